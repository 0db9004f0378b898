"""The block service (aiokvtier.server) in a subprocess, and its load generator: what the server benchmarks share."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_load(url: str, clients: int, seconds: float, block: int) -> dict[str, Any]:
    """One run of ``python -m aiokvtier.server.load`` against ``url``: its JSON."""
    out = subprocess.run(
        [sys.executable, "-m", "aiokvtier.server.load", "--url", url, "--clients", str(clients),
         "--seconds", str(seconds), "--block-size", str(block)],
        capture_output=True, text=True, check=False, cwd=ROOT,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"the load generator failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout)
    return result


@dataclass
class Served:
    """A started server: its URL, a client, when it was started, and (after the block) its exit code."""

    url: str
    client: httpx.Client
    started: float
    exit_code: int | None = None


@contextmanager
def served(quota: str, *options: str, name: str = "the") -> Iterator[Served]:
    """Start ``python -m aiokvtier.server`` on a free loopback port and wait until it answers.

    On leaving: SIGTERM, then ``exit_code`` (None if it had to be killed after 60 s).
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "aiokvtier.server", "--quota", quota, "--max-quota", quota,
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *options],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    started = time.perf_counter()
    with httpx.Client(base_url=url, timeout=10) as client:
        run = Served(url, client, started)
        try:
            while True:
                try:
                    client.get("/healthz")
                    break
                except httpx.TransportError:
                    if server.poll() is not None:
                        raise SystemExit(f"{name} server exited before it answered") from None
                    time.sleep(0.02)
            yield run
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                run.exit_code = server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
