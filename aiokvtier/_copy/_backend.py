"""The seam between a CopyEngine and what moves its bytes.

The engine checks and plans a request on the caller's loop, then hands the
plan to its backend from two threads of its own::

    CopyEngine ─┬─ submit thread ───── backend.issue(plan, direction, after) -> handle
                └─ completion thread ─ backend.landed(handle), backend.wait(handle)

    CopyBackend
    ├── HostBackend        memmove on the submit thread: landed when issue() returns
    ├── CudaBackend        the copy engines or the SM kernel, on the engine's streams (aiokvtier._cuda)
    └── RecordingBackend   records every job, holds, releases or fails it (aiokvtier.testing)

The engine keeps everything else: the checks, the plan, the futures and their
crossing back to the loop, the order of completion, the regions' tracking of
copies in flight, the latency figures. A backend never sees an event loop.
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ._plan import U64, Plan

__all__ = ["BackendStatistics", "CopyBackend", "HostBackend"]


@dataclass(frozen=True, slots=True)
class BackendStatistics:
    """A backend's own figures, folded into ``CopyStatistics``."""

    driver_calls: int
    jobs_by_method: dict[str, int] = field(hash=False)
    bytes_by_method: dict[str, int] = field(hash=False)
    batch_abi: int | None = None
    sm_budget: int | None = None
    sm_unavailable: str | None = None
    sm_crossover_bytes: dict[str, int] = field(default_factory=dict, hash=False)


class CopyBackend(ABC):
    """What a CopyEngine's threads call to issue one planned job and to wait for it.

    ``open()`` and ``close()`` run on the engine's worker thread, ``attach()``
    first thing on each of the engine's own threads, ``mark()`` on the
    caller's thread, ``issue()`` on the submit thread (one job at a time, in
    the order the jobs were queued), ``landed()`` and ``wait()`` on the
    completion thread (handles in issue order). Each counter has one writer
    (the submit thread), so ``statistics()`` may be read from any thread.
    """

    synchronous: ClassVar[bool] = False
    """A job has landed when ``issue()`` returns (``memmove``): the submit thread settles it
    itself, and ``landed()`` and ``wait()`` are never called."""
    method: str = "dma"
    """What the engine reports it was asked for: ``"auto"``, ``"dma"`` or ``"sm"``."""
    coalesce: bool = False
    """Jobs queued behind one another (one direction, no ``after=``) may reach ``issue()`` as one
    plan, their copies one after another, and land together: one driver call, event and wake-up
    for many small requests. Where such an ``issue()`` raises, the engine issues each job alone
    (what the failed call did issue is copied again: the same bytes to the same places)."""

    def __init__(self) -> None:
        self._calls = 0
        self._jobs_by_method = {"dma": 0, "sm": 0}
        self._bytes_by_method = {"dma": 0, "sm": 0}

    def open(self, max_batch: int) -> None:
        """Acquire what the copies need; ``max_batch`` caps descriptors per driver call.

        Undoes itself when it raises. Engine's worker thread.
        """
        self._max_batch = max_batch

    def close(self) -> None:
        """Release what ``open()`` acquired; every issued job has been waited for. Worker thread."""
        return None

    def attach(self) -> None:
        """First thing on each thread the engine starts (a CUDA backend makes its context current)."""
        return None

    def in_pieces(self, direction: str, host: U64, other: U64, page: int) -> bool:
        """Whether a per-slot request between the slots at ``host`` and the pages at ``other``, ``page``
        bytes each, is better planned in pieces where it is issued (``Pieces``: each piece copies
        while the next is planned) than whole on the caller's loop. Caller's thread, for requests
        the engine's ``pieces_from`` lets through. Default: where the copy runs on after ``issue()``
        returns (not ``synchronous``)."""
        return not self.synchronous

    def mark(self, stream: int) -> Any:
        """Something recorded on ``stream`` now, on the caller's thread, that ``issue()`` may wait for.

        The engine refuses ``after=`` without a device, so a host-only backend is never asked.
        """
        raise NotImplementedError(f"{type(self).__name__} has no streams to wait for")

    @abstractmethod
    def issue(self, plan: Plan, direction: str, after: tuple[str, Any] | None) -> Any:
        """Issue one planned job; returns a handle for ``wait()``.

        ``direction``: ``"h2d"``, ``"d2h"`` or ``"any"`` (a raw copy). ``after``:
        ``("event", handle)``, or ``("marker", what mark() returned)``, which this
        call owns and disposes of, issued or not.

        :raises Exception: the job was not issued (or only partly, when nothing
            of it can land later); reported to the awaiting caller.
        """

    def landed(self, handle: Any) -> bool:
        """Whether the job has landed already (it then rides the same crossing as the one waited for)."""
        return False

    def wait(self, handle: Any) -> None:
        """Block until the job has landed (completion thread).

        :raises Exception: the copy failed; reported to the awaiting caller.
        """
        return None

    def statistics(self) -> BackendStatistics:
        return BackendStatistics(self._calls, dict(self._jobs_by_method), dict(self._bytes_by_method))

    def _count(self, method: str, issued: Plan) -> None:
        """A plan issued through ``method`` (submit thread): its jobs and bytes."""
        self._jobs_by_method[method] += issued.jobs
        self._bytes_by_method[method] += issued.nbytes


class HostBackend(CopyBackend):
    """``memmove`` on the submit thread, one "call" per chunk of at most ``max_batch`` copies.

    The engine has checked that every span lies in an open tier or
    StaticHostMem: a copy from any other address would kill the process.
    """

    synchronous = True

    def issue(self, plan: Plan, direction: str, after: tuple[str, Any] | None) -> Any:
        rows = plan.rows
        if rows is not None and len(rows) <= self._max_batch:
            for dst, src, n in rows:
                ctypes.memmove(dst, src, n)
            self._calls += 1
            self._count("dma", plan)
            return None
        for chunk in plan.chunks(self._max_batch):
            if rows is not None:
                copies: Iterable[tuple[int, int, int]] = rows[chunk]
            else:
                copies = zip(
                    plan.dsts[chunk].tolist(), plan.srcs[chunk].tolist(), plan.sizes[chunk].tolist(), strict=True
                )
            for dst, src, n in copies:
                ctypes.memmove(dst, src, n)
            self._calls += 1
        self._count("dma", plan)
        return None

    def __repr__(self) -> str:
        return f"<HostBackend [{self._calls} calls]>"
