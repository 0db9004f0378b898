"""Prometheus collectors for tiers, block stores and copy engines.

Needs the ``metrics`` extra (``pip install 'aiokvtier[metrics]'``). Each
collector reads ``statistics()`` of the objects it was given when Prometheus
scrapes, so nothing is counted twice and nothing runs between scrapes:

    from prometheus_client import REGISTRY
    from aiokvtier.metrics import (
        DiskCollector, EngineCollector, MooncakeCollector, PoolCollector, StoreCollector, TierCollector
    )

    REGISTRY.register(TierCollector(tier))
    REGISTRY.register(StoreCollector(store, name="kv"))
    REGISTRY.register(EngineCollector(engine, name="gpu0"))
    REGISTRY.register(DiskCollector(disk, name="nvme0"))
    REGISTRY.register(MooncakeCollector(remote, name="cluster"))
    REGISTRY.register(PoolCollector(pool, name="shared"))  # and TierCollector(pool.tier) for its tier

Every series carries the object's name as the label ``tier``, ``store``,
``engine``, ``disk``, ``mooncake`` or ``pool``. A registry takes one collector of each kind (the metric names
would clash otherwise); [``TierCollector.add()``][aiokvtier.metrics.TierCollector.add] puts more objects under
the same one. A closed object still scrapes (its last figures); a tier that
has not opened yet scrapes as nothing.

Threads: ``collect()`` runs on whichever thread scrapes; ``statistics()``
of each object may be called from any thread. ``add`` belongs to the thread
that set the collector up.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Generic, Protocol, TypeVar

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.metrics_core import Metric
except ImportError as exc:  # pragma: no cover - the test extra installs it
    raise ImportError("aiokvtier.metrics needs prometheus-client: pip install 'aiokvtier[metrics]'") from exc

from ._copy._engine import CopyEngine, CopyStatistics
from ._disk._tier import DiskStatistics, DiskTier
from ._errors import TierClosedError
from ._host._statistics import TierStatistics
from ._mooncake._tier import MooncakeStatistics, MooncakeTier
from ._pool._statistics import PoolStatistics
from ._store._store import BlockStore, StoreStatistics

__all__ = ["DiskCollector", "EngineCollector", "MooncakeCollector", "PoolCollector", "StoreCollector", "TierCollector"]


class _Snapshotting(Protocol):
    def statistics(self) -> Any: ...


_T = TypeVar("_T", bound=_Snapshotting)
_S = TypeVar("_S")
_R = TypeVar("_R", covariant=True)


class _Reporting(Protocol[_R]):
    """What a collector reads: an object whose ``statistics()`` returns its figures, from any thread."""

    def statistics(self) -> _R: ...


class _Collector(Generic[_T, _S]):
    _label: str

    def __init__(self, obj: _T, *, name: str = "default") -> None:
        self._objects: dict[str, _T] = {}
        self.add(obj, name=name)

    def add(self, obj: _T, *, name: str) -> None:
        """Export another object through this collector, labelled ``name``.

        :raises ValueError: ``name`` is empty or already in use here.
        :raises TypeError: ``name`` is not a str.
        """
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, not {type(name).__name__}")
        if not name:
            raise ValueError("name must not be empty")
        if name in self._objects:
            raise ValueError(f"a {self._label} named {name!r} is already exported by this collector")
        self._objects[name] = obj

    def describe(self) -> list[Metric]:
        """The metric families without samples: lets a registry refuse a clashing collector."""
        return self._families([])

    def collect(self) -> Iterator[Metric]:
        """The metric families, from each object's ``statistics()`` now."""
        snapshots = []
        for name, obj in list(self._objects.items()):
            try:
                snapshots.append((name, obj.statistics()))
            except TierClosedError:  # a tier that is not open yet (or whose open failed) has no figures
                continue
        yield from self._families(snapshots)

    def _families(self, snapshots: list[tuple[str, _S]]) -> list[Metric]:
        raise NotImplementedError

    def _gauge(self, name: str, doc: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=[self._label])

    def _counter(self, name: str, doc: str) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, labels=[self._label])

    def __repr__(self) -> str:
        return f"<{type(self).__name__} [{', '.join(self._objects)}]>"


_Figures = tuple[tuple[str, str, Any], ...]
"""(metric, help, figure): gauges or counters read straight off a snapshot."""


class _Tabled(_Collector[_T, _S]):
    """A collector whose families are its tables of gauges and counters."""

    _gauges: _Figures = ()
    _counters: _Figures = ()

    def _families(self, snapshots: list[tuple[str, _S]]) -> list[Metric]:
        families: list[Metric] = []
        for make, table in ((self._gauge, self._gauges), (self._counter, self._counters)):
            for metric, doc, figure in table:
                family = make(metric, doc)
                for name, s in snapshots:
                    family.add_metric([name], figure(s))
                families.append(family)
        return families


def _fill_rate(s: TierStatistics) -> float:
    return s.resident_bytes / s.fill_seconds if s.fill_seconds > 0 else 0.0


_TIER_GAUGES: _Figures = (
    ("aiokvtier_tier_resident_bytes", "Bytes resident as one contiguous prefix.", lambda s: s.resident_bytes),
    ("aiokvtier_tier_target_bytes", "Bytes the fill works towards.", lambda s: s.target_bytes),
    ("aiokvtier_tier_quota_bytes", "The tier's quota.", lambda s: s.quota),
    ("aiokvtier_tier_max_quota_bytes", "The reserved range (the largest quota).", lambda s: s.max_quota),
    ("aiokvtier_tier_registered_bytes", "Bytes registered with the GPU.", lambda s: s.registered_bytes),
    ("aiokvtier_tier_slots_allocated", "Slots allocated.", lambda s: s.slots_allocated),
    ("aiokvtier_tier_slots_free", "Slots of the quota free to allocate.", lambda s: s.slots_free),
    ("aiokvtier_tier_filling", "1 while the fill runs.", lambda s: int(s.filling)),
    ("aiokvtier_tier_fill_seconds", "Duration of the latest fill (so far, while filling).", lambda s: s.fill_seconds),
    (
        "aiokvtier_tier_fill_rate_bytes_per_second",
        "Resident bytes over the latest fill's duration.",
        _fill_rate,
    ),
    ("aiokvtier_tier_fill_errors", "1 while the fill has failed.", lambda s: int(s.fill_error is not None)),
)
_TIER_COUNTERS: _Figures = (
    ("aiokvtier_tier_allocation_waits", "allocate calls that waited for the fill.", lambda s: s.allocation_waits),
    (
        "aiokvtier_tier_allocation_wait_seconds",
        "Seconds allocate calls waited for the fill.",
        lambda s: s.allocation_wait_seconds,
    ),
)


class TierCollector(_Tabled[_Reporting[TierStatistics], TierStatistics]):
    """Exports a [``HostTier``][aiokvtier.HostTier]'s statistics, labelled ``tier=name`` (or those of
    anything whose ``statistics()`` returns ``TierStatistics``)."""

    _label = "tier"
    _gauges = _TIER_GAUGES
    _counters = _TIER_COUNTERS


_STORE_GAUGES: _Figures = (
    ("aiokvtier_store_blocks", "Visible blocks.", lambda s: s.blocks),
    ("aiokvtier_store_capacity_blocks", "Blocks the tier's slots can hold.", lambda s: s.capacity),
    ("aiokvtier_store_pinned_blocks", "Blocks a load is reading now.", lambda s: s.blocks_pinned),
    ("aiokvtier_store_calls_in_flight", "store and load calls running now.", lambda s: s.in_flight),
    ("aiokvtier_store_event_subscribers", "Event subscriptions alive.", lambda s: s.subscribers),
)
_STORE_COUNTERS: _Figures = (
    ("aiokvtier_store_queries", "lookup and lookup_remote calls that answered.", lambda s: s.queries),
    ("aiokvtier_store_hits", "Keys lookup matched (the stored prefix).", lambda s: s.hits),
    ("aiokvtier_store_misses", "Keys lookup was asked beyond the stored prefix.", lambda s: s.misses),
    ("aiokvtier_store_stores", "Blocks stored.", lambda s: s.stores),
    ("aiokvtier_store_present", "Keys a store found already stored (not copied again).", lambda s: s.present),
    ("aiokvtier_store_skipped", "Keys a store skipped (nothing left to evict).", lambda s: s.skipped),
    ("aiokvtier_store_evictions", "Blocks evicted.", lambda s: s.evictions),
    ("aiokvtier_store_discards", "Blocks discarded.", lambda s: s.discards),
    ("aiokvtier_store_loads", "Blocks loaded.", lambda s: s.loads),
    ("aiokvtier_store_stored_bytes", "Bytes stored.", lambda s: s.bytes_stored),
    ("aiokvtier_store_loaded_bytes", "Bytes loaded.", lambda s: s.bytes_loaded),
    ("aiokvtier_store_disk_hits", "Keys lookup found on the disk tier past the host prefix.", lambda s: s.disk_hits),
    ("aiokvtier_store_promoted", "Blocks load brought back from the disk tier.", lambda s: s.promoted),
    ("aiokvtier_store_written_back", "Blocks written back to the disk tier.", lambda s: s.written_back),
    (
        "aiokvtier_store_remote_hits",
        "Keys lookup_remote found only on the Mooncake tier past the local prefix.",
        lambda s: s.remote_hits,
    ),
    ("aiokvtier_store_remote_fetched", "Blocks load brought from the Mooncake tier.", lambda s: s.remote_fetched),
    ("aiokvtier_store_remote_written", "Blocks written to the Mooncake tier.", lambda s: s.remote_written),
)


class StoreCollector(_Tabled[BlockStore, StoreStatistics]):
    """Exports a [``BlockStore``][aiokvtier.BlockStore]'s statistics, labelled ``store=name``."""

    _label = "store"
    _gauges = _STORE_GAUGES
    _counters = _STORE_COUNTERS


_DISK_GAUGES: _Figures = (
    ("aiokvtier_disk_blocks", "Blocks on disk.", lambda s: s.blocks),
    ("aiokvtier_disk_capacity_blocks", "Blocks the disk quota holds.", lambda s: s.capacity),
    ("aiokvtier_disk_stored_bytes", "Bytes of the blocks on disk.", lambda s: s.bytes_stored),
    ("aiokvtier_disk_queue_depth", "I/O jobs queued or running.", lambda s: s.queue_depth),
    ("aiokvtier_disk_direct_io", "1: O_DIRECT; 0: buffered I/O.", lambda s: int(s.direct_io)),
    (
        "aiokvtier_disk_free_bytes",
        "Free space of the file system after the last write (NaN once closed).",
        lambda s: math.nan if s.free_disk_bytes is None else s.free_disk_bytes,
    ),
)
_DISK_COUNTERS: _Figures = (
    ("aiokvtier_disk_hits", "Blocks read back.", lambda s: s.hits),
    ("aiokvtier_disk_misses", "Keys asked of read that were absent or failed their checksum.", lambda s: s.misses),
    ("aiokvtier_disk_read_bytes", "Bytes read back.", lambda s: s.bytes_read),
    ("aiokvtier_disk_written_bytes", "Bytes written.", lambda s: s.bytes_written),
    ("aiokvtier_disk_writes_skipped", "Blocks write did not store.", lambda s: s.writes_skipped),
    ("aiokvtier_disk_evictions", "Blocks evicted from the disk tier.", lambda s: s.evictions),
    ("aiokvtier_disk_write_errors", "Writes the file system refused.", lambda s: s.write_errors),
    ("aiokvtier_disk_read_errors", "Reads that failed.", lambda s: s.read_errors),
    (
        "aiokvtier_disk_checksum_failures",
        "Blocks whose bytes did not match their checksum.",
        lambda s: s.checksum_failures,
    ),
)


class DiskCollector(_Tabled[DiskTier, DiskStatistics]):
    """Exports a [``DiskTier``][aiokvtier.DiskTier]'s statistics, labelled ``disk=name``."""

    _label = "disk"
    _gauges = _DISK_GAUGES
    _counters = _DISK_COUNTERS


_MOONCAKE_GAUGES: _Figures = (
    ("aiokvtier_mooncake_available", "1 while calls go to the cluster; 0 while skipped.", lambda s: int(s.available)),
    ("aiokvtier_mooncake_queue_depth", "Batch calls running now.", lambda s: s.queue_depth),
    (
        "aiokvtier_mooncake_held_calls",
        "Calls past their timeout, holding memory.",
        lambda s: s.held_calls,
    ),
    ("aiokvtier_mooncake_held_bytes", "Memory those calls hold.", lambda s: s.held_bytes),
    ("aiokvtier_mooncake_registered_bytes", "Memory registered for transfers.", lambda s: s.registered_bytes),
)
_MOONCAKE_COUNTERS: _Figures = (
    ("aiokvtier_mooncake_hits", "Blocks read.", lambda s: s.hits),
    ("aiokvtier_mooncake_misses", "Keys read did not fill.", lambda s: s.misses),
    ("aiokvtier_mooncake_read_bytes", "Bytes read.", lambda s: s.bytes_read),
    ("aiokvtier_mooncake_written_bytes", "Bytes written.", lambda s: s.bytes_written),
    ("aiokvtier_mooncake_writes_skipped", "Blocks write did not store.", lambda s: s.writes_skipped),
    ("aiokvtier_mooncake_errors", "Keys or calls that failed.", lambda s: s.errors),
    ("aiokvtier_mooncake_size_mismatches", "Gets of another size than expected.", lambda s: s.size_mismatches),
    ("aiokvtier_mooncake_timeouts", "Calls that did not return within the timeout.", lambda s: s.timeouts),
    ("aiokvtier_mooncake_reconnects", "Times the tier became available again.", lambda s: s.reconnects),
)


class MooncakeCollector(_Tabled[MooncakeTier, MooncakeStatistics]):
    """Exports a [``MooncakeTier``][aiokvtier.MooncakeTier]'s statistics, labelled ``mooncake=name``."""

    _label = "mooncake"
    _gauges = _MOONCAKE_GAUGES
    _counters = _MOONCAKE_COUNTERS


_POOL_GAUGES: _Figures = (
    ("aiokvtier_pool_clients", "Processes attached now.", lambda s: s.clients),
    ("aiokvtier_pool_slots_attached", "Slots attached processes hold through allocate.", lambda s: s.slots_attached),
    ("aiokvtier_pool_blocks", "Visible blocks of the shared store.", lambda s: s.blocks),
    ("aiokvtier_pool_pinned_blocks", "Blocks a load (in any process) is reading now.", lambda s: s.blocks_pinned),
    ("aiokvtier_pool_claims", "Stores in flight (claims not yet committed or aborted).", lambda s: s.claims),
)
_POOL_COUNTERS: _Figures = (
    ("aiokvtier_pool_queries", "Lookups that answered.", lambda s: s.queries),
    ("aiokvtier_pool_hits", "Keys lookups matched (the stored prefix).", lambda s: s.hits),
    ("aiokvtier_pool_misses", "Keys lookups were asked beyond the stored prefix.", lambda s: s.misses),
    ("aiokvtier_pool_stores", "Blocks stored.", lambda s: s.stores),
    ("aiokvtier_pool_present", "Keys a store found already stored.", lambda s: s.present),
    ("aiokvtier_pool_skipped", "Keys a store skipped (nothing left to evict).", lambda s: s.skipped),
    ("aiokvtier_pool_loads", "Blocks loaded.", lambda s: s.loads),
    ("aiokvtier_pool_evictions", "Blocks evicted.", lambda s: s.evictions),
    ("aiokvtier_pool_discards", "Blocks discarded.", lambda s: s.discards),
    ("aiokvtier_pool_stored_bytes", "Bytes stored.", lambda s: s.bytes_stored),
    ("aiokvtier_pool_loaded_bytes", "Bytes loaded.", lambda s: s.bytes_loaded),
    ("aiokvtier_pool_owner_lookups", "Lookups the owner answered itself (also in queries).", lambda s: s.owner_lookups),
    (
        "aiokvtier_pool_mirror_retries",
        "Mirror reads attached processes did over.",
        lambda s: s.mirror_retries,
    ),
)


class PoolCollector(_Tabled[_Reporting[PoolStatistics], PoolStatistics]):
    """Exports a [``Pool``][aiokvtier.Pool]'s shared figures (attached processes, the shared store),
    labelled ``pool=name``; its tier's go through ``TierCollector(pool.tier)``.

    ``Pool.statistics()`` may be scraped from any thread: from another thread than the owner's loop it
    waits for that loop to take the snapshot. An attached process exports its figures through any object
    whose ``statistics()`` returns them (``AttachedPool.statistics()`` is a coroutine: take them on its
    loop).
    """

    _label = "pool"
    _gauges = _POOL_GAUGES
    _counters = _POOL_COUNTERS


class EngineCollector(_Collector[CopyEngine, CopyStatistics]):
    """Exports a [``CopyEngine``][aiokvtier.CopyEngine]'s statistics, labelled ``engine=name``.

    ``direction`` is ``h2d`` (``to_device``), ``d2h`` (``to_host``) or ``any``
    (the raw ``copy``); a batch is one such call, however many driver calls it took.
    """

    _label = "engine"

    def _families(self, snapshots: list[tuple[str, CopyStatistics]]) -> list[Metric]:
        labels = [self._label, "direction"]
        nbytes = CounterMetricFamily("aiokvtier_copy_bytes", "Bytes copied, by direction.", labels=labels)
        batches = CounterMetricFamily("aiokvtier_copy_batches", "Copy calls submitted, by direction.", labels=labels)
        latency = HistogramMetricFamily(
            "aiokvtier_copy_latency_seconds",
            "Copy calls from submission to completion.",
            labels=[self._label],
        )
        in_flight = self._gauge("aiokvtier_copy_batches_in_flight", "Copy calls submitted and not yet completed.")
        descriptors = self._counter(
            "aiokvtier_copy_descriptors", "Copies handed to the driver, after merging contiguous ones."
        )
        calls = self._counter("aiokvtier_copy_driver_calls", "cuMemcpyBatchAsync calls (memmove rounds without a GPU).")
        for name, s in snapshots:
            for direction, count in s.bytes_by_direction.items():
                nbytes.add_metric([name, direction], count)
            for direction, count in s.jobs_by_direction.items():
                batches.add_metric([name, direction], count)
            buckets = [("+Inf" if math.isinf(bound) else repr(bound), count) for bound, count in s.latency_buckets]
            latency.add_metric([name], buckets, s.latency_sum_seconds)
            in_flight.add_metric([name], max(0, s.jobs_submitted - s.jobs_completed))  # two counters, read apart
            descriptors.add_metric([name], s.descriptors_submitted)
            calls.add_metric([name], s.driver_calls)
        return [nbytes, batches, latency, in_flight, descriptors, calls]
