"""The store's tiers below the host tier (a disk tier, a Mooncake tier): blocks worth keeping written
back to them, and found again there on a miss.

Admission by measured value: a block is written below once loads have hit it
``admit_after`` times (an SSD is not worn, nor the network used, by blocks
never read again). Each lower tier has its own write-back (a ``_Lane``): a
queue and a background task that writes one batch per loop turn, with the
blocks pinned in the host tier while their bytes go down (never evicted
under it). A block queued or in a batch being written is not queued again
by the loads that hit it meanwhile. A host-tier eviction then costs nothing:
the copy below stays.
Going the other way (a load whose blocks are only below) is the store's: it
stores them from a ``Source`` into host slots before it copies them out.

The Mooncake tier is a network away: whether it holds a block is an awaited
question (``remote_more``, for ``BlockStore.lookup_remote``), its discards
are sent in the background (tracked here: the store's close waits for
them), and memory a call of it did not give back in time (its ``held``) is
waited for before a slot is unpinned or given back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .._errors import BlockNotFound, MooncakeError, TierClosedError
from .._lifecycle import finish
from ._index import I64, BlockIndex
from ._keys import Key

if TYPE_CHECKING:
    from .._disk._tier import DiskTier
    from .._host._tier import HostTier
    from .._mooncake._tier import MooncakeTier

__all__ = ["PIECE_BYTES", "Source", "Spill"]

PIECE_BYTES = 8 << 20
"""What a load brings back from the disk tier in one go (at least a block)."""

log = logging.getLogger("aiokvtier")


class _Lower(Protocol):
    """What a write-back needs of a tier below the host tier: ``DiskTier`` and ``MooncakeTier`` have it."""

    @property
    def closed(self) -> bool: ...

    async def write(self, keys: Sequence[Key], addresses: Sequence[int], lengths: Sequence[int]) -> tuple[Key, ...]: ...


_Released = Callable[[Sequence[int], Sequence[int]], Awaitable[bool]]
"""Waits until the lower tier no longer uses this memory; False: it may for good (do not reuse it)."""


class _Lane:
    """The write-back to one lower tier: its queue, its task, and what it wrote."""

    __slots__ = ("dropped", "flying", "holds", "name", "queue", "released", "sent", "task", "tier", "written")

    def __init__(
        self, tier: _Lower, name: str, holds: Callable[[Key], bool] | None, released: _Released | None
    ) -> None:
        self.tier = tier
        self.name = name
        self.holds = holds
        """Whether the tier holds a key, asked before it is queued. None where that is a network call:
        the lane remembers instead the keys it wrote (or that came from it) while they are in host slots."""
        self.released = released
        self.sent: set[Key] = set()
        self.queue: dict[Key, None] = {}
        """Keys waiting for the task, in order."""
        self.flying: set[Key] = set()
        """The keys of the batch the task has taken (being written, or about to be)."""
        self.dropped: set[Key] = set()
        """Keys of that batch discarded meanwhile: not remembered as written, and discarded again once
        the write settled (a discard sent before could overtake the put)."""
        self.task: asyncio.Task[None] | None = None
        self.written = 0

    def wants(self, key: Key) -> bool:
        # A block queued or being written is not queued again: a load that hits it meanwhile would
        # write it twice (the tier cannot tell, a put of a key it holds counts as written).
        if key in self.queue or key in self.flying:
            return False
        return key not in self.sent if self.holds is None else not self.holds(key)


class Source:
    """A lower tier that ``load`` brings blocks back from, into host slots (the store's promotion)."""

    def __init__(self, tier: HostTier, name: str) -> None:
        self._tier = tier
        self.name = name
        self.brought = 0
        """Blocks brought back into host slots (counted by the store)."""
        self.piece = 0
        """Bytes a load brings back in one go, each piece copied out as soon as it landed while the next
        ones are read; 0: all of a load's blocks in one go."""

    def lengths(self, keys: Sequence[Key]) -> list[int]:
        """The bytes to book a slot with, per key.

        :raises BlockNotFound: a key the tier does not hold (or the tier is closed).
        """
        raise NotImplementedError

    async def fill(self, keys: Sequence[Key], slots: I64, lengths: list[int]) -> list[int]:
        """Read ``keys`` into host ``slots`` (booked with ``lengths``); per key, the bytes that arrived (0: a miss).

        Never raises for a miss; returns once nothing of the tier writes into the slots any more.
        """
        raise NotImplementedError


class _DiskSource(Source):
    def __init__(self, tier: HostTier, disk: DiskTier) -> None:
        super().__init__(tier, "disk")
        self.disk = disk
        # Pieces of 8 MiB: a load ends one piece's copy after its last read, not a whole copy after it.
        # The pieces are queued on the disk's threads together, so the disk stays as busy as with one
        # read; with the default 4 threads, a thread's share of a piece is one run of 2 MiB (the most one
        # call moves). Each piece costs the event loop a promotion, a read and a copy: 4 MiB pieces add
        # about twice the CPU that 8 MiB pieces add, for no faster load on the development VM (docs/benchmarks.md).
        self.piece = PIECE_BYTES

    def lengths(self, keys: Sequence[Key]) -> list[int]:
        disk = self.disk
        out = []
        for key in keys:
            if disk.closed or key not in disk:  # a closed disk tier holds nothing any more
                raise BlockNotFound(key)
            out.append(disk.length(key))
        return out

    async def fill(self, keys: Sequence[Key], slots: I64, lengths: list[int]) -> list[int]:
        # The slots were booked with the lengths seen before; the disk tier may have closed, or
        # dropped or rewritten a block, while they were taken.
        disk = self.disk
        there = [
            i
            for i, (key, length) in enumerate(zip(keys, lengths, strict=True))
            if not disk.closed and key in disk and disk.length(key) == length
        ]
        sizes = [0] * len(keys)
        if there:
            addresses = self._tier.slot_addresses(slots[there]).tolist()
            arrived = await disk.read([keys[i] for i in there], addresses)
            for i, ok in zip(there, arrived, strict=True):
                sizes[i] = lengths[i] if ok else 0
        return sizes


class _RemoteSource(Source):
    def __init__(self, tier: HostTier, spill: Spill, remote: MooncakeTier) -> None:
        super().__init__(tier, "Mooncake")
        self._spill = spill
        self.remote = remote
        # In one go (piece 0): a piece would be a batch get of its own, a network round trip each.

    def lengths(self, keys: Sequence[Key]) -> list[int]:
        return [self._tier.slot_size] * len(keys)  # the room: a block's size is known once it arrived

    async def fill(self, keys: Sequence[Key], slots: I64, lengths: list[int]) -> list[int]:
        remote = self.remote
        addresses = self._tier.slot_addresses(slots).tolist()
        try:
            await self._spill.cover()
            sizes = list(await remote.read_into(keys, addresses, lengths))
        except (TierClosedError, MooncakeError, ValueError) as exc:  # closed meanwhile; the slots not registered
            log.warning("aiokvtier: reading blocks from the Mooncake tier failed: %r", exc)
            return [0] * len(keys)
        if not await remote.released(addresses, lengths):
            log.error("aiokvtier: a Mooncake get that did not return may still write into host slots %s", slots)
        if any(sizes):
            self._spill.arrived(keys, sizes)
        return sizes


class Spill:
    """Hit counts and the write-back to each lower tier; the sources ``load`` brings blocks back from."""

    def __init__(
        self,
        disk: DiskTier | None,
        remote: MooncakeTier | None,
        tier: HostTier,
        index: BlockIndex,
        admit_after: int,
        busy: tuple[Callable[[], None], Callable[[], None]],
    ) -> None:
        self.disk = disk
        self.remote = remote
        self._enter, self._exit = busy
        """The store's count of work in flight (its pins are this work's): entered per write-back task,
        from the load that queued its first block to its end."""
        self._tier = tier
        self._index = index
        self.admit_after = admit_after
        self._hits: dict[Key, int] = {}
        """Loads that hit each block not yet admitted (dropped with the block)."""
        self._lanes: list[_Lane] = []
        self.disk_source: Source | None = None
        self.remote_source: Source | None = None
        self._remote_lane: _Lane | None = None
        if disk is not None:
            self._lanes.append(_Lane(disk, "disk", disk.__contains__, None))
            self.disk_source = _DiskSource(tier, disk)
        if remote is not None:
            self._remote_lane = _Lane(remote, "Mooncake", None, remote.released)
            self._lanes.append(self._remote_lane)
            self.remote_source = _RemoteSource(tier, self, remote)
        self._discards: set[asyncio.Task[None]] = set()
        self._registered: list[int] = []
        """Addresses of the host memory this store registered with the Mooncake tier, in order."""
        self._covered = 0
        """The end of that memory."""
        self._cover_lock = asyncio.Lock()
        self._stopped = False
        """The store's close began: nothing more is queued, and no batch is taken."""

    def written(self, name: str) -> int:
        """Blocks written back to the lower tier ``name`` ("disk", "Mooncake")."""
        return sum(lane.written for lane in self._lanes if lane.name == name)

    # -- lookups -----------------------------------------------------------------------

    def lookup_more(self, keys: Sequence[Key], start: int) -> int:
        """How many keys from ``start`` on the disk holds, in a row (after a host prefix of ``start``)."""
        disk = self.disk
        return disk.lookup(keys[start:]) if disk is not None and start < len(keys) and not disk.closed else 0

    async def remote_more(self, keys: Sequence[Key], start: int) -> int:
        """How many keys from ``start`` on are found in a row in some tier, asking the Mooncake tier
        about those that neither the host tier nor the disk tier holds. 0 while it is unavailable."""
        remote = self.remote
        rest = keys[start:]
        if remote is None or not rest or not remote.available:
            return 0
        index, disk = self._index, self.disk
        local = index.ready(index.slots(rest)).tolist()
        if disk is not None and not disk.closed:
            local = [here or key in disk for key, here in zip(rest, local, strict=True)]
        asked = [i for i, here in enumerate(local) if not here]
        try:
            n = await remote.lookup([rest[i] for i in asked])
        except TierClosedError:
            return 0
        return len(rest) if n == len(asked) else asked[n]

    def source_of(self, key: Key) -> Source:
        """Where ``load`` can bring ``key`` (absent from the host tier) back from.

        :raises BlockNotFound: no lower tier holds it (the disk tier does not, and there is no
            Mooncake tier or it is unavailable).
        """
        disk = self.disk
        if disk is not None and not disk.closed and key in disk:
            assert self.disk_source is not None
            return self.disk_source
        if self.remote_source is None or self.remote is None or not self.remote.available:
            raise BlockNotFound(key)
        return self.remote_source

    # -- admission and write-back -------------------------------------------------------

    def loaded(self, keys: Sequence[Key]) -> None:
        """Loads hit ``keys``: count them, and queue those that reach the admission count."""
        lanes = [lane for lane in self._lanes if not lane.tier.closed]
        if not lanes or self._stopped:
            return
        hits, admit = self._hits, self.admit_after
        for key in keys:
            n = hits.get(key, 0) + 1
            if n < admit:
                hits[key] = n
                continue
            hits.pop(key, None)
            for lane in lanes:
                if lane.wants(key):
                    lane.queue[key] = None
        loop = asyncio.get_running_loop()
        for lane in lanes:
            if lane.queue and lane.task is None:
                lane.task = loop.create_task(self._flush(lane), name=f"aiokvtier-store-write-back-{lane.name}")
                self._enter()

    def arrived(self, keys: Sequence[Key], sizes: Sequence[int]) -> None:
        """Blocks read from the Mooncake tier: not written back to it again while they stay in host slots."""
        if self._remote_lane is not None:
            self._remote_lane.sent.update(key for key, n in zip(keys, sizes, strict=True) if n)

    def forget(self, keys: Sequence[Key]) -> None:
        """Blocks gone from the host tier: their hit counts and queued write-backs go with them."""
        hits = self._hits
        if hits:
            for key in keys:
                hits.pop(key, None)
        for lane in self._lanes:
            if lane.queue:
                for key in keys:
                    lane.queue.pop(key, None)
            if lane.sent:
                lane.sent.difference_update(keys)

    async def _flush(self, lane: _Lane) -> None:
        """Write the queued blocks that are still ready, pinned meanwhile; until the queue is empty."""
        try:
            while lane.queue and not self._stopped:
                keys = list(lane.queue)
                lane.queue.clear()
                lane.flying.update(keys)
                try:
                    await self._write_back(lane, keys)
                except Exception as exc:  # the host tier keeps serving: the tiers below are caches of it
                    log.warning("aiokvtier: writing blocks back to the %s tier failed: %r", lane.name, exc)
                finally:  # not written, or written: a later load may queue them again (a failed one retried)
                    lane.flying.clear()
                    lane.dropped.clear()
        finally:
            lane.task = None
            self._exit()

    async def _write_back(self, lane: _Lane, keys: list[Key]) -> None:
        """Write one batch taken from the queue (``lane.flying``): those of its blocks still ready."""
        index = self._index
        if lane.released is not None:
            await self.cover()  # before the slots are looked up: it may await
        slots = np.fromiter((index.ready_slot(k) for k in keys), dtype=np.int64, count=len(keys))
        keep = slots >= 0
        keys = [k for k, ok in zip(keys, keep.tolist(), strict=True) if ok]
        slots = slots[keep]
        if not keys or self._tier.closed or lane.tier.closed:
            return
        index.pin(slots)
        try:
            addresses = self._tier.slot_addresses(slots).tolist()
            lengths = index.length[slots].tolist()
            written = await lane.tier.write(keys, addresses, lengths)
            if lane.released is not None and not await lane.released(addresses, lengths):
                log.error("aiokvtier: a %s put that did not return may still read host slots", lane.name)
        finally:
            index.unpin(slots)
        lane.written += len(written)
        if lane.holds is None:
            late = lane.dropped
            lane.sent.update(key for key in written if key not in late)
            again = [key for key in written if key in late]
            if again and self.remote is not None:
                self._discard_remote_soon(self.remote, again)

    # -- discards ---------------------------------------------------------------------

    def discard(self, keys: Sequence[Key]) -> None:
        """Drop ``keys`` from every lower tier: the disk tier's at once, the Mooncake tier's in the
        background (and again once a write-back of them in flight settled)."""
        self.forget(keys)
        lane = self._remote_lane
        if lane is not None and lane.flying:
            lane.dropped.update(key for key in keys if key in lane.flying)
        disk, remote = self.disk, self.remote
        if disk is not None and not disk.closed:
            disk.discard(keys)  # a discarded block is wrong or unwanted everywhere
        if remote is not None and keys:
            self._discard_remote_soon(remote, list(keys))

    def _discard_remote_soon(self, remote: MooncakeTier, keys: list[Key]) -> None:
        if not remote.available:
            return
        task = asyncio.get_running_loop().create_task(
            self._discard_remote(remote, keys), name="aiokvtier-store-discard-Mooncake"
        )
        self._discards.add(task)
        task.add_done_callback(self._discards.discard)

    @staticmethod
    async def _discard_remote(remote: MooncakeTier, keys: list[Key]) -> None:
        try:
            await remote.discard(keys)
        except Exception as exc:  # closed meanwhile: nothing left to drop there from this store
            log.warning("aiokvtier: discarding blocks from the Mooncake tier failed: %r", exc)

    # -- the store's memory in the Mooncake tier ------------------------------------------

    async def cover(self) -> None:
        """Register the host tier's slots with the Mooncake tier, as far as the tier reaches now
        (once at the store's open, then what a resize added). Its transfers use them in place.

        :raises MooncakeError, TierClosedError: the Mooncake tier refused, or is closed.
        """
        remote = self.remote
        if remote is None:
            return
        async with self._cover_lock:
            base = self._tier.base_address
            end = base + self._tier.slots_total * self._tier.slot_size
            start = max(base, self._covered)
            if end <= start:
                return
            await finish(remote.register(start, end - start))
            self._registered.append(start)
            self._covered = end

    async def uncover(self) -> None:
        """Unregister what ``cover()`` registered (the store's close, once nothing of it is in flight)."""
        remote = self.remote
        registered, self._registered, self._covered = self._registered, [], 0
        for address in registered:
            assert remote is not None
            try:
                await finish(remote.unregister(address))
            except TierClosedError:  # closed first by its owner: unregistered by its close
                return
            except (ValueError, MooncakeError) as exc:  # held, or refused (its master gone): the tier's close tries
                log.warning("aiokvtier: the store's memory stays registered with the Mooncake tier: %s", exc)

    def stop(self) -> None:
        """The store's close began: the blocks queued for a write-back, or hit from now on, are not
        written (the batch in flight is)."""
        self._stopped = True
        for lane in self._lanes:
            lane.queue.clear()

    async def drain(self) -> None:
        """Wait for the write-backs and discards in flight (the store's close, after ``stop()``)."""
        self.stop()
        for lane in self._lanes:
            while lane.task is not None:
                await asyncio.shield(lane.task)
        while self._discards:
            await asyncio.wait(list(self._discards))
