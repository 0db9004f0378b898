"""The Mooncake tier and the Cache facade under attack, against a real ``mooncake_master``: calls cancelled
at every await, the master killed mid-put, mid-get and mid-close, closes racing calls, hostile input,
and ``Cache.open`` failing or cancelled at each stage. Afterwards: no library thread left, no memory
left registered with Mooncake, every key whole (bit-exact) or absent."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import pytest

from aiokvtier import (
    BlockNotFound,
    BlockStore,
    Cache,
    CacheConfig,
    HostTier,
    MooncakeError,
    MooncakeTier,
    MooncakeTierConfig,
    TierClosedError,
)
from aiokvtier._mooncake import _client

from .helpers import KiB, MiB, descriptors, eventually, small_config
from .invariants import library_threads, wait_no_library_threads
from .test_mooncake import BLOCK, Hanging, Master, Pages, Wrapped, master, own_master, unique, until

pytestmark = pytest.mark.timeout(120)

__all__ = ["master", "own_master"]  # fixtures: a module-scoped master of this module's own, and one per test


DELAYS = [0.0, 0.0002, 0.001, 0.004]
"""Where a ``wait_for`` cancels a call: before it starts, while its batch calls run, after they returned."""


class Tracked(Wrapped):
    """The client, every call passed through, with the memory Mooncake holds registered and whether it was
    closed: what Mooncake itself was told, to hold the tier's books against."""

    def __init__(self) -> None:
        super().__init__()
        self.registered: dict[int, int] = {}
        self.closed = 0
        self._lock = threading.Lock()

    def register_buffer(self, address: int, size: int) -> Any:
        code = self.client.register_buffer(address, size)
        if code == 0:
            with self._lock:
                self.registered[address] = size
        return code

    def unregister_buffer(self, address: int) -> Any:
        code = self.client.unregister_buffer(address)
        if code == 0:
            with self._lock:
                self.registered.pop(address, None)
        return code

    def close(self) -> Any:
        self.closed += 1
        return self.client.close()


@contextlib.asynccontextmanager
async def tracked_tier(
    config: MooncakeTierConfig, name: str, *memory: Pages, client: Tracked | None = None
) -> AsyncIterator[tuple[MooncakeTier, Tracked]]:
    """A tier over ``memory`` whose client is ``Tracked``; on the way out, closed, its client closed and
    nothing left registered with Mooncake."""
    client = client or Tracked()
    tier = MooncakeTier(config, block_size=BLOCK, fingerprint=unique(name), wrap_client=client)
    async with tier:
        for pages in memory:
            await tier.register(pages.base, pages.size)
        yield tier, client
    assert client.closed == 1 and client.registered == {}, client.registered
    assert tier.statistics().registered_bytes == 0


def settled(tier: MooncakeTier, client: Tracked) -> None:
    """Nothing of a call left running or held; the tier's books are what Mooncake was told."""
    s = tier.statistics()
    assert (s.queue_depth, s.held_calls, s.held_bytes) == (0, 0, 0), s
    assert s.available, s
    assert s.registered_bytes == sum(client.registered.values()), (s.registered_bytes, client.registered)


async def whole_or_absent(tier: MooncakeTier, keys: list[int], src: Pages, rows: list[int], dst: Pages) -> int:
    """Read every key back: each is bit-exact or a miss, and ``lookup`` says the same; how many were there."""
    dst.array[: len(keys)] = 0
    got = await tier.read(keys, dst.addresses(range(len(keys))))
    for i, (row, ok) in enumerate(zip(rows, got, strict=True)):
        if ok:
            assert np.array_equal(dst.array[i], src.array[row]), f"key {keys[i]} came back altered"
        assert await tier.lookup([keys[i]]) == int(ok)
    return sum(got)


async def cancelled(call: Callable[[], Any], how: str, delay: float) -> None:
    """Run ``call()`` and cancel it: by ``wait_for``, by ``task.cancel()`` after ``delay``, or by a
    ``TaskGroup`` sibling that fails after ``delay``. Whether it finished first is the race's to say."""
    if how == "wait_for":
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(call(), delay)
    elif how == "cancel":
        task = asyncio.ensure_future(call())
        await asyncio.sleep(delay)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
    else:

        async def sibling() -> None:
            await asyncio.sleep(delay)
            raise RuntimeError("the sibling failed")

        with pytest.raises(ExceptionGroup) as group:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(call())
                tg.create_task(sibling())
        assert group.group_contains(RuntimeError, match="the sibling failed")


# -- cancellation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["wait_for", "cancel", "taskgroup"])
async def test_calls_cancelled_at_swept_delays_leave_every_key_whole_or_absent(master: Master, how: str) -> None:
    n = 16
    src, dst, extra = Pages(n * len(DELAYS)), Pages(n), Pages(8)
    src.fill(11)
    async with asyncio.timeout(90), tracked_tier(master.config(), f"cancel-{how}", src, dst) as (tier, client):
        for r, delay in enumerate(DELAYS):
            rows = list(range(r * n, (r + 1) * n))
            keys = [1000 * r + i for i in range(n)]
            await cancelled(partial(tier.write, keys, src.addresses(rows), [BLOCK] * n), how, delay)
            settled(tier, client)
            there = await whole_or_absent(tier, keys, src, rows, dst)
            await cancelled(partial(tier.read, keys, dst.addresses(range(n))), how, delay)
            settled(tier, client)
            await cancelled(partial(tier.read_into, keys, dst.addresses(range(n)), [BLOCK] * n), how, delay)
            await cancelled(partial(tier.lookup, keys), how, delay)
            settled(tier, client)
            # a cancelled read wrote only into its own memory: the cluster's blocks are as they were
            assert await whole_or_absent(tier, keys, src, rows, dst) == there
            await cancelled(partial(tier.register, extra.base, extra.size), how, delay)
            settled(tier, client)  # registered or not, the books say what Mooncake was told
            with contextlib.suppress(ValueError):  # not registered: the register lost its race
                await cancelled(partial(tier.unregister, extra.base), how, delay)
            settled(tier, client)
            with contextlib.suppress(ValueError):
                await tier.unregister(extra.base)
            assert extra.base not in client.registered
            # every key is written whole now, a second write of those there counts them as written
            assert await tier.write(keys, src.addresses(rows), [BLOCK] * n) == tuple(keys)
            assert await whole_or_absent(tier, keys, src, rows, dst) == n
            await cancelled(partial(tier.discard, keys), how, delay)  # under their lease: none removed
            settled(tier, client)
            assert await whole_or_absent(tier, keys, src, rows, dst) == n
        assert tier.statistics().timeouts == 0 and tier.statistics().size_mismatches == 0
    await wait_no_library_threads()


async def test_a_cancelled_open_leaves_no_thread_and_no_client(master: Master, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Tracked] = []
    setup = _client.setup

    def tracked_setup(config: MooncakeTierConfig) -> Any:
        made.append(Tracked()(setup(config)))
        return made[-1]

    monkeypatch.setattr(_client, "setup", tracked_setup)
    async with asyncio.timeout(60):
        for delay in [0.0, 0.01, 0.2]:
            tier = MooncakeTier(master.config(), block_size=BLOCK, fingerprint=unique("open"))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(tier.__aenter__(), delay)
            if tier.state == "open":  # it won the race
                await tier.aclose()
            assert tier.state in ("new", "closed")  # "new": cancelled before its first step
            await wait_no_library_threads()
            assert all(c.closed == 1 and not c.registered for c in made), [(c.closed, c.registered) for c in made]
            with pytest.raises(TierClosedError, match=r"is (new|closed)"):
                await tier.lookup([1])


# -- the store over the tier -----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def store_over(tier: MooncakeTier, *, admit_after: int = 2) -> AsyncIterator[tuple[BlockStore, HostTier]]:
    async with HostTier(small_config(slot_size=BLOCK, quota=4 * MiB, max_quota=4 * MiB)) as host:
        await asyncio.wait_for(host.wait_resident(), 30)
        async with BlockStore(host, remote=tier, admit_after=admit_after) as store:
            yield store, host
        assert host.statistics().slots_allocated == 0


def agrees(store: BlockStore, host: HostTier) -> None:
    """Nothing in flight: the store's figures are what its books and its host tier say."""
    store.check_invariants(sole_user=True)
    s = store.statistics()
    assert s.blocks == len(store) == host.statistics().slots_allocated, s
    assert s.blocks_pinned == 0 and s.in_flight == 0, s


async def test_loads_that_promote_from_the_cluster_cancelled_at_swept_delays_leave_whole_blocks_or_none(
    master: Master,
) -> None:
    n, rounds = 8, [(how, d) for how in ("wait_for", "cancel", "taskgroup") for d in DELAYS]
    src, out = Pages(n * len(rounds)), np.zeros((n, BLOCK), dtype=np.uint8)
    src.fill(12)
    async with asyncio.timeout(90), tracked_tier(master.config(), "promote", src) as (tier, client):
        keys = [b"p%03d" % i for i in range(n * len(rounds))]
        assert len(await tier.write(keys, src.addresses(range(len(keys))), [BLOCK] * len(keys))) == len(keys)
        async with store_over(tier) as (store, host):
            for r, (how, delay) in enumerate(rounds):
                mine = keys[r * n : (r + 1) * n]
                assert await store.lookup_remote(mine) == n
                await cancelled(partial(store.load, mine, out), how, delay)
                agrees(store, host)
                settled(tier, client)
                for i, key in enumerate(mine):  # promoted whole, or not at all; the cluster keeps it
                    if key in store:
                        out[0] = 0
                        await store.load([key], out[:1])
                        assert np.array_equal(out[0], src.array[r * n + i])
                assert await store.lookup_remote(mine) == n
                await store.load(mine, out)
                assert np.array_equal(out, src.array[r * n : (r + 1) * n])
                agrees(store, host)
            before = store.statistics().queries
            for delay in DELAYS:  # a cancelled lookup_remote counts nothing
                with contextlib.suppress(TimeoutError):
                    if await asyncio.wait_for(store.lookup_remote([b"none", *keys]), delay) is not None:
                        before += 1
                assert store.statistics().queries == before
        assert client.registered == {src.base: src.size}  # the store's slots unregistered at its close
    await wait_no_library_threads()


async def test_loads_cancelled_while_their_blocks_are_written_back_leave_the_cluster_whole(master: Master) -> None:
    n = 8
    pages = np.random.default_rng(13).integers(0, 256, (n * len(DELAYS), BLOCK), dtype=np.uint8)
    out = np.zeros((n, BLOCK), dtype=np.uint8)
    dst = Pages(n)
    async with asyncio.timeout(90), tracked_tier(master.config(), "write-back", dst) as (tier, client):
        async with store_over(tier, admit_after=1) as (store, host):
            for r, delay in enumerate(DELAYS):
                keys = [b"w%03d" % (r * n + i) for i in range(n)]
                await store.store(keys, pages[r * n : (r + 1) * n])
                await cancelled(partial(store.load, keys, out), "cancel", delay)
                await cancelled(partial(store.load, keys, out), "wait_for", delay)
            await eventually(lambda: not store.statistics().in_flight, 20)
            agrees(store, host)
            written = store.statistics().remote_written
        settled(tier, client)
        keys = [b"w%03d" % i for i in range(n * len(DELAYS))]
        there = 0
        for r in range(len(DELAYS)):  # in the cluster: whole, or absent
            got = await tier.read(keys[r * n : (r + 1) * n], dst.addresses(range(n)))
            for i, ok in enumerate(got):
                if ok:
                    assert np.array_equal(dst.array[i], pages[r * n + i])
            there += sum(got)
        assert 0 < there == written  # each written once, also when loaded again while its put ran
    await wait_no_library_threads()


# -- the master killed -----------------------------------------------------------------------------


class Killing(Wrapped):
    """While ``armed`` names a method, that call SIGKILLs the master (and waits for it to die) before it
    goes on to the real one: the call meets a master that died under it."""

    def __init__(self, master: Master) -> None:
        super().__init__()
        self.master = master
        self.armed: str | None = None
        self.killed = threading.Event()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.client, name)
        if name != self.armed:
            return method

        def killing(*args: Any) -> Any:
            process = self.master.process
            if self.armed == name and process is not None:
                self.armed = None
                os.kill(process.pid, signal.SIGKILL)
                process.wait(10)
                self.killed.set()
            return method(*args)

        return killing


async def restart(master: Master, tier: MooncakeTier) -> None:
    await asyncio.to_thread(master.stop)
    await asyncio.to_thread(master.start)
    await until(lambda: tier.available, 30, "available again")


async def test_the_master_killed_mid_put_mid_get_and_mid_close_is_never_a_hang_nor_an_error(
    own_master: Master, caplog: pytest.LogCaptureFixture
) -> None:
    n = 16
    src, dst = Pages(n), Pages(n)
    src.fill(14)
    killing = Killing(own_master)
    config = own_master.config()
    async with asyncio.timeout(100):
        tier = MooncakeTier(config, block_size=BLOCK, fingerprint=unique("kill"), wrap_client=killing)
        async with tier:
            await tier.register(src.base, src.size)
            await tier.register(dst.base, dst.size)
            keys = list(range(n))
            # mid-put: the write returns (none written), nothing raises, the tier says why it is off
            killing.armed = "batch_put_from"
            written = await asyncio.wait_for(tier.write(keys, src.addresses(keys), [BLOCK] * n), 15)
            assert killing.killed.is_set() and len(written) < n
            await until(lambda: not tier.available, 15, "unavailable")
            s = tier.statistics()
            assert f"master at {config.master}" in (s.unavailable_why or "") and s.held_calls == 0, s
            assert await tier.read(keys, dst.addresses(keys)) == (False,) * n
            await restart(own_master, tier)
            assert await tier.write(keys, src.addresses(keys), [BLOCK] * n) == tuple(keys)
            # mid-get: misses, never data from a dead master
            killing.killed.clear()
            killing.armed = "batch_get_into"
            dst.array[:] = 0
            got = await asyncio.wait_for(tier.read(keys, dst.addresses(keys)), 15)
            assert killing.killed.is_set()
            for i, ok in enumerate(got):
                if ok:
                    assert np.array_equal(dst.array[i], src.array[i])
            await until(lambda: not tier.available, 15, "unavailable")
            assert tier.statistics().held_calls == 0
            await restart(own_master, tier)
            assert tier.statistics().reconnects == 2
            assert await tier.write(keys, src.addresses(keys), [BLOCK] * n) == tuple(keys)
            # mid-close: the close unregisters, closes the client, stops its threads, within bounds
            killing.killed.clear()
            killing.armed = "unregister_buffer"
            await asyncio.wait_for(tier.aclose(), 30)
            assert killing.killed.is_set() and tier.state == "closed"
        assert "left open" not in caplog.text  # a dead master is no reason to keep the client
        await wait_no_library_threads()


async def test_the_master_killed_under_a_cache_leaves_its_local_tiers_serving(
    own_master: Master, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """And its close completes with the master still down, the health monitor polling it: Mooncake's
    own ``close`` retries unmounting from the gone master for some seconds (docs/mooncake.md, Faults),
    and the client is closed, not kept."""
    config = {
        "tiers": [
            {"kind": "host", "quota": 2 * MiB, "max_quota": 2 * MiB, "slot_size": BLOCK, "commit_unit": MiB},
            {"kind": "disk", "quota": 32 * BLOCK, "path": str(tmp_path)},
            own_master.config().model_dump(),
        ]
    }
    pages = np.random.default_rng(15).integers(0, 256, (8, BLOCK), dtype=np.uint8)
    out = np.zeros_like(pages)
    keys = [b"c%d" % i for i in range(8)]
    async with asyncio.timeout(60):
        async with await Cache.open(config, fingerprint=unique("cache-kill"), admit_after=1) as cache:
            assert cache.remote is not None
            await cache.store.store(keys, pages)
            await cache.store.load(keys, out)
            await eventually(lambda: cache.store.statistics().remote_written == 8, 20)
            await asyncio.to_thread(own_master.stop)
            assert await cache.store.lookup_remote([*keys, b"gone"]) == 8  # the host tier's hits
            await until(lambda: not cache.remote.available, 15, "unavailable")  # type: ignore[union-attr]
            with pytest.raises(BlockNotFound):
                await asyncio.wait_for(cache.store.load([b"gone"], out[:1]), 5)
            out[:] = 0
            await cache.store.load(keys, out)
            assert np.array_equal(out, pages)
            assert cache.store.statistics().remote is not None
        assert cache.remote.closed and cache.tier.closed and cache.store.closed  # type: ignore[union-attr]
    assert "left open" not in caplog.text
    await wait_no_library_threads()


# -- close racing calls, use after close -----------------------------------------------------------


async def test_a_close_racing_calls_from_many_tasks_ends_each_call_cleanly(master: Master) -> None:
    n = 8
    src, dst = Pages(n * 16), Pages(n * 16)
    src.fill(16)
    async with asyncio.timeout(60):
        for delay in [0.0, 0.001, 0.004]:
            client = Tracked()
            tier = MooncakeTier(master.config(), block_size=BLOCK, fingerprint=unique("race"), wrap_client=client)
            await tier.__aenter__()
            await tier.register(src.base, src.size)
            await tier.register(dst.base, dst.size)

            async def worker(t: int) -> str:
                rows = list(range(t * n, (t + 1) * n))
                keys = [100 * t + i for i in range(n)]
                try:
                    for _ in range(50):
                        if t % 3 == 0:
                            await tier.write(keys, src.addresses(rows), [BLOCK] * n)  # noqa: B023
                        elif t % 3 == 1:
                            await tier.read(keys, dst.addresses(rows))  # noqa: B023
                        else:
                            await tier.lookup(keys)  # noqa: B023
                        await asyncio.sleep(0)
                except TierClosedError:
                    return "closed"
                return "done"

            tasks = [asyncio.ensure_future(worker(t)) for t in range(16)]
            await asyncio.sleep(delay)
            await asyncio.gather(tier.aclose(), tier.aclose())
            assert set(await asyncio.gather(*tasks)) <= {"closed", "done"}
            assert tier.state == "closed" and client.closed == 1 and client.registered == {}
            s = tier.statistics()
            assert (s.queue_depth, s.held_calls, s.registered_bytes, s.timeouts) == (0, 0, 0, 0), s
            await tier.aclose()  # again: nothing
            assert client.closed == 1
            await wait_no_library_threads()
        for call in (
            lambda: tier.write([1], src.addresses([0]), [BLOCK]),
            lambda: tier.read([1], dst.addresses([0])),
            lambda: tier.read_into([1], dst.addresses([0]), [BLOCK]),
            lambda: tier.lookup([1]),
            lambda: tier.discard([1]),
            lambda: tier.register(src.base, src.size),
            lambda: tier.unregister(src.base),
        ):
            with pytest.raises(TierClosedError, match="MooncakeTier is closed"):
                await call()
        assert await tier.released(src.addresses([0]), [BLOCK])  # nothing was held
        assert not tier.available and "closed" in (tier.statistics().unavailable_why or "")


async def test_a_register_racing_the_close_is_unregistered_by_it(master: Master) -> None:
    memory = Pages(64)
    async with asyncio.timeout(60):
        for delay in [0.0, 0.0002, 0.002]:
            client = Tracked()
            tier = MooncakeTier(master.config(), block_size=BLOCK, fingerprint=unique("reg"), wrap_client=client)
            await tier.__aenter__()
            registering = asyncio.ensure_future(tier.register(memory.base, memory.size))
            await asyncio.sleep(delay)
            await tier.aclose()
            with contextlib.suppress(TierClosedError):
                await asyncio.wait_for(registering, 10)
            assert client.closed == 1 and client.registered == {}, client.registered
            assert tier.statistics().registered_bytes == 0
        await wait_no_library_threads()


async def test_registers_racing_each_other_over_the_same_memory_are_refused_as_overlaps(master: Master) -> None:
    memory = Pages(16)
    async with asyncio.timeout(30), tracked_tier(master.config(), "overlap") as (tier, client):
        for inner in ((memory.base, memory.size), (memory.base + BLOCK, BLOCK), (memory.base - BLOCK, 2 * BLOCK)):
            outcomes = await asyncio.gather(
                tier.register(memory.base, memory.size), tier.register(*inner), return_exceptions=True
            )
            assert outcomes[0] is None, outcomes
            assert isinstance(outcomes[1], ValueError) and "overlaps" in str(outcomes[1]), outcomes
            settled(tier, client)
            assert client.registered == {memory.base: memory.size}
            await tier.unregister(memory.base)
            settled(tier, client)


async def test_a_close_under_a_hung_call_keeps_its_client_as_documented_and_returns_in_time(
    master: Master, caplog: pytest.LogCaptureFixture
) -> None:
    src, dst = Pages(2), Pages(2)
    src.fill(18)
    gate = threading.Event()
    hanging = Hanging(gate)
    try:
        async with asyncio.timeout(30):
            tier = MooncakeTier(
                master.config(timeout=0.3), block_size=BLOCK, fingerprint=unique("hung-close"), wrap_client=hanging
            )
            async with tier:
                await tier.register(src.base, src.size)
                await tier.register(dst.base, dst.size)
                assert len(await tier.write([0, 1], src.addresses([0, 1]), [BLOCK] * 2)) == 2
                hanging.active = True
                assert await tier.read([0, 1], dst.addresses([0, 1])) == (False, False)
                assert tier.held and "left open" not in caplog.text
                started = asyncio.get_running_loop().time()
            assert asyncio.get_running_loop().time() - started < 5  # one more timeout, not the call's end
            assert "left open" in caplog.text  # the one case the docs keep a client for
            assert not await tier.released(dst.addresses([0, 1]), [BLOCK] * 2)  # never to be reused
    finally:
        gate.set()  # the held call returns into memory that outlives it; its thread exits
    await wait_no_library_threads(15)


# -- hostile input ---------------------------------------------------------------------------------


async def test_hostile_input_is_refused_before_anything_is_sent(master: Master) -> None:
    src, dst = Pages(4), Pages(4)
    src.fill(17)
    calls: list[str] = []

    class Counting(Tracked):
        def __getattr__(self, name: str) -> Any:
            calls.append(name)
            return super().__getattr__(name)

    async with asyncio.timeout(60), tracked_tier(master.config(), "hostile", src, dst, client=Counting()) as (tier, _):
        a, b = src.addresses([0, 1])
        wrong: list[Any] = [1.5, "k", None, True, bytearray(b"k"), memoryview(b"k"), np.int64(1), (1,), object()]
        for key in wrong:
            for call in (
                lambda: tier.write([key], [a], [BLOCK]),  # noqa: B023
                lambda: tier.read([key], [a]),  # noqa: B023
                lambda: tier.read_into([key], [a], [BLOCK]),  # noqa: B023
                lambda: tier.lookup([key]),  # noqa: B023
                lambda: tier.discard([key]),  # noqa: B023
            ):
                with pytest.raises(TypeError, match="a block key is bytes or int"):
                    await call()
        # one key where a sequence of keys belongs: never its bytes (or digits) as keys of their own
        for one in (b"ab", bytearray(b"ab"), memoryview(b"ab"), "ab", 7):
            for call in (
                lambda: tier.write(one, [a, b], [BLOCK, BLOCK]),  # type: ignore[arg-type]  # noqa: B023
                lambda: tier.read(one, [a, b]),  # type: ignore[arg-type]  # noqa: B023
                lambda: tier.lookup(one),  # type: ignore[arg-type]  # noqa: B023
                lambda: tier.discard(one),  # type: ignore[arg-type]  # noqa: B023
            ):
                with pytest.raises(TypeError):
                    await call()
        with pytest.raises(ValueError, match="does not fit"):  # a page larger than a block
            await tier.write([1], [a], [BLOCK + 1])
        for n in (0, -1):
            with pytest.raises(ValueError, match="does not fit"):
                await tier.write([1], [a], [n])
            with pytest.raises(ValueError, match="does not fit"):
                await tier.read_into([1], [a], [n])
        with pytest.raises(ValueError, match="not inside memory registered"):  # straddles the end
            await tier.write([1], [src.base + src.size - BLOCK // 2], [BLOCK])
        for address in (0, -BLOCK, 1 << 62):
            with pytest.raises(ValueError, match="not inside memory registered"):
                await tier.read([1], [address])
        for address, size in ((0, BLOCK), (src.base, 0), (src.base, -1), (src.base + 1, BLOCK), (1.0, BLOCK)):
            with pytest.raises(ValueError):
                await tier.register(address, size)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="no memory is registered"):
            await tier.unregister(src.base + BLOCK)
        assert not {"batch_put_from", "batch_get_into", "batch_is_exist", "batch_remove"} & set(calls)
        # empty batches: nothing asked of the cluster
        assert await tier.write([], [], []) == () and await tier.read([], []) == ()
        assert await tier.read_into([], [], []) == () and await tier.lookup([]) == 0 and await tier.discard([]) == 0
        assert not {"batch_put_from", "batch_get_into", "batch_is_exist", "batch_remove"} & set(calls)
        s = tier.statistics()
        assert (s.hits, s.misses, s.writes_skipped, s.errors, s.bytes_written) == (0, 0, 0, 0, 0), s
        # a key twice in one call: written once (the first page), read into both places
        assert await tier.write([5, 5, b"5"], [a, b, b], [BLOCK] * 3) == (5, b"5")
        assert tier.statistics().bytes_written == 2 * BLOCK
        assert await tier.read([5, 5, b"5"], dst.addresses([0, 1, 2])) == (True, True, True)
        assert np.array_equal(dst.array[0], src.array[0]) and np.array_equal(dst.array[1], src.array[0])
        assert np.array_equal(dst.array[2], src.array[1])
        assert await tier.lookup([5, 5, b"5"]) == 3
        # long keys are names like any other: bit-exact, and never another key's block
        long = [b"\xff" * 4096, 1 << 4000, -(1 << 4000)]
        assert await tier.write(long, src.addresses([1, 2, 3]), [BLOCK] * 3) == tuple(long)
        assert await tier.read(long[::-1], dst.addresses([0, 1, 2])) == (True, True, True)
        assert np.array_equal(dst.array[:3], src.array[3:0:-1])
        # ints past Python's decimal text (4300 digits by default) are named by their hex
        huge = [10**5000, -(10**5000), 10**640]
        assert await tier.write(huge, src.addresses([1, 2, 3]), [BLOCK] * 3) == tuple(huge)
        assert await tier.lookup(huge) == 3 and await tier.lookup([10**5000 + 1]) == 0
        dst.array[:3] = 0
        assert await tier.read(huge[::-1], dst.addresses([0, 1, 2])) == (True, True, True)
        assert np.array_equal(dst.array[:3], src.array[3:0:-1])
        settled(tier, _)
    await wait_no_library_threads()


BAD_CONFIG: list[tuple[str, Any]] = [
    ("master", "no-port"),
    ("master", "host:"),
    ("master", "host:123456"),
    ("master", ""),
    ("master", 50051),
    ("metadata_server", ""),
    ("local_hostname", ""),
    ("local_hostname", "a host"),
    ("protocol", "udp"),
    ("segment_size", 0),
    ("segment_size", -1),
    ("segment_size", True),
    ("segment_size", 1.5),
    ("segment_size", "lots"),
    ("local_buffer_size", 0),
    ("timeout", 0),
    ("timeout", -1),
    ("timeout", float("nan")),
    ("timeout", float("inf")),
    ("open_timeout", 0),
    ("open_timeout", 1e9),
    ("key_prefix", ""),
    ("key_prefix", "a b"),
    ("key_prefix", "x" * 65),
    ("kind", "disk"),
]


async def test_bad_configs_and_arguments_are_refused_by_field_with_nothing_opened(master: Master) -> None:
    good = master.config().model_dump()
    before = await asyncio.to_thread(descriptors)
    for field, value in BAD_CONFIG:
        with pytest.raises(pydantic.ValidationError) as refused:
            MooncakeTier({**good, field: value}, block_size=BLOCK, fingerprint="m")
        assert {error["loc"][0] for error in refused.value.errors()} == {field}, (field, value, refused.value)
    with pytest.raises(pydantic.ValidationError, match="rdma_devices"):
        MooncakeTier({**good, "protocol": "rdma"}, block_size=BLOCK, fingerprint="m")
    with pytest.raises(pydantic.ValidationError, match="masterr"):
        MooncakeTier({**good, "masterr": good["master"]}, block_size=BLOCK, fingerprint="m")
    for block_size in (0, -1, True, 1.5, "64KiB", None):
        with pytest.raises(ValueError, match="block_size"):
            MooncakeTier(good, block_size=block_size, fingerprint="m")  # type: ignore[arg-type]
    for fingerprint in ("", None, b"m", 1, "\udc80"):
        with pytest.raises(ValueError, match="fingerprint"):
            MooncakeTier(good, block_size=BLOCK, fingerprint=fingerprint)  # type: ignore[arg-type]
    for io_threads in (0, 65, True, 2.0, -1):
        with pytest.raises(ValueError, match="io_threads"):
            MooncakeTier(good, block_size=BLOCK, fingerprint="m", io_threads=io_threads)  # type: ignore[arg-type]
    with pytest.raises(pydantic.ValidationError, match="segment_size"):
        await Cache.open({"tiers": [{"kind": "host", "quota": MiB, "slot_size": BLOCK}, {**good, "segment_size": 0}]})
    assert not library_threads() and await asyncio.to_thread(descriptors) == before


# -- Cache.open failing at each stage --------------------------------------------------------------


def host_config() -> dict[str, Any]:
    return {"kind": "host", "quota": 2 * MiB, "max_quota": 2 * MiB, "slot_size": 64 * KiB, "commit_unit": MiB}


@pytest.fixture
def made_clients(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Tracked]]:
    """Every Mooncake client a tier sets up in this test, tracked."""
    made: list[Tracked] = []
    setup = _client.setup

    def tracked_setup(config: MooncakeTierConfig) -> Any:
        made.append(Tracked()(setup(config)))
        return made[-1]

    monkeypatch.setattr(_client, "setup", tracked_setup)
    yield made


async def descriptors_after_a_client(master: Master) -> list[str]:
    """This process's descriptors once a Mooncake client has lived in it: Mooncake keeps some of its own
    (an eventfd, pipes) from its first client on, for the rest of the process."""
    async with MooncakeTier(master.config(), block_size=BLOCK, fingerprint="warm"):
        pass
    return await asyncio.to_thread(descriptors)


async def nothing_left(before: list[str], made: list[Tracked]) -> None:
    await wait_no_library_threads()
    assert await asyncio.to_thread(descriptors) == before
    assert all(c.closed == 1 and not c.registered for c in made), [(c.closed, c.registered) for c in made]


async def test_a_cache_open_failing_at_each_stage_names_it_and_leaves_nothing_open(
    master: Master, tmp_path: Path, made_clients: list[Tracked]
) -> None:
    remote = master.config().model_dump()
    disk_dir = tmp_path / "disk"
    await asyncio.to_thread(disk_dir.mkdir)
    disk = {"kind": "disk", "quota": 32 * 64 * KiB, "path": str(disk_dir)}
    before = await descriptors_after_a_client(master)
    async with asyncio.timeout(60):
        # the host tier: a range the address space cannot hold
        with pytest.raises(OSError) as failed:
            await Cache.open({"tiers": [{**host_config(), "max_quota": "1PiB"}, disk, remote]}, fingerprint="m")
        assert "host tier" in "".join(getattr(failed.value, "__notes__", [])), failed.value
        await nothing_left(before, made_clients)
        # the disk tier: its directory made a file between the config's validation and the open
        gone = tmp_path / "gone"
        await asyncio.to_thread(gone.mkdir)
        config = await asyncio.to_thread(
            CacheConfig.model_validate, {"tiers": [host_config(), {**disk, "path": str(gone)}, remote]}
        )
        await asyncio.to_thread(gone.rmdir)
        await asyncio.to_thread(gone.write_bytes, b"")
        with pytest.raises(OSError) as failed:
            await Cache.open(config, fingerprint="m")
        assert "disk tier" in "".join(getattr(failed.value, "__notes__", [])), failed.value
        await nothing_left(before, made_clients)
        # the Mooncake tier: a master nobody listens for
        rpc, http = await asyncio.to_thread(_client.loopback_ports, 2)
        dead = {**remote, "master": f"127.0.0.1:{rpc}", "metadata_server": f"http://127.0.0.1:{http}/metadata"}
        with pytest.raises(MooncakeError, match=f"cannot reach the Mooncake master at 127.0.0.1:{rpc}"):
            await Cache.open({"tiers": [host_config(), disk, dead]}, fingerprint="m")
        await nothing_left(before, made_clients)
        # the store: the Mooncake tier refuses the host tier's slots
        refusing = Tracked()
        refusing.register_buffer = lambda address, size: -1  # type: ignore[method-assign]
        with pytest.MonkeyPatch.context() as mp:
            setup = _client.setup
            mp.setattr(_client, "setup", lambda config: refusing(setup(config)))
            with pytest.raises(MooncakeError, match="refused to register"):
                await Cache.open({"tiers": [host_config(), disk, remote]}, fingerprint="m")
        assert refusing.closed == 1
        await nothing_left(before, made_clients)
        # and with every stage whole, it opens (the disk tier's directory was let go each time)
        async with await Cache.open({"tiers": [host_config(), disk, remote]}, fingerprint="m") as cache:
            assert repr(cache).startswith("<Cache [host + disk + mooncake")
        await nothing_left(before, made_clients)


async def test_a_cache_open_cancelled_at_swept_delays_leaves_nothing_open(
    master: Master, tmp_path: Path, made_clients: list[Tracked]
) -> None:
    config = {
        "tiers": [host_config(), {"kind": "disk", "quota": 32 * 64 * KiB, "path": str(tmp_path)}, master.config()]
    }
    before = await descriptors_after_a_client(master)
    async with asyncio.timeout(60):
        for how, delay in [
            ("wait_for", 0.0),
            ("cancel", 0.0),
            ("wait_for", 0.005),
            ("cancel", 0.05),
            ("wait_for", 0.3),
        ]:
            opened: list[Cache] = []

            async def open_it() -> None:
                opened.append(await Cache.open(config, fingerprint="m"))  # noqa: B023

            await cancelled(open_it, how, delay)
            for cache in opened:  # it won the race
                await cache.aclose()
            await nothing_left(before, made_clients)
        async with await Cache.open(config, fingerprint="m"):  # the disk tier's lock was let go
            pass
    await nothing_left(before, made_clients)
