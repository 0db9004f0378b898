"""The store's index: which key's block lies in which tier slot, in what state, pinned how often.

Bookkeeping is arrays indexed by slot id (key, state, length, pins) plus one
dict from key to slot, so a million blocks cost about a hundred bytes each
beside their keys, and a call's bookkeeping is a few array operations rather
than a Python step per key. The eviction policy is told of every block that
becomes visible, is hit or leaves. A slot's states::

    FREE ──book──> STORING ──landed──> READY ──evict/discard──> FREE
                      │                  │ discarded while pinned: DOOMED, FREE at its last unpin
                      └─ not landed ─> FREE (the slot goes back to the tier)

Synchronous, and not thread-safe: the store calls it from its event loop.
Slots are the tier's: the index gives back those of the blocks that leave.
"""

from __future__ import annotations

import logging
import operator
from collections import deque
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from .._errors import SlotError, key_text
from ._keys import Key, canonical, key_array
from ._policy import EvictionPolicy

if TYPE_CHECKING:
    from .._host._tier import HostTier

__all__ = ["DOOMED", "FREE", "I64", "NO_IDS", "READY", "STORING", "U64", "BlockIndex", "require"]

log = logging.getLogger("aiokvtier")

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
FREE, STORING, READY, DOOMED = 0, 1, 2, 3
NO_IDS = np.empty(0, dtype=np.int64)
_ONE = np.uint32(1)  # the pin counts' own type: ufunc.at with a Python int takes a path 25x slower


class BlockIndex:
    """Key <-> slot maps, per-slot state, length and pins, and the policy, kept in step with the tier.

    The arrays and the map are read by the store directly; every change goes
    through a method here, which keeps them and the policy agreeing.

    :param evicted: told of the keys of blocks evicted (by ``evict()`` or
        ``drop_past()``), once their slots went back to the tier.
    """

    def __init__(self, tier: HostTier, evicted: Callable[[list[Key]], None]) -> None:
        self._tier = tier
        self._evicted_keys = evicted
        self.slot_of: dict[Key, int] = {}
        self.key_of: npt.NDArray[np.object_] = np.empty(0, dtype=object)
        self.state: npt.NDArray[np.uint8] = np.empty(0, dtype=np.uint8)
        self.length: U64 = np.empty(0, dtype=np.uint64)
        self.pins: npt.NDArray[np.uint32] = np.empty(0, dtype=np.uint32)
        self.capacity = 0
        """Slots the policy and the maps are sized for."""
        self.visible = 0
        """Ready blocks."""
        self.doomed = 0
        """Blocks discarded (or given up) while pinned, their slots freed at their last unpin."""
        self.policy: EvictionPolicy

    def attach(self, policy: EvictionPolicy, capacity: int) -> None:
        """Start with ``policy``, sized (as the maps) for ``capacity`` slots."""
        self.policy = policy
        self.capacity = capacity
        self._grow_maps(capacity)

    # -- following the tier -------------------------------------------------------------

    def sync_capacity(self) -> None:
        """Follow a tier that was grown behind the store's back (slot ids index the maps)."""
        if self._tier.slots_total > self.capacity:
            self.follow_tier()

    def follow_tier(self) -> None:
        """Size the maps and the policy to the tier's slot count (after a resize, whatever its outcome)."""
        capacity = self._tier.slots_total
        self._grow_maps(capacity)  # the maps only grow: slots past a shrink stay free in them
        if capacity != self.capacity:
            self.policy.resize(capacity)
            self.capacity = capacity

    def _grow_maps(self, capacity: int) -> None:
        extra = capacity - len(self.state)
        if extra > 0:
            self.key_of = np.concatenate([self.key_of, np.full(extra, None, dtype=object)])
            self.state = np.concatenate([self.state, np.zeros(extra, dtype=np.uint8)])
            self.length = np.concatenate([self.length, np.zeros(extra, dtype=np.uint64)])
            self.pins = np.concatenate([self.pins, np.zeros(extra, dtype=np.uint32)])

    # -- queries ------------------------------------------------------------------------

    def slots(self, keys: Sequence[Key]) -> I64:
        """Each key's slot, -1 for a key without one (one pass over the dict, in C)."""
        return np.fromiter(map(self.slot_of.get, keys, repeat(-1)), dtype=np.int64, count=len(keys))

    def slots_of_all(self, keys: Sequence[Key]) -> I64 | None:
        """Each key's slot, or None when a key has none: a load's keys, all known unless it fails."""
        n = len(keys)
        if n < 2:  # itemgetter of one key returns the value itself
            slots = self.slots(keys)
            return None if (slots < 0).any() else slots
        try:
            found = operator.itemgetter(*keys)(self.slot_of)  # a third cheaper than map(get) at 4,096 keys
        except KeyError:
            return None
        return np.fromiter(found, dtype=np.int64, count=n)

    def ready(self, slots: I64) -> npt.NDArray[np.bool_]:
        """Which of ``slots`` (from ``slots()``) hold a ready block."""
        known = slots >= 0
        if known.all():
            ready: npt.NDArray[np.bool_] = self.state[slots] == READY
            return ready
        ready = np.zeros(len(slots), dtype=np.bool_)
        ready[known] = self.state[slots[known]] == READY
        return ready

    def ready_slot(self, key: Key) -> int:
        """The slot of the ready block of ``key``, or -1."""
        slot = self.slot_of.get(key, -1)
        return slot if slot >= 0 and self.state[slot] == READY else -1

    def blocks_in(self, slots: I64) -> I64:
        """Those of ``slots`` (ascending tier slot ids) that hold (or are getting) a block."""
        if not slots.size:  # the usual call's pages lie outside the tier: no array work
            return slots
        slots = slots[slots < len(self.state)]
        used: I64 = slots[self.state[slots] != FREE]
        return used

    # -- pins ---------------------------------------------------------------------------

    def pin(self, slots: I64) -> None:
        if slots.size:
            np.add.at(self.pins, slots, _ONE)  # a key loaded twice in one call pins twice

    def unpin(self, slots: I64) -> None:
        if not slots.size:
            return
        pins = self.pins
        np.subtract.at(pins, slots, _ONE)
        if not self.doomed:  # the usual unpin: nothing discarded while it was read, no look at the states
            return
        doomed = slots[self.state[slots] == DOOMED]
        if doomed.size:
            doomed = doomed[pins[doomed] == 0]  # released
        if doomed.size:
            doomed = np.unique(doomed)
            self.state[doomed] = FREE
            self.doomed -= len(doomed)
            if not self._tier.closed:
                self._tier.free_many(doomed.tolist())

    # -- a store's blocks ---------------------------------------------------------------

    def book(self, slots: I64, keys: Sequence[Key], lengths: U64) -> None:
        """Blocks being stored into ``slots``: known to the maps, invisible until ``landed()``.

        :raises ValueError: a key twice among ``keys`` (the map grew by fewer).
        """
        self.key_of[slots] = key_array(keys)
        self.state[slots] = STORING
        self.length[slots] = lengths
        before = len(self.slot_of)
        self.slot_of.update(zip(keys, slots.tolist(), strict=True))
        if len(self.slot_of) - before != len(keys):
            raise ValueError("a key appears twice in one store call")

    def landed(self, slots: I64) -> None:
        """The blocks booked in ``slots`` are stored: visible from now on."""
        self.state[slots] = READY
        self.visible += len(slots)

    def forget_inserted(self, slots: I64) -> None:
        """Untell the policy about blocks of a store that did not land (one by one if the batch fails)."""
        try:
            self.policy.removed_many(slots)
        except Exception:
            log.warning(
                "aiokvtier: the eviction policy failed to remove %d blocks; removing them one by one", len(slots)
            )
            for slot in slots.tolist():
                try:
                    self.policy.removed(slot)
                except KeyError:
                    pass  # the batch got this far

    def unbook(self, taken: list[int]) -> None:
        """Give back the slots of a store that did not land, and forget what was booked in them."""
        slot_of = self.slot_of
        for slot in taken:
            owner = self.key_of[slot]
            if owner is not None and slot_of.get(owner) == slot:
                del slot_of[owner]
            self.key_of[slot] = None
            self.state[slot] = FREE
        if taken and not self._tier.closed:
            self._tier.free_many(taken)

    def give_up(self, slot: int, key: Key, reuse: bool) -> bool:
        """Drop the ready block of ``key`` in ``slot``, which a store call stored and pins.

        Returns True when ``reuse`` and only the call pins it: the slot is the
        call's again, free and unpinned. Otherwise the block is doomed: its
        slot goes back to the tier at its last unpin.
        """
        self.policy.removed(slot)  # first: a policy that refuses leaves the block as it was
        del self.slot_of[key]
        self.key_of[slot] = None
        self.visible -= 1
        if reuse and self.pins[slot] == 1:
            self.pins[slot] = 0
            self.state[slot] = FREE
            return True
        self.state[slot] = DOOMED
        self.doomed += 1
        return False

    def give_back(self, slots: list[int]) -> None:
        """Slots taken from the tier and not booked."""
        if slots and not self._tier.closed:
            self._tier.free_many(slots)

    # -- blocks leaving -----------------------------------------------------------------

    def evict(self, n: int) -> int:
        """Evict up to ``n`` ready, unpinned blocks in the policy's order; returns how many."""
        state, pins = self.state, self.pins
        slots: list[int] = []
        keys: list[Key] = []
        try:
            victims = self.policy.victims()
            try:
                for slot in victims:
                    if state[slot] != READY or pins[slot]:
                        continue
                    keys.append(self._forget(slot))
                    slots.append(slot)
                    if len(slots) == n:
                        break
            finally:
                close = getattr(victims, "close", None)  # a generator: let it clean up now
                if close is not None:
                    close()
        finally:  # also when the policy failed half way: what was forgotten is given back
            self._evicted(slots, keys)
        return len(slots)

    def _forget(self, slot: int) -> Key:
        """Drop a ready block's bookkeeping (its slot is the caller's to give back); returns its key."""
        key: Key | None = self.key_of[slot]
        assert key is not None
        self.policy.removed(slot)
        del self.slot_of[key]
        self.key_of[slot] = None
        self.state[slot] = FREE
        return key

    def _evicted(self, slots: list[int], keys: list[Key]) -> None:
        if slots:
            self._tier.free_many(slots)
            self.visible -= len(slots)
            self._evicted_keys(keys)

    def discard(self, gone: I64, keys: Sequence[Key]) -> None:
        """Drop the ready blocks of ``keys`` in ``gone``: freed now, or (pinned by a load) at their last unpin."""
        self.policy.removed_many(gone)  # first: a policy that refuses leaves the blocks as they were
        deque(map(self.slot_of.__delitem__, keys), maxlen=0)
        self.key_of[gone] = None
        pinned = self.pins[gone] > 0
        self.state[gone] = np.where(pinned, DOOMED, FREE).astype(np.uint8)
        self.doomed += int(np.count_nonzero(pinned))
        free = gone[~pinned]
        if free.size:
            self._tier.free_many(free.tolist())
        self.visible -= len(keys)

    def busy_past(self, total: int) -> I64:
        """Slots at or past ``total`` whose block is being stored or read."""
        tail = self.state[total:]
        busy: I64 = np.flatnonzero((tail == STORING) | (tail == DOOMED) | (self.pins[total:] > 0))
        return busy + total

    def not_ready(self, slots: I64) -> I64:
        """Those of ``slots`` that hold no ready block."""
        foreign: I64 = slots[self.state[slots] != READY] if slots.size else slots
        return foreign

    def drop_past(self, total: int) -> None:
        """Evict every ready block at or past slot ``total`` (a shrink)."""
        dropped: list[int] = []
        keys: list[Key] = []
        try:
            for slot in (np.flatnonzero(self.state[total:] == READY) + total).tolist():
                keys.append(self._forget(slot))
                dropped.append(slot)
        finally:  # also when the policy failed half way: what was forgotten is given back
            self._evicted(dropped, keys)

    def release_all(self) -> None:
        """The store closes: every block's slot goes back to the tier (the tier stays the owner's)."""
        slots = [*self.slot_of.values(), *np.flatnonzero(self.state == DOOMED).tolist()]
        self.slot_of.clear()
        self.visible = 0
        if slots and not self._tier.closed:
            self._tier.free_many(slots)

    # -- invariants ---------------------------------------------------------------------

    def check(self, idle: bool) -> None:
        """Raise ``AssertionError`` naming the first invariant that does not hold (see ``BlockStore.check_invariants``).

        ``idle``: no store or load call is in flight, so no block is being
        stored, doomed or pinned.
        """
        tier = self._tier
        state, key_of, pins = self.state, self.key_of, self.pins
        require(
            len(key_of) == len(self.length) == len(pins) == len(state) >= self.capacity,
            f"the maps differ in length or cover fewer than the capacity's {self.capacity} slots",
        )
        used = np.flatnonzero(state != FREE)
        end = min(self.capacity, tier.slots_total)
        require(not used.size or int(used[-1]) < end, f"slot {int(used[-1]) if used.size else -1} lies past {end}")
        try:
            tier.slot_addresses(used)
        except SlotError as exc:
            require(False, f"a block's slot is not allocated in the tier ({exc})")
        ready = np.flatnonzero(state == READY)
        require(len(ready) == self.visible, f"{len(ready)} ready slots for {self.visible} visible blocks")
        for key, slot in self.slot_of.items():
            if not (state[slot] in (STORING, READY) and key_of[slot] == key):
                require(False, f"key {key_text(key)} maps to slot {slot}, which is not its block")
        require(canonical(list(self.slot_of)), "a key is neither bytes nor an int")
        require(
            all(self.slot_of.get(key_of[s]) == s for s in ready.tolist()),
            "a ready slot's key maps to another slot",
        )
        pinned = np.flatnonzero(pins)
        # Counts are unsigned: an unpin without its pin wraps to about 2**32 rather than going negative.
        require(not pinned.size or int(pins.max()) < 1 << 31, "a pin count went below zero")
        require(set(state[pinned].tolist()) <= {READY, DOOMED}, "a pin on a slot that holds no readable block")
        require((pins[state == DOOMED] > 0).all(), "a doomed block that nothing pins")
        doomed = int(np.count_nonzero(state == DOOMED))
        require(doomed == self.doomed, f"{doomed} doomed slots, {self.doomed} counted")
        policy = self.policy
        tracked = policy.tracked()
        if tracked is not None:
            require(
                len(tracked) == self.capacity,
                f"the policy is sized for {len(tracked)} slots, the store for {self.capacity}",
            )
            slots = np.flatnonzero(tracked)
            require(len(policy) == len(slots), f"the policy counts {len(policy)} blocks and tracks {len(slots)}")
            # The policy knows every visible block, and a block being stored at most.
            require(set(ready.tolist()) <= set(slots.tolist()), "a visible block the policy does not track")
            require(
                set(slots.tolist()) <= set(np.flatnonzero(state >= STORING).tolist()),
                "the policy tracks a slot without a block",
            )
        if idle:
            require(not pinned.size, f"slot {int(pinned[0]) if pinned.size else -1} is pinned with nothing in flight")
            require(not (state == STORING).any(), "a block is being stored with nothing in flight")
            require(len(self.slot_of) == len(ready), "a key maps to a block that is not visible")
            require(len(policy) == self.visible, f"the policy tracks {len(policy)} blocks, {self.visible} are visible")


def require(ok: object, broken: str) -> None:
    """:raises AssertionError: not ``ok``; the message names the ``broken`` invariant."""
    if not ok:
        raise AssertionError(f"BlockStore invariant broken: {broken}")
