"""The pool mode's jobs with KV tensors on a GPU (marker ``cuda``), without vLLM: one attached process
stores a job's pages (after the work on its stream) and seals, another loads them bit-exact, a load after
an eviction names its unfilled blocks, and cancelled or cut-off jobs leave nothing claimed.

The attached processes are children running ``CHILD``; they import the geometry below from this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import textwrap
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiokvtier import AttachedPool, Pool
from aiokvtier.integrations._pool_jobs import KVTensor, PoolJob, PoolJobs
from tests.test_pool import sock, until
from tests.test_pool_attack import settle

__all__ = ["sock"]  # the fixture, used by name

pytestmark = [pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

SLOT = 64 << 10
BPC = 2
BLOCKS = 512
# Tensor 0: a page of a slot and a half (two pieces, the second shorter) in a padded row; tensor 1: a
# quarter slot. Group 0 holds both, group 1 only tensor 1.
PAGES = (96 << 10, 16 << 10)
ROWS = (100 << 10, 16 << 10)
GROUPS = ((0, 1), (1,))
NS = b"ns-cuda!"
SIZES = (448, 64)
"""GPU blocks of a whole job per group (every block of the tensors once): about 50 MiB of pages."""
SRC_IDS = np.random.default_rng(1).permutation(BLOCKS).astype(np.int64)
DST_IDS = np.random.default_rng(2).permutation(BLOCKS).astype(np.int64)
CONFIG = {"quota": "256MiB", "max_quota": "256MiB", "slot_size": SLOT, "commit_unit": "32MiB"}
POOL_SLOTS = (256 << 20) // SLOT


def chunks(tag: bytes, sizes: Sequence[int]) -> list[bytes]:
    """A job's chunk keys, group after group (the last 4 bytes name the group, as vLLM's do)."""
    return [b"%s-%05d" % (tag, c) + g.to_bytes(4, "big") for g, n in enumerate(sizes) for c in range(n // BPC)]


def plan_job(jobs: PoolJobs, job_id: int, tag: bytes, ids: Any, sizes: Sequence[int], *, store: bool) -> PoolJob:
    return jobs.plan(
        job_id,
        store=store,
        chunks=chunks(tag, sizes),
        sizes=list(sizes),
        first_blocks=[0, 0],
        ids=np.asarray(ids[: sum(sizes)], dtype=np.int64),
    )


def keys_only() -> PoolJobs:
    """The same planning as the children's, without memory: keys and GPU blocks, no pages to copy."""
    layout = [KVTensor(0, row, page, BLOCKS) for row, page in zip(ROWS, PAGES, strict=True)]
    return PoolJobs(layout, GROUPS, namespace=NS, rank=0, blocks_per_chunk=BPC, slot_size=SLOT, device=None)


CHILD = textwrap.dedent(
    """
    import asyncio, hashlib, json, os, sys, time
    import numpy as np
    import torch
    from aiokvtier import AttachedPool, CopyEngine
    from aiokvtier.integrations._pool_jobs import SEAL, KVTensor, PoolJobs, block_key, seal_count
    from tests.test_pool_jobs_cuda import (
        BLOCKS, BPC, DST_IDS, GROUPS, NS, PAGES, ROWS, SIZES, SLOT, SRC_IDS, chunks, plan_job,
    )

    CASES = [("ticks", t) for t in range(0, 40, 4)] + [("sleep", d) for d in (0.0002, 0.0005, 0.001, 0.002, 0.005)]
    SMALL = (8, 2)

    def report(**fields):
        print(json.dumps(fields), flush=True)

    async def go_on():
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    def kv(seed=None):
        if seed is None:
            return [torch.zeros((BLOCKS, row), dtype=torch.uint8, device="cuda") for row in ROWS]
        g = torch.Generator(device="cuda")
        g.manual_seed(seed)
        return [torch.randint(0, 256, (BLOCKS, row), dtype=torch.uint8, device="cuda", generator=g) for row in ROWS]

    def jobs_of(tensors):
        layout = [KVTensor.of(t, page) for t, page in zip(tensors, PAGES)]
        return PoolJobs(layout, GROUPS, namespace=NS, rank=0, blocks_per_chunk=BPC, slot_size=SLOT, device=0)

    def digest(tensors, ids, sizes):
        # The pages a job moves: group 0's blocks of both tensors, then group 1's of tensor 1.
        ids = torch.as_tensor(ids[: sum(sizes)], device="cuda")
        h = hashlib.sha256()
        for t, part in ((0, ids[: sizes[0]]), (1, ids[: sizes[0]]), (1, ids[sizes[0] :])):
            h.update(tensors[t].index_select(0, part)[:, : PAGES[t]].cpu().numpy().tobytes())
        return h.hexdigest()

    async def settled(pool):
        for _ in range(500):  # an orphaned claim is aborted when its answer comes: a few turns
            s = await pool.statistics()
            if s.claims == 0 and s.blocks_pinned == 0:
                return True
            await asyncio.sleep(0.01)
        return False

    async def cancel(call, how, x):
        task = asyncio.ensure_future(call())
        if how == "ticks":
            for _ in range(x):
                await asyncio.sleep(0)
        else:
            await asyncio.sleep(x)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def store(pool, engine):
        src, data = kv(), kv(seed=11)
        torch.cuda.synchronize()
        jobs = jobs_of(src)
        job = plan_job(jobs, 1, b"job", SRC_IDS, SIZES, store=True)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(1 << 27)  # the pages are written late on this stream: the store waits for them
            for s, d in zip(src, data):
                s.copy_(d)
            written = torch.cuda.Event()
            written.record(side)
        taken = await jobs.store(pool, job, engine=engine, after=written)
        # Timed: the same pages under other chunks, nothing to wait for (then dropped, for room).
        timed = plan_job(jobs, 2, b"timed", SRC_IDS, SIZES, store=True)
        started = time.perf_counter()
        again = await jobs.store(pool, timed, engine=engine)
        seconds = time.perf_counter() - started
        await pool.discard(timed.keys)
        report(taken=taken, again=again, nbytes=job.nbytes, digest=digest(data, SRC_IDS, SIZES),
               store_gb_s=job.nbytes / seconds / 1e9)

    async def load(pool, engine):
        dst, src = kv(), kv(seed=12)
        torch.cuda.synchronize()
        jobs, jobs_src = jobs_of(dst), jobs_of(src)
        job = plan_job(jobs, 3, b"job", DST_IDS, SIZES, store=False)
        count = await jobs.load(pool, job, engine=engine)
        same = digest(dst, DST_IDS, SIZES)
        padding = all(not bool(t[:, page:].any()) for t, page in zip(dst, PAGES))
        names = chunks(b"job", SIZES)
        seals = np.zeros((len(names), 8), dtype=np.uint8)
        await pool.load([block_key(NS, c, 0, SEAL) for c in names], seals)
        counts = sorted({seal_count(row.tobytes()) for row in seals})
        times = []
        for _ in range(3):
            started = time.perf_counter()
            await jobs.load(pool, job, engine=engine)
            times.append(time.perf_counter() - started)
        report(count=count, keys=len(job.keys), digest=same, padding=padding, seals=counts,
               load_gb_s=job.nbytes / sorted(times)[1] / 1e9)

        await go_on()  # another process dropped a page of a block in the middle of the job
        for t in dst:
            t.zero_()
        torch.cuda.synchronize()
        count = await jobs.load(pool, job, engine=engine)
        unfilled = sorted(job.unfilled(count))
        rows = torch.as_tensor(unfilled, device="cuda")
        untouched = not any(bool(t.index_select(0, rows).any()) for t in dst)
        report(count=count, unfilled=unfilled, untouched=untouched, settled=await settled(pool))

        await go_on()  # other stores filled the pool: every block of the job evicted
        count = await jobs.load(pool, job, engine=engine)
        report(count=count, unfilled=sorted(job.unfilled(count)), settled=await settled(pool))

        await go_on()
        problems = []
        for i, (how, x) in enumerate(CASES):
            tag = b"c%d" % i
            storing = plan_job(jobs_src, 10 + i, tag, SRC_IDS, SMALL, store=True)
            await cancel(lambda: jobs_src.store(pool, storing, engine=engine), how, x)
            if not await settled(pool):
                problems.append(["a cancelled store left a claim or a pin", how, x])
            for _, _, lo, hi in storing.seals:
                visible = [await pool.lookup([k]) for k in storing.keys[lo : hi + 1]]
                if sum(visible) not in (0, hi + 1 - lo):
                    problems.append(["a chunk neither whole nor absent", how, x, visible])
            await jobs_src.store(pool, storing, engine=engine)
            for t in dst:
                t.zero_()
            torch.cuda.synchronize()
            loading = plan_job(jobs, 100 + i, tag, DST_IDS, SMALL, store=False)
            await cancel(lambda: jobs.load(pool, loading, engine=engine), how, x)
            if not await settled(pool):
                problems.append(["a cancelled load left a claim or a pin", how, x])
            if await jobs.load(pool, loading, engine=engine) != len(loading.keys):
                problems.append(["a load after a cancelled one missed blocks", how, x])
            elif digest(dst, DST_IDS, SMALL) != digest(src, SRC_IDS, SMALL):
                problems.append(["a load after a cancelled one differs", how, x])
            await pool.discard(storing.keys)
        report(cases=len(CASES), problems=problems)

        await go_on()  # the process ends while a store's claim waits for its copies: the owner takes it back
        cut = plan_job(jobs_src, 999, b"exit", SRC_IDS, SIZES, store=True)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(1 << 32)  # seconds: the copies wait for it on the GPU, the claim is held
            held = torch.cuda.Event()
            held.record(side)
        task = asyncio.ensure_future(jobs_src.store(pool, cut, engine=engine, after=held))
        report(started=True)
        await go_on()  # the owner saw the claim
        os._exit(0)

    async def main():
        pool = await AttachedPool.attach(sys.argv[1], device=0)
        try:
            await pool.wait_resident()
            async with CopyEngine(0) as engine:
                await (store if sys.argv[2] == "store" else load)(pool, engine)
        finally:
            await pool.aclose()

    asyncio.run(main())
    """
)


class _Child:
    """An attached process running ``CHILD``: one JSON report a line, a line on stdin to go on."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None and proc.stdin is not None
        self.proc, self._out, self._in = proc, proc.stdout, proc.stdin

    async def report(self) -> dict[str, Any]:
        async with asyncio.timeout(150):
            line = await self._out.readline()
        assert line, f"the attached process failed ({await self.proc.wait()})"
        result: dict[str, Any] = json.loads(line)
        return result

    async def go_on(self) -> None:
        self._in.write(b"go\n")
        await self._in.drain()

    async def exits(self) -> None:
        async with asyncio.timeout(60):
            assert await self.proc.wait() == 0


@contextlib.asynccontextmanager
async def _child(sock: str, mode: str) -> AsyncIterator[_Child]:
    """Start it; stopped however the test ends (a failed assertion leaves no process behind)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        sock,
        mode,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=ENV,
        cwd=ROOT,
    )
    try:
        yield _Child(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.cuda
async def test_gpu_kv_pages_stored_by_one_process_load_bit_exact_in_another_and_evictions_are_load_errors(
    sock: str,
) -> None:
    planned = plan_job(keys_only(), 3, b"job", DST_IDS, SIZES, store=False)
    async with Pool(CONFIG, sock) as pool:
        async with _child(sock, "store") as a:
            stored = await a.report()
            await a.exits()
        # Every page went in (the store waited for the pages its stream wrote late), and again under
        # other keys, timed.
        assert stored["taken"] == stored["again"] == stored["nbytes"] == planned.nbytes, stored
        async with _child(sock, "load") as b, AttachedPool(sock) as host:
            first = await b.report()
            assert first["count"] == first["keys"] == len(planned.keys), first
            assert first["digest"] == stored["digest"], "the pages loaded differ from those stored"
            assert first["padding"], "a load wrote past a page"
            assert first["seals"] == [BPC * 1, BPC * 3], first  # group 1: one piece a block; group 0: three
            print(
                f"pool jobs, GPU KV tensors: store {stored['store_gb_s']:.2f} GB/s, load {first['load_gb_s']:.2f} "
                f"GB/s ({planned.nbytes / 2**20:.0f} MiB a job, pages of 96 and 16 KiB in 64 KiB slots)"
            )

            # Evicted under the next load: one piece of a block in the middle.
            victim = len(planned.keys) // 2
            assert await host.discard([planned.keys[victim]]) == 1
            block = planned.gpu_blocks[victim]
            leading = int(np.flatnonzero(planned.gpu_blocks == block)[0])
            await b.go_on()
            partial = await b.report()
            assert partial["count"] == leading, partial
            assert partial["unfilled"] == sorted(planned.unfilled(leading)), partial
            assert partial["untouched"] and partial["settled"], partial

            # Evicted by other stores: as many blocks as the pool has slots.
            result = await host.store([b"filler-%d" % i for i in range(POOL_SLOTS)], [b"x"] * POOL_SLOTS)
            assert len(result.stored) == POOL_SLOTS
            await b.go_on()
            gone = await b.report()
            assert gone["count"] == 0 and gone["unfilled"] == sorted(DST_IDS.tolist()) and gone["settled"], gone

            await b.go_on()
            cancelled = await b.report()
            assert cancelled["cases"] > 0 and cancelled["problems"] == [], cancelled

            await b.go_on()
            assert (await b.report())["started"]
            await until(lambda: pool.statistics().claims > 0, "the store cut off claimed nothing")
            await b.go_on()
            async with asyncio.timeout(60):
                await b.proc.wait()
            # Cut off mid-store: nothing of it visible (its claim was given up), no chunk in part.
            cut = plan_job(keys_only(), 999, b"exit", SRC_IDS, SIZES, store=True)
            for _, _, lo, hi in cut.seals:
                assert sum([await host.lookup([k]) for k in cut.keys[lo : hi + 1]]) in (0, hi + 1 - lo)
        await until(lambda: pool.clients == 0, "the owner did not see its processes go")
        await settle(pool)
