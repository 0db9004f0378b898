"""A vLLM replica over a pool, for tests/test_integration_vllm_pool.py: the helpers both use, and a process.

``python tests/vllm_pool_replica.py PATH JSON`` builds a scheduler-side and a worker-side spec with
vLLM's factory (DP index ``dp``, its own KV caches of ``seed``), then for ``{"op": "load", "keys": [...],
"blocks": [...]}`` looks the chunks up and loads them into those GPU blocks, or for ``{"op": "store", ...}``
stores those blocks under those chunks; it prints one JSON line: the lookups, whether the job succeeded,
and the SHA-256 of each KV tensor's rows of the blocks.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    OffloadingWorker,
    OffloadKey,
    TransferResult,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

PAGE = 4096
LAYERS = 2
GPU_BLOCKS = 64


def pool_config(
    path: str,
    *,
    rank: int = 0,
    world_size: int = 1,
    dp: int = 0,
    blocks_per_chunk: int = 1,
    events: bool = True,
    page: int = PAGE,
    **extra: Any,
) -> OffloadingConfig:
    """What ``build_offloading_config`` makes for a one-group, two-layer model, over the pool at ``path``."""
    extra_config = {
        "spec_name": "AiokvtierOffloadingSpec",
        "spec_module_path": "aiokvtier.integrations.vllm",
        "aiokvtier": {"pool": path},
        **extra,
    }
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=LAYERS * page,
        enable_kv_cache_events=events,
        extra_config=extra_config,
        engine_id=f"replica-{dp}",
        model=OffloadingModelConfig(name="test", dtype="float16", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=dp,
            data_parallel_size=2,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def kv_caches(seed: int, page: int = PAGE) -> CanonicalKVCaches:
    """One tensor per layer, (blocks, page) int8, as the connector canonicalizes them."""
    generator = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randint(-128, 128, (GPU_BLOCKS, page), dtype=torch.int8, generator=generator) for _ in range(LAYERS)
    ]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=page) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page) for i in range(LAYERS)]],
    )


def keys(numbers: list[int]) -> list[OffloadKey]:
    return [make_offload_key(hashlib.sha256(str(i).encode()).digest(), 0) for i in numbers]


def gpu_spec(block_ids: list[int], first_block: int = 0) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(block_ids, group_sizes=[len(block_ids)], block_indices=[first_block])


def digests(caches: CanonicalKVCaches, block_ids: list[int]) -> list[str]:
    return [hashlib.sha256(entry.tensor[block_ids].numpy().tobytes()).hexdigest() for entry in caches.tensors]


def finish(worker: OffloadingWorker, job_ids: set[int], timeout: float = 30.0) -> list[TransferResult]:
    """Polls ``get_finished`` as the connector does once a step, until the jobs ended."""
    results: list[TransferResult] = []
    deadline = time.monotonic() + timeout
    while {r.job_id for r in results} != job_ids:
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs {job_ids} did not finish")
        results += worker.get_finished()
        time.sleep(0.001)
    return results


def main(path: str, order: dict[str, Any]) -> dict[str, Any]:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    config = pool_config(path, dp=order["dp"])
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    caches = kv_caches(order["seed"])
    worker = OffloadingSpecFactory.create_spec(config).get_worker(caches)
    try:
        request = ReqContext(req_id="replica")
        manager.on_new_request(request)
        chunks = keys(order["keys"])
        blocks = order["blocks"]
        for _ in range(2):  # a lookup that answers RETRY is asked again at the next step, as vLLM does
            with manager.lock:
                answers = [manager.lookup(k, request) for k in chunks]
                manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
            if LookupResult.RETRY not in answers:
                break
        found = [answer is LookupResult.HIT for answer in answers]
        if order["op"] == "load":
            with manager.lock:
                spec = manager.prepare_load(chunks, request)
            worker.submit_load(1, spec, gpu_spec(blocks))
        else:
            with manager.lock:
                out = manager.prepare_store(chunks, request)
            worker.submit_store(1, gpu_spec(blocks), out.store_spec)
        (result,) = finish(worker, {1})
        return {"found": found, "success": result.success, "digests": digests(caches, blocks)}
    finally:
        worker.shutdown()
        manager.shutdown()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
