"""Filling anonymous memory with ``UFFDIO_COPY``: populate's rate, a page fault's locking.

A fill can make pages resident three ways. ``MADV_POPULATE_WRITE`` runs the
kernel's own loop, but holds the address space's lock for reading through
each call, and a neighbour's ``mmap`` waits (milliseconds per call). A write
per page (``_linux.touch``) takes only the VMA's lock (Linux 6.4+), but pays
an exception per page: 0.64-0.75x populate per thread. ``UFFDIO_COPY`` fills
a whole range in one call under the VMA's lock (Linux 6.9+; older kernels
take the address space's lock for reading, as populate does): on the
development VM 1.04x populate at one thread and 1.41x at two, with a
neighbour's ``mmap`` at 0.05 ms p99 where populate's waited 15 ms
(``python benchmarks/fill_uffd.py``).

How: one userfaultfd per process, for user-mode faults only (allowed without
privileges since Linux 5.11), opened on first use and kept. A range is
registered for missing pages for the length of its fill, copied into from a
read-only source that maps the zero page, and unregistered. A thread that
faults in the range meanwhile waits until the copy reaches its page (the
copy wakes it), so nothing can hang on it; unregistering wakes any waiter
left. Where the architecture, the kernel or a seccomp filter refuses a
userfaultfd, or the kernel predates per-VMA locking of its operations
(:data:`PER_VMA_KERNEL`), :func:`fill_zeros` says so once and for all
(``False``) and the caller writes the pages itself.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import re
import threading

__all__ = ["SOURCE_BYTES", "fill_zeros", "refused"]

log = logging.getLogger("aiokvtier")

SOURCE_BYTES = 64 << 20
"""Bytes per ``UFFDIO_COPY`` call (the source's size): one GIL hand-off per 64 MiB."""

_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282, "ppc64le": 364}.get(platform.machine())
PER_VMA_KERNEL = (6, 9)
"""The first kernel whose userfaultfd operations take the VMA's lock: before it a copy holds the
address space's lock for reading, as populate does, and a neighbour's ``mmap`` would wait."""
_O_CLOEXEC, _O_NONBLOCK, _UFFD_USER_MODE_ONLY = 0o2000000, 0o4000, 1
_UFFD_API = 0xAA
_MODE_MISSING = 1
_PROT_READ, _MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x1, 0x02, 0x20, 0x4000
_MADV_POPULATE_READ = 22


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0xAA << 8) | nr


_UFFDIO_API = _ioc(3, 0x3F, 24)
_UFFDIO_REGISTER = _ioc(3, 0x00, 32)
_UFFDIO_UNREGISTER = _ioc(2, 0x01, 16)
_UFFDIO_COPY = _ioc(3, 0x03, 40)

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

_lock = threading.Lock()
_fd = -1
_source = 0
_refused: str | None = None


def _forget_in_child() -> None:
    """After fork: the inherited userfaultfd still speaks for the parent's address space (a
    range registered through it would be the parent's), so the child drops it and opens its own."""
    global _fd, _source, _refused, _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    if _fd >= 0:
        os.close(_fd)
    if _source:
        _munmap(_source, SOURCE_BYTES)
    _fd, _source, _refused = -1, 0, None


def kernel_version(release: str) -> tuple[int, int]:
    """``(major, minor)`` of a kernel release string (``"6.18.44-fc"``); ``(0, 0)`` where unreadable."""
    match = re.match(r"(\d+)\.(\d+)", release)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def refused() -> str | None:
    """Why this process fills by writing each page instead (None: ``UFFDIO_COPY`` is used, or not tried yet)."""
    return _refused


def _open() -> int:
    """The process's userfaultfd and zero source, made on first use; -1 where refused."""
    global _fd, _source, _refused
    with _lock:
        if _fd >= 0 or _refused is not None:
            return _fd
        if _SYS_USERFAULTFD is None:
            _refused = f"no userfaultfd system call known for {platform.machine()}"
            return -1
        release = kernel_version(platform.release())
        if release < PER_VMA_KERNEL:
            _refused = (
                f"kernel {platform.release()} copies under the address space's lock "
                f"(per-VMA from {'.'.join(map(str, PER_VMA_KERNEL))})"
            )
            return -1
        fd = int(_syscall(_SYS_USERFAULTFD, _O_CLOEXEC | _O_NONBLOCK | _UFFD_USER_MODE_ONLY))
        if fd < 0:
            _refused = f"userfaultfd: {os.strerror(ctypes.get_errno())}"
            return -1
        api = (ctypes.c_uint64 * 3)(_UFFD_API, 0, 0)
        source = _mmap(None, SOURCE_BYTES, _PROT_READ, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if _ioctl(fd, _UFFDIO_API, api) or source in (None, ctypes.c_void_p(-1).value):
            _refused = f"UFFDIO_API or the zero source: {os.strerror(ctypes.get_errno())}"
            os.close(fd)
            return -1
        _madvise(source, SOURCE_BYTES, _MADV_POPULATE_READ)  # the zero page, mapped now: copies never fault on it
        _fd, _source = fd, int(source)
        log.debug("aiokvtier: filling 4 KiB pages with UFFDIO_COPY")
        return _fd


def fill_zeros(addr: int, length: int) -> bool:
    """Make ``[addr, addr + length)`` resident and zero with ``UFFDIO_COPY``; GIL released per call.

    The range must be anonymous, writable, with no page resident yet, and
    not advised for huge pages (the copies place 4 KiB pages).

    :returns: False where this process cannot use a userfaultfd, or the kernel
        refuses to register this range: nothing was done, write the pages instead.
    :raises OSError: ENOMEM when memory ran out (the range is unregistered, part
        of it may be resident), or another error of the copy.
    """
    fd = _open()
    if fd < 0:
        return False
    register = (ctypes.c_uint64 * 4)(addr, length, _MODE_MISSING, 0)
    if _ioctl(fd, _UFFDIO_REGISTER, register):
        return False
    try:
        copy = (ctypes.c_int64 * 5)()
        done = 0
        while done < length:
            n = min(SOURCE_BYTES, length - done)
            copy[0], copy[1], copy[2], copy[3], copy[4] = addr + done, _source, n, 0, 0
            if _ioctl(fd, _UFFDIO_COPY, copy) == 0:
                done += n
                continue
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EINTR):  # stopped part way: resume where it stopped
                done += max(0, int(copy[4]))
            elif err == errno.EEXIST:  # a page already there (nothing to fill in it): step over it
                done += max(0, int(copy[4])) + os.sysconf("SC_PAGE_SIZE")
            else:
                raise OSError(err, f"UFFDIO_COPY: {os.strerror(err)}")
    finally:
        unregister = (ctypes.c_uint64 * 2)(addr, length)
        if _ioctl(fd, _UFFDIO_UNREGISTER, unregister):
            err = ctypes.get_errno()
            raise OSError(err, f"UFFDIO_UNREGISTER: {os.strerror(err)}")
    return True


os.register_at_fork(after_in_child=_forget_in_child)
