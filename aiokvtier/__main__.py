"""``python -m aiokvtier demo``: open a tier on this machine and watch it fill."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from ._config import HostTierConfig, default_max_quota
from ._host._tier import HostTier


def _default_quota() -> int:
    # A quarter of what this machine (or its cgroup) has, in whole GiB (at least 1), capped at 8 GiB.
    return max(1 << 30, min(8 << 30, default_max_quota() // 4) >> 30 << 30)


async def demo(args: argparse.Namespace) -> dict[str, object]:
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn
    except ImportError:
        sys.exit("the demo's progress bar needs rich: pip install 'aiokvtier[demo]'")
    values: dict[str, object] = {
        "quota": args.quota or _default_quota(),
        "slot_size": args.slot_size,
        "fill_threads": args.fill_threads,
        "device": args.device,
    }
    if args.max_quota:
        values["max_quota"] = args.max_quota
    config = HostTierConfig.model_validate(values)
    started = time.perf_counter()
    async with HostTier(config) as tier:
        await tier.allocate()
        first = time.perf_counter() - started
        with Progress(
            TextColumn("[bold]filling"),
            BarColumn(),
            TextColumn("{task.completed:,.0f}/{task.total:,.0f} MiB"),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            transient=not sys.stdout.isatty(),
        ) as progress:
            target = tier.statistics().target_bytes
            bar = progress.add_task("fill", total=target / 2**20)
            waiter = asyncio.ensure_future(tier.wait_resident())
            while not waiter.done():
                progress.update(bar, completed=tier.statistics().resident_bytes / 2**20)
                await asyncio.wait([waiter], timeout=0.1)
            await waiter
            progress.update(bar, completed=target / 2**20)
        full = time.perf_counter() - started
        stats = tier.statistics()
        placement = tier.placement()
        report: dict[str, object] = {
            "quota_bytes": stats.quota,
            "max_quota_bytes": stats.max_quota,
            "resident_bytes": stats.resident_bytes,
            "backing": stats.backing,
            "fill_threads": stats.fill_threads,
            "time_to_first_allocation_ms": round(first * 1e3, 2),
            "time_to_full_residency_s": round(full, 3),
            "fill_gib_per_s": round(stats.resident_bytes / 2**30 / stats.fill_seconds, 3),
            "numa_node": stats.numa_node,
            "numa_policy": stats.numa_policy,
            "placement": {
                "policy": placement.policy,
                "bytes_per_node": {str(k): v for k, v in placement.bytes_per_node.items()},
            },
        }
        print(repr(tier))
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m aiokvtier", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="open a tier here, show the fill, time the first allocation")
    p.add_argument("--quota", help="bytes to make resident, e.g. 4GiB (default: 1/4 of memory, at most 8 GiB)")
    p.add_argument("--max-quota", help="address range to reserve (default: host memory)")
    p.add_argument("--slot-size", default="2MiB")
    p.add_argument("--fill-threads", type=int, default=1)
    p.add_argument("--device", type=int, default=None, help="CUDA ordinal (needs the cuda extra)")
    args = parser.parse_args(argv)
    report = asyncio.run(demo(args))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
