"""Pool: the owner of a tier that every process of the machine can attach to.

The owner opens a ``HostTier`` over shared memory (``aiokvtier._host._shared``)
and serves a Unix socket. It is the one authority: its tier allocates and
frees every slot, its ``BlockIndex`` says which key lives where, and it
publishes the watermark; attached processes (``aiokvtier._pool._client``)
map the same memory and copy into and out of the slots they are told. What
a process holds (slots, stores in flight, pinned loads) is booked under its
connection, so when the connection closes (the process exited, or was
killed) the owner takes all of it back.

Requests that may wait (an allocation waiting for the fill, a store waiting
for another process's store of the same key) run as tasks of their
connection; the rest are answered inline, in the order they came.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import socket
import struct
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from .._backings import SharedBackings
from .._config import HostTierConfig, gpu_unit
from .._crossing import one_moment
from .._errors import ConfigError, FillError, OutOfSlots, PoolError, SlotError, TierClosedError, WouldBlock
from .._host._statistics import TierStatistics
from .._host._tier import HostTier
from .._lifecycle import Lifecycle, Owner
from . import _wire
from ._index import BlockIndex
from ._mirror import USABLE, IndexMirror, mirror_fits
from ._socket import Listener, recv_frame_with_fds, send_with_fds
from ._statistics import PoolStatistics
from ._wire import (
    CLAIMED,
    PRESENT,
    SKIPPED,
    Message,
    decode,
    decode_key_matrix,
    decode_keys,
    encode,
    encode_keys,
    error_to,
)

__all__ = ["Pool"]

log = logging.getLogger("aiokvtier")

HELLO_TIMEOUT = 10.0
"""Seconds a new connection has to say hello before it is dropped."""
EVENTS_BUFFERED = 8 << 20
"""Bytes waiting to be sent to a process past which its events are dropped (and counted: its next event says
how many) and its requests are not read (until it reads its answers). A process that stops reading (stopped,
its loop blocked) would otherwise have every event of every store kept for it here, and one that sends without
reading every answer, without bound."""

Reply = tuple[dict[str, Any], list[bytes]]
_KINDS: dict[object, set[type]] = {"f": {bytes}, "p": {bytes}, "b": {bytes}, "i": {int}}
"""The keys' types in each form of keys the wire carries that has one type only."""


class _Peer:
    """One attached process: its connection and what it holds."""

    def __init__(self, pid: int, writer: asyncio.StreamWriter) -> None:
        self.pid = pid
        self.writer = writer
        self.slots: set[int] = set()
        self.claims: set[int] = set()
        self.pins: set[int] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.subscribed = False
        self.dropped = 0
        """Events not sent to this process since its last (it did not read them): told with its next."""

    def send(self, frame: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(frame)

    def reply(self, rid: int, fields: dict[str, Any], parts: list[bytes]) -> None:
        self.send(encode(_wire.REPLY, rid, fields, parts))

    def error(self, rid: int, exc: BaseException) -> None:
        fields, parts = error_to(exc)
        self.send(encode(_wire.ERROR, rid, fields, parts))

    def spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


def _peer_pid(conn: socket.socket) -> int:
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return 0
    pid: int = struct.unpack("3i", creds)[0]
    return pid


def _shared_units(config: HostTierConfig) -> HostTierConfig:
    """A host-backed pool's config with a GPU-usable tier's commit unit, unless it names one (or a
    fill chunk): every process attached with ``device=`` registers the pool unit by unit, and a
    registration of 512 MiB (a host tier's default unit) holds that process's other CUDA calls
    eight times as long as one of 64 MiB (docs/benchmarks.md, executor_responsiveness)."""
    if config.resolved_backing != "host" or {"commit_unit", "fill_chunk"} & config.model_fields_set:
        return config
    values = config.model_dump(exclude_unset=True)
    values["commit_unit"] = gpu_unit(int(config.slot_size))
    return HostTierConfig.model_validate(values)


class Pool(Owner):
    """A host tier shared by every process that attaches to it, and a block store they share.

    ``pool = await Pool.open(config, "/run/kv/pool.sock")`` or
    ``async with Pool(config, path) as pool:`` reserves the tier (as
    ``HostTier.open`` does, over shared memory), starts its fill and serves
    ``path``, returning without waiting for the fill. Other processes
    attach with [``AttachedPool``][aiokvtier.AttachedPool]; the owner's own
    code may use ``pool.tier`` directly, or attach to its own path to use
    the shared store.

    The socket is created with ``mode`` (0600: the owner's user only), next
    to a lock file ``path + ".lock"`` that the kernel releases when the
    owner dies; a restarted owner replaces a dead owner's socket and starts
    clean (every block of the old pool is gone with its memory).

    Threads: the event loop that opened it; its blocking steps run on an
    ``aiokvtier-pool`` thread. Cancellation: as ``HostTier``.

    :param config: the tier's config: ``backing`` resolves to ``"host"``, or to ``"register"``
        (with ``device``: the owner registers the shared memory with its GPU unit by unit, so that
        ``pool.tier`` is a copy region of its ``CopyEngine``).
    :param path: where the socket goes; its directory must exist.
    :param mode: the socket's permission bits.
    """

    def __init__(self, config: HostTierConfig | Mapping[str, Any], path: str | os.PathLike[str], *, mode: int = 0o600):
        self._config = _shared_units(
            config if isinstance(config, HostTierConfig) else HostTierConfig.model_validate(config)
        )
        backing = self._config.resolved_backing
        if backing == "vmm":
            raise ConfigError(
                "a pool shares host memory, registered with the owner's GPU or not (backing='host' or "
                "'register'); backing='vmm' is not shared yet"
            )
        self._path = os.fspath(path)
        if not self._path:
            raise ValueError("path must name a socket file, got an empty path")
        if type(mode) is not int or not 0 <= mode <= 0o777:
            raise ValueError(f"mode must be permission bits (0 to 0o777), got {mode!r}")
        self._mode = mode
        self._life = Lifecycle("Pool", "aiokvtier-pool")
        self._index = BlockIndex()
        self._peers: set[_Peer] = set()
        self._connections: set[asyncio.Task[None]] = set()
        self._claim_waiters: dict[int, list[asyncio.Future[None]]] = {}
        self._pool_id = secrets.token_hex(8)
        self._inline: dict[int, Callable[[_Peer, Message], Reply | None]] = {
            _wire.FREE: self._free,
            _wire.STATS: self._stats,
            _wire.LOOKUP: self._lookup,
            _wire.CONTAINS: self._contains,
            _wire.COMMIT: self._commit,
            _wire.ABORT: self._abort,
            _wire.LOAD: self._load,
            _wire.UNPIN: self._unpin,
            _wire.DISCARD: self._discard,
            _wire.SUBSCRIBE: self._subscribe,
            _wire.LOOKED: self._looked,
        }
        self._waiting: dict[int, Callable[[_Peer, Message], Awaitable[Reply]]] = {
            _wire.ALLOC: self._alloc,
            _wire.BEGIN: self._begin,
            _wire.AWAIT: self._await,
        }

    @classmethod
    async def open(
        cls, config: HostTierConfig | Mapping[str, Any], path: str | os.PathLike[str], *, mode: int = 0o600
    ) -> Pool:
        """Reserve the shared tier, start its fill and serve ``path``.

        :raises pydantic.ValidationError: the config is invalid.
        :raises ConfigError: the config asks for the vmm backing (not shared yet; raised by the constructor).
        :raises PoolError: the directory does not exist, another owner serves ``path``, or a file
            that is not a socket is there.
        :raises OSError: the memory or the socket cannot be had.

        As ``HostTier.open``, everything built is released before an error
        or a cancellation reaches the caller.
        """
        pool = cls(config, path, mode=mode)
        await pool.__aenter__()
        return pool

    async def _build(self) -> None:
        life = self._life
        self._loop = asyncio.get_running_loop()
        self._listener = listener = await life.run(Listener, self._path, self._mode)
        life.undo.callback(listener.close)
        backings = SharedBackings()
        self._tier = await HostTier.open(self._config, backings=backings)
        assert backings.made is not None
        self._fd = backings.made.fd
        s = self._tier.statistics()
        self._mirror: IndexMirror | None = None
        if USABLE and mirror_fits(s.max_quota // s.slot_size, s.slot_size):  # else lookups ask the owner
            self._mirror = await life.run(IndexMirror.create, s.max_quota // s.slot_size)
            life.undo.callback(self._mirror.close)
        self._index = BlockIndex(self._mirror, s.max_quota // s.slot_size)
        self._resized = asyncio.Event()
        self._accepting = asyncio.ensure_future(self._accept())
        self._publisher = asyncio.ensure_future(self._publish())
        log.info("aiokvtier: pool served at %s (owner pid %d)", self._path, os.getpid())

    async def _teardown(self) -> None:
        for name in ("_accepting", "_publisher"):
            task: asyncio.Task[None] | None = self.__dict__.get(name)
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        mirror: IndexMirror | None = self.__dict__.get("_mirror")
        if mirror is not None:
            mirror.mark_closed()  # lookups in attached processes ask the owner now, and learn it closed
        bye = encode(_wire.BYE, 0, {"reason": "the pool's owner closed the pool"})
        for peer in list(self._peers):
            peer.send(bye)
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        tier: HostTier | None = self.__dict__.get("_tier")
        if tier is not None:
            await tier.aclose()
        await self._life.run_undo()

    async def aclose(self) -> None:
        """Tell every attached process that the pool closes (their calls raise ``PoolLostError``),
        drop their connections, close the tier and remove the socket. Idempotent."""
        await self._life.close(self._teardown)

    # -- what the owner sees -------------------------------------------------------------

    @property
    def tier(self) -> HostTier:
        """The shared tier, for the owner's own use (its slots and the attached processes' are one set).

        :raises TierClosedError: the pool is not open.
        """
        self.check_open()
        return self._tier

    @property
    def path(self) -> str:
        return self._path

    @property
    def clients(self) -> int:
        """Processes attached now."""
        return len(self._peers)

    def statistics(self) -> PoolStatistics:
        """A snapshot of the tier, the attached processes and the shared store (any thread: from another
        thread it is taken on the owner's loop, between two of its callbacks, so it waits for the loop;
        a closed pool answers its last figures without it).

        :raises TierClosedError: the pool never opened.
        """
        if "_tier" not in self.__dict__:
            raise TierClosedError(self._life.describe())
        # Read off the loop, the tier's slots, the attached processes and the blocks each come from
        # another moment (and the set of processes may change while it is summed).
        return one_moment(self._loop, self._snapshot, settled=self._life.state == "closed")

    def _snapshot(self) -> PoolStatistics:
        index = self._index
        c = index.counts
        return PoolStatistics(
            tier=self._tier.statistics(),
            path=self._path,
            owner_pid=os.getpid(),
            clients=len(self._peers),
            slots_attached=sum(len(s.slots) for s in self._peers),
            blocks=len(index),
            blocks_pinned=index.pinned,
            claims=index.claims,
            bytes_stored=index.bytes_stored,
            bytes_loaded=index.bytes_loaded,
            **c,
        )

    def check_invariants(self, *, sole_user: bool = False) -> None:
        """Check the shared store's and the attached processes' bookkeeping against each other and the
        tier: for tests and debugging.

        At any time: a key being stored belongs to one store in flight and is
        not visible; each block's pin count is the loads reading it; a
        discarded block is kept only while a load reads it; the index mirror
        names the index's slot and length for every visible key; every store
        in flight and every load belongs to one attached process; no slot is
        held twice (by two processes, or by a process and a block), and
        every one is below the tier's slot count. With ``sole_user`` (the
        owner's own code allocates nothing from ``pool.tier``): the tier's
        ``slots_allocated`` is exactly what the blocks, the stores in flight
        and the attached processes hold.

        A pass over every block and slot: not for a hot path. Call it from
        the owner's event loop.

        :raises AssertionError: an invariant does not hold (the message names it).
        :raises TierClosedError: the pool is not open.
        """
        self.check_open()
        index = self._index
        held = index.check()
        claims: set[int] = set()
        pins: set[int] = set()
        for peer in self._peers:
            _require(not claims & peer.claims, "a store in flight belongs to two processes")
            _require(not pins & peer.pins, "a load belongs to two processes")
            claims |= peer.claims
            pins |= peer.pins
            held.extend(peer.slots)
        _require(claims == index.claims_held, "a store in flight belongs to no attached process")
        _require(pins == index.pins_held, "a load belongs to no attached process")
        _require(len(set(held)) == len(held), "a slot is held twice (by two processes, or a process and a block)")
        s = self._tier.statistics()
        _require(all(0 <= slot < s.slots_total for slot in held), f"a slot held is past the tier's {s.slots_total}")
        _require(s.slots_allocated >= len(held), f"{len(held)} slots held, the tier has {s.slots_allocated} allocated")
        if sole_user:
            _require(
                s.slots_allocated == len(held),
                f"the tier has {s.slots_allocated} slots allocated, the blocks and processes hold {len(held)}",
            )

    def __repr__(self) -> str:
        if "_tier" not in self.__dict__:
            return f"<Pool [{self._life.state} | {self._path}]>"
        return (
            f"<Pool [{self._life.state} | {self._path} | {len(self._peers)} attached | "
            f"{len(self._index)} blocks | {self._tier!r}]>"
        )

    async def resize(self, new_quota: int | str) -> None:
        """Resize the shared tier (as ``HostTier.resize``) and tell every attached process.

        Resize a pool's tier through here, not through ``pool.tier``: the
        attached processes learn the new quota from this call.

        :raises QuotaError: as ``HostTier.resize`` (a slot past the new end is held by any process).
        :raises TierClosedError: the pool is closed.
        """
        self.check_open()
        try:
            await self._tier.resize(new_quota)
        finally:
            # Pushed now, each resize in turn, not coalesced by the publisher: a shrink then a grow
            # seen as one state would leave an attached process's registrations of the punched units
            # (the old pages) in place; and every reply sent after this one follows it on the wire.
            if not self._tier.closed:
                frame = self._state()
                for peer in self._peers:
                    peer.send(frame)
            self._resized.set()

    # -- the watermark, pushed -------------------------------------------------------------

    def _state(self, s: TierStatistics | None = None) -> bytes:
        """The state frame of the tier's statistics ``s`` (None: read now)."""
        s = self._tier.statistics() if s is None else s
        fields = {
            "resident": s.resident_bytes,
            "quota": s.quota,
            "target": s.target_bytes,
            "slots": s.slots_total,
            "error": s.fill_error,
        }
        return encode(_wire.STATE, 0, fields)

    async def _publish(self) -> None:
        """Push the tier's state to every process at each change of the watermark or the quota; nothing polls.

        It waits for the next byte of the fill and for a resize at once: a shrink below the byte it
        waits for would stop the fill short of it (that wait would end only in a ``ValueError``, or
        never), and every process must learn the new quota.
        """
        tier = self._tier
        while True:
            self._resized.clear()  # a resize from here on is pushed by the next turn
            # One reading for the frame and for the byte waited for: the fill moves on other threads,
            # and a watermark read again after the frame could be the last one, never pushed (every
            # attached process waiting for the whole fill then waited for good).
            s = tier.statistics()
            frame = self._state(s)
            for peer in self._peers:
                peer.send(frame)
            waits: set[asyncio.Future[Any]] = {asyncio.ensure_future(self._resized.wait())}
            if s.resident_bytes < s.quota and s.fill_error is None:
                waits.add(asyncio.ensure_future(tier.wait_resident(min(s.resident_bytes + 1, s.quota))))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
                outcomes = await asyncio.gather(*waits, return_exceptions=True)
            if any(isinstance(outcome, TierClosedError) for outcome in outcomes):
                return
            # A FillError is pushed with the next state (then only a resize wakes this); a ValueError is a
            # shrink below the byte awaited (the resize is pushed next).

    # -- connections ------------------------------------------------------------------------

    async def _accept(self) -> None:
        loop = self._loop
        sock = self._listener.sock
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:  # EMFILE and the like: the next accept may succeed
                log.error("aiokvtier: the pool at %s cannot accept: %s", self._path, exc)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            task = asyncio.ensure_future(self._serve(conn))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, conn: socket.socket) -> None:
        pid = _peer_pid(conn)
        try:
            async with asyncio.timeout(HELLO_TIMEOUT):
                payload, fds = await recv_frame_with_fds(conn, 0)
            for fd in fds:
                os.close(fd)
            hello = decode(payload)
            if hello.op != _wire.HELLO or hello.fields.get("v") != _wire.VERSION:
                error = PoolError(
                    f"the pool speaks protocol version {_wire.VERSION}; this process asked for "
                    f"{hello.fields.get('v')!r}: run the same aiokvtier version in both"
                )
                fields, parts = error_to(error)
                await self._loop.sock_sendall(conn, encode(_wire.ERROR, hello.rid, fields, parts))
                conn.close()
                return
            welcome = encode(_wire.WELCOME, hello.rid, self._welcome())
            mirror = self._mirror
            await send_with_fds(conn, welcome, [self._fd] if mirror is None else [self._fd, mirror.fd])
            reader, writer = await asyncio.open_unix_connection(sock=conn)
        except (OSError, ValueError, TimeoutError) as exc:
            log.warning("aiokvtier: a process (pid %d) could not attach to the pool: %r", pid, exc)
            conn.close()
            return
        except BaseException:
            conn.close()
            raise
        peer = _Peer(pid, writer)
        self._peers.add(peer)
        log.info("aiokvtier: process %d attached to the pool at %s", pid, self._path)
        peer.send(self._state())
        try:
            while True:
                head = await reader.readexactly(_wire.LENGTH.size)
                (size,) = _wire.LENGTH.unpack(head)
                if size > _wire.MAX_FRAME:
                    raise ValueError(f"a frame of {size} bytes")
                self._dispatch(peer, decode(await reader.readexactly(size)))
                if writer.transport.get_write_buffer_size() > EVENTS_BUFFERED:
                    # It sends requests and does not read the answers: read no more from it until it does
                    # (else every answer would be kept here for it, without bound).
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the process closed its end, or died
        except ValueError as exc:
            log.warning("aiokvtier: dropping process %d: it broke the pool protocol (%s)", pid, exc)
        finally:
            self._peers.discard(peer)
            await self._release(peer)
            writer.close()
            log.info("aiokvtier: process %d detached from the pool at %s", pid, self._path)

    def _welcome(self) -> dict[str, Any]:
        tier = self._tier
        s = tier.statistics()
        return {
            "pool": self._pool_id,
            "owner": os.getpid(),
            "size": s.max_quota,
            "slot_size": s.slot_size,
            "commit_unit": s.commit_unit,
            "index": None if self._mirror is None else {"slots": self._mirror.slots},
            "config": self._config.model_dump(mode="json"),
        }

    async def _release(self, peer: _Peer) -> None:
        """Take back everything a departed process held: its requests, stores, pins and slots."""
        for task in list(peer.tasks):
            task.cancel()
        await asyncio.gather(*peer.tasks, return_exceptions=True)
        index, free = self._index, self._free_slots
        for claim in list(peer.claims):
            free(index.abort(claim))
            self._claim_done(claim)
        for pin in list(peer.pins):
            free(index.unpin(pin))
        free(list(peer.slots))
        peer.claims.clear()
        peer.pins.clear()
        peer.slots.clear()

    def _free_slots(self, slots: list[int] | npt.NDArray[np.int64]) -> None:
        if len(slots) and not self._tier.closed:
            self._tier.free_many(slots)

    # -- requests ---------------------------------------------------------------------------

    def _dispatch(self, peer: _Peer, message: Message) -> None:
        looked = message.fields.pop("looked", None)
        if looked is not None:
            self._count_looked(looked)
        inline = self._inline.get(message.op)
        if inline is not None:
            try:
                result = inline(peer, message)
            except Exception as exc:
                self._refuse(peer, message, exc)
                return
            if result is not None:
                peer.reply(message.rid, *result)
            return
        waiting = self._waiting.get(message.op)
        if waiting is None:
            peer.error(message.rid, PoolError(f"unknown request {message.op} (a newer client?)"))
            return
        peer.spawn(self._run(peer, message, waiting))

    async def _run(self, peer: _Peer, message: Message, handler: Callable[[_Peer, Message], Awaitable[Reply]]) -> None:
        try:
            result = await handler(peer, message)
        except Exception as exc:
            self._refuse(peer, message, exc)
            return
        peer.reply(message.rid, *result)

    def _refuse(self, peer: _Peer, message: Message, exc: Exception) -> None:
        if not isinstance(exc, ValueError | TypeError | KeyError | PoolError | OutOfSlots | WouldBlock):
            if not isinstance(exc, FillError | TierClosedError):
                log.error("aiokvtier: the pool failed a request (op %d) of process %d", message.op, peer.pid)
                log.exception(exc)
        peer.error(message.rid, exc)

    @staticmethod
    def _count(message: Message) -> int:
        n = message.fields.get("n")
        if type(n) is not int or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        return n

    async def _alloc(self, peer: _Peer, message: Message) -> Reply:
        n = self._count(message)
        tier = self._tier
        if not message.fields.get("wait", True) and tier.slots_ready < n:
            raise WouldBlock(f"{n} slots asked for, {tier.slots_ready} resident and free")
        ids = await tier.allocate_ids(n)
        peer.slots.update(ids.tolist())  # in the step that took them: a cancellation cannot come between
        return {}, [ids.tobytes()]

    def _free(self, peer: _Peer, message: Message) -> Reply:
        if len(message.parts) != 1:
            raise ValueError(f"a FREE carries the slot ids to free as one part, not {len(message.parts)}")
        ids = message.ints(0).tolist()
        if len(set(ids)) != len(ids):
            raise SlotError("a slot appears twice in one free; nothing was freed")
        for slot in ids:
            if slot not in peer.slots:
                raise SlotError(f"slot {slot} is not allocated by this process; nothing was freed")
        self._tier.free_many(ids)
        peer.slots.difference_update(ids)
        return {}, []

    def _stats(self, peer: _Peer, message: Message) -> Reply:
        s = self.statistics()
        return {"stats": dataclasses.asdict(s)}, []

    def _keys(self, message: Message, first: int = 0) -> list[_wire.Key]:
        return decode_keys(
            message.fields.get("k"), message.parts[first : first + (1 if message.fields.get("k") == "i" else 2)]
        )

    def _lookup(self, peer: _Peer, message: Message) -> Reply:
        kind = message.fields.get("k")
        parts = message.parts[: 1 if kind == "i" else 2]
        hits = self._index.lookup(decode_keys(kind, parts))
        self._index.counts["owner_lookups"] += 1  # after the keys decoded: a refused request is not one
        return {"hits": hits}, []

    def _contains(self, peer: _Peer, message: Message) -> Reply:
        """Per key, whether it is stored: for a process whose mirror cannot answer. Not a lookup: nothing is
        touched or counted."""
        return {}, [self._index.present(self._keys(message)).view(np.uint8).tobytes()]

    async def _begin(self, peer: _Peer, message: Message) -> Reply:
        kind = message.fields.get("k")
        first = 1 if kind == "i" else 2
        keys, matrix = decode_key_matrix(kind, message.parts[:first])
        if len(message.parts) != first + 1:  # else the keys' own bytes would be read as their lengths
            raise ValueError(f"a BEGIN carries its keys, then their lengths as one part: {len(message.parts)} parts")
        lengths = message.uints(first).astype(np.int64)
        if len(lengths) != len(keys):
            raise ValueError(f"{len(keys)} keys and {len(lengths)} lengths")
        slot_size = self._tier.slot_size
        if lengths.size and not (0 < int(lengths.min()) and int(lengths.max()) <= slot_size):
            raise ValueError(f"a block is 1 to {slot_size} bytes (the slot size); nothing changed")
        wait = bool(message.fields.get("wait", True))
        index, tier = self._index, self._tier
        for _ in range(8):  # another process may take the room while this one waits for the fill
            outcomes = index.classify(keys)
            wanted = int(np.count_nonzero(outcomes == CLAIMED))
            short = wanted - tier.slots_free
            if short > 0:
                evicted, freed = index.evict(short, keys)
                self._free_slots(freed)
                self._event("evicted", evicted)
            room = tier.slots_free if wait else min(tier.slots_free, tier.slots_ready)
            outcomes = index.cut(outcomes, room)
            claimed = np.flatnonzero(outcomes == CLAIMED)
            slots = np.full(len(keys), -1, dtype=np.int64)
            claim = 0
            if claimed.size:
                if claimed.size == len(keys):
                    mine, rows = keys, matrix
                else:
                    mine = [keys[i] for i in claimed.tolist()]
                    rows = None if matrix is None else (matrix[0][claimed], matrix[1][claimed])
                claim = index.claim(mine, lengths[claimed], _KINDS.get(kind), rows)
                peer.claims.add(claim)
                try:
                    ids = await tier.allocate_ids(claimed.size)
                except OutOfSlots:
                    peer.claims.discard(claim)
                    index.abort(claim)
                    self._claim_done(claim)
                    continue
                except BaseException:
                    peer.claims.discard(claim)
                    index.abort(claim)
                    self._claim_done(claim)
                    raise
                if claim not in peer.claims:
                    # Aborted while it waited (a process may name a claim before its BEGIN answers: ids are
                    # small ints): the slots it came for would be held by nobody.
                    self._free_slots(ids)
                    raise PoolError(
                        f"the store of claim {claim} was aborted while it waited for slots; nothing was stored"
                    )
                index.place(claim, ids)
                slots[claimed] = ids
            self._count_outcomes(outcomes)
            return {"claim": claim}, [outcomes.tobytes(), slots.tobytes()]
        outcomes = index.cut(index.classify(keys), 0)
        self._count_outcomes(outcomes)
        return {"claim": 0}, [outcomes.tobytes(), np.full(len(keys), -1, dtype=np.int64).tobytes()]

    def _count_outcomes(self, outcomes: npt.NDArray[np.uint8]) -> None:
        counts = self._index.counts
        counts["present"] += int(np.count_nonzero(outcomes == PRESENT))
        counts["skipped"] += int(np.count_nonzero(outcomes == SKIPPED))

    def _claim_of(self, peer: _Peer, message: Message) -> int:
        claim = message.fields.get("claim")
        if type(claim) is not int or claim not in peer.claims:
            raise PoolError(f"no store in flight with claim {claim!r} for this process")
        return claim

    def _commit(self, peer: _Peer, message: Message) -> Reply:
        claim = self._claim_of(peer, message)
        if not self._index.placed(claim):
            raise PoolError(
                f"the store of claim {claim} is still waiting for its slots: commit it once its BEGIN answered"
            )
        self._event("stored", self._index.commit(claim))
        peer.claims.discard(claim)
        self._claim_done(claim)
        return {}, []

    def _abort(self, peer: _Peer, message: Message) -> None:
        claim = message.fields.get("claim")
        if type(claim) is int and claim in peer.claims:
            peer.claims.discard(claim)
            self._free_slots(self._index.abort(claim))
            self._claim_done(claim)

    def _claim_done(self, claim: int) -> None:
        for future in self._claim_waiters.pop(claim, ()):
            if not future.done():
                future.set_result(None)

    async def _await(self, peer: _Peer, message: Message) -> Reply:
        keys = self._keys(message)
        while True:
            claims = self._index.claims_storing(keys)
            if not claims:
                return {}, []
            future: asyncio.Future[None] = self._loop.create_future()
            self._claim_waiters.setdefault(next(iter(claims)), []).append(future)
            await future

    def _load(self, peer: _Peer, message: Message) -> Reply:
        pin, slots, lengths = self._index.pin(self._keys(message))
        peer.pins.add(pin)
        return {"pin": pin}, [slots.tobytes(), lengths.astype(np.uint64).tobytes()]

    def _unpin(self, peer: _Peer, message: Message) -> None:
        pin = message.fields.get("pin")
        if type(pin) is int and pin in peer.pins:
            peer.pins.discard(pin)
            self._free_slots(self._index.unpin(pin, loaded=message.fields.get("loaded") is True))

    def _discard(self, peer: _Peer, message: Message) -> Reply:
        dropped, freed = self._index.discard(self._keys(message))
        self._free_slots(freed)
        self._event("discarded", dropped)
        return {"dropped": len(dropped)}, []

    def _looked(self, peer: _Peer, message: Message) -> None:
        """Lookups a process answered from the index mirror: their counts, and the reads it did over
        (no reply)."""
        self._count_looked(message.fields)

    def _count_looked(self, fields: object) -> None:
        """Count a process's lookups answered from the mirror (``LOOKED``'s fields, or any request's
        ``"looked"``); malformed figures are ignored."""
        if not isinstance(fields, dict):
            return
        figures = [fields.get(name, 0) for name in ("q", "h", "m", "r")]
        if all(type(x) is int and 0 <= x < 1 << 62 for x in figures):
            c = self._index.counts
            for name, x in zip(("queries", "hits", "misses", "mirror_retries"), figures, strict=True):
                c[name] += x

    def _subscribe(self, peer: _Peer, message: Message) -> Reply:
        peer.subscribed = True
        return {}, []

    def _event(self, kind: str, keys: list[_wire.Key]) -> None:
        """Push an event of the shared store to every process that subscribed."""
        if not keys:
            return
        subscribed = [s for s in self._peers if s.subscribed]
        if not subscribed:
            return
        form, parts = encode_keys(keys)
        frame = encode(_wire.EVENT, 0, {"kind": kind, "k": form}, parts)
        for peer in subscribed:
            if peer.writer.transport.get_write_buffer_size() > EVENTS_BUFFERED:
                peer.dropped += 1
            elif peer.dropped:
                peer.send(encode(_wire.EVENT, 0, {"kind": kind, "k": form, "dropped": peer.dropped}, parts))
                peer.dropped = 0
            else:
                peer.send(frame)


def _require(ok: object, broken: str) -> None:
    if not ok:
        raise AssertionError(f"pool invariant broken: {broken}")
