"""``python -m aiokvtier.bench store``: the BlockStore beside the plain structure or copy it wraps.

Sections: ``lookup`` (a prefix lookup against a dict scan), ``bookkeeping``
(tracemalloc bytes per block), ``cpu_copies`` (store + load against
``ctypes.memmove`` of the same bytes), ``gpu_copies`` (store + load against
``CopyEngine.to_host`` / ``to_device`` on the same slots; needs CUDA) and
``churn`` (hit rates of the store's policies against an ``OrderedDict`` LRU
replaying the same trace); ``shared``, run only when named (a pool served
here, used by other processes: attaching during the fill, a cross-process
lookup and load, eight processes' memory; ``aiokvtier.bench._shared``).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import hashlib
import time
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from .._config import HostTierConfig
from .._host._tier import HostTier
from .._progress import note
from .._store._policy import make_policy
from .._store._store import BlockStore
from . import _tiers
from ._common import median, percentile, run_sections
from ._shared import shared

KiB = 1 << 10


def _config(quota: int, slot: int, **overrides: Any) -> HostTierConfig:
    values: dict[str, Any] = {"quota": quota, "max_quota": quota, "slot_size": slot, "numa_node": None}
    values.update(overrides)
    return HostTierConfig.model_validate(values)


def _keys(n: int, start: int = 0) -> list[bytes]:
    """32-byte keys, as block hashes are (sha256 of a counter: distinct, reproducible)."""
    return [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(start, start + n)]


async def _fill(store: BlockStore, keys: list[bytes], batch: int = 4096) -> None:
    """Store one 1-byte page per key, ``batch`` keys a call."""
    pages = np.full((batch, 1), ord("x"), dtype=np.uint8)
    for i in range(0, len(keys), batch):
        chunk = keys[i : i + batch]
        result = await store.store(chunk, pages[: len(chunk)])
        if result.skipped:
            raise RuntimeError(f"the store skipped {len(result.skipped)} blocks while filling")


# -- lookup ---------------------------------------------------------------------------------


def _ms(values: list[float]) -> float:
    """The median of ``values`` (seconds) in milliseconds."""
    return round(median(values) * 1e3, 3)


async def _lookup(blocks: int, prefix: int, repeats: int, policy: str) -> dict[str, Any]:
    async with HostTier(_config(blocks * 4 * KiB, 4 * KiB)) as tier, BlockStore(tier, policy=policy) as store:
        keys = _keys(blocks)
        await _fill(store, keys)
        hit = keys[blocks // 2 : blocks // 2 + prefix]  # stored keys, not the most recent ones
        miss_after = [*hit[: prefix // 2], *_keys(prefix - prefix // 2, start=blocks)]
        table = {k: i for i, k in enumerate(keys)}  # the baseline: the same keys in a plain dict

        def dict_scan(query: list[bytes]) -> int:
            get, n = table.get, 0
            for key in query:
                if get(key) is None:
                    break
                n += 1
            return n

        arms: dict[str, Callable[[], int]] = {
            "store_all_hit": lambda: store.lookup(hit),
            "dict_scan_all_hit": lambda: dict_scan(hit),
            "store_half_hit": lambda: store.lookup(miss_after),
            "dict_scan_half_hit": lambda: dict_scan(miss_after),
        }
        samples: dict[str, list[float]] = {name: [] for name in arms}
        for _ in range(repeats):  # arms interleaved, so drift lands on all of them
            for name, arm in arms.items():
                started = time.perf_counter()
                found = arm()
                samples[name].append(time.perf_counter() - started)
                expect = prefix if "all_hit" in name else prefix // 2
                if found != expect:
                    raise RuntimeError(f"{name} found {found} of {prefix}, expected {expect}")
    out: dict[str, Any] = {"blocks": blocks, "prefix": prefix, "key_bytes": 32, "repeats": repeats, "policy": policy}
    for name, values in samples.items():
        out[name] = {
            "median_us": round(median(values) * 1e6, 1),
            "p99_us": round(percentile(values, 99) * 1e6, 1),
        }
    out["ratio_all_hit_vs_dict_scan"] = round(
        out["store_all_hit"]["median_us"] / max(out["dict_scan_all_hit"]["median_us"], 1e-3), 2
    )
    out["goal_us"] = 1000
    return out


# -- bookkeeping ----------------------------------------------------------------------------


async def _bookkeeping(blocks: int, policy: str) -> dict[str, Any]:
    slot = 4 * KiB
    async with HostTier(_config(blocks * slot, slot)) as tier:
        await tier.wait_resident()
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            keys = _keys(blocks)
            with_keys = tracemalloc.take_snapshot()
            store = await BlockStore.open(tier, policy=policy)
            await _fill(store, keys)
            gc.collect()
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        stats = store.statistics()
        await store.aclose()

    def by_file(new: tracemalloc.Snapshot, old: tracemalloc.Snapshot) -> dict[str, int]:
        out: dict[str, int] = {}
        for diff in new.compare_to(old, "filename"):
            name = diff.traceback[0].filename or ""
            if "aiokvtier" in name and diff.size_diff:
                short = name[name.rindex("aiokvtier") :]
                out[short] = out.get(short, 0) + diff.size_diff
        return out

    keys_bytes = sum(d.size_diff for d in with_keys.compare_to(before, "filename"))
    files = by_file(after, with_keys)
    store_bytes = sum(v for k, v in files.items() if "_store" in k)
    return {
        "blocks": stats.blocks,
        "slot_kib": slot >> 10,
        "policy": policy,
        "store_bytes_per_block": round(store_bytes / blocks, 1),
        "keys_bytes_per_block": round(keys_bytes / blocks, 1),
        "with_keys_bytes_per_block": round((store_bytes + keys_bytes) / blocks, 1),
        "by_file_bytes": dict(sorted(files.items())),
        "goal_bytes_per_block": 200,
    }


# -- copies on the CPU ----------------------------------------------------------------------


async def _cpu_copies(blocks: int, page: int, repeats: int) -> dict[str, Any]:
    # Twice the slots: the store's blocks and the baseline's slots side by side.
    async with HostTier(_config(2 * blocks * page, page, fill_threads=2)) as tier:
        await tier.wait_resident()
        raw_slots = await tier.allocate(blocks)
        src = np.random.default_rng(0).integers(0, 256, size=(blocks, page), dtype=np.uint8)
        dst = np.zeros_like(src)
        keys = _keys(blocks)
        pairs_in = [(tier.address(s), src.ctypes.data + i * page) for i, s in enumerate(raw_slots)]
        pairs_out = [(dst.ctypes.data + i * page, tier.address(s)) for i, s in enumerate(raw_slots)]

        def memmove_round() -> tuple[float, float]:
            move = ctypes.memmove
            t0 = time.perf_counter()
            for d, s in pairs_in:
                move(d, s, page)
            t1 = time.perf_counter()
            for d, s in pairs_out:
                move(d, s, page)
            return t1 - t0, time.perf_counter() - t1

        async with BlockStore(tier) as store:

            async def store_round() -> tuple[float, float]:
                t0 = time.perf_counter()
                result = await store.store(keys, src)
                t1 = time.perf_counter()
                await store.load(keys, dst)
                t2 = time.perf_counter()
                if len(result.stored) != blocks:
                    raise RuntimeError(f"stored {len(result.stored)} of {blocks}")
                store.discard(keys)  # untimed: the next round stores afresh
                return t1 - t0, t2 - t1

            await store_round()  # warm: first touch of dst, the store's thread
            memmove_round()
            ours: list[tuple[float, float]] = []
            bare: list[tuple[float, float]] = []
            for _ in range(repeats):  # interleaved
                ours.append(await store_round())
                bare.append(memmove_round())
            dst[:] = 0
            await store.store(keys, src)
            await store.load(keys, dst)
            if not np.array_equal(src, dst):
                raise RuntimeError("the bytes loaded differ from the bytes stored")
        tier.free_many(raw_slots)

    total = blocks * page
    ours_ms = _ms([a + b for a, b in ours])
    bare_ms = _ms([a + b for a, b in bare])
    return {
        "blocks": blocks,
        "page_kib": page >> 10,
        "repeats": repeats,
        "store_ms": _ms([a for a, _ in ours]),
        "load_ms": _ms([b for _, b in ours]),
        "store_plus_load_ms": ours_ms,
        "memmove_in_ms": _ms([a for a, _ in bare]),
        "memmove_out_ms": _ms([b for _, b in bare]),
        "memmove_in_plus_out_ms": bare_ms,
        "store_plus_load_GBps": round(2 * total / (ours_ms / 1e3) / 1e9, 2),
        "memmove_GBps": round(2 * total / (bare_ms / 1e3) / 1e9, 2),
        "ratio_store_vs_memmove": round(ours_ms / bare_ms, 3),
        "goal_ratio_at_most": 1.2,
    }


# -- copies through a CopyEngine ------------------------------------------------------------


def _cuda_missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import cuda.bindings  # noqa: F401
    except ImportError:
        return "cuda-bindings is not installed (pip install 'aiokvtier[cuda]')"
    return None


async def _gpu_copies(blocks: int, page: int, repeats: int, method: str) -> dict[str, Any]:
    import torch

    from .._copy._engine import CopyEngine

    config = _config(blocks * page, page, device=0, fill_threads=2)
    async with HostTier(config) as tier, CopyEngine(0, method=method) as engine:
        await tier.wait_resident()
        # Shuffle the tier side: free every slot in a random order, so the
        # store's slots (taken most recently freed first) do not ascend with
        # the tensor's rows.
        every = await tier.allocate(blocks)
        order = np.random.default_rng(1).permutation(blocks)
        tier.free_many([every[i] for i in order.tolist()])
        src = torch.randint(0, 256, (blocks, page), dtype=torch.uint8, device="cuda")
        dst = torch.zeros_like(src)
        torch.cuda.synchronize()  # the engine's streams do not wait for torch's: the pages must be written
        keys = _keys(blocks)
        async with BlockStore(tier, engine) as store:
            await store.store(keys, src)
            # The slots the store chose, read from its map: the baseline copies the very same ones.
            slots = np.asarray([store.slot(k) for k in keys], dtype=np.int64)
            shuffled = bool((np.diff(slots) != 1).mean() > 0.9)

            async def store_round() -> tuple[float, float]:
                store.discard(keys)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                result = await store.store(keys, src)
                t1 = time.perf_counter()
                await store.load(keys, dst)
                t2 = time.perf_counter()
                if len(result.stored) != blocks:
                    raise RuntimeError(f"stored {len(result.stored)} of {blocks}")
                return t1 - t0, t2 - t1

            async def engine_round() -> tuple[float, float]:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                await engine.to_host(tier, slots, src)
                t1 = time.perf_counter()
                await engine.to_device(tier, slots, dst)
                return t1 - t0, time.perf_counter() - t1

            await store_round()
            await engine_round()
            ours: list[tuple[float, float]] = []
            bare: list[tuple[float, float]] = []
            for _ in range(repeats):
                ours.append(await store_round())
                bare.append(await engine_round())
            same_slots = np.asarray([store.slot(k) for k in keys], dtype=np.int64)
            dst.zero_()
            torch.cuda.synchronize()
            await store.load(keys, dst)
            torch.cuda.synchronize()
            equal = bool(torch.equal(src, dst))
        copy_stats = engine.statistics()

    total = blocks * page
    ours_ms = _ms([a + b for a, b in ours])
    bare_ms = _ms([a + b for a, b in bare])
    return {
        "blocks": blocks,
        "page_kib": page >> 10,
        "repeats": repeats,
        "method": method,
        "bytes_by_method": copy_stats.bytes_by_method,
        "sm_crossover_bytes": copy_stats.sm_crossover_bytes,
        "backing": tier.statistics().backing,
        "tier_side_shuffled": shuffled,
        "baseline_slots_are_the_store_slots": bool(np.array_equal(np.sort(slots), np.sort(same_slots))),
        "loaded_equals_stored": equal,
        "store_d2h_ms": _ms([a for a, _ in ours]),
        "load_h2d_ms": _ms([b for _, b in ours]),
        "store_plus_load_ms": ours_ms,
        "engine_to_host_ms": _ms([a for a, _ in bare]),
        "engine_to_device_ms": _ms([b for _, b in bare]),
        "engine_plus_ms": bare_ms,
        "store_d2h_GBps": round(total / (_ms([a for a, _ in ours]) / 1e3) / 1e9, 2),
        "load_h2d_GBps": round(total / (_ms([b for _, b in ours]) / 1e3) / 1e9, 2),
        "engine_d2h_GBps": round(total / (_ms([a for a, _ in bare]) / 1e3) / 1e9, 2),
        "engine_h2d_GBps": round(total / (_ms([b for _, b in bare]) / 1e3) / 1e9, 2),
        "ratio_store_vs_engine": round(bare_ms / ours_ms, 3),
        "goal_ratio_at_least": 0.9,
    }


def gpu_copies(blocks: int, page: int, repeats: int) -> dict[str, Any]:
    """Per engine method: the copy engines (``dma``), and ``auto`` (the default: DMA or the SM kernel)."""
    missing = _cuda_missing()
    if missing is not None:
        return {"skipped": f"needs CUDA: {missing}"}
    return {method: asyncio.run(_gpu_copies(blocks, page, repeats, method)) for method in ("dma", "auto")}


# -- churn ----------------------------------------------------------------------------------


def _zipf_trace(length: int, working_set: int, a: float, seed: int) -> np.ndarray:
    """Block ids in ``[0, working_set)``, Zipf-distributed (numpy's ``zipf``, truncated), popularity shuffled."""
    rng = np.random.default_rng(seed)
    drawn: list[np.ndarray] = []
    have = 0
    while have < length:
        z = rng.zipf(a, size=2 * length)
        z = z[z <= working_set] - 1
        drawn.append(z)
        have += z.size
    ids = np.concatenate(drawn)[:length]
    spread: np.ndarray = rng.permutation(working_set)[ids]  # popular ids spread over the key space
    return spread


def _with_scans(trace: np.ndarray, working_set: int, every: int, scan: int) -> np.ndarray:
    """The trace with a scan of ``scan`` never-repeated ids after every ``every`` requests."""
    parts: list[np.ndarray] = []
    fresh = working_set
    for i in range(0, trace.size, every):
        parts.append(trace[i : i + every])
        parts.append(np.arange(fresh, fresh + scan))
        fresh += scan
    return np.concatenate(parts)


def _lru_baseline(trace: list[int], capacity: int) -> float:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for key in trace:
        if key in cache:
            cache.move_to_end(key)
            hits += 1
        else:
            cache[key] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits / len(trace)


async def _replay(trace: list[int], capacity: int, policy: str) -> dict[str, Any]:
    page = [b"x"]
    async with HostTier(_config(capacity * 4 * KiB, 4 * KiB)) as tier:
        await tier.wait_resident()
        async with BlockStore(tier, policy=policy) as store:
            started = time.perf_counter()
            hits = 0
            for key in trace:
                if store.lookup((key,)):
                    hits += 1
                else:
                    await store.store((key,), page)
            elapsed = time.perf_counter() - started
            stats = store.statistics()
    return {
        "hit_rate": round(hits / len(trace), 4),
        "evictions": stats.evictions,
        "us_per_request": round(elapsed / len(trace) * 1e6, 2),
    }


def policies() -> tuple[list[str], dict[str, str]]:
    """The policy names ``make_policy`` knows, and why each other one is left out."""
    known, unavailable = [], {}
    for name in ("lru", "s3fifo"):
        try:
            make_policy(name, 16)
            known.append(name)
        except ValueError as exc:
            unavailable[name] = str(exc)
    return known, unavailable


def per_policy(measure: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    known, unavailable = policies()
    out: dict[str, Any] = {}
    for name in known:
        note(name)
        out[name] = measure(name)
    return {**out, "policies_unavailable": unavailable}


def churn(capacity: int, length: int, a: float) -> dict[str, Any]:
    known, unavailable = policies()
    working_set = 2 * capacity
    zipf = _zipf_trace(length, working_set, a, seed=2)
    traces = {
        "zipf": zipf,
        # One-hit blocks (a long prompt nobody repeats) between the Zipf requests.
        "zipf_with_scans": _with_scans(zipf, working_set, every=capacity, scan=capacity // 2),
    }
    out: dict[str, Any] = {
        "capacity_blocks": capacity,
        "working_set_blocks": working_set,
        "zipf_a": a,
        "requests": {name: int(t.size) for name, t in traces.items()},
        "policies_unavailable": unavailable,
    }
    for name, trace in traces.items():
        ids = trace.tolist()
        row: dict[str, Any] = {"ordereddict_lru_hit_rate": round(_lru_baseline(ids, capacity), 4)}
        for policy in known:
            note(f"{name}, {policy}")
            row[f"store_{policy}"] = asyncio.run(_replay(ids, capacity, policy))
        out[name] = row
    return out


# -- the program ----------------------------------------------------------------------------


def sections(args: Any) -> dict[str, Callable[[], Any]]:
    """The program's sections by name, in their order; building them runs nothing."""
    quick, repeats = args.quick, args.repeats
    return {
        "lookup": lambda: per_policy(
            lambda p: asyncio.run(_lookup(8192 if quick else 65536, 4096, 20 if quick else 200, p))
        ),
        "bookkeeping": lambda: per_policy(lambda p: asyncio.run(_bookkeeping(65536 if quick else 1 << 20, p))),
        "cpu_copies": lambda: asyncio.run(_cpu_copies(512 if quick else 4096, 64 * KiB, repeats)),
        "gpu_copies": lambda: gpu_copies(512 if quick else 4096, 64 * KiB, max(repeats, 15)),
        "churn": lambda: churn(512 if quick else 4096, 10_000 if quick else 100_000, 1.1),
        "tiers": lambda: _tiers.section(quick, args.disk_path),
        "prefix": lambda: _tiers.prefix_section(quick, args.disk_path),
        "shared": lambda: shared(quick, repeats),
    }


def run(args: Any) -> dict[str, Any]:
    parts = sections(args)
    # shared starts processes of its own, and prefix is a part of tiers: asked for by name only.
    chosen = args.sections or [name for name in parts if name not in ("shared", "prefix")]
    return run_sections(parts, chosen, title="bench store")
