"""fork() while a library thread of the parent holds the lock of the table of open regions (a staging
buffer's close unregistering it on its thread): the child opens tiers and staging buffers of its own,
as the guide says to, instead of waiting for good on a lock whose holder does not exist there."""

from __future__ import annotations

import pytest

from .test_cancellation import run_script

LOOPS = ["asyncio", "uvloop"]

# A trace function on the library's threads holds the one that republishes the open regions inside its
# lock (the line that builds the tuple) until the child has answered: deterministic where the window
# is otherwise a few bytecodes.
FORK_WHILE_UNREGISTERING = """
import os, signal, threading
from aiokvtier import HostTier, HostTierConfig, StaticHostMem
from tests.held_copies import in_a_fork
MiB = 1 << 20
GATE, ENTERED = threading.Event(), threading.Event()
LOOP = sys.argv[1]

def hold_in_the_lock(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "_republish" and frame.f_code.co_filename.endswith("_regions.py"):
        def line(frame, event, arg):
            if event == "line" and "tuple(" in (open(frame.f_code.co_filename).readlines()[frame.f_lineno - 1]):
                if not ENTERED.is_set():
                    ENTERED.set()
                    assert GATE.wait(30)
            return line
        return line
    return None

async def in_the_child():  # blocks its loop: nothing else runs on it in the child
    out = []

    async def open_own():
        cfg = HostTierConfig(quota=4 * MiB, max_quota=4 * MiB, slot_size=MiB, commit_unit=MiB, numa_node=None)
        async with StaticHostMem(MiB) as stage, HostTier(cfg) as tier:
            await tier.wait_resident()
            out.append(f"opened {stage.size} {tier.statistics().slots_total}")

    def runner():
        try:
            run(open_own)
        except BaseException as exc:
            out.append(repr(exc))

    thread = threading.Thread(target=runner, daemon=True)
    thread.start()
    thread.join(20)
    print("child", out[0] if out else "hung", flush=True)

async def main():
    threading.settrace(hold_in_the_lock)  # threads started from here on: the staging buffer's
    stage = await StaticHostMem.open(MiB)
    threading.settrace(None)
    closing = asyncio.ensure_future(stage.aclose())
    assert await asyncio.to_thread(ENTERED.wait, 30)
    if not await in_a_fork(in_the_child, 30):
        print("child killed", flush=True)
    GATE.set()
    await asyncio.wait_for(closing, 30)
    print("parent closed", stage.released, flush=True)

run(main)
"""


@pytest.mark.parametrize("loop", LOOPS)
def test_a_child_forked_while_a_region_unregisters_opens_regions_of_its_own(loop: str) -> None:
    out = run_script(FORK_WHILE_UNREGISTERING, loop, timeout=120)
    assert "child opened 1048576 4" in out, out
    assert "parent closed True" in out, out
