"""Adversarial tests of the lifecycle: races, hostile arguments, foreign loops, dying loops.

Each test states a promise of the guide or a docstring and tries to break it:
cancellation lands only once the object is consistent, nothing leaks (threads
or mappings) whatever the outcome, bad input gets a clear error and changes
nothing, nothing blocks on or releases from the loop thread. Tests marked
``xfail(strict=True)`` expose a bug named in their reason; the others are
regression tests. Every await is bounded by ``HANG``.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from aiokvtier import (
    CopyEngine,
    HostTier,
    OutOfSlots,
    QuotaError,
    SlotError,
    StaticHostMem,
    TierClosedError,
)
from aiokvtier._host._backing import HostBacking
from aiokvtier._host._slots import SlotAllocator
from aiokvtier._lifecycle import finish

from .conftest import PopulateGate
from .helpers import HostBackings, KiB, MiB, small_config, state_of
from .invariants import check_tier, leaked, maps_between, wait_no_library_threads
from .test_cancellation import run_script, sampled

HANG = 10.0
SLOT = 64 * KiB  # small_config's slot size


def snapshot(tier: HostTier) -> tuple[Any, ...]:
    """The figures a refused call must leave unchanged."""
    s = tier.statistics()
    return (s.quota, s.target_bytes, s.slots_total, s.slots_allocated, s.slots_free, s.views_exported, s.closed)


# -- residency waits -----------------------------------------------------------------------------


async def test_a_nan_wait_does_not_starve_other_waiters(gate: PopulateGate) -> None:
    async with HostTier(small_config()) as tier:
        nan_wait = asyncio.create_task(tier.wait_resident(float("nan")))
        await asyncio.sleep(0)
        allocate = asyncio.create_task(tier.allocate(100))
        await asyncio.sleep(0.01)
        gate.release_all()
        try:
            done, _ = await asyncio.wait({allocate}, timeout=3)
            assert done, "allocate(100) hung behind wait_resident(nan) although the fill completed"
            assert len(allocate.result()) == 100
            assert nan_wait.done() and isinstance(nan_wait.exception(), (TypeError, ValueError))
        finally:
            nan_wait.cancel()
            allocate.cancel()
            await asyncio.gather(nan_wait, allocate, return_exceptions=True)


async def _shrink_under_a_blocked_waiter(gate: PopulateGate, nbytes: int | None) -> tuple[BaseException | None, float]:
    """A thread waits (blocking) for bytes the fill has not reached; the tier then shrinks below them."""
    tier = await asyncio.wait_for(HostTier.open(small_config()), HANG)
    try:
        gate.allow(4)
        await asyncio.wait_for(tier.wait_resident(4 * MiB), HANG)
        outcome: list[BaseException | None] = []
        started = threading.Event()

        def waiter() -> None:
            started.set()
            try:
                tier.wait_resident_blocking(nbytes, timeout=1.5)
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=waiter)
        thread.start()
        await asyncio.to_thread(started.wait, HANG)
        await asyncio.sleep(0.05)
        shrink = asyncio.create_task(tier.resize(2 * MiB))
        await asyncio.sleep(0.02)
        gate.release_all()  # the unit being committed past the new end lands; the shrink goes on
        await asyncio.wait_for(shrink, HANG)
        t0 = time.monotonic()
        await asyncio.to_thread(thread.join, HANG)
        check_tier(tier)
        return outcome[0], time.monotonic() - t0
    finally:
        gate.release_all()
        await asyncio.wait_for(tier.aclose(), HANG)


@pytest.mark.parametrize("nbytes", [None, 32 * MiB], ids=["whole-quota", "past-new-quota"])
async def test_a_shrink_wakes_a_blocking_waiter_past_the_new_end(gate: PopulateGate, nbytes: int | None) -> None:
    error, waited = await _shrink_under_a_blocked_waiter(gate, nbytes)
    assert not isinstance(error, TimeoutError), f"the blocked thread slept to its timeout after the shrink: {error!r}"
    assert waited < 1.0


@pytest.mark.parametrize("nbytes", [None, 32 * MiB], ids=["whole-quota", "past-new-quota"])
async def test_a_shrink_wakes_an_async_waiter_past_the_new_end(gate: PopulateGate, nbytes: int | None) -> None:
    """The async counterpart of the test above: the resize kicks it and it re-reads the quota."""
    tier = await asyncio.wait_for(HostTier.open(small_config()), HANG)
    try:
        gate.allow(4)
        await asyncio.wait_for(tier.wait_resident(4 * MiB), HANG)
        waiter = asyncio.create_task(tier.wait_resident(nbytes))
        await asyncio.sleep(0.01)
        shrink = asyncio.create_task(tier.resize(2 * MiB))
        await asyncio.sleep(0.02)
        gate.release_all()
        await asyncio.wait_for(shrink, HANG)
        done, _ = await asyncio.wait({waiter}, timeout=HANG)
        assert done
        if nbytes is None:
            assert waiter.exception() is None
        else:
            assert isinstance(waiter.exception(), ValueError)
        check_tier(tier, settled=True)
    finally:
        gate.release_all()
        await asyncio.wait_for(tier.aclose(), HANG)


async def test_blocking_waiters_in_threads_wake_when_the_tier_closes(gate: PopulateGate) -> None:
    tier = await asyncio.wait_for(HostTier.open(small_config()), HANG)
    gate.allow(2)
    outcomes: list[BaseException | None] = []

    def waiter(nbytes: int | None) -> None:
        try:
            tier.wait_resident_blocking(nbytes, timeout=HANG)
            outcomes.append(None)
        except BaseException as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=waiter, args=(n,)) for n in (None, 8 * MiB, 32 * MiB, 64 * MiB)]
    for thread in threads:
        thread.start()
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    closer = asyncio.create_task(tier.aclose())
    await asyncio.sleep(0.01)
    gate.release_all()  # the unit held in populate lands; the fill stops after it
    await asyncio.wait_for(closer, HANG)
    for thread in threads:
        await asyncio.to_thread(thread.join, HANG)
    assert time.monotonic() - t0 < 3.0, "blocked threads outlived the close"
    assert len(outcomes) == 4 and all(isinstance(e, TierClosedError) for e in outcomes), outcomes
    with pytest.raises(TierClosedError):
        await asyncio.to_thread(tier.wait_resident_blocking, 0, 1.0)
    await wait_no_library_threads()


# -- resize races --------------------------------------------------------------------------------


async def test_a_view_taken_while_a_shrink_starts_is_never_unmapped() -> None:
    async with HostTier(small_config()) as tier:
        await asyncio.wait_for(tier.wait_resident(), HANG)
        slots = await tier.allocate(41)
        tier.free_many(slots[20:40])
        tier.free(slots[40])  # the most recently freed: allocate_nowait hands out slot 40 next
        views: list[memoryview] = []

        got: list[int] = []

        async def intruder() -> None:
            slot = tier.allocate_nowait()
            got.append(slot)
            views.append(tier.view(slot))
            tier.free(slot)

        # The resize runs its checks first; the intruder runs before the accepted work starts.
        shrink = asyncio.create_task(tier.resize(2 * MiB))  # 32 slots: slot 40 lies past the end
        other = asyncio.create_task(intruder())
        try:
            await asyncio.wait_for(shrink, HANG)
            shrunk = True
        except QuotaError:
            shrunk = False
        await asyncio.wait_for(other, HANG)
        # The shrink cuts the slots before it first yields: the intruder got a slot below the new end.
        assert got and (not shrunk or got[0] < tier.slots_total)
        address = tier.statistics().base_address + got[0] * SLOT
        perms = {p for _, _, p in maps_between(address, address + SLOT)}
        try:
            assert perms == {"rw-p"}, (
                f"shrink accepted: {shrunk}; a live view of slot 40 points at memory mapped {perms} "
                f"(views_exported={tier.statistics().views_exported}, slots_total={tier.statistics().slots_total})"
            )
        finally:
            views.clear()


async def test_a_slot_taken_while_a_shrink_starts_is_below_the_new_end() -> None:
    async with HostTier(small_config()) as tier:
        await asyncio.wait_for(tier.wait_resident(), HANG)
        slots = await tier.allocate(41)
        tier.free_many(slots[20:40])
        tier.free(slots[40])
        taken: list[int] = []
        before = snapshot(tier)
        shrink = asyncio.create_task(tier.resize(2 * MiB))
        # Runs in the loop iteration after resize() started: the shrink has already cut the slots.
        asyncio.get_running_loop().call_soon(lambda: taken.append(tier.allocate_nowait()))
        await asyncio.wait_for(shrink, HANG)
        assert len(taken) == 1 and taken[0] < tier.slots_total == 32
        assert snapshot(tier) != before and tier.statistics().quota == 2 * MiB
        check_tier(tier, settled=True)


async def test_queued_resizes_some_cancelled_then_close() -> None:
    """Resizes queue on the lock; some are cancelled; a close arrives; every caller ends, nothing leaks."""
    tier = await asyncio.wait_for(HostTier.open(small_config()), HANG)
    base = tier.statistics().base_address
    await asyncio.wait_for(tier.wait_resident(), HANG)
    rng = random.Random(5)
    quotas = [rng.choice([2, 8, 32, 64, 128, 256]) * MiB for _ in range(12)]
    tasks = [asyncio.create_task(tier.resize(q)) for q in quotas]
    await asyncio.sleep(0)
    for i in rng.sample(range(12), 5):
        tasks[i].cancel()
    await asyncio.sleep(0.001)
    closer = asyncio.create_task(tier.aclose())
    _, pending = await asyncio.wait([*tasks, closer], timeout=HANG)
    assert not pending, "a resize or the close hung"
    assert closer.exception() is None
    for task in tasks:
        if not task.cancelled():
            error = task.exception()
            assert error is None or isinstance(error, TierClosedError), repr(error)
    assert tier.closed and tier.released
    assert not leaked([base], 256 * MiB)
    await wait_no_library_threads()


async def test_close_races_allocate_and_wait_resident_waiters(gate: PopulateGate) -> None:
    tier = await asyncio.wait_for(HostTier.open(small_config()), HANG)
    base = tier.statistics().base_address
    gate.allow(3)
    waiters = [asyncio.create_task(tier.allocate(n)) for n in (1, 50, 100, 500, 1000)]
    waiters += [asyncio.create_task(tier.wait_resident(n)) for n in (None, 2 * MiB, 40 * MiB)]
    waiters += [asyncio.create_task(tier.resize(n * MiB)) for n in (128, 1)]
    await asyncio.sleep(0.02)
    waiters[1].cancel()
    closer = asyncio.create_task(tier.aclose())
    await asyncio.sleep(0.01)
    gate.release_all()
    _, pending = await asyncio.wait([*waiters, closer], timeout=HANG)
    assert not pending, "a waiter hung after the close"
    for task in waiters:
        if task.cancelled():
            continue
        error = task.exception()
        # Those already satisfied before the close (the first units) may have succeeded.
        # OutOfSlots, ValueError: an allocate or a wait that re-read the quota after the shrink to 16 slots.
        assert error is None or isinstance(error, (TierClosedError, OutOfSlots, ValueError)), repr(error)
    assert tier.released and not leaked([base], 256 * MiB)
    await wait_no_library_threads()


async def test_memory_error_inside_a_resize_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    async with HostTier(small_config()) as tier:
        await asyncio.wait_for(tier.wait_resident(), HANG)
        slots = await tier.allocate(10)
        real = SlotAllocator.resize

        def failing(self: SlotAllocator, total: int) -> None:
            raise MemoryError("injected")

        for quota in (128 * MiB, 8 * MiB):
            before = snapshot(tier)
            monkeypatch.setattr(SlotAllocator, "resize", failing)
            with pytest.raises(MemoryError):
                await asyncio.wait_for(tier.resize(quota), HANG)
            monkeypatch.setattr(SlotAllocator, "resize", real)
            assert snapshot(tier) == before
            check_tier(tier, settled=True)
        # The tier still works: a resize, the slots, the fill.
        await asyncio.wait_for(tier.resize(128 * MiB), HANG)
        await asyncio.wait_for(tier.wait_resident(), HANG)
        check_tier(tier, settled=True)
        assert len(await tier.allocate(2000)) == 2000
        tier.free_many(slots)


async def test_resize_with_views_then_close_then_drop_the_views(reserved: list[int]) -> None:
    tier = await asyncio.wait_for(HostTier.open(small_config()), HANG)
    await asyncio.wait_for(tier.wait_resident(), HANG)
    slots = await tier.allocate(40)
    views = [tier.view(s) for s in slots[:40:3]]
    for i, view in enumerate(views):
        view[:] = bytes([i + 1]) * SLOT
    del view
    await asyncio.wait_for(tier.resize(128 * MiB), HANG)
    with pytest.raises(QuotaError):
        await asyncio.wait_for(tier.resize(1 * MiB), HANG)  # slot 39 is viewed
    tier.free_many(slots)
    await asyncio.wait_for(tier.resize(3 * MiB), HANG)  # the views all lie below 40 slots = 2.5 MiB
    check_tier(tier)
    await asyncio.wait_for(tier.aclose(), HANG)
    assert not tier.released and leaked(reserved, 256 * MiB), "unmapped under live views"
    assert all(bytes(v[:1]) == bytes([i + 1]) for i, v in enumerate(views)), "retained slots lost their contents"
    views.clear()
    await wait_no_library_threads()
    assert tier.released
    assert not leaked(reserved, 256 * MiB)


# -- hostile arguments ---------------------------------------------------------------------------


HOSTILE = [True, False, 1.5, float("nan"), "1", None, -1, 2**70, np.float64(1.0), b"\x01"]


async def test_hostile_arguments_raise_clearly_and_change_nothing() -> None:
    async with HostTier(small_config()) as tier:
        await asyncio.wait_for(tier.wait_resident(), HANG)
        slots = await tier.allocate(8)
        tier.free(slots[-1])
        held = slots[:-1]
        before = snapshot(tier)

        def refused(call: Callable[[], Any], *kinds: type[BaseException]) -> None:
            with pytest.raises(kinds):
                call()
            assert snapshot(tier) == before, f"{call} changed the tier"

        for value in HOSTILE:
            refused(lambda v=value: tier.free(v), SlotError)
            refused(lambda v=value: tier.address(v), SlotError)
            refused(lambda v=value: tier.view(v), SlotError)
            refused(lambda v=value: tier.free_many([held[0], v]), SlotError)
            refused(lambda v=value: tier.slot_addresses([held[0], v]), SlotError)
            with pytest.raises(QuotaError):
                await asyncio.wait_for(tier.resize(value), HANG)  # type: ignore[arg-type]
            assert snapshot(tier) == before
        for value in (True, 1.5, "1", np.float64(2.0), -1, 0):
            with pytest.raises((TypeError, ValueError)):
                await asyncio.wait_for(tier.allocate(value), HANG)  # type: ignore[call-overload]
            assert snapshot(tier) == before
        with pytest.raises(OutOfSlots):
            await asyncio.wait_for(tier.allocate(2**70), HANG)
        for value in (-1, 2**70, 64 * MiB + 1, "1"):
            with pytest.raises((TypeError, ValueError)):
                await asyncio.wait_for(tier.wait_resident(value), HANG)  # type: ignore[arg-type]
        refused(lambda: tier.free(slots[-1]), SlotError)  # a double free
        refused(lambda: tier.free_many([held[0], held[0]]), SlotError)
        refused(lambda: tier.free_many(np.array([[held[0]]])), SlotError)
        refused(lambda: tier.free_many(np.array([held[0]], dtype=np.float64)), SlotError)
        refused(lambda: tier.free_many(np.array([held[0], 2**64 - 1], dtype=np.uint64)), SlotError)
        refused(lambda: tier.free_many([held[0], slots[-1]]), SlotError)
        refused(lambda: tier.free_many(iter([held[0], 10**6])), SlotError)
        with pytest.raises(QuotaError):
            await asyncio.wait_for(tier.resize(1 << 40), HANG)
        with pytest.raises(QuotaError):
            await asyncio.wait_for(tier.resize("64 parsecs"), HANG)
        assert snapshot(tier) == before
        # Valid numpy integers are taken where operator.index is (counts, quotas, id arrays).
        assert len(await asyncio.wait_for(tier.allocate(np.int64(2)), HANG)) == 2
        await asyncio.wait_for(tier.resize(np.int64(64 * MiB)), HANG)
        tier.free_many(np.array(held[:2], dtype=np.int32))
        check_tier(tier, settled=True)


async def test_a_refused_second_open_from_another_loop_changes_nothing() -> None:
    async with HostTier(small_config()) as tier:
        await asyncio.wait_for(tier.wait_resident(), HANG)
        errors: list[BaseException] = []

        def reopen() -> None:
            try:
                asyncio.run(tier.__aenter__())
            except BaseException as exc:
                errors.append(exc)

        await asyncio.to_thread(reopen)
        assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
        with pytest.raises(RuntimeError, match="block the event loop"):
            tier.wait_resident_blocking(0, timeout=0)


LOOP_HOP = """
from aiokvtier import HostTier, TierClosedError
from tests.helpers import small_config

tier = asyncio.run(HostTier.open(small_config()))

async def main():
    tier.wait_resident_blocking(None, 30)  # resident: nothing to wait for from here on
    try:
        await asyncio.wait_for(tier.wait_resident(), 5)
    except RuntimeError as exc:
        print("refused:", exc, flush=True)
    try:
        slot = await asyncio.wait_for(tier.allocate(), 5)
        print("allocate from a second loop returned slot", slot, flush=True)
    except RuntimeError as exc:
        print("refused:", exc, flush=True)
    await asyncio.wait_for(tier.aclose(), 30)

run(main)
"""


def test_a_tier_used_from_a_second_loop_refuses_clearly() -> None:
    out = run_script(LOOP_HOP, "asyncio", timeout=60)
    assert "refused:" in out and "loop" in out, out


# -- copies --------------------------------------------------------------------------------------


CLOSE_UNDER_A_RAW_COPY = """
from aiokvtier import CopyEngine, CopyPlanError, HostTier, HostTierConfig, StaticHostMem, TierClosedError
MiB = 1 << 20

async def main():
    cfg = HostTierConfig(quota=512 * MiB, max_quota=512 * MiB, slot_size=MiB, commit_unit=MiB, fill_chunk=64 * MiB)
    async with CopyEngine(None) as engine, StaticHostMem(256 * MiB) as src:
        src.view()[:] = b"\\x07" * (256 * MiB)
        tier = await HostTier.open(cfg)
        await asyncio.wait_for(tier.wait_resident(), 60)
        base = tier.base_address
        slow = asyncio.create_task(engine.copy([(base + i * MiB, src.address + i * MiB, MiB) for i in range(256)]))
        await asyncio.sleep(0)
        closer = asyncio.create_task(tier.aclose())
        for _ in range(3):
            await asyncio.sleep(0)  # the close's teardown has taken its snapshot of copies in flight
        print("tier closed:", tier.closed, flush=True)
        late = [(base + 256 * MiB + i * MiB, src.address + i * MiB, MiB) for i in range(256)]
        try:
            await asyncio.wait_for(engine.copy(late), 60)
            print("a raw copy into the closing tier was accepted", flush=True)
        except (CopyPlanError, TierClosedError) as exc:
            print("refused:", exc, flush=True)
        await asyncio.wait_for(slow, 60)
        await asyncio.wait_for(closer, 60)

run(main)
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_raw_copy_into_a_closing_tier_is_refused(loop: str) -> None:
    out = run_script(CLOSE_UNDER_A_RAW_COPY, loop, timeout=60)
    assert "refused:" in out, out


ROWS = 16


def copy_config() -> Any:
    return small_config(quota=8 * ROWS * MiB, max_quota=8 * ROWS * MiB, slot_size=MiB)


def peek(tier: HostTier, slot: int) -> np.ndarray:
    """Every 4096th byte of a one-MiB slot, read without a view (a view would defer the tier's release)."""
    return np.frombuffer(ctypes.string_at(tier.address(slot), MiB), dtype=np.uint8)[::4096]


def pages(value: int) -> np.ndarray:
    return np.full((ROWS, MiB), value, dtype=np.uint8)


async def test_close_of_a_tier_waits_for_a_copy_queued_behind_a_slow_one(reserved: list[int]) -> None:
    big = np.full((8 * ROWS, MiB), 3, dtype=np.uint8)
    async with CopyEngine(None) as engine, HostTier(copy_config()) as slow_tier:
        tier = await asyncio.wait_for(HostTier.open(copy_config()), HANG)
        for t in (tier, slow_tier):
            await asyncio.wait_for(t.wait_resident(), HANG)
        big_slots = await slow_tier.allocate(8 * ROWS)
        slots = await tier.allocate(ROWS)
        await asyncio.wait_for(engine.to_host(tier, slots, pages(1)), HANG)
        out = np.zeros((ROWS, MiB), dtype=np.uint8)
        slow = asyncio.create_task(engine.to_host(slow_tier, big_slots, big))
        await asyncio.sleep(0)
        queued = asyncio.create_task(engine.to_device(tier, slots, out))
        await asyncio.sleep(0)
        await asyncio.wait_for(tier.aclose(), HANG)
        assert np.array_equal(sampled(out), sampled(pages(1))), "the tier closed before the queued copy read it"
        assert tier.released
        await asyncio.wait_for(asyncio.gather(slow, queued), HANG)
        late = asyncio.create_task(engine.to_device(tier, slots, out))
        with pytest.raises(TierClosedError):
            await asyncio.wait_for(late, HANG)
    await wait_no_library_threads()


async def test_closing_the_engine_under_copies_from_many_tasks() -> None:
    async with HostTier(copy_config()) as tier:
        await asyncio.wait_for(tier.wait_resident(), HANG)
        groups = [await tier.allocate(ROWS) for _ in range(8)]
        engine = await asyncio.wait_for(CopyEngine.open(None, max_batch=3), HANG)
        tasks = [asyncio.create_task(engine.to_host(tier, g, pages(i + 1))) for i, g in enumerate(groups)]
        for _ in range(3):
            await asyncio.sleep(0)
        await asyncio.wait_for(engine.aclose(), HANG)
        _, pending = await asyncio.wait(tasks, timeout=HANG)
        assert not pending, "a copy hung across the engine's close"
        results = {"landed": 0, "refused": 0}
        for i, (task, group) in enumerate(zip(tasks, groups, strict=True)):
            got = peek(tier, group[0])
            if task.exception() is None:
                results["landed"] += 1
                assert (got == i + 1).all(), f"copy {i} reported success without its bytes"
            else:
                results["refused"] += 1
                assert isinstance(task.exception(), TierClosedError), repr(task.exception())
                assert (got == 0).all(), f"copy {i} was refused but wrote"
        assert results["landed"] >= 1 and engine.closed
        s = engine.statistics()
        assert s.jobs_submitted == s.jobs_completed == results["landed"]
        await asyncio.wait_for(engine.aclose(), HANG)  # idempotent
        with pytest.raises(TierClosedError):
            await asyncio.wait_for(engine.to_host(tier, groups[0], pages(9)), HANG)
    await wait_no_library_threads()


async def test_many_concurrent_copies_cancelled_at_random_leave_whole_destinations() -> None:
    rng = random.Random(11)
    async with CopyEngine(None) as engine, HostTier(copy_config()) as tier:
        await asyncio.wait_for(tier.wait_resident(), HANG)
        groups = [await tier.allocate(ROWS) for _ in range(8)]
        faults: list[str] = []

        async def one(i: int, value: int, delay: float) -> None:
            group = groups[i]
            old = int(peek(tier, group[0])[0])
            task = asyncio.create_task(engine.to_host(tier, group, pages(value)))
            await asyncio.sleep(delay)
            task.cancel()
            try:
                await asyncio.wait_for(task, HANG)
            except asyncio.CancelledError:
                pass
            # Control is back: the group holds the old bytes or the new ones, whole.
            firsts = {int(peek(tier, s).min()) for s in group} | {int(peek(tier, s).max()) for s in group}
            if firsts not in ({old}, {value}):
                faults.append(f"group {i}: bytes {sorted(firsts)} after a cancel (old {old}, new {value})")

        for round_ in range(6):
            await asyncio.wait_for(
                asyncio.gather(*(one(i, 10 * round_ + i + 1, rng.random() ** 2 * 0.01) for i in range(8))), HANG
            )
        assert not faults, faults
        assert engine.statistics().jobs_submitted == engine.statistics().jobs_completed
    await wait_no_library_threads()


# -- lifecycle under exceptions --------------------------------------------------------------------


class Abort(BaseException):
    """A KeyboardInterrupt-like exception that is not an Exception."""


async def test_finish_passes_a_base_exception_through() -> None:
    async def work() -> None:
        await asyncio.sleep(0.01)
        raise Abort("stop")

    with pytest.raises(Abort):
        await asyncio.wait_for(finish(work()), HANG)

    async def caller() -> None:
        await finish(work())

    task = asyncio.create_task(caller())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError) as info:
        await asyncio.wait_for(task, HANG)
    assert isinstance(info.value.__cause__, Abort)


async def test_a_base_exception_in_the_build_releases_everything(reserved: list[int]) -> None:
    class Aborting(HostBacking):
        def expose(self, end: int) -> None:  # the build's first fill target, on the tier's worker
            raise Abort("from the worker")

    tier = HostTier(small_config(), backings=HostBackings(Aborting))
    with pytest.raises(Abort):
        await asyncio.wait_for(tier.__aenter__(), HANG)
    assert tier.closed and reserved and tier.released
    assert not leaked(reserved, 256 * MiB)
    await wait_no_library_threads()


@pytest.mark.parametrize("delay", [0, 0.002, 0.01, 0.05, 0.15])
async def test_a_taskgroup_failure_closes_a_tier_an_engine_and_a_buffer(delay: float) -> None:
    """A sibling fails while the three are opening, open, or copying: all close, nothing is left."""

    class Boom(Exception):
        pass

    tier, engine, buf = HostTier(copy_config()), CopyEngine(None), StaticHostMem(ROWS * MiB)
    copies = 0

    async def user() -> None:
        nonlocal copies
        async with tier, engine, buf:
            # Not wait_for: on Python 3.11 it swallows a cancellation that lands as the awaited call
            # finishes (fixed in 3.12), and this loop would then copy forever.
            async with asyncio.timeout(HANG):
                await tier.wait_resident()
            slots = await tier.allocate(ROWS)
            view = buf.view()
            view[:] = b"\x05" * (ROWS * MiB)
            del view
            while True:  # copies until the sibling fails
                assert not asyncio.current_task().cancelling(), "a cancellation was lost"  # type: ignore[union-attr]
                await engine.copy([(tier.address(s), buf.address + i * MiB, MiB) for i, s in enumerate(slots)])
                copies += 1

    async def sibling() -> None:
        await asyncio.sleep(delay)
        raise Boom

    with pytest.raises(ExceptionGroup) as info:
        async with asyncio.timeout(HANG), asyncio.TaskGroup() as tg:
            tg.create_task(user())
            tg.create_task(sibling())
    assert info.group_contains(Boom) and not info.group_contains(asyncio.CancelledError)
    states = [state_of(o) for o in (tier, engine, buf)]
    assert all(state in ("new", "closed") for state in states), states  # new: never entered
    # (Freed ranges are soon reused by thread stacks and arenas: the objects' own flags say what was released.)
    for owner in (tier, buf):
        assert state_of(owner) == "new" or owner.released, f"{owner!r} not released ({delay} s, {copies} copies)"
    await wait_no_library_threads()


# -- loops that go away, and forks ---------------------------------------------------------------


LOOP_ENDS_MID_FILL = """
import threading, time
from aiokvtier import HostTier, HostTierConfig
MiB, GiB = 1 << 20, 1 << 30
kept = []

async def main():
    cfg = HostTierConfig(quota=2 * GiB, max_quota=2 * GiB, slot_size=MiB, commit_unit=MiB, fill_chunk=16 * MiB,
                         fill_threads=2)
    tier = await HostTier.open(cfg)
    kept.append(tier)
    await tier.allocate()
    asyncio.create_task(tier.wait_resident())  # an armed waiter, cancelled by asyncio.run
    asyncio.create_task(tier.resize(GiB))  # a resize in flight
    await asyncio.sleep(0.01)
    print("left while filling:", tier.statistics().filling, flush=True)

run(main)
time.sleep(0.3)  # the fill threads go on publishing to a closed loop
print("threads:", sorted({t.name for t in threading.enumerate() if t.name.startswith("aiokvtier")}), flush=True)
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_loop_that_ends_without_aclose_mid_fill_exits_quietly(loop: str) -> None:
    import subprocess
    import sys

    from .test_cancellation import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = (
        "import asyncio, sys\n"
        "def run(main):\n"
        "    if sys.argv[1] == 'uvloop':\n"
        "        import uvloop\n"
        "        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r: r.run(main())\n"
        "    else:\n"
        "        asyncio.run(main())\n"
    ) + LOOP_ENDS_MID_FILL
    done = subprocess.run(
        [sys.executable, "-c", script, loop], capture_output=True, text=True, env=env, timeout=60, cwd=ROOT
    )
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stderr[-3000:]}"
    assert "left while filling: True" in done.stdout
    noise = [line for line in done.stderr.splitlines() if line.strip()]
    assert not noise, "stderr after the loop closed:\n" + done.stderr[-3000:]


def _wait_child(pid: int, within: float) -> int:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"the forked child hung for {within} s")


@pytest.fixture
def opened_engine_and_buffer() -> Iterator[tuple[CopyEngine, StaticHostMem]]:
    runner = asyncio.Runner()
    engine = runner.run(CopyEngine.open(None))
    buf = runner.run(StaticHostMem.open(MiB))
    yield engine, buf
    runner.run(buf.aclose())
    runner.run(engine.aclose())
    runner.close()


def test_a_forked_child_cannot_use_an_engine_or_a_buffer(
    opened_engine_and_buffer: tuple[CopyEngine, StaticHostMem],
) -> None:
    engine, buf = opened_engine_and_buffer
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        report = []
        try:
            with asyncio.Runner() as runner:
                for name, call in (
                    ("copy", lambda: runner.run(asyncio.wait_for(engine.copy([(buf.address, buf.address, 1)]), 5))),
                    ("view", buf.view),
                    ("address", lambda: buf.address),
                ):
                    try:
                        call()
                        report.append(f"{name}: no error")
                    except TierClosedError as exc:
                        report.append(f"{name}: ok" if "fork" in str(exc) else f"{name}: {exc}")
                    except BaseException as exc:
                        report.append(f"{name}: {exc!r}")
                runner.run(asyncio.wait_for(engine.aclose(), 5))
                runner.run(asyncio.wait_for(buf.aclose(), 5))
                report.append(f"closed: {engine.closed and buf.closed}")
        finally:
            os.write(write, "\n".join(report).encode())
            os._exit(0)
    os.close(write)
    status = _wait_child(pid, 30)
    with os.fdopen(read) as f:
        report = f.read()
    assert os.waitstatus_to_exitcode(status) == 0, report
    assert report.splitlines() == ["copy: ok", "view: ok", "address: ok", "closed: True"], report
    # The parent's objects are untouched by the child's close.
    assert not engine.closed and not buf.closed
    assert bytes(buf.view()[:1]) == b"\x00"


async def test_the_few_ids_path_gives_slot_addresses_or_leaves_the_ids_to_it() -> None:
    """``slot_address_list`` (a request's few ids, checked in C passes) gives exactly
    ``slot_addresses()`` as ints for lists, tuples and 1-D integer arrays of allocated ids, and None
    for anything else, which ``slot_addresses()`` then refuses or takes as it always has."""
    async with HostTier(small_config()) as tier:
        await asyncio.wait_for(tier.wait_resident(), HANG)
        slots = await tier.allocate(40)
        tier.free(slots[-1])
        held, freed = slots[:-1], slots[-1]
        rng = np.random.default_rng(7)
        for n in (1, 2, 16, 32):
            ids = [int(i) for i in rng.choice(held, n, replace=n > len(held))]
            for form in (ids, tuple(ids), np.array(ids, np.int64), np.array(ids, np.uint32)):
                assert tier.slot_address_list(form) == tier.slot_addresses(form).tolist(), form
        assert tier.slot_address_list([held[0], held[0]]) == tier.slot_addresses([held[0], held[0]]).tolist()
        many = held[:33]  # past FEW_IDS: the array path
        assert tier.slot_address_list(many) is None
        assert tier.slot_addresses(many).tolist() == [tier.address(s) for s in many]
        for value in [*HOSTILE, freed, tier.statistics().slots_total, np.int64(held[0])]:
            assert tier.slot_address_list([held[0], value]) is None, value
        for other in ([], (), np.array([], np.int64), np.array([[held[0]]]), iter([held[0]]), {held[0]}, held[0]):
            assert tier.slot_address_list(other) is None, other
        assert tier.slot_addresses([held[0], np.int64(held[1])]).tolist() == [
            tier.address(held[0]),
            tier.address(held[1]),
        ]  # numpy ints in a list: the array path takes them, as before
    with pytest.raises(TierClosedError):
        tier.slot_address_list([held[0]])


def test_ids_changed_by_another_thread_during_the_check_are_never_copied_unchecked() -> None:
    """A caller's list that another thread rewrites while the tier checks it: what comes back is the
    addresses of allocated slots the list held at one moment, or a SlotError; never the address of an
    id that was not checked (below the tier, past it, or freed)."""
    import sys
    import threading

    async def scenario() -> None:
        async with HostTier(small_config()) as tier:
            await asyncio.wait_for(tier.wait_resident(), HANG)
            held = await tier.allocate(4)
            freed = (await tier.allocate(1))[0]
            tier.free(freed)
            good = {tier.address(s) for s in held}
            ids = [held[0], held[1]]
            stop = threading.Event()

            def flip() -> None:
                bad = (-5, freed, 2**40)
                k = 0
                while not stop.is_set():
                    ids[1] = bad[k % 3]
                    ids[1] = held[1]
                    k += 1

            writer = threading.Thread(target=flip)
            interval = sys.getswitchinterval()
            sys.setswitchinterval(1e-6)
            writer.start()
            seen = refused = 0
            try:
                for _ in range(3000):
                    for call in (tier.slot_address_list, tier.slot_addresses):
                        try:
                            got = call(ids)
                        except SlotError:
                            refused += 1
                            continue
                        if got is None:
                            continue
                        got = got.tolist() if isinstance(got, np.ndarray) else got
                        assert set(got) <= good, got
                        seen += 1
            finally:
                stop.set()
                sys.setswitchinterval(interval)
                writer.join(HANG)
            assert seen > 0

    asyncio.run(scenario())
