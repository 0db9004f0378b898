"""Study: large pages on the copy engines, one stream against several, beside one large copy.

    python benchmarks/dma_streams.py [--gib 2] [--repeats 5] [--pages-kib 2048 256] > OUT.json

Issue "SM copy path", goal 4: nothing regresses at 2 MiB (>= 97% of one large pinned copy).
The engine's 2 MiB copies ran at 0.99-1.01x a bare ``cuMemcpyBatchAsync`` of the same slots,
and both at 96-97% of one copy: the batch itself loses ~3%. This program asks where:

- ``one_copy``: one copy of the same bytes from one pinned buffer (``cuMemHostAlloc``), the ceiling;
- ``batch_pinned``: the same pages as a batch, shuffled, from that pinned buffer;
- ``batch_tier_s{S}``: the pages of a tier (default backing: registered 4 KiB pages), shuffled,
  split into S equal batches on S streams that start together and are joined by events.

These arms are queued behind a gate (a stream waiting on a host word) and timed with CUDA events,
so no host time is in them. Then, timed from the host as ``bench cuda --sections copy_bandwidth``
times them (synchronize, start the clock, queue, synchronize):

- ``host_one_copy``: the one copy;
- ``host_batch_tier``: the tier's pages as one stream of batches;
- ``engine``: ``CopyEngine.begin(tier, slots, pages, direction)`` from the event loop, awaited to
  its end (planning, the hand-offs and the completion's wake-up included), as a fraction of
  ``host_one_copy``; ``{direction}_engine_ms`` splits its time into planning (``begin``), the wait
  for submission and the rest (the copy, the completion's wake-up).

Arms are interleaved round by round, medians of ``--repeats``; each figure is a fraction of the
one copy timed the same way in the same round. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import numpy as np

from aiokvtier import CopyEngine, HostTier, HostTierConfig
from aiokvtier._cuda._batch import DEFAULT_MAX_BATCH, BatchCall, resolve_batch_function
from aiokvtier._cuda._driver import PrimaryContext, check, driver
from aiokvtier.bench._sm import Gate

MiB, GiB = 1 << 20, 1 << 30
STREAMS = (1, 2, 4)


class Arms:
    def __init__(self, total: int, page: int, tier: HostTier, pinned: int, dbuf: int, streams: list[Any]) -> None:
        drv = driver()
        self.drv, self.total, self.page, self.streams, self.dbuf, self.pinned = drv, total, page, streams, dbuf, pinned
        self.gate = Gate()
        self.start, self.end = (check("cuEventCreate", drv.cuEventCreate(0)) for _ in range(2))
        self.joins = [check("cuEventCreate", drv.cuEventCreate(2)) for _ in streams]
        function, abi = resolve_batch_function(drv)
        self.calls = {d: BatchCall(function, abi, d, 0) for d in ("h2d", "d2h")}
        n = total // page
        self.n = n
        rng = np.random.default_rng(7)
        self.dev = np.uint64(dbuf) + rng.permutation(n).astype(np.uint64) * np.uint64(page)
        self.pinned_pages = np.uint64(pinned) + rng.permutation(n).astype(np.uint64) * np.uint64(page)
        self.tier = tier
        self.sizes = np.full(n, page, dtype=np.uint64)
        self.phases: list[tuple[float, float, float]] = []  # the engine's: planned, submitted, landed

    async def tier_pages(self) -> None:
        slots = np.asarray(await self.tier.allocate(self.n), dtype=np.int64)
        slots = slots[np.random.default_rng(8).permutation(self.n)]
        self.slots = slots
        self.tier_addrs = np.uint64(self.tier.base_address) + slots.astype(np.uint64) * np.uint64(self.page)

    def queue(self, name: str, direction: str) -> None:
        if name == "one_copy":
            self.one_copy(direction)
        elif name == "batch_pinned":
            self.batch(direction, self.pinned_pages, 1)
        else:
            self.batch(direction, self.tier_addrs, int(name.removeprefix("batch_tier_s")))

    async def host_timed(self, name: str, direction: str, engine: CopyEngine) -> float:
        """Seconds from the host's clock, the stream idle at the start, as the bench's section 5 times."""
        drv, main = self.drv, self.streams[0]
        check("cuStreamSynchronize", drv.cuStreamSynchronize(main))
        started = time.perf_counter()
        if name == "engine":
            started_copy = engine.begin(self.tier, self.slots, self.dev, direction)
            planned = time.perf_counter()
            await started_copy.submitted
            submitted = time.perf_counter()
            await started_copy.done
            self.phases.append((planned - started, submitted - planned, time.perf_counter() - submitted))
        else:
            self.queue("one_copy" if name == "host_one_copy" else "batch_tier_s1", direction)
            check("cuStreamSynchronize", drv.cuStreamSynchronize(main))
        return time.perf_counter() - started

    def timed(self, name: str, direction: str) -> float:
        drv, main = self.drv, self.streams[0]
        held = self.gate.hold(main)
        try:
            check("cuEventRecord", drv.cuEventRecord(self.start, main))
            self.queue(name, direction)
            check("cuEventRecord", drv.cuEventRecord(self.end, main))
        finally:
            if held:
                self.gate.release()
        check("cuEventSynchronize", drv.cuEventSynchronize(self.end))
        return float(check("cuEventElapsedTime", drv.cuEventElapsedTime(self.start, self.end))) / 1e3

    def one_copy(self, direction: str) -> None:
        drv, s = self.drv, self.streams[0]
        if direction == "h2d":
            check("h2d", drv.cuMemcpyHtoDAsync(self.dbuf, self.pinned, self.total, s))
        else:
            check("d2h", drv.cuMemcpyDtoHAsync(self.pinned, self.dbuf, self.total, s))

    def batch(self, direction: str, host: Any, ways: int) -> None:
        """The pages in ``ways`` equal batches on as many streams, started and joined on stream 0."""
        drv, main = self.drv, self.streams[0]
        dsts, srcs = (self.dev, host) if direction == "h2d" else (host, self.dev)
        check("cuEventRecord", drv.cuEventRecord(self.joins[0], main))
        for k in range(1, ways):
            check("cuStreamWaitEvent", drv.cuStreamWaitEvent(self.streams[k], self.joins[0], 0))
        bounds = np.linspace(0, self.n, ways + 1).astype(int)
        for k in range(ways):
            lo, hi = bounds[k], bounds[k + 1]
            for i in range(lo, hi, DEFAULT_MAX_BATCH):
                j = min(hi, i + DEFAULT_MAX_BATCH)
                self.calls[direction](dsts[i:j], srcs[i:j], self.sizes[i:j], self.streams[k])
        for k in range(1, ways):
            check("cuEventRecord", drv.cuEventRecord(self.joins[k], self.streams[k]))
            check("cuStreamWaitEvent", drv.cuStreamWaitEvent(main, self.joins[k], 0))

    def close(self) -> None:
        for e in (self.start, self.end, *self.joins):
            self.drv.cuEventDestroy(e)
        self.gate.close()


async def study(args: argparse.Namespace) -> dict[str, Any]:
    drv = driver()
    ctx = PrimaryContext(0)
    ctx.make_current()
    total = args.gib * GiB
    streams = [check("cuStreamCreate", drv.cuStreamCreate(1)) for _ in range(max(STREAMS))]
    dbuf = int(check("cuMemAlloc", drv.cuMemAlloc(total)))
    pinned = int(check("cuMemHostAlloc", drv.cuMemHostAlloc(total, 0)))
    out: dict[str, Any] = {"gib": args.gib, "repeats": args.repeats, "unit": "fraction of one_copy, same round"}
    try:
        for page_kib in args.pages_kib:
            page = page_kib << 10
            cfg = HostTierConfig.model_validate(
                {"quota": total, "max_quota": total, "slot_size": page, "device": 0, "backing": "register"}
            )
            async with HostTier(cfg) as tier, CopyEngine(0) as engine:
                await tier.wait_resident()
                arms = Arms(total, page, tier, pinned, dbuf, streams)
                await arms.tier_pages()
                names = ["one_copy", "batch_pinned", *(f"batch_tier_s{w}" for w in STREAMS)]
                hosted = ["host_one_copy", "host_batch_tier", "engine"]
                try:
                    row: dict[str, Any] = {}
                    for direction in ("h2d", "d2h"):
                        for name in names:
                            arms.timed(name, direction)  # warm
                        for name in hosted:
                            await arms.host_timed(name, direction, engine)
                        ratios: dict[str, list[float]] = {k: [] for k in names + hosted}
                        ref_gbps: list[float] = []
                        for _ in range(args.repeats):
                            secs = {k: arms.timed(k, direction) for k in names}
                            for k in hosted:
                                secs[k] = await arms.host_timed(k, direction, engine)
                            ref_gbps.append(total / secs["one_copy"] / 1e9)
                            for k in names:
                                ratios[k].append(secs["one_copy"] / secs[k])
                            for k in hosted:
                                ratios[k].append(secs["host_one_copy"] / secs[k])
                        phases = arms.phases[-args.repeats :]
                        row[direction + "_engine_ms"] = {
                            name: round(statistics.median(p[i] for p in phases) * 1e3, 3)
                            for i, name in enumerate(("plan", "submit", "copy_and_wake"))
                        }
                        row[direction] = {
                            "one_copy_GBps": round(statistics.median(ref_gbps), 2),
                            **{
                                k: round(statistics.median(v), 4)
                                for k, v in ratios.items()
                                if k not in ("one_copy", "host_one_copy")
                            },
                            "ranges": {k: [round(min(v), 4), round(max(v), 4)] for k, v in ratios.items()},
                        }
                    row["gated"] = arms.gate.usable
                finally:
                    check("cuCtxSynchronize", drv.cuCtxSynchronize())
                    arms.close()
            out[f"page_{page_kib}KiB"] = row
            print(json.dumps({page_kib: row}), flush=True)
    finally:
        drv.cuMemFreeHost(pinned)
        drv.cuMemFree(dbuf)
        for s in streams:
            drv.cuStreamDestroy(s)
        ctx.release()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pages-kib", type=int, nargs="+", default=[2048, 256])
    print(json.dumps(asyncio.run(study(parser.parse_args())), indent=1))


if __name__ == "__main__":
    main()
