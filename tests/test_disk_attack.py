"""Attacks on the disk tier and the store over it: cancellation at every await, closes and discards
racing the I/O, faults in the middle of a batch, damaged files, hostile input.

After each attack the invariants hold: the store's own check, a disk tier
whose free slots and blocks add up to its capacity with nothing queued, no
library thread left after the close, and a reopen that finds exactly the
blocks the tier held when it closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import sys
import textwrap
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from aiokvtier import BlockNotFound, BlockStore, DiskTier, DiskTierConfig, HostTier, QuotaError, TierClosedError
from aiokvtier._disk import _journal, _tier
from aiokvtier._disk._io import DataFile
from aiokvtier._disk._journal import Journal, encode_key

from .helpers import eventually, small_config
from .invariants import wait_no_library_threads
from .test_disk import BLOCK, Pages, config, file_size_limit, open_disk
from .test_store_disk import SLOT, page

pytestmark = pytest.mark.timeout(120)

Key = bytes | int
_ROOT = str(Path(__file__).resolve().parents[1])
"""The tree under test, for the children's imports."""


def settled(disk: DiskTier) -> None:
    """Nothing queued, and every data slot free or holding a block."""
    s = disk.statistics()
    assert s.queue_depth == 0, s
    assert s.blocks + s.free == s.capacity, s


async def reopened(path: Path, candidates: list[Key], blocks: int = 64, fingerprint: str = "model-a") -> set[Key]:
    """The candidates a fresh open of the tier finds."""
    async with await open_disk(path, blocks, fingerprint) as disk:
        settled(disk)
        return {k for k in candidates if k in disk}


class Gate:
    """Holds every call of a ``DataFile`` method on the I/O threads until ``release()``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.entered = 0
        self._open = threading.Event()
        real = getattr(DataFile, name)

        def held(data: DataFile, *args: Any) -> Any:
            self.entered += 1
            self._open.wait(60)
            return real(data, *args)

        monkeypatch.setattr(DataFile, name, held)

    async def reached(self, n: int = 1) -> None:
        await eventually(lambda: self.entered >= n, within=30)

    async def release(self) -> None:
        await asyncio.to_thread(self._open.set)  # Event.set takes a lock: off the loop

    def release_now(self) -> None:
        self._open.set()


@contextlib.contextmanager
def gate(monkeypatch: pytest.MonkeyPatch, name: str) -> Iterator[Gate]:
    g = Gate(monkeypatch, name)
    try:
        yield g
    finally:
        g.release_now()  # a failed test must not leave an I/O thread waiting


# -- closes racing the I/O -----------------------------------------------------------------


async def test_a_close_waits_for_the_writes_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The close used to close the files under the I/O threads: the writes in flight failed (or landed
    in whatever file took the descriptor's number)."""
    src = Pages(8)
    src.fill(1)
    keys: list[Key] = list(range(8))
    disk = await DiskTier.open(await config(tmp_path), block_size=BLOCK, fingerprint="model-a")
    with gate(monkeypatch, "write_blocks") as g:
        writing = asyncio.create_task(disk.write(keys, src.addresses(range(8)), [BLOCK] * 8))
        await g.reached()
        closing = asyncio.create_task(disk.aclose())
        await asyncio.sleep(0.05)
        assert not closing.done()  # the close waits for the I/O
        await g.release()
        written = await writing
        await closing
    assert written == tuple(keys) and disk.statistics().write_errors == 0
    settled(disk)
    await wait_no_library_threads()
    assert await reopened(tmp_path, keys) == set(keys)


async def test_a_close_waits_for_the_reads_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = Pages(4), Pages(4)
    src.fill(2)
    disk = await DiskTier.open(await config(tmp_path), block_size=BLOCK, fingerprint="model-a")
    await disk.write([0, 1, 2, 3], src.addresses(range(4)), [BLOCK] * 4)
    with gate(monkeypatch, "read_blocks") as g:
        reading = asyncio.create_task(disk.read([0, 1, 2, 3], dst.addresses(range(4))))
        await g.reached()
        closing = asyncio.create_task(disk.aclose())
        await g.release()
        assert await reading == (True,) * 4
        await closing
    assert np.array_equal(src.array, dst.array)
    settled(disk)
    await wait_no_library_threads()


# -- discards racing the writes, and the journal's order ----------------------------------------


async def test_a_key_discarded_while_it_is_written_is_not_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It used to be published when its write settled: a discarded block came back."""
    src = Pages(2)
    src.fill(3)
    async with await open_disk(tmp_path) as disk:
        with gate(monkeypatch, "write_blocks") as g:
            writing = asyncio.create_task(disk.write([b"gone", b"kept"], src.addresses([0, 1]), [BLOCK] * 2))
            await g.reached()
            assert disk.discard([b"gone"]) == 0  # not stored yet: dropped when the write settles
            await g.release()
            assert await writing == (b"kept",)
        assert b"gone" not in disk and b"kept" in disk
        settled(disk)
        assert await disk.write([b"gone"], src.addresses([0]), [BLOCK]) == (b"gone",)  # may be written again
        disk.discard([b"gone"])
    assert await reopened(tmp_path, [b"gone", b"kept"]) == {b"kept"}


def slow_drops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drop records take their time to be made (on whichever thread makes them)."""
    real = _journal._record

    def record(op: int, *args: Any) -> bytes:
        if op == _journal._DROP:
            threading.Event().wait(0.05)
        return real(op, *args)

    monkeypatch.setattr(_journal, "_record", record)


async def test_a_block_written_again_after_a_discard_survives_a_reopen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drop record was appended by one thread and the new put by another: a late drop undid the
    rewrite, and a reopen lost a block whose write had returned."""
    slow_drops(monkeypatch)
    src = Pages(2)
    src.fill(4)
    path = tmp_path
    disk = DiskTier(await config(path), block_size=BLOCK, fingerprint="model-a", io_threads=2)
    async with disk:
        for round_ in range(4):
            assert await disk.write([b"k"], src.addresses([round_ % 2]), [BLOCK]) == (b"k",)
            assert disk.discard([b"k"]) == 1
        assert await disk.write([b"k"], src.addresses([0]), [BLOCK]) == (b"k",)
        await asyncio.sleep(0.5)  # no assertion on time: room for late drop records to land before the close
    assert await reopened(path, [b"k"]) == {b"k"}
    out = Pages(1)
    async with await open_disk(path) as disk:
        assert await disk.read([b"k"], out.addresses([0])) == (True,)
    assert np.array_equal(out.array[0], src.array[0])


async def test_a_block_evicted_and_written_again_at_once_survives_a_reopen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_drops(monkeypatch)
    src = Pages(4)
    src.fill(5)
    disk = DiskTier(await config(tmp_path, blocks=2), block_size=BLOCK, fingerprint="model-a", io_threads=2)
    async with disk:
        await disk.write([0, 1], src.addresses([0, 1]), [BLOCK] * 2)
        # 2 evicts 0, and 0 comes straight back (evicting 1) in a concurrent call
        got = await asyncio.gather(
            disk.write([2], src.addresses([2]), [BLOCK]), disk.write([0], src.addresses([0]), [BLOCK])
        )
        assert got == [(2,), (0,)]
        settled(disk)
        held = {k for k in range(3) if k in disk}
    assert held == {0, 2}
    assert await reopened(tmp_path, [0, 1, 2], blocks=2) == held


async def test_the_later_of_two_records_for_one_slot_wins_at_replay(tmp_path: Path) -> None:
    """A key put again into another block's slot (that block's drop record lost) is the later record:
    the replay used to keep the other key, by the order keys were first seen."""
    src, out = Pages(3), Pages(1)
    src.fill(6)
    async with await open_disk(tmp_path) as disk:
        await disk.write([b"a", b"b"], src.addresses([0, 1]), [BLOCK] * 2)
        directory = disk.directory
    slot_of_b = 1

    def rewrite() -> None:  # "a" put again into b's slot, b's drop never written
        with open(Path(directory, "blocks"), "r+b") as f:
            f.seek(slot_of_b * BLOCK)
            f.write(src.array[2].tobytes())
        checksum = xxhash.xxh3_64_intdigest(src.array[2].tobytes())
        journal = Journal(str(Path(directory, "journal")))  # appends after the records there
        try:
            journal.put([(b"a", slot_of_b, BLOCK, checksum)])
        finally:
            journal.close()

    await asyncio.to_thread(rewrite)
    async with await open_disk(tmp_path) as disk:
        settled(disk)
        assert b"a" in disk and b"b" not in disk
        assert await disk.read([b"a"], out.addresses([0])) == (True,)
    assert np.array_equal(out.array[0], src.array[2])


# -- faults ----------------------------------------------------------------------------------


async def test_an_error_that_is_no_oserror_mid_batch_skips_only_its_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A MemoryError on the third block failed the whole share: blocks already journaled were reported
    unwritten, their slots given back, and a reopen found blocks whose write had not returned them."""
    src = Pages(6)
    src.fill(7)
    real = xxhash.xxh3_64
    calls = 0

    def hasher(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise MemoryError
        return real(*args)

    keys: list[Key] = list(range(6))
    disk = DiskTier(await config(tmp_path), block_size=BLOCK, fingerprint="model-a", io_threads=1)
    async with disk:
        monkeypatch.setattr(_tier.xxhash, "xxh3_64", hasher)
        written = await disk.write(keys, src.addresses(range(6)), [BLOCK] * 6)
        monkeypatch.undo()
        assert len(written) == 5 and disk.statistics().write_errors == 1
        settled(disk)
    assert await reopened(tmp_path, keys) == set(written)


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
async def test_an_io_error_mid_batch_skips_only_its_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """The third block's slot refuses every write: the run that holds it fails, and of its blocks,
    written again one at a time, only that one is skipped."""
    src = Pages(6)
    src.fill(8)
    real = os.pwritev

    def pwritev(fd: int, buffers: list[Any], offset: int) -> int:
        if offset <= 2 * BLOCK < offset + sum(len(memoryview(b)) for b in buffers):
            raise OSError(code, os.strerror(code))
        return real(fd, buffers, offset)

    keys: list[Key] = list(range(6))
    async with await open_disk(tmp_path) as disk:  # a fresh tier: key i in slot i
        monkeypatch.setattr(os, "pwritev", pwritev)
        written = await disk.write(keys, src.addresses(range(6)), [BLOCK] * 6)
        monkeypatch.undo()
        assert written == (0, 1, 3, 4, 5) and disk.statistics().write_errors == 1
        settled(disk)
    assert await reopened(tmp_path, keys) == set(written)


async def test_efbig_mid_batch_then_the_disk_has_room_again(tmp_path: Path) -> None:
    src = Pages(8)
    src.fill(9)
    keys: list[Key] = list(range(8))
    async with await open_disk(tmp_path, blocks=8) as disk:
        with file_size_limit(3 * BLOCK):
            written = await disk.write(keys, src.addresses(range(8)), [BLOCK] * 8)
        settled(disk)
        assert 0 < len(written) < 8
        again = await disk.write(keys, src.addresses(range(8)), [BLOCK] * 8)
        assert set(written) | set(again) == set(keys)
        settled(disk)
    assert await reopened(tmp_path, keys, blocks=8) == set(keys)


async def test_room_reserved_past_the_journal_end_is_allocated_and_never_replayed(tmp_path: Path) -> None:
    """The records' room is taken before the data that may fill the disk; the records still land at the
    journal's end (room that grew the file would put them after zeros, where the replay stops)."""
    path = str(tmp_path / "journal")

    def run() -> tuple[os.stat_result, os.stat_result, dict[Key, Any], os.stat_result]:
        journal = Journal(path)
        try:
            journal.replay()
            header = os.stat(path)
            journal.reserve([b"a", 1])
            reserved = os.stat(path)
            journal.put([(b"a", 0, BLOCK, 7), (1, 1, BLOCK, 8)])
        finally:
            journal.close()
        again = Journal(path)
        try:
            return header, reserved, again.replay(), os.stat(path)
        finally:
            again.close()

    header, reserved, blocks, written = await asyncio.to_thread(run)
    assert reserved.st_size == header.st_size and reserved.st_blocks > header.st_blocks
    assert blocks == {b"a": (0, BLOCK, 7), 1: (1, BLOCK, 8)}
    # a record: 27 bytes of fields, the key's encoding, an 8-byte tag
    assert written.st_size == header.st_size + 2 * (27 + 8) + len(encode_key(b"a")) + len(encode_key(1))


async def test_a_journal_that_cannot_be_written_skips_the_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = Pages(4)
    src.fill(10)

    def refuse(journal: Journal, records: bytes, count: int = 1) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    async with await open_disk(tmp_path, blocks=4) as disk:
        await disk.write([b"old"], src.addresses([0]), [BLOCK])
        monkeypatch.setattr(Journal, "_append", refuse)
        assert await disk.write([1, 2], src.addresses([1, 2]), [BLOCK] * 2) == ()
        assert disk.discard([b"old"]) == 1  # its drop record cannot be written yet
        settled(disk)
        assert disk.statistics().write_errors == 2
        monkeypatch.undo()
        # the journal works again: "old"'s slot is reused, and its drop is written before anything
        assert await disk.write([1, 2, 3, 4], src.addresses([1, 2, 3, 0]), [BLOCK] * 4) == (1, 2, 3, 4)
        settled(disk)
    assert await reopened(tmp_path, [b"old", 1, 2, 3, 4], blocks=4) == {1, 2, 3, 4}


async def test_a_data_file_truncated_behind_the_tiers_back_gives_misses_then_room(tmp_path: Path) -> None:
    """The blocks the file lost used to stay in the index: every read of them failed again, the store's
    lookup counted them, and nothing ever wrote them again."""
    src, dst = Pages(4), Pages(4)
    src.fill(11)
    async with await open_disk(tmp_path) as disk:
        await disk.write([0, 1, 2, 3], src.addresses(range(4)), [BLOCK] * 4)
        await asyncio.to_thread(os.truncate, Path(disk.directory, "blocks"), 2 * BLOCK)
        got = await disk.read([0, 1, 2, 3], dst.addresses(range(4)))
        assert got == (True, True, False, False)
        assert {k for k in range(4) if k in disk} == {0, 1} and disk.statistics().read_errors == 2
        settled(disk)
        assert await disk.write([2, 3], src.addresses([2, 3]), [BLOCK] * 2) == (2, 3)
        assert await disk.read([2, 3], dst.addresses([2, 3])) == (True, True)
    assert np.array_equal(src.array, dst.array)
    assert await reopened(tmp_path, [0, 1, 2, 3]) == {0, 1, 2, 3}


async def test_a_data_file_deleted_behind_the_tiers_back(tmp_path: Path) -> None:
    src, dst = Pages(4), Pages(4)
    src.fill(12)
    async with await open_disk(tmp_path) as disk:
        await disk.write([0, 1], src.addresses([0, 1]), [BLOCK] * 2)
        await asyncio.to_thread(os.unlink, Path(disk.directory, "blocks"))
        # the open descriptor keeps the file: the tier goes on until it closes
        assert await disk.read([0, 1], dst.addresses([0, 1])) == (True, True)
        assert await disk.write([2], src.addresses([2]), [BLOCK]) == (2,)
    async with await open_disk(tmp_path) as disk:  # a new, empty file: the journal's blocks are misses
        assert await disk.read([0, 1, 2], dst.addresses([0, 1, 2])) == (False,) * 3
        assert len(disk) == 0 and disk.statistics().checksum_failures == 3
        settled(disk)


async def test_the_whole_directory_removed_behind_the_tiers_back(tmp_path: Path) -> None:
    src, dst = Pages(2), Pages(2)
    src.fill(13)
    async with await open_disk(tmp_path) as disk:
        await disk.write([0], src.addresses([0]), [BLOCK])
        await asyncio.to_thread(_remove_tree, Path(disk.directory))
        assert await disk.write([1], src.addresses([1]), [BLOCK]) == (1,)
        assert await disk.read([0, 1], dst.addresses([0, 1])) == (True, True)
        assert disk.statistics().free_disk_bytes is None  # the directory is gone: nothing to ask
    await wait_no_library_threads()
    assert await reopened(tmp_path, [0, 1]) == set()


def _remove_tree(path: Path) -> None:
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


async def test_a_journal_of_garbage_or_of_slots_past_the_quota_starts_clean(tmp_path: Path) -> None:
    src = Pages(2)
    src.fill(14)
    async with await open_disk(tmp_path, blocks=4) as disk:
        directory = disk.directory

    def forge(records: bytes | None) -> None:
        path = Path(directory, "journal")
        if records is not None:
            path.write_bytes(records)
            return
        path.unlink()  # whole records, naming slots past the quota or lengths no block has
        journal = Journal(str(path))
        try:
            journal.put([(i, slot, length, 0) for i, (slot, length) in enumerate(past)])
        finally:
            journal.close()

    past = [(4, BLOCK), (1 << 40, BLOCK), (0, BLOCK + 1), (1, 0)]
    for records in (os.urandom(10_000), b"AKVJ" * 1000, None):
        await asyncio.to_thread(forge, records)
        async with await open_disk(tmp_path, blocks=4) as disk:
            assert len(disk) == 0
            settled(disk)
            assert await disk.write([9], src.addresses([0]), [BLOCK]) == (9,)
        assert await reopened(tmp_path, [9], blocks=4) == {9}


_HOLD = textwrap.dedent(
    """
    import asyncio, sys
    from aiokvtier import DiskTier, DiskTierConfig

    async def main():
        config = DiskTierConfig(quota=64 * 65536, path=sys.argv[1])
        await DiskTier.open(config, block_size=65536, fingerprint="model-a")
        print("open", flush=True)
        await asyncio.sleep(120)

    asyncio.run(main())
    """
)


async def test_a_lock_held_by_a_dead_process_is_free(tmp_path: Path) -> None:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLD, str(tmp_path), stdout=asyncio.subprocess.PIPE
    )
    assert child.stdout is not None
    assert await asyncio.wait_for(child.stdout.readline(), 60) == b"open\n"
    child.send_signal(signal.SIGKILL)
    await child.wait()
    async with await open_disk(tmp_path) as disk:  # the lock file still names the dead process
        settled(disk)


_READ_ONLY = textwrap.dedent(
    """
    import asyncio, mmap, os, sys
    import numpy as np
    from aiokvtier import DiskTier, DiskTierConfig

    async def main(path):
        block = 65536
        pages = np.frombuffer(mmap.mmap(-1, 8 * block), dtype=np.uint8).reshape(8, block)
        at = [pages.ctypes.data + i * block for i in range(8)]
        config = DiskTierConfig(quota=64 * block, path=path)
        async with DiskTier(config, block_size=block, fingerprint="m") as disk:
            await disk.write([0, 1], at[:2], [block] * 2)
            for key in range(100, 700):  # enough drops that the next open compacts the journal
                await disk.write([key], at[7:], [block])
                disk.discard([key])
            os.chmod(disk.directory, 0o500)
            try:
                open(os.path.join(disk.directory, "probe"), "w")
            except PermissionError:
                print("read-only")
            print(await disk.write([2, 3], at[2:4], [block] * 2), disk.discard([0]))
            print(await disk.read([1, 2, 3], at[4:7]))
        async with DiskTier(config, block_size=block, fingerprint="m") as disk:
            print(sorted(k for k in range(700) if k in disk))

    asyncio.run(main(sys.argv[1]))
    """
)


async def test_a_directory_made_read_only_after_open(tmp_path: Path) -> None:
    """No file is made after the open, so the tier goes on; the next open's journal compaction could
    not make its new file, and the open failed: it is skipped (said in the log) instead."""
    if os.geteuid() != 0 or not await asyncio.to_thread(os.path.exists, "/usr/bin/setpriv"):
        pytest.skip("needs root and setpriv: root without the capabilities that override file modes")
    drop = "-dac_override,-dac_read_search,-fowner"
    env = {**os.environ, "PYTHONPATH": _ROOT}
    child = await asyncio.create_subprocess_exec(
        *("setpriv", "--bounding-set", drop, "--inh-caps", drop, sys.executable, "-c", _READ_ONLY, str(tmp_path)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(child.communicate(), 60)
    await asyncio.to_thread(_writable_again, tmp_path)
    assert out.decode().splitlines() == ["read-only", "(2, 3) 1", "(True, True, True)", "[1, 2, 3]"], err.decode()
    assert "could not compact its journal" in err.decode()


def _writable_again(path: Path) -> None:
    for directory in path.iterdir():
        directory.chmod(0o700)


@pytest.mark.parametrize("name", ["aiokvtier-disk", "aiokvtier-disk-io-0", "aiokvtier-disk-io-3"])
async def test_an_io_thread_that_cannot_start_fails_the_open_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    real = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name == name:
            raise RuntimeError("can't start new thread")
        real(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    disk = await open_disk(tmp_path)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        await disk.__aenter__()
    assert disk.closed
    await disk.aclose()
    await wait_no_library_threads()
    monkeypatch.undo()
    async with await open_disk(tmp_path) as disk:  # the lock and the files were released
        settled(disk)


# -- cancellation --------------------------------------------------------------------------

DELAYS = [0.0, 0.0001, 0.0003, 0.0007, 0.001, 0.002, 0.004]


@pytest.mark.parametrize("delay", DELAYS)
async def test_cancelled_writes_and_reads_at_any_point(tmp_path: Path, delay: float) -> None:
    src, dst = Pages(16), Pages(16)
    src.fill(15)
    keys: list[Key] = list(range(16))
    async with await open_disk(tmp_path, blocks=12) as disk:
        for start in (0, 4, 8):  # the third round evicts
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    disk.write(keys[start : start + 8], src.addresses(range(start, start + 8)), [BLOCK] * 8), delay
                )
            settled(disk)
        held = [k for k in keys if k in disk]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(disk.read(held, dst.addresses(range(len(held)))), delay)
        settled(disk)
        assert await disk.read(held, dst.addresses(range(len(held)))) == (True,) * len(held)
        for i, key in enumerate(held):
            assert isinstance(key, int) and np.array_equal(dst.array[i], src.array[key])
    await wait_no_library_threads()
    assert await reopened(tmp_path, keys, blocks=12) == set(held)


@pytest.mark.parametrize("steps", [0, 1, 2, 3, 5, 8])
async def test_task_cancel_after_some_loop_turns(tmp_path: Path, steps: int) -> None:
    src = Pages(8)
    src.fill(16)
    keys: list[Key] = list(range(8))
    async with await open_disk(tmp_path) as disk:
        task = asyncio.create_task(disk.write(keys, src.addresses(range(8)), [BLOCK] * 8))
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        settled(disk)
        held = {k for k in keys if k in disk}
        assert held in (set(), set(keys))  # not begun, or run to its end
    assert await reopened(tmp_path, keys) == held


async def test_a_failing_sibling_in_a_task_group_cancels_a_write_and_a_read(tmp_path: Path) -> None:
    src, dst = Pages(8), Pages(8)
    src.fill(17)

    async def fail() -> None:
        await asyncio.sleep(0)
        raise LookupError("sibling")

    async with await open_disk(tmp_path) as disk:
        await disk.write([100], src.addresses([0]), [BLOCK])
        with pytest.raises(ExceptionGroup) as caught:
            async with asyncio.TaskGroup() as group:
                group.create_task(disk.write(list(range(8)), src.addresses(range(8)), [BLOCK] * 8))
                group.create_task(disk.read([100], dst.addresses([7])))
                group.create_task(fail())
        assert caught.group_contains(LookupError)
        settled(disk)
        held = {k for k in range(8) if k in disk}
    assert await reopened(tmp_path, [100, *range(8)]) == held | {100}


# -- hostile input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (True, TypeError),
        (1.0, TypeError),
        ("k", TypeError),
        (None, TypeError),
        ([1], TypeError),
        (1 << (8 * 70_000), ValueError),
        (b"x" * 70_000, ValueError),
    ],
    ids=["bool", "float", "str", "None", "list", "huge-int", "huge-bytes"],
)
async def test_a_bad_key_changes_nothing(tmp_path: Path, bad: object, error: type[Exception]) -> None:
    """A bad key after a good one used to take a slot and leave the good key 'being written' for good
    (or fail on the I/O thread after the good one was journaled)."""
    src, dst = Pages(2), Pages(2)
    src.fill(18)
    async with await open_disk(tmp_path) as disk:
        with pytest.raises(error):
            await disk.write([1, bad], src.addresses([0, 1]), [BLOCK] * 2)  # type: ignore[list-item]
        with pytest.raises(error):
            await disk.read([1, bad], dst.addresses([0, 1]))  # type: ignore[list-item]
        with pytest.raises(error):
            disk.discard([bad])  # type: ignore[list-item]
        settled(disk)
        assert len(disk) == 0 and disk.statistics().free == disk.capacity
        assert await disk.write([1], src.addresses([0]), [BLOCK]) == (1,)
    assert await reopened(tmp_path, [1]) == {1}


async def test_every_kind_of_good_key(tmp_path: Path) -> None:
    src, dst = Pages(8), Pages(8)
    src.fill(19)
    given: list[Any] = [b"", bytearray(b"ba"), memoryview(b"mv"), np.int64(-5), 0, -(1 << 200), 1 << 200, b"\x00"]
    canonical: list[Key] = [b"", b"ba", b"mv", -5, 0, -(1 << 200), 1 << 200, b"\x00"]
    async with await open_disk(tmp_path) as disk:
        assert await disk.write(given, src.addresses(range(8)), [BLOCK] * 8) == tuple(canonical)
        assert all(type(k) in (bytes, int) for k in canonical if k in disk)
        assert await disk.read(given, dst.addresses(range(8))) == (True,) * 8
    assert np.array_equal(src.array, dst.array)
    assert await reopened(tmp_path, canonical) == set(canonical)


@pytest.mark.parametrize(
    ("length", "error"),
    [
        (0, ValueError),
        (-1, ValueError),
        (BLOCK + 1, ValueError),
        (True, TypeError),
        (100.0, TypeError),
        ("1", TypeError),
    ],
)
async def test_a_bad_length_changes_nothing(tmp_path: Path, length: object, error: type[Exception]) -> None:
    src = Pages(2)
    async with await open_disk(tmp_path) as disk:
        with pytest.raises(error):
            await disk.write([1, 2], src.addresses([0, 1]), [BLOCK, length])  # type: ignore[list-item]
        settled(disk)
        assert len(disk) == 0 and disk.statistics().bytes_written == 0


@pytest.mark.parametrize(
    ("address", "error"), [(0, ValueError), (-4096, ValueError), (4096.0, TypeError), (None, TypeError)]
)
async def test_a_bad_address_changes_nothing(tmp_path: Path, address: object, error: type[Exception]) -> None:
    """Address 0 reached the checksum, which read it on the I/O thread: the process died of SIGSEGV."""
    src = Pages(2)
    async with await open_disk(tmp_path) as disk:
        await disk.write([9], src.addresses([0]), [BLOCK])
        with pytest.raises(error):
            await disk.write([1, 2], [src.addresses([0])[0], address], [BLOCK] * 2)  # type: ignore[list-item]
        with pytest.raises(error):
            await disk.read([9], [address])  # type: ignore[list-item]
        settled(disk)
        assert len(disk) == 1


async def test_numpy_lengths_and_addresses_and_odd_alignments(tmp_path: Path) -> None:
    src, dst = Pages(4), Pages(4)
    src.fill(20)
    async with await open_disk(tmp_path) as disk:
        addresses = np.asarray(src.addresses(range(3)), dtype=np.uint64)
        addresses[2] += np.uint64(1)  # unaligned: the buffered descriptor
        lengths = np.asarray([1, 4097, BLOCK - 1], dtype=np.int64)
        assert await disk.write([0, 1, 2], list(addresses), list(lengths)) == (0, 1, 2)
        assert all(type(disk.length(k)) is int for k in range(3))
        assert await disk.read([0, 1, 2], [np.int64(a) for a in dst.addresses(range(3))]) == (True,) * 3
        for i, n in enumerate([1, 4097, BLOCK - 1]):
            assert dst.array[i, :n].tobytes() == bytes(src.map[int(addresses[i]) - src.base :][:n])
        assert disk.statistics().bytes_written == 1 + 4097 + BLOCK - 1


async def test_unmapped_memory_is_a_skip_or_a_miss_not_a_crash(tmp_path: Path) -> None:
    src, dst = Pages(1), Pages(1)
    src.fill(21)
    nowhere = 1 << 46  # above any mapping of this process, page-aligned
    async with await open_disk(tmp_path) as disk:
        assert await disk.write([1], [nowhere], [BLOCK]) == ()
        await disk.write([2], src.addresses([0]), [BLOCK])
        assert await disk.read([2], [nowhere]) == (False,)
        assert 2 in disk  # the memory was bad, not the block
        assert await disk.read([2], dst.addresses([0])) == (True,)
        settled(disk)


async def test_repeated_keys_and_empty_calls(tmp_path: Path) -> None:
    src, dst = Pages(4), Pages(4)
    src.fill(22)
    async with await open_disk(tmp_path) as disk:
        assert await disk.write([], [], []) == () and await disk.read([], []) == () and disk.discard([]) == 0
        assert await disk.write([5, 5, 6], src.addresses([0, 1, 2]), [BLOCK] * 3) == (5, 6)
        assert await disk.read([5, 5, 6, 5], dst.addresses([0, 1, 2, 3])) == (True,) * 4
        for i in (0, 1, 3):
            assert np.array_equal(dst.array[i], src.array[0])
        assert disk.discard([5, 5, 7]) == 1
        settled(disk)


@pytest.mark.parametrize("fingerprint", ["a/../b", "\x00", "llama 🦙 / bf16", "x" * 5000, "\n\t"])
async def test_odd_fingerprints_keep_apart(tmp_path: Path, fingerprint: str) -> None:
    src = Pages(1)
    src.fill(23)
    async with DiskTier(await config(tmp_path), block_size=BLOCK, fingerprint=fingerprint) as disk:
        assert Path(disk.directory).parent == tmp_path
        await disk.write([1], src.addresses([0]), [BLOCK])
    assert await reopened(tmp_path, [1], fingerprint=fingerprint) == {1}
    assert await reopened(tmp_path, [1], fingerprint="other") == set()


@pytest.mark.parametrize(
    ("block_size", "fingerprint"),
    [(0, "m"), (-4096, "m"), (4095, "m"), (True, "m"), (4096.0, "m"), ((1 << 31) + 4096, "m"), (4096, "\ud800")],
)
async def test_bad_block_sizes_and_fingerprints_are_refused(tmp_path: Path, block_size: Any, fingerprint: str) -> None:
    big = await asyncio.to_thread(DiskTierConfig, quota=1 << 40, path=tmp_path)
    with pytest.raises(ValueError):
        DiskTier(big, block_size=block_size, fingerprint=fingerprint)


@pytest.mark.parametrize("block_size", [4096, 1 << 31])
async def test_block_size_edges_open(tmp_path: Path, block_size: int) -> None:
    src = Pages(1)
    src.fill(24)
    quota = await asyncio.to_thread(DiskTierConfig, quota=4 * block_size, path=tmp_path)
    async with DiskTier(quota, block_size=block_size, fingerprint="m") as disk:
        assert disk.capacity == 4
        assert await disk.write([1], src.addresses([0]), [min(block_size, BLOCK)]) == (1,)
        settled(disk)


async def test_a_huge_quota_costs_no_list_of_its_slots(tmp_path: Path) -> None:
    """The free slots were a list of every slot: a quota of a few billion blocks took minutes and gigabytes."""
    src = Pages(1)
    src.fill(25)
    huge = await asyncio.to_thread(DiskTierConfig, quota=1 << 42, path=tmp_path)  # a sparse file ext4 takes
    async with asyncio.timeout(60), DiskTier(huge, block_size=4096, fingerprint="m") as disk:
        assert disk.capacity == 1 << 30
        await disk.write([1, 2], src.addresses([0, 0]), [4096, 4096])
        settled(disk)
    async with asyncio.timeout(60), DiskTier(huge, block_size=4096, fingerprint="m") as disk:
        assert len(disk) == 2
        settled(disk)


# -- the store over a disk tier ----------------------------------------------------------------


@asynccontextmanager
async def cache(path: Path, **kwargs: Any) -> AsyncIterator[tuple[BlockStore, DiskTier, HostTier]]:
    """A 16-slot host tier over a 256-block disk tier; on the way out, the invariants, then no thread."""
    config = await asyncio.to_thread(DiskTierConfig, quota=256 * SLOT, path=path)
    tier_config = small_config(quota=16 * SLOT, max_quota=16 * SLOT, slot_size=SLOT, commit_unit=SLOT * 16)
    async with HostTier(tier_config) as tier, DiskTier(config, block_size=SLOT, fingerprint="m") as disk:
        await tier.wait_resident()
        async with BlockStore(tier, disk=disk, admit_after=1, **kwargs) as store:
            yield store, disk, tier
            if not store.closed:
                store.check_invariants(sole_user=True)
        assert tier.statistics().slots_allocated == 0
        settled(disk)
    await wait_no_library_threads()


async def load_pages(store: BlockStore, keys: list[bytes]) -> list[bytes]:
    out = np.zeros((len(keys), SLOT), dtype=np.uint8)
    await store.load(keys, out)
    return [row.tobytes() for row in out]


async def on_disk_only(store: BlockStore, keys: list[bytes]) -> None:
    """Store ``keys``, load them once (admitted), wait for the write-back, push them out of the host tier."""
    await store.store(keys, [page(i) for i in range(len(keys))])
    await load_pages(store, keys)
    await eventually(lambda: store.statistics().written_back >= len(keys))
    await store.store([b"other%d" % i for i in range(16)], [page(100 + i) for i in range(16)])
    assert not any(k in store for k in keys)


KEYS = [b"k%d" % i for i in range(4)]


async def test_a_disk_tier_closed_under_the_store_is_a_miss(tmp_path: Path) -> None:
    """A load of blocks the closed disk tier had listed raised TierClosedError (the store looked closed)."""
    async with cache(tmp_path) as (store, disk, _):
        await on_disk_only(store, KEYS)
        await disk.aclose()
        assert store.lookup(KEYS) == 0
        with pytest.raises(BlockNotFound, match=repr(KEYS[0])):
            await store.load(KEYS, np.zeros((4, SLOT), dtype=np.uint8))
        await store.store([b"new"], [page(50)])
        assert await load_pages(store, [b"new"]) == [page(50)]  # no write-back, no error
        assert store.discard([b"new", KEYS[0]]) == 1
        store.check_invariants(sole_user=True)


async def test_a_disk_tier_closed_during_the_write_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with cache(tmp_path) as (store, disk, _):
        await store.store(KEYS, [page(i) for i in range(4)])
        with gate(monkeypatch, "write_blocks") as g:
            await load_pages(store, KEYS)
            await g.reached()
            assert store.statistics().blocks_pinned == 4  # pinned while their bytes go to disk
            closing = asyncio.create_task(disk.aclose())
            await g.release()
            await closing
        await eventually(lambda: store.statistics().blocks_pinned == 0)
        assert store.statistics().written_back == 4
        assert await load_pages(store, KEYS) == [page(i) for i in range(4)]
    assert await reopened_store_keys(tmp_path) == set(KEYS)


async def reopened_store_keys(path: Path) -> set[Key]:
    config = await asyncio.to_thread(DiskTierConfig, quota=256 * SLOT, path=path)
    async with DiskTier(config, block_size=SLOT, fingerprint="m") as disk:
        settled(disk)
        return {k for k in [*KEYS, b"k9"] if k in disk}


async def test_a_disk_tier_closed_during_a_promotion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with cache(tmp_path) as (store, disk, _):
        await on_disk_only(store, KEYS)
        with gate(monkeypatch, "read_blocks") as g:
            loading = asyncio.create_task(load_pages(store, KEYS[:2]))
            await g.reached()
            closing = asyncio.create_task(disk.aclose())
            await g.release()
            assert await loading == [page(0), page(1)]  # the read in flight finished before the close
            await closing
        with pytest.raises(BlockNotFound):
            await load_pages(store, KEYS[2:])


async def test_the_store_closed_during_the_write_back_and_its_load_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with cache(tmp_path) as (store, disk, tier):
        await store.store(KEYS, [page(i) for i in range(4)])
        with gate(monkeypatch, "write_blocks") as g:
            loading = asyncio.create_task(load_pages(store, KEYS))
            await g.reached()
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading
            closing = asyncio.create_task(store.aclose())
            await asyncio.sleep(0.05)
            assert not closing.done()  # its close waits for the write-back
            closing.cancel()  # and a cancelled close still finishes it
            await g.release()
            with contextlib.suppress(asyncio.CancelledError):
                await closing
        assert store.closed and tier.statistics().slots_allocated == 0
        assert all(k in disk for k in KEYS)


async def test_a_discard_during_the_write_back_drops_the_block_from_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The discarded block used to be published on disk when its write settled: it came back."""
    async with cache(tmp_path) as (store, disk, _):
        await store.store(KEYS, [page(i) for i in range(4)])
        with gate(monkeypatch, "write_blocks") as g:
            await load_pages(store, KEYS)
            await g.reached()
            assert store.discard([KEYS[0]]) == 1
            await g.release()
        await eventually(lambda: store.statistics().blocks_pinned == 0)
        assert KEYS[0] not in disk and all(k in disk for k in KEYS[1:])
        assert store.lookup(KEYS) == 0
    assert await reopened_store_keys(tmp_path) == set(KEYS[1:])


async def test_a_discard_during_a_promotion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The discarded block used to land in the host tier once its read ended, after the discard had
    returned (and the load's hit wrote it back to the disk): it is a miss of the load instead."""
    async with cache(tmp_path) as (store, disk, _):
        await on_disk_only(store, KEYS)
        with gate(monkeypatch, "read_blocks") as g:
            loading = asyncio.create_task(load_pages(store, KEYS))
            await g.reached()
            assert store.discard([KEYS[1]]) == 0  # not ready yet: nothing dropped in the host tier
            await g.release()
            with pytest.raises(BlockNotFound, match=repr(KEYS[1])):
                await loading
        await eventually(lambda: store.statistics().in_flight == 0)
        assert KEYS[1] not in store and KEYS[1] not in disk
        assert await load_pages(store, [KEYS[0], KEYS[2], KEYS[3]]) == [page(i) for i in (0, 2, 3)]


async def test_a_store_of_the_key_a_load_is_promoting_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with cache(tmp_path) as (store, _, _):
        await on_disk_only(store, KEYS)
        with gate(monkeypatch, "read_blocks") as g:
            loading = asyncio.create_task(load_pages(store, KEYS))
            await g.reached()
            storing = asyncio.create_task(store.store([KEYS[2], b"fresh"], [page(77), page(78)]))
            await asyncio.sleep(0.01)
            await g.release()
            assert await loading == [page(i) for i in range(4)]
            result = await storing
        assert result.present == (KEYS[2],) and result.stored == (b"fresh",)
        assert await load_pages(store, [KEYS[2]]) == [page(2)]


async def test_two_loads_promoting_the_same_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with cache(tmp_path) as (store, _, _):
        await on_disk_only(store, KEYS)
        with gate(monkeypatch, "read_blocks") as g:
            first = asyncio.create_task(load_pages(store, KEYS))
            second = asyncio.create_task(load_pages(store, KEYS[::-1]))
            await g.reached()
            await asyncio.sleep(0.01)
            await g.release()
            assert await first == [page(i) for i in range(4)]
            assert await second == [page(i) for i in range(4)][::-1]
        assert store.statistics().promoted == 4


async def test_a_shrink_while_a_promotion_holds_slots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with cache(tmp_path) as (store, _, tier):
        await on_disk_only(store, KEYS)
        with gate(monkeypatch, "read_blocks") as g:
            loading = asyncio.create_task(load_pages(store, KEYS))
            await g.reached()
            with contextlib.suppress(QuotaError):  # refused if a promoted block lies past the new end
                await store.resize(8 * SLOT)
            store.check_invariants()
            await g.release()
            assert await loading == [page(i) for i in range(4)]
        store.check_invariants(sole_user=True)
        assert tier.slots_total in (8, 16)


async def test_a_failing_sibling_cancels_a_load_from_disk(tmp_path: Path) -> None:
    async def fail() -> None:
        await asyncio.sleep(0)
        raise LookupError("sibling")

    async with cache(tmp_path) as (store, _, _):
        await on_disk_only(store, KEYS)
        with pytest.raises(ExceptionGroup):
            async with asyncio.TaskGroup() as group:
                group.create_task(load_pages(store, KEYS))
                group.create_task(store.store([b"x"], [page(9)]))
                group.create_task(fail())
        store.check_invariants(sole_user=True)
        assert await load_pages(store, KEYS) == [page(i) for i in range(4)]


@pytest.mark.parametrize("delay", DELAYS)
async def test_a_load_from_disk_cancelled_at_any_point(tmp_path: Path, delay: float) -> None:
    async with cache(tmp_path) as (store, _, _):
        await on_disk_only(store, KEYS)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(load_pages(store, KEYS), delay)
        store.check_invariants(sole_user=True)
        assert await load_pages(store, KEYS) == [page(i) for i in range(4)]


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 6, 10])
async def test_a_load_from_disk_cancelled_after_some_loop_turns(tmp_path: Path, steps: int) -> None:
    async with cache(tmp_path) as (store, _, _):
        await on_disk_only(store, KEYS)
        task = asyncio.create_task(load_pages(store, KEYS))
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        store.check_invariants(sole_user=True)
        assert await load_pages(store, KEYS) == [page(i) for i in range(4)]


async def test_the_invariant_check_during_a_write_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check took the write-back's pins for pins that outlived their load."""
    async with cache(tmp_path) as (store, _, _):
        await store.store(KEYS, [page(i) for i in range(4)])
        with gate(monkeypatch, "write_blocks") as g:
            await load_pages(store, KEYS)
            await g.reached()
            store.check_invariants(sole_user=True)
            await g.release()
        await eventually(lambda: store.statistics().blocks_pinned == 0)


# -- storms ---------------------------------------------------------------------------------


async def test_a_write_that_finds_every_block_held_by_reads_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = Pages(4), Pages(4)
    src.fill(30)
    async with await open_disk(tmp_path, blocks=2) as disk:
        await disk.write([0, 1], src.addresses([0, 1]), [BLOCK] * 2)
        with gate(monkeypatch, "read_blocks") as g:
            reading = asyncio.create_task(disk.read([0, 1], dst.addresses([0, 1])))
            await g.reached()
            assert await disk.write([2], src.addresses([2]), [BLOCK]) == ()  # nothing to evict
            assert disk.statistics().writes_skipped == 1
            assert disk.discard([0]) == 1  # its slot comes back when the read lets go
            await g.release()
            assert await reading == (True, True)
        settled(disk)
        assert await disk.write([2], src.addresses([2]), [BLOCK]) == (2,)
    assert await reopened(tmp_path, [0, 1, 2], blocks=2) == {1, 2}


async def test_a_journal_of_many_drops_is_compacted_at_open(tmp_path: Path) -> None:
    src = Pages(2)
    src.fill(31)
    async with await open_disk(tmp_path, blocks=4) as disk:
        for i in range(700):
            await disk.write([i], src.addresses([i % 2]), [BLOCK])
            if i % 7:
                disk.discard([i])
        held = {i for i in range(700) if i in disk}
        directory = disk.directory
    size = (await asyncio.to_thread(os.stat, Path(directory, "journal"))).st_size
    assert await reopened(tmp_path, list(range(700)), blocks=4) == held
    assert (await asyncio.to_thread(os.stat, Path(directory, "journal"))).st_size < size
    assert await reopened(tmp_path, list(range(700)), blocks=4) == held


@pytest.mark.parametrize("seed", range(6))
async def test_a_storm_of_writes_reads_discards_and_cancellations(tmp_path: Path, seed: int) -> None:
    """Random calls, some cancelled at random points, on a small tier: every read that arrives is the
    key's own bytes, the slots always add up, and a reopen finds exactly the blocks held at the close."""
    rng = np.random.default_rng(seed)
    src, dst = Pages(16), Pages(16)
    src.fill(32 + seed)
    disk = DiskTier(await config(tmp_path, blocks=12), block_size=BLOCK, fingerprint="model-a", io_threads=3)

    async def write(keys: list[int]) -> None:
        await disk.write(keys, src.addresses([k % 16 for k in keys]), [BLOCK - k for k in keys])

    async def read(keys: list[int], at: int) -> None:
        got = await disk.read(keys, dst.addresses(range(at, at + len(keys))))
        for i, (key, ok) in enumerate(zip(keys, got, strict=True)):
            if ok:
                n = BLOCK - key
                assert np.array_equal(dst.array[at + i, :n], src.array[key % 16, :n]), key

    async with disk:
        for _ in range(60):
            tasks = []
            for lane in range(3):
                keys = [int(k) for k in rng.choice(40, size=int(rng.integers(1, 6)), replace=False)]
                op = rng.integers(3)
                if op == 0:
                    tasks.append(asyncio.create_task(write(keys)))
                elif op == 1:
                    tasks.append(asyncio.create_task(read(keys, lane * 5)))
                else:
                    disk.discard(keys)
            for task in tasks:
                if rng.random() < 0.3:
                    delay = float(rng.choice([0.0, 0.0001, 0.0005, 0.002]))
                    asyncio.get_running_loop().call_later(delay, task.cancel)
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            settled(disk)
        held: set[Key] = {k for k in range(40) if k in disk}
    await wait_no_library_threads()
    assert await reopened(tmp_path, list(range(40)), blocks=12) == held


class SlotGate:
    """Holds the store's calls at the point where they take host slots, until ``release()``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = 0
        self.event = asyncio.Event()
        real = BlockStore._take_slots

        async def held(store: BlockStore, *args: Any) -> None:
            self.entered += 1
            await self.event.wait()
            await real(store, *args)

        monkeypatch.setattr(BlockStore, "_take_slots", held)

    async def reached(self) -> None:
        await eventually(lambda: self.entered >= 1, within=30)

    def release(self) -> None:
        self.event.set()


async def test_a_block_rewritten_on_disk_at_another_length_during_a_promotion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slots were booked with the length seen before they were taken, and the read brought the new,
    shorter block: the load returned its bytes followed by whatever the slot held before."""
    async with cache(tmp_path) as (store, disk, _):
        await on_disk_only(store, KEYS)
        slots = SlotGate(monkeypatch)
        loading = asyncio.create_task(load_pages(store, KEYS[:1]))
        await slots.reached()
        disk.discard(KEYS[:1])
        short = np.frombuffer(page(66), dtype=np.uint8)[: SLOT // 2].copy()
        assert await disk.write(KEYS[:1], [short.ctypes.data], [SLOT // 2]) == (KEYS[0],)
        slots.release()
        with pytest.raises(BlockNotFound):
            await loading
        monkeypatch.undo()
        assert KEYS[0] not in store
        out = np.zeros((1, SLOT), dtype=np.uint8)
        await store.load(KEYS[:1], out)  # the block as it is now, its length with it
        assert out[0, : SLOT // 2].tobytes() == short.tobytes()
        assert store.statistics().bytes_loaded >= SLOT // 2


async def test_a_disk_tier_closed_while_a_promotion_waits_for_host_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with cache(tmp_path) as (store, disk, _):
        await on_disk_only(store, KEYS)
        slots = SlotGate(monkeypatch)
        loading = asyncio.create_task(load_pages(store, KEYS))
        await slots.reached()
        await disk.aclose()
        slots.release()
        with pytest.raises(BlockNotFound):
            await loading
        monkeypatch.undo()
        store.check_invariants(sole_user=True)


async def test_the_store_closed_during_a_promotion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with cache(tmp_path) as (store, _, tier):
        await on_disk_only(store, KEYS)
        with gate(monkeypatch, "read_blocks") as g:
            loading = asyncio.create_task(load_pages(store, KEYS))
            await g.reached()
            closing = asyncio.create_task(store.aclose())
            await asyncio.sleep(0.05)
            assert not closing.done()  # the load in flight finishes first
            await g.release()
            assert await loading == [page(i) for i in range(4)]
            await closing
        assert tier.statistics().slots_allocated == 0


async def test_blocks_read_into_overlapping_memory_are_refused(tmp_path: Path) -> None:
    """Read on two threads into the same memory, good blocks failed each other's checksums and were dropped."""
    src, dst = Pages(8), Pages(8)
    src.fill(40)
    async with await open_disk(tmp_path) as disk:
        await disk.write(list(range(8)), src.addresses(range(8)), [BLOCK] * 8)
        for addresses in (
            [dst.base] * 8,
            [dst.base + i * 4096 for i in range(8)],
            [*dst.addresses(range(7)), dst.base],
        ):
            with pytest.raises(ValueError, match="overlapping"):
                await disk.read(list(range(8)), addresses)
        with pytest.raises(ValueError, match="overlapping"):
            await disk.read([3, 3], [dst.base, dst.base + 1])
        small = await disk.write([b"s"], src.addresses([0]), [100])
        assert small == (b"s",)
        # unaligned memory is read as given, aligned memory in whole pages: these do not overlap
        assert await disk.read([b"s", 1], [dst.base + 1, dst.base + 4096]) == (True, True)
        assert await disk.read([b"s", 1, 99], [dst.base, dst.base + 4096, dst.base]) == (True, True, False)
        s = disk.statistics()
        assert len(disk) == 9 and s.checksum_failures == 0
        settled(disk)
        assert await disk.read(list(range(8)), dst.addresses(range(8))) == (True,) * 8
    assert np.array_equal(src.array, dst.array)


async def test_a_load_naming_a_block_on_disk_twice(tmp_path: Path) -> None:
    async with cache(tmp_path) as (store, _, _):
        await on_disk_only(store, KEYS)
        assert await load_pages(store, [KEYS[1], KEYS[0], KEYS[1]]) == [page(1), page(0), page(1)]
        assert store.statistics().promoted == 2


async def test_a_shrink_while_the_write_back_pins_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with cache(tmp_path) as (store, disk, tier):
        await store.store(
            [b"o%d" % i for i in range(12)] + KEYS, [page(200 + i) for i in range(12)] + [page(i) for i in range(4)]
        )
        with gate(monkeypatch, "write_blocks") as g:
            await load_pages(store, KEYS)
            await g.reached()
            with contextlib.suppress(QuotaError):  # the pinned blocks lie past the new end
                await store.resize(8 * SLOT)
            store.check_invariants()
            await g.release()
        await eventually(lambda: store.statistics().blocks_pinned == 0)
        assert all(k in disk for k in KEYS)
        store.check_invariants(sole_user=True)
        assert tier.slots_total in (8, 16)


async def test_a_write_back_the_disk_refuses_is_tried_again_later(tmp_path: Path) -> None:
    async with cache(tmp_path) as (store, disk, _):
        await store.store(KEYS, [page(i) for i in range(4)])
        with file_size_limit(1):  # every write to the data file fails
            await load_pages(store, KEYS)
            await eventually(lambda: store.statistics().blocks_pinned == 0 and disk.statistics().write_errors == 4)
        assert not any(k in disk for k in KEYS) and store.statistics().written_back == 0
        await load_pages(store, KEYS)  # hit again: admitted again
        await eventually(lambda: store.statistics().written_back == 4)
        assert all(k in disk for k in KEYS)


async def test_queries_tell_keys_from_what_only_compares_equal(tmp_path: Path) -> None:
    """``True in disk`` and ``1.0 in disk`` answered for the block of key 1."""
    src = Pages(1)
    src.fill(41)
    async with await open_disk(tmp_path) as disk:
        await disk.write([1, b"b"], src.addresses([0, 0]), [BLOCK, 10])
        assert 1 in disk and np.int64(1) in disk and bytearray(b"b") in disk
        assert True not in disk and 1.0 not in disk and "b" not in disk and [1] not in disk
        assert disk.lookup([np.int64(1), memoryview(b"b")]) == 2
        with pytest.raises(TypeError):
            disk.lookup([True])
        with pytest.raises(TypeError):
            disk.length(1.0)  # type: ignore[arg-type]
        assert disk.length(np.int64(1)) == BLOCK and disk.length(bytearray(b"b")) == 10  # type: ignore[arg-type]


@pytest.mark.parametrize("delay", DELAYS)
async def test_an_open_cancelled_at_any_point_leaves_nothing(tmp_path: Path, delay: float) -> None:
    src = Pages(1)
    src.fill(42)
    async with await open_disk(tmp_path) as disk:
        await disk.write([1], src.addresses([0]), [BLOCK])
    disk = await open_disk(tmp_path)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(disk.__aenter__(), delay)
    await disk.aclose()
    await wait_no_library_threads()
    assert await reopened(tmp_path, [1]) == {1}  # the lock was released, the journal kept


async def test_closes_cancelled_and_repeated_while_a_write_is_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = Pages(4)
    src.fill(43)
    disk = await DiskTier.open(await config(tmp_path), block_size=BLOCK, fingerprint="model-a")
    with gate(monkeypatch, "write_blocks") as g:
        writing = asyncio.create_task(disk.write([0, 1, 2, 3], src.addresses(range(4)), [BLOCK] * 4))
        await g.reached()
        closes = [asyncio.create_task(disk.aclose()) for _ in range(3)]
        await asyncio.sleep(0.01)
        closes[0].cancel()  # the close that runs the teardown: it still finishes it
        closes[1].cancel()
        with pytest.raises(TierClosedError):
            await disk.write([9], src.addresses([0]), [BLOCK])
        await g.release()
        assert await writing == (0, 1, 2, 3)
        for close in closes:
            with contextlib.suppress(asyncio.CancelledError):
                await close
    assert disk.closed
    settled(disk)
    await wait_no_library_threads()
    assert await reopened(tmp_path, [0, 1, 2, 3, 9]) == {0, 1, 2, 3}


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_sync_that_fails_at_close_still_closes_every_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The data file's failed fsync skipped the closes after it: both files' descriptors were left open."""
    src = Pages(1)
    src.fill(44)
    before = await asyncio.to_thread(open_descriptors)
    disk = await DiskTier.open(await config(tmp_path), block_size=BLOCK, fingerprint="model-a")
    await disk.write([1], src.addresses([0]), [BLOCK])

    def sync(data: DataFile) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(DataFile, "sync", sync)
    with pytest.raises(OSError, match="Input/output"):
        await disk.aclose()
    monkeypatch.undo()
    assert disk.closed
    await wait_no_library_threads()
    assert await asyncio.to_thread(open_descriptors) == before
    assert await reopened(tmp_path, [1]) == {1}


async def test_a_reopen_with_a_smaller_then_a_larger_quota(tmp_path: Path) -> None:
    src, dst = Pages(8), Pages(8)
    src.fill(45)
    keys: list[Key] = list(range(8))
    async with await open_disk(tmp_path, blocks=8) as disk:
        await disk.write(keys, src.addresses(range(8)), [BLOCK] * 8)
    async with await open_disk(tmp_path, blocks=4) as disk:
        settled(disk)
        kept = [k for k in keys if k in disk]
        assert len(kept) == 4 and disk.statistics().free == 0
        assert await disk.read(kept, dst.addresses(range(4))) == (True,) * 4
        assert await disk.write([100], src.addresses([0]), [BLOCK]) == (100,)  # evicts one
        settled(disk)
    async with await open_disk(tmp_path, blocks=16) as disk:
        settled(disk)
        held = {k for k in [*keys, 100] if k in disk}
        assert 100 in held and len(held) >= 4
        got = await disk.read(sorted(held, key=int), dst.addresses(range(len(held))))
        for i, key in enumerate(sorted(held, key=int)):  # every block found is intact, or a miss
            if got[i]:
                assert np.array_equal(dst.array[i], src.array[key % 100])
        settled(disk)


async def test_a_slot_taken_again_at_once_keeps_its_new_bytes(tmp_path: Path) -> None:
    src, dst = Pages(8), Pages(8)
    src.fill(46)
    async with await open_disk(tmp_path) as disk:
        await disk.write(list(range(8)), src.addresses(range(8)), [BLOCK] * 8)
        assert disk.discard(list(range(6))) == 6
        for round_ in range(60):
            key = 100 + round_
            assert await disk.write([key], src.addresses([round_ % 8]), [BLOCK]) == (key,)
            assert await disk.read([key], dst.addresses([0])) == (True,), (round_, disk.statistics())
            assert np.array_equal(dst.array[0], src.array[round_ % 8])
            disk.discard([key])
        settled(disk)
        assert await disk.read([6, 7], dst.addresses([6, 7])) == (True, True)


@pytest.mark.parametrize("io_threads", [1, 4])
async def test_a_discard_just_before_the_close_is_kept(tmp_path: Path, io_threads: int) -> None:
    src = Pages(8)
    src.fill(47)
    disk = DiskTier(await config(tmp_path), block_size=BLOCK, fingerprint="model-a", io_threads=io_threads)
    async with disk:
        await disk.write(list(range(8)), src.addresses(range(8)), [BLOCK] * 8)
        assert disk.discard(list(range(0, 8, 2))) == 4
    await wait_no_library_threads()
    assert await reopened(tmp_path, list(range(8))) == {1, 3, 5, 7}


@pytest.mark.parametrize("meta", [b"{not json", b'{"layout": 0}', b"[]"])
async def test_a_directory_of_another_layout_starts_afresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, meta: bytes
) -> None:
    src = Pages(1)
    src.fill(48)
    async with await open_disk(tmp_path) as disk:
        await disk.write([1], src.addresses([0]), [BLOCK])
        directory = disk.directory
    await asyncio.to_thread(Path(directory, "tier.json").write_bytes, meta)
    async with await open_disk(tmp_path) as disk:
        assert len(disk) == 0 and "starting it empty" in caplog.text
        settled(disk)
        await disk.write([2], src.addresses([0]), [BLOCK])
    assert await reopened(tmp_path, [1, 2]) == {2}
