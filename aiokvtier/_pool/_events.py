"""The shared store's events, in an attached process: what the owner pushes, one queue per subscriber.

The owner pushes a ``stored``, ``evicted`` or ``discarded`` event to every
process that subscribed, whichever process caused it; in the process, each
``PoolEvents`` gets every event from its making on, into a bounded queue
(the oldest dropped past ``limit``, the next event read says how many), as
``BlockStore.events()`` does. The iteration ends when the pool is closed or
lost, or at ``aclose()``. The event loop that attached only.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from types import TracebackType
from typing import Literal, Self

from .. import BlockEvent

__all__ = ["EventFanout", "PoolEvents"]

EventKind = Literal["stored", "evicted", "discarded"]


class PoolEvents:
    """One subscriber's stream of ``BlockEvent`` from a pool (``AttachedPool.events()``, not made directly).

    ``async for event in pool.events():`` or ``async with pool.events() as events:``.
    """

    __slots__ = ("__weakref__", "_dropped", "_ended", "_queue", "_waiter")

    def __init__(self, limit: int) -> None:
        self._queue: deque[BlockEvent] = deque(maxlen=limit)
        self._dropped = 0
        self._ended = False
        self._waiter: asyncio.Future[None] | None = None

    def _push(self, event: BlockEvent) -> None:
        if len(self._queue) == self._queue.maxlen:
            self._dropped += 1 + self._queue[0].dropped  # the oldest goes, with what it said was missed
        self._queue.append(event)
        self._wake()

    def _end(self) -> None:
        self._ended = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> BlockEvent:
        while not self._queue:
            if self._ended:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        event = self._queue.popleft()
        if self._dropped:
            event = BlockEvent(event.kind, event.keys, event.dropped + self._dropped)
            self._dropped = 0
        return event

    async def aclose(self) -> None:
        """Stop receiving; events already queued are dropped. Idempotent."""
        self._queue.clear()
        self._end()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class EventFanout:
    """The attached process's subscribers, held weakly (one that nobody holds stops receiving)."""

    def __init__(self) -> None:
        self._subscribers: weakref.WeakSet[PoolEvents] = weakref.WeakSet()
        self.ended = False

    def subscribe(self, limit: int) -> PoolEvents:
        events = PoolEvents(limit)
        if self.ended:
            events._end()
        else:
            self._subscribers.add(events)
        return events

    def publish(self, kind: EventKind, keys: tuple[bytes | int, ...], dropped: int = 0) -> None:
        """An event from the owner; ``dropped``: events before it that the owner did not send (this process
        had not read what it had sent)."""
        event = BlockEvent(kind, keys, dropped)
        for events in list(self._subscribers):
            if not events._ended:
                events._push(event)

    def end(self) -> None:
        self.ended = True
        for events in list(self._subscribers):
            events._end()
        self._subscribers = weakref.WeakSet()

    def __len__(self) -> int:
        return sum(1 for events in self._subscribers if not events._ended)
