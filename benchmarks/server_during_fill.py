"""The example server under its load generator while its tier fills, then once it is resident.

Starts ``examples/server/app.py`` on a free loopback port, runs
``examples/server/load.py`` for ``--seconds`` as soon as the server answers
(the tier still filling), waits until ``/readyz`` says the tier is fully
resident, runs the same load again, sends SIGTERM, and prints one JSON
object with both runs and the p99 ratio per endpoint (during / after; the
goal is <= 2).

    python benchmarks/server_during_fill.py --quota 64GiB --clients 64 --seconds 4
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _load(url: str, clients: int, seconds: float, block: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples/server/load.py"), "--url", url, "--clients", str(clients),
         "--seconds", str(seconds), "--block-size", str(block)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"load.py failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quota", default="64GiB", help="the server's --quota and --max-quota (default 64GiB)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds per load run (default 4)")
    parser.add_argument("--block-size", type=int, default=64 << 10, help="bytes per block (default 65536)")
    args = parser.parse_args()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "examples/server/app.py"), "--quota", args.quota, "--max-quota", args.quota,
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    started = time.perf_counter()
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            while True:
                try:
                    client.get("/healthz")
                    break
                except httpx.TransportError:
                    if server.poll() is not None:
                        raise SystemExit("the server exited before it answered") from None
                    time.sleep(0.02)
            report: dict[str, Any] = {"quota": args.quota, "answering_after_s": round(time.perf_counter() - started, 3)}
            report["readyz_before"] = client.get("/readyz").json()
            report["during_fill"] = _load(url, args.clients, args.seconds, args.block_size)
            report["readyz_after_first_run"] = client.get("/readyz").json()
            while client.get("/readyz").json().get("fraction", 0.0) < 1.0:
                time.sleep(0.1)
            report["resident_after_s"] = round(time.perf_counter() - started, 2)
            report["once_resident"] = _load(url, args.clients, args.seconds, args.block_size)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            report_exit = server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            report_exit = None
    during, after = report["during_fill"]["endpoints"], report["once_resident"]["endpoints"]
    report["p99_during_vs_resident"] = {
        name: round(during[name]["p99_ms"] / after[name]["p99_ms"], 3) for name in during if name in after
    }
    report["goal_ratio_at_most"] = 2.0
    report["server_exit"] = report_exit
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
