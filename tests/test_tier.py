"""HostTier end to end, on real reserved and populated memory."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import types

import anyio
import numpy as np
import pytest

import aiokvtier
from aiokvtier import (
    DecommitError,
    FillError,
    HostTier,
    NumaPolicyError,
    OutOfSlots,
    QuotaError,
    SlotError,
    TierClosedError,
    WouldBlock,
)
from aiokvtier._host import _linux
from aiokvtier._host._backing import HostBacking

from .conftest import PopulateGate, fill_threads_alive, mappings_in, proc_text, smaps_flags
from .helpers import GiB, HostBackings, KiB, MiB, eventually, small_config

SLOTS_PER_UNIT = 16  # small_config: 1 MiB units of 64 KiB slots


async def test_open_returns_before_the_fill_and_reserves_far_above_ram() -> None:
    huge = 1 << 44  # 16 TiB of address space: far above this machine's RAM
    cfg = aiokvtier.HostTierConfig(quota="2GiB", max_quota=huge, slot_size="64KiB")
    async with HostTier(cfg) as tier:
        stats = tier.statistics()
        assert stats.max_quota == huge and stats.quota == 2 * GiB
        assert stats.resident_bytes < stats.target_bytes == 2 * GiB
        assert mappings_in(stats.base_address, huge)
        slot = await tier.allocate()
        assert slot == 0
        await tier.wait_resident()
        stats = tier.statistics()
        assert stats.resident_bytes == stats.target_bytes and not stats.filling
        assert stats.fill_seconds > 0
    assert not mappings_in(stats.base_address, huge)
    assert not fill_threads_alive()


async def test_allocation_waits_only_for_its_unit(gate: PopulateGate) -> None:
    async with HostTier(small_config()) as tier:
        assert tier.statistics().resident_bytes == 0
        with pytest.raises(WouldBlock):
            tier.allocate_nowait()
        task = asyncio.create_task(tier.allocate())
        await asyncio.sleep(0.02)
        assert not task.done()
        gate.allow(1)
        assert await task == 0
        # The rest of unit 0 is resident: no wait; unit 1 is not.
        assert [tier.allocate_nowait() for _ in range(SLOTS_PER_UNIT - 1)] == list(range(1, SLOTS_PER_UNIT))
        with pytest.raises(WouldBlock):
            tier.allocate_nowait()
        many = asyncio.create_task(tier.allocate_many(SLOTS_PER_UNIT * 2))
        gate.allow(2)
        await asyncio.sleep(0.02)
        assert not many.done()  # needs unit 2 too
        gate.allow(3)
        assert await many == list(range(SLOTS_PER_UNIT, SLOTS_PER_UNIT * 3))
        assert tier.statistics().resident_bytes == 3 * MiB
        gate.release_all()


async def test_freed_slots_are_reused_most_recent_first() -> None:
    async with HostTier(small_config()) as tier:
        await tier.wait_resident()
        slots = await tier.allocate(5)
        assert slots == [0, 1, 2, 3, 4]
        tier.free(1)
        tier.free(3)
        assert await tier.allocate() == 3
        assert tier.allocate_nowait() == 1
        assert await tier.allocate() == 5
        tier.free_many([0, 2])
        assert await tier.allocate(3) == [2, 0, 6]
        tier.free_many([6, 4])
        ids = await tier.allocate_ids(3)  # the same order, as an int64 array
        assert ids.dtype == np.int64 and ids.tolist() == [4, 6, 7]
        tier.free_many(ids)
        assert tier.statistics().slots_allocated == 5
        with pytest.raises(ValueError):
            await tier.allocate_ids(0)


async def test_out_of_slots_and_bad_frees_change_nothing() -> None:
    async with HostTier(small_config(quota=1 * MiB, max_quota=1 * MiB)) as tier:
        slots = await tier.allocate(SLOTS_PER_UNIT)
        with pytest.raises(OutOfSlots):
            tier.allocate_nowait()
        with pytest.raises(OutOfSlots):
            await tier.allocate()
        with pytest.raises(ValueError):
            await tier.allocate(0)
        tier.free(slots[0])
        for bad in (slots[0], -1, SLOTS_PER_UNIT, 10**9, "1", None):
            with pytest.raises(SlotError):
                tier.free(bad)  # type: ignore[arg-type]
        with pytest.raises(SlotError):
            tier.free_many([slots[1], slots[0]])  # slot 0 is already free: nothing is freed
        assert tier.statistics().slots_allocated == SLOTS_PER_UNIT - 1
        with pytest.raises(SlotError):
            tier.view(slots[0])
        with pytest.raises(SlotError):
            tier.address(slots[0])
        assert issubclass(SlotError, ValueError)


async def test_views_are_writable_and_addresses_are_slot_strided() -> None:
    cfg = small_config()
    async with HostTier(cfg) as tier:
        a, b = await tier.allocate(2)
        assert tier.address(b) - tier.address(a) == cfg.slot_size
        assert tier.address(a) == tier.base_address
        va, vb = tier.view(a), tier.view(b)
        assert len(va) == cfg.slot_size and not va.readonly
        va[:] = b"\x01" * len(va)
        vb[-3:] = b"xyz"
        assert bytes(tier.view(a)[:4]) == b"\x01" * 4 and bytes(vb[-3:]) == b"xyz"
        assert tier.statistics().views_exported == 2
        va.release()
        vb.release()
        gc.collect()
        assert tier.statistics().views_exported == 0


async def test_close_with_live_view_defers_unmap_and_view_stays_valid() -> None:
    tier = await HostTier.open(small_config())
    slot = await tier.allocate()
    view = tier.view(slot)
    view[:5] = b"hello"
    base, size = tier.statistics().base_address, tier.config.max_quota
    await tier.aclose()
    await tier.aclose()  # idempotent
    assert tier.closed and not tier.released
    with pytest.raises(TierClosedError):
        tier.view(slot)
    with pytest.raises(TierClosedError):
        await tier.allocate()
    with pytest.raises(TierClosedError):
        tier.allocate_nowait()
    assert bytes(view[:5]) == b"hello"  # still mapped: no crash
    assert mappings_in(base, size)
    view.release()
    del view
    gc.collect()
    await eventually(lambda: tier.released)  # released on the tier's thread, not the one that dropped the view
    assert not mappings_in(base, size)
    await eventually(lambda: not fill_threads_alive())


async def test_wait_resident_and_blocking_variant(gate: PopulateGate) -> None:
    async with HostTier(small_config()) as tier:
        with pytest.raises(RuntimeError, match="block the event loop"):
            tier.wait_resident_blocking(0)
        with pytest.raises(ValueError):
            await tier.wait_resident(tier.statistics().quota + 1)
        with pytest.raises(TimeoutError):
            await anyio.to_thread.run_sync(tier.wait_resident_blocking, 2 * MiB, 0.05)
        waiter = asyncio.create_task(tier.wait_resident(5 * MiB))
        blocked = asyncio.create_task(anyio.to_thread.run_sync(tier.wait_resident_blocking, 5 * MiB, 30))
        gate.allow(4)
        await asyncio.sleep(0.05)
        assert not waiter.done() and not blocked.done()
        gate.allow(5)
        await waiter
        await blocked
        gate.release_all()
        await tier.wait_resident()
        assert tier.statistics().resident_bytes == 64 * MiB


async def test_many_waiters_share_one_wakeup_per_publish(gate: PopulateGate) -> None:
    async with HostTier(small_config()) as tier:
        waiters = [asyncio.create_task(tier.wait_resident(MiB)) for _ in range(1000)]
        await asyncio.sleep(0)
        # Each has run to its only suspension, the wait for the fill, and nothing is resident yet.
        assert not any(w.done() for w in waiters) and tier.statistics().resident_bytes == 0
        loop = asyncio.get_running_loop()  # the tier's: it belongs to the loop that opened it
        calls = 0
        real = loop.call_soon_threadsafe

        def counting(*args: object) -> object:
            nonlocal calls
            calls += 1
            return real(*args)  # type: ignore[arg-type]

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        try:
            gate.allow(1)
            await asyncio.gather(*waiters)
        finally:
            del loop.call_soon_threadsafe
        assert calls == 1
        gate.release_all()


async def test_cancelled_allocate_leaks_no_slot(gate: PopulateGate) -> None:
    async with HostTier(small_config()) as tier:
        task = asyncio.create_task(tier.allocate(3))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert tier.statistics().slots_allocated == 0
        gate.allow(1)
        assert await tier.allocate() == 0
        gate.release_all()


async def test_resize_grow_continues_the_fill_inside_the_reservation() -> None:
    async with HostTier(small_config(quota=4 * MiB)) as tier:
        base = tier.base_address
        await tier.wait_resident()
        slots = await tier.allocate(4 * SLOTS_PER_UNIT)
        with pytest.raises(OutOfSlots):
            tier.allocate_nowait()
        await tier.resize("8MiB")
        assert tier.base_address == base
        more = await tier.allocate(SLOTS_PER_UNIT)
        assert more[0] == len(slots)
        await tier.wait_resident()
        assert tier.statistics().resident_bytes == 8 * MiB
        with pytest.raises(QuotaError, match="max_quota"):
            await tier.resize("1GiB")
        with pytest.raises(QuotaError):
            await tier.resize(0)
        with pytest.raises(QuotaError):
            await tier.resize("a lot")
        stats = tier.statistics()
        assert stats.quota == 8 * MiB and stats.slots_total == 8 * SLOTS_PER_UNIT


async def test_resize_shrink_keeps_contents_and_refuses_used_tail() -> None:
    async with HostTier(small_config(quota=8 * MiB)) as tier:
        await tier.wait_resident()
        slots = await tier.allocate(5 * SLOTS_PER_UNIT)
        for s in slots:
            tier.view(s)[:8] = s.to_bytes(8, "little")
        with pytest.raises(QuotaError, match="allocated"):
            await tier.resize(2 * MiB)
        assert tier.statistics().quota == 8 * MiB
        tier.free_many(slots[2 * SLOTS_PER_UNIT :])
        view = tier.view(slots[0])
        await tier.resize(2 * MiB)
        stats = tier.statistics()
        assert stats.quota == 2 * MiB and stats.resident_bytes == 2 * MiB and stats.slots_total == 32
        for s in slots[: 2 * SLOTS_PER_UNIT]:
            assert int.from_bytes(tier.view(s)[:8], "little") == s
        assert int.from_bytes(view[:8], "little") == 0
        # The tail's memory went back: the mapping past 2 MiB is inaccessible again.
        base = stats.base_address
        tail = [m for m in mappings_in(base + 2 * MiB, 6 * MiB) if "---p" in m]
        assert tail
        with pytest.raises(OutOfSlots):
            await tier.allocate()
        # A live view past the new end blocks a shrink too.
        await tier.resize(4 * MiB)
        s = (await tier.allocate(SLOTS_PER_UNIT + 1))[-1]
        tail_view = tier.view(s)
        tier.free_many(range(2 * SLOTS_PER_UNIT, 3 * SLOTS_PER_UNIT + 1))
        with pytest.raises(QuotaError, match="view"):
            await tier.resize(2 * MiB)
        tail_view.release()
        gc.collect()
        await tier.resize(2 * MiB)


async def test_fill_failure_is_partial_and_a_shrink_clears_it(gate: PopulateGate) -> None:
    async with HostTier(small_config(quota=8 * MiB)) as tier:
        gate.allow(3)
        gate.fail(3)
        low = asyncio.create_task(tier.wait_resident(3 * MiB))
        high = asyncio.create_task(tier.allocate_many(4 * SLOTS_PER_UNIT))
        await low
        with pytest.raises(FillError) as info:
            await high
        assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOMEM
        assert info.value.resident_bytes == 3 * MiB
        with pytest.raises(FillError):
            await tier.wait_resident()
        with pytest.raises(FillError):
            await tier.allocate(3 * SLOTS_PER_UNIT + 1)
        assert await tier.allocate(3 * SLOTS_PER_UNIT) == list(range(48))
        with pytest.raises(FillError):
            tier.allocate_nowait()
        stats = tier.statistics()
        assert stats.fill_error is not None and "injected failure" in stats.fill_error
        assert stats.resident_bytes == 3 * MiB and not stats.filling
        await tier.resize(3 * MiB)
        assert tier.statistics().fill_error is None
        await tier.wait_resident()
        gate.release_all()
        await tier.resize(6 * MiB)
        await tier.wait_resident()
        assert tier.statistics().resident_bytes == 6 * MiB


async def test_fill_threads_finish_out_of_order_but_publish_the_prefix(gate: PopulateGate, reserved: list[int]) -> None:
    class SecondUnit:
        """Holds unit 1 (one thread runs alone until unit 0 is resident; then the second starts)."""

        def __contains__(self, addr: object) -> bool:
            return bool(reserved) and addr == reserved[0] + MiB

    gate.hold_addresses(SecondUnit())  # type: ignore[arg-type]
    gate.allow(1 << 60)
    async with HostTier(small_config(quota=8 * MiB, fill_threads=2)) as tier:
        while gate.returned < 7:  # noqa: ASYNC110 - the other thread commits 0 and 2..7
            await asyncio.sleep(0.01)
        assert tier.statistics().resident_bytes == MiB  # ...but the prefix stops at the held unit
        assert len(await tier.allocate(16)) == 16  # unit 0's slots
        with pytest.raises(WouldBlock):
            tier.allocate_nowait()
        gate.unhold_addresses()
        await tier.wait_resident()
        assert tier.statistics().resident_bytes == 8 * MiB
        assert len({name for _, _, name, _ in gate.seen}) == 2


async def test_close_while_filling_stops_between_units(gate: PopulateGate) -> None:
    tier = await HostTier.open(small_config())
    base = tier.statistics().base_address
    gate.allow(2)
    await tier.wait_resident(2 * MiB)
    closing = asyncio.create_task(tier.aclose())
    await asyncio.sleep(0.02)
    gate.release_all()
    await closing
    assert gate.calls < 64
    assert not fill_threads_alive()
    assert not mappings_in(base, tier.config.max_quota)
    with pytest.raises(TierClosedError):
        await tier.wait_resident()


async def test_close_wakes_waiters_and_tears_down_after_failed_fill(gate: PopulateGate) -> None:
    tier = await HostTier.open(small_config())
    base = tier.statistics().base_address
    gate.fail(0)
    with pytest.raises(FillError):
        await tier.wait_resident()
    waiter = asyncio.create_task(tier.wait_resident(0))
    await waiter  # zero bytes: nothing to wait for
    await tier.aclose()
    assert not fill_threads_alive()
    assert not mappings_in(base, tier.config.max_quota)


async def test_pending_waiters_get_closed_error(gate: PopulateGate) -> None:
    tier = await HostTier.open(small_config())
    waiter = asyncio.create_task(tier.allocate())
    await asyncio.sleep(0.01)
    closing = asyncio.create_task(tier.aclose())
    await asyncio.sleep(0.01)
    gate.release_all()
    await closing
    with pytest.raises(TierClosedError):
        await waiter


async def test_transparent_huge_pages_off_by_default_and_opt_in() -> None:
    async with HostTier(small_config()) as tier:
        await tier.wait_resident(MiB)
        assert "nh" in smaps_flags(tier.base_address)
        assert not tier.placement().huge_pages
    async with HostTier(small_config(transparent_huge_pages=True)) as tier:
        await tier.wait_resident(MiB)
        assert "hg" in smaps_flags(tier.base_address)
        assert tier.statistics().transparent_huge_pages
        await tier.wait_resident()
        placement = tier.placement()
        if _thp_enabled():  # huge pages are a kernel's choice: the placement reports what it made
            assert placement.huge_pages == (placement.huge_page_bytes > 0)
            assert placement.huge_page_bytes % (2 * MiB) == 0


def _thp_enabled() -> bool:
    try:
        return "[never]" not in proc_text("/sys/kernel/mm/transparent_hugepage/enabled")
    except OSError:
        return False


def _node0_cpus() -> set[int]:
    from aiokvtier._sysinfo import node_cpus, online_nodes

    if not online_nodes():
        pytest.skip("this kernel exposes no NUMA nodes")
    return node_cpus(0)


async def test_numa_preferred_placement_and_bound_fill_thread(gate: PopulateGate) -> None:
    cpus = _node0_cpus()
    gate.release_all()
    async with HostTier(small_config(numa_node=0)) as tier:
        await tier.wait_resident()
        placement = tier.placement()
        stats = tier.statistics()
    if stats.numa_policy == "first-touch":
        pytest.fail(f"mbind was denied here: {stats.numa_warning}")
    assert stats.numa_policy == "preferred" and stats.numa_node == 0
    assert placement.policy.startswith("prefer:0")
    assert placement.pages_per_node.get(0, 0) * placement.kernel_page_size >= 64 * MiB
    assert all(affinity <= cpus for _, _, _, affinity in gate.seen)


async def test_numa_strict_binds() -> None:
    _node0_cpus()
    async with HostTier(small_config(numa_node=0, allow_remote_numa_fallback=False)) as tier:
        await tier.wait_resident(MiB)
        assert tier.statistics().numa_policy == "bind"
        assert tier.placement().policy.startswith("bind:0")


def _deny_mbind(*args: object) -> None:
    raise OSError(errno.EPERM, "mbind: Operation not permitted")


async def test_numa_denied_preferred_falls_back_with_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    _node0_cpus()
    monkeypatch.setattr(_linux, "mbind", _deny_mbind)
    async with HostTier(small_config(numa_node=0)) as tier:
        await tier.wait_resident()
        stats = tier.statistics()
        assert stats.numa_policy == "first-touch"
        assert stats.numa_warning and "CAP_SYS_NICE" in stats.numa_warning
        assert tier.placement().policy == "default"


async def test_numa_denied_strict_raises_and_releases_everything(
    monkeypatch: pytest.MonkeyPatch, reserved: list[int]
) -> None:
    _node0_cpus()
    monkeypatch.setattr(_linux, "mbind", _deny_mbind)
    cfg = small_config(numa_node=0, allow_remote_numa_fallback=False)
    with pytest.raises(NumaPolicyError, match="node 0"):
        await HostTier.open(cfg)
    assert reserved and not mappings_in(reserved[0], cfg.max_quota)
    assert not fill_threads_alive()


async def test_statistics_and_repr_show_live_figures() -> None:
    async with HostTier(small_config()) as tier:
        await tier.wait_resident()
        await tier.allocate(3)
        stats = tier.statistics()
        assert (stats.slots_total, stats.slots_allocated, stats.slots_free) == (1024, 3, 1021)
        assert stats.backing == "host" and stats.registered_bytes == 0 and stats.commit_unit == MiB
        assert stats.slot_size == 64 * KiB and stats.fill_threads == 1
        text = repr(tier)
        assert "resident" in text and "3/1024" in text and "host" in text
    assert "closed" in repr(tier)
    assert "new" in repr(HostTier(small_config()))


async def test_open_twice_is_refused() -> None:
    tier = HostTier(small_config())
    async with tier:
        with pytest.raises(RuntimeError, match="opens once"):
            await tier.__aenter__()


async def test_cancelled_open_leaves_nothing(reserved: list[int]) -> None:
    cfg = small_config()
    task = asyncio.create_task(HostTier.open(cfg))
    await asyncio.sleep(0)
    task.cancel()
    try:
        tier = await task
    except asyncio.CancelledError:
        pass
    else:  # the open won the race: the tier is whole
        await tier.aclose()
    await asyncio.sleep(0.05)
    assert not fill_threads_alive()
    for base in reserved:
        assert not mappings_in(base, cfg.max_quota)


async def test_blocking_calls_in_the_loop_are_detected() -> None:
    import time

    from blockbuster import BlockingError

    with pytest.raises(BlockingError):
        time.sleep(0.001)  # noqa: ASYNC251 - the point of the test


def test_public_names_match_all() -> None:
    public = {name for name in dir(aiokvtier) if not name.startswith("_")}
    modules = {name for name in public if isinstance(getattr(aiokvtier, name), types.ModuleType)}  # aiokvtier.metrics
    assert set(aiokvtier.__all__) == public - modules - {"annotations"}
    assert os.path.exists(os.path.join(os.path.dirname(aiokvtier.__file__), "py.typed"))


async def test_a_device_without_a_driver_fails_clearly() -> None:
    from aiokvtier import CudaUnavailableError
    from aiokvtier._cuda._driver import device_count

    try:  # off the loop: the first use imports cuda-bindings, which reads files
        if await anyio.to_thread.run_sync(device_count) > 0:
            pytest.skip("a CUDA device is present: this checks machines without one")
    except CudaUnavailableError:
        pass
    for backing in ("register", "vmm"):
        with pytest.raises(CudaUnavailableError):
            await HostTier.open(small_config(device=0, backing=backing))
    with pytest.raises(CudaUnavailableError):
        await aiokvtier.StaticHostMem.open(MiB, device=0)
    assert not fill_threads_alive()


async def test_a_failed_decommit_leaves_the_unit_tracked() -> None:
    failed: list[int] = []
    recommitted: list[tuple[int, int]] = []
    released: list[list[tuple[int, int]]] = []

    class Flaky(HostBacking):
        def decommit(self, offset: int, length: int) -> None:
            if offset == 5 * MiB and not failed:
                failed.append(offset)
                raise OSError(errno.EIO, "injected decommit failure")
            super().decommit(offset, length)

        def recommit(self, offset: int, length: int) -> None:
            recommitted.append((offset, length))
            super().recommit(offset, length)

        def release(self, committed: list[tuple[int, int]]) -> None:
            released.append(list(committed))
            super().release(committed)

    tier = await HostTier.open(small_config(quota=8 * MiB), backings=HostBackings(Flaky))
    base = tier.statistics().base_address
    await tier.wait_resident()
    with pytest.raises(DecommitError, match="stay committed") as info:
        await tier.resize(2 * MiB)
    assert isinstance(info.value.__cause__, OSError) and "injected" in str(info.value)
    assert info.value.committed == ((5 * MiB, MiB),)
    assert failed and tier.statistics().resident_bytes == 2 * MiB
    assert tier.statistics().stranded_bytes == MiB
    await tier.resize(8 * MiB)  # the grow recommits the unit that is still committed, not commits it anew
    await tier.wait_resident()
    assert recommitted == [(5 * MiB, MiB)]  # still tracked, not leaked
    assert tier.statistics().resident_bytes == 8 * MiB
    await tier.aclose()
    assert len(released) == 1 and (5 * MiB, MiB) in released[0]
    assert not mappings_in(base, tier.config.max_quota)


async def test_concurrent_closes_all_wait_for_the_teardown(gate: PopulateGate) -> None:
    tier = await HostTier.open(small_config())
    base = tier.statistics().base_address
    gate.allow(1)
    await tier.wait_resident(MiB)
    await eventually(lambda: gate.calls == 2)  # the fill thread is held inside its second populate
    first = asyncio.create_task(tier.aclose())
    second = asyncio.create_task(tier.aclose())
    await asyncio.sleep(0.02)
    assert not second.done()  # the fill thread is still held: the teardown is not over
    gate.release_all()
    await asyncio.gather(first, second)
    assert tier.released and not mappings_in(base, tier.config.max_quota)


async def test_close_during_open_closes_once_the_open_is_whole_and_the_opener_learns_it(reserved: list[int]) -> None:
    tier = HostTier(small_config())
    opening = asyncio.create_task(tier.__aenter__())
    await asyncio.sleep(0)
    await tier.aclose()
    with pytest.raises(TierClosedError, match="closed while it was opening"):
        await opening  # the opener does not get a closed tier back
    assert tier.closed and not fill_threads_alive()
    assert reserved and not mappings_in(reserved[0], tier.config.max_quota)


@pytest.mark.usefixtures("touch_fill")
async def test_fill_falls_back_to_touching_pages_without_populate_write(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Kernels before 5.14 answer MADV_POPULATE_WRITE with EINVAL; where memory is short (the one
    # case the fill populates rather than touches) the fill then writes the pages itself.
    from aiokvtier._host import _headroom

    monkeypatch.setattr(_headroom, "available_bytes", lambda: 0)
    real_madvise = _linux._madvise
    refused: list[int] = []

    def old_kernel(addr: int, length: int, advice: int) -> int:
        if advice == _linux.MADV_POPULATE_WRITE:
            refused.append(length)
            import ctypes

            ctypes.set_errno(errno.EINVAL)
            return -1
        return int(real_madvise(addr, length, advice))

    monkeypatch.setattr(_linux, "_madvise", old_kernel)
    monkeypatch.setattr(_linux, "_populate_write_supported", None)
    async with HostTier(small_config(quota=4 * MiB)) as tier:
        await tier.wait_resident()
        slot = await tier.allocate()
        assert bytes(tier.view(slot)[:8]) == bytes(8)
        placement = tier.placement()
        assert sum(placement.pages_per_node.values()) * placement.kernel_page_size >= 4 * MiB  # resident
    assert refused and _linux._populate_write_supported is False
    # A fallback, logged as the guide says fallbacks are: once, at WARNING.
    warned = [r for r in caplog.records if "MADV_POPULATE_WRITE" in r.getMessage()]
    assert [r.levelno for r in warned] == [logging.WARNING]
