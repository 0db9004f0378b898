"""The ``aiokvtier`` command: ``demo``, ``doctor``, ``pool``, ``bench`` and ``serve``.

It starts and ends by the convention of ``aiokvtier._program``: one line
``aiokvtier: error: ...`` and exit 2 for a usage error (a bad value, or what
this machine cannot do, refused before anything runs), 1 for a failure while
running; Ctrl-C closes the tier and ends the process by SIGINT (130), a closed
stdout ends it by SIGPIPE (141); never a traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ._program import (
    Parser,
    UsageError,
    check_quota_available,
    cuda_devices,
    force_option,
    options_in_advice,
    run,
    run_async,
    seconds,
    whole_number,
)
from ._program import size as _size

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


def _numa_node(text: str) -> int | str | None:
    if text in ("auto", "none"):
        return None if text == "none" else text
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not a node number (0 or more), 'auto' or 'none'")


def _octal_mode(text: str) -> int:
    try:
        value = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal mode such as 600 or 660") from None
    if not 0 <= value <= 0o777:
        raise argparse.ArgumentTypeError(f"{text!r} is not permission bits (0 to 777)")
    return value


def _host_port(text: str) -> str:
    """``HOST:PORT`` (an IPv6 host in brackets), as ``MooncakeTierConfig.master`` takes it."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:50051)")
    return text


def _default_quota(available: int) -> int:
    # A quarter of what can be made resident now, in whole GiB, 1 to 8 GiB.
    return max(1 << 30, min(8 << 30, available // 4) >> 30 << 30)


def build_parser(prog: str = "aiokvtier") -> Parser:
    from . import __version__

    parser = Parser(
        prog=prog,
        description="aiokvtier: an asyncio-native host-memory tier for LLM KV caches.",
        epilog="Run 'COMMAND --help' for each command's options. Exit status: 0 done, 1 failed while running, "
        "2 usage error, 130 Ctrl-C, 141 stdout closed.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"aiokvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    demo = sub.add_parser(
        "demo",
        help="open a tier here, show it fill, time the first allocation",
        description=(
            "Open a host tier on this machine, take a slot as soon as the first unit is resident, show the fill,\n"
            "and print what the tier holds as JSON. Sizes are bytes or strings like 512MiB, 4GiB or 1GB."
        ),
    )
    demo.add_argument(
        "--quota",
        type=_size("quota"),
        metavar="SIZE",
        help="bytes to make resident, rounded down to whole slots "
        "(default: a quarter of the memory available now, in whole GiB, 1 to 8 GiB; 256MiB with --quick)",
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
        "--fill-threads",
        type=whole_number(1, 256),
        default=1,
        metavar="N",
        help="threads making the range resident, 1 to 256",
    )
    demo.add_argument(
        "--backing",
        choices=["auto", "host", "register", "vmm"],
        default="auto",
        help="host memory only, or GPU-usable through cuMemHostRegister or cuMemCreate; "
        "auto: register with --device, host without",
    )
    demo.add_argument(
        "--device",
        type=whole_number(0),
        metavar="N",
        help="CUDA ordinal that will copy to and from the tier (cuda extra; checked before the tier opens)",
    )
    demo.add_argument(
        "--numa-node",
        type=_numa_node,
        metavar="NODE",
        default="auto",
        help="node to place pages on: a number, 'none', or 'auto' (the GPU's node with --device)",
    )
    demo.add_argument("--thp", action="store_true", help="opt the range into transparent huge pages")
    force_option(demo)
    demo.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio", help="event loop to run on")
    demo.add_argument(
        "--interval",
        type=seconds(positive=True),
        default=1.0,
        metavar="SECONDS",
        help="seconds between progress lines when output is not a terminal",
    )
    demo.add_argument(
        "--hold",
        type=seconds(),
        default=0.0,
        metavar="SECONDS",
        help="seconds to keep the tier open once it is resident",
    )
    demo.add_argument(
        "--json",
        action="store_true",
        help="print only the JSON report on stdout (progress lines go to stderr)",
    )
    demo.add_argument("--quick", action="store_true", help="a 256MiB tier, resident in a moment (a --quota given wins)")

    doctor = sub.add_parser(
        "doctor",
        help="check what this host offers a tier (THP, NUMA, mbind, cgroups, CUDA)",
        description=(
            "One line per check: verdict (ok, info, warn, fail, skip), what was found, and advice.\n"
            "Exits 1 only when a check is fatal (no tier can work here)."
        ),
    )
    doctor.add_argument("--json", action="store_true", help="print the checks as one JSON document")
    doctor.add_argument("--no-cuda", action="store_true", help="leave the CUDA driver alone")
    doctor.add_argument(
        "--disk-path", type=Path, metavar="DIR", help="also check a disk tier's directory (O_DIRECT, free space)"
    )
    doctor.add_argument(
        "--mooncake-master",
        type=_host_port,
        metavar="HOST:PORT",
        help="also check that a Mooncake master answers there",
    )

    pool = sub.add_parser(
        "pool",
        help="own a tier that every process of this machine can attach to, served on a Unix socket",
        description=(
            "Reserve a host tier over shared memory, fill it, and serve it on a Unix socket until SIGTERM\n"
            "(exit 0) or Ctrl-C. Processes attach with aiokvtier.AttachedPool(PATH). Prints one JSON line\n"
            "once the socket is served and one when it stops."
        ),
    )
    pool.add_argument(
        "--socket",
        metavar="PATH",
        help="where to serve (default: $AIOKVTIER_POOL, else $XDG_RUNTIME_DIR/aiokvtier-pool.sock, "
        "else /tmp/aiokvtier-pool-UID.sock)",
    )
    pool.add_argument("--mode", type=_octal_mode, default="600", metavar="OCTAL", help="the socket's permission bits")
    pool.add_argument("--quota", type=_size("quota"), required=True, metavar="SIZE", help="bytes to make resident")
    pool.add_argument(
        "--max-quota",
        type=_size("max_quota"),
        metavar="SIZE",
        help="address range to reserve; resizes stay below it (default: host memory, capped by the cgroup limit)",
    )
    pool.add_argument("--slot-size", type=_size("slot_size"), default="64KiB", metavar="SIZE", help="bytes per slot")
    pool.add_argument(
        "--fill-threads",
        type=whole_number(1, 256),
        metavar="N",
        help="threads making the range resident, 1 to 256 (default: one per CPU this process may use, at most 8)",
    )
    pool.add_argument(
        "--numa-node", type=_numa_node, metavar="NODE", default="none", help="node to place pages on, or 'none'"
    )
    pool.add_argument("--thp", action="store_true", help="opt the range into transparent huge pages")
    force_option(pool)
    pool.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio", help="event loop to run on")

    sub.add_parser(
        "bench",
        help="benchmark programs printing JSON: bench host | cuda | store | ranks ('bench --help' for more)",
        add_help=False,
    )
    sub.add_parser(
        "serve",
        help="the HTTP block server over a tier ('serve --help' for more; needs the server extra)",
        add_help=False,
    )
    return parser


def _config_error(error: Any) -> NoReturn:
    """:raises UsageError: the config's first complaint, naming the option and the rule in our words."""
    first = error.errors()[0]
    ctx = first.get("ctx") or {}
    rules = {
        "greater_than_equal": "must be {ge} or more",
        "less_than_equal": "must be {le} or less",
        "greater_than": "must be more than {gt}",
        "less_than": "must be less than {lt}",
    }
    if first["type"] in rules:  # a bound pydantic checked: its wording is pydantic's, say it in ours
        message = f"{first.get('input')!r} {rules[first['type']].format(**ctx)}"
    else:
        message = str(first["msg"]).removeprefix("Value error, ")
    loc = first.get("loc") or ()
    leading = re.match(r"[a-z_]+", message)  # a model-wide rule's message starts with the field it is about
    field = str(loc[0]) if loc else leading.group(0) if leading else ""
    option = _OPTION_OF_FIELD.get(field)
    message = options_in_advice(message, _OPTION_OF_FIELD)
    raise UsageError(f"argument {option}: {message}" if option else message)


def _check_device(device: int) -> None:
    """:raises UsageError: this machine has no CUDA device ``device`` (found before the tier opens)."""
    count = cuda_devices("argument --device")
    if device >= count:
        raise UsageError(f"argument --device: there is no CUDA device {device} ({count} visible)")


_QUICK_QUOTA = 256 << 20


def _demo(args: argparse.Namespace, argv_quota: str | None) -> int:
    from pydantic import ValidationError

    from . import _sysinfo
    from ._config import HostTierConfig, default_max_quota
    from ._demo import DemoOptions, run_demo

    quota = args.quota
    if quota is None:
        quota = _QUICK_QUOTA if args.quick else _default_quota(_sysinfo.available_memory()[0])
        if args.max_quota is not None:
            quota = min(quota, args.max_quota)  # the default never contradicts an explicit reservation
        argv_quota = argv_quota or ("256MiB" if quota == _QUICK_QUOTA else None)
    check_quota_available(quota, force=args.force)
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
        _config_error(exc)
    factory = None
    if args.loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            raise UsageError("argument --loop: uvloop is not installed (pip install uvloop)") from None
        factory = uvloop.new_event_loop
    if config.device is not None:
        _check_device(config.device)
    out = sys.stderr if args.json else sys.stdout
    options = DemoOptions(
        config=config, requested_quota=argv_quota or str(quota), interval=args.interval, hold=args.hold
    )
    report = run_async(run_demo(options, out), loop_factory=factory)
    print(json.dumps(report, indent=2))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from . import _doctor

    checks = _doctor.run_checks(cuda=not args.no_cuda, disk_path=args.disk_path, mooncake_master=args.mooncake_master)
    if args.json:
        print(json.dumps(_doctor.report(checks), indent=2))
    else:
        for check in checks:
            print(_doctor.format_line(check))
    return 1 if any(c.fatal for c in checks) else 0


def _loop_factory(loop: str) -> Callable[[], Any] | None:
    if loop != "uvloop":
        return None
    try:
        import uvloop
    except ImportError:
        raise UsageError("argument --loop: uvloop is not installed (pip install uvloop)") from None
    factory: Callable[[], Any] = uvloop.new_event_loop
    return factory


def _pool(args: argparse.Namespace) -> int:
    import os

    from pydantic import ValidationError

    from ._config import HostTierConfig
    from ._pool._command import default_socket, serve_pool

    values: dict[str, object] = {
        "quota": args.quota,
        "slot_size": args.slot_size,
        "numa_node": args.numa_node,
        "transparent_huge_pages": args.thp,
        "backing": "host",
    }
    if args.max_quota is not None:
        values["max_quota"] = args.max_quota
    if args.fill_threads is not None:
        values["fill_threads"] = args.fill_threads
    try:
        config = HostTierConfig.model_validate(values)
    except ValidationError as exc:
        _config_error(exc)
    check_quota_available(int(config.quota), force=args.force)
    path = args.socket or default_socket()
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"argument --socket: the directory {directory} does not exist")
    run_async(serve_pool(config, path, args.mode), loop_factory=_loop_factory(args.loop))
    return 0


def _quota_text(argv: Sequence[str]) -> str | None:
    """The quota as typed, for the report (argparse keeps only the parsed number)."""
    for i, arg in enumerate(argv):
        if arg == "--quota" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--quota="):
            return arg.partition("=")[2]
    return None


def _command(argv: list[str], prog: str) -> int:
    if argv[:1] == ["bench"]:
        from .bench.__main__ import bench

        return bench(argv[1:], prog=f"{prog} bench")
    if argv[:1] == ["serve"]:
        from .server import main as serve

        status = serve(argv[1:], prog=f"{prog} serve")
        if status == 130:  # its shutdown after Ctrl-C is done: end by SIGINT, as every command does
            raise KeyboardInterrupt
        return status
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.command is None:  # the bare command: what it offers, as a usage error
        print(parser.format_help(), file=sys.stderr, end="")
        return 2
    if args.command == "doctor":
        return _doctor(args)
    if args.command == "pool":
        return _pool(args)
    return _demo(args, _quota_text(argv))


def main(argv: Sequence[str] | None = None, prog: str = "aiokvtier") -> NoReturn:
    """Run the command line and exit by the convention of ``aiokvtier._program``.

    :param argv: the arguments (None: ``sys.argv[1:]``, this process's own
        command line: Ctrl-C then stays "end at once" until the process ends).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    run(lambda: _command(args, prog), program=argv is None)
