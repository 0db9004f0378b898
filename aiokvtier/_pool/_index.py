"""The pool's block index: which key lives in which slot, for every process at once.

A synchronous core that the owner's service (``aiokvtier._pool._owner``)
calls from its event loop; it never touches memory and never frees a slot
itself: every call that lets slots go returns them, and the service hands
them back to the tier. A block's life, as in ``BlockStore``::

    (absent) ──claim──> storing ──commit──> ready ──evict/discard──> (absent)
                           │                  │ pinned by a load: never evicted;
                           └─ abort ─> (slot) │ discarded while pinned: freed at the last unpin

Claims and pins carry ids, so that the service can release everything a
process held when its connection closes. Ready blocks sit in an
``OrderedDict`` in recency order (least recently used first): a lookup of
4,096 keys is 4,096 dict steps, well under a millisecond.

With a mirror (``aiokvtier._pool._mirror``), every change of the ready
blocks is written there too, in the same step, and attached processes look
keys up in it themselves. Their hits do not reach this order: they set the
block's referenced byte instead, and an eviction gives a referenced block a
second chance (CLOCK over the LRU order: it is cleared and moved to the
most recent end, and the scan goes on).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

from .._errors import BlockNotFound
from ._mirror import IndexMirror
from ._wire import BUSY, CLAIMED, PRESENT, SKIPPED, Key

__all__ = ["Block", "BlockIndex"]


class Block:
    __slots__ = ("doomed", "length", "pins", "slot")

    def __init__(self, slot: int, length: int) -> None:
        self.slot = slot
        self.length = length
        self.pins = 0
        self.doomed = False


class BlockIndex:
    """Keys to slots, claims and pins of a shared block store (the owner's loop only)."""

    def __init__(self, mirror: IndexMirror | None = None) -> None:
        self.mirror = mirror
        self.ready: OrderedDict[Key, Block] = OrderedDict()
        self.storing: dict[Key, int] = {}
        """Key -> the claim storing it."""
        self._claims: dict[int, tuple[list[Key], list[int], list[int]]] = {}
        self._pins: dict[int, list[Block]] = {}
        self._ids = itertools.count(1)
        self.counts = dict.fromkeys(
            ("queries", "hits", "misses", "stores", "present", "skipped", "loads", "evictions", "discards"), 0
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
        return sum(1 for block in self.ready.values() if block.pins)

    # -- queries --------------------------------------------------------------------

    def lookup(self, keys: Sequence[Key]) -> int:
        """The stored prefix of ``keys``; touches it (most recent last)."""
        ready = self.ready
        # Loops in C: membership of every key, then the touches of the prefix (4,096 keys: ~0.2 ms).
        present = list(map(ready.__contains__, keys))
        try:
            hits = present.index(False)
        except ValueError:
            hits = len(keys)
        deque(map(ready.move_to_end, keys[:hits] if hits < len(keys) else keys), maxlen=0)
        c = self.counts
        c["queries"] += 1
        c["hits"] += hits
        c["misses"] += len(keys) - hits
        return hits

    # -- store: classify, claim, commit or abort ------------------------------------------

    def classify(self, keys: Sequence[Key]) -> list[int]:
        """Each key's outcome before slots are taken: ``PRESENT`` (touched), ``BUSY`` (another claim
        stores it) or ``CLAIMED`` (to store).

        :raises ValueError: a key twice.
        """
        if len(set(keys)) != len(keys):
            raise ValueError("a key appears twice in one store; nothing changed")
        ready, storing = self.ready, self.storing
        out = []
        for key in keys:
            if key in ready:
                ready.move_to_end(key)
                out.append(PRESENT)
            elif key in storing:
                out.append(BUSY)
            else:
                out.append(CLAIMED)
        return out

    @staticmethod
    def cut(outcomes: list[int], room: int) -> list[int]:
        """Keep the first ``room`` keys to claim; from the first one left out, every key not present is
        skipped (no key after a skipped one is stored)."""
        out = list(outcomes)
        seen = 0
        skipping = False
        for i, outcome in enumerate(out):
            if outcome == PRESENT:
                continue
            if skipping:
                out[i] = SKIPPED
            elif outcome == CLAIMED:
                seen += 1
                if seen > room:
                    out[i] = SKIPPED
                    skipping = True
        return out

    def claim(self, keys: list[Key], lengths: list[int]) -> int:
        """Mark ``keys`` as being stored (slots come later, ``place``); returns the claim id."""
        claim = next(self._ids)
        for key in keys:
            self.storing[key] = claim
        self._claims[claim] = (keys, [], lengths)
        return claim

    def place(self, claim: int, slots: list[int]) -> None:
        self._claims[claim][1][:] = slots

    def commit(self, claim: int) -> list[Key]:
        """The claim's blocks become visible (most recently used).

        :raises KeyError: no such claim.
        """
        keys, slots, lengths = self._claims.pop(claim)
        ready, storing = self.ready, self.storing
        for key, slot, length in zip(keys, slots, lengths, strict=True):
            del storing[key]
            ready[key] = Block(slot, length)
        if self.mirror is not None:
            self.mirror.insert(keys, slots, lengths)
        self.counts["stores"] += len(keys)
        self.bytes_stored += sum(lengths)
        return keys

    def abort(self, claim: int) -> list[int]:
        """Forget a claim (its store failed, or its process went away); returns its slots to free."""
        entry = self._claims.pop(claim, None)
        if entry is None:
            return []
        keys, slots, _ = entry
        for key in keys:
            self.storing.pop(key, None)
        return slots

    def owns(self, claim: int) -> bool:
        return claim in self._claims

    # -- room --------------------------------------------------------------------------

    def evict(self, n: int, keep: set[Key]) -> tuple[list[Key], list[int]]:
        """Up to ``n`` least recently used blocks that no load reads and that are not in ``keep``;
        returns their keys and slots (to free). A block an attached process's lookup hit since the last
        scan is passed over once (moved to the most recent end)."""
        keys: list[Key] = []
        slots: list[int] = []
        if n <= 0:
            return keys, slots
        ready, mirror = self.ready, self.mirror
        for second in (False, True):  # the second pass takes what the first passed over
            spared: list[Key] = []
            start = len(keys)
            for key, block in ready.items():
                if block.pins or key in keep:
                    continue
                if not second and mirror is not None and mirror.referenced(block.slot):
                    mirror.unreference(block.slot)
                    spared.append(key)
                    continue
                keys.append(key)
                slots.append(block.slot)
                if len(keys) == n:
                    break
            for key in keys[start:]:
                del ready[key]
            deque(map(ready.move_to_end, spared), maxlen=0)
            if len(keys) == n or not spared:
                break
        if mirror is not None:
            mirror.remove_slots(slots)
        self.counts["evictions"] += len(keys)
        return keys, slots

    # -- load: pin, unpin -------------------------------------------------------------------

    def pin(self, keys: Sequence[Key]) -> tuple[int, list[int], list[int]]:
        """Pin every key's block for a load; touches them.

        :returns: ``(pin id, slots, lengths)``.
        :raises BlockNotFound: a key is not stored (the first missing one; nothing pinned).
        """
        ready = self.ready
        try:
            blocks = [ready[key] for key in keys]
        except KeyError:
            raise BlockNotFound(next(k for k in keys if k not in ready)) from None
        for key, block in zip(keys, blocks, strict=True):
            block.pins += 1
            ready.move_to_end(key)
        pin = next(self._ids)
        self._pins[pin] = blocks
        return pin, [block.slot for block in blocks], [block.length for block in blocks]

    def unpin(self, pin: int, loaded: bool = False) -> list[int]:
        """Release a load's pins (``loaded``: its copy landed, count it); returns the slots of blocks
        discarded meanwhile (to free now)."""
        freed: list[int] = []
        blocks = self._pins.pop(pin, [])
        if loaded:
            self.counts["loads"] += len(blocks)
            self.bytes_loaded += sum(block.length for block in blocks)
        for block in blocks:
            block.pins -= 1
            if not block.pins and block.doomed:
                freed.append(block.slot)
        return freed

    def discard(self, keys: Sequence[Key]) -> tuple[list[Key], list[int]]:
        """Drop blocks (unknown keys ignored); returns the keys dropped, and the slots to free now (a pinned
        block's slot is freed at its last unpin)."""
        dropped: list[Key] = []
        freed: list[int] = []
        gone: list[int] = []
        for key in keys:
            block = self.ready.pop(key, None)
            if block is None:
                continue
            dropped.append(key)
            gone.append(block.slot)
            if block.pins:
                block.doomed = True
            else:
                freed.append(block.slot)
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
        held: list[int] = [block.slot for block in self.ready.values()]
        for claim, (keys, slots, lengths) in self._claims.items():
            _require(len(lengths) == len(keys), f"claim {claim} has {len(keys)} keys and {len(lengths)} lengths")
            _require(not slots or len(slots) == len(keys), f"claim {claim}: {len(slots)} slots, {len(keys)} keys")
            for key in keys:
                _require(self.storing.get(key) == claim, f"key {key!r} of claim {claim} is not marked as stored by it")
                _require(key not in self.ready, f"key {key!r} is visible and being stored at once")
            held.extend(slots)
        _require(
            len(self.storing) == sum(len(keys) for keys, _, _ in self._claims.values()),
            "a key is marked as being stored by no claim",
        )
        pins: dict[int, int] = {}
        blocks: dict[int, Block] = {}
        for pinned in self._pins.values():
            for block in pinned:
                pins[id(block)] = pins.get(id(block), 0) + 1
                blocks[id(block)] = block
        for block in self.ready.values():
            _require(not block.doomed, f"the block in slot {block.slot} is visible and discarded")
            _require(block.pins == pins.get(id(block), 0), f"the block in slot {block.slot} has a wrong pin count")
        ready = {id(block) for block in self.ready.values()}
        for ident, block in blocks.items():
            if ident not in ready:
                _require(block.doomed, f"the block in slot {block.slot} is pinned, neither visible nor discarded")
                _require(block.pins == pins[ident], f"the discarded block in slot {block.slot} has a wrong pin count")
                held.append(block.slot)
        _require(len(set(held)) == len(held), "a slot is held twice (two blocks, or a block and a claim)")
        mirror = self.mirror
        if mirror is not None and not mirror.closed:
            _require(mirror.live == len(self.ready), f"mirror: {mirror.live} keys, index: {len(self.ready)}")
            keys = list(self.ready)
            seen = mirror.blocks(keys) if keys else None
            if seen is not None:
                found, sizes = seen
                want = np.array([b.slot for b in self.ready.values()], dtype=np.int64)
                have = np.array([b.length for b in self.ready.values()], dtype=np.int64)
                _require(np.array_equal(found, want), "the mirror names another slot for a visible key")
                _require(np.array_equal(sizes, have), "the mirror names another length for a visible key")
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
        slots = [block.slot for block in self.ready.values()]
        for claim in list(self._claims):
            slots.extend(self.abort(claim))
        for blocks in self._pins.values():
            slots.extend(b.slot for b in blocks if b.doomed and b.pins)
        self.ready.clear()
        self._pins.clear()
        if self.mirror is not None:
            self.mirror.clear()
        return sorted(set(slots))


def _require(ok: object, broken: str) -> None:
    if not ok:
        raise AssertionError(f"pool invariant broken: {broken}")
