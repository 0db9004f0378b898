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
from typing import Any

import numpy as np
import pytest

from aiokvtier._host import _linux
from aiokvtier._host._rows import rows_from_slots
from aiokvtier._store import _transfers as transfers_module
from tests.test_store import SLOT, TIMEOUT, bounded, open_store, page, pages
from tests.test_store_attack import whole

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
