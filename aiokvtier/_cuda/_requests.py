"""Checking a copy request before it is planned: pure functions, no event loop."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._plan import U64

__all__ = ["buffer_addresses", "stream_handle"]


def stream_handle(obj: Any) -> tuple[str, int]:
    """``("stream" | "event", handle)`` for an ``after=`` argument."""
    name = type(obj).__name__
    if name == "CUevent":
        return "event", int(obj)
    if name == "CUstream":
        return "stream", int(obj)
    if hasattr(obj, "__cuda_stream__"):
        return "stream", int(obj.__cuda_stream__()[1])
    if hasattr(obj, "cuda_stream"):
        return "stream", int(obj.cuda_stream)
    if hasattr(obj, "cuda_event"):
        return "event", int(obj.cuda_event)
    if isinstance(obj, int) and not isinstance(obj, bool):
        return "stream", obj
    raise TypeError(
        f"after= takes a CUDA stream or event (handle, CUstream/CUevent, or an object with "
        f"cuda_stream/__cuda_stream__), not {name}"
    )


def buffer_addresses(obj: Any, n: int, default_page: int) -> tuple[U64, int]:
    """Per-slot addresses of ``obj`` and the page size.

    ``obj`` is a buffer of one page per slot (anything with
    ``__cuda_array_interface__``, or a host array of two or more dimensions),
    or else one address per slot (a sequence or 1-D integer array).
    """
    iface = getattr(obj, "__cuda_array_interface__", None)
    if iface is None:
        host = getattr(obj, "__array_interface__", None)
        iface = host if host is not None and len(host["shape"]) >= 2 else None
    if iface is None:
        if isinstance(obj, int | np.integer):
            raise TypeError("give one address per slot, or an array with one page per slot")
        addrs = np.asarray(obj)
        if addrs.shape != (n,) or addrs.dtype.kind not in "iu":
            raise ValueError(f"expected {n} integer addresses, got shape {addrs.shape} of {addrs.dtype}")
        return addrs.astype(np.uint64), default_page
    shape = tuple(iface["shape"])
    itemsize = np.dtype(iface["typestr"]).itemsize
    strides = iface.get("strides")
    if strides is not None:
        expect, contiguous = itemsize, True
        for dim, stride in zip(reversed(shape), reversed(strides), strict=True):
            if dim > 1 and stride != expect:
                contiguous = False
            expect *= dim
        if not contiguous:
            raise ValueError("the buffer must be C-contiguous")
    if not shape or shape[0] != n:
        raise ValueError(f"the buffer's first dimension must be one page per slot ({n}), got shape {shape}")
    total = int(np.prod(shape, dtype=np.int64)) * itemsize
    page = total // n
    base = int(iface["data"][0])
    return np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(page), page
