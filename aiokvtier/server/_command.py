"""``aiokvtier-server`` / ``python -m aiokvtier.server``: parse, check the extra, serve."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence

from ._options import parse

__all__ = ["main"]

INSTALL = "pip install 'aiokvtier[server]'"


def main(argv: Sequence[str] | None = None, *, prog: str = "aiokvtier-server") -> int:
    """Run the server until SIGTERM or SIGINT; returns the exit status.

    0 after a clean shutdown that SIGTERM started (and after ``--help``); 2
    after one line naming a bad option; 1 after one line saying why the
    server did not start (the port taken, the tier refused) or what to
    install when the ``server`` extra is missing. After a shutdown that
    Ctrl-C (SIGINT) started, the process's own command (``argv`` None) ends
    by SIGINT, as every ``aiokvtier`` command does (a shell shows 130); a
    call with ``argv`` returns 130.

    :param argv: the options (default: ``sys.argv[1:]``).
    :param prog: the command's name in ``--help`` and in error lines.
    """
    if argv is None and threading.current_thread() is threading.main_thread():
        # Until uvicorn takes the signals over, Ctrl-C ends the process at once: nothing is open yet that
        # outlives it, and a worker of --workers still importing gets the parent's SIGINT too.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        args, config = parse(argv, prog)
    except SystemExit as exit_:  # argparse's way out: --help, or a bad option
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        from ._process import INTERRUPTED, StartupError, serve
    except ImportError as error:
        print(f"{prog}: error: needs the server extra ({error.name} is missing): {INSTALL}", file=sys.stderr)
        return 1
    try:
        status = serve(args, config)
    except StartupError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 1
    if status == INTERRUPTED and argv is None:
        from .._program import end_by_sigint

        end_by_sigint()
    return status
