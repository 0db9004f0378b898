"""The example server with ``--workers N`` over one pool: a block PUT through one worker is a GET hit
through any other."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@contextlib.contextmanager
def two_workers() -> Iterator[str]:
    """A server of two workers over a 64 MiB pool, serving: its URL. It exits 0 after SIGTERM at the end."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiokvtier.server", "--workers", "2", "--port", "0", "--quota", "64MiB"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        found = re.search(r"http://([\d.]+):(\d+) \(2 workers, one pool\)", first)
        assert found, (first, proc.stderr.read() if proc.poll() is not None else "")
        for _ in range(2):  # each worker says where it listens once it serves
            assert "listening" in proc.stdout.readline()
        yield f"http://{found.group(1)}:{found.group(2)}"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_workers_share_one_pool() -> None:
    with two_workers() as url:
        for i in range(16):  # a new connection per request: the kernel hands each to either worker
            put = httpx.put(f"{url}/v1/blocks/{i:04x}", content=b"block %d" % i, timeout=30)
            assert put.status_code == 201, put.text
        for i in range(16):
            got = httpx.get(f"{url}/v1/blocks/{i:04x}", timeout=30)
            assert got.status_code == 200 and got.content == b"block %d" % i
            stats = httpx.get(f"{url}/v1/stats", timeout=30).json()
            assert stats["pool"]["clients"] == 2 and stats["pool"]["blocks"] == 16
        assert httpx.post(f"{url}/v1/lookup", json={"keys": ["0000", "0001", "ffff"]}, timeout=30).json() == {"hits": 2}
        assert httpx.delete(f"{url}/v1/blocks/0000", timeout=30).status_code == 204
        assert httpx.get(f"{url}/v1/blocks/0000", timeout=30).status_code == 404


def test_each_workers_metrics_expose_the_shared_pool() -> None:
    """Before: /metrics of a worker answered an empty page (no collector was registered)."""
    with two_workers() as url:
        for i in range(3):
            assert httpx.put(f"{url}/v1/blocks/{i:04x}", content=b"block", timeout=30).status_code == 201
        for _ in range(16):  # a new connection each: the kernel hands them to either worker
            page = httpx.get(f"{url}/metrics", timeout=30)
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
            samples = {
                (sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(page.text)
                for sample in family.samples
            }
            assert samples[("aiokvtier_pool_blocks", (("pool", "default"),))] == 3, page.text
            assert samples[("aiokvtier_pool_clients", (("pool", "default"),))] == 2
            assert samples[("aiokvtier_pool_stores_total", (("pool", "default"),))] == 3
            assert samples[("aiokvtier_tier_quota_bytes", (("tier", "default"),))] == 64 << 20


def test_workers_refuse_what_cannot_be_shared() -> None:
    for args, says in (
        (["--workers", "2", "--plain-dict"], "--plain-dict"),
        (["--workers", "2", "--backing", "register", "--device", "0"], "host memory only"),
        (["--workers", "0"], "not 1 to 256"),
        (["--workers", "2", "--policy", "s3fifo"], "argument --policy: "),  # it was ignored: the pool's own order
    ):
        done = subprocess.run(
            [sys.executable, "-m", "aiokvtier.server", *args], capture_output=True, text=True, env=ENV, timeout=60
        )
        assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1
