"""The ``cold`` section: the first allocation of a fresh process, beside the warmed figure.

Each sample is a fresh Python process (this module run with ``-m``) that opens
a tier, awaits its first allocation and closes it (the cold figure), settles,
then does the same again (the warm figure, what a benchmark with a warm-up
open shows). The parent interleaves the arms and takes medians.
"""

from __future__ import annotations

import asyncio
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from .._config import HostTierConfig
from .._host._tier import HostTier
from .._progress import note
from ._common import GiB, MiB, median

GOAL_MS = 30  # the target for the cold figure, measured as DESIGN.md section 7 defines it
SETTLE_S = 0.5
SLOT = 2 * MiB


@dataclass(frozen=True)
class Arm:
    backing: str
    threads: int
    prewarmed: bool = False
    """cuda-bindings imported and initialised before the clock starts (a process that uses it already)."""

    @property
    def name(self) -> str:
        return f"{self.backing}_threads{self.threads}" + ("_bindings_imported" if self.prewarmed else "")


def section(args: Any, backings: list[str], cuda: bool) -> dict[str, Any]:
    """The section from the command line's ``--cold-*`` options (their defaults already resolved)."""
    prewarm = cuda and getattr(args, "cold_prewarm", False)
    return cold_first_allocation(
        backings, args.cold_threads, int(args.cold_gib * GiB), args.cold_repeats, cuda, prewarm
    )


def cold_first_allocation(
    backings: list[str], threads: list[int], size: int, repeats: int, cuda: bool, prewarm: bool = False
) -> dict[str, Any]:
    """Per arm, ``repeats`` fresh processes; arm after arm in each repeat, so drift lands on all.

    With ``prewarm``, each arm also runs with cuda-bindings imported before the
    clock starts: the difference is what importing the bindings costs the first open.
    """
    variants = (False, True) if prewarm else (False,)
    arms = [Arm(b, k, p) for b in backings for k in dict.fromkeys(threads) for p in variants]
    samples: dict[Arm, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for repeat in range(repeats):
        for arm in arms:
            note(f"{arm.name}, a fresh process, repeat {repeat + 1} of {repeats}")
            samples[arm].append(_sample(arm, size, cuda))
    first = samples[arms[0]][0]
    out: dict[str, Any] = {
        "quota_gib": size / GiB,
        "slot_mib": SLOT // MiB,
        "repeats": repeats,
        "python": first["python"],
        "loop": first["loop"],
    }
    if cuda:
        out["cuda_context"] = first["cuda_context"]  # "torch" or "cuda-bindings"
    out["arms"] = {arm.name: _arm_summary(arm, rows) for arm, rows in samples.items()}
    return out


def _arm_summary(arm: Arm, rows: list[dict[str, Any]]) -> dict[str, Any]:
    cold = [r["cold_ms"] for r in rows]
    warm = median([r["warm_ms"] for r in rows])
    return {
        "backing": arm.backing,
        "fill_threads": arm.threads,
        "cold_ms": {"median": round(median(cold), 2), "min": round(min(cold), 2), "max": round(max(cold), 2)},
        "warm_ms_median": round(warm, 2),
        "ratio_cold_warm": round(median(cold) / warm, 2),
        "goal_ms": GOAL_MS,
    }


def _sample(arm: Arm, size: int, cuda: bool) -> dict[str, Any]:
    config: dict[str, Any] = {"quota": size, "max_quota": size, "slot_size": SLOT, "fill_threads": arm.threads}
    if cuda:
        config |= {"device": 0, "backing": arm.backing}
    spec = json.dumps({"config": config, "cuda": cuda, "prewarm": arm.prewarmed})
    # The child inherits this process's environment (PYTHONPATH included) and
    # working directory, so it imports the same aiokvtier.
    done = subprocess.run(
        [sys.executable, "-m", __name__, spec], capture_output=True, text=True, timeout=300, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"cold sample {arm.name} failed ({done.returncode}): {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# -- the child process ------------------------------------------------------------------


def _make_cuda_context() -> str:
    """Make device 0's context current the way a serving process has it; say who made it."""
    try:
        import torch
    except ImportError:
        from cuda.bindings import driver as drv

        from .._cuda._driver import check

        check("cuInit", drv.cuInit(0))
        dev = check("cuDeviceGet", drv.cuDeviceGet(0))
        ctx = check("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(dev))
        check("cuCtxSetCurrent", drv.cuCtxSetCurrent(ctx))
        return "cuda-bindings"
    torch.cuda.init()
    # init() leaves the primary context to the first allocation: make one, as a model load would.
    torch.empty(1, device="cuda:0")
    return "torch"


async def _first_allocation(config: HostTierConfig) -> float:
    started = time.perf_counter()
    tier = await HostTier.open(config)
    await tier.allocate()
    elapsed = time.perf_counter() - started
    # Closing stops the fill between units, so a quota larger than the machine never becomes resident.
    await tier.aclose()
    return elapsed


async def _cold_then_warm(config: HostTierConfig) -> tuple[float, float]:
    cold = await _first_allocation(config)
    await asyncio.sleep(SETTLE_S)
    warm = await _first_allocation(config)
    return cold, warm


def _child(spec: dict[str, Any]) -> None:
    context = _make_cuda_context() if spec["cuda"] else None
    if spec.get("prewarm"):
        from .._cuda._driver import driver

        driver()
    config = HostTierConfig.model_validate(spec["config"])
    cold, warm = asyncio.run(_cold_then_warm(config))
    row = {
        "cold_ms": cold * 1e3,
        "warm_ms": warm * 1e3,
        "cuda_context": context,
        "python": platform.python_version(),
        "loop": "asyncio",
    }
    print(json.dumps(row))


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
