"""Adversarial checks of the fill by ``UFFDIO_COPY``: cancellation, races, faults, hostile use.

Every test that opens a tier ends with no library thread, no mapping of its
reservation, no userfaultfd left registered (``_userfault._active``) and no
descriptor left open (``/proc/self/fd`` before and after). The kernel is the
judge where it can be: ``mincore`` for residency, child processes for the
signals.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from aiokvtier import HostTier
from aiokvtier._host import _linux, _userfault
from aiokvtier._host._backing import HostBacking

from .helpers import MiB, small_config
from .invariants import check_tier, wait_no_library_threads
from .test_fill_copy import resident_pages

needs_copy = pytest.mark.skipif(
    not _userfault.supported(),
    reason=f"the fill copies only on Linux {_userfault.MIN_KERNEL[0]}.{_userfault.MIN_KERNEL[1]}+ (x86-64, arm64)",
)
pytestmark = needs_copy

ROOT = Path(__file__).resolve().parents[1]
Ioctl = Callable[[int, int, "ctypes.Array[ctypes.c_int64]"], int]


def open_fds() -> set[str]:
    """Targets of the process's open descriptors (the listing's own descriptor left out)."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{name}->{os.readlink(f'/proc/self/fd/{name}')}")
        except FileNotFoundError:
            pass  # the listing's own descriptor, closed since
    return out


def userfaultfds() -> list[str]:
    return [fd for fd in open_fds() if "userfaultfd" in fd]


async def userfaultfds_async() -> list[str]:
    return await asyncio.to_thread(userfaultfds)


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Nothing of the test's tiers outlives it: reservations, userfaultfds, registry entries.

    Reservations are checked by call (each one unmapped whole), not in ``/proc/self/maps``:
    an address given back is soon another mapping's (a malloc arena's, say)."""
    reservations: list[tuple[int, int]] = []
    unmapped: list[tuple[int, int]] = []
    real_reserve, real_munmap = _linux.mmap_reserve, _linux.munmap

    def reserve(length: int, align: int) -> tuple[int, int]:
        base, size = real_reserve(length, align)
        reservations.append((base, size))
        return base, size

    def munmap(addr: int, length: int) -> None:
        real_munmap(addr, length)
        unmapped.append((addr, length))

    monkeypatch.setattr(_linux, "mmap_reserve", reserve)
    monkeypatch.setattr(_linux, "munmap", munmap)
    before = userfaultfds()
    yield
    assert not _userfault._active, _userfault._active
    assert userfaultfds() == before, "a userfaultfd leaked"
    left = [r for r in reservations if r not in unmapped]
    assert not left, f"reservations never unmapped: {left}"


def slow_ioctl(monkeypatch: pytest.MonkeyPatch, seconds: float = 0.002) -> None:
    """Every UFFDIO_COPY call takes ``seconds`` longer: a fill lasts long enough to be cut anywhere."""
    real: Ioctl = _userfault._ioctl

    def slow(fd: int, request: int, args: ctypes.Array[ctypes.c_int64]) -> int:
        if request == _userfault._UFFDIO_COPY:
            time.sleep(seconds)
        return int(real(fd, request, args))

    monkeypatch.setattr(_userfault, "_ioctl", slow)


def memory(base: int, length: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_ubyte * length).from_address(base))


async def settled_and_resident(tier: HostTier) -> None:
    """The invariants, and ``mincore`` agreeing with ``statistics()`` over the whole reservation."""
    s = check_tier(tier)
    assert s.fill_method == "copy"
    page = _linux.PAGE_SIZE
    assert resident_pages(s.base_address, s.resident_bytes) == s.resident_bytes // page
    assert resident_pages(s.base_address + s.target_bytes, s.max_quota - s.target_bytes) == 0


def _source_smaps() -> tuple[set[str], int]:
    """VmFlags and resident kB of the zero source copies come from."""
    source = _userfault._zeros()
    flags: set[str] = set()
    rss, inside = -1, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == source
            elif inside and line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif inside and line.startswith("VmFlags:"):
                flags = set(line.split()[1:])
    return flags, rss


def test_the_zero_source_costs_no_memory_and_never_takes_huge_pages() -> None:
    """Read faults on a THP-eligible mapping allocate real huge pages where the huge zero page is off
    (``use_zero_page=0`` with THP ``always``): the source must be advised NOHUGEPAGE."""
    b = HostBacking(64 * MiB, node=None, strict_numa=False, huge_pages=False)
    try:
        b.expose(64 * MiB)
        b.commit(0, 64 * MiB)
        flags, rss = _source_smaps()
        assert "nh" in flags, f"the zero source may take huge pages: VmFlags {sorted(flags)}"
        assert "wr" not in flags
        assert rss == 0, f"the zero source holds {rss} kB"
    finally:
        b.release([])


_MADV_DONTFORK, _MADV_DOFORK = 10, 11
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


@pytest.mark.parametrize("cut", [4096, 512 * 1024, MiB - 4096, 3 * MiB + 8192])
def test_a_unit_split_into_several_mappings_is_still_copied_in(cut: int) -> None:
    """Anything of the process that advises part of a range (an RDMA registration's MADV_DONTFORK,
    an mlock, a madvise) splits its mapping, and the kernel copies within one mapping per call
    (ENOENT across two): the unit is copied in mapping by mapping, as touching would have filled it."""
    b = HostBacking(8 * MiB, node=None, strict_numa=False, huge_pages=False)
    try:
        b.expose(8 * MiB)
        assert _libc.madvise(b.base + cut, 8192, _MADV_DONTFORK) == 0  # three mappings now
        b.commit(0, 4 * MiB)
        b.commit(4 * MiB, 4 * MiB)
        assert resident_pages(b.base, 8 * MiB) == 8 * MiB // _linux.PAGE_SIZE
        assert not memory(b.base, 8 * MiB).any()
    finally:
        b.release([])


def test_a_copy_outside_any_registered_mapping_still_fails_with_enoent() -> None:
    b = HostBacking(8 * MiB, node=None, strict_numa=False, huge_pages=False)
    uf = b._userfault
    assert uf is not None
    try:
        b.expose(8 * MiB)
        _linux.munmap(b.base + 6 * MiB, 2 * MiB)  # gone: no mapping to copy into
        with pytest.raises(OSError) as info:
            uf.copy(b.base + 4 * MiB, 4 * MiB)
        assert info.value.errno == errno.ENOENT
    finally:
        b.release([])


@pytest.mark.usefixtures("clean")
@pytest.mark.parametrize("where", ["activate", "lock"])
async def test_memory_error_while_registering_leaks_no_descriptor(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    def no_memory(*args: object) -> None:
        raise MemoryError

    if where == "activate":
        monkeypatch.setattr(_userfault, "activate", no_memory)
    else:  # the userfault's lock cannot be made
        monkeypatch.setattr(_userfault, "threading", types.SimpleNamespace(Lock=no_memory))
    tier = HostTier(small_config(quota=4 * MiB))
    with pytest.raises(MemoryError):
        await tier.__aenter__()
    assert not await userfaultfds_async(), "the userfaultfd was left open"
    await wait_no_library_threads()
