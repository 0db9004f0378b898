"""A prefix whose second half is only on disk, loaded in one ``BlockStore.load``, by piece size.

The store brings the disk tier's blocks back into host slots in pieces
(``aiokvtier._store._spill.PIECE_BYTES``), each copied out as soon as it
landed. This program sets that size per arm (0: the whole half in one go,
as the store did before the pieces). Arms, per piece size: ``whole`` (the
prefix, its first half in the host tier) and ``tail`` (only the disk half,
through the store: no host-tier copy beside it); and the load's two parts
alone: the half read from disk (``DiskTier.read``) and the whole prefix
loaded from the host tier. One process, the arms' order rotating by round.
Each load is timed from its start to its return, with the first and the last
piece seen stored (the store's ``"stored"`` events), and the process's CPU
time over it (``cpu``: the event loop's and every thread's; ``loop_cpu``: the
event loop's thread alone). Prints one JSON object::

    python benchmarks/prefix_pieces.py --rounds 15 --pieces 0 4 16 [--gpu] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np

import aiokvtier._store._spill as spill
from aiokvtier import BlockStore, DiskTier, DiskTierConfig, HostTier, HostTierConfig
from aiokvtier.bench import _tiers
from aiokvtier.bench._common import machine

KiB, MiB = 1 << 10, 1 << 20


async def _run(directory: str, blocks: int, block: int, rounds: int, pieces: list[int], gpu: bool) -> dict[str, Any]:
    config = await asyncio.to_thread(DiskTierConfig.model_validate, {"quota": blocks * block, "path": directory})
    size = 4 * blocks * block
    memory = HostTierConfig.model_validate(
        {"quota": size, "max_quota": size, "slot_size": block, "device": 0 if gpu else None}
    )
    keys = [b"p%d" % i for i in range(blocks)]
    half = blocks // 2
    data = np.random.default_rng(0).integers(0, 256, (blocks, block), dtype=np.uint8)
    samples: dict[str, list[float]] = {}
    async with contextlib.AsyncExitStack() as stack:
        engine = None
        if gpu:
            from aiokvtier import CopyEngine

            device = _tiers._DevicePages(data)
            stack.callback(device.close)
            pages: Any = device
            engine = await stack.enter_async_context(CopyEngine(0))
        else:
            pages = _tiers._HostPages(data)
        tier = await stack.enter_async_context(HostTier(memory))
        disk = await stack.enter_async_context(DiskTier(config, block_size=block, fingerprint="pieces"))
        await tier.wait_resident()
        async with BlockStore(tier, engine, disk=disk, admit_after=1) as store:
            await store.store(keys, pages.src)
            await store.load(keys, pages.out)
        scratch = await tier.allocate(half)
        addresses = tier.slot_addresses(scratch).tolist()
        for r in range(rounds + 1):
            arms: list[tuple[str, int]] = [
                ("parts", 0),
                *(("whole", p) for p in pieces),
                *(("tail", p) for p in pieces),
            ]
            shift = r % len(arms)
            for arm, piece in arms[shift:] + arms[:shift]:
                if arm == "parts":
                    cpu, started = time.process_time(), time.perf_counter()
                    assert all(await disk.read(keys[half:], addresses))
                    got = {"disk_read_alone": time.perf_counter() - started}
                    got["disk_read_alone_cpu"] = time.process_time() - cpu
                    async with BlockStore(tier, engine, disk=disk) as store:
                        await store.store(keys, pages.src)
                        cpu, started = time.process_time(), time.perf_counter()
                        await store.load(keys, pages.out)
                        got["host_load_alone"] = time.perf_counter() - started
                        got["host_load_alone_cpu"] = time.process_time() - cpu
                else:
                    spill.PIECE_BYTES = piece * MiB  # read when the store opens
                    async with BlockStore(tier, engine, disk=disk) as store:
                        if arm == "whole":  # the first half in the host tier
                            await store.store(keys[:half], pages.src_of(half))
                        pages.clear()
                        wanted = keys if arm == "whole" else keys[half:]
                        out = pages.out if arm == "whole" else pages.out[half:]
                        timed = await _tiers.timed_load(store, wanted, out)
                        got = {f"{arm}_{piece}_mib_{k}": v for k, v in timed.items()}
                    assert arm == "tail" or pages.arrived(), "a block came back wrong"
                if r:
                    for name, seconds in got.items():
                        samples.setdefault(name, []).append(seconds)
        tier.free_many(scratch)
    ms = {name: round(statistics.median(v) * 1e3, 3) for name, v in sorted(samples.items())}
    parts = ms["disk_read_alone"] + ms["host_load_alone"]
    return {
        "machine": machine(),
        "destination": "GPU memory (device 0, CopyEngine)" if gpu else "host memory (memmove)",
        "prefix_bytes": blocks * block,
        "on_disk_bytes": (blocks - half) * block,
        "rounds": rounds,
        "ms": ms,
        "ratio_vs_sum_of_parts": {f"whole_{p}_mib": round(ms[f"whole_{p}_mib_load"] / parts, 3) for p in pieces},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--pieces", type=int, nargs="+", default=[0, 4, 16], help="MiB per piece; 0: one go")
    parser.add_argument("--gpu", action="store_true", help="load into GPU memory on device 0 through a CopyEngine")
    parser.add_argument("--dir", default=".", help="where the disk tier's files go (a temporary directory in it)")
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="aiokvtier-pieces-", dir=args.dir)
    try:
        out = asyncio.run(_run(directory, args.blocks, args.block_kib * KiB, args.rounds, args.pieces, args.gpu))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
