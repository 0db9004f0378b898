from __future__ import annotations

import asyncio
import errno
import gc
import os
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any

import pytest

from aiokvtier._host import _linux, _userfault

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a test dependency on Linux
    uvloop = None


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], Any]]:
    """Every async test runs on asyncio and on uvloop."""
    factories: dict[str, Callable[[], Any]] = {"asyncio": asyncio.new_event_loop}
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


def _cuda_device_count() -> int:
    from aiokvtier import CudaUnavailableError
    from aiokvtier._cuda._driver import device_count

    try:
        return device_count()
    except CudaUnavailableError:
        return 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any("cuda" in item.keywords for item in items):
        return
    if _cuda_device_count() == 0:
        skip = pytest.mark.skip(reason="no CUDA device (driver or cuda-bindings missing, or no GPU)")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_blocking_in_loop(request: pytest.FixtureRequest) -> Iterator[None]:
    """Async tests run with blockbuster: a blocking call on the event loop fails the test."""
    if not asyncio.iscoroutinefunction(getattr(request.node, "function", None)):
        yield
        return
    from blockbuster import BlockBuster

    bb = BlockBuster()
    # Tests themselves read /proc to check mappings and placement; the library
    # reads tiny procfs/sysfs files at open (placement and host facts), which
    # cannot block on I/O.
    for name in ("io.BufferedReader.read", "io.TextIOWrapper.read", "io.FileIO.read", "os.stat"):
        fn = bb.functions.get(name)
        if fn is not None:
            fn.can_block_in("aiokvtier/_host/_placement.py", {"read_placement"})
            fn.can_block_in(
                "aiokvtier/_sysinfo.py", {"cgroup_memory_limit", "_cgroup_dir", "online_nodes", "node_cpus"}
            )
            fn.can_block_in("tests/conftest.py", {"proc_text"})
    # The loop's GIL hand-off to the library's threads: a 0.2 ms sleep every 10 ms while they
    # have work pending, by design (aiokvtier/_handoff.py).
    bb.functions["time.sleep"].can_block_in("aiokvtier/_handoff.py", {"_tick"})
    for name in ("threading.Lock.acquire", "threading.Lock.acquire_lock", "threading.Thread.join"):
        fn = bb.functions.get(name)
        if fn is not None:
            # Joining a worker whose last job has run (see Lifecycle._finish_close).
            fn.can_block_in("aiokvtier/_lifecycle.py", {"_finish_close"})
    for name in ("threading.Lock.acquire", "threading.Lock.acquire_lock"):
        # The index mirror's count of reads in flight, shared by the loop's lookups and those on other
        # threads (``lookup_nowait``, ``contains_nowait``): held for an increment, by design.
        bb.functions[name].can_block_in("aiokvtier/_pool/_mirror.py", {"_enter", "_leave", "close"})
        # The tests' populate gate is shared with fill threads by design.
        bb.functions[name].can_block_in(
            "tests/conftest.py",
            {"allow", "fail", "hold_addresses", "unhold_addresses", "release_all"},
        )
    bb.activate()
    try:
        yield
    finally:
        bb.deactivate()


def proc_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def mappings_in(base: int, size: int) -> list[str]:
    """Lines of /proc/self/maps that overlap ``[base, base+size)``."""
    out = []
    for line in proc_text("/proc/self/maps").splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo < base + size and hi > base:
            out.append(line)
    return out


def smaps_flags(addr: int) -> set[str]:
    """VmFlags of the mapping containing ``addr``."""
    inside = False
    for line in proc_text("/proc/self/smaps").splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


def fill_threads_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("aiokvtier-")]


class PopulateGate:
    """Replaces populate: the k-th call (in call order) waits until let through, or fails."""

    def __init__(self, real: Callable[[int, int], None]) -> None:
        self._real = real
        self._cond = threading.Condition()
        self.allowed = 0
        self.calls = 0
        self.fail_at: set[int] = set()
        self.held_addresses: list[int] = []
        self.seen: list[tuple[int, int, str, set[int]]] = []
        self.returned = 0
        """Calls that populated their range and returned."""

    def __call__(self, addr: int, length: int) -> None:
        with self._cond:
            index = self.calls
            self.calls += 1
            self.seen.append((addr, length, threading.current_thread().name, os.sched_getaffinity(0)))
            self._cond.wait_for(
                lambda: (self.allowed > index and addr not in self.held_addresses) or index in self.fail_at,
                timeout=60,
            )
            if index in self.fail_at:
                raise OSError(errno.ENOMEM, f"injected failure at call {index}")
        self._real(addr, length)
        with self._cond:
            self.returned += 1

    def allow(self, n: int) -> None:
        with self._cond:
            self.allowed = n
            self._cond.notify_all()

    def fail(self, index: int) -> None:
        with self._cond:
            self.fail_at.add(index)
            self._cond.notify_all()

    def hold_addresses(self, addresses: list[int]) -> None:
        """Hold calls at these addresses (the list may be filled in later, e.g. by ``reserved``)."""
        with self._cond:
            self.held_addresses = addresses

    def unhold_addresses(self) -> None:
        with self._cond:
            self.held_addresses = []
            self._cond.notify_all()

    def release_all(self) -> None:
        with self._cond:
            self.held_addresses = []
        self.allow(1 << 60)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[PopulateGate]:
    g = PopulateGate(_linux.populate)
    monkeypatch.setattr(_linux, "populate", g)
    yield g
    g.release_all()


@pytest.fixture
def fill_threads_cannot_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting a fill thread raises what CPython raises when the system has no thread to give."""
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name.startswith("aiokvtier-fill-"):
            raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)


@pytest.fixture
def touch_fill(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiers opened in the test fill by touching (and populate calls), as where the kernel has no
    userfaultfd copies: for tests of that path on kernels that have them."""
    monkeypatch.setattr(_userfault, "supported", lambda: False)


@pytest.fixture
def reserved(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Base addresses of every reservation made during the test."""
    bases: list[int] = []
    real = _linux.mmap_reserve

    def spy(length: int, align: int) -> tuple[int, int]:
        base, size = real(length, align)
        bases.append(base)
        return base, size

    monkeypatch.setattr(_linux, "mmap_reserve", spy)
    return bases


@pytest.fixture
def tiny_switch_interval() -> Iterator[None]:
    """Threads switch every microsecond: what one thread reads while others write it (a figure, a
    read-modify-write) is interleaved often."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def run_on_new_loop(name: str, main: Callable[[], Coroutine[Any, Any, object]]) -> None:
    """Run ``main()`` on a fresh event loop of kind ``name`` ("asyncio" or "uvloop") on this thread."""
    import uvloop

    factory = uvloop.new_event_loop if name == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())


async def raised_on_another_loop(
    calls: Sequence[Callable[[], Awaitable[object]]], within: float = 10.0
) -> list[BaseException]:
    """Await each of ``calls`` in turn on an asyncio loop of a new thread, at most ``within`` seconds
    each; what they raised, in order (a call that returned adds nothing)."""
    seen: list[BaseException] = []

    async def each() -> None:
        for call in calls:
            try:
                async with asyncio.timeout(within):
                    await call()
            except BaseException as exc:
                seen.append(exc)

    thread = threading.Thread(target=lambda: asyncio.run(each()))
    thread.start()
    await asyncio.to_thread(thread.join, within * (len(calls) + 1))
    assert not thread.is_alive(), "the calls on the other loop did not end"
    return seen


def copies_back_and_forth(engine: Any, config: Any, rounds: int, errors: list[BaseException]) -> Callable[[str], None]:
    """A thread's target: on a new event loop of kind ``name``, a tier of ``config`` of its own and
    ``rounds`` copies of two of its slots to and from a host array through ``engine`` (shared with other
    loops); what raises is appended to ``errors``."""
    import numpy as np

    from aiokvtier import HostTier

    def one_loop(name: str) -> None:
        async def copies() -> None:
            async with HostTier(config) as tier:
                await tier.wait_resident()
                slots = await tier.allocate(2)
                page = np.zeros((2, 4096), dtype=np.uint8)
                for i in range(rounds):
                    if i % 2:
                        await engine.to_device(tier, slots, page)
                    else:
                        await engine.to_host(tier, slots, page)

        try:
            run_on_new_loop(name, copies)
        except BaseException as exc:
            errors.append(exc)

    return one_loop


@pytest.fixture
def views_collected() -> Iterator[None]:
    """Collect the garbage after the test: a test that leaves views of a StaticHostMem in reference cycles
    (the tracebacks of its cancelled and failed copies) keeps the buffer's thread alive until they are
    collected, as documented; collected here, that thread ends with its own test, not during a later one."""
    yield
    gc.collect()
