"""The disk tier's journal: which key lies in which data slot, with the checksum of its bytes.

One record per change, appended after the data it names was written (a put)
or before its slot is reused (a drop). Each record carries its own CRC, so a
record torn by a crash ends the replay there instead of being believed. A
block whose data write did not complete before a crash has no record; a slot
overwritten after its record (a crash between a reuse's write and its drop)
fails the checksum: both are misses, never wrong data.

Drops are decided on the event loop and written by whichever I/O thread
appends next: every append first writes the drops queued before it, so a
block dropped and then written again under the same key is never undone by
its own late drop record.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
import threading
import zlib
from collections import deque
from collections.abc import Iterable, Iterator

__all__ = ["Entry", "Journal", "decode_key", "encode_key"]

_HEAD = struct.Struct("<4sBQIQH")
"""magic, op, slot, length, checksum, key length; then the key, then a CRC32 of all of it."""
_CRC = struct.Struct("<I")
_MAGIC = b"AKVJ"
_PUT, _DROP = 1, 2
_RESERVE = 1 << 20
"""Bytes of file space kept allocated past the journal's end, taken a chunk at a time."""
_KEEP_SIZE = 0x01  # FALLOC_FL_KEEP_SIZE: the space is allocated, the file's size (what replay reads) stays

_fallocate = ctypes.CDLL(None, use_errno=True).fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]

Key = bytes | int
Entry = tuple[int, int, int]
"""A block's data slot, length in bytes and checksum."""


def encode_key(key: Key) -> bytes:
    """Bytes keys and int keys stay apart (``1`` and ``b"\\x01"`` are different keys)."""
    if type(key) is bytes:
        return b"b" + key
    assert type(key) is int
    return b"i" + key.to_bytes((key.bit_length() + 8) // 8 or 1, "little", signed=True)


def decode_key(raw: bytes) -> Key:
    return raw[1:] if raw[:1] == b"b" else int.from_bytes(raw[1:], "little", signed=True)


def _record(op: int, slot: int, length: int, checksum: int, key: bytes) -> bytes:
    body = _HEAD.pack(_MAGIC, op, slot, length, checksum, len(key)) + key
    return body + _CRC.pack(zlib.crc32(body))


class Journal:
    """Append-only records in one file, replayed at open (the caller holds the directory's lock)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self.records = 0
        self._lock = threading.Lock()
        self._drops: deque[Key] = deque()
        """Keys dropped on the loop whose records are not written yet."""
        self._end = os.fstat(self._fd).st_size
        self._reserved = 0
        """The file's space is allocated up to here (``reserve()``)."""

    def replay(self) -> dict[Key, Entry]:
        """The blocks the journal vouches for; a torn or foreign tail is cut off."""
        with open(self.path, "rb") as f:
            data = f.read()
        blocks: dict[Key, Entry] = {}
        end = 0
        for op, slot, length, checksum, key, stop in _records(data):
            end = stop
            self.records += 1
            # A key put again moves to the end: the order says which of two keys naming one slot is the later.
            name = decode_key(key)
            blocks.pop(name, None)
            if op == _PUT:
                blocks[name] = (slot, length, checksum)
        if end < len(data):
            os.ftruncate(self._fd, end)  # a crash mid-append: the next record starts clean
        self._end = end
        return blocks

    def reserve(self, keys: Iterable[Key]) -> None:
        """On an I/O thread, before writing the data these keys' records will name: have the file
        system allocate the records' room past the journal's end (with some to spare), so that data
        which fills the disk still leaves room to record what it wrote. Best effort: where the room
        cannot be had, the records take their chances when they are written."""
        need = sum(_HEAD.size + len(encode_key(key)) + _CRC.size for key in keys)
        with self._lock:
            if self._end + need <= self._reserved:
                return
            for length in (max(need, _RESERVE), need):
                if _fallocate(self._fd, _KEEP_SIZE, self._end, length) == 0:
                    self._reserved = self._end + length
                    return

    def put(self, blocks: list[tuple[Key, int, int, int]]) -> None:
        """On an I/O thread: the drops queued before, then one record per ``(key, slot, length, checksum)``,
        all in one write (a record per block cost a syscall each, and the threads queued on the file).

        :raises OSError: the records could not be written (any that were name bytes already on disk;
            once their slot is reused, its new bytes fail their checksum).
        """
        records = b"".join(
            _record(_PUT, slot, length, checksum, encode_key(key)) for key, slot, length, checksum in blocks
        )
        with self._lock:
            self._flush()
            self._append(records, len(blocks))

    def drop_soon(self, key: Key) -> None:
        """On the loop, never blocking: ``key``'s drop is written before the next record (or ``flush()``)."""
        self._drops.append(key)

    def flush(self) -> None:
        """On an I/O thread: write the drops queued so far.

        :raises OSError: a record could not be written (it stays queued: a
            slot is never rewritten while its old record is unwritten).
        """
        # Under the lock even when none are queued: another thread may be writing the last ones, and a
        # slot they name must not be rewritten before they are on file.
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        # The queued drops in one write (a discard of many keys is one call, not one per key); a crash
        # that tears it loses the drops from the tear on, each a miss at worst (their slots' checksums).
        drops = self._drops
        while drops:
            batch = [drops.popleft() for _ in range(min(len(drops), 4096))]
            try:
                self._append(b"".join(_record(_DROP, 0, 0, 0, encode_key(key)) for key in batch), len(batch))
            except BaseException:
                drops.extendleft(reversed(batch))  # written again before anything after them
                raise

    def _append(self, records: bytes, count: int = 1) -> None:
        # One write per call, O_APPEND: a crash leaves at most its end torn.
        written = os.write(self._fd, records)
        if written != len(records):
            raise OSError(f"short journal write ({written} of {len(records)} bytes)")
        self.records += count
        self._end += written

    def rewrite(self, blocks: dict[Key, Entry]) -> None:
        """Replace the journal by one record per live block (atomic: a new file renamed over it).

        :raises OSError: the new file cannot be made or renamed (the journal is left as it was).
        """
        tmp = self.path + ".new"
        try:
            with open(tmp, "wb") as f:
                for key, (slot, length, checksum) in blocks.items():
                    f.write(_record(_PUT, slot, length, checksum, encode_key(key)))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        self.records = len(blocks)
        self._end, self._reserved = os.fstat(self._fd).st_size, 0

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def _records(data: bytes) -> Iterator[tuple[int, int, int, int, bytes, int]]:
    at, head, crc = 0, _HEAD.size, _CRC.size
    while at + head + crc <= len(data):
        magic, op, slot, length, checksum, klen = _HEAD.unpack_from(data, at)
        end = at + head + klen + crc
        if magic != _MAGIC or op not in (_PUT, _DROP) or end > len(data):
            return
        (stored,) = _CRC.unpack_from(data, end - crc)
        if zlib.crc32(data[at : end - crc]) != stored:
            return
        yield op, slot, length, checksum, data[at + head : end - crc], end
        at = end
