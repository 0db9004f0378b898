"""For the tests of objects shared by several event loops, run in child processes (which have the
repository on ``PYTHONPATH``): a HostTier whose tracking of a copy can be held at a gate (the window
between a copy's checks and its queueing, opened on purpose), a copy from a thread's loop of its own,
what the owner does while that thread is held, a forked child run and reaped, and a busy engine (its first
copy held in flight)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np

from aiokvtier import CopyEngine, HostTier, StaticHostMem
from aiokvtier.testing import RecordingBackend

from .helpers import small_config
from .invariants import wait_no_library_threads

SLOT = 64 << 10


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


def copy_on_its_own_loop(
    run: Callable[[Callable[[], Awaitable[None]]], None],
    copy: Callable[[], Awaitable[object]],
    outcome: list[str],
    refused: type[BaseException] | tuple[type[BaseException], ...] = (),
) -> Callable[[], None]:
    """A thread's target: ``run`` (the script's runner, on the loop kind it was started for) awaits
    ``copy()`` on a loop of the thread's own; ``outcome`` gets "copied", or "refused: " and the error
    for one of ``refused`` (anything else raises on that thread)."""

    async def attempt() -> None:
        try:
            await copy()
            outcome.append("copied")
        except refused as exc:
            outcome.append("refused: " + str(exc))

    return lambda: run(attempt)


async def while_held(
    target: Callable[[], None],
    during: Callable[[], Awaitable[object]],
    gate: threading.Event,
    entered: threading.Event,
    join: float = 30,
    **thread: Any,
) -> threading.Thread:
    """Start ``target`` on a thread (``thread``: the Thread's other arguments); once it is held (``entered``
    set, 30 s at most), await ``during()``; then open ``gate``, whatever happened, and join the thread
    (``join`` seconds at most). Returns the thread, to ask whether it ended."""
    import asyncio

    held = threading.Thread(target=target, **thread)
    held.start()
    try:
        assert await asyncio.to_thread(entered.wait, 30), "the thread was never held"
        await during()
    finally:
        gate.set()
        await asyncio.to_thread(held.join, join)
    return held


async def in_a_fork(child: Callable[[], Awaitable[None]], seconds: float) -> bool:
    """Fork; the child awaits ``child()`` and exits at once (status 0, whatever happened; nothing of the
    parent's runs on in it); the parent reaps it: True if it exited within ``seconds`` (see ``reap``)."""
    import os

    pid = os.fork()
    if pid == 0:
        try:
            await child()
        finally:
            os._exit(0)
    return await reap(pid, seconds)


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


@asynccontextmanager
async def busy_engine(**backend: Any) -> AsyncIterator[tuple[HostTier, StaticHostMem, CopyEngine, RecordingBackend]]:
    """A tier of 64 allocated slots (slot ``s`` holds bytes ``s + 1``), a staging buffer of 64 rows, and an
    engine over a RecordingBackend whose first job (slot 0 into the last row) is issued and held: the
    engine is busy, and requests made now are deferred. On exit the held jobs land and the threads go."""
    recording = RecordingBackend(hold=True, memmove=True, **backend)
    async with (
        HostTier(small_config()) as tier,
        StaticHostMem(64 * SLOT) as stage,
        CopyEngine(None, backend=recording) as engine,
    ):
        await asyncio.wait_for(tier.wait_resident(), 60)
        slots = await tier.allocate(64)
        assert slots == list(range(64))
        for s in slots:
            tier.view(s)[:] = bytes([s + 1]) * SLOT
        first = asyncio.ensure_future(engine.to_device(tier, [0], [stage.address + 63 * SLOT]))
        await asyncio.wait_for(recording.wait_issued(1), 30)
        yield tier, stage, engine, recording
        recording.release()
        await asyncio.wait_for(first, 30)
    await wait_no_library_threads()


def staged_rows(stage: StaticHostMem) -> np.ndarray:
    """A copy of the staging buffer's rows now (no view left exported, which would keep it mapped)."""
    with stage.view() as view:
        return np.frombuffer(view, dtype=np.uint8).reshape(-1, SLOT).copy()
