"""Attacks on vLLM's pool mode (skipped without vLLM): hostile job specs, racing callers of the worker,
an owner killed under its jobs; after each, the owner's statistics show nothing claimed or pinned.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vllm is not installed")

from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingGroupConfig

from aiokvtier import AttachedPool, CudaError
from aiokvtier.integrations import _vllm_pool
from aiokvtier.integrations._pool_jobs import MAGIC, SEAL, SEAL_BYTES
from aiokvtier.integrations._vllm_pool import REATTACH_AFTER, PoolLoadStoreSpec, PoolOffloadingWorker

from .helpers import gil_thrashed
from .invariants import assert_no_library_threads
from .test_integration_vllm_pool import Replica, in_pool, key_of, start_owner, statistics, stop_owner, wait_for
from .vllm_pool_replica import GPU_BLOCKS, LAYERS, PAGE, digests, finish, gpu_spec, keys, kv_caches, pool_config

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def owned(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    path = str(tmp_path / "pool.sock")
    owner = start_owner(path, "64MiB")
    try:
        yield path, owner
    finally:
        if owner.poll() is None:
            stop_owner(owner)


def nothing_held(path: str, clients: int = 0) -> Any:
    stats = statistics(path)
    assert stats.claims == 0 and stats.blocks_pinned == 0, stats
    assert stats.clients == clients + 1, stats  # the statistics call's own attachment
    return stats


def two_group_worker(path: str) -> PoolOffloadingWorker:
    """A worker of two KV cache groups, one layer each."""
    config = pool_config(path)
    config = dataclasses.replace(
        config,
        groups=(
            OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),
            OffloadingGroupConfig(tokens_per_block=16, layer_names=("l1",), group_id=1),
        ),
    )
    base = kv_caches(3)
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=e.tensor, page_size_bytes=PAGE) for e in base.tensors],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE)] for i in range(2)],
    )
    return PoolOffloadingWorker(caches, config=config, settings={"pool": path, "namespace": ""})


# -- hostile specs -------------------------------------------------------------------------------


def refused_both_ways(
    worker: PoolOffloadingWorker, spec: GPULoadStoreSpec, error: type[Exception], match: str | None = None
) -> None:
    """A store and a load of two chunks with ``spec`` are refused on the caller's thread; no job ran."""
    chunks = PoolLoadStoreSpec(keys([1, 2]))
    with pytest.raises(error, match=match):
        worker.submit_store(1, spec, chunks)
    with pytest.raises(error, match=match):
        worker.submit_load(2, chunks, spec)
    assert worker.get_finished() == []


def test_a_negative_group_size_is_refused_not_read_from_the_ids_end(owned: tuple[str, Any]) -> None:
    """vLLM checks only that the group sizes add up: [-1, 4] with three ids passed, and the -1 made a
    negative offset, so the plan took the second group's first block from the ids' end (ids[-1])."""
    path, _ = owned
    worker = two_group_worker(path)
    try:
        chunks = PoolLoadStoreSpec(keys([1, 2, 3]))
        spec = GPULoadStoreSpec([5, 6, 7], group_sizes=[-1, 4], block_indices=[0, 0])
        with pytest.raises(ValueError, match="group sizes must not be negative"):
            worker.submit_store(1, spec, chunks)
        with pytest.raises(ValueError, match="group sizes must not be negative"):
            worker.submit_load(2, chunks, spec)
        assert worker.get_finished() == []
        stats = nothing_held(path, clients=1)
        assert stats.stores == 0 and stats.loads == 0
        # Sizes that match the groups still work.
        good = GPULoadStoreSpec([5, 6], group_sizes=[1, 1], block_indices=[0, 0])
        assert worker.submit_store(3, good, PoolLoadStoreSpec(keys([1, 2])))
        (result,) = finish(worker, {3})
        assert result.success
    finally:
        worker.shutdown()
    nothing_held(path)


@pytest.mark.parametrize(
    ("ids", "error"),
    [
        (np.array([1.7, 2.2]), TypeError),  # cut to 1 and 2: another block's bytes
        (np.array([True, False]), TypeError),
        (np.array([-1, 0]), ValueError),
        (np.array([0, GPU_BLOCKS]), ValueError),
        (np.array([0, 2**63 + 5], dtype=np.uint64), ValueError),  # past int64: it wrapped negative
        (np.array([0, 2**31 - 1], dtype=np.int32), ValueError),
    ],
)
def test_block_ids_of_a_wrong_type_or_range_change_nothing(
    owned: tuple[str, Any], ids: Any, error: type[Exception]
) -> None:
    path, _ = owned
    a = Replica(path, seed=11)
    try:
        spec = gpu_spec([0, 1])
        spec.block_ids = ids  # what a caller past vLLM's constructor can hand over
        refused_both_ways(a.worker, spec, error)
        stats = nothing_held(path, clients=2)
        assert stats.stores == 0 and stats.loads == 0
    finally:
        a.close()


@pytest.mark.parametrize(
    ("sizes", "firsts", "error", "match"),
    [
        ([True], [0], TypeError, "a group size is an integer, not a bool"),  # was taken for 1
        ([2], [0.5], TypeError, "a first block index is an integer, not float"),  # was cut to 0
        ([2], [True], TypeError, "a first block index is an integer, not a bool"),
        ([2], [-1], ValueError, "first block indices must not be negative"),  # was a chunk's last block
    ],
)
def test_group_sizes_and_first_indices_of_a_wrong_type_or_range_change_nothing(
    owned: tuple[str, Any], sizes: list[Any], firsts: list[Any], error: type[Exception], match: str
) -> None:
    path, _ = owned
    a = Replica(path, seed=12)
    try:
        spec = GPULoadStoreSpec([0, 1], group_sizes=[2], block_indices=[0])
        spec.group_sizes, spec.block_indices = sizes, firsts  # what a caller past vLLM's constructor can hand over
        refused_both_ways(a.worker, spec, error, match)
        stats = nothing_held(path, clients=2)
        assert stats.stores == 0 and stats.loads == 0
    finally:
        a.close()


def test_a_load_that_names_a_gpu_block_twice_is_refused_on_the_callers_thread(owned: tuple[str, Any]) -> None:
    """Two chunks' pages into one GPU block: the block would end with whichever landed last."""
    path, _ = owned
    a = Replica(path, seed=13)
    try:
        chunks = PoolLoadStoreSpec(keys([1, 2]))
        assert a.worker.submit_store(1, gpu_spec([3, 3]), chunks)  # a store may read one block twice
        (stored,) = finish(a.worker, {1})
        assert stored.success
        with pytest.raises(ValueError, match="job 2 loads two pages into GPU block 3"):
            a.worker.submit_load(2, chunks, gpu_spec([3, 3]))
        assert a.worker.get_finished() == []
        stats = nothing_held(path, clients=2)
        assert stats.loads == 0
    finally:
        a.close()


# -- racing callers --------------------------------------------------------------------------------


def test_get_finished_from_several_threads_gives_each_result_once(owned: tuple[str, Any]) -> None:
    """Four threads polling at once, the GIL traded between any two bytecodes: a check-then-pop could
    find the queue emptied by another thread (IndexError); each result comes out once, to one of them."""
    path, _ = owned
    a = Replica(path, seed=12)
    jobs = 400
    seen: list[TransferResult] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    lock = threading.Lock()

    def poll() -> None:
        try:
            while not stop.is_set():
                got = a.worker.get_finished()
                with lock:
                    seen.extend(got)
        except BaseException as exc:
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads trade the GIL between any two bytecodes
    pollers = [threading.Thread(target=poll) for _ in range(4)]
    try:
        for t in pollers:
            t.start()
        chunks = keys(list(range(jobs)))
        for job in range(jobs):
            assert a.worker.submit_load(job, PoolLoadStoreSpec([chunks[job]]), gpu_spec([job % GPU_BLOCKS]))
        wait_for(lambda: len(seen) >= jobs or bool(errors), timeout=60)
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        for t in pollers:
            t.join()
        a.close()
    assert errors == []
    assert sorted(r.job_id for r in seen) == list(range(jobs))
    nothing_held(path)


def test_a_job_id_reused_while_in_flight_is_refused_and_after_it_ended_is_taken(owned: tuple[str, Any]) -> None:
    path, _ = owned
    a = Replica(path, seed=13)
    try:
        chunks = keys([1, 2])
        with a.manager.lock:
            out = a.manager.prepare_store(chunks, a.request)
        worker = a.worker
        # A load job held in flight: its block is not there, and the store below names the same id.
        assert worker.submit_store(7, gpu_spec([0, 1]), out.store_spec)
        refused = 0
        try:
            worker.submit_store(7, gpu_spec([2, 3]), out.store_spec)
        except ValueError as exc:
            assert "already in flight" in str(exc)
            refused = 1
        (first, *rest) = finish(worker, {7})
        assert first.success and rest == [] and refused in (0, 1)
        if not refused:  # the first had ended already: the second ran under the same id
            (second,) = finish(worker, {7})
            assert second.success
        with a.manager.lock:
            a.manager.complete_store(out.keys_to_store, a.request)
        assert worker.submit_load(7, PoolLoadStoreSpec(chunks), gpu_spec([10, 11]))  # reused after it ended
        (loaded,) = finish(worker, {7})
        assert loaded.success and digests(a.caches, [10, 11]) == digests(a.caches, [0, 1])
    finally:
        a.close()
    nothing_held(path)


def test_jobs_after_shutdown_are_refused_and_leave_nothing(owned: tuple[str, Any]) -> None:
    path, _ = owned
    a = Replica(path, seed=14)
    chunks = keys([1, 2])
    a.close()
    a.close()  # idempotent
    assert not a.worker.submit_store(1, gpu_spec([0, 1]), PoolLoadStoreSpec(chunks))
    assert not a.worker.submit_load(2, PoolLoadStoreSpec(chunks), gpu_spec([0, 1]))
    a.worker.wait({1, 2})  # nothing to wait for
    assert a.worker.get_finished() == [] and a.worker.take_load_errors() == set()
    stats = nothing_held(path)
    assert stats.stores == 0 and stats.loads == 0
    assert_no_library_threads()


def test_wait_from_several_threads_while_jobs_end(owned: tuple[str, Any]) -> None:
    path, _ = owned
    a = Replica(path, seed=15)
    try:
        chunks = keys(list(range(32)))
        with a.manager.lock:
            out = a.manager.prepare_store(chunks, a.request)
        for job in range(32):
            assert a.worker.submit_store(job, gpu_spec([job]), PoolLoadStoreSpec([out.store_spec.keys[job]]))
        waiters = [threading.Thread(target=a.worker.wait, args=(set(range(i, 32, 4)),)) for i in range(4)]
        for t in waiters:
            t.start()
        for t in waiters:
            t.join(30)
            assert not t.is_alive()
        assert sorted(r.job_id for r in finish(a.worker, set(range(32)))) == list(range(32))
    finally:
        a.close()
    stats = nothing_held(path)
    assert stats.blocks == 32 * 3  # two layers' blocks and a seal per chunk


# -- the owner killed under the jobs ----------------------------------------------------------------


def test_an_owner_killed_mid_job_ends_every_job_and_the_next_owner_serves(tmp_path: Path) -> None:
    path = str(tmp_path / "pool.sock")
    owner = start_owner(path, "64MiB")
    a = Replica(path, seed=16)
    try:
        chunks = keys(list(range(48)))
        a.store(chunks[:16], list(range(16)))
        with a.manager.lock:
            out = a.manager.prepare_store(chunks[16:], a.request)
        a.worker.report_load_errors = True
        for job in range(32):
            a.worker.submit_store(100 + job, gpu_spec([16 + job]), PoolLoadStoreSpec([out.store_spec.keys[job]]))
            a.worker.submit_load(200 + job, PoolLoadStoreSpec([chunks[job % 16]]), gpu_spec([48 + job % 16]))
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(30)
        ids = {*range(100, 132), *range(200, 232)}
        results = finish(a.worker, ids, timeout=60)
        assert {r.job_id for r in results} == ids
        loads = {r.job_id: r for r in results if r.job_id >= 200}
        errors = a.worker.take_load_errors()
        assert errors <= set(range(48, 64))
        for blocks in range(48, 64):  # a block is loaded whole (its bytes) or named a load error
            if blocks not in errors:
                assert digests(a.caches, [blocks]) == digests(a.caches, [blocks - 48])
        assert all(r.success for r in loads.values())  # failures reported as load errors, not failed jobs
        with a.manager.lock:
            a.manager.complete_store(out.keys_to_store, a.request)
        owner = start_owner(path, "64MiB")  # a new owner starts empty; the replica attaches again
        wait_for(lambda: [a.store(chunks[:2], [0, 1]), a.lookup(chunks[:2])][1] == [LookupResult.HIT] * 2, timeout=30)
        nothing_held(path, clients=2)
    finally:
        a.close()
        if owner.poll() is None:
            stop_owner(owner)
    assert_no_library_threads()


def test_a_pool_back_with_another_slot_size_is_not_used_by_an_engine_that_cut_its_pages_for_the_old(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker cuts each page into pieces of the slot size it first attached with, and the keys name the
    pieces. An owner restarted with larger slots was taken back as it came: the old engine stored its
    pages cut in 64 KiB pieces under the same keys a new engine cuts in 128 KiB ones (the namespace is the
    same), and the new engine's lookups hit them and its load succeeded, with no load error, copying the
    pieces into the wrong places of its KV blocks."""
    path = str(tmp_path / "pool.sock")
    page = 96 << 10  # two pieces of 64 KiB slots, one of 128 KiB ones
    owner = start_owner(path, "16MiB")
    old = Replica(path, seed=71, page=page)
    new = None
    try:
        chunks = keys([1, 2])
        stop_owner(owner)
        owner = start_owner(path, "16MiB", "128KiB")
        deadline = time.monotonic() + 3 * REATTACH_AFTER
        while time.monotonic() < deadline:  # past a reattach or two: the old engine's stores go nowhere
            old.store(chunks, [0, 1])
            time.sleep(0.05)
        assert statistics(path).blocks == 0
        said = [r for r in caplog.records if "is back with 131072-byte slots, not 65536: given up" in r.getMessage()]
        assert 1 <= len(said) <= 2  # once by each half of the old engine, not at every attempt
        new = Replica(path, seed=72, page=page)
        assert new.store(chunks, [0, 1]) == chunks
        old.worker.report_load_errors = True
        before = digests(old.caches, [5, 6])
        result = old.load(chunks, [5, 6])
        assert result.success and old.worker.take_load_errors() == {5, 6}  # recomputed, never cut wrong
        assert digests(old.caches, [5, 6]) == before
        assert new.load(chunks, [5, 6]).success and digests(new.caches, [5, 6]) == digests(new.caches, [0, 1])
        nothing_held(path, clients=2)  # the new engine's halves: the old engine's scheduler does not use it either
    finally:
        old.close()
        if new is not None:
            new.close()
        stop_owner(owner)
    assert_no_library_threads()


def before_attach(monkeypatch: pytest.MonkeyPatch, before: Callable[[str], None]) -> None:
    """``AttachedPool.attach`` calls ``before(path)`` first (which may raise), then attaches."""
    real = AttachedPool.attach.__func__  # type: ignore[attr-defined]

    async def attach(cls: type[AttachedPool], path: str, **kw: Any) -> AttachedPool:
        before(path)
        pool: AttachedPool = await real(cls, path, **kw)
        return pool

    monkeypatch.setattr(AttachedPool, "attach", classmethod(attach))


def test_a_pool_back_with_another_slot_size_is_given_up_once_not_attached_again_every_period(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused, the pool was attached again every ``REATTACH_AFTER`` for the engine's life: a connection,
    the tier mapped (prefaulted by a host worker, registered with CUDA by a GPU one) and dropped, every
    second, by each half. It is given up once, with an error that says so; a restart takes it up."""
    monkeypatch.setattr(_vllm_pool, "REATTACH_AFTER", 0.02)
    attaches: list[str] = []
    before_attach(monkeypatch, attaches.append)
    path = str(tmp_path / "pool.sock")
    owner = start_owner(path, "16MiB")
    old = Replica(path, seed=73)
    try:
        chunks = keys([1, 2])
        stop_owner(owner)
        owner = start_owner(path, "16MiB", "128KiB")
        wait_for(lambda: [old.lookup(chunks), any("is back with 131072" in r.getMessage() for r in caplog.records)][1])
        first = len(attaches)
        deadline = time.monotonic() + 1.0  # fifty periods
        while time.monotonic() < deadline:
            old.store(chunks, [0, 1])
            assert old.lookup(chunks) == [LookupResult.MISS] * 2
            time.sleep(0.01)
        assert len(attaches) - first <= 1, attaches  # the other half's one refusal at most
        said = [r for r in caplog.records if "given up" in r.getMessage()]
        assert 1 <= len(said) <= 2 and all(r.levelname == "ERROR" for r in said)
        assert "restart the engine" in said[0].getMessage()
        assert statistics(path).blocks == 0
        nothing_held(path)  # neither half stays attached to a pool it does not use
    finally:
        old.close()
        stop_owner(owner)
    assert_no_library_threads()


def test_lookups_racing_evictions_by_another_replica_never_load_wrong_bytes(owned: tuple[str, Any]) -> None:
    """Replica B fills the pool (evicting A's chunks) while A looks up and loads: every block A loads is
    its own bytes or a load error."""
    path, _ = owned
    a, b = Replica(path, seed=17), Replica(path, seed=18, dp=1)
    done = threading.Event()
    failures: list[BaseException] = []

    def churn() -> None:
        try:
            n = 1000
            while not done.is_set():
                b.store(keys(list(range(n, n + 32))), list(range(32)))
                n += 32
        except BaseException as exc:
            failures.append(exc)

    churner = threading.Thread(target=churn)
    try:
        a.worker.report_load_errors = True
        mine = keys(list(range(16)))
        churner.start()
        for _ in range(20):
            a.store(mine, list(range(16)))
            hits = a.lookup(mine)
            result = a.load(mine, list(range(32, 48)))
            assert result.success
            errors = a.worker.take_load_errors()
            for i in range(16):
                if 32 + i not in errors:
                    assert digests(a.caches, [32 + i]) == digests(a.caches, [i]), (hits, errors)
    finally:
        done.set()
        churner.join(60)
        a.close()
        b.close()
    assert failures == []
    nothing_held(path)


def test_a_second_shutdown_returns_only_once_the_first_has_ended_every_job(owned: tuple[str, Any]) -> None:
    """A shutdown called while another thread's shutdown was cancelling the jobs returned at once:
    its caller went on (to free the KV caches, say) while jobs still copied and held the pool's slots."""
    path, _ = owned
    a = Replica(path, seed=19)
    chunks = keys(list(range(64)))
    a.store(chunks, list(range(64)))
    submitted = set()
    for job in range(2000):
        assert a.worker.submit_load(job, PoolLoadStoreSpec([chunks[job % 64]]), gpu_spec([job % 64]))
        submitted.add(job)
    first = threading.Thread(target=a.worker.shutdown)
    first.start()
    probe = 10_000
    while a.worker.submit_load(probe, PoolLoadStoreSpec([chunks[0]]), gpu_spec([0])):  # until it is closing
        submitted.add(probe)
        probe += 1
    a.worker.shutdown()
    ended = {r.job_id for r in a.worker.get_finished()}
    first.join(30)
    a.manager.shutdown()
    assert ended == submitted
    nothing_held(path)


def test_the_private_tiers_worker_a_second_shutdown_waits_for_the_first() -> None:
    """The same for the worker over a private tier: the second caller found the tier not yet released."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from . import test_integration_vllm as private

    config = private.offloading_config(cpu_bytes=4096 * private.LAYERS * private.PAGE)
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    worker = OffloadingSpecFactory.create_spec(config).get_worker(private.kv_caches(seed=4))
    request = ReqContext(req_id="c")
    manager.on_new_request(request)
    assert manager.prepare_store(private.keys(0, 4096), request) is not None
    for job in range(8):
        ids = list(range(job * 512, (job + 1) * 512))
        assert worker.submit_store(job, private.gpu_spec([i % private.GPU_BLOCKS for i in ids]), CPULoadStoreSpec(ids))
    first = threading.Thread(target=worker.shutdown)
    first.start()
    while worker.submit_store(99, private.gpu_spec([0]), CPULoadStoreSpec([0])):  # until it is closing
        worker.wait({99})
    worker.shutdown()
    released = worker.tier.released
    first.join(30)
    assert released


def test_a_pool_spec_refuses_keys_that_are_not_bytes() -> None:
    """``bytes(5)`` is five zero bytes: an int key would have named another chunk without a word."""
    for bad in (5, "key", 1.5, None):
        with pytest.raises(TypeError, match="offload key is bytes"):
            PoolLoadStoreSpec([b"fine", bad])  # type: ignore[list-item]
    assert PoolLoadStoreSpec([b"a", bytearray(b"b"), memoryview(b"c")]).keys == (b"a", b"b", b"c")


# -- forged seals and blocks -------------------------------------------------------------------------


def forge(path: str, key: bytes, value: bytes) -> None:
    """Replace the block of ``key`` with ``value``, as a stray writer of the engines' namespace would."""

    async def write(pool: AttachedPool) -> None:
        await pool.discard([key])
        assert not (await pool.store([key], [value])).skipped

    in_pool(path, write)


@pytest.mark.parametrize(
    "seal",
    [
        SEAL_BYTES.pack(MAGIC, 2) + b"\x00",  # longer than a seal: its load raised into vLLM's scheduler
        MAGIC,  # cut short: read as a count of 0 (the rest of the row zero)
        SEAL_BYTES.pack(MAGIC, 2)[:5],  # cut short, its count's first byte kept: read as 2
        SEAL_BYTES.pack(MAGIC, 0),  # no rank's share of a chunk is empty
    ],
    ids=["long", "magic-only", "cut", "zero"],
)
def test_a_seal_of_the_wrong_length_or_an_empty_count_is_a_miss_and_teaches_nothing(
    owned: tuple[str, Any], seal: bytes
) -> None:
    """The scheduler learns a group's block counts from the first chunk it finds by its seals, once. A seal
    of 9 bytes made the load of the seals raise ValueError out of ``lookup`` (vLLM's scheduler died); one
    cut short was read zero-padded, and a count of 0 was believed: every later chunk of the group was a
    hit by its seals alone, its blocks gone or not."""
    path, _ = owned
    a = Replica(path, seed=80)
    b = None
    try:
        chunks = keys([1, 2])
        a.store(chunks, [0, 1])
        forge(path, key_of(chunks[0], SEAL), seal)
        in_pool(path, lambda pool: pool.discard([key_of(chunks[1], 1)]))  # the second chunk lacks a block
        b = Replica(path, seed=81, dp=1)  # has not learned the group's block counts
        assert b.lookup(chunks[:1]) == [LookupResult.MISS]
        assert b.lookup(chunks[1:]) == [LookupResult.MISS]  # a seal alone is not a chunk
        a.store(chunks[2:], [2])
        forge(path, key_of(chunks[0], SEAL), SEAL_BYTES.pack(MAGIC, 2))  # what the engine writes
        assert b.lookup(chunks[:1]) == [LookupResult.HIT]
        assert b.lookup(chunks[1:]) == [LookupResult.MISS]
    finally:
        a.close()
        if b is not None:
            b.close()
    nothing_held(path)


def test_a_block_stored_shorter_than_its_page_is_a_load_error_not_half_a_page(owned: tuple[str, Any]) -> None:
    """A load copies a block's stored length; the worker took a short block for its whole page, and the
    GPU block kept its old bytes past it under a successful load: another engine's bytes and its own. Its
    GPU block is a load error now (vLLM computes it again)."""
    path, _ = owned
    a = Replica(path, seed=82)
    try:
        chunks = keys([1, 2])
        a.store(chunks, [0, 1])
        forge(path, key_of(chunks[0], 1), b"\x01" * 100)  # the second layer's page of the first chunk
        a.worker.report_load_errors = True
        result = a.load(chunks, [5, 6])
        assert result.success and a.worker.take_load_errors() == {5, 6}  # from the short block's GPU block on
        assert a.load(chunks[1:], [6]).success and a.worker.take_load_errors() == set()
        assert digests(a.caches, [6]) == digests(a.caches, [1])
    finally:
        a.close()
    nothing_held(path)


# -- jobs cancelled mid-transfer -------------------------------------------------------------------------


@pytest.mark.parametrize("delay", [0.0, 0.001, 0.003, 0.01, 0.03])
def test_a_shutdown_at_any_moment_of_its_jobs_leaves_no_claim_pin_or_slot_and_chunks_whole(
    owned: tuple[str, Any], delay: float
) -> None:
    """Stores and loads of pages cut in two pieces, the worker shut down ``delay`` s after they were
    queued: the pool holds no claim, no pin and no slot but its blocks', and each chunk another engine
    finds loads whole, bit for bit."""
    path, _ = owned
    page = 96 << 10  # two pieces of a 64 KiB slot
    a = Replica(path, seed=83, page=page)
    chunks = keys(list(range(40)))
    try:
        a.store(chunks[:8], list(range(8)))
        with a.manager.lock:
            out = a.manager.prepare_store(chunks[8:], a.request)
        todo = out.store_spec.keys
        for job in range(16):
            a.worker.submit_store(
                job, gpu_spec([8 + 2 * job, 9 + 2 * job]), PoolLoadStoreSpec(todo[2 * job : 2 * job + 2])
            )
            a.worker.submit_load(100 + job, PoolLoadStoreSpec([chunks[job % 8]]), gpu_spec([40 + job]))
        time.sleep(delay)
    finally:
        a.close()
    ended = {r.job_id for r in a.worker.get_finished()}
    assert ended == {*range(16), *range(100, 116)}
    stats = nothing_held(path)
    assert stats.slots_attached == 0 and stats.tier.slots_allocated == stats.blocks
    b = Replica(path, seed=84, page=page, dp=1)
    try:
        whole = [
            i for i, c in enumerate(chunks) if b.lookup([c]) == [LookupResult.HIT]
        ]  # one by one: jobs end in any order
        assert whole[:8] == list(range(8))
        assert stats.blocks == len(whole) * (2 * LAYERS + 1)  # two pieces a layer and a seal: no chunk in part
        b.worker.report_load_errors = True
        assert b.load([chunks[i] for i in whole], list(range(len(whole)))).success
        assert b.worker.take_load_errors() == set()
        for n, i in enumerate(whole):
            assert digests(b.caches, [n]) == digests(a.caches, [i])
    finally:
        b.close()
    nothing_held(path)


def test_a_gpu_error_while_attaching_again_is_a_miss_and_a_later_attempt_takes_the_pool(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU worker attaches again by registering the pool's memory with CUDA; a driver error there
    went out of the link into the job (each failed, vLLM's too). It is now a miss, said in a warning,
    and the next attempt after the period takes the pool as any reattach does."""
    monkeypatch.setattr(_vllm_pool, "REATTACH_AFTER", 0.05)
    failing = [False]

    def refuse(path: str) -> None:
        if failing[0]:
            raise CudaError("cuMemHostRegister", "CUDA_ERROR_OUT_OF_MEMORY", 2)

    before_attach(monkeypatch, refuse)
    path = str(tmp_path / "pool.sock")
    owner = start_owner(path, "16MiB")
    old = Replica(path, seed=74)
    try:
        chunks = keys([1, 2])
        stop_owner(owner)
        failing[0] = True
        owner = start_owner(path, "16MiB")
        wait_for(
            lambda: [old.store(chunks, [0, 1]), any("with the GPU here" in r.getMessage() for r in caplog.records)][1]
        )
        assert old.lookup(chunks) == [LookupResult.MISS] * 2  # no job failed: misses
        said = [r for r in caplog.records if "with the GPU here" in r.getMessage()]
        assert all(r.levelname == "WARNING" and "CUDA_ERROR_OUT_OF_MEMORY" in r.getMessage() for r in said)
        failing[0] = False
        wait_for(lambda: [old.store(chunks, [0, 1]), old.lookup(chunks)][1] == [LookupResult.HIT] * 2, timeout=30)
        nothing_held(path, clients=2)  # both halves attached again
    finally:
        old.close()
        stop_owner(owner)
    assert_no_library_threads()


def test_a_job_id_is_taken_again_as_soon_as_its_result_was_reported(owned: tuple[str, Any]) -> None:
    """The result was queued before the job left the jobs in flight: a caller that saw it and reused its
    id at once could be told that the job was still in flight. Two threads spin so that the worker's
    loop thread loses the GIL between any two bytecodes."""
    path, _ = owned
    a = Replica(path, seed=17)
    refused: list[str] = []
    try:
        chunks = keys([1])
        with a.manager.lock:
            out = a.manager.prepare_store(chunks, a.request)
        worker = a.worker
        assert worker.submit_store(0, gpu_spec([0]), out.store_spec)
        assert finish(worker, {0})[0].success
        with a.manager.lock:
            a.manager.complete_store(out.keys_to_store, a.request)
        with gil_thrashed():
            for _ in range(400):
                try:
                    assert worker.submit_load(7, PoolLoadStoreSpec(chunks), gpu_spec([10]))
                except ValueError as exc:
                    refused.append(str(exc))
                    worker.wait({7})
                    continue
                deadline = time.monotonic() + 30
                while not (results := worker.get_finished()):  # at once: no sleep between the polls
                    assert time.monotonic() < deadline, "job 7 did not finish"
                assert [(r.job_id, r.success) for r in results] == [(7, True)]
    finally:
        a.close()
    assert refused == []
    nothing_held(path)
