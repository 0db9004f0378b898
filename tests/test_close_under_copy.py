"""Closing a tier under a copy over its memory, whoever issues the copy.

The tier's ``copies`` (one :class:`aiokvtier._regions.InflightCopies` per
region) is the one mechanism: the CopyEngine and the BlockStore's host
copies both register there before they start, and the tier's close and
shrink wait for what is registered. A copy that is not registered races the
unmap (before: a SIGSEGV when ``tier.aclose()`` ran under a host-mode store).
On asyncio and uvloop.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from aiokvtier import BlockStore, CopyEngine, HostTier, HostTierConfig, StaticHostMem, TierClosedError

from .helpers import MiB, eventually

SLOT = 2 * MiB
BLOCKS = 48  # 96 MiB per call: tens of milliseconds of memmove, long enough to close under


async def _open() -> tuple[HostTier, BlockStore]:
    tier = await HostTier.open(HostTierConfig(quota=BLOCKS * SLOT, max_quota=BLOCKS * SLOT, slot_size=SLOT))
    await tier.wait_resident()
    return tier, await BlockStore.open(tier)


def _keys(tag: int) -> list[bytes]:
    return [bytes([tag, i]) for i in range(BLOCKS)]


def _no_library_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith("aiokvtier-")]


async def _close_while_in_flight(tier: HostTier, call: asyncio.Task[object]) -> None:
    """Close the tier once ``call``'s copy is registered with it; the close must wait for that copy."""
    await asyncio.wait_for(eventually(lambda: len(tier.copies) > 0 or call.done(), within=5.0), 10.0)
    assert not call.done(), "the copy finished before the close could race it: make it longer"
    await asyncio.wait_for(tier.aclose(), 30.0)
    assert len(tier.copies) == 0  # the close returned only once the copy had let go of the slots


async def test_closing_the_tier_under_a_host_store_waits_for_the_copy() -> None:
    tier, store = await _open()
    try:
        pages = np.full((BLOCKS, SLOT), 7, dtype=np.uint8)
        call = asyncio.ensure_future(store.store(_keys(1), pages))
        await _close_while_in_flight(tier, call)
        result = await asyncio.wait_for(call, 10.0)
        assert len(result.stored) == BLOCKS  # the copy landed before the unmap
        with pytest.raises(TierClosedError):
            await store.load(_keys(1)[:1], np.empty((1, SLOT), dtype=np.uint8))
        with pytest.raises(TierClosedError):
            await store.store([b"late"], np.zeros((1, 16), dtype=np.uint8))
    finally:
        await store.aclose()
        await tier.aclose()
    await eventually(_no_library_threads)


async def test_closing_the_tier_under_a_host_load_waits_for_the_copy() -> None:
    tier, store = await _open()
    try:
        src = np.arange(BLOCKS * SLOT, dtype=np.uint64).view(np.uint8)[: BLOCKS * SLOT].reshape(BLOCKS, SLOT)
        await store.store(_keys(2), src)
        out = np.zeros((BLOCKS, SLOT), dtype=np.uint8)
        call = asyncio.ensure_future(store.load(_keys(2), out))
        await _close_while_in_flight(tier, call)
        await asyncio.wait_for(call, 10.0)
        assert np.array_equal(out, src)  # every byte read before the range went
    finally:
        await store.aclose()
        await tier.aclose()
    await eventually(_no_library_threads)


async def test_a_cancelled_host_load_still_holds_the_tiers_close() -> None:
    tier, store = await _open()
    try:
        await store.store(_keys(3), np.ones((BLOCKS, SLOT), dtype=np.uint8))
        out = np.zeros((BLOCKS, SLOT), dtype=np.uint8)
        call = asyncio.ensure_future(store.load(_keys(3), out))
        await asyncio.wait_for(eventually(lambda: len(tier.copies) > 0), 10.0)
        call.cancel()  # the cancellation waits for the copy; so does the close
        closing = asyncio.ensure_future(tier.aclose())
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.wait_for(closing, 30.0)
        assert bool((out == 1).all())
    finally:
        await store.aclose()
        await tier.aclose()


async def test_closing_the_tier_under_an_engine_copy_waits_for_it() -> None:
    """The same mechanism for a host-to-host CopyEngine's copy into a StaticHostMem."""
    tier = await HostTier.open(HostTierConfig(quota=BLOCKS * SLOT, max_quota=BLOCKS * SLOT, slot_size=SLOT))
    try:
        async with CopyEngine(None) as engine, StaticHostMem(BLOCKS * SLOT) as buf:
            await tier.wait_resident()
            slots = await tier.allocate(BLOCKS)
            for slot in slots:
                tier.view(slot)[:] = bytes([slot % 251]) * SLOT
            dst = np.frombuffer(buf.view(), dtype=np.uint8).reshape(BLOCKS, SLOT)
            call = asyncio.ensure_future(engine.to_device(tier, slots, dst))
            await _close_while_in_flight(tier, call)
            await asyncio.wait_for(call, 10.0)
            assert all(int(dst[i, -1]) == slot % 251 for i, slot in enumerate(slots))
    finally:
        await tier.aclose()
