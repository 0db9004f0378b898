"""What planning a per-slot copy costs on the loop, per page, without a GPU.

The planner a CopyEngine runs before it submits (``plan_slots``: slot
checks, addresses, the overlap check, the sort in host address order, the
merge that never crosses a registration) on shuffled slots of a filled host
tier, both directions, for a GPU engine's device side (integer addresses) and
for a host-to-host engine's (addresses inside a second tier). Beside it, in
the same run, the same planner with stable argsorts where it still argsorts
(``SORT_KIND``: large requests now sort by radix passes, untouched by it; see
``plan_cost.py`` for the planner before them); ``x_faster`` is that arm's
time over the planner's. The goal is
``goal_us_per_page`` (planning and submission, at 32k pages).

``python benchmarks/planning.py [--pages 32768] [--rounds 15]`` prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from aiokvtier import HostTier, HostTierConfig
from aiokvtier._copy import _plan, _requests
from aiokvtier.bench._common import machine, median

GOAL_US = 0.1
MiB = 1 << 20


@contextmanager
def stable_sorts() -> Iterator[None]:
    """The baseline: the planner with stable sorts (numpy's timsort on 64-bit keys), as it was."""
    saved = _plan.SORT_KIND
    _plan.SORT_KIND = "stable"
    try:
        yield
    finally:
        _plan.SORT_KIND = saved


def _per_page_us(call: Callable[[], Any], pages: int, rounds: int) -> float:
    call()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return median(times) / pages * 1e6


async def _run(pages: int, page: int, rounds: int) -> dict[str, Any]:
    cfg = HostTierConfig(quota=pages * page, max_quota=pages * page, slot_size=page, commit_unit=64 * MiB)
    async with HostTier(cfg) as tier, HostTier(cfg) as other:
        await tier.wait_resident()
        await other.wait_resident()
        rng = np.random.default_rng(1)
        slots = np.asarray(await tier.allocate(pages), dtype=np.int64)[rng.permutation(pages)]
        theirs = np.asarray(await other.allocate(pages), dtype=np.int64)[rng.permutation(pages)]
        sides = {
            "device_side": (np.uint64(1 << 44) + rng.permutation(pages).astype(np.uint64) * np.uint64(page), False),
            "host_to_host": (other.slot_addresses(theirs), True),
        }
        out: dict[str, Any] = {}
        for name, (addresses, host_only) in sides.items():
            for direction in ("h2d", "d2h"):

                def call(a: Any = addresses, d: str = direction, h: bool = host_only) -> Any:
                    return _requests.plan_slots(tier, slots, a, d, None, host_only=h)

                ours, base = [], []
                for _ in range(3):  # interleaved: drift lands on both arms
                    ours.append(_per_page_us(call, pages, rounds))
                    with stable_sorts():
                        base.append(_per_page_us(call, pages, rounds))
                mine, theirs_us = median(ours), median(base)
                out[f"{name}_{direction}"] = {
                    "us_per_page": round(mine, 4),
                    "stable_sort_us_per_page": round(theirs_us, 4),
                    "x_faster": round(theirs_us / mine, 2),
                    "meets_goal": bool(mine <= GOAL_US),
                }
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=32768, help="pages per request (default 32768)")
    parser.add_argument("--page-kib", type=int, default=4, help="page and slot size, KiB (default 4)")
    parser.add_argument("--rounds", type=int, default=15, help="timed calls per arm and repeat (default 15)")
    args = parser.parse_args()
    result = asyncio.run(_run(args.pages, args.page_kib << 10, args.rounds))
    report = {"machine": machine(), "pages": args.pages, "page_kib": args.page_kib, "goal_us_per_page": GOAL_US}
    print(json.dumps(report | {"planning": result}, indent=2))


if __name__ == "__main__":
    main()
