"""Eviction policies, driven directly (no store, no event loop)."""

from __future__ import annotations

import random
import tracemalloc
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from aiokvtier._store._policy import EvictionPolicy, Key, LRUPolicy, S3FIFOPolicy, make_policy

MILLION = 1 << 20


def ids(slots: Iterable[int]) -> npt.NDArray[np.int64]:
    return np.fromiter(slots, dtype=np.int64)


class Cache:
    """The store's side of the policy contract, reduced to keys and slots: a miss evicts the first victim."""

    def __init__(self, policy: str | EvictionPolicy, capacity: int) -> None:
        self.policy = make_policy(policy, capacity)
        self.slot_of: dict[Key, int] = {}
        self.key_of: dict[int, Key] = {}
        self.free = list(range(capacity - 1, -1, -1))

    def get(self, key: Key) -> bool:
        """Look ``key`` up, storing it on a miss; whether it hit."""
        slot = self.slot_of.get(key)
        if slot is not None:
            self.policy.accessed(ids([slot]))
            return True
        if not self.free:
            victims = self.policy.victims()
            victim = next(victims)
            self.policy.removed(victim)
            victims.close()
            del self.slot_of[self.key_of.pop(victim)]
            self.free.append(victim)
        slot = self.free.pop()
        self.slot_of[key] = slot
        self.key_of[slot] = key
        self.policy.inserted(slot, key)
        return False


def replay_hit_rate(policy: str | EvictionPolicy, trace: Sequence[Key], capacity: int) -> float:
    cache = Cache(policy, capacity)
    return sum(map(cache.get, trace)) / len(trace)


def skip_all(policy: EvictionPolicy) -> list[int]:
    """Every candidate of one episode in which the store skips them all."""
    return list(policy.victims())


# --- LRU -----------------------------------------------------------------------------------------------------------


class SmallQueueLRU(LRUPolicy):
    """Rebuilds queues of a few entries, so that a handful of blocks reaches every queue path."""

    _MIN_QUEUE = 2


class ReferenceLRU:
    """An OrderedDict LRU with the policy's rules: a batch is one moment (lower slot id older), and an episode offers a
    slot once."""

    def __init__(self) -> None:
        self.order: OrderedDict[int, None] = OrderedDict()

    def inserted(self, slot: int) -> None:
        self.order[slot] = None

    def accessed(self, slots: Iterable[int]) -> None:
        for slot in slots:  # in the batch's order: the last one hit is the most recent
            if slot in self.order:
                self.order.move_to_end(slot)

    def next_victim(self, offered: set[int]) -> int | None:
        return next((s for s in self.order if s not in offered), None)


def run_episode(policy: LRUPolicy, ref: ReferenceLRU, decisions: Sequence[str], drain: bool) -> None:
    """One eviction episode on both; ``decisions``: evict, skip, or refill (evict and store a block in the slot)."""
    victims = policy.victims()
    offered: set[int] = set()
    for decision in decisions:
        got = next(victims, None)
        assert got == ref.next_victim(offered)
        if got is None:
            break
        offered.add(got)
        if decision in ("evict", "refill"):
            policy.removed(got)
            del ref.order[got]
        if decision == "refill":
            policy.inserted(got, got)
            ref.inserted(got)
    else:
        if drain:
            assert list(victims) == [s for s in ref.order if s not in offered]
    victims.close()


class LRUMachine(RuleBasedStateMachine):
    slot = st.integers(0, 10**6)

    @initialize(capacity=st.integers(1, 24), small_queue=st.booleans())
    def start(self, capacity: int, small_queue: bool) -> None:
        self.capacity = capacity
        self.policy = SmallQueueLRU(capacity) if small_queue else LRUPolicy(capacity)
        self.ref = ReferenceLRU()

    @rule(slot=slot)
    def insert(self, slot: int) -> None:
        slot %= self.capacity
        if slot in self.ref.order:
            with pytest.raises(ValueError, match="already holds"):
                self.policy.inserted(slot, slot)
            return
        self.policy.inserted(slot, slot)
        self.ref.inserted(slot)

    @rule(slots=st.lists(slot, max_size=8))
    def access(self, slots: list[int]) -> None:
        batch = [s % self.capacity for s in slots]
        self.policy.accessed(ids(batch))
        self.ref.accessed(batch)

    @rule(slot=slot)
    def remove(self, slot: int) -> None:
        slot %= self.capacity
        if slot not in self.ref.order:
            with pytest.raises(KeyError):
                self.policy.removed(slot)
            return
        self.policy.removed(slot)
        del self.ref.order[slot]

    @rule(decisions=st.lists(st.sampled_from(["evict", "skip", "refill"]), max_size=12), drain=st.booleans())
    def episode(self, decisions: list[str], drain: bool) -> None:
        run_episode(self.policy, self.ref, decisions, drain)

    @rule(capacity=st.integers(1, 24))
    def resize(self, capacity: int) -> None:
        if any(s >= capacity for s in self.ref.order):
            with pytest.raises(ValueError, match="past the new end"):
                self.policy.resize(capacity)
            return
        self.policy.resize(capacity)
        self.capacity = capacity

    @invariant()
    def same_size(self) -> None:
        assert len(self.policy) == len(self.ref.order)

    @invariant()
    def tracks_the_same_slots(self) -> None:
        tracked = self.policy.tracked()
        assert len(tracked) == self.capacity and np.flatnonzero(tracked).tolist() == sorted(self.ref.order)


TestLRUMachine = LRUMachine.TestCase
TestLRUMachine.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


def test_lru_matches_reference_past_the_first_queue() -> None:
    """Thousands of blocks, the real queue size (1,024 entries of 5,000), batches with repeats, long episodes."""
    rnd = random.Random(7)
    capacity = 5000
    policy, ref = LRUPolicy(capacity), ReferenceLRU()
    for step in range(4000):
        op = rnd.random()
        if op < 0.45:
            free = rnd.sample(range(capacity), 20)
            for slot in free:
                if slot not in ref.order:
                    policy.inserted(slot, slot)
                    ref.inserted(slot)
        elif op < 0.8:
            batch = [rnd.randrange(capacity) for _ in range(rnd.randrange(1, 300))]
            policy.accessed(ids(batch))
            ref.accessed(batch)
        elif op < 0.85 and ref.order:
            slot = rnd.choice(list(ref.order))
            policy.removed(slot)
            del ref.order[slot]
        else:
            decisions = rnd.choices(["evict", "skip", "refill"], weights=[6, 2, 1], k=rnd.randrange(1, 400))
            run_episode(policy, ref, decisions, drain=step % 50 == 0)
        assert len(policy) == len(ref.order)


def test_lru_skipping_every_block_ends() -> None:
    policy = SmallQueueLRU(100)
    for slot in range(100):
        policy.inserted(slot, slot)
    policy.accessed(ids(range(0, 100, 2)))
    order = list(range(1, 100, 2)) + list(range(0, 100, 2))
    assert skip_all(policy) == order
    assert skip_all(policy) == order  # the skipped blocks are still queued, in order
    assert len(policy) == 100


def test_lru_accessed_ignores_blocks_not_tracked() -> None:
    policy = LRUPolicy(8)
    for slot in (1, 2):
        policy.inserted(slot, slot)
    policy.accessed(ids([0, 1, 7]))
    assert len(policy) == 2
    assert skip_all(policy) == [2, 1]
    policy.accessed(ids([]))


def test_lru_at_a_million_blocks() -> None:
    policy = LRUPolicy(MILLION)
    for slot in range(MILLION):
        policy.inserted(slot, slot)
    hot = np.random.default_rng(0).choice(MILLION, 4096, replace=False).astype(np.int64)
    policy.accessed(hot)
    victims = policy.victims()
    taken = [next(victims) for _ in range(5000)]
    for slot in taken:
        policy.removed(slot)
    victims.close()
    hot_set = set(hot.tolist())
    assert taken == [s for s in range(MILLION) if s not in hot_set][:5000]
    assert len(policy) == MILLION - 5000


def test_lru_state_per_block_at_a_million_blocks() -> None:
    """Stamps, presence and a built queue (the store's steady state) stay within 40 bytes a block."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        policy = LRUPolicy(MILLION)
        for slot in range(MILLION):
            policy.inserted(slot, slot)
        policy.accessed(np.arange(0, MILLION, 256, dtype=np.int64))
        victims = policy.victims()
        policy.removed(next(victims))
        victims.close()
        per_block = (tracemalloc.get_traced_memory()[0] - before) / MILLION
    finally:
        tracemalloc.stop()
    assert len(policy) == MILLION - 1
    assert per_block <= 40


# --- S3-FIFO -------------------------------------------------------------------------------------------------------


def working_set_then_scan(policy: str) -> Cache:
    """A working set of 20 keys hit repeatedly, then a scan of 500 keys seen once, in a cache of 100."""
    cache = Cache(policy, 100)
    for _ in range(5):
        for key in range(20):
            cache.get(key)
    for key in range(1000, 1500):
        cache.get(key)
    return cache


def test_s3fifo_scan_does_not_evict_the_working_set() -> None:
    assert all(key in working_set_then_scan("s3fifo").slot_of for key in range(20))
    assert not any(key in working_set_then_scan("lru").slot_of for key in range(20))
    trace = [*range(20)] * 5 + [*range(1000, 1500)] + [*range(20)] * 5
    assert replay_hit_rate("s3fifo", trace, 100) > replay_hit_rate("lru", trace, 100)


def test_s3fifo_ghost_readmits_to_main() -> None:
    cache = Cache("s3fifo", 10)
    policy = cache.policy
    assert isinstance(policy, S3FIFOPolicy)
    for key in range(11):  # the 11th evicts key 0, never hit, from small: its hash joins the ghost
        cache.get(key)
    assert 0 not in cache.slot_of
    assert "main 0, ghost 1" in repr(policy)
    cache.get(0)
    assert "small 9, main 1, ghost 1" in repr(policy)  # key 0 left the ghost; key 1, evicted for it, came in
    # Key 0 now sits in main, so the next misses evict from small around it.
    for key in range(100, 109):
        cache.get(key)
    assert 0 in cache.slot_of


@pytest.mark.parametrize("name", ["lru", "s3fifo"])
def test_tracked_says_which_slots_hold_a_block_and_the_capacity(name: str) -> None:
    policy = make_policy(name, 8)
    policy.inserted_many(ids([5, 1, 6]), [5, 1, 6])
    policy.removed(1)
    tracked = policy.tracked()
    assert tracked is not None and tracked.dtype == np.bool_
    assert np.flatnonzero(tracked).tolist() == [5, 6] and len(tracked) == 8
    tracked[:] = False  # a copy: the policy is untouched
    policy.resize(12)
    after = policy.tracked()
    assert after is not None and np.flatnonzero(after).tolist() == [5, 6] and len(after) == 12


def test_tracked_is_not_said_by_default() -> None:
    class Silent(EvictionPolicy):
        name = "silent"

        def inserted(self, slot: int, key: Key) -> None:
            pass

        def accessed(self, slots: npt.NDArray[np.int64]) -> None:
            pass

        def removed(self, slot: int) -> None:
            pass

        def victims(self) -> Iterator[int]:
            return iter(())

        def __len__(self) -> int:
            return 0

    assert Silent().tracked() is None


def test_s3fifo_victims_end_when_every_candidate_is_skipped() -> None:
    policy = S3FIFOPolicy(50)
    for slot in range(50):
        policy.inserted(slot, slot)
    policy.accessed(ids(range(0, 50, 3)))
    policy.accessed(ids(range(0, 50, 6)))
    for _ in range(3):
        offered = skip_all(policy)
        assert sorted(offered) == list(range(50))
    assert len(policy) == 50
    victims = policy.victims()
    first = next(victims)
    policy.removed(first)
    victims.close()
    assert len(policy) == 49
    assert first not in skip_all(policy)


def test_s3fifo_skipped_then_removed_block_does_not_end_the_episode_early() -> None:
    policy = S3FIFOPolicy(10)
    for slot in range(10):
        policy.inserted(slot, slot)
    victims = policy.victims()
    first, second = next(victims), next(victims)  # both skipped
    policy.removed(first)  # a discard of a block the episode skipped
    policy.removed(second)
    policy.inserted(first, b"again")
    rest = list(victims)
    assert first not in rest  # a slot is offered once per episode, even with a new block in it
    assert sorted([first, second, *rest]) == list(range(10))


def test_s3fifo_bookkeeping() -> None:
    policy = S3FIFOPolicy(4)
    with pytest.raises(KeyError):
        policy.removed(0)
    for slot in range(4):
        policy.inserted(slot, slot)
    with pytest.raises(ValueError, match="already holds"):
        policy.inserted(2, 2)
    with pytest.raises(IndexError):
        policy.inserted(4, 4)
    policy.removed(0)
    policy.inserted(0, b"new")  # its old queue entry is stale, not a second copy
    assert skip_all(policy) == [1, 2, 3, 0]
    policy.accessed(ids([0, 3]))
    assert len(policy) == 4
    with pytest.raises(ValueError, match="past the new end"):
        policy.resize(3)
    policy.removed(3)
    policy.resize(3)
    assert len(policy) == 3
    assert sorted(skip_all(policy)) == [0, 1, 2]
    policy.resize(6)
    policy.inserted(5, 5)
    assert sorted(skip_all(policy)) == [0, 1, 2, 5]
    assert len(policy) == 4


def test_s3fifo_random_operations_keep_the_contract() -> None:
    rnd = random.Random(3)
    capacity = 64
    policy = S3FIFOPolicy(capacity)
    tracked: set[int] = set()
    key = 0
    for _ in range(3000):
        op = rnd.random()
        if op < 0.4 and len(tracked) < capacity:
            slot = rnd.choice([s for s in range(capacity) if s not in tracked])
            key = rnd.randrange(200)  # keys come back, so the ghost readmits some
            policy.inserted(slot, key)
            tracked.add(slot)
        elif op < 0.7:
            policy.accessed(ids(rnd.randrange(capacity) for _ in range(rnd.randrange(1, 20))))
        elif op < 0.75 and tracked:
            slot = rnd.choice(sorted(tracked))
            policy.removed(slot)
            tracked.discard(slot)
        else:
            offered: list[int] = []
            for slot in policy.victims():
                assert slot in tracked
                offered.append(slot)
                if rnd.random() < 0.5:
                    policy.removed(slot)
                    tracked.discard(slot)
                if rnd.random() < 0.1:
                    break
            assert len(offered) == len(set(offered))
        assert len(policy) == len(tracked)


def test_s3fifo_accessed_ignores_blocks_not_tracked() -> None:
    policy = S3FIFOPolicy(8)
    policy.inserted(1, 1)
    policy.accessed(ids([0, 1, 7]))
    policy.accessed(ids([]))
    assert len(policy) == 1
    assert skip_all(policy) == [1]


# --- make_policy ---------------------------------------------------------------------------------------------------


def test_make_policy_by_name() -> None:
    assert isinstance(make_policy("lru", 4), LRUPolicy)
    assert isinstance(make_policy("s3fifo", 4), S3FIFOPolicy)
    assert make_policy("lru", 4).name == "lru"
    assert make_policy("s3fifo", 4).name == "s3fifo"


@pytest.mark.parametrize("cls", [LRUPolicy, S3FIFOPolicy])
def test_make_policy_passes_an_instance_through_resized(cls: type[LRUPolicy] | type[S3FIFOPolicy]) -> None:
    policy = cls(2)
    assert make_policy(policy, 10) is policy
    policy.inserted(9, 9)
    assert list(policy.victims()) == [9]


def test_make_policy_refuses_unknown_names_and_types() -> None:
    with pytest.raises(ValueError, match=r"unknown eviction policy 'lfu'; choose one of 'lru', 's3fifo'"):
        make_policy("lfu", 4)
    with pytest.raises(TypeError):
        make_policy(3, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        make_policy("lru", 0)
    with pytest.raises(TypeError):
        make_policy("s3fifo", True)


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_batched_insert_and_remove_refuse_bad_slots_and_change_nothing(policy: str) -> None:
    p = make_policy(policy, 8)
    p.inserted_many(ids([1, 2]), [b"a", b"b"])
    with pytest.raises(ValueError):
        p.inserted_many(ids([3, 4, 3]), [b"c", b"d", b"e"])  # a slot twice
    with pytest.raises(ValueError):
        p.inserted_many(ids([5, 2]), [b"f", b"g"])  # 2 holds a block
    with pytest.raises(KeyError):
        p.removed_many(ids([1, 6]))  # 6 holds none
    with pytest.raises(KeyError):
        p.removed_many(ids([1, 1]))
    if policy == "lru":  # the batched overrides check before they change anything
        assert len(p) == 2
        assert list(p.victims()) == [1, 2]
        p.removed_many(ids([2, 1]))
        assert len(p) == 0
        p.inserted_many(ids([3, 4]), [b"c", b"d"])
        assert list(p.victims()) == [3, 4]
