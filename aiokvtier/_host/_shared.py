"""Host memory that other processes can map: a memfd, mapped MAP_SHARED, filled unit by unit.

The backing of a pool's tier (``aiokvtier._pool``). The owner reserves the
range as a memfd of ``max_quota`` bytes (a size costs nothing until pages
are allocated), maps it shared at a huge-page-aligned address and makes
it resident per commit unit, as the host backing does; an attached process
receives the file descriptor over the pool's socket and maps the same
pages (``map_shared``). A decommit punches the unit out of the file, so
the pages go back to the system for every process at once (``MADV_DONTNEED``
on a shared mapping would only drop this process's page table entries).

The NUMA policy set with ``mbind`` on a shared mapping of shmem is the
file's own (the kernel keeps it with the inode), so pages land on the
owner's node whichever process touches them first.

An attached mapping keeps the memfd alive on its own: when the owner dies
the client's addresses stay valid memory until the client unmaps them.
"""

from __future__ import annotations

import ctypes
import errno
import os

from . import _linux
from ._backing import HUGE_ALIGN, Backing, apply_numa_policy

__all__ = ["SharedBacking", "map_shared", "unmap_shared"]

PROT_READ = 0x1
PROT_WRITE = 0x2
MAP_SHARED = 0x01
MAP_FIXED = 0x10
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_fallocate = _libc.fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_shared(fd: int, size: int) -> int:
    """Map ``size`` bytes of ``fd`` read-write and shared, at a huge-page-aligned address.

    The address range is reserved first (``mmap_reserve``) and the file
    mapped over it with MAP_FIXED, so the alignment costs no extra mapping.

    :returns: the base address.
    :raises OSError: the kernel refused the mapping.
    """
    base, _ = _linux.mmap_reserve(size, HUGE_ALIGN)
    raw = _mmap(base, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0)
    if raw is None or raw == _MAP_FAILED:
        err = ctypes.get_errno()
        _linux.munmap(base, size)
        raise OSError(err, f"mmap of the shared tier ({size} bytes): {os.strerror(err)}")
    return base


def unmap_shared(base: int, size: int) -> None:
    _linux.munmap(base, size)


class SharedBacking(Backing):
    """A memfd of the reservation's size, mapped shared; units populated, punched out on decommit.

    ``fd`` is what an attached process maps (it stays open until ``release``).
    Transparent huge pages follow the shmem setting
    (``/sys/kernel/mm/transparent_hugepage/shmem_enabled``); ``True`` advises
    them, ``"auto"`` is taken as off here.
    """

    name = "shared"

    def __init__(self, size: int, *, node: int | None, strict_numa: bool, huge_pages: bool) -> None:
        self.size = size
        self.fd = os.memfd_create("aiokvtier-pool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.base = map_shared(self.fd, size)
            try:
                advice = _linux.MADV_HUGEPAGE if huge_pages else _linux.MADV_NOHUGEPAGE
                try:
                    _linux.madvise(self.base, size, advice)
                except OSError as exc:
                    if huge_pages or exc.errno != errno.EINVAL:
                        raise
                self.numa_policy, self.numa_warning = apply_numa_policy(self.base, size, node, strict_numa)
            except BaseException:
                _linux.munmap(self.base, size)
                raise
        except BaseException:
            os.close(self.fd)
            raise

    def commit(self, offset: int, length: int) -> None:
        try:
            # Reports ENOMEM where memory is short (a touch would end in SIGBUS on shmem).
            _linux.populate_write(self.base + offset, length)
        except BaseException:
            self._punch(offset, length)
            raise

    def decommit(self, offset: int, length: int) -> None:
        self._punch(offset, length)

    def _punch(self, offset: int, length: int) -> None:
        if _fallocate(self.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"fallocate(PUNCH_HOLE) of the shared tier: {os.strerror(err)}")

    def release(self, committed: list[tuple[int, int]]) -> None:
        try:
            _linux.munmap(self.base, self.size)
        finally:
            os.close(self.fd)
