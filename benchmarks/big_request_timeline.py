"""Where the time of a back-to-back 128 MiB request of small pages goes, on a GPU.

``bench cuda --sections request_latency`` times 128 MiB requests of shuffled
4 and 16 KiB pages awaited one after another at 0.5-0.65 of the link's
ceiling. This study cuts each request at its hand-overs: the loop's checks
and planning (timed alone on the same inputs), the hand-over to the submit
thread, the backend's ``issue`` (the driver calls: ``cuMemcpyBatchAsync`` in
calls of ``max_batch`` descriptors, or the SM kernel's launches), the copy
landing (the completion thread's wait returns), and the loop's resumption.
One engine per method (``auto``, ``dma``, ``sm``), page size and arm: ``whole`` (the request
planned whole on the loop, ``pieces_from=None``) and ``pieces`` (the default: planned and issued
in pieces by the submit thread); medians of the requests.
Prints JSON. A study, not a user's benchmark; it times a subclass of the
CUDA backend (a private module)::

    python benchmarks/big_request_timeline.py [--requests 8]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from typing import Any

import numpy as np

from aiokvtier import CopyEngine, HostTier, HostTierConfig
from aiokvtier._copy._plan import PIECES_FROM
from aiokvtier._copy._requests import plan_slots
from aiokvtier._cuda._backend import CudaBackend
from aiokvtier._cuda._driver import PrimaryContext, check, driver

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


class Timed(CudaBackend):
    """Stamps each job's issue (start, end) on the submit thread and its landing on the completion thread."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stamps: list[dict[str, float]] = []
        self.request = 0
        """Set by the caller before each request: a request in pieces is several issues."""

    def issue(self, plan: Any, direction: str, after: Any) -> Any:
        began = time.perf_counter()
        handle = super().issue(plan, direction, after)
        self.stamps.append(
            {
                "issue_start": began,
                "issue_end": time.perf_counter(),
                "event": int(handle.event),
                "request": self.request,
            }
        )
        return handle

    def per_request(self, key: str, first: bool) -> list[float]:
        """Per request (in order), the earliest (``first``) or latest stamp ``key`` of its issues."""
        by: dict[float, list[float]] = {}
        for stamp in self.stamps:
            by.setdefault(stamp["request"], []).append(stamp[key])
        return [min(v) if first else max(v) for _, v in sorted(by.items())]

    def wait(self, handle: Any) -> None:
        super().wait(handle)
        now = time.perf_counter()
        for stamp in reversed(self.stamps):
            if stamp["event"] == int(handle.event) and "landed" not in stamp:
                stamp["landed"] = now
                break


def _gaps(first: list[float], then: list[float]) -> list[float]:
    return [b - a for a, b in zip(first, then, strict=True)]


def _ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 3)


async def run(requests: int) -> dict[str, Any]:
    drv = driver()
    context = PrimaryContext(0)
    context.make_current()
    dbuf = int(check("cuMemAlloc", drv.cuMemAlloc(128 * MiB)))
    out: dict[str, Any] = {}
    config = HostTierConfig.model_validate({"quota": 8 * GiB, "max_quota": 8 * GiB, "slot_size": 64 * KiB, "device": 0})
    rng = np.random.default_rng(0)
    try:
        async with HostTier(config) as tier:
            await tier.wait_resident()
            slots = np.asarray(await tier.allocate(8 * GiB // (64 * KiB)), dtype=np.int64)
            for method, page, whole in itertools.product(("auto", "dma", "sm"), (4 * KiB, 16 * KiB), (True, False)):
                backend = Timed(0, method=method)
                pieces_from = None if whole else PIECES_FROM
                async with CopyEngine(0, backend=backend, pieces_from=pieces_from) as engine:
                    n = 128 * MiB // page
                    dev = np.uint64(dbuf) + np.arange(n, dtype=np.uint64) * np.uint64(page)
                    picks = [rng.choice(slots, n, replace=False) for _ in range(requests + 1)]
                    await engine.to_device(tier, picks[0], dev, page=page)  # warm
                    plans, calls, returns = [], [], []
                    backend.stamps.clear()
                    before = engine.statistics().bytes_by_method
                    started = time.perf_counter()
                    for i, chosen in enumerate(picks[1:]):
                        backend.request = i + 1
                        calls.append(time.perf_counter())
                        await engine.to_device(tier, chosen, dev, page=page)
                        returns.append(time.perf_counter())
                    elapsed = time.perf_counter() - started
                    after = engine.statistics().bytes_by_method
                    for chosen in picks[1:]:
                        t = time.perf_counter()
                        plan_slots(tier, chosen, dev, "h2d", page, host_only=False)
                        plans.append(time.perf_counter() - t)
                    backend.stamps = [x for x in backend.stamps if x["request"] > 0]
                    issued = backend.per_request("issue_start", first=True)
                    ended = backend.per_request("issue_end", first=False)
                    landed = backend.per_request("landed", first=False)
                    pieces = len(backend.stamps) / requests
                    out[f"{method}_{page // KiB}KiB_{'whole' if whole else 'pieces'}"] = {
                        "gb_s": round(128 * MiB * requests / elapsed / 1e9, 2),
                        "issues_per_request": pieces,
                        "method_bytes": {k: after[k] - before[k] for k in after},
                        "ms": {
                            "request": _ms(_gaps(calls, returns)),
                            "plan_alone": _ms(plans),
                            "call_to_issue": _ms(_gaps(calls, issued)),
                            "issue": _ms(_gaps(issued, ended)),
                            "issue_to_landed": _ms(_gaps(ended, landed)),
                            "landed_to_return": _ms(_gaps(landed, returns)),
                            "between_requests": _ms(_gaps(returns[:-1], calls[1:]) or [0.0]),
                        },
                    }
    finally:
        drv.cuMemFree(dbuf)
        context.release()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.requests)), indent=1))


if __name__ == "__main__":
    main()
