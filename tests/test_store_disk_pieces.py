"""A load whose tail is only on the disk tier brings it back in pieces, each copied out once it landed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from aiokvtier import BlockNotFound, BlockStore, DiskTier, DiskTierConfig, HostTier
from aiokvtier._store._spill import PIECE_BYTES

from .helpers import MiB, eventually, small_config

pytestmark = pytest.mark.timeout(120)

SLOT = 1 * MiB
PER = PIECE_BYTES // SLOT
"""Blocks in one piece."""
HEAD, TAIL = 3, 5 * PER
"""A prefix of HEAD blocks in the host tier and TAIL only on disk: five pieces."""
KEYS = [b"q%d" % i for i in range(HEAD + TAIL)]


def pages(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, SLOT), dtype=np.uint8)


DATA = pages(len(KEYS))

T = TypeVar("T")


async def begun(call: Coroutine[Any, Any, T], turns: int) -> asyncio.Future[T]:
    """``call`` as a task, once the loop has turned ``turns`` times since it was made one."""
    task = asyncio.ensure_future(call)
    for _ in range(turns):
        await asyncio.sleep(0)
    return task


@asynccontextmanager
async def prefix(path: Path) -> AsyncIterator[tuple[HostTier, BlockStore, DiskTier]]:
    """A store whose host tier holds KEYS[:HEAD] while the disk tier holds every key."""
    slots = len(KEYS) + 4
    config = await asyncio.to_thread(DiskTierConfig, quota=2 * len(KEYS) * SLOT, path=path)
    tier_config = small_config(quota=slots * SLOT, max_quota=slots * SLOT, slot_size=SLOT, commit_unit=SLOT * 4)
    async with HostTier(tier_config) as tier, DiskTier(config, block_size=SLOT, fingerprint="m") as disk:
        await tier.wait_resident()
        async with BlockStore(tier, disk=disk, admit_after=1) as store:
            await store.store(KEYS, DATA)
            await store.load(KEYS, np.zeros_like(DATA))
            await eventually(lambda: store.statistics().written_back == len(KEYS))
            others = [b"o%d" % i for i in range(slots)]
            await store.store(others, pages(slots, 1))  # every key out of the host tier
            await store.store(KEYS[:HEAD], DATA[:HEAD])
            assert [k in store for k in KEYS] == [True] * HEAD + [False] * TAIL
            yield tier, store, disk
            if not store.closed:
                store.check_invariants()


def settled(tier: HostTier, store: BlockStore, disk: DiskTier) -> None:
    """Nothing pinned, claimed or in flight in any tier."""
    s = store.statistics()
    assert s.in_flight == 0 and s.blocks_pinned == 0
    d = disk.statistics()
    assert d.queue_depth == 0 and d.blocks + d.free == d.capacity  # no read holds a disk slot
    store.check_invariants(sole_user=True)  # every slot the tier lent is a block of the store
    assert tier.statistics().slots_allocated == len(store)


async def test_the_tail_comes_back_in_pieces_bit_exact(tmp_path: Path) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        out = np.zeros_like(DATA)
        events = store.events()
        await store.load(KEYS, out)
        assert np.array_equal(out, DATA)
        s = store.statistics()
        assert s.promoted == TAIL and s.disk is not None and s.disk.hits == TAIL
        assert all(k in store for k in KEYS)
        settled(tier, store, disk)
        await store.aclose()  # ends the event stream once it is read
        stored = [event.keys for event in [e async for e in events] if event.kind == "stored"]
        # One booking per piece.
        assert sorted(stored) == sorted(tuple(KEYS[HEAD + i : HEAD + i + PER]) for i in range(0, TAIL, PER))


async def test_a_key_given_twice_across_pieces_is_brought_back_once(tmp_path: Path) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        wanted = [*KEYS, KEYS[HEAD], KEYS[-1], KEYS[0]]
        out = np.zeros((len(wanted), SLOT), dtype=np.uint8)
        await store.load(wanted, out)
        assert np.array_equal(out, DATA[[*range(len(KEYS)), HEAD, len(KEYS) - 1, 0]])
        assert store.statistics().promoted == TAIL
        settled(tier, store, disk)


async def test_a_block_gone_from_disk_in_the_middle_piece_is_a_miss_and_the_others_land(tmp_path: Path) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        middle = HEAD + 2 * PER + 1  # in the third piece
        # One turn: the load asked the disk tier for the lengths and queued its pieces.
        load = await begun(store.load(KEYS, np.zeros_like(DATA)), 1)
        assert disk.discard([KEYS[middle]]) == 1  # before any piece reads
        with pytest.raises(BlockNotFound, match=repr(KEYS[middle])):
            await load
        piece = range(HEAD + 2 * PER, HEAD + 3 * PER)
        assert [k in store for k in KEYS] == [i not in piece for i in range(len(KEYS))]
        settled(tier, store, disk)
        out = np.zeros((len(KEYS) - 1, SLOT), dtype=np.uint8)
        rest = [i for i in range(len(KEYS)) if i != middle]
        await store.load([KEYS[i] for i in rest], out)  # the rest of that piece is still on disk
        assert np.array_equal(out, DATA[rest])
        settled(tier, store, disk)


@pytest.mark.parametrize("delay", [0.0, 0.0001, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.05])
async def test_a_load_cancelled_at_any_point_leaves_nothing_claimed(tmp_path: Path, delay: float) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        out = np.zeros_like(DATA)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(store.load(KEYS, out), delay)
        settled(tier, store, disk)
        out[:] = 0
        await store.load(KEYS, out)
        assert np.array_equal(out, DATA)
        settled(tier, store, disk)


@pytest.mark.parametrize("steps", [1, 2, 3, 5, 8])
async def test_a_close_that_begins_during_the_load_waits_for_it(tmp_path: Path, steps: int) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        out = np.zeros_like(DATA)
        load = await begun(store.load(KEYS, out), steps)
        await store.aclose()
        assert load.done()
        await load  # the close waited: every piece landed and was copied
        assert np.array_equal(out, DATA)
        assert tier.statistics().slots_allocated == 0
        d = disk.statistics()
        assert d.queue_depth == 0 and d.blocks + d.free == d.capacity


async def test_a_piece_cancelled_from_within_ends_the_load_as_cancelled_not_as_a_success(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A piece whose read is cancelled inside it (not by this load's caller) wrote none of its pages: the
    load must not return as if it had. It ends as the piece did, and nothing stays claimed."""
    async with prefix(tmp_path) as (tier, store, disk):
        real_read = disk.read
        calls = 0

        async def read(keys: list[bytes], addresses: list[int]) -> tuple[bool, ...]:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise asyncio.CancelledError("a read cut short inside the disk tier")
            return await real_read(keys, addresses)

        monkeypatch.setattr(disk, "read", read)
        with pytest.raises(asyncio.CancelledError):
            await store.load(KEYS, np.zeros_like(DATA))
        monkeypatch.setattr(disk, "read", real_read)
        settled(tier, store, disk)
        out = np.zeros_like(DATA)
        await store.load(KEYS, out)
        assert np.array_equal(out, DATA)
        settled(tier, store, disk)
