"""The loop's CPU cost of planning a per-slot copy, the planner before radix sorting beside today's.

``plan_slots`` (slot checks, addresses, the overlap check, the sort in host
address order, the merge search) for shuffled slots of a filled 64 KiB-slot
tier and a device buffer (any object with ``__cuda_array_interface__``: no
driver is touched), 1k-32k pages of 4, 16 and 64 KiB, both directions. The
two planners run interleaved in one process, ``--repeats`` times each for
``--rounds`` calls; the figures are medians. ``before`` is commit db49479's
planner (``_plan_before.py``); ``x_faster`` its time over today's.

``python benchmarks/plan_cost.py [--rounds 15] [--repeats 5]`` prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from aiokvtier import HostTier, HostTierConfig
from aiokvtier._copy import _requests
from aiokvtier.bench._common import machine, median

try:
    from . import _plan_before as before
except ImportError:  # run as a script
    import _plan_before as before  # type: ignore[no-redef]

KiB, MiB = 1 << 10, 1 << 20
SLOT = 64 * KiB


class DeviceBuffer:
    """What a device tensor of ``n`` pages exposes; the planner reads its pointer, never its memory."""

    def __init__(self, n: int, page: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n, page),
            "typestr": "|u1",
            "data": (1 << 44, False),
            "strides": None,
            "version": 3,
        }


def _seconds(call: Callable[[], Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return median(times)


async def _run(counts: list[int], pages: list[int], rounds: int, repeats: int) -> list[dict[str, Any]]:
    top = max(counts)
    cfg = HostTierConfig(quota=top * SLOT, max_quota=top * SLOT, slot_size=SLOT, commit_unit=64 * MiB)
    out = []
    async with HostTier(cfg) as tier:
        await tier.wait_resident()
        ids = np.asarray(await tier.allocate(top), dtype=np.int64)
        rng = np.random.default_rng(1)
        for n in counts:
            slots = ids[rng.permutation(top)[:n]]
            for page in pages:
                buffer = DeviceBuffer(n, page)
                for direction in ("h2d", "d2h"):
                    arms = {
                        "before": lambda d=direction, b=buffer, p=page, s=slots: before.plan_slots(
                            tier, s, b, d, p, host_only=False
                        ),
                        "now": lambda d=direction, b=buffer, p=page, s=slots: _requests.plan_slots(
                            tier, s, b, d, p, host_only=False
                        ),
                    }
                    old, new = arms["before"](), arms["now"]()
                    assert (old[0].dsts.tolist(), old[0].srcs.tolist(), old[0].sizes.tolist()) == (
                        new[0].dsts.tolist(),
                        new[0].srcs.tolist(),
                        new[0].sizes.tolist(),
                    ), "the planners disagree"
                    times: dict[str, list[float]] = {name: [] for name in arms}
                    for _ in range(repeats):  # interleaved: drift lands on both arms
                        for name, call in arms.items():
                            times[name].append(_seconds(call, rounds))
                    was, now = median(times["before"]), median(times["now"])
                    out.append(
                        {
                            "pages": n,
                            "page_kib": page // KiB,
                            "direction": direction,
                            "before_us": round(was * 1e6, 1),
                            "now_us": round(now * 1e6, 1),
                            "before_ns_per_page": round(was / n * 1e9, 1),
                            "now_ns_per_page": round(now / n * 1e9, 1),
                            "x_faster": round(was / now, 2),
                        }
                    )
        tier.free_many(ids.tolist())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="1024,4096,16384,32768", help="pages per request, comma-separated")
    parser.add_argument("--page-kib", default="4,16,64", help="page sizes in KiB (at most 64), comma-separated")
    parser.add_argument("--rounds", type=int, default=15, help="timed calls per arm and repeat (default 15)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats per arm (default 5)")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    pages = [int(p) * KiB for p in args.page_kib.split(",")]
    result = asyncio.run(_run(counts, pages, args.rounds, args.repeats))
    report = {"machine": machine(), "slot_kib": SLOT // KiB, "rounds": args.rounds, "repeats": args.repeats}
    print(json.dumps(report | {"plan_slots": result}, indent=1))


if __name__ == "__main__":
    main()
