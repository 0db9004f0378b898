"""Jobs queued behind a busy submit thread reach a coalescing backend as one plan, on asyncio and uvloop.

A GPU backend issues many small requests queued together as one driver call with one event
(``CopyBackend.coalesce``). What must hold: a group keeps one direction and no ``after=``,
stays within ``max_batch`` descriptors and ``GROUP_BYTES``, is issued in queue order, lands
(or fails) for every job in it, and where its one issue fails each job is issued alone, so a
job is never refused for another's copies.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import uvloop

from aiokvtier import CopyEngine, HostTier, StaticHostMem
from aiokvtier._copy._backend import HostBackend
from aiokvtier._copy._engine import GROUP_BYTES
from aiokvtier._copy._plan import Plan
from aiokvtier.testing import RecordingBackend

from .helpers import KiB, MiB, small_config
from .invariants import wait_no_library_threads

pytestmark = pytest.mark.usefixtures("views_collected")

SLOT = 64 * KiB
HANG = 10.0
DEVICE = 0x7F00_0000_0000


class FirstWaits:
    """The first ``issue()`` waits for ``gate``: whatever is queued meanwhile reaches the submit
    thread at once, as behind a GPU's slow first call."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self._first = True

    def hold_first(self) -> None:
        if self._first:
            self._first = False
            self.entered.set()
            self.gate.wait(HANG)


class Gated(RecordingBackend):
    """A coalescing recorder whose first ``issue()`` waits for ``gate`` (``FirstWaits``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(coalesce=True, **kwargs)
        self.first = FirstWaits()
        self.gate, self.entered = self.first.gate, self.first.entered
        self.fail_group: BaseException | None = None
        """Raised by the next ``issue()`` of more than one request (then cleared)."""

    def issue(self, plan: Plan, direction: str, after: tuple[str, Any] | None) -> Any:
        self.first.hold_first()
        if plan.requested > 1 and self.fail_group is not None:
            error, self.fail_group = self.fail_group, None
            raise error
        return super().issue(plan, direction, after)


@asynccontextmanager
async def rig(
    device: int | None = None, *, max_batch: int = 1024, **backend: Any
) -> AsyncIterator[tuple[HostTier, StaticHostMem, CopyEngine, Gated]]:
    gated = Gated(**backend)
    async with (
        HostTier(small_config(quota=128 * MiB)) as tier,
        StaticHostMem(128 * SLOT) as stage,
        CopyEngine(device, max_batch=max_batch, backend=gated) as engine,
    ):
        await tier.wait_resident()
        yield tier, stage, engine, gated


async def bounded(aw: Any) -> Any:
    return await asyncio.wait_for(asyncio.shield(asyncio.ensure_future(aw)), HANG)


async def busy(engine: CopyEngine, tier: HostTier, stage: StaticHostMem, gated: Gated) -> asyncio.Future[None]:
    """A first job that holds the submit thread inside ``issue()`` until ``gated.gate`` is set."""
    slot = await tier.allocate()
    first = engine.begin(tier, [slot], [stage.address], "h2d")
    await bounded(asyncio.to_thread(gated.entered.wait, HANG))
    return first.done


async def test_jobs_queued_together_are_issued_as_one_plan_and_each_lands_bit_exact() -> None:
    async with rig(memmove=True) as (tier, stage, engine, gated):
        first = await busy(engine, tier, stage, gated)
        view = np.frombuffer(stage.view(), dtype=np.uint8).reshape(-1, SLOT)
        jobs, expect = [], []
        for i in range(5):
            slots = await tier.allocate(3)
            for k, slot in enumerate(slots):
                tier.view(slot)[:] = bytes([i * 3 + k + 1]) * SLOT
            rows = [1 + i * 3 + k for k in range(3)][::-1]  # pages in another order than the slots
            jobs.append(engine.begin(tier, slots, [stage.address + r * SLOT for r in rows], "h2d"))
            expect.append((rows, [i * 3 + k + 1 for k in range(3)]))
        gated.gate.set()
        await bounded(asyncio.gather(first, *(j.done for j in jobs), *(j.submitted for j in jobs)))
        assert [c.requested for c in gated.issued] == [1, 15]  # the busy job, then one group of five
        group = gated.issued[1]
        assert group.after is None and group.direction == "h2d" and len(group.dsts) == 15
        for rows, values in expect:
            for r, v in zip(rows, values, strict=True):
                assert (view[r] == v).all()
        stats = engine.statistics()
        assert stats.jobs_coalesced == 5 and stats.jobs_completed == 6 and stats.descriptors_submitted == 16
        assert stats.jobs_by_method == {"dma": 6, "sm": 0}, "a group counts each of its jobs once"
        assert stats.bytes_by_method["dma"] == stats.bytes_copied == stats.bytes_by_direction["h2d"] == 16 * SLOT
        assert stats.latency_count == 6
        assert len(tier.copies) == 0 and len(stage.copies) == 0


async def test_a_group_ends_at_a_new_direction_or_an_after_and_keeps_the_queue_order() -> None:
    async with rig(0) as (tier, stage, engine, gated):
        first = await busy(engine, tier, stage, gated)
        slots = await tier.allocate(6)
        plan = [("h2d", None), ("h2d", None), ("d2h", None), ("d2h", 0x5), ("d2h", None), ("h2d", None)]
        started = [
            engine.begin(tier, [slot], [DEVICE + i * SLOT], direction, after=after)
            for i, (slot, (direction, after)) in enumerate(zip(slots, plan, strict=True))
        ]
        gated.gate.set()
        await bounded(asyncio.gather(first, *(s.done for s in started)))
        issued = gated.issued[1:]
        assert [(c.direction, c.requested, c.after) for c in issued] == [
            ("h2d", 2, None),
            ("d2h", 1, None),
            ("d2h", 1, ("stream", 0x5)),  # a job that waits for a stream is issued alone
            ("d2h", 1, None),
            ("h2d", 1, None),
        ]
        order = [DEVICE + i * SLOT for i in range(6)]
        seen = [a for c in issued for a in (c.dsts if c.direction == "h2d" else c.srcs)]
        assert seen == order


async def test_a_group_holds_at_most_max_batch_descriptors_and_group_bytes() -> None:
    async with rig(max_batch=4) as (tier, stage, engine, gated):
        first = await busy(engine, tier, stage, gated)
        started = []
        for i in range(5):  # two descriptors each: pages every other row, so nothing merges
            slots = await tier.allocate(2)
            started.append(engine.begin(tier, slots, [stage.address + (2 * i + k) * 2 * SLOT for k in range(2)], "h2d"))
        gated.gate.set()
        await bounded(asyncio.gather(first, *(s.done for s in started)))
        assert [c.requested for c in gated.issued] == [1, 4, 4, 2]
    per_job = GROUP_BYTES // 2 // SLOT  # two jobs reach the bound: a third starts the next group
    async with rig() as (tier, stage, engine, gated):
        first = await busy(engine, tier, stage, gated)
        started = []
        for _ in range(3):
            slots = await tier.allocate(per_job)
            started.append(engine.begin(tier, slots, [stage.address + k * SLOT for k in range(per_job)], "h2d"))
        gated.gate.set()
        await bounded(asyncio.gather(first, *(s.done for s in started)))
        assert [c.requested for c in gated.issued] == [1, 2 * per_job, per_job]


async def test_a_group_whose_issue_fails_is_issued_job_by_job() -> None:
    async with rig() as (tier, stage, engine, gated):
        first = await busy(engine, tier, stage, gated)
        started = []
        for i in range(3):
            slots = await tier.allocate(1)
            started.append(engine.begin(tier, slots, [stage.address + (i + 1) * SLOT], "h2d"))
        gated.fail_group = OSError("the batch was refused")
        gated.gate.set()
        await bounded(asyncio.gather(first, *(s.done for s in started)))  # every job landed alone
        assert [c.requested for c in gated.issued] == [1, 1, 1, 1]
        stats = engine.statistics()
        assert stats.jobs_coalesced == 0 and stats.jobs_completed == 4 and stats.descriptors_submitted == 4


async def test_a_failed_group_fails_each_of_its_callers_and_a_cancelled_one_waits_for_the_landing() -> None:
    async with rig(hold=True) as (tier, stage, engine, gated):
        first = await busy(engine, tier, stage, gated)
        calls = []
        for i in range(3):
            slots = await tier.allocate(1)
            calls.append(asyncio.ensure_future(engine.to_device(tier, slots, [stage.address + (i + 1) * SLOT])))
        for _ in range(5):
            await asyncio.sleep(0)  # the calls plan and queue
        gated.gate.set()
        await bounded(gated.wait_issued(2))
        assert [c.requested for c in gated.issued] == [1, 3]
        calls[1].cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        assert not calls[1].done(), "a cancelled caller regained its buffers while its group was in flight"
        assert gated.release(1) == 1  # the busy job
        await bounded(first)
        assert gated.fail(RuntimeError("the group's copy failed")) == 1
        for call in (calls[0], calls[2]):
            with pytest.raises(RuntimeError, match="the group's copy failed"):
                await bounded(call)
        with pytest.raises(asyncio.CancelledError):
            await bounded(calls[1])
        assert len(tier.copies) == 0 and len(stage.copies) == 0
        stats = engine.statistics()
        assert stats.jobs_completed == stats.jobs_submitted == 4


async def test_a_backend_that_does_not_coalesce_gets_every_job_alone() -> None:
    recording = RecordingBackend(hold=True)
    async with (
        HostTier(small_config()) as tier,
        StaticHostMem(16 * SLOT) as stage,
        CopyEngine(None, backend=recording) as engine,
    ):
        await tier.wait_resident()
        slots = await tier.allocate(8)
        started = [engine.begin(tier, [s], [stage.address + i * SLOT], "h2d") for i, s in enumerate(slots)]
        await bounded(recording.wait_issued(8))
        recording.release()
        await bounded(asyncio.gather(*(s.done for s in started)))
        assert [c.requested for c in recording.issued] == [1] * 8
        assert engine.statistics().jobs_coalesced == 0


async def test_a_small_job_is_not_grouped_with_one_that_would_take_the_group_past_group_bytes() -> None:
    whole = GROUP_BYTES // SLOT  # the second job alone fills the bound: the first must not wait for it
    async with rig() as (tier, stage, engine, gated):
        first = await busy(engine, tier, stage, gated)
        small = engine.begin(tier, await tier.allocate(1), [stage.address], "h2d")
        slots = await tier.allocate(whole)
        big = engine.begin(tier, slots, [stage.address + k * SLOT for k in range(whole)], "h2d")
        gated.gate.set()
        await bounded(asyncio.gather(first, small.done, big.done))
        assert [c.requested for c in gated.issued] == [1, 1, whole]
        assert all(sum(c.sizes) <= GROUP_BYTES for c in gated.issued)


class GatedHost(HostBackend):
    """A coalescing memmove backend whose first ``issue()`` waits for ``gate``."""

    coalesce = True

    def __init__(self) -> None:
        super().__init__()
        self.first = FirstWaits()
        self.gate, self.entered = self.first.gate, self.first.entered
        self.plans: list[int] = []

    def issue(self, plan: Plan, direction: str, after: tuple[str, Any] | None) -> Any:
        self.first.hold_first()
        self.plans.append(plan.requested)
        return super().issue(plan, direction, after)

    def wait(self, handle: Any) -> None:
        raise AssertionError("a synchronous backend is never waited for")


async def test_a_synchronous_backend_that_coalesces_has_its_groups_settled_by_the_submit_thread() -> None:
    backend = GatedHost()
    async with (
        HostTier(small_config(quota=16 * MiB)) as tier,
        StaticHostMem(16 * SLOT) as stage,
        CopyEngine(None, backend=backend) as engine,
    ):
        await tier.wait_resident()
        view = np.frombuffer(stage.view(), dtype=np.uint8).reshape(-1, SLOT)
        first = engine.begin(tier, await tier.allocate(1), [stage.address], "h2d")
        await bounded(asyncio.to_thread(backend.entered.wait, HANG))
        slots = await tier.allocate(4)
        for i, slot in enumerate(slots):
            tier.view(slot)[:] = bytes([i + 7]) * SLOT
        started = [engine.begin(tier, [slot], [stage.address + (i + 1) * SLOT], "h2d") for i, slot in enumerate(slots)]
        backend.gate.set()
        await bounded(asyncio.gather(first.done, *(s.done for s in started), *(s.submitted for s in started)))
        assert backend.plans == [1, 4]
        for i in range(4):
            assert (view[i + 1] == i + 7).all()
        stats = engine.statistics()
        assert stats.jobs_coalesced == 4 and stats.jobs_completed == stats.jobs_submitted == 5
        assert len(tier.copies) == 0 and len(stage.copies) == 0


@pytest.mark.parametrize("stop_at", ["a carried job", "the group's end"])
async def test_close_while_a_group_is_queued_and_held_issues_every_job_then_stops(stop_at: str) -> None:
    async with rig(hold=True) as (tier, stage, engine, gated):
        first = await busy(engine, tier, stage, gated)
        kinds = ["h2d", "h2d", "d2h"] if stop_at == "a carried job" else ["h2d", "h2d"]
        slots = await tier.allocate(len(kinds))
        started = [
            engine.begin(tier, [slot], [stage.address + (i + 1) * SLOT], kind)
            for i, (slot, kind) in enumerate(zip(slots, kinds, strict=True))
        ]
        closing = asyncio.ensure_future(engine.aclose())
        await asyncio.sleep(0.05)  # the stop signal queues behind the jobs
        gated.gate.set()
        await bounded(gated.wait_issued(len(set(kinds)) + 1))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not closing.done() and not any(s.done.done() for s in started)
        assert gated.release() == len(set(kinds)) + 1
        await bounded(closing)
        await bounded(asyncio.gather(first, *(s.done for s in started)))
        assert [c.requested for c in gated.issued] == [1, 2] + ([1] if stop_at == "a carried job" else [])
        stats = engine.statistics()
        assert stats.jobs_completed == stats.jobs_submitted == len(kinds) + 1 == stats.latency_count
        assert len(tier.copies) == 0 and len(stage.copies) == 0
    await wait_no_library_threads()


DELAYS = (0, 0.0001, 0.0005, 0.002, 0.01)


async def test_callers_of_a_group_cancelled_or_timed_out_resume_only_once_their_copy_landed() -> None:
    class Sibling(Exception):
        pass

    async with rig(memmove=True) as (tier, stage, engine, gated):
        first = await busy(engine, tier, stage, gated)
        view = np.frombuffer(stage.view(), dtype=np.uint8).reshape(-1, SLOT)
        slots = await tier.allocate(3 * len(DELAYS))
        for i, slot in enumerate(slots):
            tier.view(slot)[:] = bytes([i + 1]) * SLOT

        def landed(i: int) -> bool:
            return bool((view[i + 1] == i + 1).all())

        async def timed(i: int, delay: float) -> None:
            try:
                async with asyncio.timeout(delay):
                    await engine.to_device(tier, [slots[i]], [stage.address + (i + 1) * SLOT])
            except TimeoutError:
                pass
            assert landed(i), f"a caller timed out after {delay} s came back before its copy landed"

        async def cancelled(i: int) -> None:
            try:
                await engine.to_device(tier, [slots[i]], [stage.address + (i + 1) * SLOT])
            except asyncio.CancelledError:
                assert landed(i), "a cancelled caller came back before its copy landed"
                raise

        async def in_group(i: int, delay: float) -> None:
            async def sibling() -> None:
                await asyncio.sleep(delay)
                raise Sibling

            with pytest.raises(ExceptionGroup):
                async with asyncio.TaskGroup() as group:
                    group.create_task(sibling())
                    await engine.to_device(tier, [slots[i]], [stage.address + (i + 1) * SLOT])
                    await asyncio.sleep(HANG)
            assert landed(i), f"a TaskGroup failed after {delay} s came back before its copy landed"

        n = len(DELAYS)
        tasks = [asyncio.ensure_future(timed(k, d)) for k, d in enumerate(DELAYS)]
        tasks += [asyncio.ensure_future(in_group(n + k, d)) for k, d in enumerate(DELAYS)]
        victims = [asyncio.ensure_future(cancelled(2 * n + k)) for k in range(n)]
        for _ in range(5):
            await asyncio.sleep(0)  # every call plans and queues behind the held first job
        for k, victim in enumerate(victims):
            victim.cancel()
            await asyncio.sleep(DELAYS[k])
        await asyncio.sleep(0.02)
        gated.gate.set()
        await bounded(asyncio.gather(first, *tasks))
        for victim in victims:
            with pytest.raises(asyncio.CancelledError):
                await bounded(victim)
        assert [c.requested for c in gated.issued] == [1, 3 * n]
        stats = engine.statistics()
        assert stats.jobs_completed == stats.jobs_submitted == stats.latency_count == 3 * n + 1
        assert len(tier.copies) == 0 and len(stage.copies) == 0


async def test_a_group_whose_merged_issue_fails_gives_each_job_its_own_outcome() -> None:
    class Picky(Gated):
        """Refuses the group, then the job writing to ``bad``."""

        bad = 0

        def issue(self, plan: Plan, direction: str, after: tuple[str, Any] | None) -> Any:
            if plan.requested == 1 and int(plan.dsts[0]) == self.bad:
                raise OSError("this job was refused")
            return super().issue(plan, direction, after)

    picky = Picky(hold=True)
    async with (
        HostTier(small_config(quota=16 * MiB)) as tier,
        StaticHostMem(16 * SLOT) as stage,
        CopyEngine(None, backend=picky) as engine,
    ):
        await tier.wait_resident()
        first = await busy(engine, tier, stage, picky)
        slots = await tier.allocate(4)
        picky.bad = stage.address + 2 * SLOT
        started = [engine.begin(tier, [slot], [stage.address + (i + 1) * SLOT], "h2d") for i, slot in enumerate(slots)]
        picky.fail_group = OSError("the batch was refused")
        picky.gate.set()
        await bounded(picky.wait_issued(4))  # the busy job, then three of the four alone
        await bounded(asyncio.gather(*(s.submitted for s in started)))
        assert picky.release(2) == 2  # the busy job and the first one
        await bounded(asyncio.gather(first, started[0].done))
        with pytest.raises(OSError, match="this job was refused"):  # settled in queue order
            await bounded(started[1].done)
        assert picky.fail(RuntimeError("the copy failed"), 1) == 1  # the third fails landing, alone
        with pytest.raises(RuntimeError, match="the copy failed"):
            await bounded(started[2].done)
        assert not started[3].done.done()
        assert picky.release() == 1
        await bounded(started[3].done)
        assert [c.requested for c in picky.issued] == [1, 1, 1, 1]
        stats = engine.statistics()
        assert stats.jobs_coalesced == 0 and stats.jobs_completed == stats.jobs_submitted == 5
        assert stats.descriptors_submitted == 4 and stats.jobs_by_method["dma"] == 4
        assert len(tier.copies) == 0 and len(stage.copies) == 0


@pytest.mark.parametrize("report_issue", [False, True])
def test_jobs_from_two_event_loops_in_one_group_settle_each_on_its_own_loop(report_issue: bool) -> None:
    async def main() -> None:
        async with rig(hold=True) as (tier, stage, engine, gated):
            first = await busy(engine, tier, stage, gated)
            slots = await tier.allocate(8)
            pages = engine.pages([stage.address + (r + 1) * SLOT for r in range(8)], 8, page=SLOT, writable=True)
            queued = threading.Barrier(3)
            settled: dict[str, int] = {}
            errors: list[BaseException] = []

            def other(name: str, rows: range) -> None:
                async def calls() -> None:
                    loop = asyncio.get_running_loop()
                    started = [
                        engine.start(tier, [slots[r]], pages.take([r]), "h2d", report_issue=report_issue) for r in rows
                    ]
                    await asyncio.to_thread(queued.wait, HANG)
                    await asyncio.gather(*(s.submitted for s in started))
                    await asyncio.gather(*(s.done for s in started))
                    assert all(f.get_loop() is loop for s in started for f in s)
                    settled[name] = len(started)

                try:
                    with asyncio.Runner(loop_factory=uvloop.new_event_loop if name == "uvloop" else None) as runner:
                        runner.run(calls())
                except BaseException as exc:
                    errors.append(exc)
                    queued.abort()

            threads = [
                threading.Thread(target=other, args=(name, rows))
                for name, rows in (("asyncio", range(4)), ("uvloop", range(4, 8)))
            ]
            for thread in threads:
                thread.start()
            await bounded(asyncio.to_thread(queued.wait, HANG))
            gated.gate.set()
            await bounded(gated.wait_issued(2))
            assert [c.requested for c in gated.issued] == [1, 8]
            gated.release()
            await bounded(first)
            for thread in threads:
                await bounded(asyncio.to_thread(thread.join, HANG))
            assert not errors, errors
            assert settled == {"asyncio": 4, "uvloop": 4}, "a loop's callers were not all settled"
            stats = engine.statistics()
            assert stats.jobs_coalesced == 8 and stats.jobs_completed == stats.jobs_submitted == 9
            assert len(tier.copies) == 0 and len(stage.copies) == 0
        await wait_no_library_threads()

    asyncio.run(main())


async def test_raw_copies_queued_together_are_one_group_between_slot_copies() -> None:
    async with rig(memmove=True) as (tier, stage, engine, gated):
        first = await busy(engine, tier, stage, gated)
        view = np.frombuffer(stage.view(), dtype=np.uint8).reshape(-1, SLOT)
        slots = await tier.allocate(4)
        for i, slot in enumerate(slots):
            tier.view(slot)[:] = bytes([i + 1]) * SLOT
        addresses = tier.slot_addresses(slots)
        h2d = engine.begin(tier, [slots[0]], [stage.address + SLOT], "h2d")
        raw = [
            asyncio.ensure_future(engine.copy([(stage.address + (i + 2) * SLOT, int(addresses[i + 1]), SLOT)]))
            for i in range(3)
        ]
        for _ in range(5):
            await asyncio.sleep(0)  # the raw copies plan and queue
        gated.gate.set()
        await bounded(asyncio.gather(first, h2d.done, *raw))
        assert [(c.direction, c.requested) for c in gated.issued] == [("h2d", 1), ("h2d", 1), ("any", 3)]
        for row in range(1, 5):
            assert (view[row] == row).all()
        stats = engine.statistics()
        assert stats.jobs_by_direction == {"h2d": 2, "d2h": 0, "any": 3}
        assert stats.bytes_by_direction == {"h2d": 2 * SLOT, "d2h": 0, "any": 3 * SLOT}
        assert stats.jobs_coalesced == 3 and stats.jobs_completed == stats.jobs_submitted == 5
        assert len(tier.copies) == 0 and len(stage.copies) == 0
