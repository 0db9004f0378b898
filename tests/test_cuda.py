"""GPU tests (marker ``cuda``): skipped with "no CUDA device" where there is none."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from aiokvtier import (
    CopyEngine,
    CopyPlanError,
    HostTier,
    HostTierConfig,
    StaticHostMem,
)
from aiokvtier._cuda import _backings, _driver
from aiokvtier._host._backing import Backing
from aiokvtier._host._layout import UnitLayout

from .conftest import fill_threads_alive, mappings_in
from .helpers import MiB

try:  # imported here, not on the event loop: importing torch does blocking file I/O
    import torch as _torch
except ImportError:  # pragma: no cover - the GPU machine has torch
    _torch = None

pytestmark = pytest.mark.cuda
BACKINGS = ["register", "vmm"]
SLOT = 256 << 10
UNIT = 32 * MiB
SLOTS_PER_UNIT = UNIT // SLOT


def gpu_config(backing: str, **overrides: Any) -> HostTierConfig:
    values: dict[str, Any] = dict(
        quota=256 * MiB, max_quota=1024 * MiB, slot_size=SLOT, commit_unit=UNIT, fill_chunk=UNIT,
        device=0, backing=backing, fill_threads=2,
    )  # fmt: skip
    values.update(overrides)
    return HostTierConfig.model_validate(values)


def torch_cuda() -> Any:
    if _torch is None:
        pytest.skip("torch is not installed")
    if not _torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch")
    return _torch


def pages(torch: Any, n: int, seed: int) -> Any:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n, SLOT), dtype=torch.uint8, device="cuda", generator=g)


@pytest.mark.parametrize("backing", BACKINGS)
async def test_backing_fills_and_registers_per_unit(backing: str) -> None:
    drv = _driver.driver()
    async with HostTier(gpu_config(backing)) as tier:
        await tier.wait_resident()
        stats = tier.statistics()
        assert stats.backing == backing
        assert stats.registered_bytes == stats.resident_bytes == 256 * MiB
        base = tier.base_address
        # Units: the ramp's below UNIT, then one per 32 MiB: each its own registration.
        layout = UnitLayout.build(stats.max_quota, SLOT, UNIT)
        starts = [layout.start(i) for i in range(layout.units_for(256 * MiB))]
        assert starts[0] == 0 and starts[-1] == 256 * MiB - UNIT and len(starts) > 256 * MiB // UNIT
        ends = [*starts[1:], 256 * MiB]
        if backing == "register":
            attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR
            for lo, hi in zip(starts, ends, strict=True):
                for probe in (lo, hi - 1):
                    start = _driver.check("range", drv.cuPointerGetAttribute(attr, base + probe))
                    assert int(start) == base + lo, f"+{probe} is not in the registration at +{lo}"
        else:
            handles = []
            for lo, hi in zip(starts, ends, strict=True):
                first = _driver.check("retain", drv.cuMemRetainAllocationHandle(base + lo))
                last = _driver.check("retain", drv.cuMemRetainAllocationHandle(base + hi - 1))
                assert int(first) == int(last), f"unit at +{lo} is not one allocation"
                handles.append(int(first))
                drv.cuMemRelease(first)
                drv.cuMemRelease(last)
            assert len(set(handles)) == len(starts), "units share an allocation"
        slot = await tier.allocate()
        tier.view(slot)[:4] = b"kvkv"  # CPU access works for both backings
        assert bytes(tier.view(slot)[:4]) == b"kvkv"
        tier.placement()
    assert not fill_threads_alive()
    assert not mappings_in(stats.base_address, stats.max_quota)


@pytest.mark.parametrize("backing", BACKINGS)
async def test_round_trips_bit_exact(backing: str) -> None:
    torch = torch_cuda()
    async with HostTier(gpu_config(backing)) as tier, CopyEngine(0, max_batch=16) as engine:
        await tier.wait_resident()
        slots = await tier.allocate(3 * SLOTS_PER_UNIT)
        src = pages(torch, len(slots), 1)
        # Contiguous slots merge into one copy per registration, and never cross one:
        # the ramp's [0, 4), [4, 8), [8, 16), [16, 32), then [32, 64), [64, 96) MiB.
        await engine.to_host(tier, slots, src)
        units = UnitLayout.build(tier.statistics().max_quota, SLOT, UNIT).units_for(3 * UNIT)
        assert units == 6 and engine.statistics().descriptors_submitted == units
        edge = [SLOTS_PER_UNIT - 1, SLOTS_PER_UNIT, 2 * SLOTS_PER_UNIT - 1, 2 * SLOTS_PER_UNIT]
        for i in edge:
            assert bytes(tier.view(slots[i])) == src[i].cpu().numpy().tobytes()
        order = torch.randperm(len(slots)).tolist()
        back = torch.zeros_like(src)
        await engine.to_device(tier, [slots[i] for i in order], back)
        torch.cuda.synchronize()
        assert torch.equal(back, src[order])
        # Raw device addresses work too, and device-to-device through copy().
        dev = int(back.data_ptr())
        await engine.to_host(tier, slots[:2], [dev + SLOT, dev])
        assert bytes(tier.view(slots[0])) == back[1].cpu().numpy().tobytes()
        other = torch.zeros_like(src[:1])
        await engine.copy([(int(other.data_ptr()), int(src[5].data_ptr()), SLOT)])
        torch.cuda.synchronize()
        assert torch.equal(other[0], src[5])


@pytest.mark.parametrize("backing", BACKINGS)
async def test_planner_refuses_a_copy_across_registrations(backing: str) -> None:
    torch = torch_cuda()
    async with HostTier(gpu_config(backing)) as tier, CopyEngine(0) as engine:
        await tier.wait_resident()
        slots = await tier.allocate(SLOTS_PER_UNIT + 1)
        dst = torch.zeros(2 * SLOT, dtype=torch.uint8, device="cuda")
        with pytest.raises(CopyPlanError, match="two registrations"):
            await engine.copy([(int(dst.data_ptr()), tier.address(slots[SLOTS_PER_UNIT - 1]), 2 * SLOT)])
        assert engine.statistics().jobs_submitted == 0


@pytest.mark.parametrize("backing", BACKINGS)
def test_fill_threads_use_the_tiers_device_context(backing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    drv = _driver.driver()
    seen: list[tuple[int, int]] = []
    cls = _backings.RegisterBacking if backing == "register" else _backings.VmmBacking
    original = cls.commit

    def spying_commit(self: Backing, offset: int, length: int) -> None:
        ctx = _driver.check("cuCtxGetCurrent", drv.cuCtxGetCurrent())
        dev = _driver.check("cuCtxGetDevice", drv.cuCtxGetDevice())
        seen.append((int(ctx), int(dev)))
        original(self, offset, length)

    monkeypatch.setattr(cls, "commit", spying_commit)

    # The opening thread has a different (non-primary) context current.
    def open_from_foreign_context() -> None:
        dev = _driver.check("cuDeviceGet", drv.cuDeviceGet(0))
        params = drv.CUctxCreateParams()
        foreign = _driver.check("cuCtxCreate", drv.cuCtxCreate(params, 0, dev))
        try:
            asyncio.run(_open_fill_close(backing))
            # The library pushed and popped its context: the caller's stays current.
            after.append(int(_driver.check("cuCtxGetCurrent", drv.cuCtxGetCurrent())) == int(foreign))
        finally:
            drv.cuCtxDestroy(foreign)

    after: list[bool] = []

    thread = threading.Thread(target=open_from_foreign_context)
    thread.start()
    thread.join()
    primary = _driver.PrimaryContext(0)
    try:
        assert seen and all(ctx == int(primary.handle) and dev == 0 for ctx, dev in seen)
        assert len({c for c, _ in seen}) == 1
        assert after == [True]
    finally:
        primary.release()


async def test_register_backing_registers_one_unit_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several fill threads, one registration in flight: another CUDA call waits for one, not a series."""
    real = _driver.driver()
    lock = threading.Lock()
    in_flight = [0]
    most: list[int] = []

    class Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def cuMemHostRegister(self, *args: Any) -> Any:
            with lock:
                in_flight[0] += 1
                most.append(in_flight[0])
            try:
                return real.cuMemHostRegister(*args)
            finally:
                with lock:
                    in_flight[0] -= 1

    counting = Counting()
    monkeypatch.setattr(_backings, "driver", lambda: counting)
    config = gpu_config("register", quota=512 * MiB, max_quota=512 * MiB, commit_unit=8 * MiB, fill_threads=4)
    async with HostTier(config) as tier:
        await tier.wait_resident()
        assert tier.statistics().registered_bytes == 512 * MiB
    assert len(most) >= 512 // 8 and max(most) == 1
    assert not fill_threads_alive()


async def _open_fill_close(backing: str) -> None:
    async with HostTier(gpu_config(backing)) as tier, CopyEngine(0) as engine, StaticHostMem(SLOT, device=0) as stage:
        await tier.wait_resident()
        slots = await tier.allocate(1)
        await engine.copy([(tier.address(slots[0]), stage.address, SLOT)])


@pytest.mark.parametrize("backing", BACKINGS)
async def test_resize_keeps_retained_contents(backing: str) -> None:
    torch = torch_cuda()
    async with HostTier(gpu_config(backing)) as tier, CopyEngine(0) as engine:
        await tier.wait_resident()
        slots = await tier.allocate(2 * SLOTS_PER_UNIT)
        src = pages(torch, len(slots), 2)
        await engine.to_host(tier, slots, src)
        await tier.resize(2 * UNIT)
        assert tier.statistics().registered_bytes == 2 * UNIT
        await tier.resize(512 * MiB)
        await tier.wait_resident()
        assert tier.statistics().registered_bytes == 512 * MiB
        more = await tier.allocate(SLOTS_PER_UNIT)
        await engine.to_host(tier, more, src[:SLOTS_PER_UNIT])
        back = torch.zeros_like(src)
        await engine.to_device(tier, slots, back)
        torch.cuda.synchronize()
        assert torch.equal(back, src)


@pytest.mark.parametrize("numa", [False, True])
async def test_static_host_mem_round_trip(numa: bool) -> None:
    torch = torch_cuda()
    node = _driver.device_numa_node(0) if numa else None
    if numa and node is None:
        node = 0
    async with StaticHostMem(8 * MiB, device=0, numa_node=node) as stage, CopyEngine(0) as engine:
        assert stage.kind == ("registered" if numa else "hostalloc")
        src = torch.arange(8 * MiB, dtype=torch.uint8, device="cuda")
        await engine.copy([(stage.address, int(src.data_ptr()), 8 * MiB)])
        assert bytes(stage.view()[:300]) == bytes(range(256)) + bytes(range(44))
        back = torch.zeros_like(src)
        await engine.copy([(int(back.data_ptr()), stage.address, 8 * MiB)])
        torch.cuda.synchronize()
        assert torch.equal(back, src)


async def test_cancellation_during_a_copy_leaves_data_intact() -> None:
    torch = torch_cuda()
    async with HostTier(gpu_config("register")) as tier, CopyEngine(0) as engine:
        await tier.wait_resident()
        slots = await tier.allocate(8 * SLOTS_PER_UNIT)
        src = pages(torch, len(slots), 3)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(50_000_000)  # keep the GPU busy so the copy is still queued when cancelled
        task = asyncio.create_task(engine.to_host(tier, slots, src, after=stream))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(tier.copies) == 0  # the cancellation arrived once the copy had landed
        del src
        torch.cuda.synchronize()
        again = pages(torch, len(slots), 3)
        for i in (0, len(slots) // 2, len(slots) - 1):
            assert bytes(tier.view(slots[i])) == again[i].cpu().numpy().tobytes()


async def test_after_orders_the_copy_behind_compute_without_host_sync() -> None:
    torch = torch_cuda()
    async with HostTier(gpu_config("vmm")) as tier, CopyEngine(0) as engine:
        await tier.wait_resident()
        slots = await tier.allocate(4)
        kv = torch.zeros((4, SLOT), dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)
            kv.fill_(7)
        await engine.to_host(tier, slots, kv, after=stream)
        assert all(bytes(tier.view(s)[:8]) == b"\x07" * 8 for s in slots)


async def test_after_a_stream_waits_for_what_was_queued_before_the_call_only() -> None:
    """The stream is marked when the call is made, not when the submit thread gets to the job."""
    torch = torch_cuda()
    async with HostTier(gpu_config("vmm")) as tier, CopyEngine(0, method="dma") as engine:
        await tier.wait_resident()
        slots = await tier.allocate(4)
        kv = torch.zeros((4, SLOT), dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)
            kv.fill_(7)
        started = engine.begin(tier, slots, kv, "d2h", after=stream)
        with torch.cuda.stream(stream):  # queued after the call, before the submit thread ran
            torch.cuda._sleep(400_000_000)
            kv.fill_(9)
        await started.submitted
        await started.done
        assert all(bytes(tier.view(s)) == b"\x07" * SLOT for s in slots)
        stream.synchronize()


async def test_begin_refuses_a_bad_direction_and_queues_nothing() -> None:
    torch = torch_cuda()
    async with HostTier(gpu_config("vmm")) as tier, CopyEngine(0) as engine:
        await tier.wait_resident()
        slots = await tier.allocate(2)
        kv = torch.zeros((2, SLOT), dtype=torch.uint8, device="cuda")
        with pytest.raises(ValueError, match="direction"):
            engine.begin(tier, slots, kv, "any")
        assert engine.statistics().jobs_submitted == 0


async def test_numa_auto_resolves_the_gpus_node() -> None:
    node = _driver.device_numa_node(0)
    async with HostTier(gpu_config("register", numa_node="auto")) as tier:
        stats = tier.statistics()
        assert stats.numa_node == node
        assert stats.numa_policy == ("none" if node is None else "preferred")


@pytest.mark.parametrize("shared", [False, True], ids=["register", "shared-register"])
def test_a_unit_stranded_after_its_unregistration_is_registered_again_by_recommit(
    shared: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decommit that unregistered the unit and then failed leaves it stranded: recommit registers it again."""
    unit = 4 << 20
    if shared:
        backing: Backing = _backings.SharedRegisterBacking(
            2 * unit, device=0, node=None, strict_numa=False, huge_pages=False
        )
    else:
        backing = _backings.RegisterBacking(2 * unit, device=0, node=None, strict_numa=False, huge_pages=False)
    below = type(backing).__mro__[2]  # the backing under the registration (HostBacking or SharedBacking)
    committed: list[tuple[int, int]] = []
    try:
        backing.thread_setup()
        backing.commit(0, unit)
        committed.append((0, unit))
        assert backing.registered_bytes == unit

        def failing(self: Backing, offset: int, length: int) -> None:
            raise OSError(12, "injected")

        with monkeypatch.context() as patch:
            patch.setattr(below, "decommit", failing)
            with pytest.raises(OSError, match="injected"):
                backing.decommit(0, unit)
        assert backing.registered_bytes == 0  # unregistered, still committed: stranded
        backing.recommit(0, unit)
        assert backing.registered_bytes == unit
        backing.decommit(0, unit)
        committed.clear()
        assert backing.registered_bytes == 0
    finally:
        backing.release(committed)
