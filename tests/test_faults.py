"""Faults injected into the lifecycle: threads that cannot start, memory that runs out, fork, finalizers.

Each test checks that the failure is reported as the documented error and
that nothing is left behind: no reservation, no library thread, a tier
object that closes at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from aiokvtier import FillError, HostTier, TierClosedError
from aiokvtier._host._backing import HostBacking
from aiokvtier._host._slots import SlotAllocator

from .helpers import HostBackings, MiB, eventually, small_config
from .invariants import assert_no_library_threads, check_tier, fill_threads, leaked, wait_no_library_threads

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a test dependency on Linux
    uvloop = None

HANG = 10.0
ROOT = Path(__file__).resolve().parents[1]


# -- (a) a fill thread that cannot start ------------------------------------------------------


class ThreadRefusal:
    def __init__(self) -> None:
        self.on = True
        self.refused = 0


@pytest.fixture
def refuse_fill_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[ThreadRefusal]:
    """``Thread.start`` of an ``aiokvtier-fill-*`` thread fails as it does at the process's thread limit."""
    state = ThreadRefusal()
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if state.on and self.name.startswith("aiokvtier-fill-"):
            state.refused += 1
            raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    yield state


async def test_open_fails_cleanly_when_no_fill_thread_can_start(
    refuse_fill_threads: ThreadRefusal, reserved: list[int]
) -> None:
    cfg = small_config()
    with pytest.raises(FillError, match=r"(?i)thread"):
        await asyncio.wait_for(HostTier.open(cfg), HANG)
    assert refuse_fill_threads.refused
    tier = HostTier(cfg)
    with pytest.raises(FillError, match=r"(?i)thread"):
        await asyncio.wait_for(tier.__aenter__(), HANG)
    assert len(reserved) == 2
    assert not leaked(reserved, cfg.max_quota), "a failed open left its reservation mapped"
    assert tier.closed
    await asyncio.wait_for(tier.aclose(), 1)
    await wait_no_library_threads()


async def test_grow_fails_cleanly_when_no_fill_thread_can_start(refuse_fill_threads: ThreadRefusal) -> None:
    refuse_fill_threads.on = False
    tier = await asyncio.wait_for(HostTier.open(small_config(quota=8 * MiB, max_quota=64 * MiB)), HANG)
    try:
        await asyncio.wait_for(tier.wait_resident(), HANG)
        await eventually(lambda: not fill_threads())  # the fill is done: its thread has exited, a grow must start one
        slots = await tier.allocate(4)
        refuse_fill_threads.on = True
        with pytest.raises(FillError, match=r"(?i)thread"):
            await asyncio.wait_for(tier.resize(32 * MiB), HANG)
        assert refuse_fill_threads.refused
        s = tier.statistics()
        assert s.quota == 8 * MiB, f"a grow that could not start its fill left the quota at {s.quota}"
        assert s.slots_allocated == 4
        check_tier(tier)
        refuse_fill_threads.on = False
        await asyncio.wait_for(tier.resize(32 * MiB), HANG)
        await asyncio.wait_for(tier.wait_resident(), HANG)
        s = check_tier(tier, settled=True)
        assert s.quota == 32 * MiB and s.fill_error is None
        await asyncio.wait_for(tier.allocate(s.slots_free), HANG)
        tier.free_many(slots)
    finally:
        refuse_fill_threads.on = False
        await asyncio.wait_for(tier.aclose(), HANG)
    await wait_no_library_threads()


# -- (b) MemoryError while opening -----------------------------------------------------------


async def test_memory_error_during_open_releases_everything(
    monkeypatch: pytest.MonkeyPatch, reserved: list[int]
) -> None:
    def out_of_memory(self: SlotAllocator, total: int) -> None:
        raise MemoryError

    monkeypatch.setattr(SlotAllocator, "__init__", out_of_memory)
    cfg = small_config()
    tier = HostTier(cfg)
    with pytest.raises(MemoryError):
        await asyncio.wait_for(tier.__aenter__(), HANG)
    with pytest.raises(MemoryError):
        await asyncio.wait_for(HostTier.open(cfg), HANG)
    assert len(reserved) == 2
    assert not leaked(reserved, cfg.max_quota), "an open that ran out of memory left its reservation mapped"
    assert tier.closed, f"a failed open left the tier {tier!r}"
    await asyncio.wait_for(tier.aclose(), 1)
    await wait_no_library_threads()


# -- (c) RLIMIT_AS, in a subprocess -----------------------------------------------------------

RLIMIT_SCRIPT = """
import asyncio, errno, resource, sys, threading
import anyio
from aiokvtier import HostTier, HostTierConfig
MiB, GiB = 1 << 20, 1 << 30

def vm_size():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

async def main():
    await anyio.to_thread.run_sync(lambda: None)  # the worker thread exists before the limit
    limit = vm_size() + GiB
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    cfg = HostTierConfig(quota=64 * MiB, max_quota=8 * GiB, slot_size=64 * 1024, commit_unit=MiB, fill_chunk=MiB)
    tier = HostTier(cfg)
    try:
        await asyncio.wait_for(tier.__aenter__(), 30)
    except OSError as exc:
        assert exc.errno == errno.ENOMEM, f"expected ENOMEM, got {exc!r}"
        print("error:", exc)
    else:
        raise AssertionError("a reservation past RLIMIT_AS succeeded")
    assert tier.closed, repr(tier)
    await asyncio.wait_for(tier.aclose(), 5)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("aiokvtier-")]
    assert vm_size() < limit - GiB // 2, "address space was left behind"
    # The process is still able to open a tier that fits.
    small = HostTierConfig(quota=16 * MiB, max_quota=64 * MiB, slot_size=64 * 1024, commit_unit=MiB, fill_chunk=MiB)
    async with HostTier(small) as ok:
        await asyncio.wait_for(ok.wait_resident(), 30)
    print("ok")

if sys.argv[1] == "uvloop":
    import uvloop
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
else:
    asyncio.run(main())
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_address_space_limit_gives_a_clear_enomem(loop: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", RLIMIT_SCRIPT, loop], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    assert done.stdout.rstrip().endswith("ok")


# -- (d) fork ---------------------------------------------------------------------------------


def loop_factory(loop: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if loop == "uvloop":
        if uvloop is None:
            pytest.skip("uvloop is not installed")
        return uvloop.new_event_loop  # type: ignore[no-any-return]
    return asyncio.new_event_loop


def _child_checks(tier: HostTier, factory: Callable[[], asyncio.AbstractEventLoop]) -> list[str]:
    """In the forked child: every call must raise TierClosedError naming fork, within 5 s."""
    report: list[str] = []

    def expect(name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except TierClosedError as exc:
            ok = "fork" in str(exc).lower()
            report.append(f"{name}: ok" if ok else f"{name}: TierClosedError not naming fork: {exc}")
        except BaseException as exc:
            report.append(f"{name}: raised {exc!r}")
        else:
            report.append(f"{name}: returned without an error")

    with asyncio.Runner(loop_factory=factory) as runner:
        expect("resize", lambda: runner.run(asyncio.wait_for(tier.resize(8 * MiB), 5)))
        expect("allocate", lambda: runner.run(asyncio.wait_for(tier.allocate(), 5)))
    expect("wait_resident_blocking", lambda: tier.wait_resident_blocking(None, timeout=5))
    return report


def _wait_child(pid: int, within: float) -> int:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"the forked child hung for {within} s")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_forked_child_cannot_use_the_tier(loop: str) -> None:
    factory = loop_factory(loop)
    with asyncio.Runner(loop_factory=factory) as runner:
        tier = runner.run(asyncio.wait_for(HostTier.open(small_config(quota=16 * MiB)), HANG))
        try:
            runner.run(asyncio.wait_for(tier.wait_resident(), HANG))
            runner.run(tier.allocate(4))
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: never returns into pytest
                code = 2
                try:
                    os.close(read_end)
                    signal.alarm(30)  # a hang kills the child; the parent reports it
                    report = _child_checks(tier, factory)
                    os.write(write_end, "\n".join(report).encode())
                    code = 0 if all(line.endswith(": ok") for line in report) else 1
                finally:
                    os._exit(code)
            os.close(write_end)
            status = _wait_child(pid, 40)
            with os.fdopen(read_end) as f:
                report = f.read()
            assert os.WIFEXITED(status), f"the child died of signal {os.WTERMSIG(status)}\n{report}"
            assert os.WEXITSTATUS(status) == 0, f"in the forked child:\n{report}"
            # The parent's tier is untouched by the child.
            runner.run(asyncio.wait_for(tier.resize(32 * MiB), HANG))
            runner.run(asyncio.wait_for(tier.wait_resident(), HANG))
            more = runner.run(asyncio.wait_for(tier.allocate(300), HANG))
            tier.view(more[-1])[:4] = b"kvkv"
            assert tier.statistics().slots_allocated == 304
        finally:
            runner.run(asyncio.wait_for(tier.aclose(), HANG))
    assert_no_library_threads()


# -- (e) the last view dropped on the loop thread -----------------------------------------------


async def test_dropping_the_last_view_does_not_unmap_on_the_loop() -> None:
    seen: list[threading.Thread] = []

    class Spy(HostBacking):
        def release(self, committed: list[tuple[int, int]]) -> None:
            seen.append(threading.current_thread())
            super().release(committed)

    cfg = small_config()
    tier = await asyncio.wait_for(HostTier.open(cfg, backings=HostBackings(Spy)), HANG)
    base = tier.statistics().base_address
    await asyncio.wait_for(tier.wait_resident(MiB), HANG)
    view = tier.view(await tier.allocate())
    view[:4] = b"kvkv"
    await asyncio.wait_for(tier.aclose(), HANG)
    assert not tier.released and not seen, "the range was released under a live view"
    loop_thread = threading.current_thread()
    del view  # the last view goes on the loop's thread
    deadline = time.monotonic() + 5
    while not tier.released and time.monotonic() < deadline:  # noqa: ASYNC110 - nothing to await
        await asyncio.sleep(0.01)
    assert tier.released, "the range was not released within 5 s of the last view"
    assert len(seen) == 1
    assert seen[0] is not loop_thread, f"the release (munmap) ran on the event loop's thread ({seen[0].name})"
    assert not leaked([base], cfg.max_quota)
    await wait_no_library_threads()
