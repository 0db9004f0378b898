"""aiokvtier.metrics: Prometheus collectors read at scrape time, and the figures they need."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from aiokvtier import BlockStore, CopyEngine, DiskTier, DiskTierConfig, HostTier, HostTierConfig, StaticHostMem
from aiokvtier.metrics import DiskCollector, EngineCollector, StoreCollector, TierCollector

from .conftest import PopulateGate
from .helpers import KiB, MiB, eventually, small_config

try:  # imported here, not on the event loop: importing torch does blocking file I/O
    import torch as _torch
except ImportError:  # pragma: no cover - the GPU machine has torch
    _torch = None

SLOT = 64 * KiB


def _scrape(registry: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample as ``{(sample name, labels): value}``, through the text format a server sees."""
    text = generate_latest(registry).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in samples, f"{key} exported twice"
            samples[key] = sample.value
    return samples


def _types(registry: CollectorRegistry) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(generate_latest(registry).decode())}


def test_import_needs_no_prometheus_and_says_what_to_install() -> None:
    code = "import sys, aiokvtier; assert 'prometheus_client' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "try:\n    import aiokvtier.metrics\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert "pip install 'aiokvtier[metrics]'" in out


async def test_scrape_matches_statistics() -> None:
    registry = CollectorRegistry()
    async with (
        HostTier(small_config()) as tier,
        CopyEngine(None) as engine,
        BlockStore(tier, engine=None) as store,
        StaticHostMem(4 * SLOT) as stage,
    ):
        registry.register(TierCollector(tier))
        registry.register(StoreCollector(store, name="kv"))
        registry.register(EngineCollector(engine, name="host"))
        await tier.wait_resident()
        pages = np.random.default_rng(0).integers(0, 256, (4, SLOT), dtype=np.uint8)
        await store.store([b"a", b"b", b"c"], pages[:3])
        assert (await store.store([b"a"], pages[:1])).present == (b"a",)
        assert store.lookup([b"a", b"b", b"x"]) == 2
        await store.load([b"a"], np.zeros((1, SLOT), np.uint8))
        store.discard([b"c"])
        slots = await tier.allocate(4)
        await engine.to_host(tier, slots, pages)
        await engine.to_device(tier, slots[:2], np.zeros((2, SLOT), np.uint8))
        await engine.copy([(stage.address, tier.address(slots[0]), SLOT)])

        samples = _scrape(registry)
        t, s, e = tier.statistics(), store.statistics(), engine.statistics()

    def value(name: str, **labels: str) -> float:
        return samples[(name, frozenset(labels.items()))]

    tier_figures = {
        "aiokvtier_tier_resident_bytes": t.resident_bytes,
        "aiokvtier_tier_target_bytes": t.target_bytes,
        "aiokvtier_tier_quota_bytes": t.quota,
        "aiokvtier_tier_max_quota_bytes": t.max_quota,
        "aiokvtier_tier_registered_bytes": t.registered_bytes,
        "aiokvtier_tier_slots_allocated": t.slots_allocated,
        "aiokvtier_tier_slots_free": t.slots_free,
        "aiokvtier_tier_filling": 0,
        "aiokvtier_tier_fill_seconds": t.fill_seconds,
        "aiokvtier_tier_fill_rate_bytes_per_second": t.resident_bytes / t.fill_seconds,
        "aiokvtier_tier_fill_errors": 0,
        "aiokvtier_tier_allocation_waits_total": 0,
        "aiokvtier_tier_allocation_wait_seconds_total": 0,
    }
    for name, expected in tier_figures.items():
        assert value(name, tier="default") == pytest.approx(expected), name
    assert t.slots_allocated == 3 - 1 + 4 and t.resident_bytes == 64 * MiB

    store_figures = {
        "aiokvtier_store_blocks": (s.blocks, 2),
        "aiokvtier_store_capacity_blocks": (s.capacity, 1024),
        "aiokvtier_store_pinned_blocks": (s.blocks_pinned, 0),
        "aiokvtier_store_calls_in_flight": (s.in_flight, 0),
        "aiokvtier_store_event_subscribers": (s.subscribers, 0),
        "aiokvtier_store_present_total": (s.present, 1),
        "aiokvtier_store_queries_total": (s.queries, 1),
        "aiokvtier_store_hits_total": (s.hits, 2),
        "aiokvtier_store_misses_total": (s.misses, 1),
        "aiokvtier_store_stores_total": (s.stores, 3),
        "aiokvtier_store_skipped_total": (s.skipped, 0),
        "aiokvtier_store_evictions_total": (s.evictions, 0),
        "aiokvtier_store_discards_total": (s.discards, 1),
        "aiokvtier_store_loads_total": (s.loads, 1),
        "aiokvtier_store_stored_bytes_total": (s.bytes_stored, 3 * SLOT),
        "aiokvtier_store_loaded_bytes_total": (s.bytes_loaded, SLOT),
    }
    for name, (figure, expected) in store_figures.items():
        assert value(name, store="kv") == figure == expected, name

    per_direction = {"d2h": (1, 4 * SLOT), "h2d": (1, 2 * SLOT), "any": (1, SLOT)}
    assert e.jobs_by_direction == {d: jobs for d, (jobs, _) in per_direction.items()}
    assert e.bytes_by_direction == {d: nbytes for d, (_, nbytes) in per_direction.items()}
    assert sum(e.bytes_by_direction.values()) == e.bytes_copied
    for direction, (jobs, nbytes) in per_direction.items():
        assert value("aiokvtier_copy_batches_total", engine="host", direction=direction) == jobs
        assert value("aiokvtier_copy_bytes_total", engine="host", direction=direction) == nbytes

    assert value("aiokvtier_copy_batches_in_flight", engine="host") == 0
    assert value("aiokvtier_copy_descriptors_total", engine="host") == e.descriptors_submitted > 0
    assert value("aiokvtier_copy_driver_calls_total", engine="host") == e.driver_calls >= 3
    assert e.latency_count == e.jobs_completed == 3
    assert e.latency_buckets[-1] == (math.inf, 3)
    assert [c for _, c in e.latency_buckets] == sorted(c for _, c in e.latency_buckets)
    assert value("aiokvtier_copy_latency_seconds_count", engine="host") == 3
    assert value("aiokvtier_copy_latency_seconds_sum", engine="host") == pytest.approx(e.latency_sum_seconds)
    assert e.latency_sum_seconds > 0
    for bound, count in e.latency_buckets:
        le = "+Inf" if math.isinf(bound) else repr(bound)
        assert value("aiokvtier_copy_latency_seconds_bucket", engine="host", le=le) == count
    assert len(e.latency_buckets) == 12 and e.latency_buckets[0][0] == 0.0001

    types = _types(registry)
    assert types["aiokvtier_tier_resident_bytes"] == "gauge"
    assert types["aiokvtier_tier_allocation_waits"] == "counter"
    assert types["aiokvtier_store_hits"] == "counter"
    assert types["aiokvtier_copy_latency_seconds"] == "histogram"
    assert all(name.startswith("aiokvtier_") for name in types)


async def test_allocation_waits_are_counted(gate: PopulateGate) -> None:
    registry = CollectorRegistry()
    async with HostTier(small_config()) as tier:
        registry.register(TierCollector(tier, name="t0"))
        task = asyncio.create_task(tier.allocate())
        await asyncio.sleep(0.02)
        assert not task.done()
        samples = _scrape(registry)
        assert samples[("aiokvtier_tier_filling", frozenset({("tier", "t0")}))] == 1
        assert samples[("aiokvtier_tier_allocation_waits_total", frozenset({("tier", "t0")}))] == 0
        gate.allow(1)
        assert await task == 0
        await tier.allocate(15)  # the rest of unit 0: resident, no wait
        stats = tier.statistics()
        assert stats.allocation_waits == 1 and stats.allocation_wait_seconds > 0
        many = asyncio.create_task(tier.allocate(32))
        await asyncio.sleep(0.01)
        gate.release_all()
        await many
        stats = tier.statistics()
        assert stats.allocation_waits == 2
        samples = _scrape(registry)
        assert samples[("aiokvtier_tier_allocation_waits_total", frozenset({("tier", "t0")}))] == 2
        assert samples[("aiokvtier_tier_allocation_wait_seconds_total", frozenset({("tier", "t0")}))] == pytest.approx(
            stats.allocation_wait_seconds
        )


async def test_a_cancelled_wait_is_counted(gate: PopulateGate) -> None:
    async with HostTier(small_config()) as tier:
        task = asyncio.create_task(tier.allocate())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert tier.statistics().allocation_waits == 1
        gate.release_all()


async def test_closed_and_unopened_objects_scrape() -> None:
    registry = CollectorRegistry()
    unopened = HostTier(small_config())
    collector = TierCollector(unopened, name="later")
    registry.register(collector)
    assert not [k for k in _scrape(registry) if k[0].startswith("aiokvtier_tier_")]  # nothing until open

    async with HostTier(small_config()) as tier, CopyEngine(None) as engine, BlockStore(tier, engine=None) as store:
        collector.add(tier, name="open")
        registry.register(StoreCollector(store, name="kv"))
        registry.register(EngineCollector(engine, name="host"))
        await store.store([1], np.ones((1, SLOT), np.uint8))
    assert tier.closed
    samples = _scrape(registry)
    assert samples[("aiokvtier_tier_quota_bytes", frozenset({("tier", "open")}))] == 64 * MiB
    assert samples[("aiokvtier_tier_filling", frozenset({("tier", "open")}))] == 0
    assert samples[("aiokvtier_store_stores_total", frozenset({("store", "kv")}))] == 1
    assert samples[("aiokvtier_copy_latency_seconds_count", frozenset({("engine", "host")}))] == 0
    assert not [k for k in samples if ("tier", "later") in k[1]]


async def test_one_collector_per_kind_and_distinct_names() -> None:
    async with HostTier(small_config()) as a, HostTier(small_config()) as b:
        registry = CollectorRegistry()
        collector = TierCollector(a, name="a")
        registry.register(collector)
        with pytest.raises(ValueError, match="Duplicated"):
            registry.register(TierCollector(b, name="b"))  # the metric names would clash in the text format
        collector.add(b, name="b")
        with pytest.raises(ValueError, match="already"):
            collector.add(b, name="b")
        with pytest.raises(ValueError, match="empty"):
            collector.add(b, name="")
        samples = _scrape(registry)
        assert {dict(k[1])["tier"] for k in samples if k[0] == "aiokvtier_tier_quota_bytes"} == {"a", "b"}
        assert repr(collector) == "<TierCollector [a, b]>"


@pytest.mark.cuda
async def test_engine_collector_counts_gpu_copies_by_direction() -> None:
    if _torch is None or not _torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch")
    torch = _torch
    registry = CollectorRegistry()
    config = HostTierConfig(quota=64 * MiB, max_quota=64 * MiB, slot_size=SLOT, device=0, backing="vmm")
    async with HostTier(config) as tier, CopyEngine(0) as engine, BlockStore(tier, engine) as store:
        registry.register(EngineCollector(engine, name="gpu0"))
        registry.register(StoreCollector(store, name="kv"))
        g = torch.Generator(device="cuda").manual_seed(5)
        src = torch.randint(0, 256, (8, SLOT), dtype=torch.uint8, device="cuda", generator=g)
        slots = await tier.allocate(8)
        await engine.to_host(tier, slots, src, after=torch.cuda.current_stream())  # d2h: 8 pages
        back = torch.zeros((3, SLOT), dtype=torch.uint8, device="cuda")
        await engine.to_device(tier, slots[2:5], back)  # h2d: 3 pages
        assert torch.equal(back, src[2:5])
        half = torch.zeros(SLOT // 2, dtype=torch.uint8, device="cuda")
        await engine.copy([(half.data_ptr(), tier.address(slots[7]), SLOT // 2)])  # raw: half a page
        assert torch.equal(half, src[7, : SLOT // 2])
        samples = _scrape(registry)

        def value(name: str, **labels: str) -> float:
            return samples[(name, frozenset(labels.items()))]

        expected = {"d2h": (1, 8 * SLOT), "h2d": (1, 3 * SLOT), "any": (1, SLOT // 2)}
        for direction, (batches, nbytes) in expected.items():
            assert value("aiokvtier_copy_batches_total", engine="gpu0", direction=direction) == batches, direction
            assert value("aiokvtier_copy_bytes_total", engine="gpu0", direction=direction) == nbytes, direction
        e = engine.statistics()
        assert e.batch_abi in (13000, 12080) and e.bytes_copied == sum(e.bytes_by_direction.values())
        assert value("aiokvtier_copy_latency_seconds_count", engine="gpu0") == 3 == e.jobs_completed
        assert value("aiokvtier_copy_batches_in_flight", engine="gpu0") == 0
        assert value("aiokvtier_copy_driver_calls_total", engine="gpu0") == e.driver_calls >= 3

        # Through the store: an offload is d2h, an onboard h2d, each one batch more.
        pages = torch.randint(0, 256, (4, SLOT), dtype=torch.uint8, device="cuda", generator=g)
        result = await store.store([1, 2, 3, 4], pages, after=torch.cuda.current_stream())
        assert result.stored == (1, 2, 3, 4)
        out = torch.zeros((2, SLOT), dtype=torch.uint8, device="cuda")
        await store.load([3, 4], out, after=torch.cuda.current_stream())
        assert torch.equal(out, pages[2:])
        samples = _scrape(registry)
        assert value("aiokvtier_copy_bytes_total", engine="gpu0", direction="d2h") == 12 * SLOT
        assert value("aiokvtier_copy_bytes_total", engine="gpu0", direction="h2d") == 5 * SLOT
        assert value("aiokvtier_copy_batches_total", engine="gpu0", direction="d2h") == 2
        assert value("aiokvtier_copy_batches_total", engine="gpu0", direction="h2d") == 2
        assert value("aiokvtier_store_stored_bytes_total", store="kv") == 4 * SLOT
        assert value("aiokvtier_store_loaded_bytes_total", store="kv") == 2 * SLOT
        tier.free_many(slots)


async def test_disk_collector_and_the_store_disk_counters_match_statistics(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    config = await asyncio.to_thread(DiskTierConfig, quota=64 * SLOT, path=tmp_path)
    async with (
        HostTier(small_config(slot_size=SLOT)) as tier,
        DiskTier(config, block_size=SLOT, fingerprint="m") as disk,
        BlockStore(tier, disk=disk, admit_after=1) as store,
    ):
        registry.register(DiskCollector(disk, name="nvme0"))
        registry.register(StoreCollector(store, name="kv"))
        await tier.wait_resident()
        pages = np.random.default_rng(1).integers(0, 256, (3, SLOT), dtype=np.uint8)
        await store.store([b"a", b"b", b"c"], pages)
        await store.load([b"a", b"b"], np.zeros((2, SLOT), np.uint8))
        await eventually(lambda: store.statistics().written_back == 2)
        d, s = disk.statistics(), store.statistics()

        def value(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(name, labels)

        assert value("aiokvtier_disk_blocks", disk="nvme0") == d.blocks == 2
        assert value("aiokvtier_disk_written_bytes_total", disk="nvme0") == d.bytes_written == 2 * SLOT
        assert value("aiokvtier_disk_direct_io", disk="nvme0") == int(d.direct_io)
        assert value("aiokvtier_disk_free_bytes", disk="nvme0") == d.free_disk_bytes
        assert value("aiokvtier_store_written_back_total", store="kv") == s.written_back == 2
        assert value("aiokvtier_store_promoted_total", store="kv") == 0


class _Snapshot:
    """Something whose ``statistics()`` a collector scrapes: a Mooncake tier's figures without a cluster."""

    def __init__(self, statistics: object) -> None:
        self._statistics = statistics

    def statistics(self) -> object:
        return self._statistics


def _metrics_the_guide_names() -> set[str]:
    """The families docs/guide.md's table lists: each row names its first whole, the others by their
    suffix after the first's prefix (``aiokvtier_store_blocks``, ``_capacity_blocks``)."""
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "guide.md").read_text()
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    named = set()
    for row in section.splitlines():
        if not row.startswith("| `aiokvtier_"):
            continue
        names = re.findall(r"`(aiokvtier_\w+|_\w+)(?:\{\w+\})?`", row.split(" | ")[0])
        prefix = re.match(r"aiokvtier_[a-z]+", names[0]).group(0)  # type: ignore[union-attr]
        named |= {name if name.startswith("aiokvtier_") else prefix + name for name in names}
    return named


async def test_the_guide_names_every_metric(tmp_path: Path) -> None:
    """docs/guide.md's table lists each family the collectors export (it missed the store's counters of
    the tiers below, and the disk and Mooncake collectors), and none they do not."""
    import dataclasses

    from aiokvtier import MooncakeStatistics, PoolStatistics
    from aiokvtier.metrics import MooncakeCollector, PoolCollector

    named = await asyncio.to_thread(_metrics_the_guide_names)
    mooncake = MooncakeStatistics(**{f.name: 0 for f in dataclasses.fields(MooncakeStatistics)})
    pool = PoolStatistics(**{f.name: 0 for f in dataclasses.fields(PoolStatistics)})
    registry = CollectorRegistry()
    config = await asyncio.to_thread(DiskTierConfig, quota=64 * SLOT, path=tmp_path)
    async with (
        HostTier(small_config(slot_size=SLOT)) as tier,
        DiskTier(config, block_size=SLOT, fingerprint="m") as disk,
        BlockStore(tier, disk=disk) as store,
        CopyEngine(None) as engine,
    ):
        registry.register(TierCollector(tier))
        registry.register(StoreCollector(store))
        registry.register(EngineCollector(engine))
        registry.register(DiskCollector(disk))
        registry.register(MooncakeCollector(_Snapshot(mooncake)))  # type: ignore[arg-type]
        registry.register(PoolCollector(_Snapshot(pool)))  # type: ignore[arg-type]
        exported = {
            f.name + ("_total" if f.type == "counter" else "")
            for f in text_string_to_metric_families(generate_latest(registry).decode())
        }
    assert {name.split("_")[1] for name in exported} == {"tier", "store", "copy", "disk", "mooncake", "pool"}
    assert not exported - named, sorted(exported - named)
    assert not named - exported, sorted(named - exported)


async def test_pool_collector_exports_the_shared_store_beside_the_pools_tier() -> None:
    import tempfile

    from aiokvtier import AttachedPool, Pool
    from aiokvtier.metrics import PoolCollector

    directory = await asyncio.to_thread(tempfile.mkdtemp, prefix="akm", dir="/tmp")
    path = f"{directory}/pool.sock"
    registry = CollectorRegistry()
    try:
        async with Pool(small_config(slot_size=SLOT), path) as pool, AttachedPool(path) as attached:
            registry.register(TierCollector(pool.tier))
            registry.register(PoolCollector(pool, name="shared"))
            await attached.store([b"a", b"b"], [bytes(SLOT), bytes(SLOT)])
            s = pool.statistics()

            def value(name: str, **labels: str) -> float | None:
                return registry.get_sample_value(name, labels)

            assert value("aiokvtier_pool_blocks", pool="shared") == s.blocks == 2
            assert value("aiokvtier_pool_clients", pool="shared") == 1
            assert value("aiokvtier_pool_stores_total", pool="shared") == s.stores == 2
            assert value("aiokvtier_pool_stored_bytes_total", pool="shared") == 2 * SLOT
            assert value("aiokvtier_tier_quota_bytes", tier="default") == s.tier.quota
    finally:
        for name in await asyncio.to_thread(os.listdir, directory):
            await asyncio.to_thread(os.unlink, f"{directory}/{name}")
        await asyncio.to_thread(os.rmdir, directory)
