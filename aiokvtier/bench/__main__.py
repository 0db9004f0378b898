"""``python -m aiokvtier.bench {host,cuda,store,ranks}``: print the benchmark's JSON."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from typing import NoReturn

from .._cli import non_negative_seconds as _seconds
from ._common import UnknownSections, machine

_GIB_STEP = 2 / 1024
"""GiB options are whole 2 MiB: the largest slot a program uses, and a multiple of the page that mmap wants."""


def _gib(text: str) -> float:
    """GiB, at least 2 MiB, rounded down to whole 2 MiB."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not math.isfinite(value) or value < _GIB_STEP:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size of at least 2 MiB ({_GIB_STEP} GiB)")
    return math.floor(value / _GIB_STEP) * _GIB_STEP


def _int_from(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            bounds = f"{low} to {high}" if high is not None else f"{low} or more"
            raise argparse.ArgumentTypeError(f"{text!r} is not {bounds}")
        return value

    parse.__name__ = "count"
    return parse


_count = _int_from(1)


def _mib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of MiB") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of MiB")
    return value


class _Parser(argparse.ArgumentParser):
    """Errors in one line naming the option, exit 2 (as ``aiokvtier demo``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


_SECTIONS_HELP = "run only these parts, in this order (default: {}); an unknown name is refused with the list"


def _cold_options(parser: argparse.ArgumentParser, gib: str, repeats: str) -> None:
    cold = parser.add_argument_group("cold section (a fresh process per sample)")
    cold.add_argument("--cold-gib", type=_gib, help=f"quota and max_quota of each tier, GiB (default {gib})")
    cold.add_argument("--cold-repeats", type=_count, help=f"fresh processes per arm (default {repeats})")
    cold.add_argument(
        "--cold-threads", type=_int_from(1, 256), nargs="+", default=[1, 4], help="fill_threads values (default 1 4)"
    )


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default where its help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def main(argv: list[str] | None = None, prog: str = "python -m aiokvtier.bench") -> None:
    parser = _Parser(
        prog=prog, description="Benchmark programs: each prints one JSON document.", formatter_class=_Formatter
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    host = sub.add_parser(
        "host", help="progressive host tier vs making memory resident up front", formatter_class=_Formatter
    )
    host.add_argument("--sizes", type=_gib, nargs="+", default=[4, 8, 16], help="GiB, time to first allocation")
    host.add_argument("--fill-gib", type=_gib, default=8, help="GiB for fill throughput and loop lag")
    host.add_argument("--ops-gib", type=_gib, default=4, help="GiB of the tier that slot operations run on")
    host.add_argument("--pairs", type=_count, default=1_000_000, help="allocate/free pairs timed per loop")
    host.add_argument(
        "--bookkeeping-gib", type=_gib, default=16, help="GiB of 64 KiB slots whose bookkeeping is measured"
    )
    host.add_argument("--repeats", type=_count, default=3, help="runs per measurement (the median is reported)")
    host.add_argument("--sections", nargs="+", help=_SECTIONS_HELP.format("all but thp_auto"))
    fill = host.add_argument_group("neighbours, fill_scaling and thp_auto sections")
    fill.add_argument("--gib", type=_gib, default=4, help="GiB each fill makes resident (default 4)")
    fill.add_argument("--settle", type=_seconds, default=0.5, help="seconds of rest after each free (default 0.5)")
    fill.add_argument(
        "--register-units-mib",
        type=_mib,
        nargs="*",
        default=[64, 128, 256],
        help="commit units to try with the register backing, MiB (GPU only; default 64 128 256)",
    )
    fill.add_argument(
        "--vmm-units-mib",
        type=_mib,
        nargs="*",
        default=[64, 128],
        help="commit units to try with the vmm backing, MiB (GPU only; default 64 128)",
    )
    fill.add_argument(
        "--fragment-gib",
        type=_gib,
        help="thp_auto: GiB to fragment (every other 4 KiB page held); default: what the free 2 MiB blocks hold, "
        "at most 16 GiB and what memory allows",
    )
    _cold_options(host, "64", "5")
    cuda = sub.add_parser("cuda", help="CUDA backings and copies (needs a GPU)", formatter_class=_Formatter)
    cuda.add_argument("--quick", action="store_true", help="small sizes, to check the program runs")
    cuda.add_argument("--sections", nargs="+", help=_SECTIONS_HELP.format("all"))
    _cold_options(cuda, "64; 2 with --quick", "5; 1 with --quick")
    full = cuda.add_argument_group("full_tier section")
    full.add_argument("--full-gib", type=_gib, default=96, help="GiB of the tier made wholly resident (2 with --quick)")
    full.add_argument("--settle", type=_seconds, default=10, help="seconds of rest before each fill (1 with --quick)")
    cuda.add_argument(
        "--cold-prewarm",
        action="store_true",
        help="also run each cold arm with cuda-bindings imported before the clock starts",
    )
    store = sub.add_parser(
        "store", help="the BlockStore: lookups, bookkeeping, copies, hit rates", formatter_class=_Formatter
    )
    store.add_argument("--quick", action="store_true", help="small sizes, to check the program runs")
    store.add_argument("--sections", nargs="+", help=_SECTIONS_HELP.format("all"))
    store.add_argument("--repeats", type=_count, help="rounds per copy arm (default 9; 3 with --quick)")
    ranks = sub.add_parser(
        "ranks", help="one rank per GPU filling at once (needs the cuda extra)", formatter_class=_Formatter
    )
    ranks.add_argument("--size-gib", type=_gib, default=8, help="GiB each rank fills")
    args = parser.parse_args(argv)
    try:
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
    except UnknownSections as error:
        {"host": host, "cuda": cuda, "store": store}[args.mode].error(f"argument --sections: {error}")
    json.dump({"mode": args.mode, "machine": machine(), **result}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
