"""The CUDA driver boundary: lazy import, error conversion, contexts, GPU backings.

``cuda-bindings`` is imported on first use, so the package imports and the
host-only tier works where there is no GPU or driver; asking for a device
there raises :class:`CudaUnavailableError` saying what is missing. Driver
errors are converted here, once, into :class:`CudaError` with the CUresult
name.
"""

from __future__ import annotations

import logging
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from . import _linux
from ._backing import Backing, HostBacking
from ._config import HostTierConfig
from ._errors import CudaError, CudaUnavailableError, NumaPolicyError

__all__ = [
    "PrimaryContext",
    "RegisterBacking",
    "VmmBacking",
    "check",
    "device_numa_node",
    "driver",
    "make_backing",
]

log = logging.getLogger("aiokvtier")

_driver: Any = None
_init_lock = threading.Lock()
CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTALLOC_PORTABLE = 0x01


def driver() -> Any:
    """``cuda.bindings.driver``, initialised.

    :raises CudaUnavailableError: cuda-bindings is not installed, or the driver cannot initialise.
    """
    global _driver
    if _driver is not None:
        return _driver
    with _init_lock:
        if _driver is not None:
            return _driver
        try:
            from cuda.bindings import driver as drv
        except ImportError as exc:
            raise CudaUnavailableError(
                "a CUDA device was requested but cuda-bindings is not installed: pip install 'aiokvtier[cuda]'"
            ) from exc
        try:
            (err,) = drv.cuInit(0)
        except Exception as exc:  # the bindings raise when libcuda itself is missing
            raise CudaUnavailableError(f"no usable NVIDIA driver on this machine: {exc}") from exc
        if err != drv.CUresult.CUDA_SUCCESS:
            raise CudaUnavailableError(f"cuInit failed: {err.name}: no usable CUDA device")
        _driver = drv
        return drv


def check(call: str, result: tuple[Any, ...]) -> Any:
    """Unpack a cuda-bindings result: raise on error, return the value(s) after it."""
    err = result[0]
    if int(err) != 0:
        raise CudaError(call, getattr(err, "name", str(err)), int(err))
    rest = result[1:]
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def device_count() -> int:
    return int(check("cuDeviceGetCount", driver().cuDeviceGetCount()))


def check_device(device: int) -> None:
    count = device_count()
    if not 0 <= device < count:
        raise CudaUnavailableError(f"CUDA device {device} does not exist ({count} device(s) visible)")


def device_numa_node(device: int) -> int | None:
    """The host NUMA node nearest ``device``, or None if it has none (-1).

    ``CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID`` where the driver reports it, else the
    PCI device's ``numa_node`` in sysfs.
    """
    drv = driver()
    check_device(device)
    err, value = drv.cuDeviceGetAttribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, device)
    if int(err) == 0 and int(value) >= 0:
        return int(value)
    bus = check("cuDeviceGetPCIBusId", drv.cuDeviceGetPCIBusId(64, device))
    bus_id = (bus.decode() if isinstance(bus, bytes) else str(bus)).rstrip("\x00").lower()
    try:
        node = int(Path(f"/sys/bus/pci/devices/{bus_id}/numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


class PrimaryContext:
    """A retained primary context of one device; :meth:`make_current` on any thread.

    A thread starts on device 0 whatever its creator chose, so every thread
    the library starts calls :meth:`make_current` before touching the driver.
    """

    def __init__(self, device: int) -> None:
        drv = driver()
        check_device(device)
        self.device = device
        self._dev = check("cuDeviceGet", drv.cuDeviceGet(device))
        self.handle = check("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(self._dev))
        self._released = False

    def make_current(self) -> None:
        check("cuCtxSetCurrent", driver().cuCtxSetCurrent(self.handle))

    def release(self) -> None:
        if not self._released:
            self._released = True
            check("cuDevicePrimaryCtxRelease", driver().cuDevicePrimaryCtxRelease(self._dev))


class RegisterBacking(HostBacking):
    """The host backing plus ``cuMemHostRegister`` of each unit once populated.

    Registering populated memory runs at 12-22 GiB/s; registering untouched
    memory makes the driver fault it (1.5-2.7 GiB/s), hence populate first.
    Never one registration for the whole range: drivers refuse 512 GB and
    more, and a large one stalls other CUDA calls for seconds.
    """

    name = "register"

    def __init__(self, size: int, *, device: int, node: int | None, strict_numa: bool, huge_pages: bool) -> None:
        self.context = PrimaryContext(device)
        try:
            super().__init__(size, node=node, strict_numa=strict_numa, huge_pages=huge_pages)
        except BaseException:
            self.context.release()
            raise
        self._lock = threading.Lock()

    def thread_setup(self) -> None:
        self.context.make_current()

    def commit(self, offset: int, length: int) -> None:
        super().commit(offset, length)
        try:
            check(
                "cuMemHostRegister",
                driver().cuMemHostRegister(self.base + offset, length, CU_MEMHOSTREGISTER_PORTABLE),
            )
        except BaseException:
            super().decommit(offset, length)
            raise
        with self._lock:
            self.registered_bytes += length

    def decommit(self, offset: int, length: int) -> None:
        self.context.make_current()
        check("cuMemHostUnregister", driver().cuMemHostUnregister(self.base + offset))
        with self._lock:
            self.registered_bytes -= length
        super().decommit(offset, length)

    def release(self, committed: list[tuple[int, int]]) -> None:
        try:
            self.context.make_current()
            for offset, length in committed:
                try:
                    check("cuMemHostUnregister", driver().cuMemHostUnregister(self.base + offset))
                    self.registered_bytes -= length
                except CudaError as exc:
                    log.error("aiokvtier: unregistering %d bytes at +%d failed: %s", length, offset, exc)
        finally:
            try:
                super().release(committed)
            finally:
                self.context.release()


class VmmBacking(Backing):
    """``cuMemAddressReserve`` once, then ``cuMemCreate`` (host NUMA) + map per unit.

    The driver allocates and zeroes the pages; the range is mapped for the
    device and for the CPU, so views work. Units must be multiples of the
    allocation granularity.
    """

    name = "vmm"

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
            self.context.make_current()
            self.size = size
            self.base = int(check("cuMemAddressReserve", drv.cuMemAddressReserve(size, granule, 0, 0)))
            undo.callback(lambda: check("cuMemAddressFree", drv.cuMemAddressFree(self.base, size)))
            self.numa_policy = "host-numa" if node is not None else "none"
            undo.pop_all()

    @staticmethod
    def prop(node: int | None) -> Any:
        drv = driver()
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        if node is None:
            prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
            prop.location.id = 0
        else:
            prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
            prop.location.id = node
        prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        return prop

    @classmethod
    def granularity(cls, node: int | None) -> int:
        drv = driver()
        flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(check("cuMemGetAllocationGranularity", drv.cuMemGetAllocationGranularity(cls.prop(node), flag)))

    def thread_setup(self) -> None:
        self.context.make_current()

    def _access(self) -> list[Any]:
        drv = driver()
        rw = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        gpu = drv.CUmemAccessDesc()
        gpu.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        gpu.location.id = self.device
        gpu.flags = rw
        cpu = drv.CUmemAccessDesc()
        cpu.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST
        cpu.location.id = 0
        cpu.flags = rw
        return [gpu, cpu]

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
            access = self._access()
            check("cuMemSetAccess", drv.cuMemSetAccess(addr, length, access, len(access)))
            undo.pop_all()
        with self._lock:
            self._handles[offset] = handle
            self.registered_bytes += length

    def decommit(self, offset: int, length: int) -> None:
        drv = driver()
        self.context.make_current()
        with self._lock:
            handle = self._handles.pop(offset)
            self.registered_bytes -= length
        check("cuMemUnmap", drv.cuMemUnmap(self.base + offset, length))
        check("cuMemRelease", drv.cuMemRelease(handle))

    def release(self, committed: list[tuple[int, int]]) -> None:
        drv = driver()
        try:
            self.context.make_current()
            for offset, length in committed:
                try:
                    self.decommit(offset, length)
                except CudaError as exc:
                    log.error("aiokvtier: unmapping %d bytes at +%d failed: %s", length, offset, exc)
            check("cuMemAddressFree", drv.cuMemAddressFree(self.base, self.size))
        finally:
            self.context.release()


def make_backing(config: HostTierConfig, node: int | None) -> Backing:
    """Build the register or vmm backing for ``config`` (blocking; off the loop)."""
    assert config.device is not None
    size = int(config.max_quota)  # type: ignore[arg-type]
    if config.resolved_backing == "register":
        return RegisterBacking(
            size,
            device=config.device,
            node=node,
            strict_numa=not config.allow_remote_numa_fallback,
            huge_pages=config.transparent_huge_pages,
        )
    PrimaryContext(config.device).release()  # validates the device before anything is reserved
    granule = VmmBacking.granularity(node)
    from ._errors import ConfigError
    from ._layout import FIRST_STEP

    unit = int(config.commit_unit)  # type: ignore[arg-type]
    first = max(int(config.slot_size), FIRST_STEP - FIRST_STEP % int(config.slot_size))
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
