"""The hybrid-model (``*_v2``) calls under attack, with SGLang's own classes (skipped without SGLang):
SGLang's prefetch and backup threads at once, ``close()`` and a lost owner mid-call, hostile
transfers, and SGLang's file backend as the reference for more shapes of ``batch_exists_v2``."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheFile,
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
    )
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import _trailing_chain_groups
except ImportError:
    pytest.skip("sglang is not installed (pip install 'aiokvtier[sglang]')", allow_module_level=True)

from aiokvtier import TierClosedError
from aiokvtier.integrations.sglang import REATTACH_AFTER

from .sglang_instance import digests, fill_pages, make_host_pool, make_storage, storage_config
from .test_integration_sglang import (
    TIER,
    hybrid,
    keys_of,
    mamba_pool,
    owner_took_back,
    page_indices,
    pool_path,
    pool_statistics,
    sglang_threads,
    start_owner,
)

__all__ = ["pool_path"]  # the fixture, shared with the SGLang integration tests

JOIN = 120.0
"""Seconds a test waits for a thread it started: a hang fails the test."""


def join_all(threads: list[threading.Thread]) -> None:
    deadline = time.monotonic() + JOIN
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not [t.name for t in threads if t.is_alive()], "a call never returned"


def big_mamba_pool(slots: int) -> Any:
    """SGLang's Mamba host pool with 64 KiB of temporal state per page (large transfers)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(2, slots, 64, 128, dtype=torch.float32),
        conv=(torch.zeros(2, slots, 3, 16, dtype=torch.bfloat16),),
    )
    return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first")


def conv_only_pool(slots: int = 24) -> Any:
    """SGLang's Mamba host pool of a conv-only model (no SSM state): one span a page."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(2, slots, 0, 8, dtype=torch.float32),
        conv=(torch.zeros(2, slots, 3, 16, dtype=torch.bfloat16),),
    )
    return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first")


def transfer(name: Any, keys: list[str] | None, indices: Any = None, policy: Any = None) -> Any:
    if policy is None:
        return PoolTransfer(name=name, host_indices=indices, keys=keys)
    return PoolTransfer(name=name, host_indices=indices, keys=keys, hit_policy=policy)


def blocks_of(storage: Any) -> int:
    return int(storage.statistics().blocks)


# -- concurrency -------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["tier", "pool"])
def test_prefetch_and_backup_threads_mix_v1_and_v2_calls_bit_exact(where: str, request: pytest.FixtureRequest) -> None:
    """Backup threads store KV and state pages (``batch_set_v2``, ``batch_set_v1``) while prefetch threads
    ask (``batch_exists_v2``, ``batch_exists``) and load (``batch_get_v2``, ``batch_get_v1``), many rounds:
    every call returns, and every answer and byte is what was stored."""
    section = TIER if where == "tier" else {"pool": request.getfixturevalue("pool_path")}
    host, mamba = make_host_pool(), mamba_pool(slots=32)
    storage = hybrid(make_storage(host, section), host, mamba)
    errors: list[BaseException] = []
    rounds, pages = 8, 3

    def worker(n: int) -> None:
        try:
            kv_src = host.alloc(pages * host.page_size)
            kv_dst = host.alloc(pages * host.page_size)
            state_src, state_dst = torch.tensor([n * 2]), torch.tensor([n * 2 + 1])
            for r in range(rounds):
                keys = keys_of(f"{where}-t{n}-r{r}", pages)
                fill_pages(host, kv_src, seed=n * 100 + r)
                fill_pages(mamba, state_src, seed=n * 100 + r + 50)
                kv = transfer(PoolName.KV, keys, kv_src)
                if r % 2:  # the KV pages through v1, the state through v2
                    assert storage.batch_set_v1(keys, kv_src) == [True] * pages
                    got = storage.batch_set_v2([transfer(PoolName.MAMBA, keys[-1:], state_src)])
                    assert got == {PoolName.MAMBA: [True]}
                else:
                    got = storage.batch_set_v2([kv, transfer(PoolName.MAMBA, keys[-1:], state_src)])
                    assert got == {PoolName.KV: [True] * pages, PoolName.MAMBA: [True]}
                assert storage.batch_exists(keys) == pages
                hit = storage.batch_exists_v2(
                    keys, [transfer(PoolName.MAMBA, keys[-1:], policy=PoolHitPolicy.TRAILING_PAGES)]
                )
                assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (pages, [pages])
                loaded = storage.batch_get_v2(
                    [transfer(PoolName.KV, keys, kv_dst), transfer(PoolName.MAMBA, keys[-1:], state_dst)]
                )
                assert loaded == {PoolName.KV: [True] * pages, PoolName.MAMBA: [True]}
                assert digests(host, kv_dst) == digests(host, kv_src)
                assert digests(mamba, state_dst) == digests(mamba, state_src)
                assert storage.batch_get_v1(keys, kv_dst) == [True] * pages
                assert digests(host, kv_dst) == digests(host, kv_src)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,), name=f"sglang-{n}") for n in range(4)]
    try:
        for t in threads:
            t.start()
        join_all(threads)
        assert not errors, errors
        # Every round's pages are there, found by a fresh instance alike.
        other = hybrid(make_storage(host, section), host, mamba) if where == "pool" else storage
        try:
            for n in range(4):
                for r in range(rounds):
                    keys = keys_of(f"{where}-t{n}-r{r}", pages)
                    every = [transfer(PoolName.MAMBA, keys[-1:], policy=PoolHitPolicy.TRAILING_PAGES)]
                    assert other.batch_exists_v2(keys, every).kv_hit_pages == pages
        finally:
            if other is not storage:
                other.close()
    finally:
        storage.close()
    if where == "pool":
        stats = pool_statistics(section["pool"])
        assert stats.claims == 0 and stats.blocks_pinned == 0


# -- close and a lost owner mid-call -----------------------------------------------------------------


@pytest.mark.parametrize("op", ["batch_set_v2", "batch_get_v2"])
def test_close_during_large_v2_transfers_leaves_nothing_claimed_or_pinned(pool_path: str, op: str) -> None:
    """2,048 pages of 64 KiB of state (128 MiB) per call, from two threads: ``close()`` meanwhile makes each
    call return or raise ``TierClosedError`` as the v1 calls do, and the pool holds no claim or pin after."""
    mamba = big_mamba_pool(slots=2048)
    host = make_host_pool()
    interrupted = 0
    for attempt in range(4):
        keys = [keys_of(f"close{attempt}-{t}", 1024) for t in range(2)]
        indices = [torch.arange(0, 1024), torch.arange(1024, 2048)]
        if op == "batch_get_v2":
            writer = hybrid(make_storage(host, {"pool": pool_path}), host, mamba)
            try:
                for k, i in zip(keys, indices, strict=True):
                    assert writer.batch_set_v2([transfer(PoolName.MAMBA, k, i)]) == {PoolName.MAMBA: [True] * 1024}
            finally:
                writer.close()
        storage = hybrid(make_storage(host, {"pool": pool_path}), host, mamba)
        outcomes: list[Any] = []

        def run(storage: Any, keys: list[str], idx: Any, outcomes: list[Any] = outcomes) -> None:
            try:
                outcomes.append(getattr(storage, op)([transfer(PoolName.MAMBA, keys, idx)]))
            except Exception as exc:
                outcomes.append(exc)

        workers = [threading.Thread(target=run, args=(storage, k, i)) for k, i in zip(keys, indices, strict=True)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(w.is_alive() for w in workers):
            stats = pool_statistics(pool_path)
            if stats.claims or stats.blocks_pinned:
                break  # a copy is under way
        storage.close()
        join_all(workers)
        for outcome in outcomes:
            if isinstance(outcome, TierClosedError):
                interrupted += 1
                assert "interrupted by close()" in str(outcome) or "closed" in str(outcome)
            else:
                assert isinstance(outcome, dict), outcome
                assert list(outcome) == [PoolName.MAMBA] and len(outcome[PoolName.MAMBA]) == 1024
        with pytest.raises(TierClosedError, match="closed"):
            storage.batch_get_v2([transfer(PoolName.MAMBA, keys[0][:1], torch.arange(1))])
        assert sglang_threads() == []
        stats = owner_took_back(pool_path)
        assert stats.clients == 1 and stats.claims == 0 and stats.blocks_pinned == 0 and stats.slots_attached == 0
        if interrupted:
            break
    assert interrupted, "no close landed during a copy"


def test_an_owner_lost_mid_v2_calls_is_a_miss_then_the_new_pool_is_used(tmp_path: Path) -> None:
    path = str(tmp_path / "pool.sock")
    owner = start_owner(path)
    host, mamba = make_host_pool(), mamba_pool()
    storage = hybrid(make_storage(host, {"pool": path}), host, mamba)
    keys = keys_of("lost-v2", 4)
    kv_src, kv_dst = page_indices(host, [0, 1, 2, 3]), page_indices(host, [4, 5, 6, 7])
    fill_pages(host, kv_src, seed=21)
    fill_pages(mamba, torch.arange(4), seed=22)
    both = [transfer(PoolName.KV, keys, kv_src), transfer(PoolName.MAMBA, keys[-1:], torch.tensor([3]))]
    load = [transfer(PoolName.KV, keys, kv_dst), transfer(PoolName.MAMBA, keys[-1:], torch.tensor([9]))]
    trailing = [transfer(PoolName.MAMBA, keys[-1:], policy=PoolHitPolicy.TRAILING_PAGES)]
    stop = threading.Event()
    seen: list[Any] = []

    def calls() -> None:  # SGLang's threads keep calling while the owner goes away
        try:
            while not stop.is_set():
                seen.append(storage.batch_set_v2(both))
                seen.append(storage.batch_exists_v2(keys, trailing).kv_hit_pages)
                seen.append(storage.batch_get_v2(load))
        except BaseException as exc:
            seen.append(exc)

    worker = threading.Thread(target=calls)
    try:
        assert storage.batch_set_v2(both) == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True]}
        worker.start()
        time.sleep(0.2)
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10
        while storage.batch_exists_v2(keys, trailing).kv_hit_pages and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        join_all([worker])
        assert not [s for s in seen if isinstance(s, BaseException)], seen
        assert storage.batch_exists_v2(keys, trailing).kv_hit_pages == 0
        assert storage.batch_set_v2(both) == {PoolName.KV: [False] * 4, PoolName.MAMBA: [False]}
        assert storage.batch_get_v2(load) == {PoolName.KV: [False] * 4, PoolName.MAMBA: [False]}

        owner = start_owner(path)  # a restarted owner starts empty
        time.sleep(REATTACH_AFTER + 0.2)
        assert storage.batch_exists_v2(keys, trailing).kv_hit_pages == 0
        assert storage.batch_set_v2(both) == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True]}
        hit = storage.batch_exists_v2(keys, trailing)
        assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (4, [4])
        assert storage.batch_get_v2(load) == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True]}
        assert digests(host, kv_dst) == digests(host, kv_src)
        assert digests(mamba, torch.tensor([9])) == digests(mamba, torch.tensor([3]))
    finally:
        stop.set()
        if worker.is_alive():
            worker.join(JOIN)
        storage.close()
        assert owner.stdin is not None
        owner.stdin.close()
        owner.wait(timeout=30)
    assert sglang_threads() == []


# -- hostile transfers -------------------------------------------------------------------------------


def hostile_cases(host: Any, mamba: Any) -> dict[str, tuple[list[Any], type[Exception], str]]:
    """Transfers that must be refused: (the call's transfers after a good one, error, words in its message)."""
    ps = host.page_size
    k = keys_of("hostile", 2)
    m, kv = PoolName.MAMBA, PoolName.KV
    return {
        "indices None": ([transfer(m, k, None)], TypeError, "host_indices must be a torch.Tensor"),
        "indices a list": ([transfer(m, k, [0, 1])], TypeError, "host_indices must be a torch.Tensor"),
        "indices float": ([transfer(m, k, torch.tensor([0.0, 1.5]))], TypeError, "integer"),
        "indices bool": ([transfer(m, k, torch.tensor([True, False]))], TypeError, "integer"),
        "indices 2-D": ([transfer(m, k, torch.tensor([[0], [1]]))], ValueError, "1-D"),
        "kv indices 2-D": ([transfer(kv, k, torch.arange(2 * ps).reshape(2, ps))], ValueError, "1-D"),
        "indices negative": ([transfer(m, k, torch.tensor([-1, 0]))], ValueError, "outside"),
        "indices past the pool": ([transfer(m, k, torch.tensor([mamba.size, 0]))], ValueError, "outside"),
        "kv past the pool": ([transfer(kv, k, torch.arange(host.size - ps, host.size + ps))], ValueError, "outside"),
        "kv not page-aligned": ([transfer(kv, k, torch.arange(3, 3 + 2 * ps))], ValueError, "page"),
        "kv page not contiguous": (
            [transfer(kv, k, page_indices(host, [0, 1]).flip(0))],
            ValueError,
            "page",
        ),
        "keys a str": ([transfer(m, "ab", torch.arange(2))], TypeError, "list of str"),
        "keys not str": ([transfer(m, [1, 2], torch.arange(2))], TypeError, "list of str"),
        "kv keys not str": ([transfer(kv, [b"a", b"b"], page_indices(host, [0, 1]))], TypeError, "list of str"),
        "keys duplicated": ([transfer(m, [k[0], k[0]], torch.arange(2))], ValueError, "twice"),
        "one pool twice": (
            [transfer(m, k[:1], torch.arange(1)), transfer("mamba", k[1:], torch.arange(1, 2))],
            ValueError,
            "two transfers",
        ),
        "unregistered pool": ([transfer(PoolName.SWA, k, torch.arange(2))], ValueError, "never registered"),
    }


def test_hostile_transfers_are_refused_by_name_and_nothing_of_the_call_is_stored() -> None:
    """Each hostile transfer follows good ones of the KV pool and a second extra pool (in DSA's indexer
    place): the call raises, naming the problem, and stores none of them."""
    host, mamba = make_host_pool(), mamba_pool()
    storage = hybrid(make_storage(host, TIER), host, mamba)
    storage.register_mem_host_pool_v2(mamba_pool(), PoolName.INDEXER)
    failures = []
    try:
        fill_pages(host, page_indices(host, [0, 1]), seed=1)
        fill_pages(mamba, torch.arange(4), seed=2)
        for n, (name, (transfers, error, words)) in enumerate(hostile_cases(host, mamba).items()):
            good = [transfer(PoolName.INDEXER, keys_of(f"good{n}", 1), torch.arange(2, 3))]
            if all(t.name != PoolName.KV for t in transfers):
                good.append(transfer(PoolName.KV, keys_of(f"good{n}", 1), page_indices(host, [0])))
            for op in ("batch_set_v2", "batch_get_v2"):
                before = blocks_of(storage)
                try:
                    result = getattr(storage, op)([*good, *transfers])
                except error as exc:
                    if words not in str(exc):
                        failures.append(f"{name} ({op}): {type(exc).__name__}: {exc}")
                except Exception as exc:
                    failures.append(f"{name} ({op}): {type(exc).__name__}: {exc}")
                else:
                    failures.append(f"{name} ({op}): accepted, {result}")
                if blocks_of(storage) != before:
                    failures.append(f"{name} ({op}): {blocks_of(storage) - before} blocks stored")
    finally:
        storage.close()
    assert not failures, "\n".join(failures)


def test_pages_are_checked_against_the_pools_own_index_range_not_any_tensor_it_holds() -> None:
    """A conv-only model's Mamba pool has one span a page: an index far past the pool can land its span
    inside another tensor the pool holds (its free-slot list). Refused: that memmove would overwrite SGLang's
    allocator."""
    host, conv = make_host_pool(), conv_only_pool()
    storage = make_storage(host, TIER)
    storage.register_mem_host_pool_v2(conv, PoolName.MAMBA)
    try:
        (base,), (size,) = conv.get_page_buffer_meta(torch.arange(1))
        target = conv.free_slots
        index = -(-(target.data_ptr() - base) // size)  # the first page whose span starts in free_slots
        assert not 0 <= index < conv.size
        assert target.data_ptr() <= base + index * size
        assert base + (index + 1) * size <= target.data_ptr() + target.numel() * target.element_size()
        fill_pages(conv, torch.arange(1), seed=5)
        key = keys_of("conv", 1)
        assert storage.batch_set_v2([transfer(PoolName.MAMBA, key, torch.arange(1))]) == {PoolName.MAMBA: [True]}
        before = target.clone()
        with pytest.raises(ValueError, match="outside"):
            storage.batch_get_v2([transfer(PoolName.MAMBA, key, torch.tensor([index]))])
        assert torch.equal(target, before)
    finally:
        storage.close()


def test_a_transfer_with_no_keys_and_no_indices_moves_nothing_as_sglangs_file_backend() -> None:
    host, mamba = make_host_pool(), mamba_pool()
    storage = hybrid(make_storage(host, TIER), host, mamba)
    try:
        for keys in (None, []):
            empty = [transfer(PoolName.MAMBA, keys, None)]
            assert storage.batch_set_v2(empty) == {PoolName.MAMBA: []}
            assert storage.batch_get_v2(empty) == {PoolName.MAMBA: []}
        assert storage.batch_set_v2([]) == {} and storage.batch_get_v2(None) == {}
        assert blocks_of(storage) == 0
    finally:
        storage.close()


def test_pool_names_as_plain_strings_are_the_same_pools() -> None:
    host, mamba = make_host_pool(), mamba_pool()
    storage = hybrid(make_storage(host, TIER), host, mamba)
    try:
        keys = keys_of("named", 2)
        fill_pages(mamba, torch.arange(2), seed=8)
        assert storage.batch_set_v2([transfer("mamba", keys, torch.arange(2))]) == {"mamba": [True, True]}
        got = storage.batch_get_v2([transfer(PoolName.MAMBA, keys, torch.arange(4, 6))])
        assert got == {PoolName.MAMBA: [True, True]}
        assert digests(mamba, torch.arange(4, 6)) == digests(mamba, torch.arange(2))
    finally:
        storage.close()


# -- SGLang's file backend as the reference, more shapes ---------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_batch_exists_v2_answers_as_sglangs_file_backend_for_two_pools_and_any_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Two extra pools in one call (each ``ALL_PAGES`` or ``TRAILING_PAGES``, windows up to past the
    prefix), stored as SGLang's backup thread stores them (``_trailing_chain_groups`` with a prefix chain)."""
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    rng = random.Random(seed)
    host, mamba, indexer = make_host_pool(), mamba_pool(), mamba_pool()
    backends = [make_storage(host, TIER), HiCacheFile(storage_config(TIER))]
    for backend in backends:
        backend.register_mem_pool_host(host)
        backend.register_mem_host_pool_v2(host, PoolName.KV)
        backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        backend.register_mem_host_pool_v2(indexer, PoolName.INDEXER)
        backend.on_host_pools_registered()
    ours, reference = backends
    try:
        chain = keys_of(f"chain{seed}", 10)
        prefix, keys = chain[:2], chain[2:]  # the first two pages were stored by an earlier request
        fill_pages(host, page_indices(host, list(range(8))), seed=seed)
        fill_pages(mamba, torch.arange(8), seed=seed + 1)
        fill_pages(indexer, torch.arange(8), seed=seed + 2)
        kv_stored = rng.randrange(0, 9)
        stored = {n: sorted(rng.sample(range(8), rng.randrange(0, 9))) for n in (PoolName.MAMBA, PoolName.INDEXER)}
        for backend in backends:
            backups = []
            if kv_stored:
                kv = transfer(PoolName.KV, keys[:kv_stored], page_indices(host, list(range(kv_stored))))
                backups.append(kv)
            for name, pages in stored.items():
                if pages:
                    backups.append(transfer(name, [keys[i] for i in pages], torch.tensor(pages)))
            for extra_info, group in _trailing_chain_groups(prefix, keys, backups):
                results = backend.batch_set_v2(group, extra_info=extra_info)
                assert all(all(v) for v in results.values())
        for _ in range(12):
            asked = []
            for name in rng.sample([PoolName.MAMBA, PoolName.INDEXER], rng.randrange(1, 3)):
                policy = rng.choice([PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES])
                window = rng.randrange(0, 11)  # up to past the 8 pages of the prefix
                asked.append((name, policy, window))
            transfers = [transfer(n, chain[:w], policy=p) for n, p, w in asked]
            info = HiCacheStorageExtraInfo(prefix_keys=prefix)
            got, want = ours.batch_exists_v2(keys, transfers, info), reference.batch_exists_v2(keys, transfers, info)
            assert (got.kv_hit_pages, got.extra_pool_hit_pages, got.restorable_prefix_pages) == (
                want.kv_hit_pages,
                want.extra_pool_hit_pages,
                want.restorable_prefix_pages,
            ), (asked, kv_stored, stored)
    finally:
        ours.close()
        reference.clear()


def test_the_v1_calls_refuse_indices_that_are_not_whole_pages_of_integers() -> None:
    """The ``*_v1`` calls share the page check: float, bool, 2-D or unaligned indices are refused."""
    host = make_host_pool()
    storage = make_storage(host, TIER)
    ps = host.page_size
    try:
        cases = [
            (torch.arange(2 * ps, dtype=torch.float32), TypeError, "integer"),
            (torch.ones(2 * ps, dtype=torch.bool), TypeError, "integer"),
            (torch.arange(2 * ps).reshape(2, ps), ValueError, "1-D"),
            (torch.arange(3, 3 + 2 * ps), ValueError, "whole pages"),
        ]
        for indices, error, words in cases:
            for call in (storage.batch_set_v1, storage.batch_get_v1):
                with pytest.raises(error, match=words):
                    call(keys_of("v1", 2), indices)
        assert blocks_of(storage) == 0
    finally:
        storage.close()
