"""The load generator's clients and figures (needs httpx); ``aiokvtier.server.load`` is the command."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import httpx

__all__ = ["NotTheServer", "run"]


class NotTheServer(Exception):
    """What answered at the URL is not the block server: the message names the URL and what came back."""


async def server_stats(http: httpx.AsyncClient) -> dict[str, object]:
    """The server's ``/v1/stats``.

    :raises NotTheServer: the answer is not the block server's JSON (another server at that address).
    """
    response = await http.get("/v1/stats")
    try:
        stats = response.json() if response.status_code == 200 else None
    except ValueError:  # not JSON, or not UTF-8
        stats = None
    if not isinstance(stats, dict) or "server" not in stats:
        kind = response.headers.get("content-type", "no Content-Type").partition(";")[0]
        raise NotTheServer(
            f"{response.url} answered {response.status_code} {kind}: {response.text[:60]!r}, "
            "not the block server's JSON (is --url the block server?)"
        )
    return stats


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def client(
    url: str, index: int, args: argparse.Namespace, deadline: float, budget: list[int], out: dict[str, list[float]]
) -> int:
    unexpected = 0
    blocks = [os.urandom(args.block_size) for _ in range(8)]
    keys: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        n = 0
        while time.monotonic() < deadline and budget[0] > 0:
            budget[0] -= 3
            key = f"{index:04x}{n:012x}"
            n += 1
            start = time.perf_counter()
            response = await http.put(f"/v1/blocks/{key}", content=blocks[n % len(blocks)])
            out["PUT"].append(time.perf_counter() - start)
            unexpected += response.status_code not in (200, 201)
            keys.append(key)
            start = time.perf_counter()
            response = await http.get(f"/v1/blocks/{keys[(n * 7919) % len(keys)]}")
            out["GET"].append(time.perf_counter() - start)
            unexpected += response.status_code not in (200, 404)  # 404: evicted meanwhile
            start = time.perf_counter()
            response = await http.post("/v1/lookup", json={"keys": keys[-args.lookup_keys :]})
            out["lookup"].append(time.perf_counter() - start)
            unexpected += response.status_code != 200
    return unexpected


async def run(args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, list[float]] = {"PUT": [], "GET": [], "lookup": []}
    async with httpx.AsyncClient(base_url=args.url, timeout=30) as http:
        await server_stats(http)  # before the load: another server there is told at once, not after it
    budget = [args.requests]
    start = time.monotonic()
    deadline = start + args.seconds
    unexpected = await asyncio.gather(*(client(args.url, i, args, deadline, budget, out) for i in range(args.clients)))
    elapsed = time.monotonic() - start
    endpoints = {
        name: {
            "requests": len(times),
            "requests_per_s": round(len(times) / elapsed, 1),
            "p50_ms": round(percentile(times, 0.50) * 1e3, 2),
            "p99_ms": round(percentile(times, 0.99) * 1e3, 2),
            "mean_ms": round(statistics.fmean(times) * 1e3, 2) if times else 0.0,
        }
        for name, times in out.items()
    }
    async with httpx.AsyncClient(base_url=args.url, timeout=30) as http:
        stats = await server_stats(http)
    return {
        "url": args.url,
        "clients": args.clients,
        "block_size": args.block_size,
        "seconds": round(elapsed, 2),
        "requests_per_s": round(sum(len(t) for t in out.values()) / elapsed, 1),
        "unexpected_answers": sum(unexpected),
        "endpoints": endpoints,
        "server": "plain dict" if "dict" in stats else "BlockStore",
    }
