"""Checking a copy request before it is planned: pure functions, no event loop.

Everything a caller hands the CopyEngine passes through here first: the raw
``(dst, src, nbytes)`` table, the per-slot buffer or addresses, the ``after=``
stream. Bad input raises before anything is submitted or counted, so a
refused request changes nothing.

What is refused, and why:

- non-integers (``bool``, ``float``): numpy would truncate ``1.5e9`` or take
  ``True`` as address 1 without a word (DESIGN section 7: exactly what
  ``operator.index`` takes);
- empty requests and zero-byte copies (DESIGN section 7);
- a read-only destination buffer (``np.frombuffer(some_bytes)``): the copy
  would overwrite an immutable object;
- destinations that overlap: the DMA engines (and the batch) run copies in
  no promised order, so the bytes that land are undefined;
- on a host-to-host engine, a raw address outside every open tier and
  StaticHostMem: ``memmove`` from a garbage address, or from a tier closed
  meanwhile, kills the process instead of raising.
"""

from __future__ import annotations

import itertools
import math
import weakref
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .. import _regions
from .._errors import CopyPlanError
from .._host._slots import positive_count
from . import _plan
from ._plan import U64, Pieces, Plan, plan, plan_many, plan_small, refuse_repeats

if TYPE_CHECKING:
    from .._host._tier import HostTier

__all__ = [
    "InPieces",
    "Pages",
    "buffer_addresses",
    "check_again",
    "check_disjoint",
    "checked",
    "copy_table",
    "integers",
    "located",
    "located_again",
    "owners_of",
    "refuse_closed",
    "plan_side",
    "plan_slots",
    "plan_slots_many",
    "registrations",
    "relocate",
    "stream_handle",
]

I64 = npt.NDArray[np.int64]


def stream_handle(obj: Any) -> tuple[str, int]:
    """``("stream" | "event", handle)`` for an ``after=`` argument.

    :raises TypeError: ``obj`` is neither a stream nor an event.
    """
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


def integers(values: Iterable[Any], what: str) -> I64:
    """``values`` as a flat int64 array, taking exactly what ``operator.index`` takes, bools refused.

    :raises TypeError: a value is a bool, a float or anything else that is not an integer;
        the message names it.
    :raises ValueError: a value does not fit 64 bits.
    """
    if isinstance(values, np.ndarray):
        if values.dtype == np.int64:
            return values.reshape(-1)
        if values.dtype.kind == "i":
            return values.astype(np.int64, copy=False).reshape(-1)
        if values.dtype.kind == "u":
            if values.size and int(values.max()) >= 1 << 63:
                raise ValueError(f"{what} {int(values.max())} does not fit 63 bits")
            return values.astype(np.int64).reshape(-1)
        first = values.reshape(-1)[0].item() if values.size else None
        raise TypeError(f"{what} must be integers, not {values.dtype} (the first is {first!r})")
    items = values if isinstance(values, list | tuple) else list(values)
    # One pass in C over the types; the slow search for the culprit runs only to name it.
    for kind in set(map(type, items)) - {int}:
        if issubclass(kind, bool | np.bool_) or not hasattr(kind, "__index__"):
            bad = next(v for v in items if type(v) is kind)
            noun = "a bool" if issubclass(kind, bool | np.bool_) else f"a {kind.__name__}"
            raise TypeError(f"{what} {bad!r} is {noun}, not an integer")
    try:
        return np.frombuffer(array("q", items), dtype=np.int64)
    except OverflowError:
        bad = next(v for v in items if not -(1 << 63) <= int(v) < 1 << 63)
        raise ValueError(f"{what} {bad!r} does not fit 63 bits") from None


def copy_table(copies: Iterable[tuple[int, int, int]]) -> I64:
    """Raw ``(dst, src, nbytes)`` copies as an ``(n, 3)`` int64 table.

    :raises TypeError: a copy is not a triple of integers (bools and floats are refused).
    :raises ValueError: no copies, a triple of the wrong length, a negative
        address or size, or a copy of zero bytes.
    """
    if isinstance(copies, np.ndarray):
        if copies.ndim != 2 or copies.shape[1] != 3:
            raise ValueError(f"copies: expected (dst, src, nbytes) rows, got an array of shape {copies.shape}")
        table = integers(copies, "copy address or size").reshape(-1, 3)
    else:
        rows = copies if isinstance(copies, list | tuple) else list(copies)
        try:
            lengths = set(map(len, rows))
        except TypeError:
            raise TypeError("each copy is a (dst, src, nbytes) tuple") from None
        if lengths - {3}:
            raise ValueError(f"each copy is a (dst, src, nbytes) triple, got one of length {min(lengths - {3})}")
        table = integers(list(itertools.chain.from_iterable(rows)), "copy address or size").reshape(-1, 3)
    if len(table) == 0:
        raise ValueError("no copies to make")
    if (table < 0).any():
        row = int(np.flatnonzero((table < 0).any(axis=1))[0])
        raise ValueError(f"addresses and sizes must be non-negative: copy {row} is {tuple(table[row].tolist())}")
    if not table[:, 2].all():
        raise ValueError(f"copy {int(np.flatnonzero(table[:, 2] == 0)[0])} is a copy of zero bytes")
    return table


def check_disjoint(dsts: npt.ArrayLike, sizes: npt.ArrayLike) -> None:
    """Refuse a request whose destination spans overlap (sizes are positive).

    Copies of one batch run in no promised order, so overlapping writes land
    undefined bytes. Sorted by start, spans overlap exactly where one ends
    past the next one's start; already-ascending requests skip the sort.

    :raises CopyPlanError: two destination spans share a byte.
    """
    if isinstance(dsts, np.ndarray) and 1 < dsts.size <= _plan.SMALL and isinstance(sizes, int):
        starts = dsts.tolist()  # a usual request's pages, one size: ints, no arrays
        if all(starts[i + 1] >= starts[i] + sizes for i in range(len(starts) - 1)):
            return
    d = np.asarray(dsts).astype(np.uint64, copy=False).reshape(-1)
    if d.size < 2:
        return
    z = np.asarray(sizes).astype(np.uint64, copy=False)
    ends = d + z  # both below 2**63: no wrap
    if (d[1:] >= ends[:-1]).all():
        return
    if z.ndim == 0:  # one size for all (the usual page): the sorted starts say it all
        d = _plan.sorted_values(d)
        ends = d + z
    else:  # ties need no stable order: equal starts clash whatever their order
        order = np.argsort(d, kind=_plan.SORT_KIND)
        d, ends = d[order], ends[order]
    clash = np.flatnonzero(ends[:-1] > d[1:])
    if clash.size:
        i = int(clash[0])
        raise CopyPlanError(
            f"two copies write overlapping bytes: [{int(d[i]):#x}, {int(ends[i]):#x}) and "
            f"[{int(d[i + 1]):#x}, {int(ends[i + 1]):#x}); nothing was copied"
        )


def registrations(
    sides: Sequence[npt.ArrayLike], sizes: npt.ArrayLike, *, known_only: bool
) -> tuple[list[I64], list[Any]]:
    """Per side, per copy, a dense id of the registration holding the span (-1: no known region),
    and the regions met (the owners whose close must wait for the copy).

    Ids number each distinct ``(region, registration)`` pair of the request
    0, 1, 2... in order of appearance, shared by all sides: two registrations
    never share an id (a hash could collide and merge copies across them).

    :param known_only: every span must lie in a known region (a host-to-host
        engine, where anything else would be a ``memmove`` from or to memory nobody owns).
    :raises CopyPlanError: a span leaves its region, crosses registrations or is
        not committed; with ``known_only``, a span in no open tier or StaticHostMem.
    """
    arrays = [np.asarray(side).astype(np.uint64, copy=False).reshape(-1) for side in sides]
    lengths = [len(a) for a in arrays]
    z = np.asarray(sizes).astype(np.uint64, copy=False)
    if len(arrays) == 1:  # one side (per-slot addresses): no copies, one size stays a broadcast view
        addrs, nbytes = arrays[0], np.broadcast_to(z, arrays[0].shape)
    else:
        addrs = np.concatenate(arrays)
        nbytes = np.concatenate([np.broadcast_to(z, a.shape) for a in arrays])
    which, regions, registration = _regions.locate(addrs, nbytes)
    known = which >= 0
    if known_only and not known.all():
        addr = int(addrs[np.flatnonzero(~known)[0]])
        raise CopyPlanError(
            f"address {addr:#x} lies in no open HostTier or StaticHostMem; a host-to-host "
            f"CopyEngine (device=None) copies only between those"
        )
    if not known.any():  # device memory, the caller's own buffers: ids are -1 already
        return [which] if len(arrays) == 1 else list(np.split(which, np.cumsum(lengths)[:-1])), []
    ids = np.full(len(addrs), -1, dtype=np.int64)
    # Dense ids in order of first appearance, one per (region, registration) pair.
    pairs = which[known] << 32 | registration[known]
    unique, first, inverse = np.unique(pairs, return_index=True, return_inverse=True)
    appearance = np.argsort(first, kind="stable")
    rank = np.empty(len(unique), dtype=np.int64)
    rank[appearance] = np.arange(len(unique))
    ids[known] = rank[inverse.reshape(-1)]
    # Owners in order of first appearance: read off the pairs (few), not the spans (many).
    met = (unique[appearance] >> 32).tolist()
    owners = [regions[r] for r in dict.fromkeys(met)]
    return list(np.split(ids, np.cumsum(lengths)[:-1])), owners


@dataclass(frozen=True, slots=True, repr=False)
class Pages:
    """A caller's buffer checked once by ``CopyEngine.pages()``: one address per page, one page size.

    ``take(ids)`` picks some of the pages (in any order) without checking them
    again; ``CopyEngine.start()`` copies them to or from tier slots, one page
    per slot. The object keeps the buffer referenced, so a copy keeps it alive
    until the bytes landed.
    """

    addresses: U64
    """One address per page."""
    page: int
    """Bytes per page copied."""
    regions: tuple[Any, ...]
    """The tiers and StaticHostMems the addresses lie in: owners whose close waits for a copy."""
    owner: Any = None
    """The buffer (or whatever keeps the memory alive)."""
    writable: bool = True
    """Checked as a destination (``to_device``, a load): the buffer is not read-only."""
    checked_at: tuple[int, object] | None = None
    """The regions' ``generation()`` read before the check, where every region met keeps its checks
    until a snapshot (``checks_hold_until_snapshot``): while it is unchanged, ``relocate`` has
    nothing to do. None: located again before each copy."""
    _checked: Any = field(default=None, init=False, compare=False)
    # The addresses the library checked (``checked()``: ``buffer_addresses``, ``take``): pages built
    # or ``replace``d by hand have none, and are located again before every copy.

    def take(self, ids: Any) -> Pages:
        """The pages at positions ``ids`` (a sequence or integer array), in that order.

        :raises IndexError: a position is out of range.
        """
        taken = replace(self, addresses=self.addresses[np.asarray(ids, dtype=np.intp)])
        return checked(taken) if self._checked is self.addresses else taken

    def __len__(self) -> int:
        return int(self.addresses.shape[0])

    def __repr__(self) -> str:
        access = "writable" if self.writable else "read-only"
        return f"<Pages [{len(self)} of {self.page} bytes | {access} | {len(self.regions)} regions]>"


_NOT_ADDRESSES = int | np.integer | bytes | bytearray | memoryview | str
"""Not a sequence of addresses, though numpy would read some of these as one."""


def buffer_addresses(obj: Any, n: int, default_page: int | None, *, writable: bool, host_only: bool) -> Pages:
    """Per-slot addresses of ``obj`` and the page size.

    ``obj`` is a buffer of one page per slot (anything with
    ``__cuda_array_interface__``, or a host array of two or more dimensions),
    or else one integer address per slot (a sequence or 1-D integer array).

    :param default_page: bytes per page where ``obj`` is addresses (None: refused).
    :param writable: ``obj`` is the destination: a read-only buffer is refused.
    :param host_only: a host-to-host engine: device buffers are refused, and
        addresses must lie in an open tier or StaticHostMem (with a device,
        other addresses pass; those in one are checked alike).
    :raises TypeError: an address is not an integer, ``obj`` is neither addresses nor a buffer,
        or it is addresses and ``default_page`` is None.
    :raises ValueError: wrong shape, not C-contiguous, read-only, or pages of zero bytes.
    :raises CopyPlanError: a page that leaves a tier or StaticHostMem, crosses a registration or is not
        committed; on a host-to-host engine, device memory or an address outside every known region.
    """
    host = getattr(obj, "__array_interface__", None)
    host = host if host is not None and len(host["shape"]) >= 2 else None
    device = getattr(obj, "__cuda_array_interface__", None)
    if host_only and host is None and device is not None:
        raise CopyPlanError("a host-to-host CopyEngine (device=None) cannot copy device memory")
    iface = host if host_only or device is None else device
    if iface is None:
        if isinstance(obj, _NOT_ADDRESSES):
            raise TypeError(f"give one address per slot, or an array with one page per slot; got {type(obj).__name__}")
        if isinstance(obj, np.ndarray) and obj.ndim != 1:
            raise ValueError(f"expected {n} integer addresses, got shape {obj.shape} of {obj.dtype}")
        if default_page is None:
            raise TypeError("addresses need a page size: give page= (bytes per page)")
        addrs = integers(obj, "address")
        if addrs.shape != (n,):
            raise ValueError(f"expected {n} integer addresses, got {addrs.size}")
        lo = int(addrs.min()) if n else 0
        if lo < 0:
            raise ValueError(f"address {int(addrs[addrs < 0][0])} is negative")
        # The caller's own int64 array comes back as it is: copied, so that the addresses checked are
        # the ones copied, whatever the caller writes there later (a request in pieces, or pages
        # started later, reads them after the call has returned).
        shared = isinstance(obj, np.ndarray) and np.may_share_memory(addrs, obj)
        unsigned = addrs.astype(np.uint64) if shared else addrs.view(np.uint64)
        # Located with a device too: a staging buffer or tier named by address is an owner whose
        # close must wait for the DMA, and a page leaving it is refused, as in a raw copy. Device
        # memory meets no region: no owners.
        regions, checked_at = located(unsigned, default_page, known_only=host_only)
        return checked(Pages(unsigned, default_page, regions, obj, writable, checked_at))
    data = iface.get("data")
    if n == 0 and tuple(iface["shape"])[:1] == (0,):
        # No pages (a store or load of no keys): no page size to find, and an empty tensor may
        # expose a null pointer.
        return checked(Pages(np.empty(0, dtype=np.uint64), default_page or 0, (), obj, writable))
    if not isinstance(data, tuple) or not data[0]:
        raise ValueError("the buffer exposes no data pointer")
    if writable and data[1]:
        raise ValueError("the destination buffer is read-only; nothing was copied")
    strides = iface.get("strides")
    # The protocols say tuples; lists pass too, as they do in a fresh check.
    key: tuple[Any, ...] | None = (data, tuple(iface["shape"]), strides and tuple(strides), iface["typestr"], n)
    try:
        known = _checked.get(key)  # type: ignore[arg-type]
    except TypeError:  # an unhashable part: such a buffer is checked afresh each time
        key = known = None
    if known is not None:
        addresses, page, refs, generation = known
        owners = tuple(ref() for ref in refs)
        if _regions.generation() == generation and all(o is not None and not o.closed for o in owners):
            return checked(Pages(addresses, page, owners, obj, writable, generation))
    shape = tuple(iface["shape"])
    itemsize = np.dtype(iface["typestr"]).itemsize
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
    total = math.prod(shape) * itemsize
    page = total // n
    if page == 0:
        raise ValueError(f"the buffer's pages are zero bytes (shape {shape}): a copy of zero bytes")
    base = int(data[0])
    addresses = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(page)
    # An array over a tier's or a StaticHostMem's memory (made from its address, not through a
    # view that keeps it mapped): an owner whose close must wait for the copy, its pages checked
    # as addresses naming it are. The array vouches for memory outside every region (the caller's
    # own, or device memory).
    owners, holding = located(addresses, page, known_only=False, span=(base, base + total))
    if key is not None and holding is not None:
        addresses.flags.writeable = False  # shared by every request of this buffer
        if len(_checked) >= _CHECKED_BUFFERS:
            _checked.clear()
        _checked[key] = (addresses, page, tuple(map(weakref.ref, owners)), holding)
    return checked(Pages(addresses, page, owners, obj, writable, holding))


def checked(pages: Pages) -> Pages:
    """Mark ``pages`` as checked by the library (their addresses located when they were made)."""
    object.__setattr__(pages, "_checked", pages.addresses)
    return pages


def located(
    addresses: U64, sizes: int | U64, *, known_only: bool, span: tuple[int, int] | None = None
) -> tuple[tuple[Any, ...], tuple[int, object] | None]:
    """The regions spans lie in now (``owners_of``), and the regions' ``generation()`` read before,
    where every region met keeps its checks until a snapshot (None: the answer holds for now only)."""
    generation = _regions.generation()
    owners = owners_of(addresses, sizes, known_only=known_only, span=span)
    holds = all(getattr(o, "checks_hold_until_snapshot", False) for o in owners)
    return owners, generation if holds else None


def refuse_closed(regions: tuple[Any, ...]) -> None:
    """:raises CopyPlanError: a region the pages lay in when they were checked has closed since."""
    for region in regions:
        if region.closed:
            raise CopyPlanError(f"{region.region_name} closed after the pages were checked; nothing was copied")


def located_again(
    regions: tuple[Any, ...],
    checked_at: tuple[int, object] | None,
    addresses: U64,
    sizes: int | U64,
    *,
    known_only: bool,
) -> tuple[Any, ...]:
    """``regions`` that ``located()`` found (with ``checked_at``), as they stand now: the same while no
    region closed or shrank since (a snapshot moves the generation), else the spans located afresh.

    :raises CopyPlanError: one of ``regions`` closed since, or as ``owners_of()``.
    """
    refuse_closed(regions)
    if checked_at is not None and checked_at == _regions.generation():
        return regions
    return owners_of(addresses, sizes, known_only=known_only)


_CHECKED_BUFFERS = 256
"""Array buffers whose check ``buffer_addresses()`` keeps (an engine copies to and from the same few
staging buffers and tensors, request after request); past this many the record starts again."""

_checked: dict[tuple[Any, ...], tuple[U64, int, tuple[weakref.ref[Any], ...], tuple[int, object]]] = {}
"""Arrays that passed the check, by what their interface says (pointer, read-only flag, shape,
strides, type, pages): the addresses, the page, the regions they lie in (weakly) and the regions'
``generation()`` then. A hit needs the same generation and every region still open: a region that
closes or shrinks snapshots first (which moves the generation), and one whose checks may change
otherwise (``checks_hold_until_snapshot`` false) is never recorded. Arrays in no region (device
memory, the caller's own) need nothing more."""


@dataclass(frozen=True, slots=True)
class InPieces:
    """Which requests are planned in pieces (``Pieces``): of ``bound`` pages or more, where
    ``wants(host, other, page)`` says so of the slots at these addresses and the pages at those."""

    bound: int
    wants: Callable[[U64, U64, int], bool]


def plan_slots(
    tier: HostTier,
    slots: Any,
    buffer: Any,
    direction: str,
    page_size: int | None,
    *,
    host_only: bool,
    in_pieces: InPieces | None = None,
) -> tuple[Plan | Pieces, list[Any]]:
    """Check a per-slot copy's two sides, then plan it in the host side's address order.

    ``direction`` is ``"h2d"`` (slots to ``buffer``) or ``"d2h"``; ``host_only``:
    a host-to-host engine (``buffer`` must lie in known regions). Returns the
    plan and the regions whose close must wait for it. ``in_pieces``: see ``plan_side()``.

    :raises CopyPlanError: a page larger than a slot, or (host-to-host) an address outside every region.
    :raises SlotError: a slot is not allocated, or (d2h) appears twice.
    """
    # A usual request's few ids, as ints: no numpy call between them and the plan (``plan_small``).
    few = tier.slot_address_list(slots)
    host: U64 | list[int] = tier.slot_addresses(slots) if few is None else few
    if not len(host):
        raise ValueError("no slots to copy")
    page = tier.slot_size if page_size is None else positive_count(page_size, "page")
    _check_page(tier, page)  # before the addresses are located: a page of 2**64 does not fit numpy's uint64
    side = buffer_addresses(buffer, len(host), page, writable=direction == "h2d", host_only=host_only)
    return plan_side(tier, host, side, direction, in_pieces=in_pieces)


def plan_slots_many(
    tier: HostTier, requests: Sequence[tuple[Any, Any]], direction: str, page_size: int | None, *, host_only: bool
) -> list[tuple[Plan, list[Any]]]:
    """``plan_slots()`` of several ``(slots, buffer)`` requests of one tier, direction and ``page``
    at once: the same plans and owners, for the numpy calls of one request (plus a check of each
    buffer, which ``buffer_addresses()`` keeps for arrays).

    Takes slot ids as lists or tuples of ints, or 1-D integer arrays; and buffers whose pages are
    one size for every request.

    :raises: where any request would be refused, or takes something else: something (which request,
        and why, is for ``plan_slots()`` of each alone to say).
    """
    parts = []
    for slots, _ in requests:
        if isinstance(slots, np.ndarray):
            if slots.ndim != 1 or slots.dtype.kind not in "iu" or not slots.size:
                raise ValueError("plan alone")
            parts.append(slots.astype(np.int64, copy=False))
        elif not slots or set(map(type, slots)) != {int}:  # bools and the rest: named by plan_slots() alone
            raise ValueError("plan alone")
        else:
            parts.append(np.asarray(slots, dtype=np.int64))
    counts = [len(p) for p in parts]
    host = tier.slot_addresses(np.concatenate(parts))
    page = tier.slot_size if page_size is None else positive_count(page_size, "page")
    _check_page(tier, page)
    h2d = direction == "h2d"
    sides = [
        buffer_addresses(buffer, count, page, writable=h2d, host_only=host_only)
        for (_, buffer), count in zip(requests, counts, strict=True)
    ]
    page = sides[0].page
    if any(side.page != page for side in sides):
        raise ValueError("plan alone")
    _check_page(tier, page)
    other = np.concatenate([side.addresses for side in sides])
    request = np.repeat(np.arange(len(counts)), counts)
    if h2d:  # each request's destinations (the buffer's pages) must not overlap (check_disjoint)
        starts = other[np.lexsort((other, request))]
        if ((request[1:] == request[:-1]) & (starts[1:] < starts[:-1] + np.uint64(page))).any():
            raise CopyPlanError("two copies write overlapping bytes")
        plans = plan_many(other, host, page, counts, src_reg=tier.registrations_at)
    else:
        plans = plan_many(
            host, other, page, counts, dst_reg=tier.registrations_at, order_by="dst", distinct_order_side=True
        )
    return [
        (planned, [tier, *(r for r in side.regions if r is not tier)])
        for planned, side in zip(plans, sides, strict=True)
    ]


def plan_side(
    tier: HostTier, host: U64 | list[int], side: Pages, direction: str, *, in_pieces: InPieces | None = None
) -> tuple[Plan | Pieces, list[Any]]:
    """Plan a per-slot copy between the slots at ``host`` (``tier.slot_addresses``, or
    ``slot_address_list``) and pages that ``buffer_addresses()`` checked (a subset of its addresses,
    in any order, stays checked).

    ``in_pieces``: which requests to check whole and return as ``Pieces``, planned where they
    are issued (None: always planned here).

    :raises CopyPlanError: the side's page is larger than a slot.
    :raises ValueError: no slots, or not one address per slot.
    """
    other, page, regions = side.addresses, side.page, side.regions
    n = len(host)
    if n == 0:
        raise ValueError("no slots to copy")
    if len(other) != n:
        raise ValueError(f"expected one address per slot ({n}), got {len(other)}")
    _check_page(tier, page)  # an array's page is its row, whatever page= said
    h2d = direction == "h2d"
    if h2d:
        check_disjoint(other, page)  # to_host's destinations are slots: the planner refuses repeats
    owners = [tier, *(r for r in regions if r is not tier)]
    registration = tier.registrations_at
    if n <= _plan.SMALL and (in_pieces is None or n < in_pieces.bound):
        # The usual request: Python ints beat two dozen numpy calls.
        hosts, others = host if isinstance(host, list) else host.tolist(), other.tolist()
        if h2d:
            return plan_small(others, hosts, page, src_reg=registration), owners
        return plan_small(hosts, others, page, dst_reg=registration, order_by="dst", distinct_order_side=True), owners
    host = np.asarray(host, dtype=np.uint64)
    if in_pieces is not None and n >= in_pieces.bound and in_pieces.wants(host, other, page):
        if h2d:
            return Pieces(other, host, page, "src", src_reg=registration), owners
        refuse_repeats(host, tier.slot_size)  # the whole request's, before any piece is issued
        return Pieces(host, other, page, "dst", dst_reg=registration), owners
    if h2d:
        return plan(other, host, page, src_reg=registration, n=n), owners
    planned = plan(host, other, page, dst_reg=registration, n=n, order_by="dst", distinct_order_side=True)
    return planned, owners


def relocate(side: Pages, *, host_only: bool = False) -> Pages:
    """A side ``buffer_addresses()`` checked some time ago, located again before it is copied.

    Addresses named in a tier or a StaticHostMem were located when checked;
    the region may have closed (unmapped) or shrunk since, while the caller
    waited. Without such regions (a device buffer, an array) nothing is done.
    Pages the library did not make (built or ``replace``d by hand) are located
    afresh, and with ``host_only`` (an engine without a device) each must lie
    in an open tier or StaticHostMem.

    :raises CopyPlanError: a region closed, a page now leaves its committed range, or
        (``host_only``) a page lies in no known region.
    """
    trusted = side._checked is side.addresses
    if trusted and not side.regions and not host_only:
        return side  # device memory, as checked
    # Without a device every page must lie in a known region (a memmove elsewhere could kill the process).
    checked_at = side.checked_at if trusted else None
    regions = located_again(side.regions, checked_at, side.addresses, side.page, known_only=host_only)
    return side if regions is side.regions else replace(side, regions=regions)


def owners_of(
    addresses: U64, sizes: int | U64, *, known_only: bool, span: tuple[int, int] | None = None
) -> tuple[Any, ...]:
    """The regions spans of ``sizes`` bytes (one size, or one per span) at ``addresses`` lie in.

    The usual spans (a staging buffer's pages, a tier's) lie in one registration of one region,
    or (device memory) in none: their bounding span, searched once, says so; anything else is
    searched span by span, which names the span at fault. ``span``: that bounding ``(lo, hi)``
    where the caller knows it (an array's). Raises as ``registrations()``.
    """
    if len(addresses):
        if span is not None:
            lo, hi = span
        elif isinstance(sizes, int):
            lo, hi = int(addresses.min()), int(addresses.max()) + sizes  # Python ints: no wrap
        else:
            lo, hi = int(addresses.min()), int((addresses + sizes).max())  # host pages' own lengths
        try:
            region = _regions.locate_span(lo, hi - lo)
        except CopyPlanError:
            pass  # spans may still each lie inside one registration (or outside every region)
        else:
            if region is not None:
                return (region,)
            if not known_only:
                return ()
    _, regions = registrations([addresses], sizes, known_only=known_only)
    return tuple(regions)


def check_again(dsts: U64, srcs: U64, sizes: npt.ArrayLike, owners: Sequence[Any]) -> None:
    """Check a tracked copy again: for one planned on another thread than a region's close or shrink,
    whose snapshot may have come between its checks and its tracking (``aiokvtier._regions``).

    :raises CopyPlanError: a region is closing or closed, or a span now leaves its committed range.
    """
    for owner in owners:
        if owner.closed:
            raise CopyPlanError(f"{owner.region_name} closed while the copy was checked; nothing was copied")
    registrations([dsts, srcs], sizes, known_only=False)


def _check_page(tier: HostTier, page: int) -> None:
    if not 0 < page <= tier.slot_size:
        raise CopyPlanError(f"a page of {page} bytes does not fit a {tier.slot_size}-byte slot")
