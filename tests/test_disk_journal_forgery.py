"""The disk tier's journal against records spelled by key bytes, old files and torn headers.

A caller chooses key bytes, and the replay, stepping over damage, scans for
the next whole record: a key that spells one (magic, fields, a CRC32 anyone
can compute) was believed, and mapped a key of the attacker's choosing onto
another block's bytes. Records now carry a tag keyed by a salt that never
leaves the journal's file: a record built under any other salt is damage.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import xxhash

from aiokvtier import DiskTier
from aiokvtier._disk._journal import Entry, Journal, encode_key

from .invariants import wait_no_library_threads
from .test_disk import BLOCK, Pages, open_disk
from .test_disk_journal import JournalFaults, found_intact

pytestmark = pytest.mark.timeout(120)

Key = bytes | int
HEAD = struct.Struct("<4sBQIQH")
"""A record's fields in both formats: magic, op, slot, length, checksum, key length."""
PUT, DROP = 1, 2
VICTIM = b"victim"


def old_record(op: int, slot: int, length: int, checksum: int, key: Key) -> bytes:
    """A record of format 1: the fields, the key, a CRC32 of both (what anyone could make)."""
    raw = encode_key(key)
    body = HEAD.pack(b"AKVJ", op, slot, length, checksum, len(raw)) + raw
    return body + struct.pack("<I", zlib.crc32(body))


def salted_record(salt: bytes, op: int, slot: int, length: int, checksum: int, key: Key) -> bytes:
    """A record of format 2 under ``salt``: the fields, the key, a BLAKE2b of both keyed by the salt."""
    raw = encode_key(key)
    body = HEAD.pack(b"AKVJ", op, slot, length, checksum, len(raw)) + raw
    return body + hashlib.blake2b(body, key=salt, digest_size=8).digest()


def old_replay(data: bytes) -> dict[Key, tuple[int, int, int]]:
    """Format 1's replay as it was: past a bad record, the next magic that starts a whole CRC-valid one."""
    blocks: dict[Key, tuple[int, int, int]] = {}
    at = 0
    while at + HEAD.size + 4 <= len(data):
        magic, op, slot, length, checksum, klen = HEAD.unpack_from(data, at)
        end = at + HEAD.size + klen + 4
        body = data[at : end - 4]
        if (
            magic == b"AKVJ"
            and op in (PUT, DROP)
            and end <= len(data)
            and struct.pack("<I", zlib.crc32(body)) == data[end - 4 : end]
        ):
            raw = data[at + HEAD.size : end - 4]
            key: Key = raw[1:] if raw[:1] == b"b" else int.from_bytes(raw[1:], "little", signed=True)
            blocks.pop(key, None)
            if op == PUT:
                blocks[key] = (slot, length, checksum)
            at = end
            continue
        at = data.find(b"AKVJ", at + 1)
        if at < 0:
            break
    return blocks


def checksum(src: Pages, i: int) -> int:
    return xxhash.xxh3_64_intdigest(src.array[i].tobytes())


def journal_of(disk: DiskTier) -> Path:
    return Path(disk.directory, "journal")


async def read(path: Path) -> bytes:
    return await asyncio.to_thread(path.read_bytes)


async def write(path: Path, data: bytes) -> None:
    await asyncio.to_thread(path.write_bytes, data)


def damaged_at(data: bytes, at: int) -> bytes:
    flipped = bytearray(data)
    flipped[at] ^= 0x01
    return bytes(flipped)


Forge = Callable[[bytes, int], bytes]
"""The journal's salt and block 0's checksum -> the record a key will spell."""


async def plant(tmp_path: Path, src: Pages, forge: Forge) -> tuple[Path, bytes, int, int]:
    """Blocks 0, 1 and 2 written around one whose key spells ``forge(...)``. Returns the journal, its
    bytes, and where the planted key's own record starts and where its tag starts."""
    async with await open_disk(tmp_path) as disk:
        path = journal_of(disk)
        salt = (await read(path))[6:22]  # only the control uses it: an attacker never sees the file
        evil = b"<" + forge(salt, checksum(src, 0)) + b">"
        assert await disk.write([0], src.addresses([0]), [BLOCK]) == (0,)  # slot 0, the first one taken
        assert await disk.write([1], src.addresses([1]), [BLOCK]) == (1,)
        assert await disk.write([evil], src.addresses([3]), [BLOCK]) == (evil,)
        assert await disk.write([2], src.addresses([2]), [BLOCK]) == (2,)
    data = await read(path)
    key_at = data.find(b"b" + evil)
    assert HEAD.unpack_from(data, key_at - HEAD.size)[0] == b"AKVJ"
    return path, data, key_at - HEAD.size, key_at + 1 + len(evil)


def old_victim(salt: bytes, check: int) -> bytes:
    """Format 1's record of ``VICTIM`` in block 0's slot, with block 0's checksum."""
    return old_record(PUT, 0, BLOCK, check, VICTIM)


def guessed_victim(salt: bytes, check: int) -> bytes:
    """The same in format 2, under a salt of the attacker's own."""
    return salted_record(os.urandom(16), PUT, 0, BLOCK, check, VICTIM)


def true_victim(salt: bytes, check: int) -> bytes:
    """The same under the journal's own salt (what no attacker has)."""
    return salted_record(salt, PUT, 0, BLOCK, check, VICTIM)


@pytest.fixture
def src() -> Pages:
    pages = Pages(4)
    pages.fill(40)
    return pages


WANT: dict[Key, int] = {0: 0, 1: 1, 2: 2, VICTIM: 0}
"""Each key a reopen may find, and the block whose bytes it must read back."""


# -- records spelled by keys ---------------------------------------------------------------------


@pytest.mark.parametrize("where", ["op", "tag"])
@pytest.mark.parametrize("forge", [old_victim, guessed_victim], ids=["format-1", "another-salt"])
async def test_a_record_spelled_by_a_key_is_not_believed(tmp_path: Path, src: Pages, where: str, forge: Forge) -> None:
    """The planted key's own record is damaged (its op, or its tag): the replay steps over it into
    the key's bytes, where a whole record names block 0's slot under ``VICTIM``."""
    path, data, start, tag = await plant(tmp_path, src, forge)
    await write(path, damaged_at(data, start + 4 if where == "op" else tag))
    assert await found_intact(tmp_path, src, WANT) == {0, 1, 2}  # block 0 kept its slot and its bytes


async def test_the_format_1_replay_believed_the_record_a_key_spelled(src: Pages) -> None:
    """The attack above against the replay as it was: the key's record is taken."""
    evil = b"<" + old_victim(b"", checksum(src, 0)) + b">"
    keys: list[Key] = [0, 1, evil, 2]
    journal = b"".join(old_record(PUT, slot, BLOCK, 0, key) for slot, key in enumerate(keys))
    start = journal.find(b"b" + evil) - HEAD.size
    assert old_replay(journal)[evil] == (2, BLOCK, 0) and VICTIM not in old_replay(journal)
    assert old_replay(damaged_at(journal, start + 4))[VICTIM] == (0, BLOCK, checksum(src, 0))


async def test_only_the_journals_own_salt_makes_a_record_a_key_spells_believed(tmp_path: Path, src: Pages) -> None:
    """The control for the test above: the same plant tagged under the salt read from the file is
    taken (what keeps the others out is the salt alone, not a malformed plant)."""
    path, data, start, _ = await plant(tmp_path, src, true_victim)
    await write(path, damaged_at(data, start + 4))
    async with await open_disk(tmp_path) as disk:
        assert VICTIM in disk and 0 not in disk  # the later record for slot 0 won


async def test_an_undamaged_journal_never_reads_inside_a_key(tmp_path: Path, src: Pages) -> None:
    path, data, _, _ = await plant(tmp_path, src, true_victim)
    assert await found_intact(tmp_path, src, WANT) == {0, 1, 2}
    assert await read(path) == data  # nothing to cut, nothing stepped over: not rewritten


# -- format 1 ------------------------------------------------------------------------------------


async def old_journal(tmp_path: Path, src: Pages, records: Callable[[list[bytes]], bytes]) -> Path:
    """A tier whose data file holds blocks 0-3 in slots 0-3, under a format-1 journal made of
    ``records(one record per block)``."""
    async with await open_disk(tmp_path) as disk:
        assert await disk.write([0, 1, 2, 3], src.addresses(range(4)), [BLOCK] * 4) == (0, 1, 2, 3)
        path = journal_of(disk)
    await write(path, records([old_record(PUT, i, BLOCK, checksum(src, i), i) for i in range(4)]))
    return path


async def test_a_format_1_journal_keeps_its_blocks_and_is_rewritten(
    tmp_path: Path, src: Pages, caplog: pytest.LogCaptureFixture
) -> None:
    drop = old_record(DROP, 0, 0, 0, 1)
    path = await old_journal(tmp_path, src, lambda r: b"".join(r) + drop + b"AKVJ\x01torn")
    caplog.set_level(logging.WARNING)
    assert await found_intact(tmp_path, src, {k: k for k in range(4)}) == {0, 2, 3}
    assert "format 1" in caplog.text and "rewritten in format 2" in caplog.text
    data = await read(path)
    assert data[:4] != b"AKVJ" and b"torn" not in data
    caplog.clear()
    async with await open_disk(tmp_path) as disk:  # format 2 now: it takes records again
        assert disk.statistics().recovered_blocks == 3
        assert await disk.write([b"new"], src.addresses([1]), [BLOCK]) == (b"new",)
    assert "format 1" not in caplog.text
    assert await found_intact(tmp_path, src, {0: 0, 2: 2, 3: 3, b"new": 1}) == {0, 2, 3, b"new"}


async def test_a_format_1_journal_is_read_up_to_its_first_damage_only(
    tmp_path: Path, src: Pages, caplog: pytest.LogCaptureFixture
) -> None:
    """Past damage, format 1 cannot tell a record from a key's bytes: what follows it is not read
    (those blocks are misses), and neither is the record a key spells there."""
    evil = b"<" + old_victim(b"", checksum(src, 0)) + b">"
    planted = old_record(PUT, 3, BLOCK, 0, evil)

    def records(r: list[bytes]) -> bytes:
        return r[0] + r[1] + damaged_at(planted, 4) + r[2] + r[3]

    await old_journal(tmp_path, src, records)
    caplog.set_level(logging.WARNING)
    assert await found_intact(tmp_path, src, {0: 0, 1: 1, 2: 2, 3: 3, VICTIM: 0}) == {0, 1}
    assert "from its first bad record on are not read" in caplog.text


async def test_a_format_1_journal_the_open_cannot_rewrite_is_read_and_takes_no_records(
    tmp_path: Path, src: Pages, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = await old_journal(tmp_path, src, b"".join)

    def refuse(journal: Journal, blocks: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Journal, "rewrite", refuse)
    async with await open_disk(tmp_path) as disk:
        assert {k for k in range(4) if k in disk} == {0, 1, 2, 3}
        dst = Pages(4)
        assert await disk.read([0, 1, 2, 3], dst.addresses(range(4))) == (True,) * 4
        assert np.array_equal(dst.array, src.array)
        assert await disk.write([b"new"], src.addresses([0]), [BLOCK]) == ()  # refused, counted
        assert disk.statistics().write_errors == 1
    assert "could not compact" in caplog.text
    assert (await read(path))[:4] == b"AKVJ"  # left as it was
    monkeypatch.undo()
    assert await found_intact(tmp_path, src, {k: k for k in range(4)}) == {0, 1, 2, 3}


# -- the header ----------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [0, 3, 10, 29])
async def test_a_header_cut_short_starts_the_tier_empty(
    tmp_path: Path, src: Pages, keep: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A crash while the file was made leaves a header cut short (or none, the file empty) and no
    record after it: nothing is believed, and the tier starts empty with a new header."""
    async with await open_disk(tmp_path) as disk:
        assert await disk.write([0, 1], src.addresses([0, 1]), [BLOCK] * 2) == (0, 1)
        path = journal_of(disk)
    await write(path, (await read(path))[:keep])
    caplog.set_level(logging.WARNING)
    async with await open_disk(tmp_path) as disk:
        assert len(disk) == 0 and disk.statistics().free == disk.statistics().capacity
        assert await disk.write([2], src.addresses([2]), [BLOCK]) == (2,)
    if keep:
        assert "a header cut short" in caplog.text
    assert await found_intact(tmp_path, src, {0: 0, 1: 1, 2: 2}) == {2}


@pytest.mark.parametrize("at", [4, 10, 25], ids=["version", "salt", "check"])
async def test_a_damaged_header_vouches_for_nothing(
    tmp_path: Path, src: Pages, at: int, caplog: pytest.LogCaptureFixture
) -> None:
    async with await open_disk(tmp_path) as disk:
        assert await disk.write([0, 1], src.addresses([0, 1]), [BLOCK] * 2) == (0, 1)
        path = journal_of(disk)
    await write(path, damaged_at(await read(path), at))
    caplog.set_level(logging.WARNING)
    assert await found_intact(tmp_path, src, {0: 0, 1: 1}) == set()
    assert "none of its" in caplog.text
    assert await found_intact(tmp_path, src, {0: 0, 1: 1}) == set()


async def test_a_header_that_cannot_be_written_fails_the_open_and_leaves_nothing(
    tmp_path: Path, src: Pages, monkeypatch: pytest.MonkeyPatch
) -> None:
    faults = JournalFaults(monkeypatch)
    faults.plan = [errno.ENOSPC]
    with pytest.raises(OSError, match="No space left"):
        async with await open_disk(tmp_path):
            pass
    await wait_no_library_threads()
    directory = Path((await open_disk(tmp_path)).directory)
    assert (await asyncio.to_thread(os.stat, directory / "journal")).st_size == 0
    assert await found_intact(tmp_path, src, {0: 0}) == set()  # the next open writes it, and works
    async with await open_disk(tmp_path) as disk:
        assert await disk.write([0], src.addresses([0]), [BLOCK]) == (0,)
    assert await found_intact(tmp_path, src, {0: 0}) == {0}


# -- a large journal -----------------------------------------------------------------------------


def large_replay(path: str) -> tuple[dict[Key, Entry], dict[Key, Entry], dict[Key, Entry], int, dict[Key, Entry]]:
    """100k puts (keys that spell the magic and an op among them), every tenth dropped, then damage in
    the middle. Returns what the replay finds, what it should find, every put, the bytes it stepped
    over, and what a replay finds after the journal is rewritten."""
    journal = Journal(path)
    want: dict[Key, Entry] = {}
    puts: dict[Key, Entry] = {}
    try:
        journal.replay()
        for start in range(0, 100_000, 1000):
            batch: list[tuple[Key, int, int, int]] = []
            for i in range(start, start + 1000):
                key: Key = b"AKVJ\x01%d" % i if i % 3 else i
                batch.append((key, i, BLOCK, i * 7))
            journal.put(batch)
            for key, slot, length, check in batch:
                want[key] = puts[key] = (slot, length, check)
            for key, *_ in batch[::10]:
                journal.drop_soon(key)
                del want[key]
            journal.flush()
    finally:
        journal.close()
    data = bytearray(Path(path).read_bytes())
    middle = len(data) // 2
    data[middle : middle + 100] = bytes(range(100))  # a few records lost: which ones, the replay says
    Path(path).write_bytes(data)
    journal = Journal(path)
    try:
        blocks = journal.replay()
        skipped = journal.skipped
        journal.rewrite(blocks)
    finally:
        journal.close()
    again = Journal(path)
    try:
        return blocks, want, puts, skipped, again.replay()
    finally:
        again.close()


async def test_a_large_journal_replays_exactly(tmp_path: Path) -> None:
    blocks, want, puts, skipped, again = await asyncio.to_thread(large_replay, str(tmp_path / "journal"))
    lost = set(want) - set(blocks)  # puts the damage took
    back = set(blocks) - set(want)  # drops the damage took: their keys come back as they were put
    assert 0 < len(lost) + len(back) <= 5 and 100 <= skipped < 300
    assert all(blocks[key] == puts[key] for key in blocks)
    assert again == blocks
