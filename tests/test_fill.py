"""The Filler tested directly: plain threads, no event loop, a fake backing.

The fake backing touches no memory. It records every call with the calling
thread's name, can hold the commit of any unit until the test lets it go,
and can fail the commit of chosen units with ENOMEM, so the interleavings
that matter (units finishing out of order, a shrink racing a commit, a
failure below a held unit) are set up exactly rather than hoped for.
Every wait is bounded: a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from aiokvtier import FillError, TierClosedError
from aiokvtier._host._backing import Backing
from aiokvtier._host._fill import Filler
from aiokvtier._host._layout import UnitLayout

MiB = 1 << 20
UNIT = MiB
SLOT = 64 << 10
UNITS = 16
WAIT = 10.0
"""Seconds after which any wait in these tests counts as a hang."""
SETTLE = 0.1
"""Seconds a call is given to (wrongly) get past a point it must block at."""


class FakeBacking(Backing):
    """A backing that records calls, holds chosen units and fails others."""

    name = "fake"

    def __init__(self, size: int) -> None:
        self.base = 0
        self.size = size
        self._lock = threading.Lock()
        self.commits: list[tuple[str, int, int]] = []
        """``(thread name, offset, length)`` of every commit call, in the order they started."""
        self.committed: list[int] = []
        """Offsets whose commit returned, in that order."""
        self.decommits: list[tuple[str, int, int]] = []
        self.recommits: list[int] = []
        """Offsets of every recommit call (a stranded unit made usable again)."""
        self.releases: list[list[tuple[int, int]]] = []
        self.failing: set[int] = set()
        self._holds: dict[int, threading.Event] = {}
        self._entered: dict[int, threading.Event] = {}
        self._returned: dict[int, threading.Event] = {}

    def _event(self, table: dict[int, threading.Event], offset: int) -> threading.Event:
        with self._lock:
            return table.setdefault(offset, threading.Event())

    # -- controls (any thread) --------------------------------------------------

    def hold(self, *offsets: int) -> None:
        """Commits of these units wait (up to ``WAIT`` s) until :meth:`let_go`."""
        with self._lock:
            for offset in offsets:
                self._holds[offset] = threading.Event()

    def let_go(self, *offsets: int) -> None:
        with self._lock:
            for offset in offsets:
                self._holds.pop(offset).set()

    def let_all_go(self) -> None:
        with self._lock:
            holds, self._holds = self._holds, {}
        for event in holds.values():
            event.set()

    def wait_entered(self, offset: int) -> None:
        """Wait until a thread has called commit for ``offset``."""
        assert self._event(self._entered, offset).wait(WAIT), f"no commit of +{offset:#x} started"

    def wait_committed(self, offset: int) -> None:
        assert self._event(self._returned, offset).wait(WAIT), f"the commit of +{offset:#x} never returned"

    def threads_of(self, offsets: range) -> set[str]:
        with self._lock:
            return {name for name, offset, _ in self.commits if offset in offsets}

    # -- the interface ------------------------------------------------------------

    def commit(self, offset: int, length: int) -> None:
        with self._lock:
            self.commits.append((threading.current_thread().name, offset, length))
            hold = self._holds.get(offset)
        self._event(self._entered, offset).set()
        if hold is not None and not hold.wait(WAIT):
            raise AssertionError(f"the commit of +{offset:#x} was held for {WAIT} s")
        if offset in self.failing:
            raise OSError(errno.ENOMEM, f"injected failure at +{offset:#x}")
        with self._lock:
            self.committed.append(offset)
        self._event(self._returned, offset).set()

    def decommit(self, offset: int, length: int) -> None:
        with self._lock:
            self.decommits.append((threading.current_thread().name, offset, length))

    def recommit(self, offset: int, length: int) -> None:
        with self._lock:
            self.recommits.append(offset)
        if offset in self.failing:
            raise OSError(errno.ENOMEM, f"injected recommit failure at +{offset:#x}")

    def release(self, committed: list[tuple[int, int]]) -> None:
        with self._lock:
            self.releases.append(list(committed))


class Rig:
    """A filler over a fake backing of ``UNITS`` one-MiB units, and what its on_change saw."""

    def __init__(self, *, threads: int, fill_chunk: int = UNIT) -> None:
        self.backing = FakeBacking(UNITS * UNIT)
        self.layout = UnitLayout.build(self.backing.size, SLOT, UNIT)
        assert self.layout.count == UNITS and self.layout.start(1) == UNIT  # no ramp: every unit is 1 MiB
        self.changes: list[int] = []
        """The watermark each on_change call saw."""
        self.errors: list[bool] = []
        """Whether each on_change call saw a fill error."""
        self.changed_under_lock = 0
        self.pause: Callable[[], None] | None = None
        """Called from on_change, to hold the thread that published where it is."""
        self.filler = Filler(
            self.backing,
            self.layout,
            threads=threads,
            fill_chunk=fill_chunk,
            cpus=None,
            on_change=self._on_change,
        )

    def _on_change(self) -> None:
        # A probe takes the filler's lock: if this thread held it, the probe would still be waiting.
        # Another thread holds it for microseconds at most, so the probe returns then.
        probe = threading.Thread(target=self._take_the_lock, daemon=True)
        probe.start()
        probe.join(2)
        if probe.is_alive():
            self.changed_under_lock += 1
        self.changes.append(self.filler.watermark)
        self.errors.append(self.filler.error is not None)
        if self.pause is not None:
            self.pause()

    def _take_the_lock(self) -> None:
        try:
            self.filler.wait_blocking(0, None)  # under the lock, and done at once: 0 bytes are resident
        except TierClosedError:
            pass  # said under the lock too

    def committed_units(self) -> list[int]:
        return [offset // UNIT for offset, _ in self.filler.committed_ranges()]


@pytest.fixture
def rigs() -> Iterator[Callable[..., Rig]]:
    """Make rigs; each is let go and closed at the end, whatever the test did."""
    made: list[Rig] = []

    def make(**kwargs: Any) -> Rig:
        rig = Rig(**kwargs)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.backing.let_all_go()
        rig.filler.close()


class InThread:
    """Run a blocking call on a thread of the test's own and collect its outcome."""

    def __init__(self, fn: Callable[[], Any], name: str = "test-caller") -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _main(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:
            self.error = exc

    def blocked(self, within: float = SETTLE) -> bool:
        """Whether the call is still running ``within`` seconds from now."""
        self._thread.join(within)
        return self._thread.is_alive()

    def outcome(self) -> Any:
        self._thread.join(WAIT)
        assert not self._thread.is_alive(), f"the call had not returned after {WAIT} s"
        if self.error is not None:
            raise self.error
        return self.result


def fill_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("aiokvtier-fill")]


# -- the watermark ----------------------------------------------------------------------------


def test_watermark_covers_only_the_committed_prefix(rigs: Callable[..., Rig]) -> None:
    rig = rigs(threads=2)
    backing, filler = rig.backing, rig.filler
    backing.hold(1 * UNIT)
    assert filler.set_target(4) is None
    backing.wait_committed(2 * UNIT)
    backing.wait_committed(3 * UNIT)
    # Units 0, 2 and 3 are resident; 1 is not, so only unit 0 is a prefix.
    assert rig.committed_units() == [0, 2, 3]
    assert filler.watermark == 1 * UNIT
    assert not filler.complete
    assert not filler.ready(2 * UNIT)
    with pytest.raises(TimeoutError):
        filler.wait_blocking(2 * UNIT, timeout=SETTLE)
    backing.let_go(1 * UNIT)
    filler.wait_blocking(4 * UNIT, timeout=WAIT)
    assert filler.watermark == 4 * UNIT
    assert filler.complete
    assert rig.committed_units() == [0, 1, 2, 3]
    assert len(backing.threads_of(range(0, 4 * UNIT))) == 2


def test_watermark_never_runs_past_the_target(rigs: Callable[..., Rig]) -> None:
    rig = rigs(threads=3)
    rig.filler.set_target(5)
    rig.filler.wait_blocking(5 * UNIT, timeout=WAIT)
    rig.filler.close()
    assert rig.filler.watermark == rig.filler.target_bytes == 5 * UNIT
    assert sorted(offset for _, offset, _ in rig.backing.commits) == [i * UNIT for i in range(5)]
    assert all(length == UNIT for _, _, length in rig.backing.commits)


def test_one_thread_fills_until_the_first_unit_is_resident(rigs: Callable[..., Rig]) -> None:
    rig = rigs(threads=4)
    backing, filler = rig.backing, rig.filler
    backing.hold(0, 1 * UNIT, 2 * UNIT, 3 * UNIT)
    filler.set_target(8)
    backing.wait_entered(0)
    # Every thread is started at once (none has to be started by a fill thread, which would
    # wait for the GIL), but only one fills while unit 0 is being committed, and it has
    # claimed only unit 0: the others wait for it.
    assert sorted(t.name for t in fill_threads()) == [f"aiokvtier-fill-{i}" for i in range(4)]
    time.sleep(0.05)
    assert [offset for _, offset, _ in backing.commits] == [0]
    first = backing.commits[0][0]
    backing.let_go(0)
    # Then units 1..3 each hold one thread, the fourth fills 4..7.
    for offset in (1 * UNIT, 2 * UNIT, 3 * UNIT):
        backing.wait_entered(offset)
    for offset in range(4 * UNIT, 8 * UNIT, UNIT):
        backing.wait_committed(offset)
    assert filler.watermark == 1 * UNIT
    assert backing.threads_of(range(0, 1)) == {first}
    assert backing.threads_of(range(1 * UNIT, 8 * UNIT)) == {f"aiokvtier-fill-{i}" for i in range(4)}
    backing.let_all_go()
    filler.wait_blocking(8 * UNIT, timeout=WAIT)


# -- set_target -------------------------------------------------------------------------------


def test_set_target_grows_and_shrinks(rigs: Callable[..., Rig]) -> None:
    rig = rigs(threads=2)
    backing, filler = rig.backing, rig.filler
    assert filler.set_target(4) is None
    filler.wait_blocking(4 * UNIT, timeout=WAIT)
    assert filler.set_target(8) is None
    assert filler.target_bytes == 8 * UNIT
    filler.wait_blocking(8 * UNIT, timeout=WAIT)
    assert rig.committed_units() == list(range(8))

    tail = filler.set_target(3)
    assert tail == [(i * UNIT, UNIT) for i in range(3, 8)]
    assert filler.target_bytes == 3 * UNIT
    for offset, length in tail:
        backing.decommit(offset, length)
    filler.finish_shrink(3, tail)
    assert filler.watermark == 3 * UNIT
    assert filler.complete
    assert rig.committed_units() == [0, 1, 2]

    # Growing again recommits the decommitted units, and only those.
    before = len(backing.commits)
    assert filler.set_target(5) is None
    filler.wait_blocking(5 * UNIT, timeout=WAIT)
    assert sorted(offset for _, offset, _ in backing.commits[before:]) == [3 * UNIT, 4 * UNIT]
    assert rig.committed_units() == list(range(5))


def test_same_size_target_returns_no_tail(rigs: Callable[..., Rig]) -> None:
    rig = rigs(threads=1)
    rig.filler.set_target(4)
    rig.filler.wait_blocking(4 * UNIT, timeout=WAIT)
    assert rig.filler.set_target(4) == []


def test_shrink_waits_for_a_unit_being_committed_past_the_new_end(rigs: Callable[..., Rig]) -> None:
    rig = rigs(threads=1)
    backing, filler = rig.backing, rig.filler
    backing.hold(5 * UNIT)
    filler.set_target(8)
    backing.wait_entered(5 * UNIT)
    shrink = InThread(lambda: filler.set_target(3))
    assert shrink.blocked(), "set_target returned while unit 5 was being committed"
    backing.let_go(5 * UNIT)
    # Unit 5 finished committing, so it is in the tail to decommit; 6 and 7 were never started.
    assert shrink.outcome() == [(3 * UNIT, UNIT), (4 * UNIT, UNIT), (5 * UNIT, UNIT)]
    filler.finish_shrink(3, shrink.result)
    filler.close()
    assert {offset for _, offset, _ in backing.commits} == {i * UNIT for i in range(6)}
    assert filler.watermark == 3 * UNIT
    assert rig.committed_units() == [0, 1, 2]


def test_a_failed_decommit_leaves_the_unit_committed(rigs: Callable[..., Rig]) -> None:
    rig = rigs(threads=1)
    filler = rig.filler
    filler.set_target(6)
    filler.wait_blocking(6 * UNIT, timeout=WAIT)
    tail = filler.set_target(2)
    assert tail is not None
    # Units 2, 4 and 5 were given back; 3's decommit "failed".
    filler.finish_shrink(2, [r for r in tail if r[0] != 3 * UNIT])
    assert rig.committed_units() == [0, 1, 3]
    assert filler.watermark == 2 * UNIT
    before = len(rig.backing.commits)
    filler.set_target(6)
    filler.wait_blocking(6 * UNIT, timeout=WAIT)
    assert sorted(offset for _, offset, _ in rig.backing.commits[before:]) == [2 * UNIT, 4 * UNIT, 5 * UNIT]


def test_a_grow_over_a_tail_that_no_decommit_gave_back_completes(rigs: Callable[..., Rig]) -> None:
    # Every unit of the tail is still there (mlock: madvise refuses them all), so the grow back
    # has nothing to commit. The watermark used to move only when a commit returned: it stayed
    # at the shrunk end, and every waiter for the grown range waited forever.
    rig = rigs(threads=2)
    backing, filler = rig.backing, rig.filler
    filler.set_target(6)
    filler.wait_blocking(6 * UNIT, timeout=WAIT)
    assert filler.set_target(2) == [(i * UNIT, UNIT) for i in range(2, 6)]
    filler.finish_shrink(2, [])  # no unit of the tail could be decommitted
    assert filler.watermark == 2 * UNIT and filler.complete
    before = len(backing.commits)
    assert filler.set_target(6) is None
    filler.wait_blocking(6 * UNIT, timeout=WAIT)
    assert filler.complete and filler.watermark == 6 * UNIT
    assert backing.commits[before:] == []  # reused, never committed twice
    assert sorted(backing.recommits) == [i * UNIT for i in range(2, 6)]
    assert filler.stranded_bytes == 0
    assert rig.committed_units() == list(range(6))


def test_stranded_units_are_counted_retried_by_a_shrink_and_released(rigs: Callable[..., Rig]) -> None:
    rig = rigs(threads=1)
    filler = rig.filler
    filler.set_target(8)
    filler.wait_blocking(8 * UNIT, timeout=WAIT)
    tail = filler.set_target(4)
    assert tail is not None
    filler.finish_shrink(4, [r for r in tail if r[0] not in (5 * UNIT, 7 * UNIT)])
    assert filler.stranded_bytes == 2 * UNIT
    assert rig.committed_units() == [0, 1, 2, 3, 5, 7]
    # A second shrink hands back its own tail and tries the stranded units again.
    assert filler.set_target(2) == [(2 * UNIT, UNIT), (3 * UNIT, UNIT), (5 * UNIT, UNIT), (7 * UNIT, UNIT)]
    filler.finish_shrink(2, [(2 * UNIT, UNIT), (3 * UNIT, UNIT), (5 * UNIT, UNIT)])
    assert filler.stranded_bytes == UNIT and rig.committed_units() == [0, 1, 7]
    # A grow short of the stranded unit leaves it stranded, and the fill completes.
    filler.set_target(6)
    filler.wait_blocking(6 * UNIT, timeout=WAIT)
    assert filler.complete and filler.stranded_bytes == UNIT and rig.backing.recommits == []
    filler.close()
    assert filler.committed_ranges() == [(i * UNIT, UNIT) for i in (0, 1, 2, 3, 4, 5, 7)]


def test_a_failed_recommit_fails_the_fill_there_and_keeps_the_unit_stranded(rigs: Callable[..., Rig]) -> None:
    rig = rigs(threads=1)
    backing, filler = rig.backing, rig.filler
    filler.set_target(6)
    filler.wait_blocking(6 * UNIT, timeout=WAIT)
    filler.set_target(2)
    filler.finish_shrink(2, [])
    backing.failing.add(3 * UNIT)
    filler.set_target(6)
    with pytest.raises(FillError) as info:
        filler.wait_blocking(6 * UNIT, timeout=WAIT)
    assert info.value.failed_offset == 3 * UNIT and isinstance(info.value.__cause__, OSError)
    assert filler.watermark == 3 * UNIT  # unit 2 was recommitted; 3 failed; 4 and 5 wait behind it
    assert filler.stranded_bytes == 3 * UNIT
    assert rig.committed_units() == list(range(6))  # all still held: closing releases them
    # A shrink to the failure clears it and hands the stranded units back.
    backing.failing.clear()
    tail = filler.set_target(3)
    assert tail == [(i * UNIT, UNIT) for i in range(3, 6)]
    filler.finish_shrink(3, tail)
    assert filler.error is None and filler.stranded_bytes == 0
    assert rig.committed_units() == [0, 1, 2]
    filler.set_target(6)
    filler.wait_blocking(6 * UNIT, timeout=WAIT)
    assert sorted(backing.recommits) == [2 * UNIT, 3 * UNIT]  # 4 and 5 came back as fresh commits


# -- failures ---------------------------------------------------------------------------------


def test_a_commit_failure_stops_the_fill_past_it_only(rigs: Callable[..., Rig]) -> None:
    rig = rigs(threads=2)
    backing, filler = rig.backing, rig.filler
    backing.hold(2 * UNIT)
    backing.failing.add(4 * UNIT)
    filler.set_target(8)
    with pytest.raises(FillError) as info:
        filler.wait_blocking(8 * UNIT, timeout=WAIT)
    error = info.value
    assert error is filler.error
    assert error.failed_offset == 4 * UNIT
    assert error.resident_bytes == 2 * UNIT  # unit 2 was still held
    assert isinstance(error.__cause__, OSError) and error.__cause__.errno == errno.ENOMEM
    # Waiters below the failure keep waiting for the held unit; those past it are done.
    with pytest.raises(TimeoutError):
        filler.wait_blocking(3 * UNIT, timeout=SETTLE)
    with pytest.raises(FillError):
        filler.wait_blocking(5 * UNIT, timeout=0)
    backing.let_go(2 * UNIT)
    filler.wait_blocking(4 * UNIT, timeout=WAIT)
    assert filler.watermark == 4 * UNIT
    assert not filler.complete
    filler.close()
    assert max(offset for _, offset, _ in backing.commits) == 4 * UNIT
    assert rig.committed_units() == [0, 1, 2, 3]


def test_a_later_failure_below_the_first_one_replaces_it(rigs: Callable[..., Rig]) -> None:
    rig = rigs(threads=2)
    backing, filler = rig.backing, rig.filler
    backing.hold(2 * UNIT)
    backing.failing.update({2 * UNIT, 5 * UNIT})
    filler.set_target(8)
    with pytest.raises(FillError):
        filler.wait_blocking(8 * UNIT, timeout=WAIT)
    assert filler.error is not None and filler.error.failed_offset == 5 * UNIT
    backing.let_go(2 * UNIT)
    with pytest.raises(FillError) as info:
        filler.wait_blocking(3 * UNIT, timeout=WAIT)
    assert info.value.failed_offset == 2 * UNIT
    assert filler.watermark == 2 * UNIT


def test_finish_shrink_clears_an_error_past_the_new_end(rigs: Callable[..., Rig]) -> None:
    rig = rigs(threads=1)
    backing, filler = rig.backing, rig.filler
    backing.failing.add(5 * UNIT)
    filler.set_target(8)
    with pytest.raises(FillError):
        filler.wait_blocking(8 * UNIT, timeout=WAIT)
    assert filler.watermark == 5 * UNIT

    # A shrink that keeps the failed unit keeps the error.
    tail = filler.set_target(6)
    assert tail == []
    filler.finish_shrink(6, tail)
    assert filler.error is not None and filler.error.failed_offset == 5 * UNIT

    # One that drops it clears the error, and the tier is whole again.
    tail = filler.set_target(5)
    assert tail == []
    filler.finish_shrink(5, tail)
    assert filler.error is None
    assert filler.complete
    filler.wait_blocking(5 * UNIT, timeout=0)

    backing.failing.clear()
    filler.set_target(8)
    filler.wait_blocking(8 * UNIT, timeout=WAIT)
    assert rig.committed_units() == list(range(8))


# -- waiting ----------------------------------------------------------------------------------


def test_ready_and_wait_blocking(rigs: Callable[..., Rig]) -> None:
    rig = rigs(threads=1)
    backing, filler = rig.backing, rig.filler
    assert filler.ready(0)
    filler.wait_blocking(0, timeout=0)
    backing.hold(2 * UNIT)
    filler.set_target(4)
    filler.wait_blocking(2 * UNIT, timeout=WAIT)
    assert filler.ready(2 * UNIT, raise_=True)
    assert not filler.ready(2 * UNIT + 1)
    with pytest.raises(TimeoutError, match="not resident"):
        filler.wait_blocking(3 * UNIT, timeout=SETTLE)
    waiter = InThread(lambda: filler.wait_blocking(4 * UNIT, timeout=WAIT))
    assert waiter.blocked()
    backing.let_go(2 * UNIT)
    waiter.outcome()
    assert filler.watermark == 4 * UNIT


def test_close_wakes_a_blocked_waiter_with_tier_closed_error(rigs: Callable[..., Rig]) -> None:
    rig = rigs(threads=1)
    backing, filler = rig.backing, rig.filler
    backing.hold(1 * UNIT)
    filler.set_target(4)
    backing.wait_entered(1 * UNIT)
    waiter = InThread(lambda: filler.wait_blocking(4 * UNIT, timeout=WAIT), name="test-waiter")
    assert waiter.blocked()
    closer = InThread(filler.close, name="test-closer")
    with pytest.raises(TierClosedError):
        waiter.outcome()
    assert closer.blocked(), "close returned before the thread committing unit 1 was joined"
    backing.let_go(1 * UNIT)
    closer.outcome()
    assert not fill_threads()
    # Resident bytes stay readable; anything beyond raises.
    assert filler.ready(2 * UNIT, raise_=True)
    assert filler.ready(3 * UNIT)
    with pytest.raises(TierClosedError):
        filler.ready(3 * UNIT, raise_=True)
    with pytest.raises(TierClosedError):
        filler.wait_blocking(3 * UNIT, timeout=WAIT)
    with pytest.raises(TierClosedError):
        filler.set_target(8)
    # Units past the one being committed at close were never started.
    assert {offset for _, offset, _ in backing.commits} == {0, 1 * UNIT}


def test_close_joins_every_thread_and_is_idempotent(rigs: Callable[..., Rig]) -> None:
    rig = rigs(threads=4)
    backing, filler = rig.backing, rig.filler
    backing.hold(1 * UNIT, 2 * UNIT, 3 * UNIT, 4 * UNIT)
    filler.set_target(UNITS)
    for offset in (1 * UNIT, 2 * UNIT, 3 * UNIT, 4 * UNIT):
        backing.wait_entered(offset)
    assert len(fill_threads()) == 4
    closer = InThread(filler.close, name="test-closer")
    assert closer.blocked()
    backing.let_all_go()
    closer.outcome()
    assert not fill_threads()
    assert filler.closed
    calls = len(rig.changes)
    filler.close()
    assert not fill_threads()
    assert len(rig.changes) == calls + 1
    # Stopped between units: nothing past the held ones was started.
    assert {offset for _, offset, _ in backing.commits} == {i * UNIT for i in range(5)}


def test_close_before_any_target(rigs: Callable[..., Rig]) -> None:
    rig = rigs(threads=2)
    rig.filler.close()
    rig.filler.close()
    assert rig.filler.closed
    assert rig.backing.commits == []


# -- threads that cannot start ----------------------------------------------------------------


class Refusal:
    """Patches ``Thread.start`` to refuse fill threads once ``allow`` of them have started."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, allow: int = 0) -> None:
        self.allow = allow
        self.refused = 0
        self.started = 0
        self._monkeypatch = monkeypatch
        real = threading.Thread.start

        def start(thread: threading.Thread) -> None:
            if thread.name.startswith("aiokvtier-fill"):
                if self.started >= self.allow:
                    self.refused += 1
                    raise RuntimeError("can't start new thread")
                self.started += 1
            real(thread)

        monkeypatch.setattr(threading.Thread, "start", start)

    def remove(self) -> None:
        self._monkeypatch.undo()


def test_set_target_raises_when_no_thread_can_start(rigs: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch) -> None:
    rig = rigs(threads=2)
    filler = rig.filler
    refusal = Refusal(monkeypatch)
    with pytest.raises(FillError, match="could not start a fill thread") as info:
        filler.set_target(4)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert refusal.refused == 1
    assert filler.target_bytes == 0
    assert filler.error is None  # nothing failed that a shrink would have to clear
    assert not fill_threads()
    refusal.remove()
    assert filler.set_target(4) is None
    filler.wait_blocking(4 * UNIT, timeout=WAIT)
    assert rig.committed_units() == [0, 1, 2, 3]


def test_a_grow_that_cannot_start_a_thread_leaves_the_target(
    rigs: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = rigs(threads=1)
    filler = rig.filler
    filler.set_target(4)
    filler.wait_blocking(4 * UNIT, timeout=WAIT)
    for thread in fill_threads():
        thread.join(WAIT)  # the fill is done: its thread is on its way out
    refusal = Refusal(monkeypatch)
    with pytest.raises(FillError):
        filler.set_target(8)
    assert refusal.refused == 1
    assert filler.target_bytes == 4 * UNIT
    assert filler.complete
    refusal.remove()
    filler.set_target(8)
    filler.wait_blocking(8 * UNIT, timeout=WAIT)
    assert rig.committed_units() == list(range(8))


def test_the_fill_goes_on_with_the_one_thread_that_started(
    rigs: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aiokvtier")
    rig = rigs(threads=4)
    refusal = Refusal(monkeypatch, allow=1)
    rig.filler.set_target(8)
    rig.filler.wait_blocking(8 * UNIT, timeout=WAIT)
    rig.filler.close()
    assert refusal.started == 1 and refusal.refused >= 1
    assert rig.backing.threads_of(range(0, 8 * UNIT)) == {"aiokvtier-fill-0"}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings, "no warning that the fill runs with fewer threads"
    assert any("could not start" in r.getMessage() for r in warnings)


# -- on_change --------------------------------------------------------------------------------


def test_on_change_follows_every_publish(rigs: Callable[..., Rig]) -> None:
    rig = rigs(threads=1)
    rig.filler.set_target(6)
    rig.filler.wait_blocking(6 * UNIT, timeout=WAIT)
    rig.filler.close()
    # One thread: every call saw the watermark its publish had just set, in order.
    assert rig.changes[:6] == [i * UNIT for i in range(1, 7)]
    assert rig.changes[6:] == [6 * UNIT]  # the close
    assert rig.changed_under_lock == 0


def test_on_change_follows_a_failure_and_a_shrink(rigs: Callable[..., Rig]) -> None:
    rig = rigs(threads=1)
    filler = rig.filler
    rig.backing.failing.add(2 * UNIT)
    filler.set_target(4)
    with pytest.raises(FillError):
        filler.wait_blocking(4 * UNIT, timeout=WAIT)
    for thread in fill_threads():
        thread.join(WAIT)
    assert rig.errors == [False, False, True]  # units 0 and 1 published, then the failure
    tail = filler.set_target(2)
    assert tail == []
    filler.finish_shrink(2, tail)
    assert rig.errors == [False, False, True, False]  # called once the shrink had cleared the error
    assert rig.changed_under_lock == 0


def test_a_grow_that_lands_as_the_fill_ends_is_logged_when_done(
    rigs: Callable[..., Rig], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aiokvtier")
    rig = rigs(threads=1)
    filler = rig.filler
    published_all = threading.Event()
    go_on = threading.Event()

    def pause() -> None:
        if filler.watermark == 4 * UNIT and not go_on.is_set():
            published_all.set()
            assert go_on.wait(WAIT)

    rig.pause = pause
    filler.set_target(4)
    assert published_all.wait(WAIT)
    # The fill is done and has woken its waiters, but its thread has not counted itself out yet.
    assert filler.complete
    assert filler.set_target(8) is None
    go_on.set()
    filler.wait_blocking(8 * UNIT, timeout=WAIT)
    filler.close()
    done = [r.getMessage() for r in caplog.records if "fill done" in r.getMessage()]
    assert len(done) == 2, done


def test_fill_done_reports_the_bytes_the_fill_made_resident(
    rigs: Callable[..., Rig], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aiokvtier")
    rig = rigs(threads=1)
    filler = rig.filler
    published_all = threading.Event()
    go_on = threading.Event()

    def pause() -> None:
        if filler.watermark == 4 * UNIT and not go_on.is_set():
            published_all.set()
            assert go_on.wait(WAIT)

    rig.pause = pause
    filler.set_target(4)
    assert published_all.wait(WAIT)
    # A waiter woken by that publish shrinks the tier before the fill thread logs.
    tail = filler.set_target(2)
    assert tail is not None
    filler.finish_shrink(2, tail)
    go_on.set()
    filler.close()
    (done,) = [r for r in caplog.records if "fill done" in r.getMessage()]
    assert isinstance(done.args, tuple)
    assert done.args[0] == 4 * UNIT / 2**30, done.getMessage()
