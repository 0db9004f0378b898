"""Linux memory syscalls through ctypes.

ctypes releases the GIL for the length of each call, which is the point: a fill
thread populating gigabytes must not stall the event loop (CPython's
``mmap.madvise`` holds the GIL). ``mbind`` has no libc wrapper outside libnuma,
so it goes through ``syscall(2)``.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import platform

import numpy as np

from . import _headroom, _userfault

__all__ = [
    "MADV_DONTNEED",
    "MADV_HUGEPAGE",
    "MADV_NOHUGEPAGE",
    "MPOL_BIND",
    "MPOL_PREFERRED",
    "PAGE_SIZE",
    "absent_runs",
    "madvise",
    "map_anonymous",
    "mbind",
    "mmap_reserve",
    "mprotect",
    "munmap",
    "populate",
    "populate_write",
    "touch",
]

PAGE_SIZE = mmap.PAGESIZE

PROT_NONE = 0x0
PROT_READ = 0x1
PROT_WRITE = 0x2
MAP_PRIVATE = 0x02
MAP_ANONYMOUS = 0x20
MAP_NORESERVE = 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value

log = logging.getLogger("aiokvtier")

MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_NOHUGEPAGE = 15
MADV_POPULATE_WRITE = 23

MPOL_PREFERRED = 1
MPOL_BIND = 2

_SYS_MBIND = {"x86_64": 237, "aarch64": 235, "ppc64le": 259}.get(platform.machine())

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_mprotect = _libc.mprotect
_mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_mincore = _libc.mincore
_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_memset = _libc.memset
_memset.restype = ctypes.c_void_p
_memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mmap_reserve(length: int, align: int) -> tuple[int, int]:
    """Reserve ``length`` bytes of address space, inaccessible and unaccounted.

    PROT_NONE private mappings are not charged against the commit limit, even
    under ``vm.overcommit_memory=2``; MAP_NORESERVE covers the other modes once
    parts are made writable. The base is aligned to ``align`` (huge-page
    alignment keeps THP and registrations on natural boundaries).

    :returns: ``(base, length)``.
    :raises OSError: the kernel refused the reservation.
    """
    span = length + align
    raw = _mmap(None, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
    if raw is None or raw == MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} bytes: {os.strerror(err)}")
    base = (raw + align - 1) // align * align
    if base > raw:
        munmap(raw, base - raw)
    tail = raw + span - (base + length)
    if tail:
        munmap(base + length, tail)
    return base, length


def map_anonymous(length: int) -> int:
    """A plain read-write anonymous mapping (what a large malloc makes). :raises OSError: refused."""
    raw = _mmap(None, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if raw is None or raw == MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} bytes: {os.strerror(err)}")
    return int(raw)


def munmap(addr: int, length: int) -> None:
    _check(_munmap(addr, length), "munmap")


def mprotect(addr: int, length: int, writable: bool) -> None:
    prot = PROT_READ | PROT_WRITE if writable else PROT_NONE
    _check(_mprotect(addr, length, prot), "mprotect")


def madvise(addr: int, length: int, advice: int) -> None:
    _check(_madvise(addr, length, advice), "madvise")


def absent_runs(addr: int, length: int) -> list[tuple[int, int]]:
    """``(address, length)`` of each run of pages of ``[addr, addr + length)`` that is not resident.

    From ``mincore``: one call, one byte per page, whatever the protection.
    A page that was swapped out counts as absent too.

    :raises OSError: ENOMEM where part of the range is not mapped.
    """
    pages = length // PAGE_SIZE
    vec = (ctypes.c_ubyte * pages)()
    _check(_mincore(addr, length, vec), "mincore")
    absent = (np.frombuffer(memoryview(vec), dtype=np.uint8) & 1) == 0
    edges = np.diff(absent.astype(np.int8), prepend=np.int8(0), append=np.int8(0))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return [(addr + int(a) * PAGE_SIZE, int(b - a) * PAGE_SIZE) for a, b in zip(starts, ends, strict=True)]


TOUCH_STEP = 1 << 30
"""Bytes one touch call covers (a unit is at most this in practice: one call).

Each call gives up the GIL and must take it back; next to a busy event loop
taking it back can wait a long time, so a fill makes as few calls as it can.
Far above the 500 elements from which numpy releases the GIL for an
assignment (a piece under ``_TOUCH_MIN_PAGES`` pages uses memset, which
always runs without it)."""
POPULATE_STEP = 2 << 20
"""Bytes one MADV_POPULATE_WRITE call covers. The call holds the address
space's lock for its whole length, and a thread that wants to mmap or munmap
waits for it: 2 MiB is ~1 ms of population, where 512 MiB calls stalled a
neighbouring mmap for 0.5 s (docs/benchmarks.md, ``neighbours``)."""
_TOUCH_MIN_PAGES = 512

_populate_write_supported: bool | None = None


def touch(addr: int, length: int) -> None:
    """Make ``length`` writable bytes at ``addr`` resident by writing a zero into every page.

    Page faults take a per-VMA lock on Linux 6.4+ (on older kernels they hold
    the address space's lock for one fault at a time): other threads' mmap
    and munmap never wait behind the fill. Calls of at most
    ``TOUCH_STEP`` bytes, each without the GIL. Only for memory that holds
    nothing yet (it writes zeroes), and only where memory is known to be
    available: a fault that finds none ends in SIGBUS or the OOM killer, not
    in an error (see ``aiokvtier._host._headroom``).
    """
    for offset in range(0, length, TOUCH_STEP):
        _touch_step(addr + offset, min(TOUCH_STEP, length - offset))


def _touch_step(addr: int, n: int) -> None:
    if n // PAGE_SIZE < _TOUCH_MIN_PAGES:
        _memset(addr, 0, n)
        return
    # frombuffer, not numpy.ctypeslib: that module is imported on first use, and an import
    # reads files, each read a wait for the GIL next to a busy event loop.
    pages = np.frombuffer(memoryview((ctypes.c_ubyte * n).from_address(addr)), dtype=np.uint8)
    pages[::PAGE_SIZE] = 0


def populate_write(addr: int, length: int, step: int = POPULATE_STEP) -> None:
    """Fault in and zero ``length`` writable bytes with MADV_POPULATE_WRITE, ``step`` bytes per call.

    MADV_POPULATE_WRITE (Linux 5.14) reports a lack of memory as ENOMEM;
    older kernels answer EINVAL and get a memset, which also faults every
    page and also runs without the GIL.

    :raises OSError: ENOMEM when memory runs out, EFAULT/EINVAL on a bad range.
    """
    global _populate_write_supported
    for offset in range(0, length, step):
        piece, n = addr + offset, min(step, length - offset)
        if _populate_write_supported is not False:
            if _madvise(piece, n, MADV_POPULATE_WRITE) == 0:
                _populate_write_supported = True
                continue
            err = ctypes.get_errno()
            if err != errno.EINVAL or _populate_write_supported:
                raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")
            _populate_write_supported = False
            log.warning(
                "aiokvtier: this kernel has no MADV_POPULATE_WRITE (Linux 5.14+); where memory is short "
                "the fill writes its pages, and running out ends in SIGBUS or the OOM killer, not ENOMEM"
            )
        _memset(piece, 0, n)


def map_in(addr: int, length: int, step: int = POPULATE_STEP) -> bool:
    """Map pages that already exist (a shared mapping of a file whose pages are resident) into this
    process's page tables, ``step`` bytes per call, without touching their contents.

    MADV_POPULATE_WRITE (Linux 5.14). Returns False, having done nothing, on a kernel without it:
    never a memset (that would write over what another process stored).

    :raises OSError: ENOMEM or EFAULT from the kernel.
    """
    for offset in range(0, length, step):
        if _madvise(addr + offset, min(step, length - offset), MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            if err == errno.EINVAL and offset == 0:
                return False
            raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")
    return True


def populate(addr: int, length: int) -> None:
    """Make ``length`` writable bytes at ``addr`` resident (zeroed), GIL released.

    Touches the pages while the process has memory to spare (no stall for
    other threads), else populates them in short calls that report ENOMEM.

    Inside a range registered for ``UFFDIO_COPY`` (``_userfault``) the pages are copied in
    instead: as fast as populate, no stall, ENOMEM reported (touching would raise SIGBUS there).
    A copy leaves a page that is present already as it is (a unit whose decommit failed
    part-way holds some).

    :raises OSError: ENOMEM when memory runs out, EFAULT/EINVAL on a bad range.
    """
    uf = _userfault.covering(addr, length)
    with _headroom.Claim(length) as claim:
        if uf is not None:
            claim.copied = True
            uf.copy(addr, length, skip_present=True)
        elif claim.granted:
            touch(addr, length)
        else:
            populate_write(addr, length)


def mbind(addr: int, length: int, mode: int, node: int) -> None:
    """Attach a NUMA policy for ``node`` to a range (before any page is touched).

    :raises OSError: EPERM where seccomp or missing CAP_SYS_NICE forbids it,
        ENOSYS on architectures this module has no syscall number for.
    """
    if _SYS_MBIND is None:
        raise OSError(errno.ENOSYS, f"mbind: no syscall number for {platform.machine()}")
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    rc = _syscall(
        ctypes.c_long(_SYS_MBIND),
        ctypes.c_void_p(addr),
        ctypes.c_ulong(length),
        ctypes.c_int(mode),
        mask,
        ctypes.c_ulong(words * 64 + 1),
        ctypes.c_uint(0),
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mbind(node {node}): {os.strerror(err)}")
