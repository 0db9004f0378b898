from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from aiokvtier import HostTierConfig, TierClosedError
from aiokvtier._backings import DefaultBackings
from aiokvtier._config import ResolvedHostConfig
from aiokvtier._host._backing import Backing, HostBacking
from aiokvtier._lifecycle import Owner

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def small_config(**overrides: Any) -> HostTierConfig:
    """64 one-MiB units of 16 slots each: one populate call per unit, in order."""
    values: dict[str, Any] = dict(
        quota=64 * MiB,
        max_quota=256 * MiB,
        slot_size=64 * KiB,
        commit_unit=1 * MiB,
        fill_chunk=1 * MiB,
        fill_threads=1,
    )
    values.update(overrides)
    return HostTierConfig(**values)


async def eventually(predicate: Callable[[], bool], within: float = 5.0) -> None:
    """Wait (on the loop) until ``predicate()``: for what library threads finish after a call returns."""
    deadline = asyncio.get_running_loop().time() + within
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not true after {within} s: {predicate}")
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def saturated(within: float = 30.0) -> AsyncIterator[list[int]]:
    """A task that keeps the loop busy (about a millisecond of Python, then one loop iteration) while the
    body runs: a loop that never idles, which starves threads that need the GIL often. Yields its spin
    count, so the body can see it ran; the task's end is bounded by ``within`` seconds."""
    stop = asyncio.Event()
    spins = [0]

    async def busy() -> None:
        x = 0
        while not stop.is_set():
            for i in range(20_000):
                x += i
            spins[0] += 1
            await asyncio.sleep(0)

    hog = asyncio.create_task(busy())
    try:
        yield spins
    finally:
        stop.set()
        async with asyncio.timeout(within):
            await hog


async def closing_with_a_copy_held(region: Any) -> tuple[threading.Event, asyncio.Task[None]]:
    """Start ``region.aclose()`` with a copy in flight over it (an Event tracked as one) and return once
    the region is closing: the Event (set it to let the close finish) and the close's task."""
    held = threading.Event()
    region.copies.track(held)  # a copy in flight: the close waits for it
    closing = asyncio.create_task(region.aclose())
    for _ in range(100):
        await asyncio.sleep(0)
        if region.state == "closing":
            break
    assert region.state == "closing"
    return held, closing


def state_of(owner: Owner) -> str:
    """The state ``check_open()`` names ("the HostTier is new"), or "open" (not for an owner opened
    before a ``fork()``: that message is a sentence of its own)."""
    try:
        owner.check_open()
    except TierClosedError as exc:
        return re.match(r"the \w+ is (\w+)", str(exc)).group(1)  # type: ignore[union-attr]
    return "open"


class HostBackings:
    """Hands a tier a ``HostBacking`` subclass (a test's faults in one of its calls) and keeps each one built.

    Only the tiers opened with it see the faults: ``HostTier.open(config, backings=HostBackings(Flaky))``.
    """

    def __init__(self, kind: type[HostBacking] = HostBacking) -> None:
        self.kind = kind
        self.built: list[HostBacking] = []

    def numa_node(self, config: ResolvedHostConfig) -> int | None:
        return DefaultBackings().numa_node(config)

    def make(self, config: ResolvedHostConfig, node: int | None) -> Backing:
        backing = self.kind.from_config(config, node)
        self.built.append(backing)
        return backing


def descriptors() -> list[str]:
    """This process's open descriptors (their targets), IP sockets and unnamed Unix sockets left out.

    The library opens neither: its Unix sockets (a pool's) are bound to, or connected to, a path. A
    Mooncake client an earlier test had to keep (a transfer might still use it: ``_mooncake/_client.py``)
    goes on reconnecting to its gone master from its own threads for the rest of the process, opening
    and closing TCP sockets (unbound ones too, which ``/proc/net/tcp`` does not list: each socket is
    asked) and socket pairs of its own at any moment; an event loop's wake-up pair is one too."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, or one closed meanwhile
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("socket:") and not _counted_socket(int(name)):
                continue
            out.append(target)
    return sorted(out)


def _counted_socket(fd: int) -> bool:
    """Not an IP socket, nor a Unix socket without a name at either end (a socket pair)."""
    with socket.socket(fileno=os.dup(fd)) as sock:  # a duplicate: closing it leaves the owner's open
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            return False
        if sock.family != socket.AF_UNIX:
            return True
        try:
            peer = sock.getpeername()
        except OSError:  # not connected: a listening or unconnected socket, named by its own address
            peer = ""
        return bool(sock.getsockname() or peer)


@contextlib.contextmanager
def gil_thrashed(spinners: int = 2, interval: float = 1e-6) -> Iterator[None]:
    """Threads switch every ``interval`` and ``spinners`` threads spin beside the body: a thread of the
    library loses the GIL between almost any two bytecodes, so a window between two of its steps that
    another thread can see into is seen."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    threads = [threading.Thread(target=spin, name="test-spinner") for _ in range(spinners)]
    before = sys.getswitchinterval()
    for thread in threads:
        thread.start()
    sys.setswitchinterval(interval)
    try:
        yield
    finally:
        sys.setswitchinterval(before)
        stop.set()
        for thread in threads:
            thread.join(30)
