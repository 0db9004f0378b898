"""Attacks on the disk tier's hashing beside the disk: a share's runs are hashed on the
``aiokvtier-disk-hash`` threads while its next run is written.

Each attack spans several runs per share (a run is at most 2 MiB: 32 blocks of
64 KiB), then checks that nothing is queued, that every slot is free or holds
a block, that no library thread outlives the close, and that a reopen finds
exactly the blocks the tier said it held (the journal and the figures agree).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from aiokvtier import DiskTier

from .helpers import eventually
from .invariants import wait_no_library_threads
from .test_disk import BLOCK, Pages, config
from .test_disk_attack import reopened, settled

pytestmark = pytest.mark.timeout(120)

Key = bytes | int
RUN = (2 << 20) // BLOCK
"""Blocks in one run (one ``pwritev``)."""
N = 3 * RUN + 5
"""A share of four runs on one I/O thread."""
HASH_THREAD = "aiokvtier-disk-hash"


async def open_tier(path: Path, io_threads: int = 1, blocks: int = 4 * N) -> DiskTier:
    return DiskTier(await config(path, blocks), block_size=BLOCK, fingerprint="model-a", io_threads=io_threads)


async def intact(disk: DiskTier, src: Pages, keys: list[int]) -> None:
    """Every key reads back as the source block of its own number."""
    dst = Pages(len(keys))
    assert await disk.read(keys, dst.addresses(range(len(keys)))) == (True,) * len(keys)
    for i, key in enumerate(keys):
        assert np.array_equal(dst.array[i], src.array[key % len(src.array)])


class HashSpy:
    """Records the address each hash reads and the thread that reads it; can hold the hashing threads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[tuple[str, int]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.held = 0
        real = xxhash.xxh3_64
        spy = self

        class Hasher:
            def __init__(self) -> None:
                self._h = real()

            def update(self, data: Any) -> None:
                name = threading.current_thread().name
                spy.seen.append((name, np.frombuffer(data, dtype=np.uint8).ctypes.data))
                if name.startswith(HASH_THREAD) and not spy.hold.is_set():
                    spy.held += 1
                    spy.hold.wait(60)
                self._h.update(data)

            def intdigest(self) -> int:
                return self._h.intdigest()

        monkeypatch.setattr(xxhash, "xxh3_64", Hasher)

    def on_hash_threads(self) -> list[int]:
        return [address for name, address in self.seen if name.startswith(HASH_THREAD)]


@contextlib.contextmanager
def hash_threads_refused(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """While inside: a hashing thread's start fails as with EAGAIN (the list counts the refusals)."""
    refused: list[int] = []
    real = threading.Thread.start
    active = True

    def start(thread: threading.Thread) -> None:
        if active and thread.name.startswith(HASH_THREAD):
            refused.append(1)
            raise RuntimeError("can't start new thread")
        real(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    try:
        yield refused
    finally:
        active = False


# -- a hashing thread that cannot start, or fails -----------------------------------------


async def test_a_hash_whose_thread_could_not_start_never_runs_after_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused thread's job stayed queued in the pool although the share hashed its blocks itself:
    the next thread to start hashed the old write's memory, long after that write had returned it."""
    first, second = Pages(N), Pages(N)
    first.fill(1)
    second.fill(2)
    spy = HashSpy(monkeypatch)
    async with await open_tier(tmp_path) as disk:
        with hash_threads_refused(monkeypatch) as refused:
            assert await disk.write(list(range(N)), first.addresses(range(N)), [BLOCK] * N) == tuple(range(N))
        assert refused  # every run's hand-over was refused: the share hashed them all itself
        assert spy.on_hash_threads() == []
        spy.seen.clear()
        keys = list(range(N, 2 * N))
        assert await disk.write(keys, second.addresses(range(N)), [BLOCK] * N) == tuple(keys)
        stale = set(first.addresses(range(N)))
        await asyncio.sleep(0.05)  # a stray job would be run by now, on the thread that did start
        assert not [a for a in spy.on_hash_threads() if a in stale]
        settled(disk)
        await intact(disk, first, list(range(N)))
    await wait_no_library_threads()
    assert await reopened(tmp_path, list(range(2 * N)), blocks=4 * N) == set(range(2 * N))


async def test_a_thread_refused_while_another_hashes_leaves_no_job_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two I/O threads, two hashing threads: the first hashes (held), the second cannot start. The
    refused runs are hashed by the share itself, and the held thread, let go, hashes none of them."""
    src = Pages(2 * N)
    src.fill(3)
    spy = HashSpy(monkeypatch)
    keys = list(range(2 * N))
    real = threading.Thread.start
    started: list[str] = []

    def start(thread: threading.Thread) -> None:
        if thread.name.startswith(HASH_THREAD):
            if started:
                raise RuntimeError("can't start new thread")
            started.append(thread.name)
        real(thread)

    async with await open_tier(tmp_path, io_threads=2) as disk:
        monkeypatch.setattr(threading.Thread, "start", start)
        spy.hold.clear()
        task = asyncio.create_task(disk.write(keys, src.addresses(keys), [BLOCK] * len(keys)))
        await eventually(lambda: spy.held >= 1, within=30)
        await asyncio.sleep(0.05)  # the shares go on writing, and hashing what they could not hand over
        await asyncio.to_thread(spy.hold.set)
        assert await task == tuple(keys)
        returned = len(spy.on_hash_threads())
        await asyncio.sleep(0.05)
        assert len(spy.on_hash_threads()) == returned  # nothing hashed after the write returned
        monkeypatch.setattr(threading.Thread, "start", real)
        settled(disk)
        await intact(disk, src, keys)
    await wait_no_library_threads()
    assert await reopened(tmp_path, keys, blocks=4 * N) == set(keys)


async def test_a_hand_over_that_fails_with_memory_error_is_hashed_by_the_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A MemoryError from the pool's submit failed the whole share: every block of the call was
    reported unwritten, while the other I/O thread's share had journaled its own, so a reopen found
    blocks the write had not returned."""
    src = Pages(2 * N)
    src.fill(4)
    keys = list(range(2 * N))
    real = concurrent.futures.ThreadPoolExecutor.submit
    calls = 0
    lock = threading.Lock()

    def submit(pool: concurrent.futures.ThreadPoolExecutor, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        if threading.current_thread().name.startswith("aiokvtier-disk-io-0"):
            with lock:
                calls += 1
                if calls == 2:
                    raise MemoryError
        return real(pool, fn, *args, **kwargs)

    async with await open_tier(tmp_path, io_threads=2) as disk:
        monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit", submit)
        written = await disk.write(keys, src.addresses(keys), [BLOCK] * len(keys))
        monkeypatch.undo()
        assert calls >= 2
        assert written == tuple(keys)
        s = disk.statistics()
        assert s.write_errors == 0 and s.blocks == len(keys)
        settled(disk)
        await intact(disk, src, keys)
    await wait_no_library_threads()
    assert await reopened(tmp_path, keys, blocks=4 * N) == set(keys)


async def test_a_hashing_job_that_fails_whole_skips_only_its_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hashing thread whose job raises (a MemoryError before any block's hash) costs its run's
    blocks, counted and logged; the other runs are stored, and the journal agrees."""
    src = Pages(N)
    src.fill(5)
    keys = list(range(N))
    real = xxhash.xxh3_64
    failed: list[str] = []

    def hasher() -> Any:
        name = threading.current_thread().name
        if name.startswith(HASH_THREAD) and not failed:
            failed.append(name)
            raise MemoryError
        return real()

    async with await open_tier(tmp_path) as disk:
        monkeypatch.setattr(xxhash, "xxh3_64", hasher)
        written = await disk.write(keys, src.addresses(keys), [BLOCK] * N)
        monkeypatch.undo()
        assert failed and len(written) == N - 1  # the failed hash is one block's outcome
        s = disk.statistics()
        assert s.write_errors == 1 and s.blocks == N - 1
        settled(disk)
        await intact(disk, src, list(written))
    assert await reopened(tmp_path, keys, blocks=4 * N) == set(written)


async def test_a_failure_after_the_records_are_written_reports_what_was_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A MemoryError sampling the free space, after a share's records were written, failed the whole
    call: every block was reported unwritten and its slot given back, yet a reopen found them all."""
    src = Pages(2 * N)
    src.fill(10)
    keys = list(range(2 * N))
    real = shutil.disk_usage

    def disk_usage(path: Any) -> Any:
        if threading.current_thread().name == "aiokvtier-disk-io-1":
            raise MemoryError
        return real(path)

    async with await open_tier(tmp_path, io_threads=2) as disk:
        monkeypatch.setattr(shutil, "disk_usage", disk_usage)
        written = await disk.write(keys, src.addresses(keys), [BLOCK] * len(keys))
        monkeypatch.undo()
        assert written == tuple(keys)
        s = disk.statistics()
        assert s.write_errors == 0 and s.blocks == len(keys)
        settled(disk)
        await intact(disk, src, keys)
    assert await reopened(tmp_path, keys, blocks=4 * N) == set(keys)


# -- faults in one run while the previous is hashed ---------------------------------------


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
async def test_an_io_error_in_one_run_while_the_last_is_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """The second run's third block refuses every write while the first run's hashes are computed:
    that block alone is skipped, and the journal records none but what the disk holds."""
    src = Pages(N)
    src.fill(6)
    keys = list(range(N))
    bad = RUN + 2
    real = os.pwritev

    def pwritev(fd: int, buffers: list[Any], offset: int) -> int:
        if offset <= bad * BLOCK < offset + sum(len(memoryview(b)) for b in buffers):
            raise OSError(code, os.strerror(code))
        return real(fd, buffers, offset)

    spy = HashSpy(monkeypatch)
    async with await open_tier(tmp_path) as disk:  # a fresh tier: key i in slot i
        monkeypatch.setattr(os, "pwritev", pwritev)
        written = await disk.write(keys, src.addresses(keys), [BLOCK] * N)
        monkeypatch.setattr(os, "pwritev", real)
        assert written == tuple(k for k in keys if k != bad)
        assert src.addresses([bad])[0] not in {a for _, a in spy.seen}  # a block not written is not hashed
        assert spy.on_hash_threads()  # the hashing did run beside the disk
        s = disk.statistics()
        assert s.write_errors == 1 and s.blocks == N - 1
        settled(disk)
        await intact(disk, src, list(written))
    assert await reopened(tmp_path, keys, blocks=4 * N) == set(written)


# -- closes and cancellations while runs are hashed ---------------------------------------

DELAYS = [0.0, 0.0002, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016]


@pytest.mark.parametrize("delay", DELAYS)
async def test_wait_for_cancels_a_write_at_any_point_of_its_hashes(tmp_path: Path, delay: float) -> None:
    src = Pages(2 * N)
    src.fill(7)
    keys = list(range(2 * N))
    async with await open_tier(tmp_path, io_threads=2) as disk:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(disk.write(keys, src.addresses(keys), [BLOCK] * len(keys)), delay)
        settled(disk)
        held = [k for k in keys if k in disk]
        assert held in ([], keys)  # cancelled before it began, or run to its end
        assert disk.statistics().blocks == len(held)
        if held:
            await intact(disk, src, held)
    await wait_no_library_threads()
    assert await reopened(tmp_path, keys, blocks=4 * N) == set(held)


async def test_task_cancel_and_close_while_a_hashing_thread_is_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = Pages(N)
    src.fill(8)
    keys = list(range(N))
    spy = HashSpy(monkeypatch)
    disk = await open_tier(tmp_path)
    await disk.__aenter__()
    spy.hold.clear()
    task = asyncio.create_task(disk.write(keys, src.addresses(keys), [BLOCK] * N))
    await eventually(lambda: spy.held >= 1, within=30)
    task.cancel()
    closing = asyncio.create_task(disk.aclose())
    await asyncio.sleep(0.05)
    assert not task.done() and not closing.done()  # both wait for the hashes of the caller's memory
    await asyncio.to_thread(spy.hold.set)
    with pytest.raises(asyncio.CancelledError):
        await task
    await closing
    s = disk.statistics()
    assert s.blocks == N and s.queue_depth == 0  # the cancellation came once the share had settled
    await wait_no_library_threads()
    assert await reopened(tmp_path, keys, blocks=4 * N) == set(keys)


async def test_a_failing_sibling_in_a_task_group_while_runs_are_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = Pages(N)
    src.fill(9)
    keys = list(range(N))
    spy = HashSpy(monkeypatch)
    spy.hold.clear()

    async def fail() -> None:
        await eventually(lambda: spy.held >= 1, within=30)
        await asyncio.to_thread(spy.hold.set)
        raise LookupError("sibling")

    async with await open_tier(tmp_path) as disk:
        with pytest.raises(ExceptionGroup) as caught:
            async with asyncio.TaskGroup() as group:
                group.create_task(disk.write(keys, src.addresses(keys), [BLOCK] * N))
                group.create_task(fail())
        assert caught.group_contains(LookupError)
        settled(disk)
        assert {k for k in keys if k in disk} == set(keys)
        await intact(disk, src, keys)
    await wait_no_library_threads()
    assert await reopened(tmp_path, keys, blocks=4 * N) == set(keys)
