"""AttachedPool: a process's view of a pool another process owns.

Attaching connects to the owner's socket, receives the tier's memfd and
the index mirror's (SCM_RIGHTS) and maps them shared: the same pages, at an
address of this process. ``lookup`` reads the mirror here
(``aiokvtier._pool._mirror``: no round trip; the owner is asked only when
the mirror cannot answer at once). Everything else is asked of the owner
over the socket: slots (``allocate``, ``free``), the claims and pins behind
``store`` and ``load``, ``discard`` and ``statistics()``. The
bytes never cross the socket: a store copies into the slots the owner
claimed for it, a load copies out of the slots it pinned, on this
process's own ``aiokvtier-attached`` thread.

The owner pushes its watermark at every change; ``wait_resident`` waits
for those pushes. When the connection ends (the owner closed or died) every
pending and later call raises ``PoolLostError``; the mapping stays valid
memory until ``aclose()`` (the memfd lives as long as a mapping of it).

A seam for GPU use: a process that copies with its own ``CopyEngine``
would register the mapping with its CUDA context unit by unit as the
pushed watermark passes each unit (``_on_resident``); host mode has nothing
to do there.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import operator
import os
import socket
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, cast, overload

import numpy as np
import numpy.typing as npt

from .. import _regions
from .._copy._requests import integers, refuse_closed, stream_handle
from .._errors import CopyPlanError, FillError, PoolError, PoolLostError, SlotError
from .._host import _linux
from .._host._rows import SMALL_ROW, memmove_all, rows_from_slots, rows_into_slots, runs
from .._host._shared import map_shared, unmap_shared
from .._host._slots import positive_count
from .._host._statistics import TierStatistics
from .._host._views import ViewLedger
from .._lifecycle import Lifecycle, Owner, finish
from .._regions import I64, U64, InflightCopies, epoch
from .._store._result import StoreResult
from .._store._transfers import Pages, copy_tracked, host_pages, located_pages
from . import _wire
from ._events import EventFanout, PoolEvents
from ._gpu import Registrations
from ._mirror import USABLE, IndexMirror, Keys, Looked
from ._socket import connect, recv_frame_with_fds
from ._statistics import PoolStatistics
from ._wire import (
    BUSY,
    CLAIMED,
    PRESENT,
    SKIPPED,
    Key,
    Message,
    as_key,
    decode,
    decode_keys,
    encode,
    encode_keys,
    error_from,
)

if TYPE_CHECKING:
    from .._copy._engine import CopyEngine

__all__ = ["AttachedPool"]

log = logging.getLogger("aiokvtier")

ATTACH_TIMEOUT = 30.0
"""Seconds an attach waits for the owner's welcome (it answers at once unless it is stuck)."""
PREFAULT_CHUNK = 64 << 20
"""Bytes one prefault job maps in: copies queued on the worker wait behind one chunk at most."""
READ_WAIT = 10.0
"""Seconds ``aclose`` waits for lookups reading the index mirror on other threads (a read takes milliseconds:
this bounds only a thread stopped mid-read, say by an exception raised in it from outside)."""
TELL_AFTER = 0.05
"""Seconds the counts of lookups answered on other threads wait to go to the owner, in one message: a
message per call woke this process's loop and the owner at each of SGLang's calls (a call of 128 keys took
0.2 ms instead of 0.09 on the development VM)."""


class AttachedPool(Owner):
    """A pool served by another process (or by this one), attached: its tier and its shared block store.

    ``pool = await AttachedPool.attach(path)`` or ``async with AttachedPool(path) as pool:``.
    Slots come from the owner's allocator (``allocate`` waits only for the
    unit it needs, as ``HostTier.allocate``); ``address`` and ``view`` give
    this process's address of a slot it holds. ``store``, ``load``,
    ``lookup`` and ``discard`` act on the store every attached process
    shares, with ``BlockStore``'s rules: a key stored by any process is
    found by all; a load pins its blocks (never evicted under it); a store
    of a key another process is storing waits for it and reports it
    present.

    Threads: the event loop that attached. Cancellation: a cancelled
    ``allocate`` takes no slot, a cancelled ``store`` leaves nothing
    visible and no slot taken, a cancelled ``load`` returns once nothing
    reads the caller's pages any more. When this process exits or is killed
    the owner takes back everything it held.

    GPU copies: attached with ``device=N``, the process registers the shared
    memory with its own CUDA context, unit by unit as the watermark passes
    them (``wait_resident`` and ``allocate`` then also wait for this
    process's registration of what they return), and the pool becomes a copy
    region of this process: ``CopyEngine.copy()`` with slot addresses
    (``address()``) moves pages at the rate of registered memory, and
    ``aclose()`` waits for such copies in flight before it unregisters and
    unmaps. A shrink's lower fill target, pushed by the owner, refuses copies
    past it at once and unregisters the units it handed back before a regrow
    registers the new pages (``registered_bytes``).

    Prefaulting: the owner's fill made the pages resident, but this process
    maps each on its first touch (a page fault per 4 KiB: a first copy of 64
    MiB took 4x a later one on the development VM). With ``prefault=True``
    the worker maps the resident units in ahead of use, 64 MiB a job between
    copies, never past the owner's fill target, and never writing a byte
    (``MADV_POPULATE_WRITE``; nothing on a kernel before 5.14). It costs this
    process page tables for the whole pool (about 2 MiB per GiB) and some CPU
    while the pool fills. With ``device=`` the registration maps the pages
    in already.

    :param path: the pool's socket.
    :param device: a CUDA ordinal to register the memory for, or None (host copies only).
    :param prefault: map the resident memory in ahead of its first touch (host copies).
    """

    def __init__(self, path: str | os.PathLike[str], *, device: int | None = None, prefault: bool = False) -> None:
        if device is not None and (type(device) is not int or device < 0):
            raise ValueError(f"device must be a CUDA ordinal or None, got {device!r}")
        if type(prefault) is not bool:
            raise TypeError(f"prefault must be a bool, not {type(prefault).__name__}")
        self._prefault = prefault and device is None
        self._prefaulted = 0
        self._prefaulting = False
        self._device = device
        self._gpu: Registrations | None = None
        self._registered = 0
        self._registering = False
        self._unregistering = 0
        """Shrinks whose units are being unregistered here (the bound stays down until none is)."""
        self._copies = InflightCopies()
        self._path = os.fspath(path)
        self._life = Lifecycle("AttachedPool", "aiokvtier-attached")
        self._rids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future[Message], str]] = {}
        """Requests awaiting their answer: the caller's future, and what to undo if the caller gave up."""
        self._orphans: dict[int, str] = {}
        """Requests whose caller gave up: what to undo when their reply comes (``"free"``, ``"abort"``, ``"unpin"``)."""
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._lost: str | None = None
        self._mine: set[int] = set()
        self._resident = 0
        self._quota = 0
        self._target = 0
        self._slots_total = 0
        self._fill_error: str | None = None
        self._events = EventFanout()
        self._subscribed = False
        self._mirror: IndexMirror | None = None
        self._looked: collections.deque[Looked] = collections.deque()
        """Each lookup read from the mirror and not yet told to the owner: ``(answers, hits, misses, reads
        done over)`` (appended from any thread: a deque's appends and pops need no lock)."""
        self._telling = False

    @classmethod
    async def attach(
        cls, path: str | os.PathLike[str], *, device: int | None = None, prefault: bool = False
    ) -> AttachedPool:
        """Connect to the pool at ``path`` and map its memory.

        :raises PoolError: no socket there, permission denied (the message
            names the socket's mode and owner), the owner refused or is gone,
            it speaks another protocol version, or what is at ``path`` is not
            a pool (a file, a directory, another program's socket, or one that
            does not answer within 30 s).
        :raises OSError: the memory cannot be mapped here.
        :raises CudaUnavailableError: ``device`` was given without a usable driver.
        :raises CudaError: ``device`` was given and the driver refused to make what is resident
            GPU-usable in this process.
        """
        pool = cls(path, device=device, prefault=prefault)
        await pool.__aenter__()
        return pool

    async def _build(self) -> None:
        life = self._life
        self._loop = asyncio.get_running_loop()
        sock = await connect(self._path)
        try:
            welcome, fds = await self._handshake(sock)
            if welcome.op == _wire.ERROR:
                raise error_from(welcome)
            index = welcome.fields.get("index")
            wanted = 1 if index is None else 2
            if welcome.op != _wire.WELCOME or len(fds) != wanted:
                for fd in fds:
                    os.close(fd)
                raise PoolError(f"{self._path} is not an aiokvtier pool (no memory came with its answer)")
            if index is not None:
                try:
                    if not isinstance(index, dict) or type(index.get("slots")) is not int:
                        os.close(fds[1])
                        raise PoolError(f"the pool at {self._path} sent a malformed layout of its index mirror")
                    if USABLE:
                        try:  # takes the descriptor
                            self._mirror = await life.run(IndexMirror.attach, fds[1], index["slots"])
                        except ValueError as exc:
                            raise PoolError(f"the pool at {self._path}: {exc}") from None
                        life.undo.callback(self._mirror.close)
                    else:  # the seqlock's reads are not sound on this architecture: lookups ask the owner
                        os.close(fds[1])
                except BaseException:
                    os.close(fds[0])
                    raise
            fields = welcome.fields
            self._pool_id = str(fields["pool"])
            self._owner_pid = int(fields["owner"])
            self._size = int(fields["size"])
            self._slot_size = int(fields["slot_size"])
            self._commit_unit = int(fields["commit_unit"])
            self._config: dict[str, Any] = dict(fields["config"])
            try:
                self._base = await life.run(map_shared, fds[0], self._size)
            finally:
                os.close(fds[0])  # the mapping keeps the memory
            self._views = ViewLedger(self._slot_size)
            life.undo.callback(life.release_when_unviewed, self._views.defer_until_empty, self._unmap)
            if self._device is not None:
                self._gpu = await life.run(
                    Registrations, self._device, self._base, self._size, self._slot_size, self._commit_unit
                )
                life.undo.callback(self._gpu.release)  # runs before the unmap (the undo stack is LIFO)
                _regions.register(self)
                life.undo.callback(_regions.unregister, self)
            reader, self._writer = await asyncio.open_unix_connection(sock=sock)
        except BaseException:
            sock.close()
            raise
        self._reader_task = asyncio.ensure_future(self._read(reader))
        # The owner pushes its state right after the welcome: wait for it, so figures are known at return.
        if not self._quota:
            future: asyncio.Future[None] = self._loop.create_future()
            self._waiters.append((0, future))
            await future
            self._raise_if_lost()

    async def _handshake(self, sock: socket.socket) -> tuple[Message, list[int]]:
        """Say hello; the owner's answer and the descriptors that came with it.

        :raises PoolError: what answers at the path is not a pool (it hung up, or spoke something else),
            or it did not answer within ``ATTACH_TIMEOUT``.
        """
        not_a_pool = f"{self._path} is not an aiokvtier pool, or not one of this version"
        try:
            await self._loop.sock_sendall(sock, encode(_wire.HELLO, 0, {"v": _wire.VERSION, "pid": os.getpid()}))
            async with asyncio.timeout(ATTACH_TIMEOUT):
                payload, fds = await recv_frame_with_fds(sock, 2)
        except TimeoutError:
            raise PoolError(
                f"{self._path} did not answer within {ATTACH_TIMEOUT:g} s: is it an aiokvtier pool, "
                "and is its owner's event loop running?"
            ) from None
        except ConnectionError:  # an owner answers a hello it refuses before it hangs up
            raise PoolError(f"{not_a_pool}: it hung up on the handshake") from None
        except ValueError as exc:
            raise PoolError(f"{not_a_pool}: its answer is not the pool protocol ({exc})") from None
        try:
            return decode(payload), fds
        except ValueError as exc:
            for fd in fds:
                os.close(fd)
            raise PoolError(f"{not_a_pool}: its answer is not the pool protocol ({exc})") from None

    def _unmap(self) -> None:
        unmap_shared(self._base, self._size)

    async def _teardown(self) -> None:
        if self._gpu is not None and self._life.worker is not None:
            await self._life.run(InflightCopies.wait, self._copies.snapshot())  # the GPU lets go first
        mirror = self._mirror
        if mirror is not None:
            # No lookup starts reading now; those reading on other threads record their counts as they end,
            # and the mapping goes with the last (a read is short): then every answer given is counted.
            mirror.close()
            if not await self._life.run(mirror.wait_unmapped, READ_WAIT):
                log.warning(
                    "aiokvtier: a lookup on another thread still reads the pool's index mirror after %.0f s; "
                    "closing without it (the mapping goes when it ends, its count is not told)",
                    READ_WAIT,
                )
        writer = self.__dict__.get("_writer")
        if writer is not None:
            self._tell_looked()  # the last lookups' counts go before the connection ends
            writer.close()
        task: asyncio.Task[None] | None = self.__dict__.get("_reader_task")
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._lose("this AttachedPool was closed", closed=True)
        await self._life.run_undo()

    async def aclose(self) -> None:
        """Detach: the owner takes back every slot, store and pin this process holds; unmaps the memory
        (once no view of it is left). Idempotent."""
        await self._life.close(self._teardown)

    # -- the connection -----------------------------------------------------------------

    async def _read(self, reader: asyncio.StreamReader) -> None:
        reason = "the pool's owner went away (the connection closed)"
        try:
            while True:
                head = await reader.readexactly(_wire.LENGTH.size)
                (size,) = _wire.LENGTH.unpack(head)
                message = decode(await reader.readexactly(size))
                if message.op == _wire.STATE:
                    self._on_state(message.fields)
                elif message.op == _wire.BYE:
                    reason = str(message.fields.get("reason", reason))
                elif message.op == _wire.EVENT:
                    keys = decode_keys(message.fields.get("k"), message.parts)
                    dropped = message.fields.get("dropped", 0)  # events the owner did not send, unread
                    self._events.publish(message.fields["kind"], tuple(keys), dropped if type(dropped) is int else 0)
                else:
                    self._on_reply(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except ValueError as exc:
            reason = f"the pool's owner broke the protocol: {exc}"
        finally:
            closing = self._life.closed  # our own aclose ended the connection
            self._lose(f"{reason}: pool at {self._path}, owner pid {self.__dict__.get('_owner_pid')}", closing)

    def _lose(self, reason: str, closed: bool = False) -> None:
        if self._lost is not None:
            return
        self._lost = reason
        if not closed:
            log.warning("aiokvtier: %s", reason)
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(PoolLostError(reason))
        self._pending.clear()
        self._events.end()
        self._wake_all()

    def _raise_if_lost(self) -> None:
        if self._lost is not None:
            raise PoolLostError(self._lost)

    def _on_state(self, fields: dict[str, Any]) -> None:
        self._resident = int(fields["resident"])
        self._quota = int(fields["quota"])
        self._target = int(fields["target"])
        self._slots_total = int(fields["slots"])
        self._fill_error = fields.get("error")
        gpu = self._gpu
        if gpu is not None:
            # A lower fill target is a shrink the owner has made (it punched the units out): copies
            # past it are refused from now on, and the units past it are unregistered here, since
            # they pin the old pages. The bound stays down until that is done, through any grow
            # pushed meanwhile: until then a copy there would reach the old pages, not the file's.
            if self._target < gpu.bound and gpu.end > self._target and not self._life.closed:
                gpu.bound = self._target
                self._registered = min(self._registered, self._target)
                self._unregistering += 1
                self._life.submit(gpu.shrink).add_done_callback(self._unregistered)
            elif self._unregistering:
                gpu.bound = min(gpu.bound, self._target)
            else:
                gpu.bound = self._target
        self._prefaulted = min(self._prefaulted, self._target)  # a shrink punched the rest out
        self._on_resident(self._resident)
        self._wake_all()

    def _on_resident(self, end: int) -> None:
        """The watermark reached ``end``: a GPU-attached process registers the new units (on its worker)."""
        gpu = self._gpu
        if gpu is None:
            self._prefault_to(end)
            return
        if self._registering or gpu.end >= gpu.reachable(end) or self._life.closed:
            return
        self._registering = True
        future = self._life.submit(gpu.extend, end)
        future.add_done_callback(self._extended_to)

    def _prefault_to(self, end: int) -> None:
        """With ``prefault``: map the next resident chunk in below ``end`` (one worker job at a time)."""
        end = min(end, self._target, self._size)
        start = self._prefaulted
        if not self._prefault or self._prefaulting or start >= end or self._life.closed:
            return
        stop = min(end, start + PREFAULT_CHUNK)
        self._prefaulting = True
        future = self._life.submit(_linux.map_in, self._base + start, stop - start)
        future.add_done_callback(partial(self._prefaulted_to, stop))

    def _prefaulted_to(self, stop: int, future: asyncio.Future[bool]) -> None:
        self._prefaulting = False
        if future.cancelled():
            return
        error = future.exception()
        if error is not None or not future.result():
            self._prefault = False  # the pages map on first touch, as without prefault
            if error is not None:
                log.warning("aiokvtier: mapping the pool's memory in ahead of use failed: %s", error)
            return
        self._prefaulted = min(stop, self._target)
        self._prefault_to(self._resident)

    def _unregistered(self, future: asyncio.Future[int]) -> None:
        """A shrink's units were unregistered here: the bound follows the owner's target again."""
        self._unregistering -= 1
        if not self._unregistering and self._gpu is not None:
            self._gpu.bound = self._target
        if self._registered_to(future):
            self._on_resident(self._resident)

    def _extended_to(self, future: asyncio.Future[int]) -> None:
        self._registering = False
        if self._registered_to(future):
            self._on_resident(self._resident)  # the watermark moved on meanwhile

    def _registered_to(self, future: asyncio.Future[int]) -> bool:
        """A registration job ended (the worker runs them in turn): what is registered, or why not."""
        if future.cancelled():
            return False
        error = future.exception()
        assert self._gpu is not None
        self._registered = self._gpu.end
        if error is not None:
            self._fill_error = f"registering the shared memory with device {self._device} failed: {error}"
            log.warning("aiokvtier: %s", self._fill_error)
        self._wake_all()
        return error is None

    def _usable(self) -> int:
        """What this process may copy: resident, and registered here when attached to a device."""
        gpu = self._gpu
        return self._resident if gpu is None else min(self._resident, self._registered, gpu.bound, gpu.ceiling)

    def _wake_all(self) -> None:
        waiters, self._waiters = self._waiters, []
        for _, future in waiters:
            if not future.done():
                future.set_result(None)

    def _on_reply(self, message: Message) -> None:
        pending = self._pending.pop(message.rid, None)
        if pending is not None:
            future, undo = pending
            if not future.done():
                future.set_result(message)
            elif undo:  # the caller was cancelled and has not run since: it can no longer see this answer
                self._undo(undo, message)
            return
        orphan = self._orphans.pop(message.rid, None)
        if orphan is not None:
            self._undo(orphan, message)

    def _undo(self, undo: str, message: Message) -> None:
        """The caller was cancelled after its request left: give back what the owner gave it."""
        if message.op != _wire.REPLY:
            return
        if undo == "free":
            self._post(_wire.FREE, {}, [message.parts[0]], expect_reply=True)
        elif undo == "abort" and message.fields.get("claim"):
            self._post(_wire.ABORT, {"claim": message.fields["claim"]})
        elif undo == "unpin":
            self._post(_wire.UNPIN, {"pin": message.fields["pin"]})

    def _post(self, op: int, fields: dict[str, Any], parts: Sequence[bytes] = (), expect_reply: bool = False) -> int:
        """Send without waiting for an answer (ordered after everything sent before)."""
        rid = next(self._rids)
        frame = encode(op, rid, fields, parts, request=True)
        if expect_reply:
            self._orphans[rid] = ""
        if self._lost is None:
            try:
                self._write(frame)
            except PoolLostError:
                pass  # nothing to wait for: the reader ends the connection's calls as it meets the close
        return rid

    def _write(self, frame: bytes) -> None:
        """Send ``frame`` on the connection.

        :raises PoolLostError: the owner closed the connection and the reader has not met the close
            yet (uvloop raises ``RuntimeError`` on a write to a closed transport; asyncio drops it).
        """
        try:
            self._writer.write(frame)
        except RuntimeError as exc:
            raise PoolLostError(f"the connection to the pool's owner closed: pool at {self._path}") from exc

    def _check_loop(self) -> None:
        """:raises RuntimeError: the running loop is not the one that attached (never attached: no check)."""
        loop = self.__dict__.get("_loop")
        if loop is not None and asyncio.get_running_loop() is not loop:
            raise RuntimeError("this AttachedPool belongs to the event loop that attached it; call it from that loop")

    async def _request(
        self, op: int, fields: dict[str, Any] | None = None, parts: Sequence[bytes] = (), undo: str = ""
    ) -> Message:
        """Send a request and await its answer.

        :raises PoolLostError: the owner went away.
        :raises Exception: what the owner refused it with.
        """
        self._check_open()
        self._raise_if_lost()
        # The mirror's lookup counts are told with this request (a frame less), so before its work: one
        # connection is one order.
        looked = self._counts_looked() if self._looked else None
        rid = next(self._rids)
        try:
            # Refused here, before anything is sent: the owner drops a process whose frame is too large.
            frame = encode(
                op, rid, fields if looked is None else {**(fields or {}), "looked": looked}, parts, request=True
            )
        except ValueError:
            try:
                frame = encode(op, rid, fields, parts, request=True)
            except ValueError:
                if looked is not None:  # told with the next request
                    self._looked.appendleft((looked["q"], looked["h"], looked["m"], looked["r"]))
                raise
            assert looked is not None
            self._post(_wire.LOOKED, looked)  # the counts took the last of the room: in a frame of their own
        future: asyncio.Future[Message] = self._loop.create_future()
        self._write(frame)
        self._pending[rid] = (future, undo)
        try:
            message = await future
        except asyncio.CancelledError:
            if self._pending.pop(rid, None) is not None:
                if undo:
                    self._orphans[rid] = undo
            elif undo and future.done() and not future.cancelled() and future.exception() is None:
                self._undo(undo, future.result())  # answered, but the caller was cancelled before it resumed
            raise
        if message.op == _wire.ERROR:
            raise error_from(message)
        return message

    # -- the tier -----------------------------------------------------------------------

    @property
    def path(self) -> str:
        return self._path

    @property
    def owner_pid(self) -> int:
        return self._owner_pid

    @property
    def slot_size(self) -> int:
        return self._slot_size

    @property
    def max_quota(self) -> int:
        return self._size

    @property
    def quota(self) -> int:
        """The shared tier's quota, as last pushed by the owner."""
        return self._quota

    @property
    def slots_total(self) -> int:
        return self._slots_total

    @property
    def resident_bytes(self) -> int:
        """The shared watermark, as last pushed by the owner."""
        return self._resident

    @property
    def prefaulted_bytes(self) -> int:
        """Bytes of the shared tier mapped in ahead of use (``prefault=True``), from its start."""
        return self._prefaulted

    @property
    def registered_bytes(self) -> int:
        """Bytes of the shared tier this process has registered with its GPU (0 without ``device=``):
        the owner's units the watermark passed, less those a shrink handed back."""
        return 0 if self._gpu is None else self._gpu.end

    @property
    def base_address(self) -> int:
        """Where the shared tier is mapped in this process (another process maps it elsewhere)."""
        self._check_open()
        return self._base

    @property
    def config(self) -> dict[str, Any]:
        """The owner's tier config, as JSON-able fields."""
        return dict(self._config)

    @overload
    async def allocate(self) -> int: ...
    @overload
    async def allocate(self, n: int) -> list[int]: ...
    async def allocate(self, n: int | None = None) -> int | list[int]:
        """Allocate one slot (``allocate()``) or ``n`` slots from the shared tier.

        Waits only for the unit holding the highest fresh slot it takes (the owner's fill).

        :raises OutOfSlots: the shared quota does not have that many free.
        :raises FillError: the fill failed below those slots.
        :raises PoolLostError: the owner went away.

        Cancellation: a cancelled call holds no slot (one the owner gave
        meanwhile is given back).
        """
        ids = await self.allocate_ids(1 if n is None else positive_count(n, "n"))
        if n is None:
            return int(ids[0])
        taken: list[int] = ids.tolist()
        return taken

    async def allocate_ids(self, n: int, *, wait: bool = True) -> npt.NDArray[np.int64]:
        """``allocate(n)`` as an int64 array; ``wait=False`` raises ``WouldBlock`` rather than wait for the fill.

        :raises WouldBlock: ``wait=False`` and fewer than ``n`` slots are resident and free.
        :raises TypeError: ``wait`` is not a bool.
        """
        self._check_loop()
        n = positive_count(n, "n")
        if type(wait) is not bool:
            raise TypeError(f"wait must be a bool, not {type(wait).__name__}")
        reply = await self._request(_wire.ALLOC, {"n": n, "wait": wait}, undo="free")
        ids = reply.ints(0).copy()
        self._mine.update(ids.tolist())
        if self._gpu is not None and ids.size:
            end = (int(ids.max()) + 1) * self._slot_size
            try:
                await self.wait_resident(min(end, self._quota))  # registered here too
            except BaseException:
                await asyncio.shield(self.free_many(ids.tolist()))
                raise
        return ids

    async def free(self, slot: int) -> None:
        """Give a slot back to the shared tier.

        :raises SlotError: this process does not hold that slot (nothing changes).
        :raises PoolLostError: the owner went away.
        """
        self._check_loop()
        await self.free_many([slot])

    async def free_many(self, slots: Iterable[int]) -> None:
        """Give several slots back, all or none.

        :raises SlotError: one is not held by this process, or repeated.
        """
        self._check_loop()
        self._check_open()
        held = [self._held(slot, "; nothing was freed") for slot in slots]
        if len(set(held)) != len(held):
            raise SlotError("a slot appears twice in one free; nothing was freed")
        ids = np.array(held, dtype=np.int64)
        request = self._request(_wire.FREE, {}, [ids.tobytes()])
        # Once the request has left, the owner frees them (a cancelled caller included): let go of them here
        # now, and take them back only if the request never left or the owner refused it (it freed nothing).
        self._mine.difference_update(ids.tolist())
        try:
            await request
        except asyncio.CancelledError:
            raise
        except BaseException:
            if self._lost is None:
                self._mine.update(ids.tolist())
            raise

    def address(self, slot: int) -> int:
        """This process's address of a slot it holds.

        :raises SlotError: not allocated by this process.
        """
        self._check_open()
        return self._base + self._held(slot) * self._slot_size

    def _held(self, slot: object, then: str = "") -> int:
        """``slot`` as an int, a slot this process holds (an integer, not a bool or a float).

        :raises SlotError: not a slot id, or not allocated by this process.
        """
        if isinstance(slot, bool) or not isinstance(slot, int | np.integer):
            raise SlotError(f"slot {slot!r} is not a slot id (an integer){then}")
        if int(slot) not in self._mine:
            raise SlotError(f"slot {slot} is not allocated by this process{then}")
        return int(slot)

    def view(self, slot: int) -> memoryview:
        """A writable ``slot_size``-byte view of a slot this process holds (``aclose`` unmaps only once
        every view is released).

        :raises SlotError: not allocated by this process.
        """
        address = self.address(slot)
        return self._views.view(int(slot), address)

    async def wait_resident(self, nbytes: int | None = None) -> None:
        """Wait until the shared watermark reaches ``nbytes`` (None: the whole quota), from the owner's pushes.

        :raises TypeError: ``nbytes`` is not an integer (a bool, a float, a string).
        :raises ValueError: ``nbytes`` is negative or past the quota.
        :raises FillError: the fill failed below ``nbytes``.
        :raises PoolLostError: the owner went away.
        """
        self._check_loop()
        self._check_open()
        if nbytes is not None:
            if isinstance(nbytes, bool):
                raise TypeError(f"nbytes must be an integer, not a bool ({nbytes!r})")
            try:
                nbytes = operator.index(nbytes)
            except TypeError:
                raise TypeError(f"nbytes must be an integer or None, got {nbytes!r}") from None
        while True:
            self._raise_if_lost()
            need = self._quota if nbytes is None else nbytes
            if need > self._quota or need < 0:
                raise ValueError(f"nbytes ({need}) must be between 0 and the quota ({self._quota})")
            if self._usable() >= need:
                return
            if self._fill_error is not None:
                raise FillError(
                    f"the shared tier's fill failed at {self._resident} bytes: {self._fill_error}",
                    resident_bytes=self._resident,
                    failed_offset=self._resident,
                )
            future: asyncio.Future[None] = self._loop.create_future()
            self._waiters.append((need, future))
            await future

    # -- a copy region (attached with a device) --------------------------------------------

    @property
    def region_name(self) -> str:
        return f"the pool at {self._path}"

    @property
    def closed(self) -> bool:
        return self._life.closed

    @property
    def lost(self) -> str | None:
        """Why every call now raises ``PoolLostError`` (the owner closed the pool or went away, or this
        process closed it), or None while the owner serves this process. Any thread."""
        return self._lost

    @property
    def copies(self) -> InflightCopies:
        return self._copies

    def region_bounds(self) -> tuple[int, int]:
        return self._base, self._size

    def registrations_of(self, offsets: U64, nbytes: U64) -> I64:
        """The commit unit of each span (each is one registration in this process).

        :raises CopyPlanError: the pool is closing, or a span crosses two units or leaves what this
            process has registered.
        """
        if self._life.state != "open" or self._gpu is None:
            raise CopyPlanError(f"{self.region_name} is {self._life.state}")
        units, bad = self._gpu.units_of(offsets, nbytes)
        if bad >= 0:
            raise CopyPlanError(
                f"copy of {int(nbytes[bad])} bytes at +{int(offsets[bad])} crosses a commit unit of "
                f"{self.region_name} or leaves what this process registered ({self._gpu.end} bytes)"
            )
        return units

    async def statistics(self) -> PoolStatistics:
        """The shared tier's and store's figures, from the owner.

        :raises PoolLostError: the owner went away.
        """
        self._check_loop()
        reply = await self._request(_wire.STATS)
        fields = dict(reply.fields["stats"])
        tier = TierStatistics(**fields.pop("tier"))
        return PoolStatistics(tier=tier, **fields)

    def __repr__(self) -> str:
        if "_base" not in self.__dict__:
            return f"<AttachedPool [{self._life.state} | {self._path}]>"
        state = "lost" if self._lost and not self.closed else self._life.state
        gib = 1 << 30
        return (
            f"<AttachedPool [{state} | {self._path} | owner pid {self._owner_pid} | resident "
            f"{self._resident / gib:.2f}/{self._quota / gib:.2f} GiB | {len(self._mine)} slots held]>"
        )

    # -- the shared store --------------------------------------------------------------------

    @staticmethod
    def _given(keys: Sequence[object]) -> tuple[list[Key], set[type] | None]:
        """The keys as ``bytes`` and ``int``, and their types when they all came so (else None)."""
        if isinstance(keys, bytes | bytearray | memoryview | str | int):
            raise TypeError("keys are a sequence of keys (bytes or ints), not one key")
        if type(keys) is not list and type(keys) is not tuple:
            keys = list(keys)  # an iterator is read once: the types' pass below would consume it
        # bytes and ints are keys as they are (a bool's type is bool): one pass over the types, not a call per key.
        if keys and operator.countOf(map(type, keys), bytes) == len(keys):  # the common case, a cheaper pass
            return list(cast("Sequence[bytes]", keys)), {bytes}
        types = set(map(type, keys))
        if types <= {bytes, int}:
            return list(keys), types
        return [as_key(k) for k in keys], None

    def _keys(self, keys: Sequence[object]) -> tuple[list[Key], dict[str, Any], list[bytes]]:
        given, types = self._given(keys)
        kind, parts = encode_keys(given, types)
        return given, {"k": kind}, parts

    async def lookup(self, keys: Sequence[object] | npt.NDArray[np.uint8]) -> int:
        """How many leading keys the shared store holds (a prefix hit).

        Answered from the index mirror in this process's memory (no round
        trip to the owner); the hits mark their blocks referenced, which
        the owner's eviction honours (docs/pool.md). Asks the owner when the
        mirror cannot give a consistent answer at once.

        :param keys: a sequence of keys, or a 2-D uint8 array whose rows are keys (bytes keys of one
            length, with no Python object per key: the cheaper form for large batches).
        :raises TypeError: a key that is not bytes-like or an int, or an array that is not 2-D uint8.
        :raises ValueError: the owner is asked, and the keys are too long in all for one request (1 GiB).
        :raises PoolLostError: the owner went away.
        """
        self._check_loop()
        given, types = self._lookup_keys(keys)
        self._check_open()
        self._raise_if_lost()
        hits = self._from_mirror(given, types)
        if hits is not None:
            return hits
        reply = await self._ask_about(_wire.LOOKUP, given, types)
        return int(reply.fields["hits"])

    def lookup_nowait(self, keys: Sequence[object] | npt.NDArray[np.uint8]) -> int | None:
        """``lookup`` answered on the calling thread from the index mirror, or None where only the owner
        can answer: then ``await lookup(keys)`` on the pool's loop.

        None comes when the pool has no mirror (not x86-64, or a tier too large for one), when no
        consistent read came within a few tries (the owner writing all the while), and once the pool is
        closing, closed or lost. Hits mark their blocks referenced, and are counted by the owner, as
        ``lookup``'s are.

        Threads: any (no await and no crossing to the loop: a thread that serves a framework's
        synchronous calls asks here first). ``aclose()`` waits for such lookups in flight, tells the owner
        their counts, and returns with the mirror unmapped.

        :raises TypeError: as ``lookup``.
        """
        given, types = self._lookup_keys(keys)
        if not self._mirror_readable():
            return None
        return self._from_mirror(given, types, threadsafe=True)

    async def contains(self, keys: Sequence[object] | npt.NDArray[np.uint8]) -> npt.NDArray[np.bool_]:
        """Per key, whether the shared store holds it (``lookup`` answers the leading run only): for a caller
        that needs to know of blocks past a miss.

        Answered from the index mirror in one read; where the mirror cannot answer, the owner is asked, in
        one request that it answers in one step. Either way the answer is the store at one instant, and it
        touches nothing (no block is marked referenced or moved in the eviction order) and counts nothing.

        :raises TypeError: as ``lookup``.
        :raises ValueError: the owner is asked, and the keys are too long in all for one request (1 GiB).
        :raises TierClosedError: this process closed the pool (or is closing it).
        :raises PoolLostError: the owner went away.

        Cancellation: nothing to undo (nothing is claimed or counted).
        """
        self._check_loop()
        given, types = self._lookup_keys(keys)
        self._check_open()
        self._raise_if_lost()
        mirror = self._mirror
        found = None if mirror is None else mirror.present(given, types)
        if found is not None:
            return found
        n = len(given)
        if not n:
            return np.zeros(0, dtype=np.bool_)
        # Not ``lookup`` key by key: a lookup touches and counts its keys, and answers one by one span many instants.
        reply = await self._ask_about(_wire.CONTAINS, given, types)
        stored = np.frombuffer(reply.parts[0], dtype=np.uint8) if len(reply.parts) == 1 else None
        if stored is None or stored.shape != (n,):
            raise PoolError(f"the pool's owner broke the protocol: no answer per key to a contains of {n} keys")
        answer: npt.NDArray[np.bool_] = stored != 0
        return answer

    async def _ask_about(self, op: int, given: Keys, types: set[type] | None) -> Message:
        """Ask the owner ``op`` (``LOOKUP``, ``CONTAINS``) about keys the mirror could not answer for."""
        if isinstance(given, np.ndarray):
            given, types = [row.tobytes() for row in given], {bytes}
        kind, parts = encode_keys(given, types)
        return await self._request(op, {"k": kind}, parts)

    def contains_nowait(self, keys: Sequence[object] | npt.NDArray[np.uint8]) -> npt.NDArray[np.bool_] | None:
        """``contains`` answered on the calling thread from the index mirror, or None where only the owner
        can answer (as ``lookup_nowait``: no mirror, no consistent read within a few tries, or the pool
        closing, closed or lost): then ``await contains(keys)`` on the pool's loop. Touches and counts
        nothing.

        Threads: any (``aclose()`` waits for such reads in flight).

        :raises TypeError: as ``lookup``.
        """
        given, types = self._lookup_keys(keys)
        mirror = self._mirror
        if mirror is None or not self._mirror_readable():
            return None
        return mirror.present(given, types)

    def _mirror_readable(self) -> bool:
        """Whether a ``*_nowait`` call may read the mirror: the pool is open and its owner not lost."""
        return self._life.state == "open" and self._lost is None

    def _lookup_keys(self, keys: Sequence[object] | npt.NDArray[np.uint8]) -> tuple[Keys, set[type] | None]:
        if isinstance(keys, np.ndarray):
            if keys.dtype != np.uint8 or keys.ndim != 2:
                raise TypeError(
                    f"keys as an array are a 2-D uint8 array (a key per row), not {keys.ndim}-D {keys.dtype}"
                )
            return keys, {bytes}
        return self._given(keys)

    def _from_mirror(self, keys: Keys, types: set[type] | None, threadsafe: bool = False) -> int | None:
        """The mirror's answer, counted for the owner; None: ask the owner."""
        mirror = self._mirror
        if mirror is None:
            return None
        hits = mirror.lookup(keys, types, self._looked.append)  # counted before its read ends (``_teardown``)
        if not self._telling:
            self._telling = True
            if not threadsafe:
                self._loop.call_soon(self._tell_looked)
            else:
                try:
                    self._loop.call_soon_threadsafe(self._loop.call_later, TELL_AFTER, self._tell_looked)
                except RuntimeError:  # the loop closed under a lookup on another thread: nobody to tell
                    pass
        return hits  # None: ask the owner (its retries are told all the same)

    def _tell_looked(self) -> None:
        """Send the counts of the lookups answered from the mirror (one message for all since the last)."""
        self._telling = False
        writer = self.__dict__.get("_writer")
        if self._lost is not None or writer is None or writer.is_closing():
            return
        looked = self._counts_looked()
        if looked is not None:
            self._post(_wire.LOOKED, looked)

    def _counts_looked(self) -> dict[str, int] | None:
        """The counts of the lookups answered from the mirror since the last told, taken (None: none)."""
        looked, q, h, m, r = self._looked, 0, 0, 0, 0
        while looked:  # other threads may append meanwhile: what they add after this is told next time
            answers, hits, misses, retries = looked.popleft()
            q, h, m, r = q + answers, h + hits, m + misses, r + retries
        return {"q": q, "h": h, "m": m, "r": r} if q or r else None

    async def events(self, *, limit: int = 1024) -> PoolEvents:
        """A new subscription: every ``stored``, ``evicted`` and ``discarded`` event of the shared store,
        whichever process caused it, from this call on (as ``BlockStore.events()``: bounded by ``limit``,
        the next event read after a loss says how many were dropped; it ends when the pool closes or is lost).

        :raises ValueError: ``limit`` is not a positive int.
        :raises PoolLostError: the owner went away.
        """
        self._check_loop()
        if type(limit) is not int or limit < 1:
            raise ValueError(f"limit must be a positive int, got {limit!r}")
        self._check_open()
        self._raise_if_lost()
        events = self._events.subscribe(limit)  # before the request: no event after it is missed
        if not self._subscribed:
            await self._request(_wire.SUBSCRIBE)
            self._subscribed = True
        return events

    async def discard(self, keys: Sequence[object]) -> int:
        """Drop blocks from the shared store (a block a load reads goes when that load is done).

        :returns: how many were dropped.
        :raises ValueError: keys too long in all for one request (1 GiB); nothing changed.
        """
        self._check_loop()
        _, fields, parts = self._keys(keys)
        reply = await self._request(_wire.DISCARD, fields, parts)
        return int(reply.fields["dropped"])

    async def store(
        self,
        keys: Sequence[object],
        src: Any,
        *,
        wait: bool = True,
        engine: CopyEngine | None = None,
        page: Any = None,
        after: Any = None,
    ) -> Any:
        """Store one page per key in the shared store; keys already stored (by any process) are not copied.

        With a full tier the least recently used blocks that no process is
        loading are evicted; what still does not fit is skipped (the rest
        of the keys from the first skipped one). A key another process is
        storing is waited for, and reported present.

        :param src: a 2-D uint8 array (a row per key) or a sequence of bytes-like pages; with
            ``engine``, what its ``to_host()`` takes (a CUDA tensor of a page per key, or one device
            address per key, each a slot long).
        :param wait: False: skip keys whose slots are not resident yet rather than wait for the fill.
        :param engine: a ``CopyEngine`` on the device this process attached with (``device=``): the
            pages are copied from GPU memory into the shared slots by it.
        :param page: with ``engine`` and ``src`` as addresses: the bytes of each page, one int for all
            or one per key (default: a slot each).
        :param after: with ``engine``: a CUDA stream or event the copies wait for on the GPU (a stream
            is marked when the copy is queued, after the claim: pass an event recorded at the call to
            follow exactly the work queued before it).
        :returns: a ``StoreResult`` (stored, present, skipped: keys in the caller's order).
        :raises ValueError: a page larger than a slot, an empty page, a key twice, pages that do not
            match the keys, keys too long in all for one request (1 GiB) (nothing changed).
        :raises TypeError: a key that is not bytes-like or an int, a ``wait`` that is not a bool, or an
            ``after`` that is neither a stream nor an event.
        :raises PoolLostError: the owner went away (nothing of this call is visible then).
        :raises CopyPlanError: a page lies in a region (a ``StaticHostMem``, a tier) that closed, or shrank
            past it, while the call waited for the owner: nothing was copied from it, the keys claimed then
            are given back (keys stored before the call waited for another process's store stay stored).

        Cancellation: the call returns once nothing reads the caller's pages;
        blocks whose copy had not landed are given up (never visible); a
        call cancelled while their commit was on its way may leave those
        blocks visible, whole.
        """
        self._check_loop()
        if type(wait) is not bool:
            raise TypeError(f"wait must be a bool, not {type(wait).__name__}")
        given, types = self._given(keys)
        n = len(given)
        pages = self._pages(src, n, engine, page, after, writable=False)
        if n and int(pages.lengths.max()) > self._slot_size:
            raise ValueError(f"a page of {int(pages.lengths.max())} bytes does not fit a {self._slot_size}-byte slot")
        if n and int(pages.lengths.min()) == 0:
            raise ValueError("an empty page cannot be stored")
        # A key twice is refused by the owner's first step, before anything changes (not checked here too:
        # a set of 4,096 keys was a tenth of a store's CPU in this process).
        array = src if isinstance(src, np.ndarray) and engine is None else None
        outcome = np.full(n, SKIPPED, dtype=np.uint8)
        todo = np.arange(n, dtype=np.int64)
        asked = given
        while todo.size:
            kind, parts = encode_keys(asked, types)
            lengths = pages.lengths[todo]
            reply = await self._request(
                _wire.BEGIN, {"k": kind, "wait": bool(wait)}, [*parts, lengths.tobytes()], undo="abort"
            )
            claim = int(reply.fields["claim"])
            got = np.frombuffer(reply.parts[0], dtype=np.uint8)
            if claim:
                await self._fill_claim(claim, got, reply.ints(1), todo, pages, array, engine, after)
            outcome[todo] = got
            todo = todo[got == BUSY]
            if todo.size:  # another process stores these: wait for it, then ask again
                asked = [given[i] for i in todo.tolist()]
                kind, parts = encode_keys(asked, types)
                await self._request(_wire.AWAIT, {"k": kind}, parts)
        # Every key stored, or every one there already (the usual cases): no pass over the keys per outcome.
        if n and int(np.count_nonzero(outcome == CLAIMED)) == n:
            return StoreResult(stored=tuple(given), present=(), skipped=())
        if n and int(np.count_nonzero(outcome == PRESENT)) == n:
            return StoreResult(stored=(), present=tuple(given), skipped=())
        stored = tuple(itertools.compress(given, (outcome == CLAIMED).tolist()))
        present = tuple(itertools.compress(given, (outcome == PRESENT).tolist()))
        skipped = tuple(itertools.compress(given, ((outcome != CLAIMED) & (outcome != PRESENT)).tolist()))
        return StoreResult(stored=stored, present=present, skipped=skipped)

    async def _fill_claim(
        self,
        claim: int,
        got: npt.NDArray[np.uint8],
        slots: npt.NDArray[np.int64],
        todo: npt.NDArray[np.int64],
        pages: Pages,
        array: npt.NDArray[np.uint8] | None,
        engine: CopyEngine | None = None,
        after: Any = None,
    ) -> None:
        """Copy the claimed pages into their slots, then make them visible (or give the claim up).

        ``array``: the pages as a 2-D array, copied as rows (``_rows``); ``engine``: device pages,
        copied by it; else a memmove per run of neighbours."""
        mine = np.flatnonzero(got == CLAIMED)
        rows, into = todo[mine], slots[mine]
        job: Callable[[], None]
        committed = False
        try:
            if engine is not None:
                if into.size:
                    await self._copy_on(engine, into, pages.take(rows), pages.lengths[rows], to_slots=True, after=after)
            else:
                since = epoch()
                taken = pages.take(rows)
                if array is not None and (rows.size == len(array) or array.shape[1] <= SMALL_ROW):
                    every = None if rows.size == len(array) else rows  # every row, in order: copied where it lies
                    job = partial(rows_into_slots, self._base, self._size, self._slot_size, into, array, every)
                else:
                    job = partial(memmove_all, runs(self._at(into), taken.addresses, taken.lengths))
                # Refused where the pages' region closed while the owner answered; the caller's pages are
                # read until it lands, and their region's close waits for that.
                at = partial(self._at, into)
                await finish(copy_tracked(self._life, job, taken, taken.lengths, at, since, tier=None, into_slots=True))
            await self._request(_wire.COMMIT, {"claim": claim})
            committed = True
        finally:
            if not committed and self._lost is None:
                self._post(_wire.ABORT, {"claim": claim})

    def _pages(self, obj: Any, n: int, engine: CopyEngine | None, page: Any, after: Any, *, writable: bool) -> Pages:
        """The caller's pages: host pages, or (``engine``) pages its engine checked, a slot each at most
        (``page``: their lengths where ``obj`` is addresses). ``after`` is checked here, before any claim.

        :raises ValueError: ``engine`` without a device, or on another device than this process attached
            with; ``page`` or ``after`` without ``engine``; ``page`` with pages as an array, or not one
            positive length per key.
        :raises TypeError: ``after`` is neither a CUDA stream nor an event.
        """
        if after is not None:
            stream_handle(after)  # its type, before anything is asked of the owner
        if engine is None:
            if page is not None or after is not None:
                raise ValueError("page= and after= go with engine= (GPU pages); host pages carry their lengths")
            return located_pages(host_pages(obj, n, writable=writable))
        if self._device is None or engine.device != self._device:
            raise ValueError(
                f"engine= copies GPU pages: this process attached with device={self._device}, the engine copies "
                f"on device {engine.device}; attach with the engine's device (AttachedPool(path, device=N))"
            )
        if page is None:
            checked = engine.pages(obj, n, page=self._slot_size, writable=writable)
            each = np.full(n, checked.page, dtype=np.uint64)
            return Pages(checked.addresses, each, [obj, checked], checked.page, tuple(checked.regions))
        if hasattr(obj, "__cuda_array_interface__") or (isinstance(obj, np.ndarray) and obj.ndim != 1):
            raise ValueError("page= goes with pages given as addresses; an array's page is its row")
        lengths = integers([page] * n if np.ndim(page) == 0 else page, "page")  # one length: an int or a numpy scalar
        if lengths.shape != (n,) or (n and int(lengths.min()) < 1):
            raise ValueError(f"page= is one positive length, or one per key ({n}); got {page!r}")
        addresses = integers(obj, "address")
        if addresses.shape != (n,):
            raise ValueError(f"expected {n} integer addresses, got {addresses.size}")
        owners: list[Any] = [obj]
        regions: dict[int, Any] = {}
        for size in np.unique(lengths).tolist():  # each length's pages checked as a CopyEngine checks one size
            same = addresses[lengths == size]
            checked = engine.pages(same, len(same), page=size, writable=writable)
            owners.append(checked)
            regions.update((id(region), region) for region in checked.regions)
        return Pages(addresses.view(np.uint64), lengths.view(np.uint64), owners, 0, tuple(regions.values()))

    def _at(self, slots: I64) -> U64:
        """The addresses of ``slots`` in this process's mapping."""
        return np.uint64(self._base) + slots.astype(np.uint64) * np.uint64(self._slot_size)

    async def _copy_on(
        self, engine: CopyEngine, slots: I64, pages: Pages, lengths: U64, *, to_slots: bool, after: Any = None
    ) -> None:
        """Copy ``lengths`` bytes between ``slots`` and the engine's ``pages`` with ``engine``, once this
        process has registered the slots' units (the owner hands out slots as its fill passes them;
        this process registers them on its own worker, a little later).

        :raises CopyPlanError: a region the pages lay in when the call began closed since.
        """
        end = (int(slots.max()) + 1) * self._slot_size
        await self.wait_resident(min(end, self._quota))
        # A raw copy locates its spans afresh: pages whose region closed while the call waited would be
        # taken for device memory.
        refuse_closed(pages.regions)
        at = self._at(slots).tolist()
        addresses = pages.addresses.tolist()
        dst, src = (at, addresses) if to_slots else (addresses, at)
        # Returns once the GPU let go of the pages, also when the caller is cancelled.
        await engine.copy(list(zip(dst, src, lengths.tolist(), strict=True)), after=after)

    async def load(
        self, keys: Sequence[object], dst: Any, *, engine: CopyEngine | None = None, page: Any = None, after: Any = None
    ) -> list[int]:
        """Copy each key's block from the shared store into ``dst`` (one page per key).

        The blocks are pinned while they are read: no process evicts them under this load.
        Returns the bytes copied per key (a block stored shorter than its page copies its length).

        :param dst: a writable 2-D uint8 array (a row per key) or a sequence of writable buffers;
            with ``engine``, what its ``to_device()`` takes (a CUDA tensor of a page per key, or one
            device address per key, each a slot long).
        :param engine: a ``CopyEngine`` on the device this process attached with: the blocks are
            copied into GPU memory by it.
        :param page: with ``engine`` and ``dst`` as addresses: the bytes of each destination page, one
            int for all or one per key (default: a slot each).
        :param after: with ``engine``: a CUDA stream or event the copies wait for on the GPU.
        :raises BlockNotFound: a key is not stored (the first missing one is named); nothing copied.
        :raises ValueError: a destination page shorter than its block, a read-only destination,
            pages that do not match the keys, ``page`` or ``after`` without ``engine``, keys too long in
            all for one request (1 GiB) (nothing copied).
        :raises TypeError: an ``after`` that is neither a stream nor an event.
        :raises PoolLostError: the owner went away.
        :raises CopyPlanError: a destination page lies in a region (a ``StaticHostMem``, a tier) that closed,
            or shrank past it, while the call waited for the owner: nothing was copied (the blocks unpinned).
        """
        self._check_loop()
        given, fields, parts = self._keys(keys)
        pages = self._pages(dst, len(given), engine, page, after, writable=True)
        if not given:
            return []
        reply = await self._request(_wire.LOAD, fields, parts, undo="unpin")
        pin = reply.fields["pin"]
        loaded = False
        try:
            slots, lengths = reply.ints(0), reply.uints(1)
            short = np.flatnonzero(pages.lengths < lengths)
            if short.size:
                i = int(short[0])
                raise ValueError(
                    f"destination page {i} has {int(pages.lengths[i])} bytes, block {given[i]!r} has "
                    f"{int(lengths[i])}; nothing was copied"
                )
            job: Callable[[], None]
            if engine is not None:
                await self._copy_on(engine, slots, pages, lengths, to_slots=False, after=after)
            else:
                since = epoch()
                width = int(lengths[0])
                if isinstance(dst, np.ndarray) and width <= SMALL_ROW and bool((lengths == width).all()):
                    job = partial(rows_from_slots, self._base, self._size, self._slot_size, slots, dst, width)
                else:
                    job = partial(memmove_all, runs(pages.addresses, self._at(slots), lengths))
                # Refused where the pages' region closed while the owner answered (nothing written).
                at = partial(self._at, slots)
                await finish(copy_tracked(self._life, job, pages, lengths, at, since, tier=None, into_slots=False))
            loaded = True
        finally:
            if self._lost is None:
                self._post(_wire.UNPIN, {"pin": pin, "loaded": loaded})
        copied: list[int] = lengths.tolist()
        return copied
