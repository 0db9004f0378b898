"""A BlockStore whose CopyEngine is shared with another event loop, which closes the engine while the
store queues a copy through it: the store's call fails with TierClosedError and the store is left whole
(no claim, no pin, no slot held for a block that is not there), where before both hung for good."""

from __future__ import annotations

import pytest

from .test_cancellation import run_script

LOOPS = ["asyncio", "uvloop"]

# The store's tier holds the store's loop at the copy's tracking (its ``copies``, a public property)
# until the engine's loop has closed the engine.
ENGINE_CLOSED_UNDER_THE_STORE = """
import gc, os, threading
import numpy as np
from aiokvtier import BlockStore, CopyEngine, HostTier, HostTierConfig, StaticHostMem, TierClosedError
from aiokvtier._store._transfers import Transfers
Transfers.host_engines = True  # the engine path without a GPU (tests/test_store_attack.py does the same)
MiB = 1 << 20
LOOP, CALL = sys.argv[1].split()
GATE, ENTERED, HOLD = threading.Event(), threading.Event(), threading.Event()

from tests.held_copies import HeldTier
HeldTier.hold = staticmethod(lambda: HOLD.is_set() and (HOLD.clear() or True))
HeldTier.gate, HeldTier.entered = GATE, ENTERED

def new_loop(main):
    if LOOP == "uvloop":
        import uvloop
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r: r.run(main())
    else:
        asyncio.run(main())

ENGINE = []
OPENED, CLOSED = threading.Event(), threading.Event()

def engine_loop():
    async def main():
        engine = await CopyEngine.open(None)
        ENGINE.append(engine)
        OPENED.set()
        await asyncio.to_thread(ENTERED.wait, 30)
        await engine.aclose()
        CLOSED.set()
        GATE.set()
    new_loop(main)

async def main():
    other = threading.Thread(target=engine_loop, daemon=True)
    other.start()
    assert await asyncio.to_thread(OPENED.wait, 30)
    engine = ENGINE[0]
    cfg = HostTierConfig(quota=8 * MiB, max_quota=8 * MiB, slot_size=MiB, commit_unit=MiB, numa_node=None)
    tier = await HeldTier.open(cfg)
    await tier.wait_resident()
    stage = await StaticHostMem.open(4 * MiB)
    pages = np.frombuffer(stage.view(), dtype=np.uint8).reshape(4, MiB)
    pages[:] = np.arange(4, dtype=np.uint8)[:, None]
    store = await BlockStore.open(tier, engine)
    await store.store([1, 2], pages[:2])
    HOLD.set()
    try:
        if CALL == "store":
            await asyncio.wait_for(store.store([3, 4], pages[2:]), 30)
        else:
            await asyncio.wait_for(store.load([1, 2], pages[2:]), 30)
        print("outcome done", flush=True)
    except TierClosedError as exc:
        print("outcome refused:", exc, flush=True)
    except TimeoutError:
        print("outcome hung", flush=True)
        sys.stdout.flush()
        os._exit(0)
    await asyncio.to_thread(other.join, 30)
    print("engine closed", CLOSED.is_set(), flush=True)
    try:
        store.check_invariants(sole_user=True)
        print("store whole, blocks", sorted(store.keys()), "in flight", store.statistics().in_flight, flush=True)
    except AssertionError as exc:
        print("store broken:", exc, flush=True)
    await asyncio.wait_for(store.aclose(), 30)
    del pages
    await asyncio.wait_for(stage.aclose(), 30)
    await asyncio.wait_for(tier.aclose(), 30)
    gc.collect()  # the staging buffer goes with the last view of it: the refused call's frames held some
    for _ in range(500):
        if not [t for t in threading.enumerate() if t.name.startswith("aiokvtier-")]:
            break
        await asyncio.sleep(0.01)
    print("threads left", [t.name for t in threading.enumerate() if t.name.startswith("aiokvtier-")], flush=True)

new_loop(main)
"""


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("call", ["store", "load"])
def test_a_store_whose_engine_another_loop_closes_under_a_copy_fails_the_call_and_stays_whole(
    loop: str, call: str
) -> None:
    out = run_script(ENGINE_CLOSED_UNDER_THE_STORE, f"{loop} {call}", timeout=90)
    assert "outcome refused: the CopyEngine is closed" in out, out
    assert "engine closed True" in out, out
    assert "store whole, blocks [1, 2] in flight 0" in out, out
    assert "threads left []" in out, out
