"""The fill: threads that commit units and publish the resident prefix.

This is the synchronous core of progressive residency. Fill threads claim
runs of units (about ``fill_chunk`` bytes each) in ascending order, commit
them through the backing with the GIL released, and publish the *watermark*:
the byte length of the longest fully committed prefix. With several threads
units complete out of order; the watermark still only covers the prefix.

A unit whose decommit failed is *stranded*: the backing still holds it, so it
is released at close and a later shrink tries to decommit it again, but it is
not part of the prefix. A grow over it hands it to a fill thread like any
empty unit, which recommits it (``Backing.recommit()``) instead of
committing it; only then does the watermark pass it.

All state is guarded by one lock. The event loop never takes it: the async
facade reads the watermark (a plain attribute) and hands every call that must
lock to a worker thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from .._errors import FillError, TierClosedError
from ._backing import Backing
from ._layout import UnitLayout

__all__ = ["Filler"]

log = logging.getLogger("aiokvtier")

_EMPTY, _FILLING, _COMMITTED, _STRANDED = 0, 1, 2, 3
_FIRST_FILLING = bytes([_FILLING])


class Filler:
    """Commits units ``[0, target)`` of a backing with ``threads`` workers.

    :param on_change: called (from whichever thread changed the state, never
        under the lock) after every publish, failure or close.
    """

    def __init__(
        self,
        backing: Backing,
        layout: UnitLayout,
        *,
        threads: int,
        fill_chunk: int,
        cpus: set[int] | None,
        on_change: Callable[[], None],
    ) -> None:
        self._backing = backing
        self._layout = layout
        self._threads_wanted = threads
        self._fill_chunk = fill_chunk
        self._cpus = cpus
        self._on_change = on_change
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._states = bytearray()
        self._stranded: set[int] = set()  # stranded units, also while a fill thread recommits them
        self._target = 0
        self._next_claim = 0
        self._prefix = 0
        self._threads: list[threading.Thread] = []
        self._active = 0
        self._stop = False
        self._started_at = 0.0
        self._finished_at: float | None = None
        self.watermark = 0
        """Bytes resident as one contiguous prefix. Read without the lock."""
        self.error: FillError | None = None
        """The lowest failure not yet cleared by a shrink."""
        self.closed = False
        self.affinity_warning: str | None = None
        self.stranded_bytes = 0
        """Bytes of stranded units (a failed decommit left them committed). Read without the lock."""

    # -- figures (read without the lock: a racy snapshot is fine) -------------

    @property
    def target_bytes(self) -> int:
        return self._layout.start(self._target)

    def committed_ranges(self, first: int = 0) -> list[tuple[int, int]]:
        """``(offset, length)`` of every unit the backing holds from unit ``first`` on: committed or stranded."""
        layout = self._layout
        return [
            (layout.start(i), layout.end(i) - layout.start(i))
            for i in range(first, len(self._states))
            if self._states[i] in (_COMMITTED, _STRANDED)
        ]

    @property
    def fill_seconds(self) -> float:
        end = self._finished_at if self._finished_at is not None else time.monotonic()
        return end - self._started_at if self._started_at else 0.0

    @property
    def complete(self) -> bool:
        return self._prefix >= self._target

    # -- control (blocking: call off the event loop) --------------------------

    def set_target(self, units: int) -> list[tuple[int, int]] | None:
        """Fill to ``units`` units.

        :returns: None for a grow; for a shrink (or same size), the committed
            (and stranded) ranges past the new end, once no unit there is being
            committed. The caller decommits them and then calls ``finish_shrink()``.
        """
        with self._cond:
            self._check_open()
            grow = units > self._target
        if grow:
            # One mprotect per resize, outside the lock: it waits for the address space's lock.
            self._backing.expose(self._layout.start(units))
        try:
            with self._cond:
                self._check_open()
                if units > len(self._states):
                    self._states.extend(bytes(units - len(self._states)))
                grow = units > self._target
                previous, self._target = self._target, units
                if grow:
                    try:
                        self._start_threads_locked()
                    except FillError:
                        self._target = previous  # nothing changed: a later grow tries again
                        raise
                    self._advance_locked()
                    self._cond.notify_all()
                    return None
                self._next_claim = min(self._next_claim, units)
                self._cond.wait_for(lambda: _FILLING not in self._states[units:])
                return self.committed_ranges(units)
        except FillError:
            if grow:  # the grow did not happen: close what was opened for it
                self._backing.expose(self.target_bytes)
            raise

    def finish_shrink(self, units: int, decommitted: list[tuple[int, int]]) -> None:
        """Record a shrink to ``units`` units once the tail is decommitted, and close the tail.

        Units of the tail not in ``decommitted`` (their decommit failed) are
        stranded: closing still releases (and unregisters) them, a later
        shrink tries them again, and a grow recommits them.

        :raises OSError: the tail could not be made inaccessible (the shrink stands).
        """
        try:
            self._record_shrink(units, decommitted)
        finally:
            self._on_change()
        with self._cond:
            if self._target != units:
                return  # a grow came first (resizes are serialised by the caller; defensive)
        self._backing.expose(self._layout.start(units))

    def _record_shrink(self, units: int, decommitted: list[tuple[int, int]]) -> None:
        with self._cond:
            for offset, _ in decommitted:
                index = self._layout.unit_at(offset)
                self._states[index] = _EMPTY
                self._unstrand_locked(index)
            for index in range(units, len(self._states)):
                if self._states[index] == _COMMITTED:
                    self._states[index] = _STRANDED
                    self._strand_locked(index)
            while len(self._states) > units and self._states[-1] == _EMPTY:
                self._states.pop()
            if self._prefix > units:
                self._prefix = units
                self.watermark = self._layout.start(units)
            if self.error is not None and self.error.failed_offset >= self._layout.start(units):
                self.error = None
            self._mark_finished_locked()
            self._cond.notify_all()

    def close(self) -> None:
        """Stop between units and join every worker. Idempotent."""
        with self._cond:
            self._stop = True
            self.closed = True
            self._cond.notify_all()
            threads = list(self._threads)
        for thread in threads:
            thread.join()
        self._threads.clear()
        self._on_change()

    def wait_blocking(self, nbytes: int | Callable[[], int], timeout: float | None) -> None:
        """Block the calling thread until ``nbytes`` are resident.

        ``nbytes`` may be a function, read again at every wake-up (a shrink
        moves the target; the function may raise to end the wait).

        :raises TimeoutError: ``timeout`` seconds passed first.
        :raises FillError: the fill failed below ``nbytes``.
        :raises TierClosedError: the tier closed first.
        """
        target = nbytes if callable(nbytes) else lambda: nbytes
        with self._cond:
            if not self._cond.wait_for(lambda: self.ready(target()), timeout):
                raise TimeoutError(f"{target()} bytes not resident after {timeout} s (watermark {self.watermark})")
            self.ready(target(), raise_=True)

    def ready(self, nbytes: int, *, raise_: bool = False) -> bool:
        """Whether a waiter for ``nbytes`` is done (resident, failed or closed)."""
        if self.watermark >= nbytes:
            return True
        error = self.error
        if self.closed or (error is not None and error.failed_offset < nbytes):
            if raise_:
                if self.closed:
                    raise TierClosedError("the tier is closed")
                assert error is not None
                raise error
            return True
        return False

    # -- workers --------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise TierClosedError("the tier is closed")

    def _start_threads_locked(self) -> None:
        """Start workers up to the wanted count, all of them now.

        Until the first unit is resident one worker fills alone: it fills the
        unit the first allocation waits for, and others would only compete
        with it for the memory bandwidth; they wait for it (see ``_run()``).
        They are started here rather than by the first worker once it is done:
        ``Thread.start`` waits until the new thread has run, which needs the
        GIL, and a fill thread asking for the GIL next to a busy event loop
        can wait for seconds (the loop gives it up and takes it back on every
        iteration, and the waiting thread rarely wins).

        :raises FillError: there is work, no worker runs, and none could start.
        """
        if self._stop or self.error is not None or self._next_claim >= self._target:
            self._mark_finished_locked()
            return
        if self._active == 0 or self._finished_at is not None:
            # A new fill (the last one ended, though its worker may not have counted itself out yet).
            self._started_at = time.monotonic()
            self._finished_at = None
        self._threads = [t for t in self._threads if t.is_alive()]
        wanted = self._threads_wanted
        while self._active < wanted:
            thread = threading.Thread(target=self._run, name=f"aiokvtier-fill-{len(self._threads)}", daemon=True)
            try:
                thread.start()
            except (RuntimeError, MemoryError) as exc:
                if self._active == 0:
                    raise FillError(
                        f"could not start a fill thread: {exc}",
                        resident_bytes=self.watermark,
                        failed_offset=self.watermark,
                    ) from exc
                log.warning("aiokvtier: filling with %d thread(s); another could not start: %s", self._active, exc)
                return
            self._active += 1  # under the lock, so before the worker can count itself out
            self._threads.append(thread)

    def _advance_locked(self) -> bool:
        """Extend the prefix over committed units and publish it; True when that finished the fill."""
        states, end = self._states, min(len(self._states), self._target)
        prefix = self._prefix
        while prefix < end and states[prefix] == _COMMITTED:
            prefix += 1
        self._prefix = prefix
        self.watermark = self._layout.start(prefix)
        return self._mark_finished_locked()

    def _strand_locked(self, index: int) -> None:
        if index not in self._stranded:
            self._stranded.add(index)
            self.stranded_bytes += self._layout.end(index) - self._layout.start(index)

    def _unstrand_locked(self, index: int) -> None:
        if index in self._stranded:
            self._stranded.discard(index)
            self.stranded_bytes -= self._layout.end(index) - self._layout.start(index)

    def _mark_finished_locked(self) -> bool:
        """Record the end of a fill; True the first time it is reached."""
        if self._prefix >= self._target and self._finished_at is None:
            self._finished_at = time.monotonic()
            return True
        return False

    def _thread_setup(self) -> None:
        if self._cpus:
            try:
                os.sched_setaffinity(0, self._cpus & os.sched_getaffinity(0) or self._cpus)
            except OSError as exc:
                self.affinity_warning = f"could not bind fill thread to CPUs {sorted(self._cpus)}: {exc.strerror}"
                log.warning(self.affinity_warning)
        self._backing.thread_setup()

    def _claim_locked(self) -> range | None:
        states = self._states
        first = self._next_claim
        while first < self._target and states[first] == _COMMITTED:
            first += 1
        self._next_claim = first
        if self._stop or self.error is not None or first >= self._target:
            return None
        layout = self._layout
        last = first + 1
        # Empty and stranded units alike: each is committed or recommitted in turn.
        while (
            last < self._target
            and states[last] in (_EMPTY, _STRANDED)
            and layout.start(last) - layout.start(first) < self._fill_chunk
        ):
            last += 1
        for i in range(first, last):
            self._states[i] = _FILLING
        self._next_claim = last
        return range(first, last)

    def _release_claim_locked(self, units: range) -> None:
        for i in units:
            if self._states[i] == _FILLING:
                self._states[i] = _STRANDED if i in self._stranded else _EMPTY
        if units:
            self._next_claim = min(self._next_claim, units.start)

    def _run(self) -> None:
        try:
            self._thread_setup()
        except BaseException as exc:
            with self._cond:
                self._fail_locked(self._next_claim, exc)
                self._active -= 1
                self._cond.notify_all()
            self._on_change()
            return
        while True:
            with self._cond:
                # The first unit is being filled: leave it the bandwidth (the first allocation waits for it).
                self._cond.wait_for(lambda: self._prefix > 0 or self._states[:1] != _FIRST_FILLING or self._stop)
                claim = self._claim_locked()
                if claim is None:
                    self._active -= 1
                    self._mark_finished_locked()
                    self._cond.notify_all()
                    return
            for pos, index in enumerate(claim):
                if self._stop or index >= self._target or self._failed_below(index):
                    with self._cond:
                        self._release_claim_locked(claim[pos:])
                        self._cond.notify_all()
                    break
                if not self._commit_unit(index):
                    with self._cond:
                        self._release_claim_locked(claim[pos + 1 :])
                        self._cond.notify_all()
                    break

    def _failed_below(self, index: int) -> bool:
        # Units past a failure cannot join the prefix until a shrink clears
        # it; units below it still serve waiters, so they are finished.
        error = self.error
        return error is not None and error.failed_offset < self._layout.start(index)

    def _commit_unit(self, index: int) -> bool:
        layout = self._layout
        start = layout.start(index)
        stranded = index in self._stranded  # for a claimed unit, only the thread that claimed it changes this
        try:
            if stranded:
                self._backing.recommit(start, layout.end(index) - start)
            else:
                self._backing.commit(start, layout.end(index) - start)
        except BaseException as exc:
            with self._cond:
                self._states[index] = _STRANDED if stranded else _EMPTY
                self._fail_locked(index, exc)
                self._cond.notify_all()
            self._on_change()
            return False
        with self._cond:
            self._states[index] = _COMMITTED
            self._unstrand_locked(index)
            finished = self._advance_locked()
            done_bytes, done_seconds = self.watermark, self.fill_seconds
            self._cond.notify_all()
        self._on_change()
        what = "recommitted" if stranded else "committed"
        log.debug("aiokvtier: unit %d %s (%d bytes at +%d)", index, what, layout.end(index) - start, start)
        if finished:
            self._log_done(done_bytes, done_seconds)
        return True

    @staticmethod
    def _log_done(nbytes: int, seconds: float) -> None:
        gib = nbytes / 2**30
        rate = f"{gib / seconds:.2f} GiB/s" if seconds > 0 else "at once"
        log.info("aiokvtier: fill done: %.2f GiB resident in %.3f s (%s)", gib, seconds, rate)

    def _fail_locked(self, index: int, exc: BaseException) -> None:
        offset = self._layout.start(index)
        if self.error is not None and self.error.failed_offset <= offset:
            return
        error = FillError(
            f"making bytes {offset}.. resident failed: {exc}",
            resident_bytes=self.watermark,
            failed_offset=offset,
        )
        error.__cause__ = exc
        self.error = error
        log.error("aiokvtier fill failed at offset %d: %s", offset, exc)
