"""``aiokvtier-server`` / ``python -m aiokvtier.server``: parse, check the extra, serve."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ._options import parse

__all__ = ["main"]

INSTALL = "pip install 'aiokvtier[server]'"


def main(argv: Sequence[str] | None = None, *, prog: str = "aiokvtier-server") -> int:
    """Run the server until SIGTERM or SIGINT; returns the exit status.

    0 after a clean shutdown (and after ``--help``); 2 after one line naming
    a bad option; 1 after one line saying what to install when the
    ``server`` extra is missing; 3 when the server did not start (the port
    taken, the tier refused: the log says why).

    :param argv: the options (default: ``sys.argv[1:]``).
    :param prog: the command's name in ``--help`` and in error lines.
    """
    try:
        args, config = parse(argv, prog)
    except SystemExit as exit_:  # argparse's way out: --help, or a bad option
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        from ._process import serve
    except ImportError as error:
        print(f"{prog}: error: needs the server extra ({error.name} is missing): {INSTALL}", file=sys.stderr)
        return 1
    return serve(args, config)
