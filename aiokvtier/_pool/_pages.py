"""A caller's host pages (one per key) as addresses and lengths, for the copies of an attached process."""

from __future__ import annotations

import ctypes
import threading
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = ["Pages", "host_pages", "memmove_all"]

U64 = npt.NDArray[np.uint64]


class Pages(NamedTuple):
    addresses: U64
    lengths: U64
    owners: list[Any]
    """What keeps the memory alive while a copy reads or writes it."""


def host_pages(obj: Any, n: int, *, writable: bool) -> Pages:
    """Pages in host memory: a 2-D uint8 C-contiguous array (a row per key), or a sequence of bytes-like
    objects.

    :raises ValueError: the wrong number of pages, a non-contiguous page, a read-only destination.
    :raises TypeError: not pages.
    """
    if isinstance(obj, np.ndarray):
        if obj.ndim != 2 or obj.dtype != np.uint8:
            raise ValueError(f"a numpy page array must be 2-D uint8, got {obj.ndim}-D {obj.dtype}")
        if obj.shape[0] != n:
            raise ValueError(f"expected one page per key ({n}), got {obj.shape[0]} rows")
        if not obj.flags.c_contiguous:
            raise ValueError("the page array must be C-contiguous")
        if writable and not obj.flags.writeable:
            raise ValueError("the destination array is read-only; nothing was copied")
        page = obj.shape[1]
        addresses = np.uint64(obj.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(page)
        return Pages(addresses, np.full(n, page, dtype=np.uint64), [obj])
    if isinstance(obj, bytes | bytearray | memoryview | str):
        raise TypeError("pages are a sequence of bytes-like objects (one per key) or a 2-D uint8 array")
    try:
        items = list(obj)
    except TypeError:
        raise TypeError("pages are a sequence of bytes-like objects or a 2-D uint8 numpy array") from None
    if len(items) != n:
        raise ValueError(f"expected one page per key ({n}), got {len(items)}")
    arrays = []
    for item in items:
        try:
            view = memoryview(item)
        except TypeError:
            raise TypeError(f"a page must be bytes-like, not {type(item).__name__}") from None
        if not view.c_contiguous:
            raise ValueError("a page must be contiguous")
        if writable and view.readonly:
            raise ValueError(f"destination page of {type(item).__name__} is read-only; nothing was copied")
        arrays.append(np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, np.uint8))
    addresses = np.fromiter((a.ctypes.data if a.size else 0 for a in arrays), dtype=np.uint64, count=n)
    lengths = np.fromiter((a.size for a in arrays), dtype=np.uint64, count=n)
    return Pages(addresses, lengths, arrays)


def memmove_all(copies: list[tuple[int, int, int]], done: threading.Event | None = None) -> None:
    """``(dst, src, n)`` copies, on a worker thread (ctypes releases the GIL for each)."""
    move = ctypes.memmove
    try:
        for dst, src, n in copies:
            move(dst, src, n)
    finally:
        if done is not None:
            done.set()
