"""Loading the ``mooncake`` wheel and making one client: blocking, run on the tier's threads.

Mooncake's Python binding returns negative ``ErrorCode`` values (its
``types.h``) per key; the ones named here are those the tier tells apart.
A client whose ``setup`` did not return 0 is dropped without another call
(a batch call on one crashed the process; destroying it was measured safe).
A client a transfer may still use is never closed nor destroyed: it is kept
in ``_UNUSABLE`` until the process exits.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from .._config import MooncakeTierConfig
from .._errors import MooncakeError

__all__ = [
    "LEASE_EXPIRED",
    "OBJECT_NOT_FOUND",
    "SAFE_GET",
    "SAFE_PUT",
    "UNREACHABLE",
    "load",
    "setup",
    "why_unloadable",
]

NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600  # also "buffer too small": refused before any transfer
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
LEASE_EXPIRED = -707
RPC_FAIL = -900
RPC_TIMEOUT = -901
TENANT_QUOTA_EXCEEDED = -1700

UNREACHABLE = frozenset({RPC_FAIL, RPC_TIMEOUT})
"""The master did not answer: the tier becomes unavailable until ``health_check`` says it is back."""
_SAFE = frozenset(
    {NO_AVAILABLE_HANDLE, INVALID_PARAMS, REPLICA_IS_NOT_READY, OBJECT_NOT_FOUND, OBJECT_ALREADY_EXISTS} | UNREACHABLE
)
SAFE_GET = _SAFE | {LEASE_EXPIRED}
"""Failures of a get that come before any transfer or after it completed (the lease is checked after)."""
SAFE_PUT = _SAFE | {TENANT_QUOTA_EXCEEDED}
"""Failures of a put that come before any transfer. Any other failure may leave a transfer
using the memory after the call returned (what vLLM's Mooncake connector also assumes)."""

_UNUSABLE: list[Any] = []
_UNUSABLE_LOCK = threading.Lock()


def why_unloadable() -> str | None:
    """None if ``mooncake.store`` imports here, else what is missing (for skips and ``doctor``)."""
    try:
        load()
    except MooncakeError as exc:
        return str(exc)
    return None


def load() -> Any:
    """``mooncake.store.MooncakeDistributedStore``.

    :raises MooncakeError: the wheel is not installed, or its libraries cannot load.
    """
    try:
        from mooncake.store import MooncakeDistributedStore
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] != "mooncake":
            raise MooncakeError(f"the mooncake wheel cannot import {exc.name!r}") from exc
        raise MooncakeError("the Mooncake Store client is not installed: pip install 'aiokvtier[mooncake]'") from exc
    except ImportError as exc:
        lib = next((name for name in ("libibverbs", "librdmacm", "libnuma") if name in str(exc)), None)
        hint = f" (install {lib}: apt-get install libibverbs1 librdmacm1)" if lib else ""
        raise MooncakeError(f"the mooncake wheel is installed but cannot load{hint}: {exc}") from exc
    return MooncakeDistributedStore


def reachable(config: MooncakeTierConfig, timeout: float) -> None:
    """Connect to the master (and to an HTTP metadata server) once, within ``timeout`` seconds.

    ``setup`` against an unreachable master retries for about 90 s *holding the GIL*
    (measured with 0.3.13: the event loop froze with it), so it is never called on one.

    :raises MooncakeError: one of them refused or did not answer.
    """
    deadline = time.monotonic() + timeout
    master, _, master_port = config.master.rpartition(":")
    places = [("master", master.strip("[]"), int(master_port))]
    url = urlsplit(config.metadata_server)
    if url.scheme in ("http", "https") and url.hostname:
        places.append(("metadata server", url.hostname, url.port or (443 if url.scheme == "https" else 80)))
    for what, host, port in places:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic())):
                pass
        except OSError as exc:
            raise MooncakeError(f"cannot reach the Mooncake {what} at {host}:{port}: {exc}") from None


def setup(config: MooncakeTierConfig) -> Any:
    """A client set up against ``config``'s master.

    :raises MooncakeError: the wheel cannot load, or ``setup`` failed.
    """
    cls = load()
    reachable(config, config.open_timeout)
    client = cls()
    code = client.setup(
        config.local_hostname,
        config.metadata_server,
        int(config.segment_size),
        int(config.local_buffer_size),
        config.protocol,
        config.rdma_devices,
        config.master,
    )
    if code != 0:
        raise MooncakeError(
            f"the Mooncake Store client could not be set up (code {code}): is the master at "
            f"{config.master} and the metadata server at {config.metadata_server} reachable?"
        )
    return client


def keep_forever(client: Any) -> None:
    """Never close or destroy ``client``: a transfer may still be using memory through it."""
    with _UNUSABLE_LOCK:
        _UNUSABLE.append(client)


def find_master() -> str | None:
    """``mooncake_master`` beside this interpreter, on PATH, or inside the wheel (None if nowhere)."""
    import os
    import shutil
    import sys

    found = shutil.which("mooncake_master", path=os.pathsep.join([os.path.dirname(sys.executable), os.defpath]))
    found = found or shutil.which("mooncake_master")
    if found:
        return found
    try:
        import mooncake
    except ImportError:
        return None
    inside = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    return inside if os.access(inside, os.X_OK) else None


def loopback_ports(n: int) -> list[int]:
    """``n`` free TCP ports on 127.0.0.1 (for a local master: the bench's, the tests')."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def master_argv(binary: str, rpc: int, http: int, metrics: int) -> list[str]:
    """A ``mooncake_master`` with its RPC, HTTP metadata and metrics servers on loopback ports (the
    metadata server binds every address whatever its host flag says: docs/mooncake.md)."""
    return [
        binary,
        f"--rpc_port={rpc}",
        "--rpc_address=127.0.0.1",
        "--enable_http_metadata_server=true",
        "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={http}",
        "--metrics_host=127.0.0.1",
        f"--metrics_port={metrics}",
    ]
