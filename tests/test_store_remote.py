"""A BlockStore over a Mooncake tier (against a real ``mooncake_master`` on loopback ports): write-back
after repeated hits, lookup_remote, loads of blocks found only there, a second store reading what the
first wrote, the master killed and restarted, cancellation, bad input; Cache.open and the metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from aiokvtier import (
    BlockNotFound,
    BlockStore,
    Cache,
    ConfigError,
    DiskTier,
    DiskTierConfig,
    HostTier,
    HostTierConfig,
    MooncakeError,
    MooncakeTier,
    MooncakeTierConfig,
    TierClosedError,
)
from aiokvtier._mooncake import _client
from aiokvtier.metrics import MooncakeCollector, StoreCollector
from aiokvtier.server import _app, _blocks, _options

from .helpers import KiB, eventually, small_config
from .invariants import wait_no_library_threads
from .test_mooncake import Master, own_master, running_master, unique, until

pytestmark = pytest.mark.timeout(180)

SLOT = 64 * KiB


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    # A short lease: Mooncake refuses to remove a block for that long after any put or get of it.
    yield from running_master(tmp_path_factory.mktemp("mooncake") / "master.log", "--default_kv_lease_ttl=200")


__all__ = ["own_master"]  # a fixture: a master of one test's own, to kill and restart


def page(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8).tobytes()


def host_config(slots: int = 16) -> Any:
    return small_config(quota=slots * SLOT, max_quota=slots * SLOT, slot_size=SLOT, commit_unit=SLOT * 16)


@asynccontextmanager
async def remote_store(
    config: MooncakeTierConfig, fingerprint: str, slots: int = 16, disk: DiskTier | None = None, **kwargs: Any
) -> AsyncIterator[tuple[BlockStore, MooncakeTier]]:
    async with (
        HostTier(host_config(slots)) as tier,
        MooncakeTier(config, block_size=SLOT, fingerprint=fingerprint) as remote,
    ):
        await tier.wait_resident()
        async with BlockStore(tier, disk=disk, remote=remote, **kwargs) as store:
            yield store, remote
            await eventually(lambda: store.statistics().in_flight == 0, 30)
            store.check_invariants(sole_user=True)
        assert remote.statistics().registered_bytes == 0  # the store's close unregistered its slots


async def load_pages(store: BlockStore, keys: list[bytes]) -> list[bytes]:
    out = np.zeros((len(keys), SLOT), dtype=np.uint8)
    await store.load(keys, out)
    return [row.tobytes() for row in out]


async def admit(store: BlockStore, keys: list[bytes]) -> None:
    """Store ``page(i)`` under the i-th key, load them once (a store with ``admit_after=1``) and wait until
    they are written to the Mooncake tier."""
    await store.store(keys, [page(i) for i in range(len(keys))])
    await load_pages(store, keys)
    await eventually(lambda: store.statistics().remote_written == len(keys), 30)


async def push_out(store: BlockStore, n: int = 16, seed: int = 100) -> None:
    """Fill the host tier with other blocks (never loaded: never written below)."""
    await store.store([b"other-%d-%d" % (seed, i) for i in range(n)], [page(seed + i) for i in range(n)])


@asynccontextmanager
async def over_disk_and_mooncake(
    master: Master, path: Path, name: str, keys: list[bytes]
) -> AsyncIterator[tuple[BlockStore, DiskTier]]:
    """A store over a disk tier and a Mooncake tier (``admit_after=1``) that wrote ``page(i)`` under the
    i-th key to both; then ``keys[2:4]`` dropped from the disk (only in Mooncake now), and the host tier
    filled with other blocks."""
    fingerprint = unique(name)
    disk_config = await asyncio.to_thread(DiskTierConfig, quota=64 * SLOT, path=path)
    async with (
        DiskTier(disk_config, block_size=SLOT, fingerprint=fingerprint) as disk,
        remote_store(master.config(), fingerprint, disk=disk, admit_after=1) as (store, _),
    ):
        await admit(store, keys)
        await eventually(lambda: store.statistics().written_back == len(keys), 30)
        disk.discard(keys[2:4])
        await push_out(store)
        yield store, disk


async def test_blocks_hit_twice_go_to_mooncake_and_come_back_bit_exact_once_evicted(master: Master) -> None:
    keys = [b"k%d" % i for i in range(8)]
    async with remote_store(master.config(), unique("store")) as (store, remote):
        assert remote.statistics().registered_bytes == 16 * SLOT  # the host tier's slots, at open
        await store.store(keys, [page(i) for i in range(8)])
        await load_pages(store, keys)
        assert store.statistics().remote_written == 0  # one hit: not admitted
        await load_pages(store, keys[:6])
        await eventually(lambda: store.statistics().remote_written == 6, 30)
        assert await remote.lookup(keys) == 6
        await push_out(store)
        assert not any(k in store for k in keys)
        assert store.lookup(keys) == 0  # local only: no network call
        assert await store.lookup_remote(keys) == 6
        assert await load_pages(store, keys[:6]) == [page(i) for i in range(6)]
        s = store.statistics()
        assert (s.remote_fetched, s.remote_hits) == (6, 6) and s.remote is not None and s.remote.hits == 6
        assert all(k in store for k in keys[:6])  # back in the host tier
        with pytest.raises(BlockNotFound, match=repr(keys[6])):
            await store.load(keys[5:7], np.zeros((2, SLOT), dtype=np.uint8))
        store.check_invariants(sole_user=True)
    await wait_no_library_threads(15)


async def test_a_block_shorter_than_a_slot_comes_back_with_its_length(master: Master) -> None:
    short = page(7)[:1000]
    async with remote_store(master.config(), unique("short"), admit_after=1) as (store, _):
        await store.store([b"s"], [short])
        await store.load([b"s"], [bytearray(1000)])
        await eventually(lambda: store.statistics().remote_written == 1, 30)
        await push_out(store)
        out = bytearray(SLOT)
        stored = store.statistics().bytes_stored
        await store.load([b"s"], [out])
        assert store.length(b"s") == 1000 and bytes(out[:1000]) == short
        assert store.statistics().bytes_stored == stored + 1000  # what arrived, not the slot booked for it
        # a destination page too short for the block: known once it arrived, nothing copied
        await push_out(store, seed=200)
        with pytest.raises(ValueError, match="destination page 0 has 10 bytes"):
            await store.load([b"s"], [bytearray(10)])


async def test_lookup_remote_goes_on_through_host_disk_and_mooncake(master: Master, tmp_path: Path) -> None:
    keys = [b"m%d" % i for i in range(6)]
    async with over_disk_and_mooncake(master, tmp_path, "mixed", keys) as (store, _):
        await store.store([keys[4]], [page(4)])  # back in the host tier
        assert store.lookup(keys) == 2  # disk, disk, then neither local tier
        assert await store.lookup_remote(keys) == 6  # disk, disk, Mooncake, Mooncake, host, disk
        assert await store.lookup_remote([*keys[:3], b"nowhere", keys[3]]) == 3
        mixed = [keys[4], keys[2], keys[0], keys[3], keys[5]]  # host, Mooncake, disk, Mooncake, disk
        assert await load_pages(store, mixed) == [page(i) for i in (4, 2, 0, 3, 5)]
        s = store.statistics()
        assert (s.promoted, s.remote_fetched) == (2, 2)
        assert s.disk is not None and s.remote is not None and s.remote.hits == 2


async def test_a_miss_on_disk_does_not_keep_mooncakes_blocks_from_landing_and_the_first_miss_is_named(
    master: Master, tmp_path: Path
) -> None:
    """The tiers' batches ran one after the other and the first to fail ended the load: a block missing on
    disk left the Mooncake tier's blocks unread (the error said the others landed), and a load whose
    Mooncake block came earlier in its keys named the disk's miss, not the first missing key."""
    keys = [b"f%d" % i for i in range(6)]
    async with over_disk_and_mooncake(master, tmp_path, "firstmiss", keys) as (store, disk):
        mixed = [keys[0], keys[2], keys[3], keys[5]]  # disk, Mooncake, Mooncake, disk
        out = np.zeros((4, SLOT), dtype=np.uint8)
        load = asyncio.ensure_future(store.load(mixed, out))
        await asyncio.sleep(0)  # the load chose its tiers
        disk.discard([keys[0]])  # gone before its read
        with pytest.raises(BlockNotFound, match=repr(keys[0])):
            await load
        assert keys[2] in store and keys[3] in store  # Mooncake's blocks landed all the same
        assert [out[i].tobytes() for i in (1, 2)] == [page(2), page(3)]
        await push_out(store, seed=300)
        # The disk's batch first (its first key comes first), but the first key missing is the Mooncake tier's.
        wanted = [keys[1], b"nowhere", keys[5]]
        load = asyncio.ensure_future(store.load(wanted, np.zeros((3, SLOT), dtype=np.uint8)))
        await asyncio.sleep(0)
        disk.discard([keys[5]])
        with pytest.raises(BlockNotFound, match=repr(b"nowhere")):
            await load


async def test_a_second_store_loads_what_the_first_wrote(master: Master) -> None:
    keys = [b"shared%d" % i for i in range(8)]
    fingerprint = unique("shared")
    async with remote_store(master.config(), fingerprint, admit_after=1) as (first, _):
        await admit(first, keys)
        async with remote_store(master.config(), fingerprint) as (second, _):
            assert len(second) == 0 and await second.lookup_remote(keys) == 8
            assert await load_pages(second, keys[::-1]) == [page(i) for i in range(8)][::-1]
            assert second.statistics().remote_fetched == 8
        # another fingerprint names other blocks
        async with remote_store(master.config(), unique("other")) as (third, _):
            assert await third.lookup_remote(keys) == 0
            with pytest.raises(BlockNotFound, match=repr(keys[0])):
                await load_pages(third, keys[:1])
    await wait_no_library_threads(15)


async def test_discard_drops_the_block_from_mooncake_too_and_the_close_waits_for_it(master: Master) -> None:
    async with (
        HostTier(host_config()) as tier,
        MooncakeTier(master.config(), block_size=SLOT, fingerprint=unique("discard")) as remote,
    ):
        await tier.wait_resident()
        store = await BlockStore.open(tier, remote=remote, admit_after=1)
        await store.store([b"x", b"y"], [page(0), page(1)])
        await load_pages(store, [b"x", b"y"])
        await eventually(lambda: store.statistics().remote_written == 2, 30)
        await asyncio.sleep(0.5)  # past the master's 200 ms lease of the put
        assert store.discard([b"x"]) == 1
        await store.aclose()  # waits for the discard it sent (a lookup meanwhile would renew the lease)
        assert await remote.lookup([b"x"]) == 0 and await remote.lookup([b"y"]) == 1
    await wait_no_library_threads(15)


async def test_the_master_killed_and_restarted_under_the_store(
    own_master: Master, caplog: pytest.LogCaptureFixture
) -> None:
    keys = [b"r%d" % i for i in range(4)]
    async with remote_store(own_master.config(), unique("restart"), admit_after=1) as (store, remote):
        await admit(store, keys)
        await push_out(store, 12)  # r0-r3 out of the host tier, only in Mooncake now
        await store.store([b"h"], [page(50)])
        await asyncio.to_thread(own_master.stop)
        # the host tier keeps serving; what is only in Mooncake is a miss, never a hang
        assert await load_pages(store, [b"h"]) == [page(50)]
        with pytest.raises(BlockNotFound, match=repr(keys[0])):
            await asyncio.wait_for(store.load(keys, np.zeros((4, SLOT), dtype=np.uint8)), 30)
        await until(lambda: not remote.available, 20, "unavailable")
        assert await asyncio.wait_for(store.lookup_remote([b"h", *keys]), 5) == 1
        with pytest.raises(BlockNotFound, match=repr(keys[0])):
            await store.load(keys, np.zeros((4, SLOT), dtype=np.uint8))
        await store.store([b"n"], [page(51)])
        await load_pages(store, [b"n"])  # admitted: the write-back skips it, counted, no error
        await eventually(lambda: store.statistics().in_flight == 0, 30)
        s = store.statistics()
        assert s.remote is not None and not s.remote.available and s.remote.writes_skipped >= 1
        store.check_invariants(sole_user=True)
        await asyncio.to_thread(own_master.start)
        await until(lambda: remote.available, 30, "available again")
        # the restarted master starts empty; blocks go there again and come back
        await store.store([b"a"], [page(60)])
        await load_pages(store, [b"a"])
        await eventually(lambda: store.statistics().remote_written == 5, 30)
        await push_out(store, 16, 300)
        assert await store.lookup_remote([b"a"]) == 1
        assert await load_pages(store, [b"a"]) == [page(60)]
    assert caplog.text.count("Mooncake tier is unavailable") == 1
    await wait_no_library_threads(15)


@pytest.mark.parametrize("delay", [0.0, 0.0005, 0.002, 0.01, 0.05])
async def test_cancelled_loads_stores_and_lookups_leave_nothing_claimed(master: Master, delay: float) -> None:
    keys = [b"c%d" % i for i in range(12)]
    async with remote_store(master.config(), unique("cancel"), admit_after=1) as (store, remote):
        await admit(store, keys)
        await push_out(store)
        out = np.zeros((12, SLOT), dtype=np.uint8)
        calls = (
            lambda: store.load(keys, out),
            lambda: store.lookup_remote(keys),
            lambda: store.store([b"n%d" % i for i in range(8)], [page(400 + i) for i in range(8)]),
        )
        for call in calls:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(call(), delay)
            await eventually(lambda: store.statistics().in_flight == 0, 30)
            store.check_invariants(sole_user=True)
            assert remote.statistics().held_calls == 0
        await push_out(store, 16, 500)
        assert await load_pages(store, keys) == [page(i) for i in range(12)]
    await wait_no_library_threads(15)


def lookup_counts(store: BlockStore) -> tuple[int, ...]:
    s = store.statistics()
    return (s.queries, s.hits, s.disk_hits, s.remote_hits, s.misses)


async def test_a_cancelled_lookup_remote_counts_nothing(master: Master) -> None:
    keys = [b"q%d" % i for i in range(6)]
    async with remote_store(master.config(), unique("counted"), admit_after=1) as (store, _):
        await admit(store, keys[1:5])
        await push_out(store)
        await store.store([keys[0]], [page(0)])  # host, Mooncake x4, nowhere
        before = lookup_counts(store)
        task = asyncio.ensure_future(store.lookup_remote(keys))
        await asyncio.sleep(0)  # on its way: the Mooncake tier asked
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert lookup_counts(store) == before  # no misses for keys it never answered about
        answered = 0
        for delay in (0.0, 0.0002, 0.001, 0.003, 0.01, 0.05, 5.0):
            before = lookup_counts(store)
            try:
                found = await asyncio.wait_for(store.lookup_remote(keys), delay)
            except TimeoutError:
                assert lookup_counts(store) == before, delay
                continue
            assert found == 5
            delta = tuple(a - b for a, b in zip(lookup_counts(store), before, strict=True))
            assert delta == (1, 1, 0, 4, 1), delay  # one query: host, Mooncake x4, a miss
            answered += 1
        assert answered  # the longest delay at least
        store.check_invariants(sole_user=True)


async def test_a_load_cancelled_while_a_late_get_may_write_keeps_its_slots_until_it_returned(master: Master) -> None:
    keys = [b"late%d" % i for i in range(32)]
    fresh = [b"fresh%d" % i for i in range(32)]
    fingerprint = unique("late-cancel")
    caught = 0
    async with remote_store(master.config(), fingerprint, slots=32, admit_after=1) as (writer, _):
        await admit(writer, keys)
        for _ in range(4):
            # A reader whose gets all pass their timeout: each returns later, writing into the slots it was
            # given (and whose tier, unavailable after the first, is made anew for the next attempt).
            async with (
                HostTier(host_config(32)) as tier,
                MooncakeTier(master.config(timeout=0.0001), block_size=SLOT, fingerprint=fingerprint) as remote,
                BlockStore(tier, remote=remote) as reader,
            ):
                await tier.wait_resident()
                loading = asyncio.ensure_future(load_pages(reader, keys))
                await eventually(lambda: loading.done() or remote.statistics().held_calls > 0, 30)  # noqa: B023
                caught += not loading.done()
                loading.cancel()  # while a get past its timeout may still write into the slots
                with contextlib.suppress(asyncio.CancelledError, BlockNotFound):
                    await loading
                # the load gave its slots back only once the get returned (to the store below, say)
                assert remote.statistics().held_calls == 0
                assert tier.statistics().slots_allocated == len(reader)
                await reader.store(fresh, [page(600 + i) for i in range(32)])
                assert all(k in reader for k in fresh)
                assert await load_pages(reader, fresh) == [page(600 + i) for i in range(32)]  # no late write
                reader.check_invariants(sole_user=True)
            if caught >= 2:
                break
    assert caught  # a cancellation came while a get was held
    await wait_no_library_threads(15)


async def test_an_open_cancelled_while_it_registers_the_slots_leaves_nothing_registered(master: Master) -> None:
    async with (
        HostTier(host_config()) as tier,
        MooncakeTier(master.config(), block_size=SLOT, fingerprint=unique("open-cancel")) as remote,
    ):
        await tier.wait_resident()
        cancelled = opened = 0
        delays = [0.0, 0.0, *(0.0001 * 1.5**i for i in range(30))]
        for delay in delays:  # cancelled ever later, until the open is done first
            opening = asyncio.ensure_future(BlockStore.open(tier, remote=remote))
            await asyncio.sleep(delay)
            opening.cancel()
            try:
                store = await opening
            except asyncio.CancelledError:
                cancelled += 1
            else:
                opened += 1
                await store.aclose()
            assert remote.statistics().registered_bytes == 0, delay  # the slots are not left registered
            assert tier.statistics().slots_allocated == 0
            if opened >= 3:
                break
        assert cancelled and opened
        async with BlockStore(tier, remote=remote):  # and a store opens over them again
            assert remote.statistics().registered_bytes == 16 * SLOT
        assert remote.statistics().registered_bytes == 0


async def test_a_mooncake_tier_that_does_not_fit_is_refused_and_changes_nothing(master: Master, tmp_path: Path) -> None:
    disk_config = await asyncio.to_thread(DiskTierConfig, quota=64 * SLOT, path=tmp_path)
    async with (
        HostTier(host_config()) as tier,
        MooncakeTier(master.config(), block_size=2 * SLOT, fingerprint="m") as wide,
        MooncakeTier(master.config(), block_size=SLOT, fingerprint="m") as remote,
        DiskTier(disk_config, block_size=SLOT, fingerprint="other") as disk,
    ):
        with pytest.raises(ValueError, match=r"Mooncake tier.s blocks are 131072 bytes.*must be the same"):
            await BlockStore.open(tier, remote=wide)
        with pytest.raises(ValueError, match="fingerprint 'other' is not the Mooncake tier's 'm'"):
            await BlockStore.open(tier, disk=disk, remote=remote)
        assert remote.statistics().registered_bytes == 0 and tier.statistics().slots_allocated == 0
        # open and closed twice over the same tiers: registered and unregistered each time
        for _ in range(2):
            async with BlockStore(tier, remote=remote) as store:
                assert remote.statistics().registered_bytes == 16 * SLOT and len(store) == 0
            assert remote.statistics().registered_bytes == 0
    closed = MooncakeTier(master.config(), block_size=SLOT, fingerprint="m")
    async with HostTier(host_config()) as tier:
        with pytest.raises(TierClosedError):
            await BlockStore.open(tier, remote=closed)
    await wait_no_library_threads(15)


def cache_config(master: Master, **remote: Any) -> dict[str, Any]:
    host = {"kind": "host", "quota": 16 * SLOT, "max_quota": 16 * SLOT, "slot_size": SLOT, "backing": "host"}
    mooncake = {"kind": "mooncake", **master.config(**remote).model_dump(exclude={"kind"})}
    return {"tiers": [host, mooncake]}


async def test_cache_open_puts_a_mooncake_tier_under_its_store(master: Master) -> None:
    fingerprint = unique("cache")
    async with await Cache.open(cache_config(master), fingerprint=fingerprint, admit_after=1) as cache:
        assert cache.remote is not None and cache.remote.available and "mooncake" in repr(cache)
        await cache.tier.wait_resident()
        await cache.store.store([b"c"], [page(1)])
        await load_pages(cache.store, [b"c"])
        await eventually(lambda: cache.store.statistics().remote_written == 1, 30)
        remote = cache.remote
    assert remote.closed and cache.tier.closed
    with pytest.raises(ConfigError, match="fingerprint"):
        await Cache.open(cache_config(master))
    await wait_no_library_threads(15)


async def test_a_cache_whose_master_does_not_answer_closes_what_it_opened(master: Master) -> None:
    rpc, http = await asyncio.to_thread(_client.loopback_ports, 2)
    config = cache_config(master, open_timeout=2.0)
    config["tiers"][1] |= {"master": f"127.0.0.1:{rpc}", "metadata_server": f"http://127.0.0.1:{http}/metadata"}
    with pytest.raises(MooncakeError, match="cannot reach the Mooncake master"):
        await Cache.open(config, fingerprint="m")
    await wait_no_library_threads(15)


async def test_the_mooncake_collector_and_the_store_remote_counters_match_statistics(master: Master) -> None:
    registry = CollectorRegistry()
    async with remote_store(master.config(), unique("metrics"), admit_after=1) as (store, remote):
        registry.register(MooncakeCollector(remote, name="cluster"))
        registry.register(StoreCollector(store, name="kv"))
        await store.store([b"a", b"b"], [page(0), page(1)])
        await load_pages(store, [b"a", b"b"])
        await eventually(lambda: store.statistics().remote_written == 2, 30)
        await push_out(store)
        assert await store.lookup_remote([b"a", b"z"]) == 1
        await load_pages(store, [b"a"])
        m, s = remote.statistics(), store.statistics()

        def value(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(name, labels)

        assert value("aiokvtier_mooncake_available", mooncake="cluster") == 1
        assert value("aiokvtier_mooncake_written_bytes_total", mooncake="cluster") == m.bytes_written == 2 * SLOT
        assert value("aiokvtier_mooncake_hits_total", mooncake="cluster") == m.hits == 1
        assert value("aiokvtier_mooncake_registered_bytes", mooncake="cluster") == 16 * SLOT
        assert value("aiokvtier_store_remote_written_total", store="kv") == s.remote_written == 2
        assert value("aiokvtier_store_remote_hits_total", store="kv") == s.remote_hits == 1
        assert value("aiokvtier_store_remote_fetched_total", store="kv") == s.remote_fetched == 1
    assert value("aiokvtier_mooncake_available", mooncake="cluster") == 0  # closed: its last figures


async def test_the_server_serves_blocks_through_a_mooncake_tier_and_exports_its_metrics(master: Master) -> None:
    host = HostTierConfig(quota="1MiB", max_quota="1MiB", slot_size="64KiB", backing="host")
    args, _ = await asyncio.to_thread(
        _options.parse,
        ["--mooncake-master", f"127.0.0.1:{master.rpc}", "--mooncake-metadata-server", master.config().metadata_server],
    )
    assert args.mooncake.local_hostname == "127.0.0.1"  # the address that reaches a loopback master
    key, body = "ab%04x" % (time.monotonic_ns() % 65536), bytes(range(256)) * 100
    url = f"/v1/blocks/{key}"
    async with contextlib.AsyncExitStack() as stack:
        # Two servers on one cluster (a block lives in the memory of the client that put it: both stay up).
        clients, stores = [], []
        for _ in range(2):
            service = _app.Service(_blocks.StoreBlocks(host, "lru", None, args.mooncake))
            app = service.app()
            transport = httpx.ASGITransport(app=app)
            clients.append(await stack.enter_async_context(httpx.AsyncClient(transport=transport, base_url="http://s")))
            await stack.enter_async_context(app.router.lifespan_context(app))
            assert isinstance(service.blocks, _blocks.StoreBlocks)
            stores.append(service.blocks.store)
        first, second = clients
        assert (await first.put(url, content=body)).status_code in (200, 201)
        for _ in range(2):  # hit twice: written to the Mooncake tier
            assert (await first.get(url)).content == body
        await eventually(lambda: stores[0].statistics().remote_written == 1, 30)
        metrics = (await first.get("/metrics")).text
        assert 'aiokvtier_mooncake_available{mooncake="default"} 1.0' in metrics
        assert 'aiokvtier_store_remote_written_total{store="default"} 1.0' in metrics
        # the other server's host tier is empty: the block comes from the cluster
        assert len(stores[1]) == 0
        assert (await second.post("/v1/lookup", json={"keys": [key, "ffff"]})).json() == {"hits": 1}
        assert (await second.get(url)).content == body
        assert stores[1].statistics().remote_fetched == 1
        assert (await second.get("/v1/blocks/ab02")).status_code == 404
    await wait_no_library_threads(15)


async def test_the_server_closes_its_disk_and_host_tiers_when_its_mooncake_tier_fails_to_close(
    master: Master, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = await asyncio.to_thread(DiskTierConfig, quota=64 * SLOT, path=tmp_path)
    blocks = _blocks.StoreBlocks(host_config(), "lru", disk, master.config())
    await blocks.open()
    real = MooncakeTier.aclose

    async def failing(self: MooncakeTier) -> None:
        await real(self)
        raise RuntimeError("the Mooncake tier's close failed")

    monkeypatch.setattr(MooncakeTier, "aclose", failing)
    with pytest.raises(RuntimeError, match="the Mooncake tier's close failed"):
        await blocks.aclose()
    assert blocks.disk is not None and blocks.disk.closed
    assert blocks.tier.statistics().closed


def test_the_mooncake_options_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    for options, named in (
        (["--mooncake-master", "nohost"], "--mooncake-master"),
        (["--mooncake-master", "127.0.0.1:50051", "--workers", "2"], "--mooncake-master"),
        (["--mooncake-master", "127.0.0.1:50051", "--plain-dict"], "--mooncake-master"),
        (["--mooncake-master", "127.0.0.1:50051", "--mooncake-segment-size", "lots"], "--mooncake-segment-size"),
        (["--mooncake-segment-size", "2GiB"], "--mooncake-segment-size"),  # no master to describe
        (["--mooncake-local-hostname", "10.0.0.2"], "--mooncake-local-hostname"),
        (["--mooncake-metadata-server", "http://10.0.0.1:8080/metadata"], "--mooncake-metadata-server"),
    ):
        with pytest.raises(SystemExit) as exit_:
            _options.parse(options)
        assert exit_.value.code == 2 and named in capsys.readouterr().err
    args, _ = _options.parse(["--mooncake-master", "10.0.0.1:50051", "--mooncake-local-hostname", "10.0.0.2"])
    assert args.mooncake.metadata_server == "http://10.0.0.1:8080/metadata"
    assert args.mooncake.local_hostname == "10.0.0.2" and args.mooncake.segment_size == 1 << 30
    assert _options.parse([])[0].mooncake is None


async def test_concurrent_loads_of_one_remote_block_fetch_it_once(master: Master) -> None:
    keys = [b"d%d" % i for i in range(4)]
    async with remote_store(master.config(), unique("twice"), admit_after=1) as (store, remote):
        await admit(store, keys)
        await push_out(store)
        both = await asyncio.gather(load_pages(store, keys), load_pages(store, keys[::-1]))
        assert both == [[page(i) for i in range(4)], [page(i) for i in range(4)][::-1]]
        assert store.statistics().remote_fetched == 4 and remote.statistics().hits == 4


async def test_int_keys_past_pythons_decimal_text_go_to_mooncake_and_come_back(master: Master) -> None:
    keys = [10**5000 + i for i in range(3)] + [-(10**5000)]  # str() of each is a ValueError
    async with remote_store(master.config(), unique("huge"), admit_after=1) as (store, remote):
        await store.store(keys, [page(i) for i in range(4)])
        out = np.zeros((4, SLOT), dtype=np.uint8)
        await store.load(keys, out)
        await eventually(lambda: store.statistics().remote_written == 4, 30)
        await push_out(store)
        assert await store.lookup_remote(keys) == 4 and await remote.lookup(keys) == 4
        await store.load(keys, out)
        assert [row.tobytes() for row in out] == [page(i) for i in range(4)]
        assert store.statistics().remote_fetched == 4


async def test_a_grown_host_tier_is_registered_before_its_new_slots_go_to_mooncake(master: Master) -> None:
    config = small_config(quota=16 * SLOT, max_quota=32 * SLOT, slot_size=SLOT, commit_unit=SLOT * 16)
    async with (
        HostTier(config) as tier,
        MooncakeTier(master.config(), block_size=SLOT, fingerprint=unique("grow")) as remote,
        BlockStore(tier, remote=remote, admit_after=1) as store,
    ):
        await tier.wait_resident()
        await store.resize(32 * SLOT)
        await tier.wait_resident()
        keys = [b"g%d" % i for i in range(32)]
        await admit(store, keys)
        assert remote.statistics().registered_bytes == 32 * SLOT
        await store.store([b"o%d" % i for i in range(32)], [page(100 + i) for i in range(32)])
        assert await load_pages(store, keys[:16]) == [page(i) for i in range(16)]
        await store.aclose()
        assert remote.statistics().registered_bytes == 0
    await wait_no_library_threads(15)


async def test_a_mooncake_tier_closed_under_the_store_is_one_that_holds_nothing(master: Master) -> None:
    keys = [b"z%d" % i for i in range(4)]
    async with HostTier(host_config()) as tier:
        await tier.wait_resident()
        remote = await MooncakeTier.open(master.config(), block_size=SLOT, fingerprint=unique("gone"))
        async with BlockStore(tier, remote=remote, admit_after=1) as store:
            await admit(store, keys)
            await push_out(store)
            await remote.aclose()
            assert await store.lookup_remote(keys) == 0
            with pytest.raises(BlockNotFound, match=repr(keys[0])):
                await load_pages(store, keys)
            await store.store([b"late"], [page(9)])
            await load_pages(store, [b"late"])  # admitted: nothing to write it to
            assert store.discard(keys) == 0
            await eventually(lambda: store.statistics().in_flight == 0)
            store.check_invariants(sole_user=True)
            assert await load_pages(store, [b"late"]) == [page(9)]
    await wait_no_library_threads(15)


async def test_a_get_past_its_timeout_keeps_its_slots_until_it_returns(master: Master) -> None:
    keys = [b"t%d" % i for i in range(16)]
    fingerprint = unique("late")
    async with remote_store(master.config(), fingerprint, admit_after=1) as (writer, _):
        await admit(writer, keys)
        # A reader whose calls time out at once: each get is abandoned (its memory held) and returns later.
        async with remote_store(master.config(timeout=0.0001), fingerprint) as (reader, remote):
            with pytest.raises(BlockNotFound):
                await load_pages(reader, keys)
            s = remote.statistics()
            assert s.timeouts >= 1 and s.held_calls == 0  # the load waited for the get before giving back slots
            reader.check_invariants(sole_user=True)
    await wait_no_library_threads(15)
