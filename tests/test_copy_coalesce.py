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

from aiokvtier import CopyEngine, HostTier, StaticHostMem
from aiokvtier._copy._engine import GROUP_BYTES
from aiokvtier._copy._plan import Plan
from aiokvtier.testing import RecordingBackend

from .helpers import KiB, MiB, small_config

SLOT = 64 * KiB
HANG = 10.0
DEVICE = 0x7F00_0000_0000


class Gated(RecordingBackend):
    """A coalescing recorder whose first ``issue()`` waits for ``gate``: whatever is queued
    meanwhile reaches the submit thread at once, as behind a GPU's slow first call."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(coalesce=True, **kwargs)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail_group: BaseException | None = None
        """Raised by the next ``issue()`` of more than one request (then cleared)."""
        self._first = True

    def issue(self, plan: Plan, direction: str, after: tuple[str, Any] | None) -> Any:
        if self._first:
            self._first = False
            self.entered.set()
            self.gate.wait(HANG)
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
