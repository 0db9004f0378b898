"""The single-process tier's adversarial suite, against an attached pool.

The owner (``Pool``) and its attached processes (``AttachedPool``) run on
the test's loop, except where a test needs a separate process. Every call
is attacked three ways: cancelled at every await (after 0 to 40 turns of
the loop, through ``wait_for`` with delays of 0 to 5 ms, ``task.cancel()``
and a TaskGroup whose sibling fails), raced against closes and resizes,
and given bad input. Afterwards the owner's books must agree with what the
attached processes hold (``Pool.check_invariants(sole_user=True)``), a
following store and load of the same keys must work, and once everything
is closed no library thread, mapping or descriptor of the pool is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from aiokvtier import (
    AttachedPool,
    BlockNotFound,
    OutOfSlots,
    Pool,
    PoolLostError,
    QuotaError,
    SlotError,
    TierClosedError,
    WouldBlock,
)
from aiokvtier._host import _linux
from tests.conftest import PopulateGate, mappings_in, proc_text
from tests.invariants import wait_no_library_threads
from tests.test_cancellation import cancel_during
from tests.test_pool import attached, key, sock, until

__all__ = ["sock"]  # the fixture, used by name

SLOT = 64 << 10
CONFIG = {"quota": "16MiB", "max_quota": "32MiB", "slot_size": "64KiB"}  # 256 slots, room to grow to 512
HANG = 10.0

TICKS = tuple(range(0, 40, 3))
"""Turns of the loop before a ``task.cancel()``: one lands inside each await of a call."""
DELAYS = (0, 0.0002, 0.0005, 0.001, 0.002, 0.005)


def pages(keys: list[bytes], size: int = 4096) -> np.ndarray:
    out = np.empty((len(keys), size), dtype=np.uint8)
    for i, k in enumerate(keys):
        out[i] = np.frombuffer((k * (size // len(k) + 1))[:size], dtype=np.uint8)
    return out


def pool_fds() -> list[str]:
    """Descriptors of this process that point at a pool's memfd (its tier or its index mirror)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("/memfd:aiokvtier-pool"):
            out.append(target)
    return out


def pool_maps() -> list[str]:
    return [line for line in proc_text("/proc/self/maps").splitlines() if "memfd:aiokvtier-pool" in line]


async def assert_nothing_left() -> None:
    await wait_no_library_threads()
    assert not await asyncio.to_thread(pool_maps), "a mapping of the pool's memory is left"
    assert not await asyncio.to_thread(pool_fds), "a descriptor of the pool's memory is left"


async def settle(pool: Pool, held: int = 0) -> None:
    """Once every answer has come: nothing claimed or pinned, and the owner's books are whole."""
    await until(
        lambda: (s := pool.statistics()).claims == 0 and s.blocks_pinned == 0 and s.slots_attached == held,
        "a cancelled call left something claimed, pinned or held",
    )
    pool.check_invariants(sole_user=True)
    s = pool.statistics()
    assert s.tier.slots_allocated == s.blocks + held


@contextlib.asynccontextmanager
async def rig(
    sock: str, clients: int = 1, config: dict[str, Any] = CONFIG
) -> AsyncIterator[tuple[Pool, list[AttachedPool]]]:
    """An owner and ``clients`` attached pools; on the way out, the books and the leaks are checked."""
    async with Pool(config, sock) as pool:
        attached_pools = [await AttachedPool.attach(sock) for _ in range(clients)]
        try:
            yield pool, attached_pools
        finally:
            for a in attached_pools:
                await a.aclose()
        await until(lambda: pool.clients == 0, "the owner did not see its processes go")
        await settle(pool)
    await assert_nothing_left()


async def roundtrip(a: AttachedPool, keys: list[bytes]) -> None:
    """A store and a load of ``keys`` work, bit-exact."""
    src = pages(keys)
    result = await a.store(keys, src)
    assert not result.skipped
    assert await a.lookup(keys) == len(keys)
    dst = np.zeros_like(src)
    await a.load(keys, dst)
    assert (dst == src).all()


async def cancel_after_ticks(call: Callable[[], Awaitable[Any]], ticks: int) -> tuple[bool, Any]:
    """Run ``call()`` and cancel it after ``ticks`` turns of the loop; ``(cancelled, result)``."""
    task = asyncio.ensure_future(call())
    for _ in range(ticks):
        await asyncio.sleep(0)
    task.cancel()
    async with asyncio.timeout(HANG):
        try:
            return False, await task
        except asyncio.CancelledError:
            return True, None


def cases() -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = [("ticks", t) for t in TICKS]
    out += [("wait_for", d) for d in DELAYS] + [("taskgroup", d) for d in DELAYS] + [("cancel", d) for d in DELAYS]
    return out


async def attack(call: Callable[[], Awaitable[Any]], how: str, delay: float) -> tuple[bool, Any]:
    if how == "ticks":
        return await cancel_after_ticks(call, int(delay))
    _, cancelled, result = await cancel_during(call, how, delay)
    return cancelled, result


# -- cancellation at every await ----------------------------------------------------------------------


async def test_a_cancelled_allocate_holds_nothing(sock: str) -> None:
    async with rig(sock) as (pool, (a,)):
        await a.wait_resident()  # allocate_ids(wait=False) takes what is resident
        for how, delay in cases():
            for call in (lambda: a.allocate(3), lambda: a.allocate(), lambda: a.allocate_ids(2, wait=False)):
                cancelled, got = await attack(call, how, delay)
                if not cancelled:
                    await a.free_many([got] if isinstance(got, int) else list(got))
                await settle(pool)


async def test_a_cancelled_free_frees_all_or_none_and_the_process_knows_which(sock: str) -> None:
    async with rig(sock) as (pool, (a,)):
        for how, delay in cases():
            slots = await a.allocate(4)
            await attack(lambda s=slots: a.free_many(s), how, delay)  # type: ignore[misc]
            # Whatever the owner did, this process agrees: it still holds the slots (and may free them) or not.
            held = []
            for slot in slots:
                try:
                    a.address(slot)
                    held.append(slot)
                except SlotError:
                    pass
            assert len(held) in (0, 4), f"{how} {delay}: half a free"
            await until(
                lambda h=held: pool.statistics().slots_attached == len(h),  # type: ignore[misc]
                f"{how} {delay}: the owner disagrees",
            )
            if held:
                await a.free_many(held)
            await settle(pool)


async def test_a_cancelled_store_leaves_nothing_claimed_and_the_keys_can_be_stored_again(sock: str) -> None:
    async with rig(sock) as (pool, (a,)):
        for n, (how, delay) in enumerate(cases()):
            keys = [b"s%d-%d" % (n, i) for i in range(32)]
            src = pages(keys)
            await attack(lambda k=keys, s=src: a.store(k, s), how, delay)  # type: ignore[misc]
            await settle(pool)
            # Visible or not, never half: a block that is visible is whole.
            visible = await a.lookup(keys)
            if visible:
                dst = np.zeros((visible, 4096), dtype=np.uint8)
                await a.load(keys[:visible], dst)
                assert (dst == src[:visible]).all()
            await roundtrip(a, keys)
            await a.discard(keys)
            await settle(pool)


async def test_a_cancelled_load_leaves_nothing_pinned(sock: str) -> None:
    async with rig(sock) as (pool, (a,)):
        keys = [b"load-%d" % i for i in range(64)]
        await a.store(keys, pages(keys))
        dst = np.zeros((64, 4096), dtype=np.uint8)
        for how, delay in cases():
            await attack(lambda: a.load(keys, dst), how, delay)
            await settle(pool)
            await roundtrip(a, keys)


async def test_a_store_waiting_for_another_store_of_its_keys_cancelled(sock: str) -> None:
    async with rig(sock, clients=2) as (pool, (a, b)):
        for n, (how, delay) in enumerate(cases()):
            keys = [b"w%d-%d" % (n, i) for i in range(16)]
            src = pages(keys)
            first = asyncio.ensure_future(a.store(keys, src))
            await attack(lambda k=keys, s=src: b.store(k, s), how, delay)  # type: ignore[misc]
            async with asyncio.timeout(HANG):
                await first
            await settle(pool)
            await roundtrip(b, keys)


async def test_other_calls_cancelled(sock: str) -> None:
    async with rig(sock) as (pool, (a,)):
        keys = [b"o-%d" % i for i in range(16)]
        await a.store(keys, pages(keys))
        calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: a.statistics(),
            lambda: a.discard(keys[:1]),
            lambda: a.lookup(keys),
            lambda: a.wait_resident(SLOT),
            lambda: a.events(),
        ]
        for how, delay in cases():
            for call in calls:
                await attack(call, how, delay)
                await settle(pool)
            await a.store(keys, pages(keys))
        await roundtrip(a, keys)


async def test_cancelled_attach_leaves_nothing(sock: str) -> None:
    async with rig(sock, clients=0) as (pool, _):
        for how, delay in cases():
            cancelled, got = await attack(lambda: AttachedPool.attach(sock), how, delay)
            if not cancelled:
                await got.aclose()
        await until(lambda: pool.clients == 0, "a cancelled attach stayed attached")


async def test_a_cancelled_open_of_the_owner_leaves_nothing(sock: str) -> None:
    for how, delay in cases():
        cancelled, pool = await attack(lambda: Pool.open(CONFIG, sock), how, delay)
        if not cancelled:
            await pool.aclose()
        assert not await asyncio.to_thread(os.path.exists, sock), f"{how} {delay}: the socket is left"
        await assert_nothing_left()
    async with Pool(CONFIG, sock), AttachedPool(sock) as a:  # the path serves again
        await roundtrip(a, [b"reopened"])
    await assert_nothing_left()


# -- close and resize races -------------------------------------------------------------------------


async def test_detaching_while_calls_are_in_flight(sock: str) -> None:
    async with rig(sock, clients=0) as (pool, _):
        keys = [b"d-%d" % i for i in range(32)]
        async with AttachedPool(sock) as a:
            await a.store(keys, pages(keys))
        for ticks in range(0, 30, 2):
            a = await AttachedPool.attach(sock)
            dst = np.zeros((32, 4096), dtype=np.uint8)
            calls = [
                a.allocate(4),
                a.store([b"new-%d-%d" % (ticks, i) for i in range(8)], pages([b"x"] * 8)),
                a.load(keys, dst),
                a.lookup(keys),
                a.statistics(),
                a.wait_resident(),
            ]
            tasks = [asyncio.ensure_future(c) for c in calls]
            for _ in range(ticks):
                await asyncio.sleep(0)
            async with asyncio.timeout(HANG):
                await a.aclose()
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    assert isinstance(outcome, PoolLostError | TierClosedError), repr(outcome)
            await until(lambda: pool.clients == 0, "the owner did not see a detached process go")
            await settle(pool)
        async with AttachedPool(sock) as b:
            await roundtrip(b, keys)


async def test_a_cancelled_close_still_closes_and_unmaps(sock: str) -> None:
    async with rig(sock, clients=0) as (pool, _):
        for how, delay in cases():
            a = await AttachedPool.attach(sock)
            base, size = a.base_address, a.max_quota
            slots = await a.allocate(3)
            busy = asyncio.ensure_future(a.store([b"c-%d" % i for i in range(8)], pages([b"z"] * 8)))
            await attack(a.aclose, how, delay)
            async with asyncio.timeout(HANG):
                await a.aclose()  # waits for a teardown under way, if the first was cancelled before it began
                await asyncio.gather(busy, return_exceptions=True)
            assert a.closed and slots
            assert not await asyncio.to_thread(mappings_in, base, size), f"{how} {delay}: still mapped"
            await until(lambda: pool.clients == 0, f"{how} {delay}: the owner did not see it go")
            await settle(pool)


async def test_a_cancelled_owner_close_still_closes(sock: str) -> None:
    for how, delay in cases()[::3]:
        pool = await Pool.open(CONFIG, sock)
        a = await AttachedPool.attach(sock)
        pending = asyncio.ensure_future(a.allocate(1000))
        await attack(pool.aclose, how, delay)
        async with asyncio.timeout(HANG):
            await pool.aclose()
            outcome = (await asyncio.gather(pending, return_exceptions=True))[0]
        assert isinstance(outcome, PoolLostError | OutOfSlots), repr(outcome)
        assert not await asyncio.to_thread(os.path.exists, sock)
        await a.aclose()
    await assert_nothing_left()


async def test_calls_after_detach_and_double_close(sock: str) -> None:
    async with rig(sock, clients=0) as (pool, _):
        a = await AttachedPool.attach(sock)
        slot = await a.allocate()
        await a.aclose()
        await a.aclose()
        await asyncio.gather(a.aclose(), a.aclose())
        for call in (
            lambda: a.allocate(),
            lambda: a.allocate_ids(1),
            lambda: a.free(slot),
            lambda: a.free_many([slot]),
            lambda: a.store([b"k"], [b"v"]),
            lambda: a.load([b"k"], [bytearray(1)]),
            lambda: a.lookup([b"k"]),
            lambda: a.discard([b"k"]),
            lambda: a.statistics(),
            lambda: a.events(),
            lambda: a.wait_resident(),
        ):
            with pytest.raises(TierClosedError, match="AttachedPool is closed"):
                await call()
        for sync in (lambda: a.address(slot), lambda: a.view(slot)):
            with pytest.raises(TierClosedError, match="AttachedPool is closed"):
                sync()
        await until(lambda: pool.clients == 0, "")


async def test_the_owner_closing_under_pending_calls(sock: str) -> None:
    for ticks in (0, 1, 3, 6, 10, 20):
        async with Pool(CONFIG, sock) as pool:
            a = await AttachedPool.attach(sock)
            keys = [b"p-%d" % i for i in range(32)]
            await a.store(keys, pages(keys))
            big = await a.allocate(200)  # what is left cannot hold the next allocate: it waits
            del big
            dst = np.zeros((32, 4096), dtype=np.uint8)
            tasks = [
                asyncio.ensure_future(c)
                for c in (
                    a.allocate(100),  # waits for room it never gets
                    a.wait_resident(),
                    a.store([b"q-%d" % i for i in range(8)], pages([b"y"] * 8)),
                    a.load(keys, dst),
                    a.statistics(),
                )
            ]
            events = await a.events()
            for _ in range(ticks):
                await asyncio.sleep(0)
            async with asyncio.timeout(HANG):
                await pool.aclose()
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
                ended = [e async for e in events]  # the subscription ends with the pool
            assert all(e.kind == "stored" for e in ended)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    assert isinstance(outcome, PoolLostError | OutOfSlots), repr(outcome)
            with pytest.raises(PoolLostError, match="closed the pool"):
                await a.allocate()
            with pytest.raises(PoolLostError, match="closed the pool"):
                await a.lookup(keys)
            await pool.aclose()  # twice
            await a.aclose()
    await assert_nothing_left()


async def test_the_owner_closing_under_a_process_in_another_process(sock: str) -> None:
    gate = PopulateGate(_linux.populate_write)
    real, _linux.populate_write = _linux.populate_write, gate  # type: ignore[assignment]
    try:
        gate.allow(1)  # one commit unit resident: an allocation past it waits for the fill
        pool = await Pool.open(CONFIG, sock)
        async with attached(sock) as child:
            await child.event("attached")
            await child.call("hold")
            storing = child.send("store", keys=[key(i) for i in range(4)], size=4096)
            await child.event("copying")
            waiting = child.send("allocate", n=200)
            await until(lambda: pool.statistics().claims == 1, "the child's store did not begin")
            await asyncio.sleep(0.05)  # the allocation is waiting in the owner
            assert child.pending(waiting)
            async with asyncio.timeout(HANG):
                # The client learns it at once, while the owner's close waits for the (held) fill to stop.
                closing = asyncio.ensure_future(pool.aclose())
                assert "closed the pool" in (await child.answer(waiting))["message"]
                gate.release_all()
                await closing
                await child.call("release")
                answer = await child.answer(storing)
            assert answer["error"] == "PoolLostError" and "closed the pool" in answer["message"], answer
            answer = await child.answer(child.send("stats"))
            assert answer["error"] == "PoolLostError", answer
    finally:
        gate.release_all()
        _linux.populate_write = real  # type: ignore[assignment]
    await assert_nothing_left()


async def test_resizes_race_attached_allocations_and_stores(sock: str) -> None:
    async with rig(sock, clients=2) as (pool, (a, b)):
        for round_ in range(6):
            keys = [b"r%d-%d" % (round_, i) for i in range(48)]

            async def allocations() -> None:
                for _ in range(10):
                    try:
                        slots = await a.allocate(8)
                    except OutOfSlots:
                        continue
                    await asyncio.sleep(0)
                    await a.free_many(slots)

            async def stores(keys: list[bytes] = keys) -> None:
                result = await b.store(keys, pages(keys))
                assert len(result.stored) + len(result.skipped) + len(result.present) == 48

            async def resizes() -> None:
                for quota in ("8MiB", "32MiB", "4MiB", "16MiB"):
                    try:
                        await pool.resize(quota)
                    except QuotaError:
                        pass  # a slot past the new end is held: refused, nothing changed
                    await asyncio.sleep(0.001)

            async with asyncio.timeout(HANG):
                await asyncio.gather(allocations(), stores(), resizes())
            await pool.resize("16MiB")
            await settle(pool)
            s = pool.statistics()
            assert s.tier.quota == 16 << 20
            await until(lambda: a.quota == 16 << 20 and b.quota == 16 << 20, "the new quota was not pushed")
            await b.discard(keys)
        await roundtrip(a, [b"after-%d" % i for i in range(16)])


async def test_a_shrink_below_the_watermark_while_the_fill_goes_on_reaches_every_process(sock: str) -> None:
    gate = PopulateGate(_linux.populate_write)
    real, _linux.populate_write = _linux.populate_write, gate  # type: ignore[assignment]
    try:
        gate.allow(2)  # two steps of the fill (4 MiB each) resident, the fill held at the third
        async with rig(sock) as (pool, (a,)):
            await a.wait_resident(8 << 20)
            assert a.resident_bytes < 16 << 20
            # The shrink waits for the fill's step under way (held here): let that step end meanwhile.
            shrink = asyncio.ensure_future(pool.resize("4MiB"))  # below the watermark: nothing left to fill
            await asyncio.sleep(0.05)
            gate.allow(3)
            async with asyncio.timeout(HANG):
                await shrink
            async with asyncio.timeout(HANG):
                while a.quota != 4 << 20:  # noqa: ASYNC110 - pushed by the owner, no event to await here
                    await asyncio.sleep(0.01)
            await pool.resize("16MiB")
            async with asyncio.timeout(HANG):
                while a.quota != 16 << 20:  # noqa: ASYNC110 - pushed by the owner, no event to await here
                    await asyncio.sleep(0.01)
            gate.release_all()
            await a.wait_resident()
            assert a.quota == 16 << 20 and a.resident_bytes == 16 << 20
            await roundtrip(a, [b"after-%d" % i for i in range(16)])
    finally:
        gate.release_all()
        _linux.populate_write = real  # type: ignore[assignment]


async def test_resizes_race_the_stores_of_another_process(sock: str) -> None:
    async with rig(sock, clients=0) as (pool, _), attached(sock) as child:
        await child.event("attached")
        batches = [[key(1000 * r + i) for i in range(40)] for r in range(5)]
        sent = [child.send("store", keys=keys, size=4096) for keys in batches]
        slots = (await child.call("allocate", n=20))["slots"]
        for quota in ("4MiB", "32MiB", "2MiB", "8MiB", "16MiB"):
            try:
                await pool.resize(quota)
            except QuotaError:
                pass  # a slot past the new end is held: refused, nothing changed
            await asyncio.sleep(0.002)
        await pool.resize("16MiB")
        stored: list[str] = []
        for rid in sent:
            answer = await child.answer(rid)
            assert "error" not in answer, answer
            stored += answer["stored"]
        assert (await child.call("load", keys=stored, size=4096))["exact"]
        await settle(pool, held=20)
        await child.call("free", slots=slots)
        await settle(pool)


# -- bad input ------------------------------------------------------------------------------------


Refusal = tuple[Callable[[], Awaitable[Any]], "type[BaseException] | tuple[type[BaseException], ...]", str]


async def refuse_all(pool: Pool, a: AttachedPool, refusals: list[Refusal]) -> None:
    """Each call raises its error, naming the problem, and changes nothing the owner holds (once the
    one-way messages the call sent have arrived: a round trip of the same process comes after them)."""
    before = pool.statistics()
    for i, (call, error, words) in enumerate(refusals):
        with pytest.raises(error, match=words or None):
            try:
                await call()
            except BaseException as exc:
                exc.add_note(f"bad input #{i}")
                raise
            raise AssertionError(f"bad input #{i} was taken")
        await a.statistics()
        after = pool.statistics()
        assert after.tier.slots_allocated == before.tier.slots_allocated, f"bad input #{i} changed the slots"
        assert after.blocks == before.blocks and after.claims == 0 and after.blocks_pinned == 0, f"bad input #{i}"
        pool.check_invariants(sole_user=True)


async def test_bad_counts_are_refused(sock: str) -> None:
    async with rig(sock) as (pool, (a,)):
        await refuse_all(
            pool,
            a,
            [
                (lambda: a.allocate(0), ValueError, "n"),
                (lambda: a.allocate(-1), ValueError, "n"),
                (lambda: a.allocate(True), TypeError, "bool"),
                (lambda: a.allocate(1.5), TypeError, "n must be an integer"),  # type: ignore[call-overload]
                (lambda: a.allocate("2"), TypeError, "n must be an integer"),  # type: ignore[call-overload]
                (lambda: a.allocate(1 << 70), OutOfSlots, "slots"),
                (lambda: a.allocate(10_000), OutOfSlots, "slots"),
                (lambda: a.allocate_ids(0), ValueError, "n"),
                (lambda: a.allocate_ids(1 << 70, wait=False), (OutOfSlots, WouldBlock), "slots"),
                (lambda: a.allocate_ids(1, wait="no"), TypeError, "wait must be a bool"),  # type: ignore[arg-type]
                (lambda: a.allocate_ids(1, wait=None), TypeError, "wait must be a bool"),  # type: ignore[arg-type]
                (lambda: a.store([b"w"], [b"v"], wait=1), TypeError, "wait must be a bool"),  # type: ignore[arg-type]
                (lambda: a.events(limit=0), ValueError, "limit"),
                (lambda: a.events(limit=True), ValueError, "limit"),
            ],
        )


async def test_slot_ids_this_process_does_not_hold_are_refused(sock: str) -> None:
    async with rig(sock, clients=2) as (pool, (a, b)):
        mine = await a.allocate(2)
        theirs = await b.allocate()
        await refuse_all(
            pool,
            a,
            [
                (lambda: a.free(theirs), SlotError, "not allocated by this process"),
                (lambda: a.free(1 << 40), SlotError, "not allocated by this process"),
                (lambda: a.free(-1), SlotError, "not allocated by this process"),
                (lambda: a.free_many([mine[0], theirs]), SlotError, "not allocated by this process"),
                (lambda: a.free_many([mine[0], mine[0]]), SlotError, "twice"),
                (lambda: a.free(float(mine[0])), SlotError, "not a slot id"),  # type: ignore[arg-type]
                (lambda: a.free("1"), SlotError, "not a slot id"),  # type: ignore[arg-type]
                (lambda: a.free(True), SlotError, "not a slot id"),
                (lambda: a.free_many([mine[0], None]), SlotError, "not a slot id"),  # type: ignore[list-item]
                (lambda: a.free_many(mine[0]), TypeError, ""),  # type: ignore[arg-type]
            ],
        )
        for sync in (lambda: a.address(theirs), lambda: a.view(theirs), lambda: a.address(-1)):
            with pytest.raises(SlotError, match="not allocated by this process"):
                sync()
        for bad in ("1", float(mine[0]), None, True):
            with pytest.raises(SlotError, match="not a slot id"):
                a.address(bad)  # type: ignore[arg-type]
        # Still this process's: written, then freed.
        a.view(mine[0])[:3] = b"abc"
        await a.free_many(mine)
        await b.free(theirs)


async def test_bad_watermarks_are_refused(sock: str) -> None:
    async with rig(sock) as (pool, (a,)):
        await refuse_all(
            pool,
            a,
            [
                (lambda: a.wait_resident(-1), ValueError, "nbytes"),
                (lambda: a.wait_resident(1 << 40), ValueError, "nbytes"),
                (lambda: a.wait_resident("1"), TypeError, "nbytes"),  # type: ignore[arg-type]
                (lambda: a.wait_resident(1.5), TypeError, "nbytes"),  # type: ignore[arg-type]
                (lambda: a.wait_resident(True), TypeError, "nbytes"),
            ],
        )


async def test_bad_keys_and_pages_are_refused(sock: str) -> None:
    async with rig(sock) as (pool, (a,)):
        keys = [b"b-%d" % i for i in range(8)]
        await a.store(keys, pages(keys))
        await refuse_all(
            pool,
            a,
            [
                (lambda: a.store([b"x"], [b"a" * (SLOT + 1)]), ValueError, "does not fit"),
                (lambda: a.store([b"x", b"x"], [b"a", b"b"]), ValueError, "twice"),
                (lambda: a.store([b"x"], [b""]), ValueError, "empty"),
                (lambda: a.store([b"x", b"y"], [b"a"]), ValueError, "one page per key"),
                (lambda: a.store([b"x"], np.zeros((2, 8), dtype=np.uint8)), ValueError, "page"),
                (lambda: a.store([b"x"], np.zeros((1, 8), dtype=np.float32)), (TypeError, ValueError), ""),
                (lambda: a.store([1.5], [b"a"]), TypeError, "key"),
                (lambda: a.store([None], [b"a"]), TypeError, "key"),
                (lambda: a.store([True], [b"a"]), TypeError, "bool"),
                (lambda: a.store(b"x", [b"a"]), TypeError, "not one key"),
                (lambda: a.store([b"x"], None), (TypeError, ValueError), ""),
                (lambda: a.load(keys[:1], [b"a" * 4096]), ValueError, "read-only"),
                (lambda: a.load(keys[:1], np.zeros((1, 8192), dtype=np.uint8)[:, ::2]), ValueError, ""),
                (lambda: a.load(keys[:2], [bytearray(4096)]), ValueError, "one page per key"),
                (lambda: a.load(keys[:1], [bytearray(100)]), ValueError, "has 100 bytes"),
                (lambda: a.load([b"missing"], [bytearray(4096)]), BlockNotFound, "missing"),
                (lambda: a.load([keys[0], b"missing"], [bytearray(4096), bytearray(4096)]), BlockNotFound, "missing"),
                (lambda: a.load([1.5], [bytearray(4096)]), TypeError, "key"),
                (lambda: a.lookup([1.5]), TypeError, "key"),
                (lambda: a.lookup([True]), TypeError, "bool"),
                (lambda: a.lookup(b"abc"), TypeError, "not one key"),
                (lambda: a.lookup(7), TypeError, ""),  # type: ignore[arg-type]
                (lambda: a.discard([None]), TypeError, "key"),
                (lambda: a.discard(b"abc"), TypeError, "not one key"),
            ],
        )
        await roundtrip(a, keys)  # still whole


async def test_keys_from_an_iterator_are_taken_as_a_list(sock: str) -> None:
    async with rig(sock) as (_, (a,)):
        keys = [b"g-%d" % i for i in range(8)]
        src = pages(keys)
        result = await a.store(iter(keys), src)
        assert result.stored == tuple(keys)
        assert await a.lookup(iter(keys)) == 8
        assert await a.lookup(k for k in keys[:3]) == 3
        dst = np.zeros_like(src)
        await a.load(iter(keys), dst)
        assert (dst == src).all()
        assert await a.discard(iter(keys)) == 8
        assert await a.lookup(keys) == 0


async def test_empty_and_oversized_calls(sock: str) -> None:
    async with rig(sock) as (pool, (a,)):
        assert await a.lookup([]) == 0
        assert await a.load([], np.zeros((0, 8), dtype=np.uint8)) == []
        assert await a.discard([]) == 0
        result = await a.store([], np.zeros((0, 8), dtype=np.uint8))
        assert result.stored == result.present == result.skipped == ()
        await a.free_many([])
        # More keys than the tier has slots: what fits is stored, the rest skipped, nothing held after.
        keys = [b"big-%d" % i for i in range(300)]
        result = await a.store(keys, [b"v"] * 300)
        assert len(result.stored) == 256 and result.skipped == tuple(keys[256:])
        await settle(pool)
        assert pool.statistics().blocks == 256
