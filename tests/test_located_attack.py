"""Pages located when the call begins, under attack, on asyncio and uvloop.

``CopyEngine.pages()`` and a ``BlockStore`` call locate the caller's pages once,
when the call begins (``Pages.checked_at``); a copy started later locates them
again only where a region closed or shrank since (``aiokvtier._regions.generation``),
and refuses pages whose region closed meanwhile. Here the regions change while
the pages wait: their own buffer closes (and a new one is mapped at its address),
other regions open, close and shrink, a tier the pages lie in shrinks past them,
and the waiting call is cancelled at each of its awaits.

Pages over a region's memory are built from its address (``ctypes``), not
through a view that would keep it mapped: a copy the library failed to refuse
would read or write memory the region let go. Every await is bounded.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from aiokvtier import (
    BlockStore,
    CopyEngine,
    CopyPlanError,
    DiskTier,
    DiskTierConfig,
    HostTier,
    HostTierConfig,
    StaticHostMem,
    StoreResult,
)
from aiokvtier._store._transfers import Transfers
from aiokvtier.testing import RecordingBackend

from .conftest import PopulateGate
from .helpers import eventually
from .test_cancellation import cancel_during, sweep

T = TypeVar("T")
SLOT = 4096
UNIT = 4 * SLOT
"""A tier's commit unit, and what one populate call fills."""
TIMEOUT = 10.0


async def bounded(aw: Awaitable[T]) -> T:
    return await asyncio.wait_for(aw, TIMEOUT)


def config(slots: int) -> HostTierConfig:
    return HostTierConfig(quota=slots * SLOT, max_quota=slots * SLOT, slot_size=SLOT, commit_unit=UNIT, fill_chunk=UNIT)


def raw(address: int, rows: int, row: int = SLOT) -> np.ndarray:
    """A writable ``(rows, row)`` array over the memory at ``address``, which it does not keep mapped."""
    return np.frombuffer((ctypes.c_ubyte * (rows * row)).from_address(address), dtype=np.uint8).reshape(rows, row)


def pattern(n: int, seed: int, row: int = SLOT) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, row), dtype=np.uint8)


def untouched(store: BlockStore, tier: HostTier, *regions: Any) -> None:
    """No store or load in flight, nothing pinned or claimed, no copy tracked by any region."""
    stats = store.statistics()
    assert stats.in_flight == 0 and stats.blocks_pinned == 0
    assert tier.statistics().slots_allocated == len(store) == stats.blocks
    store.check_invariants(sole_user=True)
    for region in (tier, *regions):
        assert len(region.copies) == 0


@pytest.fixture
def host_engines(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A store copies through the host-to-host engine it was given: the engine path without a GPU."""
    monkeypatch.setattr(Transfers, "host_engines", True)
    yield


async def through(gate: PopulateGate, opening: Awaitable[T]) -> T:
    """``opening``, with every populate call made meanwhile let through (a held store's tier stays held:
    the gate holds its addresses)."""
    task = asyncio.ensure_future(opening)

    async def drive() -> T:
        while not task.done():
            gate.allow(gate.calls)
            await asyncio.sleep(0.001)
        return await task

    try:
        return await bounded(drive())
    finally:
        if not task.done():
            task.cancel()


async def turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


# -- the engine: pages checked by CopyEngine.pages(), copied by start() ------------------------------


@asynccontextmanager
async def engine_rig(**backend: Any) -> AsyncIterator[tuple[HostTier, CopyEngine, RecordingBackend]]:
    recording = RecordingBackend(memmove=True, **backend)
    async with HostTier(config(16)) as tier, CopyEngine(None, backend=recording) as engine:
        await bounded(tier.wait_resident())
        yield tier, engine, recording


@pytest.mark.parametrize("form", ["addresses", "array"])
async def test_pages_whose_buffer_closed_are_refused_and_a_buffer_mapped_there_since_is_not_theirs(form: str) -> None:
    """The pages' StaticHostMem closes; a new one is mapped (at its address, where the kernel gives it back):
    start() refuses the old pages and writes nothing into the new buffer; pages checked afresh at that address
    lie in the new buffer, and copy there."""
    async with engine_rig() as (tier, engine, recording):
        slots = await bounded(tier.allocate(2))
        tier.view(slots[0])[:] = bytes(pattern(1, 1))
        tier.view(slots[1])[:] = bytes(pattern(1, 2))
        old = await bounded(StaticHostMem.open(2 * SLOT))
        at = old.address
        given: Any = [at, at + SLOT] if form == "addresses" else raw(at, 2)
        checked = engine.pages(given, 2, page=SLOT, writable=True)
        assert checked.regions == (old,) and checked.checked_at is not None
        await bounded(old.aclose())
        new = await bounded(StaticHostMem.open(2 * SLOT))
        try:
            mine = raw(new.address, 2)
            mine[:] = 0xAB
            for pages in (checked, checked.take([1, 0])):
                with pytest.raises(CopyPlanError, match="closed after the pages were checked"):
                    engine.start(tier, slots, pages, "h2d")
            assert recording.issued == [] and len(new.copies) == 0 and (mine == 0xAB).all()
            if new.address == at:  # the same address, the new buffer's: it is located, not taken for the old one
                fresh = engine.pages(given, 2, page=SLOT, writable=True)
                assert fresh.regions == (new,)
                await bounded(engine.start(tier, slots, fresh, "h2d").done)
                assert np.array_equal(mine, np.concatenate([pattern(1, 1), pattern(1, 2)]))
        finally:
            await bounded(new.aclose())
        assert len(tier.copies) == 0


async def test_other_regions_opening_closing_and_shrinking_leave_checked_pages_copied_right() -> None:
    """Pages in a StaticHostMem keep their check while other regions come and go (each move of the regions'
    generation has them located again): every copy lands right, tracked by their buffer, whose close waits."""
    async with engine_rig() as (tier, engine, recording), StaticHostMem(4 * SLOT) as stage:
        slots = await bounded(tier.allocate(4))
        data = pattern(4, 3)
        raw(stage.address, 4)[:] = data
        checked = engine.pages([stage.address + i * SLOT for i in range(4)], 4, page=SLOT, writable=False)
        subset = checked.take([3, 1])
        assert subset.checked_at == checked.checked_at is not None

        async def copied() -> None:
            for slot in slots:
                tier.view(slot)[:] = bytes(SLOT)
            await bounded(engine.start(tier, slots, checked, "d2h").done)
            await bounded(engine.start(tier, slots[:2], subset, "d2h").done)
            assert [bytes(tier.view(s)) for s in slots] == [bytes(data[i]) for i in (3, 1, 2, 3)]

        await copied()  # nothing moved
        other = await bounded(StaticHostMem.open(SLOT))
        await copied()  # a region opened
        async with HostTier(config(16)) as third:
            await bounded(third.wait_resident())
            await bounded(third.resize(4 * SLOT))  # a shrink elsewhere: a snapshot
            await copied()
        await bounded(other.aclose())  # a close elsewhere
        await copied()
        assert len(recording.issued) == 8
        # Held in flight: the skipped location still tracks the buffer, whose close waits for the copy.
        recording.hold = True
        started = engine.start(tier, slots, checked, "d2h")
        await bounded(recording.wait_issued(9))
        closing = asyncio.ensure_future(stage.aclose())
        await turns()
        assert not closing.done() and len(stage.copies) == 1
        recording.release()
        await bounded(started.done)
        await bounded(closing)
        assert stage.released and len(tier.copies) == 0


@pytest.mark.parametrize("mixed", [False, True])
async def test_pages_over_a_tier_are_located_before_each_copy_and_refused_once_it_shrank_past_them(
    mixed: bool,
) -> None:
    """Pages in another tier's committed memory (with a StaticHostMem's, or alone) carry no kept check: the
    tier's shrink past them between the check and start() refuses the copy; pages below the cut still copy."""
    async with (
        engine_rig() as (tier, engine, recording),
        HostTier(config(16)) as other,
        StaticHostMem(SLOT) as stage,
    ):
        await bounded(other.wait_resident())
        slots = await bounded(tier.allocate(2))
        low, high = other.base_address, other.base_address + 12 * SLOT
        raw(low, 1)[:] = pattern(1, 4)
        raw(stage.address, 1)[:] = pattern(1, 5)
        first = stage.address if mixed else low
        checked = engine.pages([first, high], 2, page=SLOT, writable=False)
        assert checked.checked_at is None and other in checked.regions
        below = engine.pages([low, first if mixed else low + SLOT], 2, page=SLOT, writable=False)
        await bounded(other.resize(8 * SLOT))  # past ``high``
        with pytest.raises(CopyPlanError, match="committed range"):
            engine.start(tier, slots, checked, "d2h")
        with pytest.raises(CopyPlanError, match="committed range"):
            engine.start(tier, slots[1:], checked.take([1]), "d2h")
        assert recording.issued == []
        await bounded(engine.start(tier, slots, below, "d2h").done)
        assert bytes(tier.view(slots[0])) == bytes(pattern(1, 4))
        await bounded(other.aclose())
        with pytest.raises(CopyPlanError, match="closed after the pages were checked"):
            engine.start(tier, slots, below, "d2h")
        assert len(recording.issued) == 1 and len(stage.copies) == 0 and len(tier.copies) == 0


# -- the store: pages located when the call begins ------------------------------------------------


@asynccontextmanager
async def held_store(
    gate: PopulateGate, engine: CopyEngine | None = None, resident: int = 0
) -> AsyncIterator[tuple[HostTier, BlockStore]]:
    """A store whose tier's fill is held by ``gate`` past its first ``resident`` commit units (other
    populate calls pass): a store call waits for slots."""
    async with HostTier(config(8)) as tier, BlockStore(tier, engine=engine) as store:
        gate.hold_addresses([tier.base_address + unit * UNIT for unit in range(resident, 8 * SLOT // UNIT)])
        gate.allow(1 << 60)
        try:
            yield tier, store
        finally:
            gate.release_all()  # before the tier's close, which joins its fill thread


def source(form: str, address: int, n: int) -> Any:
    rows = raw(address, n)
    if form == "array":
        return rows
    if form == "list":
        return [memoryview(row) for row in rows]
    return [address + i * SLOT for i in range(n)]  # addresses, for an engine


@pytest.mark.parametrize("form", ["array", "list"])
async def test_a_store_waiting_while_its_buffer_closes_and_another_is_mapped_there_stores_nothing(
    gate: PopulateGate, form: str
) -> None:
    """A store of pages over a StaticHostMem waits for the fill; the buffer closes and a new one is mapped
    meanwhile (at its address where the kernel gives it back): refused, nothing stored, the new buffer's bytes
    not read as the old pages."""
    old = await through(gate, StaticHostMem.open(4 * SLOT))
    raw(old.address, 4)[:] = pattern(4, 6)
    async with held_store(gate) as (tier, store):
        storing = asyncio.ensure_future(store.store([1, 2, 3, 4], source(form, old.address, 4)))
        await turns()
        assert not storing.done()
        await bounded(old.aclose())
        new = await through(gate, StaticHostMem.open(4 * SLOT))
        gate.release_all()
        with pytest.raises(CopyPlanError, match="closed after the pages were checked"):
            await bounded(storing)
        assert len(store) == 0 and store.statistics().stores == 0
        untouched(store, tier, new)
        await bounded(new.aclose())


@pytest.mark.parametrize("form", ["array", "list"])
@pytest.mark.parametrize("change", ["shrink", "close"])
async def test_a_store_waiting_while_the_tier_its_pages_lie_in_shrinks_or_closes_stores_nothing(
    gate: PopulateGate, form: str, change: str
) -> None:
    """Pages in another tier's committed memory: the store waits for its fill while that tier shrinks past
    them (or closes): refused with CopyPlanError, not a copy of memory handed back."""
    other = await through(gate, HostTier.open(config(16)))
    try:
        await through(gate, other.wait_resident())
        at = other.base_address + 12 * SLOT
        raw(at, 2)[:] = pattern(2, 7)
        async with held_store(gate) as (tier, store):
            storing = asyncio.ensure_future(store.store([1, 2], source(form, at, 2)))
            await turns()
            assert not storing.done()
            if change == "shrink":
                await bounded(other.resize(8 * SLOT))
            else:
                await bounded(other.aclose())
            gate.release_all()
            with pytest.raises(CopyPlanError, match="committed range" if change == "shrink" else "closed after"):
                await bounded(storing)
            assert len(store) == 0 and store.statistics().stores == 0
            untouched(store, tier, other)
    finally:
        await bounded(other.aclose())


@pytest.mark.parametrize("form", ["array", "list"])
async def test_a_store_waiting_while_other_regions_come_and_go_stores_its_pages_right(
    gate: PopulateGate, form: str
) -> None:
    """The pages' own buffer stays open while other regions open, shrink and close: the store copies them
    right, tracked by their buffer (its close afterwards is clean)."""
    stage = await through(gate, StaticHostMem.open(4 * SLOT))
    data = pattern(4, 8)
    raw(stage.address, 4)[:] = data
    async with held_store(gate) as (tier, store):
        storing = asyncio.ensure_future(store.store([1, 2, 3, 4], source(form, stage.address, 4)))
        await turns()
        other = await through(gate, StaticHostMem.open(SLOT))
        third = await through(gate, HostTier.open(config(16)))
        await through(gate, third.wait_resident())
        await bounded(third.resize(4 * SLOT))
        await bounded(third.aclose())
        await bounded(other.aclose())
        assert not storing.done()
        gate.release_all()
        assert await bounded(storing) == StoreResult(stored=(1, 2, 3, 4), present=(), skipped=())
        out = np.zeros((4, SLOT), dtype=np.uint8)
        await bounded(store.load([1, 2, 3, 4], out))
        assert np.array_equal(out, data)
        untouched(store, tier, stage)
    await bounded(stage.aclose())
    assert stage.released


async def test_a_store_waiting_on_another_calls_claim_is_refused_once_its_buffer_closed(gate: PopulateGate) -> None:
    """A store waits on another call's claim of its key; that call is cancelled (nothing stored) and this
    one takes the key over, after its pages' buffer closed: refused, nothing stored or claimed."""
    stage = await through(gate, StaticHostMem.open(SLOT))
    async with held_store(gate) as (tier, store):
        first = asyncio.ensure_future(store.store([1], pattern(1, 9)))
        await turns()
        second = asyncio.ensure_future(store.store([1], raw(stage.address, 1)))
        await turns()
        assert not first.done() and not second.done()
        await bounded(stage.aclose())
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await bounded(first)
        gate.release_all()
        with pytest.raises(CopyPlanError, match="closed after the pages were checked"):
            await bounded(second)
        assert len(store) == 0 and store.statistics().stores == 0
        untouched(store, tier)


async def test_own_blocks_as_sources_stay_pinned_while_the_store_waits_and_as_destinations_are_refused(
    gate: PopulateGate,
) -> None:
    """Pages in the store's own blocks: as a store's sources they stay pinned (never evicted for the call's
    room) while it waits for the fill; as a load's destination they are refused."""
    async with held_store(gate, resident=1) as (tier, store):
        await eventually(lambda: tier.slots_ready >= 4, TIMEOUT)
        data = pattern(4, 10)
        await bounded(store.store([1, 2, 3, 4], data))
        sources = [tier.address(store.slot(k)) for k in (1, 2)]
        storing = asyncio.ensure_future(store.store([5, 6, 7], [*(raw(a, 1)[0] for a in sources), data[3]]))
        await turns()
        assert not storing.done() and store.statistics().blocks_pinned == 2
        gate.release_all()
        assert (await bounded(storing)).stored == (5, 6, 7)
        assert all(k in store for k in (1, 2, 5, 6, 7))
        out = np.zeros((3, SLOT), dtype=np.uint8)
        await bounded(store.load([5, 6, 7], out))
        assert np.array_equal(out, data[[0, 1, 3]])
        with pytest.raises(ValueError, match="a block of this store"):
            await bounded(store.load([5], [raw(sources[0], 1)[0]]))
        untouched(store, tier)


# -- the store through an engine (host_engines: the engine path without a GPU) --------------------


async def test_a_store_through_an_engine_waiting_while_its_buffer_closes_stores_nothing(
    gate: PopulateGate, host_engines: None
) -> None:
    recording = RecordingBackend(memmove=True)
    stage = await through(gate, StaticHostMem.open(2 * SLOT))
    async with CopyEngine(None, backend=recording) as engine, held_store(gate, engine) as (tier, store):
        storing = asyncio.ensure_future(store.store([1, 2], source("addresses", stage.address, 2)))
        await turns()
        assert not storing.done()
        await bounded(stage.aclose())
        gate.release_all()
        with pytest.raises(CopyPlanError, match="closed after the pages were checked"):
            await bounded(storing)
        assert recording.issued == [] and len(store) == 0
        untouched(store, tier)


@asynccontextmanager
async def spilled(engine: CopyEngine, path: Path) -> AsyncIterator[tuple[HostTier, BlockStore, DiskTier]]:
    """A store over a disk tier whose two half-slot blocks live on disk only (a load brings them back)."""
    disk_config = await asyncio.to_thread(DiskTierConfig, quota=64 * SLOT, path=path)
    async with (
        HostTier(config(8)) as tier,
        DiskTier(disk_config, block_size=SLOT, fingerprint="located") as disk,
        StaticHostMem(2 * SLOT) as warm,
    ):
        await bounded(tier.wait_resident())
        async with BlockStore(tier, disk=disk, admit_after=1, engine=engine) as store:
            data = pattern(2, 11, SLOT // 2)
            raw(warm.address, 2, SLOT // 2)[:] = data
            await bounded(store.store([b"a", b"b"], raw(warm.address, 2, SLOT // 2)))
            await bounded(store.load([b"a", b"b"], raw(warm.address, 2)))  # a hit: written back
            await eventually(lambda: store.statistics().written_back == 2, TIMEOUT)
            await bounded(store.store([b"o%d" % i for i in range(8)], raw(warm.address, 8, SLOT // 4)))
            assert b"a" not in store and b"b" not in store
            yield tier, store, disk


@pytest.mark.parametrize("device", [None, 0])
async def test_a_load_of_short_blocks_waiting_on_the_disk_refuses_pages_whose_buffer_closed(
    device: int | None, host_engines: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Blocks shorter than the destination pages are copied by a raw copy, not by start(): a load of them
    waits for the disk while its pages' StaticHostMem closes (and a new one is mapped, at its address where
    the kernel gives it back): refused, nothing issued, the new buffer untouched."""
    recording = RecordingBackend(memmove=device is None)
    async with CopyEngine(device, backend=recording) as engine, spilled(engine, tmp_path) as (tier, store, disk):
        dst = await bounded(StaticHostMem.open(2 * SLOT))
        at = dst.address
        reading, asked = asyncio.Event(), asyncio.Event()
        real = disk.read

        async def read(keys: list[bytes], addresses: list[int]) -> tuple[bool, ...]:
            asked.set()
            await reading.wait()
            return await real(keys, addresses)

        monkeypatch.setattr(disk, "read", read)
        before = len(recording.issued)
        loading = asyncio.ensure_future(store.load([b"a", b"b"], [at, at + SLOT]))
        await bounded(asked.wait())
        await bounded(dst.aclose())
        new = await bounded(StaticHostMem.open(2 * SLOT))
        mine = raw(new.address, 2)
        mine[:] = 0xAB
        reading.set()
        try:
            with pytest.raises(CopyPlanError):
                await bounded(loading)
            assert recording.issued[before:] == [] and (mine == 0xAB).all()
            untouched(store, tier, new)
        finally:
            await bounded(new.aclose())


# -- cancellation of the waiting call -------------------------------------------------------------


@pytest.mark.parametrize("path", ["host", "engine"])
async def test_a_waiting_store_cancelled_at_each_await_leaves_nothing_behind(
    gate: PopulateGate, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store of pages over a StaticHostMem, waiting for the fill, cancelled at each of its awaits: nothing
    claimed, pinned or tracked afterwards; then the fill comes, the same pages store right and the buffer
    closes cleanly."""
    if path == "engine":  # else the store leaves its host-to-host engine aside: the host path
        monkeypatch.setattr(Transfers, "host_engines", True)
    recording = RecordingBackend(memmove=True)
    stage = await through(gate, StaticHostMem.open(2 * SLOT))
    data = pattern(2, 12)
    raw(stage.address, 2)[:] = data
    form = "array" if path == "host" else "addresses"
    async with CopyEngine(None, backend=recording) as engine, held_store(gate, engine) as (tier, store):
        for how, delay in sweep(seed=17, delays=(0, 0.0005, 0.001, 0.005, 0.01), taskgroup=3, cancels=3):
            outcome = await cancel_during(lambda: store.store([1, 2], source(form, stage.address, 2)), how, delay)
            assert outcome.cancelled, (how, delay)
            untouched(store, tier, stage)
            assert len(store) == 0
        assert recording.issued == []
        gate.release_all()
        assert (await bounded(store.store([1, 2], source(form, stage.address, 2)))).stored == (1, 2)
        out = np.zeros((2, SLOT), dtype=np.uint8)
        await bounded(store.load([1, 2], out))
        assert np.array_equal(out, data)
        untouched(store, tier, stage)
    await bounded(stage.aclose())
    assert stage.released


@pytest.mark.parametrize("path", ["host", "engine"])
async def test_a_load_waiting_on_the_disk_cancelled_at_each_await_leaves_nothing_behind(
    path: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A load of short blocks into a StaticHostMem, waiting for the disk, cancelled at each of its awaits (a
    read under way runs to its end first): nothing pinned, claimed or tracked afterwards; the load then lands
    right and the buffer closes cleanly."""
    if path == "engine":
        monkeypatch.setattr(Transfers, "host_engines", True)
    async with CopyEngine(None, backend=RecordingBackend(memmove=True)) as engine:
        async with spilled(engine, tmp_path) as (tier, store, disk), StaticHostMem(2 * SLOT) as dst:
            real = disk.read

            async def read(keys: list[bytes], addresses: list[int]) -> tuple[bool, ...]:
                await asyncio.sleep(0.02)  # longer than the delays swept: the cancellation lands while it waits
                return await real(keys, addresses)

            monkeypatch.setattr(disk, "read", read)
            given = source("array" if path == "host" else "addresses", dst.address, 2)
            for how, delay in sweep(seed=23, delays=(0, 0.0005, 0.001, 0.005, 0.01), taskgroup=3, cancels=3):
                outcome = await cancel_during(lambda: store.load([b"a", b"b"], given), how, delay)
                assert outcome.cancelled, (how, delay)
                untouched(store, tier, dst)
            await bounded(store.load([b"a", b"b"], given))
            assert np.array_equal(raw(dst.address, 2)[:, : SLOT // 2], pattern(2, 11, SLOT // 2))
            untouched(store, tier, dst)
        assert dst.released
