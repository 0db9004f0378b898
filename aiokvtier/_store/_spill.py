"""The store's disk tier: blocks worth keeping written back, and found again there on a miss.

Admission by measured value: a block is written to disk once loads have hit
it ``admit_after`` times (an SSD is not worn by blocks never read again).
The write-back runs in the background, one batch per loop turn, with the
blocks pinned in the host tier while their bytes go to disk (never evicted
under it). A host-tier eviction then costs nothing: the disk copy stays.
Going the other way (a load whose blocks are only on disk) is the store's:
it stores them from disk into host slots before it copies them out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ._index import BlockIndex
from ._keys import Key

if TYPE_CHECKING:
    from .._disk._tier import DiskTier
    from .._host._tier import HostTier

__all__ = ["Spill"]

log = logging.getLogger("aiokvtier")


class Spill:
    """Hit counts, the write-back queue and its task, over one open ``DiskTier``."""

    def __init__(
        self,
        disk: DiskTier,
        tier: HostTier,
        index: BlockIndex,
        admit_after: int,
        busy: tuple[Callable[[], None], Callable[[], None]],
    ) -> None:
        self.disk = disk
        self._enter, self._exit = busy
        """The store's count of work in flight (its pins are this work's): entered per write-back batch."""
        self._tier = tier
        self._index = index
        self.admit_after = admit_after
        self._hits: dict[Key, int] = {}
        """Loads that hit each block not yet on disk (dropped with the block)."""
        self._queue: list[Key] = []
        self._task: asyncio.Task[None] | None = None
        self.written_back = 0
        self.promoted = 0

    @property
    def writing(self) -> bool:
        """A write-back is in flight (its blocks pinned)."""
        return self._task is not None

    def lookup_more(self, keys: Sequence[Key], start: int) -> int:
        """How many keys from ``start`` on the disk holds, in a row (after a host prefix of ``start``)."""
        return self.disk.lookup(keys[start:]) if start < len(keys) and not self.disk.closed else 0

    def loaded(self, keys: Sequence[Key]) -> None:
        """Loads hit ``keys``: count them, and queue those that reach the admission count."""
        if self.disk.closed:
            return
        hits, disk, admit = self._hits, self.disk, self.admit_after
        for key in keys:
            n = hits.get(key, 0) + 1
            if n < admit:
                hits[key] = n
                continue
            hits.pop(key, None)
            if key not in disk:
                self._queue.append(key)
        if self._queue and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._flush(), name="aiokvtier-store-write-back")

    def forget(self, keys: Sequence[Key]) -> None:
        """Blocks gone from the host tier: their hit counts go with them."""
        hits = self._hits
        if hits:
            for key in keys:
                hits.pop(key, None)

    async def _flush(self) -> None:
        """Write the queued blocks that are still ready, pinned meanwhile; until the queue is empty."""
        index = self._index
        try:
            while self._queue:
                keys, self._queue = list(dict.fromkeys(self._queue)), []
                slots = np.fromiter((index.ready_slot(k) for k in keys), dtype=np.int64, count=len(keys))
                keep = slots >= 0
                keys = [k for k, ok in zip(keys, keep.tolist(), strict=True) if ok]
                slots = slots[keep]
                if not keys or self._tier.closed or self.disk.closed:
                    continue
                self._enter()
                index.pin(slots)
                try:
                    written = await self.disk.write(
                        keys, self._tier.slot_addresses(slots).tolist(), index.length[slots].tolist()
                    )
                finally:
                    index.unpin(slots)
                    self._exit()
                self.written_back += len(written)
        except Exception as exc:  # the host tier keeps serving: the disk is a cache below it
            log.warning("aiokvtier: writing blocks back to the disk tier failed: %r", exc)
        finally:
            self._task = None

    async def drain(self) -> None:
        """Wait for the write-back in flight (the store's close)."""
        self._queue.clear()
        while self._task is not None:
            await asyncio.shield(self._task)
