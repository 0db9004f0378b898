"""The synchronous core: layout arithmetic and slot bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiokvtier import OutOfSlots, SlotError
from aiokvtier._host._layout import UnitLayout
from aiokvtier._host._slots import FEW_IDS, SlotAllocator

from .helpers import KiB, MiB


def test_layout_ramps_then_commit_units() -> None:
    layout = UnitLayout.build(4096 * MiB, 2 * MiB, 512 * MiB)
    starts = [layout.start(i) // MiB for i in range(11)]
    assert starts == [0, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 1536]
    assert layout.count == 8 + 7
    assert layout.units_for(4096 * MiB) == layout.count  # a 4 GiB quota commits exactly 4 GiB


@given(
    slot=st.sampled_from([4 * KiB, 64 * KiB, 2 * MiB, 3 * MiB]),
    per_unit=st.integers(1, 300),
    size=st.integers(1, 1 << 36),
    first=st.sampled_from([4 * KiB, 1 * MiB, 16 * MiB]),
)
def test_layout_units_are_slot_aligned_and_tile_the_range(slot: int, per_unit: int, size: int, first: int) -> None:
    size = max(size, slot)
    layout = UnitLayout.build(size, slot, slot * per_unit, first)
    n = layout.count
    assert layout.start(0) == 0 and layout.end(n - 1) == layout.size
    for i in [*range(min(n, 10)), n - 1]:
        lo, hi = layout.start(i), layout.end(i)
        assert lo < hi and lo % slot == 0 and hi % slot == 0 and hi - lo <= slot * per_unit
        assert layout.unit_at(lo) == i == layout.unit_at(hi - 1)
    firsts = [layout.start(i) for i in range(min(n, 10))]
    lasts = [layout.end(i) - 1 for i in range(min(n, 10))]
    offsets = np.array([0, layout.size - 1, *firsts, *lasts], dtype=np.uint64)
    units = layout.units_at(offsets)
    assert units.tolist() == [layout.unit_at(int(o)) for o in offsets]
    assert layout.ends_of(units).tolist() == [layout.end(int(u)) for u in units]


def test_slots_fresh_ascend_and_freed_reused_most_recent_first() -> None:
    slots = SlotAllocator(8)
    assert [slots.take_one() for _ in range(4)] == [0, 1, 2, 3]
    slots.give(1)
    slots.give(3)
    assert slots.take_one() == 3
    assert slots.take(3) == [1, 4, 5]
    assert slots.count == 6 and slots.available == 2
    with pytest.raises(OutOfSlots):
        slots.take(3)
    assert slots.count == 6


def test_slot_errors_change_nothing() -> None:
    slots = SlotAllocator(4)
    a, b = slots.take(2)
    for bad in (-1, 4, 2, "0", 1.0, True):
        with pytest.raises(SlotError):
            slots.give(bad)  # type: ignore[arg-type]
    slots.give(a)
    with pytest.raises(SlotError, match="not allocated"):
        slots.give(a)
    with pytest.raises(SlotError, match="twice"):
        slots.give_many([b, b])
    with pytest.raises(SlotError):
        slots.give_many([b, 3])
    for bad_value in (1.5, 2**70, "1", None):
        with pytest.raises(SlotError, match="not a slot id"):
            slots.give_many([b, bad_value])  # type: ignore[list-item]
    assert slots.checked_ids((np.int64(b), b)).tolist() == [b, b]
    assert slots.is_allocated(b) and slots.count == 1


@pytest.mark.parametrize("count", [0, 1, 2, FEW_IDS, FEW_IDS + 1])
@pytest.mark.parametrize(
    "spoil",
    [None, -1, 8, 7, True, np.True_, 1.0, np.float64(1), "1", np.int64(1), np.uint64(1), 2**70],
    ids=repr,
)
@pytest.mark.parametrize("form", ["list", "tuple", "int64", "uint64", "object", "2d"])
def test_checked_ids_of_few_ids_answers_as_the_array_path(count: int, spoil: object, form: str) -> None:
    """The few ids of a usual request are checked as Python ints; the answer (the ids, or a
    SlotError naming the culprit) is the array path's, for every form a caller may pass."""
    slots = SlotAllocator(8)
    slots.take(6)  # 0..5 allocated, 6 and 7 not
    ids: list[object] = [i % 6 for i in range(count)]
    if spoil is not None and count:
        ids[count // 2] = spoil
    made: object
    if form in ("list", "tuple"):
        made = list(ids) if form == "list" else tuple(ids)
    else:
        try:
            dtype = {"int64": np.int64, "uint64": np.uint64, "object": object, "2d": np.int64}[form]
            made = np.array(ids, dtype=dtype)
        except (TypeError, ValueError, OverflowError):
            return  # numpy refuses to build it: nothing reaches the tier
        if form == "2d":
            made = made.reshape(1, -1)

    def answer(allocator: SlotAllocator, few: int) -> object:
        import aiokvtier._host._slots as module

        saved, module.FEW_IDS = module.FEW_IDS, few
        try:
            return allocator.checked_ids(made).tolist()  # type: ignore[arg-type]
        except SlotError as error:
            return ("SlotError", str(error))
        finally:
            module.FEW_IDS = saved

    assert answer(slots, FEW_IDS) == answer(slots, -1)


def test_slots_shrink_refuses_allocated_tail_and_filters_free_list() -> None:
    slots = SlotAllocator(10)
    taken = slots.take(8)
    slots.give_many(taken[4:])
    with pytest.raises(SlotError):
        slots.resize(3)
    slots.resize(5)
    assert slots.total == 5 and slots.available == 1
    assert slots.take_one() == 4
    slots.resize(7)
    assert slots.take(2) == [5, 6]


@given(
    st.lists(
        st.tuples(st.sampled_from(["take", "give"]), st.integers(1, 3 * FEW_IDS)),
        max_size=40,
    ),
)
def test_taking_few_slots_and_many_agree_with_a_model(steps: list[tuple[str, int]]) -> None:
    """Few ids (list steps) and many (numpy) hand out the same slots: recycled ones, most
    recently freed first, then fresh ones in order; freed slots can be taken again."""
    total = 4 * FEW_IDS
    slots = SlotAllocator(total)
    held: list[int] = []
    free: list[int] = []  # most recently freed last
    fresh = 0
    for op, n in steps:
        if op == "take":
            if n > total - len(held):
                with pytest.raises(OutOfSlots):
                    slots.take_ids(n)
                continue
            k = min(n, len(free))
            expect = free[::-1][:k] + list(range(fresh, fresh + n - k))
            del free[len(free) - k :]
            fresh += n - k
            got = slots.take_ids(n)
            assert got.dtype == np.int64 and got.tolist() == expect
            held += expect
        elif held:
            given_back = held[: min(n, len(held))]
            held = held[len(given_back) :]
            slots.give_many(given_back)
            free += given_back
        assert slots.count == len(held) and slots.available == total - len(held)
        for slot in held:
            slots.check_allocated(slot)  # marked allocated
        for slot in free:
            with pytest.raises(SlotError):
                slots.check_allocated(slot)
