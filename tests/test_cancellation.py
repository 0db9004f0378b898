"""Cancellation at every await of the tier's and the engine's lifecycles.

Each test sweeps three sources of cancellation: ``asyncio.wait_for`` with a
timeout swept from 0 to 50 ms, a TaskGroup whose sibling raises after the
same delays, and ``task.cancel()`` after a seeded random delay. After each
cancelled call the tier must be whole (see ``invariants.check_tier``) or
wholly gone. Every await is bounded, so a hang fails the test instead of
stalling the suite. Tests whose failure could leave a decommit running
against a closed range leave a broken tier open rather than unmap under it.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import random
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

import anyio
import numpy as np
import pytest

from aiokvtier import CopyEngine, HostTier, TierClosedError
from aiokvtier._host import _linux
from aiokvtier._host._backing import HostBacking

from .conftest import PopulateGate
from .helpers import HostBackings, MiB, small_config
from .invariants import check_tier, leaked, wait_no_library_threads

T = TypeVar("T")

DELAYS = (0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05)
HANG = 10.0  # seconds after which a call counts as hung
ROOT = Path(__file__).resolve().parents[1]


class SiblingFailed(Exception):
    """Raised by a TaskGroup sibling to cancel the task under test."""


def sweep(
    seed: int, delays: tuple[float, ...] = DELAYS, taskgroup: int = 8, cancels: int = 6
) -> list[tuple[str, float]]:
    """``(how, delay)`` cases: every delay through wait_for, the first ``taskgroup`` through a
    TaskGroup, and ``cancels`` seeded random delays (small ones likelier) through task.cancel()."""
    rng = random.Random(seed)
    cases = [("wait_for", d) for d in delays] + [("taskgroup", d) for d in delays[:taskgroup]]
    cases += [("cancel", 0.0)] + [("cancel", rng.random() ** 2 * max(delays)) for _ in range(cancels - 1)]
    return cases


class Outcome(NamedTuple, Generic[T]):
    started: bool
    """Whether the call ran at all: ``wait_for(call, 0)`` cancels it before its first step."""
    cancelled: bool
    result: T | None


async def cancel_during(call: Callable[[], Awaitable[T]], how: str, delay: float) -> Outcome[T]:
    """Run ``call()`` and cancel it ``delay`` s in, through ``how``.

    :raises AssertionError: the call had not returned ``HANG`` s after the cancellation.
    """
    started: list[bool] = []

    async def tracked() -> T:
        started.append(True)
        return await call()

    async def by_wait_for() -> tuple[bool, T | None]:
        try:
            return False, await asyncio.wait_for(tracked(), delay)
        except TimeoutError:
            return True, None

    async def by_taskgroup() -> tuple[bool, T | None]:
        out: list[T] = []

        async def main() -> None:
            out.append(await tracked())

        async def sibling() -> None:
            await asyncio.sleep(delay)
            raise SiblingFailed

        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(main())
                tg.create_task(sibling())
        except* SiblingFailed:
            pass
        return (False, out[0]) if out else (True, None)

    async def by_cancel() -> tuple[bool, T | None]:
        task = asyncio.ensure_future(tracked())
        await asyncio.sleep(delay)
        task.cancel()
        try:
            return False, await task
        except asyncio.CancelledError:
            return True, None

    runner = asyncio.ensure_future({"wait_for": by_wait_for, "taskgroup": by_taskgroup, "cancel": by_cancel}[how]())
    done, _ = await asyncio.wait({runner}, timeout=HANG)
    if not done:
        runner.cancel()
        raise AssertionError(f"cancelled by {how} after {delay} s, the call had not returned {HANG} s later")
    cancelled, result = runner.result()
    return Outcome(bool(started), cancelled, result)


def raw_bytes(address: int, rows: int, row: int) -> np.ndarray:
    """Read-only numpy view of ``rows * row`` bytes at ``address`` (not through the tier's view ledger)."""
    return np.frombuffer((ctypes.c_ubyte * (rows * row)).from_address(address), dtype=np.uint8).reshape(rows, row)


def sampled(array: np.ndarray) -> np.ndarray:
    """The first byte of every page and the last byte of every row: enough to see a partly done copy."""
    return np.concatenate([array[:, :: _linux.PAGE_SIZE].ravel(), array[:, -1]])


async def write_every_slot(tier: HostTier, slots: list[int], value: int) -> None:
    block = bytes([value]) * tier.slot_size
    for i, slot in enumerate(slots):
        tier.view(slot)[:] = block
        if i % 256 == 255:
            await asyncio.sleep(0)


@pytest.fixture
def slow_reserve(reserved: list[int], monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Reservations take 3 ms (as on a loaded machine), so a cancellation lands while one is under way."""
    spy = _linux.mmap_reserve

    def slow(length: int, align: int) -> tuple[int, int]:
        time.sleep(0.003)
        return spy(length, align)

    monkeypatch.setattr(_linux, "mmap_reserve", slow)
    return reserved


# -- open ------------------------------------------------------------------------------------


async def _open_and_check(cfg: Any, form: str, how: str, delay: float, bases: list[int]) -> None:
    if form == "open":

        async def call() -> HostTier:
            return await HostTier.open(cfg)
    else:

        async def call() -> HostTier:
            async with HostTier(cfg) as tier:
                await asyncio.sleep(0)
            return tier

    _, cancelled, tier = await cancel_during(call, how, delay)
    if not cancelled:
        assert tier is not None
        await asyncio.wait_for(tier.aclose(), HANG)
    left = leaked(bases, cfg.max_quota)
    assert not left, f"open cancelled by {how} after {delay} s left reservations mapped: {left}"
    await wait_no_library_threads()


@pytest.mark.parametrize("form", ["open", "async_with"])
async def test_cancelled_open_releases_everything(form: str, reserved: list[int]) -> None:
    cfg = small_config(quota=4 * MiB, max_quota=64 * MiB)
    for how, delay in sweep(1, cancels=30):
        await _open_and_check(cfg, form, how, delay, reserved)
    # A reservation that finished on a worker thread after its open was cancelled shows up late.
    await asyncio.sleep(0.1)
    assert not leaked(reserved, cfg.max_quota), "a cancelled open reserved its range after it returned"


@pytest.mark.parametrize("form", ["open", "async_with"])
async def test_cancelled_open_during_a_slow_reservation_releases_it(form: str, slow_reserve: list[int]) -> None:
    cfg = small_config(quota=4 * MiB, max_quota=64 * MiB)
    for how, delay in sweep(2, delays=(0.0005, 0.001, 0.002), cancels=4):
        await _open_and_check(cfg, form, how, delay, slow_reserve)
    await asyncio.sleep(0.1)
    assert not leaked(slow_reserve, cfg.max_quota), "a cancelled open reserved its range after it returned"


# -- close -----------------------------------------------------------------------------------


async def _assert_torn_down(tier: HostTier, base: int, what: str) -> None:
    assert tier.closed, f"{what}: the tier is not closed"
    left = leaked([base], tier.config.max_quota)
    assert not left and tier.released, f"{what}: the teardown had not finished when control came back: {left}"
    try:
        await asyncio.wait_for(tier.aclose(), 5)
    except TimeoutError:
        raise AssertionError(f"{what}: a second aclose() hung ({tier!r})") from None
    await wait_no_library_threads()


@pytest.mark.parametrize("filling", [False, True], ids=["resident", "filling"])
async def test_cancelled_aclose_still_tears_down(filling: bool) -> None:
    for how, delay in sweep(3):
        tier = await asyncio.wait_for(HostTier.open(small_config()), HANG)
        base = tier.statistics().base_address
        if not filling:
            await asyncio.wait_for(tier.wait_resident(), HANG)
        await asyncio.wait_for(tier.allocate(4), HANG)
        outcome = await cancel_during(tier.aclose, how, delay)
        if not outcome.started:  # cancelled before its first step: nothing may have changed
            assert not tier.closed
            check_tier(tier)
            await asyncio.wait_for(tier.aclose(), HANG)
        await _assert_torn_down(tier, base, f"aclose cancelled by {how} after {delay} s")


async def _exit_cancelled_by_a_sibling(delay: float) -> HostTier:
    """``async with HostTier(...)`` in a TaskGroup whose sibling raises ``delay`` s into the exit."""
    tiers: list[HostTier] = []
    exiting = asyncio.Event()

    async def body() -> None:
        async with HostTier(small_config()) as tier:
            tiers.append(tier)
            await tier.allocate()
            exiting.set()

    async def sibling() -> None:
        await exiting.wait()
        await asyncio.sleep(delay)
        raise SiblingFailed

    with pytest.raises(ExceptionGroup) as info:
        async with asyncio.timeout(HANG), asyncio.TaskGroup() as tg:
            tg.create_task(body())
            tg.create_task(sibling())
    assert info.group_contains(SiblingFailed)
    return tiers[0]


async def test_taskgroup_cancelling_async_with_exit_leaves_nothing() -> None:
    for delay in (0, 0, 0.0005, 0.001, 0.002, 0.005, 0.01):
        tier = await _exit_cancelled_by_a_sibling(delay)
        base = tier.statistics().base_address
        await _assert_torn_down(tier, base, f"async-with exit cancelled by a sibling after {delay} s")


# -- resize ----------------------------------------------------------------------------------

GROW = (16 * MiB, 96 * MiB)
SHRINK = (96 * MiB, 8 * MiB)


async def _check_after_resize(tier: HostTier, old: int, new: int, what: str, retained: list[int]) -> None:
    s = tier.statistics()
    assert s.quota in (old, new), f"{what}: quota {s.quota} is neither the old {old} nor the new {new}"
    check_tier(tier)
    try:
        await asyncio.wait_for(tier.wait_resident(), HANG)
    except TimeoutError:
        raise AssertionError(f"{what}: wait_resident() hung ({tier!r})") from None
    s = check_tier(tier, settled=True)
    # The fill target was checked above: every slot of the quota is resident, so taking them must not wait.
    try:
        rest = await asyncio.wait_for(tier.allocate(s.slots_free), HANG)
    except TimeoutError:
        raise AssertionError(f"{what}: allocating the quota's last {s.slots_free} slots hung ({tier!r})") from None
    for slot in retained:
        assert tier.view(slot)[0] == 0xA5, f"{what}: retained slot {slot} lost its contents"
    await write_every_slot(tier, rest, 0x5A)
    tier.free_many(rest)


@pytest.mark.parametrize("direction", ["grow", "shrink"])
async def test_cancelled_resize_runs_to_the_end(direction: str) -> None:
    old, new = GROW if direction == "grow" else SHRINK
    for how, delay in sweep(4 if direction == "grow" else 5, taskgroup=5, cancels=6):
        what = f"{direction} cancelled by {how} after {delay} s"
        tier = await asyncio.wait_for(HostTier.open(small_config(quota=old, max_quota=128 * MiB)), HANG)
        await asyncio.wait_for(tier.wait_resident(), HANG)
        retained = await tier.allocate(16)
        await write_every_slot(tier, retained, 0xA5)
        await cancel_during(lambda: tier.resize(new), how, delay)  # noqa: B023
        # Checked before closing: if this fails, a decommit may still be running, and closing
        # would unmap the range under it; the broken tier is left open instead.
        await _check_after_resize(tier, old, new, what, retained)
        await asyncio.wait_for(tier.aclose(), HANG)


class SlowDecommit(HostBacking):
    def decommit(self, offset: int, length: int) -> None:
        time.sleep(0.0005)  # a unit's worth of dirty pages on a busy machine
        super().decommit(offset, length)


async def test_cancelled_shrink_waits_for_its_decommit() -> None:
    old, new = SHRINK
    for how, delay in [("wait_for", 0.005), ("wait_for", 0.01), ("taskgroup", 0.01), ("cancel", 0.02)]:
        config = small_config(quota=old, max_quota=128 * MiB)
        tier = await asyncio.wait_for(HostTier.open(config, backings=HostBackings(SlowDecommit)), HANG)
        await asyncio.wait_for(tier.wait_resident(), HANG)
        retained = await tier.allocate(16)
        await write_every_slot(tier, retained, 0xA5)
        outcome = await cancel_during(lambda: tier.resize(new), how, delay)  # noqa: B023
        assert outcome.cancelled, "the slowed decommit of 88 units should outlast the cancellation"
        s = tier.statistics()
        assert s.quota == new, f"a shrink cancelled mid-decommit reports quota {s.quota}"
        # Straight away, without waiting: the decommit is over when control comes back.
        check_tier(tier, settled=True)
        await _check_after_resize(tier, old, new, f"shrink cancelled by {how} after {delay} s", retained)
        await asyncio.wait_for(tier.aclose(), HANG)


async def test_cancelled_grow_keeps_new_slots_reachable() -> None:
    """A grow cancelled before its worker thread ran must not leave quota = new with the fill target old."""
    old, new = GROW
    for hold_workers in (True, False):
        tier = await asyncio.wait_for(HostTier.open(small_config(quota=old, max_quota=128 * MiB)), HANG)
        await asyncio.wait_for(tier.wait_resident(), HANG)
        limiter = anyio.to_thread.current_default_thread_limiter()
        borrowers = [object() for _ in range(int(limiter.total_tokens))] if hold_workers else []
        for borrower in borrowers:  # every worker thread busy elsewhere: the grow waits for one
            await limiter.acquire_on_behalf_of(borrower)
        try:
            task = asyncio.create_task(tier.resize(new))
            await asyncio.sleep(0.01 if hold_workers else 0)
            task.cancel()
            await asyncio.wait({task}, timeout=HANG)
        finally:
            for borrower in borrowers:
                limiter.release_on_behalf_of(borrower)
        assert task.done(), "the cancelled grow did not return"
        s = tier.statistics()
        assert s.quota in (old, new)
        try:
            await asyncio.wait_for(tier.allocate(s.slots_free), 3)
        except TimeoutError:
            s = tier.statistics()
            raise AssertionError(
                f"allocate() of the last slots hung: quota {s.quota}, fill target {s.target_bytes}, "
                f"resident {s.resident_bytes}"
            ) from None
        check_tier(tier, settled=True)
        await asyncio.wait_for(tier.aclose(), HANG)


async def test_resize_cancelled_while_queued_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _linux.populate
    for how, delay in sweep(6, delays=(0, 0.0005, 0.001, 0.005, 0.01), taskgroup=3, cancels=3):
        gate = PopulateGate(real)
        monkeypatch.setattr(_linux, "populate", gate)
        tier = await asyncio.wait_for(HostTier.open(small_config(quota=16 * MiB)), HANG)
        try:
            gate.allow(4)
            await asyncio.wait_for(tier.wait_resident(4 * MiB), HANG)
            for _ in range(500):  # until the fill thread is inside the held populate of unit 4
                if gate.calls > 4:
                    break
                await asyncio.sleep(0.01)
            # Unit 4 is being populated (held): a shrink to 2 MiB waits for it, holding the resize lock.
            first = asyncio.create_task(tier.resize(2 * MiB))
            await asyncio.sleep(0.01)
            assert not first.done()
            for second in (32 * MiB, MiB):
                outcome = await cancel_during(lambda: tier.resize(second), how, delay)  # noqa: B023
                assert outcome.cancelled, "a resize queued behind another finished first"
                assert not first.done()
        finally:
            gate.release_all()
        await asyncio.wait_for(first, HANG)
        s = tier.statistics()
        assert s.quota == 2 * MiB, f"a resize cancelled while queued changed the quota to {s.quota}"
        await asyncio.wait_for(tier.wait_resident(), HANG)
        check_tier(tier, settled=True)
        await asyncio.wait_for(tier.aclose(), HANG)


# -- allocate and wait_resident --------------------------------------------------------------


@pytest.mark.parametrize("call", ["allocate", "wait_resident"])
async def test_cancelled_wait_for_the_fill_takes_nothing(call: str, gate: PopulateGate) -> None:
    tier = await asyncio.wait_for(HostTier.open(small_config()), HANG)
    try:
        gate.allow(1)
        await asyncio.wait_for(tier.wait_resident(MiB), HANG)
        first = await tier.allocate(16)  # unit 0, whole
        before = tier.statistics()
        for how, delay in sweep(7, taskgroup=4, cancels=4):

            def make() -> Awaitable[Any]:
                return tier.allocate(3) if call == "allocate" else tier.wait_resident(2 * MiB)

            outcome = await cancel_during(make, how, delay)
            assert outcome.cancelled, f"{call} returned while the fill was held"
            s = tier.statistics()
            assert s.slots_allocated == before.slots_allocated == 16, f"{call} cancelled by {how} took slots"
            assert (s.quota, s.target_bytes, s.slots_total) == (before.quota, before.target_bytes, before.slots_total)
        gate.release_all()
        assert await asyncio.wait_for(tier.allocate(), HANG) == 16  # no id was skipped
        await asyncio.wait_for(tier.wait_resident(), HANG)
        check_tier(tier, settled=True)
        tier.free_many(first)
    finally:
        gate.release_all()
        await asyncio.wait_for(tier.aclose(), HANG)


# -- copies ----------------------------------------------------------------------------------

ROWS = 128  # one-MiB slots: a 128 MiB copy takes tens of milliseconds with memmove


@pytest.fixture(scope="module")
def patterns() -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Two page sets that differ in every byte: row i of x is 1 + i % 127, of y 128 + i % 127."""
    rows = (np.arange(ROWS) % 127).astype(np.uint8)[:, None]
    x = np.empty((ROWS, MiB), dtype=np.uint8)
    y = np.empty((ROWS, MiB), dtype=np.uint8)
    x[:] = rows + 1
    y[:] = rows + 128
    yield x, y


def copy_config() -> Any:
    return small_config(quota=ROWS * MiB, max_quota=ROWS * MiB, slot_size=MiB)


@pytest.mark.parametrize("kind", ["to_host", "to_device", "copy"])
async def test_cancelled_copy_has_landed_when_control_returns(
    kind: str, patterns: tuple[np.ndarray, np.ndarray]
) -> None:
    x, y = patterns
    async with (
        HostTier(copy_config()) as a,
        HostTier(copy_config()) as b,
        HostTier(copy_config()) as c,
        CopyEngine(None) as engine,
    ):
        for tier in (a, b, c):
            await asyncio.wait_for(tier.wait_resident(), HANG)
        sa, sb, sc = (await a.allocate(ROWS), await b.allocate(ROWS), await c.allocate(ROWS))
        await asyncio.wait_for(engine.to_host(a, sa, x), HANG)
        await asyncio.wait_for(engine.to_host(b, sb, y), HANG)
        host_dst = np.zeros((ROWS, MiB), dtype=np.uint8)

        def rows(tier: HostTier, slots: list[int]) -> list[int]:
            return [tier.address(s) for s in slots]

        if kind == "to_host":
            dst = raw_bytes(c.address(sc[0]), ROWS, MiB)
            first = lambda: engine.to_host(c, sc, x)  # noqa: E731
            second = lambda: engine.to_host(c, sc, y)  # noqa: E731
        elif kind == "to_device":
            dst = host_dst
            first = lambda: engine.to_device(a, sa, host_dst)  # noqa: E731
            second = lambda: engine.to_device(b, sb, host_dst)  # noqa: E731
        else:
            dst = raw_bytes(c.address(sc[0]), ROWS, MiB)
            first = lambda: engine.copy(zip(rows(c, sc), rows(a, sa), [MiB] * ROWS, strict=True))  # noqa: E731
            second = lambda: engine.copy(zip(rows(c, sc), rows(b, sb), [MiB] * ROWS, strict=True))  # noqa: E731
        want_x, want_y = sampled(x), sampled(y)
        await asyncio.wait_for(second(), HANG)  # the destination starts out holding y
        for how, delay in sweep(8, taskgroup=4, cancels=4):
            before = engine.statistics().jobs_submitted
            outcome = await cancel_during(first, how, delay)
            got = sampled(dst)
            landed, untouched = int((got == want_x).sum()), int((got == want_y).sum())
            if untouched == got.size:  # never submitted (cancelled before its first step)
                assert engine.statistics().jobs_submitted == before, f"{kind}: a submitted copy never landed"
            else:
                assert landed == got.size, (
                    f"{kind} cancelled by {how} after {delay} s (started: {outcome.started}): control came back "
                    f"with {landed} of {got.size} sampled bytes of the destination written"
                )
            await asyncio.wait_for(second(), HANG)
            await asyncio.sleep(0.005)
            assert np.array_equal(sampled(dst), want_y), f"{kind}: the first copy landed over the second"
        assert np.array_equal(dst, y)


async def test_close_waits_for_a_copy_in_flight(patterns: tuple[np.ndarray, np.ndarray]) -> None:
    x, _ = patterns
    async with CopyEngine(None) as engine:
        for delay in (0, 0.001, 0.005):
            tier = await asyncio.wait_for(HostTier.open(copy_config()), HANG)
            base = tier.statistics().base_address
            await asyncio.wait_for(tier.wait_resident(), HANG)
            slots = await tier.allocate(ROWS)
            await asyncio.wait_for(engine.to_host(tier, slots, x), HANG)
            out = np.zeros((ROWS, MiB), dtype=np.uint8)
            task = asyncio.create_task(engine.to_device(tier, slots, out))
            await asyncio.sleep(delay)
            await asyncio.wait_for(tier.aclose(), HANG)
            # The copy read the tier before it was unmapped: it is complete now.
            assert np.array_equal(sampled(out), sampled(x)), "aclose() returned before the copy out of the tier"
            assert not leaked([base], ROWS * MiB)
            await asyncio.wait_for(task, HANG)


@pytest.mark.parametrize("delay", [0, 0.0005, 0.001, 0.002, 0.005])
async def test_aclose_racing_a_shrink_releases_everything(delay: float) -> None:
    tier = await asyncio.wait_for(HostTier.open(small_config(quota=256 * MiB, max_quota=256 * MiB)), HANG)
    base = tier.statistics().base_address
    await asyncio.wait_for(tier.wait_resident(), HANG)
    shrink = asyncio.create_task(tier.resize(MiB))
    await asyncio.sleep(delay)
    await asyncio.wait_for(tier.aclose(), HANG)  # must not raise
    done, _ = await asyncio.wait({shrink}, timeout=HANG)
    assert done, "the shrink hung after the close"
    error = shrink.exception()
    assert error is None or isinstance(error, TierClosedError), f"the shrink raced by aclose() raised {error!r}"
    assert tier.closed and tier.released
    assert not leaked([base], 256 * MiB)
    await wait_no_library_threads()


# -- crashes, in a subprocess ------------------------------------------------------------------


def run_script(script: str, loop: str, timeout: float = 240) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    prelude = (
        "import asyncio, sys\n"
        "def run(main):\n"
        "    if sys.argv[1] == 'uvloop':\n"
        "        import uvloop\n"
        "        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r: r.run(main())\n"
        "    else:\n"
        "        asyncio.run(main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", prelude + script, loop], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert done.returncode != -11, f"the process died of SIGSEGV\n{done.stdout}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    return done.stdout


SHRINK_THEN_GROW = """
from aiokvtier import HostTier, HostTierConfig
MiB, GiB = 1 << 20, 1 << 30

async def main():
    cfg = HostTierConfig(quota=GiB, max_quota=2 * GiB, slot_size=MiB, commit_unit=MiB, fill_chunk=64 * MiB)
    async with HostTier(cfg) as tier:
        await asyncio.wait_for(tier.wait_resident(), 120)
        for round in range(3):
            try:
                await asyncio.wait_for(tier.resize(64 * MiB), 0.01)
            except TimeoutError:
                pass
            await asyncio.wait_for(tier.resize(GiB), 120)
            await asyncio.wait_for(tier.wait_resident(), 120)
            slots = await asyncio.wait_for(tier.allocate(tier.statistics().slots_free), 120)
            block = bytes([round + 1]) * MiB
            for slot in slots:
                tier.view(slot)[:] = block
            tier.free_many(slots)
            print("round", round, "ok", flush=True)

run(main)
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_shrink_cancelled_mid_decommit_then_grow_does_not_crash(loop: str) -> None:
    out = run_script(SHRINK_THEN_GROW, loop)
    assert out.count(" ok") == 3


COPY_THEN_SHRINK = """
import ctypes
import numpy as np
from aiokvtier import CopyEngine, HostTier, HostTierConfig, StaticHostMem
MiB, GiB = 1 << 20, 1 << 30

async def main():
    cfg = HostTierConfig(quota=GiB, max_quota=GiB, slot_size=MiB, commit_unit=MiB, fill_chunk=64 * MiB)
    # A host-only engine copies only between known regions: the source is a staging buffer.
    async with HostTier(cfg) as tier, CopyEngine(None) as engine, StaticHostMem(512 * MiB) as src:
        src.view()[:] = b"\x07" * (512 * MiB)
        for round, delay in enumerate((0, 0.001, 0.005)):
            await asyncio.wait_for(tier.wait_resident(), 120)
            base = tier.base_address
            # Committed, never allocated: a raw copy may write there.
            copies = [(base + 512 * MiB + i * MiB, src.address + i * MiB, MiB) for i in range(512)]
            task = asyncio.create_task(engine.copy(copies))
            await asyncio.sleep(delay)
            await asyncio.wait_for(tier.resize(64 * MiB), 120)
            await asyncio.wait_for(task, 120)
            await asyncio.wait_for(tier.resize(GiB), 120)
            print("round", round, "ok", flush=True)

run(main)
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_shrink_waits_for_a_raw_copy_into_the_tail(loop: str) -> None:
    out = run_script(COPY_THEN_SHRINK, loop)
    assert out.count(" ok") == 3
