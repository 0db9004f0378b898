"""BlockStore under attack: cancellation at every await, concurrent churn, hostile input, a failing policy.

Host pages (no engine), on asyncio and uvloop. After every attack the store
must be whole (``whole``): nothing in flight, no pin, no claim, one tier slot
per visible block, the policy tracking exactly the visible blocks, and every
visible key loading its exact bytes.
"""

from __future__ import annotations

import asyncio
import ctypes
import random
from collections.abc import Awaitable, Callable, Iterator, Sequence
from functools import partial
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import pytest

from aiokvtier import (
    BlockNotFound,
    BlockStore,
    CopyEngine,
    CopyPlanError,
    FillError,
    HostTier,
    HostTierConfig,
    OutOfSlots,
    QuotaError,
    StaticHostMem,
    StoreResult,
    WouldBlock,
)
from aiokvtier._store._claims import Claim, Claims
from aiokvtier._store._policy import EvictionPolicy, Key, LRUPolicy
from aiokvtier._store._transfers import Transfers

from .conftest import PopulateGate
from .helpers import KiB, MiB, eventually, small_config
from .test_cancellation import cancel_during, sweep
from .test_store import SLOT, Events, Gate, bounded, held, hold, open_store, page, pages, store_then_hold

T = TypeVar("T")

__all__ = ["held", "store_then_hold"]  # fixtures used here

TIMEOUT_LONG = 10.0


def whole(tier: HostTier, store: BlockStore, universe: Sequence[Any] = ()) -> None:
    """Nothing in flight and the bookkeeping agrees with itself, the tier and the policy."""
    stats = store.statistics()
    assert stats.in_flight == 0 and stats.blocks_pinned == 0
    assert tier.statistics().slots_allocated == len(store) == stats.blocks
    # Also: no claim, no block being stored, every key a visible block's, the policy tracking exactly them.
    store.check_invariants(sole_user=True)
    if universe:
        assert len(store) == sum(1 for k in universe if k in store)


def through_host_engines(monkeypatch: pytest.MonkeyPatch, on: bool = True) -> None:
    """While ``on``, a store copies through the host-to-host engine it was given (it ignores one otherwise):
    the engine path without a GPU."""
    monkeypatch.setattr(Transfers, "host_engines", on)


@pytest.fixture
def claims(monkeypatch: pytest.MonkeyPatch) -> list[Claim]:
    """Every claim a store call makes from here on; ``live()`` those whose call has not ended."""
    made: list[Claim] = []
    open_claim = Claims.open

    def record(self: Claims, keys: list[Key], filling: bool) -> Claim:
        claim = open_claim(self, keys, filling)
        made.append(claim)
        return claim

    monkeypatch.setattr(Claims, "open", record)
    return made


def live(claims: list[Claim]) -> list[Claim]:
    """The claims still held: a call settles its claim's future as it gives the claim up."""
    return [c for c in claims if not c.future.done()]


def suffix(keys: Sequence[Any], result: StoreResult) -> None:
    """No key past a skipped one was stored (keys found present may lie anywhere)."""
    if result.stored and result.skipped:
        last_stored = max(keys.index(k) for k in result.stored)
        first_skipped = min(keys.index(k) for k in result.skipped)
        assert last_stored < first_skipped, f"stored {result.stored} after skipped {result.skipped} in {keys}"


async def exact(store: BlockStore, n: int = SLOT) -> None:
    """Every visible block loads the bytes its key was stored with (keys name their pages)."""
    keys = store.keys()
    dst = np.zeros((len(keys), n), dtype=np.uint8)
    await bounded(store.load(keys, dst))
    for key, row in zip(keys, dst, strict=True):
        assert row.tobytes() == page(key, n), f"block {key!r} holds other bytes"


async def cancel_after(call: Callable[[], Awaitable[Any]], steps: int) -> bool:
    """Run ``call()`` and cancel it after ``steps`` loop iterations; whether it was cancelled."""
    task = asyncio.ensure_future(call())
    for _ in range(steps):
        await asyncio.sleep(0)
    task.cancel()
    try:
        await bounded(task)
    except asyncio.CancelledError:
        return True
    return False


async def perhaps_cancelled(call: Awaitable[T], r: random.Random, steps: int) -> tuple[bool, T | None]:
    """Run ``call``, cancelled after 0 to ``steps`` loop iterations in 3 draws of 10: whether it ran to
    the end, and its result if it did. The caller's own cancellation (a sibling failed) propagates."""
    task = asyncio.ensure_future(call)
    try:
        if r.random() < 0.3:
            for _ in range(r.randint(0, steps)):
                await asyncio.sleep(0)
            task.cancel()
        try:
            return True, await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # this task's own cancellation: a sibling failed
            return False, None
    finally:
        task.cancel()  # a sibling failed: no call outlives the test


# -- cancellation -----------------------------------------------------------------------------------


async def test_cancel_store_at_every_step_with_eviction() -> None:
    """A tiny tier: every store evicts; cancelled after 0..N iterations, on every await it has."""
    async with open_store(4) as (tier, store):
        universe: list[int] = []
        cancelled = 0
        for steps in range(12):
            for shift in range(3):
                keys = [steps * 100 + shift * 10 + i for i in range(3)] + universe[-1:]  # one present key
                universe.extend(keys[:3])
                cancelled += await cancel_after(lambda keys=keys: store.store(keys, pages(keys)), steps)
                whole(tier, store, universe)
                await exact(store)
        assert cancelled > 0


async def test_cancel_store_by_sweep_while_the_tier_fills(gate: PopulateGate) -> None:
    cfg = small_config(quota=4 * MiB, max_quota=4 * MiB)
    async with HostTier(cfg) as tier, BlockStore(tier) as store:
        slot = tier.slot_size
        universe: list[int] = []
        for case, (how, delay) in enumerate(sweep(3, delays=(0, 0.0005, 0.001, 0.005), cancels=4)):
            gate.allow(case // 2 + 1)  # the fill moves on as the sweep goes
            keys = [case * 1000 + i for i in range(20)]
            universe += keys
            src = np.frombuffer(b"".join(page(k, slot) for k in keys), dtype=np.uint8).reshape(20, slot)
            call = partial(store.store, keys, src, wait=case % 2 == 0)
            await cancel_during(call, how, delay)
            whole(tier, store, universe)
            await exact(store, slot)
        gate.release_all()


async def test_cancel_a_store_waiting_for_another_stores_claim(store_then_hold: Gate) -> None:
    gate = store_then_hold
    async with open_store(4) as (tier, store):
        for first_cancelled in (False, True):
            for steps in range(6):
                store.discard(list(range(10)))
                hold(gate)
                first = asyncio.create_task(store.store([1, 2], pages([1, 2])))
                await gate.started()
                second = asyncio.create_task(store.store([3, 1], pages([3, 1])))
                for _ in range(steps):
                    await asyncio.sleep(0)
                second.cancel()
                if first_cancelled:
                    first.cancel()
                await gate.release()
                for task in (first, second):
                    try:
                        await bounded(task)
                    except asyncio.CancelledError:
                        pass
                whole(tier, store, range(10))
                await exact(store)


async def test_cancel_load_and_resize_at_every_step(store_then_hold: Gate) -> None:
    async with open_store(8) as (tier, store):
        for steps in range(10):
            keys = list(range(8))
            store.discard(keys)
            await bounded(store.store(keys, pages(keys)))
            dst = np.zeros((8, SLOT), dtype=np.uint8)
            if not await cancel_after(lambda keys=keys, dst=dst: store.load(keys, dst), steps):
                assert [r.tobytes() for r in dst] == [page(k) for k in keys]
            whole(tier, store, keys)
            await cancel_after(lambda: store.resize(4 * SLOT), steps)
            whole(tier, store, keys)
            await cancel_after(lambda: store.resize(8 * SLOT), steps)
            await bounded(store.resize(8 * SLOT))
            await bounded(tier.wait_resident())
            whole(tier, store, keys)
            await exact(store)


async def test_a_taskgroup_failure_cancels_stores_loads_and_discards() -> None:
    async with open_store(6) as (tier, store):
        rng = random.Random(7)
        for round_ in range(6):

            async def churn(seed: int) -> None:
                r = random.Random(seed)
                while True:
                    keys = r.sample(range(24), 4)
                    await store.store(keys, pages(keys))
                    here = [k for k in keys if k in store]
                    try:
                        await store.load(here, np.zeros((len(here), SLOT), dtype=np.uint8))
                    except BlockNotFound:
                        pass
                    store.discard(r.sample(range(24), 1))

            async def boom(delay: float) -> None:
                await asyncio.sleep(delay)
                raise LookupError("boom")

            with pytest.raises(ExceptionGroup):
                async with asyncio.timeout(TIMEOUT_LONG):
                    async with asyncio.TaskGroup() as tg:
                        for _ in range(8):
                            tg.create_task(churn(rng.random()))
                        tg.create_task(boom(0.001 * round_))
            whole(tier, store, range(24))
            await exact(store)


# -- concurrency ------------------------------------------------------------------------------------


async def test_overlapping_stores_with_bad_keys_duplicates_discards_and_resizes(gate: PopulateGate) -> None:
    """Many tasks on a tier that is still filling and too small: only the documented errors come out."""
    cfg = small_config(quota=2 * MiB, max_quota=4 * MiB)
    async with HostTier(cfg) as tier, BlockStore(tier) as store:
        slot = tier.slot_size
        data = {k: page(k, slot) for k in range(120)}
        errors: dict[str, int] = {}

        async def worker(seed: int) -> None:
            r = random.Random(seed)
            for _ in range(12):
                keys: list[Any] = r.sample(range(120), r.randint(1, 10))
                bad = r.random()
                if bad < 0.1:
                    keys.append(r.choice([True, 1.5, "k"]))
                elif bad < 0.2:
                    keys.append(keys[0])  # a duplicate, last
                elif bad < 0.3:
                    keys[-1] = np.int64(keys[-1])  # converted: fine
                src = np.zeros((len(keys), slot), dtype=np.uint8)
                for i, k in enumerate(keys):
                    if type(k) in (int, np.int64):
                        src[i] = np.frombuffer(data[int(k)], dtype=np.uint8)
                try:
                    result = await store.store(keys, src, wait=r.random() < 0.5)
                    assert len(result.stored) + len(result.present) + len(result.skipped) == len(keys)
                except (TypeError, ValueError) as exc:
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                    assert bad < 0.2, exc
                here = [k for k in range(120) if k in store][:6]
                dst = np.zeros((len(here), slot), dtype=np.uint8)
                try:
                    await store.load(here, dst)
                    assert all(dst[i].tobytes() == data[k] for i, k in enumerate(here))
                except BlockNotFound:
                    pass
                if r.random() < 0.2:
                    store.discard(r.sample(range(120), 3))
                await asyncio.sleep(0)

        async def resizer() -> None:
            for quota in (1, 3, 2, 4, 2):
                try:
                    await store.resize(quota * MiB)
                except QuotaError:
                    pass
                await asyncio.sleep(0.002)

        async with asyncio.timeout(TIMEOUT_LONG):
            async with asyncio.TaskGroup() as tg:
                tg.create_task(resizer())
                for i in range(24):
                    tg.create_task(worker(i))
                gate.allow(2)
                await asyncio.sleep(0.01)
                gate.release_all()
        assert errors, "no bad call was made"
        whole(tier, store, range(120))
        await exact(store, slot)


async def test_a_discard_of_keys_being_stored_ignores_them(store_then_hold: Gate) -> None:
    gate = store_then_hold
    async with open_store(4) as (tier, store):
        hold(gate)
        task = asyncio.create_task(store.store([1, 2], pages([1, 2])))
        await gate.started()
        assert store.discard([1, 2]) == 0
        await gate.release()
        assert (await bounded(task)).stored == (1, 2)
        whole(tier, store, [1, 2])
        await exact(store)


# -- hostile input --------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [True, 1.0, "x", np.bool_(True), None, [1]])
@pytest.mark.parametrize("where", ["first", "late"])
async def test_a_bad_key_in_a_full_tier_changes_nothing(bad: Any, where: str) -> None:
    async with open_store(4) as (tier, store):
        await bounded(store.store([1, 2, 3, 4], pages([1, 2, 3, 4])))
        keys = [bad, 10, 11] if where == "first" else [10, 11, 1, bad]
        with pytest.raises(TypeError):
            await bounded(store.store(keys, [b"x"] * 4))
        assert store.statistics().evictions == 0 and set(store.keys()) == {1, 2, 3, 4}
        whole(tier, store, [1, 2, 3, 4, 10, 11])
        await exact(store)


@pytest.mark.parametrize("wait", [True, False])
@pytest.mark.parametrize("at", [(0, 1), (0, 5), (3, 4), (4, 5), (1, 3)])
async def test_a_duplicate_key_anywhere_in_a_full_tier_changes_nothing(at: tuple[int, int], wait: bool) -> None:
    async with open_store(4) as (tier, store):
        await bounded(store.store([1, 2, 3, 4], pages([1, 2, 3, 4])))
        keys: list[Any] = [10, 11, 12, 13, 14, 15]
        keys[at[1]] = keys[at[0]]
        with pytest.raises(ValueError, match="twice"):
            await bounded(store.store(keys, pages(keys), wait=wait))
        assert store.statistics().evictions == 0
        keys = [1, 10, 2, 1]  # a present key twice
        with pytest.raises(ValueError, match="twice"):
            await bounded(store.store(keys, pages(keys), wait=wait))
        keys = [10, 11, 10]  # converted to the same key: np.int64(10) == 10
        with pytest.raises(ValueError, match="twice"):
            await bounded(store.store([10, 11, np.int64(10)], pages(keys), wait=wait))
        assert store.statistics().evictions == 0
        whole(tier, store, [1, 2, 3, 4, 10, 11])
        await exact(store)


async def test_a_float_or_bool_equal_to_a_stored_int_is_refused_late() -> None:
    """``1.0 == 1 == True`` for the dict: a late non-key must not pass as the stored key."""
    async with open_store(4) as (tier, store):
        await bounded(store.store([1], pages([1])))
        for bad in (1.0, True, np.float64(1.0)):
            with pytest.raises(TypeError):
                await bounded(store.store([7, bad], pages([7, 1])))
            with pytest.raises(TypeError):
                await bounded(store.store([1, bad], pages([1, 1])))
        assert store.statistics().present == 0
        whole(tier, store, [1, 7])


async def test_keys_from_numpy_arrays_generators_and_bytes_likes() -> None:
    async with open_store(16) as (tier, store):
        ints = np.arange(5, dtype=np.int64)
        assert (await bounded(store.store(ints, pages(list(range(5)))))).stored == (0, 1, 2, 3, 4)
        assert all(type(k) is int for k in store.keys())
        gen = (k for k in (5, 6))
        assert (await bounded(store.store(gen, pages([5, 6])))).stored == (5, 6)
        digests = np.array([b"d1", b"d2"], dtype="S2")
        assert (await bounded(store.store(digests, pages([b"d1", b"d2"])))).stored == (b"d1", b"d2")
        late = [b"b1", bytearray(b"b2"), memoryview(b"b3")]  # nothing of these stored yet
        assert (await bounded(store.store(late, pages([b"b1", b"b2", b"b3"])))).stored == (b"b1", b"b2", b"b3")
        assert (await bounded(store.store([], np.zeros((0, SLOT), dtype=np.uint8)))) == StoreResult((), (), ())
        await bounded(store.load([], []))
        assert store.discard([]) == 0 and store.lookup([]) == 0
        assert store.lookup(np.arange(3)) == 3 and store.discard(x for x in [b"d1"]) == 1
        with pytest.raises(TypeError):
            await bounded(store.store(b"ab", [b"a", b"b"]))
        with pytest.raises(TypeError):
            await bounded(store.store(5, [b"a"]))
        whole(tier, store, [*range(7), b"d1", b"d2", b"b1", b"b2", b"b3"])
        await exact(store)


async def test_int_keys_past_pythons_decimal_text_are_keys_and_named_by_size_in_errors() -> None:
    huge = 10**5000  # str() of it is a ValueError (Python's 4300 digits)
    async with open_store(4) as (tier, store):
        assert (await bounded(store.store([huge, -huge], pages([1, 2])))).stored == (huge, -huge)
        assert store.lookup([huge, -huge]) == 2
        store.check_invariants(sole_user=True)
        out = np.zeros((2, SLOT), dtype=np.uint8)
        await bounded(store.load([-huge, huge], out))
        assert out[0].tobytes() == page(2) and out[1].tobytes() == page(1)
        with pytest.raises(BlockNotFound, match=f"<an int of {(huge + 1).bit_length()} bits>") as missing:
            await bounded(store.load([huge, huge + 1], out))
        assert missing.value.key == huge + 1
        with pytest.raises(ValueError, match=f"block <an int of {huge.bit_length()} bits> has"):
            await bounded(store.load([huge], np.zeros((1, SLOT // 2), dtype=np.uint8)))
        assert store.discard([huge, -huge]) == 2
        whole(tier, store)


async def test_a_bytearray_key_after_a_stored_key_is_converted() -> None:
    async with open_store(4) as (tier, store):
        await bounded(store.store([b"a"], pages([b"a"])))
        result = await bounded(store.store([b"a", bytearray(b"b")], pages([b"a", b"b"])))
        assert result == StoreResult(stored=(b"b",), present=(b"a",), skipped=())
        whole(tier, store)


@pytest.mark.parametrize(
    "src",
    [
        np.zeros((2, SLOT), dtype=np.uint16),
        np.zeros((3, SLOT), dtype=np.uint8),
        np.zeros(2 * SLOT, dtype=np.uint8),
        np.zeros((2, 2 * SLOT), dtype=np.uint8)[:, ::2],
        [b"a"],
        [b"a", b""],
        [b"a", 5],
        "ab",
        5,
    ],
    ids=["uint16", "rows", "1-D", "strided", "short-list", "empty-page", "int-page", "str", "int"],
)
async def test_bad_pages_change_nothing(src: Any) -> None:
    async with open_store(2) as (tier, store):
        await bounded(store.store([1, 2], pages([1, 2])))
        with pytest.raises((TypeError, ValueError)):
            await bounded(store.store([3, 4], src))
        with pytest.raises((TypeError, ValueError)):
            await bounded(store.load([1, 2], src if not isinstance(src, list) else [bytearray(1), bytearray(0)]))
        readonly = np.zeros((2, SLOT), dtype=np.uint8)
        readonly.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            await bounded(store.load([1, 2], readonly))
        with pytest.raises(ValueError, match="read-only"):
            await bounded(store.load([1, 2], [bytes(SLOT), bytes(SLOT)]))
        assert store.statistics().evictions == 0
        whole(tier, store, [1, 2, 3, 4])
        await exact(store)


async def test_a_load_into_overlapping_destination_pages_is_refused_and_copies_nothing() -> None:
    """Two keys into one buffer (or views that overlap): the page would hold whichever copy landed last."""
    async with open_store(2) as (tier, store):
        await bounded(store.store([1, 2], pages([1, 2])))
        one = bytearray(SLOT)
        both = memoryview(bytearray(2 * SLOT))
        for dst in ([one, one], [both[:SLOT], both[SLOT // 2 : SLOT // 2 + SLOT]]):
            with pytest.raises(ValueError, match="two destination pages overlap"):
                await bounded(store.load([1, 2], dst))
        assert not any(one) and not any(both)
        await bounded(store.load([1, 2], [both[:SLOT], both[SLOT:]]))  # neighbours, not overlapping
        assert bytes(both) == pages([1, 2]).tobytes()
        whole(tier, store, [1, 2])


# -- a policy that fails ---------------------------------------------------------------------------


class Flaky(LRUPolicy):
    """LRU whose hooks raise while ``fail`` names them (after ``after`` successful calls)."""

    __slots__ = ("after", "fail")
    name = "flaky"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.fail: set[str] = set()
        self.after = 0

    def _maybe(self, hook: str) -> None:
        if hook in self.fail:
            if self.after <= 0:
                raise RuntimeError(f"policy {hook} failed")
            self.after -= 1

    def accessed(self, slots: npt.NDArray[np.int64]) -> None:
        self._maybe("accessed")
        super().accessed(slots)

    def inserted_many(self, slots: Sequence[int] | npt.NDArray[np.int64], keys: Sequence[Key]) -> None:
        self._maybe("inserted_many")
        super().inserted_many(slots, keys)

    def removed_many(self, slots: npt.NDArray[np.int64]) -> None:
        self._maybe("removed_many")
        super().removed_many(slots)

    def removed(self, slot: int) -> None:
        self._maybe("removed")
        super().removed(slot)

    def victims(self) -> Iterator[int]:
        for i, slot in enumerate(super().victims()):
            if i:
                self._maybe("victims")
            yield slot


async def test_a_policy_failing_in_accessed_or_inserted_many() -> None:
    policy = Flaky(4)
    async with open_store(4, policy=policy) as (tier, store):
        assert store.statistics().policy == policy.name
        await bounded(store.store([1, 2], pages([1, 2])))
        policy.fail = {"accessed"}
        with pytest.raises(RuntimeError):
            store.lookup([1, 2])  # nothing else happens
        dst = np.zeros((1, SLOT), dtype=np.uint8)
        with pytest.raises(RuntimeError):
            await bounded(store.load([1], dst))  # the copy ran; the pins are gone
        assert dst[0].tobytes() == page(1)
        with pytest.raises(RuntimeError):
            await bounded(store.store([1, 3], pages([1, 3])))  # the present key's touch fails: 3 is not stored
        assert 3 not in store
        whole(tier, store, [1, 2, 3])
        policy.fail = {"inserted_many"}
        with pytest.raises(RuntimeError):
            await bounded(store.store([3, 4, 5], pages([3, 4, 5])))  # 5 evicts 1
        assert [k for k in range(6) if k in store] == [2]
        policy.fail = set()
        whole(tier, store, range(6))
        assert (await bounded(store.store([3, 4], pages([3, 4])))).stored == (3, 4)
        await exact(store)


async def test_a_policy_failing_in_removed_many_after_a_cancelled_store(store_then_hold: Gate) -> None:
    gate = store_then_hold
    policy = Flaky(4)
    async with open_store(4, policy=policy) as (tier, store):
        assert store.statistics().policy == policy.name
        hold(gate)
        first = asyncio.create_task(store.store([1], pages([1])))
        await gate.started()
        waiter = asyncio.create_task(store.store([1], pages([1])))
        await asyncio.sleep(0.01)
        policy.fail = {"removed_many"}
        first.cancel()
        await gate.release()
        with pytest.raises((asyncio.CancelledError, RuntimeError)):
            await bounded(first)
        policy.fail = set()
        assert (await asyncio.wait_for(waiter, 1.0)).stored == (1,)  # hangs: the claim future is never set
        whole(tier, store, [1])


@pytest.mark.parametrize("hook", ["removed", "victims"])
async def test_a_policy_failing_in_the_middle_of_an_eviction(hook: str) -> None:
    policy = Flaky(4)
    async with open_store(4, policy=policy) as (tier, store):
        assert store.statistics().policy == policy.name
        await bounded(store.store([1, 2, 3, 4], pages([1, 2, 3, 4])))
        policy.fail, policy.after = {hook}, 1 if hook == "removed" else 0
        with pytest.raises(RuntimeError):
            await bounded(store.store([5, 6], pages([5, 6])))
        policy.fail = set()
        whole(tier, store, range(7))  # block 1 left the map, its slot stays taken and len() still counts it


async def test_a_policy_failing_in_removed_many_during_a_discard() -> None:
    policy = Flaky(4)
    async with open_store(4, policy=policy) as (tier, store):
        assert store.statistics().policy == policy.name
        await bounded(store.store([1, 2, 3, 4], pages([1, 2, 3, 4])))
        policy.fail = {"removed_many"}
        with pytest.raises(RuntimeError):
            store.discard([1])
        policy.fail = set()
        whole(tier, store, range(6))
        await bounded(store.store([5], pages([5])))  # AssertionError in _forget: a READY slot without a key


# -- resize ----------------------------------------------------------------------------------------


async def test_a_store_in_flight_takes_slots_of_a_grow_whose_resize_was_cancelled(gate: PopulateGate) -> None:
    cfg = small_config(quota=2 * MiB, max_quota=4 * MiB)  # two units of 16 slots
    async with HostTier(cfg) as tier, BlockStore(tier) as store:
        slot = tier.slot_size
        gate.allow(1)
        await bounded(tier.wait_resident(16 * slot))
        first = list(range(16))
        await bounded(store.store(first, pages(first, slot)))
        store.discard([0])  # one freed slot; 16 fresh ones, not resident
        keys = list(range(100, 117))  # 17: the freed slot and all 16 fresh ones
        pending = asyncio.create_task(store.store(keys, pages(keys, slot)))
        await asyncio.sleep(0.01)
        assert not pending.done()
        await bounded(store.store([200], pages([200], slot), wait=False))  # takes the freed slot
        resize = asyncio.create_task(store.resize(4 * MiB))
        await asyncio.sleep(0)
        resize.cancel()  # accepted by the tier, which grows; the store's maps do not follow
        with pytest.raises(asyncio.CancelledError):
            await bounded(resize)
        assert tier.slots_total == 64
        gate.release_all()
        result = await bounded(pending)  # IndexError: a slot id past the store's maps
        assert result.stored == tuple(keys)
        whole(tier, store, [*first, *keys, 200])


async def test_a_refused_shrink_evicts_nothing() -> None:
    async with open_store(8) as (tier, store):
        keys = list(range(6))
        await bounded(store.store(keys, pages(keys)))  # slots 0..5
        other = await bounded(tier.allocate())  # slot 6: the tier's other user
        with pytest.raises(QuotaError):
            await bounded(store.resize(4 * SLOT))
        assert [k for k in keys if k in store] == keys, "QuotaError, yet blocks 4 and 5 were evicted"
        tier.free(other)


class Switched(LRUPolicy):
    """LRU with a ``fail`` switch, off at first, for subclasses whose failure a test turns on."""

    __slots__ = ("fail",)

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.fail = False


class HalfInserts(Switched):
    """LRU with the base class's looping ``inserted_many``, whose ``inserted`` fails on the second block."""

    __slots__ = ()
    name = "half"

    def inserted(self, slot: int, key: Key) -> None:
        if self.fail and len(self) % 2:
            raise RuntimeError("policy inserted failed")
        super().inserted(slot, key)

    inserted_many = EvictionPolicy.inserted_many


async def test_a_policy_failing_half_way_through_the_default_inserted_many() -> None:
    policy = HalfInserts(4)
    async with open_store(4, policy=policy) as (tier, store):
        assert store.statistics().policy == policy.name
        policy.fail = True
        with pytest.raises(RuntimeError):
            await bounded(store.store([1, 2], pages([1, 2])))
        policy.fail = False
        assert (await bounded(store.store([3, 4], pages([3, 4])))).stored == (3, 4)  # slot 0 is "tracked" still
        whole(tier, store, range(5))


async def test_a_store_retrying_a_key_after_another_store_failed_follows_a_grown_tier(
    store_then_hold: Gate, claims: list[Claim]
) -> None:
    """The retry of a key whose other store failed takes a slot of a tier grown meanwhile."""
    gate = store_then_hold
    async with open_store(4) as (tier, store):
        await bounded(store.store([10, 11, 12], pages([10, 11, 12])))  # slots 0..2
        hold(gate)
        first = asyncio.create_task(store.store([1], pages([1])))  # slot 3: the tier is full
        await gate.started()
        (claim,) = live(claims)
        taken: list[int] = []
        # Runs before the waiting store resumes: the slot the failed store frees is gone again,
        # so the retry takes a fresh slot past the store's old capacity.
        claim.future.add_done_callback(lambda _: taken.append(tier.allocate_nowait()))
        second = asyncio.create_task(store.store([1], pages([1]), wait=False))
        await asyncio.sleep(0.01)
        await bounded(tier.resize(8 * SLOT))  # behind the store's back
        await bounded(tier.wait_resident())
        first.cancel()
        await gate.release()
        with pytest.raises(asyncio.CancelledError):
            await bounded(first)
        assert (await bounded(second)).stored == (1,)
        assert taken == [3] and store.slot(1) == 4
        tier.free(taken[0])
        whole(tier, store, [1, 10, 11, 12])
        await exact(store)


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
async def test_a_shrink_after_the_tier_grew_behind_the_stores_back_refuses_a_foreign_slot(policy: str) -> None:
    """The slot past the new end that another user holds lies past the store's maps: QuotaError, not IndexError."""
    async with open_store(4, policy=policy) as (tier, store):
        await bounded(store.store([1, 2], pages([1, 2])))  # slots 0, 1
        await bounded(tier.resize(16 * SLOT))  # behind the store's back: its maps still have 4 slots
        await bounded(tier.wait_resident())
        others = [await bounded(tier.allocate()) for _ in range(12)]
        tier.free_many(others[:-1])
        assert others[-1] == 13
        with pytest.raises(QuotaError, match="slot 13"):
            await bounded(store.resize(8 * SLOT))
        assert tier.slots_total == 16 and 1 in store and 2 in store
        tier.free(others[-1])
        await bounded(store.resize(8 * SLOT))
        keys = list(range(10, 16))
        assert (await bounded(store.store(keys, pages(keys)))).stored == tuple(keys)
        whole(tier, store, [1, 2, *keys])
        await exact(store)


@pytest.mark.parametrize("first_fails", [False, True])
async def test_a_cancelled_waiter_leaves_the_claim_to_the_other_waiters(
    store_then_hold: Gate, first_fails: bool, claims: list[Claim]
) -> None:
    """Two stores wait on a third's claim; cancelling one cancels neither the claim nor the other waiter."""
    gate = store_then_hold
    async with open_store(4) as (tier, store):
        hold(gate)
        first = asyncio.create_task(store.store([1], pages([1])))
        await gate.started()
        second = asyncio.create_task(store.store([1], pages([1])))
        third = asyncio.create_task(store.store([2, 1], pages([2, 1]), wait=False))
        await asyncio.sleep(0.01)
        (claim,) = (c for c in live(claims) if 1 in c.keys)
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await bounded(second)
        if first_fails:
            first.cancel()
        await gate.release()
        if first_fails:
            with pytest.raises(asyncio.CancelledError):
                await bounded(first)
            assert await bounded(third) == StoreResult(stored=(2, 1), present=(), skipped=())  # the retry stored it
        else:
            assert (await bounded(first)).stored == (1,)  # InvalidStateError: its claim's future was cancelled
            assert await bounded(third) == StoreResult(stored=(2,), present=(1,), skipped=())
        assert list(claim.future.result()) == ([] if first_fails else [1])
        whole(tier, store, [1, 2])
        await exact(store)


class GrowFails(Switched):
    """LRU whose grow fails (a policy out of memory) while ``fail`` is set."""

    __slots__ = ()
    name = "grow-fails"

    def resize(self, capacity: int) -> None:
        if self.fail and capacity > len(self._stamp):
            raise MemoryError("policy grow failed")
        super().resize(capacity)


async def test_a_policy_failing_to_follow_a_grown_tier_fails_the_store_that_waited(gate: PopulateGate) -> None:
    """Not a fill failure: the store does not skip its keys with the slots it was given still taken."""
    cfg = small_config(quota=2 * MiB, max_quota=4 * MiB)  # two units of 16 slots
    policy = GrowFails(32)
    async with HostTier(cfg) as tier, BlockStore(tier, policy=policy) as store:
        slot = tier.slot_size
        gate.allow(1)
        await bounded(tier.wait_resident(16 * slot))
        first = list(range(16))
        await bounded(store.store(first, pages(first, slot)))
        keys = list(range(100, 104))
        pending = asyncio.create_task(store.store(keys, pages(keys, slot)))  # waits for the second unit
        await asyncio.sleep(0.01)
        assert not pending.done()
        await bounded(tier.resize(4 * MiB))  # behind the store's back
        policy.fail = True
        gate.release_all()
        with pytest.raises(MemoryError):
            await bounded(pending)  # was: StoreResult(skipped=keys), its 4 slots taken for good
        whole(tier, store, [*first, *keys])
        policy.fail = False
        assert (await bounded(store.store(keys, pages(keys, slot)))).stored == tuple(keys)
        whole(tier, store, [*first, *keys])
        await exact(store, slot)


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
async def test_a_retry_after_another_store_failed_keeps_the_calls_present_prefix(
    store_then_hold: Gate, policy: str, claims: list[Claim]
) -> None:
    """The retry of a key makes room as any store does, but not by evicting the call's own prefix."""
    gate = store_then_hold
    async with open_store(2, policy=policy) as (tier, store):
        await bounded(store.store([2], pages([2])))  # slot 0
        hold(gate)
        first = asyncio.create_task(store.store([1], pages([1])))  # slot 1: the tier is full
        await gate.started()
        (claim,) = live(claims)
        taken: list[int] = []
        claim.future.add_done_callback(lambda _: taken.append(tier.allocate_nowait()))  # the freed slot 1
        second = asyncio.create_task(store.store([2, 1], pages([2, 1])))  # 2 present; waits on 1
        await asyncio.sleep(0.01)
        first.cancel()
        await gate.release()
        with pytest.raises(asyncio.CancelledError):
            await bounded(first)
        # Was stored=(1,), present=(2,), with 2 evicted by the retry to make room for 1.
        assert await bounded(second) == StoreResult(stored=(), present=(2,), skipped=(1,))
        assert taken == [1] and 2 in store
        tier.free(taken[0])
        whole(tier, store, [1, 2])
        await exact(store)


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
async def test_a_retry_after_another_store_failed_keeps_the_blocks_the_call_stored(
    store_then_hold: Gate, gate: PopulateGate, policy: str, claims: list[Claim]
) -> None:
    """The call's own stored blocks are never its victims, in the retry of a key either."""
    copies = store_then_hold
    cfg = small_config(quota=17 * 64 * KiB, max_quota=4 * MiB)  # a unit of 16 slots and a unit of one
    async with HostTier(cfg) as tier, BlockStore(tier, policy=policy) as store:
        slot = tier.slot_size
        gate.allow(1)
        await bounded(tier.wait_resident(16 * slot))
        others = await bounded(tier.allocate(16))  # slots 0..15: another user's
        first = asyncio.create_task(store.store([1], pages([1], slot)))  # waits for slot 16's fill
        await asyncio.sleep(0.01)
        (claim,) = live(claims)
        tier.free(others.pop(0))
        second = asyncio.create_task(store.store([3, 1], pages([3, 1], slot)))  # 3 lands in slot 0; waits on 1
        await eventually(lambda: 3 in store)
        await asyncio.sleep(0.01)
        assert not second.done()
        taken: list[int] = []
        claim.future.add_done_callback(lambda _: taken.append(tier.allocate_nowait()))  # the freed slot 16
        hold(copies)
        gate.release_all()
        await copies.started()  # the first store copies into slot 16
        first.cancel()
        await copies.release()
        with pytest.raises(asyncio.CancelledError):
            await bounded(first)
        # Was stored=(3, 1), with 3 evicted by the retry to make room for 1.
        assert await bounded(second) == StoreResult(stored=(3,), present=(), skipped=(1,))
        assert taken == [16] and 3 in store
        tier.free_many([*others, *taken])
        whole(tier, store, [1, 3])
        await exact(store, slot)


def consistent(tier: HostTier, store: BlockStore) -> None:
    """What holds at every await, calls in flight or not: the maps, the policy and the tier agree on every slot
    (and, at an await where no store or load is in flight, nothing is pinned, claimed or being stored)."""
    store.check_invariants()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
@pytest.mark.parametrize("engine", ["none", "laggy"])
async def test_churn_with_resizes_of_the_store_and_of_the_tier_behind_its_back(
    gate: PopulateGate, engine: str, policy: str, seed: int
) -> None:
    """Stores (waiting or not), loads, discards, resizes of the store and of the tier itself, another user's
    slots, a fill still running, and cancellations at random steps; ``consistent`` at every loop iteration.
    With a stand-in engine, copies are reported issued a few loop iterations late, as a CopyEngine's are."""
    cfg = small_config(quota=2 * MiB, max_quota=4 * MiB)  # 32 slots of 64 slots at most
    rng = random.Random(seed)
    copies = LaggyEngine(rng.random()) if engine == "laggy" else None
    async with HostTier(cfg) as tier, BlockStore(tier, copies, policy) as store:  # type: ignore[arg-type]
        slot = tier.slot_size
        data = {k: np.frombuffer(page(k, slot), dtype=np.uint8) for k in range(100)}
        theirs: list[int] = []  # another user's slots
        done = False

        async def checker() -> None:
            while not done:
                consistent(tier, store)
                await asyncio.sleep(0)

        async def storer(r: random.Random) -> None:
            for _ in range(25):
                keys = r.sample(range(100), r.randint(1, 12))

                async def call(keys: list[int] = keys) -> None:
                    result = await store.store(keys, np.stack([data[k] for k in keys]), wait=r.random() < 0.5)
                    assert sorted(result.stored + result.present + result.skipped) == sorted(keys)
                    suffix(keys, result)

                await perhaps_cancelled(call(), r, 6)
                await asyncio.sleep(0)

        async def loader(r: random.Random) -> None:
            for _ in range(40):
                here = [k for k in r.sample(range(100), 20) if k in store][:8]
                dst = np.zeros((len(here), slot), dtype=np.uint8)
                try:
                    if (await perhaps_cancelled(store.load(here, dst), r, 6))[0]:
                        assert all((dst[i] == data[k]).all() for i, k in enumerate(here))
                except BlockNotFound:
                    pass  # evicted or discarded before the load began
                await asyncio.sleep(0)

        async def discarder(r: random.Random) -> None:
            for _ in range(40):
                store.discard(r.sample(range(100), 2))
                await asyncio.sleep(r.random() * 0.002)

        async def resizer(r: random.Random, resize: Callable[[int], Awaitable[None]]) -> None:
            for _ in range(12):
                try:
                    await perhaps_cancelled(resize(r.randint(8, 64) * slot), r, 6)
                except QuotaError:
                    pass
                await asyncio.sleep(r.random() * 0.003)

        async def other_user(r: random.Random) -> None:
            for _ in range(40):
                if theirs and r.random() < 0.5:
                    tier.free(theirs.pop(r.randrange(len(theirs))))
                else:
                    try:
                        theirs.append(tier.allocate_nowait())
                    except (WouldBlock, OutOfSlots):
                        pass
                await asyncio.sleep(r.random() * 0.002)

        async def fill() -> None:
            for unit in range(1, 65):
                gate.allow(unit)
                await asyncio.sleep(0.001)
            gate.release_all()

        async def work() -> None:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(fill())
                tg.create_task(resizer(random.Random(rng.random()), store.resize))
                tg.create_task(resizer(random.Random(rng.random()), tier.resize))
                tg.create_task(other_user(random.Random(rng.random())))
                tg.create_task(discarder(random.Random(rng.random())))
                for _ in range(6):
                    tg.create_task(storer(random.Random(rng.random())))
                for _ in range(3):
                    tg.create_task(loader(random.Random(rng.random())))

        async with asyncio.timeout(TIMEOUT_LONG * 3):
            async with asyncio.TaskGroup() as tg:
                tg.create_task(checker())
                try:
                    await work()
                finally:
                    done = True
                    gate.release_all()
        tier.free_many(theirs)
        consistent(tier, store)
        whole(tier, store, range(100))
        await exact(store, slot)


class HeldEngine:
    """A stand-in CopyEngine (a device, host pages): copies at once and reports them issued when let.

    What matters here is the store's side of a CopyEngine: ``begin`` returns (``submitted``,
    ``done``) and the store's bookkeeping waits for ``submitted``, other tasks running meanwhile.
    """

    device = 0

    def __init__(self) -> None:
        self.hold = False
        self.held: list[asyncio.Future[None]] = []

    def check_open(self) -> None:
        pass

    def begin(
        self, tier: HostTier, slots: Any, addresses: Any, direction: str, *, after: Any = None, page: int = 0
    ) -> tuple[asyncio.Future[None], asyncio.Future[None]]:
        loop = asyncio.get_running_loop()
        for ours, theirs in zip(tier.slot_addresses(slots).tolist(), np.asarray(addresses).tolist(), strict=True):
            dst, src = (ours, theirs) if direction == "d2h" else (theirs, ours)
            ctypes.memmove(dst, src, page)
        submitted, done = loop.create_future(), loop.create_future()
        submitted.add_done_callback(lambda _: done.set_result(None))
        if self.hold:
            self.held.append(submitted)
        else:
            submitted.set_result(None)
        return submitted, done

    def start(
        self, tier: HostTier, slots: Any, pages: Any, direction: str, *, after: Any = None, report_issue: bool = False
    ) -> tuple[asyncio.Future[None], asyncio.Future[None]]:
        return self.begin(tier, slots, pages.addresses, direction, after=after, page=pages.page)

    async def copy(self, copies: list[tuple[int, int, int]], *, after: Any = None) -> None:
        for dst, src, n in copies:
            ctypes.memmove(dst, src, n)


class LaggyEngine(HeldEngine):
    """Reports each copy issued after a random number (0..8) of loop iterations."""

    def __init__(self, seed: float) -> None:
        super().__init__()
        self.hold = True
        self._rng = random.Random(seed)

    def begin(
        self, tier: HostTier, slots: Any, addresses: Any, direction: str, *, after: Any = None, page: int = 0
    ) -> tuple[asyncio.Future[None], asyncio.Future[None]]:
        submitted, done = super().begin(tier, slots, addresses, direction, after=after, page=page)
        self.held.clear()
        loop = asyncio.get_running_loop()

        def issue(steps: int) -> None:
            if steps:
                loop.call_soon(issue, steps - 1)
            elif not submitted.done():  # a store cancelled while waiting for it cancelled it
                submitted.set_result(None)

        issue(self._rng.randint(0, 8))
        return submitted, done


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
async def test_a_shrink_while_an_engine_store_waits_for_its_copy_to_be_issued_keeps_its_present_prefix(
    policy: str,
) -> None:
    """The present block is not dropped before the store touches it (past the shrunk policy: IndexError)."""
    engine = HeldEngine()
    async with open_store(4, engine=engine, policy=policy) as (tier, store):
        await bounded(store.store([10, 11, 12, 13], pages([10, 11, 12, 13])))  # slots 0..3
        store.discard([11, 12])
        engine.hold = True
        task = asyncio.create_task(store.store([13, 5], pages([13, 5])))  # 13 present in slot 3; 5 into slot 2
        await asyncio.sleep(0.01)
        assert len(engine.held) == 1
        try:
            with pytest.raises(QuotaError, match="slot 3 is being stored or loaded"):
                await bounded(store.resize(3 * SLOT))  # was accepted: 13 evicted, the policy cut to 3 slots
        finally:
            engine.hold = False
            engine.held[0].set_result(None)
        assert await bounded(task) == StoreResult(stored=(5,), present=(13,), skipped=())
        whole(tier, store, [5, 10, 11, 12, 13])
        await exact(store)


@pytest.mark.parametrize("taken_meanwhile", [False, True])
async def test_a_shrink_that_waits_for_a_grow_of_the_tier_made_behind_the_stores_back(taken_meanwhile: bool) -> None:
    """The shrink evicts, then waits for the tier's own resize: it shrinks after it or, when a slot past the
    new end was taken meanwhile, is refused by the tier with the blocks it evicted gone (documented)."""
    policy = LRUPolicy(8)
    async with open_store(8, policy=policy) as (tier, store):
        keys = list(range(8))
        await bounded(store.store(keys, pages(keys)))
        grow = asyncio.create_task(tier.resize(16 * SLOT))
        await asyncio.sleep(0)  # the grow holds the tier's resize lock while its fill target moves
        shrink = asyncio.create_task(store.resize(4 * SLOT))
        await asyncio.sleep(0)
        assert [k for k in keys if k in store] == [0, 1, 2, 3] and not shrink.done()
        new = list(range(10, 14))
        if taken_meanwhile:
            assert (await bounded(store.store(new, pages(new), wait=False))).stored == tuple(new)  # slots 4..7
        await bounded(grow)
        if taken_meanwhile:
            with pytest.raises(QuotaError, match="slot 7 past the new end"):
                await bounded(shrink)
            assert tier.slots_total == 16 and store.statistics().evictions == 4
        else:
            await bounded(shrink)
            tracked = policy.tracked()
            assert tier.slots_total == 4 and tracked is not None and len(tracked) == 4  # as is the store (whole)
        whole(tier, store, keys + new)
        consistent(tier, store)
        await exact(store)
        more = list(range(20, 40))
        await bounded(store.store(more, pages(more)))
        whole(tier, store, keys + new + more)
        consistent(tier, store)


class _EmptyDeviceArray:
    """A stand-in for an empty CUDA tensor: no pages, and (as torch gives one) a null data pointer."""

    def __init__(self, page: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (0, page),
            "typestr": "|u1",
            "data": (0, False),
            "strides": None,
            "version": 3,
        }


async def test_a_call_of_no_keys_with_an_engine_does_nothing() -> None:
    """As without an engine: the empty page array had no page size to find (ZeroDivisionError)."""
    async with open_store(4, engine=HeldEngine()) as (tier, store):
        await bounded(store.store([1], pages([1])))
        empties: list[Any] = [np.zeros((0, SLOT), dtype=np.uint8), _EmptyDeviceArray(SLOT), []]
        for empty in empties:
            assert await bounded(store.store([], empty)) == StoreResult((), (), ())
            await bounded(store.load([], empty))
        with pytest.raises(ValueError, match="one page per slot"):
            await bounded(store.store([], np.zeros((1, SLOT), dtype=np.uint8)))
        with pytest.raises(ValueError, match="expected 0 integer addresses"):
            await bounded(store.load([], [0x7F00_0000_0000]))
        whole(tier, store, [1])
        await exact(store)


@pytest.mark.parametrize("wait", [False, True])
@pytest.mark.parametrize("order", ["claimed_first", "claimed_last"])
async def test_a_store_that_does_not_wait_skips_a_key_whose_other_store_waits_for_the_fill(
    gate: PopulateGate, wait: bool, order: str
) -> None:
    """``wait=False`` never waits for the fill, also not through another store of the same key; the keys
    after the one it skips are skipped too (no key past a skipped one is stored)."""
    cfg = small_config(quota=2 * MiB, max_quota=4 * MiB)  # two units of 16 slots
    async with HostTier(cfg) as tier, BlockStore(tier) as store:
        slot = tier.slot_size
        gate.allow(1)
        await bounded(tier.wait_resident(16 * slot))
        first = list(range(16))
        await bounded(store.store(first, pages(first, slot)))
        other = asyncio.create_task(store.store([100], pages([100], slot)))  # waits for the second unit
        await asyncio.sleep(0.01)
        assert not other.done()
        store.discard([0])  # one resident slot free
        keys = [100, 101] if order == "claimed_first" else [101, 100]
        call = asyncio.create_task(store.store(keys, pages(keys, slot), wait=wait))
        if not wait:  # was: waiting, for the fill, for the other store (a timeout here)
            # Was stored=(101,), skipped=(100,) with 100 first: a stored key after a skipped one.
            expected = StoreResult(stored=(), present=(), skipped=(100, 101))
            if order == "claimed_last":
                expected = StoreResult(stored=(101,), present=(), skipped=(100,))
            assert await bounded(call) == expected
        else:
            await asyncio.sleep(0.05)
            assert not call.done()
        gate.release_all()
        assert (await bounded(other)).stored == (100,)
        result = await bounded(call)
        if wait:
            assert result == StoreResult(stored=(101,), present=(100,), skipped=())
        whole(tier, store, [*first, 100, 101])
        await exact(store, slot)


@pytest.mark.parametrize(
    ("keys", "loaded", "expected"),
    [
        # The retry of 1 takes the slot of 3, stored after it by the same call.
        ([1, 3], (), StoreResult(stored=(1,), present=(), skipped=(3,))),
        # 3 is being loaded: it cannot give its slot, and stays no stored key after the skipped 1.
        ([1, 3], (3,), StoreResult(stored=(), present=(), skipped=(1, 3))),
        # One slot to be had (4's, the latest): 1 keeps the call's prefix 1, 3; 2 and 4 are skipped.
        ([1, 3, 2, 4], (), StoreResult(stored=(1, 3), present=(), skipped=(2, 4))),
        # 4 is being loaded: 3 gives its slot to 1, and 3, 2 and 4 are skipped.
        ([1, 3, 2, 4], (4,), StoreResult(stored=(1,), present=(), skipped=(3, 2, 4))),
    ],
)
async def test_a_retry_that_finds_no_room_takes_the_slots_of_keys_the_call_stored_after_it(
    keys: list[int], loaded: tuple[int, ...], expected: StoreResult, claims: list[Claim]
) -> None:
    """No key past a skipped one is stored, also when the skip comes from the retry of a key whose other
    store failed: blocks the call stored after it give their slots to it, latest first, or are given up."""
    engine = HeldEngine()
    engine.hold = True
    retried = [k for k in keys if k in (1, 2)]
    async with open_store(len(keys), engine=engine) as (tier, store):
        events = await Events.start(store)
        first = asyncio.create_task(store.store(retried, pages(retried)))
        await eventually(lambda: len(engine.held) == 1)
        second = asyncio.create_task(store.store(keys, pages(keys)))  # waits on 1 (and 2); stores the rest
        await eventually(lambda: len(engine.held) == 2)
        engine.held[1].set_result(None)
        await eventually(lambda: all(k in store for k in keys if k not in retried))
        dst = np.zeros((len(loaded), SLOT), dtype=np.uint8)
        load = asyncio.create_task(store.load(list(loaded), dst))
        if loaded:
            await eventually(lambda: store.statistics().blocks_pinned == len(loaded))
        (claim,) = (c for c in live(claims) if 1 in c.keys)
        taken: list[int] = []
        # Runs before the waiting store resumes: the slots the failed store frees are gone again.
        claim.future.add_done_callback(lambda _: taken.extend(tier.allocate_nowait() for _ in retried))
        engine.hold = False  # the retry's copy goes through at once
        first.cancel()  # cancels the held submission too: the store gives its slots back
        with pytest.raises(asyncio.CancelledError):
            await bounded(first)
        assert await bounded(second) == expected
        assert len(taken) == len(retried)
        for key in expected.skipped:
            assert key not in store
        if loaded:
            assert store.statistics().blocks_pinned == len(loaded)
            engine.held[2].set_result(None)
        await bounded(load)
        assert [row.tobytes() for row in dst] == [page(k) for k in loaded]  # a given-up block loads whole
        given_up = tuple(k for k in keys if k not in retried and k in expected.skipped)
        want = [("stored", tuple(k for k in keys if k not in retried))]
        want += [("evicted", given_up)] if given_up else []
        want += [("stored", tuple(k for k in retried if k in expected.stored))] if 1 in expected.stored else []
        assert await events.next(len(want)) == want
        await asyncio.sleep(0.01)
        assert not events.got, "more events than expected"
        stats = store.statistics()
        assert (stats.skipped, stats.evictions) == (len(expected.skipped), len(given_up))
        tier.free_many(taken)
        whole(tier, store, keys)
        await exact(store)


async def test_a_retry_that_does_not_wait_gives_up_the_blocks_its_call_stored_after_the_key_it_skips(
    gate: PopulateGate, claims: list[Claim]
) -> None:
    """``wait=False``: the retry of a key whose other store failed finds a third store storing it while that
    one waits for the fill; the key is skipped, and the block the call stored after it is given up again."""
    engine = HeldEngine()
    cfg = small_config(quota=2 * MiB, max_quota=4 * MiB)  # two units of 16 slots
    async with HostTier(cfg) as tier, BlockStore(tier, engine) as store:  # type: ignore[arg-type]
        slot = tier.slot_size
        gate.allow(1)
        await bounded(tier.wait_resident(16 * slot))
        first = list(range(16))
        await bounded(store.store(first, pages(first, slot)))
        store.discard([0, 1])  # two resident slots free
        events = await Events.start(store)
        engine.hold = True
        failing = asyncio.create_task(store.store([100], pages([100], slot)))
        await eventually(lambda: len(engine.held) == 1)
        (claim,) = live(claims)
        taken: list[int] = []
        claim.future.add_done_callback(lambda _: taken.append(tier.allocate_nowait()))  # the slot it frees
        waiting = asyncio.create_task(store.store([100], pages([100], slot)))  # retries first, waits for the fill
        call = asyncio.create_task(store.store([100, 101], pages([100, 101], slot), wait=False))
        await eventually(lambda: len(engine.held) == 2)
        engine.held[1].set_result(None)
        await eventually(lambda: 101 in store)  # the call stored 101 and waits on the failing store
        engine.hold = False
        failing.cancel()  # cancels its held submission: it gives its slot back
        with pytest.raises(asyncio.CancelledError):
            await bounded(failing)
        assert await bounded(call) == StoreResult(stored=(), present=(), skipped=(100, 101))
        assert 101 not in store and len(taken) == 1
        assert await events.next(2) == [("stored", (101,)), ("evicted", (101,))]
        gate.release_all()
        assert (await bounded(waiting)).stored == (100,)
        tier.free_many(taken)
        whole(tier, store, [*first, 100, 101])
        await exact(store, slot)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("filling", [False, True])
@pytest.mark.parametrize("engine", ["none", "laggy"])
async def test_overlapping_stores_in_a_small_tier_store_no_key_past_a_skipped_one(
    gate: PopulateGate, engine: str, filling: bool, seed: int
) -> None:
    """Many stores of overlapping keys in a tier too small for them: stores skip keys, those waiting on them
    retry, retries find no room and take the slots of blocks their own call stored later, or (``wait=False``)
    skip a key whose other store waits for the fill. Loads pin blocks and a third of the calls are cancelled.
    Every result stores no key past a skipped one; ``consistent`` holds at every loop iteration."""
    rng = random.Random(seed)
    copies = LaggyEngine(rng.random()) if engine == "laggy" else None
    cfg = HostTierConfig(quota=8 * SLOT, max_quota=8 * SLOT, slot_size=SLOT, commit_unit=2 * SLOT, fill_chunk=2 * SLOT)
    if not filling:
        gate.release_all()
    async with HostTier(cfg) as tier, BlockStore(tier, copies) as store:  # type: ignore[arg-type]
        done = False

        async def checker() -> None:
            while not done:
                consistent(tier, store)
                await asyncio.sleep(0)

        async def fill() -> None:
            for unit in range(1, 5):
                await asyncio.sleep(rng.random() * 0.01)
                gate.allow(unit)
            gate.release_all()

        async def storer(r: random.Random) -> None:
            for _ in range(30):
                keys = r.sample(range(16), r.randint(3, 8))
                _, result = await perhaps_cancelled(store.store(keys, pages(keys), wait=r.random() < 0.5), r, 8)
                if result is not None:
                    assert sorted(result.stored + result.present + result.skipped) == sorted(keys)
                    suffix(keys, result)
                await asyncio.sleep(0)

        async def loader(r: random.Random) -> None:
            for _ in range(60):
                here = [k for k in r.sample(range(16), 6) if k in store][:3]
                dst = np.zeros((len(here), SLOT), dtype=np.uint8)
                try:
                    await perhaps_cancelled(store.load(here, dst), r, 8)
                except BlockNotFound:
                    pass  # evicted before the load began
                await asyncio.sleep(0)

        async with asyncio.timeout(TIMEOUT_LONG * 3):
            async with asyncio.TaskGroup() as tg:
                tg.create_task(checker())
                try:
                    async with asyncio.TaskGroup() as work:
                        work.create_task(fill())
                        for _ in range(8):
                            work.create_task(storer(random.Random(rng.random())))
                        for _ in range(2):
                            work.create_task(loader(random.Random(rng.random())))
                finally:
                    done = True
        consistent(tier, store)
        whole(tier, store, range(16))
        await exact(store)


async def test_the_engine_path_over_a_host_engine_copies_the_pages_checked_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The device path (pages checked once per call, then a subset handed to the engine as checked) through a
    real CopyEngine copying host to host: arrays and addresses, present keys among new ones, short blocks."""
    n = 8
    async with (
        CopyEngine(None) as engine,
        open_store(2 * n, engine=engine) as (tier, store),
        StaticHostMem(3 * n * SLOT) as src_mem,
        StaticHostMem(2 * n * SLOT) as dst_mem,
    ):
        through_host_engines(monkeypatch)
        src = np.frombuffer(src_mem.view(), dtype=np.uint8).reshape(3 * n, SLOT)
        dst = np.frombuffer(dst_mem.view(), dtype=np.uint8).reshape(2 * n, SLOT)
        keys = list(range(2 * n))
        src[: 2 * n] = pages(keys)
        first = await bounded(store.store(keys[:n], src[:n]))
        assert first.stored == tuple(keys[:n])
        # Present keys among new ones: the engine gets the checked addresses of the new keys' pages only.
        mixed = [0, n, 1, n + 1]
        rows = src[2 * n : 2 * n + 4]  # a host engine's pages lie in a StaticHostMem
        rows[:] = np.stack([src[k] for k in mixed])
        assert await bounded(store.store(mixed, rows)) == StoreResult(stored=(n, n + 1), present=(0, 1), skipped=())
        # Pages named by address (located once: the buffer is an owner of the copy).
        tail = keys[n + 2 :]
        addresses = [src_mem.address + k * SLOT for k in tail]
        assert (await bounded(store.store(tail, addresses))).stored == tuple(tail)
        await bounded(store.load(keys, dst))
        assert all(dst[k].tobytes() == page(k) for k in keys)
        # A page larger than a slot changes nothing.
        with pytest.raises(ValueError, match="does not fit"):
            await bounded(store.store([99], np.frombuffer(src_mem.view(), dtype=np.uint8)[: 2 * SLOT].reshape(1, -1)))
        assert 99 not in store
        through_host_engines(monkeypatch, False)
        whole(tier, store, keys)
        await exact(store)


# -- the engine path: pages checked once, copied later ----------------------------------------------


@pytest.mark.parametrize("retried", [False, True])
async def test_the_engine_path_refuses_pages_whose_buffer_closed_while_the_store_waited(
    gate: PopulateGate, retried: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages named by address in a StaticHostMem are located when the call begins; the store may wait (for
    the fill, or for another store of a key whose failure it retries) before it copies them. A buffer closed
    meanwhile is unmapped: the copy is refused (no slot kept) rather than read from memory nobody owns."""
    engine = CopyEngine(None)
    gate.allow(2)  # the buffer's populate and the tier's first unit; the second unit waits
    async with engine, StaticHostMem(4 * 64 * KiB) as mem:
        cfg = small_config(quota=2 * MiB, max_quota=4 * MiB)
        async with HostTier(cfg) as tier, BlockStore(tier, engine) as store:
            through_host_engines(monkeypatch)
            slot = tier.slot_size
            await bounded(tier.wait_resident(16 * slot))
            others = await bounded(tier.allocate(15 if retried else 16))  # another user's: one resident slot left
            src = np.frombuffer(mem.view(), dtype=np.uint8).reshape(4, slot)
            src[:] = pages([1, 2, 3, 4], slot)
            del src
            addresses = [mem.address + i * slot for i in range(4)]
            other: asyncio.Task[StoreResult] | None = None
            if retried:  # waits for the fill, claiming 1; the call stores 2, then retries 1 once this fails
                other = asyncio.create_task(store.store([1, 100], pages([1, 100], slot)))
                await asyncio.sleep(0.01)
            call = asyncio.create_task(
                store.store([1, 2, 3, 4][: 2 if retried else 4], addresses[: 2 if retried else 4])
            )
            if retried:
                await eventually(lambda: 2 in store)
            await asyncio.sleep(0.01)
            assert not call.done()
            await bounded(mem.aclose())  # nothing in flight over it: unmapped at once
            if other is not None:
                other.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await bounded(other)
            gate.release_all()
            with pytest.raises(CopyPlanError, match="closed"):
                await bounded(call)
            assert 1 not in store and (2 in store) == retried
            tier.free_many(others)
            whole(tier, store, [1, 2, 3, 4, 100])
            through_host_engines(monkeypatch, False)
            await exact(store, slot)


@pytest.mark.parametrize("how", ["engine", "straddling", "views"])
async def test_pages_in_the_stores_own_blocks_are_not_evicted_under_the_copy(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages that lie in blocks of the store itself (named by address with a CopyEngine, or tier views):
    the call pins those blocks, so the room it makes never hands their slots to the blocks it copies
    from them (the copy would read bytes it had overwritten)."""
    async with CopyEngine(None) as engine, open_store(4, engine=engine) as (tier, store):
        await bounded(store.store([10, 11, 12, 13], pages([10, 11, 12, 13])))  # full; 10 and 11 are the LRU
        s10, s11 = store.slot(10), store.slot(11)
        src: Any
        if how == "views":
            views = [tier.view(s10), tier.view(s11)]
            src = views
            want = [page(10), page(11)]
        else:
            through_host_engines(monkeypatch)
            half = SLOT // 2 if how == "straddling" else 0
            src = [tier.address(s10) + half, tier.address(s11) + half]
            want = [page(10), page(11)] if not half else [page(10)[half:] + page(11)[:half], None]
        keys = [1, 2] if how != "straddling" else [1]
        result = await bounded(store.store(keys, src[: len(keys)]))
        through_host_engines(monkeypatch, False)
        assert result == StoreResult(stored=tuple(keys), present=(), skipped=())
        assert 10 in store and 11 in store  # the sources stayed; 12 and 13 made the room
        dst = np.zeros((len(keys), SLOT), dtype=np.uint8)
        await bounded(store.load(keys, dst))
        assert [row.tobytes() for row in dst] == want[: len(keys)]
        if how == "views":
            for view in views:
                view.release()
        whole(tier, store, [1, 2, 10, 11, 12, 13])


# -- after the tier's fill failed ---------------------------------------------------------------------


@pytest.mark.parametrize("wait", [True, False])
async def test_after_a_failed_fill_a_shrink_and_a_grow_let_stores_take_fresh_slots_again(
    gate: PopulateGate, wait: bool
) -> None:
    """The fill fails: a full store evicts into the resident slots. A shrink to the resident prefix clears the
    failure and a grow fills again: stores then take the new slots (waiting for them, or skipping the keys
    whose slots are not resident yet with ``wait=False``) rather than evict. A retry meanwhile does the same."""
    slot = 64 * KiB
    async with HostTier(small_config(quota=4 * MiB, max_quota=8 * MiB)) as tier, BlockStore(tier) as store:
        gate.allow(2)
        gate.fail(2)  # 32 slots resident, then the fill fails
        with pytest.raises(FillError):
            await bounded(tier.wait_resident())
        first = list(range(32))
        assert (await bounded(store.store(first, pages(first, slot)))).stored == tuple(first)
        more = list(range(100, 104))
        assert (await bounded(store.store(more, pages(more, slot), wait=wait))).stored == tuple(more)
        assert store.statistics().evictions == 4 and tier.slots_ready == 0
        await bounded(store.resize(2 * MiB))  # the resident prefix: the failure is cleared
        await bounded(store.resize(3 * MiB))  # 16 fresh slots, their fill held
        new = list(range(200, 204))
        call = asyncio.create_task(store.store(new, pages(new, slot), wait=wait))
        if wait:
            await asyncio.sleep(0.01)
            assert not call.done()  # waits for the fill, evicting nothing
            gate.allow(1 << 40)
            assert (await bounded(call)).stored == tuple(new)
        else:
            assert (await bounded(call)).skipped == tuple(new)  # not resident yet: skipped, nothing evicted
            gate.allow(1 << 40)
            await bounded(tier.wait_resident())
            assert (await bounded(store.store(new, pages(new, slot), wait=False))).stored == tuple(new)
        assert store.statistics().evictions == 4 and len(store) == 36
        whole(tier, store, [*first, *more, *new])
        await exact(store, slot)


@pytest.mark.parametrize("how", ["engine", "straddling", "views"])
async def test_a_load_into_the_stores_own_blocks_is_refused(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Destination pages in the store's own tier that lie in one of its blocks would overwrite that block
    (its key then names other bytes): refused, nothing copied, nothing pinned. A slot of the same tier that
    another user holds is that user's memory: a load into it copies."""
    async with CopyEngine(None) as engine, open_store(4, engine=engine) as (tier, store):
        await bounded(store.store([1, 2], pages([1, 2])))
        s2 = store.slot(2)
        (foreign,) = await bounded(tier.allocate(1))
        dst: Any
        views: list[memoryview] = []
        if how == "views":
            views = [tier.view(s2), tier.view(foreign)]
            dst, ok = views[:1], views[1:]
        else:
            through_host_engines(monkeypatch)
            half = SLOT // 2 if how == "straddling" else 0
            dst, ok = [tier.address(s2) - half], [tier.address(foreign)]  # straddles the slot before and 2's
        with pytest.raises(ValueError, match="a block of this store"):
            await bounded(store.load([1], dst))
        assert store.statistics().blocks_pinned == 0
        await bounded(store.load([1], ok))
        through_host_engines(monkeypatch, False)
        assert bytes(tier.view(foreign)) == page(1) if not views else bytes(views[1]) == page(1)
        for view in views:
            view.release()
        tier.free(foreign)
        whole(tier, store, [1, 2])
        await exact(store)
