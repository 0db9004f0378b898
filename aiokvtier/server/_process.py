"""The server process: uvicorn serving the app, signals, drain and shutdown.

Shutdown, after the drain: stop accepting; close the idle connections at
once and every other one after its response; wait up to ``grace_seconds``
for the requests in flight; then answer those still running 503 (JSON, see
``Service.cut()``), give those answers ``CUT_SECONDS`` to go out, abort
every connection still open (a client that does not read what it was sent
holds its connection open for as long as it likes), and close the store and
the tier. uvicorn's own shutdown would wait ``timeout_graceful_shutdown``
and then cancel the requests, which answers them a plain-text 500 and logs
a traceback each; this one replaces it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Generator
from types import FrameType
from typing import Any

import uvicorn

from .._config import DiskTierConfig, HostTierConfig
from .._errors import AiokvtierError
from ._app import Service
from ._blocks import Blocks, DictBlocks, PoolBlocks, StoreBlocks

__all__ = ["INTERRUPTED", "StartupError", "listen", "serve"]

log = logging.getLogger("aiokvtier.server")

INTERRUPTED = 130
"""What ``serve`` returns after a shutdown that Ctrl-C (SIGINT) started: the command then ends by SIGINT."""


class StartupError(Exception):
    """The server did not start: the port, or the tier, a tier below or the store refused (one line says why)."""


CUT_SECONDS = 1.0
"""After the grace, how long the 503s have to go out before the connections left are aborted (and again
after that, for the aborted connections' handlers to see it). A small JSON answer fits in the socket's
send buffer whether the client reads or not, so this is ample; it only bounds the wait."""


class Server(uvicorn.Server):
    """uvicorn's server, saying where it listens, marking the service draining on a signal, exiting 0 after it.

    With ``drain_seconds``, the first signal only marks the service draining
    (``/readyz`` 503, everything else served, so that a load balancer sees
    the change before the port closes); the shutdown starts when the drain
    is over, or at a second signal. A signal during the shutdown ends its
    grace at once.
    """

    def __init__(
        self, config: uvicorn.Config, service: Service, drain_seconds: float = 0.0, grace_seconds: float = 10.0
    ) -> None:
        super().__init__(config)
        self.service = service
        self.drain_seconds = drain_seconds
        self.grace_seconds = grace_seconds
        self.drain_until: float | None = None
        self.cut_now = False
        self.first_signal: int | None = None
        """The signal that started the shutdown: SIGINT (Ctrl-C) ends the command by SIGINT, SIGTERM with 0."""
        self.startup_error: AiokvtierError | OSError | None = None
        self.lost: str | None = None
        """Why the service stopped by itself: its pool is lost (a worker whose parent died), or None."""

    async def serve(self, sockets: list[Any] | None = None) -> None:
        # The blocks open before uvicorn starts, so that a tier that cannot open is one line of ours, not a
        # lifespan traceback; a signal meanwhile is seen once uvicorn runs, which then shuts down at once.
        with self.capture_signals():
            try:
                await self.service.open()
            except (AiokvtierError, OSError) as exc:
                self.startup_error = exc
                return
        try:
            await super().serve(sockets)
        finally:
            await self.service.blocks.aclose()  # idempotent: the lifespan closed them unless uvicorn failed first

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                # One write for the whole line: the workers of --workers share the parent's stdout, and
                # print() writes the newline apart (unbuffered, PYTHONUNBUFFERED=1), so lines interleaved.
                print(f"aiokvtier server listening on http://{host}:{port}\n", end="", flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler may only set flags: on_tick and the shutdown's wait (every 0.1 s or less,
        # on the loop) act on them.
        self.service.draining = True
        if self.first_signal is None:
            self.first_signal = sig
        if self.drain_seconds > 0 and self.drain_until is None:
            self.drain_until = time.monotonic() + self.drain_seconds
            return
        if self.should_exit:
            self.cut_now = True
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_until is not None and time.monotonic() >= self.drain_until:
            self.should_exit = True
        if self.lost is None and self.service.opened:
            # A worker's pool goes only with the parent that owns it: nothing can be served any more and
            # nobody is left to stop this process, so it stops itself (no drain: there is nothing to drain).
            self.lost = self.service.blocks.lost()
            if self.lost is not None:
                log.error("aiokvtier server: the block pool is lost, shutting down: %s", self.lost)
                self.service.draining = True
                self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        state = self.server_state
        for connection in list(state.connections):
            connection.shutdown()  # idle: closed now; busy: closed once its response is complete
        if not await self._settled(self.grace_seconds):
            cut = self.service.cut()
            log.warning(
                "shutdown: after the %g s grace, %d request(s) still in flight, answered 503, "
                "and %d connection(s) open, closed",
                self.grace_seconds,
                cut,
                len(state.connections),
            )
            if not await self._settled(CUT_SECONDS, cutting=True):
                for connection in list(state.connections):
                    connection.transport.abort()  # a client that does not read its response
                await self._settled(CUT_SECONDS, cutting=True)
        # Always, even after a second SIGINT: closing the tier stops its fill threads, and it is quick
        # once no request is left.
        await self.lifespan.shutdown()

    async def _settled(self, seconds: float, *, cutting: bool = False) -> bool:
        """Wait until no connection and no request is left: True, or False after ``seconds`` or a further signal."""
        deadline = time.monotonic() + seconds
        state = self.server_state
        while state.connections or state.tasks:
            if time.monotonic() >= deadline or (self.cut_now and not cutting):
                return False
            await asyncio.sleep(0.02)
        return True

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn raises the caught signal again once it has shut down; here the
        # command ends by the first signal itself (``first_signal``).
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before uvicorn starts (as uvicorn binds it for its own workers).

    :raises StartupError: the address does not resolve, or the port is taken or not allowed.
    """
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
        except BaseException:
            sock.close()
            raise
    except OSError as exc:
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def serve(args: argparse.Namespace, config: HostTierConfig) -> int:
    """Serve until a signal; 0 after a clean shutdown that SIGTERM started, ``INTERRUPTED`` after SIGINT, 1
    when a worker stopped because its pool was lost.

    :raises StartupError: the server did not start: the port, or the tier or the store refused.
    """
    if args.workers > 1:
        from ._workers import serve_workers

        return serve_workers(args, config)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    blocks: Blocks
    if args.attach is not None:
        blocks = PoolBlocks(args.attach)
    elif args.plain_dict:
        blocks = DictBlocks(int(config.quota), int(config.slot_size))
    else:
        disk = None
        if args.disk_path is not None:
            disk = DiskTierConfig(quota=args.disk_quota, path=args.disk_path)
        blocks = StoreBlocks(config, args.policy, disk, args.mooncake)
    service = Service(blocks, body_timeout=args.body_timeout or None)
    uv = uvicorn.Config(
        service.app(),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=args.grace_seconds,  # what Server.shutdown waits, in its own way
        timeout_keep_alive=args.keep_alive,
    )
    server = Server(uv, service, args.drain_seconds, args.grace_seconds)
    if args.listen_fd is not None:  # a worker of --workers: the parent's listening socket
        sock = socket.socket(fileno=args.listen_fd)
    else:
        sock = listen(args.host, args.port)
    try:
        server.run(sockets=[sock])
    except SystemExit:  # uvicorn's way out of a startup that failed after the blocks opened: it logged why
        raise StartupError("the server did not start (the line above says why)") from None
    finally:
        sock.close()
    error = server.startup_error
    if error is not None:
        raise StartupError(f"{type(error).__name__}: {error}" if isinstance(error, AiokvtierError) else str(error))
    if not server.started:
        raise StartupError("the server did not start (the line above says why)")
    if server.lost is not None:
        return 1
    return INTERRUPTED if server.first_signal == signal.SIGINT else 0
