"""The contract between host memory owners and the copy engine.

A region (an open tier or staging buffer) tells the planner its bounds, which
registration holds a span (a tier's commit unit, or a whole static buffer),
and keeps the copies in flight over it, so that a shrink or a close waits for
them. The engine never touches an owner's private state.

A raw copy whose host side falls inside a known region must stay inside one
of its registrations and inside what is committed; addresses outside every
region (device memory, the caller's own buffers) pass through to the driver.
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol

from ._errors import CopyPlanError

__all__ = ["InflightCopies", "Region", "check_span", "find", "register", "unregister"]


class InflightCopies:
    """Copies in flight against one region.

    Only the event loop thread adds and snapshots; completion threads only
    set events. The owner waits for a snapshot on its worker thread.
    """

    def __init__(self) -> None:
        self._events: list[threading.Event] = []

    def track(self, done: threading.Event) -> None:
        events = self._events
        if len(events) > 64:
            events[:] = [e for e in events if not e.is_set()]
        events.append(done)

    def __len__(self) -> int:
        return sum(not e.is_set() for e in self._events)

    def snapshot(self) -> list[threading.Event]:
        """The copies in flight now (on the loop); later ones are the planner's to refuse."""
        pending = [e for e in self._events if not e.is_set()]
        self._events = pending
        return list(pending)

    @staticmethod
    def wait(events: list[threading.Event]) -> None:
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

    def registration_of(self, offset: int, nbytes: int) -> int:
        """Index of the registration holding ``[offset, offset+nbytes)``.

        :raises CopyPlanError: the span crosses two registrations or leaves the committed range.
        """
        ...


_lock = threading.Lock()
_regions: weakref.WeakValueDictionary[int, Region] = weakref.WeakValueDictionary()


def register(region: Region) -> None:
    with _lock:
        _regions[id(region)] = region


def unregister(region: Region) -> None:
    with _lock:
        _regions.pop(id(region), None)


def find(addr: int) -> tuple[Region, int] | None:
    with _lock:
        regions = list(_regions.values())
    for region in regions:
        base, size = region.region_bounds()
        if base <= addr < base + size:
            return region, base
    return None


def check_span(addr: int, nbytes: int) -> tuple[Region, int] | None:
    """``(region, registration index)`` for a host span inside a known region, else None.

    :raises CopyPlanError: the span leaves its region, crosses registrations or is not committed.
    """
    hit = find(addr)
    if hit is None:
        hit_end = find(addr + nbytes - 1) if nbytes > 0 else None
        if hit_end is not None:
            raise CopyPlanError(f"copy of {nbytes} bytes at {addr:#x} runs into {hit_end[0].region_name}")
        return None
    region, base = hit
    _, size = region.region_bounds()
    if addr + nbytes > base + size:
        raise CopyPlanError(f"copy of {nbytes} bytes at {addr:#x} leaves {region.region_name}")
    return region, region.registration_of(addr - base, nbytes)
