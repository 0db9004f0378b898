"""One CopyEngine used from several threads and event loops, attacked: the engine closed on its loop
while another loop's thread queues a copy, and ``statistics()`` read from a thread while two loops copy."""

from __future__ import annotations

import asyncio
import threading

import pytest

from aiokvtier import CopyEngine, CopyStatistics, HostTierConfig

from .conftest import copies_back_and_forth
from .test_cancellation import run_script

MiB = 1 << 20
LOOPS = ["asyncio", "uvloop"]


# The engine closed on loop A while loop B's thread is between the engine's open check and the
# queueing of its copy: the tier's ``copies`` (a public property) holds B there, at the copy's
# tracking, until the close has stopped the engine's threads. Before the fix the copy was queued
# behind the submit thread's stop: nobody ran it, B's await hung for good, and so did the tier's
# close (it waits for every copy tracked over it).
ENGINE_CLOSED_WHILE_QUEUEING = """
import os, threading
import numpy as np
from aiokvtier import CopyEngine, HostTier, HostTierConfig, TierClosedError
MiB = 1 << 20

from tests.held_copies import HeldTier, copy_on_its_own_loop, once, while_held
HeldTier.hold = staticmethod(once(lambda: threading.current_thread().name == "other-loop"))
GATE, ENTERED = HeldTier.gate, HeldTier.entered

async def main():
    cfg = HostTierConfig(quota=64 * MiB, max_quota=64 * MiB, slot_size=MiB, commit_unit=MiB, numa_node=None)
    tier = await HeldTier.open(cfg)
    await asyncio.wait_for(tier.wait_resident(), 60)
    slots = await tier.allocate(2)
    engine = await CopyEngine.open(None)
    page = np.zeros((2, 4096), dtype=np.uint8)
    outcome = []
    other_loop = copy_on_its_own_loop(run, lambda: engine.to_host(tier, slots, page), outcome, TierClosedError)
    close = lambda: asyncio.wait_for(engine.aclose(), 30)
    thread = await while_held(other_loop, close, GATE, ENTERED, join=10, name="other-loop", daemon=True)
    print("outcome", "hung" if thread.is_alive() else outcome[0], flush=True)
    # A copy left tracked would hold the tier's close for good (a close is not cancellable).
    print("copies over the tier", len(tier.copies), flush=True)
    if not len(tier.copies):
        await asyncio.wait_for(tier.aclose(), 30)
        print("tier closed", flush=True)
    stats = engine.statistics()
    print("jobs", stats.jobs_submitted, stats.jobs_completed, flush=True)
    left = [t.name for t in threading.enumerate() if t.name.startswith("aiokvtier-")]
    print("threads left", left, flush=True)
    sys.stdout.flush()
    os._exit(0)  # a hung thread must not hold the process

run(main)
"""


@pytest.mark.parametrize("loop", LOOPS)
def test_an_engine_closed_while_another_loop_queues_a_copy_refuses_it_and_nothing_hangs(loop: str) -> None:
    out = run_script(ENGINE_CLOSED_WHILE_QUEUEING, loop, timeout=90)
    assert "outcome refused: the CopyEngine is closed" in out, out
    assert "copies over the tier 0" in out and "tier closed" in out, out
    assert "jobs 0 0" in out, out
    assert "threads left []" in out, out


def _torn(s: CopyStatistics) -> list[str]:
    """What a snapshot says that no moment of the engine had."""
    wrong = []
    if s.jobs_completed > s.jobs_submitted:
        wrong.append(f"{s.jobs_completed} jobs completed of {s.jobs_submitted} submitted")
    if sum(s.jobs_by_direction.values()) != s.jobs_submitted:
        wrong.append(f"jobs by direction {s.jobs_by_direction} do not add up to {s.jobs_submitted}")
    if sum(s.bytes_by_direction.values()) != s.bytes_copied:
        wrong.append(f"bytes by direction {s.bytes_by_direction} do not add up to {s.bytes_copied}")
    if s.latency_count > s.jobs_completed:
        wrong.append(f"{s.latency_count} latencies for {s.jobs_completed} completed jobs")
    if s.copies_requested != 2 * s.jobs_submitted:  # every request here copies two slots
        wrong.append(f"{s.copies_requested} copies requested by {s.jobs_submitted} jobs of two")
    return wrong


@pytest.mark.usefixtures("tiny_switch_interval")
def test_statistics_read_from_a_thread_while_two_loops_copy_are_each_one_moment() -> None:
    per_loop = 400
    config = HostTierConfig(quota=64 * MiB, max_quota=64 * MiB, slot_size=MiB, commit_unit=MiB, numa_node=None)
    errors: list[BaseException] = []
    torn: list[str] = []

    async def both() -> None:
        async with CopyEngine(None) as engine:
            copying = threading.Event()

            one_loop = copies_back_and_forth(engine, config, per_loop, errors)

            def reader() -> None:
                while copying.is_set():
                    torn.extend(_torn(engine.statistics()))

            copying.set()
            watcher = threading.Thread(target=reader)
            watcher.start()
            threads = [threading.Thread(target=one_loop, args=(name,)) for name in LOOPS]
            for thread in threads:
                thread.start()
            for thread in threads:
                await asyncio.to_thread(thread.join, 120)
            copying.clear()
            await asyncio.to_thread(watcher.join, 30)
            assert not errors, errors
            assert not torn, torn[:5]
            final = engine.statistics()
            assert final.jobs_submitted == final.jobs_completed == final.latency_count == 2 * per_loop
            assert not _torn(final)

    asyncio.run(both())
