"""The SM copy path's host-side logic, without a GPU: descriptors, method choice, the crossover file."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokvtier import CopyEngine, CudaError
from aiokvtier._cuda import _crossover, _kernel, _sm
from aiokvtier._cuda._crossover import LADDER, Crossover, Curve, load_or_measure, parse_thresholds
from aiokvtier._cuda._sm import SmOptions

U = np.uint64


def arrays(*values: list[int]) -> tuple[Any, ...]:
    return tuple(np.asarray(v, dtype=U) for v in values)


def test_descriptor_block_is_srcs_then_dsts_then_sizes() -> None:
    dsts, srcs, sizes = arrays([0x1000, 0x3000], [0x9000, 0x7000], [4096, 16])
    out = np.zeros(3 * 4, dtype=U)
    layout = _kernel.descriptor_block(out, dsts, srcs, sizes)
    assert layout == _kernel.Descriptors(2, 2 * _kernel.DESCRIPTOR_BYTES, False)
    assert out[:6].tolist() == [0x9000, 0x7000, 0x1000, 0x3000, 4096, 16]
    with pytest.raises(ValueError, match="holds 1 copies, 2 needed"):
        _kernel.descriptor_block(np.zeros(3, dtype=U), dsts, srcs, sizes)


def unpack(out: Any, layout: Any) -> tuple[list[int], list[int]]:
    """The (srcs, dsts) a packed layout stands for, as the kernel computes them."""
    words = out.view(np.uint32)
    n = layout.n
    srcs = [layout.src_base + (int(i) << layout.src_shift) for i in words[:n]]
    dsts = [layout.dst_base + (int(i) << layout.dst_shift) for i in words[n : 2 * n]]
    return srcs, dsts


def test_copies_of_one_length_are_packed_in_eight_bytes() -> None:
    """One length and spans that fit: two 32-bit indices per copy, each side from its own base in
    steps of its own alignment; the kernel's arithmetic gives back every address."""
    tier, dev = 0x7F00_0000_0000, 0x7000_0000_0000
    srcs = np.asarray([tier + 4096 * s for s in (9, 3, 700_000, 0)], dtype=U)  # steps of 4 KiB
    dsts = np.asarray([dev + 48 * i + 16 for i in (1, 0, 3, 2)], dtype=U)  # steps of 16 bytes
    out = np.zeros(3 * 4, dtype=U)
    layout = _kernel.descriptor_block(out, dsts, srcs, np.full(4, 48, dtype=U))
    assert layout.packed and layout.nbytes == 4 * _kernel.PACKED_BYTES == 32
    assert (layout.src_base, layout.src_shift, layout.dst_base, layout.dst_shift, layout.size) == (
        tier,
        12,
        dev + 16,
        4,
        48,
    )
    assert unpack(out, layout) == (srcs.tolist(), dsts.tolist())


@pytest.mark.parametrize(
    ("dsts", "srcs", "sizes", "why"),
    [
        ([0x1000, 0x2000], [0x9000, 0xA000], [4096, 2048], "two lengths"),
        ([0x10, 0x20, 0x10 + (1 << 36)], [0x9000, 0xA000, 0xB000], [16] * 3, "destination: 2**32 16-byte steps"),
        ([0x1000, 0x2000, 0x3000], [0x8, 0x10, 0x8 + (1 << 40)], [4096] * 3, "source: 2**37 8-byte steps"),
    ],
)
def test_requests_that_do_not_pack_take_the_wide_layout(
    dsts: list[int], srcs: list[int], sizes: list[int], why: str
) -> None:
    out = np.zeros(3 * 4, dtype=U)
    layout = _kernel.descriptor_block(out, *arrays(dsts, srcs, sizes))
    n = len(dsts)
    assert not layout.packed and layout.nbytes == n * _kernel.DESCRIPTOR_BYTES, why
    assert out[: 3 * n].tolist() == [*srcs, *dsts, *sizes]


def test_packing_can_be_turned_off_and_a_lone_copy_packs() -> None:
    out = np.zeros(3 * 4, dtype=U)
    dsts, srcs, sizes = arrays([0x1000, 0x3000], [0x9000, 0x7000], [4096, 4096])
    assert not _kernel.descriptor_block(out, dsts, srcs, sizes, pack=False).packed
    layout = _kernel.descriptor_block(out, *arrays([0x1234], [0x98765], [7]))
    assert layout.packed and unpack(out, layout) == ([0x98765], [0x1234])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, (1 << 47) - 1), st.integers(0, (1 << 47) - 1)), min_size=1, max_size=40),
    st.integers(1, 1 << 21),
)
def test_packed_descriptors_give_back_every_address(pairs: list[tuple[int, int]], size: int) -> None:
    """Whatever the addresses, a request either packs to exactly its addresses or is written wide."""
    srcs = np.asarray([p[0] for p in pairs], dtype=U)
    dsts = np.asarray([p[1] for p in pairs], dtype=U)
    out = np.zeros(3 * len(pairs), dtype=U)
    layout = _kernel.descriptor_block(out, dsts, srcs, np.full(len(pairs), size, dtype=U))
    if layout.packed:
        assert unpack(out, layout) == (srcs.tolist(), dsts.tolist()) and layout.size == size
    else:
        assert out.tolist() == [*srcs.tolist(), *dsts.tolist(), *[size] * len(pairs)]


SENTINEL = 0xDEAD_BEEF_0BAD_F00D


def check_block(dsts: Any, srcs: Any, sizes: Any, spare: int = 0) -> Any:
    """``descriptor_block`` into a buffer ``spare`` values longer than needed: the inputs are left
    as they were, nothing past ``3 * n`` is touched, and the block stands for exactly the request
    (packed only where every copy has one length)."""
    n = len(dsts)
    inputs = [np.array(a, copy=True) for a in (dsts, srcs, sizes)]
    out = np.full(3 * n + spare, SENTINEL, dtype=U)
    layout = _kernel.descriptor_block(out, dsts, srcs, sizes)
    assert all(np.array_equal(a, b) for a, b in zip((dsts, srcs, sizes), inputs, strict=True))
    assert (out[3 * n :] == U(SENTINEL)).all()
    assert layout.n == n
    assert layout.packed == (n > 0 and len(set(np.asarray(sizes).tolist())) == 1 and fits(srcs) and fits(dsts))
    if layout.packed:
        assert len(set(np.asarray(sizes).tolist())) == 1 and layout.size == int(sizes[0])
        assert layout.nbytes == n * _kernel.PACKED_BYTES
        assert unpack(out, layout) == (srcs.tolist(), dsts.tolist())
    else:
        assert layout.nbytes == n * _kernel.DESCRIPTOR_BYTES
        assert out[: 3 * n].tolist() == [*srcs.tolist(), *dsts.tolist(), *np.asarray(sizes).tolist()]
    return layout


def fits(addrs: Any) -> bool:
    """Every address is the lowest plus a 32-bit multiple of the largest power of two dividing
    every offset from it (counted here offset by offset)."""
    offsets = [int(a) - int(addrs.min()) for a in addrs]
    shift = min(((o & -o).bit_length() - 1 for o in offsets if o), default=0)
    return max(offsets) >> shift <= 0xFFFF_FFFF


TOP = (1 << 64) - 1
STEPS_FIT = (1 << 32) - 1  # the largest index a packed side holds


@pytest.mark.parametrize(
    ("dsts", "srcs", "packed"),
    [
        ([], [], False),  # nothing: an empty wide block
        ([0], [TOP], True),
        ([TOP, TOP - 16], [0, 16], True),
        ([0, TOP], [0, 1], False),  # the lowest differing bit is bit 0: a span of 2**64 - 1 steps does not fit
        ([5, 5, 5], [7, 7, 7], True),  # every address equal: every index 0
        ([0, 16, 16 * STEPS_FIT], [0, 16, 32], True),
        ([0, 16, 16 * (STEPS_FIT + 1)], [0, 16, 32], False),
        ([TOP + 1 - 16 * (STEPS_FIT + 1), TOP + 1 - 16, TOP + 1 - 32], [0, 16, 32], True),
        ([0, 16, 32], [TOP - 16 * STEPS_FIT, TOP, TOP - 16], True),
        ([0, 16, 32], [TOP - 16 * (STEPS_FIT + 1), TOP, TOP - 16], False),
        ([0, 1 << 63], [1 << 63, (1 << 63) + (1 << 62)], True),  # shifts of 63 and 62
    ],
)
@pytest.mark.parametrize("spare", [0, 5])
def test_descriptor_block_at_the_edges(dsts: list[int], srcs: list[int], packed: bool, spare: int) -> None:
    d, s = arrays(dsts, srcs)
    assert check_block(d, s, np.full(len(dsts), 4096, dtype=U), spare).packed == packed


@pytest.mark.parametrize(
    ("sizes", "packed"),
    [
        (np.broadcast_to(U(4096), (4,)), True),  # one length given once (stride 0)
        (np.full(4, 4096, dtype=U), True),
        (np.asarray([4096, 4096, 4096, 4112], dtype=U), False),
        (np.asarray([4112, 4096, 4096, 4096], dtype=U), False),
        (np.full(8, 4096, dtype=U)[::2], True),  # strided
    ],
)
def test_descriptor_block_packs_one_length_however_given(sizes: Any, packed: bool) -> None:
    d, s = arrays([0x10000, 0x20000, 0x30000, 0x40000], [0x1000, 0x5000, 0x2000, 0x9000])
    assert check_block(d, s, sizes, 3).packed == packed


def test_descriptor_block_reads_strided_and_reversed_views() -> None:
    base = np.arange(64, dtype=U) * U(4096) + U(1 << 40)
    layout = check_block(base[::4], base[62::-3][:16], np.broadcast_to(U(4096), (16,)), 2)
    assert layout.packed
    assert not check_block(base[::4], base[::-4], (base % U(3) + U(1))[::4]).packed


def test_a_partly_contiguous_request_packs_once_its_runs_are_cut() -> None:
    """The planner merges neighbours on both sides into runs: where some merge and others do not,
    the copies have several lengths and would take the wide layout; the SM path cuts the runs back
    into pages first (``pieces``), and then they pack. Where none merge, they pack as planned."""
    from aiokvtier._copy._plan import plan

    page, tier, dev = 4096, U(1 << 30), U(1 << 40)
    for slots, pages, packed in (([0, 1, 2, 5, 9], [7, 8, 9, 3, 20], False), ([0, 2, 5, 9], [7, 3, 9, 20], True)):
        p = plan(dev + np.asarray(pages, dtype=U) * U(page), tier + np.asarray(slots, dtype=U) * U(page), page)
        assert check_block(p.dsts, p.srcs, p.sizes).packed == packed
        cut = _sm.pieces(p.dsts, p.srcs, p.sizes)
        assert len(cut[0]) == len(slots) and check_block(*cut).packed


def edge_addresses(n: int) -> st.SearchStrategy[list[int]]:
    """``n`` addresses of one side: a base near 0, 2**32, 2**63 or 2**64 (or anywhere), a step of
    2**shift, indices biased to 0 and the edges of 32 bits; wrapped into 64 bits."""
    base = st.one_of(st.sampled_from([0, 1, (1 << 32) - 16, 1 << 63, TOP + 1 - (1 << 40), TOP]), st.integers(0, TOP))
    index = st.one_of(st.sampled_from([0, 1, STEPS_FIT - 1, STEPS_FIT, STEPS_FIT + 1]), st.integers(0, 1 << 33))
    return st.tuples(base, st.integers(0, 63), st.lists(index, min_size=n, max_size=n)).map(
        lambda t: [(t[0] + (i << t[1])) & TOP for i in t[2]]
    )


@settings(max_examples=400, deadline=None)
@given(st.data(), st.integers(1, 12), st.sampled_from(["broadcast", "equal", "one-differs"]), st.booleans())
def test_edge_biased_requests_pack_exactly_or_go_wide(data: Any, n: int, sizes_as: str, strided: bool) -> None:
    srcs = np.asarray(data.draw(edge_addresses(n)), dtype=U)
    dsts = np.asarray(data.draw(edge_addresses(n)), dtype=U)
    if strided:  # views with a stride: every other element of a longer array
        srcs, dsts = np.repeat(srcs, 2)[::2], np.repeat(dsts, 2)[::-2][::-1]
    if sizes_as == "broadcast":
        sizes: Any = np.broadcast_to(U(16), (n,))
    else:
        sizes = np.full(n, 16, dtype=U)
        if sizes_as == "one-differs":
            sizes[data.draw(st.integers(0, n - 1))] = 32
    layout = check_block(dsts, srcs, sizes, data.draw(st.integers(0, 3)))
    if sizes_as != "one-differs" and n == 1:
        assert layout.packed


def test_vector_alignment_covers_both_sides_and_the_length() -> None:
    assert _kernel.vector_aligned(*arrays([16, 4096], [32, 8192], [4096, 64]))
    assert not _kernel.vector_aligned(*arrays([16, 4104], [32, 8192], [4096, 64]))
    assert not _kernel.vector_aligned(*arrays([16], [40], [4096]))
    assert not _kernel.vector_aligned(*arrays([16], [32], [4100]))


def test_slab_capacity_is_a_power_of_two_with_a_floor() -> None:
    assert _sm.slab_capacity(1) == _sm.MIN_SLAB
    assert _sm.slab_capacity(_sm.MIN_SLAB) == _sm.MIN_SLAB
    assert _sm.slab_capacity(_sm.MIN_SLAB + 1) == 2 * _sm.MIN_SLAB
    assert _sm.slab_capacity(32768) == 32768


@pytest.mark.parametrize(
    ("sizes", "limit", "expect"),
    [
        ([4096] * 8, 1 << 20, [(0, 8)]),  # under the limit: one launch
        ([4096] * 8, 8192, [(0, 2), (2, 2), (4, 2), (6, 2)]),
        ([4096] * 7, 8192, [(0, 1), (1, 2), (3, 2), (5, 2)]),  # the fewest runs, cut evenly
        ([4096] * 5, 16384, [(0, 2), (2, 3)]),  # 20 KiB at 16 KiB: two runs, not 16 + 4
        ([4096, 1 << 20, 4096, 4096], 8192, [(0, 1), (1, 1), (2, 2)]),  # a copy over the limit: alone
        ([100, 200, 300], 250, [(0, 1), (1, 1), (2, 1)]),
        ([], 8192, []),
    ],
)
def test_slices_cover_every_copy_in_order_within_the_limit(
    sizes: list[int], limit: int, expect: list[tuple[int, int]]
) -> None:
    got = _sm.slices(np.asarray(sizes, dtype=U), limit)
    assert got == expect
    assert sum(c for _, c in got) == len(sizes)
    for first, count in got:
        assert count == 1 or sum(sizes[first : first + count]) <= limit


def test_kernel_spec_options_name_the_arch_and_shape() -> None:
    opts = _kernel.KernelSpec("sm_90", threads=512, unroll=4).options()
    assert "--gpu-architecture=sm_90" in opts and "-DTHREADS=512" in opts and "-DUNROLL=4" in opts
    assert "-DBOUNDED=1" in opts and "-DBOUNDED=0" in _kernel.KernelSpec("sm_90", bounded=False).options()


def curves(sm_per_page: float, dma_per_page: float, sm_fixed: float = 20e-6, dma_fixed: float = 10e-6) -> Any:
    """Flat per-page costs at every ladder size (bytes do not matter): enough to test the choice."""
    n = len(LADDER)
    return {
        d: {
            "sm": Curve(LADDER, (sm_per_page,) * n, sm_fixed),
            "dma": Curve(LADDER, (dma_per_page,) * n, dma_fixed),
        }
        for d in ("h2d", "d2h")
    }


def test_curve_interpolates_and_extrapolates_by_bandwidth() -> None:
    c = Curve((4096, 8192), (1.0, 3.0), 0.5)
    assert c.per_page(1024) == 1.0
    assert c.per_page(6144) == pytest.approx(2.0)
    assert c.per_page(16384) == pytest.approx(6.0)
    assert c.time(10, 4096) == pytest.approx(10.5)


def test_choice_weighs_fixed_cost_against_count() -> None:
    x = Crossover(curves=curves(sm_per_page=1e-6, dma_per_page=4e-6, sm_fixed=100e-6, dma_fixed=10e-6))
    assert x.choose("h2d", 4096, 4096 * 16384) == "sm"  # many pages: per-page cost wins
    assert x.choose("h2d", 2, 2 * 16384) == "dma"  # two pages: the launch's fixed cost does not pay
    assert x.choose("any", 4096, 4096 * 16384) == "dma"
    near = Crossover(curves=curves(sm_per_page=0.95e-6, dma_per_page=1e-6))
    assert near.choose("d2h", 4096, 4096 * 4096) == "dma"  # within the margin: the copy engines cost no SMs


def test_method_selection() -> None:
    x = Crossover(curves=curves(sm_per_page=1e-6, dma_per_page=4e-6))
    aligned = arrays([4096 * i for i in range(64)], [8192 * i for i in range(64)], [4096] * 64)
    assert _sm.pick_method("auto", x, "h2d", *aligned) == "sm"
    assert _sm.pick_method("dma", x, "h2d", *aligned) == "dma"
    assert _sm.pick_method("sm", None, "d2h", *aligned) == "sm"
    assert _sm.pick_method("sm", x, "any", *aligned) == "dma"
    assert _sm.pick_method("auto", None, "h2d", *aligned) == "dma"
    odd = arrays([4096 * i + 8 for i in range(64)], [8192 * i for i in range(64)], [4096] * 64)
    assert _sm.pick_method("auto", x, "h2d", *odd) == "dma"  # not 16-byte aligned: the kernel would crawl


def test_a_piece_takes_the_path_of_its_whole_request() -> None:
    x = Crossover(curves=curves(sm_per_page=1e-6, dma_per_page=4e-6, sm_fixed=100e-6, dma_fixed=10e-6))
    two = arrays([4096, 8192], [0, 4096], [4096, 4096])
    assert _sm.pick_method("auto", x, "h2d", *two) == "dma"  # alone, two pages do not pay for a launch
    assert _sm.pick_method("auto", x, "h2d", *two, whole=(32768, 32768 * 4096)) == "sm"
    odd = arrays([8, 4104], [0, 4096], [4096, 4096])
    assert _sm.pick_method("auto", x, "h2d", *odd, whole=(32768, 32768 * 4096)) == "dma"  # the piece's own alignment


def test_thresholds_override() -> None:
    x = parse_thresholds("h2d=32KiB, d2h=16384")
    assert x.thresholds == {"h2d": 32768, "d2h": 16384}
    assert x.choose("h2d", 10, 10 * 32768) == "sm" and x.choose("h2d", 10, 10 * 65536) == "dma"
    assert x.choose("d2h", 1, 16385) == "dma"
    with pytest.raises(ValueError, match="direction=bytes"):
        parse_thresholds("h2d")
    with pytest.raises(ValueError, match="not a size"):
        parse_thresholds("h2d=lots")
    with pytest.raises(ValueError, match="per direction"):
        parse_thresholds("up=4096")


def key(**changes: Any) -> dict[str, Any]:
    k = {"device": "Fake GPU", "uuid": "00ff", "driver": 13000, "budget": 8, "kernel": 1, "threads": 1024, "unroll": 8}
    k.update(changes)
    return k


def test_crossover_file_is_measured_once_then_reused(tmp_path: Path) -> None:
    calls = []

    def measure() -> Any:
        calls.append(1)
        return curves(1e-6, 4e-6)

    first = load_or_measure(key(), measure, tmp_path)
    again = load_or_measure(key(), measure, tmp_path)
    assert len(calls) == 1 and again == first
    assert again.choose("h2d", 4096, 4096 * 4096) == "sm"
    stored = json.loads(_crossover.cache_path(key(), tmp_path).read_text())
    assert stored["key"] == key()


@pytest.mark.parametrize("change", [{"driver": 13010}, {"device": "Other GPU"}, {"kernel": 2}])
def test_crossover_file_is_rebuilt_when_the_device_or_driver_changes(tmp_path: Path, change: dict[str, Any]) -> None:
    load_or_measure(key(), lambda: curves(1e-6, 4e-6), tmp_path)
    rebuilt = load_or_measure(key(**change), lambda: curves(8e-6, 4e-6), tmp_path)
    assert rebuilt.key == key(**change) and rebuilt.choose("h2d", 4096, 4096 * 4096) == "dma"
    stored = json.loads(_crossover.cache_path(key(**change), tmp_path).read_text())
    assert stored["key"] == key(**change)


def test_an_unreadable_crossover_file_is_measured_again(tmp_path: Path) -> None:
    path = _crossover.cache_path(key(), tmp_path)
    path.write_text("{not json")
    got = load_or_measure(key(), lambda: curves(1e-6, 4e-6), tmp_path)
    assert got.key == key() and json.loads(path.read_text())["format"] == _crossover.FORMAT


def test_a_budget_has_its_own_file(tmp_path: Path) -> None:
    assert _crossover.cache_path(key(), tmp_path) != _crossover.cache_path(key(budget=16), tmp_path)


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("AIOKVTIER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _crossover.cache_dir() == tmp_path / "aiokvtier"
    monkeypatch.setenv("AIOKVTIER_CACHE_DIR", str(tmp_path / "x"))
    assert _crossover.cache_dir() == tmp_path / "x"


def test_engine_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="method must be one of"):
        CopyEngine(None, method="fast")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        CopyEngine(None, method="sm")
    with pytest.raises(ValueError, match="sm_budget"):
        CopyEngine(None, sm_budget=0)
    with pytest.raises(ValueError, match="per direction"):
        CopyEngine(None, crossover={"sideways": 1})
    assert CopyEngine(None).method == "dma"  # the default is auto; without a device there is nothing to choose
    assert CopyEngine(None, method="auto").method == "dma"


async def test_host_engine_reports_bytes_per_method() -> None:
    from aiokvtier import StaticHostMem

    async with StaticHostMem(1 << 20) as mem, CopyEngine(None) as engine:
        await engine.copy([(mem.address, mem.address + (512 << 10), 4096)])
        stats = engine.statistics()
        assert stats.method == "dma" and stats.sm_budget is None
        assert stats.bytes_by_method == {"dma": 4096, "sm": 0} and stats.jobs_by_method == {"dma": 1, "sm": 0}


def test_kernel_compiles_where_nvrtc_is_installed() -> None:
    """NVRTC needs no GPU: where it is installed, the kernel compiles for a Hopper and an Ampere."""
    try:
        cubin = _kernel.compile_cubin(_kernel.KernelSpec("sm_90"))
    except Exception as exc:  # no NVRTC here: nothing to check
        pytest.skip(f"NVRTC is not usable here: {exc}")
    assert cubin[:4] == b"\x7fELF"
    assert _kernel.compile_cubin(_kernel.KernelSpec("sm_80", threads=512, unroll=4))[:4] == b"\x7fELF"


# -- SmPath.submit on a model of streams and events: ordering, budgets, failures -------------------


class _Failed(int):
    name = "CUDA_ERROR_INJECTED"


class StreamModel:
    """A driver stand-in: per stream, ops in order; an event wait orders a stream after the op the
    event was recorded behind. ``fail_at``: the fallible call (driver call or launch) to refuse."""

    class CUevent_flags:
        CU_EVENT_DISABLE_TIMING = 2

    class CUstream_flags:
        CU_STREAM_NON_BLOCKING = 1

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at, self.calls = fail_at, 0
        self.ops: list[tuple[str, int, set[int], Any]] = []  # (kind, stream, direct dependencies, detail)
        self.tail: dict[int, int] = {}  # stream: its last op
        self.recorded: dict[int, int | None] = {}  # event: the op it follows, once recorded
        self.events: set[int] = set()
        self.streams: set[int] = set()
        self.synced: list[tuple[int, int]] = []  # (stream, ops enqueued by then)
        self.pdl: set[int] = set()  # launches made as programmatic dependents
        self.sources: dict[int, str] = {}  # launch: where its descriptors are read, "host" or "device"
        self._handles = itertools.count(1000)

    def _fails(self) -> bool:
        self.calls += 1
        return self.calls - 1 == self.fail_at

    def enqueue(self, kind: str, stream: int, detail: Any = None, after: int | None = None) -> int:
        deps = {d for d in (self.tail.get(stream), after) if d is not None}
        self.ops.append((kind, stream, deps, detail))
        self.tail[stream] = len(self.ops) - 1
        return len(self.ops) - 1

    def before(self, op: int) -> set[int]:
        """Every op that ``op`` runs after."""
        seen: set[int] = set()
        todo = list(self.ops[op][2])
        while todo:
            d = todo.pop()
            if d not in seen:
                seen.add(d)
                todo.extend(self.ops[d][2])
        return seen

    def cuMemcpyHtoDAsync(self, dst: int, src: int, nbytes: int, stream: int) -> tuple[int]:
        if self._fails():
            return (_Failed(1),)
        self.enqueue("upload", int(stream))
        return (0,)

    def cuEventCreate(self, flags: int) -> tuple[int, int]:
        if self._fails():
            return _Failed(1), 0
        event = next(self._handles)
        self.events.add(event)
        return 0, event

    def cuEventRecord(self, event: int, stream: int) -> tuple[int]:
        if self._fails():
            return (_Failed(1),)
        self.recorded[event] = self.tail.get(int(stream))
        return (0,)

    def cuStreamWaitEvent(self, stream: int, event: int, flags: int) -> tuple[int]:
        if self._fails():
            return (_Failed(1),)
        # A wait for an event never recorded waits for nothing: the stream would run ahead.
        assert event in self.recorded, "a stream waits for an event that was never recorded"
        self.enqueue("wait", int(stream), after=self.recorded[event])
        return (0,)

    def cuEventDestroy(self, event: int) -> tuple[int]:
        self.events.remove(event)
        self.recorded.pop(event, None)
        return (0,)

    def cuStreamCreate(self, flags: int) -> tuple[int, int]:
        if self._fails():
            return _Failed(1), 0
        stream = next(self._handles)
        self.streams.add(stream)
        return 0, stream

    def cuStreamDestroy(self, stream: int) -> tuple[int]:
        self.streams.remove(stream)
        return (0,)

    def cuStreamSynchronize(self, stream: int) -> tuple[int]:
        self.synced.append((int(stream), len(self.ops)))
        return (0,)

    def cuMemFree(self, ptr: int) -> tuple[int]:
        return (0,)

    def cuMemFreeHost(self, ptr: int) -> tuple[int]:
        return (0,)


class ModelKernel:
    def __init__(self, model: StreamModel, budget: int) -> None:
        self.model, self.budget = model, budget

    def launch(
        self, descriptors: int, layout: Any, stream: Any, budget: int | None, first: int, count: int, pdl: bool = False
    ) -> None:
        if self.model._fails():
            raise CudaError("cuLaunchKernel", "CUDA_ERROR_INJECTED", 1)
        self.model.enqueue("launch", int(stream), (budget or self.budget, first, count))
        self.model.sources[len(self.model.ops) - 1] = "host" if descriptors == SLAB_HOST else "device"
        if pdl:
            self.model.pdl.add(len(self.model.ops) - 1)

    def unload(self) -> None:
        pass


def model_path(
    monkeypatch: pytest.MonkeyPatch,
    budget: int,
    fail_at: int | None = None,
    model: StreamModel | None = None,
    options: SmOptions | None = None,
) -> tuple[Any, StreamModel]:
    """An SmPath over the model (no GPU): one slab free, the kernel recording its launches."""
    model = StreamModel(fail_at) if model is None else model
    monkeypatch.setattr(_sm, "driver", lambda: model)
    slab = _sm.Slab(_sm.MIN_SLAB, SLAB_HOST, SLAB_DEVICE, np.zeros(3 * _sm.MIN_SLAB, dtype=U))
    path = _sm.SmPath(0, budget, options=options, kernel=ModelKernel(model, budget), slabs=[slab])
    return path, model


STREAM = 7
SLAB_HOST, SLAB_DEVICE = 1, 2


@pytest.fixture(params=[False, True], ids=["one-stream", "alternate"])
def alternate(request: pytest.FixtureRequest) -> bool:
    """Slices on the copy's stream alone (the default) and alternating with a partner stream."""
    return bool(request.param)


@pytest.fixture(params=[False, True], ids=["upload-first", "head"])
def head(request: pytest.FixtureRequest) -> bool:
    """The descriptors uploaded before the first slice, or the first slice reading them from the
    staging slab while the partner stream uploads them for the rest (``SmOptions.head``)."""
    return bool(request.param)


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("pages", [1, 2, 3, 4, 7])
def test_sliced_launches_follow_the_upload_and_precede_the_completion(
    monkeypatch: pytest.MonkeyPatch, budget: int, pages: int, alternate: bool, head: bool
) -> None:
    """Every slice that reads the uploaded descriptors runs after the upload (with ``head``, only
    the first slice reads them from the slab, launched plainly, and a request of one slice uploads
    nothing), the request's completion (recorded on the copy's stream next) runs after every slice
    and the upload, each copy is launched once, every launch has a block, at most ``budget`` blocks
    run at once, and no event is left behind; the partner stream goes at close."""
    path, model = model_path(monkeypatch, budget, options=SmOptions(alternate=alternate, head=head))
    sizes = np.full(pages, 4096, dtype=U)
    slab = path.submit(np.arange(pages, dtype=U), np.arange(pages, dtype=U), sizes, STREAM, slice_bytes=4096)
    path.give_back(slab)
    done = model.enqueue("completion", STREAM)
    launches = [i for i, op in enumerate(model.ops) if op[0] == "launch"]
    uploads = [i for i, op in enumerate(model.ops) if op[0] == "upload"]
    assert sorted(c for i in launches for c in range(model.ops[i][3][1], sum(model.ops[i][3][1:]))) == list(
        range(pages)
    )
    headed = head and not alternate
    assert len(uploads) == (0 if headed and len(launches) == 1 else 1)
    ancestors = model.before(done)
    assert all(u in ancestors for u in uploads)
    for k, i in enumerate(launches):
        if headed and k == 0:
            assert model.sources[i] == "host" and i not in model.pdl
        else:
            assert model.sources[i] == "device" and uploads[0] in model.before(i)
        assert i in ancestors
        assert model.ops[i][3][0] >= 1
    for i, j in itertools.combinations(launches, 2):
        if i not in model.before(j):  # may run together
            assert model.ops[i][3][0] + model.ops[j][3][0] <= budget
    assert len({model.ops[i][1] for i in launches}) == (2 if alternate and budget > 1 and pages > 1 else 1)
    assert not model.events
    path.close()
    assert not model.streams and not path.partners


@pytest.mark.parametrize("pdl", [False, True])
def test_a_programmatic_launch_follows_only_a_slice_of_its_own_request(
    monkeypatch: pytest.MonkeyPatch, pdl: bool, alternate: bool, head: bool
) -> None:
    """A programmatic launch may start while the kernel just before it on its stream drains: that
    kernel is always a slice of the same request (between requests the upload, an event or a wait
    comes first), so a request never overlaps another's copies; launched so or not, each request's
    completion follows its every slice."""
    path, model = model_path(monkeypatch, 4, options=SmOptions(alternate=alternate, head=head, pdl=pdl))
    requests: list[range] = []
    for pages in (3, 1, 5, 2):
        start = len(model.ops)
        args = (np.arange(pages, dtype=U), np.arange(pages, dtype=U), np.full(pages, 4096, dtype=U), STREAM)
        path.give_back(path.submit(*args, slice_bytes=4096))
        done = model.enqueue("completion", STREAM)
        requests.append(range(start, done + 1))
        assert all(i in model.before(done) for i in requests[-1] if model.ops[i][0] == "launch")
    owner = {i: r for r in requests for i in r}
    assert bool(model.pdl) == pdl
    for i in model.pdl:
        previous = [j for j in range(i) if model.ops[j][1] == model.ops[i][1]]
        assert previous, i
        j = previous[-1]
        assert model.ops[j][0] != "launch" or owner[j] is owner[i], (i, j)
    path.close()


@pytest.mark.parametrize("budget", [2, 3, 4])
def test_a_refused_call_midway_leaves_no_slice_running_and_no_event(
    monkeypatch: pytest.MonkeyPatch, budget: int, alternate: bool, head: bool
) -> None:
    """Whichever driver call or launch of a sliced request is refused, the error comes out, both
    streams are synchronized after everything queued (the slab is reusable), the slab is free, and no
    event is left; a later request on the same stream still orders its slices."""
    options = SmOptions(alternate=alternate, head=head)
    path, model = model_path(monkeypatch, budget, options=options)
    pages = 5
    args = (np.arange(pages, dtype=U), np.arange(pages, dtype=U), np.full(pages, 4096, dtype=U), STREAM)
    path.give_back(path.submit(*args, slice_bytes=4096))
    fallible = model.calls
    for fail_at in range(fallible):
        path, model = model_path(monkeypatch, budget, fail_at, options=options)
        try:
            path.give_back(path.submit(*args, slice_bytes=4096))
        except CudaError as exc:
            assert "INJECTED" in str(exc)
            for i, (kind, stream, _, _) in enumerate(model.ops):
                assert any(s == stream and i < count for s, count in model.synced), (fail_at, kind)
        else:  # only a refused partner stream is not an error: every slice then runs on the copy's stream
            assert not model.streams and {op[1] for op in model.ops} == {STREAM}
            assert sum(op[3][2] for op in model.ops if op[0] == "launch") == pages
        assert len(path.free_slabs) == 1 and not model.events
        model.fail_at = None
        path.give_back(path.submit(*args, slice_bytes=4096))
        done = model.enqueue("completion", STREAM)
        assert not model.events
        last = max(i for i, op in enumerate(model.ops) if op[0] == "launch")
        assert last in model.before(done)
        path.close()
        assert not model.streams


def request(pages: int) -> tuple[Any, ...]:
    return np.arange(pages, dtype=U), np.arange(pages, dtype=U), np.full(pages, 4096, dtype=U), STREAM


def test_an_empty_request_launches_nothing(monkeypatch: pytest.MonkeyPatch, alternate: bool, head: bool) -> None:
    """No copies: no launch, no event, no error; the slab comes back."""
    path, model = model_path(monkeypatch, 4, options=SmOptions(alternate=alternate, head=head))
    path.give_back(path.submit(*request(0), slice_bytes=4096))
    assert not [op for op in model.ops if op[0] == "launch"] and not model.events and len(path.free_slabs) == 1
    path.close()


@pytest.mark.parametrize("pdl", [False, True])
def test_each_request_starts_after_the_one_before_on_its_stream(
    monkeypatch: pytest.MonkeyPatch, alternate: bool, head: bool, pdl: bool
) -> None:
    """A request's first slice follows every slice of the request before it on the copy's stream
    (the partner's included), and may not overlap it: with ``head`` it is launched plainly (its
    descriptors read from the slab); otherwise what comes just before it is the upload."""
    path, model = model_path(monkeypatch, 4, options=SmOptions(alternate=alternate, head=head, pdl=pdl))
    previous: list[int] = []
    for pages in (3, 1, 5, 1, 2, 7):
        start = len(model.ops)
        path.give_back(path.submit(*request(pages), slice_bytes=4096))
        launches = [i for i in range(start, len(model.ops)) if model.ops[i][0] == "launch"]
        first = min(launches)
        assert all(j in model.before(first) for j in previous), pages
        if first in model.pdl:
            before_first = [j for j in range(first) if model.ops[j][1] == model.ops[first][1]][-1]
            assert model.ops[before_first][0] == "upload" and before_first >= start
        if head and not alternate:
            assert first not in model.pdl and model.sources[first] == "host"
        previous = launches
    path.close()


@pytest.mark.parametrize("pages", [1, 2, 5])
def test_a_refused_partner_stream_uploads_on_the_copy_stream_first(
    monkeypatch: pytest.MonkeyPatch, pages: int, head: bool
) -> None:
    """Where the driver refuses the partner stream, the descriptors go up on the copy's stream ahead
    of every slice that reads them; a request of one slice with ``head`` needs neither. The next
    request asks for the partner again."""
    path, model = model_path(monkeypatch, 4, options=SmOptions(head=head))
    refuse = model.cuStreamCreate
    model.cuStreamCreate = lambda flags: (_Failed(1), 0)  # type: ignore[method-assign]
    path.give_back(path.submit(*request(pages), slice_bytes=4096))
    launches = [i for i, op in enumerate(model.ops) if op[0] == "launch"]
    uploads = [i for i, op in enumerate(model.ops) if op[0] == "upload"]
    assert {op[1] for op in model.ops} == {STREAM} and not path.partners and not model.events
    if head and pages == 1:
        assert not uploads and model.sources[launches[0]] == "host"
    else:
        assert len(uploads) == 1 and uploads[0] < launches[0]
        assert all(model.sources[i] == "device" and uploads[0] in model.before(i) for i in launches)
    model.cuStreamCreate = refuse  # type: ignore[method-assign]
    path.give_back(path.submit(*request(pages), slice_bytes=4096))
    assert bool(path.partners) == (head and pages > 1)
    path.close()


class _KeyDriver:
    """What ``device_key`` asks the driver."""

    def cuDeviceGet(self, device: int) -> tuple[int, int]:
        return 0, device

    def cuDeviceGetName(self, size: int, device: int) -> tuple[int, bytes]:
        return 0, b"Model GPU\x00"

    def cuDeviceGetUuid(self, device: int) -> tuple[int, bytes]:
        return 0, bytes(range(16))

    def cuDriverGetVersion(self) -> tuple[int, int]:
        return 0, 13000


def test_the_crossover_key_names_how_requests_are_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    """A crossover measured with other slices (or one stream) is measured again, not reused."""
    from aiokvtier._cuda import _driver

    monkeypatch.setattr(_driver, "driver", lambda: _KeyDriver())
    spec, options = _kernel.KernelSpec("sm_90"), SmOptions()
    key = _crossover.device_key(0, 4, spec, options)
    assert _crossover.device_key(0, 4, spec, SmOptions(slice_bytes=2 * key["slice_bytes"])) != key
    for switch in ("alternate", "pdl", "pack", "head", "split_runs"):
        flipped = dataclasses.replace(options, **{switch: not getattr(options, switch)})
        assert _crossover.device_key(0, 4, spec, flipped) != key, switch
    assert _crossover.device_key(0, 4, _kernel.KernelSpec("sm_90", bounded=False), options) != key


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 1 << 22), min_size=1, max_size=60),
    limit=st.integers(1, 1 << 23),
)
def test_slices_are_even_and_within_the_limit(sizes: list[int], limit: int) -> None:
    """Every copy once, in order; a run over the limit is one copy; runs of one page size are as
    few as fit and differ by at most one page."""
    got = _sm.slices(np.asarray(sizes, dtype=U), limit)
    assert [i for first, count in got for i in range(first, first + count)] == list(range(len(sizes)))
    for first, count in got:
        assert count >= 1 and (count == 1 or sum(sizes[first : first + count]) <= limit)
    if len(set(sizes)) == 1 and sizes[0] <= limit:
        counts = [c for _, c in got]
        assert max(counts) - min(counts) <= 1
        assert len(got) == -(-len(sizes) // (limit // sizes[0]))


def test_the_engine_states_the_present_slice_size() -> None:
    """``sm_budget``'s documentation names the slice size requests are cut to."""
    doc = " ".join((CopyEngine.__doc__ or "").split())
    assert f"launches of at most {SmOptions().slice_bytes >> 20} MiB" in doc


# -- the bench's gate: a stream it holds is always let go ------------------------------------------


class GateModel(StreamModel):
    """The stream model with stream memory waits: a stream held by a wait on a pinned word blocks a
    synchronization until the word reaches the value (failing after a few seconds, not hanging)."""

    class CUstreamWaitValue_flags:
        CU_STREAM_WAIT_VALUE_GEQ = 0

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__(fail_at)
        self.words: list[Any] = []
        self.holds: list[tuple[int, int, int]] = []  # (stream, word address, value)
        self.wait_value: Any = None  # replaces cuStreamWaitValue32's result where set

    def cuMemHostAlloc(self, nbytes: int, flags: int) -> tuple[int, int]:
        self.words.append(ctypes.create_string_buffer(nbytes))
        return 0, ctypes.addressof(self.words[-1])

    def cuMemHostGetDevicePointer(self, host: int, flags: int) -> tuple[int, int]:
        return 0, host

    def cuStreamWaitValue32(self, stream: int, address: int, value: int, flags: int) -> tuple[int]:
        if self.wait_value is not None:
            return self.wait_value(stream)  # type: ignore[no-any-return]
        self.holds.append((int(stream), address, value))
        return (0,)

    def held(self, stream: int) -> bool:
        return any(s == stream and ctypes.c_uint32.from_address(a).value < v for s, a, v in self.holds)

    def cuStreamSynchronize(self, stream: int) -> tuple[int]:
        deadline = time.monotonic() + 5
        while self.held(int(stream)):
            if time.monotonic() > deadline:
                raise AssertionError(f"stream {stream} is held by a gate nothing releases")
            time.sleep(0.001)
        return super().cuStreamSynchronize(stream)

    def cuEventSynchronize(self, event: int) -> tuple[int]:
        for stream in {s for s, _, _ in self.holds}:
            self.cuStreamSynchronize(stream)
        return (0,)

    def cuEventElapsedTime(self, start: int, end: int) -> tuple[int, float]:
        return 0, 1.0


def gate_model(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, GateModel]:
    from aiokvtier.bench import _sm as bench

    model = GateModel()
    monkeypatch.setattr(bench, "driver", lambda: model)
    return bench.Gate(), model


def test_a_gate_refused_or_raising_on_one_stream_lets_the_others_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait the driver refuses, or one that raises, after another stream is held: that stream
    runs at once (and a refusal turns the gate off)."""
    gate, model = gate_model(monkeypatch)
    assert gate.hold(1) and model.held(1)
    gate.release()
    assert not model.held(1)

    def wait(stream: Any) -> tuple[int]:
        if stream is None:
            raise TypeError("not a stream")
        if stream == 2:
            return (_Failed(1),)
        model.holds.append((stream, gate.device, gate.value))
        return (0,)

    model.wait_value = wait
    with pytest.raises(TypeError):
        gate.hold(1, None)
    assert not model.held(1) and gate.usable
    assert not gate.hold(1, 2) and not gate.usable
    assert not model.held(1) and not gate.hold(1)
    gate.close()


def test_a_failing_submit_behind_the_gate_does_not_hold_its_stream_forever(
    monkeypatch: pytest.MonkeyPatch, head: bool
) -> None:
    """A launch refused while the gate holds the streams: the SM path's clean-up synchronizes the
    copy's stream, which the gate still holds; the gate lets go by itself, the error comes out, and
    the timing after it is no longer gated."""
    from aiokvtier.bench import _sm as bench

    monkeypatch.setattr(bench, "HOLD_LIMIT", 0.05)
    gate, model = gate_model(monkeypatch)
    path, _ = model_path(monkeypatch, 4, model=model, options=SmOptions(head=head))
    calls = 0

    def submit() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:  # the first timed call: its first launch is refused
            model.fail_at = model.calls + (3 if head else 1)
        path.give_back(path.submit(*request(5), slice_bytes=4096))

    partner = (path.partner(STREAM),)
    started = time.monotonic()
    with pytest.raises(CudaError, match="INJECTED"):
        bench.sync_time(submit, STREAM, gate=gate, also=partner)
    assert time.monotonic() - started < 4
    assert not model.held(STREAM) and not model.held(partner[0]) and not gate.usable
    assert len(path.free_slabs) == 1 and not model.events
    gate.close()
    path.close()


@settings(max_examples=200, deadline=None)
@given(
    runs=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 1 << 20)), min_size=1, max_size=30),
    page=st.sampled_from([4096, 16384, 65536, 2 << 20]),
)
def test_runs_are_cut_back_into_pages_covering_the_same_bytes(runs: list[tuple[int, int]], page: int) -> None:
    """Runs of whole pages become pages of one length, in order, each inside the run it came from,
    together exactly the run's bytes on both sides."""
    sizes = np.asarray([k * page for k, _ in runs], dtype=U)
    srcs = np.asarray([(i << 36) + (gap << 4) for i, (_, gap) in enumerate(runs)], dtype=U)
    dsts = srcs + np.uint64(1 << 44)
    d, s, z = _sm.pieces(dsts, srcs, sizes)
    if len(set(sizes.tolist())) == 1 or len(runs) == 1:
        assert d is dsts and s is srcs and z is sizes  # one length already: as given
        return
    g = int(np.gcd.reduce(sizes))
    assert set(z.tolist()) == {g} and int(z.sum()) == int(sizes.sum())
    expect = [(int(b) + o, int(a) + o) for a, b, n in zip(srcs, dsts, sizes, strict=True) for o in range(0, int(n), g)]
    assert list(zip(d.tolist(), s.tolist(), strict=True)) == expect


@pytest.mark.parametrize(
    "sizes",
    [[4096, 6144], [16, 32, 48], [4104, 8208], [4096], [8192, 8192]],
    ids=["gcd-2KiB", "gcd-16B", "gcd-not-16", "one-copy", "one-length"],
)
def test_copies_that_are_not_runs_of_pages_stay_whole(sizes: list[int]) -> None:
    n = len(sizes)
    dsts, srcs, z = arrays([i << 20 for i in range(n)], [i << 24 for i in range(n)], sizes)
    assert _sm.pieces(dsts, srcs, z) == (dsts, srcs, z)


def test_a_merged_request_is_launched_as_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run of three pages among single ones reaches the kernel as three pages, packed."""
    path, model = model_path(monkeypatch, 4)
    dsts, srcs, sizes = arrays([0x10000, 0x50000, 0x90000], [0x7000000, 0x8000000, 0x9000000], [4096, 12288, 8192])
    path.give_back(path.submit(dsts, srcs, sizes, STREAM))
    launches = [op[3] for op in model.ops if op[0] == "launch"]
    assert sum(count for _, _, count in launches) == 6
    view = path.free_slabs[0].view
    assert view[:3].view(np.uint32).tolist() == [0, 0x1000, 0x1001, 0x1002, 0x2000, 0x2001]  # srcs, 4 KiB steps
    path, model = model_path(monkeypatch, 4, options=SmOptions(split_runs=False))
    path.give_back(path.submit(dsts, srcs, sizes, STREAM))
    assert sum(op[3][2] for op in model.ops if op[0] == "launch") == 3


def test_no_home_directory_measures_and_keeps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """No HOME, no passwd entry, no AIOKVTIER_CACHE_DIR (a container's arbitrary user): measured
    and used (before: ``Path.home()``'s RuntimeError failed the engine's open)."""
    import pwd

    def unknown(uid: int) -> Any:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    for name in ("AIOKVTIER_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pwd, "getpwuid", unknown)
    got = load_or_measure(key(), lambda: curves(1e-6, 4e-6))
    assert got.key == key() and got.choose("h2d", 4096, 4096 * 4096) == "sm"


def test_a_crossover_that_cannot_be_stored_leaves_no_temporary_file(tmp_path: Path) -> None:
    _crossover.cache_path(key(), tmp_path).mkdir()  # a directory where the file goes
    assert load_or_measure(key(), lambda: curves(1e-6, 4e-6), tmp_path).key == key()
    assert list(tmp_path.rglob("*.tmp")) == []
