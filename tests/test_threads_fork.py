"""fork() while another event loop's thread is inside a CopyEngine call (queueing a copy, under the
engine's lock): the child's ``statistics()`` of the parent's engine and tier answer (they take no lock
that the fork could leave held), and every other call says that the objects are the parent's."""

from __future__ import annotations

import pytest

from .test_cancellation import run_script

LOOPS = ["asyncio", "uvloop"]

# The other loop's copy waits inside the engine's queueing step: the backend's mark() of its after=
# stream (recorded on the caller's thread, under the lock the close takes too) blocks on a gate.
FORK_WHILE_QUEUEING = """
import os, signal, threading, time
from aiokvtier import CopyEngine, HostTier, HostTierConfig, TierClosedError
from aiokvtier.testing import RecordingBackend
from tests.held_copies import copy_on_its_own_loop, in_a_fork, while_held
MiB = 1 << 20
GATE, ENTERED = threading.Event(), threading.Event()

class HeldMarks(RecordingBackend):
    def mark(self, stream):
        ENTERED.set()
        assert GATE.wait(30)
        return super().mark(stream)

async def main():
    cfg = HostTierConfig(quota=8 * MiB, max_quota=8 * MiB, slot_size=MiB, commit_unit=MiB, numa_node=None)
    tier = await HostTier.open(cfg)
    await tier.wait_resident()
    slots = await tier.allocate(2)
    engine = await CopyEngine.open(0, backend=HeldMarks())  # the backend issues nothing: no GPU needed
    device_side = [0x7E0000000000, 0x7E0000100000]  # addresses the backend never touches
    outcome = []
    other_loop = copy_on_its_own_loop(run, lambda: engine.to_device(tier, slots, device_side, after=7), outcome)

    async def in_the_child():
        s, t = engine.statistics(), tier.statistics()
        print("child statistics", s.jobs_submitted, s.jobs_completed, t.slots_allocated, flush=True)
        try:
            await engine.to_device(tier, slots, device_side)
        except TierClosedError as exc:
            print("child refused:", exc, flush=True)

    async def fork():
        if not await in_a_fork(in_the_child, 20):
            print("child hung", flush=True)

    await while_held(other_loop, fork, GATE, ENTERED)
    print("parent", outcome, engine.statistics().jobs_completed, flush=True)
    await engine.aclose()
    await tier.aclose()

run(main)
"""


@pytest.mark.parametrize("loop", LOOPS)
def test_a_fork_while_another_loop_queues_a_copy_leaves_the_childs_statistics_answering(loop: str) -> None:
    out = run_script(FORK_WHILE_QUEUEING, loop, timeout=90)
    assert "child statistics 0 0 2" in out, out
    assert "child refused: this CopyEngine was opened in process" in out, out
    assert "parent ['copied'] 1" in out, out
