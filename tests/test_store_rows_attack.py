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
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from aiokvtier import StoreResult
from aiokvtier._host import _linux
from aiokvtier._host._rows import rows_from_slots
from aiokvtier._store import _transfers as transfers_module
from tests.test_store import SLOT, TIMEOUT, bounded, open_store, page, pages
from tests.test_store_attack import exact, whole

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
