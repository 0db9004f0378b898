"""The one crossing from library threads into the event loop.

Every result a library thread hands to a coroutine goes through
``deliver()`` (one ``call_soon_threadsafe`` per batch of futures), and
waiting for "``n`` bytes resident" goes through ``LoopWaiters``, which
collapses many publishes into one wake-up. ``Worker`` is the blocking
side: a named thread that runs an owner's blocking steps (reserve, resize,
release) in order and delivers each result here. ``call_on()`` is the other
way round: a thread that needs the loop's state in one moment has the loop
take it (its caller wakes every 0.1 s only to notice a loop that stopped
before it got there). Nothing else polls.

Futures handed out here are never cancelled by the library; a caller that
must not abandon the work awaits them through
``aiokvtier._lifecycle.finish()``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ._handoff import handoff

__all__ = ["LoopWaiters", "Worker", "call_on", "deliver", "one_moment"]

T = TypeVar("T")

Outcome = tuple["asyncio.Future[Any]", Any, BaseException | None]


def _settle(outcomes: Iterable[Outcome]) -> None:
    for future, result, error in outcomes:
        if future.done():
            continue  # cancelled by its awaiter: the work still completed
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def deliver(loop: asyncio.AbstractEventLoop, outcomes: list[Outcome]) -> None:
    """Settle ``(future, result, error)`` triples on their loop, from any thread, in one wake-up."""
    if not outcomes:
        return
    try:
        loop.call_soon_threadsafe(_settle, outcomes)
    except RuntimeError:
        pass  # the loop is closed: nobody is left awaiting on it


def call_on(loop: asyncio.AbstractEventLoop, fn: Callable[[], T]) -> T:
    """``fn()``, run on ``loop`` between two of its callbacks, when called from another thread while
    ``loop`` runs; else run here (on the loop, or once it stopped: then nothing changes under ``fn``).

    The calling thread waits for the loop to get to it, however busy the loop is; a loop that stops
    meanwhile leaves the call to the caller's thread. Never call it from a thread that the loop
    is blocked on.
    """
    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:
        here = False
    if here or loop.is_closed() or not loop.is_running():
        return fn()
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as exc:  # raised on the caller's thread
                future.set_exception(exc)

    try:
        loop.call_soon_threadsafe(run)
    except RuntimeError:  # closed meanwhile
        return fn()
    while True:
        try:
            return future.result(0.1)
        except concurrent.futures.TimeoutError:
            # A loop that stopped will never run it: nothing changes any more, read it here.
            if (loop.is_closed() or not loop.is_running()) and future.cancel():
                return fn()


def one_moment(loop: asyncio.AbstractEventLoop | None, fn: Callable[[], T], *, settled: bool) -> T:
    """``fn()`` over one moment of an owner's state, from any thread: on ``loop`` (``call_on``) while
    that state may change, here once it cannot (``loop`` None: never opened; ``settled``: closed)."""
    if loop is None or settled:
        return fn()
    return call_on(loop, fn)


class Worker:
    """A named thread that runs blocking calls one at a time, in submission order.

    It is started at construction (so an owner learns at open, before it
    builds anything, that no thread can be had) and exits after ``stop()``,
    once everything submitted before has run.

    :raises RuntimeError: the thread cannot start (thread or memory limits).
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.AbstractEventLoop | None, Any] | None]
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self.stopped = False

    def submit(
        self, fn: Callable[..., T], *args: Any, future: asyncio.Future[T] | None = None, light: bool = False
    ) -> asyncio.Future[T]:
        """Run ``fn(*args)`` on the thread; the returned future (of the running loop) gets its outcome.

        :param future: the future to settle, made by the caller on the running loop (one that refuses
            cancellation, say); None: a new one.
        :param light: a short step that comes often (a copy): the hand-off is held lightly
            (``GilHandoff.hold_lightly_until``).
        """
        if self.stopped:
            raise RuntimeError("the worker is stopped")
        loop = asyncio.get_running_loop()
        if future is None:
            future = loop.create_future()
        # The thread needs the GIL to run the step and hand its outcome back: next to a
        # saturated loop it gets it only through the loop's hand-off (aiokvtier._handoff).
        hand = handoff(loop)
        (hand.hold_lightly_until if light else hand.hold_until)(future)
        self._queue.put((lambda: fn(*args), loop, future))
        return future

    def post(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` on the thread, from any thread, without waiting (errors are the caller's to log)."""
        self._queue.put((fn, None, None))

    def stop(self) -> None:
        """Let the thread exit once what was submitted before has run. Idempotent."""
        if not self.stopped:
            self.stopped = True
            self._queue.put(None)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _main(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, loop, future = item
            try:
                result, error = fn(), None
            except BaseException as exc:  # handed to the awaiting coroutine
                result, error = None, exc
            if loop is not None:
                deliver(loop, [(future, result, error)])
            del item, fn, future, result, error  # drop references before blocking on the queue again


class LoopWaiters:
    """Coroutines waiting for "``n`` bytes resident", woken by worker threads.

    Futures sit in a heap by threshold. A thread that changes the fill state
    calls ``notify()``, which schedules at most one wake-up until the loop
    has run it: many publishes collapse into one, and one serves every waiter.

    Ordering makes this lock-free: a waiter is pushed (and ``_armed`` set)
    *before* it rechecks the state, and a worker updates the state *before* it
    reads ``_armed``; whichever runs second sees the other's write.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        ready: Callable[[int], bool],
        settled: Callable[[], bool],
    ) -> None:
        """
        :param ready: whether a waiter for ``n`` is done (resident, failed or closed).
        :param settled: whether the state is failed or closed.
        """
        self._loop = loop
        self._settled = settled
        self._ready = ready
        self._heap: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._armed = False
        self._pending = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def __len__(self) -> int:
        return len(self._heap)

    async def wait(self, nbytes: int) -> None:
        """Wait on the loop until ``ready(nbytes)`` or a ``kick()``.

        Callers loop: a kick (after a resize) means "re-read the state".
        Cancelling the wait leaves nothing behind but a cancelled future,
        which the next wake-up drops.
        """
        if self._ready(nbytes):
            return
        future: asyncio.Future[None] = self._loop.create_future()
        heapq.heappush(self._heap, (nbytes, next(self._seq), future))
        self._armed = True
        if self._ready(nbytes):
            self._wake()
        await future

    def notify(self) -> None:
        """Called from any thread after the state changed."""
        if not self._armed or self._pending:
            return
        self._pending = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:
            # The loop is closed: nobody is left awaiting on it.
            self._pending = False

    def _wake(self) -> None:
        self._pending = False
        heap = self._heap
        ready = self._ready
        done: list[asyncio.Future[None]] = []
        while heap and ready(heap[0][0]):
            done.append(heapq.heappop(heap)[2])
        if heap and self._settled():
            # Failed or closed: waiters above the failure are done too, wherever
            # they sit in the heap, while those below keep waiting.
            done.extend(entry[2] for entry in heap if ready(entry[0]))
            heap[:] = [entry for entry in heap if not ready(entry[0])]
            heapq.heapify(heap)
        if not heap:
            self._armed = False
        for future in done:
            if not future.done():
                future.set_result(None)

    def kick(self) -> None:
        """Wake every waiter now (on the loop), so each re-reads the state after a resize or close."""
        heap, self._heap = self._heap, []
        self._armed = False
        for _, _, future in heap:
            if not future.done():
                future.set_result(None)
