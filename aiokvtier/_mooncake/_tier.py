"""MooncakeTier: blocks in a Mooncake Store cluster, moved straight from and into registered memory.

The client's batch calls (``batch_put_from``, ``batch_get_into``,
``batch_is_exist``, ``batch_remove``) run on ``io_threads`` named threads and
are awaited from the loop; each is bounded by ``config.timeout``.

Availability: a call that finds the master unreachable, or that does not
return in time, makes the tier unavailable (one log line): reads are then
misses, writes are skipped, lookups find nothing, and nothing raises. A task
polls ``health_check`` on a thread with backoff and makes it available again
(one log line) once the master answers twice in a row; Mooncake's client
mounts its segment again by itself after a master restart.

Memory a call did not give back: a call that times out keeps running on its
thread, so the memory it reads or writes stays *held* (``held``,
``statistics().held_calls``) until it returns; the tier refuses calls on held
memory, and the caller must not reuse it. A call that fails in a way that may
leave a transfer running after it returned (any code outside the documented
rejections) poisons the tier: its memory stays held, the tier stays
unavailable, and its client is never closed (reopen a new tier).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

from .._below import check_fingerprint, check_io_threads
from .._config import MooncakeTierConfig
from .._crossing import Worker
from .._errors import MooncakeError
from .._lifecycle import Lifecycle, Owner, finish
from . import _client
from ._keys import KeySpace

__all__ = ["MooncakeStatistics", "MooncakeTier"]

log = logging.getLogger("aiokvtier")

Key = bytes | int
Region = tuple[int, int]
Call = tuple[str, tuple[Any, ...], tuple[Region, ...]]

_HUNG = object()
"""A call's outcome when it did not return within the timeout."""
_MAX_HUNG_THREADS = 16
"""Past this many threads stuck in calls, no new one is started: the tier stays unavailable."""
_BACKOFF_FIRST, _BACKOFF_MAX = 0.05, 1.0
_RELEASE_POLL = 0.02
"""Seconds between looks at ``held`` while ``released()`` waits (only after a call hung: rare)."""
_HEALTHY_FOR = 2.5
"""Seconds ``health_check`` must answer 0 in a row: the client pings the master once a second, and
for up to a second after the master died it still answered 0 (and then puts found no segment
until the next ping mounted it again)."""


@dataclass(frozen=True, slots=True)
class MooncakeStatistics:
    master: str
    available: bool
    unavailable_why: str | None
    """Why the tier is unavailable (None while it is available)."""
    block_size: int
    hits: int
    misses: int
    """Keys ``read()`` did not fill: not stored, the wrong size, a failed get, or the tier unavailable."""
    bytes_read: int
    bytes_written: int
    writes_skipped: int
    """Blocks ``write()`` did not store: the store full, an error, a timeout, or the tier unavailable."""
    errors: int
    """Keys or calls that failed with something other than "not stored"."""
    size_mismatches: int
    """Gets whose size differed from what was expected: misses, never data."""
    timeouts: int
    reconnects: int
    """Times the tier became available again."""
    queue_depth: int
    """Batch calls running now."""
    held_calls: int
    held_bytes: int
    """Memory of calls that did not return in time (or poisoned the client): not to be reused yet."""
    registered_bytes: int
    last_error: str | None


class MooncakeTier(Owner):
    """A remote tier in a Mooncake Store cluster, blocks of at most ``block_size`` bytes.

    Open it with ``await MooncakeTier.open(config, block_size=..., fingerprint=...)``
    or ``async with MooncakeTier(...)``. ``fingerprint`` names what the blocks
    belong to (a model and its KV layout): tiers on any machine with the same
    ``config.key_prefix`` and fingerprint share their blocks.

    The memory ``write()`` reads from and ``read()`` writes into must be
    registered first with ``register()`` (a host tier's slots, a
    StaticHostMem, any page-aligned host memory that outlives the tier): the
    transfers use it in place. Cancelling a call does not stop its transfers:
    the cancellation is delivered once they return, or once ``config.timeout``
    has passed, after which the memory is listed in ``held`` until they do.
    """

    def __init__(
        self,
        config: MooncakeTierConfig | Mapping[str, Any],
        *,
        block_size: int,
        fingerprint: str,
        io_threads: int = 4,
        wrap_client: Callable[[Any], Any] | None = None,
    ) -> None:
        """``wrap_client``: the Mooncake Store client, once set up, is passed through it and the tier
        calls what it returns (an object with the client's methods): to count or time the calls, or to
        inject faults in tests.

        :raises ValueError: ``block_size`` is not positive, ``fingerprint`` is empty (or not UTF-8), or
            ``io_threads`` is not 1-64 (a config that does not validate is a pydantic ``ValidationError``,
            also a ValueError).
        :raises TypeError: ``wrap_client`` is not callable."""
        self.config = config if isinstance(config, MooncakeTierConfig) else MooncakeTierConfig.model_validate(config)
        if type(block_size) is not int or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        check_fingerprint(fingerprint)
        check_io_threads(io_threads)
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.timeout = float(self.config.timeout)
        self.keys = KeySpace(self.config.key_prefix, fingerprint)
        self._io_threads = io_threads
        if wrap_client is not None and not callable(wrap_client):
            raise TypeError(f"wrap_client must be callable, not {type(wrap_client).__name__}")
        self._wrap_client = wrap_client
        self._life = Lifecycle("MooncakeTier", "aiokvtier-mooncake")
        self._workers: list[Worker] = []
        """I/O threads with no call stuck on them."""
        self._stuck = 0
        self._names = itertools.count()
        self._next = itertools.count()
        self._client: Any = None
        self._starts: list[int] = []
        self._ends: list[int] = []
        """Registered memory, sorted by start."""
        self._registering: dict[asyncio.Future[int], Region] = {}
        """``register()`` and ``unregister()`` calls Mooncake has not answered, with the memory a register
        is registering (size 0 for an unregister): the close waits for them."""
        self._held: dict[int, tuple[Region, ...]] = {}
        self._held_ids = itertools.count()
        self._inflight: dict[asyncio.Future[Any], tuple[Region, ...]] = {}
        """Calls running, with the memory each reads or writes."""
        self._available = True
        self._why: str | None = None
        self._poisoned = False
        self._leak = False
        self._monitor: asyncio.Task[None] | None = None
        self._busy = 0
        self._last_error: str | None = None
        self._counts = dict.fromkeys(
            (
                "hits",
                "misses",
                "bytes_read",
                "bytes_written",
                "skipped",
                "errors",
                "size_mismatches",
                "timeouts",
                "reconnects",
            ),
            0,
        )

    @classmethod
    async def open(
        cls,
        config: MooncakeTierConfig | Mapping[str, Any],
        *,
        block_size: int,
        fingerprint: str,
        io_threads: int = 4,
        wrap_client: Callable[[Any], Any] | None = None,
    ) -> MooncakeTier:
        """Start the threads and set the client up (bounded by ``config.open_timeout``).

        :raises MooncakeError: the wheel or its libraries are missing, the setup failed, or it did
            not finish in time (it is then closed on its own thread if it ever finishes).
        :raises RuntimeError: the threads cannot start.
        """
        tier = cls(
            config, block_size=block_size, fingerprint=fingerprint, io_threads=io_threads, wrap_client=wrap_client
        )
        return await tier.__aenter__()

    async def _build(self) -> None:
        setup_worker = await self._life.run(self._start_workers)
        box: list[Any] = []
        future = setup_worker.submit(_set_up_into, self.config, box)
        done, _ = await asyncio.wait([future], timeout=self.config.open_timeout)
        if not done:
            setup_worker.post(lambda: _dispose(box))  # runs once the setup returns, on its thread
        setup_worker.stop()  # the thread exits after that
        if not done:
            raise MooncakeError(
                f"the Mooncake Store client's setup did not finish within {self.config.open_timeout:g} s: "
                f"is the master at {self.config.master} reachable?"
            )
        client = future.result()
        self._client = client
        self._life.undo.callback(self._close_client)
        if self._wrap_client is not None:
            self._client = self._wrap_client(client)

    def _start_workers(self) -> Worker:
        """On the tier's worker: the I/O threads and the one that sets the client up."""
        undo = self._life.undo
        undo.callback(self._stop_workers)
        self._new_workers(self._io_threads)
        return Worker("aiokvtier-mooncake-setup")

    def _new_workers(self, n: int) -> None:
        """Start ``n`` I/O threads, each listed as it starts: a close stops every one that started, also
        where the caller that asked for them was cancelled meanwhile (its result would be lost)."""
        for _ in range(n):
            self._workers.append(Worker(f"aiokvtier-mooncake-io-{next(self._names)}"))

    def _stop_workers(self) -> None:
        for worker in self._workers:
            worker.stop()

    def _close_client(self) -> None:
        client, self._client = self._client, None
        if self._leak:
            log.error(
                "aiokvtier: the Mooncake tier's client is left open: a transfer may still use its memory (%d calls)",
                len(self._held),
            )
            _client.keep_forever(client)
            return
        client.close()

    async def _teardown(self) -> None:
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            monitor.cancel()
            await asyncio.wait([monitor])
        if self._inflight:
            _, pending = await asyncio.wait(list(self._inflight), timeout=self.timeout)
            self._leak = bool(pending)
        self._leak = self._leak or self._poisoned
        if self._registering:  # booked before the undo reads the books (they run on its worker, in order)
            await asyncio.wait(list(self._registering))
        await self._life.run_undo()

    async def aclose(self) -> None:
        """Wait for the calls in flight (each at most ``config.timeout`` more), unregister the memory,
        close the client, stop the threads. Idempotent.

        Where a call still has not returned, or the tier is poisoned, the client is left open
        (and its memory registered) for the rest of the process: closing it under a running
        transfer could crash the process.
        """
        await self._life.close(self._teardown)

    # -- memory --------------------------------------------------------------------------

    async def register(self, address: int, size: int) -> None:
        """Register ``size`` bytes at ``address`` for transfers; unregistered at close.

        Runs on the tier's thread (registering pins and maps the memory). A cancellation is
        delivered once Mooncake answered, the memory then registered and recorded as it would be
        without one (``unregister()`` or the close lets it go).

        :raises ValueError: not positive, or it overlaps memory registered before.
        :raises MooncakeError: Mooncake refused it.
        :raises TierClosedError: the tier is not open.
        """
        self.check_open()
        if type(address) is not int or type(size) is not int or address <= 0 or size <= 0:
            raise ValueError(f"address and size must be positive ints, got {address!r}, {size!r}")
        i = bisect.bisect_left(self._starts, address)
        if (
            (i > 0 and self._ends[i - 1] > address)
            or (i < len(self._starts) and self._starts[i] < address + size)
            or any(a < address + size and address < a + n for a, n in self._registering.values() if n)
        ):
            raise ValueError(f"[{address:#x}, +{size}) overlaps memory already registered with this tier")
        registering = self._life.submit(self._client.register_buffer, address, size)
        self._booking(registering, self._registered, address, size, registering=True)
        code = await finish(registering)
        if code != 0:
            raise MooncakeError(f"Mooncake refused to register {size} bytes at {address:#x} (code {code})")

    async def unregister(self, address: int) -> None:
        """Unregister the memory ``register()`` registered at ``address``, before the tier closes.

        :raises ValueError: nothing was registered at ``address``, or a call running now (or one
            that has not returned, ``held``) uses that memory: it stays registered.
        :raises MooncakeError: Mooncake refused to unregister it: it stays registered (and is tried
            again at close).
        :raises TierClosedError: the tier is not open.
        """
        self.check_open()
        i = bisect.bisect_left(self._starts, address)
        if i == len(self._starts) or self._starts[i] != address:
            raise ValueError(f"no memory is registered at {address!r} with this tier")
        end = self._ends[i]
        using = [region for regions in self._inflight.values() for region in regions]
        if any(start < end and address < start + n for start, n in [*using, *self.held]):
            raise ValueError(f"[{address:#x}, +{end - address}) is used by a call that has not returned")
        del self._starts[i], self._ends[i]  # refused from now on, before the await
        unregistering = self._life.submit(self._client.unregister_buffer, address)
        self._booking(unregistering, self._unregistered, address, end - address)
        code = await finish(unregistering)
        if code != 0:
            raise MooncakeError(f"Mooncake refused to unregister the memory at {address:#x} (code {code})")

    def _booking(
        self,
        future: asyncio.Future[int],
        book: Callable[[int, int, int | None], None],
        address: int,
        size: int,
        *,
        registering: bool = False,
    ) -> None:
        """Book ``future``'s outcome in its done-callback, also when its caller was cancelled, and make the
        close wait for it: a close that began meanwhile unregisters only what is booked once its undo runs.
        Memory being registered is refused to another ``register()`` meanwhile, as registered memory is."""
        self._registering[future] = (address, size if registering else 0)

        def booked(_: asyncio.Future[int]) -> None:
            self._registering.pop(future, None)
            book(address, size, _answer(future))

        future.add_done_callback(booked)

    def _registered(self, address: int, size: int, code: int | None) -> None:
        if code == 0:  # memory Mooncake registered that the books lack would never be let go
            i = bisect.bisect_left(self._starts, address)
            self._starts.insert(i, address)
            self._ends.insert(i, address + size)
            self._life.undo.callback(self._unregister, address)

    def _unregistered(self, address: int, size: int, code: int | None) -> None:
        if code != 0:  # still registered: back in the books, so the close tries it again
            i = bisect.bisect_left(self._starts, address)
            self._starts.insert(i, address)
            self._ends.insert(i, address + size)

    def _unregister(self, address: int) -> None:
        """At close (on the tier's thread): what ``unregister()`` did not unregister already."""
        if self._leak or self._client is None or address not in self._starts:
            return
        i = self._starts.index(address)
        del self._starts[i], self._ends[i]
        code = self._client.unregister_buffer(address)
        if code != 0:
            log.error("aiokvtier: Mooncake refused to unregister the memory at %#x at close (code %s)", address, code)

    @property
    def held(self) -> tuple[Region, ...]:
        """``(address, length)`` of the memory of calls that have not returned: not to be reused yet.

        Empty in the usual case. The loop's thread.
        """
        return tuple(region for regions in self._held.values() for region in regions)

    async def released(self, addresses: Sequence[int], lengths: Sequence[int]) -> bool:
        """Wait until no call that did not return in time uses this memory (see ``held``).

        Returns True once none does (at once in the usual case), False where some stays held for
        good (the tier is poisoned) or the tier closed while it was: that memory must not be reused.
        The loop's thread; cancelling it only stops the wait.
        """
        regions = list(zip(addresses, lengths, strict=True))

        def held() -> bool:
            return any(s < a + n and a < s + m for s, m in self.held for a, n in regions)

        while held():
            if self._poisoned or self._life.state != "open":
                return False
            await asyncio.sleep(_RELEASE_POLL)
        return True

    def _check_memory(self, addresses: Sequence[int], lengths: Sequence[int]) -> None:
        starts, ends = self._starts, self._ends
        held = self.held
        for address, length in zip(addresses, lengths, strict=True):
            i = bisect.bisect_right(starts, address) - 1
            if i < 0 or address + length > ends[i]:
                raise ValueError(f"[{address:#x}, +{length}) is not inside memory registered with this tier")
            for start, n in held:
                if start < address + length and address < start + n:
                    raise ValueError(f"[{address:#x}, +{length}) is held by a call that has not returned")

    # -- queries -------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Open, and calls go to the store (not skipped). The loop's thread."""
        return self._available and self._life.state == "open"

    def statistics(self) -> MooncakeStatistics:
        """A snapshot of the tier's figures (also after close)."""
        c = self._counts
        return MooncakeStatistics(
            master=self.config.master,
            available=self.available,
            unavailable_why=None if self.available else (self._why or self._life.describe()),
            block_size=self.block_size,
            hits=c["hits"],
            misses=c["misses"],
            bytes_read=c["bytes_read"],
            bytes_written=c["bytes_written"],
            writes_skipped=c["skipped"],
            errors=c["errors"],
            size_mismatches=c["size_mismatches"],
            timeouts=c["timeouts"],
            reconnects=c["reconnects"],
            queue_depth=self._busy,
            held_calls=len(self._held),
            held_bytes=sum(n for _, n in self.held),
            registered_bytes=sum(end - start for start, end in zip(self._starts, self._ends, strict=True)),
            last_error=self._last_error,
        )

    async def lookup(self, keys: Iterable[Key]) -> int:
        """How many leading keys the store holds (a prefix's hit length); 0 while unavailable.

        :raises TypeError: a key is neither bytes nor int, or ``keys`` is one key (a bytes, not a sequence of them).
        :raises TierClosedError: the tier is not open.
        """
        self.check_open()
        names = self.keys.names(keys)
        if not names or not self._available:
            return 0
        [outcome] = await finish(self._run([("batch_is_exist", (names,), ())]))
        if not isinstance(outcome, list):
            return 0
        self._check_codes([code for code in outcome if code < 0], "is_exist")
        n = 0
        for code in outcome:
            if code != 1:
                break
            n += 1
        return n

    # -- write ---------------------------------------------------------------------------

    async def write(self, keys: Sequence[Key], addresses: Sequence[int], lengths: Sequence[int]) -> tuple[Key, ...]:
        """Store each key's ``lengths[i]`` bytes at ``addresses[i]``; returns the keys written.

        A key the store already holds counts as written. While the tier is
        unavailable, nothing is sent and every key is skipped (counted); a key
        the store refuses (full, an error) or a call that times out is skipped
        too, and the rest go on.

        :raises ValueError: the three sequences differ in length, a length is not 1..block_size,
            or the memory is not registered (or is held): nothing is sent.
        :raises TypeError: a key is neither bytes nor int, or ``keys`` is one key (a bytes, not a sequence of them).
        :raises TierClosedError: the tier is not open.
        """
        self.check_open()
        if not len(keys) == len(addresses) == len(lengths):
            raise ValueError(f"one address and one length per key: {len(keys)}, {len(addresses)}, {len(lengths)}")
        lengths = [int(n) for n in lengths]
        addresses = [int(a) for a in addresses]
        for length in lengths:
            if not 0 < length <= self.block_size:
                raise ValueError(f"a block of {length} bytes does not fit a {self.block_size}-byte Mooncake block")
        names = self.keys.names(keys)
        self._check_memory(addresses, lengths)
        first = {name: i for i, name in reversed(list(enumerate(names)))}
        order = sorted(first.values())  # a key given twice is written once
        if not order:
            return ()
        if not self._available:
            self._counts["skipped"] += len(order)
            return ()
        return await finish(self._write(keys, names, addresses, lengths, order))

    async def _write(
        self, keys: Sequence[Key], names: list[str], addresses: list[int], lengths: list[int], order: list[int]
    ) -> tuple[Key, ...]:
        shares = self._shares(order)
        calls: list[Call] = [
            (
                "batch_put_from",
                ([names[i] for i in share], [addresses[i] for i in share], [lengths[i] for i in share]),
                tuple((addresses[i], lengths[i]) for i in share),
            )
            for share in shares
        ]
        written: list[int] = []
        for share, outcome in zip(shares, await self._run(calls), strict=True):
            if not isinstance(outcome, list):
                self._counts["skipped"] += len(share)
                continue
            failed = [(i, code) for i, code in zip(share, outcome, strict=True) if code != 0]
            unsafe = [(addresses[i], lengths[i]) for i, code in failed if code not in _client.SAFE_PUT]
            if unsafe:
                self._poison(tuple(unsafe), f"a put failed with code {failed[0][1]}")
            self._check_codes([code for _, code in failed], "put")
            self._counts["skipped"] += len(failed)
            done = [i for i, code in zip(share, outcome, strict=True) if code == 0]
            written.extend(done)
            self._counts["bytes_written"] += sum(lengths[i] for i in done)
        return tuple(keys[i] for i in sorted(written))

    # -- read ----------------------------------------------------------------------------

    async def read(
        self, keys: Sequence[Key], addresses: Sequence[int], lengths: Sequence[int] | None = None
    ) -> tuple[bool, ...]:
        """Read each key's block into ``addresses[i]``; returns, per key, whether its bytes arrived.

        ``lengths[i]`` (``block_size`` when None) is the block's expected size
        and the room at ``addresses[i]``: a block of another size is a miss,
        never data. A key not stored, a failed get and every key while the tier
        is unavailable are misses (False, counted); the memory of a miss holds
        undefined bytes.

        :raises ValueError: not one address (and length) per key, a length is not 1..block_size,
            or the memory is not registered (or is held): nothing is read.
        :raises TypeError: a key is neither bytes nor int, or ``keys`` is one key (a bytes, not a sequence of them).
        :raises TierClosedError: the tier is not open.
        """
        sizes = await self._read_checked(keys, addresses, lengths, exact=True)
        return tuple(n > 0 for n in sizes)

    async def read_into(self, keys: Sequence[Key], addresses: Sequence[int], room: Sequence[int]) -> tuple[int, ...]:
        """Read each key's block, of any size up to ``room[i]``, into ``addresses[i]``; returns, per key,
        the bytes that arrived (0: a miss, as with ``read()``; a block larger than its room is one).

        For a caller that does not know a block's size before it arrives (a store whose blocks
        may be shorter than a slot).

        :raises ValueError: as ``read()``, with ``room`` for ``lengths``.
        :raises TypeError: a key is neither bytes nor int, or ``keys`` is one key (a bytes, not a sequence of them).
        :raises TierClosedError: the tier is not open.
        """
        return await self._read_checked(keys, addresses, room, exact=False)

    async def _read_checked(
        self, keys: Sequence[Key], addresses: Sequence[int], lengths: Sequence[int] | None, *, exact: bool
    ) -> tuple[int, ...]:
        self.check_open()
        if lengths is None:
            lengths = [self.block_size] * len(keys)
        if not len(keys) == len(addresses) == len(lengths):
            raise ValueError(
                f"one address per key: {len(keys)} keys, {len(addresses)} addresses, {len(lengths)} lengths"
            )
        lengths = [int(n) for n in lengths]
        addresses = [int(a) for a in addresses]
        for length in lengths:
            if not 0 < length <= self.block_size:
                raise ValueError(f"a block of {length} bytes does not fit a {self.block_size}-byte Mooncake block")
        names = self.keys.names(keys)
        self._check_memory(addresses, lengths)
        if not names:
            return ()
        if not self._available:
            self._counts["misses"] += len(names)
            return (0,) * len(names)
        return await finish(self._read(names, addresses, lengths, exact))

    async def _read(self, names: list[str], addresses: list[int], lengths: list[int], exact: bool) -> tuple[int, ...]:
        shares = self._shares(list(range(len(names))))
        calls: list[Call] = [
            (
                "batch_get_into",
                ([names[i] for i in share], [addresses[i] for i in share], [lengths[i] for i in share]),
                tuple((addresses[i], lengths[i]) for i in share),
            )
            for share in shares
        ]
        got = [0] * len(names)
        c = self._counts
        for share, outcome in zip(shares, await self._run(calls), strict=True):
            if not isinstance(outcome, list):
                continue
            failed: list[int] = []
            for i, n in zip(share, outcome, strict=True):
                if n == lengths[i] or (not exact and 0 < n < lengths[i]):
                    got[i] = n
                    c["bytes_read"] += n
                elif n >= 0:
                    c["size_mismatches"] += 1
                else:
                    failed.append(n)
                    if n not in _client.SAFE_GET:
                        self._poison(((addresses[i], lengths[i]),), f"a get failed with code {n}")
            self._check_codes([n for n in failed if n != _client.OBJECT_NOT_FOUND], "get")
        hits = sum(1 for n in got if n)
        c["hits"] += hits
        c["misses"] += len(got) - hits
        return tuple(got)

    # -- discard -------------------------------------------------------------------------

    async def discard(self, keys: Iterable[Key]) -> int:
        """Remove blocks from the store; returns how many were removed (0 while unavailable).

        A block still under its lease (just written or read by any client) is
        left as it is: Mooncake refuses to remove it then.

        :raises TypeError: a key is neither bytes nor int, or ``keys`` is one key (a bytes, not a sequence of them).
        :raises TierClosedError: the tier is not open.
        """
        self.check_open()
        names = list(dict.fromkeys(self.keys.names(keys)))
        if not names or not self._available:
            return 0
        [outcome] = await finish(self._run([("batch_remove", (names, False), ())]))
        if not isinstance(outcome, list):
            return 0
        self._check_codes([code for code in outcome if code in _client.UNREACHABLE], "remove")
        return sum(1 for code in outcome if code == 0)

    # -- the threads ---------------------------------------------------------------------

    def _shares(self, order: list[int]) -> list[list[int]]:
        n = max(1, min(len(self._workers), len(order)))
        size = -(-len(order) // n)
        return [order[i : i + size] for i in range(0, len(order), size)]

    async def _run(self, calls: list[Call]) -> list[Any]:
        """Run each call (a client method, its arguments, the memory it uses) on its own I/O thread.

        Returns, per call, its result, the exception it raised, or ``_HUNG``
        where it did not return within the timeout (its memory is then held
        and its thread retired). Never cancelled: callers await it through
        ``finish()``.
        """
        workers = self._workers
        if not workers:
            self._unavailable("every I/O thread is stuck in a call that did not return")
            return [_HUNG] * len(calls)
        start = next(self._next)
        client = self._client
        futures: list[tuple[Worker, asyncio.Future[Any]]] = []
        for i, (method, args, regions) in enumerate(calls):
            worker = workers[(start + i) % len(workers)]
            future = worker.submit(getattr(client, method), *args)
            self._inflight[future] = regions
            future.add_done_callback(self._returned)
            futures.append((worker, future))
        self._busy += len(futures)
        try:
            _, pending = await asyncio.wait([f for _, f in futures], timeout=self.timeout)
        finally:
            self._busy -= len(futures)
        out: list[Any] = []
        for (worker, future), (method, _, regions) in zip(futures, calls, strict=True):
            if future in pending:
                self._hold(worker, future, regions, method)
                out.append(_HUNG)
            elif future.exception() is not None:
                error = future.exception()
                self._counts["errors"] += 1
                self._last_error = f"{method} raised {error!r}"
                log.warning("aiokvtier: the Mooncake tier's %s raised %r", method, error)
                out.append(error)
            else:
                out.append(future.result())
        return out

    def _returned(self, future: asyncio.Future[Any]) -> None:
        self._inflight.pop(future, None)

    def _hold(self, worker: Worker, future: asyncio.Future[Any], regions: tuple[Region, ...], method: str) -> None:
        """A call that did not return in time: hold its memory until it does, and retire its thread."""
        if worker in self._workers:
            self._workers.remove(worker)
            self._stuck += 1
            worker.stop()  # it exits once the call returns

        def returned(_: asyncio.Future[Any]) -> None:
            self._held.pop(hid, None)
            self._stuck -= 1

        hid = next(self._held_ids)
        self._held[hid] = regions
        future.add_done_callback(returned)
        self._counts["timeouts"] += 1
        self._last_error = f"{method} did not return within {self.timeout:g} s"
        self._unavailable(self._last_error)

    def _poison(self, regions: tuple[Region, ...], why: str) -> None:
        """A failure that may leave a transfer running: its memory held for good, the tier off for good."""
        self._held[next(self._held_ids)] = regions
        if not self._poisoned:
            self._poisoned = True
            self._available = True  # so that the transition below is logged with this reason
            self._unavailable(f"{why}; a transfer may still use its memory: open a new tier")

    def _check_codes(self, codes: list[int], what: str) -> None:
        """Count failure codes; an unreachable master makes the tier unavailable."""
        if not codes:
            return
        self._counts["errors"] += len(codes)
        self._last_error = f"{what} failed with code {codes[0]}"
        if any(code in _client.UNREACHABLE for code in codes):
            self._unavailable(f"the master at {self.config.master} did not answer (code {codes[0]})")

    def _unavailable(self, why: str) -> None:
        if not self._available:
            return
        self._available = False
        self._why = why
        log.warning("aiokvtier: the Mooncake tier is unavailable: %s; local tiers keep serving", why)
        if not self._poisoned and not self.closed and self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._watch(), name="aiokvtier-mooncake-health")

    async def _watch(self) -> None:
        """Poll ``health_check`` with backoff until the master answers; then available again.

        Mooncake's client reconnects and mounts its segment again by itself once the master is
        back (0.3.13): this only decides when to use it again, never recreates it.
        """
        delay = _BACKOFF_FIRST
        healthy_since: float | None = None
        loop = asyncio.get_running_loop()
        try:
            while not self._poisoned:
                await asyncio.sleep(delay)
                delay = min(2 * delay, _BACKOFF_MAX)
                missing = self._io_threads - len(self._workers)
                if missing > 0 and self._stuck < _MAX_HUNG_THREADS:
                    await finish(self._life.run(self._new_workers, missing))
                if not self._workers:
                    continue
                [outcome] = await finish(self._run([("health_check", (), ())]))
                if outcome != 0:
                    healthy_since = None
                    continue
                if healthy_since is None:
                    healthy_since = loop.time()
                if loop.time() - healthy_since < _HEALTHY_FOR:
                    continue
                # and the master answers a query (health_check reads the client's own state)
                [probe] = await finish(self._run([("batch_is_exist", ([self.keys.namespace + "probe"],), ())]))
                if not isinstance(probe, list) or any(code < 0 for code in probe):
                    healthy_since = None
                    continue
                if self._life.state == "open":
                    self._available = True
                    self._why = None
                    self._counts["reconnects"] += 1
                    log.warning("aiokvtier: the Mooncake tier is available again (master %s)", self.config.master)
                    return
        finally:
            if self._monitor is asyncio.current_task():
                self._monitor = None

    def __repr__(self) -> str:
        state = "available" if self.available else f"unavailable: {self._why}"
        return f"<MooncakeTier [{self._life.state} | {self.config.master} | {state} | {len(self._held)} held]>"

    async def __aenter__(self) -> Self:
        """Open the tier (see ``open()``)."""
        return await super().__aenter__()


def _answer(future: asyncio.Future[int]) -> int | None:
    """A finished client call's return code; None where it raised (or is not done)."""
    if not future.done() or future.cancelled() or future.exception() is not None:
        return None
    return future.result()


def _set_up_into(config: MooncakeTierConfig, box: list[Any]) -> Any:
    client = _client.setup(config)
    box.append(client)
    return client


def _dispose(box: list[Any]) -> None:
    """After a setup the open stopped waiting for: close what it made, if anything."""
    for client in box:
        try:
            client.close()
        except Exception as exc:  # nobody is left to tell but the log
            log.warning("aiokvtier: closing a Mooncake client set up too late failed: %r", exc)
