"""A BlockStore over a disk tier: write-back after repeated hits, lookup and load through both tiers, restarts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest

from aiokvtier import BlockNotFound, BlockStore, DiskTier, DiskTierConfig, HostTier

from .helpers import KiB, eventually, small_config

pytestmark = pytest.mark.timeout(120)

SLOT = 64 * KiB


def page(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8).tobytes()


@asynccontextmanager
async def cache(path: Path, slots: int = 16, **kwargs: object) -> AsyncIterator[tuple[BlockStore, DiskTier]]:
    config = await asyncio.to_thread(DiskTierConfig, quota=256 * SLOT, path=path)
    tier_config = small_config(quota=slots * SLOT, max_quota=slots * SLOT, slot_size=SLOT, commit_unit=SLOT * 16)
    async with HostTier(tier_config) as tier, DiskTier(config, block_size=SLOT, fingerprint="m") as disk:
        await tier.wait_resident()
        async with BlockStore(tier, disk=disk, **kwargs) as store:  # type: ignore[arg-type]
            yield store, disk
            store.check_invariants()


async def load_pages(store: BlockStore, keys: list[bytes]) -> list[bytes]:
    out = np.zeros((len(keys), SLOT), dtype=np.uint8)
    await store.load(keys, out)
    return [row.tobytes() for row in out]


async def test_blocks_hit_twice_are_written_back_and_loaded_from_disk_once_evicted(tmp_path: Path) -> None:
    keys = [b"k%d" % i for i in range(8)]
    async with cache(tmp_path) as (store, disk):
        await store.store(keys, [page(i) for i in range(8)])
        await load_pages(store, keys)
        assert store.statistics().written_back == 0  # one hit: not admitted
        await load_pages(store, keys[:6])
        await eventually(lambda: store.statistics().written_back == 6)
        assert all(k in disk for k in keys[:6]) and not any(k in disk for k in keys[6:])
        # other blocks push them out of the 16-slot host tier
        others = [b"o%d" % i for i in range(16)]
        await store.store(others, [page(100 + i) for i in range(16)])
        assert not any(k in store for k in keys)
        assert store.lookup(keys) == 6  # the prefix goes on through the disk tier
        assert await load_pages(store, keys[:6]) == [page(i) for i in range(6)]
        s = store.statistics()
        assert s.promoted == 6 and s.disk_hits == 6 and s.disk is not None and s.disk.hits == 6
        assert all(k in store for k in keys[:6])  # back in the host tier
        with pytest.raises(BlockNotFound, match=repr(keys[6])):
            await store.load(keys[5:7], np.zeros((2, SLOT), dtype=np.uint8))
        store.check_invariants(sole_user=True)


async def test_the_disk_tier_survives_a_restart_under_a_new_store(tmp_path: Path) -> None:
    keys = [b"r%d" % i for i in range(4)]
    async with cache(tmp_path, admit_after=1) as (store, _):
        await store.store(keys, [page(i) for i in range(4)])
        await load_pages(store, keys)
        await eventually(lambda: store.statistics().written_back == 4)
    async with cache(tmp_path) as (store, disk):
        assert len(store) == 0 and disk.statistics().recovered_blocks == 4
        assert store.lookup(keys) == 4
        assert await load_pages(store, keys) == [page(i) for i in range(4)]


async def test_a_block_damaged_on_disk_is_a_miss_and_leaves_nothing_half_built(tmp_path: Path) -> None:
    keys = [b"d0", b"d1"]
    async with cache(tmp_path, admit_after=1) as (store, disk):
        await store.store(keys, [page(0), page(1)])
        await load_pages(store, keys)
        await eventually(lambda: store.statistics().written_back == 2)
        directory = disk.directory
    await asyncio.to_thread(_flip_every_slot, Path(directory, "blocks"), 2)
    async with cache(tmp_path) as (store, disk):
        with pytest.raises(BlockNotFound):
            await load_pages(store, keys)
        store.check_invariants(sole_user=True)
        assert len(store) == 0 and disk.statistics().checksum_failures >= 1


def _flip_every_slot(path: Path, slots: int) -> None:
    with open(path, "r+b") as f:
        for slot in range(slots):
            f.seek(slot * SLOT + 7)
            byte = f.read(1)
            f.seek(slot * SLOT + 7)
            f.write(bytes([byte[0] ^ 1]))


async def test_discard_drops_the_block_from_the_disk_tier_too(tmp_path: Path) -> None:
    async with cache(tmp_path, admit_after=1) as (store, disk):
        await store.store([b"x"], [page(0)])
        await load_pages(store, [b"x"])
        await eventually(lambda: b"x" in disk)
        assert store.discard([b"x"]) == 1
        assert b"x" not in disk and store.lookup([b"x"]) == 0


@pytest.mark.parametrize("delay", [0.0, 0.0002, 0.001, 0.005])
async def test_a_cancelled_load_from_disk_leaves_the_store_consistent(tmp_path: Path, delay: float) -> None:
    keys = [b"c%d" % i for i in range(12)]
    async with cache(tmp_path, admit_after=1) as (store, _):
        await store.store(keys, [page(i) for i in range(12)])
        await load_pages(store, keys)
        await eventually(lambda: store.statistics().written_back == 12)
        await store.store([b"o%d" % i for i in range(16)], [page(100 + i) for i in range(16)])
        out = np.zeros((12, SLOT), dtype=np.uint8)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(store.load(keys, out), delay)
        store.check_invariants()
        assert store.statistics().in_flight == 0
        assert await load_pages(store, keys) == [page(i) for i in range(12)]
        store.check_invariants(sole_user=True)


async def test_a_disk_tier_of_another_block_size_or_a_bad_admission_is_refused(tmp_path: Path) -> None:
    config = await asyncio.to_thread(DiskTierConfig, quota=64 * SLOT, path=tmp_path)
    async with (
        HostTier(small_config(slot_size=SLOT)) as tier,
        DiskTier(config, block_size=2 * SLOT, fingerprint="m") as disk,
    ):
        with pytest.raises(ValueError, match="must be the same"):
            await BlockStore.open(tier, disk=disk)
        with pytest.raises(ValueError, match="admit_after"):
            BlockStore(tier, disk=disk, admit_after=0)
        assert tier.statistics().slots_allocated == 0


async def test_a_load_of_host_and_disk_blocks_copies_both_and_a_bad_disk_block_leaves_no_pin(tmp_path: Path) -> None:
    keys = [b"m%d" % i for i in range(8)]
    async with cache(tmp_path, admit_after=1) as (store, disk):
        await store.store(keys, [page(i) for i in range(8)])
        await load_pages(store, keys)
        await eventually(lambda: store.statistics().written_back == 8)
        store.discard(keys[4:])  # gone from both tiers
        await store.store(keys[4:], [page(i) for i in range(4, 8)])  # back in host only
        await store.store([b"o%d" % i for i in range(12)], [page(100 + i) for i in range(12)])  # pushes m0-m3 out
        assert [k in store for k in keys] == [False] * 4 + [True] * 4
        mixed = [keys[0], keys[5], keys[1], keys[6]]  # disk, host, disk, host
        assert await load_pages(store, mixed) == [page(0), page(5), page(1), page(6)]
        store.check_invariants()  # m5 and m6 may be on their way to disk: pinned, in flight
        await eventually(lambda: store.statistics().in_flight == 0)
        assert store.statistics().blocks_pinned == 0
        await store.store([b"p%d" % i for i in range(16)], [page(200 + i) for i in range(16)])  # m0, m1 out again
        disk.discard([keys[1]])  # the disk loses a block the store still expects to find there
        with pytest.raises(BlockNotFound, match=repr(keys[1])):
            await load_pages(store, [keys[0], keys[1]])
        store.check_invariants()
        assert store.statistics().blocks_pinned == 0 and store.statistics().in_flight == 0
