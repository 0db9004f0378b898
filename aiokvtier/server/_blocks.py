"""Where the service's blocks live: a BlockStore over a HostTier, a pool shared by several worker
processes, or a plain dict (the baseline)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal, Protocol

from prometheus_client.registry import Collector

from .. import metrics
from .._config import DiskTierConfig, HostTierConfig, MooncakeTierConfig
from .._disk._tier import DiskTier
from .._errors import BlockNotFound, TierClosedError
from .._host._statistics import TierStatistics
from .._host._tier import HostTier
from .._lifecycle import close_in_turn
from .._mooncake._tier import MooncakeTier
from .._pool._client import AttachedPool
from .._pool._statistics import PoolStatistics
from .._store._store import BlockStore

__all__ = ["Blocks", "DictBlocks", "PoolBlocks", "StoreBlocks"]

Put = Literal["stored", "present", "skipped"]


class Blocks(Protocol):
    """The service's view of where blocks live: the tier's store, or a plain dict (the baseline)."""

    slot_size: int

    async def open(self) -> None: ...
    async def aclose(self) -> None: ...
    def residency(self) -> tuple[int, int, str | None]: ...
    def lost(self) -> str | None: ...
    async def put(self, key: bytes, body: bytes) -> Put: ...
    async def get(self, key: bytes) -> bytes | None: ...
    async def delete(self, key: bytes) -> bool: ...
    async def lookup(self, keys: list[bytes]) -> int: ...
    async def stats(self) -> dict[str, Any]: ...
    def collectors(self) -> list[Collector]: ...
    async def refresh(self) -> None:
        """Before a scrape: bring the figures the collectors read up to date (those that cannot be read then)."""


class StoreBlocks:
    """Blocks in a ``BlockStore`` over a ``HostTier``.

    A GET asks the store for the block's length and loads it into a
    buffer of that length in the same loop step (nothing can evict it
    between the two), then answers those bytes.
    """

    tier: HostTier
    store: BlockStore
    disk: DiskTier | None = None
    remote: MooncakeTier | None = None

    def __init__(
        self,
        config: HostTierConfig,
        policy: str,
        disk: DiskTierConfig | None = None,
        remote: MooncakeTierConfig | None = None,
    ) -> None:
        self.config = config
        self.policy = policy
        self.slot_size = int(config.slot_size)
        self.disk_config = disk
        self.remote_config = remote

    async def open(self) -> None:
        self.tier = await HostTier.open(self.config)  # returns once the fill has started, not when resident
        try:
            fingerprint = f"aiokvtier-server/{self.slot_size}"  # blocks are opaque bytes of one slot size
            if self.disk_config is not None:
                self.disk = await DiskTier.open(self.disk_config, block_size=self.slot_size, fingerprint=fingerprint)
            if self.remote_config is not None:
                self.remote = await MooncakeTier.open(
                    self.remote_config, block_size=self.slot_size, fingerprint=fingerprint
                )
            self.store = await BlockStore.open(self.tier, None, policy=self.policy, disk=self.disk, remote=self.remote)
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        # Each closed whatever an earlier close raised; the store and the tier may not be made yet.
        await close_in_turn(self.__dict__.get("store"), self.remote, self.disk, self.__dict__.get("tier"))

    def residency(self) -> tuple[int, int, str | None]:
        s = self.tier.statistics()
        return s.resident_bytes, s.target_bytes, s.fill_error

    def lost(self) -> str | None:
        return None

    async def put(self, key: bytes, body: bytes) -> Put:
        result = await self.store.store([key], [body])
        return "stored" if result.stored else "present" if result.present else "skipped"

    async def get(self, key: bytes) -> bytes | None:
        try:
            if key in self.store:
                buffer = bytearray(self.store.length(key))
            elif self.disk is not None and key in self.disk:
                buffer = bytearray(self.disk.length(key))  # loaded back through a host slot
            elif self.remote is not None:
                buffer = bytearray(self.slot_size)  # its length is known once it is in a host slot
                await self.store.load([key], [buffer])
                return bytes(buffer[: self.store.length(key)])  # no await since the load: still there
            else:
                return None
            await self.store.load([key], [buffer])  # checks the key before its first await
        except (BlockNotFound, KeyError):
            return None
        return bytes(buffer)

    async def delete(self, key: bytes) -> bool:
        return self.store.discard([key]) == 1

    async def lookup(self, keys: list[bytes]) -> int:
        return await self.store.lookup_remote(keys) if self.remote is not None else self.store.lookup(keys)

    async def stats(self) -> dict[str, Any]:
        tier, store = self.tier.statistics(), self.store.statistics()
        return {"tier": dataclasses.asdict(tier), "store": dataclasses.asdict(store)}  # with the tiers below

    def collectors(self) -> list[Collector]:
        found: list[Collector] = [metrics.TierCollector(self.tier), metrics.StoreCollector(self.store)]
        if self.disk is not None:
            found.append(metrics.DiskCollector(self.disk))
        if self.remote is not None:
            found.append(metrics.MooncakeCollector(self.remote))
        return found

    async def refresh(self) -> None:
        pass  # the collectors read the tier's and the store's statistics() as they scrape


class PoolBlocks:
    """Blocks in the store of a pool that another process owns (``--workers``: each worker attaches).

    A block PUT through one worker is a GET hit through every other.
    """

    pool: AttachedPool

    def __init__(self, path: str) -> None:
        self.path = path
        self.slot_size = 0
        self.figures = PoolFigures()

    async def open(self) -> None:
        self.pool = await AttachedPool.attach(self.path)
        self.slot_size = self.pool.slot_size

    async def aclose(self) -> None:
        if "pool" in self.__dict__:
            await self.pool.aclose()

    def residency(self) -> tuple[int, int, str | None]:
        return self.pool.resident_bytes, self.pool.quota, None

    def lost(self) -> str | None:
        """Why the pool can no longer serve this worker (its owner went away), or None."""
        return self.pool.lost if "pool" in self.__dict__ else None

    async def put(self, key: bytes, body: bytes) -> Put:
        result = await self.pool.store([key], [body])
        return "stored" if result.stored else "present" if result.present else "skipped"

    async def get(self, key: bytes) -> bytes | None:
        buffer = bytearray(self.slot_size)
        try:
            (length,) = await self.pool.load([key], [buffer])
        except BlockNotFound:
            return None
        return bytes(buffer[:length])

    async def delete(self, key: bytes) -> bool:
        return await self.pool.discard([key]) == 1

    async def lookup(self, keys: list[bytes]) -> int:
        return await self.pool.lookup(keys)

    async def stats(self) -> dict[str, Any]:
        s = await self.pool.statistics()
        pool = dataclasses.asdict(s)
        return {"tier": pool.pop("tier"), "pool": pool, "worker": {"pid": os.getpid()}}

    def collectors(self) -> list[Collector]:
        return [metrics.TierCollector(self.figures.tier), metrics.PoolCollector(self.figures)]

    async def refresh(self) -> None:
        """Ask the owner for the pool's figures: ``AttachedPool.statistics()`` is a coroutine, which a
        collector, read synchronously as it scrapes, cannot await.

        :raises PoolLostError: the owner went away.
        """
        self.figures.latest = await self.pool.statistics()


class PoolFigures:
    """The pool's figures as of the last ``refresh()``, for the collectors; none before the first."""

    def __init__(self) -> None:
        self.latest: PoolStatistics | None = None
        self.tier = _TierFigures(self)

    def statistics(self) -> PoolStatistics:
        if self.latest is None:
            raise TierClosedError("no figures yet")  # a collector scrapes it as nothing
        return self.latest


class _TierFigures:
    def __init__(self, figures: PoolFigures) -> None:
        self.figures = figures

    def statistics(self) -> TierStatistics:
        return self.figures.statistics().tier


class DictBlocks:
    """The baseline: blocks as ``bytes`` in a dict, oldest dropped first past ``quota // slot_size`` blocks."""

    def __init__(self, quota: int, slot_size: int) -> None:
        self.slot_size = slot_size
        self.capacity = max(1, quota // slot_size)
        self.blocks: dict[bytes, bytes] = {}
        self.hits = self.misses = self.evictions = 0

    async def open(self) -> None:
        pass

    async def aclose(self) -> None:
        self.blocks.clear()

    def residency(self) -> tuple[int, int, str | None]:
        return 1, 1, None  # nothing to fill: ready at once

    def lost(self) -> str | None:
        return None

    async def put(self, key: bytes, body: bytes) -> Put:
        if key in self.blocks:
            return "present"
        if len(self.blocks) >= self.capacity:
            del self.blocks[next(iter(self.blocks))]
            self.evictions += 1
        self.blocks[key] = body
        return "stored"

    async def get(self, key: bytes) -> bytes | None:
        return self.blocks.get(key)

    async def delete(self, key: bytes) -> bool:
        return self.blocks.pop(key, None) is not None

    async def lookup(self, keys: list[bytes]) -> int:
        hits = 0
        for key in keys:
            if key not in self.blocks:
                break
            hits += 1
        self.hits += hits
        self.misses += len(keys) - hits
        return hits

    async def stats(self) -> dict[str, Any]:
        return {
            "dict": {"blocks": len(self.blocks), "capacity": self.capacity, "hits": self.hits, "misses": self.misses}
        }

    def collectors(self) -> list[Collector]:
        return []

    async def refresh(self) -> None:
        pass
