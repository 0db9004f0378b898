"""The shared block store across real processes: found by all, bit-exact, pinned loads never evicted,
a store of a key that another process is storing waits for it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aiokvtier import AttachedPool, BlockNotFound, CopyEngine, Pool
from tests.test_pool import CONFIG, attached, key, page, sock, until

__all__ = ["sock"]  # the fixture, used by name

SIZE = 64 << 10


async def test_a_key_stored_by_one_process_is_loaded_bit_exact_by_another(sock: str) -> None:
    keys = [key(i) for i in range(256)]
    async with Pool(CONFIG, sock) as pool, attached(sock) as a, attached(sock) as b:
        await a.event("attached")
        await b.event("attached")
        stored = await a.call("store", keys=keys, size=SIZE)
        assert stored["stored"] == keys and stored["skipped"] == 0
        assert (await b.call("lookup", keys=keys))["hits"] == 256
        assert (await b.call("load", keys=keys, size=SIZE))["exact"]
        again = await b.call("store", keys=keys[:10], size=SIZE)
        assert again["present"] == keys[:10] and again["stored"] == []
        # And in the owner's process, attached to its own pool.
        async with AttachedPool(sock) as own:
            dst = np.zeros((2, SIZE), dtype=np.uint8)
            await own.load([bytes.fromhex(k) for k in keys[:2]], dst)
            assert (dst[1] == page(keys[1], SIZE)).all()
            with pytest.raises(BlockNotFound, match="no block for key"):
                await own.load([bytes.fromhex(keys[0]), b"missing"], dst)
        s = pool.statistics()
        assert s.blocks == 256 and s.tier.slots_allocated == 256 and s.blocks_pinned == 0


async def test_a_block_another_process_is_loading_is_never_evicted(sock: str) -> None:
    keys = [key(i) for i in range(1024)]  # 64 MiB of 64 KiB slots: the pool is full
    async with Pool(CONFIG, sock) as pool, attached(sock) as a, attached(sock) as b:
        await a.event("attached")
        await b.event("attached")
        assert (await a.call("store", keys=keys, size=4096))["skipped"] == 0
        await b.call("hold")
        loading = b.send("load", keys=keys[:8], size=4096)
        await b.event("copying")
        async with AttachedPool(sock) as c:
            # keys[:8] are the least recently used but pinned; the next 16 are evicted instead.
            assert await c.lookup([bytes.fromhex(k) for k in keys[8:]]) == 1016
            assert await c.lookup([bytes.fromhex(k) for k in keys[8:]]) == 1016
            new = [key(i) for i in range(5000, 5016)]
            result = await c.store([bytes.fromhex(k) for k in new], [page(k, 4096).tobytes() for k in new])
            assert len(result.stored) == 16
            assert await c.lookup([bytes.fromhex(k) for k in keys[:8]]) == 8
            assert pool.statistics().evictions == 16
            # Discarded while pinned: gone at once, its slot given back once the load is done.
            assert await c.discard([bytes.fromhex(keys[0])]) == 1
            assert pool.statistics().tier.slots_allocated == 1024
        await b.call("release")
        assert (await b.answer(loading))["exact"]
        assert pool.statistics().tier.slots_allocated == 1023


@pytest.mark.parametrize("first", ["finishes", "is killed"])
async def test_a_store_of_a_key_another_process_is_storing_waits_for_it(sock: str, first: str) -> None:
    keys = [key(i) for i in range(4)]
    async with Pool(CONFIG, sock) as pool, attached(sock) as a, AttachedPool(sock) as b:
        await a.event("attached")
        await a.call("hold")
        a.send("store", keys=keys, size=SIZE)
        await a.event("copying")
        second = asyncio.ensure_future(b.store([bytes.fromhex(k) for k in keys], [page(k, SIZE) for k in keys]))
        await asyncio.sleep(0.2)
        assert not second.done()
        if first == "finishes":
            await a.call("release")
        else:
            await a.kill()
        async with asyncio.timeout(30):
            result = await second
        if first == "finishes":
            assert [k.hex() for k in result.present] == keys and not result.stored  # type: ignore[union-attr]
        else:
            assert [k.hex() for k in result.stored] == keys  # type: ignore[union-attr]
        dst = np.zeros((4, SIZE), dtype=np.uint8)
        await b.load([bytes.fromhex(k) for k in keys], dst)
        assert all((dst[i] == page(k, SIZE)).all() for i, k in enumerate(keys))
        await until(lambda: pool.statistics().claims == 0, "no store left in flight")
        assert pool.statistics().tier.slots_allocated == 4


async def test_store_without_waiting_skips_what_is_not_resident(sock: str) -> None:
    from aiokvtier._host import _linux
    from tests.conftest import PopulateGate

    gate = PopulateGate(_linux.populate_write)
    real, _linux.populate_write = _linux.populate_write, gate  # type: ignore[assignment]
    try:
        gate.allow(1)
        async with Pool(CONFIG, sock), AttachedPool(sock) as b:
            await b.wait_resident(SIZE)
            keys = [b"%d" % i for i in range(200)]  # the first unit holds 64 slots
            result = await b.store(keys, [b"x" * 100] * 200, wait=False)
            assert result.stored == tuple(keys[:64]) and result.skipped == tuple(keys[64:])
            gate.release_all()
            result = await b.store(keys, [b"x" * 100] * 200)
            assert result.present == tuple(keys[:64]) and result.stored == tuple(keys[64:])
    finally:
        gate.release_all()
        _linux.populate_write = real  # type: ignore[assignment]


async def test_bad_input_changes_nothing(sock: str) -> None:
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as b:
        with pytest.raises(ValueError, match="twice"):
            await b.store([b"a", b"a"], [b"x", b"y"])
        with pytest.raises(ValueError, match="does not fit"):
            await b.store([b"a"], [b"x" * (SIZE + 1)])
        with pytest.raises(ValueError, match="empty"):
            await b.store([b"a"], [b""])
        with pytest.raises(ValueError, match="one page per key"):
            await b.store([b"a", b"b"], [b"x"])
        with pytest.raises(TypeError, match="bool"):
            await b.lookup([True])
        with pytest.raises(TypeError, match="not one key"):
            await b.lookup(b"abc")
        await b.store([1, b"\x01", 2**70], [b"int", b"bytes", b"big"])
        assert await b.lookup([1, b"\x01", 2**70]) == 3
        dst = [bytearray(5), bytearray(5), bytearray(2)]
        with pytest.raises(ValueError, match="has 2 bytes"):
            await b.load([1, b"\x01", 2**70], dst)
        dst[2] = bytearray(3)
        await b.load([1, b"\x01", 2**70], dst)
        assert [bytes(d[:5]) for d in dst] == [b"int\0\0", b"bytes", b"big"]
        with pytest.raises(ValueError, match="read-only"):
            await b.load([1], [b"xxxxx"])
        async with CopyEngine(None) as engine:  # engine= copies GPU pages: this process attached without a device
            with pytest.raises(ValueError, match="attached with device=None"):
                await b.store([b"gpu"], [b"x"], engine=engine)
            with pytest.raises(ValueError, match="attached with device=None"):
                await b.load([1], [bytearray(5)], engine=engine)
        # page= and after= go with engine=, checked before the owner is asked for anything.
        with pytest.raises(TypeError, match="after= takes a CUDA stream or event"):
            await b.store([b"after"], [b"x"], after="stream")
        with pytest.raises(TypeError, match="after= takes a CUDA stream or event"):
            await b.load([1], [bytearray(5)], after=1.5)
        with pytest.raises(ValueError, match="go with engine="):
            await b.store([b"after"], [b"x"], after=0)
        with pytest.raises(ValueError, match="go with engine="):
            await b.store([b"page"], [b"x"], page=1)
        with pytest.raises(ValueError, match="go with engine="):
            await b.load([1], [bytearray(5)], after=0)
        with pytest.raises(ValueError, match="go with engine="):
            await b.load([1], [bytearray(5)], page=[5])
        assert await b.lookup([b"after"]) == 0 and await b.lookup([b"page"]) == 0
        s = await b.statistics()  # after this connection's unpins: one connection is one order
        assert s.blocks == 3 and s.blocks_pinned == 0 and s.claims == 0
        assert s.loads == 3 and s.bytes_loaded == 11  # the refused load copied nothing
        assert pool.statistics().tier.slots_allocated == 3


async def test_cancelled_calls_hold_nothing(sock: str) -> None:
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as b:
        keys = [b"%d" % i for i in range(64)]
        data = [b"y" * 1000] * 64
        for delay in (0, 0.0005, 0.001, 0.002, 0.005):
            for i, work in enumerate(
                (
                    lambda: b.allocate(5),
                    lambda: b.store(keys, data),
                    lambda: b.load(keys[:1], [bytearray(1000)]),
                )
            ):
                task = asyncio.ensure_future(work())
                await asyncio.sleep(delay)
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, BlockNotFound):
                    pass
                if not task.cancelled() and task.exception() is None and i == 0:
                    await b.free_many(task.result())
                # What a cancelled call was given goes back as soon as its answer comes.
                await until(
                    lambda: (s := pool.statistics()).tier.slots_allocated == s.blocks and s.claims == 0,
                    f"a call cancelled after {delay} s held something",
                )
        s = await b.statistics()
        assert s.blocks_pinned == 0
        assert pool.statistics().tier.slots_allocated == s.blocks


async def test_events_reach_every_subscriber_whichever_process_caused_them(sock: str) -> None:
    keys = [key(i) for i in range(1024)]
    async with Pool(CONFIG, sock), attached(sock) as a, AttachedPool(sock) as b, AttachedPool(sock) as c:
        await a.event("attached")
        sub_b, sub_c = await b.events(), await c.events()
        assert (await a.call("store", keys=keys[:1000], size=4096))["skipped"] == 0
        await c.store([b"new-%d" % i for i in range(30)], [b"x"] * 30)  # evicts 6 of a's blocks
        assert await b.discard([bytes.fromhex(keys[500])]) == 1
        for sub in (sub_b, sub_c):
            got = [await anext(sub) for _ in range(4)]
            assert [e.kind for e in got] == ["stored", "evicted", "stored", "discarded"]
            assert [k.hex() for k in got[0].keys] == keys[:1000]  # type: ignore[union-attr]
            assert [k.hex() for k in got[1].keys] == keys[:6]  # type: ignore[union-attr]
            assert got[3].keys == (bytes.fromhex(keys[500]),)
    async with asyncio.timeout(30):
        assert [e async for e in sub_b] == []  # ended with the pool
