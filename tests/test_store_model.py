"""A hypothesis state machine: a BlockStore under policy="lru" against a plain model.

The model is a dict of key -> bytes and an exact LRU order (oldest first): a
store that finds keys present touches them (in the caller's order) before it
evicts, lookup touches the hit prefix, load touches every key. Every page
starts with an 8-byte tag unique to that write, so the slot a block lives in
can be read back from the tier's memory without asking the store: that is how
the model predicts which blocks a shrink evicts. Events are collected by a
subscriber task and compared after every step.
"""

from __future__ import annotations

import asyncio
import ctypes
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from aiokvtier import BlockEvent, BlockNotFound, BlockStore, HostTier, HostTierConfig, TierClosedError

SLOT = 4096
MAX_SLOTS = 24
TAG = 8
STEP_TIMEOUT = 10.0

KEYS: list[bytes | int] = [*range(8), *(b"k%d" % i for i in range(8)), b"\x01", b"\x00"]
key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=12, unique=True)


def raw(address: int, n: int) -> bytes:
    return ctypes.string_at(address, n)


class StoreMachine(RuleBasedStateMachine):
    loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop

    def __init__(self) -> None:
        super().__init__()
        self.runner = asyncio.Runner(loop_factory=type(self).loop_factory)
        self.tier: HostTier | None = None
        self.store: BlockStore | None = None
        self.data: dict[bytes | int, bytes] = {}
        self.lru: list[bytes | int] = []
        self.seen: list[BlockEvent] = []
        self.expected_events: list[tuple[str, tuple[bytes | int, ...]]] = []
        self.counts = dict.fromkeys(
            (
                "queries",
                "hits",
                "misses",
                "stores",
                "present",
                "skipped",
                "loads",
                "evictions",
                "discards",
                "bytes_stored",
                "bytes_loaded",
            ),
            0,
        )
        self.tag = 0
        self.rng = random.Random(0)

    def run(self, coro: Any) -> Any:
        async def bounded() -> Any:
            return await asyncio.wait_for(coro, STEP_TIMEOUT)

        return self.runner.run(bounded())

    # -- helpers ---------------------------------------------------------------------------

    def page(self, length: int) -> bytes:
        self.tag += 1
        return self.tag.to_bytes(TAG, "big") + self.rng.randbytes(length - TAG)

    def touch(self, keys: list[bytes | int]) -> None:
        for key in keys:
            self.lru.remove(key)
            self.lru.append(key)

    def evict(self, keys: list[bytes | int]) -> None:
        for key in keys:
            del self.data[key]
            self.lru.remove(key)
        if keys:
            self.expected_events.append(("evicted", tuple(keys)))
            self.counts["evictions"] += len(keys)

    def slot_of_each(self) -> dict[bytes | int, int]:
        """Where each block lives, found by its tag in the tier's memory (not asked of the store)."""
        assert self.tier is not None
        base, total = self.tier.base_address, self.tier.slots_total
        by_tag = {raw(base + s * SLOT, TAG): s for s in range(total)}
        return {key: by_tag[value[:TAG]] for key, value in self.data.items()}

    async def _collect(self) -> None:
        assert self.store is not None
        async for event in self.store.events():
            self.seen.append(event)

    async def _settle(self) -> None:
        for _ in range(5):
            await asyncio.sleep(0)

    # -- rules -------------------------------------------------------------------------------

    @initialize(slots=st.integers(1, 10))
    def open(self, slots: int) -> None:
        cfg = HostTierConfig(
            quota=slots * SLOT, max_quota=MAX_SLOTS * SLOT, slot_size=SLOT, commit_unit=4 * SLOT, fill_chunk=8 * SLOT
        )
        self.tier = self.run(HostTier.open(cfg))
        self.run(self.tier.wait_resident())
        self.store = self.run(BlockStore.open(self.tier, policy="lru", event_limit=10_000))
        self.total = slots

        async def start() -> asyncio.Task[None]:
            task = asyncio.ensure_future(self._collect())
            await asyncio.sleep(0)
            return task

        self.collector = self.run(start())

    @rule(
        keys=key_lists,
        lengths=st.lists(st.integers(TAG, SLOT), min_size=MAX_SLOTS + 4, max_size=MAX_SLOTS + 4),
        form=st.sampled_from(["numpy", "bytes", "bytearray", "memoryview", "mixed"]),
        wait=st.booleans(),
    )
    def store_pages(self, keys: list[bytes | int], lengths: list[int], form: str, wait: bool) -> None:
        assert self.store is not None
        n = len(keys)
        if form == "numpy":
            pages = [self.page(lengths[0]) for _ in range(n)]
            src: Any = np.frombuffer(b"".join(pages), dtype=np.uint8).reshape(n, lengths[0]).copy()
        else:
            pages = [self.page(lengths[i]) for i in range(n)]
            kinds = [bytes, bytearray, lambda b: memoryview(bytearray(b))]
            pick = {"bytes": 0, "bytearray": 1, "memoryview": 2}
            src = [kinds[pick[form] if form in pick else i % 3](p) for i, p in enumerate(pages)]

        present = [k for k in keys if k in self.data]
        missing = [k for k in keys if k not in self.data]
        self.touch(present)
        free = self.total - len(self.data)
        # LRU victims: the oldest blocks, never the present keys of this very call (its prefix).
        evictable = [k for k in self.lru if k not in present]
        victims = evictable[: max(0, min(len(missing) - free, len(evictable)))]
        self.evict(victims)
        room = self.total - len(self.data)
        stored, skipped = missing[:room], missing[room:]
        for key in stored:
            self.data[key] = pages[keys.index(key)]
            self.lru.append(key)
        if stored:
            self.expected_events.append(("stored", tuple(stored)))

        result = self.run(self.store.store(keys, src, wait=wait))

        assert result.stored == tuple(stored)
        assert result.present == tuple(present)
        assert result.skipped == tuple(skipped)
        self.counts["stores"] += len(stored)
        self.counts["present"] += len(present)
        self.counts["skipped"] += len(skipped)
        self.counts["bytes_stored"] += sum(len(self.data[k]) for k in stored)

    @rule(
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=8),
        extra=st.integers(0, 64),
        form=st.sampled_from(["numpy", "bytearray", "memoryview"]),
    )
    def load(self, keys: list[bytes | int], extra: int, form: str) -> None:
        assert self.store is not None
        lengths = [len(self.data[k]) if k in self.data else TAG for k in keys]
        if form == "numpy":
            dst: Any = np.full((len(keys), min(max(lengths) + extra, SLOT)), 0xEE, dtype=np.uint8)
            pages = list(dst)
        else:
            buffers = [bytearray(b"\xee" * min(n + extra, SLOT)) for n in lengths]
            dst = buffers if form == "bytearray" else [memoryview(b) for b in buffers]
            pages = [np.frombuffer(b, dtype=np.uint8) for b in buffers]
        before = [bytes(p) for p in pages]
        missing = next((k for k in keys if k not in self.data), None)
        if missing is not None:
            with pytest.raises(BlockNotFound) as info:
                self.run(self.store.load(keys, dst))
            assert info.value.key == missing and type(info.value.key) is type(missing)
            assert repr(missing) in str(info.value)
            assert isinstance(info.value, KeyError)
            assert [bytes(p) for p in pages] == before, "a failed load copied something"
            return
        self.run(self.store.load(keys, dst))
        self.touch(keys)
        for key, page in zip(keys, pages, strict=True):
            want = self.data[key]
            assert bytes(page[: len(want)]) == want, f"block {key!r} came back different"
            assert not (page[len(want) :] != 0xEE).any(), f"load of {key!r} wrote past the block's length"
        self.counts["loads"] += len(keys)
        self.counts["bytes_loaded"] += sum(len(self.data[k]) for k in keys)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=0, max_size=8))
    def lookup(self, keys: list[bytes | int]) -> None:
        assert self.store is not None
        hits = 0
        for key in keys:
            if key not in self.data:
                break
            hits += 1
        assert self.store.lookup(keys) == hits
        self.touch(keys[:hits])
        self.counts["queries"] += 1
        self.counts["hits"] += hits
        self.counts["misses"] += len(keys) - hits

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=0, max_size=8))
    def discard(self, keys: list[bytes | int]) -> None:
        assert self.store is not None
        dropped: list[bytes | int] = []
        for key in keys:
            if key in self.data and key not in dropped:
                dropped.append(key)
        assert self.store.discard(keys) == len(dropped)
        for key in dropped:
            del self.data[key]
            self.lru.remove(key)
        if dropped:
            self.expected_events.append(("discarded", tuple(dropped)))
        self.counts["discards"] += len(dropped)

    @rule(slots=st.integers(1, MAX_SLOTS))
    def resize(self, slots: int) -> None:
        assert self.store is not None and self.tier is not None
        if slots < self.total:
            where = self.slot_of_each()
            past = sorted((k for k in self.data if where[k] >= slots), key=lambda k: where[k])
            for key in past:  # evicted in slot order
                del self.data[key]
                self.lru.remove(key)
            if past:
                self.expected_events.append(("evicted", tuple(past)))
                self.counts["evictions"] += len(past)
        self.run(self.store.resize(slots * SLOT))
        self.run(self.tier.wait_resident())
        self.total = slots

    @rule()
    def use_outside_the_rules(self) -> None:
        """Keys that are not keys, and 1 against b"\\x01"."""
        assert self.store is not None
        for bad in (True, 1.0, "k"):
            with pytest.raises(TypeError):
                self.store.lookup([bad])
            assert bad not in self.store
        assert (1 in self.store) == (1 in self.data)
        assert (b"\x01" in self.store) == (b"\x01" in self.data)

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def store_matches_model(self) -> None:
        if self.store is None or self.tier is None:
            return
        self.run(self._settle())
        got = [(e.kind, e.keys) for e in self.seen]
        assert got == self.expected_events, "events differ from the model's"
        assert all(e.dropped == 0 for e in self.seen)
        assert len(self.store) == len(self.data)
        tier_stats = self.tier.statistics()
        assert tier_stats.slots_allocated == len(self.store)
        assert tier_stats.slots_total == self.total
        for key in KEYS:
            assert (key in self.store) == (key in self.data), f"{key!r} in store disagrees with the model"
        stats = self.store.statistics()
        assert stats.policy == "lru"
        assert stats.blocks == len(self.data)
        assert stats.capacity == self.total
        assert stats.in_flight == 0 and stats.blocks_pinned == 0
        for name, value in self.counts.items():
            assert getattr(stats, name) == value, f"statistics().{name} is {getattr(stats, name)}, model {value}"
        # The bytes of every block, read from the tier's memory (touches nothing).
        base = self.tier.base_address
        for key, slot in self.slot_of_each().items():
            assert raw(base + slot * SLOT, len(self.data[key])) == self.data[key]

    def teardown(self) -> None:
        try:
            if self.store is not None and self.tier is not None:
                self.run(self.store.aclose())
                self.run(asyncio.wait_for(self.collector, STEP_TIMEOUT))  # the stream ends at close
                assert not self.tier.closed, "closing the store closed the tier"
                assert self.tier.statistics().slots_allocated == 0, "aclose kept slots"
                with pytest.raises(TierClosedError):
                    self.store.lookup([1])
            if self.tier is not None:
                self.run(self.tier.aclose())
        finally:
            self.runner.close()


class UvloopStoreMachine(StoreMachine):
    pass


try:
    import uvloop

    UvloopStoreMachine.loop_factory = uvloop.new_event_loop
except ImportError:  # pragma: no cover
    pass

_settings = settings(max_examples=25, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck))
TestStoreModelAsyncio = StoreMachine.TestCase
TestStoreModelAsyncio.settings = _settings
TestStoreModelUvloop = UvloopStoreMachine.TestCase
TestStoreModelUvloop.settings = _settings
