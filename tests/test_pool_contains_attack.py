"""``AttachedPool.contains`` and ``contains_nowait`` attacked, on the index mirror's path and on the owner's.

They promise to touch nothing (no block marked referenced, none moved in the owner's eviction order) and
to count nothing, on either path; to answer, per key, a state the key had during the call, from one
snapshot (a writer in another process stores and discards generations of keys meanwhile); to take keys as
a list or as one 2-D uint8 array, of any layout, and refuse what is not keys with a TypeError that names
it; to leave nothing behind when cancelled; and, on another thread, to answer or say None while the pool
closes or its owner is killed, never crash or hang. The owner's path is taken by an attached process with
no mirror (``USABLE`` off at attach) or whose every read is spoiled (``RETRIES`` of 0). Every await is
bounded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import mmap
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pytest

from aiokvtier import AttachedPool, Pool, PoolLostError, TierClosedError
from aiokvtier._pool import _client, _mirror, _wire
from aiokvtier._pool._mirror import USABLE
from aiokvtier._pool._wire import as_key
from tests.pool_contains_writer import PER_GENERATION, decoys, gen_keys
from tests.test_pool import WAIT, Child, sock, until
from tests.test_pool_attack_v4 import Raw

__all__ = ["sock"]  # the fixture, used by name

pytestmark = pytest.mark.skipif(not USABLE, reason="the mirror is read only on x86-64")

TINY = {"quota": "2MiB", "max_quota": "2MiB", "slot_size": "64KiB"}
TINY_SLOTS = 32
CONFIG = {"quota": "16MiB", "max_quota": "16MiB", "slot_size": "4KiB"}  # 4,096 slots
Answer = npt.NDArray[np.bool_]
SECONDS = 1.5
"""Seconds the writer process churns while this one asks."""


def read_by(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Make the pools this process attaches from now on answer ``contains`` on ``path``: ``"mirror"``,
    ``"owner"`` (no mirror mapped here) or ``"spoiled"`` (a mirror, whose every read gives up)."""
    if path == "owner":
        monkeypatch.setattr(_client, "USABLE", False)
    elif path == "spoiled":
        monkeypatch.setattr(_mirror, "RETRIES", 0)


def figures(stats: Any) -> dict[str, Any]:
    """A pool's statistics less its tier's (the fill's timings)."""
    out = dataclasses.asdict(stats)
    del out["tier"]
    return out


def truth(stored: set[bytes | int], keys: Sequence[object] | npt.NDArray[np.uint8]) -> Answer:
    if isinstance(keys, np.ndarray):
        listed: list[bytes | int] = [row.tobytes() for row in keys]
    else:
        listed = [as_key(k) for k in keys]
    return np.array([k in stored for k in listed], dtype=np.bool_)


async def agree(pool: AttachedPool, path: str, keys: Any, want: Answer) -> None:
    """``contains`` answers ``want`` (a fresh bool array, one per key); ``contains_nowait`` too, on another
    thread, where the mirror answers, and None where only the owner does."""
    got = await pool.contains(keys)
    assert got.dtype == np.bool_ and got.shape == want.shape, (got.dtype, got.shape)
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:10]
    got[:] = ~got  # the caller's to keep: nothing of the pool's
    elsewhere = await asyncio.to_thread(pool.contains_nowait, keys)
    if path == "mirror":
        assert elsewhere is not None and np.array_equal(elsewhere, want)
    else:
        assert elsewhere is None


# -- touches nothing, counts nothing ---------------------------------------------------------------------


@pytest.mark.parametrize("path", ["mirror", "owner", "spoiled"])
@pytest.mark.parametrize("asked", ["contains", "lookup"])
async def test_contains_touches_and_counts_nothing_on_either_path(
    sock: str, monkeypatch: pytest.MonkeyPatch, path: str, asked: str
) -> None:
    """A full tier of blocks stored one after the other, the oldest asked about: ``contains`` leaves it
    the oldest and unreferenced, so the next store evicts it, and the owner's counts stay as they were.
    ``lookup`` (the control) saves it: a touch or a reference is seen here."""
    read_by(monkeypatch, path)
    keys = [b"block-%02d" % i for i in range(TINY_SLOTS)]
    async with asyncio.timeout(WAIT), Pool(TINY, sock), AttachedPool(sock) as reader:
        for k in keys:  # one call each: the owner's order is the order of the stores
            await reader.store([k], [b"x"])
        before = figures(await reader.statistics())  # counts told before it, if any
        if asked == "lookup":
            assert await reader.lookup(keys[:1]) == 1
        else:
            for query in (keys[:1], keys[:1] * 3, [keys[0], b"absent", keys[0]], keys, [b"absent"]):
                await agree(reader, path, query, truth(set(keys), query))
            rows = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), -1)
            await agree(reader, path, rows, np.ones(len(keys), dtype=np.bool_))
            after = figures(await reader.statistics())
            assert after == before, {k: (before[k], after[k]) for k in before if before[k] != after[k]}
        await reader.store([b"one more"], [b"y"])  # evicts one block: the oldest not looked up
        found = await reader.contains(keys)
        gone = keys[0] if asked == "contains" else keys[1]
        assert found.tolist() == [k != gone for k in keys], [
            k for k, f in zip(keys, found.tolist(), strict=True) if not f
        ]


# -- every form of keys ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["mirror", "owner"])
async def test_contains_answers_what_is_stored_for_every_form_of_keys(
    sock: str, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    read_by(monkeypatch, path)
    shorts = [b"h%015d" % i for i in range(4096)]  # 16 bytes, as block hashes
    longs = [b"P" * 32 + b"%d" % i for i in range(20)]  # past the 32 bytes an entry holds
    digested = [b"Q" * 300 + b"%d" % i for i in range(6)]  # past the 256 bytes hashed word by word
    huge = b"H" * (1 << 20)
    ints = [0, 1, -1, 2**63 - 1, -(2**63), 2**64, -(2**64) - 5, 10**30]
    stored: set[bytes | int] = {*shorts[::3], *longs[::2], *digested[::2], huge, *ints[::2], b""}
    order = sorted(stored, key=repr)
    async with asyncio.timeout(2 * WAIT), Pool(CONFIG, sock), AttachedPool(sock) as reader:
        assert not (await reader.store(order, [b"%d" % i for i in range(len(order))])).skipped
        near = [
            longs[0] + b"\0",
            longs[0][:-1],
            longs[0][:32],
            digested[0][:-1] + b"9",
            digested[0][:256],
            huge[:-1],
            huge + b"H",
            b"\0",
            b"\0" * 8,
            (0).to_bytes(8, "little"),
            b"0",
            b"1",
        ]
        mixed: list[Any] = [
            *ints,
            *(np.int64(i) for i in ints[:5]),
            bytearray(shorts[0]),
            memoryview(shorts[3]),
            np.bytes_(shorts[6]),
            *near,
            *longs,
            *digested,
            huge,
            b"",
        ]
        queries: list[Any] = [
            [],
            (),
            [shorts[0]],
            [shorts[1]],
            [b""],
            shorts,  # 4,096 keys, a third of them stored
            shorts[::-1] + shorts[:5],  # duplicates
            [shorts[0]] * 7 + [shorts[1]] * 3,
            mixed,
            tuple(mixed[::-1]),
            dict.fromkeys(shorts[:9]),
        ]
        for query in queries:
            await agree(reader, path, query, truth(stored, list(query)))
        assert np.array_equal(await reader.contains(k for k in mixed), truth(stored, mixed))  # read once
        # Keys as one 2-D uint8 array, of any layout: rows of a wider buffer, every other row, reversed,
        # Fortran order, broadcast, no rows, rows of no bytes.
        matrix = np.frombuffer(b"".join(shorts), dtype=np.uint8).reshape(len(shorts), 16)
        wide = np.zeros((len(shorts), 21), dtype=np.uint8)
        wide[:, 3:19] = matrix
        arrays = [
            matrix,
            matrix[:1],
            matrix[::2],
            matrix[::-1],
            wide[:, 3:19],
            np.asfortranarray(matrix[:100]),
            np.broadcast_to(matrix[3], (5, 16)),
            matrix[:0],
            np.zeros((0, 0), dtype=np.uint8),
            np.zeros((3, 0), dtype=np.uint8),  # three empty keys
            np.frombuffer(b"".join(longs), dtype=np.uint8).reshape(2, -1)[:, :33],  # the first 33 bytes
            np.frombuffer(huge + huge[:-1] + b"x", dtype=np.uint8).reshape(2, -1),
            np.frombuffer(b"\0" + b"".join(shorts[:64]), dtype=np.uint8)[1:].reshape(64, 16),  # unaligned
        ]
        for array in arrays:
            await agree(reader, path, array, truth(stored, array))
        assert not np.shares_memory(await reader.contains(matrix), matrix)


@pytest.mark.parametrize("path", ["mirror", "owner"])
async def test_contains_refuses_what_is_not_keys_by_name(sock: str, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    read_by(monkeypatch, path)
    refused: list[tuple[Any, str]] = [
        (np.zeros(4, dtype=np.uint8), "2-D uint8 array .*not 1-D uint8"),
        (np.zeros((1, 1, 4), dtype=np.uint8), "not 3-D uint8"),
        (np.zeros((2, 4), dtype=np.int8), "not 2-D int8"),
        (np.zeros((2, 4), dtype=np.uint16), "not 2-D uint16"),
        (np.zeros((2, 4), dtype=np.bool_), "not 2-D bool"),
        (np.array([b"ab", b"cd"]), "not 1-D"),
        (np.array(7, dtype=np.uint8), "not 0-D uint8"),
        (["a", b"b"], "not str"),
        ([True], "not a bool"),
        ([np.True_], "not a bool"),
        ([1.0], "not float"),
        ([None], "not NoneType"),
        ([np.zeros(3, dtype=np.uint8)], "not ndarray"),
        ([[b"a"]], "not list"),
        (b"ab", "not one key"),
        ("ab", "not one key"),
        (bytearray(b"ab"), "not one key"),
        (7, "not one key"),
        (None, "NoneType"),
    ]
    async with asyncio.timeout(WAIT), Pool(CONFIG, sock), AttachedPool(sock) as reader:
        await reader.store([b"ab"], [b"x"])
        before = figures(await reader.statistics())
        for keys, message in refused:
            with pytest.raises(TypeError, match=message):
                await reader.contains(keys)
            with pytest.raises(TypeError, match=message):
                reader.contains_nowait(keys)
        assert figures(await reader.statistics()) == before
        assert (await reader.contains([b"ab"])).tolist() == [True]  # still served


async def test_the_owner_refuses_a_malformed_contains_and_serves_on(sock: str) -> None:
    """The request the owner answers when the mirror cannot: malformed keys are refused with an error, the
    process stays attached, and a well-formed one answers a byte a key."""
    async with asyncio.timeout(WAIT), Pool(CONFIG, sock) as pool, AttachedPool(sock) as writer:
        await writer.store([b"ab", 5], [b"x", b"y"])
        raw = await Raw.open(sock)
        try:
            for fields, parts in [
                ({}, []),
                ({"k": "q"}, [b"", b""]),
                ({"k": "i"}, [b"odd"]),
                ({"k": "f"}, [b"\x02\x00\x00\x00", b"abc"]),
                ({"k": "b"}, [np.array([9], np.uint32).tobytes(), b"ab"]),
            ]:
                assert str(await raw.refused(_wire.CONTAINS, fields, parts))
            kind, parts = _wire.encode_keys([b"ab", 5, b"cd", 5, 2**70])
            reply = await raw.ok(_wire.CONTAINS, {"k": kind}, parts)
            assert np.frombuffer(reply.parts[0], dtype=np.uint8).tolist() == [1, 1, 0, 1, 0]
            assert (await raw.ok(_wire.CONTAINS, {"k": "i"}, [b""])).parts[0] == b""
        finally:
            raw.writer.close()
        await until(lambda: pool.clients == 1, "the raw process's connection closed")
        s = pool.statistics()
        assert (s.queries, s.hits, s.misses, s.owner_lookups) == (0, 0, 0, 0)


# -- under a writer in another process -------------------------------------------------------------------


class Counter:
    """The writer's published counter: 8 bytes of a file both processes map."""

    def __init__(self, path: str) -> None:
        with open(path, "w+b") as f:
            f.write(bytes(8))
            f.flush()
            self._map = mmap.mmap(f.fileno(), 8)
        self._word: npt.NDArray[np.uint64] | None = np.frombuffer(self._map, dtype=np.uint64, count=1)

    def read(self) -> int:
        assert self._word is not None
        return int(self._word[0])

    def close(self) -> None:
        self._word = None  # the view first: the map closes only with none left
        self._map.close()


@asynccontextmanager
async def child(script: str, *args: str, ready: str) -> AsyncIterator[Child]:
    process = await Child.start(script, *args)
    try:
        await process.event(ready)
        yield process
    finally:
        await process.close()


class Checked:
    """Each answer held against the writer's schedule (``tests/pool_contains_writer.py``): a key of
    generation g visible only while the counter read 2g to 2g + 5, and (``roomy``: nothing evicted) for
    sure while it read 2g + 1 to 2g + 4; a generation whole or absent in one answer (``roomy``); the
    generations seen together no further apart than one instant allows; a key twice read alike; a
    decoy never present."""

    def __init__(self, roomy: bool) -> None:
        self.roomy = roomy
        self.calls = 0
        self.unanswered = 0
        self.seen_present = 0
        self.seen_absent = 0
        self.failures: list[str] = []

    def check(self, c0: int, c1: int, gens: list[int], got: Answer, keyset: list[bytes | int]) -> None:
        self.calls += 1
        g = np.array(gens)
        decoy = g < 0
        if got[decoy].any():
            self.failures.append(f"a decoy present: {[keyset[i] for i in np.flatnonzero(decoy & got)][:3]}")
        real = ~decoy
        may_be_there = (c0 <= 2 * g + 5) & (c1 >= 2 * g)
        bad = real & got & ~may_be_there
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            self.failures.append(f"{keyset[i]!r} of generation {gens[i]} present while the counter read {c0}..{c1}")
        if self.roomy:
            may_be_gone = (c0 <= 2 * g) | (c1 >= 2 * g + 5)
            bad = real & ~got & ~may_be_gone
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                self.failures.append(f"{keyset[i]!r} of generation {gens[i]} absent while the counter read {c0}..{c1}")
            for gen in np.unique(g[real]).tolist():
                answers = got[g == gen]
                if answers.any() and not answers.all():
                    self.failures.append(f"generation {gen} torn in one answer (counter {c0}..{c1})")
        present = np.unique(g[real & got])
        if present.size and int(present[-1]) - int(present[0]) > 2:
            self.failures.append(f"generations {present.tolist()} present in one answer")
        same: dict[bytes | int, bool] = {}
        for k, there in zip(keyset, got.tolist(), strict=True):
            if same.setdefault(k, there) != there:
                self.failures.append(f"{k!r} twice in one answer, read two ways")
        self.seen_present += int(np.count_nonzero(real & got))
        self.seen_absent += int(np.count_nonzero(real & ~got))


def query_around(counter: int, turn: int) -> tuple[list[bytes | int], list[int]]:
    """The keys of the generations about the counter's, their neighbours' decoys, some keys twice; and
    each key's generation (-1: a decoy)."""
    now = counter // 2
    keys: list[bytes | int] = []
    gens: list[int] = []
    for g in range(max(0, now - 3), now + 2):
        keys += gen_keys(g)
        gens += [g] * PER_GENERATION
    for g in (now, now + 1):
        more = decoys(g)
        keys += more
        gens += [-1] * len(more)
    twice = list(range(turn % 7, len(keys), 5))
    keys += [keys[i] for i in twice]
    gens += [gens[i] for i in twice]
    # Shuffled by arithmetic: numpy's generators take a lock, which a loop thread must not wait on.
    order = np.argsort((np.arange(len(keys)) * 2654435761 + turn * 40503) % 1000003).tolist()
    return [keys[i] for i in order], [gens[i] for i in order]


def short_rows(keys: list[bytes | int], gens: list[int]) -> tuple[npt.NDArray[np.uint8], list[bytes | int], list[int]]:
    """The keys of the short form (12 bytes) among ``keys``, as one 2-D uint8 array; they and their
    generations."""
    pick = [i for i, k in enumerate(keys) if isinstance(k, bytes) and k[:2] == b"s-" and len(k) == 12]
    rows = np.frombuffer(b"".join(cast("bytes", keys[i]) for i in pick), dtype=np.uint8).reshape(len(pick), 12)
    return rows, [keys[i] for i in pick], [gens[i] for i in pick]


@pytest.mark.parametrize(("path", "room"), [("mirror", "roomy"), ("mirror", "tight"), ("owner", "roomy")])
async def test_contains_answers_a_state_each_key_had_under_a_writer(
    sock: str, monkeypatch: pytest.MonkeyPatch, path: str, room: str
) -> None:
    """An owner process, a writer process storing a generation of keys and discarding the one two before
    it as fast as it can (``tight``: a tier of 24 slots, so stores evict blocks of live generations too),
    and this process asking ``contains`` (and, with a mirror, ``contains_nowait`` on a thread) all the
    while. Each answer is held against the counter the writer publishes, read before and after it."""
    read_by(monkeypatch, path)
    quota = "16MiB" if room == "roomy" else "1536KiB"
    counter_path = sock + ".counter"
    counter = await asyncio.to_thread(Counter, counter_path)
    checked = Checked(roomy=room == "roomy")
    threaded = Checked(roomy=room == "roomy")
    done = threading.Event()

    def on_a_thread(reader: AttachedPool) -> None:
        turn = 0
        while not done.is_set():
            c0 = counter.read()
            keys, gens = query_around(c0, turn)
            got = reader.contains_nowait(keys)
            c1 = counter.read()
            if got is None:
                # The documented way out: no consistent read within the mirror's retries (the writer
                # rewrote the table under each of them); the caller then asks the owner.
                threaded.unanswered += 1
                continue
            threaded.check(c0, c1, gens, got, keys)
            turn += 1

    try:
        async with (
            asyncio.timeout(3 * WAIT),
            child("pool_owner.py", sock, quota, ready="serving"),
            AttachedPool(sock) as reader,
            child("pool_contains_writer.py", sock, counter_path, str(SECONDS), ready="attached") as writer,
        ):
            thread = threading.Thread(target=on_a_thread, args=(reader,)) if path == "mirror" else None
            if thread is not None:
                thread.start()
            try:
                turn = 0
                end = time.monotonic() + SECONDS
                while time.monotonic() < end:
                    c0 = counter.read()
                    keys, gens = query_around(c0, turn)
                    query: Any = keys
                    if turn % 3 == 2:
                        query, keys, gens = short_rows(keys, gens)
                    got = await reader.contains(query)
                    c1 = counter.read()
                    checked.check(c0, c1, gens, got, keys)
                    turn += 1
                    await asyncio.sleep(0)  # the thread's turn (the mirror's reads hold the GIL)
                await writer.event("done")
            finally:
                done.set()
                if thread is not None:
                    await asyncio.to_thread(thread.join, WAIT)
                    assert not thread.is_alive()
        generations = counter.read() // 2
    finally:
        counter.close()
    assert not checked.failures, checked.failures[:5]
    assert not threaded.failures, threaded.failures[:5]
    assert generations >= 6, f"the writer stored {generations} generations only"
    assert checked.calls >= 10 and checked.seen_present and checked.seen_absent, vars(checked)
    if path == "mirror":
        # Most reads find the table still: a mirror that mostly sends its callers to the owner is broken.
        assert threaded.calls >= 10 and threaded.unanswered <= threaded.calls, vars(threaded)


# -- cancellation on the owner's path --------------------------------------------------------------------


async def settled_books(
    pool: Pool, reader: AttachedPool, keys: list[bytes], want: Answer, before: dict[str, Any]
) -> None:
    """After a cancelled call: the pool answers the next one right, nothing is claimed or pinned, and the
    owner counted nothing."""
    assert np.array_equal(await reader.contains(keys), want)
    s = figures(await reader.statistics())
    assert s == before, {k: (before[k], s[k]) for k in before if before[k] != s[k]}
    pool.check_invariants()


def calls_left() -> list[asyncio.Task[Any]]:
    """Tasks of this test's calls still pending."""
    names = ("AttachedPool.contains", "ask", "fail_after", "group")
    return [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.endswith(names)]  # type: ignore[union-attr]


@pytest.mark.parametrize("path", ["owner", "spoiled"])
async def test_contains_cancelled_at_every_turn_leaves_nothing(
    sock: str, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """``contains`` on the owner's path cancelled after each number of the loop's turns (``task.cancel()``),
    by ``asyncio.wait_for`` at swept delays, and by a failing sibling in a ``TaskGroup``: the call raises
    ``CancelledError`` (or answered in time, right), and the pool is as it was."""
    read_by(monkeypatch, path)
    keys = [b"c-%04d" % i for i in range(600)]
    stored = set(keys[::2])
    want = truth(stored, keys)  # type: ignore[arg-type]
    async with asyncio.timeout(2 * WAIT), Pool(CONFIG, sock) as pool, AttachedPool(sock) as reader:
        await reader.store(sorted(stored), [b"x"] * len(stored))
        before = figures(await reader.statistics())
        outcomes = {"cancelled": 0, "answered": 0}
        turns = 0
        while outcomes["answered"] < 3:  # until the call answers before its cancel, three times over
            task = asyncio.ensure_future(reader.contains(keys))
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            try:
                got = await task
            except asyncio.CancelledError:
                outcomes["cancelled"] += 1
            else:
                assert np.array_equal(got, want)
                outcomes["answered"] += 1
            await settled_books(pool, reader, keys, want, before)
            turns += 1
            assert turns < 200, "the call never answered"
        assert outcomes["cancelled"] >= 2, outcomes
        for delay in (0, 1e-6, 1e-5, 5e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2):
            try:
                got = await asyncio.wait_for(reader.contains(keys), delay)
            except TimeoutError:
                pass
            else:
                assert np.array_equal(got, want)
            await settled_books(pool, reader, keys, want, before)
        for turns in range(0, 8):

            async def fail_after(n: int) -> None:
                for _ in range(n):
                    await asyncio.sleep(0)
                raise LookupError("a sibling failed")

            async def ask() -> None:
                assert np.array_equal(await reader.contains(keys), want)

            async def group(n: int) -> None:
                async with asyncio.TaskGroup() as group:
                    group.create_task(ask())
                    group.create_task(fail_after(n))

            with pytest.raises(ExceptionGroup) as raised:
                # In a task of its own: Python 3.11's TaskGroup leaves its parent a cancel request when a
                # child fails while the parent waits at the group's end.
                await asyncio.ensure_future(group(turns))
            assert raised.group_contains(LookupError)
            await settled_books(pool, reader, keys, want, before)
        await until(lambda: not calls_left(), "no task of a cancelled call left")


# -- lifecycle races -------------------------------------------------------------------------------------


class Hammer:
    """A thread asking ``contains_nowait`` over and over: each answer must be ``want`` or None, and no call
    begun after ``closed()`` may answer."""

    def __init__(self, pool: AttachedPool, keys: list[bytes], want: Answer) -> None:
        self.pool, self.keys, self.want = pool, keys, want
        self.answers = 0
        self.nones = 0
        self.last_answered = 0.0
        """When the last call that answered (not None) began."""
        self.errors: list[BaseException] = []
        self.wrong = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self.stop.is_set():
            began = time.monotonic()
            try:
                got = self.pool.contains_nowait(self.keys)
            except BaseException as exc:
                self.errors.append(exc)
                return
            if got is None:
                self.nones += 1
            else:
                self.last_answered = began
                self.answers += 1
                self.wrong += not np.array_equal(got, self.want)

    async def closed(self) -> None:
        """The pool is closed or lost for this process now: later calls answer None (a few are made)."""
        at, nones = time.monotonic(), self.nones
        await until(lambda: self.nones > nones + 3, "the thread answered None")
        assert self.last_answered < at, "a call begun after the close answered"

    async def __aenter__(self) -> Hammer:
        self.thread.start()
        await until(lambda: self.answers > 3, "the thread answered from the mirror")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        await asyncio.to_thread(self.thread.join, WAIT)
        assert not self.thread.is_alive(), "contains_nowait hung"


@pytest.mark.parametrize("closer", ["attached", "owner"])
async def test_contains_nowait_on_a_thread_while_the_pool_closes(sock: str, closer: str) -> None:
    """A thread asking all the while ``aclose()`` runs (this process's, or the owner's): right answers,
    then None for good; never an error. ``contains`` after it raises the closed error, or PoolLostError."""
    keys = [b"n-%04d" % i for i in range(2000)]
    want = truth(set(keys[::3]), keys)  # type: ignore[arg-type]
    async with asyncio.timeout(2 * WAIT):
        pool = await Pool.open(CONFIG, sock)
        try:
            reader = await AttachedPool.attach(sock)
            try:
                await reader.store(keys[::3], [b"x"] * len(keys[::3]))
                async with Hammer(reader, keys, want) as hammer:
                    if closer == "attached":
                        await reader.aclose()
                    else:
                        await pool.aclose()
                        await until(lambda: reader.lost is not None, "the attached process saw the close")
                    await hammer.closed()
                assert not hammer.errors and not hammer.wrong, (hammer.errors, hammer.wrong)
                assert reader.contains_nowait(keys) is None
                error = TierClosedError if closer == "attached" else PoolLostError
                with pytest.raises(error):
                    await reader.contains(keys)
            finally:
                await reader.aclose()
        finally:
            await pool.aclose()


async def test_contains_when_the_owner_is_killed(sock: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner process SIGKILLed while a thread asks ``contains_nowait`` of one attached process and
    calls on the owner's path are in flight in another: the calls in flight answer or raise PoolLostError,
    the thread answers until the loss is seen and None after, never an error; ``contains`` then raises
    PoolLostError on both paths, and both detach."""
    keys = [b"k-%04d" % i for i in range(3000)]
    want = truth(set(keys[::2]), keys)  # type: ignore[arg-type]
    async with asyncio.timeout(2 * WAIT), child("pool_owner.py", sock, "16MiB", "4KiB", ready="serving") as owner:
        mirrored = await AttachedPool.attach(sock)
        monkeypatch.setattr(_client, "USABLE", False)
        asking = await AttachedPool.attach(sock)
        try:
            await mirrored.store(keys[::2], [b"x"] * len(keys[::2]))
            assert np.array_equal(await asking.contains(keys), want)
            async with Hammer(mirrored, keys, want) as hammer:
                flying = [asyncio.ensure_future(asking.contains(keys)) for _ in range(8)]
                await asyncio.sleep(0)
                await owner.kill()
                for outcome in await asyncio.gather(*flying, return_exceptions=True):
                    assert isinstance(outcome, PoolLostError) or np.array_equal(outcome, want), outcome
                await until(lambda: mirrored.lost is not None and asking.lost is not None, "both saw the loss")
                await hammer.closed()
            assert not hammer.errors and not hammer.wrong, (hammer.errors, hammer.wrong)
            for pool in (mirrored, asking):
                assert pool.contains_nowait(keys) is None
                with pytest.raises(PoolLostError):
                    await pool.contains(keys)
                with pytest.raises(PoolLostError):
                    await pool.contains([])
        finally:
            await mirrored.aclose()
            await asking.aclose()
