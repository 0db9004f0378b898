"""The block server over a BlockStore against the same server over a plain dict of bytes, in one run.

Starts ``python -m aiokvtier.server`` on a free loopback port, waits until
``/readyz`` says its tier is fully resident (``--during-fill``: runs at once,
the tier still filling), runs ``python -m aiokvtier.server.load`` against it, stops
it with SIGTERM; then the same with ``--plain-dict``. ``--rounds`` repeats the
pair, alternating the order, and keeps each arm's median round by requests/s
(the upper middle one of an even count).
Prints one JSON object: both runs, the requests/s ratio (BlockStore / plain
dict: the cost of the tier is small when it is near 1) and the p50 / p99
ratios per endpoint.

    python benchmarks/server_vs_dict.py --quota 2GiB --clients 16 --seconds 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from _served import run_load, served

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiokvtier.bench._common import machine

ARMS = {"blockstore": [], "plain_dict": ["--plain-dict"]}


def _arm(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One server process, one load run; the run's JSON with how the server started and ended."""
    with served(args.quota, "--slot-size", str(args.block_size), *ARMS[name], name=f"the {name}") as server:
        client = server.client
        while not args.during_fill and client.get("/readyz").json().get("fraction", 0.0) < 1.0:
            time.sleep(0.05)
        readyz = client.get("/readyz").json()
        run = run_load(server.url, args.clients, args.seconds, args.block_size)
        stats = client.get("/v1/stats").json()
    run["resident_fraction_at_start"] = round(readyz["fraction"], 4)
    run["seconds_to_start"] = round(time.perf_counter() - server.started - run["seconds"], 2)
    run["server_exit"] = server.exit_code
    if "store" in stats:
        run["store"] = {k: stats["store"][k] for k in ("blocks", "evictions", "skipped")}
    return run


def _ratios(ours: dict[str, Any], base: dict[str, Any], key: str) -> dict[str, float]:
    return {
        endpoint: round(ours["endpoints"][endpoint][key] / base["endpoints"][endpoint][key], 3)
        for endpoint in ours["endpoints"]
        if base["endpoints"].get(endpoint, {}).get(key)
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, prog="server_vs_dict.py"
    )
    parser.add_argument("--quota", default="2GiB", help="the server's --quota and --max-quota (default 2GiB)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds per load run (default 8)")
    parser.add_argument("--block-size", type=int, default=64 << 10, help="bytes per block and slot (default 65536)")
    parser.add_argument("--rounds", type=int, default=1, help="pairs of runs, order alternating (default 1)")
    parser.add_argument("--during-fill", action="store_true", help="load the store at once, its tier still filling")
    args = parser.parse_args()
    if args.clients < 1 or args.rounds < 1 or not args.seconds > 0 or args.block_size < 1:
        parser.error("--clients, --rounds, --seconds and --block-size must be positive")

    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in ARMS}
    for i in range(args.rounds):
        for name in list(ARMS) if i % 2 == 0 else list(ARMS)[::-1]:
            rounds[name].append(_arm(name, args))
    runs = {name: sorted(rs, key=lambda r: r["requests_per_s"])[len(rs) // 2] for name, rs in rounds.items()}
    ours, base = runs["blockstore"], runs["plain_dict"]
    report = {
        "mode": "server",
        "machine": machine(),
        "commands": [
            f"python -m aiokvtier.server --quota {args.quota} --slot-size {args.block_size} [--plain-dict]",
            f"python -m aiokvtier.server.load --clients {args.clients} --seconds {args.seconds:g} "
            f"--block-size {args.block_size}",
        ],
        "uvicorn": version("uvicorn"),
        "starlette": version("starlette"),
        # What uvicorn's "auto" picks in the server's interpreter (this one).
        "loop": "uvloop" if find_spec("uvloop") else "asyncio",
        "http": "httptools" if find_spec("httptools") else "h11",
        "tier_resident_before_load": not args.during_fill,
        "rounds": args.rounds,
        "requests_per_s_by_round": {name: [r["requests_per_s"] for r in rs] for name, rs in rounds.items()},
        "runs": runs,
        "ratio_requests_per_s": round(ours["requests_per_s"] / base["requests_per_s"], 3),
        "ratio_p50": _ratios(ours, base, "p50_ms"),
        "ratio_p99": _ratios(ours, base, "p99_ms"),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
