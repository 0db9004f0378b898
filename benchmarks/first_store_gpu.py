"""How soon a serving process can take its first offloaded block on a GPU machine.

What an engine's offloading worker does at start, without the engine (the
vLLM adapter's worker opens exactly this: a ``HostTier`` for the device and a
``CopyEngine``, then copies GPU pages into tier slots): from nothing to the
first 32 GPU pages of 64 KiB landed in the tier, for a tier of ``--size``
bytes (reserved whole, filled in the background; closed right after, so a size
past the machine's memory is fine). Beside it, in the same process and
interleaved, the buffer an engine pins before serving today:
``torch.empty(--pinned-size, pin_memory=True)`` (vLLM's CPU tier), capped by
the machine's memory, in a fresh process per sample.

A CUDA context exists before either arm starts (a serving process has one).
Settles ``--settle`` seconds before each sample: freed memory goes back to the
host on these VMs, and an allocation right after a large free is slower.

::

    python benchmarks/first_store_gpu.py --size 256GiB --pinned-size 64GiB --runs 3

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from aiokvtier import CopyEngine, HostTier, HostTierConfig
from aiokvtier._config import _size_bytes
from aiokvtier.bench._common import machine

PAGE = 64 << 10
PAGES = 32


async def first_store(size: int, gpu: torch.Tensor) -> dict[str, float]:
    began = time.perf_counter()
    config = HostTierConfig(quota=size, max_quota=size, slot_size=PAGE, device=0)
    async with HostTier(config) as tier, CopyEngine(0) as engine:
        opened = time.perf_counter()
        slots = await tier.allocate(PAGES)
        await engine.to_host(tier, slots, gpu)
        landed = time.perf_counter()
        resident = tier.statistics().resident_bytes
        back = torch.empty_like(gpu)
        await engine.to_device(tier, slots, back)
        torch.cuda.synchronize()
        if not torch.equal(back, gpu):
            raise RuntimeError("the first store did not come back bit-exact")
    return {
        "open_ms": (opened - began) * 1e3,
        "first_store_ms": (landed - began) * 1e3,
        "resident_bytes": resident,
    }


_PINNED = """
import sys, time, torch
torch.cuda.init()
began = time.perf_counter()
buffer = torch.empty(int(sys.argv[1]), dtype=torch.uint8, pin_memory=True)
print((time.perf_counter() - began) * 1e3)
"""


def pinned(size: int) -> float:
    """Milliseconds to pin ``size`` bytes with torch, in a fresh process with its CUDA context made
    first: in this one, torch's caching host allocator would hand back the block pinned before."""
    out = subprocess.run([sys.executable, "-c", _PINNED, str(size)], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="256GiB", help="the tier's quota and max_quota")
    parser.add_argument("--pinned-size", default="64GiB", help="bytes torch pins, the baseline (0: skip)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--settle", type=float, default=5.0)
    args = parser.parse_args()
    size, pinned_size = _size_bytes(args.size, "--size"), _size_bytes(args.pinned_size, "--pinned-size")
    torch.cuda.init()
    gpu = torch.randint(0, 256, (PAGES, PAGE), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    ours: list[dict[str, float]] = []
    theirs: list[float] = []
    for _ in range(args.runs):  # interleaved: drift lands on both arms
        time.sleep(args.settle)
        ours.append(asyncio.run(first_store(size, gpu)))
        if pinned_size:
            time.sleep(args.settle)
            theirs.append(pinned(pinned_size))
    first = statistics.median(r["first_store_ms"] for r in ours)
    report: dict[str, Any] = {
        "benchmark": "first_store_gpu",
        "machine": machine(),
        "gpu": torch.cuda.get_device_name(0),
        "tier_bytes": size,
        "aiokvtier": {
            "runs": [{k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()} for r in ours],
            "first_store_median_ms": round(first, 2),
        },
    }
    if theirs:
        report["torch_pinned"] = {
            "bytes": pinned_size,
            "ready_ms": [round(v, 1) for v in theirs],
            "ready_median_ms": round(statistics.median(theirs), 1),
            "ratio_to_first_store": round(statistics.median(theirs) / first, 1),
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
