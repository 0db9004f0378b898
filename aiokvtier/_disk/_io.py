"""Block I/O between memory (by address) and one data file of fixed-size slots.

``O_DIRECT`` where the file system takes it (the page cache would hold a
second copy of blocks that are already in the host tier); buffered I/O where
it refuses (tmpfs, some overlayfs), said once in the log. Direct I/O needs
the memory, the offset and the length aligned to the device's block: slots
of a tier or a StaticHostMem are page-aligned and whole pages long, so a
block's length is rounded up to ``ALIGN`` inside its slot.

Blocks bound for neighbouring slots move in one ``pwritev``/``preadv`` (a
run), one buffer per block: a system call per block cost more of the CPU
than the copy on a small machine. A run that fails or comes up short is
done again a block at a time, so each block gets its own outcome. The
outcomes come out a run at a time: the caller hashes a run's blocks before
the next run moves, as it hashed each block after its own call (a share
hashed only after all its calls left the disk idle while the threads
hashed: 2 MiB writes on the development VM went from 0.97-1.02x the plain
loop to 0.85-0.87x).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
from collections.abc import Callable, Iterator, Sequence

__all__ = ["ALIGN", "MAX_RUN_BYTES", "DataFile", "memory_at"]

log = logging.getLogger("aiokvtier")

ALIGN = 4096
MAX_RUN_BYTES = 2 << 20
"""Bytes in one call (at most 512 buffers of 4 KiB, within ``IOV_MAX``). On the development VM
runs of 1-8 MiB moved 64 KiB blocks alike, and 256 KiB runs kept most of the system time a call
per block cost; a thread hashes a run's blocks before its next call, so shorter runs keep the
disk busier."""

Block = tuple[int, int, int]
"""A block's data slot, its memory's address and its length."""


def memory_at(address: int, length: int) -> memoryview:
    """``length`` bytes of memory at ``address`` as a buffer (the caller keeps the memory alive)."""
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


class DataFile:
    """``slots`` slots of ``slot_bytes`` (a multiple of ``ALIGN``) in one sparse file."""

    def __init__(self, path: str, slots: int, slot_bytes: int) -> None:
        self.path = path
        self.slot_bytes = slot_bytes
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._direct: int | None = None
        try:
            if os.fstat(self._fd).st_size < slots * slot_bytes:
                os.ftruncate(self._fd, slots * slot_bytes)  # sparse: the disk fills as blocks arrive
            self._direct = self._open_direct()
        except BaseException:
            os.close(self._fd)
            raise
        self.direct_why = None if self._direct is not None else self._refused
        """Why I/O is buffered (the file system refused ``O_DIRECT``); None: direct."""

    _refused = "O_DIRECT is not supported"

    def _open_direct(self) -> int | None:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            self._refused = "this platform has no O_DIRECT"
            return None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | flag)
        except OSError as exc:
            self._refused = f"the file system refused O_DIRECT ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
            return None
        # Some file systems accept the flag and fail the first I/O: read one aligned block to know.
        probe = mmap.mmap(-1, ALIGN)
        try:
            os.preadv(fd, [probe], 0)
        except OSError as exc:
            os.close(fd)
            self._refused = f"O_DIRECT reads fail here ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
            return None
        finally:
            probe.close()
        return fd

    @property
    def direct(self) -> bool:
        return self._direct is not None

    def _fd_for(self, address: int, length: int) -> tuple[int, int]:
        """The descriptor and the length to move: direct for aligned memory (the length rounded up)."""
        if self._direct is not None and address % ALIGN == 0:
            return self._direct, -(-length // ALIGN) * ALIGN
        return self._fd, length

    def write(self, slot: int, address: int, length: int) -> None:
        """Write ``length`` bytes at ``address`` into ``slot`` (memory up to the rounded length is readable)."""
        fd, n = self._fd_for(address, length)
        view, offset, done = memory_at(address, n), slot * self.slot_bytes, 0
        while done < n:
            wrote = os.pwritev(fd, [view[done:]], offset + done)
            if wrote <= 0:
                raise OSError(errno.EIO, f"a write to {self.path} made no progress")
            done += wrote

    def runs(self, blocks: Sequence[Block]) -> Iterator[tuple[int, int, int, list[int]]]:
        """Split ``blocks`` (in the order given) into runs that one call can move: each run's
        ``(start, stop, fd, lengths)``, ``blocks[start:stop]`` bound for slots one after another on
        one descriptor, every block but the last filling its slot (nothing between them in the file),
        ``MAX_RUN_BYTES`` at most unless one block is longer."""
        start, lengths, fd, total = 0, list[int](), -1, 0
        for i, (slot, address, length) in enumerate(blocks):
            this_fd, n = self._fd_for(address, length)
            if lengths and (
                this_fd != fd
                or slot != blocks[i - 1][0] + 1
                or lengths[-1] != self.slot_bytes
                or total + n > MAX_RUN_BYTES
            ):
                yield start, i, fd, lengths
                start, lengths, total = i, [], 0
            fd, total = this_fd, total + n
            lengths.append(n)
        if lengths:
            yield start, len(blocks), fd, lengths

    def write_blocks(
        self, blocks: Sequence[Block], before: Callable[[], None] | None = None
    ) -> Iterator[Exception | None]:
        """Write each ``(slot, address, length)``; yields, per block in order, None or why it was not
        written, a run's blocks once the run is written (the caller works on them before the next).

        ``before()``: called as each run is about to be written, the previous run's outcomes all
        yielded, so the caller can start work on those blocks beside the call."""
        return self._move(blocks, write=True, before=before)

    def read_blocks(self, blocks: Sequence[Block]) -> Iterator[Exception | None]:
        """Read each ``(slot, address, length)``; yields, per block in order, None or why it did not
        arrive, a run's blocks once the run is read."""
        return self._move(blocks, write=False)

    def _move(
        self, blocks: Sequence[Block], write: bool, before: Callable[[], None] | None = None
    ) -> Iterator[Exception | None]:
        call, one = (os.pwritev, self.write) if write else (os.preadv, self.read)
        for start, stop, fd, lengths in self.runs(blocks):
            if before is not None:
                before()
            if stop - start == 1:  # no neighbour to move with: the block's own call, without a run's bookkeeping
                try:
                    one(*blocks[start])
                except Exception as exc:
                    yield exc
                else:
                    yield None
                continue
            done = 0
            views = [memory_at(address, n) for (_, address, _), n in zip(blocks[start:stop], lengths, strict=True)]
            with contextlib.suppress(Exception):  # a block at a time says which blocks failed, and why
                done = call(fd, views, blocks[start][0] * self.slot_bytes)
            # Blocks the run moved whole are done; the rest one at a time (a block half-moved again from its start).
            for i, n in zip(range(start, stop), lengths, strict=True):
                done -= n
                if done >= 0:
                    yield None
                    continue
                slot, address, length = blocks[i]
                try:
                    one(slot, address, length)
                except Exception as exc:
                    yield exc
                    continue
                yield None

    def read(self, slot: int, address: int, length: int) -> None:
        """Read ``slot``'s first ``length`` bytes to ``address`` (writable up to the rounded length)."""
        fd, n = self._fd_for(address, length)
        view, offset, done = memory_at(address, n), slot * self.slot_bytes, 0
        while done < n:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(errno.EIO, f"{self.path} ended inside slot {slot}")
            done += got

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        if self._direct is not None:
            os.close(self._direct)
        os.close(self._fd)
