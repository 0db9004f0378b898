"""vLLM's offloading over the machine-wide pool: the scheduler's manager and the worker, by key.

Chosen by ``kv_connector_extra_config["aiokvtier"] = {"pool": PATH}`` (``aiokvtier.integrations.vllm``
builds these). Every vLLM engine of the host (DP replicas, separate servers) attaches to one pool and
shares what any of them stored.

Keys. vLLM names a chunk (``blocks_per_chunk`` GPU blocks of one KV cache group) by its offload key
(block-hash bytes and the group). A worker rank's share of a chunk is ``n`` pool blocks: for each KV
tensor of the group and each block of the chunk, the page cut into slot-sized pieces. Block ``i`` of rank
``r`` is ``namespace + offload key + r (2 bytes) + i (4 bytes)``; with it, in the same store (so visible
at the same commit), the rank stores a seal (``i = 0xFFFFFFFF``) whose 8 bytes say ``n``. The namespace
is a digest of what makes two engines' pages the same bytes (model, dtype, layout, block geometry, the
parallel sizes), and leaves out the DP index: replicas share. ``_pool_jobs`` plans and runs the
worker's copies, without vLLM.

Lookups. A chunk is a hit when the pool holds every rank's seal and blocks. The scheduler never sees a
KV tensor, so it learns ``n`` from the seals of the first chunk it finds by its seals (once per group).
The answer comes from the pool's index mirror on the scheduler's thread (``AttachedPool.lookup_nowait``),
from the owner only when the mirror cannot answer; a request's chunks after its first are read together
at the step's end (``PoolOffloadingManager.lookup``).

Nothing pins a block between the scheduler's lookup and the worker's load, so another process may evict
it meanwhile. The worker then loads the leading blocks still there and reports the rest as vLLM's load
errors (``AiokvtierOffloadingConnector``), which vLLM recomputes: a load never copies wrong bytes.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import logging
import threading
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from .. import AttachedPool, BlockNotFound, CopyEngine, CudaError, CudaUnavailableError, PoolError, PoolLostError
from ._pool_jobs import SEAL, SEAL_BYTES, SUFFIX, KVTensor, PoolJob, PoolJobs, block_key, seal_count, tensors_device
from .vllm import EXTRA_KEY, _cancel_all, _LoopThread, _would_wait, job_blocks

__all__ = [
    "SEAL",
    "PoolLoadStoreSpec",
    "PoolOffloadingManager",
    "PoolOffloadingWorker",
    "block_key",
    "namespace",
    "pool_section",
]

log = logging.getLogger(__name__)

REATTACH_AFTER = 1.0
"""Seconds between attempts to attach again to a pool whose owner went away (meanwhile lookups miss,
stores are dropped and loads fail: vLLM recomputes)."""

_POOL_KEYS = frozenset({"pool", "namespace"})
_REFUSED = {
    "eviction_policy": "lru",
    "cache_policy_module_path": None,
    "store_threshold": 0,
}
"""Manager settings of vLLM's CPU tier the pool does not take (its owner evicts), with the values that
mean 'not set'."""


def pool_section(extra_config: Mapping[str, Any]) -> dict[str, str] | None:
    """The pool settings of ``kv_connector_extra_config``, checked; None when no pool is named.

    :raises ValueError: a bad or unknown key, or a CPU tier setting the pool does not take; the message
        names it.
    """
    raw = extra_config.get(EXTRA_KEY)
    if not isinstance(raw, Mapping) or "pool" not in raw:
        return None
    where = f"kv_connector_extra_config[{EXTRA_KEY!r}]"
    unknown = sorted(set(raw) - _POOL_KEYS)
    if unknown:
        raise ValueError(f"{where}: {unknown} cannot go with 'pool' (the pool's owner sets the tier; known: "
                         f"{sorted(_POOL_KEYS)})")  # fmt: skip
    path = raw["pool"]
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where}['pool'] must be the pool's socket path, got {path!r}")
    namespace = raw.get("namespace", "")
    if not isinstance(namespace, str):
        raise ValueError(f"{where}['namespace'] must be a string, got {type(namespace).__name__}")
    for name, unset in _REFUSED.items():
        value = extra_config.get(name, unset)
        if value != unset and not (name == "store_threshold" and value in (0, 1)):
            raise ValueError(
                f"kv_connector_extra_config[{name!r}] is not supported with a pool: the pool's owner evicts "
                "(least recently used, shared by every process); leave it out"
            )
    return {"pool": path, "namespace": namespace}


def namespace(config: OffloadingConfig, user: str) -> bytes:
    """A digest of what makes two engines' pages the same bytes; the DP index is left out (replicas share)."""
    parallel = config.parallel
    parts = [
        "vllm-offload/1",
        user,
        config.model.name,
        config.model.dtype,
        str(config.kv_cache_layout),
        ";".join(f"{g.group_id}/{g.tokens_per_block}/{len(g.layer_names)}" for g in config.groups),
        f"hash{config.cache.tokens_per_hash}/chunk{config.cache.blocks_per_chunk}",
        f"bytes{config.worker_kv_bytes_per_block}",
        f"world{parallel.world_size}/tp{parallel.tp_size}/pp{parallel.pp_size}",
        f"pcp{parallel.pcp_size}/dcp{parallel.dcp_size}",
    ]
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=8).digest()


def _key_bytes(key: object) -> bytes:
    # bytes(5) is five zero bytes: an int key would name another chunk without a word.
    if not isinstance(key, bytes | bytearray | memoryview):
        raise TypeError(f"an offload key is bytes, not {type(key).__name__}")
    return bytes(key)


class PoolLoadStoreSpec(LoadStoreSpec):
    """The pool side of a job: the chunks' offload keys, in the job's order (each worker adds its rank)."""

    def __init__(self, keys: Iterable[bytes]) -> None:
        self.keys: tuple[bytes, ...] = tuple(_key_bytes(k) for k in keys)

    def __repr__(self) -> str:
        return f"PoolLoadStoreSpec({len(self.keys)} chunks)"


class _Link:
    """The attached pool of one process, attached again (every ``REATTACH_AFTER`` s) once its owner is back;
    given up for good if it comes back with another slot size.

    Lives on the runner's loop; ``current`` may be read from any thread.
    """

    def __init__(self, path: str, *, prefault: bool, device: int | None = None) -> None:
        self.path = path
        self._prefault = prefault
        self._device = device
        self.current: AttachedPool | None = None
        self.slot_size: int | None = None
        """The slot size of the first pool attached: the worker's pages are cut into pieces of it, and a pool
        of another size (an owner restarted with other settings) is not used (its keys would name pieces cut
        otherwise: another engine's loads would copy them into the wrong places)."""
        self._gave_up = False
        """A pool of another slot size came back: never attached again (each attempt mapped the tier, and a
        GPU worker registered it, to drop it again)."""
        self._lost_at: float | None = None
        self._next = 0.0
        self._closed = False

    async def attach(self) -> None:
        # Returns once attached: the first state push, not the pool's fill.
        self.current = await AttachedPool.attach(self.path, device=self._device, prefault=self._prefault)
        self.slot_size = self.current.slot_size

    async def get(self) -> AttachedPool | None:
        """The pool, or None while its owner is away (and once closed or given up)."""
        if self._lost_at is None or self._closed or self._gave_up:
            return self.current
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + REATTACH_AFTER
        try:
            pool = await AttachedPool.attach(self.path, device=self._device, prefault=self._prefault)
        except (PoolError, OSError) as exc:
            log.debug("aiokvtier: the pool at %s is not back yet: %s", self.path, exc)
            return None
        except (CudaError, CudaUnavailableError) as exc:
            # The pool is back, but making its memory GPU-usable here failed: a miss, as while it was away
            # (a job that raised instead failed, and vLLM's, with it), and another try after the period.
            log.warning(
                "aiokvtier: the pool at %s is back but could not be registered with the GPU here: %s; vLLM's "
                "offloading misses until a later attempt succeeds",
                self.path,
                exc,
            )
            return None
        if pool.slot_size != self.slot_size:
            self._gave_up = True
            old, self.current = self.current, None
            await pool.aclose()
            if old is not None:
                await old.aclose()
            log.error(
                "aiokvtier: the pool at %s is back with %d-byte slots, not %d: given up (this engine's keys name "
                "pieces of the old size); vLLM's offloading misses from now on: restart the engine to use the pool",
                self.path,
                pool.slot_size,
                self.slot_size,
            )
            return None
        old, self.current, self._lost_at = self.current, pool, None
        if old is not None:
            await old.aclose()
        log.warning("aiokvtier: attached again to the pool at %s", self.path)
        return pool

    def lost(self, pool: AttachedPool, exc: PoolLostError) -> None:
        if pool is not self.current or self._lost_at is not None:
            return
        self._lost_at = time.monotonic()
        self._next = self._lost_at + REATTACH_AFTER
        log.warning("aiokvtier: %s; vLLM's offloading misses until a pool serves %s again", exc, self.path)

    async def aclose(self) -> None:
        self._closed = True  # attaches no more
        pool, self.current = self.current, None
        if pool is not None:
            await pool.aclose()


def _group(offload_key: bytes) -> int:
    """The KV cache group of an offload key (vLLM's ``get_offload_group_idx``)."""
    return int.from_bytes(offload_key[-4:], "big")


def _key_rows(ns: bytes, offload_key: bytes, suffixes: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """The pool keys ``ns + offload_key + suffix`` as the rows of one array (no Python object per key)."""
    head = len(ns) + len(offload_key)
    rows = np.empty((len(suffixes), head + SUFFIX.size), dtype=np.uint8)
    rows[:, :head] = np.frombuffer(ns + offload_key, dtype=np.uint8)
    rows[:, head:] = suffixes
    return rows


def _suffixes(pairs: Iterable[tuple[int, int]]) -> npt.NDArray[np.uint8]:
    raw = b"".join(SUFFIX.pack(rank, i) for rank, i in pairs)
    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, SUFFIX.size)


class PoolOffloadingManager(OffloadingManager):
    """The scheduler's books over the pool: a chunk is offloaded when the pool holds it for every rank.

    The pool keeps the only record (what any engine stored, what its owner evicted); this manager keeps
    only its own stores in flight, which are ``HIT_PENDING`` until ``complete_store``. ``prepare_store``
    never evicts (the owner does, at store time) and never refuses; ``evicted_keys`` is empty, and the
    evictions come through ``take_events`` with the stores, whichever engine caused them.

    Threads: vLLM's scheduler thread calls it; it attaches on a loop thread of its own
    (``aiokvtier-vllm-scheduler``), used only when the mirror cannot answer and for the pool's events.

    :raises PoolError: no pool answers at the path (start the pool first).
    """

    def __init__(self, config: OffloadingConfig, settings: Mapping[str, str]) -> None:
        self._ns = namespace(config, settings["namespace"])
        self._ranks = max(int(config.parallel.world_size), 1)
        self._storing: collections.Counter[bytes] = collections.Counter()
        self._fresh: dict[bytes, bool] = {}
        """What the pool held of chunks read in this step (and at its end)."""
        self._last: dict[bytes, bool] = {}
        """What it held of those read in the last step."""
        self._queued: dict[str, list[bytes]] = {}
        """Per request, the chunks whose lookup answered RETRY in this step, to read at its end."""
        self._blocks: dict[int, tuple[int, ...]] = {}
        """Per KV cache group, each rank's block count of a chunk (learned from the seals)."""
        self._suffixes: dict[int, npt.NDArray[np.uint8]] = {}
        self._seals = _suffixes((rank, SEAL) for rank in range(self._ranks))
        self._events: collections.deque[OffloadingEvent] | None = (
            collections.deque() if config.enable_kv_cache_events else None
        )
        self._closed = False
        self._runner = _LoopThread("aiokvtier-vllm-scheduler")
        self._link = _Link(settings["pool"], prefault=False)  # it copies only the seals
        self._watcher: asyncio.Task[None] | None = None
        try:
            self._runner.call(self._link.attach())
            if self._events is not None:
                self._watcher = self._runner.call(self._start_watching())
        except BaseException:
            self._runner.call(self._link.aclose())
            self._runner.stop()
            raise

    # -- lookups -----------------------------------------------------------------------------

    def _rows(self, key: bytes) -> npt.NDArray[np.uint8]:
        group = _group(key)
        suffixes = self._suffixes.get(group)
        if suffixes is None:
            blocks = self._blocks.get(group)
            if blocks is None:
                return _key_rows(self._ns, key, self._seals)
            pairs = [(rank, SEAL) for rank in range(self._ranks)]
            pairs += [(rank, i) for rank, n in enumerate(blocks) for i in range(n)]
            suffixes = self._suffixes[group] = _suffixes(pairs)
        return _key_rows(self._ns, key, suffixes)

    def _count(self, rows: npt.NDArray[np.uint8]) -> int:
        """How many leading rows the pool holds: from the mirror here, from the owner when it cannot say."""
        pool = self._link.current
        found = None if pool is None else pool.lookup_nowait(rows)
        if found is None:
            found = self._runner.call(self._lookup(rows))
        return found

    def _present(self, keys: Sequence[bytes]) -> list[bool]:
        """Which chunks the pool holds for every rank, in one read of the mirror (not one per chunk).

        The read answers the leading chunks that are there; those after the first that is not are
        answered absent too (vLLM's lookup stops at a miss anyway): a chunk taken for absent is stored
        again (the pool copies nothing it holds) or computed, never loaded wrong.
        """
        answers = [False] * len(keys)
        if not keys:
            return answers
        rows = [self._rows(k) for k in keys]
        ends = np.cumsum([len(r) for r in rows])
        whole = int(np.searchsorted(ends, self._count(np.concatenate(rows)), side="right"))
        answers[:whole] = [True] * whole
        unknown = {_group(k) for k in keys[:whole]} - set(self._blocks)
        if unknown:
            # Found by their seals alone: learn each group's block counts from one chunk's seals, then ask
            # again with every block (which the hits then mark referenced, for the owner's eviction).
            for group in unknown:
                first = next(k for k, a in zip(keys, answers, strict=True) if a and _group(k) == group)
                if not self._learn(first, group):
                    answers = [a and _group(k) != group for k, a in zip(keys, answers, strict=True)]
            again = [i for i, k in enumerate(keys) if answers[i] and _group(k) in unknown]
            for i, present in zip(again, self._present([keys[i] for i in again]), strict=True):
                answers[i] = present
        return answers

    async def _lookup(self, rows: npt.NDArray[np.uint8]) -> int:
        pool = await self._link.get()
        if pool is None:
            return 0
        try:
            return await pool.lookup(rows)
        except PoolLostError as exc:
            self._link.lost(pool, exc)
            return 0

    def _learn(self, key: bytes, group: int) -> bool:
        """Reads each rank's seal of ``key`` for the group's block counts; False if they are gone or bad."""
        counts = self._runner.call(self._read_seals(_key_rows(self._ns, key, self._seals)))
        if counts is None:
            return False
        self._blocks[group] = counts
        return True

    async def _read_seals(self, rows: npt.NDArray[np.uint8]) -> tuple[int, ...] | None:
        pool = await self._link.get()
        if pool is None:
            return None
        out = np.zeros((len(rows), SEAL_BYTES.size), dtype=np.uint8)
        try:
            copied = await pool.load([row.tobytes() for row in rows], out)
        except PoolLostError as exc:
            self._link.lost(pool, exc)
            return None
        except BlockNotFound:
            return None
        except ValueError:  # a block longer than a seal under a seal's key
            copied = [0] * len(rows)
        counts = []
        most = pool.max_quota // pool.slot_size  # a rank's blocks of one chunk never outnumber the pool's slots
        for row, size in zip(out, copied, strict=True):
            # A seal cut short reads zero-padded here; no rank's share of a chunk is empty.
            n = seal_count(row.tobytes()) if size == SEAL_BYTES.size else None
            if n is None or not 0 < n <= most:
                break
            counts.append(n)
        if len(counts) != len(rows):
            log.warning("aiokvtier: a chunk's seal in the pool is not one this version writes: ignored")
            return None
        return tuple(counts)

    # -- vLLM's OffloadingManager --------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when the pool holds the chunk for every rank; HIT_PENDING while this engine stores it.

        vLLM asks chunk by chunk, and a read of the mirror costs about the same for one chunk as for many:
        a request's first chunk not answered lately is read at once (a miss ends the lookup there), and
        when it is there, the request's later chunks answer RETRY and are read together at the step's
        end; vLLM asks again at the next step, and they answer from that read.
        """
        if self._storing[key]:
            return LookupResult.HIT_PENDING
        known = self._fresh.get(key)
        if known is None:
            known = self._last.get(key)
        if known is not None:
            return LookupResult.HIT if known else LookupResult.MISS
        queued = self._queued.get(req_context.req_id)
        if queued is not None:
            queued.append(key)
            return LookupResult.RETRY
        (present,) = self._present([key])
        self._fresh[key] = present
        if not present:
            return LookupResult.MISS
        self._queued[req_context.req_id] = []
        return LookupResult.HIT

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Reads the chunks that lookups queued in this step (one read a request); their answers, and
        this step's, hold for the next step."""
        for keys in self._queued.values():
            if keys:
                keys = list(dict.fromkeys(keys))
                self._fresh.update(zip(keys, self._present(keys), strict=True))
        self._queued.clear()
        self._last, self._fresh = self._fresh, {}

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """The keys, for the workers (nothing is pinned: a block evicted before the load is a load error)."""
        return PoolLoadStoreSpec(keys)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Marks the chunks referenced in the pool (a lookup's hit does, for the owner's eviction): one read."""
        keys = [k for k in keys if not self._storing[k]]
        if keys:
            self._present(keys)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput:
        """The chunks neither in the pool nor being stored by this engine; the owner evicts for them."""
        offered = [k for k in dict.fromkeys(keys) if not self._storing[k]]
        todo = [k for k, present in zip(offered, self._present(offered), strict=True) if not present]
        self._storing.update(todo)
        return PrepareStoreOutput(keys_to_store=todo, store_spec=PoolLoadStoreSpec(todo), evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        """The store ended: the chunks are what the pool says (stored, or skipped when it was full)."""
        self._storing.subtract(keys)
        for key in keys:
            if self._storing[key] <= 0:
                del self._storing[key]
            self._fresh.pop(key, None)  # read again at the next lookup
            self._last.pop(key, None)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def reset_cache(self) -> None:
        """Forgets the answers of recent lookups; the pool's blocks are every engine's, not this one's to drop."""
        self._fresh.clear()
        self._last.clear()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The pool's stores and removals of chunks (by rank 0's seal), from any engine, since the last call."""
        events = self._events
        if events is None:
            return ()
        out = []
        while events:
            out.append(events.popleft())
        return out

    async def _start_watching(self) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """Turns the pool's events into vLLM's (for the life of the manager, across reattaches)."""
        assert self._events is not None
        events = self._events
        head, tail = len(self._ns), SUFFIX.pack(0, SEAL)
        while not self._closed:
            pool = await self._link.get()
            if pool is None:
                await asyncio.sleep(REATTACH_AFTER)
                continue
            try:
                subscription = await pool.events()
                async for event in subscription:
                    keys = [
                        OffloadKey(k[head : -len(tail)])
                        for k in event.keys
                        if isinstance(k, bytes) and k.startswith(self._ns) and k.endswith(tail)
                    ]
                    if keys:
                        events.append(OffloadingEvent(keys=keys, medium=Medium.CPU, removed=event.kind != "stored"))
            except PoolLostError as exc:
                self._link.lost(pool, exc)
            if not self._closed and self._link.current is pool:
                # The subscription ended with the pool still current: its owner is closing.
                await asyncio.sleep(REATTACH_AFTER)

    def shutdown(self) -> None:
        """Detaches from the pool and stops the loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._runner.call(self._close())
        finally:
            self._runner.stop()

    async def _close(self) -> None:
        watcher = self._watcher
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        await self._link.aclose()


# -- the worker --------------------------------------------------------------------------------------


class PoolOffloadingWorker(OffloadingWorker):
    """Copies KV blocks between vLLM's KV cache tensors and the pool, by key (``PoolJobs`` plans and runs
    the copies; this class turns vLLM's specs into its jobs and reports their ends).

    KV tensors in host memory (CPU tensors: tests, development machines) are copied with ``memmove`` on
    the attached pool's own thread, straight between the tensors and the slots. KV tensors on a CUDA
    device: the worker attaches with ``device=`` (the pool's memory registered with this process's
    context) and copies the pages with a ``CopyEngine`` of its own on that device, after the work queued
    on the caller's current stream at the ``submit_*`` call (an event recorded there); the seals go with
    them, from a copy of their few bytes on the same device. All KV tensors lie on one device.

    A store is one call of the pool's: each chunk's pages and its seal, claimed and committed together,
    so a chunk is whole or absent. It reports success when it ended, whatever the pool kept: a pool that
    was full skipped what did not fit, and the scheduler, which asks the pool, sees those chunks missing.
    A store cancelled by ``shutdown`` reports a failure. A load whose blocks the pool no longer holds
    loads the leading ones that are there; the GPU blocks of the rest are load errors
    (``take_load_errors``). With
    ``report_load_errors`` set (``AiokvtierOffloadingConnector`` sets it) such a load ends as a success
    and vLLM recomputes the blocks named; without it, as a failure (vLLM's stock ``OffloadingConnector``
    then stops: it takes no failed job).

    Threads: the ``submit_*`` calls, ``get_finished``, ``take_load_errors`` and ``wait`` may come from any
    thread; the copies run on the ``aiokvtier-vllm`` loop thread.

    :raises ValueError: KV tensors on several devices or on one neither host nor CUDA, or not one block
        a row.
    :raises PoolError: no pool answers at the path.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, *, config: OffloadingConfig, settings: Mapping[str, str]) -> None:
        tensors = [entry.tensor for entry in kv_caches.tensors]
        device = tensors_device(tensors)
        layout = [KVTensor.of(t, int(e.page_size_bytes)) for t, e in zip(tensors, kv_caches.tensors, strict=True)]
        groups = [tuple(dict.fromkeys(ref.tensor_idx for ref in refs)) for refs in kv_caches.group_data_refs]
        if not any(groups):
            raise ValueError("no KV cache group references a tensor")
        self._tensors_held = tensors  # their memory must outlive every copy
        self._device = device
        self._finished: collections.deque[TransferResult] = collections.deque()
        self._errors: set[int] = set()
        self._errors_lock = threading.Lock()
        self.report_load_errors = False
        self._pending: dict[int, concurrent.futures.Future[None]] = {}
        self._lock = threading.Lock()
        self._closing = False
        self._shut = threading.Event()
        """Set once the shutdown has ended (a second caller waits for it)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._engine: CopyEngine | None = None
        self._runner = _LoopThread("aiokvtier-vllm")
        self._link = _Link(settings["pool"], prefault=device is None, device=device)
        try:
            self._runner.call(self._link.attach())
            assert self._link.current is not None
            self._jobs = PoolJobs(
                layout,
                groups,
                namespace=namespace(config, settings["namespace"]),
                rank=int(config.parallel.rank),
                blocks_per_chunk=int(config.cache.blocks_per_chunk),
                slot_size=self._link.current.slot_size,
                device=device,
            )
            if device is not None:
                self._engine = self._runner.call(CopyEngine.open(device))
        except BaseException:
            self._runner.call(self._link.aclose())
            self._runner.stop()
            raise
        self.slot_size = self._jobs.slot_size
        self.blocks_per_chunk: list[int] = self._jobs.blocks_per_chunk
        """Per KV cache group, this rank's pool blocks of a chunk."""

    @property
    def namespace(self) -> bytes:
        """The first bytes of every pool key of this engine (``namespace()`` of its config)."""
        return self._jobs.namespace

    # -- planning (on the caller's thread) ----------------------------------------------------

    def _plan(self, job_id: int, gpu: LoadStoreSpec, host: LoadStoreSpec, *, store: bool) -> PoolJob:
        if not isinstance(gpu, GPULoadStoreSpec):
            raise TypeError(f"the GPU side is a GPULoadStoreSpec, not {type(gpu).__name__}")
        if not isinstance(host, PoolLoadStoreSpec):
            raise TypeError(f"the pool side is a PoolLoadStoreSpec, not {type(host).__name__}")
        jobs = self._jobs
        sizes, ids = job_blocks(gpu, jobs.groups, jobs.num_blocks)
        firsts = list(gpu.block_indices)  # checked by the plan, not cut to ints here
        return jobs.plan(job_id, store=store, chunks=host.keys, sizes=sizes, first_blocks=firsts, ids=ids)

    def _after(self) -> Any:
        """An event after the work queued so far on the caller's current stream (None for host tensors):
        a store reads what the model wrote, a load overwrites blocks the stream may still use."""
        if self._device is None:
            return None
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    # -- jobs -------------------------------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Queue GPU blocks -> pool. Returns at once; the result comes from ``get_finished``."""
        return self._submit(self._plan(job_id, src_spec, dst_spec, store=True))

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        """Queue pool -> GPU blocks. ``expedited`` changes nothing: no load queues behind another here."""
        return self._submit(self._plan(job_id, dst_spec, src_spec, store=False))

    def _submit(self, job: PoolJob) -> bool:
        with self._lock:
            if self._closing:
                return False
            if job.job_id in self._pending:
                raise ValueError(f"job {job.job_id} is already in flight")
            self._pending[job.job_id] = self._runner.submit(self._run(job, self._after()))
        return True

    async def _run(self, job: PoolJob, after: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        began = time.perf_counter()
        success, moved = False, 0
        failed = job.unfilled(0)
        try:
            if self._closing:
                raise asyncio.CancelledError
            if job.store:
                # Success once it ended, whatever the pool kept: the scheduler asks the pool what is there.
                moved = await self._store(job, after)
                success = True
            else:
                failed = job.unfilled(await self._load(job, after))
                success = not failed
                moved = job.nbytes if success else 0
        except asyncio.CancelledError:
            pass  # shutdown: the job ends as a failure, with nothing of it in flight
        except Exception as error:
            log.error("aiokvtier %s job %d failed: %r", "store" if job.store else "load", job.job_id, error)
        finally:
            self._tasks.discard(task)
            if not job.store and not success:
                with self._errors_lock:
                    self._errors.update(failed)
                success = self.report_load_errors  # vLLM recomputes the blocks named
            result = TransferResult(
                job_id=job.job_id,
                success=success,
                transfer_size=moved if moved else None,
                transfer_time=time.perf_counter() - began if moved else None,
            )
            # Reported and out of the jobs in flight at once: a caller that sees the result may reuse its id.
            with self._lock:
                self._pending.pop(job.job_id, None)
                self._finished.append(result)

    async def _store(self, job: PoolJob, after: Any) -> int:
        """Stores the job's pages and seals (one call); the page bytes the pool took (0 while it is away)."""
        if not job.keys:
            return 0
        pool = await self._link.get()
        if pool is None:
            return 0
        try:
            return await self._jobs.store(pool, job, engine=self._engine, after=after)
        except PoolLostError as exc:
            self._link.lost(pool, exc)
            return 0

    async def _load(self, job: PoolJob, after: Any) -> int:
        """Loads the job's leading blocks that the pool holds; how many keys (whole GPU blocks) were loaded."""
        if not job.keys:
            return 0
        pool = await self._link.get()
        if pool is None:
            return 0
        try:
            return await self._jobs.load(pool, job, engine=self._engine, after=after)
        except PoolLostError as exc:
            self._link.lost(pool, exc)
            return 0

    def get_finished(self) -> list[TransferResult]:
        """The jobs that ended since the last call."""
        results: list[TransferResult] = []
        while True:  # another thread may take the last one between a check and a pop
            try:
                results.append(self._finished.popleft())
            except IndexError:
                return results

    def take_load_errors(self) -> set[int]:
        """The GPU blocks that loads since the last call could not fill (vLLM's ``invalid_block_ids``)."""
        with self._errors_lock:
            errors, self._errors = self._errors, set()
        return errors

    def wait(self, job_ids: set[int]) -> None:
        """Blocks until the given jobs ended.

        :raises RuntimeError: called on the worker's loop thread while a job has not ended.
        """
        with self._lock:
            futures = [f for job_id in job_ids if (f := self._pending.get(job_id)) is not None]
        if self._runner.here() and not all(f.done() for f in futures):
            raise _would_wait("wait")
        concurrent.futures.wait(futures)

    def shutdown(self) -> None:
        """Stops taking jobs, cancels those in flight (each returns once nothing copies for it, and the pool
        takes back what it claimed or pinned), detaches. Cancelled jobs end as failures. Idempotent: a call
        while another thread's shutdown runs returns once that one has ended.

        :raises RuntimeError: called on the worker's loop thread.
        """
        with self._lock:
            first = not self._closing
            if self._runner.here():
                if first:
                    raise _would_wait("shutdown")
                return  # the loop itself is being shut down: waiting here would wait forever
            self._closing = True
        if not first:
            self._shut.wait()
            return
        try:
            self._runner.call(self._shutdown())
        finally:
            self._runner.stop()
            self._shut.set()

    async def _shutdown(self) -> None:
        await _cancel_all(self._tasks)
        await self._link.aclose()
        if self._engine is not None:
            await self._engine.aclose()
