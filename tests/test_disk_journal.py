"""The disk tier's journal under faults: appends that fail part-way are cut back off the file (or stop
the journal taking records), and the replay steps over damage inside the file to the records after it.

After each fault a reopen finds every block whose write returned, each with its own bytes, and none
whose write did not.
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from aiokvtier._disk._journal import Journal

from .test_disk import BLOCK, Pages, open_disk

pytestmark = pytest.mark.timeout(120)

Key = bytes | int


def is_journal(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").endswith("/journal")
    except OSError:
        return False


class JournalFaults:
    """``os.write`` and ``os.ftruncate`` that fail on the journal's file as told (other files untouched).

    ``plan`` holds one step per coming journal write: ``"half"`` writes the first half of the bytes and
    returns short, an errno raises it without writing, ``"ok"`` writes; past the plan every write goes
    through. ``cut_fails`` makes truncating the journal fail with EIO.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.plan: list[str | int] = []
        self.cut_fails = False
        self.cuts = 0
        self._write = os.write
        self._truncate = os.ftruncate
        monkeypatch.setattr(os, "write", self.write)
        monkeypatch.setattr(os, "ftruncate", self.ftruncate)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        if not self.plan or not is_journal(fd):
            return self._write(fd, data)
        step = self.plan.pop(0)
        if step == "half":
            return self._write(fd, memoryview(data)[: len(data) // 2])
        if isinstance(step, int):
            raise OSError(step, os.strerror(step))
        return self._write(fd, data)

    def ftruncate(self, fd: int, length: int) -> None:
        if is_journal(fd):
            self.cuts += 1
            if self.cut_fails:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        self._truncate(fd, length)


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[JournalFaults]:
    yield JournalFaults(monkeypatch)


async def found_intact(path: Path, src: Pages, keys: dict[Key, int], blocks: int = 64) -> set[Key]:
    """The keys a fresh open finds and reads back with the bytes of their ``src`` block."""
    dst = Pages(len(keys))
    async with await open_disk(path, blocks) as disk:
        s = disk.statistics()
        assert s.blocks + s.free == s.capacity and s.queue_depth == 0, s
        present = [k for k in keys if k in disk]
        got = await disk.read(present, dst.addresses(range(len(present))))
        assert all(got), "a block the journal vouched for failed its checksum"
        for i, key in enumerate(present):
            assert np.array_equal(dst.array[i], src.array[keys[key]]), f"block {key!r} came back wrong"
        return set(present)


async def header_bytes(tmp_path: Path) -> int:
    """The size of a journal that holds no record yet: its header."""

    def run() -> int:
        journal = Journal(str(tmp_path / "empty-journal"))
        journal.close()
        return os.stat(tmp_path / "empty-journal").st_size

    return await asyncio.to_thread(run)


@pytest.mark.parametrize("step", ["half", errno.ENOSPC, errno.EIO])
async def test_a_failed_append_is_cut_back_and_later_records_are_replayed(
    tmp_path: Path, faults: JournalFaults, step: str | int
) -> None:
    """The short write used to stay in the file: the replay stopped at it and lost every later block."""
    src = Pages(12)
    src.fill(20)
    async with await open_disk(tmp_path) as disk:
        assert await disk.write([0, 1], src.addresses([0, 1]), [BLOCK] * 2) == (0, 1)
        size = (await asyncio.to_thread(os.stat, Path(disk.directory, "journal"))).st_size
        # "half" is followed by ENOSPC when the rest is written: the disk filled under the append
        faults.plan = [step, errno.ENOSPC] if step == "half" else [step]
        # three shares on three threads, each its own append: one of them fails
        written = await disk.write([2, 3, 4], src.addresses([2, 3, 4]), [BLOCK] * 3)
        assert not faults.plan and len(written) == 2
        records = (await asyncio.to_thread(os.stat, Path(disk.directory, "journal"))).st_size - size
        # two whole records (as many bytes as blocks 0 and 1's after the header), nothing of the third
        assert records == size - await header_bytes(tmp_path)
        s = disk.statistics()
        assert s.write_errors == 1 and s.blocks + s.free == s.capacity
        assert await disk.write([5, 6], src.addresses([5, 6]), [BLOCK] * 2) == (5, 6)
        assert disk.discard([0]) == 1
        assert await disk.write([7], src.addresses([7]), [BLOCK]) == (7,)
    keys = {k: k for k in range(8)}
    assert await found_intact(tmp_path, src, keys) == {1, *written, 5, 6, 7}


async def test_a_short_write_that_can_go_on_completes_the_append(tmp_path: Path, faults: JournalFaults) -> None:
    src = Pages(4)
    src.fill(21)
    async with await open_disk(tmp_path) as disk:
        faults.plan = ["half", "ok"]  # a signal cut the write short: the rest follows it
        assert await disk.write([0, 1, 2], src.addresses([0, 1, 2]), [BLOCK] * 3) == (0, 1, 2)
        assert not faults.plan and faults.cuts == 0
        assert disk.statistics().write_errors == 0
    assert await found_intact(tmp_path, src, {0: 0, 1: 1, 2: 2, 3: 3}) == {0, 1, 2}


async def test_an_append_that_cannot_be_cut_back_stops_the_writes_until_reopened(
    tmp_path: Path, faults: JournalFaults, caplog: pytest.LogCaptureFixture
) -> None:
    src, dst = Pages(8), Pages(8)
    src.fill(22)
    async with await open_disk(tmp_path) as disk:
        assert await disk.write([0, 1], src.addresses([0, 1]), [BLOCK] * 2) == (0, 1)
        faults.cut_fails = True
        faults.plan = ["half", errno.ENOSPC]
        assert await disk.write([2], src.addresses([2]), [BLOCK]) == ()
        assert "takes no more records" in caplog.text
        faults.cut_fails = False  # the file could be cut now: the journal still refuses (its end is torn)
        assert await disk.write([4], src.addresses([4]), [BLOCK]) == ()
        assert disk.discard([1]) == 1  # its drop cannot be written: its slot is not written either
        assert await disk.write([5], src.addresses([5]), [BLOCK]) == ()
        s = disk.statistics()
        assert s.write_errors == 3 and s.blocks + s.free == s.capacity and len(disk) == 1
        assert await disk.read([0], dst.addresses([0])) == (True,)  # reads go on
    # block 1's drop was never written: it comes back, with its own bytes
    assert await found_intact(tmp_path, src, {k: k for k in range(6)}) == {0, 1}
    async with await open_disk(tmp_path) as disk:  # the torn tail was cut at the open: writes go on
        assert await disk.write([6], src.addresses([6]), [BLOCK]) == (6,)
    assert await found_intact(tmp_path, src, {k: k for k in range(7)}) == {0, 1, 6}


def journal_bytes(directory: str) -> bytes:
    return Path(directory, "journal").read_bytes()


def record_starts(data: bytes) -> list[int]:
    """Where each record starts (int keys below 2**24 never spell the magic)."""
    starts, at = [], data.find(b"AKVJ")
    while at >= 0:
        starts.append(at)
        at = data.find(b"AKVJ", at + 1)
    return starts


async def edit_journal(directory: str, edit: Callable[[bytes], bytes]) -> None:
    def run() -> None:
        path = Path(directory, "journal")
        path.write_bytes(edit(path.read_bytes()))

    await asyncio.to_thread(run)


async def test_damage_inside_the_journal_is_stepped_over_and_compacted_away(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The replay used to stop at the first bad record and cut the file there: one flipped bit lost
    every block recorded after it."""
    src = Pages(8)
    src.fill(23)
    async with await open_disk(tmp_path) as disk:
        for key in range(6):  # one record per write
            assert await disk.write([key], src.addresses([key]), [BLOCK]) == (key,)
        directory = disk.directory
    data = await asyncio.to_thread(journal_bytes, directory)
    starts = record_starts(data)
    assert len(starts) == 6
    torn = b"AKVJ\x01torn"  # a record cut short, with whole records after it

    def damage(data: bytes) -> bytes:
        flipped = bytearray(data)
        flipped[starts[1] + 10] ^= 0x01  # block 1's record fails its tag
        return bytes(flipped[: starts[3]]) + torn + bytes(flipped[starts[3] :])

    await edit_journal(directory, damage)
    assert await found_intact(tmp_path, src, {k: k for k in range(8)}) == {0, 2, 3, 4, 5}
    assert "stepped over" in caplog.text
    data = await asyncio.to_thread(journal_bytes, directory)
    assert len(record_starts(data)) == 5 and torn not in data  # rewritten whole at that open
    caplog.clear()
    async with await open_disk(tmp_path) as disk:
        assert disk.statistics().recovered_blocks == 5
        assert await disk.write([6], src.addresses([6]), [BLOCK]) == (6,)  # block 1's slot, free again
    assert "stepped over" not in caplog.text
    assert await found_intact(tmp_path, src, {k: k for k in range(8)}) == {0, 2, 3, 4, 5, 6}


@pytest.mark.parametrize("damaged", [[1], [1, 2]], ids=["the-drop", "the-drop-and-the-later-put"])
async def test_a_lost_drop_brings_back_no_wrong_bytes(tmp_path: Path, damaged: list[int]) -> None:
    """Block 0 is dropped and its slot reused by block 1. With the drop's record damaged, the later put
    still owns the slot; with the later put's record damaged too, block 0 comes back naming bytes that
    are not its own, and its read is a miss."""
    src, dst = Pages(2), Pages(2)
    src.fill(24)
    async with await open_disk(tmp_path, blocks=1) as disk:
        assert await disk.write([0], src.addresses([0]), [BLOCK]) == (0,)
        assert disk.discard([0]) == 1
        assert await disk.write([1], src.addresses([1]), [BLOCK]) == (1,)
        directory = disk.directory
    starts = record_starts(await asyncio.to_thread(journal_bytes, directory))
    assert len(starts) == 3  # put 0, drop 0, put 1

    def damage(data: bytes) -> bytes:
        flipped = bytearray(data)
        for i in damaged:
            flipped[starts[i] + 8] ^= 0x01
        return bytes(flipped)

    await edit_journal(directory, damage)
    async with await open_disk(tmp_path, blocks=1) as disk:
        if damaged == [1]:
            assert 0 not in disk and 1 in disk
            assert await disk.read([1], dst.addresses([1])) == (True,)
            assert np.array_equal(dst.array[1], src.array[1])
        else:
            assert 0 in disk and 1 not in disk
            assert await disk.read([0], dst.addresses([0])) == (False,)
            assert disk.statistics().checksum_failures == 1 and 0 not in disk
            assert not np.array_equal(dst.array[0], src.array[0])


def replay_twice(path: str, garbage: bytes) -> tuple[dict[Key, object], int, dict[Key, object], int]:
    """Records, garbage, more records appended by a journal opened over the garbage; two replays."""
    first = Journal(path)
    first.replay()
    first.put([(b"a", 0, BLOCK, 1), (2, 1, BLOCK, 2)])
    first.close()
    with open(path, "ab") as f:
        f.write(garbage)
    second = Journal(path)  # no replay: it appends after the garbage, as the old append did after a tear
    second.put([(3, 2, BLOCK, 3)])
    second.drop_soon(b"a")
    second.flush()
    second.close()
    out = []
    for _ in range(2):
        journal = Journal(path)
        try:
            out += [journal.replay(), journal.skipped]
        finally:
            journal.close()
    return out[0], out[1], out[2], out[3]  # type: ignore[return-value]


@pytest.mark.parametrize("garbage", [b"AKVJ\x01to", b"\x00" * 4096, b"AKVJ" * 50 + os.urandom(3000)])
async def test_the_replay_reads_past_damage_to_the_records_after_it(tmp_path: Path, garbage: bytes) -> None:
    blocks, skipped, again, skipped_again = await asyncio.to_thread(replay_twice, str(tmp_path / "journal"), garbage)
    assert blocks == again == {2: (1, BLOCK, 2), 3: (2, BLOCK, 3)}
    assert skipped == skipped_again == len(garbage)  # the replay leaves the damage (the tier compacts it)
