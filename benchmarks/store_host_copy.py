"""A block store's 1 MiB store and load beside the engine's own request, many rounds, without a GPU.

``BlockStore.store`` of 16 new keys (pages: 16 rows of 64 KiB of a ``StaticHostMem`` array) into a tier,
``CopyEngine.to_host`` of the same pages on 16 slots, and ``BlockStore.load`` of 16 stored keys into the
other half of the array, in turns each round: the median wall time of each, the loop thread's CPU per call
(mean of ``time.thread_time``), and the store's and load's ratios to the engine's request (the goal of the
copy layer's issue is 1.15x). ``bench host --sections request_latency`` reports the same ratios from 25
rounds; this runs enough rounds to compare two trees, each put first on ``PYTHONPATH`` in turn::

    PYTHONPATH=/path/to/tree python -P benchmarks/store_host_copy.py [--rounds 1500] [--loop asyncio|uvloop]
        [--engine host|recording]

``--engine host`` (default): the host-only engine; the store copies host pages itself on its thread.
``--engine recording``: the store's GPU path, as far as a CPU shows it: an engine over a
``RecordingBackend`` that copies each job on its completion thread (as a GPU copy lands) and a store
made to copy through it (``Transfers.host_engines``), so the store plans, queues and books as it does
with a device, and waits for the copy's landing as it does on a GPU.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from aiokvtier import BlockStore, CopyEngine, HostTier, HostTierConfig, StaticHostMem
from aiokvtier._store._transfers import Transfers
from aiokvtier.bench._common import loop_factories, machine, run_on
from aiokvtier.testing import RecordingBackend

KiB, MiB = 1 << 10, 1 << 20


async def _measure(rounds: int, recording: bool) -> dict[str, Any]:
    n, slot = 16, 64 * KiB
    size = (rounds + 100) * n * slot
    config = HostTierConfig(quota=size, max_quota=size, slot_size=slot)
    Transfers.host_engines = recording
    backend = RecordingBackend(memmove=True) if recording else None
    async with CopyEngine(None, backend=backend) as engine, StaticHostMem(2 * MiB) as buf:
        pages = np.frombuffer(buf.view(), dtype=np.uint8).reshape(32, slot)
        src, dst = pages[:n], pages[n:]
        src[:] = np.random.default_rng(0).integers(0, 256, src.shape, dtype=np.uint8)
        async with HostTier(config) as tier, BlockStore(tier, engine) as store:
            await tier.wait_resident()
            ids = await tier.allocate(n)
            counter = iter(range(1 << 62))
            loaded = [next(counter) for _ in range(n)]
            await store.store(loaded, src)
            arms: dict[str, Callable[[], Awaitable[Any]]] = {
                "store": lambda: store.store([next(counter) for _ in range(n)], src),
                "engine": lambda: engine.to_host(tier, ids, src),
                "load": lambda: store.load(loaded, dst),
            }
            wall: dict[str, list[float]] = {name: [] for name in arms}
            cpu: dict[str, list[float]] = {name: [] for name in arms}
            for r in range(rounds + 50):  # the first 50: warm-up
                for name, arm in arms.items():
                    cpu0, t0 = time.thread_time(), time.perf_counter()
                    await arm()
                    if r >= 50:
                        wall[name].append(time.perf_counter() - t0)
                        cpu[name].append(time.thread_time() - cpu0)
            if not np.array_equal(dst, src):
                raise AssertionError("a load did not bring back what was stored")
    med = {name: float(np.median(v)) for name, v in wall.items()}
    return {
        "wall_ms": {name: round(v * 1e3, 4) for name, v in med.items()},
        "loop_cpu_us": {name: round(float(np.mean(v)) * 1e6, 1) for name, v in cpu.items()},
        "store_over_engine": round(med["store"] / med["engine"], 3),
        "load_over_engine": round(med["load"] / med["engine"], 3),
        "goal": 1.15,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1500)
    parser.add_argument("--loop", choices=sorted(loop_factories()), default="asyncio")
    parser.add_argument("--engine", choices=["host", "recording"], default="host")
    args = parser.parse_args()
    result = run_on(loop_factories()[args.loop], _measure(args.rounds, args.engine == "recording"))
    print(json.dumps({"machine": machine(), "loop": args.loop, "engine": args.engine, "rounds": args.rounds, **result}))


if __name__ == "__main__":
    main()
