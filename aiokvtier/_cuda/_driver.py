"""The CUDA driver boundary: lazy import, error conversion, contexts.

``cuda-bindings`` is imported on first use, so the package imports and the
host-only tier works where there is no GPU or driver; asking for a device
there raises ``CudaUnavailableError`` saying what is missing. Driver
errors are converted here, once, into ``CudaError`` with the CUresult
name.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .._errors import CudaError, CudaUnavailableError

__all__ = [
    "PrimaryContext",
    "check",
    "device_numa_node",
    "device_count",
    "driver",
]

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
    """A retained primary context of one device.

    A thread starts with no current context whatever its creator chose, so
    every thread the library starts binds one (``make_current()``) before
    touching the driver; a blocking step that may run on a thread the
    library does not own uses ``current()``, which restores what was there.
    """

    def __init__(self, device: int) -> None:
        drv = driver()
        check_device(device)
        self.device = device
        self._dev = check("cuDeviceGet", drv.cuDeviceGet(device))
        self.handle = check("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(self._dev))
        self._released = False

    def make_current(self) -> None:
        """Bind the context to the calling thread for good: only on threads the library owns."""
        check("cuCtxSetCurrent", driver().cuCtxSetCurrent(self.handle))

    @contextmanager
    def current(self) -> Iterator[None]:
        """The context, current on this thread for the block; the thread's previous one is restored."""
        drv = driver()
        check("cuCtxPushCurrent", drv.cuCtxPushCurrent(self.handle))
        try:
            yield
        finally:
            check("cuCtxPopCurrent", drv.cuCtxPopCurrent())

    def release(self) -> None:
        if not self._released:
            self._released = True
            check("cuDevicePrimaryCtxRelease", driver().cuDevicePrimaryCtxRelease(self._dev))
