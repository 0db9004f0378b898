"""SGLang's calls through ``aiokvtier.integrations.sglang``, against what lies beneath them.

An ``aiokvtier pool`` owner runs in a child process (or, with ``--tier``, the
storage opens a tier of this process); this process builds SGLang's host KV
pool (MHA, fp16, ``page_first``) and the storage the way SGLang's dynamic
loader does, and calls it from the calling thread, as SGLang's prefetch and
backup threads do.

``exists``: ``--keys`` pages stored, then ``batch_exists`` of all of them
(every page a hit: the longest answer):

- ``one_call``: one call of ``--keys`` keys (the issue's goal: 4,096 keys in 1 ms or less);
- ``sglang_batches``: the same keys in calls of 128 (SGLang's ``STORAGE_BATCH_SIZE``, what its
  prefetch thread sends), the total per round;
- ``floor``: the same number of stored block keys of the same length, looked up beneath the
  adapter (``AttachedPool.lookup`` or ``BlockStore.lookup`` awaited on a loop of this process:
  no thread crossing, keys already bytes).

Two page formats: ``v1`` (SGLang's zero-copy calls: a page is its K and V spans, two blocks)
and ``flat`` (SGLang's generic calls: one flat page, one block).

``transfers``: ``batch_set_v1`` of 128 new pages (512 KiB each: 8 layers, 8 heads of 128, 16
tokens; a span a slot) and ``batch_get_v1`` of 128 stored pages, against ``floor``: the same
spans ``memmove``d by the calling thread into one buffer (the bytes alone); and
``get_stats()`` (what SGLang's scheduler thread calls) while another thread stores.

    python benchmarks/sglang_storage.py [--keys 4096] [--rounds 50] [--tier]

Needs SGLang (``pip install 'aiokvtier[sglang]'``). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from aiokvtier import AttachedPool, BlockStore, HostTier
from aiokvtier.bench._common import machine

PAGE = 16


def host_pool(pages: int, layers: int = 1, heads: int = 1, dim: int = 64) -> Any:
    """An MHA host pool (by default 1 layer, 1 head of 64: 2 KiB spans) with room for ``pages`` pages twice."""
    device = MHATokenToKVPool(
        pages * PAGE, PAGE, torch.float16, heads, dim, layers, "cpu", False, start_layer=0, end_layer=layers - 1
    )
    return MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        PAGE,
        "page_first",
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
        write_back_staging=device.hicache_write_back_staging,
    )


def storage(host: Any, section: dict[str, Any], v1: bool) -> Any:
    extra = {
        "backend_name": "aiokvtier",
        "module_path": "aiokvtier.integrations.sglang",
        "class_name": "HiCacheAiokvtier",
        "interface_v1": int(v1),
        "aiokvtier": section,
    }
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench",
        extra_config=extra,
    )
    made = StorageBackendFactory.create_backend("dynamic", config, host)
    made.register_mem_pool_host(host)
    return made


def summary(seconds: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in seconds)
    return {
        "p50_ms": round(statistics.median(ms), 4),
        "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 4),
        "min_ms": round(ms[0], 4),
    }


def timed_once(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def section_slots(made: Any) -> int:
    stats = made.statistics()
    tier = getattr(stats, "tier", None)
    return int(tier.slots_total if tier is not None else stats.capacity)


def timed(fn: Callable[[], Any], rounds: int) -> list[float]:
    fn()  # warm
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def measure(section: dict[str, Any], n: int, rounds: int, floor: Callable[[list[bytes], int], list[float]]) -> Any:
    host = host_pool(n)
    results = {}
    for fmt in ("v1", "flat"):
        made = storage(host, section, v1=fmt == "v1")
        try:
            keys = [f"{fmt}-{i:060x}" for i in range(n)]
            before = made.statistics().blocks
            indices = host.alloc(n * PAGE)
            if fmt == "v1":
                assert all(made.batch_set_v1(keys, indices))
            else:
                pages = [host.get_data_page(int(indices[i * PAGE])) for i in range(n)]
                assert made.batch_set(keys, pages)
            host.free(indices)
            assert made.batch_exists(keys) == n
            batches = [keys[i : i + STORAGE_BATCH_SIZE] for i in range(0, n, STORAGE_BATCH_SIZE)]
            blocks = (made.statistics().blocks - before) // n  # blocks per page
            results[fmt] = {
                "blocks_per_page": blocks,
                "one_call": summary(timed(lambda made=made, keys=keys: made.batch_exists(keys), rounds)),
                "sglang_batches": summary(
                    timed(lambda made=made, b=batches: [made.batch_exists(k) for k in b], rounds)
                ),
                # The same number of stored block keys, of the same length, looked up beneath the adapter.
                "floor": summary(floor(block_keys(fmt, n * blocks, 8 + 64 + (2 if blocks > 1 else 0)), rounds)),
            }
        finally:
            made.close()
    return results


def block_keys(name: str, n: int, length: int) -> list[bytes]:
    return [f"{name}{i}".encode().ljust(length, b".") for i in range(n)]


def pool_floor(path: str) -> Callable[[list[bytes], int], list[float]]:
    def run(keys: list[bytes], rounds: int) -> list[float]:
        async def go() -> list[float]:
            async with AttachedPool(path) as pool:
                await pool.store(keys, [b"x"] * len(keys))
                assert await pool.lookup(keys) == len(keys)
                out = []
                for _ in range(rounds):
                    start = time.perf_counter()
                    await pool.lookup(keys)
                    out.append(time.perf_counter() - start)
                return out

        return asyncio.run(go())

    return run


def store_floor(keys: list[bytes], rounds: int) -> list[float]:
    async def go() -> list[float]:
        async with HostTier({"quota": "64MiB", "slot_size": "4KiB"}) as tier, BlockStore(tier) as store:
            await store.store(keys, [b"x"] * len(keys))
            assert store.lookup(keys) == len(keys)
            out = []
            for _ in range(rounds):
                start = time.perf_counter()
                store.lookup(keys)
                out.append(time.perf_counter() - start)
            return out

    return asyncio.run(go())


def transfers(section: dict[str, Any], rounds: int) -> dict[str, Any]:
    n = STORAGE_BATCH_SIZE
    host = host_pool(n, layers=8, heads=8, dim=128)
    made = storage(host, section, v1=True)
    try:
        src, dst = host.alloc(n * PAGE), host.alloc(n * PAGE)
        ptrs, sizes = host.get_page_buffer_meta(src)
        for p, size in zip(ptrs, sizes, strict=True):
            ctypes.memmove(p, os.urandom(size), size)
        total = sum(sizes)
        scratch = np.empty(total, dtype=np.uint8)
        base = scratch.ctypes.data

        def copy_alone() -> None:
            offset = 0
            for p, size in zip(ptrs, sizes, strict=True):
                ctypes.memmove(base + offset, p, size)
                offset += size

        counter = iter(range(1 << 30))
        last: list[list[str]] = []

        def store() -> None:
            keys = [f"t{next(counter)}-{i:058x}" for i in range(n)]
            assert all(made.batch_set_v1(keys, src))
            last[:] = [keys]

        # Until the tier is full, each store lands in slots this process has not touched yet: over a pool,
        # its mapping of the shared memory takes a page fault per 4 KiB there. Timed apart.
        first_touch = [timed_once(store) for _ in range(section_slots(made) // (2 * n))]
        sets = timed(store, rounds)
        gets = timed(lambda: made.batch_get_v1(last[0], dst), rounds)
        assert all(made.batch_get_v1(last[0], dst))

        # SGLang's scheduler thread calls get_stats() while the backup thread stores: how long it takes then.
        busy = threading.Event()

        def backup() -> None:
            while not busy.is_set():
                store()

        made.get_stats()  # its first call imports SGLang's metrics module
        thread = threading.Thread(target=backup)
        thread.start()
        stats_calls = []
        for _ in range(rounds * 20):
            start = time.perf_counter()
            made.get_stats()
            stats_calls.append(time.perf_counter() - start)
            time.sleep(0.001)
        busy.set()
        thread.join()
        return {
            "pages": n,
            "mib_per_call": round(total / (1 << 20), 1),
            "batch_set_v1_first_touch": summary(first_touch),
            "batch_set_v1": summary(sets),
            "batch_get_v1": summary(gets),
            "floor": summary(timed(copy_alone, rounds)),
            "get_stats_during_stores": {
                **summary(stats_calls),
                "p99_ms": round(sorted(stats_calls)[int(0.99 * (len(stats_calls) - 1))] * 1e3, 4),
                "max_ms": round(max(stats_calls) * 1e3, 4),
                "calls": len(stats_calls),
            },
        }
    finally:
        made.close()


class Owner:
    """``aiokvtier pool`` in a child process, on a socket in a temporary directory."""

    def __init__(self, quota: str, slot: str) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.path = os.path.join(self._tmp.name, "pool.sock")
        command = ["pool", "--quota", quota, "--slot-size", slot, "--socket", self.path]
        self._owner = subprocess.Popen([sys.executable, "-m", "aiokvtier", *command], stdout=subprocess.PIPE, text=True)
        assert self._owner.stdout is not None
        json.loads(self._owner.stdout.readline())

        async def filled() -> None:  # measure a filled pool, not one whose fill the first stores wait for
            async with AttachedPool(self.path) as pool:
                await pool.wait_resident()

        asyncio.run(filled())

    def __enter__(self) -> str:
        return self.path

    def __exit__(self, *exc: object) -> None:
        self._owner.terminate()
        self._owner.wait()
        self._tmp.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--tier", action="store_true", help="a process-local tier instead of a pool")
    args = parser.parse_args()
    out: dict[str, Any] = {"bench": "sglang_storage", "keys": args.keys, "rounds": args.rounds, "machine": machine()}
    if args.tier:
        out["mode"] = "tier"
        out["exists"] = measure({"tier": {"quota": "64MiB", "slot_size": "4KiB"}}, args.keys, args.rounds, store_floor)
        out["transfers"] = transfers({"tier": {"quota": "512MiB", "slot_size": "256KiB"}}, args.rounds)
    else:
        out["mode"] = "pool"
        with Owner("128MiB", "4KiB") as path:
            out["exists"] = measure({"pool": path}, args.keys, args.rounds, pool_floor(path))
        with Owner("512MiB", "256KiB") as path:
            out["transfers"] = transfers({"pool": path}, args.rounds)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
