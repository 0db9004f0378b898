"""BlockStore: the KV block cache a serving engine awaits, on top of a tier.

One block per key, one tier slot per block, taken on demand and given back
on eviction, discard, or a failed or cancelled store: the store keeps no
private pool. Bookkeeping is arrays indexed by slot id (state, length, pins)
plus one dict from key to slot, so a million blocks cost about a hundred bytes
each beside their keys.

A block's life::

    (absent) ──store──> storing ──copy landed──> ready ──evict/discard──> (absent)
                           │                       │ load pins it; evicted only unpinned;
                           └─ failed/cancelled ─>  │ discarded while pinned: doomed, freed at unpin
                              (slot given back)

Only ``ready`` blocks are visible to ``lookup``, ``load`` and ``in``. A store
of a key that another store is writing waits for that store instead of
copying twice. Copies go through a ``CopyEngine`` (device memory) or,
without one, ``memmove`` on the store's own thread.

This module validates each call and orchestrates it; the parts are
``_keys`` (keys made bytes or ints), ``_index`` (key <-> slot, per-slot
state, pins and lengths, with the policy), ``_claims`` (keys other calls are
storing) and ``_transfers`` (the caller's pages and every copy of them).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from itertools import compress
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._config import parse_quota
from .._crossing import one_moment
from .._errors import BlockNotFound, OutOfSlots, QuotaError, TierClosedError, WouldBlock, key_text
from .._lifecycle import Lifecycle, Owner, finish
from ._claims import Claims
from ._events import EventHub, EventSubscription
from ._index import I64, NO_IDS, READY, U64, BlockIndex, require
from ._keys import Key, NotCanonical, canonical, key_list, key_of, key_seq, keys_of
from ._policy import EvictionPolicy, has_repeats, make_policy
from ._result import StoreResult
from ._spill import Source, Spill
from ._transfers import Pages, Started, Transfers

if TYPE_CHECKING:
    from .._copy._engine import CopyEngine
    from .._disk._tier import DiskStatistics, DiskTier
    from .._host._tier import HostTier
    from .._mooncake._tier import MooncakeStatistics, MooncakeTier

__all__ = ["BlockStore", "StoreResult", "StoreStatistics"]

log = logging.getLogger("aiokvtier")

_MISSING, _STORED, _PRESENT, _SKIPPED = 0, 1, 2, 3  # a key's outcome in one store call


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """A snapshot of a [``BlockStore``][aiokvtier.BlockStore]."""

    policy: str
    blocks: int
    """Visible blocks."""
    capacity: int
    """The tier's slot count."""
    queries: int
    """``lookup`` and ``lookup_remote`` calls that answered (a cancelled one counts nothing here or below)."""
    hits: int
    """Keys matched by ``lookup`` (the stored prefix)."""
    misses: int
    """Keys asked of ``lookup`` beyond the stored prefix (of ``lookup_remote``: beyond the prefix any tier holds)."""
    stores: int
    """Blocks stored."""
    present: int
    """Keys a store found already there."""
    skipped: int
    loads: int
    """Blocks loaded."""
    evictions: int
    discards: int
    bytes_stored: int
    bytes_loaded: int
    blocks_pinned: int
    """Blocks a load is reading now (never evicted)."""
    in_flight: int
    """Store and load calls running now."""
    subscribers: int
    """Event subscriptions alive: made by ``BlockStore.events()`` and neither ended, closed nor dropped."""
    disk_hits: int = 0
    """Keys ``lookup`` found on the disk tier past the host tier's prefix."""
    promoted: int = 0
    """Blocks a ``load`` brought back from the disk tier into the host tier."""
    written_back: int = 0
    """Blocks written to the disk tier (admitted after ``admit_after`` load hits)."""
    disk: DiskStatistics | None = None
    """The disk tier's own figures; None without one."""
    remote_hits: int = 0
    """Keys ``lookup_remote`` found only on the Mooncake tier past the local prefix."""
    remote_fetched: int = 0
    """Blocks a ``load`` brought from the Mooncake tier into the host tier."""
    remote_written: int = 0
    """Blocks written to the Mooncake tier (admitted after ``admit_after`` load hits)."""
    remote: MooncakeStatistics | None = None
    """The Mooncake tier's own figures; None without one."""


class _Own:
    """A block one store call stored, kept pinned by the call while it retries other keys."""

    __slots__ = ("key", "position", "slot")

    def __init__(self, position: int, key: Key, slot: int) -> None:
        self.position = position
        """In the call's keys."""
        self.key = key
        self.slot = slot
        """Pinned by the call; -1 once unpinned or given up (or when the block was gone before the pin)."""


_Start = Callable[[I64, Pages, Sequence[Key]], Started]
"""Queue the copy of a call's blocks (``keys``, as ``pages``) into the slots taken for them."""


class _LowerMiss(Exception):
    """A block a lower tier held came back as a miss (a read error, a failed checksum, gone meanwhile)."""

    def __init__(self, key: Key) -> None:
        self.key = key


class _Promotion:
    """Keys a load is bringing back from a lower tier; those a ``discard`` named meanwhile must not land."""

    __slots__ = ("keys", "unwanted")

    def __init__(self, keys: Sequence[Key]) -> None:
        self.keys = frozenset(keys)
        self.unwanted: set[Key] = set()


class _Call:
    """One store call across its retries (each retry is a nested pass over some of its keys).

    The contract it keeps: no key past a skipped one is stored. ``limit`` is
    the position of the first key skipped so far; a pass stores no key at or
    past it, and a block the call stored past it is given up again.
    """

    __slots__ = ("given_up", "limit", "own", "start")

    def __init__(self, n: int, start: _Start | None = None) -> None:
        self.start = start
        """Fills the call's slots (default: the caller's pages through the transfers)."""
        self.limit = n
        self.own: list[_Own] = []
        """Blocks stored by earlier passes, pinned while later passes run."""
        self.given_up: list[int] = []
        """Positions of blocks the call stored and gave up again: reported skipped."""


class BlockStore(Owner):
    """KV blocks keyed by block hashes, in tier slots, with eviction, pinning and awaited copies.

    ``async with BlockStore(tier, engine=None, policy="lru") as store:`` or
    ``store = await BlockStore.open(tier, ...)``. The store never closes the
    tier or the engine it was given: whoever opened them closes them, after
    the store.

    Threads: every method belongs to the event loop that opened the store
    (the tier's). Cancellation: a cancelled ``store`` or ``load`` leaves no
    partial block visible and no slot taken, and delivers ``CancelledError``
    only once nothing reads or writes the caller's pages any more.

    :param tier: an open [``HostTier``][aiokvtier.HostTier]; one block per slot.
    :param engine: a [``CopyEngine``][aiokvtier.CopyEngine] for device pages (tensors or
        addresses), or None for host pages copied on the store's thread.
    :param policy: ``"lru"`` (default), ``"s3fifo"``, or an
        [``EvictionPolicy``][aiokvtier.EvictionPolicy] instance.
    :param event_limit: events kept per subscriber of ``events()`` before
        the oldest are dropped.
    :param disk: an open [``DiskTier``][aiokvtier.DiskTier] below the host tier
        (its ``block_size`` the tier's slot size): blocks loaded ``admit_after``
        times are written back to it in the background, ``lookup`` counts the
        keys it holds past the host prefix, and ``load`` brings blocks found
        only there back into host slots before it copies them out.
    :param remote: an open [``MooncakeTier``][aiokvtier.MooncakeTier] below the host (and disk)
        tier, its ``block_size`` the slot size: admitted blocks are written to it too (in the
        background), ``lookup_remote`` counts the keys it holds past the local prefix, and ``load``
        brings blocks found only there into host slots. The store registers the host tier's slots
        with it at open and unregisters them at close. Its calls are network calls: ``lookup``
        never asks it, and while it is unavailable it is skipped, never an error.
    :param admit_after: load hits that admit a block to the tiers below.
    :raises TypeError: ``tier`` is not a HostTier, ``engine`` is a device number rather than a
        CopyEngine, or ``policy`` is neither a name nor an EvictionPolicy.
    :raises ValueError: ``event_limit`` or ``admit_after`` below 1.
    """

    def __init__(
        self,
        tier: HostTier,
        engine: CopyEngine | None = None,
        policy: str | EvictionPolicy = "lru",
        *,
        event_limit: int = 1024,
        disk: DiskTier | None = None,
        remote: MooncakeTier | None = None,
        admit_after: int = 2,
    ) -> None:
        from .._host._tier import HostTier

        if not isinstance(tier, HostTier):  # a config, a pool or None would fail at open, far from here
            raise TypeError(
                f"tier is an open HostTier (async with HostTier(config) as tier), not {type(tier).__name__}"
            )
        if isinstance(engine, int):  # a device number where the engine for it goes
            raise TypeError(f"engine is a CopyEngine (async with CopyEngine({engine}) as engine) or None, not int")
        if not isinstance(policy, str | EvictionPolicy):
            raise TypeError(f"policy is a name or an EvictionPolicy, not {type(policy).__name__}")
        if type(event_limit) is not int or event_limit < 1:
            raise ValueError(f"event_limit must be a positive int, got {event_limit!r}")
        if type(admit_after) is not int or admit_after < 1:
            raise ValueError(f"admit_after must be a positive int, got {admit_after!r}")
        self._disk = disk
        self._remote = remote
        self._admit_after = admit_after
        self._spill: Spill | None = None
        self._tier = tier
        self._engine_given = engine
        self._policy_arg = policy
        self._life = Lifecycle("BlockStore", "aiokvtier-store")
        self._events = EventHub(event_limit)
        self._index = BlockIndex(tier, self._evicted)
        self._claims = Claims()
        self._promotions: list[_Promotion] = []
        """Promotions in flight (a ``discard`` tells each of the keys it named)."""
        self._transfers = Transfers(tier, engine, self._life)
        self._fill_failure_logged: str | None = None  # the fill failure last warned of
        self._in_flight = 0
        self._idle: asyncio.Event | None = None
        self._resize_lock = asyncio.Lock()
        self._counts = dict.fromkeys(
            (
                "queries",
                "hits",
                "misses",
                "stores",
                "present",
                "skipped",
                "loads",
                "evictions",
                "discards",
                "bytes_stored",
                "bytes_loaded",
                "disk_hits",
                "remote_hits",
            ),
            0,
        )

    # -- lifecycle --------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        tier: HostTier,
        engine: CopyEngine | None = None,
        policy: str | EvictionPolicy = "lru",
        *,
        event_limit: int = 1024,
        disk: DiskTier | None = None,
        remote: MooncakeTier | None = None,
        admit_after: int = 2,
    ) -> BlockStore:
        """Open a store over an open tier.

        :raises TierClosedError: the tier (or the engine, the disk or the Mooncake tier) is not open.
        :raises ValueError: an unknown policy name, a disk or Mooncake tier whose block size is not the
            slot size, or a disk and a Mooncake tier of different fingerprints.
        :raises MooncakeError: the Mooncake tier refused to register the host tier's slots.
        """
        store = cls(tier, engine, policy, event_limit=event_limit, disk=disk, remote=remote, admit_after=admit_after)
        await store.__aenter__()
        return store

    async def _build(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._tier.check_open()
        if self._engine_given is not None:
            self._engine_given.check_open()
        disk, remote = self._disk, self._remote
        for name, lower in (("disk", disk), ("Mooncake", remote)):
            if lower is None:
                continue
            lower.check_open()
            if lower.block_size != self._tier.slot_size:
                raise ValueError(
                    f"the {name} tier's blocks are {lower.block_size} bytes, the tier's slots "
                    f"{self._tier.slot_size}: they must be the same"
                )
        if disk is not None and remote is not None and disk.fingerprint != remote.fingerprint:
            raise ValueError(
                f"the disk tier's fingerprint {disk.fingerprint!r} is not the Mooncake tier's "
                f"{remote.fingerprint!r}: their blocks would not be the same blocks"
            )
        capacity = self._tier.slots_total
        self._index.attach(make_policy(self._policy_arg, capacity), capacity)
        self._idle = asyncio.Event()
        self._idle.set()
        if disk is not None or remote is not None:
            busy = (self._enter_quietly, self._exit)
            self._spill = Spill(disk, remote, self._tier, self._index, self._admit_after, busy)
            await self._spill.cover()  # last: nothing after it can fail the open

    async def _teardown(self) -> None:
        if self._spill is not None:
            self._spill.stop()  # the write-back batch in flight finishes; queued blocks are not written
        if self._idle is not None:
            await self._idle.wait()  # stores and loads in flight finish first
        if self._spill is not None:
            await self._spill.drain()  # blocks being written back stay pinned until then
        self._events.close()
        self._index.release_all()  # the blocks go with the store; the tier stays the owner's
        if self._spill is not None:
            await self._spill.uncover()
        await self._life.run_undo()

    async def aclose(self) -> None:
        """Wait for stores and loads in flight, give every block's slot back to the tier, end the event streams.

        Idempotent; the tier and the engine stay open. Cancelling it does not
        interrupt the teardown.
        """
        await self._life.close(self._teardown)

    # -- queries ------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._index.visible

    def __contains__(self, key: object) -> bool:
        try:
            return self._index.ready_slot(key_of(key)) >= 0
        except TypeError:
            return False

    def length(self, key: object) -> int:
        """Bytes the block of ``key`` holds (what ``load`` copies). Does not touch it.

        :raises BlockNotFound: the key is not stored.
        :raises TypeError: a key that is not bytes-like or an int.
        """
        return int(self._index.length[self.slot(key)])

    def slot(self, key: object) -> int:
        """The tier slot that holds the block of ``key`` (``tier.view(slot)`` shows its bytes). Does not touch it.

        The slot is the block's until the block is evicted or discarded.

        :raises BlockNotFound: the key is not stored.
        :raises TypeError: a key that is not bytes-like or an int.
        """
        key = key_of(key)
        slot = self._index.ready_slot(key)
        if slot < 0:
            raise BlockNotFound(key)
        return slot

    def keys(self) -> list[Key]:
        """The keys of the stored blocks (those ``in`` the store), in no particular order: a snapshot."""
        index = self._index
        state = index.state
        return [key for key, slot in index.slot_of.items() if state[slot] == READY]

    def check_invariants(self, *, sole_user: bool = False) -> None:
        """Check the store's bookkeeping against itself, its policy and the tier: for tests and debugging.

        At any time: every block (stored, or being stored) has a slot that the
        tier has allocated, below the tier's and the store's slot counts; a key
        and its slot name each other; keys are ``bytes`` or ``int``; only
        blocks that can be read are pinned, and a block discarded while a load
        reads it is pinned; a policy that says what it tracks
        (``EvictionPolicy.tracked()``) is sized for the store's slots and
        tracks every stored block and no slot without a block. Once no store
        or load is in flight: no pin, no claim, no block being stored, and the
        policy tracks exactly the stored blocks; with ``sole_user`` (nothing
        else allocates from the tier), ``tier.statistics().slots_allocated ==
        len(store)``.

        A pass over every slot and key: not for a hot path. Call it from the
        store's event loop.

        :raises AssertionError: an invariant does not hold (the message names it).
        :raises TierClosedError: the store or its tier is closed.
        """
        self._check_open()
        idle = self._in_flight == 0  # a write-back (its blocks pinned) is in flight as a load is
        self._index.check(idle)
        if idle:
            require(not len(self._claims), "a claim outlived its call")
            if sole_user:
                allocated = self._tier.statistics().slots_allocated
                require(allocated == len(self), f"the tier has {allocated} slots allocated for {len(self)} blocks")

    def lookup(self, keys: Sequence[object]) -> int:
        """How many leading keys are stored (a prefix hit); touches them. Never blocks.

        With a disk tier, the prefix goes on through the keys it holds (a
        ``load`` of them brings them back). The Mooncake tier is not asked
        (a network call): ``lookup_remote`` does.

        :raises TypeError: a key is not bytes-like or an int (a bool, a str).
        :raises TierClosedError: the store is closed.
        """
        self._check_open()
        keys = key_seq(keys)
        hits, disk_hits = self._lookup_local(keys)
        self._count_lookup(len(keys), hits, disk_hits, 0)
        return hits + disk_hits

    def _check_loop(self) -> None:
        """:raises RuntimeError: the running loop is not the one that opened the store (its tier's)."""
        loop = self.__dict__.get("_loop")
        if loop is not None and asyncio.get_running_loop() is not loop:
            raise RuntimeError("this BlockStore belongs to the event loop that opened it; call it from that loop")

    async def lookup_remote(self, keys: Sequence[object]) -> int:
        """``lookup``, then the Mooncake tier: how many leading keys some tier holds (a ``load`` of
        them brings those found only below back). Touches the host tier's prefix.

        The Mooncake tier is asked about the keys past the local prefix that neither the host nor
        the disk tier holds, in one call bounded by its ``timeout``; while it is unavailable (or
        without one) this is ``lookup``. A block found there may be gone by the ``load``: a
        ``BlockNotFound`` then. Cancellation: nothing to undo (nothing is claimed), and a call
        that is cancelled (or fails) counts nothing in the statistics: they count the keys of
        the calls that answered (the host tier's prefix may have been touched all the same).

        :raises TypeError: a key is not bytes-like or an int (a bool, a str).
        :raises TierClosedError: the store is closed.
        :raises RuntimeError: called from a loop other than the store's.
        """
        self._check_open()
        self._check_loop()
        keys = key_seq(keys)
        hits, disk_hits = self._lookup_local(keys)
        found = hits + disk_hits
        more = 0
        if self._spill is not None and found < len(keys):
            more = await self._spill.remote_more(keys, found)
        self._count_lookup(len(keys), hits, disk_hits, more)
        return found + more

    def _lookup_local(self, keys: Sequence[Key]) -> tuple[int, int]:
        """The prefix found in the host tier (touched), then on through the disk tier: the two lengths."""
        index = self._index
        slots = index.slots(keys)
        misses = np.flatnonzero(~index.ready(slots))
        hits = int(misses[0]) if misses.size else len(keys)
        if hits:
            index.policy.accessed(slots[:hits])
        more = 0 if self._spill is None else self._spill.lookup_more(keys, hits)
        return hits, more

    def _count_lookup(self, asked: int, hits: int, disk_hits: int, remote_hits: int) -> None:
        """Count a lookup once it answered: a cancelled or failed one counts nothing."""
        counts = self._counts
        counts["queries"] += 1
        counts["hits"] += hits
        counts["disk_hits"] += disk_hits
        counts["remote_hits"] += remote_hits
        counts["misses"] += asked - hits - disk_hits - remote_hits

    def statistics(self) -> StoreStatistics:
        """A snapshot of the store's figures (any thread, also after close: from another thread while the
        store is open it is taken on the store's loop, between two of its callbacks, so it waits for it)."""
        # Read off the loop, the blocks and the capacity (a shrink) come from two moments.
        return one_moment(self.__dict__.get("_loop"), self._snapshot, settled=self._life.state == "closed")

    def _snapshot(self) -> StoreStatistics:
        c = self._counts
        spill = self._spill
        return StoreStatistics(
            policy=self._policy_arg if isinstance(self._policy_arg, str) else self._policy_arg.name,
            blocks=self._index.visible,
            capacity=self._tier.slots_total,
            queries=c["queries"],
            hits=c["hits"],
            misses=c["misses"],
            stores=c["stores"],
            present=c["present"],
            skipped=c["skipped"],
            loads=c["loads"],
            evictions=c["evictions"],
            discards=c["discards"],
            bytes_stored=c["bytes_stored"],
            bytes_loaded=c["bytes_loaded"],
            blocks_pinned=int(np.count_nonzero(self._index.pins)),
            in_flight=self._in_flight,
            subscribers=len(self._events),
            disk_hits=c["disk_hits"],
            promoted=0 if spill is None or spill.disk_source is None else spill.disk_source.brought,
            written_back=0 if spill is None else spill.written("disk"),
            disk=None if self._disk is None else self._disk.statistics(),
            remote_hits=c["remote_hits"],
            remote_fetched=0 if spill is None or spill.remote_source is None else spill.remote_source.brought,
            remote_written=0 if spill is None else spill.written("Mooncake"),
            remote=None if self._remote is None else self._remote.statistics(),
        )

    def events(self) -> EventSubscription:
        """A new subscription: every ``stored``, ``evicted`` and ``discarded`` event from this call on.

        Bounded: a subscriber that reads too slowly loses the oldest events,
        and the next one it reads says how many (``BlockEvent.dropped``). The
        iteration ends when the store closes, or at the subscription's
        ``aclose()``. A subscription that nobody references any more stops
        receiving and is released (see ``EventSubscription``).

        :raises TierClosedError: the store is closed.
        """
        self._check_open()
        return self._events.subscribe()

    def __repr__(self) -> str:
        return (
            f"<BlockStore [{self._life.state} | {self._index.visible}/{self._tier.slots_total} blocks | "
            f"{self.statistics().blocks_pinned} pinned | {self._in_flight} in flight]>"
        )

    # -- the in-flight count (close waits for it) ---------------------------------------

    def _enter(self) -> None:
        self._check_open()
        self._in_flight += 1
        assert self._idle is not None
        self._idle.clear()

    def _enter_quietly(self) -> None:
        """``_enter()`` for the store's own background work, which runs on after a close began."""
        self._in_flight += 1
        assert self._idle is not None
        self._idle.clear()

    def _exit(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            assert self._idle is not None
            self._idle.set()

    # -- store --------------------------------------------------------------------------

    async def store(self, keys: Sequence[object], src: Any, *, after: Any = None, wait: bool = True) -> StoreResult:
        """Store one page per key; keys already stored are not copied again.

        With a full tier, blocks that no load is reading (and that this call
        did not store) are evicted in the policy's order (least recently used
        first with ``"lru"``); when nothing more can be, the rest of the keys
        are skipped, never an error. No key after a skipped one is stored
        (keys found present may follow it): a key whose other store failed
        is retried, and a retry that finds no room takes the slots of the
        blocks this call stored after that key, latest first, rather than
        keep them behind a skipped key; such blocks are given up (evicted)
        and reported skipped.

        :param src: with a CopyEngine, device addresses or a CUDA tensor (one
            page per key), as [``CopyEngine.to_host()``][aiokvtier.CopyEngine.to_host] takes them; without
            one, a sequence of bytes-like objects or a 2-D uint8 numpy array.
        :param after: a CUDA stream or event the copy waits for on the GPU.
        :param wait: False: skip keys whose slots are not resident yet
            instead of waiting for the fill (and keys that another store is
            storing while it waits for the fill, rather than wait for it),
            and the keys after them.
        :raises ValueError: a page larger than a slot, a key twice in one
            call, pages that do not match the keys (nothing changed).
        :raises TypeError: a key that is not bytes-like or an int.
        :raises TierClosedError: the store (or its tier) is closed.
        :raises RuntimeError: called from a loop other than the store's.
        :raises CudaError: the driver refused the copy (nothing stored).
        :raises CopyPlanError: pages in a StaticHostMem or a tier (named by
            address, or an array over its memory) that is closing, or that
            closed (or shrank past them) while the call waited.

        Pages that lie in the store's own blocks keep those blocks pinned
        (never evicted for the call's room) until the call returns.
        """
        self._check_open()
        self._check_loop()
        # Whether every key is a bytes or an int is checked while the copy runs (the common case
        # costs nothing then); a list that starts with anything else is converted here.
        given = key_list(keys)
        checked = bool(given) and type(given[0]) not in (bytes, int)
        if checked:
            given = keys_of(given)  # type: ignore[assignment]
        if type(wait) is not bool:
            raise TypeError(f"wait must be a bool, not {type(wait).__name__}")
        if after is not None and self._transfers.engine is None:
            raise ValueError("after= needs a CopyEngine; this store copies host memory")
        self._index.sync_capacity()
        pages = self._transfers.pages(src, len(given), writable=False)
        self._enter()
        sources = self._sources(pages)
        self._index.pin(sources)
        try:
            try:
                return await self._store(given, pages, after, wait, checked)  # type: ignore[arg-type]
            except NotCanonical:  # nothing was stored: convert (or refuse) and start again
                return await self._store(keys_of(given), pages, after, wait, True)
        finally:
            self._index.unpin(sources)
            self._exit()

    def _sources(self, pages: Pages) -> I64:
        """The ready blocks whose slots the pages lie in (pages in the store's own tier), pinned for the call.

        Unpinned, such a block could be evicted by this call (or another) and
        its slot handed to a new block while the copy still reads it.
        """
        slots = self._blocks_under(pages)
        if not slots.size:  # the usual call: pages of the caller's own
            return NO_IDS
        ready: I64 = slots[self._index.state[slots] == READY]
        return ready

    def _blocks_under(self, pages: Pages) -> I64:
        """The slots the pages lie in that hold (or are getting) a block of the store, ascending."""
        return self._index.blocks_in(self._transfers.slots_under(pages))

    async def _store(
        self,
        keys: list[Key],
        pages: Pages,
        after: Any,
        wait: bool,
        checked: bool,
        call: _Call | None = None,
        positions: I64 | None = None,
        start: _Start | None = None,
    ) -> StoreResult:
        """Store ``keys``; ``checked``: their types were checked (else ``NotCanonical`` may come).

        ``call`` and ``positions`` (each key's position in the call): a retry
        of some of the call's keys, nested in the call's pass.
        """

        def check_types() -> None:
            nonlocal checked
            if not checked and not canonical(keys):
                raise NotCanonical
            checked = True

        index = self._index
        n = len(keys)
        top = call is None
        if call is None:
            call = _Call(n, start)
        at: Callable[[int], int] = (lambda i: i) if positions is None else positions.item
        try:
            fresh = index.slot_of.keys().isdisjoint(keys)  # new blocks only, the common case: no look-ups
            slots = NO_IDS if fresh else index.slots(keys)
        except TypeError:  # an unhashable key (a bytearray): convert
            check_types()
            raise
        outcome = np.zeros(n, dtype=np.uint8)  # _MISSING
        if fresh:
            present_slots, missing = NO_IDS, np.arange(n, dtype=np.int64)
        else:
            ready = index.ready(slots)
            outcome[ready] = _PRESENT
            present_slots = slots[ready]
            if has_repeats(present_slots):
                check_types()
                raise ValueError("a key appears twice in one store call")
            missing = np.flatnonzero(~ready)
        waiting: dict[asyncio.Future[Sequence[Key]], list[int]] = {}
        if missing.size and len(self._claims):  # a key another call is storing: wait for that call
            check_types()
            if len(set(keys)) != n:
                raise ValueError("a key appears twice in one store call")
            missing, waiting, filling = self._claims.elsewhere(keys, missing, wait)
            if filling:  # skipped (wait=False): so is every key after it
                outcome[filling] = _SKIPPED
                self._lower(call, at(filling[0]))
        # A retry's keys past a skip made meanwhile (a first pass's keys all lie below its limit unless lowered).
        if missing.size and (positions is not None or call.limit < n) and at(int(missing[-1])) >= call.limit:
            keep = int(np.searchsorted(missing if positions is None else positions[missing], call.limit))
            outcome[missing[keep:]] = _SKIPPED
            missing = missing[:keep]
        if not missing.size:
            check_types()  # no copy to hide it behind
        # The call claims its missing keys before any await: a concurrent store of one of them
        # waits for this call and learns from its result (the keys stored) what became of its key.
        claimed = keys if missing.size == n else [keys[i] for i in missing.tolist()]
        vetted = False

        def vet() -> None:
            # A key twice among the missing ones is caught by the booking (the map grows by fewer
            # keys than were booked); this earlier check runs only before a change the booking
            # cannot undo: an eviction, or a skip that would split a repeated key.
            nonlocal vetted
            check_types()
            if not vetted and len(set(claimed)) != len(claimed):
                raise ValueError("a key appears twice in one store call")
            vetted = True

        claim = self._claims.open(claimed, filling=wait)
        stored_keys: Sequence[Key] = ()
        chunks: list[I64] = []
        inserted: I64 | None = None
        landed = False
        # The call's own present blocks (its prefix) are not evicted to make room, nor dropped by a
        # shrink before the policy touched them: with a CopyEngine the touch waits for the copy to be
        # issued, and a slot past a shrunk policy's end is no slot id of it (IndexError).
        pinned = present_slots
        index.pin(pinned)

        def unpin() -> None:
            nonlocal pinned
            index.unpin(pinned)
            pinned = NO_IDS

        try:
            try:
                await self._take_slots(len(claimed), wait, chunks, vet)
            finally:
                claim.filling = False
            taken = chunks[0] if len(chunks) == 1 else np.concatenate([NO_IDS, *chunks])
            if len(taken) < len(claimed):
                vet()
                if call.own:  # blocks an earlier pass stored after these keys: their slots, rather than a skip
                    wanted = missing if positions is None else positions[missing]
                    taken = self._make_room(call, wanted, taken, chunks)
                if len(taken) < len(claimed):
                    self._lower(call, at(int(missing[len(taken)])))
            everything = len(taken) == n  # every key, in order: no subsets to take
            chosen = missing[: len(taken)]
            if len(taken) < len(missing):
                outcome[missing[len(taken) :]] = _SKIPPED
            chosen_keys = keys if everything else claimed[: len(taken)]
            chosen_pages = pages if everything else pages.take(chosen)
            published: tuple[Key, ...] = ()
            nbytes = 0

            def book() -> None:
                # Runs while the copy is in flight: nobody sees these blocks before they are ready
                # (lookups want ready, a store of the same key waits on the claim, and eviction
                # passes over blocks being stored, so the policy may know them already).
                nonlocal inserted, published, nbytes
                check_types()
                index.book(taken, chosen_keys, chosen_pages.lengths)
                if present_slots.size:  # touched first: the blocks stored by the call are the most recent
                    index.policy.accessed(present_slots)
                unpin()
                index.policy.inserted_many(taken, chosen_keys)
                inserted = taken
                published = tuple(chosen_keys)
                page = chosen_pages.page  # one length for every page (a CopyEngine's pages): no reduction
                nbytes = page * len(taken) if page else int(chosen_pages.lengths.sum())

            if chosen.size:
                queued = (
                    self._transfers.start_in(taken, chosen_pages, after)
                    if call.start is None
                    else call.start(taken, chosen_pages, chosen_keys)
                )
                await self._transfers.overlap(queued, book)
            elif present_slots.size:
                index.policy.accessed(present_slots)
                unpin()
            landed = True
            index.landed(taken)
            stored_keys = chosen_keys
            self._counts["stores"] += len(chosen_keys)
            self._counts["bytes_stored"] += nbytes
            self._events.publish("stored", published)
        finally:
            unpin()
            try:
                if not landed:  # failed or cancelled: no partial block stays, no slot is kept
                    try:
                        if inserted is not None:
                            index.forget_inserted(inserted)
                    finally:
                        index.unbook(np.concatenate([NO_IDS, *chunks]).tolist())
            finally:
                self._claims.settle(claim, stored_keys)
        retry: list[int] = []
        for future, indices in waiting.items():
            # Shielded: a cancelled waiter would cancel the claim's future itself, failing every
            # other waiter and the claiming call (whose set_result would meet a cancelled future).
            done = set(await asyncio.shield(future))
            for i in indices:
                if keys[i] in done:
                    outcome[i] = _PRESENT
                elif at(i) < call.limit:
                    retry.append(i)  # the other store failed or skipped it: try it here
                else:
                    outcome[i] = _SKIPPED  # past a key this call skipped
        counts = self._counts
        if len(stored_keys) == n:
            return StoreResult(stored=published if stored_keys is keys else tuple(keys), present=(), skipped=())
        outcome[chosen] = _STORED
        counts["present"] += int(np.count_nonzero(outcome == _PRESENT))
        counts["skipped"] += int(np.count_nonzero(outcome == _SKIPPED))
        if retry:  # counted by the inner call
            retry.sort()
            await self._retry(keys, pages, after, wait, call, positions, outcome, retry)
        if top:
            outcome[call.given_up] = _SKIPPED
        return StoreResult(
            stored=tuple(compress(keys, (outcome == _STORED).tolist())),
            present=tuple(compress(keys, (outcome == _PRESENT).tolist())),
            skipped=tuple(compress(keys, (outcome == _SKIPPED).tolist())),
        )

    async def _retry(
        self,
        keys: list[Key],
        pages: Pages,
        after: Any,
        wait: bool,
        call: _Call,
        positions: I64 | None,
        outcome: npt.NDArray[np.uint8],
        retry: list[int],
    ) -> None:
        """Store the keys whose other store failed or skipped them, in a nested pass; sets their outcome.

        The retry makes room as any store does, but not by evicting the blocks
        this call stored or found present: they stay pinned. Those the call
        stored after a retried key are its last resort (``_make_room()``).
        """
        index = self._index
        where = np.arange(len(keys), dtype=np.int64) if positions is None else positions
        stored = np.flatnonzero(outcome == _STORED)
        present = index.slots([keys[i] for i in np.flatnonzero(outcome == _PRESENT).tolist()])
        present = present[index.ready(present)]
        mine = index.slots([keys[i] for i in stored.tolist()])
        mine[~index.ready(mine)] = -1  # evicted while this call waited: nothing to pin or give up
        triples = zip(where[stored].tolist(), stored.tolist(), mine.tolist(), strict=True)
        own = [_Own(p, keys[i], s) for p, i, s in triples]
        index.pin(present)
        index.pin(mine[mine >= 0])
        call.own.extend(own)
        call.own.sort(key=lambda o: o.position)
        try:
            again = await self._store(
                [keys[i] for i in retry],
                pages.take(np.asarray(retry, dtype=np.int64)),
                after,
                wait,
                True,
                call,
                where[retry],
            )
        finally:
            index.unpin(present)
            held = [o.slot for o in own if o.slot >= 0]
            for o in own:
                o.slot = -1
            index.unpin(np.asarray(held, dtype=np.int64))
            gone = set(map(id, own))
            call.own = [o for o in call.own if id(o) not in gone]
        done_stored, done_present = set(again.stored), set(again.present)
        for i in retry:
            key = keys[i]
            outcome[i] = _STORED if key in done_stored else _PRESENT if key in done_present else _SKIPPED

    def _lower(self, call: _Call, limit: int) -> None:
        """Nothing at or past ``limit`` is stored by the call: blocks it stored past it are given up."""
        if limit >= call.limit:
            return
        call.limit = limit
        past = [o for o in call.own if o.position > limit]
        if past:
            self._give_up(call, past, None)

    def _make_room(self, call: _Call, wanted: I64, taken: I64, chunks: list[I64]) -> I64:
        """A pass got ``taken`` slots, fewer than the keys at positions ``wanted`` (ascending) need.

        Rather than skip a key and keep blocks the call stored after it, take
        the slots of those blocks, latest first: the call keeps the longest
        prefix it can. A block a load is reading cannot give its slot now;
        past the first key skipped it is given up all the same. Returns the
        slots for the leading keys of ``wanted`` (``chunks`` says the same).
        """
        own = [o for o in call.own if o.position > int(wanted[0])]
        if not own:
            return taken
        state, pins = self._index.state, self._index.pins
        at = np.asarray([o.position for o in own], dtype=np.int64)
        free = np.asarray([o.slot >= 0 and state[o.slot] == READY and pins[o.slot] == 1 for o in own])
        tail = np.concatenate([np.cumsum(free[::-1])[::-1], [0]])  # slots to be had from own[j:]
        m, got = len(wanted), len(taken)
        s = min(m, got + int(tail[0]))
        while True:  # the most keys whose slots the blocks after them can give (s == got always can)
            start = int(np.searchsorted(at, wanted[s - 1], side="right")) if s else 0
            if got + int(tail[start]) >= s:
                break
            s -= 1
        # Given up: every block past the first key skipped, then, latest first, as many as needed.
        first = int(np.searchsorted(at, wanted[s], side="right")) if s < m else len(own)
        while first > start and got + int(tail[first]) < s:
            first -= 1
        reused: list[int] = []
        try:
            self._give_up(call, own[first:], reused)
        finally:
            if reused:
                chunks.append(np.asarray(reused, dtype=np.int64))
        if first < len(own):  # what was given up is skipped: nothing after it is stored
            self._lower(call, own[first].position)
        taken = np.concatenate([NO_IDS, *chunks])
        if len(taken) > s:  # more than the leading keys need: back to the tier
            spare, taken = taken[s:], taken[:s]
            chunks[:] = [taken]
            self._index.give_back(spare.tolist())
        return taken

    def _give_up(self, call: _Call, own: list[_Own], reused: list[int] | None) -> None:
        """Drop blocks the call stored (reported skipped); a slot only the call pins goes to ``reused``.

        A block a load is reading disappears at once and its slot is given
        back when the load is done, as with a discard.
        """
        index = self._index
        keys: list[Key] = []
        doomed: list[int] = []
        done: set[int] = set()
        try:
            for o in own:
                slot = o.slot
                if slot >= 0 and index.state[slot] == READY:  # pinned by the call: still its block
                    freed = index.give_up(slot, o.key, reused is not None)
                    keys.append(o.key)
                    if freed and reused is not None:
                        reused.append(slot)
                        slot = o.slot = -1
                if slot >= 0:  # unpinned below: freed now, or when the load reading it is done
                    doomed.append(slot)
                    o.slot = -1
                call.given_up.append(o.position)
                done.add(id(o))
        finally:
            call.own = [o for o in call.own if id(o) not in done]
            index.unpin(np.asarray(doomed, dtype=np.int64))
            if keys:
                self._evicted(keys)  # their hit counts (and what the Mooncake lane sent) go too
            self._counts["skipped"] += len(done)

    async def _take_slots(self, n: int, wait: bool, taken: list[I64], vet: Callable[[], None]) -> None:
        """Take up to ``n`` slots into ``taken`` (arrays of ids), evicting as needed; fewer when no more can be had.

        ``vet`` runs before the first eviction (a check that must come before any change).
        """
        tier = self._tier
        got = 0
        failed = False  # the fill failed: only slots already resident (or freed) can be had
        while got < n:
            need = n - got
            free = tier.slots_ready if failed else tier.slots_free
            if free < need:
                vet()
                self._index.evict(need - free)
                free = tier.slots_ready if failed else tier.slots_free
            want = min(need, free)
            if want == 0:
                return
            if not wait:
                ids: list[int] = []
                now_failed = False
                try:
                    for _ in range(want):
                        ids.append(tier.allocate_nowait())
                except (WouldBlock, OutOfSlots):
                    pass
                except Exception as exc:  # FillError: only resident slots can be had from now on
                    now_failed = not failed
                    if now_failed:
                        self._fill_failed(exc)
                        failed = True
                finally:
                    taken.append(np.asarray(ids, dtype=np.int64))
                    self._index.sync_capacity()  # the tier may have grown since the call began (a retry)
                got += len(ids)
                if len(ids) < want and not now_failed:
                    return
                continue
            try:
                chunk = await tier.allocate_ids(want)
            except OutOfSlots:
                continue  # another task took them while this one waited for the fill
            except TierClosedError:
                raise
            except Exception as exc:  # FillError: only resident slots can be had from now on
                if failed:
                    return
                self._fill_failed(exc)
                failed = True
                continue
            taken.append(chunk)
            # The tier may have grown while this call waited. Outside the try: a policy that cannot
            # follow fails the call (which gives the chunk back), it is no fill failure to skip.
            self._index.sync_capacity()
            got += len(chunk)

    def _fill_failed(self, exc: BaseException) -> None:
        """Say once per fill failure (not per call) that stores now recycle resident slots only."""
        error = str(exc)
        if error != self._fill_failure_logged:
            self._fill_failure_logged = error
            log.warning("aiokvtier: the tier's fill failed; the store evicts into resident slots only: %s", exc)

    # -- load ---------------------------------------------------------------------------

    async def load(self, keys: Sequence[object], dst: Any, *, after: Any = None) -> None:
        """Copy each key's block into ``dst`` (one page per key); the blocks stay stored.

        Blocks are pinned while they are read: never evicted under a load. A
        block copies the length it was stored with.

        :raises BlockNotFound: a key is not stored (the first missing one is
            named); nothing is copied. With a disk or Mooncake tier, blocks in
            the host tier are copied while the others come back from below (a
            key the disk tier does not hold is asked of the Mooncake tier, unless
            it is unavailable; the disk tier's come back, into host memory, in
            pieces of a few MiB, each copied out as soon as it landed): a block that does not come back intact (or, from
            the Mooncake tier, at all) raises this once the others landed; the
            blocks that did come back stay in the host tier.
        :raises ValueError: a destination page shorter than its block (for a
            block from the Mooncake tier, known once it arrived), a
            read-only destination, pages that do not match the keys, two
            destination pages that overlap, a destination page in a block of
            this store (its own tier's slots).
        :raises TypeError: a key that is not bytes-like or an int.
        :raises TierClosedError: the store is closed.
        :raises RuntimeError: called from a loop other than the store's.
        :raises CopyPlanError: pages in a StaticHostMem or another tier (named
            by address, or an array over its memory) that is closing, or that
            closed (or shrank past them) while the call waited.
        """
        self._check_open()
        self._check_loop()
        index, transfers = self._index, self._transfers
        keys = key_seq(keys)
        slots = index.slots_of_all(keys)
        if slots is not None and not np.count_nonzero(index.state[slots] != READY):
            pages = transfers.pages(dst, len(keys), writable=True)
            await self._begin_load(keys, slots, pages, after)
            return
        ready = index.ready(index.slots(keys) if slots is None else slots)
        absent = np.flatnonzero(~ready)
        spill = self._spill
        if spill is None:
            raise BlockNotFound(keys[int(absent[0])])
        # The blocks in the host tier are copied out while the rest come back from below, in one
        # batch per tier: the disk tier's, then the Mooncake tier's.
        below: dict[Source, list[int]] = {}
        for i in absent.tolist():
            below.setdefault(spill.source_of(keys[i]), []).append(i)
        pages = transfers.pages(dst, len(keys), writable=True)
        # Checked before the blocks in the host tier are copied and the rest brought back (each copy
        # checks again, after its blocks were read from below).
        if after is not None and transfers.engine is None:
            raise ValueError("after= needs a CopyEngine; this store copies host memory")
        self._refuse_own(pages)
        present = np.flatnonzero(ready)
        batches = [(source, np.asarray(ids, dtype=np.int64)) for source, ids in below.items()]
        for source, ids in batches:
            lengths = np.asarray(source.lengths([keys[i] for i in ids.tolist()]), dtype=np.uint64)
            if source is spill.disk_source:  # a Mooncake block's length is known once it arrived
                self._check_lengths(keys, ids, pages.lengths[ids], lengths)
        # In flight from the first promotion to the end of every copy: a close that begins meanwhile waits
        # for all of it (the copies' own entries would find the store closing).
        self._enter()
        try:
            held = None
            if present.size:
                here = [keys[i] for i in present.tolist()]
                held = self._begin_load(here, slots_of(index, keys, present), pages.take(present), after, inside=True)
            try:
                # Every tier's batch runs, a miss in one or not: the first key missing is named, and the
                # blocks of the other tiers land (a failed batch ended the load before the next one ran).
                misses: list[tuple[int, BlockNotFound]] = []
                for source, ids in batches:
                    batch = [keys[i] for i in ids.tolist()]
                    try:
                        await self._load_from(source, batch, pages.take(ids), after)
                    except BlockNotFound as miss:
                        at = batch.index(miss.key) if miss.key in batch else len(batch) - 1
                        misses.append((int(ids[at]), miss))
                if misses:
                    raise min(misses, key=lambda m: m[0])[1]
            finally:
                if held is not None:
                    await finish(held)
        finally:
            self._exit()

    async def _load_from(self, source: Source, keys: list[Key], pages: Pages, after: Any) -> None:
        """Bring ``keys`` back from a lower tier into host slots and copy them into ``pages``: into host
        memory in pieces of ``source.piece`` bytes, all asked for at once, each copied out as soon as it
        landed; into GPU memory in one go.

        Every piece runs to its end (a miss in one does not stop the others); the first failure in the
        keys' order is raised then. Cancelled: the pieces not begun are not begun, and the cancellation
        comes once the others let go of their slots and of ``pages``.
        """
        distinct = list(dict.fromkeys(keys))
        engine = self._transfers.engine
        # Into GPU memory the copy after the last read is the DMA's ~1 ms, and each piece's loop work
        # slowed the reads beside it more than that: one go measured faster on the H200 (docs/benchmarks.md).
        size = source.piece if engine is None or engine.device is None else 0
        per = max(1, size // self._tier.slot_size) if size else len(distinct)
        if len(distinct) <= per:
            await self._bring(source, keys, pages, after)
            return
        # A key given twice goes with its first place's piece: two pieces never promote the same key.
        rank = {key: i // per for i, key in enumerate(distinct)}
        piece = np.fromiter(map(rank.__getitem__, keys), dtype=np.int64, count=len(keys))
        order = np.argsort(piece, kind="stable")
        tasks: list[asyncio.Future[None]] = []
        try:
            for ids in np.split(order, np.cumsum(np.bincount(piece))[:-1]):
                tasks.append(
                    asyncio.ensure_future(self._bring(source, [keys[i] for i in ids.tolist()], pages.take(ids), after))
                )
                # A turn of the loop per piece: its read is under way before the next piece is booked.
                await asyncio.sleep(0)
            await asyncio.wait(tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            try:
                if tasks:  # none when the first piece could not be made: its error is the one to see
                    await finish(asyncio.wait(tasks))
            finally:
                _outcomes(tasks)  # taken, though the load ends otherwise: the loop would log them as lost
            raise
        for task, error in zip(tasks, _outcomes(tasks), strict=True):  # the first failure in the keys' order
            if task.cancelled():
                # Cancelled from within (this load was not): its pages were not written, so the load
                # ends as the piece did, as a load in one go would.
                raise asyncio.CancelledError("a piece of the load was cancelled")
            if error is not None:
                raise error

    async def _bring(self, source: Source, keys: list[Key], pages: Pages, after: Any) -> None:
        """Bring ``keys`` back from a lower tier into host slots, then copy them into ``pages``."""
        index = self._index
        for _ in range(3):  # promoted blocks may be evicted by concurrent stores before the copy starts
            await self._promote(source, list(dict.fromkeys(keys)))
            slots = index.slots_of_all(keys)
            if slots is not None and (index.state[slots] == READY).all():
                await self._begin_load(keys, slots, pages, after, inside=True)
                return
        absent = np.flatnonzero(~index.ready(index.slots(keys)))
        raise BlockNotFound(keys[int(absent[0])])

    @staticmethod
    def _check_lengths(keys: Sequence[Key], ids: I64 | None, pages: U64, lengths: U64) -> None:
        """:raises ValueError: a page shorter than its block (``ids``: the keys' positions; None: in order)."""
        short_of = pages < lengths
        if not np.count_nonzero(short_of):  # the usual call: one C call, no index array
            return
        short = int(np.flatnonzero(short_of)[0])
        at = short if ids is None else int(ids[short])
        raise ValueError(
            f"destination page {at} has {int(pages[short])} bytes, block "
            f"{key_text(keys[at])} has {int(lengths[short])}; nothing was copied"
        )

    def _begin_load(
        self, keys: Sequence[Key], slots: I64, pages: Pages, after: Any, *, inside: bool = False
    ) -> Coroutine[Any, Any, None]:
        """Check the ready blocks at ``slots`` against ``pages``, pin them and queue their copy (before any
        await); returns what waits for the copy, unpins and counts. ``inside``: part of a load already
        in flight (a close that began since waits for it, rather than refuse the copy).

        :raises ValueError: a page shorter than its block, ``after=`` without an engine, a page in a block.
        """
        index, transfers = self._index, self._transfers
        lengths = index.length[slots]  # a copy: the map may grow later
        self._check_lengths(keys, None, pages.lengths, lengths)
        if after is not None and transfers.engine is None:
            raise ValueError("after= needs a CopyEngine; this store copies host memory")
        if slots.size:
            self._refuse_own(pages)
        self._enter_quietly() if inside else self._enter()
        index.pin(slots)
        try:
            started = transfers.start_out(slots, pages, lengths, after) if slots.size else None
        except BaseException:
            index.unpin(slots)
            self._exit()
            raise
        return self._end_load(keys, slots, lengths, started)

    def _refuse_own(self, pages: Pages) -> None:
        """:raises ValueError: a page lies in a block of this store (the load would overwrite it)."""
        under = self._blocks_under(pages)
        if under.size:
            raise ValueError(
                f"a destination page lies in slot {int(under[0])}, a block of this store; nothing was copied"
            )

    async def _end_load(self, keys: Sequence[Key], slots: I64, lengths: U64, started: Started | None) -> None:
        index = self._index
        nbytes = 0

        def touch() -> None:  # while the copy runs
            nonlocal nbytes
            index.policy.accessed(slots)
            nbytes = int(lengths.sum())

        try:
            if started is not None:
                await self._transfers.overlap(started, touch)
        finally:
            index.unpin(slots)
            self._exit()
        self._counts["loads"] += len(slots)
        self._counts["bytes_loaded"] += nbytes
        if self._spill is not None:
            self._spill.loaded(keys)

    async def _promote(self, source: Source, keys: list[Key]) -> None:
        """Store ``keys`` (absent from the host tier) from a lower tier into host slots.

        :raises BlockNotFound: a key the tier does not hold, or whose block it could not give back
            (a read error, a failed checksum, gone meanwhile), or found no room in the host tier.
        """
        index = self._index
        lengths = source.lengths(keys)
        from_below = Pages(np.zeros(len(keys), dtype=np.uint64), np.asarray(lengths, dtype=np.uint64), [])
        surplus = 0  # bytes booked past what arrived, counted as stored when the blocks were booked
        # A discard while the blocks are read drops them below, but the read goes on and would land
        # them in the host tier after the discard returned (and the load's hit would write them back).
        promotion = _Promotion(keys)

        def start(slots: I64, pages: Pages, chosen: Sequence[Key]) -> Started:
            async def read() -> None:
                nonlocal surplus
                sizes = await source.fill(chosen, slots, pages.lengths.tolist())
                if promotion.unwanted:  # discarded while read: a miss
                    sizes = [0 if key in promotion.unwanted else n for key, n in zip(chosen, sizes, strict=True)]
                index.length[slots] = sizes  # booked before (a Mooncake block's size is known only now)
                if not all(sizes):
                    raise _LowerMiss(chosen[sizes.index(0)])
                surplus += int(pages.lengths.sum()) - sum(sizes)

            return (None, asyncio.ensure_future(read()))

        self._promotions.append(promotion)
        try:  # the caller (a load) is in flight meanwhile
            result = await self._store(keys, from_below, None, True, True, start=start)
        except _LowerMiss as miss:
            raise BlockNotFound(miss.key) from None
        finally:
            self._promotions.remove(promotion)
        self._counts["bytes_stored"] -= surplus
        source.brought += len(result.stored)
        # Discarded after their read ended, before they were ready (the discard passed them over).
        late = [key for key in result.stored if key in promotion.unwanted]
        if late:
            self._drop(late)
            raise BlockNotFound(late[0])
        if result.skipped:
            raise BlockNotFound(result.skipped[0])

    # -- discard and resize ---------------------------------------------------------------

    def discard(self, keys: Iterable[object]) -> int:
        """Drop blocks; unknown keys (and keys still being stored) are ignored. Returns how many were dropped.

        A block a load is reading disappears at once and its slot is given
        back when the load is done. A block a load is bringing back from a
        lower tier does not land: that load raises ``BlockNotFound`` for it
        once its other blocks landed. The keys are dropped from the disk tier
        too, and from the Mooncake tier in the background (the store's close
        waits for that; Mooncake keeps a block under its lease, about 10 s
        after any client's put, get or lookup of it, and offline it drops nothing).

        :raises TypeError: a key that is not bytes-like or an int.
        """
        self._check_open()
        keys = key_seq(keys)
        for promotion in self._promotions:  # being brought back from below: they must not land now
            promotion.unwanted.update(promotion.keys.intersection(keys))
        return self._drop(keys)

    def _drop(self, keys: Sequence[Key]) -> int:
        """``discard()`` of checked keys (also while the store closes: a load in flight drops its own)."""
        slots = self._index.slots(keys)
        hit = np.flatnonzero(self._index.ready(slots))
        if len(hit) < len(keys) or has_repeats(slots[hit]):  # a key given twice is dropped once
            hit = hit[np.unique(slots[hit], return_index=True)[1]]
            hit.sort()
        dropped = keys if len(hit) == len(keys) else [keys[i] for i in hit.tolist()]
        if self._spill is not None:
            self._spill.discard(keys)  # a discarded block is wrong or unwanted everywhere
        if not dropped:
            return 0
        self._index.discard(slots[hit], dropped)
        self._counts["discards"] += len(dropped)
        self._events.publish("discarded", tuple(dropped))
        return len(dropped)

    async def resize(self, new_quota: int | str) -> None:
        """Resize the tier; a shrink first evicts the blocks that lie past the new end.

        :raises QuotaError: the quota is invalid, or a block past the new end
            is being stored or loaded (nothing changed).
        :raises TierClosedError: the store is closed.
        :raises RuntimeError: called from a loop other than the store's.

        A shrink is refused before anything is evicted when a slot past the
        new end is held by something other than a stored block (another
        user's slot, a store's slot not booked yet). A shrink that meets a
        resize of the tier made directly (``tier.resize``) evicts, then waits
        for it; if the tier then refuses (a slot past the new end was taken
        meanwhile), the blocks evicted stay evicted. Cancellation: as
        [``HostTier.resize()``][aiokvtier.HostTier.resize]; blocks evicted for a shrink stay evicted,
        and the store follows whatever size the tier ends with.
        """
        self._check_open()
        self._check_loop()
        tier = self._tier
        async with self._resize_lock:
            self._check_open()
            # A tier grown behind the store's back: the slots past the new end checked below
            # (another user's among them) index the maps.
            index = self._index
            index.sync_capacity()
            cfg = tier.config.resolved
            quota = parse_quota(new_quota, slot_size=cfg.slot_size, max_quota=cfg.max_quota)
            total = quota // tier.slot_size
            if total < tier.slots_total:
                busy = index.busy_past(total)
                if busy.size:
                    raise QuotaError(
                        f"cannot shrink to {quota} bytes: the block in slot {int(busy[0])} is being stored or loaded"
                    )
                # Slots past the end that are not this store's blocks (another user's, a view, a store's
                # slots not booked yet): the tier would refuse, so refuse before evicting anything.
                held = tier.slots_held_past(total)
                foreign = index.not_ready(held)
                if foreign.size:
                    raise QuotaError(
                        f"cannot shrink to {quota} bytes: slot {int(foreign[0])} past the new end is held "
                        "by something other than a stored block (nothing was evicted)"
                    )
                index.drop_past(total)
            try:
                await tier.resize(quota)
            finally:  # also when cancelled: the tier may have grown all the same
                index.follow_tier()

    def _evicted(self, keys: list[Key]) -> None:
        """Blocks the index evicted (their slots back to the tier): counted and published."""
        self._counts["evictions"] += len(keys)
        if self._spill is not None:
            self._spill.forget(keys)
        self._events.publish("evicted", tuple(keys))


def _outcomes(tasks: list[asyncio.Future[None]]) -> list[BaseException | None]:
    """Each finished piece's error (None: it landed, or was cancelled), every one taken: a failed task
    whose error nobody took is logged by the loop as an error when it is collected."""
    return [None if not task.done() or task.cancelled() else task.exception() for task in tasks]


def slots_of(index: BlockIndex, keys: Sequence[Key], ids: I64) -> I64:
    """The slots of the ready blocks of ``keys`` at positions ``ids``."""
    slots: I64 = index.slots([keys[i] for i in ids.tolist()])
    return slots
