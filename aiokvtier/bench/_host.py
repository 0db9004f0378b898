"""``python -m aiokvtier.bench host``: the host tier against making memory resident up front."""

from __future__ import annotations

import asyncio
import gc
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from .._config import HostTierConfig
from .._host._tier import HostTier
from .._progress import note
from . import _cold, _fill, _requests
from ._common import (
    GiB,
    MiB,
    bare_populate,
    loop_factories,
    median,
    record_fill,
    run_on,
    run_sections,
    sample_loop_lag,
    summary_ms,
)


def _config(size: int, **overrides: Any) -> HostTierConfig:
    values: dict[str, Any] = {"quota": size, "max_quota": size, "slot_size": 64 << 10, "numa_node": None}
    values.update(overrides)
    return HostTierConfig(**values)


async def _first_allocation(size: int) -> float:
    started = time.perf_counter()
    async with HostTier(_config(size)) as tier:
        await tier.allocate()
        return time.perf_counter() - started


async def _full_fill(size: int, threads: int) -> float:
    started = time.perf_counter()
    async with HostTier(_config(size, fill_threads=threads)) as tier:
        await tier.wait_resident()
        return time.perf_counter() - started


def time_to_first_allocation(sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    # A serving process has imported everything and started threads before its
    # tier opens: one untimed open warms the same things up here.
    asyncio.run(_first_allocation(64 * MiB))
    rows = []
    for size in sizes:
        ours, upfront = [], []
        for repeat in range(repeats):  # alternate the arms so drift lands on both
            note(f"{size / GiB:g} GiB, repeat {repeat + 1} of {repeats}")
            ours.append(asyncio.run(_first_allocation(size)))
            upfront.append(bare_populate(size))
        rows.append(
            {
                "quota_gib": size / GiB,
                "aiokvtier_first_allocation_ms": round(median(ours) * 1e3, 2),
                "upfront_resident_ms": round(median(upfront) * 1e3, 1),
                "sooner_x": round(median(upfront) / median(ours), 1),
            }
        )
    return rows


def fill_progress(size: int) -> dict[str, Any]:
    """Usable GiB over time: a tier filling against making the same range resident up front, one run each."""
    asyncio.run(_first_allocation(64 * MiB))  # imports and threads warm, as in a serving process
    ours = asyncio.run(record_fill(_config(size)))
    upfront = bare_populate(size)
    return {
        "quota_gib": size / GiB,
        "aiokvtier_host": ours,
        "upfront_resident_s": round(upfront, 4),
        "first_allocation_sooner_x": round(upfront * 1e3 / ours["first_allocation_ms"], 1),
    }


def fill_throughput(size: int, threads: list[int], repeats: int) -> dict[str, Any]:
    bare: list[float] = []
    ours: dict[int, list[float]] = {k: [] for k in threads}
    for repeat in range(repeats):
        note(f"repeat {repeat + 1} of {repeats}")
        bare.append(bare_populate(size))
        for k in threads:
            ours[k].append(asyncio.run(_full_fill(size, k)))
    bare_gibs = size / GiB / median(bare)
    out: dict[str, Any] = {"size_gib": size / GiB, "bare_populate_gib_s": round(bare_gibs, 3)}
    for k, secs in ours.items():
        gibs = size / GiB / median(secs)
        out[f"aiokvtier_threads{k}_gib_s"] = round(gibs, 3)
        out[f"ratio_threads{k}"] = round(gibs / bare_gibs, 3)
    return out


async def _lag_during_fill(size: int) -> dict[str, Any]:
    async with HostTier(_config(size)) as tier:
        filled = asyncio.ensure_future(tier.wait_resident())
        lags = await sample_loop_lag(filled)
        await filled
    idle_stop = asyncio.ensure_future(asyncio.sleep(1.0))
    idle = await sample_loop_lag(idle_stop)
    return {"during_fill": summary_ms(lags), "idle_baseline": summary_ms(idle)}


def loop_lag(size: int) -> dict[str, Any]:
    out = {}
    for name, factory in loop_factories().items():
        note(f"on {name}")
        out[name] = run_on(factory, _lag_during_fill(size))
    return out


async def _slot_ops(size: int, pairs: int) -> dict[str, Any]:
    async with HostTier(_config(size)) as tier:
        await tier.wait_resident()
        alloc, free = tier.allocate_nowait, tier.free
        started = time.perf_counter()
        for _ in range(pairs):
            free(alloc())
        pair_s = (time.perf_counter() - started) / pairs
        # Batches of 4096 slots, or half the tier where it holds fewer (a small --ops-gib).
        n = max(1, min(4096, tier.statistics().slots_total // 2))
        batch: list[float] = []
        for _ in range(50):
            started = time.perf_counter()
            slots = await tier.allocate_many(n)
            tier.free_many(slots)
            batch.append(time.perf_counter() - started)
        # Fresh slots each time: free a full batch, then allocate past it (at least one batch fits).
        fresh: list[float] = []
        held: list[int] = []
        for _ in range(max(1, min(10, tier.statistics().slots_total // n - 1))):
            started = time.perf_counter()
            held += await tier.allocate_many(n)
            fresh.append(time.perf_counter() - started)
        tier.free_many(held)
    return {
        "nowait_free_pairs_per_s": round(1 / pair_s),
        "batch_slots": n,
        "allocate_many_4096_plus_free_many_ms": round(median(batch) * 1e3, 3),
        "allocate_many_4096_fresh_ms": round(median(fresh) * 1e3, 3),
    }


def slot_ops(size: int, pairs: int) -> dict[str, Any]:
    out = {}
    for name, factory in loop_factories().items():
        note(f"on {name}")
        out[name] = run_on(factory, _slot_ops(size, pairs))
    return out


async def _bookkeeping(size: int, slot_size: int) -> dict[str, Any]:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    tier = HostTier(_config(size, slot_size=slot_size))
    await tier.__aenter__()
    await tier.wait_resident()
    fresh = tracemalloc.take_snapshot().compare_to(before, "filename")
    slots = await tier.allocate_many(tier.statistics().slots_total)
    tier.free_many(slots)
    del slots
    gc.collect()
    churned = tracemalloc.take_snapshot().compare_to(before, "filename")
    tracemalloc.stop()
    stats = tier.statistics()
    await tier.aclose()

    def ours(diff: list[tracemalloc.StatisticDiff]) -> int:
        return sum(d.size_diff for d in diff if "aiokvtier" in (d.traceback[0].filename or ""))

    return {
        "quota_gib": size / GiB,
        "slot_kib": slot_size >> 10,
        "slots": stats.slots_total,
        "filled_bytes": ours(fresh),
        "after_allocating_and_freeing_every_slot_bytes": ours(churned),
        "budget_bytes": MiB,
    }


FILL_S_PER_GIB = 0.5
"""A guess at a fill's seconds per GiB, for the relative cost of each section (the estimate of the time left
scales it by what the finished sections took here)."""


def _costs(args: Any, loops: int) -> dict[str, float]:
    """Each section's seconds by ``FILL_S_PER_GIB``, with its fixed waits: only the ratios matter."""
    fill, gib, r, settle = args.fill_gib * FILL_S_PER_GIB, args.gib * FILL_S_PER_GIB, args.repeats, args.settle
    return {
        "time_to_first_allocation": r * sum(args.sizes) * FILL_S_PER_GIB + 0.05 * len(args.sizes) * r,
        "fill_throughput": 3 * r * fill,
        "fill_progress": 2 * fill + 0.1,
        "event_loop_lag_during_fill": loops * (fill + 1.0),
        "slot_operations": loops * (args.ops_gib * FILL_S_PER_GIB + 1.5e-6 * args.pairs + 0.1),
        "bookkeeping": 3 * args.bookkeeping_gib * FILL_S_PER_GIB,
        "cold": args.cold_repeats * len(args.cold_threads) * 1.5,
        "neighbours": 5 * r * (gib + settle) + loops * 2 * (gib + settle),
        "fill_scaling": 2 * 4 * 3 * r * (gib + settle),
        "busy_loop": 2 * r * (1.5 * gib + settle),
        "thp_auto": 2 * 3 * r * (gib + settle) + 8,
        "request_latency": loops * (2.0 if getattr(args, "quick", False) else 6.0),
    }


def sections(args: Any) -> dict[str, Callable[[], Any]]:
    """The program's sections by name, in their order; building them runs nothing."""
    fill = int(args.fill_gib * GiB)
    return {
        "time_to_first_allocation": lambda: time_to_first_allocation([int(s * GiB) for s in args.sizes], args.repeats),
        "fill_throughput": lambda: fill_throughput(fill, [1, 2], args.repeats),
        "fill_progress": lambda: fill_progress(fill),
        "event_loop_lag_during_fill": lambda: loop_lag(fill),
        "slot_operations": lambda: slot_ops(int(args.ops_gib * GiB), args.pairs),
        "bookkeeping": lambda: asyncio.run(_bookkeeping(int(args.bookkeeping_gib * GiB), 64 << 10)),
        "cold": lambda: _cold.section(args, ["host"], cuda=False),
        "request_latency": lambda: _requests.host_section(bool(getattr(args, "quick", False))),
        "neighbours": lambda: _fill.neighbours(
            int(args.gib * GiB),
            args.repeats,
            args.settle,
            [int(u * MiB) for u in args.register_units_mib],
            [int(u * MiB) for u in args.vmm_units_mib],
        ),
        "fill_scaling": lambda: _fill.fill_scaling(int(args.gib * GiB), args.repeats, args.settle),
        "busy_loop": lambda: _fill.busy_loop(int(args.gib * GiB), args.repeats, args.settle),
        "thp_auto": lambda: _fill.thp_auto(
            int(args.gib * GiB),
            args.repeats,
            args.settle,
            None if args.fragment_gib is None else int(args.fragment_gib * GiB),
        ),
    }


def run(args: Any) -> dict[str, Any]:
    parts = sections(args)
    # thp_auto fragments memory on purpose (gigabytes held in 4 KiB pieces): only when asked for.
    chosen = args.sections or [name for name in parts if name != "thp_auto"]
    costs = _costs(args, len(loop_factories()))
    return run_sections(parts, chosen, title="bench host", costs=costs)
