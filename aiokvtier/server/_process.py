"""The server process: uvicorn serving the app, signals, drain and shutdown."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Generator
from types import FrameType
from typing import Any

import uvicorn

from .._config import HostTierConfig
from ._app import Service
from ._blocks import Blocks, DictBlocks, StoreBlocks

__all__ = ["serve"]


class Server(uvicorn.Server):
    """uvicorn's server, saying where it listens, marking the service draining on a signal, exiting 0 after it.

    With ``drain_seconds``, the first signal only marks the service draining
    (``/readyz`` 503, everything else served, so that a load balancer sees
    the change before the port closes); uvicorn's shutdown starts when the
    drain is over, or at a second signal.
    """

    def __init__(self, config: uvicorn.Config, service: Service, drain_seconds: float = 0.0) -> None:
        super().__init__(config)
        self.service = service
        self.drain_seconds = drain_seconds
        self.drain_until: float | None = None

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                print(f"aiokvtier server listening on http://{host}:{port}", flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.service.draining = True
        if self.drain_seconds > 0 and self.drain_until is None:
            # A signal handler may only set flags: on_tick (every 0.1 s on the loop) acts on it.
            self.drain_until = time.monotonic() + self.drain_seconds
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_until is not None and time.monotonic() >= self.drain_until:
            self.should_exit = True
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn raises the caught signal again once it has shut down; the
        # shutdown here is the intended end, so the process exits 0 instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(args: argparse.Namespace, config: HostTierConfig) -> int:
    """Serve until a signal; 0 after a clean shutdown, 3 when the server did not start."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    blocks: Blocks = (
        DictBlocks(int(config.quota), int(config.slot_size)) if args.plain_dict else StoreBlocks(config, args.policy)
    )
    service = Service(blocks)
    uv = uvicorn.Config(
        service.app(),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=30,
    )
    server = Server(uv, service, args.drain_seconds)
    server.run()
    return 0 if server.started else 3
