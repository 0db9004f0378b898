"""Transfers: every copy a store makes, into its slots and out of them, and the caller's pages they copy.

Three paths: a ``CopyEngine`` (device pages; the addresses checked once when
the call began), ``CopyEngine.copy`` for blocks shorter than the destination
pages, and, without an engine, a copy on the store's own thread, tracked
as every copy over a region's memory is (by the tier, and by any
StaticHostMem or other tier the caller's pages lie in), so that their close
and shrink wait for it. A copy owns the caller's pages until it lands.

Without an engine, pages given as the rows of one 2-D array are copied by one
numpy call (``aiokvtier._host._rows``), which releases the GIL for the whole
copy: the loop books the blocks meanwhile, where a ``memmove`` per page took
the GIL back between pages and ran after the booking rather than beside it.
Other pages (a list of buffers, blocks shorter than the rows) take a
``memmove`` per page.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np
import numpy.typing as npt

from .._copy._requests import Pages as CopyPages
from .._copy._requests import (
    buffer_addresses,
    check_again,
    check_disjoint,
    checked,
    located,
    located_again,
    refuse_closed,
)
from .._errors import CopyPlanError
from .._host._rows import memmove_all, rows_from_slots, rows_into_slots
from .._lifecycle import Lifecycle, finish
from .._regions import Landing, Region, epoch
from ._index import I64, NO_IDS, U64

U8 = npt.NDArray[np.uint8]

if TYPE_CHECKING:
    from .._copy._engine import CopyEngine
    from .._host._tier import HostTier

__all__ = ["Copied", "Pages", "Started", "Transfers", "copy_tracked", "host_pages", "landed_after", "located_pages"]


class Pages(NamedTuple):
    """The caller's pages: one address and length per key, and the objects that own the memory."""

    addresses: U64
    lengths: U64
    owners: list[Any]
    page: int = 0
    """The one length of every page (a CopyEngine's pages, checked by ``buffer_addresses``); 0: host pages."""
    regions: tuple[Any, ...] = ()
    """Where the pages lie (a StaticHostMem, a tier), located when the call began: owners the copy must
    outlive, and whose close since refuses it."""
    array: U8 | None = None
    """Host pages given as the rows of one 2-D uint8 array: that array (copied as rows)."""
    rows: I64 | None = None
    """With ``array``: which of its rows the pages are, in order (None: every row)."""
    checked_at: tuple[int, object] | None = None
    """When ``regions`` were located, where that holds until a region snapshots (``located()``)."""

    def take(self, ids: I64) -> Pages:
        rows = None if self.array is None else ids if self.rows is None else self.rows[ids]
        return self._replace(addresses=self.addresses[ids], lengths=self.lengths[ids], rows=rows)

    def side(self, page: int) -> CopyPages:
        """For ``CopyEngine.start()``: the addresses were checked when the call began (as a
        destination for a load, the one direction that writes them)."""
        return checked(CopyPages(self.addresses, page, self.regions, self.owners, checked_at=self.checked_at))


Started = tuple["asyncio.Future[None] | None", "asyncio.Future[None]"]
"""A queued copy: ``submitted`` (None: nothing to wait for) settles once it was issued, ``done`` once it landed."""


class Copied(asyncio.Future[None]):
    """A host copy's end on a worker thread (``copy_tracked``): never cancelled, as a CopyEngine's copies.

    A task cancelled while it awaits one stays suspended until the copy ended, then receives the
    cancellation (its ``cancel()`` finds a waiter that refuses it): the caller's pages are the copy's
    until then. Awaited directly, its wake-up is one loop iteration, where ``finish()``'s shield took two;
    a copy that failed under a cancelled caller is then not the cancellation's ``__cause__`` (as with
    the engine's copies).
    """

    def cancel(self, msg: Any = None) -> bool:
        return False


def located_pages(pages: Pages) -> Pages:
    """Host ``pages`` with the regions they lie in now (``located()``): a region among them that closes
    while the call waits (for slots, another call's claim, an owner's answer) refuses the copy
    (``copy_tracked``) rather than read or write memory it let go.

    :raises CopyPlanError: a page runs into a region, or leaves one, or what it lies in is not committed.
    """
    if not len(pages.addresses):
        return pages
    regions, checked_at = located(pages.addresses, pages.lengths, known_only=False)
    return pages._replace(regions=regions, checked_at=checked_at)


def host_pages(obj: Any, n: int, *, writable: bool) -> Pages:
    """Pages in host memory: a 2-D uint8 array, or a sequence of bytes-like objects."""
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
        base = obj.ctypes.data
        if page:  # one arange: half the numpy steps of a base plus an arange times the page
            addresses = np.arange(base, base + n * page, page, dtype=np.uint64)
        else:
            addresses = np.full(n, base, dtype=np.uint64)
        lengths = np.empty(n, dtype=np.uint64)
        lengths.fill(page)
        return Pages(addresses, lengths, [obj], array=obj)
    if isinstance(obj, bytes | bytearray | memoryview | str):
        raise TypeError("pages are a sequence of bytes-like objects (one per key) or a 2-D uint8 array")
    try:
        items = list(obj)
    except TypeError:
        raise TypeError(
            "host pages are a sequence of bytes-like objects or a 2-D uint8 numpy array (device pages need a "
            "CopyEngine)"
        ) from None
    if len(items) != n:
        raise ValueError(f"expected one page per key ({n}), got {len(items)}")
    views = []
    for item in items:
        try:
            view = memoryview(item)
        except TypeError:
            raise TypeError(f"a page must be bytes-like, not {type(item).__name__}") from None
        if not view.c_contiguous:
            raise ValueError("a page must be contiguous")
        if writable and view.readonly:
            raise ValueError(f"destination page of {type(item).__name__} is read-only; nothing was copied")
        views.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
    arrays = [np.frombuffer(v, dtype=np.uint8) for v in views]
    addresses = np.fromiter((a.ctypes.data if a.size else 0 for a in arrays), dtype=np.uint64, count=n)
    lengths = np.fromiter((a.size for a in arrays), dtype=np.uint64, count=n)
    if writable and n > 1 and lengths.all():
        # Two keys into one buffer (or views that overlap): the copies land in no promised order and the
        # page would hold whichever landed last. An array's rows never overlap.
        try:
            check_disjoint(addresses, lengths)
        except CopyPlanError as exc:
            raise ValueError(f"two destination pages overlap ({exc}); pass one buffer per key") from None
    return Pages(addresses, lengths, [*views, *arrays])


class Transfers:
    """The copies of one store over ``tier``: through ``engine``, or ``memmove`` on the worker of ``life``.

    :param engine: the store's engine; a host-to-host one adds nothing over
        the store's own memmove (host pages either way), so it is not used
        (unless ``host_engines``).
    """

    host_engines: ClassVar[bool] = False
    """Copy through a host-to-host engine too: tests set it to take the engine path without a GPU.
    Read at every call, so it may change between calls."""

    def __init__(self, tier: HostTier, engine: CopyEngine | None, life: Lifecycle) -> None:
        self._tier = tier
        self._engine = engine
        self._life = life

    @property
    def engine(self) -> CopyEngine | None:
        """The engine copies go through; None: ``memmove`` on the store's thread."""
        engine = self._engine
        if engine is None or (engine.device is None and not self.host_engines):
            return None
        return engine

    def pages(self, obj: Any, n: int, *, writable: bool) -> Pages:
        """The caller's pages, checked against the slot size."""
        slot_size = self._tier.slot_size
        engine = self.engine
        if engine is not None:
            side = buffer_addresses(obj, n, slot_size, writable=writable, host_only=engine.device is None)
            if not writable and n and side.page > slot_size:  # one page size: no pass over the lengths
                raise ValueError(f"a page of {side.page} bytes does not fit a {slot_size}-byte slot; nothing changed")
            lengths = np.empty(n, dtype=np.uint64)
            lengths.fill(side.page)  # np.full's own Python steps cost more than this
            return Pages(side.addresses, lengths, [obj], side.page, tuple(side.regions), checked_at=side.checked_at)
        pages = host_pages(obj, n, writable=writable)
        if not writable and n:
            longest = int(pages.lengths.max())
            if longest > slot_size:
                raise ValueError(f"a page of {longest} bytes does not fit a {slot_size}-byte slot; nothing changed")
            if int(pages.lengths.min()) == 0:
                raise ValueError("an empty page cannot be stored")
        return located_pages(pages)

    def slots_under(self, pages: Pages) -> I64:
        """The tier slots the pages lie in, ascending (pages in the store's own tier)."""
        tier = self._tier
        if tier not in pages.regions:  # located when the call began: the usual call, pages of the caller's own
            return NO_IDS
        base, size = tier.region_bounds()
        offsets = pages.addresses - np.uint64(base)  # below the base: wraps past the size
        inside = np.flatnonzero(offsets < np.uint64(size))
        if not inside.size:  # the usual call: pages of the caller's own
            return NO_IDS
        slot_size = np.uint64(tier.slot_size)
        first = offsets[inside] // slot_size
        last = (offsets[inside] + pages.lengths[inside] - np.uint64(1)) // slot_size  # a page may straddle two
        slots: I64 = np.union1d(first, last).astype(np.int64)
        return slots

    def start_in(self, slots: I64, pages: Pages, after: Any) -> Started:
        """Queue the copy of the caller's pages into ``slots``."""
        tier, engine = self._tier, self.engine
        if engine is not None:
            return engine.start(tier, slots, pages.side(pages.page), "d2h", after=after)
        since = epoch()
        if pages.array is not None:
            base, size = tier.base_address, tier.region_bounds()[1]  # the first checks the tier open
            rows = partial(rows_into_slots, base, size, tier.slot_size, slots, pages.array, pages.rows)
            return (None, self._copy_host(rows, slots, pages, pages.lengths, since, into_slots=True))
        copies = list(
            zip(tier.slot_addresses(slots).tolist(), pages.addresses.tolist(), pages.lengths.tolist(), strict=True)
        )
        return (None, self._copy_host(partial(memmove_all, copies), slots, pages, pages.lengths, since))

    def start_out(self, slots: I64, pages: Pages, lengths: U64, after: Any) -> Started:
        """Queue the copy of ``slots`` into the caller's pages.

        :raises CopyPlanError: a region the pages lay in when the call began closed since (or, through an
            engine, shrank past them).
        """
        tier, engine = self._tier, self.engine
        page = pages.page or int(pages.lengths[0])
        if engine is not None and not np.count_nonzero(lengths != page):
            return engine.start(tier, slots, pages.side(page), "h2d", after=after)
        since = epoch()
        array = pages.array
        if (
            engine is None
            and array is not None
            and pages.rows is None
            and not np.count_nonzero(lengths != array.shape[1])
        ):
            base, size = tier.base_address, tier.region_bounds()[1]
            # Whole rows, every row in order: gathered straight into the array (shorter blocks or some
            # rows only would go through a temporary array of the rows first).
            rows = partial(rows_from_slots, base, size, tier.slot_size, slots, array, array.shape[1])
            return (None, self._copy_host(rows, slots, pages, lengths, since, into_slots=False))
        # Host pages, or blocks shorter than the destination pages: each copies its own length.
        copies = list(zip(pages.addresses.tolist(), tier.slot_addresses(slots).tolist(), lengths.tolist(), strict=True))
        if engine is not None:
            # A raw copy locates its spans afresh: where the pages' region closed while the call waited, a
            # device engine would take them for device memory, a host one for whatever is mapped there now.
            refuse_closed(pages.regions)
            return (None, asyncio.ensure_future(engine.copy(copies, after=after)))
        return (None, self._copy_host(partial(memmove_all, copies), slots, pages, lengths, since, into_slots=False))

    @staticmethod
    async def overlap(started: Started, work: Callable[[], None]) -> None:
        """Do ``work`` once the copy was issued, then wait for the copy to land.

        The store asks the engine for no signal of the issue (a crossing back to
        the loop per call, 60-100 us on the H200, where the booking takes ~30
        us): ``submitted`` is then the copy's landing, and the work follows it.
        An engine that does report the issue has the work run while the copy
        is in flight. The caller's pages belong to the copy until it lands: a
        cancellation is held back until then.
        """
        submitted, done = started
        try:
            if submitted is not None:
                await submitted
            work()
        finally:
            if done.done() or isinstance(done, Copied):  # never cancelled: awaited without a task and a shield
                await done
            else:
                await finish(done)

    def _copy_host(
        self,
        copy: Callable[[], None],
        slots: I64,
        pages: Pages,
        lengths: U64,
        since: int,
        *,
        into_slots: bool = True,
    ) -> asyncio.Future[None]:
        """``copy_tracked`` on the store's thread, between the tier's ``slots`` and the caller's pages.

        :raises CopyPlanError: as ``copy_tracked``.
        """
        tier = self._tier
        at = partial(tier.slot_addresses, slots)
        return copy_tracked(self._life, copy, pages, lengths, at, since, tier=tier, into_slots=into_slots)


def copy_tracked(
    life: Lifecycle,
    copy: Callable[[], None],
    pages: Pages,
    lengths: U64,
    slot_addresses: Callable[[], U64],
    since: int,
    *,
    tier: Region | None,
    into_slots: bool,
) -> asyncio.Future[None]:
    """Run ``copy`` on the worker of ``life``: a copy of ``lengths`` bytes between slots (at
    ``slot_addresses()``) and the caller's host ``pages`` (``located_pages``), tracked as every copy
    over a region's memory is: by ``tier`` (the slots' region, None where they lie in none), and by
    any StaticHostMem or other tier that the pages lie in, for an array made over its memory keeps
    none of it mapped. Their close and shrink wait until the thread let go (``landed_after``).
    ``since``: ``epoch()`` before the slots were located. On the loop, in one step. Returns a ``Copied``:
    never cancelled, so it may be awaited directly.

    :raises CopyPlanError: a region the pages lay in when the call began closed since, or a page
        lies in a region that is closing, or leaves it.
    """
    # Located when the call began; again where a region closed or shrank since (the pages may have
    # left one), in the step that located the slots: every region met is open.
    regions = located_again(pages.regions, pages.checked_at, pages.addresses, lengths, known_only=False)
    done = Landing() if tier is None else tier.copies.begin()
    try:
        for region in regions:
            if region is not tier:
                region.copies.track(done)
        if epoch() != since:  # a region snapshotted meanwhile (from another loop's thread): again
            at = slot_addresses()
            dsts, srcs = (at, pages.addresses) if into_slots else (pages.addresses, at)
            check_again(dsts, srcs, lengths, regions if tier is None else (tier, *regions))
        return life.submit(landed_after, copy, done, future=Copied(loop=asyncio.get_running_loop()), light=True)
    except BaseException:
        done.set()
        raise


def landed_after(copy: Callable[[], None], done: Landing) -> None:
    """Run ``copy`` on a worker thread, then set ``done`` (also on failure) for the regions it was over."""
    try:
        copy()
    finally:
        done.set()
