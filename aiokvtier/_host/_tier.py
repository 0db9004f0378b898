"""HostTier: the async facade over reservation, fill, slots and views."""

from __future__ import annotations

import asyncio
import errno
import logging
import operator
import time
from collections.abc import Iterable, Mapping
from typing import Any, Self, overload

import numpy as np
import numpy.typing as npt

from .. import _regions
from .._config import HostTierConfig, default_fill_threads, parse_quota
from .._crossing import LoopWaiters
from .._errors import CopyPlanError, DecommitError, OutOfSlots, QuotaError, TierClosedError, WouldBlock
from .._handoff import handoff
from .._lifecycle import Lifecycle, Owner, finish
from .._regions import I64, U64, InflightCopies
from .._units import format_bytes
from ._backing import Backing, Backings
from ._fill import Filler
from ._layout import UnitLayout
from ._placement import Placement, node_cpus_or_none, read_placement
from ._slots import SlotAllocator, positive_count
from ._statistics import TierStatistics
from ._views import ViewLedger

__all__ = ["HostTier"]

log = logging.getLogger("aiokvtier")


class HostTier(Owner):
    """A host-memory KV tier that serves slots while it is still being filled.

    Open it with ``tier = await HostTier.open(config)`` or
    ``async with HostTier(config) as tier:``; either returns once the range is
    reserved and the fill has started. Slots are ``slot_size`` bytes at
    ``base + slot * slot_size``; fresh ids ascend from 0 and freed ids are
    reused first (most recently freed first).

    Threads: the async methods and the slot calls (``allocate_nowait``,
    ``free``, ``view``, ``address``) belong to the event loop that opened the
    tier; other threads use ``wait_resident_blocking()`` and
    ``statistics()``. The tier's blocking work (reserving, resizing,
    releasing) runs on its own ``aiokvtier-tier`` thread, never on the loop.

    Cancellation: every await is safe to cancel. ``open``, an accepted
    ``resize`` and ``aclose`` run to the end first and deliver the
    cancellation afterwards, with the tier consistent (a cancelled ``open``
    has released everything it built).

    Fork: a child process cannot use a tier its parent opened (its threads do
    not exist there); every call but ``statistics()`` and ``aclose()`` raises
    [``TierClosedError``][aiokvtier.TierClosedError] saying so.
    """

    # Set while opening; the methods that read them run only once the tier is open.
    _backing: Backing
    _filler: Filler
    _waiters: LoopWaiters

    def __init__(self, config: HostTierConfig | Mapping[str, Any], *, backings: Backings | None = None) -> None:
        """``backings``: what reserves and commits the range (default: the backing the config names,
        ``"host"``, ``"register"`` or ``"vmm"``); a seam for memory of another kind or a test's faults.

        :raises pydantic.ValidationError: ``config`` is a mapping that does not validate.
        """
        self._config = config if isinstance(config, HostTierConfig) else HostTierConfig.model_validate(config)
        if backings is None:
            from .._backings import DefaultBackings  # the one place that knows the CUDA backings

            backings = DefaultBackings()
        self._backings = backings
        self._life = Lifecycle("HostTier", "aiokvtier-tier")
        self._resize_lock = asyncio.Lock()
        self._views = ViewLedger(int(self._config.slot_size), "HostTier")
        self._copies = InflightCopies()
        self._released = False
        self._allocation_waits = 0  # allocate calls that waited for the fill; on the loop only
        self._allocation_wait_seconds = 0.0

    # -- lifecycle -------------------------------------------------------------

    @classmethod
    async def open(cls, config: HostTierConfig | Mapping[str, Any], *, backings: Backings | None = None) -> HostTier:
        """Reserve the range, start the fill, and return without waiting for it.

        :raises pydantic.ValidationError: the config is invalid.
        :raises NumaPolicyError: strict NUMA placement cannot be applied.
        :raises OSError: the range cannot be reserved (ENOMEM: address space or ``RLIMIT_AS``).
        :raises FillError: no fill thread could start.
        :raises MemoryError: the slot map does not fit.
        :raises CudaUnavailableError: a CUDA backing was asked for without a usable driver.
        :raises TierClosedError: ``aclose()`` was called while it opened.

        On any failure or cancellation, whatever was built is released
        before the error (or the cancellation) reaches the caller.
        """
        tier = cls(config, backings=backings)
        await tier._open()
        return tier

    async def __aenter__(self) -> Self:
        await self._open()
        return self

    async def _open(self) -> None:
        if self._life.state == "new":  # a refused second open must not adopt its loop
            self._loop = asyncio.get_running_loop()
        await self._life.open(self._build, self._teardown)
        s = self.statistics()
        log.info(
            "aiokvtier: HostTier open: quota %d bytes of %d reserved at %#x, backing %s, NUMA node %s (%s)",
            s.quota,
            s.max_quota,
            s.base_address,
            s.backing,
            s.numa_node,
            s.numa_policy,
        )

    async def _build(self) -> None:
        life, cfg = self._life, self._config.resolved
        self._slot_size = slot = cfg.slot_size
        self._quota = cfg.quota
        self._node = node = await life.run(self._backings.numa_node, cfg)
        self._backing = backing = await life.run(self._backings.make, cfg, node)
        life.undo.callback(life.release_when_unviewed, self._views.defer_until_empty, self._release)
        self._base = backing.base
        self._layout = layout = UnitLayout.build(backing.size, slot, cfg.commit_unit)
        self._slots = SlotAllocator(self._quota // slot)
        cpus = node_cpus_or_none(node)
        threads = cfg.fill_threads if self._config.fill_threads is not None else default_fill_threads(cpus)
        self._fill_threads = threads
        self._filler = filler = Filler(
            backing,
            layout,
            threads=threads,
            fill_chunk=cfg.fill_chunk,
            cpus=cpus,
            on_change=self._notify,
        )
        life.undo.callback(filler.close)  # LIFO: the fill stops before the range goes
        self._waiters = LoopWaiters(self._loop, filler.ready, self._settled)
        _regions.register(self)
        life.undo.callback(_regions.unregister, self)
        await life.run(filler.set_target, layout.units_for(self._slots.total * slot))
        self._handoff = handoff(self._loop)
        self._handoff.add_source(self._filling)  # removed by the teardown, on the loop
        self._handoff.start()

    def _filling(self) -> bool:
        filler = self._filler
        return not (filler.closed or filler.complete or filler.error is not None)

    async def _teardown(self) -> None:
        hand = self.__dict__.get("_handoff")
        if hand is not None:
            hand.discard_source(self._filling)
        # Under the resize lock: an accepted resize finishes before the range goes.
        async with self._resize_lock:
            waiters = self.__dict__.get("_waiters")
            if waiters is not None:
                waiters.kick()  # waiters re-read the state and see the close
            await self._life.run(InflightCopies.wait, self._copies.snapshot())
            await self._life.run_undo()
        if "_base" in self.__dict__:
            log.info("aiokvtier: HostTier at %#x closed", self._base)

    def _notify(self) -> None:
        self._waiters.notify()

    def _settled(self) -> bool:
        filler = self._filler
        return filler.closed or filler.error is not None

    async def aclose(self) -> None:
        """Stop the fill between units, join its threads and release the range. Idempotent.

        Waits for an accepted resize and for copies in flight over the tier.
        If views of slots are still exported, the range is unmapped when the
        last one is released (it stays valid memory until then), on the
        tier's thread. Cancelling ``aclose`` does not interrupt the teardown:
        the cancellation is delivered once it is complete. Concurrent calls
        wait for the same teardown.

        :raises RuntimeError: called on another event loop than the tier's while that loop runs
            (nothing changes): the teardown wakes that loop's waiters. Once the tier's loop has
            ended, any loop may close it.
        """
        if self._life.state == "open" and not self._loop_thread() and self._loop.is_running():
            raise RuntimeError(
                "this HostTier belongs to the event loop that opened it, which is running in another thread: "
                "close it there (asyncio.run_coroutine_threadsafe(tier.aclose(), loop)); nothing changed"
            )
        await self._life.close(self._teardown)

    def _release(self) -> None:
        filler: Filler | None = self.__dict__.get("_filler")  # None: the open failed before the fill existed
        try:
            self._backing.release([] if filler is None else filler.committed_ranges())
        finally:
            self._released = True

    @property
    def released(self) -> bool:
        """Whether the range has been given back (after close and the last view)."""
        return self._released

    # -- allocation ------------------------------------------------------------

    @overload
    async def allocate(self) -> int: ...
    @overload
    async def allocate(self, n: int) -> list[int]: ...
    async def allocate(self, n: int | None = None) -> int | list[int]:
        """Allocate one slot (``allocate()``) or ``n`` slots (``allocate(n)``).

        Waits only for the unit holding the highest fresh slot it takes.

        :raises OutOfSlots: the quota does not have that many slots free.
        :raises FillError: the fill failed below those slots.
        :raises TierClosedError: the tier is not open (new, closing or closed).
        :raises ValueError: ``n`` is below 1.
        :raises TypeError: ``n`` is not an integer (a bool or a float).
        :raises RuntimeError: called from a loop other than the tier's.

        Cancellation: slots are taken only once they are resident, so a
        cancelled call has taken none.
        """
        ids = await self.allocate_ids(1 if n is None else n)
        if n is None:
            return int(ids[0])
        taken: list[int] = ids.tolist()
        return taken

    async def allocate_many(self, n: int) -> list[int]:
        """Same as ``allocate(n)``."""
        taken: list[int] = (await self.allocate_ids(n)).tolist()
        return taken

    async def allocate_ids(self, n: int) -> npt.NDArray[np.int64]:
        """``allocate(n)`` as an int64 array (what copies and stores index with)."""
        n = positive_count(n, "n")
        self._check_open()
        self._check_loop()
        waiting_since: float | None = None
        try:
            while True:
                self._check_open()
                slots = self._slots
                if n > slots.available:
                    raise OutOfSlots(f"{n} slots requested, {slots.available} of {slots.total} available")
                need = slots.fresh_needed(n) * self._slot_size
                filler = self._filler
                if filler.watermark >= need:
                    return slots.take_ids(n)
                if filler.ready(need):
                    filler.ready(need, raise_=True)
                if waiting_since is None:
                    waiting_since = time.perf_counter()
                await self._waiters.wait(need)
        finally:
            # A wait that ended in an error or a cancellation was still a wait for the fill.
            if waiting_since is not None:
                self._allocation_waits += 1
                self._allocation_wait_seconds += time.perf_counter() - waiting_since

    def slots_held_past(self, total: int) -> npt.NDArray[np.int64]:
        """Slots at or past ``total`` that are allocated or viewed: what a shrink to ``total`` slots refuses."""
        self._check_open()
        held = self._slots.allocated_past(total)
        viewed = [s for s in self._views.live() if s >= total]
        return np.union1d(held, np.asarray(viewed, dtype=np.int64)).astype(np.int64)

    def allocate_nowait(self) -> int:
        """Allocate one slot without waiting.

        :raises WouldBlock: the next fresh slot is not resident yet.
        :raises OutOfSlots: every slot of the quota is allocated.
        :raises FillError: the fill failed below the next fresh slot.
        """
        if self._life.state != "open":
            self._check_open()
        slots = self._slots
        if slots.freed or (slots.next_fresh + 1) * self._slot_size <= self._filler.watermark:
            return slots.take_one()
        if slots.next_fresh >= slots.total:
            raise OutOfSlots(f"all {slots.total} slots are allocated")
        need = (slots.next_fresh + 1) * self._slot_size
        self._filler.ready(need, raise_=True)
        raise WouldBlock(f"slot {slots.next_fresh} is not resident yet ({self._filler.watermark} bytes are)")

    def free(self, slot: int) -> None:
        """Return a slot.

        :raises SlotError: not an allocated slot of this tier (nothing changes).
        """
        if self._life.state != "open":
            self._check_open()
        self._slots.give(slot)

    def free_many(self, slots: Iterable[int]) -> None:
        """Return several slots, all or none.

        :raises SlotError: any is invalid or repeated.
        """
        self._check_open()
        self._slots.give_many(slots)

    # -- memory ------------------------------------------------------------------

    def address(self, slot: int) -> int:
        """Address of an allocated slot.

        :raises SlotError: not allocated.
        """
        self._check_open()
        self._slots.check_allocated(slot)
        return self._base + slot * self._slot_size

    def view(self, slot: int) -> memoryview:
        """A writable ``slot_size``-byte view of an allocated slot.

        The view keeps the memory mapped: a shrink past a viewed slot is
        refused, and close defers unmapping until every view is released.

        :raises SlotError: not allocated.
        """
        address = self.address(slot)
        return self._views.view(slot, address)

    @property
    def base_address(self) -> int:
        self._check_open()
        return self._base

    @property
    def slots_total(self) -> int:
        """Slots the quota holds (0 before open)."""
        return self._slots.total if "_slots" in self.__dict__ else 0

    @property
    def slots_free(self) -> int:
        """Slots that can be allocated now, resident or not (0 before open)."""
        return self._slots.available if "_slots" in self.__dict__ else 0

    @property
    def slots_ready(self) -> int:
        """Slots that can be allocated without waiting for the fill: freed ones and fresh resident ones."""
        if "_slots" not in self.__dict__:
            return 0
        slots = self._slots
        resident = min(slots.total, self._filler.watermark // self._slot_size)
        return slots.freed + max(0, resident - slots.next_fresh)

    @property
    def slot_size(self) -> int:
        return self._config.resolved.slot_size

    @property
    def config(self) -> HostTierConfig:
        return self._config

    # -- residency ---------------------------------------------------------------

    def _wait_target(self, nbytes: int | None) -> int:
        """What a waiter waits for, read again at every wake-up (a shrink can move it).

        :raises ValueError: ``nbytes`` is past the (current) quota.
        """
        if nbytes is None:
            return self._filler.target_bytes
        if nbytes > self._quota:
            raise ValueError(f"nbytes ({nbytes}) must be between 0 and the quota ({self._quota})")
        return nbytes

    @staticmethod
    def _byte_count(nbytes: object) -> int | None:
        """:raises TypeError: not an integer (bools and floats refused). :raises ValueError: negative."""
        if nbytes is None:
            return None
        if isinstance(nbytes, bool):
            raise TypeError(f"nbytes must be an integer, not a bool ({nbytes!r})")
        try:
            count = operator.index(nbytes)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"nbytes must be an integer or None, got {nbytes!r}") from None
        if count < 0:
            raise ValueError(f"nbytes ({count}) must be between 0 and the quota")
        return count

    def _check_loop(self) -> None:
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("this HostTier belongs to the event loop that opened it; call it from that loop")

    async def wait_resident(self, nbytes: int | None = None) -> None:
        """Wait until ``nbytes`` (None: the whole quota) are resident.

        :raises ValueError: ``nbytes`` is past the quota.
        :raises FillError: the fill failed below ``nbytes``.
        :raises TierClosedError: the tier closed first.
        """
        self._check_open()
        self._check_loop()
        count = self._byte_count(nbytes)
        while True:
            self._check_open()
            need = self._wait_target(count)
            if self._filler.ready(need, raise_=True):
                return
            await self._waiters.wait(need)

    def wait_resident_blocking(self, nbytes: int | None = None, timeout: float | None = None) -> None:
        """Block the calling thread (not the loop's) until ``nbytes`` are resident.

        :raises RuntimeError: called from the tier's event loop thread.
        :raises TimeoutError: ``timeout`` seconds passed first.
        :raises FillError: the fill failed below ``nbytes``.
        :raises TierClosedError: the tier closed first.
        """
        if self._loop_thread():
            raise RuntimeError("wait_resident_blocking would block the event loop; use await wait_resident()")
        self._check_open()
        count = self._byte_count(nbytes)
        self._wait_target(count)  # a bad size fails before waiting
        self._filler.wait_blocking(lambda: self._wait_target(count), timeout)

    def _loop_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    async def resize(self, new_quota: int | str) -> None:
        """Grow or shrink the quota inside the reservation; the base never moves.

        A grow continues the fill. A shrink waits for copies in flight over
        the tier, hands whole commit units back and keeps the contents of
        retained slots; it clears a fill error if the new end is at or below
        the resident prefix. ``new_quota`` is rounded down to whole slots.
        A resize to the current quota does nothing, except where a failed
        shrink left units committed: then it is a shrink, and tries them again.

        :raises QuotaError: past ``max_quota``, below one slot, or a slot
            past the new end is allocated or viewed (nothing changes).
        :raises FillError: a grow found no fill thread running and could not
            start one (nothing changes; a later grow tries again).
        :raises TierClosedError: the tier is closed.
        :raises DecommitError: a shrink could not decommit some units of the
            tail (``madvise`` refuses pages the application locked with
            ``mlock``, for one; the first error is the ``__cause__``). The
            shrink stands; every other unit of the tail was handed back, and
            those listed in ``DecommitError.committed`` stay committed
            (``statistics().stranded_bytes``). They are released at close; a
            later shrink (or resize to the same quota) tries them again; a
            later grow over them reuses them: the fill makes resident again
            whatever page the failed call discarded, and the watermark passes
            them like any unit it commits (if that fails, the grow's waiters
            get a ``FillError``, as for any unit).

        Cancellation: while waiting for another resize, nothing has changed;
        once accepted, the resize runs to the end and the cancellation is
        delivered after, with quota, fill target and residency consistent.
        """
        self._check_open()
        self._check_loop()
        quota = self._parse_quota(new_quota)
        async with self._resize_lock:
            self._check_open()
            total = quota // self._slot_size
            slots = self._slots
            # The same quota again is a shrink while a failed one left units committed: it retries them.
            if total < slots.total or (total == slots.total and self._filler.stranded_bytes):
                highest = max(slots.highest_allocated(), self._views.highest())
                if highest >= total:
                    raise QuotaError(
                        f"cannot shrink to {quota} bytes ({total} slots): slot {highest} past the new end "
                        "is allocated or has a live view"
                    )
                # Accepted: from here no slot past the new end can be taken, before any await.
                slots.resize(total)  # MemoryError here changes nothing
                old_quota, self._quota = self._quota, quota
                await finish(self._apply_shrink(old_quota, quota, total))
            else:
                await finish(self._apply_grow(quota, total))

    async def _apply_grow(self, quota: int, total: int) -> None:
        """The accepted part of a grow: runs to the end whatever happens to its caller."""
        life, filler, layout, slots = self._life, self._filler, self._layout, self._slots
        old_quota, old_units = self._quota, layout.units_for(slots.total * self._slot_size)
        try:
            await life.run(filler.set_target, layout.units_for(total * self._slot_size))
            if self._life.state == "open":
                self._handoff.start()
            try:
                slots.resize(total)  # only once the fill covers the new slots
            except BaseException:
                # MemoryError for the slot map: take the fill back, so a failed grow changes nothing.
                tail = await life.run(filler.set_target, old_units)
                if tail is not None:
                    try:
                        await life.run(self._decommit_tail, old_units, tail)
                    except DecommitError as exc:
                        log.warning("aiokvtier: taking a failed grow back: %s", exc)
                raise
            self._quota = quota
        finally:
            self._waiters.kick()
        log.info("aiokvtier: HostTier at %#x resized: quota %d -> %d bytes", self._base, old_quota, quota)

    async def _apply_shrink(self, old_quota: int, quota: int, total: int) -> None:
        """The rest of an accepted shrink (slots and quota already cut): runs to the end, whatever its caller does."""
        life, filler = self._life, self._filler
        units = self._layout.units_for(total * self._slot_size)
        try:
            # The tail is off limits already (no slot there, and the planner refuses raw copies
            # past the slots): wait for the copies in flight, then let the fill stop there.
            await life.run(InflightCopies.wait, self._copies.snapshot())
            tail = await life.run(filler.set_target, units)
            if tail is not None:
                await life.run(self._decommit_tail, units, tail)
        finally:
            self._waiters.kick()
        log.info("aiokvtier: HostTier at %#x resized: quota %d -> %d bytes", self._base, old_quota, quota)

    def _decommit_tail(self, units: int, tail: list[tuple[int, int]]) -> None:
        """Decommit every unit of ``tail``, each whatever happened to the others.

        :raises DecommitError: some could not be decommitted (they are stranded).
        """
        done: list[tuple[int, int]] = []
        failed: list[tuple[int, int]] = []
        first: Exception | None = None
        try:
            for offset, length in tail:
                try:
                    self._backing.decommit(offset, length)
                except Exception as exc:
                    failed.append((offset, length))
                    first = first or exc
                else:
                    done.append((offset, length))
        finally:
            self._filler.finish_shrink(units, done)
        if first is not None:
            error = self._decommit_error(units, len(tail), failed, first)
            log.error("aiokvtier: %s", error)
            raise error from first

    def _decommit_error(self, units: int, count: int, failed: list[tuple[int, int]], cause: Exception) -> DecommitError:
        runs: list[tuple[int, int]] = []
        for offset, length in failed:
            if runs and sum(runs[-1]) == offset:
                runs[-1] = (runs[-1][0], runs[-1][1] + length)
            else:
                runs.append((offset, length))
        where = ", ".join(f"+{offset}..+{offset + length}" for offset, length in runs)
        held = format_bytes(sum(length for _, length in failed))
        hint = ""
        if isinstance(cause, OSError) and cause.errno == errno.EINVAL:
            hint = " (madvise refuses memory locked with mlock or mlockall: munlock it, then resize again)"
        return DecommitError(
            f"{self.region_name}: the tail past +{self._layout.start(units)} could not be decommitted: "
            f"{len(failed)} of its {count} unit(s), bytes {where} ({held}), stay committed: {cause}{hint}. "
            f"The shrink to {self._quota} bytes stands; those units are released at close, a later shrink "
            "tries them again, and a later grow over them reuses them",
            committed=tuple(runs),
        )

    def _parse_quota(self, value: int | str) -> int:
        return parse_quota(value, slot_size=self._slot_size, max_quota=self._config.resolved.max_quota)

    # -- a copy region (see aiokvtier._regions) ---------------------------------------

    @property
    def copies(self) -> InflightCopies:
        return self._copies

    def slot_addresses(self, slots: Iterable[int] | npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.uint64]:
        """Host addresses of allocated slots, in the order given (a copy's tier side).

        :raises SlotError: an id is not an allocated slot.
        :raises TierClosedError: the tier is not open.
        """
        self._check_open()
        ids = self._slots.checked_ids(slots)
        return np.uint64(self._base) + ids.astype(np.uint64) * np.uint64(self._slot_size)

    def slot_address_list(self, slots: object) -> list[int] | None:
        """``slot_addresses()`` as ints, for a request's few allocated ids given as a list or tuple of
        ints (``FEW_IDS`` at most); None for anything else, which ``slot_addresses()`` checks.

        :raises TierClosedError: the tier is not open.
        """
        self._check_open()
        ids = self._slots.few_checked(slots)
        if ids is None:
            return None
        return list(map(self._base.__add__, map(self._slot_size.__mul__, ids)))  # in C: no Python step per id

    def registrations_at(self, addresses: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        """The registration (commit unit) holding each address of this tier (the planner never merges across)."""
        return self._layout.units_at(addresses - np.uint64(self._base))

    @property
    def region_name(self) -> str:
        return f"HostTier at {self._base:#x}"

    def region_bounds(self) -> tuple[int, int]:
        return self._base, self._backing.size

    def registrations_of(self, offsets: U64, nbytes: U64) -> I64:
        if self._life.state != "open":  # closing: the range is about to go, whatever is in flight
            raise CopyPlanError(f"{self.region_name} is {self._life.state}")
        layout = self._layout
        units = layout.units_at(offsets)
        ends = offsets + nbytes
        cross = np.flatnonzero(ends > layout.ends_of(units))
        if cross.size:
            i = int(cross[0])
            unit = int(units[i])
            raise CopyPlanError(
                f"copy of {int(nbytes[i])} bytes at +{int(offsets[i])} spans two registrations (unit {unit} ends "
                f"at +{layout.end(unit)}); the driver would refuse it"
            )
        limit = min(self._filler.watermark, self._slots.total * self._slot_size)
        over = np.flatnonzero(ends > np.uint64(limit))
        if over.size:
            i = int(over[0])
            raise CopyPlanError(
                f"copy of {int(nbytes[i])} bytes at +{int(offsets[i])} leaves the committed range ({limit} bytes)"
            )
        return units

    # -- introspection -------------------------------------------------------------

    def placement(self) -> Placement:
        """Pages per NUMA node and the policy of the range, from /proc/self/numa_maps."""
        self._check_open()
        return read_placement(self._base, self._backing.size)

    def statistics(self) -> TierStatistics:
        """A snapshot of the live figures (any thread).

        :raises TierClosedError: the tier is new or still opening (or its open failed early).
        """
        state = self._life.state  # read once: on another thread the open may complete meanwhile
        if state in ("new", "opening") or "_filler" not in self.__dict__:
            raise TierClosedError(self._life.describe(state))
        cfg = self._config.resolved
        filler = self._filler
        slots = self._slots
        # Each read once, from which the rest follows: the loop changes them while another thread
        # reads, and a snapshot's slots must add up and fill its quota (a resize sets both in turn).
        total, allocated = slots.total, slots.count
        error = filler.error
        return TierStatistics(
            backing=self._backing.name,
            device=cfg.device,
            quota=total * self._slot_size,
            max_quota=cfg.max_quota,
            base_address=self._base,
            resident_bytes=filler.watermark,
            target_bytes=filler.target_bytes,
            registered_bytes=self._backing.registered_bytes,
            slot_size=self._slot_size,
            commit_unit=cfg.commit_unit,
            fill_chunk=cfg.fill_chunk,
            fill_threads=self._fill_threads,
            slots_total=total,
            slots_allocated=allocated,
            slots_free=total - allocated,
            views_exported=self._views.count(),
            filling=not filler.complete and error is None and not filler.closed,
            fill_seconds=filler.fill_seconds,
            fill_error=None if error is None else f"{error} (cause: {error.__cause__!r})",
            stranded_bytes=filler.stranded_bytes,
            numa_node=self._node,
            numa_policy=self._backing.numa_policy,
            numa_warning=self._backing.numa_warning or filler.affinity_warning,
            transparent_huge_pages=cfg.transparent_huge_pages,
            closed=self.closed,
            allocation_waits=self._allocation_waits,
            allocation_wait_seconds=self._allocation_wait_seconds,
            huge_page_units=self._backing.huge_page_units,
            huge_pages_given_up=self._backing.huge_pages_given_up,
            fill_method=self._backing.fill_method,
        )

    def __repr__(self) -> str:
        if self._life.state in ("new", "opening") or "_filler" not in self.__dict__:
            return f"<HostTier [{self._life.state} | quota {self._config.quota.human_readable()}]>"
        s = self.statistics()
        gib = 1 << 30
        state = "closed" if s.closed else "failed" if s.fill_error else "filling" if s.filling else "resident"
        return (
            f"<HostTier [{state} | {s.backing} | resident {s.resident_bytes / gib:.2f}/"
            f"{s.target_bytes / gib:.2f} GiB (max {s.max_quota / gib:.2f}) | slots {s.slots_allocated}/"
            f"{s.slots_total} allocated | views {s.views_exported}]>"
        )
