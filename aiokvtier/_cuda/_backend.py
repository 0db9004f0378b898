"""The CUDA backend of a CopyEngine: the copy engines or the SM kernel, on the engine's own streams.

Per job, on the submit thread: wait for ``after=`` on the next stream (round
robin), then either ``cuMemcpyBatchAsync`` in calls of at most ``max_batch``
descriptors (``BatchCall``) or the SM kernel (``SmPath``), as ``method`` and,
for ``"auto"``, the device's measured crossover choose; then record an event
(kept and reused once it has fired). The completion thread sleeps on that
event (blocking sync, no polling) and hands the kernel's descriptor slab
back. No Python callback ever runs inside the driver.
"""

from __future__ import annotations

import itertools
import logging
import os
from contextlib import ExitStack
from typing import Any, NamedTuple

import numpy as np

from .._copy._backend import BackendStatistics, CopyBackend
from .._copy._plan import U64, Plan
from .._errors import AiokvtierError, CopyPlanError, CudaError
from ._batch import BatchCall, resolve_batch_function
from ._crossover import Crossover, parse_thresholds
from ._kernel import DEFAULT_SM_BUDGET
from ._sm import SmOptions, SmPath, device_side_problem, pick_method

__all__ = ["CudaBackend"]

log = logging.getLogger("aiokvtier")


class _UseDma(CopyPlanError):
    """``auto``: this request's device side is not reachable by the kernel; the copy engines take it."""


class _Issued(NamedTuple):
    event: Any
    slab: Any
    """The SM path's descriptor slab, handed back once ``event`` has fired; None for the copy engines."""


class CudaBackend(CopyBackend):
    """Copies on ``device`` through the copy engines (``"dma"``), the SM kernel (``"sm"``), or per
    request whichever the crossover predicts is faster (``"auto"``); see ``CopyEngine``."""

    coalesce = True

    def __init__(
        self,
        device: int,
        *,
        streams: int = 2,
        method: str = "auto",
        sm_budget: int = DEFAULT_SM_BUDGET,
        crossover: Crossover | None = None,
        sm_options: SmOptions | None = None,
    ) -> None:
        super().__init__()
        self._sm_options = sm_options
        self.device = device
        self.method = method
        self._n_streams = streams
        self._sm_budget = sm_budget
        self._crossover = crossover
        self._sm: SmPath | None = None
        self._sm_unavailable: str | None = None
        self._context: Any = None
        self._batch: Any = None
        self._abi: int | None = None
        self._streams: list[Any] = []
        self._rr = itertools.count()
        self._events: list[Any] = []
        """Completion events whose copies have landed, for reuse (append/pop are atomic)."""

    # -- the worker thread ----------------------------------------------------------------

    def open(self, max_batch: int) -> None:
        """The context, the batch function, the streams and (not ``"dma"``) the kernel."""
        from ._driver import PrimaryContext, check, driver

        super().open(max_batch)
        with ExitStack() as undo:
            drv = driver()
            self._context = context = PrimaryContext(self.device)
            undo.callback(context.release)
            with context.current():
                self._batch, self._abi = resolve_batch_function(drv)
                flag = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
                for _ in range(self._n_streams):
                    stream = check("cuStreamCreate", drv.cuStreamCreate(flag))
                    self._streams.append(stream)
                    undo.callback(self._destroy_stream, stream)
                if self.method != "dma":
                    self._start_sm(undo)
            undo.pop_all()

    def _start_sm(self, undo: ExitStack) -> None:
        """Compile and load the kernel, then settle the crossover (``auto``); context current."""
        from ._crossover import device_key, load_or_measure, measure_device

        try:
            sm = SmPath(self.device, self._sm_budget, options=self._sm_options)
        except AiokvtierError as exc:
            if self.method == "sm":
                raise
            self._sm_unavailable = str(exc)
            log.warning("aiokvtier: the SM copy path is unavailable, copying with the copy engines: %s", exc)
            return
        undo.callback(self._close_sm)
        self._sm = sm
        if self.method != "auto" or self._crossover is not None:
            return
        env = os.environ.get("AIOKVTIER_SM_CROSSOVER")
        if env:
            self._crossover = parse_thresholds(env)
            return
        device = self.device
        key = device_key(device, sm.budget, sm.kernel.spec, sm.options)

        def call(direction: str) -> BatchCall:
            return BatchCall(self._batch, self._abi, direction, device)

        try:
            self._crossover = load_or_measure(key, lambda: measure_device(sm, call, self._streams[0], self._max_batch))
        except AiokvtierError as exc:
            self._close_sm()
            self._sm_unavailable = f"measuring the crossover failed: {exc}"
            log.warning("aiokvtier: the SM copy path is unavailable, copying with the copy engines: %s", exc)

    def _close_sm(self) -> None:
        sm, self._sm = self._sm, None
        if sm is not None:
            with self._context.current():
                sm.close()

    def _destroy_stream(self, stream: Any) -> None:
        from ._driver import driver

        with self._context.current():
            driver().cuStreamDestroy(stream)

    def close(self) -> None:
        try:
            self._close_sm()
            for stream in self._streams:
                self._destroy_stream(stream)
            self._destroy_events()
        finally:
            self._context.release()

    def _destroy_events(self) -> None:
        from ._driver import driver

        events, self._events = self._events, []
        with self._context.current():
            for event in events:
                driver().cuEventDestroy(event)

    # -- the engine's threads -------------------------------------------------------------

    def attach(self) -> None:
        self._context.make_current()

    def mark(self, stream: int) -> Any:
        """An event recorded on ``stream`` now, on the caller's thread: the copy waits for what was queued
        there before the call, not for what the caller queues after it while the submit thread is busy."""
        from ._driver import check, driver

        drv = driver()
        with self._context.current():
            marker = check("cuEventCreate", drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING))
            try:
                check("cuEventRecord", drv.cuEventRecord(marker, stream))
            except BaseException:
                drv.cuEventDestroy(marker)
                raise
        return marker

    def issue(self, plan: Plan, direction: str, after: tuple[str, Any] | None) -> _Issued:
        from ._driver import check, driver

        drv = driver()
        stream = self._streams[next(self._rr) % len(self._streams)]
        if after is not None:
            kind, handle = after
            try:
                check("cuStreamWaitEvent", drv.cuStreamWaitEvent(stream, handle, 0))
            finally:
                if kind == "marker":
                    drv.cuEventDestroy(handle)  # the wait is enqueued; the driver frees it when done
        method = "sm" if self._sm is not None and self._wants_sm(plan, direction) else "dma"
        slab = None
        if method == "sm":
            try:
                slab = self._launch_sm(plan, direction, stream)
            except _UseDma:
                method = "dma"
            except CopyPlanError:
                raise
            except AiokvtierError as exc:
                if self.method == "sm":
                    raise
                self._disable_sm(f"a launch failed: {exc}")
                method = "dma"
        if method == "dma":
            call = BatchCall(self._batch, self._abi, direction, self.device)
            try:
                for chunk in plan.chunks(self._max_batch):
                    call(plan.dsts[chunk], plan.srcs[chunk], plan.sizes[chunk], stream)
                    self._calls += 1
            except BaseException:
                # What was issued (earlier calls, or part of the refused one) still copies: the caller
                # regains its buffers once the stream has run it.
                drv.cuStreamSynchronize(stream)
                raise
        self._count(method, plan)
        try:
            event = self._events.pop()
        except IndexError:
            flags = drv.CUevent_flags.CU_EVENT_BLOCKING_SYNC | drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
            try:
                event = check("cuEventCreate", drv.cuEventCreate(flags))
            except BaseException:
                self._give_back_after(slab, stream)
                raise
        try:
            check("cuEventRecord", drv.cuEventRecord(event, stream))
        except BaseException:
            drv.cuEventDestroy(event)
            self._give_back_after(slab, stream)
            raise
        return _Issued(event, slab)

    def _give_back_after(self, slab: Any, stream: Any) -> None:
        """An issued job whose event could not be recorded: the error reaches its caller, who regains the
        buffers, once the stream has run its copies; then its slab (if any) is reusable."""
        from ._driver import driver

        driver().cuStreamSynchronize(stream)
        if slab is not None and self._sm is not None:
            self._sm.give_back(slab)

    def _wants_sm(self, plan: Plan, direction: str) -> bool:
        chosen = pick_method(self.method, self._crossover, direction, plan.dsts, plan.srcs, plan.sizes, plan.whole)
        return chosen == "sm"

    def in_pieces(self, direction: str, host: U64, other: U64, page: int) -> bool:
        """Requests that go to the kernel: it copies a piece while the next is planned. The copy
        engines' share of a request is held by the driver calls (~1 us a descriptor), which
        already overlap the copy; planned in pieces it came out slower (docs/benchmarks.md).
        With ``"auto"``, what ``pick_method()`` would send to the kernel whole: a request it cannot
        move in 16-byte accesses goes to the copy engines, so it is planned whole too."""
        if self._sm is None:
            return False
        count, sizes = int(host.shape[0]), np.array([page], dtype=np.uint64)
        chosen = pick_method(self.method, self._crossover, direction, host, other, sizes, (count, count * page))
        return chosen == "sm"

    def _launch_sm(self, plan: Plan, direction: str, stream: Any) -> Any:
        """Check the device side, then upload descriptors and launch (submit thread).

        :raises CopyPlanError: with ``method="sm"``, a device-side span the driver does not map
            for this device (a kernel touching it would poison the context).
        """
        assert self._sm is not None
        device_side = plan.dsts if direction == "h2d" else plan.srcs
        problem = device_side_problem(device_side, plan.sizes, self.device)
        if problem is not None:
            if self.method == "sm":
                raise CopyPlanError(f"the SM copy path cannot reach the device side: {problem}; nothing was copied")
            raise _UseDma(problem)
        slab = self._sm.submit(plan.dsts, plan.srcs, plan.sizes, stream)
        self._calls += 1
        return slab

    def _disable_sm(self, why: str) -> None:
        if self._sm_unavailable is None:
            self._sm_unavailable = why
            log.warning("aiokvtier: the SM copy path is off for this engine, copying with the copy engines: %s", why)
        self._crossover = None  # "auto" now always picks the copy engines; the slabs are freed at close

    def landed(self, handle: _Issued) -> bool:
        from ._driver import driver

        return int(driver().cuEventQuery(handle.event)[0]) == 0

    def wait(self, handle: _Issued) -> None:
        from ._driver import driver

        drv = driver()
        try:
            (err,) = drv.cuEventSynchronize(handle.event)  # blocking sync: this thread sleeps
            if int(err) != 0:
                drv.cuEventDestroy(handle.event)
                raise CudaError("cuEventSynchronize", err.name, int(err))
            self._events.append(handle.event)  # recorded again by a later job: no create/destroy per copy
        finally:
            if handle.slab is not None and self._sm is not None:
                self._sm.give_back(handle.slab)

    def statistics(self) -> BackendStatistics:
        crossover = self._crossover
        return BackendStatistics(
            driver_calls=self._calls,
            jobs_by_method=dict(self._jobs_by_method),
            bytes_by_method=dict(self._bytes_by_method),
            batch_abi=self._abi,
            sm_budget=None if self._sm is None else self._sm.budget,
            sm_unavailable=self._sm_unavailable,
            sm_crossover_bytes=(
                {}
                if crossover is None or self.method != "auto"
                else {d: crossover.crossover_bytes(d) for d in ("h2d", "d2h")}
            ),
        )

    def __repr__(self) -> str:
        return f"<CudaBackend [device {self.device} | {self.method} | streams {self._n_streams}]>"
