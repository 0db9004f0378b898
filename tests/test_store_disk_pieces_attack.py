"""A half-on-disk load (its tail brought back from the disk tier in pieces) attacked: cancelled at every
await, a piece's read failing or damaged, its key discarded meanwhile, the tiers closed under it, and
hostile destinations. Afterwards nothing is pinned, claimed or in flight, and no thread is left."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiokvtier import BlockNotFound, BlockStore, DiskTier, HostTier, QuotaError
from aiokvtier._disk._io import DataFile

from .helpers import eventually
from .invariants import wait_no_library_threads
from .test_disk_attack import Gate, gate
from .test_store_disk_pieces import DATA, HEAD, KEYS, PER, SLOT, TAIL, begun, prefix, settled

pytestmark = pytest.mark.timeout(180)

TICKS = tuple(range(0, 60, 4))
"""Turns of the loop before a ``task.cancel()``: one lands inside each await of the load."""


def intact_or_untouched(out: np.ndarray, keys: list[bytes] = KEYS) -> int:
    """Every destination page is its block whole, or untouched (zeros): never part of one, never
    another's bytes. Returns how many pages were written."""
    written = 0
    for i, key in enumerate(keys):
        row = out[i]
        if row.any():
            assert np.array_equal(row, DATA[KEYS.index(key)]), f"page {i} holds neither its block nor zeros"
            written += 1
    return written


async def reload_exact(tier: HostTier, store: BlockStore, disk: DiskTier) -> None:
    """A later load of every key lands bit-exact, and leaves everything settled."""
    out = np.zeros_like(DATA)
    await store.load(KEYS, out)
    assert np.array_equal(out, DATA)
    settled(tier, store, disk)


async def quiet(tier: HostTier, store: BlockStore, disk: DiskTier) -> None:
    """Once the write-backs a load's hits queued are done: settled."""
    await eventually(lambda: store.statistics().in_flight == 0 and disk.statistics().queue_depth == 0)
    settled(tier, store, disk)


def slot_on_disk(disk: DiskTier, i: int) -> int:
    """The disk tier's data slot of ``KEYS[i]``, found by its bytes in the data file."""
    path = os.path.join(disk.statistics().path, "blocks")
    with open(path, "rb") as f:
        whole = f.read()
    at = whole.find(DATA[i].tobytes())
    assert at >= 0 and at % SLOT == 0
    return at // SLOT


def corrupt(disk: DiskTier, slot: int) -> None:
    """Flip a byte of a block in the data file (behind the tier's back)."""
    path = os.path.join(disk.statistics().path, "blocks")
    fd = os.open(path, os.O_RDWR)
    try:
        offset = slot * SLOT + 1234
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset)
    finally:
        os.close(fd)


def fail_reads_of(monkeypatch: pytest.MonkeyPatch, slots: set[int], code: int = errno.EIO) -> None:
    """Reads of these data slots fail with ``code`` (the other blocks of the call are read)."""
    real = DataFile.read_blocks

    def read_blocks(data: DataFile, blocks: Any) -> Iterator[Exception | None]:
        blocks = list(blocks)
        good = [b for b in blocks if b[0] not in slots]
        outcomes = iter(real(data, good))
        for block in blocks:
            yield OSError(code, os.strerror(code)) if block[0] in slots else next(outcomes)

    monkeypatch.setattr(DataFile, "read_blocks", read_blocks)


@asynccontextmanager
async def load_held_in_a_read(
    monkeypatch: pytest.MonkeyPatch, store: BlockStore
) -> AsyncIterator[tuple[asyncio.Future[None], Gate, np.ndarray]]:
    """A load of every key into a zeroed destination, begun as a task and held inside its first piece's
    read until the gate is released (it is on the way out, whatever happened); with the destination."""
    out = np.zeros_like(DATA)
    with gate(monkeypatch, "read_blocks") as g:
        load = asyncio.ensure_future(store.load(KEYS, out))
        await g.reached()
        yield load, g, out


async def closed_under_a_read(g: Gate, close: Callable[[], Awaitable[None]], *waiting: asyncio.Future[None]) -> None:
    """``close()`` begun while the gate holds a read waits for it (and so does each of ``waiting``), and
    ends once the read is let go."""
    closing = asyncio.ensure_future(close())
    await asyncio.sleep(0.05)
    assert not closing.done()  # a read in flight uses the files and the host slots
    assert not any(w.done() for w in waiting)
    await g.release()
    await closing


@asynccontextmanager
async def nothing_unretrieved(caplog: pytest.LogCaptureFixture) -> AsyncIterator[None]:
    """The body leaves no failed task whose exception nobody retrieved (the loop logs one as an error when
    it is collected)."""
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        yield
        gc.collect()
        await asyncio.sleep(0)
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


async def cancel_after(call: Callable[[], Coroutine[Any, Any, Any]], ticks: int) -> bool:
    """Run ``call()`` as a task and cancel it after ``ticks`` turns of the loop; True if it was cancelled."""
    task = await begun(call(), ticks)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return True
    return False


# -- cancellation at every await --------------------------------------------------------------------


@pytest.mark.parametrize("ticks", TICKS)
async def test_a_load_cancelled_after_any_number_of_turns_holds_nothing_and_writes_whole_pages(
    tmp_path: Path, ticks: int
) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        out = np.zeros_like(DATA)
        cancelled = await cancel_after(lambda: store.load(KEYS, out), ticks)
        settled(tier, store, disk)
        written = intact_or_untouched(out)
        if not cancelled:
            assert written == len(KEYS)
        then = out.copy()
        await asyncio.sleep(0.02)  # nothing of the load writes into the destination once it ended
        assert np.array_equal(out, then)
        await reload_exact(tier, store, disk)


@pytest.mark.parametrize("delay", [0.0, 0.0003, 0.001, 0.003, 0.01, 0.03])
async def test_a_load_whose_taskgroup_sibling_fails_holds_nothing(tmp_path: Path, delay: float) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        out = np.zeros_like(DATA)

        async def sibling() -> None:
            await asyncio.sleep(delay)
            raise LookupError("the sibling failed")

        with pytest.raises(ExceptionGroup) as group:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(store.load(KEYS, out))
                tg.create_task(sibling())
        assert group.group_contains(LookupError)
        settled(tier, store, disk)
        intact_or_untouched(out)
        await reload_exact(tier, store, disk)


@pytest.mark.parametrize("delay", [0.0, 0.0005, 0.002, 0.008, 0.03])
async def test_a_load_under_asyncio_timeout_ends_as_a_timeout_and_leaves_the_task_uncancelled(
    tmp_path: Path, delay: float
) -> None:
    """``asyncio.timeout`` turns its own cancellation into TimeoutError only if the load lets that very
    cancellation out (one swallowed, or another raised in its place, would leave the task cancelled)."""
    async with prefix(tmp_path) as (tier, store, disk):
        out = np.zeros_like(DATA)
        task = asyncio.current_task()
        assert task is not None
        try:
            async with asyncio.timeout(delay):
                await store.load(KEYS, out)
        except TimeoutError:
            pass
        assert task.cancelling() == 0
        settled(tier, store, disk)
        intact_or_untouched(out)
        await reload_exact(tier, store, disk)


async def test_a_load_cancelled_while_every_piece_reads_waits_for_the_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancellation comes only once the disk's threads let go of the host slots; the pieces not
    read are not read, and their slots go back."""
    async with prefix(tmp_path) as (tier, store, disk):
        async with load_held_in_a_read(monkeypatch, store) as (load, g, out):
            load.cancel()
            await asyncio.sleep(0.05)
            assert not load.done()  # a read holds host slots: the load waits for it
            await g.release()
            with pytest.raises(asyncio.CancelledError):
                await load
        settled(tier, store, disk)
        intact_or_untouched(out)
        await reload_exact(tier, store, disk)


# -- a piece's read failing ---------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["eio", "checksum"])
async def test_a_damaged_block_in_one_piece_is_a_miss_once_the_others_landed_and_is_never_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        bad = HEAD + 2 * PER + 3  # in the third piece
        slot = await asyncio.to_thread(slot_on_disk, disk, bad)
        if damage == "eio":
            fail_reads_of(monkeypatch, {slot})
        else:
            await asyncio.to_thread(corrupt, disk, slot)
        out = np.zeros_like(DATA)
        with pytest.raises(BlockNotFound, match=repr(KEYS[bad])):
            await store.load(KEYS, out)
        monkeypatch.undo()
        settled(tier, store, disk)
        piece = range(HEAD + 2 * PER, HEAD + 3 * PER)
        others = [i for i in range(len(KEYS)) if i not in piece]
        assert np.array_equal(out[others], DATA[others])  # every other piece landed and was copied
        assert not out[list(piece)].any()
        d = disk.statistics()
        assert (d.read_errors, d.checksum_failures) == ((1, 0) if damage == "eio" else (0, 1))
        assert KEYS[bad] not in disk and KEYS[bad] not in store  # dropped: never served again
        assert store.lookup(KEYS) == bad
        with pytest.raises(BlockNotFound, match=repr(KEYS[bad])):
            await store.load(KEYS, np.zeros_like(DATA))
        rest = [i for i in range(len(KEYS)) if i != bad]
        again = np.zeros((len(rest), SLOT), dtype=np.uint8)
        await store.load([KEYS[i] for i in rest], again)  # the piece's other blocks are still on disk
        assert np.array_equal(again, DATA[rest])
        settled(tier, store, disk)


async def test_a_read_that_fails_for_the_memory_is_a_miss_but_keeps_the_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EFAULT says the memory could not be written, not that the file is bad: the block stays on disk."""
    async with prefix(tmp_path) as (tier, store, disk):
        bad = HEAD + PER + 1
        fail_reads_of(monkeypatch, {await asyncio.to_thread(slot_on_disk, disk, bad)}, errno.EFAULT)
        with pytest.raises(BlockNotFound, match=repr(KEYS[bad])):
            await store.load(KEYS, np.zeros_like(DATA))
        monkeypatch.undo()
        assert KEYS[bad] in disk
        settled(tier, store, disk)
        await reload_exact(tier, store, disk)


async def test_short_reads_are_read_again_to_the_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        real = os.preadv
        shorts = 0

        def preadv(fd: int, buffers: list[Any], offset: int, *args: Any) -> int:
            nonlocal shorts
            total = sum(memoryview(b).nbytes for b in buffers)
            if total > 4096 and shorts < 20:  # half of it, as a signal or a device may give
                shorts += 1
                view = memoryview(buffers[0]).cast("B")
                return real(fd, [view[: min(view.nbytes, total // 2) // 4096 * 4096 or 4096]], offset)
            return real(fd, buffers, offset, *args)

        monkeypatch.setattr(os, "preadv", preadv)
        out = np.zeros_like(DATA)
        await store.load(KEYS, out)
        monkeypatch.undo()
        assert shorts and np.array_equal(out, DATA)
        d = disk.statistics()
        assert d.read_errors == 0 and d.checksum_failures == 0
        settled(tier, store, disk)


async def test_two_failed_pieces_raise_the_first_in_the_keys_order_and_log_nothing_unretrieved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every piece's outcome is taken, not only the first failure's: a failed task whose exception nobody
    retrieved is logged by the loop as an error when it is collected."""
    async with prefix(tmp_path) as (tier, store, disk):
        first, second = HEAD + PER + 2, HEAD + 3 * PER + 5
        slots = {await asyncio.to_thread(slot_on_disk, disk, i) for i in (first, second)}
        fail_reads_of(monkeypatch, slots)
        async with nothing_unretrieved(caplog):
            with pytest.raises(BlockNotFound, match=repr(KEYS[first])):
                await store.load(KEYS, np.zeros_like(DATA))
        monkeypatch.undo()
        settled(tier, store, disk)


async def test_a_cancelled_load_with_a_failed_piece_logs_nothing_unretrieved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        fail_reads_of(monkeypatch, {await asyncio.to_thread(slot_on_disk, disk, HEAD + 1)})
        async with (
            nothing_unretrieved(caplog),
            load_held_in_a_read(monkeypatch, store) as (load, g, _),
        ):
            load.cancel()
            await g.release()
            with pytest.raises(asyncio.CancelledError):
                await load
        monkeypatch.undo()
        settled(tier, store, disk)


# -- the key discarded or evicted while its piece is read ----------------------------------------


async def test_a_key_discarded_while_its_piece_is_read_is_not_in_the_store_afterwards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A discard says the block is wrong or unwanted everywhere: a promotion in flight must not bring it
    back into the host tier after the discard returned."""
    async with prefix(tmp_path) as (tier, store, disk):
        victim = HEAD + 2 * PER + 4
        async with load_held_in_a_read(monkeypatch, store) as (load, g, out):
            store.discard([KEYS[victim]])
            assert KEYS[victim] not in disk and KEYS[victim] not in store
            await g.release()
            try:
                await load
            except BlockNotFound as exc:
                assert exc.key == KEYS[victim]
        intact_or_untouched(out)
        assert KEYS[victim] not in store and KEYS[victim] not in disk
        assert store.lookup(KEYS) == victim
        settled(tier, store, disk)


async def test_a_key_discarded_once_its_read_ended_but_before_it_was_ready_does_not_land(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The discard comes in the turn between the read's end and the block's landing (the store passes
    over a block that is not ready yet): the promotion drops it again, and the load names it."""
    async with prefix(tmp_path) as (tier, store, disk):
        victim = HEAD + PER + 6
        real_read = disk.read

        async def read(keys: list[bytes], addresses: list[int]) -> tuple[bool, ...]:
            arrived = await real_read(keys, addresses)
            if KEYS[victim] in keys:
                asyncio.get_running_loop().call_soon(store.discard, [KEYS[victim]])
            return arrived

        monkeypatch.setattr(disk, "read", read)
        out = np.zeros_like(DATA)
        with pytest.raises(BlockNotFound, match=repr(KEYS[victim])):
            await store.load(KEYS, out)
        monkeypatch.undo()
        assert KEYS[victim] not in store and KEYS[victim] not in disk
        piece = range(HEAD + PER, HEAD + 2 * PER)
        others = [i for i in range(len(KEYS)) if i not in piece]
        assert np.array_equal(out[others], DATA[others])
        await quiet(tier, store, disk)
        assert store.lookup(KEYS) == victim


async def test_blocks_evicted_from_the_disk_tier_while_their_piece_is_read_still_arrive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dropped while a read holds their data slots: the slots are reused only after the read let go."""
    async with prefix(tmp_path) as (tier, store, disk):
        async with load_held_in_a_read(monkeypatch, store) as (load, g, out):
            assert disk.discard(KEYS[HEAD:]) > 0  # what an eviction by a write does to the index
            await g.release()
            await load  # the bytes were read whole before the slots were given to anyone
        assert np.array_equal(out, DATA)
        await quiet(tier, store, disk)  # the blocks the load hit are written back again
        assert all(k in disk for k in KEYS)


async def test_a_load_racing_stores_that_evict_its_promoted_blocks_is_exact_or_a_miss(tmp_path: Path) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        others = [b"x%d" % i for i in range(tier.slots_total)]
        filler = np.full((len(others), SLOT), 7, dtype=np.uint8)

        async def churn() -> None:
            for i in range(0, len(others), 4):
                await store.store(others[i : i + 4], filler[i : i + 4])
                await asyncio.sleep(0)

        for _ in range(3):
            out = np.zeros_like(DATA)
            results = await asyncio.gather(store.load(KEYS, out), churn(), return_exceptions=True)
            assert results[1] is None
            if results[0] is not None:
                assert isinstance(results[0], BlockNotFound)
            else:
                assert np.array_equal(out, DATA)
            intact_or_untouched(out)
            settled(tier, store, disk)


# -- the tiers closed under the load ----------------------------------------------------------------


async def test_the_disk_tier_closed_while_pieces_read_waits_for_them_and_the_load_gets_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        async with load_held_in_a_read(monkeypatch, store) as (load, g, out):
            await closed_under_a_read(g, disk.aclose)
            try:
                await load
            except BlockNotFound as exc:
                assert exc.key in KEYS[HEAD:]
        intact_or_untouched(out)
        s = store.statistics()
        assert s.in_flight == 0 and s.blocks_pinned == 0
        store.check_invariants(sole_user=True)
        assert tier.statistics().slots_allocated == len(store)
        # What is left: the host tier's blocks, served; the disk's, gone with it.
        assert store.lookup(KEYS) >= HEAD
        await store.aclose()
        assert tier.statistics().slots_allocated == 0
    await wait_no_library_threads()


async def test_the_store_closed_while_pieces_read_waits_for_the_load_to_land(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        async with load_held_in_a_read(monkeypatch, store) as (load, g, out):
            await closed_under_a_read(g, store.aclose, load)
        await load
        assert np.array_equal(out, DATA)
        assert tier.statistics().slots_allocated == 0
        d = disk.statistics()
        assert d.queue_depth == 0 and d.blocks + d.free == d.capacity
    await wait_no_library_threads()


# -- hostile destinations and keys ------------------------------------------------------------------


def untouched(tier: HostTier, store: BlockStore, disk: DiskTier, reads: int) -> None:
    """Nothing was brought back: the disk read nothing, the tail is still absent from the host tier."""
    assert disk.statistics().hits == reads
    assert [k in store for k in KEYS] == [True] * HEAD + [False] * TAIL
    settled(tier, store, disk)


async def test_a_destination_too_short_for_a_tail_block_changes_nothing(tmp_path: Path) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        reads = disk.statistics().hits
        rows = [bytearray(SLOT) for _ in KEYS]
        rows[-1] = bytearray(SLOT - 4096)
        with pytest.raises(ValueError, match=f"destination page {len(KEYS) - 1} has"):
            await store.load(KEYS, rows)
        assert not any(any(r) for r in rows)
        untouched(tier, store, disk, reads)


@pytest.mark.parametrize("kind", ["readonly", "bytes", "float32", "short", "one"])
async def test_a_destination_that_cannot_take_the_pages_changes_nothing(tmp_path: Path, kind: str) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        reads = disk.statistics().hits
        dst: Any
        if kind == "readonly":
            dst = np.zeros_like(DATA)
            dst.flags.writeable = False
        elif kind == "bytes":
            dst = [bytes(SLOT) for _ in KEYS]
        elif kind == "float32":
            dst = np.zeros((len(KEYS), SLOT // 4), dtype=np.float32)
        elif kind == "short":
            dst = np.zeros((len(KEYS) - 1, SLOT), dtype=np.uint8)
        else:
            dst = np.zeros(SLOT, dtype=np.uint8)
        with pytest.raises((ValueError, TypeError)):
            await store.load(KEYS, dst)
        if isinstance(dst, np.ndarray):
            assert not dst.any()
        untouched(tier, store, disk, reads)


async def test_a_destination_in_the_stores_own_blocks_is_refused_before_any_piece_is_read(tmp_path: Path) -> None:
    """A page over one of the store's blocks would overwrite it (its key then names other bytes): refused
    up front, nothing copied and nothing brought back, whichever key's page it is."""
    async with prefix(tmp_path) as (tier, store, disk):
        reads = disk.statistics().hits
        views = [memoryview(bytearray(SLOT)) for _ in KEYS]
        block = tier.view(store.slot(KEYS[0]))
        try:
            views[-1] = block  # the last key's page (a tail block's) lies in KEYS[0]'s slot
            with pytest.raises(ValueError, match="a block of this store"):
                await store.load(KEYS, views)
            assert bytes(block) == DATA[0].tobytes()
            assert not any(any(v) for v in views[:-1])
        finally:
            block.release()
        untouched(tier, store, disk, reads)


async def test_keys_repeated_within_and_across_pieces_and_the_head(tmp_path: Path) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        order = [*range(HEAD + TAIL)] * 2 + [HEAD + PER] * 3 + [0, 1]
        wanted = [KEYS[i] for i in order]
        out = np.zeros((len(wanted), SLOT), dtype=np.uint8)
        await store.load(wanted, out)
        assert np.array_equal(out, DATA[order])
        assert store.statistics().promoted == TAIL
        settled(tier, store, disk)


async def test_a_load_and_the_same_load_at_once_share_the_promotions(tmp_path: Path) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        outs = [np.zeros_like(DATA) for _ in range(3)]
        await asyncio.gather(*(store.load(KEYS, out) for out in outs))
        assert all(np.array_equal(out, DATA) for out in outs)
        assert store.statistics().promoted == TAIL
        settled(tier, store, disk)
        await eventually(lambda: disk.statistics().queue_depth == 0)


@pytest.mark.parametrize("ticks", TICKS[::2])
async def test_a_load_cancelled_while_another_load_waits_on_its_promotions(tmp_path: Path, ticks: int) -> None:
    """The second load waits for the first's claims; the first cancelled, the second brings the blocks
    back itself and lands bit-exact."""
    async with prefix(tmp_path) as (tier, store, disk):
        first, second = np.zeros_like(DATA), np.zeros_like(DATA)
        other = asyncio.ensure_future(store.load(KEYS, second))
        await cancel_after(lambda: store.load(KEYS, first), ticks)
        await other
        assert np.array_equal(second, DATA)
        intact_or_untouched(first)
        settled(tier, store, disk)


@pytest.mark.parametrize("ticks", [0, 2, 6, 12, 24])
async def test_a_shrink_racing_the_load_is_refused_or_evicts_and_nothing_is_held(tmp_path: Path, ticks: int) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        out = np.zeros_like(DATA)
        load = await begun(store.load(KEYS, out), ticks)
        try:
            await store.resize((HEAD + PER) * SLOT)
        except QuotaError:
            pass  # a block past the new end is being stored or loaded
        try:
            await load
        except BlockNotFound:
            pass  # a piece found no room
        intact_or_untouched(out)
        await quiet(tier, store, disk)
        assert tier.statistics().slots_allocated == len(store) <= tier.slots_total


async def test_a_tail_the_host_tier_cannot_hold_at_once_is_a_miss_that_holds_nothing(tmp_path: Path) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        await store.resize((2 * PER + 2) * SLOT)  # the head and two pieces' room; the tail is five
        out = np.zeros_like(DATA)
        try:
            await store.load(KEYS, out)
        except BlockNotFound as exc:
            assert exc.key in KEYS
        intact_or_untouched(out)
        await quiet(tier, store, disk)
        assert all(k in disk for k in KEYS)  # nothing the load failed to bring back was dropped below


@pytest.mark.parametrize("head", [True, False])
async def test_after_without_an_engine_is_refused_before_any_piece_is_read(tmp_path: Path, head: bool) -> None:
    async with prefix(tmp_path) as (tier, store, disk):
        reads = disk.statistics().hits
        wanted = KEYS if head else KEYS[HEAD:]
        out = np.zeros((len(wanted), SLOT), dtype=np.uint8)
        with pytest.raises(ValueError, match="after= needs a CopyEngine"):
            await store.load(wanted, out, after=object())
        assert not out.any()
        untouched(tier, store, disk, reads)
