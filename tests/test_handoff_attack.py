"""The copies' light hand-off holds under attack: after any mix of copies (host-only and deferred ones),
cancelled callers, failing and refused copies and closes racing them, next to a loop that never idles,
no hold is left behind (the loop's hand-off stops ticking) and no future stays pending; a copy refused
after its hold was taken gives that hold back exactly once; copies and a store's host copies still land
next to a saturated loop; a host copy of ``plan_small`` rows cut into many calls is bit-exact.
"""

from __future__ import annotations

import asyncio
import queue
import random
import types
from collections.abc import Awaitable
from typing import Any, TypeVar

import numpy as np
import pytest

from aiokvtier import BlockStore, CopyEngine, CopyPlanError, HostTier, SlotError, StaticHostMem, TierClosedError
from aiokvtier._copy import _engine
from aiokvtier._handoff import GilHandoff, handoff
from aiokvtier.testing import RecordingBackend

from .helpers import KiB, MiB, eventually, saturated, small_config

pytestmark = pytest.mark.usefixtures("views_collected")

T = TypeVar("T")

HANG = 30.0
"""A bound on a hang, not a speed goal."""
SLOT = 64 * KiB
REFUSED = (TierClosedError, SlotError, CopyPlanError, RuntimeError, TimeoutError, asyncio.CancelledError)
"""What a caller of the mix may meet: a refusal, an injected failure, its own timeout or cancellation."""


async def bounded(aw: Awaitable[T], within: float = HANG) -> T:
    async with asyncio.timeout(within):
        return await aw


async def hand_off_stops() -> None:
    """The loop's hand-off stops ticking: no hold, light or counted, is left behind."""
    await eventually(lambda: not handoff(asyncio.get_running_loop()).ticking, within=2.0)


async def settle_all(tasks: list[asyncio.Task[Any]]) -> None:
    """Every task ends (bounded), with a result or one of the errors the mix may raise."""
    await bounded(asyncio.wait(tasks))
    for task in tasks:
        error = None if task.cancelled() else task.exception()
        errors = error.exceptions if isinstance(error, BaseExceptionGroup) else (error,)
        for e in errors:
            assert e is None or isinstance(e, REFUSED), repr(e)


def rows_of(stage: StaticHostMem, n: int) -> np.ndarray:
    return np.frombuffer(stage.view(), dtype=np.uint8)[: n * SLOT].reshape(n, SLOT)


async def mix(engine: CopyEngine, tier: HostTier, slots: np.ndarray, pages: np.ndarray, seed: int) -> None:
    """Copies that time out (0-5 ms), are cancelled, fail in a task group, ask for a slot nobody holds,
    and plain ones: all at once, and each bounded."""
    rnd = random.Random(seed)
    tasks: list[asyncio.Task[Any]] = []

    def copy(k: int) -> Awaitable[None]:
        mine, rows = slots[4 * k : 4 * k + 4], pages[4 * k : 4 * k + 4]
        return engine.to_host(tier, mine, rows) if rnd.random() < 0.5 else engine.to_device(tier, mine, rows)

    for step in range(20):
        tasks.append(asyncio.create_task(asyncio.wait_for(copy(step % 8), step * 0.00025)))
    for step in range(8):
        tasks.append(asyncio.create_task(copy(step)))
    for task in tasks[-4:]:
        task.cancel()
    await asyncio.sleep(0)
    for task in tasks[-8:-4]:
        task.cancel()

    async def refused() -> None:
        await engine.to_device(tier, [10**6], pages[:1])

    async def grouped() -> None:
        async def boom() -> None:
            await asyncio.sleep(0.001)
            raise RuntimeError("a sibling failed")

        async with asyncio.TaskGroup() as group:
            for k in range(4):
                group.create_task(copy(k))
            group.create_task(boom())

    tasks += [asyncio.create_task(refused()) for _ in range(3)]
    tasks.append(asyncio.create_task(grouped()))
    await settle_all(tasks)


async def close_racing(engine: CopyEngine, tier: HostTier, slots: np.ndarray, pages: np.ndarray, width: int) -> None:
    """A close racing copies: 16 of ``width`` slots each made before it starts, 8 of one slot after;
    each is copied or refused, none left pending."""
    racing = [
        asyncio.create_task(engine.to_host(tier, slots[k : k + width], pages[k : k + width]))
        for k in range(0, 16 * width, width)
    ]
    await asyncio.sleep(0)
    closing = asyncio.create_task(engine.aclose())
    racing += [asyncio.create_task(engine.to_device(tier, slots[k : k + 1], pages[k : k + 1])) for k in range(8)]
    await bounded(closing)
    await settle_all(racing)


async def test_host_copies_cancelled_refused_and_racing_a_close_leave_no_hold() -> None:
    config = small_config(quota=8 * MiB, max_quota=8 * MiB)
    async with HostTier(config) as tier, StaticHostMem(2 * MiB) as stage:
        await bounded(tier.wait_resident())
        slots = np.asarray(await bounded(tier.allocate(32)), dtype=np.int64)
        pages = rows_of(stage, 32)
        engine = await bounded(CopyEngine.open(None))
        async with saturated() as spins:
            for seed in range(3):
                await mix(engine, tier, slots, pages, seed)
            await close_racing(engine, tier, slots, pages, 1)
            with pytest.raises(TierClosedError):
                await bounded(engine.to_host(tier, slots[:1], pages[:1]))
            await hand_off_stops()  # while the loop is still saturated
        assert spins[0] > 0
    await hand_off_stops()


async def test_deferred_copies_failed_cancelled_refused_and_closed_mid_flight_leave_no_hold() -> None:
    """A backend that lands on its completion thread, holding every job until let go: requests made
    while it is busy take the deferred path (planned at the end of the loop's turn, ``waiting``
    futures). Jobs land, fail, fail to issue, are refused at their turn, the engine closes with jobs
    held; then nothing is held and every caller has its answer."""
    config = small_config(quota=8 * MiB, max_quota=8 * MiB)
    recording = RecordingBackend(hold=True, memmove=True)
    async with HostTier(config) as tier, StaticHostMem(2 * MiB) as stage:
        await bounded(tier.wait_resident())
        slots = np.asarray(await bounded(tier.allocate(32)), dtype=np.int64)
        pages = rows_of(stage, 32)
        engine = await bounded(CopyEngine.open(None, backend=recording))
        stop = asyncio.Event()

        async def let_go() -> None:
            n = 0
            while not stop.is_set():
                await asyncio.sleep(0.0005)
                n += 1
                if n % 7 == 0:
                    recording.fail(RuntimeError("the copy failed"), 1)
                elif n % 11 == 0:
                    recording.fail_issue = RuntimeError("the issue failed")
                recording.release(3)
            recording.hold = False
            recording.release()

        releaser = asyncio.create_task(let_go())
        try:
            async with saturated() as spins:
                for seed in range(3):
                    await mix(engine, tier, slots, pages, seed)
                assert recording.issued  # the copies reached the backend
                await close_racing(engine, tier, slots, pages, 2)
                await hand_off_stops()
            assert spins[0] > 0
        finally:
            stop.set()
            await bounded(releaser)
        assert recording.held == 0
    await hand_off_stops()


class _RefusingQueue(queue.SimpleQueue):  # type: ignore[type-arg]
    """The engine's queues, refusing the next ``refuse`` copy jobs put (neither the stop signal nor the
    completion thread's tuples): a failure after the copy's hold was taken, before it was queued."""

    refuse = 0

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if item is not None and not isinstance(item, tuple) and _RefusingQueue.refuse:
            _RefusingQueue.refuse -= 1
            raise RuntimeError("refused while queued")
        super().put(item, block, timeout)


@pytest.fixture
def refusing_queue(monkeypatch: pytest.MonkeyPatch) -> type[_RefusingQueue]:
    _RefusingQueue.refuse = 0
    fake = types.SimpleNamespace(SimpleQueue=_RefusingQueue, Empty=queue.Empty)
    monkeypatch.setattr(_engine, "queue", fake)
    return _RefusingQueue


@pytest.mark.parametrize("path", ["alone", "deferred"])
async def test_a_copy_refused_after_its_hold_releases_it_once(refusing_queue: type[_RefusingQueue], path: str) -> None:
    """A copy held in flight keeps the hand-off pausing the loop; another copy fails after its hold was
    taken and before it was queued (its own future, or a deferred request's): that hold goes once, and
    the first copy's hold still pauses the loop until it lands."""
    config = small_config(quota=8 * MiB, max_quota=8 * MiB)
    recording = RecordingBackend(hold=True, memmove=True)
    hand = handoff(asyncio.get_running_loop())
    async with (
        HostTier(config) as tier,
        StaticHostMem(2 * MiB) as stage,
        CopyEngine(None, backend=recording) as engine,
    ):
        await bounded(tier.wait_resident())
        slots = np.asarray(await bounded(tier.allocate(8)), dtype=np.int64)
        pages = rows_of(stage, 8)
        try:
            first = asyncio.create_task(engine.to_host(tier, slots[:2], pages[:2]))
            await bounded(recording.wait_issued(1))
            refusing_queue.refuse = 1
            if path == "alone":
                with pytest.raises(RuntimeError, match="refused while queued"):
                    await bounded(engine.copy([(int(pages[4].ctypes.data), int(pages[5].ctypes.data), 64)]))
            else:  # made while the engine is busy: planned at the turn's end, refused there
                with pytest.raises(RuntimeError, match="refused while queued"):
                    await bounded(engine.to_device(tier, slots[2:4], pages[2:4]))
            assert refusing_queue.refuse == 0
            # Released once: the first copy's hold is still counted, so the loop keeps pausing for it.
            await asyncio.sleep(0)
            paused = hand.handoffs
            await eventually(lambda: hand.handoffs >= paused + 3, within=5.0)
            assert hand.ticking and not first.done()
            recording.release()
            await bounded(first)
            third = asyncio.create_task(engine.to_host(tier, slots[4:6], pages[4:6]))  # counted from one again
            await bounded(recording.wait_issued(2))
            paused = hand.handoffs
            await eventually(lambda: hand.handoffs >= paused + 2, within=5.0)
            recording.release()
            await bounded(third)
        finally:  # a failure above leaves no copy held under the engine's close
            recording.hold = False
            recording.release()
    await hand_off_stops()


async def test_copies_one_at_a_time_and_many_at_once_land_next_to_a_loop_that_never_idles() -> None:
    config = small_config(quota=8 * MiB, max_quota=8 * MiB)
    async with (
        HostTier(config) as tier,
        StaticHostMem(4 * MiB) as stage,
        CopyEngine(None) as engine,
    ):
        await bounded(tier.wait_resident())
        slots = np.asarray(await bounded(tier.allocate(64)), dtype=np.int64)
        pages = rows_of(stage, 64)
        pages[:] = np.random.default_rng(3).integers(0, 256, pages.shape, dtype=np.uint8)
        want = pages.copy()
        async with saturated() as spins:
            for k in range(30):  # one copy at a time: each waits for the hand-off alone
                await bounded(engine.to_host(tier, slots[k : k + 1], pages[k : k + 1]))
                pages[k] = 0
                await bounded(engine.to_device(tier, slots[k : k + 1], pages[k : k + 1]))

            async def mover(k: int) -> None:
                for _ in range(4):
                    await engine.to_host(tier, slots[k : k + 1], pages[k : k + 1])
                    await engine.to_device(tier, slots[k : k + 1], pages[k : k + 1])

            async with asyncio.timeout(HANG):
                async with asyncio.TaskGroup() as group:
                    for k in range(64):
                        group.create_task(mover(k))
            await hand_off_stops()
        assert spins[0] > 0
        assert np.array_equal(pages, want)


async def test_a_store_s_host_copies_land_next_to_a_loop_that_never_idles() -> None:
    """The store's host copies run on its worker with a light hold (``Worker.submit(light=True)``)."""
    config = small_config(quota=8 * MiB, max_quota=8 * MiB)
    async with HostTier(config) as tier, BlockStore(tier) as store, StaticHostMem(2 * MiB) as stage:
        await bounded(tier.wait_resident())
        pages = rows_of(stage, 16)
        pages[:8] = np.random.default_rng(5).integers(0, 256, (8, SLOT), dtype=np.uint8)
        async with saturated() as spins:
            for k in range(8):  # one at a time
                await bounded(store.store([100 + k], pages[k : k + 1]))
                await bounded(store.load([100 + k], pages[8 + k : 9 + k]))
            assert np.array_equal(pages[8:16], pages[:8])
            pages[8:] = 0

            async def both(k: int) -> None:
                await store.store([200 + k], pages[k : k + 1])
                await store.load([200 + k], pages[8 + k : 9 + k])

            async with asyncio.timeout(HANG):
                async with asyncio.TaskGroup() as group:
                    for k in range(8):
                        group.create_task(both(k))
            await hand_off_stops()
        assert spins[0] > 0
        assert np.array_equal(pages[8:16], pages[:8])


@pytest.mark.parametrize("max_batch", [1, 2, 3, 7])
@pytest.mark.parametrize("layout", ["shuffled", "runs", "contiguous"])
async def test_host_copies_of_small_plans_cut_into_many_calls_are_bit_exact(max_batch: int, layout: str) -> None:
    """A usual request (``plan_small``: rows of ints) that exceeds ``max_batch`` is copied call by call
    from its rows: every byte lands where the arrays say, in ``ceil(copies / max_batch)`` calls."""
    config = small_config(quota=4 * MiB, max_quota=4 * MiB)
    async with (
        HostTier(config) as tier,
        StaticHostMem(2 * MiB) as stage,
        CopyEngine(None, max_batch=max_batch) as engine,
    ):
        await bounded(tier.wait_resident())
        slots = np.asarray(await bounded(tier.allocate(32)), dtype=np.int64)
        order = np.arange(32)
        if layout == "shuffled":
            np.random.default_rng(max_batch).shuffle(order)
        elif layout == "runs":  # runs of 4 pages that merge, in shuffled order
            order = np.random.default_rng(max_batch).permutation(8).repeat(4) * 4 + np.tile(np.arange(4), 8)
        pages = rows_of(stage, 32)
        pages[:] = np.random.default_rng(11).integers(0, 256, pages.shape, dtype=np.uint8)
        want = pages.copy()
        calls = engine.statistics().driver_calls
        await bounded(engine.to_host(tier, slots[order], pages))
        copies = engine.statistics().descriptors_submitted
        assert engine.statistics().driver_calls - calls == -(-copies // max_batch)
        pages[:] = 0
        await bounded(engine.to_device(tier, slots[order], pages))
        assert np.array_equal(pages, want)
        back = np.zeros_like(pages)
        await bounded(engine.to_device(tier, slots, back))  # in slot order: each slot holds its page
        assert np.array_equal(back[order], want)


async def test_a_light_hold_taken_after_a_stop_pauses_at_its_first_tick() -> None:
    """A counted hold's release stops the ticking at once, also where a light hold ended since the last
    tick; a light hold taken after that is pending throughout the next interval, so the first tick
    pauses for it (a thread next to a saturated loop waits one interval, not two)."""
    every = 0.05
    loop = asyncio.get_running_loop()
    hand = GilHandoff(loop, every=every, pause=0.0001)
    first: asyncio.Future[None] = loop.create_future()
    hand.hold_lightly_until(first)
    first.set_result(None)
    await asyncio.sleep(0)  # its end: a gap since the last tick
    hand.hold()
    hand.release()  # nothing asks: stopped now
    assert not hand.ticking
    second: asyncio.Future[None] = loop.create_future()
    hand.hold_lightly_until(second)
    seen: asyncio.Future[int] = loop.create_future()
    # Due after the first tick and before the second (due one interval after the first ran).
    loop.call_later(every * 1.5, lambda: seen.set_result(hand.handoffs))
    assert await bounded(seen) == 1
    second.set_result(None)
    await eventually(lambda: not hand.ticking, within=2.0)
