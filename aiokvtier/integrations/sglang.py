"""aiokvtier as SGLang's HiCache storage (L3): a ``HiCacheStorage`` that SGLang loads by configuration.

Supported: SGLang 0.5.23. Load it with::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "aiokvtier", "module_path": "aiokvtier.integrations.sglang",
        "class_name": "HiCacheAiokvtier", "interface_v1": 1,
        "aiokvtier": {"pool": "/run/aiokvtier.sock"}}'

``"aiokvtier"`` names the storage: ``{"pool": PATH}`` attaches to the
machine-wide pool served there (``aiokvtier pool``), so every SGLang
instance of the host shares the pages one of them stored; ``{"tier": {...}}``
opens a process-local ``HostTier`` (a ``HostTierConfig``) under a
``BlockStore``.

How SGLang's pages become blocks: a page is what the host pool's
``get_page_buffer_meta`` describes (the zero-copy ``*_v1`` calls: K and V
of the page, or one span per layer; a hybrid model's extra pools, Mamba
state and the like, the same way through the ``*_v2`` calls, each under
its own namespace), or a flat page tensor (``get``,
``set``, ``batch_get``, ``batch_set``), or ``(address, size)`` (the pointer
form some backends take). Each span is cut into slot-sized pieces, and each
piece is one block under the key ``namespace + page key + piece number``.
The namespace is a digest of the model, the ranks whose shards differ and
the page's byte format, so instances that would read each other's bytes
differently never meet. Bytes move by ``memmove`` between SGLang's host pool
and the slots, on the store's (or the attached pool's) own thread: no
staging copy.

Threads: SGLang calls from its prefetch, backup and scheduler threads,
synchronously. Every call crosses to one event loop on the
``aiokvtier-sglang`` thread (a task made there with ``call_soon_threadsafe``)
and the calling thread waits for its outcome; nothing blocks that loop. ``get_stats`` never crosses: it
drains figures kept on the caller's side. Nor does ``batch_exists`` over a pool, as a rule: the calling
thread reads the pool's index mirror (``AttachedPool.lookup_nowait``), with the batch's block keys built
as one array; it crosses only when the mirror cannot answer.
"""

from __future__ import annotations

import asyncio
import bisect
import ctypes
import hashlib
import logging
import operator
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransferResult,
)

from .. import (
    AttachedPool,
    BlockNotFound,
    BlockStore,
    ConfigError,
    HostTier,
    HostTierConfig,
    PoolError,
    PoolLostError,
    TierClosedError,
)
from .._lifecycle import close_in_turn

__all__ = ["SGLANG_VERSION", "HiCacheAiokvtier"]

SGLANG_VERSION = "0.5.23"
"""The SGLang release whose ``HiCacheStorage`` this module implements."""

log = logging.getLogger("aiokvtier")

T = TypeVar("T")
U64 = npt.NDArray[np.uint64]

_CONFIG_KEYS = frozenset({"pool", "tier", "namespace"})

REATTACH_AFTER = 1.0
"""Seconds between attempts to attach again to a pool whose owner went away (a restarted owner starts
empty; meanwhile every lookup is a miss and every store fails, and SGLang computes what it would have
loaded)."""


@dataclass(frozen=True)
class _Plan:
    """How one page's bytes become blocks: a page format and the pieces of it, in order."""

    namespace: bytes
    """The first bytes of every key of this format."""
    span: npt.NDArray[np.intp]
    """For each block, the span of the page it lies in."""
    offset: U64
    """For each block, its offset in that span."""
    length: U64
    """For each block, its length."""
    suffixes: tuple[bytes, ...]
    """For each block, what follows the page key in its key."""
    spans: tuple[int, ...]
    """The page's span sizes."""

    @property
    def blocks(self) -> int:
        return len(self.suffixes)

    @property
    def page_bytes(self) -> int:
        return sum(self.spans)

    def keys(self, keys: Sequence[str]) -> list[bytes]:
        """The block keys of ``keys``' pages, page by page (one list: the store's one call)."""
        ns = self.namespace
        if not isinstance(keys, list | tuple) or operator.countOf(map(type, keys), str) != len(keys):
            raise TypeError("SGLang's keys are a list of str")
        pages = [ns + k.encode() for k in keys]
        if len(self.suffixes) == 1:
            return pages
        suffixes = self.suffixes
        return [page + s for page in pages for s in suffixes]

    def key_matrix(self, keys: Sequence[str]) -> npt.NDArray[np.uint8] | None:
        """The block keys of ``keys``' pages as the rows of one array, page by page (as ``keys()``), built
        without a Python object per key; None when the pages' keys are not all of one length in UTF-8 (then
        ``keys()``).

        :raises TypeError: ``keys`` is not a list of str.
        """
        if not isinstance(keys, list | tuple) or not keys:
            raise TypeError("SGLang's keys are a list of str")
        n = len(keys)
        try:  # one join and one encode for the batch; the separators say where each key ends
            raw = "\n".join(keys).encode()
        except TypeError:
            raise TypeError("SGLang's keys are a list of str") from None
        if (len(raw) + 1) % n:
            return None  # the lengths differ
        width = (len(raw) + 1) // n - 1
        text = np.frombuffer(raw, dtype=np.uint8)
        newline = text == ord("\n")
        if np.count_nonzero(newline) != n - 1 or not bool(newline[width :: width + 1].all()):
            return None  # a key holds a newline, or the lengths differ
        # Key i's bytes start at i * (width + 1): a strided view of the joined text, no copy.
        keyed = np.lib.stride_tricks.as_strided(text, (n, width), (width + 1, 1), writeable=False)
        ns, suffixes = self.namespace, self.suffixes
        tail, blocks = len(suffixes[0]), len(suffixes)
        page = np.empty((n, len(ns) + width + tail), dtype=np.uint8)
        page[:, : len(ns)] = np.frombuffer(ns, dtype=np.uint8)
        page[:, len(ns) : len(ns) + width] = keyed
        if blocks == 1:
            return page
        out = np.repeat(page, blocks, axis=0)  # whole rows: numpy is slow copying a few bytes a row
        ends = np.frombuffer(b"".join(suffixes), dtype=np.uint8).reshape(blocks, tail)
        out.reshape(n, blocks, -1)[:, :, -tail:] = ends
        return out

    def addresses(self, starts: npt.NDArray[np.uint64]) -> tuple[U64, U64]:
        """Block addresses and lengths for pages whose spans start at ``starts`` (pages x spans)."""
        addresses = starts[:, self.span] + self.offset
        lengths = np.broadcast_to(self.length, addresses.shape)
        return addresses.reshape(-1), np.ascontiguousarray(lengths).reshape(-1)


def _plan(namespace: bytes, spans: Sequence[int], slot_size: int) -> _Plan:
    """Cut each span into slot-sized pieces (the last one shorter)."""
    span, offset, length = [], [], []
    for j, size in enumerate(spans):
        for start in range(0, size, slot_size):
            span.append(j)
            offset.append(start)
            length.append(min(slot_size, size - start))
    if len(span) > 1 << 16:
        raise ConfigError(
            f"a page of {sum(spans)} bytes would be {len(span)} blocks of {slot_size} bytes: use larger slots"
        )
    suffixes = (b"",) if len(span) == 1 else tuple(i.to_bytes(2, "little") for i in range(len(span)))
    return _Plan(
        namespace,
        np.array(span, dtype=np.intp),
        np.array(offset, dtype=np.uint64),
        np.array(length, dtype=np.uint64),
        suffixes,
        tuple(spans),
    )


@dataclass(frozen=True)
class _Extra:
    """A hybrid model's extra host pool (``register_mem_host_pool_v2``): its page format and buffers."""

    host: Any
    plan: _Plan | None
    """None: the pool gives no zero-copy page layout (``get_page_buffer_meta``), so its pages are not stored."""
    why: str
    """Why ``plan`` is None (empty otherwise)."""
    bounds: tuple[U64, U64]


SLOT_USE_WARNING = 0.5
"""Below this share of the slots' bytes holding page data, registering a host pool warns."""


def _warn_if_slots_are_mostly_empty(spans: Sequence[int], blocks: int, slot_size: int, *, pool: bool) -> None:
    """A span shorter than a slot leaves the rest of its slot empty: say so where most of the tier would be
    (the pages it holds are then a fraction of what its bytes could hold), naming the setting to change."""
    used = sum(spans) / (blocks * slot_size)
    if used >= SLOT_USE_WARNING:
        return
    setting = "the pool owner's --slot-size" if pool else 'the "tier" section\'s slot_size'
    log.warning(
        "aiokvtier: SGLang pages of %d spans of at most %d bytes fill %.0f%% of their %d slots of %d bytes: "
        "the tier holds %.1fx fewer pages than its bytes could; set %s near the largest span (%d bytes)",
        len(spans), max(spans), used * 100, blocks, slot_size, 1 / used, setting, max(spans),
    )  # fmt: skip


def _views(addresses: U64, lengths: U64) -> list[Any]:
    """Writable bytes-like objects over SGLang's memory at ``addresses`` (no copy; SGLang owns it)."""
    kinds: dict[int, Any] = {}
    out = []
    for address, n in zip(addresses.tolist(), lengths.tolist(), strict=True):
        kind = kinds.get(n)
        if kind is None:
            kind = kinds[n] = ctypes.c_ubyte * n
        out.append(kind.from_address(address))
    return out


def _namespace(config: HiCacheStorageConfig, user: str, page_format: str, *, tp_sharded: bool = False) -> bytes:
    """A digest of what makes two instances' pages the same bytes: the model, the shard, the format.

    DP replicas (``dp_rank``) are left out: they hold the same shards, which is what sharing is for.
    MLA's KV is the same on every TP rank, so the TP rank is left out there too, unless ``tp_sharded``
    (a hybrid model's extra pool: Mamba state is split across TP ranks even beside MLA's KV).
    """
    parts = [
        "sglang-hicache/1",
        user,
        config.model_name or "",
        f"pp{config.pp_rank}/{config.pp_size}",
        f"cp{config.attn_cp_rank}/{config.attn_cp_size}",
        f"dcp{config.dcp_rank}/{config.dcp_size}/{config.logical_page_size}",
        page_format,
    ]
    if tp_sharded or not config.is_mla_model:
        parts.append(f"tp{config.tp_rank}/{config.tp_size}")
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=8).digest()


def _parse(extra: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
    """The ``"aiokvtier"`` section of SGLang's extra config, checked, and whether ``interface_v1`` is on.

    :raises ConfigError: it is missing, names neither or both of ``pool`` and ``tier``, or has other keys.
    """
    where = "--hicache-storage-backend-extra-config"
    if not isinstance(extra, dict) or "aiokvtier" not in extra:
        raise ConfigError(
            f'{where} needs an "aiokvtier" object: {{"pool": "/path/to/pool.sock"}} to share the machine\'s '
            'pool, or {"tier": {"quota": "16GiB", "slot_size": "1MiB"}} for a tier of this process'
        )
    section = extra["aiokvtier"]
    if not isinstance(section, dict):
        raise ConfigError(f'{where}: "aiokvtier" must be an object, got {type(section).__name__}')
    unknown = sorted(set(section) - _CONFIG_KEYS)
    if unknown:
        raise ConfigError(f'{where}: unknown key(s) {unknown} in "aiokvtier" (known: {sorted(_CONFIG_KEYS)})')
    if ("pool" in section) == ("tier" in section):
        raise ConfigError(f'{where}: "aiokvtier" takes exactly one of "pool" (a socket path) and "tier" (a config)')
    if "pool" in section and not (isinstance(section["pool"], str) and section["pool"]):
        raise ConfigError(f'{where}: "aiokvtier.pool" must be the pool\'s socket path, got {section["pool"]!r}')
    if "tier" in section:
        try:
            section = {**section, "tier": HostTierConfig.model_validate(section["tier"])}
        except ValueError as exc:
            raise ConfigError(f'{where}: "aiokvtier.tier" is not a valid host tier config: {exc}') from None
    if not isinstance(section.get("namespace", ""), str):
        raise ConfigError(f'{where}: "aiokvtier.namespace" must be a string')
    return section, bool(extra.get("interface_v1", 0))


class _Call:
    """One call's outcome, set on the loop once its task is done (cancelled included)."""

    __slots__ = ("done", "error", "result")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class _Loop:
    """An event loop on its own thread, and calls into it from any other thread.

    A call's task is the loop's until it is done: a caller whose call is cancelled (by ``close``)
    returns only once the task has ended, so no copy is still running over SGLang's pages then.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._detached = False
        self._thread = threading.Thread(target=self._main, name="aiokvtier-sglang", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        self.loop.run_forever()
        if self._detached:  # nobody joins this thread to close the loop
            self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> _Call:
        call = _Call()

        def finished(task: asyncio.Task[Any]) -> None:
            self._tasks.discard(task)
            if task.cancelled():
                call.error = asyncio.CancelledError()
            elif task.exception() is not None:
                call.error = task.exception()
            else:
                call.result = task.result()
            call.done.set()

        def start() -> None:
            task = self.loop.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(finished)

        self.loop.call_soon_threadsafe(start)
        return call

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Submit and wait (for set-up and tear-down, which nothing cancels)."""
        call = self.submit(coro)
        call.done.wait()
        if call.error is not None:
            raise call.error
        result: T = call.result
        return result

    def cancel_all(self) -> None:
        """Cancel every call's task (on the loop, after every call submitted before)."""

        def cancel() -> None:
            for task in self._tasks:
                task.cancel()

        self.loop.call_soon_threadsafe(cancel)

    async def drain(self) -> None:
        """Wait until every call's task has ended."""
        mine = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not mine]
        if tasks:
            await asyncio.wait(tasks)

    def on_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()

    def finish_detached(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` after the calls submitted so far, then stop the loop and close it, all on its
        own thread; the caller does not wait (a finalizer must not: the collector may run it on a
        thread holding a lock the loop needs)."""

        async def last() -> None:
            try:
                await coro
            except Exception:
                log.exception("aiokvtier: closing an unclosed HiCacheAiokvtier failed")
            finally:
                self.loop.call_soon(self.loop.stop)

        def closing() -> None:
            self.loop.create_task(last())

        self._detached = True
        self.loop.call_soon_threadsafe(closing)


class _Counts:
    """What ``get_stats`` reports (SGLang's ``StorageMetrics``), kept on the callers' side."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prefetch_pgs: list[int] = []
        self.backup_pgs: list[int] = []
        self.prefetch_bandwidth: list[float] = []
        self.backup_bandwidth: list[float] = []

    def add(self, load: bool, pages: int, nbytes: int, seconds: float) -> None:
        gbps = nbytes / max(seconds, 1e-9) / (1 << 30)
        with self.lock:
            (self.prefetch_pgs if load else self.backup_pgs).append(pages)
            (self.prefetch_bandwidth if load else self.backup_bandwidth).append(gbps)

    def drain(self) -> tuple[list[int], list[int], list[float], list[float]]:
        with self.lock:
            out = (self.prefetch_pgs, self.backup_pgs, self.prefetch_bandwidth, self.backup_bandwidth)
            self.prefetch_pgs, self.backup_pgs, self.prefetch_bandwidth, self.backup_bandwidth = [], [], [], []
        return out


class HiCacheAiokvtier(HiCacheStorage):  # type: ignore[misc]
    """SGLang's HiCache L3 over aiokvtier: a machine-wide pool shared by every instance, or a tier of this process.

    Created by SGLang's ``StorageBackendFactory`` (``backend_class(storage_config, kwargs)``) with the
    ``"aiokvtier"`` section of ``storage_config.extra_config`` (see the module docstring). The pool or
    the tier is attached or opened here, at construction; ``close()`` gives everything back.

    Results follow SGLang's rules: ``batch_exists`` is the length of the stored prefix of pages;
    ``batch_get_v1``/``batch_set_v1`` answer per page (a get is True for the leading pages that were
    found and loaded, False from the first missing one on: the prefix is what SGLang uses). A page is
    stored when each of its blocks is stored or already present.

    A pool whose owner goes away makes every call a miss (``batch_exists`` 0, gets and sets False:
    SGLang computes instead) until an owner serves the path again; then it is attached again.

    :raises ConfigError: the extra config does not name a pool or a tier correctly.
    :raises PoolError: no pool answers at the path (with the reason): start the pool first.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise TypeError(
                f"storage_config must be SGLang's HiCacheStorageConfig, not {type(storage_config).__name__}"
            )
        section, self._interface_v1 = _parse(storage_config.extra_config)
        self.storage_config = storage_config
        self._user_namespace: str = section.get("namespace", "")
        self._counts = _Counts()
        self._lock = threading.Lock()
        self._closed = False
        self._shut = threading.Event()  # set once close() is done: a close from another thread waits for it
        self._pool: AttachedPool | None = None
        self._pool_path: str = section.get("pool", "")
        self._lost_at: float | None = None
        """When the pool's owner went away (None: attached); on the loop only."""
        self._next_attach = 0.0
        self._attaching: asyncio.Lock | None = None
        self._tier: HostTier | None = None
        self._store: BlockStore | None = None
        self._v1: _Plan | None = None
        self._flat: dict[int, _Plan] = {}
        self._flat_default: int | None = None
        self._bounds: tuple[U64, U64] = (np.empty(0, np.uint64), np.empty(0, np.uint64))
        self._extra: dict[str, _Extra] = {}
        """A hybrid model's extra host pools by name (``register_mem_host_pool_v2``); the KV pool is v1's."""
        self._loop = _Loop()
        try:
            if "pool" in section:
                self._pool = self._loop.run(AttachedPool.attach(section["pool"], prefault=True))
                self._slot_size = self._pool.slot_size
            else:
                self._tier = self._loop.run(HostTier.open(section["tier"]))
                self._store = self._loop.run(BlockStore.open(self._tier))
                self._slot_size = self._tier.slot_size
        except BaseException:
            self._closed = True
            try:
                self._loop.run(self._release())
            finally:
                self._loop.stop()
            raise
        self.mem_pool_host: Any = None

    # -- SGLang's hooks ----------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the host pool's page format: its spans (``get_page_buffer_meta``) and its flat page."""
        super().register_mem_pool_host(mem_pool_host)
        page_size = int(mem_pool_host.page_size)
        dtype = str(getattr(mem_pool_host, "dtype", ""))
        layout = str(getattr(mem_pool_host, "layout", ""))
        if hasattr(mem_pool_host, "get_page_buffer_meta"):
            _, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
            spans = [int(s) for s in _flatten(sizes)]
            page_format = f"v1/{layout}/{dtype}/{page_size}/{','.join(map(str, spans))}"
            self._v1 = _plan(_namespace(self.storage_config, self._user_namespace, page_format), spans, self._slot_size)
            log.info(
                "aiokvtier: SGLang pages of %d spans (%d bytes) as %d blocks of up to %d bytes",
                len(spans), sum(spans), self._v1.blocks, self._slot_size,
            )  # fmt: skip
            _warn_if_slots_are_mostly_empty(spans, self._v1.blocks, self._slot_size, pool=self._pool is not None)
        if hasattr(mem_pool_host, "get_dummy_flat_data_page"):
            flat = mem_pool_host.get_dummy_flat_data_page()
            self._flat_default = int(flat.numel() * flat.element_size())
        self._bounds = _buffers(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Learn an extra host pool's page format (a hybrid model's Mamba or SWA state, DSA indexer, draft
        KV...), for the ``*_v2`` calls. The KV pool's pages are the ``*_v1`` pages, under the same keys."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == PoolName.KV.value:
            return
        page_size = int(getattr(host_pool, "page_size", 1) or 1)
        bounds = _pool_buffers(host_pool)
        try:
            if not bounds[0].size:  # a page could not be checked to lie in the pool: a memmove could crash
                raise ValueError("it holds no CPU tensor")
            _, sizes = host_pool.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
            spans = [int(s) for s in _flatten(sizes)]
        except (AttributeError, NotImplementedError, ValueError, AssertionError) as exc:
            why = f"{type(host_pool).__name__} gives no zero-copy page layout ({exc})"
            self._extra[name] = _Extra(host_pool, None, why, bounds)
            log.warning("aiokvtier: SGLang's %s pool is not stored: %s", name, why)
            return
        dtype = str(getattr(host_pool, "dtype", ""))
        layout = str(getattr(host_pool, "layout", ""))
        page_format = f"v2/{name}/{layout}/{dtype}/{page_size}/{','.join(map(str, spans))}"
        namespace = _namespace(self.storage_config, self._user_namespace, page_format, tp_sharded=True)
        plan = _plan(namespace, spans, self._slot_size)
        self._extra[name] = _Extra(host_pool, plan, "", bounds)
        log.info(
            "aiokvtier: SGLang's %s pool: pages of %d spans (%d bytes) as %d blocks of up to %d bytes",
            name, len(spans), sum(spans), plan.blocks, self._slot_size,
        )  # fmt: skip

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GiB/s per batch); never waits."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        prefetch_pgs, backup_pgs, prefetch_bw, backup_bw = self._counts.drain()
        return StorageMetrics(
            prefetch_pgs=prefetch_pgs,
            backup_pgs=backup_pgs,
            prefetch_bandwidth=prefetch_bw,
            backup_bandwidth=backup_bw,
        )

    def statistics(self) -> Any:
        """aiokvtier's own figures: the pool's ``PoolStatistics`` or the store's ``StoreStatistics``."""
        if self._pool is not None:
            return self._call("statistics", self._pool.statistics())
        assert self._store is not None
        store = self._store

        async def stats() -> Any:
            return store.statistics()

        return self._call("statistics", stats())

    # -- zero-copy: pages of SGLang's registered host pool -------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of ``keys`` are stored (every block of each)."""
        if not keys:
            return 0
        plan = self._exists_plan()
        pool = self._pool
        if pool is not None and not self._closed:
            # Answered here, on the calling thread, from the pool's index mirror (shared memory): no
            # crossing to the loop. What the mirror cannot answer (a pool lost or being attached again,
            # an owner writing all the while) goes the loop's way.
            matrix = plan.key_matrix(keys)
            found = pool.lookup_nowait(plan.keys(keys) if matrix is None else matrix)
            if found is not None:
                return found // plan.blocks
        return self._call("batch_exists", self._lookup(plan.keys(keys))) // plan.blocks

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store the pages at ``host_indices`` of the registered host pool (``page_size`` indices per key)."""
        plan, views = self._pool_pages(keys, host_indices)
        if not keys:
            return []
        return self._set("batch_set_v1", plan, keys, views)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Load the stored pages into the host pool at ``host_indices``; True for the leading pages found."""
        plan, views = self._pool_pages(keys, host_indices)
        if not keys:
            return []
        return self._get("batch_get_v1", plan, keys, views)

    # -- flat pages and raw addresses ---------------------------------------------------------

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one page: a CPU tensor ``value``, or ``target_sizes`` bytes at address ``target_location``."""
        return self.batch_set([key], None if value is None else [value], [target_location], [target_sizes])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store pages given as CPU tensors (``values``) or as addresses and sizes; True if every one was."""
        if not keys:
            return True
        # ``pages`` holds the contiguous copies made of non-contiguous tensors until they are stored.
        pages = _flat_pages(keys, values, target_locations, target_sizes, writable=False, bounds=self._bounds)
        plan = self._flat_plan(self._one_size(pages))
        views = _views(*plan.addresses(np.array([[p[0]] for p in pages], dtype=np.uint64)))
        return all(self._set("batch_set", plan, keys, views))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Load one page into a CPU tensor (returned, or None if missing) or into ``target_sizes`` bytes at an
        address (True or False)."""
        result = self.batch_get([key], [target_location], None if target_sizes is None else [target_sizes])
        if isinstance(result, int):
            return result == 1
        return result[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        """Load pages into CPU tensors (a list: each tensor, or None from the first missing page on) or into
        addresses with sizes (the number of leading pages loaded)."""
        if not keys:
            return 0 if target_sizes is not None else []
        if target_locations is None:
            raise ValueError("batch_get needs target_locations: one CPU tensor (or address) per key")
        pages = _flat_pages(keys, None, target_locations, target_sizes, writable=True, bounds=self._bounds)
        plan = self._flat_plan(self._one_size(pages))
        views = _views(*plan.addresses(np.array([[p[0]] for p in pages], dtype=np.uint64)))
        loaded = self._get("batch_get", plan, keys, views)
        if target_sizes is not None:
            return sum(loaded)
        return [t if ok else None for t, ok in zip(target_locations, loaded, strict=True)]

    # -- hybrid models: the KV pool and extra pools (Mamba and SWA state, DSA indexer, draft KV) ---------

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """The usable prefix of ``keys``' pages: the stored KV prefix, cut where an extra pool cannot serve
        it (SGLang's ``PoolTransferResult``, as its file backend folds it).

        An ``ALL_PAGES`` pool must hold every page of the prefix; a ``TRAILING_PAGES`` pool (state that
        covers the tail of a prefix) the last ``len(transfer.keys)`` pages before each stop point, so the
        restorable prefixes may have holes (``restorable_prefix_pages``, which SGLang intersects across
        ranks).

        :raises ValueError: a pool that was not registered, or a hit policy other than those two.
        :raises NotImplementedError: a registered pool whose pages this backend cannot store (named).
        """
        kv_pages = self.batch_exists(keys) if keys else 0
        hits: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        prefix = list(keys[:kv_pages])
        for transfer in pool_transfers or []:
            if not restorable:
                break
            plan = self._extra_pool("batch_exists_v2", transfer.name)[0]
            blocks = plan.keys(prefix)
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = self._stored_prefix(blocks) // plan.blocks
                allowed = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                present = self._pages_present(blocks, plan.blocks)
                trailing = max(1, len(transfer.keys or ()))
                allowed = {p for p in range(1, kv_pages + 1) if all(present[max(0, p - trailing) : p])}
                boundary = max(allowed, default=0)
            else:
                raise ValueError(f"hit policy {transfer.hit_policy} of the {transfer.name} pool is not supported")
            if boundary:
                hits[transfer.name] = boundary
            restorable = [p for p in restorable if p in allowed]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> Any:
        """Load each transfer's pages (``keys``) into its pool at ``host_indices``: per pool, True for the
        leading pages found and loaded.

        :raises ValueError: a pool that was not registered, or ``host_indices`` that do not fit its keys.
        :raises NotImplementedError: a registered pool whose pages this backend cannot store (named).
        """
        return self._io_v2("batch_get_v2", transfers, load=True)

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> Any:
        """Store each transfer's pages (``keys``) from its pool at ``host_indices``: per pool, True for each
        page stored (or present already). Raises as ``batch_get_v2``."""
        return self._io_v2("batch_set_v2", transfers, load=False)

    def clear(self) -> None:
        """Not supported over a shared pool (another instance's pages are not this one's to drop): a no-op
        there; over a process-local tier, every block is dropped."""
        if self._store is None:
            return
        store = self._store

        async def drop() -> None:
            store.discard(store.keys())

        self._call("clear", drop())

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Give everything back: calls in flight are cancelled (they raise ``TierClosedError``; a page
        whose copy had not landed is never visible), the pool is detached or the store and tier closed,
        and the loop's thread ends. Idempotent (a close while another thread's runs returns once that one
        is done); safe from any thread but the loop's."""
        if self._loop.on_loop():
            raise RuntimeError("HiCacheAiokvtier.close() was called on its own loop's thread")
        with self._lock:
            closing = self._closed
            self._closed = True
            if not closing:
                self._loop.cancel_all()  # after every call already submitted: aiokvtier gives back what each held
        if closing:  # another close began (or the collector's): done when it is
            self._shut.wait()
            return
        try:
            self._loop.run(self._release())
        finally:
            try:
                self._loop.stop()
            finally:
                self._shut.set()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        log.warning("aiokvtier: a HiCacheAiokvtier was not closed; closing it on its own thread")
        self._closed = True
        try:
            self._loop.cancel_all()
            self._loop.finish_detached(self._release())
        except RuntimeError:  # pragma: no cover - the loop is gone (interpreter shutdown)
            pass

    async def _release(self) -> None:
        await self._loop.drain()  # cancelled calls end once nothing reads or writes SGLang's pages
        await close_in_turn(self._store, self._tier, self._pool)  # each whatever an earlier close raised

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        where = f"pool {self._pool!r}" if self._pool is not None else f"tier {self._tier!r}"
        return f"<HiCacheAiokvtier [{state} | {where}]>"

    # -- the bridge and the copies -------------------------------------------------------------

    def _call(self, name: str, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it here; a close meanwhile raises ``TierClosedError``."""
        if self._loop.on_loop():
            coro.close()
            raise RuntimeError(f"HiCacheAiokvtier.{name}() was called on its own loop's thread (it would deadlock)")
        with self._lock:
            if self._closed:
                coro.close()
                raise TierClosedError(f"HiCacheAiokvtier.{name}(): the storage is closed")
            call = self._loop.submit(coro)
        call.done.wait()
        if isinstance(call.error, asyncio.CancelledError):
            raise TierClosedError(
                f"HiCacheAiokvtier.{name}() was interrupted by close(): pages it was storing may or may not be "
                "stored, pages it was loading must not be used"
            )
        if call.error is not None:
            raise call.error
        result: T = call.result
        return result

    async def _backend(self) -> Any:
        """The store, or the pool (attached again once its owner is back); None while the pool is gone."""
        if self._pool is None:
            return self._store
        if self._lost_at is None:
            return self._pool
        if self._attaching is None:
            self._attaching = asyncio.Lock()
        async with self._attaching:
            now = time.monotonic()
            if self._lost_at is None or now < self._next_attach:
                return self._pool if self._lost_at is None else None
            self._next_attach = now + REATTACH_AFTER
            try:
                pool = await AttachedPool.attach(self._pool_path, prefault=True)
            except (PoolError, OSError) as exc:
                log.debug("aiokvtier: the pool at %s is not back yet: %s", self._pool_path, exc)
                return None
            if pool.slot_size != self._slot_size:
                await pool.aclose()
                log.warning(
                    "aiokvtier: the pool at %s came back with %d-byte slots, this SGLang instance's pages are "
                    "cut into %d-byte blocks: not used (restart the instance)",
                    self._pool_path, pool.slot_size, self._slot_size,
                )  # fmt: skip
                return None
            old, self._pool, self._lost_at = self._pool, pool, None
            await old.aclose()
            log.warning("aiokvtier: attached again to the pool at %s", self._pool_path)
            return pool

    def _pool_lost(self, pool: Any, exc: PoolLostError) -> None:
        """The owner of ``pool`` went away: SGLang's calls miss until it is back (warned once per loss)."""
        if pool is not self._pool or self._lost_at is not None:
            return
        self._lost_at = time.monotonic()
        self._next_attach = self._lost_at + REATTACH_AFTER
        log.warning(
            "aiokvtier: %s; SGLang's L3 misses until a pool serves %s again (tried every %.0f s)",
            exc, self._pool_path, REATTACH_AFTER,
        )  # fmt: skip

    async def _lookup(self, keys: list[bytes]) -> int:
        if self._store is not None:
            return self._store.lookup(keys)
        backend = await self._backend()
        if backend is None:
            return 0
        try:
            found: int = await backend.lookup(keys)
            return found
        except PoolLostError as exc:
            self._pool_lost(backend, exc)
            return 0

    async def _store_blocks(self, blocks: list[bytes], views: list[Any]) -> Any:
        """``store()``'s ``StoreResult``, or None while the pool is gone."""
        backend = await self._backend()
        if backend is None:
            return None
        try:
            return await backend.store(blocks, views)
        except PoolLostError as exc:
            self._pool_lost(backend, exc)
            return None

    def _set(self, name: str, plan: _Plan, keys: list[str], views: list[Any]) -> list[bool]:
        blocks = plan.keys(keys)
        start = time.perf_counter()
        result = self._call(name, self._store_blocks(blocks, views))
        seconds = time.perf_counter() - start
        if result is None:
            return [False] * len(keys)
        missed = set(result.skipped)
        n = plan.blocks
        ok = (
            [not any(blocks[i * n + j] in missed for j in range(n)) for i in range(len(keys))]
            if missed
            else [True] * len(keys)
        )
        self._counts.add(False, len(keys), len(result.stored) * plan.page_bytes // n, seconds)
        return ok

    def _get(self, name: str, plan: _Plan, keys: list[str], views: list[Any]) -> list[bool]:
        blocks = plan.keys(keys)
        start = time.perf_counter()
        pages = self._call(name, self._load(blocks, views, plan.blocks))
        self._counts.add(True, pages, pages * plan.page_bytes, time.perf_counter() - start)
        return [i < pages for i in range(len(keys))]

    async def _load(self, blocks: list[bytes], views: list[Any], per_page: int) -> int:
        """Load the stored prefix of whole pages, in one request when every page is there (SGLang loads
        what ``batch_exists`` just found). A missing block cuts the prefix before its page and the rest
        is loaded again; the prefix only shrinks, a block evicted meanwhile included."""
        backend = await self._backend()
        for _ in range(64):  # each round follows an eviction under this call: a bound, not a wait
            if not blocks or backend is None:
                return 0
            try:
                await backend.load(blocks, views[: len(blocks)])
                return len(blocks) // per_page
            except PoolLostError as exc:
                self._pool_lost(backend, exc)
                return 0
            except BlockNotFound as exc:
                try:
                    found = blocks.index(exc.key)  # type: ignore[arg-type]
                except ValueError:  # not one of ours: ask which prefix is there
                    found = await self._lookup(blocks)
                    if found == len(blocks):
                        continue
                blocks = blocks[: found // per_page * per_page]
        return 0

    def _exists_plan(self) -> _Plan:
        if self._interface_v1 or (self._flat_default is None and not self._flat):
            if self._v1 is None:
                raise RuntimeError("HiCacheAiokvtier: register_mem_pool_host() first (the page format comes from it)")
            return self._v1
        if self._flat_default is not None:
            return self._flat_plan(self._flat_default)
        return next(iter(self._flat.values()))

    def _flat_plan(self, size: int) -> _Plan:
        plan = self._flat.get(size)
        if plan is None:
            dtype = str(getattr(self.mem_pool_host, "dtype", ""))
            namespace = _namespace(self.storage_config, self._user_namespace, f"flat/{dtype}/{size}")
            plan = self._flat[size] = _plan(namespace, [size], self._slot_size)
        return plan

    @staticmethod
    def _one_size(pages: list[tuple[int, int, Any]]) -> int:
        sizes = {p[1] for p in pages}
        if len(sizes) != 1:
            raise ValueError(f"pages of one call must have one size, got {sorted(sizes)}")
        return sizes.pop()

    def _io_v2(self, call: str, transfers: Any, *, load: bool) -> dict[Any, list[bool]]:
        # Every transfer is checked (and its views made) before any is copied: a bad one changes nothing.
        work: list[tuple[Any, list[str], _Plan | None, list[Any]]] = []
        seen: set[str] = set()
        for transfer in transfers or []:
            keys = _transfer_keys(call, transfer)
            if str(transfer.name) in seen:
                raise ValueError(f"{call}: the {transfer.name} pool has two transfers in one call; nothing was copied")
            seen.add(str(transfer.name))
            if not keys and transfer.host_indices is None:
                work.append((transfer.name, keys, None, []))  # nothing to move, as SGLang's file backend answers
                continue
            plan, host, bounds = self._extra_pool(call, transfer.name)
            work.append((transfer.name, keys, plan, self._pages(plan, host, bounds, keys, transfer.host_indices)))
        results: dict[Any, list[bool]] = {}
        for name, page_keys, format_, views in work:
            if format_ is None or not page_keys:
                results[name] = []
            elif load:
                results[name] = self._get(call, format_, page_keys, views)
            else:
                results[name] = self._set(call, format_, page_keys, views)
        return results

    def _extra_pool(self, call: str, name: Any) -> tuple[_Plan, Any, tuple[U64, U64]]:
        """The plan, host pool and buffers of the pool ``name`` (the KV pool: the ``*_v1`` pages)."""
        if str(name) == PoolName.KV.value:
            return self._kv_pool()
        extra = self._extra.get(str(name))
        if extra is None:
            raise ValueError(f"{call}: the {name} pool was never registered (register_mem_host_pool_v2)")
        if extra.plan is None:
            raise NotImplementedError(f"{call}: aiokvtier does not store SGLang's {name} pool: {extra.why}")
        return extra.plan, extra.host, extra.bounds

    def _stored_prefix(self, blocks: list[bytes]) -> int:
        """How many leading blocks are stored: over a pool, read from its index mirror on the calling thread
        (as ``batch_exists``); else on the loop."""
        pool = self._pool
        found = pool.lookup_nowait(blocks) if pool is not None and not self._closed and blocks else None
        return found if found is not None else self._call("batch_exists_v2", self._lookup(blocks))

    def _pages_present(self, blocks: list[bytes], per_page: int) -> list[bool]:
        """Whether each page's blocks are all stored: over a pool, one read of its index mirror on the calling
        thread (as ``batch_exists``); else on the loop."""
        if not blocks:
            return []
        pool = self._pool
        found = pool.contains_nowait(blocks) if pool is not None and not self._closed else None
        if found is None:
            found = self._call("batch_exists_v2", self._contains(blocks))
        whole: list[bool] = np.logical_and.reduce(found.reshape(-1, per_page), axis=1).tolist()
        return whole

    async def _contains(self, blocks: list[bytes]) -> npt.NDArray[np.bool_]:
        if self._store is not None:
            store = self._store
            return np.fromiter((block in store for block in blocks), dtype=np.bool_, count=len(blocks))
        backend = await self._backend()
        if backend is None:
            return np.zeros(len(blocks), dtype=np.bool_)
        try:
            found: npt.NDArray[np.bool_] = await backend.contains(blocks)
            return found
        except PoolLostError as exc:
            self._pool_lost(backend, exc)
            return np.zeros(len(blocks), dtype=np.bool_)

    def _kv_pool(self) -> tuple[_Plan, Any, tuple[U64, U64]]:
        """The KV pool's page format, host pool and buffers (``register_mem_pool_host``)."""
        if self._v1 is None or self.mem_pool_host is None:
            raise RuntimeError("HiCacheAiokvtier: register_mem_pool_host() first (the KV pool's pages come from it)")
        return self._v1, self.mem_pool_host, self._bounds

    def _pool_pages(self, keys: list[str], host_indices: Any) -> tuple[_Plan, list[Any]]:
        """The block views of the pages at ``host_indices`` in the registered host pool."""
        if not isinstance(keys, list | tuple):
            raise TypeError(f"SGLang's keys are a list of str, not {type(keys).__name__}; nothing was copied")
        plan, host, bounds = self._kv_pool()
        return plan, self._pages(plan, host, bounds, keys, host_indices)

    @staticmethod
    def _pages(plan: _Plan, host: Any, bounds: tuple[U64, U64], keys: list[str], host_indices: Any) -> list[Any]:
        """The block views of the pages at ``host_indices`` of ``host`` (a pool whose format is ``plan``'s)."""
        if not isinstance(host_indices, torch.Tensor):
            raise TypeError(f"host_indices must be a torch.Tensor, not {type(host_indices).__name__}")
        if host_indices.is_floating_point() or host_indices.is_complex() or host_indices.dtype == torch.bool:
            raise TypeError(f"host_indices must be an integer tensor, not {host_indices.dtype}; nothing was copied")
        if host_indices.dim() != 1:
            raise ValueError(f"host_indices must be 1-D, got shape {tuple(host_indices.shape)}; nothing was copied")
        page_size = int(host.page_size)
        if host_indices.numel() != len(keys) * page_size:
            raise ValueError(
                f"{len(keys)} keys need {len(keys) * page_size} host indices ({page_size} per page), "
                f"got {host_indices.numel()}; nothing was copied"
            )
        if not keys:
            return []
        indices = host_indices.to(device="cpu", dtype=torch.int64)
        # Checked in numpy (the tensor's own memory): a torch operation costs several microseconds more.
        flat = indices.numpy()
        low, high = int(flat.min()), int(flat.max())
        size = getattr(host, "size", None)
        # A page is where its index says, in the pool's own range: an address check alone would let a page
        # land in another tensor the pool holds (its allocator's free list), and the memmove overwrite it.
        if low < 0 or (isinstance(size, int) and high >= size):
            raise ValueError(
                f"host_indices point outside the registered host pool (indices 0 to {size}, got "
                f"{low} to {high}); nothing was copied"
            )
        pages = flat.reshape(len(keys), page_size)
        if page_size > 1 and (
            bool((pages[:, 0] % page_size).any()) or bool((pages - pages[:, :1] != np.arange(page_size)).any())
        ):
            raise ValueError(
                f"host_indices must be whole pages ({page_size} consecutive indices from a multiple of {page_size} "
                "per key); nothing was copied"
            )
        ptrs, sizes = host.get_page_buffer_meta(indices)
        ptrs = _flatten(ptrs)
        if len(ptrs) != len(keys) * len(plan.spans) or tuple(_flatten(sizes)[: len(plan.spans)]) != plan.spans:
            raise ValueError("the host pool's page spans changed since it was registered; nothing was copied")
        addresses, lengths = plan.addresses(np.array(ptrs, dtype=np.uint64).reshape(len(keys), len(plan.spans)))
        lo, hi = bounds
        if lo.size:  # memmove outside SGLang's buffers would kill the process, not raise
            inside = (addresses[:, None] >= lo) & (addresses[:, None] + lengths[:, None] <= hi)
            if not bool(inside.any(axis=1).all()):
                raise ValueError("host_indices point outside the registered host pool's buffers; nothing was copied")
        return _views(addresses, lengths)


def _buffers(host: Any) -> tuple[U64, U64]:
    """Where the host pool's tensors lie (start and end addresses), to check the pages a call names."""
    tensors = [getattr(host, name, None) for name in ("kv_buffer", "k_buffer", "v_buffer")]
    if hasattr(host, "get_hybrid_pool_buffer"):
        tensors.extend(host.get_hybrid_pool_buffer())
    bounds = _bounds_of(tensors)
    if not bounds[0].size:
        log.warning("aiokvtier: the host pool shows no CPU buffer: the *_v1 calls' pages are not checked")
    return bounds


def _bounds_of(tensors: Sequence[Any]) -> tuple[U64, U64]:
    """The start and end addresses of the non-empty CPU tensors among ``tensors`` (other objects skipped)."""
    spans = {
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for t in tensors
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel()
    }
    return np.array([a for a, _ in spans], dtype=np.uint64), np.array([b for _, b in spans], dtype=np.uint64)


def _transfer_keys(call: str, transfer: Any) -> list[str]:
    """A transfer's keys, checked: None or a list of distinct str.

    :raises TypeError: keys that are not a list of str.
    :raises ValueError: a key twice in one transfer (its page would be stored from, or loaded into, two places).
    """
    keys = transfer.keys
    if keys is None:
        return []
    if not isinstance(keys, list | tuple) or operator.countOf(map(type, keys), str) != len(keys):
        raise TypeError(f"{call}: the {transfer.name} pool's keys must be a list of str; nothing was copied")
    if len(set(keys)) != len(keys):
        twice = next(k for i, k in enumerate(keys) if k in keys[:i])
        raise ValueError(f"{call}: the {transfer.name} pool's key {twice!r} appears twice; nothing was copied")
    return list(keys)


def _pool_buffers(host: Any) -> tuple[U64, U64]:
    """Where an extra host pool's tensors lie: every CPU tensor it holds, alone or in a list (a Mamba
    pool's temporal and conv state buffers), so that a page it names is checked to lie in one."""
    tensors: list[Any] = []
    for value in vars(host).values():
        tensors.extend(value if isinstance(value, list | tuple) else [value])
    return _bounds_of(tensors)


def _flatten(items: Sequence[Any]) -> list[Any]:
    """SGLang's buffer metadata: a flat list, or a list per page (multi-buffer pools)."""
    if items and isinstance(items[0], list | tuple):
        return [x for group in items for x in group]
    return list(items)


def _flat_pages(
    keys: list[str], values: Any, locations: Any, sizes: Any, *, writable: bool, bounds: tuple[U64, U64]
) -> list[tuple[int, int, Any]]:
    """``(address, nbytes, owner)`` per key: from CPU tensors, or from addresses and sizes (each range in
    memory of this process, and one that starts in a buffer of SGLang's host pool, ``bounds``, within it).

    :raises ValueError: counts that do not match the keys, a tensor not on the CPU, a read-only target,
        an address range outside this process's memory or running past the end of a host pool buffer.
    """
    if values is None and locations is not None and sizes is None:
        values = locations  # get(): the target tensors
    if values is not None:
        if len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(values)} tensors; nothing changed")
        out = []
        for value in values:
            if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
                raise ValueError(
                    f"a page must be a CPU tensor, not {type(value).__name__} on {getattr(value, 'device', '?')}"
                )
            if writable and not value.is_contiguous():
                raise ValueError("a target page tensor must be contiguous (it is written in place)")
            if not value.numel():
                raise ValueError("a page of 0 bytes: nothing to store or load; nothing changed")
            owner = value.contiguous()
            out.append((owner.data_ptr(), owner.numel() * owner.element_size(), owner))
        return out
    if locations is None or sizes is None or len(locations) != len(keys) or len(sizes) != len(keys):
        raise ValueError("pages are CPU tensors, or one address (target_locations) and one size (target_sizes) per key")
    out = []
    for address, size in zip(locations, sizes, strict=True):
        if type(address) is not int or type(size) is not int or address <= 0 or size <= 0:
            raise ValueError(f"an address and a size are positive ints, got {address!r} and {size!r}")
        out.append((address, size, None))
    lo, hi = bounds
    elsewhere = out
    if lo.size:  # past a buffer's end lie other tensors: mapped, so the check below would let it through
        starts = np.array([a for a, _, _ in out], dtype=np.uint64)
        ends = starts + np.array([n for _, n, _ in out], dtype=np.uint64)
        inside = (starts[:, None] >= lo) & (starts[:, None] < hi)
        over = inside & (ends[:, None] > hi)
        if bool(over.any()):
            i = int(np.flatnonzero(over.any(axis=1))[0])
            raise ValueError(
                f"{out[i][1]} bytes at address {out[i][0]:#x} run past the end of a buffer of SGLang's host pool; "
                "nothing changed"
            )
        # Pages in SGLang's own buffers (the usual call) are its memory: the memory map is read for the others.
        elsewhere = [out[int(i)] for i in np.flatnonzero(~np.asarray(inside).any(axis=1))]
    # A memmove from or to memory this process does not map (so) kills it: refuse instead.
    bad = _unmapped([(a, n) for a, n, _ in elsewhere], writable=writable) if elsewhere else None
    if bad is not None:
        access = "writable" if writable else "readable"
        raise ValueError(
            f"{bad[1]} bytes at address {bad[0]:#x} are not all {access} memory of this process; nothing changed"
        )
    return out


def _unmapped(spans: list[tuple[int, int]], *, writable: bool) -> tuple[int, int] | None:
    """The first ``(address, size)`` of ``spans`` not wholly in readable (and, with ``writable``, writable)
    mappings of this process; None if each is. Reads ``/proc/self/maps``: the pointer form only."""
    with open("/proc/self/maps") as maps:
        regions: list[tuple[int, int, str]] = []
        for line in maps:
            where, access = line.split(maxsplit=2)[:2]
            first, _, last = where.partition("-")
            regions.append((int(first, 16), int(last, 16), access))
    starts = [region[0] for region in regions]
    needs = ("r", "w") if writable else ("r",)
    for address, size in spans:
        at, end = address, address + size
        i = bisect.bisect_right(starts, at) - 1
        while at < end and 0 <= i < len(regions):
            lo, hi, perms = regions[i]
            if not lo <= at < hi or not all(p in perms for p in needs):
                break
            at, i = hi, i + 1
        if at < end:
            return address, size
    return None
