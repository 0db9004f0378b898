"""vLLM's offloading over the machine-wide pool against the spec's private tier: lookups, stores, loads.

Needs vLLM (``pip install 'aiokvtier[vllm]'``). Starts ``aiokvtier pool`` in a process of its own, then in
this process two replicas (DP index 0 and 1) over it, each a scheduler-side and a worker-side spec made by
vLLM's ``OffloadingSpecFactory``, with CPU tensors standing in for the GPU KV cache (``--layers`` KV
tensors of ``--page``-byte pages, one block per chunk). Replica A stores ``--chunks`` chunks in jobs of
16; replica B looks each up (the scheduler's ``lookup``, a call per chunk as vLLM makes it) and loads
them in jobs of 16. The baseline is the same calls on the spec's private tier (vLLM's
``CPUOffloadingManager`` keeping the books, the worker's own ``HostTier``): one replica storing and
loading its own chunks.

Figures, medians with p90, in microseconds: ``lookup`` per chunk (a request of 16 chunks looked up as
vLLM's scheduler does, over two steps where an answer is RETRY, divided by 16), ``submit``
(what ``submit_store`` / ``submit_load`` hold the caller), ``job`` (from the submission to the result in
``get_finished``, polled).

::

    python benchmarks/vllm_pool.py [--layers 8] [--page 64KiB] [--chunks 256]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from aiokvtier._config import _size_bytes

JOB = 16


def config(layers: int, page: int, extra: dict[str, Any], dp: int) -> OffloadingConfig:
    names = tuple(f"l{i}" for i in range(layers))
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=names, group_id=0),),
        worker_kv_bytes_per_block=layers * page,
        enable_kv_cache_events=False,
        extra_config={"spec_name": "AiokvtierOffloadingSpec", "spec_module_path": "aiokvtier.integrations.vllm",
                      **extra},
        engine_id=f"bench-{dp}",
        model=OffloadingModelConfig(name="bench", dtype="float16", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=dp,
            data_parallel_size=2, data_parallel_rank_local=None, is_parallelism_agnostic=False,
        ),
    )  # fmt: skip


def caches(layers: int, page: int, blocks: int, seed: int) -> CanonicalKVCaches:
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(-128, 128, (blocks, page), dtype=torch.int8, generator=generator) for _ in range(layers)]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=page) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page) for i in range(layers)]],
    )


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered) * 1e6, 1), "p90": round(ordered[int(len(ordered) * 0.9)] * 1e6, 1)}


class Replica:
    def __init__(self, layers: int, page: int, chunks: int, extra: dict[str, Any], dp: int) -> None:
        made = config(layers, page, extra, dp)
        self.manager = OffloadingSpecFactory.create_spec(made).get_manager()
        self.caches = caches(layers, page, chunks, seed=dp)
        self.worker = OffloadingSpecFactory.create_spec(made).get_worker(self.caches)
        self.request = ReqContext(req_id=f"bench{dp}")
        self.manager.on_new_request(self.request)
        self.jobs = 0
        self.figures: dict[str, list[float]] = {"lookup": [], "store_submit": [], "store_job": [], "load_submit": [],
                                                "load_job": []}  # fmt: skip

    def lookup(self, keys: list[Any]) -> int:
        """Looks a request's chunks up as vLLM's scheduler does: chunk by chunk until a miss, the step's end,
        and again at the next step if an answer was RETRY; the time per request, divided by its chunks."""
        end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
        request = ReqContext(req_id=os.urandom(8).hex())
        began = time.perf_counter()
        with self.manager.lock:
            for _ in range(2):
                answers = []
                for key in keys:
                    answers.append(self.manager.lookup(key, request))
                    if answers[-1] is LookupResult.MISS:
                        break
                self.manager.on_schedule_end(end)
                if LookupResult.RETRY not in answers:
                    break
        self.figures["lookup"].append((time.perf_counter() - began) / len(keys))
        return answers.count(LookupResult.HIT)

    def _job(self, kind: str, submit: Any) -> None:
        self.jobs += 1
        began = time.perf_counter()
        assert submit(self.jobs)
        submitted = time.perf_counter()
        while True:
            results = self.worker.get_finished()
            if results:
                assert results[0].success, results
                break
            time.sleep(0.0001)
        self.figures[f"{kind}_submit"].append(submitted - began)
        self.figures[f"{kind}_job"].append(time.perf_counter() - began)

    def store(self, keys: list[Any], blocks: list[int]) -> None:
        with self.manager.lock:
            out = self.manager.prepare_store(keys, self.request)
        assert out is not None and len(out.keys_to_store) == len(keys)
        spec = GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])
        self._job("store", lambda job: self.worker.submit_store(job, spec, out.store_spec))
        with self.manager.lock:
            self.manager.complete_store(keys, self.request)

    def load(self, keys: list[Any], blocks: list[int]) -> None:
        with self.manager.lock:
            source = self.manager.prepare_load(keys, self.request)
        spec = GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])
        self._job("load", lambda job: self.worker.submit_load(job, source, spec))
        with self.manager.lock:
            self.manager.complete_load(keys, self.request)

    def close(self) -> None:
        self.worker.shutdown()
        self.manager.shutdown()


def run(layers: int, page: int, chunks: int, extra: dict[str, Any], storer: Replica | None = None) -> dict[str, Any]:
    keys = [make_offload_key(os.urandom(32), 0) for _ in range(chunks)]
    a = storer or Replica(layers, page, chunks, extra, dp=0)
    b = Replica(layers, page, chunks, extra, dp=1) if storer is None and "aiokvtier" in extra else a
    try:
        for start in range(0, chunks, JOB):
            a.store(keys[start : start + JOB], list(range(start, start + JOB)))
        hits = sum(b.lookup(keys[start : start + JOB]) for start in range(0, chunks, JOB))
        assert hits == chunks, f"{hits} of {chunks} chunks found"
        reversed_blocks = list(range(chunks))[::-1]
        for start in range(0, chunks, JOB):
            b.load(keys[start : start + JOB], reversed_blocks[start : start + JOB])
        for entry_a, entry_b in zip(a.caches.tensors, b.caches.tensors, strict=True):
            assert torch.equal(entry_b.tensor[reversed_blocks[:JOB]], entry_a.tensor[:JOB]) or b is a
        figures = {**{k: summary(v) for k, v in a.figures.items() if k.startswith("store")},
                   **{k: summary(v) for k, v in b.figures.items() if not k.startswith("store")}}  # fmt: skip
        return figures
    finally:
        a.close()
        if b is not a:
            b.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--page", default="64KiB")
    parser.add_argument("--chunks", type=int, default=256)
    args = parser.parse_args()
    page = _size_bytes(args.page, "--page")
    chunk_bytes = args.layers * page * args.chunks
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "pool.sock")
        quota = 2 * chunk_bytes  # room for the chunks and their seals (a slot each)
        owner = subprocess.Popen(
            [sys.executable, "-m", "aiokvtier", "pool", "--socket", path, "--quota", str(quota), "--max-quota",
             str(quota), "--slot-size", str(page)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert owner.stdout is not None
            assert json.loads(owner.stdout.readline())["event"] == "serving"
            pool = run(args.layers, page, args.chunks, {"aiokvtier": {"pool": path}})
        finally:
            owner.terminate()
            owner.wait(timeout=30)
    private = run(args.layers, page, args.chunks, {"cpu_bytes_to_use": 2 * chunk_bytes})
    print(json.dumps({
        "layers": args.layers, "page": page, "chunks": args.chunks, "blocks_per_job": JOB, "torch": torch.__version__,
        "pool_two_replicas": pool, "private_tier_one_replica": private,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
