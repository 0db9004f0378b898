"""The SM copy kernel: its CUDA source, run-time compilation, descriptor building.

The copy engines process one descriptor at a time; below ~32 KiB their
per-copy overhead dominates (shuffled 16 KiB pages: 40% of the PCIe ceiling
H2D, 30% D2H on the H200). Here, SMs read and write host memory directly
over UVA instead: registered units (``cuMemHostRegister``; the driver maps
them at the same address where
``CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`` is 1) and
vmm units (``cuMemSetAccess`` grants the device read-write).

Reaching wire speed is a matter of bytes in flight: a plain gather of 16
programs moving 8 KiB per step needs 16-32 SMs for 92% of the ceiling.
This kernel keeps more in flight per SM: blocks of many warps (one block
per SM of the budget), each lane issuing ``UNROLL`` 16-byte streaming loads
(``ld.global.cs``, so host pages do not evict the model's working set from
L2) before its first store. One warp copies a page; when the request has
fewer pages than warps, warps share a page, so a few large pages still use
the whole budget.

Compilation: NVRTC through ``cuda.core`` (``Program(...).compile("cubin")``)
for the device's own ``sm_XY``, once per architecture and process; where
``cuda.core`` is not installed, ``cuda.bindings.nvrtc`` directly (the same
library; cuda.core adds nothing the cubin needs). The cubin is loaded into
the engine's context by the driver and launched with ``cuLaunchKernel``
through ctypes, like the batch call: no Python object per launch argument.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import logging
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import CudaError, CudaUnavailableError
from ._driver import check, driver

log = logging.getLogger("aiokvtier")

__all__ = [
    "DEFAULT_SM_BUDGET",
    "DESCRIPTOR_BYTES",
    "KERNEL_NAME",
    "PACKED_BYTES",
    "Descriptors",
    "KernelSpec",
    "SmKernel",
    "compile_cubin",
    "cubin_path",
    "descriptor_block",
    "vector_aligned",
]

U64 = npt.NDArray[np.uint64]

DEFAULT_SM_BUDGET = 4
"""Blocks launched, one per SM: 4 of the H200's 132. Every SM the copy takes is
taken from the model (LMCache measured its scatter kernels waiting ~1.6 ms to
be scheduled during prefill), so the default is the fewest that reach the
link's ceiling: on the H200, 4 blocks of this kernel moved shuffled 4-64 KiB
pages at 92.5-95% of one pinned copy, as 8 and 16 did
(``python benchmarks/sm_kernel.py``); the bench reports a concurrent matmul's
slowdown for it."""

DESCRIPTOR_BYTES = 24
"""Per copy, wide: source, destination and length, 8 bytes each (three arrays)."""

PACKED_BYTES = 8
"""Per copy, packed: a 32-bit index on each side (copies of one length). The upload crosses the
link the copy uses: at 4 KiB pages host to device, 24 bytes per page cost 0.6% of the link, 8 cost 0.2%."""

KERNEL_NAME = "aiokvtier_copy_pages"
PACKED_NAME = "aiokvtier_copy_packed"
KERNEL_VERSION = 3
"""Bumped when the source changes meaning: part of the crossover file's key."""

SOURCE = r"""
typedef unsigned long long u64;
struct __align__(16) v4 { unsigned x, y, z, w; };

static __device__ __forceinline__ v4 load_stream(const v4* p) {
    v4 r;
    asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

static __device__ __forceinline__ void store_stream(v4* p, v4 v) {
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// A group of `share` warps copies a page; groups stride over the pages.
struct Work { u64 lane, share, groups, group, rank; };

static __device__ __forceinline__ Work split(u64 n) {
    Work w;
    w.lane = threadIdx.x & 31u;
    const u64 warps_per_block = blockDim.x >> 5;
    const u64 warp = (u64)blockIdx.x * warps_per_block + (threadIdx.x >> 5);
    const u64 warps = (u64)gridDim.x * warps_per_block;
    w.share = n >= warps ? 1 : warps / n;
    w.groups = warps / w.share;
    w.group = warp / w.share;
    w.rank = warp % w.share;
    return w;
}

// This lane's part of one page. Lanes issue UNROLL 16-byte loads before their first store:
// that is what keeps host reads in flight.
static __device__ __forceinline__ void copy_page(const char* s, char* d, u64 len, const Work& w) {
    if ((((u64)s ^ (u64)d) & 15u) != 0) {
        // Mutually misaligned: bytes (correct, slow; "auto" never sends these here).
        for (u64 i = w.rank * 32 + w.lane; i < len; i += w.share * 32) d[i] = s[i];
        return;
    }
    u64 head = (16u - ((u64)s & 15u)) & 15u;
    if (head > len) head = len;
    const u64 nv = (len - head) >> 4;
    const u64 tail = head + (nv << 4);
    if (w.rank == 0 && w.lane < head) d[w.lane] = s[w.lane];
    if (w.rank == 0 && w.lane < len - tail) d[tail + w.lane] = s[tail + w.lane];
    const v4* vs = (const v4*)(s + head);
    v4* vd = (v4*)(d + head);
    const u64 step = 32ull * UNROLL;
    for (u64 v0 = w.rank * step + w.lane; v0 < nv; v0 += w.share * step) {
        v4 r[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const u64 v = v0 + (u64)u * 32;
            if (v < nv) r[u] = load_stream(vs + v);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const u64 v = v0 + (u64)u * 32;
            if (v < nv) store_stream(vd + v, r[u]);
        }
    }
}

// Launched as a programmatic dependent of the previous slice (SmKernel.launch(pdl=True)), a
// block that has copied its pages lets the next slice's blocks start while the rest of its
// slice drains (no idle link between slices), and every thread ends only after the previous
// slice has, so the stream's order of completion holds. BOUNDED: a block lets the next slice
// start only once the previous one has ended, so at most two slices (this one draining, the
// next starting) hold SMs at a time. Without the launch attribute both are no-ops.
// No "memory" clobbers: no copy reads what an earlier slice wrote, so only the order of
// completion matters, which the last wait gives.
static __device__ __forceinline__ void release_next() {
#if __CUDA_ARCH__ >= 900
#if BOUNDED
    asm volatile("griddepcontrol.wait;");
#endif
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

static __device__ __forceinline__ void finish(bool worked) {
#if __CUDA_ARCH__ >= 900
    if (worked) release_next();  // the first in a block releases it; a repeat is a no-op
    asm volatile("griddepcontrol.wait;");
#endif
}

// Wide descriptors: one (src, dst, len) per copy, 24 bytes.
extern "C" __global__ void __launch_bounds__(THREADS)
aiokvtier_copy_pages(const u64* __restrict__ srcs, const u64* __restrict__ dsts,
                     const u64* __restrict__ sizes, u64 n)
{
    const Work w = split(n);
    for (u64 p = w.group; w.group < w.groups && p < n; p += w.groups)
        copy_page((const char*)srcs[p], (char*)dsts[p], sizes[p], w);
    finish(w.group < w.groups);
}

// Packed descriptors: copies of one length, each side a 32-bit index of 2^shift-byte steps
// from that side's base, 8 bytes per copy (the upload crosses the link the copy uses).
extern "C" __global__ void __launch_bounds__(THREADS)
aiokvtier_copy_packed(const unsigned* __restrict__ sidx, const unsigned* __restrict__ didx,
                      u64 src_base, u64 dst_base, u64 src_shift, u64 dst_shift, u64 len, u64 n)
{
    const Work w = split(n);
    for (u64 p = w.group; w.group < w.groups && p < n; p += w.groups)
        copy_page((const char*)(src_base + ((u64)sidx[p] << src_shift)),
                  (char*)(dst_base + ((u64)didx[p] << dst_shift)), len, w);
    finish(w.group < w.groups);
}
"""


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """What a compiled kernel depends on: the architecture and the two compile-time shapes."""

    arch: str
    """``sm_XY`` of the device."""
    threads: int = 1024
    """Threads per block (32 warps): one block fills an SM's warp slots halfway and its
    registers (``__launch_bounds__`` caps them at 64), so a block is one SM."""
    unroll: int = 8
    """16-byte loads in flight per lane: 128 KiB per block of 1024 threads."""
    bounded: bool = True
    """A programmatic slice lets its successor start only once its predecessor has ended, so at
    most two slices of a request hold SMs at a time (``release_next`` in ``SOURCE``)."""

    def macros(self) -> list[tuple[str, str]]:
        return [("THREADS", str(self.threads)), ("UNROLL", str(self.unroll)), ("BOUNDED", str(int(self.bounded)))]

    def options(self) -> list[str]:
        return [f"--gpu-architecture={self.arch}", "--std=c++17", *(f"-D{k}={v}" for k, v in self.macros())]


def vector_aligned(dsts: U64, srcs: U64, sizes: U64) -> bool:
    """True where every copy can move in 16-byte accesses from its first byte to its last."""
    if dsts.size == 0:
        return True
    mask = np.uint64(15)
    return not int(np.bitwise_or.reduce(dsts | srcs | sizes) & mask)


@dataclass(frozen=True, slots=True)
class Descriptors:
    """How a request's copies are written in a descriptor buffer: what a launch passes the kernel
    besides the buffer's device address."""

    n: int
    nbytes: int
    """Bytes of the buffer used: what is uploaded."""
    packed: bool
    """``aiokvtier_copy_packed``'s layout (``u32 sidx[n] | u32 didx[n]``) rather than the
    wide ``srcs | dsts | sizes``."""
    src_base: int = 0
    dst_base: int = 0
    src_shift: int = 0
    dst_shift: int = 0
    size: int = 0
    """The one length of every copy (packed)."""


def _indices(addrs: U64, scratch: U64, words: npt.NDArray[np.uint32]) -> tuple[int, int] | None:
    """Write ``(addrs - base) >> shift`` into ``words`` and return ``(base, shift)``: the lowest
    address and the largest power of two dividing every offset from it; None (``words`` left
    unspecified) where an index would not fit 32 bits. ``scratch``: room for ``len(addrs)`` values."""
    base, top = int(addrs.min()), int(addrs.max())
    # Offsets from the lowest share their low bits up to the lowest bit where the addresses differ.
    differ = int(np.bitwise_or.reduce(addrs)) ^ int(np.bitwise_and.reduce(addrs))
    shift = (differ & -differ).bit_length() - 1 if differ else 0
    if (top - base) >> shift >= 1 << 32:
        return None
    np.subtract(addrs, np.uint64(base), out=scratch)
    np.right_shift(scratch, np.uint64(shift), out=words, casting="unsafe")
    return base, shift


def descriptor_block(out: U64, dsts: U64, srcs: U64, sizes: U64, pack: bool = True) -> Descriptors:
    """Write a request's descriptors into ``out`` (room for ``3 * len(dsts)`` values).

    Copies of one length whose sides each span under 2**32 steps of their common alignment
    (a KV request's pages, the planner's merged runs cut back into pages) are packed,
    ``PACKED_BYTES`` per copy;
    others, or every request where ``pack`` is false, take the wide ``DESCRIPTOR_BYTES``.
    """
    n = int(dsts.shape[0])
    if out.shape[0] < 3 * n:
        raise ValueError(f"descriptor buffer holds {out.shape[0] // 3} copies, {n} needed")
    one_size = n > 0 and (sizes.strides[0] == 0 or int(sizes.min()) == int(sizes.max()))  # a broadcast: one
    if pack and one_size:
        words = out[:n].view(np.uint32)  # sidx | didx; the rest of ``out`` is scratch meanwhile
        src = _indices(srcs, out[n : 2 * n], words[:n])
        dst = None if src is None else _indices(dsts, out[2 * n : 3 * n], words[n:])
        if src is not None and dst is not None:
            return Descriptors(n, PACKED_BYTES * n, True, src[0], dst[0], src[1], dst[1], int(sizes[0]))
    out[:n] = srcs
    out[n : 2 * n] = dsts
    out[2 * n : 3 * n] = sizes
    return Descriptors(n, DESCRIPTOR_BYTES * n, False)


_cubins: dict[KernelSpec, bytes] = {}
_cubin_lock = threading.Lock()


def compile_cubin(spec: KernelSpec, *, cached: bool = True) -> bytes:
    """The kernel compiled for ``spec``: once per process, and once per machine where the
    cache directory is writable (a compile costs ~150 ms of an engine's open; reading the
    file back, well under 1 ms).

    :param cached: read the on-disk copy if there is one (False: a stored copy the driver
        refused is replaced).
    :raises CudaUnavailableError: no NVRTC (with what to install), or the compile failed
        (with NVRTC's log).
    """
    with _cubin_lock:
        cubin = _cubins.get(spec) if cached else None
        if cubin is None:
            try:
                path: Path | None = cubin_path(spec)
            except RuntimeError as exc:  # no home directory (and no AIOKVTIER_CACHE_DIR): no cache, as if unwritable
                log.info("aiokvtier: no cache directory for the compiled SM copy kernel: %s", exc)
                path = None
            cubin = _read_cubin(path) if cached and path is not None else None
            if cubin is None:
                cubin = _compile(spec)
                if path is not None:
                    _write_cubin(path, cubin)
            _cubins[spec] = cubin
        return cubin


def cubin_path(spec: KernelSpec, directory: Path | None = None) -> Path:
    """Where the kernel compiled for ``spec`` is kept: named by a hash of everything it is built
    from (the source, the options, the library's version), so a change never loads a stale one."""
    from .. import __version__
    from ._crossover import cache_dir

    digest = hashlib.sha256("\0".join([SOURCE, *spec.options(), __version__]).encode()).hexdigest()[:32]
    return (directory or cache_dir()) / f"sm-kernel-{spec.arch}-{digest}.cubin"


def _read_cubin(path: Path) -> bytes | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data if data[:4] == b"\x7fELF" else None  # a cubin is an ELF image; anything else is recompiled


def _write_cubin(path: Path, cubin: bytes) -> None:
    """Store atomically (``write_atomically``); failure is logged."""
    from ._crossover import write_atomically

    try:
        write_atomically(path, cubin)
    except OSError as exc:
        log.info("aiokvtier: cannot keep the compiled SM copy kernel at %s: %s", path, exc)


def _preload_nvrtc() -> None:
    """Load ``libnvrtc`` from an ``nvidia-cuda-nvrtc`` wheel found on ``sys.path``.

    cuda-pathfinder looks for the wheel's library in the interpreter's site
    directories only; a wheel installed with ``pip install --target`` (an
    offline host, a vendored tree) is on ``sys.path`` but not there. Once the
    library is loaded, the bindings' ``dlopen`` by name finds it.
    """
    for entry in sys.path:
        for major in ("cu13", "cu12"):
            lib = Path(entry or ".") / "nvidia" / major / "lib"
            if not (lib / f"libnvrtc.so.{major[2:]}").is_file():
                continue
            # NVRTC opens its builtins library by name at compile time: load it first.
            builtins = sorted(p for p in lib.glob("libnvrtc-builtins.so.*") if ".alt." not in p.name)
            try:
                for path in [*builtins[:1], lib / f"libnvrtc.so.{major[2:]}"]:
                    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            return


def _compile(spec: KernelSpec, source: str | None = None) -> bytes:
    """Compile ``source`` (the copy kernel when None, read now so that a test can swap it)."""
    source = SOURCE if source is None else source
    _preload_nvrtc()
    try:
        from cuda.core import Program, ProgramOptions
    except ImportError:
        return _compile_bindings(spec, source)
    log = io.StringIO()
    options = ProgramOptions(
        name="aiokvtier_copy.cu",
        arch=spec.arch,
        std="c++17",
        define_macro=spec.macros(),
    )
    try:
        code = Program(source, "c++", options=options).compile("cubin", logs=log).code
    except Exception as exc:
        raise CudaUnavailableError(
            f"the SM copy kernel did not compile for {spec.arch} through cuda.core "
            f"({type(exc).__name__}: {exc}); NVRTC log:\n{log.getvalue() or '(empty)'}"
        ) from exc
    return bytes(code)


def _compile_bindings(spec: KernelSpec, source: str) -> bytes:
    _preload_nvrtc()
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise CudaUnavailableError(
            "the SM copy path needs NVRTC: pip install 'aiokvtier[cuda]' (cuda-core and nvidia-cuda-nvrtc)"
        ) from exc

    def ok(call: str, result: tuple[Any, ...]) -> Any:
        err = result[0]
        if int(err) != 0:
            raise CudaUnavailableError(f"{call} failed: {getattr(err, 'name', err)}")
        return result[1] if len(result) == 2 else result[1:]

    try:
        prog = ok("nvrtcCreateProgram", nvrtc.nvrtcCreateProgram(source.encode(), b"aiokvtier_copy.cu", 0, [], []))
    except (RuntimeError, OSError) as exc:  # the bindings raise when libnvrtc cannot be loaded
        raise CudaUnavailableError(
            f"NVRTC is not loadable ({exc}): pip install 'aiokvtier[cuda]' (nvidia-cuda-nvrtc)"
        ) from exc
    try:
        opts = [o.encode() for o in spec.options()]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        size = ok("nvrtcGetProgramLogSize", nvrtc.nvrtcGetProgramLogSize(prog))
        text = b" " * int(size)
        ok("nvrtcGetProgramLog", nvrtc.nvrtcGetProgramLog(prog, text))
        if int(err) != 0:
            raise CudaUnavailableError(
                f"the SM copy kernel did not compile for {spec.arch} ({getattr(err, 'name', err)}); "
                f"NVRTC log:\n{text.decode(errors='replace').rstrip(chr(0))}"
            )
        size = ok("nvrtcGetCUBINSize", nvrtc.nvrtcGetCUBINSize(prog))
        cubin = b" " * int(size)
        ok("nvrtcGetCUBIN", nvrtc.nvrtcGetCUBIN(prog, cubin))
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    *([ctypes.c_uint] * 7),
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
)
_launch_fn: Any = None


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [
        ("id", ctypes.c_uint),
        ("pad", ctypes.c_char * 4),
        ("value", ctypes.c_int),
        ("rest", ctypes.c_char * 60),
    ]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (CUDA 12+)."""

    _fields_ = [
        *((name, ctypes.c_uint) for name in ("gx", "gy", "gz", "bx", "by", "bz", "shared")),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("count", ctypes.c_uint),
    ]


_LAUNCH_EX = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
)
_PROGRAMMATIC_STREAM_SERIALIZATION = 6
"""``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``."""
_launch_ex_fn: Any = None


def _proc(drv: Any, name: str, version: int) -> int:
    flags = drv.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    pfn, status = check("cuGetProcAddress", drv.cuGetProcAddress(name.encode(), version, flags))
    if int(status) != 0 or not pfn:
        raise CudaUnavailableError(f"the driver has no {name} (status {status})")
    return int(pfn)


def _launch_function(drv: Any) -> Any:
    """``cuLaunchKernel`` through ctypes (its signature has not changed since CUDA 4.0)."""
    global _launch_fn
    if _launch_fn is None:
        _launch_fn = _LAUNCH(_proc(drv, "cuLaunchKernel", 12000))
    return _launch_fn


def _launch_ex_function(drv: Any) -> Any:
    """``cuLaunchKernelEx`` through ctypes (CUDA 12.0+), for launch attributes."""
    global _launch_ex_fn
    if _launch_ex_fn is None:
        _launch_ex_fn = _LAUNCH_EX(_proc(drv, "cuLaunchKernelEx", 12000))
    return _launch_ex_fn


def device_arch(device: int) -> str:
    drv = driver()
    attr = drv.CUdevice_attribute
    major = check(
        "cuDeviceGetAttribute", drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)
    )
    minor = check(
        "cuDeviceGetAttribute", drv.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)
    )
    return f"sm_{int(major)}{int(minor)}"


def host_pointers_usable(device: int) -> bool:
    """Registered host memory is usable by kernels at its host address (no ``cuMemHostGetDevicePointer``)."""
    drv = driver()
    attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
    return bool(int(check("cuDeviceGetAttribute", drv.cuDeviceGetAttribute(attr, device))))


class SmKernel:
    """The copy kernel loaded into the calling thread's current context (the engine's).

    :param budget: blocks per launch, one per SM.
    :raises CudaUnavailableError: compilation failed, or registered host memory is not
        usable at its host address on this device.
    :raises CudaError: the driver refused to load the module.
    """

    def __init__(self, device: int, budget: int = DEFAULT_SM_BUDGET, spec: KernelSpec | None = None) -> None:
        drv = driver()
        if not host_pointers_usable(device):
            raise CudaUnavailableError(
                f"device {device} cannot use registered host memory at its host address "
                "(CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM is 0): the SM copy path needs it"
            )
        sms = check(
            "cuDeviceGetAttribute",
            drv.cuDeviceGetAttribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device),
        )
        self.budget = min(budget, int(sms))
        self.spec = spec or KernelSpec(device_arch(device))
        self._image = np.frombuffer(compile_cubin(self.spec), dtype=np.uint8).copy()
        err, module = drv.cuModuleLoadData(self._image.ctypes.data)
        if int(err) != 0:  # a stored image this driver refuses (a file damaged on disk): build it afresh
            self._image = np.frombuffer(compile_cubin(self.spec, cached=False), dtype=np.uint8).copy()
            module = check("cuModuleLoadData", drv.cuModuleLoadData(self._image.ctypes.data))
        self._module = module
        try:
            self._wide = check("cuModuleGetFunction", drv.cuModuleGetFunction(self._module, KERNEL_NAME.encode()))
            self._packed = check("cuModuleGetFunction", drv.cuModuleGetFunction(self._module, PACKED_NAME.encode()))
        except BaseException:
            drv.cuModuleUnload(self._module)
            raise
        self._launch = _launch_function(drv)
        # The arguments, written in place per launch: 4 for the wide kernel, 8 for the packed one.
        self._values = (ctypes.c_uint64 * 8)()
        self._params = (ctypes.c_void_p * 8)(*(ctypes.addressof(self._values) + 8 * i for i in range(8)))
        # Programmatic dependent launch (compute capability 9.0+): a slice may start while the
        # previous one on its stream drains; the kernel keeps completion in order (SOURCE).
        self.pdl_capable = int(self.spec.arch.removeprefix("sm_")[:-1] or 0) >= 9
        self._launch_ex: Any = None
        self._attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self._config = _LaunchConfig(gy=1, gz=1, by=1, bz=1, shared=0, count=1)
        self._config.bx = self.spec.threads
        self._config.attrs = ctypes.pointer(self._attr)

    def launch(
        self,
        descriptors: int,
        layout: Descriptors,
        stream: Any,
        budget: int | None = None,
        first: int = 0,
        count: int | None = None,
        pdl: bool = False,
    ) -> None:
        """Launch over copies ``first .. first + count`` (default: all) of those written as
        ``layout`` at device address ``descriptors``, on ``stream``. One thread at a time (the
        submit thread). ``pdl``: as a programmatic dependent of the kernel before it on ``stream``
        (ignored where not ``pdl_capable``).

        :raises CudaError: the launch was refused.
        """
        n, v = layout.n, self._values
        count = n - first if count is None else count
        if layout.packed:
            function, base = self._packed, int(descriptors) + 4 * first
            v[0], v[1], v[2], v[3] = base, base + 4 * n, layout.src_base, layout.dst_base
            v[4], v[5], v[6], v[7] = layout.src_shift, layout.dst_shift, layout.size, count
        else:
            function, base = self._wide, int(descriptors) + 8 * first
            v[0], v[1], v[2], v[3] = base, base + 8 * n, base + 16 * n, count
        blocks = budget or self.budget  # blocks with no page to copy return at once
        if pdl and self.pdl_capable:
            if self._launch_ex is None:
                self._launch_ex = _launch_ex_function(driver())
            self._config.gx, self._config.stream = blocks, int(stream)
            rc = self._launch_ex(ctypes.byref(self._config), int(function), ctypes.addressof(self._params), None)
            call = "cuLaunchKernelEx"
        else:
            rc = self._launch(
                int(function), blocks, 1, 1, self.spec.threads, 1, 1, 0, int(stream),
                ctypes.addressof(self._params), None,
            )  # fmt: skip
            call = "cuLaunchKernel"
        if rc != 0:
            name = PACKED_NAME if layout.packed else KERNEL_NAME
            raise CudaError(f"{call}({name})", driver().CUresult(rc).name, rc)

    def unload(self) -> None:
        """Unload the module (in the context it was loaded in, current on the calling thread)."""
        if self._module is not None:
            driver().cuModuleUnload(self._module)
            self._module = None
