"""A pool's shared memory made GPU-usable in an attached process: ``cuMemHostRegister`` unit by unit.

Each process has its own CUDA context, so each registers the mapping it
made, on the attached pool's worker thread. It registers the owner's own
commit units (the same ``UnitLayout``, built from what the owner sent), each
once the owner's watermark has passed it whole, so no registration reaches
memory the owner has not made resident, and no copy planned inside one
unit spans two registrations.

A shrink hands units back: the owner punches them out of the file, and a
registration here would keep the old pages pinned, out of the file, for the
GPU to read and write while the CPU of every process sees new ones after a
regrow. So the owner's fill target (``bound``, pushed with its state) caps
what copies may touch at once, on the loop, and ``shrink()`` unregisters
the units past it before any later ``extend()`` registers the new pages.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .._cuda._backings import paced
from .._cuda._driver import PrimaryContext, check, driver
from .._host._layout import UnitLayout

__all__ = ["Registrations"]

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
CU_MEMHOSTREGISTER_PORTABLE = 0x01


class Registrations:
    """The registered leading units ``[base, base + end)`` of a mapping of ``size`` bytes.

    :raises CudaUnavailableError: no usable driver; :raises CudaError: the device is refused.
    """

    def __init__(self, device: int, base: int, size: int, slot_size: int, commit_unit: int) -> None:
        self.device = device
        self.base, self.size = base, size
        self.layout = UnitLayout.build(size, slot_size, commit_unit)
        self.count = 0
        """Units registered, from the first."""
        self.end = 0
        """Bytes registered from ``base`` (the end of unit ``count - 1``)."""
        self.bound = size
        """The owner's fill target as last pushed (set on the loop): nothing past it is copied, or
        registered again, until a later push raises it."""
        self.ceiling = size
        """Lowered for good to a unit that could not be unregistered (its pinned pages are not the
        file's any more): nothing at or past it is copied or registered again."""
        self._context = PrimaryContext(device)

    def reachable(self, end: int) -> int:
        """The end of the last unit that lies whole below ``end``, the bound and the ceiling."""
        layout = self.layout
        limit = min(end, self.bound, self.ceiling, layout.size)
        n = layout.units_for(limit)
        if n and layout.end(n - 1) > limit:
            n -= 1
        return layout.end(n - 1) if n else 0

    def extend(self, end: int) -> int:
        """Register the units that lie whole below ``end`` (the watermark) and the bound; returns the end."""
        layout = self.layout
        with self._context.current():
            while self.count < layout.count:
                start, stop = layout.start(self.count), layout.end(self.count)
                if stop > min(end, self.bound, self.ceiling):  # read per unit: a shrink may lower the bound
                    break
                # Paced as a tier's own registrations are: back to back, the units of a 48 GiB pool
                # held each of 8 attached processes' other CUDA calls for up to 0.8 s.
                registered = paced(
                    driver().cuMemHostRegister, self.base + start, stop - start, CU_MEMHOSTREGISTER_PORTABLE
                )
                check("cuMemHostRegister", registered)
                self.count += 1
                self.end = stop
        return self.end

    def shrink(self) -> int:
        """Unregister the units that reach past the bound (the owner handed them back); returns the end."""
        layout = self.layout
        with self._context.current():
            while self.count and layout.end(self.count - 1) > self.bound:
                start = layout.start(self.count - 1)
                try:
                    check("cuMemHostUnregister", paced(driver().cuMemHostUnregister, self.base + start))
                except BaseException:
                    self.ceiling = min(self.ceiling, start)
                    raise
                self.count -= 1
                self.end = start
        return self.end

    def units_of(self, offsets: U64, nbytes: U64) -> tuple[I64, int]:
        """Per span, its unit; and the index of the first span past what may be copied (registered,
        below the bound) or across two units (-1: none)."""
        layout = self.layout
        units = layout.units_at(offsets)
        ends = offsets + nbytes
        limit = np.uint64(min(self.end, self.reachable(self.size)))  # whole units below the bound
        bad = np.flatnonzero((ends > layout.ends_of(units)) | (ends > limit))
        return units, int(bad[0]) if bad.size else -1

    def release(self) -> None:
        """Unregister everything (before the mapping goes), then let the context go."""
        try:
            with self._context.current():
                layout = self.layout
                while self.count:
                    paced(driver().cuMemHostUnregister, self.base + layout.start(self.count - 1))
                    self.count -= 1
                self.end = 0
        finally:
            self._context.release()
