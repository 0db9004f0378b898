"""``python -m aiokvtier.bench cuda``: GPU backings and copies on a CUDA machine."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from .._config import HostTierConfig
from .._copy._engine import CopyEngine
from .._cuda._batch import DEFAULT_MAX_BATCH
from .._cuda._driver import PrimaryContext, check, driver
from .._cuda._static import StaticHostMem
from .._host._tier import HostTier
from . import _cold, _requests, _sm
from ._common import GiB, MiB, loop_factories, median, record_fill, run_on, run_sections, sample_loop_lag, summary_ms
from ._pool_probe import pool_contention
from ._probe import Probe


def _cfg(size: int, backing: str, threads: int | None = 1, slot: int = 2 * MiB, device: int = 0) -> HostTierConfig:
    """A tier of ``size`` bytes; ``threads`` None: the default ``fill_threads`` (the machine's)."""
    fields: dict[str, Any] = {"quota": size, "max_quota": size, "slot_size": slot, "device": device, "backing": backing}
    if threads is not None:
        fields["fill_threads"] = threads
    return HostTierConfig.model_validate(fields)


# -- 1. time to first allocation ------------------------------------------------------


async def _first_alloc(size: int, backing: str) -> float:
    started = time.perf_counter()
    tier = await HostTier.open(_cfg(size, backing))
    await tier.allocate()
    elapsed = time.perf_counter() - started
    await tier.aclose()
    return elapsed


def _host_alloc(size: int) -> float:
    drv = driver()
    ctx = PrimaryContext(0)
    ctx.make_current()
    started = time.perf_counter()
    ptr = check("cuMemHostAlloc", drv.cuMemHostAlloc(size, 0x01))
    elapsed = time.perf_counter() - started
    check("cuMemFreeHost", drv.cuMemFreeHost(ptr))
    ctx.release()
    return elapsed


def _torch_pinned_child(size: int, out: Any) -> None:
    try:
        import torch
    except ImportError:
        out.put(None)
        return
    torch.cuda.init()
    started = time.perf_counter()
    t = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    out.put(time.perf_counter() - started)
    del t


def _torch_pinned(size: int) -> float | None:
    """torch's pinned allocator caches what it frees: measure in a child so the memory goes back."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_torch_pinned_child, args=(size, out))
    child.start()
    elapsed: float | None = out.get(timeout=600)
    child.join()
    return elapsed


def first_allocation(size: int) -> dict[str, Any]:
    # A serving process has its CUDA context before its tier opens: create it
    # (and warm each backing once, untimed) so that the arms compare the tier alone.
    ctx = PrimaryContext(0)
    for backing in ("vmm", "register"):
        asyncio.run(_first_alloc(64 * MiB, backing))
    ours = {b: asyncio.run(_first_alloc(size, b)) for b in ("vmm", "register")}
    host_alloc = _host_alloc(size)
    ctx.release()
    pinned = _torch_pinned(size)
    best = min(ours.values())
    return {
        "quota_gib": size / GiB,
        **{f"aiokvtier_{b}_ms": round(v * 1e3, 2) for b, v in ours.items()},
        "cuMemHostAlloc_ms": round(host_alloc * 1e3, 1),
        "torch_pinned_empty_ms": None if pinned is None else round(pinned * 1e3, 1),
        "sooner_x_vs_cuMemHostAlloc": round(host_alloc / best, 1),
        "sooner_x_vs_torch": None if pinned is None else round(pinned / best, 1),
    }


def fill_progress(size: int) -> dict[str, Any]:
    """Usable GiB over time for each GPU backing (1 fill thread) against pinning it all up front, one run."""
    ctx = PrimaryContext(0)  # a serving process has its context before its tier opens
    try:
        for backing in ("vmm", "register"):
            asyncio.run(_first_alloc(64 * MiB, backing))
        ours = {b: asyncio.run(record_fill(_cfg(size, b))) for b in ("vmm", "register")}
        host_alloc = _host_alloc(size)
    finally:
        ctx.release()
    pinned = _torch_pinned(size)
    return {
        "quota_gib": size / GiB,
        **{f"aiokvtier_{b}": series for b, series in ours.items()},
        "cuMemHostAlloc_s": round(host_alloc, 4),
        "torch_pinned_empty_s": None if pinned is None else round(pinned, 4),
    }


# -- 2./3. fill throughput with a probe thread ----------------------------------------


async def _fill(
    size: int, backing: str, threads: int | None, probe_ctx: PrimaryContext, dptr: int, device: int = 0
) -> dict[str, Any]:
    config = _cfg(size, backing, threads, device=device)
    with Probe(probe_ctx, dptr) as probe:
        started = time.perf_counter()
        async with HostTier(config) as tier:
            await tier.wait_resident()
            wall = time.perf_counter() - started
            registered = tier.statistics().registered_bytes
    return {
        "seconds": round(wall, 3),
        "gib_s": round(size / GiB / wall, 3),
        "backing": config.resolved_backing,
        "fill_threads": config.resolved.fill_threads,
        "commit_unit_mib": config.resolved.commit_unit / MiB,
        "registered_gib": registered / GiB,
        **probe.report(wall, started),
    }


def _hostalloc_pieces(size: int, piece: int, probe_ctx: PrimaryContext, dptr: int) -> dict[str, Any]:
    drv = driver()
    ptrs = []
    with Probe(probe_ctx, dptr) as probe:
        started = time.perf_counter()
        for _ in range(size // piece):
            ptrs.append(check("cuMemHostAlloc", drv.cuMemHostAlloc(piece, 0x01)))
        wall = time.perf_counter() - started
    for p in ptrs:
        drv.cuMemFreeHost(p)
    return {"gib_s": round(size / GiB / wall, 3), **probe.report(wall)}


def fill_throughput(size: int) -> dict[str, Any]:
    ctx = PrimaryContext(0)
    ctx.make_current()
    drv = driver()
    dptr = check("cuMemAlloc", drv.cuMemAlloc(1 << 20))
    rows: dict[str, Any] = {"size_gib": size / GiB}
    rows["cuMemHostAlloc_512MiB_pieces"] = _hostalloc_pieces(size, 512 * MiB, ctx, dptr)
    for backing in ("vmm", "register"):
        for threads in (1, None):
            name = f"{backing}_threads{threads or '_default'}"
            rows[name] = asyncio.run(_fill(size, backing, threads, ctx, dptr))
    base = rows["cuMemHostAlloc_512MiB_pieces"]["gib_s"]
    best = max((v["gib_s"], k) for k, v in rows.items() if isinstance(v, dict) and k != "cuMemHostAlloc_512MiB_pieces")
    rows["best"] = {"arm": best[1], "ratio_vs_cuMemHostAlloc": round(best[0] / base, 3)}
    drv.cuMemFree(dptr)
    ctx.release()
    return rows


FULL_TIER_GOAL_S = 12.0
"""A 96 GiB GPU-usable tier fully resident within this many seconds (H200 machine, defaults)."""


def full_tier(size: int, settle: float) -> dict[str, Any]:
    """A GPU-usable tier of ``size`` made wholly resident with default settings, per backing.

    One fill per arm, default ``fill_threads`` and commit unit, a driver probe
    in the process; ``settle`` seconds of rest before each fill (the VM takes
    freed memory back, and a fill right after a large free runs slower).
    """
    ctx = PrimaryContext(0)
    ctx.make_current()
    drv = driver()
    dptr = check("cuMemAlloc", drv.cuMemAlloc(1 << 20))
    rows: dict[str, Any] = {"size_gib": size / GiB, "goal_s": FULL_TIER_GOAL_S, "settle_s": settle}
    try:
        for backing in ("auto", "register", "vmm"):
            time.sleep(settle)
            row = asyncio.run(_fill(size, backing, None, ctx, dptr))
            row["meets_goal"] = bool(row["seconds"] <= FULL_TIER_GOAL_S * size / (96 * GiB))
            rows[backing] = row
    finally:
        drv.cuMemFree(dptr)
        ctx.release()
    rows["register_vs_vmm"] = round(rows["vmm"]["seconds"] / rows["register"]["seconds"], 3)
    return rows


def _rank(rank: int, device: int, size: int, out: Any) -> None:
    ctx = PrimaryContext(device)
    ctx.make_current()
    drv = driver()
    dptr = check("cuMemAlloc", drv.cuMemAlloc(1 << 20))
    order = ("vmm", "register") if rank % 2 == 0 else ("register", "vmm")
    result: dict[str, Any] = {"rank": rank, "device": device}
    for backing in order:  # arms alternate within each rank, so drift lands on both
        result[backing] = asyncio.run(_fill(size, backing, None, ctx, dptr, device))
    out.put(result)


def contention(processes: int, size: int, one_per_gpu: bool = False) -> dict[str, Any]:
    """``processes`` ranks filling at once: all on GPU 0, or rank r on GPU r."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, r if one_per_gpu else 0, size, out)) for r in range(processes)]
    started = time.perf_counter()
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    wall = time.perf_counter() - started
    summary: dict[str, Any] = {"processes": processes, "size_per_process_gib": size / GiB, "wall_s": round(wall, 2)}
    for backing in ("vmm", "register"):
        arms = [r[backing] for r in results]
        summary[backing] = {
            "per_rank_gib_s_median": round(median([a["gib_s"] for a in arms]), 3),
            "aggregate_gib_s": round(sum(a["gib_s"] for a in arms), 3),
            "blocked_fraction_max": max(a["blocked_fraction"] for a in arms),
            "worst_stall_ms": max(a["worst_stall_ms"] for a in arms),
            "after_worst_stall_ms": max(a["after_worst_stall_ms"] for a in arms),
        }
    return summary


# -- 4. event-loop lag -----------------------------------------------------------------


async def _lag(size: int, backing: str) -> dict[str, float]:
    async with HostTier(_cfg(size, backing)) as tier:
        filled = asyncio.ensure_future(tier.wait_resident())
        lags = await sample_loop_lag(filled)
        await filled
    return summary_ms(lags)


def loop_lag(size: int) -> dict[str, Any]:
    return {
        f"{name}_{backing}": run_on(factory, _lag(size, backing))
        for name, factory in loop_factories().items()
        for backing in ("vmm", "register")
    }


# -- 5. copy bandwidth -----------------------------------------------------------------


def _timed(fn: Any, stream: Any, repeats: int = 3) -> float:
    drv = driver()
    best = float("inf")
    for _ in range(repeats):
        check("cuStreamSynchronize", drv.cuStreamSynchronize(stream))
        t0 = time.perf_counter()
        fn()
        check("cuStreamSynchronize", drv.cuStreamSynchronize(stream))
        best = min(best, time.perf_counter() - t0)
    return best


async def _direction(
    engine: CopyEngine,
    tier: HostTier,
    slots: Any,
    host: Any,
    dev: Any,
    slot: int,
    direction: str,
    ref: float,
    stream: Any,
) -> dict[str, Any]:
    drv = driver()
    total = len(slots) * slot
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    pairs = list(zip(dst.tolist(), src.tolist(), strict=True))

    def per_slot_loop() -> None:
        for d, s in pairs:
            check("cuMemcpyAsync", drv.cuMemcpyAsync(d, s, slot, stream))

    errors: dict[str, str] = {}
    try:
        loop_s: float | None = _timed(per_slot_loop, stream)
    except Exception as exc:
        loop_s, errors["per_slot"] = None, repr(exc)
    try:
        plain_s: float | None = _timed(lambda: _plain_batch(drv, dst, src, slot, stream, direction), stream)
        plain_error = None
    except Exception as exc:  # the baseline's failure is reported, not fatal
        plain_s, plain_error = None, repr(exc)
    ids = slots.tolist()
    call = engine.to_device if direction == "h2d" else engine.to_host
    await call(tier, ids, dev)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        await call(tier, ids, dev)
        times.append(time.perf_counter() - t0)
    ours_s = min(times)

    def gbs(secs: float) -> float:
        return round(total / secs / 1e9, 2)

    return {
        "aiokvtier_GBps": gbs(ours_s),
        "one_large_copy_GBps": gbs(ref),
        "per_slot_cuMemcpyAsync_GBps": None if loop_s is None else gbs(loop_s),
        "per_slot_error": errors.get("per_slot"),
        "plain_batch_CUdeviceptr_GBps": None if plain_s is None else gbs(plain_s),
        "plain_batch_error": plain_error,
        "fraction_of_one_copy": round(ref / ours_s, 3),
        "x_vs_plain_batch": None if plain_s is None else round(plain_s / ours_s, 3),
    }


def _scheduling_us(engine: CopyEngine, tier: HostTier, ids: Any, dev: Any) -> float:
    """The Python-side cost per slot of planning a copy: checks, addresses, sort, merge."""
    t0 = time.perf_counter()
    for _ in range(5):
        engine._plan_slots(tier, ids, dev, "h2d")
    return round((time.perf_counter() - t0) / 5 / len(ids) * 1e6, 4)


@contextmanager
def device_scratch(total: int) -> Iterator[tuple[Any, Any, int]]:
    """``(driver, stream, device buffer of total bytes)`` on device 0, its primary
    context current; all released on the way out."""
    drv = driver()
    ctx = PrimaryContext(0)
    try:
        ctx.make_current()
        stream = check("cuStreamCreate", drv.cuStreamCreate(1))
        try:
            dbuf = int(check("cuMemAlloc", drv.cuMemAlloc(total)))
            try:
                yield drv, stream, dbuf
            finally:
                drv.cuMemFree(dbuf)
        finally:
            drv.cuStreamDestroy(stream)
    finally:
        ctx.release()


async def _copies(total: int, backing: str) -> dict[str, Any]:
    results: dict[str, Any] = {"total_gib": total / GiB, "backing": backing}
    async with CopyEngine(0) as engine:
        with device_scratch(total) as (drv, stream, dbuf):
            results |= await _copies_by_slot_size(engine, drv, stream, dbuf, total, backing)
    return results


async def _copies_by_slot_size(
    engine: CopyEngine, drv: Any, stream: Any, dbuf: int, total: int, backing: str
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    # Baseline (a) needs one registration holding every byte: a tier never has one.
    async with StaticHostMem(total, device=0) as staging:
        for slot in (2 * MiB, 256 << 10, 64 << 10):
            n = total // slot
            async with HostTier(_cfg(total, backing, 2, slot=slot)) as tier:
                await tier.wait_resident()
                slots = np.asarray(await tier.allocate(n), dtype=np.int64)
                host = np.uint64(tier.base_address) + slots.astype(np.uint64) * np.uint64(slot)
                refs = _one_large_copy(drv, dbuf, staging.address, total, stream)
                for layout in ("contiguous", "shuffled"):
                    perm = np.arange(n) if layout == "contiguous" else np.random.default_rng(1).permutation(n)
                    dev = np.uint64(dbuf) + perm.astype(np.uint64) * np.uint64(slot)
                    row: dict[str, Any] = {
                        d: await _direction(engine, tier, slots, host, dev, slot, d, refs[d], stream)
                        for d in ("h2d", "d2h")
                    }
                    row["scheduling_us_per_slot"] = _scheduling_us(engine, tier, slots.tolist(), dev)
                    row["scheduling_us_per_slot_numpy_ids"] = _scheduling_us(engine, tier, slots, dev)
                    results[f"slot_{slot >> 10}KiB_{layout}"] = row
    return results


def _one_large_copy(drv: Any, dbuf: int, host: int, total: int, stream: Any) -> dict[str, float]:
    """Baseline (a): one copy of all the bytes from one pinned buffer, the PCIe ceiling."""
    return {
        "h2d": _timed(lambda: check("cuMemcpyHtoDAsync", drv.cuMemcpyHtoDAsync(dbuf, host, total, stream)), stream),
        "d2h": _timed(lambda: check("cuMemcpyDtoHAsync", drv.cuMemcpyDtoHAsync(host, dbuf, total, stream)), stream),
    }


def _plain_batch(drv: Any, dst: Any, src: Any, size: int, stream: Any, direction: str) -> None:
    """Baseline (c): cuda-bindings' cuMemcpyBatchAsync with one CUdeviceptr object per address."""
    n = len(dst)
    attrs = drv.CUmemcpyAttributes()
    attrs.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    host, device = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST, drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    attrs.srcLocHint.type, attrs.dstLocHint.type = (host, device) if direction == "h2d" else (device, host)
    step = DEFAULT_MAX_BATCH  # the engine's cap: the comparison isolates how descriptors are built
    for i in range(0, n, step):
        d = [drv.CUdeviceptr(int(a)) for a in dst[i : i + step].tolist()]
        s = [drv.CUdeviceptr(int(a)) for a in src[i : i + step].tolist()]
        check("cuMemcpyBatchAsync", drv.cuMemcpyBatchAsync(d, s, [size] * len(d), len(d), [attrs], [0], 1, stream))


def sections(args: Any) -> dict[str, Callable[[], Any]]:
    """The program's sections by name, in their order; building them touches no GPU."""
    quick = args.quick
    return {
        "time_to_first_allocation": lambda: first_allocation((2 if quick else 64) * GiB),
        "fill_throughput": lambda: fill_throughput((2 if quick else 16) * GiB),
        "fill_progress": lambda: fill_progress((2 if quick else 64) * GiB),
        "full_tier": lambda: full_tier(int(args.full_gib * GiB), args.settle),
        "event_loop_lag_during_fill": lambda: loop_lag((1 if quick else 8) * GiB),
        "copy_bandwidth": lambda: {
            "sm_path_shuffled": _sm.copy_bandwidth_sm(128 * MiB),
            **{
                b: run_on(asyncio.new_event_loop, _copies((256 * MiB) if quick else 2 * GiB, b))
                for b in ("vmm", "register")
            },
        },
        "sm_concurrent_compute": lambda: _sm.concurrent_compute(128 * MiB),
        "request_latency": lambda: _requests.section(quick),
        "executor_responsiveness": lambda: {
            "1_process": contention(1, (1 if quick else 8) * GiB),
            "8_processes": contention(8, (1 if quick else 6) * GiB),
            "8_processes_one_pool": pool_contention(8, (1 if quick else 48) * GiB, "host"),
        },
        "cold": lambda: _cold.section(args, ["host", "register", "vmm"], cuda=True),
    }


def run(args: Any) -> dict[str, Any]:
    return run_sections(sections(args), args.sections, title="bench cuda")


def run_ranks(args: Any) -> dict[str, Any]:
    """One rank per visible GPU, each filling its own GPU's tier with a probe (the multi-GPU reference)."""
    from .._cuda._driver import device_count

    gpus = device_count()
    parts = {"one_rank_per_gpu": lambda: contention(gpus, int(args.size_gib * GiB), one_per_gpu=True)}
    return {"gpus": gpus, **run_sections(parts, None, title="bench ranks")}
