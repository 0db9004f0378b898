"""Copies in flight against a memory owner, so closing it waits for them.

Only the event loop thread adds; completion threads only set events; the
loop prunes finished ones. Nothing here takes a lock on the loop.
"""

from __future__ import annotations

import threading

import anyio

__all__ = ["InflightCopies"]


class InflightCopies:
    def __init__(self) -> None:
        self._events: list[threading.Event] = []

    def track(self, done: threading.Event) -> None:
        events = self._events
        if len(events) > 64:
            events[:] = [e for e in events if not e.is_set()]
        events.append(done)

    def __len__(self) -> int:
        return sum(not e.is_set() for e in self._events)

    async def drain(self) -> None:
        """Wait (off the loop) until every tracked copy has landed."""
        pending = [e for e in self._events if not e.is_set()]
        self._events.clear()
        if pending:
            await anyio.to_thread.run_sync(lambda: [e.wait() for e in pending])
