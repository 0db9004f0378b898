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
import itertools
import json
import os
import signal
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

import numpy as np
import pytest

from aiokvtier import AttachedPool, CopyPlanError, HostTier, HostTierConfig, StaticHostMem
from tests.helpers import eventually
from tests.test_pool import ENV, ROOT, Child, loop_kind, sock
from tests.test_pool_attack import rig, settle
from tests.test_store import Gate, held, hold

__all__ = ["held", "sock"]  # the fixtures, used by name

T = TypeVar("T")
SLOT = 64 << 10
KEYS = 4
TIMEOUT = 30.0
POOL = {"quota": "4MiB", "max_quota": "4MiB", "slot_size": "64KiB"}


async def bounded(aw: Awaitable[T]) -> T:
    return await asyncio.wait_for(aw, TIMEOUT)


def raw(address: int, rows: int, row: int = SLOT) -> np.ndarray:
    """A writable ``(rows, row)`` array over the memory at ``address``, which it does not keep mapped."""
    return np.frombuffer((ctypes.c_ubyte * (rows * row)).from_address(address), dtype=np.uint8).reshape(rows, row)


def pattern(n: int, seed: int, row: int = SLOT) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, row), dtype=np.uint8)


def keys_of(name: str, n: int = KEYS) -> list[bytes]:
    return [f"{name}-{i}".encode() for i in range(n)]


# -- the region changes during the owner's round trip (a child process: a copy not refused kills it) ---


def tier_config() -> HostTierConfig:
    return HostTierConfig(quota=16 * SLOT, max_quota=16 * SLOT, slot_size=SLOT, commit_unit=4 * SLOT)


async def changed_during_round_trip(path: str, op: str, form: str, change: str) -> dict[str, Any]:
    """In a child: an owner in its own process, stopped while this process's ``op`` waits for its answer;
    meanwhile the pages' StaticHostMem closes (``change`` "close"), or closes and another is mapped
    ("remap", at its address where the kernel gives it back), or the HostTier they lie in shrinks past
    them ("shrink"). What the call did, and what the owner holds after it."""
    owner = await Child.start("pool_owner.py", path, "16MiB", "64KiB")
    other: HostTier | None = None
    new: StaticHostMem | None = None
    try:
        pid = int((await owner.event("serving"))["pid"])
        async with AttachedPool(path) as pool:
            keys = keys_of(op)
            if op == "load":
                await bounded(pool.store(keys, pattern(KEYS, 1)))
            if change == "shrink":
                other = await bounded(HostTier.open(tier_config()))
                await bounded(other.wait_resident())
                region: HostTier | StaticHostMem = other
                at = other.base_address + 12 * SLOT  # committed, in no slot; past the shrink below
            else:
                region = await bounded(StaticHostMem.open(KEYS * SLOT))
                at = region.address
            rows = raw(at, KEYS)
            rows[:] = pattern(KEYS, 2)
            pages: Any = rows if form == "array" else list(rows)
            os.kill(pid, signal.SIGSTOP)
            try:
                call = asyncio.ensure_future(pool.store(keys, pages) if op == "store" else pool.load(keys, pages))
                for _ in range(5):  # the request leaves; its answer waits for the owner
                    await asyncio.sleep(0)
                assert not call.done()
                if change == "shrink":
                    await bounded(region.resize(8 * SLOT))
                else:
                    await bounded(region.aclose())
                if change == "remap":
                    new = await bounded(StaticHostMem.open(KEYS * SLOT))
                    raw(new.address, KEYS)[:] = 0xAB
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
                "new_untouched": new is None or bool((raw(new.address, KEYS) == 0xAB).all()),
            }
    finally:
        for closing in (new, other):
            if closing is not None:
                await bounded(closing.aclose())
        await owner.close()


CHILD = """
import json, sys
from tests.conftest import run_on_new_loop
from tests.test_pool_located_attack import changed_during_round_trip

async def main():
    print(json.dumps(await changed_during_round_trip(*sys.argv[2:])), flush=True)

run_on_new_loop(sys.argv[1], main)
"""

REFUSED = {"close": "closed after the pages were checked", "remap": "closed after the pages were checked"}
REFUSED["shrink"] = "committed range"


@pytest.mark.parametrize("change", ["close", "remap", "shrink"])
@pytest.mark.parametrize("form", ["array", "list"])
@pytest.mark.parametrize("op", ["store", "load"])
async def test_pages_whose_region_changed_during_the_round_trip_are_refused(
    sock: str, op: str, form: str, change: str
) -> None:
    """The owner answers the claim (store) or the pin (load) only after the pages' StaticHostMem closed (and
    another was mapped), or the tier they lie in shrank past them: the call is refused, nothing is stored or
    loaded (a buffer mapped since is not written), and the owner holds no claim, pin or slot for it."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        loop_kind(),
        sock,
        op,
        form,
        change,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=ENV,
        cwd=ROOT,
    )
    out, err = await bounded(child.communicate())
    assert child.returncode == 0, f"the child ended with {child.returncode}: {err.decode()[-3000:]}"
    got = json.loads(out.decode().splitlines()[-1])
    assert got["outcome"].startswith("refused: ") and REFUSED[change] in got["outcome"], got
    stored = KEYS if op == "load" else 0  # a load's blocks were stored before; a refused store adds none
    assert got["claims"] == 0 and got["pinned"] == 0 and got["attached"] == 0, got
    assert got["blocks"] == got["allocated"] == got["visible"] == stored and got["intact"], got
    assert got["new_untouched"], got


# -- in this process: the region closes as the call runs, the call cancelled --------------------------


DELAYS = (0.0, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01)
"""``wait_for`` timeouts swept over a call (0: cancelled before it begins, its pages never read)."""
CLOSE_AFTER = (1, 3, 6, 12)
"""Turns of the loop between the call's start and the region's close: the call located its pages in the
first (a region closed before a call begins is the caller's memory freed, which no check can see)."""


async def outcome(call: Awaitable[Any]) -> str:
    try:
        await bounded(call)
    except CopyPlanError as exc:
        assert "closed after the pages were checked" in str(exc) or "is closing" in str(exc), exc
        return "refused"
    except TimeoutError:
        return "cancelled"
    return "done"


async def whole(pool: AttachedPool, keys: list[bytes], want: np.ndarray) -> int:
    """How many leading keys are visible, each loaded whole as ``want``'s row."""
    visible = await bounded(pool.lookup(keys))
    if visible:
        got = np.zeros((visible, SLOT), dtype=np.uint8)
        await bounded(pool.load(keys[:visible], got))
        assert (got == want[:visible]).all(), "a visible block is not what was stored"
    return visible


@pytest.mark.parametrize("form", ["array", "list"])
async def test_a_store_cancelled_while_its_region_closes_leaves_no_claim_and_no_half_block(
    sock: str, form: str
) -> None:
    """Each store of pages over a StaticHostMem is swept by ``wait_for`` while the buffer closes a few turns
    in: refused, cancelled or done, the owner afterwards holds no claim or slot for it, and its keys are
    all visible and whole, or none is (a refused or cancelled store may have committed nothing but whole
    blocks)."""
    seen: set[str] = set()
    async with rig(sock, config=POOL) as (pool, (a,)):
        await bounded(a.wait_resident())
        for n, (delay, turns) in enumerate(itertools.product(DELAYS, CLOSE_AFTER)):
            mem = await bounded(StaticHostMem.open(KEYS * SLOT))
            want = pattern(KEYS, n)
            rows = raw(mem.address, KEYS)
            rows[:] = want
            keys = keys_of(f"s{n}")
            pages: Any = rows if form == "array" else list(rows)
            call = asyncio.ensure_future(asyncio.wait_for(a.store(keys, pages), delay))
            for _ in range(turns):
                await asyncio.sleep(0)
            await bounded(mem.aclose())
            got = await outcome(call)
            seen.add(got)
            del pages, rows
            await settle(pool)
            visible = await whole(a, keys, want)
            assert visible == (KEYS if got == "done" else 0) or got == "cancelled", (got, visible)
            await bounded(a.discard(keys))
            await settle(pool)
    assert "refused" in seen, seen


@pytest.mark.parametrize("form", ["array", "list"])
async def test_a_load_cancelled_while_its_region_closes_leaves_no_pin(sock: str, form: str) -> None:
    """Each load into pages over a StaticHostMem is swept by ``wait_for`` while the buffer closes a few turns
    in: refused, cancelled or done, the owner afterwards holds no pin, and the blocks stay whole."""
    seen: set[str] = set()
    async with rig(sock, config=POOL) as (pool, (a,)):
        keys = keys_of("l")
        want = pattern(KEYS, 9)
        await bounded(a.store(keys, want))
        for delay, turns in itertools.product(DELAYS, CLOSE_AFTER):
            mem = await bounded(StaticHostMem.open(KEYS * SLOT))
            rows = raw(mem.address, KEYS)
            pages: Any = rows if form == "array" else list(rows)
            call = asyncio.ensure_future(asyncio.wait_for(a.load(keys, pages), delay))
            for _ in range(turns):
                await asyncio.sleep(0)
            await bounded(mem.aclose())
            seen.add(await outcome(call))
            del pages, rows
            await settle(pool)
            assert await whole(a, keys, want) == KEYS
    assert "refused" in seen, seen


# -- in this process: a copy in flight holds the region's close -----------------------------------------


@pytest.mark.parametrize("op", ["store", "load"])
async def test_a_copy_in_flight_holds_its_regions_close_until_it_landed(sock: str, held: Gate, op: str) -> None:
    """The pool's copy of pages over a StaticHostMem is held on this process's thread: the buffer's close
    waits for it (the memory stays mapped under the copy), then the copy lands whole."""
    async with rig(sock, config=POOL) as (pool, (a,)):
        keys = keys_of(op)
        want = pattern(KEYS, 3)
        if op == "load":
            held.open.set()
            await bounded(a.store(keys, want))
            hold(held)
        mem = await bounded(StaticHostMem.open(KEYS * SLOT))
        rows = raw(mem.address, KEYS)
        rows[:] = want if op == "store" else 0
        # What the load wrote is read through a view taken now, which keeps the memory mapped past the
        # close (``rows`` does not: the close releases it as soon as the copy landed).
        kept = mem.view() if op == "load" else None
        call = asyncio.ensure_future(a.store(keys, rows) if op == "store" else a.load(keys, rows))
        await bounded(held.started())
        closing = asyncio.ensure_future(mem.aclose())
        await asyncio.sleep(0.05)
        assert not closing.done() and not mem.released and len(mem.copies) == 1
        await held.release()
        await bounded(call)
        del rows
        await bounded(closing)
        assert len(mem.copies) == 0
        if kept is not None:
            assert (np.frombuffer(kept, dtype=np.uint8).reshape(KEYS, SLOT) == want).all()
            kept.release()
        await eventually(lambda: mem.released)
        await settle(pool)
        assert await whole(a, keys, want) == KEYS
