"""The store's event stream: what a router or a prefix-aware scheduler subscribes to.

Every subscriber gets its own bounded queue. Publishing never waits: when a
subscriber falls behind, its oldest events are dropped and the next event it
reads says how many (``BlockEvent.dropped``). Everything runs on the store's
event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

__all__ = ["BlockEvent", "EventHub"]

Key = bytes | int
EventKind = Literal["stored", "evicted", "discarded"]


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """Blocks that became visible (``"stored"``) or left the store (``"evicted"``, ``"discarded"``)."""

    kind: EventKind
    keys: tuple[Key, ...]
    dropped: int = 0
    """Events this subscriber missed just before this one (it read too slowly)."""


class _Subscriber:
    __slots__ = ("dropped", "queue", "wakeup")

    def __init__(self, limit: int) -> None:
        self.queue: deque[BlockEvent] = deque(maxlen=limit)
        self.dropped = 0
        self.wakeup = asyncio.Event()


class EventHub:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the event limit must be positive, got {limit}")
        self._limit = limit
        self._subscribers: set[_Subscriber] = set()
        self._closed = False

    def publish(self, kind: EventKind, keys: tuple[Key, ...]) -> None:
        if not keys or not self._subscribers:
            return
        event = BlockEvent(kind, keys)
        for sub in self._subscribers:
            if len(sub.queue) == self._limit:
                sub.dropped += 1  # the deque drops the oldest itself
            sub.queue.append(event)
            sub.wakeup.set()

    def close(self) -> None:
        """End every subscription once its queue is read."""
        self._closed = True
        for sub in self._subscribers:
            sub.wakeup.set()

    def subscribe(self) -> AsyncIterator[BlockEvent]:
        """A subscription that receives every event from this call on (not from its first read)."""
        sub = _Subscriber(self._limit)
        self._subscribers.add(sub)
        return self._read(sub)

    async def _read(self, sub: _Subscriber) -> AsyncIterator[BlockEvent]:
        try:
            while True:
                while sub.queue:
                    event = sub.queue.popleft()
                    if sub.dropped:
                        event = BlockEvent(event.kind, event.keys, sub.dropped)
                        sub.dropped = 0
                    yield event
                if self._closed:
                    return
                sub.wakeup.clear()
                await sub.wakeup.wait()
        finally:
            self._subscribers.discard(sub)
