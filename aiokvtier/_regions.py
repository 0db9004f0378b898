"""The contract between host memory owners and the copy engine.

A region (an open tier or staging buffer) tells the planner its bounds, which
registration holds a span (a tier's commit unit, or a whole static buffer),
and keeps the copies in flight over it, so that a shrink or a close waits for
them. The engine never touches an owner's private state.

A raw copy whose host side falls inside a known region must stay inside one
of its registrations and inside what is committed; addresses outside every
region (device memory, the caller's own buffers) pass through to the driver.

A copy may be planned on another thread than the one closing or shrinking
a region (an engine used from two event loops): a check that passed can be
stale by the time the copy is tracked. So every snapshot bumps ``epoch()``,
and whoever tracks a copy reads it before its checks and checks again after
tracking where it moved (``InflightCopies`` says why that suffices).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ._errors import CopyPlanError

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]

__all__ = [
    "InflightCopies",
    "Landing",
    "Region",
    "epoch",
    "generation",
    "known",
    "locate",
    "locate_span",
    "register",
    "unregister",
]


class Landing:
    """One copy's "the bytes have landed" flag: set once by whoever copies (any thread), waited
    for by an owner's close or shrink on its worker thread.

    A lock taken at creation and released by ``set()``: a request makes one, and a
    ``threading.Event`` (a condition over a lock) costs ten times as much to make and set.
    """

    __slots__ = ("_flag", "_lock")

    def __init__(self) -> None:
        self._flag = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        """Idempotent; one thread sets (the one that copied or failed to)."""
        if not self._flag:
            self._flag = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._flag

    def wait(self) -> None:
        """Block until ``set()``."""
        if not self._flag:
            with self._lock:
                pass


class InflightCopies:
    """Copies in flight against one region: the one mechanism by which an owner's close and
    shrink wait for every copy over its memory, whoever issues it (the CopyEngine, the
    BlockStore's host copies).

    Loop threads add (more than one where an engine serves several loops) and the
    owner's loop snapshots, under one lock; the threads that copy only set their
    ``Landing``. The owner waits for a snapshot on its worker thread.

    The owner marks itself closing (or cuts its committed range) before it
    snapshots, and a snapshot bumps ``epoch()``. A copy tracked after a snapshot
    is not in it, but its tracker, reading ``epoch()`` after tracking, sees the
    bump and checks the region again, and then sees the close or the cut: a copy
    is either waited for or refused, never run over memory going away.
    """

    def __init__(self) -> None:
        self._events: list[Landing] = []
        self._compact_at = 64
        self._lock = threading.Lock()

    def begin(self) -> Landing:
        """Track a copy about to start (on the loop, in the same step that checked the region open);
        whoever copies sets it once the bytes have landed, also when the copy failed."""
        done = Landing()
        self.track(done)
        return done

    def track(self, done: Landing) -> None:
        with self._lock:
            events = self._events
            if len(events) >= self._compact_at:
                # Landed copies are dropped now and then; the bound doubles past what stays in flight,
                # so many copies in flight cost a scan per doubling, not one per copy.
                events[:] = [e for e in events if not e.is_set()]
                self._compact_at = max(64, 2 * len(events))
            events.append(done)

    def __len__(self) -> int:
        with self._lock:
            return sum(not e.is_set() for e in self._events)

    def snapshot(self) -> list[Landing]:
        """The copies in flight now (on the owner's loop, after it marked itself closing or cut its
        range); copies tracked later see ``epoch()`` moved and check the region again."""
        global _epoch
        with self._lock:
            pending = [e for e in self._events if not e.is_set()]
            self._events = pending
            with _lock:
                _epoch += 1
            return list(pending)

    @staticmethod
    def wait(events: list[Landing]) -> None:
        """Block until every copy of a snapshot has landed (on a worker thread)."""
        for event in events:
            event.wait()


class Region(Protocol):
    @property
    def region_name(self) -> str: ...
    @property
    def copies(self) -> InflightCopies:
        """Where the engine tracks its copies over this region."""
        ...

    def region_bounds(self) -> tuple[int, int]:
        """``(base, size)`` of the whole reserved range."""
        ...

    def registrations_of(self, offsets: U64, nbytes: U64) -> I64:
        """Per span ``[offset, offset+nbytes)``, the index of the registration holding it.

        The planner asks only about spans inside ``region_bounds()``: ``offset + nbytes``
        is at most the region's size, never wrapped.

        :raises CopyPlanError: a span crosses two registrations or leaves the committed range.
        """
        ...


_lock = threading.Lock()
_regions: weakref.WeakValueDictionary[int, Region] = weakref.WeakValueDictionary()
_live: tuple[weakref.ref[Region], ...] = ()
"""The regions as one tuple, replaced whole under the lock: a request reads it without the lock
(every planner call does, so a dictionary's iteration guard is too dear). A region dropped without
``unregister()`` stays in it as a dead reference, skipped, until the next change: nothing here runs
from a garbage collector's callback, which could come while this thread holds the lock."""


_epoch = 0
"""Snapshots taken so far, of any region (``epoch()``)."""


def _after_fork_in_child() -> None:
    # A thread of the parent (a close unregistering on its owner's thread) may have held the lock:
    # the child has none of those threads, and opens regions of its own.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def epoch() -> int:
    """A count that moves whenever a region snapshots its copies in flight (a close, a shrink): a
    tracker that read it before its checks and finds it moved after tracking checks again."""
    return _epoch


def generation() -> tuple[int, object]:
    """What a check of where spans lie depends on: ``epoch()`` and the set of regions. A check
    that passed stays true while this is unchanged (a region grows, never moves; it shrinks or
    closes only through a snapshot), so a caller may keep its result until then."""
    return _epoch, _live


def _republish() -> None:
    global _live
    with _lock:
        _live = tuple(weakref.ref(region) for region in _regions.values())


def register(region: Region) -> None:
    with _lock:
        _regions[id(region)] = region
    _republish()


def unregister(region: Region) -> None:
    with _lock:
        _regions.pop(id(region), None)
    _republish()


def known() -> list[Region]:
    """The regions open now, in no particular order."""
    return [region for ref in _live if (region := ref()) is not None]


def locate_span(addr: int, nbytes: int) -> Region | None:
    """The known region one span ``[addr, addr + nbytes)`` lies in, inside one of its
    registrations; None where it meets no region. Python ints, no arrays but the
    region's own answer: a request's whole buffer, checked at once.

    :raises CopyPlanError: the span meets a region without lying inside it, crosses
        registrations or is not committed (as ``locate``).
    """
    end = addr + nbytes
    for region in known():
        start, size = region.region_bounds()
        if start < end and addr < start + size:
            if addr < start or end > start + size:
                raise CopyPlanError(f"copy of {nbytes} bytes at {addr:#x} does not lie inside {region.region_name}")
            offset = np.array([addr - start], dtype=np.uint64)
            region.registrations_of(offset, np.array([nbytes], dtype=np.uint64))
            return region
    return None


def locate(addrs: U64, nbytes: U64) -> tuple[I64, list[Region], I64]:
    """Per host span, the known region holding it and the registration inside it.

    Returns ``(which, regions, registration)``: ``which`` indexes ``regions``
    (-1: in no known region, ``registration`` then -1 too). Vectorised: a
    request of 32k spans costs a few sorts, not 32k Python calls. Any
    uint64 sizes: no ``addr + nbytes`` is formed, so none can wrap.

    :raises CopyPlanError: a span leaves its region, runs into (or over) one
        from outside, crosses registrations or is not committed.
    """
    regions = known()
    bounds = [region.region_bounds() for region in regions]
    if not regions or not len(addrs):
        return np.full(len(addrs), -1, dtype=np.int64), regions, np.full(len(addrs), -1, dtype=np.int64)
    # The usual device side lies far from every region: one bounding span (Python ints, so no
    # wrap) that meets none settles all, before any array is built (a request's planning is
    # tens of microseconds, each numpy call about one).
    lo, hi = int(addrs.min()), int(addrs.max()) + int(nbytes.max())
    if not any(start < hi and lo < start + size for start, size in bounds):
        return np.full(len(addrs), -1, dtype=np.int64), regions, np.full(len(addrs), -1, dtype=np.int64)
    order = sorted(range(len(regions)), key=lambda i: bounds[i][0])
    regions = [regions[i] for i in order]
    bounds_sorted = [bounds[i] for i in order]
    starts = np.array([b[0] for b in bounds_sorted], dtype=np.uint64)
    ends = starts + np.array([b[1] for b in bounds_sorted], dtype=np.uint64)
    registration = np.full(len(addrs), -1, dtype=np.int64)
    following = np.searchsorted(starts, addrs, side="right")  # the first region starting past each address
    which = following.astype(np.int64) - 1
    inside = (which >= 0) & (addrs < ends[np.maximum(which, 0)])
    which = np.where(inside, which, -1)
    if inside.any():
        outside: npt.NDArray[np.intp] | None = np.flatnonzero(~inside)
        nxt, out_addrs, out_sizes = following[outside], addrs[outside], nbytes[outside]
    else:  # the usual device-side request: no span in a region, nothing to gather
        outside, nxt, out_addrs, out_sizes = None, following, addrs, nbytes
    if len(nxt):
        # A span from outside reaches a region when the next one starts before the span ends, wherever
        # its last byte lies (it may cover the region whole). Room, not an end: ``addr + nbytes`` could
        # wrap past 2**64 for a uint64 size, this difference cannot (the next start lies past addr).
        room = starts[np.minimum(nxt, len(starts) - 1)] - out_addrs
        into = (nxt < len(starts)) & (out_sizes > room)
        if into.any():
            i = int(np.flatnonzero(into)[0])
            span = i if outside is None else int(outside[i])
            raise CopyPlanError(
                f"copy of {int(nbytes[span])} bytes at {int(addrs[span]):#x} runs into "
                f"{regions[int(nxt[i])].region_name}"
            )
    if outside is None:
        return which, regions, registration
    met = np.flatnonzero(np.bincount(which[inside], minlength=len(regions)))  # a count, not a sort
    for r in met.tolist():
        # The usual request has all its spans in one region: no gathers then.
        at = slice(None) if outside.size == 0 and len(met) == 1 else np.flatnonzero(which == r)
        offsets, sizes = addrs[at] - starts[r], nbytes[at]
        leaving = np.flatnonzero(sizes > np.uint64(bounds_sorted[r][1]) - offsets)  # room again: no sum to wrap
        if leaving.size:
            i = int(leaving[0])
            raise CopyPlanError(
                f"copy of {int(sizes[i])} bytes at {int(offsets[i] + starts[r]):#x} leaves {regions[r].region_name}"
            )
        registration[at] = regions[r].registrations_of(offsets, sizes)
    return which, regions, registration
