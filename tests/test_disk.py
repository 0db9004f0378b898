"""The disk tier: bit-exact round trips, restart and SIGKILL, torn and flipped bytes, two openers, full disks."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import resource
import signal
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from aiokvtier import DiskTier, DiskTierBusy, DiskTierConfig, HostTier

from .helpers import KiB, MiB, small_config
from .invariants import wait_no_library_threads

pytestmark = pytest.mark.timeout(120)

BLOCK = 64 * KiB


class Pages:
    """Page-aligned anonymous memory, ``n`` blocks of ``BLOCK`` bytes."""

    def __init__(self, n: int) -> None:
        self.map = mmap.mmap(-1, n * BLOCK)
        self.array = np.frombuffer(self.map, dtype=np.uint8).reshape(n, BLOCK)
        self.base = self.array.ctypes.data

    def addresses(self, ids: range | list[int]) -> list[int]:
        return [self.base + i * BLOCK for i in ids]

    def fill(self, seed: int) -> None:
        self.array[:] = np.random.default_rng(seed).integers(0, 256, self.array.shape, dtype=np.uint8)


async def config(path: Path, blocks: int = 64) -> DiskTierConfig:
    """Validating the path stats it: off the loop."""
    return await asyncio.to_thread(DiskTierConfig, quota=blocks * BLOCK, path=path)


async def open_disk(path: Path, blocks: int = 64, fingerprint: str = "model-a") -> DiskTier:
    """A tier to open with ``async with``."""
    return DiskTier(await config(path, blocks), block_size=BLOCK, fingerprint=fingerprint)


async def test_blocks_round_trip_bit_exact_with_direct_io(tmp_path: Path) -> None:
    src, dst = Pages(16), Pages(16)
    src.fill(1)
    keys: list[bytes | int] = [b"k%d" % i for i in range(8)] + list(range(8))
    lengths = [BLOCK] * 8 + [1000 + i for i in range(8)]
    async with await open_disk(tmp_path) as disk:
        assert await disk.write(keys, src.addresses(range(16)), lengths) == tuple(keys)
        assert disk.lookup(keys) == 16 and b"k0" in disk and 0 in disk and b"\x00" not in disk
        assert await disk.read(keys[::-1], dst.addresses(range(16))) == (True,) * 16
        for i in range(16):
            assert np.array_equal(dst.array[15 - i, : lengths[i]], src.array[i, : lengths[i]])
        s = disk.statistics()
        assert s.direct_io and s.buffered_why is None  # ext4 and tmpfs (Linux 6.6+) both take O_DIRECT
        assert (s.blocks, s.hits, s.bytes_written, s.queue_depth) == (16, 16, sum(lengths), 0)
        assert s.bytes_stored == sum(lengths)
        assert disk.discard(keys[:2] + keys[8:10]) == 4
        assert disk.statistics().bytes_stored == sum(lengths) - 2 * BLOCK - 1000 - 1001
    await wait_no_library_threads()


async def test_unaligned_memory_goes_through_buffered_io(tmp_path: Path) -> None:
    buf = bytearray(3 * BLOCK + 1)
    arr = np.frombuffer(buf, dtype=np.uint8)
    address = arr.ctypes.data + (1 if arr.ctypes.data % 4096 == 0 else 0)
    ctypes_view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * BLOCK).from_address(address))
    ctypes_view[:] = np.arange(BLOCK, dtype=np.uint64).astype(np.uint8)
    out = Pages(1)
    async with await open_disk(tmp_path) as disk:
        assert await disk.write([b"odd"], [address], [BLOCK]) == (b"odd",)
        assert await disk.read([b"odd"], out.addresses([0])) == (True,)
    assert np.array_equal(out.array[0], ctypes_view)


async def test_a_reopened_tier_finds_its_blocks_and_another_fingerprint_does_not(tmp_path: Path) -> None:
    src, dst = Pages(8), Pages(8)
    src.fill(2)
    async with await open_disk(tmp_path) as disk:
        await disk.write(list(range(8)), src.addresses(range(8)), [BLOCK] * 8)
    async with await open_disk(tmp_path, fingerprint="model-b") as other:
        assert len(other) == 0 and other.directory != disk.directory
    async with await open_disk(tmp_path) as again:
        assert again.statistics().recovered_blocks == 8 and again.statistics().bytes_stored == 8 * BLOCK
        assert await again.read(list(range(8)), dst.addresses(range(8))) == (True,) * 8
    assert np.array_equal(src.array, dst.array)


async def test_a_second_opener_is_refused_clearly(tmp_path: Path) -> None:
    async with await open_disk(tmp_path) as disk:
        with pytest.raises(DiskTierBusy, match=f"process {os.getpid()}"):
            await DiskTier.open(await config(tmp_path), block_size=BLOCK, fingerprint="model-a")
        out, err = await run(sys.executable, "-c", _OPEN_ONCE, str(tmp_path))
        assert "DiskTierBusy" in out, out + err
        assert not disk.closed
    async with await open_disk(tmp_path):  # released at close
        pass


_OPEN_ONCE = textwrap.dedent(
    """
    import asyncio, sys
    from aiokvtier import DiskTier, DiskTierConfig

    async def main():
        try:
            config = DiskTierConfig(quota=64 * 65536, path=sys.argv[1])
            await DiskTier.open(config, block_size=65536, fingerprint="model-a")
        except Exception as exc:
            print(type(exc).__name__, exc)

    asyncio.run(main())
    """
)


def damage(directory: str) -> None:
    """Flip a bit in odd slots, zero ten bytes in even ones, and leave a torn record at the journal's end."""
    with open(Path(directory, "blocks"), "r+b") as f:  # which slot holds which key is the journal's: all of them
        for slot in range(4):
            f.seek(slot * BLOCK + 100)
            byte = f.read(1)
            f.seek(slot * BLOCK + 100)
            f.write(bytes([byte[0] ^ 0x40]) if slot % 2 else b"\x00" * 10)
    with open(Path(directory, "journal"), "ab") as f:
        f.write(b"AKVJ\x01torn")  # a record cut by a crash


async def run(*argv: str) -> tuple[str, str]:
    child = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(child.communicate(), 60)
    assert child.returncode is not None
    return out.decode(), err.decode()


async def test_flipped_and_torn_bytes_are_misses_never_data(tmp_path: Path) -> None:
    src, dst = Pages(4), Pages(4)
    src.fill(3)
    async with await open_disk(tmp_path) as disk:
        await disk.write([0, 1, 2, 3], src.addresses(range(4)), [BLOCK] * 4)
        directory = disk.directory
    await asyncio.to_thread(damage, directory)
    async with await open_disk(tmp_path) as disk:
        assert len(disk) == 4
        got = await disk.read([0, 1, 2, 3], dst.addresses(range(4)))
        intact = [np.array_equal(src.array[i], dst.array[i]) for i in range(4)]
        assert all(ok == good for ok, good in zip(got, intact, strict=True))
        s = disk.statistics()
        assert s.checksum_failures == got.count(False) >= 2 and len(disk) == got.count(True)
        # the journal's torn tail was cut: records appended after it are read at the next open
        await disk.write([9], src.addresses([0]), [BLOCK])
    async with await open_disk(tmp_path) as disk:
        assert 9 in disk and len(disk) == got.count(True) + 1


async def test_a_full_tier_evicts_the_least_recently_used_block_no_read_holds(tmp_path: Path) -> None:
    src, dst = Pages(6), Pages(6)
    src.fill(4)
    async with await open_disk(tmp_path, blocks=4) as disk:
        await disk.write([0, 1, 2, 3], src.addresses(range(4)), [BLOCK] * 4)
        await disk.read([0], dst.addresses([0]))  # 0 becomes the most recent: 1 goes first
        assert await disk.write([4], src.addresses([4]), [BLOCK]) == (4,)
        assert 1 not in disk and {0, 2, 3, 4} <= {k for k in range(6) if k in disk}
        assert disk.statistics().evictions == 1
        assert await disk.read([4, 1], dst.addresses([4, 1])) == (True, False)
        assert np.array_equal(dst.array[4], src.array[4])


async def test_bad_input_changes_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of 4096"):
        DiskTier(await config(tmp_path), block_size=5000, fingerprint="m")
    with pytest.raises(ValueError, match="fingerprint"):
        DiskTier(await config(tmp_path), block_size=BLOCK, fingerprint="")
    with pytest.raises(ValueError, match="holds no"):
        DiskTier(await asyncio.to_thread(DiskTierConfig, quota=4096, path=tmp_path), block_size=BLOCK, fingerprint="m")
    src = Pages(2)
    async with await open_disk(tmp_path) as disk:
        with pytest.raises(ValueError, match="does not fit"):
            await disk.write([1], src.addresses([0]), [BLOCK + 1])
        with pytest.raises(ValueError, match="one address and one length per key"):
            await disk.write([1, 2], src.addresses([0]), [BLOCK])
        with pytest.raises(ValueError, match="one address per key"):
            await disk.read([1, 2], src.addresses([0]))
        assert len(disk) == 0 and disk.statistics().bytes_written == 0


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """Writes past ``nbytes`` fail with EFBIG (SIGXFSZ ignored): a disk that refuses the write."""
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


async def test_a_write_the_disk_refuses_is_skipped_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src, dst = Pages(8), Pages(8)
    src.fill(5)
    async with await open_disk(tmp_path, blocks=8) as disk:
        await disk.write([0], src.addresses([0]), [BLOCK])
        with file_size_limit(2 * BLOCK):  # slots 0 and 1 fit, the rest fail
            written = await disk.write(list(range(1, 8)), src.addresses(range(1, 8)), [BLOCK] * 7)
        assert 0 < len(written) < 7
        s = disk.statistics()
        assert s.write_errors == 7 - len(written) == s.writes_skipped
        assert "skipped a block" in caplog.text
        assert len(disk) == 1 + len(written)
        keys = [0, *written]
        assert await disk.read(keys, dst.addresses(range(len(keys)))) == (True,) * len(keys)
        # the slots of the failed writes came back: later writes use them
        assert len(await disk.write([100, 101], src.addresses([6, 7]), [BLOCK] * 2)) == 2


async def test_a_full_file_system_skips_blocks_and_keeps_serving(tmp_path: Path) -> None:
    mount = tmp_path / "small"
    await asyncio.to_thread(mount.mkdir)
    mounted = await asyncio.create_subprocess_exec(
        "mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount), stderr=asyncio.subprocess.PIPE
    )
    _, err = await mounted.communicate()
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root): {err.decode().strip()}")
    try:
        src, dst = Pages(16), Pages(16)
        src.fill(6)
        async with await open_disk(mount, blocks=16, fingerprint="m") as disk:
            written = await disk.write(list(range(16)), src.addresses(range(16)), [BLOCK] * 16)
            assert 0 < len(written) < 16 and disk.statistics().write_errors == 16 - len(written)
            ok = await disk.read(list(written), dst.addresses(range(len(written))))
            assert all(ok)
            for i, key in enumerate(written):
                assert isinstance(key, int) and np.array_equal(dst.array[i], src.array[key])
    finally:
        await run("umount", "-l", str(mount))


_STORM = textwrap.dedent(
    """
    import asyncio, mmap, sys
    import numpy as np
    from aiokvtier import DiskTier, DiskTierConfig

    async def main():
        block = 65536
        buf = mmap.mmap(-1, 64 * block)
        pages = np.frombuffer(buf, dtype=np.uint8).reshape(64, block)
        config = DiskTierConfig(quota=4096 * block, path=sys.argv[1])
        disk = await DiskTier.open(config, block_size=block, fingerprint="m")
        key = 0
        while True:
            for i in range(64):
                pages[i] = (key + i) % 251
            keys = list(range(key, key + 64))
            await disk.write(keys, [pages.ctypes.data + i * block for i in range(64)], [block] * 64)
            print(key + 63, flush=True)
            key += 64

    asyncio.run(main())
    """
)


async def test_sigkill_during_a_storm_of_writes_loses_no_returned_block(tmp_path: Path) -> None:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _STORM, str(tmp_path), stdout=asyncio.subprocess.PIPE
    )
    assert child.stdout is not None
    last = -1
    async with asyncio.timeout(60):
        while last < 64 * 12:
            line = await child.stdout.readline()
            assert line, "the writer died"
            last = int(line)
    child.send_signal(signal.SIGKILL)
    await child.wait()
    async with await open_disk(tmp_path, blocks=4096, fingerprint="m") as disk:
        assert disk.lookup(range(last + 1)) == last + 1  # every block whose write returned
        found = [k for k in range(last + 1 + 64 * 4) if k in disk]
        out = Pages(64)
        for start in range(0, len(found), 64):
            keys = found[start : start + 64]
            got = await disk.read(keys, out.addresses(range(len(keys))))
            for i, key in enumerate(keys):
                if got[i]:  # a block past the last one returned may be torn: then a miss, never wrong data
                    assert int(out.array[i, 0]) == key % 251 and int(out.array[i, -1]) == key % 251
                else:
                    assert key > last
        assert all(await disk.read(list(range(last + 1))[:64], out.addresses(range(64))))


@pytest.mark.parametrize("delay", [0.0, 0.0005, 0.002, 0.01])
async def test_cancelled_writes_and_reads_leave_a_consistent_tier(tmp_path: Path, delay: float) -> None:
    src, dst = Pages(32), Pages(32)
    src.fill(7)
    async with await open_disk(tmp_path, blocks=32) as disk:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(disk.write(list(range(32)), src.addresses(range(32)), [BLOCK] * 32), delay)
        s = disk.statistics()
        assert s.queue_depth == 0 and s.blocks + s.write_errors in (0, 32)  # not started, or run to its end
        stored = [k for k in range(32) if k in disk]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(disk.read(stored, dst.addresses(range(len(stored)))), delay)
        # every slot is free or holds a block: a second round stores the rest and reads all of it back
        await disk.write(list(range(32)), src.addresses(range(32)), [BLOCK] * 32)
        assert len(disk) == 32
        assert await disk.read(list(range(32)), dst.addresses(range(32))) == (True,) * 32
        assert np.array_equal(src.array, dst.array)
    await wait_no_library_threads()


async def test_blocks_move_between_tier_slots_and_disk(tmp_path: Path) -> None:
    async with HostTier(small_config(slot_size=BLOCK, quota=4 * MiB)) as tier, await open_disk(tmp_path) as disk:
        slots = await tier.allocate(8)
        for i, slot in enumerate(slots):
            tier.view(slot)[:] = bytes([i + 1]) * BLOCK
        addresses = tier.slot_addresses(slots).tolist()
        assert len(await disk.write([b"a%d" % i for i in range(8)], addresses, [BLOCK] * 8)) == 8
        back = await tier.allocate(8)
        assert all(await disk.read([b"a%d" % i for i in range(8)], tier.slot_addresses(back).tolist()))
        for i, slot in enumerate(back):
            assert bytes(tier.view(slot)) == bytes([i + 1]) * BLOCK
