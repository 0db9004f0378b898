"""Large requests planned in pieces where they are issued (``CopyEngine(pieces_from=)``), on asyncio
and uvloop, over a RecordingBackend: checked whole when made, planned and issued piece by piece by
the submit thread, settled once every piece landed, also when a piece fails or the caller is
cancelled; and bit-exact where the pieces copy.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest

from aiokvtier import CopyEngine, HostTier, SlotError, StaticHostMem
from aiokvtier._copy._plan import PIECES_FROM, Pieces, plan, refuse_repeats
from aiokvtier.testing import RecordingBackend

from .helpers import KiB, MiB, small_config
from .invariants import check_tier, wait_no_library_threads

PAGE = 4 * KiB
SLOTS = 16384
"""A 64 MiB tier of 4 KiB slots: a request of every slot is six pieces, each half as large again as
the last (``SIZES``)."""
SIZES = [4096, 6144, 6144]
N = len(SIZES)
HANG = 20.0


@asynccontextmanager
async def rig(**backend: Any) -> AsyncIterator[tuple[HostTier, StaticHostMem, CopyEngine, RecordingBackend]]:
    recording = RecordingBackend(**backend)
    config = small_config(quota=64 * MiB, max_quota=64 * MiB, slot_size=PAGE)
    async with (
        HostTier(config) as tier,
        StaticHostMem(SLOTS * PAGE) as stage,
        CopyEngine(None, backend=recording) as engine,
    ):
        await tier.wait_resident()
        yield tier, stage, engine, recording


async def bounded(aw: Any) -> Any:
    return await asyncio.wait_for(asyncio.shield(asyncio.ensure_future(aw)), HANG)


def pages_of(stage: StaticHostMem, order: np.ndarray) -> np.ndarray:
    return np.uint64(stage.address) + order.astype(np.uint64) * np.uint64(PAGE)


def copied(issued: list[Any]) -> set[tuple[int, int]]:
    """Every page copy the issued jobs make, as ``(dst, src)`` page by page (runs cut back into pages)."""
    out = set()
    for job in issued:
        for dst, src, size in zip(job.dsts, job.srcs, job.sizes, strict=True):
            out.update((dst + k, src + k) for k in range(0, size, PAGE))
    return out


async def test_a_large_request_is_issued_in_pieces_each_in_host_order() -> None:
    async with rig() as (tier, stage, engine, recording):
        slots = np.asarray(await tier.allocate(SLOTS), dtype=np.int64)
        shuffled = np.random.default_rng(1).permutation(slots)
        pages = pages_of(stage, np.arange(SLOTS))
        await bounded(engine.to_host(tier, shuffled, pages))
        sizes = [job.requested for job in recording.issued]
        assert sizes == SIZES
        for job in recording.issued:
            assert job.direction == "d2h" and list(job.dsts) == sorted(job.dsts)  # the slots lead, ascending
        host = tier.slot_addresses(shuffled)
        assert copied(recording.issued) == set(zip(host.tolist(), pages.tolist(), strict=True))
        stats = engine.statistics()
        assert stats.jobs_submitted == stats.jobs_completed == 1 and stats.jobs_in_pieces == 1
        assert stats.copies_requested == SLOTS and stats.bytes_copied == SLOTS * PAGE
        assert stats.jobs_by_method == {"dma": 1, "sm": 0}  # one request, one job
        assert stats.jobs_by_direction["d2h"] == 1


async def test_pieces_merge_runs_within_a_piece_and_never_across_a_registration() -> None:
    async with rig() as (tier, stage, engine, recording):
        slots = np.asarray(await tier.allocate(SLOTS), dtype=np.int64)
        await bounded(engine.to_device(tier, slots, pages_of(stage, np.arange(SLOTS))))
        base = int(tier.slot_addresses([0])[0])
        unit = 1 * MiB  # small_config's commit unit: runs stop at each
        runs = [(src - base, size) for job in recording.issued for src, size in zip(job.srcs, job.sizes, strict=True)]
        assert all(offset // unit == (offset + size - 1) // unit for offset, size in runs)
        assert max(size for _, size in runs) == unit and len(runs) < SLOTS // 64  # merged, within a piece
        assert copied(recording.issued) == set(
            zip(pages_of(stage, np.arange(SLOTS)).tolist(), tier.slot_addresses(slots).tolist(), strict=True)
        )


async def test_a_request_below_the_bound_after_a_stream_or_on_an_engine_without_pieces_is_one_job() -> None:
    async with rig() as (tier, stage, engine, recording):
        slots = np.asarray(await tier.allocate(SLOTS), dtype=np.int64)
        few = slots[: PIECES_FROM - 1]
        await bounded(engine.to_device(tier, few, pages_of(stage, np.arange(len(few)))))
        assert len(recording.issued) == 1 and engine.statistics().jobs_in_pieces == 0
    recording = RecordingBackend()
    async with (
        HostTier(small_config(quota=64 * MiB, max_quota=64 * MiB, slot_size=PAGE)) as tier,
        StaticHostMem(SLOTS * PAGE) as stage,
        CopyEngine(None, backend=recording, pieces_from=None) as whole,
    ):
        await tier.wait_resident()
        slots = np.asarray(await tier.allocate(SLOTS), dtype=np.int64)
        await bounded(whole.to_host(tier, slots[::-1].copy(), pages_of(stage, np.arange(SLOTS))))
        assert len(recording.issued) == 1 and recording.issued[0].requested == SLOTS
        async with CopyEngine(None, pieces_from=8) as host_only:  # memmove copies as it issues: never pieces
            await bounded(host_only.to_device(tier, slots[:64], pages_of(stage, np.arange(64))))
            stats = host_only.statistics()
            assert stats.jobs_completed == 1 and stats.jobs_in_pieces == 0


@pytest.mark.parametrize("pieces_from", [1, 0, -5, 2.5, True, "8"])
def test_a_bad_pieces_from_is_refused(pieces_from: Any) -> None:
    with pytest.raises(ValueError, match="pieces_from"):
        CopyEngine(None, pieces_from=pieces_from)


async def test_a_repeated_slot_is_refused_before_any_piece_is_issued() -> None:
    async with rig() as (tier, stage, engine, recording):
        slots = np.asarray(await tier.allocate(SLOTS), dtype=np.int64)
        repeated = slots.copy()
        repeated[-1] = repeated[0]  # in the last piece, repeating one of the first
        with pytest.raises(SlotError, match="appears twice"):
            await bounded(engine.to_host(tier, repeated, pages_of(stage, np.arange(SLOTS))))
        with pytest.raises(SlotError, match="not a slot id"):
            bad = slots.copy()
            bad[-1] = SLOTS + 5
            await bounded(engine.to_device(tier, bad, pages_of(stage, np.arange(SLOTS))))
        assert recording.issued == [] and engine.statistics().jobs_submitted == 0
        assert len(tier.copies) == 0 and len(stage.copies) == 0


def test_repeats_are_found_by_marks_and_by_sorting() -> None:
    step = 64 * KiB
    near = np.arange(5000, dtype=np.uint64) * np.uint64(step) + np.uint64(1 << 40)
    refuse_repeats(near, step)
    spread = near * np.uint64(4096)  # a span too wide for a mark per step: sorted instead
    refuse_repeats(spread, step)
    for values in (near, spread):
        twice = values.copy()
        twice[4321] = twice[17]
        with pytest.raises(SlotError):
            refuse_repeats(twice, step)
    refuse_repeats(near[:1], step)


def test_pieces_plan_the_same_copies_as_one_plan() -> None:
    rng = np.random.default_rng(7)
    n = 20000
    srcs = (np.uint64(1 << 40) + rng.permutation(n).astype(np.uint64) * np.uint64(PAGE)).astype(np.uint64)
    dsts = np.uint64(1 << 42) + np.arange(n, dtype=np.uint64) * np.uint64(PAGE)
    pieces = Pieces(dsts, srcs, PAGE, "src")
    plans = list(pieces.plans())
    assert [p.jobs for p in plans] == [1] + [0] * (len(plans) - 1)
    assert sum(p.requested for p in plans) == n == pieces.requested and pieces.nbytes == n * PAGE
    whole = plan(dsts, srcs, PAGE)

    def spans(ps: list[Any]) -> set[tuple[int, int]]:
        return {
            (int(d) + k, int(s) + k)
            for p in ps
            for d, s, z in zip(p.dsts, p.srcs, p.sizes, strict=True)
            for k in range(0, int(z), PAGE)
        }

    assert spans(plans) == spans([whole])


def test_pieces_that_cannot_merge_keep_the_requests_order_and_the_rest_are_sorted() -> None:
    rng = np.random.default_rng(8)
    n = 9000
    slots = np.uint64(1 << 40) + rng.permutation(n).astype(np.uint64) * np.uint64(64 * KiB)
    rows = np.uint64(1 << 42) + np.arange(n, dtype=np.uint64) * np.uint64(PAGE)
    short = list(Pieces(rows, slots, PAGE, "src").plans())  # 4 KiB of each 64 KiB slot: nothing merges
    assert np.array_equal(np.concatenate([p.srcs for p in short]), slots)
    assert np.array_equal(np.concatenate([p.dsts for p in short]), rows)
    assert all(p.count == p.requested for p in short)
    whole = list(Pieces(rows, slots, 64 * KiB, "src").plans())  # whole slots could merge: sorted
    assert all(np.all(p.srcs[1:] > p.srcs[:-1]) for p in whole)
    alone = plan(rows[:100], slots[:100], PAGE, keep_order=True)
    assert np.array_equal(alone.srcs, slots[:100])
    assert np.array_equal(plan(rows[:100], slots[:100], PAGE).srcs, np.sort(slots[:100]))


async def test_the_pieces_copy_bit_exact_both_ways() -> None:
    async with rig(memmove=True) as (tier, stage, engine, recording):
        slots = np.asarray(await tier.allocate(SLOTS), dtype=np.int64)
        rows = np.frombuffer(stage.view(), dtype=np.uint8).reshape(SLOTS, PAGE)
        data = np.frombuffer(np.random.default_rng(3).bytes(SLOTS * PAGE), dtype=np.uint8).reshape(SLOTS, PAGE)
        rows[:] = data
        shuffled = np.random.default_rng(4).permutation(slots)
        await bounded(engine.to_host(tier, shuffled, rows))
        rows[:] = 0
        back = np.random.default_rng(5).permutation(SLOTS)  # load in another order: row i <- slot shuffled[back[i]]
        await bounded(engine.to_device(tier, shuffled[back], rows))
        assert np.array_equal(rows, data[back])
        assert engine.statistics().jobs_in_pieces == 2 and len(recording.issued) == 2 * N


async def test_the_caller_returns_once_every_piece_landed_and_a_cancelled_one_only_then() -> None:
    async with rig(hold=True) as (tier, stage, engine, recording):
        slots = np.asarray(await tier.allocate(SLOTS), dtype=np.int64)
        task = asyncio.ensure_future(engine.to_device(tier, slots, pages_of(stage, np.arange(SLOTS))))
        await bounded(recording.wait_issued(N))
        for held in range(N, 1, -1):
            recording.release(1)
            for _ in range(20):
                await asyncio.sleep(0)
            assert not task.done(), f"returned with {held - 1} pieces in flight"
            assert len(tier.copies) == 1 and len(stage.copies) == 1
        task.cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done(), "a cancelled caller regained its buffers while a piece was in flight"
        recording.release()
        with pytest.raises(asyncio.CancelledError):
            await bounded(task)
        assert len(tier.copies) == 0 and len(stage.copies) == 0
        assert engine.statistics().jobs_completed == 1


class _RefusesPiece(RecordingBackend):
    """Refuses the ``n``-th issue (from 1)."""

    def __init__(self, n: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.n = n
        self.calls = 0

    def issue(self, plan: Any, direction: str, after: Any) -> Any:
        self.calls += 1
        if self.calls == self.n:
            raise OSError(f"piece {self.n} refused")
        return super().issue(plan, direction, after)


@pytest.mark.parametrize("refused", [1, 3])
async def test_a_refused_piece_reaches_the_caller_after_the_pieces_issued_before_it(refused: int) -> None:
    recording = _RefusesPiece(refused, hold=True)
    async with (
        HostTier(small_config(quota=64 * MiB, max_quota=64 * MiB, slot_size=PAGE)) as tier,
        StaticHostMem(SLOTS * PAGE) as stage,
        CopyEngine(None, backend=recording) as engine,
    ):
        await tier.wait_resident()
        slots = np.asarray(await tier.allocate(SLOTS), dtype=np.int64)
        call = asyncio.ensure_future(engine.to_host(tier, slots, pages_of(stage, np.arange(SLOTS))))
        if refused > 1:
            await bounded(recording.wait_issued(refused - 1))
            for _ in range(20):
                await asyncio.sleep(0)
            assert not call.done() and recording.held == refused - 1  # nothing issued after the refusal
            recording.release()
        with pytest.raises(OSError, match=f"piece {refused} refused"):
            await bounded(call)
        assert len(tier.copies) == 0 and len(stage.copies) == 0
        assert engine.statistics().jobs_in_pieces == 1  # also where its first piece was refused
        recording.n = 0
        recording.hold = False
        await bounded(engine.to_host(tier, slots, pages_of(stage, np.arange(SLOTS))))  # the engine goes on
        stats = engine.statistics()
        assert stats.jobs_submitted == stats.jobs_completed == 2


async def test_a_failed_piece_fails_its_caller_once_every_piece_is_done() -> None:
    async with rig(hold=True) as (tier, stage, engine, recording):
        slots = np.asarray(await tier.allocate(SLOTS), dtype=np.int64)
        call = asyncio.ensure_future(engine.to_device(tier, slots, pages_of(stage, np.arange(SLOTS))))
        await bounded(recording.wait_issued(N))
        recording.release(1)
        recording.fail(RuntimeError("piece 2 failed"), 1)
        for _ in range(20):
            await asyncio.sleep(0)
        assert not call.done()
        recording.release()
        with pytest.raises(RuntimeError, match="piece 2 failed"):
            await bounded(call)
        assert len(tier.copies) == 0 and len(stage.copies) == 0


async def test_a_large_request_on_a_busy_engine_is_not_deferred_and_small_ones_around_it_land() -> None:
    async with rig(hold=True, coalesce=True) as (tier, stage, engine, recording):
        slots = np.asarray(await tier.allocate(SLOTS), dtype=np.int64)
        small = asyncio.ensure_future(engine.to_device(tier, slots[:4], pages_of(stage, np.arange(4))))
        await bounded(recording.wait_issued(1))
        big = asyncio.ensure_future(engine.to_host(tier, slots[4:], pages_of(stage, np.arange(4, SLOTS))))
        after = asyncio.ensure_future(engine.to_device(tier, slots[:4], pages_of(stage, np.arange(4))))
        await bounded(recording.wait_issued(N + 2))
        assert [j.direction for j in recording.issued] == ["h2d"] + ["d2h"] * N + ["h2d"]
        recording.hold = False
        recording.release()
        await bounded(asyncio.gather(small, big, after))
        stats = engine.statistics()
        assert stats.jobs_in_pieces == 1 and stats.jobs_completed == 3


async def test_close_waits_for_every_piece_and_leaves_no_thread() -> None:
    async with rig(hold=True) as (tier, stage, engine, recording):
        slots = np.asarray(await tier.allocate(SLOTS), dtype=np.int64)
        call = asyncio.ensure_future(engine.to_device(tier, slots, pages_of(stage, np.arange(SLOTS))))
        await bounded(recording.wait_issued(N))
        closing = asyncio.ensure_future(engine.aclose())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not closing.done() and not call.done()
        recording.release(N - 1)
        for _ in range(20):
            await asyncio.sleep(0)
        assert not closing.done()
        recording.release()
        await bounded(closing)
        await bounded(call)
    await wait_no_library_threads()


@pytest.mark.parametrize("delay_ms", [0, 0.05, 0.2, 1, 3])
async def test_cancelled_at_any_point_a_request_in_pieces_leaves_nothing_tracked(delay_ms: float) -> None:
    async with rig(memmove=True) as (tier, stage, engine, _):
        slots = np.asarray(await tier.allocate(SLOTS), dtype=np.int64)
        pages = pages_of(stage, np.random.default_rng(9).permutation(SLOTS))
        for direction in ("h2d", "d2h"):
            call = engine.to_device if direction == "h2d" else engine.to_host
            try:
                await asyncio.wait_for(call(tier, slots, pages), delay_ms / 1e3)
            except TimeoutError:
                pass
            assert len(tier.copies) == 0 and len(stage.copies) == 0  # a cancelled caller resumed after the copy
        stats = engine.statistics()
        assert stats.jobs_submitted == stats.jobs_completed
        await bounded(engine.to_host(tier, slots, pages))
        check_tier(tier)
