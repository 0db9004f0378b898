"""A region named by an *array* over its memory, on asyncio and uvloop.

A tier or a StaticHostMem may be named by addresses, through a view that
keeps it mapped, or by an array made over its memory (from its address, by
a foreign library): its close and shrink must wait for a copy over it in
each case. Before, an array was never located, so the region's close
unmapped under the memmove (SIGSEGV), and a shrunk tail took the copy.

Copies are held, where a test needs one in flight, by replacing the
function that runs it on its thread with a gated one; every await is
bounded, so a regression fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import pytest

import aiokvtier._store._store as store_module
from aiokvtier import (
    BlockStore,
    CopyEngine,
    CopyPlanError,
    HostTier,
    HostTierConfig,
    StaticHostMem,
)
from aiokvtier._cuda import _requests

from .helpers import KiB, MiB, eventually
from .invariants import wait_no_library_threads

T = TypeVar("T")
HANG = 10.0
SLOT = 256 * KiB
ROWS = 64  # 16 MiB per copy: a few milliseconds of memmove


async def bounded(aw: Awaitable[T], within: float = HANG) -> T:
    """Await ``aw`` in a task of its own, failing (not hanging) after ``within`` s."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=within)
    if not done:
        task.cancel()
        raise AssertionError(f"still running after {within} s")
    return task.result()


def over(address: int, rows: int, row: int) -> np.ndarray:
    """A writable array over raw memory: no view of its owner's, so nothing keeps it mapped."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * (rows * row)).from_address(address)).reshape(rows, row)


def config(rows: int = ROWS) -> HostTierConfig:
    return HostTierConfig(quota=rows * SLOT, max_quota=rows * SLOT, slot_size=SLOT, commit_unit=MiB)


class Held:
    """Replaces the function a library thread copies with: each call waits until let through."""

    def __init__(self, real: Callable[..., None]) -> None:
        self.real = real
        self.entered = threading.Event()
        self.open = threading.Event()

    def __call__(self, *args: Any) -> None:
        self.entered.set()
        self.open.wait(HANG)
        self.real(*args)

    async def started(self) -> None:
        await eventually(self.entered.is_set, HANG)

    async def release(self) -> None:
        await asyncio.to_thread(self.open.set)


@pytest.fixture
def held_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[Held]:
    gate = Held(store_module._memmove_all)
    monkeypatch.setattr(store_module, "_memmove_all", gate)
    yield gate
    gate.open.set()


async def _still_closing(closing: asyncio.Future[None], region: Any) -> None:
    for _ in range(20):  # it waits for the held copy, so no number of turns can let it finish
        await asyncio.sleep(0)
    assert not closing.done() and not region.released, f"{region!r} closed under a copy from an array over it"


# -- a region named by an array over its memory ---------------------------------------------


@pytest.mark.parametrize("kind", ["to_device", "to_host", "begin"])
async def test_an_array_over_a_static_buffer_holds_its_close(kind: str) -> None:
    tier = await bounded(HostTier.open(config()))
    try:
        await bounded(tier.wait_resident())
        slots = await tier.allocate(ROWS)
        for slot in slots:
            tier.view(slot)[:] = bytes([slot % 251 + 1]) * SLOT
        async with CopyEngine(None) as engine:
            buf = await bounded(StaticHostMem.open(ROWS * SLOT))
            pages = over(buf.address, ROWS, SLOT)
            if kind == "to_host":
                pages[:] = 7
            held = Held(engine._copy_host)
            engine._copy_host = held  # type: ignore[method-assign]
            if kind == "begin":
                started = engine.begin(tier, slots, pages, "h2d")
                call: asyncio.Future[None] = asyncio.ensure_future(started.done)
            else:
                method = engine.to_device if kind == "to_device" else engine.to_host
                call = asyncio.ensure_future(method(tier, slots, pages))
            closing: asyncio.Future[None] | None = None
            try:
                await held.started()
                assert len(buf.copies) == 1, "a copy from an array over the buffer is not registered with it"
                closing = asyncio.ensure_future(buf.aclose())
                await _still_closing(closing, buf)
            finally:
                await held.release()
                await bounded(call)
                if closing is None:
                    await bounded(buf.aclose())
            if kind == "to_host":
                assert all(bytes(tier.view(slot))[:: SLOT // 8] == b"\x07" * 8 for slot in slots)
            assert closing is not None
            await bounded(closing)
            assert buf.released and len(buf.copies) == 0 and len(tier.copies) == 0
    finally:
        await bounded(tier.aclose())
    await wait_no_library_threads()


async def test_an_array_over_another_tier_holds_its_close() -> None:
    a = await bounded(HostTier.open(config()))
    b = await bounded(HostTier.open(config()))
    try:
        for tier in (a, b):
            await bounded(tier.wait_resident())
        sa, sb = await a.allocate(ROWS), await b.allocate(ROWS)
        for slot in sa:
            a.view(slot)[:] = b"\x05" * SLOT
        pages = over(b.address(sb[0]), ROWS, SLOT)  # b's slots, fresh: ascending and contiguous
        async with CopyEngine(None) as engine:
            held = Held(engine._copy_host)
            engine._copy_host = held  # type: ignore[method-assign]
            call = asyncio.ensure_future(engine.to_device(a, sa, pages))
            closing: asyncio.Future[None] | None = None
            try:
                await held.started()
                assert len(b.copies) == 1, "a copy into an array over a tier's slots is not registered with it"
                b.free_many(sb)
                closing = asyncio.ensure_future(b.aclose())
                await _still_closing(closing, b)
            finally:
                await held.release()
                await bounded(call)
                if closing is None:
                    await bounded(b.aclose())
            assert closing is not None
            await bounded(closing)
            assert b.released and len(a.copies) == 0
    finally:
        await bounded(a.aclose())
        await bounded(b.aclose())


async def test_an_array_over_a_shrunk_tail_is_refused() -> None:
    """Pages in the decommitted tail of a tier are refused as addresses there are (planned only:
    before, the plan was made, and its memmove would have written to memory given back)."""
    a = await bounded(HostTier.open(config()))
    b = await bounded(HostTier.open(config()))
    try:
        for tier in (a, b):
            await bounded(tier.wait_resident())
        sa = await a.allocate(2)
        await bounded(b.resize(ROWS // 2 * SLOT))
        tail = over(b.statistics().base_address + ROWS // 2 * SLOT, 2, SLOT)
        for direction in ("h2d", "d2h"):
            with pytest.raises(CopyPlanError, match="committed"):
                _requests.plan_slots(a, sa, tail, direction, None, host_only=True)
    finally:
        await bounded(a.aclose())
        await bounded(b.aclose())


async def test_an_array_over_a_closing_buffer_is_refused() -> None:
    tier = await bounded(HostTier.open(config()))
    try:
        await bounded(tier.wait_resident())
        slots = await tier.allocate(ROWS)
        async with CopyEngine(None) as engine:
            buf = await bounded(StaticHostMem.open(ROWS * SLOT))
            pages = over(buf.address, ROWS, SLOT)
            held = Held(engine._copy_host)
            engine._copy_host = held  # type: ignore[method-assign]
            first = asyncio.ensure_future(engine.to_device(tier, slots[:1], pages[:1]))
            try:
                await held.started()
                assert len(buf.copies) == 1, "a copy from an array over the buffer is not registered with it"
                closing = asyncio.ensure_future(buf.aclose())
                await asyncio.sleep(0)  # the close has begun: the buffer is no copy target any more
                before = engine.statistics().jobs_submitted
                with pytest.raises(CopyPlanError, match="closing"):
                    await engine.to_device(tier, slots[1:], pages[1:])
                assert engine.statistics().jobs_submitted == before
            finally:
                await held.release()
                await bounded(first)
            await bounded(closing)
    finally:
        await bounded(tier.aclose())


@pytest.mark.parametrize("call", ["load", "store"])
async def test_host_store_pages_over_a_static_buffer_hold_its_close(call: str, held_store: Held) -> None:
    tier = await bounded(HostTier.open(config()))
    try:
        await bounded(tier.wait_resident())
        store = await bounded(BlockStore.open(tier))
        keys = [bytes([1, i]) for i in range(ROWS // 2)]
        await held_store.release()  # the blocks to load land now
        await bounded(store.store(keys, np.full((len(keys), SLOT), 3, dtype=np.uint8)))
        held_store.open.clear()
        held_store.entered.clear()
        buf = await bounded(StaticHostMem.open(len(keys) * SLOT))
        pages = over(buf.address, len(keys), SLOT)
        pages[:] = 9
        if call == "load":
            task = asyncio.ensure_future(store.load(keys, pages))
        else:
            task = asyncio.ensure_future(store.store([bytes([2, i]) for i in range(len(keys))], pages))
        closing: asyncio.Future[None] | None = None
        try:
            await held_store.started()
            assert len(buf.copies) == 1, f"a host {call} over the buffer's memory is not registered with it"
            closing = asyncio.ensure_future(buf.aclose())
            await _still_closing(closing, buf)
        finally:
            await held_store.release()
            await bounded(task)
            if closing is None:
                await bounded(buf.aclose())
        assert closing is not None
        await bounded(closing)
        if call == "store":
            out = np.zeros((1, SLOT), dtype=np.uint8)
            await bounded(store.load([bytes([2, 5])], out))
            assert bool((out == 9).all())
        await bounded(store.aclose())
    finally:
        await bounded(tier.aclose())


# -- a crash, in a subprocess --------------------------------------------------------------


CLOSE_UNDER_ARRAYS = """
import ctypes
import numpy as np
from aiokvtier import BlockStore, CopyEngine, CopyPlanError, HostTier, HostTierConfig, StaticHostMem
MiB = 1 << 20
SLOT, N = 2 * MiB, 24

async def main():
    cfg = HostTierConfig(quota=3 * N * SLOT, max_quota=3 * N * SLOT, slot_size=SLOT)
    async with HostTier(cfg) as tier, CopyEngine(None) as engine:
        await asyncio.wait_for(tier.wait_resident(), 60)
        store = await BlockStore.open(tier)
        slots = await tier.allocate(N)
        keys = [bytes([1, i]) for i in range(N)]
        await store.store(keys, np.ones((N, SLOT), dtype=np.uint8))
        for round, delay in enumerate((0, 0, 0.001, 0.003, 0.01)):
            buf = await StaticHostMem.open(N * SLOT)
            # An array over the buffer's memory, as a foreign library would make one from its address.
            raw = (ctypes.c_uint8 * (N * SLOT)).from_address(buf.address)
            pages = np.ctypeslib.as_array(raw).reshape(N, SLOT)
            calls = [
                asyncio.ensure_future(engine.to_device(tier, slots, pages)),
                asyncio.ensure_future(engine.to_host(tier, slots, pages)),
                asyncio.ensure_future(store.load(keys, pages)),
                asyncio.ensure_future(store.store([bytes([2 + round, i]) for i in range(N)], pages)),
            ]
            await asyncio.sleep(delay)
            await asyncio.wait_for(buf.aclose(), 60)
            for outcome in await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60):
                # Landed, or refused before anything was copied (the buffer was closing already).
                assert not isinstance(outcome, BaseException) or isinstance(outcome, CopyPlanError), repr(outcome)
            print("round", round, "ok", flush=True)
        await store.aclose()

run(main)
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_closing_a_buffer_under_copies_through_arrays_over_it_does_not_crash(loop: str) -> None:
    """Engine copies and host store calls whose pages are an array over a StaticHostMem, the
    buffer closed among them (before: SIGSEGV, its memory unmapped under the memmove)."""
    from .test_cancellation import run_script

    out = run_script(CLOSE_UNDER_ARRAYS, loop)
    assert out.count(" ok") == 5
