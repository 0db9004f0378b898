"""Adversarial checks of the fill by ``UFFDIO_COPY``: cancellation, races, faults, hostile use.

Every test that opens a tier ends with no library thread, no mapping of its
reservation, no userfaultfd left registered (``_userfault.registered()``) and no
descriptor left open (``/proc/self/fd`` before and after). The kernel is the
judge where it can be: ``mincore`` for residency, child processes for the
signals.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from aiokvtier import FillError, HostTier, QuotaError, StaticHostMem, TierClosedError
from aiokvtier._host import _linux, _userfault
from aiokvtier._host._backing import HostBacking

from .helpers import MiB, small_config, state_of
from .invariants import check_tier, settle_earlier_owners, wait_no_library_threads
from .test_fill_copy import resident_pages, touch_filled_tier

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
    settle_earlier_owners()  # an earlier test's tier may still be giving its range back: not this test's
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
    assert not _userfault.registered(), _userfault.registered()
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


# -- cancellation at every await of a copy fill ------------------------------------------------


@pytest.mark.usefixtures("clean")
async def test_timeouts_swept_over_open_fill_and_close(monkeypatch: pytest.MonkeyPatch) -> None:
    slow_ioctl(monkeypatch)
    config = small_config(quota=16 * MiB, max_quota=64 * MiB, fill_threads=3)
    for delay in (0.0, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.03):
        tier = HostTier(config)
        try:
            async with asyncio.timeout(delay):
                await tier.__aenter__()
                await tier.wait_resident()
        except TimeoutError:
            pass
        if state_of(tier) == "open":
            await settled_and_resident(tier)
        try:
            async with asyncio.timeout(delay / 2):
                await tier.aclose()  # the teardown runs to the end whatever the timeout says
        except TimeoutError:
            pass
        await tier.aclose()
        assert tier.released or state_of(tier) == "closed"
        assert not _userfault.registered(), f"still registered after a close at {delay} s"
    await wait_no_library_threads()


@pytest.mark.usefixtures("clean")
async def test_timeouts_swept_over_resizes_keep_the_copies_consistent(monkeypatch: pytest.MonkeyPatch) -> None:
    slow_ioctl(monkeypatch)
    config = small_config(quota=16 * MiB, max_quota=64 * MiB, fill_threads=3)
    async with HostTier(config) as tier:
        for delay in (0.0, 0.001, 0.003, 0.006, 0.012, 0.025):
            for size in (64 * MiB, 8 * MiB, 40 * MiB, 4 * MiB, 64 * MiB):
                try:
                    async with asyncio.timeout(delay):
                        await tier.resize(size)
                        await tier.wait_resident()
                except TimeoutError:
                    pass
                check_tier(tier)
        await tier.resize(24 * MiB)
        await tier.wait_resident()
        await settled_and_resident(tier)
        s = check_tier(tier, settled=True)
        # Every resident page below the target reads zero: nothing was written, and a unit
        # decommitted and copied in again comes back zeroed.
        assert not memory(s.base_address, s.resident_bytes).any()
    await wait_no_library_threads()


@pytest.mark.usefixtures("clean")
async def test_task_cancel_at_every_step_of_open_fill_resize_close(monkeypatch: pytest.MonkeyPatch) -> None:
    slow_ioctl(monkeypatch, 0.001)
    config = small_config(quota=16 * MiB, max_quota=64 * MiB, fill_threads=2)
    for n in range(0, 60, 4):
        holder: list[HostTier] = []

        async def run(holder: list[HostTier]) -> None:
            tier = HostTier(config)
            holder.append(tier)
            async with tier:
                await tier.wait_resident(2 * MiB)
                await tier.resize(48 * MiB)
                await tier.resize(8 * MiB)
                await tier.resize(32 * MiB)
                await tier.wait_resident()

        task = asyncio.create_task(run(holder))
        for _ in range(n):
            await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        for tier in holder:
            await tier.aclose()
        assert not _userfault.registered(), f"still registered after a cancel at step {n}"
    await wait_no_library_threads()


@pytest.mark.usefixtures("clean")
async def test_a_failing_task_group_sibling_cancels_a_copy_fill(monkeypatch: pytest.MonkeyPatch) -> None:
    slow_ioctl(monkeypatch)
    for delay in (0.0, 0.002, 0.01):

        async def fill() -> None:
            async with HostTier(small_config(quota=32 * MiB, max_quota=64 * MiB, fill_threads=3)) as tier:
                await tier.wait_resident()
                await tier.resize(64 * MiB)
                await tier.wait_resident()

        async def fail(delay: float = delay) -> None:
            await asyncio.sleep(delay)
            raise KeyError("sibling")

        with pytest.raises(ExceptionGroup) as info:
            async with asyncio.TaskGroup() as group:
                group.create_task(fill())
                group.create_task(fail())
        assert info.group_contains(KeyError)
        assert not _userfault.registered()
    await wait_no_library_threads()


# -- races between close, resize and a fill in flight -------------------------------------------


@pytest.mark.usefixtures("clean")
async def test_shrink_while_units_copy_then_grow_reads_zeros_and_keeps_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow_ioctl(monkeypatch, 0.003)
    async with HostTier(small_config(quota=8 * MiB, max_quota=64 * MiB, fill_threads=3)) as tier:
        await tier.wait_resident()
        slots = await tier.allocate(tier.statistics().slots_total)
        for slot in slots:
            np.frombuffer(tier.view(slot), dtype=np.uint8)[:] = 0x5A
        tier.free_many(slots[64:])  # keep 4 MiB of data
        await tier.resize(64 * MiB)  # units copy in from 8 MiB on ...
        await asyncio.sleep(0.005)
        await tier.resize(4 * MiB)  # ... and the shrink cuts them off while they do
        s = check_tier(tier, settled=True)
        assert resident_pages(s.base_address + 4 * MiB, 60 * MiB) == 0
        await tier.resize(64 * MiB)
        await tier.wait_resident()
        s = check_tier(tier, settled=True)
        await settled_and_resident(tier)
        data = memory(s.base_address, 64 * MiB)
        assert data[: 4 * MiB].min() == 0x5A, "the kept slots lost their data"
        assert not data[4 * MiB :].any(), "a unit copied in again does not read zeros"
    await wait_no_library_threads()


@pytest.mark.usefixtures("clean")
async def test_close_racing_a_grow_and_copies_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    slow_ioctl(monkeypatch, 0.002)
    config = small_config(quota=4 * MiB, max_quota=64 * MiB, fill_threads=4)
    for delay in (0.0, 0.001, 0.004, 0.01):
        tier = await HostTier.open(config)
        grow = asyncio.create_task(tier.resize(64 * MiB))
        waiter = asyncio.create_task(tier.wait_resident())
        await asyncio.sleep(delay)
        await tier.aclose()
        for task in (grow, waiter):
            try:
                await task
            except TierClosedError:
                pass
        assert not _userfault.registered()
    await wait_no_library_threads()


# -- faults from the kernel ----------------------------------------------------------------------


def failing_ioctl(monkeypatch: pytest.MonkeyPatch, err: int, after: int, progress: int = 0) -> list[int]:
    """UFFDIO_COPY calls after the first ``after`` bytes fail with ``err``, having copied ``progress``."""
    real: Ioctl = _userfault._ioctl
    copied, calls = [0], [0]
    lock = threading.Lock()

    def ioctl(fd: int, request: int, args: ctypes.Array[ctypes.c_int64]) -> int:
        if request == _userfault._UFFDIO_COPY:
            with lock:
                calls[0] += 1
                fail = copied[0] + int(args[2]) > after
                if not fail:
                    copied[0] += int(args[2])
            if fail:
                if progress:
                    done = args[2]
                    args[2] = progress
                    rc = int(real(fd, request, args))
                    args[2] = done
                    assert rc == 0
                    args[4] = progress
                else:
                    args[4] = -err
                ctypes.set_errno(err)
                return -1
        return int(real(fd, request, args))

    monkeypatch.setattr(_userfault, "_ioctl", ioctl)
    return calls


@pytest.mark.usefixtures("clean")
@pytest.mark.parametrize("err", [errno.EFAULT, errno.ENOENT, errno.EAGAIN])
async def test_a_copy_error_fails_the_fill_partially(monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    calls = failing_ioctl(monkeypatch, err, after=3 * MiB)
    async with HostTier(small_config(quota=8 * MiB)) as tier:
        with pytest.raises(FillError) as info:
            async with asyncio.timeout(10):
                await tier.wait_resident()
        cause = info.value.__cause__
        assert isinstance(cause, OSError) and cause.errno == err, cause
        s = check_tier(tier)
        assert s.resident_bytes == 3 * MiB
        assert resident_pages(s.base_address, 8 * MiB) == 3 * MiB // _linux.PAGE_SIZE
        if err == errno.EAGAIN:
            assert 1 < calls[0] - 3 < 200, f"EAGAIN without progress retried {calls[0] - 3} times"
    await wait_no_library_threads()


@pytest.mark.usefixtures("clean")
async def test_eagain_with_progress_each_time_goes_on_to_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel copies part and answers EAGAIN (the address space changed): the copy resumes."""
    real: Ioctl = _userfault._ioctl

    def partial(fd: int, request: int, args: ctypes.Array[ctypes.c_int64]) -> int:
        if request != _userfault._UFFDIO_COPY or args[2] <= 64 * 1024:
            return int(real(fd, request, args))
        whole = args[2]
        args[2] = 64 * 1024
        rc = int(real(fd, request, args))
        args[2] = whole
        assert rc == 0 and args[4] == 64 * 1024
        ctypes.set_errno(errno.EAGAIN)
        return -1

    monkeypatch.setattr(_userfault, "_ioctl", partial)
    async with HostTier(small_config(quota=4 * MiB, fill_threads=2)) as tier:
        async with asyncio.timeout(10):
            await tier.wait_resident()
        await settled_and_resident(tier)
    await wait_no_library_threads()


@pytest.mark.usefixtures("clean")
async def test_enomem_after_progress_keeps_nothing_of_the_failed_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    failing_ioctl(monkeypatch, errno.ENOMEM, after=2 * MiB, progress=256 * 1024)
    async with HostTier(small_config(quota=8 * MiB)) as tier:
        with pytest.raises(FillError):
            await tier.wait_resident()
        s = check_tier(tier)
        assert s.resident_bytes == 2 * MiB
        assert resident_pages(s.base_address, 8 * MiB) == 2 * MiB // _linux.PAGE_SIZE
    await wait_no_library_threads()


@pytest.mark.usefixtures("clean")
async def test_memory_error_in_the_middle_of_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    real: Ioctl = _userfault._ioctl
    count = [0]

    def ioctl(fd: int, request: int, args: ctypes.Array[ctypes.c_int64]) -> int:
        if request == _userfault._UFFDIO_COPY:
            count[0] += 1
            if count[0] == 3:
                raise MemoryError
        return int(real(fd, request, args))

    monkeypatch.setattr(_userfault, "_ioctl", ioctl)
    async with HostTier(small_config(quota=8 * MiB)) as tier:
        with pytest.raises(FillError) as info:
            await tier.wait_resident()
        assert isinstance(info.value.__cause__, MemoryError)
        uf = _userfault.covering(tier.base_address, 1)
        assert uf is not None and uf.copying == 0
        await tier.resize(2 * MiB)
        monkeypatch.setattr(_userfault, "_ioctl", real)
        await tier.resize(8 * MiB)
        await tier.wait_resident()
        await settled_and_resident(tier)
    await wait_no_library_threads()


@pytest.mark.usefixtures("clean")
@pytest.mark.parametrize("err", [errno.EPERM, errno.ENOSYS, errno.EINVAL])
async def test_a_refused_userfaultfd_syscall_falls_back_to_touching(monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    def refuse(*args: object) -> int:
        ctypes.set_errno(err)
        return -1

    monkeypatch.setattr(_userfault, "_syscall", refuse)
    async with touch_filled_tier():
        assert not _userfault.registered()
    await wait_no_library_threads()


@pytest.mark.usefixtures("clean")
@pytest.mark.parametrize("stage", ["api", "register", "no-copy", "zeros"])
async def test_a_failed_registration_closes_its_fd_and_touches(monkeypatch: pytest.MonkeyPatch, stage: str) -> None:
    real: Ioctl = _userfault._ioctl
    opened: list[int] = []
    real_syscall = _userfault._syscall

    def syscall(*args: object) -> int:
        fd = int(real_syscall(*args))
        opened.append(fd)
        return fd

    def ioctl(fd: int, request: int, args: ctypes.Array[ctypes.c_uint64]) -> int:
        if stage == "api" and request == _userfault._UFFDIO_API:
            ctypes.set_errno(errno.EINVAL)
            return -1
        if stage == "register" and request == _userfault._UFFDIO_REGISTER:
            ctypes.set_errno(errno.EPERM)
            return -1
        rc = int(real(fd, request, args))
        if stage == "no-copy" and request == _userfault._UFFDIO_REGISTER:
            args[3] &= ~_userfault._COPY_BIT
        return rc

    def no_zeros() -> int:
        raise OSError(errno.ENOMEM, "mmap of the zero source: Cannot allocate memory")

    monkeypatch.setattr(_userfault, "_syscall", syscall)
    monkeypatch.setattr(_userfault, "_ioctl", ioctl)
    if stage == "zeros":
        monkeypatch.setattr(_userfault, "_zeros", no_zeros)
    async with touch_filled_tier():
        assert opened and opened[0] >= 0
        assert not await userfaultfds_async(), "the refused userfaultfd was left open"
    await wait_no_library_threads()


@pytest.mark.usefixtures("clean", "fill_threads_cannot_start")
async def test_no_fill_thread_can_start() -> None:
    tier = HostTier(small_config(quota=4 * MiB))
    with pytest.raises(FillError):
        await tier.__aenter__()
    assert tier.released
    await wait_no_library_threads()


# -- hostile use --------------------------------------------------------------------------------


@pytest.mark.usefixtures("clean")
async def test_several_tiers_route_each_range_to_its_own_userfaultfd(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int, int]] = []
    real: Ioctl = _userfault._ioctl

    def spy(fd: int, request: int, args: ctypes.Array[ctypes.c_int64]) -> int:
        result = int(real(fd, request, args))
        if request == _userfault._UFFDIO_COPY:
            seen.append((fd, int(args[0]), max(0, int(args[4]))))  # descriptor, address, bytes copied
        return result

    monkeypatch.setattr(_userfault, "_ioctl", spy)
    config = small_config(quota=16 * MiB, max_quota=32 * MiB, fill_threads=2)
    async with HostTier(config) as a, HostTier(config) as b, HostTier(config) as c:
        tiers = (a, b, c)
        assert len(_userfault.registered()) == 3
        assert len(await userfaultfds_async()) >= 3
        await asyncio.gather(*(t.resize(32 * MiB) for t in tiers))
        await asyncio.gather(*(t.wait_resident() for t in tiers))
        for t in tiers:
            await settled_and_resident(t)
        userfaults = {t: _userfault.covering(t.base_address, 1) for t in tiers}
        owners = {uf.fd: t for t, uf in userfaults.items() if uf is not None}
        assert len(owners) == 3
        for fd, addr, length in seen:
            tier = owners[fd]
            base = tier.statistics().base_address
            assert base <= addr and addr + length <= base + 32 * MiB
        assert sum(length for *_, length in seen) == 3 * 32 * MiB
        await b.aclose()  # one closes: the others go on copying through their own
        assert len(_userfault.registered()) == 2
        await a.resize(8 * MiB)
        await a.resize(32 * MiB)
        await c.resize(4 * MiB)
        await c.resize(32 * MiB)
        await asyncio.gather(a.wait_resident(), c.wait_resident())
        await settled_and_resident(a)
        await settled_and_resident(c)
    await wait_no_library_threads()


async def test_unregistered_memory_is_touched_beside_an_open_tier() -> None:
    async with HostTier(small_config(quota=8 * MiB)) as tier, StaticHostMem(8 * MiB) as buf:
        await tier.wait_resident()
        assert _userfault.covering(buf.address, 8 * MiB) is None
        assert resident_pages(buf.address, 8 * MiB) == 8 * MiB // _linux.PAGE_SIZE
        base, length = _linux.mmap_reserve(4 * MiB, 2 * MiB)
        try:
            _linux.mprotect(base, length, writable=True)
            _linux.populate(base, length)
            assert resident_pages(base, length) == length // _linux.PAGE_SIZE
        finally:
            _linux.munmap(base, length)


def test_a_closed_userfaultfd_never_reaches_a_reused_descriptor() -> None:
    b = HostBacking(8 * MiB, node=None, strict_numa=False, huge_pages=False)
    uf = _userfault.covering(b.base, b.size)
    assert uf is not None
    fd = uf.fd
    b.release([])
    r, w = os.pipe()  # the lowest free numbers: the userfaultfd's, most likely
    try:
        calls: list[int] = []
        real: Ioctl = _userfault._ioctl
        _userfault._ioctl = lambda fd, request, args: calls.append(fd) or int(real(fd, request, args))
        try:
            with pytest.raises(OSError) as info:
                uf.copy(b.base, 4096)
        finally:
            _userfault._ioctl = real
        assert info.value.errno == errno.EBADF
        assert not calls, f"an ioctl reached descriptor {calls} (the userfaultfd was {fd})"
        os.write(w, b"x")
        assert os.read(r, 1) == b"x"
    finally:
        os.close(r)
        os.close(w)


def test_release_and_close_are_safe_to_repeat() -> None:
    b = HostBacking(4 * MiB, node=None, strict_numa=False, huge_pages=False)
    uf = _userfault.covering(b.base, b.size)
    assert uf is not None
    b.release([])
    uf.close()
    uf.close()
    _userfault.deactivate(uf)
    assert not _userfault.registered()


def test_kernel_mode_access_to_a_missing_page_fails_with_efault() -> None:
    """A read(2)/write(2) whose buffer is a page not copied in yet: EFAULT at once, no hang, no signal."""
    b = HostBacking(8 * MiB, node=None, strict_numa=False, huge_pages=False)
    r, w = os.pipe()
    try:
        b.expose(8 * MiB)
        b.commit(0, 1 * MiB)
        missing = memoryview((ctypes.c_ubyte * 4096).from_address(b.base + 4 * MiB)).cast("B")
        os.write(w, b"abc")
        with pytest.raises(OSError) as info:
            os.readv(r, [missing])
        assert info.value.errno == errno.EFAULT
        with pytest.raises(OSError) as info:
            os.write(w, missing)
        assert info.value.errno == errno.EFAULT
        present = memoryview((ctypes.c_ubyte * 4096).from_address(b.base)).cast("B")
        assert os.readv(r, [present]) == 3
        assert bytes(present[:3]) == b"abc"
        assert resident_pages(b.base + 4 * MiB, 4096) == 0, "the kernel's access allocated the page"
    finally:
        os.close(r)
        os.close(w)
        b.release([])


def _child(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )


@pytest.mark.parametrize("access", ["read", "write", "read-after-shrink", "read-past-target"])
def test_sigbus_guard(access: str) -> None:
    done = _child(
        f"""
        import ctypes
        from aiokvtier._host._backing import HostBacking
        b = HostBacking(64 << 20, node=None, strict_numa=False, huge_pages=False)
        b.expose(16 << 20)
        b.commit(0, 8 << 20)
        access = {access!r}
        if access == "read-after-shrink":
            b.decommit(4 << 20, 4 << 20)
        print("ok so far", flush=True)
        if access == "write":
            ctypes.memset(b.base + (8 << 20), 1, 1)
        elif access == "read":
            ctypes.c_ubyte.from_address(b.base + (12 << 20)).value
        elif access == "read-after-shrink":
            ctypes.c_ubyte.from_address(b.base + (5 << 20)).value
        else:
            ctypes.c_ubyte.from_address(b.base + (20 << 20)).value  # PROT_NONE: SIGSEGV
        print("no fault", flush=True)
        """
    )
    assert "ok so far" in done.stdout, done.stderr
    assert "no fault" not in done.stdout
    expected = signal.SIGSEGV if access == "read-past-target" else signal.SIGBUS
    assert done.returncode == -expected, (done.returncode, done.stderr)


_FORK = r"""
import asyncio, os, signal, sys, time
from aiokvtier import HostTier, TierClosedError
from aiokvtier._host import _userfault
from tests.helpers import MiB, small_config
real = _userfault._ioctl
def slow(fd, request, args):
    if request == _userfault._UFFDIO_COPY:
        time.sleep(0.003)
    return real(fd, request, args)
_userfault._ioctl = slow
factory = asyncio.new_event_loop
if sys.argv[1] == "uvloop":
    import uvloop
    factory = uvloop.new_event_loop

def child_main(tier):
    async def child():
        try:
            await tier.allocate(2)
        except TierClosedError:
            pass
        else:
            raise AssertionError("allocate worked in the child")
        assert not _userfault.registered(), "the parent's registry is still in the child"
        await tier.aclose()
        # A tier of the child's own copies in through its own userfaultfd.
        async with HostTier(small_config(quota=8 * MiB)) as mine:
            await mine.wait_resident()
            s = mine.statistics()
            assert s.fill_method == "copy" and s.resident_bytes == 8 * MiB, s
        assert not _userfault.registered()
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(child())

async def parent():
    tier = await HostTier.open(small_config(quota=32 * MiB, max_quota=64 * MiB, fill_threads=3))
    await tier.wait_resident(2 * MiB)
    assert tier.statistics().resident_bytes < 32 * MiB, "the fill ended before the fork"
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)
        code = 1
        try:
            child_main(tier)
            code = 0
        finally:
            os._exit(code)
    await tier.wait_resident()
    await tier.resize(8 * MiB)
    await tier.resize(64 * MiB)
    await tier.wait_resident()
    s = tier.statistics()
    assert s.fill_method == "copy" and s.resident_bytes == 64 * MiB, s
    await tier.aclose()
    assert not _userfault.registered()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    print("ok")

with asyncio.Runner(loop_factory=factory) as r:
    r.run(parent())
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_fork_of_a_process_with_a_tier_copying(loop: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _FORK, loop], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.usefixtures("clean")
async def test_statistics_agree_with_mincore_through_a_fill(monkeypatch: pytest.MonkeyPatch) -> None:
    slow_ioctl(monkeypatch, 0.001)
    async with HostTier(small_config(quota=32 * MiB, max_quota=64 * MiB, fill_threads=3)) as tier:
        for _ in range(20):
            s = tier.statistics()
            # The watermark never runs ahead of the kernel (units past it may be resident already).
            assert resident_pages(s.base_address, s.resident_bytes) == s.resident_bytes // _linux.PAGE_SIZE
            await asyncio.sleep(0.002)
        await tier.wait_resident()
        await settled_and_resident(tier)
        with pytest.raises(QuotaError):
            await tier.resize(128 * MiB)
        await settled_and_resident(tier)
    await wait_no_library_threads()


@pytest.mark.usefixtures("clean")
async def test_strict_overcommit_copies_unit_by_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one large mprotect refused (vm.overcommit_memory=2): each unit opens, copies, and closes again
    on a shrink; the registration survives every mprotect."""
    real = _linux.mprotect

    def strict(addr: int, length: int, writable: bool) -> None:
        if writable and length > 2 * MiB:
            raise OSError(errno.ENOMEM, "mprotect: Cannot allocate memory")
        real(addr, length, writable)

    monkeypatch.setattr(_linux, "mprotect", strict)
    async with HostTier(small_config(quota=16 * MiB, max_quota=32 * MiB, fill_threads=2)) as tier:
        await tier.wait_resident()
        await settled_and_resident(tier)
        await tier.resize(4 * MiB)
        s = check_tier(tier, settled=True)
        assert resident_pages(s.base_address, 32 * MiB) == 4 * MiB // _linux.PAGE_SIZE
        await tier.resize(32 * MiB)
        await tier.wait_resident()
        await settled_and_resident(tier)
    await wait_no_library_threads()


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


def test_the_eagain_retries_without_progress_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [0]

    def stuck(fd: int, request: int, args: ctypes.Array[ctypes.c_int64]) -> int:
        calls[0] += 1
        args[4] = -errno.EAGAIN
        ctypes.set_errno(errno.EAGAIN)
        return -1

    b = HostBacking(4 * MiB, node=None, strict_numa=False, huge_pages=False)
    try:
        uf = _userfault.covering(b.base, b.size)
        assert uf is not None
        b.expose(4 * MiB)
        monkeypatch.setattr(_userfault, "_ioctl", stuck)
        with pytest.raises(OSError) as info:
            uf.copy(b.base, MiB)
        assert info.value.errno == errno.EAGAIN
        assert calls[0] <= 200
        assert uf.copying == 0
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
    uf = _userfault.covering(b.base, b.size)
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


@pytest.mark.usefixtures("clean")
async def test_a_close_with_a_live_view_keeps_the_registration_until_the_view_goes() -> None:
    tier = await HostTier.open(small_config(quota=4 * MiB))
    await tier.wait_resident()
    slot = await tier.allocate()
    view = tier.view(slot)
    np.frombuffer(view, dtype=np.uint8)[:] = 9
    await tier.aclose()
    assert not tier.released and len(_userfault.registered()) == 1
    assert np.frombuffer(view, dtype=np.uint8).min() == 9  # still memory, still resident
    view.release()
    del view
    for _ in range(500):
        if tier.released:
            break
        await asyncio.sleep(0.01)
    assert tier.released and not _userfault.registered()
    await wait_no_library_threads()


def test_a_unit_larger_than_one_call_is_copied_whole() -> None:
    size = _userfault.SOURCE_BYTES + 44 * MiB
    b = HostBacking(size + 4 * MiB, node=None, strict_numa=False, huge_pages=False)
    try:
        b.expose(size)
        b.commit(0, size)
        assert resident_pages(b.base, size + 4 * MiB) == size // _linux.PAGE_SIZE
        b.decommit(0, size)
        assert resident_pages(b.base, size) == 0
    finally:
        b.release([])


def test_a_reservation_of_a_tebibyte_registers_and_copies() -> None:
    b = HostBacking(1 << 40, node=None, strict_numa=False, huge_pages=False)
    try:
        assert b.fill_method == "copy"
        b.expose(8 * MiB)
        b.commit(0, 8 * MiB)
        assert resident_pages(b.base, 16 * MiB) == 8 * MiB // _linux.PAGE_SIZE
    finally:
        b.release([])
