"""aiokvtier as an L2 adapter of LMCache's multi-process server (LMCache 0.5.6).

LMCache loads it by configuration, through its ``plugin`` L2 adapter type::

    --l2-adapter '{"type": "plugin", "module_path": "aiokvtier.integrations.lmcache",
                   "class_name": "AiokvtierL2Adapter", "adapter_params": {"quota": "64GiB"}}'

The adapter runs one asyncio loop on its own thread (``aiokvtier-lmcache``)
and keeps a ``BlockStore`` over a ``HostTier`` there (or, with ``"pool"``,
an ``AttachedPool``). LMCache's controller threads submit tasks with
``run_coroutine_threadsafe`` / ``call_soon_threadsafe`` and never wait for
the loop; each finished task is recorded under a lock and its eventfd is
signalled. LMCache's listeners are told on the loop's thread: a listener
that calls back ``statistics``, ``report_status``, ``check_invariants`` or
``delete`` is answered there over a host tier, and what would wait for the
loop from its own thread (``close``; over a pool, ``report_status`` and
``delete``) raises ``RuntimeError`` rather than hang. A memory object's bytes move by address (``MemoryObj.byte_array``
is a view of LMCache's L1 buffer): one ``memmove`` into the tier slot on a
store, one out of it on a load.

Lookup-and-lock holds a block against eviction: the store's policy is
wrapped so that locked blocks are never offered as victims, and ``delete``
leaves locked blocks alone, until LMCache unlocks them. ``close()`` cancels
the tasks in flight (a cancelled store leaves no partial block and no slot
taken, and returns only once nothing reads LMCache's buffers), then closes
the store and the tier, or detaches from the pool.

This is the only module of the package that imports LMCache (and, through
it, torch).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import pydantic
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier

from .._config import HostTierConfig
from .._errors import BlockNotFound, PoolLostError, TierClosedError
from .._host._tier import HostTier
from .._lifecycle import close_in_turn
from .._pool._client import AttachedPool
from .._store._keys import Key
from .._store._policy import EvictionPolicy, make_policy
from .._store._store import BlockStore, StoreStatistics

__all__ = ["LMCACHE_VERSION", "AiokvtierL2Adapter", "AiokvtierL2AdapterConfig"]

LMCACHE_VERSION = "0.5.6"
"""The LMCache release whose ``L2AdapterInterface`` this module implements."""

log = logging.getLogger("aiokvtier")

T = TypeVar("T")

_POLICIES = ("lru", "s3fifo")
_PREFIXES_MAX = 4096  # (model, rank, group, salt) prefixes kept; salts may be per user


class AiokvtierL2AdapterConfig(L2AdapterConfigBase):
    """The ``adapter_params`` of the plugin: a host tier, or a pool to attach to.

    - A host tier: ``HostTierConfig``'s fields (``quota`` is required;
      ``slot_size`` should be at least LMCache's chunk size in bytes), plus
      ``policy`` (``"lru"``, the default, or ``"s3fifo"``).
    - A pool: ``{"pool": "/run/kv/pool.sock"}``: the machine-wide pool that
      ``aiokvtier pool`` serves; every LMCache server on the host shares it.
    """

    def __init__(self, tier: HostTierConfig | None = None, pool: str | None = None, policy: str = "lru") -> None:
        if (tier is None) == (pool is None):
            raise ValueError("aiokvtier L2 adapter: give a host tier or a pool, exactly one")
        self.tier = tier
        self.pool = pool
        self.policy = policy

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AiokvtierL2AdapterConfig:
        """Parse ``adapter_params``.

        :raises ValueError: an unknown or invalid field, or neither ``quota`` nor ``pool`` given
            (the message names it).
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"aiokvtier L2 adapter: adapter_params must be a JSON object, got {d!r}")
        params = dict(d)
        pool = params.pop("pool", None)
        if pool is not None:
            if not isinstance(pool, str) or not pool:
                raise ValueError(f"aiokvtier L2 adapter: 'pool' must be the pool's socket path, got {pool!r}")
            if params:
                raise ValueError(
                    "aiokvtier L2 adapter: with 'pool' the tier is the pool's; remove "
                    + ", ".join(map(repr, sorted(params)))
                )
            return cls(pool=pool)
        policy = params.pop("policy", "lru")
        if policy not in _POLICIES:
            raise ValueError(f"aiokvtier L2 adapter: 'policy' must be one of {', '.join(_POLICIES)}, got {policy!r}")
        if "quota" not in params:
            raise ValueError("aiokvtier L2 adapter: give 'quota' (the host tier's size, e.g. \"64GiB\") or 'pool'")
        try:
            tier = HostTierConfig.model_validate(params)
        except pydantic.ValidationError as e:
            raise ValueError(f"aiokvtier L2 adapter: invalid host tier config: {e}") from None
        return cls(tier=tier, policy=policy)

    @classmethod
    def help(cls) -> str:
        return (
            "aiokvtier L2 adapter fields (adapter_params):\n"
            '- quota (size, e.g. "64GiB"): a host tier of this size, filled progressively; with it, any\n'
            "  other HostTierConfig field (slot_size >= the chunk size in bytes, max_quota, numa_node, ...)\n"
            '- policy ("lru" or "s3fifo", default "lru")\n'
            "- pool (str): instead of a tier, attach to the aiokvtier pool served at this socket path\n"
        )


class _Locking(EvictionPolicy):
    """A policy that never offers a locked block as a victim (LMCache's lookup-and-lock)."""

    def __init__(self, inner: EvictionPolicy) -> None:
        self.inner = inner
        self.name = inner.name
        self.held: dict[int, int] = {}  # slot -> locks

    def hold(self, slot: int) -> None:
        self.held[slot] = self.held.get(slot, 0) + 1

    def release(self, slot: int) -> None:
        n = self.held.get(slot, 0) - 1
        if n > 0:
            self.held[slot] = n
        else:
            self.held.pop(slot, None)

    def inserted(self, slot: int, key: Key) -> None:
        self.inner.inserted(slot, key)

    def inserted_many(self, slots: Sequence[int] | npt.NDArray[np.int64], keys: Sequence[Key]) -> None:
        self.inner.inserted_many(slots, keys)

    def accessed(self, slots: npt.NDArray[np.int64]) -> None:
        self.inner.accessed(slots)

    def removed(self, slot: int) -> None:
        self.inner.removed(slot)
        self.held.pop(slot, None)

    def removed_many(self, slots: npt.NDArray[np.int64]) -> None:
        self.inner.removed_many(slots)
        for slot in slots.tolist():
            self.held.pop(slot, None)

    def victims(self) -> Iterator[int]:
        victims = self.inner.victims()
        try:
            for slot in victims:
                if slot not in self.held:
                    yield slot
        finally:
            close = getattr(victims, "close", None)
            if close is not None:
                close()

    def resize(self, capacity: int) -> None:
        self.inner.resize(capacity)

    def __len__(self) -> int:
        return len(self.inner)

    def tracked(self) -> npt.NDArray[np.bool_] | None:
        return self.inner.tracked()


class AiokvtierL2Adapter(L2AdapterInterface):
    """LMCache's ``L2AdapterInterface`` over an aiokvtier ``BlockStore`` (or an ``AttachedPool``).

    Built by LMCache's plugin factory with an ``AiokvtierL2AdapterConfig``
    (found by its name) or the raw ``adapter_params`` dict; it opens the
    tier before it returns (the tier fills in the background: stores are
    accepted at once, each waiting only for the slots it takes).

    :raises ValueError: bad ``adapter_params`` (nothing opened).
    :raises OSError, NumaPolicyError, PoolError: the tier could not be opened, the pool attached, or
        the eventfds made (nothing left open).
    """

    def __init__(self, config: AiokvtierL2AdapterConfig | Mapping[str, Any], **_kwargs: object) -> None:
        # _kwargs: l1_memory_desc, which LMCache passes to adapters that register its L1 buffer; bytes move
        # here by CPU copies from the buffer's addresses, so nothing needs registering.
        if not isinstance(config, AiokvtierL2AdapterConfig):
            config = AiokvtierL2AdapterConfig.from_dict(config)
        self._config = config
        self._lock = threading.Lock()  # the completed tasks and the closed flag, shared with LMCache's threads
        self._ids = itertools.count()
        self._done_store: dict[L2TaskId, L2StoreResult] = {}
        self._done_lookup: dict[L2TaskId, Bitmap] = {}
        self._done_load: dict[L2TaskId, Bitmap] = {}
        self._closed = False
        self._shut = threading.Event()  # set once close() is done: a close from another thread waits for it
        # On the loop only:
        self._tasks: set[asyncio.Task[None]] = set()
        self._prefixes: dict[tuple[str, int, int, str], bytes] = {}
        self._objects: dict[Key, tuple[ObjectKey, int]] = {}  # stored by this adapter: for LMCache's listeners
        self._locks: dict[Key, tuple[int, int]] = {}  # key -> (slot, locks)
        self._tier: HostTier | None = None
        self._store: BlockStore | None = None
        self._policy: _Locking | None = None
        self._pool: AttachedPool | None = None
        self._events: asyncio.Task[None] | None = None
        self._slot_size = 0
        self._warned_size = False

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="aiokvtier-lmcache", daemon=True)
        self._thread.start()
        try:
            capacity = asyncio.run_coroutine_threadsafe(self._open(), self._loop).result()
        except BaseException:
            self._stop_loop()
            raise
        efds: list[Any] = []
        try:
            super().__init__(max_capacity_bytes=capacity)
            for _ in range(3):
                efds.append(create_event_notifier())
        except BaseException:  # out of descriptors, say: nothing opened above stays open
            self._closed = True
            for efd in efds:
                efd.close()
            try:
                asyncio.run_coroutine_threadsafe(self._close_backend(), self._loop).result()
            finally:
                self._stop_loop()
            raise
        self._store_efd, self._lookup_efd, self._load_efd = efds
        self._loop.call_soon_threadsafe(self._start_events)

    async def _open(self) -> int:
        config = self._config
        try:
            if config.pool is not None:
                self._pool = await AttachedPool.attach(config.pool)
                self._slot_size = self._pool.slot_size
                return self._pool.slots_total * self._slot_size
            assert config.tier is not None
            self._tier = await HostTier.open(config.tier)
            self._policy = _Locking(make_policy(config.policy, max(1, self._tier.slots_total)))
            self._store = await BlockStore.open(self._tier, None, self._policy)
            self._slot_size = self._tier.slot_size
            return self._tier.slots_total * self._slot_size
        except BaseException:
            await self._close_backend()
            raise

    def _start_events(self) -> None:
        if not self._closed:
            self._events = self._loop.create_task(self._forward_events())

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    # -- event fds ------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return int(self._store_efd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_efd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_efd.fileno())

    # -- LMCache's threads: submit and collect ----------------------------------------------

    def _submit(self, work: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        # Under the lock: close() cannot come between the check and the scheduling, so every task
        # submitted is on the loop before the shutdown, which then cancels and awaits it.
        with self._lock:
            if not self._closed:
                asyncio.run_coroutine_threadsafe(self._tracked(work, *args), self._loop)
                return
        raise TierClosedError("the aiokvtier L2 adapter is closed")

    def _task_id(self) -> L2TaskId:
        with self._lock:
            return next(self._ids)

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} memory objects")
        tid = self._task_id()
        self._submit(self._store_task, tid, list(keys), list(objects))
        return tid

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:  # copied and cleared, never swapped: _finish holds this dict while it waits for the lock
            done = dict(self._done_store)
            self._done_store.clear()
        return done

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey], group_layout_descs: object = None) -> L2TaskId:
        tid = self._task_id()
        if self._pool is not None:
            self._submit(self._lookup_pool, tid, list(keys))
            return tid
        with self._lock:  # a host tier's lookup never waits: a callback, not a task (a third of the latency)
            if not self._closed:
                self._loop.call_soon_threadsafe(self._lookup_here, tid, list(keys))
                return tid
        raise TierClosedError("the aiokvtier L2 adapter is closed")

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._done_lookup.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            if not self._closed:  # closing released every lock
                self._loop.call_soon_threadsafe(self._unlock, list(keys))

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} memory objects")
        tid = self._task_id()
        self._submit(self._load_task, tid, list(keys), list(objects))
        return tid

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._done_load.pop(task_id, None)

    def delete(self, keys: list[ObjectKey]) -> None:
        """Drop blocks (LMCache's own L2 eviction); locked blocks stay.

        Returns once they are gone and the listeners were told, as LMCache's
        accounting expects: a discard on the loop, microseconds per key. On
        the adapter's loop thread (from a listener) it is done there and then
        over a host tier; over a pool it would wait for itself: a RuntimeError.
        """
        with self._lock:
            if self._closed:
                return
            here = self._on_loop()
            if not here:
                done = asyncio.run_coroutine_threadsafe(self._tracked(self._delete, list(keys)), self._loop)
        if here:  # outside the lock: the listeners told may call the adapter again
            if self._store is None:
                raise self._would_wait("delete")
            self._delete_here(list(keys))
            return
        try:
            done.result()
        except concurrent.futures.CancelledError:
            pass  # close() came meanwhile: everything is gone

    def report_status(self) -> dict[str, Any]:
        """LMCache's health and usage figures. On the adapter's loop thread (from a listener) over a pool,
        whose figures are a request away, it would wait for itself: a RuntimeError."""
        with self._lock:
            if self._closed:
                return self._closed_status()
            if self._on_loop():
                if self._store is None:
                    raise self._would_wait("report_status")
                return self._status_here()
            done = asyncio.run_coroutine_threadsafe(self._tracked(self._status), self._loop)
        try:
            return done.result()
        except concurrent.futures.CancelledError:  # close() came meanwhile
            return self._closed_status()

    def _closed_status(self) -> dict[str, Any]:
        return {"is_healthy": False, "type": type(self).__name__, "closed": True}

    def statistics(self) -> StoreStatistics | None:
        """The host tier's ``StoreStatistics``, read on the adapter's loop (None with a pool, or once closed)."""
        with self._lock:
            if self._closed:
                return None
            if self._on_loop():  # the books are this thread's: read them, rather than wait for itself
                return self._statistics_here()
            done = asyncio.run_coroutine_threadsafe(self._statistics(), self._loop)
        return done.result()

    def check_invariants(self) -> None:
        """Check the store's books and the adapter's locks against each other (tests, debugging).

        :raises AssertionError: naming what is broken.
        :raises TierClosedError: the adapter is closed.
        """
        with self._lock:
            if self._closed:
                raise TierClosedError("the aiokvtier L2 adapter is closed")
            here = self._on_loop()
            if not here:
                done = asyncio.run_coroutine_threadsafe(self._check(), self._loop)
        if here:
            self._check_here()
            return
        done.result()

    def close(self) -> None:
        """Cancel what is in flight, close the store and the tier (or detach from the pool), end the thread.

        Returns once nothing reads or writes LMCache's memory objects any more; idempotent (a close
        called while another thread's runs returns once that one is done).

        :raises RuntimeError: called on the adapter's own loop thread (from a listener): the close
            waits for that thread to end. Nothing is closed.
        """
        with self._lock:
            closing = self._closed
            if not closing and self._on_loop():
                raise self._would_wait("close")
            self._closed = True
        if closing:  # another close began: done when it is (the loop's thread cannot wait for it)
            if not self._on_loop():
                self._shut.wait()
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result()
        finally:
            self._stop_loop()
            for efd in (self._store_efd, self._lookup_efd, self._load_efd):
                efd.close()
            self._shut.set()

    def _on_loop(self) -> bool:
        """Called on the adapter's loop thread (by a listener LMCache's notifications run there)."""
        return threading.get_ident() == self._thread.ident

    @staticmethod
    def _would_wait(what: str) -> RuntimeError:
        return RuntimeError(
            f"AiokvtierL2Adapter.{what}() was called on the adapter's own loop thread (from a listener, say), "
            "where it would wait for that loop forever: call it from another thread"
        )

    # -- the loop ------------------------------------------------------------------------------

    async def _tracked(self, work: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """``work(*args)``, cancelled and awaited by close() if it is still running then."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            return await work(*args)
        finally:
            self._tasks.discard(task)

    def _key(self, key: ObjectKey) -> bytes:
        """``model@rank@group@salt@`` + the chunk hash: '@' appears in none of the first four fields."""
        fields = (key.model_name, key.kv_rank, key.object_group_id, key.cache_salt)
        prefix = self._prefixes.get(fields)
        if prefix is None:
            if len(self._prefixes) >= _PREFIXES_MAX:
                self._prefixes.clear()
            prefix = self._prefixes[fields] = "{}@{}@{}@{}@".format(*fields).encode()
        chunk: bytes = key.chunk_hash
        return prefix + chunk

    def _finish(self, table: dict[L2TaskId, Any], tid: L2TaskId, result: Any, efd: Any) -> None:
        with self._lock:
            if self._closed:
                return
            table[tid] = result
        efd.notify()

    async def _store_task(self, tid: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        ok, nbytes = True, 0
        try:
            chosen: dict[Key, int] = {}  # a key once (the store refuses repeats), first object wins
            slot_size = self._slot_size
            for i, key in enumerate(keys):
                size = objects[i].get_size()
                if 0 < size <= slot_size:
                    chosen.setdefault(self._key(key), i)
                elif size and not self._warned_size:  # never fits: not stored, as a full tier skips
                    self._warned_size = True
                    # A pool's slot size is its owner's: 'slot_size' is refused beside 'pool'.
                    fix = (
                        "start the pool with a --slot-size of at least"
                        if self._pool is not None
                        else "set adapter_params' slot_size to at least"
                    )
                    log.warning(
                        "aiokvtier L2 adapter: a %d-byte object does not fit a %d-byte slot and is not stored; "
                        "%s the bytes of one LMCache chunk (chunk_size tokens x layers x 2 x KV heads per rank "
                        "x head size x bytes per element)",
                        size,
                        slot_size,
                        fix,
                    )
            akeys = list(chosen)
            pages = [objects[i].byte_array for i in chosen.values()]
            if self._store is not None:
                result = await self._store.store(akeys, pages)
                stored = [k for k in result.stored if k in self._store]  # one evicted since is gone already
            else:
                assert self._pool is not None
                result = await self._pool.store(akeys, pages)
                stored = list(result.stored)
                # One evicted since by another process's store is gone already: its event may have been read
                # before this task resumed (it came in the same read as the reply), and found nothing to tell.
                there = self._pool.contains_nowait(stored) if stored else None
                if there is not None:
                    stored = [k for k, here in zip(stored, there.tolist(), strict=True) if here]
            if stored:
                done = [(keys[chosen[k]], objects[chosen[k]].get_size()) for k in stored]
                for k, (okey, size) in zip(stored, done, strict=True):
                    self._objects[k] = (okey, size)
                nbytes = sum(size for _, size in done)
                _tell(self._notify_keys_stored, [okey for okey, _ in done], [size for _, size in done])
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("aiokvtier L2 adapter: store task %d failed", tid)
            ok = False
        self._finish(self._done_store, tid, L2StoreResult(ok, nbytes), self._store_efd)

    def _lookup_here(self, tid: L2TaskId, keys: list[ObjectKey]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            store, policy = self._store, self._policy
            assert store is not None and policy is not None
            akeys = [self._key(k) for k in keys]
            for i, k in enumerate(akeys):
                if k in store:
                    slot = store.slot(k)
                    _, n = self._locks.get(k, (slot, 0))
                    self._locks[k] = (slot, n + 1)
                    policy.hold(slot)
                    bitmap.set(i)
            store.lookup(akeys)  # touches the stored prefix for the policy, and counts hits and misses
        except Exception:
            log.exception("aiokvtier L2 adapter: lookup task %d failed", tid)
        self._finish(self._done_lookup, tid, bitmap, self._lookup_efd)

    async def _lookup_pool(self, tid: L2TaskId, keys: list[ObjectKey]) -> None:
        """Which chunks the pool holds, without locks: the pool's owner evicts for every process.

        A row is one (model, rank, object group, salt); LMCache lists a row's chunks in token order. One
        lookup per row (all at once; each read from the pool's index mirror, or a request to the owner
        when the mirror cannot answer) finds its stored prefix and marks those blocks referenced for the
        owner's eviction; the chunks after a row's first miss, where there are any, are then asked key by
        key in one read (``AttachedPool.contains``), for LMCache's "full" prefetch.
        """
        bitmap = Bitmap(len(keys))
        try:
            pool = self._pool
            assert pool is not None
            rows: dict[tuple[str, int, int, str], list[int]] = {}
            for i, k in enumerate(keys):
                rows.setdefault((k.model_name, k.kv_rank, k.object_group_id, k.cache_salt), []).append(i)
            hits = await asyncio.gather(*(pool.lookup([self._key(keys[i]) for i in row]) for row in rows.values()))
            past: list[int] = []
            for row, n in zip(rows.values(), hits, strict=True):
                for i in row[:n]:
                    bitmap.set(i)
                past.extend(row[n + 1 :])  # row[n] is the miss
            if past:
                found = await pool.contains([self._key(keys[i]) for i in past])
                for i, there in zip(past, found.tolist(), strict=True):
                    if there:
                        bitmap.set(i)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("aiokvtier L2 adapter: lookup task %d failed", tid)
        self._finish(self._done_lookup, tid, bitmap, self._lookup_efd)

    def _unlock(self, keys: list[ObjectKey]) -> None:
        if self._store is None or self._closed:
            return
        policy = self._policy
        assert policy is not None
        for key in keys:
            try:
                k = self._key(key)
            except (AttributeError, TypeError):  # no ObjectKey: never locked, and LMCache never retries the rest
                continue
            held = self._locks.get(k)
            if held is None:
                continue
            slot, n = held
            if n > 1:
                self._locks[k] = (slot, n - 1)
            else:
                del self._locks[k]
            policy.release(slot)

    async def _load_task(self, tid: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        bitmap = Bitmap(len(keys))
        loaded: list[int] = []
        try:
            akeys = [self._key(k) for k in keys]
            want = list(range(len(keys)))
            store = self._store
            if store is not None:  # only blocks of the object's exact size: bit-exact, or a miss
                want = [i for i in want if akeys[i] in store and store.length(akeys[i]) == objects[i].get_size()]
            while want:
                pages = [objects[i].byte_array for i in want]
                try:
                    if store is not None:
                        await store.load([akeys[i] for i in want], pages)
                        loaded = want
                    else:
                        loaded = await self._load_pool(akeys, objects, want, pages)
                    break
                except BlockNotFound as e:  # evicted since (a pool's other process): a miss, the rest load
                    want = [i for i in want if akeys[i] != e.key]
            for i in loaded:
                bitmap.set(i)
            if loaded:
                _tell(self._notify_keys_accessed, [keys[i] for i in loaded])
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("aiokvtier L2 adapter: load task %d failed", tid)
        self._finish(self._done_load, tid, bitmap, self._load_efd)

    async def _load_pool(
        self, akeys: list[bytes], objects: list[MemoryObj], want: list[int], pages: list[Any]
    ) -> list[int]:
        """Load ``want`` from the pool; the positions loaded whole. A block stored with another size than
        its object is a miss: a longer one refuses the pool's load (nothing copied), so the keys are then
        loaded one by one, that one left out; a shorter one is copied into the object's first bytes."""
        pool = self._pool
        assert pool is not None
        try:
            lengths = await pool.load([akeys[i] for i in want], pages)
        except ValueError:  # a block longer than its object
            loaded = []
            for i, page in zip(want, pages, strict=True):
                try:
                    [n] = await pool.load([akeys[i]], [page])
                except (ValueError, BlockNotFound):
                    continue
                if n == objects[i].get_size():
                    loaded.append(i)
            return loaded
        return [i for i, n in zip(want, lengths, strict=True) if n == objects[i].get_size()]

    async def _delete(self, keys: list[ObjectKey]) -> None:
        if self._pool is None:
            self._delete_here(keys)
            return
        akeys = list(dict.fromkeys(self._key(key) for key in keys))
        try:
            await self._pool.discard(akeys)
        except PoolLostError:
            pass  # the blocks went with the owner: gone all the same (LMCache's eviction thread must not die)
        self._told_deleted(akeys)

    def _delete_here(self, keys: list[ObjectKey]) -> None:
        """``_delete`` over a host tier: nothing to wait for."""
        akeys = list(dict.fromkeys(self._key(key) for key in keys))
        if self._store is not None:
            akeys = [k for k in akeys if k in self._store and k not in self._locks]  # locked: kept
            self._store.discard(akeys)
        self._told_deleted(akeys)

    def _told_deleted(self, akeys: Sequence[Key]) -> None:
        # Told here rather than by the "discarded" event, which comes later: it then finds nothing to tell.
        gone = [self._objects.pop(k) for k in akeys if k in self._objects]
        if gone:
            self._notify_keys_deleted([okey for okey, _ in gone], [size for _, size in gone])

    async def _forward_events(self) -> None:
        """Tell LMCache's listeners about blocks of this adapter that the store evicted or discarded."""
        events = self._store.events() if self._store is not None else await self._pool.events()  # type: ignore[union-attr]
        async with events:
            async for event in events:
                if event.dropped:
                    log.warning("aiokvtier L2 adapter: %d store events lost; usage figures may drift", event.dropped)
                if event.kind == "stored":
                    continue
                gone = [self._objects.pop(k) for k in event.keys if k in self._objects]
                if gone:
                    _tell(self._notify_keys_deleted, [okey for okey, _ in gone], [size for _, size in gone])

    async def _statistics(self) -> StoreStatistics | None:
        return self._statistics_here()

    def _statistics_here(self) -> StoreStatistics | None:
        return self._store.statistics() if self._store is not None else None

    async def _status(self) -> dict[str, Any]:
        if self._pool is None:
            return self._status_here()
        status: dict[str, Any] = {"is_healthy": True, "type": type(self).__name__, "locked_keys": len(self._locks)}
        try:
            p = await self._pool.statistics()
        except PoolLostError as e:  # LMCache's /status gathers every adapter's: an answer, not an exception
            status.update(is_healthy=False, error=f"{e}; the adapter does not re-attach: restart the server")
            return status
        status.update(pool=p.path, blocks=p.blocks, capacity_blocks=p.tier.slots_total, processes=p.clients)
        return status

    def _status_here(self) -> dict[str, Any]:
        """``_status`` over a host tier: nothing to wait for."""
        status: dict[str, Any] = {"is_healthy": True, "type": type(self).__name__, "locked_keys": len(self._locks)}
        if self._store is not None:
            s = self._store.statistics()
            status.update(
                blocks=s.blocks, capacity_blocks=s.capacity, evictions=s.evictions, bytes_stored=s.bytes_stored,
                bytes_loaded=s.bytes_loaded, blocks_pinned=s.blocks_pinned, in_flight=s.in_flight,
            )  # fmt: skip
        return status

    async def _check(self) -> None:
        self._check_here()

    def _check_here(self) -> None:
        if self._store is None:
            return
        self._store.check_invariants()
        policy = self._policy
        assert policy is not None
        held: dict[int, int] = {}
        for k, (slot, n) in self._locks.items():
            assert self._store.slot(k) == slot, f"locked key {k!r} moved from slot {slot}"
            held[slot] = held.get(slot, 0) + n
        assert held == policy.held, f"the policy holds {policy.held}, the locks say {held}"

    async def _shutdown(self) -> None:
        tasks = list(self._tasks)
        if self._events is not None:
            tasks.append(self._events)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._locks.clear()
        if self._policy is not None:
            self._policy.held.clear()
        await self._close_backend()

    async def _close_backend(self) -> None:
        await close_in_turn(self._store, self._tier, self._pool)


def _tell(notify: Callable[..., None], *args: Any) -> None:
    """Tell LMCache's listeners (on the loop): a listener that raises is logged, and neither fails the
    task that did the work (its blocks are stored or loaded) nor ends the forwarding of later events."""
    try:
        notify(*args)
    except Exception:
        log.exception("aiokvtier L2 adapter: a listener of LMCache's raised")
