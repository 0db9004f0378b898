"""StaticHostMem: a staging buffer sized once and released once.

No fill thread, no watermark: one ``cuMemHostAlloc`` (portable) with a
device, or, when a NUMA node is asked for, one mmap + mbind + populate + a
single registration; with no device, populated host memory. It is a single
registration, so a copy may span it whole.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _regions
from .._errors import CopyPlanError
from .._host import _linux
from .._host._backing import HUGE_ALIGN, apply_numa_policy
from .._host._views import ViewLedger
from .._lifecycle import Lifecycle, Owner
from .._regions import I64, U64, InflightCopies

__all__ = ["StaticHostMem"]


class StaticHostMem(Owner):
    """A populated (and, with a device, registered) host buffer for staging and uploads.

    ``async with StaticHostMem(size, device=0) as buf:`` or
    ``buf = await StaticHostMem.open(size)``. ``size`` is rounded up to the page.
    Its blocking work runs on its own ``aiokvtier-staging`` thread. Cancelling
    ``open`` or ``aclose`` delivers the cancellation once the buffer is
    released (or, for ``aclose``, once the teardown is complete).
    """

    checks_hold_until_snapshot = True
    """A span found inside it stays inside until it closes (its size never changes, and its close
    marks it closed before it snapshots): the copy engine may keep an array's check over it."""

    def __init__(self, size: int, device: int | None = None, numa_node: int | None = None) -> None:
        if type(size) is not int or size <= 0:
            raise ValueError(f"size must be a positive int, got {size!r}")
        if device is not None and (type(device) is not int or device < 0):
            raise ValueError(f"device must be a CUDA ordinal or None, got {device!r}")
        if numa_node is not None and (type(numa_node) is not int or numa_node < 0):
            raise ValueError(f"numa_node must be a node id or None, got {numa_node!r}")
        self.size = -(-size // _linux.PAGE_SIZE) * _linux.PAGE_SIZE
        self.device = device
        self.numa_node = numa_node
        self.kind = "new"
        """``"hostalloc"``, ``"registered"`` or ``"host"`` once open."""
        self.numa_policy = "none"
        self.numa_warning: str | None = None
        self._address = 0
        self._context: Any = None
        self._views = ViewLedger(self.size, "StaticHostMem")
        self._copies = InflightCopies()
        self._released = False
        self._life = Lifecycle("StaticHostMem", "aiokvtier-staging")

    @classmethod
    async def open(cls, size: int, device: int | None = None, numa_node: int | None = None) -> StaticHostMem:
        """Allocate, populate (and register); blocking work runs off the loop.

        :raises CudaUnavailableError: a device was asked for without a usable driver.
        :raises NumaPolicyError: never (a denied mbind falls back to first touch, with a warning).
        :raises OSError: the memory cannot be had.
        :raises TierClosedError: ``aclose()`` was called while it opened.
        """
        buf = cls(size, device, numa_node)
        await buf.__aenter__()
        return buf

    async def _build(self) -> None:
        kind = await self._life.run(self._allocate)
        self._life.undo.callback(
            self._life.release_when_unviewed, self._views.defer_until_empty, lambda: self._release(kind)
        )
        self.kind = kind
        _regions.register(self)
        self._life.undo.callback(_regions.unregister, self)

    def _allocate(self) -> str:
        """Allocate on the worker; on failure nothing is left (no mapping, no context reference)."""
        if self.device is not None:
            from ._driver import PrimaryContext, check, driver

            self._context = context = PrimaryContext(self.device)
            try:
                with context.current():
                    if self.numa_node is None:
                        self._address = int(check("cuMemHostAlloc", driver().cuMemHostAlloc(self.size, 0x01)))
                        return "hostalloc"  # PORTABLE
                    self._map(register=True)
                    return "registered"
            except BaseException:
                context.release()
                self._context = None
                raise
        self._map(register=False)
        return "host"

    def _map(self, register: bool) -> None:
        base, length = _linux.mmap_reserve(self.size, HUGE_ALIGN)
        try:
            _linux.madvise(base, length, _linux.MADV_NOHUGEPAGE)
            self.numa_policy, self.numa_warning = apply_numa_policy(base, length, self.numa_node, strict=False)
            _linux.mprotect(base, length, writable=True)
            _linux.populate(base, length)
            if register:
                from ._driver import check, driver

                check("cuMemHostRegister", driver().cuMemHostRegister(base, length, 0x01))  # PORTABLE
        except BaseException:
            _linux.munmap(base, length)
            raise
        self._address = base

    @property
    def address(self) -> int:
        self._check_open()
        return self._address

    def view(self) -> memoryview:
        """A writable view of the whole buffer; it keeps the memory mapped until released."""
        self._check_open()
        return self._views.view(0, self._address)

    # -- a copy region --------------------------------------------------------

    @property
    def region_name(self) -> str:
        return f"StaticHostMem({self.size} bytes at {self._address:#x})"

    def region_bounds(self) -> tuple[int, int]:
        return self._address, self.size

    def registrations_of(self, offsets: U64, nbytes: U64) -> I64:
        if self._life.state != "open":
            raise CopyPlanError(f"{self.region_name} is {self._life.state}")
        over = np.flatnonzero(offsets + nbytes > np.uint64(self.size))
        if over.size:
            i = int(over[0])
            raise CopyPlanError(f"copy of {int(nbytes[i])} bytes at +{int(offsets[i])} leaves {self.region_name}")
        return np.zeros(len(offsets), dtype=np.int64)  # one registration: the whole buffer

    @property
    def copies(self) -> InflightCopies:
        return self._copies

    async def aclose(self) -> None:
        """Wait for copies in flight, then release. Idempotent.

        With views still exported, the memory is released (on the buffer's
        thread) when the last one is. Cancelling ``aclose`` does not
        interrupt the teardown.
        """
        await self._life.close(self._teardown)
        if self.kind != "new":
            self.kind = "closed"

    async def _teardown(self) -> None:
        await self._life.run(InflightCopies.wait, self._copies.snapshot())
        await self._life.run_undo()

    def _release(self, kind: str) -> None:
        try:
            if kind == "hostalloc" or kind == "registered":
                from ._driver import check, driver

                with self._context.current():
                    if kind == "hostalloc":
                        check("cuMemFreeHost", driver().cuMemFreeHost(self._address))
                    else:
                        check("cuMemHostUnregister", driver().cuMemHostUnregister(self._address))
            if kind != "hostalloc":
                _linux.munmap(self._address, self.size)
        finally:
            if self._context is not None:
                self._context.release()
            self._released = True

    @property
    def released(self) -> bool:
        return self._released

    def __repr__(self) -> str:
        state = self._life.state if self._life.state != "open" else self.kind
        return f"<StaticHostMem [{state} | {self.size} bytes | device {self.device}]>"
