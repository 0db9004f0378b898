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
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import operator
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .._config import parse_quota
from .._copy._requests import Pages, buffer_addresses, registrations
from .._errors import BlockNotFound, OutOfSlots, QuotaError, TierClosedError, WouldBlock
from .._lifecycle import Lifecycle, Owner, finish
from ._events import EventHub, EventSubscription
from ._policy import EvictionPolicy, has_repeats, make_policy

if TYPE_CHECKING:
    from .._copy._engine import CopyEngine
    from .._host._tier import HostTier

__all__ = ["BlockStore", "StoreResult", "StoreStatistics"]

log = logging.getLogger("aiokvtier")

Key = bytes | int
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
_FREE, _STORING, _READY, _DOOMED = 0, 1, 2, 3
_MISSING, _STORED, _PRESENT, _SKIPPED = 0, 1, 2, 3  # a key's outcome in one store call
_NO_IDS = np.empty(0, dtype=np.int64)
_ONE = np.uint32(1)  # the pin counts' own type: ufunc.at with a Python int takes a path 25x slower


@dataclass(frozen=True, slots=True)
class StoreResult:
    """What [``BlockStore.store()``][aiokvtier.BlockStore.store] did with each key, in the caller's order."""

    stored: tuple[Key, ...]
    """Newly stored (copied)."""
    present: tuple[Key, ...]
    """Already stored, or stored meanwhile by a concurrent call that this one waited for: not copied again."""
    skipped: tuple[Key, ...]
    """Not stored: no room even after eviction, or, with ``wait=False``, no resident slot (or a key that another
    store, waiting for the fill, is storing). No key after the first skipped one is in ``stored``: every key
    before it was stored or present, and from it on the call stored nothing (keys found present may follow)."""


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """A snapshot of a [``BlockStore``][aiokvtier.BlockStore]."""

    policy: str
    blocks: int
    """Visible blocks."""
    capacity: int
    """The tier's slot count."""
    queries: int
    """``lookup`` calls."""
    hits: int
    """Keys matched by ``lookup`` (the stored prefix)."""
    misses: int
    """Keys asked of ``lookup`` beyond the stored prefix."""
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


def _key(key: object) -> Key:
    """``bytes`` or ``int``: bytes-like objects become bytes, numpy integers ints; bools are refused."""
    kind = type(key)
    if kind is bytes or kind is int:
        return key  # type: ignore[return-value]
    if kind is bool or isinstance(key, bool | np.bool_):
        raise TypeError(f"a key is bytes or an int, not a bool ({key!r})")
    if isinstance(key, bytes | bytearray | memoryview):
        return bytes(key)
    if isinstance(key, str | float):
        raise TypeError(f"a key is bytes or an int, not {kind.__name__} ({key!r})")
    try:
        return operator.index(key)  # type: ignore[arg-type]
    except TypeError:
        pass
    try:
        return bytes(memoryview(key))  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"a key is bytes or an int, not {kind.__name__}") from None


def _keys(keys: Iterable[object]) -> list[Key]:
    """The caller's keys as a new list of bytes and ints (converted where they are bytes-like or integers)."""
    given = _key_list(keys)
    if _canonical(given):
        return given  # type: ignore[return-value]
    return [_key(k) for k in given]


def _key_seq(keys: Iterable[object]) -> Sequence[Key]:
    """The caller's list or tuple itself when every key is a bytes or an int: for a call that does not keep
    its keys across an await (lookup, load, discard); else as ``_keys()``."""
    if type(keys) is list or type(keys) is tuple:
        if _canonical(keys):
            return keys
        return [_key(k) for k in keys]
    return _keys(keys)


def _key_list(keys: Iterable[object]) -> list[object]:
    if isinstance(keys, bytes | bytearray | memoryview | str | int):
        raise TypeError(f"keys must be a sequence of keys, not one {type(keys).__name__}")
    return list(keys)  # a copy: the call keeps it across awaits, whatever the caller does to theirs


def _canonical(keys: Sequence[object]) -> bool:
    """Every key is a bytes or an int already (one pass in C)."""
    if keys and type(keys[0]) in (bytes, int) and operator.countOf(map(type, keys), type(keys[0])) == len(keys):
        return True  # one kind of key, the usual case: a fifth cheaper than the set of types
    return set(map(type, keys)) <= {bytes, int}


class _NotCanonical(Exception):
    """A store found a key that is not a bytes or an int only after it had started: convert and start again."""


class _Pages(NamedTuple):
    """The caller's pages: one address and length per key, and the objects that own the memory."""

    addresses: U64
    lengths: U64
    owners: list[Any]
    page: int = 0
    """The one length of every page (a CopyEngine's pages, checked by ``buffer_addresses``); 0: host pages."""
    regions: tuple[Any, ...] = ()
    """Where a CopyEngine's page addresses lie (a StaticHostMem, a tier): owners the copy must outlive."""

    def take(self, ids: I64) -> _Pages:
        return _Pages(self.addresses[ids], self.lengths[ids], self.owners, self.page, self.regions)

    def side(self, page: int) -> Pages:
        """For ``CopyEngine.start()``: the addresses were checked when the call began (as a
        destination for a load, the one direction that writes them)."""
        return Pages(self.addresses, page, self.regions, self.owners)


_Started = tuple["asyncio.Future[None] | None", "asyncio.Future[None]"]
"""A queued copy: ``submitted`` (None: nothing to wait for) settles once it was issued, ``done`` once it landed."""


class _Claim:
    """The keys one store call is storing, and the future its waiters learn the stored keys from."""

    __slots__ = ("_keys", "_set", "filling", "future")

    def __init__(self, keys: list[Key], filling: bool) -> None:
        self._keys = keys
        self._set: set[Key] | None = None
        self.future: asyncio.Future[Sequence[Key]] = asyncio.get_running_loop().create_future()
        self.filling = filling
        """The call may be waiting for the fill (``wait=True``, taking slots): ``wait=False`` calls skip its keys."""

    @property
    def keys(self) -> set[Key]:
        """As a set, made when a concurrent call first asks (most calls have none)."""
        if self._set is None:
            self._set = set(self._keys)
        return self._set


class _Own:
    """A block one store call stored, kept pinned by the call while it retries other keys."""

    __slots__ = ("key", "position", "slot")

    def __init__(self, position: int, key: Key, slot: int) -> None:
        self.position = position
        """In the call's keys."""
        self.key = key
        self.slot = slot
        """Pinned by the call; -1 once unpinned or given up (or when the block was gone before the pin)."""


class _Call:
    """One store call across its retries (each retry is a nested pass over some of its keys).

    The contract it keeps: no key past a skipped one is stored. ``limit`` is
    the position of the first key skipped so far; a pass stores no key at or
    past it, and a block the call stored past it is given up again.
    """

    __slots__ = ("given_up", "limit", "own")

    def __init__(self, n: int) -> None:
        self.limit = n
        self.own: list[_Own] = []
        """Blocks stored by earlier passes, pinned while later passes run."""
        self.given_up: list[int] = []
        """Positions of blocks the call stored and gave up again: reported skipped."""


def _host_pages(obj: Any, n: int, *, writable: bool) -> _Pages:
    """Pages in host memory: a 2-D uint8 array, or a sequence of bytes-like objects."""
    if isinstance(obj, np.ndarray):
        if obj.ndim != 2 or obj.dtype != np.uint8:
            raise ValueError(f"a numpy page array must be 2-D uint8, got {obj.ndim}-D {obj.dtype}")
        if obj.shape[0] != n:
            raise ValueError(f"expected one page per key ({n}), got {obj.shape[0]} rows")
        if not obj.flags.c_contiguous:
            raise ValueError("the page array must be C-contiguous")
        if writable and not obj.flags.writeable:
            raise ValueError("the destination array is read-only; nothing was copied")
        page = obj.shape[1]
        addresses = np.uint64(obj.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(page)
        return _Pages(addresses, np.full(n, page, dtype=np.uint64), [obj])
    if isinstance(obj, bytes | bytearray | memoryview | str):
        raise TypeError("pages are a sequence of bytes-like objects (one per key) or a 2-D uint8 array")
    try:
        items = list(obj)
    except TypeError:
        raise TypeError(
            "without a CopyEngine, pages are a sequence of bytes-like objects or a 2-D uint8 numpy array"
        ) from None
    if len(items) != n:
        raise ValueError(f"expected one page per key ({n}), got {len(items)}")
    views = []
    for item in items:
        try:
            view = memoryview(item)
        except TypeError:
            raise TypeError(f"a page must be bytes-like, not {type(item).__name__}") from None
        if not view.c_contiguous:
            raise ValueError("a page must be contiguous")
        if writable and view.readonly:
            raise ValueError(f"destination page of {type(item).__name__} is read-only; nothing was copied")
        views.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
    arrays = [np.frombuffer(v, dtype=np.uint8) for v in views]
    addresses = np.fromiter((a.ctypes.data if a.size else 0 for a in arrays), dtype=np.uint64, count=n)
    lengths = np.fromiter((a.size for a in arrays), dtype=np.uint64, count=n)
    return _Pages(addresses, lengths, [*views, *arrays])


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
    """

    def __init__(
        self,
        tier: HostTier,
        engine: CopyEngine | None = None,
        policy: str | EvictionPolicy = "lru",
        *,
        event_limit: int = 1024,
    ) -> None:
        if not isinstance(policy, str | EvictionPolicy):
            raise TypeError(f"policy is a name or an EvictionPolicy, not {type(policy).__name__}")
        if type(event_limit) is not int or event_limit < 1:
            raise ValueError(f"event_limit must be a positive int, got {event_limit!r}")
        self._tier = tier
        self._engine_given = engine
        # A host-to-host engine adds nothing over the store's own memmove: host pages either way.
        self._engine = engine if engine is not None and engine.device is not None else None
        self._policy_arg = policy
        self._life = Lifecycle("BlockStore", "aiokvtier-store")
        self._events = EventHub(event_limit)
        # Per slot: the key (object), state, length and pin count, as numpy arrays so that a
        # call's bookkeeping is a few array operations rather than a Python step per key.
        self._slot_of: dict[Key, int] = {}
        self._key_of: npt.NDArray[np.object_] = np.empty(0, dtype=object)
        self._state: npt.NDArray[np.uint8] = np.empty(0, dtype=np.uint8)
        self._length: U64 = np.empty(0, dtype=np.uint64)
        self._pins: npt.NDArray[np.uint32] = np.empty(0, dtype=np.uint32)
        self._claims: set[_Claim] = set()
        self._capacity = 0
        """Slots the policy and the maps are sized for."""
        self._fill_failure_logged: str | None = None  # the fill failure last warned of
        self._visible = 0
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
    ) -> BlockStore:
        """Open a store over an open tier.

        :raises TierClosedError: the tier (or the engine) is not open.
        :raises ValueError: an unknown policy name.
        """
        store = cls(tier, engine, policy, event_limit=event_limit)
        await store.__aenter__()
        return store

    async def _build(self) -> None:
        self._tier.check_open()
        if self._engine_given is not None:
            self._engine_given.check_open()
        capacity = self._tier.slots_total
        self._policy = make_policy(self._policy_arg, capacity)
        self._capacity = capacity
        self._grow_maps(capacity)
        self._idle = asyncio.Event()
        self._idle.set()

    async def _teardown(self) -> None:
        if self._idle is not None:
            await self._idle.wait()  # stores and loads in flight finish first
        self._events.close()
        slots = [*self._slot_of.values(), *np.flatnonzero(self._state == _DOOMED).tolist()]
        self._slot_of.clear()
        self._visible = 0
        if slots and not self._tier.closed:
            self._tier.free_many(slots)  # the blocks go with the store; the tier stays the owner's
        await self._life.run_undo()

    async def aclose(self) -> None:
        """Wait for stores and loads in flight, give every block's slot back to the tier, end the event streams.

        Idempotent; the tier and the engine stay open. Cancelling it does not
        interrupt the teardown.
        """
        await self._life.close(self._teardown)

    def _sync_capacity(self) -> None:
        """Follow a tier that was grown behind the store's back (slot ids index the maps)."""
        if self._tier.slots_total > self._capacity:
            self._follow_tier()

    def _follow_tier(self) -> None:
        """Size the maps and the policy to the tier's slot count (after a resize, whatever its outcome)."""
        capacity = self._tier.slots_total
        self._grow_maps(capacity)  # the maps only grow: slots past a shrink stay free in them
        if capacity != self._capacity:
            self._policy.resize(capacity)
            self._capacity = capacity

    def _grow_maps(self, capacity: int) -> None:
        extra = capacity - len(self._state)
        if extra > 0:
            self._key_of = np.concatenate([self._key_of, np.full(extra, None, dtype=object)])
            self._state = np.concatenate([self._state, np.zeros(extra, dtype=np.uint8)])
            self._length = np.concatenate([self._length, np.zeros(extra, dtype=np.uint64)])
            self._pins = np.concatenate([self._pins, np.zeros(extra, dtype=np.uint32)])

    def _slots(self, keys: Sequence[Key]) -> I64:
        """Each key's slot, -1 for a key without one (one pass over the dict, in C)."""
        return np.fromiter(map(self._slot_of.get, keys, repeat(-1)), dtype=np.int64, count=len(keys))

    def _slots_of_all(self, keys: Sequence[Key]) -> I64 | None:
        """Each key's slot, or None when a key has none: a load's keys, all known unless it fails."""
        n = len(keys)
        if n < 2:  # itemgetter of one key returns the value itself
            slots = self._slots(keys)
            return None if (slots < 0).any() else slots
        try:
            found = operator.itemgetter(*keys)(self._slot_of)  # a third cheaper than map(get) at 4,096 keys
        except KeyError:
            return None
        return np.fromiter(found, dtype=np.int64, count=n)

    def _ready(self, slots: I64) -> npt.NDArray[np.bool_]:
        """Which of ``slots`` (from ``_slots()``) hold a ready block."""
        known = slots >= 0
        if known.all():
            ready: npt.NDArray[np.bool_] = self._state[slots] == _READY
            return ready
        ready = np.zeros(len(slots), dtype=np.bool_)
        ready[known] = self._state[slots[known]] == _READY
        return ready

    # -- queries ------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._visible

    def __contains__(self, key: object) -> bool:
        try:
            slot = self._slot_of.get(_key(key), -1)
        except TypeError:
            return False
        return slot >= 0 and self._state[slot] == _READY

    def length(self, key: object) -> int:
        """Bytes the block of ``key`` holds (what ``load`` copies). Does not touch it.

        :raises BlockNotFound: the key is not stored.
        :raises TypeError: a key that is not bytes-like or an int.
        """
        key = _key(key)
        slot = self._slot_of.get(key, -1)
        if slot < 0 or self._state[slot] != _READY:
            raise BlockNotFound(key)
        return int(self._length[slot])

    def lookup(self, keys: Sequence[object]) -> int:
        """How many leading keys are stored (a prefix hit); touches them. Never blocks.

        :raises TypeError: a key is not bytes-like or an int (a bool, a str).
        :raises TierClosedError: the store is closed.
        """
        self._check_open()
        keys = _key_seq(keys)
        slots = self._slots(keys)
        misses = np.flatnonzero(~self._ready(slots))
        hits = int(misses[0]) if misses.size else len(keys)
        if hits:
            self._policy.accessed(slots[:hits])
        counts = self._counts
        counts["queries"] += 1
        counts["hits"] += hits
        counts["misses"] += len(keys) - hits
        return hits

    def statistics(self) -> StoreStatistics:
        c = self._counts
        return StoreStatistics(
            policy=self._policy_arg if isinstance(self._policy_arg, str) else self._policy_arg.name,
            blocks=self._visible,
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
            blocks_pinned=int(np.count_nonzero(self._pins)),
            in_flight=self._in_flight,
            subscribers=len(self._events),
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
            f"<BlockStore [{self._life.state} | {self._visible}/{self._tier.slots_total} blocks | "
            f"{self.statistics().blocks_pinned} pinned | {self._in_flight} in flight]>"
        )

    # -- the in-flight count (close waits for it) ---------------------------------------

    def _enter(self) -> None:
        self._check_open()
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
        :raises CudaError: the driver refused the copy (nothing stored).
        :raises CopyPlanError: pages in a StaticHostMem or a tier (named by
            address, or an array over its memory) that is closing, or that
            closed (or shrank past them) while the call waited.

        Pages that lie in the store's own blocks keep those blocks pinned
        (never evicted for the call's room) until the call returns.
        """
        self._check_open()
        # Whether every key is a bytes or an int is checked while the copy runs (the common case
        # costs nothing then); a list that starts with anything else is converted here.
        given = _key_list(keys)
        checked = bool(given) and type(given[0]) not in (bytes, int)
        if checked:
            given = _keys(given)  # type: ignore[assignment]
        if type(wait) is not bool:
            raise TypeError(f"wait must be a bool, not {type(wait).__name__}")
        if after is not None and self._engine is None:
            raise ValueError("after= needs a CopyEngine; this store copies host memory")
        self._sync_capacity()
        pages = self._pages(src, len(given), writable=False)
        self._enter()
        sources = self._sources(pages)
        self._pin(sources)
        try:
            try:
                return await self._store(given, pages, after, wait, checked)  # type: ignore[arg-type]
            except _NotCanonical:  # nothing was stored: convert (or refuse) and start again
                return await self._store(_keys(given), pages, after, wait, True)
        finally:
            self._unpin(sources)
            self._exit()

    def _sources(self, pages: _Pages) -> I64:
        """The ready blocks whose slots the pages lie in (pages in the store's own tier), pinned for the call.

        Unpinned, such a block could be evicted by this call (or another) and
        its slot handed to a new block while the copy still reads it.
        """
        slots = self._blocks_under(pages)
        ready: I64 = slots[self._state[slots] == _READY]
        return ready

    def _blocks_under(self, pages: _Pages) -> I64:
        """The slots the pages lie in that hold (or are getting) a block of the store, ascending."""
        tier = self._tier
        if self._engine is not None and tier not in pages.regions:
            return _NO_IDS
        base, size = tier.region_bounds()
        offsets = pages.addresses - np.uint64(base)  # below the base: wraps past the size
        inside = np.flatnonzero(offsets < np.uint64(size))
        if not inside.size:  # the usual call: pages of the caller's own
            return _NO_IDS
        slot_size = np.uint64(tier.slot_size)
        first = offsets[inside] // slot_size
        last = (offsets[inside] + pages.lengths[inside] - np.uint64(1)) // slot_size  # a page may straddle two
        slots: I64 = np.union1d(first, last).astype(np.int64)
        slots = slots[slots < len(self._state)]
        used: I64 = slots[self._state[slots] != _FREE]
        return used

    def _pages(self, obj: Any, n: int, *, writable: bool) -> _Pages:
        """The caller's pages, checked against the slot size."""
        slot_size = self._tier.slot_size
        if self._engine is not None:
            side = buffer_addresses(obj, n, slot_size, writable=writable, host_only=self._engine.device is None)
            if not writable and n and side.page > slot_size:  # one page size: no pass over the lengths
                raise ValueError(f"a page of {side.page} bytes does not fit a {slot_size}-byte slot; nothing changed")
            lengths = np.full(n, side.page, dtype=np.uint64)
            return _Pages(side.addresses, lengths, [obj], side.page, tuple(side.regions))
        pages = _host_pages(obj, n, writable=writable)
        if not writable and n:
            longest = int(pages.lengths.max())
            if longest > slot_size:
                raise ValueError(f"a page of {longest} bytes does not fit a {slot_size}-byte slot; nothing changed")
            if int(pages.lengths.min()) == 0:
                raise ValueError("an empty page cannot be stored")
        return pages

    async def _store(
        self,
        keys: list[Key],
        pages: _Pages,
        after: Any,
        wait: bool,
        checked: bool,
        call: _Call | None = None,
        positions: I64 | None = None,
    ) -> StoreResult:
        """Store ``keys``; ``checked``: their types were checked (else ``_NotCanonical`` may come).

        ``call`` and ``positions`` (each key's position in the call): a retry
        of some of the call's keys, nested in the call's pass.
        """

        def check_types() -> None:
            nonlocal checked
            if not checked and not _canonical(keys):
                raise _NotCanonical
            checked = True

        n = len(keys)
        top = call is None
        if call is None:
            call = _Call(n)
        at: Callable[[int], int] = (lambda i: i) if positions is None else positions.item
        try:
            fresh = self._slot_of.keys().isdisjoint(keys)  # new blocks only, the common case: no look-ups
            slots = _NO_IDS if fresh else self._slots(keys)
        except TypeError:  # an unhashable key (a bytearray): convert
            check_types()
            raise
        outcome = np.zeros(n, dtype=np.uint8)  # _MISSING
        if fresh:
            present_slots, missing = _NO_IDS, np.arange(n, dtype=np.int64)
        else:
            ready = self._ready(slots)
            outcome[ready] = _PRESENT
            present_slots = slots[ready]
            if has_repeats(present_slots):
                check_types()
                raise ValueError("a key appears twice in one store call")
            missing = np.flatnonzero(~ready)
        waiting: dict[asyncio.Future[Sequence[Key]], list[int]] = {}
        if missing.size and self._claims:  # a key another call is storing: wait for that call
            check_types()
            if len(set(keys)) != n:
                raise ValueError("a key appears twice in one store call")
            missing, waiting, filling = self._claimed_elsewhere(keys, missing, wait)
            if filling:  # skipped (wait=False): so is every key after it
                outcome[filling] = _SKIPPED
                self._lower(call, at(filling[0]))
        if missing.size and at(int(missing[-1])) >= call.limit:  # a retry's keys past a skip made meanwhile
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

        claim = _Claim(claimed, filling=wait)
        self._claims.add(claim)
        stored_keys: Sequence[Key] = ()
        chunks: list[I64] = []
        inserted: I64 | None = None
        landed = False
        # The call's own present blocks (its prefix) are not evicted to make room, nor dropped by a
        # shrink before the policy touched them: with a CopyEngine the touch waits for the copy to be
        # issued, and a slot past a shrunk policy's end is no slot id of it (IndexError).
        pinned = present_slots
        self._pin(pinned)

        def unpin() -> None:
            nonlocal pinned
            self._unpin(pinned)
            pinned = _NO_IDS

        try:
            try:
                await self._take_slots(len(claimed), wait, chunks, vet)
            finally:
                claim.filling = False
            taken = chunks[0] if len(chunks) == 1 else np.concatenate([_NO_IDS, *chunks])
            if len(taken) < len(claimed):
                vet()
                if call.own:  # blocks an earlier pass stored after these keys: their slots, rather than a skip
                    wanted = missing if positions is None else positions[missing]
                    taken = self._make_room(call, wanted, taken, chunks)
                if len(taken) < len(claimed):
                    self._lower(call, at(int(missing[len(taken)])))
            everything = len(taken) == n  # every key, in order: no subsets to take
            chosen = missing[: len(taken)]
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
                self._key_of[taken] = _objects(chosen_keys)
                self._state[taken] = _STORING
                self._length[taken] = chosen_pages.lengths
                before = len(self._slot_of)
                self._slot_of.update(zip(chosen_keys, taken.tolist(), strict=True))
                if len(self._slot_of) - before != len(chosen_keys):
                    raise ValueError("a key appears twice in one store call")
                if present_slots.size:  # touched first: the blocks stored by the call are the most recent
                    self._policy.accessed(present_slots)
                unpin()
                self._policy.inserted_many(taken, chosen_keys)
                inserted = taken
                published = tuple(chosen_keys)
                nbytes = int(chosen_pages.lengths.sum())

            if chosen.size:
                await self._overlap(self._start_in(taken, chosen_pages, after), book)
            elif present_slots.size:
                self._policy.accessed(present_slots)
                unpin()
            landed = True
            self._state[taken] = _READY
            stored_keys = chosen_keys
            self._visible += len(chosen_keys)
            self._counts["stores"] += len(chosen_keys)
            self._counts["bytes_stored"] += nbytes
            self._events.publish("stored", published)
        finally:
            unpin()
            try:
                if not landed:  # failed or cancelled: no partial block stays, no slot is kept
                    try:
                        if inserted is not None:
                            self._forget_inserted(inserted)
                    finally:
                        self._unbook(np.concatenate([_NO_IDS, *chunks]).tolist())
            finally:
                self._claims.discard(claim)
                claim.future.set_result(stored_keys)
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
        pages: _Pages,
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
        where = np.arange(len(keys), dtype=np.int64) if positions is None else positions
        stored = np.flatnonzero(outcome == _STORED)
        present = self._slots([keys[i] for i in np.flatnonzero(outcome == _PRESENT).tolist()])
        present = present[self._ready(present)]
        mine = self._slots([keys[i] for i in stored.tolist()])
        mine[~self._ready(mine)] = -1  # evicted while this call waited: nothing to pin or give up
        triples = zip(where[stored].tolist(), stored.tolist(), mine.tolist(), strict=True)
        own = [_Own(p, keys[i], s) for p, i, s in triples]
        self._pin(present)
        self._pin(mine[mine >= 0])
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
            self._unpin(present)
            held = [o.slot for o in own if o.slot >= 0]
            for o in own:
                o.slot = -1
            self._unpin(np.asarray(held, dtype=np.int64))
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
        state, pins = self._state, self._pins
        at = np.asarray([o.position for o in own], dtype=np.int64)
        free = np.asarray([o.slot >= 0 and state[o.slot] == _READY and pins[o.slot] == 1 for o in own])
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
        taken = np.concatenate([_NO_IDS, *chunks])
        if len(taken) > s:  # more than the leading keys need: back to the tier
            spare, taken = taken[s:], taken[:s]
            chunks[:] = [taken]
            if not self._tier.closed:
                self._tier.free_many(spare.tolist())
        return taken

    def _give_up(self, call: _Call, own: list[_Own], reused: list[int] | None) -> None:
        """Drop blocks the call stored (reported skipped); a slot only the call pins goes to ``reused``.

        A block a load is reading disappears at once and its slot is given
        back when the load is done, as with a discard.
        """
        state, pins = self._state, self._pins
        keys: list[Key] = []
        doomed: list[int] = []
        done: set[int] = set()
        try:
            for o in own:
                slot = o.slot
                if slot >= 0 and state[slot] == _READY:  # pinned by the call: still its block
                    self._policy.removed(slot)  # first: a policy that refuses leaves the block as it was
                    del self._slot_of[o.key]
                    self._key_of[slot] = None
                    keys.append(o.key)
                    if reused is not None and pins[slot] == 1:
                        pins[slot] = 0
                        state[slot] = _FREE
                        reused.append(slot)
                        slot = o.slot = -1
                    else:
                        state[slot] = _DOOMED
                if slot >= 0:  # unpinned below: freed now, or when the load reading it is done
                    doomed.append(slot)
                    o.slot = -1
                call.given_up.append(o.position)
                done.add(id(o))
        finally:
            call.own = [o for o in call.own if id(o) not in done]
            self._unpin(np.asarray(doomed, dtype=np.int64))
            if keys:
                self._visible -= len(keys)
                self._counts["evictions"] += len(keys)
                self._events.publish("evicted", tuple(keys))
            self._counts["skipped"] += len(done)

    def _claimed_elsewhere(
        self, keys: list[Key], missing: I64, wait: bool
    ) -> tuple[I64, dict[asyncio.Future[Sequence[Key]], list[int]], list[int]]:
        """Split ``missing`` into the keys no other call is storing, per call those it is, and (``wait=False``)
        those a call that may be waiting for the fill is storing: waiting for that call would wait for the fill."""
        indices = missing.tolist()
        missing_keys = [keys[i] for i in indices]
        elsewhere: dict[Key, _Claim] = {}
        for other in self._claims:
            for key in other.keys.intersection(missing_keys):
                elsewhere[key] = other
        if not elsewhere:
            return missing, {}, []
        free: list[int] = []
        filling: list[int] = []
        waiting: dict[asyncio.Future[Sequence[Key]], list[int]] = {}
        for i, key in zip(indices, missing_keys, strict=True):
            claim = elsewhere.get(key)
            if claim is None:
                free.append(i)
            elif claim.filling and not wait:
                filling.append(i)
            else:
                waiting.setdefault(claim.future, []).append(i)
        return np.asarray(free, dtype=np.int64), waiting, filling

    def _forget_inserted(self, slots: I64) -> None:
        """Untell the policy about blocks of a store that did not land (one by one if the batch fails)."""
        try:
            self._policy.removed_many(slots)
        except Exception:
            log.warning(
                "aiokvtier: the eviction policy failed to remove %d blocks; removing them one by one", len(slots)
            )
            for slot in slots.tolist():
                try:
                    self._policy.removed(slot)
                except KeyError:
                    pass  # the batch got this far

    def _unbook(self, taken: list[int]) -> None:
        """Give back the slots of a store that did not land, and forget what was booked in them."""
        slot_of = self._slot_of
        for slot in taken:
            owner = self._key_of[slot]
            if owner is not None and slot_of.get(owner) == slot:
                del slot_of[owner]
            self._key_of[slot] = None
            self._state[slot] = _FREE
        if taken and not self._tier.closed:
            self._tier.free_many(taken)

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
                self._evict(need - free)
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
                    self._sync_capacity()  # the tier may have grown since the call began (a retry)
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
            self._sync_capacity()
            got += len(chunk)

    def _fill_failed(self, exc: BaseException) -> None:
        """Say once per fill failure (not per call) that stores now recycle resident slots only."""
        error = str(exc)
        if error != self._fill_failure_logged:
            self._fill_failure_logged = error
            log.warning("aiokvtier: the tier's fill failed; the store evicts into resident slots only: %s", exc)

    def _evict(self, n: int) -> int:
        """Evict up to ``n`` ready, unpinned blocks in the policy's order; returns how many."""
        state, pins = self._state, self._pins
        slots: list[int] = []
        keys: list[Key] = []
        try:
            victims = self._policy.victims()
            try:
                for slot in victims:
                    if state[slot] != _READY or pins[slot]:
                        continue
                    keys.append(self._forget(slot))
                    slots.append(slot)
                    if len(slots) == n:
                        break
            finally:
                close = getattr(victims, "close", None)  # a generator: let it clean up now
                if close is not None:
                    close()
        finally:  # also when the policy failed half way: what was forgotten is given back
            self._evicted(slots, keys)
        return len(slots)

    def _forget(self, slot: int) -> Key:
        """Drop a ready block's bookkeeping (its slot is the caller's to give back); returns its key."""
        key: Key | None = self._key_of[slot]
        assert key is not None
        self._policy.removed(slot)
        del self._slot_of[key]
        self._key_of[slot] = None
        self._state[slot] = _FREE
        return key

    def _evicted(self, slots: list[int], keys: list[Key]) -> None:
        if slots:
            self._tier.free_many(slots)
            self._visible -= len(slots)
            self._counts["evictions"] += len(slots)
            self._events.publish("evicted", tuple(keys))

    def _start_in(self, slots: I64, pages: _Pages, after: Any) -> _Started:
        """Queue the copy of the caller's pages into ``slots``."""
        tier, engine = self._tier, self._engine
        if engine is not None:
            return engine.start(tier, slots, pages.side(pages.page), "d2h", after=after)
        copies = list(
            zip(tier.slot_addresses(slots).tolist(), pages.addresses.tolist(), pages.lengths.tolist(), strict=True)
        )
        return (None, self._copy_host(copies, pages.addresses, pages.lengths))

    @staticmethod
    async def _overlap(started: _Started, work: Callable[[], None]) -> None:
        """Do ``work`` once the copy was issued, then wait for the copy to land.

        The store asks the engine for no signal of the issue (a crossing back to
        the loop per call, 60-100 us on the H200, where the booking takes ~30
        us): ``submitted`` is then the copy's landing, and the work follows it.
        An engine that does report the issue has the work run while the copy
        is in flight. The caller's pages belong to the copy until it lands: a
        cancellation is held back until then.
        """
        submitted, done = started
        try:
            if submitted is not None:
                await submitted
            work()
        finally:
            await finish(done)

    def _copy_host(self, copies: list[tuple[int, int, int]], pages: U64, lengths: U64) -> asyncio.Future[None]:
        """``memmove`` the copies on the store's thread, tracked as every copy over a region's memory
        is: by the tier, and by any StaticHostMem or other tier that the caller's ``pages`` (of
        ``lengths`` bytes) lie in, for an array made over its memory keeps none of it mapped. Their
        close and shrink wait until the thread let go.

        :raises CopyPlanError: a page lies in a region that is closing, or leaves it.
        """
        # Located now, in the step that located the slots: every region met is open.
        _, regions = registrations([pages], lengths, known_only=False)
        done = self._tier.copies.begin()
        for region in regions:
            if region is not self._tier:
                region.copies.track(done)
        try:
            return self._life.submit(_memmove_all, copies, done)
        except BaseException:
            done.set()
            raise

    # -- load ---------------------------------------------------------------------------

    async def load(self, keys: Sequence[object], dst: Any, *, after: Any = None) -> None:
        """Copy each key's block into ``dst`` (one page per key); the blocks stay stored.

        Blocks are pinned while they are read: never evicted under a load. A
        block copies the length it was stored with.

        :raises BlockNotFound: a key is not stored (the first missing one is
            named); nothing is copied.
        :raises ValueError: a destination page shorter than its block, a
            read-only destination, pages that do not match the keys, a
            destination page in a block of this store (its own tier's slots).
        :raises TypeError: a key that is not bytes-like or an int.
        :raises TierClosedError: the store is closed.
        :raises CopyPlanError: pages in a StaticHostMem or another tier (named
            by address, or an array over its memory) that is closing, or that
            closed (or shrank past them) while the call waited.
        """
        self._check_open()
        keys = _key_seq(keys)
        slots = self._slots_of_all(keys)
        if slots is None or not (self._state[slots] == _READY).all():
            absent = np.flatnonzero(~self._ready(self._slots(keys) if slots is None else slots))
            raise BlockNotFound(keys[int(absent[0])])
        pages = self._pages(dst, len(keys), writable=True)
        lengths = self._length[slots]  # a copy: the map may grow later
        shorts = np.flatnonzero(pages.lengths < lengths)
        if shorts.size:
            short = int(shorts[0])
            raise ValueError(
                f"destination page {short} has {int(pages.lengths[short])} bytes, block {keys[short]!r} has "
                f"{int(lengths[short])}; nothing was copied"
            )
        if after is not None and self._engine is None:
            raise ValueError("after= needs a CopyEngine; this store copies host memory")
        if not slots.size:
            return
        under = self._blocks_under(pages)
        if under.size:
            raise ValueError(
                f"a destination page lies in slot {int(under[0])}, a block of this store; nothing was copied"
            )
        nbytes = 0

        def touch() -> None:  # while the copy runs
            nonlocal nbytes
            self._policy.accessed(slots)
            nbytes = int(lengths.sum())

        self._enter()
        self._pin(slots)
        try:
            await self._overlap(self._start_out(slots, pages, lengths, after), touch)
        finally:
            self._unpin(slots)
            self._exit()
        self._counts["loads"] += len(slots)
        self._counts["bytes_loaded"] += nbytes

    def _pin(self, slots: I64) -> None:
        if slots.size:
            np.add.at(self._pins, slots, _ONE)  # a key loaded twice in one call pins twice

    def _unpin(self, slots: I64) -> None:
        if not slots.size:
            return
        pins = self._pins
        np.subtract.at(pins, slots, _ONE)
        released = slots[pins[slots] == 0]
        doomed = released[self._state[released] == _DOOMED]  # discarded while they were read
        if doomed.size:
            doomed = np.unique(doomed)
            self._state[doomed] = _FREE
            if not self._tier.closed:
                self._tier.free_many(doomed.tolist())

    def _start_out(self, slots: I64, pages: _Pages, lengths: U64, after: Any) -> _Started:
        """Queue the copy of ``slots`` into the caller's pages."""
        tier, engine = self._tier, self._engine
        page = pages.page or int(pages.lengths[0])
        if engine is not None and bool((lengths == page).all()):
            return engine.start(tier, slots, pages.side(page), "h2d", after=after)
        # Host pages, or blocks shorter than the destination pages: each copies its own length.
        copies = list(zip(pages.addresses.tolist(), tier.slot_addresses(slots).tolist(), lengths.tolist(), strict=True))
        if engine is not None:
            return (None, asyncio.ensure_future(engine.copy(copies, after=after)))
        return (None, self._copy_host(copies, pages.addresses, lengths))

    # -- discard and resize ---------------------------------------------------------------

    def discard(self, keys: Iterable[object]) -> int:
        """Drop blocks; unknown keys (and keys still being stored) are ignored. Returns how many were dropped.

        A block a load is reading disappears at once and its slot is given
        back when the load is done.

        :raises TypeError: a key that is not bytes-like or an int.
        """
        self._check_open()
        keys = _key_seq(keys)
        slots = self._slots(keys)
        hit = np.flatnonzero(self._ready(slots))
        if len(hit) < len(keys) or has_repeats(slots[hit]):  # a key given twice is dropped once
            hit = hit[np.unique(slots[hit], return_index=True)[1]]
            hit.sort()
        dropped = keys if len(hit) == len(keys) else [keys[i] for i in hit.tolist()]
        if not dropped:
            return 0
        gone = slots[hit]
        self._policy.removed_many(gone)  # first: a policy that refuses leaves the blocks as they were
        slot_of = self._slot_of
        deque(map(slot_of.__delitem__, dropped), maxlen=0)
        self._key_of[gone] = None
        pinned = self._pins[gone] > 0
        self._state[gone] = np.where(pinned, _DOOMED, _FREE).astype(np.uint8)
        free = gone[~pinned]
        if free.size:
            self._tier.free_many(free.tolist())
        self._visible -= len(dropped)
        self._counts["discards"] += len(dropped)
        self._events.publish("discarded", tuple(dropped))
        return len(dropped)

    async def resize(self, new_quota: int | str) -> None:
        """Resize the tier; a shrink first evicts the blocks that lie past the new end.

        :raises QuotaError: the quota is invalid, or a block past the new end
            is being stored or loaded (nothing changed).
        :raises TierClosedError: the store is closed.

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
        tier = self._tier
        async with self._resize_lock:
            self._check_open()
            # A tier grown behind the store's back: the slots past the new end checked below
            # (another user's among them) index the maps.
            self._sync_capacity()
            cfg = tier.config.resolved
            quota = parse_quota(new_quota, slot_size=cfg.slot_size, max_quota=cfg.max_quota)
            total = quota // tier.slot_size
            if total < tier.slots_total:
                tail = self._state[total:]
                busy = np.flatnonzero((tail == _STORING) | (tail == _DOOMED) | (self._pins[total:] > 0))
                if busy.size:
                    raise QuotaError(
                        f"cannot shrink to {quota} bytes: the block in slot {total + int(busy[0])} "
                        "is being stored or loaded"
                    )
                # Slots past the end that are not this store's blocks (another user's, a view, a store's
                # slots not booked yet): the tier would refuse, so refuse before evicting anything.
                held = tier.slots_held_past(total)
                foreign = held[self._state[held] != _READY] if held.size else held
                if foreign.size:
                    raise QuotaError(
                        f"cannot shrink to {quota} bytes: slot {int(foreign[0])} past the new end is held "
                        "by something other than a stored block (nothing was evicted)"
                    )
                self._drop_past(total)
            try:
                await tier.resize(quota)
            finally:  # also when cancelled: the tier may have grown all the same
                self._follow_tier()

    def _drop_past(self, total: int) -> None:
        dropped: list[int] = []
        keys: list[Key] = []
        try:
            for slot in (np.flatnonzero(self._state[total:] == _READY) + total).tolist():
                keys.append(self._forget(slot))
                dropped.append(slot)
        finally:  # also when the policy failed half way: what was forgotten is given back
            self._evicted(dropped, keys)


def _objects(keys: Sequence[Key]) -> npt.NDArray[np.object_]:
    """Keys as a 1-D object array (numpy would make fixed-width bytes of a list of bytes)."""
    out = np.empty(len(keys), dtype=object)
    out[:] = keys
    return out


def _memmove_all(copies: list[tuple[int, int, int]], done: threading.Event) -> None:
    """On the store's thread (ctypes releases the GIL for each copy); ``done`` tells the tier."""
    move = ctypes.memmove
    try:
        for dst, src, n in copies:
            move(dst, src, n)
    finally:
        done.set()
