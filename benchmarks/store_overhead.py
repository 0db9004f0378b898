"""The block store's own work around a CopyEngine copy, measured on a CPU.

``BlockStore.store`` / ``load`` against ``CopyEngine.to_host`` / ``to_device``
of the same pages on the same slots, through a host-to-host engine made to
take the store's device path (a store given ``CopyEngine(None)`` otherwise
copies host pages itself). The pages lie in ``StaticHostMem`` buffers, as a
host-to-host engine requires. Each call is cut into phases on the loop's
clock:

- ``before``: from the call to the engine's ``begin`` (keys, pages, slots);
- ``begin``: the engine's ``begin`` itself (checks and planning);
- ``after``: from the copy's ``done`` to the call's return.

On a GPU the copy runs between ``begin`` and ``done`` and the store books its
blocks meanwhile, so ``before + begin + after`` beyond the engine's is what a
store or load adds to a copy's time. ``booked`` is the loop's CPU between
``begin`` and ``done`` (the work the GPU's copy hides), ``loop_cpu`` the loop
thread's CPU for the whole call. Rounds interleave the store and the engine.

A study, not a user's benchmark::

    python benchmarks/store_overhead.py [--blocks 4096] [--page 4096] [--slot 4096] [--rounds 30]
        [--lag-ms 5] [--loop asyncio|uvloop]

A copy of 4 KiB pages goes through the CPU's caches (a GPU's DMA does not):
``--page 256`` keeps them warmer, nearer what a GPU machine sees.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import numpy as np

from aiokvtier import BlockStore, CopyEngine, HostTier, StaticHostMem
from aiokvtier._copy._engine import StartedCopy
from aiokvtier._store._transfers import Transfers
from aiokvtier.bench._common import loop_factories, machine, run_on
from aiokvtier.bench._store import _config, _keys


class _Clock:
    """Wraps an engine's ``begin``: when it was entered and left, and when its copy's ``done`` settled.

    A host-to-host engine reports a copy issued only once it has copied, so
    ``done`` follows at once. As on a GPU, where the copy lasts longer than
    the store's booking, ``done`` is held back by ``lag`` seconds after the
    copy landed: the booking then runs before it, and what follows ``done``
    is the call's own work.
    """

    def __init__(self, engine: CopyEngine, lag: float) -> None:
        self._lag = lag
        self.entered = self.left = self.landed = self.cpu_left = self.cpu_landed = 0.0
        for name in ("begin", "start"):  # the awaited calls' entry and the store's
            real = getattr(engine, name, None)
            if real is not None:
                setattr(engine, name, partial(self.begin, real))

    def begin(self, real: Callable[..., StartedCopy], *args: Any, **kwargs: Any) -> StartedCopy:
        self.entered = time.perf_counter()
        started = real(*args, **kwargs)
        self.left = time.perf_counter()
        self.cpu_left = time.thread_time()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def settle(copied: asyncio.Future[None]) -> None:
            self.landed = time.perf_counter()
            self.cpu_landed = time.thread_time()
            error = copied.exception()
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(None)

        started.done.add_done_callback(lambda copied: loop.call_later(self._lag, settle, copied))
        return StartedCopy(started.submitted, done)


async def _timed(clock: _Clock, call: Callable[[], Awaitable[Any]]) -> dict[str, float]:
    cpu0, t0 = time.thread_time(), time.perf_counter()
    await call()
    t1, cpu1 = time.perf_counter(), time.thread_time()
    return {
        "before": clock.entered - t0,
        "begin": clock.left - clock.entered,
        "after": t1 - clock.landed,
        "booked": clock.cpu_landed - clock.cpu_left,
        "loop_cpu": cpu1 - cpu0,
        "wall": t1 - t0,
    }


async def _measure(blocks: int, page: int, slot: int, rounds: int, lag: float) -> dict[str, Any]:
    config = _config(blocks * slot, slot, fill_threads=2)
    async with (
        HostTier(config) as tier,
        CopyEngine(None) as engine,
        StaticHostMem(blocks * page) as src_mem,
        StaticHostMem(blocks * page) as dst_mem,
    ):
        await tier.wait_resident()
        every = await tier.allocate(blocks)  # shuffled slots, as in the GPU benchmark
        tier.free_many([every[i] for i in np.random.default_rng(1).permutation(blocks).tolist()])
        src = np.frombuffer(src_mem.view(), dtype=np.uint8).reshape(blocks, page)
        dst = np.frombuffer(dst_mem.view(), dtype=np.uint8).reshape(blocks, page)
        src[:] = np.random.default_rng(0).integers(0, 256, size=src.shape, dtype=np.uint8)
        keys = _keys(blocks)
        clock = _Clock(engine, lag)
        Transfers.host_engines = True  # the device path, over host memory
        async with BlockStore(tier, engine) as store:
            await store.store(keys, src)
            slots = np.asarray([store.slot(k) for k in keys], dtype=np.int64)
            arms: dict[str, Callable[[], Awaitable[Any]]] = {
                "store": lambda: store.store(keys, src),
                "to_host": lambda: engine.to_host(tier, slots, src),
                "load": lambda: store.load(keys, dst),
                "to_device": lambda: engine.to_device(tier, slots, dst),
            }
            samples: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
            for r in range(rounds + 2):
                for name, call in arms.items():
                    if name == "store":
                        store.discard(keys)
                    sample = await _timed(clock, call)
                    if r >= 2:  # two warm-up rounds
                        samples[name].append(sample)
            dst[:] = 0
            await store.load(keys, dst)
            if not np.array_equal(src, dst):
                raise RuntimeError("the bytes loaded differ from the bytes stored")

    def med(name: str, phase: str) -> float:
        return statistics.median(s[phase] for s in samples[name]) * 1e3

    out: dict[str, Any] = {"blocks": blocks, "page": page, "slot": slot, "rounds": rounds, "lag_ms": lag * 1e3}
    for ours, bare in (("store", "to_host"), ("load", "to_device")):
        phases = {p: {ours: round(med(ours, p), 4), bare: round(med(bare, p), 4)} for p in samples[ours][0]}
        added = sum(med(ours, p) - med(bare, p) for p in ("before", "begin", "after"))
        out[ours] = {
            "phases_ms": phases,
            "not_overlapped_added_ms": round(added, 4),
            "not_overlapped_added_ns_per_key": round(added * 1e6 / blocks, 1),
            "booked_ns_per_key": round(med(ours, "booked") * 1e6 / blocks, 1),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--page", type=int, default=4096, help="bytes copied per block (small: caches stay warm)")
    parser.add_argument("--slot", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--lag-ms", type=float, default=5.0, help="done held back after the copy (a GPU's copy)")
    parser.add_argument("--loop", choices=list(loop_factories()), default="asyncio")
    args = parser.parse_args()
    result = run_on(
        loop_factories()[args.loop], _measure(args.blocks, args.page, args.slot, args.rounds, args.lag_ms / 1e3)
    )
    print(json.dumps({"machine": machine(), "loop": args.loop, **result}, indent=2))


if __name__ == "__main__":
    main()
