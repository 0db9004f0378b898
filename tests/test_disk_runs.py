"""Blocks bound for neighbouring data slots move in one pwritev/preadv: where runs start and end, that
a run moves every byte, and that a run which fails or comes up short still gives each block its own
outcome (the blocks it moved whole, the others one at a time)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiokvtier import DiskTier
from aiokvtier._disk import _tier
from aiokvtier._disk._io import ALIGN, MAX_RUN_BYTES, DataFile

from .test_disk import BLOCK, Pages, config

pytestmark = pytest.mark.timeout(120)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def protect(address: int, length: int, prot: int) -> None:
    if _libc.mprotect(address, length, prot) != 0:
        raise OSError(ctypes.get_errno(), "mprotect")


class Unreadable:
    """Blocks of ``Pages`` made PROT_NONE (the kernel answers EFAULT to I/O through them) until exit."""

    def __init__(self, pages: Pages, ids: Sequence[int]) -> None:
        self.spans = [(pages.base + i * BLOCK, BLOCK) for i in ids]

    def __enter__(self) -> None:
        for address, length in self.spans:
            protect(address, length, 0)  # PROT_NONE

    def __exit__(self, *exc: object) -> None:
        for address, length in self.spans:
            protect(address, length, mmap.PROT_READ | mmap.PROT_WRITE)


@pytest.fixture
def data(tmp_path: Path) -> Iterator[DataFile]:
    f = DataFile(str(tmp_path / "blocks"), 64, BLOCK)
    assert f.direct, "these tests lay out direct runs (tmp_path's file system refused O_DIRECT)"
    yield f
    f.close()


class Calls:
    """Counts the vector calls, and lets a test answer the multi-buffer ones itself."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.runs: list[int] = []
        """Buffers per call that moved more than one."""
        self.singles = 0
        self.answer: Callable[[Callable[..., int], int, list[Any], int], int] | None = None
        for name in ("pwritev", "preadv"):
            monkeypatch.setattr(os, name, self._spy(getattr(os, name)))

    def _spy(self, real: Callable[..., int]) -> Callable[..., int]:
        def call(fd: int, buffers: list[Any], offset: int) -> int:
            if len(buffers) == 1:
                self.singles += 1
                return real(fd, buffers, offset)
            self.runs.append(len(buffers))
            if self.answer is not None:
                return self.answer(real, fd, buffers, offset)
            return real(fd, buffers, offset)

        return call


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    return Calls(monkeypatch)


def spans(runs: Iterator[tuple[int, int, int, list[int]]]) -> list[tuple[int, int]]:
    return [(start, stop) for start, stop, _, _ in runs]


def test_runs_break_where_the_file_or_the_descriptor_does(data: DataFile) -> None:
    pages = Pages(12)
    at = pages.addresses(range(12))
    blocks = [
        (0, at[0], BLOCK),
        (1, at[1], BLOCK),
        (2, at[2], BLOCK),  # 0-2: one run
        (4, at[3], BLOCK),  # a gap in the file
        (5, at[4], BLOCK - 100),  # rounded up to fill its slot: the run goes on
        (6, at[5], ALIGN),  # short of its slot: the run ends with it
        (7, at[6], BLOCK),
        (8, at[7] + 8, BLOCK - 8),  # memory not aligned: buffered, another descriptor
        (9, at[8] + 8, BLOCK - 8),  # buffered, but not filling the slot before it: alone
        (11, at[9], BLOCK),
        (10, at[10], BLOCK),  # descending: another run
    ]
    runs = list(data.runs(blocks))
    assert spans(iter(runs)) == [(0, 3), (3, 6), (6, 7), (7, 8), (8, 9), (9, 10), (10, 11)]
    assert runs[1][3] == [BLOCK, BLOCK, ALIGN]
    assert runs[0][2] == runs[1][2] != runs[3][2]
    assert list(data.runs([])) == []


def test_a_run_is_at_most_max_run_bytes_unless_one_block_is_longer(tmp_path: Path) -> None:
    small = DataFile(str(tmp_path / "small"), 2000, ALIGN)
    big = DataFile(str(tmp_path / "big"), 4, 2 * MAX_RUN_BYTES)
    base = 1 << 30  # runs() looks at the addresses' alignment only
    try:
        n = MAX_RUN_BYTES // ALIGN
        many = [(slot, base + slot * ALIGN, ALIGN) for slot in range(n + 3)]
        assert spans(small.runs(many)) == [(0, n), (n, n + 3)]
        assert spans(big.runs([(0, base, 2 * MAX_RUN_BYTES), (1, base, 2 * MAX_RUN_BYTES)])) == [(0, 1), (1, 2)]
    finally:
        small.close()
        big.close()


def test_a_run_moves_every_block_bit_exact_in_one_call(data: DataFile, calls: Calls) -> None:
    src, dst = Pages(40), Pages(40)
    src.fill(30)
    slots = [*range(3, 35), 50, 51, 60]  # 32 blocks of 64 KiB (2 MiB), then 2, then 1 (and 3 more, a gap)
    blocks = [(slot, address, BLOCK) for slot, address in zip(slots, src.addresses(range(35)), strict=True)]
    moving = data.write_blocks(blocks)
    assert next(moving) is None and calls.runs == [32]  # the caller hashes a run before the next moves
    assert [next(moving) for _ in range(31)] == [None] * 31 and calls.runs == [32]
    assert list(moving) == [None] * 3
    assert calls.runs == [32, 2] and calls.singles == 1
    back = [(slot, address, BLOCK) for slot, address in zip(slots, dst.addresses(range(35)), strict=True)]
    assert list(data.read_blocks(back)) == [None] * 35
    assert calls.runs == [32, 2, 32, 2] and calls.singles == 2
    assert np.array_equal(src.array[:35], dst.array[:35])


def test_a_block_whose_memory_the_kernel_cannot_reach_fails_alone(data: DataFile) -> None:
    src, dst = Pages(6), Pages(6)
    src.fill(31)
    blocks = [(slot, address, BLOCK) for slot, address in zip(range(6), src.addresses(range(6)), strict=True)]
    with Unreadable(src, [2]):
        out = list(data.write_blocks(blocks))
    assert [e is None for e in out] == [True, True, False, True, True, True]
    assert isinstance(out[2], OSError) and out[2].errno == errno.EFAULT
    back = [(slot, address, BLOCK) for slot, address in zip(range(6), dst.addresses(range(6)), strict=True)]
    with Unreadable(dst, [4]):
        out = list(data.read_blocks(back))
    assert [e is None for e in out] == [True, True, True, True, False, True]
    assert isinstance(out[4], OSError) and out[4].errno == errno.EFAULT
    for i in (0, 1, 3, 5):
        assert np.array_equal(src.array[i], dst.array[i])


@pytest.mark.parametrize("cut", [0, BLOCK, BLOCK + ALIGN, 3 * BLOCK - ALIGN])
def test_a_run_cut_short_is_finished_a_block_at_a_time(data: DataFile, calls: Calls, cut: int) -> None:
    """The call moves ``cut`` bytes of the run's start (0: it moves nothing and fails)."""
    src, dst = Pages(4), Pages(4)
    src.fill(32)

    def short(real: Callable[..., int], fd: int, buffers: list[Any], offset: int) -> int:
        if not cut:
            raise OSError(errno.EIO, "injected")
        moved, left = [], cut
        for buffer in buffers:
            moved.append(memoryview(buffer)[: min(left, len(buffer))])
            left -= len(moved[-1])
        return real(fd, [m for m in moved if len(m)], offset)

    calls.answer = short
    blocks = [(slot, address, BLOCK) for slot, address in zip(range(10, 14), src.addresses(range(4)), strict=True)]
    assert list(data.write_blocks(blocks)) == [None] * 4
    assert calls.singles == 4 - cut // BLOCK  # the blocks the run did not move whole, from their start
    back = [(slot, address, BLOCK) for slot, address in zip(range(10, 14), dst.addresses(range(4)), strict=True)]
    assert list(data.read_blocks(back)) == [None] * 4
    assert np.array_equal(src.array, dst.array)


def test_a_failed_run_gives_each_block_its_own_outcome(
    data: DataFile, calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run fails as a whole; a block at a time, only slot 22 fails (a bad sector, say)."""
    src, dst = Pages(4), Pages(4)
    src.fill(33)

    def refuse(real: Callable[..., int], fd: int, buffers: list[Any], offset: int) -> int:
        raise OSError(errno.EIO, "injected")

    calls.answer = refuse
    real_one = os.pwritev  # the spy: it passes single buffers on

    def bad_sector(fd: int, buffers: list[Any], offset: int) -> int:
        if len(buffers) == 1 and offset == 22 * BLOCK:
            raise OSError(errno.EIO, "injected bad sector")
        return real_one(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", bad_sector)
    blocks = [(slot, address, BLOCK) for slot, address in zip(range(20, 24), src.addresses(range(4)), strict=True)]
    out = list(data.write_blocks(blocks))
    assert [e is None for e in out] == [True, True, False, True]
    assert isinstance(out[2], OSError) and "bad sector" in str(out[2])
    calls.answer = None
    back = [(slot, address, BLOCK) for slot, address in zip(range(20, 24), dst.addresses(range(4)), strict=True)]
    assert list(data.read_blocks(back)) == [None] * 4
    for i in (0, 1, 3):
        assert np.array_equal(src.array[i], dst.array[i])


def test_a_run_past_the_files_end_reads_the_blocks_before_it(data: DataFile) -> None:
    src, dst = Pages(4), Pages(4)
    src.fill(34)
    blocks = [(slot, address, BLOCK) for slot, address in zip(range(60, 64), src.addresses(range(4)), strict=True)]
    assert list(data.write_blocks(blocks)) == [None] * 4
    os.truncate(data.path, 62 * BLOCK)  # behind the file's back
    back = [(slot, address, BLOCK) for slot, address in zip(range(60, 64), dst.addresses(range(4)), strict=True)]
    out = list(data.read_blocks(back))
    assert [e is None for e in out] == [True, True, False, False]
    assert np.array_equal(src.array[:2], dst.array[:2])


async def test_the_tier_writes_and_reads_runs_and_skips_only_the_unreachable_block(tmp_path: Path) -> None:
    """One I/O thread: the call's eight blocks are one run; the block whose memory is unreachable is
    skipped, the rest stored, found again after a reopen, and read back bit-exact."""
    src, dst = Pages(8), Pages(8)
    src.fill(35)
    keys = list(range(8))
    async with DiskTier(await config(tmp_path), block_size=BLOCK, fingerprint="runs", io_threads=1) as disk:
        with Unreadable(src, [5]):
            written = await disk.write(keys, src.addresses(range(8)), [BLOCK] * 8)
        assert written == (0, 1, 2, 3, 4, 6, 7)
        assert disk.statistics().write_errors == 1
    async with DiskTier(await config(tmp_path), block_size=BLOCK, fingerprint="runs", io_threads=1) as disk:
        assert {k for k in keys if k in disk} == set(written)
        with Unreadable(dst, [1]):
            got = await disk.read(list(written), dst.addresses(range(7)))
        assert got == (True, False, True, True, True, True, True)
        assert disk.statistics().read_errors == 1 and 1 in disk  # the memory's fault: the block is kept
        for i, key in enumerate(written):
            if i != 1:
                assert np.array_equal(dst.array[i], src.array[key])


async def test_blocks_are_hashed_on_the_writing_thread_where_no_hashing_thread_can_be_had(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's hashes go to a hashing thread beside the next run's write; where the pool refuses
    (no thread can start), the writing thread hashes them itself: every block is stored and read back
    bit-exact, in runs and alone, and the checksums agree with the ones the hashing threads give."""
    from concurrent.futures import ThreadPoolExecutor

    src, dst = Pages(16), Pages(16)
    src.fill(41)
    keys = list(range(16))
    addresses = src.addresses([*range(8), 9, 11, 13, 15, 8, 10, 12, 14])  # runs, then blocks alone

    class Refusing(ThreadPoolExecutor):
        def submit(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("can't start new thread")

    for attempt in ("pool", "refused"):
        name = f"hash-{attempt}"
        with monkeypatch.context() as patch:
            if attempt == "refused":
                patch.setattr(_tier, "ThreadPoolExecutor", Refusing)
            async with DiskTier(await config(tmp_path), block_size=BLOCK, fingerprint=name, io_threads=2) as disk:
                assert await disk.write(keys, addresses, [BLOCK] * 16) == tuple(keys)
                assert disk.statistics().write_errors == 0
        async with DiskTier(await config(tmp_path), block_size=BLOCK, fingerprint=name, io_threads=2) as disk:
            assert await disk.read(keys, dst.addresses(range(16))) == (True,) * 16  # each checksum matched
        for i, address in enumerate(addresses):
            assert np.array_equal(dst.array[i], src.array[(address - src.base) // BLOCK])
