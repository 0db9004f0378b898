"""DiskTier: blocks kept in a local file, found again after a restart or a crash.

The index (key -> data slot, length, checksum) lives on the event loop; the
bytes move on ``io_threads`` named threads with ``preadv``/``pwritev``. A
block is visible once its data and its journal record are written; a read
checks the block's checksum and treats a mismatch as a miss (the block is
dropped), so a torn write or a flipped bit never comes back as data.

One process opens a directory at a time (an exclusive ``flock``): a second
opener gets ``DiskTierBusy``. Blocks of different models never meet: the
files live in a subdirectory named by the fingerprint the caller gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import itertools
import json
import logging
import operator
import os
import shutil
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any, Self

import xxhash

from .._below import check_fingerprint, check_io_threads
from .._config import DiskTierConfig
from .._crossing import Worker, one_moment
from .._errors import DiskTierBusy
from .._lifecycle import Lifecycle, Owner, finish
from .._store._keys import key_of
from ._io import ALIGN, DataFile, memory_at
from ._journal import Entry, Journal

__all__ = ["DiskStatistics", "DiskTier"]

log = logging.getLogger("aiokvtier")

Key = bytes | int
_LAYOUT = 1
"""The on-disk format's version: a directory of another version is started afresh."""
MAX_BLOCK = 1 << 31
"""A journal record holds a block's length in 32 bits."""
_MAX_KEY = 0xFFFF
"""A journal record holds a key's encoding in at most this many bytes."""


@dataclass(frozen=True, slots=True)
class DiskStatistics:
    path: str
    """The tier's own directory (under the configured path, named by the fingerprint)."""
    direct_io: bool
    """True: ``O_DIRECT``; False: buffered I/O (``buffered_why`` says why)."""
    buffered_why: str | None
    block_size: int
    capacity: int
    """Blocks the quota holds."""
    blocks: int
    free: int
    """Data slots holding nothing; at rest ``blocks + free == capacity`` (the rest are being written,
    or hold a dropped block a read still has)."""
    bytes_stored: int
    hits: int
    misses: int
    """Keys asked for by ``read()`` that were not stored, or failed their checksum."""
    bytes_read: int
    bytes_written: int
    writes_skipped: int
    """Blocks ``write()`` did not store: the tier was full of blocks being read or written, or an I/O error."""
    evictions: int
    write_errors: int
    read_errors: int
    checksum_failures: int
    queue_depth: int
    """I/O jobs queued or running now."""
    recovered_blocks: int
    """Blocks found again when the tier opened."""
    free_disk_bytes: int | None
    """What the file system has left (None once closed)."""


class DiskTier(Owner):
    """A disk tier of ``config.quota`` bytes in blocks of ``block_size`` under ``config.path``.

    Open it with ``await DiskTier.open(config, block_size=..., fingerprint=...)``
    or ``async with DiskTier(...)``. ``fingerprint`` names what the blocks
    belong to (a model and its KV layout): a tier reopened with the same path
    and fingerprint finds its blocks again, one with another fingerprint
    starts empty beside it.

    The memory ``write()`` reads from and ``read()`` writes to is given as
    addresses (tier slots, a StaticHostMem, any page-aligned host memory);
    it must stay valid until the call returns. Cancelling either call does
    not stop the I/O: the cancellation is delivered once the threads let go
    of the memory.
    """

    def __init__(
        self,
        config: DiskTierConfig | Mapping[str, Any],
        *,
        block_size: int,
        fingerprint: str,
        io_threads: int = 4,
    ) -> None:
        """:raises ValueError: ``block_size`` is not a positive multiple of 4096 up to 2 GiB, ``fingerprint``
        is empty (or not UTF-8), ``io_threads`` is not 1-64, or the quota holds no block."""
        self.config = config if isinstance(config, DiskTierConfig) else DiskTierConfig.model_validate(config)
        if type(block_size) is not int or not 0 < block_size <= MAX_BLOCK or block_size % ALIGN:
            raise ValueError(f"block_size must be a positive multiple of {ALIGN} up to {MAX_BLOCK}, got {block_size!r}")
        check_fingerprint(fingerprint)
        check_io_threads(io_threads)
        self.capacity = int(self.config.quota) // block_size
        if self.capacity == 0:
            raise ValueError(f"the disk quota ({int(self.config.quota)} bytes) holds no {block_size}-byte block")
        self.block_size = block_size
        self.fingerprint = fingerprint
        digest = hashlib.sha256(f"{fingerprint}\0{block_size}".encode()).hexdigest()[:20]
        self.directory = os.path.join(os.fspath(self.config.path), f"aiokvtier-{digest}")
        self._io_threads = io_threads
        self._life = Lifecycle("DiskTier", "aiokvtier-disk")
        self._workers: list[Worker] = []
        self._next = itertools.count()
        self._index: OrderedDict[Key, Entry] = OrderedDict()
        """Visible blocks, least recently used first."""
        self._free: list[int] = []
        """Data slots given back, below ``_fresh``."""
        self._fresh = 0
        """Slots from here on were never used since the tier opened (a huge quota costs no list of them)."""
        self._pins: dict[int, int] = {}
        """Data slots being read, and by how many calls."""
        self._writing: set[Key] = set()
        self._unwanted: set[Key] = set()
        """Keys discarded while being written: dropped once their write settles."""
        self._calls = 0
        self._idle = asyncio.Event()
        """Set while no ``write()`` or ``read()`` is in flight (the close waits for it)."""
        self._idle.set()
        self._doomed: set[int] = set()
        """Slots whose block was dropped while a read had them pinned: freed by the last unpin."""
        self._busy = 0
        self._bytes = 0
        """The stored blocks' lengths, summed as the index changes (a statistics() call is any thread's, any time)."""
        self._flush_posted = False
        self._recovered = 0
        self._counts = dict.fromkeys(
            (
                "hits",
                "misses",
                "bytes_read",
                "bytes_written",
                "skipped",
                "evictions",
                "write_errors",
                "read_errors",
                "checksum_failures",
            ),
            0,
        )
        self._free_disk: int | None = None
        """What the file system had left after the last write (sampled on an I/O thread: statvfs may block)."""
        self._lock_fd: int | None = None
        self._data: DataFile | None = None
        self._journal: Journal | None = None

    @classmethod
    async def open(
        cls,
        config: DiskTierConfig | Mapping[str, Any],
        *,
        block_size: int,
        fingerprint: str,
        io_threads: int = 4,
    ) -> DiskTier:
        """Lock the directory, replay the journal, start the I/O threads.

        :raises DiskTierBusy: another opener holds the directory.
        :raises OSError: the directory or its files cannot be made (permissions, a full disk).
        :raises RuntimeError: the I/O threads cannot start.
        """
        tier = cls(config, block_size=block_size, fingerprint=fingerprint, io_threads=io_threads)
        return await tier.__aenter__()

    async def _build(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._life.run(self._start)

    async def _teardown(self) -> None:
        # The I/O in flight uses the files and the callers' memory: closing a descriptor under it
        # would fail the I/O, or let it land in whatever file reuses the descriptor's number.
        await self._idle.wait()
        await self._life.run_undo()

    def _enter(self) -> None:
        self._calls += 1
        self._idle.clear()

    def _exit(self) -> None:
        self._calls -= 1
        if not self._calls:
            self._idle.set()

    def _start(self) -> None:
        """On the tier's worker: lock, files, replay, threads; undoes itself on failure."""
        undo = self._life.undo
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise OSError(
                exc.errno, f"the disk tier's path is not a writable directory: {exc.strerror}", exc.filename
            ) from None
        self._lock_fd = fd = os.open(os.path.join(self.directory, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        undo.callback(os.close, fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise DiskTierBusy(
                f"the disk tier at {self.directory} is open elsewhere (process {holder}): one opener at a time"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._adopt_layout()
        self._data = data = DataFile(os.path.join(self.directory, "blocks"), self.capacity, self.block_size)
        undo.callback(self._close_files)
        if not data.direct:
            log.info("aiokvtier: disk tier %s uses buffered I/O: %s", self.directory, data.direct_why)
        self._journal = journal = Journal(os.path.join(self.directory, "journal"))
        self._recover(journal.replay())
        self._sample_free()
        # Shut down after the I/O threads have drained (undone in reverse): no hash outlives its write.
        self._hashers = ThreadPoolExecutor(self._io_threads, thread_name_prefix="aiokvtier-disk-hash")
        undo.callback(self._hashers.shutdown)
        for i in range(self._io_threads):
            self._workers.append(Worker(f"aiokvtier-disk-io-{i}"))
            undo.callback(_drain, self._workers[-1])

    def _adopt_layout(self) -> None:
        """Keep the files if they were written in this layout, else start afresh (said in the log)."""
        meta = os.path.join(self.directory, "tier.json")
        want = {"layout": _LAYOUT, "fingerprint": self.fingerprint, "block_size": self.block_size}
        try:
            with open(meta) as f:
                have = json.load(f)
        except FileNotFoundError:
            have = None
        except (OSError, ValueError) as exc:
            have = {"unreadable": str(exc)}
        if have is not None and have != want:
            log.warning("aiokvtier: disk tier %s was written as %s; starting it empty", self.directory, have)
            for name in ("blocks", "journal"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.directory, name))
        if have != want:
            tmp = meta + ".new"
            with open(tmp, "w") as f:
                json.dump(want, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, meta)

    def _recover(self, blocks: dict[Key, Entry]) -> None:
        owner: dict[int, Key] = {}
        for key, (slot, length, checksum) in blocks.items():
            if slot >= self.capacity or not 0 < length <= self.block_size:
                continue  # past a smaller quota, or not a record of this layout
            previous = owner.get(slot)
            if previous is not None:
                del self._index[previous]  # the slot was reused and the older drop never made it
            owner[slot] = key
            self._index[key] = (slot, length, checksum)
        self._bytes = sum(length for _, length, _ in self._index.values())
        self._fresh = max(owner, default=-1) + 1
        self._free = sorted(set(range(self._fresh)) - set(owner), reverse=True)
        self._recovered = len(self._index)
        journal = self._journal
        assert journal is not None
        if journal.skipped:
            log.warning(
                "aiokvtier: disk tier %s stepped over %d damaged bytes in its journal", self.directory, journal.skipped
            )
        # A damaged journal is rewritten whole: the damage would be stepped over again at every open. An
        # outdated one (format 1, a torn header) takes no records until it is rewritten in this format.
        if journal.skipped or journal.outdated or journal.records > 2 * len(self._index) + 1024:
            try:
                journal.rewrite(dict(self._index))
            except OSError as exc:  # a read-only directory, a full disk: the long journal still serves (an
                # outdated one for reads only: it refuses records, and the writes are skipped)
                log.warning("aiokvtier: disk tier %s could not compact its journal: %s", self.directory, _why(exc))

    def _close_files(self) -> None:
        """Sync and close both files; a failed sync is raised once both are closed."""
        data, journal = self._data, self._journal
        try:
            if data is not None:
                try:
                    data.sync()
                finally:
                    data.close()
        finally:
            if journal is not None:
                try:
                    _quietly(journal.flush)
                    journal.sync()
                finally:
                    journal.close()

    async def aclose(self) -> None:
        """Finish the I/O in flight, write everything to disk, release the lock. Idempotent."""
        await self._life.close(self._teardown)

    # -- queries (the loop) ----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is stored; False for what is no key (``True`` and ``1.0`` are not ``1``)."""
        try:
            return key_of(key) in self._index
        except TypeError:
            return False

    def length(self, key: Key) -> int:
        """The stored length of ``key``'s block.

        :raises KeyError: the key is not stored.
        :raises TypeError: the key is not bytes-like or an int.
        """
        return self._index[key_of(key)][1]

    def lookup(self, keys: Iterable[Key]) -> int:
        """How many leading keys are stored (a prefix's hit length).

        :raises TypeError: a key before the first miss is not bytes-like or an int.
        """
        n = 0
        index = self._index
        for key in keys:
            if key_of(key) not in index:
                break
            n += 1
        return n

    def statistics(self) -> DiskStatistics:
        """A snapshot of the tier's figures (any thread, also after close: from another thread while
        the tier is open it is taken on the tier's loop, between two of its callbacks, so it waits for
        the loop)."""
        # Read off the loop, the blocks, their bytes and the free slots each come from another moment.
        return one_moment(self.__dict__.get("_loop"), self._snapshot, settled=self._life.state == "closed")

    def _snapshot(self) -> DiskStatistics:
        c = self._counts
        data = self._data
        return DiskStatistics(
            path=self.directory,
            direct_io=data is not None and data.direct,
            buffered_why=None if data is None else data.direct_why,
            block_size=self.block_size,
            capacity=self.capacity,
            blocks=len(self._index),
            free=len(self._free) + self.capacity - self._fresh,
            bytes_stored=self._bytes,
            hits=c["hits"],
            misses=c["misses"],
            bytes_read=c["bytes_read"],
            bytes_written=c["bytes_written"],
            writes_skipped=c["skipped"],
            evictions=c["evictions"],
            write_errors=c["write_errors"],
            read_errors=c["read_errors"],
            checksum_failures=c["checksum_failures"],
            queue_depth=self._busy,
            recovered_blocks=self._recovered,
            free_disk_bytes=None if self.closed else self._free_disk,
        )

    # -- write ---------------------------------------------------------------------------

    async def write(self, keys: Sequence[Key], addresses: Sequence[int], lengths: Sequence[int]) -> tuple[Key, ...]:
        """Store each key's ``lengths[i]`` bytes at ``addresses[i]``; returns the keys written.

        Keys already stored or being written are left as they are (so is a
        key's second appearance in one call). When the tier is full, least
        recently used blocks that no read holds are evicted; a key that finds
        no slot, or whose write fails (ENOSPC, EIO), is skipped, counted and
        logged, and the rest go on. A key discarded while its write is in
        flight is not stored.

        :raises ValueError: the three sequences differ in length, a length is not 1..block_size, an
            address is not above 0, or a key's encoding is longer than 65535 bytes (nothing changed).
        :raises TypeError: a key is not bytes-like or an int, or an address or length not an int.
        :raises TierClosedError: the tier is not open.
        """
        self.check_open()
        if not len(keys) == len(addresses) == len(lengths):
            raise ValueError(f"one address and one length per key: {len(keys)}, {len(addresses)}, {len(lengths)}")
        keys = _keys(keys)
        addresses = [_address(a) for a in addresses]
        sizes = [_int(length, "a length") for length in lengths]
        for length in sizes:
            if not 0 < length <= self.block_size:
                raise ValueError(f"a block of {length} bytes does not fit a {self.block_size}-byte disk block")
        jobs: list[tuple[Key, int, int, int]] = []
        for key, address, length in zip(keys, addresses, sizes, strict=True):
            if key in self._index or key in self._writing:
                continue
            slot = self._take_slot()
            if slot is None:
                self._counts["skipped"] += 1
                continue
            self._writing.add(key)
            jobs.append((key, address, length, slot))
        if not jobs:
            return ()
        self._enter()
        try:
            task = asyncio.ensure_future(self._spread(self._write_all, jobs, operator.itemgetter(3)))
            try:
                await finish(task)
            finally:
                written = self._settle_writes(jobs, _outcomes(task, len(jobs)))
        finally:
            self._exit()
        return written

    def _settle_writes(self, jobs: list[tuple[Key, int, int, int]], outcomes: list[Any]) -> tuple[Key, ...]:
        """Publish what was written, give back the slots of what was not (also after a cancellation)."""
        written: list[Key] = []
        for (key, _, length, slot), outcome in zip(jobs, outcomes, strict=True):
            self._writing.discard(key)
            if isinstance(outcome, int):
                self._counts["bytes_written"] += length
                self._index[key] = (slot, length, outcome)
                self._bytes += length
                if key in self._unwanted:  # discarded while its bytes went to disk
                    self._drop(key)
                    continue
                written.append(key)
            else:
                self._free.append(slot)
                self._counts["skipped"] += 1
                self._counts["write_errors"] += 1
        self._unwanted.difference_update(key for key, _, _, _ in jobs)
        return tuple(written)

    def _take_slot(self) -> int | None:
        """A free data slot, or the least recently used unpinned block's (now dropped)."""
        if self._free:
            return self._free.pop()
        if self._fresh < self.capacity:
            self._fresh += 1
            return self._fresh - 1
        for key, (slot, length, _) in self._index.items():
            if slot not in self._pins:
                del self._index[key]
                self._bytes -= length
                assert self._journal is not None
                self._journal.drop_soon(key)  # written before the slot's new bytes (``_write_all``)
                self._counts["evictions"] += 1
                return slot
        return None

    def _write_all(self, jobs: list[tuple[Key, int, int, int]]) -> list[int | Exception]:
        """On an I/O thread: the drops queued before (an evicted block's among them), the blocks' data
        (neighbouring slots in one call) and each block's checksum, then one journal write with every
        written block's record (none is visible, nor reported written, before the whole share settles:
        a record per block bought nothing but a syscall each, with the threads queued on the journal)."""
        data, journal = self._data, self._journal
        assert data is not None and journal is not None
        out: list[int | Exception] = []
        try:
            journal.flush()  # a slot's old record goes before its bytes change
            journal.reserve(key for key, _, _, _ in jobs)  # room for the records, taken before the data's
        except Exception as exc:
            log.warning("aiokvtier: disk tier %s skipped %d blocks: %s", self.directory, len(jobs), _why(exc))
            return [exc] * len(jobs)
        written: list[tuple[Key, int, int, int]] = []
        # A run's blocks, once written, are hashed on a hashing thread while the next run is written
        # (the bytes do not change meanwhile; a block is hashed only once the kernel could read it:
        # memory it cannot read is EFAULT, not a crash). The disk does not wait for the hashes,
        # which on a fast disk took a tenth of a 2 MiB block's time. Where no hashing thread can be
        # had, this thread hashes.
        hashes: dict[int, tuple[Future[list[int | Exception]], int]] = {}
        ready: list[int] = []

        def hand_over() -> None:
            if not ready:
                return
            spans = [(jobs[i][1], jobs[i][2]) for i in ready]
            # The share's own future: a submit that fails (no thread could start, a MemoryError) may
            # have queued the job already, and a thread started later would hash memory this share
            # gave back long before. Cancelled here, that job never runs; one a thread took is waited for.
            future: Future[list[int | Exception]] = Future()
            try:
                self._hashers.submit(_run, future, _checksums, spans)
            except Exception:
                if future.cancel():  # not taken: this thread hashes the run
                    ready.clear()
                    return
            for j, i in enumerate(ready):
                hashes[i] = (future, j)
            ready.clear()

        errors: list[Exception | None] = []
        try:
            # ``hand_over`` runs as the next run is about to be written: the previous run's outcomes are in.
            blocks = [(slot, address, length) for _, address, length, slot in jobs]
            for i, error in enumerate(data.write_blocks(blocks, hand_over)):
                errors.append(error)
                if error is None:
                    ready.append(i)
            hand_over()
        finally:  # the memory is this share's until every hash of it ended
            futures_wait({future for future, _ in hashes.values()})
        for i, ((key, address, length, slot), error) in enumerate(zip(jobs, errors, strict=True)):
            if error is None:
                try:
                    pending = hashes.get(i)
                    outcome = _checksum(address, length) if pending is None else pending[0].result()[pending[1]]
                    if isinstance(outcome, Exception):
                        raise outcome
                    checksum = outcome
                except Exception as exc:
                    error = exc
            if error is not None:  # this block is skipped; the rest of the share goes on
                log.warning("aiokvtier: disk tier %s skipped a block: %s", self.directory, _why(error))
                out.append(error)
                continue
            written.append((key, slot, length, checksum))
            out.append(checksum)
        if written:
            try:
                journal.put(written)
            except Exception as exc:  # unrecorded blocks are not stored
                log.warning("aiokvtier: disk tier %s skipped %d blocks: %s", self.directory, len(written), _why(exc))
                out = [exc if isinstance(outcome, int) else outcome for outcome in out]
        self._sample_free()
        return out

    def _sample_free(self) -> None:
        try:
            self._free_disk = shutil.disk_usage(self.directory).free
        except Exception:  # a figure only: after a share's records, no failure may unsay what they stored
            self._free_disk = None

    # -- read ----------------------------------------------------------------------------

    async def read(self, keys: Sequence[Key], addresses: Sequence[int]) -> tuple[bool, ...]:
        """Read each stored key's block to ``addresses[i]`` (writable for ``block_size`` bytes, or
        the block's length rounded up to 4096); returns, per key, whether its bytes arrived.

        A key not stored, a read error and a block that fails its checksum
        are misses: False, counted. A block the file cannot give back (a
        failed checksum, a read error other than memory the kernel could not
        write to) is dropped. Blocks read are pinned (never evicted under the
        read) and become the most recently used.

        :raises ValueError: not one address per key, an address not above 0, or two blocks that would
            be read into overlapping memory (nothing read).
        :raises TypeError: a key is not bytes-like or an int, or an address not an int.
        :raises TierClosedError: the tier is not open.
        """
        self.check_open()
        if len(keys) != len(addresses):
            raise ValueError(f"one address per key: {len(keys)} keys, {len(addresses)} addresses")
        keys = _keys(keys)
        addresses = [_address(a) for a in addresses]
        entries = [self._index.get(key) for key in keys]
        # Blocks read into one another's memory on two threads fail each other's checksums: good
        # blocks would be dropped for the caller's mistake.
        spans = sorted((a, a + _span(a, e[1])) for a, e in zip(addresses, entries, strict=True) if e is not None)
        for (_, end), (start, _) in itertools.pairwise(spans):
            if start < end:
                raise ValueError(f"two blocks would be read into overlapping memory (at {start:#x}); nothing was read")
        jobs: list[tuple[Key, int, Entry]] = []
        found: list[bool] = []
        for key, address, entry in zip(keys, addresses, entries, strict=True):
            found.append(entry is not None)
            if entry is None:
                self._counts["misses"] += 1
                continue
            self._index.move_to_end(key)
            self._pins[entry[0]] = self._pins.get(entry[0], 0) + 1
            jobs.append((key, address, entry))
        if not jobs:
            return tuple(found)
        self._enter()
        try:
            task = asyncio.ensure_future(self._spread(self._read_all, jobs, lambda job: job[2][0]))
            try:
                await finish(task)
            finally:
                outcomes = _outcomes(task, len(jobs))
                for (key, _, entry), outcome in zip(jobs, outcomes, strict=True):
                    slot, length, _ = entry
                    self._unpin(slot)
                    if outcome == "ok":
                        self._counts["hits"] += 1
                        self._counts["bytes_read"] += length
                        continue
                    self._counts["misses"] += 1
                    self._counts["checksum_failures" if outcome == "checksum" else "read_errors"] += 1
                    if outcome in ("checksum", "error") and self._index.get(key) == entry:
                        self._drop(key)
        finally:
            self._exit()
        arrived = iter(outcome == "ok" for outcome in outcomes)
        return tuple(next(arrived) if present else False for present in found)

    def _read_all(self, jobs: list[tuple[Key, int, Entry]]) -> list[str]:
        """On an I/O thread: "ok", "checksum", "error" (the file's), or "failed" (the memory's, or no I/O)."""
        data = self._data
        assert data is not None
        out: list[str] = []
        errors = data.read_blocks([(slot, address, length) for _, address, (slot, length, _) in jobs])
        for (_, address, (_, length, checksum)), error in zip(jobs, errors, strict=True):
            if error is not None:
                log.warning("aiokvtier: disk tier %s: a read failed: %s", self.directory, _why(error))
                file_error = isinstance(error, OSError) and error.errno != errno.EFAULT
                out.append("error" if file_error else "failed")
                continue
            good = _checksum(address, length) == checksum
            out.append("ok" if good else "checksum")
        return out

    def _unpin(self, slot: int) -> None:
        left = self._pins[slot] - 1
        if left:
            self._pins[slot] = left
            return
        del self._pins[slot]
        if slot in self._doomed:
            self._doomed.discard(slot)
            self._give_back(slot)

    # -- discard -------------------------------------------------------------------------

    def discard(self, keys: Iterable[Key]) -> int:
        """Drop blocks (unknown keys are ignored); returns how many were dropped. A key whose write is
        in flight is dropped when the write settles (not counted here; that ``write()`` does not return it).

        :raises TypeError: a key is not bytes-like or an int (nothing dropped).
        :raises TierClosedError: the tier is not open.
        """
        self.check_open()
        dropped = 0
        for key in _keys(list(keys)):
            if key in self._index:
                self._drop(key)
                dropped += 1
            elif key in self._writing:
                self._unwanted.add(key)
        return dropped

    def _drop(self, key: Key) -> None:
        slot, length, _ = self._index.pop(key)
        self._bytes -= length
        journal = self._journal
        assert journal is not None
        journal.drop_soon(key)
        if not self._flush_posted:  # one flush job for a burst of drops, not one per key
            self._flush_posted = True
            self._workers[next(self._next) % len(self._workers)].post(self._flush_drops)
        if slot in self._pins:
            self._doomed.add(slot)
        else:
            self._give_back(slot)

    def _flush_drops(self) -> None:
        """On an I/O thread: write the drops queued so far (those queued after this starts post again)."""
        self._flush_posted = False
        journal = self._journal
        assert journal is not None
        _quietly(journal.flush)

    def _give_back(self, slot: int) -> None:
        """A dropped block's slot is free. Its disk space stays allocated for the next write there: a
        write into a punched hole allocates again, and cost a rewrite half its rate (the quota bounds
        the file either way)."""
        self._free.append(slot)

    # -- the threads ---------------------------------------------------------------------

    async def _spread(self, fn: Any, jobs: list[Any], slot: Any) -> list[Any]:
        """Run ``fn`` over ``jobs`` on the I/O threads, each thread a run of neighbouring data slots
        (``slot(job)``: the disk sees ascending runs, and the slots that follow one another move in
        one call); returns one outcome per job, in the order given.

        Returns only once every share has run (the memory is the threads' until then).
        """
        order = sorted(range(len(jobs)), key=lambda i: slot(jobs[i]))
        ordered = [jobs[i] for i in order]
        n = min(len(self._workers), len(ordered))
        share = -(-len(ordered) // n)
        futures = [
            self._workers[next(self._next) % len(self._workers)].submit(fn, ordered[i : i + share])
            for i in range(0, len(ordered), share)
        ]
        self._busy += len(futures)
        try:
            await asyncio.wait(futures)
        finally:
            self._busy -= len(futures)
        # A share that failed as a whole fails its own jobs (its error is each one's outcome); the
        # others' outcomes stand: their blocks may be on file already.
        results: list[Any] = []
        for start, future in zip(range(0, len(ordered), share), futures, strict=True):
            error = future.exception()
            results.extend(future.result() if error is None else [error] * len(ordered[start : start + share]))
        outcomes: list[Any] = [None] * len(jobs)
        for i, outcome in zip(order, results, strict=True):
            outcomes[i] = outcome
        return outcomes

    def __repr__(self) -> str:
        return f"<DiskTier [{self._life.state} | {self.directory} | {len(self._index)}/{self.capacity} blocks]>"

    async def __aenter__(self) -> Self:
        """Open the tier (see ``open()``)."""
        return await super().__aenter__()


def _outcomes(task: asyncio.Future[list[Any]], n: int) -> list[Any]:
    """A finished share-out's outcomes; where it failed as a whole, every job failed."""
    if task.cancelled() or task.exception() is not None:
        return ["failed"] * n
    return task.result()


def _keys(keys: Sequence[object]) -> list[Key]:
    """The keys as bytes and ints (bytes-like and numpy integers converted), each short enough to journal.

    Checked before the call changes anything: a key the journal cannot encode
    would otherwise fail on an I/O thread, after slots were taken for it.
    """
    out = [key_of(key) for key in keys]
    for key in out:
        # encode_key() adds one byte to bytes, and to an int's signed little-endian bytes.
        size = len(key) + 1 if type(key) is bytes else (key.bit_length() + 8) // 8 + 1  # type: ignore[union-attr]
        if size > _MAX_KEY:
            raise ValueError(f"a key of {size} journaled bytes is longer than {_MAX_KEY}")
    return out


def _int(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} is an int, not a bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} is an int, not {type(value).__name__}") from None


def _address(value: object) -> int:
    address = _int(value, "an address")
    if address <= 0:
        raise ValueError(f"an address must be above 0, got {address}")
    return address


def _checksum(address: int, length: int) -> int:
    """The xxh3-64 of ``length`` bytes at ``address``, computed without the GIL: a hasher's
    ``update()`` lets go of it (``xxh3_64_intdigest()`` holds it, and the other I/O threads waited
    behind each block's hash to issue their next read or write)."""
    hasher = xxhash.xxh3_64()
    hasher.update(memory_at(address, length))
    return hasher.intdigest()


def _checksums(spans: list[tuple[int, int]]) -> list[int | Exception]:
    """``_checksum()`` of each ``(address, length)``, on a hashing thread: each block's own outcome."""
    out: list[int | Exception] = []
    for address, length in spans:
        try:
            out.append(_checksum(address, length))
        except Exception as exc:  # this block is skipped, the run's others are not
            out.append(exc)
    return out


def _run(future: Future[Any], fn: Any, *args: Any) -> None:
    """Run ``fn`` for ``future`` unless the future was cancelled before a thread took it."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args)
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _span(address: int, length: int) -> int:
    """The bytes a read may write at ``address``: a direct read moves whole 4 KiB pages."""
    return -(-length // ALIGN) * ALIGN if address % ALIGN == 0 else length


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc} ({errno.errorcode.get(exc.errno or 0, '?')})"
    return repr(exc)


def _drain(worker: Worker) -> None:
    """Stop a worker and wait until it has run what was posted (a drop record, a hole): the files
    close after it, and a descriptor closed under it could be another file's by then."""
    worker.stop()
    worker.join()


def _quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except OSError as exc:  # a drop record lost: the checksum still refuses the slot's next bytes
        log.warning("aiokvtier: a disk tier journal write failed: %s", exc)
