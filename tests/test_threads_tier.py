"""A HostTier resized, closed and read on its loop while other threads and event loops use it as the
guide and docs/gpu.md allow: a copy checked on another loop's thread (through a shared CopyEngine),
``statistics()`` and ``wait_resident_blocking()`` from any thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from aiokvtier import CopyEngine, HostTier, HostTierConfig, TierClosedError, TierStatistics

from .invariants import assert_no_library_threads, check_tier

MiB = 1 << 20
LOOPS = ["asyncio", "uvloop"]


def run_loop(name: str, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``main()`` on a new event loop of kind ``name`` in this thread."""
    import uvloop

    factory = uvloop.new_event_loop if name == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())


class HeldIds(np.ndarray):  # type: ignore[type-arg]
    """Slot ids whose first boolean selection from thread ``on`` waits for ``gate``: a tier checking
    many ids selects the unallocated ones that way, with its slot map read into numpy meanwhile."""

    gate: threading.Event
    entered: threading.Event
    on: str

    @classmethod
    def of(cls, ids: npt.NDArray[np.int64], on: str) -> HeldIds:
        held = ids.view(cls)
        held.gate, held.entered, held.on = threading.Event(), threading.Event(), on
        return held

    def __getitem__(self, key: Any) -> Any:
        entered = getattr(self, "entered", None)
        if (
            entered is not None
            and not entered.is_set()
            and threading.current_thread().name == self.on
            and isinstance(key, np.ndarray)
            and key.dtype == bool
        ):
            entered.set()
            assert self.gate.wait(30)
        return super().__getitem__(key)


def config(quota: int, max_quota: int) -> HostTierConfig:
    return HostTierConfig(
        quota=quota, max_quota=max_quota, slot_size=MiB, commit_unit=MiB, fill_chunk=64 * MiB, numa_node=None
    )


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize(("quota", "new_quota"), [(128 * MiB, 64 * MiB), (64 * MiB, 128 * MiB)], ids=["shrink", "grow"])
def test_a_resize_while_another_loop_checks_the_slots_of_a_copy_succeeds_and_so_does_the_copy(
    loop: str, quota: int, new_quota: int
) -> None:
    """Loop B's thread checks 40 slot ids of a copy through the shared engine (holding a numpy view of
    the tier's slot map) while loop A resizes the tier. Before the fix the resize raised BufferError
    ("Existing exports of data: object cannot be re-sized") on the owner's loop, half done."""
    outcome: list[str] = []

    async def main() -> None:
        async with CopyEngine(None) as engine, HostTier(config(quota, 128 * MiB)) as tier:
            await asyncio.wait_for(tier.wait_resident(), 60)
            ids = HeldIds.of(await tier.allocate_ids(40), on="other-loop")
            for slot in ids.tolist():
                tier.view(slot)[:8] = slot.to_bytes(8, "little")
            page = np.zeros((40, 4096), dtype=np.uint8)

            def other_loop() -> None:
                async def copy() -> None:
                    try:
                        await engine.to_device(tier, ids, page)
                        outcome.append("copied")
                    except Exception as exc:
                        outcome.append(f"refused: {exc!r}")

                run_loop(loop, copy)

            thread = threading.Thread(target=other_loop, name="other-loop")
            thread.start()
            try:
                assert await asyncio.to_thread(ids.entered.wait, 30)
                await asyncio.wait_for(tier.resize(new_quota), 30)
            finally:
                ids.gate.set()
                await asyncio.to_thread(thread.join, 30)
            assert not thread.is_alive()
            assert outcome == ["copied"], outcome
            assert [int.from_bytes(row[:8].tobytes(), "little") for row in page] == ids.tolist()
            s = tier.statistics()
            assert (s.quota, s.slots_total, s.slots_allocated) == (new_quota, new_quota // MiB, 40)
            await asyncio.wait_for(tier.wait_resident(), 60)
            check_tier(tier, settled=True)
            # The slot map works on after the resize: every free slot can be taken and given back.
            rest = await tier.allocate_ids(s.slots_free)
            tier.free_many(rest)
            tier.free_many(ids)
            assert tier.statistics().slots_free == new_quota // MiB

    run_loop(loop, main)


def _torn(s: TierStatistics) -> list[str]:
    """What a snapshot says that no moment of the tier had."""
    wrong = []
    if s.slots_allocated + s.slots_free != s.slots_total:
        wrong.append(f"{s.slots_allocated} allocated + {s.slots_free} free != {s.slots_total} slots")
    if s.quota != s.slots_total * s.slot_size:
        wrong.append(f"quota {s.quota} does not hold {s.slots_total} slots of {s.slot_size}")
    return wrong


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.usefixtures("tiny_switch_interval")
def test_statistics_read_from_a_thread_while_the_loop_allocates_frees_and_resizes_are_each_one_moment(
    loop: str,
) -> None:
    torn: list[str] = []
    errors: list[BaseException] = []

    async def main() -> None:
        tier = await HostTier.open(config(64 * MiB, 96 * MiB))
        await asyncio.wait_for(tier.wait_resident(), 60)
        running = threading.Event()
        running.set()

        def reader() -> None:
            try:
                while running.is_set():
                    torn.extend(_torn(tier.statistics()))
            except BaseException as exc:
                errors.append(exc)

        watcher = threading.Thread(target=reader)
        watcher.start()
        try:
            for round in range(30):
                many = await tier.allocate_ids(40)  # past the few ids checked one by one
                few = [tier.allocate_nowait() for _ in range(3)]
                for slot in few:
                    tier.free(slot)
                tier.free_many(many)
                await tier.resize((96 if round % 2 else 48) * MiB)
                await tier.wait_resident()
        finally:
            running.clear()
            await asyncio.to_thread(watcher.join, 30)
            await tier.aclose()
        # statistics() after close, from a thread, too.
        torn.extend(_torn(await asyncio.to_thread(tier.statistics)))

    run_loop(loop, main)
    assert not errors, errors
    assert not torn, sorted(set(torn))[:5]
    assert_no_library_threads()


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.usefixtures("tiny_switch_interval")
def test_statistics_read_from_a_thread_while_tiers_open_and_close_answer_or_say_the_tier_is_not_open(
    loop: str,
) -> None:
    """A reader polls the tier of the moment while the loop opens and closes tiers one after another:
    every answer adds up, and a tier not open yet says so with TierClosedError, nothing else."""
    current: list[HostTier] = []
    answers: list[TierStatistics] = []
    errors: list[BaseException] = []
    running = threading.Event()
    running.set()

    def reader() -> None:
        while running.is_set():
            if not current:
                continue
            try:
                answers.append(current[-1].statistics())
                repr(current[-1])
            except TierClosedError as exc:
                if "is new" not in str(exc) and "is opening" not in str(exc):
                    errors.append(exc)
            except BaseException as exc:
                errors.append(exc)

    async def main() -> None:
        watcher = threading.Thread(target=reader)
        watcher.start()
        try:
            for _ in range(15):
                tier = HostTier(config(8 * MiB, 8 * MiB))
                current.append(tier)
                async with tier:
                    await tier.wait_resident()
                    slots = await tier.allocate(3)
                    tier.free_many(slots[1:])
        finally:
            running.clear()
            await asyncio.to_thread(watcher.join, 30)

    run_loop(loop, main)
    assert not errors, errors[:3]
    assert answers and not [wrong for s in answers for wrong in _torn(s)]
    assert any(s.closed for s in answers) or current[-1].statistics().closed
    assert_no_library_threads()
