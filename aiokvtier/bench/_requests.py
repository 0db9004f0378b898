"""``request_latency``: what one awaited request costs, beside the asyncio floor of its bytes.

An engine moves KV pages in requests of 1-64 MiB and feels each one's latency
as time to first token. Every figure here is a median over interleaved rounds
(the arms alternate within a round, so drift lands on all of them), with the
baselines measured in the same run:

- the *floor*: the same bytes as one contiguous copy awaited the cheapest way
  asyncio allows (queued on the loop's thread, an event recorded, one waiter
  thread that synchronizes it and wakes the loop with ``call_soon_threadsafe``);
  without a device, a worker thread that does the same ``memmove`` calls and
  wakes the loop;
- the *blocking* copy: queued and synchronized on the caller's thread.
"""

from __future__ import annotations

import asyncio
import ctypes
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import numpy as np

from .._config import HostTierConfig
from .._copy._backend import CopyBackend
from .._copy._engine import CopyEngine
from .._copy._plan import Plan
from .._cuda._static import StaticHostMem
from .._host._tier import HostTier
from .._store._store import BlockStore, StoreResult
from ._common import GiB, MiB, loop_factories, median, run_on, sample_loop_lag, summary_ms

KiB = 1 << 10
REQUEST_MIB = (1, 4, 16, 64)
GOALS = {64 * KiB: 1.25, 16 * KiB: 1.5, 4 * KiB: 2.0}
"""The request's latency over the floor's, at most (issue goals, per page size)."""


class Floor:
    """One waiter thread: waits for a recorded event (or does the ``memmove`` calls) and wakes the loop."""

    def __init__(self, context: Any = None) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._context = context
        self._thread = threading.Thread(target=self._main, name="aiokvtier-bench-floor", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        drv = None
        if self._context is not None:
            from .._cuda._driver import driver

            drv = driver()
            self._context.make_current()
        while (item := self._queue.get()) is not None:
            loop, future, event, copies = item
            if event is not None:
                drv.cuEventSynchronize(event)  # type: ignore[union-attr]
            for dst, src, n in copies:
                ctypes.memmove(dst, src, n)
            loop.call_soon_threadsafe(future.set_result, None)

    async def wait(self, event: Any = None, copies: tuple[tuple[int, int, int], ...] = ()) -> None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((loop, future, event, copies))
        await future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


WARMUP = 2
"""Rounds run before the timed ones."""

Arm = Callable[[int], Awaitable[Any]]
"""One way to make a request; called with the round's number, so that what it copies (shuffled slots,
built before the clock starts) differs from round to round."""


async def _timed(make: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await make()
    return time.perf_counter() - started


async def _rounds(arms: dict[str, Arm], rounds: int) -> dict[str, float]:
    """Median seconds of each arm over ``rounds`` (after ``WARMUP``), the arms rotated round by round."""
    names = list(arms)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds + WARMUP):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            elapsed = await _timed(partial(arms[name], r))
            if r >= WARMUP:
                samples[name].append(elapsed)
    return {name: median(values) for name, values in samples.items()}


def _picks(rng: np.random.Generator, slots: Any, n: int, rounds: int) -> list[Any]:
    """Shuffled slot sets, one per round, drawn before anything is timed."""
    return [rng.choice(slots, n, replace=False) for _ in range(rounds + WARMUP)]


def _slot_arm(call: Callable[..., Awaitable[None]], tier: HostTier, picks: list[Any], dev: Any, page: int) -> Arm:
    """An engine request of the round's shuffled slots."""
    return lambda r: call(tier, picks[r], dev, page=page)


def _bytes_arm(
    contiguous: Callable[[int, bool, bool], Awaitable[None]], nbytes: int, h2d: bool, awaited: bool, r: int
) -> Awaitable[None]:
    """A contiguous copy of the request's bytes (the round does not matter)."""
    return contiguous(nbytes, h2d, awaited)


def _config(size: int, slot: int, device: int | None = None) -> HostTierConfig:
    return HostTierConfig.model_validate({"quota": size, "max_quota": size, "slot_size": slot, "device": device})


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


# -- without a device: the proxy any machine runs ------------------------------------------------


async def _host_requests(quick: bool) -> dict[str, Any]:
    page = 64 * KiB
    largest = 16 * MiB
    tier_size = 256 * MiB if quick else 1 * GiB
    rounds = 7 if quick else 25
    out: dict[str, Any] = {}
    config = _config(tier_size, page)
    async with HostTier(config) as tier, CopyEngine(None) as engine, StaticHostMem(largest) as buf:
        await tier.wait_resident()
        total = tier_size // page
        slots = np.asarray(await tier.allocate(total), dtype=np.int64)
        rng = np.random.default_rng(0)
        pages = np.frombuffer(buf.view(), dtype=np.uint8)
        floor = Floor()
        try:
            for mib in (1, 4, 16):
                n = mib * MiB // page
                dst = pages[: n * page].reshape(n, page)
                picks = _picks(rng, slots, n, rounds)
                copies = [
                    tuple((buf.address + i * page, a, page) for i, a in enumerate(tier.slot_addresses(p).tolist()))
                    for p in _picks(rng, slots, n, rounds)
                ]

                def engine_arm(r: int, dst: np.ndarray = dst, picks: list[Any] = picks) -> Awaitable[None]:
                    return engine.to_device(tier, picks[r], dst)

                def floor_arm(r: int, copies: list[Any] = copies) -> Awaitable[None]:
                    return floor.wait(copies=copies[r])

                timed = await _rounds({"engine": engine_arm, "floor": floor_arm}, rounds)
                out[f"{mib}MiB_{page // KiB}KiB"] = {
                    "pages": n,
                    "engine_ms": _ms(timed["engine"]),
                    "floor_ms": _ms(timed["floor"]),
                    "ratio": round(timed["engine"] / timed["floor"], 3),
                    "goal": 1.5,
                }
            halves = pages[: 2 * MiB].reshape(32, page)
            out["store_1MiB"] = await _store_vs_engine(engine, halves[:16], halves[16:], rounds, None)
            out["engine_core"] = await _engine_core(tier, slots, pages[:MiB].reshape(16, page), floor, rng, quick)
        finally:
            floor.close()
    return out


class _NoCopy(CopyBackend):
    """A backend that copies nothing and lands at once, on the threads a GPU's uses (submit, completion):
    what is left of a request is the engine's own work."""

    coalesce = True

    def issue(self, plan: Plan, direction: str, after: tuple[str, Any] | None) -> None:
        self._calls += 1

    def landed(self, handle: Any) -> bool:
        return True


async def _engine_core(tier: HostTier, slots: Any, dst: Any, floor: Floor, rng: Any, quick: bool) -> dict[str, Any]:
    """A GPU engine's own cost, without a GPU: 1 MiB requests (16 shuffled 64 KiB slots) through a backend
    that copies nothing, one awaited at a time against the floor's one crossing, and from 64 tasks."""
    rounds, tasks, each = (100, 64, 4) if quick else (1000, 64, 16)
    picks = _picks(rng, slots, 16, rounds)
    async with CopyEngine(None, backend=_NoCopy()) as engine:
        timed = await _rounds(
            {"engine": lambda r: engine.to_host(tier, picks[r], dst), "floor": lambda r: floor.wait()}, rounds
        )
        many = _picks(rng, slots, 16, tasks * each)

        async def worker(k: int) -> None:
            for i in range(each):
                await engine.to_host(tier, many[k * each + i], dst)

        started = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(tasks)))
        elapsed = time.perf_counter() - started
    return {
        "request_us": round(timed["engine"] * 1e6, 1),
        "floor_us": round(timed["floor"] * 1e6, 1),
        "over_floor_us": round((timed["engine"] - timed["floor"]) * 1e6, 1),
        "tasks_64_requests_per_s": round(tasks * each / elapsed),
        "tasks_64_us_per_request": round(elapsed / (tasks * each) * 1e6, 1),
    }


def host_section(quick: bool) -> dict[str, Any]:
    """The host-only engine's awaited request (tier slots into a StaticHostMem) against a worker thread."""
    return {
        "what": "awaited request of shuffled 64 KiB tier slots into a StaticHostMem buffer, host-only CopyEngine, "
        "vs a worker thread doing the same memmoves and waking the loop; medians of interleaved rounds",
        **{name: run_on(factory, _host_requests(quick)) for name, factory in loop_factories().items()},
    }


# -- on a device ---------------------------------------------------------------------------------


async def _gpu_requests(quick: bool) -> dict[str, Any]:
    from .._cuda._driver import PrimaryContext, check, driver

    drv = driver()
    slot = 64 * KiB
    tier_size = (2 if quick else 8) * GiB
    rounds = 5 if quick else 15
    context = PrimaryContext(0)
    context.make_current()
    stream = check("cuStreamCreate", drv.cuStreamCreate(1))
    flags = drv.CUevent_flags.CU_EVENT_BLOCKING_SYNC | drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
    event = check("cuEventCreate", drv.cuEventCreate(flags))
    dbuf = int(check("cuMemAlloc", drv.cuMemAlloc(128 * MiB)))
    floor = Floor(context)
    out: dict[str, Any] = {"tier_gib": tier_size / GiB, "slot_kib": slot // KiB}
    try:
        opened = time.perf_counter()
        engine = await CopyEngine.open(0)
        out["engine_open_ms"] = _ms(time.perf_counter() - opened)
        config = _config(tier_size, slot, device=0)
        async with HostTier(config) as tier, StaticHostMem(128 * MiB, device=0) as pinned:
            await tier.wait_resident()
            slots = np.asarray(await tier.allocate(tier_size // slot), dtype=np.int64)
            rng = np.random.default_rng(0)

            def device_pages(n: int, page: int) -> np.ndarray:
                return np.uint64(dbuf) + np.arange(n, dtype=np.uint64) * np.uint64(page)

            async def contiguous(nbytes: int, h2d: bool, awaited: bool) -> None:
                if h2d:
                    check("cuMemcpyHtoDAsync", drv.cuMemcpyHtoDAsync(dbuf, pinned.address, nbytes, stream))
                else:
                    check("cuMemcpyDtoHAsync", drv.cuMemcpyDtoHAsync(pinned.address, dbuf, nbytes, stream))
                if awaited:
                    check("cuEventRecord", drv.cuEventRecord(event, stream))
                    await floor.wait(event)
                else:
                    check("cuStreamSynchronize", drv.cuStreamSynchronize(stream))

            first_ids = rng.choice(slots, 16, replace=False)
            started = time.perf_counter()
            await engine.to_device(tier, first_ids, device_pages(16, slot))
            out["first_request_after_open_ms"] = _ms(time.perf_counter() - started)

            latency: dict[str, Any] = {}
            cases = [(mib, page) for mib in REQUEST_MIB for page in (64 * KiB, 16 * KiB)] + [(64, 4 * KiB)]
            for mib, page in cases:
                n = mib * MiB // page
                dev = device_pages(n, page)
                nbytes = mib * MiB
                picks = _picks(rng, slots, n, rounds)
                arms: dict[str, Arm] = {
                    "engine_h2d": _slot_arm(engine.to_device, tier, picks, dev, page),
                    "engine_d2h": _slot_arm(engine.to_host, tier, picks[::-1], dev, page),
                    "floor_h2d": partial(_bytes_arm, contiguous, nbytes, True, True),
                    "floor_d2h": partial(_bytes_arm, contiguous, nbytes, False, True),
                    "blocking_h2d": partial(_bytes_arm, contiguous, nbytes, True, False),
                }
                t = await _rounds(arms, rounds)
                latency[f"{mib}MiB_{page // KiB}KiB"] = {
                    "pages": n,
                    **{f"{name}_ms": _ms(value) for name, value in t.items()},
                    "ratio_h2d": round(t["engine_h2d"] / t["floor_h2d"], 3),
                    "ratio_d2h": round(t["engine_d2h"] / t["floor_d2h"], 3),
                    "goal": GOALS[page] if page != 4 * KiB or mib == 64 else None,
                }
            out["latency"] = latency
            out["steady_1MiB_64KiB_h2d_ms"] = latency["1MiB_64KiB"]["engine_h2d_ms"]
            out["first_over_steady"] = round(
                out["first_request_after_open_ms"] / max(out["steady_1MiB_64KiB_h2d_ms"], 1e-9), 2
            )
            out["throughput_128MiB"] = await _throughput(engine, tier, slots, dbuf, contiguous, rng, quick)
            out["concurrent_64x1MiB"] = await _concurrent(engine, tier, slots, dbuf, contiguous, rng, quick)
            dev = (np.uint64(dbuf) + np.arange(16, dtype=np.uint64) * np.uint64(slot)).tolist()
            back = (np.uint64(dbuf + 8 * MiB) + np.arange(16, dtype=np.uint64) * np.uint64(slot)).tolist()
            out["store_1MiB"] = await _store_vs_engine(engine, dev, back, rounds, 0)
        await engine.aclose()
        reopened = []
        for _ in range(3):
            opened = time.perf_counter()
            again = await CopyEngine.open(0)
            reopened.append(time.perf_counter() - opened)
            await again.aclose()
        out["engine_reopen_ms"] = [_ms(x) for x in reopened]
    finally:
        floor.close()
        drv.cuMemFree(dbuf)
        drv.cuEventDestroy(event)
        drv.cuStreamDestroy(stream)
        context.release()
    return out


async def _ceiling(contiguous: Callable[[int, bool, bool], Awaitable[None]], nbytes: int, h2d: bool) -> float:
    """GB/s of one blocking contiguous copy of ``nbytes`` (median of 5): the link's ceiling."""
    times = [await _timed(lambda: contiguous(nbytes, h2d, False)) for _ in range(5)]
    return nbytes / median(times) / 1e9


async def _throughput(
    engine: CopyEngine, tier: HostTier, slots: Any, dbuf: int, contiguous: Any, rng: Any, quick: bool
) -> dict[str, Any]:
    """Back-to-back awaited 128 MiB requests of shuffled 4 and 16 KiB pages, against the ceiling."""
    out: dict[str, Any] = {}
    nbytes = 128 * MiB
    repeats = 3 if quick else 8
    for page in (4 * KiB, 16 * KiB):
        n = nbytes // page
        dev = np.uint64(dbuf) + np.arange(n, dtype=np.uint64) * np.uint64(page)
        for direction in ("h2d", "d2h"):
            call = engine.to_device if direction == "h2d" else engine.to_host
            ids = [rng.choice(slots, n, replace=False) for _ in range(repeats)]
            await call(tier, ids[0], dev, page=page)  # warm
            started = time.perf_counter()
            for chosen in ids:
                await call(tier, chosen, dev, page=page)
            rate = nbytes * repeats / (time.perf_counter() - started) / 1e9
            ceiling = await _ceiling(contiguous, nbytes, direction == "h2d")
            out[f"{page // KiB}KiB_{direction}"] = {
                "gb_s": round(rate, 2),
                "ceiling_gb_s": round(ceiling, 2),
                "ratio": round(rate / ceiling, 3),
                "goal": 0.85,
            }
    return out


async def _concurrent(
    engine: CopyEngine, tier: HostTier, slots: Any, dbuf: int, contiguous: Any, rng: Any, quick: bool
) -> dict[str, Any]:
    """64 tasks, each awaiting 1 MiB requests of 16 shuffled 64 KiB slots; aggregate rate and loop lag."""
    page, tasks, each = 64 * KiB, 64, 4 if quick else 16
    n = MiB // page

    picks = _picks(rng, slots, n * each, tasks)

    async def worker(k: int) -> None:
        dev = np.uint64(dbuf + k * MiB) + np.arange(n, dtype=np.uint64) * np.uint64(page)
        for chosen in np.split(picks[k], each):
            await engine.to_device(tier, chosen, dev)

    started = time.perf_counter()
    work = asyncio.ensure_future(asyncio.gather(*(worker(k) for k in range(tasks))))
    lags = await sample_loop_lag(work)
    await work
    rate = tasks * each * MiB / (time.perf_counter() - started) / 1e9
    ceiling = await _ceiling(contiguous, 64 * MiB, True)
    return {
        "gb_s": round(rate, 2),
        "ceiling_gb_s": round(ceiling, 2),
        "ratio": round(rate / ceiling, 3),
        "goal": 0.8,
        "loop_lag": summary_ms(lags),
        "loop_lag_goal_p99_ms": 1.0,
    }


async def _store_vs_engine(engine: CopyEngine, src: Any, dst: Any, rounds: int, device: int | None) -> dict[str, Any]:
    """BlockStore.store/load of 1 MiB (16 blocks of 64 KiB) against the engine's own request, one tier.

    ``src`` and ``dst``: 16 pages each (device addresses, or a 2-D host array
    without a device). Each store round stores 16 new keys into free slots:
    the tier holds every round's blocks, so no eviction and no ``discard``
    is timed with it (those are calls of their own).
    """
    slot, n = 64 * KiB, 16
    config = _config((rounds + WARMUP + 2) * n * slot, slot, device=device)
    async with HostTier(config) as tier, BlockStore(tier, engine) as store:
        await tier.wait_resident()
        ids = await tier.allocate(n)
        counter = iter(range(1 << 62))

        def store_new(r: int) -> Awaitable[StoreResult]:
            return store.store([next(counter) for _ in range(n)], src)

        keys = list(range(-n, 0))
        await store.store(keys, src)
        t = await _rounds(
            {
                "store": store_new,
                "load": lambda r: store.load(keys, dst),
                "engine_d2h": lambda r: engine.to_host(tier, ids, src),
                "engine_h2d": lambda r: engine.to_device(tier, ids, dst),
            },
            rounds,
        )
    return {
        **{f"{name}_ms": _ms(value) for name, value in t.items()},
        "store_over_engine": round(t["store"] / t["engine_d2h"], 3),
        "load_over_engine": round(t["load"] / t["engine_h2d"], 3),
        "goal": 1.15,
    }


def section(quick: bool) -> dict[str, Any]:
    """The GPU requests (device 0, asyncio and uvloop), then the host-only proxy."""
    return {
        "gpu": {name: run_on(factory, _gpu_requests(quick)) for name, factory in loop_factories().items()},
        "host_only": host_section(quick),
    }
