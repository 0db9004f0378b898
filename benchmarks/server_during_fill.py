"""The block server (aiokvtier.server) under its load generator while its tier fills, then once it is resident.

Starts ``python -m aiokvtier.server`` on a free loopback port, runs
``python -m aiokvtier.server.load`` for ``--seconds`` as soon as the server answers
(the tier still filling), waits until ``/readyz`` says the tier is fully
resident, runs the same load again, sends SIGTERM, and prints one JSON
object with both runs and the p99 ratio per endpoint (during / after; the
goal is <= 2).

    python benchmarks/server_during_fill.py --quota 64GiB --clients 64 --seconds 4
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from _served import run_load, served


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quota", default="64GiB", help="the server's --quota and --max-quota (default 64GiB)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds per load run (default 4)")
    parser.add_argument("--block-size", type=int, default=64 << 10, help="bytes per block (default 65536)")
    args = parser.parse_args()
    with served(args.quota) as server:
        client = server.client
        report: dict[str, Any] = {
            "quota": args.quota,
            "answering_after_s": round(time.perf_counter() - server.started, 3),
        }
        report["readyz_before"] = client.get("/readyz").json()
        report["during_fill"] = run_load(server.url, args.clients, args.seconds, args.block_size)
        report["readyz_after_first_run"] = client.get("/readyz").json()
        while client.get("/readyz").json().get("fraction", 0.0) < 1.0:
            time.sleep(0.1)
        report["resident_after_s"] = round(time.perf_counter() - server.started, 2)
        report["once_resident"] = run_load(server.url, args.clients, args.seconds, args.block_size)
    during, after = report["during_fill"]["endpoints"], report["once_resident"]["endpoints"]
    report["p99_during_vs_resident"] = {
        name: round(during[name]["p99_ms"] / after[name]["p99_ms"], 3) for name in during if name in after
    }
    report["goal_ratio_at_most"] = 2.0
    report["server_exit"] = server.exit_code
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
