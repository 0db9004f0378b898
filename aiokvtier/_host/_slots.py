"""Slot bookkeeping: which slot ids are handed out.

Fresh slots are a counter (``next_fresh``), not a list, so a tier of
millions of slots costs one byte per slot (the allocated map) plus four bytes
per *freed* slot. Freed slots are reused first, most recently freed first,
so hot memory stays hot and fresh slots ascend from zero.

Written from the tier's event loop only. ``checked_ids`` may also run on
another loop's thread (a copy engine shared by several loops checks a copy's
slots there): ``resize`` replaces the allocated map rather than resizing it in
place (a numpy view of it held by such a check would make the resize fail),
and a check reads the map once and bounds its ids by that map's length.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import _numpy  # noqa: F401  (numpy's lazy submodules imported now, not on a loop)
from .._errors import OutOfSlots, SlotError

__all__ = ["SlotAllocator", "positive_count"]


def positive_count(value: object, name: str) -> int:
    """``value`` as a positive int: anything ``operator.index`` takes, but not a bool.

    :raises TypeError: not an integer (a bool, a float, a string).
    :raises ValueError: zero or negative.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, not a bool ({value!r})")
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None
    if n < 1:
        raise ValueError(f"{name} must be positive, got {n}")
    return n


def _fits_q(value: Any) -> bool:
    """Whether ``array("q")`` takes ``value``: an integer (``operator.index``) of 64 bits."""
    try:
        array("q", [value])
    except (TypeError, OverflowError):
        return False
    return True


FEW_IDS = 32
"""Ids that ``checked_ids`` checks as Python ints (the copy planner's small requests)."""


_INT_ONLY = {int}
"""What ``set(map(type, ids))`` is for ids that are all plain ints (bools and numpy ints are not)."""


class SlotAllocator:
    __slots__ = ("_allocated", "_free", "count", "next_fresh", "total")

    def __init__(self, total: int) -> None:
        self.total = total
        """Slots the quota holds; ids ``[0, total)`` are valid."""
        self.next_fresh = 0
        """The next never-allocated id; ``[next_fresh, total)`` are fresh."""
        self.count = 0
        """Slots currently allocated."""
        self._allocated = bytearray(total)
        self._free = array("I")

    @property
    def available(self) -> int:
        return len(self._free) + self.total - self.next_fresh

    @property
    def freed(self) -> int:
        return len(self._free)

    def nbytes(self) -> int:
        """Bookkeeping memory, for the benchmark's budget."""
        return self._allocated.__sizeof__() + self._free.buffer_info()[1] * self._free.itemsize

    def fresh_needed(self, n: int) -> int:
        """Highest fresh id (exclusive) that taking ``n`` slots would reach."""
        return self.next_fresh + max(0, n - len(self._free))

    def take(self, n: int) -> list[int]:
        """Take ``n`` slots: recycled ones first (most recent first), then fresh ones."""
        taken: list[int] = self.take_ids(n).tolist()
        return taken

    def take_ids(self, n: int) -> npt.NDArray[np.int64]:
        """``take()`` as an int64 array."""
        if n > self.available:
            raise OutOfSlots(f"{n} slots requested, {self.available} of {self.total} available")
        free = self._free
        k = min(n, len(free))
        fresh = self.next_fresh
        self.next_fresh = fresh + n - k
        if n <= FEW_IDS:  # a usual request's few slots: list and bytearray steps, no dozen numpy calls
            marks = self._allocated
            ids = [free.pop() for _ in range(k)]  # most recent first
            for slot in ids:
                marks[slot] = 1
            marks[fresh : self.next_fresh] = b"\x01" * (n - k)
            self.count += n
            ids.extend(range(fresh, self.next_fresh))
            return np.array(ids, dtype=np.int64)
        # numpy views of the buffers are dropped before they are resized (a live export forbids it).
        allocated = np.frombuffer(self._allocated, dtype=np.uint8)
        recycled = np.frombuffer(free, dtype=np.uint32)[len(free) - k :][::-1].copy()
        allocated[recycled] = 1
        allocated[fresh : self.next_fresh] = 1
        del allocated
        del free[len(free) - k :]
        self.count += n
        return np.concatenate([recycled.astype(np.int64), np.arange(fresh, self.next_fresh, dtype=np.int64)])

    def take_one(self) -> int:
        free = self._free
        if free:
            slot = free.pop()
        elif self.next_fresh < self.total:
            slot = self.next_fresh
            self.next_fresh = slot + 1
        else:
            raise OutOfSlots(f"all {self.total} slots are allocated")
        self._allocated[slot] = 1
        self.count += 1
        return slot

    def check_allocated(self, slot: int) -> None:
        if not (type(slot) is int and 0 <= slot < self.total):
            raise SlotError(f"slot {slot!r} is not a slot id of this tier (0..{self.total - 1})")
        if not self._allocated[slot]:
            raise SlotError(f"slot {slot} is not allocated (double free, or never handed out)")

    def give(self, slot: int) -> None:
        self.check_allocated(slot)
        self._allocated[slot] = 0
        self._free.append(slot)
        self.count -= 1

    def few_checked(self, slots: object) -> list[int] | None:
        """A copy of ``slots`` as a list, where they are a request's few ids (``FEW_IDS`` at most, a list
        or tuple of ints, or a 1-D integer array) and each is allocated; else None (``checked_ids()``
        then says what is wrong). Each check is one pass in C: no Python step per id. The ids checked
        are the copy's: a caller's thread that changes its list meanwhile changes nothing here."""
        if type(slots) is np.ndarray:
            if slots.ndim != 1 or slots.dtype.kind not in "iu" or slots.size > FEW_IDS:
                return None
            ids: list[int] = slots.tolist()
        elif type(slots) is list or type(slots) is tuple:
            if len(slots) > FEW_IDS:
                return None
            ids = list(slots)
        else:
            return None
        if not ids or set(map(type, ids)) != _INT_ONLY:
            return None
        marks = self._allocated  # once: a resize on the loop replaces it (see the module's docstring)
        if min(ids) < 0 or max(ids) >= len(marks) or not all(map(marks.__getitem__, ids)):
            return None
        return ids

    def checked_ids(self, slots: Iterable[int]) -> npt.NDArray[np.int64]:
        """``slots`` as an int64 array, each an allocated id of this tier (repeats allowed).

        :raises SlotError: an id is not an integer (a bool, a float), out of
            range, or not allocated.
        """
        if not isinstance(slots, list | tuple | np.ndarray):
            slots = list(slots)
        # A usual request's few ids: checked as ints in a few microseconds, where the array path costs a
        # dozen numpy calls; anything else takes that path (and its messages).
        few = self.few_checked(slots)
        if few is not None:
            return np.array(few, dtype=np.int64)
        marks = self._allocated  # once: a resize on the loop replaces it (see the module's docstring)
        total = len(marks)
        if isinstance(slots, list | tuple):
            if bool in set(map(type, slots)):  # one pass in C; array("q") would take True as 1
                raise SlotError(f"slot {next(s for s in slots if type(s) is bool)!r} is not a slot id (a bool)")
            try:  # twice as fast as numpy's type discovery; takes exactly what operator.index takes
                ids = np.frombuffer(array("q", slots), dtype=np.int64)
            except (TypeError, OverflowError):
                # Named here, not through numpy: it would make [0, 2.5] floats and [0, 2**70] objects,
                # and name the 0.
                refused = [s for s in slots if not _fits_q(s)][:1]  # none: an __index__ that answers once only
                what = f"slot {refused[0]!r} is not a slot id" if refused else "slot ids must be integers of 64 bits"
                raise SlotError(f"{what} of this tier (0..{self.total - 1})") from None
        else:
            ids = slots
        if ids.size == 0:
            return np.empty(0, dtype=np.int64)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            bad = next((s for s in ids.ravel().tolist() if type(s) is not int), None)
            if bad is None:  # integers all, in the wrong shape (or objects)
                raise SlotError(f"slot ids are one integer per slot, not an array of shape {ids.shape} of {ids.dtype}")
            raise SlotError(f"slot {bad!r} is not a slot id of this tier (0..{self.total - 1})")
        low, high = int(ids.min()), int(ids.max())  # before the cast: a uint64 past 2**63 would wrap
        if low < 0 or high >= total:
            raise SlotError(f"slot {low if low < 0 else high} is not a slot id of this tier (0..{total - 1})")
        ids = ids.astype(np.int64, copy=False)
        allocated = np.frombuffer(marks, dtype=np.uint8)
        missing = ids[allocated[ids] == 0]
        del allocated  # a live export would stop the map from resizing
        if missing.size:
            raise SlotError(f"slot {int(missing[0])} is not allocated (double free, or never handed out)")
        return ids

    def give_many(self, slots: Iterable[int]) -> None:
        """Free every slot or, if any is invalid or repeated, none."""
        ids = self.checked_ids(slots)
        if ids.size == 0:
            return
        ordered = np.sort(ids)
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
        if repeated.size:
            raise SlotError(f"slot {int(repeated[0])} appears twice in one free_many call")
        allocated = np.frombuffer(self._allocated, dtype=np.uint8)
        allocated[ids] = 0
        del allocated
        self._free.frombytes(ids.astype(np.uint32).tobytes())
        self.count -= int(ids.size)

    def is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.total and bool(self._allocated[slot])

    def allocated_past(self, first: int) -> npt.NDArray[np.int64]:
        """Allocated ids at or past ``first``."""
        allocated = np.frombuffer(self._allocated, dtype=np.uint8)
        ids = np.flatnonzero(allocated[first:]).astype(np.int64) + first
        del allocated  # a live export would stop the buffer from being resized
        return ids

    def highest_allocated(self) -> int:
        """Highest allocated id, or -1."""
        return self._allocated.rfind(b"\x01", 0, self.next_fresh)

    def resize(self, total: int) -> None:
        """Change the number of slots; a shrink must leave no allocated slot past the end.

        The maps are built first and then replaced, never resized in place: a MemoryError changes
        nothing, and a check on another thread that holds the old map reads it to its end.
        """
        if total < self.total:
            if self.highest_allocated() >= total:
                raise SlotError(f"slot {self.highest_allocated()} is allocated past the new end ({total} slots)")
            free = array("I", (s for s in self._free if s < total))
            allocated = self._allocated[:total]
            self._free = free
            self.next_fresh = min(self.next_fresh, total)
        else:
            allocated = self._allocated + bytes(total - self.total)
        self._allocated = allocated
        self.total = total
