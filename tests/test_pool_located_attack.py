"""An attached pool's pages, located when the call begins, under attack, on asyncio and uvloop.

``AttachedPool.store`` and ``load`` copy the caller's host pages on this
process's thread, after a round trip to the owner (the claim of slots, the
pin of blocks). Pages over a ``StaticHostMem`` (or any region) are located
when the call begins: a region that closed (or shrank past them) while the
call waited is refused with ``CopyPlanError``, nothing stored or loaded, the
claim or pin given back; a region that closes while the copy runs waits for it.

Pages are built over a region's memory from its address (``ctypes``), not
through a view that would keep it mapped: a copy the library failed to refuse
would read or write memory the region let go. The round trip is held by
stopping an owner in a separate process (``SIGSTOP``); those cases run in a
child process, where such a copy kills the child, not the test run. Every
await is bounded.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

import numpy as np
import pytest

from aiokvtier import AttachedPool, CopyPlanError, StaticHostMem
from tests.test_pool import ENV, ROOT, Child, loop_kind, sock

__all__ = ["sock"]  # the fixture, used by name

T = TypeVar("T")
SLOT = 64 << 10
KEYS = 4
TIMEOUT = 30.0


async def bounded(aw: Awaitable[T]) -> T:
    return await asyncio.wait_for(aw, TIMEOUT)


def raw(address: int, rows: int, row: int = SLOT) -> np.ndarray:
    """A writable ``(rows, row)`` array over the memory at ``address``, which it does not keep mapped."""
    return np.frombuffer((ctypes.c_ubyte * (rows * row)).from_address(address), dtype=np.uint8).reshape(rows, row)


def pattern(n: int, seed: int, row: int = SLOT) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, row), dtype=np.uint8)


def keys_of(name: str, n: int = KEYS) -> list[bytes]:
    return [f"{name}-{i}".encode() for i in range(n)]


# -- the region closes during the owner's round trip (a child process: a copy not refused kills it) ----


async def closed_during_round_trip(path: str, op: str, form: str) -> dict[str, Any]:
    """In a child: an owner in its own process, stopped while this process's ``op`` waits for its answer;
    the pages' StaticHostMem closes meanwhile. What the call did, and what the owner holds after it."""
    owner = await Child.start("pool_owner.py", path, "16MiB", "64KiB")
    try:
        pid = int((await owner.event("serving"))["pid"])
        async with AttachedPool(path) as pool:
            keys = keys_of(op)
            if op == "load":
                await bounded(pool.store(keys, pattern(KEYS, 1)))
            mem = await bounded(StaticHostMem.open(KEYS * SLOT))
            rows = raw(mem.address, KEYS)
            rows[:] = pattern(KEYS, 2)
            pages: Any = rows if form == "array" else list(rows)
            os.kill(pid, signal.SIGSTOP)
            try:
                call = asyncio.ensure_future(pool.store(keys, pages) if op == "store" else pool.load(keys, pages))
                for _ in range(5):  # the request leaves; its answer waits for the owner
                    await asyncio.sleep(0)
                assert not call.done()
                await bounded(mem.aclose())
            finally:
                os.kill(pid, signal.SIGCONT)
            try:
                await bounded(call)
                outcome = "copied"
            except CopyPlanError as exc:
                outcome = f"refused: {exc}"
            del pages, rows
            s = await bounded(pool.statistics())
            visible = await bounded(pool.lookup(keys))
            loaded = np.zeros((KEYS, SLOT), dtype=np.uint8)
            if visible:
                await bounded(pool.load(keys[:visible], loaded[:visible]))
            return {
                "outcome": outcome,
                "claims": s.claims,
                "pinned": s.blocks_pinned,
                "attached": s.slots_attached,
                "blocks": s.blocks,
                "allocated": s.tier.slots_allocated,
                "visible": visible,
                "intact": bool((loaded[:visible] == pattern(KEYS, 1)[:visible]).all()),
            }
    finally:
        await owner.close()


CHILD = """
import json, sys
from tests.conftest import run_on_new_loop
from tests.test_pool_located_attack import closed_during_round_trip

async def main():
    print(json.dumps(await closed_during_round_trip(*sys.argv[2:])), flush=True)

run_on_new_loop(sys.argv[1], main)
"""


@pytest.mark.parametrize("form", ["array", "list"])
@pytest.mark.parametrize("op", ["store", "load"])
async def test_pages_whose_region_closed_during_the_round_trip_are_refused(sock: str, op: str, form: str) -> None:
    """The owner answers the claim (store) or the pin (load) only after the pages' StaticHostMem closed:
    the call is refused, nothing is stored or loaded, and the owner holds no claim, pin or slot for it."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        loop_kind(),
        sock,
        op,
        form,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=ENV,
        cwd=ROOT,
    )
    out, err = await bounded(child.communicate())
    assert child.returncode == 0, f"the child ended with {child.returncode}: {err.decode()[-3000:]}"
    got = json.loads(out.decode().splitlines()[-1])
    assert got["outcome"].startswith("refused: ") and "closed after the pages were checked" in got["outcome"], got
    stored = KEYS if op == "load" else 0  # a load's blocks were stored before; a refused store adds none
    assert got["claims"] == 0 and got["pinned"] == 0 and got["attached"] == 0, got
    assert got["blocks"] == got["allocated"] == got["visible"] == stored and got["intact"], got
