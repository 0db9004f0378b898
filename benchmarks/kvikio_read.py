"""Reading blocks from disk into GPU memory: the disk tier's path beside KvikIO's.

The disk tier reads blocks with ``O_DIRECT`` ``preadv`` into the host tier's
registered slots on its I/O threads, and a ``CopyEngine`` moves them to the
GPU (what ``BlockStore.load`` does for blocks found only on disk). KvikIO
(``pip install kvikio-cu13``) reads a file straight into GPU memory: through
GPUDirect Storage where the machine has it (the ``nvidia-fs`` driver and a
file system that supports it), else in its compatibility mode (POSIX reads
into its own bounce buffers, then copies). This program measures both on the
same blocks, the same number of threads, interleaved, the page cache dropped
for the file before each KvikIO round (the tier's reads bypass it):

- ``aiokvtier``: ``DiskTier.read`` of every block into tier slots, then one
  ``CopyEngine.to_device`` of those slots into a GPU buffer;
- ``kvikio``: ``CuFile.pread`` of the same bytes, laid out as one file, into
  a GPU buffer of the same size (``KVIKIO_NTHREADS`` set to the threads).

Both results are checked bit-exact against what was written. Needs a CUDA
device, torch and kvikio; prints one JSON object (KvikIO's failure to load is
reported there, not raised)::

    python benchmarks/kvikio_read.py --dir /tmp/kv --blocks 256 --block-size 2MiB --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

import numpy as np
import torch

from aiokvtier import CopyEngine, DiskTier, HostTier, HostTierConfig
from aiokvtier._config import _size_bytes
from aiokvtier.bench._common import machine


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _kvikio(threads: int) -> tuple[Any, dict[str, Any]]:
    os.environ["KVIKIO_NTHREADS"] = str(threads)
    try:
        import kvikio
        import kvikio.defaults
    except Exception as exc:  # reported, not raised: the other arm still runs
        return None, {"unavailable": f"{type(exc).__name__}: {exc}"}
    info: dict[str, Any] = {"version": getattr(kvikio, "__version__", "?")}
    for name in ("compat_mode", "is_compat_mode_preferred", "num_threads"):
        fn = getattr(kvikio.defaults, name, None)
        if callable(fn):
            try:
                info[name] = str(fn())
            except Exception as exc:
                info[name] = f"error: {exc}"
    return kvikio, info


async def run(args: argparse.Namespace) -> dict[str, Any]:
    block = _size_bytes(args.block_size, "--block-size")
    n = args.blocks
    total = n * block
    os.makedirs(args.dir, exist_ok=True)
    plain = os.path.join(args.dir, "plain.bin")
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, (n, block), dtype=np.uint8)
    await asyncio.to_thread(data.tofile, plain)
    kvikio, info = _kvikio(args.threads)
    gpu = torch.empty((n, block), dtype=torch.uint8, device="cuda:0")
    expect = torch.from_numpy(data).to("cuda:0")
    config = HostTierConfig(quota=total, max_quota=total, slot_size=block, device=0)
    disk_config = {"path": args.dir, "quota": total}
    ours: list[float] = []
    theirs: list[float] = []
    async with HostTier(config) as tier, CopyEngine(0) as engine:
        await tier.wait_resident()
        slots = await tier.allocate(n)
        addresses = tier.slot_addresses(slots).tolist()
        async with DiskTier(disk_config, block_size=block, fingerprint="kvikio-bench", io_threads=args.threads) as disk:
            for i, slot in enumerate(slots):
                view = tier.view(slot)
                np.frombuffer(view, dtype=np.uint8)[:] = data[i]
                view.release()
            keys = list(range(n))
            written = await disk.write(keys, addresses, [block] * n)
            assert len(written) == n, "the disk tier skipped blocks"
            for r in range(args.rounds + 1):  # the first round warms both arms, untimed
                for arm in ("ours", "kvikio") if r % 2 == 0 else ("kvikio", "ours"):
                    gpu.zero_()
                    torch.cuda.synchronize()
                    if arm == "ours":
                        began = time.perf_counter()
                        got = await disk.read(keys, addresses)
                        await engine.to_device(tier, slots, gpu)
                        elapsed = time.perf_counter() - began
                        assert all(got), "a block was not read back"
                        (ours if r else []).append(elapsed)
                    elif kvikio is not None:
                        await asyncio.to_thread(_drop_cache, plain)
                        began = time.perf_counter()
                        with kvikio.CuFile(plain, "r") as f:
                            f.pread(gpu).get()
                        torch.cuda.synchronize()
                        elapsed = time.perf_counter() - began
                        (theirs if r else []).append(elapsed)
                    else:
                        continue
                    if not torch.equal(gpu, expect):
                        raise RuntimeError(f"the {arm} arm did not read the blocks back bit-exact")
    out: dict[str, Any] = {
        "benchmark": "kvikio_read",
        "machine": machine(),
        "gpu": torch.cuda.get_device_name(0),
        "blocks": n,
        "block_bytes": block,
        "threads": args.threads,
        "kvikio": info,
        "aiokvtier_gb_s": round(total / statistics.median(ours) / 1e9, 3),
        "aiokvtier_ms": [round(t * 1e3, 2) for t in ours],
    }
    if theirs:
        out["kvikio_gb_s"] = round(total / statistics.median(theirs) / 1e9, 3)
        out["kvikio_ms"] = [round(t * 1e3, 2) for t in theirs]
        out["kvikio_over_aiokvtier"] = round(statistics.median(ours) / statistics.median(theirs), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="a directory on the disk to measure")
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--block-size", default="2MiB")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    print(json.dumps(asyncio.run(run(parser.parse_args())), indent=1))


if __name__ == "__main__":
    main()
