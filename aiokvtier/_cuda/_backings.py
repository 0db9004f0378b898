"""GPU-usable backings: ``cuMemHostRegister`` per unit, or ``cuMemCreate`` per unit.

Both implement ``aiokvtier._host._backing.Backing``; which wins where is
measured, not assumed (docs/gpu.md, DESIGN section 3).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from .._config import ResolvedHostConfig
from .._errors import CudaError, NumaPolicyError
from .._host import _linux
from .._host._backing import Backing, HostBacking
from .._host._shared import SharedBacking
from ._driver import CU_MEMHOSTREGISTER_PORTABLE, PrimaryContext, check, driver

__all__ = ["RegisterBacking", "SharedRegisterBacking", "VmmBacking", "gpu_and_cpu_access", "make_backing", "paced"]

log = logging.getLogger("aiokvtier")

T = TypeVar("T")

# One registration at a time in the process, and a moment with the driver free
# after each, so a CUDA call that waited gets in before the next registration. The
# driver pins a unit under locks that other calls of the process wait for; with all
# fill threads registering at once a call waited behind a series of registrations
# (worst 42-61 ms at 16 GiB on the H200, against 13-22 ms this way, at the same fill
# rate; benchmarks/register_stalls.py). Touching the pages stays parallel.
_REGISTERING = threading.Lock()
_REGISTER_GAP_S = 0.0002


def paced(call: Callable[..., T], *args: Any) -> T:
    """``call(*args)``, a registration or unregistration, one at a time in the process, then the
    driver left free for a moment (``_REGISTER_GAP_S``); returns what the driver call returned."""
    with _REGISTERING:
        result = call(*args)
        if _REGISTER_GAP_S:
            time.sleep(_REGISTER_GAP_S)
    return result


if TYPE_CHECKING:
    _Below = HostBacking  # type-checked against one concrete backing below it
else:
    _Below = object


class _Registering(_Below):
    """``cuMemHostRegister`` of each unit once the backing below made it resident (a mixin: first base).

    Registering populated memory runs at 12-22 GiB/s; registering untouched
    memory makes the driver fault it (1.5-2.7 GiB/s), hence populate first.
    Never one registration for the whole range: drivers refuse 512 GB and
    more, and a large one stalls other CUDA calls for seconds.
    """

    def __init__(self, size: int, *, device: int, **below: Any) -> None:
        self.context = PrimaryContext(device)
        try:
            super().__init__(size, **below)
        except BaseException:
            self.context.release()
            raise
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}
        """Offset -> length of each unit registered now (what a release unregisters)."""

    def thread_setup(self) -> None:
        self.context.make_current()

    def commit(self, offset: int, length: int) -> None:
        super().commit(offset, length)
        try:
            self._host_register(offset, length)
        except BaseException:
            super().decommit(offset, length)
            raise

    def _host_register(self, offset: int, length: int) -> None:
        address = self.base + offset
        result = paced(driver().cuMemHostRegister, address, length, CU_MEMHOSTREGISTER_PORTABLE)
        check("cuMemHostRegister", result)
        with self._lock:
            self._registered[offset] = length
            self.registered_bytes += length

    def _host_unregister(self, offset: int) -> None:
        # Paced like registrations: a close that unregistered a 96 GiB tier's units back to back
        # kept other CUDA calls of the process out for 0.27 s (benchmarks/register_stalls.py).
        address = self.base + offset
        result = paced(driver().cuMemHostUnregister, address)
        check("cuMemHostUnregister", result)
        with self._lock:
            self.registered_bytes -= self._registered.pop(offset)

    def decommit(self, offset: int, length: int) -> None:
        if offset in self._registered:  # absent: a stranded unit whose earlier decommit got this far
            with self.context.current():
                self._host_unregister(offset)
        super().decommit(offset, length)

    def recommit(self, offset: int, length: int) -> None:
        super().recommit(offset, length)
        if offset not in self._registered:  # its failed decommit had unregistered it
            with self.context.current():
                self._host_register(offset, length)

    def release(self, committed: list[tuple[int, int]]) -> None:
        try:
            with self.context.current():
                for offset in list(self._registered):
                    try:
                        self._host_unregister(offset)
                    except CudaError as exc:
                        log.error("aiokvtier: unregistering the unit at +%d failed: %s", offset, exc)
        finally:
            try:
                super().release(committed)
            finally:
                self.context.release()


class RegisterBacking(_Registering, HostBacking):
    """The host backing plus ``cuMemHostRegister`` of each unit once populated."""

    name = "register"

    def __init__(
        self, size: int, *, device: int, node: int | None, strict_numa: bool, huge_pages: bool | Literal["auto"]
    ) -> None:
        super().__init__(size, device=device, node=node, strict_numa=strict_numa, huge_pages=huge_pages)


class SharedRegisterBacking(_Registering, SharedBacking):
    """A pool's shared memory (a memfd, ``aiokvtier._host._shared``) registered unit by unit in the owner.

    Attached processes map the same file and register their own mapping
    (``AttachedPool(device=)``); a registration belongs to one process.
    """

    name = "shared-register"

    def __init__(self, size: int, *, device: int, node: int | None, strict_numa: bool, huge_pages: bool) -> None:
        super().__init__(size, device=device, node=node, strict_numa=strict_numa, huge_pages=huge_pages)


def gpu_and_cpu_access(device: int) -> list[Any]:
    """``cuMemSetAccess`` descriptors: read and write for ``device`` and for the CPU."""
    drv = driver()
    rw = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    gpu = drv.CUmemAccessDesc()
    gpu.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    gpu.location.id = device
    gpu.flags = rw
    cpu = drv.CUmemAccessDesc()
    cpu.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
    cpu.location.id = 0
    cpu.flags = rw
    return [gpu, cpu]


class VmmBacking(Backing):
    """``cuMemAddressReserve`` once, then ``cuMemCreate`` (host NUMA) + map per unit.

    The driver allocates and zeroes the pages; the range is mapped for the
    device and for the CPU, so views work. Units must be multiples of the
    allocation granularity.
    """

    name = "vmm"
    fill_method = "driver"

    def __init__(self, size: int, *, device: int, node: int | None, allow_fallback: bool, granule: int) -> None:
        drv = driver()
        self.context = PrimaryContext(device)
        self.device = device
        self.node = node
        self._allow_fallback = allow_fallback
        self._handles: dict[int, Any] = {}
        self._lock = threading.Lock()
        with ExitStack() as undo:
            undo.callback(self.context.release)
            with self.context.current():
                self.size = size
                self.base = int(check("cuMemAddressReserve", drv.cuMemAddressReserve(size, granule, 0, 0)))
            self.numa_policy = "host-numa" if node is not None else "none"
            undo.pop_all()

    @staticmethod
    def prop(node: int | None, *, exportable: bool = False) -> Any:
        """Pinned host memory on ``node`` (None: any); ``exportable``: as a POSIX descriptor another
        process imports."""
        drv = driver()
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        if node is None:
            prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
            prop.location.id = 0
        else:
            prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
            prop.location.id = node
        handles = drv.CUmemAllocationHandleType
        prop.requestedHandleTypes = (
            handles.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if exportable else handles.CU_MEM_HANDLE_TYPE_NONE
        )
        return prop

    @classmethod
    def granularity(cls, node: int | None) -> int:
        drv = driver()
        flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(check("cuMemGetAllocationGranularity", drv.cuMemGetAllocationGranularity(cls.prop(node), flag)))

    def thread_setup(self) -> None:
        self.context.make_current()

    def _create(self, length: int) -> Any:
        drv = driver()
        err, handle = drv.cuMemCreate(length, self.prop(self.node), 0)
        if int(err) != 0 and self.node is not None:
            if not self._allow_fallback:
                raise NumaPolicyError(
                    f"cuMemCreate on host NUMA node {self.node} failed ({err.name}) and "
                    "allow_remote_numa_fallback is False"
                )
            log.warning("aiokvtier: cuMemCreate on NUMA node %s failed (%s); retrying without a node", self.node, err)
            self.numa_warning = f"cuMemCreate on node {self.node} failed ({err.name}); fell back to any host node"
            self.numa_policy = "host"
            self.node = None
            err, handle = drv.cuMemCreate(length, self.prop(None), 0)
        check("cuMemCreate", (err,))
        return handle

    def commit(self, offset: int, length: int) -> None:
        drv = driver()
        handle = self._create(length)
        addr = self.base + offset
        with ExitStack() as undo:
            undo.callback(lambda: drv.cuMemRelease(handle))
            check("cuMemMap", drv.cuMemMap(addr, length, 0, handle, 0))
            undo.callback(lambda: drv.cuMemUnmap(addr, length))
            access = gpu_and_cpu_access(self.device)
            check("cuMemSetAccess", drv.cuMemSetAccess(addr, length, access, len(access)))
            undo.pop_all()
        with self._lock:
            self._handles[offset] = handle
            self.registered_bytes += length

    def decommit(self, offset: int, length: int) -> None:
        drv = driver()
        with self.context.current():
            check("cuMemUnmap", drv.cuMemUnmap(self.base + offset, length))
            with self._lock:
                handle = self._handles.pop(offset)
                self.registered_bytes -= length
            check("cuMemRelease", drv.cuMemRelease(handle))

    def release(self, committed: list[tuple[int, int]]) -> None:
        drv = driver()
        try:
            with self.context.current():
                for offset, length in committed:
                    try:
                        self.decommit(offset, length)
                    except CudaError as exc:
                        log.error("aiokvtier: unmapping %d bytes at +%d failed: %s", length, offset, exc)
                check("cuMemAddressFree", drv.cuMemAddressFree(self.base, self.size))
        finally:
            self.context.release()


def make_backing(config: ResolvedHostConfig, node: int | None) -> Backing:
    """Build the register or vmm backing for ``config`` (blocking; off the loop)."""
    assert config.device is not None
    size = config.max_quota
    if config.backing == "register":
        return RegisterBacking(
            size,
            device=config.device,
            node=node,
            strict_numa=not config.allow_remote_numa_fallback,
            huge_pages=config.transparent_huge_pages,
        )
    PrimaryContext(config.device).release()  # validates the device before anything is reserved
    granule = VmmBacking.granularity(node)
    from .._errors import ConfigError
    from .._host._layout import FIRST_STEP

    unit = config.commit_unit
    first = max(config.slot_size, FIRST_STEP - FIRST_STEP % config.slot_size)
    if unit % granule or (first < unit and first % granule):
        raise ConfigError(
            f"backing='vmm' needs commit_unit ({unit}) and the first fill step ({first}) to be multiples "
            f"of the driver's allocation granularity ({granule})"
        )
    size = -(-size // granule) * granule
    return VmmBacking(
        size,
        device=config.device,
        node=node,
        allow_fallback=config.allow_remote_numa_fallback,
        granule=max(granule, _linux.PAGE_SIZE),
    )
