"""``python -m aiokvtier.bench {host,cuda,store,ranks}``: print the benchmark's JSON."""

from __future__ import annotations

import argparse
import json
import sys

from ._common import machine


def _cold_options(parser: argparse.ArgumentParser, gib: str, repeats: str) -> None:
    cold = parser.add_argument_group("cold section (a fresh process per sample)")
    cold.add_argument("--cold-gib", type=float, help=f"quota and max_quota of each tier, GiB (default {gib})")
    cold.add_argument("--cold-repeats", type=int, help=f"fresh processes per arm (default {repeats})")
    cold.add_argument("--cold-threads", type=int, nargs="+", default=[1, 4], help="fill_threads values (default 1 4)")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default where its help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def main(argv: list[str] | None = None, prog: str = "python -m aiokvtier.bench") -> None:
    parser = argparse.ArgumentParser(
        prog=prog, description="Benchmark programs: each prints one JSON document.", formatter_class=_Formatter
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    host = sub.add_parser(
        "host", help="progressive host tier vs making memory resident up front", formatter_class=_Formatter
    )
    host.add_argument("--sizes", type=float, nargs="+", default=[4, 8, 16], help="GiB, time to first allocation")
    host.add_argument("--fill-gib", type=float, default=8, help="GiB for fill throughput and loop lag")
    host.add_argument("--ops-gib", type=float, default=4, help="GiB of the tier that slot operations run on")
    host.add_argument("--pairs", type=int, default=1_000_000, help="allocate/free pairs timed per loop")
    host.add_argument(
        "--bookkeeping-gib", type=float, default=16, help="GiB of 64 KiB slots whose bookkeeping is measured"
    )
    host.add_argument("--repeats", type=int, default=3, help="runs per measurement (the median is reported)")
    host.add_argument("--sections", nargs="+", help="run only these parts (default: all but thp_auto)")
    fill = host.add_argument_group("neighbours, fill_scaling and thp_auto sections")
    fill.add_argument("--gib", type=float, default=4, help="GiB each fill makes resident (default 4)")
    fill.add_argument("--settle", type=float, default=0.5, help="seconds of rest after each free (default 0.5)")
    fill.add_argument(
        "--register-units-mib",
        type=float,
        nargs="*",
        default=[64, 128, 256],
        help="commit units to try with the register backing, MiB (GPU only; default 64 128 256)",
    )
    fill.add_argument(
        "--vmm-units-mib",
        type=float,
        nargs="*",
        default=[64, 128],
        help="commit units to try with the vmm backing, MiB (GPU only; default 64 128)",
    )
    fill.add_argument(
        "--fragment-gib",
        type=float,
        help="thp_auto: GiB to fragment (every other 4 KiB page held); default: what the free 2 MiB blocks hold, "
        "at most 16 GiB and what memory allows",
    )
    _cold_options(host, "64", "5")
    cuda = sub.add_parser("cuda", help="CUDA backings and copies (needs a GPU)", formatter_class=_Formatter)
    cuda.add_argument("--quick", action="store_true", help="small sizes, to check the program runs")
    cuda.add_argument("--sections", nargs="+", help="run only these parts (default: all)")
    _cold_options(cuda, "64; 2 with --quick", "5; 1 with --quick")
    full = cuda.add_argument_group("full_tier section")
    full.add_argument(
        "--full-gib", type=float, default=96, help="GiB of the tier made wholly resident (2 with --quick)"
    )
    full.add_argument("--settle", type=float, default=10, help="seconds of rest before each fill (1 with --quick)")
    cuda.add_argument(
        "--cold-prewarm",
        action="store_true",
        help="also run each cold arm with cuda-bindings imported before the clock starts",
    )
    store = sub.add_parser(
        "store", help="the BlockStore: lookups, bookkeeping, copies, hit rates", formatter_class=_Formatter
    )
    store.add_argument("--quick", action="store_true", help="small sizes, to check the program runs")
    store.add_argument("--sections", nargs="+", help="run only these parts (default: all)")
    store.add_argument("--repeats", type=int, help="rounds per copy arm (default 9; 3 with --quick)")
    ranks = sub.add_parser(
        "ranks", help="one rank per GPU filling at once (needs the cuda extra)", formatter_class=_Formatter
    )
    ranks.add_argument("--size-gib", type=float, default=8, help="GiB each rank fills")
    args = parser.parse_args(argv)
    if args.mode == "host":
        from . import _host

        result = _host.run(args)
    elif args.mode == "cuda":
        from ._cuda import run

        result = run(args)
    elif args.mode == "store":
        from . import _store

        result = _store.run(args)
    else:
        from ._cuda import run_ranks

        result = run_ranks(args)
    json.dump({"mode": args.mode, "machine": machine(), **result}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
