"""vLLM's KV offloading over aiokvtier's progressive host tier.

Loaded by vLLM's ``OffloadingConnector`` through its spec factory::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "AiokvtierOffloadingSpec",
        "spec_module_path": "aiokvtier.integrations.vllm", "cpu_bytes_to_use": 68719476736}}'

Written against vLLM 0.33.0 (``vllm.v1.kv_offload``: ``OffloadingSpec``,
``OffloadingManager``, ``OffloadingWorker``, ``CanonicalKVCaches``,
``GPULoadStoreSpec``, ``CPULoadStoreSpec``); these interfaces move between
vLLM releases.

The two halves live in different processes: vLLM builds one spec in the
scheduler (``get_manager()``) and one per worker (``get_worker()``), and
they share nothing but the chunk ids the manager writes into each job.

- Scheduler side: vLLM's own ``CPUOffloadingManager`` keeps the books
  (lookup, pinning under loads, eviction policy, ``store_threshold``,
  events, statistics), so the engine sees the semantics of its CPU tier
  exactly. It holds no memory and starts no thread; the offload keys
  (vLLM's block-hash bytes) are its dictionary keys as they come.
- Worker side: an aiokvtier ``HostTier`` replaces the CPU tier's buffer
  that vLLM allocates and pins whole before serving. The tier reserves its
  range at once and fills it in the background, so a store can land as soon
  as the first unit is resident. A chunk takes its tier slots (one per KV
  tensor and block) when it is first stored and keeps them; the copies go
  through a ``CopyEngine`` on a loop thread of the worker's own
  (``aiokvtier-vllm``). vLLM's calls only queue work there and collect
  results: ``submit_store`` / ``submit_load`` plan on the caller's thread
  with numpy and hand the job over; ``get_finished`` drains what landed.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import operator
import threading
import time
from collections.abc import Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import pydantic
import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingInfo
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from .._config import HostTierConfig, _size_bytes
from .._copy._engine import CopyEngine, StartedCopy
from .._copy._requests import Pages
from .._host._linux import PAGE_SIZE
from .._host._tier import HostTier
from .._lifecycle import close_in_turn

__all__ = ["SUPPORTED_VLLM", "AiokvtierOffloadingConnector", "AiokvtierOffloadingSpec", "AiokvtierOffloadingWorker"]

SUPPORTED_VLLM = "0.33"
"""The vLLM release whose ``vllm.v1.kv_offload`` interfaces this module implements."""

EXTRA_KEY = "aiokvtier"
"""The key of ``kv_connector_extra_config`` holding the host tier's settings."""

_DERIVED = ("quota", "slot_size", "device", "kind")
"""Tier settings the spec derives (from ``cpu_bytes_to_use`` and the KV caches); a user's value is refused."""

_T = TypeVar("_T")
_logger = logging.getLogger(__name__)

if not str(getattr(vllm, "__version__", "")).startswith(SUPPORTED_VLLM + "."):
    # Loading goes on: the interfaces may still match, and vLLM's own checks fail loudly where they do not.
    _logger.warning(
        "aiokvtier.integrations.vllm implements vLLM %s's offloading interfaces; this is vLLM %s",
        SUPPORTED_VLLM,
        getattr(vllm, "__version__", "unknown"),
    )
I64 = npt.NDArray[np.int64]


def job_blocks(gpu: GPULoadStoreSpec, groups: int, num_blocks: int) -> tuple[list[int], npt.NDArray[np.int64]]:
    """A job's group sizes and GPU block ids, checked before anything is planned or claimed.

    A copy outside the KV tensors corrupts the process's memory (or the GPU's) instead of raising, so
    the ids are checked here: vLLM checks only that the sizes add up. A negative size made a negative
    offset, which indexed the ids from their end; a negative id would do the same; a float id would be
    cut to another block's number, a bool taken as 0 or 1.

    :raises ValueError: not one size and one first index per KV cache group, a negative size or first
        index, ids not in one dimension, or an id outside ``[0, num_blocks)``.
    :raises TypeError: a size, a first index or an id that is not an integer (a bool is not one: it
        was taken for 0 or 1, and a float first index was cut to another place in its chunk).
    """
    if len(gpu.group_sizes) != groups:
        raise ValueError(f"{len(gpu.group_sizes)} group sizes for {groups} KV cache groups")
    if len(gpu.block_indices) != groups:
        raise ValueError(f"{len(gpu.block_indices)} first block indices for {groups} KV cache groups")
    sizes = [_integer(size, "a group size") for size in gpu.group_sizes]
    if any(size < 0 for size in sizes):
        raise ValueError(f"group sizes must not be negative, got {sizes}")
    firsts = [_integer(first, "a first block index") for first in gpu.block_indices]
    if any(first < 0 for first in firsts):
        raise ValueError(f"first block indices must not be negative, got {firsts}")
    ids = _ids(gpu.block_ids, "GPU block ids")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"GPU block ids must lie in [0, {num_blocks}), got {ids.min()}..{ids.max()}")
    return sizes, ids


def job_chunks(host: CPULoadStoreSpec, num_chunks: int) -> I64:
    """A job's chunk ids, checked as ``job_blocks`` checks its GPU block ids (a float id was cut to
    another chunk, a bool taken for chunk 0 or 1).

    :raises TypeError: an id that is not an integer.
    :raises ValueError: not one dimension, or an id outside ``[0, num_chunks)``.
    """
    chunks = _ids(host.block_ids, "chunk ids")
    if chunks.size and (int(chunks.min()) < 0 or int(chunks.max()) >= num_chunks):
        raise ValueError(f"chunk ids must lie in [0, {num_chunks}), got {chunks.min()}..{chunks.max()}")
    return chunks


def _ids(value: object, what: str) -> I64:
    raw = np.asarray(value)
    if raw.ndim != 1:
        raise ValueError(f"{what} are one dimension, not an array of shape {raw.shape}")
    if raw.dtype.kind not in "iu" and raw.size:  # an empty list is read as floats
        raise TypeError(f"{what} are integers, not {raw.dtype}")
    return raw.astype(np.int64)  # a uint64 past int64's range turns negative: refused by the range checks


def _integer(value: object, what: str) -> int:
    if isinstance(value, bool | np.bool_):
        raise TypeError(f"{what} is an integer, not a bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} is an integer, not {type(value).__name__}") from None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(value: int, multiple: int) -> int:
    return _cdiv(value, multiple) * multiple


def tier_settings(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """The user's host tier settings (``kv_connector_extra_config["aiokvtier"]``), checked.

    Every ``HostTierConfig`` field but the derived ones may be given. The
    values are checked now, against a stand-in quota and slot size, so a
    typo or a bad value fails where vLLM builds the spec; rules that depend
    on the slot size (``commit_unit``) are checked again when the worker
    opens the tier.

    :raises ValueError: not a mapping, a derived or unknown field, or a bad
        value; the message names the field.
    """
    raw = extra_config.get(EXTRA_KEY, {})
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"kv_connector_extra_config[{EXTRA_KEY!r}] must be a mapping of host tier settings, "
            f"not {type(raw).__name__}"
        )
    settings = dict(raw)
    for name in _DERIVED:
        if name in settings:
            raise ValueError(
                f"kv_connector_extra_config[{EXTRA_KEY!r}][{name!r}] is set by the spec "
                "(quota from cpu_bytes_to_use, slot_size from the KV page size, device from the KV caches); "
                "leave it out"
            )
    settings.setdefault("max_quota", None)
    _validate(settings, quota=PAGE_SIZE, slot_size=PAGE_SIZE, device=None)
    return settings


def _validate(settings: Mapping[str, Any], *, quota: int, slot_size: int, device: int | None) -> HostTierConfig:
    values = {**settings, "quota": quota, "slot_size": slot_size, "device": device}
    if values.get("max_quota") is None:
        values["max_quota"] = quota  # reserve what is used, not the machine's memory
    try:
        return HostTierConfig(**values)
    except pydantic.ValidationError as error:
        raise ValueError(f"kv_connector_extra_config[{EXTRA_KEY!r}]: {error}") from None


def chunk_count(config: OffloadingConfig) -> int:
    """How many chunks ``cpu_bytes_to_use`` holds, over every worker of the engine (vLLM's CPU tier's reading).

    :raises ValueError: ``cpu_bytes_to_use`` missing or not a size, or too small for one chunk.
    """
    raw = config.extra_config.get("cpu_bytes_to_use")
    if raw is None:
        raise ValueError("kv_connector_extra_config['cpu_bytes_to_use'] is required (bytes for all workers)")
    try:
        total = _size_bytes(raw, "cpu_bytes_to_use")
    except ValueError as error:
        raise ValueError(f"kv_connector_extra_config['cpu_bytes_to_use']: {error}") from None
    per_chunk = int(
        config.worker_kv_bytes_per_block * config.cache.blocks_per_chunk * max(config.parallel.world_size, 1)
    )
    if per_chunk <= 0:
        raise ValueError("the KV cache has no bytes per block to offload (worker_kv_bytes_per_block is 0)")
    if total < per_chunk:
        raise ValueError(
            f"kv_connector_extra_config['cpu_bytes_to_use'] ({total} bytes) holds no chunk of {per_chunk} bytes"
        )
    return total // per_chunk


def _pooled(extra_config: Mapping[str, Any]) -> bool:
    section = extra_config.get(EXTRA_KEY)
    return isinstance(section, Mapping) and "pool" in section


class AiokvtierOffloadingSpec(OffloadingSpec):
    """The spec vLLM's ``OffloadingConnector`` loads by ``spec_name`` and ``spec_module_path``.

    ``kv_connector_extra_config`` keys read here: ``cpu_bytes_to_use``
    (required: host bytes for all workers of the engine, as for vLLM's CPU
    tier), ``aiokvtier`` (host tier settings, see ``tier_settings``),
    and vLLM's own ``eviction_policy``, ``cache_policy_module_path``,
    ``store_threshold`` and ``max_tracker_size`` for the manager.

    With ``"aiokvtier": {"pool": PATH}`` (and optionally ``"namespace"``) the
    halves attach to the machine-wide pool at ``PATH`` instead
    (``aiokvtier.integrations._vllm_pool``): ``cpu_bytes_to_use`` is not
    read (the pool's owner sets the quota), and the eviction settings are
    refused (the owner evicts).

    Building it checks the settings and allocates nothing: the scheduler's
    spec never opens a tier, a worker's opens one in ``get_worker()``.

    :raises ValueError: a bad setting, named in the message.
    :raises NotImplementedError: ``canonical_layout`` or a replicated layout was asked for.
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """The metrics of vLLM's CPU manager, which keeps the books here (none over a pool)."""
        if _pooled(extra_config):
            return {}
        definitions: dict[str, OffloadingMetricMetadata] = CPUOffloadingSpec.build_metric_definitions(extra_config)
        return definitions

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        if _pooled(extra_config):
            return ()
        keys: tuple[str, ...] = CPUOffloadingInfo.config_info_keys()
        return keys

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        if config.canonical_layout:
            raise NotImplementedError(
                "kv_connector_extra_config['canonical_layout'] is not supported by AiokvtierOffloadingSpec: "
                "each worker stores its own pages"
            )
        from ._vllm_pool import pool_section

        self.pool_settings = pool_section(self.extra_config)
        """The pool's settings (``{"pool": PATH}``), or None: a private tier per worker."""
        if self.pool_settings is None:
            self.tier_settings = tier_settings(self.extra_config)
            self.num_chunks = chunk_count(config)
        self.replicated_layout = False  # every worker stores its own shard (in its tier, or under its rank)
        self.eviction_policy: str = str(self.extra_config.get("eviction_policy", "lru"))
        self._manager: OffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        """vLLM's ``CPUOffloadingManager`` over ``num_chunks`` chunks: its chunk ids are the worker's tier chunks.

        With a pool, a ``PoolOffloadingManager`` attached to it instead (the pool keeps the books).

        :raises PoolError: a pool is named and none answers at its path.
        """
        if self._manager is None and self.pool_settings is not None:
            from ._vllm_pool import PoolOffloadingManager

            self._manager = PoolOffloadingManager(self.config, self.pool_settings)
        if self._manager is None:
            bytes_per_chunk = self.config.worker_kv_bytes_per_block * self.blocks_per_chunk
            self._manager = CPUOffloadingManager(
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.extra_config.get("cache_policy_module_path"),
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
                info=CPUOffloadingInfo.from_config(self.config, self.num_chunks, bytes_per_chunk),
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """Opens this worker's tier and copy engine (once) and returns the worker; with a pool, attaches to it.

        :raises ValueError: a KV cache layout the worker cannot copy, or tier settings refused for the real slot size.
        :raises PoolError: a pool is named and none answers at its path.
        """
        if self._worker is None and self.pool_settings is not None:
            from ._vllm_pool import PoolOffloadingWorker

            self._worker = PoolOffloadingWorker(kv_caches, config=self.config, settings=self.pool_settings)
        if self._worker is None:
            self._worker = AiokvtierOffloadingWorker(
                kv_caches,
                num_chunks=self.num_chunks,
                blocks_per_chunk=self.blocks_per_chunk,
                settings=self.tier_settings,
            )
        return self._worker


class _LoopThread:
    """An asyncio loop on a thread of its own, for callers on vLLM's threads."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return self.submit(coro).result()

    def here(self) -> bool:
        """Called on the loop's own thread, where waiting for the loop waits forever."""
        return threading.get_ident() == self._thread.ident

    def stop(self) -> None:
        """Stops the loop and joins the thread (the loop's own work must be done)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


@dataclass(frozen=True)
class _Part:
    """One KV tensor's share of a job: its GPU blocks and the chunk slot positions they pair with."""

    tensor: int
    blocks: npt.NDArray[np.intp]
    positions: I64


@dataclass(frozen=True)
class _Job:
    job_id: int
    store: bool
    chunks: I64
    parts: tuple[_Part, ...]
    after: Any
    nbytes: int


class AiokvtierOffloadingWorker(OffloadingWorker):
    """Moves KV blocks between vLLM's KV cache tensors and a host tier's slots.

    Tier layout: chunk ``c`` owns ``slots_per_chunk`` slots, one for each
    (KV tensor of its group, block of the chunk), each holding one page of
    that tensor. The chunk's slots are allocated from the tier the first
    time it is stored, lowest first, so the early stores use what the fill
    made resident first; they stay the chunk's until the worker shuts down.

    CUDA tensors are copied by a ``CopyEngine`` on their device; CPU tensors
    (tests, development machines) by the host-to-host engine, which needs
    their pages contiguous.

    Threads: the ``submit_*`` calls, ``get_finished`` and ``wait`` may come
    from any thread (vLLM calls them from its worker thread); the copies and
    the tier live on the ``aiokvtier-vllm`` loop thread.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        *,
        num_chunks: int,
        blocks_per_chunk: int,
        settings: Mapping[str, Any],
    ) -> None:
        tensors = [entry.tensor for entry in kv_caches.tensors]
        if not tensors:
            raise ValueError("no KV cache tensors to offload")
        devices = {(t.device.type, t.device.index) for t in tensors}
        if len(devices) != 1:
            raise ValueError(f"the KV cache tensors lie on several devices: {sorted(map(str, devices))}")
        kind, index = devices.pop()
        if kind not in ("cuda", "cpu"):
            raise ValueError(f"KV cache tensors on {kind!r}: only CUDA and CPU tensors are supported")
        device: int | None = None
        if kind == "cuda":
            device = int(torch.cuda.current_device() if index is None else index)
        self._cuda = device is not None
        self._blocks_per_chunk = blocks_per_chunk
        self._num_chunks = num_chunks
        # Each group's tensors, in order of first use: the k-th owns slots k*bpc .. k*bpc+bpc-1 of a chunk.
        self._group_tensors: list[tuple[int, ...]] = [
            tuple(dict.fromkeys(ref.tensor_idx for ref in refs)) for refs in kv_caches.group_data_refs
        ]
        width = max((len(g) for g in self._group_tensors), default=0)
        if width == 0:
            raise ValueError("no KV cache group references a tensor")
        self.slots_per_chunk = width * blocks_per_chunk
        self._page = [int(entry.page_size_bytes) for entry in kv_caches.tensors]
        slot_size = _round_up(max(self._page), PAGE_SIZE)
        config = _validate(
            settings, quota=num_chunks * self.slots_per_chunk * slot_size, slot_size=slot_size, device=device
        )
        self._buffers = [self._buffer(t, page) for t, page in zip(tensors, self._page, strict=True)]
        # Each chunk's slots (-1: never stored), grown as the manager hands out chunk ids (lowest first), so a
        # 256 GiB tier does not write a map of millions of entries before its first store.
        self._slot_of: I64 = np.full(min(num_chunks, 1024) * self.slots_per_chunk, -1, dtype=np.int64)
        self._finished: collections.deque[TransferResult] = collections.deque()
        self._pending: dict[int, concurrent.futures.Future[None]] = {}
        self._pending_lock = threading.Lock()
        self._closing = False
        self._closed = False
        self._shut = threading.Event()
        """Set once the shutdown has ended (a second caller waits for it)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._runner = _LoopThread("aiokvtier-vllm")
        try:
            self.tier, self.engine, self._claiming = self._runner.call(self._open(config, device))
            self._source_pages, self._dest_pages = self._runner.call(self._pages())
        except BaseException:
            try:
                self._runner.call(self._close_opened())
            finally:
                self._runner.stop()
            raise

    # -- opening and closing ------------------------------------------------------

    async def _open(self, config: HostTierConfig, device: int | None) -> tuple[HostTier, CopyEngine, asyncio.Lock]:
        tier = await HostTier.open(config)
        self.tier = tier
        engine = await CopyEngine.open(device)
        self.engine = engine
        return tier, engine, asyncio.Lock()

    async def _pages(self) -> tuple[list[Pages], list[Pages]]:
        # Checked once: a job's copies take() the blocks it names without checking them again.
        sources = [self.engine.pages(b, n, page=p, writable=False) for b, n, p in self._buffers]
        dests = [self.engine.pages(b, n, page=p, writable=True) for b, n, p in self._buffers]
        return sources, dests

    async def _close_opened(self) -> None:
        # The tier is closed whatever the engine's close raised.
        await close_in_turn(getattr(self, "engine", None), getattr(self, "tier", None))

    def _buffer(self, tensor: torch.Tensor, page: int) -> tuple[Any, int, int | None]:
        """What ``CopyEngine.pages`` takes for one KV tensor: addresses on a GPU, a host array on a CPU."""
        blocks = int(tensor.shape[0])
        row = tensor.stride(0) * tensor.element_size()
        if row < page:
            raise ValueError(f"a KV tensor's blocks are {row} bytes apart, less than its page of {page} bytes")
        if self._cuda:
            base = tensor.data_ptr()
            return base + np.arange(blocks, dtype=np.uint64) * np.uint64(row), blocks, page
        if row != page or not tensor.is_contiguous():
            raise ValueError("CPU KV tensors must hold their pages contiguously (one page per block, no padding)")
        return tensor.view(torch.uint8).reshape(blocks, page).numpy(), blocks, None

    def shutdown(self) -> None:
        """Stops taking jobs, cancels those waiting for the fill, waits for copies in flight, closes the tier.

        Jobs cancelled here end as failed results. Idempotent: a call while another thread's shutdown runs
        returns once that one has ended.

        :raises RuntimeError: called on the worker's loop thread (from a logging handler, say), where it
            would wait for that loop forever: nothing is shut down.
        """
        with self._pending_lock:
            first = not self._closed
            if self._runner.here():
                if first:
                    raise _would_wait("shutdown")
                return  # the loop itself is being shut down: waiting here would wait forever
            self._closing = self._closed = True
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
        await self._close_opened()

    # -- jobs -------------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Queue GPU -> tier. Returns at once; the result comes from ``get_finished``."""
        return self._submit(job_id, src_spec, dst_spec, store=True)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        """Queue tier -> GPU. ``expedited`` changes nothing: no load queues behind another here."""
        return self._submit(job_id, dst_spec, src_spec, store=False)

    def _submit(self, job_id: int, gpu: LoadStoreSpec, host: LoadStoreSpec, *, store: bool) -> bool:
        if not isinstance(gpu, GPULoadStoreSpec):
            raise TypeError(f"the GPU side is a GPULoadStoreSpec, not {type(gpu).__name__}")
        if not isinstance(host, CPULoadStoreSpec):
            raise TypeError(f"the host side is a CPULoadStoreSpec, not {type(host).__name__}")
        chunks = job_chunks(host, self._num_chunks)
        parts, nbytes = self._plan(job_id, gpu, chunks, store=store)
        after = None
        if self._cuda:
            # Stores read what the model wrote, loads overwrite blocks the stream may still zero: both follow
            # the work queued on the caller's stream so far (an event on this thread, waited on by the GPU).
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream())
        job = _Job(job_id, store, chunks, parts, after, nbytes)
        with self._pending_lock:
            if self._closing:
                return False
            if job_id in self._pending:
                raise ValueError(f"job {job_id} is already in flight")
            future = self._runner.submit(self._run(job))
            self._pending[job_id] = future
        return True

    def _plan(self, job_id: int, gpu: GPULoadStoreSpec, chunks: I64, *, store: bool) -> tuple[tuple[_Part, ...], int]:
        """Pairs each GPU block with its chunk's slot position, per KV tensor (vLLM's chunk arithmetic).

        :raises ValueError: the blocks and chunks do not match, a store writes one slot twice (a chunk
            named twice, or by two groups), or a load writes one GPU block twice.
        """
        bpc = self._blocks_per_chunk
        sizes, ids = job_blocks(gpu, len(self._group_tensors), min(blocks for _, blocks, _ in self._buffers))
        blocks: dict[int, list[npt.NDArray[np.intp]]] = {}
        positions: dict[int, list[I64]] = {}
        offset = chunk_offset = 0
        nbytes = 0
        for group, (size, first) in enumerate(zip(sizes, gpu.block_indices, strict=True)):
            if size == 0:
                continue
            skip = int(first) % bpc
            used = _cdiv(skip + size, bpc)
            # Checked before the positions are made: a size past the ids would make that many of them.
            if chunk_offset + used > len(chunks) or offset + size > len(ids):
                raise ValueError("the GPU blocks and the chunks of a job do not match")
            logical = np.arange(skip, skip + size, dtype=np.int64)
            chunk_of = chunks[chunk_offset + logical // bpc]
            within = logical % bpc
            group_ids = ids[offset : offset + size]
            for k, tensor in enumerate(self._group_tensors[group]):
                blocks.setdefault(tensor, []).append(group_ids)
                positions.setdefault(tensor, []).append(chunk_of * self.slots_per_chunk + k * bpc + within)
                nbytes += int(size) * self._page[tensor]
            offset += int(size)
            chunk_offset += used
        if offset != len(ids) or chunk_offset != len(chunks):
            raise ValueError("the GPU blocks and the chunks of a job do not match")
        parts = tuple(
            _Part(tensor, np.concatenate(blocks[tensor]), np.concatenate(positions[tensor])) for tensor in blocks
        )
        # Two pages into one place end with whichever landed last. The engine refuses that too, but on the
        # loop: a store's chunk has claimed its slots by then (a later load of it would succeed), and a
        # load's other tensors may have been written.
        if store and parts:
            twice = _twice(np.concatenate([part.positions for part in parts]))
            if twice is not None:
                raise ValueError(f"job {job_id} stores two pages into chunk {twice // self.slots_per_chunk}")
        for part in () if store else parts:
            twice = _twice(part.blocks)
            if twice is not None:
                raise ValueError(f"job {job_id} loads two pages into GPU block {twice}")
        return parts, nbytes

    async def _run(self, job: _Job) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        began = time.perf_counter()
        success = False
        try:
            if self._closing:
                return
            if job.store:
                await self._claim(job.chunks)
            await self._copy(job)
            success = True
        except asyncio.CancelledError:
            pass  # shutdown: the job ends as a failure, with nothing of it in flight
        except Exception as error:
            _log_failure(job, error)
        finally:
            self._tasks.discard(task)
            result = TransferResult(
                job_id=job.job_id,
                success=success,
                transfer_size=job.nbytes if success else None,
                transfer_time=time.perf_counter() - began if success else None,
            )
            # Reported and out of the jobs in flight at once: a caller that sees the result may reuse its id.
            with self._pending_lock:
                self._pending.pop(job.job_id, None)
                self._finished.append(result)

    def _slots(self, positions: I64) -> I64:
        """The slots at ``positions`` of the chunk map, -1 where no slot was claimed."""
        inside = positions < len(self._slot_of)
        if inside.all():
            return self._slot_of[positions]
        return np.where(inside, self._slot_of[np.where(inside, positions, 0)], -1)

    def _grow(self, chunks: int) -> None:
        width = self.slots_per_chunk
        if chunks * width <= len(self._slot_of):
            return
        size = min(max(chunks, 2 * len(self._slot_of) // width), self._num_chunks) * width
        grown = np.full(size, -1, dtype=np.int64)
        grown[: len(self._slot_of)] = self._slot_of
        self._slot_of = grown

    async def _claim(self, chunks: I64) -> None:
        """Gives each chunk not stored before its slots (waiting for the fill where they are not resident)."""
        width = self.slots_per_chunk
        if chunks.size == 0 or not (self._slots(chunks * width) < 0).any():
            return
        async with self._claiming:
            self._grow(int(chunks.max()) + 1)
            fresh = np.unique(chunks[self._slot_of[chunks * width] < 0])
            if fresh.size == 0:
                return
            slots = await self.tier.allocate_ids(int(fresh.size) * width)
            starts = fresh * width
            self._slot_of[(starts[:, None] + np.arange(width)).ravel()] = slots

    async def _copy(self, job: _Job) -> None:
        direction = "d2h" if job.store else "h2d"
        pages = self._source_pages if job.store else self._dest_pages
        # Every part's slots first: a chunk of a later group never stored fails the job with no block written.
        slots = [self._slots(part.positions) for part in job.parts]
        if any((s < 0).any() for s in slots):
            raise LookupError(f"job {job.job_id} loads a chunk that was never stored")
        started: list[StartedCopy] = []
        error: BaseException | None = None
        try:
            for part, part_slots in zip(job.parts, slots, strict=True):
                started.append(
                    self.engine.start(
                        self.tier, part_slots, pages[part.tensor].take(part.blocks), direction, after=job.after
                    )
                )
        except BaseException as raised:
            error = raised
        # Every copy started is the GPU's until it lands: wait for all (a cancellation arrives after them).
        outcomes = await asyncio.gather(*(copy.done for copy in started), return_exceptions=True)
        if error is not None:
            raise error
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    def get_finished(self) -> list[TransferResult]:
        """The jobs that ended since the last call (successes and failures)."""
        results: list[TransferResult] = []
        while True:
            try:
                results.append(self._finished.popleft())
            except IndexError:
                return results

    def wait(self, job_ids: set[int]) -> None:
        """Blocks until the given jobs ended (vLLM calls it for flushes and synchronous loads).

        :raises RuntimeError: called on the worker's loop thread (from a logging handler, say) while a
            job has not ended: it would wait for that loop forever.
        """
        with self._pending_lock:
            futures = [f for job_id in job_ids if (f := self._pending.get(job_id)) is not None]
        if self._runner.here() and not all(f.done() for f in futures):
            raise _would_wait("wait")
        concurrent.futures.wait(futures)


def _twice(values: npt.NDArray[Any]) -> int | None:
    """A value that appears twice in ``values``, or None."""
    ordered = np.sort(values)
    same = np.flatnonzero(ordered[1:] == ordered[:-1])
    return int(ordered[same[0]]) if same.size else None


async def _cancel_all(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel the jobs' tasks and wait until each has ended (each gives back what it held)."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def _would_wait(what: str) -> RuntimeError:
    return RuntimeError(
        f"AiokvtierOffloadingWorker.{what}() was called on the worker's own loop thread, where it would "
        "wait for that loop forever: call it from another thread"
    )


def _log_failure(job: _Job, error: BaseException) -> None:
    kind = "store" if job.store else "load"
    _logger.error("aiokvtier %s job %d failed: %r", kind, job.job_id, error)


class AiokvtierOffloadingConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` that takes a load the pool could not serve as vLLM's load error.

    vLLM 0.33's connector takes no failed job (it asserts each succeeded). Over a shared pool a block the
    scheduler found may be evicted by another process before this worker loads it; with this connector
    such a load finishes, and its GPU blocks come back from ``get_block_ids_with_load_errors``, so vLLM
    recomputes them (``kv_load_failure_policy="recompute"``) or fails the request (``"fail"``, vLLM's
    default): never wrong bytes. Load it with ``"kv_connector": "AiokvtierOffloadingConnector",
    "kv_connector_module_path": "aiokvtier.integrations.vllm"``; with a private tier it is vLLM's own.
    """

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        worker = self._spec_worker()
        if worker is not None:
            worker.report_load_errors = True

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The GPU blocks of loads the pool could not serve, since the last call."""
        worker = self._spec_worker()
        return set() if worker is None else worker.take_load_errors()

    def _spec_worker(self) -> Any:
        from ._vllm_pool import PoolOffloadingWorker

        worker = getattr(self.connector_worker, "worker", None)
        return worker if isinstance(worker, PoolOffloadingWorker) else None
