"""Host regions the copy planner knows: open tiers and static buffers.

A raw copy whose host side falls inside a known region must stay inside one
of its registrations (a tier's commit unit, or a whole static buffer) and
inside what is committed; addresses outside every region (device memory,
the caller's own buffers) pass through to the driver.
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol

from ._errors import CopyPlanError

__all__ = ["Region", "check_span", "register", "unregister"]


class Region(Protocol):
    @property
    def region_name(self) -> str: ...
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
