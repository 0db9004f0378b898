"""The store's event stream: what a router or a prefix-aware scheduler subscribes to.

Every subscription gets its own bounded queue. Publishing never waits: when a
subscriber falls behind, its oldest events are dropped and the next event it
reads says how many (``BlockEvent.dropped``). Everything runs on the store's
event loop.

Who keeps a subscription alive: its holder, never the hub. The hub keeps its
subscriptions by weak reference, so one that nobody holds any more (made and
never iterated, or left part way) stops receiving and is freed at once
(CPython frees it when its last reference goes; one caught in a reference
cycle, at the next garbage collection). A subscription registers when it is
made, not at its first read, so that ``sub = store.events()`` followed by a
store sees that store's event. The one exception: while a reader waits in
``__anext__``, the hub holds the subscription strongly, because a reader's
task may be referenced by nothing but the future it waits on (a task made
with ``create_task`` and not kept), and dropping the subscription there
would drop the task with it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

__all__ = ["BlockEvent", "EventHub", "EventSubscription"]

Key = bytes | int
EventKind = Literal["stored", "evicted", "discarded"]


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """Blocks that became visible (``"stored"``) or left the store (``"evicted"``, ``"discarded"``)."""

    kind: EventKind
    keys: tuple[Key, ...]
    dropped: int = 0
    """Events this subscriber missed just before this one (it read too slowly)."""


class EventSubscription:
    """One subscriber's stream of ``BlockEvent``, from ``BlockStore.events()`` (not made directly).

    An async iterator (``async for event in store.events():``) and an async
    context manager (``async with store.events() as events:``). It receives
    every event from the ``BlockStore.events()`` call on, read or not,
    into a queue of at most ``event_limit`` events: past that, the oldest are
    dropped and the next event read says how many (``dropped``). Iteration
    ends when the store closes (once the queue is read) or at ``aclose()``.

    A subscription that nobody references any more is released: it stops
    receiving and is freed; ``aclose()`` releases it at once. A reader
    whose wait in ``__anext__`` is cancelled leaves the subscription as it
    was (still subscribed, nothing lost); ``async for`` then drops it.

    Threads: the store's event loop only.
    """

    __slots__ = ("__weakref__", "_dropped", "_ended", "_hub", "_queue", "_waiters")

    def __init__(self, hub: EventHub, limit: int) -> None:
        self._hub = hub
        self._queue: deque[BlockEvent] = deque(maxlen=limit)
        self._dropped = 0
        self._ended = False
        self._waiters: list[asyncio.Future[None]] = []

    def _push(self, event: BlockEvent) -> None:
        if len(self._queue) == self._queue.maxlen:
            self._dropped += 1  # the deque drops the oldest itself
        self._queue.append(event)
        self._wake()

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    def __aiter__(self) -> EventSubscription:
        return self

    async def __anext__(self) -> BlockEvent:
        """The next event, waiting for one.

        :raises StopAsyncIteration: the store closed and every event was
            read, or ``aclose()`` was called.
        """
        while not self._queue:
            if self._ended or self._hub.closed:
                self._end()
                raise StopAsyncIteration
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            self._hub.park(self)
            try:
                await waiter
            finally:
                self._waiters.remove(waiter)
                if not self._waiters:
                    self._hub.unpark(self)
        event = self._queue.popleft()
        if self._dropped:
            event = BlockEvent(event.kind, event.keys, self._dropped)
            self._dropped = 0
        return event

    def _end(self) -> None:
        self._ended = True
        self._queue.clear()
        self._hub.unsubscribe(self)

    async def aclose(self) -> None:
        """Stop receiving and drop the events not read; a reader waiting in ``__anext__`` ends its iteration.

        Idempotent; never waits.
        """
        self._end()
        self._wake()

    async def __aenter__(self) -> EventSubscription:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "ended" if self._ended else "closed store" if self._hub.closed else "open"
        return (
            f"<EventSubscription [{state} | {len(self._queue)}/{self._queue.maxlen} queued | "
            f"{self._dropped} dropped | {len(self._waiters)} waiting]>"
        )


class EventHub:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the event limit must be positive, got {limit}")
        self._limit = limit
        self._subscribers: weakref.WeakSet[EventSubscription] = weakref.WeakSet()
        self._parked: set[EventSubscription] = set()
        """Subscriptions a reader waits on: held strongly (see the module's docstring)."""
        self.closed = False

    def __len__(self) -> int:
        return len(self._subscribers)

    def publish(self, kind: EventKind, keys: tuple[Key, ...]) -> None:
        if not keys or not self._subscribers:
            return
        event = BlockEvent(kind, keys)
        for sub in self._subscribers:
            sub._push(event)

    def close(self) -> None:
        """End every subscription once its queue is read."""
        self.closed = True
        for sub in self._subscribers:
            sub._wake()

    def subscribe(self) -> EventSubscription:
        """A subscription that receives every event from this call on (not from its first read)."""
        sub = EventSubscription(self, self._limit)
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: EventSubscription) -> None:
        """``sub`` receives nothing more."""
        self._subscribers.discard(sub)

    def park(self, sub: EventSubscription) -> None:
        """A reader waits on ``sub``: held strongly until ``unpark()`` (see the module's docstring)."""
        self._parked.add(sub)

    def unpark(self, sub: EventSubscription) -> None:
        self._parked.discard(sub)
