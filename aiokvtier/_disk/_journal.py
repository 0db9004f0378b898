"""The disk tier's journal: which key lies in which data slot, with the checksum of its bytes.

One record per change, appended after the data it names was written (a put)
or before its slot is reused (a drop). The file starts with a header written
once, when it is made: the format's version and a random salt. Each record
ends with a tag, a BLAKE2b of its bytes keyed by that salt, so a record torn
by a crash is never believed: the replay cuts a torn tail off, and steps
over damage inside the file to the next whole record. The key is what makes
that step safe: a caller chooses key bytes, and a key could spell a whole
record whose CRC holds (the format before the salt, 1, was forged so);
without the salt, which never leaves the file, a record made up by anyone
else passes its tag with odds of 2**-64. A block
whose data write did not complete before a crash has no record; a slot
overwritten after its record (a crash between a reuse's write and its drop)
fails the checksum: both are misses, never wrong data.

An append that fails (a short write, ENOSPC, EIO) is cut back off the file
before the error is raised, so the next record follows the last whole one.
Where even the cut fails, the journal takes no more records until it is
opened again (the replay cuts the torn tail then): its blocks are still
read, but nothing more is written.

A file of format 1 (no header, a CRC32 per record) is read once, from its
start up to its first damaged record and no further (stepping over damage
there could land inside a key), and the tier rewrites it in this format at
the same open; until then it takes no records. A file whose header is cut
short (a crash while it was made: no record can follow it), damaged, or of
another version vouches for nothing: the tier starts empty and rewrites it.

Drops are decided on the event loop and written by whichever I/O thread
appends next: every append first writes the drops queued before it, so a
block dropped and then written again under the same key is never undone by
its own late drop record.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import logging
import os
import struct
import threading
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator

__all__ = ["Entry", "Journal", "decode_key", "encode_key"]

log = logging.getLogger("aiokvtier")

_FILE = struct.Struct("<4sH16s8s")
"""The header: magic, format version, salt, and an (unkeyed) BLAKE2b of the three."""
_FILE_MAGIC = b"AKVF"
_VERSION = 2
_HEAD = struct.Struct("<4sBQIQH")
"""magic, op, slot, length, checksum, key length; then the key, then the tag of all of it."""
_TAG = 8
"""Bytes of a record's tag (64 bits: a made-up record passes one with odds of 2**-64)."""
_CRC = struct.Struct("<I")
"""Format 1's record trailer: a CRC32 of the record, which anyone can compute."""
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
Seal = Callable[[bytes], bytes]
"""A record's bytes -> its tag."""
Found = tuple[int, int, int, int, bytes, int, int]
"""A record read back: op, slot, length, checksum, key, where it starts and ends."""


def encode_key(key: Key) -> bytes:
    """Bytes keys and int keys stay apart (``1`` and ``b"\\x01"`` are different keys)."""
    if type(key) is bytes:
        return b"b" + key
    assert type(key) is int
    return b"i" + key.to_bytes((key.bit_length() + 8) // 8 or 1, "little", signed=True)


def decode_key(raw: bytes) -> Key:
    return raw[1:] if raw[:1] == b"b" else int.from_bytes(raw[1:], "little", signed=True)


def _sealer(salt: bytes) -> Seal:
    """Tags keyed by ``salt``: a copy of one keyed hasher (keying a new one each time cost half as much again)."""
    keyed = hashlib.blake2b(key=salt, digest_size=_TAG)

    def seal(body: bytes) -> bytes:
        hasher = keyed.copy()
        hasher.update(body)
        return hasher.digest()

    return seal


def _header(salt: bytes) -> bytes:
    body = _FILE.pack(_FILE_MAGIC, _VERSION, salt, b"")[: _FILE.size - _TAG]
    return body + hashlib.blake2b(body, digest_size=_TAG).digest()


def _salt_of(head: bytes) -> tuple[bytes | None, str]:
    """The salt in a file's first bytes; else None and what the file holds instead."""
    if head[:4] == _MAGIC:
        return None, "format 1"
    if not _FILE_MAGIC.startswith(head[:4]):
        return None, "no header"
    version = int.from_bytes(head[4:6], "little")
    if len(head) >= 6 and version != _VERSION:  # a later format keeps its magic and version where they are
        return None, f"format {version} (this reads {_VERSION})"
    if len(head) < _FILE.size:
        return None, "a header cut short"
    _, _, salt, check = _FILE.unpack_from(head)
    if hashlib.blake2b(head[: _FILE.size - _TAG], digest_size=_TAG).digest() != check:
        return None, "a damaged header"
    return salt, f"format {_VERSION}"


def _record(op: int, slot: int, length: int, checksum: int, key: bytes, seal: Seal) -> bytes:
    body = _HEAD.pack(_MAGIC, op, slot, length, checksum, len(key)) + key
    return body + seal(body)


class Journal:
    """Append-only records in one file, replayed at open (the caller holds the directory's lock).

    :raises OSError: the file cannot be opened, or a new one's header cannot be written (the file is
        then left empty: the next open writes it again).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self.records = 0
        self._lock = threading.Lock()
        self._drops: deque[Key] = deque()
        """Keys dropped on the loop whose records are not written yet."""
        self._reserved = 0
        """The file's space is allocated up to here (``reserve()``)."""
        self.skipped = 0
        """Bytes of damage inside the file the replay stepped over (the caller compacts the journal)."""
        self.broken: str | None = None
        """Why the journal takes no more records: an append failed and could not be cut back off, or the
        file is not of this format (``outdated``)."""
        self._seal: Seal | None = None
        """Tags records under this file's salt; None while the file is of another format."""
        self._holds = ""
        """What the file's first bytes say it is (for the log)."""
        try:
            self._end = os.fstat(self._fd).st_size
            if self._end == 0:
                self._begin()
            else:
                salt, self._holds = _salt_of(os.pread(self._fd, _FILE.size, 0))
                if salt is None:
                    self.broken = f"its file holds {self._holds}, not yet rewritten in format {_VERSION}"
                else:
                    self._seal = _sealer(salt)
        except BaseException:
            os.close(self._fd)
            raise

    def _begin(self) -> None:
        """A new file's header, synced before any record can follow it: a crash leaves the header cut
        short with nothing after it, never records behind a header that is not on disk."""
        salt = os.urandom(16)
        header = _header(salt)
        try:
            if os.write(self._fd, header) != len(header):
                raise OSError(errno.ENOSPC, f"the journal {self.path}'s header was written short")
            os.fsync(self._fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            raise
        self._end, self._seal, self._holds = len(header), _sealer(salt), f"format {_VERSION}"

    @property
    def outdated(self) -> bool:
        """The file is not of this format (format 1, or a header cut short or damaged): it takes no
        records until ``rewrite()``."""
        return self._seal is None

    def replay(self) -> dict[Key, Entry]:
        """The blocks the journal vouches for; a torn or foreign tail is cut off, damage before the
        last whole record is stepped over (counted in ``skipped``). An outdated file is only read:
        format 1 up to its first bad record, anything else not at all (the caller rewrites it)."""
        with open(self.path, "rb") as f:
            data = f.read()
        seal = self._seal
        if seal is not None:
            found, end = _records(data, _FILE.size, seal), _FILE.size
        else:
            found, end = _unsalted(data) if self._holds == "format 1" else iter(()), 0
        blocks: dict[Key, Entry] = {}
        for op, slot, length, checksum, key, start, stop in found:
            # Stepping over a lost record is safe: a lost put is a miss, and a lost drop brings back a
            # block whose slot either a later record names (the later wins) or holds bytes that fail
            # the block's checksum unless they are its own.
            self.skipped += start - end
            end = stop
            self.records += 1
            # A key put again moves to the end: the order says which of two keys naming one slot is the later.
            name = decode_key(key)
            blocks.pop(name, None)
            if op == _PUT:
                blocks[name] = (slot, length, checksum)
        if seal is None:
            self._explain(len(blocks), end, len(data))
        elif end < len(data):
            os.ftruncate(self._fd, end)  # a crash mid-append: the next record starts clean
            self._end = end
        return blocks

    def _explain(self, blocks: int, end: int, size: int) -> None:
        if self._holds == "format 1":
            rest = f"; the {size - end} bytes from its first bad record on are not read" if end < size else ""
            log.warning(
                "aiokvtier: the disk tier journal %s is of format 1 (unsalted): %d blocks read from it%s;"
                " it is rewritten in format %d",
                self.path,
                blocks,
                rest,
                _VERSION,
            )
        else:
            log.warning(
                "aiokvtier: the disk tier journal %s holds %s: none of its %d bytes are believed, the tier"
                " starts empty",
                self.path,
                self._holds,
                size,
            )

    def _sealing(self) -> Seal:
        seal = self._seal
        if seal is None:
            self._refuse_if_broken()
            raise AssertionError("an outdated journal is broken")
        return seal

    def reserve(self, keys: Iterable[Key]) -> None:
        """On an I/O thread, before writing the data these keys' records will name: have the file
        system allocate the records' room past the journal's end (with some to spare), so that data
        which fills the disk still leaves room to record what it wrote. Best effort: where the room
        cannot be had, the records take their chances when they are written."""
        need = sum(_HEAD.size + len(encode_key(key)) + _TAG for key in keys)
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
        seal = self._sealing()
        records = b"".join(
            _record(_PUT, slot, length, checksum, encode_key(key), seal) for key, slot, length, checksum in blocks
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
            self._refuse_if_broken()
            self._flush()

    def _refuse_if_broken(self) -> None:
        if self.broken is not None:
            raise OSError(errno.EIO, f"the journal {self.path} takes no more records: {self.broken}")

    def _flush(self) -> None:
        # The queued drops in one write (a discard of many keys is one call, not one per key); a crash
        # that tears it loses the drops from the tear on, each a miss at worst (their slots' checksums).
        drops = self._drops
        while drops:
            seal = self._sealing()
            batch = [drops.popleft() for _ in range(min(len(drops), 4096))]
            try:
                self._append(b"".join(_record(_DROP, 0, 0, 0, encode_key(key), seal) for key in batch), len(batch))
            except BaseException:
                drops.extendleft(reversed(batch))  # written again before anything after them
                raise

    def _append(self, records: bytes, count: int = 1) -> None:
        # O_APPEND under the lock: a crash leaves at most the end torn, and the replay cuts it. A failed
        # append is cut back here: a torn record left inside the file would hide the records after it.
        self._refuse_if_broken()
        view, done = memoryview(records), 0
        try:
            while done < len(records):  # a short write (a signal, the disk filling) goes on, or fails next
                wrote = os.write(self._fd, view[done:])
                if wrote <= 0:
                    raise OSError(errno.EIO, f"a write to the journal {self.path} made no progress")
                done += wrote
        except BaseException as exc:
            self._cut(exc)
            raise
        self.records += count
        self._end += done

    def _cut(self, cause: BaseException) -> None:
        """Take a failed append's bytes back off the file, or stop taking records."""
        try:
            if os.fstat(self._fd).st_size != self._end:
                os.ftruncate(self._fd, self._end)
                self._reserved = 0  # the cut freed the room reserve() had taken past the end
        except OSError as exc:
            self.broken = f"a failed append ({cause}) could not be cut back off ({exc})"
            log.error("aiokvtier: the disk tier journal %s takes no more records: %s", self.path, self.broken)

    def rewrite(self, blocks: dict[Key, Entry]) -> None:
        """Replace the journal by one record per live block, under a new salt, in this format (atomic: a
        new file renamed over it).

        :raises OSError: the new file cannot be made or renamed (the journal is left as it was).
        """
        tmp = self.path + ".new"
        salt = os.urandom(16)
        seal = _sealer(salt)
        try:
            with open(tmp, "wb") as f:
                f.write(_header(salt))
                for key, (slot, length, checksum) in blocks.items():
                    f.write(_record(_PUT, slot, length, checksum, encode_key(key), seal))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        os.close(self._fd)
        self._fd, self._seal, self._holds = fd, seal, f"format {_VERSION}"
        self.records = len(blocks)
        self._end, self._reserved = os.fstat(fd).st_size, 0
        self.skipped, self.broken = 0, None  # a whole new file

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def _records(data: bytes, at: int, seal: Seal) -> Iterator[Found]:
    """Each whole record's fields, start and end; past a bad one, the next magic that starts a whole record
    (which may lie inside a key: only the salt, which the key's author never sees, makes its tag)."""
    head = _HEAD.size
    while at + head + _TAG <= len(data):
        magic, op, slot, length, checksum, klen = _HEAD.unpack_from(data, at)
        end = at + head + klen + _TAG
        if (
            magic == _MAGIC
            and op in (_PUT, _DROP)
            and end <= len(data)
            and seal(data[at : end - _TAG]) == data[end - _TAG : end]
        ):
            yield op, slot, length, checksum, data[at + head : end - _TAG], at, end
            at = end
            continue
        at = data.find(_MAGIC, at + 1)
        if at < 0:
            return


def _unsalted(data: bytes) -> Iterator[Found]:
    """Format 1's records, from the start up to the first that is not whole: past it, the next record
    could be one spelled by a key's bytes, whose CRC anyone can make."""
    at, head, crc = 0, _HEAD.size, _CRC.size
    while at + head + crc <= len(data):
        magic, op, slot, length, checksum, klen = _HEAD.unpack_from(data, at)
        end = at + head + klen + crc
        if (
            magic != _MAGIC
            or op not in (_PUT, _DROP)
            or end > len(data)
            or zlib.crc32(data[at : end - crc]) != _CRC.unpack_from(data, end - crc)[0]
        ):
            return
        yield op, slot, length, checksum, data[at + head : end - crc], at, end
        at = end
