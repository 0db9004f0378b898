"""``--workers N``: N server processes over one pool, sharing one listening socket.

The parent owns the pool (``Pool``, its socket in a private temporary
directory) and the listening socket; each worker is ``python -m
aiokvtier.server --attach PATH --listen-fd FD``: it attaches to the pool
and serves the inherited socket (the kernel spreads the connections over
the workers' accepts). A block PUT through one worker is a GET hit through
every other. SIGTERM and SIGINT are passed on to the workers (each drains
and shuts down as a single server does); the pool closes once they have
exited. A worker that exits on its own stops the others: exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile

from .._config import HostTierConfig
from .._errors import AiokvtierError
from .._pool._owner import Pool
from ._process import INTERRUPTED, StartupError, listen

__all__ = ["serve_workers"]

log = logging.getLogger("aiokvtier.server")


def serve_workers(args: argparse.Namespace, config: HostTierConfig) -> int:
    """Own the pool, start ``args.workers`` workers, pass signals on; 0 once every worker exited 0."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    directory = tempfile.mkdtemp(prefix="aiokvtier-server-")
    try:
        listener = listen(args.host, args.port)
        listener.listen(2048)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    try:
        return asyncio.run(_supervise(args, config, os.path.join(directory, "pool.sock"), listener))
    finally:
        listener.close()
        shutil.rmtree(directory, ignore_errors=True)


async def _supervise(args: argparse.Namespace, config: HostTierConfig, path: str, listener: socket.socket) -> int:
    loop = asyncio.get_running_loop()
    fd = listener.fileno()
    host, port = listener.getsockname()[:2]
    stopping: int | None = None
    """The signal that started the shutdown (0: a worker exited on its own), or None while serving."""
    workers: list[asyncio.subprocess.Process] = []
    signals: list[int] = []

    def pass_on(sig: int) -> None:
        nonlocal stopping
        if stopping is None:
            stopping = sig
        signals.append(sig)
        for worker in workers:
            if worker.returncode is None:
                worker.send_signal(sig)
        # The workers close their copies of the listening socket as they shut down; this one must go too,
        # or the kernel would go on queueing connections that nobody answers until this process exits.
        listener.close()

    # From the start: a signal while the pool opens or the workers start stops them too, instead of
    # killing this process (the default action) and leaving the workers behind.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, pass_on, sig)
    try:
        try:
            pool = await Pool.open(config, path)
        except (AiokvtierError, OSError) as exc:
            said = f"{type(exc).__name__}: {exc}" if isinstance(exc, AiokvtierError) else str(exc)
            raise StartupError(said) from None
        try:
            argv = [
                sys.executable, "-m", "aiokvtier.server", "--attach", path, "--listen-fd", str(fd),
                "--log-level", args.log_level, "--drain-seconds", str(args.drain_seconds),
                "--grace-seconds", str(args.grace_seconds), "--body-timeout", str(args.body_timeout),
                "--keep-alive", str(args.keep_alive),
            ]  # fmt: skip
            for _ in range(args.workers):
                if stopping is not None:
                    break
                # Each in its own process group: a terminal's Ctrl-C (SIGINT to the foreground group) reaches
                # this process alone, which passes it on once; a worker that got it twice, from the terminal
                # and from here, would take the second for "end the grace now".
                worker = await asyncio.create_subprocess_exec(*argv, pass_fds=(fd,), process_group=0)
                workers.append(worker)
                for came in signals:  # those that came while it started: pass_on did not know it yet
                    worker.send_signal(came)
            if stopping is None:
                print(
                    f"aiokvtier server listening on http://{host}:{port} ({args.workers} workers, one pool)",
                    flush=True,
                )
            waits = {asyncio.ensure_future(worker.wait()) for worker in workers}
            if waits:
                _, waits = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if stopping is None:
                log.error("aiokvtier server: a worker exited on its own; stopping the others")
                pass_on(signal.SIGTERM)
                stopping = 0  # not a shutdown asked for: the exit status says so
            await asyncio.gather(*waits)
        finally:
            await pool.aclose()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    # A worker shut down by Ctrl-C ends by SIGINT, as a single server does; one the signal reached before it
    # took its handlers (while Python started) ends by the signal itself: it served nothing yet.
    stopped = {0, -signal.SIGTERM, -signal.SIGINT}
    if not stopping or not all(worker.returncode in stopped for worker in workers):
        return 1
    return INTERRUPTED if stopping == signal.SIGINT else 0
