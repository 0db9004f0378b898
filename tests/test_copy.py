"""CopyEngine and StaticHostMem without a GPU: host-to-host copies on the worker thread.

The planner, merging, the per-call cap, the refusals and the completion path
are the same code that feeds cuMemcpyBatchAsync on a GPU.
"""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest

from aiokvtier import CopyEngine, CopyPlanError, HostTier, SlotError, StaticHostMem, TierClosedError
from aiokvtier._copy._plan import plan

from .conftest import PopulateGate, fill_threads_alive, mappings_in
from .helpers import KiB, MiB, eventually, small_config

SLOT = 64 * KiB


def _pages(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, SLOT), dtype=np.uint8)


def test_plan_merges_runs_contiguous_on_both_sides_within_a_registration() -> None:
    src = np.array([0, 10, 20, 40, 50], dtype=np.uint64) * 1000
    dst = np.array([5, 15, 25, 35, 45], dtype=np.uint64) * 1000
    p = plan(dst, src, 10_000)
    assert p.requested == 5 and p.count == 2  # 0..20 merge; 40 leaves a gap in src; 50 follows 40
    assert p.sizes.tolist() == [30_000, 20_000] and p.dsts.tolist() == [5_000, 35_000]
    p = plan(dst, src, 10_000, src_reg=[0, 0, 1, 1, 1])  # a registration boundary before 20
    assert p.sizes.tolist() == [20_000, 10_000, 20_000]
    shuffled = plan(dst[::-1], src, 10_000)  # nothing is contiguous on both sides
    assert shuffled.count == 5 and shuffled.srcs.tolist() == sorted(src.tolist())
    by_dst = plan(dst[::-1], src, 10_000, order_by="dst")  # the host side of a D2H batch leads
    assert by_dst.dsts.tolist() == sorted(dst.tolist())
    with pytest.raises(ValueError, match="order_by"):
        plan(dst, src, 1, order_by="size")
    assert [c.stop - c.start for c in plan(np.arange(10) * 7, np.arange(10) * 9, 1).chunks(4)] == [4, 4, 2]
    with pytest.raises(ValueError):
        plan([1, 2], [3], 1)
    with pytest.raises(ValueError):
        plan([1], [3], 0)


def test_plan_registration_function_and_unsorted_input_give_the_same_plan() -> None:
    src = np.arange(8, dtype=np.uint64) * 100
    dst = np.arange(8, dtype=np.uint64) * 100 + 10_000

    def unit(addresses: np.ndarray) -> np.ndarray:
        return (addresses // 300).astype(np.int64)  # registrations start at 0, 300, 600

    by_function = plan(dst, src, 100, src_reg=unit)
    assert by_function.sizes.tolist() == [300, 300, 200] and by_function.srcs.tolist() == [0, 300, 600]
    assert plan(dst, src, 100, src_reg=unit(src)).sizes.tolist() == [300, 300, 200]
    order = np.random.default_rng(2).permutation(8)
    unsorted = plan(dst[order], src[order], 100, src_reg=unit)
    assert unsorted.srcs.tolist() == by_function.srcs.tolist() and unsorted.sizes.tolist() == [300, 300, 200]
    with pytest.raises(SlotError, match="twice"):
        plan(dst[[0, 1, 0]], src[:3], 100, order_by="dst", distinct_order_side=True)


def test_chunks_start_small_and_double_up_to_the_cap() -> None:
    p = plan(np.arange(5000) * 7, np.arange(5000) * 9, 1)
    assert [c.stop - c.start for c in p.chunks(1024)] == [128, 256, 512, 1024, 1024, 1024, 1024, 8]
    assert [c.stop - c.start for c in p.chunks(100)][:2] == [100, 100]
    assert sum(c.stop - c.start for c in p.chunks(1024, first=1)) == 5000


async def test_round_trip_shuffled_slots_bit_exact_and_merged() -> None:
    async with HostTier(small_config()) as tier, CopyEngine(None, max_batch=5) as engine:
        await tier.wait_resident()
        slots = await tier.allocate(48)
        pages = _pages(48)
        await engine.to_host(tier, slots, pages)  # contiguous: merges within each 1 MiB unit
        stats = engine.statistics()
        assert stats.copies_requested == 48 and stats.descriptors_submitted == 3 and stats.driver_calls == 1
        for i, s in enumerate(slots):
            assert bytes(tier.view(s)) == pages[i].tobytes()
        order = np.random.default_rng(1).permutation(48)
        out = np.zeros_like(pages)
        await engine.to_device(tier, [slots[i] for i in order], out)
        assert np.array_equal(out, pages[order])
        stats = engine.statistics()
        assert stats.jobs_completed == stats.jobs_submitted == 2
        assert stats.driver_calls == 1 + -(-(stats.descriptors_submitted - 3) // 5)  # the cap splits calls
        assert stats.bytes_copied == 2 * 48 * SLOT


async def test_slot_at_unit_edge_and_page_smaller_than_slot() -> None:
    async with HostTier(small_config()) as tier, CopyEngine(None) as engine:
        await tier.wait_resident()
        slots = await tier.allocate(34)
        edge = [15, 16, 31, 32, 33]
        half = np.random.default_rng(3).integers(0, 256, (5, SLOT // 2), dtype=np.uint8)
        await engine.to_host(tier, [slots[i] for i in edge], half)
        back = np.zeros_like(half)
        await engine.to_device(tier, [slots[i] for i in edge], back)
        assert np.array_equal(back, half)


async def test_planner_refusals_change_nothing() -> None:
    async with HostTier(small_config()) as tier, StaticHostMem(2 * SLOT) as stage, CopyEngine(None) as engine:
        await tier.wait_resident()
        slots = await tier.allocate(32)
        with pytest.raises(SlotError):
            await engine.to_device(tier, [slots[0], 40], _pages(2))
        with pytest.raises(SlotError):
            await engine.to_device(tier, [-1], _pages(1))
        with pytest.raises(SlotError, match="twice"):
            await engine.to_host(tier, [slots[0], slots[0]], _pages(2))
        with pytest.raises(ValueError, match="first dimension"):
            await engine.to_device(tier, slots[:3], _pages(2))
        with pytest.raises(CopyPlanError, match="does not fit"):
            await engine.to_device(tier, slots[:1], np.zeros((1, 2 * SLOT), np.uint8))
        with pytest.raises(ValueError, match="needs a CUDA device"):
            await engine.to_device(tier, slots[:1], _pages(1), after=0)
        # Slot 15 ends unit 0; reading two slots from it crosses into unit 1: the driver would refuse.
        with pytest.raises(CopyPlanError, match="two registrations"):
            await engine.copy([(stage.address, tier.address(slots[15]), 2 * SLOT)])
        assert not any(stage.view()) and engine.statistics().jobs_submitted == 0


async def test_copy_beyond_the_committed_prefix_is_refused(gate: PopulateGate) -> None:
    async with HostTier(small_config()) as tier, CopyEngine(None) as engine:
        gate.allow(1)
        await tier.wait_resident(MiB)
        slot = await tier.allocate()
        with pytest.raises(CopyPlanError, match="committed"):
            await engine.copy([(tier.address(slot), tier.address(slot) + MiB, SLOT)])
        gate.release_all()


async def test_tier_to_tier_and_static_buffer_copies() -> None:
    async with (
        HostTier(small_config()) as a,
        HostTier(small_config()) as b,
        StaticHostMem(4 * MiB) as stage,
        CopyEngine(None) as engine,
    ):
        await a.wait_resident()
        await b.wait_resident()
        sa, sb = await a.allocate(16), await b.allocate(16)
        pages = _pages(16, 7)
        await engine.to_host(a, sa, pages)
        # A whole unit in one copy, then the static buffer spanned whole.
        await engine.copy([(b.address(sb[0]), a.address(sa[0]), 16 * SLOT)])
        await engine.copy([(stage.address, b.address(sb[0]), MiB)])
        assert bytes(stage.view()[:MiB]) == pages.tobytes()
        await engine.copy([(stage.address + MiB, stage.address, MiB)])
        assert bytes(stage.view()[MiB : 2 * MiB]) == pages.tobytes()
        with pytest.raises(CopyPlanError, match="leaves"):
            await engine.copy([(stage.address + 3 * MiB, stage.address, 2 * MiB)])


async def test_cancelled_copy_is_delivered_once_the_copy_landed() -> None:
    tier = await HostTier.open(small_config())
    await tier.wait_resident()
    slots = await tier.allocate(1024)
    pages = np.random.default_rng(5).integers(0, 256, (1024, SLOT), dtype=np.uint8)
    async with CopyEngine(None, max_batch=1) as engine:
        order = np.random.default_rng(6).permutation(1024)  # shuffled: 1024 separate memmoves
        task = asyncio.create_task(engine.to_host(tier, [slots[i] for i in order], pages[order]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(tier.copies) == 0  # the cancellation arrived only once the copy had landed
        for i in (0, 511, 1023):
            assert bytes(tier.view(slots[i])) == pages[i].tobytes()
    base = tier.statistics().base_address
    gc.collect()
    await tier.aclose()
    assert not mappings_in(base, tier.config.max_quota)


async def test_engine_lifecycle() -> None:
    engine = CopyEngine(None)
    async with HostTier(small_config()) as tier:
        await tier.wait_resident()
        slots = await tier.allocate(1)
        with pytest.raises(TierClosedError):
            await engine.to_device(tier, slots, _pages(1))
        async with engine:
            await engine.to_host(tier, slots, _pages(1))
            assert "jobs 1/1" in repr(engine)
        await engine.aclose()
        with pytest.raises(TierClosedError):
            await engine.to_host(tier, slots, _pages(1))
    assert not [t for t in fill_threads_alive() if "copy" in t.name]
    with pytest.raises(ValueError):
        CopyEngine(None, streams=0)
    with pytest.raises(ValueError):
        CopyEngine(-1)


async def test_static_host_mem_lifecycle() -> None:
    with pytest.raises(ValueError):
        StaticHostMem(0)
    buf = await StaticHostMem.open(100_000)
    assert buf.size % 4096 == 0 and buf.size >= 100_000
    view = buf.view()
    view[:3] = b"abc"
    base = buf.address
    await buf.aclose()
    await buf.aclose()
    with pytest.raises(TierClosedError):
        buf.view()
    assert bytes(view[:3]) == b"abc" and not buf.released  # the view keeps it mapped
    view.release()
    del view
    gc.collect()
    await eventually(lambda: buf.released)  # on the buffer's thread, not the one that dropped the view
    assert not mappings_in(base, buf.size)


async def test_static_host_mem_on_a_numa_node() -> None:
    from aiokvtier._host._placement import read_placement
    from aiokvtier._sysinfo import online_nodes

    if not online_nodes():
        pytest.skip("this kernel exposes no NUMA nodes")
    async with StaticHostMem(2 * MiB, numa_node=0) as buf:
        assert buf.kind == "host" and buf.numa_policy in ("preferred", "first-touch")
        placement = read_placement(buf.address, buf.size)
        assert placement.pages_per_node.get(0, 0) * placement.kernel_page_size == 2 * MiB
        if buf.numa_policy == "preferred":
            assert placement.policy.startswith("prefer:0")


async def test_one_dimensional_integer_arrays_are_addresses() -> None:
    async with HostTier(small_config()) as tier, StaticHostMem(2 * SLOT) as stage, CopyEngine(None) as engine:
        await tier.wait_resident()
        slots = await tier.allocate(2)
        pages = _pages(2, 9)
        stage.view()[:] = pages.tobytes()
        # A numpy array of addresses, not a buffer; without a device they must lie in a known region.
        addresses = np.array([stage.address + SLOT, stage.address], dtype=np.uint64)
        await engine.to_host(tier, slots, addresses)
        assert bytes(tier.view(slots[0])) == pages[1].tobytes()
        assert engine.statistics().bytes_copied == 2 * SLOT
