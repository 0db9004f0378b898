"""``bench store --sections tiers``: the disk tier beside a plain ``O_DIRECT`` loop on the same disk
(and the Mooncake tier beside Mooncake's batch calls: ``_mooncake``).

Both arms move the same blocks between the same page-aligned memory (a host
tier's slots) and files in the same directory, on the same number of
threads: the baseline is ``pwritev``/``preadv`` of each block at its offset
and nothing else, the limit of that disk for this access pattern; the tier
adds its checksums, its journal and its index. Each timed arm starts with
the disk settled (``os.sync`` and a pause), and which arm goes first
alternates by round; medians are reported, with each arm's CPU time per
block (the process's user and system time over the arm: its threads and
the event loop).

The prefix load goes to host memory and, where a CUDA device can be used,
to GPU memory through a CopyEngine (``prefix_load_gpu``; otherwise it says
why it was skipped). Its ``breakdown_ms`` times one more such load per round,
watched through the store's events: when the first and the last piece read
back from disk were stored, and when the load returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .._config import DiskTierConfig, HostTierConfig
from .._disk._io import memory_at
from .._disk._tier import DiskTier
from .._host._tier import HostTier
from .._store._spill import PIECE_BYTES
from .._store._store import BlockStore
from . import _mooncake
from ._common import median

KiB, MiB = 1 << 10, 1 << 20
THREADS = 4


def _raw(fd: int, addresses: list[tuple[int, int]], block: int, write: bool) -> None:
    """One thread's share: each block at its own offset, as the tier lays them out."""
    for i, address in addresses:
        view = memory_at(address, block)
        if write:
            os.pwritev(fd, [view], i * block)
        else:
            os.preadv(fd, [view], i * block)


def _raw_round(pool: ThreadPoolExecutor, fd: int, addresses: list[int], block: int, write: bool) -> float:
    indexed = list(enumerate(addresses))
    share = -(-len(indexed) // THREADS)
    started = time.perf_counter()
    futures = [pool.submit(_raw, fd, indexed[i : i + share], block, write) for i in range(0, len(indexed), share)]
    for future in futures:
        future.result()
    return time.perf_counter() - started


async def _one_size(directory: str, block: int, total: int, rounds: int) -> dict[str, Any]:
    n = total // block
    config = HostTierConfig.model_validate(
        {"quota": 2 * n * block, "max_quota": 2 * n * block, "slot_size": block, "fill_threads": 2}
    )
    async with HostTier(config) as tier:
        await tier.wait_resident()
        src = await tier.allocate(n)
        dst = await tier.allocate(n)
        rng = np.random.default_rng(block)
        for slot in src:
            tier.view(slot)[:] = rng.integers(0, 256, block, dtype=np.uint8).tobytes()
        src_addresses = tier.slot_addresses(src).tolist()
        dst_addresses = tier.slot_addresses(dst).tolist()
        disk_config = await asyncio.to_thread(DiskTierConfig.model_validate, {"quota": n * block, "path": directory})
        raw_path = os.path.join(directory, f"raw-{block}")
        flags = os.O_RDWR | os.O_CREAT
        fd = os.open(raw_path, flags | (os.O_DIRECT if direct_ok(directory) else 0), 0o600)
        samples: dict[str, list[float]] = {k: [] for k in ("raw_write", "raw_read", "tier_write", "tier_read")}
        cpu: dict[str, list[tuple[float, float]]] = {k: [] for k in samples}
        try:
            os.ftruncate(fd, n * block)
            with ThreadPoolExecutor(THREADS, thread_name_prefix="aiokvtier-bench-io") as pool:
                async with DiskTier(disk_config, block_size=block, fingerprint="bench", io_threads=THREADS) as disk:
                    direct = disk.statistics().direct_io
                    loop = asyncio.get_running_loop()

                    async def raw(addresses: list[int], write: bool) -> tuple[float, float, float]:
                        await _settle()
                        used = _cpu()
                        elapsed = await loop.run_in_executor(None, _raw_round, pool, fd, addresses, block, write)
                        return elapsed, *_cpu_since(used)

                    async def tier_write(keys: list[bytes]) -> tuple[float, float, float]:
                        await _settle()
                        used, started = _cpu(), time.perf_counter()
                        written = await disk.write(keys, src_addresses, [block] * n)
                        elapsed = time.perf_counter() - started
                        assert len(written) == n, "the disk tier skipped blocks: is the disk full?"
                        return elapsed, *_cpu_since(used)

                    async def tier_read(keys: list[bytes]) -> tuple[float, float, float]:
                        await _settle()
                        used, started = _cpu(), time.perf_counter()
                        ok = await disk.read(keys, dst_addresses)
                        elapsed = time.perf_counter() - started
                        assert all(ok)
                        return elapsed, *_cpu_since(used)

                    for r in range(rounds + 1):
                        keys_b = [f"{r}:{i}".encode() for i in range(n)]
                        # Which arm goes first alternates: the second of two back-to-back writes runs while
                        # the disk still drains the first (it measured 5-10% slower on the VM either way).
                        times: dict[str, tuple[float, float, float]] = {}
                        for name in ("raw_write", "tier_write")[:: 1 if r % 2 else -1]:
                            write_arm = raw(src_addresses, True) if name == "raw_write" else tier_write(keys_b)
                            times[name] = await write_arm
                        for name in ("raw_read", "tier_read")[:: 1 if r % 2 else -1]:
                            read_arm = raw(dst_addresses, False) if name == "raw_read" else tier_read(keys_b)
                            times[name] = await read_arm
                        disk.discard(keys_b)
                        if r:  # the first round warms the files and the threads
                            for name, (elapsed, user, system) in times.items():
                                samples[name].append(elapsed)
                                cpu[name].append((user, system))
                    for slot_a, slot_b in zip(src[:4], dst[:4], strict=True):
                        assert bytes(tier.view(slot_a)) == bytes(tier.view(slot_b)), "a block came back wrong"
        finally:
            os.close(fd)
            os.unlink(raw_path)
    gbps = {k: round(total / median(v) / 1e9, 3) for k, v in samples.items()}
    return {
        "block_bytes": block,
        "blocks": n,
        "direct_io": direct,
        "gb_per_s": gbps,
        "write_ratio": round(gbps["tier_write"] / gbps["raw_write"], 3),
        "read_ratio": round(gbps["tier_read"] / gbps["raw_read"], 3),
        "cpu_us_per_block": {
            k: {
                "user": round(median([u for u, _ in v]) / n * 1e6, 2),
                "sys": round(median([y for _, y in v]) / n * 1e6, 2),
            }
            for k, v in cpu.items()
        },
    }


SETTLE_S = 0.2


def _cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def _cpu_since(before: tuple[float, float]) -> tuple[float, float]:
    """The process's user and system seconds since ``before``."""
    user, system = _cpu()
    return user - before[0], system - before[1]


async def _settle() -> None:
    """Before each timed arm: what the last one left dirty written out (the tier's journal, a drop
    flush), and a pause for the disk to drain what it acknowledged but still holds."""
    await asyncio.to_thread(os.sync)
    await asyncio.sleep(SETTLE_S)


def direct_ok(directory: str) -> bool:
    """The file system takes ``O_DIRECT`` (the baseline uses it where the tier does)."""
    probe = os.path.join(directory, "probe")
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(probe)


async def _reopen(directory: str, blocks: int, rounds: int) -> dict[str, Any]:
    """Open a disk tier of ``blocks`` 4 KiB blocks again (the journal replayed): the restart's cost."""
    block = 4 * KiB
    config = await asyncio.to_thread(DiskTierConfig.model_validate, {"quota": blocks * block, "path": directory})
    memory = HostTierConfig.model_validate({"quota": 4 * MiB, "max_quota": 4 * MiB, "slot_size": block})
    async with HostTier(memory) as tier:
        await tier.wait_resident()
        slots = await tier.allocate(1024)
        addresses = tier.slot_addresses(slots).tolist()
        async with DiskTier(config, block_size=block, fingerprint="reopen") as disk:
            for start in range(0, blocks, 1024):
                n = min(1024, blocks - start)
                await disk.write(list(range(start, start + n)), addresses[:n], [block] * n)
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        async with DiskTier(config, block_size=block, fingerprint="reopen") as disk:
            times.append(time.perf_counter() - started)
            found = disk.statistics().recovered_blocks
        assert found == blocks, f"reopened with {found} of {blocks} blocks"
    return {"blocks": blocks, "block_bytes": block, "reopen_s": round(median(times), 4)}


PREFIX_BLOCK = 64 * KiB


async def _prefix_load(directory: str, blocks: int, rounds: int, destination: str = "host") -> dict[str, Any]:
    """A prefix whose second half is only on disk, loaded in one call, beside its parts measured alone:
    reading that half from disk, and loading the whole prefix from the host tier.

    ``destination``: ``"host"`` (numpy memory, copied by the store's memmove) or ``"gpu"`` (device 0's
    memory, copied by a CopyEngine: the host tier's half goes to the GPU while the other half is read
    back from disk into host slots, then copied after it).
    """
    if destination not in ("host", "gpu"):
        raise ValueError(f"destination is 'host' or 'gpu', got {destination!r}")
    gpu = destination == "gpu"
    block = PREFIX_BLOCK
    config = await asyncio.to_thread(DiskTierConfig.model_validate, {"quota": blocks * block, "path": directory})
    size = 4 * blocks * block
    memory = HostTierConfig.model_validate(
        {"quota": size, "max_quota": size, "slot_size": block, "device": 0 if gpu else None}
    )
    keys = [b"p%d" % i for i in range(blocks)]
    half = blocks // 2
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (blocks, block), dtype=np.uint8)
    async with contextlib.AsyncExitStack() as stack:
        engine = None
        if gpu:
            from .._copy._engine import CopyEngine

            device = _DevicePages(data)
            stack.callback(device.close)
            pages: _Pages = device
            engine = await stack.enter_async_context(CopyEngine(0))
        else:
            pages = _HostPages(data)
        tier = await stack.enter_async_context(HostTier(memory))
        disk = await stack.enter_async_context(DiskTier(config, block_size=block, fingerprint=f"prefix-{destination}"))
        samples = await _prefix_rounds(tier, engine, disk, keys, pages, rounds)
    ms = {k: round(median(v) * 1e3, 3) for k, v in samples.items() if not k.startswith("watched_")}
    out: dict[str, Any] = {
        "prefix_bytes": blocks * block,
        "on_disk_bytes": (blocks - half) * block,
        "piece_bytes": PIECE_BYTES,
        "destination": "GPU memory (device 0, CopyEngine)" if gpu else "host memory (memmove)",
        "ms": ms,
        "ratio_vs_sum_of_parts": round(ms["combined"] / (ms["disk_read_alone"] + ms["host_load_alone"]), 3),
        "breakdown_ms": {
            k.removeprefix("watched_"): round(median(v) * 1e3, 3)
            for k, v in samples.items()
            if k != k.removeprefix("watched_")
        },
    }
    if engine is not None:
        out["engine_method"] = engine.method
        out["bytes_by_method"] = engine.statistics().bytes_by_method
    return out


async def _prefix_rounds(
    tier: HostTier, engine: Any, disk: DiskTier, keys: list[bytes], pages: _Pages, rounds: int
) -> dict[str, list[float]]:
    """The arms, one after another in each round (the first round warms up): the load with half
    the prefix on disk, the same load with all of it in the host tier, and the disk half read alone.

    Then the first load again, watched (the ``watched_`` samples, kept apart from the arms): from its
    start, when the store said the first and the last piece read back from disk were stored (its
    ``"stored"`` events, seen by a task of the bench's own), and when the load returned.
    """
    blocks, half = len(keys), len(keys) // 2
    await tier.wait_resident()
    async with BlockStore(tier, engine, disk=disk, admit_after=1) as store:
        await store.store(keys, pages.src)
        await store.load(keys, pages.out)
    assert store.statistics().written_back == blocks  # the close waited for the write-back
    scratch = await tier.allocate(half)
    scratch_addresses = tier.slot_addresses(scratch).tolist()
    samples: dict[str, list[float]] = {"combined": [], "disk_read_alone": [], "host_load_alone": []}
    for name in ("first_piece_landed", "last_piece_landed", "load_done", "copy_after_last_read"):
        samples[f"watched_{name}"] = []
    for r in range(rounds + 1):
        async with BlockStore(tier, engine, disk=disk) as store:
            await store.store(keys[:half], pages.src_of(half))
            pages.clear()
            started = time.perf_counter()
            await store.load(keys, pages.out)
            combined = time.perf_counter() - started
            assert pages.arrived(), "a block came back wrong"
            started = time.perf_counter()
            await store.load(keys, pages.out)
            host_alone = time.perf_counter() - started
        started = time.perf_counter()
        assert all(await disk.read(keys[half:], scratch_addresses))
        disk_alone = time.perf_counter() - started
        watched = await _watched_load(tier, engine, disk, keys, pages)
        if r:
            samples["combined"].append(combined)
            samples["disk_read_alone"].append(disk_alone)
            samples["host_load_alone"].append(host_alone)
            for name, seconds in watched.items():
                samples[f"watched_{name}"].append(seconds)
    tier.free_many(scratch)
    return samples


async def _watched_load(
    tier: HostTier, engine: Any, disk: DiskTier, keys: list[bytes], pages: _Pages
) -> dict[str, float]:
    """The load with half the prefix on disk, with the store's ``"stored"`` events timed as they come
    (each one a piece the load read back from disk and booked in the host tier)."""
    half = len(keys) // 2
    async with BlockStore(tier, engine, disk=disk) as store:
        await store.store(keys[:half], pages.src_of(half))
        pages.clear()
        timed = await timed_load(store, keys, pages.out)
        assert pages.arrived(), "a block came back wrong"
    return {
        "first_piece_landed": timed["first_piece_landed"],
        "last_piece_landed": timed["last_piece_landed"],
        "load_done": timed["load"],
        "copy_after_last_read": timed["copy_after_last_read"],
    }


async def timed_load(store: BlockStore, keys: list[bytes], out: Any) -> dict[str, float]:
    """``store.load(keys, out)`` with its ``"stored"`` events timed as they come (seconds from the load's
    start: the first and the last piece read back from a lower tier and booked), its wall time, the
    process's CPU time and the event loop thread's over it."""
    landed: list[float] = []
    async with store.events() as events:

        async def watch() -> None:
            async for event in events:
                if event.kind == "stored":
                    landed.append(time.perf_counter())

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0)  # waiting for the first event before the load starts
        cpu, loop_cpu = time.process_time(), time.thread_time()
        started = time.perf_counter()
        await store.load(keys, out)
        done = time.perf_counter()
        cpu, loop_cpu = time.process_time() - cpu, time.thread_time() - loop_cpu
        await asyncio.sleep(0)  # the watcher sees the last event
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    assert landed, "the load stored nothing it read back"
    return {
        "load": done - started,
        "first_piece_landed": landed[0] - started,
        "last_piece_landed": landed[-1] - started,
        "copy_after_last_read": done - landed[-1],
        "cpu": cpu,
        "loop_cpu": loop_cpu,
    }


class _Pages:
    """The prefix's source pages (what is stored) and destination pages (what is loaded into)."""

    src: Any
    out: Any

    def src_of(self, n: int) -> Any:
        """The first ``n`` source pages."""
        return self.src[:n]

    def clear(self) -> None:
        """Zero the destination (a load that skipped a block fails ``arrived()``)."""

    def arrived(self) -> bool:
        """Whether the destination holds the source's bytes."""
        raise NotImplementedError


class _HostPages(_Pages):
    def __init__(self, data: np.ndarray) -> None:
        self.src, self.out = data, np.zeros_like(data)

    def clear(self) -> None:
        self.out[:] = 0

    def arrived(self) -> bool:
        return bool(np.array_equal(self.out, self.src))


class _DevicePages(_Pages):
    """Two device buffers of the prefix's size on device 0, as one address per page (the source
    uploaded once from ``data``)."""

    def __init__(self, data: np.ndarray) -> None:
        from .._cuda._driver import PrimaryContext, check, driver

        self._drv, self._check = driver(), check
        self._data = data
        self._context = PrimaryContext(0)
        self._buffers: list[int] = []
        nbytes, page = data.nbytes, data.shape[1]
        try:
            with self._context.current():
                for _ in range(2):
                    self._buffers.append(int(check("cuMemAlloc", self._drv.cuMemAlloc(nbytes))))
                check("cuMemcpyHtoD", self._drv.cuMemcpyHtoD(self._buffers[0], data.ctypes.data, nbytes))
                # From pageable memory the call may return before the bytes land, on the legacy stream
                # (the engine's streams do not wait for it).
                check("cuCtxSynchronize", self._drv.cuCtxSynchronize())
        except BaseException:
            self.close()
            raise
        self.src, self.out = ([base + i * page for i in range(len(data))] for base in self._buffers)

    def clear(self) -> None:
        with self._context.current():
            self._check("cuMemsetD8", self._drv.cuMemsetD8(self._buffers[1], 0, self._data.nbytes))
            self._check("cuCtxSynchronize", self._drv.cuCtxSynchronize())  # a memset returns before it ran

    def arrived(self) -> bool:
        back = np.empty_like(self._data)
        with self._context.current():
            self._check("cuMemcpyDtoH", self._drv.cuMemcpyDtoH(back.ctypes.data, self._buffers[1], back.nbytes))
        return bool(np.array_equal(back, self._data))

    def close(self) -> None:
        with self._context.current():
            while self._buffers:
                self._check("cuMemFree", self._drv.cuMemFree(self._buffers.pop()))
        self._context.release()


def gpu_missing() -> str | None:
    """Why the prefix cannot be loaded into GPU memory here (None: device 0 can be used)."""
    from .._cuda._driver import device_count
    from .._errors import CudaError, CudaUnavailableError

    try:
        count = device_count()
    except (CudaUnavailableError, CudaError) as exc:
        return f"no CUDA device: {str(exc).removeprefix('a CUDA device was requested but ')}"
    return None if count else "no CUDA device: the driver sees none"


def section(quick: bool, path: str | None) -> dict[str, Any]:
    """The disk tier's write-back and read-back against the plain loop, per block size; a restart;
    a prefix loaded through both tiers."""
    directory = tempfile.mkdtemp(prefix="aiokvtier-bench-", dir=path or ".")
    try:
        total = 32 * MiB if quick else 512 * MiB
        rounds = 2 if quick else 5
        sizes = [64 * KiB, 2 * MiB] if quick else [64 * KiB, 256 * KiB, 2 * MiB]
        results = [asyncio.run(_one_size(directory, block, total, rounds)) for block in sizes]
        reopen = asyncio.run(_reopen(directory, 10_000 if quick else 100_000, 3))
        prefix, prefix_gpu = _prefix_arms(directory, quick)
        usage = shutil.disk_usage(directory)
        return {
            "directory": os.path.abspath(directory),
            "free_gib": round(usage.free / (1 << 30), 1),
            "threads": THREADS,
            "settle_s": SETTLE_S,
            "bytes_per_round": total,
            "disk": results,
            "reopen": reopen,
            "prefix_load": prefix,
            "prefix_load_gpu": prefix_gpu,
            "mooncake": _mooncake.row(quick),
        }
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _prefix_arms(directory: str, quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The prefix load to host memory, and to GPU memory where a CUDA device can be used."""
    blocks, rounds = (128, 2) if quick else (1024, 5)
    prefix = asyncio.run(_prefix_load(directory, blocks, rounds))
    missing = gpu_missing()
    if missing is not None:
        return prefix, {"skipped": f"needs CUDA: {missing}"}
    try:
        return prefix, asyncio.run(_prefix_load(directory, blocks, rounds, "gpu"))
    except Exception as exc:  # not yet run on a GPU: report, and keep the section's other figures
        return prefix, {"error": repr(exc)}


def prefix_section(quick: bool, path: str | None) -> dict[str, Any]:
    """Only the prefix load of ``section`` (both destinations): ``bench store --sections prefix``."""
    directory = tempfile.mkdtemp(prefix="aiokvtier-bench-", dir=path or ".")
    try:
        prefix, prefix_gpu = _prefix_arms(directory, quick)
        return {"directory": os.path.abspath(directory), "prefix_load": prefix, "prefix_load_gpu": prefix_gpu}
    finally:
        shutil.rmtree(directory, ignore_errors=True)
