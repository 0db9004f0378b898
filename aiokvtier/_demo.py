"""``aiokvtier demo``: open a tier on this machine, show it fill, report what it holds.

The progress shown is the tier's watermark, read every ``interval`` seconds
while the demo waits for full residency; on a terminal it is a rich progress
bar (where rich is installed), elsewhere one plain line per interval, so a
log or a pipe sees the fill too.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from typing import IO, Any, Protocol

from ._config import HostTierConfig
from ._host._tier import HostTier
from ._units import format_bytes, format_rate

__all__ = ["DemoOptions", "run_demo"]


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """What the command line asked for, validated; ``config`` is the tier's."""

    config: HostTierConfig
    requested_quota: str
    """The quota as typed (``"1GB"``), shown beside what the tier holds."""
    interval: float = 1.0
    """Seconds between plain progress lines (a terminal's bar refreshes ten times as often)."""
    hold: float = 0.0
    """Seconds to keep the tier open once resident."""
    bar: bool = True
    """A progress bar where ``out`` is a terminal and rich is installed; plain lines otherwise."""


class _Progress(Protocol):
    def update(self, resident: int, target: int, elapsed: float) -> None: ...
    def close(self, resident: int, target: int, elapsed: float) -> None: ...


def progress_line(resident: int, target: int, elapsed: float) -> str:
    """``fill: 512 MiB of 2.00 GiB (25%), 2.31 GiB/s, 0.2 s``: bytes over time since the open began."""
    percent = 100 * resident // target if target else 100
    rate = resident / elapsed if elapsed > 0 else 0.0
    return (
        f"fill: {format_bytes(resident)} of {format_bytes(target)} ({percent}%), {format_rate(rate)}, {elapsed:.1f} s"
    )


class _Lines:
    def __init__(self, out: IO[str], interval: float) -> None:
        self._out = out
        self._interval = interval
        self._next = interval

    def update(self, resident: int, target: int, elapsed: float) -> None:
        if elapsed >= self._next:
            self._next = elapsed + self._interval
            print(progress_line(resident, target, elapsed), file=self._out, flush=True)

    def close(self, resident: int, target: int, elapsed: float) -> None:
        print(progress_line(resident, target, elapsed), file=self._out, flush=True)


class _Bar:
    def __init__(self, out: IO[str]) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("[bold]filling"),
            BarColumn(),
            TextColumn("{task.fields[amount]}"),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            console=Console(file=out),
        )
        self._progress.start()
        self._task = self._progress.add_task("fill", total=None, amount="", rate="")

    def update(self, resident: int, target: int, elapsed: float) -> None:
        rate = format_rate(resident / elapsed) if elapsed > 0 else ""
        amount = f"{format_bytes(resident)} / {format_bytes(target)}"
        self._progress.update(self._task, completed=resident, total=target, amount=amount, rate=rate)

    def close(self, resident: int, target: int, elapsed: float) -> None:
        self.update(resident, target, elapsed)
        self._progress.stop()


def _progress(options: DemoOptions, out: IO[str]) -> _Progress:
    if options.bar and out.isatty():
        try:
            return _Bar(out)
        except ImportError:
            pass  # rich is the demo extra's; plain lines do without it
    return _Lines(out, options.interval)


async def run_demo(options: DemoOptions, out: IO[str] = sys.stdout) -> dict[str, Any]:
    """Open the tier, take one slot, wait for full residency, and describe the tier.

    :raises AiokvtierError: the tier could not open or fill (its message says why).
    :raises OSError: the range could not be reserved.

    Cancellation (Ctrl-C) closes the tier before it propagates; nothing is
    left running.
    """
    started = time.perf_counter()
    async with HostTier(options.config) as tier:
        slot = await tier.allocate()
        first = time.perf_counter() - started
        target = tier.statistics().target_bytes
        progress = _progress(options, out)
        tick = min(0.1, options.interval)
        # Polled with asyncio.wait, which cancels nothing: a timeout that cancels the task to
        # wake it can meet a Ctrl-C (a cancellation too) and turn it into a TimeoutError.
        resident = asyncio.ensure_future(tier.wait_resident())
        try:
            while not (await asyncio.wait({resident}, timeout=tick))[0]:
                progress.update(tier.statistics().resident_bytes, target, time.perf_counter() - started)
            resident.result()
        finally:
            if not resident.done():
                resident.cancel()
            elif not resident.cancelled():
                resident.exception()  # raised above, or superseded by the cancellation now propagating
            progress.close(tier.statistics().resident_bytes, target, time.perf_counter() - started)
        full = time.perf_counter() - started
        if options.hold > 0:
            print(f"holding the tier open for {options.hold:g} s (Ctrl-C ends it)", file=out, flush=True)
            await asyncio.sleep(options.hold)
        tier.free(slot)
        stats = tier.statistics()
        placement = tier.placement()
        print(repr(tier), file=out)
        print(_summary(options, stats.quota, stats.slots_total, stats.slot_size, stats.resident_bytes), file=out)
        return {
            "quota_requested": options.requested_quota,
            "quota_bytes": stats.quota,
            "slots_total": stats.slots_total,
            "slot_size_bytes": stats.slot_size,
            "commit_unit_bytes": stats.commit_unit,
            "resident_bytes": stats.resident_bytes,
            "max_quota_bytes": stats.max_quota,
            "backing": stats.backing,
            "device": stats.device,
            "fill_threads": stats.fill_threads,
            "transparent_huge_pages": stats.transparent_huge_pages,
            "time_to_first_allocation_ms": round(first * 1e3, 2),
            "time_to_full_residency_s": round(full, 3),
            "fill_gib_per_s": round(stats.resident_bytes / 2**30 / full, 3),
            "numa_node": stats.numa_node,
            "numa_policy": stats.numa_policy,
            "numa_warning": stats.numa_warning,
            "placement": {
                "policy": placement.policy,
                "huge_pages": placement.huge_pages,
                "bytes_per_node": {str(k): v for k, v in placement.bytes_per_node.items()},
            },
        }


def _summary(options: DemoOptions, quota: int, slots: int, slot_size: int, resident: int) -> str:
    """What the tier holds, next to what was asked for (a quota is whole slots; residency whole units)."""
    line = f"quota {format_bytes(quota)} = {slots:,} slots of {format_bytes(slot_size)}"
    if options.requested_quota and options.requested_quota != str(quota):
        line += f" (asked for {options.requested_quota})"
    if resident != quota:
        line += f"; resident {format_bytes(resident)} (the fill commits whole units)"
    return line
