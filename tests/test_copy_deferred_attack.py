"""Requests made while the engine is busy, under attack: each must come out as if made alone.

Every request here is made twice: alone, on an idle engine (it is checked and queued at once), and
deferred, on an engine whose first copy is held (it is checked and planned at the end of the loop's
turn, with the others of that turn). The two must give the same plan, the same error (type and
words), the same cancellation; nothing may leak either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest

from aiokvtier import CopyEngine, CopyPlanError, HostTier, StaticHostMem, TierClosedError
from aiokvtier.testing import RecordingBackend

from .held_copies import staged_rows
from .helpers import KiB, MiB, small_config
from .invariants import wait_no_library_threads
from .test_cancellation import run_script

SLOT = 64 * KiB
ROWS = 64
HANG = 10.0

Call = Callable[[CopyEngine, HostTier, HostTier, StaticHostMem], Awaitable[None]]


def _over(address: int, pages: int, page: int = SLOT) -> np.ndarray:
    """A writable array of ``pages`` rows over memory nobody else's view keeps."""
    raw = (ctypes.c_uint8 * (pages * page)).from_address(address)
    return np.frombuffer(raw, dtype=np.uint8).reshape(pages, page)


def _row(stage: StaticHostMem, i: int) -> int:
    return stage.address + i * SLOT


@asynccontextmanager
async def _world() -> AsyncIterator[tuple[HostTier, HostTier, StaticHostMem]]:
    """Two tiers (64 and 8 allocated slots of known bytes) and a staging buffer of 64 rows."""
    async with (
        HostTier(small_config()) as tier,
        HostTier(small_config(quota=8 * MiB)) as other,
        StaticHostMem(ROWS * SLOT) as stage,
    ):
        await tier.wait_resident()
        await other.wait_resident()
        assert await tier.allocate(64) == list(range(64))
        assert await other.allocate(8) == list(range(8))
        for s in range(64):
            tier.view(s)[:] = bytes([s + 1]) * SLOT
        yield tier, other, stage
    await wait_no_library_threads()


@asynccontextmanager
async def _busy(tier: HostTier, stage: StaticHostMem) -> AsyncIterator[tuple[CopyEngine, RecordingBackend]]:
    """An engine whose first copy (slot 0 into the stage's last row) is issued and held: busy."""
    recording = RecordingBackend(hold=True, memmove=True)
    async with CopyEngine(None, backend=recording) as engine:
        first = asyncio.ensure_future(engine.to_device(tier, [0], [_row(stage, ROWS - 1)]))
        await asyncio.wait_for(recording.wait_issued(1), HANG)
        try:
            yield engine, recording
        finally:
            recording.hold = False  # a test that failed with copies held must not hang the close
            recording.release()
            await asyncio.wait_for(first, HANG)
            _idle(engine, tier, stage)


def _idle(engine: CopyEngine, *tiers: Any) -> None:
    stats = engine.statistics()
    assert stats.jobs_submitted == stats.jobs_completed == stats.latency_count, stats
    assert all(len(t.copies) == 0 for t in tiers)


def _outcome(result: Any) -> tuple[Any, ...]:
    if isinstance(result, BaseException):
        return (type(result).__name__, str(result))
    return ("ok",)


def _plans(recording: RecordingBackend, skip: int = 0) -> list[tuple[Any, ...]]:
    return sorted((c.direction, c.dsts, c.srcs, c.sizes, c.requested) for c in recording.issued[skip:])


async def _alone(calls: list[Call], tier: HostTier, other: HostTier, stage: StaticHostMem) -> tuple[list[Any], Any]:
    """Each request made alone, on an idle engine: its outcome, and the plans issued."""
    recording = RecordingBackend(memmove=True)
    async with CopyEngine(None, backend=recording) as engine:
        outcomes = []
        for call in calls:
            result = await asyncio.wait_for(
                asyncio.gather(call(engine, tier, other, stage), return_exceptions=True), HANG
            )
            outcomes.append(_outcome(result[0]))
        _idle(engine, tier, other, stage)
    return outcomes, _plans(recording)


async def _deferred(calls: list[Call], tier: HostTier, other: HostTier, stage: StaticHostMem) -> tuple[list[Any], Any]:
    """The same requests made in one turn while the engine is busy."""
    async with _busy(tier, stage) as (engine, recording):
        tasks = [asyncio.ensure_future(call(engine, tier, other, stage)) for call in calls]
        for _ in range(3):
            await asyncio.sleep(0)
        recording.release()
        recording.hold = False
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), HANG)
    return [_outcome(r) for r in results], _plans(recording, skip=1)


def _good() -> list[Call]:
    """Requests that pass: both directions, both tiers, lists, tuples, arrays of ids, arrays of pages."""
    return [
        lambda e, t, o, s: e.to_device(t, [5, 6], [_row(s, 10), _row(s, 11)]),
        lambda e, t, o, s: e.to_device(t, (9, 7, 8), [_row(s, 12), _row(s, 13), _row(s, 14)]),
        lambda e, t, o, s: e.to_device(t, np.array([21, 22], dtype=np.uint16), [_row(s, 15), _row(s, 16)]),
        lambda e, t, o, s: e.to_device(t, np.array([23, 23], dtype=np.int8), [_row(s, 17), _row(s, 18)]),
        lambda e, t, o, s: e.to_device(t, [24, 25], _over(_row(s, 19), 2)),
        lambda e, t, o, s: e.to_device(t, [26, 27], _over(_row(s, 21), 2)),  # the same array's check, kept
        lambda e, t, o, s: e.to_device(t, [26, 27], _over(_row(s, 21), 2)),
        lambda e, t, o, s: e.to_device(t, [28], [_row(s, 23)], page=SLOT // 2),
        lambda e, t, o, s: e.to_device(t, [29], [_row(s, 23) + SLOT // 2], page=SLOT // 2),
        lambda e, t, o, s: e.to_device(t, [31, 30], np.array([_row(s, 25), _row(s, 24)], dtype=np.uint64)),
        lambda e, t, o, s: e.to_device(o, [0, 1], [_row(s, 26), _row(s, 27)]),
        lambda e, t, o, s: e.to_host(t, [40, 41], [_row(s, 0), _row(s, 1)]),
        lambda e, t, o, s: e.to_host(t, [43, 42], _over(_row(s, 2), 2)),
        lambda e, t, o, s: e.to_host(o, [3, 2], [_row(s, 4), _row(s, 5)]),
        lambda e, t, o, s: e.to_host(o, np.array([4]), [_row(s, 6)], page=4096),
        lambda e, t, o, s: e.to_device(t, list(range(20, 60)), [_row(s, 28) + i for i in range(40)], page=1),
    ]


def _bad() -> list[Call]:
    """Requests that are refused: slot ids, buffers and ``page=`` of every wrong kind."""
    frozen = np.frombuffer(bytes(2 * SLOT), dtype=np.uint8).reshape(2, SLOT)
    return [
        # slot ids
        lambda e, t, o, s: e.to_device(t, [1, 99], [_row(s, 30), _row(s, 31)]),
        lambda e, t, o, s: e.to_device(t, [1, -1], [_row(s, 30), _row(s, 31)]),
        lambda e, t, o, s: e.to_device(t, [1, True], [_row(s, 30), _row(s, 31)]),
        lambda e, t, o, s: e.to_device(t, [1, 2.0], [_row(s, 30), _row(s, 31)]),
        lambda e, t, o, s: e.to_device(t, [1, "2"], [_row(s, 30), _row(s, 31)]),
        lambda e, t, o, s: e.to_device(t, [1, None], [_row(s, 30), _row(s, 31)]),
        lambda e, t, o, s: e.to_device(t, [1, 2**64], [_row(s, 30), _row(s, 31)]),
        lambda e, t, o, s: e.to_device(t, [1, np.int64(2)], [_row(s, 30), _row(s, 31)]),
        lambda e, t, o, s: e.to_device(t, np.array([1, 2**63 + 1], dtype=np.uint64), [_row(s, 30), _row(s, 31)]),
        lambda e, t, o, s: e.to_device(t, np.array([1, 2**64 - 2], dtype=np.uint64), [_row(s, 30), _row(s, 31)]),
        lambda e, t, o, s: e.to_device(t, np.array([True, False]), [_row(s, 30), _row(s, 31)]),
        lambda e, t, o, s: e.to_device(t, np.array([1.0, 2.0]), [_row(s, 30), _row(s, 31)]),
        lambda e, t, o, s: e.to_device(t, np.array([[1, 2]]), [_row(s, 30), _row(s, 31)]),
        lambda e, t, o, s: e.to_device(t, np.array(3), [_row(s, 30)]),
        lambda e, t, o, s: e.to_device(t, np.array([1, 2], dtype=object), [_row(s, 30), _row(s, 31)]),
        lambda e, t, o, s: e.to_device(t, np.array([], dtype=np.int64), []),
        lambda e, t, o, s: e.to_device(t, [], []),
        lambda e, t, o, s: e.to_device(o, [1, 9], [_row(s, 30), _row(s, 31)]),
        lambda e, t, o, s: e.to_host(t, [45, 45], [_row(s, 0), _row(s, 1)]),
        lambda e, t, o, s: e.to_host(t, np.array([46, 46]), _over(_row(s, 2), 2)),
        # buffers
        lambda e, t, o, s: e.to_device(t, [1, 2], frozen),
        lambda e, t, o, s: e.to_device(t, [1, 2], _over(_row(s, 30), 1)),  # too short
        lambda e, t, o, s: e.to_device(t, [1], _over(_row(s, 30), 1, 2 * SLOT)),  # rows longer than a slot
        lambda e, t, o, s: e.to_device(t, [1, 2], _over(_row(s, 30), 4)[::2]),  # not contiguous
        lambda e, t, o, s: e.to_device(t, [1], _over(_row(s, ROWS - 1) + SLOT // 2, 1)),  # its row leaves the stage
        lambda e, t, o, s: e.to_device(t, [1, 2], [_row(s, 30), _row(s, 30) + SLOT // 2]),  # overlapping
        lambda e, t, o, s: e.to_device(t, [1, 2], [_row(s, 30), _row(s, 30)]),
        lambda e, t, o, s: e.to_device(t, [1, 2], [_row(s, 30)]),  # one address short
        lambda e, t, o, s: e.to_device(t, [1, 2], [_row(s, 30), float(_row(s, 31))]),
        lambda e, t, o, s: e.to_device(t, [1, 2], [_row(s, 30), True]),
        lambda e, t, o, s: e.to_device(t, [1, 2], [_row(s, 30), -5]),
        lambda e, t, o, s: e.to_device(t, [1, 2], [_row(s, 30), 64]),  # in no region
        lambda e, t, o, s: e.to_device(t, [1, 2], np.array([_row(s, 30), _row(s, 31)], dtype=np.float64)),
        lambda e, t, o, s: e.to_device(t, [1], [_row(s, ROWS - 1) + 4096]),  # runs past the stage
        lambda e, t, o, s: e.to_device(t, [1], "abc"),
        lambda e, t, o, s: e.to_device(t, [1], b"abc"),
        lambda e, t, o, s: e.to_device(t, [1], _row(s, 30)),
        lambda e, t, o, s: e.to_device(t, [1], None),
        lambda e, t, o, s: e.to_host(t, [1], [_row(s, 30) + 3]),  # from an odd address: fine
        # page=
        lambda e, t, o, s: e.to_device(t, [4], [_row(s, 32)], page=True),
        lambda e, t, o, s: e.to_device(t, [4], [_row(s, 32)], page=0),
        lambda e, t, o, s: e.to_device(t, [4], [_row(s, 32)], page=-1),
        lambda e, t, o, s: e.to_device(t, [4], [_row(s, 32)], page=1.5),
        lambda e, t, o, s: e.to_device(t, [4], [_row(s, 32)], page="1"),
        lambda e, t, o, s: e.to_device(t, [4], [_row(s, 32)], page=[1]),
        lambda e, t, o, s: e.to_device(t, [4], [_row(s, 32)], page=2**70),
        lambda e, t, o, s: e.to_device(t, [4], [_row(s, 32)], page=SLOT + 1),
        lambda e, t, o, s: e.to_device(t, [4], [_row(s, 32)], page=np.int64(4096)),
        lambda e, t, o, s: e.to_device(t, [4, 5], _over(_row(s, 32), 2), page=7),  # an array's page is its row
    ]


async def test_a_mix_of_good_and_bad_requests_in_one_turn_come_out_as_each_alone() -> None:
    async with _world() as (tier, other, stage):
        calls = _good() + _bad()
        alone, alone_plans = await _alone(calls, tier, other, stage)
        deferred, deferred_plans = await _deferred(calls, tier, other, stage)
        for i, (a, d) in enumerate(zip(alone, deferred, strict=True)):
            assert a == d, f"request {i}: alone {a}, deferred {d}"
        assert deferred_plans == alone_plans
        assert alone[: len(_good())] == [("ok",)] * len(_good())
        # Some good and some bad, in every order: still each as alone.
        rng = np.random.default_rng(11)
        for _ in range(3):
            order = [int(i) for i in rng.permutation(len(calls))[:12]]
            picked = [calls[i] for i in order]
            got, plans = await _deferred(picked, tier, other, stage)
            assert got == [alone[i] for i in order]
            assert plans == sorted(p for p in (await _alone(picked, tier, other, stage))[1])


async def test_addresses_changed_after_a_deferred_request_was_made_do_not_move_its_copy() -> None:
    """A request reads its addresses when it is made, as one made alone does: a caller that reuses its
    list (or array) of addresses once the call has begun does not redirect the copy."""
    async with _world() as (tier, _, stage), _busy(tier, stage) as (engine, recording):
        with stage.view() as view:
            view[3 * SLOT : 5 * SLOT] = b"\xaa" * (2 * SLOT)
            view[41 * SLOT : 43 * SLOT] = b"\xbb" * (2 * SLOT)
        listed = [_row(stage, 1), _row(stage, 2)]
        array = np.array([_row(stage, 3), _row(stage, 4)], dtype=np.uint64)
        tasks = [
            asyncio.ensure_future(engine.to_device(tier, [5, 6], listed)),
            asyncio.ensure_future(engine.to_host(tier, [7, 8], array)),
        ]
        await asyncio.sleep(0)  # both requests made (and deferred); their turn has not ended
        listed[:] = [_row(stage, 40), 64]  # elsewhere, and an address in no region
        array[:] = [_row(stage, 41), _row(stage, 42)]
        await asyncio.wait_for(recording.wait_issued(3), HANG)
        recording.release()
        assert await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), HANG) == [None, None]
        rows = staged_rows(stage)
        assert (rows[1] == 6).all() and (rows[2] == 7).all() and not rows[40].any()
        assert bytes(tier.view(7)) == bytes(tier.view(8)) == b"\xaa" * SLOT


async def _refused_then_cancelled(engine: CopyEngine, tier: HostTier, stage: StaticHostMem, k: int) -> tuple[Any, ...]:
    """A refused request (slot 99) cancelled after ``k`` yields of the loop: how its caller ended."""
    task = asyncio.ensure_future(engine.to_device(tier, [99], [_row(stage, 1)]))
    for _ in range(k):
        await asyncio.sleep(0)
    task.cancel()
    (result,) = await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), HANG)
    return _outcome(result)


@pytest.mark.parametrize("k", range(5))
async def test_a_refused_request_cancelled_before_its_turn_ends_reports_its_error_as_alone(k: int) -> None:
    """Alone, a refused request raises before any cancel can reach it (its first step); deferred,
    the refusal comes a turn later, and a cancel in between must not hide it."""
    async with _world() as (tier, _, stage):
        async with CopyEngine(None, backend=RecordingBackend(memmove=True)) as engine:
            alone = await _refused_then_cancelled(engine, tier, stage, k)
        async with _busy(tier, stage) as (engine, _recording):
            deferred = await _refused_then_cancelled(engine, tier, stage, k)
        assert deferred == alone
        assert alone[0] == ("CancelledError" if k == 0 else "SlotError")  # k == 0: it never ran


async def _group(engine: CopyEngine, tier: HostTier, stage: StaticHostMem) -> list[tuple[Any, ...]]:
    """A TaskGroup whose one task fails at once, beside a refused request and a good one."""

    async def boom() -> None:
        raise RuntimeError("boom")

    good = asyncio.Event()

    async def copy() -> None:
        await engine.to_device(tier, [3], [_row(stage, 3)])
        good.set()

    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(engine.to_device(tier, [1, 99], [_row(stage, 1), _row(stage, 2)]))
            group.create_task(copy())
            group.create_task(boom())
    except BaseExceptionGroup as failed:
        return sorted(_outcome(e) for e in failed.exceptions)
    raise AssertionError("the group did not fail")


async def test_a_task_group_whose_sibling_fails_reports_a_refused_request_as_alone() -> None:
    async with _world() as (tier, _, stage):
        async with CopyEngine(None, backend=RecordingBackend(memmove=True)) as engine:
            alone = await asyncio.wait_for(_group(engine, tier, stage), HANG)
        async with _busy(tier, stage) as (engine, recording):
            recording.hold = False
            # The held first copy lands a little later, by a timer the group's failure cannot cancel.
            asyncio.get_running_loop().call_later(0.01, recording.release)
            deferred = await asyncio.wait_for(_group(engine, tier, stage), HANG)
        assert deferred == alone
        assert [kind for kind, _ in alone] == ["RuntimeError", "SlotError"]


class _Interface:
    """A host buffer exposing ``__array_interface__`` with lists where the protocol says tuples."""

    def __init__(self, address: int, rows: int, *, strides: bool = False) -> None:
        self.__array_interface__ = {
            "shape": [rows, SLOT],
            "typestr": "|u1",
            "data": (address, False),
            "strides": [SLOT, 1] if strides else None,
            "version": 3,
        }


async def test_a_buffer_whose_interface_gives_lists_is_copied_as_one_giving_tuples() -> None:
    """Before the check was kept, such a buffer was copied; the record's key must not refuse it."""
    async with _world() as (tier, _, stage):
        async with CopyEngine(None) as engine:
            for strides in (False, True):
                for _ in range(2):  # the second request of the same buffer meets the kept check
                    await engine.to_device(tier, [5, 6], _Interface(_row(stage, 8), 2, strides=strides))
                    assert (staged_rows(stage)[8] == 6).all() and (staged_rows(stage)[9] == 7).all()
                    await engine.to_host(tier, [10, 11], _Interface(_row(stage, 8), 2, strides=strides))
                    assert bytes(tier.view(10)) == bytes([6]) * SLOT
            _idle(engine, tier)


DELAYS = (0, 0.0001, 0.0002, 0.0005, 0.001, 0.0015, 0.002)


def _landed(stage: StaticHostMem, row: int) -> bool:
    """Whether slot ``row``'s bytes are in the stage's row ``row`` (requests below copy slot i to row i)."""
    return bool((staged_rows(stage)[row] == row + 1).all())


async def _interrupted(engine: CopyEngine, tier: HostTier, stage: StaticHostMem, wrap: str, i: int) -> bool:
    """Copy slot ``i`` to row ``i`` under a timeout, ``wait_for`` or a cancel after some yields; whether
    the bytes had landed when the caller came back."""
    call = engine.to_device(tier, [i], [_row(stage, i)])
    if wrap == "timeout":
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(DELAYS[i % len(DELAYS)]):
                await call
    elif wrap == "wait_for":
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(call, DELAYS[i % len(DELAYS)])
    else:
        task = asyncio.ensure_future(call)
        for _ in range(i % 7):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return _landed(stage, i)


async def test_callers_cancelled_or_timed_out_at_every_point_resume_only_once_their_copy_landed() -> None:
    """Timeouts of 0 to 2 ms and cancels after 0 to 6 yields: a caller whose copy was made comes back
    only once its bytes landed (the held first copy, which every other lands after, lands ~3 ms on)."""
    async with _world() as (tier, _, stage):
        for wrap in ("timeout", "wait_for", "cancel"):
            with stage.view() as view:
                view[:] = bytes(len(view))
            async with _busy(tier, stage) as (engine, recording):
                recording.hold = False
                asyncio.get_running_loop().call_later(0.003, recording.release)
                tasks = [asyncio.ensure_future(_interrupted(engine, tier, stage, wrap, i)) for i in range(1, 61)]
                at_return = await asyncio.wait_for(asyncio.gather(*tasks), HANG)
            finally_landed = [_landed(stage, i) for i in range(1, 61)]
            back_early = [i + 1 for i, (a, f) in enumerate(zip(at_return, finally_landed, strict=True)) if f and not a]
            assert not back_early, f"{wrap}: callers of rows {back_early} came back before their copy landed"
            if wrap == "timeout":  # each request is made before its timeout can fire
                assert all(finally_landed)
            assert any(finally_landed), wrap


@pytest.mark.parametrize("when", ["before", "after"])
async def test_a_tier_closed_or_shrunk_in_the_turn_of_deferred_requests_never_has_its_memory_copied_gone(
    when: str,
) -> None:
    """A close or shrink begun in the same turn as the requests, before or after their flush: each
    copy is waited for (its bytes right) or refused; none runs over memory going away."""
    async with _world() as (tier, _, stage):
        other = await HostTier.open(small_config(quota=8 * MiB))
        await other.wait_resident()
        ids = await other.allocate(8)
        for s in ids:
            other.view(s)[:] = bytes([0x40 + s]) * SLOT
        beyond = _over(other.statistics().base_address + 6 * MiB, 2)  # committed now; past 4 MiB
        async with _busy(tier, stage) as (engine, recording):
            loop = asyncio.get_running_loop()
            calls = [engine.to_device(other, [s], [_row(stage, s)]) for s in ids]
            calls.append(engine.to_device(tier, [1, 2], beyond))  # into the shrunk tier's memory
            calls.append(engine.to_host(other, [6, 7], beyond))  # out of it, into slots of the closing one
            tasks = [asyncio.ensure_future(c) for c in calls]
            ops: list[asyncio.Task[Any]] = []
            start = lambda: ops.extend([loop.create_task(other.resize(4 * MiB)), loop.create_task(other.aclose())])  # noqa: E731
            if when == "after":
                await asyncio.sleep(0)  # the requests are made, their flush queued: the close and shrink come after it
            start()  # else their first steps run right after the requests', before the flush
            await asyncio.sleep(0.005)
            recording.release()
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), HANG)
            await asyncio.wait_for(asyncio.gather(*ops, return_exceptions=True), HANG)
        rows = staged_rows(stage)
        for s, result in zip(ids, results, strict=False):
            assert result is None or isinstance(result, TierClosedError | CopyPlanError), result
            if result is None:
                assert (rows[s] == 0x40 + s).all()
        assert len(other.copies) == 0 and other.state == "closed"


# Requests deferred on two loops at once (the main one, and a thread's own), half of the thread's
# cancelled while deferred: every copy lands, each caller after its own, and the figures add up.
TWO_LOOPS_DEFER = """
import threading
from tests.held_copies import SLOT, busy_engine, staged_rows

async def main():
    async with busy_engine() as (tier, stage, engine, recording):  # slot 0's copy held: busy
        row = lambda s: stage.address + s * SLOT
        early = []

        async def theirs():
            async def one(s, cancel):
                task = asyncio.ensure_future(engine.to_device(tier, [s], [row(s)]))
                await asyncio.sleep(0)
                if cancel:
                    task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                with stage.view() as v:
                    if bytes(v[s * SLOT : (s + 1) * SLOT]) != bytes([s + 1]) * SLOT:
                        early.append(s)
            await asyncio.wait_for(asyncio.gather(*(one(s, s % 2 == 0) for s in range(21, 41))), 30)

        thread = threading.Thread(target=run, args=(theirs,))
        thread.start()
        mine = [asyncio.ensure_future(engine.to_device(tier, [s], [row(s)])) for s in range(1, 21)]
        await asyncio.wait_for(recording.wait_issued(41), 30)
        recording.release()
        await asyncio.wait_for(asyncio.gather(*mine), 30)
        await asyncio.to_thread(thread.join, 30)
        assert not thread.is_alive() and not early, early
        rows = staged_rows(stage)
        assert all((rows[s] == s + 1).all() for s in range(1, 41))
        stats = engine.statistics()
        print("jobs", stats.jobs_submitted, stats.jobs_completed, stats.latency_count, len(tier.copies), flush=True)

run(main)
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_requests_deferred_on_two_loops_at_once_all_land_and_add_up(loop: str) -> None:
    out = run_script(TWO_LOOPS_DEFER, loop, timeout=120)
    assert out.split() == ["jobs", "41", "41", "41", "0"], out


# fork() while requests wait for the end of the loop's turn: the child runs that turn's flush on its
# copy of the loop, and must queue nothing (the engine is the parent's); the parent's copies all land.
# The child's aclose() of the parent's engine (which flushes its loop's requests first) closes it
# quietly, as for any owner; it raised RuntimeError('no running event loop').
FORK_WHILE_DEFERRED = """
from tests.held_copies import SLOT, busy_engine, in_a_fork, staged_rows

async def main():
    async with busy_engine() as (tier, stage, engine, recording):  # slot 0's copy held: busy
        mine = [asyncio.ensure_future(engine.to_device(tier, [s], [stage.address + s * SLOT])) for s in range(1, 8)]
        await asyncio.sleep(0)  # deferred; their flush is the loop's next callback, in both processes

        async def in_the_child():
            # The child's loop runs on (this task, the turn's flush) but has no running loop to give
            # asyncio's helpers: bare yields only.
            for _ in range(5):
                await asyncio.sleep(0)
            ended = sorted({type(t.exception()).__name__ if t.done() else "pending" for t in mine})
            print("child", ended, len(recording.issued), flush=True)
            try:
                await engine.aclose()  # the parent's: closed here without a word, as any owner in a child
                print("child closed", engine, flush=True)
            except Exception as exc:
                print("child aclose:", repr(exc), flush=True)

        if not await in_a_fork(in_the_child, 20):
            print("child hung", flush=True)
        await asyncio.wait_for(recording.wait_issued(8), 30)
        recording.release()
        await asyncio.wait_for(asyncio.gather(*mine), 30)
        rows = staged_rows(stage)
        assert all((rows[s] == s + 1).all() for s in range(1, 8))
        stats = engine.statistics()
        print("parent", stats.jobs_submitted, stats.jobs_completed, stats.latency_count, len(tier.copies), flush=True)

run(main)
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_fork_while_requests_are_deferred_queues_nothing_in_the_child(loop: str) -> None:
    out = run_script(FORK_WHILE_DEFERRED, loop, timeout=90)
    assert "child ['TierClosedError'] 1" in out, out
    assert "parent 8 8 8 0" in out, out
    assert "child closed <CopyEngine [closed" in out, out


# The engine closed on another loop's thread while this loop's requests wait for the end of its turn
# (this loop blocked meanwhile, so that the close begins first): each is refused, as a request checked
# after the close began (the close cannot queue another loop's requests ahead of it), none waits
# forever, and nothing is left tracked.
CLOSED_BY_ANOTHER_LOOP = """
import threading, time
from aiokvtier import CopyEngine, HostTier, StaticHostMem, TierClosedError
from aiokvtier.testing import RecordingBackend
from tests.helpers import small_config
SLOT = 64 << 10

async def main():
    recording = RecordingBackend(hold=True, memmove=True)
    async with HostTier(small_config()) as tier, StaticHostMem(16 * SLOT) as stage:
        await asyncio.wait_for(tier.wait_resident(), 60)
        ids = await tier.allocate(8)
        engine = await CopyEngine.open(None, backend=recording)
        first = asyncio.ensure_future(engine.to_device(tier, [0], [stage.address]))
        await asyncio.wait_for(recording.wait_issued(1), 30)
        mine = [asyncio.ensure_future(engine.to_device(tier, [s], [stage.address + s * SLOT])) for s in ids[1:]]
        await asyncio.sleep(0)  # deferred; their flush is the loop's next callback
        closer = threading.Thread(target=run, args=(engine.aclose,))
        closer.start()
        deadline = time.monotonic() + 30
        while "closing" not in repr(engine) and time.monotonic() < deadline:
            time.sleep(0.001)  # this loop's turn is held open until the close has begun
        results = await asyncio.wait_for(asyncio.gather(*mine, return_exceptions=True), 30)
        recording.release()
        await asyncio.wait_for(first, 30)
        await asyncio.to_thread(closer.join, 30)
        kinds = sorted({"copied" if r is None else type(r).__name__ for r in results})
        stats = engine.statistics()
        print("outcomes", kinds, closer.is_alive(), repr(engine).split()[1], flush=True)
        print("jobs", stats.jobs_submitted, stats.jobs_completed, stats.latency_count, len(tier.copies), flush=True)

run(main)
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_an_engine_closed_on_another_loop_before_this_loops_turn_ends_refuses_its_requests(loop: str) -> None:
    out = run_script(CLOSED_BY_ANOTHER_LOOP, loop, timeout=90)
    assert "outcomes ['TierClosedError'] False [closed" in out, out
    assert "jobs 1 1 1 0" in out, out
