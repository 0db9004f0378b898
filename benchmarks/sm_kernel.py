"""Study: the SM copy kernel on the device alone, beside the plain anchor gather, and beside a matmul.

python benchmarks/sm_kernel.py [--gib 1] [--repeats 5] [--no-matmul] > OUT.json

``bench cuda --sections copy_bandwidth`` times awaited engine calls from the
event loop, so planning, the descriptor upload and the hand-offs are in its
figures, and not in the anchor's. This program takes the host out: shuffled
pages (both sides permuted), descriptors already in device memory, each
launch timed with CUDA events (median of ``--repeats``), as a fraction of one
pinned copy of the same bytes in the same run. Arms:

- ``anchor{P}``: the plain gather (P blocks of 1024 threads, 8-byte words);
- ``ldst_t{T}_u{U}_b{B}``: the library's kernel shape (T threads per block,
  U 16-byte loads in flight per lane, B blocks = SMs);
- ``bulk_c{C}_p{P}_b{B}``: a variant where C threads per block each move
  P-byte pieces with ``cp.async.bulk`` (the SM's bulk-copy unit) through
  shared memory, so bytes in flight are not bounded by registers.

Every arm's copy is checked bit-exact on a sample of pages. Then, with torch,
a bf16 8192x8192 matmul loop on its own stream while copies run back to
back on another: the matmul's slowdown and the copies' rate during it, for
the copy engines and for the kernel launched whole per request or in slices
(a slice bounds how long its blocks hold their SMs).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from aiokvtier._cuda import _kernel
from aiokvtier._cuda._batch import BatchCall, resolve_batch_function
from aiokvtier._cuda._driver import PrimaryContext, check, driver
from aiokvtier.bench._sm import ANCHOR, PAGES, queue_matmuls  # the bench's gather, pages, matmul loop

MiB, GiB = 1 << 20, 1 << 30


# Each thread is a channel with its own PIECE bytes of shared memory and its own mbarrier:
# bulk load global -> shared (completes on the barrier), then bulk store shared -> global;
# the next load into the buffer waits until the store has read it. Pages 16-byte aligned,
# lengths multiples of 16 (the study's pages are).
BULK = r"""
typedef unsigned long long u64;
extern "C" __global__ void __launch_bounds__(THREADS)
bulk_copy(const u64* __restrict__ srcs, const u64* __restrict__ dsts, const u64* __restrict__ sizes, u64 n)
{
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) u64 bars[THREADS];
    const unsigned t = threadIdx.x;
    const unsigned sbuf = (unsigned)__cvta_generic_to_shared(smem + (u64)t * UNROLL);
    const unsigned bar = (unsigned)__cvta_generic_to_shared(&bars[t]);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const u64 ch = (u64)blockIdx.x * blockDim.x + t, chans = (u64)gridDim.x * blockDim.x;
    const u64 share = n >= chans ? 1 : chans / n;
    const u64 groups = chans / share, group = ch / share, rank = ch % share;
    unsigned phase = 0;
    if (group < groups) {
        for (u64 p = group; p < n; p += groups) {
            const u64 s = srcs[p], d = dsts[p], len = sizes[p];
            for (u64 off = rank * UNROLL; off < len; off += share * UNROLL) {
                const unsigned bytes = (unsigned)(len - off < UNROLL ? len - off : UNROLL);
                asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                             :: "r"(bar), "r"(bytes) : "memory");
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                             :: "r"(sbuf), "l"(s + off), "r"(bytes), "r"(bar) : "memory");
                unsigned done = 0;
                while (!done) {
                    asm volatile("{ .reg .pred P; mbarrier.try_wait.parity.shared::cta.b64 P, [%1], %2;"
                                 " selp.u32 %0, 1, 0, P; }" : "=r"(done) : "r"(bar), "r"(phase) : "memory");
                }
                phase ^= 1u;
                asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                             :: "l"(d + off), "r"(sbuf), "r"(bytes) : "memory");
                asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            }
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""


class Kernel:
    """One compiled kernel: ``fn(srcs, dsts, sizes, n)`` launched with a fixed block shape."""

    def __init__(self, source: str, name: str, threads: int, unroll: int, smem: int = 0) -> None:
        drv = driver()
        spec = _kernel.KernelSpec(_kernel.device_arch(0), threads=threads, unroll=unroll)
        self.image = np.frombuffer(_kernel._compile(spec, source), dtype=np.uint8).copy()
        self.module = check("cuModuleLoadData", drv.cuModuleLoadData(self.image.ctypes.data))
        self.fn = check("cuModuleGetFunction", drv.cuModuleGetFunction(self.module, name.encode()))
        self.threads, self.smem = threads, smem
        if smem > 48 << 10:
            attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check("cuFuncSetAttribute", drv.cuFuncSetAttribute(self.fn, attr, smem))
        self.launch_fn = _kernel._launch_function(drv)

    def launch(self, desc: int, n: int, blocks: int, stream: Any, first: int = 0, count: int | None = None) -> None:
        """Copies ``first .. first + count`` of the ``n`` whose arrays start at ``desc``."""
        count = n - first if count is None else count
        vals = (ctypes.c_uint64 * 4)(desc + 8 * first, desc + 8 * (n + first), desc + 8 * (2 * n + first), count)
        params = (ctypes.c_void_p * 4)(*(ctypes.addressof(vals) + 8 * i for i in range(4)))
        rc = self.launch_fn(
            int(self.fn), blocks, 1, 1, self.threads, 1, 1, self.smem, int(stream), ctypes.addressof(params), None
        )
        if rc:
            raise RuntimeError(f"launch failed: {driver().CUresult(rc).name}")


def event_ms(fn: Any, stream: Any, repeats: int) -> float:
    drv = driver()
    a, b = (check("cuEventCreate", drv.cuEventCreate(0)) for _ in range(2))
    fn()
    times = []
    for _ in range(repeats):
        check("cuEventRecord", drv.cuEventRecord(a, stream))
        fn()
        check("cuEventRecord", drv.cuEventRecord(b, stream))
        check("cuEventSynchronize", drv.cuEventSynchronize(b))
        times.append(float(check("cuEventElapsedTime", drv.cuEventElapsedTime(a, b))))
    drv.cuEventDestroy(a)
    drv.cuEventDestroy(b)
    return statistics.median(times)


class Layout:
    """Shuffled pages of one size between the host buffer and the device buffer, both directions."""

    def __init__(self, page: int, total: int, host: int, dev: int) -> None:
        drv = driver()
        self.page, self.n = page, total // page
        rng = np.random.default_rng(page)
        self.hoff = rng.permutation(self.n).astype(np.uint64) * np.uint64(page)
        self.doff = rng.permutation(self.n).astype(np.uint64) * np.uint64(page)
        self.host, self.dev = host, dev
        self.desc: dict[str, int] = {}
        self.arrays: dict[str, tuple[Any, Any, Any]] = {}
        for direction in ("h2d", "d2h"):
            h, d = np.uint64(host) + self.hoff, np.uint64(dev) + self.doff
            srcs, dsts = (h, d) if direction == "h2d" else (d, h)
            sizes = np.full(self.n, page, dtype=np.uint64)
            arr = np.ascontiguousarray(np.concatenate([srcs, dsts, sizes]))
            ptr = int(check("cuMemAlloc", drv.cuMemAlloc(arr.nbytes)))
            check("cuMemcpyHtoD", drv.cuMemcpyHtoD(ptr, arr.ctypes.data, arr.nbytes))
            self.desc[direction] = ptr
            self.arrays[direction] = (dsts.copy(), srcs.copy(), sizes)

    def free(self) -> None:
        for ptr in self.desc.values():
            driver().cuMemFree(ptr)


def check_exact(layout: Layout, direction: str, host_view: Any, dev: int, run: Any, stream: Any) -> bool:
    """Fill the source with a pattern, run the copy once, compare a sample of pages."""
    drv = driver()
    n, page = layout.n, layout.page
    sample = np.random.default_rng(7).choice(n, size=min(n, 64), replace=False)
    pattern = np.random.default_rng(8).integers(0, 256, size=page, dtype=np.uint8)
    scratch = np.empty(page, dtype=np.uint8)
    for i in sample:
        hoff, doff = int(layout.hoff[i]), int(layout.doff[i])
        mark = np.roll(pattern, int(i))
        if direction == "h2d":
            host_view[hoff : hoff + page] = mark
            check("cuMemsetD8", drv.cuMemsetD8(dev + doff, 0, page))
        else:
            check("cuMemcpyHtoD", drv.cuMemcpyHtoD(dev + doff, mark.ctypes.data, page))
            host_view[hoff : hoff + page] = 0
    check("cuCtxSynchronize", drv.cuCtxSynchronize())
    run()
    check("cuStreamSynchronize", drv.cuStreamSynchronize(stream))
    for i in sample:
        hoff, doff = int(layout.hoff[i]), int(layout.doff[i])
        mark = np.roll(pattern, int(i))
        if direction == "h2d":
            check("cuMemcpyDtoH", drv.cuMemcpyDtoH(scratch.ctypes.data, dev + doff, page))
            got = scratch
        else:
            got = host_view[hoff : hoff + page]
        if not np.array_equal(got, mark):
            return False
    return True


def bandwidth(args: argparse.Namespace, host: int, host_view: Any, dev: int, stream: Any) -> dict[str, Any]:
    drv = driver()
    total = args.gib * GiB
    ceiling = {
        "h2d": event_ms(lambda: check("h2d", drv.cuMemcpyHtoDAsync(dev, host, total, stream)), stream, args.repeats),
        "d2h": event_ms(lambda: check("d2h", drv.cuMemcpyDtoHAsync(host, dev, total, stream)), stream, args.repeats),
    }
    out: dict[str, Any] = {
        "one_copy_GBps": {k: round(total / v / 1e6, 2) for k, v in ceiling.items()},
        "unit": "fraction of one pinned copy of the same bytes, device-timed, median",
    }
    anchor = Kernel(ANCHOR, "anchor_copy", 1024, 1)
    arms: list[tuple[str, Kernel, int]] = [(f"anchor{p}", anchor, p) for p in (8, 16, 32)]
    for threads, unroll in ((1024, 8), (1024, 16), (512, 16), (256, 16), (1024, 4)):
        k = Kernel(_kernel.SOURCE, _kernel.KERNEL_NAME, threads, unroll)
        arms += [(f"ldst_t{threads}_u{unroll}_b{b}", k, b) for b in (4, 8, 16)]
    bulk: list[tuple[str, Kernel, int]] = []
    for channels, piece in ((32, 4096), (48, 4096), (16, 8192), (24, 8192), (12, 16384)):
        try:
            k = Kernel(BULK, "bulk_copy", channels, piece, smem=channels * piece)
        except Exception as exc:  # a study: record and go on
            out[f"bulk_c{channels}_p{piece}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        bulk += [(f"bulk_c{channels}_p{piece}_b{b}", k, b) for b in (4, 8)]
    for page in PAGES:
        layout = Layout(page, total, host, dev)
        row: dict[str, Any] = {"pages": layout.n}
        for name, kern, blocks in arms + bulk:
            for direction in ("h2d", "d2h"):
                desc = layout.desc[direction]

                def go(k: Kernel = kern, d: int = desc, b: int = blocks, n: int = layout.n) -> None:
                    k.launch(d, n, b, stream)

                try:
                    exact = check_exact(layout, direction, host_view, dev, go, stream)
                    ms = event_ms(go, stream, args.repeats)
                except Exception as exc:  # recorded; a lost context ends the study
                    row[f"{name}_{direction}"] = f"{type(exc).__name__}: {exc}"[:200]
                    if "ILLEGAL" in str(exc) or "LAUNCH_FAILED" in str(exc):
                        out[f"shuffled_{page >> 10}KiB"] = row
                        out["aborted"] = f"context lost at {name} {direction}"
                        return out
                    continue
                row[f"{name}_{direction}"] = round(ceiling[direction] / ms, 3) if exact else "NOT EXACT"
        layout.free()
        out[f"shuffled_{page >> 10}KiB"] = row
        print(json.dumps({page: row}), file=sys.stderr, flush=True)
    return out


def with_matmul(args: argparse.Namespace, host: int, dev: int, stream: Any) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed"}
    drv = driver()
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()

    def matmuls(k: int = 20) -> tuple[Any, Any]:
        return queue_matmuls(a, side, k)

    s, e = matmuls(3)
    e.synchronize()
    alone = []
    for _ in range(3):
        s, e = matmuls()
        e.synchronize()
        alone.append(s.elapsed_time(e))
    base = statistics.median(alone)
    out: dict[str, Any] = {"matmul_alone_ms": round(base, 2), "request_mib": args.request_mib}
    kernel = Kernel(_kernel.SOURCE, _kernel.KERNEL_NAME, 1024, 8)
    batch_fn, abi = resolve_batch_function(drv)
    request = args.request_mib * MiB
    for page in (4 << 10, 16 << 10):
        layout = Layout(page, args.gib * GiB, host, dev)
        per = request // page
        calls = {d: BatchCall(batch_fn, abi, d, 0) for d in ("h2d", "d2h")}
        arms: list[tuple[str, Any]] = [("dma", None)]
        arms += [(f"sm8_slice{s >> 10}KiB" if s < request else "sm8_whole", s) for s in (request, 8 * MiB, 2 * MiB)]
        row: dict[str, Any] = {}
        for name, slice_bytes in arms:

            def issue(
                i: int, slice_bytes: int | None = slice_bytes, lay: Layout = layout, per: int = per, calls: Any = calls
            ) -> None:
                direction = ("h2d", "d2h")[i % 2]
                first = (i // 2 * per) % lay.n
                if slice_bytes is None:
                    d, s_, z = lay.arrays[direction]
                    for c in range(first, first + per, 1024):
                        calls[direction](d[c : c + 1024], s_[c : c + 1024], z[c : c + 1024], stream)
                    return
                step = max(1, slice_bytes // lay.page)
                for c in range(first, first + per, step):
                    kernel.launch(lay.desc[direction], lay.n, 8, stream, c, min(step, first + per - c))

            slowdowns, rates = [], []
            for _ in range(2):
                events: list[Any] = []
                start, end = matmuls()
                t0, moved, i = time.perf_counter(), 0, 0
                while not end.query():
                    if len(events) >= 2:
                        done = events.pop(0)
                        check("cuEventSynchronize", drv.cuEventSynchronize(done))
                        drv.cuEventDestroy(done)
                    issue(i)
                    ev = check("cuEventCreate", drv.cuEventCreate(2))
                    check("cuEventRecord", drv.cuEventRecord(ev, stream))
                    events.append(ev)
                    i += 1
                    moved += request
                end.synchronize()
                check("cuStreamSynchronize", drv.cuStreamSynchronize(stream))
                wall = time.perf_counter() - t0
                for ev in events:
                    drv.cuEventDestroy(ev)
                slowdowns.append(start.elapsed_time(end) / base - 1)
                rates.append(moved / wall / 1e9)
            row[name] = {"matmul_slowdown": round(statistics.median(slowdowns), 3),
                         "copy_GBps_during": round(statistics.median(rates), 2)}  # fmt: skip
        layout.free()
        out[f"{page >> 10}KiB"] = row
        print(json.dumps({f"matmul {page}": row}), file=sys.stderr, flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--request-mib", type=int, default=128)
    parser.add_argument("--no-matmul", action="store_true")
    args = parser.parse_args()
    drv = driver()
    ctx = PrimaryContext(0)
    ctx.make_current()
    total = args.gib * GiB
    stream = check("cuStreamCreate", drv.cuStreamCreate(1))
    host = int(check("cuMemHostAlloc", drv.cuMemHostAlloc(total, 0x01 | 0x02)))
    host_view = np.ctypeslib.as_array((ctypes.c_uint8 * total).from_address(host))
    dev = int(check("cuMemAlloc", drv.cuMemAlloc(total)))
    name = check("cuDeviceGetName", drv.cuDeviceGetName(64, 0))
    result: dict[str, Any] = {"device": bytes(name).rstrip(b"\0").decode(), "gib": args.gib}
    try:
        if not args.no_matmul:
            result["with_matmul"] = with_matmul(args, host, dev, stream)
        result["bandwidth"] = bandwidth(args, host, host_view, dev, stream)
    finally:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
