"""Invariants the lifecycle tests check after every cancelled or failed call.

``check_tier`` compares a host tier's ``statistics()`` with ``/proc/self/maps``:
the resident prefix must be mapped read-write, everything past the fill
target must be PROT_NONE, and the slot count must follow the quota.
``wait_no_library_threads`` waits (threads exit asynchronously after a close)
and then asserts that no ``aiokvtier-`` thread is alive.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .conftest import proc_text

if TYPE_CHECKING:
    from aiokvtier import HostTier, TierStatistics

RW = "rw-p"
NONE = "---p"


def maps_between(lo: int, hi: int) -> list[tuple[int, int, str]]:
    """``(start, end, perms)`` of every mapping overlapping ``[lo, hi)``, clipped to it, in address order."""
    out = []
    for line in proc_text("/proc/self/maps").splitlines():
        fields = line.split()
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start < hi and end > lo:
            out.append((max(start, lo), min(end, hi), fields[1]))
    return sorted(out)


def assert_perms(lo: int, hi: int, perms: str, what: str) -> None:
    """``[lo, hi)`` is wholly mapped, and every byte of it with ``perms``."""
    if lo >= hi:
        return
    at = lo
    for start, end, seen in maps_between(lo, hi):
        assert start == at, f"{what}: bytes +{at - lo:#x}..+{start - lo:#x} are not mapped at all"
        assert seen == perms, f"{what}: bytes +{start - lo:#x}..+{end - lo:#x} are {seen!r}, expected {perms!r}"
        at = end
    assert at == hi, f"{what}: bytes +{at - lo:#x}..+{hi - lo:#x} are not mapped at all"


def check_tier(tier: HostTier, *, settled: bool = False) -> TierStatistics:
    """Check a host-backed tier's figures against each other and against /proc/self/maps.

    ``[base, base+resident_bytes)`` must be read-write and
    ``[base+target_bytes, base+max_quota)`` PROT_NONE; with ``settled`` (after
    ``wait_resident()``) the fill must also have reached its target, which
    covers the quota, so the split is exactly at ``target_bytes``.
    """
    s = tier.statistics()
    assert s.slots_total == s.quota // s.slot_size, f"slots_total {s.slots_total} does not follow quota {s.quota}"
    assert s.resident_bytes <= s.target_bytes, f"resident {s.resident_bytes} past the target {s.target_bytes}"
    if settled:
        assert s.resident_bytes == s.target_bytes, (
            f"after wait_resident(): resident {s.resident_bytes} != target {s.target_bytes} (quota {s.quota})"
        )
        assert s.target_bytes >= s.quota, f"fill target {s.target_bytes} is below the quota {s.quota}"
    base = s.base_address
    assert_perms(base, base + s.resident_bytes, RW, f"resident prefix of {s.resident_bytes} bytes")
    assert_perms(base + s.target_bytes, base + s.max_quota, NONE, f"past the target ({s.target_bytes} bytes)")
    return s


def leaked(bases: Iterable[int], size: int) -> dict[int, list[str]]:
    """Reservations (by base) that still have a mapping in ``[base, base+size)``."""
    out = {}
    for base in bases:
        lines = [f"{start:#x}-{end:#x} {perms}" for start, end, perms in maps_between(base, base + size)]
        if lines:
            out[base] = lines
    return out


def fill_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("aiokvtier-fill")]


def library_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("aiokvtier-")]


async def wait_no_library_threads(within: float = 5.0) -> None:
    """Wait (polling the loop, never blocking it) for every ``aiokvtier-`` thread to exit, then assert none is left."""
    deadline = time.monotonic() + within
    # A thread's exit sets nothing a coroutine could await: poll.
    while library_threads() and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    alive = library_threads()
    assert not alive, f"library threads still alive after {within} s: {[t.name for t in alive]}"


def assert_no_library_threads(timeout: float = 5.0) -> None:
    """Off any event loop: join every ``aiokvtier-`` thread for up to ``timeout`` s, then assert none is left."""
    deadline = time.monotonic() + timeout
    for thread in library_threads():
        thread.join(max(0.0, deadline - time.monotonic()))
    alive = library_threads()
    assert not alive, f"library threads still alive after {timeout} s: {[t.name for t in alive]}"


def settle_earlier_owners(timeout: float = 30.0) -> None:
    """Before a test that checks process-wide state (the userfault registry, its descriptors): let the
    owners of earlier tests finish. A tier whose last view outlived its close gives its range back on its
    worker when that view is dropped, which may be after its test returned, while the next one runs.

    Off any event loop; ``timeout`` only bounds a hang."""
    gc.collect()  # a view dropped in a reference cycle
    assert_no_library_threads(timeout)
