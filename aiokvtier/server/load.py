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
import sys
from collections.abc import Sequence

from ._options import Parser

__all__ = ["main"]


def build_parser(prog: str = "python -m aiokvtier.server.load") -> argparse.ArgumentParser:
    parser = Parser(
        prog=prog,
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8077", help="the server")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients, each one request at a time")
    parser.add_argument("--seconds", type=float, default=10.0, help="stop after this long")
    parser.add_argument("--requests", type=int, default=10**9, help="stop after about this many requests in all")
    parser.add_argument("--block-size", type=int, default=64 << 10, help="bytes per block PUT")
    parser.add_argument("--lookup-keys", type=int, default=32, help="keys per lookup: the client's last ones")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the load and print its JSON; 1 after one line when httpx is missing, 2 after a bad option."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        from ._load import run
    except ImportError as error:
        missing = f"needs httpx ({error.name} is missing): pip install 'aiokvtier[server]'"
        print(f"{parser.prog}: error: {missing}", file=sys.stderr)
        return 1
    print(json.dumps(asyncio.run(run(args)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
