"""Attacks on the index mirror's reads from any thread (``AttachedPool.lookup_nowait``): a close, an owner
killed or restarted, stores, discards and evictions by other processes, all while threads look up in a
loop; hostile keys; the lookup counts told to the owner (real processes, asyncio and uvloop)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable

import numpy as np
import pytest

from aiokvtier import AttachedPool, Pool, PoolLostError
from aiokvtier._pool._mirror import CHUNK, CLOSED, STATE, USABLE, IndexMirror
from tests.test_pool import CONFIG, Child, attached, sock, until
from tests.test_pool import key as hexkey
from tests.test_pool_index_batch import mirror_mappings
from tests.test_pool_index_shm import open_mirror

__all__ = ["sock"]  # the fixture, used by name

pytestmark = pytest.mark.skipif(not USABLE, reason="the mirror is read only on x86-64")

HUGE = 10**5000
"""An int key too long for the decimal text a pool carries it as: the lookup raises while it reads."""
TOO_LONG = "int key of 16610 bits has more digits than Python converts"


def b(keys: list[str]) -> list[bytes]:
    return [bytes.fromhex(k) for k in keys]


async def mappings() -> int:
    return await asyncio.to_thread(mirror_mappings)


class Lookers:
    """``n`` threads calling ``lookup`` in a loop until ``stop()``, each keeping its answers in order (an
    exception a call raised ends that thread and is kept)."""

    def __init__(self, n: int, lookup: Callable[[int], int | None]) -> None:
        self.answers: list[list[int | None]] = [[] for _ in range(n)]
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i, lookup), name=f"looker-{i}", daemon=True) for i in range(n)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, i: int, lookup: Callable[[int], int | None]) -> None:
        seen = self.answers[i]
        try:
            while not self._stop.is_set():
                seen.append(lookup(len(seen)))
        except BaseException as exc:
            self.errors.append(exc)

    def counts(self) -> list[int]:
        """Each thread's answers that were not None, so far."""
        return [sum(a is not None for a in seen) for seen in self.answers]

    def each_answered(self, n: int, since: list[int] | None = None) -> bool:
        assert not self.errors, self.errors
        return all(c >= n + (since[i] if since else 0) for i, c in enumerate(self.counts()))

    def lengths(self) -> list[int]:
        return [len(seen) for seen in self.answers]

    def each_saw(self, answer: int | None, since: list[int]) -> bool:
        """Whether every thread got ``answer`` after its first ``since[i]`` calls."""
        assert not self.errors, self.errors
        return all(answer in seen[since[i] :] for i, seen in enumerate(self.answers))

    async def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            await asyncio.to_thread(thread.join, 30.0)
            assert not thread.is_alive()

    def given(self) -> list[int]:
        return [a for seen in self.answers for a in seen if a is not None]


def attached_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "aiokvtier-attached"]


# -- a read that raises ----------------------------------------------------------------------------


def test_a_lookup_that_raises_while_it_reads_does_not_keep_the_mirror_mapped() -> None:
    """The error's traceback (kept, as a logger or a caller may) holds no view of the mapping: the close
    unmaps, here and under other threads' reads that raise."""
    writer = IndexMirror.create(64)
    before = mirror_mappings()
    reader = IndexMirror.attach(os.dup(writer.fd), 64)
    try:
        writer.insert([b"a", 5], [0, 1], [1, 1])
        with pytest.raises(ValueError, match=TOO_LONG) as caught:
            reader.lookup([b"a", HUGE])
        assert reader.lookup([b"a", 5]) == 2
        reader.close()  # the exception and its traceback are still alive here
        assert caught.value.__traceback__ is not None
        assert mirror_mappings() == before
        # Again with threads raising on the mirror while it is closed under them.
        reader = IndexMirror.attach(os.dup(writer.fd), 64)
        kept: list[BaseException] = []
        started = threading.Barrier(5)

        def fail() -> None:
            started.wait()
            while True:
                try:
                    if reader.lookup([b"a", HUGE]) is None:
                        return
                except ValueError as exc:
                    kept.append(exc)

        threads = [threading.Thread(target=fail) for _ in range(4)]
        for thread in threads:
            thread.start()
        started.wait()
        while len(kept) < 40:
            pass
        reader.close()
        for thread in threads:
            thread.join()
        assert all(isinstance(exc, ValueError) for exc in kept)
        assert mirror_mappings() == before
    finally:
        reader.close()
        writer.close()


async def test_an_attached_pool_closes_after_a_lookup_raised_on_its_mirror(sock: str) -> None:
    before = await mappings()
    async with Pool(CONFIG, sock) as pool:
        reader = await AttachedPool.attach(sock)
        try:
            await reader.store([b"a"], [b"x"])
            with pytest.raises(ValueError, match=TOO_LONG) as caught:
                await asyncio.to_thread(reader.lookup_nowait, [b"a", HUGE])
            with pytest.raises(ValueError, match=TOO_LONG):
                await reader.lookup([b"a", HUGE])
            assert reader.lookup_nowait([b"a"]) == 1
            with pytest.raises(ValueError, match=TOO_LONG):
                await reader.store([b"b", HUGE], [b"x", b"y"])
            assert reader.lookup_nowait([b"b"]) == 0  # nothing of it stored
        finally:
            await reader.aclose()  # the error is alive, its frames were cleared
        assert caught.value is not None
        assert await mappings() == before + 1  # the owner's own mapping
        assert pool.statistics().queries == 2  # the failed calls counted nothing


# -- close, owner death and restart under threads looking up -------------------------------------------


async def test_aclose_under_threads_looking_up_counts_every_answer_and_returns_unmapped(sock: str) -> None:
    keys = [bytes.fromhex(hexkey(i)) for i in range(300)]
    array = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(300, 16)
    before = await mappings()
    async with Pool(CONFIG, sock) as pool:
        reader = await AttachedPool.attach(sock)
        await reader.store(keys, [b"v"] * 300)
        lookers = Lookers(4, lambda i: reader.lookup_nowait(keys if i % 2 else array))
        try:
            await until(lambda: lookers.each_answered(50), "every thread answered")
            await reader.aclose()
            # At once: no thread still reads the mapping, and the calls that follow say closed.
            assert await mappings() == before + 1  # the owner's
            assert not attached_threads()
            marks = lookers.lengths()
            await until(lambda: lookers.each_saw(None, marks), "later calls say closed")
        finally:
            await lookers.stop()
            await reader.aclose()
        assert not lookers.errors
        given = lookers.given()
        assert set(given) == {300}
        for seen in lookers.answers:
            first = seen.index(None)
            assert all(a is None for a in seen[first:])  # closed is for good
        # Every answer a thread was given is counted, none more: told before the connection ended.
        await until(lambda: pool.statistics().queries == len(given), f"{len(given)} lookups counted")
        s = pool.statistics()
        assert (s.hits, s.misses) == (300 * len(given), 0)


@pytest.mark.parametrize(("refusing", "end"), [(False, "kill"), (True, "kill"), (False, "close")])
async def test_an_owner_killed_then_restarted_under_threads_looking_up(sock: str, refusing: bool, end: str) -> None:
    """Each call answers the stored prefix, or None: while the mirror refuses every read, and from the
    loss on (the owner killed, or closing the pool: for good, the pool does not follow a restarted owner);
    a new attach finds the new owner."""
    keys = [b"%d" % i for i in range(256)]
    before = await mappings()
    owner = await Child.start("pool_owner.py", sock, "64MiB")
    try:
        serving = await owner.event("serving")
        reader = await AttachedPool.attach(sock)
        await reader.store(keys, [b"v"] * 256)
        lookers = Lookers(4, lambda i: reader.lookup_nowait(keys))

        async def none_from_now() -> None:
            marks = lookers.lengths()
            await until(lambda: lookers.each_saw(None, marks), "None from each thread")

        try:
            await until(lambda: lookers.each_answered(20), "answers")
            if refusing:
                raw = await asyncio.to_thread(open_mirror, serving["pid"])
                header = np.frombuffer(raw, dtype=np.uint64, count=8)
                header[STATE] = CLOSED  # the mirror refuses every read, as once the owner closes
                del header
                raw.close()
                await none_from_now()
                assert await reader.lookup(keys) == 256  # the owner answers
            await (owner.kill() if end == "kill" else owner.close())
            with pytest.raises(PoolLostError):
                async with asyncio.timeout(30):
                    while True:
                        await reader.lookup(keys)
                        await asyncio.sleep(0.001)
            await none_from_now()
            owner = await Child.start("pool_owner.py", sock, "64MiB")
            await owner.event("serving")
            async with AttachedPool(sock) as fresh:
                assert fresh.lookup_nowait(keys) == 0
                await fresh.store(keys[:10], [b"w"] * 10)
                assert await asyncio.to_thread(fresh.lookup_nowait, keys) == 10
                await none_from_now()  # the first pool stays lost
        finally:
            await reader.aclose()
            await lookers.stop()
        assert not lookers.errors
        assert set(lookers.given()) == {256}
        assert await mappings() == before
        assert not attached_threads()
    finally:
        await owner.close()


# -- other processes writing under the reads ---------------------------------------------------------


async def test_stores_and_discards_elsewhere_are_seen_as_a_stored_prefix_of_some_instant(sock: str) -> None:
    """Another process stores 64 keys a commit, in order, then discards them a commit at a time from the
    end: the stored keys are always a prefix of a multiple of 64, and every answer is one of those. A
    store whose copy is held is never seen; an eviction takes them all at once, for good."""
    keys = [hexkey(i) for i in range(512)]
    raw = b(keys)
    array = np.frombuffer(b"".join(raw), dtype=np.uint8).reshape(512, 16)
    async with Pool(CONFIG, sock), attached(sock) as a, AttachedPool(sock) as reader:
        await a.event("attached")
        lookers = Lookers(3, lambda i: reader.lookup_nowait(raw if i % 2 else array))
        try:
            for _ in range(3):
                for start in range(0, 512, 64):
                    assert (await a.call("store", keys=keys[start : start + 64], size=64))["skipped"] == 0
                for start in range(448, -1, -64):
                    assert (await a.call("discard", keys=keys[start : start + 64]))["dropped"] == 64
            for start in range(0, 448, 64):
                assert (await a.call("store", keys=keys[start : start + 64], size=64))["skipped"] == 0
            # A store whose copy has not landed: its keys are never a hit.
            await a.call("hold")
            held = a.send("store", keys=keys[448:], size=64)
            await a.event("copying")
            marks = lookers.counts()
            await until(lambda: lookers.each_answered(20, since=marks), "answers while the copy is held")
            assert reader.lookup_nowait(raw) == 448
            await a.call("release")
            assert (await a.answer(held))["skipped"] == 0
            assert reader.lookup_nowait(raw) == 512
        finally:
            await lookers.stop()
        assert not lookers.errors
        assert set(lookers.given()) <= set(range(0, 513, 64))
        # Evictions: 1,024 other keys in one store take every slot, the looked-up keys too (their marks
        # spare them for one pass of the scan, which finds nothing else to take).
        lookers = Lookers(3, lambda i: reader.lookup_nowait(raw if i % 2 else array))
        try:
            others = [hexkey(10_000 + i) for i in range(1024)]
            assert (await a.call("store", keys=others, size=64))["skipped"] == 0
            assert reader.lookup_nowait(raw) == 0
            assert reader.lookup_nowait(b(others)) == 1024
        finally:
            await lookers.stop()
        assert not lookers.errors
        for seen in lookers.answers:
            got = [x for x in seen if x is not None]
            assert set(got) <= {0, 512} and got == sorted(got, reverse=True)  # evicted keys never come back


async def test_a_miss_past_the_first_chunk_marks_only_the_prefix_referenced(sock: str) -> None:
    """100,000 keys from threads (a list and an array): the prefix ends in the second chunk; only its
    blocks are marked referenced, so an eviction spares them and takes the stored keys after the miss."""
    config = {"quota": "64MiB", "max_quota": "64MiB", "slot_size": "4KiB"}  # 16,384 slots
    keys = [b"k%09d" % i for i in range(100_000)]
    array = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(100_000, 10)
    prefix = CHUNK + 1000
    async with Pool(config, sock) as pool, AttachedPool(sock) as reader:
        stored = keys[:prefix] + keys[prefix + 1 : prefix + 2001]  # 2,000 after the miss
        for start in range(0, len(stored), 4096):
            part = stored[start : start + 4096]
            assert not (await reader.store(part, [b"v"] * len(part))).skipped
        assert await asyncio.to_thread(reader.lookup_nowait, keys) == prefix
        assert await asyncio.to_thread(reader.lookup_nowait, array) == prefix
        free = pool.statistics().tier.slots_free
        # Room for 2,000 more than is free: the LRU order would take the oldest (the prefix); the marks send
        # the scan past them to the 2,000 stored after the miss.
        flood = [b"f%09d" % i for i in range(free + 2000)]
        for start in range(0, len(flood), 4096):
            part = flood[start : start + 4096]
            assert not (await reader.store(part, [b"v"] * len(part))).skipped
        assert pool.statistics().evictions == 2000
        assert reader.lookup_nowait(keys[:prefix]) == prefix
        assert reader.lookup_nowait(keys[prefix + 1 : prefix + 2001]) == 0


# -- hostile keys and the counts --------------------------------------------------------------------------


HOSTILE: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    ("a bool", lambda: [b"a", True], TypeError, "not a bool"),
    ("a numpy bool", lambda: [np.bool_(False)], TypeError, "not a bool"),
    ("a str key", lambda: ["a"], TypeError, "not str"),
    ("a str", lambda: "abc", TypeError, "not one key"),
    ("bytes", lambda: b"abc", TypeError, "not one key"),
    ("an int", lambda: 5, TypeError, "not one key"),
    ("a float", lambda: [b"a", 1.0], TypeError, "not float"),
    ("None in keys", lambda: [b"a", None], TypeError, "not NoneType"),
    ("None", lambda: None, TypeError, "not iterable"),
    ("a 1-D array", lambda: np.zeros(16, np.uint8), TypeError, "not 1-D uint8"),
    ("a 3-D array", lambda: np.zeros((2, 2, 4), np.uint8), TypeError, "not 3-D uint8"),
    ("an int16 array", lambda: np.zeros((2, 8), np.int16), TypeError, "not 2-D int16"),
    ("a bool array", lambda: np.zeros((2, 8), np.bool_), TypeError, "not 2-D bool"),
    ("an object array", lambda: np.array([b"a", b"b"], dtype=object), TypeError, "not 1-D object"),
]


@pytest.mark.parametrize("case", HOSTILE, ids=[c[0] for c in HOSTILE])
async def test_hostile_keys_are_refused_by_name_and_count_nothing(sock: str, case: tuple) -> None:
    _, make, error, match = case
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as reader:
        await reader.store([b"a"], [b"x"])
        assert pool.statistics().queries == 0
        with pytest.raises(error, match=match):
            await asyncio.to_thread(reader.lookup_nowait, make())
        with pytest.raises(error, match=match):
            await reader.lookup(make())  # type: ignore[arg-type]
        assert (await reader.statistics()).queries == 0


async def test_odd_but_valid_keys_answer_as_the_owner_does(sock: str) -> None:
    big = b"x" * 100_000
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as reader:
        stored = [b"", big, 2**70, -1, b"\x00" * 40]
        assert not (await reader.store(stored, [b"v"] * len(stored))).skipped
        fortran = np.asfortranarray(np.frombuffer(b"\x00" * 80, dtype=np.uint8).reshape(2, 40))
        cases: list[tuple[object, int]] = [
            ([], 0),
            ([b""], 1),
            (np.zeros((1, 0), np.uint8), 1),
            (np.zeros((0, 16), np.uint8), 0),
            ([big, bytearray(big), memoryview(big)], 3),
            ([big[:-1] + b"y"], 0),
            ((k for k in stored), len(stored)),
            ((2**70, np.int64(-1), b""), 3),
            ([b"", 2**70, b"zz", -1], 2),
            ({b"": 1, -1: 2}, 2),
            (fortran, 2),  # two equal rows, both the stored key
            (np.zeros((3, 80), np.uint8)[:, 20:60], 3),  # rows of a wider array
        ]
        for keys, want in cases:
            assert await asyncio.to_thread(reader.lookup_nowait, keys) == want, keys
        s = await reader.statistics()  # flushed before it: no wait for the batched message
        assert s.queries == len(cases) == pool.statistics().queries
        assert s.hits == sum(want for _, want in cases)


async def test_counts_from_threads_are_flushed_before_statistics_and_a_none_counts_nothing(sock: str) -> None:
    keys = [b"%d" % i for i in range(64)]
    older = frozenset(await asyncio.to_thread(os.listdir, "/proc/self/fd"))
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as reader:
        await reader.store(keys[:32], [b"v"] * 32)
        answers = await asyncio.gather(*(asyncio.to_thread(reader.lookup_nowait, keys) for _ in range(20)))
        assert answers == [32] * 20
        s = await reader.statistics()  # within the 50 ms the counts would wait otherwise
        assert (s.queries, s.hits, s.misses) == (20, 640, 640)
        assert pool.statistics().queries == 20
        # The mirror refusing to answer (marked closed): None, counted nowhere; the owner's answer counts once.
        raw = await asyncio.to_thread(open_mirror, os.getpid(), older)
        try:
            header = np.frombuffer(raw, dtype=np.uint64, count=8)
            header[STATE] = CLOSED  # the mirror refuses every read, as once the owner closes
            assert await asyncio.to_thread(reader.lookup_nowait, keys) is None
            assert await reader.lookup(keys) == 32
            header[STATE] = 0
            del header
        finally:
            raw.close()
        s = await reader.statistics()
        assert (s.queries, s.hits, s.misses) == (21, 672, 672)


# -- the table rebuilt, the tier resized, under the reads -------------------------------------------


async def test_stable_keys_stay_found_while_churn_rebuilds_the_table_and_the_tier_is_resized(sock: str) -> None:
    """64 keys stay stored while another process stores and discards 800 others over and over (tombstones
    pile up past the table's limit: it is rebuilt in place, every live entry moved) and the owner shrinks
    and regrows the tier: every answer from the threads is all 64, or None (ask the owner), never fewer."""
    stable = [bytes.fromhex(hexkey(i)) for i in range(64)]
    async with Pool(CONFIG, sock) as pool, attached(sock) as a, AttachedPool(sock) as reader:
        await a.event("attached")
        await reader.store(stable, [b"s"] * 64)  # the lowest slots: a shrink to 60 MiB keeps them
        lookers = Lookers(3, lambda i: reader.lookup_nowait(stable))
        try:
            for round_ in range(6):
                churn = [hexkey(100_000 + round_ * 1000 + i) for i in range(800)]
                assert (await a.call("store", keys=churn, size=64))["skipped"] == 0
                assert (await a.call("discard", keys=churn))["dropped"] == 800
                await pool.resize("60MiB" if round_ % 2 == 0 else "64MiB")
            marks = lookers.counts()
            await until(lambda: lookers.each_answered(5, since=marks), "answers after the churn")
        finally:
            await lookers.stop()
        assert not lookers.errors
        assert set(lookers.given()) == {64}
        assert reader.lookup_nowait(stable) == 64
        pool.check_invariants()


async def test_aclose_gives_up_waiting_for_a_read_stopped_midway_and_the_mapping_goes_when_it_ends(
    sock: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A thread stopped in the middle of a read (held here while it hashes its keys) does not hang the
    close: after ``READ_WAIT`` it closes without it, says so, and the mapping goes when the read ends."""
    from aiokvtier._pool import _client, _mirror

    held, reading = threading.Event(), threading.Event()
    real = _mirror.key_rows

    def key_rows(*args: object, **kwargs: object) -> np.ndarray:
        reading.set()
        held.wait(30)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_client, "READ_WAIT", 0.3)
    before = await mappings()
    async with Pool(CONFIG, sock):
        reader = await AttachedPool.attach(sock)
        await reader.store([b"a"], [b"x"])
        monkeypatch.setattr(_mirror, "key_rows", key_rows)
        answer: list[int | None] = []
        thread = threading.Thread(target=lambda: answer.append(reader.lookup_nowait([b"a"])))
        thread.start()
        try:
            await asyncio.to_thread(reading.wait, 30)
            async with asyncio.timeout(10):
                await reader.aclose()
            assert "still reads the pool's index mirror" in caplog.text
            assert await mappings() == before + 2  # the owner's, and the one the read holds
            assert not attached_threads()
        finally:
            held.set()
            await asyncio.to_thread(thread.join, 30)
        assert answer == [1]
        assert await mappings() == before + 1
