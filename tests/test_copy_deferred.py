"""Requests made while the engine is busy: planned together at the end of the loop's turn.

A ``to_device``/``to_host`` made while copies are queued or in flight waits for them anyway, so
the engine takes it at the end of the loop's turn with every other such request and checks and
plans them with the numpy calls of one. Each must come out as if it had been made alone: the
same plan, the same error (and only its own), the same cancellation, the same close.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import numpy as np
import pytest

from aiokvtier import CopyEngine, CopyPlanError, HostTier, SlotError, StaticHostMem, TierClosedError
from aiokvtier._copy._plan import plan, plan_many
from aiokvtier.testing import IssuedCopy, RecordingBackend

from .held_copies import busy_engine, staged_rows
from .helpers import KiB, small_config

SLOT = 64 * KiB
HANG = 10.0


async def _settled(*calls: Awaitable[Any]) -> list[Any]:
    return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), HANG)


def _alone(tier: HostTier, slots: list[int], pages: list[int], direction: str) -> tuple[tuple[int, ...], ...]:
    """The plan ``plan()`` makes of one request: (dsts, srcs, sizes)."""
    host = tier.slot_addresses(slots)
    other = np.asarray(pages, dtype=np.uint64)
    if direction == "h2d":
        p = plan(other, host, SLOT, src_reg=tier.registrations_at, n=len(slots))
    else:
        p = plan(host, other, SLOT, dst_reg=tier.registrations_at, n=len(slots), order_by="dst")
    return tuple(p.dsts.tolist()), tuple(p.srcs.tolist()), tuple(p.sizes.tolist())


def _as_issued(copy: IssuedCopy) -> tuple[tuple[int, ...], ...]:
    return copy.dsts, copy.srcs, copy.sizes


async def test_requests_made_while_busy_get_the_plans_they_would_get_alone() -> None:
    async with busy_engine() as (tier, stage, engine, recording):
        rng = np.random.default_rng(7)
        requests = []
        for i in range(12):  # shuffled slots or one run, both directions, each into its own 4 rows
            pool = np.arange(1, 32) if i % 2 == 0 else np.arange(32, 63)  # the d2h ones write other slots
            slots = [int(s) for s in rng.choice(pool, 4, replace=False)]
            if i % 3 == 0:
                slots = [int(pool[0]) + 4 * (i // 2) + r for r in range(4)]  # contiguous: one run
            pages = [stage.address + (4 * i + r) * SLOT for r in range(4)]
            requests.append((slots, pages, "h2d" if i % 2 == 0 else "d2h"))
        calls = [
            engine.to_device(tier, np.asarray(s), p) if d == "h2d" else engine.to_host(tier, s, p)
            for s, p, d in requests
        ]
        tasks = [asyncio.ensure_future(c) for c in calls]
        await asyncio.wait_for(recording.wait_issued(1 + len(tasks)), HANG)
        issued = recording.issued[1:]
        assert sorted(map(_as_issued, issued)) == sorted(_alone(tier, s, p, d) for s, p, d in requests)
        assert [c.requested for c in issued] == [4] * len(tasks)
        assert not any(t.done() for t in tasks)  # held: none came back before its copy landed
        recording.release()
        assert await _settled(*tasks) == [None] * len(tasks)
        rows = staged_rows(stage)
        for slots, pages, direction in requests:
            for s, address in zip(slots, pages, strict=True):
                if direction == "h2d":
                    assert (rows[(address - stage.address) // SLOT] == s + 1).all()
                else:
                    assert bytes(tier.view(s)) == bytes(SLOT)  # the rows were zeros
        stats = engine.statistics()
        assert stats.jobs_submitted == stats.jobs_completed == 1 + len(tasks)


async def test_a_refused_request_among_deferred_ones_fails_alone_with_its_own_error() -> None:
    async with busy_engine() as (tier, stage, engine, recording):
        frozen = np.frombuffer(bytes(2 * SLOT), dtype=np.uint8).reshape(2, SLOT)
        good = [stage.address + r * SLOT for r in (10, 11)]
        bad: list[tuple[Awaitable[Any], type[BaseException], str]] = [
            (engine.to_device(tier, [1, 99], [stage.address, stage.address + SLOT]), SlotError, "99"),
            (engine.to_device(tier, [1, True], [stage.address, stage.address + SLOT]), SlotError, "bool"),
            (engine.to_device(tier, [1, 2], frozen), ValueError, "read-only"),
            (engine.to_device(tier, [1, 2], [stage.address, stage.address + SLOT // 2]), CopyPlanError, "overlap"),
            (engine.to_host(tier, [3, 3], [stage.address, stage.address + SLOT]), SlotError, "twice"),
            (engine.to_device(tier, [1, 2], [stage.address, 64]), CopyPlanError, "no open HostTier"),
            (engine.to_device(tier, [], []), ValueError, "no slots"),
            (engine.to_device(tier, [4], [stage.address], page=2 * SLOT), CopyPlanError, "does not fit"),
            (engine.to_device(tier, [4], [stage.address], page=[1]), TypeError, "page"),  # unhashable
            (engine.to_device(tier, [4], [stage.address], page=True), TypeError, "bool"),
            (engine.to_device(tier, [4], [stage.address], page=0), ValueError, "positive"),
        ]
        before = engine.statistics()
        tasks = [asyncio.ensure_future(engine.to_device(tier, [5, 6], good))]
        tasks += [asyncio.ensure_future(call) for call, _, _ in bad]
        tasks.append(asyncio.ensure_future(engine.to_host(tier, [7, 8], good)))
        for _ in range(5):
            await asyncio.sleep(0)
        for task, (_, kind, words) in zip(tasks[1:-1], bad, strict=True):
            assert task.done(), words
            with pytest.raises(kind, match=words):
                task.result()
        await asyncio.wait_for(recording.wait_issued(3), HANG)
        assert engine.statistics().jobs_submitted == before.jobs_submitted + 2  # the refused ones: not counted
        recording.release()
        assert await _settled(tasks[0], tasks[-1]) == [None, None]
        assert (staged_rows(stage)[10] == 6).all() and bytes(tier.view(7)) == bytes([6]) * SLOT


async def test_the_same_request_alone_is_refused_with_the_same_words() -> None:
    """The errors of the test above, met by requests made alone (the engine idle), name the same things."""
    async with (
        HostTier(small_config()) as tier,
        StaticHostMem(4 * SLOT) as stage,
        CopyEngine(None) as engine,
    ):
        await tier.wait_resident()
        await tier.allocate(8)
        with pytest.raises(SlotError, match="99"):
            await engine.to_device(tier, [1, 99], [stage.address, stage.address + SLOT])
        with pytest.raises(SlotError, match="twice"):
            await engine.to_host(tier, [3, 3], [stage.address, stage.address + SLOT])
        with pytest.raises(CopyPlanError, match="overlap"):
            await engine.to_device(tier, [1, 2], [stage.address, stage.address + SLOT // 2])


async def test_a_cancelled_or_timed_out_deferred_caller_resumes_once_its_copy_landed() -> None:
    async with busy_engine() as (tier, stage, engine, recording):

        async def timed(i: int, delay: float) -> None:
            try:
                async with asyncio.timeout(delay):
                    await engine.to_device(tier, [i], [stage.address + i * SLOT])
            except TimeoutError:
                pass
            landed = (staged_rows(stage)[i] == i + 1).all()
            assert landed, f"a caller timed out after {delay} s came back before its copy landed"

        tasks = [asyncio.ensure_future(timed(i + 1, d)) for i, d in enumerate((0, 0, 0.0001, 0.001))]
        cancelled = asyncio.ensure_future(engine.to_device(tier, [9], [stage.address + 9 * SLOT]))
        await asyncio.sleep(0)
        cancelled.cancel()  # deferred, not yet queued
        await asyncio.sleep(0.01)
        assert not any(t.done() for t in tasks) and not cancelled.done()
        recording.release()
        await _settled(*tasks)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(cancelled, HANG)
        assert (staged_rows(stage)[9] == 10).all()  # the copy was made: a cancelled caller only stops waiting for it
        assert [t.result() for t in tasks] == [None] * 4


async def test_a_close_right_after_deferred_requests_queues_them_ahead_of_it() -> None:
    recording = RecordingBackend(hold=True, memmove=True)
    async with HostTier(small_config()) as tier, StaticHostMem(8 * SLOT) as stage:
        await tier.wait_resident()
        slots = await tier.allocate(8)
        for s in slots:
            tier.view(s)[:] = bytes([s + 1]) * SLOT
        engine = await CopyEngine.open(None, backend=recording)
        first = asyncio.ensure_future(engine.to_device(tier, [0], [stage.address]))
        await asyncio.wait_for(recording.wait_issued(1), HANG)
        calls = [asyncio.ensure_future(engine.to_device(tier, [s], [stage.address + s * SLOT])) for s in slots[1:]]
        await asyncio.sleep(0)  # every call deferred; the turn that plans them has not come
        closing = asyncio.ensure_future(engine.aclose())
        await asyncio.sleep(0.01)
        late = engine.to_device(tier, [1], [stage.address + SLOT])
        with pytest.raises(TierClosedError):
            await late
        assert not closing.done()
        recording.release()
        await asyncio.wait_for(closing, HANG)
        assert await _settled(first, *calls) == [None] * len(slots)
        assert all((staged_rows(stage)[s] == s + 1).all() for s in slots)
        stats = engine.statistics()
        assert stats.jobs_submitted == stats.jobs_completed == len(slots)


async def test_deferred_requests_of_a_tier_closed_before_their_turn_are_refused() -> None:
    async with busy_engine() as (_, stage, engine, _recording):
        other = await HostTier.open(small_config())
        await other.wait_resident()
        ids = await other.allocate(2)
        calls = [asyncio.ensure_future(engine.to_device(other, [i], [stage.address + (i + 1) * SLOT])) for i in ids]
        await other.aclose()  # closes before the turn that plans the deferred requests
        results = await _settled(*calls)
        assert all(isinstance(r, TierClosedError) for r in results), results
        assert len(other.copies) == 0


def test_plan_many_gives_each_request_the_plan_plan_gives_it() -> None:
    rng = np.random.default_rng(3)
    for _ in range(400):
        page = int(rng.choice([4096, 32768, 65536]))
        counts = [int(c) for c in rng.integers(1, 40, int(rng.integers(1, 6)))]
        dsts, srcs = [], []
        for c in counts:
            base = (1 << 40) + int(rng.integers(0, 64)) * page
            src = np.uint64(base) + rng.choice(256, c, replace=False).astype(np.uint64) * np.uint64(page)
            if rng.random() < 0.4:
                src = np.uint64(base) + np.arange(c, dtype=np.uint64) * np.uint64(page)  # one run
            dst = np.uint64(1 << 41) + np.arange(c, dtype=np.uint64) * np.uint64(page)
            dsts.append(dst[::-1].copy() if rng.random() < 0.3 else dst)
            srcs.append(src)

        def reg(a: np.ndarray, page: int = page) -> np.ndarray:
            return (a // np.uint64(8 * page)).astype(np.int64)

        order_by = "src" if rng.random() < 0.5 else "dst"
        many = plan_many(np.concatenate(dsts), np.concatenate(srcs), page, counts, src_reg=reg, order_by=order_by)
        for d, s, c, got in zip(dsts, srcs, counts, many, strict=True):
            want = plan(d, s, page, src_reg=reg, n=c, order_by=order_by)
            assert (got.dsts.tolist(), got.srcs.tolist(), got.sizes.tolist(), got.requested) == (
                want.dsts.tolist(),
                want.srcs.tolist(),
                want.sizes.tolist(),
                want.requested,
            )
