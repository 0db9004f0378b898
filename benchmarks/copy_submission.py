"""How a batch of small copies is cut into driver calls: the measurements behind
the engine's first-call ramp and its 1024-descriptor cap.

Shuffled 64 KiB pages of a filled vmm tier are copied by: bare
``cuMemcpyBatchAsync`` calls of fixed sizes or ramped sizes (the descriptors
already built), the plain batch with one ``CUdeviceptr`` per address, and the
engine itself (slot ids as a list and as an int64 array). Arms are
interleaved over rounds so that drift on the machine hits them all alike.

A study, not a user's benchmark: ``python benchmarks/copy_submission.py
[--gib 2] [--rounds 5]`` on a GPU machine prints its JSON.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from aiokvtier import CopyEngine, HostTier
from aiokvtier._copy._plan import chunk_slices
from aiokvtier._cuda._batch import DEFAULT_MAX_BATCH, BatchCall, resolve_batch_function
from aiokvtier._cuda._driver import check
from aiokvtier.bench._common import GiB, machine, run_on
from aiokvtier.bench._cuda import _cfg, _plain_batch, device_scratch

SLOT = 64 << 10


class _Arms:
    """The arms of one direction; each runs to completion (stream synchronised)."""

    def __init__(self, drv: Any, call: BatchCall, dst: Any, src: Any, stream: Any, direction: str) -> None:
        self.drv, self.call, self.dst, self.src, self.stream, self.direction = drv, call, dst, src, stream, direction
        self.sizes = np.full(len(dst), SLOT, dtype=np.uint64)
        self.first_call: dict[str, list[float]] = {}

    def bare(self, name: str, calls: list[slice]) -> Callable[[], None]:
        def run() -> None:
            for i, part in enumerate(calls):
                t0 = time.perf_counter()
                self.call(self.dst[part], self.src[part], self.sizes[part], self.stream)
                if i == 0:
                    self.first_call.setdefault(name, []).append(time.perf_counter() - t0)
            self.sync()

        return run

    def plain(self) -> None:
        _plain_batch(self.drv, self.dst, self.src, SLOT, self.stream, self.direction)
        self.sync()

    def sync(self) -> None:
        check("cuStreamSynchronize", self.drv.cuStreamSynchronize(self.stream))


async def _direction(
    engine: CopyEngine, tier: HostTier, slots: Any, dev: Any, arms: _Arms, rounds: int
) -> dict[str, Any]:
    n = len(slots)
    runs: dict[str, Callable[[], None]] = {}
    for cap in (1024, 4096, 16384, n):
        runs[f"bare_calls_of_{cap}"] = arms.bare(f"bare_calls_of_{cap}", chunk_slices(n, cap, first=cap))
    for cap in (1024, 4096):
        runs[f"bare_ramp_128_to_{cap}"] = arms.bare(f"bare_ramp_128_to_{cap}", chunk_slices(n, cap, first=128))
    runs[f"plain_batch_CUdeviceptr_{DEFAULT_MAX_BATCH}"] = arms.plain
    ids = slots.tolist()
    engine_call = engine.to_device if arms.direction == "h2d" else engine.to_host
    times: dict[str, list[float]] = {name: [] for name in runs}
    times |= {"engine_list_ids": [], "engine_int64_ids": []}
    await engine_call(tier, ids, dev)  # warm-up
    for _ in range(rounds):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
        for name, given in (("engine_list_ids", ids), ("engine_int64_ids", slots)):
            t0 = time.perf_counter()
            await engine_call(tier, given, dev)
            times[name].append(time.perf_counter() - t0)
    total = n * SLOT
    out: dict[str, Any] = {}
    for name, secs in times.items():
        out[name] = {
            "best_GBps": round(total / min(secs) / 1e9, 2),
            "median_GBps": round(total / statistics.median(secs) / 1e9, 2),
        }
        if name in arms.first_call:
            out[name]["first_call_ms"] = round(statistics.median(arms.first_call[name]) * 1e3, 3)
    return out


async def study(total: int, rounds: int) -> dict[str, Any]:
    n = total // SLOT
    result: dict[str, Any] = {"total_gib": total / GiB, "slot_kib": SLOT >> 10, "rounds": rounds}
    with device_scratch(total) as (drv, stream, dbuf):
        function, abi = resolve_batch_function(drv)
        async with HostTier(_cfg(total, "vmm", 2, slot=SLOT)) as tier, CopyEngine(0) as engine:
            await tier.wait_resident()
            slots = np.asarray(await tier.allocate(n), dtype=np.int64)
            host = np.uint64(tier.base_address) + slots.astype(np.uint64) * np.uint64(SLOT)
            dev = np.uint64(dbuf) + np.random.default_rng(1).permutation(n).astype(np.uint64) * np.uint64(SLOT)
            for direction in ("h2d", "d2h"):
                src, dst = (host, dev) if direction == "h2d" else (dev, host)
                arms = _Arms(drv, BatchCall(function, abi, direction, 0), dst, src, stream, direction)
                result[direction] = await _direction(engine, tier, slots, dev, arms, rounds)
    return result


def main() -> None:
    import argparse
    import asyncio
    import json

    parser = argparse.ArgumentParser(prog="python benchmarks/copy_submission.py")
    parser.add_argument("--gib", type=float, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    result = run_on(asyncio.new_event_loop, study(int(args.gib * GiB), args.rounds))
    print(json.dumps({"study": "copy_submission", "machine": machine(), **result}, indent=2))


if __name__ == "__main__":
    main()
