"""A host store's row copies (pages given as the rows of one 2-D uint8 array) under attack: rows over the
store's own tier and over other regions, regions closed or shrunk while a row copy is held on the store's
thread, cancellation at every await, a row copy that fails half way, odd arrays, and subsets of rows mixed
with waits on another call's claim.

The row copies are held, slowed or failed where the store calls them (``rows_into_slots`` and
``rows_from_slots`` in ``aiokvtier._store._transfers``, wrapped with monkeypatch). After every attack the
store is whole (``whole``) and every visible key loads the exact bytes it was stored with (``exact``).
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from aiokvtier import BlockStore, HostTier, HostTierConfig, StaticHostMem, StoreResult
from aiokvtier._host import _linux
from aiokvtier._host._rows import rows_from_slots
from aiokvtier._store import _transfers as transfers_module
from tests.helpers import eventually
from tests.test_cancellation import cancel_during, sweep
from tests.test_store import SLOT, TIMEOUT, bounded, open_store, page, pages
from tests.test_store_attack import cancel_after, exact, whole

HALF = SLOT // 2


class Rows:
    """One of the store's row copies, wrapped where the store calls it, on the store's thread.

    Every call is recorded; ``hold()`` makes the next call wait until its event is set; ``fail``
    calls fail after copying their first row (``MemoryError``); ``delay`` slows every call. A call
    that ran to its end checks, over the memory it copied, that every row landed whole (``landed``).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.real: Callable[..., None] = getattr(transfers_module, name)
        self.into = name == "rows_into_slots"
        self.calls = 0
        self.entered = threading.Event()
        self.fail = 0
        self.delay = 0.0
        self.landed: list[bool] = []
        self._next: threading.Event | None = None
        monkeypatch.setattr(transfers_module, name, self._copy)

    def hold(self) -> threading.Event:
        """Hold the next call until the event returned is set (from the loop: ``asyncio.to_thread(ev.set)``)."""
        self.entered.clear()
        self._next = threading.Event()
        return self._next

    def _copy(self, *args: Any) -> None:
        self.calls += 1
        gate, self._next = self._next, None
        self.entered.set()
        if gate is not None:
            assert gate.wait(TIMEOUT), "the held row copy was never let through"
        if self.delay:
            time.sleep(self.delay)
        if self.fail:
            self.fail -= 1
            self.real(*self._first_row(*args))
            raise MemoryError("injected: the row copy ran out of memory after its first row")
        self.real(*args)
        self.landed.append(self._whole(*args))

    def _first_row(self, base: int, size: int, slot_size: int, slots: Any, pages: Any, last: Any) -> tuple[Any, ...]:
        if self.into:
            rows = np.arange(len(slots), dtype=np.int64) if last is None else last
            return (base, size, slot_size, slots[:1], pages, rows[:1])
        return (base, size, slot_size, slots[:1], pages[:1], last)

    def _whole(self, base: int, size: int, slot_size: int, slots: Any, pages: Any, last: Any) -> bool:
        """Whether the slots and the rows hold the same bytes (read while the regions wait for this copy)."""
        count = size // slot_size
        memory = np.frombuffer((ctypes.c_ubyte * (count * slot_size)).from_address(base), dtype=np.uint8)
        tier = memory.reshape(count, slot_size)
        if self.into:
            rows = np.asarray(pages) if last is None else np.asarray(pages)[last]
            return bool(np.array_equal(tier[slots, : rows.shape[1]], rows))
        return bool(np.array_equal(tier[slots, :last], np.asarray(pages)[:, :last]))


@pytest.fixture
def into(monkeypatch: pytest.MonkeyPatch) -> Rows:
    return Rows(monkeypatch, "rows_into_slots")


@pytest.fixture
def out(monkeypatch: pytest.MonkeyPatch) -> Rows:
    return Rows(monkeypatch, "rows_from_slots")


async def let_through(gate: threading.Event) -> None:
    await asyncio.to_thread(gate.set)


async def turns(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def over(address: int, rows: int, width: int) -> np.ndarray:
    """A writable ``(rows, width)`` array over memory at ``address`` (that keeps none of it mapped)."""
    memory = (ctypes.c_ubyte * (rows * width)).from_address(address)
    return np.frombuffer(memory, dtype=np.uint8).reshape(rows, width)


def consecutive(slots: list[int]) -> bool:
    return slots == list(range(slots[0], slots[0] + len(slots)))


# -- blocks shorter than the slot, loaded into rows of their width -----------------------------------


@pytest.mark.parametrize("width", [1, SLOT // 4, SLOT - 1, SLOT])
async def test_blocks_load_into_rows_of_their_own_width(width: int, into: Rows, out: Rows) -> None:
    """Blocks of ``width`` bytes copied out into an array ``width`` wide: the whole-row path. The tier's
    reservation runs past its quota (inaccessible there): the copy reads the blocks' slots only."""
    async with open_store(16) as (tier, store):
        keys = list(range(10))
        assert (await bounded(store.store(keys, pages(keys, width)))).stored == tuple(keys)
        dst = np.zeros((10, width), dtype=np.uint8)
        await bounded(store.load(keys[::-1], dst))
        assert np.array_equal(dst, pages(keys[::-1], width))
        twice = [3, 9, 3]  # one block into two rows
        dst = np.zeros((3, width), dtype=np.uint8)
        await bounded(store.load(twice, dst))
        assert np.array_equal(dst, pages(twice, width))
        assert into.calls == 1 and out.calls == 2 and into.landed == [True] and out.landed == [True, True]
        whole(tier, store, keys)


@pytest.mark.parametrize("width", [64, SLOT])
def test_rows_from_slots_reads_the_slots_it_is_given_only(width: int) -> None:
    """A mapping of four slots of which only the second is accessible: copying out of it reads nothing else."""
    base, length = _linux.mmap_reserve(4 * SLOT, SLOT)
    try:
        _linux.mprotect(base + SLOT, SLOT, writable=True)
        over(base + SLOT, 1, SLOT)[:] = pages([7])
        dst = np.full((3, width), 0xEE, dtype=np.uint8)
        rows_from_slots(base, 4 * SLOT, SLOT, np.array([1, 1, 1], dtype=np.int64), dst, width)
        assert all(row.tobytes() == page(7)[:width] for row in dst)
        with pytest.raises(IndexError):
            rows_from_slots(base, 4 * SLOT, SLOT, np.array([1, 4], dtype=np.int64), dst[:2], width)
    finally:
        _linux.munmap(base, length)


# -- rows over the store's own tier ---------------------------------------------------------------------


@pytest.mark.parametrize("how", ["several slots", "one slot"])
async def test_rows_over_the_stores_own_blocks_are_pinned_sources(how: str, into: Rows) -> None:
    """The rows of an array over blocks of the store itself (several slots, or halves of one block's view):
    the call pins those blocks, so the room it makes evicts others; a present key's row is not copied
    (its block keeps its bytes), the others land bit-exact from the blocks they lay in."""
    async with open_store(5) as (tier, store):
        first = [10, 11, 12, 13]
        await bounded(store.store(first, pages(first)))  # one slot left; 10 is the least recently used
        slots = [store.slot(k) for k in first]
        assert consecutive(slots)
        view: memoryview | None = None
        if how == "several slots":
            src = over(tier.address(slots[0]), 3, SLOT)  # rows over 10, 11 and 12
            keys = [1, 12, 2]
            result = await bounded(store.store(keys, src))
            assert result == StoreResult(stored=(1, 2), present=(12,), skipped=())
            gone, want = 13, {1: page(10), 2: page(12)}
        else:
            view = tier.view(slots[0])
            src = np.frombuffer(view, dtype=np.uint8).reshape(2, HALF)  # two pages in block 10
            result = await bounded(store.store([1, 2], src))
            assert result == StoreResult(stored=(1, 2), present=(), skipped=())
            gone, want = 11, {1: page(10)[:HALF], 2: page(10)[HALF:]}
        assert gone not in store and all(k in store for k in first if k != gone)
        assert into.calls == 2 and into.landed == [True, True]
        for key, data in want.items():
            dst = np.zeros((1, len(data)), dtype=np.uint8)
            await bounded(store.load([key], dst))
            assert dst.tobytes() == data
        del src
        if view is not None:
            view.release()
        store.discard([1, 2])
        whole(tier, store, [1, 2, *first])
        await exact(store)


async def exact_width(store: BlockStore, keys: list[Any], width: int) -> None:
    dst = np.zeros((len(keys), width), dtype=np.uint8)
    await bounded(store.load(keys, dst))
    assert np.array_equal(dst, pages(keys, width))


@pytest.mark.parametrize("width", [SLOT, HALF])
async def test_a_load_into_rows_over_the_stores_own_tier(width: int, out: Rows) -> None:
    """Rows over a block of the store would overwrite it: refused, nothing copied or pinned, even where
    only one row of several lies there. Rows over slots of the same tier that the caller holds are the
    caller's memory: the load copies into them."""
    async with open_store(8) as (tier, store):
        keys = [1, 2, 3]
        await bounded(store.store(keys, pages(keys, width)))
        slots = [store.slot(k) for k in keys]
        foreign = await bounded(tier.allocate(2))
        assert consecutive([*slots, *foreign])
        refused = [
            over(tier.address(slots[1]), 1, width),  # in block 2
            over(tier.address(slots[2]) + SLOT - width, 2, width),  # the end of block 3, then the caller's slot
        ]
        for dst in refused:
            with pytest.raises(ValueError, match="a block of this store"):
                await bounded(store.load(keys[: len(dst)], dst))
            assert store.statistics().blocks_pinned == 0
        assert out.calls == 0
        await exact_width(store, keys, width)
        dst = over(tier.address(foreign[0]), 2, width)
        await bounded(store.load([3, 1], dst))
        assert np.array_equal(dst, pages([3, 1], width))
        assert bytes(tier.view(foreign[0]))[:width] == page(3, width)
        assert out.calls == 2 and out.landed == [True, True]
        del dst, refused
        tier.free_many(foreign)
        whole(tier, store, keys)


# -- regions closed or shrunk while a row copy is held -----------------------------------------------


async def test_a_held_load_into_rows_over_a_static_host_mem_holds_its_close(out: Rows) -> None:
    """A load into an array over a StaticHostMem's view: its close waits for the row copy, which lands
    whole; the view the array holds keeps the memory mapped until the array goes."""
    async with open_store(8) as (tier, store):
        keys = list(range(4))
        await bounded(store.store(keys, pages(keys)))
        mem = await bounded(StaticHostMem.open(4 * SLOT))
        dst = np.frombuffer(mem.view(), dtype=np.uint8).reshape(4, SLOT)
        gate = out.hold()
        loading = asyncio.ensure_future(store.load(keys[::-1], dst))
        await eventually(out.entered.is_set)
        closing = asyncio.ensure_future(mem.aclose())
        await turns()
        assert not closing.done() and len(mem.copies) == 1
        assert store.statistics().blocks_pinned == 4
        await let_through(gate)
        await bounded(loading)
        await bounded(closing)
        assert out.landed == [True] and np.array_equal(dst, pages(keys[::-1]))
        assert not mem.released
        del dst
        await eventually(lambda: mem.released)
        whole(tier, store, keys)


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("change", ["close", "shrink"])
async def test_a_held_row_copy_over_another_tier_holds_its_close_and_shrink(
    direction: str, change: str, into: Rows, out: Rows
) -> None:
    """Rows over slots of another tier (an array over several of its slots, holding none of them mapped),
    as the source of a store or the destination of a load: that tier's close or shrink waits for the row
    copy, which lands whole."""
    rows = into if direction == "store" else out
    cfg = HostTierConfig(quota=8 * SLOT, max_quota=16 * SLOT, slot_size=SLOT, commit_unit=4 * SLOT, fill_chunk=8 * SLOT)
    async with open_store(8) as (tier, store):
        other = await bounded(HostTier.open(cfg))
        try:
            await bounded(other.wait_resident())
            held = await bounded(other.allocate(3))
            assert consecutive(held)
            array = over(other.address(held[0]), 3, SLOT)
            keys = [5, 6, 7]
            if direction == "store":
                array[:] = pages(keys)
                call = store.store(keys, array)
            else:
                await bounded(store.store(keys, pages(keys)))
                call = store.load(keys, array)
            gate = rows.hold()
            copying = asyncio.ensure_future(call)
            await eventually(rows.entered.is_set)
            changing = asyncio.ensure_future(other.aclose() if change == "close" else other.resize(4 * SLOT))
            await turns()
            assert not changing.done() and len(other.copies) == 1
            await let_through(gate)
            result = await bounded(copying)
            if direction == "store":
                assert result == StoreResult(stored=tuple(keys), present=(), skipped=())
            await bounded(changing)
            assert rows.landed == [True]
            if change == "shrink":
                assert other.slots_total == 4 and np.array_equal(array, pages(keys))
            del array
            await exact(store)
            whole(tier, store, keys)
        finally:
            await bounded(other.aclose())
        assert other.released


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("change", ["close", "shrink"])
async def test_a_held_row_copy_holds_the_stores_own_tier_close_and_shrink(
    direction: str, change: str, into: Rows, out: Rows
) -> None:
    """The store's own tier closed or shrunk (past slots nobody holds) while one of its row copies is held:
    the close or shrink waits for it, the copy lands whole and the call ends as if nothing happened."""
    rows = into if direction == "store" else out
    async with open_store(8) as (tier, store):
        keys = [1, 2, 3]
        src = pages(keys)
        dst = np.zeros_like(src)
        if direction == "load":
            await bounded(store.store(keys, src))
        gate = rows.hold()
        copying = asyncio.ensure_future(store.store(keys, src) if direction == "store" else store.load(keys, dst))
        await eventually(rows.entered.is_set)
        changing = asyncio.ensure_future(tier.aclose() if change == "close" else tier.resize(4 * SLOT))
        await turns()
        assert not changing.done() and len(tier.copies) == 1
        await let_through(gate)
        result = await bounded(copying)
        await bounded(changing)
        assert rows.landed == [True]
        if direction == "store":
            assert result == StoreResult(stored=tuple(keys), present=(), skipped=())
        else:
            assert np.array_equal(dst, src)
        stats = store.statistics()
        assert stats.in_flight == 0 and stats.blocks_pinned == 0 and stats.blocks == 3
        if change == "shrink":
            assert tier.slots_total == 4
            whole(tier, store, keys)
            await exact(store)
    assert tier.released


# -- cancellation ---------------------------------------------------------------------------------------


def whole_rows_or_none(dst: np.ndarray, keys: list[Any]) -> None:
    for key, row in zip(keys, dst, strict=True):
        assert not row.any() or row.tobytes() == page(key), f"the row of {key!r} is torn"


async def test_cancelled_row_stores_leave_each_key_whole_or_absent(into: Rows) -> None:
    """Stores of rows (a present key among them: a subset of rows) cancelled by ``wait_for``, a TaskGroup and
    ``task.cancel()`` at delays from before the first step to past the (slowed) copy, in a tier that
    evicts: afterwards nothing is in flight or pinned, one slot per block, every key whole or absent."""
    into.delay = 0.002
    async with open_store(8) as (tier, store):
        universe: list[int] = []
        cancelled = 0
        for case, (how, delay) in enumerate(sweep(11, delays=(0, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.02))):
            keys = [case * 10 + i for i in range(4)] + universe[-1:]
            universe += keys[:4]
            outcome = await cancel_during(partial(store.store, keys, pages(keys)), how, delay)
            cancelled += outcome.cancelled
            if not outcome.cancelled:  # the present key may have been evicted since: stored again
                result = outcome.result
                assert result is not None and set(keys[:4]) <= set(result.stored) and not result.skipped
            whole(tier, store, universe)
            await exact(store)
        assert 0 < cancelled < len(universe) // 4
        assert into.landed.count(True) == len(into.landed)


async def test_cancelled_row_loads_write_whole_rows_or_none(out: Rows) -> None:
    """Loads into rows cancelled at swept delays: each row is its block whole or untouched, the blocks
    stay, and nothing stays pinned."""
    out.delay = 0.002
    async with open_store(8) as (tier, store):
        keys = list(range(8))
        await bounded(store.store(keys, pages(keys)))
        cancelled = 0
        for how, delay in sweep(12, delays=(0, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.02)):
            dst = np.zeros((8, SLOT), dtype=np.uint8)
            outcome = await cancel_during(partial(store.load, keys[::-1], dst), how, delay)
            cancelled += outcome.cancelled
            if outcome.cancelled:
                whole_rows_or_none(dst, keys[::-1])
            else:
                assert np.array_equal(dst, pages(keys[::-1]))
            whole(tier, store, keys)
        assert cancelled
        await exact(store)


async def test_row_stores_and_loads_cancelled_after_each_step(into: Rows, out: Rows) -> None:
    """``task.cancel()`` after 0, 1, 2... loop iterations: at every await a row store or load has."""
    async with open_store(6) as (tier, store):
        universe: list[int] = []
        for steps in range(10):
            keys = [steps * 10 + i for i in range(3)] + universe[-2:]
            universe += keys[:3]
            await cancel_after(partial(store.store, keys, pages(keys)), steps)
            whole(tier, store, universe)
            here = [k for k in universe if k in store]
            dst = np.zeros((len(here), SLOT), dtype=np.uint8)
            if not await cancel_after(partial(store.load, here, dst), steps):
                assert np.array_equal(dst, pages(here))
            else:
                whole_rows_or_none(dst, here)
            whole(tier, store, universe)
            await exact(store)
        assert into.landed.count(True) == len(into.landed) and out.landed.count(True) == len(out.landed)


# -- a row copy that fails ------------------------------------------------------------------------------


@pytest.mark.parametrize("present", [False, True])
async def test_a_failing_row_store_keeps_nothing_and_lets_its_regions_close(present: bool, into: Rows) -> None:
    """The row copy fails after writing its first row: the store raises, no key of it is stored (not even
    the row that landed), no slot is kept, and the StaticHostMem it read closes (the copy let go)."""
    async with open_store(8) as (tier, store):
        before = [1, 2]
        await bounded(store.store(before, pages(before)))
        keys = [5, 1, 6, 7] if present else [5, 6, 7]
        async with StaticHostMem(len(keys) * SLOT) as mem:
            src = np.frombuffer(mem.view(), dtype=np.uint8).reshape(len(keys), SLOT)
            src[:] = pages(keys)
            into.fail = 1
            with pytest.raises(MemoryError, match="injected"):
                await bounded(store.store(keys, src))
            assert not any(k in store for k in (5, 6, 7)) and 1 in store
            whole(tier, store, sorted({*before, *keys}))
            del src
        assert (await bounded(store.store(keys, pages(keys)))).stored == (5, 6, 7)  # no claim left behind
        whole(tier, store, sorted({*before, *keys}))
        await exact(store)


async def test_a_failing_row_load_unpins_and_lets_its_regions_close(out: Rows) -> None:
    """The row copy of a load fails after its first row: the load raises, nothing stays pinned or in
    flight, the blocks stay whole, and the StaticHostMem the rows lie in closes."""
    async with open_store(8) as (tier, store):
        keys = [1, 2, 3]
        await bounded(store.store(keys, pages(keys)))
        async with StaticHostMem(3 * SLOT) as mem:
            dst = np.frombuffer(mem.view(), dtype=np.uint8).reshape(3, SLOT)
            out.fail = 1
            with pytest.raises(MemoryError, match="injected"):
                await bounded(store.load(keys, dst))
            whole_rows_or_none(dst, keys)
            whole(tier, store, keys)
            await bounded(store.load(keys, dst))
            assert np.array_equal(dst, pages(keys))
            del dst
        await exact(store)


# -- some rows only, beside another call's claim -------------------------------------------------------


@pytest.mark.parametrize("other", ["lands", "fails", "waiter cancelled"])
async def test_a_subset_of_rows_beside_another_calls_claim(other: str, into: Rows) -> None:
    """A call storing four rows finds two of its keys claimed by a call whose row copy is held: it copies
    its other two rows (a subset, queued behind the held copy), then waits for the claim and finds them
    stored (``lands``), or stores them itself from its own rows once the other call failed (``fails``).
    Cancelled before its copy landed, it keeps none of its keys."""
    async with open_store(8) as (tier, store):
        gate = into.hold()
        first = asyncio.ensure_future(store.store([1, 2], pages([1, 2])))
        await eventually(into.entered.is_set)
        keys = [3, 1, 0, 2]
        second = asyncio.ensure_future(store.store(keys, pages(keys)))
        await turns()
        assert store.statistics().in_flight == 2 and not second.done()
        if other == "fails":
            into.fail = 1  # the held copy, the first to run
        if other == "waiter cancelled":
            second.cancel()
        await let_through(gate)
        if other == "fails":
            with pytest.raises(MemoryError):
                await bounded(first)
            assert await bounded(second) == StoreResult(stored=(3, 1, 0, 2), present=(), skipped=())
            assert into.calls == 3  # the retry copied rows 1 and 3 of its own pages
        else:
            assert (await bounded(first)).stored == (1, 2)
            if other == "lands":
                assert await bounded(second) == StoreResult(stored=(3, 0), present=(1, 2), skipped=())
            else:
                with pytest.raises(asyncio.CancelledError):
                    await bounded(second)
                assert 3 not in store and 0 not in store
            assert into.calls == 2
        assert into.landed.count(True) == len(into.landed)
        whole(tier, store, [0, 1, 2, 3])
        await exact(store)


# -- odd arrays -----------------------------------------------------------------------------------------


def odd_sources() -> dict[str, Callable[[], Any]]:
    """Arrays for keys 1, 2, 3 that a store refuses."""
    return {
        "columns strided": lambda: pages([1, 2, 3], 2 * SLOT)[:, ::2],
        "rows strided": lambda: pages([1, 9, 2, 9, 3])[::2],
        "fortran order": lambda: np.asfortranarray(pages([1, 2, 3])),
        "reversed": lambda: pages([3, 2, 1])[::-1],
        "a row too many": lambda: pages([1, 2, 3, 4]),
        "no rows": lambda: np.zeros((0, SLOT), dtype=np.uint8),
        "int8": lambda: pages([1, 2, 3]).view(np.int8),
        "uint16": lambda: pages([1, 2, 3]).view(np.uint16),
        "bool": lambda: np.ones((3, SLOT), dtype=np.bool_),
        "1-D": lambda: pages([1, 2, 3]).reshape(-1),
        "3-D": lambda: pages([1, 2, 3]).reshape(3, 2, HALF),
        "rows wider than a slot": lambda: pages([1, 2, 3], SLOT + 1),
        "rows of no bytes": lambda: np.zeros((3, 0), dtype=np.uint8),
    }


@pytest.mark.parametrize("case", list(odd_sources()))
async def test_odd_source_arrays_are_refused_and_change_nothing(case: str, into: Rows) -> None:
    async with open_store(8) as (tier, store):
        await bounded(store.store([2], pages([2])))
        before = store.statistics()
        with pytest.raises(ValueError, match=r"2-D uint8|C-contiguous|one page per key|does not fit|empty page"):
            await bounded(store.store([1, 2, 3], odd_sources()[case]()))
        assert store.statistics() == before and into.calls == 1
        assert 1 not in store and 3 not in store
        whole(tier, store, [1, 2, 3])
        await exact(store)


class Hostile(np.ndarray):
    """An ndarray that refuses its own indexing and notes every numpy function called on it (``used``): its
    rows are to be copied where they lie, with none of its code run on the store's thread."""

    used: ClassVar[list[str]] = []

    def __getitem__(self, item: Any) -> Any:
        raise RuntimeError("this array's indexing is not to be used")

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        Hostile.used.append(func.__name__)
        return NotImplemented  # numpy then runs its own implementation


def matrix(array: np.ndarray) -> Any:
    return np.asmatrix(array)


def masked(array: np.ndarray) -> Any:
    return np.ma.masked_array(array, mask=np.eye(*array.shape, dtype=bool))  # the data is what is copied


def hostile(array: np.ndarray) -> Any:
    return array.view(Hostile)


def one_byte_rows_with_odd_strides(array: np.ndarray) -> Any:
    """(n, 1) rows whose unused column stride is odd: still C-contiguous (a stride of a length-1 axis)."""
    return np.lib.stride_tricks.as_strided(array, strides=(array.strides[0], 99))


WRAPS: dict[str, Callable[[np.ndarray], Any]] = {
    "matrix": matrix,
    "masked": masked,
    "recarray": lambda a: a.view(np.recarray),
    "hostile subclass": hostile,
    "read-only": lambda a: np.frombuffer(a.tobytes(), dtype=np.uint8).reshape(a.shape),
}


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("present", [False, True])
@pytest.mark.parametrize("wrap", list(WRAPS))
async def test_odd_but_valid_arrays_copy_their_rows_in_memory(wrap: str, present: bool, into: Rows, out: Rows) -> None:
    """Subclasses of ndarray (their own indexing never used) and read-only sources: stored whole (every row,
    or the rows of the keys not present) and loaded back into the same kind of array (a writable one)."""
    Hostile.used.clear()
    async with open_store(8) as (tier, store):
        if present:
            await bounded(store.store([2], pages([2])))
        keys = [1, 2, 3]
        result = await bounded(store.store(keys, WRAPS[wrap](pages(keys))))
        assert result.stored == ((1, 3) if present else (1, 2, 3)) and into.landed == [True] * into.calls
        dst = WRAPS[wrap](np.zeros((3, SLOT), dtype=np.uint8)) if wrap != "read-only" else np.zeros((3, SLOT), np.uint8)
        await bounded(store.load(keys[::-1], dst))
        assert np.array_equal(np.ndarray.view(dst, np.ndarray), pages(keys[::-1])) and out.landed == [True]
        assert Hostile.used == []
        whole(tier, store, keys)


async def test_one_byte_rows_with_an_odd_unused_stride(into: Rows, out: Rows) -> None:
    async with open_store(8) as (tier, store):
        keys = [1, 2, 3]
        src = one_byte_rows_with_odd_strides(pages(keys, 1))
        assert src.flags.c_contiguous
        assert (await bounded(store.store(keys, src))).stored == tuple(keys)
        dst = one_byte_rows_with_odd_strides(np.zeros((3, 1), dtype=np.uint8))
        await bounded(store.load(keys, dst))
        assert dst.tobytes() == b"".join(page(k, 1) for k in keys) and into.calls == out.calls == 1
        whole(tier, store, keys)


def odd_destinations() -> dict[str, Callable[[], Any]]:
    """Destinations for keys 1, 2, 3 that a load refuses."""
    return {
        "read-only bytes": lambda: np.frombuffer(bytes(3 * SLOT), dtype=np.uint8).reshape(3, SLOT),
        "read-only flag": lambda: read_only(np.zeros((3, SLOT), dtype=np.uint8)),
        "broadcast": lambda: np.broadcast_to(np.zeros(SLOT, dtype=np.uint8), (3, SLOT)),
        "columns strided": lambda: np.zeros((3, 2 * SLOT), dtype=np.uint8)[:, ::2],
        "fortran order": lambda: np.zeros((3, SLOT), dtype=np.uint8, order="F"),
        "a row short": lambda: np.zeros((2, SLOT), dtype=np.uint8),
        "uint16": lambda: np.zeros((3, HALF), dtype=np.uint16),
        "rows shorter than the blocks": lambda: np.zeros((3, SLOT - 1), dtype=np.uint8),
    }


def read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


@pytest.mark.parametrize("case", list(odd_destinations()))
async def test_odd_destination_arrays_are_refused_and_copy_nothing(case: str, out: Rows) -> None:
    async with open_store(8) as (tier, store):
        keys = [1, 2, 3]
        await bounded(store.store(keys, pages(keys)))
        dst = odd_destinations()[case]()
        before = np.array(dst, copy=True)
        with pytest.raises(ValueError, match=r"read-only|2-D uint8|C-contiguous|one page per key|has \d+ bytes"):
            await bounded(store.load(keys, dst))
        assert np.array_equal(dst, before) and out.calls == 0
        assert store.statistics().loads == 0
        whole(tier, store, keys)


async def test_memmaps_as_sources_and_destinations(tmp_path: Path, into: Rows, out: Rows) -> None:
    """numpy memmaps of a file: a read-only one is a source (and refused as a destination), a writable one
    and a copy-on-write one take a load."""
    keys = [1, 2, 3]
    path = tmp_path / "pages"

    def make(mode: str) -> np.memmap[Any, np.dtype[np.uint8]]:
        return np.memmap(path, dtype=np.uint8, mode=mode, shape=(3, SLOT))

    def write(array: Any) -> None:
        array[:] = pages(keys)
        array.flush()

    async with open_store(8) as (tier, store):
        writable = await asyncio.to_thread(make, "w+")
        await asyncio.to_thread(write, writable)
        src = await asyncio.to_thread(make, "r")
        assert (await bounded(store.store(keys, src))).stored == tuple(keys)
        with pytest.raises(ValueError, match="read-only"):
            await bounded(store.load(keys, src))
        for mode in ("r+", "c"):
            dst = await asyncio.to_thread(make, mode)
            dst[:] = 0
            await bounded(store.load(keys[::-1], dst))
            assert np.array_equal(dst, pages(keys[::-1]))
        assert into.calls == 1 and out.calls == 2
        del writable, src, dst
        whole(tier, store, keys)


async def test_no_keys_and_no_rows(into: Rows, out: Rows) -> None:
    async with open_store(8) as (tier, store):
        assert await bounded(store.store([], np.zeros((0, SLOT), dtype=np.uint8))) == StoreResult((), (), ())
        await bounded(store.load([], np.zeros((0, SLOT), dtype=np.uint8)))
        await bounded(store.load([], np.zeros((0, 0), dtype=np.uint8)))
        assert into.calls == out.calls == 0
        whole(tier, store)
