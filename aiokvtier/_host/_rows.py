"""Copies between a caller's page array and a mapping's slots (a tier's, the pool's): numpy row copies, not a
memmove per page.

A store of 4,096 one-byte pages cost 3.2 ms as 4,096 ``ctypes.memmove`` calls (a Python step and a GIL
release each) and 0.03 ms as one ``slots[ids, :1] = pages``; at 64 KiB pages the assignment is no slower
(13 against 15 ms, development VM), and numpy releases the GIL while it copies, so the loop thread runs
while a worker copies (a block store books its blocks then). The slots are viewed as one
``(slots, slot_size)`` array over this process's mapping for the length of a copy only: a view kept past it
would outlive the unmap. Every copy runs on a worker thread (blocking).
"""

from __future__ import annotations

import ctypes

import numpy as np
import numpy.typing as npt

__all__ = ["SMALL_ROW", "memmove_all", "rows_from_slots", "rows_into_slots", "runs"]

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
U8 = npt.NDArray[np.uint8]

SMALL_ROW = 4096
"""Rows up to this many bytes are gathered through a temporary array (at most 16 MiB for 4,096 keys); longer
ones are copied where they lie (a whole array into slots), or a memmove per run of neighbours."""


def _slots(base: int, size: int, slot_size: int) -> U8:
    count = size // slot_size
    memory = memoryview((ctypes.c_ubyte * (count * slot_size)).from_address(base))
    return np.frombuffer(memory, dtype=np.uint8).reshape(count, slot_size)


def _plain(pages: U8) -> U8:
    """The array itself over the same memory: a subclass's own indexing or ``__array_function__`` would run
    on the worker and could take other bytes than its rows in memory (those a copy per page takes)."""
    if type(pages) is np.ndarray:
        return pages
    plain: U8 = np.ndarray.view(pages, np.ndarray)
    return plain


def rows_into_slots(base: int, size: int, slot_size: int, slots: I64, pages: U8, rows: I64 | None) -> None:
    """Copy ``pages[rows]`` (every row: None) into the first bytes of ``slots`` of the mapping at ``base``.

    :raises IndexError: a slot past the mapping (nothing is written past it).
    """
    tier, pages = _slots(base, size, slot_size), _plain(pages)
    width = pages.shape[1]
    tier[slots, :width] = pages if rows is None else pages[rows]


def rows_from_slots(base: int, size: int, slot_size: int, slots: I64, pages: U8, width: int) -> None:
    """Copy the first ``width`` bytes of ``slots`` into the first ``width`` bytes of every row of ``pages``.

    :raises IndexError: a slot past the mapping.
    """
    tier, pages = _slots(base, size, slot_size), _plain(pages)
    # Whole slots into whole rows: gathered straight into them. Shorter blocks are not: ``np.take`` first
    # copies a source that is not C-contiguous whole, here the first ``width`` bytes of every slot of the
    # mapping (a read past the committed range crashes, and every slot is read for a few).
    if width == slot_size == pages.shape[1] and pages.flags.c_contiguous:
        outside = slots[(slots < 0) | (slots >= len(tier))]
        if outside.size:  # "clip" would copy the last slot instead
            raise IndexError(f"slot {int(outside[0])} is outside the mapping's {len(tier)} slots")
        np.take(tier, slots, axis=0, out=pages, mode="clip")  # "raise" would buffer the output
    else:
        pages[:, :width] = tier[slots, :width]


def runs(dst: U64, src: U64, lengths: U64) -> list[tuple[int, int, int]]:
    """``(dst, src, n)`` copies with neighbours merged: a copy whose source and destination both start where
    the previous one's end is one longer copy (whole slots from a page array into consecutive slots)."""
    if dst.size < 2:
        return list(zip(dst.tolist(), src.tolist(), lengths.tolist(), strict=True))
    ends = dst[:-1] + lengths[:-1]
    joined = (dst[1:] == ends) & (src[1:] == src[:-1] + lengths[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    sizes = np.add.reduceat(lengths, starts)
    return list(zip(dst[starts].tolist(), src[starts].tolist(), sizes.tolist(), strict=True))


def memmove_all(copies: list[tuple[int, int, int]]) -> None:
    """``(dst, src, n)`` copies, a ``memmove`` each (ctypes releases the GIL for each), on a worker thread."""
    move = ctypes.memmove
    for dst, src, n in copies:
        move(dst, src, n)
