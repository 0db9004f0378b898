"""A pool's shared memory made GPU-usable in an attached process: ``cuMemHostRegister`` unit by unit.

Each process has its own CUDA context, so each registers the mapping it
made, commit unit by commit unit as the owner's watermark passes them (the
way the register backing does in the owner), on the attached pool's worker
thread. No registration spans two units, so no copy planned inside one unit
spans two registrations.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .._cuda._driver import PrimaryContext, check, driver

__all__ = ["Registrations"]

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
CU_MEMHOSTREGISTER_PORTABLE = 0x01


class Registrations:
    """The registered prefix ``[base, base + end)`` of a mapping of ``size`` bytes, in units of ``unit``.

    :raises CudaUnavailableError: no usable driver; :raises CudaError: the device is refused.
    """

    def __init__(self, device: int, base: int, size: int, unit: int) -> None:
        self.device = device
        self.base, self.size, self.unit = base, size, unit
        self.end = 0
        """Bytes registered from ``base`` (a whole number of units, or the size)."""
        self._context = PrimaryContext(device)

    def extend(self, end: int) -> int:
        """Register the units up to ``end`` (the watermark) that are not yet; returns the registered end."""
        end = min(end, self.size)
        with self._context.current():
            while self.end < end:
                length = min(self.unit, self.size - self.end)
                check(
                    "cuMemHostRegister",
                    driver().cuMemHostRegister(self.base + self.end, length, CU_MEMHOSTREGISTER_PORTABLE),
                )
                self.end += length
        return self.end

    def units_of(self, offsets: U64, nbytes: U64) -> tuple[I64, int]:
        """Per span, its unit; and the index of the first span past the registered end or across two
        units (-1: none)."""
        unit = np.uint64(self.unit)
        first = offsets // unit
        last = (offsets + nbytes - np.uint64(1)) // unit
        bad = np.flatnonzero((first != last) | (offsets + nbytes > np.uint64(self.end)))
        return first.astype(np.int64), int(bad[0]) if bad.size else -1

    def release(self) -> None:
        """Unregister everything (before the mapping goes), then let the context go."""
        try:
            with self._context.current():
                for offset in reversed(range(0, self.end, self.unit)):
                    driver().cuMemHostUnregister(self.base + offset)
                self.end = 0
        finally:
            self._context.release()
