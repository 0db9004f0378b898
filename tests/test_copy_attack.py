"""Hostile use of copies over a region's memory, on asyncio and uvloop.

A region (a tier, a StaticHostMem) named by an *array* over its memory, made
from its address by a foreign library rather than through a view that keeps
it mapped: its close and shrink must wait for a copy over it, as for
addresses (before: the array was never located, and the close unmapped under
the memmove, SIGSEGV). Cancellation of the host-only engine's awaited copies
by every means asyncio offers (``asyncio.timeout``, a TaskGroup, ``gather``,
``shield``, repeated ``cancel()``, ``begin()`` abandoned): the cancellation
arrives once, only after the copy landed whole, and the task's
``cancelling()`` count stays right. Closes and shrinks raced by many copies
at once. Hostile slot ids (a SlotError naming the refused value; before, a
TypeError for a 0-d array and messages that named a good id) and requests
on both sides of the small-request thresholds (the same answer).

Copies are held, where a test needs one in flight, by an engine over a
``RecordingBackend`` that holds its jobs (and copies their bytes once let
through), or for the store's host copies by replacing the function that
runs them on their thread with a gated one; every await is bounded, so a
regression fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import gc
import itertools
import random
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import pytest

import aiokvtier._store._transfers as transfers_module
from aiokvtier import (
    BlockNotFound,
    BlockStore,
    CopyEngine,
    CopyPlanError,
    HostTier,
    HostTierConfig,
    QuotaError,
    SlotError,
    StartedCopy,
    StaticHostMem,
    TierClosedError,
)
from aiokvtier._copy import _plan, _requests
from aiokvtier._host import _slots
from aiokvtier._host._slots import SlotAllocator
from aiokvtier.testing import RecordingBackend

from .helpers import KiB, MiB, eventually
from .invariants import wait_no_library_threads

T = TypeVar("T")
HANG = 10.0
SLOT = 256 * KiB
ROWS = 64  # 16 MiB per copy: a few milliseconds of memmove


async def bounded(aw: Awaitable[T], within: float = HANG) -> T:
    """Await ``aw`` in a task of its own, failing (not hanging) after ``within`` s."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=within)
    if not done:
        task.cancel()
        raise AssertionError(f"still running after {within} s")
    return task.result()


def over(address: int, rows: int, row: int) -> np.ndarray:
    """A writable array over raw memory: no view of its owner's, so nothing keeps it mapped."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * (rows * row)).from_address(address)).reshape(rows, row)


def config(rows: int = ROWS) -> HostTierConfig:
    return HostTierConfig(quota=rows * SLOT, max_quota=rows * SLOT, slot_size=SLOT, commit_unit=MiB)


class Held:
    """Replaces the function a library thread copies with: each call waits until let through."""

    def __init__(self, real: Callable[..., None]) -> None:
        self.real = real
        self.entered = threading.Event()
        self.open = threading.Event()

    def __call__(self, *args: Any) -> None:
        self.entered.set()
        self.open.wait(HANG)
        self.real(*args)

    async def started(self) -> None:
        await eventually(self.entered.is_set, HANG)

    async def release(self) -> None:
        await asyncio.to_thread(self.open.set)


@pytest.fixture
def held_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[Held]:
    gate = Held(transfers_module.landed_after)
    monkeypatch.setattr(transfers_module, "landed_after", gate)
    yield gate
    gate.open.set()


def holding() -> RecordingBackend:
    """A backend whose jobs land, bytes copied, only once ``let_through()`` lets them."""
    return RecordingBackend(hold=True, memmove=True)


async def let_through(backend: RecordingBackend) -> None:
    backend.hold = False  # a job not issued yet lands by itself
    backend.release()


async def _still_closing(closing: asyncio.Future[None], region: Any) -> None:
    for _ in range(20):  # it waits for the held copy, so no number of turns can let it finish
        await asyncio.sleep(0)
    assert not closing.done() and not region.released, f"{region!r} closed under a copy from an array over it"


# -- a region named by an array over its memory ---------------------------------------------


@pytest.mark.parametrize("kind", ["to_device", "to_host", "begin"])
async def test_an_array_over_a_static_buffer_holds_its_close(kind: str) -> None:
    tier = await bounded(HostTier.open(config()))
    try:
        await bounded(tier.wait_resident())
        slots = await tier.allocate(ROWS)
        for slot in slots:
            tier.view(slot)[:] = bytes([slot % 251 + 1]) * SLOT
        held = holding()
        async with CopyEngine(None, backend=held) as engine:
            buf = await bounded(StaticHostMem.open(ROWS * SLOT))
            pages = over(buf.address, ROWS, SLOT)
            if kind == "to_host":
                pages[:] = 7
            if kind == "begin":
                started = engine.begin(tier, slots, pages, "h2d")
                call: asyncio.Future[None] = asyncio.ensure_future(started.done)
            else:
                method = engine.to_device if kind == "to_device" else engine.to_host
                call = asyncio.ensure_future(method(tier, slots, pages))
            closing: asyncio.Future[None] | None = None
            try:
                await bounded(held.wait_issued(1))
                assert len(buf.copies) == 1, "a copy from an array over the buffer is not registered with it"
                closing = asyncio.ensure_future(buf.aclose())
                await _still_closing(closing, buf)
            finally:
                await let_through(held)
                await bounded(call)
                if closing is None:
                    await bounded(buf.aclose())
            if kind == "to_host":
                assert all(bytes(tier.view(slot))[:: SLOT // 8] == b"\x07" * 8 for slot in slots)
            assert closing is not None
            await bounded(closing)
            assert buf.released and len(buf.copies) == 0 and len(tier.copies) == 0
    finally:
        await bounded(tier.aclose())
    await wait_no_library_threads()


async def test_an_array_over_another_tier_holds_its_close() -> None:
    a = await bounded(HostTier.open(config()))
    b = await bounded(HostTier.open(config()))
    try:
        for tier in (a, b):
            await bounded(tier.wait_resident())
        sa, sb = await a.allocate(ROWS), await b.allocate(ROWS)
        for slot in sa:
            a.view(slot)[:] = b"\x05" * SLOT
        pages = over(b.address(sb[0]), ROWS, SLOT)  # b's slots, fresh: ascending and contiguous
        held = holding()
        async with CopyEngine(None, backend=held) as engine:
            call = asyncio.ensure_future(engine.to_device(a, sa, pages))
            closing: asyncio.Future[None] | None = None
            try:
                await bounded(held.wait_issued(1))
                assert len(b.copies) == 1, "a copy into an array over a tier's slots is not registered with it"
                b.free_many(sb)
                closing = asyncio.ensure_future(b.aclose())
                await _still_closing(closing, b)
            finally:
                await let_through(held)
                await bounded(call)
                if closing is None:
                    await bounded(b.aclose())
            assert closing is not None
            await bounded(closing)
            assert b.released and len(a.copies) == 0
    finally:
        await bounded(a.aclose())
        await bounded(b.aclose())


async def test_an_array_over_a_shrunk_tail_is_refused() -> None:
    """Pages in the decommitted tail of a tier are refused as addresses there are (planned only:
    before, the plan was made, and its memmove would have written to memory given back)."""
    a = await bounded(HostTier.open(config()))
    b = await bounded(HostTier.open(config()))
    try:
        for tier in (a, b):
            await bounded(tier.wait_resident())
        sa = await a.allocate(2)
        await bounded(b.resize(ROWS // 2 * SLOT))
        tail = over(b.statistics().base_address + ROWS // 2 * SLOT, 2, SLOT)
        for direction in ("h2d", "d2h"):
            with pytest.raises(CopyPlanError, match="committed"):
                _requests.plan_slots(a, sa, tail, direction, None, host_only=True)
    finally:
        await bounded(a.aclose())
        await bounded(b.aclose())


async def test_an_array_over_a_closing_buffer_is_refused() -> None:
    tier = await bounded(HostTier.open(config()))
    try:
        await bounded(tier.wait_resident())
        slots = await tier.allocate(ROWS)
        held = holding()
        async with CopyEngine(None, backend=held) as engine:
            buf = await bounded(StaticHostMem.open(ROWS * SLOT))
            pages = over(buf.address, ROWS, SLOT)
            first = asyncio.ensure_future(engine.to_device(tier, slots[:1], pages[:1]))
            try:
                await bounded(held.wait_issued(1))
                assert len(buf.copies) == 1, "a copy from an array over the buffer is not registered with it"
                closing = asyncio.ensure_future(buf.aclose())
                await asyncio.sleep(0)  # the close has begun: the buffer is no copy target any more
                before = engine.statistics().jobs_submitted
                with pytest.raises(CopyPlanError, match="closing"):
                    await engine.to_device(tier, slots[1:], pages[1:])
                assert engine.statistics().jobs_submitted == before
            finally:
                await let_through(held)
                await bounded(first)
            await bounded(closing)
    finally:
        await bounded(tier.aclose())


@pytest.mark.parametrize("call", ["load", "store"])
async def test_host_store_pages_over_a_static_buffer_hold_its_close(call: str, held_store: Held) -> None:
    tier = await bounded(HostTier.open(config()))
    try:
        await bounded(tier.wait_resident())
        store = await bounded(BlockStore.open(tier))
        keys = [bytes([1, i]) for i in range(ROWS // 2)]
        await held_store.release()  # the blocks to load land now
        await bounded(store.store(keys, np.full((len(keys), SLOT), 3, dtype=np.uint8)))
        held_store.open.clear()
        held_store.entered.clear()
        buf = await bounded(StaticHostMem.open(len(keys) * SLOT))
        pages = over(buf.address, len(keys), SLOT)
        pages[:] = 9
        if call == "load":
            task = asyncio.ensure_future(store.load(keys, pages))
        else:
            task = asyncio.ensure_future(store.store([bytes([2, i]) for i in range(len(keys))], pages))
        closing: asyncio.Future[None] | None = None
        try:
            await held_store.started()
            assert len(buf.copies) == 1, f"a host {call} over the buffer's memory is not registered with it"
            closing = asyncio.ensure_future(buf.aclose())
            await _still_closing(closing, buf)
        finally:
            await held_store.release()
            await bounded(task)
            if closing is None:
                await bounded(buf.aclose())
        assert closing is not None
        await bounded(closing)
        if call == "store":
            out = np.zeros((1, SLOT), dtype=np.uint8)
            await bounded(store.load([bytes([2, 5])], out))
            assert bool((out == 9).all())
        await bounded(store.aclose())
    finally:
        await bounded(tier.aclose())


# -- cancelling the host-only engine's awaited copies ---------------------------------------


class Rig:
    """A tier of ``ROWS`` slots, a staging buffer and a host-only engine; the slots hold a fresh
    pattern before each call, so what landed tells the calls apart."""

    def __init__(self, tier: HostTier, engine: CopyEngine, buf: StaticHostMem, slots: list[int]) -> None:
        self.tier, self.engine, self.buf, self.slots = tier, engine, buf, slots
        self.dst = np.frombuffer(buf.view(), dtype=np.uint8).reshape(ROWS, SLOT)
        self.value = 0

    def fresh(self) -> int:
        self.value = self.value % 250 + 1
        for slot in self.slots:
            ctypes.memset(self.tier.address(slot), self.value, SLOT)
        return self.value

    def call(self, kind: str) -> Awaitable[None]:
        e, tier, slots = self.engine, self.tier, self.slots
        if kind == "to_device":
            return e.to_device(tier, slots, self.dst)
        if kind == "to_host":  # the other way: the buffer holds the pattern, the slots get it
            self.dst[:] = self.value
            for slot in slots:
                ctypes.memset(tier.address(slot), 0, SLOT)
            return e.to_host(tier, slots, self.dst)
        rows = [(self.buf.address + i * SLOT, tier.address(s), SLOT) for i, s in enumerate(slots)]
        return e.copy(rows)

    def landed(self, kind: str) -> bool:
        """All of the call's bytes are there (True), none are (False); anything else fails."""
        if kind == "to_host":
            got = np.stack([np.frombuffer(self.tier.view(s), dtype=np.uint8) for s in self.slots])
        else:
            got = self.dst
        hits = int(np.count_nonzero(got == self.value))
        assert hits in (0, got.size), f"{kind}: {hits} of {got.size} bytes landed when control came back"
        return hits == got.size

    def settled(self) -> None:
        assert len(self.tier.copies) == 0 and len(self.buf.copies) == 0
        stats = self.engine.statistics()
        assert stats.jobs_completed == stats.jobs_submitted


async def with_rig(test: Callable[[Rig], Awaitable[None]]) -> None:
    tier = await bounded(HostTier.open(config()))
    try:
        await bounded(tier.wait_resident())
        slots = await tier.allocate(ROWS)
        random.Random(ROWS).shuffle(slots)  # no run to merge: one memmove per page
        async with CopyEngine(None, max_batch=4) as engine, StaticHostMem(ROWS * SLOT) as buf:
            rig = Rig(tier, engine, buf, slots)
            await bounded(test(rig))
            del rig
            gc.collect()  # caught exceptions' frames hold the rig, and its view keeps the buffer's thread
    finally:
        await bounded(tier.aclose())
    await wait_no_library_threads()


KINDS = ["to_device", "to_host", "copy"]
DELAYS = (0, 0.0001, 0.0005, 0.002, 0.01)


@pytest.mark.parametrize("kind", KINDS)
async def test_asyncio_timeout_over_a_copy_raises_timeout_error_once_it_landed(kind: str) -> None:
    async def run(rig: Rig) -> None:
        me = asyncio.current_task()
        assert me is not None
        for delay in DELAYS:
            rig.fresh()
            try:
                async with asyncio.timeout(delay):
                    await rig.call(kind)
            except TimeoutError:
                pass
            assert rig.landed(kind), f"{kind}: the timeout after {delay} s came back before the copy landed"
            assert me.cancelling() == 0, "the timeout's cancellation was not taken back"
            rig.settled()

    await with_rig(run)


@pytest.mark.parametrize("kind", KINDS)
async def test_an_outer_cancellation_under_a_timeout_stays_a_cancellation(kind: str) -> None:
    async def run(rig: Rig) -> None:
        for delay in DELAYS:
            rig.fresh()

            async def under_timeout(delay: float) -> None:
                async with asyncio.timeout(delay):
                    await rig.call(kind)

            task = asyncio.ensure_future(under_timeout(delay))
            await asyncio.sleep(delay)
            if task.cancel():  # not done yet: whether or not the timeout fired, this is no timeout
                with pytest.raises(asyncio.CancelledError):
                    await bounded(task)
            else:
                with pytest.raises(TimeoutError) if task.exception() else contextlib.nullcontext():
                    await task
            assert rig.landed(kind)
            rig.settled()

    await with_rig(run)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_copy_in_a_taskgroups_body_lands_before_a_failed_sibling_is_reported(kind: str) -> None:
    class Sibling(Exception):
        pass

    async def run(rig: Rig) -> None:
        me = asyncio.current_task()
        assert me is not None
        for delay in DELAYS:
            rig.fresh()

            async def sibling(delay: float) -> None:
                await asyncio.sleep(delay)
                raise Sibling

            with pytest.raises(ExceptionGroup) as caught:
                async with asyncio.TaskGroup() as group:
                    group.create_task(sibling(delay))
                    await rig.call(kind)
                    await asyncio.sleep(HANG)  # only the sibling ends this
            assert [type(e) for e in caught.value.exceptions] == [Sibling]
            assert rig.landed(kind)
            # The group cancelled this task in its body and took the cancellation back.
            assert me.cancelling() == 0
            rig.settled()

    await with_rig(run)


@pytest.mark.parametrize("kind", KINDS)
async def test_gather_cancelled_with_return_exceptions_leaves_no_half_copy(kind: str) -> None:
    async def run(rig: Rig) -> None:
        for delay in DELAYS:
            rig.fresh()
            gathered = asyncio.gather(rig.call(kind), asyncio.sleep(HANG), return_exceptions=True)
            await asyncio.sleep(delay)
            gathered.cancel()
            try:
                await bounded(gathered)
            except asyncio.CancelledError:
                pass
            rig.landed(kind)  # never half
            rig.settled()

    await with_rig(run)


async def test_a_shielded_copy_runs_on_after_its_awaiter_is_cancelled() -> None:
    async def run(rig: Rig) -> None:
        for delay in DELAYS:
            rig.fresh()
            inner = asyncio.ensure_future(rig.call("to_device"))
            outer = asyncio.shield(inner)
            await asyncio.sleep(delay)
            if outer.cancel():  # the shield gives way at once; the copy does not
                with pytest.raises(asyncio.CancelledError):
                    await bounded(outer)
            assert not inner.cancelled()
            await bounded(inner)
            assert rig.landed("to_device")
            rig.settled()

    await with_rig(run)


async def test_a_copy_cancelled_twice_delivers_one_cancellation_and_the_task_goes_on() -> None:
    async def run(rig: Rig) -> None:
        for delay in DELAYS:
            rig.fresh()

            async def twice() -> tuple[int, bool, bool]:
                try:
                    await rig.call("to_device")
                except asyncio.CancelledError:
                    me = asyncio.current_task()
                    assert me is not None
                    count = me.cancelling()
                    first = rig.landed("to_device")
                    while me.uncancel():
                        pass
                    rig.fresh()
                    await rig.call("to_device")  # nothing left pending: this one is not cancelled
                    return count, first, rig.landed("to_device")
                return 0, True, True

            task = asyncio.ensure_future(twice())
            await asyncio.sleep(delay)
            task.cancel()
            task.cancel()
            count, first, second = await bounded(task)
            assert count in (0, 2) and first and second
            rig.settled()

    await with_rig(run)


async def test_begin_cancelled_before_submission_leaves_done_to_await() -> None:
    async def run(rig: Rig) -> None:
        for delay in DELAYS:
            rig.fresh()
            started = rig.engine.begin(rig.tier, rig.slots, rig.dst, "h2d")

            async def caller(started: StartedCopy) -> None:
                await started.submitted
                await started.done

            task = asyncio.ensure_future(caller(started))
            await asyncio.sleep(delay)
            task.cancel()
            try:
                await bounded(task)
            except asyncio.CancelledError:
                pass
            started.done.cancel()  # refused: the copy is the engine's to settle
            await bounded(started.done)  # a cancelled caller still waits for this
            assert not started.done.cancelled() and rig.landed("to_device")
            rig.settled()

    await with_rig(run)


# -- closes and shrinks raced by many copies ------------------------------------------------


async def _race(action: str, rng: random.Random) -> None:
    tier = await bounded(HostTier.open(config(128)))
    await bounded(tier.wait_resident())
    store = await bounded(BlockStore.open(tier))
    engine = await bounded(CopyEngine.open(None))
    buf = await bounded(StaticHostMem.open(16 * SLOT))
    try:
        own = await tier.allocate(16)
        src = np.random.default_rng(rng.randrange(1 << 30)).integers(0, 256, (16, SLOT), dtype=np.uint8)

        async def stores(i: int) -> None:
            await store.store([bytes([i, j]) for j in range(8)], src[:8])

        async def loads(i: int) -> None:
            await store.load([bytes([i % 4, j]) for j in range(8)], np.zeros((8, SLOT), dtype=np.uint8))

        async def copies(i: int) -> None:
            await engine.to_device(tier, own, [buf.address + k * SLOT for k in range(16)])
            await engine.to_host(tier, own, src)
            await engine.copy([(buf.address + k * SLOT, tier.address(own[k]), SLOT) for k in range(16)])

        for i in range(4):
            await bounded(stores(i))
        calls = [asyncio.ensure_future(f(i)) for i in range(8) for f in (stores, loads, copies)]
        for _ in range(rng.randrange(40)):
            await asyncio.sleep(0)
        if action == "close":
            await bounded(tier.aclose())
            assert len(tier.copies) == 0
        elif action == "shrink":
            try:
                await bounded(store.resize(64 * SLOT))
            except QuotaError:
                pass  # blocks or the engine's slots past the new end: refused, nothing changed
        else:
            await bounded(buf.aclose())
            assert len(buf.copies) == 0
        done, pending = await asyncio.wait(calls, timeout=HANG)
        assert not pending, f"{len(pending)} calls hung after the {action}"
        for call in done:
            error = call.exception()
            if error is not None and not isinstance(error, TierClosedError | CopyPlanError | BlockNotFound):
                raise error
    finally:
        await bounded(store.aclose())
        await bounded(engine.aclose())
        await bounded(buf.aclose())
        await bounded(tier.aclose())
    assert len(tier.copies) == 0 and len(buf.copies) == 0


@pytest.mark.parametrize("action", ["close", "shrink", "close the buffer"])
async def test_closes_and_shrinks_raced_by_many_copies(action: str) -> None:
    """Stores, loads and engine copies in flight by the dozen; the close or shrink lands among them at
    seeded points. Each call succeeds or is refused; none hangs or leaves a copy registered."""
    rng = random.Random(action)
    for _ in range(4):
        await _race(action, rng)
    await wait_no_library_threads()


CLOSE_UNDER_ARRAYS = """
import ctypes
import numpy as np
from aiokvtier import BlockStore, CopyEngine, CopyPlanError, HostTier, HostTierConfig, StaticHostMem
MiB = 1 << 20
SLOT, N = 2 * MiB, 24

async def main():
    cfg = HostTierConfig(quota=3 * N * SLOT, max_quota=3 * N * SLOT, slot_size=SLOT)
    async with HostTier(cfg) as tier, CopyEngine(None) as engine:
        await asyncio.wait_for(tier.wait_resident(), 60)
        store = await BlockStore.open(tier)
        slots = await tier.allocate(N)
        keys = [bytes([1, i]) for i in range(N)]
        await store.store(keys, np.ones((N, SLOT), dtype=np.uint8))
        for round, delay in enumerate((0, 0, 0.001, 0.003, 0.01)):
            buf = await StaticHostMem.open(N * SLOT)
            # An array over the buffer's memory, as a foreign library would make one from its address.
            raw = (ctypes.c_uint8 * (N * SLOT)).from_address(buf.address)
            pages = np.ctypeslib.as_array(raw).reshape(N, SLOT)
            calls = [
                asyncio.ensure_future(engine.to_device(tier, slots, pages)),
                asyncio.ensure_future(engine.to_host(tier, slots, pages)),
                asyncio.ensure_future(store.load(keys, pages)),
                asyncio.ensure_future(store.store([bytes([2 + round, i]) for i in range(N)], pages)),
            ]
            await asyncio.sleep(delay)
            await asyncio.wait_for(buf.aclose(), 60)
            for outcome in await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60):
                # Landed, or refused before anything was copied (the buffer was closing already).
                assert not isinstance(outcome, BaseException) or isinstance(outcome, CopyPlanError), repr(outcome)
            print("round", round, "ok", flush=True)
        await store.aclose()

run(main)
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_closing_a_buffer_under_copies_through_arrays_over_it_does_not_crash(loop: str) -> None:
    """Engine copies and host store calls whose pages are an array over a StaticHostMem, the
    buffer closed among them (before: SIGSEGV, its memory unmapped under the memmove)."""
    from .test_cancellation import run_script

    out = run_script(CLOSE_UNDER_ARRAYS, loop)
    assert out.count(" ok") == 5


# -- hostile slot ids and the small-request thresholds -------------------------------------


def _answer(run: Callable[[], Any]) -> object:
    try:
        out = run()
    except (SlotError, CopyPlanError, TypeError, ValueError) as error:
        return type(error).__name__, str(error)
    if isinstance(out, tuple):  # (plan, owners)
        p, owners = out
        return p.dsts.tolist(), p.srcs.tolist(), p.sizes.tolist(), p.requested, [type(o).__name__ for o in owners]
    assert out.ndim == 1 and out.dtype == np.int64, f"ids came back as {out.shape} of {out.dtype}"
    return out.tolist()


@pytest.mark.parametrize(
    "ids",
    [np.array(3), np.array(7), np.zeros((0, 3), dtype=np.int64), np.array([[1, 2]]), np.array([1, 2], dtype=object)],
    ids=repr,
)
def test_slot_ids_in_an_array_of_the_wrong_shape_are_refused_as_slot_errors(ids: np.ndarray) -> None:
    """A 0-d array has no ``len()``: the few-ids path raised TypeError for it, and gave a (0, 3) array
    back as it came; the array path refuses both forms (or gives no ids)."""
    slots = SlotAllocator(8)
    slots.take(6)
    answers = []
    for few in (_slots.FEW_IDS, 0):
        saved, _slots.FEW_IDS = _slots.FEW_IDS, few
        try:
            answers.append(_answer(lambda: slots.checked_ids(ids)))
        finally:
            _slots.FEW_IDS = saved
    assert answers[0] == answers[1]
    if ids.size == 0:
        assert answers[0] == []
    else:
        assert isinstance(answers[0], tuple) and answers[0][0] == "SlotError"
        assert "shape" in answers[0][1], "the message names a good id as the one refused"


@pytest.mark.parametrize(
    "bad",
    [2**70, -(2**70), 2**64 - 1, np.uint64(2**64 - 1), 2.5, np.float64(2), "3", None, [1], np.True_],
    ids=repr,
)
@pytest.mark.parametrize("count", [2, _slots.FEW_IDS + 1])
def test_a_refused_slot_id_is_the_one_named(bad: object, count: int) -> None:
    """numpy made ``[0, 2.5]`` floats and ``[0, 2**70]`` objects, and the message named the 0 (a
    good id); a uint64 past 2**63 was named as -1."""
    slots = SlotAllocator(8)
    slots.take(6)
    ids: list[object] = [i % 6 for i in range(count)]
    ids[-1] = bad
    with pytest.raises(SlotError) as caught:
        slots.checked_ids(ids)  # type: ignore[arg-type]
    assert repr(bad) in str(caught.value)
    if isinstance(bad, np.uint64):
        with pytest.raises(SlotError, match=str(2**64 - 1)):
            slots.checked_ids(np.array([0, bad], dtype=np.uint64))


def test_an_id_that_answers_once_is_a_slot_error() -> None:
    """array("q") refuses the list on the first ask, the search for the culprit finds none."""

    class Once:
        asked = 0

        def __index__(self) -> int:
            Once.asked += 1
            if Once.asked > 1:
                return 1
            raise TypeError("first ask")

    slots = SlotAllocator(8)
    slots.take(6)
    with pytest.raises(SlotError, match="integers of 64 bits"):
        slots.checked_ids([0] * (_slots.FEW_IDS + 1) + [Once()])  # type: ignore[list-item]


async def test_a_zero_dimensional_array_of_slots_is_a_slot_error_at_the_engine() -> None:
    tier = await bounded(HostTier.open(config(8)))
    try:
        await bounded(tier.wait_resident())
        slot = await tier.allocate()
        async with CopyEngine(None) as engine, StaticHostMem(SLOT) as buf:
            with pytest.raises(SlotError):
                await engine.to_device(tier, np.array(slot), [buf.address])
            with pytest.raises(SlotError):
                tier.free_many(np.array(slot))
            assert len(tier.copies) == 0 and engine.statistics().jobs_submitted == 0
    finally:
        await bounded(tier.aclose())


SPOILERS: list[object] = [None, True, np.True_, 1.0, 2**70, -1, np.int64(3), np.uint64(3), 2**64 - 1, "3", 50]


async def test_requests_either_side_of_the_small_thresholds_get_the_same_answer() -> None:
    """Per-slot requests of a size below, at and above ``SMALL`` and ``FEW_IDS`` (slot ids and buffer
    addresses spoiled, as lists, tuples and arrays of each dtype, repeats, overlapping
    destinations, shuffled), planned once with the small paths and once without: the same plan,
    or the same error with the same message."""
    rng = random.Random(5)
    tier = await bounded(HostTier.open(config()))
    try:
        await bounded(tier.wait_resident())
        held = await tier.allocate(48)
        async with StaticHostMem(ROWS * SLOT) as buf:
            for n, spoil_slot, spoil_address, form, direction in itertools.product(
                [1, 2, _plan.SMALL, _plan.SMALL + 1],
                SPOILERS,
                SPOILERS[:6],
                ["list", "tuple", "int64", "uint64", "object"],
                ["h2d", "d2h"],
            ):
                slots: list[object] = rng.sample(held, n)
                addresses: list[object] = [buf.address + i * SLOT for i in range(n)]
                rng.shuffle(addresses)
                if n > 1 and rng.random() < 0.3:
                    slots[-1] = slots[0]  # a repeat: refused as a destination only
                if n > 1 and rng.random() < 0.3:
                    addresses[-1] = int(addresses[0]) + 100  # type: ignore[call-overload]
                if spoil_slot is not None:
                    slots[n // 2] = spoil_slot
                if spoil_address is not None:
                    addresses[n // 2] = spoil_address

                def make(values: list[object], form: str) -> Any:
                    if form in ("list", "tuple"):
                        return list(values) if form == "list" else tuple(values)
                    dtype = {"int64": np.int64, "uint64": np.uint64, "object": object}[form]
                    try:
                        return np.array(values, dtype=dtype)
                    except (TypeError, ValueError, OverflowError):
                        return None  # numpy refuses to build it: nothing reaches the engine

                s, a = make(slots, form), make(addresses, form)
                if s is None or a is None:
                    continue
                answers = []
                for small in (True, False):
                    saved = _plan.SMALL, _slots.FEW_IDS
                    if not small:
                        _plan.SMALL, _slots.FEW_IDS = 0, 0
                    try:
                        plan = functools.partial(_requests.plan_slots, tier, s, a, direction, None, host_only=True)
                        answers.append(_answer(plan))
                    finally:
                        _plan.SMALL, _slots.FEW_IDS = saved
                assert answers[0] == answers[1], (n, spoil_slot, spoil_address, form, direction)
    finally:
        await bounded(tier.aclose())
