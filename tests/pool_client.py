"""A process attached to a pool, driven by the pool tests: one JSON command a line on stdin, one JSON
answer a line on stdout.

``python tests/pool_client.py LOOP PATH``: attaches to the pool at PATH on
LOOP (``asyncio`` or ``uvloop``) and prints ``{"event": "attached", ...}``
(or ``{"event": "refused", "error": ...}``). Each command runs as a task, so
one that waits (an allocation during the fill, a store held by ``hold``)
does not hold back the next; its answer carries its ``id``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import threading
import traceback
from typing import Any

import numpy as np

from aiokvtier import AttachedPool
from aiokvtier._pool import _client

held = threading.Event()
holding = False
real_memmove = _client.memmove_all
real_into, real_from = _client.rows_into_slots, _client.rows_from_slots


def out(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def held_memmove(copies: list[tuple[int, int, int]]) -> None:
    """Copies wait for a ``release`` command while ``hold`` is on (the process is mid-store or mid-load)."""
    if holding:
        out({"event": "copying", "n": len(copies)})
        held.wait()
    real_memmove(copies)


def held_rows(real: Any) -> Any:
    """The same hold for copies made as rows of a page array (``aiokvtier._host._rows``)."""

    def copy(*args: Any) -> None:
        if holding:
            out({"event": "copying", "n": len(args[3])})
            held.wait()
        real(*args)

    return copy


def pages(keys: list[str], size: int) -> np.ndarray:
    """Each key's page: bytes derived from the key, so any process can check what it loads."""
    rows = [np.frombuffer(hashlib.shake_128(bytes.fromhex(k)).digest(size), dtype=np.uint8) for k in keys]
    return np.stack(rows) if rows else np.zeros((0, size), dtype=np.uint8)


async def run(pool: AttachedPool, cmd: dict[str, Any]) -> dict[str, Any]:
    global holding
    op = cmd["op"]
    if op == "allocate":
        return {"slots": await pool.allocate(cmd["n"])}
    if op == "free":
        await pool.free_many(cmd["slots"])
        return {}
    if op == "write":
        view = pool.view(cmd["slot"])
        data = bytes.fromhex(cmd["data"])
        view[: len(data)] = data
        return {}
    if op == "read":
        return {"data": bytes(pool.view(cmd["slot"])[: cmd["n"]]).hex()}
    if op == "wait_resident":
        await pool.wait_resident(cmd.get("nbytes"))
        return {"resident": pool.resident_bytes}
    if op == "stats":
        s = await pool.statistics()
        return {"slots_allocated": s.tier.slots_allocated, "clients": s.clients, "blocks": s.blocks}
    if op == "store":
        r = await pool.store([bytes.fromhex(k) for k in cmd["keys"]], pages(cmd["keys"], cmd["size"]))
        stored, present = [k.hex() for k in r.stored], [k.hex() for k in r.present]  # type: ignore[union-attr]
        return {"stored": stored, "present": present, "skipped": len(r.skipped)}
    if op == "load":
        dst = np.zeros((len(cmd["keys"]), cmd["size"]), dtype=np.uint8)
        await pool.load([bytes.fromhex(k) for k in cmd["keys"]], dst)
        return {"exact": bool((dst == pages(cmd["keys"], cmd["size"])).all())}
    if op == "lookup":
        return {"hits": await pool.lookup([bytes.fromhex(k) for k in cmd["keys"]])}
    if op == "discard":
        return {"dropped": await pool.discard([bytes.fromhex(k) for k in cmd["keys"]])}
    if op == "hold":
        holding = True
        held.clear()
        return {}
    if op == "release":
        holding = False
        held.set()
        return {}
    raise ValueError(f"unknown op {op}")


async def command(pool: AttachedPool, cmd: dict[str, Any]) -> None:
    try:
        answer = await run(pool, cmd)
    except Exception as exc:
        answer = {"error": type(exc).__name__, "message": str(exc)}
    out({"id": cmd.get("id"), **answer})


async def main(path: str) -> None:
    if len(sys.argv) > 3 and sys.argv[3] == "as-nobody":  # a root test run: attach as another user
        os.setgid(65534)
        os.setuid(65534)
    _client.memmove_all = held_memmove  # type: ignore[assignment]
    _client.rows_into_slots = held_rows(real_into)
    _client.rows_from_slots = held_rows(real_from)
    try:
        pool = await AttachedPool.attach(path)
    except Exception as exc:
        out({"event": "refused", "error": type(exc).__name__, "message": str(exc)})
        return
    out({"event": "attached", "pid": os.getpid(), "resident": pool.resident_bytes, "quota": pool.quota})
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str] = asyncio.Queue()

    def read() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(lines.put_nowait, "")

    threading.Thread(target=read, name="aiokvtier-test-stdin", daemon=True).start()
    tasks = set()
    try:
        while line := await lines.get():
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            task = asyncio.ensure_future(command(pool, cmd))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        await pool.aclose()
    out({"event": "detached"})


if __name__ == "__main__":
    try:
        if sys.argv[1] == "uvloop":
            import uvloop

            uvloop.run(main(sys.argv[2]))
        else:
            asyncio.run(main(sys.argv[2]))
    except BaseException:
        traceback.print_exc()
        raise
