"""The SM copy path of a CopyEngine: the loaded kernel, its descriptor slabs, the device-side check.

A request runs as consecutive launches of at most ``SmOptions.slice_bytes`` each
on the copy's stream: a launch's blocks hold their SMs until its last page
lands, so a kernel of the model that is queued meanwhile (a persistent
matmul waits for every SM it was sized for) waits for one slice, not the
whole request. Each slice is launched as a programmatic dependent of the one
before (``pdl``), so the link does not idle between them. Measured on the
H200 (docs/benchmarks.md): a bf16 matmul loop beside 128 MiB requests on 4
SMs slowed by 16-30% with whole-request launches and by 7-9% with 8 MiB
slices, and the copy alone moved shuffled 4-64 KiB pages host to device at
0.921-0.922 of a DMA copy (0.87-0.90 with the launch gap between slices).

A launch reads its descriptors (8 bytes per copy for a request whose copies
have one length, else 24: ``descriptor_block()``) from a slab: a pinned
staging buffer the host writes them into, and a device buffer. The first
slice reads the staging buffer itself over the link (``head``), so it
waits for no upload; the other slices read the device buffer, which one
async H2D copy on a partner stream fills meanwhile, and the copy's stream
waits for that copy before the second slice. A slab belongs to one request
until that request's completion event has fired: the completion thread
hands it back, so a later launch on any stream never overwrites
descriptors that an earlier upload or kernel has yet to read. Slabs are
kept and reused; they grow in powers of two.

The device side of a copy is checked before a launch: a kernel that
dereferences an address the driver does not map stops with a sticky error
that poisons the whole context (the model's too), where a copy engine
would have refused the descriptor. One ``cuPointerGetAttribute`` query per
allocation the request touches: a KV cache in one tensor costs one.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._copy._plan import U64
from .._errors import CudaError
from ._crossover import Crossover
from ._driver import check, driver
from ._kernel import (
    DEFAULT_SM_BUDGET,
    DESCRIPTOR_BYTES,
    Descriptors,
    KernelSpec,
    SmKernel,
    descriptor_block,
    device_arch,
    vector_aligned,
)

__all__ = [
    "METHODS",
    "MIN_PIECE",
    "MIN_SLAB",
    "Slab",
    "SmOptions",
    "SmPath",
    "device_side_problem",
    "pick_method",
    "pieces",
    "slab_capacity",
    "slices",
]

MIN_SLAB = 4096
"""Copies per slab at least (96 KiB of descriptors)."""


@dataclass(frozen=True, slots=True)
class SmOptions:
    """How the SM copy path launches a request. The defaults are the measured best on the H200;
    the others are kept for the studies that measured them (``benchmarks/sm_*.py``)."""

    slice_bytes: int = 8 << 20
    """Bytes per launch at most (a copy larger than this is a launch of its own). A launch's blocks
    hold their SMs until its last page lands, so a kernel of the model queued meanwhile waits for one
    slice, not a whole request: a concurrent matmul slowed by 16-30% beside whole-request launches
    and by 7-9% beside 8 MiB slices (``docs/results/sm-launches-h200.jsonl``)."""
    bounded: bool = True
    """The kernel lets a programmatic slice's successor start only once the slice before it has ended
    (``KernelSpec.bounded``): a request then holds at most two slices' blocks at a time, its
    budget twice over while one drains and the next starts."""
    head: bool = True
    """The first slice of a request reads its descriptors from the pinned staging slab over the link
    instead of waiting for their upload, which the partner stream runs meanwhile for the other slices
    (``SmPath._headed()``); a request of one slice needs no upload at all. Host to device on the H200,
    shuffled 4 / 16 / 64 KiB pages: 0.921 / 0.922 / 0.921 of a DMA copy, against 0.9185 / 0.9195 / 0.921
    with the upload first (medians of 8 interleaved rounds, ``docs/results/sm-head-h200.jsonl``)."""
    pack: bool = True
    """Requests whose copies have one length (pages, the planner's merged runs cut back into pages by
    ``pieces()``) are described in 8 bytes per copy, not 24 (``descriptor_block()``): the upload
    crosses the link the copy uses, so host to device at 4 KiB pages it takes 0.2% of the bytes instead
    of 0.6%."""
    alternate: bool = False
    """Slices alternate between the copy's stream and a partner stream with half the budget each
    (``SmPath._alternate()``). Without ``pdl`` that hid the launch gap between slices (0.89 of a
    DMA copy host to device, against 0.87 for one stream of 4 MiB slices); with it, one stream does as
    well (0.913-0.924 against 0.915-0.921), so the partner is kept for the launch study only."""
    pdl: bool = True
    """Each slice is a programmatic dependent of the one before it on its stream (compute capability
    9.0+): its blocks start while the previous slice's last pages drain, instead of after a launch
    gap; the kernel's ``griddepcontrol.wait`` keeps completion in stream order. Host to device, shuffled
    4-64 KiB pages on the H200: 0.913-0.924 of a DMA copy, against 0.889-0.896 without
    (``docs/results/sm-launches-h200.jsonl``)."""
    split_runs: bool = True
    """Runs the planner merged from neighbouring pages are cut back into pages before a launch
    (``pieces()``): the kernel gives each copy to one warp, so a long run among single pages would
    keep its warp, and its block's SM, after the rest of its slice is done; and copies of one length
    pack into 8-byte descriptors. The rate does not show it (programmatic launches let the next slice
    use the link meanwhile): 0.921 of a DMA copy either way, ``docs/results/sm-runs-h200.json``."""

    def __post_init__(self) -> None:
        if type(self.slice_bytes) is not int or self.slice_bytes < 1:
            raise ValueError(f"slice_bytes must be a positive int, got {self.slice_bytes!r}")


def slices(sizes: U64, limit: int) -> list[tuple[int, int]]:
    """``(first, count)`` runs of consecutive copies, in order, covering every copy, each at
    most ``limit`` bytes (a larger copy alone), as few as that allows and of about equal bytes.

    Equal runs keep the two streams' launches alike: a 5 MiB request at a 4 MiB limit is two
    launches of 2.5 MiB, not 4 MiB on half the budget while 1 MiB finishes beside it. The
    fewest runs come from filling each to the limit; the runs are then cut where the request's
    bytes pass each equal share, unless a cut would leave a run empty or over the limit.
    """
    n = int(sizes.shape[0])
    total = int(sizes.sum())
    if total <= limit:
        return [(0, n)] if n else []
    ends = np.cumsum(sizes)
    stops: list[int] = []
    done = 0
    while not stops or stops[-1] < n:  # filled to the limit: the fewest runs
        stop = int(np.searchsorted(ends, np.uint64(done + limit), side="right"))
        stops.append(max(stop, (stops[-1] if stops else 0) + 1))
        done = int(ends[stops[-1] - 1])
    k = len(stops)
    shares = np.array([i * total // k for i in range(1, k)], dtype=np.uint64)
    even = [*np.searchsorted(ends, shares, side="right").tolist(), n]
    starts = [0, *even[:-1]]
    if all(
        stop > first and (stop - first == 1 or int(ends[stop - 1]) - (int(ends[first - 1]) if first else 0) <= limit)
        for first, stop in zip(starts, even, strict=True)
    ):
        stops = even
    return [(first, stop - first) for first, stop in zip([0, *stops[:-1]], stops, strict=True)]


MIN_PIECE = 4096
"""Bytes at least of the pieces ``pieces()`` cuts runs into (smaller ones stay whole)."""


def pieces(dsts: U64, srcs: U64, sizes: U64) -> tuple[U64, U64, U64]:
    """Copies of several lengths that are all multiples of their greatest common divisor ``g``
    (a multiple of 16 and at least ``MIN_PIECE``: pages, some merged into runs) cut into copies
    of ``g`` bytes, in order; anything else as given."""
    n = int(sizes.shape[0])
    if n < 2 or sizes.strides[0] == 0 or int(sizes.min()) == int(sizes.max()):
        return dsts, srcs, sizes
    g = int(np.gcd.reduce(sizes))
    if g < MIN_PIECE or g % 16:
        return dsts, srcs, sizes
    step = np.uint64(g)
    counts = (sizes // step).astype(np.int64)
    owner = np.repeat(np.arange(n), counts)  # the copy each piece comes from
    first = np.cumsum(counts) - counts  # each copy's first piece
    within = (np.arange(int(counts.sum())) - first[owner]).astype(np.uint64) * step
    return dsts[owner] + within, srcs[owner] + within, np.broadcast_to(step, within.shape)


def slab_capacity(n: int) -> int:
    """The slab size that holds ``n`` copies: a power of two, at least ``MIN_SLAB``."""
    return max(MIN_SLAB, 1 << max(0, n - 1).bit_length())


@dataclass(eq=False)
class Slab:
    capacity: int
    host: int
    device: int
    view: U64


class SmPath:
    """The kernel of one engine, loaded in its context (current on the calling thread).

    :raises CudaUnavailableError: the kernel cannot be compiled or host pointers are not usable.
    :raises CudaError: the driver refused to load it.
    """

    def __init__(
        self,
        device: int,
        budget: int = DEFAULT_SM_BUDGET,
        spec: KernelSpec | None = None,
        *,
        options: SmOptions | None = None,
        kernel: Any = None,
        slabs: Sequence[Slab] = (),
    ) -> None:
        """``kernel``: one already loaded (anything with ``budget``, ``launch()`` and
        ``unload()``) instead of the compiled one; ``slabs``: descriptor slabs made elsewhere,
        the path's from now on (freed at close). Both let the launch logic run over a model
        of the driver."""
        self.device = device
        self.options = options = options or SmOptions()
        if kernel is None:
            kernel = SmKernel(device, budget, spec or KernelSpec(device_arch(device), bounded=options.bounded))
        self.kernel = kernel
        self.budget: int = kernel.budget
        self._free: list[Slab] = list(slabs)
        self._all: list[Slab] = list(slabs)
        self._partners: dict[int, Any] = {}
        self._lock = threading.Lock()

    @property
    def free_slabs(self) -> tuple[Slab, ...]:
        """The slabs no launch holds now."""
        with self._lock:
            return tuple(self._free)

    @property
    def partners(self) -> dict[int, Any]:
        """The partner stream made for each of the engine's streams (handle -> stream)."""
        return dict(self._partners)

    def submit(
        self, dsts: U64, srcs: U64, sizes: U64, stream: Any, budget: int | None = None, slice_bytes: int | None = None
    ) -> Slab:
        """Write the descriptors, upload them (on the partner stream behind the first slice, with
        ``head``) and launch, in slices of ``slice_bytes`` (default ``options.slice_bytes``), on
        ``stream`` (submit thread). The slab is the launches' until ``give_back()`` (after the
        request's completion event, recorded on ``stream`` next).

        :raises CudaError: the upload or the launch was refused (nothing is left half-done
            that could touch a later launch's slab).
        """
        opt = self.options
        if opt.split_runs:
            dsts, srcs, sizes = pieces(dsts, srcs, sizes)
        n = int(dsts.shape[0])
        slab = self._take(n)
        try:
            layout = descriptor_block(slab.view, dsts, srcs, sizes, opt.pack)
            runs = slices(sizes, opt.slice_bytes if slice_bytes is None else slice_bytes)
            blocks = budget or self.budget
            if opt.head and not opt.alternate and self._headed(slab, layout, runs, stream, blocks):
                return slab
            drv = driver()
            check("cuMemcpyHtoDAsync", drv.cuMemcpyHtoDAsync(slab.device, slab.host, layout.nbytes, stream))
            partner = self.partner(stream) if opt.alternate and len(runs) > 1 and blocks > 1 else None
            if partner is not None:
                self._alternate(slab.device, layout, runs, stream, partner, blocks)
            else:
                for first, count in runs:
                    self.kernel.launch(slab.device, layout, stream, blocks, first, count, opt.pdl)
        except BaseException:
            # An upload or launches may be queued: the slab is reusable only once they have run.
            driver().cuStreamSynchronize(stream)
            partner = self._partners.get(int(stream))
            if partner is not None:
                driver().cuStreamSynchronize(partner)
            self.give_back(slab)
            raise
        return slab

    def _headed(self, slab: Slab, layout: Descriptors, runs: list[tuple[int, int]], stream: Any, blocks: int) -> bool:
        """The first slice reads its descriptors from the pinned staging slab itself (mapped for the
        device at its host address), so it waits for no upload; the other slices read the device
        copy that the partner stream uploads meanwhile, and ``stream`` waits for that upload before
        the second slice. The first slice is launched plainly: it follows whatever ``stream`` ran
        before (another request's slices) as an upload would have made it. False, with nothing
        queued, where the partner stream is refused: the caller uploads in order instead."""
        if not runs:
            return True  # no copies: nothing to read the descriptors
        (first, count), rest = runs[0], runs[1:]
        partner = self.partner(stream) if rest else None
        if rest and partner is None:
            return False
        drv = driver()
        ready = None
        if partner is not None:
            check("cuMemcpyHtoDAsync", drv.cuMemcpyHtoDAsync(slab.device, slab.host, layout.nbytes, partner))
            ready = check("cuEventCreate", drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        try:
            if ready is not None:
                check("cuEventRecord", drv.cuEventRecord(ready, partner))
            self.kernel.launch(slab.host, layout, stream, blocks, first, count, False)
            if ready is not None:
                check("cuStreamWaitEvent", drv.cuStreamWaitEvent(stream, ready, 0))
        finally:
            if ready is not None:
                drv.cuEventDestroy(ready)  # the driver keeps it until the wait has run
        for first, count in rest:
            self.kernel.launch(slab.device, layout, stream, blocks, first, count, self.options.pdl)
        return True

    def _alternate(
        self, descriptors: int, layout: Descriptors, runs: list[tuple[int, int]], stream: Any, partner: Any, blocks: int
    ) -> None:
        """The slices in turn on ``stream`` and its partner stream, half the budget each: while one
        launch drains and the next starts, the other keeps the link busy, and launched plainly at
        most ``blocks`` SMs are held at once (with ``pdl``, a slice's successor on its stream
        may start while it drains). The partner starts after ``stream``'s upload (and ``after=``), and
        ``stream`` waits for the partner's last slice, so the request's completion event, recorded
        on ``stream``, follows every slice."""
        drv = driver()
        flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        ready = check("cuEventCreate", drv.cuEventCreate(flags))
        try:
            check("cuEventRecord", drv.cuEventRecord(ready, stream))
            check("cuStreamWaitEvent", drv.cuStreamWaitEvent(partner, ready, 0))
        finally:
            drv.cuEventDestroy(ready)  # the driver keeps it until the wait has run
        half = blocks // 2  # the copy's stream runs the odd slice out: it takes the larger half
        for i, (first, count) in enumerate(runs):
            if i % 2 == 0:
                self.kernel.launch(descriptors, layout, stream, blocks - half, first, count, self.options.pdl)
            else:
                self.kernel.launch(descriptors, layout, partner, half, first, count, self.options.pdl)
        done = check("cuEventCreate", drv.cuEventCreate(flags))
        try:
            check("cuEventRecord", drv.cuEventRecord(done, partner))
            check("cuStreamWaitEvent", drv.cuStreamWaitEvent(stream, done, 0))
        finally:
            drv.cuEventDestroy(done)

    def partner(self, stream: Any) -> Any:
        """The partner of one of the engine's streams, made on first use (submit thread, context
        current); None where the driver refuses a stream: the slices then run on ``stream`` alone
        (slower across their boundaries, never wrong), and the next request asks again."""
        partner = self._partners.get(int(stream))
        if partner is None:
            drv = driver()
            err, made = drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
            if int(err) != 0:
                return None
            partner = self._partners[int(stream)] = made
        return partner

    def give_back(self, slab: Slab) -> None:
        """Any thread: the launch that used ``slab`` has completed."""
        with self._lock:
            self._free.append(slab)

    def _take(self, n: int) -> Slab:
        with self._lock:
            fits = [s for s in self._free if s.capacity >= n]
            if fits:
                slab = min(fits, key=lambda s: s.capacity)
                self._free.remove(slab)
                return slab
        return self._allocate(slab_capacity(n))

    def _allocate(self, capacity: int) -> Slab:
        drv = driver()
        nbytes = capacity * DESCRIPTOR_BYTES
        host = int(check("cuMemHostAlloc", drv.cuMemHostAlloc(nbytes, 0)))
        try:
            device = int(check("cuMemAlloc", drv.cuMemAlloc(nbytes)))
        except BaseException:
            drv.cuMemFreeHost(host)
            raise
        view = np.ctypeslib.as_array((ctypes.c_uint64 * (3 * capacity)).from_address(host))
        slab = Slab(capacity, host, device, view)
        with self._lock:
            self._all.append(slab)
        return slab

    def close(self) -> None:
        """Free the slabs and unload the kernel; every launch must have completed."""
        drv = driver()
        with self._lock:
            slabs, self._all, self._free = self._all, [], []
        for slab in slabs:
            drv.cuMemFree(slab.device)
            drv.cuMemFreeHost(slab.host)
        partners, self._partners = self._partners, {}
        for partner in partners.values():
            drv.cuStreamDestroy(partner)
        self.kernel.unload()

    def __repr__(self) -> str:
        return f"<SmPath device {self.device} | budget {self.budget} SMs | {len(self._all)} slabs>"


_MEMORYTYPE_HOST, _MEMORYTYPE_DEVICE = 1, 2


def _allocation(drv: Any, addr: int, device: int) -> tuple[int, int] | str:
    """``(start, end)`` of the allocation holding ``addr``, or why a kernel may not touch it."""
    attr = drv.CUpointer_attribute
    try:
        kind = int(
            check("cuPointerGetAttribute", drv.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr))
        )
        start = int(
            check("cuPointerGetAttribute", drv.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, addr))
        )
        size = int(
            check("cuPointerGetAttribute", drv.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_RANGE_SIZE, addr))
        )
        if kind == _MEMORYTYPE_DEVICE:
            ordinal = int(
                check(
                    "cuPointerGetAttribute", drv.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr)
                )
            )
            if ordinal != device:
                return f"address {addr:#x} is memory of device {ordinal}, not {device}"
        elif kind != _MEMORYTYPE_HOST:
            return f"address {addr:#x} has memory type {kind}"
    except CudaError as exc:
        return f"address {addr:#x} is no allocation the driver knows ({exc.result})"
    return start, start + size


def device_side_problem(addrs: U64, sizes: U64, device: int) -> str | None:
    """None when every span ``[addr, addr + size)`` lies in memory the driver maps for
    ``device`` (its own memory or mapped host memory); else the reason. Submit thread
    (the engine's context current)."""
    drv = driver()
    ends = addrs + sizes
    lo, hi = int(addrs.min()), int(ends.max())
    first = _allocation(drv, lo, device)
    if isinstance(first, str):
        return first
    if first[0] <= lo and hi <= first[1]:
        return None  # the usual case: one tensor holds every page
    order = np.argsort(addrs, kind="stable")
    starts, ends = addrs[order], ends[order]
    i, n = 0, len(starts)
    while i < n:
        got = _allocation(drv, int(starts[i]), device)
        if isinstance(got, str):
            return got
        _, end = got
        j = int(np.searchsorted(starts, np.uint64(end), side="left"))
        reach = int(ends[i:j].max())
        while reach > end:  # a span runs past this allocation: only an adjacent one may hold the rest
            nxt = _allocation(drv, end, device)
            if isinstance(nxt, str) or nxt[0] != end:
                return f"the span at {int(starts[i]):#x} leaves its allocation at {end:#x}"
            end = nxt[1]
            j = int(np.searchsorted(starts, np.uint64(end), side="left"))
            reach = int(ends[i:j].max())
        i = j
    return None


METHODS = ("auto", "dma", "sm")


def pick_method(
    method: str,
    crossover: Crossover | None,
    direction: str,
    dsts: U64,
    srcs: U64,
    sizes: U64,
    whole: tuple[int, int] | None = None,
) -> str:
    """``"sm"`` or ``"dma"`` for one planned request (or a piece of one: ``whole`` is the request's
    ``(copies, bytes)``, which the crossover is asked about).

    Raw copies (``direction="any"``) always go to the copy engines; ``"auto"`` sends to the
    kernel only requests whose every copy moves in 16-byte accesses, and only where the
    crossover predicts a clear win.
    """
    if method == "dma" or direction not in ("h2d", "d2h"):
        return "dma"
    if method == "sm":
        return "sm"
    if crossover is None:
        return "dma"
    count, nbytes = (int(dsts.shape[0]), int(sizes.sum())) if whole is None else whole
    # The crossover first (a few float operations), then the alignment (passes over every copy).
    if crossover.choose(direction, count, nbytes) != "sm" or not vector_aligned(dsts, srcs, sizes):
        return "dma"
    return "sm"
