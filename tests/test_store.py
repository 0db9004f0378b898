"""BlockStore through its public API (host pages, no engine), on asyncio and uvloop.

Copies are held where a test needs a block pinned or a store in flight: the
store's host copy (``landed_after``, run on its thread) is replaced by a gated
one. Every await is bounded, so a hang fails the test instead of stalling it.
"""

from __future__ import annotations

import asyncio
import random
import threading
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import pytest

import aiokvtier._store._transfers as transfers_module
from aiokvtier import (
    AiokvtierError,
    BlockEvent,
    BlockNotFound,
    BlockStore,
    EvictionPolicy,
    FillError,
    HostTier,
    HostTierConfig,
    QuotaError,
    StoreResult,
    TierClosedError,
)
from aiokvtier._store._policy import Key, LRUPolicy

from .conftest import PopulateGate, raised_on_another_loop
from .helpers import KiB, MiB, eventually, small_config
from .test_cancellation import cancel_during, sweep

T = TypeVar("T")
SLOT = 4 * KiB
TIMEOUT = 10.0


async def bounded(aw: Awaitable[T]) -> T:
    return await asyncio.wait_for(aw, TIMEOUT)


@asynccontextmanager
async def open_store(slots: int = 8, slot: int = SLOT, **kwargs: Any) -> AsyncIterator[tuple[HostTier, BlockStore]]:
    cfg = HostTierConfig(
        quota=slots * slot, max_quota=max(64, slots) * slot, slot_size=slot, commit_unit=slot * 4, fill_chunk=slot * 8
    )
    tier = await bounded(HostTier.open(cfg))
    try:
        await bounded(tier.wait_resident())
        store = await bounded(BlockStore.open(tier, **kwargs))
        try:
            yield tier, store
        finally:
            await bounded(store.aclose())
    finally:
        await bounded(tier.aclose())


def page(key: object, n: int = SLOT) -> bytes:
    """Bytes that belong to ``key`` alone (a stale or partly written block shows)."""
    seed = zlib.crc32(repr(key).encode())
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def pages(keys: list[Any], n: int = SLOT) -> np.ndarray:
    return np.frombuffer(b"".join(page(k, n) for k in keys), dtype=np.uint8).reshape(len(keys), n).copy()


async def read(store: BlockStore, keys: list[Any], n: int = SLOT) -> list[bytes]:
    dst = np.zeros((len(keys), n), dtype=np.uint8)
    await bounded(store.load(keys, dst))
    return [row.tobytes() for row in dst]


def settled(tier: HostTier, store: BlockStore) -> None:
    """Nothing in flight: one tier slot per visible block."""
    stats = store.statistics()
    assert stats.in_flight == 0 and stats.blocks_pinned == 0
    assert tier.statistics().slots_allocated == len(store) == stats.blocks
    assert stats.capacity == tier.slots_total
    store.check_invariants(sole_user=True)


class Events:
    """A subscriber task that reads ``store.events()`` into a list (subscribed once started)."""

    def __init__(self, store: BlockStore) -> None:
        self.got: list[BlockEvent] = []
        self._stream = store.events()
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for event in self._stream:
            self.got.append(event)

    @classmethod
    async def start(cls, store: BlockStore) -> Events:
        events = cls(store)
        await asyncio.sleep(0)  # the generator runs up to its first wait: subscribed
        return events

    async def next(self, n: int) -> list[tuple[str, tuple[Any, ...]]]:
        """The first ``n`` events not taken yet, as (kind, keys)."""
        await eventually(lambda: len(self.got) >= n, TIMEOUT)
        taken, self.got = self.got[:n], self.got[n:]
        return [(e.kind, e.keys) for e in taken]


class Gate:
    """Replaces the store's host copy: each copy waits until let through, then runs."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        self.done = threading.Event()
        self.calls = 0
        self._real = transfers_module.landed_after

    def __call__(self, copy: Callable[[], None], landed: threading.Event) -> None:
        self.calls += 1
        self.entered.set()
        self.open.wait(TIMEOUT)
        self._real(copy, landed)
        self.done.set()

    async def release(self) -> None:
        await asyncio.to_thread(self.open.set)

    async def started(self) -> None:
        await eventually(self.entered.is_set)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    gate = Gate()
    monkeypatch.setattr(transfers_module, "landed_after", gate)
    yield gate
    gate.open.set()


@pytest.fixture
def store_then_hold(held: Gate) -> Gate:
    """Copies run until ``hold()`` is called (stores before the test's point of interest land)."""
    held.open.set()
    return held


def hold(gate: Gate) -> None:
    gate.open.clear()
    gate.entered.clear()
    gate.done.clear()


# -- round trips and refusals ----------------------------------------------------------------


@pytest.mark.parametrize("form", ["numpy", "bytes", "bytearray", "memoryview", "mixed"])
async def test_round_trip_is_bit_exact(form: str) -> None:
    async with open_store(8) as (tier, store):
        keys = [b"a", b"b", 3, 4]
        lengths = [SLOT, SLOT, SLOT, SLOT] if form == "numpy" else [SLOT, 1, 100, SLOT - 1]
        data = [page(k, n) for k, n in zip(keys, lengths, strict=True)]
        src: Any
        if form == "numpy":
            src = np.frombuffer(b"".join(data), dtype=np.uint8).reshape(4, SLOT)
        else:
            kinds: list[Any] = [bytes, bytearray, lambda b: memoryview(bytearray(b))]
            pick = {"bytes": 0, "bytearray": 1, "memoryview": 2}
            src = [kinds[pick.get(form, i % 3)](d) for i, d in enumerate(data)]
        result = await bounded(store.store(keys, src))
        assert result == StoreResult(stored=tuple(keys), present=(), skipped=())
        # Into a wide numpy array: each block copies its own length, the rest stays.
        dst = np.full((4, SLOT), 0xEE, dtype=np.uint8)
        await bounded(store.load(keys, dst))
        for row, d in zip(dst, data, strict=True):
            assert row[: len(d)].tobytes() == d and not (row[len(d) :] != 0xEE).any()
        # Into exactly-sized bytearrays and memoryviews.
        out = [bytearray(len(d)) for d in data]
        await bounded(store.load(keys, [out[0], memoryview(out[1]), out[2], memoryview(out[3])]))
        assert [bytes(o) for o in out] == data
        stats = store.statistics()
        assert stats.bytes_stored == sum(lengths) and stats.bytes_loaded == 2 * sum(lengths)
        assert stats.stores == 4 and stats.loads == 8
        settled(tier, store)


async def test_page_larger_than_the_slot_changes_nothing() -> None:
    async with open_store(4) as (tier, store):
        for src in ([b"x" * (SLOT + 1)], np.zeros((1, SLOT + 1), dtype=np.uint8), [b"ok", b"y" * (SLOT + 1)]):
            keys = [1, 2][: len(src)]
            with pytest.raises(ValueError, match="does not fit"):
                await bounded(store.store(keys, src))
            assert len(store) == 0 and 1 not in store
            settled(tier, store)
        assert store.statistics().stores == 0


async def test_destination_shorter_than_the_block_copies_nothing() -> None:
    async with open_store(4) as (tier, store):
        await bounded(store.store([1, 2], [page(1, 100), page(2, 50)]))
        dst = [bytearray(b"\xee" * 100), bytearray(b"\xee" * 49)]
        with pytest.raises(ValueError):
            await bounded(store.load([1, 2], dst))
        assert dst == [bytearray(b"\xee" * 100), bytearray(b"\xee" * 49)]
        wide = np.full((2, 99), 0xEE, dtype=np.uint8)
        with pytest.raises(ValueError):
            await bounded(store.load([1, 2], wide))
        assert (wide == 0xEE).all()
        assert store.statistics().loads == 0
        settled(tier, store)


async def test_read_only_destination_is_refused() -> None:
    async with open_store(4) as (tier, store):
        await bounded(store.store([1], [page(1)]))
        with pytest.raises(ValueError, match="read-only"):
            await bounded(store.load([1], [bytes(SLOT)]))
        frozen = np.zeros((1, SLOT), dtype=np.uint8)
        frozen.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            await bounded(store.load([1], frozen))
        assert not frozen.any()
        settled(tier, store)


async def test_a_key_twice_in_one_store_is_refused() -> None:
    async with open_store(4) as (tier, store):
        with pytest.raises(ValueError, match="twice"):
            await bounded(store.store([1, 2, 1], pages([1, 2, 1])))
        with pytest.raises(ValueError, match="twice"):
            await bounded(store.store([b"k", bytearray(b"k")], pages([0, 1])))
        assert len(store) == 0
        settled(tier, store)


async def test_a_key_twice_changes_nothing_whichever_path_finds_it() -> None:
    """Free slots (found by the booking), a full tier (found before evicting), a skip, present keys."""
    async with open_store(4) as (tier, store):
        await bounded(store.store([10, 11], pages([10, 11])))
        before = store.statistics()
        with pytest.raises(ValueError, match="twice"):  # two free slots: booked, then undone
            await bounded(store.store([1, 1], pages([1, 1])))
        with pytest.raises(ValueError, match="twice"):  # three new blocks, two free slots: refused before evicting
            await bounded(store.store([1, 2, 1], pages([1, 2, 1])))
        with pytest.raises(ValueError, match="twice"):  # present twice
            await bounded(store.store([10, 3, 10], pages([10, 3, 10])))
        with pytest.raises(ValueError, match="twice"):  # would be split by a skip
            await bounded(store.store([4, 5, 6, 7, 8, 4], pages([4, 5, 6, 7, 8, 4]), wait=False))
        after = store.statistics()
        assert (after.evictions, after.stores, after.skipped, after.present) == (
            before.evictions,
            before.stores,
            before.skipped,
            before.present,
        )
        assert sorted(k for k in range(20) if k in store) == [10, 11]
        assert await read(store, [10, 11]) == [page(10), page(11)]
        settled(tier, store)


async def test_a_key_twice_while_another_call_stores_it(store_then_hold: Gate) -> None:
    gate = store_then_hold
    async with open_store(4) as (tier, store):
        hold(gate)
        first = asyncio.create_task(store.store([1], pages([1])))
        await gate.started()
        with pytest.raises(ValueError, match="twice"):
            await bounded(store.store([2, 1, 2], pages([2, 1, 2])))
        await gate.release()
        assert (await bounded(first)).stored == (1,)
        assert 2 not in store and await read(store, [1]) == [page(1)]
        settled(tier, store)


@pytest.mark.parametrize("bad", [True, 1.5, "key", None, [1]])
async def test_a_bad_key_after_good_ones_changes_nothing(bad: object) -> None:
    """Types are checked while the copy runs when the list starts with a bytes or an int."""
    async with open_store(4) as (tier, store):
        await bounded(store.store([10, 11, 12], pages([10, 11, 12])))
        before = store.statistics()
        with pytest.raises(TypeError):  # room for both: found by the booking, undone after the copy
            await bounded(store.store([1, bad], pages([1, 2])))
        with pytest.raises(TypeError):  # the tier is full: found before anything is evicted
            await bounded(store.store([1, 2, bad], pages([1, 2, 3])))
        after = store.statistics()
        assert (after.stores, after.evictions, after.skipped) == (before.stores, before.evictions, before.skipped)
        assert sorted(k for k in range(20) if k in store) == [10, 11, 12]
        result = await bounded(store.store([5, np.int64(6), bytearray(b"k"), 10], pages([5, 6, b"k", 10])))
        assert result.stored == (5, 6, b"k") and result.present == (10,)
        assert [type(k) for k in (*result.stored, *result.present)] == [int, int, bytes, int]
        assert await read(store, [6, b"k"]) == [page(6), page(b"k")]
        settled(tier, store)


@pytest.mark.parametrize("bad", [True, False, np.bool_(True), 1.5, "key", None])
async def test_keys_that_are_not_bytes_or_int_are_refused(bad: object) -> None:
    async with open_store(4) as (tier, store):
        with pytest.raises(TypeError):
            await bounded(store.store([bad], pages([0])))
        with pytest.raises(TypeError):
            store.lookup([bad])
        with pytest.raises(TypeError):
            store.discard([bad])
        await bounded(store.store([1, 0], pages([1, 0])))
        with pytest.raises(TypeError):
            await bounded(store.load([bad], np.zeros((1, SLOT), dtype=np.uint8)))
        assert bad not in store  # True == 1, but it is not the key 1
        assert len(store) == 2
        settled(tier, store)


async def test_int_and_bytes_keys_are_distinct_and_bytes_likes_convert() -> None:
    async with open_store(8) as (tier, store):
        result = await bounded(store.store([1, b"\x01", bytearray(b"k"), np.int64(7)], pages(["i", "b", "k", 7])))
        assert result.stored == (1, b"\x01", b"k", 7)
        assert [type(k) for k in result.stored] == [int, bytes, bytes, int]
        assert await read(store, [1, b"\x01"]) == [page("i"), page("b")]
        assert await read(store, [memoryview(b"k"), np.uint16(7)]) == [page("k"), page(7)]
        assert np.int32(7) in store and memoryview(b"\x01") in store and b"\x01\x00" not in store
        assert store.lookup(np.array([7, 1], dtype=np.int64)) == 2
        assert (await bounded(store.store([np.int8(1)], pages([9])))).present == (1,)
        assert store.discard([np.uint64(7), bytearray(b"k")]) == 2
        assert len(store) == 2
        settled(tier, store)


async def test_store_result_keeps_the_callers_order(store_then_hold: Gate) -> None:
    gate = store_then_hold
    async with open_store(4) as (tier, store):
        await bounded(store.store([b"p", 2], pages([b"p", 2])))
        hold(gate)
        load = asyncio.create_task(store.load([2, b"p"], np.zeros((2, SLOT), dtype=np.uint8)))
        await gate.started()  # 2 and b"p" are pinned: nothing can be evicted
        keys = [5, 2, b"n", b"p", 9, 10]
        storing = asyncio.create_task(store.store(keys, pages(keys)))
        await gate.release()
        result = await bounded(storing)
        # Room for two new blocks: 5 and b"n"; 9 and 10 are the skipped suffix.
        assert result == StoreResult(stored=(5, b"n"), present=(2, b"p"), skipped=(9, 10))
        await bounded(load)
        assert await read(store, [2, b"p", 5, b"n"]) == [page(2), page(b"p"), page(5), page(b"n")]
        settled(tier, store)


async def test_block_not_found_names_the_first_missing_key_and_copies_nothing() -> None:
    async with open_store(4) as (tier, store):
        await bounded(store.store([1, 2], pages([1, 2])))
        dst = np.full((4, SLOT), 0xEE, dtype=np.uint8)
        with pytest.raises(BlockNotFound) as info:
            await bounded(store.load([1, b"gone", 2, 7], dst))
        assert isinstance(info.value, AiokvtierError) and isinstance(info.value, KeyError)
        assert info.value.key == b"gone" and repr(b"gone") in str(info.value)
        assert (dst == 0xEE).all()
        assert store.statistics().loads == 0
        settled(tier, store)


# -- a full tier --------------------------------------------------------------------------------


async def test_full_tier_evicts_least_recently_used_and_skips_the_suffix() -> None:
    async with open_store(4) as (tier, store):
        events = await Events.start(store)
        await bounded(store.store([1, 2, 3, 4], pages([1, 2, 3, 4])))
        assert store.lookup([1, 9]) == 1  # touches 1: 2 is now the oldest
        await bounded(store.load([3], np.zeros((1, SLOT), dtype=np.uint8)))  # and 3 the newest
        result = await bounded(store.store([5, 6], pages([5, 6])))
        assert result.stored == (5, 6)
        assert 2 not in store and 4 not in store and {1, 3, 5, 6} == {k for k in (1, 2, 3, 4, 5, 6) if k in store}
        # More new keys than the tier holds: every older block goes, the suffix is skipped.
        keys = [10, 11, 12, 13, 14, 15]
        result = await bounded(store.store(keys, pages(keys)))
        assert result.stored == (10, 11, 12, 13) and result.skipped == (14, 15) and result.present == ()
        assert await read(store, [10, 11, 12, 13]) == [page(k) for k in (10, 11, 12, 13)]
        assert await events.next(5) == [
            ("stored", (1, 2, 3, 4)),
            ("evicted", (2, 4)),
            ("stored", (5, 6)),
            ("evicted", (1, 3, 5, 6)),
            ("stored", (10, 11, 12, 13)),
        ]
        stats = store.statistics()
        assert stats.evictions == 6 and stats.skipped == 2
        settled(tier, store)


class FIFOPolicy(EvictionPolicy):
    """A policy of one's own, from the interface alone (docs/store.md): first in, first out."""

    name = "fifo"

    def __init__(self) -> None:
        self._order: dict[int, None] = {}

    def inserted(self, slot: int, key: bytes | int) -> None:
        if slot in self._order:
            raise ValueError(f"slot {slot} holds a block already")
        self._order[slot] = None

    def accessed(self, slots: np.ndarray) -> None:
        pass

    def removed(self, slot: int) -> None:
        del self._order[slot]

    def victims(self) -> Iterator[int]:
        yield from list(self._order)

    def __len__(self) -> int:
        return len(self._order)


async def test_a_policy_of_ones_own_from_the_interface_alone(store_then_hold: Gate) -> None:
    gate = store_then_hold
    policy = FIFOPolicy()
    async with open_store(3, policy=policy) as (tier, store):
        assert (await bounded(store.store([1, 2, 3], pages([1, 2, 3])))).stored == (1, 2, 3)
        assert store.lookup([1]) == 1  # a hit: LRU would keep 1, FIFO does not care
        assert (await bounded(store.store([4], pages([4])))).stored == (4,)
        assert 1 not in store and {2, 3, 4} <= {k for k in range(5) if k in store}
        hold(gate)
        reading = asyncio.create_task(store.load([2], np.zeros((1, SLOT), dtype=np.uint8)))
        await gate.started()
        storing = asyncio.create_task(store.store([5], pages([5])))  # its copy waits behind the load's
        await eventually(lambda: 3 not in store)  # 2 is pinned: 3 goes
        assert 2 in store
        await gate.release()
        await bounded(reading)
        assert (await bounded(storing)).stored == (5,)
        assert store.statistics().policy == "fifo" and len(policy) == len(store) == 3
        assert await read(store, [2, 4, 5]) == [page(2), page(4), page(5)]
        settled(tier, store)


async def test_a_store_does_not_evict_its_own_present_prefix() -> None:
    async with open_store(2) as (_tier, store):
        await bounded(store.store([1, 2], pages([1, 2])))
        result = await bounded(store.store([1, 3, 4], pages([1, 3, 4])))
        assert result.present == (1,)
        assert 1 in store, "the call's present leading block was evicted by the same call"
        assert store.lookup([1, 3, 4]) >= 1


# -- pinning, discard and concurrent stores --------------------------------------------------------


async def test_a_block_being_loaded_is_never_evicted(store_then_hold: Gate) -> None:
    held = store_then_hold
    async with open_store(1) as (tier, store):
        await bounded(store.store([1], pages([1])))
        hold(held)
        dst = np.zeros((1, SLOT), dtype=np.uint8)
        load = asyncio.create_task(store.load([1], dst))
        await held.started()
        assert store.statistics().blocks_pinned == 1
        result = await bounded(store.store([2], pages([2])))  # needs the pinned block's slot
        assert result == StoreResult(stored=(), present=(), skipped=(2,))
        assert 1 in store and 2 not in store
        await held.release()
        await bounded(load)
        assert dst[0].tobytes() == page(1)
        settled(tier, store)


async def test_pinned_blocks_are_skipped_by_eviction(store_then_hold: Gate) -> None:
    gate = store_then_hold
    async with open_store(2) as (tier, store):
        await bounded(store.store([1, 2], pages([1, 2])))
        hold(gate)
        dst = np.zeros((1, SLOT), dtype=np.uint8)
        load = asyncio.create_task(store.load([1], dst))
        await gate.started()
        assert store.lookup([2]) == 1  # 2 is the newest: LRU alone would evict the pinned 1
        stored = asyncio.create_task(store.store([3], pages([3])))
        await asyncio.sleep(0.01)  # it has evicted by now and waits in its (held) copy
        assert 1 in store and 2 not in store and 3 not in store
        await gate.release()
        assert (await bounded(stored)).stored == (3,)
        await bounded(load)
        assert dst[0].tobytes() == page(1)
        assert 2 not in store and 1 in store and 3 in store
        settled(tier, store)


async def test_discard_of_a_block_being_loaded(store_then_hold: Gate) -> None:
    gate = store_then_hold
    async with open_store(2) as (tier, store):
        events = await Events.start(store)
        await bounded(store.store([1], pages([1])))
        hold(gate)
        dst = np.zeros((1, SLOT), dtype=np.uint8)
        load = asyncio.create_task(store.load([1], dst))
        await gate.started()
        assert store.discard([1, 1, 5]) == 1
        assert 1 not in store and len(store) == 0 and store.lookup([1]) == 0
        assert tier.statistics().slots_allocated == 1  # the load still reads it
        with pytest.raises(BlockNotFound):
            await bounded(store.load([1], np.zeros((1, SLOT), dtype=np.uint8)))
        await gate.release()
        await bounded(load)
        assert dst[0].tobytes() == page(1)
        assert tier.statistics().slots_allocated == 0
        assert await events.next(2) == [
            ("stored", (1,)),
            ("discarded", (1,)),
        ]
        settled(tier, store)


async def test_concurrent_store_of_one_key_copies_once(store_then_hold: Gate) -> None:
    gate = store_then_hold
    async with open_store(4) as (tier, store):
        hold(gate)
        first = asyncio.create_task(store.store([1, 2], pages([1, 2])))
        await gate.started()
        second = asyncio.create_task(store.store([3, 1], [page("other")] * 2))
        await asyncio.sleep(0.01)
        assert not second.done() and 1 not in store  # visible only once its data landed
        await gate.release()
        assert (await bounded(first)).stored == (1, 2)
        assert await bounded(second) == StoreResult(stored=(3,), present=(1,), skipped=())
        assert gate.calls == 2  # one copy per call: 1 was not copied again
        assert await read(store, [1, 3]) == [page(1), page("other")]
        assert store.statistics().present == 1
        settled(tier, store)


async def test_a_store_retrying_after_a_cancelled_one_counts_its_present_keys(store_then_hold: Gate) -> None:
    gate = store_then_hold
    async with open_store(4) as (tier, store):
        await bounded(store.store([b"p"], pages([b"p"])))
        hold(gate)
        first = asyncio.create_task(store.store([1], pages([1])))
        await gate.started()
        second = asyncio.create_task(store.store([b"p", 1], pages(["x", 1])))
        await asyncio.sleep(0.01)
        first.cancel()
        await gate.release()
        with pytest.raises(asyncio.CancelledError):
            await bounded(first)
        # The cancelled store's copy finished, yet its block never became visible: the waiter stores 1 itself.
        assert await bounded(second) == StoreResult(stored=(1,), present=(b"p",), skipped=())
        assert await read(store, [1, b"p"]) == [page(1), page(b"p")]
        settled(tier, store)
        stats = store.statistics()
        assert (stats.stores, stats.present) == (2, 1), "statistics().present misses the present key of a retry"


async def test_wait_false_skips_slots_that_are_not_resident(gate: PopulateGate) -> None:
    cfg = small_config(quota=4 * MiB, max_quota=4 * MiB)
    async with HostTier(cfg) as tier, BlockStore(tier) as store:
        slot = tier.slot_size
        keys = list(range(40))
        src = pages(keys, slot)
        assert (await bounded(store.store(keys, src, wait=False))).skipped == tuple(keys)
        gate.allow(1)
        await bounded(tier.wait_resident(slot))
        resident = tier.statistics().resident_bytes // slot
        assert 0 < resident < len(keys)
        result = await bounded(store.store(keys, src, wait=False))
        assert result.stored == tuple(keys[:resident]) and result.skipped == tuple(keys[resident:])
        pending = asyncio.create_task(store.store(keys, src))  # waits for the fill
        await asyncio.sleep(0.01)
        assert not pending.done()
        gate.release_all()
        result = await bounded(pending)
        assert result.present == tuple(keys[:resident]) and result.stored == tuple(keys[resident:])
        assert await read(store, keys, slot) == [page(k, slot) for k in keys]
        settled(tier, store)


# -- many tasks, cancellation ----------------------------------------------------------------------


async def test_hundreds_of_tasks_while_the_tier_fills() -> None:
    slot = 16 * KiB
    cfg = HostTierConfig(quota=384 * MiB, max_quota=384 * MiB, slot_size=slot, commit_unit=8 * MiB, fill_chunk=8 * MiB)
    universe = 2000
    data = {k: page(k, slot) for k in range(universe)}
    async with HostTier(cfg) as tier, BlockStore(tier) as store:
        assert tier.statistics().filling
        rng = random.Random(5)

        async def worker(seed: int) -> None:
            r = random.Random(seed)
            for _ in range(3):
                keys = r.sample(range(universe), 8)
                src = np.frombuffer(b"".join(data[k] for k in keys), dtype=np.uint8).reshape(8, slot)
                result = await store.store(keys, src)
                assert not result.skipped
                assert set(result.stored) | set(result.present) == set(keys)
                dst = np.zeros((8, slot), dtype=np.uint8)
                await store.load(keys, dst)
                assert all(dst[i].tobytes() == data[k] for i, k in enumerate(keys))

        async with asyncio.timeout(30):
            async with asyncio.TaskGroup() as tg:
                for _ in range(300):
                    tg.create_task(worker(rng.random()))
        touched = sorted(k for k in range(universe) if k in store)
        stats = store.statistics()
        assert stats.stores == len(store) == len(touched) and stats.evictions == 0
        assert await read(store, touched, slot) == [data[k] for k in touched]
        settled(tier, store)


async def test_cancellation_storm_leaves_no_partial_block_and_no_leaked_slot() -> None:
    slot = 256 * KiB
    cfg = HostTierConfig(quota=24 * MiB, max_quota=24 * MiB, slot_size=slot, commit_unit=2 * MiB, fill_chunk=2 * MiB)
    async with HostTier(cfg) as tier, BlockStore(tier) as store:
        case = 0
        for how, delay in sweep(11, delays=(0, 0.0005, 0.001, 0.002, 0.005, 0.01), cancels=8):
            case += 1
            keys = [case * 1000 + i for i in range(24)]
            await cancel_during(lambda keys=keys: store.store(keys, pages(keys, slot)), how, delay)
            here = [k for k in keys if k in store]
            dst = np.zeros((len(here), slot), dtype=np.uint8)
            outcome = await cancel_during(lambda here=here, dst=dst: store.load(here, dst), how, delay)
            if outcome.started and not outcome.cancelled:
                assert [row.tobytes() for row in dst] == [page(k, slot) for k in here]
            settled(tier, store)
            alive = [k for k in range(case * 1000 + 1000) if k in store]
            assert await read(store, alive, slot) == [page(k, slot) for k in alive], f"{how} {delay}: a partial block"
        assert tier.statistics().slots_allocated == len(store)


async def test_cancelled_load_returns_only_after_its_copy(store_then_hold: Gate) -> None:
    gate = store_then_hold
    async with open_store(4) as (tier, store):
        await bounded(store.store([1, 2], pages([1, 2])))
        hold(gate)
        dst = np.zeros((2, SLOT), dtype=np.uint8)
        task = asyncio.create_task(store.load([1, 2], dst))
        await gate.started()
        task.cancel()
        await asyncio.sleep(0.02)
        assert not task.done(), "the load returned while its copy still writes the destination"
        await gate.release()
        with pytest.raises(asyncio.CancelledError):
            await bounded(task)
        assert gate.done.is_set()
        assert [row.tobytes() for row in dst] == [page(1), page(2)]
        settled(tier, store)


async def test_cancelled_store_returns_only_after_its_copy_and_stores_nothing(store_then_hold: Gate) -> None:
    gate = store_then_hold
    async with open_store(4) as (tier, store):
        hold(gate)
        events = await Events.start(store)
        task = asyncio.create_task(store.store([1, 2], pages([1, 2])))
        await gate.started()
        task.cancel()
        await asyncio.sleep(0.02)
        assert not task.done(), "the store returned while its copy still reads the source"
        await gate.release()
        with pytest.raises(asyncio.CancelledError):
            await bounded(task)
        assert gate.done.is_set()
        assert 1 not in store and 2 not in store and len(store) == 0
        settled(tier, store)
        await bounded(store.store([3], pages([3])))
        assert await events.next(1) == [("stored", (3,))]  # none for the cancelled one


# -- events, close, open, resize ----------------------------------------------------------------------


async def test_events_are_bounded_and_say_how_many_were_dropped() -> None:
    async with open_store(8, event_limit=2) as (_tier, store):
        events = store.events()
        first = asyncio.create_task(anext(events))
        await asyncio.sleep(0)  # subscribed, waiting
        await bounded(store.store([0], pages([0])))
        assert await bounded(first) == BlockEvent("stored", (0,))
        for k in range(1, 6):  # nobody reads: 1 and 2 and 3 are dropped
            await bounded(store.store([k], pages([k])))
        assert await bounded(anext(events)) == BlockEvent("stored", (4,), dropped=3)
        assert await bounded(anext(events)) == BlockEvent("stored", (5,), dropped=0)
        assert store.discard([0, 4, 42]) == 2
        assert await bounded(anext(events)) == BlockEvent("discarded", (0, 4))
        store.discard([0])  # nothing dropped: no event
        await bounded(store.store([9], pages([9])))
        assert await bounded(anext(events)) == BlockEvent("stored", (9,))


async def test_events_subscribes_when_called() -> None:
    async with open_store(4) as (_tier, store):
        events = store.events()
        await bounded(store.store([1], pages([1])))
        assert await asyncio.wait_for(anext(events), 1.0) == BlockEvent("stored", (1,))


async def test_event_iteration_ends_at_aclose() -> None:
    async with open_store(4) as (_tier, store):
        got: list[BlockEvent] = []

        async def reader() -> None:
            async for event in store.events():
                got.append(event)

        task = asyncio.create_task(reader())
        await asyncio.sleep(0)
        await bounded(store.store([1], pages([1])))
        await bounded(store.aclose())
        await bounded(task)
        assert got == [BlockEvent("stored", (1,))]


async def test_aclose_waits_for_operations_in_flight_and_frees_every_slot(store_then_hold: Gate) -> None:
    gate = store_then_hold
    async with open_store(4) as (tier, store):
        await bounded(store.store([1, 2], pages([1, 2])))
        hold(gate)
        dst = np.zeros((1, SLOT), dtype=np.uint8)
        load = asyncio.create_task(store.load([1], dst))
        await gate.started()
        closing = asyncio.create_task(store.aclose())
        await asyncio.sleep(0.02)
        assert not closing.done() and tier.statistics().slots_allocated == 2
        with pytest.raises(TierClosedError):
            await bounded(store.store([3], pages([3])))
        await gate.release()
        await bounded(closing)
        await bounded(load)
        assert dst[0].tobytes() == page(1)
        assert store.closed and not tier.closed
        assert tier.statistics().slots_allocated == 0
        await bounded(store.aclose())  # idempotent
        assert len(await bounded(tier.allocate(4))) == 4  # every slot is the tier's again


async def test_operations_after_aclose_raise_tier_closed() -> None:
    async with open_store(4) as (tier, store):
        await bounded(store.store([1], pages([1])))
        await bounded(store.aclose())
        with pytest.raises(TierClosedError):
            await bounded(store.store([2], pages([2])))
        with pytest.raises(TierClosedError):
            await bounded(store.load([1], np.zeros((1, SLOT), dtype=np.uint8)))
        with pytest.raises(TierClosedError):
            store.lookup([1])
        with pytest.raises(TierClosedError):
            store.discard([1])
        with pytest.raises(TierClosedError):
            await bounded(store.resize(2 * SLOT))
        with pytest.raises(TierClosedError):
            store.events()
        assert 1 not in store
        assert not tier.closed and tier.statistics().slots_allocated == 0


async def test_a_closed_store_holds_no_blocks() -> None:
    async with open_store(4) as (tier, store):
        await bounded(store.store([1], pages([1])))
        await bounded(store.aclose())
        assert tier.statistics().slots_allocated == 0
        assert len(store) == 0 and store.statistics().blocks == 0


async def test_open_classmethod_and_a_closed_tier() -> None:
    cfg = HostTierConfig(quota=8 * SLOT, max_quota=8 * SLOT, slot_size=SLOT, commit_unit=4 * SLOT, fill_chunk=8 * SLOT)
    tier = await bounded(HostTier.open(cfg))
    store = await bounded(BlockStore.open(tier, policy="lru"))
    try:
        assert isinstance(store, BlockStore) and not store.closed
        assert store.statistics().policy == "lru" and store.statistics().capacity == 8
        assert (await bounded(store.store([1], pages([1])))).stored == (1,)
    finally:
        await bounded(store.aclose())
    with pytest.raises(ValueError):
        await bounded(BlockStore.open(tier, policy="nope"))
    await bounded(tier.aclose())
    with pytest.raises(TierClosedError):
        await bounded(BlockStore.open(tier))
    assert tier.statistics().slots_allocated == 0


async def test_resize_shrink_evicts_blocks_past_the_end(store_then_hold: Gate) -> None:
    async with open_store(8) as (tier, store):
        events = await Events.start(store)
        keys = list(range(8))
        await bounded(store.store(keys, pages(keys)))
        # Slots are taken in order here: key k is in slot k.
        assert store.discard([1]) == 1
        await bounded(store.resize(4 * SLOT))
        assert [k for k in keys if k in store] == [0, 2, 3]
        assert store.statistics().capacity == 4 == tier.slots_total
        assert await read(store, [0, 2, 3]) == [page(0), page(2), page(3)]
        assert (await events.next(3))[2] == ("evicted", (4, 5, 6, 7))
        await bounded(store.resize(8 * SLOT))
        await bounded(tier.wait_resident())
        result = await bounded(store.store([10, 11, 12, 13, 14], pages([10, 11, 12, 13, 14])))
        assert result.stored == (10, 11, 12, 13, 14) and len(store) == 8
        settled(tier, store)


async def test_resize_refuses_a_shrink_past_a_block_being_loaded(store_then_hold: Gate) -> None:
    gate = store_then_hold
    async with open_store(8) as (tier, store):
        keys = list(range(6))
        await bounded(store.store(keys, pages(keys)))
        hold(gate)
        dst = np.zeros((1, SLOT), dtype=np.uint8)
        load = asyncio.create_task(store.load([5], dst))
        await gate.started()
        with pytest.raises(QuotaError):
            await bounded(store.resize(4 * SLOT))
        assert [k for k in keys if k in store] == keys, "a refused shrink evicted blocks"
        assert tier.slots_total == 8 and store.statistics().evictions == 0
        await gate.release()
        await bounded(load)
        assert dst[0].tobytes() == page(5)
        await bounded(store.resize(4 * SLOT))
        assert [k for k in keys if k in store] == [0, 1, 2, 3]
        settled(tier, store)


async def test_length_tells_what_load_copies() -> None:
    async with HostTier(small_config()) as tier, BlockStore(tier) as store:
        await store.store([b"a", 7], [b"hello", bytearray(1000)])
        assert store.length(b"a") == 5 and store.length(bytearray(b"a")) == 5 and store.length(7) == 1000
        with pytest.raises(BlockNotFound) as info:
            store.length(b"missing")
        assert info.value.key == b"missing"
        with pytest.raises(TypeError):
            store.length(True)


async def test_slot_and_keys_tell_where_the_blocks_are() -> None:
    async with open_store(4) as (tier, store):
        await bounded(store.store([b"a", 7], pages([b"a", 7])))
        assert sorted(map(repr, store.keys())) == sorted(map(repr, [b"a", 7]))
        for key in (b"a", 7):
            assert bytes(tier.view(store.slot(key))) == page(key)
        assert store.slot(bytearray(b"a")) == store.slot(b"a") and store.slot(np.int64(7)) == store.slot(7)
        with pytest.raises(BlockNotFound) as info:
            store.slot(b"\x07")  # not the key 7
        assert info.value.key == b"\x07"
        with pytest.raises(TypeError):
            store.slot(True)
        store.discard([b"a"])
        assert store.keys() == [7]
        with pytest.raises(BlockNotFound):
            store.slot(b"a")


async def test_check_invariants_names_what_is_broken() -> None:
    async with open_store(4) as (tier, store):
        store.check_invariants(sole_user=True)
        await bounded(store.store([1, 2], pages([1, 2])))
        store.check_invariants(sole_user=True)
        other = await bounded(tier.allocate())  # another user of the tier: fine, unless the store is the only one
        store.check_invariants()
        with pytest.raises(AssertionError, match="3 slots allocated for 2 blocks"):
            store.check_invariants(sole_user=True)
        tier.free(other)
        tier.free(store.slot(1))  # behind the store's back
        with pytest.raises(AssertionError, match="invariant broken: a block's slot is not allocated in the tier"):
            store.check_invariants()
        await bounded(tier.allocate())  # the same slot again: the tier's books agree with the store's
        store.check_invariants()
    with pytest.raises(TierClosedError):
        store.check_invariants()


async def test_check_invariants_holds_the_policy_to_the_store() -> None:
    class Forgetful(LRUPolicy):
        """Takes no notice of new blocks."""

        __slots__ = ()

        def inserted_many(self, slots: Sequence[int] | npt.NDArray[np.int64], keys: Sequence[Key]) -> None:
            pass

    async with open_store(4, policy=Forgetful(4)) as (_, store):
        await bounded(store.store([1], pages([1])))
        with pytest.raises(AssertionError, match="a visible block the policy does not track"):
            store.check_invariants()


@pytest.mark.parametrize("wait", [True, False])
async def test_after_a_failed_fill_stores_evict_into_the_resident_slots(
    gate: PopulateGate, wait: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The slots past a failed fill can never be had: a full store evicts instead of skipping every block,
    and says so once for the failure, not once per call."""
    slot = 64 * KiB
    async with HostTier(small_config(quota=8 * MiB)) as tier, BlockStore(tier) as store:
        gate.allow(2)
        gate.fail(2)  # two 1 MiB units (32 slots) resident, then the fill fails
        with pytest.raises(FillError):
            await bounded(tier.wait_resident())
        first = np.arange(32, dtype=np.uint8)[:, None].repeat(slot, axis=1)
        result = await bounded(store.store(list(range(32)), first))
        assert result.stored == tuple(range(32)) and not result.skipped
        later = np.full((8, slot), 200, dtype=np.uint8)
        result = await bounded(store.store(list(range(100, 108)), later, wait=wait))
        assert result.stored == tuple(range(100, 108)) and not result.skipped
        stats = store.statistics()
        assert stats.evictions == 8 and stats.blocks == 32 and len(store) == 32
        assert all(k not in store for k in range(8)) and all(k in store for k in range(8, 32))
        back = np.zeros((8, slot), dtype=np.uint8)
        await bounded(store.load(list(range(100, 108)), back))
        assert (back == 200).all()
        assert tier.slots_ready == 0
        settled(tier, store)
        for key in range(200, 204):  # more full-tier stores after the failure: no more warnings
            await bounded(store.store([key], later[:1], wait=wait))
        warned = [r for r in caplog.records if "store evicts into resident slots" in r.getMessage()]
        assert len(warned) == 1


async def test_a_call_from_another_event_loop_is_refused_and_changes_nothing() -> None:
    """A store called from a loop other than its own skipped its keys and logged "the tier's fill failed"
    (the tier's own refusal of the wrong loop, taken for a fill failure); a resize raised the tier's
    message. Each is now the store's RuntimeError, before anything changes."""
    async with HostTier(small_config(slot_size=64 * KiB)) as tier, BlockStore(tier) as store:
        await store.store([b"kept"], [b"x" * 10])
        before = store.statistics()
        seen = await raised_on_another_loop(
            [
                lambda: store.store([b"a"], [b"y"]),
                lambda: store.load([b"kept"], [bytearray(10)]),
                lambda: store.resize(tier.statistics().quota),
                lambda: store.lookup_remote([b"kept"]),
            ]
        )
        assert len(seen) == 4, seen
        for exc in seen:
            assert type(exc) is RuntimeError, repr(exc)
            assert str(exc) == "this BlockStore belongs to the event loop that opened it; call it from that loop"
        assert store.statistics() == before and store.keys() == [b"kept"]
        store.check_invariants(sole_user=True)


async def test_a_store_over_something_that_is_not_a_tier_is_refused_where_it_is_built() -> None:
    """A config, None or a device number was taken, and the open failed with an AttributeError."""
    config = small_config(slot_size=64 * KiB)
    for tier in (config, None, "tier"):
        with pytest.raises(TypeError, match=r"tier is an open HostTier \(async with HostTier\(config\) as tier\)"):
            BlockStore(tier)  # type: ignore[arg-type]
    async with HostTier(config) as tier:
        with pytest.raises(TypeError, match=r"engine is a CopyEngine \(async with CopyEngine\(0\) as engine\)"):
            BlockStore(tier, 0)  # type: ignore[arg-type]
        async with BlockStore(tier) as store:  # and nothing was left behind
            assert len(store) == 0
