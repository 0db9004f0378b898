"""The shared pool attacked as a hostile or unlucky engine would, after its index rewrite (protocol 4).

A raw client (``Raw``) speaks the wire protocol itself and sends what no
``AttachedPool`` would: frames that lack parts, keys of mixed forms and
widths, commits and aborts of claims it guesses, requests while its store
waits for slots. Attached processes scribble the index mirror's shared
table, real processes are killed between a store's begin and its commit,
and ``AttachedPool`` calls are cancelled at every await while others evict
and load. After each scenario the owner's books must hold
(``assert_books``): its index, its mirror and ``statistics()`` agree, no
slot is both free and indexed, and nothing is claimed or pinned that no
live process holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import mmap
import os
import sys
import tracemalloc
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from aiokvtier import AttachedPool, Pool, PoolLostError
from aiokvtier._host import _linux
from aiokvtier._pool import _owner, _wire
from aiokvtier._pool._events import EventFanout
from aiokvtier._pool._index import BlockIndex
from aiokvtier._pool._mirror import ENTRY, HEADER, USABLE, IndexMirror, capacity_for, hash_words, key_rows
from tests.conftest import PopulateGate
from tests.test_pool import ENV, ROOT, WAIT, Child, attached, sock, until
from tests.test_pool import key as hexkey
from tests.test_pool_attack import attack, cases

__all__ = ["sock"]  # the fixture, used by name

CONFIG = {"quota": "16MiB", "max_quota": "32MiB", "slot_size": "64KiB"}  # 256 slots; the first fill unit holds 64
SLOTS = 256


class Raw:
    """A process that speaks the pool's wire protocol itself (its WELCOME's descriptors are dropped)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.rid = 1000
        self.kept: dict[int, _wire.Message] = {}

    @classmethod
    async def open(cls, path: str) -> Raw:
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(_wire.encode(_wire.HELLO, 0, {"v": _wire.VERSION, "pid": os.getpid()}))
        raw = cls(reader, writer)
        welcome = await raw._next()
        assert welcome.op == _wire.WELCOME, welcome
        return raw

    async def _next(self) -> _wire.Message:
        async with asyncio.timeout(WAIT):
            head = await self.reader.readexactly(_wire.LENGTH.size)
            return _wire.decode(await self.reader.readexactly(_wire.LENGTH.unpack(head)[0]))

    def send(self, op: int, fields: dict[str, Any] | None = None, parts: Sequence[bytes] = ()) -> int:
        self.rid += 1
        self.writer.write(_wire.encode(op, self.rid, fields, parts))
        return self.rid

    async def answer(self, rid: int) -> _wire.Message:
        while rid not in self.kept:
            message = await self._next()
            if message.op in (_wire.REPLY, _wire.ERROR):
                self.kept[message.rid] = message
        return self.kept.pop(rid)

    async def ask(self, op: int, fields: dict[str, Any] | None = None, parts: Sequence[bytes] = ()) -> _wire.Message:
        return await self.answer(self.send(op, fields, parts))

    async def ok(self, op: int, fields: dict[str, Any] | None = None, parts: Sequence[bytes] = ()) -> _wire.Message:
        message = await self.ask(op, fields, parts)
        assert message.op == _wire.REPLY, message.fields
        return message

    async def refused(self, op: int, fields: dict[str, Any] | None = None, parts: Sequence[bytes] = ()) -> Exception:
        message = await self.ask(op, fields, parts)
        assert message.op == _wire.ERROR, f"op {op} was served: {message.fields}"
        return _wire.error_from(message)

    async def owner_hits(self, keys: Sequence[bytes | int]) -> int:
        """The owner's own answer to a lookup (asked over the socket, never from the mirror)."""
        kind, parts = _wire.encode_keys(list(keys))
        return int((await self.ok(_wire.LOOKUP, {"k": kind}, parts)).fields["hits"])

    def begin(self, keys: Sequence[bytes | int], length: int = 100, **fields: Any) -> int:
        kind, parts = _wire.encode_keys(list(keys))
        return self.send(_wire.BEGIN, {"k": kind, **fields}, [*parts, np.full(len(keys), length, np.uint64).tobytes()])

    async def store(self, keys: Sequence[bytes | int]) -> int:
        """Claim and commit ``keys`` (their bytes are not written: the owner cannot tell); returns the claim."""
        claim = int((await self.answer(self.begin(keys))).fields["claim"])
        if claim:
            await self.ok(_wire.COMMIT, {"claim": claim})
        return claim

    async def discard(self, keys: Sequence[bytes | int]) -> int:
        kind, parts = _wire.encode_keys(list(keys))
        return int((await self.ok(_wire.DISCARD, {"k": kind}, parts)).fields["dropped"])

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


@contextlib.asynccontextmanager
async def rig(path: str, config: dict[str, Any] = CONFIG) -> AsyncIterator[tuple[Pool, AttachedPool, Raw]]:
    """An owner, an attached process that reads the mirror, and a raw one that asks the owner."""
    async with Pool(config, path) as pool, AttachedPool(path) as reader:
        raw = await Raw.open(path)
        try:
            yield pool, reader, raw
        finally:
            await raw.close()


async def assert_books(
    pool: Pool, reader: AttachedPool, raw: Raw, universe: Sequence[bytes | int], held: int = 0
) -> None:
    """Once every answer has come: the owner's index, its mirror and ``statistics()`` agree.

    Every key of ``universe`` (a superset of what is stored) is a hit in the mirror exactly where the
    owner's index holds it, and they add up to ``statistics().blocks``; nothing is claimed or pinned;
    the tier's allocated slots are the blocks' and the ``held`` slots of attached processes; and no slot
    is both free and indexed: every free slot, taken at once, is none of the blocks' slots."""
    universe = list(dict.fromkeys(universe))
    await until(
        lambda: (s := pool.statistics()).claims == 0 and s.blocks_pinned == 0 and s.slots_attached == held,
        "a store or a load left something claimed, pinned or held",
    )
    pool.check_invariants(sole_user=True)
    owner = [await raw.owner_hits([k]) for k in universe]
    mirror = [reader.lookup_nowait([k]) for k in universe]
    found = [await reader.lookup([k]) for k in universe]
    assert found == owner, "the mirror answers other than the owner's index"
    assert all(m in (None, o) for m, o in zip(mirror, owner, strict=True))
    s = pool.statistics()
    assert sum(owner) == s.blocks and s.tier.slots_allocated == s.blocks + held
    stored = [k for k, hit in zip(universe, owner, strict=True) if hit]
    await reader.wait_resident()
    blocks: set[int] = set()
    if stored:  # the blocks' slots, as a load is told them (pinned meanwhile)
        kind, parts = _wire.encode_keys(stored)
        loaded = await raw.ok(_wire.LOAD, {"k": kind}, parts)
        blocks = set(loaded.ints(0).tolist())
        assert len(blocks) == len(stored), "two blocks share a slot"
    free = s.tier.slots_total - s.tier.slots_allocated
    if free:
        taken = (await raw.ok(_wire.ALLOC, {"n": free})).ints(0).tolist()
        assert not blocks & set(taken), f"slots {sorted(blocks & set(taken))} are free and indexed"
        await raw.ok(_wire.FREE, {}, [np.array(taken, dtype=np.int64).tobytes()])
    if stored:
        raw.send(_wire.UNPIN, {"pin": loaded.fields["pin"]})
    await until(lambda: pool.statistics().blocks_pinned == 0, "the books' own load stayed pinned")
    pool.check_invariants(sole_user=True)


@pytest.fixture
def gate() -> Iterator[PopulateGate]:
    """The shared tier's fill, held after its first unit (64 slots) until let through."""
    held = PopulateGate(_linux.populate_write)
    real, _linux.populate_write = _linux.populate_write, held  # type: ignore[assignment]
    held.allow(1)
    try:
        yield held
    finally:
        held.release_all()
        _linux.populate_write = real  # type: ignore[assignment]


def keyed(keys: Sequence[bytes | int]) -> tuple[dict[str, Any], list[bytes]]:
    """A request's fields and parts for ``keys``."""
    kind, parts = _wire.encode_keys(list(keys))
    return {"k": kind}, parts


def framed(payload: bytes) -> bytes:
    return _wire.LENGTH.pack(len(payload)) + payload


def keys_of(prefix: bytes, n: int) -> list[bytes]:
    return [b"%s-%d" % (prefix, i) for i in range(n)]


# -- a store's claim, touched while its BEGIN waits for slots ------------------------------------------------


@pytest.mark.parametrize("meddle", [_wire.ABORT, _wire.COMMIT], ids=["abort", "commit"])
async def test_a_claim_aborted_or_committed_while_its_begin_waits_for_the_fill_takes_no_slot(
    sock: str, gate: PopulateGate, meddle: int
) -> None:
    """Claim ids are small consecutive ints: a process may name one before its BEGIN has answered.
    An ABORT of it used to make the BEGIN take its slots when the fill came and answer ``'1'`` (a
    KeyError): the slots were then held by nobody, for good."""
    async with rig(sock) as (pool, reader, raw):
        keys = keys_of(b"waiting", 200)  # more than the first unit's 64 slots: the BEGIN waits
        begin = raw.begin(keys)
        await until(lambda: pool.statistics().claims == 1, "the store did not claim its keys")
        guesses = [raw.send(meddle, {"claim": claim}) for claim in range(1, 8)] if meddle == _wire.COMMIT else []
        if meddle == _wire.ABORT:
            for claim in range(1, 8):
                raw.send(_wire.ABORT, {"claim": claim})
        for rid in guesses:  # its slots are not there yet (or it is not this process's): refused, by name
            error = await raw.answer(rid)
            assert error.op == _wire.ERROR
            message = str(error.fields["message"])
            assert message.startswith(("no store in flight with claim", "the store of claim")), message
        await until(lambda: pool.statistics().claims == (1 if meddle == _wire.COMMIT else 0), "the abort")
        gate.release_all()
        answer = await raw.answer(begin)
        if meddle == _wire.ABORT:
            assert answer.op == _wire.ERROR
            assert "aborted" in str(answer.fields["message"])
        else:  # the store goes on, and commits once its slots came
            assert answer.op == _wire.REPLY
            await raw.ok(_wire.COMMIT, {"claim": answer.fields["claim"]})
        await assert_books(pool, reader, raw, keys)
        assert pool.statistics().blocks == (200 if meddle == _wire.COMMIT else 0)


# -- keys of very different lengths ---------------------------------------------------------------------------


async def test_one_long_key_among_short_ones_costs_its_own_bytes_not_a_matrix_of_them(sock: str) -> None:
    """The mirror used to pad every key of a batch to the longest: a store and two lookups of 255 short
    keys and one of 64 KiB peaked at 34 MB (16 MiB of rows, copied), in the owner at its commit and in the
    attached process at its lookups; with a key of 100 MiB the owner asked for 25 GiB (an error on this
    machine, the owner killed for memory on a larger one)."""
    async with rig(sock) as (pool, reader, raw):
        keys = [*keys_of(b"short", 255), b"L" * (64 << 10)]
        tracemalloc.start()
        try:
            result = await reader.store(keys, [b"v" * 100] * len(keys))
            assert await reader.lookup(keys) == 256
            assert await reader.lookup(keys[::-1]) == 256
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert len(result.stored) == 256
        assert peak < 8 << 20, f"a peak of {peak >> 10} KiB for 66 KiB of keys"
        await assert_books(pool, reader, raw, keys)


# -- the mirror's shared table, scribbled by an attached process ----------------------------------------------


def scribble_mirror(capacity: int, how: str) -> None:
    """Write over the index mirror's table as any attached process can (its memfd, reached through /proc;
    every one found: a mapping of an earlier pool may be left until the garbage collector's next pass)."""
    scribbled = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
            fd = os.open(f"/proc/self/fd/{name}", os.O_RDWR) if "aiokvtier-pool-index" in target else -1
        except OSError:
            continue
        if fd < 0:
            continue
        try:
            if os.fstat(fd).st_size < HEADER + capacity * ENTRY:
                continue
            mapping = mmap.mmap(fd, HEADER + capacity * ENTRY)
        finally:
            os.close(fd)
        table = np.frombuffer(mapping, dtype=np.uint64, count=capacity * 8, offset=HEADER).reshape(capacity, 8)
        if how == "slots":
            table[table[:, 0] >= 2, 7] ^= np.uint64(0xFF)
        elif how == "tags":
            table[:, 0] = np.uint64(7)  # every entry looks taken: no room, and no probe ends
        else:
            table[:] = 0
        del table
        mapping.close()
        scribbled += 1
    assert scribbled, "no index mirror in this process"


@pytest.mark.skipif(not USABLE, reason="the mirror is read only on x86-64")
@pytest.mark.parametrize("scribble", ["slots", "tags", "zeros"])
async def test_a_mirror_table_scribbled_by_a_process_spoils_lookups_never_the_owners_books(
    sock: str, scribble: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every attached process maps the mirror read-write (for its referenced bytes). A process that wrote
    over the table used to make the owner's next discard or eviction raise half-way: the keys left the
    index, their slots were never freed, and the mirror answered them as hits for good."""
    async with rig(sock) as (pool, reader, raw):
        keys = keys_of(b"scribbled", 100)
        assert await raw.store(keys)
        await asyncio.to_thread(scribble_mirror, capacity_for(512), scribble)
        await raw.discard(keys[:30])
        assert await raw.store(keys_of(b"more", 200))  # evicts 44
        assert await raw.store(keys[30:40])  # present ones and stored again
        universe = [*keys, *keys_of(b"more", 200)]
        assert "index mirror could not be written" in caplog.text  # and made anew: lookups read it again
        assert reader.lookup_nowait(keys[30:40]) == 10
        await assert_books(pool, reader, raw, universe)
        # The books hold, whatever the scribbler spoiled: stores, discards and evictions go on.
        await raw.discard(universe)
        assert await raw.store(keys)
        await assert_books(pool, reader, raw, universe)


# -- frames that lack what their request needs ---------------------------------------------------------------


async def test_requests_missing_their_parts_are_refused_by_name(sock: str, caplog: pytest.LogCaptureFixture) -> None:
    """A FREE without its slot ids used to fail inside the owner (an IndexError logged as the pool's own
    failure, answered ``list index out of range``); a BEGIN without its lengths took the keys' bytes for
    them; padded keys wider than numpy's records were a TypeError."""
    I = np.array([1, 2, 3], dtype=np.int64).tobytes()  # noqa: E741
    async with rig(sock) as (pool, reader, raw):
        with caplog.at_level(logging.ERROR, logger="aiokvtier"):
            for op, fields, parts, named in [
                (_wire.FREE, {}, [], "slot ids"),
                (_wire.BEGIN, {"k": "i"}, [I], "lengths"),
                (_wire.BEGIN, {"k": "i"}, [I, I, I], "lengths"),
                (_wire.BEGIN, {"k": "f"}, [_wire.LENGTH.pack(8), I], "lengths"),
                (_wire.LOOKUP, {"k": "p"}, [_wire.LENGTH.pack(2**32 - 1), b""], "padded keys"),
                (_wire.LOOKUP, {"k": "f"}, [_wire.LENGTH.pack(2**32 - 1), b""], "fixed-length keys"),
                (_wire.BEGIN, {"k": "p"}, [_wire.LENGTH.pack(2**31), b"", b""], "padded keys"),
            ]:
                error = await raw.refused(op, fields, parts)
                assert isinstance(error, ValueError), (op, parts, error)
                assert named in str(error), (op, parts, error)
        assert "failed a request" not in caplog.text
        await assert_books(pool, reader, raw, [1, 2, 3])


def test_a_key_has_one_entry_however_far_apart_the_lengths_of_its_batch() -> None:
    keys: list[bytes | int] = [b"a", b"b" * 40, b"c" * 300, 5, 2**70, b"d" * 5000, b"e\x00", -1, b"f" * 33]
    rows = key_rows(keys)
    for i, k in enumerate(keys):
        assert (key_rows([k])[0] == rows[i]).all(), k
    only_bytes = [k for k in keys if isinstance(k, bytes)]
    assert (key_rows(only_bytes) == rows[[i for i, k in enumerate(keys) if isinstance(k, bytes)]]).all()


@pytest.mark.skipif(not USABLE, reason="the mirror is read only on x86-64")
def test_a_mirror_that_cannot_be_written_nor_made_anew_is_retired_and_the_index_keeps_its_books() -> None:
    """Lookups then go to the owner (a reader's answer is None), and the index goes on whole."""
    calls = itertools.count()

    def failing(data: np.ndarray, kind: int, lengths: np.ndarray) -> np.ndarray:
        if next(calls) >= 1:
            raise MemoryError("injected: no memory for the rows")
        return hash_words(data, kind, lengths)

    writer = IndexMirror.create(16, hasher=failing)
    reader = IndexMirror.attach(os.dup(writer.fd), 16)
    try:
        index = BlockIndex(writer, 16)
        for key, slot in ((b"first", 3), (b"second", 5)):
            claim = index.claim([key], np.array([100], dtype=np.int64))
            index.place(claim, np.array([slot], dtype=np.int64))
            index.commit(claim)
        assert index.mirror is None and reader.lookup([b"first"]) is None
        assert index.lookup([b"first", b"second"]) == 2
        index.check()
        assert index.discard([b"first"])[1].tolist() == [3]
        assert index.evict(1, [])[1] == [5]
        index.check()
    finally:
        reader.close()
        writer.close()


# -- hostile frames, then the books ---------------------------------------------------------------------------


async def test_commits_and_aborts_of_claims_a_process_does_not_hold_change_nothing(sock: str) -> None:
    async with rig(sock) as (pool, reader, mine):
        other = await Raw.open(sock)
        try:
            keys = keys_of(b"theirs", 8)
            claim = int((await other.answer(other.begin(keys))).fields["claim"])
            error = await mine.refused(_wire.COMMIT, {"claim": claim})
            assert "no store in flight" in str(error)
            mine.send(_wire.ABORT, {"claim": claim})
            mine.send(_wire.UNPIN, {"pin": claim})
            assert await reader.lookup(keys) == 0 and pool.statistics().claims == 1
            await other.ok(_wire.COMMIT, {"claim": claim})
            error = await other.refused(_wire.COMMIT, {"claim": claim})  # twice
            assert "no store in flight" in str(error)
            other.send(_wire.ABORT, {"claim": claim})  # after its commit: nothing to give up
            assert await other.owner_hits(keys) == 8 and await reader.lookup(keys) == 8
        finally:
            await other.close()
        await assert_books(pool, reader, mine, keys)


async def test_a_store_left_claimed_by_a_process_that_goes_is_stored_by_the_one_waiting_for_it(sock: str) -> None:
    async with rig(sock) as (pool, reader, raw):
        keys = keys_of(b"left", 70)  # 70 keys of several lengths: the padded form
        claim = int((await raw.answer(raw.begin(keys))).fields["claim"])
        assert claim and pool.statistics().claims == 1
        assert await reader.discard(keys) == 0  # being stored: not a block yet, and the claim stands
        waiting = asyncio.ensure_future(reader.store(keys, [b"mine"] * 70))
        await asyncio.sleep(0.05)
        assert not waiting.done() and await reader.lookup(keys) == 0
        await raw.close()  # BEGIN, never COMMIT: the process goes
        async with asyncio.timeout(WAIT):
            result = await waiting
        assert result.stored == tuple(keys)
        dst = np.zeros((70, 4), dtype=np.uint8)
        await reader.load(keys, dst)
        assert (dst == np.frombuffer(b"mine", dtype=np.uint8)).all()
        again = await Raw.open(sock)
        try:
            await assert_books(pool, reader, again, keys)
        finally:
            await again.close()


async def test_keys_in_every_form_hostile_ones_included_are_the_owners_keys_in_the_mirror(sock: str) -> None:
    """Rows with zero bytes inside or at their end, an all-zero row, rows wider than the client's padded
    form, fixed-length keys ending in zero bytes, ints beside bytes: whatever the owner makes of a frame's
    keys, the mirror answers those same keys."""
    async with rig(sock) as (pool, reader, raw):
        rows = [b"a\x00b", b"ab\x00", b"\x00\x00\x00", b"xyz"] + [b"r%02d" % i for i in range(60)]
        wide = np.zeros((len(rows), 40), dtype=np.uint8)
        for i, row in enumerate(rows):
            wide[i, : len(row)] = np.frombuffer(row, dtype=np.uint8)
        wide[3, 39] = 7  # a key of 40 bytes
        lengths = np.full(len(rows), 10, np.uint64).tobytes()
        answer = await raw.ok(_wire.BEGIN, {"k": "p"}, [_wire.LENGTH.pack(40), wide.tobytes(), lengths])
        await raw.ok(_wire.COMMIT, {"claim": answer.fields["claim"]})
        fixed = [b"f\x00\x00\x00", b"g\x00\x00\x01", b"\x00\x00\x00\x00"]
        answer = await raw.ok(
            _wire.BEGIN, {"k": "f"}, [_wire.LENGTH.pack(4), b"".join(fixed), np.full(3, 9, np.uint64).tobytes()]
        )
        await raw.ok(_wire.COMMIT, {"claim": answer.fields["claim"]})
        mixed: list[bytes | int] = [0, -1, 2**63 - 1, 2**64, -(2**70), b"m", b"", b"i5"]
        assert await raw.store(mixed[:-2]) and await raw.store([b"i5"])  # b"" came as the all-zero row
        decoded = [row.rstrip(b"\x00") for row in rows]
        decoded[3] = bytes(wide[3])
        universe = [*decoded, *fixed, *mixed, b"a", b"ab\x00", b"f", b"\x00", 5, b"\x00" * 3]
        assert await reader.lookup(decoded) == len(rows)
        assert await reader.lookup(fixed) == 3 and await reader.lookup(mixed) == len(mixed)
        await assert_books(pool, reader, raw, universe)


async def test_malformed_frames_are_refused_or_drop_their_process_and_change_nothing(sock: str) -> None:
    I = np.array([1, 2, 3], dtype=np.int64).tobytes()  # noqa: E741
    async with rig(sock) as (pool, reader, raw):
        keys = keys_of(b"kept", 40)
        await reader.store(keys, [b"v" * 10] * 40)
        refused: list[tuple[int, dict[str, Any], list[bytes]]] = [
            (_wire.LOOKUP, {}, []),
            (_wire.LOOKUP, {"k": ["i"]}, [I]),
            (_wire.LOOKUP, {"k": "p"}, [_wire.LENGTH.pack(0), b""]),
            (_wire.LOOKUP, {"k": "p"}, [_wire.LENGTH.pack(3), b"abcd"]),
            (_wire.LOOKUP, {"k": "b"}, [np.array([5], np.uint32).tobytes(), b"ab"]),
            (_wire.LOOKUP, {"k": "m"}, [np.array([2], np.uint32).tobytes(), b"zz"]),
            (_wire.LOOKUP, {"k": "m"}, [np.array([5001], np.uint32).tobytes(), b"i" + b"9" * 5000]),
            (_wire.BEGIN, {"k": "i"}, [I, np.array([0, 1, 1], np.uint64).tobytes()]),
            (_wire.BEGIN, {"k": "i"}, [I, np.array([1, 1, 2**63], np.uint64).tobytes()]),
            (_wire.BEGIN, {"k": "i"}, [I, np.array([1, 1], np.uint64).tobytes()]),
            (_wire.BEGIN, {"k": "i"}, [I, b"odd"]),
            (_wire.BEGIN, {"k": "i"}, [np.array([4, 4], np.int64).tobytes(), np.ones(2, np.uint64).tobytes()]),
            (_wire.COMMIT, {}, []),
            (_wire.COMMIT, {"claim": True}, []),
            (_wire.COMMIT, {"claim": "1"}, []),
            (_wire.AWAIT, {}, []),
            (_wire.LOAD, {"k": "i"}, [np.array([77], np.int64).tobytes()]),
            (_wire.DISCARD, {"k": "q"}, [b"", b""]),
            (_wire.ALLOC, {}, []),
            (_wire.ALLOC, {"n": 0}, []),
            (_wire.ALLOC, {"n": 2**62}, []),
            (_wire.ALLOC, {"n": 10**30}, []),
            (_wire.ALLOC, {"n": 1.5}, []),
            (_wire.FREE, {}, [np.array([0], np.int64).tobytes()]),
            (_wire.FREE, {}, [b"abc"]),
            (_wire.HELLO, {"v": _wire.VERSION}, []),
            (_wire.REPLY, {}, []),
            (0, {}, []),
            (255, {}, []),
        ]
        for op, fields, parts in refused:
            error = await raw.refused(op, fields, parts)
            assert str(error), (op, fields)
        for op, fields in [(_wire.ABORT, {"claim": -5}), (_wire.UNPIN, {"pin": 10**40}), (_wire.LOOKED, {"q": -1})]:
            raw.send(op, fields)  # no reply, and nothing changes
        empty = {"k": "i"}, [b""]
        assert (await raw.ok(_wire.LOOKUP, *empty)).fields["hits"] == 0
        assert (await raw.ok(_wire.DISCARD, *empty)).fields["dropped"] == 0
        await raw.ok(_wire.AWAIT, *empty)
        assert (await raw.ok(_wire.BEGIN, {"k": "i"}, [b"", b""])).fields["claim"] == 0
        pin = (await raw.ok(_wire.LOAD, *empty)).fields["pin"]
        raw.send(_wire.UNPIN, {"pin": pin})
        await assert_books(pool, reader, raw, keys)
        # Frames that are not frames: the process is dropped, and what it held goes back.
        stats = _wire.HEAD.pack(_wire.STATS, 1, 0)
        for garbage, then_goes in [
            (b"\x05\x00\x00\x00garbage", False),
            (_wire.LENGTH.pack(_wire.MAX_FRAME + 1), False),
            (framed(_wire.HEAD.pack(_wire.STATS, 1, 200) + b"{}"), False),  # json past the frame's end
            (framed(_wire.HEAD.pack(_wire.STATS, 1, 3) + b"[1]"), False),
            (framed(_wire.HEAD.pack(_wire.STATS, 1, 6) + b'{"p":1'), False),
            (framed(_wire.HEAD.pack(_wire.STATS, 1, 10) + b'{"p":[-1]}'), False),
            (framed(_wire.HEAD.pack(_wire.STATS, 1, 9) + b'{"p":[4]}' + b"abc"), False),
            (framed(_wire.HEAD.pack(_wire.STATS, 1, 2) + b"\xff\xfe"), False),
            (framed(stats[:5]), False),
            (_wire.encode(_wire.STATS, 1)[:-3], True),  # cut short, then the process goes
            (_wire.LENGTH.pack(64) + stats, True),
        ]:
            hostile = await Raw.open(sock)
            await hostile.ok(_wire.ALLOC, {"n": 3})
            claim = int((await hostile.answer(hostile.begin(keys_of(b"dropped", 5)))).fields["claim"])
            pin = (await hostile.ok(_wire.LOAD, *keyed(keys[:4]))).fields["pin"]
            assert claim and pin and pool.statistics().claims == 1
            hostile.writer.write(garbage)
            if then_goes:
                hostile.writer.write_eof()
            async with asyncio.timeout(WAIT):
                assert await hostile.reader.read() == b""  # the owner let it go
            await hostile.close()
            await assert_books(pool, reader, raw, [*keys, *keys_of(b"dropped", 5)])
        assert pool.clients == 2


async def test_a_store_of_more_keys_than_slots_evicts_what_it_may_and_skips_the_rest(sock: str) -> None:
    async with rig(sock) as (pool, reader, raw):
        old = keys_of(b"old", 100)
        await reader.store(old, [b"o"] * 100)
        pinned = (await raw.ok(_wire.LOAD, *keyed(old[:10]))).fields["pin"]
        many = list(range(100_000))
        answer = await raw.answer(raw.begin(many))
        outcomes = np.frombuffer(answer.parts[0], dtype=np.uint8)
        assert int(np.count_nonzero(outcomes == _wire.CLAIMED)) == SLOTS - 10  # all but the pinned
        assert (outcomes[SLOTS - 10 :] == _wire.SKIPPED).all()
        await raw.ok(_wire.COMMIT, {"claim": answer.fields["claim"]})
        assert await raw.owner_hits(old[:10]) == 10 and await raw.owner_hits(old[10:11]) == 0
        raw.send(_wire.UNPIN, {"pin": pinned})
        await assert_books(pool, reader, raw, [*old, *many[:300]])


# -- processes killed between a store's steps -----------------------------------------------------------------


@contextlib.asynccontextmanager
async def raw_process(path: str, prefix: str, n: int) -> AsyncIterator[Child]:
    child = Child(
        await asyncio.create_subprocess_exec(
            sys.executable,
            str(ROOT / "tests" / "pool_raw_client.py"),
            path,
            prefix,
            str(n),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=ENV,
            cwd=ROOT,
        )
    )
    try:
        await child.event("attached")
        yield child
    finally:
        if child.proc.returncode is None:
            await child.kill()


def command(child: Child, line: str) -> None:
    assert child.proc.stdin is not None
    child.proc.stdin.write(line.encode() + b"\n")


async def test_a_process_killed_while_its_begin_waits_for_the_fill_hands_its_keys_to_the_one_waiting(
    sock: str, gate: PopulateGate
) -> None:
    keys = keys_of(b"killed", 200)  # more than the first unit: the BEGIN waits for the fill
    async with rig(sock) as (pool, reader, raw), raw_process(sock, "killed", 200) as child:
        command(child, "begin")
        await child.event("sent")
        await until(lambda: pool.statistics().claims == 1, "the killed process's store never claimed")
        waiting = asyncio.ensure_future(reader.store(keys, [b"w" * 64] * 200))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await child.kill()
        await until(lambda: pool.clients == 2, "the owner never saw the process die")
        gate.release_all()
        async with asyncio.timeout(WAIT):
            result = await waiting
        assert result.stored == tuple(keys)
        await assert_books(pool, reader, raw, keys)


@pytest.mark.parametrize("delay", [0, 0.0002, 0.001, 0.005])
async def test_a_process_killed_as_it_commits_leaves_its_blocks_whole_or_gone(sock: str, delay: float) -> None:
    async with rig(sock) as (pool, reader, raw):
        universe: list[bytes] = []
        for turn in range(3):
            keys = keys_of(b"c%d" % turn, 70)
            universe += keys
            async with raw_process(sock, f"c{turn}", 70) as child:
                command(child, "begin")
                command(child, "wait")
                begun = await child.event("begun")
                assert begun["op"] == _wire.REPLY and begun["claim"]
                command(child, "commit")
                await asyncio.sleep(delay)
                await child.kill()
            await until(lambda: pool.clients == 2, "the owner never saw the process die")
            assert await raw.owner_hits(keys) in (0, 70)
            await assert_books(pool, reader, raw, universe)


# -- recency: many touches, the log compacted and read from its head ------------------------------------------


async def test_evictions_follow_every_touch_through_many_compactions_of_the_recency_log(sock: str) -> None:
    """Thousands of touches (owner lookups, loads, stores of present keys) between evictions: the recency
    log is compacted and read from its head many times over, and each eviction takes the least recently
    used blocks that no load pins, in order, as an ordered dict moved to its end at each touch would."""
    rng = np.random.default_rng(7)
    async with rig(sock) as (pool, reader, raw):
        events = await reader.events(limit=100_000)
        order: dict[bytes, None] = {}
        keys = keys_of(b"lru", SLOTS)
        assert await raw.store(keys)
        order.update(dict.fromkeys(keys))
        fresh = 0
        for _ in range(6):
            for i in rng.integers(0, len(order), 1500).tolist():
                key = list(order)[i]
                how = i % 3
                if how == 0:
                    assert await raw.owner_hits([key]) == 1
                elif how == 1:
                    pin = (await raw.ok(_wire.LOAD, *keyed([key]))).fields["pin"]
                    raw.send(_wire.UNPIN, {"pin": pin})
                else:
                    outcome = await raw.answer(raw.begin([key]))
                    assert outcome.parts[0] == bytes([_wire.PRESENT])
                del order[key]
                order[key] = None
            pinned = [list(order)[i] for i in rng.choice(len(order), 3, replace=False).tolist()]
            pin = (await raw.ok(_wire.LOAD, *keyed(pinned))).fields["pin"]
            others = [k for k in order if k not in pinned]
            assert await raw.owner_hits(others) == len(others)  # the pinned ones are the oldest now
            order = dict.fromkeys([*pinned, *others])
            new = keys_of(b"new%d" % fresh, 20)
            fresh += 1
            assert await raw.store(new)
            want = others[:20]  # the pinned are passed over
            for key in want:
                del order[key]
            order.update(dict.fromkeys(new))
            async with asyncio.timeout(WAIT):
                while (event := await anext(events)).kind != "evicted":
                    pass
            assert list(event.keys) == want
            raw.send(_wire.UNPIN, {"pin": pin})
        universe = [*keys, *(k for f in range(fresh) for k in keys_of(b"new%d" % f, 20))]
        await assert_books(pool, reader, raw, universe)
        assert await raw.owner_hits(list(order)) == len(order) == SLOTS


# -- cancellation at every await, while the pool evicts and another process pins --------------------------------


async def test_calls_cancelled_at_every_await_while_the_pool_evicts_around_another_processs_pins(sock: str) -> None:
    """Stores of 80 keys of several lengths (the padded form) into a full pool, loads, lookups and
    discards, each cancelled at every await (turns of the loop, ``wait_for``, ``task.cancel()``, a
    TaskGroup's failing sibling), while a raw process pins blocks: afterwards nothing is claimed, only its
    pins are held, every visible block is whole, and the books hold."""
    async with rig(sock) as (pool, reader, raw):
        filler = keys_of(b"filler", SLOTS - 20)
        assert await raw.store(filler)
        pinned = filler[100:110]
        pin = (await raw.ok(_wire.LOAD, *keyed(pinned))).fields["pin"]

        async def settled(what: str) -> None:
            await until(
                lambda: (s := pool.statistics()).claims == 0 and s.blocks_pinned == len(pinned),
                f"{what}: something left claimed or pinned",
            )
            pool.check_invariants(sole_user=True)
            assert await raw.owner_hits(pinned) == len(pinned), f"{what}: a pinned block was evicted"

        universe: list[bytes] = [*filler]
        for n, (how, delay) in enumerate(cases()):
            keys = [b"x%d-%s" % (n, b"k" * (i % 9)) + b"%d" % i for i in range(80)]
            universe += keys
            src = np.stack([np.frombuffer((k * 64)[:256], dtype=np.uint8) for k in keys])
            await attack(lambda k=keys, s=src: reader.store(k, s), how, delay)  # type: ignore[misc]
            await settled(f"store {how} {delay}")
            visible = await reader.lookup(keys)
            assert visible == await raw.owner_hits(keys)
            if visible:  # whole, never half-copied
                dst = np.zeros((visible, 256), dtype=np.uint8)
                await reader.load(keys[:visible], dst)
                assert (dst == src[:visible]).all(), f"store {how} {delay}: a visible block is not whole"
                out = np.zeros_like(dst)
                await attack(lambda k=keys[:visible], d=out: reader.load(k, d), how, delay)  # type: ignore[misc]
                await settled(f"load {how} {delay}")
            await attack(lambda k=keys: reader.lookup(k), how, delay)  # type: ignore[misc]
            await attack(lambda k=keys[:10]: reader.discard(k), how, delay)  # type: ignore[misc]
            await settled(f"discard {how} {delay}")
            assert await reader.lookup(keys[:10]) in (0, min(visible, 10))  # all dropped, or none
        raw.send(_wire.UNPIN, {"pin": pin})
        await assert_books(pool, reader, raw, universe)


# -- a subscriber that stops reading ----------------------------------------------------------------------------


async def test_events_for_a_process_that_stops_reading_are_dropped_and_counted_not_buffered_for_good(
    sock: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subscribed process that stops reading its socket (stopped, its loop blocked) used to have every
    event of every store on the machine buffered for it in the owner, without bound (4 MiB after 300
    stores and discards of 256 keys, and on as long as it stayed stopped). Past a bound the owner now
    drops its events, and the next one it reads says how many it missed."""
    monkeypatch.setattr(_owner, "EVENTS_BUFFERED", 256 << 10)
    async with rig(sock) as (pool, reader, raw):
        stuck = await Raw.open(sock)
        await stuck.ok(_wire.SUBSCRIBE)
        transport = stuck.writer.transport
        transport.pause_reading()  # type: ignore[attr-defined]  # the raw process reads no more, from here
        keys = [b"%031d" % i for i in range(256)]
        src = np.zeros((256, 16), dtype=np.uint8)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(300):
                await reader.store(keys, src)
                await reader.discard(keys)
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert grown < 2 << 20, f"{grown >> 10} KiB kept for a process that reads nothing"
        transport.resume_reading()  # type: ignore[attr-defined]
        await reader.store(keys[:1], src[:1])  # an event after the drops, which says how many
        seen, dropped = 0, 0
        while True:
            message = await stuck._next()
            if message.op != _wire.EVENT:
                continue
            seen += 1
            dropped += int(message.fields.get("dropped", 0))
            if message.fields["kind"] == "stored" and len(_wire.decode_keys(message.fields["k"], message.parts)) == 1:
                break
        assert dropped and seen + dropped == 601
        await stuck.close()
        await assert_books(pool, reader, raw, keys)


async def test_events_the_owner_dropped_are_counted_with_those_the_subscription_dropped() -> None:
    fanout = EventFanout()
    events = fanout.subscribe(2)
    fanout.publish("stored", (b"a",), 3)  # the owner dropped 3 before this one
    fanout.publish("stored", (b"b",))
    fanout.publish("discarded", (b"c",), 5)  # the queue drops the first (and its 3), this one says 5
    got = [await anext(events), await anext(events)]
    assert [(e.kind, e.keys, e.dropped) for e in got] == [("stored", (b"b",), 4), ("discarded", (b"c",), 5)]


# -- a key discarded and stored again while another process loads it -------------------------------------------


async def test_a_key_discarded_and_stored_anew_while_another_process_loads_it(sock: str) -> None:
    """The loader reads the bytes it pinned, whole, while the key is discarded, stored again with other
    bytes and the pool churned full around the pinned slots; then a loader killed mid-load lets go of its
    pins, and the books hold."""
    hexes = [hexkey(i) for i in range(8)]
    keys = [bytes.fromhex(k) for k in hexes]
    async with rig(sock) as (pool, reader, raw), attached(sock) as child:
        await child.event("attached")
        await child.call("store", keys=hexes, size=4096)
        await child.call("hold")
        loading = child.send("load", keys=hexes, size=4096)
        await child.event("copying")
        assert await reader.discard(keys) == 8 and await reader.lookup(keys) == 0
        anew = np.full((8, 4096), 0xAB, dtype=np.uint8)
        assert len((await reader.store(keys, anew)).stored) == 8
        churn = keys_of(b"churn", 2 * SLOTS)
        for i in range(0, len(churn), 64):  # every slot that may be taken is taken, again and again
            await reader.store(churn[i : i + 64], [b"c" * 4096] * 64)
        assert pool.statistics().blocks_pinned == 0  # the pinned blocks are discarded ones now
        await child.call("release")
        assert (await child.answer(loading))["exact"]  # the old bytes, whole
        universe = [*keys, *churn]
        stored = await raw.owner_hits(keys)
        if stored:
            out = np.zeros((stored, 4096), dtype=np.uint8)
            await reader.load(keys[:stored], out)
            assert (out == 0xAB).all()
        await assert_books(pool, reader, raw, universe)
        await reader.store(keys, anew)
        await child.call("hold")
        child.send("load", keys=hexes, size=4096)
        await child.event("copying")
        assert pool.statistics().blocks_pinned == 8
        await child.kill()
        await until(lambda: pool.clients == 2, "the owner never saw the loader die")
        await assert_books(pool, reader, raw, universe)


# -- the owner killed under stores in flight, then restarted -----------------------------------------------------


async def test_the_owner_killed_under_stores_in_flight_then_restarted_starts_clean(sock: str) -> None:
    owner = await Child.start("pool_owner.py", sock, "16MiB")
    try:
        await owner.event("serving")
        async with AttachedPool(sock) as reader:
            raw = await Raw.open(sock)
            keys = keys_of(b"inflight", 70)
            assert int((await raw.answer(raw.begin(keys))).fields["claim"])  # claimed, never committed
            waiting = asyncio.ensure_future(reader.store(keys, [b"w"] * 70))  # waits for that store
            await asyncio.sleep(0.05)
            assert not waiting.done()
            await owner.kill()
            async with asyncio.timeout(WAIT):
                with pytest.raises(PoolLostError, match="owner went away"):
                    await waiting
                await raw.reader.read()  # to the end: the connection closed
            await raw.close()
            with pytest.raises(PoolLostError):
                await reader.store(keys, [b"w"] * 70)
    finally:
        await owner.close()
    async with rig(sock) as (pool, reader, raw):  # a new owner on the same path: nothing of the old one
        assert await reader.lookup(keys) == 0 and pool.statistics().tier.slots_allocated == 0
        assert len((await reader.store(keys, [b"w"] * 70)).stored) == 70
        await assert_books(pool, reader, raw, keys)


async def test_a_process_that_sends_requests_without_reading_the_answers_is_read_no_more_meanwhile(
    sock: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner used to read and answer such a process's requests for as long as it sent them, keeping
    every answer for it (20 MB for 20,000 STATS): now it stops reading from it while more than the bound
    waits for it there, and goes on once it reads; every answer comes, and other processes are served."""
    monkeypatch.setattr(_owner, "EVENTS_BUFFERED", 256 << 10)
    async with rig(sock) as (pool, reader, raw):
        greedy = await Raw.open(sock)
        greedy.writer.transport.pause_reading()  # type: ignore[attr-defined]
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            greedy.writer.write(b"".join(_wire.encode(_wire.STATS, 1 + i) for i in range(30_000)))
            await asyncio.sleep(0.5)
            assert (await reader.statistics()).clients == 3  # others are served meanwhile
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert grown < 4 << 20, f"{grown >> 10} KiB kept for a process that reads nothing"
        greedy.writer.transport.resume_reading()  # type: ignore[attr-defined]
        answered = 0
        async with asyncio.timeout(WAIT):
            while answered < 30_000:
                message = await greedy._next()
                answered += message.op == _wire.REPLY
        await greedy.close()
        await assert_books(pool, reader, raw, [])
