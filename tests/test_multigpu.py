"""Multi-GPU tests (marker ``cuda``): they run unchanged on any machine with two or more GPUs."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from aiokvtier import CopyEngine, HostTier
from aiokvtier._cuda import _backings, _driver
from aiokvtier._host._backing import Backing

from .conftest import PopulateGate
from .test_cuda import BACKINGS, SLOT, SLOTS_PER_UNIT, gpu_config, torch_cuda

pytestmark = pytest.mark.cuda


def need_gpus(n: int) -> None:
    try:
        count = _driver.device_count()
    except Exception:  # pragma: no cover - the cuda marker already skips without a driver
        count = 0
    if count < n:
        pytest.skip(f"needs {n} CUDA devices, {count} visible")


@pytest.mark.parametrize("backing", BACKINGS)
@pytest.mark.parametrize(("tier_device", "current"), [(1, 0), (0, 1)])
def test_library_threads_use_the_tiers_device(
    backing: str, tier_device: int, current: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    need_gpus(2)
    torch = torch_cuda()
    drv = _driver.driver()
    cls = _backings.RegisterBacking if backing == "register" else _backings.VmmBacking
    original = cls.commit
    devices: list[int] = []

    def spying_commit(self: Backing, offset: int, length: int) -> None:
        devices.append(int(_driver.check("cuCtxGetDevice", drv.cuCtxGetDevice())))
        original(self, offset, length)

    monkeypatch.setattr(cls, "commit", spying_commit)
    errors: list[BaseException] = []

    async def body() -> None:
        async with HostTier(gpu_config(backing, device=tier_device)) as tier, CopyEngine(tier_device) as engine:
            await tier.wait_resident()
            slots = await tier.allocate(2 * SLOTS_PER_UNIT)
            src = torch.randint(0, 256, (len(slots), SLOT), dtype=torch.uint8, device=f"cuda:{tier_device}")
            await engine.to_host(tier, slots, src)
            back = torch.zeros_like(src)
            await engine.to_device(tier, slots[::-1], back)
            torch.cuda.synchronize(tier_device)
            assert torch.equal(back, src.flip(0))

    def run() -> None:
        try:
            torch.cuda.set_device(current)
            asyncio.run(body())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    assert devices and set(devices) == {tier_device}


async def test_tiers_on_two_devices_fill_and_copy_concurrently() -> None:
    need_gpus(2)
    torch = torch_cuda()

    async def one(device: int, backing: str) -> None:
        async with HostTier(gpu_config(backing, device=device)) as tier, CopyEngine(device) as engine:
            slots = await tier.allocate(4 * SLOTS_PER_UNIT)
            src = torch.randint(0, 256, (len(slots), SLOT), dtype=torch.uint8, device=f"cuda:{device}")
            await engine.to_host(tier, slots, src)
            back = torch.empty_like(src)
            await engine.to_device(tier, slots, back)
            torch.cuda.synchronize(device)
            assert torch.equal(back, src)

    await asyncio.gather(one(0, "vmm"), one(1, "register"))


def _per_gpu_nodes() -> dict[int, int | None]:
    return {d: _driver.device_numa_node(d) for d in range(_driver.device_count())}


async def test_numa_auto_places_each_tier_on_its_gpus_node(gate: PopulateGate) -> None:
    need_gpus(2)
    nodes = _per_gpu_nodes()
    if None in nodes.values() or len(set(nodes.values())) < 2:
        pytest.skip(f"the GPUs do not attach to distinct NUMA nodes ({nodes}): the check cannot discriminate")
    from aiokvtier._sysinfo import node_cpus

    gate.release_all()
    for device, node in nodes.items():
        assert node is not None
        gate.seen.clear()
        async with HostTier(gpu_config("register", device=device, numa_node="auto")) as tier:
            await tier.wait_resident()
            placement = tier.placement()
            stats: Any = tier.statistics()
        assert stats.numa_node == node
        assert max(placement.pages_per_node, key=placement.pages_per_node.__getitem__) == node
        assert all(affinity <= node_cpus(node) for _, _, _, affinity in gate.seen)
