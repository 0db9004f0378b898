"""The pool mode's jobs without vLLM: which pool keys a job's KV blocks are, and their copies.

A worker rank's KV caches are tensors of one block per row (``KVTensor``) on one device, host memory
or a GPU. A chunk (``blocks_per_chunk`` blocks of one KV cache group) is, for this rank, ``n`` pool
blocks: for each tensor of the group and each block of the chunk, the page cut into slot-sized pieces
(the last one shorter). Block ``i`` of rank ``r`` is ``namespace + chunk key + r (2 bytes) + i (4 bytes)``;
the rank's seal of the chunk (``i = SEAL``) is 8 bytes saying ``n``.

``PoolJobs.plan`` turns a job (chunk keys, GPU block ids) into pool keys and page addresses;
``store`` and ``load`` run it against an ``AttachedPool``. GPU pages go through the process's
``CopyEngine`` (``engine=``), host pages through the pool's own thread.

A store is one call: each chunk's pages, then its seal, claimed and committed together (the seals are
copied from a few bytes this object keeps beside the tensors: in host memory, or on their GPU, so one
call copies them all). A store cut short (a shutdown) leaves each chunk whole or absent; a full pool
skips the keys from the first that does not fit, so a chunk is sealed only when its pages went in
before it. A load copies the leading pages the pool still holds; the GPU blocks of the rest are the
caller's load errors (``PoolJob.unfilled``).

No vLLM here, and torch only for GPU tensors (their seals' copy on the device): tensors are read
through their methods (``data_ptr``, ``stride``), events are recorded by the caller.
"""

from __future__ import annotations

import ctypes
import operator
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .. import _numpy  # noqa: F401  (numpy's lazy submodules imported now, not on a loop)
from .._errors import BlockNotFound

if TYPE_CHECKING:
    from .._copy._engine import CopyEngine
    from .._pool._client import AttachedPool

__all__ = ["SEAL", "KVTensor", "PoolJob", "PoolJobs", "block_key", "seal_count", "tensors_device"]

SEAL = 0xFFFFFFFF
"""The block index of a rank's seal of a chunk."""
SUFFIX = struct.Struct(">HI")
SEAL_BYTES = struct.Struct("<4sI")
MAGIC = b"akv1"
LOAD_ROUNDS = 64
"""Loads tried again after a block evicted under the load (each with fewer keys): a bound, not a wait."""


def block_key(ns: bytes, chunk: bytes, rank: int, index: int) -> bytes:
    """The pool key of block ``index`` (``SEAL``: the seal) of ``rank``'s share of the chunk ``chunk``."""
    return ns + chunk + SUFFIX.pack(rank, index)


def seal_count(seal: bytes) -> int | None:
    """The block count a seal's bytes say; None for bytes this version does not write."""
    if len(seal) != SEAL_BYTES.size:
        return None
    magic, n = SEAL_BYTES.unpack(seal)
    return int(n) if magic == MAGIC else None


@dataclass(frozen=True)
class KVTensor:
    """One KV tensor: block ``b``'s page is ``page`` bytes at ``base + b * row``."""

    base: int
    row: int
    page: int
    blocks: int

    @classmethod
    def of(cls, tensor: Any, page: int) -> KVTensor:
        """A tensor (torch's methods) with one block per row: contiguous, its row at least ``page``.

        :raises ValueError: not contiguous, a row shorter than the page, or a page below one byte.
        """
        row = int(tensor.stride(0)) * int(tensor.element_size())
        if page < 1 or not tensor.is_contiguous() or row < page:
            raise ValueError(
                f"KV tensors must hold their pages contiguously, one block a row (page {page} bytes, row {row})"
            )
        return cls(int(tensor.data_ptr()), row, int(page), int(tensor.shape[0]))


def tensors_device(tensors: Sequence[Any]) -> int | None:
    """The CUDA ordinal the tensors lie on, or None for host memory.

    :raises ValueError: no tensors, tensors on several devices, or on a device that is neither.
    """
    if not tensors:
        raise ValueError("no KV cache tensors to offload")
    devices = {(t.device.type, t.device.index) for t in tensors}
    if len(devices) != 1:
        named = sorted(kind if index is None else f"{kind}:{index}" for kind, index in devices)
        raise ValueError(f"the KV cache tensors lie on several devices: {', '.join(named)}")
    kind, index = devices.pop()
    if kind == "cpu":
        return None
    if kind != "cuda":
        raise ValueError(f"KV cache tensors on {kind!r}: the pool copies host memory or CUDA memory")
    if index is None:  # "cuda" without an ordinal: the current device
        import torch

        return int(torch.cuda.current_device())
    return int(index)


@dataclass(frozen=True)
class PoolJob:
    """One planned job: its keys in order (a load's leading keys are a prefix; a store's seal of a chunk
    follows the chunk's pages), their pages and the GPU blocks they belong to."""

    job_id: int
    store: bool
    keys: list[bytes]
    addresses: npt.NDArray[np.uint64]
    lengths: npt.NDArray[np.uint64]
    gpu_blocks: npt.NDArray[np.int64]
    """For each key, the GPU block its page belongs to (-1: a seal)."""
    nbytes: int
    """The bytes of the KV pages (seals left out)."""
    seals: list[tuple[bytes, bytes, int, int]] = field(default_factory=list)
    """A store's seals: key, bytes, and the range ``[lo, hi)`` of the chunk's page keys (the seal's key
    is at ``hi``)."""

    def unfilled(self, count: int) -> set[int]:
        """The GPU blocks a load that copied its ``count`` leading keys left unfilled."""
        return {int(b) for b in np.unique(self.gpu_blocks[count:]) if b >= 0}


def _count(value: object, what: str) -> int:
    """A non-negative integer (numpy's too); a bool or a float is refused, not cut or taken for 0 or 1."""
    if isinstance(value, bool | np.bool_):
        raise TypeError(f"{what} is an integer, not a bool")
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} is an integer, not {type(value).__name__}") from None
    if n < 0:
        raise ValueError(f"{what} must not be negative, got {n}")
    return n


@dataclass(frozen=True)
class _Tensor:
    base: int
    row: int
    page: int
    pieces: int


class PoolJobs:
    """Plans and runs the jobs of one worker rank between its KV tensors and the pool.

    :param tensors: the KV tensors (``KVTensor``), on one device.
    :param groups: per KV cache group, the indices of its tensors.
    :param namespace: the first bytes of every pool key (what makes two engines' pages the same bytes).
    :param rank: this worker's rank.
    :param blocks_per_chunk: GPU blocks per chunk.
    :param slot_size: the pool's slot size: a page is cut into pieces of at most this.
    :param device: the CUDA ordinal of the tensors, or None for host memory (a CUDA ordinal needs
        torch, which copies the seals there).
    :raises ValueError: no tensors, a group naming no tensor or one that is not there, bad sizes.
    """

    def __init__(
        self,
        tensors: Sequence[KVTensor],
        groups: Sequence[Sequence[int]],
        *,
        namespace: bytes,
        rank: int,
        blocks_per_chunk: int,
        slot_size: int,
        device: int | None,
    ) -> None:
        if not tensors:
            raise ValueError("no KV cache tensors to offload")
        if not any(groups):
            raise ValueError("no KV cache group references a tensor")
        if any(t < 0 or t >= len(tensors) for g in groups for t in g):
            raise ValueError(f"a KV cache group names a tensor that is not there ({len(tensors)} tensors)")
        if blocks_per_chunk < 1 or slot_size < 1 or not 0 <= rank < 1 << 16:
            raise ValueError(f"bad geometry: blocks_per_chunk={blocks_per_chunk}, slot_size={slot_size}, rank={rank}")
        self.namespace = bytes(namespace)
        self.rank = rank
        self.device = device
        self.slot_size = slot_size
        self._bpc = blocks_per_chunk
        self.num_blocks = min(t.blocks for t in tensors)
        self._groups = [tuple(dict.fromkeys(g)) for g in groups]
        self._tensors = [_Tensor(t.base, t.row, t.page, -(-t.page // slot_size)) for t in tensors]
        # Each group's block numbering within a chunk: tensor by tensor, block by block, piece by piece.
        self._first: list[dict[int, int]] = []
        self.blocks_per_chunk: list[int] = []
        """Per group, this rank's pool blocks of a chunk (what its seal says)."""
        for group in self._groups:
            first, at = {}, 0
            for t in group:
                first[t] = at
                at += blocks_per_chunk * self._tensors[t].pieces
            if at > SEAL:  # a page's index would reach the seal's (or past 32 bits)
                raise ValueError(f"bad geometry: a chunk of {at} pool blocks per rank; at most {SEAL}")
            self._first.append(first)
            self.blocks_per_chunk.append(at)
        # Each group's seal, where the job's copies take it from: beside the tensors, so that one store
        # (one claim, one commit) holds a chunk's pages and its seal.
        seals = b"".join(SEAL_BYTES.pack(MAGIC, n) for n in self.blocks_per_chunk)
        self._seal_bytes = np.frombuffer(seals, dtype=np.uint8).copy()
        self._seal_memory: Any = self._seal_bytes
        base = self._seal_bytes.ctypes.data
        if device is not None:
            import torch  # GPU KV tensors are torch's: it is there

            self._seal_memory = torch.from_numpy(self._seal_bytes).to(torch.device("cuda", device))
            base = int(self._seal_memory.data_ptr())
        self._seal_at = [base + g * SEAL_BYTES.size for g in range(len(self._groups))]

    @property
    def groups(self) -> int:
        return len(self._groups)

    def plan(
        self,
        job_id: int,
        *,
        store: bool,
        chunks: Sequence[bytes],
        sizes: Sequence[int],
        first_blocks: Sequence[int],
        ids: npt.NDArray[np.int64],
    ) -> PoolJob:
        """The pool keys and pages of a job.

        :param chunks: the chunks' keys, group after group, in the job's order.
        :param sizes: per group, how many GPU blocks the job moves (``ids`` holds them, group after group).
        :param first_blocks: per group, the logical index of its first block (where in its first chunk
            the job starts: ``first_blocks[g] % blocks_per_chunk``).
        :param ids: the GPU block ids, each in ``[0, num_blocks)``.
        :raises ValueError: the blocks and the chunks do not match, the sizes not the groups, a negative
            size or first block, an id outside the tensors, or a load that names a GPU block twice.
        :raises TypeError: a size, a first block or the ids not integers (a bool, a float).

        A store leaves out a chunk it covers in part: its seal would claim all of it.
        """
        if len(sizes) != len(self._groups) or len(first_blocks) != len(self._groups):
            raise ValueError(f"a job gives {len(sizes)} group sizes for {len(self._groups)} KV cache groups")
        # Checked here, whoever the caller: an id outside the tensors is an address in other memory (a
        # store would publish it, a load overwrite it), a negative size indexed the ids from their end.
        sizes = [_count(size, "a group size") for size in sizes]
        first_blocks = [_count(first, "a first block index") for first in first_blocks]
        ids = self._ids(ids)
        bpc, rank, ns, slot = self._bpc, self.rank, self.namespace, self.slot_size
        keys: list[bytes] = []
        addresses: list[int] = []
        lengths: list[int] = []
        blocks: list[int] = []
        places: list[int] = []
        """Each (tensor, GPU block) a page goes to or comes from, as ``tensor * num_blocks + block``."""
        seals: list[tuple[bytes, bytes, int, int]] = []
        nbytes = offset = chunk_offset = 0
        for group, (size, first_block) in enumerate(zip(sizes, first_blocks, strict=True)):
            if size == 0:
                continue
            skip = int(first_block) % bpc
            used = -(-(skip + size) // bpc)
            if chunk_offset + used > len(chunks) or offset + size > len(ids):
                raise ValueError("the GPU blocks and the chunks of a job do not match")
            for c, chunk in enumerate(chunks[chunk_offset : chunk_offset + used]):
                lo, hi = max(skip, c * bpc), min(skip + size, (c + 1) * bpc)
                if store and not (lo == c * bpc and hi == (c + 1) * bpc):
                    continue
                prefix, start_key = ns + chunk, len(keys)
                for logical in range(lo, hi):
                    j = logical % bpc
                    gpu_block = int(ids[offset + logical - skip])
                    for t in self._groups[group]:
                        places.append(t * self.num_blocks + gpu_block)
                        tensor = self._tensors[t]
                        at = self._first[group][t] + j * tensor.pieces
                        start = tensor.base + gpu_block * tensor.row
                        for p in range(tensor.pieces):
                            keys.append(prefix + SUFFIX.pack(rank, at + p))
                            addresses.append(start + p * slot)
                            lengths.append(min(slot, tensor.page - p * slot))
                            blocks.append(gpu_block)
                        nbytes += tensor.page
                if store:
                    seal = SEAL_BYTES.pack(MAGIC, self.blocks_per_chunk[group])
                    seals.append((prefix + SUFFIX.pack(rank, SEAL), seal, start_key, len(keys)))
                    keys.append(prefix + SUFFIX.pack(rank, SEAL))
                    addresses.append(self._seal_at[group])
                    lengths.append(SEAL_BYTES.size)
                    blocks.append(-1)
            offset += size
            chunk_offset += used
        if offset != len(ids) or chunk_offset != len(chunks):
            raise ValueError("the GPU blocks and the chunks of a job do not match")
        if not store:
            # A GPU block of a tensor loaded twice (named twice, or by two groups that share the tensor):
            # it would end with whichever of its pages landed last.
            where = np.sort(np.asarray(places, dtype=np.int64))
            twice = np.flatnonzero(where[1:] == where[:-1])
            if twice.size:
                block = int(where[twice[0]]) % self.num_blocks
                raise ValueError(f"job {job_id} loads two pages into GPU block {block}")
        return PoolJob(
            job_id,
            store,
            keys,
            np.array(addresses, dtype=np.uint64),
            np.array(lengths, dtype=np.uint64),
            np.array(blocks, dtype=np.int64),
            nbytes,
            seals,
        )

    def _ids(self, ids: Any) -> npt.NDArray[np.int64]:
        """The GPU block ids as int64, each in ``[0, num_blocks)``."""
        raw = np.asarray(ids)
        if raw.ndim != 1:
            raise ValueError(f"GPU block ids are one id per block, not an array of shape {raw.shape}")
        if raw.size == 0:
            return np.zeros(0, dtype=np.int64)
        if raw.dtype.kind not in "iu":
            raise TypeError(f"GPU block ids are integers, not {raw.dtype}")
        low, high = int(raw.min()), int(raw.max())  # before a cast: a uint64 past int64 would wrap negative
        if low < 0 or high >= self.num_blocks:
            raise ValueError(f"GPU block ids must lie in [0, {self.num_blocks}), got {low}..{high}")
        return raw.astype(np.int64, copy=False)

    def _check(self, engine: CopyEngine | None) -> None:
        if (engine is None) != (self.device is None) or (engine is not None and engine.device != self.device):
            where = "host memory" if self.device is None else f"CUDA device {self.device}"
            raise ValueError(
                f"the KV tensors lie in {where}: "
                + ("copy without an engine" if self.device is None else f"give a CopyEngine on device {self.device}")
            )

    def _pages(self, job: PoolJob, count: int, engine: CopyEngine | None) -> tuple[Any, dict[str, Any]]:
        """The first ``count`` pages of the job as ``AttachedPool.store``/``load`` take them, with the
        keywords that go with them: device addresses and their lengths, or views of host memory."""
        if engine is not None:
            return job.addresses[:count].astype(np.int64), {"engine": engine, "page": job.lengths[:count]}
        kinds: dict[int, Any] = {}
        views = []
        for address, n in zip(job.addresses[:count].tolist(), job.lengths[:count].tolist(), strict=True):
            kind = kinds.get(n)
            if kind is None:
                kind = kinds[n] = ctypes.c_ubyte * n
            views.append(kind.from_address(address))
        return views, {}

    async def store(
        self, pool: AttachedPool, job: PoolJob, *, engine: CopyEngine | None = None, after: Any = None
    ) -> int:
        """Store the job's pages and seals (one call); the bytes of the KV pages the pool took.

        :param engine: the CopyEngine on the tensors' device (GPU tensors), None for host memory.
        :param after: with ``engine``: an event (or stream) the copies wait for on the GPU.
        :raises ValueError: an engine that does not match the tensors' device.
        :raises PoolLostError: the pool's owner went away.

        Cancellation: as ``AttachedPool.store``: nothing claimed remains, and each chunk is whole or absent.
        """
        if not job.store:
            raise ValueError(f"job {job.job_id} is a load")
        self._check(engine)
        if not job.keys:
            return 0
        pages, how = self._pages(job, len(job.keys), engine)
        result = await pool.store(job.keys, pages, after=after, **how)
        stored = set(result.stored)
        return sum(
            n
            for k, n, b in zip(job.keys, job.lengths.tolist(), job.gpu_blocks.tolist(), strict=True)
            if b >= 0 and k in stored
        )

    async def load(
        self, pool: AttachedPool, job: PoolJob, *, engine: CopyEngine | None = None, after: Any = None
    ) -> int:
        """Load the job's leading pages that the pool holds; how many keys were loaded (whole GPU blocks).

        A block evicted meanwhile ends the load there, at the start of its GPU block: those before it are
        loaded, the rest are ``job.unfilled(count)``.

        :raises ValueError: an engine that does not match the tensors' device.
        :raises PoolLostError: the pool's owner went away.
        """
        if job.store:
            raise ValueError(f"job {job.job_id} is a store")
        self._check(engine)
        count = len(job.keys)
        for _ in range(LOAD_ROUNDS):
            if count == 0:
                return 0
            try:
                pages, how = self._pages(job, count, engine)
                copied = await pool.load(job.keys[:count], pages, after=after, **how)
                # A block stored shorter than its page (not one this version writes) left the rest of the
                # page as it was: its GPU block is not loaded.
                short = np.flatnonzero(np.asarray(copied, dtype=np.uint64) != job.lengths[:count])
                if not short.size:
                    return count
                return self._block_start(job, int(short[0]))
            except BlockNotFound as exc:
                try:
                    missing = job.keys.index(exc.key)  # type: ignore[arg-type]
                except ValueError:
                    return 0
                count = self._block_start(job, missing)
        return 0

    @staticmethod
    def _block_start(job: PoolJob, index: int) -> int:
        """The first key of the GPU block of key ``index``: a block is loaded whole or not at all."""
        block = job.gpu_blocks[index]
        while index > 0 and job.gpu_blocks[index - 1] == block:
            index -= 1
        return index
