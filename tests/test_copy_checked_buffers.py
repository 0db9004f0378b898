"""An array buffer's check, kept across requests: what may change under it is checked again.

The engine keeps the check of an array it copied to or from (its pages' addresses, the regions
they lie in), so that the next request of the same buffer skips it. These tests change what the
check depends on between two requests (the buffer closing, the tier it lies in shrinking, the
array's shape or flags) and expect the same answers as a first request gets.
"""

from __future__ import annotations

import ctypes
import gc
import weakref

import numpy as np
import pytest

from aiokvtier import CopyEngine, CopyPlanError, HostTier, StaticHostMem

from .helpers import KiB, MiB, closing_with_a_copy_held, small_config

SLOT = 64 * KiB


def _over(address: int, pages: int) -> np.ndarray:
    """A writable array of ``pages`` rows over memory nobody else's view keeps."""
    raw = (ctypes.c_uint8 * (pages * SLOT)).from_address(address)
    return np.frombuffer(raw, dtype=np.uint8).reshape(pages, SLOT)


async def _filled(tier: HostTier, engine: CopyEngine, n: int, seed: int) -> tuple[list[int], np.ndarray]:
    ids = await tier.allocate(n)
    pages = np.random.default_rng(seed).integers(0, 256, (n, SLOT), dtype=np.uint8)
    await engine.to_host(tier, ids, pages)
    return ids, pages


async def test_copies_through_one_array_land_where_its_pages_are() -> None:
    async with HostTier(small_config()) as tier, StaticHostMem(8 * SLOT) as stage, CopyEngine(None) as engine:
        await tier.wait_resident()
        ids, pages = await _filled(tier, engine, 4, 1)
        dst = _over(stage.address, 4)
        for order in ([0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0]):
            await engine.to_device(tier, [ids[i] for i in order], dst)
            assert np.array_equal(dst, pages[order])
        # The same pointer with fewer pages, then more: each its own check.
        await engine.to_device(tier, ids[:2], _over(stage.address, 2))
        assert np.array_equal(dst[:2], pages[:2])
        both = _over(stage.address, 8)
        await engine.to_device(tier, ids + ids, both)
        assert np.array_equal(both, np.concatenate([pages, pages]))


async def test_an_array_checked_before_is_refused_once_its_buffer_is_closing() -> None:
    async with HostTier(small_config()) as tier, CopyEngine(None) as engine:
        await tier.wait_resident()
        ids, pages = await _filled(tier, engine, 2, 2)
        stage = await StaticHostMem.open(2 * SLOT)
        dst = _over(stage.address, 2)
        await engine.to_device(tier, ids, dst)
        await engine.to_device(tier, ids, dst)  # a second request of the same buffer
        held, closing = await closing_with_a_copy_held(stage)
        before = engine.statistics().jobs_submitted
        for direction in (engine.to_device, engine.to_host):
            with pytest.raises(CopyPlanError, match="is closing"):
                await direction(tier, ids, dst)
        assert engine.statistics().jobs_submitted == before and not closing.done()
        assert [bytes(tier.view(i)) for i in ids] == [p.tobytes() for p in pages]
        held.set()
        await closing


async def test_an_array_over_a_tier_is_checked_again_after_a_shrink() -> None:
    async with (
        HostTier(small_config(quota=8 * MiB)) as tier,
        HostTier(small_config()) as other,
        CopyEngine(None) as engine,
    ):
        await tier.wait_resident()
        await other.wait_resident()
        ids, pages = await _filled(other, engine, 2, 3)
        base = tier.statistics().base_address
        dst = _over(base + 6 * MiB, 2)  # slots 96 and 97 of the tier: committed now
        await engine.to_device(other, ids, dst)
        await engine.to_device(other, ids, dst)
        assert np.array_equal(dst, pages)
        await tier.resize(4 * MiB)  # the array's memory is past the tier's slots now
        with pytest.raises(CopyPlanError, match="committed"):
            await engine.to_device(other, ids, dst)
        await tier.resize(8 * MiB)
        await tier.wait_resident()
        await engine.to_device(other, ids, dst)
        assert np.array_equal(dst, pages)


# The same array reshaped in place, as a caller still may: numpy 2.5 deprecates setting the shape
@pytest.mark.filterwarnings("ignore:Setting the shape on a NumPy array:DeprecationWarning")
async def test_an_array_reshaped_or_frozen_after_a_copy_is_checked_again() -> None:
    async with HostTier(small_config()) as tier, StaticHostMem(4 * SLOT) as stage, CopyEngine(None) as engine:
        await tier.wait_resident()
        ids, pages = await _filled(tier, engine, 2, 4)
        dst = _over(stage.address, 2)
        await engine.to_device(tier, ids, dst)
        dst.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            await engine.to_device(tier, ids, dst)
        await engine.to_host(tier, ids, dst)  # a read-only source is fine
        dst.flags.writeable = True
        dst.shape = (1, 2 * SLOT)  # one page of two slots' bytes
        with pytest.raises(CopyPlanError, match="does not fit"):
            await engine.to_device(tier, ids[:1], dst)
        dst.shape = (4, SLOT // 2)  # four half pages: four slots
        with pytest.raises(ValueError, match="one page per slot"):
            await engine.to_device(tier, ids, dst)
        await engine.to_device(tier, ids + ids, dst)
        halves = pages[:, : SLOT // 2]
        assert np.array_equal(dst, np.concatenate([halves, halves]))


async def test_a_checked_array_is_not_kept_alive() -> None:
    async with HostTier(small_config()) as tier, CopyEngine(None) as engine:
        await tier.wait_resident()
        ids, pages = await _filled(tier, engine, 2, 5)
        own = np.zeros((2, SLOT), dtype=np.uint8)  # the caller's own memory, in no region
        await engine.to_device(tier, ids, own)
        await engine.to_device(tier, ids, own)
        assert np.array_equal(own, pages)
        gone = weakref.ref(own)
        del own
        gc.collect()
        assert gone() is None
        stage = await StaticHostMem.open(2 * SLOT)
        await engine.to_device(tier, ids, _over(stage.address, 2))
        closed = weakref.ref(stage)
        await stage.aclose()
        del stage
        gc.collect()
        assert closed() is None
