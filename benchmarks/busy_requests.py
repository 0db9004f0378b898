"""Many tasks copying at once: requests made while the engine is busy, planned together, against each alone.

64 tasks each make ``--requests`` awaited requests of 16 shuffled 64 KiB slots into their own
16 pages of a StaticHostMem. Arm ``together``: ``CopyEngine.to_device``, which takes a request
made while copies are queued or in flight at the end of the loop's turn and plans it with the
others made then. Arm ``alone`` (the baseline): the same request through ``CopyEngine.begin``
and its ``done`` future, which checks and plans each request when it is made. Per arm, the loop
thread's CPU time and the wall time per request, medians of ``--rounds`` rounds, the arms
alternating; on asyncio and uvloop; over a ``RecordingBackend`` (nothing copied, the jobs settled
on a completion thread as a GPU's are: what the loop pays, the copy left out) and the host-only
engine (``memmove``, a synchronous backend, whose requests are never deferred: both arms run the
same code there, a control of the noise). Prints JSON::

    python benchmarks/busy_requests.py [--tasks 64] [--requests 20] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import uvloop

from aiokvtier import CopyEngine, HostTier, HostTierConfig, StaticHostMem
from aiokvtier.testing import RecordingBackend

KiB, MiB = 1 << 10, 1 << 20
PAGE, PAGES = 64 * KiB, 16


async def _measure(tasks: int, requests: int, rounds: int, backend: Callable[[], Any] | None) -> dict[str, Any]:
    size = 512 * MiB
    config = HostTierConfig.model_validate({"quota": size, "max_quota": size, "slot_size": PAGE})
    engine_backend = None if backend is None else backend()
    async with (
        HostTier(config) as tier,
        CopyEngine(None, backend=engine_backend) as engine,
        StaticHostMem(tasks * PAGES * PAGE) as buf,
    ):
        await tier.wait_resident()
        slots = np.asarray(await tier.allocate(size // PAGE), dtype=np.int64)
        rng = np.random.default_rng(0)
        # An array over the buffer's memory that exports no view of it (which would keep it mapped).
        raw = (ctypes.c_uint8 * (tasks * PAGES * PAGE)).from_address(buf.address)
        rows = np.frombuffer(raw, dtype=np.uint8).reshape(tasks, PAGES, PAGE)
        picks = [[rng.choice(slots, PAGES, replace=False) for _ in range(requests)] for _ in range(tasks)]

        async def together(k: int) -> None:
            for ids in picks[k]:
                await engine.to_device(tier, ids, rows[k])

        async def alone(k: int) -> None:
            for ids in picks[k]:
                await engine.begin(tier, ids, rows[k], "h2d").done

        arms = {"together": together, "alone": alone}
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
        for r in range(rounds + 1):  # the first round warms up
            names = list(arms) if r % 2 == 0 else list(arms)[::-1]
            for name in names:
                cpu, wall = time.thread_time(), time.perf_counter()
                await asyncio.gather(*(arms[name](k) for k in range(tasks)))
                cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
                if r:
                    samples[name].append((cpu, wall))
    out: dict[str, Any] = {}
    n = tasks * requests
    for name, values in samples.items():
        out[name] = {
            "loop_cpu_us_per_request": round(statistics.median(c for c, _ in values) / n * 1e6, 1),
            "wall_us_per_request": round(statistics.median(w for _, w in values) / n * 1e6, 1),
        }
    for what in ("loop_cpu_us_per_request", "wall_us_per_request"):
        out[f"{what}_together_over_alone"] = round(out["together"][what] / out["alone"][what], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--requests", type=int, default=20, help="requests per task per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    results: dict[str, Any] = {
        "what": __doc__.splitlines()[0],
        "tasks": args.tasks,
        "requests_per_task": args.requests,
        "request": f"{PAGES} shuffled slots of {PAGE // KiB} KiB",
    }
    for backend_name, backend in (("recording", RecordingBackend), ("memmove", None)):
        for loop_name, factory in (("asyncio", None), ("uvloop", uvloop.new_event_loop)):
            with asyncio.Runner(loop_factory=factory) as runner:
                results[f"{backend_name}_{loop_name}"] = runner.run(
                    _measure(args.tasks, args.requests, args.rounds, backend)
                )
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
