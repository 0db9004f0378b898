"""A host store's pages given as the rows of one 2-D array are copied as rows (one numpy call on the store's
thread), other forms a ``memmove`` per page: every byte lands where a copy per page would put it, whichever
path a call takes, and the regions the rows lie in wait for the copy as they wait for any other."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from aiokvtier import BlockStore, CopyPlanError, HostTier, HostTierConfig, StaticHostMem
from aiokvtier._store import _transfers as transfers_module
from tests.conftest import PopulateGate
from tests.helpers import eventually
from tests.test_store import SLOT, bounded, open_store, page, pages, settled


class Paths:
    """Counts the copies each path made (the row copies wrapped where the store calls them)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = {"into": 0, "from": 0}
        for name, kind in (("rows_into_slots", "into"), ("rows_from_slots", "from")):
            monkeypatch.setattr(transfers_module, name, self._counted(getattr(transfers_module, name), kind))

    def _counted(self, real: Callable[..., None], kind: str) -> Callable[..., None]:
        def copy(*args: Any) -> None:
            self.calls[kind] += 1
            real(*args)

        return copy


async def test_a_page_array_goes_in_and_out_as_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    paths = Paths(monkeypatch)
    async with open_store(16) as (tier, store):
        src = pages(list(range(8)))
        assert (await bounded(store.store(list(range(8)), src))).stored == tuple(range(8))
        assert paths.calls == {"into": 1, "from": 0}
        dst = np.zeros_like(src)
        await bounded(store.load(list(range(8))[::-1], dst))  # the slots in another order than stored
        assert np.array_equal(dst, src[::-1]) and paths.calls["from"] == 1
        settled(tier, store)


async def test_some_keys_present_copy_only_the_missing_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    paths = Paths(monkeypatch)
    async with open_store(16) as (tier, store):
        await bounded(store.store([1, 4, 6], pages([1, 4, 6])))
        src = pages(list(range(8)))
        src[[1, 4, 6]] = 0xAB  # a present key's row is not copied: its block keeps what it held
        result = await bounded(store.store(list(range(8)), src))
        assert result.stored == (0, 2, 3, 5, 7) and result.present == (1, 4, 6)
        assert paths.calls["into"] == 2
        dst = np.zeros_like(src)
        await bounded(store.load(list(range(8)), dst))
        assert np.array_equal(dst, pages(list(range(8))))
        settled(tier, store)


@pytest.mark.parametrize("shape", ["wider", "list"])
async def test_loads_the_rows_path_does_not_take_land_as_before(monkeypatch: pytest.MonkeyPatch, shape: str) -> None:
    """Rows wider than the blocks, and a list of buffers, copy a ``memmove`` per page: each block lands in
    its row, the rest of a row stays."""
    paths = Paths(monkeypatch)
    async with open_store(16) as (tier, store):
        width = SLOT // 2 if shape == "wider" else SLOT
        await bounded(store.store([1, 2, 3], pages([1, 2, 3], width)))
        assert paths.calls["into"] == 1
        dst: Any = np.full((3, SLOT), 0xEE, dtype=np.uint8)
        if shape == "list":
            dst = [bytearray(b"\xee" * SLOT) for _ in range(3)]
        await bounded(store.load([3, 2, 1], dst))
        assert paths.calls["from"] == 0
        for key, row in zip([3, 2, 1], dst, strict=True):
            assert bytes(row[:width]) == page(key, width) and set(bytes(row[width:])) <= {0xEE}
        settled(tier, store)


async def test_rows_in_a_static_host_mem_hold_its_close_until_they_landed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store from an array over a StaticHostMem's memory: its close waits for the row copy, which
    lands whole; the store's thread is held inside the copy to make the close come first."""
    entered, gate = threading.Event(), threading.Event()
    real = transfers_module.rows_into_slots

    def held(*args: Any) -> None:
        entered.set()
        assert gate.wait(30), "the gate was never opened"
        real(*args)

    monkeypatch.setattr(transfers_module, "rows_into_slots", held)
    async with open_store(16) as (tier, store):
        mem = await bounded(StaticHostMem.open(8 * SLOT))
        src = np.frombuffer(mem.view(), dtype=np.uint8).reshape(8, SLOT)
        src[:] = pages(list(range(8)))
        storing = asyncio.ensure_future(store.store(list(range(8)), src))
        await eventually(entered.is_set)
        closing = asyncio.ensure_future(mem.aclose())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not closing.done() and len(mem.copies) == 1  # the row copy still reads its memory
        del src
        await asyncio.to_thread(gate.set)
        assert (await bounded(storing)).stored == tuple(range(8))
        await bounded(closing)
        dst = np.zeros((8, SLOT), dtype=np.uint8)
        await bounded(store.load(list(range(8)), dst))
        assert np.array_equal(dst, pages(list(range(8))))
        settled(tier, store)


@pytest.mark.parametrize("form", ["array", "list"])
async def test_pages_whose_region_closed_while_the_store_waited_are_refused(gate: PopulateGate, form: str) -> None:
    """A store of pages in a StaticHostMem waits for the fill; the StaticHostMem closes meanwhile: the copy
    is refused (the pages' region was located when the call began), nothing is stored, no slot kept."""
    opening = asyncio.ensure_future(StaticHostMem.open(4 * SLOT))
    while not opening.done():  # the buffer's own populate calls go through; the tier's fill then waits
        gate.allow(gate.calls)
        await asyncio.sleep(0.001)
    mem = await bounded(opening)
    cfg = HostTierConfig(quota=64 * SLOT, max_quota=64 * SLOT, slot_size=SLOT, commit_unit=8 * SLOT)
    async with HostTier(cfg) as tier, BlockStore(tier) as store:
        rows = np.frombuffer(mem.view(), dtype=np.uint8).reshape(4, SLOT)
        src: Any = rows if form == "array" else list(rows)
        storing = asyncio.ensure_future(store.store([1, 2, 3, 4], src))  # no slot resident yet: it waits
        for _ in range(5):
            await asyncio.sleep(0)
        assert not storing.done()
        await bounded(mem.aclose())
        gate.release_all()
        with pytest.raises(CopyPlanError, match="closed after the pages were checked"):
            await bounded(storing)
        del src, rows
        assert len(store) == 0 and store.statistics().stores == 0
        settled(tier, store)
