"""The host tier's own figures with a disk tier configured but not hit, beside none.

Issue: a disk tier under the ``BlockStore`` must not cost the host tier's
requests. Two stores over one host tier (64 KiB slots), one with a
``DiskTier`` below it, the other without; per round each arm stores 16 new
keys (1 MiB from a host array), looks up a 4,096-key prefix it holds, loads
the 16 keys back and discards them. Every key is loaded once, so nothing
reaches the disk tier's admission (``admit_after=2``) and every lookup and
load is a host-tier hit. The arms alternate by round; medians. Prints JSON::

    python benchmarks/idle_disk_tier.py [--rounds 300] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from aiokvtier import BlockStore, DiskTier, DiskTierConfig, HostTier, HostTierConfig

KiB, MiB = 1 << 10, 1 << 20
SLOT = 64 * KiB


async def run(rounds: int, directory: str) -> dict[str, Any]:
    config = HostTierConfig.model_validate({"quota": 1 << 30, "max_quota": 1 << 30, "slot_size": SLOT})
    disk_config = await asyncio.to_thread(DiskTierConfig.model_validate, {"quota": 256 * MiB, "path": directory})
    pages = np.random.default_rng(0).integers(0, 256, (16, SLOT), dtype=np.uint8)
    out = np.empty_like(pages)
    prefix = [b"prefix-%05d" % i for i in range(4096)]
    small = np.zeros((4096, 64), dtype=np.uint8)
    times: dict[str, dict[str, list[float]]] = {}
    async with contextlib.AsyncExitStack() as stack:
        tier = await stack.enter_async_context(HostTier(config))
        await tier.wait_resident()
        disk = await stack.enter_async_context(DiskTier(disk_config, block_size=SLOT, fingerprint="idle"))
        stores = {
            "none": await stack.enter_async_context(BlockStore(tier, None)),
            "disk": await stack.enter_async_context(BlockStore(tier, None, disk=disk)),
        }
        for name, store in stores.items():
            await store.store([b"%s-%s" % (name.encode(), k) for k in prefix], small)
            times[name] = {"store_ms": [], "lookup_ms": [], "load_ms": []}
        for r in range(rounds + 10):
            for name, store in stores.items() if r % 2 else reversed(stores.items()):
                keys = [b"%s-r%d-%d" % (name.encode(), r, i) for i in range(16)]
                held = [b"%s-%s" % (name.encode(), k) for k in prefix]
                t0 = time.perf_counter()
                await store.store(keys, pages)
                t1 = time.perf_counter()
                assert store.lookup(held) == len(held)
                t2 = time.perf_counter()
                await store.load(keys, out)
                t3 = time.perf_counter()
                store.discard(keys)
                if r >= 10:
                    times[name]["store_ms"].append(t1 - t0)
                    times[name]["lookup_ms"].append(t2 - t1)
                    times[name]["load_ms"].append(t3 - t2)
        written = stores["disk"].statistics().written_back
    medians = {name: {k: round(statistics.median(v) * 1e3, 4) for k, v in arms.items()} for name, arms in times.items()}
    return {
        "rounds": rounds,
        "ms": medians,
        "disk_over_none": {k: round(medians["disk"][k] / medians["none"][k], 3) for k in medians["none"]},
        "blocks_written_to_disk": written,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="aiokvtier-idle-", dir=args.dir) as directory:
        print(json.dumps(asyncio.run(run(args.rounds, directory)), indent=1))


if __name__ == "__main__":
    main()
