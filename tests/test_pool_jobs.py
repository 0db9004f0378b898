"""The pool mode's jobs without vLLM or torch (``aiokvtier.integrations._pool_jobs``), KV tensors in host
memory: planned keys and pages, a store's pages and seals, leading loads and load errors, cancellation."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aiokvtier import AttachedPool, CopyEngine, Pool
from aiokvtier.integrations._pool_jobs import SEAL, KVTensor, PoolJob, PoolJobs, block_key, seal_count
from tests.test_pool import sock
from tests.test_pool_attack import CONFIG, assert_nothing_left, attack, cases, settle

__all__ = ["sock"]  # the fixture, used by name

ROOT = Path(__file__).resolve().parents[1]
SLOT = 64 << 10
NS = b"ns-jobs!"
BPC = 2
BLOCKS = 16
# Tensor 0: a page of a slot and a half (two pieces, the second shorter) in a padded row; tensor 1: a
# page of a quarter slot. Group 0 holds both, group 1 only tensor 1.
PAGES = (96 << 10, 16 << 10)
ROWS = (100 << 10, 16 << 10)
GROUPS = ((0, 1), (1,))


def arrays(seed: int | None) -> list[np.ndarray]:
    """The KV tensors: random pages (seed) or zeros (None), padding bytes zero."""
    rng = np.random.default_rng(seed)
    out = []
    for page, row in zip(PAGES, ROWS, strict=True):
        a = np.zeros((BLOCKS, row), dtype=np.uint8)
        if seed is not None:
            a[:, :page] = rng.integers(0, 256, (BLOCKS, page), dtype=np.uint8)
        out.append(a)
    return out


def jobs_of(tensors: list[np.ndarray], *, rank: int = 0) -> PoolJobs:
    layout = [KVTensor(a.ctypes.data, a.strides[0], page, a.shape[0]) for a, page in zip(tensors, PAGES, strict=True)]
    return PoolJobs(layout, GROUPS, namespace=NS, rank=rank, blocks_per_chunk=BPC, slot_size=SLOT, device=None)


CHUNKS = [b"chunk-0\0\0\0\0", b"chunk-1\0\0\0\0", b"chunk-2\0\0\0\1"]
SRC_IDS = np.array([3, 5, 7, 9, 2, 4], dtype=np.int64)  # chunks 0 and 1 of group 0, chunk 2 of group 1
DST_IDS = np.array([1, 2, 3, 4, 5, 6], dtype=np.int64)


def plan(jobs: PoolJobs, job_id: int, ids: np.ndarray, *, store: bool) -> PoolJob:
    return jobs.plan(job_id, store=store, chunks=CHUNKS, sizes=[4, 2], first_blocks=[0, 0], ids=ids)


def same_blocks(src: list[np.ndarray], dst: list[np.ndarray], pairs: list[tuple[int, int, int]]) -> bool:
    """``(tensor, src block, dst block)``: the pages equal, and the padding after the page untouched."""
    return all(
        np.array_equal(src[t][s, : PAGES[t]], dst[t][d, : PAGES[t]]) and not dst[t][d, PAGES[t] :].any()
        for t, s, d in pairs
    )


def pairs(src_ids: np.ndarray, dst_ids: np.ndarray, upto: int = 6) -> list[tuple[int, int, int]]:
    out = []
    for i, (s, d) in enumerate(zip(src_ids.tolist()[:upto], dst_ids.tolist()[:upto], strict=True)):
        out += [(t, s, d) for t in (GROUPS[0] if i < 4 else GROUPS[1])]
    return out


def test_a_plan_cuts_pages_into_slot_pieces_and_seals_each_whole_chunk() -> None:
    src = arrays(1)
    jobs = jobs_of(src)
    assert jobs.blocks_per_chunk == [BPC * (2 + 1), BPC * 1]
    job = plan(jobs, 7, SRC_IDS, store=True)
    # Per block of group 0: tensor 0's two pieces and tensor 1's page; per block of group 1: one page;
    # after each chunk's pages, its seal.
    assert len(job.keys) == 4 * 3 + 2 * 1 + 3
    assert job.keys[:3] == [block_key(NS, CHUNKS[0], 0, i) for i in (0, 1, 4)]  # tensor 1 comes after tensor 0's
    assert job.lengths[:3].tolist() == [SLOT, PAGES[0] - SLOT, PAGES[1]]
    base0, base1 = src[0].ctypes.data, src[1].ctypes.data
    assert job.addresses[:3].tolist() == [base0 + 3 * ROWS[0], base0 + 3 * ROWS[0] + SLOT, base1 + 3 * ROWS[1]]
    assert job.nbytes == 4 * sum(PAGES) + 2 * PAGES[1]
    assert [(k, seal_count(s), lo, hi) for k, s, lo, hi in job.seals] == [
        (block_key(NS, CHUNKS[0], 0, SEAL), 6, 0, 6),
        (block_key(NS, CHUNKS[1], 0, SEAL), 6, 7, 13),
        (block_key(NS, CHUNKS[2], 0, SEAL), 2, 14, 16),
    ]
    assert [job.keys[hi] for _, _, _, hi in job.seals] == [k for k, *_ in job.seals]
    assert job.gpu_blocks[[6, 13, 16]].tolist() == [-1, -1, -1] and job.lengths[[6, 13, 16]].tolist() == [8, 8, 8]
    # A seal's page holds its bytes (beside the tensors, where the copies take it from).
    assert [bytes((ctypes.c_ubyte * 8).from_address(int(job.addresses[hi]))) for *_, hi in job.seals] == [
        s for _, s, *_ in job.seals
    ]
    # A store starting inside a chunk leaves that chunk out; a load takes its part.
    part = dict(chunks=CHUNKS[:2], sizes=[3, 0], first_blocks=[1, 0], ids=SRC_IDS[:3])
    stored = jobs.plan(8, store=True, **part)  # type: ignore[arg-type]
    assert stored.keys == [block_key(NS, CHUNKS[1], 0, i) for i in (0, 1, 4, 2, 3, 5, SEAL)]
    loaded = jobs.plan(9, store=False, **part)  # type: ignore[arg-type]
    assert loaded.keys[:3] == [block_key(NS, CHUNKS[0], 0, i) for i in (2, 3, 5)] and not loaded.seals
    assert loaded.unfilled(3) == {5, 7} and loaded.unfilled(len(loaded.keys)) == set()


def test_a_job_that_does_not_match_its_chunks_or_groups_is_refused() -> None:
    jobs = jobs_of(arrays(None))
    for chunks, sizes, ids in [
        (CHUNKS[:2], [4, 2], SRC_IDS),  # a chunk short
        (CHUNKS, [4, 2], SRC_IDS[:5]),  # a block short
        ([*CHUNKS, b"extra"], [4, 2], SRC_IDS),  # a chunk too many
    ]:
        with pytest.raises(ValueError, match="do not match"):
            jobs.plan(1, store=True, chunks=chunks, sizes=sizes, first_blocks=[0, 0], ids=ids)
    with pytest.raises(ValueError, match="gives 1 group sizes for 2 KV cache groups"):
        jobs.plan(1, store=True, chunks=CHUNKS, sizes=[6], first_blocks=[0], ids=SRC_IDS)
    layout = [KVTensor(0, 10, 10, 4)]
    with pytest.raises(ValueError, match="no KV cache tensors"):
        PoolJobs([], [(0,)], namespace=NS, rank=0, blocks_per_chunk=1, slot_size=SLOT, device=None)
    with pytest.raises(ValueError, match="no KV cache group references a tensor"):
        PoolJobs(layout, [()], namespace=NS, rank=0, blocks_per_chunk=1, slot_size=SLOT, device=None)
    with pytest.raises(ValueError, match="names a tensor that is not there"):
        PoolJobs(layout, [(1,)], namespace=NS, rank=0, blocks_per_chunk=1, slot_size=SLOT, device=None)
    with pytest.raises(ValueError, match="bad geometry"):
        PoolJobs(layout, [(0,)], namespace=NS, rank=1 << 16, blocks_per_chunk=1, slot_size=SLOT, device=None)


def test_the_core_imports_neither_vllm_nor_torch() -> None:
    code = "import sys, aiokvtier.integrations._pool_jobs; print(sorted({'vllm', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out


async def test_a_job_stored_by_one_attached_pool_loads_bit_exact_in_another_with_its_seals(sock: str) -> None:
    src, dst = arrays(2), arrays(None)
    async with Pool(CONFIG, sock) as pool:
        async with AttachedPool(sock) as a, AttachedPool(sock) as b:
            storing = plan(jobs_of(src), 1, SRC_IDS, store=True)
            assert await jobs_of(src).store(a, storing) == storing.nbytes
            seals = [k for k, *_ in storing.seals]
            got = np.zeros((3, 8), dtype=np.uint8)
            await b.load(seals, got)
            assert [seal_count(row.tobytes()) for row in got] == [6, 6, 2]
            loading = plan(jobs_of(dst), 2, DST_IDS, store=False)
            assert await jobs_of(dst).load(b, loading) == len(loading.keys)
            assert same_blocks(src, dst, pairs(SRC_IDS, DST_IDS))
            # Stored again: every page present, nothing copied, the seals present too.
            assert await jobs_of(src).store(b, plan(jobs_of(src), 3, SRC_IDS, store=True)) == 0
            assert pool.statistics().blocks == len(storing.keys)
        await settle(pool, held=0)
    await assert_nothing_left()


async def test_a_load_copies_the_leading_blocks_still_there_and_names_the_rest(sock: str) -> None:
    src = arrays(3)
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as a:
        await jobs_of(src).store(a, plan(jobs_of(src), 1, SRC_IDS, store=True))
        # Another process drops the second piece of tensor 0's page of the chunk 1's first block.
        assert await a.discard([block_key(NS, CHUNKS[1], 0, 1)]) == 1
        dst = arrays(None)
        job = plan(jobs_of(dst), 2, DST_IDS, store=False)
        count = await jobs_of(dst).load(a, job)
        assert count == 6  # chunk 0's two blocks, whole; the block whose piece is gone is not half-loaded
        assert job.unfilled(count) == {3, 4, 5, 6}
        assert same_blocks(src, dst, pairs(SRC_IDS, DST_IDS, upto=2))
        assert not dst[0][3].any() and not dst[1][3].any()  # nothing of the missing block's other pages
        # Evicted by other stores: the pool (256 slots) takes 256 other blocks, least recently used first.
        filler = np.ones((256, 4096), dtype=np.uint8)
        await a.store([b"filler-%d" % i for i in range(256)], filler)
        assert await jobs_of(dst).load(a, job) == 0
        assert job.unfilled(0) == set(DST_IDS.tolist())
        await settle(pool)


async def test_a_pool_too_small_for_a_store_seals_only_the_chunks_it_holds_whole(sock: str) -> None:
    # One tensor of a slot a page, 300 blocks of 4-block chunks, into a pool of 256 slots.
    tensor = np.arange(300 * SLOT, dtype=np.uint64).view(np.uint8).reshape(300, -1)[:, :SLOT].copy()
    jobs = PoolJobs(
        [KVTensor(tensor.ctypes.data, SLOT, SLOT, 300)],
        [(0,)],
        namespace=NS,
        rank=0,
        blocks_per_chunk=4,
        slot_size=SLOT,
        device=None,
    )
    chunks = [b"big-%03d" % c for c in range(75)]
    job = jobs.plan(1, store=True, chunks=chunks, sizes=[300], first_blocks=[0], ids=np.arange(300, dtype=np.int64))
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as a:
        stored = await jobs.store(a, job)
        # The pool skips the keys from the first that does not fit: the leading chunks are whole (pages and
        # seal), the one the skip cuts has some pages and no seal, the rest nothing.
        sealed = [bool(await a.lookup([block_key(NS, c, 0, SEAL)])) for c in chunks]
        whole = sum(sealed)
        assert 0 < whole < 75 and sealed == [c < whole for c in range(75)], sealed
        assert await a.lookup([block_key(NS, c, 0, i) for c in chunks[:whole] for i in range(4)]) == 4 * whole
        assert whole * 4 * SLOT <= stored < (whole + 1) * 4 * SLOT
        assert pool.statistics().blocks == stored // SLOT + whole
        await settle(pool)


async def test_cancelled_stores_and_loads_hold_nothing_and_leave_each_chunk_whole_or_absent(sock: str) -> None:
    src = arrays(4)
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as a:
        jobs = jobs_of(src)
        for how, delay in cases():
            job = plan(jobs, 1, SRC_IDS, store=True)
            await attack(lambda j=job: jobs.store(a, j), how, delay)  # type: ignore[misc]
            await settle(pool)
            for _, _, lo, hi in job.seals:
                visible = [await a.lookup([k]) for k in job.keys[lo : hi + 1]]
                assert sum(visible) in (0, hi + 1 - lo), (how, delay, visible)
            await jobs.store(a, job)
            dst = arrays(None)
            loading = plan(jobs_of(dst), 2, DST_IDS, store=False)
            await attack(lambda j=loading, d=dst: jobs_of(d).load(a, j), how, delay)  # type: ignore[misc]
            await settle(pool)
            assert await jobs_of(dst).load(a, loading) == len(loading.keys)
            assert same_blocks(src, dst, pairs(SRC_IDS, DST_IDS)), (how, delay)
            await a.discard(job.keys)
            await settle(pool)


async def test_an_engine_that_does_not_match_the_tensors_is_refused_before_anything_is_asked(sock: str) -> None:
    src = arrays(5)
    host = jobs_of(src)
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as a, CopyEngine(None) as engine:
        job = plan(host, 1, SRC_IDS, store=True)
        with pytest.raises(ValueError, match="lie in host memory: copy without an engine"):
            await host.store(a, job, engine=engine)
        with pytest.raises(ValueError, match="job 1 is a store"):
            await host.load(a, job)
        with pytest.raises(ValueError, match="job 2 is a load"):
            await host.store(a, plan(host, 2, SRC_IDS, store=False))
        assert await a.lookup(job.keys) == 0
        await settle(pool)
