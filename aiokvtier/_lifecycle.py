"""One lifecycle for every owner of memory or threads (tier, staging buffer, copy engine).

::

    new ──open──> opening ──built──> open ──aclose──> closing ──> closed
                     │                                              ▲
                     └── failed, cancelled, or closed meanwhile ────┘
    (any state) ──fork()──> forked: the child holds none of the threads

Building and tearing down run as tasks that nobody cancels; the caller awaits
them through ``finish()``, which keeps waiting when the caller is cancelled
and re-raises the cancellation once the work is done. So a cancelled ``open``
returns only after everything it built is released, and a cancelled
``aclose`` only after the teardown is complete. (``anyio.CancelScope(shield=True)``
does not stop a native ``Task.cancel()``, so it cannot give this guarantee.)

Partial opens unwind through an undo stack of blocking callbacks that run on
the owner's ``Worker``, never on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import ExitStack
from types import TracebackType
from typing import Any, Self, TypeVar

from ._crossing import Worker
from ._errors import TierClosedError

__all__ = ["Lifecycle", "Owner", "close_in_turn", "finish"]

T = TypeVar("T")
log = logging.getLogger("aiokvtier")


async def finish(work: Awaitable[T]) -> T:
    """Await ``work`` to its end, even if the caller is cancelled meanwhile.

    A cancellation that arrives while waiting is held back and re-raised once
    the work is done (if the work failed too, its error becomes the
    cancellation's ``__cause__``). A coroutine is wrapped in a task first.
    """
    future = asyncio.ensure_future(work)
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            result = await asyncio.shield(future)
        except asyncio.CancelledError as exc:
            if future.done() and future.cancelled():
                raise  # the work itself was cancelled, not its awaiter
            if not future.done():
                cancelled = exc
                continue
            if cancelled is None:
                cancelled = exc
            error = future.exception()
            if error is not None:
                raise cancelled from error
            raise cancelled from None
        except BaseException as exc:
            if cancelled is not None:
                raise cancelled from exc
            raise
        if cancelled is not None:
            raise cancelled
        return result


_live: weakref.WeakSet[Lifecycle] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for life in list(_live):
        life.forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Lifecycle:
    """States, one open, one close, close during open, concurrent closes, an undo stack.

    :param owner: what to call the object in errors ("HostTier", "CopyEngine"...).
    :param thread: the name of the owner's worker thread.
    """

    def __init__(self, owner: str, thread: str) -> None:
        self.owner = owner
        self.state = "new"
        self._thread_name = thread
        self.worker: Worker | None = None
        self.undo = ExitStack()
        """Blocking callbacks that release what was built, run LIFO on the worker at teardown."""
        self.keep_worker = False
        """Set by a teardown that hands its worker a job still to come (a release deferred to the last view)."""
        self._close_requested = False
        self._closed: concurrent.futures.Future[None] | None = None
        """Done once the teardown is: thread-safe, for a close awaited on another loop (an engine's)."""
        self._pid = os.getpid()

    # -- queries ----------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.state in ("closing", "closed", "forked")

    def check_open(self) -> None:
        """:raises TierClosedError: the object is not open (new, opening, closing, closed or forked)."""
        if self.state != "open":
            raise TierClosedError(self.describe())

    def describe(self, state: str | None = None) -> str:
        """Why the object cannot be used, and what to do: for ``state`` as read by the caller (default: now)."""
        state = self.state if state is None else state
        if state == "forked":
            return (
                f"this {self.owner} was opened in process {self._pid}; after fork() the child has none of its "
                "threads: open a new one in the child"
            )
        owner = self.owner
        if state == "new":  # built but never entered: the commonest slip of a first program
            opener = "attach" if owner == "AttachedPool" else "open"
            return f"the {owner} is new: open it first (async with {owner}(...), or await {owner}.{opener}(...))"
        if state == "opening":
            return f"the {owner} is opening: use it once its open has returned"
        if state in ("closing", "closed"):
            return f"the {owner} is {state}: a closed {owner} cannot be used again; open a new one"
        return f"the {owner} is {state}"

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking step on the worker and await its outcome (within build/teardown)."""
        return await self.submit(fn, *args)

    def submit(
        self, fn: Callable[..., T], *args: Any, future: asyncio.Future[T] | None = None, light: bool = False
    ) -> asyncio.Future[T]:
        """Queue a blocking step on the worker now; the future (never cancelled by the library) gets its outcome.

        :param future: as ``Worker.submit()``'s: the caller's own future to settle.
        :param light: as ``Worker.submit()``'s: a copy.
        :raises RuntimeError: the worker is stopped (the owner is closed).
        """
        assert self.worker is not None
        return self.worker.submit(fn, *args, future=future, light=light)

    # -- transitions -------------------------------------------------------------

    async def open(
        self,
        build: Callable[[], Coroutine[Any, Any, None]],
        teardown: Callable[[], Coroutine[Any, Any, None]],
    ) -> None:
        """Run ``build`` to the end; on failure, cancellation or a close meanwhile, run ``teardown``.

        :raises RuntimeError: opened twice, or the worker thread cannot start.
        :raises TierClosedError: ``aclose()`` was called while opening.
        """
        if self.state != "new":
            raise RuntimeError(f"this {self.owner} is {self.state}: an object opens once; make a new one")
        self.state = "opening"
        self._closed = concurrent.futures.Future()
        try:
            self.worker = Worker(self._thread_name)
        except BaseException:
            self._finish_close()
            raise
        _live.add(self)
        try:
            await finish(self._open(build, teardown))
        except asyncio.CancelledError:
            if self.state == "open":  # built before the cancellation landed: undo it first
                self.state = "closing"
                await finish(self._teardown(teardown))
            raise

    async def _open(
        self,
        build: Callable[[], Coroutine[Any, Any, None]],
        teardown: Callable[[], Coroutine[Any, Any, None]],
    ) -> None:
        try:
            await build()
        except BaseException:
            self.state = "closing"
            try:
                await self._teardown(teardown)
            except Exception:
                pass  # logged; the build's own error is the one to report
            raise
        if self._close_requested:
            self.state = "closing"
            await self._teardown(teardown)
            raise TierClosedError(f"the {self.owner} was closed while it was opening")
        self.state = "open"

    async def close(self, teardown: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Tear down once; concurrent and later calls wait for that teardown. Idempotent.

        Cancelling a call that runs the teardown does not interrupt it: the
        cancellation is re-raised once it is done.
        """
        state = self.state
        if state == "new":
            self.state = "closed"
            return
        if state == "forked":
            self.state = "closed"  # the memory belongs to the parent's threads and driver state
            return
        if state == "opening":
            self._close_requested = True  # the open tears down what it built once it is whole
        if state == "open":
            self.state = "closing"  # now, not when the task starts: a concurrent close must wait, not tear down again
            await finish(self._teardown(teardown))
            return
        if self._closed is not None and not self._closed.done():
            # A cancelled waiter, too, returns only once the teardown is done, on whichever loop it runs.
            await finish(asyncio.wrap_future(self._closed))

    async def _teardown(self, teardown: Callable[[], Coroutine[Any, Any, None]]) -> None:
        try:
            await teardown()
        except BaseException as exc:
            log.error("aiokvtier: closing the %s failed: %r", self.owner, exc)
            raise
        finally:
            self._finish_close()

    def _finish_close(self) -> None:
        self.state = "closed"
        if self.worker is not None and not self.keep_worker:
            self.worker.stop()
            # Its last job has run and been delivered: it has nothing left but to
            # return, so this join takes microseconds, and "closed" means no thread left.
            self.worker.join(timeout=1.0)
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)
        _live.discard(self)

    def release_when_unviewed(self, defer: Callable[[Callable[[], None]], bool], release: Callable[[], None]) -> None:
        """On the worker, in the undo stack: ``release()`` now, or once the last view is dropped.

        :param defer: a view ledger's ``defer_until_empty``: True if no view is
            live; else it keeps the callback for whichever thread drops the last
            view, and that thread only hands the release to this worker (never
            running it itself: it may be the loop's).
        """
        worker = self.worker
        assert worker is not None

        def release_later() -> None:
            worker.post(release)
            worker.stop()

        if defer(release_later):
            release()
        else:
            self.keep_worker = True  # the worker outlives the close, until that release

    async def run_undo(self) -> None:
        """Run the undo stack on the worker (the usual last step of a teardown)."""
        await self.run(self.undo.close)

    def forked(self) -> None:
        if self.state not in ("new", "closed"):
            self.state = "forked"


class Owner:
    """What every owner of memory or threads shares: ``async with`` opens and closes it.

    A subclass sets ``self._life`` and defines ``_build`` and ``_teardown``
    (coroutines run through ``Lifecycle``), and documents its own
    ``aclose``.
    """

    _life: Lifecycle

    async def _build(self) -> None:
        raise NotImplementedError

    async def _teardown(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self._life.open(self._build, self._teardown)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._life.close(self._teardown)

    @property
    def closed(self) -> bool:
        return self._life.closed

    @property
    def state(self) -> str:
        """``"new"``, ``"opening"``, ``"open"``, ``"closing"`` or ``"closed"``: where its life is now."""
        return self._life.state

    def check_open(self) -> None:
        """Raise unless the object is open: for a caller that builds on it (a store over a tier
        and an engine checks both at open). Any thread.

        :raises TierClosedError: it is new, opening, closing, closed, or was opened before a ``fork()``;
            the message says which.
        """
        self._life.check_open()

    _check_open = check_open


async def close_in_turn(*owners: Owner | None) -> None:
    """``aclose()`` each owner given (None: skipped), first to last, every one whatever an earlier
    close raised: nested ``finally`` blocks (the last error raised, an earlier one its context)."""
    if not owners:
        return
    try:
        if owners[0] is not None:
            await owners[0].aclose()
    finally:
        await close_in_turn(*owners[1:])
