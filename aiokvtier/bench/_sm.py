"""``bench cuda --sections copy_bandwidth`` (SM part) and ``sm_concurrent_compute``: the SM copy
path beside the copy engines and a plain anchor gather, as fractions of one large pinned copy."""

from __future__ import annotations

import asyncio
import ctypes
import statistics
import threading
import time
from dataclasses import replace
from typing import Any

import numpy as np

from .._config import HostTierConfig
from .._copy._engine import CopyEngine
from .._cuda import _kernel, _sm
from .._cuda._driver import PrimaryContext, check, driver
from .._host._tier import HostTier
from ._common import GiB, MiB

PAGES = (4 << 10, 16 << 10, 64 << 10, 2 * MiB)
ARMS = (
    ("dma", {"method": "dma"}),
    ("sm4", {"method": "sm", "sm_budget": 4}),
    ("sm8", {"method": "sm", "sm_budget": 8}),
)
LAUNCH = _sm.SmOptions()
"""How the kernel launches requests unless a study says otherwise: the library's default."""
KERNEL_BUDGETS = (4, 8)
"""The library's kernel alone (descriptor upload and sliced launches, as the engine submits them), device-timed."""

ANCHOR = r"""
// The anchor: a plain gather of the kind serving stacks use; PROGRAMS blocks loop over the
// copy jobs, 1024 threads moving one 8-byte word each per step.
extern "C" __global__ void anchor_copy(const unsigned long long* srcs, const unsigned long long* dsts,
                                       const unsigned long long* sizes, unsigned long long n) {
    for (unsigned long long p = blockIdx.x; p < n; p += gridDim.x) {
        const unsigned long long* s = (const unsigned long long*)srcs[p];
        unsigned long long* d = (unsigned long long*)dsts[p];
        for (unsigned long long i = threadIdx.x; i < sizes[p] / 8; i += blockDim.x) d[i] = s[i];
    }
}
"""


ROUNDS = 3
"""Matmul loops per arm (and alone): the slowdown is the median's, against the median alone."""

MATMUL_ARMS: tuple[tuple[str, dict[str, Any], int | None], ...] = (
    ("dma", {"method": "dma"}, None),
    ("sm4", {"method": "sm", "sm_budget": 4}, None),
    ("sm8", {"method": "sm", "sm_budget": 8}, None),
    ("sm4_unsliced", {"method": "sm", "sm_budget": 4}, 1 << 62),
    ("sm8_unsliced", {"method": "sm", "sm_budget": 8}, 1 << 62),
)
"""Beside the matmul: the copy engines, the kernel at the default slice (``SmOptions.slice_bytes``)
and launched whole per request, as it was."""


def _cfg(total: int, page: int) -> HostTierConfig:
    return HostTierConfig.model_validate(
        {"quota": total, "max_quota": total, "slot_size": page, "device": 0, "backing": "vmm", "fill_threads": 2}
    )


class Anchor:
    """The plain gather, 16 programs, launched on its own stream."""

    def __init__(self, programs: int = 16) -> None:
        drv = driver()
        arch = _kernel.device_arch(0)
        cubin = _kernel._compile(_kernel.KernelSpec(arch, threads=1024, unroll=1), ANCHOR)
        self._image = np.frombuffer(cubin, dtype=np.uint8).copy()
        self.module = check("cuModuleLoadData", drv.cuModuleLoadData(self._image.ctypes.data))
        self.fn = check("cuModuleGetFunction", drv.cuModuleGetFunction(self.module, b"anchor_copy"))
        self.programs = programs
        self.launch = _kernel._launch_function(drv)

    def run(self, desc: int, n: int, stream: Any) -> None:
        vals = (ctypes.c_uint64 * 4)(desc, desc + 8 * n, desc + 16 * n, n)
        params = (ctypes.c_void_p * 4)(*(ctypes.addressof(vals) + 8 * i for i in range(4)))
        rc = self.launch(int(self.fn), self.programs, 1, 1, 1024, 1, 1, 0, int(stream), ctypes.addressof(params), None)
        if rc:
            raise RuntimeError(f"anchor launch failed: {rc}")


HOLD_LIMIT = 10.0
"""Seconds a gate holds its streams at most: work queued behind it that synchronizes a held stream
(the SM path's clean-up after a refused launch) would otherwise wait for a release that never comes."""


class Gate:
    """A pinned word that a stream waits on (``cuStreamWaitValue32``): work queued behind a held gate
    starts only once all of it is queued, so events around it time the device alone. Without the
    gate, the time the host spends before the first operation is queued (building a request's
    descriptors: tens of microseconds at 32k pages) counts as device time, the stream idle."""

    def __init__(self) -> None:
        drv = driver()
        self.host = int(check("cuMemHostAlloc", drv.cuMemHostAlloc(4, 0)))
        self.word = ctypes.c_uint32.from_address(self.host)
        self.word.value = self.value = 0
        self.device = int(check("cuMemHostGetDevicePointer", drv.cuMemHostGetDevicePointer(self.host, 0)))
        self.usable = True
        """False once the driver has refused a wait (no stream memory operations) or a hold ran past
        ``HOLD_LIMIT``: timing is then ungated."""
        self._timer: threading.Timer | None = None

    def hold(self, *streams: Any) -> bool:
        """Queue a wait for the next value on each of ``streams``; False where the driver refuses it
        (the streams already held then run at once)."""
        if not self.usable:
            return False
        drv = driver()
        flags = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        self.value += 1
        try:
            for stream in streams:
                (err,) = drv.cuStreamWaitValue32(stream, self.device, self.value, flags)
                if int(err) != 0:
                    self.usable = False
                    self.release()
                    return False
        except BaseException:
            self.release()
            raise
        self._timer = threading.Timer(HOLD_LIMIT, self._expire)
        self._timer.daemon = True
        self._timer.start()
        return True

    def _expire(self) -> None:
        self.usable = False
        self.word.value = self.value

    def release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.word.value = self.value

    def close(self) -> None:
        self.release()
        driver().cuMemFreeHost(self.host)


def sync_time(fn: Any, stream: Any, repeats: int = 3, gate: Gate | None = None, also: tuple[Any, ...] = ()) -> float:
    """Seconds, the best of ``repeats``, timed by events on ``stream``; with a ``gate``, the work is
    all queued before it starts (no host time in it), else it starts as it is queued. ``also``:
    other streams the work uses, held by the gate too."""
    drv = driver()
    start, end = (check("cuEventCreate", drv.cuEventCreate(0)) for _ in range(2))
    try:
        fn()
        best = float("inf")
        for _ in range(repeats):
            held = gate is not None and gate.hold(stream, *also)
            try:
                check("cuEventRecord", drv.cuEventRecord(start, stream))
                fn()
                check("cuEventRecord", drv.cuEventRecord(end, stream))
            finally:
                if held:  # never leave the stream waiting
                    assert gate is not None
                    gate.release()
            check("cuEventSynchronize", drv.cuEventSynchronize(end))
            best = min(best, float(check("cuEventElapsedTime", drv.cuEventElapsedTime(start, end))) / 1e3)
        return best
    finally:
        drv.cuEventDestroy(start)
        drv.cuEventDestroy(end)


async def _page_size(
    page: int,
    total: int,
    dbuf: int,
    stream: Any,
    anchor: Anchor,
    rate: dict[str, float],
    gate: Gate,
    options: _sm.SmOptions,
) -> Any:
    drv = driver()
    n = total // page
    row: dict[str, Any] = {"pages": n}
    async with HostTier(_cfg(total, page)) as tier:
        await tier.wait_resident()
        slots = np.asarray(await tier.allocate(n), dtype=np.int64)
        slots = slots[np.random.default_rng(1).permutation(n)]
        dev = np.uint64(dbuf) + np.random.default_rng(2).permutation(n).astype(np.uint64) * np.uint64(page)
        host = np.uint64(tier.base_address) + slots.astype(np.uint64) * np.uint64(page)
        for name, kwargs in ARMS:
            async with CopyEngine(0, **kwargs, sm_options=options) as engine:
                for direction in ("h2d", "d2h"):
                    call = engine.to_device if direction == "h2d" else engine.to_host
                    await call(tier, slots, dev)
                    times = []
                    for _ in range(3):
                        t0 = time.perf_counter()
                        await call(tier, slots, dev)
                        times.append(time.perf_counter() - t0)
                    row[f"{name}_{direction}"] = round(n * page / min(times) / rate[direction], 3)
                if name == "dma":
                    t0 = time.perf_counter()
                    for _ in range(5):
                        engine._plan_slots(tier, slots, dev, "h2d")
                    row["planning_us_per_page"] = round((time.perf_counter() - t0) / 5 / n * 1e6, 4)
        # The library's kernel alone: what the engine queues for a request (the descriptor upload and
        # the sliced launches), timed on the device, so neither planning nor the hand-offs are in it.
        for budget in KERNEL_BUDGETS:
            path = _sm.SmPath(0, budget, options=options)
            try:
                for direction in ("h2d", "d2h"):
                    srcs, dsts = (host, dev) if direction == "h2d" else (dev, host)
                    sizes = np.full(n, page, dtype=np.uint64)

                    def submit(d: Any = dsts, s: Any = srcs, z: Any = sizes, p: Any = path) -> None:
                        # The slab goes back at once: the next call writes the same descriptors into it.
                        p.give_back(p.submit(d, s, z, stream))

                    # The partner stream, where the upload may run (SmOptions.head), is held too; where it is
                    # refused, nothing is (None would name the default stream).
                    partner = tuple(x for x in (path.partner(stream),) if x is not None)
                    for key, held in (
                        (f"kernel{budget}_{direction}", gate),
                        (f"kernel{budget}_{direction}_ungated", None),
                    ):
                        secs = sync_time(submit, stream, gate=held, also=partner)
                        row[key] = round(n * page / secs / rate[direction], 3)
            finally:
                check("cuStreamSynchronize", drv.cuStreamSynchronize(stream))
                path.close()
        # The anchor, on descriptors already in device memory (its best case).
        for direction in ("h2d", "d2h"):
            srcs, dsts = (host, dev) if direction == "h2d" else (dev, host)
            arr = np.concatenate([srcs, dsts, np.full(n, page, dtype=np.uint64)])
            desc = int(check("cuMemAlloc", drv.cuMemAlloc(arr.nbytes)))
            try:
                check("cuMemcpyHtoD", drv.cuMemcpyHtoD(desc, arr.ctypes.data, arr.nbytes))
                secs = sync_time(lambda d=desc: anchor.run(d, n, stream), stream, gate=gate)
            finally:
                drv.cuMemFree(desc)
            row[f"anchor16_{direction}"] = round(n * page / secs / rate[direction], 3)
    return row


async def _bandwidth(total: int, options: _sm.SmOptions) -> dict[str, Any]:
    drv = driver()
    ctx = PrimaryContext(0)
    ctx.make_current()
    stream = check("cuStreamCreate", drv.cuStreamCreate(1))
    dbuf = int(check("cuMemAlloc", drv.cuMemAlloc(total)))
    pinned = int(check("cuMemHostAlloc", drv.cuMemHostAlloc(GiB, 1)))
    out: dict[str, Any] = {
        "unit": "fraction of one 1 GiB pinned copy",
        "total_mib": total // MiB,
        "timing": "dma/sm*: awaited engine calls from the loop (planning, hand-offs included); "
        "kernel*: the engine's upload and launches alone, queued behind a gate, then device-timed "
        "(kernel*_ungated: timed from when the host starts building the descriptors, the stream idle "
        "meanwhile); anchor16 and the one copy: device-timed behind the gate",
        **{name: getattr(options, name) for name in ("slice_bytes", "alternate", "pdl", "pack", "bounded", "head")},
    }
    gate = Gate()
    try:
        scratch = int(check("cuMemAlloc", drv.cuMemAlloc(GiB)))
        try:
            h2d = sync_time(
                lambda: check("h2d", drv.cuMemcpyHtoDAsync(scratch, pinned, GiB, stream)), stream, gate=gate
            )
            d2h = sync_time(
                lambda: check("d2h", drv.cuMemcpyDtoHAsync(pinned, scratch, GiB, stream)), stream, gate=gate
            )
        finally:
            drv.cuMemFree(scratch)
        rate = {"h2d": GiB / h2d, "d2h": GiB / d2h}
        out["one_copy_GBps"] = {d: round(r / 1e9, 2) for d, r in rate.items()}
        anchor = Anchor()
        for page in PAGES:
            out[f"shuffled_{page >> 10}KiB"] = await _page_size(page, total, dbuf, stream, anchor, rate, gate, options)
        drv.cuModuleUnload(anchor.module)
        out["gated"] = gate.usable
    finally:
        gate.close()
        drv.cuMemFreeHost(pinned)
        drv.cuMemFree(dbuf)
        drv.cuStreamDestroy(stream)
        ctx.release()
    return out


def copy_bandwidth_sm(total: int, options: _sm.SmOptions = LAUNCH) -> dict[str, Any]:
    return asyncio.run(_bandwidth(total, options))


def queue_matmuls(a: Any, side: Any, k: int) -> tuple[Any, Any]:
    """Queue ``k`` matmuls ``a @ a`` on the torch stream ``side`` between two timing events; returns
    them (the concurrent-compute check of DESIGN section 7; the caller synchronizes)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        start.record(side)
        for _ in range(k):
            a @ a
        end.record(side)
    return start, end


async def _with_matmul(total: int, page: int, launch: _sm.SmOptions) -> dict[str, Any]:
    import torch

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()

    def matmuls(k: int) -> float:
        """Seconds of GPU time from the first matmul's start to the last one's end (events on ``side``)."""
        start, end = queue_matmuls(a, side, k)
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    matmuls(3)
    alone = statistics.median(matmuls(20) for _ in range(ROUNDS))
    n = total // page
    out: dict[str, Any] = {"page_kib": page >> 10, "matmul_alone_ms": round(alone * 1e3, 2)}
    dev = torch.empty((n, page), dtype=torch.uint8, device="cuda")
    async with HostTier(_cfg(total, page)) as tier:
        await tier.wait_resident()
        slots = np.asarray(await tier.allocate(n), dtype=np.int64)[np.random.default_rng(3).permutation(n)]
        for name, kwargs, slice_bytes in MATMUL_ARMS:
            options = launch if slice_bytes is None else replace(launch, slice_bytes=slice_bytes)
            async with CopyEngine(0, **kwargs, sm_options=options) as engine:
                await engine.to_device(tier, slots, dev)
                loop = asyncio.get_running_loop()
                slowed, copies, wall = [], 0, 0.0
                for _ in range(ROUNDS):
                    busy = loop.run_in_executor(None, matmuls, 20)
                    started = time.perf_counter()
                    while not busy.done():
                        await engine.to_device(tier, slots, dev)
                        await engine.to_host(tier, slots, dev)
                        copies += 2
                    wall += time.perf_counter() - started
                    slowed.append(await busy)
            out[name] = {
                "matmul_slowdown": round(statistics.median(slowed) / alone - 1, 3),
                "matmul_slowdowns": [round(t / alone - 1, 3) for t in slowed],
                "copies_during": copies,
                "copy_GBps_during": round(copies * n * page / wall / 1e9, 2),
            }
    return out


def concurrent_compute(total: int, options: _sm.SmOptions = LAUNCH) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device visible to torch"}
    return {f"{p >> 10}KiB": asyncio.run(_with_matmul(total, p, options)) for p in (4 << 10, 16 << 10)}
