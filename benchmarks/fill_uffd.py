"""Study: filling anonymous memory with ``UFFDIO_COPY`` beside touching and ``MADV_POPULATE_WRITE``.

    python benchmarks/fill_uffd.py [--gib 2] [--threads 1 2] [--repeats 3] [--settle 1] > OUT.json

The tier fills 4 KiB pages by touching them (a write per page) because
``MADV_POPULATE_WRITE`` holds the address space's lock for reading through
each call, and a neighbour's ``mmap`` then waits (milliseconds per call); a
touch fault takes the VMA's own lock instead, but costs an exception per
page, so it runs at 0.64-0.75x populate per thread. ``UFFDIO_COPY`` fills a
range in one call, like populate, and on Linux 6.9+ takes the per-VMA lock,
like a fault. This program measures the three side by side, per thread
count, over shares of one read-write mapping (huge pages off): the fill
rate and a neighbour thread's ``mmap`` + ``munmap`` of 1 MiB every 5 ms.
Arms are interleaved round by round with a rest before each; medians are
printed as JSON, with each arm's rate over populate's.

The userfaultfd is opened with ``UFFD_USER_MODE_ONLY`` (allowed without
privileges since Linux 5.11); where the kernel or a seccomp filter refuses
it, the arm reports why. ``uffd_copy`` registers the whole mapping for
missing pages once; ``uffd_units{U}_calls{C}`` is what a tier's fill would
do, each thread taking ``U`` MiB units in turn, registering one, copying it
in ``C`` MiB calls and unregistering it (``--units-mib``, ``--calls-mib``).
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from aiokvtier._host import _userfault as uffd  # the library's userfaultfd ABI: syscall, ioctls, flags
from aiokvtier.bench._common import machine

GiB, MiB = 1 << 30, 1 << 20
CHUNK = 2 * MiB
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]

PROT_RW, MAP_PRIVATE, MAP_ANONYMOUS, MAP_NORESERVE = 3, 0x02, 0x20, 0x4000
MADV_NOHUGEPAGE, MADV_POPULATE_WRITE = 15, 23
UFFDIO_UNREGISTER = uffd._ioc(2, 0x01, 16)  # the library never unregisters: the per-unit arms do


def _map(size: int) -> int:
    addr = _libc.mmap(None, size, PROT_RW, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise uffd._fail("mmap")
    _libc.madvise(addr, size, MADV_NOHUGEPAGE)
    return int(addr)


def touch(addr: int, length: int) -> None:
    view = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(addr))
    for off in range(0, length, CHUNK):
        view[off : off + CHUNK : 4096] = 0


def populate(addr: int, length: int) -> None:
    for off in range(0, length, CHUNK):
        if _libc.madvise(addr + off, min(CHUNK, length - off), MADV_POPULATE_WRITE):
            raise uffd._fail("madvise(MADV_POPULATE_WRITE)")


def open_uffd() -> int:
    """A userfaultfd for user-mode faults, its API handshake done. :raises OSError: refused."""
    if uffd._SYS_USERFAULTFD is None:
        raise OSError(errno.ENOSYS, "userfaultfd: no syscall number for this architecture")
    flags = uffd._O_CLOEXEC | uffd._O_NONBLOCK | uffd._UFFD_USER_MODE_ONLY
    fd = int(_libc.syscall(uffd._SYS_USERFAULTFD, flags))
    if fd < 0:
        raise uffd._fail("userfaultfd")
    api = (ctypes.c_uint64 * 3)(0xAA, 0, 0)
    if _libc.ioctl(fd, uffd._UFFDIO_API, api):
        os.close(fd)
        raise uffd._fail("UFFDIO_API")
    return fd


def uffd_copy(fd: int, addr: int, length: int, src: int, call: int = CHUNK) -> None:
    """Fill ``[addr, addr + length)`` (registered on ``fd``) from the zeros at ``src``, ``call`` bytes per call."""
    copy = (ctypes.c_int64 * 5)()
    off = 0
    while off < length:
        n = min(call, length - off)
        copy[0], copy[1], copy[2], copy[3], copy[4] = addr + off, src, n, 0, 0
        if _libc.ioctl(fd, uffd._UFFDIO_COPY, copy) and ctypes.get_errno() != errno.EAGAIN:
            raise uffd._fail("UFFDIO_COPY")
        off += max(0, int(copy[4]))  # a partial copy (EAGAIN) resumes where it stopped


def uffd_units(
    fd: int, addr: int, length: int, src: int, unit: int, call: int, units: list[int], lock: threading.Lock
) -> None:
    """A fill thread of a tier: take the next unit, register it, copy it in, unregister it."""
    while True:
        with lock:
            if not units:
                return
            off = units.pop(0)
        n = min(unit, length - off)
        reg = (ctypes.c_uint64 * 4)(addr + off, n, uffd._MODE_MISSING, 0)
        if _libc.ioctl(fd, uffd._UFFDIO_REGISTER, reg):
            raise uffd._fail("UFFDIO_REGISTER")
        try:
            uffd_copy(fd, addr + off, n, src, call)
        finally:
            rng = (ctypes.c_uint64 * 2)(addr + off, n)
            if _libc.ioctl(fd, UFFDIO_UNREGISTER, rng):
                raise uffd._fail("UFFDIO_UNREGISTER")


def _neighbour(stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        addr = _libc.mmap(None, MiB, PROT_RW, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        _libc.munmap(addr, MiB)
        out.append(time.perf_counter() - t0)
        time.sleep(0.005)


def fill(size: int, threads: int, method: str, unit: int = 0, call: int = CHUNK) -> dict[str, float]:
    """One fill of ``size`` bytes by ``threads`` threads, with the neighbour: over equal shares, or
    (``unit``) units taken in turn and registered one at a time."""
    addr = _map(size)
    src = _map(max(call, CHUNK))  # zeros to copy from, set up once per fill (not timed)
    ctypes.memset(src, 0, max(call, CHUNK))
    fd = -1
    try:
        if method.startswith("uffd"):
            fd = open_uffd()
        if method == "uffd_copy":
            reg = (ctypes.c_uint64 * 4)(addr, size, uffd._MODE_MISSING, 0)
            if _libc.ioctl(fd, uffd._UFFDIO_REGISTER, reg):
                raise uffd._fail("UFFDIO_REGISTER")
        share = size // threads // CHUNK * CHUNK
        spans = [(addr + i * share, share if i < threads - 1 else size - i * share) for i in range(threads)]
        queue, lock = list(range(0, size, unit or size)), threading.Lock()
        work: Callable[[int, int], None] = {"touch": touch, "populate": populate}.get(
            method, lambda a, n: uffd_copy(fd, a, n, src)
        )
        if unit:
            work = lambda a, n: uffd_units(fd, addr, size, src, unit, call, queue, lock)  # noqa: E731
        errors: list[BaseException] = []

        def run(a: int, n: int) -> None:
            try:
                work(a, n)
            except BaseException as exc:  # reported after the join
                errors.append(exc)

        stop, lat = threading.Event(), []  # type: ignore[var-annotated]
        probe = threading.Thread(target=_neighbour, args=(stop, lat))
        probe.start()
        started = time.perf_counter()
        workers = [threading.Thread(target=run, args=span) for span in spans]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - started
        stop.set()
        probe.join()
        if errors:
            raise errors[0]
        if method == "uffd_copy":
            rng = (ctypes.c_uint64 * 2)(addr, size)
            if _libc.ioctl(fd, UFFDIO_UNREGISTER, rng):
                raise uffd._fail("UFFDIO_UNREGISTER")
        view = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr))
        if int(view[::4096].max()) != 0:
            raise RuntimeError(f"{method}: the filled memory is not zero")
        ms = np.asarray(lat) * 1e3
        return {
            "gib_s": size / GiB / wall,
            "neighbour_p50_ms": float(np.percentile(ms, 50)),
            "neighbour_p99_ms": float(np.percentile(ms, 99)),
            "neighbour_max_ms": float(ms.max()),
        }
    finally:
        if fd >= 0:
            os.close(fd)
        _libc.munmap(src, max(call, CHUNK))
        _libc.munmap(addr, size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settle", type=float, default=1)
    parser.add_argument("--units-mib", type=int, nargs="*", default=[64], help="per-unit arms: unit sizes")
    parser.add_argument("--calls-mib", type=int, nargs="*", default=[64, 2], help="per-unit arms: bytes per copy")
    args = parser.parse_args()
    size = int(args.gib * GiB) // CHUNK * CHUNK
    methods = ["touch", "populate", "uffd_copy"]
    per_unit = [(u * MiB, c * MiB) for u in args.units_mib for c in args.calls_mib]
    refused: str | None = None
    try:
        os.close(open_uffd())
    except OSError as exc:
        refused, methods, per_unit = str(exc), methods[:2], []
    rows: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.repeats):
        for threads in args.threads:
            for method in methods:
                time.sleep(args.settle)
                rows.setdefault(f"{method}_{threads}t", []).append(fill(size, threads, method))
            for unit, call in per_unit:
                time.sleep(args.settle)
                name = f"uffd_units{unit >> 20}_calls{call >> 20}_{threads}t"
                rows.setdefault(name, []).append(fill(size, threads, "uffd_units", unit, call))
    arms: dict[str, Any] = {
        name: {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]} for name, runs in rows.items()
    }
    for threads in args.threads:
        base = arms[f"populate_{threads}t"]["gib_s"]
        for name, arm in arms.items():
            if name.endswith(f"_{threads}t"):
                arm["vs_populate"] = round(arm["gib_s"] / base, 3)
    report = {
        "machine": machine(),
        "gib": args.gib,
        "repeats": args.repeats,
        "neighbour": "mmap + munmap of 1 MiB every 5 ms on another thread",
        "uffd_refused": refused,
        "arms": arms,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
