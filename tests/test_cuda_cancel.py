"""Cancellation on GPU-backed tiers (marker ``cuda``): skipped with "no CUDA device" where there is none.

A shrink cancelled mid-way must leave every unit either registered and
resident or released, so that the next grow can commit and register it
again; a copy cancelled while awaited must have landed when the
cancellation arrives, so that a later copy into the same memory is never
overwritten by it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aiokvtier import CopyEngine, HostTier, HostTierConfig

from .helpers import GiB, MiB
from .test_cuda import BACKINGS, gpu_config, torch_cuda

pytestmark = pytest.mark.cuda

SLOT = UNIT = 2 * MiB
HANG = 300.0  # a 4 GiB fill with registration takes seconds; a hang is far longer


def big_config(backing: str) -> HostTierConfig:
    """4 GiB of 2 MiB slots, each its own commit unit and registration."""
    return gpu_config(backing, quota=4 * GiB, max_quota=4 * GiB, slot_size=SLOT, commit_unit=UNIT, fill_chunk=64 * MiB)


def row_pattern(torch: Any, n: int, offset: int) -> Any:
    """``n`` pages whose row i is filled with ``offset + i % 127``: two offsets 127 apart never agree."""
    values = (torch.arange(n, device="cuda") % 127 + offset).to(torch.uint8)
    return values[:, None].expand(n, SLOT).contiguous()


@pytest.mark.parametrize("backing", BACKINGS)
async def test_cancelled_shrink_then_grow_registers_every_unit(backing: str) -> None:
    async with HostTier(big_config(backing)) as tier:
        await asyncio.wait_for(tier.wait_resident(), HANG)
        for delay in (0.0005, 0.002, 0.005, 0.01, 0.05):
            try:
                await asyncio.wait_for(tier.resize(64 * MiB), delay)
            except TimeoutError:
                pass
            s = tier.statistics()
            assert s.quota in (4 * GiB, 64 * MiB), f"a cancelled shrink left the quota at {s.quota}"
            # Straight after the cancellation: the grow must find every unit whole.
            await asyncio.wait_for(tier.resize(4 * GiB), HANG)
            await asyncio.wait_for(tier.wait_resident(), HANG)
            s = tier.statistics()
            assert s.quota == 4 * GiB and s.fill_error is None, s.fill_error
            assert s.resident_bytes == s.target_bytes >= s.quota
            assert s.registered_bytes == s.resident_bytes, (
                f"shrink cancelled after {delay} s: registered {s.registered_bytes} != resident {s.resident_bytes}"
            )
            slots = await asyncio.wait_for(tier.allocate(s.slots_free), HANG)
            for slot in (slots[0], slots[len(slots) // 2], slots[-1]):
                tier.view(slot)[:4] = b"kvkv"
            tier.free_many(slots)


@pytest.mark.parametrize("backing", BACKINGS)
async def test_cancelled_to_device_has_landed_when_cancellation_arrives(backing: str) -> None:
    torch = torch_cuda()
    n = 512  # 1 GiB per copy: about 20 ms over PCIe, so a cancellation at 0-4 ms lands mid-copy
    async with HostTier(big_config(backing)) as tier, CopyEngine(0) as engine:
        await asyncio.wait_for(tier.wait_resident(), HANG)
        first_slots = await tier.allocate(n)
        second_slots = await tier.allocate(n)
        x, y = row_pattern(torch, n, 1), row_pattern(torch, n, 128)
        await asyncio.wait_for(engine.to_host(tier, first_slots, x), HANG)
        await asyncio.wait_for(engine.to_host(tier, second_slots, y), HANG)
        dst = torch.zeros((n, SLOT), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        for delay in (0, 0.0005, 0.001, 0.002, 0.003, 0.004):
            dst.zero_()
            torch.cuda.synchronize()
            try:
                await asyncio.wait_for(engine.to_device(tier, first_slots, dst), delay)
            except TimeoutError:
                pass
            # Issued at once: if the cancelled copy were still running (on the engine's other
            # stream), it could land after this one.
            await asyncio.wait_for(engine.to_device(tier, second_slots, dst), HANG)
            torch.cuda.synchronize()
            wrong = int((dst[:, ::4096] != y[:, ::4096]).any(dim=1).sum())
            assert wrong == 0, f"copy cancelled after {delay} s: {wrong} of {n} pages were overwritten by it"
            assert torch.equal(dst, y)
