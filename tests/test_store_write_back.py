"""A BlockStore's write-back to a Mooncake tier under attack (a real ``mooncake_master`` on loopback ports):
blocks loaded again while their write-back is queued or running, a write-back that failed, a discard or an
eviction meanwhile, the store closing with write-backs queued, and the loads that queued them cancelled."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Sequence

import numpy as np
import pytest

from aiokvtier import BlockStore, HostTier, MooncakeError, MooncakeTier
from aiokvtier._store._keys import Key

from .helpers import eventually
from .invariants import wait_no_library_threads
from .test_mooncake import Master, unique
from .test_store_remote import SLOT, host_config, load_pages, master, page, push_out, remote_store

__all__ = ["master"]  # the module's master fixture, with the short lease

pytestmark = pytest.mark.timeout(180)


async def test_blocks_loaded_again_while_their_write_back_runs_are_written_once(master: Master) -> None:
    keys = [b"once%d" % i for i in range(8)]
    async with asyncio.timeout(60), remote_store(master.config(), unique("once"), admit_after=1) as (store, remote):
        await store.store(keys, [page(i) for i in range(8)])
        await load_pages(store, keys)
        await load_pages(store, keys)  # while the first load's write-back is queued or running
        await asyncio.gather(*(load_pages(store, keys[::-1]) for _ in range(3)))
        await eventually(lambda: store.statistics().in_flight == 0, 30)
        assert store.statistics().remote_written == 8
        assert await remote.lookup(keys) == 8
        await load_pages(store, keys)  # written already: not again
        await eventually(lambda: store.statistics().in_flight == 0, 30)
        assert store.statistics().remote_written == 8
    await wait_no_library_threads(15)


class Puts:
    """``MooncakeTier.write`` and ``discard`` patched to record what the store sends, in order: each put
    waits at ``gate`` (at most 30 s) while it is clear, and the first ``failing`` puts raise."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[list[Key]] = []
        """The keys of each put, as the store gave them."""
        self.events: list[tuple[str, tuple[Key, ...]]] = []
        """("written", keys a put wrote) and ("discard", keys) in the order they happened."""
        self.gate = asyncio.Event()
        self.gate.set()
        self.entered = asyncio.Event()
        self.failing = 0
        write, discard = MooncakeTier.write, MooncakeTier.discard

        async def gated_write(
            tier: MooncakeTier, keys: Sequence[Key], addresses: Sequence[int], lengths: Sequence[int]
        ) -> tuple[Key, ...]:
            self.calls.append(list(keys))
            self.entered.set()
            await asyncio.wait_for(self.gate.wait(), 30)
            if self.failing:
                self.failing -= 1
                raise MooncakeError("the put was refused")
            written = await write(tier, keys, addresses, lengths)
            self.events.append(("written", written))
            return written

        async def recorded_discard(tier: MooncakeTier, keys: Iterable[Key]) -> int:
            keys = tuple(keys)
            self.events.append(("discard", keys))
            return await discard(tier, keys)

        monkeypatch.setattr(MooncakeTier, "write", gated_write)
        monkeypatch.setattr(MooncakeTier, "discard", recorded_discard)

    async def held(self) -> None:
        """Close the gate and wait for the next put to reach it."""
        self.gate.clear()
        self.entered.clear()
        await asyncio.wait_for(self.entered.wait(), 30)


async def settle(store: BlockStore) -> None:
    await eventually(lambda: store.statistics().in_flight == 0 and store.statistics().blocks_pinned == 0, 30)


async def test_a_block_queued_or_being_written_is_not_queued_again(
    master: Master, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = [b"qa%d" % i for i in range(4)], [b"qb%d" % i for i in range(4)]
    puts = Puts(monkeypatch)
    async with asyncio.timeout(60), remote_store(master.config(), unique("queued"), admit_after=1) as (store, remote):
        await store.store(a + b, [page(i) for i in range(8)])
        await load_pages(store, a)
        await puts.held()  # a's put in flight
        await load_pages(store, a)
        await load_pages(store, b)  # queued behind it
        await asyncio.gather(load_pages(store, b), load_pages(store, a + b))
        puts.gate.set()
        await settle(store)
        assert puts.calls == [a, b]
        assert store.statistics().remote_written == 8 and await remote.lookup(a + b) == 8


async def test_a_write_back_that_failed_or_skipped_keys_is_retried_by_a_later_load(
    master: Master, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    keys = [b"retry%d" % i for i in range(8)]
    puts = Puts(monkeypatch)
    puts.failing = 1
    async with asyncio.timeout(60), remote_store(master.config(), unique("retry"), admit_after=1) as (store, remote):
        await store.store(keys, [page(i) for i in range(8)])
        await load_pages(store, keys)
        await settle(store)
        assert "writing blocks back to the Mooncake tier failed" in caplog.text
        assert store.statistics().remote_written == 0 and await remote.lookup(keys) == 0
        await load_pages(store, keys)  # the next hit queues them again
        await settle(store)
        assert puts.calls == [keys, keys]
        assert store.statistics().remote_written == 8 and await remote.lookup(keys) == 8


async def test_a_block_discarded_while_its_put_runs_is_discarded_again_after_it_and_not_remembered(
    master: Master, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [b"gone%d" % i for i in range(8)]
    puts = Puts(monkeypatch)
    async with asyncio.timeout(60), remote_store(master.config(), unique("gone"), admit_after=1) as (store, _):
        await store.store(keys, [page(i) for i in range(8)])
        await load_pages(store, keys)
        await puts.held()
        assert store.discard(keys[:2]) == 2  # pinned by the put: freed once it settled
        assert not any(k in store for k in keys[:2])
        puts.gate.set()
        await settle(store)
        await eventually(lambda: ("discard", tuple(keys[:2])) in puts.events[1:], 30)
        written = puts.events.index(("written", tuple(keys)))
        assert puts.events.index(("discard", tuple(keys[:2])), written) > written  # after the put, not before
        assert store.statistics().remote_written == 8
        # not remembered as written: stored and loaded again, it is written again
        await store.store(keys[:2], [page(0), page(1)])
        await load_pages(store, keys)
        await settle(store)
        assert puts.calls == [keys, keys[:2]]
        assert store.statistics().remote_written == 10


async def test_an_evicted_block_leaves_the_queue_and_a_block_being_written_is_not_evicted(
    master: Master, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = [b"ea%d" % i for i in range(8)], [b"eb%d" % i for i in range(8)]
    puts = Puts(monkeypatch)
    async with asyncio.timeout(60), remote_store(master.config(), unique("evict"), admit_after=1) as (store, remote):
        await store.store(a + b, [page(i) for i in range(16)])
        await load_pages(store, a)
        await puts.held()  # a pinned by its put
        await load_pages(store, b)  # queued
        await push_out(store, 8)  # evicts b (a is pinned)
        assert all(k in store for k in a) and not any(k in store for k in b)
        puts.gate.set()
        await settle(store)
        assert puts.calls == [a] and store.statistics().remote_written == 8
        assert await remote.lookup(a) == 8 and await remote.lookup(b) == 0
        await store.store(b, [page(8 + i) for i in range(8)])  # back, and hit: written now
        await load_pages(store, b)
        await settle(store)
        assert puts.calls == [a, b] and store.statistics().remote_written == 16
        await push_out(store, 16, 200)
        assert await load_pages(store, a + b) == [page(i) for i in range(16)]  # from the cluster
        await settle(store)
        assert store.statistics().remote_written == 16  # came from it: not written again


async def test_a_close_with_write_backs_queued_writes_the_batch_in_flight_and_drops_the_rest(
    master: Master, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = [b"ca%d" % i for i in range(4)], [b"cb%d" % i for i in range(4)]
    puts = Puts(monkeypatch)
    async with asyncio.timeout(60):
        async with (
            HostTier(host_config()) as tier,
            MooncakeTier(master.config(), block_size=SLOT, fingerprint=unique("close")) as remote,
        ):
            await tier.wait_resident()
            store = await BlockStore.open(tier, remote=remote, admit_after=1)
            await store.store(a + b, [page(i) for i in range(8)])
            await load_pages(store, a)
            await puts.held()
            await load_pages(store, b)  # queued behind a's put
            closing = asyncio.ensure_future(store.aclose())
            await asyncio.sleep(0.05)
            assert not closing.done()  # waits for the put in flight
            puts.gate.set()
            await asyncio.wait_for(closing, 30)
            assert puts.calls == [a]
            s = store.statistics()
            assert (s.remote_written, s.in_flight, s.blocks_pinned) == (4, 0, 0), s
            assert tier.statistics().slots_allocated == 0
            assert remote.statistics().registered_bytes == 0
            assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("aiokvtier-store-")]
            assert await remote.lookup(a) == 4 and [await remote.lookup([k]) for k in b] == [0] * 4
    await wait_no_library_threads(15)


DELAYS = [0.0, 0.0005, 0.002, 0.01, 0.05]


async def test_loads_cancelled_at_swept_delays_write_each_block_once(master: Master) -> None:
    async with asyncio.timeout(120), remote_store(master.config(), unique("swept"), admit_after=1) as (store, remote):
        out = np.zeros((8, SLOT), dtype=np.uint8)
        for r, delay in enumerate(DELAYS):
            keys = [b"s%d-%d" % (r, i) for i in range(8)]
            await store.store(keys, [page(i) for i in range(8)])
            for _ in range(3):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(store.load(keys, out), delay)
            await load_pages(store, keys)
            await settle(store)
            store.check_invariants(sole_user=True)
            assert store.statistics().remote_written == 8 * (r + 1)
            assert await remote.lookup(keys) == 8
            store.discard(keys)  # room for the next round
    await wait_no_library_threads(15)
