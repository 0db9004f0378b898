"""The one crossing from worker threads into the event loop.

Coroutines wait for "``n`` bytes resident" on futures kept in a heap by
threshold. A worker that changes the fill state calls :meth:`notify`, which
schedules at most one ``call_soon_threadsafe`` until the loop has run it:
many publishes collapse into one wake-up, and one wake-up serves every
waiter. Nothing polls.

Ordering makes this lock-free: a waiter is pushed (and ``_armed`` set)
*before* it rechecks the state, and a worker updates the state *before* it
reads ``_armed``; whichever runs second sees the other's write.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

__all__ = ["LoopWaiters"]


class LoopWaiters:
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
        """Wait on the loop until ``ready(nbytes)`` or a :meth:`kick`.

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
