"""For the tests of objects shared by several event loops, run in child processes (which have the
repository on ``PYTHONPATH``): a HostTier whose tracking of a copy can be held at a gate (the window
between a copy's checks and its queueing, opened on purpose), and the reaping of a forked child."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from aiokvtier import HostTier


class HeldCopies:
    """A region's copies in flight: a tracking for which ``hold()`` says True sets ``entered``, then
    waits for ``gate`` (30 s at most) before it tracks."""

    def __init__(self, real: Any, hold: Callable[[], bool], entered: threading.Event, gate: threading.Event) -> None:
        self._real, self._hold, self._entered, self._gate = real, hold, entered, gate

    def track(self, done: Any) -> None:
        if self._hold():
            self._entered.set()
            assert self._gate.wait(30), "the gate was never opened"
        self._real.track(done)

    def __len__(self) -> int:
        return len(self._real)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class HeldTier(HostTier):
    """A HostTier whose ``copies`` (a public property) are held as ``HeldTier.hold`` says."""

    hold: Callable[[], bool] = staticmethod(lambda: False)
    entered = threading.Event()
    gate = threading.Event()

    @property
    def copies(self) -> Any:
        if "held" not in self.__dict__:
            self.__dict__["held"] = HeldCopies(super().copies, type(self).hold, self.entered, self.gate)
        return self.__dict__["held"]


def once(condition: Callable[[], bool]) -> Callable[[], bool]:
    """True the first time ``condition()`` is, then never again."""
    armed = [True]

    def hold() -> bool:
        if armed[0] and condition():
            armed[0] = False
            return True
        return False

    return hold


async def reap(pid: int, seconds: float) -> bool:
    """Wait (polling, on the loop) for the forked child ``pid`` to exit: True if it did within ``seconds``,
    else it is killed (SIGKILL), reaped, and False."""
    import asyncio
    import os
    import signal

    for _ in range(int(seconds / 0.01)):
        done, _status = os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 (WNOHANG: never waits)
        if done:
            return True
        await asyncio.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)  # noqa: ASYNC222 (killed: returns at once)
    return False
