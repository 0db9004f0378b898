"""The index mirror's batch lookups: keys given as the rows of one array, batches longer than a chunk
(the prefix stops at the first miss, and only its hits are marked referenced), lookups on other threads
while the mirror is closed under them, and ``AttachedPool.lookup_nowait`` (any thread, no await)."""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest

from aiokvtier import AttachedPool, Pool
from aiokvtier._pool._mirror import CHUNK, USABLE, IndexMirror, capacity_for, key_rows
from tests.test_pool import CONFIG, sock, until
from tests.test_pool import key as hexkey

__all__ = ["sock"]  # the fixture, used by name

pytestmark = pytest.mark.skipif(not USABLE, reason="the mirror is read only on x86-64")


def rows_of(keys: np.ndarray) -> list[bytes | int]:
    return [row.tobytes() for row in keys]


def mirror_mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum("aiokvtier-pool-index" in line for line in maps)


@pytest.mark.parametrize("width", [1, 8, 31, 32, 33, 73, 80])
def test_a_key_array_finds_what_its_rows_as_bytes_find(width: int) -> None:
    rng = np.random.default_rng(width)
    keys = rng.integers(0, 256, (300, width), dtype=np.uint8)
    keys[:, -1] = np.arange(300) % 256  # rows of one byte are not all distinct otherwise
    keys = np.unique(keys, axis=0)
    writer = IndexMirror.create(512)
    reader = IndexMirror.attach(os.dup(writer.fd), 512)
    try:
        stored = rows_of(keys[::2])
        writer.insert(stored, list(range(len(stored))), [1] * len(stored))
        for sample in (keys, keys[::2], keys[::-2], keys[::2][5:9], keys[:0]):
            assert reader.lookup(sample) == reader.lookup(rows_of(sample))
        assert reader.lookup(keys[::2]) == len(stored)
        # A view of a wider array (rows not contiguous): its own bytes, not its neighbours'.
        wide = np.zeros((len(stored), width + 5), dtype=np.uint8)
        wide[:, 2 : 2 + width] = keys[::2]
        assert reader.lookup(wide[:, 2 : 2 + width]) == len(stored)
        shifted = wide[:, 1 : 1 + width]
        assert reader.lookup(shifted) == reader.lookup(rows_of(shifted))
        # Zero bytes at the end make another key, as they do for bytes.
        padded = np.zeros((1, width + 1), dtype=np.uint8)
        padded[0, :width] = keys[0]
        assert reader.lookup(padded) == 0 == reader.lookup(rows_of(padded))
    finally:
        reader.close()
        writer.close()


@pytest.mark.parametrize("missing", [10, CHUNK + 808, None])
def test_a_batch_past_a_chunk_stops_at_its_first_miss(missing: int | None) -> None:
    n = 2 * CHUNK + 500
    keys = [b"block-%08d" % i for i in range(n)]
    writer = IndexMirror.create(n)
    reader = IndexMirror.attach(os.dup(writer.fd), n)
    try:
        stored = [i for i in range(n) if i != missing]
        writer.insert([keys[i] for i in stored], stored, [64] * len(stored))  # key i in slot i
        assert reader.lookup(keys) == (n if missing is None else missing)
        end = n if missing is None else missing
        marked = [reader.referenced(i) for i in range(n) if i != missing]
        assert all(marked[:end]) and not any(marked[end:])  # the prefix's blocks, none after the miss
        assert reader.lookup(np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(n, -1)) == end
    finally:
        reader.close()
        writer.close()


def near_the_end(data: np.ndarray, kind: int, lengths: np.ndarray) -> np.ndarray:
    """Every key starts its probe two entries before the end of a table of 32: the chain wraps."""
    h = np.full((2, data.shape[0]), capacity_for(16) - 2, dtype=np.uint64)
    h[1] = data.view("<u8")[:, 0]  # the check hash differs, the tag collides
    return h


@pytest.mark.parametrize("as_array", [False, True])
def test_a_chain_that_wraps_past_the_table_end_is_probed_whole(as_array: bool) -> None:
    writer = IndexMirror.create(16, hasher=near_the_end)
    reader = IndexMirror.attach(os.dup(writer.fd), 16, hasher=near_the_end)
    try:
        keys = [b"key-%04d" % i for i in range(16)]
        writer.insert(keys, list(range(16)), [1] * 16)  # one chain of 16 entries, 14 of them past the end
        writer.remove_slots(list(range(3, 12, 2)))  # keys[3:12:2]: tombstones in the chain, probes go on past them

        def look(batch: list[bytes]) -> int | None:
            if as_array:
                return reader.lookup(np.frombuffer(b"".join(batch), dtype=np.uint8).reshape(len(batch), -1))
            return reader.lookup(list(batch))

        kept = [k for k in keys if k not in keys[3:12:2]]
        assert look(kept) == len(kept)
        assert look(keys) == 3
        for k in keys:
            assert look([k]) == (k in kept), k
        assert look([b"key-9999", *kept]) == 0
        assert look([*kept[::-1], b"key-9999"]) == len(kept)
    finally:
        reader.close()
        writer.close()


def test_a_close_while_other_threads_look_up_unmaps_once_they_are_done() -> None:
    keys = [b"block-%08d" % i for i in range(4096)]
    writer = IndexMirror.create(4096)
    writer.insert(keys, list(range(4096)), [1] * 4096)
    before = mirror_mappings()
    reader = IndexMirror.attach(os.dup(writer.fd), 4096)
    assert mirror_mappings() == before + 1
    answers: list[set[int | None]] = [set() for _ in range(4)]
    started = threading.Barrier(5)

    def look(seen: set[int | None]) -> None:
        started.wait()
        while None not in seen:
            seen.add(reader.lookup(keys))

    threads = [threading.Thread(target=look, args=(seen,)) for seen in answers]
    for thread in threads:
        thread.start()
    try:
        started.wait()
        while not all(4096 in seen for seen in answers):
            pass
        reader.close()  # under lookups in flight: each finishes on the mapping, then it goes
    finally:
        reader.close()
        for thread in threads:
            thread.join()
        try:
            assert [seen for seen in answers] == [{4096, None}] * 4
            assert reader.closed and reader.lookup(keys) is None and reader.blocks(keys) is None
            assert mirror_mappings() == before
        finally:
            writer.close()


async def test_lookup_nowait_answers_on_any_thread_as_lookup_does(sock: str) -> None:
    keys = [bytes.fromhex(hexkey(i)) for i in range(200)]
    array = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(200, 16)
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as reader:
        await reader.store(keys[:150], [b"x"] * 150)
        assert await asyncio.to_thread(reader.lookup_nowait, keys) == 150
        assert await asyncio.to_thread(reader.lookup_nowait, array) == 150
        assert await asyncio.to_thread(reader.lookup_nowait, array[150:]) == 0
        assert reader.lookup_nowait(keys[:10]) == 10  # the loop's own thread too
        assert await reader.lookup(array) == 150
        assert await reader.lookup(array[140:]) == 10
        # The owner counts them, in one message a little later (the loop's lookups go at once).
        await until(lambda: pool.statistics().queries == 6, "the counts told")
        s = pool.statistics()
        assert (s.hits, s.misses) == (150 + 150 + 10 + 150 + 10, 50 + 50 + 50 + 50 + 50)
        with pytest.raises(TypeError, match="2-D uint8"):
            reader.lookup_nowait(array.reshape(-1))
        with pytest.raises(TypeError, match="2-D uint8"):
            await reader.lookup(array.view(np.int16))
        with pytest.raises(TypeError, match="not one key"):
            reader.lookup_nowait(keys[0])
    assert reader.lookup_nowait(keys) is None  # closed: ask lookup(), which says so


async def test_lookup_nowait_is_none_where_only_the_owner_answers(sock: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No mirror (a tier too large for one, made to look so here): None here, and ``lookup`` of a key
    array asks the owner."""
    from aiokvtier._pool import _owner

    monkeypatch.setattr(_owner, "mirror_fits", lambda slots, slot_size: False)
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as reader:
        await reader.store([b"ab", b"cd"], [b"x", b"y"])
        array = np.frombuffer(b"abcdef", dtype=np.uint8).reshape(3, 2)
        assert reader.lookup_nowait(array) is None
        assert await reader.lookup(array) == 2
        s = pool.statistics()
        assert (s.queries, s.hits, s.misses) == (1, 2, 1)


async def test_lookup_nowait_is_none_once_the_owner_closed(sock: str) -> None:
    reader: AttachedPool | None = None
    try:
        async with Pool(CONFIG, sock):
            reader = await AttachedPool.attach(sock)
            await reader.store([b"a"], [b"x"])
            assert reader.lookup_nowait([b"a"]) == 1
        assert reader.lookup_nowait([b"a"]) is None  # the mirror marked closed, then the loss seen
    finally:
        if reader is not None:
            await reader.aclose()


@pytest.mark.parametrize(
    "key", [b"", b"a", b"12345-678-", b"a\0b", b"a\0", b"\0", b"x" * 32, b"x" * 31 + b"\0", b"x" * 33, b"y" * 64]
)
def test_a_key_has_one_entry_whichever_batch_packs_it(key: bytes) -> None:
    """Batches of short keys are packed in C, their lengths read off the packed rows; a key ending in NUL
    bytes or longer than 32 sends its batch the slow way. Either way a key's entry (its hashes, length
    and bytes) is the same: what the owner wrote is what a reader looks for."""
    alone = key_rows([key], types={bytes})
    for batch in ([key, b"b"], [b"b", key, b"c" * 40], [b"b", key, b"c\0"]):
        rows = key_rows(batch, types={bytes})
        assert (rows[batch.index(key)] == alone[0]).all()
    writer = IndexMirror.create(16)
    reader = IndexMirror.attach(os.dup(writer.fd), 16)
    try:
        writer.insert([b"c" * 40, key], [1, 2], [5, 6])  # the slow way
        assert reader.lookup([key, b"c" * 40]) == 2
        assert reader.lookup([key + b"\0"]) == 0 and reader.lookup([key[:-1] or b"z"]) == 0
    finally:
        reader.close()
        writer.close()


async def test_contains_answers_per_key_past_a_miss_and_touches_nothing(sock: str) -> None:
    keys = [bytes.fromhex(hexkey(i)) for i in range(64)]
    array = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(64, 16)
    stored = set(range(0, 64, 3)) | {1, 2}
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as reader:
        await reader.store([keys[i] for i in sorted(stored)], [b"x"] * len(stored))
        want = np.array([i in stored for i in range(64)])
        before = pool.statistics()
        assert np.array_equal(await reader.contains(keys), want)
        assert np.array_equal(await reader.contains(array), want)
        assert np.array_equal(await asyncio.to_thread(reader.contains_nowait, keys), want)  # any thread
        assert np.array_equal(reader.contains_nowait(array[::-1]), want[::-1])
        assert reader.contains_nowait([]) is not None and len(await reader.contains([])) == 0
        assert await reader.lookup(keys) == 4  # the prefix stops at the first miss; contains does not
        await until(lambda: pool.statistics().queries == before.queries + 1, "the lookup counted")
        after = pool.statistics()
        assert (after.queries, after.hits) == (before.queries + 1, before.hits + 4)  # contains counted nothing
        await reader.discard([keys[0]])
        assert not (await reader.contains(keys[:1]))[0]
        with pytest.raises(TypeError, match="2-D uint8"):
            reader.contains_nowait(array.reshape(-1))
        with pytest.raises(TypeError, match="not one key"):
            await reader.contains(keys[0])
    assert reader.contains_nowait(keys) is None  # closed


async def test_contains_asks_the_owner_without_a_mirror(sock: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokvtier._pool import _owner

    monkeypatch.setattr(_owner, "mirror_fits", lambda slots, slot_size: False)
    async with Pool(CONFIG, sock), AttachedPool(sock) as reader:
        await reader.store([b"ab", b"ef"], [b"x", b"y"])
        array = np.frombuffer(b"abcdef", dtype=np.uint8).reshape(3, 2)
        assert reader.contains_nowait(array) is None
        assert (await reader.contains(array)).tolist() == [True, False, True]
