"""The SM copy path on a GPU (marker ``cuda``): skipped with "no CUDA device" where there is none."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiokvtier import CopyEngine, CopyPlanError, HostTier, SmOptions

from .helpers import MiB
from .test_cuda import BACKINGS, gpu_config, torch_cuda

pytestmark = pytest.mark.cuda
UNIT = 32 * MiB
PAGE_SIZES = [4 << 10, 16 << 10, 64 << 10, 2 * MiB]
METHODS = ["dma", "sm"]


def tier_config(backing: str, slot: int) -> Any:
    return gpu_config(backing, quota=128 * MiB, max_quota=128 * MiB, slot_size=slot, commit_unit=UNIT, fill_chunk=UNIT)


def chosen_slots(slot: int, total: int, n: int, seed: int) -> list[int]:
    """``n`` shuffled slot ids that include both sides of every unit edge."""
    per_unit = UNIT // slot
    edges = {s for u in range(1, total // per_unit) for s in (u * per_unit - 1, u * per_unit)}
    rng = np.random.default_rng(seed)
    rest = [int(s) for s in rng.permutation(total) if int(s) not in edges][: max(0, n - len(edges))]
    ids = [*edges, *rest]
    rng.shuffle(ids)
    return ids


def random_pages(torch: Any, n: int, page: int, seed: int) -> Any:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n, page), dtype=torch.uint8, device="cuda", generator=g)


@pytest.mark.parametrize("page", PAGE_SIZES, ids=lambda p: f"{p >> 10}KiB")
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("backing", BACKINGS)
async def test_bit_exact_shuffled_and_unit_edges(backing: str, method: str, page: int) -> None:
    torch = torch_cuda()
    async with HostTier(tier_config(backing, page)) as tier, CopyEngine(0, method=method) as engine:
        await tier.wait_resident()
        total = tier.statistics().quota // page
        await tier.allocate(total)
        ids = chosen_slots(page, total, min(total, 2048), seed=page)
        src = random_pages(torch, len(ids), page, seed=1)
        await engine.to_host(tier, ids, src)
        expect = src.cpu().numpy()
        for row in (0, len(ids) // 2, len(ids) - 1, *range(0, len(ids), max(1, len(ids) // 64))):
            assert bytes(tier.view(ids[row])) == expect[row].tobytes(), f"slot {ids[row]} differs"
        order = np.random.default_rng(2).permutation(len(ids))
        back = torch.zeros_like(src)
        await engine.to_device(tier, [ids[i] for i in order], back)
        torch.cuda.synchronize()
        assert torch.equal(back, src[torch.as_tensor(order, device="cuda")])
        stats = engine.statistics()
        assert stats.bytes_by_method[method] == 2 * len(ids) * page
        assert stats.bytes_by_method["sm" if method == "dma" else "dma"] == 0


@pytest.mark.parametrize("method", ["auto", *METHODS])
@pytest.mark.parametrize("backing", BACKINGS)
async def test_a_request_in_pieces_is_bit_exact_both_ways(backing: str, method: str) -> None:
    """Every 4 KiB slot of a 128 MiB tier, shuffled (32,768 pages: for the kernel, pieces from 4,096
    pages growing to 8,192, on the streams in turn; whole for the copy engines), to the GPU and back
    in another order, beside the same request planned whole."""
    torch = torch_cuda()
    page = 4 << 10
    async with (
        HostTier(tier_config(backing, page)) as tier,
        CopyEngine(0, method=method) as engine,
        CopyEngine(0, method=method, pieces_from=None) as whole,
    ):
        await tier.wait_resident()
        total = tier.statistics().quota // page
        ids = chosen_slots(page, total, total, seed=11)
        await tier.allocate(total)
        src = random_pages(torch, total, page, seed=3)
        await engine.to_host(tier, ids, src)
        order = np.random.default_rng(4).permutation(total)
        back = torch.zeros_like(src)
        await engine.to_device(tier, [ids[i] for i in order], back)
        torch.cuda.synchronize()
        assert torch.equal(back, src[torch.as_tensor(order, device="cuda")])
        again = torch.zeros_like(src)
        await whole.to_device(tier, [ids[i] for i in order], again)
        torch.cuda.synchronize()
        assert torch.equal(again, back)
        stats = engine.statistics()
        kernel = stats.bytes_by_method["sm"] == stats.bytes_copied  # auto: as the device's crossover chose
        assert stats.jobs_in_pieces == (2 if method == "sm" or (method == "auto" and kernel) else 0)
        assert stats.jobs_completed == 2 and stats.bytes_copied == 2 * total * page
        assert whole.statistics().jobs_in_pieces == 0


@pytest.mark.parametrize("short", [16, 8, 1], ids=["16B-short", "8B-short", "1B-short"])
@pytest.mark.parametrize("backing", BACKINGS)
async def test_sm_pages_smaller_than_the_slot(backing: str, short: int) -> None:
    """Pages shorter than the slot, including lengths that end off a 16-byte boundary (the tails)."""
    torch = torch_cuda()
    slot = 16 << 10
    page = slot - short
    async with HostTier(tier_config(backing, slot)) as tier, CopyEngine(0, method="sm") as engine:
        await tier.wait_resident()
        ids = await tier.allocate(512)
        ids = [ids[i] for i in np.random.default_rng(3).permutation(len(ids))]
        for i in ids:
            tier.view(i)[:] = b"\xee" * slot
        src = random_pages(torch, len(ids), page, seed=4)
        await engine.to_host(tier, ids, src)
        expect = src.cpu().numpy()
        for row in range(0, len(ids), 17):
            view = bytes(tier.view(ids[row]))
            assert view[:page] == expect[row].tobytes() and view[page:] == b"\xee" * short
        back = torch.zeros_like(src)
        await engine.to_device(tier, ids, back)
        torch.cuda.synchronize()
        assert torch.equal(back, src)
        assert engine.statistics().bytes_by_method["sm"] == 2 * len(ids) * page


@pytest.mark.parametrize("backing", BACKINGS)
@pytest.mark.parametrize(
    ("alternate", "pdl", "pack", "bounded", "head", "slice_kib"),
    [
        (False, True, True, True, True, 40),  # the defaults, small slices
        (False, True, True, True, True, 65536),  # the defaults, one slice: no upload at all
        (False, True, False, True, True, 40),
        (False, True, False, True, True, 65536),
        (False, True, True, True, False, 40),
        (False, True, False, True, False, 40),
        (False, True, True, False, True, 40),
        (True, True, True, True, True, 40),
        (False, False, True, True, True, 40),
        (False, False, False, False, False, 40),
    ],
)
async def test_sm_request_in_many_slices_is_bit_exact(
    backing: str,
    alternate: bool,
    pdl: bool,
    pack: bool,
    bounded: bool,
    head: bool,
    slice_kib: int,
) -> None:
    """A request runs as launches of at most ``slice_bytes`` (uneven: 2 pages and a bit), each a
    programmatic dependent of the one before (the default) or not, on one stream (the default)
    or alternating with a partner stream, with packed descriptors (the default) or wide ones,
    each slice's successor held until the slice before it has ended (the default) or not, the
    first slice reading its descriptors from the staging slab (the default) or after their
    upload: every page lands, in both directions."""
    options = SmOptions(
        slice_bytes=slice_kib << 10, alternate=alternate, pdl=pdl, pack=pack, bounded=bounded, head=head
    )
    torch = torch_cuda()
    slot = 16 << 10
    engine = CopyEngine(0, method="sm", sm_options=options)
    async with HostTier(tier_config(backing, slot)) as tier, engine:
        await tier.wait_resident()
        ids = await tier.allocate(515)
        ids = [ids[i] for i in np.random.default_rng(5).permutation(len(ids))]
        src = random_pages(torch, len(ids), slot, seed=6)
        await engine.to_host(tier, ids, src)
        expect = src.cpu().numpy()
        assert all(bytes(tier.view(i)) == expect[row].tobytes() for row, i in enumerate(ids))
        back = torch.zeros_like(src)
        await engine.to_device(tier, ids, back)
        torch.cuda.synchronize()
        assert torch.equal(back, src)


@pytest.mark.parametrize("split", [True, False], ids=["runs-cut", "runs-whole"])
@pytest.mark.parametrize("backing", BACKINGS)
async def test_sm_partly_contiguous_request_is_bit_exact(backing: str, split: bool) -> None:
    """Slots and pages in runs that the planner merges (64, 17 and 3 pages) among shuffled single
    ones: the runs are cut back into pages (the default) or copied whole; every page lands, in both
    directions."""
    torch = torch_cuda()
    slot = 16 << 10
    engine = CopyEngine(0, method="sm", sm_options=SmOptions(split_runs=split))
    async with HostTier(tier_config(backing, slot)) as tier, engine:
        await tier.wait_resident()
        ids = await tier.allocate(600)
        rng = np.random.default_rng(11)
        singles = [ids[i] for i in rng.permutation(range(84, 600))]
        order = [*ids[:64], *singles[:200], *ids[64:81], *singles[200:], *ids[81:84]]
        src = random_pages(torch, len(order), slot, seed=12)
        await engine.to_host(tier, order, src)
        expect = src.cpu().numpy()
        assert all(bytes(tier.view(i)) == expect[row].tobytes() for row, i in enumerate(order))
        back = torch.zeros_like(src)
        await engine.to_device(tier, order, back)
        torch.cuda.synchronize()
        assert torch.equal(back, src)
        assert engine.statistics().descriptors_submitted < 2 * len(order)  # the runs were merged


async def test_sm_copy_waits_for_after_behind_a_kernel() -> None:
    torch = torch_cuda()
    slot = 16 << 10
    async with HostTier(tier_config("vmm", slot)) as tier, CopyEngine(0, method="sm") as engine:
        await tier.wait_resident()
        ids = await tier.allocate(1024)
        pages = torch.zeros((len(ids), slot), dtype=torch.uint8, device="cuda")
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time before the write
            pages.fill_(0x5A)
        await engine.to_host(tier, ids, pages, after=side)
        for i in (ids[0], ids[len(ids) // 2], ids[-1]):
            assert bytes(tier.view(i)) == b"\x5a" * slot


async def test_cancelled_sm_copy_leaves_complete_data() -> None:
    torch = torch_cuda()
    slot = 16 << 10
    async with HostTier(tier_config("register", slot)) as tier, CopyEngine(0, method="sm") as engine:
        await tier.wait_resident()
        ids = await tier.allocate(4096)
        ids = [ids[i] for i in np.random.default_rng(5).permutation(len(ids))]
        src = random_pages(torch, len(ids), slot, seed=6)
        torch.cuda.synchronize()
        task = asyncio.ensure_future(engine.to_host(tier, ids, src))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        expect = src.cpu().numpy()  # the copy had landed when the cancellation arrived
        for row in range(0, len(ids), 97):
            assert bytes(tier.view(ids[row])) == expect[row].tobytes()
        assert engine.statistics().jobs_completed == 1


async def test_sm_refuses_a_device_side_it_cannot_reach() -> None:
    torch = torch_cuda()
    slot = 16 << 10
    async with HostTier(tier_config("vmm", slot)) as tier, CopyEngine(0, method="sm") as engine:
        await tier.wait_resident()
        ids = await tier.allocate(2)
        page = torch.zeros(slot, dtype=torch.uint8, device="cuda")
        with pytest.raises(CopyPlanError, match="cannot reach the device side"):
            await engine.to_device(tier, ids, [int(page.data_ptr()), 1 << 47])
        await engine.to_device(tier, ids[:1], [int(page.data_ptr())])  # the context is intact
        torch.cuda.synchronize()


async def test_auto_measures_once_and_reuses_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    torch = torch_cuda()
    monkeypatch.setenv("AIOKVTIER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("AIOKVTIER_SM_CROSSOVER", raising=False)
    async with CopyEngine(0, method="auto") as engine:
        stats = engine.statistics()
    assert stats.method == "auto" and stats.sm_unavailable is None, stats.sm_unavailable
    files = await asyncio.to_thread(lambda: sorted(tmp_path.glob("sm-crossover-*.json")))
    assert len(files) == 1
    mtime = (await asyncio.to_thread(os.stat, files[0])).st_mtime_ns
    slot = 16 << 10
    async with HostTier(tier_config("vmm", slot)) as tier, CopyEngine(0) as engine:  # auto: the default
        assert engine.statistics().method == "auto"
        assert (await asyncio.to_thread(os.stat, files[0])).st_mtime_ns == mtime
        await tier.wait_resident()
        ids = await tier.allocate(4096)
        ids = [ids[i] for i in np.random.default_rng(8).permutation(len(ids))]
        src = random_pages(torch, len(ids), slot, seed=9)
        await engine.to_host(tier, ids, src)
        back = torch.zeros_like(src)
        await engine.to_device(tier, ids, back)
        torch.cuda.synchronize()
        assert torch.equal(back, src)
        stats = engine.statistics()
        assert sum(stats.bytes_by_method.values()) == stats.bytes_copied
        print("auto crossover:", stats.sm_crossover_bytes, "bytes by method:", stats.bytes_by_method)


async def test_auto_falls_back_to_dma_when_the_kernel_cannot_build(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from aiokvtier._cuda import _kernel

    monkeypatch.setattr(_kernel, "SOURCE", "this is not C++")
    monkeypatch.setattr(_kernel, "_cubins", {})
    async with CopyEngine(0, method="auto", sm_budget=3) as engine:
        stats = engine.statistics()
    assert stats.sm_unavailable is not None and "NVRTC log" in stats.sm_unavailable
    assert any("SM copy path is unavailable" in r.message for r in caplog.records)
    from aiokvtier import CudaUnavailableError

    with pytest.raises(CudaUnavailableError, match="NVRTC log"):
        async with CopyEngine(0, method="sm", sm_budget=3):
            pass
