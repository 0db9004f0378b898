"""The block store's cheaper calls under attack: what each saving must still keep.

- A host copy's future refuses cancellation and is awaited directly: a cancelled ``store`` or ``load``
  raises only once its copy ended, whether cancelled by ``task.cancel()`` (once or twice), by
  ``asyncio.wait_for``, by a failing TaskGroup sibling, or while the store or its tier closes.
- A claim makes its future only when a concurrent store waits on it: the waiters of a store that is
  cancelled, fails or meets a close wake and store the keys themselves (or see them present).
- The index counts its doomed blocks: after pins, discards, evictions and shrinks in any order, its
  counts agree with a recount (``check_invariants``), and no slot is lost once nothing is in flight.
- ``LRUPolicy.inserted_many`` checks few slots as Python ints: hostile slot ids change nothing.
- Host pages with fewer numpy steps: bad arrays and buffers are refused with nothing stored, good ones
  round-trip bit-exact.

Host pages (no engine), on asyncio and uvloop. Copies go through the store's thread; the copy seam is
``aiokvtier._store._transfers.landed_after`` (patched with ``monkeypatch``). Every await is bounded.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import aiokvtier._store._transfers as transfers_module
from aiokvtier import BlockNotFound, BlockStore, HostTier, HostTierConfig, QuotaError, TierClosedError
from aiokvtier._store._policy import LRUPolicy, S3FIFOPolicy

from .helpers import eventually

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a test dependency on Linux
    uvloop = None
from .test_cancellation import cancel_during, sweep
from .test_store import SLOT, bounded, open_store, page, pages

T = TypeVar("T")

DELAYS = (0, 0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005)
"""Cancellation delays: a copy takes ``Copies.pause`` (2 ms), so most land while one is in flight."""


class CopyFailed(Exception):
    """Raised by a host copy that ``Copies.fail`` asks to fail."""


class Copies:
    """Replaces the store's host copy (run on its thread): counts copies begun and ended, holds each
    until a permit is given (while ``held``), sleeps ``pause`` s in it, and fails the next ``fail``
    copies (without writing)."""

    def __init__(self, pause: float = 0.0) -> None:
        self._real = transfers_module.landed_after
        self._lock = threading.Lock()
        self._permits = threading.Semaphore(0)
        self.held = False
        self._waiting = 0
        self.pause = pause
        self.fail = 0
        """Copies to fail, the next ones begun."""
        self.begun = 0
        self.ended = 0

    def __call__(self, copy: Callable[[], None], landed: threading.Event) -> None:
        with self._lock:
            self.begun += 1
            wait = self.held
            self._waiting += wait
        try:
            if wait:
                assert self._permits.acquire(timeout=10), "a held copy was never let through"
            if self.pause:
                time.sleep(self.pause)
            failing = self.fail > 0
            self.fail -= failing
            self._real(_failing if failing else copy, landed)
        finally:
            landed.set()  # also when the hold failed: a region's close waits for it
            with self._lock:
                self.ended += 1

    @property
    def running(self) -> int:
        """Copies begun and not ended (queued ones not counted: the worker runs them in turn)."""
        with self._lock:
            return self.begun - self.ended

    def let_through(self, n: int = 1) -> None:
        """Let the next ``n`` held copies run."""
        with self._lock:
            self._waiting -= n
        if n > 0:
            self._permits.release(n)

    def release(self) -> None:
        """Hold no copy from now on, and let those held run."""
        with self._lock:
            self.held = False
            n, self._waiting = self._waiting, 0
        if n > 0:
            self._permits.release(n)

    def mark(self) -> Callable[[int], Awaitable[None]]:
        """``await mark()(n)`` waits until ``n`` copies began since the call to ``mark()``."""
        start = self.begun

        async def entered(n: int) -> None:
            await eventually(lambda: self.begun >= start + n)

        return entered

    async def quiet(self) -> None:
        """Wait until every copy begun ended."""
        await eventually(lambda: self.running == 0)


def _failing() -> None:
    raise CopyFailed("injected copy failure")


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[Copies]:
    seam = Copies()
    monkeypatch.setattr(transfers_module, "landed_after", seam)
    yield seam
    seam.release()  # a test that failed half way leaves no copy waiting


def whole(tier: HostTier, store: BlockStore) -> None:
    """Nothing in flight, no pin or claim, one tier slot per visible block, the books agreeing."""
    stats = store.statistics()
    assert stats.in_flight == 0 and stats.blocks_pinned == 0
    assert tier.statistics().slots_allocated == len(store) == stats.blocks == len(store.keys())
    store.check_invariants(sole_user=True)


async def exact(store: BlockStore) -> None:
    """Every visible block loads, bit-exact, the bytes its key names (``page(key)``)."""
    keys = store.keys()
    dst = np.zeros((len(keys), SLOT), dtype=np.uint8)
    await bounded(store.load(keys, dst))
    for key, row in zip(keys, dst, strict=True):
        assert row.tobytes() == page(key), f"block {key!r} holds other bytes"


async def held_call(
    store: BlockStore, copies: Copies, op: str
) -> tuple[Coroutine[Any, Any, Any], Callable[[int], Awaitable[None]]]:
    """Keys 1 and 2 stored, then copies held: a store of keys 3 and 4, or a load of 1 and 2 (``op``), made
    and not yet awaited, and the wait for its copy to begin (``copies.mark()``)."""
    await bounded(store.store([1, 2], pages([1, 2])))
    copies.held = True
    entered = copies.mark()
    dst = np.zeros((2, SLOT), dtype=np.uint8)
    return (store.store([3, 4], pages([3, 4])) if op == "store" else store.load([1, 2], dst)), entered


async def ended_copies(copies: Copies, call: Awaitable[T], seen: list[int]) -> T:
    """Await ``call``; ``seen`` gets how many copies were still running the moment it returned or raised."""
    try:
        return await call
    finally:
        seen.append(copies.running)


# -- a host copy's future refuses cancellation (8d1796e) ----------------------------------------------


@pytest.mark.parametrize("form", ["rows", "buffers"])
async def test_a_cancelled_store_raises_only_after_its_copy_and_keeps_no_partial_block(
    copies: Copies, form: str
) -> None:
    copies.pause = 0.002
    async with open_store(16) as (tier, store):
        stored: list[int] = []
        for case, (how, delay) in enumerate(sweep(11, delays=DELAYS, cancels=8)):
            keys = [case * 100 + i for i in range(6)]
            src: Any = pages(keys)
            if form == "buffers":
                src = [bytearray(row.tobytes()) for row in src]
            seen: list[int] = []
            outcome = await cancel_during(
                lambda keys=keys, src=src, seen=seen: ended_copies(copies, store.store(keys, src), seen), how, delay
            )
            assert seen in ([], [0]), f"{how} after {delay} s: the call ended with its copy running"
            # The caller reuses its pages at once: nothing may read them any more.
            if form == "rows":
                src[:] = 0xEE
            else:
                for buffer in src:
                    buffer[:] = b"\xee" * len(buffer)
            await copies.quiet()
            if outcome.cancelled:
                assert not any(k in store for k in keys), f"{how} after {delay} s: a cancelled store kept a block"
            else:
                assert outcome.result is not None and outcome.result.stored == tuple(keys)
                stored += keys
            assert set(store.keys()) == set(stored)
            whole(tier, store)
            await exact(store)
            store.discard(stored[:-6])  # room for the next case
            stored = stored[-6:]


@pytest.mark.parametrize("form", ["rows", "short_rows", "buffers"])
async def test_a_cancelled_load_raises_only_after_its_copy_and_writes_nothing_after(copies: Copies, form: str) -> None:
    async with open_store(16) as (tier, store):
        keys = list(range(8))
        await bounded(store.store(keys, pages(keys)))
        copies.pause = 0.002
        for case, (how, delay) in enumerate(sweep(12, delays=DELAYS, cancels=8)):
            width = SLOT + 16 if form == "short_rows" else SLOT  # wider rows: blocks shorter than them
            dst: Any = np.full((len(keys), width), case % 200, dtype=np.uint8)
            if form == "buffers":
                dst = [bytearray(SLOT) for _ in keys]
            seen: list[int] = []
            outcome = await cancel_during(
                lambda dst=dst, seen=seen: ended_copies(copies, store.load(keys, dst), seen), how, delay
            )
            assert seen in ([], [0]), f"{how} after {delay} s: the call ended with its copy running"
            before = [bytes(row) for row in dst]
            await copies.quiet()
            # A second load through the store's thread runs after anything the first left queued.
            await bounded(store.load(keys[:1], np.zeros((1, SLOT), dtype=np.uint8)))
            assert [bytes(row) for row in dst] == before, f"{how} after {delay} s: written after the call ended"
            if not outcome.cancelled:
                assert all(bytes(row)[:SLOT] == page(k) for k, row in zip(keys, dst, strict=True))
            whole(tier, store)
        await exact(store)


@pytest.mark.parametrize("op", ["store", "load"])
async def test_a_call_cancelled_twice_while_its_copy_is_held_waits_for_it(copies: Copies, op: str) -> None:
    async with open_store(8) as (tier, store):
        call, entered = await held_call(store, copies, op)
        seen: list[int] = []
        task = asyncio.ensure_future(ended_copies(copies, call, seen))
        await entered(1)
        task.cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0.01)
        assert not task.done(), "the call ended while its copy was held"
        copies.release()
        with pytest.raises(asyncio.CancelledError):
            await bounded(task)
        assert seen == [0]
        assert 3 not in store and 4 not in store
        whole(tier, store)
        await exact(store)


async def test_a_taskgroup_sibling_failing_while_the_store_copies(copies: Copies) -> None:
    async with open_store(8) as (tier, store):
        copies.held = True
        entered = copies.mark()
        seen: list[int] = []

        async def sibling() -> None:
            await entered(1)
            raise RuntimeError("the sibling failed")

        at_release: list[list[int]] = []

        def release() -> None:  # a callback: the group cancels its tasks (and its body), never this
            at_release.append(list(seen))
            copies.release()

        asyncio.get_running_loop().call_later(0.05, release)
        with pytest.raises(ExceptionGroup) as caught:
            async with asyncio.timeout(5), asyncio.TaskGroup() as group:
                group.create_task(ended_copies(copies, store.store([1, 2], pages([1, 2])), seen))
                group.create_task(sibling())
        assert at_release == [[]], "the cancelled store ended while its copy was held"
        assert [type(e) for e in caught.value.exceptions] == [RuntimeError]
        assert seen == [0]
        assert len(store) == 0
        whole(tier, store)


@pytest.mark.parametrize("op", ["store", "load"])
async def test_a_failed_copy_under_a_cancelled_call_cancels_it_and_stores_nothing(copies: Copies, op: str) -> None:
    async with open_store(8) as (tier, store):
        call, entered = await held_call(store, copies, op)
        copies.fail = 1  # the held copy fails once let through
        task = asyncio.ensure_future(call)
        await entered(1)
        task.cancel()
        copies.release()
        with pytest.raises(asyncio.CancelledError):
            await bounded(task)
        copies.held = False
        assert set(store.keys()) == {1, 2}
        assert store.statistics().loads == 0
        whole(tier, store)
        await exact(store)


@pytest.mark.parametrize("op", ["store", "load"])
async def test_the_store_closing_while_a_cancelled_call_waits_for_its_copy(copies: Copies, op: str) -> None:
    cfg = HostTierConfig(quota=8 * SLOT, max_quota=64 * SLOT, slot_size=SLOT, commit_unit=SLOT * 4)
    async with HostTier(cfg) as tier:
        await bounded(tier.wait_resident())
        store = await bounded(BlockStore.open(tier))
        call, entered = await held_call(store, copies, op)
        seen: list[int] = []
        task = asyncio.ensure_future(ended_copies(copies, call, seen))
        await entered(1)
        task.cancel()
        closing = asyncio.ensure_future(store.aclose())
        await asyncio.sleep(0.01)
        assert not task.done() and not closing.done(), "a call or the close ended while the copy was held"
        with pytest.raises(TierClosedError):
            await bounded(store.store([5], pages([5])))
        copies.release()
        with pytest.raises(asyncio.CancelledError):
            await bounded(task)
        await bounded(closing)
        assert seen == [0]
        assert tier.statistics().slots_allocated == 0  # every block's slot (and the cancelled call's) went back


@pytest.mark.parametrize("op", ["store", "load"])
async def test_the_tier_closing_while_a_cancelled_call_waits_for_its_copy(copies: Copies, op: str) -> None:
    cfg = HostTierConfig(quota=8 * SLOT, max_quota=64 * SLOT, slot_size=SLOT, commit_unit=SLOT * 4)
    tier = await bounded(HostTier.open(cfg))
    await bounded(tier.wait_resident())
    store = await bounded(BlockStore.open(tier))
    try:
        call, entered = await held_call(store, copies, op)
        seen: list[int] = []
        task = asyncio.ensure_future(ended_copies(copies, call, seen))
        await entered(1)
        task.cancel()
        closing = asyncio.ensure_future(tier.aclose())  # the tier's close waits for the copy over its slots
        await asyncio.sleep(0.01)
        assert not task.done() and not closing.done(), "a call or the tier's close ended while the copy was held"
        copies.release()
        with pytest.raises(asyncio.CancelledError):
            await bounded(task)
        await bounded(closing)
        assert seen == [0]
        assert 3 not in store and 4 not in store
    finally:
        await bounded(store.aclose())
        await bounded(tier.aclose())


# -- a claim's future made only for a waiter (8e958f9) --------------------------------------------------


async def settle_all(tasks: Sequence[asyncio.Future[T]]) -> list[T | BaseException]:
    """Every task's outcome, bounded: a waiter that never wakes fails the test."""
    _, pending = await asyncio.wait(tasks, timeout=10)
    assert not pending, f"{len(pending)} calls never ended"
    return [asyncio.CancelledError() if t.cancelled() else t.exception() or t.result() for t in tasks]


@pytest.mark.parametrize("first_ends", ["lands", "cancelled", "fails", "cancelled_and_fails"])
@pytest.mark.parametrize("waiters", [1, 5])
async def test_the_waiters_of_a_store_wake_and_store_its_keys_when_it_does_not(
    copies: Copies, first_ends: str, waiters: int
) -> None:
    async with open_store(16) as (tier, store):
        copies.held = True
        entered = copies.mark()
        first = asyncio.ensure_future(store.store([1, 2, 3], pages([1, 2, 3])))
        await entered(1)
        # Each waiter shares a key or two with the first store, and one of its own.
        shapes = [lambda w: [10 + w, 2], lambda w: [3, 20 + w], lambda w: [2, 3, 30 + w], lambda w: [40 + w, 1]]
        calls = [shapes[w % len(shapes)](w) for w in range(waiters)]
        others = [asyncio.ensure_future(store.store(keys, pages(keys))) for keys in calls]
        for _ in range(10):
            await asyncio.sleep(0)
        assert not any(t.done() for t in others), "a waiter ended before the store it waits for"
        if first_ends.startswith("cancelled"):
            first.cancel()
        if first_ends.endswith("fails"):
            copies.fail = 1
        copies.release()
        outcomes = await settle_all([first, *others])
        if first_ends == "lands":
            assert outcomes[0] == transfers_result([1, 2, 3])
        elif first_ends.startswith("cancelled"):
            assert isinstance(outcomes[0], asyncio.CancelledError)
        else:
            assert isinstance(outcomes[0], transfers_module.CopyPlanError | CopyFailed), outcomes[0]
        first_stored = first_ends == "lands"
        taken: set[int] = set()
        for keys, result in zip(calls, outcomes[1:], strict=True):
            assert not isinstance(result, BaseException), result
            assert set(result.stored) | set(result.present) == set(keys) and not result.skipped
            for key in keys:
                if key in (1, 2, 3) and first_stored:
                    assert key in result.present, f"{key} was stored by the first call: {result}"
            taken |= set(result.stored)
        # Each key was copied once: by the first store, or by one waiter that found it absent.
        expected = {k for keys in calls for k in keys} | ({1, 2, 3} if first_stored else set())
        assert set(store.keys()) == expected
        assert store.statistics().stores == len(expected)
        whole(tier, store)
        await exact(store)


def transfers_result(keys: list[int]) -> Any:
    from aiokvtier import StoreResult

    return StoreResult(stored=tuple(keys), present=(), skipped=())


async def test_the_waiters_of_a_store_met_by_a_close(copies: Copies) -> None:
    cfg = HostTierConfig(quota=16 * SLOT, max_quota=64 * SLOT, slot_size=SLOT, commit_unit=SLOT * 4)
    async with HostTier(cfg) as tier:
        await bounded(tier.wait_resident())
        for cancel_first in (False, True):
            store = await bounded(BlockStore.open(tier))
            copies.held = True
            entered = copies.mark()
            first = asyncio.ensure_future(store.store([1, 2], pages([1, 2])))
            await entered(1)
            waiter = asyncio.ensure_future(store.store([2, 3], pages([2, 3])))
            for _ in range(10):
                await asyncio.sleep(0)
            closing = asyncio.ensure_future(store.aclose())
            await asyncio.sleep(0.01)
            assert not closing.done() and not waiter.done()
            if cancel_first:
                first.cancel()
            copies.release()
            first_out, waiter_out, _ = await settle_all([first, waiter, closing])
            if cancel_first:
                assert isinstance(first_out, asyncio.CancelledError)
                # The waiter stores the key itself, though the store began closing meanwhile.
                assert not isinstance(waiter_out, BaseException) and waiter_out.stored == (2, 3), waiter_out
            else:
                assert not isinstance(waiter_out, BaseException)
                assert waiter_out.present == (2,) and waiter_out.stored == (3,), waiter_out
            assert tier.statistics().slots_allocated == 0


async def test_many_stores_of_overlapping_keys_cancelled_failing_or_landing(copies: Copies) -> None:
    rng = random.Random(5)
    copies.pause = 0.0005
    async with open_store(48) as (tier, store):
        for round_ in range(12):
            calls = [rng.sample(range(24), rng.randint(1, 8)) for _ in range(8)]
            copies.held = True
            entered = copies.mark()
            tasks = [asyncio.ensure_future(store.store(keys, pages(keys))) for keys in calls]
            await entered(1)
            copies.fail = rng.randint(0, 3)
            doomed = rng.sample(range(len(tasks)), rng.randint(0, 3))
            for i in doomed:
                tasks[i].cancel()
            copies.release()
            outcomes = await settle_all(tasks)
            copies.fail = 0
            for keys, out in zip(calls, outcomes, strict=True):
                if isinstance(out, BaseException):
                    assert isinstance(out, asyncio.CancelledError | CopyFailed), repr(out)
                    continue
                assert set(out.stored) | set(out.present) | set(out.skipped) == set(keys)
                assert not out.skipped  # room for every key: nothing is skipped
                assert all(k in store for k in keys), f"round {round_}: {keys} returned {out}, not all stored"
            whole(tier, store)
            await exact(store)
            store.discard(range(24))


# -- LRUPolicy.inserted_many checks few slots as Python ints (ecf8f7a) ---------------------------------


HOSTILE_SLOTS: dict[str, Any] = {
    "repeat": [5, 5],
    "repeat_of_a_tracked_slot": [7, 60],
    "repeat_numpy": np.array([3, 9, 3], dtype=np.int64),
    "repeat_past_the_few": [*range(40), 0],
    "negative": [-1],
    "negative_numpy_int8": np.array([4, -3], dtype=np.int8),
    "out_of_range": [64],
    "out_of_range_numpy_uint16": np.array([1, 1000], dtype=np.uint16),
    "uint64_past_int64": np.array([2**63], dtype=np.uint64),
    "uint64_max": np.array([2**64 - 1], dtype=np.uint64),
    "python_int_past_int64": [2**70],
    "bools": [True, False],
    "a_bool_among_ints": [2, True],
    "numpy_bools": np.array([True, False]),
    "numpy_bool_scalars": [np.bool_(True), np.bool_(False)],
    "floats": [1.0, 2.0],
    "numpy_floats": np.array([1.5, 2.5]),
    "strings": ["1", "2"],
    "nested": [[1, 2]],
    "two_d": np.array([[1, 2]], dtype=np.int64),
}


@pytest.mark.parametrize("policy", [LRUPolicy, S3FIFOPolicy])
@pytest.mark.parametrize("hostile", list(HOSTILE_SLOTS))
def test_hostile_slot_ids_are_refused_and_change_nothing(policy: type[LRUPolicy | S3FIFOPolicy], hostile: str) -> None:
    tracker = policy(64)
    tracker.inserted_many(np.array([60, 7], dtype=np.int64), [b"a", b"b"])
    before = (len(tracker), tracker.tracked().tolist(), victims(tracker))
    slots = HOSTILE_SLOTS[hostile]
    keys = [b"k%d" % i for i in range(len(slots))]
    with pytest.raises((TypeError, ValueError, IndexError)):
        tracker.inserted_many(slots, keys)
    assert (len(tracker), tracker.tracked().tolist(), victims(tracker)) == before
    # Still whole: the good insert after it is taken in full, and ordered after the first two.
    tracker.inserted_many([1, 2], [b"c", b"d"])
    assert len(tracker) == 4 and victims(tracker)[-2:] == [1, 2]


@pytest.mark.parametrize("policy", [LRUPolicy, S3FIFOPolicy])
@pytest.mark.parametrize("slot", [True, 1.0, "1", np.bool_(True)])
def test_a_single_insert_of_a_hostile_slot_id_is_refused(policy: type[LRUPolicy | S3FIFOPolicy], slot: Any) -> None:
    tracker = policy(64)
    with pytest.raises(TypeError):
        tracker.inserted(slot, b"k")
    assert len(tracker) == 0 and not tracker.tracked().any()


@pytest.mark.parametrize("policy", [LRUPolicy, S3FIFOPolicy])
def test_slot_ids_of_other_integer_widths_are_taken(policy: type[LRUPolicy | S3FIFOPolicy]) -> None:
    tracker = policy(64)
    tracker.inserted_many(np.array([3, 4], dtype=np.uint8), [b"a", b"b"])
    tracker.inserted_many([np.int16(5), np.uint32(6), 7], [b"c", b"d", b"e"])
    tracker.inserted_many(np.arange(8, 50, dtype=np.int32), [b"f%d" % i for i in range(42)])
    assert len(tracker) == 47 and tracker.tracked()[3:50].all()


def victims(tracker: LRUPolicy | S3FIFOPolicy) -> list[int]:
    """The policy's eviction order now (nothing evicted)."""
    walk = tracker.victims()
    try:
        return list(walk)
    finally:
        walk.close()


# -- host pages with fewer numpy steps (9980441, 6802af9) -------------------------------------------------


BAD_SOURCES: dict[str, Callable[[], Any]] = {
    "every_other_row": lambda: pages(list(range(8)))[::2],
    "rows_reversed": lambda: pages(list(range(4)))[::-1],
    "bytes_reversed": lambda: pages(list(range(4)))[:, ::-1],
    "fortran_order": lambda: np.asfortranarray(pages(list(range(4)))),
    "rows_cut_short_in_place": lambda: np.zeros((4, 2 * SLOT), dtype=np.uint8)[:, :SLOT],
    "rows_longer_than_the_slot": lambda: np.zeros((4, SLOT + 1), dtype=np.uint8),
    "int8": lambda: pages(list(range(4))).view(np.int8),
    "uint16": lambda: pages(list(range(4))).view(np.uint16),
    "bool": lambda: pages(list(range(4))).view(np.bool_),
    "structured": lambda: pages(list(range(4))).view(np.dtype([("b", np.uint8)])),
    "three_d": lambda: pages(list(range(4))).reshape(4, 1, SLOT),
    "zero_length_rows": lambda: np.zeros((4, 0), dtype=np.uint8),
    "a_zero_length_buffer": lambda: [b"x", b"", b"y", b"z"],
    "a_reversed_buffer": lambda: [b"x", np.arange(8, dtype=np.uint8)[::-1], b"y", b"z"],
    "a_fortran_buffer": lambda: [b"x", np.asfortranarray(np.zeros((4, 4), np.uint8)), b"y", b"z"],
    "a_str": lambda: [b"x", "y", b"y", b"z"],
    "a_buffer_longer_than_the_slot": lambda: [b"x", bytes(SLOT + 1), b"y", b"z"],
    "one_buffer_for_four_keys": lambda: bytes(4 * SLOT),
    "three_rows_for_four_keys": lambda: pages(list(range(3))),
}


@pytest.mark.parametrize("bad", list(BAD_SOURCES))
async def test_bad_pages_are_refused_and_store_nothing(bad: str) -> None:
    async with open_store(8) as (tier, store):
        await bounded(store.store([100], pages([100])))
        with pytest.raises((ValueError, TypeError)):
            await bounded(store.store([0, 1, 2, 3], BAD_SOURCES[bad]()))
        assert store.keys() == [100] and store.statistics().stores == 1
        whole(tier, store)
        await exact(store)


BAD_DESTINATIONS: dict[str, Callable[[], Any]] = {
    "read_only": lambda: _read_only(np.zeros((4, SLOT), np.uint8)),
    "every_other_row": lambda: np.zeros((8, SLOT), np.uint8)[::2],
    "rows_reversed": lambda: np.zeros((4, SLOT), np.uint8)[::-1],
    "fortran_order": lambda: np.zeros((4, SLOT), np.uint8, order="F"),
    "rows_shorter_than_the_blocks": lambda: np.zeros((4, SLOT - 1), np.uint8),
    "zero_length_rows": lambda: np.zeros((4, 0), np.uint8),
    "int8": lambda: np.zeros((4, SLOT), np.int8),
    "a_bytes_page": lambda: [bytearray(SLOT), bytes(SLOT), bytearray(SLOT), bytearray(SLOT)],
    "a_read_only_array_page": lambda: [bytearray(SLOT), _read_only(np.zeros(SLOT, np.uint8)), *_buffers(2)],
    "a_zero_length_page": lambda: [bytearray(SLOT), bytearray(0), bytearray(SLOT), bytearray(SLOT)],
    "overlapping_pages": lambda: _overlapping(),
}


def _buffers(n: int) -> list[bytearray]:
    return [bytearray(SLOT) for _ in range(n)]


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _overlapping() -> list[Any]:
    buffer = bytearray(3 * SLOT)
    view = memoryview(buffer)
    return [view[:SLOT], view[SLOT - 1 : 2 * SLOT - 1], bytearray(SLOT), bytearray(SLOT)]


@pytest.mark.parametrize("bad", list(BAD_DESTINATIONS))
async def test_bad_destinations_are_refused_and_written_nothing(bad: str) -> None:
    async with open_store(8) as (tier, store):
        await bounded(store.store([0, 1, 2, 3], pages([0, 1, 2, 3])))
        dst = BAD_DESTINATIONS[bad]()
        before = [bytes(memoryview(d).cast("B")) if not isinstance(d, np.ndarray) else d.tobytes() for d in dst]
        with pytest.raises((ValueError, TypeError)):
            await bounded(store.load([0, 1, 2, 3], dst))
        after = [bytes(memoryview(d).cast("B")) if not isinstance(d, np.ndarray) else d.tobytes() for d in dst]
        assert after == before
        assert store.statistics().loads == 0
        whole(tier, store)


class _Subclass(np.ndarray):
    """An ndarray subclass: its rows are taken as the plain array's."""


async def test_good_pages_of_every_form_round_trip_bit_exact() -> None:
    async with open_store(32) as (tier, store):
        keys = list(range(4))
        data = [page(k) for k in keys]
        short = [page(k)[: 1 + 97 * k] for k in range(10, 14)]
        forms: list[tuple[list[int], Any, list[bytes]]] = [
            ([20], np.asfortranarray(np.frombuffer(page(20), np.uint8).reshape(1, SLOT)), [page(20)]),
            ([21], np.frombuffer(page(21), np.uint8).reshape(1, SLOT), [page(21)]),  # read-only: fine to store
            ([], np.zeros((0, SLOT), np.uint8), []),
            ([], [], []),
            (keys, np.frombuffer(b"".join(data), np.uint8).reshape(4, SLOT).view(_Subclass), data),
            (
                list(range(10, 14)),
                [short[0], bytearray(short[1]), memoryview(short[2]), np.frombuffer(short[3], np.uint8)],
                short,
            ),
            (
                [30, 31],
                [np.frombuffer(page(30), np.float32), memoryview(page(31)).cast("B", (64, 64))],
                [page(30), page(31)],
            ),
            (
                [40, 41, 42],
                np.frombuffer(b"".join(page(k)[:100] for k in (40, 41, 42)), np.uint8).reshape(3, 100),
                [page(k)[:100] for k in (40, 41, 42)],
            ),
        ]
        expected: dict[int, bytes] = {}
        for form_keys, src, blocks in forms:
            result = await bounded(store.store(form_keys, src))
            assert result.stored == tuple(form_keys)
            expected.update(zip(form_keys, blocks, strict=True))
        # Some present, some not: the rows of an array taken as a subset.
        mixed = [0, 50, 1, 51, 2]
        src = np.stack([np.frombuffer(expected.get(k, page(k)), np.uint8) for k in mixed])
        result = await bounded(store.store(mixed, src))
        assert result.stored == (50, 51) and result.present == (0, 1, 2)
        expected[50], expected[51] = page(50), page(51)
        everything = sorted(expected)
        lengths = [len(expected[k]) for k in everything]
        # Into rows as wide as the slot, wider rows, a subset, a 1-row Fortran array, and buffers of each kind.
        for width in (SLOT, SLOT + 64):
            dst = np.full((len(everything), width), 0xEE, np.uint8)
            await bounded(store.load(everything, dst))
            for k, n, row in zip(everything, lengths, dst, strict=True):
                assert row[:n].tobytes() == expected[k] and not (row[n:] != 0xEE).any()
        one = np.zeros((1, SLOT), np.uint8, order="F")
        await bounded(store.load([21], one))
        assert one.tobytes() == page(21)
        buffers: list[Any] = [bytearray(n) for n in lengths]
        kinds = [lambda b: b, memoryview, lambda b: np.frombuffer(b, np.uint8)]
        await bounded(store.load(everything, [kinds[i % 3](b) for i, b in enumerate(buffers)]))
        assert [bytes(b) for b in buffers] == [expected[k] for k in everything]
        whole(tier, store)


# -- the index counts its doomed blocks; unpin looks for them first (9dc3f00, ad5937a) -------------------

KEYS = [*range(12), 20, 21]
key_sets = st.lists(st.sampled_from(KEYS), min_size=1, max_size=5, unique=True)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("store"), key_sets, st.booleans()),
        st.tuples(st.just("load"), key_sets),
        st.tuples(st.just("discard"), key_sets),
        st.tuples(st.just("resize"), st.integers(4, 20)),
        st.tuples(st.just("let"), st.integers(1, 3)),
        st.tuples(st.just("settle")),
    ),
    min_size=1,
    max_size=25,
)
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
if uvloop is not None:
    LOOPS["uvloop"] = uvloop.new_event_loop


@pytest.mark.parametrize("loop", list(LOOPS))
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=operations)
@example(ops=[("store", [0, 1], True), ("settle",), ("load", [0]), ("discard", [0, 1]), ("let", 1), ("settle",)])
@example(  # two loads pin one block; the discard dooms it; each unpin in turn, the last one frees it
    ops=[("store", [0], True), ("settle",), ("load", [0]), ("load", [0, 0]), ("discard", [0]), ("let", 1), ("let", 1)]
)
@example(  # a pinned block in a full tier: stores evict around it, a shrink past it is refused
    ops=[
        ("store", list(range(12)), True),
        ("settle",),
        ("load", [11]),
        ("store", [20, 21], True),
        ("resize", 4),
        ("discard", [11]),
        ("store", [11], True),
        ("settle",),
    ]
)
@example(  # discarded while pinned and stored again at once: two slots for one key until the unpin
    ops=[("store", [3], True), ("settle",), ("load", [3]), ("discard", [3]), ("store", [3], False), ("let", 2)]
)
def test_pins_discards_evictions_and_shrinks_in_any_order_keep_the_counts_true(loop: str, ops: list[Any]) -> None:
    """Every copy is held until let through (in the order the store's thread takes them), so loads keep
    their blocks pinned across the discards, evictions, stores and shrinks that follow. After every step
    the books agree with a recount (``check_invariants``: the doomed blocks among them) and the pins are
    at least the in-flight loads' blocks; once everything settled, no slot is lost, every visible block
    loads bit-exact, and a key discarded is not back unless a store of it ran since."""
    copies = Copies()
    with pytest.MonkeyPatch.context() as patch, asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        patch.setattr(transfers_module, "landed_after", copies)
        try:
            runner.run(asyncio.wait_for(_run_operations(copies, ops), 60))
        finally:
            copies.release()


async def _run_operations(copies: Copies, ops: list[Any]) -> None:
    async with open_store(12) as (tier, store):
        try:
            await _operations(tier, store, copies, ops)
        finally:
            copies.release()  # the store's close waits for its copies


async def _operations(tier: HostTier, store: BlockStore, copies: Copies, ops: list[Any]) -> None:
    copies.held = True
    tasks: list[asyncio.Future[Any]] = []
    loads: dict[asyncio.Future[Any], set[int]] = {}  # a load in flight: the slots it pins
    stored_since: set[int] = set()  # keys a store was started for since their last discard

    async def settle_loop() -> None:
        for _ in range(5):
            await asyncio.sleep(0)

    for op in ops:
        kind = op[0]
        if kind == "store":
            stored_since.update(op[1])
            tasks.append(asyncio.ensure_future(store.store(op[1], pages(op[1]), wait=op[2])))
        elif kind == "load":
            ready = [k for k in op[1] if k in store]
            task = asyncio.ensure_future(store.load(op[1], np.zeros((len(op[1]), SLOT), np.uint8)))
            tasks.append(task)
            if len(ready) == len(op[1]):
                loads[task] = {store.slot(k) for k in ready}
        elif kind == "discard":
            present = {k for k in op[1] if k in store}  # a key being stored is not dropped
            assert store.discard(op[1]) == len(present)
            assert not any(k in store for k in op[1])
            stored_since -= present
        elif kind == "resize":
            tasks.append(asyncio.ensure_future(store.resize(op[1] * SLOT)))
        elif kind == "let":
            copies.let_through(op[1])
            await asyncio.sleep(0.002)
        else:
            copies.release()
            await _settled(tasks)
            copies.held = True
        await settle_loop()
        store.check_invariants()
        pinned = set().union(*(slots for task, slots in loads.items() if not task.done()))
        stats = store.statistics()
        assert stats.blocks_pinned >= len(pinned)
        if not any(not t.done() for t in tasks if t not in loads):  # no store or resize in flight
            assert stats.blocks_pinned == len(pinned)
        assert set(store.keys()) <= stored_since
    copies.release()
    await _settled(tasks)
    whole(tier, store)
    await exact(store)


async def _settled(tasks: list[asyncio.Future[Any]]) -> None:
    """Wait for every call; each ended as its docs allow."""
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=10)
        assert not pending, f"{len(pending)} calls never ended"
    for task in tasks:
        error = task.exception()
        assert error is None or isinstance(error, BlockNotFound | QuotaError), repr(error)
    tasks.clear()
