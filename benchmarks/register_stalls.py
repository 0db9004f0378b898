"""How long a register-backed fill stalls the process's other CUDA calls, per unit and lock.

    python benchmarks/register_stalls.py [--gib 16] [--repeats 2] [--settle 3] [--units-mib 16 32 64]

``cuMemHostRegister`` pins a unit under a driver lock that every other CUDA call
of the process waits for. This study fills a register-backed tier with the
default ``fill_threads``, per commit unit, with the library's one-registration-
at-a-time lock and without it (the lock swapped for a no-op), while a thread
times ``cuPointerGetAttribute`` every millisecond (the bench's driver probe).
Arms are interleaved round by round, with a rest before each fill; medians are
printed as JSON. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from aiokvtier import HostTier, HostTierConfig
from aiokvtier._cuda import _backings
from aiokvtier._cuda._driver import PrimaryContext, check, driver
from aiokvtier.bench._common import machine
from aiokvtier.bench._cuda import Probe

GiB, MiB = 1 << 30, 1 << 20


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


async def _fill(size: int, unit: int, ctx: PrimaryContext, dptr: int) -> dict[str, float]:
    config = HostTierConfig(quota=size, max_quota=size, device=0, backing="register", commit_unit=unit)
    with Probe(ctx, dptr) as probe:
        started = time.perf_counter()
        async with HostTier(config) as tier:
            await tier.wait_resident()
            wall = time.perf_counter() - started
    return {"gib_s": size / GiB / wall, **probe.report(wall)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--settle", type=float, default=3)
    parser.add_argument("--units-mib", type=int, nargs="+", default=[16, 32, 64])
    args = parser.parse_args()
    size = int(args.gib * GiB)
    ctx = PrimaryContext(0)
    ctx.make_current()
    dptr = check("cuMemAlloc", driver().cuMemAlloc(1 << 20))
    serial = _backings._REGISTERING
    arms = [(unit, lock) for unit in args.units_mib for lock in ("serial", "parallel")]
    rows: dict[str, list[dict[str, float]]] = {f"unit_{u}mib_{lock}": [] for u, lock in arms}
    try:
        for _ in range(args.repeats):
            for unit, lock in arms:
                _backings._REGISTERING = serial if lock == "serial" else _NoLock()  # type: ignore[assignment]
                time.sleep(args.settle)
                rows[f"unit_{unit}mib_{lock}"].append(asyncio.run(_fill(size, unit * MiB, ctx, dptr)))
    finally:
        _backings._REGISTERING = serial
        driver().cuMemFree(dptr)
        ctx.release()
    result: dict[str, Any] = {
        "machine": machine(),
        "size_gib": args.gib,
        "repeats": args.repeats,
        "probe": "cuPointerGetAttribute every 1 ms on another thread",
        "goal": {"gib_s_at_least": 8.0, "worst_stall_ms_at_most": 20.0},
        "arms": {
            name: {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]}
            | {"worst_stall_ms_max": round(max(r["worst_stall_ms"] for r in runs), 3)}
            for name, runs in rows.items()
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
