"""Study: the SM path on requests whose pages the planner merges into runs, runs cut back or whole.

    python benchmarks/sm_runs.py [--repeats 5] [--run-pages 1 16 256] > OUT.json

A request of 128 MiB of 4 KiB slots, half of its pages in runs of R pages contiguous on both
sides (which the planner merges into one copy each), the other half single pages, all in
shuffled order. The planned copies go to the SM path (4 SMs, the engine's submission: descriptors,
slices, launches) with ``SmOptions.split_runs`` on (runs cut back into pages: one length, 8-byte
descriptors, every warp a page) and off (each run one copy, for one warp; 24-byte descriptors),
queued behind a gate and timed with CUDA events; arms interleaved round by round, medians of
``--repeats``, as a fraction of one 1 GiB pinned copy timed the same way in the same run.
Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from typing import Any

import numpy as np

from aiokvtier import CopyEngine, HostTier, HostTierConfig, SmOptions
from aiokvtier._cuda import _sm
from aiokvtier._cuda._driver import PrimaryContext, check, driver
from aiokvtier.bench._sm import Gate, sync_time

MiB, GiB = 1 << 20, 1 << 30
PAGE = 4096


def layout(n: int, run: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(slot index, device page index) per requested page: half the pages in runs of ``run``
    consecutive slots and device pages, the rest single, the pieces in shuffled order."""
    rng = np.random.default_rng(seed)
    in_runs = (n // 2) // run * run
    pieces = [np.arange(i, i + run) for i in range(0, in_runs, run)]
    pieces += [np.array([i]) for i in range(in_runs, n)]
    order = rng.permutation(len(pieces))
    slots = np.concatenate([pieces[i] for i in order])
    # Device pages: runs stay runs on the device side too, every piece elsewhere.
    dev_order = rng.permutation(len(pieces))
    starts = np.zeros(len(pieces), dtype=np.int64)
    lengths = np.array([len(p) for p in pieces])
    starts[dev_order] = np.cumsum(lengths[dev_order]) - lengths[dev_order]
    dev = np.concatenate([starts[i] + np.arange(len(pieces[i])) for i in order])
    return slots, dev


async def study(args: argparse.Namespace) -> dict[str, Any]:
    drv = driver()
    ctx = PrimaryContext(0)
    ctx.make_current()
    total = 128 * MiB
    n = total // PAGE
    stream = check("cuStreamCreate", drv.cuStreamCreate(1))
    dbuf = int(check("cuMemAlloc", drv.cuMemAlloc(GiB)))
    pinned = int(check("cuMemHostAlloc", drv.cuMemHostAlloc(GiB, 0)))
    gate = Gate()
    out: dict[str, Any] = {"request_mib": total // MiB, "page": PAGE, "sm_budget": 4, "repeats": args.repeats}
    cfg = HostTierConfig.model_validate({"quota": total, "max_quota": total, "slot_size": PAGE, "device": 0})
    try:
        one = sync_time(lambda: check("h2d", drv.cuMemcpyHtoDAsync(dbuf, pinned, GiB, stream)), stream, gate=gate)
        rate = GiB / one
        out["one_copy_GBps"] = round(rate / 1e9, 2)
        async with HostTier(cfg) as tier, CopyEngine(0, method="dma") as planner:
            await tier.wait_resident()
            ids = np.asarray(await tier.allocate(n), dtype=np.int64)
            path = _sm.SmPath(0, 4)
            partner = tuple(x for x in (path.partner(stream),) if x is not None)
            try:
                for run in args.run_pages:
                    slot_ix, dev_ix = layout(n, run, seed=run)
                    dev = np.uint64(dbuf) + dev_ix.astype(np.uint64) * np.uint64(PAGE)
                    plan, _ = planner._plan_slots(tier, ids[slot_ix], dev, "h2d")
                    times: dict[str, list[float]] = {"cut": [], "whole": []}
                    for _ in range(args.repeats):
                        for arm in times:
                            # One loaded kernel and partner stream for both arms: only the options differ.
                            path.options = SmOptions(split_runs=arm == "cut")

                            def submit(p: Any = plan) -> None:
                                path.give_back(path.submit(p.dsts, p.srcs, p.sizes, stream))

                            times[arm].append(sync_time(submit, stream, gate=gate, also=partner))
                    row = {
                        "copies_planned": int(plan.count),
                        **{arm: round(total / statistics.median(t) / rate, 3) for arm, t in times.items()},
                        "cut_over_whole": round(statistics.median(times["whole"]) / statistics.median(times["cut"]), 3),
                    }
                    out[f"runs_of_{run}"] = row
                    print(json.dumps({run: row}), flush=True)
            finally:
                check("cuStreamSynchronize", drv.cuStreamSynchronize(stream))
                path.close()
        out["gated"] = gate.usable
    finally:
        gate.close()
        drv.cuMemFreeHost(pinned)
        drv.cuMemFree(dbuf)
        drv.cuStreamDestroy(stream)
        ctx.release()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--run-pages", type=int, nargs="+", default=[1, 16, 256])
    print(json.dumps(asyncio.run(study(parser.parse_args())), indent=1))


if __name__ == "__main__":
    main()
