"""Cache: a CacheConfig opened whole (host tier, disk tier, store), closed whole, and nothing left after a failure."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiokvtier import Cache, CacheConfig, ConfigError, DiskTier, DiskTierBusy

from .helpers import KiB, MiB, eventually
from .invariants import wait_no_library_threads

pytestmark = pytest.mark.timeout(120)

SLOT = 64 * KiB


def tiers(path: Path, *, disk: bool = True) -> dict[str, Any]:
    found: list[dict[str, Any]] = [
        {"kind": "host", "quota": 4 * MiB, "max_quota": 4 * MiB, "slot_size": SLOT, "commit_unit": MiB}
    ]
    if disk:
        found.append({"kind": "disk", "quota": 64 * SLOT, "path": str(path)})
    return {"tiers": found}


async def test_a_cache_config_opens_a_store_over_a_host_and_a_disk_tier(tmp_path: Path) -> None:
    pages = np.random.default_rng(0).integers(0, 256, (4, SLOT), dtype=np.uint8)
    out = np.zeros_like(pages)
    keys = [b"a", b"b", b"c", b"d"]
    async with await Cache.open(tiers(tmp_path), fingerprint="m", admit_after=1) as cache:
        assert cache.disk is not None and cache.engine is None and "disk" in repr(cache)
        assert cache.disk.block_size == cache.tier.slot_size
        await cache.store.store(keys, pages)
        await cache.store.load(keys, out)
        await eventually(lambda: cache.store.statistics().written_back == 4)
    assert cache.tier.closed and cache.disk.closed and cache.store.closed
    config = await asyncio.to_thread(CacheConfig.model_validate, tiers(tmp_path))
    async with await Cache.open(config, fingerprint="m") as again:
        assert again.store.lookup(keys) == 4
        out[:] = 0
        await again.store.load(keys, out)
        assert np.array_equal(out, pages)
    await wait_no_library_threads()


async def test_a_config_the_cache_cannot_open_is_refused_before_anything_opens(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs a host tier"):
        await Cache.open({"tiers": [{"kind": "disk", "quota": "1GiB", "path": str(tmp_path)}]}, fingerprint="m")
    remote = {
        "kind": "mooncake",
        "master": "127.0.0.1:50051",
        "metadata_server": "http://127.0.0.1:8080/metadata",
        "local_hostname": "127.0.0.1",
    }
    with pytest.raises(ConfigError, match="a Mooncake tier needs a fingerprint"):
        await Cache.open({"tiers": [tiers(tmp_path, disk=False)["tiers"][0], remote]})
    with pytest.raises(ConfigError, match="needs a fingerprint"):
        await Cache.open(tiers(tmp_path))
    async with await Cache.open(tiers(tmp_path, disk=False)) as cache:  # no disk: no fingerprint needed
        assert cache.disk is None
    await wait_no_library_threads()


async def test_a_part_that_fails_to_open_closes_the_parts_before_it(tmp_path: Path) -> None:
    config = await asyncio.to_thread(CacheConfig.model_validate, tiers(tmp_path))
    disk_config = config.tiers[1]
    async with DiskTier(disk_config, block_size=SLOT, fingerprint="m"):  # type: ignore[arg-type]
        with pytest.raises(DiskTierBusy):
            await Cache.open(config, fingerprint="m")
    await wait_no_library_threads()  # the host tier it had opened is closed


@pytest.mark.parametrize("delay", [0.0, 0.001, 0.005, 0.02])
async def test_a_cancelled_open_leaves_nothing_open(tmp_path: Path, delay: float) -> None:
    config = await asyncio.to_thread(CacheConfig.model_validate, tiers(tmp_path))
    opened: Cache | None = None
    with contextlib.suppress(TimeoutError):
        opened = await asyncio.wait_for(Cache.open(config, fingerprint="m"), delay)
    if opened is not None:
        await opened.aclose()
    await wait_no_library_threads()
    async with await Cache.open(config, fingerprint="m"):  # the directory's lock was released
        pass
