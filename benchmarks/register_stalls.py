"""How long a register-backed fill stalls the process's other CUDA calls, per unit and lock.

    python benchmarks/register_stalls.py [--gib 16] [--repeats 2] [--settle 3] [--units-mib 32 64]

``cuMemHostRegister`` pins a unit under a driver lock that every other CUDA call
of the process waits for. This study fills a register-backed tier with the
default ``fill_threads``, per commit unit, in three ways: registrations one at
a time with a short gap after each (the library's default), one at a time with
no gap, and all fill threads registering at once (the lock swapped for a
no-op); and a host-backed tier as the reference with no registration at all.
``--gaps-ms`` sets the gaps tried after each registration (default: the
library's). Meanwhile a thread times ``cuPointerGetAttribute`` every
millisecond (the bench's driver probe), and each registration is timed. For
the probe's worst stall, ``worst_window_*`` say what ran during it: how many
registrations overlapped it and for how long, so a stall made of a chain of
registrations tells itself apart from one that no registration explains.
Arms are interleaved round by round, with a rest before each fill; medians
are printed as JSON. Needs a CUDA device.
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
from aiokvtier.bench._probe import Probe

GiB, MiB = 1 << 30, 1 << 20


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _TimedDriver:
    """The driver module, with ``cuMemHostRegister`` timed."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.durations: list[float] = []
        self.spans: list[tuple[float, float]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def cuMemHostRegister(self, *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return self._real.cuMemHostRegister(*args)
        finally:
            ended = time.perf_counter()
            self.durations.append(ended - started)
            self.spans.append((started, ended))


def worst_window(
    starts: list[float], samples: list[float], spans: list[tuple[float, float]], end: float
) -> dict[str, float]:
    """What overlapped the probe's longest call that began before ``end`` (the fill's): registrations,
    their time inside it, its place in the fill."""
    during = [i for i, t in enumerate(starts) if t < end]
    if not during:
        return {}
    i = max(during, key=samples.__getitem__)
    lo, hi = starts[i], starts[i] + samples[i]
    inside = [(max(a, lo), min(b, hi)) for a, b in spans if a < hi and b > lo]
    return {
        "worst_window_registrations": len(inside),
        "worst_window_registering_ms": round(sum(b - a for a, b in inside) * 1e3, 3),
        "worst_window_at_s": round(lo - starts[0], 3),
    }


async def _fill(size: int, unit: int, backing: str, ctx: PrimaryContext, dptr: int) -> dict[str, float]:
    config = HostTierConfig(quota=size, max_quota=size, device=0, backing=backing, commit_unit=unit)
    timed = _TimedDriver(driver())
    _backings.driver = lambda: timed  # type: ignore[assignment]
    try:
        with Probe(ctx, dptr) as probe:
            started = time.perf_counter()
            async with HostTier(config) as tier:
                await tier.wait_resident()
                wall = time.perf_counter() - started
    finally:
        _backings.driver = driver
    row = {
        "gib_s": size / GiB / wall,
        **probe.report(wall, started),
        **worst_window(probe.starts, probe.samples, timed.spans, started + wall),
    }
    if timed.durations:
        ms = sorted(d * 1e3 for d in timed.durations)
        row |= {"register_p50_ms": ms[len(ms) // 2], "register_max_ms": ms[-1]}
        row["registering_fraction"] = sum(ms) / 1e3 / wall
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--settle", type=float, default=3)
    parser.add_argument("--units-mib", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--gaps-ms", type=float, nargs="+", default=None, help="gaps after each registration")
    parser.add_argument(
        "--ways", nargs="+", default=["gap", "serial", "parallel"], choices=["gap", "serial", "parallel"]
    )
    args = parser.parse_args()
    size = int(args.gib * GiB)
    ctx = PrimaryContext(0)
    ctx.make_current()
    dptr = check("cuMemAlloc", driver().cuMemAlloc(1 << 20))
    serial, gap = _backings._REGISTERING, _backings._REGISTER_GAP_S
    ways: dict[str, tuple[Any, float]] = {}
    if "gap" in args.ways:
        for g in [gap * 1e3] if args.gaps_ms is None else args.gaps_ms:
            ways["serial_gap" if g == gap * 1e3 else f"serial_gap{g:g}ms"] = (serial, g / 1e3)
    if "serial" in args.ways:
        ways["serial"] = (serial, 0.0)
    if "parallel" in args.ways:
        ways["parallel"] = (_NoLock(), 0.0)
    arms = [("host", 64, "host")] + [("register", u, way) for u in args.units_mib for way in ways]
    ways["host"] = (serial, gap)
    name = {arm: "host" if arm[0] == "host" else f"unit_{arm[1]}mib_{arm[2]}" for arm in arms}
    rows: dict[str, list[dict[str, float]]] = {name[arm]: [] for arm in arms}
    try:
        for _ in range(args.repeats):
            for arm in arms:
                backing, unit, way = arm
                _backings._REGISTERING, _backings._REGISTER_GAP_S = ways[way]  # type: ignore[assignment]
                time.sleep(args.settle)
                rows[name[arm]].append(asyncio.run(_fill(size, unit * MiB, backing, ctx, dptr)))
    finally:
        _backings._REGISTERING, _backings._REGISTER_GAP_S = serial, gap
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
