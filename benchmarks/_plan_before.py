"""The copy planner as it was before radix sorting (commit db49479), kept to be measured beside
the current one by ``plan_cost.py``: ``plan``, ``_sorted_order``, ``check_disjoint``,
``plan_slots`` and ``plan_side`` verbatim, the unchanged pieces imported."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from aiokvtier._copy._plan import SMALL, U64, Plan, Registrations, _as_u64, plan_small
from aiokvtier._copy._requests import CopyPlanError, Pages, _check_page, buffer_addresses
from aiokvtier._errors import SlotError
from aiokvtier._host._slots import positive_count

SORT_KIND = "quicksort"
PACKED_SORT_FROM = 512


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
) -> Plan:
    """Sort copies by one side, merge runs contiguous on both sides within one registration.

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
    if not (lead[1:] > lead[:-1]).all():  # fresh slots usually ascend already: no sort, no gathers
        order, lead = _sorted_order(lead)
        if order_by == "src":
            s, d = lead, d[order]
        else:
            d, s = lead, s[order]
        if page is None:
            z = z[order]
        if distinct_order_side and (lead[1:] == lead[:-1]).any():
            raise SlotError("a slot appears twice as a copy destination")
    step = np.uint64(page) if page is not None else z[:-1]
    joins = (s[1:] == s[:-1] + step) & (d[1:] == d[:-1] + step)
    pairs = np.flatnonzero(joins)
    for reg, side in ((dst_reg, d), (src_reg, s)):
        if reg is None or pairs.size == 0:
            continue
        if callable(reg) and 2 * pairs.size < count:  # few candidates: ask about those alone
            ids = reg(np.concatenate((side[pairs], side[pairs + 1])))
            joins[pairs] &= ids[: pairs.size] == ids[pairs.size :]
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


def _uniform(sizes: object) -> int | None:
    """The one size of every copy, where ``sizes`` is a single integer (a page); else None."""
    if isinstance(sizes, int | np.integer) and not isinstance(sizes, bool):
        return int(sizes)
    return None


def _sorted_order(lead: U64) -> tuple[npt.NDArray[np.intp], U64]:
    """The permutation that sorts ``lead``, and ``lead`` sorted.

    Addresses of one request span far less than 2**49 bytes: each is packed
    with its position into one 64-bit key (offset from the lowest, shifted
    past the position bits), and the keys are sorted by value, 2-3x cheaper
    than an argsort, and ties come out in position order. The sorted values
    are read back off the keys (no gather). Where the span is too wide, an
    argsort (``SORT_KIND``: copies sharing a leading address never merge,
    a copy's length being positive, so their order is immaterial).
    """
    n = int(lead.shape[0])
    if n <= PACKED_SORT_FROM:  # stable, as the packed keys are: ties in position order either way
        order = np.argsort(lead, kind="stable")
        return order, lead[order]
    bits = max(1, (n - 1).bit_length())
    lo = int(lead.min())
    if SORT_KIND == "stable" or int(lead.max()) - lo >= 1 << (64 - bits):
        order = np.argsort(lead, kind=SORT_KIND)
        return order, lead[order]
    shift = np.uint64(bits)
    keys = (lead - np.uint64(lo)) << shift
    keys |= np.arange(n, dtype=np.uint64)
    keys.sort()
    order = (keys & np.uint64((1 << bits) - 1)).astype(np.intp)
    keys >>= shift
    keys += np.uint64(lo)
    return order, keys


def check_disjoint(dsts: npt.ArrayLike, sizes: npt.ArrayLike) -> None:
    """Refuse a request whose destination spans overlap (sizes are positive).

    Copies of one batch run in no promised order, so overlapping writes land
    undefined bytes. Sorted by start, spans overlap exactly where one ends
    past the next one's start; already-ascending requests skip the sort.

    :raises CopyPlanError: two destination spans share a byte.
    """
    if isinstance(dsts, np.ndarray) and 1 < dsts.size <= SMALL and isinstance(sizes, int):
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
    if z.ndim == 0:  # one size for all (the usual page): the sorted starts say it all, and a
        d = np.sort(d, kind=SORT_KIND)  # value sort is cheaper than an argsort
        ends = d + z
    else:  # ties need no stable order: equal starts clash whatever their order
        order = np.argsort(d, kind=SORT_KIND)
        d, ends = d[order], ends[order]
    clash = np.flatnonzero(ends[:-1] > d[1:])
    if clash.size:
        i = int(clash[0])
        raise CopyPlanError(
            f"two copies write overlapping bytes: [{int(d[i]):#x}, {int(ends[i]):#x}) and "
            f"[{int(d[i + 1]):#x}, {int(ends[i + 1]):#x}); nothing was copied"
        )


def plan_slots(
    tier: Any, slots: Any, buffer: Any, direction: str, page_size: int | None, *, host_only: bool
) -> tuple[Plan, list[Any]]:
    """Check a per-slot copy's two sides, then plan it in the host side's address order.

    ``direction`` is ``"h2d"`` (slots to ``buffer``) or ``"d2h"``; ``host_only``:
    a host-to-host engine (``buffer`` must lie in known regions). Returns the
    plan and the regions whose close must wait for it.

    :raises CopyPlanError: a page larger than a slot, or (host-to-host) an address outside every region.
    :raises SlotError: a slot is not allocated, or (d2h) appears twice.
    """
    host = tier.slot_addresses(slots)
    if host.size == 0:
        raise ValueError("no slots to copy")
    page = tier.slot_size if page_size is None else positive_count(page_size, "page")
    _check_page(tier, page)  # before the addresses are located: a page of 2**64 does not fit numpy's uint64
    side = buffer_addresses(buffer, len(host), page, writable=direction == "h2d", host_only=host_only)
    return plan_side(tier, host, side, direction)


def plan_side(tier: Any, host: U64, side: Pages, direction: str) -> tuple[Plan, list[Any]]:
    """Plan a per-slot copy between the slots at ``host`` (``tier.slot_addresses``) and pages that
    ``buffer_addresses()`` checked (a subset of its addresses, in any order, stays checked).

    :raises CopyPlanError: the side's page is larger than a slot.
    :raises ValueError: no slots, or not one address per slot.
    """
    other, page, regions = side.addresses, side.page, side.regions
    if host.size == 0:
        raise ValueError("no slots to copy")
    if other.shape != host.shape:
        raise ValueError(f"expected one address per slot ({len(host)}), got {len(other)}")
    _check_page(tier, page)  # an array's page is its row, whatever page= said
    h2d = direction == "h2d"
    if h2d:
        check_disjoint(other, page)  # to_host's destinations are slots: the planner refuses repeats
    owners = [tier, *(r for r in regions if r is not tier)]
    registration = tier.registrations_at
    if len(host) <= SMALL:  # the usual request: Python ints beat two dozen numpy calls
        hosts, others = host.tolist(), other.tolist()
        if h2d:
            return plan_small(others, hosts, page, src_reg=registration), owners
        return plan_small(hosts, others, page, dst_reg=registration, order_by="dst", distinct_order_side=True), owners
    if h2d:
        return plan(other, host, page, src_reg=registration, n=len(host)), owners
    planned = plan(host, other, page, dst_reg=registration, n=len(host), order_by="dst", distinct_order_side=True)
    return planned, owners
