"""aiokvtier.integrations.vllm's pool mode: replicas of vLLM over one machine-wide pool (skipped without vLLM).

A real pool owner runs in its own process (tests/pool_owner.py, 64 KiB slots); the specs are made by
vLLM's ``OffloadingSpecFactory`` and driven with the offloading connector's call pattern, with CPU
tensors standing in for the GPU's KV caches. A second replica runs in a process of its own
(tests/vllm_pool_replica.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not installed")

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingManager,
    OffloadingWorker,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from aiokvtier import AttachedPool, PoolError
from aiokvtier.integrations._vllm_pool import (
    SEAL,
    PoolLoadStoreSpec,
    PoolOffloadingManager,
    PoolOffloadingWorker,
    block_key,
    namespace,
)
from aiokvtier.integrations.vllm import AiokvtierOffloadingConnector, AiokvtierOffloadingSpec

from .vllm_pool_replica import GPU_BLOCKS, LAYERS, PAGE, digests, finish, gpu_spec, keys, kv_caches, pool_config

ROOT = Path(__file__).resolve().parent.parent


def start_owner(path: str, quota: str, slot_size: str = "64KiB") -> subprocess.Popen[str]:
    owner = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "pool_owner.py"), "asyncio", path, quota, slot_size],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdout is not None
    assert json.loads(owner.stdout.readline())["event"] == "serving"
    return owner


def stop_owner(owner: subprocess.Popen[str]) -> None:
    assert owner.stdin is not None
    owner.stdin.close()
    assert owner.wait(timeout=30) == 0


@pytest.fixture
def pool_path(tmp_path: Path) -> Iterator[str]:
    """A pool owner process (64 KiB slots, 64 MiB)."""
    path = str(tmp_path / "pool.sock")
    owner = start_owner(path, "64MiB")
    try:
        yield path
    finally:
        stop_owner(owner)


def in_pool(path: str, call: Callable[[AttachedPool], Any]) -> Any:
    """``await call(pool)`` in a process of its own kind: a fresh attachment on a loop of this thread."""

    async def run() -> Any:
        async with AttachedPool(path) as pool:
            return await call(pool)

    return asyncio.run(run())


def statistics(path: str) -> Any:
    return in_pool(path, lambda pool: pool.statistics())


class Replica:
    """One engine's two halves over the pool, as vLLM makes them (the scheduler's and one worker's)."""

    def __init__(self, path: str, *, seed: int, rank: int = 0, world_size: int = 1, dp: int = 0, **kw: Any) -> None:
        config = pool_config(path, rank=rank, world_size=world_size, dp=dp, **kw)
        self.manager = OffloadingSpecFactory.create_spec(config).get_manager()
        self.caches = kv_caches(seed, page=kw.get("page", PAGE))
        self.worker = OffloadingSpecFactory.create_spec(config).get_worker(self.caches)
        self.bpc = int(kw.get("blocks_per_chunk", 1))
        self.request = ReqContext(req_id=f"r{seed}")
        self.manager.on_new_request(self.request)
        self._jobs = 0

    def step(self) -> None:
        """The end of a scheduler step: lookups queued in it are read."""
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def lookup(self, chunks: list[Any]) -> list[LookupResult]:
        """Each chunk's answer, as vLLM gets it: steps go by (answers hold a step), a lookup whose answers
        include RETRY is asked again at the next step."""
        self.step()
        self.step()
        for _ in range(2):
            with self.manager.lock:
                answers = [self.manager.lookup(k, self.request) for k in chunks]
            self.step()
            if LookupResult.RETRY not in answers:
                break
        return answers

    def store(self, chunks: list[Any], blocks: list[int]) -> list[Any]:
        """Stores what ``prepare_store`` asks for: the GPU blocks of those of ``chunks`` the pool lacks."""
        with self.manager.lock:
            out = self.manager.prepare_store(chunks, self.request)
        todo = set(out.keys_to_store)
        bpc = self.bpc
        blocks = [b for i, k in enumerate(chunks) if k in todo for b in blocks[i * bpc : (i + 1) * bpc]]
        self._jobs += 1
        assert self.worker.submit_store(self._jobs, gpu_spec(blocks), out.store_spec)
        (result,) = finish(self.worker, {self._jobs})
        assert result.success
        with self.manager.lock:
            self.manager.complete_store(out.keys_to_store, self.request)
        stored: list[Any] = out.keys_to_store
        return stored

    def load(self, chunks: list[Any], blocks: list[int], first_block: int = 0) -> Any:
        with self.manager.lock:
            spec = self.manager.prepare_load(chunks, self.request)
        self._jobs += 1
        assert self.worker.submit_load(self._jobs, spec, gpu_spec(blocks, first_block))
        (result,) = finish(self.worker, {self._jobs})
        with self.manager.lock:
            self.manager.complete_load(chunks, self.request)
        return result

    def close(self) -> None:
        self.worker.shutdown()
        self.manager.shutdown()


@pytest.fixture
def replicas(pool_path: str) -> Iterator[Callable[..., Replica]]:
    made: list[Replica] = []

    def make(**kw: Any) -> Replica:
        made.append(Replica(pool_path, **kw))
        return made[-1]

    try:
        yield make
    finally:
        for replica in made:
            replica.close()


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# -- the halves ------------------------------------------------------------------------------


def test_the_pool_halves_are_vllms_classes_and_the_scheduler_reserves_nothing(pool_path: str) -> None:
    config = pool_config(pool_path)
    spec = OffloadingSpecFactory.create_spec(config)
    assert type(spec) is AiokvtierOffloadingSpec and spec.pool_settings == {"pool": pool_path, "namespace": ""}
    assert "cpu_bytes_to_use" not in config.extra_config  # the pool's owner sets the quota
    assert type(spec).build_metric_definitions(dict(config.extra_config)) == {}
    assert type(spec).config_info_keys(dict(config.extra_config)) == ()
    before = {t.name for t in threading.enumerate()}
    manager = spec.get_manager()
    try:
        assert isinstance(manager, PoolOffloadingManager) and isinstance(manager, OffloadingManager)
        assert spec.get_manager() is manager
        # Its loop thread, and the attached pool's copy thread.
        assert {t.name for t in threading.enumerate()} - before == {"aiokvtier-vllm-scheduler", "aiokvtier-attached"}
        assert manager.get_stats() is None and manager.config_info() == [{}]
        stats = statistics(pool_path)
        assert stats.clients == 2 and stats.slots_attached == 0 and stats.blocks == 0
    finally:
        manager.shutdown()
        manager.shutdown()  # idempotent
    assert {t.name for t in threading.enumerate()} <= before
    worker = OffloadingSpecFactory.create_spec(config).get_worker(kv_caches(0))
    try:
        assert isinstance(worker, PoolOffloadingWorker) and isinstance(worker, OffloadingWorker)
        assert {"aiokvtier-vllm", "aiokvtier-attached"} <= {t.name for t in threading.enumerate()}
    finally:
        worker.shutdown()
    assert {t.name for t in threading.enumerate()} <= before
    assert statistics(pool_path).clients == 1  # both detached: only the reader of these figures


def test_the_halves_attach_and_a_store_lands_before_the_pools_fill_ends(tmp_path: Path) -> None:
    path = str(tmp_path / "pool.sock")
    owner = subprocess.Popen(
        [sys.executable, "-m", "aiokvtier", "pool", "--socket", path, "--quota", "1GiB", "--max-quota", "1GiB",
         "--fill-threads", "1"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert owner.stdout is not None
        assert json.loads(owner.stdout.readline())["event"] == "serving"
        a = Replica(path, seed=8)
        try:
            a.store(keys([1, 2]), [0, 1])
            assert a.lookup(keys([1, 2])) == [LookupResult.HIT] * 2
            tier = statistics(path).tier
            assert tier.resident_bytes < tier.quota  # the fill goes on behind the first store
        finally:
            a.close()
    finally:
        owner.terminate()
        assert owner.wait(timeout=30) == 0


def test_bad_pool_settings_are_refused_by_name(tmp_path: Path) -> None:
    path = str(tmp_path / "pool.sock")
    cases = [
        ({"aiokvtier": {"pool": path, "quota": "1GiB"}}, "cannot go with 'pool'"),
        ({"aiokvtier": {"pool": ""}}, "must be the pool's socket path"),
        ({"aiokvtier": {"pool": path, "namespace": 3}}, "must be a string"),
        ({"eviction_policy": "arc"}, "eviction_policy'] is not supported with a pool"),
        ({"store_threshold": 2}, "store_threshold'] is not supported with a pool"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            OffloadingSpecFactory.create_spec(pool_config(path, **extra))
    spec = OffloadingSpecFactory.create_spec(pool_config(path))  # checks, attaches nothing
    with pytest.raises(PoolError, match="no pool"):
        spec.get_manager()
    with pytest.raises(PoolError, match="no pool"):
        spec.get_worker(kv_caches(0))
    assert not [t for t in threading.enumerate() if t.name.startswith("aiokvtier-vllm")]


def test_kv_caches_neither_in_host_memory_nor_on_a_cuda_device_are_refused(pool_path: str) -> None:
    caches = kv_caches(0)
    caches.tensors[0].tensor = torch.empty((GPU_BLOCKS, PAGE), dtype=torch.int8, device="meta")
    with pytest.raises(ValueError, match="lie on several devices: cpu, meta"):
        OffloadingSpecFactory.create_spec(pool_config(pool_path)).get_worker(caches)
    for entry in caches.tensors:
        entry.tensor = torch.empty((GPU_BLOCKS, PAGE), dtype=torch.int8, device="meta")
    with pytest.raises(ValueError, match="the pool copies host memory or CUDA memory"):
        OffloadingSpecFactory.create_spec(pool_config(pool_path)).get_worker(caches)
    assert statistics(pool_path).clients == 1
    assert not [t for t in threading.enumerate() if t.name.startswith("aiokvtier-vllm")]


def test_lookups_read_the_pool_once_for_a_requests_first_chunk_and_once_for_the_rest(
    pool_path: str, replicas: Callable[..., Replica]
) -> None:
    a = replicas(seed=6)
    chunks = keys(list(range(12)))
    a.store(chunks[:8], list(range(8)))
    assert a.lookup(chunks[:1]) == [LookupResult.HIT]  # the chunks' block count is learned (once)
    a.step()
    a.step()
    manager = a.manager
    time.sleep(0.2)  # the counts of reads of the mirror reach the owner within 50 ms
    queries = statistics(pool_path).queries
    cold, warm = ReqContext(req_id="cold"), ReqContext(req_id="warm")
    with manager.lock:
        # A prompt the pool does not hold misses at its first chunk, answered at once.
        assert manager.lookup(keys([99])[0], cold) is LookupResult.MISS
        # One it holds: the first chunk is read at once, the others wait for the step's end.
        answers = [manager.lookup(k, warm) for k in chunks]
        assert answers == [LookupResult.HIT] + [LookupResult.RETRY] * 11
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        # The next step answers from that read: the first eight, then misses.
        answers = [manager.lookup(k, warm) for k in chunks]
        assert answers == [LookupResult.HIT] * 8 + [LookupResult.MISS] * 4
    # Three reads in all: the first chunk of each request, and the rest of one.
    time.sleep(0.2)
    assert statistics(pool_path).queries - queries == 3


def test_a_job_that_does_not_match_the_caches_is_refused_on_the_callers_thread(
    pool_path: str, replicas: Callable[..., Replica]
) -> None:
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    a = replicas(seed=7)
    chunk = PoolLoadStoreSpec(keys([1]))
    with pytest.raises(ValueError, match=r"GPU block ids must lie in \[0, 64\)"):
        a.worker.submit_store(1, gpu_spec([GPU_BLOCKS]), chunk)
    with pytest.raises(ValueError, match="do not match"):
        a.worker.submit_load(2, chunk, gpu_spec([0, 1]))
    with pytest.raises(TypeError, match="PoolLoadStoreSpec"):
        a.worker.submit_load(3, CPULoadStoreSpec([0]), gpu_spec([0]))
    assert a.worker.get_finished() == []
    stats = statistics(pool_path)
    assert stats.stores == 0 and stats.loads == 0 and stats.claims == 0


# -- sharing -----------------------------------------------------------------------------------


def run_replica(path: str, **order: Any) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "vllm_pool_replica.py"), path, json.dumps(order)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def test_a_chunk_one_replica_stored_is_a_hit_and_a_bit_exact_load_in_another_process(
    pool_path: str, replicas: Callable[..., Replica]
) -> None:
    a = replicas(seed=1, dp=0)
    chunks = keys(list(range(8)))
    stored_blocks = [5, 9, 2, 40, 17, 33, 8, 1]
    assert a.lookup(chunks) == [LookupResult.MISS] * 8
    assert a.store(chunks, stored_blocks) == chunks
    assert a.lookup(chunks) == [LookupResult.HIT] * 8
    # Replica B, DP index 1, its own process and KV caches: every chunk is a hit, and loads bit-exact.
    targets = [60, 61, 3, 4, 50, 51, 52, 12]
    got = run_replica(pool_path, op="load", dp=1, seed=2, keys=list(range(8)), blocks=targets)
    assert got["found"] == [True] * 8 and got["success"]
    assert got["digests"] == digests(a.caches, stored_blocks)
    # And back: B stores chunks A never saw; A finds them and loads B's bytes.
    b_blocks = [10, 11, 12]
    got = run_replica(pool_path, op="store", dp=1, seed=3, keys=[100, 101, 102], blocks=b_blocks)
    assert got["found"] == [False] * 3 and got["success"]
    more = keys([100, 101, 102])
    assert a.lookup(more) == [LookupResult.HIT] * 3
    assert a.load(more, [20, 21, 22]).success
    assert digests(a.caches, [20, 21, 22]) == got["digests"]
    # A store of chunks the pool holds stores nothing again.
    with a.manager.lock:
        out = a.manager.prepare_store(chunks + more, a.request)
    assert out.keys_to_store == [] and out.evicted_keys == []
    stats = statistics(pool_path)
    # 11 chunks, each 2 pages and a seal; 8 + 3 loaded through other replicas, and the seals read once each.
    assert stats.blocks == 11 * (LAYERS + 1) and stats.claims == 0 and stats.blocks_pinned == 0


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_a_page_larger_than_a_slot_and_chunks_of_several_blocks_round_trip(
    replicas: Callable[..., Replica], blocks_per_chunk: int
) -> None:
    page = 96 * 1024  # two pieces of a 64 KiB slot, the second shorter
    a = replicas(seed=4, page=page, blocks_per_chunk=blocks_per_chunk)
    b = replicas(seed=5, page=page, blocks_per_chunk=blocks_per_chunk, dp=1)
    chunks = keys(list(range(8 // blocks_per_chunk)))
    stored_blocks = [7, 6, 5, 4, 3, 2, 1, 0]
    a.store(chunks, stored_blocks)
    assert b.lookup(chunks) == [LookupResult.HIT] * len(chunks)
    assert b.load(chunks, [30, 31, 32, 33, 34, 35, 36, 37]).success
    assert digests(b.caches, [30, 31, 32, 33, 34, 35, 36, 37]) == digests(a.caches, stored_blocks)
    if blocks_per_chunk == 2:
        # A load that starts mid-chunk (the second block of chunk 0).
        assert b.load(chunks[:2], [40, 41, 42], first_block=1).success
        assert digests(b.caches, [40, 41, 42]) == digests(a.caches, stored_blocks[1:4])
        # A store that covers a chunk in part leaves it out: its seal would claim blocks it has not.
        more = keys([50, 51])
        b.store(more, [1, 2, 3])  # the second chunk has one of its two blocks: not stored
        assert a.lookup(more) == [LookupResult.HIT, LookupResult.MISS]
        with b.manager.lock:
            spec = b.manager.prepare_store(keys([60, 61]), b.request)
        assert b.worker.submit_store(99, gpu_spec([1, 2, 3], first_block=1), spec.store_spec)
        assert finish(b.worker, {99})[0].success
        with b.manager.lock:
            b.manager.complete_store(spec.keys_to_store, b.request)
        assert a.lookup(keys([60, 61])) == [LookupResult.MISS, LookupResult.HIT]


def test_tensor_parallel_ranks_store_their_shards_under_their_own_keys(
    pool_path: str, replicas: Callable[..., Replica]
) -> None:
    rank0 = replicas(seed=10, rank=0, world_size=2)
    rank1 = replicas(seed=11, rank=1, world_size=2)
    chunks = keys([1, 2, 3])
    rank0.store(chunks, [0, 1, 2])
    # One rank's shard is not the chunk: the scheduler (of either process, they agree) waits for every rank.
    assert rank0.lookup(chunks) == [LookupResult.MISS] * 3
    rank1.store(chunks, [0, 1, 2])
    assert rank0.lookup(chunks) == rank1.lookup(chunks) == [LookupResult.HIT] * 3
    # A replica's ranks each load their own shard back: different bytes, each bit-exact.
    other0 = replicas(seed=12, rank=0, world_size=2, dp=1)
    other1 = replicas(seed=13, rank=1, world_size=2, dp=1)
    assert other0.load(chunks, [9, 8, 7]).success and other1.load(chunks, [9, 8, 7]).success
    assert digests(other0.caches, [9, 8, 7]) == digests(rank0.caches, [0, 1, 2])
    assert digests(other1.caches, [9, 8, 7]) == digests(rank1.caches, [0, 1, 2])
    assert digests(rank0.caches, [0, 1, 2]) != digests(rank1.caches, [0, 1, 2])
    assert statistics(pool_path).blocks == 3 * 2 * (LAYERS + 1)
    # An engine with one rank does not see the two-rank engine's chunks (another namespace).
    single = replicas(seed=14)
    assert single.lookup(chunks) == [LookupResult.MISS] * 3


# -- failures ------------------------------------------------------------------------------------


def test_a_chunk_evicted_before_its_load_is_a_load_error_never_wrong_bytes(
    pool_path: str, replicas: Callable[..., Replica]
) -> None:
    a = replicas(seed=20)
    b = replicas(seed=21, dp=1)
    chunks = keys(list(range(6)))
    a.store(chunks, [0, 1, 2, 3, 4, 5])
    assert b.lookup(chunks) == [LookupResult.HIT] * 6  # the scheduler saw them all
    # Then another process drops chunk 3's second page (as an eviction would) before B's worker loads.
    b.worker.report_load_errors = False
    assert in_pool(pool_path, lambda pool: pool.discard([key_of(chunks[3], 1)])) == 1
    for entry in b.caches.tensors:
        entry.tensor[40:46] = 7
    result = b.load(chunks, [40, 41, 42, 43, 44, 45])
    assert not result.success  # vLLM's stock connector: a failed job
    assert b.worker.take_load_errors() == {43, 44, 45}
    assert b.worker.take_load_errors() == set()
    # The chunks before the missing one loaded bit-exact; the blocks reported were not written.
    assert digests(b.caches, [40, 41, 42]) == digests(a.caches, [0, 1, 2])
    assert all(bool((entry.tensor[43:46] == 7).all()) for entry in b.caches.tensors)
    # With AiokvtierOffloadingConnector's setting the job finishes and the blocks are vLLM's load errors.
    b.worker.report_load_errors = True
    result = b.load(chunks[3:], [50, 51, 52])
    assert result.success and result.transfer_size is None
    assert b.worker.take_load_errors() == {50, 51, 52}
    # The scheduler sees it now: the prefix ends at chunk 3 (later chunks answer as misses too, since
    # vLLM takes a prefix), and a store puts chunk 3 back (the pool copies none of the others again).
    assert b.lookup(chunks) == [LookupResult.HIT] * 3 + [LookupResult.MISS] * 3
    assert b.store(chunks, [0, 1, 2, 3, 4, 5]) == chunks[3:]
    assert b.lookup(chunks) == [LookupResult.HIT] * 6
    assert statistics(pool_path).present >= 2 * (LAYERS + 1)  # chunks 4 and 5 were there: not copied
    stats = statistics(pool_path)
    assert stats.claims == 0 and stats.blocks_pinned == 0


def key_of(chunk: bytes, block: int, rank: int = 0) -> bytes:
    """The pool key of block ``block`` of ``chunk`` for ``rank`` (the namespace of these tests' engines)."""
    return block_key(namespace(pool_config("unused"), ""), chunk, rank, block)


def test_the_connector_reports_the_workers_load_errors(replicas: Callable[..., Replica]) -> None:
    assert issubclass(AiokvtierOffloadingConnector, OffloadingConnector)
    a = replicas(seed=30)
    connector = object.__new__(AiokvtierOffloadingConnector)  # vLLM builds it from a whole VllmConfig
    connector.connector_worker = SimpleNamespace(worker=a.worker)
    assert connector.get_block_ids_with_load_errors() == set()
    a.worker.report_load_errors = True
    assert a.load(keys([77]), [5]).success  # never stored
    assert connector.get_block_ids_with_load_errors() == {5}
    assert connector.get_block_ids_with_load_errors() == set()
    connector.connector_worker = SimpleNamespace(worker=object())  # a private tier: vLLM's own behaviour
    assert connector.get_block_ids_with_load_errors() == set()


def test_the_pools_events_are_vllms_offloading_events(pool_path: str, replicas: Callable[..., Replica]) -> None:
    a = replicas(seed=40)
    b = replicas(seed=41, dp=1)
    chunks = keys([1, 2])
    a.store(chunks, [0, 1])
    seen: list[Any] = []

    def stored_seen() -> bool:
        seen.extend(b.manager.take_events())
        return any(not e.removed and set(e.keys) == set(chunks) for e in seen)

    wait_for(stored_seen)  # B hears of A's store
    assert in_pool(pool_path, lambda pool: pool.discard([key_of(chunks[0], SEAL)])) == 1
    wait_for(lambda: any(e.removed and chunks[0] in e.keys for e in [*seen, *b.manager.take_events()]))


def test_shutdown_mid_transfer_leaves_nothing_claimed_or_pinned(pool_path: str) -> None:
    a = Replica(pool_path, seed=50)
    chunks = keys(list(range(32)))
    try:
        a.store(chunks[:16], list(range(16)))
        with a.manager.lock:
            stores = a.manager.prepare_store(chunks[16:], a.request)
            loads = a.manager.prepare_load(chunks[:16], a.request)
        for job in range(16):
            a.worker.submit_store(100 + job, gpu_spec([16 + job]), PoolLoadStoreSpec([stores.store_spec.keys[job]]))
            a.worker.submit_load(200 + job, PoolLoadStoreSpec([loads.keys[job]]), gpu_spec([32 + job]))
    finally:
        a.close()
    results = a.worker.get_finished()
    assert {r.job_id for r in results} == {*range(100, 116), *range(200, 216)}
    assert not a.worker.submit_load(300, loads, gpu_spec(list(range(16))))  # shut down: refused
    stats = statistics(pool_path)
    assert stats.clients == 1 and stats.claims == 0 and stats.blocks_pinned == 0 and stats.slots_attached == 0
    # Every chunk is whole or absent: a store cut short is never visible in part.
    assert stats.blocks % (LAYERS + 1) == 0


def test_a_lost_pool_makes_misses_and_failed_loads_until_it_is_back(tmp_path: Path) -> None:
    path = str(tmp_path / "pool.sock")
    owner = start_owner(path, "16MiB")
    a = Replica(path, seed=60)
    try:
        chunks = keys([1, 2])
        a.store(chunks, [0, 1])
        stop_owner(owner)
        wait_for(lambda: a.lookup(chunks) == [LookupResult.MISS] * 2)
        a.worker.report_load_errors = True
        assert a.load(chunks, [5, 6]).success and a.worker.take_load_errors() == {5, 6}
        owner = start_owner(path, "16MiB")  # a restarted owner starts empty
        wait_for(lambda: a.store(chunks, [0, 1]) == chunks and a.lookup(chunks) == [LookupResult.HIT] * 2)
        assert a.load(chunks, [5, 6]).success and a.worker.take_load_errors() == set()
        assert digests(a.caches, [5, 6]) == digests(a.caches, [0, 1])
    finally:
        a.close()
        stop_owner(owner)


# -- vLLM's scheduler and connector ---------------------------------------------------------------


class Engine:
    """vLLM's Scheduler and ``AiokvtierOffloadingConnector`` (worker role) over the pool, stepped as vLLM's
    engine core steps them (as ``test_vllms_scheduler_and_connector_move_a_prefix_through_the_spec``), with
    per-layer CPU tensors of its own for the KV cache."""

    LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
    BLOCKS = 32

    def __init__(self, model_dir: Path, pool: str, seed: int) -> None:
        from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.forward_context import ForwardContext
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float16", max_model_len=2048)
        transfer = KVTransferConfig(
            kv_connector="AiokvtierOffloadingConnector",
            kv_connector_module_path="aiokvtier.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "spec_name": "AiokvtierOffloadingSpec",
                "spec_module_path": "aiokvtier.integrations.vllm",
                "aiokvtier": {"pool": pool},
            },
        )
        config = VllmConfig(
            device_config=DeviceConfig(device="cpu"),
            model_config=model,
            cache_config=CacheConfig(block_size=16),
            kv_transfer_config=transfer,
        )
        config.cache_config.num_gpu_blocks = self.BLOCKS
        config.scheduler_config.async_scheduling = False
        attention = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
        kv_config = KVCacheConfig(
            num_blocks=self.BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(self.LAYERS), attention)],
        )
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(config),
            block_size=16,
        )
        self.worker = AiokvtierOffloadingConnector(config, KVConnectorRole.WORKER, kv_config)
        generator = torch.Generator().manual_seed(seed)
        self.caches = {
            name: torch.randint(-1000, 1000, (self.BLOCKS, 2, 16, 2, 64), dtype=torch.int16, generator=generator).view(
                torch.float16
            )
            for name in self.LAYERS
        }
        self.worker.register_kv_caches(self.caches)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(16, sha256)
        self.context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self.invalid: set[int] = set()
        self.before_load: Callable[[Any], None] = lambda metadata: None

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        scheduled = self.scheduler.schedule()
        metadata = scheduled.kv_connector_metadata
        worker = self.worker
        worker.handle_preemptions(metadata)
        worker.bind_connector_metadata(metadata)
        self.before_load(metadata)
        worker.start_load_kv(self.context)
        worker.wait_for_save()
        sending, receiving = worker.get_finished(scheduled.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors()  # after get_finished, as vLLM's model runner asks
        self.invalid |= invalid
        output = KVConnectorOutput(
            finished_sending=sending,
            finished_recving=receiving,
            invalid_block_ids=invalid,
            kv_connector_worker_meta=worker.build_connector_worker_meta(),
        )
        worker.clear_connector_metadata()
        ids = list(scheduled.num_scheduled_tokens)
        self.scheduler.update_from_output(
            scheduled,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[0] for _ in ids],
                kv_connector_output=output,
            ),
        )

    def request(self, request_id: str, prompt: list[int]) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=3, ignore_eos=True)
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            block_hasher=self.hasher,
        )

    def run(self, request: Any) -> list[int]:
        """Runs the request to its end; the GPU blocks it held."""
        self.scheduler.add_request(request)
        held: list[int] = []
        for _ in range(500):
            self.step()
            if not held and request.request_id in self.scheduler.requests:
                held = list(self.scheduler.kv_cache_manager.get_block_ids(request.request_id)[0])
            if not self.scheduler.requests:
                return held
            time.sleep(0.002)
        raise AssertionError(f"request {request.request_id} did not finish")

    def settle(self) -> None:
        for _ in range(50):  # stores land and are reported in later steps
            self.step()
            time.sleep(0.002)

    def rows(self, blocks: list[int]) -> dict[str, torch.Tensor]:
        return {name: self.caches[name][blocks].view(torch.int16).clone() for name in self.LAYERS}

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


def test_two_vllm_engines_share_a_prefix_through_the_pool_and_recompute_what_was_evicted(
    tmp_path: Path, pool_path: str
) -> None:
    from vllm.v1.kv_offload.base import make_offload_key

    from tests.test_integration_vllm import TINY_MODEL

    (tmp_path / "config.json").write_text(json.dumps(TINY_MODEL))
    a = Engine(tmp_path, pool_path, seed=1)
    b = Engine(tmp_path, pool_path, seed=2)
    try:
        prompt = list(range(1, 65))  # four blocks of 16 tokens
        first = a.run(a.request("A", prompt))
        assert len(first) == 4
        written = a.rows(first)
        a.settle()
        assert statistics(pool_path).blocks == 4 * (LAYERS + 1)
        # Engine B, its own scheduler, worker and KV caches: the prefix comes from the pool, bit for bit.
        second = b.run(b.request("B", prompt))
        assert len(second) == 4 and b.invalid == set()
        for name, rows in b.rows(second).items():
            assert torch.equal(rows, written[name])

        # Another prompt of four blocks, stored by A; B's scheduler finds all four, and another process
        # drops the third's pages between B's lookup and B's worker's load.
        other = list(range(100, 164))
        stored = a.rows(a.run(a.request("A2", other)))
        a.settle()
        request = b.request("B2", other)
        chunks = [make_offload_key(bytes(h), 0) for h in request.block_hashes[:4]]
        spec_worker = b.worker.connector_worker.worker
        assert isinstance(spec_worker, PoolOffloadingWorker) and spec_worker.report_load_errors
        victim = block_key(spec_worker.namespace, chunks[2], 0, 0)
        dropped: list[int] = []

        def evict(metadata: Any) -> None:
            if not dropped and metadata.load_jobs:
                dropped.append(in_pool(pool_path, lambda pool: pool.discard([victim])))

        b.before_load = evict
        held = b.run(request)
        assert dropped == [1]
        # The worker named the GPU blocks of the third and fourth chunks as load errors, and vLLM
        # recomputed them (the request ran to its end under kv_load_failure_policy="recompute").
        assert b.invalid == set(held[2:4])
        for name, rows in b.rows(held[:2]).items():  # the chunks before it loaded, bit for bit
            assert torch.equal(rows, stored[name][:2])
        stats = statistics(pool_path)
        assert stats.claims == 0 and stats.blocks_pinned == 0
    finally:
        a.close()
        b.close()


def test_a_seal_that_claims_more_blocks_than_the_pool_holds_is_a_miss(
    pool_path: str, replicas: Callable[..., Replica]
) -> None:
    """A seal says how many blocks a rank stored of a chunk; one that says more than the pool has slots (a
    stray write of the seal's key) was believed, and the scheduler built a key per claimed block (up to
    2**32 - 1 of them). Such a seal is ignored: the chunk is a miss, computed again."""
    from aiokvtier.integrations._pool_jobs import MAGIC, SEAL_BYTES

    a = replicas(seed=90)
    chunks = keys([1])
    a.store(chunks, [0])
    seal = key_of(chunks[0], SEAL)

    async def forge(pool: AttachedPool) -> None:
        assert await pool.discard([seal]) == 1
        assert not (await pool.store([seal], [SEAL_BYTES.pack(MAGIC, 2**32 - 1)])).skipped

    in_pool(pool_path, forge)
    b = replicas(seed=91, dp=1)  # has not learned the chunk's block counts
    assert b.lookup(chunks) == [LookupResult.MISS]
