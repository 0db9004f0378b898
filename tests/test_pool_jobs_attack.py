"""The pool mode's job core (``_pool_jobs``, KV tensors in host memory) attacked: hostile plans (block ids,
group sizes and first blocks of a wrong type or range), jobs that repeat a chunk or a GPU block, jobs on a
closed attachment, the pool's owner closing under them. Afterwards the owner holds nothing claimed or
pinned, and no thread or mapping is left."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from aiokvtier import AttachedPool, Pool, PoolLostError, TierClosedError
from aiokvtier.integrations._pool_jobs import KVTensor, PoolJobs

from .test_pool import sock
from .test_pool_attack import CONFIG, assert_nothing_left, settle
from .test_pool_jobs import (
    BLOCKS,
    CHUNKS,
    DST_IDS,
    GROUPS,
    PAGES,
    ROWS,
    SRC_IDS,
    arrays,
    jobs_of,
    pairs,
    plan,
    same_blocks,
)

__all__ = ["sock"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(120)


# -- hostile plans --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ids", "error"),
    [
        (np.array([3, 5, 7, 9, 2, -1]), ValueError),  # an address before the tensor
        (np.array([3, 5, 7, 9, 2, BLOCKS]), ValueError),  # one row past its end
        (np.array([3, 5, 7, 9, 2, 2**40]), ValueError),
        (np.array([3, 5, 7, 9, 2, 2**63 + 1], dtype=np.uint64), ValueError),  # wraps negative as int64
        (np.array([3.0, 5.5, 7.0, 9.0, 2.0, 4.0]), TypeError),  # 5.5 cut to 5: another block's bytes
        (np.array([True, False, True, False, True, False]), TypeError),
        (np.array([[3, 5, 7], [9, 2, 4]]), ValueError),  # not one id per block
        ([3, 5, 7, 9, 2, 4], None),  # a list of ints is a list of ids
    ],
)
def test_block_ids_of_a_wrong_type_or_range_are_refused_by_the_plan(ids: Any, error: type[Exception] | None) -> None:
    """The plan turns ids into addresses in the tensors: an id outside them copies (and a store publishes)
    whatever memory lies there, so the plan refuses it rather than trust its caller."""
    jobs = jobs_of(arrays(None))
    for store in (True, False):
        if error is None:
            job = jobs.plan(1, store=store, chunks=CHUNKS, sizes=[4, 2], first_blocks=[0, 0], ids=ids)
            assert job.gpu_blocks[job.gpu_blocks >= 0].max() < BLOCKS
            continue
        with pytest.raises(error):
            jobs.plan(1, store=store, chunks=CHUNKS, sizes=[4, 2], first_blocks=[0, 0], ids=ids)


@pytest.mark.parametrize(
    ("sizes", "firsts", "error"),
    [
        ([-1, 7], [0, 0], ValueError),  # a negative size took the next group's blocks from the ids' end
        ([True, 5], [0, 0], TypeError),
        ([4.0, 2], [0, 0], TypeError),
        ([4, 2], [-2, 0], ValueError),  # a negative first block is a chunk's last blocks
        ([4, 2], [0.5, 0], TypeError),
        ([4, 2], [False, 0], TypeError),
        ([4, 2], [0], ValueError),
    ],
)
def test_group_sizes_and_first_blocks_of_a_wrong_type_or_range_are_refused(
    sizes: list[Any], firsts: list[Any], error: type[Exception]
) -> None:
    jobs = jobs_of(arrays(None))
    for store in (True, False):
        with pytest.raises(error):
            jobs.plan(1, store=store, chunks=CHUNKS, sizes=sizes, first_blocks=firsts, ids=SRC_IDS)


def test_numpy_integers_are_integers() -> None:
    jobs = jobs_of(arrays(None))
    job = jobs.plan(
        1,
        store=True,
        chunks=CHUNKS,
        sizes=[np.int64(4), np.uint8(2)],
        first_blocks=[np.int32(0), np.int64(0)],
        ids=SRC_IDS.astype(np.int32),
    )
    assert job.keys == plan(jobs, 1, SRC_IDS, store=True).keys


def test_a_load_of_distinct_blocks_plans_whatever_its_tensors_addresses() -> None:
    """The repeat a load refuses is a tensor's GPU block, not an address: a layout without memory (bases
    0, as planning keys only uses) has tensors whose rows meet, and plans all the same."""
    layout = [KVTensor(0, row, page, BLOCKS) for row, page in zip(ROWS, PAGES, strict=True)]
    jobs = PoolJobs(layout, GROUPS, namespace=b"ns", rank=0, blocks_per_chunk=2, slot_size=64 << 10, device=None)
    ids = np.random.default_rng(3).permutation(BLOCKS).astype(np.int64)
    chunks = [b"c%02d" % c + bytes(4) for c in range(6)] + [b"d%02d" % c + bytes([0, 0, 0, 1]) for c in range(2)]
    job = jobs.plan(1, store=False, chunks=chunks, sizes=[12, 4], first_blocks=[0, 0], ids=ids)
    assert len(set(job.addresses.tolist())) < len(job.keys)  # addresses meet, blocks do not
    assert job.unfilled(0) == set(ids.tolist())


def test_a_chunk_whose_page_indices_would_reach_the_seals_is_refused() -> None:
    """Index ``0xFFFFFFFF`` is the seal's: a chunk of that many pool blocks would load a seal into a page."""
    layout = [KVTensor(4096, 2 * 64 << 10, 96 << 10, 4)]  # two pieces a page
    with pytest.raises(ValueError, match="bad geometry: a chunk of 4294967296 pool blocks"):
        PoolJobs(layout, [(0,)], namespace=b"ns", rank=0, blocks_per_chunk=1 << 31, slot_size=64 << 10, device=None)
    jobs = PoolJobs(layout, [(0,)], namespace=b"ns", rank=0, blocks_per_chunk=(1 << 31) - 1, slot_size=64 << 10,
                    device=None)  # fmt: skip
    assert jobs.blocks_per_chunk == [(1 << 32) - 2]


# -- hostile jobs against a pool ------------------------------------------------------------------


async def test_a_store_that_names_a_chunk_twice_is_refused_and_claims_nothing(sock: str) -> None:
    src = arrays(21)
    jobs = jobs_of(src)
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as a:
        twice = jobs.plan(
            1, store=True, chunks=[CHUNKS[0], CHUNKS[0]], sizes=[4, 0], first_blocks=[0, 0], ids=SRC_IDS[:4]
        )
        with pytest.raises(ValueError, match="twice"):
            await jobs.store(a, twice)
        assert pool.statistics().blocks == 0
        await settle(pool)
    await assert_nothing_left()


async def test_a_load_that_names_a_gpu_block_twice_is_refused_before_anything_is_copied(sock: str) -> None:
    """Two pages of one load into the same GPU block: the block would end with whichever landed last."""
    src, dst = arrays(22), arrays(None)
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as a:
        await jobs_of(src).store(a, plan(jobs_of(src), 1, SRC_IDS, store=True))
        same = np.array([1, 1, 3, 4, 5, 6], dtype=np.int64)
        with pytest.raises(ValueError, match="job 2 loads two pages into GPU block 1"):
            plan(jobs_of(dst), 2, same, store=False)
        assert plan(jobs_of(src), 3, same, store=True).keys  # a store may read one block twice
        # Two groups that share a tensor (group 1 is tensor 1 of group 0): block 6 in both is one place.
        with pytest.raises(ValueError, match="GPU block 6"):
            plan(jobs_of(dst), 4, np.array([1, 2, 3, 6, 5, 6], dtype=np.int64), store=False)
        assert not any(t.any() for t in dst)
        await settle(pool)
    await assert_nothing_left()


async def test_jobs_on_a_closed_attachment_are_refused_and_the_owner_holds_nothing(sock: str) -> None:
    src = arrays(23)
    jobs = jobs_of(src)
    async with Pool(CONFIG, sock) as pool:
        a = await AttachedPool.attach(sock)
        await jobs.store(a, plan(jobs, 1, SRC_IDS, store=True))
        await a.aclose()
        with pytest.raises(TierClosedError):
            await jobs.store(a, plan(jobs, 2, SRC_IDS, store=True))
        dst = arrays(None)
        with pytest.raises(TierClosedError):
            await jobs_of(dst).load(a, plan(jobs_of(dst), 3, DST_IDS, store=False))
        assert not any(t.any() for t in dst)
        await settle(pool)
    await assert_nothing_left()


@pytest.mark.parametrize("ticks", [0, 1, 2, 4, 8, 16, 32])
async def test_the_owner_closing_under_jobs_ends_them_and_leaves_nothing(sock: str, ticks: int) -> None:
    src = arrays(24)
    jobs = jobs_of(src)
    pool = await Pool.open(CONFIG, sock)
    try:
        async with AttachedPool(sock) as a:
            await jobs.store(a, plan(jobs, 1, SRC_IDS, store=True))
            dst = arrays(None)
            loading = plan(jobs_of(dst), 2, DST_IDS, store=False)
            other = [b"x" + c for c in CHUNKS]
            storing = jobs.plan(3, store=True, chunks=other, sizes=[4, 2], first_blocks=[0, 0], ids=SRC_IDS)
            calls = [
                asyncio.ensure_future(jobs_of(dst).load(a, loading)),
                asyncio.ensure_future(jobs.store(a, storing)),
            ]
            for _ in range(ticks):
                await asyncio.sleep(0)
            await pool.aclose()
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            for outcome in outcomes:
                assert isinstance(outcome, int | PoolLostError), outcome
            if isinstance(outcomes[0], int):  # the leading blocks it counted landed whole
                unfilled = loading.unfilled(outcomes[0])
                upto = next((i for i, b in enumerate(DST_IDS.tolist()) if b in unfilled), len(DST_IDS))
                assert same_blocks(src, dst, pairs(SRC_IDS, DST_IDS, upto=upto))
            with pytest.raises(PoolLostError):
                await jobs.store(a, plan(jobs, 4, SRC_IDS, store=True))
    finally:
        await pool.aclose()
    await assert_nothing_left()


async def test_the_same_job_stored_by_two_tasks_at_once_is_stored_once_and_whole(sock: str) -> None:
    src = arrays(25)
    jobs = jobs_of(src)
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as a, AttachedPool(sock) as b:
        job = plan(jobs, 1, SRC_IDS, store=True)
        took = await asyncio.gather(jobs.store(a, job), jobs.store(b, job), jobs.store(a, job))
        assert sum(took) == job.nbytes  # one of them copied each page
        assert pool.statistics().blocks == len(job.keys)
        dst = arrays(None)
        loading = plan(jobs_of(dst), 2, DST_IDS, store=False)
        assert await jobs_of(dst).load(b, loading) == len(loading.keys)
        assert same_blocks(src, dst, pairs(SRC_IDS, DST_IDS))
        await settle(pool)
    await assert_nothing_left()
