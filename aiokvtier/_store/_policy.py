"""Eviction policies: which blocks a full store gives up first.

A policy sees blocks only as tier slot ids (one block per slot, ids below the
capacity) and is told everything that happens to them: a block became
visible (``EvictionPolicy.inserted()``), was hit
(``accessed()``, one call per batch), or left
(``removed()``). When the store needs room it walks
``victims()``, evicting some candidates and skipping others
(blocks a load is reading, or that the same call stored).

- ``LRUPolicy`` (``"lru"``, the default): exact least recently used, about
  11 bytes of state per block, for stores of millions of blocks.
- ``S3FIFOPolicy`` (``"s3fifo"``): S3-FIFO, scan-resistant, heavier per
  block (Python objects), recency only approximate.

Synchronous and not thread-safe: the store calls a policy from its event loop
only, and walks one ``victims()`` iterator at a time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from .._host._slots import FEW_IDS, positive_count

__all__ = ["EvictionPolicy", "Key", "LRUPolicy", "S3FIFOPolicy", "has_repeats", "make_policy"]

Key = bytes | int


class EvictionPolicy(ABC):
    """Chooses which blocks a full store evicts.

    A block is identified by its tier slot id (one block per slot, ids <
    capacity). Not thread-safe: call it from the store's event loop only.
    """

    __slots__ = ()

    name: str

    @abstractmethod
    def inserted(self, slot: int, key: Key) -> None:
        """A block became visible in ``slot``.

        :raises ValueError: ``slot`` already holds a tracked block.
        :raises IndexError: ``slot`` is not below the capacity.
        :raises TypeError: ``slot`` is not an integer (a bool, a float).
        """

    @abstractmethod
    def accessed(self, slots: npt.NDArray[np.int64]) -> None:
        """Blocks were hit (lookup, load, or a store that found them present); one call per batch, hot path.

        Slots that hold no tracked block are ignored: a store may hit a block
        in the same batch in which it evicts it. Ids must be slot ids
        (``0 <= id < capacity``): the check would cost more than the update,
        and the store passes its own ids.
        """

    def inserted_many(self, slots: Sequence[int] | npt.NDArray[np.int64], keys: Sequence[Key]) -> None:
        """Several blocks became visible, in this order (one store call); override to batch it.

        All or nothing: if one insert fails, those made before it are removed again.

        :raises TypeError: a slot id that is not an integer (a bool, a float, a str), nothing inserted.
        :raises ValueError: slots that are not one flat sequence, or a slot given twice or tracked already.
        :raises IndexError: a slot not below the capacity.
        """
        done: list[int] = []
        try:
            for slot, key in zip(slot_ids(slots).tolist(), keys, strict=True):
                self.inserted(slot, key)
                done.append(slot)
        except BaseException:
            for slot in reversed(done):
                self.removed(slot)
            raise

    @abstractmethod
    def removed(self, slot: int) -> None:
        """A block left (discarded, evicted, or dropped by a shrink).

        :raises KeyError: no block is tracked in ``slot`` (a bug in the caller).
        """

    def removed_many(self, slots: npt.NDArray[np.int64]) -> None:
        """Several blocks left (one discard call); override to batch it.

        :raises KeyError: a slot holds no tracked block (a bug in the caller).
        """
        for slot in slots.tolist():
            self.removed(slot)

    @abstractmethod
    def victims(self) -> Iterator[int]:
        """Candidate slots, best victim first.

        The store evicts a candidate by calling ``removed(slot)`` before it
        advances the iterator, or skips it (pinned by a load, or stored by the
        same call) by advancing without removing. The iterator must end once
        no unvisited candidate is left, even when the store skips every block;
        the store closes it after each eviction episode. A slot is offered at
        most once per iterator.
        """

    def resize(self, capacity: int) -> None:
        """Slot ids are now < capacity.

        Grow: before inserts into new slots; shrink: after the blocks past the
        end were removed. The base implementation keeps no per-slot state and
        only checks the capacity.

        :raises ValueError: a shrink would drop a block still tracked, or the
            capacity is not positive.
        """
        positive_count(capacity, "capacity")

    @abstractmethod
    def __len__(self) -> int:
        """Blocks tracked."""

    def tracked(self) -> npt.NDArray[np.bool_] | None:
        """Per slot id below the capacity, whether a block is tracked there; None (the default): not said.

        Read only by ``BlockStore.check_invariants()``, which then checks the
        policy against the store: sized for the store's slots, tracking every
        visible block and no slot without one.
        """
        return None


_ABSENT = np.uint64(2**64 - 1)


def slot_id(slot: object) -> int:
    """``slot`` as a slot id.

    :raises TypeError: not an integer: a bool (an index of every slot to numpy), a float, a str.
    """
    if type(slot) is int:
        return slot
    if isinstance(slot, np.integer):
        return int(slot)
    raise TypeError(f"a slot id is an int, not {type(slot).__name__} ({slot!r})")


def slot_ids(slots: Sequence[int] | npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """``slots`` as one flat int64 array: a store's own int64 array costs a dtype look and no copy.

    :raises TypeError: an id that is not an integer (numpy would take True as 1, 1.5 as 1 and "1" as 1).
    :raises ValueError: ids that are not one flat sequence.
    :raises IndexError: an id past any slot id (an int past int64).
    """
    if isinstance(slots, np.ndarray):
        if slots.dtype.kind not in "iu":
            raise TypeError(f"slot ids are integers, not {slots.dtype}")
    else:
        slots = slots if isinstance(slots, list | tuple) else list(slots)
        for slot in slots:
            slot_id(slot)
    try:
        ids = np.asarray(slots, dtype=np.int64)  # uint64 ids past int64 wrap below zero: out of range below
    except OverflowError:
        raise IndexError("a slot id is past any capacity") from None
    if ids.ndim != 1:
        raise ValueError(f"slot ids are one flat sequence, not {ids.ndim}-D")
    return ids


def has_repeats(ids: npt.NDArray[np.int64]) -> bool:
    """Whether an id appears twice (a sort: numpy's hashing unique is ten times slower here)."""
    ordered = np.sort(ids)
    return bool((ordered[1:] == ordered[:-1]).any())


class LRUPolicy(EvictionPolicy):
    """Exact least recently used, sized for millions of blocks.

    State per slot: a uint64 access stamp and a bool "present" flag (9 bytes),
    plus an eviction queue of about one eighth of the blocks (16 bytes each):
    11 bytes per block in all (tracemalloc, 1 M blocks). A batch of hits is a
    numpy gather and scatter (a 4,096-slot batch of random slots: about 50 us
    at 1 M blocks, cache misses included); inserts and removals are O(1);
    eviction is amortised O(1), with an O(capacity) rebuild of the queue
    (5-15 ms at 1 M blocks) every ``max(1024, blocks / 8)`` victims.

    Trade-off: LRU is exact and cheap but not scan-resistant: one pass over
    blocks that are never used again (a long prompt nobody repeats) flushes
    the working set. ``S3FIFOPolicy`` resists scans at a higher cost per
    block.

    Blocks hit in the same batch are equally recent; among them the lower slot
    id is evicted first.
    """

    name = "lru"
    _MIN_QUEUE: ClassVar[int] = 1024
    """Least entries a rebuilt queue asks for; tests lower it to reach the rebuild paths with few blocks."""

    __slots__ = ("_clock", "_count", "_episode", "_head", "_present", "_qslots", "_qstamps", "_stamp")

    def __init__(self, capacity: int) -> None:
        capacity = positive_count(capacity, "capacity")
        # An absent slot's stamp is the largest uint64, so the rebuild's
        # partition needs no mask: absent slots sort after every block.
        self._stamp = np.full(capacity, _ABSENT, dtype=np.uint64)
        self._present = np.zeros(capacity, dtype=np.bool_)
        self._clock = 0
        self._count = 0
        self._qslots = np.empty(0, dtype=np.int64)
        self._qstamps = np.empty(0, dtype=np.uint64)
        self._head = 0
        self._episode = 0

    def __len__(self) -> int:
        return self._count

    def tracked(self) -> npt.NDArray[np.bool_]:
        return self._present.copy()

    def __repr__(self) -> str:
        queued = len(self._qslots) - self._head
        return f"<LRUPolicy [{self._count} blocks of {len(self._stamp)} slots | queue {queued}]>"

    def inserted(self, slot: int, key: Key) -> None:
        slot = slot_id(slot)
        if not 0 <= slot < len(self._stamp):
            raise IndexError(f"slot {slot} is not below the capacity ({len(self._stamp)})")
        if self._present[slot]:
            raise ValueError(f"slot {slot} already holds a tracked block")
        self._clock += 1
        self._stamp[slot] = self._clock
        self._present[slot] = True
        self._count += 1

    def inserted_many(self, slots: Sequence[int] | npt.NDArray[np.int64], keys: Sequence[Key]) -> None:
        ids = slot_ids(slots)
        if len(ids) != len(keys):
            raise ValueError(f"{len(ids)} slots for {len(keys)} keys")
        if not ids.size:
            return
        # A store's few slots: checked as Python ints, where each numpy reduction costs about 2 us.
        few = ids.tolist() if ids.size <= FEW_IDS else None
        capacity = len(self._stamp)
        low, high = (min(few), max(few)) if few is not None else (int(ids.min()), int(ids.max()))
        if low < 0 or high >= capacity:
            raise IndexError(f"a slot is not below the capacity ({capacity})")
        if np.count_nonzero(self._present[ids]):
            raise ValueError("a slot already holds a tracked block")
        stamps = np.arange(self._clock + 1, self._clock + 1 + ids.size, dtype=np.uint64)
        if few is not None:
            if len(set(few)) != len(few):
                raise ValueError("a slot appears twice in one insert")
            self._stamp[ids] = stamps
        else:
            self._stamp[ids] = stamps
            # A slot given twice keeps only its last stamp; cheaper to see than to sort the ids first.
            if not np.array_equal(self._stamp[ids], stamps):
                self._stamp[ids] = _ABSENT  # they were all absent: nothing else to undo
                raise ValueError("a slot appears twice in one insert")
        self._clock += ids.size
        self._present[ids] = True
        self._count += ids.size

    def accessed(self, slots: npt.NDArray[np.int64]) -> None:
        hit = slots[self._present[slots]]
        if not len(hit):
            return
        # One stamp per position, in the batch's order: the last one hit is the most recent
        # (a repeated slot keeps its last position: numpy's assignment applies them in order).
        self._stamp[hit] = np.arange(self._clock + 1, self._clock + 1 + len(hit), dtype=np.uint64)
        self._clock += len(hit)

    def removed(self, slot: int) -> None:
        if not (0 <= slot < len(self._present) and self._present[slot]):
            raise KeyError(slot)
        self._present[slot] = False
        self._stamp[slot] = _ABSENT  # also marks any queue entry for the slot stale
        self._count -= 1

    def removed_many(self, slots: npt.NDArray[np.int64]) -> None:
        if not slots.size:
            return
        if int(slots.min()) < 0 or int(slots.max()) >= len(self._present):
            raise KeyError(int(slots.min()) if int(slots.min()) < 0 else int(slots.max()))
        absent = np.flatnonzero(~self._present[slots])
        if absent.size or has_repeats(slots):
            raise KeyError(int(slots[absent[0]]) if absent.size else "a slot given twice")
        self._present[slots] = False
        self._stamp[slots] = _ABSENT
        self._count -= slots.size

    def resize(self, capacity: int) -> None:
        capacity = positive_count(capacity, "capacity")
        old = len(self._stamp)
        if capacity < old:
            past = np.flatnonzero(self._present[capacity:])
            if past.size:
                raise ValueError(f"slot {capacity + int(past[0])} still holds a block past the new end ({capacity})")
            self._stamp = self._stamp[:capacity].copy()
            self._present = self._present[:capacity].copy()
            # Entries past the end are stale (their blocks were removed) but
            # would index past the shrunk arrays.
            keep = np.flatnonzero(self._qslots[self._head :] < capacity) + self._head
            self._qslots = self._qslots[keep]
            self._qstamps = self._qstamps[keep]
            self._head = 0
        elif capacity > old:
            self._stamp = np.concatenate([self._stamp, np.full(capacity - old, _ABSENT, dtype=np.uint64)])
            self._present = np.concatenate([self._present, np.zeros(capacity - old, dtype=np.bool_)])
        self._episode += 1  # an iterator open across a resize would read the old arrays

    # Why the queue gives exact LRU. Order blocks by (stamp, slot). A rebuild
    # queues the ``want`` smallest present blocks in that order and remembers
    # each one's stamp; call the largest queued key K. Every present block
    # left out had a key above K when the queue was built, and stamps only
    # grow (each insert or batch takes a clock value above every stamp given
    # before), so blocks left out, blocks hit since (their queue entry is
    # stale: the stamp changed) and blocks inserted since all stay above K.
    # Removal sets the stamp to _ABSENT, which also makes the entry stale. So
    # while the queue holds a valid entry (stamp unchanged), the first valid
    # one is the least recently used block in the store. Entries the store
    # skipped stay in the queue, in order, for the next episode.

    def _rebuild(self, extra: int) -> None:
        """Queue the oldest ``max(_MIN_QUEUE, blocks / 8) + extra`` blocks, oldest first."""
        want = min(self._count, max(self._MIN_QUEUE, self._count // 8) + extra)
        stamp = self._stamp
        if want == self._count:
            chosen = np.flatnonzero(stamp != _ABSENT)
        else:
            # The want-th smallest stamp; blocks tied with it are taken by
            # ascending slot id, so the queue is a prefix of the (stamp, slot)
            # order even when a batch gave thousands of blocks one stamp.
            cut = np.partition(stamp, want - 1)[want - 1]
            older = np.flatnonzero(stamp < cut)
            tied = np.flatnonzero(stamp == cut)[: want - len(older)]
            chosen = np.concatenate([older, tied])
        # flatnonzero is ascending in slot id, so a stable sort orders by (stamp, slot).
        chosen = chosen[np.argsort(stamp[chosen], kind="stable")]
        self._qslots = chosen.astype(np.int64, copy=False)
        self._qstamps = stamp[chosen]
        self._head = 0

    def _compact(self, cursor: int, kept: list[int]) -> None:
        """Drop the consumed queue prefix but the valid entries skipped in it, kept in order before ``cursor``."""
        qslots, qstamps = self._qslots, self._qstamps
        if kept:
            idx = np.asarray(kept, dtype=np.int64)
            idx = idx[self._stamp[qslots[idx]] == qstamps[idx]]
            k = len(idx)
            # The fancy-indexed right-hand sides are copies, so overlap is safe.
            qslots[cursor - k : cursor] = qslots[idx]
            qstamps[cursor - k : cursor] = qstamps[idx]
            cursor -= k
        self._head = cursor

    def victims(self) -> Iterator[int]:
        self._episode += 1
        episode = self._episode
        yielded: set[int] = set()
        kept: list[int] = []  # indices of entries passed over while valid: skipped in this episode
        cursor = self._head
        pending = -1  # index of the entry offered and not yet resumed
        rebuilt = offered = False
        try:
            while True:
                qslots, qstamps, stamp = self._qslots, self._qstamps, self._stamp
                end = len(qslots)
                while cursor < end:
                    slot = int(qslots[cursor])
                    if stamp[slot] != qstamps[cursor]:
                        cursor += 1
                        continue
                    if slot in yielded:
                        kept.append(cursor)
                        cursor += 1
                        continue
                    yielded.add(slot)
                    offered = True
                    pending = cursor
                    yield slot
                    if self._episode != episode:
                        raise RuntimeError("the policy was resized, or a newer victims() began")
                    pending = -1
                    if stamp[slot] == qstamps[cursor]:
                        kept.append(cursor)
                    cursor += 1
                if rebuilt and not offered:
                    return  # every block left was offered in this episode and skipped
                # Ask for as many more as were skipped, so a rebuild that
                # re-queues skipped blocks still reaches unvisited ones.
                present = self._present
                self._rebuild(extra=sum(1 for s in yielded if present[s]))
                kept, cursor = [], 0
                rebuilt, offered = True, False
        finally:
            if self._episode == episode:
                if pending >= 0:
                    kept.append(pending)
                    cursor = pending + 1
                self._compact(cursor, kept)


_SMALL = 1
_MAIN = 2


def _s3fifo_capacity(capacity: int) -> int:
    capacity = positive_count(capacity, "capacity")
    if capacity > 2**32:
        raise ValueError(f"S3FIFOPolicy holds at most 2**32 slots (entries pack ids in 32 bits), got {capacity}")
    return capacity


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP 2023): a small FIFO, a main FIFO and a ghost.

    New blocks enter the small FIFO (about 10% of the blocks). A block leaving
    the small FIFO that was hit since it came in moves to the main FIFO;
    otherwise it is evicted and its key's hash joins the ghost FIFO, and a key
    stored again while its hash is in the ghost goes straight to main. The
    main FIFO evicts in insertion order, giving a block back a place at its
    tail once per hit (frequency counters capped at 3).

    Trade-off: scan-resistant, and better hit rates than LRU on skewed,
    scan-heavy traces: one-hit wonders (a long prompt nobody repeats) leave
    through the small queue without flushing the working set held in main.
    Recency is less exact than LRU (a hit only sets a counter; order is
    insertion order), and the FIFOs and the ghost are Python objects (deques
    of ints, an ordered dict of hashes): at 1 M blocks about 60 bytes per
    block, and about 170 once the ghost is full, against 11 for
    ``LRUPolicy`` (tracemalloc).

    The ghost holds as many hashes as the main FIFO's share of the blocks (90%
    of those tracked), as in the paper, where it is sized to the main queue.
    Hashes, not keys, are remembered: a collision only admits a block to main.
    """

    name = "s3fifo"

    __slots__ = ("_count", "_freq", "_gen", "_ghost", "_hash", "_main", "_nmain", "_nsmall", "_small", "_where")

    def __init__(self, capacity: int) -> None:
        capacity = _s3fifo_capacity(capacity)
        self._where = bytearray(capacity)  # 0 absent, _SMALL or _MAIN
        self._freq = bytearray(capacity)  # hits since insertion or the last pass through main, capped at 3
        # A removal bumps the slot's generation; queue entries carry the
        # generation they were queued with, so removals are O(1) and leave
        # stale entries that are dropped when they reach the head.
        self._gen = array("Q", bytes(8 * capacity))
        self._hash = array("q", bytes(8 * capacity))  # the key's hash, for the ghost once evicted
        self._small: deque[int] = deque()
        self._main: deque[int] = deque()
        self._nsmall = 0
        self._nmain = 0
        self._count = 0
        self._ghost: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return (
            f"<S3FIFOPolicy [{self._count} blocks of {len(self._where)} slots"
            f" | small {self._nsmall}, main {self._nmain}, ghost {len(self._ghost)}]>"
        )

    def tracked(self) -> npt.NDArray[np.bool_]:
        tracked: npt.NDArray[np.bool_] = np.frombuffer(self._where, dtype=np.uint8) != 0
        return tracked

    def _entry(self, slot: int) -> int:
        return (self._gen[slot] << 32) | slot

    def inserted(self, slot: int, key: Key) -> None:
        slot = slot_id(slot)
        if not 0 <= slot < len(self._where):
            raise IndexError(f"slot {slot} is not below the capacity ({len(self._where)})")
        if self._where[slot]:
            raise ValueError(f"slot {slot} already holds a tracked block")
        h = hash(key)
        self._hash[slot] = h
        self._freq[slot] = 0
        if h in self._ghost:
            del self._ghost[h]
            self._where[slot] = _MAIN
            self._main.append(self._entry(slot))
            self._nmain += 1
        else:
            self._where[slot] = _SMALL
            self._small.append(self._entry(slot))
            self._nsmall += 1
        self._count += 1

    def accessed(self, slots: npt.NDArray[np.int64]) -> None:
        if not len(slots):
            return
        # Views are dropped on return: a live export would stop resize() from resizing the bytearrays.
        where = np.frombuffer(self._where, dtype=np.uint8)
        freq = np.frombuffer(self._freq, dtype=np.uint8)
        live = slots[where[slots] != 0]
        freq[live] = np.minimum(freq[live], 2) + 1

    def removed(self, slot: int) -> None:
        if not 0 <= slot < len(self._where) or not (where := self._where[slot]):
            raise KeyError(slot)
        if where == _SMALL:
            self._nsmall -= 1
        else:
            self._nmain -= 1
        self._where[slot] = 0
        self._gen[slot] += 1
        self._count -= 1

    def resize(self, capacity: int) -> None:
        capacity = _s3fifo_capacity(capacity)
        old = len(self._where)
        if capacity < old:
            past = self._where.find(b"\x01", capacity), self._where.find(b"\x02", capacity)
            if max(past) >= 0:
                slot = min(p for p in past if p >= 0)
                raise ValueError(f"slot {slot} still holds a block past the new end ({capacity})")
            del self._where[capacity:], self._freq[capacity:], self._gen[capacity:], self._hash[capacity:]
            mask = (1 << 32) - 1
            self._small = deque(e for e in self._small if e & mask < capacity)
            self._main = deque(e for e in self._main if e & mask < capacity)
            self._trim_ghost()
        elif capacity > old:
            self._where.extend(bytes(capacity - old))
            self._freq.extend(bytes(capacity - old))
            self._gen.frombytes(bytes(8 * (capacity - old)))
            self._hash.frombytes(bytes(8 * (capacity - old)))

    def _trim_ghost(self) -> None:
        bound = self._count - self._count // 10
        ghost = self._ghost
        while len(ghost) > bound:
            ghost.popitem(last=False)

    def _pop(self, queue: deque[int]) -> int:
        """The slot of the first live entry of ``queue`` (the caller knows there is one), stale entries dropped."""
        gen, mask = self._gen, (1 << 32) - 1
        while True:
            entry = queue.popleft()
            slot = entry & mask
            if gen[slot] == entry >> 32:
                return slot

    def victims(self) -> Iterator[int]:
        # Each slot is offered at most once per episode, a block is promoted
        # from small at most once and given a second pass through main at
        # most 3 times (its counter is capped), and a block already offered
        # goes back to the tail of its queue, so the walk is bounded. It ends
        # once every block left in both queues was offered: ``counted`` holds
        # the offered blocks still tracked (slot -> generation) and
        # ``counted_in`` how many sit in each queue. A block offered and then
        # removed keeps being counted until the recount before giving up; a
        # block stored since into an offered slot is counted when the walk
        # meets it, so the counts never exceed the truth for long.
        offered: set[int] = set()
        counted: dict[int, int] = {}
        counted_in = {_SMALL: 0, _MAIN: 0}
        where, freq, gen = self._where, self._freq, self._gen
        while True:
            small_open = counted_in[_SMALL] < self._nsmall
            main_open = counted_in[_MAIN] < self._nmain
            if not (small_open or main_open):
                counted = {slot: g for slot, g in counted.items() if gen[slot] == g}
                counted_in = {_SMALL: 0, _MAIN: 0}
                for slot in counted:
                    counted_in[where[slot]] += 1
                if counted_in[_SMALL] >= self._nsmall and counted_in[_MAIN] >= self._nmain:
                    return
                continue
            if small_open and (self._nsmall > self._count // 10 or not main_open):
                source, queue = _SMALL, self._small
            else:
                source, queue = _MAIN, self._main
            slot = self._pop(queue)
            if slot in offered:
                queue.append(self._entry(slot))
                if counted.get(slot) != gen[slot]:
                    counted[slot] = gen[slot]
                    counted_in[source] += 1
                continue
            if freq[slot]:
                if source == _SMALL:
                    where[slot] = _MAIN
                    self._main.append(self._entry(slot))
                    self._nsmall -= 1
                    self._nmain += 1
                else:
                    freq[slot] -= 1
                    self._main.append(self._entry(slot))
                continue
            g, h = gen[slot], self._hash[slot]
            offered.add(slot)
            try:
                yield slot
            finally:
                # Runs on resume and on close(): an evicted small block's key
                # joins the ghost; a skipped one goes back to its queue's tail.
                if gen[slot] != g:
                    if source == _SMALL:
                        self._ghost[h] = None
                        self._ghost.move_to_end(h)
                        self._trim_ghost()
                else:
                    queue.append(self._entry(slot))
                    counted[slot] = g
                    counted_in[source] += 1


def make_policy(policy: str | EvictionPolicy, capacity: int) -> EvictionPolicy:
    """The policy named ``policy`` (``"lru"`` or ``"s3fifo"``) for ``capacity`` slots.

    An ``EvictionPolicy`` instance is returned itself, resized to ``capacity``.

    :raises ValueError: an unknown name (the message lists the choices), or a
        capacity that is not positive.
    :raises TypeError: neither a name nor an ``EvictionPolicy``.
    """
    if isinstance(policy, EvictionPolicy):
        policy.resize(capacity)
        return policy
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a name or an EvictionPolicy, got {policy!r}")
    try:
        cls = _POLICIES[policy]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {policy!r}; choose one of {', '.join(map(repr, _POLICIES))}"
        ) from None
    return cls(capacity)


_POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy}
