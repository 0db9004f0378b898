"""Whether a range can be made resident by touching it, or must be populated.

Touching pages (a plain write per page) makes them resident through page
faults, which on Linux 6.4+ take a per-VMA lock instead of the address
space's ``mmap_lock``: the rest of the process keeps mapping and unmapping
while the fill runs, and fill threads scale. ``MADV_POPULATE_WRITE`` holds
``mmap_lock`` for the whole call, stalling every ``mmap``/``munmap`` of the
process, but it is the only one of the two that reports running out of
memory as ``ENOMEM``: a page fault that finds no memory ends in SIGBUS or
the OOM killer instead.

So a range is touched only while the memory the kernel reports as available
(``MemAvailable``, and the room left under every cgroup ``memory.max`` on the
way to the root) exceeds what all fill threads of the process are touching
now plus a reserve; otherwise it is populated in short calls that can fail
cleanly. This module keeps that ledger, process-wide, because every tier of
the process draws on the same memory.
"""

from __future__ import annotations

import os
import threading
import time

from .. import _sysinfo

__all__ = ["Claim", "available_bytes", "counters", "reserve_bytes"]

_lock = threading.Lock()
_in_flight = 0  # bytes being touched right now, across every tier of the process
_touched = 0
_populated = 0
_copied = 0


def reserve_bytes() -> int:
    """Memory left untouched by the touch path: 1/32 of RAM, at least 256 MiB.

    Room for the rest of the process and for the kernel's own allocations
    while several threads fault at once; below it, population reports ENOMEM.
    """
    return max(256 << 20, _sysinfo.host_memory_bytes() // 32)


SNAPSHOT_SECONDS = 1.0
"""How long a reading of the available memory is used (less what was touched since).

Reading it means a dozen small file reads (``/proc/meminfo``, the cgroup
files up to the root), each of which gives up and takes back the GIL; next
to a busy event loop every take-back waits up to the interpreter's switch
interval (5 ms). Read for every unit, it starved the fill to a few MiB/s.
"""

_snapshot: tuple[float, int | None, int] | None = None  # (monotonic time, available, _made() then)
_refreshing = False


def _made() -> int:
    """Bytes made resident through the ledger so far, touched, populated or copied (hold ``_lock``)."""
    return _touched + _populated + _copied


def _after_fork_in_child() -> None:
    # The parent's other threads do not exist here: a lock one of them held, a refresh one of
    # them was making and the bytes they were touching would otherwise stay taken forever.
    global _lock, _in_flight, _snapshot, _refreshing
    _lock = threading.Lock()
    _in_flight = 0
    _snapshot = None
    _refreshing = False


os.register_at_fork(after_in_child=_after_fork_in_child)


def _read_available() -> int | None:
    try:
        return _sysinfo.available_memory()[0]
    except (OSError, ValueError):
        return None


def available_bytes() -> int | None:
    """Memory that can still be made resident: MemAvailable, capped by the cgroup limit's room.

    Read at most once per ``SNAPSHOT_SECONDS`` (one thread reads, the
    others use the last reading meanwhile), less the bytes touched since.
    None where the kernel reports neither (the caller then populates).
    """
    global _snapshot, _refreshing
    now = time.monotonic()
    with _lock:
        snap = _snapshot
        refresh = snap is None or (now - snap[0] >= SNAPSHOT_SECONDS and not _refreshing)
        if refresh:
            _refreshing = True
    if refresh:
        try:
            available = _read_available()
        finally:
            with _lock:
                _refreshing = False
        with _lock:
            _snapshot = snap = (time.monotonic(), available, _made())
    assert snap is not None
    with _lock:
        _, available, made_then = snap
        return None if available is None else available - (_made() - made_then)


class Claim:
    """The right to touch ``length`` bytes, counted while held. Use as a context manager.

    ``granted`` is False when the memory available, less what other threads
    are touching, does not cover ``length`` plus ``reserve_bytes()``: the
    caller must then populate (which reports ENOMEM) instead of touching.
    """

    __slots__ = ("copied", "granted", "length")

    def __init__(self, length: int) -> None:
        self.length = length
        self.granted = False
        self.copied = False
        """Set by the caller that copied the range in (``UFFDIO_COPY``) instead: counted as copied."""

    def __enter__(self) -> Claim:
        global _in_flight
        with _lock:
            made_before = _made()
        available = available_bytes()
        with _lock:
            # A claim that ended since ``made_before`` left ``_in_flight`` but may not be in
            # ``available`` yet: count what was made resident since once more (at worst twice).
            if available is not None:
                available -= _made() - made_before
            if available is not None and available - _in_flight >= self.length + reserve_bytes():
                _in_flight += self.length
                self.granted = True
        return self

    def __exit__(self, *exc: object) -> None:
        global _in_flight, _touched, _populated, _copied
        with _lock:
            if self.granted:
                _in_flight -= self.length
            if self.copied:
                _copied += self.length
            elif self.granted:
                _touched += self.length
            else:
                _populated += self.length


def counters() -> dict[str, int]:
    """Bytes this process made resident by touching, by populating and by copying in, so far."""
    with _lock:
        return {"touched_bytes": _touched, "populated_bytes": _populated, "copied_bytes": _copied}
