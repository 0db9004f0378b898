"""A process that attaches to a pool and cancels its own calls, for the pool tests.

``python tests/pool_cancel_sweep.py LOOP PATH OP MAX_MS``: for each delay of
0 to MAX_MS milliseconds (and a few turns of the loop below a millisecond),
attaches, runs OP (``attach``, ``allocate``, ``free``, ``store`` or ``load``)
under ``asyncio.wait_for`` with that delay, then detaches; every await is
bounded. Once every round is done it prints one JSON line: what this process
held before the sweep and after it (descriptors, ``aiokvtier-`` threads, its
mappings of the pool's memory), the owner's figures once it has seen every
round's connection go, and the rounds that were cancelled.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from typing import Any

import numpy as np

from aiokvtier import AttachedPool

BOUND = 20.0
"""Seconds any one step may take (a hang fails the test instead of stalling it)."""
KEYS = [b"sweep-%d" % i for i in range(16)]
PAGES = np.frombuffer(bytes(range(256)) * 16 * len(KEYS), dtype=np.uint8).reshape(len(KEYS), 4096)


def held() -> dict[str, Any]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:
            pass  # the listing's own descriptor, closed by now
    with open("/proc/self/maps") as f:
        maps = [line for line in f if "aiokvtier-pool" in line]
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("aiokvtier-"))
    return {"fds": sorted(fds), "threads": threads, "maps": len(maps)}


async def settled() -> dict[str, Any]:
    """Library threads gone (a worker ends just after its close returns), then what is held."""
    deadline = time.monotonic() + BOUND
    # A thread's exit sets nothing to await: poll.
    while any(t.name.startswith("aiokvtier-") for t in threading.enumerate()) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    return held()


async def one_round(path: str, op: str, delay: float) -> bool:
    """One attach, OP cancelled after ``delay`` s, one detach; whether OP was cancelled."""
    if op == "attach":
        try:
            pool = await asyncio.wait_for(AttachedPool.attach(path), delay)
        except TimeoutError:
            return True
        async with asyncio.timeout(BOUND):
            await pool.aclose()
        return False
    async with asyncio.timeout(BOUND):
        pool = await AttachedPool.attach(path)
    try:
        if op == "free":
            async with asyncio.timeout(BOUND):
                slots = await pool.allocate(4)
            call: Any = pool.free_many(slots)
        elif op == "allocate":
            call = pool.allocate(8)
        elif op == "store":
            call = pool.store(KEYS, PAGES)
        elif op == "load":
            async with asyncio.timeout(BOUND):
                await pool.store(KEYS, PAGES)
            call = pool.load(KEYS, np.zeros_like(PAGES))
        else:
            raise ValueError(f"unknown op {op}")
        try:
            await asyncio.wait_for(call, delay)
        except TimeoutError:
            return True
        return False
    finally:
        async with asyncio.timeout(BOUND):
            await pool.aclose()


async def main(path: str, op: str, max_ms: str) -> None:
    delays = [0.0, 0.00005, 0.0001, 0.0002, 0.0005] + [ms / 1000 for ms in range(1, int(max_ms) + 1)]
    async with asyncio.timeout(BOUND):
        first = await AttachedPool.attach(path)  # the loop's own descriptors, made before the count
        await first.aclose()
    before = await settled()
    cancelled = [await one_round(path, op, delay) for delay in delays]
    after = await settled()
    async with asyncio.timeout(BOUND), AttachedPool(path) as pool:
        while True:  # the owner sees the rounds' connections go in its own time
            s = await pool.statistics()
            if s.clients == 1:
                break
            await asyncio.sleep(0.01)
        owner = {
            "slots_attached": s.slots_attached,
            "claims": s.claims,
            "blocks_pinned": s.blocks_pinned,
            "slots_allocated": s.tier.slots_allocated,
            "blocks": s.blocks,
        }
    out = {"before": before, "after": after, "owner": owner, "cancelled": cancelled}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1] == "uvloop":
        import uvloop

        uvloop.run(main(*sys.argv[2:]))
    else:
        asyncio.run(main(*sys.argv[2:]))
