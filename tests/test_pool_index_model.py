"""The pool's block index against a model: recency kept as an ``OrderedDict`` (least recently used first,
``move_to_end`` on every touch) and CLOCK's scan walked key by key, as the index did before it kept ticks
per slot. Random sequences of stores (committed or aborted), lookups by the owner and through the mirror
(which mark blocks referenced), per-key presence (which touches nothing), loads, unpins, discards and
evictions give the same answers, the same evictions in the same order, and a consistent index and mirror
after every step."""

from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokvtier import BlockNotFound
from aiokvtier._pool import _index
from aiokvtier._pool._index import BlockIndex
from aiokvtier._pool._mirror import USABLE, IndexMirror
from aiokvtier._pool._wire import BUSY, CLAIMED, PRESENT, Key

SLOTS = 12
UNIVERSE: list[Key] = [b"a", b"bb", b"c\x00", b"", 0, 7, -3, 2**70, b"k" * 40, b"d", b"e", 11, b"f", b"g"]


class Model:
    """What the index promises, the plain way."""

    def __init__(self) -> None:
        self.ready: OrderedDict[Key, int] = OrderedDict()
        self.length: dict[int, int] = {}
        self.storing: dict[Key, int] = {}
        self.pins: dict[int, list[int]] = {}
        self.doomed: set[int] = set()
        self.referenced: set[int] = set()

    def pinned(self, slot: int) -> int:
        return sum(slots.count(slot) for slots in self.pins.values())

    def classify(self, keys: list[Key]) -> list[int]:
        out = []
        for key in keys:
            if key in self.ready:
                self.ready.move_to_end(key)
                out.append(PRESENT)
            else:
                out.append(BUSY if key in self.storing else CLAIMED)
        return out

    def lookup(self, keys: list[Key]) -> int:
        hits = 0
        for key in keys:
            if key not in self.ready:
                break
            hits += 1
        for key in keys[:hits]:
            self.ready.move_to_end(key)
        return hits

    def evict(self, n: int, keep: list[Key]) -> tuple[list[Key], list[int]]:
        keys: list[Key] = []
        slots: list[int] = []
        if n <= 0:
            return keys, slots
        for second in (False, True):
            spared: list[Key] = []
            start = len(keys)
            for key, slot in self.ready.items():
                if self.pinned(slot) or key in keep:
                    continue
                if not second and slot in self.referenced:
                    self.referenced.discard(slot)
                    spared.append(key)
                    continue
                keys.append(key)
                slots.append(slot)
                if len(keys) == n:
                    break
            for key in keys[start:]:
                del self.ready[key]
            for key in spared:
                self.ready.move_to_end(key)
            if len(keys) == n or not spared:
                break
        return keys, slots


keys_st = st.lists(st.sampled_from(UNIVERSE), max_size=6)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), with_mirror=st.booleans(), log=st.sampled_from([1, 3, _index.LOG_MIN]))
def test_the_index_matches_its_model(data: st.DataObject, with_mirror: bool, log: int) -> None:
    """``log``: the recency log's smallest buffer and chunk (small: it is compacted and grown, and evictions
    read it in several chunks, within a few steps)."""
    writer = IndexMirror.create(SLOTS) if with_mirror and USABLE else None
    reader = IndexMirror.attach(os.dup(writer.fd), SLOTS) if writer is not None else None
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(_index, "LOG_MIN", log)
            _run(data, BlockIndex(writer, SLOTS), reader)
    finally:
        for mirror in (reader, writer):
            if mirror is not None:
                mirror.close()


def _run(data: st.DataObject, index: BlockIndex, reader: IndexMirror | None) -> None:
    model = Model()
    free = list(range(SLOTS))
    flying: dict[int, tuple[list[Key], list[int], list[int]]] = {}  # claims in flight: keys, slots, lengths

    def give_back(slots: list[int] | np.ndarray) -> None:
        free.extend(int(s) for s in slots)

    for _ in range(data.draw(st.integers(1, 40))):
        ops = ["store", "finish", "lookup", "look", "contains", "load", "unpin", "discard", "evict"]
        op = data.draw(st.sampled_from(ops))
        if op == "store":
            keys = data.draw(st.lists(st.sampled_from(UNIVERSE), max_size=6, unique=True))
            outcomes = index.classify(keys)
            assert outcomes.tolist() == model.classify(keys)
            claimed = [k for k, o in zip(keys, outcomes.tolist(), strict=True) if o == CLAIMED]
            if not claimed or len(claimed) > len(free):
                continue
            lengths = [data.draw(st.integers(1, 1000)) for _ in claimed]
            claim = index.claim(claimed, np.array(lengths, dtype=np.int64))
            model.storing.update(dict.fromkeys(claimed, claim))
            slots = [free.pop(data.draw(st.integers(0, len(free) - 1))) for _ in claimed]
            index.place(claim, np.array(slots, dtype=np.int64))
            flying[claim] = (claimed, slots, lengths)
        elif op == "finish" and flying:  # a store in flight commits, or gives up (its process went away)
            claim = data.draw(st.sampled_from(sorted(flying)))
            claimed, slots, lengths = flying.pop(claim)
            if data.draw(st.booleans()):
                assert index.commit(claim) == claimed
                for key, slot, length in zip(claimed, slots, lengths, strict=True):
                    model.ready[key] = slot
                    model.length[slot] = length
                    model.referenced.discard(slot)
            else:
                assert sorted(index.abort(claim)) == sorted(slots)
                give_back(slots)
            for key in claimed:
                del model.storing[key]
        elif op == "lookup":
            keys = data.draw(keys_st)
            assert index.lookup(keys) == model.lookup(keys)
        elif op == "look" and reader is not None:
            keys = data.draw(keys_st)
            hits = reader.lookup(keys)
            assert hits is not None
            want = 0
            while want < len(keys) and keys[want] in model.ready:
                want += 1
            assert hits == want
            model.referenced.update(model.ready[k] for k in keys[:hits])
        elif op == "contains":  # touches nothing: the evictions after it follow the model's order still
            keys = data.draw(keys_st)
            want_present = [k in model.ready for k in keys]
            assert index.present(keys).tolist() == want_present
            if reader is not None:
                seen = reader.present(keys)
                assert seen is not None and seen.tolist() == want_present
        elif op == "load":
            keys = data.draw(keys_st)
            if not keys:
                continue
            missing = [k for k in keys if k not in model.ready]
            if missing:  # absent, or being stored: nothing pinned
                with pytest.raises(BlockNotFound) as caught:
                    index.pin(keys)
                assert caught.value.key == missing[0]
                continue
            pin, slots, lengths = index.pin(keys)
            want = [model.ready[k] for k in keys]
            assert slots.tolist() == want and lengths.tolist() == [model.length[s] for s in want]
            for key in keys:
                model.ready.move_to_end(key)
            model.pins[pin] = want
        elif op == "unpin" and model.pins:
            pin = data.draw(st.sampled_from(sorted(model.pins)))
            freed = index.unpin(pin, loaded=data.draw(st.booleans()))
            model.pins.pop(pin)
            want = sorted(s for s in model.doomed if not model.pinned(s))
            assert sorted(freed) == want
            model.doomed.difference_update(want)
            give_back(freed)
        elif op == "discard":
            keys = data.draw(keys_st)
            dropped, freed = index.discard(keys)
            want: list[Key] = []
            want_freed: list[int] = []
            for key in keys:
                slot = model.ready.pop(key, None)
                if slot is None:
                    continue
                want.append(key)
                if model.pinned(slot):
                    model.doomed.add(slot)
                else:
                    want_freed.append(slot)
            assert dropped == want and freed.tolist() == want_freed
            give_back(freed)
        elif op == "evict":
            n = data.draw(st.integers(0, 5))
            keep = data.draw(keys_st)
            evicted = index.evict(n, keep)
            assert evicted == model.evict(n, keep)
            give_back(evicted[1])
        index.check()
        assert index.blocks() == dict(model.ready) and len(index) == len(model.ready)
        for key in UNIVERSE:
            assert index.claims_storing([key]) == ({model.storing[key]} if key in model.storing else set())
    for claim in sorted(flying):
        claimed, slots, _ = flying.pop(claim)
        assert sorted(index.abort(claim)) == sorted(slots)
        for key in claimed:
            del model.storing[key]
    # Everything that may go, in the order it goes: the whole recency order, referenced blocks last.
    assert index.evict(SLOTS, []) == model.evict(SLOTS, [])
    index.check()
