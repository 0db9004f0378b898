"""A mirror of the pool's block index in shared memory: lookups without asking the owner.

The owner (``aiokvtier._pool._owner``) is the only writer: it changes its
``BlockIndex`` on its loop, and each change of the ready blocks (a commit,
an eviction, a discard) is written here in the same step. Every attached
process maps the same memfd (passed with the tier's at attach) and reads it
itself for ``lookup``: a hash of each key, a probe of the table with numpy
gathers, the stored prefix, and no socket round trip. Any thread of that
process may read (``AttachedPool.lookup_nowait``); ``close`` unmaps once
the last read in flight ends.

Layout (one memfd)::

    header   4 KiB: seq, magic, capacity, slots, live, used, state, the hash's two seeds
    table    capacity x 64-byte entries (open addressing, linear probing)
    spare    the same again: the table as it was before the write in progress
    refs     one byte per slot: "referenced since the owner last looked" (CLOCK)

An entry is eight little-endian uint64: ``tag`` (the key's first 64-bit
hash; 0 an empty entry, 1 a tombstone), ``check`` (a second, independent
64-bit hash), the key's kind and length, the key's first 32 bytes, then
``slot | length << 32``. A hit needs the first seven equal to the key's:
keys of up to 32 bytes (block hashes, ints) are compared whole, so a hash
collision can cost a probe, never a false hit; longer keys are told apart
by their length, their first 32 bytes and 128 bits of hash. The hash is
seeded with two random words the owner draws for its mirror (in the header,
read by every attached process): with fixed seeds anyone could search for
two keys that hash alike, and with one multiply a word, two keys apart in
a word's top bit and in what that bit made of the state in the next word
hashed alike whatever the seeds (no search at all), so each word takes two
multiplies. (A tier whose slots or slot size do not fit 32 bits has no
mirror: its lookups ask the owner.)

Consistency is a seqlock over two copies (a "latch"): the owner makes
``seq`` odd, writes the table, makes ``seq`` even, then copies the entries it
changed into the spare. A reader reads ``seq``, copies what it needs from
the table (``seq`` even) or the spare (odd: the table is being written, the
spare holds the state before), reads ``seq`` again and keeps its copy only
if it held still. So a reader never waits for a write, nor for an owner
that was descheduled (or died) mid-write: under 8 storing processes on 2
CPUs a plain seqlock's readers found ``seq`` odd often enough that one
lookup in five asked the owner, behind its queue of stores. A read that
overlapped a step of a write is done over, a few times, then given up
(``None``: the caller asks the owner); a retried read does not hash its
keys again. That needs loads kept in order with loads and stores with
stores, which x86-64 gives (``USABLE``); elsewhere the attached process asks
the owner. A reader never trusts a torn copy: it only computes positions
modulo the capacity and discards the copy unless ``seq`` held still.

Sizing: every ready block holds a slot, so the table never holds more than
``slots`` (the tier's at ``max_quota``) live entries; the capacity is the
power of two at or above twice that, and a write that would take live
entries and tombstones past three quarters rebuilds the table first, so a
probe always ends at an empty entry and an insert always finds room. A
removal empties the tombstones it leaves at the end of a chain (nothing
probes past them), so a table whose keys come and go is seldom rebuilt.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import mmap
import os
import platform
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar, cast

import numpy as np
import numpy.typing as npt
from numpy import char as np_char  # numpy imports it on first use: a first lookup paid 0.9 ms for that

from ._wire import KeyMatrix, decimal

__all__ = ["USABLE", "IndexMirror", "KeyMatrix", "Looked", "mirror_fits", "mirror_size"]

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
T = TypeVar("T")
Hasher = Callable[[npt.NDArray[np.uint8], int, I64], U64]
"""``(keys' bytes (n, width) zero-padded, kind, each key's length) -> (2, n) uint64``: two independent
64-bit hashes of each key."""

USABLE = platform.machine().lower() in ("x86_64", "amd64")
"""The seqlock's reads are sound here (loads are not reordered with loads): attached processes read the
mirror; elsewhere they ask the owner."""

POPULATE: int = getattr(mmap, "MAP_POPULATE", 0)
MAGIC = 0x61696F6B76696478  # "aiokvidx"
HEADER = 4096
ENTRY = 64
KEY_BYTES = 32
SEQ, MAGIC_AT, CAPACITY, SLOTS, LIVE, USED, STATE, SEEDS = range(8)
"""The header's words (``SEEDS``: the first of two)."""
CLOSED = 1
EMPTY, TOMBSTONE = 0, 1
KIND_BYTES, KIND_INT, KIND_BIGINT = 1, 2, 3
LONG_BYTES = 256
"""Keys longer than this are hashed as their first ``KEY_BYTES`` and a BLAKE2b digest of the whole key:
the word-by-word hash costs a round of numpy calls per word of the batch's longest key (a key of 1 MiB held
the owner's loop for half a second), the digest runs in C at the speed of memory."""
DIGEST_BYTES = 32
RETRIES = 8
"""Whole reads a lookup tries before it asks the owner (a read is done over only when a step of a write
fell inside it: a write's two steps come a fraction of a millisecond apart)."""
WINDOW = 4
"""Entries a probe reads a round past its first (at most a few keys in a hundred go that far)."""
ONE_BY_ONE = 32
"""Keys left to place that go one at a time rather than in another round (a round costs ~50 us of numpy calls,
a key a few microseconds)."""
RECLAIM_ROUNDS = 16
"""Entries back from its end a run of tombstones is emptied by one removal at most (what is left stays a
tombstone, which is sound: the next rebuild drops it)."""
CHUNK = 8192
"""Keys a lookup hashes and probes at a time, stopping after the first chunk with a miss (a batch of SGLang's
largest is one chunk: numpy's fixed cost per call is most of a small chunk's)."""

_LO = np.uint64(0xFFFFFFFF)
_P = np.array([[0x9E3779B97F4A7C15], [0xC2B2AE3D27D4EB4F]], dtype=np.uint64)
_SEEDS = np.array([[0x243F6A8885A308D3], [0x13198A2E03707344]], dtype=np.uint64)
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


def mirror_fits(slots: int, slot_size: int) -> bool:
    """Whether a tier's slot ids and block lengths fit an entry (32 bits each)."""
    return 0 < slots < 1 << 32 and 0 < slot_size < 1 << 32


def capacity_for(slots: int) -> int:
    return max(16, 1 << (2 * max(slots, 1) - 1).bit_length())


def mirror_size(slots: int) -> int:
    """Bytes of the memfd for a tier of ``slots`` slots (at ``max_quota``)."""
    refs = -(-slots // 4096) * 4096
    return HEADER + 2 * capacity_for(slots) * ENTRY + refs


def hash_words(data: npt.NDArray[np.uint8], kind: int, lengths: I64, seeds: U64 = _SEEDS) -> U64:
    """Two 64-bit hashes of each row of ``data`` (keys of one kind, zero-padded to whole words): two rounds
    of multiply-xorshift a word over the key's own words (``ceil(length / 8)``), seeded with ``seeds``
    (``(2, 1)`` uint64), its kind and length, in numpy."""
    n = data.shape[0]
    h = np.empty((2, n), dtype=np.uint64)
    h[:] = seeds ^ (lengths.astype(np.uint64) | np.uint64(kind << 56))
    if not n:
        return h
    counts = (lengths + 7) // 8
    least, most = int(counts.min()), int(counts.max())
    # A word of every key at a time, contiguous, both hashes as one flat array and every step in place:
    # numpy is slow broadcasting along a short axis, and a fresh array per step of a large batch can cost
    # more in page faults than its arithmetic.
    words = np.ascontiguousarray(data.view("<u8")[:, :most].T)
    factors = np.repeat(_P, n, axis=1).reshape(-1)
    others = factors.reshape(2, n)[::-1].reshape(-1)
    flat = h.reshape(-1)
    mixed = np.empty_like(h)
    spare = np.empty_like(flat)
    shift, half = np.uint64(29), np.uint64(32)
    for c in range(most):
        into = h if c < least else mixed  # keys shorter than this word keep theirs
        np.bitwise_xor(h, words[c], out=into)
        step = into.reshape(-1)
        # Two rounds: through one, a difference in the top bit came out as a fixed difference (a multiply
        # carries nothing past the top bit), which the next word cancelled in both hashes at once.
        step *= factors
        np.right_shift(step, shift, out=spare)
        step ^= spare
        step *= others
        np.right_shift(step, half, out=spare)
        step ^= spare
        if c >= least:
            np.copyto(h, mixed, where=c < counts)
    flat *= others
    np.right_shift(flat, np.uint64(32), out=spare)
    flat ^= spare
    return h


def _padded(parts: Sequence[bytes], lengths: I64) -> npt.NDArray[np.uint8]:
    """The keys' bytes as rows of a uint8 matrix, zero-padded to whole words and at least ``KEY_BYTES``."""
    n = len(parts)
    longest = int(lengths.max()) if n else 0
    data = np.zeros((n, max(-(-longest // 8) * 8, KEY_BYTES)), dtype=np.uint8)
    if longest and int(lengths.min()) == longest:
        data[:, :longest] = np.frombuffer(b"".join(parts), dtype=np.uint8).reshape(n, longest)
    elif longest:  # numpy pads each to the longest, in C (zero bytes inside a key kept: "S" is raw bytes)
        data[:, :longest] = np.array(parts, dtype=f"S{longest}").view(np.uint8).reshape(n, longest)
    return data


Looked = tuple[int, int, int, int]
"""What a lookup tells its ``counted``: ``(answers, hits, misses, reads done over)``."""
Group = tuple[int, npt.NDArray[np.intp] | None, npt.NDArray[np.uint8], I64]
Keys = Sequence[bytes | int] | npt.NDArray[np.uint8]
"""Keys as a sequence of bytes and ints, or as the rows of a 2-D uint8 array (byte keys of one length, with no
Python object per key)."""


def _short(keys: Sequence[bytes]) -> Group | None:
    """Bytes keys of up to ``KEY_BYTES`` with no NUL byte at their end (block hashes, most names) as one
    group, or None. Packed by numpy in C, their lengths read off the packed rows: the rows' lengths add up
    to the keys' only when no key was cut short and none ended in NUL bytes (numpy's count stops at
    those). A Python call per key (``len``) was a fifth of a lookup of 4,096 keys (0.1 ms)."""
    if not keys or len(keys[0]) > KEY_BYTES:  # long keys (a batch of them is of one kind): not tried in vain
        return None
    data = np.array(keys, dtype=f"S{KEY_BYTES}")
    lengths = np_char.str_len(data).astype(np.int64)
    if int(lengths.sum()) != len(b"".join(keys)):
        return None
    return KIND_BYTES, None, data.view(np.uint8).reshape(len(keys), KEY_BYTES), lengths


def _matrix(keys: npt.NDArray[np.uint8]) -> Group:
    """A key matrix's rows as one group: zero-padded to whole words (a copy only where they are not)."""
    n, width = keys.shape
    padded = max(-(-width // 8) * 8, KEY_BYTES)
    if padded == width and keys.flags.c_contiguous:
        data = keys
    else:
        data = np.zeros((n, padded), dtype=np.uint8)
        data[:, :width] = keys
    return KIND_BYTES, None, data, np.full(n, width, dtype=np.int64)


def _groups(keys: Keys, types: set[type] | None = None) -> list[Group]:
    """``(kind, positions or None for all, padded bytes, lengths)`` per kind of key (``types``: the keys'
    types, where the caller knows them)."""
    if isinstance(keys, np.ndarray):
        return [_matrix(keys)]
    n = len(keys)
    if types is None:
        types = set(map(type, keys))
    if types == {bytes}:
        short = _short(cast("Sequence[bytes]", keys))
        if short is not None:
            return [short]
        lengths = np.fromiter(map(len, keys), dtype=np.int64, count=n)  # type: ignore[arg-type]
        return _by_width(KIND_BYTES, None, keys, lengths)  # type: ignore[arg-type]
    if types == {int}:
        try:
            ints = np.array(keys, dtype="<i8")
        except OverflowError:
            pass
        else:
            data = np.zeros((n, KEY_BYTES), dtype=np.uint8)
            data[:, :8] = ints.view(np.uint8).reshape(n, 8)
            return [(KIND_INT, None, data, np.full(n, 8, dtype=np.int64))]
    found: dict[int, tuple[list[int], list[bytes]]] = {}
    for i, key in enumerate(keys):
        if isinstance(key, bytes):
            kind, data_ = KIND_BYTES, key
        elif _I64_MIN <= key <= _I64_MAX:
            kind, data_ = KIND_INT, int(key).to_bytes(8, "little", signed=True)
        else:
            kind, data_ = KIND_BIGINT, decimal(key)
        where, parts = found.setdefault(kind, ([], []))
        where.append(i)
        parts.append(data_)
    out: list[Group] = []
    for kind, (where, parts) in found.items():
        lengths = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        out.extend(_by_width(kind, np.array(where, dtype=np.intp), parts, lengths))
    return out


def _by_width(kind: int, where: npt.NDArray[np.intp] | None, parts: Sequence[bytes], lengths: I64) -> list[Group]:
    """Keys of one kind as groups whose rows cost at most twice their keys' words (and ``KEY_BYTES`` a key).

    Rows are padded to the longest key of their group (a key's hash reads its own words only, so the
    grouping changes no entry): one group for a batch of similar lengths, as most are; a batch far apart
    goes by powers of two of words. One group for all made a store of 255 short keys and one of 1 MiB
    pad 256 MiB, and one of 100 MiB ask for 25 GiB in the owner."""
    words = np.maximum((lengths + 7) // 8, KEY_BYTES // 8)
    if not len(parts) or int(words.max()) * len(parts) <= 2 * int(words.sum()):
        return [(kind, where, _padded(parts, lengths), lengths)]
    classes = np.ceil(np.log2(words)).astype(np.int64)
    out: list[Group] = []
    for c in np.unique(classes).tolist():
        at = np.flatnonzero(classes == c)
        group = [parts[i] for i in at.tolist()]
        out.append((kind, at if where is None else where[at], _padded(group, lengths[at]), lengths[at]))
    return out


def _from_matrix(matrix: KeyMatrix) -> Group:
    """A key matrix of rows zero-padded to the longest, as one group: padded on to whole words."""
    data, lengths = matrix
    n, width = data.shape
    padded = max(-(-width // 8) * 8, KEY_BYTES)
    if padded != width or not data.flags.c_contiguous:
        wide = np.zeros((n, padded), dtype=np.uint8)
        wide[:, :width] = data
        data = wide
    return KIND_BYTES, None, data, lengths


def key_rows(
    keys: Keys, hasher: Hasher = hash_words, types: set[type] | None = None, matrix: KeyMatrix | None = None
) -> U64:
    """Each key's entry as it would be stored, with slot and length 0: ``(n, 8)`` uint64. ``matrix``: the
    same keys (bytes) as a key matrix, where the caller has one."""
    n = len(keys)
    rows = np.empty((n, 8), dtype=np.uint64)  # every row is written below, by its kind's group
    if not n:
        return rows
    for kind, where, data, lengths in [_from_matrix(matrix)] if matrix is not None else _groups(keys, types):
        h = hasher(data, kind, lengths) if int(lengths.max()) <= LONG_BYTES else _hash_long(hasher, data, kind, lengths)
        tag = h[0]
        tag[tag < 2] += np.uint64(2)  # 0 and 1 mark empty entries and tombstones
        part = rows if where is None else np.empty((len(data), 8), dtype=np.uint64)
        part[:, 0] = tag
        part[:, 1] = h[1]
        part[:, 2] = np.minimum(lengths, 0xFFFFFFFF).astype(np.uint64) | np.uint64(kind << 56)
        part[:, 3:7] = data[:, :KEY_BYTES].view("<u8")
        part[:, 7] = 0
        if where is not None:
            rows[where] = part
    return rows


def _hash_long(hasher: Hasher, data: npt.NDArray[np.uint8], kind: int, lengths: I64) -> U64:
    """``hasher``'s two hashes of keys some of which are longer than ``LONG_BYTES``: those as their first
    ``KEY_BYTES`` and a digest of the whole key (``DIGEST_BYTES``), hashed as keys of that length. A key's
    hash depends on its own bytes only, whatever the batch; its entry keeps its real length (entries are
    compared whole), so a digested key never meets a key of the digest form's length."""
    long = np.flatnonzero(lengths > LONG_BYTES)
    short = np.flatnonzero(lengths <= LONG_BYTES)
    h = np.empty((2, len(lengths)), dtype=np.uint64)
    if short.size:
        width = max(-(-int(lengths[short].max()) // 8) * 8, KEY_BYTES)
        h[:, short] = hasher(np.ascontiguousarray(data[short, :width]), kind, lengths[short])
    form = np.zeros((long.size, KEY_BYTES + DIGEST_BYTES), dtype=np.uint8)
    form[:, :KEY_BYTES] = data[long, :KEY_BYTES]
    for row, (i, n) in enumerate(zip(long.tolist(), lengths[long].tolist(), strict=True)):
        form[row, KEY_BYTES:] = np.frombuffer(
            hashlib.blake2b(data[i, :n].data, digest_size=DIGEST_BYTES).digest(), np.uint8
        )
    h[:, long] = hasher(form, kind, np.full(long.size, KEY_BYTES + DIGEST_BYTES, dtype=np.int64))
    return h


def _drop_views(exc: BaseException) -> None:
    """Clear the locals of the frames an exception raised during a read passed through: they hold views of
    the mapping, and a traceback kept alive (logged, stored) would keep ``close`` from unmapping it."""
    traceback.clear_frames(exc.__traceback__)


class IndexMirror:
    """The shared table: created by the owner (``create``, the writer) or mapped by an attached process
    (``attach``, a reader). A reader writes only the referenced bytes."""

    def __init__(self, fd: int, slots: int, *, owner: bool, hasher: Hasher | None = None) -> None:
        self.fd = fd
        self.slots = slots
        self.capacity = capacity_for(slots)
        self.size = mirror_size(slots)
        self._hasher: Hasher = hasher or hash_words  # seeded by ``create`` and ``attach``
        self._owner = owner
        # Mapped in whole, now (on the caller's worker thread): a lookup's keys land on random pages of
        # both copies, and faulting them in one by one cost a process's first lookup of 4,096 keys about
        # 3.4 ms more CPU.
        self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED | POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
        self._header: U64 = np.frombuffer(self._map, dtype=np.uint64, count=SEEDS + 2)
        table_bytes = self.capacity * ENTRY
        self._table: U64 = np.frombuffer(self._map, dtype=np.uint64, count=self.capacity * 8, offset=HEADER).reshape(
            self.capacity, 8
        )
        self._spare: U64 = np.frombuffer(
            self._map, dtype=np.uint64, count=self.capacity * 8, offset=HEADER + table_bytes
        ).reshape(self.capacity, 8)
        refs = HEADER + 2 * table_bytes
        self._refs: npt.NDArray[np.uint8] = np.frombuffer(self._map, dtype=np.uint8, count=slots, offset=refs)
        self._flags = memoryview(self._map)[refs : refs + slots]
        self._mask = np.uint64(self.capacity - 1)
        self._entry_of: npt.NDArray[np.intp] = np.full(slots if owner else 0, -1, dtype=np.intp)
        self._claimant: npt.NDArray[np.intp] = np.full(self.capacity if owner else 0, -1, dtype=np.intp)
        """The owner's scratch for a round of ``_place``: the key taking each entry (-1 between rounds)."""
        """The owner's own record of the table entry holding each slot's block (-1: none), so that a
        removal needs no hashing and no probe (it knows the blocks' slots)."""
        self._guard = threading.Lock()
        self._readers = 0
        self._closing = False
        self._unmapped = threading.Event()

    @classmethod
    def create(cls, slots: int, *, hasher: Hasher | None = None) -> IndexMirror:
        """A new, empty mirror for a tier of ``slots`` slots (the owner; blocking: a memfd and a mapping).

        :raises ValueError: ``slots`` is not a positive int.
        """
        if type(slots) is not int or slots < 1:
            raise ValueError(f"slots must be a positive int, got {slots!r}")
        fd = os.memfd_create("aiokvtier-pool-index", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, mirror_size(slots))
            mirror = cls(fd, slots, owner=True, hasher=hasher)
        except BaseException:
            os.close(fd)
            raise
        h = mirror._header
        h[MAGIC_AT], h[CAPACITY], h[SLOTS] = MAGIC, mirror.capacity, slots
        h[SEEDS : SEEDS + 2] = np.frombuffer(os.urandom(16), dtype=np.uint64)
        mirror._seeded(hasher)
        return mirror

    @classmethod
    def attach(cls, fd: int, slots: int, *, hasher: Hasher | None = None) -> IndexMirror:
        """Map the owner's mirror (takes ``fd``: closed here once mapped, or on failure).

        :raises ValueError: the memfd is not a mirror of that many slots.
        """
        try:
            if type(slots) is not int or slots < 1:
                raise ValueError(f"the pool's index mirror has a bad slot count ({slots!r})")
            if os.fstat(fd).st_size != mirror_size(slots):
                raise ValueError("the pool's index mirror is not of the size its slots need")
            mirror = cls(fd, slots, owner=False, hasher=hasher)
        finally:
            os.close(fd)
        h = mirror._header
        ok = int(h[MAGIC_AT]) == MAGIC and int(h[CAPACITY]) == mirror.capacity and int(h[SLOTS]) == slots
        del h  # a view of the mapping: the unmap needs none left
        if not ok:
            mirror.close()
            raise ValueError("the memory the pool sent is not its index mirror")
        mirror.fd = -1
        mirror._seeded(hasher)
        return mirror

    def _seeded(self, hasher: Hasher | None) -> None:
        """Hash with ``hasher``, or (None) ``hash_words`` seeded with the header's seeds (copied: the unmap
        needs no view of the mapping left)."""
        if hasher is None:
            seeds = self._header[SEEDS : SEEDS + 2].copy().reshape(2, 1)
            hasher = functools.partial(hash_words, seeds=seeds)
        self._hasher = hasher

    def close(self) -> None:
        """Unmap (and close the owner's memfd), at once or when the last lookup reading on another thread
        ends. Idempotent."""
        with self._guard:
            if self._closing:
                return
            self._closing = True
            reading = self._readers
        if not reading:
            self._unmap()

    def _enter(self) -> bool:
        """A lookup starts reading: False once ``close`` has begun (the memory may be unmapped)."""
        with self._guard:
            if self._closing:
                return False
            self._readers += 1
            return True

    def _leave(self) -> None:
        with self._guard:
            self._readers -= 1
            last = self._closing and not self._readers
        if last:
            self._unmap()

    def _unmap(self) -> None:
        try:
            del self._header, self._table, self._spare, self._refs
            self._flags.release()
            try:
                self._map.close()
            except BufferError:  # a view of it is still alive elsewhere: the mapping goes with the last one
                pass
            if self._owner and self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
        finally:
            self._unmapped.set()  # whoever waits for it is never left hanging

    def wait_unmapped(self, timeout: float | None = None) -> bool:
        """After ``close``: wait until the last lookup reading on another thread has ended and the mapping
        is gone (blocking; a lookup reads for a bounded time). Returns whether it did within ``timeout``."""
        return self._unmapped.wait(timeout)

    @property
    def closed(self) -> bool:
        return self._closing

    @property
    def live(self) -> int:
        return int(self._header[LIVE])

    @property
    def used(self) -> int:
        """Entries not empty: live ones and tombstones (a rebuild comes when they pass 3/4 of the table)."""
        return int(self._header[USED])

    # -- reading (any process) ----------------------------------------------------------------

    def _probe(self, rows: U64, table: U64) -> tuple[npt.NDArray[np.intp], U64]:
        """Each row's position in ``table`` (-1: absent) and its stored ``slot | length << 32`` (``rows``'
        last column is scratch here).

        Most keys end at their first entry: a first round reads one entry per key. The few left read
        ``WINDOW`` entries a round (a round costs numpy's fixed cost over again, whatever its size)."""
        mask = self.capacity - 1
        at = (rows[:, 0] & self._mask).astype(np.intp)
        got = np.take(table, at, axis=0)
        # A whole entry compared at once: the stored column copied over, the 8 flags of a row read as one
        # word (numpy is slow along a short last axis, and with masks).
        rows[:, 7] = got[:, 7]
        same = (got != rows).view(np.uint64)[:, 0] == 0
        found = np.where(same, at, -1)
        stored = np.where(same, got[:, 7], np.uint64(0))
        go_on = got[:, 0] != EMPTY
        go_on &= ~same
        pending = np.flatnonzero(go_on)
        last = at[pending]
        steps = np.arange(1, WINDOW + 1, dtype=np.intp)
        for _ in range(0, self.capacity, WINDOW):  # a probe ends at an empty entry; the bound is for a torn copy
            if not pending.size:
                break
            n = pending.size
            window = (last[:, None] + steps) & mask
            got = np.take(table, window.reshape(-1), axis=0)
            want = np.repeat(rows[pending], WINDOW, axis=0)
            want[:, 7] = got[:, 7]
            same = ((got != want).view(np.uint64)[:, 0] == 0).reshape(n, WINDOW)
            stop = (got[:, 0] == EMPTY).reshape(n, WINDOW)
            stop |= same
            first = stop.argmax(axis=1)  # the first entry that ends each probe, or 0 where none does
            each = np.arange(n)
            hit = same[each, first]
            found[pending[hit]] = window[hit, first[hit]]
            stored[pending[hit]] = got.reshape(n, WINDOW, 8)[hit, first[hit], 7]
            left = ~stop[each, first]
            pending, last = pending[left], window[left, -1]
        return found, stored

    @contextlib.contextmanager
    def _reading(self) -> Iterator[bool]:
        """A read of the mapping: False once ``close`` has begun (the memory may be unmapped), else the
        mapping stays until the block ends. A read that raises leaves no view of it in its traceback."""
        if not self._enter():
            yield False
            return
        try:
            yield True
        except BaseException as exc:
            _drop_views(exc)
            raise
        finally:
            self._leave()

    def _consistent(self, attempt: Callable[[U64], T]) -> tuple[T | None, int]:
        """``attempt(copy)`` within the seqlock, on the copy no write changes now: what it returned while
        ``seq`` held still, or None (no consistent read within the retries, or the owner closed the pool);
        and how many reads were done over."""
        header = self._header
        for retry in range(RETRIES):
            seq = int(header[SEQ])
            if int(header[STATE]) == CLOSED:
                return None, retry
            result = attempt(self._spare if seq & 1 else self._table)
            if int(header[SEQ]) == seq:
                return result, retry
        return None, RETRIES

    def lookup(
        self, keys: Keys, types: set[type] | None = None, counted: Callable[[Looked], object] | None = None
    ) -> int | None:
        """The stored prefix of ``keys`` (as ``BlockIndex.lookup``), its slots marked referenced; None when no
        consistent read came within the retries, or the owner closed the pool: ask the owner.

        Any thread (reads only; ``close`` waits for the unmap until no lookup reads). Keys are hashed and
        probed ``CHUNK`` at a time, and the first chunk with a miss is the last: a short prefix costs its
        own keys, not the batch's. ``counted`` gets ``(answers, hits, misses, reads done over)`` before the
        read ends (so that whoever waits for the readers after ``close`` sees every answer given): ``(1, h,
        m, r)`` for an answer, ``(0, 0, 0, r)`` for a lookup left to the owner."""
        with self._reading() as mapped:
            if not mapped:
                return None
            n = len(keys)
            hits, retries = self._lookup(keys, n, types) if n else (0, 0)
            if counted is not None:
                counted((0, 0, 0, retries) if hits is None else (1, hits, n - hits, retries))
            return hits

    def _lookup(self, keys: Keys, n: int, types: set[type] | None) -> tuple[int | None, int]:
        # Hashed once, before the first read (out of the window a write can spoil), kept for a retry.
        rows: list[U64] = [key_rows(keys if n <= CHUNK else keys[:CHUNK], self._hasher, types)]

        def attempt(table: U64) -> tuple[int, list[U64]]:
            # The table comes as an argument: no view of the mapping in a closure cell (a traceback keeps
            # this function alive, its frame does, and clearing the frames does not empty the cells).
            hits, hit_slots = 0, []
            for i, start in enumerate(range(0, n, CHUNK)):
                if i == len(rows):
                    rows.append(key_rows(keys[start : start + CHUNK], self._hasher, types))
                found, stored = self._probe(rows[i], table)
                missing = np.flatnonzero(found < 0)
                end = int(missing[0]) if missing.size else found.size
                hits += end
                hit_slots.append(stored[:end] & _LO)
                if missing.size:
                    break
            return hits, hit_slots

        read, retries = self._consistent(attempt)
        if read is None:
            return None, retries
        hits, hit_slots = read
        for slots in hit_slots:
            self._refs[slots[slots < self.slots].astype(np.intp)] = 1
        return hits, retries

    def present(self, keys: Keys, types: set[type] | None = None) -> npt.NDArray[np.bool_] | None:
        """Per key, whether the table holds it, from one consistent read; None as ``lookup``. Touches nothing:
        no block is marked referenced, no answer is counted."""
        if not len(keys):
            return np.zeros(0, dtype=np.bool_)
        read = self._read_probe(keys, types)
        return None if read is None else read[0] >= 0

    def blocks(self, keys: Sequence[bytes | int]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None:
        """Each key's slot and length as one consistent read saw them (-1 and 0 where absent), or None
        (as ``lookup``); touches nothing."""
        read = self._read_probe(keys)
        if read is None:
            return None
        found, stored = read
        slots = np.where(found >= 0, (stored & _LO).astype(np.int64), -1)
        lengths = np.where(found >= 0, (stored >> np.uint64(32)).astype(np.int64), 0)
        return slots, lengths

    def _read_probe(self, keys: Keys, types: set[type] | None = None) -> tuple[npt.NDArray[np.intp], U64] | None:
        """``_probe`` of ``keys`` in one consistent read (None as ``lookup``); touches nothing."""
        rows = key_rows(keys, self._hasher, types)  # hashed out of the window a write can spoil
        with self._reading() as mapped:
            return self._consistent(lambda table: self._probe(rows, table))[0] if mapped else None

    # -- writing (the owner only, on its loop) ------------------------------------------------

    def _begin(self) -> None:
        """Readers go to the spare (odd ``seq``): the table is written now."""
        self._header[SEQ] += np.uint64(1)

    def _end(self, changed: npt.NDArray[np.intp] | None, *, tags: bool = False) -> None:
        """Readers come back to the table (even ``seq``); the spare catches up with it: the entries at
        ``changed`` (only their tags, with ``tags``), or all of them (None)."""
        self._header[SEQ] += np.uint64(1)
        try:
            if changed is None:
                self._spare[:] = self._table
            elif tags:
                self._spare[changed, 0] = self._table[changed, 0]
            elif changed.size:
                self._spare[changed] = np.take(self._table, changed, axis=0)
        except BaseException:
            # A partial catch-up (a MemoryError for the gathers) would leave readers of the spare on old
            # entries for good: copied whole, in place (nothing to allocate).
            self._spare[:] = self._table
            raise

    def _place(self, rows: U64) -> npt.NDArray[np.intp]:
        """Put rows (keys not in the table) into empty entries or tombstones, linear probing: in rounds while
        many keys are left, then one key at a time (a round costs numpy's fixed cost over again; 4,096 keys
        took 8 rounds, the last few for a handful of keys). Returns the entries written."""
        table, header = self._table, self._header
        tags = table[:, 0]
        mask = self.capacity - 1
        pos = (rows[:, 0] & self._mask).astype(np.intp)
        pending = np.arange(rows.shape[0], dtype=np.intp)
        if self._claimant.size != self.capacity:  # a mirror placing that did not create it (tests)
            self._claimant = np.full(self.capacity, -1, dtype=np.intp)
        claimant = self._claimant
        fresh = 0
        placed: list[tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]] = []
        # It ends: an insert comes with at most ``slots`` live entries in all (each holds its own slot) and
        # tombstones are dropped before used entries pass 3/4 of a table of 2 * slots or more.
        for _ in range(self.capacity):
            if pending.size <= ONE_BY_ONE:
                break
            at = pos[pending]
            seen = tags[at]  # not np.take: it copies a strided column (the whole table) first
            free = np.flatnonzero(seen < 2)
            # One key per free entry this round (the last written wins, as a sort would pick one); the rest
            # probe on, the entry taken by then.
            claimant[at[free]] = free
            winners = free[claimant[at[free]] == free]
            claimant[at[free]] = -1
            table[at[winners]] = rows[pending[winners]]
            placed.append((pending[winners], at[winners]))
            fresh += int(np.count_nonzero(seen[winners] == EMPTY))
            left = np.ones(pending.size, dtype=np.bool_)
            left[winners] = False
            pending = pending[left]
            pos[pending] = (pos[pending] + 1) & mask
        last: list[int] = []
        for i in pending.tolist():
            p = int(pos[i])
            for _ in range(self.capacity):
                tag = int(tags[p])
                if tag < 2:
                    break
                p = (p + 1) & mask
            else:
                raise RuntimeError("the pool's index mirror has no room left (more live blocks than slots?)")
            table[p] = rows[i]
            fresh += tag == EMPTY
            last.append(p)
        if last:
            placed.append((pending, np.array(last, dtype=np.intp)))
        entries = np.concatenate([a for _, a in placed]) if placed else np.empty(0, dtype=np.intp)
        if self._entry_of.size and placed:  # the owner (a reader never places)
            which = np.concatenate([w for w, _ in placed])
            self._entry_of[(rows[which, 7] & _LO).astype(np.intp)] = entries
        header[USED] += np.uint64(fresh)
        header[LIVE] += np.uint64(rows.shape[0])
        return entries

    def _rebuild(self) -> None:
        """Drop the tombstones: every live entry placed again into an empty table."""
        table = self._table
        live = np.take(table, np.flatnonzero(table[:, 0] >= 2), axis=0)  # 4x cheaper than a boolean mask's
        table[:] = 0
        self._header[USED] = 0
        self._header[LIVE] = 0
        self._place(self._place_in_order(live))

    def _place_in_order(self, rows: U64) -> U64:
        """Place rows into an empty table as inserting them one by one in the order of their home entries
        would: each takes its home or the entry after the previous one's, whichever is later (a running
        maximum, in numpy: a rebuild of 24,000 entries took 5 ms in rounds). Returns the rows that would
        wrap past the table's end, for ``_place``."""
        n = rows.shape[0]
        if not n:
            return rows
        home = (rows[:, 0] & self._mask).astype(np.intp)
        order = np.argsort(home, kind="stable")  # the live rows come in table order, nearly sorted: timsort's case
        each = np.arange(n, dtype=np.intp)
        at = np.maximum.accumulate(home[order] - each) + each
        fits = at < self.capacity  # the last few of a chain at the end wrap: probed from their home after
        placed, at = order[fits], at[fits]
        self._table[at] = rows[placed]
        if self._entry_of.size:
            self._entry_of[(rows[placed, 7] & _LO).astype(np.intp)] = at
        self._header[USED] += np.uint64(placed.size)
        self._header[LIVE] += np.uint64(placed.size)
        left: U64 = rows[order[~fits]]
        return left

    def insert(
        self,
        keys: Sequence[bytes | int],
        slots: Sequence[int] | I64,
        lengths: Sequence[int] | I64,
        types: set[type] | None = None,
        matrix: KeyMatrix | None = None,
    ) -> None:
        """Committed blocks (keys not in the mirror); their slots start unreferenced. ``types`` and
        ``matrix``: the keys' types and bytes (``KeyMatrix``), where the caller has them."""
        if not keys or self.closed:
            return
        rows = key_rows(keys, self._hasher, types, matrix)
        slot_ids = np.asarray(slots, dtype=np.uint64)
        rows[:, 7] = slot_ids | np.asarray(lengths, dtype=np.uint64) << np.uint64(32)
        changed: npt.NDArray[np.intp] | None = None  # all of them, unless the placing finishes
        self._begin()
        try:
            rebuilt = int(self._header[USED]) + len(keys) > self.capacity * 3 // 4
            if rebuilt:
                self._rebuild()
            placed = self._place(rows)
            changed = None if rebuilt else placed
            self._refs[slot_ids.astype(np.intp)] = 0
        finally:
            self._end(changed)

    def remove_slots(self, slots: Sequence[int] | I64) -> None:
        """The blocks in ``slots`` evicted or discarded (owner): their entries are found by slot, with no
        hashing and no probe. A slot holding no block in the table is ignored."""
        if not len(slots) or self.closed:
            return
        ids = np.asarray(slots, dtype=np.intp)
        entries = self._entry_of[ids]
        held = entries >= 0
        entries, ids = entries[held], ids[held]
        # The record is the owner's alone; the table's own slot field is checked all the same.
        if not np.array_equal((self._table[entries, 7] & _LO).astype(np.intp), ids):
            raise AssertionError("pool invariant broken: the mirror's record of its entries is stale")
        changed = entries
        self._begin()
        try:
            self._table[entries, 0] = TOMBSTONE
            self._header[LIVE] -= np.uint64(entries.size)
            changed = np.concatenate([entries, self._reclaim(entries)])
        finally:
            self._end(changed, tags=True)
        self._entry_of[ids] = -1

    def _reclaim(self, entries: npt.NDArray[np.intp]) -> npt.NDArray[np.intp]:
        """Empty the tombstones just written that end a chain (the entry after is empty: no probe passes
        them to reach a key), and those before them in turn; returns the entries emptied. Without it a
        table whose keys come and go filled up with tombstones and was rebuilt (a copy of both tables)
        every few stores."""
        tags = self._table[:, 0]
        mask = self.capacity - 1
        emptied: list[npt.NDArray[np.intp]] = []
        ending = entries[tags[(entries + 1) & mask] == EMPTY]  # each entry removed is a tombstone (distinct)
        for _ in range(RECLAIM_ROUNDS):  # a run of tombstones empties from its end, an entry a round
            if not ending.size:
                break
            tags[ending] = EMPTY
            emptied.append(ending)
            ending = (ending - 1) & mask
            ending = ending[tags[ending] == TOMBSTONE]  # the entry after each was just emptied
        out = np.concatenate(emptied) if emptied else np.empty(0, dtype=np.intp)
        self._header[USED] -= np.uint64(out.size)
        return out

    def clear(self) -> None:
        if self.closed:
            return
        self._begin()
        try:
            self._table[:] = 0
            self._header[LIVE] = 0
            self._header[USED] = 0
        finally:
            self._end(None)
        self._entry_of[:] = -1

    def mark_closed(self) -> None:
        """Readers stop answering from the mirror (the owner closes the pool)."""
        if self.closed:
            return
        self._begin()
        self._header[STATE] = CLOSED
        self._end(np.empty(0, dtype=np.intp))

    def referenced(self, slot: int) -> bool:
        """Whether an attached process's lookup hit the block in ``slot`` since ``unreference``."""
        return bool(self._flags[slot])

    def unreference(self, slot: int) -> None:
        self._flags[slot] = 0

    def referenced_many(self, slots: I64) -> npt.NDArray[np.bool_]:
        """``referenced`` of each slot in ``slots`` (owner)."""
        flags: npt.NDArray[np.bool_] = self._refs[slots] != 0
        return flags

    def unreference_many(self, slots: I64) -> None:
        self._refs[slots] = 0
