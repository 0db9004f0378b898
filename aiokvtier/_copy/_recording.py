"""A CopyEngine backend that records every job and lets a test decide when, and how, each one lands."""

from __future__ import annotations

import asyncio
import ctypes
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ._backend import CopyBackend
from ._plan import Plan

__all__ = ["IssuedCopy", "RecordingBackend"]


@dataclass(frozen=True, slots=True)
class IssuedCopy:
    """One job as the engine issued it: its plan, after merging and sorting."""

    order: int
    """0, 1, 2... in the order the submit thread issued the jobs."""
    direction: str
    """``"h2d"`` (``to_device``), ``"d2h"`` (``to_host``) or ``"any"`` (``copy``)."""
    dsts: tuple[int, ...]
    srcs: tuple[int, ...]
    sizes: tuple[int, ...]
    requested: int
    """Copies asked for, before merging."""
    calls: tuple[int, ...]
    """Descriptors per driver call: the plan cut at the engine's ``max_batch``."""
    after: tuple[str, int] | None
    """``("event", handle)``, ``("stream", handle)`` (marked on the caller's thread), or None."""


@dataclass(eq=False)
class _Held:
    copy: IssuedCopy
    plan: Plan
    gate: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class RecordingBackend(CopyBackend):
    """A fake backend for tests: records every job and copies nothing unless asked to.

    ``CopyEngine(None, backend=RecordingBackend())`` plans, checks and
    orders requests as any engine does, but hands each planned job to this
    object, which appends an ``IssuedCopy`` to ``issued``. Unlike a host-only
    engine's ``memmove``, a job completes on the engine's completion thread,
    as a GPU copy does, so a test can hold it in flight and then release or
    fail it.

    :param hold: jobs wait for ``release()`` or ``fail()`` before they land
        (settable at any time; it applies to jobs issued afterwards).
    :param memmove: copy the bytes when a job lands (host memory only: with a
        device engine, only where every address is mapped host memory).
    :param coalesce: let the engine issue jobs queued together as one (``CopyBackend.coalesce``,
        as a GPU backend does); each such group is one ``IssuedCopy``.

    Threads: ``issued``, ``held`` and ``statistics()`` may be read from any
    thread; ``release()`` and ``fail()`` never block; ``wait_issued()`` belongs
    to the caller's event loop.
    """

    def __init__(self, *, hold: bool = False, memmove: bool = False, coalesce: bool = False) -> None:
        super().__init__()
        self.hold = hold
        self.coalesce = coalesce
        self.memmove = memmove
        self.issued: list[IssuedCopy] = []
        self.marks: list[tuple[int, str]] = []
        """``(stream, thread name)`` per ``after=`` stream, marked on the calling thread."""
        self.fail_issue: BaseException | None = None
        """Raised by the next ``issue()`` (then cleared): the job is refused before anything is copied."""
        self._lock = threading.Lock()
        self._held: deque[_Held] = deque()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None], int]] = []

    @property
    def held(self) -> int:
        """Jobs issued and not yet released or failed."""
        with self._lock:
            return len(self._held)

    def release(self, count: int | None = None) -> int:
        """Let the ``count`` oldest held jobs land (all when None); returns how many."""
        return self._let_go(count, None)

    def fail(self, error: BaseException, count: int | None = None) -> int:
        """Make the ``count`` oldest held jobs fail with ``error`` (all when None); returns how many.

        The engine reports ``error`` to each job's caller once the job is settled.
        """
        return self._let_go(count, error)

    async def wait_issued(self, count: int) -> None:
        """Return once at least ``count`` jobs were issued in all (the submit thread has them)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if len(self.issued) >= count:
                return
            self._waiters.append((loop, future, count))
        await future

    def _let_go(self, count: int | None, error: BaseException | None) -> int:
        with self._lock:
            n = len(self._held) if count is None else min(count, len(self._held))
            going = [self._held.popleft() for _ in range(n)]
        for job in going:
            job.error = error
            job.gate.set()
        return n

    # -- the engine's side --------------------------------------------------------------

    def mark(self, stream: int) -> Any:
        self.marks.append((stream, threading.current_thread().name))
        return stream

    def issue(self, plan: Plan, direction: str, after: tuple[str, Any] | None) -> _Held:
        error, self.fail_issue = self.fail_issue, None
        if error is not None:
            raise error
        if after is not None and after[0] == "marker":
            after = ("stream", after[1])
        calls = tuple(s.stop - s.start for s in plan.chunks(self._max_batch))
        job = _Held(
            IssuedCopy(
                len(self.issued),
                direction,
                tuple(plan.dsts.tolist()),
                tuple(plan.srcs.tolist()),
                tuple(plan.sizes.tolist()),
                plan.requested,
                calls,
                after,
            ),
            plan,
        )
        self._calls += len(calls)
        self._count("dma", plan)
        with self._lock:
            self.issued.append(job.copy)
            if self.hold:
                self._held.append(job)
            else:
                job.gate.set()
            ready = [w for w in self._waiters if w[2] <= len(self.issued)]
            self._waiters = [w for w in self._waiters if w[2] > len(self.issued)]
        for loop, future, _ in ready:
            loop.call_soon_threadsafe(_resolve, future)
        return job

    def landed(self, handle: _Held) -> bool:
        return handle.gate.is_set()

    def wait(self, handle: _Held) -> None:
        handle.gate.wait()
        if handle.error is not None:
            raise handle.error
        if self.memmove:
            p = handle.plan
            for dst, src, n in zip(p.dsts.tolist(), p.srcs.tolist(), p.sizes.tolist(), strict=True):
                ctypes.memmove(dst, src, n)

    def __repr__(self) -> str:
        return f"<RecordingBackend [{len(self.issued)} issued | {self.held} held]>"


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
