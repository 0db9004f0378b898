"""The LMCache adapter attacked: its promises under LMCache's own calls, at once, at close, and with bad input.

Several controller threads submit store, lookup-and-lock, unlock, load and
delete tasks for overlapping keys, while one thread plays LMCache's
collector (it polls the three eventfds and hands each result to the thread
that submitted its task, once). ``close()`` races each kind of task from
another thread; the pool's owner is killed mid-task; hostile keys, objects
and ``adapter_params`` come in. After each scenario the adapter's figures
are held against the store's (or the pool's) own.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache", reason="lmcache is not installed")
torch = pytest.importorskip("torch", reason="torch is not installed")

from lmcache.v1.platform import consume_fd  # noqa: E402

from aiokvtier import TierClosedError  # noqa: E402
from aiokvtier.integrations.lmcache import AiokvtierL2AdapterConfig  # noqa: E402

from .helpers import descriptors  # noqa: E402
from .test_integration_lmcache import (  # noqa: E402
    PoolOwner,
    adapter_threads,
    adapters,
    build,
    key,
    load,
    lookup,
    memory_obj,
    pool_owner,
    random_obj,
    same_bytes,
    store,
)

__all__ = ["adapters", "pool_owner"]  # fixtures

WAIT = 10.0  # seconds any one result may take before the test fails (a hang fails, it does not stall)


class Collector:
    """LMCache's controllers' side of the eventfds: one thread polls them and hands each result to the
    thread that submitted its task. A result is collected only when its eventfd said so, and once."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.lock = threading.Lock()  # taken around each submit too: a result never beats its registration
        self.pending: dict[tuple[str, int], concurrent.futures.Future[Any]] = {}
        self.delivered: set[tuple[str, int]] = set()
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.fds = {
            adapter.get_store_event_fd(): "store",
            adapter.get_lookup_and_lock_event_fd(): "lookup",
            adapter.get_load_event_fd(): "load",
        }
        self.thread = threading.Thread(target=self._run, name="lmcache-collector", daemon=True)
        self.thread.start()

    def submit(self, kind: str, keys: list[Any], objs: list[Any] | None = None) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self.lock:
            if kind == "store":
                tid = self.adapter.submit_store_task(keys, objs)
            elif kind == "lookup":
                tid = self.adapter.submit_lookup_and_lock_task(keys, {})
            else:
                tid = self.adapter.submit_load_task(keys, objs)
            if (kind, tid) in self.pending or (kind, tid) in self.delivered:
                self.errors.append(f"{kind} task id {tid} given twice")
            self.pending[(kind, tid)] = future
        return future

    def _run(self) -> None:
        poll = select.poll()
        for fd in self.fds:
            poll.register(fd, select.POLLIN)
        while not self.stop.is_set():
            for fd, _ in poll.poll(20):
                consume_fd(fd)
                with self.lock:
                    self._collect(self.fds[fd])

    def _collect(self, kind: str) -> None:
        if kind == "store":
            for tid, result in self.adapter.pop_completed_store_tasks().items():
                self._deliver(kind, tid, result)
            return
        query = self.adapter.query_lookup_and_lock_result if kind == "lookup" else self.adapter.query_load_result
        for k, tid in [p for p in self.pending if p[0] == kind]:
            result = query(tid)
            if result is not None:
                self._deliver(k, tid, result)

    def _deliver(self, kind: str, tid: int, result: Any) -> None:
        future = self.pending.pop((kind, tid), None)
        if future is None:
            self.errors.append(f"{kind} task {tid}: a result never asked for, or a second one")
            return
        self.delivered.add((kind, tid))
        future.set_result(result)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(WAIT)
        assert not self.thread.is_alive()
        # Each result once: asked again, none comes back.
        for kind, tid in self.delivered:
            if kind == "lookup":
                assert self.adapter.query_lookup_and_lock_result(tid) is None
            elif kind == "load":
                assert self.adapter.query_load_result(tid) is None
        assert self.adapter.pop_completed_store_tasks() == {}
        assert not self.errors, self.errors


def bits(bitmap: Any, n: int) -> list[bool]:
    return [bitmap.test(i) for i in range(n)]


def run_threads(targets: list[Callable[[], None]], within: float = 60.0) -> None:
    """Run each target on its own thread; the first failure is raised here, and a hang fails."""
    failures: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,), name=f"controller-{i}") for i, t in enumerate(targets)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + within
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a controller thread hung"
    if failures:
        raise failures[0]


def eventually(predicate: Callable[[], bool], within: float = WAIT) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, f"not true after {within} s"
        time.sleep(0.01)


class Tally:
    """Bytes stored and loaded, added to by several threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stored = self.loaded = 0

    def add(self, stored: int = 0, loaded: int = 0) -> None:
        with self.lock:
            self.stored += stored
            self.loaded += loaded


SIZE = 4096
CONTENT = {i: random_obj(SIZE, seed=1000 + i) for i in range(64)}  # one content per key: any store of it is it


# -- concurrency ----------------------------------------------------------------------------


def controller(
    adapter: Any, collector: Collector, seed: int, rounds: int, nkeys: int, locks: bool, tally: Tally
) -> Callable[[], None]:
    """One controller thread: store, lookup-and-lock, load what was found, unlock it, now and then delete."""

    def run() -> None:
        rng = random.Random(seed)
        for _ in range(rounds):
            ids = rng.sample(range(nkeys), 6)
            result = collector.submit("store", [key(i) for i in ids], [CONTENT[i] for i in ids]).result(WAIT)
            assert result.is_successful()
            tally.add(stored=result.bytes_transferred())
            ids = rng.sample(range(nkeys), 6)
            if rng.random() < 0.3:
                ids.append(ids[0])  # a key twice: two locks, two unlocks
            found = [
                i
                for i, hit in zip(
                    ids, bits(collector.submit("lookup", [key(i) for i in ids]).result(WAIT), len(ids)), strict=True
                )
                if hit
            ]
            distinct = list(dict.fromkeys(found))
            outs = [memory_obj(torch.zeros(SIZE, dtype=torch.uint8)) for _ in distinct]
            loaded = bits(collector.submit("load", [key(i) for i in distinct], outs).result(WAIT), len(distinct))
            if locks:  # locked: never evicted, never deleted, so loaded bit-exact
                assert all(loaded), f"a locked block was not loaded: {dict(zip(distinct, loaded, strict=True))}"
            for i, out, hit in zip(distinct, outs, loaded, strict=True):
                if hit:
                    assert same_bytes(out, CONTENT[i]), f"key {i} loaded other bytes"
                    tally.add(loaded=SIZE)
                else:
                    assert not out.raw_tensor.any(), f"a miss of key {i} wrote into its object"
            if locks and rng.random() < 0.3:
                # Another thread's delete of a key this one holds: it stays.
                adapter.delete([key(i) for i in distinct[:1]])
                if distinct:
                    assert lookup_held(collector, key(distinct[0]))
            adapter.submit_unlock([key(i) for i in found])
            if rng.random() < 0.3:
                adapter.delete([key(rng.randrange(nkeys))])

    return run


def lookup_held(collector: Collector, k: Any) -> bool:
    """A lookup of one key that gives its lock back at once."""
    hit = collector.submit("lookup", [k]).result(WAIT).test(0)
    if hit:
        collector.adapter.submit_unlock([k])
    return bool(hit)


def consistent_with_the_store(adapter: Any, tally: Tally) -> None:
    """The adapter's figures against its store's, once its tasks are done."""
    eventually(lambda: adapter.report_status()["locked_keys"] == 0)  # every lock given back
    adapter.check_invariants()
    stats = adapter.statistics()
    status = adapter.report_status()
    assert stats.in_flight == 0 and stats.blocks_pinned == 0
    assert stats.bytes_stored == tally.stored and stats.bytes_loaded == tally.loaded
    assert status["blocks"] == stats.blocks and status["bytes_stored"] == stats.bytes_stored
    # LMCache's usage, kept from what the listeners heard, is what the store holds.
    eventually(lambda: adapter.get_usage().total_bytes_used == adapter.statistics().blocks * SIZE)


@pytest.mark.timeout(120)
def test_controller_threads_at_once_on_a_tier(adapters: Callable[[dict[str, Any]], Any]) -> None:
    adapter = adapters({"quota": 32 * SIZE, "slot_size": SIZE})  # 32 blocks for 48 keys: evictions
    collector = Collector(adapter)
    tally = Tally()
    run_threads([controller(adapter, collector, seed, 60, 48, True, tally) for seed in range(4)])
    collector.close()
    consistent_with_the_store(adapter, tally)
    assert adapter.statistics().evictions > 0  # the rounds did fill the tier


@pytest.mark.timeout(120)
def test_controller_threads_at_once_over_a_shared_pool(
    pool_owner: PoolOwner, adapters: Callable[[dict[str, Any]], Any]
) -> None:
    pool = pool_owner.pool
    big = {i: random_obj(512 << 10, seed=2000 + i) for i in range(48)}  # 32 slots of 1 MiB for 48 keys
    servers = [adapters({"pool": pool.path}) for _ in range(2)]
    collectors = [Collector(a) for a in servers]

    def run(a: Any, c: Collector, seed: int) -> Callable[[], None]:
        def go() -> None:
            rng = random.Random(seed)
            for _ in range(25):
                ids = rng.sample(range(48), 4)
                assert c.submit("store", [key(i) for i in ids], [big[i] for i in ids]).result(WAIT).is_successful()
                ids = rng.sample(range(48), 4)
                found = [
                    i
                    for i, h in zip(ids, bits(c.submit("lookup", [key(i) for i in ids]).result(WAIT), 4), strict=True)
                    if h
                ]
                outs = [memory_obj(torch.zeros(512 << 10, dtype=torch.uint8)) for _ in found]
                loaded = bits(c.submit("load", [key(i) for i in found], outs).result(WAIT), len(found))
                for i, out, hit in zip(found, outs, loaded, strict=True):  # no locks in a pool: a miss may come
                    assert same_bytes(out, big[i]) if hit else not out.raw_tensor.any()
                a.submit_unlock([key(i) for i in found])
                if rng.random() < 0.3:
                    a.delete([key(rng.randrange(48))])

        return go

    run_threads([run(servers[n % 2], collectors[n % 2], n) for n in range(4)])
    for c in collectors:
        c.close()

    stats = pool_owner.statistics()
    assert stats.claims == 0 and stats.blocks_pinned == 0
    assert all(a.report_status()["blocks"] == stats.blocks for a in servers)


@pytest.mark.timeout(120)
def test_what_two_servers_heard_adds_up_to_the_pools_blocks(
    pool_owner: PoolOwner, adapters: Callable[[dict[str, Any]], Any]
) -> None:
    size = 512 << 10
    big = {i: random_obj(size, seed=2000 + i) for i in range(48)}  # 32 slots of 1 MiB for 48 keys
    servers = [adapters({"pool": pool_owner.pool.path}) for _ in range(2)]
    collectors = [Collector(a) for a in servers]

    def run(a: Any, c: Collector, seed: int) -> Callable[[], None]:
        def go() -> None:
            rng = random.Random(seed)
            for _ in range(40):
                ids = rng.sample(range(48), 4)
                assert c.submit("store", [key(i) for i in ids], [big[i] for i in ids]).result(WAIT).is_successful()
                hits = bits(c.submit("lookup", [key(i) for i in ids]).result(WAIT), 4)
                found = [i for i, hit in zip(ids, hits, strict=True) if hit]
                outs = [memory_obj(torch.zeros(size, dtype=torch.uint8)) for _ in found]
                c.submit("load", [key(i) for i in found], outs).result(WAIT)
                if rng.random() < 0.3:
                    a.delete([key(rng.randrange(48))])

        return go

    run_threads([run(servers[n % 2], collectors[n % 2], n) for n in range(4)])
    for c in collectors:
        c.close()

    # Every block was stored by one of the servers: what their listeners heard adds up to the pool's blocks.
    def heard() -> list[int]:
        return [a.get_usage().total_bytes_used // size for a in servers]

    try:
        eventually(lambda: sum(heard()) == pool_owner.statistics().blocks)
    except AssertionError:
        raise AssertionError(
            f"the servers heard {heard()} blocks; the pool holds {pool_owner.statistics().blocks}"
        ) from None


# -- close racing each kind of task ----------------------------------------------------------

KINDS = ("store", "lookup", "load", "unlock", "delete", "report_status")
DELAYS = (0.0, 0.0005, 0.002, 0.01)
MiB = 1 << 20


def submitting(adapter: Any, kind: str, keys: list[Any], srcs: list[Any], dsts: list[Any]) -> Callable[[], None]:
    """A controller thread that submits three tasks of ``kind``, as long as the adapter takes them."""

    def run() -> None:
        for _ in range(3):
            try:
                if kind == "store":
                    adapter.submit_store_task(keys[8:], srcs[8:])
                elif kind == "lookup":
                    adapter.submit_lookup_and_lock_task(keys, {})
                elif kind == "load":
                    adapter.submit_load_task(keys[:8], dsts)
                elif kind == "unlock":
                    adapter.submit_lookup_and_lock_task(keys[:8], {})
                    adapter.submit_unlock(keys[:8])
                elif kind == "delete":
                    adapter.delete(keys[:4])
                else:
                    adapter.report_status()
                    adapter.statistics()
            except TierClosedError:
                return

    return run


def close_during(adapter: Any, work: Callable[[], None], delay: float) -> None:
    """``work`` on one thread, ``adapter.close()`` on another ``delay`` s after it began: both must return."""
    worker = threading.Thread(target=work, name="controller")
    closer = threading.Thread(target=adapter.close, name="closer")
    worker.start()
    time.sleep(delay)
    closer.start()
    closer.join(WAIT)
    worker.join(WAIT)
    assert not closer.is_alive(), "close() hung"
    assert not worker.is_alive(), "a call racing close() hung"


def untouched_after_close(srcs: list[Any], dsts: list[Any], originals: list[bytes]) -> None:
    """LMCache reuses its buffers once close returned: nothing of the adapter reads or writes them after."""
    landed = [bytes(d.byte_array) for d in dsts]
    for s in srcs:
        s.raw_tensor.fill_(0xEE)
    time.sleep(0.02)
    assert [bytes(d.byte_array) for d in dsts] == landed, "a load wrote into LMCache's objects after close()"
    for d, original in zip(dsts, originals, strict=False):
        assert not d.raw_tensor.any() or bytes(d.byte_array) == original, "a load left half an object"


@pytest.fixture(scope="module")
def warmed() -> None:
    # The first build makes LMCache's factory import its built-in adapters, gRPC among them, whose fds stay.
    build({"quota": "1MiB", "slot_size": "64KiB"}).close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_close_racing_each_kind_of_task_on_a_tier(kind: str, warmed: None) -> None:
    threads, fds = adapter_threads(), descriptors()
    for delay in DELAYS:
        adapter = build({"quota": "32MiB", "slot_size": "1MiB"})
        keys = [key(i) for i in range(16)]
        srcs = [random_obj(MiB, seed=i) for i in range(16)]
        originals = [bytes(s.byte_array) for s in srcs]
        store(adapter, keys[:8], srcs[:8])
        dsts = [memory_obj(torch.zeros(MiB, dtype=torch.uint8)) for _ in range(8)]
        close_during(adapter, submitting(adapter, kind, keys, srcs, dsts), delay)
        untouched_after_close(srcs, dsts, originals)
        assert adapter_threads() == threads and descriptors() == fds, f"left behind after a close at {delay} s"
        assert adapter.statistics() is None and adapter.report_status()["closed"] is True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_close_racing_each_kind_of_task_over_a_pool(kind: str, pool_owner: PoolOwner, warmed: None) -> None:
    threads = adapter_threads()
    keys = [key(i) for i in range(16)]
    for delay in DELAYS:
        adapter = build({"pool": pool_owner.pool.path})
        srcs = [random_obj(MiB, seed=i) for i in range(16)]
        originals = [bytes(s.byte_array) for s in srcs]
        store(adapter, keys[:8], srcs[:8])
        dsts = [memory_obj(torch.zeros(MiB, dtype=torch.uint8)) for _ in range(8)]
        close_during(adapter, submitting(adapter, kind, keys, srcs, dsts), delay)
        untouched_after_close(srcs, dsts, originals)
        assert adapter_threads() == threads
        stats = pool_owner.statistics()
        assert stats.claims == 0 and stats.blocks_pinned == 0 and stats.slots_attached == 0
        assert stats.tier.slots_allocated == stats.blocks
        # What the pool shows was copied whole before close returned (the sources were overwritten since).
        reader = build({"pool": pool_owner.pool.path})
        try:
            outs = [memory_obj(torch.zeros(MiB, dtype=torch.uint8)) for _ in keys]
            for i, hit in enumerate(load(reader, keys, outs)):
                assert not hit or bytes(outs[i].byte_array) == originals[i], f"key {i}: bytes read after close"
            reader.delete(keys)
        finally:
            reader.close()


def test_a_second_close_from_another_thread_returns_once_the_first_is_done(warmed: None) -> None:
    for delay in DELAYS:
        adapter = build({"quota": "32MiB", "slot_size": "1MiB"})
        srcs = [random_obj(MiB, seed=i) for i in range(24)]
        adapter.submit_store_task([key(i) for i in range(24)], srcs)
        first = threading.Thread(target=adapter.close)
        first.start()
        time.sleep(delay)
        adapter.close()  # idempotent: and, like the first, it returns once nothing reads LMCache's objects
        assert adapter_threads() == 0, f"the second close() returned while the first was closing ({delay} s)"
        first.join(WAIT)
        assert not first.is_alive()


def test_calls_after_close(warmed: None) -> None:
    adapter = build({"quota": "1MiB", "slot_size": "64KiB"})
    store(adapter, [key(0)], [random_obj(4096)])
    tid = adapter.submit_lookup_and_lock_task([key(0)], {})
    adapter.close()
    adapter.close()
    obj = random_obj(4096)
    for submit in (
        lambda: adapter.submit_store_task([key(1)], [obj]),
        lambda: adapter.submit_lookup_and_lock_task([key(0)], {}),
        lambda: adapter.submit_load_task([key(0)], [obj]),
    ):
        with pytest.raises(TierClosedError, match="closed"):
            submit()
    adapter.submit_unlock([key(0)])  # LMCache may still unlock: nothing happens
    adapter.delete([key(0)])
    assert adapter.pop_completed_store_tasks() == {}
    assert adapter.query_load_result(0) is None
    adapter.query_lookup_and_lock_result(tid)  # answered before the close, or never: either way no hang
    assert adapter.report_status() == {"is_healthy": False, "type": "AiokvtierL2Adapter", "closed": True}
    assert adapter.statistics() is None
    with pytest.raises(TierClosedError):
        adapter.check_invariants()
    assert adapter_threads() == 0


# -- the pool's owner killed --------------------------------------------------------------------


class ServedPool:
    """``aiokvtier pool`` in a process of its own, which a test may SIGKILL and start again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.proc = self.start()

    def start(self) -> subprocess.Popen[str]:
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
        cmd = [sys.executable, "-m", "aiokvtier", "pool", "--quota", "32MiB", "--slot-size", "1MiB"]
        proc = subprocess.Popen(
            [*cmd, "--fill-threads", "1", "--socket", str(self.path)], stdout=subprocess.PIPE, text=True, env=env
        )
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready and '"serving"' in proc.stdout.readline(), "the pool did not start"
        return proc

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(WAIT)

    def restart(self) -> None:
        self.kill()
        self.proc = self.start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServedPool]:
    pool = ServedPool(tmp_path / "pool.sock")
    yield pool
    pool.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [0.0, 0.003])
@pytest.mark.parametrize("kind", ["store", "load"])
def test_the_pool_owner_killed_mid_task(kind: str, delay: float, served: ServedPool, warmed: None) -> None:
    adapter = build({"pool": str(served.path)})
    try:
        keys = [key(i) for i in range(16)]
        srcs = [random_obj(MiB, seed=i) for i in range(16)]
        store(adapter, keys[:8], srcs[:8])
        collector = Collector(adapter)
        if kind == "store":
            futures = [collector.submit("store", keys[8:], srcs[8:]) for _ in range(3)]
        else:
            dsts = [[memory_obj(torch.zeros(MiB, dtype=torch.uint8)) for _ in range(8)] for _ in range(3)]
            futures = [collector.submit("load", keys[:8], d) for d in dsts]
        time.sleep(delay)
        served.kill()
        results = [f.result(WAIT) for f in futures]  # each task ends: done, failed or missed, never hung
        if kind == "load":
            for bitmap, d in zip(results, dsts, strict=True):
                for i, hit in enumerate(bits(bitmap, 8)):
                    assert same_bytes(d[i], srcs[i]) if hit else True
        # From now on: stores fail, lookups and loads miss, at once.
        assert not collector.submit("store", keys[:1], srcs[:1]).result(WAIT).is_successful()
        out = memory_obj(torch.zeros(MiB, dtype=torch.uint8))
        assert bits(collector.submit("load", keys[:1], [out]).result(WAIT), 1) == [False]
        collector.submit("lookup", keys[:1]).result(WAIT)
        collector.close()
        # LMCache's status page and its L2 eviction thread call these: an answer, not an exception.
        status = adapter.report_status()
        assert status["is_healthy"] is False and "went away" in status["error"], status
        adapter.delete(keys[:1])
        # A new pool at the same path: the adapter says why it does not use it; a new adapter does.
        served.proc = served.start()
        status = adapter.report_status()
        assert status["is_healthy"] is False and "restart the server" in status["error"], status
        fresh = build({"pool": str(served.path)})
        try:
            assert store(fresh, keys[:1], srcs[:1]).is_successful()
        finally:
            fresh.close()
    finally:
        adapter.close()
    assert adapter_threads() == 0


# -- hostile input ------------------------------------------------------------------------------


def test_keys_of_the_wrong_type_fail_their_task_and_nothing_else(adapters: Callable[[dict[str, Any]], Any]) -> None:
    adapter = adapters({"quota": "1MiB", "slot_size": "64KiB"})
    obj = random_obj(4096)
    store(adapter, [key(0)], [obj])
    for bad in ("a string", None, 7, b"bytes"):
        assert not store(adapter, [key(1), bad], [obj, obj]).is_successful()
        assert lookup(adapter, [key(0), bad]) == [False, False]  # the task failed whole: nothing locked
        out = memory_obj(torch.zeros(4096, dtype=torch.uint8))
        assert load(adapter, [key(0), bad], [out, random_obj(4096)]) == [False, False]
        assert not out.raw_tensor.any()
    assert lookup(adapter, [key(0), key(0)]) == [True, True]  # two locks
    adapter.submit_unlock([key(0), "a string", key(0)])  # LMCache never retries an unlock: both go
    adapter.check_invariants()
    assert adapter.report_status()["locked_keys"] == 0
    assert lookup(adapter, [key(1)]) == [False]  # the failed store stored nothing
    adapter.check_invariants()


def test_duplicate_and_empty_key_lists(adapters: Callable[[dict[str, Any]], Any]) -> None:
    adapter = adapters({"quota": "1MiB", "slot_size": "64KiB"})
    a, b = random_obj(4096, seed=1), random_obj(4096, seed=2)
    result = store(adapter, [key(0), key(0)], [a, b])  # the first object wins, once
    assert result.is_successful() and result.bytes_transferred() == 4096
    assert adapter.get_usage().total_bytes_used == 4096
    outs = [memory_obj(torch.zeros(4096, dtype=torch.uint8)) for _ in range(2)]
    assert load(adapter, [key(0), key(0)], outs) == [True, True]
    assert same_bytes(outs[0], a) and same_bytes(outs[1], a)
    assert lookup(adapter, [key(0), key(0)]) == [True, True]  # two locks
    adapter.submit_unlock([key(0)])
    assert adapter.report_status()["locked_keys"] == 1
    adapter.submit_unlock([key(0)])
    assert adapter.report_status()["locked_keys"] == 0
    assert store(adapter, [], []).is_successful()
    assert lookup(adapter, []) == [] and load(adapter, [], []) == []
    adapter.submit_unlock([])
    adapter.delete([])
    adapter.check_invariants()
    stats = adapter.statistics()
    assert stats.blocks == 1 and stats.bytes_stored == 4096 and stats.bytes_loaded == 8192


def test_memory_objects_of_the_wrong_size_dtype_or_count(adapters: Callable[[dict[str, Any]], Any]) -> None:
    adapter = adapters({"quota": "1MiB", "slot_size": "64KiB"})
    obj = random_obj(4096, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="1 keys but 2 memory objects"):
        adapter.submit_store_task([key(0)], [obj, obj])
    with pytest.raises(ValueError, match="2 keys but 1 memory objects"):
        adapter.submit_load_task([key(0), key(1)], [obj])
    empty = memory_obj(torch.zeros(0, dtype=torch.uint8))
    result = store(adapter, [key(0), key(1)], [obj, empty])  # an empty object is not stored
    assert result.bytes_transferred() == 4096 and lookup(adapter, [key(0), key(1)]) == [True, False]
    adapter.submit_unlock([key(0)])
    # Blocks are bytes: another dtype or shape of the same size loads them bit-exact; another size misses.
    as_floats = memory_obj(torch.zeros(1024, dtype=torch.float32))
    as_matrix = memory_obj(torch.zeros((64, 32), dtype=torch.float16))
    longer, shorter = memory_obj(torch.zeros(8192, dtype=torch.uint8)), memory_obj(torch.zeros(2048, dtype=torch.uint8))
    assert load(adapter, [key(0)] * 4, [as_floats, as_matrix, longer, shorter]) == [True, True, False, False]
    assert same_bytes(as_floats, obj) and same_bytes(as_matrix, obj)
    assert not longer.raw_tensor.any() and not shorter.raw_tensor.any()
    assert not store(adapter, [key(2)], ["not a memory object"]).is_successful()
    assert load(adapter, [key(0)], [None]) == [False]
    adapter.check_invariants()
    stats = adapter.statistics()
    assert stats.blocks == 1 and stats.bytes_loaded == 8192 and adapter.get_usage().total_bytes_used == 4096


# -- adapter_params --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "names"),
    [
        ({"quota": 1.5}, "quota"),
        ({"quota": -1}, "quota"),
        ({"quota": "64 parsecs"}, "quota"),
        ({"quota": True}, "quota"),
        ({"quota": None}, "quota"),
        ({"quota": "1MiB", "slot_size": "2MiB"}, "slot_size"),
        ({"quota": "1MiB", "slot_size": [1]}, "slot_size"),
        ({"quota": "1MiB", "fill_threads": "two"}, "fill_threads"),
        ({"quota": "1MiB", "Quota": "1MiB"}, "Quota"),
        ({"quota": "1MiB", "policy": ["lru"]}, "policy"),
        ({"quota": "1MiB", "policy": None}, "policy"),
        ({"pool": ""}, "pool"),
        ({"pool": ["/x.sock"]}, "pool"),
        ({"pool": "/x.sock", "policy": "lru"}, "policy"),
        ({"policy": "lru"}, "quota"),
    ],
)
def test_bad_adapter_params_name_the_field_and_open_nothing(params: dict[str, Any], names: str, warmed: None) -> None:
    threads, fds = adapter_threads(), descriptors()
    with pytest.raises(ValueError, match="aiokvtier L2 adapter") as info:
        build(params)
    assert names in str(info.value)
    assert adapter_threads() == threads and descriptors() == fds


@pytest.mark.parametrize("params", [["quota", "1MiB"], "quota=1MiB", None])
def test_adapter_params_that_are_no_object(params: Any) -> None:
    with pytest.raises(ValueError, match="adapter_params must be a JSON object"):
        AiokvtierL2AdapterConfig.from_dict(params)
