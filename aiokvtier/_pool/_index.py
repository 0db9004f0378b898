"""The pool's block index: which key lives in which slot, for every process at once.

A synchronous core that the owner's service (``aiokvtier._pool._owner``)
calls from its event loop; it never touches memory and never frees a slot
itself: every call that lets slots go returns them, and the service hands
them back to the tier. A block's life, as in ``BlockStore``::

    (absent) ──claim──> storing ──commit──> ready ──evict/discard──> (absent)
                           │                  │ pinned by a load: never evicted;
                           └─ abort ─> (slot) │ discarded while pinned: freed at the last unpin

Claims and pins carry ids, so that the service can release everything a
process held when its connection closes. One plain dict maps each key to
its block's slot (ready) or to its claim (storing: ``~claim``, negative),
so that a store's keys are classified in one pass and its commit rewrites
their values rather than moving them between two dicts; a block's key,
length, pin count, "discarded while pinned" mark and recency are arrays
indexed by its slot. A call of 4,096 keys is a few dict passes in C and
array operations, no Python object and no Python step per key (a ``Block``
object per key cost a store's commit about a millisecond).

Recency is a tick per slot: a touch of ``n`` blocks gives them the next
``n`` ticks, in order, and appends ``(slot, tick)`` to a log, so the log's
entries whose tick is still their block's are the blocks from least to most
recently used, as an ``OrderedDict``'s ``move_to_end`` would have them (which
cost a store's commit and a discard of 4,096 keys ~0.45 ms more than a plain
dict). An eviction reads the log from its head in chunks, as far as it needs;
stale entries are dropped when the log's buffer is full (each costs one
append, so that is amortized).

With a mirror (``aiokvtier._pool._mirror``), every change of the ready
blocks is written there too, in the same step, and attached processes look
keys up in it themselves. Their hits do not reach this order: they set the
block's referenced byte instead, and an eviction gives a referenced block a
second chance (CLOCK over the LRU order: it is cleared and moved to the
most recent end, and the scan goes on).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Collection, Sequence

import numpy as np
import numpy.typing as npt

from .._errors import BlockNotFound
from ._mirror import IndexMirror
from ._wire import BUSY, CLAIMED, PRESENT, SKIPPED, Key, KeyMatrix

__all__ = ["BlockIndex"]

log = logging.getLogger("aiokvtier")

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]
_NONE = np.empty(0, dtype=np.int64)
LOG_MIN = 256
"""The recency log's smallest buffer, and the fewest entries an eviction reads at a time."""
_ONE = np.int64(1)


ABSENT = -1
"""What ``_where`` gives for a key it does not hold (a claim's value, ``~claim``, is -2 or less)."""


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
        self._where: dict[Key, int] = {}
        """Key -> the slot of its visible block (their recency: ``_tick``), or ``~claim`` while a store
        claims it (a key is never both)."""
        self._visible = 0
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
        self._log: I64 = np.zeros(max(2 * slots, LOG_MIN), dtype=np.int64)
        """Touched slots, in the order of their ticks (``_log_tick``); between ``_head`` and ``_end``."""
        self._log_tick: I64 = np.zeros(len(self._log), dtype=np.int64)
        self._head = 0
        self._end = 0
        self._kept: npt.NDArray[np.bool_] = np.zeros(slots, dtype=np.bool_)
        """An eviction's scratch: the slots of the keys it keeps (all False between evictions)."""
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
        return self._visible

    def _find(self, keys: Sequence[Key]) -> I64:
        """Each key's value in ``_where`` (``ABSENT``: none), one loop in C."""
        where = self._where
        return np.fromiter(map(where.get, keys, itertools.repeat(ABSENT)), dtype=np.int64, count=len(keys))

    def blocks(self) -> dict[Key, int]:
        """Key -> slot of every visible block (a pass over the index: for checks)."""
        return {k: v for k, v in self._where.items() if v >= 0}

    def claims_storing(self, keys: Sequence[Key]) -> set[int]:
        """The claims storing any of ``keys``."""
        return {~v for v in self._find(keys).tolist() if v < ABSENT}

    @property
    def claims(self) -> int:
        return len(self._claims)

    @property
    def pinned(self) -> int:
        slots = self._slots_of_ready()
        return int(np.count_nonzero(self._pinned[slots]))

    def _slots_of_ready(self) -> I64:
        return np.flatnonzero(self._live).astype(np.int64)

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
            self._kept = np.concatenate([self._kept, np.zeros(extra, dtype=np.bool_)])

    def _touch(self, slots: I64) -> None:
        """The blocks in ``slots`` become the most recently used, the last of them most (a slot twice: its
        last place counts, as ``move_to_end`` would have it)."""
        n = len(slots)
        if not n:
            return
        ticks = np.arange(self._clock, self._clock + n, dtype=np.int64)
        self._tick[slots] = ticks
        self._clock += n
        if self._end + n > len(self._log):
            self._compact(n)
        self._log[self._end : self._end + n] = slots
        self._log_tick[self._end : self._end + n] = ticks
        self._end += n

    def _current(self, slots: I64, ticks: I64) -> npt.NDArray[np.bool_]:
        """Which log entries still stand for their block's last touch (a visible block, its tick)."""
        current: npt.NDArray[np.bool_] = self._live[slots] & (self._tick[slots] == ticks)
        return current

    def _compact(self, room: int) -> None:
        """Drop the log's stale entries, and grow its buffer if ``room`` more still do not fit."""
        span = slice(self._head, self._end)
        slots, ticks = self._log[span], self._log_tick[span]
        keep = self._current(slots, ticks)
        slots, ticks = slots[keep], ticks[keep]
        size = len(self._log)
        if len(slots) + room > size // 2:  # at most half full after: the next compaction is as far off
            size = max(2 * size, 2 * (len(slots) + room))
            self._log = np.zeros(size, dtype=np.int64)
            self._log_tick = np.zeros(size, dtype=np.int64)
        self._log[: len(slots)] = slots
        self._log_tick[: len(slots)] = ticks
        self._head, self._end = 0, len(slots)

    # -- queries --------------------------------------------------------------------

    def lookup(self, keys: Sequence[Key]) -> int:
        """The stored prefix of ``keys``; touches it (most recent last)."""
        n = len(keys)
        # One loop in C: each key's slot (-1: absent), then the touches of the prefix as one array write.
        slots = self._find(keys)
        missing = np.flatnonzero(slots < 0)
        hits = int(missing[0]) if missing.size else n
        self._touch(slots[:hits])
        c = self.counts
        c["queries"] += 1
        c["hits"] += hits
        c["misses"] += len(keys) - hits
        return hits

    def present(self, keys: Sequence[Key]) -> npt.NDArray[np.bool_]:
        """Per key, whether a visible block holds it (a key being stored does not yet); touches nothing and
        counts nothing."""
        found: npt.NDArray[np.bool_] = self._find(keys) >= 0
        return found

    # -- store: classify, claim, commit or abort ------------------------------------------

    def classify(self, keys: Sequence[Key]) -> U8:
        """Each key's outcome before slots are taken: ``PRESENT`` (touched), ``BUSY`` (another claim
        stores it) or ``CLAIMED`` (to store).

        :raises ValueError: a key twice.
        """
        n = len(keys)
        if len(set(keys)) != n:
            raise ValueError("a key appears twice in one store; nothing changed")
        out = np.full(n, CLAIMED, dtype=np.uint8)
        if self._where:
            slots = self._find(keys)
            present = slots >= 0
            if present.any():
                out[present] = PRESENT
                self._touch(slots[present])
            out[slots < ABSENT] = BUSY
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
        self._where.update(zip(keys, itertools.repeat(~claim)))
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
        self._where.update(zip(keys, slots.tolist(), strict=True))  # each key's claim replaced by its slot
        self._visible += len(keys)
        self._length[slots] = lengths
        self._live[slots] = True
        self._key[slots] = keys
        self._touch(slots)
        self._mirrored(lambda mirror: mirror.insert(keys, slots, lengths, entry.types, entry.matrix))
        self.counts["stores"] += len(keys)
        self.bytes_stored += int(lengths.sum())
        return keys

    def abort(self, claim: int) -> list[int]:
        """Forget a claim (its store failed, or its process went away); returns its slots to free."""
        entry = self._claims.pop(claim, None)
        if entry is None:
            return []
        deque(map(self._where.pop, entry.keys, itertools.repeat(None)), maxlen=0)
        freed: list[int] = entry.slots.tolist()
        return freed

    def placed(self, claim: int) -> bool:
        """Whether ``claim`` is a store in flight whose slots are placed (it may commit)."""
        entry = self._claims.get(claim)
        return entry is not None and len(entry.slots) == len(entry.keys)

    def owns(self, claim: int) -> bool:
        return claim in self._claims

    # -- room --------------------------------------------------------------------------

    def evict(self, n: int, keep: Collection[Key]) -> tuple[list[Key], list[int]]:
        """Up to ``n`` least recently used blocks that no load reads and that are not in ``keep``;
        returns their keys and slots (to free). A block an attached process's lookup hit since the last
        scan is passed over once (moved to the most recent end).

        The scan reads the recency log in chunks (a scan in Python cost ~0.3 us a block passed), as far as
        it needs: an eviction of a few blocks reads a few entries, not the whole order."""
        if n <= 0 or not self._visible:
            return [], []
        mirror = self.mirror
        kept = self._find(list(keep))
        kept = kept[kept >= 0]
        self._kept[kept] = True
        try:
            taken, spared, scanned = self._oldest(n)
        finally:
            self._kept[kept] = False
        found = sum(map(len, taken))
        spared_all = np.concatenate(spared) if spared else _NONE
        # The first pass found fewer than n: the second takes the oldest of what it passed over (moved to the
        # most recent end meanwhile, in their order, behind every block it did not pass over).
        second = spared_all[: n - found] if found < n else _NONE
        slots = np.concatenate([*taken, second])
        keys: list[Key] = self._key[slots].tolist()
        deque(map(self._where.__delitem__, keys), maxlen=0)
        self._forget(slots)
        self._advance(scanned)  # before the touch below, which may compact the log
        if mirror is not None and spared_all.size:
            mirror.unreference_many(spared_all)
        self._touch(spared_all[len(second) :])
        self._mirrored(lambda mirror: mirror.remove_slots(slots))
        self.counts["evictions"] += len(keys)
        freed: list[int] = slots.tolist()
        return keys, freed

    def _oldest(self, n: int) -> tuple[list[I64], list[I64], int]:
        """CLOCK's first pass over the log: the oldest ``n`` blocks that no load reads, not kept and not
        referenced, and the referenced ones passed over before the ``n``-th (fewer than ``n`` where the log
        ends first); and where the scan stopped. In chunks of the log, each a few array operations."""
        mirror = self.mirror
        taken: list[I64] = []
        spared: list[I64] = []
        found, at = 0, self._head
        while found < n and at < self._end:
            stop = min(self._end, at + max(2 * (n - found), LOG_MIN))
            slots, ticks = self._log[at:stop], self._log_tick[at:stop]
            at = stop
            slots = slots[self._current(slots, ticks) & (self._pinned[slots] == 0) & ~self._kept[slots]]
            if mirror is None:
                referenced = np.zeros(len(slots), dtype=np.bool_)
            else:
                referenced = mirror.referenced_many(slots)
            plain = np.flatnonzero(~referenced)
            if plain.size >= n - found:  # the n-th is in this chunk: the scan ends there
                last = int(plain[n - found - 1]) + 1
                taken.append(slots[plain[: n - found]])
                spared.append(slots[:last][referenced[:last]])
                found = n
            else:
                taken.append(slots[plain])
                spared.append(slots[referenced])
                found += plain.size
        return taken, spared, at

    def _advance(self, scanned: int) -> None:
        """Move the log's head past the stale entries it starts with, up to ``scanned``."""
        span = slice(self._head, scanned)
        current = np.flatnonzero(self._current(self._log[span], self._log_tick[span]))
        self._head = self._head + int(current[0]) if current.size else max(self._head, scanned)

    def _forget(self, slots: I64) -> None:
        """The blocks in ``slots`` are no longer visible (their keys already out of ``_where``)."""
        self._visible -= len(slots)
        self._live[slots] = False
        self._key[slots] = None

    # -- the mirror -------------------------------------------------------------------------

    def _mirrored(self, write: Callable[[IndexMirror], object]) -> None:
        """Write a change of the ready blocks, already made here, to the mirror.

        The mirror's table is shared memory that every attached process maps read-write (for its
        referenced bytes): one that wrote over it, or a write that cannot have its memory, makes the write
        fail part-way. That must not cost the index its books (a discard that raised there kept its slots
        from the tier for good, and the mirror answered its keys as hits): the index is changed first and
        whole, and a failed write has the mirror made anew from it. A mirror that cannot be made anew is
        retired: attached processes ask the owner from then on."""
        mirror = self.mirror
        if mirror is None:
            return
        try:
            write(mirror)
        except Exception as exc:
            try:
                mirror.clear()
                slots = self._slots_of_ready()
                mirror.insert(self._key[slots].tolist(), slots, self._length[slots])
            except Exception as again:
                self.mirror = None
                try:
                    mirror.mark_closed()
                finally:
                    log.error(
                        "aiokvtier: the pool's index mirror could not be written (%r) nor made anew (%r): "
                        "attached processes ask the owner for lookups from now on",
                        exc,
                        again,
                    )
            else:
                log.warning("aiokvtier: the pool's index mirror could not be written (%r): made anew", exc)

    # -- load: pin, unpin -------------------------------------------------------------------

    def pin(self, keys: Sequence[Key]) -> tuple[int, I64, I64]:
        """Pin every key's block for a load; touches them.

        :returns: ``(pin id, slots, lengths)``.
        :raises BlockNotFound: a key is not stored (the first missing one; nothing pinned).
        """
        slots = self._find(keys)
        missing = np.flatnonzero(slots < 0)
        if missing.size:
            raise BlockNotFound(keys[int(missing[0])])
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
        where = self._where
        gone = np.fromiter(map(where.pop, keys, itertools.repeat(ABSENT)), dtype=np.int64, count=n)
        storing = np.flatnonzero(gone < ABSENT)
        for i in storing.tolist():  # a key being stored is not a block yet: its claim's mark goes back
            where[keys[i]] = int(gone[i])
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
        self._mirrored(lambda mirror: mirror.remove_slots(gone))
        self.counts["discards"] += len(dropped)
        return dropped, freed

    # -- checks ------------------------------------------------------------------------------

    def check(self) -> list[int]:
        """Check the index against itself and its mirror; returns every slot it holds (blocks, claims,
        discarded blocks still pinned).

        :raises AssertionError: an invariant does not hold (the message names it).
        """
        blocks = self.blocks()
        _require(len(blocks) == self._visible, f"{self._visible} blocks counted, {len(blocks)} visible")
        ready = np.fromiter(blocks.values(), dtype=np.int64, count=len(blocks))
        held: list[int] = ready.tolist()
        live = np.zeros(len(self._live), dtype=np.bool_)
        live[ready] = True
        _require(np.array_equal(live, self._live), "the per-slot record of visible blocks is wrong")
        _require(self._key[ready].tolist() == list(blocks), "a visible block's slot names another key")
        _require(all(k is None for k in self._key[~live].tolist()), "a slot with no visible block keeps a key")
        span = slice(self._head, self._end)
        logged = self._log[span][self._current(self._log[span], self._log_tick[span])]
        _require(
            len(logged) == len(ready) and np.array_equal(np.sort(logged), np.sort(ready)),
            "the recency log does not hold each visible block once",
        )
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
                _require(self._where.get(key) == ~claim, f"key {key!r} of claim {claim} is not marked as stored by it")
            held.extend(slots.tolist())
        _require(
            len(self._where) - len(blocks) == sum(len(entry.keys) for entry in self._claims.values()),
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
            _require(mirror.live == len(blocks), f"mirror: {mirror.live} keys, index: {len(blocks)}")
            keys = list(blocks)
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
        self._where.clear()
        self._visible = 0
        self._head = self._end = 0
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
