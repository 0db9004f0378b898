"""One CopyEngine used from two event loops' threads: a region closed on one loop while the other
checks a copy over it, counters written from both, copies tracked while a close snapshots them."""

from __future__ import annotations

import asyncio
import threading

import pytest

from aiokvtier import CopyEngine, HostTierConfig
from aiokvtier._regions import InflightCopies, Landing

from .conftest import copies_back_and_forth
from .test_cancellation import run_script

MiB = 1 << 20
LOOPS = ["asyncio", "uvloop"]


# A copy from loop B's thread into slots of a tier that loop A closes between the copy's checks and its
# tracking: the destination's __array_interface__ is read after the slots were located and holds the
# planner there until the tier is closed (its memory unmapped). Before the fix the memmove read the
# unmapped slots: the process died of SIGSEGV.
CLOSED_BETWEEN_CHECK_AND_TRACK = """
import threading
import numpy as np
from aiokvtier import CopyEngine, CopyPlanError, HostTier, HostTierConfig
from tests.held_copies import copy_on_its_own_loop, while_held
MiB = 1 << 20

class HeldArray:
    def __init__(self, array, gate, entered):
        self.array, self.gate, self.entered = array, gate, entered

    @property
    def __array_interface__(self):
        self.entered.set()
        assert self.gate.wait(30)
        return self.array.__array_interface__

async def main():
    cfg = HostTierConfig(quota=64 * MiB, max_quota=64 * MiB, slot_size=MiB, commit_unit=MiB, fill_chunk=64 * MiB,
                         numa_node=None)
    async with CopyEngine(None) as engine:
        tier = await HostTier.open(cfg)
        await asyncio.wait_for(tier.wait_resident(), 60)
        slots = await tier.allocate(4)
        gate, entered = threading.Event(), threading.Event()
        dst = HeldArray(np.zeros((4, MiB), dtype=np.uint8), gate, entered)
        outcome = []
        other_loop = copy_on_its_own_loop(run, lambda: engine.to_device(tier, slots, dst), outcome, CopyPlanError)
        await while_held(other_loop, lambda: asyncio.wait_for(tier.aclose(), 30), gate, entered)
        print(outcome[0], flush=True)
        stats = engine.statistics()
        print("jobs", stats.jobs_submitted, stats.jobs_completed, flush=True)

run(main)
"""


@pytest.mark.parametrize("loop", LOOPS)
def test_a_tier_closed_on_its_loop_while_another_loop_checks_a_copy_refuses_the_copy(loop: str) -> None:
    out = run_script(CLOSED_BETWEEN_CHECK_AND_TRACK, loop, timeout=120)
    assert "refused: HostTier at" in out and "closed while the copy was checked; nothing was copied" in out, out
    assert "jobs 0 0" in out, out


@pytest.mark.usefixtures("tiny_switch_interval")
def test_one_engine_used_from_two_loops_counts_every_request_of_both() -> None:
    per_loop = 300
    config = HostTierConfig(quota=64 * MiB, max_quota=64 * MiB, slot_size=MiB, commit_unit=MiB, numa_node=None)
    errors: list[BaseException] = []

    async def both() -> None:
        async with CopyEngine(None) as engine:
            one_loop = copies_back_and_forth(engine, config, per_loop, errors)

            threads = [threading.Thread(target=one_loop, args=(name,)) for name in LOOPS]
            for thread in threads:
                thread.start()
            for thread in threads:
                await asyncio.to_thread(thread.join, 120)
            assert not errors, errors
            stats = engine.statistics()
            assert stats.jobs_submitted == stats.jobs_completed == 2 * per_loop
            assert stats.jobs_by_direction == {"h2d": per_loop, "d2h": per_loop, "any": 0}
            assert stats.copies_requested == 2 * 2 * per_loop

    asyncio.run(both())


@pytest.mark.usefixtures("tiny_switch_interval")
def test_every_copy_tracked_from_two_threads_lands_in_a_snapshot_of_a_closing_owner() -> None:
    """Two loops' threads track copies (many, so that the list is compacted often) while the owner's
    thread snapshots: each copy is in exactly one snapshot (the owner waits for it), none is dropped."""
    copies = InflightCopies()
    tracked: list[list[Landing]] = [[], []]

    def tracker(mine: list[Landing]) -> None:
        for _ in range(20000):
            done = Landing()
            copies.track(done)
            mine.append(done)

    threads = [threading.Thread(target=tracker, args=(mine,)) for mine in tracked]
    for thread in threads:
        thread.start()
    waited = 0
    while any(thread.is_alive() for thread in threads):
        for done in copies.snapshot():
            done.set()  # the owner waited for it
            waited += 1
    for thread in threads:
        thread.join()
    for done in copies.snapshot():
        done.set()
        waited += 1
    assert waited == sum(map(len, tracked)) == 40000
    assert all(done.is_set() for mine in tracked for done in mine), "a tracked copy was in no snapshot"
