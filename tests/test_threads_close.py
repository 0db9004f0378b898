"""Closes from another event loop: an engine (which serves several loops) or a staging buffer closed
from two loops at once, each close returning once the one teardown is done; a tier closed from a loop
other than its own while its own runs is refused, changing nothing; closed from a new loop once its own
has ended, it closes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import pytest

from aiokvtier import CopyEngine, HostTier, HostTierConfig, StaticHostMem
from aiokvtier.testing import RecordingBackend

from .invariants import assert_no_library_threads, check_tier

MiB = 1 << 20
LOOPS = ["asyncio", "uvloop"]


def run_loop(name: str, main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``main()`` on a new event loop of kind ``name`` in this thread."""
    import uvloop

    factory = uvloop.new_event_loop if name == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())


def config() -> HostTierConfig:
    return HostTierConfig(quota=8 * MiB, max_quota=8 * MiB, slot_size=MiB, commit_unit=MiB, numa_node=None)


def close_on_another_loop(loop: str, owner: Any, outcome: list[str]) -> threading.Thread:
    """A thread that runs ``owner.aclose()`` on a loop of its own, bounded, and notes how it ended."""

    def other() -> None:
        async def close() -> None:
            try:
                await asyncio.wait_for(owner.aclose(), 30)
                outcome.append(f"closed: {owner.state}")
            except BaseException as exc:
                outcome.append(f"failed: {exc!r}")

        run_loop(loop, close)

    thread = threading.Thread(target=other)
    thread.start()
    return thread


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("what", ["engine", "staging"])
def test_an_owner_closed_from_two_loops_at_once_closes_once_and_both_return(loop: str, what: str) -> None:
    """The owner's loop closes it while a copy over it is held in flight (so its teardown waits); another
    loop's close meanwhile waits for that teardown. Before the fix it raised RuntimeError at once: it
    awaited the first loop's future ("attached to a different loop")."""
    outcome: list[str] = []
    backend = RecordingBackend(hold=True)

    async def main() -> None:
        async with HostTier(config()) as tier:
            await tier.wait_resident()
            slots = await tier.allocate(2)
            engine = await CopyEngine.open(None, backend=backend)
            stage = await StaticHostMem.open(2 * MiB)
            # An array made over the staging buffer's memory: the copy holds its close as it does the engine's.
            page = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * (2 * MiB)).from_address(stage.address))
            copy = engine.begin(tier, slots, page.reshape(2, MiB), "d2h")
            await asyncio.wait_for(copy.submitted, 30)
            owner: Any = engine if what == "engine" else stage
            closing = asyncio.ensure_future(owner.aclose())
            try:
                await asyncio.sleep(0.05)
                assert owner.state == "closing" and not closing.done()
                thread = close_on_another_loop(loop, owner, outcome)
                await asyncio.sleep(0.1)
                assert not outcome, outcome  # it waits for the teardown under way
            finally:
                assert backend.release() == 1  # whatever failed: nothing may wait for the held copy for good
            await asyncio.wait_for(copy.done, 30)
            await asyncio.wait_for(closing, 30)
            await asyncio.to_thread(thread.join, 30)
            assert outcome == ["closed: closed"], outcome
            del page
            await asyncio.wait_for(engine.aclose(), 30)
            await asyncio.wait_for(stage.aclose(), 30)
            assert stage.released
            check_tier(tier, settled=True)

    run_loop(loop, main)
    assert_no_library_threads()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_tier_closed_from_another_loop_while_its_own_runs_is_refused_and_nothing_changes(loop: str) -> None:
    outcome: list[str] = []

    async def main() -> None:
        tier = await HostTier.open(config())
        await tier.wait_resident()
        slot = await tier.allocate()
        thread = close_on_another_loop(loop, tier, outcome)
        await asyncio.to_thread(thread.join, 30)
        assert len(outcome) == 1 and outcome[0].startswith("failed: RuntimeError("), outcome
        assert "belongs to the event loop that opened it" in outcome[0], outcome
        assert tier.state == "open"
        tier.view(slot)[:4] = b"kept"
        assert bytes(tier.view(slot)[:4]) == b"kept"
        check_tier(tier, settled=True)
        await asyncio.wait_for(tier.aclose(), 30)
        assert tier.released

    run_loop(loop, main)
    assert_no_library_threads()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_tier_closed_from_a_new_loop_once_its_own_ended_closes(loop: str) -> None:
    async def open_one() -> HostTier:
        tier = await HostTier.open(config())
        await tier.wait_resident()
        await tier.allocate()
        return tier

    tier: HostTier = run_loop(loop, open_one)
    run_loop(loop, tier.aclose)
    assert tier.state == "closed" and tier.released
    assert_no_library_threads()
