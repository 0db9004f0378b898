"""Handing the GIL to the fill threads while the event loop is busy.

An event loop that never idles gives the GIL up and takes it back on every
iteration (its ``epoll`` call), and a thread waiting for the GIL then almost
never gets it: CPython's waiter asks the holder to let go only when nobody
gave the GIL up for a whole switch interval, and a woken waiter loses the
race to the loop's thread, which is already running. On a 16-core machine a
fill thread next to a saturated loop got no unit done in 15 s.

So while its fill runs, a tier's loop sleeps a fraction of a millisecond at a
fixed cadence, without the GIL: a waiting fill thread takes it then, runs the
few microseconds of Python between two units, and gives it back. The loop
loses ``pause / every`` of its time (2% by default) and only while a fill is
running; an idle loop sleeps in ``epoll`` anyway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["GilHandoff"]


class GilHandoff:
    """Sleeps ``pause`` seconds on the loop every ``every`` seconds while ``active()`` is true."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        active: Callable[[], bool],
        *,
        every: float = 0.01,
        pause: float = 0.0002,
    ) -> None:
        self._loop = loop
        self._active = active
        self._every = every
        self._pause = pause
        self._handle: asyncio.TimerHandle | None = None
        self.handoffs = 0
        """Pauses so far (a figure for tests and statistics)."""

    def start(self) -> None:
        """Begin (idempotent); call on the loop. It stops by itself once ``active()`` is false."""
        if self._handle is None and not self._loop.is_closed():
            self._handle = self._loop.call_later(self._every, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        self._handle = None
        try:
            active = self._active()
        except Exception:  # the tier is half torn down: nothing left to hand the GIL to
            return
        if not active:
            return
        time.sleep(self._pause)  # without the GIL: a waiting fill thread takes it now
        self.handoffs += 1
        self._handle = self._loop.call_later(self._every, self._tick)
