"""The ``aiokvtier`` command: ``demo``, ``doctor`` and ``bench``.

Errors a user can fix print one line and exit 2 (a bad option) or 1 (the
machine refused); Ctrl-C exits 130 without a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from . import _sysinfo
from ._units import format_bytes

__all__ = ["main"]

# Config fields and the options that set them, for naming the option in an error.
_OPTION_OF_FIELD = {
    "quota": "--quota",
    "max_quota": "--max-quota",
    "slot_size": "--slot-size",
    "fill_threads": "--fill-threads",
    "numa_node": "--numa-node",
    "device": "--device",
    "backing": "--backing",
    "transparent_huge_pages": "--thp",
}


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help
        if "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line: ``aiokvtier demo: argument --quota: ...``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def _size(name: str) -> Callable[[str], int]:
    from ._config import _size_bytes

    def parse(text: str) -> int:
        try:
            return _size_bytes(int(text) if text.isdigit() else text, name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{name} ")) from None

    parse.__name__ = "size"
    return parse


def _numa_node(text: str) -> int | str | None:
    if text in ("auto", "none"):
        return None if text == "none" else text
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not a node number, 'auto' or 'none'")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value


def non_negative_seconds(text: str) -> float:
    """An option's seconds, 0 or more (the demo's and the benchmarks' argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more seconds")
    return abs(value)  # -0.0 prints as 0


def _default_quota(available: int) -> int:
    # A quarter of what can be made resident now, in whole GiB, 1 to 8 GiB.
    return max(1 << 30, min(8 << 30, available // 4) >> 30 << 30)


def build_parser(prog: str = "aiokvtier") -> _Parser:
    from . import __version__

    parser = _Parser(
        prog=prog,
        description="aiokvtier: an asyncio-native host-memory tier for LLM KV caches.",
        formatter_class=_Formatter,
        epilog="Run 'COMMAND --help' for each command's options.",
    )
    parser.add_argument("--version", action="version", version=f"aiokvtier {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    demo = sub.add_parser(
        "demo",
        help="open a tier here, show it fill, time the first allocation",
        description=(
            "Open a host tier on this machine, take a slot as soon as the first unit is resident, show the fill,\n"
            "and print what the tier holds as JSON. Sizes are bytes or strings like 512MiB, 4GiB or 1GB."
        ),
        formatter_class=_Formatter,
    )
    demo.add_argument(
        "--quota",
        type=_size("quota"),
        metavar="SIZE",
        help="bytes to make resident, rounded down to whole slots "
        "(default: a quarter of the memory available now, in whole GiB, 1 to 8 GiB)",
    )
    demo.add_argument(
        "--max-quota",
        type=_size("max_quota"),
        metavar="SIZE",
        help="address range to reserve; resizes stay below it (default: host memory, capped by the cgroup limit)",
    )
    demo.add_argument(
        "--slot-size", type=_size("slot_size"), default="2MiB", metavar="SIZE", help="bytes per slot, a page multiple"
    )
    demo.add_argument(
        "--fill-threads", type=int, default=1, metavar="N", help="threads making the range resident (1 to 256)"
    )
    demo.add_argument(
        "--backing",
        choices=["auto", "host", "register", "vmm"],
        default="auto",
        help="host memory only, or GPU-usable through cuMemHostRegister or cuMemCreate; "
        "auto: register with --device, host without",
    )
    demo.add_argument(
        "--device", type=int, metavar="N", help="CUDA ordinal that will copy to and from the tier (cuda extra)"
    )
    demo.add_argument(
        "--numa-node",
        type=_numa_node,
        metavar="NODE",
        default="auto",
        help="node to place pages on: a number, 'none', or 'auto' (the GPU's node with --device)",
    )
    demo.add_argument("--thp", action="store_true", help="opt the range into transparent huge pages")
    demo.add_argument(
        "--force",
        action="store_true",
        help="open a quota larger than the memory available now (the kernel may OOM-kill the process)",
    )
    demo.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio", help="event loop to run on")
    demo.add_argument(
        "--interval",
        type=_positive_float,
        default=1.0,
        metavar="SECONDS",
        help="seconds between progress lines when output is not a terminal",
    )
    demo.add_argument(
        "--hold",
        type=non_negative_seconds,
        default=0.0,
        metavar="SECONDS",
        help="seconds to keep the tier open once it is resident",
    )
    demo.add_argument(
        "--json",
        action="store_true",
        help="print only the JSON report on stdout (progress lines go to stderr)",
    )

    doctor = sub.add_parser(
        "doctor",
        help="check what this host offers a tier (THP, NUMA, mbind, cgroups, CUDA)",
        description=(
            "One line per check: verdict (ok, info, warn, fail, skip), what was found, and advice.\n"
            "Exits 1 only when a check is fatal (no tier can work here)."
        ),
        formatter_class=_Formatter,
    )
    doctor.add_argument("--json", action="store_true", help="print the checks as one JSON document")
    doctor.add_argument("--no-cuda", action="store_true", help="leave the CUDA driver alone")

    sub.add_parser(
        "bench",
        help="benchmark programs printing JSON: bench host | cuda | store | ranks ('bench --help' for more)",
        add_help=False,
    )
    return parser


def _config_error(parser: argparse.ArgumentParser, error: Any) -> NoReturn:
    first = error.errors()[0]
    message = str(first["msg"]).removeprefix("Value error, ")
    loc = first.get("loc") or ()
    leading = re.match(r"[a-z_]+", message)  # a model-wide rule's message starts with the field it is about
    field = str(loc[0]) if loc else leading.group(0) if leading else ""
    option = _OPTION_OF_FIELD.get(field)
    parser.error(f"argument {option}: {message}" if option else message)


def _demo(parser: argparse.ArgumentParser, args: argparse.Namespace, argv_quota: str | None) -> int:
    from pydantic import ValidationError

    from ._config import HostTierConfig, default_max_quota
    from ._demo import DemoOptions, run_demo
    from ._errors import AiokvtierError

    available, bound = _sysinfo.available_memory()
    quota = args.quota
    if quota is None:
        quota = _default_quota(available)
        if args.max_quota is not None:
            quota = min(quota, args.max_quota)  # the default never contradicts an explicit reservation
    if quota > available and not args.force:
        parser.error(
            f"argument --quota: {format_bytes(quota)} is more than this machine can make resident now "
            f"({format_bytes(available)} available: {bound}); the kernel would kill the process part-way, "
            "so it is refused (--force to try anyway)"
        )
    values: dict[str, object] = {
        "quota": quota,
        "slot_size": args.slot_size,
        "fill_threads": args.fill_threads,
        "backing": args.backing,
        "device": args.device,
        "numa_node": args.numa_node,
        "transparent_huge_pages": args.thp,
    }
    if args.max_quota is not None:
        values["max_quota"] = args.max_quota
    elif args.force and quota > default_max_quota():
        values["max_quota"] = quota  # forced past the host's memory: reserve what was asked
    try:
        config = HostTierConfig.model_validate(values)
    except ValidationError as exc:
        _config_error(parser, exc)
    out = sys.stderr if args.json else sys.stdout
    options = DemoOptions(
        config=config, requested_quota=argv_quota or str(quota), interval=args.interval, hold=args.hold
    )
    factory = None
    if args.loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            parser.error("argument --loop: uvloop is not installed (pip install uvloop)")
        factory = uvloop.new_event_loop
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            report = runner.run(run_demo(options, out))
    except (AiokvtierError, OSError) as exc:
        print(f"{parser.prog}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from . import _doctor

    checks = _doctor.run_checks(cuda=not args.no_cuda)
    if args.json:
        print(json.dumps(_doctor.report(checks), indent=2))
    else:
        for check in checks:
            print(_doctor.format_line(check))
    return 1 if any(c.fatal for c in checks) else 0


def _quota_text(argv: Sequence[str]) -> str | None:
    """The quota as typed, for the report (argparse keeps only the parsed number)."""
    for i, arg in enumerate(argv):
        if arg == "--quota" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--quota="):
            return arg.partition("=")[2]
    return None


def main(argv: Sequence[str] | None = None, prog: str = "aiokvtier") -> NoReturn:
    """Run the command line; exits with the command's status (130 after Ctrl-C)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        if args_list[:1] == ["bench"]:
            from .bench.__main__ import main as bench

            bench(args_list[1:], prog=f"{prog} bench")
            sys.exit(0)
        parser = build_parser(prog)
        args = parser.parse_args(args_list)
        if args.command == "doctor":
            sys.exit(_doctor(args))
        demo_parser = _Parser(prog=f"{prog} demo")
        sys.exit(_demo(demo_parser, args, _quota_text(args_list)))
    except KeyboardInterrupt:
        # Ctrl-C is how a user ends the demo or a benchmark: the tier has closed
        # by now (the runner cancelled the task), so exit as a shell expects.
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        sys.exit(130)
