"""One ``cuMemcpyBatchAsync`` call through ctypes, with the ABI chosen deliberately.

cuda-bindings builds one Python object per address; calling the driver's
function directly with plain uint64 arrays costs 0.02 us per copy instead of
~0.7 us. The CUDA 13 ABI (``cuMemcpyBatchAsync_v2``) and the 12.8 one differ by
a ``failIdx`` argument: calling one with the other's arguments corrupts
memory, so the symbol is resolved through ``cuGetProcAddress`` for the
version this code is written for.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from .._copy._plan import U64
from .._errors import CopyPlanError, CudaError
from ._driver import check, driver

__all__ = ["DEFAULT_MAX_BATCH", "BatchCall", "resolve_batch_function"]

DEFAULT_MAX_BATCH = 1024
"""Descriptors per driver call (a peer hung near 52 k). Calls of 1024 moved
shuffled 64 KiB pages faster than calls of 4096-32768 on the H200
(``python benchmarks/copy_submission.py``)."""


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_SRC_ACCESS_ORDER_STREAM = 1
_LOC_DEVICE, _LOC_HOST = 1, 2
_P = ctypes.c_void_p
# CUDA 13 ABI (cuMemcpyBatchAsync_v2): no failIdx. CUDA 12.8/12.9: a size_t* failIdx before the stream.
_BATCH_V13 = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, ctypes.c_size_t, _P, _P, ctypes.c_size_t, _P)
_BATCH_V128 = ctypes.CFUNCTYPE(ctypes.c_int, _P, _P, _P, ctypes.c_size_t, _P, _P, ctypes.c_size_t, _P, _P)


def resolve_batch_function(drv: Any) -> tuple[Any, int]:
    """The driver's cuMemcpyBatchAsync with the ABI we code for, chosen by driver version."""
    version = int(check("cuDriverGetVersion", drv.cuDriverGetVersion()))
    if version >= 13000:
        want, proto = 13000, _BATCH_V13
    elif version >= 12080:
        want, proto = 12080, _BATCH_V128
    else:
        raise CopyPlanError(f"cuMemcpyBatchAsync needs a CUDA 12.8+ driver; this one is {version}")
    flags = drv.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    pfn, status = check("cuGetProcAddress", drv.cuGetProcAddress(b"cuMemcpyBatchAsync", want, flags))
    if int(status) != 0 or not pfn:
        raise CopyPlanError(f"the driver has no cuMemcpyBatchAsync for CUDA {want} (status {status})")
    return proto(int(pfn)), want


class BatchCall:
    """One ``cuMemcpyBatchAsync`` call per invocation: plain uint64 arrays, one
    attribute set for the whole batch (stream order, location hints)."""

    def __init__(self, function: Any, abi: int | None, direction: str, device: int) -> None:
        self._function, self._abi = function, abi
        src_dev, dst_dev = {"h2d": (False, True), "d2h": (True, False)}.get(direction, (True, True))
        self._attrs = _MemcpyAttributes()
        self._attrs.srcAccessOrder = _SRC_ACCESS_ORDER_STREAM
        self._attrs.srcLocHint = _MemLocation(_LOC_DEVICE if src_dev else _LOC_HOST, device if src_dev else 0)
        self._attrs.dstLocHint = _MemLocation(_LOC_DEVICE if dst_dev else _LOC_HOST, device if dst_dev else 0)
        self._zero = (ctypes.c_size_t * 1)(0)
        self._fail = ctypes.c_size_t(0)

    def __call__(self, dsts: U64, srcs: U64, sizes: U64, stream: Any) -> None:
        d, s, z = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
        args = [d.ctypes.data, s.ctypes.data, z.ctypes.data, len(d)]
        args += [ctypes.addressof(self._attrs), ctypes.addressof(self._zero), 1]
        if self._abi == 13000:
            rc = self._function(*args, int(stream))
        else:
            rc = self._function(*args, ctypes.addressof(self._fail), int(stream))
        if rc != 0:
            where = f" (descriptor {self._fail.value})" if self._abi != 13000 else ""
            raise CudaError("cuMemcpyBatchAsync" + where, driver().CUresult(rc).name, rc)
