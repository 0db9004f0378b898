"""Attacks on large requests planned in pieces (``CopyEngine(pieces_from=)``), on asyncio and uvloop:
cancellation at every await and at every piece boundary, closes and shrinks while pieces are held or
being issued (also from a second loop's thread), a piece that fails to plan, issue or land, hostile
input at the bound, ``begin()`` and ``start()`` in pieces, and a busy engine's deferred requests
around a large one. After each: nothing tracked, the figures consistent, the tier as it should be.

Defects these tests found: a 0-d array of slot ids raised ``TypeError`` (``len()`` of it, asked to
choose between deferring and pieces) instead of the ``SlotError`` a request planned at once raises;
and an int64 array of addresses was kept as the caller's own array, so pieces planned after the
call returned (``begin()``, ``start()``) copied whatever the caller had written there since, never
checked (a memmove from any address on a host-only backend); and with ``method="auto"`` a request
the kernel cannot take (odd addresses or pages) went to the copy engines in pieces.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest

from aiokvtier import CopyEngine, CopyPlanError, CudaError, HostTier, QuotaError, SlotError, StaticHostMem
from aiokvtier._copy import _plan
from aiokvtier._copy._plan import PIECES_FROM
from aiokvtier._cuda import _driver
from aiokvtier.testing import RecordingBackend

from .helpers import KiB, MiB, eventually, small_config
from .invariants import check_tier, wait_no_library_threads
from .test_copy_backend import DEVICE, ModelBatch, ModelDriver, ModelSmPath, model_driver, model_sm  # noqa: F401

PAGE = 4 * KiB
SLOTS = 16384
SIZES = [4096, 6144, 6144]
"""The pieces of a request of every slot."""
N = len(SIZES)
HANG = 20.0


def _config(quota: int = 64 * MiB) -> Any:
    return small_config(quota=quota, max_quota=128 * MiB, slot_size=PAGE)


class Gated(RecordingBackend):
    """Holds the submit thread in its ``at``-th issue (from 1) until ``gate`` opens: a request caught
    while its pieces are being issued."""

    def __init__(self, at: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.at = at
        self.calls = 0
        self.entered = threading.Event()
        self.gate = threading.Event()

    def issue(self, plan: Any, direction: str, after: Any) -> Any:
        self.calls += 1
        if self.calls == self.at:
            self.entered.set()
            assert self.gate.wait(HANG), "the gate was never opened"
        return super().issue(plan, direction, after)


class Waits(RecordingBackend):
    """Counts the handles the completion thread waited for."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.waited = 0

    def wait(self, handle: Any) -> None:
        self.waited += 1
        super().wait(handle)


@asynccontextmanager
async def rig(
    recording: RecordingBackend | None = None, quota: int = 64 * MiB
) -> AsyncIterator[tuple[HostTier, StaticHostMem, CopyEngine, RecordingBackend]]:
    recording = RecordingBackend(memmove=True) if recording is None else recording
    try:
        async with (
            HostTier(_config(quota)) as tier,
            StaticHostMem(SLOTS * PAGE) as stage,
            CopyEngine(None, backend=recording) as engine,
        ):
            await tier.wait_resident()
            try:
                yield tier, stage, engine, recording
            finally:  # a test that failed with copies held must not hang the closes
                recording.hold = False
                recording.release()
                if isinstance(recording, Gated):
                    recording.gate.set()
    finally:
        await wait_no_library_threads()


async def bounded(aw: Any) -> Any:
    return await asyncio.wait_for(asyncio.shield(asyncio.ensure_future(aw)), HANG)


async def turns(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def write_rows(stage: StaticHostMem, values: np.ndarray) -> None:
    """Row ``i`` of the stage holds ``values[i]`` (no view left exported, which would keep it mapped)."""
    with stage.view() as view:
        rows = np.frombuffer(view, dtype=np.uint8).reshape(SLOTS, PAGE)
        rows[:] = values.astype(np.uint8)[:, None]
        del rows


def addresses(stage: StaticHostMem, order: Any) -> np.ndarray:
    return np.uint64(stage.address) + np.asarray(order).astype(np.uint64) * np.uint64(PAGE)


def slot_bytes(tier: HostTier, slots: Any) -> np.ndarray:
    """The first byte of each slot, in the order given."""
    return np.array([tier.view(int(s))[0] for s in slots], dtype=np.uint8)


def settled(engine: CopyEngine, *regions: Any) -> None:
    """Every copy settled: counted completed, none tracked by a region."""
    stats = engine.statistics()
    assert stats.jobs_submitted == stats.jobs_completed == stats.latency_count, stats
    assert all(len(r.copies) == 0 for r in regions)


async def allocated(tier: HostTier, n: int = SLOTS) -> np.ndarray:
    return np.asarray(await tier.allocate(n), dtype=np.int64)


def fill(stage: StaticHostMem) -> None:
    """Row ``i`` of the stage holds ``i % 251 + 1``."""
    write_rows(stage, np.arange(SLOTS) % 251 + 1)


# -- cancellation --------------------------------------------------------------------------------

CALLS: dict[str, Callable[[CopyEngine, HostTier, Any, Any], Any]] = {
    "to_device": lambda e, t, s, b: e.to_device(t, s, b),
    "to_host": lambda e, t, s, b: e.to_host(t, s, b),
    "begin": lambda e, t, s, b: e.begin(t, s, b, "d2h").done,
    "start": lambda e, t, s, b: e.start(t, s, e.pages(b, len(s), page=PAGE, writable=False), "d2h").done,
}


@pytest.mark.parametrize("call", sorted(CALLS))
async def test_cancelled_by_a_timeout_at_any_delay_the_copy_lands_whole_before_its_caller_resumes(call: str) -> None:
    async with rig() as (tier, stage, engine, _):
        slots = await allocated(tier)
        order = np.random.default_rng(1).permutation(SLOTS)
        fill(stage)
        pages = addresses(stage, order)
        for delay_ms in (0, 0.05, 0.2, 0.5, 1, 2, 4, 8):
            tier.view(int(slots[0]))[:] = bytes(PAGE)
            before = engine.statistics().jobs_submitted
            try:
                await asyncio.wait_for(CALLS[call](engine, tier, slots, pages), delay_ms / 1e3)
            except TimeoutError:
                pass
            settled(engine, tier, stage)
            made = engine.statistics().jobs_submitted > before  # a timeout of 0 may cancel it before it began
            if made and call != "to_device":  # into the slots: every one holds its page, cancelled or not
                assert (slot_bytes(tier, slots) == (order % 251 + 1)).all()
        stats = engine.statistics()  # a timeout of 0 may cancel the call before it began
        assert stats.jobs_in_pieces == stats.jobs_submitted >= 7
        check_tier(tier)


@pytest.mark.parametrize("landed", range(N))
async def test_cancelled_at_each_piece_boundary_the_caller_resumes_only_once_every_piece_landed(landed: int) -> None:
    async with rig(RecordingBackend(hold=True, memmove=True)) as (tier, stage, engine, recording):
        slots = await allocated(tier)
        fill(stage)
        task = asyncio.ensure_future(engine.to_host(tier, slots, addresses(stage, np.arange(SLOTS))))
        await bounded(recording.wait_issued(N))
        recording.release(landed)
        await turns()
        task.cancel()
        for held in range(N - landed, 0, -1):
            await turns()
            assert not task.done(), f"a cancelled caller resumed with {held} pieces in flight"
            assert len(tier.copies) == 1 and len(stage.copies) == 1
            recording.release(1)
        with pytest.raises(asyncio.CancelledError):
            await bounded(task)
        settled(engine, tier, stage)
        assert (slot_bytes(tier, slots) == (np.arange(SLOTS) % 251 + 1)).all()
        check_tier(tier)


async def test_a_sibling_failing_in_a_task_group_waits_for_every_piece() -> None:
    async with rig(RecordingBackend(hold=True, memmove=True)) as (tier, stage, engine, recording):
        slots = await allocated(tier)

        async def sibling() -> None:
            await recording.wait_issued(N)
            raise LookupError("sibling failed")

        async def group() -> None:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(engine.to_device(tier, slots, addresses(stage, np.arange(SLOTS))))
                tg.create_task(sibling())

        task = asyncio.ensure_future(group())
        await bounded(recording.wait_issued(N))
        await turns()
        assert not task.done(), "the group ended with the copy's pieces in flight"
        recording.release()
        with pytest.raises(ExceptionGroup) as caught:
            await bounded(task)
        assert caught.group_contains(LookupError)
        settled(engine, tier, stage)
        check_tier(tier)


# -- closes and shrinks while pieces are held or being issued --------------------------------------


async def test_an_engine_closed_while_its_pieces_are_being_issued_issues_and_lands_them_all() -> None:
    gated = Gated(2, memmove=True)
    async with rig(gated) as (tier, stage, engine, _):
        slots = await allocated(tier)
        fill(stage)
        call = asyncio.ensure_future(engine.to_host(tier, slots, addresses(stage, np.arange(SLOTS))))
        await eventually(gated.entered.is_set)
        closing = asyncio.ensure_future(engine.aclose())
        await turns()
        assert not closing.done() and not call.done()
        gated.gate.set()
        await bounded(closing)
        await bounded(call)
        assert [c.requested for c in gated.issued] == SIZES
        assert (slot_bytes(tier, slots) == (np.arange(SLOTS) % 251 + 1)).all()
        settled(engine, tier, stage)


@pytest.mark.parametrize("owner", ["tier", "stage"])
@pytest.mark.parametrize("phase", ["held", "issuing"])
async def test_a_region_closed_under_pieces_waits_for_every_one(owner: str, phase: str) -> None:
    recording = RecordingBackend(hold=True, memmove=True) if phase == "held" else Gated(2, memmove=True)
    async with rig(recording) as (tier, stage, engine, _):
        slots = await allocated(tier)
        fill(stage)
        call = asyncio.ensure_future(engine.to_host(tier, slots, addresses(stage, np.arange(SLOTS))))
        if isinstance(recording, Gated):
            await eventually(recording.entered.is_set)
        else:
            await bounded(recording.wait_issued(N))
        region = tier if owner == "tier" else stage
        closing = asyncio.ensure_future(region.aclose())
        await turns(50)
        assert not closing.done(), f"the {owner} closed with pieces in flight over it"
        if isinstance(recording, Gated):
            recording.gate.set()
        else:
            recording.release()
        await bounded(closing)
        await bounded(call)
        assert region.closed and len(region.copies) == 0
        assert [c.requested for c in recording.issued] == SIZES
        stats = engine.statistics()
        assert stats.jobs_submitted == stats.jobs_completed == 1


async def test_a_shrink_past_the_slots_is_refused_and_one_past_the_free_tail_waits_for_the_pieces() -> None:
    async with rig(RecordingBackend(hold=True), quota=96 * MiB) as (tier, stage, engine, recording):
        slots = await allocated(tier)
        call = asyncio.ensure_future(engine.to_device(tier, slots, addresses(stage, np.arange(SLOTS))))
        await bounded(recording.wait_issued(N))
        with pytest.raises(QuotaError, match="allocated"):
            await bounded(tier.resize(32 * MiB))
        shrinking = asyncio.ensure_future(tier.resize(64 * MiB))  # the free tail past every slot copied
        await turns(50)
        assert not shrinking.done(), "the shrink went on with pieces in flight over the tier"
        recording.release()
        await bounded(shrinking)
        await bounded(call)
        assert tier.statistics().quota == 64 * MiB
        settled(engine, tier, stage)
        check_tier(tier)


@pytest.mark.parametrize("closed", ["engine", "tier", "stage"])
async def test_a_close_on_one_loop_while_another_loops_pieces_are_held(closed: str) -> None:
    async with rig(RecordingBackend(hold=True, memmove=True)) as (tier, stage, engine, recording):
        slots = await allocated(tier)
        fill(stage)
        outcome: list[object] = []

        def other_loop() -> None:
            async def copy() -> None:
                await engine.to_host(tier, slots, addresses(stage, np.arange(SLOTS)))

            try:
                asyncio.run(asyncio.wait_for(copy(), HANG))
                outcome.append("copied")
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=other_loop)
        thread.start()
        try:
            await eventually(lambda: len(recording.issued) == N, HANG)
            target: Any = {"engine": engine, "tier": tier, "stage": stage}[closed]
            closing = asyncio.ensure_future(target.aclose())
            await turns(50)
            assert not closing.done() and not outcome
            recording.release()
            await bounded(closing)
        finally:
            recording.release()
            await asyncio.to_thread(thread.join, HANG)
        assert outcome == ["copied"]
        assert (slot_bytes(tier, slots) == (np.arange(SLOTS) % 251 + 1)).all() if closed != "tier" else tier.closed
        stats = engine.statistics()
        assert stats.jobs_submitted == stats.jobs_completed == 1 and len(tier.copies) == len(stage.copies) == 0


async def test_a_request_in_pieces_from_a_second_loop_is_refused_once_the_engine_closed() -> None:
    async with rig() as (tier, stage, engine, recording):
        slots = await allocated(tier)
        await bounded(engine.aclose())
        errors: list[BaseException] = []

        def other_loop() -> None:
            try:
                asyncio.run(engine.to_host(tier, slots, addresses(stage, np.arange(SLOTS))))
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=other_loop)
        thread.start()
        await asyncio.to_thread(thread.join, HANG)
        assert len(errors) == 1 and "clos" in str(errors[0])
        assert recording.issued == [] and len(tier.copies) == 0


# -- a piece that fails to plan, issue or land ------------------------------------------------------


@pytest.mark.parametrize("failing", range(1, N + 1))
async def test_a_piece_whose_plan_raises_fails_its_request_after_the_pieces_before_landed(
    failing: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The planner seam of ``Pieces.plans()``, made to raise at piece ``failing``, while a second
    engine on a loop of its own copies small requests (planned on their loops, never through it)."""
    real = _plan.plan
    planned = [0]

    def planner(*args: Any, **kwargs: Any) -> Any:
        planned[0] += 1
        if planned[0] == failing:
            raise MemoryError(f"piece {failing} could not be planned")
        return real(*args, **kwargs)

    monkeypatch.setattr(_plan, "plan", planner)
    async with rig(RecordingBackend(hold=True, memmove=True)) as (tier, stage, engine, recording):
        slots = await allocated(tier)
        others: list[object] = []

        def other_loop() -> None:
            async def small() -> None:
                async with CopyEngine(None, backend=RecordingBackend(memmove=True)) as other:
                    for i in range(50):
                        await other.to_device(tier, slots[i : i + 4], addresses(stage, np.arange(4) + 4 * i))
                    others.append(other.statistics().jobs_completed)

            try:
                asyncio.run(asyncio.wait_for(small(), HANG))
            except BaseException as exc:
                others.append(exc)

        thread = threading.Thread(target=other_loop)
        thread.start()
        call = asyncio.ensure_future(engine.to_host(tier, slots, addresses(stage, np.arange(SLOTS))))
        await eventually(lambda: planned[0] >= failing, HANG)
        await turns()
        assert recording.held == failing - 1  # nothing issued after the piece that failed
        if failing > 1:
            assert not call.done(), "the caller saw the error with pieces in flight"
        recording.release()
        with pytest.raises(MemoryError, match=f"piece {failing}"):
            await bounded(call)
        await asyncio.to_thread(thread.join, HANG)
        assert others == [50]
        settled(engine, tier, stage)
        monkeypatch.setattr(_plan, "plan", real)
        recording.hold = False
        await bounded(engine.to_host(tier, slots, addresses(stage, np.arange(SLOTS))))  # the engine goes on
        settled(engine, tier, stage)
        check_tier(tier)


@pytest.mark.parametrize("failing", range(N))
async def test_a_piece_that_fails_to_land_fails_its_request_once_every_piece_was_waited_for(failing: int) -> None:
    async with rig(Waits(hold=True, memmove=True)) as (tier, stage, engine, recording):
        assert isinstance(recording, Waits)
        slots = await allocated(tier)
        fill(stage)
        call = asyncio.ensure_future(engine.to_host(tier, slots, addresses(stage, np.arange(SLOTS))))
        await bounded(recording.wait_issued(N))
        recording.release(failing)
        recording.fail(RuntimeError(f"piece {failing} failed"), 1)
        await turns()
        if failing < N - 1:
            assert not call.done()
        recording.fail(RuntimeError("a later piece failed too"))  # the first error is the caller's
        with pytest.raises(RuntimeError, match=f"piece {failing} failed"):
            await bounded(call)
        assert recording.waited == N
        landed = slot_bytes(tier, slots[:failing])  # the pieces before the failed one copied
        assert (landed == (np.arange(failing) % 251 + 1)).all()
        settled(engine, tier, stage)


# -- hostile input at the bound ----------------------------------------------------------------


async def test_requests_at_the_bound() -> None:
    async with rig(RecordingBackend()) as (tier, stage, engine, recording):
        slots = await allocated(tier)
        pages = addresses(stage, np.arange(SLOTS))
        await bounded(engine.to_device(tier, slots[:PIECES_FROM], pages[:PIECES_FROM]))
        assert [c.requested for c in recording.issued] == [4096, 4096]
        await bounded(engine.to_host(tier, slots[: PIECES_FROM - 1], pages[: PIECES_FROM - 1]))
        assert [c.requested for c in recording.issued[2:]] == [PIECES_FROM - 1]
        for ids in (
            iter(slots.tolist()),  # read once, by the checks
            slots.astype(np.uint16),
            slots.astype(np.int32)[::-1],  # not contiguous
            np.ascontiguousarray(slots[::-1].astype(np.uint32)),
            tuple(slots.tolist()),
        ):
            before = len(recording.issued)
            await bounded(engine.to_host(tier, ids, pages))
            assert [c.requested for c in recording.issued[before:]] == SIZES
        stats = engine.statistics()
        assert stats.jobs_in_pieces == 6 and stats.jobs_submitted == stats.jobs_completed == 7
        assert stats.bytes_copied == (PIECES_FROM + PIECES_FROM - 1 + 5 * SLOTS) * PAGE


def _repeated(slots: np.ndarray, i: int, j: int) -> np.ndarray:
    out = slots.copy()
    out[j] = out[i]
    return out


def _hostile(slots: np.ndarray, pages: np.ndarray) -> list[tuple[str, str, Any, Any, dict[str, Any], type]]:
    """``(name, direction, ids, buffer, keywords, error)``: requests of at least ``pieces_from`` pages refused."""
    huge = slots.copy()
    huge[-1] = 2**63 - 1
    negative = slots.copy()
    negative[4096] = -1
    listed = slots.tolist()
    floated: list[Any] = [*listed[:-1], 3.0]
    flagged: list[Any] = [True, *listed[1:]]
    twice_pages = pages.copy()
    twice_pages[4096] = twice_pages[4095]
    last_pages = pages.copy()
    last_pages[-1] = last_pages[0]
    shifted = pages + np.uint64(PAGE // 2) * (np.arange(SLOTS) % 2 == 1)  # odd pages half a page on
    return [
        ("huge id", "d2h", huge, pages, {}, SlotError),
        ("negative id", "h2d", negative, pages, {}, SlotError),
        ("id past 2**64", "h2d", [*listed[:-1], 2**64], pages, {}, SlotError),
        ("float id", "d2h", floated, pages, {}, SlotError),
        ("bool id", "h2d", flagged, pages, {}, SlotError),
        ("float array", "h2d", slots.astype(np.float64), pages, {}, SlotError),
        ("bool array", "d2h", np.ones(SLOTS, dtype=bool), pages, {}, SlotError),
        ("uint64 past 2**63", "h2d", np.full(SLOTS, 2**64 - 1, dtype=np.uint64), pages, {}, SlotError),
        ("object array", "h2d", slots.astype(object), pages, {}, SlotError),
        ("2-d array", "d2h", slots.reshape(2, -1), pages, {}, SlotError),
        ("2-d array, one row", "d2h", slots.reshape(1, -1), pages, {}, SlotError),
        ("0-d array", "h2d", np.array(3), pages[:1], {}, SlotError),
        ("page past the slot", "h2d", slots, pages, {"page": PAGE + 1}, CopyPlanError),
        ("page of zero", "d2h", slots, pages, {"page": 0}, ValueError),
        ("page a bool", "d2h", slots, pages, {"page": True}, TypeError),
        ("rows past the slot", "h2d", slots[: SLOTS // 2], rows_view(pages, 2 * PAGE), {}, CopyPlanError),
        ("one address short", "d2h", slots, pages[:-1], {}, ValueError),
        ("repeated: first two", "d2h", _repeated(slots, 0, 1), pages, {}, SlotError),
        ("repeated: across the first boundary", "d2h", _repeated(slots, 4095, 4096), pages, {}, SlotError),
        ("repeated: last and first", "d2h", _repeated(slots, 0, SLOTS - 1), pages, {}, SlotError),
        ("repeated: last two", "d2h", _repeated(slots, SLOTS - 2, SLOTS - 1), pages, {}, SlotError),
        ("repeated as an iterator", "d2h", iter(_repeated(slots, 10, 10240).tolist()), pages, {}, SlotError),
        ("destinations repeated at a boundary", "h2d", slots, twice_pages, {}, CopyPlanError),
        ("destinations repeated first and last", "h2d", slots, last_pages, {}, CopyPlanError),
        ("destinations overlapping", "h2d", slots, shifted, {}, CopyPlanError),
    ]


def rows_view(pages: np.ndarray, row: int) -> np.ndarray:
    """An array over the stage whose rows are ``row`` bytes (a page per slot; the stage's memory)."""
    n = SLOTS * PAGE // row
    buffer = (ctypes.c_uint8 * (n * row)).from_address(int(pages[0]))
    return np.frombuffer(buffer, dtype=np.uint8).reshape(n, row)


@pytest.mark.parametrize("case", range(25))
async def test_hostile_input_is_refused_before_any_piece_and_changes_nothing(case: int) -> None:
    async with rig(RecordingBackend()) as (tier, stage, engine, recording):
        slots = await allocated(tier)
        cases = _hostile(slots, addresses(stage, np.arange(SLOTS)))
        assert len(cases) == 25
        name, direction, ids, buffer, keywords, error = cases[case]
        call = engine.to_device if direction == "h2d" else engine.to_host
        for busy in (False, True):  # alone, and on a busy engine (deferred, or not for its size)
            if busy:
                recording.hold = True
                first = asyncio.ensure_future(engine.to_device(tier, slots[:1], addresses(stage, [0])))
                await bounded(recording.wait_issued(1))
                ids = iter(ids) if isinstance(ids, type(iter([]))) else ids
            before = len(recording.issued)
            with pytest.raises(error):
                await bounded(call(tier, ids, buffer, **keywords))
            assert len(recording.issued) == before, f"{name}: a piece was issued"
            if busy:
                recording.release()
                recording.hold = False
                await bounded(first)
            settled(engine, tier, stage)
            if isinstance(ids, type(iter([]))):
                break  # an iterator is read once
        assert engine.statistics().jobs_in_pieces == 0 and engine.statistics().copies_requested <= 1


# -- begin() and start() in pieces ---------------------------------------------------------------


async def test_begin_settles_submitted_once_every_piece_is_issued_and_done_once_every_one_landed() -> None:
    gated = Gated(N, hold=True, memmove=True)
    async with rig(gated) as (tier, stage, engine, _):
        slots = await allocated(tier)
        fill(stage)
        started = engine.begin(tier, slots, addresses(stage, np.arange(SLOTS)), "d2h")
        await eventually(gated.entered.is_set)
        await turns()
        assert not started.submitted.done(), "submitted settled before the last piece was issued"
        gated.gate.set()
        await bounded(started.submitted)
        assert [c.requested for c in gated.issued] == SIZES
        for _ in range(N):
            await turns()
            assert not started.done.done()
            gated.release(1)
        await bounded(started.done)
        assert (slot_bytes(tier, slots) == (np.arange(SLOTS) % 251 + 1)).all()
        settled(engine, tier, stage)


@pytest.mark.parametrize("report_issue", [False, True])
async def test_start_with_checked_pages_copies_in_pieces_and_refuses_a_region_closed_since(
    report_issue: bool,
) -> None:
    async with rig() as (tier, stage, engine, recording):
        slots = await allocated(tier)
        fill(stage)
        pages = engine.pages(addresses(stage, np.arange(SLOTS)).astype(np.int64), SLOTS, page=PAGE, writable=False)
        order = np.random.default_rng(2).permutation(SLOTS)
        started = engine.start(tier, slots, pages.take(order), "d2h", report_issue=report_issue)
        await bounded(started.submitted)
        await bounded(started.done)
        assert (slot_bytes(tier, slots) == (order % 251 + 1)).all()
        assert [c.requested for c in recording.issued] == SIZES
        async with StaticHostMem(SLOTS * PAGE) as other:
            gone = engine.pages(addresses(other, np.arange(SLOTS)), SLOTS, page=PAGE, writable=True)
        with pytest.raises(CopyPlanError, match="closed"):
            engine.start(tier, slots, gone, "h2d", report_issue=report_issue)
        assert len(recording.issued) == N
        settled(engine, tier, stage)


async def test_addresses_the_caller_rewrites_after_the_call_do_not_move_its_pieces() -> None:
    """``begin()`` returns before the submit thread plans the later pieces: they copy the addresses
    checked when the call was made, not what the caller's array holds by then (before the fix, an
    int64 array was kept as it was, and pieces copied from wherever it pointed, never checked)."""
    gated = Gated(1, memmove=True)
    async with rig(gated) as (tier, stage, engine, _):
        slots = await allocated(tier, SLOTS // 2)
        half = SLOTS // 2
        write_rows(stage, np.repeat(np.array([1, 2]), half))
        mine = addresses(stage, np.arange(half)).astype(np.int64)
        started = engine.begin(tier, slots, mine, "d2h")
        await eventually(gated.entered.is_set)
        mine[:] = addresses(stage, np.arange(half, SLOTS)).astype(np.int64)
        gated.gate.set()
        await bounded(started.done)
        assert (slot_bytes(tier, slots) == 1).all()
        # Pages checked once, then rewritten by the caller before a start: the checked ones copy.
        listed = addresses(stage, np.arange(half)).astype(np.int64)
        pages = engine.pages(listed, half, page=PAGE, writable=False)
        listed[:] = 64  # no region's: a memmove from there would kill the process
        await bounded(engine.start(tier, slots, pages, "d2h").done)
        assert (slot_bytes(tier, slots) == 1).all()
        settled(engine, tier, stage)


# -- a busy engine: a large request among deferred small ones ---------------------------------------


async def test_a_large_request_among_small_ones_of_one_turn_is_not_deferred_and_the_small_ones_coalesce() -> None:
    recording = RecordingBackend(hold=True, memmove=True, coalesce=True)
    async with rig(recording) as (tier, stage, engine, _):
        slots = await allocated(tier)
        fill(stage)
        pages = addresses(stage, np.arange(SLOTS))
        first = asyncio.ensure_future(engine.to_host(tier, slots[:4], pages[:4]))
        await bounded(recording.wait_issued(1))
        tasks = [
            asyncio.ensure_future(engine.to_host(tier, slots[4:8], pages[4:8])),
            asyncio.ensure_future(engine.to_host(tier, slots[8:], pages[8:])),
            asyncio.ensure_future(engine.to_host(tier, [SLOTS + 5, 10], pages[10:12])),  # refused alone
            asyncio.ensure_future(engine.to_host(tier, slots[12:14], pages[12:14])),  # meets the large one's slots
            asyncio.ensure_future(engine.to_host(tier, slots[:2].tolist(), pages[:2].tolist())),
        ]
        await bounded(recording.wait_issued(1 + N + 1))
        issued = [c.requested for c in recording.issued[1:]]
        assert issued == [4096, 6144, 6136, 4 + 2 + 2], issued  # the large one first, then the small ones as one
        recording.hold = False
        recording.release()
        results = await bounded(asyncio.gather(first, *tasks, return_exceptions=True))
        assert [r is None for r in results] == [True, True, True, False, True, True]
        assert isinstance(results[3], SlotError)
        assert (slot_bytes(tier, slots) == (np.arange(SLOTS) % 251 + 1)).all()
        stats = engine.statistics()
        assert stats.jobs_in_pieces == 1 and stats.jobs_coalesced == 3
        settled(engine, tier, stage)


async def test_a_0d_array_of_ids_is_a_slot_error_on_an_idle_and_a_busy_engine() -> None:
    """Before the fix: ``TypeError: len() of unsized object`` from the choice between deferring and pieces."""
    async with rig(RecordingBackend(hold=True)) as (tier, stage, engine, recording):
        slots = await allocated(tier, 8)
        with pytest.raises(SlotError, match="shape"):
            await bounded(engine.to_device(tier, np.array(3), addresses(stage, [0])))
        first = asyncio.ensure_future(engine.to_device(tier, slots, addresses(stage, np.arange(8))))
        await bounded(recording.wait_issued(1))
        with pytest.raises(SlotError, match="shape"):
            await bounded(engine.to_host(tier, np.array(3), addresses(stage, [0])))
        recording.release()
        recording.hold = False
        await bounded(first)
        settled(engine, tier, stage)


# -- the CUDA backend's side, over the model driver ----------------------------------------------


@pytest.mark.usefixtures("model_sm")
async def test_a_piece_whose_event_fails_fails_its_request_after_every_piece_and_gives_every_slab_back() -> None:
    model = _driver.driver()  # the fixture's model, through the seam it patched
    assert isinstance(model, ModelDriver)
    synced = [0]
    real = model.cuEventSynchronize

    def failing_second(event: int) -> Any:
        synced[0] += 1
        return (type(real(event)[0])(1),) if synced[0] == 2 else real(event)

    model.cuEventSynchronize = failing_second  # type: ignore[method-assign]
    async with HostTier(_config()) as tier:
        await tier.wait_resident()
        slots = await allocated(tier, 9000)
        spread = [DEVICE + 2 * i * PAGE for i in range(9000)]
        async with CopyEngine(0, method="sm") as engine:
            sm = ModelSmPath.made[-1]
            with pytest.raises(CudaError, match="cuEventSynchronize"):
                await bounded(engine.to_device(tier, slots, spread))
            assert sm.launched == [4096, 4904] and sm.out == 0 and synced[0] == 2
            await bounded(engine.to_host(tier, slots, spread))  # the engine goes on
            assert sm.out == 0 and ModelBatch.calls == []
            settled(engine, tier)
            assert engine.statistics().jobs_in_pieces == 2
    assert not model.streams and not model.events


@pytest.mark.usefixtures("model_sm")
async def test_a_refused_launch_of_a_later_piece_fails_its_request_after_the_pieces_before() -> None:
    async with HostTier(_config()) as tier:
        await tier.wait_resident()
        slots = await allocated(tier, SLOTS)
        spread = [DEVICE + 2 * i * PAGE for i in range(SLOTS)]
        async with CopyEngine(0, method="sm") as engine:
            sm = ModelSmPath.made[-1]
            real = ModelSmPath.submit

            def refuse_third(self: ModelSmPath, *args: Any) -> object:
                if len(self.launched) == 2:
                    raise CudaError("cuLaunchKernel", "CUDA_ERROR_INJECTED", 1)
                return real(self, *args)

            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(ModelSmPath, "submit", refuse_third)
                with pytest.raises(CudaError, match="INJECTED"):
                    await bounded(engine.to_host(tier, slots, spread))
            assert sm.launched == SIZES[:2] and sm.out == 0
            settled(engine, tier)


@pytest.mark.usefixtures("model_sm")
async def test_a_request_the_kernel_cannot_take_goes_whole_to_the_copy_engines() -> None:
    """``"auto"`` sends to the kernel only what it moves in 16-byte accesses: a request of odd
    addresses or pages goes to the copy engines, whole (before the fix, in pieces: a driver call
    of 128 descriptors again at each piece, 14 calls where the whole takes 11)."""
    async with HostTier(_config()) as tier:
        await tier.wait_resident()
        slots = await allocated(tier, 9000)
        even = [DEVICE + 2 * i * PAGE for i in range(9000)]
        async with CopyEngine(0, crossover={"h2d": 64 * KiB, "d2h": 64 * KiB}) as engine:
            sm = ModelSmPath.made[-1]
            await bounded(engine.to_device(tier, slots, [a + 8 for a in even]))  # odd addresses
            await bounded(engine.to_host(tier, slots, even, page=PAGE - 8))  # odd pages
            assert sm.launched == [] and sum(n for _, n, _ in ModelBatch.calls) == 2 * 9000
            assert len(ModelBatch.calls) == 2 * 11
            await bounded(engine.to_host(tier, slots, even))  # the kernel's: in pieces
            assert sm.launched == [4096, 4904]
            stats = engine.statistics()
            assert stats.jobs_in_pieces == 1 and stats.jobs_by_method == {"sm": 1, "dma": 2}
            settled(engine, tier)
