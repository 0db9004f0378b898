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
copying twice. Copies go through a :class:`CopyEngine` (device memory) or,
without one, ``memmove`` on the store's own thread.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import operator
from array import array
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._config import parse_quota
from .._errors import BlockNotFound, OutOfSlots, QuotaError, TierClosedError, WouldBlock
from .._lifecycle import Lifecycle, Owner, finish
from ._events import BlockEvent, EventHub
from ._policy import EvictionPolicy, make_policy

if TYPE_CHECKING:
    from .._cuda._engine import CopyEngine
    from .._host._tier import HostTier

__all__ = ["BlockStore", "StoreResult", "StoreStatistics"]

log = logging.getLogger("aiokvtier")

Key = bytes | int
_FREE, _STORING, _READY, _DOOMED = 0, 1, 2, 3
_MISSING, _STORED, _PRESENT, _SKIPPED = 0, 1, 2, 3  # a key's outcome in one store call


@dataclass(frozen=True, slots=True)
class StoreResult:
    """What :meth:`BlockStore.store` did with each key, in the caller's order."""

    stored: tuple[Key, ...]
    """Newly stored (copied)."""
    present: tuple[Key, ...]
    """Already stored, or stored meanwhile by a concurrent call that this one waited for: not copied again."""
    skipped: tuple[Key, ...]
    """Not stored: no room even after eviction (the suffix of the call), or, with ``wait=False``, not resident yet."""


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """A snapshot of a :class:`BlockStore`."""

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
    if isinstance(keys, bytes | bytearray | memoryview | str | int):
        raise TypeError(f"keys must be a sequence of keys, not one {type(keys).__name__}")
    given = keys if isinstance(keys, list | tuple) else list(keys)
    if set(map(type, given)) <= {bytes, int}:  # one pass in C: nothing to convert
        return given if isinstance(given, list) else list(given)
    return [_key(k) for k in given]


class _HostPages:
    """Pages in host memory: (address, length) per key, and the objects that own them."""

    def __init__(self, obj: Any, n: int, *, writable: bool) -> None:
        if isinstance(obj, np.ndarray):
            if obj.ndim != 2 or obj.dtype != np.uint8:
                raise ValueError(f"a numpy page array must be 2-D uint8, got {obj.ndim}-D {obj.dtype}")
            if obj.shape[0] != n:
                raise ValueError(f"expected one page per key ({n}), got {obj.shape[0]} rows")
            if not obj.flags.c_contiguous:
                raise ValueError("the page array must be C-contiguous")
            if writable and not obj.flags.writeable:
                raise ValueError("the destination array is read-only; nothing was copied")
            base, page = obj.ctypes.data, obj.shape[1]
            self.addresses = [base + i * page for i in range(n)]
            self.lengths = [page] * n
            self.owners: list[Any] = [obj]
            return
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
        self.addresses = [a.ctypes.data if a.size else 0 for a in arrays]
        self.lengths = [a.size for a in arrays]
        self.owners = [*views, *arrays]


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

    :param tier: an open :class:`HostTier`; one block per slot.
    :param engine: a :class:`CopyEngine` for device pages (tensors or
        addresses), or None for host pages copied on the store's thread.
    :param policy: ``"lru"`` (default), ``"s3fifo"``, or an
        :class:`EvictionPolicy` instance.
    :param event_limit: events kept per subscriber of :meth:`events` before
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
        self._slot_of: dict[Key, int] = {}
        self._key_of: list[Key | None] = []
        self._state = bytearray()
        self._length = array("Q")
        self._pins = array("I")
        self._pending: dict[Key, asyncio.Future[frozenset[Key]]] = {}
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
        self._tier._check_open()
        if self._engine_given is not None:
            self._engine_given._check_open()
        capacity = self._tier.slots_total
        self._policy = make_policy(self._policy_arg, capacity)
        self._grow_maps(capacity)
        self._idle = asyncio.Event()
        self._idle.set()

    async def _teardown(self) -> None:
        if self._idle is not None:
            await self._idle.wait()  # stores and loads in flight finish first
        self._events.close()
        slots = [slot for slot in self._slot_of.values() if slot >= 0]
        slots += [s for s, state in enumerate(self._state) if state == _DOOMED]
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
        capacity = self._tier.slots_total
        if capacity > len(self._state):
            self._grow_maps(capacity)
            self._policy.resize(capacity)

    def _grow_maps(self, capacity: int) -> None:
        extra = capacity - len(self._state)
        if extra > 0:
            self._key_of.extend([None] * extra)
            self._state.extend(bytes(extra))
            self._length.extend([0] * extra)
            self._pins.extend([0] * extra)

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
        return self._length[slot]

    def lookup(self, keys: Sequence[object]) -> int:
        """How many leading keys are stored (a prefix hit); touches them. Never blocks.

        :raises TypeError: a key is not bytes-like or an int (a bool, a str).
        :raises TierClosedError: the store is closed.
        """
        self._check_open()
        keys = _keys(keys)
        get, state = self._slot_of.get, self._state
        slots = []
        for key in keys:
            slot = get(key, -1)
            if slot < 0 or state[slot] != _READY:
                break
            slots.append(slot)
        hits = len(slots)
        if hits:
            self._policy.accessed(np.asarray(slots, dtype=np.int64))
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
            blocks_pinned=int(np.count_nonzero(np.frombuffer(self._pins, dtype=np.uint32))),
            in_flight=self._in_flight,
        )

    def events(self) -> AsyncIterator[BlockEvent]:
        """A new subscription: every ``stored``, ``evicted`` and ``discarded`` event from now on.

        Bounded: a subscriber that reads too slowly loses the oldest events,
        and the next one it reads says how many (``BlockEvent.dropped``). The
        iteration ends when the store closes.
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
        (the suffix) are skipped, never an error.

        :param src: with a CopyEngine, device addresses or a CUDA tensor (one
            page per key), as :meth:`CopyEngine.to_host` takes them; without
            one, a sequence of bytes-like objects or a 2-D uint8 numpy array.
        :param after: a CUDA stream or event the copy waits for on the GPU.
        :param wait: False: skip keys whose slots are not resident yet
            instead of waiting for the fill.
        :raises ValueError: a page larger than a slot, a key twice in one
            call, pages that do not match the keys (nothing changed).
        :raises TypeError: a key that is not bytes-like or an int.
        :raises TierClosedError: the store (or its tier) is closed.
        :raises CudaError: the driver refused the copy (nothing stored).
        """
        self._check_open()
        keys = _keys(keys)
        if len(set(keys)) != len(keys):
            raise ValueError("a key appears twice in one store call")
        if type(wait) is not bool:
            raise TypeError(f"wait must be a bool, not {type(wait).__name__}")
        self._sync_capacity()
        pages = self._pages(src, len(keys), writable=False)
        self._enter()
        try:
            return await self._store(keys, src, pages, after, wait)
        finally:
            self._exit()

    def _pages(self, obj: Any, n: int, *, writable: bool) -> tuple[list[int], list[int], list[Any]]:
        """``(addresses, lengths, owners)`` of the caller's pages, checked against the slot size."""
        slot_size = self._tier.slot_size
        if self._engine is None:
            host = _HostPages(obj, n, writable=writable)
            addresses, lengths, owners = host.addresses, host.lengths, host.owners
        else:
            from .._cuda._requests import buffer_addresses

            side = buffer_addresses(obj, n, slot_size, writable=writable, host_only=self._engine.device is None)
            addresses, lengths, owners = side.addresses.tolist(), [side.page] * n, [obj]
        too_big = None if writable else next((length for length in lengths if length > slot_size), None)
        if too_big is not None:
            raise ValueError(f"a page of {too_big} bytes does not fit a {slot_size}-byte slot; nothing changed")
        if not writable and n and min(lengths) == 0:
            raise ValueError("an empty page cannot be stored")
        return addresses, lengths, owners

    async def _store(
        self, keys: list[Key], src: Any, pages: tuple[list[int], list[int], list[Any]], after: Any, wait: bool
    ) -> StoreResult:
        if after is not None and self._engine is None:
            raise ValueError("after= needs a CopyEngine; this store copies host memory")
        addresses, lengths, _owners = pages
        slot_of, state, pending = self._slot_of, self._state, self._pending
        n = len(keys)
        outcome = bytearray(n)  # _MISSING, then _STORED / _PRESENT / _SKIPPED per key
        present_slots: list[int] = []
        missing: list[int] = []
        waiting: dict[asyncio.Future[frozenset[Key]], list[int]] = {}
        for i, key in enumerate(keys):
            slot = slot_of.get(key, -1)
            if slot >= 0 and state[slot] == _READY:
                outcome[i] = _PRESENT
                present_slots.append(slot)
            elif key in pending:
                waiting.setdefault(pending[key], []).append(i)
            else:
                missing.append(i)
        if present_slots:
            self._policy.accessed(np.asarray(present_slots, dtype=np.int64))
        # One future for the whole call, claimed before any await: a concurrent store of one of
        # these keys waits for it and learns from its result (the keys stored) what became of its key.
        claim: asyncio.Future[frozenset[Key]] = asyncio.get_running_loop().create_future()
        claimed = [keys[i] for i in missing]
        for key in claimed:
            pending[key] = claim
        stored_keys: frozenset[Key] = frozenset()
        taken: list[int] = []
        landed = False
        self._pin(present_slots)  # the call's own present blocks (its prefix) are not evicted to make room
        try:
            try:
                await self._take_slots(len(missing), wait, taken)
            finally:
                self._unpin(present_slots)
            chosen = missing[: len(taken)]
            for i in missing[len(taken) :]:
                outcome[i] = _SKIPPED
            chosen_keys = [keys[i] for i in chosen]
            chosen_lengths = [lengths[i] for i in chosen]

            def book() -> None:
                # Runs while the copy is in flight: nobody sees these blocks before they are ready
                # (lookups want ready, and a store of the same key waits on the claim).
                key_of, length_of = self._key_of, self._length
                for key, slot, length in zip(chosen_keys, taken, chosen_lengths, strict=True):
                    slot_of[key] = slot
                    key_of[slot] = key
                    state[slot] = _STORING
                    length_of[slot] = length

            if chosen:
                await finish(
                    self._copy_while(
                        self._copy_in(taken, [addresses[i] for i in chosen], chosen_lengths, src, after), book
                    )
                )
            landed = True
            np.frombuffer(state, dtype=np.uint8)[np.asarray(taken, dtype=np.int64)] = _READY
            self._policy.inserted_many(taken, chosen_keys)
            for i in chosen:
                outcome[i] = _STORED
            stored_keys = frozenset(chosen_keys)
            self._visible += len(chosen)
            self._counts["stores"] += len(chosen)
            self._counts["bytes_stored"] += sum(chosen_lengths)
            self._events.publish("stored", tuple(chosen_keys))
        finally:
            if not landed:  # failed or cancelled: no partial block stays, no slot is kept
                for slot in taken:
                    owner = self._key_of[slot]
                    if owner is not None and slot_of.get(owner) == slot:
                        del slot_of[owner]
                    self._key_of[slot] = None
                    state[slot] = _FREE
                if taken and not self._tier.closed:
                    self._tier.free_many(taken)
            for key in claimed:
                if pending.get(key) is claim:
                    del pending[key]
            claim.set_result(stored_keys)
        retry: list[int] = []
        for future, indices in waiting.items():
            done = await future
            for i in indices:
                if keys[i] in done:
                    outcome[i] = _PRESENT
                else:
                    retry.append(i)  # the other store failed or skipped it: try it here
        counts = self._counts
        counts["present"] += outcome.count(_PRESENT)
        counts["skipped"] += outcome.count(_SKIPPED)
        if retry:  # counted by the inner call
            retry.sort()
            again = await self._store(
                [keys[i] for i in retry],
                src,
                ([addresses[i] for i in retry], [lengths[i] for i in retry], _owners),
                after,
                wait,
            )
            done_stored, done_present = set(again.stored), set(again.present)
            for i in retry:
                key = keys[i]
                outcome[i] = _STORED if key in done_stored else _PRESENT if key in done_present else _SKIPPED
        return StoreResult(
            stored=tuple(k for k, o in zip(keys, outcome, strict=True) if o == _STORED),
            present=tuple(k for k, o in zip(keys, outcome, strict=True) if o == _PRESENT),
            skipped=tuple(k for k, o in zip(keys, outcome, strict=True) if o == _SKIPPED),
        )

    async def _take_slots(self, n: int, wait: bool, taken: list[int]) -> None:
        """Take up to ``n`` slots into ``taken``, evicting as needed; fewer when nothing more can be had."""
        tier = self._tier
        while len(taken) < n:
            need = n - len(taken)
            if tier.slots_free < need:
                self._evict(need - tier.slots_free)
            want = min(need, tier.slots_free)
            if want == 0:
                return
            if not wait:
                for _ in range(want):
                    try:
                        taken.append(tier.allocate_nowait())
                    except (WouldBlock, OutOfSlots):
                        return
                    except Exception as exc:  # FillError: nothing more can be had here
                        log.warning("aiokvtier: store skips blocks: %s", exc)
                        return
                continue
            try:
                taken.extend(await tier.allocate(want))
            except OutOfSlots:
                continue  # another task took them while this one waited for the fill
            except TierClosedError:
                raise
            except Exception as exc:  # FillError: the slots cannot be made resident
                log.warning("aiokvtier: store skips blocks: %s", exc)
                return

    def _evict(self, n: int) -> int:
        """Evict up to ``n`` ready, unpinned blocks in the policy's order; returns how many."""
        state, pins = self._state, self._pins
        slots: list[int] = []
        keys: list[Key] = []
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
        self._evicted(slots, keys)
        return len(slots)

    def _forget(self, slot: int) -> Key:
        """Drop a ready block's bookkeeping (its slot is the caller's to give back); returns its key."""
        key = self._key_of[slot]
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

    async def _copy_in(self, slots: list[int], addresses: list[int], lengths: list[int], src: Any, after: Any) -> None:
        tier, engine = self._tier, self._engine
        if engine is not None:
            # The pages stay referenced by this frame until the copy has landed (finish() in the engine).
            await engine.to_host(tier, slots, np.asarray(addresses, dtype=np.uint64), after=after, page=lengths[0])
            return
        copies = list(zip(tier.slot_addresses(slots).tolist(), addresses, lengths, strict=True))
        await finish(self._run_copies(copies))

    @staticmethod
    async def _copy_while(copy: Coroutine[Any, Any, None], work: Callable[[], None]) -> None:
        """Start ``copy``, do ``work`` while it is in flight, then wait for it (run through finish())."""
        task = asyncio.ensure_future(copy)
        await asyncio.sleep(0)  # the copy plans and submits; then the loop is free for the work
        try:
            work()
        finally:
            await task

    async def _run_copies(self, copies: list[tuple[int, int, int]]) -> None:
        await self._life.run(_memmove_all, copies)

    # -- load ---------------------------------------------------------------------------

    async def load(self, keys: Sequence[object], dst: Any, *, after: Any = None) -> None:
        """Copy each key's block into ``dst`` (one page per key); the blocks stay stored.

        Blocks are pinned while they are read: never evicted under a load. A
        block copies the length it was stored with.

        :raises BlockNotFound: a key is not stored (the first missing one is
            named); nothing is copied.
        :raises ValueError: a destination page shorter than its block, a
            read-only destination, pages that do not match the keys.
        :raises TypeError: a key that is not bytes-like or an int.
        :raises TierClosedError: the store is closed.
        """
        self._check_open()
        keys = _keys(keys)
        slot_of, state = self._slot_of, self._state
        slots: list[int] = []
        for key in keys:
            slot = slot_of.get(key, -1)
            if slot < 0 or state[slot] != _READY:
                raise BlockNotFound(key)
            slots.append(slot)
        addresses, room, _owners = self._pages(dst, len(keys), writable=True)
        ids = np.asarray(slots, dtype=np.int64)
        length_of = np.frombuffer(self._length, dtype=np.uint64)[ids]  # a copy: the map may grow later
        shorts = np.flatnonzero(np.asarray(room, dtype=np.uint64) < length_of)
        if shorts.size:
            short = int(shorts[0])
            raise ValueError(
                f"destination page {short} has {room[short]} bytes, block {keys[short]!r} has "
                f"{int(length_of[short])}; nothing was copied"
            )
        lengths: list[int] = length_of.tolist()
        if after is not None and self._engine is None:
            raise ValueError("after= needs a CopyEngine; this store copies host memory")
        self._policy.accessed(ids)
        self._enter()
        self._pin(slots)
        try:
            await self._copy_out(slots, addresses, lengths, room, dst, after)
        finally:
            self._unpin(slots)
            self._exit()
        self._counts["loads"] += len(slots)
        self._counts["bytes_loaded"] += int(length_of.sum())

    def _pin(self, slots: list[int]) -> None:
        if slots:
            pins = np.frombuffer(self._pins, dtype=np.uint32)
            np.add.at(pins, np.asarray(slots, dtype=np.int64), 1)  # a key loaded twice in one call pins twice
            del pins  # an exported buffer would stop the array from growing

    def _unpin(self, slots: list[int]) -> None:
        if not slots:
            return
        ids = np.asarray(slots, dtype=np.int64)
        pins = np.frombuffer(self._pins, dtype=np.uint32)
        np.subtract.at(pins, ids, 1)
        released = ids[pins[ids] == 0]
        del pins
        state = np.frombuffer(self._state, dtype=np.uint8)
        doomed = np.unique(released[state[released] == _DOOMED])  # discarded while they were read
        state[doomed] = _FREE
        del state
        if doomed.size and not self._tier.closed:
            self._tier.free_many(doomed.tolist())

    async def _copy_out(
        self, slots: list[int], addresses: list[int], lengths: list[int], room: list[int], dst: Any, after: Any
    ) -> None:
        tier, engine = self._tier, self._engine
        if engine is not None:
            page = room[0]
            if all(n == page for n in lengths):
                await engine.to_device(tier, slots, np.asarray(addresses, dtype=np.uint64), after=after, page=page)
            else:  # blocks shorter than the destination pages: each copies its own length
                copies = [(a, tier.address(s), n) for s, a, n in zip(slots, addresses, lengths, strict=True)]
                await engine.copy(copies, after=after)
            return
        copies = list(zip(addresses, tier.slot_addresses(slots).tolist(), lengths, strict=True))
        await finish(self._run_copies(copies))

    # -- discard and resize ---------------------------------------------------------------

    def discard(self, keys: Iterable[object]) -> int:
        """Drop blocks; unknown keys (and keys still being stored) are ignored. Returns how many were dropped.

        A block a load is reading disappears at once and its slot is given
        back when the load is done.

        :raises TypeError: a key that is not bytes-like or an int.
        """
        self._check_open()
        keys = _keys(keys)
        state, pins = self._state, self._pins
        dropped: list[Key] = []
        free: list[int] = []
        for key in keys:
            slot = self._slot_of.get(key, -1)
            if slot < 0 or state[slot] != _READY:
                continue
            del self._slot_of[key]
            self._key_of[slot] = None
            self._policy.removed(slot)
            if pins[slot]:
                state[slot] = _DOOMED
            else:
                state[slot] = _FREE
                free.append(slot)
            dropped.append(key)
        if free:
            self._tier.free_many(free)
        self._visible -= len(dropped)
        self._counts["discards"] += len(dropped)
        self._events.publish("discarded", tuple(dropped))
        return len(dropped)

    async def resize(self, new_quota: int | str) -> None:
        """Resize the tier; a shrink first evicts the blocks that lie past the new end.

        :raises QuotaError: the quota is invalid, or a block past the new end
            is being stored or loaded (nothing changed).
        :raises TierClosedError: the store is closed.

        Cancellation: as :meth:`HostTier.resize`; blocks evicted for a shrink
        stay evicted.
        """
        self._check_open()
        tier = self._tier
        async with self._resize_lock:
            self._check_open()
            cfg = tier.config.resolved
            quota = parse_quota(new_quota, slot_size=cfg.slot_size, max_quota=cfg.max_quota)
            total = quota // tier.slot_size
            if total < tier.slots_total:
                state, pins = self._state, self._pins
                busy = next((s for s in range(total, len(state)) if state[s] in (_STORING, _DOOMED) or pins[s]), None)
                if busy is not None:
                    raise QuotaError(
                        f"cannot shrink to {quota} bytes: the block in slot {busy} is being stored or loaded"
                    )
                self._drop_past(total)
            await tier.resize(quota)
            self._grow_maps(tier.slots_total)
            self._policy.resize(tier.slots_total)

    def _drop_past(self, total: int) -> None:
        state = self._state
        slots = [slot for slot in range(total, len(state)) if state[slot] == _READY]
        self._evicted(slots, [self._forget(slot) for slot in slots])


def _memmove_all(copies: list[tuple[int, int, int]]) -> None:
    """On the store's thread (ctypes releases the GIL for each copy)."""
    move = ctypes.memmove
    for dst, src, n in copies:
        move(dst, src, n)
