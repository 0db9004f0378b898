"""CopyEngine: batched, awaited copies between tier slots and GPU memory.

Planning runs on the caller's loop (numpy, no per-copy Python objects);
requests made while a GPU engine is busy are planned at the end of the
loop's turn, all of that turn's at once (``_defer()``). The engine's
submit thread hands each planned job to its backend
(``aiokvtier._copy._backend``): with a device, ``cuMemcpyBatchAsync`` called
through ctypes with plain arrays or the SM kernel, on the engine's own
non-default streams, an event recorded per job. One completion thread waits
for the jobs in order (blocking sync: it sleeps, nobody polls) and resolves
the awaiting futures on their loops, many per wake-up. No Python callback
ever runs inside the driver.

Without a device the same engine copies host to host with ``memmove`` on
its submit thread, so the planner, the cap and the errors are exercised on
any machine; ``aiokvtier.testing.RecordingBackend`` exercises the
completion path too.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import operator
import queue
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, Self

import numpy as np

from .._crossing import Outcome, deliver
from .._cuda._batch import DEFAULT_MAX_BATCH
from .._cuda._crossover import Crossover
from .._cuda._kernel import DEFAULT_SM_BUDGET
from .._cuda._sm import METHODS, SmOptions
from .._errors import CopyPlanError
from .._handoff import handoff
from .._host._slots import positive_count
from .._lifecycle import Lifecycle, Owner
from .._regions import Landing, epoch
from ._backend import CopyBackend, HostBackend
from ._plan import PIECES_FROM, Pieces, Plan, plan
from ._requests import (
    InPieces,
    Pages,
    buffer_addresses,
    check_again,
    check_disjoint,
    copy_table,
    plan_side,
    plan_slots,
    plan_slots_many,
    registrations,
    relocate,
)
from ._requests import stream_handle as _stream_handle

if TYPE_CHECKING:
    from .._host._tier import HostTier

__all__ = ["CopyEngine", "CopyStatistics", "Pages", "StartedCopy"]


class _Landed(asyncio.Future[None]):
    """A copy's completion: settled only by the engine, never cancelled.

    A task cancelled while it awaits one stays suspended until the copy has
    landed and then receives the cancellation (the task's ``cancel()`` finds
    a waiter that refuses it): the buffers are the GPU's until then. One
    future and no shield, so the wake-up costs one loop iteration.
    """

    def cancel(self, msg: Any = None) -> bool:
        return False


class _Waiting(_Landed):
    """A request made while the engine was busy (``CopyEngine._defer()``): never cancelled either,
    so a cancelled caller resumes once its copy landed, as any caller does."""

    queued = False
    """The copy was queued: the engine settles the future once it landed."""


@dataclass(eq=False, slots=True)
class _Deferred:
    """A request made while the engine was busy, planned with the others of its loop's turn."""

    tier: HostTier
    slots: Any
    buffer: Any
    direction: str
    page: int | None
    future: _Waiting


@dataclass(eq=False)
class _Job:
    plan: Plan | Pieces
    direction: str
    after: Any
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    keepalive: tuple[Any, ...]
    done: Landing = field(default_factory=Landing)
    error: BaseException | None = None
    submitted: float = 0.0
    """``time.perf_counter()`` when it was queued."""
    on_submit: asyncio.Future[None] | None = None
    """Settled once the submit thread has issued the copy (or failed to): see ``CopyEngine.begin()``."""


class StartedCopy(NamedTuple):
    """A queued slot copy (``CopyEngine.begin()``)."""

    submitted: asyncio.Future[None]
    """Settles once the copy was issued to the GPU (or failed to be)."""
    done: asyncio.Future[None]
    """Settles once the bytes landed, or with the copy's error."""


GROUP_BYTES = 8 << 20
"""A backend that coalesces (``CopyBackend.coalesce``) gets jobs queued together as one plan of
up to this many bytes (and ``max_batch`` descriptors): the first job of a group lands with the
last, so the bound keeps what it waits for beyond its own bytes to a fraction of a millisecond."""

_NOTHING = object()
"""No job carried over to the next turn of the submit thread."""

DIRECTIONS = ("h2d", "d2h", "any")
"""``to_device``, ``to_host`` and the raw ``copy``."""

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
"""Upper bounds (seconds) of the copy latency histogram: 0.1 ms to 250 ms, then +Inf."""


def _plus(by: tuple[int, int, int], direction: str, n: int) -> tuple[int, int, int]:
    """``by`` (a figure per direction of ``DIRECTIONS``) with ``n`` added to ``direction``'s."""
    h2d, d2h, raw = by
    if direction == "h2d":
        return (h2d + n, d2h, raw)
    if direction == "d2h":
        return (h2d, d2h + n, raw)
    return (h2d, d2h, raw + n)


class _Queued(NamedTuple):
    """What the loops queued, published whole (``CopyEngine.statistics()``)."""

    jobs: int = 0
    requested: int = 0
    by_direction: tuple[int, int, int] = (0, 0, 0)

    def add(self, direction: str, requested: int) -> _Queued:
        return _Queued(self.jobs + 1, self.requested + requested, _plus(self.by_direction, direction, 1))


class _Issued(NamedTuple):
    """What the submit thread issued, published whole (``CopyEngine.statistics()``)."""

    descriptors: int = 0
    nbytes: int = 0
    coalesced: int = 0
    by_direction: tuple[int, int, int] = (0, 0, 0)
    in_pieces: int = 0

    def add(self, direction: str, planned: Plan, jobs: int) -> _Issued:
        return _Issued(
            self.descriptors + planned.count,
            self.nbytes + planned.nbytes,
            self.coalesced + (jobs if jobs > 1 else 0),
            _plus(self.by_direction, direction, planned.nbytes),
            self.in_pieces,
        )

    def one_in_pieces(self) -> _Issued:
        """A request whose pieces the submit thread starts to plan (counted also if its first fails)."""
        return self._replace(in_pieces=self.in_pieces + 1)


class _InPieces(NamedTuple):
    """The handles of a request issued in pieces (``Pieces``), in issue order: it has landed once all
    of them have, and one that failed to issue still waits for the pieces issued before it."""

    handles: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class CopyStatistics:
    device: int | None
    streams: int
    max_batch: int
    jobs_submitted: int
    jobs_completed: int
    copies_requested: int
    descriptors_submitted: int
    driver_calls: int
    bytes_copied: int
    batch_abi: int | None
    """The cuMemcpyBatchAsync ABI in use (13000 or 12080); None without a device."""
    jobs_by_direction: dict[str, int] = field(hash=False)
    """Copy calls submitted per direction: ``"h2d"`` (to_device), ``"d2h"`` (to_host), ``"any"`` (copy)."""
    bytes_by_direction: dict[str, int] = field(hash=False)
    """Bytes handed to the driver (or to memmove) per direction."""
    latency_buckets: tuple[tuple[float, int], ...]
    """Completed copy calls whose latency (submission to completion) was at most each bound,
    in seconds, cumulative; the last bound is ``inf``."""
    latency_sum_seconds: float
    latency_count: int
    method: str = "dma"
    """What the engine was asked for: ``"auto"``, ``"dma"`` or ``"sm"``."""
    sm_budget: int | None = None
    """SMs (blocks) per kernel launch; None where the SM path is not in use."""
    sm_unavailable: str | None = None
    """Why ``"auto"`` copies through the copy engines only (the kernel did not compile or load)."""
    sm_crossover_bytes: dict[str, int] = field(default_factory=dict, hash=False)
    """Per direction, the largest page size (of a 4096-page request) sent to the kernel; 0: none."""
    jobs_by_method: dict[str, int] = field(default_factory=lambda: {"dma": 0, "sm": 0}, hash=False)
    """Copy calls per path: ``"dma"`` (the copy engines) and ``"sm"`` (the kernel)."""
    bytes_by_method: dict[str, int] = field(default_factory=lambda: {"dma": 0, "sm": 0}, hash=False)
    """Bytes each path moved."""
    jobs_coalesced: int = 0
    """Copy calls issued together with others as one plan (queued behind a busy submit thread,
    on a backend that coalesces: a GPU's)."""
    jobs_in_pieces: int = 0
    """Copy calls planned and issued piece by piece on the submit thread (``pieces_from``)."""


class CopyEngine(Owner):
    """Moves KV pages between tier slots and GPU memory in batched, awaited copies.

    :param device: CUDA ordinal, or None for host-to-host copies on a worker thread.
    :param streams: the engine's own non-default streams, used round-robin per call.
    :param max_batch: descriptors per driver call; larger plans are split.
    :param method: ``"auto"`` (default): per request, whichever the device's measured
        crossover predicts is faster for its page size, count and direction;
        ``"dma"``: always the copy engines (``cuMemcpyBatchAsync``), which take no SMs
        from the model; ``"sm"``: always the kernel that reads and writes the tier's host
        memory directly (docs/gpu.md). If the kernel cannot be built, ``"auto"`` copies
        with the copy engines (one warning) and ``"sm"`` fails to open. Without a device,
        every method is ``"dma"`` (``memmove``).
    :param sm_budget: SMs a launch of the kernel occupies (blocks per launch); a request runs
        as launches of at most 8 MiB, so a model kernel waits for one slice, not the request.
        Where slices launch as programmatic dependents (compute capability 9.0+), the next
        slice's blocks may start on other SMs while one drains.
    :param crossover: a ``Crossover``, or ``{"h2d": bytes, "d2h": bytes}`` (the kernel
        for mean page sizes up to so many bytes); default: ``AIOKVTIER_SM_CROSSOVER``, else
        measured once per device and kept on disk.
    :param sm_options: how the kernel launches a request (``SmOptions``: slice size, descriptor
        packing, programmatic launches...); default: the measured best.
    :param backend: what issues the planned copies and waits for them; default: ``memmove``
        without a device, else the copy engines and the kernel as ``method`` says. A test
        passes ``aiokvtier.testing.RecordingBackend`` to see (and hold) every planned job
        without a GPU. ``method``, ``sm_budget``, ``crossover`` and ``sm_options``
        configure the default backend only.
    :param pieces_from: a request of at least this many pages (``to_device``, ``to_host``,
        ``begin``, ``start``; without ``after=``) that the SM kernel copies is checked whole
        when it is made, then planned and issued in pieces (4,096 pages, each piece half as
        large again as the last, up to 8,192) by the submit thread, so the GPU copies one
        piece while the next is planned; its caller still awaits one copy, settled once
        every piece landed. None: every request planned whole on the caller's loop. The
        copy engines' requests (``"dma"``) and a host-only engine's (``memmove``) are
        always planned whole: their issue is the copy's pace already.

    For a store or an integration that copies subsets of one buffer:
    ``pages = engine.pages(buffer, n, writable=True)`` checks the buffer once,
    and ``engine.start(tier, slots, pages.take(ids), "h2d")`` queues a copy
    of those pages without checking them again (``StartedCopy``).

    Order: copies of requests in flight at once are not ordered with one
    another (they run on the engine's streams in turn, and requests queued
    together may go as one batch): a request that must follow another awaits
    it, or passes ``after=``.

    Cancellation: cancelling a task that awaits a copy does not cancel the
    copy. The engine keeps the buffers it was given (tensors, the tier)
    referenced until the GPU has finished with them, and closing a tier or
    a StaticHostMem waits for copies in flight against it.
    """

    def __init__(
        self,
        device: int | None,
        *,
        streams: int = 2,
        max_batch: int = DEFAULT_MAX_BATCH,
        method: str = "auto",
        sm_budget: int = DEFAULT_SM_BUDGET,
        crossover: Crossover | Mapping[str, int] | None = None,
        sm_options: SmOptions | None = None,
        backend: CopyBackend | None = None,
        pieces_from: int | None = PIECES_FROM,
    ) -> None:
        if device is not None and (type(device) is not int or device < 0):
            raise ValueError(f"device must be a CUDA ordinal or None, got {device!r}")
        if type(streams) is not int or streams < 1:
            raise ValueError(f"streams must be a positive int, got {streams!r}")
        if type(max_batch) is not int or not 1 <= max_batch <= 1 << 20:
            raise ValueError(f"max_batch must be between 1 and 2**20, got {max_batch!r}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if method == "sm" and device is None:
            raise ValueError("method='sm' needs a CUDA device; this engine copies host to host")
        if type(sm_budget) is not int or not 1 <= sm_budget <= 1024:
            raise ValueError(f"sm_budget must be an int between 1 and 1024, got {sm_budget!r}")
        if crossover is not None and not isinstance(crossover, Crossover):
            crossover = Crossover.fixed(crossover)
        if sm_options is not None and not isinstance(sm_options, SmOptions):
            raise TypeError(f"sm_options must be an SmOptions, not {type(sm_options).__name__}")
        if pieces_from is not None and (type(pieces_from) is not int or pieces_from < 2):
            raise ValueError(f"pieces_from must be an int of at least 2, or None; got {pieces_from!r}")
        if backend is None:
            backend = _default_backend(device, streams, method, sm_budget, crossover, sm_options)
        elif not isinstance(backend, CopyBackend):
            raise TypeError(f"backend must be a CopyBackend, not {type(backend).__name__}")
        elif (method, sm_budget, crossover, sm_options) != ("auto", DEFAULT_SM_BUDGET, None, None):
            raise ValueError(
                "method, sm_budget, crossover and sm_options configure the default backend; give them to yours"
            )
        self.device = device
        self._backend = backend
        # A synchronous backend copies as it issues: nothing to plan the next piece beside.
        self._pieces_from = None if backend.synchronous else pieces_from
        self.method = backend.method
        self.max_batch = max_batch
        self._n_streams = streams
        self._life = Lifecycle("CopyEngine", "aiokvtier-copy")
        self._submit_q: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._done_q: queue.SimpleQueue[tuple[tuple[_Job, ...], Any] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        # A reader of statistics() on any thread sees each group of figures of one moment, without a
        # lock (none that a fork could leave held in the child, where statistics() is allowed): each
        # group is published as one tuple, by the loops (under ``_loop_side``, which the close takes
        # too) for what they queue, by the submit thread for what it issues, and by the thread that
        # settles the copies for the latency histogram.
        self._loop_side = threading.Lock()
        self._queued = _Queued()
        self._issued = _Issued()
        self._completed = 0
        self._latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self._latency_sum = 0.0
        self._latency: tuple[tuple[int, ...], float] = (tuple(self._latency_counts), 0.0)
        self._pending: dict[asyncio.AbstractEventLoop, list[_Deferred]] = {}
        """Per loop, the requests made during its current turn while the engine was busy (``_defer()``)."""

    # -- lifecycle ------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Start the engine's threads (and, with a device, its context and streams).

        :raises CudaUnavailableError: a device was asked for without a usable driver.
        :raises CudaError: the driver refused a stream or has no ``cuMemcpyBatchAsync``.
        :raises RuntimeError: opened twice, or its threads cannot start.
        :raises TierClosedError: ``aclose()`` was called while it opened.
        """
        return await super().__aenter__()

    @classmethod
    async def open(cls, device: int | None, **kwargs: Any) -> CopyEngine:
        engine = cls(device, **kwargs)
        return await engine.__aenter__()

    async def _build(self) -> None:
        await self._life.run(self._start)
        self._life.undo.callback(self._join)

    async def _teardown(self) -> None:
        await self._life.run_undo()

    def _start(self) -> None:
        """On the engine's worker: the backend, then the two threads; undoes itself on failure."""
        with ExitStack() as undo:
            self._backend.open(self.max_batch)
            undo.callback(self._backend.close)
            submit = threading.Thread(target=self._submit_loop, name="aiokvtier-copy-submit", daemon=True)
            complete = threading.Thread(target=self._complete_loop, name="aiokvtier-copy-complete", daemon=True)
            submit.start()
            self._threads.append(submit)
            undo.callback(self._join_threads)
            complete.start()
            self._threads.append(complete)
            undo.pop_all()

    def _join_threads(self) -> None:
        with self._loop_side:  # after every copy queued by a call that found the engine open (``_enqueue``)
            self._submit_q.put(None)
        for thread in self._threads:
            thread.join()
        if len(self._threads) == 1:
            self._done_q.get()  # the submit thread's stop signal, meant for a completion thread that never started

    async def aclose(self) -> None:
        """Let queued copies finish, then stop the threads and free the streams. Idempotent.

        Cancelling it does not interrupt the teardown: the cancellation is
        delivered once the engine is closed.
        """
        if self._life.state == "open":  # not in a forked child, which has no running loop (and no requests)
            self._flush(asyncio.get_running_loop())  # what this loop asked for before the close is queued ahead of it
        await self._life.close(self._teardown)

    def _join(self) -> None:
        self._join_threads()
        self._backend.close()

    # -- public copies ----------------------------------------------------------------

    async def to_device(
        self, tier: HostTier, slots: Sequence[int] | Any, dst: Any, *, after: Any = None, page: int | None = None
    ) -> None:
        """Copy slots to device memory: ``dst`` is one address per slot, or an array
        (``__cuda_array_interface__``) with one page per slot. Returns once the bytes landed.

        ``page``: bytes per slot copied when ``dst`` is addresses (default: the
        slot size); an array's page is its row. Neither may exceed the slot.

        :raises SlotError: a slot is not allocated.
        :raises TierClosedError: the tier is closing or closed.
        :raises CopyPlanError: a page is larger than the slot, a copy would leave the committed
            range or cross a registration, two destinations overlap, or (host-to-host engine) an
            address lies in no open tier or StaticHostMem.
        :raises TypeError: an address or ``page`` is not an integer (bools and floats are refused).
        :raises ValueError: no slots, a ``page`` below one, a read-only, non-contiguous or misshapen ``dst``.
        :raises CudaError: the driver refused the batch.
        """
        if after is None and self._busy(slots):
            await self._deferred(self._defer(tier, slots, dst, "h2d", page))
            return
        since = epoch()
        planned, owners = self._plan_slots(tier, slots, dst, "h2d", page, after)
        await self._enqueue(planned, "h2d", after, (tier, dst), owners, since).future

    async def to_host(
        self, tier: HostTier, slots: Sequence[int] | Any, src: Any, *, after: Any = None, page: int | None = None
    ) -> None:
        """Copy device pages into slots (one address or page per slot); the reverse of ``to_device()``.

        ``after`` (a stream or event) is waited for on the GPU first, so a
        copy can follow the compute that wrote the pages without a host sync.

        Raises as ``to_device()``; a slot given twice is a [``SlotError``][aiokvtier.SlotError].
        """
        if after is None and self._busy(slots):
            await self._deferred(self._defer(tier, slots, src, "d2h", page))
            return
        since = epoch()
        planned, owners = self._plan_slots(tier, slots, src, "d2h", page, after)
        await self._enqueue(planned, "d2h", after, (tier, src), owners, since).future

    def begin(
        self,
        tier: HostTier,
        slots: Sequence[int] | Any,
        buffer: Any,
        direction: str,
        *,
        after: Any = None,
        page: int | None = None,
    ) -> StartedCopy:
        """Queue ``to_device()`` (``direction="h2d"``) or ``to_host()`` (``"d2h"``) without awaiting it.

        For a caller with bookkeeping to do while the copy runs: await
        ``submitted`` (the loop idles meanwhile, so the submit thread gets
        the GIL), do the work while the GPU copies, then await ``done``. The
        buffers are the GPU's until ``done`` settles, also for a cancelled
        caller, which must still wait for it. Checks and raises exactly as
        the awaited methods do, before anything is queued.
        """
        if direction not in ("h2d", "d2h"):
            raise ValueError(f"direction is 'h2d' or 'd2h', not {direction!r}")
        since = epoch()
        planned, owners = self._plan_slots(tier, slots, buffer, direction, page, after)
        job = self._enqueue(planned, direction, after, (tier, buffer), owners, since, signal_submit=True)
        assert job.on_submit is not None
        return StartedCopy(job.on_submit, job.future)

    def pages(self, buffer: Any, count: int, *, page: int | None = None, writable: bool) -> Pages:
        """Check a caller's buffer once, for ``start()``: one address per page, one page size.

        ``buffer`` is what ``to_device()`` and ``to_host()`` take: an array with
        one page per row (``__cuda_array_interface__``, or a host array of two or
        more dimensions) or ``count`` integer addresses, each ``page`` bytes long.
        For a caller that copies subsets of one buffer many times (the
        BlockStore's pages: checked once per call, then ``take()``-n per slot
        found): the checks cost more than the copy's planning. Any thread.

        :param page: bytes per page where ``buffer`` is addresses; an array's page is its row.
        :param writable: the buffer is a destination (``"h2d"``): a read-only one is refused.
        :raises TypeError: an address or ``page`` is not an integer, ``page`` is missing for
            addresses, or ``buffer`` is neither addresses nor an array.
        :raises ValueError: a negative ``count``, a ``page`` below one, or a read-only,
            non-contiguous or misshapen buffer.
        :raises CopyPlanError: a page leaves a tier or StaticHostMem, crosses a registration or
            is not committed; on a host-to-host engine, device memory or an address outside
            every open tier and StaticHostMem.
        """
        if isinstance(count, bool):
            raise TypeError(f"count must be an integer, not a bool ({count!r})")
        n = operator.index(count)
        if n < 0:
            raise ValueError(f"count must not be negative, got {n}")
        size = None if page is None else positive_count(page, "page")
        return buffer_addresses(buffer, n, size, writable=writable, host_only=self.device is None)

    def start(
        self,
        tier: HostTier,
        slots: Sequence[int] | Any,
        pages: Pages,
        direction: str,
        *,
        after: Any = None,
        report_issue: bool = False,
    ) -> StartedCopy:
        """Queue a copy between ``slots`` and ``pages`` (from ``pages()``), one page per slot, unawaited.

        ``direction``: ``"h2d"`` (slots into the pages) or ``"d2h"``. The
        pages' addresses are not checked again; those in a tier or a
        StaticHostMem are located again (the caller may have waited since the
        check, and the region closed or shrunk meanwhile). The slots, the page
        size and ``after`` are checked as in ``begin()``, before anything is
        queued. Loop thread.

        ``report_issue=False`` (default): no crossing back to the loop when the
        copy is issued, for a caller that does not wait for that; ``submitted``
        is then ``done``. The pages are the GPU's until ``done`` settles, also
        for a cancelled caller, which must still wait for it.

        :raises TypeError: ``pages`` does not come from ``pages()``.
        :raises ValueError: a bad direction, a read-only ``pages`` as a destination, no slots,
            or not one page per slot.
        :raises SlotError: a slot is not allocated, or (``"d2h"``) appears twice.
        :raises TierClosedError: the tier is closing or closed.
        :raises CopyPlanError: a page is larger than a slot, a tier or StaticHostMem the pages
            lie in closed or shrank under them, or two destinations overlap.
        """
        if direction not in ("h2d", "d2h"):
            raise ValueError(f"direction is 'h2d' or 'd2h', not {direction!r}")
        if not isinstance(pages, Pages):
            raise TypeError(f"pages come from CopyEngine.pages(), not {type(pages).__name__}")
        if direction == "h2d" and not pages.writable:
            raise ValueError("the pages were checked as a source (writable=False); nothing was copied")
        self._check_device(tier)
        since = epoch()
        located = relocate(pages, host_only=self.device is None)
        in_pieces = self._in_pieces(direction, after)
        planned, owners = plan_side(tier, tier.slot_addresses(slots), located, direction, in_pieces=in_pieces)
        job = self._enqueue(planned, direction, after, (tier, pages.owner), owners, since, signal_submit=report_issue)
        return StartedCopy(job.future if job.on_submit is None else job.on_submit, job.future)

    async def copy(self, copies: Iterable[tuple[int, int, int]], *, after: Any = None) -> None:
        """Raw ``(dst, src, nbytes)`` copies: tier slots, StaticHostMem, device to device.

        Host spans inside a known tier or StaticHostMem are checked: they must
        stay inside one registration and inside what is committed. Without a
        device every span must lie in one of those.

        :raises TypeError: a copy is not a triple of integers (bools and floats are refused).
        :raises ValueError: no copies, a negative address or size, or a copy of zero bytes.
        :raises CopyPlanError: a span crosses a registration or leaves the committed range,
            two destinations overlap, or (host-to-host engine) a span lies in no open tier or
            StaticHostMem.
        :raises CudaError: the driver refused the batch.
        """
        self._check_open()
        since = epoch()
        table = copy_table(copies)
        check_disjoint(table[:, 0], table[:, 2])
        sides = (table[:, 0], table[:, 1])
        (dst_reg, src_reg), owners = registrations(sides, table[:, 2], known_only=self.device is None)
        planned = plan(table[:, 0], table[:, 1], table[:, 2], dst_reg=dst_reg, src_reg=src_reg)
        await self._enqueue(planned, "any", after, tuple(owners), owners, since).future

    def statistics(self) -> CopyStatistics:
        """A snapshot of the engine's figures (any thread; also after close)."""
        # Read in the order the figures are written, last first: every copy whose latency is counted
        # is counted completed, and every completed one was submitted.
        counts, latency_sum = self._latency
        completed = self._completed
        issued = self._issued
        queued = self._queued
        cumulative = list(itertools.accumulate(counts))
        b = self._backend.statistics()
        return CopyStatistics(
            device=self.device,
            streams=self._n_streams,
            max_batch=self.max_batch,
            jobs_submitted=queued.jobs,
            jobs_completed=completed,
            copies_requested=queued.requested,
            descriptors_submitted=issued.descriptors,
            driver_calls=b.driver_calls,
            bytes_copied=issued.nbytes,
            batch_abi=b.batch_abi,
            jobs_by_direction=dict(zip(DIRECTIONS, queued.by_direction, strict=True)),
            bytes_by_direction=dict(zip(DIRECTIONS, issued.by_direction, strict=True)),
            latency_buckets=tuple(zip((*LATENCY_BUCKETS, float("inf")), cumulative, strict=True)),
            latency_sum_seconds=latency_sum,
            latency_count=cumulative[-1],
            method=self.method,
            sm_budget=b.sm_budget,
            sm_unavailable=b.sm_unavailable,
            sm_crossover_bytes=b.sm_crossover_bytes,
            jobs_by_method=b.jobs_by_method,
            bytes_by_method=b.bytes_by_method,
            jobs_coalesced=issued.coalesced,
            jobs_in_pieces=issued.in_pieces,
        )

    def __repr__(self) -> str:
        queued, issued = self._queued, self._issued
        return (
            f"<CopyEngine [{self._life.state} | device {self.device} | {self.method} | streams {self._n_streams} | "
            f"jobs {self._completed}/{queued.jobs} done | {issued.nbytes / 2**30:.2f} GiB copied]>"
        )

    # -- planning (on the loop) ---------------------------------------------------------

    def _plan_slots(
        self, tier: HostTier, slots: Any, buffer: Any, direction: str, page_size: int | None = None, after: Any = None
    ) -> tuple[Plan | Pieces, list[Any]]:
        """Check the slots and the device side, then plan in the host side's address order (a large
        request without ``after=``: ``Pieces``, planned on the submit thread).

        Returns the plan and the regions whose close must wait for it.
        """
        self._check_device(tier)
        in_pieces = self._in_pieces(direction, after)
        return plan_slots(tier, slots, buffer, direction, page_size, host_only=self.device is None, in_pieces=in_pieces)

    def _in_pieces(self, direction: str, after: Any) -> InPieces | None:
        """Which requests of this call are planned in pieces: from ``pieces_from`` pages, without
        ``after=`` (one stream waits for it; the pieces go on the streams in turn), where the
        backend gains from it (``CopyBackend.in_pieces``)."""
        bound = self._pieces_from
        if bound is None or after is not None:
            return None
        return InPieces(bound, partial(self._backend.in_pieces, direction))

    # -- requests made while the engine is busy: planned together, once per turn of the loop --

    def _busy(self, slots: Any) -> bool:
        """Whether a request is better deferred to the end of the loop's turn (``_defer()``): copies
        are queued or in flight (or deferred already), so it would wait for them anyway."""
        self._check_open()  # first, as an undeferred request does (a forked child has no running loop)
        if self._backend.synchronous or not isinstance(slots, list | tuple | np.ndarray):
            # A synchronous backend (memmove) settles its jobs one by one, a wake-up each, so requests
            # come one per turn, with nothing to plan them with (measured: a turn more for each, and
            # 4-17% slower). An iterator is read once, by the checks, now.
            return False
        # An array's size, not its len(): a 0-d array has none, and is refused as a SlotError when planned.
        count = slots.size if isinstance(slots, np.ndarray) else len(slots)
        if self._pieces_from is not None and count >= self._pieces_from:
            return False  # planned in pieces by the submit thread: nothing to gain from planning it with others
        return self._queued.jobs != self._completed or asyncio.get_running_loop() in self._pending

    def _defer(self, tier: HostTier, slots: Any, buffer: Any, direction: str, page: int | None) -> _Waiting:
        """Take a request to be checked and planned with the others made during this turn of the loop.

        Tasks that copy at once (an engine's many requests in flight) then pay the numpy calls of
        one request per turn, not one each. The checks and their errors are those of a request made
        alone, reported by the returned future. Called right after ``_busy()``, which checked the
        engine open.
        """
        loop = asyncio.get_running_loop()
        # The ids, and addresses given as a list or an array, as they are now: the caller may reuse
        # them before the turn ends, and a request made alone reads them at once. An array of pages is
        # the memory itself (its interface is read when planned).
        slots = slots.copy() if isinstance(slots, np.ndarray) else tuple(slots)
        if isinstance(buffer, list) or (isinstance(buffer, np.ndarray) and buffer.ndim < 2):
            buffer = buffer.copy()
        future = _Waiting(loop=loop)
        pending = self._pending.get(loop)
        if pending is None:
            pending = self._pending[loop] = []
            loop.call_soon(self._flush, loop)
        pending.append(_Deferred(tier, slots, buffer, direction, page, future))
        return future

    @staticmethod
    async def _deferred(waiting: _Waiting) -> None:
        """Await a deferred request: as a request made alone, bar when it is refused at its turn."""
        try:
            await waiting
        except asyncio.CancelledError:
            # Refused (never queued): alone, the refusal would have been raised when the request was
            # made, before any cancellation could reach the caller, so it is what the caller gets.
            error = None if waiting.queued or not waiting.done() else waiting.exception()
            if error is not None:
                raise error from None
            raise

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """Plan and queue the requests deferred during the turn that just ended (on ``loop``)."""
        batch = self._pending.pop(loop, None)
        if not batch:
            return
        groups: dict[tuple[int, str, object], list[_Deferred]] = {}
        for r in batch:
            # A page that is no int (unhashable, perhaps) makes a group of its own, refused alone.
            page = r.page if r.page is None or type(r.page) is int else r
            groups.setdefault((id(r.tier), r.direction, page), []).append(r)
        try:
            for group in groups.values():
                self._queue_group(group)
        finally:
            for r in batch:  # reached only where something other than a request's own error ended the flush
                if not r.future.done() and not r.future.queued:
                    r.future.set_exception(RuntimeError("the copy was not queued: the engine's flush was interrupted"))

    def _queue_group(self, group: list[_Deferred]) -> None:
        """Queue deferred requests of one tier, direction and ``page``: planned at once where every one
        passes, else each alone, so that each meets its own error."""
        first = group[0]
        since = epoch()
        planned: list[tuple[Plan, list[Any]]] | None = None
        if len(group) > 1:
            try:
                self._check_device(first.tier)
                requests = [(r.slots, r.buffer) for r in group]
                planned = plan_slots_many(
                    first.tier, requests, first.direction, first.page, host_only=self.device is None
                )
            except Exception:  # some request is refused: which one, and why, is said below
                planned = None
        for i, r in enumerate(group):
            try:
                if planned is None:
                    since = epoch()
                    plan_i, owners = self._plan_slots(r.tier, r.slots, r.buffer, r.direction, r.page)
                else:
                    plan_i, owners = planned[i]
                self._enqueue(plan_i, r.direction, None, (r.tier, r.buffer), owners, since, waiting=r.future)
            except Exception as exc:  # the caller's error, as if it had asked alone
                if r.future.queued:  # failed after the copy was handed over: the copy settles the future
                    raise
                r.future.set_exception(exc)

    def _check_device(self, tier: HostTier) -> None:
        self._check_open()
        if self.device is not None and tier.config.device not in (None, self.device):
            raise CopyPlanError(
                f"the tier is registered for device {tier.config.device}, this engine copies on device {self.device}"
            )

    def _enqueue(
        self,
        planned: Plan | Pieces,
        direction: str,
        after: Any,
        keepalive: tuple[Any, ...],
        owners: Sequence[Any],
        since: int,
        *,
        signal_submit: bool = False,
        waiting: _Waiting | None = None,
    ) -> _Job:
        """Hand a planned copy to the submit thread; its ``future`` settles once the bytes landed.

        ``since``: ``epoch()`` read before the copy was checked. ``waiting``: a deferred request's
        future, settled as the job's. The buffers are the GPU's until ``future`` settles: it is
        never cancelled, so a cancelled caller regains them only then.

        :raises CopyPlanError: a region the copy meets closed or shrank under it while it was
            checked on this thread (from another loop's thread); nothing was copied.
        :raises TierClosedError: the engine closed (on another loop) while the copy was checked.
        """
        self._check_open()
        after_handle = None if after is None else _stream_handle(after)
        if after_handle is not None and self.device is None:
            raise ValueError("after= needs a CUDA device; this engine copies host to host")
        loop = asyncio.get_running_loop()
        hand = handoff(loop)
        done = Landing()
        held = False
        try:
            for owner in owners:
                owner.copies.track(done)
            if epoch() != since:
                # A region snapshotted its copies while this one was checked, perhaps without it:
                # checked again now that it is tracked (``aiokvtier._regions.InflightCopies``).
                check_again(planned.dsts, planned.srcs, planned.sizes, owners)
            future = _Landed(loop=loop) if waiting is None else waiting
            job = _Job(planned, direction, None, loop, future, keepalive, done)
            if signal_submit:
                job.on_submit = loop.create_future()
            with self._loop_side:
                # The close queues the submit thread's stop under this lock, after marking the engine
                # closing: a copy from another loop's thread is queued ahead of the stop (and runs), or
                # sees the close here and is refused; never queued behind it, where nobody would run it.
                self._check_open()
                if after_handle is not None and after_handle[0] == "stream":
                    after_handle = ("marker", self._backend.mark(after_handle[1]))
                job.after = after_handle
                self._queued = self._queued.add(direction, planned.requested)
                job.submitted = time.perf_counter()
                # The submit and completion threads need the GIL: next to a saturated loop they get
                # it only through the loop's hand-off (aiokvtier._handoff), held until the copy lands.
                # Held before the copy is queued: after, it would keep the GIL from the woken submit
                # thread until this loop next waits (measured: 6 us of a 1 MiB host copy's 200).
                hand.hold_lightly_until(job.future)
                held = True
                self._submit_q.put(job)
                if waiting is not None:
                    waiting.queued = True
        except BaseException:
            done.set()  # never queued: no close waits for it
            if held and waiting is None:  # a future nobody settles: its hold goes now
                hand.release_light()  # (a deferred request's caller settles its future with the error)
            raise
        return job

    # -- the threads ------------------------------------------------------------------

    def _submit_loop(self) -> None:
        backend = self._backend
        backend.attach()
        carried: object = _NOTHING
        while True:
            job = self._submit_q.get() if carried is _NOTHING else carried
            carried = _NOTHING
            if job is None:
                self._done_q.put(None)
                return
            assert isinstance(job, _Job)
            if isinstance(job.plan, Pieces):
                self._issue_pieces(job)
                continue
            group = [job]
            if backend.coalesce and job.after is None:
                carried = self._gather(group)
            self._issue(group)

    def _gather(self, group: list[_Job]) -> object:
        """Add the jobs queued right behind ``group[0]`` that may be issued with it (submit thread).

        Returns the first one that may not (or the stop signal), which the caller issues next.
        """
        first = group[0]
        count, nbytes = first.plan.count, first.plan.nbytes
        while nbytes < GROUP_BYTES:
            try:
                more = self._submit_q.get_nowait()
            except queue.Empty:
                return _NOTHING
            if (
                more is None
                or isinstance(more.plan, Pieces)
                or more.after is not None
                or more.direction != first.direction
                or count + more.plan.count > self.max_batch
                or nbytes + more.plan.nbytes > GROUP_BYTES
            ):
                return more
            group.append(more)
            count += more.plan.count
            nbytes += more.plan.nbytes
        return _NOTHING

    def _issue(self, group: list[_Job]) -> None:
        """Issue one job, or jobs queued together as one plan (one driver call, event and wake-up
        for all), then hand them to the completion thread, or settle them where they landed already.

        Where a group's one issue fails, each job is issued alone, so that a job is refused only
        for its own copies; what the failed call issued is copied again (the same bytes to the
        same places, the buffers still the engine's).
        """
        first = group[0]
        handle = None
        try:
            plans = [job.plan for job in group if isinstance(job.plan, Plan)]
            assert len(plans) == len(group)  # requests in pieces go to _issue_pieces()
            planned = plans[0] if len(plans) == 1 else _merged(plans)
            handle = self._backend.issue(planned, first.direction, first.after)
        except BaseException as exc:  # reported to the awaiting task
            if len(group) > 1:
                for job in group:
                    self._issue([job])
                return
            first.error = exc
        else:
            self._issued = self._issued.add(first.direction, planned, len(group))
        if self._backend.synchronous:
            # The copies have landed (memmove returned): this thread settles the jobs itself
            # (no hop to the completion thread).
            self._settle([self._finish(job) for job in group], submitted_too=True)
            return
        self._hand_over(group, handle)

    def _issue_pieces(self, job: _Job) -> None:
        """Plan and issue a large request piece by piece (``Pieces``): the GPU copies each piece while
        the next is planned. Where a piece fails to plan or issue, the error is the caller's once the
        pieces issued before it have landed (as a failed driver call's issued part does)."""
        assert isinstance(job.plan, Pieces)
        handles = []
        self._issued = self._issued.one_in_pieces()
        try:
            for piece in job.plan.plans():
                handles.append(self._backend.issue(piece, job.direction, None))
                self._issued = self._issued.add(job.direction, piece, piece.jobs)
        except BaseException as exc:  # reported to the awaiting task
            job.error = exc
        self._hand_over([job], _InPieces(tuple(handles)))

    def _hand_over(self, group: list[_Job], handle: Any) -> None:
        """Tell the callers that asked (``begin()``) their copies were issued, then pass the jobs to the
        completion thread (submit thread)."""
        signals: dict[asyncio.AbstractEventLoop, list[Outcome]] = defaultdict(list)
        for job in group:
            if job.on_submit is not None:
                signals[job.loop].append((job.on_submit, None, None))
        for loop, batch in signals.items():
            deliver(loop, batch)
        self._done_q.put((tuple(group), handle))

    def _complete_loop(self) -> None:
        backend = self._backend
        backend.attach()
        pending: deque[tuple[tuple[_Job, ...], Any]] = deque()
        stopping = False
        while pending or not stopping:
            if not pending:
                item = self._done_q.get()
                if item is None:
                    return
                pending.append(item)
            finished = self._wait(*pending.popleft())
            # Coalesce: whatever is queued and already complete rides the same wake-up.
            while not stopping:
                try:
                    more = self._done_q.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stopping = True
                else:
                    pending.append(more)
            while pending and self._landed(*pending[0]):
                finished += self._wait(*pending.popleft())
            self._settle(finished)

    def _settle(self, finished: list[_Job], *, submitted_too: bool = False) -> None:
        """Publish the latency figures, then settle the jobs' futures: one crossing per loop.

        ``submitted_too``: their ``on_submit`` as well (a host copy is issued and landed at once).
        """
        # Published before the futures resolve: a caller whose copy returned sees it counted.
        self._latency = (tuple(self._latency_counts), self._latency_sum)
        by_loop: dict[asyncio.AbstractEventLoop, list[Outcome]] = defaultdict(list)
        for job in finished:
            if submitted_too and job.on_submit is not None:
                by_loop[job.loop].append((job.on_submit, None, None))
            by_loop[job.loop].append((job.future, None, job.error))
            job.keepalive = ()
        for loop, batch in by_loop.items():
            deliver(loop, batch)

    def _landed(self, jobs: tuple[_Job, ...], handle: Any) -> bool:
        """Whether jobs issued together have landed, or failed to issue (completion thread)."""
        if isinstance(handle, _InPieces):  # a failed piece's request waits for the pieces issued before it
            return all(self._backend.landed(h) for h in handle.handles)
        return jobs[0].error is not None or self._backend.landed(handle)

    def _wait(self, jobs: tuple[_Job, ...], handle: Any) -> list[_Job]:
        """Wait for jobs issued together to land (completion thread); one that failed to issue is done."""
        if isinstance(handle, _InPieces):
            for piece in handle.handles:  # every piece, also after one failed: the buffers are the GPU's until then
                try:
                    self._backend.wait(piece)
                except BaseException as exc:  # the first error is the caller's
                    if jobs[0].error is None:
                        jobs[0].error = exc
            return [self._finish(jobs[0])]
        if jobs[0].error is None:
            try:
                self._backend.wait(handle)
            except BaseException as exc:  # reported to every awaiting task of the group
                for job in jobs:
                    job.error = exc
        return [self._finish(job) for job in jobs]

    def _finish(self, job: _Job) -> _Job:
        """Count a landed (or failed) job and let the regions it read or wrote go."""
        latency = time.perf_counter() - job.submitted
        self._latency_counts[bisect.bisect_left(LATENCY_BUCKETS, latency)] += 1
        self._latency_sum += latency
        job.done.set()
        self._completed += 1
        return job


def _merged(plans: list[Plan]) -> Plan:
    """One plan of several jobs' copies, one after another (each job's own order kept)."""
    return Plan(
        np.concatenate([p.dsts for p in plans]),
        np.concatenate([p.srcs for p in plans]),
        np.concatenate([p.sizes for p in plans]),
        sum(p.requested for p in plans),
        sum(p.jobs for p in plans),
    )


def _default_backend(
    device: int | None,
    streams: int,
    method: str,
    sm_budget: int,
    crossover: Crossover | None,
    sm_options: SmOptions | None,
) -> CopyBackend:
    if device is None:
        return HostBackend()
    from .._cuda._backend import CudaBackend

    return CudaBackend(
        device, streams=streams, method=method, sm_budget=sm_budget, crossover=crossover, sm_options=sm_options
    )
