"""Filling a reservation with ``UFFDIO_COPY``: populate's speed, a fault's locking, a guard for free.

A userfaultfd registered once over the whole reservation, for missing pages,
with ``UFFD_FEATURE_SIGBUS``:

- ``UFFDIO_COPY`` makes a unit resident in one call, as ``MADV_POPULATE_WRITE``
  does, and reports a lack of memory as ``ENOMEM``; on Linux 6.9+ it takes the
  VMA's own lock, as a page fault does, so another thread's ``mmap`` never
  waits behind it (populate holds the address space's lock through each call).
  On the H200 machine it filled 4 KiB pages at 3.1 / 5.8 / 10.6 / 20.2 GiB/s
  with 1 / 2 / 4 / 8 threads, against 2.0 / 3.8 / 6.6 / 12.4 for touching
  and 3.5 / 3.7 / 5.6 / 9.7 for populate (``benchmarks/fill_uffd.py``).
- A missing page that anything else touches raises SIGBUS at once instead of
  waiting for a copy (no thread can hang on the fill), so memory past the
  watermark faults instead of silently allocating: the guard PROT_NONE gave
  before the range was opened once per resize.

Only for 4 KiB pages (the kernel copies into small pages; huge-page fills
populate). The userfaultfd speaks for the address space that opened it: a
forked child's copy refuses to copy (its mappings are not registered; it
fills by touching, as everywhere the kernel, an older kernel or a seccomp
filter refuses userfaultfd).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import threading

__all__ = ["Userfault", "covering", "registered", "supported"]

log = logging.getLogger("aiokvtier")

_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}.get(platform.machine())
"""Architectures with the generic ioctl encoding only (ppc64le, mips and sparc differ)."""
_O_CLOEXEC, _O_NONBLOCK, _UFFD_USER_MODE_ONLY = 0o2000000, 0o4000, 1
_UFFD_API = 0xAA
_FEATURE_SIGBUS = 1 << 7
_MODE_MISSING = 1
_COPY_BIT = 1 << 0x03


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0xAA << 8) | nr


_UFFDIO_API = _ioc(3, 0x3F, 24)
_UFFDIO_REGISTER = _ioc(3, 0x00, 32)
_UFFDIO_COPY = _ioc(3, 0x03, 40)

MIN_KERNEL = (6, 9)
"""Userfaultfd operations take the VMA's lock from Linux 6.9; before, the address space's (as
populate does), and a neighbour's ``mmap`` would wait for each copy."""

SOURCE_BYTES = 256 << 20
"""Bytes one ``UFFDIO_COPY`` call covers at most: the zeros it copies from are a read-only
mapping that is never written, so every source page is the kernel's one zero page (cached;
its page tables, 512 KiB, are the only memory it costs). A 64 MiB unit is one call."""

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_ioctl = _libc.ioctl
_ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MADV_NOHUGEPAGE = 15
_PAGE = os.sysconf("SC_PAGE_SIZE")

_source = 0
_source_lock = threading.Lock()


def _kernel() -> tuple[int, int]:
    try:
        major, minor = os.uname().release.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return 0, 0


def supported() -> bool:
    """This kernel and architecture can fill with ``UFFDIO_COPY`` without stalling the process."""
    return _SYS_USERFAULTFD is not None and _kernel() >= MIN_KERNEL


def _zeros() -> int:
    """The read-only zeros copies come from (one mapping per process, kept: a child inherits it)."""
    global _source
    with _source_lock:
        if not _source:
            prot_read, private_anon_noreserve = 0x1, 0x02 | 0x20 | 0x4000
            raw = _mmap(None, SOURCE_BYTES, prot_read, private_anon_noreserve, -1, 0)
            if raw is None or raw == ctypes.c_void_p(-1).value:
                err = ctypes.get_errno()
                raise OSError(err, f"mmap of the zero source: {os.strerror(err)}")
            # Read faults on a mapping THP may back take the huge zero page, or, where the kernel's
            # use_zero_page is off, allocate a real 2 MiB page each: 256 MiB for zeros.
            if _madvise(raw, SOURCE_BYTES, _MADV_NOHUGEPAGE) and ctypes.get_errno() != errno.EINVAL:
                err = ctypes.get_errno()
                _munmap(raw, SOURCE_BYTES)
                raise OSError(err, f"madvise of the zero source: {os.strerror(err)}")
            _source = int(raw)
        return _source


def _fail(call: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{call}: {os.strerror(err)}")


class Userfault:
    """A userfaultfd with the SIGBUS feature, registered over one range for missing pages.

    :raises OSError: the kernel or a seccomp filter refused the userfaultfd or the registration
        (ENOSYS, EPERM, EINVAL); nothing is left open then.
    """

    def __init__(self, addr: int, length: int) -> None:
        if not supported() or _SYS_USERFAULTFD is None:
            version = ".".join(map(str, MIN_KERNEL))
            raise OSError(errno.ENOSYS, f"filling by UFFDIO_COPY needs Linux {version}+ on x86-64 or arm64")
        self.start, self.end = addr, addr + length
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._copying = 0  # calls in flight: the descriptor is closed after the last one
        self._closed = False
        # User-mode faults only: allowed without privileges (Linux 5.11+); a fault the kernel takes
        # on a missing page (a read(2) into it) fails with EFAULT, as in a PROT_NONE range.
        flags = _O_CLOEXEC | _O_NONBLOCK | _UFFD_USER_MODE_ONLY
        fd = int(_syscall(ctypes.c_long(_SYS_USERFAULTFD), ctypes.c_int(flags)))
        if fd < 0:
            raise _fail("userfaultfd")
        try:
            api = (ctypes.c_uint64 * 3)(_UFFD_API, _FEATURE_SIGBUS, 0)
            if _ioctl(fd, _UFFDIO_API, api):
                raise _fail("UFFDIO_API")
            reg = (ctypes.c_uint64 * 4)(addr, length, _MODE_MISSING, 0)
            if _ioctl(fd, _UFFDIO_REGISTER, reg):
                raise _fail("UFFDIO_REGISTER")
            if not reg[3] & _COPY_BIT:
                raise OSError(errno.EINVAL, "UFFDIO_REGISTER: the range does not allow UFFDIO_COPY")
            self._source = _zeros()
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def copy(self, addr: int, length: int, *, skip_present: bool = False) -> None:
        """Make ``[addr, addr + length)`` resident and zero; every page must be missing, or, with
        ``skip_present``, a page that is present is left as it is. Any number of threads at once,
        each call without the GIL.

        :raises OSError: ENOMEM when memory runs out (what was copied stays resident), EEXIST where
            a page was present (without ``skip_present``), ENOENT where no registered mapping is,
            EBADF after ``close()`` or in a forked child.
        """
        if os.getpid() != self._pid:
            raise OSError(errno.EBADF, "UFFDIO_COPY: this userfaultfd belongs to the parent process")
        if addr < self.start or addr + length > self.end:
            raise ValueError(f"UFFDIO_COPY of {length} bytes at {addr:#x}: outside the registered range")
        with self._lock:
            if self._closed:
                raise OSError(errno.EBADF, "UFFDIO_COPY: the userfaultfd is closed")
            self._copying += 1
        try:
            self._copy(addr, length, skip_present)
        finally:
            with self._lock:
                self._copying -= 1
                last = self._closed and not self._copying
            if last:
                self._close_fd()

    def _copy(self, addr: int, length: int, skip_present: bool) -> None:
        args = (ctypes.c_int64 * 5)()
        done = stalled = 0
        most = SOURCE_BYTES
        while done < length:
            n = min(most, length - done)
            args[0], args[1], args[2], args[3], args[4] = addr + done, self._source, n, 0, 0
            failed = _ioctl(self._fd, _UFFDIO_COPY, args) != 0
            moved = max(0, int(args[4]))
            done += moved
            if not failed:
                most = SOURCE_BYTES
                continue
            err = ctypes.get_errno()
            if err == errno.ENOENT and not moved and n > _PAGE:
                # One call copies into one mapping: the range spans two where something of the
                # process advised part of it (an RDMA registration's MADV_DONTFORK, an mlock).
                # Halve the call until it ends before the boundary (a few calls per boundary).
                most = n // 2 // _PAGE * _PAGE or _PAGE
                continue
            if err == errno.EEXIST and skip_present:
                # The call stopped at a present page (after the pages it copied): step over it.
                done += 0 if moved else _PAGE
                continue
            # EAGAIN: the address space changed under the call (the part copied is counted); retry.
            stalled = 0 if moved else stalled + 1
            if err != errno.EAGAIN or stalled > 100:
                raise OSError(err, f"UFFDIO_COPY of {n - moved} bytes at {addr + done:#x}: {os.strerror(err)}")

    @property
    def copying(self) -> int:
        """``copy()`` calls in flight (any thread)."""
        return self._copying

    @property
    def fd(self) -> int:
        """The descriptor; -1 once closed (by ``close()``, or by the last copy in flight after it)."""
        return self._fd

    def close(self) -> None:
        """Close the userfaultfd once no copy is in flight; the registration ends with it."""
        with self._lock:
            self._closed = True
            now = not self._copying
        if now:
            self._close_fd()

    def _close_fd(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


_active: tuple[Userfault, ...] = ()
"""The registered ranges of the process (few: one per open tier), replaced whole under the lock."""
_active_lock = threading.Lock()


def activate(uf: Userfault) -> None:
    """Route ``aiokvtier._host._linux.populate()`` of ``uf``'s range through ``uf``."""
    global _active
    with _active_lock:
        _active = (*_active, uf)


def deactivate(uf: Userfault) -> None:
    global _active
    with _active_lock:
        _active = tuple(u for u in _active if u is not uf)


def registered() -> tuple[Userfault, ...]:
    """The userfaults ``populate()`` routes through now (one per open tier that fills by copies)."""
    return _active


def covering(addr: int, length: int) -> Userfault | None:
    """The userfault whose registered range holds ``[addr, addr + length)``, if any."""
    for uf in _active:
        if uf.start <= addr and addr + length <= uf.end:
            return uf
    return None


def _after_fork_in_child() -> None:
    # The child's mappings are not registered (no UFFD_FEATURE_EVENT_FORK): it fills by touching.
    global _active, _active_lock, _source_lock
    _active, _active_lock, _source_lock = (), threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
