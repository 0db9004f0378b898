"""``python -m aiokvtier.bench {host,cuda,store,ranks}``: print the benchmark's JSON."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from typing import Any, NoReturn

from .._program import Parser, UsageError, cuda_devices, run, seconds, whole_number

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


_count = whole_number(1)


def _mib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of MiB") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of MiB")
    return value


def _sections_help(default: str, names: list[str] | None = None) -> str:
    listed = "" if names is None else f": {', '.join(names)}"
    return f"run only these parts, in this order{listed} (default: {default}); any other name is refused"


class _ModeParser(Parser):
    """A mode's parser, whose help names the sections ``--sections`` takes: read when the help is
    shown, from the table the mode's program runs (``section_names``), so that a parse imports no
    program and the list cannot drift from what runs.

    :param mode: the mode (``host``, ``cuda``, ...).
    """

    def __init__(self, *args: Any, mode: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mode = mode
        self._sections: str | None = None

    def add_sections(self, default: str) -> None:
        """Add ``--sections``; ``default``: what runs without it, in words."""
        self.add_argument("--sections", nargs="+", help=_sections_help(default))
        self._sections = default

    def format_help(self) -> str:
        if self._sections is not None:
            names = section_names(self._mode)
            for action in self._actions:
                if action.dest == "sections":
                    action.help = _sections_help(self._sections, names)
        return super().format_help()


# Options whose default depends on --quick: (default, with --quick). --quick runs every section at small
# sizes, in seconds; an option given on the command line wins over both.
_HOST_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "sizes": ([4, 8, 16], [0.25]),
    "fill_gib": (8, 0.25),
    "ops_gib": (4, 0.25),
    "pairs": (1_000_000, 10_000),
    "bookkeeping_gib": (16, 0.25),
    "repeats": (3, 1),
    "gib": (4, 0.0625),
    "settle": (0.5, 0),
    "cold_gib": (64, 0.25),
    "cold_repeats": (5, 1),
    "cold_threads": ([1, 4], [1]),
}
_CUDA_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "cold_gib": (64, 2),
    "cold_repeats": (5, 1),
    "cold_threads": ([1, 4], [1, 4]),
    "full_gib": (96, 2),
    "settle": (10, 1),
}
_STORE_DEFAULTS: dict[str, tuple[Any, Any]] = {"repeats": (9, 3)}
_RANKS_DEFAULTS: dict[str, tuple[Any, Any]] = {"size_gib": (8, 1)}


def _directory(text: str) -> str:
    """An existing directory, checked before any section runs (not when the section that writes there does)."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    return text


def _default(table: dict[str, tuple[Any, Any]], name: str) -> str:
    """``(default: 4 8 16; 0.25 with --quick)``: both defaults, as the help shows every default."""

    def show(value: Any) -> str:
        return " ".join(map(str, value)) if isinstance(value, list) else str(value)

    full, quick = table[name]
    if full == quick:
        return f"(default: {show(full)})"
    return f"(default: {show(full)}; {show(quick)} with --quick)"


def _resolve(args: argparse.Namespace, table: dict[str, tuple[Any, Any]]) -> None:
    for name, (full, quick) in table.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)


def _quick(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--quick", action="store_true", help=f"small sizes: {what}")


def _cold_options(parser: argparse.ArgumentParser, table: dict[str, tuple[Any, Any]]) -> None:
    cold = parser.add_argument_group("cold section (a fresh process per sample)")
    cold.add_argument(
        "--cold-gib", type=_gib, help=f"quota and max_quota of each tier, GiB {_default(table, 'cold_gib')}"
    )
    cold.add_argument("--cold-repeats", type=_count, help=f"fresh processes per arm {_default(table, 'cold_repeats')}")
    cold.add_argument(
        "--cold-threads",
        type=whole_number(1, 256),
        nargs="+",
        help=f"fill_threads values {_default(table, 'cold_threads')}",
    )


def build_parser(prog: str) -> Parser:
    parser = Parser(prog=prog, description="Benchmark programs: each prints one JSON document on stdout.")
    sub = parser.add_subparsers(dest="mode", metavar="MODE", parser_class=_ModeParser)
    t = _HOST_DEFAULTS
    host = sub.add_parser(
        "host",
        mode="host",
        help="progressive host tier vs making memory resident up front",
        description="The host tier against making memory resident up front. The defaults take minutes and fill\n"
        "up to 16 GiB at a time; --quick takes seconds. Progress goes to stderr, the JSON to stdout.",
    )
    _quick(host, "every section in seconds, to check the program runs here")
    host.add_argument("--sizes", type=_gib, nargs="+", help=f"GiB, time to first allocation {_default(t, 'sizes')}")
    host.add_argument("--fill-gib", type=_gib, help=f"GiB for fill throughput and loop lag {_default(t, 'fill_gib')}")
    host.add_argument(
        "--ops-gib", type=_gib, help=f"GiB of the tier that slot operations run on {_default(t, 'ops_gib')}"
    )
    host.add_argument("--pairs", type=_count, help=f"allocate/free pairs timed per loop {_default(t, 'pairs')}")
    host.add_argument(
        "--bookkeeping-gib",
        type=_gib,
        help=f"GiB of 64 KiB slots whose bookkeeping is measured {_default(t, 'bookkeeping_gib')}",
    )
    host.add_argument(
        "--repeats", type=_count, help=f"runs per measurement (the median is reported) {_default(t, 'repeats')}"
    )
    host.add_sections("all but thp_auto")
    fill = host.add_argument_group("neighbours, fill_scaling, busy_loop and thp_auto sections")
    fill.add_argument("--gib", type=_gib, help=f"GiB each fill makes resident {_default(t, 'gib')}")
    fill.add_argument("--settle", type=seconds(), help=f"seconds of rest after each free {_default(t, 'settle')}")
    fill.add_argument(
        "--register-units-mib",
        type=_mib,
        nargs="*",
        default=[64, 128, 256],
        help="commit units to try with the register backing, MiB; GPU only",
    )
    fill.add_argument(
        "--vmm-units-mib",
        type=_mib,
        nargs="*",
        default=[64, 128],
        help="commit units to try with the vmm backing, MiB; GPU only",
    )
    fill.add_argument(
        "--fragment-gib",
        type=_gib,
        help="thp_auto: GiB to fragment, every other 4 KiB page held (default: what the free 2 MiB blocks hold, "
        "at most 16 GiB and what memory allows)",
    )
    _cold_options(host, t)
    t = _CUDA_DEFAULTS
    cuda = sub.add_parser(
        "cuda",
        mode="cuda",
        help="CUDA backings and copies (needs a GPU and the cuda extra)",
        description="GPU backings and copies on a CUDA machine. Progress goes to stderr, the JSON to stdout.",
    )
    _quick(cuda, "to check the program runs here")
    cuda.add_sections("all")
    _cold_options(cuda, t)
    full = cuda.add_argument_group("full_tier section")
    full.add_argument("--full-gib", type=_gib, help=f"GiB of the tier made wholly resident {_default(t, 'full_gib')}")
    full.add_argument("--settle", type=seconds(), help=f"seconds of rest before each fill {_default(t, 'settle')}")
    cuda.add_argument(
        "--cold-prewarm",
        action="store_true",
        help="also run each cold arm with cuda-bindings imported before the clock starts",
    )
    store = sub.add_parser(
        "store",
        mode="store",
        help="the BlockStore: lookups, bookkeeping, copies, hit rates",
        description="The BlockStore beside the plain structure or copy it wraps. Progress goes to stderr, "
        "the JSON to stdout.",
    )
    _quick(store, "to check the program runs here")
    store.add_sections("all but shared and prefix (a part of tiers)")
    store.add_argument("--repeats", type=_count, help=f"rounds per copy arm {_default(_STORE_DEFAULTS, 'repeats')}")
    store.add_argument(
        "--disk-path",
        type=_directory,
        metavar="DIR",
        help="where the tiers section writes its files (default: a temporary directory in the current one)",
    )
    ranks = sub.add_parser(
        "ranks",
        mode="ranks",
        help="one rank per GPU filling at once (needs a GPU and the cuda extra)",
        description="One rank per visible GPU, each filling its own GPU's tier. Progress goes to stderr, "
        "the JSON to stdout.",
    )
    _quick(ranks, "to check the program runs here")
    ranks.add_argument("--size-gib", type=_gib, help=f"GiB each rank fills {_default(_RANKS_DEFAULTS, 'size_gib')}")
    return parser


_PROGRAMS = {"host": "._host", "cuda": "._cuda", "store": "._store", "ranks": "._cuda"}
"""The module of each mode: its ``sections(args)`` and ``run(args)`` (``run_ranks`` for ranks)."""
_DEFAULTS = {"host": _HOST_DEFAULTS, "cuda": _CUDA_DEFAULTS, "store": _STORE_DEFAULTS, "ranks": _RANKS_DEFAULTS}


def parse(argv: list[str], prog: str) -> argparse.Namespace:
    """The command line, with each default that depends on ``--quick`` resolved (``mode`` None: no mode).

    :raises UsageError: a bad value or option.
    """
    args = build_parser(prog).parse_args(argv)
    if args.mode is not None:
        _resolve(args, _DEFAULTS[args.mode])
    return args


def section_names(mode: str) -> list[str]:
    """The names ``--sections`` takes for ``mode``, in their order: the keys of its program's
    ``sections(args)`` over the defaults (building that table runs nothing and touches no GPU)."""
    program = importlib.import_module(_PROGRAMS[mode], __package__)
    return list(program.sections(parse([mode], "bench")))


def _needs_cuda(mode: str) -> None:
    """:raises UsageError: no CUDA device can be used here (checked before anything runs)."""
    cuda_devices(f"bench {mode}")


def bench(argv: list[str], prog: str) -> int:
    """Parse, run the mode and print its JSON; the status by the command's convention.

    :raises UsageError: a bad value, an unknown section, or a CUDA mode without a device.
    """
    args = parse(argv, prog)
    if args.mode is None:
        print(build_parser(prog).format_help(), file=sys.stderr, end="")
        return 2
    from ._common import UnknownSections, check_sections, machine

    program = importlib.import_module(_PROGRAMS[args.mode], __package__)
    if args.mode != "ranks":  # ranks has one section and no --sections
        # The names before the device: a misspelt section is refused as one on every machine.
        try:
            check_sections(program.sections(args), args.sections)
        except UnknownSections as exc:
            raise UsageError(f"argument --sections: {exc}") from None
    if args.mode in ("cuda", "ranks"):
        _needs_cuda(args.mode)
    result = program.run_ranks(args) if args.mode == "ranks" else program.run(args)
    json.dump({"mode": args.mode, "machine": machine(), **result}, sys.stdout, indent=2)
    print()
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m aiokvtier.bench") -> NoReturn:
    """``python -m aiokvtier.bench``: exits by the convention of ``aiokvtier._program``."""
    run(lambda: bench(sys.argv[1:] if argv is None else argv, prog), program=argv is None)


if __name__ == "__main__":
    main()
