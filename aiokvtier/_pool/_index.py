"""The pool's block index: which key lives in which slot, for every process at once.

A synchronous core that the owner's service (``aiokvtier._pool._owner``)
calls from its event loop; it never touches memory and never frees a slot
itself: every call that lets slots go returns them, and the service hands
them back to the tier. A block's life, as in ``BlockStore``::

    (absent) ──claim──> storing ──commit──> ready ──evict/discard──> (absent)
                           │                  │ pinned by a load: never evicted;
                           └─ abort ─> (slot) │ discarded while pinned: freed at the last unpin

Claims and pins carry ids, so that the service can release everything a
process held when its connection closes. Ready blocks sit in a plain dict
from key to slot; a block's key, length, pin count, "discarded while
pinned" mark and recency are arrays indexed by its slot. Recency is a tick:
a touch of ``n`` blocks gives them the next ``n`` ticks in order, so the
least recently used block is the one of lowest tick, as an ``OrderedDict``'s
``move_to_end`` would have it (which cost a store's commit and a discard
~0.45 ms of 4,096 keys more than a dict). A call of 4,096 keys is a few dict
passes in C and array operations, no Python object and no Python step per
key (a ``Block`` object per key cost a store's commit about a millisecond).

With a mirror (``aiokvtier._pool._mirror``), every change of the ready
blocks is written there too, in the same step, and attached processes look
keys up in it themselves. Their hits do not reach this order: they set the
block's referenced byte instead, and an eviction gives a referenced block a
second chance (CLOCK over the LRU order: it is cleared and moved to the
most recent end, and the scan goes on).
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Collection, Sequence

import numpy as np
import numpy.typing as npt

from .._errors import BlockNotFound
from ._mirror import IndexMirror
from ._wire import BUSY, CLAIMED, PRESENT, SKIPPED, Key, KeyMatrix

__all__ = ["BlockIndex"]

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]
_NONE = np.empty(0, dtype=np.int64)
_ONE = np.int64(1)


def _get_all(mapping: dict[Key, int], keys: Sequence[Key]) -> I64:
    """``mapping[key]`` of every key, in C (an itemgetter of one key returns the value itself).

    :raises KeyError: a key is missing.
    """
    if len(keys) == 1:
        return np.array([mapping[keys[0]]], dtype=np.int64)
    if not keys:
        return _NONE
    return np.fromiter(operator.itemgetter(*keys)(mapping), dtype=np.int64, count=len(keys))


class _Claim:
    """A store in flight: its keys, their slots (once placed) and lengths, and what the mirror can use of
    the keys' wire form (their types, their bytes as a matrix) rather than find again."""

    __slots__ = ("keys", "lengths", "matrix", "slots", "types")

    def __init__(self, keys: list[Key], lengths: I64, types: set[type] | None, matrix: KeyMatrix | None) -> None:
        self.keys = keys
        self.slots = _NONE
        self.lengths = lengths
        self.types = types
        self.matrix = matrix


class BlockIndex:
    """Keys to slots, claims and pins of a shared block store (the owner's loop only).

    :param mirror: the index mirror every change of the ready blocks is written to, or None.
    :param slots: the slots to size the per-slot arrays for (they grow if a larger slot id comes).
    """

    def __init__(self, mirror: IndexMirror | None = None, slots: int = 0) -> None:
        self.mirror = mirror
        self.ready: dict[Key, int] = {}
        """Key -> slot of every visible block (their recency: ``_tick``)."""
        self.storing: dict[Key, int] = {}
        """Key -> the claim storing it."""
        self._claims: dict[int, _Claim] = {}
        self._pins: dict[int, I64] = {}
        self._ids = itertools.count(1)
        self._length: I64 = np.zeros(slots, dtype=np.int64)
        self._pinned: I64 = np.zeros(slots, dtype=np.int64)
        self._doomed: npt.NDArray[np.bool_] = np.zeros(slots, dtype=np.bool_)
        """Discarded while pinned: the slot is freed at its last unpin."""
        self._live: npt.NDArray[np.bool_] = np.zeros(slots, dtype=np.bool_)
        """The slot holds a visible block."""
        self._key: npt.NDArray[np.object_] = np.full(slots, None, dtype=np.object_)
        """The key of the visible block in each slot (None: none), for an eviction."""
        self._tick: I64 = np.zeros(slots, dtype=np.int64)
        """When each visible block was last touched (a larger tick is more recent; ticks are never reused)."""
        self._clock = 0
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
                "owner_lookups",
                "mirror_retries",
            ),
            0,
        )
        self.bytes_stored = 0
        self.bytes_loaded = 0

    def __len__(self) -> int:
        return len(self.ready)

    @property
    def claims(self) -> int:
        return len(self._claims)

    @property
    def pinned(self) -> int:
        slots = self._slots_of_ready()
        return int(np.count_nonzero(self._pinned[slots]))

    def _slots_of_ready(self) -> I64:
        return np.fromiter(self.ready.values(), dtype=np.int64, count=len(self.ready))

    def _fit(self, slots: I64) -> None:
        """Grow the per-slot arrays to hold ``slots`` (a tier's ids are below its slot count: rarely needed)."""
        if not slots.size:
            return
        need = int(slots.max()) + 1
        have = len(self._length)
        if need > have:
            extra = max(need, 2 * have) - have
            self._length = np.concatenate([self._length, np.zeros(extra, dtype=np.int64)])
            self._pinned = np.concatenate([self._pinned, np.zeros(extra, dtype=np.int64)])
            self._doomed = np.concatenate([self._doomed, np.zeros(extra, dtype=np.bool_)])
            self._live = np.concatenate([self._live, np.zeros(extra, dtype=np.bool_)])
            self._key = np.concatenate([self._key, np.full(extra, None, dtype=np.object_)])
            self._tick = np.concatenate([self._tick, np.zeros(extra, dtype=np.int64)])

    def _touch(self, slots: I64) -> None:
        """The blocks in ``slots`` become the most recently used, the last of them most (a slot twice: its
        last place counts, as ``move_to_end`` would have it)."""
        n = len(slots)
        if n:
            self._tick[slots] = np.arange(self._clock, self._clock + n, dtype=np.int64)
            self._clock += n

    # -- queries --------------------------------------------------------------------

    def lookup(self, keys: Sequence[Key]) -> int:
        """The stored prefix of ``keys``; touches it (most recent last)."""
        n = len(keys)
        # One loop in C: each key's slot (-1: absent), then the touches of the prefix as one array write.
        slots = np.fromiter(map(self.ready.get, keys, itertools.repeat(-1)), dtype=np.int64, count=n)
        missing = np.flatnonzero(slots < 0)
        hits = int(missing[0]) if missing.size else n
        self._touch(slots[:hits])
        c = self.counts
        c["queries"] += 1
        c["hits"] += hits
        c["misses"] += len(keys) - hits
        return hits

    # -- store: classify, claim, commit or abort ------------------------------------------

    def classify(self, keys: Sequence[Key]) -> U8:
        """Each key's outcome before slots are taken: ``PRESENT`` (touched), ``BUSY`` (another claim
        stores it) or ``CLAIMED`` (to store).

        :raises ValueError: a key twice.
        """
        n = len(keys)
        if len(set(keys)) != n:
            raise ValueError("a key appears twice in one store; nothing changed")
        ready, storing = self.ready, self.storing
        out = np.full(n, CLAIMED, dtype=np.uint8)
        if ready:
            slots = np.fromiter(map(ready.get, keys, itertools.repeat(-1)), dtype=np.int64, count=n)
            present = slots >= 0
            if present.any():
                out[present] = PRESENT
                self._touch(slots[present])
        if storing:  # a key is never ready and being stored at once
            out[np.fromiter(map(storing.__contains__, keys), dtype=np.bool_, count=n)] = BUSY
        return out

    @staticmethod
    def cut(outcomes: U8, room: int) -> U8:
        """Keep the first ``room`` keys to claim; from the first one left out, every key not present is
        skipped (no key after a skipped one is stored)."""
        claimed = np.flatnonzero(outcomes == CLAIMED)
        room = max(room, 0)
        if claimed.size <= room:
            return outcomes
        out = outcomes.copy()
        tail = out[int(claimed[room]) :]
        tail[tail != PRESENT] = SKIPPED
        return out

    def claim(
        self, keys: list[Key], lengths: I64, types: set[type] | None = None, matrix: KeyMatrix | None = None
    ) -> int:
        """Mark ``keys`` as being stored (slots come later, ``place``); returns the claim id. ``types`` and
        ``matrix``: the keys' types and bytes, where the caller has them (the mirror then need not find them)."""
        claim = next(self._ids)
        self.storing.update(zip(keys, itertools.repeat(claim)))
        self._claims[claim] = _Claim(keys, np.asarray(lengths, dtype=np.int64), types, matrix)
        return claim

    def place(self, claim: int, slots: I64) -> None:
        entry = self._claims[claim]
        entry.slots = np.asarray(slots, dtype=np.int64)
        self._fit(entry.slots)

    def commit(self, claim: int) -> list[Key]:
        """The claim's blocks become visible (most recently used).

        :raises KeyError: no such claim.
        """
        entry = self._claims.pop(claim)
        keys, slots, lengths = entry.keys, entry.slots, entry.lengths
        if len(slots) != len(keys):
            self._claims[claim] = entry
            raise KeyError(f"claim {claim} has no slots placed")
        deque(map(self.storing.__delitem__, keys), maxlen=0)
        self.ready.update(zip(keys, slots.tolist(), strict=True))
        self._length[slots] = lengths
        self._live[slots] = True
        self._key[slots] = keys
        self._touch(slots)
        if self.mirror is not None:
            self.mirror.insert(keys, slots, lengths, entry.types, entry.matrix)
        self.counts["stores"] += len(keys)
        self.bytes_stored += int(lengths.sum())
        return keys

    def abort(self, claim: int) -> list[int]:
        """Forget a claim (its store failed, or its process went away); returns its slots to free."""
        entry = self._claims.pop(claim, None)
        if entry is None:
            return []
        deque(map(self.storing.pop, entry.keys, itertools.repeat(None)), maxlen=0)
        freed: list[int] = entry.slots.tolist()
        return freed

    def owns(self, claim: int) -> bool:
        return claim in self._claims

    # -- room --------------------------------------------------------------------------

    def evict(self, n: int, keep: Collection[Key]) -> tuple[list[Key], list[int]]:
        """Up to ``n`` least recently used blocks that no load reads and that are not in ``keep``;
        returns their keys and slots (to free). A block an attached process's lookup hit since the last
        scan is passed over once (moved to the most recent end).

        In arrays: the blocks that may go, oldest first, then the scan's outcome read off where their
        referenced ones lie (a scan in Python cost ~0.3 us a block passed)."""
        if n <= 0 or not self.ready:
            return [], []
        mirror, ready = self.mirror, self.ready
        kept = np.fromiter(map(ready.get, keep, itertools.repeat(-1)), dtype=np.int64, count=len(keep))
        spare = self._live.copy()
        spare[self._pinned > 0] = False
        spare[kept[kept >= 0]] = False
        order = np.flatnonzero(spare)
        order = order[np.argsort(self._tick[order], kind="stable")]
        referenced = mirror.referenced_many(order) if mirror is not None else np.zeros(order.size, dtype=np.bool_)
        plain = np.flatnonzero(~referenced)
        if plain.size >= n:  # the first pass finds them all: it passed over the referenced ones before the n-th
            end = int(plain[n - 1]) + 1
            taken = order[plain[:n]]
            spared = order[:end][referenced[:end]]
            second = taken[:0]
        else:  # the second pass takes the oldest of what the first passed over (now at the most recent end)
            taken = order[plain]
            spared = order[referenced]
            second = spared[: n - taken.size]
        if mirror is not None and spared.size:
            mirror.unreference_many(spared)
        self._touch(spared)
        slots = np.concatenate([taken, second])
        keys: list[Key] = self._key[slots].tolist()
        deque(map(ready.__delitem__, keys), maxlen=0)
        self._forget(slots)
        if mirror is not None:
            mirror.remove_slots(slots)
        self.counts["evictions"] += len(keys)
        freed: list[int] = slots.tolist()
        return keys, freed

    def _forget(self, slots: I64) -> None:
        """The blocks in ``slots`` are no longer visible (their keys already out of ``ready``)."""
        self._live[slots] = False
        self._key[slots] = None

    # -- load: pin, unpin -------------------------------------------------------------------

    def pin(self, keys: Sequence[Key]) -> tuple[int, I64, I64]:
        """Pin every key's block for a load; touches them.

        :returns: ``(pin id, slots, lengths)``.
        :raises BlockNotFound: a key is not stored (the first missing one; nothing pinned).
        """
        ready = self.ready
        try:
            slots = _get_all(ready, keys)
        except KeyError:
            raise BlockNotFound(next(k for k in keys if k not in ready)) from None
        np.add.at(self._pinned, slots, _ONE)  # a key loaded twice in one call pins twice
        self._touch(slots)
        pin = next(self._ids)
        self._pins[pin] = slots
        return pin, slots, self._length[slots]

    def unpin(self, pin: int, loaded: bool = False) -> list[int]:
        """Release a load's pins (``loaded``: its copy landed, count it); returns the slots of blocks
        discarded meanwhile (to free now)."""
        slots = self._pins.pop(pin, _NONE)
        if loaded:
            self.counts["loads"] += len(slots)
            self.bytes_loaded += int(self._length[slots].sum())
        if not slots.size:
            return []
        pinned, doomed = self._pinned, self._doomed
        np.subtract.at(pinned, slots, _ONE)
        released = slots[(pinned[slots] == 0) & doomed[slots]]  # their last unpin, after a discard
        if not released.size:
            return []
        released = np.unique(released)
        doomed[released] = False
        freed: list[int] = released.tolist()
        return freed

    def discard(self, keys: Sequence[Key]) -> tuple[list[Key], I64]:
        """Drop blocks (unknown keys ignored); returns the keys dropped, and the slots to free now (a pinned
        block's slot is freed at its last unpin)."""
        n = len(keys)
        gone = np.fromiter(map(self.ready.pop, keys, itertools.repeat(-1)), dtype=np.int64, count=n)
        known = gone >= 0
        if known.all():
            dropped = list(keys)
        else:
            dropped = list(itertools.compress(keys, known.tolist()))
            gone = gone[known]
        self._forget(gone)
        pinned = self._pinned[gone] > 0
        self._doomed[gone[pinned]] = True
        freed = gone[~pinned]
        if self.mirror is not None:
            self.mirror.remove_slots(gone)
        self.counts["discards"] += len(dropped)
        return dropped, freed

    # -- checks ------------------------------------------------------------------------------

    def check(self) -> list[int]:
        """Check the index against itself and its mirror; returns every slot it holds (blocks, claims,
        discarded blocks still pinned).

        :raises AssertionError: an invariant does not hold (the message names it).
        """
        ready = self._slots_of_ready()
        held: list[int] = ready.tolist()
        live = np.zeros(len(self._live), dtype=np.bool_)
        live[ready] = True
        _require(np.array_equal(live, self._live), "the per-slot record of visible blocks is wrong")
        _require(self._key[ready].tolist() == list(self.ready), "a visible block's slot names another key")
        _require(all(k is None for k in self._key[~live].tolist()), "a slot with no visible block keeps a key")
        ticks = self._tick[ready]
        _require(
            len(np.unique(ticks)) == len(ticks) and (not ticks.size or int(ticks.max()) < self._clock),
            "two visible blocks share a tick",
        )
        for claim, entry in self._claims.items():
            keys, slots, lengths = entry.keys, entry.slots, entry.lengths
            _require(len(lengths) == len(keys), f"claim {claim} has {len(keys)} keys and {len(lengths)} lengths")
            _require(not slots.size or len(slots) == len(keys), f"claim {claim}: {len(slots)} slots, {len(keys)} keys")
            for key in keys:
                _require(self.storing.get(key) == claim, f"key {key!r} of claim {claim} is not marked as stored by it")
                _require(key not in self.ready, f"key {key!r} is visible and being stored at once")
            held.extend(slots.tolist())
        _require(
            len(self.storing) == sum(len(entry.keys) for entry in self._claims.values()),
            "a key is marked as being stored by no claim",
        )
        pins = np.zeros_like(self._pinned)
        for slots in self._pins.values():
            np.add.at(pins, slots, _ONE)
        _require(np.array_equal(pins, self._pinned), "a block has a wrong pin count")
        _require(not self._doomed[ready].any(), "a visible block is marked discarded")
        doomed = np.flatnonzero(self._doomed)
        _require(bool((self._pinned[doomed] > 0).all()), "a discarded block is kept with nothing pinning it")
        visible = np.zeros(len(self._pinned), dtype=np.bool_)
        visible[ready] = True
        _require(
            not (pins.astype(np.bool_) & ~visible & ~self._doomed).any(),
            "a block is pinned, neither visible nor discarded",
        )
        held.extend(doomed.tolist())
        _require(len(set(held)) == len(held), "a slot is held twice (two blocks, or a block and a claim)")
        mirror = self.mirror
        if mirror is not None and not mirror.closed:
            _require(mirror.live == len(self.ready), f"mirror: {mirror.live} keys, index: {len(self.ready)}")
            keys = list(self.ready)
            seen = mirror.blocks(keys) if keys else None
            if seen is not None:
                found, sizes = seen
                _require(np.array_equal(found, ready), "the mirror names another slot for a visible key")
                lengths = self._length[ready]
                _require(np.array_equal(sizes, lengths), "the mirror names another length for a visible key")
        return held

    @property
    def pins_held(self) -> set[int]:
        """The ids of the loads pinning blocks now."""
        return set(self._pins)

    @property
    def claims_held(self) -> set[int]:
        """The ids of the stores in flight now."""
        return set(self._claims)

    def clear(self) -> list[int]:
        """Forget everything (the owner closes); returns every slot held."""
        slots = self._slots_of_ready().tolist()
        for claim in list(self._claims):
            slots.extend(self.abort(claim))
        slots.extend(np.flatnonzero(self._doomed & (self._pinned > 0)).tolist())
        self.ready.clear()
        self._live[:] = False
        self._key[:] = None
        self._pins.clear()
        self._pinned[:] = 0
        self._doomed[:] = False
        if self.mirror is not None:
            self.mirror.clear()
        return sorted(set(slots))


def _require(ok: object, broken: str) -> None:
    if not ok:
        raise AssertionError(f"pool invariant broken: {broken}")
