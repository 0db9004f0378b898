"""A load generator for the block service: N concurrent clients, JSON figures per endpoint.

    python -m aiokvtier.server.load --url http://127.0.0.1:8077 --clients 16 --seconds 10

Each client loops: PUT a new block (``--block-size`` bytes, 64 KiB by
default), GET a block it stored earlier, POST a lookup of its last
``--lookup-keys`` keys. It stops after ``--seconds`` or ``--requests`` in
all, whichever comes first, and prints requests per second and p50 / p99
latency per endpoint, and the count of answers other than the expected ones.
Needs httpx (in the ``server`` extra): without it, one line says what to
install and the exit status is 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
import urllib.parse
from collections.abc import Sequence

from .._program import Formatter, seconds, whole_number
from ._options import Parser

__all__ = ["main"]


def build_parser(prog: str = "python -m aiokvtier.server.load") -> argparse.ArgumentParser:
    parser = Parser(
        prog=prog,
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=Formatter,
    )
    count = whole_number(1)
    parser.add_argument("--url", type=_url, default="http://127.0.0.1:8077", help="the server")
    parser.add_argument(
        "--clients", type=count, metavar="N", default=16, help="concurrent clients, each one request at a time"
    )
    parser.add_argument("--seconds", type=seconds(positive=True), default=10.0, help="stop after this long")
    parser.add_argument(
        "--requests", type=count, metavar="N", default=10**9, help="stop after about this many requests in all"
    )
    parser.add_argument("--block-size", type=count, metavar="BYTES", default=64 << 10, help="bytes per block PUT")
    parser.add_argument(
        "--lookup-keys", type=count, metavar="N", default=32, help="keys per lookup: the client's last ones"
    )
    return parser


def _url(text: str) -> str:
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # noqa: B018 - reading it checks it: a port that is not one raises
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL")
    if not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} names no host")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Run the load and print its JSON; 1 after one line when httpx is missing, the server does not
    answer or what answers is not the block server, 2 after a bad option. As the process's own command
    (``argv`` None), Ctrl-C ends it at once by SIGINT, printing nothing, as it ends a benchmark: it holds
    nothing that outlives the process."""
    if argv is None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        import httpx

        from ._load import NotTheServer, run
    except ImportError as error:
        missing = f"needs httpx ({error.name} is missing): pip install 'aiokvtier[server]'"
        print(f"{parser.prog}: error: {missing}", file=sys.stderr)
        return 1
    try:
        figures = asyncio.run(run(args))
    except httpx.TransportError as error:  # refused, unreachable, timed out: the server, not the load
        print(f"{parser.prog}: error: no answer from {args.url}: {error}", file=sys.stderr)
        return 1
    except httpx.InvalidURL as error:  # one that the option's own check let through
        print(f"{parser.prog}: error: argument --url: {args.url!r} is not a URL: {error}", file=sys.stderr)
        return 2
    except NotTheServer as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
