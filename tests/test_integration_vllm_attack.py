"""Attacks on vLLM's offloading worker over a private tier (skipped without vLLM): hostile job specs,
threads submitting and polling at once, shutdown racing its jobs, a fill that fails, and the same jobs
checked against vLLM's own CPU worker arithmetic.

The pool variant has its own attack file (``test_integration_vllm_pool_attack.py``).
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import json
import random
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vllm is not installed")

import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from aiokvtier._host import _linux
from aiokvtier.integrations.vllm import AiokvtierOffloadingWorker

from .helpers import descriptors, gil_thrashed
from .invariants import assert_no_library_threads
from .test_integration_vllm import GPU_BLOCKS, LAYERS, PAGE, finish, gpu_spec, kv_caches, offloading_config, rows

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
HANG = 30.0
"""Seconds after which a wait counts as a hang."""


def private_worker(chunks: int = 64, *, seed: int = 0, **tier: Any) -> tuple[AiokvtierOffloadingWorker, Any]:
    """A worker made by vLLM's factory over ``chunks`` chunks of one block, and its KV caches."""
    config = offloading_config(cpu_bytes=chunks * LAYERS * PAGE, **({"aiokvtier": tier} if tier else {}))
    caches = kv_caches(seed)
    worker = OffloadingSpecFactory.create_spec(config).get_worker(caches)
    assert isinstance(worker, AiokvtierOffloadingWorker)
    return worker, caches


def two_group_caches(seed: int, pages: tuple[int, ...] = (PAGE, PAGE, PAGE)) -> CanonicalKVCaches:
    """Group 0 over tensor 0, group 1 over tensors 1 and 2 (a hybrid model's two kinds of layer)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(-128, 128, (GPU_BLOCKS, p), dtype=torch.int8, generator=generator) for p in pages]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=p) for t, p in zip(tensors, pages, strict=True)],
        group_data_refs=[
            [CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=pages[0])],
            [CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=pages[i]) for i in (1, 2)],
        ],
    )


def two_groups(
    seed: int = 0, *, chunks: int = 64, blocks_per_chunk: int = 1, pages: tuple[int, ...] = (PAGE, PAGE, PAGE)
) -> tuple[AiokvtierOffloadingWorker, CanonicalKVCaches]:
    caches = two_group_caches(seed, pages)
    worker = AiokvtierOffloadingWorker(
        caches, num_chunks=chunks, blocks_per_chunk=blocks_per_chunk, settings={"max_quota": None}
    )
    return worker, caches


def spec2(ids0: list[int], ids1: list[int], first0: int = 0, first1: int = 0) -> GPULoadStoreSpec:
    return GPULoadStoreSpec([*ids0, *ids1], group_sizes=[len(ids0), len(ids1)], block_indices=[first0, first1])


def snapshot(caches: CanonicalKVCaches) -> list[torch.Tensor]:
    return [entry.tensor.clone() for entry in caches.tensors]


def unchanged(caches: CanonicalKVCaches, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(e.tensor, b) for e, b in zip(caches.tensors, before, strict=True))


def wait_until(predicate: Callable[[], bool], timeout: float = HANG) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not true after {timeout} s: {predicate}"
        time.sleep(0.001)


# -- hostile jobs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chunk_ids", "error", "match"),
    [
        (np.array([1.7, 2.2]), TypeError, "chunk ids are integers"),  # cut to 1 and 2: other chunks' slots
        (np.array([True, False]), TypeError, "chunk ids are integers"),  # taken for chunks 1 and 0
        (np.array([[0], [1]]), ValueError, "one dimension"),
        (np.array([0, 2**63 + 5], dtype=np.uint64), ValueError, "must lie in"),  # wraps negative
        (np.array([0, -1]), ValueError, "must lie in"),
        (np.array([0, 64]), ValueError, "must lie in"),  # one past the last chunk the quota holds
        (np.array([0, 2**40]), ValueError, "must lie in"),
    ],
)
def test_chunk_ids_of_a_wrong_type_or_range_are_refused_and_change_nothing(
    chunk_ids: Any, error: type[Exception], match: str
) -> None:
    worker, caches = private_worker()
    try:
        spec = CPULoadStoreSpec([0, 1])
        spec.block_ids = chunk_ids  # what a caller past vLLM's constructor can hand over
        before = snapshot(caches)
        with pytest.raises(error, match=match):
            worker.submit_store(1, gpu_spec([4, 5]), spec)
        with pytest.raises(error, match=match):
            worker.submit_load(2, spec, gpu_spec([4, 5]))
        assert worker.get_finished() == [] and unchanged(caches, before)
        assert worker.tier.statistics().slots_allocated == 0
        # Nothing was stored: chunks 1 and 2 (where a float's cut would have landed) load nothing.
        assert worker.submit_load(3, CPULoadStoreSpec([1, 2]), gpu_spec([6, 7]))
        (result,) = finish(worker, {3})
        assert not result.success and unchanged(caches, before)
    finally:
        worker.shutdown()


def test_a_group_size_past_the_jobs_blocks_is_refused_before_it_is_planned() -> None:
    """vLLM checks the sizes' sum only in its constructor; a size set past it was turned into an array of
    that many positions before the check: 10**12 raised MemoryError, 2*10**9 wrote 16 GiB."""
    worker, _ = private_worker()
    try:
        spec = gpu_spec([0, 1])
        spec.group_sizes = [10**12]
        with pytest.raises(ValueError, match="do not match"):
            worker.submit_store(1, spec, CPULoadStoreSpec([0, 1]))
        with pytest.raises(ValueError, match="do not match"):
            worker.submit_load(2, CPULoadStoreSpec([0, 1]), spec)
        spec.group_sizes, spec.block_indices = [2], [10**18]  # a huge first index is only its place in a chunk
        assert worker.submit_store(3, spec, CPULoadStoreSpec([0, 1]))
        assert finish(worker, {3})[0].success
    finally:
        worker.shutdown()


def test_a_store_naming_a_chunk_twice_is_refused_and_leaves_the_chunk_unstored() -> None:
    """Two pages into one slot: the engine refused the copy, but only after the chunk had claimed its
    slots, so a later load of the chunk (never stored) succeeded with whatever the slots held."""
    worker, caches = private_worker()
    try:
        with pytest.raises(ValueError, match="job 1 stores two pages into chunk 7"):
            worker.submit_store(1, gpu_spec([3, 4]), CPULoadStoreSpec([7, 7]))
        assert worker.get_finished() == []
        before = snapshot(caches)
        assert worker.submit_load(2, CPULoadStoreSpec([7]), gpu_spec([5]))
        (result,) = finish(worker, {2})
        assert not result.success and unchanged(caches, before)
        assert worker.tier.statistics().slots_allocated == 0
    finally:
        worker.shutdown()


def test_a_store_naming_one_chunk_for_two_groups_is_refused() -> None:
    """A chunk belongs to one group's key: named by both, their tensors' pages would share its slots."""
    worker, _ = two_groups(1)
    try:
        with pytest.raises(ValueError, match="stores two pages into chunk 3"):
            worker.submit_store(1, spec2([0], [1]), CPULoadStoreSpec([3, 3]))
        assert worker.get_finished() == [] and worker.tier.statistics().slots_allocated == 0
    finally:
        worker.shutdown()


def test_a_load_naming_a_gpu_block_twice_is_refused_on_the_callers_thread() -> None:
    """Two pages into one GPU block end with whichever landed last; in the second group of a job, the
    engine refused it only after the first group's blocks were written."""
    worker, caches = two_groups(2)
    try:
        assert worker.submit_store(1, spec2([1], [2, 3]), CPULoadStoreSpec([0, 1, 2]))
        assert finish(worker, {1})[0].success
        before = snapshot(caches)
        with pytest.raises(ValueError, match="job 2 loads two pages into GPU block 21"):
            worker.submit_load(2, CPULoadStoreSpec([0, 1, 2]), spec2([20], [21, 21]))
        with pytest.raises(ValueError, match="job 3 loads two pages into GPU block 9"):
            worker.submit_load(3, CPULoadStoreSpec([0, 1]), spec2([9, 9], []))
        assert worker.get_finished() == [] and unchanged(caches, before)
        # A store may read a block twice: two chunks of the same bytes.
        assert worker.submit_store(4, spec2([5], [6, 6]), CPULoadStoreSpec([3, 4, 5]))
        assert finish(worker, {4})[0].success
    finally:
        worker.shutdown()


def test_a_load_of_two_groups_one_never_stored_writes_no_block() -> None:
    """The first group's copies started before the second group's chunk was found never stored: the job
    failed with the first group's GPU blocks overwritten."""
    worker, caches = two_groups(3)
    try:
        assert worker.submit_store(1, spec2([1], [2]), CPULoadStoreSpec([0, 1]))
        assert finish(worker, {1})[0].success
        before = snapshot(caches)
        assert worker.submit_load(2, CPULoadStoreSpec([0, 5]), spec2([10], [11]))
        (result,) = finish(worker, {2})
        assert not result.success
        assert unchanged(caches, before)
    finally:
        worker.shutdown()


@pytest.mark.parametrize("order", ["store-first", "load-first"])
def test_a_store_and_a_load_of_one_chunk_in_one_batch_load_whole_bytes_or_fail(order: str) -> None:
    """vLLM's manager never loads a chunk under a store; if a caller does, the load gets the stored page
    whole (the old or the new one) or fails, never a mix."""
    worker, caches = private_worker(seed=4)
    try:
        old = rows(caches, [1])
        assert worker.submit_store(1, gpu_spec([1]), CPULoadStoreSpec([3]))
        assert finish(worker, {1})[0].success
        new = rows(caches, [2])
        jobs = [
            lambda: worker.submit_store(2, gpu_spec([2]), CPULoadStoreSpec([3])),
            lambda: worker.submit_load(3, CPULoadStoreSpec([3]), gpu_spec([40])),
            lambda: worker.submit_store(4, gpu_spec([2]), CPULoadStoreSpec([9])),  # never stored before
            lambda: worker.submit_load(5, CPULoadStoreSpec([9]), gpu_spec([41])),
        ]
        if order == "load-first":
            jobs = [jobs[1], jobs[0], jobs[3], jobs[2]]
        assert all(submit() for submit in jobs)
        results = {r.job_id: r for r in finish(worker, {2, 3, 4, 5})}
        assert results[2].success and results[4].success and results[3].success
        got = rows(caches, [40])
        assert all(torch.equal(g, o) for g, o in zip(got, old, strict=True)) or all(
            torch.equal(g, n) for g, n in zip(got, new, strict=True)
        )
        if results[5].success:
            assert all(torch.equal(g, n) for g, n in zip(rows(caches, [41]), new, strict=True))
    finally:
        worker.shutdown()


def test_specs_of_the_wrong_type_or_shape_are_refused_and_queue_nothing() -> None:
    worker, caches = private_worker(seed=5)
    try:
        before = snapshot(caches)
        cases: list[tuple[Callable[[], bool], type[Exception], str]] = [
            (lambda: worker.submit_store(1, gpu_spec([0]), gpu_spec([0])), TypeError, "CPULoadStoreSpec"),
            (lambda: worker.submit_load(1, gpu_spec([0]), CPULoadStoreSpec([0])), TypeError, "GPULoadStoreSpec"),
            (lambda: worker.submit_store(1, None, CPULoadStoreSpec([0])), TypeError, "GPULoadStoreSpec"),  # type: ignore[arg-type]
            (lambda: worker.submit_load(1, CPULoadStoreSpec([0, 1]), gpu_spec([0])), ValueError, "do not match"),
            (lambda: worker.submit_store(1, gpu_spec([0, 1, 2]), CPULoadStoreSpec([0])), ValueError, "do not match"),
            (
                lambda: worker.submit_store(
                    1, GPULoadStoreSpec([0, 1], group_sizes=[1, 1], block_indices=[0, 0]), CPULoadStoreSpec([0, 1])
                ),
                ValueError,
                "2 group sizes for 1 KV cache groups",
            ),
            (lambda: worker.submit_store(1, gpu_spec([0, GPU_BLOCKS]), CPULoadStoreSpec([0, 1])), ValueError, "lie in"),
        ]
        for call, error, match in cases:
            with pytest.raises(error, match=match):
                call()
        assert worker.get_finished() == [] and unchanged(caches, before)
        assert worker.tier.statistics().slots_allocated == 0
        worker.wait({1})  # nothing of that id is in flight
        assert worker.submit_store(1, gpu_spec([0]), CPULoadStoreSpec([0]))  # the id was never taken
        assert finish(worker, {1})[0].success
    finally:
        worker.shutdown()


_HOSTILE_CHILD = """
import json, sys
import numpy as np, torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from tests.test_integration_vllm_attack import private_worker, snapshot, unchanged, finish

worker, caches = private_worker(seed=9)
worker.submit_store(0, GPULoadStoreSpec([0, 1], group_sizes=[2], block_indices=[0]), CPULoadStoreSpec([0, 1]))
finish(worker, {0})
def spec(ids, sizes=None, firsts=None):
    s = GPULoadStoreSpec([0], group_sizes=[1], block_indices=[0])
    s.block_ids = np.asarray(ids)
    s.group_sizes = [len(s.block_ids)] if sizes is None else sizes
    s.block_indices = [0] if firsts is None else firsts
    return s
def chunks(ids):
    s = CPULoadStoreSpec([0]); s.block_ids = np.asarray(ids); return s
cases = {
    "gpu id 2**31": (spec([0, 2**31 - 1]), chunks([0, 1])),
    "gpu id -2**31": (spec([-2**31, 0]), chunks([0, 1])),
    "gpu ids as 2-d": (spec([[0], [1]]), chunks([0, 1])),
    "gpu ids empty, one chunk": (spec([]), chunks([0])),
    "gpu ids empty int, one chunk": (spec(np.zeros(0, dtype=np.int64)), chunks([0])),
    "chunk 2**62": (spec([0]), chunks([2**62])),
    "chunk ids empty, two blocks": (spec([0, 1]), chunks([])),
    "sizes [3, -1]": (spec([0, 1], sizes=[3, -1]), chunks([0, 1])),
    "sizes [2**62]": (spec([0, 1], sizes=[2**62]), chunks([0, 1])),
    "first -2**62": (spec([0, 1], firsts=[-2**62]), chunks([0, 1])),
    "sizes and firsts empty": (spec([0, 1], sizes=[], firsts=[]), chunks([0, 1])),
}
out = {}
before = snapshot(caches)
for n, (name, (gpu, host)) in enumerate(cases.items()):
    for store in (True, False):
        try:
            queued = worker.submit_store(10 + 2 * n, gpu, host) if store else worker.submit_load(11 + 2 * n, host, gpu)
            ok = finish(worker, {(10 if store else 11) + 2 * n})[0].success
            outcome = f"ran, success={ok}"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        out[f"{name} ({'store' if store else 'load'})"] = [outcome, unchanged(caches, before)]
worker.shutdown()
print(json.dumps(out))
"""


OUR_REFUSALS = (
    r"(ValueError|TypeError): .*(must lie in|do not match|are integers|one dimension|must not be negative"
    r"|group sizes for|first block indices for)"
)
"""The worker's own refusals (numpy's ``array is too big`` is a ValueError too, but no answer)."""


def test_hostile_specs_never_crash_the_process_and_change_no_block() -> None:
    """In a child: a copy outside the KV tensors would kill the process rather than raise."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_HOSTILE_CHILD)],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(outcomes) == 22
    for name, (outcome, same) in outcomes.items():
        assert same, f"{name}: {outcome}, and the KV tensors changed"
        assert re.match(OUR_REFUSALS, outcome), f"{name}: {outcome}"


# -- threads at once --------------------------------------------------------------------------------------


class Poller:
    """A thread calling ``get_finished`` in a loop, as vLLM's worker thread does once a step."""

    def __init__(self, worker: AiokvtierOffloadingWorker) -> None:
        self.worker = worker
        self.seen: dict[int, list[TransferResult]] = {}
        self.errors: list[BaseException] = []
        self.changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="poller")
        self._thread.start()

    def _poll(self) -> None:
        try:
            while not self._stop.is_set():
                got = self.worker.get_finished()
                if got:
                    with self.changed:
                        for r in got:
                            self.seen.setdefault(r.job_id, []).append(r)
                        self.changed.notify_all()
                else:
                    time.sleep(0.0002)
        except BaseException as exc:
            self.errors.append(exc)

    def result(self, job_id: int) -> TransferResult:
        with self.changed:
            assert self.changed.wait_for(lambda: job_id in self.seen, HANG), f"job {job_id} did not finish"
            return self.seen[job_id][0]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(HANG)
        assert not self._thread.is_alive()


@pytest.fixture
def fast_switching() -> Iterator[None]:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads trade the GIL every few bytecodes
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


@pytest.mark.usefixtures("fast_switching")
def test_threads_storing_and_loading_at_once_while_another_polls() -> None:
    """Four threads store and load disjoint chunks and one chunk they all share (each store of it from
    the same bytes), a fifth polls ``get_finished``: every job is reported once, succeeds, and every
    load is bit-exact."""
    worker, caches = private_worker(256, seed=6)
    sources = list(range(16))  # never written: loads go to 16..63
    expected = {b: rows(caches, [b]) for b in sources}
    shared = 200
    ids = itertools.count(1)
    id_lock = threading.Lock()
    failures: list[BaseException] = []

    def next_id() -> int:
        with id_lock:
            return next(ids)

    poller = Poller(worker)

    def run(t: int) -> None:
        try:
            mine = [16 * t + i for i in range(4)]  # chunk 16t+i holds source block 4t+i
            blocks = [4 * t + i for i in range(4)]
            for r in range(25):
                store, shared_store = next_id(), next_id()
                assert worker.submit_store(store, gpu_spec(blocks), CPULoadStoreSpec(mine))
                assert worker.submit_store(shared_store, gpu_spec([0]), CPULoadStoreSpec([shared]))
                if r % 5 == 0:
                    worker.wait({store, shared_store})
                assert poller.result(store).success and poller.result(shared_store).success
                load, shared_load, other = next_id(), next_id(), next_id()
                dest = [16 + 12 * t + i for i in range(4)]
                assert worker.submit_load(load, CPULoadStoreSpec(mine[::-1]), gpu_spec(dest))
                assert worker.submit_load(shared_load, CPULoadStoreSpec([shared]), gpu_spec([20 + 12 * t]))
                # Another thread's chunk (stored by now or not: a failure then) while it may be stored again.
                neighbour = (t + 1) % 4
                assert worker.submit_load(other, CPULoadStoreSpec([16 * neighbour]), gpu_spec([21 + 12 * t]))
                assert poller.result(load).success and poller.result(shared_load).success
                for block, source in zip(dest, blocks[::-1], strict=True):
                    assert all(torch.equal(g, w) for g, w in zip(rows(caches, [block]), expected[source], strict=True))
                assert all(torch.equal(g, w) for g, w in zip(rows(caches, [20 + 12 * t]), expected[0], strict=True))
                if poller.result(other).success:
                    got = rows(caches, [21 + 12 * t])
                    assert all(torch.equal(g, w) for g, w in zip(got, expected[4 * neighbour], strict=True))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
            assert not thread.is_alive(), "a submitting thread hangs"
    finally:
        poller.stop()
        worker.shutdown()
    assert failures == [] and poller.errors == []
    assert worker.get_finished() == []
    assert sorted(poller.seen) == list(range(1, 4 * 25 * 5 + 1))
    assert all(len(results) == 1 for results in poller.seen.values())  # each reported exactly once


def test_a_job_id_is_taken_again_as_soon_as_its_result_was_reported() -> None:
    """The result was queued before the job left the jobs in flight: a caller that saw it and reused its
    id at once was told now and then (59 times in 1500 here) that the job was still in flight. Two
    threads spin so that the loop thread loses the GIL between any two bytecodes."""
    worker, _ = private_worker(seed=7)
    refused: list[str] = []
    try:
        assert worker.submit_store(0, gpu_spec([0]), CPULoadStoreSpec([0]))
        assert finish(worker, {0})[0].success
        with gil_thrashed():
            for _ in range(1500):
                try:
                    assert worker.submit_load(7, CPULoadStoreSpec([0]), gpu_spec([30]))
                except ValueError as exc:
                    refused.append(str(exc))
                    worker.wait({7})
                    continue
                deadline = time.monotonic() + HANG
                while not (results := worker.get_finished()):  # at once: no sleep between the polls
                    assert time.monotonic() < deadline, "job 7 did not finish"
                assert [(r.job_id, r.success) for r in results] == [(7, True)]
    finally:
        worker.shutdown()
    assert refused == []


# -- shutdown racing the jobs -------------------------------------------------------------------------


def slow_fill(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Each populate call of the fill sleeps first: a tier whose fill takes a while."""
    real = _linux.populate

    def slow(addr: int, length: int) -> None:
        time.sleep(seconds)
        real(addr, length)

    monkeypatch.setattr(_linux, "populate", slow)


@pytest.mark.parametrize("delay", [0.0, 0.0005, 0.002, 0.01, 0.05])
def test_shutdown_from_another_thread_racing_stores_and_loads(monkeypatch: pytest.MonkeyPatch, delay: float) -> None:
    """Large stores and loads in flight, stores waiting for a fill of 1 MiB units, a caller in ``wait``:
    shutdown from another thread returns, every job is reported once, no thread or descriptor is left,
    nothing writes the KV tensors afterwards, and calls after it answer as documented."""
    slow_fill(monkeypatch, 0.005)
    before_fds = descriptors()
    chunks = 4096  # 32 MiB of slots, 32 units of 1 MiB
    worker, caches = private_worker(chunks, seed=10, fill_threads=1, fill_chunk="1MiB", commit_unit="1MiB")
    submitted: set[int] = set()
    try:
        assert worker.submit_store(0, gpu_spec(list(range(GPU_BLOCKS))), CPULoadStoreSpec(list(range(GPU_BLOCKS))))
        assert finish(worker, {0})[0].success
        for job in range(1, 9):  # 512 chunks each: most wait for the fill
            ids = list(range(job * 512 - 512 + GPU_BLOCKS, job * 512 + GPU_BLOCKS))
            ids = [i for i in ids if i < chunks]
            assert worker.submit_store(job, gpu_spec([i % GPU_BLOCKS for i in ids]), CPULoadStoreSpec(ids))
            submitted.add(job)
        for job in range(100, 108):  # loads of what is stored, each into every GPU block but the sources
            assert worker.submit_load(job, CPULoadStoreSpec(list(range(32))), gpu_spec(list(range(32, 64))))
            submitted.add(job)
        waiter = threading.Thread(target=worker.wait, args=({1, 8, 100},))
        waiter.start()
        stopper = threading.Thread(target=lambda: (time.sleep(delay), worker.shutdown()))
        stopper.start()
        probe = 1000
        while worker.submit_load(probe, CPULoadStoreSpec([probe % 32]), gpu_spec([32 + probe % 32])):
            submitted.add(probe)  # until the shutdown has begun
            probe += 1
        stopper.join(HANG)
        assert not stopper.is_alive(), "shutdown hangs"
        waiter.join(HANG)
        assert not waiter.is_alive(), "wait() outlived the shutdown"
    finally:
        worker.shutdown()
    results = worker.get_finished()
    assert sorted(r.job_id for r in results) == sorted(submitted)  # each once, stored, loaded or cancelled
    for r in results:
        assert (r.transfer_size is not None) == r.success
    # Nothing writes the KV tensors once shutdown returned: what was there stays, what is written stays.
    after = snapshot(caches)
    time.sleep(0.05)
    assert unchanged(caches, after)
    for entry in caches.tensors:
        entry.tensor.fill_(7)
    time.sleep(0.05)
    assert all(bool((entry.tensor == 7).all()) for entry in caches.tensors)
    # Calls after shutdown: refused jobs, nothing to report or wait for, shutdown again a no-op.
    assert worker.submit_store(5000, gpu_spec([0]), CPULoadStoreSpec([0])) is False
    assert worker.submit_load(5001, CPULoadStoreSpec([0]), gpu_spec([0])) is False
    worker.wait({5000, 5001, 1})
    assert worker.get_finished() == []
    worker.shutdown()
    assert worker.tier.released
    assert_no_library_threads()
    assert descriptors() == before_fds


def test_shutdown_from_several_threads_at_once_returns_in_each_once_all_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow_fill(monkeypatch, 0.005)
    worker, _ = private_worker(4096, seed=11, fill_threads=1, fill_chunk="1MiB", commit_unit="1MiB")
    ids = list(range(4096))
    assert worker.submit_store(1, gpu_spec([i % GPU_BLOCKS for i in ids]), CPULoadStoreSpec(ids))
    released: list[bool] = []

    def stop() -> None:
        worker.shutdown()
        released.append(worker.tier.released)

    stoppers = [threading.Thread(target=stop) for _ in range(4)]
    for thread in stoppers:
        thread.start()
    for thread in stoppers:
        thread.join(HANG)
        assert not thread.is_alive()
    assert released == [True] * 4
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, False)]
    assert_no_library_threads()


# -- the fill failing ------------------------------------------------------------------------------------


def test_a_store_past_a_failed_fill_fails_and_later_jobs_still_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fill stops with ENOMEM at 2 MiB of an 8 MiB tier: a store needing more fails (it does not wait
    for memory that never comes), stores and loads within what is resident go on working."""
    real = _linux.populate
    calls = [0]
    lock = threading.Lock()

    def failing(addr: int, length: int) -> None:
        with lock:
            calls[0] += 1
            n = calls[0]
        if n > 2:
            raise OSError(errno.ENOMEM, "injected")
        real(addr, length)

    monkeypatch.setattr(_linux, "populate", failing)
    chunks = 1024  # two 4 KiB pages a chunk: 8 MiB, 8 units of 1 MiB
    worker, caches = private_worker(chunks, seed=12, fill_threads=1, fill_chunk="1MiB", commit_unit="1MiB")
    try:
        first = list(range(100))  # 200 slots of the 512 resident
        assert worker.submit_store(1, gpu_spec([i % GPU_BLOCKS for i in first]), CPULoadStoreSpec(first))
        assert finish(worker, {1})[0].success
        too_many = list(range(100, 300))  # 400 more slots: past the failure
        assert worker.submit_store(2, gpu_spec([i % GPU_BLOCKS for i in too_many]), CPULoadStoreSpec(too_many))
        (failed,) = finish(worker, {2}, timeout=HANG)
        assert not failed.success
        before = snapshot(caches)
        assert worker.submit_load(3, CPULoadStoreSpec([150]), gpu_spec([60]))  # the failed store claimed nothing
        assert not finish(worker, {3})[0].success and unchanged(caches, before)
        fits = list(range(300, 350))  # 100 slots: still resident
        assert worker.submit_store(4, gpu_spec([i % GPU_BLOCKS for i in fits]), CPULoadStoreSpec(fits))
        assert finish(worker, {4})[0].success
        expected = rows(caches, [3, 300 % GPU_BLOCKS])
        assert worker.submit_load(5, CPULoadStoreSpec([3, 300]), gpu_spec([62, 63]))
        assert finish(worker, {5})[0].success
        for got, want in zip(rows(caches, [62, 63]), expected, strict=True):
            assert torch.equal(got, want)
        assert worker.tier.statistics().slots_allocated == 150 * worker.slots_per_chunk
    finally:
        worker.shutdown()
    assert worker.tier.released
    assert_no_library_threads()


# -- against vLLM's own CPU worker arithmetic -----------------------------------------------------------


class VllmReference:
    """vLLM's CPU worker (``SingleDirectionOffloadingHandler.transfer_async``) on CPU tensors.

    Its handler asserts CUDA tensors, so its job arithmetic is repeated here, with vLLM's own
    ``compute_sub_block_ptrs`` for the addresses and ``memmove`` for its copy kernel; its CPU tier is its
    layout: one tensor per KV tensor, a row of ``blocks_per_chunk`` pages per chunk.
    """

    def __init__(self, caches: CanonicalKVCaches, num_chunks: int, blocks_per_chunk: int) -> None:
        self.gpu = [entry.tensor for entry in caches.tensors]
        self.refs = caches.group_data_refs
        self.bpc = blocks_per_chunk
        self.cpu = [torch.zeros((num_chunks, t.shape[1] * blocks_per_chunk), dtype=torch.int8) for t in self.gpu]

    def transfer(self, job_id: int, gpu: GPULoadStoreSpec, host: CPULoadStoreSpec, *, store: bool) -> TransferResult:
        src_tensors, dst_tensors = (self.gpu, self.cpu) if store else (self.cpu, self.gpu)
        src_bpc, dst_bpc = (1, self.bpc) if store else (self.bpc, 1)
        src_blocks, dst_blocks = (gpu.block_ids, host.block_ids) if store else (host.block_ids, gpu.block_ids)
        src_offset = dst_offset = 0
        nbytes = 0
        for g, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices, strict=True)):
            if size == 0:
                continue
            src_skip, dst_skip = first % src_bpc, first % dst_bpc
            src_end = src_offset + cdiv(size + src_skip, src_bpc)
            dst_end = dst_offset + cdiv(size + dst_skip, dst_bpc)
            for ref in self.refs[g]:
                src = np.empty(size, dtype=np.uint64)
                dst = np.empty(size, dtype=np.uint64)
                t = ref.tensor_idx
                compute_sub_block_ptrs(src_blocks[src_offset:src_end], src_bpc, src, src_tensors[t], src_skip)
                compute_sub_block_ptrs(dst_blocks[dst_offset:dst_end], dst_bpc, dst, dst_tensors[t], dst_skip)
                for d, s in zip(dst.tolist(), src.tolist(), strict=True):
                    ctypes.memmove(d, s, ref.page_size_bytes)
                nbytes += size * ref.page_size_bytes
            src_offset, dst_offset = src_end, dst_end
        assert src_offset == len(src_blocks) and dst_offset == len(dst_blocks)
        return TransferResult(job_id=job_id, success=True, transfer_size=nbytes, transfer_time=None)


@pytest.mark.parametrize("blocks_per_chunk", [1, 2, 3])
def test_the_same_jobs_give_vllms_reports_and_bytes(blocks_per_chunk: int) -> None:
    """A random sequence of stores (whole chunks, then parts of them again) and loads (starting anywhere
    in a chunk) of two KV cache groups, pages of two sizes: after each job the reports and every byte of
    the KV tensors match vLLM's CPU worker's."""
    rng = random.Random(blocks_per_chunk)
    chunks, bpc = 48, blocks_per_chunk
    pages = (PAGE, 3000, PAGE)
    worker, caches = two_groups(20 + bpc, chunks=chunks, blocks_per_chunk=bpc, pages=pages)
    mirror = two_group_caches(20 + bpc, pages)
    reference = VllmReference(mirror, chunks, bpc)
    free = list(range(chunks))
    rng.shuffle(free)
    owner: dict[int, int] = {}  # chunk -> the group whose key it holds (every block of it stored)
    try:
        for job in range(1, 121):
            group = rng.randrange(2)
            held = [c for c, g in owner.items() if g == group]
            store = not held or rng.random() < 0.5
            if store:
                for entry, twin in zip(caches.tensors, mirror.tensors, strict=True):  # new bytes to store
                    block = rng.randrange(GPU_BLOCKS)
                    fresh = torch.randint(-128, 128, entry.tensor[block].shape, dtype=torch.int8)
                    entry.tensor[block] = fresh
                    twin.tensor[block] = fresh
            if store and (not held or rng.random() < 0.5) and free:
                n_chunks = rng.randint(1, min(3, len(free)))
                job_chunks = [free.pop() for _ in range(n_chunks)]
                skip, size = 0, n_chunks * bpc
                for c in job_chunks:
                    owner[c] = group
            else:
                job_chunks = rng.sample(held, rng.randint(1, min(3, len(held))))
                skip = rng.randrange(bpc)
                size = rng.randint(1, len(job_chunks) * bpc - skip)
                job_chunks = job_chunks[: cdiv(skip + size, bpc)]
            first = rng.randrange(5) * bpc + skip
            blocks = rng.sample(range(GPU_BLOCKS), size)
            gpu = spec2(blocks, [], first, 0) if group == 0 else spec2([], blocks, 0, first)
            host = CPULoadStoreSpec(job_chunks)
            if store:
                assert worker.submit_store(job, gpu, host)
            else:
                assert worker.submit_load(job, host, gpu)
            want = reference.transfer(job, gpu, host, store=store)
            (got,) = finish(worker, {job})
            assert (got.job_id, got.success, got.transfer_size) == (want.job_id, want.success, want.transfer_size)
            for mine, theirs in zip(caches.tensors, mirror.tensors, strict=True):
                assert torch.equal(mine.tensor, theirs.tensor), f"job {job} ({'store' if store else 'load'})"
            if owner and (rng.random() < 0.1 or len(free) < 3):  # the manager evicts: the id is free again
                gone = rng.choice(sorted(owner))
                del owner[gone]
                free.insert(0, gone)
    finally:
        worker.shutdown()
