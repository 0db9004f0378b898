"""The pool's index mirror in shared memory: its table on its own (collisions, tombstones, a table that
cannot fill, a writer in another process churning under a reader), then attached processes that look
keys up in it (real processes, asyncio and uvloop) while others store, discard, evict, and die."""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from aiokvtier import AttachedPool, Pool, PoolLostError
from aiokvtier._pool._mirror import (
    CLOSED,
    ENTRY,
    HEADER,
    SEQ,
    STATE,
    USABLE,
    IndexMirror,
    capacity_for,
    hash_words,
    mirror_size,
)
from tests.pool_mirror_writer import CHURN, STABLE, key, weak_hash
from tests.test_pool import CONFIG, ENV, ROOT, WAIT, Child, attached, page, sock, until
from tests.test_pool import key as hexkey

__all__ = ["sock"]  # the fixture, used by name

pytestmark = pytest.mark.skipif(not USABLE, reason="the mirror is read only on x86-64")


def same_hash(data: npt.NDArray[np.uint8], kind: int, lengths: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    """Every key collides whole: both hashes equal for all."""
    return np.full((2, data.shape[0]), 5, dtype=np.uint64)


@pytest.fixture
def pair() -> Iterator[tuple[IndexMirror, IndexMirror]]:
    """A writer and a reader (a second mapping of the same memfd) of a mirror of 16 slots, colliding."""
    writer = IndexMirror.create(16, hasher=same_hash)
    reader = IndexMirror.attach(os.dup(writer.fd), 16, hasher=same_hash)
    yield writer, reader
    reader.close()
    writer.close()


def model_prefix(model: dict[bytes | int, tuple[int, int]], keys: Sequence[bytes | int]) -> int:
    for i, k in enumerate(keys):
        if k not in model:
            return i
    return len(keys)


def check(reader: IndexMirror, model: dict[bytes | int, tuple[int, int]], keys: list[bytes | int]) -> None:
    assert reader.lookup(keys) == model_prefix(model, keys)
    got = reader.blocks(keys)
    assert got is not None
    slots, lengths = got
    for k, slot, length in zip(keys, slots.tolist(), lengths.tolist(), strict=True):
        assert (slot, length) == model.get(k, (-1, 0)), k


def test_removals_empty_the_tombstones_that_end_a_chain(pair: tuple[IndexMirror, IndexMirror]) -> None:
    """A removal empties the entries no probe passes any more (the entry after is empty), and the
    tombstones before them in turn; one inside a chain stays, and the keys past it are still found. A table
    whose keys come and go so stays nearly empty: no rebuild (a copy of both tables) every few stores."""
    writer, reader = pair  # every key collides: one chain, in the order of the inserts
    keys: list[bytes | int] = [b"a", b"b", b"c", b"d"]
    writer.insert(keys, [0, 1, 2, 3], [10, 11, 12, 13])
    assert (writer.live, writer.used) == (4, 4)
    writer.remove_slots([1, 2])  # inside the chain: tombstones, d still found past them
    assert (writer.live, writer.used) == (2, 4)
    check(reader, {b"a": (0, 10), b"d": (3, 13)}, keys)
    writer.remove_slots([3])  # the chain's end: emptied, and the two tombstones before it
    assert (writer.live, writer.used) == (1, 1)
    check(reader, {b"a": (0, 10)}, keys)
    for round_ in range(40):  # churn: the table never fills with tombstones
        batch: list[bytes | int] = [b"%d-%d" % (round_, i) for i in range(10)]
        writer.insert(batch, list(range(1, 11)), [1] * 10)
        check(reader, {b"a": (0, 10), **{k: (i + 1, 1) for i, k in enumerate(batch)}}, [b"a", *batch])
        writer.remove_slots(list(range(1, 11)))
        assert (writer.live, writer.used) == (1, 1)
    writer.remove_slots([0])
    assert (writer.live, writer.used) == (0, 0)
    check(reader, {}, keys)


def test_colliding_keys_are_told_apart_by_their_bytes(pair: tuple[IndexMirror, IndexMirror]) -> None:
    writer, reader = pair
    keys: list[bytes | int] = [b"a", b"b", b"ab", b"", 7, -7, 2**70, b"\x07" + bytes(7)]
    model = {k: (i, 100 + i) for i, k in enumerate(keys[:4])}
    writer.insert(keys[:4], [0, 1, 2, 3], [100, 101, 102, 103])
    check(reader, model, keys)
    assert reader.lookup([b"a\x00"]) == 0 and reader.lookup([b"a"]) == 1  # a zero byte more is another key
    writer.remove_slots([1])  # b"b": a tombstone in the middle of the one chain
    del model[b"b"]
    check(reader, model, keys)
    writer.insert(keys[4:], [4, 5, 6, 7], [1, 2, 3, 4])  # ints and big ints share the chain too
    model.update({k: (4 + i, 1 + i) for i, k in enumerate(keys[4:])})
    check(reader, model, keys)
    assert reader.lookup([8, -8, 2**71, b"\x08" + bytes(7)]) == 0


@pytest.mark.parametrize("hasher", ["real", "colliding"])
def test_random_churn_matches_a_model_and_the_table_never_fills(hasher: str) -> None:
    slots = 64
    fn = hash_words if hasher == "real" else same_hash
    writer = IndexMirror.create(slots, hasher=fn)
    reader = IndexMirror.attach(os.dup(writer.fd), slots, hasher=fn)
    raw = mmap.mmap(writer.fd, HEADER)
    header = np.frombuffer(raw, dtype=np.uint64, count=8)

    def check_both(header: npt.NDArray[np.uint64], keys: list[bytes | int]) -> None:
        """The table, then the spare (what readers see while a write is in progress): the same answers."""
        check(reader, model, keys)
        header[SEQ] += np.uint64(1)
        try:
            check(reader, model, keys)
        finally:
            header[SEQ] -= np.uint64(1)

    try:
        assert writer.capacity == capacity_for(slots) >= 2 * slots
        rng = random.Random(7)
        # Short bytes, ints, big ints; keys over 32 bytes only with the real hash (told apart by it).
        universe: list[bytes | int] = (
            [b"k%d" % i for i in range(60)] + list(range(-20, 20)) + [2**64 + i for i in range(5)]
        )
        if hasher == "real":
            universe += [b"long-key-" * 5 + b"%d" % i for i in range(20)]
        model: dict[bytes | int, tuple[int, int]] = {}
        free = list(range(slots))
        for _ in range(600):
            absent = [k for k in universe if k not in model]
            add = rng.sample(absent, min(len(free), rng.randint(0, 12), len(absent)))
            taken = [free.pop() for _ in add]
            lengths = [rng.randint(1, 1 << 20) for _ in add]
            writer.insert(add, taken, lengths)
            model.update(zip(add, zip(taken, lengths, strict=True), strict=True))
            drop = rng.sample(sorted(model, key=repr), rng.randint(0, min(12, len(model))))
            writer.remove_slots([*(model[k][0] for k in drop), *free[:1]])  # a slot holding nothing is ignored
            for k in drop:
                free.append(model.pop(k)[0])
            assert writer.live == reader.live == len(model) <= slots
            check_both(header, rng.sample(universe, 30))
        # Full: every slot holds a block, and the table still has room (and answers).
        absent = [k for k in universe if k not in model]
        add = absent[: len(free)]
        writer.insert(add, list(free), [1] * len(add))
        model.update({k: (s, 1) for k, s in zip(add, free, strict=True)})
        assert reader.live == slots
        check_both(header, universe)
    finally:
        del header
        raw.close()
        reader.close()
        writer.close()


def test_a_write_in_progress_for_ever_leaves_readers_the_spare_copy() -> None:
    """An owner that died mid-write (the sequence odd, its table half written): readers answer from the
    spare copy, the table as it was before that write, and never wait for it."""
    writer = IndexMirror.create(16)
    reader = IndexMirror.attach(os.dup(writer.fd), 16)
    raw = mmap.mmap(writer.fd, mirror_size(16))
    try:
        writer.insert([b"k", b"j"], [3, 4], [10, 20])
        assert reader.lookup([b"k", b"j"]) == 2
        header = np.frombuffer(raw, dtype=np.uint64, count=8)
        table = np.frombuffer(raw, dtype=np.uint8, count=capacity_for(16) * ENTRY, offset=HEADER)
        header[SEQ] += np.uint64(1)  # as the writer leaves it between its first and last step
        table[:] = 0xAB  # whatever a write cut short left there
        assert reader.lookup([b"k", b"j"]) == 2
        slots, lengths = reader.blocks([b"k", b"j", b"x"]) or pytest.fail("no answer")
        assert slots.tolist() == [3, 4, -1] and lengths.tolist() == [10, 20, 0]
        header[SEQ] += np.uint64(1)  # the table is the readers' copy again: what is in it now is answered
        assert reader.lookup([b"k"]) == 0
        writer.mark_closed()  # the owner closed the pool: readers send lookups to it (and learn it closed)
        assert reader.lookup([b"k"]) is None and reader.blocks([b"k"]) is None
        del header, table
    finally:
        raw.close()
        reader.close()
        writer.close()


def test_a_read_that_a_write_spoiled_is_done_over_and_counted() -> None:
    """Lookups while a writer churns on another thread: every answer is right, and the reads done over
    are counted (``counted`` gets ``(answers, hits, misses, retries)``)."""
    writer = IndexMirror.create(1 << 16)
    reader = IndexMirror.attach(os.dup(writer.fd), 1 << 16)
    stable = [b"s%d" % i for i in range(20_000)]
    writer.insert(stable, np.arange(20_000), np.ones(20_000, dtype=np.int64))
    stop = threading.Event()

    def churn() -> None:
        churned = [b"c%d" % i for i in range(4096)]
        while not stop.is_set():
            writer.insert(churned, np.arange(20_000, 24_096), np.ones(4096, dtype=np.int64))
            writer.remove_slots(np.arange(20_000, 24_096))

    told: list[tuple[int, int, int, int]] = []
    thread = threading.Thread(target=churn)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the threads take turns within a read
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not any(t[3] for t in told) and time.monotonic() < deadline:
            assert reader.lookup(stable, {bytes}, told.append) in (20_000, None)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(switch)
        reader.close()
        writer.close()
    assert any(t[3] for t in told), "no read was spoiled by a write"
    assert all(t == (1, 20_000, 0, t[3]) or t == (0, 0, 0, t[3]) for t in told)


def test_attach_refuses_memory_that_is_not_a_mirror() -> None:
    fd = os.memfd_create("not-a-mirror")
    os.ftruncate(fd, mirror_size(16))
    with pytest.raises(ValueError, match="not its index mirror"):
        IndexMirror.attach(fd, 16)  # right size, no header
    writer = IndexMirror.create(16)
    try:
        with pytest.raises(ValueError, match="not of the size"):
            IndexMirror.attach(os.dup(writer.fd), 32)
        with pytest.raises(ValueError, match="bad slot count"):
            IndexMirror.attach(os.dup(writer.fd), 0)
    finally:
        writer.close()
    with pytest.raises(ValueError, match="positive int"):
        IndexMirror.create(0)


def test_a_writer_in_another_process_churning_never_gives_a_false_hit_or_a_torn_block() -> None:
    """The writer (tests/pool_mirror_writer.py) inserts, removes and rebuilds for two seconds, every key in
    a few collision chains; every answer this process reads is one the table held at some moment."""
    slots = STABLE + CHURN
    writer = IndexMirror.create(slots, hasher=weak_hash)
    reader = IndexMirror.attach(os.dup(writer.fd), slots, hasher=weak_hash)
    stable = [key("s", i) for i in range(STABLE)]
    churn = [key("c", i) for i in range(STABLE, STABLE + CHURN)]
    never = [key("n", i) for i in range(STABLE + CHURN)]
    writer.insert(stable, list(range(STABLE)), [7000 + i for i in range(STABLE)])
    child = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "pool_mirror_writer.py"), str(writer.fd), str(slots), "2", "1"],
        pass_fds=[writer.fd],
        stdout=subprocess.PIPE,
        env=ENV,
    )
    reads = gave_up = seen = 0
    try:
        while child.poll() is None:
            reads += 1
            assert reader.lookup(stable) in (STABLE, None)
            assert reader.lookup(never) in (0, None)
            got = reader.blocks(stable + churn + never)
            if got is None:
                gave_up += 1
                continue
            slots_, lengths = got
            assert slots_[:STABLE].tolist() == list(range(STABLE))
            assert lengths[:STABLE].tolist() == [7000 + i for i in range(STABLE)]
            assert (slots_[STABLE + CHURN :] == -1).all()
            part = slice(STABLE, STABLE + CHURN)
            churned = zip(slots_[part].tolist(), lengths[part].tolist(), strict=True)
            for i, (slot, length) in enumerate(churned):
                if slot >= 0:  # present: its own slot, and a length of one of its own insertions
                    seen += 1
                    assert slot == STABLE + i and length % 1000 == STABLE + i and length > 1000, (slot, length)
        out, _ = child.communicate(timeout=30)
        assert child.returncode == 0
        writes = json.loads(out)["writes"]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        reader.close()
        writer.close()
    assert writes > 100 and reads > 20 and seen > 0
    assert gave_up < reads  # most reads are answered


# -- attached processes ----------------------------------------------------------------------------


def b(keys: list[str]) -> list[bytes]:
    return [bytes.fromhex(k) for k in keys]


async def test_lookups_see_what_other_processes_stored_discarded_and_evicted(sock: str) -> None:
    keys = [hexkey(i) for i in range(1024)]  # the whole pool (64 MiB of 64 KiB slots)
    async with Pool(CONFIG, sock) as pool, attached(sock) as a, AttachedPool(sock) as reader:
        await a.event("attached")
        assert await reader.lookup(b(keys)) == 0
        assert (await a.call("store", keys=keys, size=4096))["skipped"] == 0
        assert await reader.lookup(b(keys)) == 1024  # once the store returned, without asking the owner
        assert (await a.call("discard", keys=keys[100:101]))["dropped"] == 1
        assert await reader.lookup(b(keys)) == 100
        assert await reader.lookup(b(keys[101:])) == 923
        # A third process stores 16 more: the pool is full, so 15 blocks are evicted (keys[100] left a slot).
        async with AttachedPool(sock) as c:
            new = [hexkey(i) for i in range(5000, 5016)]
            assert len((await c.store(b(new), [page(k, 4096) for k in new])).stored) == 16
        s = pool.statistics()
        assert s.evictions == 15 and s.blocks == 1024
        gone = [k for k in keys if k != keys[100] and await reader.lookup(b([k])) == 0]
        assert len(gone) == 15
        assert await reader.lookup(b(new)) == 16
        assert (await reader.statistics()).evictions == 15


async def test_a_block_being_stored_is_not_a_hit_until_its_store_commits(sock: str) -> None:
    keys = [hexkey(i) for i in range(8)]
    async with Pool(CONFIG, sock), attached(sock) as a, AttachedPool(sock) as reader:
        await a.event("attached")
        await a.call("hold")
        storing = a.send("store", keys=keys, size=4096)
        await a.event("copying")  # claimed, slots taken, the copy under way
        assert await reader.lookup(b(keys)) == 0
        await a.call("release")
        assert (await a.answer(storing))["stored"] == keys
        assert await reader.lookup(b(keys)) == 8


async def test_blocks_attached_processes_look_up_are_evicted_last(sock: str) -> None:
    """Their hits mark the blocks referenced; the owner's eviction passes over those once (CLOCK)."""
    old = [hexkey(i) for i in range(512)]
    young = [hexkey(i) for i in range(512, 1024)]
    async with Pool(CONFIG, sock), attached(sock) as a, AttachedPool(sock) as reader:
        await a.event("attached")
        assert (await a.call("store", keys=old, size=4096))["skipped"] == 0
        assert (await a.call("store", keys=young, size=4096))["skipped"] == 0
        assert await reader.lookup(b(old)) == 512  # the least recently stored, looked up elsewhere
        new = [hexkey(i) for i in range(5000, 5016)]
        assert (await a.call("store", keys=new, size=4096))["skipped"] == 0
        assert await reader.lookup(b(old)) == 512
        assert await reader.lookup(b(young)) == 0 and await reader.lookup(b(young[16:])) == 496


async def test_lookup_counts_carried_by_a_request_are_counted_and_malformed_ones_ignored(sock: str) -> None:
    """An attached process tells its mirror lookups' counts with its next request (a frame less than a
    ``LOOKED`` of their own): the owner counts them before serving it; figures that are not counts are
    ignored, and the request is served all the same."""
    from aiokvtier._pool import _wire

    async with Pool(CONFIG, sock) as pool:
        reader, writer = await asyncio.open_unix_connection(sock)
        writer.write(_wire.encode(_wire.HELLO, 0, {"v": _wire.VERSION}))

        async def answer(rid: int) -> _wire.Message:
            async with asyncio.timeout(WAIT):
                while True:
                    head = await reader.readexactly(4)
                    message = _wire.decode(await reader.readexactly(_wire.LENGTH.unpack(head)[0]))
                    if message.op == _wire.REPLY and message.rid == rid:
                        return message

        try:
            for rid, looked in enumerate(({"q": -1, "h": 1}, "x", [1, 2], {"q": 2**70}), start=1):
                writer.write(_wire.encode(_wire.STATS, rid, {"looked": looked}))
                assert "stats" in (await answer(rid)).fields
            s = pool.statistics()
            assert (s.queries, s.hits, s.misses, s.mirror_retries) == (0, 0, 0, 0)
            writer.write(_wire.encode(_wire.STATS, 9, {"looked": {"q": 2, "h": 5, "m": 1, "r": 3}}))
            told = (await answer(9)).fields["stats"]  # counted before the request was served
            assert (told["queries"], told["hits"], told["misses"], told["mirror_retries"]) == (2, 5, 1, 3)
        finally:
            writer.close()


async def test_lookups_answered_in_the_process_are_counted_by_the_owner(sock: str) -> None:
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as reader:
        await reader.store([b"a", b"b"], [b"x", b"y"])
        assert await reader.lookup([b"a", b"b", b"c", b"a"]) == 2
        assert await reader.lookup([b"c"]) == 0
        assert await reader.lookup([]) == 0
        s = await reader.statistics()  # after the counts: one connection is one order
        assert (s.queries, s.hits, s.misses) == (3, 2, 3)
        s = pool.statistics()
        assert (s.queries, s.hits, s.misses) == (3, 2, 3)


async def test_keys_the_mirror_cannot_answer_go_to_the_owner(sock: str) -> None:
    """A mirror that cannot answer (here marked closed, as the owner marks it when it closes): lookups ask
    the owner, get its answer, and the owner counts them apart."""
    older = frozenset(await asyncio.to_thread(os.listdir, "/proc/self/fd"))
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as reader:
        await reader.store([b"a", b"b"], [b"x", b"y"])
        raw = await asyncio.to_thread(open_mirror, os.getpid(), older)
        try:
            header = np.frombuffer(raw, dtype=np.uint64, count=8)
            header[STATE] = CLOSED  # as the owner marks it when it closes: readers ask it
            assert await reader.lookup([b"a", b"b", b"c"]) == 2  # from the owner
            header[STATE] = 0
            del header
        finally:
            raw.close()
        assert await reader.lookup([b"a"]) == 1
        s = pool.statistics()  # the owner's own count; the mirror's comes with the next request
        assert (s.queries, s.owner_lookups) == (1, 1)
        s = await reader.statistics()
        assert (s.queries, s.owner_lookups, s.mirror_retries) == (2, 1, 0)


def open_mirror(pid: int, older: frozenset[str] = frozenset()) -> mmap.mmap:
    """The header of the index mirror that process ``pid`` holds (its memfd, opened again through /proc).
    ``older``: descriptors open before the pool was (this process's own: an earlier test's mirror may
    stay open until the garbage collector's next pass)."""
    for name in os.listdir(f"/proc/{pid}/fd"):
        if name in older:
            continue
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("/memfd:aiokvtier-pool-index"):
            fd = os.open(f"/proc/{pid}/fd/{name}", os.O_RDWR)
            try:
                return mmap.mmap(fd, HEADER)
            finally:
                os.close(fd)
    raise AssertionError(f"process {pid} holds no index mirror")


@pytest.mark.parametrize("mid_write", [False, True])
async def test_the_owner_dying_mid_lookup_is_an_answer_or_a_clear_error(sock: str, mid_write: bool) -> None:
    owner = await Child.start("pool_owner.py", sock, "64MiB")
    try:
        serving = await owner.event("serving")
        async with AttachedPool(sock) as reader:
            keys = [b"%d" % i for i in range(256)]
            await reader.store(keys, [b"v"] * 256)
            raw = await asyncio.to_thread(open_mirror, serving["pid"]) if mid_write else None
            if raw is not None:
                seq = np.frombuffer(raw, dtype=np.uint64, count=1)
                seq[SEQ] += np.uint64(1)  # the owner dies between its first and last step of a write
                del seq
                raw.close()
            answers: list[int] = []

            async def look() -> None:
                while True:
                    answers.append(await reader.lookup(keys))
                    await asyncio.sleep(0)

            looking = asyncio.ensure_future(look())
            await asyncio.sleep(0.05)
            await owner.kill()
            async with asyncio.timeout(WAIT):
                with pytest.raises(PoolLostError, match="owner"):
                    await looking
            assert answers and set(answers) == {256}
    finally:
        await owner.close()


async def test_a_pool_churned_past_its_table_keeps_answering(sock: str) -> None:
    """Every slot holds a block, then all are discarded and stored again, over and over: tombstones pile
    up past the table's capacity and it is rebuilt; the attached process's answers stay the owner's."""
    async with Pool(CONFIG, sock) as pool, attached(sock) as a, AttachedPool(sock) as reader:
        await a.event("attached")
        for round_ in range(4):
            keys = [hexkey(round_ * 10000 + i) for i in range(1024)]
            assert (await a.call("store", keys=keys, size=4096))["skipped"] == 0
            assert await reader.lookup(b(keys)) == 1024
            assert (await a.call("discard", keys=keys))["dropped"] == 1024
            assert await reader.lookup(b(keys)) == 0
        assert pool.statistics().blocks == 0
        await until(lambda: pool.statistics().tier.slots_allocated == 0, "every slot back")


@pytest.mark.parametrize("hasher", ["real", "colliding"])
def test_a_key_hashes_the_same_alone_in_a_batch_of_its_length_or_among_others(hasher: str) -> None:
    fn = hash_words if hasher == "real" else same_hash
    writer = IndexMirror.create(16, hasher=fn)
    reader = IndexMirror.attach(os.dup(writer.fd), 16, hasher=fn)
    try:
        stored: list[bytes | int] = [b"ab", b"abc\x00", b"\x00", b"x" * 33, 5, 2**65]
        writer.insert(stored, list(range(6)), [1] * 6)  # one batch of every kind and length
        for k in stored:
            assert reader.lookup([k]) == 1, k
        assert reader.lookup([b"ab", b"abc\x00", b"\x00", b"x" * 33]) == 4  # bytes of several lengths
        assert reader.lookup([b"ab", b"ac", b"abc\x00"]) == 1  # one length
        assert reader.lookup([5, 2**65, b"ab"]) == 3
        # What differs only by length, and an int's bytes (not that int): each a miss.
        for k in (b"abc", b"\x00\x00", b"", b"ab\x00", 6, b"x" * 32, b"x" * 34, b"\x05" + bytes(7)):
            assert reader.lookup([k]) == 0, k
    finally:
        reader.close()
        writer.close()


async def test_a_store_or_a_discard_is_seen_whole_by_lookups_meanwhile(sock: str) -> None:
    """The owner writes a commit's blocks, or a discard's, in one write: a lookup in another process sees
    all of them or none, never part."""
    keys = [hexkey(i) for i in range(512)]
    async with Pool(CONFIG, sock), attached(sock) as a, AttachedPool(sock) as reader:
        await a.event("attached")
        seen: set[int] = set()
        done = asyncio.Event()

        async def look() -> None:
            while not done.is_set():
                seen.add(await reader.lookup(b(keys)))
                await asyncio.sleep(0)

        looking = asyncio.ensure_future(look())
        try:
            for _ in range(10):
                assert (await a.call("store", keys=keys, size=64))["skipped"] == 0
                assert (await a.call("discard", keys=keys))["dropped"] == 512
        finally:
            done.set()
            await looking
        assert seen == {0, 512}


async def test_a_pool_without_a_mirror_asks_its_owner(sock: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier whose slots do not fit an entry's 32 bits (made to look so here) has no mirror: its
    processes attach with the tier's memfd alone, and their lookups ask the owner."""
    from aiokvtier._pool import _owner

    monkeypatch.setattr(_owner, "mirror_fits", lambda slots, slot_size: False)
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as reader:
        await reader.store([b"a"], [b"x"])
        assert await reader.lookup([b"a", b"b"]) == 1
        s = pool.statistics()  # counted by the owner as it answered: no message to wait for
        assert (s.queries, s.hits, s.misses) == (1, 1, 1)


def test_removal_by_slot_matches_a_model_through_rebuilds() -> None:
    """The owner removes blocks by slot (its own record of where each slot's entry lies, no hashing):
    random inserts and removals, enough to rebuild the table many times, give the reader exactly the
    model's answers and live count."""
    rng = np.random.default_rng(7)
    slots = 64
    writer = IndexMirror.create(slots)
    reader = IndexMirror.attach(os.dup(writer.fd), slots)
    try:
        model: dict[bytes | int, tuple[int, int]] = {}
        free = list(range(slots))
        serial = 0
        for _ in range(400):
            if free and (not model or rng.random() < 0.55):
                n = int(rng.integers(1, min(len(free), 9) + 1))
                taken = [free.pop(int(rng.integers(len(free)))) for _ in range(n)]
                keys: list[bytes | int] = []
                for _ in taken:
                    serial += 1
                    keys.append(serial if serial % 3 == 0 else b"key-%d" % serial)
                lengths = [int(x) for x in rng.integers(1, 1 << 20, n)]
                writer.insert(keys, taken, lengths)
                model.update(zip(keys, zip(taken, lengths, strict=True), strict=True))
            else:
                victims = list(model)[: int(rng.integers(1, len(model) + 1))]
                gone = [model.pop(k)[0] for k in victims]
                writer.remove_slots([*gone, *free[:2]])  # slots holding nothing are ignored
                free.extend(gone)
            assert writer.live == len(model)
            probe = [*model, b"never", 10**9]
            check(reader, model, probe)
        writer.remove_slots([])
    finally:
        reader.close()
        writer.close()


def end_hash(data: npt.NDArray[np.uint8], kind: int, lengths: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    """Homes in the table's last four entries, whatever its size: every chain wraps to its start."""
    h = weak_hash(data, kind, lengths)
    h[0] = np.uint64(2**64 - 1) - h[0] % np.uint64(4)
    return h


@pytest.mark.parametrize("hasher", ["real", "weak", "end"])
def test_large_batches_are_placed_as_key_by_key_inserts_through_rebuilds(hasher: str) -> None:
    """Batches of hundreds of keys (placed in rounds, then the last few one by one) and single keys give a
    reader exactly the model's answers, and the same answers as a mirror fed the same keys one at a time,
    through clusters of colliding homes (the weak hash), chains wrapping past the table's end, and
    rebuilds (each placing the live keys in the order of their homes)."""
    fn = {"real": hash_words, "weak": weak_hash, "end": end_hash}[hasher]
    rng = np.random.default_rng(11)
    slots = 1024
    batched, single = IndexMirror.create(slots, hasher=fn), IndexMirror.create(slots, hasher=fn)
    reader = IndexMirror.attach(os.dup(batched.fd), slots, hasher=fn)
    try:
        model: dict[bytes | int, tuple[int, int]] = {}
        free = list(range(slots))
        serial = 0
        for _ in range(40):
            n = min(len(free), int(rng.choice([1, 31, 33, 200, 700])))
            taken = [free.pop(int(rng.integers(len(free)))) for _ in range(n)]
            keys: list[bytes | int] = []
            for _ in taken:
                serial += 1
                keys.append(serial if serial % 4 == 0 else b"batch-%d" % serial)
            lengths = [int(x) for x in rng.integers(1, 1 << 20, n)]
            batched.insert(keys, taken, lengths)
            for k, s, length in zip(keys, taken, lengths, strict=True):
                single.insert([k], [s], [length])
            model.update(zip(keys, zip(taken, lengths, strict=True), strict=True))
            assert reader.live == single.live == len(model)
            probe = [*model, b"never", 10**9]
            check(reader, model, probe)
            assert np.array_equal(reader.blocks(probe), single.blocks(probe))  # type: ignore[arg-type]
            victims = [k for k in model if rng.random() < 0.6]
            gone = [model.pop(k)[0] for k in victims]
            batched.remove_slots(gone)
            single.remove_slots(gone)
            free.extend(gone)
            check(reader, model, [*model, *victims[:50]])
    finally:
        reader.close()
        batched.close()
        single.close()


@pytest.mark.parametrize(
    "keys",
    [
        [b"fixed-%05d" % i for i in range(300)],  # one length: the "f" form
        [b"%d-%d-" % (4242, i) for i in range(300)],  # a few lengths: records
        [b"%d-\x00" % i for i in range(300)],  # ending in a zero byte: no matrix, the keys themselves
        [b"k" * (i % 40 + 1) for i in range(300)],  # far apart: no matrix
    ],
)
def test_keys_inserted_from_their_wire_matrix_are_found_as_keys(keys: list[bytes]) -> None:
    """The owner inserts a store's keys from the matrix their frame was decoded through: a process looking
    up the same keys as bytes (hashed from its own padding) finds each at its slot."""
    from aiokvtier._pool import _wire

    kind, parts = _wire.encode_keys(keys)
    decoded, matrix = _wire.decode_key_matrix(kind, parts)
    assert decoded == keys
    writer = IndexMirror.create(512)
    reader = IndexMirror.attach(os.dup(writer.fd), 512)
    try:
        half = slice(0, None, 2)  # a subset of the rows, as a store with keys present claims
        chosen = decoded[half]
        rows = None if matrix is None else (matrix[0][half], matrix[1][half])
        writer.insert(chosen, list(range(len(chosen))), [7] * len(chosen), {bytes}, rows)
        model = {k: (i, 7) for i, k in enumerate(chosen)}
        check(reader, model, keys)
    finally:
        reader.close()
        writer.close()


def test_a_spare_catch_up_that_fails_leaves_the_spare_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spare's catch-up after a write gathers the changed entries (memory for a temporary): where that
    fails, the spare is copied whole in place, so readers during later writes never see old entries."""
    from aiokvtier._pool import _mirror

    writer = IndexMirror.create(16)
    reader = IndexMirror.attach(os.dup(writer.fd), 16)
    raw = mmap.mmap(writer.fd, HEADER)
    real_take = np.take

    def failing_take(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("no room for the gather")

    try:
        writer.insert([b"a"], [1], [10])
        monkeypatch.setattr(_mirror.np, "take", failing_take)
        with pytest.raises(MemoryError):
            writer.insert([b"b", b"c"], [2, 3], [20, 30])
        monkeypatch.setattr(_mirror.np, "take", real_take)
        header = np.frombuffer(raw, dtype=np.uint64, count=8)
        assert header[SEQ] % 2 == 0  # the write ended: readers read the table
        assert reader.lookup([b"a", b"b", b"c"]) == 3
        header[SEQ] += np.uint64(1)  # as during a later write: readers read the spare
        try:
            assert reader.lookup([b"a", b"b", b"c"]) == 3
            slots, lengths = reader.blocks([b"a", b"b", b"c"]) or pytest.fail("no answer")
            assert slots.tolist() == [1, 2, 3] and lengths.tolist() == [10, 20, 30]
        finally:
            header[SEQ] -= np.uint64(1)
        del header
    finally:
        raw.close()
        reader.close()
        writer.close()
