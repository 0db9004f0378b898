"""aiokvtier as an L2 adapter of LMCache's multi-process server, built and driven by LMCache's own code.

Every adapter here is made the way the server makes it: its ``--l2-adapter``
JSON parsed by LMCache's argument parser, the adapter built by LMCache's
factory through its ``plugin`` type, and called as LMCache's controllers
call it (submit, wait for the eventfd, collect). The last test runs
LMCache's ``StorageManager`` (its store and prefetch controllers) over the
adapter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="lmcache is not installed")
torch = pytest.importorskip("torch", reason="torch is not installed")

from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec  # noqa: E402
from lmcache.v1.distributed.config import (  # noqa: E402
    EvictionConfig,
    L1ManagerConfig,
    L1MemoryManagerConfig,
    StorageManagerConfig,
)
from lmcache.v1.distributed.internal_api import L2AdapterListener  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import (  # noqa: E402
    L2AdaptersConfig,
    add_l2_adapters_args,
    get_type_name_for_config,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig  # noqa: E402
from lmcache.v1.distributed.storage_manager import StorageManager  # noqa: E402
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj  # noqa: E402
from lmcache.v1.platform import consume_fd  # noqa: E402

from aiokvtier import Pool, TierClosedError  # noqa: E402
from aiokvtier.integrations.lmcache import AiokvtierL2Adapter, AiokvtierL2AdapterConfig  # noqa: E402

SLOT = 64 << 10
MODULE = "aiokvtier.integrations.lmcache"


def spec(params: dict[str, Any]) -> str:
    return json.dumps(
        {"type": "plugin", "module_path": MODULE, "class_name": "AiokvtierL2Adapter", "adapter_params": params}
    )


def build(params: dict[str, Any]) -> Any:
    """As LMCache's server does: ``--l2-adapter JSON`` through its parser and its factory."""
    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    config = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", spec(params)]))
    (one,) = config.adapters
    return create_l2_adapter(one)


@pytest.fixture
def adapters() -> Iterator[Callable[[dict[str, Any]], Any]]:
    made: list[Any] = []

    def make(params: dict[str, Any]) -> Any:
        made.append(build(params))
        return made[-1]

    yield make
    for adapter in made:
        adapter.close()


def key(n: int, model: str = "m", rank: int = 0, group: int = 0, salt: str = "") -> Any:
    return ObjectKey(
        chunk_hash=n.to_bytes(32, "big"), model_name=model, kv_rank=rank, object_group_id=group, cache_salt=salt
    )


def memory_obj(t: Any) -> Any:
    meta = MemoryObjMetadata(
        shape=t.shape, dtype=t.dtype, address=t.data_ptr(), phy_size=t.nelement() * t.element_size(), ref_count=1
    )
    return TensorMemoryObj(raw_data=t, metadata=meta, parent_allocator=None)


def random_obj(nbytes: int, dtype: Any = None, seed: int = 0) -> Any:
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return memory_obj(raw if dtype is None else raw.view(dtype))


def same_bytes(a: Any, b: Any) -> bool:
    return bytes(a.byte_array) == bytes(b.byte_array)


def wait(fd: int) -> None:
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    assert poll.poll(10_000), "the adapter never signalled its eventfd"
    try:
        consume_fd(fd)
    except BlockingIOError:
        pass


def store(adapter: Any, keys: list[Any], objs: list[Any]) -> Any:
    tid = adapter.submit_store_task(keys, objs)
    done: dict[int, Any] = {}
    while tid not in done:
        wait(adapter.get_store_event_fd())
        done.update(adapter.pop_completed_store_tasks())
    return done[tid]


def lookup(adapter: Any, keys: list[Any]) -> list[bool]:
    tid = adapter.submit_lookup_and_lock_task(keys, {})
    while (bitmap := adapter.query_lookup_and_lock_result(tid)) is None:
        wait(adapter.get_lookup_and_lock_event_fd())
    return [bitmap.test(i) for i in range(len(keys))]


def load(adapter: Any, keys: list[Any], objs: list[Any]) -> list[bool]:
    tid = adapter.submit_load_task(keys, objs)
    while (bitmap := adapter.query_load_result(tid)) is None:
        wait(adapter.get_load_event_fd())
    return [bitmap.test(i) for i in range(len(keys))]


def adapter_threads() -> int:
    return sum(t.name == "aiokvtier-lmcache" for t in threading.enumerate())


class Listener(L2AdapterListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.stored: list[Any] = []
        self.deleted: list[Any] = []

    def on_l2_keys_stored(self, keys: list[Any], sizes: list[int]) -> None:
        self.stored += keys

    def on_l2_keys_accessed(self, keys: list[Any]) -> None:
        pass

    def on_l2_keys_deleted(self, keys: list[Any]) -> None:
        self.deleted += keys


# -- conformance with LMCache's classes -------------------------------------------------


def test_lmcache_builds_it_from_its_command_line(adapters: Callable[[dict[str, Any]], Any]) -> None:
    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    (config,) = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", spec({"quota": "1MiB"})])).adapters
    assert isinstance(config, PluginL2AdapterConfig) and get_type_name_for_config(config) == "plugin"
    adapter = adapters({"quota": "1MiB", "slot_size": "64KiB", "policy": "s3fifo"})
    assert isinstance(adapter, AiokvtierL2Adapter) and isinstance(adapter, L2AdapterInterface)
    fds = {adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(), adapter.get_load_event_fd()}
    assert len(fds) == 3
    assert adapter.supports_global_eviction and adapter.get_usage().total_capacity_bytes == 1 << 20
    assert adapter.report_status()["is_healthy"] is True
    assert "quota" in AiokvtierL2AdapterConfig.help()


def test_the_raw_dict_mode_of_lmcache_plugins_works_too() -> None:
    adapter = AiokvtierL2Adapter({"quota": "1MiB", "slot_size": SLOT})  # as the factory calls it without a config class
    try:
        obj = random_obj(1000)
        assert store(adapter, [key(1)], [obj]).bytes_transferred() == 1000
        out = memory_obj(torch.zeros(1000, dtype=torch.uint8))
        assert load(adapter, [key(1)], [out]) == [True] and same_bytes(obj, out)
    finally:
        adapter.close()


def test_memory_objects_round_trip_bit_exact(adapters: Callable[[dict[str, Any]], Any]) -> None:
    adapter = adapters({"quota": "4MiB", "slot_size": SLOT})
    listener = Listener()
    adapter.register_listener(listener)
    # The same chunk hash under another model, rank, object group or salt is another block.
    keys = [key(7), key(7, model="other"), key(7, rank=1), key(7, group=2), key(7, salt="user-1"), key(8)]
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.int8, None, torch.bfloat16]
    sizes = [SLOT, SLOT - 4096, 4096, 2, 1, SLOT]
    objs = [random_obj(n, dt, seed=i) for i, (n, dt) in enumerate(zip(sizes, dtypes, strict=True))]
    result = store(adapter, keys, objs)
    assert result.is_successful() and result.bytes_transferred() == sum(sizes)
    assert listener.stored == keys and adapter.get_usage().bytes_by_cache_salt == {"": sum(sizes) - 1, "user-1": 1}
    assert store(adapter, keys[:1], [objs[0]]).bytes_transferred() == 0  # already there: not copied again
    assert lookup(adapter, [*keys, key(9)]) == [True] * len(keys) + [False]
    adapter.submit_unlock(keys)
    outs = [memory_obj(torch.empty_like(o.raw_tensor)) for o in objs]
    assert load(adapter, keys, outs) == [True] * len(keys)
    assert all(same_bytes(a, b) for a, b in zip(objs, outs, strict=True))
    stats = adapter.statistics()
    assert stats.blocks == len(keys) and stats.bytes_loaded == sum(sizes)
    adapter.check_invariants()


def test_a_miss_or_a_wrong_size_loads_nothing_into_that_object(adapters: Callable[[dict[str, Any]], Any]) -> None:
    adapter = adapters({"quota": "1MiB", "slot_size": SLOT})
    objs = [random_obj(4096, seed=i) for i in range(2)]
    store(adapter, [key(0), key(1)], objs)
    outs = [memory_obj(torch.zeros(n, dtype=torch.uint8)) for n in (4096, 8192, 4096)]
    assert load(adapter, [key(0), key(1), key(2)], outs) == [True, False, False]
    assert same_bytes(objs[0], outs[0]) and not outs[1].raw_tensor.any() and not outs[2].raw_tensor.any()


def test_an_object_larger_than_a_slot_is_skipped_not_a_failed_task(
    adapters: Callable[[dict[str, Any]], Any], caplog: pytest.LogCaptureFixture
) -> None:
    adapter = adapters({"quota": "1MiB", "slot_size": SLOT})
    objs = [random_obj(SLOT), random_obj(SLOT + 4096), random_obj(4096)]
    with caplog.at_level(logging.WARNING, logger="aiokvtier"):
        result = store(adapter, [key(0), key(1), key(2)], objs)
        store(adapter, [key(3)], [random_obj(SLOT + 4096)])
    assert result.is_successful() and result.bytes_transferred() == SLOT + 4096
    assert lookup(adapter, [key(0), key(1), key(2)]) == [True, False, True]
    adapter.submit_unlock([key(0), key(2)])
    (warning,) = [r.getMessage() for r in caplog.records if "does not fit" in r.getMessage()]  # once
    assert f"a {SLOT + 4096}-byte object does not fit a {SLOT}-byte slot" in warning
    assert "set adapter_params' slot_size to at least" in warning


def test_delete_is_done_and_told_when_it_returns(adapters: Callable[[dict[str, Any]], Any]) -> None:
    adapter = adapters({"quota": "1MiB", "slot_size": SLOT})
    listener = Listener()
    adapter.register_listener(listener)
    store(adapter, [key(0), key(1)], [random_obj(SLOT), random_obj(4096)])
    adapter.delete([key(0), key(5), key(0)])  # as LMCache's L2 eviction calls it; unknown and repeated keys ignored
    assert listener.deleted == [key(0)] and adapter.get_usage().total_bytes_used == 4096
    assert lookup(adapter, [key(0), key(1)]) == [False, True]
    adapter.submit_unlock([key(1)])
    adapter.check_invariants()


def test_a_listener_that_raises_fails_no_task_and_stops_no_later_event(
    adapters: Callable[[dict[str, Any]], Any],
) -> None:
    class Raising(Listener):
        def on_l2_keys_stored(self, keys: list[Any], sizes: list[int]) -> None:
            raise RuntimeError("a listener's bug")

        def on_l2_keys_deleted(self, keys: list[Any]) -> None:
            raise RuntimeError("a listener's bug")

    adapter = adapters({"quota": 4 * SLOT, "slot_size": SLOT})  # four blocks
    listener = Listener()
    adapter.register_listener(listener)
    adapter.register_listener(Raising())
    objs = [random_obj(SLOT, seed=i) for i in range(4)]
    for round_ in range(3):  # each round evicts the one before
        keys = [key(4 * round_ + i) for i in range(4)]
        assert store(adapter, keys, objs).is_successful()
        assert listener.stored[-4:] == keys
        if round_:
            deadline = time.monotonic() + 10
            while len(listener.deleted) < 4 * round_ and time.monotonic() < deadline:
                time.sleep(0.01)
            assert sorted(listener.deleted, key=lambda k: k.chunk_hash) == [key(i) for i in range(4 * round_)]
    adapter.check_invariants()


def test_no_result_is_lost_while_lmcache_collects_them(adapters: Callable[[dict[str, Any]], Any]) -> None:
    adapter = adapters({"quota": "4MiB", "slot_size": 4096})
    obj = random_obj(4096)
    tids = {adapter.submit_store_task([key(i)], [obj]) for i in range(400)}
    got: dict[int, Any] = {}
    deadline = time.monotonic() + 20
    while not tids <= got.keys() and time.monotonic() < deadline:  # collects while the tasks finish
        got.update(adapter.pop_completed_store_tasks())
    assert tids <= got.keys() and all(got[t].bytes_transferred() == 4096 for t in tids)


# -- lookup-and-lock ---------------------------------------------------------------------


def test_a_locked_block_is_never_evicted_until_unlocked(adapters: Callable[[dict[str, Any]], Any]) -> None:
    adapter = adapters({"quota": 4 * SLOT, "slot_size": SLOT})  # four blocks
    listener = Listener()
    adapter.register_listener(listener)
    first = [key(i) for i in range(4)]
    store(adapter, first, [random_obj(SLOT, seed=i) for i in range(4)])
    assert lookup(adapter, first[:2]) == [True, True]  # locks blocks 0 and 1 (the least recently used)
    adapter.delete(first[:1])  # LMCache's own eviction leaves a locked block alone too
    later = [key(i) for i in range(4, 8)]
    result = store(adapter, later, [random_obj(SLOT, seed=i) for i in range(4, 8)])
    assert result.bytes_transferred() == 2 * SLOT  # room for two: blocks 2 and 3 went, 0 and 1 stayed
    adapter.check_invariants()
    assert lookup(adapter, first + later) == [True, True, False, False, True, True, False, False]
    assert set(listener.deleted) == set(first[2:])
    adapter.submit_unlock(first[:2] + later[:2])  # the second lookup's locks
    adapter.submit_unlock(first[:2])  # the first lookup's
    adapter.check_invariants()
    store(adapter, [key(i) for i in range(8, 12)], [random_obj(SLOT, seed=i) for i in range(8, 12)])
    assert lookup(adapter, first[:2]) == [False, False]  # unlocked: evicted like any other block
    assert adapter.get_usage().total_bytes_used == 4 * SLOT


def test_unlocking_what_was_never_locked_changes_nothing(adapters: Callable[[dict[str, Any]], Any]) -> None:
    adapter = adapters({"quota": 2 * SLOT, "slot_size": SLOT})
    store(adapter, [key(0)], [random_obj(SLOT)])
    adapter.submit_unlock([key(0), key(1)])
    lookup(adapter, [key(0)])
    adapter.submit_unlock([key(0), key(0)])  # one lock, two unlocks
    adapter.check_invariants()


class Calling(Listener):
    """A listener that calls the adapter back from where LMCache tells it: the adapter's loop thread."""

    def __init__(self, adapter: Any, calls: dict[str, Callable[[], Any]]) -> None:
        super().__init__()
        self.calls = calls
        self.answers: dict[str, Any] = {}
        self.thread = ""
        adapter.register_listener(self)

    def on_l2_keys_stored(self, keys: list[Any], sizes: list[int]) -> None:
        super().on_l2_keys_stored(keys, sizes)
        self.thread = threading.current_thread().name
        for name, call in self.calls.items():
            try:
                self.answers[name] = call()
            except Exception as exc:
                self.answers[name] = exc


LOOP_THREAD = "would wait for that loop forever"


@pytest.mark.timeout(60)
def test_a_listener_on_the_loop_thread_reads_and_deletes_without_waiting_for_itself(
    adapters: Callable[[dict[str, Any]], Any],
) -> None:
    adapter = adapters({"quota": "1MiB", "slot_size": SLOT})
    store(adapter, [key(0)], [random_obj(4096)])
    listener = Calling(
        adapter,
        {
            "statistics": adapter.statistics,
            "report_status": adapter.report_status,
            "check_invariants": adapter.check_invariants,
            "delete": lambda: adapter.delete([key(0)]),
            "close": adapter.close,
        },
    )
    assert store(adapter, [key(1)], [random_obj(4096, seed=1)]).is_successful()
    answers = listener.answers
    assert listener.thread == "aiokvtier-lmcache"
    assert answers["statistics"].blocks == 2 and answers["statistics"].stores == 2
    assert answers["report_status"]["is_healthy"] is True and answers["report_status"]["blocks"] == 2
    assert answers["check_invariants"] is None and answers["delete"] is None
    assert listener.deleted == [key(0)]  # done, and told, before delete() returned
    assert isinstance(answers["close"], RuntimeError) and LOOP_THREAD in str(answers["close"])
    assert lookup(adapter, [key(0), key(1)]) == [False, True]  # the refused close closed nothing
    adapter.submit_unlock([key(1)])
    adapter.check_invariants()
    assert adapter.statistics().blocks == 1


# -- close and cancellation ------------------------------------------------------------


def test_close_mid_transfer_returns_with_nothing_left() -> None:
    # The first build makes LMCache's factory import its built-in adapters, gRPC among them, whose fds stay.
    build({"quota": "1MiB", "slot_size": SLOT}).close()
    before = adapter_threads()
    fds_before = len(os.listdir("/proc/self/fd"))
    adapter = build({"quota": "64MiB", "slot_size": "1MiB"})
    objs = [random_obj(1 << 20, seed=i) for i in range(48)]
    store(adapter, [key(i) for i in range(16)], objs[:16])
    adapter.submit_store_task([key(i) for i in range(16, 48)], objs[16:])
    adapter.submit_lookup_and_lock_task([key(i) for i in range(16)], {})
    into = [memory_obj(torch.zeros(1 << 20, dtype=torch.uint8)) for _ in range(16)]
    adapter.submit_load_task([key(i) for i in range(16)], into)
    adapter.close()  # cancels the store and the load in flight, releases the locks, closes the tier
    after_close = [bytes(o.byte_array) for o in into]
    adapter.close()
    time.sleep(0.05)
    assert [bytes(o.byte_array) for o in into] == after_close  # nothing writes LMCache's objects after close
    assert all(not o.raw_tensor.any() or same_bytes(o, objs[i]) for i, o in enumerate(into))  # none half-written
    assert adapter_threads() == before
    assert not [t.name for t in threading.enumerate() if t.name.startswith("aiokvtier")]
    assert len(os.listdir("/proc/self/fd")) == fds_before
    with pytest.raises(TierClosedError, match="closed"):
        adapter.submit_store_task([key(0)], objs[:1])
    adapter.submit_unlock([key(0)])  # LMCache may still unlock after close: nothing happens
    assert adapter.report_status()["is_healthy"] is False and adapter.statistics() is None
    with pytest.raises(TierClosedError, match="closed"):
        adapter.check_invariants()


class PoolOwner:
    """A pool owned in this process, on its own loop (as ``aiokvtier pool`` would own it)."""

    def __init__(self, path: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="pool-owner")
        self.thread.start()
        self.pool = self.call(Pool.open({"quota": "32MiB", "slot_size": "1MiB"}, path))

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def statistics(self) -> Any:
        async def read() -> Any:
            return self.pool.statistics()

        return self.call(read())

    def close(self) -> None:
        try:
            self.call(self.pool.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.loop.close()


@pytest.fixture
def pool_owner(tmp_path: Path) -> Iterator[PoolOwner]:
    owner = PoolOwner(tmp_path / "pool.sock")
    yield owner
    owner.close()


def test_two_lmcache_servers_share_one_pool(pool_owner: PoolOwner, adapters: Callable[[dict[str, Any]], Any]) -> None:
    a = adapters({"pool": pool_owner.pool.path})
    b = adapters({"pool": pool_owner.pool.path})
    objs = [random_obj(1 << 20, dtype=torch.bfloat16, seed=i) for i in range(3)]
    keys = [key(i) for i in range(3)]
    assert store(a, keys, objs).bytes_transferred() == 3 << 20
    # A pool answers each chunk, also past a miss (LMCache's "full" prefetch uses those).
    assert lookup(b, [keys[0], keys[1], key(99), keys[2]]) == [True, True, False, True]
    assert lookup(b, [key(98), keys[2], key(99), keys[0]]) == [False, True, False, True]
    assert lookup(b, [*keys, key(0, rank=1), key(1), key(1, rank=1)]) == [True, True, True, False, True, False]
    outs = [memory_obj(torch.empty_like(o.raw_tensor)) for o in objs]
    assert load(b, keys, outs) == [True] * 3 and all(same_bytes(x, y) for x, y in zip(objs, outs, strict=True))
    assert b.report_status()["processes"] == 2


def test_an_object_larger_than_a_pools_slot_names_the_pools_slot_size(
    pool_owner: PoolOwner, adapters: Callable[[dict[str, Any]], Any], caplog: pytest.LogCaptureFixture
) -> None:
    # 'slot_size' is refused beside 'pool': the fix is the owner's --slot-size.
    adapter = adapters({"pool": pool_owner.pool.path})
    slot = pool_owner.pool.tier.slot_size
    with caplog.at_level(logging.WARNING, logger="aiokvtier"):
        result = store(adapter, [key(0), key(1)], [random_obj(slot + 4096), random_obj(4096)])
    assert result.is_successful() and result.bytes_transferred() == 4096
    assert lookup(adapter, [key(1), key(0)]) == [True, False]
    (warning,) = [r.getMessage() for r in caplog.records if "does not fit" in r.getMessage()]
    assert f"a {slot + 4096}-byte object does not fit a {slot}-byte slot" in warning
    assert "start the pool with a --slot-size of at least" in warning


def test_a_pool_block_of_another_size_is_a_miss_and_the_rest_load(
    pool_owner: PoolOwner, adapters: Callable[[dict[str, Any]], Any]
) -> None:
    adapter = adapters({"pool": pool_owner.pool.path})
    objs = [random_obj(4096, seed=0), random_obj(8192, seed=1), random_obj(4096, seed=2)]
    store(adapter, [key(0), key(1), key(2)], objs)
    outs = [memory_obj(torch.zeros(n, dtype=torch.uint8)) for n in (4096, 4096, 4096)]
    # key(1)'s block is longer than its object: a miss; the others load
    assert load(adapter, [key(0), key(1), key(2)], outs) == [True, False, True]
    assert same_bytes(objs[0], outs[0]) and not outs[1].raw_tensor.any() and same_bytes(objs[2], outs[2])
    longer = memory_obj(torch.zeros(8192, dtype=torch.uint8))
    assert load(adapter, [key(0)], [longer]) == [False]  # a block shorter than its object: a miss too


def test_close_mid_transfer_leaves_nothing_claimed_in_the_pool(
    pool_owner: PoolOwner, adapters: Callable[[dict[str, Any]], Any]
) -> None:
    objs = [random_obj(1 << 20, seed=i) for i in range(24)]
    for delay in (0.0, 0.002, 0.01):
        adapter = build({"pool": pool_owner.pool.path})
        store(adapter, [key(1000)], objs[:1])
        adapter.submit_store_task([key(i) for i in range(24)], objs)
        adapter.submit_load_task([key(1000)], [random_obj(1 << 20)])
        time.sleep(delay)
        adapter.close()
        stats = pool_owner.statistics()
        assert stats.claims == 0 and stats.blocks_pinned == 0 and stats.slots_attached == 0
        assert stats.tier.slots_allocated == stats.blocks  # no slot held but by a visible block
        b = adapters({"pool": pool_owner.pool.path})
        found = lookup(b, [key(i) for i in range(24)])
        outs = [memory_obj(torch.empty(1 << 20, dtype=torch.uint8)) for _ in range(24)]
        loaded = load(b, [key(i) for i in range(24)], outs)
        assert all(loaded[i] for i in range(24) if found[i])  # what is visible is whole
        assert all(same_bytes(objs[i], outs[i]) for i in range(24) if loaded[i])


@pytest.mark.timeout(60)
def test_a_listener_on_the_loop_thread_is_refused_what_a_pool_answers_later(
    pool_owner: PoolOwner, adapters: Callable[[dict[str, Any]], Any]
) -> None:
    adapter = adapters({"pool": pool_owner.pool.path})
    listener = Calling(
        adapter,
        {
            "report_status": adapter.report_status,
            "delete": lambda: adapter.delete([key(0)]),
            "statistics": adapter.statistics,
            "close": adapter.close,
        },
    )
    assert store(adapter, [key(0)], [random_obj(4096)]).is_successful()
    answers = listener.answers
    for name in ("report_status", "delete", "close"):
        assert isinstance(answers[name], RuntimeError) and f"{name}() was called" in str(answers[name]), name
        assert LOOP_THREAD in str(answers[name])
    assert answers["statistics"] is None  # a pool's adapter has no store figures: nothing to wait for
    assert lookup(adapter, [key(0)]) == [True] and listener.deleted == []  # nothing deleted, nothing closed
    assert adapter.report_status()["blocks"] == 1  # from another thread: answered


def test_report_status_in_flight_when_close_comes_is_cancelled_with_it(pool_owner: PoolOwner) -> None:
    adapter = build({"pool": pool_owner.pool.path})
    answers: list[Any] = []
    reporting = threading.Thread(target=lambda: answers.append(adapter.report_status()))
    pool_owner.loop.call_soon_threadsafe(time.sleep, 1.0)  # the owner answers nothing for a second
    reporting.start()
    time.sleep(0.2)  # the report waits for the owner's figures
    adapter.close()  # cancels it with the rest: nothing of the adapter runs on after close
    reporting.join(10)
    assert not reporting.is_alive(), "report_status never returned after close"
    assert answers == [{"is_healthy": False, "type": "AiokvtierL2Adapter", "closed": True}]
    assert adapter_threads() == 0


# -- configuration errors ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({}, "give 'quota'"),
        ({"quota": "lots"}, "invalid host tier config"),
        ({"quota": "1MiB", "slots": 4}, "slots"),
        ({"quota": "1MiB", "policy": "fifo"}, "'policy' must be one of lru, s3fifo"),
        ({"pool": "/x.sock", "quota": "1MiB"}, "with 'pool' the tier is the pool's; remove 'quota'"),
        ({"pool": 3}, "'pool' must be the pool's socket path"),
    ],
)
def test_a_bad_config_is_a_clear_error_and_opens_nothing(params: dict[str, Any], message: str) -> None:
    before = adapter_threads()
    with pytest.raises(ValueError, match="aiokvtier L2 adapter") as info:
        build(params)
    assert message in str(info.value)
    assert adapter_threads() == before


def test_a_pool_that_is_not_there_is_a_clear_error_and_leaves_no_thread(tmp_path: Path) -> None:
    from aiokvtier import PoolError

    before = adapter_threads()
    with pytest.raises(PoolError, match="no pool at"):
        build({"pool": str(tmp_path / "none.sock")})
    assert adapter_threads() == before


def test_no_eventfd_to_be_had_after_the_open_leaves_no_tier_thread_or_fd(monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    import aiokvtier.integrations.lmcache as module

    made: list[Any] = []
    real = module.create_event_notifier

    def notifier() -> Any:  # the process runs out of descriptors at the second eventfd
        if made:
            raise OSError(errno.EMFILE, "Too many open files")
        made.append(real())
        return made[-1]

    monkeypatch.setattr(module, "create_event_notifier", notifier)
    threads = [t.name for t in threading.enumerate() if t.name.startswith("aiokvtier")]
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="Too many open files"):
        AiokvtierL2Adapter({"quota": "4MiB", "slot_size": "64KiB"})
    assert [t.name for t in threading.enumerate() if t.name.startswith("aiokvtier")] == threads
    assert len(os.listdir("/proc/self/fd")) == fds


# -- LMCache's storage manager over the adapter ----------------------------------------------


def test_lmcache_storage_manager_stores_to_and_prefetches_from_aiokvtier() -> None:
    l2 = PluginL2AdapterConfig.from_dict(json.loads(spec({"quota": "16MiB", "slot_size": "256KiB"})))
    memory = L1MemoryManagerConfig(
        size_in_bytes=32 << 20, use_lazy=False, init_size_in_bytes=32 << 20, align_bytes=4096
    )
    config = StorageManagerConfig(
        l1_manager_config=L1ManagerConfig(memory_config=memory, write_ttl_seconds=600, read_ttl_seconds=300),
        eviction_config=EvictionConfig(eviction_policy="LRU"),
        l2_adapter_config=L2AdaptersConfig([l2]),
    )
    manager = StorageManager(config)
    try:
        ((_, adapter),) = manager.l2_adapters()
        assert isinstance(adapter, AiokvtierL2Adapter)
        layout = MemoryLayoutDesc(shapes=[torch.Size([100, 2, 512])], dtypes=[torch.bfloat16])
        keys = [ObjectKey(chunk_hash=i.to_bytes(4, "big"), model_name="m", kv_rank=0) for i in range(5)]
        written = manager.reserve_write(keys, layout)
        data = {}
        for k, obj in written.items():
            data[k] = torch.randn(100 * 2 * 512).to(torch.bfloat16)
            obj.tensor.view(-1).copy_(data[k])
        manager.finish_write(list(written))
        deadline = time.monotonic() + 10
        while adapter.get_usage().total_bytes_used < 5 * 204800 and time.monotonic() < deadline:
            time.sleep(0.01)  # the store controller copies L1 to L2 in the background
        assert manager.delete_l1_keys(keys) == (5, 0)  # gone from L1: only aiokvtier has them
        handle = manager.submit_prefetch_task(
            PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout)])
        )
        while (result := manager.query_prefetch_status(handle)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert result is not None and result.hit_cells[0].count_leading_ones() == 5
        with manager.read_prefetched_results(keys) as objs:
            assert objs is not None
            assert all(torch.equal(o.tensor.view(-1), data[k]) for k, o in zip(keys, objs, strict=True))
        manager.finish_read_prefetched(keys)
        adapter.check_invariants()
    finally:
        manager.close()


def test_import_aiokvtier_imports_neither_lmcache_nor_torch() -> None:
    code = (
        "import sys, aiokvtier; aiokvtier.BlockStore; aiokvtier.HostTier; aiokvtier.AttachedPool;"
        " print('lmcache' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_lmcache_is_an_optional_extra_that_the_tests_do_not_install() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert extras["lmcache"] == ["lmcache>=0.5.6"]
    assert not any("lmcache" in req for req in extras["test"])
