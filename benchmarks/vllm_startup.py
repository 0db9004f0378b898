"""How soon vLLM's offloading takes its first store: the aiokvtier spec against vLLM's CPU tier buffer.

Needs vLLM (``pip install 'aiokvtier[vllm]'``). On one process, with CPU
tensors standing in for the GPU KV cache (two layers of 64 KiB pages, the
host-to-host engine copying), for a tier of ``--size`` bytes:

- ``aiokvtier``: from ``OffloadingSpecFactory.create_spec`` to the first
  store's result in ``get_finished`` (spec, ``get_worker`` opening the
  tier and the engine, the manager's ``prepare_store``, ``submit_store``,
  polling), the bytes resident at that moment, and when the fill ended;
  then the time ``submit_store`` and ``get_finished`` hold the caller's
  thread (a 16-block store, 32 pages, repeated).
- ``vllm_region``: vLLM 0.33's ``SharedOffloadRegion`` for the same bytes,
  what its CPU tier builds before serving on a CUDA machine (``/dev/shm``
  files, pre-faulted), without the host registration (pinning) that follows
  there, which has no CUDA to run on here.
- ``torch_zeros``: ``torch.zeros`` of the same bytes, the buffer vLLM's CPU
  worker allocates where it uses no shared region (``pin_memory`` needs CUDA,
  so unpinned here: a lower bound of the pinned allocation).

``--first-only N``: only the aiokvtier spec's construction to its first
store, N times in fresh specs, each worker shut down right after its first
store (the fill has then made little resident): for tiers larger than the
machine's memory, which reserving allows and filling would not.

::

    python benchmarks/vllm_startup.py [--size 8GiB] [--repeat 200]
    python benchmarks/vllm_startup.py --size 256GiB --first-only 5

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from aiokvtier._config import _size_bytes
from aiokvtier.bench._common import machine
from aiokvtier.integrations.vllm import AiokvtierOffloadingWorker

PAGE = 64 * 1024
LAYERS = 2
GPU_BLOCKS = 256


def _config(size: int) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=LAYERS * PAGE,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "AiokvtierOffloadingSpec",
            "spec_module_path": "aiokvtier.integrations.vllm",
            "cpu_bytes_to_use": size,
        },
        engine_id="aiokvtier-bench",
        model=OffloadingModelConfig(name="bench", dtype="float16", max_model_len=32768),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def _caches() -> CanonicalKVCaches:
    tensors = [torch.randint(-128, 128, (GPU_BLOCKS, PAGE), dtype=torch.int8) for _ in range(LAYERS)]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE) for i in range(LAYERS)]],
    )


def _wait(worker: Any, job_id: int) -> bool:
    while True:
        for result in worker.get_finished():
            if result.job_id == job_id:
                return bool(result.success)
        time.sleep(0.0001)


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50_us": round(statistics.median(ordered) * 1e6, 1),
        "p99_us": round(ordered[int(0.99 * (len(ordered) - 1))] * 1e6, 1),
        "max_us": round(ordered[-1] * 1e6, 1),
    }


def _store_calls(worker: Any, manager: Any, request: ReqContext, jobs: range) -> dict[str, Any]:
    """How long ``submit_store`` (16 blocks) and ``get_finished`` hold the caller's thread."""
    submit: list[float] = []
    finished: list[float] = []
    for job in jobs:
        keys = [make_offload_key(job.to_bytes(4, "big") + i.to_bytes(28, "big"), 0) for i in range(16)]
        out = manager.prepare_store(keys, request)
        assert out is not None
        gpu = GPULoadStoreSpec(list(range(16)), group_sizes=[16], block_indices=[0])
        t0 = time.perf_counter()
        assert worker.submit_store(job, gpu, out.store_spec)
        submit.append(time.perf_counter() - t0)
        while True:
            t0 = time.perf_counter()
            results = worker.get_finished()
            finished.append(time.perf_counter() - t0)
            if results:
                assert [r.job_id for r in results] == [job] and results[0].success
                break
            time.sleep(0.0001)
        manager.complete_store(keys, request)
    return {"submit_store_16_blocks": _quantiles(submit), "get_finished": _quantiles(finished)}


def measure_aiokvtier(size: int, repeat: int) -> dict[str, Any]:
    caches = _caches()
    config = _config(size)
    began = time.perf_counter()
    scheduler = OffloadingSpecFactory.create_spec(config)
    manager = scheduler.get_manager()
    spec = OffloadingSpecFactory.create_spec(config)
    worker = spec.get_worker(caches)
    assert isinstance(worker, AiokvtierOffloadingWorker)
    opened = time.perf_counter()
    request = ReqContext(req_id="bench")
    manager.on_new_request(request)
    key = [make_offload_key(b"\x00" * 32, 0)]
    out = manager.prepare_store(key, request)
    assert out is not None
    assert worker.submit_store(0, GPULoadStoreSpec([0], group_sizes=[1], block_indices=[0]), out.store_spec)
    assert _wait(worker, 0)
    first = time.perf_counter()
    resident_at_first = worker.tier.statistics().resident_bytes
    manager.complete_store(key, request)

    during_fill = _store_calls(worker, manager, request, range(1, repeat + 1))
    while worker.tier.statistics().filling:
        time.sleep(0.01)
    stats = worker.tier.statistics()
    after_fill = _store_calls(worker, manager, request, range(repeat + 1, 2 * repeat + 1))
    worker.shutdown()
    return {
        "spec_and_worker_ms": round((opened - began) * 1e3, 2),
        "first_store_ms": round((first - began) * 1e3, 2),
        "resident_at_first_store_bytes": resident_at_first,
        "fill_s": round(stats.fill_seconds, 3),
        "tier_bytes": stats.quota,
        "fill_threads": stats.fill_threads,
        "calls_during_fill": during_fill,
        "calls_after_fill": after_fill,
    }


def measure_first_store(size: int, runs: int) -> dict[str, Any]:
    caches = _caches()
    config = _config(size)
    worker_ms: list[float] = []
    first_ms: list[float] = []
    resident: list[int] = []
    for _ in range(runs):
        began = time.perf_counter()
        manager = OffloadingSpecFactory.create_spec(config).get_manager()
        worker = OffloadingSpecFactory.create_spec(config).get_worker(caches)
        assert isinstance(worker, AiokvtierOffloadingWorker)
        opened = time.perf_counter()
        request = ReqContext(req_id="first")
        manager.on_new_request(request)
        out = manager.prepare_store([make_offload_key(b"\x00" * 32, 0)], request)
        assert out is not None
        assert worker.submit_store(0, GPULoadStoreSpec([0], group_sizes=[1], block_indices=[0]), out.store_spec)
        assert _wait(worker, 0)
        first = time.perf_counter()
        resident.append(worker.tier.statistics().resident_bytes)
        worker.shutdown()
        worker_ms.append((opened - began) * 1e3)
        first_ms.append((first - began) * 1e3)
    return {
        "runs": runs,
        "spec_and_worker_ms": [round(v, 2) for v in worker_ms],
        "first_store_ms": [round(v, 2) for v in first_ms],
        "first_store_median_ms": round(statistics.median(first_ms), 2),
        "resident_at_first_store_bytes": resident,
    }


def measure_vllm_region(size: int) -> dict[str, Any]:
    chunk = LAYERS * PAGE
    began = time.perf_counter()
    region = SharedOffloadRegion(
        engine_id=f"aiokvtier-bench-{time.monotonic_ns()}",
        num_chunks=size // chunk,
        rank=0,
        kv_bytes_per_chunk=chunk,
        cpu_page_size=chunk,
        num_segments=32,
    )
    ready = time.perf_counter()
    region.cleanup()
    return {"ready_ms": round((ready - began) * 1e3, 2), "pinned": False}


def measure_torch_zeros(size: int) -> dict[str, Any]:
    began = time.perf_counter()
    buffer = torch.zeros((size,), dtype=torch.int8)
    ready = time.perf_counter()
    del buffer
    gc.collect()
    return {"ready_ms": round((ready - began) * 1e3, 2), "pinned": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="8GiB", help="tier bytes (cpu_bytes_to_use)")
    parser.add_argument("--repeat", type=int, default=200, help="16-block stores timed on the caller's thread")
    parser.add_argument("--first-only", type=int, default=0, metavar="N", help="construction to first store only")
    args = parser.parse_args()
    size = _size_bytes(args.size, "--size")
    if args.first_only:
        report = {
            "benchmark": "vllm_first_store",
            "size_bytes": size,
            "machine": machine(),
            "aiokvtier": measure_first_store(size, args.first_only),
        }
        print(json.dumps(report, indent=1))
        return
    report = {
        "benchmark": "vllm_startup",
        "size_bytes": size,
        "machine": machine(),
        "aiokvtier": measure_aiokvtier(size, args.repeat),
        "vllm_region": measure_vllm_region(size),
        "torch_zeros": measure_torch_zeros(size),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
