"""Copy planning: merge contiguous copies, never across a registration; cap per call.

Pure numpy, no driver: the same plan feeds ``cuMemcpyBatchAsync`` on a GPU
and ``memmove`` on a worker thread without one, so CI tests it for real.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from .. import _numpy  # noqa: F401  (numpy's lazy submodules imported now, not on a loop)
from .._errors import SlotError

__all__ = [
    "PIECES_FROM",
    "SMALL",
    "Pieces",
    "Plan",
    "chunk_slices",
    "plan",
    "plan_many",
    "plan_small",
    "refuse_repeats",
    "sorted_values",
]

U64 = npt.NDArray[np.uint64]
Registrations = npt.ArrayLike | Callable[[U64], npt.NDArray[np.int64]] | None
"""Per copy, the id of the registration holding one side: an array, or a
function from addresses to ids (asked only about copies that could merge)."""

SORT_KIND: Literal["quicksort", "stable"] = "quicksort"
"""How the planner argsorts what the radix passes do not take (per-copy sizes in the overlap
check): numpy's default (introsort, vectorised where the CPU allows); ties need no order there."""

RADIX_FROM = 2048
"""Leading addresses per 16-bit radix pass below which a stable argsort of the addresses is
cheaper (on this project's x86 VM: 1 pass beats the argsort from ~1k addresses, 2 passes
from ~4k, 4 from ~8k; at 32k one pass costs 0.18 ms where the argsort costs 1.4-1.8 ms)."""

SMALL = 32
"""Per-slot requests of at most this many pages are planned on Python ints (``plan_small()``):
one request of 16 pages is ~25 numpy calls of 1-4 us each on the numpy path, where the ints
take a few microseconds; past a few dozen pages the arrays win."""

_DST, _SRC = operator.itemgetter(0), operator.itemgetter(1)
"""A ``(dst, src, nbytes)`` row's sides."""

_WRAP = (1 << 64) - 1
"""uint64 arithmetic, as the numpy path does it (an address plus a page may wrap)."""

FIRST_CHUNK = 128
"""Descriptors in a plan's first driver call: the GPU starts after ~0.2 ms
of driver time instead of waiting 1-2 ms for a full batch (docs/benchmarks.md)."""


PIECES_FROM = 8192
"""Per-slot requests of at least this many pages are planned in pieces where they are issued
(``Pieces``), on a backend that copies while it is handed more (a GPU's): two pieces at least."""

FIRST_PIECE = 4096
"""Pages in a request's first piece: the GPU starts after its planning and issue. Smaller pieces
sort by ``argsort`` instead of radix passes (``RADIX_FROM``): 1,024-page pieces made planning a
request cost twice what it costs whole (development VM), 4,096-page ones 1.1-1.2x."""

PIECE = 8192
"""Pages in a later piece: pieces grow by half from ``FIRST_PIECE`` up to this. On an H100's host
a page of 4 KiB takes about half as long to plan and issue as the kernel takes to copy it, so a
piece twice the last would leave the GPU idle between pieces; one half as large again does not."""


@dataclass(frozen=True, slots=True)
class Plan:
    dsts: U64
    srcs: U64
    sizes: U64
    requested: int
    """Copies asked for, before merging."""
    jobs: int = 1
    """Copy calls whose copies this plan holds: more than one where the engine issues jobs
    queued together as one plan (``CopyBackend.coalesce``)."""
    rows: tuple[tuple[int, int, int], ...] | None = None
    """The same copies as ``(dst, src, nbytes)`` ints, where the planner made them so
    (``plan_small()``): a host-to-host copy runs them as they are (16 copies of 64 KiB read back
    from the arrays took a fifth longer, on the thread that copies, than from these)."""
    total: int = -1
    """Bytes, where the planner knows them without a sum (``plan_small()``); -1: ``nbytes`` sums."""
    whole: tuple[int, int] | None = None
    """A piece's request (``Pieces``), as ``(copies, bytes)``: a backend chooses the path of the
    request, not of each piece. None: the plan is the whole request."""

    @classmethod
    def of_rows(cls, rows: tuple[tuple[int, int, int], ...], requested: int, total: int) -> Plan:
        """A plan of ``rows`` alone (``plan_small()``): its arrays are made from them when first read,
        which a host-to-host copy never does, and a GPU's does on the submit thread, off the loop."""
        planned = object.__new__(cls)
        for name, value in (("rows", rows), ("requested", requested), ("total", total), ("jobs", 1), ("whole", None)):
            object.__setattr__(planned, name, value)
        return planned

    if not TYPE_CHECKING:  # hidden from the type checker, which would take any attribute for an array

        def __getattr__(self, name: str) -> U64:
            # Reached only for an array a plan of rows has not made yet (a slot never set): all three at
            # once. Two threads may both make them: the same arrays, the last kept.
            if name not in ("dsts", "srcs", "sizes") or self.rows is None:
                raise AttributeError(name)
            table = np.array(self.rows, dtype=np.uint64).reshape(-1, 3).T.copy()
            for field, column in zip(("dsts", "srcs", "sizes"), table, strict=True):
                object.__setattr__(self, field, column)
            column = getattr(self, name)
            assert isinstance(column, np.ndarray)
            return column

    @property
    def count(self) -> int:
        rows = self.rows
        return len(rows) if rows is not None else int(self.dsts.shape[0])

    @property
    def nbytes(self) -> int:
        return self.total if self.total >= 0 else int(self.sizes.sum())

    def chunks(self, cap: int, first: int = FIRST_CHUNK) -> list[slice]:
        """This plan's driver calls: see ``chunk_slices()``."""
        return chunk_slices(self.count, cap, first)


@dataclass(frozen=True, slots=True)
class Pieces:
    """A large per-slot request whose copies were checked where it was made, planned piece by piece
    where it is issued: each piece sorted and merged as ``plan()`` does a whole request (left in
    the request's order where nothing can merge: ``keep_order``), and issued before the next is
    planned, so the GPU copies one piece while the next is planned.

    Planned whole on the loop, a 128 MiB request of 4 KiB pages spent 1.3 ms planning and 0.8 ms
    being issued before its 2.6 ms copy began (docs/benchmarks.md). Runs contiguous across two
    pieces are not merged, and the host side's address order holds within a piece: pieces are cut
    in the request's order. Repeated slots were refused whole (``refuse_repeats()``).
    """

    dsts: U64
    srcs: U64
    page: int
    order_by: str
    dst_reg: Registrations = None
    src_reg: Registrations = None
    first: int = FIRST_PIECE
    size: int = PIECE

    @property
    def requested(self) -> int:
        return int(self.dsts.shape[0])

    @property
    def count(self) -> int:
        """Copies before merging: at most this many descriptors."""
        return self.requested

    @property
    def nbytes(self) -> int:
        return self.requested * self.page

    @property
    def sizes(self) -> int:
        """One page per copy (the checks broadcast it)."""
        return self.page

    def parts(self) -> list[slice]:
        """The pieces: ``first`` pages, then each half as large again as the last, up to ``size``."""
        return chunk_slices(self.requested, self.size, self.first, by_half=True)

    def plans(self) -> Iterator[Plan]:
        """The pieces' plans, in order, each planned when asked for. The first counts the request
        as a job (``Plan.jobs``), the others as none, so a request is one job in the figures;
        each carries the request's size (``Plan.whole``)."""
        whole = (self.requested, self.nbytes)
        for i, part in enumerate(self.parts()):
            planned = plan(
                self.dsts[part],
                self.srcs[part],
                self.page,
                dst_reg=self.dst_reg,
                src_reg=self.src_reg,
                n=part.stop - part.start,
                order_by=self.order_by,
                keep_order=True,  # pieces go to the SM kernel, which reads pages in any order
            )
            yield replace(planned, jobs=1 if i == 0 else 0, whole=whole)


def refuse_repeats(values: U64, step: int) -> None:
    """Refuse an address that appears twice among ``values``, each a multiple of ``step`` from the
    lowest (a tier's slots: ``step`` is the slot size), without sorting them where their span is
    small enough for a mark per step.

    :raises SlotError: an address repeats.
    """
    n = int(values.shape[0])
    if n < 2:
        return
    lo = int(values.min())
    span = (int(values.max()) - lo) // step + 1
    if span <= max(16 * n, 1 << 20):
        seen = np.zeros(span, dtype=np.bool_)
        seen[(values - np.uint64(lo)) // np.uint64(step)] = True
        repeated = int(np.count_nonzero(seen)) != n
    else:
        ordered = sorted_values(values)
        repeated = bool((ordered[1:] == ordered[:-1]).any())
    if repeated:
        raise SlotError("a slot appears twice as a copy destination")


def chunk_slices(count: int, cap: int, first: int = FIRST_CHUNK, *, by_half: bool = False) -> list[slice]:
    """Slices of at most ``cap`` of ``count`` descriptors, one driver call each;
    the first ``first`` long, doubling up to ``cap`` (growing by half with ``by_half``:
    ``Pieces``), so the copy starts early."""
    out, start, size = [], 0, max(1, min(first, cap))
    while start < count:
        out.append(slice(start, min(start + size, count)))
        start, size = out[-1].stop, min(size + (size // 2 if by_half else size), cap)
    return out


def _as_u64(values: object, n: int, what: str) -> U64:
    if type(values) is np.ndarray and values.dtype == np.uint64 and values.shape == (n,):
        return values  # what the request checks hand over: nothing to convert or check
    array = np.asarray(values)
    if array.ndim == 0:
        array = np.full(n, int(array), dtype=np.uint64)
    if array.shape != (n,):
        raise ValueError(f"{what}: expected {n} values, got shape {array.shape}")
    if array.dtype.kind not in "iu":
        raise TypeError(f"{what}: integer addresses and sizes expected, got {array.dtype}")
    if array.dtype.kind == "i" and n and int(array.min()) < 0:
        raise ValueError(f"{what}: negative value")
    return array.astype(np.uint64, copy=False)


def plan(
    dsts: object,
    srcs: object,
    sizes: object,
    *,
    dst_reg: Registrations = None,
    src_reg: Registrations = None,
    n: int | None = None,
    order_by: str = "src",
    distinct_order_side: bool = False,
    keep_order: bool = False,
) -> Plan:
    """Sort copies by one side, merge runs contiguous on both sides within one registration.

    :param keep_order: where no two copies can merge (pages of one size that no two leading
        addresses lie a page apart from: the lowest set bit of their offsets does not divide it),
        leave the copies in the order given: for a backend to which the order is no matter (the
        SM kernel), the sort would be the plan's whole cost.

    :param order_by: ``"src"`` or ``"dst"``: the side whose address order the
        batch follows. The host side is the right one: the DMA engines move
        scattered 64 KiB pages into host memory measurably slower than they
        read them from scattered device addresses.
    :param distinct_order_side: refuse two copies to or from one address on the
        ``order_by`` side (two writes to one slot), checked on the sorted
        addresses at no extra sort.
    :param dst_reg: per copy, the registration holding the destination
        (copies merge only within one); None: no constraint.
    :param src_reg: the same for the source.
    :raises SlotError: with ``distinct_order_side``, an address repeats.
    """
    count = n if n is not None else len(np.asarray(dsts))
    d = _as_u64(dsts, count, "destinations")
    s = _as_u64(srcs, count, "sources")
    page = _uniform(sizes)
    z = _as_u64(sizes, count, "sizes")
    if count == 0:
        return Plan(d, s, z, 0)
    if page == 0 if page is not None else int(z.min()) == 0:
        raise ValueError("a copy of zero bytes")
    if order_by not in ("src", "dst"):
        raise ValueError(f"order_by must be 'src' or 'dst', not {order_by!r}")
    lead = s if order_by == "src" else d
    order: npt.NDArray[np.intp] | None = None
    if keep_order and page is not None and not distinct_order_side and count > 1:
        _, grain = _offsets_and_grain(lead)
        if grain and page % grain:
            return Plan(d, s, z, count)
    if not (lead[1:] > lead[:-1]).all():  # fresh slots usually ascend already: no sort, no gathers
        order, lead, grain = _sorted_order(lead)
        if order_by == "src":
            s, d = lead, d[order]
        else:
            d, s = lead, s[order]
        if page is None:
            z = z[order]
        if distinct_order_side and (lead[1:] == lead[:-1]).any():
            raise SlotError("a slot appears twice as a copy destination")
        if page is not None and (grain == 0 or page % grain):
            # Neighbours on the leading side lie a multiple of the grain apart, never one page
            # (pages shorter than a tier's slots): no run to merge, so no search for one.
            return Plan(d, s, z, count)
    step = np.uint64(page) if page is not None else z[:-1]
    joins = (s[1:] == s[:-1] + step) & (d[1:] == d[:-1] + step)
    pairs = np.flatnonzero(joins)
    for reg, side in ((dst_reg, d), (src_reg, s)):
        if reg is None or pairs.size == 0:
            continue
        if callable(reg) and 2 * pairs.size < count:  # few candidates: ask about those alone
            joins[pairs] &= _one_registration(reg, side, pairs)
            continue
        r = reg(side) if callable(reg) else np.asarray(reg)
        r = r if order is None or callable(reg) else r[order]
        joins[pairs] &= r[pairs] == r[pairs + 1]
    if not joins.any():
        return Plan(d, s, z, count)
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    if page is not None:  # runs of equal pages: a run's length is the distance to the next start
        merged = np.diff(np.append(starts, count)).astype(np.uint64) * np.uint64(page)
    else:
        merged = np.add.reduceat(z, starts).astype(np.uint64)
    return Plan(d[starts], s[starts], merged, count)


def plan_many(
    dsts: U64,
    srcs: U64,
    page: int,
    counts: list[int],
    *,
    dst_reg: Callable[[U64], npt.NDArray[np.int64]] | None = None,
    src_reg: Callable[[U64], npt.NDArray[np.int64]] | None = None,
    order_by: str = "src",
    distinct_order_side: bool = False,
) -> list[Plan]:
    """``plan()`` of several requests at once: one plan per request, copy for copy the plan that
    ``plan()`` makes of it alone, for the numpy calls of one.

    ``dsts`` and ``srcs`` hold the requests' copies one request after another, ``counts[i]``
    of request ``i`` (each at least one), every copy ``page`` bytes. Copies of two requests
    never merge.

    :raises SlotError: with ``distinct_order_side``, an address repeats on the ``order_by`` side
        within a request (which one is not said: plan that request alone to name it).
    """
    if order_by not in ("src", "dst"):
        raise ValueError(f"order_by must be 'src' or 'dst', not {order_by!r}")
    n = len(dsts)
    request = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    order = np.lexsort((srcs if order_by == "src" else dsts, request))  # by request, then address: stable
    d, s = dsts[order], srcs[order]
    same = request[1:] == request[:-1]  # the order keeps each request's copies together, in request order
    if distinct_order_side:
        lead = s if order_by == "src" else d
        if (same & (lead[1:] == lead[:-1])).any():
            raise SlotError("a slot appears twice as a copy destination")
    step = np.uint64(page)
    joins = same & (s[1:] == s[:-1] + step) & (d[1:] == d[:-1] + step)
    pairs = np.flatnonzero(joins)
    for reg, side in ((dst_reg, d), (src_reg, s)):
        if reg is None or pairs.size == 0:
            continue
        joins[pairs] &= _one_registration(reg, side, pairs)
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    if starts.size == n:  # nothing merged (shuffled slots): the request's copies as they are
        sizes = np.full(n, page, dtype=np.uint64)
        bounds = list(itertools.accumulate(counts))
    else:
        sizes = np.diff(np.append(starts, n)).astype(np.uint64) * step
        d, s = d[starts], s[starts]
        # Each request's first copy starts a run (no join crosses requests): its position among the
        # starts is where its plan begins.
        bounds = [*np.searchsorted(starts, list(itertools.accumulate(counts[:-1]))).tolist(), len(starts)]
    plans, lo = [], 0
    for count, hi in zip(counts, bounds, strict=True):
        plans.append(Plan(d[lo:hi], s[lo:hi], sizes[lo:hi], count))
        lo = hi
    return plans


def _one_registration(
    reg: Callable[[U64], npt.NDArray[np.int64]], side: U64, pairs: npt.NDArray[np.intp]
) -> npt.NDArray[np.bool_]:
    """Per candidate pair ``(pairs[i], pairs[i] + 1)`` of ``side``, whether both lie in one registration
    (``reg`` is asked about the candidates alone)."""
    ids = reg(np.concatenate((side[pairs], side[pairs + 1])))
    same: npt.NDArray[np.bool_] = ids[: pairs.size] == ids[pairs.size :]
    return same


def _uniform(sizes: object) -> int | None:
    """The one size of every copy, where ``sizes`` is a single integer (a page); else None."""
    if isinstance(sizes, int | np.integer) and not isinstance(sizes, bool):
        return int(sizes)
    return None


def _sorted_order(lead: U64) -> tuple[npt.NDArray[np.intp], U64, int]:
    """The stable permutation that sorts ``lead``, ``lead`` sorted, and a ``grain``: every gap
    between sorted neighbours is a multiple of it (0: every address is the same).

    By radix passes where ``_radix_order()`` takes the addresses, else by a stable argsort
    of the addresses themselves, with a grain of 1 (not looked for).
    """
    radix = _radix_order(lead)
    if radix is not None:
        order, grain = radix
    else:
        order, grain = np.argsort(lead, kind="stable"), 1
    return order, lead[order], grain


def sorted_values(values: U64) -> U64:
    """``values`` sorted: by radix passes where ``_radix_order()`` takes them, else numpy's sort
    (a value sort, cheaper than an argsort and its gather)."""
    radix = _radix_order(values)
    return np.sort(values, kind=SORT_KIND) if radix is None else values[radix[0]]


def _offsets_and_grain(lead: U64) -> tuple[U64, int]:
    """Each address's offset from the lowest, and the largest power of two dividing every offset
    (0: every address is the same): neighbours in address order lie a multiple of it apart."""
    offsets = lead - np.uint64(int(lead.min()))
    common = int(np.bitwise_or.reduce(offsets))
    return offsets, common & -common


def _radix_order(lead: U64) -> tuple[npt.NDArray[np.intp], int] | None:
    """The stable permutation that sorts ``lead`` and its grain (see ``_sorted_order()``), where
    radix passes are cheaper than numpy's sorts (``RADIX_FROM``); else None.

    A request's addresses are few steps of a common alignment apart (a tier's slots, a buffer's
    pages): offsets from the lowest, divided by the largest power of two dividing them all,
    are ranks of a few bits. Those are sorted by stable argsorts of 16 bits at a time, least
    significant first, each a radix sort in numpy, where a sort of 64-bit values costs ~30 ns
    an address. Ties come out in position order, as from any stable sort.
    """
    n = int(lead.shape[0])
    if n < RADIX_FROM:
        return None
    offsets, grain = _offsets_and_grain(lead)
    if grain > 1:
        offsets >>= np.uint64(grain.bit_length() - 1)
    width = int(offsets.max()).bit_length()
    if -(-width // 16) * RADIX_FROM > n:
        return None
    order = np.arange(n, dtype=np.intp)  # no passes: every address is the same
    for shift in range(0, width, 16):
        digits = (offsets >> np.uint64(shift) if shift else offsets).astype(np.uint16)  # the low 16 bits
        step = np.argsort(digits if shift == 0 else digits[order], kind="stable")
        order = step if shift == 0 else order[step]
    return order, grain


def plan_small(
    dsts: list[int],
    srcs: list[int],
    page: int,
    *,
    dst_reg: Callable[[U64], npt.NDArray[np.int64]] | None = None,
    src_reg: Callable[[U64], npt.NDArray[np.int64]] | None = None,
    order_by: str = "src",
    distinct_order_side: bool = False,
) -> Plan:
    """``plan()`` of copies of one ``page`` each, on Python ints: the same plan, copy for copy.

    For the few pages of a usual request (``SMALL``); addresses are
    ints below 2**64, ``page`` positive. The registrations are asked only
    where some copies could merge (with shuffled slots, usually none).
    Each pass is one call into C (``sorted``, ``map``, ``zip``), and the
    plan's arrays are made only if read (``Plan.of_rows``): a Python step
    per page cost a 16-page request ~20 us on the loop, whose caches a
    1 MiB copy had just emptied.

    :raises SlotError: with ``distinct_order_side``, an address repeats on the ``order_by`` side.
    """
    n = len(dsts)
    if order_by not in ("src", "dst"):
        raise ValueError(f"order_by must be 'src' or 'dst', not {order_by!r}")
    if distinct_order_side and len(set(srcs if order_by == "src" else dsts)) != n:
        raise SlotError("a slot appears twice as a copy destination")
    # Sorted by the leading side, stable: ties in position order, as the argsort gives.
    rows = sorted(zip(dsts, srcs, [page] * n, strict=True), key=_SRC if order_by == "src" else _DST)
    d, s = list(map(_DST, rows)), list(map(_SRC, rows))
    total = (n * page) & _WRAP
    # A copy joins the next where both sides go on by one page (as uint64: across 2**64 too); with
    # shuffled slots usually none does, which passes in C find.
    step = {page, page - (1 << 64)}.__contains__
    s_steps, d_steps = map(step, map(operator.sub, s[1:], s[:-1])), map(step, map(operator.sub, d[1:], d[:-1]))
    joins = list(map(operator.and_, s_steps, d_steps))  # joins[i]: copy i + 1 goes on from copy i
    if not any(joins):
        return Plan.of_rows(tuple(rows), n, total)
    # Never across a registration: each side's registry asked once, about its few addresses (a run of
    # contiguous addresses lies in one registration where its two ends do).
    for reg, side in ((dst_reg, d), (src_reg, s)):
        if reg is not None:
            ids = reg(np.array(side, dtype=np.uint64)).tolist()
            joins = list(map(operator.and_, joins, map(operator.eq, ids[1:], ids[:-1])))
    if not any(joins):
        return Plan.of_rows(tuple(rows), n, total)
    starts = [0, *itertools.compress(range(1, n), map(operator.not_, joins))]
    sizes = map(_WRAP.__and__, map(page.__mul__, map(operator.sub, [*starts[1:], n], starts)))
    merged = zip(map(d.__getitem__, starts), map(s.__getitem__, starts), sizes, strict=True)
    return Plan.of_rows(tuple(merged), n, total)
