"""Shared pieces of the benchmark programs."""

from __future__ import annotations

import asyncio
import platform
import statistics
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from .._host import _linux
from .._progress import Steps

GiB = 1 << 30
MiB = 1 << 20


def percentile(samples: list[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary_ms(samples: list[float]) -> dict[str, float]:
    """p50/p99/max of samples in seconds, reported in milliseconds."""
    return {
        "n": len(samples),
        "p50_ms": round(percentile(samples, 50) * 1e3, 4),
        "p99_ms": round(percentile(samples, 99) * 1e3, 4),
        "max_ms": round(max(samples) * 1e3, 4) if samples else float("nan"),
    }


def median(values: list[float]) -> float:
    return statistics.median(values)


async def record_fill(config: Any, period: float = 0.002) -> dict[str, Any]:
    """Bytes usable against time for one tier, from the call to ``HostTier.open`` to full residency.

    The loop reads ``statistics().resident_bytes`` every ``period`` seconds and
    keeps a point where it changed (a step per commit unit), so the series is
    what a caller of the tier saw, not a line drawn from a rate. Also times the
    first allocation, taken as soon as open returns.
    """
    from .._host._tier import HostTier

    started = time.perf_counter()
    tier = await HostTier.open(config)
    try:
        slot = await tier.allocate()
        first = time.perf_counter() - started
        tier.free(slot)
        times, resident = [0.0], [0]
        while True:
            s = tier.statistics()
            now = time.perf_counter() - started
            if s.resident_bytes != resident[-1]:
                times.append(now)
                resident.append(s.resident_bytes)
            if s.resident_bytes >= s.target_bytes or s.fill_error is not None:
                break
            await asyncio.sleep(period)
        if s.fill_error is not None:
            raise RuntimeError(f"the fill failed: {s.fill_error}")
    finally:
        await tier.aclose()
    return {
        "first_allocation_ms": round(first * 1e3, 2),
        "full_s": round(times[-1], 4),
        "t_s": [round(t, 4) for t in times],
        "resident_gib": [round(r / GiB, 4) for r in resident],
    }


def bare_populate(size: int, chunk: int = 512 * MiB) -> float:
    """The baseline: reserve, then MADV_POPULATE_WRITE chunk by chunk on this thread. Returns seconds."""
    base, length = _linux.mmap_reserve(size, 2 * MiB)
    try:
        _linux.madvise(base, length, _linux.MADV_NOHUGEPAGE)
        started = time.perf_counter()
        for offset in range(0, size, chunk):
            n = min(chunk, size - offset)
            _linux.mprotect(base + offset, n, writable=True)
            _linux.populate(base + offset, n)
        return time.perf_counter() - started
    finally:
        _linux.munmap(base, length)


def loop_factories() -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
    try:
        import uvloop

        factories["uvloop"] = uvloop.new_event_loop
    except ImportError:
        pass
    return factories


def run_on(factory: Callable[[], asyncio.AbstractEventLoop], coro: Coroutine[Any, Any, Any]) -> Any:
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


async def sample_loop_lag(stop: asyncio.Future[Any] | asyncio.Task[Any], period: float = 0.001) -> list[float]:
    """Overshoot of ``asyncio.sleep(period)`` until ``stop`` is done."""
    lags: list[float] = []
    while not stop.done():
        started = time.perf_counter()
        await asyncio.sleep(period)
        lags.append(time.perf_counter() - started - period)
    return lags


class UnknownSections(ValueError):
    """``--sections`` named a part the program does not have (raised before any part runs)."""


def check_sections(sections: Iterable[str], chosen: list[str] | None) -> None:
    """Check the names ``--sections`` gave against a program's sections.

    Called before the program looks for what it needs (a GPU), so that a
    misspelt name is refused as one on every machine.

    :raises UnknownSections: a name is not a section.
    """
    known = list(sections)
    unknown = set(chosen or ()) - set(known)
    if unknown:
        raise UnknownSections(f"unknown sections {sorted(unknown)}; choose from {', '.join(known)}")


def run_sections(
    sections: dict[str, Callable[[], Any]],
    chosen: list[str] | None,
    *,
    title: str,
    costs: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Run the chosen sections (default: all) in the order given, showing progress on stderr.

    :param title: what the progress lines start with (``"bench host"``).
    :param costs: each section's expected seconds, for the estimate of the time left.
    :raises UnknownSections: a name is not a section; nothing has run.
    """
    names = chosen or list(sections)
    check_sections(sections, names)
    results: dict[str, Any] = {}
    with Steps(title, names, costs=costs) as steps:
        for name in names:
            steps.begin(name)
            results[name] = sections[name]()
    return results


def machine() -> dict[str, Any]:
    import os

    from .._sysinfo import host_memory_bytes

    return {
        "python": platform.python_version(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "memory_gib": round(host_memory_bytes() / GiB, 1),
    }
