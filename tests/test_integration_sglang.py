"""aiokvtier.integrations.sglang: SGLang's HiCache storage, with SGLang's own classes (skipped without SGLang)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    from sglang.srt.observability.metrics_collector import StorageMetrics
except ImportError:
    pytest.skip("sglang is not installed (pip install 'aiokvtier[sglang]')", allow_module_level=True)

from aiokvtier import AttachedPool, ConfigError, PoolError, TierClosedError
from aiokvtier.integrations.sglang import REATTACH_AFTER, HiCacheAiokvtier

from .sglang_instance import digests, fill_pages, make_host_pool, make_storage, storage_config

ROOT = Path(__file__).resolve().parent.parent
TIER = {"tier": {"quota": "64MiB", "slot_size": "16KiB"}}
"""A process-local tier whose slots are half a span (page_first: 32 KiB): a span is two blocks."""


def keys_of(name: str, n: int) -> list[str]:
    return [f"{name}-{i:060d}" for i in range(n)]


def sglang_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "aiokvtier-sglang"]


@pytest.fixture
def pool_path(tmp_path: Path) -> Iterator[str]:
    """A pool owner process (64 KiB slots, 256 MiB)."""
    path = str(tmp_path / "pool.sock")
    owner = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "pool_owner.py"), "asyncio", path, "256MiB"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdout is not None and owner.stdin is not None
    assert json.loads(owner.stdout.readline())["event"] == "serving"
    try:
        yield path
    finally:
        owner.stdin.close()
        assert owner.wait(timeout=30) == 0


def pool_statistics(path: str) -> Any:
    async def read() -> Any:
        async with AttachedPool(path) as pool:
            return await pool.statistics()

    return asyncio.run(read())


# -- conformance -------------------------------------------------------------------------


def owner_took_back(pool_path: str, polls: int = 200) -> Any:
    """The pool's statistics once its owner saw every other connection end and took back what they held
    (polled every 20 ms, ``polls`` times at most: the owner notices on its own loop)."""
    for _ in range(polls):
        stats = pool_statistics(pool_path)
        if stats.clients == 1:
            break
        time.sleep(0.02)
    return stats


def test_sglang_creates_it_from_its_dynamic_backend_config() -> None:
    host = make_host_pool()
    storage = make_storage(host, TIER)
    try:
        assert type(storage) is HiCacheAiokvtier  # made by SGLang's factory, not a wrapper of it
        assert isinstance(storage, HiCacheStorage)
        assert not HiCacheAiokvtier.__abstractmethods__
        for name in ("batch_get_v1", "batch_set_v1", "batch_exists", "get", "set", "batch_get", "batch_set"):
            assert getattr(HiCacheAiokvtier, name) is not getattr(HiCacheStorage, name), name
        assert sglang_threads() == ["aiokvtier-sglang"]
    finally:
        storage.close()
    assert sglang_threads() == []
    storage.close()  # idempotent


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_v1_round_trip_is_bit_exact_through_the_host_pool(layout: str) -> None:
    host = make_host_pool(layout)
    storage = make_storage(host, TIER)
    try:
        keys = keys_of(layout, 8)
        src = host.alloc(8 * host.page_size)
        fill_pages(host, src, seed=7)
        assert storage.batch_set_v1(keys, src) == [True] * 8
        assert storage.batch_set_v1(keys[:2], src[: 2 * host.page_size]) == [True] * 2  # already present
        assert storage.batch_exists(keys) == 8
        assert storage.batch_exists([*keys, "missing"]) == 8
        assert storage.batch_exists(["missing", *keys]) == 0
        assert storage.exists(keys[3]) and not storage.exists("missing")

        dst = host.alloc(8 * host.page_size)
        assert storage.batch_get_v1(keys, dst) == [True] * 8
        assert digests(host, dst) == digests(host, src)

        # A missing page ends the prefix: it and the pages after it are not loaded.
        mixed = [*keys[:3], "missing", *keys[3:5]]
        dst2 = host.alloc(6 * host.page_size)
        assert storage.batch_get_v1(mixed, dst2) == [True, True, True, False, False, False]
        assert digests(host, dst2)[:3] == digests(host, src)[:3]
    finally:
        storage.close()


def test_slots_far_larger_than_the_spans_are_warned_of_naming_the_setting(caplog: pytest.LogCaptureFixture) -> None:
    host = make_host_pool()  # pages of two 32 KiB spans
    with caplog.at_level(logging.WARNING, logger="aiokvtier"):
        storage = make_storage(host, {"tier": {"quota": "64MiB", "slot_size": "1MiB"}})
        storage.close()
    warned = [r.getMessage() for r in caplog.records if "fill 3% of their 2 slots" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert 'the "tier" section\'s slot_size near the largest span (32768' in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="aiokvtier"):
        storage = make_storage(host, TIER)  # 16 KiB slots: every slot full
        storage.close()
    assert not [r for r in caplog.records if "fill" in r.getMessage()], caplog.text


def test_host_indices_given_as_a_strided_view_round_trip() -> None:
    host = make_host_pool()
    storage = make_storage(host, TIER)
    try:
        keys = keys_of("strided", 2)
        flat = torch.arange(2 * host.page_size, dtype=torch.int64)
        strided = torch.stack([flat, flat], dim=1)[:, 0]  # the same indices, every other element of a buffer
        assert not strided.is_contiguous()
        fill_pages(host, flat, seed=11)
        assert storage.batch_set_v1(keys, strided) == [True, True]
        dst = torch.arange(4 * host.page_size, 6 * host.page_size, dtype=torch.int64)
        assert storage.batch_get_v1(keys, torch.stack([dst, dst], dim=1)[:, 0]) == [True, True]
        assert digests(host, dst) == digests(host, flat)
    finally:
        storage.close()


@pytest.mark.parametrize("v1", [True, False])
def test_batch_exists_over_a_pool_answers_keys_of_any_length_and_text(pool_path: str, v1: bool) -> None:
    """Keys of one length are looked up as one array; keys of several lengths, with a newline or
    outside ASCII, one by one: the same answers (the same block keys) either way."""
    host = make_host_pool()
    storage = make_storage(host, {"pool": pool_path}, v1=v1)
    try:
        keys = ["a", "bb", "cc\n", "d\u00e9", "e" * 64, "f" * 64, "\u00e9" * 32]
        src = host.alloc(len(keys) * host.page_size)
        fill_pages(host, src, seed=3)
        if v1:
            assert storage.batch_set_v1(keys, src) == [True] * len(keys)
        else:
            pages = [host.get_data_page(int(src[i * host.page_size]), flat=True) for i in range(len(keys))]
            assert storage.batch_set(keys, pages)
        assert storage.batch_exists(keys) == len(keys)
        assert storage.batch_exists(keys[4:6]) == 2  # one length: one array
        assert storage.batch_exists(["e" * 64, "g" * 64, "f" * 64]) == 1
        assert storage.batch_exists(["\u00e9" * 32, "e" * 64]) == 2  # 64 bytes in UTF-8 each
        assert storage.batch_exists(["cc\n", "bb"]) == 2 and storage.batch_exists(["cc", "bb"]) == 0
        assert storage.batch_exists(["de", "a"]) == 0 and storage.exists("d\u00e9")
        with pytest.raises(TypeError, match="list of str"):
            storage.batch_exists(["a", b"bb"])
        with pytest.raises(TypeError, match="list of str"):
            storage.batch_exists("abc")
    finally:
        storage.close()


def test_sglangs_prefetch_and_backup_threads_call_at_once() -> None:
    """SGLang's backup thread stores while its prefetch threads look up and load: calls from several threads
    share the storage's one loop, each answered bit-exact."""
    host = make_host_pool()
    storage = make_storage(host, TIER)
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            keys = keys_of(f"thread{n}", 4)
            src = host.alloc(4 * host.page_size)
            fill_pages(host, src, seed=n)
            for _ in range(5):
                assert storage.batch_set_v1(keys, src) == [True] * 4
                assert storage.batch_exists(keys) == 4
                dst = host.alloc(4 * host.page_size)
                assert storage.batch_get_v1(keys, dst) == [True] * 4
                assert digests(host, dst) == digests(host, src)
                host.free(dst)
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert storage.statistics().blocks == 4 * 4 * 4
    finally:
        storage.close()


def test_flat_pages_and_addresses_round_trip() -> None:
    host = make_host_pool()
    storage = make_storage(host, TIER, v1=False)  # SGLang's generic path: flat page tensors
    try:
        keys = keys_of("flat", 4)
        src = host.alloc(4 * host.page_size)
        fill_pages(host, src, seed=3)
        pages = [host.get_data_page(int(src[i * host.page_size]), flat=True) for i in range(4)]
        assert storage.batch_set(keys, pages)
        assert storage.batch_exists(keys) == 4 and storage.exists(keys[0])
        targets = [host.get_dummy_flat_data_page() for _ in range(5)]
        got = storage.batch_get([*keys, "missing"], targets)
        assert got[4] is None
        for page, out in zip(pages, got[:4], strict=True):
            assert bytes(out.view(torch.uint8).numpy()) == bytes(page.contiguous().view(torch.uint8).numpy())
        assert storage.get("missing", host.get_dummy_flat_data_page()) is None
        assert storage.set("one", pages[0]) and storage.get("one", targets[0]) is targets[0]

        # The pointer form (address and size), as SGLang's Mooncake backend takes it.
        a = torch.arange(1000, dtype=torch.int32)
        b = torch.zeros(1000, dtype=torch.int32)
        assert storage.set("raw", target_location=a.data_ptr(), target_sizes=4000)
        assert storage.get("raw", target_location=b.data_ptr(), target_sizes=4000) is True
        assert torch.equal(a, b)
        assert storage.batch_get(["raw", "nope"], [b.data_ptr()] * 2, [4000, 4000]) == 1
    finally:
        storage.close()


def test_get_stats_reports_sglang_storage_metrics_without_waiting() -> None:
    host = make_host_pool()
    storage = make_storage(host, TIER)
    try:
        keys = keys_of("stats", 3)
        idx = host.alloc(3 * host.page_size)
        storage.batch_set_v1(keys, idx)
        storage.batch_get_v1(keys, idx)
        stats = storage.get_stats()
        assert isinstance(stats, StorageMetrics)
        assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
        assert len(stats.backup_bandwidth) == 1 and stats.backup_bandwidth[0] > 0
        assert storage.get_stats().backup_pgs == []  # drained, as SGLang's backends do
        own = storage.statistics()
        assert own.blocks == 3 * 4  # two spans of two blocks each per page
        assert own.bytes_stored == 3 * 2 * 32 * 1024
        storage.clear()  # a process-local tier is this instance's alone: every block goes
        assert storage.batch_exists(keys) == 0 and storage.statistics().blocks == 0
    finally:
        storage.close()


# -- one pool, two processes ---------------------------------------------------------------------


def test_a_page_one_process_set_is_found_and_loaded_bit_exact_by_another(pool_path: str) -> None:
    child = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "sglang_instance.py"), pool_path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert child.stdin is not None and child.stdout is not None

    def ask(command: dict[str, Any]) -> Any:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(json.dumps(command) + "\n")
        child.stdin.flush()
        return json.loads(child.stdout.readline())

    host = make_host_pool()
    storage = make_storage(host, {"pool": pool_path})
    try:
        assert json.loads(child.stdout.readline())["event"] == "ready"
        theirs = keys_of("child", 6)
        answer = ask({"op": "set", "keys": theirs, "seed": 11})
        assert answer["results"] == [True] * 6
        assert [storage.exists(k) for k in theirs] == [True] * 6
        assert storage.batch_exists(theirs) == 6
        dst = host.alloc(6 * host.page_size)
        assert storage.batch_get_v1(theirs, dst) == [True] * 6
        assert digests(host, dst) == answer["digests"]
        dst2 = host.alloc(4 * host.page_size)
        assert storage.batch_get_v1([*theirs[:2], "missing", theirs[2]], dst2) == [True, True, False, False]
        assert digests(host, dst2)[:2] == answer["digests"][:2]

        ours = keys_of("parent", 5)
        src = host.alloc(5 * host.page_size)
        fill_pages(host, src, seed=12)
        assert storage.batch_set_v1(ours, src) == [True] * 5
        answer = ask({"op": "get", "keys": ours})
        assert answer["exists"] == [True] * 5 and answer["prefix"] == 5 and answer["results"] == [True] * 5
        assert answer["digests"] == digests(host, src)
        assert storage.batch_exists(ours) == 5

        # Another TP rank's shard is other bytes: it never sees these pages.
        other = make_storage(host, {"pool": pool_path}, tp_rank=1, tp_size=2)
        try:
            assert other.batch_exists(ours) == 0
            other.clear()  # a shared pool's pages are not one instance's to drop
        finally:
            other.close()
        assert ask({"op": "close"}) == {"closed": True}
        assert child.wait(timeout=30) == 0
    finally:
        storage.close()
        if child.poll() is None:
            child.kill()
            child.wait()
    stats = pool_statistics(pool_path)
    assert stats.blocks == 11 * 2 and stats.claims == 0 and stats.blocks_pinned == 0
    assert stats.slots_attached == 0


def start_owner(path: str) -> subprocess.Popen[str]:
    owner = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "pool_owner.py"), "asyncio", path, "64MiB"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdout is not None
    assert json.loads(owner.stdout.readline())["event"] == "serving"
    return owner


def test_a_lost_pool_is_a_miss_until_its_owner_is_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = str(tmp_path / "pool.sock")
    owner = start_owner(path)
    host = make_host_pool()
    storage = make_storage(host, {"pool": path})
    try:
        keys = keys_of("lost", 3)
        src, dst = host.alloc(3 * host.page_size), host.alloc(3 * host.page_size)
        fill_pages(host, src, seed=5)
        assert storage.batch_set_v1(keys, src) == [True] * 3
        with caplog.at_level(logging.WARNING, logger="aiokvtier"):
            owner.kill()
            owner.wait()
            deadline = time.monotonic() + 10
            while storage.batch_exists(keys) and time.monotonic() < deadline:
                time.sleep(0.01)  # until this process has seen the connection end
            assert storage.batch_exists(keys) == 0
            assert storage.batch_set_v1(keys, src) == [False] * 3
            assert storage.batch_get_v1(keys, dst) == [False] * 3
        lost = [r for r in caplog.records if "L3 misses until a pool serves" in r.getMessage()]
        assert len(lost) == 1, [r.getMessage() for r in caplog.records]

        owner = start_owner(path)  # a restarted owner starts empty
        time.sleep(REATTACH_AFTER + 0.2)
        assert storage.batch_exists(keys) == 0
        assert storage.batch_set_v1(keys, src) == [True] * 3
        assert storage.batch_get_v1(keys, dst) == [True] * 3
        assert digests(host, dst) == digests(host, src)
    finally:
        storage.close()
        assert owner.stdin is not None
        owner.stdin.close()
        owner.wait(timeout=30)
    assert sglang_threads() == []


@pytest.mark.timeout(60)
def test_calls_on_the_storages_loop_thread_raise_instead_of_hanging(tmp_path: Path) -> None:
    path = str(tmp_path / "pool.sock")
    owner = start_owner(path)
    host = make_host_pool()
    storage = make_storage(host, {"pool": path})
    keys = keys_of("here", 2)
    answers: dict[str, Any] = {}

    class Calling(logging.Handler):
        """A handler of the lost pool's warning, logged on the storage's loop thread."""

        def emit(self, record: logging.LogRecord) -> None:
            if "L3 misses until a pool serves" not in record.getMessage():
                return
            answers["thread"] = threading.current_thread().name
            calls = (("statistics", storage.statistics), ("batch_exists", lambda: storage.batch_exists(keys)))
            for name, call in (*calls, ("close", storage.close)):
                try:
                    answers[name] = call()
                except Exception as exc:
                    answers[name] = exc

    handler = Calling(logging.WARNING)
    logger = logging.getLogger("aiokvtier")
    logger.addHandler(handler)
    try:
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10
        while "close" not in answers and time.monotonic() < deadline:
            storage.batch_exists(keys)  # a call that finds the connection gone
            time.sleep(0.01)
        assert answers.get("thread") == "aiokvtier-sglang"
        for name in ("statistics", "batch_exists", "close"):
            assert isinstance(answers[name], RuntimeError) and "its own loop's thread" in str(answers[name]), name
        assert not storage.closed and storage.batch_exists(keys) == 0  # the refused close closed nothing
    finally:
        logger.removeHandler(handler)
        storage.close()
    assert sglang_threads() == []


def test_dp_replicas_share_pages_and_so_do_mla_tp_ranks(pool_path: str) -> None:
    """Data-parallel replicas hold the same shards: they share. MLA's KV is the same on every TP rank:
    those share too. MHA's TP ranks hold different heads: they do not."""
    host = make_host_pool()
    made = {
        name: make_storage(host, {"pool": pool_path}, **kwargs)
        for name, kwargs in {
            "dp0": {"tp_rank": 0, "tp_size": 2},
            "dp1": {"tp_rank": 0, "tp_size": 2, "dp_rank": 1},
            "mha-rank1": {"tp_rank": 1, "tp_size": 2},
            "mla-rank0": {"tp_rank": 0, "tp_size": 2, "mla": True},
            "mla-rank1": {"tp_rank": 1, "tp_size": 2, "mla": True},
        }.items()
    }
    try:
        keys = keys_of("shared", 4)
        src, dst = host.alloc(4 * host.page_size), host.alloc(4 * host.page_size)
        fill_pages(host, src, seed=9)
        assert made["dp0"].batch_set_v1(keys, src) == [True] * 4
        assert made["dp1"].batch_get_v1(keys, dst) == [True] * 4
        assert digests(host, dst) == digests(host, src)
        assert made["mha-rank1"].batch_exists(keys) == 0
        assert made["mla-rank0"].batch_exists(keys) == 0  # MLA keys leave the TP rank out: not MHA's keys
        assert made["mla-rank0"].batch_set_v1(keys, src) == [True] * 4
        assert made["mla-rank1"].batch_exists(keys) == 4
    finally:
        for storage in made.values():
            storage.close()


# -- close, errors ---------------------------------------------------------------------------


def test_close_during_a_transfer_leaves_nothing_claimed(pool_path: str) -> None:
    # 2,048 pages of 64 KiB (128 MiB) per call: the copy lasts long enough to be caught in flight.
    host = make_host_pool(tokens=16384)
    interrupted = 0
    for attempt in range(4):
        storage = make_storage(host, {"pool": pool_path})
        keys = keys_of(f"close{attempt}", 2048)
        src = host.alloc(2048 * host.page_size)
        outcome: list[Any] = []

        def run(storage: Any = storage, keys: list[str] = keys, src: Any = src, outcome: list[Any] = outcome) -> None:
            try:
                outcome.append(storage.batch_set_v1(keys, src))
            except Exception as exc:
                outcome.append(exc)

        worker = threading.Thread(target=run)
        worker.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and pool_statistics(pool_path).claims == 0 and worker.is_alive():
            pass  # until the store has claimed its slots and is copying
        storage.close()
        worker.join()
        host.free(src)
        if isinstance(outcome[0], TierClosedError):
            interrupted += 1
            assert "interrupted by close()" in str(outcome[0])
        else:
            assert outcome[0] == [True] * 2048
        with pytest.raises(TierClosedError, match="closed"):
            storage.batch_exists(keys)
        assert sglang_threads() == []
        stats = owner_took_back(pool_path, 100)
        assert stats.clients == 1 and stats.claims == 0 and stats.blocks_pinned == 0 and stats.slots_attached == 0
        assert stats.tier.slots_allocated == stats.blocks
        if interrupted:
            break
    assert interrupted, "no close landed during a copy"


def test_close_while_threads_ask_batch_exists_unmaps_the_mirror_after_them(pool_path: str) -> None:
    """``batch_exists`` over a pool reads the mirror on SGLang's threads: a close meanwhile lets each
    lookup in flight finish on the mapping, then every call says closed, and no mapping is left."""

    def mappings() -> int:
        with open("/proc/self/maps") as maps:
            return sum("aiokvtier-pool-index" in line for line in maps)

    host = make_host_pool()
    before = mappings()
    storage = make_storage(host, {"pool": pool_path})
    keys = keys_of("busy", 64)
    src = host.alloc(64 * host.page_size)
    fill_pages(host, src, seed=9)
    assert storage.batch_set_v1(keys, src) == [True] * 64
    assert mappings() == before + 1
    outcomes: list[list[Any]] = [[] for _ in range(4)]
    started = threading.Barrier(5)

    def ask(seen: list[Any]) -> None:
        started.wait()
        while True:
            try:
                seen.append(storage.batch_exists(keys))
            except TierClosedError as exc:
                seen.append(exc)
                return

    threads = [threading.Thread(target=ask, args=(seen,)) for seen in outcomes]
    for thread in threads:
        thread.start()
    try:
        started.wait()
        while not all(seen for seen in outcomes):
            time.sleep(0.001)
    finally:
        storage.close()
        for thread in threads:
            thread.join()
    for seen in outcomes:
        assert set(seen[:-1]) == {64} and isinstance(seen[-1], TierClosedError)
    assert mappings() == before and sglang_threads() == []


def test_bad_config_is_a_clear_error_and_leaves_no_thread(tmp_path: Path) -> None:
    cases: list[tuple[dict[str, Any] | None, type[Exception], str]] = [
        ({}, ConfigError, '"aiokvtier"'),
        ({"pool": "/x", "tier": {}}, ConfigError, "exactly one"),
        ({"pool": "/x", "size": 1}, ConfigError, "unknown key"),
        ({"pool": ""}, ConfigError, "socket path"),
        ({"tier": {"quota": "lots"}}, ConfigError, "host tier config"),
        ({"tier": {"quota": "16MiB"}, "namespace": 3}, ConfigError, "namespace"),
        ({"pool": str(tmp_path / "none.sock")}, PoolError, "no pool at"),
    ]
    for section, error, words in cases:
        config = storage_config(section) if section else storage_config({})
        if section == {}:
            config = dataclasses.replace(config, extra_config={"backend_name": "aiokvtier"})
        with pytest.raises(error, match=words):
            HiCacheAiokvtier(config, {})
        assert sglang_threads() == []


def test_a_close_whose_store_fails_to_close_still_closes_the_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiokvtier import BlockStore

    storage = HiCacheAiokvtier(storage_config(TIER), {})
    real = BlockStore.aclose

    async def failing(self: BlockStore) -> None:
        await real(self)
        raise RuntimeError("the store's close failed")

    monkeypatch.setattr(BlockStore, "aclose", failing)
    with pytest.raises(RuntimeError, match="the store's close failed"):
        storage.close()
    assert "tier <HostTier [closed" in repr(storage)
    assert sglang_threads() == []


def test_bad_calls_are_refused_and_change_nothing() -> None:
    host = make_host_pool()
    config = storage_config(TIER)
    storage = HiCacheAiokvtier(config, {})
    try:
        with pytest.raises(RuntimeError, match="register_mem_pool_host"):
            storage.batch_set_v1(["a"], host.alloc(host.page_size))
        storage.register_mem_pool_host(host)
        with pytest.raises(ValueError, match="host indices"):
            storage.batch_set_v1(["a", "b"], host.alloc(host.page_size))
        far = torch.full((host.page_size,), host.size + 64, dtype=torch.int64)
        with pytest.raises(ValueError, match="outside the registered host pool"):
            storage.batch_get_v1(["a"], far)  # a memmove there would kill the process
        with pytest.raises(ValueError, match="outside the registered host pool"):
            storage.batch_set_v1(["a"], far - 2 * (host.size + 64))
        with pytest.raises(TypeError, match="list of str"):
            storage.batch_exists([b"a"])
        with pytest.raises(ValueError, match="CPU tensor"):
            storage.batch_set(["a"], [b"bytes"])
        assert storage.batch_exists(["a", "b"]) == 0
        assert storage.statistics().blocks == 0
    finally:
        storage.close()
    with pytest.raises(TypeError, match="HiCacheStorageConfig"):
        HiCacheAiokvtier({"extra_config": TIER})  # type: ignore[arg-type]


def test_an_extra_pool_without_a_zero_copy_layout_is_refused_by_name(caplog: pytest.LogCaptureFixture) -> None:
    import types

    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    host = make_host_pool()
    storage = make_storage(host, TIER)
    try:
        page = host.alloc(host.page_size)
        assert storage.batch_set_v1(["a"], page) == [True]
        opaque = types.SimpleNamespace(page_size=1, state=torch.zeros(16))  # no get_page_buffer_meta
        with caplog.at_level(logging.WARNING, logger="aiokvtier"):
            storage.register_mem_host_pool_v2(opaque, PoolName.MAMBA)
        assert "SGLang's mamba pool is not stored" in caplog.text
        mamba = [PoolTransfer(name=PoolName.MAMBA, host_indices=torch.arange(1), keys=["a"])]
        calls = {
            "batch_exists_v2": lambda: storage.batch_exists_v2(["a"], mamba),
            "batch_get_v2": lambda: storage.batch_get_v2(mamba),
            "batch_set_v2": lambda: storage.batch_set_v2(mamba),
        }
        for name, call in calls.items():
            with pytest.raises(NotImplementedError, match=rf"{name}: aiokvtier does not store SGLang's mamba pool"):
                call()
        assert storage.batch_exists(["a"]) == 1  # the KV pages are untouched
    finally:
        storage.close()


# -- hybrid models: an extra host pool through the v2 calls -------------------------------------------


def mamba_pool(slots: int = 24) -> Any:
    """SGLang's Mamba state host pool on the CPU (page-first: one state per page, two buffers)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(2, slots, 4, 8, dtype=torch.float32),
        conv=(torch.zeros(2, slots, 3, 16, dtype=torch.bfloat16),),
    )
    return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first")


def hybrid(storage: Any, host: Any, mamba: Any) -> Any:
    """Register the pools as SGLang's hybrid cache controller does (the anchor first, then every entry)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    storage.register_mem_pool_host(host)
    storage.register_mem_host_pool_v2(host, PoolName.KV)
    storage.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    storage.on_host_pools_registered()
    return storage


def page_indices(host: Any, pages: list[int]) -> torch.Tensor:
    """The host indices of whole pages (``page_size`` per page)."""
    size = int(host.page_size)
    return torch.tensor([p * size + i for p in pages for i in range(size)], dtype=torch.int64)


def test_a_mamba_pool_round_trips_bit_exact_through_the_v2_calls(pool_path: str) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    host, mamba = make_host_pool(), mamba_pool()
    storage = hybrid(make_storage(host, {"pool": pool_path}), host, mamba)
    other = hybrid(make_storage(host, {"pool": pool_path}), host, mamba)  # another instance over the pool
    try:
        keys = keys_of("hybrid", 6)
        kv_src, state_src = page_indices(host, list(range(6))), torch.arange(6, 12)
        fill_pages(host, kv_src, seed=3)
        fill_pages(mamba, state_src, seed=4)
        assert storage.batch_set_v1(keys, kv_src) == [True] * 6
        # Mamba state is stored for the pages that end a prefix SGLang offloaded: here pages 2 and 5.
        stored = storage.batch_set_v2(
            [PoolTransfer(name=PoolName.MAMBA, host_indices=state_src[[2, 5]], keys=[keys[2], keys[5]])]
        )
        assert stored == {PoolName.MAMBA: [True, True]}

        trailing = [PoolTransfer(name=PoolName.MAMBA, keys=keys[:1], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        hit = other.batch_exists_v2(keys, trailing)
        assert (hit.kv_hit_pages, hit.restorable_prefix_pages) == (6, [3, 6])
        assert hit.extra_pool_hit_pages == {PoolName.KV: 6, PoolName.MAMBA: 6}
        every = [PoolTransfer(name=PoolName.MAMBA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)]
        assert other.batch_exists_v2(keys, every).kv_hit_pages == 0  # page 0 has no state

        state_dst = torch.arange(12, 14)
        loaded = other.batch_get_v2(
            [PoolTransfer(name=PoolName.MAMBA, host_indices=state_dst, keys=[keys[2], keys[5]])]
        )
        assert loaded == {PoolName.MAMBA: [True, True]}
        assert digests(mamba, state_dst) == digests(mamba, state_src[[2, 5]])
        missing = other.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=state_dst, keys=keys[:2])])
        assert missing == {PoolName.MAMBA: [False, False]}
        # The KV pool's transfers are the v1 pages, under the same keys.
        kv_dst = page_indices(host, [8, 9])
        loaded = other.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=kv_dst, keys=keys[:2])])
        assert loaded == {PoolName.KV: [True, True]} and digests(host, kv_dst) == digests(host, kv_src)[:2]
    finally:
        storage.close()
        other.close()
    assert pool_statistics(pool_path).claims == 0


@pytest.mark.parametrize("seed", range(12))
def test_the_v2_calls_answer_as_sglangs_file_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """SGLang's own file backend (``HiCacheFile``) is the reference: the same stores, then the same
    ``batch_exists_v2`` queries (both hit policies, windows of 1 to 3 pages) and loads, answered alike."""
    import random

    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolHitPolicy, PoolName, PoolTransfer

    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    rng = random.Random(seed)
    host, mamba = make_host_pool(), mamba_pool()
    ours = hybrid(make_storage(host, TIER), host, mamba)
    reference = hybrid(HiCacheFile(storage_config(TIER)), host, mamba)
    try:
        keys = keys_of(f"chain{seed}", 8)
        fill_pages(host, page_indices(host, list(range(8))), seed=seed)
        fill_pages(mamba, torch.arange(8), seed=seed + 100)
        kv_stored = rng.randrange(0, 9)
        with_state = sorted(rng.sample(range(8), rng.randrange(0, 9)))
        for backend in (ours, reference):
            transfers = []
            if kv_stored:
                kv = page_indices(host, list(range(kv_stored)))
                transfers.append(PoolTransfer(name=PoolName.KV, host_indices=kv, keys=keys[:kv_stored]))
            if with_state:
                state = torch.tensor(with_state, dtype=torch.int64)
                transfers.append(
                    PoolTransfer(name=PoolName.MAMBA, host_indices=state, keys=[keys[i] for i in with_state])
                )
            assert all(all(v) for v in backend.batch_set_v2(transfers).values())
        for policy, window in [(PoolHitPolicy.ALL_PAGES, 8), *((PoolHitPolicy.TRAILING_PAGES, w) for w in (1, 2, 3))]:
            transfer = [PoolTransfer(name=PoolName.MAMBA, keys=keys[:window], hit_policy=policy)]
            got, want = ours.batch_exists_v2(keys, transfer), reference.batch_exists_v2(keys, transfer)
            assert (got.kv_hit_pages, got.extra_pool_hit_pages, got.restorable_prefix_pages) == (
                want.kv_hit_pages,
                want.extra_pool_hit_pages,
                want.restorable_prefix_pages,
            ), (policy, window, kv_stored, with_state)
        ask = [keys[i] for i in range(8)]
        state_dst = torch.arange(8, 16)
        got_states = ours.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=state_dst, keys=ask)])
        ours_bytes = digests(mamba, state_dst)
        want_states = reference.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=state_dst, keys=ask)])
        lead = want_states[PoolName.MAMBA].index(False) if False in want_states[PoolName.MAMBA] else 8
        # SGLang reads the leading run (count_pool_hits); that run and its bytes agree.
        assert got_states[PoolName.MAMBA][:lead] == [True] * lead and False not in got_states[PoolName.MAMBA][:lead]
        assert sum(got_states[PoolName.MAMBA]) == lead
        assert ours_bytes[:lead] == digests(mamba, torch.arange(lead))
    finally:
        ours.close()
        reference.clear()


def test_the_v2_calls_refuse_what_they_cannot_do_and_change_nothing(pool_path: str) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    host, mamba = make_host_pool(), mamba_pool()
    storage = hybrid(make_storage(host, {"pool": pool_path}), host, mamba)
    try:
        keys = keys_of("refused", 2)
        with pytest.raises(ValueError, match="the swa pool was never registered"):
            storage.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(2), keys=keys)])
        good = PoolTransfer(name=PoolName.KV, host_indices=page_indices(host, [0, 1]), keys=keys)
        bad = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.arange(3), keys=keys)
        with pytest.raises(ValueError, match="host indices"):
            storage.batch_set_v2([good, bad])  # every transfer is checked before any is copied
        outside = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([10_000, 10_001]), keys=keys)
        with pytest.raises((ValueError, IndexError)):
            storage.batch_set_v2([outside])
        groups = PoolTransfer(name=PoolName.MAMBA, keys=keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS)
        assert storage.batch_set_v1(keys, page_indices(host, [0, 1])) == [True, True]
        with pytest.raises(ValueError, match="not supported"):
            storage.batch_exists_v2(keys, [groups])
        trailing = PoolTransfer(name=PoolName.MAMBA, keys=keys[:1], hit_policy=PoolHitPolicy.TRAILING_PAGES)
        assert storage.batch_exists_v2(keys, [trailing]).kv_hit_pages == 0  # no state was stored
    finally:
        storage.close()
    stats = pool_statistics(pool_path)
    assert stats.claims == 0 and stats.blocks == 4  # the two KV pages only: 2 spans of 2 blocks each


def test_importing_aiokvtier_imports_neither_sglang_nor_torch() -> None:
    code = (
        "import sys, aiokvtier; aiokvtier.HostTier; aiokvtier.AttachedPool; aiokvtier.BlockStore\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'torch'))\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_sglang_extra_is_optional() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["sglang"] == ["sglang>=0.5.23"]
    assert not any("sglang" in r for name, reqs in extras.items() if name != "sglang" for r in reqs)


# -- SGLang's own backend tests, with this backend in place --------------------------------------


def test_sglangs_mooncake_store_tests_pass_with_this_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang ships unit tests for its Mooncake backend (``test_single_operation``, ``test_batch_operation``
    over a mock host pool, through ``set``/``get``/``exists`` with addresses and ``batch_*_v1``/
    ``batch_exists``). They run here with ``MooncakeStore`` replaced by this backend over a local tier."""
    from sglang.srt.mem_cache.storage.mooncake_store import test_mooncake_store as suite

    made: list[HiCacheAiokvtier] = []

    def backend(config: Any = None) -> HiCacheAiokvtier:
        extra = {"aiokvtier": {"tier": {"quota": "64MiB", "slot_size": "4KiB"}}}
        storage = HiCacheAiokvtier(dataclasses.replace(config, extra_config=extra), {})
        made.append(storage)
        return storage

    monkeypatch.setattr(suite, "MooncakeStore", backend)
    try:
        suite.test_single_operation()
        for mla, rank, size in ((False, 0, 1), (True, 0, 1), (False, 1, 4), (True, 3, 8)):
            suite.test_batch_operation(suite.make_hicache_storage_config(is_mla_model=mla, tp_rank=rank, tp_size=size))
    finally:
        for storage in made:
            storage.close()
    assert len(made) == 5


def test_a_storage_dropped_unclosed_is_closed_on_its_own_thread_without_waiting(
    pool_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The finalizer does not wait for the storage's loop (the collector may run it on a thread
    holding a lock that loop needs): it hands the close over, and the loop's thread ends after it."""
    import gc

    host = make_host_pool()
    storage = make_storage(host, {"pool": pool_path})
    keys = keys_of("dropped", 4)
    src = host.alloc(4 * host.page_size)
    assert storage.batch_set_v1(keys, src) == [True] * 4
    del storage
    gc.collect()
    assert "was not closed" in caplog.text
    deadline = time.monotonic() + 10
    while sglang_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sglang_threads() == []
    stats = owner_took_back(pool_path)
    assert stats.clients == 1 and stats.claims == 0 and stats.blocks_pinned == 0 and stats.slots_attached == 0
    host.free(src)
