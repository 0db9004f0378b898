"""Attacks on the pool's long keys (those past ``LONG_BYTES``, hashed in the index mirror by a digest):
keys at the boundary and around it, keys alike in their first bytes or in their digest form, the largest
key a frame holds and one past it, two processes storing one long key, discards and evictions under
loads, and cancellation at every step of a store, a load and a lookup. After each, a lookup finds only
the keys stored (a false hit would load another key's block), and the owner's statistics, its index and
its mirror agree, with nothing claimed, pinned or leaked.
"""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest

from aiokvtier import AttachedPool, BlockNotFound, Pool, PoolStatistics
from aiokvtier._pool import _wire
from aiokvtier._pool._mirror import DIGEST_BYTES, KEY_BYTES, LONG_BYTES, USABLE, IndexMirror, key_rows
from tests.test_pool import Child, attached, until
from tests.test_pool_attack_v4 import assert_books, rig
from tests.test_pool_long_keys import sock

__all__ = ["sock"]  # the fixture, used by name

pytestmark = [
    pytest.mark.skipif(not USABLE, reason="the mirror is read only on x86-64"),
    pytest.mark.timeout(180),
]

SLOT = 4096
CONFIG = {"quota": "1MiB", "max_quota": "1MiB", "slot_size": "4KiB"}  # 256 slots: evictions come soon


BODY = np.random.default_rng(17).integers(1, 256, (1 << 20) + 2, dtype=np.uint8).tobytes()
"""Random bytes with no zero byte: every key below is a cut or a change of it, so that all share their
first bytes."""


def cut(n: int) -> bytes:
    return BODY[:n]


def changed(key: bytes, at: int) -> bytes:
    """``key`` with its byte at ``at`` different."""
    return key[:at] + bytes([key[at] ^ 0x5A]) + key[at + 1 :]


def pages_for(keys: list[bytes | int], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (len(keys), SLOT), dtype=np.uint8)


def agree(pool: Pool, stats: PoolStatistics) -> None:
    """Nothing stays claimed or pinned; the index, its mirror, the processes and the tier agree."""
    pool.check_invariants(sole_user=True)
    assert stats.claims == 0 and stats.blocks_pinned == 0, stats
    assert stats.tier.slots_allocated == stats.blocks, stats


STORED = [255, 256, 257, LONG_BYTES + 8, 1 << 16, 1 << 20]
"""Key lengths at and around the boundary, and far past it (the keys are prefixes of one another)."""
NEAR = [1, KEY_BYTES, KEY_BYTES + 1, 254, 258, 263, 265, (1 << 16) - 1, (1 << 16) + 1, (1 << 20) - 1, (1 << 20) + 1]
"""Lengths never stored: each a prefix or an extension of a stored key."""


def alike() -> list[bytes]:
    """Keys of a stored key's length that differ from it in one byte only: past its first 256 bytes, in
    its last byte, in its first 32 bytes (the entry's), and in byte 32 (the first the entry leaves out)."""
    out = []
    for n in STORED:
        key = cut(n)
        for at in {n - 1, KEY_BYTES, 0, min(LONG_BYTES + 3, n - 1)}:
            out.append(changed(key, at))
    return out


async def test_keys_at_the_boundary_are_found_as_themselves_and_their_neighbours_never(sock: str) -> None:
    stored: list[bytes | int] = [cut(n) for n in STORED]
    never: list[bytes] = [cut(n) for n in NEAR] + alike()
    never += [cut(n) + b"\x00" for n in STORED]  # the same and a zero byte more
    assert not set(never) & set(stored)
    rows = key_rows([*stored, *never])
    assert len({tuple(r[:7].tolist()) for r in rows}) == len(stored) + len(never)  # every key its own entry
    pages = pages_for(stored, 1)
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as a, AttachedPool(sock) as b:
        result = await a.store(stored, pages)
        assert result.stored == tuple(stored)
        for key in stored:
            assert b.lookup_nowait([key]) == 1
        for key in never:
            assert b.lookup_nowait([key]) == 0, len(key)  # the mirror
            assert await b.lookup([key]) == 0
            assert await b.discard([key]) == 0  # the owner
            with pytest.raises(BlockNotFound) as missing:
                await b.load([key], np.zeros((1, SLOT), dtype=np.uint8))
            assert missing.value.key == key
        assert b.lookup_nowait([*stored, never[0]]) == len(stored)
        back = np.zeros_like(pages)
        assert await b.load(stored, back) == [SLOT] * len(stored)
        assert (back == pages).all()
        lookups = len(stored) + 2 * len(never) + 1
        stats = await b.statistics()  # the lookups' counts travel with this request
        assert stats.queries == lookups and stats.hits == 2 * len(stored)
        assert stats.misses == 2 * len(never) + 1
        assert stats.blocks == len(stored) and stats.discards == 0
        agree(pool, stats)


def digest_form(key: bytes) -> bytes:
    """What a long key is hashed as in the mirror: its first bytes and a digest of it."""
    return key[:KEY_BYTES] + hashlib.blake2b(key, digest_size=DIGEST_BYTES).digest()


async def test_a_short_key_equal_to_a_long_keys_digest_form_is_another_key(sock: str) -> None:
    """The two hash alike (a long key's hashes are its digest form's); their entries differ by length."""
    long = [cut(LONG_BYTES + 1), cut(5000), cut(1 << 20)]
    forms: list[bytes | int] = [digest_form(k) for k in long]
    assert (key_rows(long)[:, :2] == key_rows(forms)[:, :2]).all()  # the same probe chain
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as a, AttachedPool(sock) as b:
        await a.store(list(long), pages_for(list(long), 2))
        for form in forms:
            assert b.lookup_nowait([form]) == 0
        form_pages = pages_for(forms, 3)
        assert (await b.store(forms, form_pages)).stored == tuple(forms)
        assert b.lookup_nowait(list(long)) == 3 and b.lookup_nowait(forms) == 3
        back = np.zeros_like(form_pages)
        await a.load(forms, back)
        assert (back == form_pages).all()
        assert await a.discard(list(long)) == 3
        assert b.lookup_nowait(forms) == 3 and b.lookup_nowait([long[0]]) == 0
        agree(pool, await a.statistics())


async def test_a_long_byte_key_and_an_int_of_the_same_digits_are_two_keys(sock: str) -> None:
    big = 10**300  # carried as its decimal text, 301 bytes: past LONG_BYTES
    text = b"%d" % big
    keys: list[bytes | int] = [big, text, -big, b"-" + text]
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as a, AttachedPool(sock) as b:
        await a.store([big], pages_for([big], 4))
        assert b.lookup_nowait([text]) == 0 and await b.lookup([text]) == 0
        assert b.lookup_nowait([big]) == 1 and b.lookup_nowait([-big]) == 0
        pages = pages_for(keys, 5)
        result = await b.store(keys, pages)
        assert result.present == (big,) and result.stored == tuple(keys[1:])
        back = np.zeros_like(pages)
        await a.load(keys[1:], back[1:])
        assert (back[1:] == pages[1:]).all()
        agree(pool, await a.statistics())


async def test_a_str_key_is_refused_everywhere_and_bytes_like_long_keys_are_their_bytes(sock: str) -> None:
    key = cut(3000)
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as a:
        page = np.ones((1, SLOT), dtype=np.uint8)
        for call in (
            lambda: a.store([key.decode("latin-1")], page),
            lambda: a.load([key.decode("latin-1")], page),
            lambda: a.discard([key.decode("latin-1")]),
            lambda: a.lookup([key.decode("latin-1")]),
        ):
            with pytest.raises(TypeError, match="not str"):
                await call()
        with pytest.raises(TypeError, match="not str"):
            a.lookup_nowait([key.decode("latin-1")])
        stats = await a.statistics()
        assert stats.queries == stats.stores == stats.discards == stats.loads == 0 and stats.blocks == 0
        assert (await a.store([bytearray(key)], page)).stored == (key,)
        assert a.lookup_nowait([memoryview(key)]) == 1 and a.lookup_nowait([key]) == 1
        assert await a.discard([memoryview(key)]) == 1
        agree(pool, await a.statistics())


# -- the largest key a frame holds ---------------------------------------------------------------------


def longest(op: int, fields: dict[str, object], before: list[bytes], after: list[bytes]) -> int:
    """The longest key a request of one key (its parts ``before``, the key, ``after``) holds in a frame."""
    empty = len(_wire.encode(op, 1, fields, [*before, b"", *after])) - _wire.LENGTH.size
    n = _wire.MAX_FRAME - empty
    return n - (len(str(n)) - 1)  # the key's length is written in the fields, in place of "0"


def test_a_request_frame_is_refused_one_byte_past_the_largest_the_owner_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner drops a process whose frame is past ``MAX_FRAME``: the client refuses to build one."""
    for limit in (1 << 14, 1 << 20):
        monkeypatch.setattr(_wire, "MAX_FRAME", limit)
        n = longest(_wire.DISCARD, {"k": "f"}, [b"1234"], [])
        frame = _wire.encode(_wire.DISCARD, 1, {"k": "f"}, [b"1234", cut(n)], request=True)
        assert len(frame) == _wire.LENGTH.size + limit
        with pytest.raises(ValueError, match=f"does not fit the pool protocol's frames of at most {limit} bytes"):
            _wire.encode(_wire.DISCARD, 1, {"k": "f"}, [b"1234", cut(n + 1)], request=True)
        assert _wire.encode(_wire.DISCARD, 1, {"k": "f"}, [b"1234", cut(n + 1)])  # a reply is not limited


async def test_a_key_past_the_largest_frame_is_refused_and_the_pool_stays_attached(sock: str) -> None:
    """A discard (or a load, a store) of a key of 1 GiB: the frame was sent, the owner dropped the process
    for breaking the protocol, and every call of the process failed after (``PoolLostError``)."""
    key = bytes(_wire.MAX_FRAME + 1)
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as a:
        a.lookup_nowait([cut(300)])  # a count to tell with the next request: kept when that one is refused
        with pytest.raises(ValueError, match="split the call, or shorten the keys"):
            await a.discard([key])
        with pytest.raises(ValueError, match="split the call, or shorten the keys"):
            await a.load([key], np.zeros((1, SLOT), dtype=np.uint8))
        with pytest.raises(ValueError, match="split the call, or shorten the keys"):
            await a.store([key], np.zeros((1, SLOT), dtype=np.uint8))
        del key
        assert a.lost is None
        page = pages_for([b"k"], 6)
        assert (await a.store([cut(300)], page)).stored == (cut(300),)
        stats = await a.statistics()
        assert stats.queries == 1 and stats.misses == 1 and stats.stores == 1 and stats.discards == 0
        agree(pool, stats)


async def test_the_largest_key_a_frame_holds_is_stored_and_found(sock: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same at a smaller frame limit (both ends read it), end to end, at the boundary."""
    monkeypatch.setattr(_wire, "MAX_FRAME", 3 * SLOT + 200)
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as a, AttachedPool(sock) as b:
        largest = cut(longest(_wire.BEGIN, {"k": "f", "wait": True}, [b"1234"], [b"12345678"]))
        assert len(largest) > 3 * SLOT
        b.lookup_nowait([largest])  # counts to tell with b's next request, which they would make too large
        page = pages_for([largest], 7)
        assert (await a.store([largest], page)).stored == (largest,)
        assert b.lookup_nowait([largest]) == 1 and await b.lookup([largest[:-1]]) == 0
        back = np.zeros_like(page)
        await b.load([largest], back)
        assert (back == page).all()
        with pytest.raises(ValueError, match="does not fit"):
            await a.store([cut(len(largest) + 1)], page)
        assert a.lost is None and b.lost is None
        assert await b.discard([largest]) == 1
        stats = await a.statistics()
        assert stats.queries == 3 and stats.hits == 1 and stats.misses == 2  # b's counts all told
        agree(pool, stats)


# -- several processes at once ---------------------------------------------------------------------------


def family(n: int, length: int = 3000) -> list[bytes | int]:
    """``n`` long keys of one length that differ in one byte past their first ``LONG_BYTES``."""
    base = cut(length)
    return [changed(base, LONG_BYTES + 1 + i) for i in range(n)]


async def test_one_long_key_stored_by_two_processes_at_once_is_stored_once_and_whole(sock: str) -> None:
    keys = [*family(24), cut(1 << 20), cut(LONG_BYTES + 1)]
    mine, theirs = pages_for(keys, 8), pages_for(keys, 9)
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as a, AttachedPool(sock) as b:
        for _ in range(4):
            ra, rb = await asyncio.gather(a.store(keys, mine), b.store(keys[::-1], np.ascontiguousarray(theirs[::-1])))
            assert not ra.skipped and not rb.skipped
            assert set(ra.stored).isdisjoint(rb.stored)
            assert set(ra.stored) | set(rb.stored) == set(keys)  # each stored once, by one of them
            assert set(ra.present) == set(keys) - set(ra.stored)
            back = np.zeros_like(mine)
            await a.load(keys, back)
            for i, key in enumerate(keys):
                assert (back[i] == (mine[i] if key in ra.stored else theirs[i])).all()
            assert b.lookup_nowait(keys) == len(keys)
            assert await b.discard(keys) == len(keys)
            assert a.lookup_nowait(keys) == 0
        stats = await a.statistics()
        assert stats.stores == 4 * len(keys) and stats.present == 4 * len(keys) and stats.skipped == 0
        assert stats.discards == 4 * len(keys) and stats.blocks == 0
        agree(pool, stats)


async def test_long_keys_discarded_and_evicted_under_loads_never_load_another_keys_bytes(sock: str) -> None:
    """Loads of long keys alike in all but one byte, while another process discards them and a third
    fills the pool (evictions): each load copies its own keys' bytes or names a missing key."""
    keys = family(64)
    pages = pages_for(keys, 10)
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as a, AttachedPool(sock) as b:
        async with AttachedPool(sock) as c:
            loaded = missing = 0
            for round_ in range(12):
                await a.store(keys, pages)
                back = np.zeros_like(pages)

                async def load(back: np.ndarray = back) -> bool:
                    try:
                        await b.load(keys, back)
                    except BlockNotFound as exc:
                        assert exc.key in keys
                        return False
                    return True

                got, _, _ = await asyncio.gather(
                    load(),
                    a.discard(keys[round_ % 3 :: 3]),
                    c.store(family(60, 4000 + round_), pages_for(keys[:60], round_)),  # full from the 4th round
                )
                if got:
                    assert (back == pages).all()
                    loaded += 1
                else:
                    missing += 1
                hits = b.lookup_nowait(keys)
                assert hits is not None and 0 <= hits <= len(keys)
                if hits:
                    part = np.zeros((hits, SLOT), dtype=np.uint8)
                    try:
                        await b.load(keys[:hits], part)
                    except BlockNotFound:
                        pass  # evicted since the lookup
                    else:
                        assert (part == pages[:hits]).all()
            assert loaded + missing == 12
        stats = await a.statistics()
        assert stats.evictions > 0
        agree(pool, stats)


# -- cancellation at every step ---------------------------------------------------------------------------


async def settled(pool: Pool, a: AttachedPool) -> PoolStatistics:
    """The owner's books once the aborts and unpins of cancelled calls (sent without a reply) reached it."""
    async with asyncio.timeout(30):
        while True:
            stats = await a.statistics()
            if stats.claims == 0 and stats.blocks_pinned == 0:
                agree(pool, stats)
                return stats
            await asyncio.sleep(0.001)


async def cancelled_at_each_step(call: object, most: int = 400) -> int:
    """Run ``call()`` again and again, cancelled after 0, 1, 2... passes of the loop, until it ends first;
    how many times it was cancelled."""
    assert callable(call)
    for steps in range(most):
        task = asyncio.ensure_future(call())
        for _ in range(steps):
            await asyncio.sleep(0)
        if task.done():
            await task
            return steps
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await call.after()  # type: ignore[attr-defined]
    raise AssertionError(f"still not done after {most} passes of the loop")


async def test_store_load_and_lookup_of_long_keys_cancelled_at_every_await_leave_nothing_behind(sock: str) -> None:
    keys = [*family(8), cut(1 << 20), cut(LONG_BYTES + 1)]
    mine, theirs = pages_for(keys, 11), pages_for(keys, 12)
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as a, AttachedPool(sock) as b:

        async def whole() -> None:
            """Every key visible holds one store's page, whole; then the keys are dropped for the next try."""
            stats = await settled(pool, b)
            hits = b.lookup_nowait(keys)
            assert hits is not None
            present = [k for k in keys if b.lookup_nowait([k]) == 1]
            if present:
                at = [keys.index(k) for k in present]
                back = np.zeros((len(present), SLOT), dtype=np.uint8)
                await b.load(present, back)
                for row, i in zip(back, at, strict=True):
                    assert (row == mine[i]).all() or (row == theirs[i]).all()
            await b.discard(keys)
            assert stats.blocks == len(present)

        async def store() -> None:
            await a.store(keys, mine)

        store.after = whole  # type: ignore[attr-defined]
        assert await cancelled_at_each_step(store) > 0

        async def store_beside_another() -> None:
            """Cancelled while another process stores the same keys: that one waits for the claim, then
            stores or finds each key."""
            other = asyncio.ensure_future(b.store(keys, theirs))
            try:
                await a.store(keys, mine)
            finally:
                result = await asyncio.shield(other)
                assert not result.skipped and len(result.stored) + len(result.present) == len(keys)

        store_beside_another.after = whole  # type: ignore[attr-defined]
        assert await cancelled_at_each_step(store_beside_another) > 0

        await a.store(keys, mine)

        async def load() -> None:
            back = np.zeros_like(mine)
            await a.load(keys, back)
            assert (back == mine).all()

        async def still_there() -> None:
            stats = await settled(pool, b)
            assert stats.blocks == len(keys) and b.lookup_nowait(keys) == len(keys)

        load.after = still_there  # type: ignore[attr-defined]
        assert await cancelled_at_each_step(load) > 0

        async def lookup() -> None:
            assert await a.lookup(keys) == len(keys)

        lookup.after = still_there  # type: ignore[attr-defined]
        await cancelled_at_each_step(lookup)

        for delay in [i * 0.0002 for i in range(16)]:  # timeouts swept from 0 to 3 ms
            for call, after in ((load, still_there), (lookup, still_there)):
                try:
                    await asyncio.wait_for(call(), delay)
                except TimeoutError:
                    pass
                await after()
            await b.discard(keys)
            try:
                await asyncio.wait_for(store(), delay)
            except TimeoutError:
                pass
            await whole()
            await a.store(keys, mine)
        stats = await settled(pool, a)
        assert stats.blocks == len(keys)


def test_a_missing_long_keys_error_frame_carries_the_key_once() -> None:
    """The owner sent a missing key's error with its message, ``repr(key)`` in JSON: four to eight times
    the key (a key of 64 MiB: a frame of 300 MiB, built in 1.9 s on the owner's loop). The client makes
    the message from the key, which the frame carries as a part."""
    key = cut(1 << 20)
    fields, parts = _wire.error_to(BlockNotFound(key))
    frame = _wire.encode(_wire.ERROR, 1, fields, parts)
    assert len(frame) < len(key) + 1024
    error = _wire.error_from(_wire.decode(frame[_wire.LENGTH.size :]))
    assert isinstance(error, BlockNotFound) and error.key == key and repr(key) in str(error)


# -- long keys in every form a frame may carry them -------------------------------------------------------


async def test_long_keys_in_every_wire_form_hostile_ones_included_are_the_owners_keys_in_the_mirror(sock: str) -> None:
    """Rows of 600 bytes zero-padded with zero bytes inside, a row as wide as its frame, 64 keys of
    several lengths cut out as records, fixed-length long keys ending in zero bytes, ints of 301 digits
    beside bytes: whatever the owner makes of them (it hashes them from the frame's matrix), the mirror
    answers those same keys, and no key alike but in its length or a byte."""
    async with rig(sock) as (pool, reader, raw):
        rows = [cut(300), cut(150) + bytes(10) + cut(200), bytes(20) + cut(290), changed(cut(599), 400), cut(600)]
        wide = np.zeros((len(rows), 600), dtype=np.uint8)
        for i, row in enumerate(rows):
            wide[i, : len(row)] = np.frombuffer(row, dtype=np.uint8)
        lengths = np.full(len(rows), 10, np.uint64).tobytes()
        answer = await raw.ok(_wire.BEGIN, {"k": "p"}, [_wire.LENGTH.pack(600), wide.tobytes(), lengths])
        await raw.ok(_wire.COMMIT, {"claim": answer.fields["claim"]})
        decoded = [row.rstrip(b"\x00") for row in rows]  # the "p" form's keys end at their last non-zero byte
        records = [cut(LONG_BYTES - 8 + i % 17) + bytes([1 + i]) for i in range(64)]  # lengths 16 apart
        kind, parts = _wire.encode_keys(records)
        assert kind == "b" and _wire.decode_key_matrix(kind, parts)[1] is not None  # cut out as records
        assert await raw.store(records)
        fixed = [cut(400)[:-3] + b"\x00\x00\x00", changed(cut(400), 399)[:-1] + b"\x00", b"\x00" * 400]
        answer = await raw.ok(
            _wire.BEGIN, {"k": "f"}, [_wire.LENGTH.pack(400), b"".join(fixed), np.full(3, 9, np.uint64).tobytes()]
        )
        await raw.ok(_wire.COMMIT, {"claim": answer.fields["claim"]})
        mixed: list[bytes | int] = [10**300, -(10**300), b"%d" % (10**300 + 1), cut(5000)]
        assert await raw.store(mixed)
        near: list[bytes | int] = [
            *(k + b"\x00" for k in decoded),
            *(k[:-1] for k in records),
            *(k[:-1] for k in fixed),
            b"%d" % 10**300,
            10**300 + 1,
            changed(cut(5000), 4000),
        ]
        assert await reader.lookup(decoded) == len(decoded) and await reader.lookup(records) == len(records)
        assert await reader.lookup(fixed) == 3 and await reader.lookup(mixed) == len(mixed)
        await assert_books(pool, reader, raw, [*decoded, *records, *fixed, *mixed, *near])


async def test_long_keys_stored_by_real_processes_at_once_and_one_killed_mid_copy(sock: str) -> None:
    """Two processes store the same long keys at once; a third, stopped in its copy of others and killed,
    leaves them to the one waiting for them: each key stored once, whole, nothing claimed after."""
    # Keys of up to 5,000 bytes: their hex and their answers' fit a line of the test's pipe.
    same = [k.hex() for k in [*family(4, 1000), cut(5000), cut(LONG_BYTES + 1)]]  # type: ignore[union-attr]
    left = [k.hex() for k in family(5, 700)]  # type: ignore[union-attr]
    async with Pool(CONFIG, sock) as pool, attached(sock) as a, attached(sock) as b:
        victim = await Child.start("pool_client.py", sock)
        try:
            await victim.event("attached")
            await a.event("attached")
            await b.event("attached")
            one, two = await asyncio.gather(
                a.call("store", keys=same, size=SLOT), b.call("store", keys=same, size=SLOT)
            )
            assert sorted(one["stored"] + two["stored"]) == sorted(same)
            assert not one["skipped"] and not two["skipped"]
            await victim.call("hold")
            storing = victim.send("store", keys=left, size=SLOT)
            await victim.event("copying")  # claimed, mid-copy
            waiting = a.send("store", keys=left, size=SLOT)
            await asyncio.sleep(0.05)
            assert a.pending(waiting) and victim.pending(storing)
            await victim.kill()
            got = await a.answer(waiting)
            assert got["stored"] == left, got
        finally:
            await victim.close()
        assert (await b.call("load", keys=[*same, *left], size=SLOT))["exact"]
        assert (await b.call("lookup", keys=[*same, *left]))["hits"] == len(same) + len(left)
        await until(lambda: not pool.statistics().claims, "the killed process's claim stayed")
        stats = pool.statistics()
        assert stats.blocks == len(same) + len(left) and stats.stores == len(same) + len(left)
        agree(pool, stats)


# -- keys made to look alike ---------------------------------------------------------------------------


def twins(length: int, at: int) -> tuple[bytes, bytes]:
    """Two keys of ``length`` bytes, alike but in the words at ``at`` and ``at + 8`` (past their first 32
    bytes): the top bit of the first word, and in the next what that bit makes of a word-by-word hash's
    state after a multiply and a shift (both exact, whatever the state). Hashed word by word with one
    multiply a word, the two were one entry: a false hit, made without a search."""
    key = bytearray(cut(length))
    other = bytearray(key)
    first = int.from_bytes(key[at : at + 8], "little") ^ (1 << 63)
    second = int.from_bytes(key[at + 8 : at + 16], "little") ^ (1 << 63) ^ (1 << 34)
    other[at : at + 8] = first.to_bytes(8, "little")
    other[at + 8 : at + 16] = second.to_bytes(8, "little")
    return bytes(key), bytes(other)


TWINS = [twins(n, at) for n, at in [(48, 32), (64, 40), (200, 96), (LONG_BYTES, LONG_BYTES - 16)]]


def digest_twins(length: int, prefix: int) -> tuple[bytes, bytes]:
    """Two long keys of one length and first 256 bytes whose digests share their first ``prefix`` bytes
    (a birthday search over their last two bytes)."""
    seen: dict[bytes, bytes] = {}
    base = cut(length - 2)
    for i in range(1 << 16):
        key = base + i.to_bytes(2, "little")
        head = hashlib.blake2b(key, digest_size=DIGEST_BYTES).digest()[:prefix]
        if head in seen:
            return seen[head], key
        seen[head] = key
    raise AssertionError("no pair found")


def test_keys_made_to_look_alike_past_their_first_32_bytes_are_two_entries() -> None:
    mirror = IndexMirror.create(64)
    try:
        for i, (key, other) in enumerate([*TWINS, digest_twins(LONG_BYTES + 40, 3), digest_twins(5000, 2)]):
            assert key != other and len(key) == len(other) and key[:KEY_BYTES] == other[:KEY_BYTES]
            mirror.insert([key], [i], [SLOT])
            assert mirror.lookup([key]) == 1
            assert mirror.lookup([other]) == 0, len(key)  # a false hit: another key's block
    finally:
        mirror.close()


async def test_a_key_made_to_look_like_a_stored_one_is_never_a_hit_and_both_keep_their_blocks(sock: str) -> None:
    keys: list[bytes | int] = [k for k, _ in TWINS]
    others: list[bytes | int] = [o for _, o in TWINS]
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as a, AttachedPool(sock) as b:
        await a.store(keys, pages_for(keys, 13))
        for other in others:
            assert b.lookup_nowait([other]) == 0 and await b.lookup([other]) == 0
        theirs = pages_for(others, 14)
        assert (await b.store(others, theirs)).stored == tuple(others)
        agree(pool, await a.statistics())  # the mirror names each key's own slot
        assert await a.discard(keys) == len(keys)
        assert b.lookup_nowait(others) == len(others) and b.lookup_nowait(keys[:1]) == 0
        back = np.zeros_like(theirs)
        await a.load(others, back)
        assert (back == theirs).all()
        agree(pool, await a.statistics())


async def test_long_keys_discarded_and_pressed_out_while_a_real_process_loads_them_load_whole(sock: str) -> None:
    """A process stopped in its load of long keys (pinned): another discards them and a third fills the
    pool past its slots. The discarded blocks are gone for lookups at once but keep their slots until the
    load ends, which copies them whole; then every slot but the blocks' is free again."""
    keys = family(20, 700)  # their hex and their answers fit a line of the test's pipe
    hexed = [k.hex() for k in keys]  # type: ignore[union-attr]
    async with Pool(CONFIG, sock) as pool, attached(sock) as loader, AttachedPool(sock) as a:
        await loader.event("attached")
        await loader.call("store", keys=hexed, size=SLOT)
        await loader.call("hold")
        loading = loader.send("load", keys=hexed, size=SLOT)
        await loader.event("copying")  # pinned, mid-copy
        assert await a.discard(keys[::2]) == 10
        assert a.lookup_nowait(keys) == 0 and a.lookup_nowait(keys[1:2]) == 1
        others = family(250, 2500)
        result = await a.store(others, pages_for(others, 15))  # room only for what no load pins
        assert result.skipped and pool.statistics().evictions == 0
        await loader.call("release")
        assert (await loader.answer(loading))["exact"]
        await until(lambda: not pool.statistics().blocks_pinned, "the load's pins stayed")
        stats = pool.statistics()
        assert stats.discards == 10 and stats.blocks == 10 + len(result.stored)
        agree(pool, stats)
        assert len((await a.store(others, pages_for(others, 15))).stored) > 0  # the freed slots serve again
        agree(pool, pool.statistics())


async def test_random_batches_of_keys_of_every_length_answer_as_a_model_of_the_store(sock: str) -> None:
    """Keys of 0 to 700 bytes (twins among them), ints and long ints, stored, discarded and looked up in
    random batches: the mirror's prefix is the model's every time."""
    rng = np.random.default_rng(21)
    universe: list[bytes | int] = [cut(int(n)) for n in rng.integers(0, 700, 120)]
    universe += [
        changed(cut(int(n)), int(a)) for n, a in zip(rng.integers(40, 700, 60), rng.integers(33, 39, 60), strict=True)
    ]
    universe += [k for pair in TWINS for k in pair] + [7, -7, 2**64 + 3, -(10**280), cut(1 << 16)]
    universe = list(dict.fromkeys(universe))
    held: set[bytes | int] = set()

    def model(batch: list[bytes | int]) -> int:
        n = 0
        for key in batch:
            if key not in held:
                break
            n += 1
        return n

    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as a, AttachedPool(sock) as b:
        for round_ in range(30):
            picks = rng.choice(len(universe), int(rng.integers(1, 40)), replace=False)
            batch = [universe[i] for i in picks.tolist()]
            if round_ % 3 == 2:
                dropped = await a.discard(batch)
                assert dropped == len(held & set(batch))
                held -= set(batch)
            else:
                result = await a.store(batch, pages_for(batch, round_))
                assert not result.skipped
                held |= set(batch)
            for _ in range(10):
                order = [universe[i] for i in rng.permutation(len(universe))[: int(rng.integers(1, 60))].tolist()]
                order.sort(key=lambda k: k not in held)  # a stored prefix, then the rest
                assert b.lookup_nowait(order) == model(order), order
        stats = await b.statistics()
        assert stats.blocks == len(held)
        agree(pool, stats)
