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
import io
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import CudaError, CudaUnavailableError
from ._driver import check, driver

__all__ = [
    "DEFAULT_SM_BUDGET",
    "DESCRIPTOR_BYTES",
    "KERNEL_NAME",
    "KernelSpec",
    "SmKernel",
    "compile_cubin",
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
"""Per copy: source, destination and length, 8 bytes each (three arrays)."""

KERNEL_NAME = "aiokvtier_copy_pages"
KERNEL_VERSION = 2
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

// One copy per (src, dst, len) descriptor. A group of `share` warps copies a
// page; groups stride over the pages. Lanes issue UNROLL 16-byte loads before
// their first store: that is what keeps host reads in flight.
extern "C" __global__ void __launch_bounds__(THREADS)
aiokvtier_copy_pages(const u64* __restrict__ srcs, const u64* __restrict__ dsts,
                     const u64* __restrict__ sizes, u64 n)
{
    const u64 lane = threadIdx.x & 31u;
    const u64 warps_per_block = blockDim.x >> 5;
    const u64 warp = (u64)blockIdx.x * warps_per_block + (threadIdx.x >> 5);
    const u64 warps = (u64)gridDim.x * warps_per_block;
    const u64 share = n >= warps ? 1 : warps / n;
    const u64 groups = warps / share;
    const u64 group = warp / share;
    const u64 rank = warp % share;
    const u64 step = 32ull * UNROLL;
    for (u64 p = group; group < groups && p < n; p += groups) {
        const char* s = (const char*)srcs[p];
        char* d = (char*)dsts[p];
        const u64 len = sizes[p];
        if ((((u64)s ^ (u64)d) & 15u) != 0) {
            // Mutually misaligned: bytes (correct, slow; "auto" never sends these here).
            for (u64 i = rank * 32 + lane; i < len; i += share * 32) d[i] = s[i];
            continue;
        }
        u64 head = (16u - ((u64)s & 15u)) & 15u;
        if (head > len) head = len;
        const u64 nv = (len - head) >> 4;
        const u64 tail = head + (nv << 4);
        if (rank == 0 && lane < head) d[lane] = s[lane];
        if (rank == 0 && lane < len - tail) d[tail + lane] = s[tail + lane];
        const v4* vs = (const v4*)(s + head);
        v4* vd = (v4*)(d + head);
        for (u64 v0 = rank * step + lane; v0 < nv; v0 += share * step) {
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
#if __CUDA_ARCH__ >= 900
    // Launched as a programmatic dependent of the previous slice (SmKernel.launch(pdl=True)):
    // a block whose first warp is done lets the next slice's blocks start while the rest of it
    // drains (no idle link between slices), and every thread ends only after the previous slice
    // has, so the stream's order of completion holds. Without the launch attribute both are no-ops.
    if (group < groups) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
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

    def options(self) -> list[str]:
        return [
            f"--gpu-architecture={self.arch}",
            "--std=c++17",
            f"-DTHREADS={self.threads}",
            f"-DUNROLL={self.unroll}",
        ]


def vector_aligned(dsts: U64, srcs: U64, sizes: U64) -> bool:
    """True where every copy can move in 16-byte accesses from its first byte to its last."""
    if dsts.size == 0:
        return True
    mask = np.uint64(15)
    return not int(np.bitwise_or.reduce(dsts | srcs | sizes) & mask)


def descriptor_block(out: U64, dsts: U64, srcs: U64, sizes: U64) -> int:
    """Write the kernel's three arrays (sources, destinations, lengths) into ``out``; return the bytes used.

    ``out`` must hold ``3 * len(dsts)`` values; the layout is ``srcs | dsts | sizes``.
    """
    n = int(dsts.shape[0])
    if out.shape[0] < 3 * n:
        raise ValueError(f"descriptor buffer holds {out.shape[0] // 3} copies, {n} needed")
    out[:n] = srcs
    out[n : 2 * n] = dsts
    out[2 * n : 3 * n] = sizes
    return DESCRIPTOR_BYTES * n


_cubins: dict[KernelSpec, bytes] = {}
_cubin_lock = threading.Lock()


def compile_cubin(spec: KernelSpec) -> bytes:
    """The kernel compiled for ``spec``, once per process.

    :raises CudaUnavailableError: no NVRTC (with what to install), or the compile failed
        (with NVRTC's log).
    """
    with _cubin_lock:
        cubin = _cubins.get(spec)
        if cubin is None:
            cubin = _cubins[spec] = _compile(spec)
        return cubin


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
        define_macro=[("THREADS", str(spec.threads)), ("UNROLL", str(spec.unroll))],
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
        cubin = compile_cubin(self.spec)
        self._image = np.frombuffer(cubin, dtype=np.uint8).copy()
        self._module = check("cuModuleLoadData", drv.cuModuleLoadData(self._image.ctypes.data))
        try:
            self._function = check("cuModuleGetFunction", drv.cuModuleGetFunction(self._module, KERNEL_NAME.encode()))
        except BaseException:
            drv.cuModuleUnload(self._module)
            raise
        self._launch = _launch_function(drv)
        self._values = (ctypes.c_uint64 * 4)()
        self._params = (ctypes.c_void_p * 4)(*(ctypes.addressof(self._values) + 8 * i for i in range(4)))
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
        n: int,
        stream: Any,
        budget: int | None = None,
        first: int = 0,
        count: int | None = None,
        pdl: bool = False,
    ) -> None:
        """Launch over copies ``first .. first + count`` (default: all) of the ``n`` whose arrays start
        at device address ``descriptors`` (``srcs | dsts | sizes``), on ``stream``. One thread at a
        time (the submit thread). ``pdl``: as a programmatic dependent of the kernel before it on
        ``stream`` (ignored where not :attr:`pdl_capable`).

        :raises CudaError: the launch was refused.
        """
        base = int(descriptors) + 8 * first
        count = n - first if count is None else count
        self._values[0], self._values[1], self._values[2], self._values[3] = base, base + 8 * n, base + 16 * n, count
        blocks = budget or self.budget  # blocks with no page to copy return at once
        if pdl and self.pdl_capable:
            if self._launch_ex is None:
                self._launch_ex = _launch_ex_function(driver())
            self._config.gx, self._config.stream = blocks, int(stream)
            rc = self._launch_ex(ctypes.byref(self._config), int(self._function), ctypes.addressof(self._params), None)
            call = "cuLaunchKernelEx"
        else:
            rc = self._launch(
                int(self._function), blocks, 1, 1, self.spec.threads, 1, 1, 0, int(stream),
                ctypes.addressof(self._params), None,
            )  # fmt: skip
            call = "cuLaunchKernel"
        if rc != 0:
            raise CudaError(f"{call}({KERNEL_NAME})", driver().CUresult(rc).name, rc)

    def unload(self) -> None:
        """Unload the module (in the context it was loaded in, current on the calling thread)."""
        if self._module is not None:
            driver().cuModuleUnload(self._module)
            self._module = None
