"""Handing the GIL to the library's threads while the event loop is busy.

An event loop that never idles gives the GIL up and takes it back on every
iteration (its ``epoll`` call), and a thread waiting for the GIL then almost
never gets it: CPython's waiter asks the holder to let go only when nobody
gave the GIL up for a whole switch interval, and a woken waiter loses the
race to the loop's thread, which is already running. On a 16-core machine a
fill thread next to a saturated loop got no unit done in 15 s, and a tier's
own steps (a shrink, a close) took seconds to tens of seconds.

So while the library has work on its threads for a loop (a fill, a step on
an owner's worker, a copy), that loop sleeps a fraction of a millisecond at
a fixed cadence, without the GIL: a waiting thread takes it then, runs its
few microseconds of Python, and gives it back. The loop loses ``pause /
every`` of its time (2% by default), and only while such work is pending
for longer than ``every``; an idle loop sleeps in ``epoll`` anyway.

A copy holds the hand-off lightly (``hold_lightly_until``): it costs a
counter, not a timer. Its end leaves the timer to its next tick, which
stops the ticking if nothing else asks, and a tick pauses for light holds
only if one was held throughout the interval before it. A loop that awaits
one short copy after another then keeps one timer that never pauses, where
arming and cancelling a timer per copy cost an awaited 1 MiB host copy 4%
of its time.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["GilHandoff", "handoff"]


class GilHandoff:
    """Sleeps ``pause`` seconds on its loop every ``every`` seconds while there is demand.

    Demand is a count of pending work (``hold()`` / ``release()``) plus
    sources (callables, e.g. "my fill is running") asked at each tick. Loop
    thread only.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, *, every: float = 0.01, pause: float = 0.0002) -> None:
        self._loop = loop
        self._every = every
        self._pause = pause
        self._handle: asyncio.TimerHandle | None = None
        self._held = 0
        self._light = 0
        """Light holds (``hold_lightly_until``) pending."""
        self._light_gap = False
        """No light hold was pending at some moment since the last tick."""
        self._sources: set[Callable[[], bool]] = set()
        self.handoffs = 0
        """Pauses so far (a figure for tests and statistics)."""

    def hold(self) -> None:
        """One more piece of pending work; pair with ``release()``."""
        self._held += 1
        self.start()

    def hold_until(self, future: asyncio.Future[Any]) -> None:
        """Hold while ``future`` is pending: work on a thread that settles it through the loop."""
        self.hold()
        future.add_done_callback(lambda _: self.release())

    def release(self) -> None:
        self._held = max(0, self._held - 1)
        self._settle()

    def hold_lightly_until(self, future: asyncio.Future[Any]) -> None:
        """Hold while ``future`` is pending, for short work that comes often (a copy): no timer is
        cancelled when it ends, and a tick pauses for it only if such work was pending throughout."""
        self._light += 1
        if self._handle is None:
            self.start()
        future.add_done_callback(self.release_light)

    def release_light(self, _: object = None) -> None:
        """A light hold's end: called when its future settles, or by hand for one that never will."""
        self._light = max(0, self._light - 1)
        if not self._light:
            self._light_gap = True

    def add_source(self, source: Callable[[], bool]) -> None:
        """Ask ``source()`` at each tick; it keeps the hand-off going while true. Call ``start()`` after."""
        self._sources.add(source)

    def discard_source(self, source: Callable[[], bool]) -> None:
        self._sources.discard(source)
        self._settle()

    def _settle(self) -> None:
        """Stop now rather than at the next tick when nothing asks for the hand-off any more."""
        if self._handle is not None and not self._light and not self._demand():  # light holds: their tick
            self.stop()

    def start(self) -> None:
        """Begin ticking (idempotent); it stops by itself once there is no demand."""
        if self._handle is None and not self._loop.is_closed():
            # An interval begins: a light hold that ended before it (then a counted release stopped
            # the ticking) is no gap in it, and one pending now is pending from its start.
            self._light_gap = not self._light
            self._handle = self._loop.call_later(self._every, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    @property
    def ticking(self) -> bool:
        return self._handle is not None

    def _demand(self) -> bool:
        if self._held:
            return True
        for source in list(self._sources):
            try:
                if source():
                    return True
            except Exception:  # an owner half torn down: it has nothing left to hand the GIL to
                self._sources.discard(source)
        return False

    def _tick(self) -> None:
        self._handle = None
        light_throughout = bool(self._light) and not self._light_gap
        self._light_gap = False
        if light_throughout or self._demand():
            time.sleep(self._pause)  # without the GIL: a waiting thread takes it now
            self.handoffs += 1
        elif not self._light:
            return
        self._handle = self._loop.call_later(self._every, self._tick)


_per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, GilHandoff] = weakref.WeakKeyDictionary()


def handoff(loop: asyncio.AbstractEventLoop) -> GilHandoff:
    """The hand-off of ``loop`` (one per loop, made on first use)."""
    hand = _per_loop.get(loop)
    if hand is None:
        hand = _per_loop[loop] = GilHandoff(loop)
    return hand
