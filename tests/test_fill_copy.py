"""The fill copies its units in with ``UFFDIO_COPY`` where the kernel allows it (Linux 6.9+, 4 KiB pages).

Checked against the kernel, not against the library's word: ``mincore`` says
which pages are resident, a child process shows that a page past the
watermark raises SIGBUS, and a forked child shows that the parent's
userfaultfd cannot write into it. Where the kernel refuses, the fill touches
(tests/test_fill_population.py tests that path on every kernel).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import numpy as np
import pytest

from aiokvtier import FillError, HostTier
from aiokvtier._host import _headroom, _linux, _userfault
from aiokvtier._host._backing import HostBacking

from .helpers import MiB, small_config
from .invariants import check_tier, settle_earlier_owners

needs_copy = pytest.mark.skipif(
    not _userfault.supported(),
    reason=f"the fill copies only on Linux {_userfault.MIN_KERNEL[0]}.{_userfault.MIN_KERNEL[1]}+ (x86-64, arm64)",
)


@pytest.fixture(autouse=True)
def _earlier_owners_settled() -> None:
    """The tests here check the process's userfault registry: none is left by an earlier test's tier."""
    settle_earlier_owners()


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_pages(addr: int, length: int) -> int:
    """Pages of ``[addr, addr + length)`` the kernel reports resident (mincore)."""
    pages = length // _linux.PAGE_SIZE
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(addr, length, vec):
        raise OSError(ctypes.get_errno(), "mincore")
    return int(np.frombuffer(vec, dtype=np.uint8).astype(bool).sum())


@asynccontextmanager
async def touch_filled_tier(quota: int = 8 * MiB) -> AsyncIterator[HostTier]:
    """A tier opened where the copy fill was refused: it fills by touching, every page resident."""
    async with HostTier(small_config(quota=quota)) as tier:
        await tier.wait_resident()
        s = check_tier(tier, settled=True)
        assert s.fill_method == "touch"
        assert resident_pages(s.base_address, quota) == quota // _linux.PAGE_SIZE
        yield tier


@pytest.fixture
def no_touching(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Fails the test if the fill touches or populates a page; yields nothing to inspect."""
    calls: list[int] = []

    def refuse(addr: int, length: int, *args: object) -> None:
        calls.append(length)
        raise AssertionError("the fill touched or populated pages it should have copied in")

    monkeypatch.setattr(_linux, "touch", refuse)
    monkeypatch.setattr(_linux, "populate_write", refuse)
    yield calls
    assert not calls


@needs_copy
@pytest.mark.usefixtures("no_touching")
async def test_the_fill_copies_every_unit_in_and_the_pages_are_resident() -> None:
    before = _headroom.counters()
    async with HostTier(small_config(quota=48 * MiB, max_quota=128 * MiB, fill_threads=3)) as tier:
        await tier.wait_resident()
        s = check_tier(tier, settled=True)
        assert s.fill_method == "copy"
        after = _headroom.counters()
        assert after["copied_bytes"] - before["copied_bytes"] == s.resident_bytes
        assert after["touched_bytes"] == before["touched_bytes"]
        assert after["populated_bytes"] == before["populated_bytes"]
        assert resident_pages(s.base_address, s.resident_bytes) == s.resident_bytes // _linux.PAGE_SIZE
        assert resident_pages(s.base_address + s.resident_bytes, 16 * MiB) == 0
        slots = await tier.allocate(s.slots_total)
        view = np.frombuffer(tier.view(slots[-1]), dtype=np.uint8)
        assert not view.any()
        view[:] = 7
        assert np.frombuffer(tier.view(slots[-1]), dtype=np.uint8).min() == 7


@needs_copy
@pytest.mark.usefixtures("no_touching")
async def test_a_shrunk_unit_copied_in_again_reads_zeros() -> None:
    async with HostTier(small_config(quota=16 * MiB, max_quota=64 * MiB)) as tier:
        await tier.wait_resident()
        slots = await tier.allocate(tier.statistics().slots_total)
        for slot in slots:
            np.frombuffer(tier.view(slot), dtype=np.uint8)[:] = 0xAB
        tier.free_many(slots[len(slots) // 2 :])
        await tier.resize(8 * MiB)
        s = check_tier(tier, settled=True)
        assert resident_pages(s.base_address + 8 * MiB, 8 * MiB) == 0  # decommitted: missing again
        await tier.resize(32 * MiB)
        await tier.wait_resident()
        s = check_tier(tier, settled=True)
        assert resident_pages(s.base_address, 32 * MiB) == 32 * MiB // _linux.PAGE_SIZE
        memory = np.ctypeslib.as_array((ctypes.c_ubyte * (32 * MiB)).from_address(s.base_address))
        assert memory[: 8 * MiB].min() == 0xAB  # the kept half keeps its data
        assert not memory[8 * MiB :].any()


@needs_copy
@pytest.mark.parametrize("huge", [True, "auto"])
async def test_huge_pages_are_touched_not_copied(huge: bool | str) -> None:
    async with HostTier(small_config(quota=8 * MiB, commit_unit=2 * MiB, transparent_huge_pages=huge)) as tier:
        await tier.wait_resident()
        assert check_tier(tier, settled=True).fill_method == "touch"


async def test_a_refused_userfaultfd_leaves_the_fill_touching(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refused(*args: object) -> int:  # the userfaultfd syscall, as a seccomp filter answers it
        ctypes.set_errno(errno.EPERM)
        return -1

    monkeypatch.setattr(_userfault, "supported", lambda: True)
    monkeypatch.setattr(_userfault, "_syscall", refused)
    async with touch_filled_tier():
        pass
    assert not _userfault.registered()
    # A fallback: logged at WARNING, as the guide says fallbacks are.
    warned = [r for r in caplog.records if "userfaultfd refused" in r.getMessage()]
    assert [r.levelno for r in warned] == [logging.WARNING]


def test_kernels_before_6_9_do_not_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_userfault, "_kernel", lambda: (6, 8))
    assert not _userfault.supported()
    with pytest.raises(OSError) as info:
        _userfault.Userfault(0, 4096)
    assert info.value.errno == errno.ENOSYS
    monkeypatch.setattr(_userfault, "_kernel", lambda: (6, 9))
    assert _userfault.supported() == (_userfault._SYS_USERFAULTFD is not None)


@needs_copy
async def test_enomem_from_a_copy_is_a_partial_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _userfault._ioctl
    copied = [0]
    lock = threading.Lock()

    def run_out(fd: int, request: int, args: ctypes.Array[ctypes.c_int64]) -> int:
        if request == _userfault._UFFDIO_COPY:
            with lock:
                copied[0] += int(args[2])
                if copied[0] > 5 * MiB:  # memory runs out in the sixth 1 MiB unit
                    args[4] = -errno.ENOMEM
                    ctypes.set_errno(errno.ENOMEM)
                    return -1
        return int(real(fd, request, args))

    monkeypatch.setattr(_userfault, "_ioctl", run_out)
    async with HostTier(small_config(quota=16 * MiB)) as tier:
        with pytest.raises(FillError) as info:
            await tier.wait_resident()
        assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOMEM
        s = check_tier(tier)
        assert s.resident_bytes == 5 * MiB == info.value.resident_bytes
        assert resident_pages(s.base_address, 16 * MiB) == 5 * MiB // _linux.PAGE_SIZE  # the failed unit discarded
        monkeypatch.setattr(_userfault, "_ioctl", real)
        await tier.resize(5 * MiB)  # the shrink to the prefix clears the failure, a grow copies again
        await tier.resize(16 * MiB)
        await tier.wait_resident()
        check_tier(tier, settled=True)


def _child(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60, check=False
    )


@needs_copy
def test_a_page_past_the_watermark_raises_sigbus_instead_of_allocating() -> None:
    done = _child(
        """
        import ctypes
        from aiokvtier._host._backing import HostBacking
        b = HostBacking(64 << 20, node=None, strict_numa=False, huge_pages=False)
        assert b.fill_method == "copy"
        b.expose(8 << 20)
        b.commit(0, 4 << 20)
        ctypes.memset(b.base, 1, 4 << 20)  # a committed unit takes writes
        print("committed ok", flush=True)
        ctypes.memset(b.base + (4 << 20), 1, 1)  # exposed, never committed
        print("wrote past the watermark", flush=True)
        """
    )
    assert "committed ok" in done.stdout, done.stderr
    assert "wrote past" not in done.stdout
    assert done.returncode == -signal.SIGBUS, (done.returncode, done.stderr)


@needs_copy
def test_a_forked_child_cannot_copy_into_its_parent() -> None:
    done = _child(
        """
        import ctypes, errno, os
        from aiokvtier._host import _linux, _userfault
        from aiokvtier._host._backing import HostBacking
        b = HostBacking(16 << 20, node=None, strict_numa=False, huge_pages=False)
        b.expose(16 << 20)
        uf = _userfault.covering(b.base, b.size)
        pid = os.fork()
        if pid == 0:
            try:
                uf.copy(b.base, 1 << 20)
            except OSError as exc:
                ok = exc.errno == errno.EBADF
            else:
                ok = False
            ok = ok and _userfault.covering(b.base, 1 << 20) is None
            _linux.populate(b.base, 1 << 20)  # the child's mapping is not registered: it touches
            ctypes.memset(b.base, 5, 1 << 20)
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        vec = (ctypes.c_ubyte * 256)()
        ctypes.CDLL(None).mincore(ctypes.c_void_p(b.base), ctypes.c_size_t(1 << 20), vec)
        assert not any(vec), "the child's writes reached the parent"
        b.commit(0, 16 << 20)  # the parent still copies
        print("parent ok", flush=True)
        """
    )
    assert done.returncode == 0 and "parent ok" in done.stdout, (done.returncode, done.stderr)


@needs_copy
def test_copies_outside_the_range_or_after_close_are_refused() -> None:
    b = HostBacking(8 * MiB, node=None, strict_numa=False, huge_pages=False)
    try:
        uf = _userfault.covering(b.base, b.size)
        assert uf is not None
        with pytest.raises(ValueError, match="outside the registered range"):
            uf.copy(b.base + 4 * MiB, 8 * MiB)
        b.expose(8 * MiB)
        b.commit(0, 1 * MiB)
        with pytest.raises(OSError) as info:
            uf.copy(b.base, 4096)  # present already
        assert info.value.errno == errno.EEXIST
    finally:
        b.release([])
    assert not _userfault.registered()
    with pytest.raises(OSError) as info:
        uf.copy(b.base, 4096)
    assert info.value.errno == errno.EBADF


@needs_copy
def test_close_waits_for_the_copies_in_flight() -> None:
    """A close while threads copy: each copy finishes or is refused whole; the descriptor closes once."""
    b = HostBacking(512 * MiB, node=None, strict_numa=False, huge_pages=False)
    uf = _userfault.covering(b.base, b.size)
    assert uf is not None
    b.expose(512 * MiB)
    results: list[BaseException | None] = []
    start = threading.Barrier(5)

    def copy(i: int) -> None:
        start.wait()
        try:
            uf.copy(b.base + i * 128 * MiB, 128 * MiB)
            results.append(None)
        except OSError as exc:
            results.append(exc)

    threads = [threading.Thread(target=copy, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    start.wait()
    uf.close()
    for t in threads:
        t.join()
    assert all(r is None or r.errno == errno.EBADF for r in results), results
    done = sum(r is None for r in results)
    assert resident_pages(b.base, 512 * MiB) == done * 128 * MiB // _linux.PAGE_SIZE
    assert uf.fd == -1
    b.release([])
