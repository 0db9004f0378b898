"""A view of a HostTier's slot or of a StaticHostMem made on another thread while the owner's loop
closes it: the view is refused, or the memory stays mapped until it is released; never a view over
unmapped memory (run in a subprocess: that killed the process with SIGSEGV)."""

from __future__ import annotations

import pytest

from .test_cancellation import run_script

LOOPS = ["asyncio", "uvloop"]

# The viewing thread is held, by a trace function of its own, as it enters the ledger that counts the
# views (past the owner's open check) until the owner's close has run its teardown. The window is a few
# bytecodes wide without the trace; with it, deterministic.
VIEW_WHILE_CLOSING = """
import os, sys, threading
from aiokvtier import HostTier, HostTierConfig, StaticHostMem, TierClosedError
from tests.held_copies import while_held
MiB = 1 << 20
GATE, ENTERED = threading.Event(), threading.Event()
LOOP, WHICH = sys.argv[1].split()

def hold_at_the_ledger(frame, event, arg):
    code = frame.f_code
    if event == "call" and code.co_name == "view" and code.co_filename.endswith("_views.py"):
        ENTERED.set()
        assert GATE.wait(30)
    return None

async def main():
    if WHICH == "tier":
        cfg = HostTierConfig(quota=4 * MiB, max_quota=4 * MiB, slot_size=MiB, commit_unit=MiB, numa_node=None)
        owner = await HostTier.open(cfg)
        await owner.wait_resident()
        slot = await owner.allocate()
        make_view = lambda: owner.view(slot)
    else:
        owner = await StaticHostMem.open(4 * MiB)
        make_view = owner.view
    outcome = []

    def viewer():
        sys.settrace(hold_at_the_ledger)
        try:
            view = make_view()
        except TierClosedError as exc:
            outcome.append("refused: " + str(exc))
            return
        finally:
            sys.settrace(None)
        view[:] = b"x" * len(view)  # over unmapped memory before the fix: SIGSEGV
        outcome.append("written, released " + str(owner.released))
        view.release()
        del view

    await while_held(viewer, lambda: asyncio.wait_for(owner.aclose(), 30), GATE, ENTERED)
    print("outcome", outcome[0], flush=True)
    for _ in range(500):  # a view outlives the close: the release comes once it is dropped
        if owner.released and not [t for t in threading.enumerate() if t.name.startswith("aiokvtier-")]:
            break
        await asyncio.sleep(0.01)
    print("released", owner.released, flush=True)
    print("threads left", [t.name for t in threading.enumerate() if t.name.startswith("aiokvtier-")], flush=True)

import asyncio
if LOOP == "uvloop":
    import uvloop
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r: r.run(main())
else:
    asyncio.run(main())
raise SystemExit(0)
"""


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("owner", ["tier", "static"])
def test_a_view_made_on_another_thread_while_its_owner_closes_is_refused(loop: str, owner: str) -> None:
    out = run_script(VIEW_WHILE_CLOSING, f"{loop} {owner}", timeout=90)
    name = "HostTier" if owner == "tier" else "StaticHostMem"
    assert f"outcome refused: the {name} is closed" in out, out
    assert "released True" in out, out
    assert "threads left []" in out, out
