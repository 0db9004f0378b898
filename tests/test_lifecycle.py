"""The one lifecycle: ``finish``, ``Lifecycle`` with fake steps, and the real owners' opens and closes.

The fake owner's build and teardown run their blocking steps on the
lifecycle's worker (``Lifecycle.run``) and wait on events the test sets, so
a close or a cancellation can be made to land at a chosen point. Every await
is bounded, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from aiokvtier import CopyEngine, HostTier, StaticHostMem, TierClosedError
from aiokvtier._host import _linux
from aiokvtier._lifecycle import Lifecycle, finish

from .conftest import mappings_in, uvloop
from .helpers import MiB, small_config

HANG = 10.0
"""Seconds after which an await counts as hung."""
DELAYS = (0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02)
WORKER = "test-lifecycle-worker"


def threads_named(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


def new_threads(prefix: str, before: set[threading.Thread]) -> list[str]:
    """Threads named ``prefix...`` that were not running at ``before`` (``threads_of(prefix)``): a
    StaticHostMem an earlier test closed with a view still alive keeps its thread until the garbage
    collector drops that view, as documented."""
    return [t.name for t in threads_of(prefix) - before]


def threads_of(prefix: str) -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(prefix)}


async def settle(rounds: int = 20) -> None:
    """Let the loop run a while, for whatever could (wrongly) finish early."""
    for _ in range(rounds):
        await asyncio.sleep(0.001)


class Work:
    """A piece of work that runs until let go, then returns or fails."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.started = asyncio.Event()
        self.go = asyncio.Event()
        self.done = False
        self.error = error

    async def __call__(self) -> str:
        self.started.set()
        await self.go.wait()
        self.done = True
        if self.error is not None:
            raise self.error
        return "result"


async def caller(work: Work, seen: list[BaseException]) -> str:
    """Await ``finish(work())``, recording the exception it raises (the one the task ends with)."""
    try:
        return await finish(work())
    except BaseException as exc:
        seen.append(exc)
        raise


# -- finish -----------------------------------------------------------------------------------


async def test_finish_passes_the_result_and_the_error_through() -> None:
    work = Work()
    work.go.set()
    assert await asyncio.wait_for(finish(work()), HANG) == "result"
    error = ValueError("boom")
    failing = Work(error)
    failing.go.set()
    with pytest.raises(ValueError) as info:
        await asyncio.wait_for(finish(failing()), HANG)
    assert info.value is error


async def test_a_cancelled_caller_waits_for_the_work() -> None:
    work, seen = Work(), []
    task = asyncio.create_task(caller(work, seen))
    await asyncio.wait_for(work.started.wait(), HANG)
    task.cancel()
    await settle()
    assert not task.done(), "the cancellation was delivered before the work completed"
    work.go.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, HANG)
    assert task.cancelled()
    assert work.done
    assert len(seen) == 1 and isinstance(seen[0], asyncio.CancelledError)
    assert seen[0].__cause__ is None


async def test_a_cancellation_carries_the_work_error_as_its_cause() -> None:
    error = ValueError("the work failed meanwhile")
    work, seen = Work(error), []
    task = asyncio.create_task(caller(work, seen))
    await asyncio.wait_for(work.started.wait(), HANG)
    task.cancel()
    await settle()
    assert not task.done()
    work.go.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, HANG)
    assert work.done
    (cancelled,) = seen
    assert isinstance(cancelled, asyncio.CancelledError)
    assert cancelled.__cause__ is error


async def test_repeated_cancels_are_absorbed_until_the_work_is_done() -> None:
    work, seen = Work(), []
    task = asyncio.create_task(caller(work, seen))
    await asyncio.wait_for(work.started.wait(), HANG)
    for _ in range(5):
        task.cancel()
        await asyncio.sleep(0)
    await settle()
    assert not task.done()
    work.go.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, HANG)
    assert work.done
    assert len(seen) == 1


async def test_finish_under_a_timeout_raises_after_the_work() -> None:
    work = Work()
    asyncio.get_running_loop().call_later(0.03, work.go.set)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.005):
            await finish(work())
    assert work.done

    work = Work()
    asyncio.get_running_loop().call_later(0.03, work.go.set)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(finish(work()), 0.005)
    assert work.done


async def test_finish_in_a_task_group_whose_sibling_fails() -> None:
    work = Work()
    done_when_raised: list[bool] = []

    async def sibling() -> None:
        await work.started.wait()
        asyncio.get_running_loop().call_later(0.02, work.go.set)
        raise KeyError("sibling")

    try:
        async with asyncio.timeout(HANG), asyncio.TaskGroup() as tg:
            tg.create_task(finish(work()))
            tg.create_task(sibling())
    except* KeyError:
        done_when_raised.append(work.done)
    assert done_when_raised == [True]


async def test_finish_of_work_cancelled_itself_raises_cancelled_error() -> None:
    work = Work()
    inner = asyncio.ensure_future(work())
    await asyncio.wait_for(work.started.wait(), HANG)
    outer = asyncio.create_task(finish(inner))
    await asyncio.sleep(0)
    inner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(outer, HANG)
    assert not work.done


# -- Lifecycle with fake steps ------------------------------------------------------------------


class FakeOwner:
    """An owner whose build pushes undo callbacks from its worker and can pause or fail."""

    def __init__(self, *, fail: BaseException | None = None) -> None:
        self.life = Lifecycle("FakeOwner", WORKER)
        self.fail = fail
        self.log: list[tuple[str, str]] = []
        """``(event, thread name)`` in order."""
        self.building = asyncio.Event()
        self.build_go = asyncio.Event()
        self.build_go.set()
        self.tearing_down = asyncio.Event()
        self.teardown_go = asyncio.Event()
        self.teardown_go.set()
        self.teardowns = 0

    def record(self, event: str) -> None:
        self.log.append((event, threading.current_thread().name))

    def acquire(self, name: str) -> None:
        """A blocking step of the build: take ``name`` and push its release."""
        self.record(f"acquire {name}")
        self.life.undo.callback(self.record, f"release {name}")

    async def build(self) -> None:
        for name in ("a", "b", "c"):
            await self.life.run(self.acquire, name)
        self.building.set()
        await self.build_go.wait()
        if self.fail is not None:
            raise self.fail

    async def teardown(self) -> None:
        self.teardowns += 1
        self.tearing_down.set()
        await self.teardown_go.wait()
        await self.life.run_undo()

    async def open(self) -> None:
        await self.life.open(self.build, self.teardown)

    async def close(self) -> None:
        await self.life.close(self.teardown)

    def released(self) -> list[tuple[str, str]]:
        return [entry for entry in self.log if entry[0].startswith("release")]


@pytest.fixture
def owners() -> Iterator[list[FakeOwner]]:
    made: list[FakeOwner] = []
    yield made
    for owner in made:
        owner.build_go.set()
        owner.teardown_go.set()


@pytest.fixture
def make_owner(owners: list[FakeOwner]) -> Callable[..., FakeOwner]:
    def make(**kwargs: BaseException | None) -> FakeOwner:
        owner = FakeOwner(**kwargs)
        owners.append(owner)
        return owner

    return make


async def test_open_then_close(make_owner: Callable[..., FakeOwner]) -> None:
    owner = make_owner()
    assert owner.life.state == "new"
    await asyncio.wait_for(owner.open(), HANG)
    assert owner.life.state == "open"
    owner.life.check_open()
    assert threads_named(WORKER) == [WORKER]
    assert [e for e, _ in owner.log] == ["acquire a", "acquire b", "acquire c"]
    assert {t for _, t in owner.log} == {WORKER}
    await asyncio.wait_for(owner.close(), HANG)
    assert owner.life.state == "closed" and owner.life.closed
    assert owner.released() == [("release c", WORKER), ("release b", WORKER), ("release a", WORKER)]
    assert threads_named(WORKER) == [], "the worker thread outlived close()"
    with pytest.raises(TierClosedError, match="closed"):
        owner.life.check_open()
    await asyncio.wait_for(owner.close(), HANG)
    assert owner.teardowns == 1


async def test_open_twice_raises_runtime_error(make_owner: Callable[..., FakeOwner]) -> None:
    owner = make_owner()
    await asyncio.wait_for(owner.open(), HANG)
    with pytest.raises(RuntimeError, match="opens once"):
        await asyncio.wait_for(owner.open(), HANG)
    assert owner.life.state == "open"
    await asyncio.wait_for(owner.close(), HANG)
    with pytest.raises(RuntimeError, match="opens once"):
        await asyncio.wait_for(owner.open(), HANG)


async def test_a_failed_build_unwinds_on_the_worker_and_reraises(make_owner: Callable[..., FakeOwner]) -> None:
    error = OSError(errno.ENOMEM, "no memory")
    owner = make_owner(fail=error)
    with pytest.raises(OSError) as info:
        await asyncio.wait_for(owner.open(), HANG)
    assert info.value is error
    assert owner.teardowns == 1
    assert owner.released() == [("release c", WORKER), ("release b", WORKER), ("release a", WORKER)]
    assert owner.life.state == "closed"
    assert threads_named(WORKER) == []
    await asyncio.wait_for(owner.close(), HANG)
    assert owner.teardowns == 1


async def test_a_close_during_open_fails_the_opener(make_owner: Callable[..., FakeOwner]) -> None:
    owner = make_owner()
    owner.build_go.clear()
    opener = asyncio.create_task(owner.open())
    await asyncio.wait_for(owner.building.wait(), HANG)
    assert owner.life.state == "opening"
    closer = asyncio.create_task(owner.close())
    await settle()
    assert not closer.done(), "close returned while the open was still building"
    owner.build_go.set()
    with pytest.raises(TierClosedError, match="closed while it was opening"):
        await asyncio.wait_for(opener, HANG)
    await asyncio.wait_for(closer, HANG)
    assert owner.teardowns == 1
    assert len(owner.released()) == 3
    assert owner.life.state == "closed"
    assert threads_named(WORKER) == []


async def test_concurrent_closes_share_one_teardown(make_owner: Callable[..., FakeOwner]) -> None:
    owner = make_owner()
    await asyncio.wait_for(owner.open(), HANG)
    owner.teardown_go.clear()
    closers = [asyncio.create_task(owner.close()) for _ in range(4)]
    await asyncio.wait_for(owner.tearing_down.wait(), HANG)
    await settle()
    assert not any(c.done() for c in closers), "a close returned before the teardown was complete"
    assert owner.life.state == "closing"
    owner.teardown_go.set()
    await asyncio.wait_for(asyncio.gather(*closers), HANG)
    assert owner.teardowns == 1
    assert len(owner.released()) == 3
    assert threads_named(WORKER) == []


async def test_a_cancelled_close_still_completes(make_owner: Callable[..., FakeOwner]) -> None:
    owner = make_owner()
    await asyncio.wait_for(owner.open(), HANG)
    owner.teardown_go.clear()
    closer = asyncio.create_task(owner.close())
    await asyncio.wait_for(owner.tearing_down.wait(), HANG)
    closer.cancel()
    await settle()
    assert not closer.done()
    owner.teardown_go.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(closer, HANG)
    assert owner.life.state == "closed"
    assert len(owner.released()) == 3
    assert threads_named(WORKER) == []


async def test_a_cancelled_close_waiting_for_another_returns_after_the_teardown(
    make_owner: Callable[..., FakeOwner],
) -> None:
    owner = make_owner()
    await asyncio.wait_for(owner.open(), HANG)
    owner.teardown_go.clear()
    first = asyncio.create_task(owner.close())
    await asyncio.wait_for(owner.tearing_down.wait(), HANG)
    second = asyncio.create_task(owner.close())
    await settle()
    second.cancel()
    await settle()
    returned_early = second.done()
    owner.teardown_go.set()
    await asyncio.wait_for(first, HANG)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(second, HANG)
    assert not returned_early, "the cancelled close returned while the teardown was still running"


async def test_a_cancelled_open_unwinds_before_it_returns(make_owner: Callable[..., FakeOwner]) -> None:
    owner = make_owner()
    owner.build_go.clear()
    opener = asyncio.create_task(owner.open())
    await asyncio.wait_for(owner.building.wait(), HANG)
    opener.cancel()
    await settle()
    assert not opener.done()
    owner.build_go.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(opener, HANG)
    assert owner.life.state == "closed"
    assert owner.teardowns == 1
    assert len(owner.released()) == 3
    assert threads_named(WORKER) == []


async def test_close_of_a_never_opened_owner(make_owner: Callable[..., FakeOwner]) -> None:
    owner = make_owner()
    await asyncio.wait_for(owner.close(), HANG)
    assert owner.life.state == "closed"
    assert owner.teardowns == 0
    assert threads_named(WORKER) == []


async def test_open_fails_when_the_worker_cannot_start(
    make_owner: Callable[..., FakeOwner], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name == WORKER:
            raise RuntimeError("can't start new thread")
        real(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    owner = make_owner()
    with pytest.raises(RuntimeError, match="can't start new thread"):
        await asyncio.wait_for(owner.open(), HANG)
    assert owner.life.state == "closed"
    assert owner.log == [] and owner.teardowns == 0
    await asyncio.wait_for(owner.close(), HANG)
    assert owner.life.state == "closed"


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_forked_child_sees_the_owner_as_forked(loop: str) -> None:
    if loop == "uvloop" and uvloop is None:
        pytest.skip("uvloop is not installed")
    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        owner = runner.run(_opened_owner())
        try:
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: never returns into pytest
                code = 2
                try:
                    os.close(read_end)
                    signal.alarm(20)
                    report = _child_report(owner.life)
                    os.write(write_end, report.encode())
                    code = 0 if report == "ok" else 1
                finally:
                    os._exit(code)
            os.close(write_end)
            status = _wait_child(pid, 30)
            with os.fdopen(read_end) as f:
                report = f.read()
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"in the forked child: {report}"
            # The parent's owner is untouched.
            assert owner.life.state == "open"
        finally:
            runner.run(asyncio.wait_for(owner.close(), HANG))
    assert threads_named(WORKER) == []


async def _opened_owner() -> FakeOwner:
    owner = FakeOwner()
    await asyncio.wait_for(owner.open(), HANG)
    return owner


def _child_report(life: Lifecycle) -> str:
    if life.state != "forked" or not life.closed:
        return f"state {life.state!r}, closed {life.closed}"
    try:
        life.check_open()
    except TierClosedError as exc:
        if "fork" not in str(exc):
            return f"TierClosedError not naming fork: {exc}"
        return "ok"
    except BaseException as exc:
        return f"check_open raised {exc!r}"
    return "check_open did not raise"


def _wait_child(pid: int, within: float) -> int:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"the forked child hung for {within} s")


# -- the real owners ----------------------------------------------------------------------------


class Spy:
    """Records ``(address, length)`` of every call to a ``_linux`` function, then calls it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.calls: list[tuple[int, int]] = []
        real = getattr(_linux, name)

        def spy(address: int, length: int) -> None:
            self.calls.append((address, length))
            real(address, length)

        monkeypatch.setattr(_linux, name, spy)


@pytest.fixture
def reservations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """``(base, size)`` of every reservation made during the test."""
    made: list[tuple[int, int]] = []
    real = _linux.mmap_reserve

    def spy(length: int, align: int) -> tuple[int, int]:
        base, size = real(length, align)
        made.append((base, size))
        return base, size

    monkeypatch.setattr(_linux, "mmap_reserve", spy)
    return made


async def test_a_static_buffer_whose_allocation_fails_unmaps_once(
    monkeypatch: pytest.MonkeyPatch, reservations: list[tuple[int, int]]
) -> None:
    def populate(address: int, length: int) -> None:
        raise OSError(errno.ENOMEM, "injected: no memory")

    monkeypatch.setattr(_linux, "populate", populate)
    munmap = Spy(monkeypatch, "munmap")
    before = threads_of("aiokvtier-staging")
    buf = StaticHostMem(4 * MiB)
    with pytest.raises(OSError) as info:
        await asyncio.wait_for(buf.__aenter__(), HANG)
    assert info.value.errno == errno.ENOMEM
    await asyncio.wait_for(buf.aclose(), HANG)
    assert buf.closed
    assert all(address != 0 for address, _ in munmap.calls), f"munmap of address 0: {munmap.calls}"
    (mapping,) = reservations
    base, size = mapping
    # mmap_reserve itself unmaps the alignment slack around the reservation: leave that out.
    inside = [(a, n) for a, n in munmap.calls if a < base + size and a + n > base]
    assert inside == [mapping], f"the mapping made was not unmapped exactly once: {inside}"
    assert not mappings_in(*mapping)
    assert new_threads("aiokvtier-staging", before) == []


async def test_a_copy_engine_closed_while_opening() -> None:
    engine = CopyEngine(None)
    opener = asyncio.create_task(engine.__aenter__())
    await asyncio.sleep(0)  # the open has started: its worker runs the build
    closer = asyncio.create_task(engine.aclose())
    with pytest.raises(TierClosedError):
        await asyncio.wait_for(opener, HANG)
    await asyncio.wait_for(closer, HANG)
    assert engine.closed
    assert threads_named("aiokvtier-copy") == []


@pytest.mark.parametrize("delay", DELAYS)
async def test_a_copy_engine_open_cancelled_leaves_no_thread(delay: float) -> None:
    engine = CopyEngine(None)
    try:
        await asyncio.wait_for(engine.__aenter__(), delay)
    except TimeoutError:
        pass
    await asyncio.wait_for(engine.aclose(), HANG)
    assert threads_named("aiokvtier-copy") == []


@pytest.mark.parametrize("delay", DELAYS)
async def test_a_static_buffer_open_cancelled_leaves_no_mapping(
    delay: float, reservations: list[tuple[int, int]]
) -> None:
    before = threads_of("aiokvtier-staging")
    buf = StaticHostMem(32 * MiB)
    try:
        await asyncio.wait_for(buf.__aenter__(), delay)
    except TimeoutError:
        pass
    await asyncio.wait_for(buf.aclose(), HANG)
    assert len(reservations) <= 1
    for base, size in reservations:
        assert not mappings_in(base, size), f"the buffer at {base:#x} is still mapped"
    assert new_threads("aiokvtier-staging", before) == []


# -- logging ------------------------------------------------------------------------------------


UNIT_LOG = re.compile(r"unit (\d+) committed")


async def _normal_run() -> HostTier:
    async with HostTier(small_config(quota=16 * MiB)) as tier:
        await asyncio.wait_for(tier.wait_resident(), HANG)
        await asyncio.wait_for(tier.resize(32 * MiB), HANG)
        await asyncio.wait_for(tier.wait_resident(), HANG)
        await asyncio.wait_for(tier.resize(8 * MiB), HANG)
    return tier


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "aiokvtier" and r.levelno == level]


async def test_a_normal_run_logs_open_fill_resize_and_close_at_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="aiokvtier")
    await _normal_run()
    info = _messages(caplog, logging.INFO)
    opens = [m for m in info if "open" in m]
    assert len(opens) == 1 and "backing host" in opens[0], info
    # At least the first fill's; a grow that lands before the fill thread has counted itself
    # out is not logged (see test_fill.test_a_grow_that_lands_as_the_fill_ends_is_logged_when_done).
    fills = [m for m in info if "fill done" in m]
    assert 1 <= len(fills) <= 2 and all("GiB/s" in m for m in fills), info
    resizes = [m for m in info if "resized" in m]
    assert len(resizes) == 2, info
    assert f"{16 * MiB} -> {32 * MiB}" in resizes[0] and f"{32 * MiB} -> {8 * MiB}" in resizes[1]
    closes = [m for m in info if "closed" in m]
    assert len(closes) == 1, info
    # The fill runs while open() returns and logs "fill done" after it wakes the waiters, so that
    # record may come before "open" or after a resize; the close comes last.
    assert info[-1] == closes[0], info
    assert not [r for r in caplog.records if r.levelno < logging.INFO]
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud, f"a normal run logged warnings: {loud}"


async def test_debug_logs_a_record_per_committed_unit(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="aiokvtier")
    await _normal_run()
    units = [int(m[1]) for m in map(UNIT_LOG.search, _messages(caplog, logging.DEBUG)) if m]
    # 16 one-MiB units, then 16 more for the grow to 32 MiB; the shrink commits nothing.
    assert sorted(units) == list(range(32))
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud, f"a normal run logged warnings: {loud}"


class _Closing:
    """Records its close in ``order``; raises ``error`` from it if given."""

    def __init__(self, name: str, order: list[str], error: BaseException | None = None) -> None:
        self.name, self.order, self.error = name, order, error

    async def aclose(self) -> None:
        self.order.append(self.name)
        if self.error is not None:
            raise self.error


async def test_close_in_turn_closes_every_owner_first_to_last_whatever_an_earlier_close_raised() -> None:
    from typing import Any

    from aiokvtier._lifecycle import close_in_turn

    order: list[str] = []
    owners: list[Any] = [
        _Closing("store", order, OSError("store")),
        None,
        _Closing("tier", order),
        _Closing("pool", order, ValueError("pool")),
    ]
    with pytest.raises(ValueError, match="pool") as caught:
        await close_in_turn(*owners)
    assert order == ["store", "tier", "pool"]  # None skipped, every one closed, in the order given
    assert isinstance(caught.value.__context__, OSError)  # the earlier error rides along, as with finally
    order.clear()
    await close_in_turn(_Closing("a", order), _Closing("b", order))  # type: ignore[arg-type]
    assert order == ["a", "b"]


async def test_using_an_object_not_open_or_closed_says_what_to_do() -> None:
    """A tier or store built but never entered said only "the HostTier is new"; a closed one "is closed"."""
    from aiokvtier import AttachedPool, BlockStore

    tier = HostTier(small_config())
    opened = r"open it first \(async with HostTier\(\.\.\.\), or await HostTier\.open\(\.\.\.\)\)"
    for call in (tier.allocate_nowait, lambda: tier.view(0), tier.statistics):
        with pytest.raises(TierClosedError, match=r"^the HostTier is new: " + opened):
            call()
    with pytest.raises(TierClosedError, match=opened):
        await tier.allocate()
    with pytest.raises(TierClosedError, match=r"await AttachedPool\.attach\(\.\.\.\)"):
        AttachedPool("/nonexistent.sock").check_open()
    async with tier:
        store = BlockStore(tier)
        with pytest.raises(TierClosedError, match=r"the BlockStore is new: open it first .*BlockStore\.open"):
            store.lookup([b"k"])
    closed = r"the HostTier is closed: a closed HostTier cannot be used again; open a new one"
    with pytest.raises(TierClosedError, match=closed):
        await tier.allocate()
    with pytest.raises(TierClosedError, match=closed):
        await BlockStore.open(tier)
