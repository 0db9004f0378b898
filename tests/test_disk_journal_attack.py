"""Attacks on the disk journal's format 2: a journal cut at every byte of its last records, and a
format-1 journal's rewrite killed (SIGKILL, in a child process) before and after its rename.

Each reopen serves no wrong bytes, and keeps every block whose record was whole on file.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from aiokvtier import DiskTierBusy

from .test_disk import BLOCK, Pages, open_disk
from .test_disk_journal import found_intact
from .test_disk_journal_forgery import journal_of, old_journal, read, src, write

pytestmark = pytest.mark.timeout(120)

__all__ = ["src"]  # the fixture, used by name
_ROOT = str(Path(__file__).resolve().parents[1])


async def test_a_journal_cut_at_every_byte_of_its_last_records(tmp_path: Path, src: Pages) -> None:
    async with await open_disk(tmp_path) as disk:
        for i in range(4):  # a record an append
            assert await disk.write([i], src.addresses([i]), [BLOCK]) == (i,)
        path = journal_of(disk)
    data = await read(path)
    record = 27 + 2 + 8  # the fields, an int key's two bytes, the tag
    header = len(data) - 4 * record
    assert header > 0
    for cut in range(len(data) - 2 * record - 1, len(data) + 1):
        await write(path, data[:cut])
        whole = {k for k in range(4) if header + (k + 1) * record <= cut}
        assert await found_intact(tmp_path, src, {k: k for k in range(4)}) == whole, cut
    async with await open_disk(tmp_path) as disk:  # the last cut's journal takes records again
        assert await disk.write([b"after"], src.addresses([0]), [BLOCK]) == (b"after",)
    assert await found_intact(tmp_path, src, {0: 0, 1: 1, 2: 2, 3: 3, b"after": 0}) == {0, 1, 2, 3, b"after"}


CHILD = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from aiokvtier import DiskTier, DiskTierConfig

    path, when = sys.argv[1], sys.argv[2]
    real_replace, real_fsync = os.replace, os.fsync

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def replace(src, dst, *args, **kwargs):
        if str(dst).endswith("journal") and when == "before-rename":
            die()
        if str(dst).endswith("journal") and when == "hold":
            print("holding", flush=True)
            signal.pause()
        real_replace(src, dst, *args, **kwargs)
        if str(dst).endswith("journal") and when == "after-rename":
            die()

    def fsync(fd):
        if when == "before-sync" and os.readlink(f"/proc/self/fd/{fd}").endswith("journal.new"):
            die()
        real_fsync(fd)

    os.replace, os.fsync = replace, fsync

    async def main() -> None:
        config = DiskTierConfig(quota=64 * 65536, path=path)
        async with DiskTier(config, block_size=65536, fingerprint="model-a"):
            pass

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("when", ["before-sync", "before-rename", "after-rename"])
async def test_a_format_1_rewrite_killed_midway_loses_no_block(tmp_path: Path, src: Pages, when: str) -> None:
    await old_journal(tmp_path, src, b"".join)
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, str(tmp_path), when, env={"PYTHONPATH": _ROOT}
    )
    assert await child.wait() == -signal.SIGKILL
    for _ in range(2):  # the reopen rewrites (or keeps) it; the next finds the same
        assert await found_intact(tmp_path, src, {k: k for k in range(4)}) == {0, 1, 2, 3}
    async with await open_disk(tmp_path) as disk:  # format 2 by now: it takes records
        assert await disk.write([b"new"], src.addresses([1]), [BLOCK]) == (b"new",)
    assert await found_intact(tmp_path, src, {0: 0, 1: 1, 2: 2, 3: 3, b"new": 1}) == {0, 1, 2, 3, b"new"}


async def test_a_second_opener_during_a_rewrite_is_busy_and_finds_every_block_after(tmp_path: Path, src: Pages) -> None:
    await old_journal(tmp_path, src, b"".join)
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, str(tmp_path), "hold", env={"PYTHONPATH": _ROOT}, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        assert await asyncio.wait_for(child.stdout.readline(), 60) == b"holding\n"
        disk = await open_disk(tmp_path)
        with pytest.raises(DiskTierBusy, match="open elsewhere"):
            await disk.__aenter__()
        await disk.aclose()
    finally:
        child.kill()
        await child.wait()
    assert await found_intact(tmp_path, src, {k: k for k in range(4)}) == {0, 1, 2, 3}
