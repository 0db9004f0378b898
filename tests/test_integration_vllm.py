"""aiokvtier.integrations.vllm against vLLM's own offloading classes (skipped where vLLM is not installed).

The spec is made by vLLM's ``OffloadingSpecFactory`` from an ``OffloadingConfig``
built with vLLM's dataclasses (what ``build_offloading_config`` returns for a
one-group model, without a model to load), and driven with the offloading
connector's call pattern. The KV caches are CPU tensors, copied by the
host-to-host engine; CUDA tensors take the same path with a device engine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not installed")

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    ReqContext,
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
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from aiokvtier.integrations.vllm import AiokvtierOffloadingSpec, AiokvtierOffloadingWorker

PAGE = 4096
LAYERS = 2
GPU_BLOCKS = 64


def offloading_config(
    *, cpu_bytes: Any = 64 * LAYERS * PAGE, blocks_per_chunk: int = 1, **extra: Any
) -> OffloadingConfig:
    extra_config = {
        "spec_name": "AiokvtierOffloadingSpec",
        "spec_module_path": "aiokvtier.integrations.vllm",
        "cpu_bytes_to_use": cpu_bytes,
        **extra,
    }
    if cpu_bytes is None:
        del extra_config["cpu_bytes_to_use"]
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=LAYERS * PAGE,
        enable_kv_cache_events=True,
        extra_config=extra_config,
        engine_id="aiokvtier-test",
        model=OffloadingModelConfig(name="test", dtype="float16", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
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


def kv_caches(seed: int = 0) -> CanonicalKVCaches:
    """One tensor per layer, (blocks, page) int8, as the connector canonicalizes them."""
    generator = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randint(-128, 128, (GPU_BLOCKS, PAGE), dtype=torch.int8, generator=generator) for _ in range(LAYERS)
    ]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE) for i in range(LAYERS)]],
    )


def keys(start: int, count: int) -> list[OffloadKey]:
    return [make_offload_key(hashlib.sha256(str(i).encode()).digest(), 0) for i in range(start, start + count)]


def gpu_spec(block_ids: list[int], first_block: int = 0) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(block_ids, group_sizes=[len(block_ids)], block_indices=[first_block])


def finish(worker: OffloadingWorker, job_ids: set[int], timeout: float = 30.0) -> list[TransferResult]:
    """Polls ``get_finished`` as the connector does once a step, until the jobs ended."""
    results: list[TransferResult] = []
    deadline = time.monotonic() + timeout
    while {r.job_id for r in results} != job_ids:
        assert time.monotonic() < deadline, f"jobs {job_ids} did not finish"
        results += worker.get_finished()
        time.sleep(0.001)
    return results


@pytest.fixture
def made() -> Iterator[tuple[OffloadingSpec, OffloadingSpec, CanonicalKVCaches]]:
    """A scheduler-side and a worker-side spec, as vLLM makes one in each process."""
    config = offloading_config()
    scheduler = OffloadingSpecFactory.create_spec(config)
    worker_side = OffloadingSpecFactory.create_spec(config)
    yield scheduler, worker_side, kv_caches()


def rows(caches: CanonicalKVCaches, block_ids: list[int]) -> list[torch.Tensor]:
    return [entry.tensor[block_ids].clone() for entry in caches.tensors]


def test_the_factory_loads_the_spec_and_its_halves_are_vllms_classes(
    made: tuple[OffloadingSpec, OffloadingSpec, CanonicalKVCaches],
) -> None:
    scheduler, worker_side, caches = made
    assert type(scheduler) is AiokvtierOffloadingSpec
    assert isinstance(scheduler, OffloadingSpec)
    assert OffloadingSpecFactory.get_spec_cls(scheduler.extra_config) is AiokvtierOffloadingSpec
    manager = scheduler.get_manager()
    assert isinstance(manager, OffloadingManager)
    assert scheduler.get_manager() is manager
    worker = worker_side.get_worker(caches)
    try:
        assert isinstance(worker, OffloadingWorker)
        assert worker_side.get_worker(caches) is worker
    finally:
        worker.shutdown()
    # The metric and info names the spec declares are the ones its manager fills.
    assert set(manager.config_info()[0]) == set(type(scheduler).config_info_keys(dict(scheduler.extra_config)))
    assert manager.get_stats() is not None


def test_the_scheduler_side_starts_no_thread_and_reserves_nothing() -> None:
    before = {t.ident for t in threading.enumerate()}
    spec = OffloadingSpecFactory.create_spec(offloading_config(cpu_bytes="64GiB"))
    spec.get_manager()
    assert {t.ident for t in threading.enumerate()} == before


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_store_then_load_round_trips_bit_exact(
    blocks_per_chunk: int,
) -> None:
    config = offloading_config(blocks_per_chunk=blocks_per_chunk)
    scheduler = OffloadingSpecFactory.create_spec(config)
    worker_side = OffloadingSpecFactory.create_spec(config)
    caches = kv_caches()
    manager = scheduler.get_manager()
    worker = worker_side.get_worker(caches)
    try:
        request = ReqContext(req_id="r1")
        manager.on_new_request(request)
        stored_blocks = [5, 9, 2, 40, 17, 33, 8, 1]  # 8 GPU blocks, in the request's order
        chunk_keys = keys(0, len(stored_blocks) // blocks_per_chunk)
        with manager.lock:
            assert [manager.lookup(k, request) for k in chunk_keys] == [LookupResult.MISS] * len(chunk_keys)
            out = manager.prepare_store(chunk_keys, request)
        assert out is not None and out.keys_to_store == chunk_keys and out.evicted_keys == []
        assert isinstance(out.store_spec, CPULoadStoreSpec)
        expected = rows(caches, stored_blocks)
        assert worker.submit_store(1, gpu_spec(stored_blocks), out.store_spec)
        (result,) = finish(worker, {1})
        assert result.success and result.transfer_size == len(stored_blocks) * LAYERS * PAGE
        with manager.lock:
            # Not loadable before complete_store, as with vLLM's CPU tier.
            assert manager.lookup(chunk_keys[0], request) == LookupResult.HIT_PENDING
            manager.complete_store(chunk_keys, request)
            (event,) = list(manager.take_events())
            assert event.keys == chunk_keys and not event.removed
            assert [manager.lookup(k, request) for k in chunk_keys] == [LookupResult.HIT] * len(chunk_keys)

        # Scribble over the GPU blocks, then load every stored block into other blocks.
        for entry in caches.tensors:
            entry.tensor[stored_blocks] = 0
        targets = [60, 61, 3, 4, 50, 51, 52, 12]
        with manager.lock:
            load_spec = manager.prepare_load(chunk_keys, request)
        assert worker.submit_load(2, load_spec, gpu_spec(targets))
        (result,) = finish(worker, {2})
        assert result.success
        with manager.lock:
            manager.complete_load(chunk_keys, request)
        for got, want in zip(rows(caches, targets), expected, strict=True):
            assert torch.equal(got, want)

        if blocks_per_chunk == 2:
            # A load that starts mid-chunk (the first GPU block is the second block of chunk 0).
            with manager.lock:
                load_spec = manager.prepare_load(chunk_keys[:2], request)
            assert worker.submit_load(3, load_spec, gpu_spec([20, 21, 22], first_block=1))
            assert finish(worker, {3})[0].success
            with manager.lock:
                manager.complete_load(chunk_keys[:2], request)
            for got, want in zip(rows(caches, [20, 21, 22]), expected, strict=True):
                assert torch.equal(got, want[1:4])
    finally:
        worker.shutdown()


def test_eviction_reuses_the_tier_slots_of_evicted_chunks() -> None:
    config = offloading_config(cpu_bytes=4 * LAYERS * PAGE)  # four chunks
    scheduler = OffloadingSpecFactory.create_spec(config)
    worker_side = OffloadingSpecFactory.create_spec(config)
    caches = kv_caches(seed=1)
    manager = scheduler.get_manager()
    worker = worker_side.get_worker(caches)
    assert isinstance(worker, AiokvtierOffloadingWorker)
    try:
        request = ReqContext(req_id="r")
        manager.on_new_request(request)
        first = keys(0, 4)
        with manager.lock:
            out = manager.prepare_store(first, request)
        assert out is not None
        assert worker.submit_store(1, gpu_spec([0, 1, 2, 3]), out.store_spec)
        assert finish(worker, {1})[0].success
        with manager.lock:
            manager.complete_store(first, request)
            list(manager.take_events())
            manager.touch(first[2:], request)  # the LRU order: 0 and 1 are the oldest
            second = keys(10, 2)
            out = manager.prepare_store(second, request)
        assert out is not None and out.evicted_keys == first[:2]
        assert worker.submit_store(2, gpu_spec([30, 31]), out.store_spec)
        assert finish(worker, {2})[0].success
        with manager.lock:
            manager.complete_store(second, request)
            events = list(manager.take_events())
            assert [(e.keys, e.removed) for e in events] == [(first[:2], True), (second, False)]
            assert manager.lookup(first[0], request) == LookupResult.MISS
            load_spec = manager.prepare_load(second, request)
        expected = rows(caches, [30, 31])
        assert worker.submit_load(3, load_spec, gpu_spec([62, 63]))
        assert finish(worker, {3})[0].success
        for got, want in zip(rows(caches, [62, 63]), expected, strict=True):
            assert torch.equal(got, want)
        # The tier holds the four chunks' slots, no more: evicted chunks' slots were reused.
        assert worker.tier.statistics().slots_allocated == 4 * worker.slots_per_chunk
        # A full tier with every chunk pinned by a load: vLLM's answer, None (nothing stored).
        with manager.lock:
            manager.prepare_load(first[2:], request)
            assert manager.prepare_store(keys(20, 3), request) is None
    finally:
        worker.shutdown()


def test_submissions_from_another_thread_and_wait() -> None:
    config = offloading_config()
    worker = OffloadingSpecFactory.create_spec(config).get_worker(kv_caches(seed=2))
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    try:
        request = ReqContext(req_id="t")
        manager.on_new_request(request)
        chunk_keys = keys(0, 16)
        out = manager.prepare_store(chunk_keys, request)
        assert out is not None
        submitted: list[bool] = []
        thread = threading.Thread(
            target=lambda: submitted.append(worker.submit_store(7, gpu_spec(list(range(16))), out.store_spec))
        )
        thread.start()
        thread.join()
        assert submitted == [True]
        worker.wait({7})  # returns once the job ended; the result is still reported once
        (result,) = finish(worker, {7})
        assert result.success
        assert worker.get_finished() == []
    finally:
        worker.shutdown()


@pytest.mark.timeout(60)
def test_wait_and_shutdown_on_the_workers_loop_thread_raise_instead_of_hanging() -> None:
    worker = OffloadingSpecFactory.create_spec(offloading_config()).get_worker(kv_caches(seed=5))
    answers: dict[str, Any] = {}

    class Calling(logging.Handler):
        """A handler of the failure a job logs, on the thread the job ran on: the worker's loop thread."""

        def emit(self, record: logging.LogRecord) -> None:
            answers["thread"] = threading.current_thread().name
            for name, call in (("wait", lambda: worker.wait({1})), ("shutdown", worker.shutdown)):
                try:
                    answers[name] = call()
                except Exception as exc:
                    answers[name] = exc

    handler = Calling(logging.ERROR)
    logger = logging.getLogger("aiokvtier.integrations.vllm")
    logger.addHandler(handler)
    try:
        assert worker.submit_load(1, CPULoadStoreSpec([5]), gpu_spec([0]))  # a chunk never stored: it fails
        (result,) = finish(worker, {1})
        assert not result.success and answers["thread"] == "aiokvtier-vllm"
        for name in ("wait", "shutdown"):
            assert isinstance(answers[name], RuntimeError), name
            assert f"{name}() was called on the worker's own loop thread" in str(answers[name])
        logger.removeHandler(handler)
        # the refused shutdown shut nothing down
        assert worker.submit_load(2, CPULoadStoreSpec([5]), gpu_spec([0]))
        worker.wait({2})
        assert [r.job_id for r in finish(worker, {2})] == [2]
    finally:
        logger.removeHandler(handler)
        worker.shutdown()


def test_shutdown_while_a_store_waits_for_the_fill_leaves_nothing_claimed() -> None:
    # 32 Ki chunks of two 4 KiB pages: 256 MiB that one fill thread makes resident unit by unit.
    chunks = 32 * 1024
    config = offloading_config(
        cpu_bytes=chunks * LAYERS * PAGE,
        aiokvtier={"fill_threads": 1, "fill_chunk": "4MiB", "commit_unit": "4MiB"},
    )
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    before = {t.ident for t in threading.enumerate()}
    worker = OffloadingSpecFactory.create_spec(config).get_worker(kv_caches(seed=3))
    assert isinstance(worker, AiokvtierOffloadingWorker)
    tier = worker.tier
    request = ReqContext(req_id="s")
    manager.on_new_request(request)
    chunk_keys = keys(0, chunks)
    out = manager.prepare_store(chunk_keys, request)
    assert out is not None
    # Every chunk at once: the job waits for the last unit of the fill (a GPU block may be read many times).
    assert worker.submit_store(1, gpu_spec([0] * chunks), out.store_spec)
    worker.shutdown()
    results = worker.get_finished()
    assert [r.job_id for r in results] == [1]
    assert not results[0].success  # cancelled while it waited: it took no slot
    assert tier.released
    assert {t.ident for t in threading.enumerate()} == before
    assert worker.submit_store(2, gpu_spec([0]), CPULoadStoreSpec([0])) is False
    worker.shutdown()  # idempotent


def test_shutdown_during_copies_waits_for_them() -> None:
    config = offloading_config(cpu_bytes=4096 * LAYERS * PAGE)
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    before = {t.ident for t in threading.enumerate()}
    worker = OffloadingSpecFactory.create_spec(config).get_worker(kv_caches(seed=4))
    assert isinstance(worker, AiokvtierOffloadingWorker)
    request = ReqContext(req_id="c")
    manager.on_new_request(request)
    out = manager.prepare_store(keys(0, 4096), request)
    assert out is not None
    for job in range(8):
        ids = list(range(job * 512, (job + 1) * 512))
        spec = CPULoadStoreSpec(ids)
        assert worker.submit_store(job, gpu_spec([i % GPU_BLOCKS for i in ids]), spec)
    worker.shutdown()
    results = worker.get_finished()
    assert sorted(r.job_id for r in results) == list(range(8))  # each ended, stored or cancelled
    assert worker.tier.released
    assert {t.ident for t in threading.enumerate()} == before


def test_a_job_that_does_not_match_the_caches_is_refused_on_the_callers_thread(
    made: tuple[OffloadingSpec, OffloadingSpec, CanonicalKVCaches],
) -> None:
    _, worker_side, caches = made
    worker = worker_side.get_worker(caches)
    try:
        with pytest.raises(ValueError, match="chunk ids must lie in"):
            worker.submit_store(1, gpu_spec([0]), CPULoadStoreSpec([10**6]))
        with pytest.raises(ValueError, match="do not match"):
            worker.submit_store(1, gpu_spec([0, 1, 2]), CPULoadStoreSpec([0]))
        with pytest.raises(TypeError, match="CPULoadStoreSpec"):
            worker.submit_store(1, gpu_spec([0]), gpu_spec([0]))
        assert worker.get_finished() == []  # nothing was queued
        # A load of a chunk never stored ends as a failed job, not a copy of garbage.
        assert worker.submit_load(2, CPULoadStoreSpec([3]), gpu_spec([0]))
        (result,) = finish(worker, {2})
        assert not result.success
    finally:
        worker.shutdown()


@pytest.mark.parametrize(
    ("ids", "sizes", "error", "match"),
    [
        (np.array([1.7, 2.2]), None, TypeError, "integers"),  # cut to 1 and 2: another block's bytes
        (np.array([True, False]), None, TypeError, "integers"),
        (np.array([-1, 0]), None, ValueError, "must lie in"),  # ids[-1]: the last block, silently
        (np.array([0, 10**6]), None, ValueError, "must lie in"),
        (np.array([0, 2**63 + 5], dtype=np.uint64), None, ValueError, "must lie in"),  # wrapped negative
        (np.array([0, 1]), [-1], ValueError, "must not be negative"),  # vLLM checks only the sum
    ],
)
def test_block_ids_or_group_sizes_that_name_no_block_change_nothing(
    made: tuple[OffloadingSpec, OffloadingSpec, CanonicalKVCaches],
    ids: Any,
    sizes: list[int] | None,
    error: type[Exception],
    match: str,
) -> None:
    _, worker_side, caches = made
    worker = worker_side.get_worker(caches)
    try:
        spec = gpu_spec([0, 1])
        spec.block_ids = ids  # what a caller past vLLM's constructor can hand over
        if sizes is not None:
            spec.group_sizes = sizes
        with pytest.raises(error, match=match):
            worker.submit_store(1, spec, CPULoadStoreSpec([0, 1]))
        with pytest.raises(error, match=match):
            worker.submit_load(2, CPULoadStoreSpec([0, 1]), spec)
        assert worker.get_finished() == []  # nothing was queued
        assert worker.submit_store(3, gpu_spec([0, 1]), CPULoadStoreSpec([0, 1]))
        (result,) = finish(worker, {3})
        assert result.success
    finally:
        worker.shutdown()


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        ({"aiokvtier": {"fill_threads": 0}}, ValueError, "fill_threads"),
        ({"aiokvtier": {"numa_node": "near"}}, ValueError, "numa_node"),
        ({"aiokvtier": {"backing": "magic"}}, ValueError, "backing"),
        ({"aiokvtier": {"fill_thread": 2}}, ValueError, "fill_thread"),
        ({"aiokvtier": {"quota": "1GiB"}}, ValueError, r"\['quota'\] is set by the spec"),
        ({"aiokvtier": {"slot_size": "2MiB"}}, ValueError, r"\['slot_size'\] is set by the spec"),
        ({"aiokvtier": "fill fast"}, ValueError, "must be a mapping"),
        ({"cpu_bytes": None}, ValueError, "cpu_bytes_to_use'\\] is required"),
        ({"cpu_bytes": "lots"}, ValueError, "cpu_bytes_to_use"),
        ({"cpu_bytes": PAGE}, ValueError, "holds no chunk"),
        ({"canonical_layout": True}, NotImplementedError, "canonical_layout"),
    ],
)
def test_a_bad_config_names_the_field(extra: dict[str, Any], error: type[Exception], match: str) -> None:
    kwargs = dict(extra)
    cpu_bytes = kwargs.pop("cpu_bytes", 64 * LAYERS * PAGE)
    config = offloading_config(cpu_bytes=cpu_bytes, **kwargs)
    if extra.get("canonical_layout"):
        config = OffloadingConfig(**{**config.__dict__, "canonical_layout": True})
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(error, match=match):
        OffloadingSpecFactory.create_spec(config)
    assert {t.ident for t in threading.enumerate()} == before


def test_a_tier_setting_refused_for_the_real_slot_size_fails_get_worker_cleanly() -> None:
    # 6 KiB pages make 8 KiB slots: a 12 KiB commit unit is no multiple of them.
    config = offloading_config(aiokvtier={"commit_unit": 12 * 1024})
    spec = OffloadingSpecFactory.create_spec(config)
    tensor = torch.zeros((GPU_BLOCKS, 6 * 1024), dtype=torch.int8)
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=tensor, page_size_bytes=6 * 1024)],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=6 * 1024)]],
    )
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ValueError, match="commit_unit"):
        spec.get_worker(caches)
    assert {t.ident for t in threading.enumerate()} == before


def test_pages_smaller_than_a_slot_round_trip() -> None:
    """A page that is not a multiple of 4 KiB takes a slot rounded up; only the page is copied."""
    page = 3000
    tensors = [torch.randint(-128, 128, (GPU_BLOCKS, page), dtype=torch.int8) for _ in range(2)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=page) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=page) for i in range(2)]],
    )
    config = offloading_config()
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    worker = OffloadingSpecFactory.create_spec(config).get_worker(caches)
    try:
        request = ReqContext(req_id="p")
        manager.on_new_request(request)
        chunk_keys = keys(0, 3)
        out = manager.prepare_store(chunk_keys, request)
        assert out is not None
        expected = [t[[7, 8, 9]].clone() for t in tensors]
        assert worker.submit_store(1, gpu_spec([7, 8, 9]), out.store_spec)
        assert finish(worker, {1})[0].success
        manager.complete_store(chunk_keys, request)
        assert worker.submit_load(2, manager.prepare_load(chunk_keys, request), gpu_spec([0, 1, 2]))
        assert finish(worker, {2})[0].success
        for t, want in zip(tensors, expected, strict=True):
            assert torch.equal(t[[0, 1, 2]], want)
    finally:
        worker.shutdown()


TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 2048,
    "torch_dtype": "float16",
}


def test_vllms_scheduler_and_connector_move_a_prefix_through_the_spec(tmp_path: Path) -> None:
    """vLLM's Scheduler and OffloadingConnector (both roles) with the spec, one engine step at a time.

    The config comes from vLLM's own ``build_offloading_config`` (a model config
    read from a local ``config.json``, no weights), the worker's KV caches from
    the connector's ``register_kv_caches`` over per-layer CPU tensors. Request A
    fills four blocks; once its stores are reported, the GPU prefix cache is
    reset and the KV tensors zeroed; request B with the same prompt must get
    A's blocks back from the tier, bit for bit, into other GPU blocks.
    """
    from vllm import SamplingParams
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.forward_context import ForwardContext
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    (tmp_path / "config.json").write_text(json.dumps(TINY_MODEL))
    model = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="float16", max_model_len=2048)
    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "AiokvtierOffloadingSpec",
            "spec_module_path": "aiokvtier.integrations.vllm",
            "cpu_bytes_to_use": 1 << 24,
        },
    )
    config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        model_config=model,
        cache_config=CacheConfig(block_size=16),
        kv_transfer_config=transfer,
    )
    blocks = 32
    config.cache_config.num_gpu_blocks = blocks
    config.scheduler_config.async_scheduling = False
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    attention = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    kv_config = KVCacheConfig(
        num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, attention)]
    )
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=16,
    )
    worker = OffloadingConnector(config, KVConnectorRole.WORKER, kv_config)
    caches = {
        name: torch.randint(-1000, 1000, (blocks, 2, 16, 2, 64), dtype=torch.int16).view(torch.float16)
        for name in layers
    }
    worker.register_kv_caches(caches)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})

    def step() -> None:
        scheduled = scheduler.schedule()
        metadata = scheduled.kv_connector_metadata
        worker.handle_preemptions(metadata)
        worker.bind_connector_metadata(metadata)
        worker.start_load_kv(context)
        worker.wait_for_save()
        sending, receiving = worker.get_finished(scheduled.finished_req_ids)
        worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        ids = list(scheduled.num_scheduled_tokens)
        output = KVConnectorOutput(
            finished_sending=sending, finished_recving=receiving, kv_connector_worker_meta=worker_meta
        )
        scheduler.update_from_output(
            scheduled,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[0] for _ in ids],
                kv_connector_output=output,
            ),
        )

    def run(request_id: str, prompt: list[int]) -> list[int]:
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        scheduler.add_request(
            Request(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling_params=params,
                pooling_params=None,
                block_hasher=hasher,
            )
        )
        held: list[int] = []
        for _ in range(500):
            step()
            if not held and request_id in scheduler.requests:
                held = list(scheduler.kv_cache_manager.get_block_ids(request_id)[0])
            if not scheduler.requests:
                return held
            time.sleep(0.002)
        raise AssertionError(f"request {request_id} did not finish")

    try:
        prompt = list(range(1, 65))  # four blocks of 16 tokens
        first = run("A", prompt)
        assert len(first) == 4
        written = {name: caches[name][first].clone() for name in layers}
        for _ in range(50):  # the stores land and are reported in later steps
            step()
            time.sleep(0.002)
        spec_worker = worker.connector_worker.worker
        assert isinstance(spec_worker, AiokvtierOffloadingWorker)
        assert spec_worker.tier.statistics().slots_allocated == 4 * spec_worker.slots_per_chunk
        assert scheduler.reset_prefix_cache()
        for tensor in caches.values():
            tensor.zero_()
        second = run("B", prompt)
        assert len(second) == 4 and not set(second) & set(first)
        for name in layers:
            assert torch.equal(caches[name][second].view(torch.int16), written[name].view(torch.int16))
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_chunk_ids_far_from_the_first_are_stored_and_loaded() -> None:
    """The worker's chunk map grows with the chunk ids it meets (the manager hands them out lowest first)."""
    config = offloading_config(cpu_bytes=4096 * LAYERS * PAGE)
    caches = kv_caches(seed=5)
    worker = OffloadingSpecFactory.create_spec(config).get_worker(caches)
    try:
        expected = rows(caches, [10, 11])
        assert worker.submit_store(1, gpu_spec([10, 11]), CPULoadStoreSpec([3000, 4095]))
        assert finish(worker, {1})[0].success
        assert worker.submit_load(2, CPULoadStoreSpec([4095, 3000]), gpu_spec([21, 20]))
        assert finish(worker, {2})[0].success
        for got, want in zip(rows(caches, [20, 21]), expected, strict=True):
            assert torch.equal(got, want)
        assert worker.submit_load(3, CPULoadStoreSpec([2000]), gpu_spec([0]))  # never stored
        assert not finish(worker, {3})[0].success
    finally:
        worker.shutdown()
