"""A pool attached with a device (marker ``cuda``): another process copies its slots to and from the GPU."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiokvtier import AttachedPool, Pool
from tests.test_pool import sock, until
from tests.test_pool_attack import attack, cases, settle

__all__ = ["sock"]  # the fixture, used by name

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
SLOT = 64 << 10
N = 1024  # 64 MiB each way

# The attached process: fills N slots, copies them to the GPU and back into N other slots through the
# pool's registered memory, then the same through a StaticHostMem of its own (the rate of registered
# memory), and prints what it did as one JSON line.
CHILD = textwrap.dedent(
    """
    import asyncio, json, sys, time
    import numpy as np
    from aiokvtier import AttachedPool, CopyEngine, StaticHostMem
    import torch

    SLOT, N = 65536, 1024

    async def rate(engine, copies, nbytes):
        await engine.copy(copies)  # warm
        best = []
        for _ in range(5):
            started = time.perf_counter()
            await engine.copy(copies)
            best.append(time.perf_counter() - started)
        return nbytes / sorted(best)[2] / 1e9

    async def main():
        pool = await AttachedPool.attach(sys.argv[1], device=0)
        async with CopyEngine(0) as engine, StaticHostMem(N * SLOT, device=0) as stage:
            src = await pool.allocate(N)
            dst = await pool.allocate(N)
            rng = np.random.default_rng(7)
            for slot in src:
                pool.view(slot)[:] = rng.integers(0, 256, SLOT, dtype=np.uint8).tobytes()
            gpu = torch.empty(N * SLOT, dtype=torch.uint8, device="cuda")
            base = gpu.data_ptr()
            up = [(base + i * SLOT, pool.address(s), SLOT) for i, s in enumerate(src)]
            down = [(pool.address(s), base + i * SLOT, SLOT) for i, s in enumerate(dst)]
            await engine.copy(up)
            await engine.copy(down)
            same = all(bytes(pool.view(a)) == bytes(pool.view(b)) for a, b in zip(src, dst))
            staged = [(base + i * SLOT, stage.address + i * SLOT, SLOT) for i in range(N)]
            pool_rate = await rate(engine, up, N * SLOT)
            stage_rate = await rate(engine, staged, N * SLOT)
            print(json.dumps({"same": same, "src": src[:4], "dst": dst, "pool_gb_s": pool_rate,
                              "static_gb_s": stage_rate}), flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # until the owner looked
        await pool.aclose()

    asyncio.run(main())
    """
)


OWNERS = {
    "host": {},
    "register": {"device": 0, "backing": "register"},  # the owner registers the shared memory too
}


class _Child:
    """An attached process running ``code`` against the pool: one JSON report a line, a line to go on."""

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
async def _child(code: str, sock: str) -> AsyncIterator[_Child]:
    """Start it; stopped however the test ends (a failed assertion leaves no process behind)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        sock,
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


@pytest.mark.parametrize("owner", list(OWNERS))
async def test_an_attached_process_copies_pool_slots_to_the_gpu_and_back(sock: str, owner: str) -> None:
    config = {"quota": "256MiB", "max_quota": "256MiB", "slot_size": SLOT, **OWNERS[owner]}
    async with Pool(config, sock) as pool, _child(CHILD, sock) as child:
        report = await child.report()
        assert report["same"], "the bytes that went to the GPU and back differ"
        # What the attached process wrote through the GPU is in the owner's memory too.
        tier = pool.tier
        base = tier.statistics().base_address
        got = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * SLOT).from_address(base + report["dst"][0] * SLOT))
        want = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * SLOT).from_address(base + report["src"][0] * SLOT))
        assert np.array_equal(got, want)
        print(f"attached pool H2D {report['pool_gb_s']:.1f} GB/s, StaticHostMem {report['static_gb_s']:.1f} GB/s")
        await child.go_on()
        await child.exits()


async def test_an_owner_with_the_register_backing_copies_its_own_slots_with_its_engine(sock: str) -> None:
    import torch

    from aiokvtier import CopyEngine

    config = {"quota": "64MiB", "max_quota": "128MiB", "slot_size": SLOT, "device": 0, "backing": "register"}
    n = 256
    async with Pool(config, sock) as pool, CopyEngine(0) as engine:
        tier = pool.tier
        await tier.wait_resident()
        stats = tier.statistics()
        assert stats.backing == "shared-register"
        assert stats.registered_bytes == stats.resident_bytes > 0  # every resident unit, registered
        src = await tier.allocate(n)
        dst = await tier.allocate(n)
        rng = np.random.default_rng(3)
        for slot in src:
            tier.view(slot)[:] = rng.integers(0, 256, SLOT, dtype=np.uint8).tobytes()
        gpu = torch.empty((n, SLOT), dtype=torch.uint8, device="cuda")
        await engine.to_device(tier, src, gpu)
        await engine.to_host(tier, dst, gpu)
        assert all(bytes(tier.view(a)) == bytes(tier.view(b)) for a, b in zip(src, dst, strict=True))
        await pool.resize("128MiB")  # the grown units are registered as the fill reaches them
        await tier.wait_resident()
        stats = tier.statistics()
        assert stats.registered_bytes == stats.resident_bytes == 128 << 20
        await pool.resize("64MiB")  # a shrink unregisters before it punches the units out
        stats = tier.statistics()
        assert stats.registered_bytes == stats.resident_bytes
        tier.free_many(src + dst)


# An attached process registered on device 0: reports its registered bytes at each step the owner asks
# for, and after the regrow copies random bytes from the GPU into a slot past the old shrink.
SHRINKING_CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    import numpy as np
    from aiokvtier import AttachedPool, CopyEngine
    import torch

    SLOT = 65536

    async def main():
        pool = await AttachedPool.attach(sys.argv[1], device=0)
        loop = asyncio.get_running_loop()
        async with CopyEngine(0) as engine:
            await pool.wait_resident()
            print(json.dumps({"registered": pool.registered_bytes}), flush=True)
            await loop.run_in_executor(None, sys.stdin.readline)  # the owner shrank the pool
            while pool.quota > 64 << 20 or pool.registered_bytes > pool.quota:  # the pushed state arrives
                await asyncio.sleep(0.01)
            print(json.dumps({"registered": pool.registered_bytes}), flush=True)
            await loop.run_in_executor(None, sys.stdin.readline)  # the owner grew it again
            await pool.wait_resident()
            slot = (await pool.allocate(1))[0]
            while slot * SLOT < 64 << 20:  # one past the shrink: a unit handed back and made again
                slot = (await pool.allocate(1))[0]
            data = torch.randint(0, 256, (SLOT,), dtype=torch.uint8, device="cuda")
            await engine.copy([(pool.address(slot), data.data_ptr(), SLOT)])
            same = bytes(pool.view(slot)) == bytes(data.cpu().numpy())
            print(json.dumps({"registered": pool.registered_bytes, "slot": int(slot), "same": same,
                              "digest": bytes(data.cpu().numpy()[:16]).hex()}), flush=True)
            await loop.run_in_executor(None, sys.stdin.readline)
        await pool.aclose()

    asyncio.run(main())
    """
)


async def test_a_shrink_unregisters_the_handed_back_units_in_a_gpu_attached_process(sock: str) -> None:
    """After a shrink and a regrow, the GPU and every CPU see the same new pages, never the old pinned ones."""
    config = {"quota": "256MiB", "max_quota": "256MiB", "slot_size": SLOT, "commit_unit": "32MiB"}
    async with Pool(config, sock) as pool, _child(SHRINKING_CHILD, sock) as child:
        assert (await child.report())["registered"] == 256 << 20
        await pool.resize("64MiB")
        await child.go_on()
        assert (await child.report())["registered"] == 64 << 20  # the handed-back units, unregistered there
        await pool.resize("256MiB")
        await pool.tier.wait_resident()
        await child.go_on()
        last = await child.report()
        assert last["registered"] == 256 << 20 and last["same"], last
        base = pool.tier.statistics().base_address
        seen = (np.ctypeslib.ctypes.c_uint8 * 16).from_address(base + int(last["slot"]) * SLOT)  # type: ignore[call-overload]
        assert bytes(seen).hex() == last["digest"]  # what the GPU wrote is in the owner's memory too
        await child.go_on()
        await child.exits()


REGROWN_CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    from aiokvtier import AttachedPool, CopyEngine
    import torch

    SLOT = 65536

    async def main():
        pool = await AttachedPool.attach(sys.argv[1], device=0)
        loop = asyncio.get_running_loop()
        async with CopyEngine(0) as engine:
            await pool.wait_resident()
            print(json.dumps({"registered": pool.registered_bytes}), flush=True)
            await loop.run_in_executor(None, sys.stdin.readline)  # the owner shrank and grew back at once
            await pool.wait_resident()  # registered here again, past the shrink
            slot = (await pool.allocate(1))[0]
            while slot * SLOT < 64 << 20:
                slot = (await pool.allocate(1))[0]
            data = torch.randint(0, 256, (SLOT,), dtype=torch.uint8, device="cuda")
            await engine.copy([(pool.address(slot), data.data_ptr(), SLOT)])
            print(json.dumps({"slot": int(slot), "digest": bytes(data.cpu().numpy()[:16]).hex()}), flush=True)
            await loop.run_in_executor(None, sys.stdin.readline)
        await pool.aclose()

    asyncio.run(main())
    """
)


async def test_a_shrink_and_a_grow_back_to_back_reach_a_gpu_attached_process_as_two(sock: str) -> None:
    """Two resizes in a row are pushed one by one: the attached process unregisters the punched units
    before it registers the regrown ones, so what its GPU writes there is the owner's memory."""
    config = {"quota": "256MiB", "max_quota": "256MiB", "slot_size": SLOT, "commit_unit": "32MiB"}
    async with Pool(config, sock) as pool, _child(REGROWN_CHILD, sock) as child:
        assert (await child.report())["registered"] == 256 << 20
        await pool.resize("64MiB")
        await pool.resize("256MiB")  # no await between them reaches the publisher
        await pool.tier.wait_resident()
        await child.go_on()
        last = await child.report()
        base = pool.tier.statistics().base_address
        seen = (np.ctypeslib.ctypes.c_uint8 * 16).from_address(base + int(last["slot"]) * SLOT)  # type: ignore[call-overload]
        assert bytes(seen).hex() == last["digest"]
        await child.go_on()
        await child.exits()


BY_KEY_CHILD = textwrap.dedent(
    """
    import asyncio, hashlib, json, sys, time
    from aiokvtier import AttachedPool, CopyEngine
    import numpy as np
    import torch

    SLOT, N = 65536, 1024

    async def main():
        pool = await AttachedPool.attach(sys.argv[1], device=0)
        async with CopyEngine(0) as engine:
            keys = [b"gpu-%d" % i for i in range(N)]
            data = torch.randint(0, 256, (N, SLOT), dtype=torch.uint8, device="cuda")
            started = time.perf_counter()
            result = await pool.store(keys, data, engine=engine)
            stored_s = time.perf_counter() - started
            back = torch.zeros_like(data)
            loads = []
            for _ in range(3):
                started = time.perf_counter()
                await pool.load(keys, back, engine=engine)
                loads.append(time.perf_counter() - started)
            # Pages given as addresses, their length a numpy scalar (as engines compute it).
            part = torch.randint(0, 256, (4, 4096), dtype=torch.uint8, device="cuda")
            addresses = [part[i].data_ptr() for i in range(4)]
            await pool.store([b"part-%d" % i for i in range(4)], addresses, engine=engine, page=np.int64(4096))
            part_back = torch.zeros_like(part)
            back_addresses = [part_back[i].data_ptr() for i in range(4)]
            await pool.load([b"part-%d" % i for i in range(4)], back_addresses, engine=engine, page=np.int64(4096))
            torch.cuda.synchronize()
            print(json.dumps({
                "scalar_page": bool(torch.equal(part, part_back)),
                "stored": len(result.stored), "same": bool(torch.equal(back, data)),
                "digest": hashlib.sha256(data.cpu().numpy().tobytes()).hexdigest(),
                "store_gb_s": N * SLOT / stored_s / 1e9, "load_gb_s": N * SLOT / sorted(loads)[1] / 1e9,
            }), flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        await pool.aclose()

    asyncio.run(main())
    """
)


async def test_a_gpu_attached_process_stores_and_loads_by_key_from_and_into_gpu_memory(sock: str) -> None:
    """``store``/``load`` with ``engine=``: GPU pages go into the shared slots by key and come back
    bit-exact; another process (this one, attached without a device) reads the same bytes."""
    config = {"quota": "256MiB", "max_quota": "256MiB", "slot_size": SLOT, "commit_unit": "32MiB"}
    async with Pool(config, sock), _child(BY_KEY_CHILD, sock) as child:
        report = await child.report()
        assert report["stored"] == N and report["same"] and report["scalar_page"], report
        print(f"store {report['store_gb_s']:.2f} GB/s, load {report['load_gb_s']:.2f} GB/s")  # in the -s output
        async with AttachedPool(sock) as host:
            pages = np.zeros((N, SLOT), dtype=np.uint8)
            await host.load([b"gpu-%d" % i for i in range(N)], pages)
        assert hashlib.sha256(pages.tobytes()).hexdigest() == report["digest"]
        await child.go_on()
        await child.exits()


async def test_cancelled_gpu_stores_and_loads_by_key_hold_nothing_and_the_bytes_stay_whole(sock: str) -> None:
    """``store``/``load`` with ``engine=`` cancelled at every await (turns of the loop, ``wait_for``,
    ``task.cancel()``, a failing TaskGroup sibling): nothing stays claimed or pinned, a key that is
    visible holds whole bytes, and the same keys store and load bit-exact afterwards."""
    import torch

    from aiokvtier import CopyEngine

    n = 64
    config = {"quota": "64MiB", "max_quota": "64MiB", "slot_size": SLOT}
    async with Pool(config, sock) as pool:
        attached = await AttachedPool.attach(sock, device=0)
        try:
            async with CopyEngine(0) as engine:
                for case, (how, delay) in enumerate(cases()):
                    keys = [b"gpu-cancel-%d-%d" % (case, i) for i in range(n)]
                    data = torch.randint(0, 256, (n, SLOT), dtype=torch.uint8, device="cuda")
                    await attack(lambda k=keys, d=data: attached.store(k, d, engine=engine), how, delay)  # type: ignore[misc]
                    await settle(pool)
                    back = torch.zeros_like(data)
                    visible = await attached.lookup(keys)
                    if visible:  # never half: a visible block is whole
                        await attached.load(keys[:visible], back[:visible], engine=engine)
                        assert torch.equal(back[:visible], data[:visible]), (how, delay)
                    assert not (await attached.store(keys, data, engine=engine)).skipped
                    back.zero_()
                    await attack(lambda k=keys, b=back: attached.load(k, b, engine=engine), how, delay)  # type: ignore[misc]
                    await settle(pool)
                    await attached.load(keys, back, engine=engine)
                    assert torch.equal(back, data), (how, delay)
                    await attached.discard(keys)
                    await settle(pool)
        finally:
            await attached.aclose()
        await until(lambda: pool.clients == 0, "the owner did not see its process go")
        await settle(pool)
