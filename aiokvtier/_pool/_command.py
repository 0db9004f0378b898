"""``aiokvtier pool``: a process that owns a pool and serves it until it is stopped.

It prints one JSON line once the socket is served (``{"event": "serving",
...}``: attached processes may connect from then on) and one when it stops.
SIGTERM closes the pool and exits 0 (what a service manager or a container
runtime sends); Ctrl-C closes it and ends by SIGINT, by the convention of
``aiokvtier._program``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

from .._config import HostTierConfig
from ._owner import Pool

__all__ = ["default_socket", "serve_pool"]


def default_socket() -> str:
    """``$AIOKVTIER_POOL``, else ``$XDG_RUNTIME_DIR/aiokvtier-pool.sock``, else ``/tmp/aiokvtier-pool-UID.sock``."""
    explicit = os.environ.get("AIOKVTIER_POOL")
    if explicit:
        return explicit
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "aiokvtier-pool.sock")
    return f"/tmp/aiokvtier-pool-{os.getuid()}.sock"


def _line(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


async def serve_pool(config: HostTierConfig, path: str, mode: int) -> None:
    """Own the pool at ``path`` until SIGTERM (returns) or a cancellation (Ctrl-C: raises it once closed)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    in_main = sys.platform != "win32"
    try:
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    except (RuntimeError, ValueError, NotImplementedError):  # not the main thread: Ctrl-C only
        in_main = False
    try:
        async with Pool(config, path, mode=mode) as pool:
            s = pool.statistics().tier
            _line("serving", path=path, pid=os.getpid(), quota=s.quota, max_quota=s.max_quota, slot_size=s.slot_size)
            try:
                await stop.wait()
            finally:  # SIGTERM, or Ctrl-C's cancellation: either way the pool closes now
                s = pool.statistics().tier
                _line(
                    "stopping", clients=pool.clients, resident_bytes=s.resident_bytes, slots_allocated=s.slots_allocated
                )
    finally:
        if in_main:
            loop.remove_signal_handler(signal.SIGTERM)
