"""Where the commit units lie inside the reserved range.

The first commit unit is split into a geometric ramp (4, 4, 8, 16, ...
MiB) so the first allocation waits for milliseconds, not for a 512 MiB unit;
every later unit is ``commit_unit`` long, and unit boundaries past the first
fall on multiples of ``commit_unit``. Every boundary is a
multiple of the slot size, so no slot straddles two units, and a unit is the
atom of commit, decommit and GPU registration. The layout is arithmetic:
no per-unit objects, whatever the reservation size.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

__all__ = ["FIRST_STEP", "UnitLayout"]

FIRST_STEP = 4 << 20
"""Target size of the first unit: ~1.5 ms of population at 2.5 GiB/s (the
first allocation waits for it in a cold process; docs/benchmarks.md, ``cold``)."""


@dataclass(frozen=True, slots=True)
class UnitLayout:
    size: int
    """Bytes covered by units: the reservation, rounded down to whole slots."""
    slot_size: int
    commit_unit: int
    ramp: tuple[int, ...]
    """Start offsets of the ramp units, then the start of the first regular unit."""
    _ramp: npt.NDArray[np.uint64] = field(init=False, repr=False, compare=False)
    """``ramp`` as an array, made once: ``units_at`` runs for every request whose copies could merge."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_ramp", np.asarray(self.ramp, dtype=np.uint64))

    @classmethod
    def build(cls, size: int, slot_size: int, commit_unit: int, first_step: int = FIRST_STEP) -> UnitLayout:
        size -= size % slot_size
        step = max(slot_size, first_step - first_step % slot_size)
        starts = [0]
        while step < commit_unit:
            starts.append(step)
            step *= 2
        if len(starts) > 1:
            starts.append(commit_unit)
        return cls(size, slot_size, commit_unit, tuple(starts))

    @property
    def count(self) -> int:
        """Number of units covering ``size`` (the last one may be short)."""
        return self.unit_at(self.size - 1) + 1

    def start(self, index: int) -> int:
        ramp = self.ramp
        if index < len(ramp):
            return min(ramp[index], self.size)
        return min(ramp[-1] + (index - len(ramp) + 1) * self.commit_unit, self.size)

    def end(self, index: int) -> int:
        return self.start(index + 1)

    def ends_of(self, units: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
        """``end()`` for an array of unit indices."""
        ramp = np.asarray(self.ramp, dtype=np.int64)
        following = units + 1
        regular = ramp[-1] + (following - len(ramp) + 1) * self.commit_unit
        ends = np.where(following < len(ramp), ramp[np.minimum(following, len(ramp) - 1)], regular)
        return np.minimum(ends, self.size).astype(np.uint64)

    def unit_at(self, offset: int) -> int:
        """Index of the unit containing byte ``offset``."""
        ramp = self.ramp
        if offset < ramp[-1]:
            return bisect.bisect_right(ramp, offset) - 1
        return len(ramp) - 1 + (offset - ramp[-1]) // self.commit_unit

    def units_at(self, offsets: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        """``unit_at()`` for an array of offsets (the copy planner's hot path)."""
        ramp = self._ramp
        end = ramp[-1]
        # Past the ramp the division counts regular units and searchsorted gives len(ramp);
        # inside it the division gives 0 and searchsorted finds the ramp unit.
        regular = (np.maximum(offsets, end) - end) // np.uint64(self.commit_unit)
        units: npt.NDArray[np.int64] = regular.astype(np.int64)
        units += np.searchsorted(ramp, offsets, side="right") - 1
        return units

    def units_for(self, nbytes: int) -> int:
        """How many leading units cover the first ``nbytes`` bytes."""
        return 0 if nbytes <= 0 else self.unit_at(min(nbytes, self.size) - 1) + 1
