"""``bench store --sections shared``: a pool served by this process, used by others.

Three figures, each from real processes attached to a pool this process owns:

- ``attach_during_fill``: a process that attaches while the pool is still
  filling: how long until it is attached, has its first slot, and its first
  lookup answer, and how much of the pool was resident then (it must not
  wait for the whole fill).
- ``cross_process``: process A stores ``blocks`` blocks of 64 KiB; process B
  (started after A exited) looks all of them up (median of 50 or more) and
  loads them bit-exact; its load throughput beside the same load done in A.
- ``concurrent``: 8 processes at once, each storing ``blocks`` keys of its
  own in one call (1-byte pages), looking them up and dropping them, 20
  rounds: p50 and p99 of the store and lookup calls, and of the CPU time the
  lookups took in their thread (the rest of a lookup's time is waiting for
  a CPU, or for the owner when it asked the owner); how many lookups asked
  the owner, and how many reads of the index mirror were done over.
- ``eight_processes``: 8 processes attach at once and each reads every page
  of the (resident) pool: how much their private memory grew (from
  ``/proc/self/smaps_rollup``) beside the pool's size, and how much shared
  memory each maps.

The attached processes are ``python -c`` children running ``client()``;
each prints one JSON line.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from .._config import HostTierConfig
from .._pool._client import AttachedPool
from .._pool._owner import Pool
from ._common import median, summary_ms

__all__ = ["client", "shared"]

KiB = 1 << 10
MiB = 1 << 20
PAGE = 64 * KiB


def _keys(n: int) -> list[bytes]:
    return [b"shared-bench-%08d" % i for i in range(n)]


def _pages(n: int) -> np.ndarray:
    return np.random.default_rng(1234).integers(0, 256, (n, PAGE), dtype=np.uint8)


async def _client(mode: str, path: str, n: int, repeats: int) -> dict[str, Any]:
    if mode == "attach":
        sys.stdin.readline()  # "go": the owner has started its pool (imports are done before)
        started = time.perf_counter()
        async with AttachedPool(path) as pool:
            attached = time.perf_counter()
            await pool.allocate()
            slot = time.perf_counter()
            resident = pool.resident_bytes
            await pool.lookup([b"nothing"])
            lookup = time.perf_counter()
            await pool.wait_resident()
            whole = time.perf_counter()
            return {
                "attach_ms": round((attached - started) * 1e3, 2),
                "first_slot_ms": round((slot - started) * 1e3, 2),
                "first_lookup_ms": round((lookup - started) * 1e3, 2),
                "resident_fraction_at_first_slot": round(resident / pool.quota, 4),
                "whole_fill_ms": round((whole - started) * 1e3, 1),
            }
    if mode == "touch":
        before = _private_kib()
        async with AttachedPool(path) as pool:
            await pool.wait_resident()
            size = pool.quota
            mapped = np.frombuffer(memoryview((ctypes.c_ubyte * size).from_address(pool.base_address)), np.uint8)
            checksum = int(mapped[::4096].sum(dtype=np.uint64))  # a read of every page
            after = _private_kib()
            shared_kib = _rollup().get("Shared_Clean", 0) + _rollup().get("Shared_Dirty", 0)
            del mapped
        return {"private_growth_kib": after - before, "shared_kib": shared_kib, "checksum": checksum}
    if mode == "concurrent":
        # n keys of its own a round (1-byte pages: the index's cost, not the copies'), stored, looked up, dropped.
        async with AttachedPool(path) as pool:
            mine = [b"%d-%d-" % (os.getpid(), i) for i in range(n)]
            print(json.dumps({"ready": True}), flush=True)
            await asyncio.to_thread(sys.stdin.readline)  # "go": every process is attached
            stores, lookups, cpu = [], [], []
            page = np.zeros((n, 1), dtype=np.uint8)
            for _ in range(repeats):
                started = time.perf_counter()
                result = await pool.store(mine, page)
                stores.append(time.perf_counter() - started)
                started, on_cpu = time.perf_counter(), time.thread_time()
                hits = await pool.lookup(mine)
                lookups.append(time.perf_counter() - started)
                cpu.append(time.thread_time() - on_cpu)  # this thread's own CPU time: the rest is waiting
                if result.skipped or hits != n:
                    raise RuntimeError(f"{len(result.skipped)} skipped, {hits} of {n} found")
                await pool.discard(mine)
            return {"store_s": stores, "lookup_s": lookups, "lookup_cpu_s": cpu}
    keys, pages = _keys(n), _pages(n)
    out: dict[str, Any] = {}
    async with AttachedPool(path) as pool:
        if mode == "store":
            started = time.perf_counter()
            result = await pool.store(keys, pages)
            out["store_s"] = time.perf_counter() - started
            if result.skipped:
                raise RuntimeError(f"the pool skipped {len(result.skipped)} blocks")
        lookups = []
        for _ in range(max(repeats, 50)):  # cheap: enough of them for a steady median
            started = time.perf_counter()
            hits = await pool.lookup(keys)
            lookups.append(time.perf_counter() - started)
            if hits != n:
                raise RuntimeError(f"{hits} of {n} keys found")
        dst = np.zeros_like(pages)
        loads = []
        for _ in range(repeats):
            started = time.perf_counter()
            await pool.load(keys, dst)
            loads.append(time.perf_counter() - started)
        out["lookup_ms"] = round(median(lookups) * 1e3, 3)
        out["load_gb_s"] = round(pages.nbytes / median(loads) / 1e9, 2)
        out["bit_exact"] = bool((dst == pages).all())
    return out


def _rollup() -> dict[str, int]:
    fields: dict[str, int] = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                fields[name] = int(parts[0])
    return fields


def _private_kib() -> int:
    rollup = _rollup()
    return rollup.get("Private_Clean", 0) + rollup.get("Private_Dirty", 0)


def client() -> None:
    """The attached process's entry (``python -c``): ``MODE PATH BLOCKS REPEATS``, one JSON line out."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a Ctrl-C meant for the benchmark ends it quietly
    mode, path, n, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(asyncio.run(_client(mode, path, n, repeats))), flush=True)


def _spawn(mode: str, path: str, n: int, repeats: int) -> subprocess.Popen[str]:
    code = "from aiokvtier.bench._shared import client; client()"
    return subprocess.Popen(
        [sys.executable, "-c", code, mode, path, str(n), str(repeats)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


async def _answer(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = await asyncio.to_thread(proc.communicate, None, 600)
    if proc.returncode != 0:
        raise RuntimeError(f"an attached process failed (status {proc.returncode})")
    answer: dict[str, Any] = json.loads(out)
    return answer


async def _run(quota: int, blocks: int, repeats: int) -> dict[str, Any]:
    directory = tempfile.mkdtemp(prefix="aiokvtier-bench-")
    path = os.path.join(directory, "pool.sock")
    config = HostTierConfig.model_validate({"quota": quota, "max_quota": quota, "slot_size": PAGE, "numa_node": None})
    try:
        attacher = _spawn("attach", path, 0, 0)
        await asyncio.sleep(1.0)  # its imports, before the pool exists
        async with Pool(config, path) as pool:
            assert attacher.stdin is not None
            attacher.stdin.write("go\n")
            attacher.stdin.flush()
            during = await _answer(attacher)
            during["quota_bytes"] = quota
            await pool.tier.wait_resident()
            a = await _answer(_spawn("store", path, blocks, repeats))
            b = await _answer(_spawn("load", path, blocks, repeats))
            asked = pool.statistics()
            rivals = [_spawn("concurrent", path, blocks, 20) for _ in range(8)]
            for rival in rivals:
                assert rival.stdout is not None and rival.stdin is not None
                await asyncio.to_thread(rival.stdout.readline)  # attached
            for rival in rivals:
                assert rival.stdin is not None
                rival.stdin.write("go\n")
                rival.stdin.flush()
            contended = [await _answer(rival) for rival in rivals]
            # Complete: each process's counts came before its last discard's reply (one connection, one order).
            told = pool.statistics()
            touchers = [_spawn("touch", path, 0, 0) for _ in range(8)]
            touched = [await _answer(p) for p in touchers]
        cross = {
            "blocks": blocks,
            "block_bytes": PAGE,
            "store_s_in_a": round(a["store_s"], 3),
            "lookup_ms_in_b": b["lookup_ms"],
            "lookup_ms_in_a": a["lookup_ms"],
            "load_gb_s_in_b": b["load_gb_s"],
            "load_gb_s_in_a": a["load_gb_s"],
            "b_over_a": round(b["load_gb_s"] / a["load_gb_s"], 3) if a["load_gb_s"] else None,
            "bit_exact": b["bit_exact"] and a["bit_exact"],
        }
        growth = [t["private_growth_kib"] * KiB for t in touched]
        eight = {
            "processes": 8,
            "pool_bytes": quota,
            "private_growth_bytes": sum(growth),
            "private_growth_fraction_of_pool": round(sum(growth) / quota, 5),
            "shared_bytes_mapped_per_process": [t["shared_kib"] * KiB for t in touched],
            "same_bytes_read": len({t["checksum"] for t in touched}) == 1,
        }
        stores = [x for c in contended for x in c["store_s"]]
        lookups = [x for c in contended for x in c["lookup_s"]]
        concurrent = {
            "processes": 8,
            "keys_per_call": blocks,
            "calls_per_process": 20,
            "store_ms": summary_ms(stores),
            "lookup_ms": summary_ms(lookups),
            "lookup_cpu_ms": summary_ms([x for c in contended for x in c["lookup_cpu_s"]]),
            "lookups_asking_owner": told.owner_lookups - asked.owner_lookups,
            "mirror_reads_done_over": told.mirror_retries - asked.mirror_retries,
        }
        result = {"attach_during_fill": during, "cross_process": cross, "concurrent": concurrent}
        return result | {"eight_processes": eight}
    finally:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)


def shared(quick: bool, repeats: int) -> dict[str, Any]:
    quota = 512 * MiB if quick else 4096 * MiB
    return asyncio.run(_run(quota, 512 if quick else 4096, max(repeats, 3)))
