"""The server's command line: options, their defaults, and the tier config they make.

Needs none of the ``server`` extra, so that ``--help`` and a bad option
answer on a base install too.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from collections.abc import Sequence
from typing import Any, NoReturn

from pydantic import ValidationError

from .._config import HostTierConfig, MooncakeTierConfig
from .._program import Formatter, UsageError, check_quota_available, force_option, seconds, size, whole_number

__all__ = ["build_parser", "parse"]

DESCRIPTION = "A KV block service over a BlockStore, on Starlette and uvicorn."


class Parser(argparse.ArgumentParser):
    """Errors are one line: ``aiokvtier-server: error: argument --quota: ...`` (the command as it was
    named: ``aiokvtier serve``, ``python -m aiokvtier.server``), exit 2, in the words of the ``aiokvtier``
    command's (the option types of ``aiokvtier._program``); an argument that starts with ``-`` and a
    digit is a value (``--quota -1GiB`` is refused as a size, not as "expected one argument")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


OPTION_OF_FIELD = {"quota": "--quota", "max_quota": "--max-quota", "slot_size": "--slot-size"}
OPTION_OF_FIELD |= {"device": "--device", "backing": "--backing"}


def build_parser(prog: str = "aiokvtier-server") -> Parser:
    parser = Parser(prog=prog, description=DESCRIPTION, formatter_class=Formatter)
    parser.add_argument(
        "--quota", type=size("quota"), default="1GiB", metavar="SIZE", help="bytes of the tier, like 2GiB"
    )
    parser.add_argument(
        "--max-quota",
        type=size("max_quota"),
        default=None,
        metavar="SIZE",
        help="bytes of address range reserved (default: the quota)",
    )
    parser.add_argument(
        "--slot-size", type=size("slot_size"), default="64KiB", metavar="SIZE", help="bytes per slot: the largest block"
    )
    parser.add_argument(
        "--backing",
        choices=["host", "register", "vmm", "auto"],
        default="host",
        help="host memory only, or GPU-usable (register, vmm: need --device); auto: register with --device",
    )
    parser.add_argument(
        "--device",
        type=whole_number(0),
        default=None,
        metavar="N",
        help="CUDA ordinal of the GPU the tier serves (default: none)",
    )
    force_option(parser)
    parser.add_argument("--policy", choices=["lru", "s3fifo"], default="lru", help="the store's eviction policy")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--port",
        type=whole_number(0, 65535),
        default=8077,
        metavar="N",
        help="port to listen on; 0: any free port (printed)",
    )
    parser.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug"],
        default="warning",
        help="uvicorn's and the library's log level",
    )
    parser.add_argument("--plain-dict", action="store_true", help="serve from a dict of bytes (the baseline)")
    parser.add_argument(
        "--drain-seconds",
        type=seconds(most=3600),
        default=0.0,
        metavar="SECONDS",
        help="after SIGTERM or SIGINT, serve on this long with readyz 503",
    )
    parser.add_argument(
        "--grace-seconds",
        type=seconds(most=3600),
        default=10.0,
        metavar="SECONDS",
        help="then, wait this long for the requests in flight before answering them 503 and closing every connection",
    )
    parser.add_argument(
        "--body-timeout",
        type=seconds(most=3600),
        default=30.0,
        metavar="SECONDS",
        help="a request's body must arrive within this long of its headers, else 408 and nothing stored; 0: no limit",
    )
    parser.add_argument(
        "--keep-alive",
        type=whole_number(1, 3600),
        default=75,
        metavar="SECONDS",
        help="an idle connection is closed after this long: longer than clients keep theirs idle (httpx 5 s, "
        "aiohttp 15 s), so that none sends a request on a connection the server is closing",
    )
    parser.add_argument(
        "--workers",
        type=whole_number(1, 256),
        default=1,
        metavar="N",
        help="server processes over one pool (host backing): a block PUT through one is a GET hit through all",
    )
    parser.add_argument(
        "--disk-path",
        metavar="DIR",
        help="a disk tier below the host tier, in this existing directory (blocks hit twice are written there)",
    )
    parser.add_argument(
        "--disk-quota",
        type=size("quota"),
        default="64GiB",
        metavar="SIZE",
        help="bytes of the disk tier (with --disk-path)",
    )
    parser.add_argument(
        "--mooncake-master",
        metavar="HOST:PORT",
        help="a Mooncake Store tier below the host (and disk) tier, through this mooncake_master "
        "(blocks hit twice are written there; docs/mooncake.md)",
    )
    parser.add_argument(
        "--mooncake-metadata-server",
        metavar="URL",
        help="the cluster's metadata server (default: http://HOST:8080/metadata, the master's own)",
    )
    parser.add_argument(
        "--mooncake-local-hostname",
        metavar="HOST",
        help="where other Mooncake clients reach this one (default: the address this host reaches the master from)",
    )
    parser.add_argument(
        "--mooncake-segment-size",
        type=size("segment_size"),
        metavar="SIZE",
        help="host memory this server gives the cluster's pool (with --mooncake-master; default 1GiB)",
    )
    # A worker of --workers: the pool to attach to and the listening socket it inherits.
    parser.add_argument("--attach", metavar="PATH", help=argparse.SUPPRESS)
    parser.add_argument("--listen-fd", type=int, metavar="FD", help=argparse.SUPPRESS)
    return parser


def mooncake_config(parser: Parser, args: argparse.Namespace) -> MooncakeTierConfig:
    """The Mooncake tier ``--mooncake-*`` describe.

    :raises SystemExit: 2 after one line naming the option at fault.
    """
    if args.workers > 1 or args.plain_dict:
        parser.error(
            "argument --mooncake-master: a Mooncake tier goes under one process's store (no --workers, no --plain-dict)"
        )
    host, _, port = str(args.mooncake_master).rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"argument --mooncake-master: {args.mooncake_master!r} is not HOST:PORT")
    values = {
        "master": args.mooncake_master,
        "metadata_server": args.mooncake_metadata_server or f"http://{host}:8080/metadata",
        "local_hostname": args.mooncake_local_hostname or _address_towards(host.strip("[]"), int(port)),
        "segment_size": 1 << 30 if args.mooncake_segment_size is None else args.mooncake_segment_size,
    }
    try:
        return MooncakeTierConfig(**values)
    except ValidationError as error:
        first = error.errors()[0]
        field = str(first["loc"][0]).replace("_", "-") if first["loc"] else "master"
        parser.error(f"argument --mooncake-{field}: {first['msg'].removeprefix('Value error, ')}")


def _address_towards(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (a UDP socket's connect sends nothing)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return str(probe.getsockname()[0])
    except OSError:  # no route (yet): let the tier's open say what is wrong
        return socket.gethostname()


def _check_device(parser: Parser, device: int) -> None:
    """Refuse, before anything opens, a ``--device`` this machine cannot use (as ``aiokvtier demo`` does)."""
    from .._program import cuda_devices

    try:
        count = cuda_devices("argument --device")
    except UsageError as exc:
        parser.error(str(exc))
    if not 0 <= device < count:
        parser.error(f"argument --device: there is no CUDA device {device} ({count} visible)")


def parse(argv: Sequence[str] | None, prog: str = "aiokvtier-server") -> tuple[argparse.Namespace, HostTierConfig]:
    """The options and the tier's config.

    :raises SystemExit: 2 after one line naming the option at fault, 0 after ``--help``.
    """
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.workers > 1 and args.plain_dict:
        parser.error("argument --workers: several workers share a pool; --plain-dict keeps blocks in one process")
    if args.workers > 1 and (args.device is not None or args.backing not in ("host", "auto")):
        parser.error("argument --workers: a pool shares host memory only (--backing host, no --device)")
    if args.policy != "lru" and (args.workers > 1 or args.plain_dict):
        # Each keeps its own order (a pool: LRU with a second chance; the dict: oldest first): say so, not ignore it.
        parser.error(
            f"argument --policy: {args.policy} is a policy of one process's store "
            "(a --workers pool evicts least recently used blocks, --plain-dict its oldest)"
        )
    if args.disk_path is not None and (args.workers > 1 or args.plain_dict):
        parser.error("argument --disk-path: a disk tier goes under one process's store (no --workers, no --plain-dict)")
    if args.disk_path is not None and not os.path.isdir(args.disk_path):
        parser.error(f"argument --disk-path: {args.disk_path} is not a directory")
    if args.mooncake_master is None:
        given = [
            flag
            for flag, value in (
                ("--mooncake-metadata-server", args.mooncake_metadata_server),
                ("--mooncake-local-hostname", args.mooncake_local_hostname),
                ("--mooncake-segment-size", args.mooncake_segment_size),
            )
            if value is not None
        ]
        if given:
            parser.error(f"argument {given[0]}: it describes the Mooncake tier of --mooncake-master, not given")
    args.mooncake = None if args.mooncake_master is None else mooncake_config(parser, args)
    if (args.attach is None) != (args.listen_fd is None):
        parser.error("argument --attach: a worker takes --attach and --listen-fd together")
    if args.device is not None and not args.plain_dict:
        _check_device(parser, args.device)
    try:
        config = HostTierConfig(
            quota=args.quota,
            max_quota=args.max_quota if args.max_quota is not None else args.quota,
            slot_size=args.slot_size,
            backing=args.backing,
            device=args.device,
            numa_node=None if args.device is None else "auto",
        )
    except ValidationError as error:
        first = error.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        named = re.match(r"\w+", message)  # a rule across fields names its subject first ("max_quota (...) is below")
        if named and named.group() in OPTION_OF_FIELD:
            field = named.group()
        else:
            field = str(first["loc"][0]) if first["loc"] else "quota"
        from .._program import options_in_advice

        message = options_in_advice(message, OPTION_OF_FIELD)
        parser.error(f"argument {OPTION_OF_FIELD.get(field, '--' + field)}: {message}")
    if args.attach is None and not args.plain_dict:
        # Checked by the process that makes the tier: with --workers, the parent that owns their pool (a
        # worker attaches to memory already there). The dict fills only as blocks are put.
        try:
            check_quota_available(int(config.quota), force=args.force)
        except UsageError as exc:
            parser.error(str(exc))
    return args, config
