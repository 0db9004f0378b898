"""``statistics()`` of every object (and ``collect()`` of every collector) read from a thread in a tight
loop while the loop stores, loads, discards, evicts, copies, resizes, cancels and closes: each snapshot
is one moment (its figures add up, its counters never go back), the reader gets no error the docs do
not name, and a closed object still answers with its last figures."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from aiokvtier import (
    AttachedPool,
    BlockNotFound,
    BlockStore,
    CopyEngine,
    CopyStatistics,
    DiskStatistics,
    DiskTier,
    DiskTierConfig,
    HostTier,
    OutOfSlots,
    Pool,
    PoolStatistics,
    StoreStatistics,
    TierClosedError,
    TierStatistics,
)
from aiokvtier.metrics import DiskCollector, EngineCollector, PoolCollector, StoreCollector, TierCollector

from .helpers import KiB, MiB, small_config

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("tiny_switch_interval")]

WAIT = 30.0
"""Seconds any one step may take before the test fails (instead of hanging)."""
SLOT = 64 * KiB


async def bounded(aw: Any) -> Any:
    return await asyncio.wait_for(aw, WAIT)


# -- what no moment of each object had -----------------------------------------------------------------


def _backwards(before: Any, after: Any, counters: tuple[str, ...]) -> list[str]:
    return [
        f"{name} went back from {getattr(before, name)} to {getattr(after, name)}"
        for name in counters
        if getattr(after, name) < getattr(before, name)
    ]


def tier_wrong(before: TierStatistics | None, s: TierStatistics) -> list[str]:
    wrong = []
    if s.slots_allocated + s.slots_free != s.slots_total:
        wrong.append(f"{s.slots_allocated} allocated + {s.slots_free} free != {s.slots_total} slots")
    if s.quota != s.slots_total * s.slot_size:
        wrong.append(f"quota {s.quota} does not hold {s.slots_total} slots of {s.slot_size}")
    if not 0 <= s.slots_allocated <= s.slots_total:
        wrong.append(f"{s.slots_allocated} slots allocated of {s.slots_total}")
    if not 0 <= s.resident_bytes <= s.max_quota or not 0 <= s.target_bytes <= s.max_quota:
        wrong.append(f"resident {s.resident_bytes} / target {s.target_bytes} past the range of {s.max_quota}")
    if s.fill_seconds < 0:
        wrong.append(f"fill_seconds {s.fill_seconds} below zero")
    if s.stranded_bytes < 0 or s.views_exported < 0:
        wrong.append(f"stranded {s.stranded_bytes}, views {s.views_exported}")
    if before is not None:
        wrong += _backwards(before, s, ("allocation_waits", "allocation_wait_seconds", "huge_page_units"))
    return wrong


def _counters(cls: type, gauges: set[str]) -> tuple[str, ...]:
    """The int fields of a statistics dataclass that only grow: all but the ``gauges``."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.type in ("int", int) and f.name not in gauges)


_STORE_COUNTERS = _counters(StoreStatistics, {"blocks", "capacity", "blocks_pinned", "in_flight", "subscribers"})


def store_wrong(before: StoreStatistics | None, s: StoreStatistics) -> list[str]:
    wrong = []
    if not 0 <= s.blocks <= s.capacity:
        wrong.append(f"{s.blocks} blocks in a capacity of {s.capacity}")
    if s.blocks_pinned < 0 or s.in_flight < 0 or s.subscribers < 0:
        wrong.append(f"pinned {s.blocks_pinned}, in flight {s.in_flight}, subscribers {s.subscribers}")
    # Every page here is a whole slot: the bytes follow the blocks.
    if s.bytes_stored != s.stores * SLOT or s.bytes_loaded != s.loads * SLOT:
        wrong.append(f"{s.stores} stores of {s.bytes_stored} bytes, {s.loads} loads of {s.bytes_loaded} bytes")
    if before is not None:
        wrong += _backwards(before, s, _STORE_COUNTERS)
    return wrong


def engine_wrong(before: CopyStatistics | None, s: CopyStatistics) -> list[str]:
    wrong = []
    if not s.latency_count <= s.jobs_completed <= s.jobs_submitted:
        wrong.append(f"{s.latency_count} timed, {s.jobs_completed} completed of {s.jobs_submitted} submitted")
    if sum(s.jobs_by_direction.values()) != s.jobs_submitted:
        wrong.append(f"jobs by direction {s.jobs_by_direction} do not add up to {s.jobs_submitted}")
    if sum(s.bytes_by_direction.values()) != s.bytes_copied:
        wrong.append(f"bytes by direction {s.bytes_by_direction} do not add up to {s.bytes_copied}")
    counts = [count for _, count in s.latency_buckets]
    if counts != sorted(counts) or counts[-1] != s.latency_count:
        wrong.append(f"latency buckets {counts} not cumulative up to {s.latency_count}")
    if before is not None:
        wrong += _backwards(
            before,
            s,
            ("jobs_submitted", "jobs_completed", "copies_requested", "descriptors_submitted", "bytes_copied"),
        )
        wrong += _backwards(before, s, ("latency_count", "latency_sum_seconds", "driver_calls"))
    return wrong


_DISK_COUNTERS = (
    "hits",
    "misses",
    "bytes_read",
    "bytes_written",
    "writes_skipped",
    "evictions",
    "write_errors",
    "read_errors",
    "checksum_failures",
)


def disk_wrong(before: DiskStatistics | None, s: DiskStatistics) -> list[str]:
    wrong = []
    if s.blocks < 0 or s.free < 0 or s.blocks + s.free > s.capacity:
        wrong.append(f"{s.blocks} blocks + {s.free} free past a capacity of {s.capacity}")
    # Every block here is written whole: the bytes follow the blocks.
    if s.bytes_stored != s.blocks * s.block_size:
        wrong.append(f"{s.blocks} blocks of {s.block_size} hold {s.bytes_stored} bytes")
    if s.bytes_read != s.hits * s.block_size:
        wrong.append(f"{s.hits} hits read {s.bytes_read} bytes")
    if s.queue_depth < 0:
        wrong.append(f"queue depth {s.queue_depth}")
    if before is not None:
        wrong += _backwards(before, s, _DISK_COUNTERS)
    return wrong


_POOL_GAUGES = {"owner_pid", "clients", "slots_attached", "blocks", "blocks_pinned", "claims"}
_POOL_COUNTERS = _counters(PoolStatistics, _POOL_GAUGES)


def pool_wrong(before: PoolStatistics | None, s: PoolStatistics) -> list[str]:
    wrong = tier_wrong(None if before is None else before.tier, s.tier)
    if not 0 <= s.blocks <= s.tier.slots_total:
        wrong.append(f"{s.blocks} blocks in {s.tier.slots_total} slots")
    if s.clients < 0 or s.slots_attached < 0 or s.claims < 0 or s.blocks_pinned < 0:
        wrong.append(f"clients {s.clients}, attached {s.slots_attached}, claims {s.claims}, pinned {s.blocks_pinned}")
    if s.slots_attached + s.blocks > s.tier.slots_allocated:
        wrong.append(f"{s.slots_attached} attached + {s.blocks} blocks > {s.tier.slots_allocated} allocated")
    if before is not None:
        wrong += _backwards(before, s, _POOL_COUNTERS)
    return wrong


# -- the reader ------------------------------------------------------------------------------------------


class Reader:
    """A thread that calls ``read()`` (and scrapes ``registry``) until stopped, checking every answer.

    ``not_yet``: the TierClosedError an object not open yet raises (the docs allow it before the open);
    once an answer came, every read must answer.
    """

    def __init__(
        self,
        read: Callable[[], Any],
        wrong: Callable[[Any, Any], list[str]],
        registry: CollectorRegistry | None = None,
        *,
        not_yet: bool = False,
    ) -> None:
        self._read, self._wrong, self._registry, self._not_yet = read, wrong, registry, not_yet
        self.answers = 0
        self.scrapes: list[bytes] = []
        self.torn: list[str] = []
        self.errors: list[BaseException] = []
        self.last: Any = None
        self._running = threading.Event()
        self._thread = threading.Thread(target=self._run, name="statistics-reader", daemon=True)

    def _run(self) -> None:
        before = None
        while self._running.is_set():
            try:
                s = self._read()
            except TierClosedError as exc:
                if not (self._not_yet and before is None):
                    self.errors.append(exc)
                continue
            except BaseException as exc:
                self.errors.append(exc)
                return
            self.answers += 1
            self.torn += self._wrong(before, s)
            before = self.last = s
            if self._registry is not None:
                try:
                    self.scrapes.append(generate_latest(self._registry))
                except BaseException as exc:
                    self.errors.append(exc)
                    return
                del self.scrapes[:-2]

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Reader]:
        self._running.set()
        self._thread.start()
        try:
            yield self
        finally:
            self._running.clear()
            await asyncio.to_thread(self._thread.join, WAIT)
            assert not self._thread.is_alive(), "the reader never returned"

    def check(self) -> None:
        assert not self.errors, self.errors[:3]
        assert not self.torn, sorted(set(self.torn))[:5]
        assert self.answers > 0


def registry_of(*collectors: Any) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    for collector in collectors:
        registry.register(collector)
    return registry


def pages(keys: list[int]) -> np.ndarray:
    out = np.empty((len(keys), SLOT), dtype=np.uint8)
    for row, k in zip(out, keys, strict=True):
        row[:] = k % 251
    return out


async def cancel_soon(aw: Any, after: float = 0.0) -> None:
    """Start ``aw``, cancel it ``after`` seconds on (or let it end first), and wait for it."""
    task = asyncio.ensure_future(aw)
    await asyncio.sleep(after)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await bounded(task)


# -- HostTier ------------------------------------------------------------------------------------------


async def test_tier_statistics_and_scrape_from_a_thread_through_fills_resizes_cancels_and_close() -> None:
    cfg = small_config(quota=32 * MiB, max_quota=128 * MiB, slot_size=SLOT)
    tier = HostTier(cfg)
    reader = Reader(tier.statistics, tier_wrong, registry_of(TierCollector(tier)), not_yet=True)
    async with reader.running():
        await bounded(tier.__aenter__())
        try:
            for round in range(12):
                ids = await bounded(tier.allocate_ids(16))
                # Resizes one after another, the fill never given time to finish: grow, shrink, grow.
                await bounded(tier.resize((128 if round % 2 else 48) * MiB))
                waiter = asyncio.ensure_future(tier.allocate_ids(tier.slots_total - 16))
                await cancel_soon(tier.resize((96 if round % 2 else 32) * MiB), after=0.001 * (round % 3))
                await cancel_soon(waiter)
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    tier.free_many(waiter.result())
                tier.free_many(ids)
            closing = asyncio.ensure_future(tier.aclose())
            await asyncio.sleep(0)
            await bounded(closing)
            await asyncio.sleep(0.02)  # the reader reads the closed tier a while
        finally:
            await bounded(tier.aclose())
    reader.check()
    assert reader.last.closed and tier.statistics().closed
    assert b"aiokvtier_tier_quota_bytes" in reader.scrapes[-1]


# -- BlockStore (host-only, and with a host-only engine) and CopyEngine(None) ------------------------------


async def churn_store(store: BlockStore, tier: HostTier) -> None:
    """Stores past the capacity (evictions), loads, discards, a resize down and up with blocks stored,
    cancelled stores and loads."""
    rng = np.random.default_rng(7)
    dst = np.zeros((16, SLOT), dtype=np.uint8)
    for round in range(10):
        keys = [int(k) for k in rng.choice(200, 16, replace=False)]
        await bounded(store.store(keys, pages(keys)))
        held = [k for k in keys if store.lookup([k])][:16]
        if held:
            await bounded(store.load(held, dst[: len(held)]))
        store.discard(keys[:3])
        more = [int(k) for k in rng.choice(400, 16, replace=False)]
        await cancel_soon(store.store(more, pages(more)), after=0.0005 * (round % 3))
        stored = [k for k in more if store.lookup([k])][:8]
        if stored:
            await cancel_soon(store.load(stored, dst[: len(stored)]))
        await bounded(store.resize((2 if round % 2 else 6) * MiB))
    await bounded(store.resize(4 * MiB))


@pytest.mark.parametrize("with_engine", [False, True], ids=["host-only", "engine"])
async def test_store_statistics_and_scrape_from_a_thread_through_churn_and_close(with_engine: bool) -> None:
    cfg = small_config(quota=4 * MiB, max_quota=8 * MiB, slot_size=SLOT)
    async with contextlib.AsyncExitStack() as stack:
        engine = await stack.enter_async_context(CopyEngine(None)) if with_engine else None
        tier = await stack.enter_async_context(HostTier(cfg))
        store = BlockStore(tier, engine)
        collectors: list[Any] = [StoreCollector(store), TierCollector(tier)]
        if engine is not None:
            collectors.append(EngineCollector(engine))
        reader = Reader(store.statistics, store_wrong, registry_of(*collectors))
        engine_reader = None if engine is None else Reader(engine.statistics, engine_wrong)
        await bounded(store.__aenter__())
        try:
            async with reader.running(), contextlib.AsyncExitStack() as readers:
                if engine_reader is not None:
                    await readers.enter_async_context(engine_reader.running())
                await churn_store(store, tier)
                keys = list(range(1000, 1040))
                storing = asyncio.ensure_future(store.store(keys, pages(keys)))
                await asyncio.sleep(0)
                await bounded(asyncio.gather(store.aclose(), storing, return_exceptions=True))
                await asyncio.sleep(0.02)
        finally:
            await bounded(store.aclose())
        reader.check()
        if engine_reader is not None:
            engine_reader.check()
            assert engine_reader.answers > 0
        final = store.statistics()
        assert final.evictions > 0 and final.discards > 0 and final.loads > 0
        assert not store_wrong(reader.last, final)
        assert b"aiokvtier_store_blocks" in reader.scrapes[-1]


async def test_engine_statistics_from_a_thread_through_copies_cancels_and_close() -> None:
    cfg = small_config(quota=16 * MiB, max_quota=16 * MiB, slot_size=SLOT)
    async with HostTier(cfg) as tier:
        engine = CopyEngine(None)
        reader = Reader(engine.statistics, engine_wrong, registry_of(EngineCollector(engine)))
        await bounded(engine.__aenter__())
        try:
            async with reader.running():
                await bounded(tier.wait_resident())
                ids = await bounded(tier.allocate_ids(64))
                buf = np.zeros((64, SLOT), dtype=np.uint8)
                for round in range(40):
                    n = 1 + round % 64
                    await bounded(engine.to_host(tier, ids[:n], buf[:n]))
                    await bounded(engine.to_device(tier, ids[:n], buf[:n]))
                    await cancel_soon(engine.to_device(tier, ids, buf))
                copying = asyncio.ensure_future(engine.to_device(tier, ids, buf))
                await asyncio.sleep(0)
                await bounded(asyncio.gather(engine.aclose(), copying, return_exceptions=True))
                await asyncio.sleep(0.02)
        finally:
            await bounded(engine.aclose())
        reader.check()
        assert engine.statistics().jobs_completed >= 80


# -- DiskTier --------------------------------------------------------------------------------------------


async def test_disk_statistics_and_scrape_from_a_thread_through_writes_reads_evictions_and_close(
    tmp_path: Path,
) -> None:
    src = np.frombuffer(os.urandom(32 * SLOT), dtype=np.uint8).reshape(32, SLOT).copy()
    dst = np.zeros_like(src)
    config = await asyncio.to_thread(DiskTierConfig, quota=24 * SLOT, path=tmp_path)
    disk = DiskTier(config, block_size=SLOT, fingerprint="stats")
    reader = Reader(disk.statistics, disk_wrong, registry_of(DiskCollector(disk)))
    addresses = [src.ctypes.data + i * SLOT for i in range(32)]
    back = [dst.ctypes.data + i * SLOT for i in range(32)]
    await bounded(disk.__aenter__())
    try:
        async with reader.running():
            for round in range(8):
                keys = [round * 32 + i for i in range(32)]  # past the capacity: evictions
                await bounded(disk.write(keys, addresses, [SLOT] * 32))
                await bounded(disk.read(keys[-8:], back[:8]))
                await cancel_soon(disk.write([k + 5000 for k in keys[:8]], addresses[:8], [SLOT] * 8))
                await cancel_soon(disk.read(keys[-16:], back[:16]))
                disk.discard(keys[-2:])
            writing = asyncio.ensure_future(disk.write(list(range(9000, 9016)), addresses[:16], [SLOT] * 16))
            await asyncio.sleep(0)
            await bounded(asyncio.gather(disk.aclose(), writing, return_exceptions=True))
            await asyncio.sleep(0.02)
    finally:
        await bounded(disk.aclose())
    reader.check()
    final = disk.statistics()
    assert final.evictions > 0 and final.hits > 0 and final.free_disk_bytes is None
    assert not disk_wrong(reader.last, final)


# -- Pool and AttachedPool ------------------------------------------------------------------------------


@pytest.fixture
def sock() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="aks", dir="/tmp")
    yield os.path.join(directory, "pool.sock")
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))
    os.rmdir(directory)


POOL = {"quota": "4MiB", "max_quota": "4MiB", "slot_size": "64KiB"}


async def pool_churn(a: AttachedPool, rounds: int) -> None:
    rng = np.random.default_rng(3)
    dst = np.zeros((16, SLOT), dtype=np.uint8)
    for round in range(rounds):
        keys = [int(k) for k in rng.choice(300, 16, replace=False)]
        await bounded(a.store(keys, pages(keys)))
        n = await bounded(a.lookup(keys))
        if n:
            with contextlib.suppress(BlockNotFound):  # the other process evicted one meanwhile
                await bounded(a.load(keys[:n], dst[:n]))
        await bounded(a.discard(keys[:2]))
        held = []
        with contextlib.suppress(OutOfSlots):  # blocks fill the tier and allocate evicts none
            held = await bounded(a.allocate(3))
        await cancel_soon(a.store([k + 1000 for k in keys], pages(keys)), after=0.0005 * (round % 3))
        await bounded(a.free_many(held))


async def test_pool_statistics_from_a_thread_while_processes_attach_store_load_and_leave(sock: str) -> None:
    """``Pool.statistics()`` from a thread while attached pools (and one that detaches each round) churn
    the shared store, then the pool closes under the reader."""
    pool = Pool(POOL, sock)
    reader = Reader(pool.statistics, pool_wrong, registry_of(PoolCollector(pool)), not_yet=True)
    async with reader.running():
        await bounded(pool.__aenter__())
        try:
            async with AttachedPool(sock) as a:
                for _ in range(4):
                    async with AttachedPool(sock) as b:
                        await bounded(asyncio.gather(pool_churn(a, 6), pool_churn(b, 6)))
            closing = asyncio.ensure_future(pool.aclose())
            await asyncio.sleep(0)
            await bounded(closing)
            await asyncio.sleep(0.02)
        finally:
            await bounded(pool.aclose())
    reader.check()
    assert reader.last.stores > 0 and reader.last.evictions > 0


async def test_attached_pool_statistics_asked_from_a_thread_through_its_loop(sock: str) -> None:
    """``AttachedPool.statistics()`` is a coroutine of its loop: a thread asks through
    ``run_coroutine_threadsafe`` while the loop churns, and gets one moment each time."""
    loop = asyncio.get_running_loop()
    async with Pool(POOL, sock), AttachedPool(sock) as a:

        def ask() -> PoolStatistics:
            result: PoolStatistics = asyncio.run_coroutine_threadsafe(a.statistics(), loop).result(WAIT)
            return result

        reader = Reader(ask, pool_wrong)
        async with reader.running():
            await pool_churn(a, 12)
        reader.check()
        assert reader.answers > 1 and reader.last.stores > 0


# -- every collector, while the objects open and close --------------------------------------------------


async def test_every_collector_scraped_from_a_thread_while_its_objects_open_and_close(
    tmp_path: Path, sock: str
) -> None:
    """Objects made but not open scrape as nothing; open ones scrape their figures; closed ones their
    last figures; the scrape never raises."""
    cfg = small_config(quota=4 * MiB, max_quota=4 * MiB, slot_size=SLOT)
    disk_config = await asyncio.to_thread(DiskTierConfig, quota=8 * SLOT, path=tmp_path)
    errors: list[BaseException] = []
    scrapes: list[bytes] = []
    registries: list[CollectorRegistry] = []
    running = threading.Event()
    running.set()

    def scrape() -> None:
        while running.is_set():
            for registry in list(registries):
                try:
                    scrapes.append(generate_latest(registry))
                except BaseException as exc:
                    errors.append(exc)
                    return
            del scrapes[:-4]

    thread = threading.Thread(target=scrape, name="scraper", daemon=True)
    thread.start()
    try:
        for round in range(5):
            engine = CopyEngine(None)
            tier = HostTier(cfg)
            store = BlockStore(tier, engine)
            disk = DiskTier(disk_config, block_size=SLOT, fingerprint=f"r{round}")
            pool = Pool(POOL, sock)
            registry = registry_of(
                TierCollector(tier),
                StoreCollector(store),
                EngineCollector(engine),
                DiskCollector(disk),
                PoolCollector(pool),
            )
            registries[:] = [registry]
            await asyncio.sleep(0.005)  # scraped unopened
            async with engine, tier, store, disk, pool:
                await bounded(store.store([1, 2, 3], pages([1, 2, 3])))
                await bounded(disk.write([1], [tier.address(0)], [SLOT]))
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.005)  # scraped closed
    finally:
        running.clear()
        await asyncio.to_thread(thread.join, WAIT)
    assert not thread.is_alive()
    assert not errors, errors[:3]
    last = b"".join(scrapes)
    assert b'aiokvtier_store_stores_total{store="default"} 3.0' in last
    assert b'aiokvtier_pool_clients{pool="default"} 0.0' in last


def test_statistics_dataclasses_are_frozen_snapshots() -> None:
    """What a reader holds does not change under it: every statistics class is frozen."""
    for cls in (TierStatistics, StoreStatistics, CopyStatistics, DiskStatistics, PoolStatistics):
        params = getattr(cls, "__dataclass_params__", None)
        assert params is not None and params.frozen, cls
        assert dataclasses.is_dataclass(cls)
