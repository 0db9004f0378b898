"""Locating host spans in known regions: the vectorised planner against a scalar reference.

``_regions.locate``, ``registrations``, ``Region.registrations_of`` (HostTier,
StaticHostMem) and ``plan`` are checked against a slow reference that takes
one span at a time: which region holds it, does it leave the region, does it
run into (or over) a region from outside, does it cross a registration, is it
past the committed range; dense ids and owners in order of first appearance.
Fake regions put the arithmetic at the edges of the address space; real tiers
and staging buffers check that every accepted request copies the right bytes
and every refused one changes nothing.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from aiokvtier import CopyEngine, CopyPlanError, HostTier, SlotError, StaticHostMem, TierClosedError, _regions
from aiokvtier._copy._plan import plan
from aiokvtier._copy._requests import buffer_addresses, check_disjoint, plan_slots, registrations
from aiokvtier._host._layout import UnitLayout
from aiokvtier._regions import InflightCopies

from .conftest import PopulateGate
from .helpers import KiB, MiB, closing_with_a_copy_held, eventually, small_config
from .test_pool import ENV, ROOT

SLOT = 64 * KiB
TOP = 1 << 63
"""Addresses and sizes a copy request may hold are below this (int64, non-negative)."""


# -- the scalar reference ------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    """A region as the reference sees it, in plain ints."""

    region: Any
    base: int
    size: int
    starts: tuple[int, ...]
    """Start offsets of the registrations, then the end of the last one."""
    committed: int
    state: str = "open"


@dataclass(frozen=True)
class Problem:
    kind: str
    """A phrase the refusal's message must contain."""
    addr: int
    nbytes: int


def model_of(region: Any) -> Model:
    base, size = region.region_bounds()
    if isinstance(region, HostTier):
        stats = region.statistics()
        layout = UnitLayout.build(size, stats.slot_size, stats.commit_unit)  # the tier's, from its public facts
        starts = tuple(layout.start(i) for i in range(layout.count + 1))
        committed = min(stats.resident_bytes, stats.slots_total * stats.slot_size)
        return Model(region, base, size, starts, committed, region.state)
    if isinstance(region, StaticHostMem):
        return Model(region, base, size, (0, size), size, region.state)
    assert isinstance(region, FakeRegion)
    return Model(region, base, size, region.starts, region.committed, region.state)


def known_models() -> list[Model]:
    return [model_of(r) for r in _regions.known()]


def check_span(models: Sequence[Model], addr: int, n: int) -> Problem | tuple[Model, int] | None:
    """One span: ``(model, registration)``, None (in no region), or what is wrong with it."""
    for m in models:
        if m.base <= addr < m.base + m.size:
            if addr + n > m.base + m.size:
                return Problem("leaves", addr, n)
            if m.state != "open":
                return Problem(f"is {m.state}", addr, n)
            offset = addr - m.base
            unit = bisect.bisect_right(m.starts, offset) - 1
            if offset + n > m.starts[unit + 1]:
                return Problem("two registrations", addr, n)
            if offset + n > m.committed:
                return Problem("committed", addr, n)
            return m, unit
    for m in models:
        if addr < m.base < addr + n:  # the span reaches a region it does not start in
            return Problem("runs into", addr, n)
    return None


def reference(
    models: Sequence[Model], sides: Sequence[Sequence[int]], sizes: Sequence[int], *, known_only: bool
) -> tuple[list[list[int]], list[Any]] | list[Problem]:
    """Dense ids per side and the owners, or every problem of the request."""
    dense: dict[tuple[int, int], int] = {}
    owners: dict[int, Any] = {}
    problems: list[Problem] = []
    out: list[list[int]] = []
    for side in sides:
        ids = []
        for addr, n in zip(side, sizes, strict=True):
            hit = check_span(models, addr, n)
            if isinstance(hit, Problem):
                problems.append(hit)
                if known_only and hit.kind == "runs into":  # it starts in no region: both are true
                    problems.append(Problem("lies in no open HostTier", addr, n))
            elif hit is None:
                if known_only:
                    problems.append(Problem("lies in no open HostTier", addr, n))
                ids.append(-1)
            else:
                m, unit = hit
                ids.append(dense.setdefault((id(m.region), unit), len(dense)))
                owners.setdefault(id(m.region), m.region)
        out.append(ids)
    return problems if problems else (out, list(owners.values()))


def names_a_problem(message: str, problems: Sequence[Problem], bases: Sequence[int]) -> bool:
    """The refusal names a real problem of one of the spans (by absolute or region-relative address)."""
    for p in problems:
        if p.kind not in message:
            continue
        if p.kind.startswith("is "):  # a region that is not open: the message names the region
            return True
        if f"{p.addr:#x}" in message or any(f"at +{p.addr - b} " in message for b in bases if p.addr >= b):
            return True
    return False


# -- fake regions: the arithmetic anywhere below 2**63 -----------------------------------------


class FakeRegion:
    """A region with chosen bounds, registrations and committed size, answering one span at a time."""

    def __init__(self, base: int, size: int, starts: tuple[int, ...], committed: int, state: str = "open") -> None:
        self.base, self.size, self.starts, self.committed, self.state = base, size, starts, committed, state
        self.asked: list[tuple[int, int]] = []
        self._copies = InflightCopies()

    @property
    def region_name(self) -> str:
        return f"fake region at {self.base:#x}"

    @property
    def copies(self) -> InflightCopies:
        return self._copies

    def region_bounds(self) -> tuple[int, int]:
        return self.base, self.size

    def registrations_of(self, offsets: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        out = []
        for offset, n in zip(offsets.tolist(), nbytes.tolist(), strict=True):
            # The planner asks a region only about spans that lie wholly inside it.
            assert 0 <= offset < offset + n <= self.size, (offset, n, self.size)
            self.asked.append((offset, n))
            if self.state != "open":
                raise CopyPlanError(f"{self.region_name} is {self.state}")
            unit = bisect.bisect_right(self.starts, offset) - 1
            if offset + n > self.starts[unit + 1]:
                raise CopyPlanError(f"copy of {n} bytes at {self.base + offset:#x} spans two registrations")
            if offset + n > self.committed:
                raise CopyPlanError(f"copy of {n} bytes at {self.base + offset:#x} leaves the committed range")
            out.append(unit)
        return np.array(out, dtype=np.int64)


@contextmanager
def only_regions(*regions: Any) -> Iterator[None]:
    """The known regions are exactly these while the block runs."""
    saved = _regions.known()
    for region in saved:
        _regions.unregister(region)
    try:
        for region in regions:
            _regions.register(region)
        yield
    finally:
        for region in regions:
            _regions.unregister(region)
        for region in saved:
            _regions.register(region)


@st.composite
def fake_layouts(draw: st.DrawFn) -> list[FakeRegion]:
    """One to four regions, maybe adjacent, maybe ending at 2**63, each cut into registrations."""
    count = draw(st.integers(1, 4))
    sizes = [draw(st.one_of(st.integers(1, 64), st.integers(1, 1 << 40), st.just(1 << 61))) for _ in range(count)]
    gaps = [draw(st.one_of(st.just(0), st.integers(1, 4096), st.integers(1, 1 << 40))) for _ in range(count)]
    span = sum(sizes) + sum(gaps[1:])
    origin = draw(st.one_of(st.just(0), st.integers(0, 1 << 47), st.just(TOP - span), st.just(TOP - span - 1)))
    origin = max(0, min(origin, TOP - span))
    out, at = [], origin
    for i, (size, gap) in enumerate(zip(sizes, gaps, strict=True)):
        at += gap if i else 0
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, size - 1)), max_size=3)) if size > 1 else set()))
        starts = (0, *cuts, size)
        committed = draw(st.one_of(st.just(size), st.integers(0, size)))
        state = draw(st.sampled_from(["open"] * 6 + ["closing", "opening", "forked"]))
        out.append(FakeRegion(at, size, starts, committed, state))
        at += size
    return out


@st.composite
def spans_near(draw: st.DrawFn, regions: Sequence[FakeRegion], top: int = TOP) -> tuple[int, int]:
    """An address at or near an edge of a region (or anywhere) and a size, both below ``top``."""
    region = draw(st.sampled_from(regions))
    edges = [region.base, region.base + region.size, *(region.base + s for s in region.starts)]
    edges.append(region.base + region.committed)
    where = draw(st.one_of(st.sampled_from(edges), st.integers(0, TOP - 1)))
    addr = where + draw(st.sampled_from([-3, -2, -1, 0, 0, 0, 1, 2, 3]))
    addr = min(max(addr, 0), TOP - 1)
    targets = [e - addr for e in edges if e > addr]
    n = draw(
        st.one_of(
            st.sampled_from(targets) if targets else st.just(1),
            st.integers(1, 8),
            st.integers(1, 1 << 41),
            st.just(top - 1 - addr if top - 1 > addr else 1),
            st.just(top - 1),
        )
    )
    n += draw(st.sampled_from([-1, 0, 0, 1]))
    return addr, min(max(n, 1), top - 1)


def _check_against_reference(
    regions: Sequence[FakeRegion], sides: list[list[int]], sizes: list[int], known_only: bool
) -> None:
    models = [model_of(r) for r in regions]
    expect = reference(models, sides, sizes, known_only=known_only)
    with only_regions(*regions):
        arrays = [np.array(side, dtype=np.uint64) for side in sides]
        if isinstance(expect, list):
            with pytest.raises(CopyPlanError) as caught:
                registrations(arrays, np.array(sizes, dtype=np.uint64), known_only=known_only)
            assert names_a_problem(str(caught.value), expect, []), (str(caught.value), expect)
            return
        ids, owners = registrations(arrays, np.array(sizes, dtype=np.uint64), known_only=known_only)
    assert [i.tolist() for i in ids] == expect[0]
    assert owners == expect[1]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), regions=fake_layouts(), known_only=st.booleans())
def test_locate_agrees_with_the_scalar_reference(
    data: st.DataObject, regions: list[FakeRegion], known_only: bool
) -> None:
    spans = data.draw(st.lists(spans_near(regions), min_size=1, max_size=6))
    _check_against_reference(regions, [[a for a, _ in spans]], [n for _, n in spans], known_only)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), regions=fake_layouts())
def test_two_sides_share_dense_ids_and_owners(data: st.DataObject, regions: list[FakeRegion]) -> None:
    spans = data.draw(st.lists(spans_near(regions), min_size=1, max_size=5))
    others = data.draw(st.lists(spans_near(regions), min_size=len(spans), max_size=len(spans)))
    sizes = [min(n, m) for (_, n), (_, m) in zip(spans, others, strict=True)]
    _check_against_reference(regions, [[a for a, _ in spans], [a for a, _ in others]], sizes, False)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), regions=fake_layouts())
def test_sizes_up_to_2_64_do_not_wrap(data: st.DataObject, regions: list[FakeRegion]) -> None:
    """``registrations`` takes uint64 sizes: no ``addr + nbytes`` may wrap round to a small end."""
    spans = data.draw(st.lists(spans_near(regions, top=1 << 64), min_size=1, max_size=4))
    _check_against_reference(regions, [[a for a, _ in spans]], [n for _, n in spans], False)


def test_edges_of_one_region_one_byte_at_a_time() -> None:
    """First byte, last byte, one past the end, one before the start; spans to each edge and one past."""
    base, size = 1 << 40, 4 * 4096
    region = FakeRegion(base, size, (0, 4096, 2 * 4096, size), size)
    cases = {
        (base, 1): [0],
        (base + size - 1, 1): [0],
        (base + size, 1): [-1],
        (base - 1, 1): [-1],
        (base - 1, 2): "runs into",
        (base, size): "two registrations",
        (base, 4096): [0],
        (base + 3 * 4096, 4096): [0],
        (base + 3 * 4096, 4097): "leaves",
        (base - 4096, 4096): [-1],
        (base - 4096, 4097): "runs into",
        (base - 1, size + 2): "runs into",  # over the whole region, from below to above
        (0, TOP - 1): "runs into",
        (base + size, TOP - 1 - base - size): [-1],
    }
    with only_regions(region):
        for (addr, n), want in cases.items():
            if isinstance(want, list):
                (ids,), _ = registrations([np.array([addr], np.uint64)], n, known_only=False)
                assert ids.tolist() == want, (addr - base, n)
            else:
                with pytest.raises(CopyPlanError, match=want):
                    registrations([np.array([addr], np.uint64)], n, known_only=False)
        # Together: ids by registration (units 0, 2, 2, 0 here), dense in order of appearance.
        addrs = np.array([base + size - 1, base, base + 3 * 4096, base + 4096, base - 1], np.uint64)
        (ids,), owners = registrations([addrs], 1, known_only=False)
        assert ids.tolist() == [0, 1, 0, 2, -1] and owners == [region]


def test_dense_ids_over_many_regions_and_units() -> None:
    """Ids number (region, registration) pairs, never one alone: region 0's unit 2 and region 1's
    unit 0 (or any other pair that a packed key could fold) keep their own ids."""
    rng = np.random.default_rng(8)
    regions = []
    for i in range(6):
        units = int(rng.integers(1, 70))
        regions.append(
            FakeRegion((1 << 32) * (i + 1), units * 4096, tuple(range(0, units * 4096 + 1, 4096)), units * 4096)
        )
    for _ in range(50):
        spans = []
        for _ in range(int(rng.integers(1, 400))):
            r = regions[int(rng.integers(len(regions)))]
            spans.append(r.base + int(rng.integers(0, r.size // 64)) * 64)
        _check_against_reference(regions, [spans], [64] * len(spans), True)
        half = len(spans) // 2
        _check_against_reference(regions, [spans[:half], spans[half : 2 * half]], [64] * half, True)


def test_a_span_over_a_whole_region_between_two_others_is_refused() -> None:
    low = FakeRegion(1 << 30, 4096, (0, 4096), 4096)
    mid = FakeRegion((1 << 30) + 3 * 4096, 4096, (0, 4096), 4096)
    high = FakeRegion((1 << 30) + 6 * 4096, 4096, (0, 4096), 4096)
    with only_regions(low, mid, high):
        # Starts in the gap after ``low``, ends in the gap before ``high``: it covers ``mid``.
        with pytest.raises(CopyPlanError, match=f"runs into {mid.region_name}"):
            registrations([np.array([(1 << 30) + 2 * 4096], np.uint64)], 3 * 4096, known_only=False)
        (ids,), _ = registrations([np.array([(1 << 30) + 2 * 4096], np.uint64)], 4096, known_only=False)
        assert ids.tolist() == [-1]
    assert not mid.asked


def test_adjacent_regions_keep_their_own_ids() -> None:
    a = FakeRegion(1 << 20, 8192, (0, 4096, 8192), 8192)
    b = FakeRegion((1 << 20) + 8192, 8192, (0, 8192), 8192)
    with only_regions(b, a):  # registered out of address order
        (ids,), owners = registrations(
            [np.array([b.base, a.base + 4096, a.base, b.base + 4096], np.uint64)], 4096, known_only=True
        )
        assert ids.tolist() == [0, 1, 2, 0] and owners == [b, a]
        with pytest.raises(CopyPlanError, match=f"leaves {a.region_name}"):
            registrations([np.array([a.base + 4096], np.uint64)], 4097, known_only=True)
        # Contiguous on both sides across the boundary of a and b: never merged.
        (dst_ids, src_ids), _ = registrations(
            [np.array([a.base + 4096, b.base], np.uint64), np.array([a.base + 4096, b.base], np.uint64)],
            4096,
            known_only=True,
        )
    merged = plan([a.base + 4096, b.base], [a.base + 4096, b.base], 4096, dst_reg=dst_ids, src_reg=src_ids)
    assert merged.count == 2


def test_empty_and_single_requests() -> None:
    region = FakeRegion(1 << 20, 4096, (0, 4096), 4096)
    with only_regions(region):
        ids, owners = registrations([np.zeros(0, np.uint64)], 4096, known_only=True)
        assert [i.tolist() for i in ids] == [[]] and owners == []
        ids, owners = registrations([np.zeros(0, np.uint64), np.zeros(0, np.uint64)], 1, known_only=False)
        assert [i.tolist() for i in ids] == [[], []] and owners == []
        ids, owners = registrations([np.array([region.base], np.int64)], np.int64(4096), known_only=True)
        assert [i.tolist() for i in ids] == [[0]] and owners == [region]
    with only_regions():  # no region at all
        ids, owners = registrations([np.array([1 << 20], np.uint64)], 4096, known_only=False)
        assert [i.tolist() for i in ids] == [[-1]] and owners == []
        with pytest.raises(CopyPlanError, match="no open HostTier"):
            registrations([np.array([1 << 20], np.uint64)], 4096, known_only=True)


# -- plan and check_disjoint against brute force ---------------------------------------------------


@st.composite
def copy_runs(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    """Runs of copies contiguous on both sides (what the planner merges), often across a
    16-byte boundary (a registration here), in a shuffled order."""
    rows = []
    for _ in range(draw(st.integers(1, 5))):
        d, s = draw(st.integers(0, 80)), draw(st.integers(0, 80))
        for z in draw(st.lists(st.integers(1, 7), min_size=1, max_size=6)):
            rows.append((d, s, z))
            d, s = d + z, s + z
    return draw(st.permutations(rows))


# Two copies start at one address pair with different sizes (found by the test below).
SHARED_START = [(0, 65, 1), (24, 64, 1), (24, 64, 2), (26, 66, 1), (8, 48, 1), (9, 49, 1), (10, 50, 7)]
SHARED_START += [(17, 57, 7), (25, 65, 1)]


@settings(max_examples=400, deadline=None)
@given(
    rows=copy_runs(),
    order_by=st.sampled_from(["src", "dst"]),
    callable_reg=st.booleans(),
    one_size=st.booleans(),
)
@example(
    rows=SHARED_START,
    order_by="src",
    callable_reg=False,
    one_size=False,
)
def test_plan_merges_only_what_is_contiguous_within_one_registration(
    rows: list[tuple[int, int, int]], order_by: str, callable_reg: bool, one_size: bool
) -> None:
    """Whatever the (unstable) sort did, the plan moves exactly the requested bytes, and a descriptor
    is a run contiguous on both sides with one registration per side (address // 16 here), the ids
    given as arrays in request order or as a function of sorted addresses."""
    dsts = [r[0] for r in rows]
    srcs = [r[1] for r in rows]
    sizes = [rows[0][2] if one_size else r[2] for r in rows]
    dst_ids = np.array([d // 16 for d in dsts], np.int64)
    src_ids = np.array([s // 16 for s in srcs], np.int64)
    if callable_reg:
        p = plan(
            dsts,
            srcs,
            sizes[0] if one_size else sizes,
            dst_reg=lambda a: (a // np.uint64(16)).astype(np.int64),
            src_reg=lambda a: (a // np.uint64(16)).astype(np.int64),
            order_by=order_by,
            n=len(rows),
        )
    else:
        p = plan(dsts, srcs, sizes, dst_reg=dst_ids, src_reg=src_ids, order_by=order_by)
    assert p.requested == len(rows) and p.nbytes == sum(sizes)
    requested = sorted(zip(dsts, srcs, sizes, dst_ids.tolist(), src_ids.tolist(), strict=True))

    def chains(d: int, s: int, z: int, left: list[Any], ids: tuple[int, int] | None) -> Iterator[list[Any]]:
        """Each way to take from ``left`` a chain of requested copies tiling ``[d, d+z)`` and
        ``[s, s+z)``, each in the registrations (``ids``) of the one before: what is left after it."""
        if z == 0:
            yield left
            return
        for i, r in enumerate(left):
            if r[0] == d and r[1] == s and r[2] <= z and ids in (None, r[3:]):
                yield from chains(d + r[2], s + r[2], z - r[2], left[:i] + left[i + 1 :], r[3:])

    def tiles(descriptors: list[tuple[int, int, int]], left: list[Any]) -> bool:
        """Whether the descriptors are chains that use every requested copy exactly once (copies that
        share a start but differ in size make a greedy match pick the wrong one, hence the search)."""
        if not descriptors:
            return left == []
        (d, s, z), rest = descriptors[0], descriptors[1:]
        return any(tiles(rest, after) for after in chains(d, s, z, left, None))

    descriptors = list(zip(p.dsts.tolist(), p.srcs.tolist(), p.sizes.tolist(), strict=True))
    assert tiles(descriptors, requested), ("the descriptors are not chains of the requested copies", descriptors)
    lead = (p.srcs if order_by == "src" else p.dsts).tolist()
    assert lead == sorted(lead)


@st.composite
def destination_spans(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """Spans that touch, overlap by a byte or leave a byte between, up to 2**63; in order or not."""
    size = draw(st.one_of(st.integers(1, 16), st.integers(1, TOP // 16)))
    at = draw(st.one_of(st.just(0), st.integers(0, TOP - 1), st.just(TOP - 9 * size)))
    starts, sizes = [], []
    for _ in range(draw(st.integers(1, 8))):
        n = size if draw(st.booleans()) else draw(st.integers(1, size))
        at = min(max(at, 0), TOP - n)
        starts.append(at)
        sizes.append(n)
        at += n + draw(st.sampled_from([-2, -1, 0, 0, 0, 1, 2]))
    order = draw(st.one_of(st.just(list(range(len(starts)))), st.permutations(range(len(starts)))))
    return [starts[i] for i in order], [sizes[i] for i in order]


@given(spans=destination_spans(), one_size=st.booleans())
def test_check_disjoint_at_touching_spans_up_to_2_63(spans: tuple[list[int], list[int]], one_size: bool) -> None:
    starts, sizes = spans
    if one_size:
        sizes = [min(sizes)] * len(starts)
    pairs = [(a, a + n) for a, n in zip(starts, sizes, strict=True)]
    overlap = any(max(a1, a2) < min(e1, e2) for i, (a1, e1) in enumerate(pairs) for (a2, e2) in pairs[i + 1 :])
    z: Any = sizes[0] if one_size else np.array(sizes, np.int64)
    if overlap:
        with pytest.raises(CopyPlanError, match="overlapping"):
            check_disjoint(np.array(starts, np.int64), z)
    else:
        check_disjoint(np.array(starts, np.int64), z)


# -- real tiers and staging buffers: bytes copied, or nothing changed --------------------------------


def _readable(models: Sequence[Model], addr: int, n: int) -> list[tuple[int, int]]:
    """The parts of ``[addr, addr+n)`` in committed memory of an open region (safe to read)."""
    out = []
    for m in models:
        lo, hi = max(addr, m.base), min(addr + n, m.base + min(m.committed, m.size))
        if lo < hi and m.state == "open":
            out.append((lo, hi))
    return out


def _snapshot(models: Sequence[Model], spans: Sequence[tuple[int, int]]) -> list[list[bytes]]:
    """Per span, the bytes of its readable parts."""
    return [[ctypes.string_at(lo, hi - lo) for lo, hi in _readable(models, a, n)] for a, n in spans]


def _fill(region: Any, seed: int) -> None:
    base, _ = region.region_bounds()
    n = model_of(region).committed
    ctypes.memmove(base, np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes(), n)


def _random_span(rng: np.random.Generator, models: Sequence[Model]) -> tuple[int, int]:
    m = models[int(rng.integers(len(models)))]
    edges = [m.base, m.base + m.size, m.base + m.committed, *(m.base + s for s in m.starts)]
    mode = int(rng.integers(8))
    if mode >= 3:  # inside the committed range, within one registration: the likely-good case
        offset = int(rng.integers(0, max(1, m.committed)))
        unit = bisect.bisect_right(m.starts, offset) - 1
        room = min(m.starts[unit + 1], m.committed) - offset
        return m.base + offset, int(rng.integers(1, max(2, min(room, 3 * SLOT) + 1)))
    addr = edges[int(rng.integers(len(edges)))] + int(rng.choice([-SLOT, -4096, -2, -1, 0, 0, 1, 4096, SLOT]))
    if mode == 1:  # up to an edge, or one past it
        targets = [e - addr for e in edges if e > addr]
        n = int(rng.choice(targets)) + int(rng.choice([-1, 0, 0, 1])) if targets else 1
    elif mode == 0:
        n = int(rng.choice([1, 7, 4096, SLOT - 1, SLOT, SLOT + 1, MiB, 4 * MiB, 16 * MiB + 1]))
    else:
        n = int(rng.choice([1 << 40, (1 << 62) + 1, TOP - 1 - addr, TOP - 1]))
    return max(addr, 0), max(1, min(n, TOP - 1))


async def _attack(engine: CopyEngine, rng: np.random.Generator, rounds: int) -> tuple[int, int]:
    """Random raw requests against every known region; returns (accepted, refused)."""
    accepted = refused = 0
    for _ in range(rounds):
        models = known_models()
        copies = []
        for _ in range(int(rng.choice([1, 1, 2, 3]))):
            (d, n), (s, m) = _random_span(rng, models), _random_span(rng, models)
            copies.append((d, s, min(n, m) if rng.integers(2) else n))
        problems = []
        dsts = sorted((d, d + n) for d, _, n in copies)
        for (a1, e1), (a2, _) in itertools.pairwise(dsts):
            if a2 < e1:
                problems.append(Problem("overlapping", a1, e1 - a1))
        expect = reference(
            models, [[c[0] for c in copies], [c[1] for c in copies]], [c[2] for c in copies], known_only=True
        )
        if isinstance(expect, list):
            problems += expect
        before = engine.statistics().jobs_submitted
        # Each destination and the byte on either side of it.
        watched = (
            [(d, n) for d, _, n in copies] + [(d - 1, 1) for d, _, _ in copies] + [(d + n, 1) for d, _, n in copies]
        )
        old = _snapshot(models, watched)
        if problems:
            with pytest.raises(CopyPlanError) as caught:
                await engine.copy(copies)
            message = str(caught.value)
            assert "overlapping" in message or names_a_problem(message, problems, [m.base for m in models]), (
                message,
                problems,
            )
            assert engine.statistics().jobs_submitted == before and _snapshot(models, watched) == old
            refused += 1
            continue
        if any(max(d, s) < min(d + n, s + m) for d, _, n in copies for _, s, m in copies):
            continue  # a copy reading what another writes: no promised order, nothing to compare
        sources = [ctypes.string_at(s, n) for _, s, n in copies]
        await engine.copy(copies)
        assert [ctypes.string_at(d, n) for d, _, n in copies] == sources
        written = [(d, d + n) for d, _, n in copies]
        for (addr, _), was, now in zip(
            watched[len(copies) :], old[len(copies) :], _snapshot(models, watched[len(copies) :]), strict=True
        ):
            if not any(lo <= addr < hi for lo, hi in written):
                assert was == now, hex(addr)
        accepted += 1
    return accepted, refused


def _ramp_config() -> Any:
    """Ramp units (4, 4, 8 MiB) before 16 MiB units; the quota ends inside a unit."""
    return small_config(quota=40 * MiB, max_quota=64 * MiB, commit_unit=16 * MiB, fill_chunk=4 * MiB)


async def test_raw_copies_between_tiers_and_staging_agree_with_the_reference() -> None:
    async with (
        HostTier(small_config()) as a,
        HostTier(_ramp_config()) as b,
        StaticHostMem(3 * SLOT + 4096) as small,
        StaticHostMem(2 * MiB) as stage,
        CopyEngine(None) as engine,
    ):
        await a.wait_resident()
        await b.wait_resident()
        stats = b.statistics()
        ramp = UnitLayout.build(b.region_bounds()[1], stats.slot_size, stats.commit_unit).ramp
        assert ramp == (0, 4 * MiB, 8 * MiB, 16 * MiB)
        for seed, region in enumerate((a, b, small, stage)):
            _fill(region, seed)
        accepted, refused = await _attack(engine, np.random.default_rng(11), 400)
        assert accepted > 40 and refused > 40, (accepted, refused)


async def test_a_partly_resident_tier_takes_copies_below_its_watermark_only(gate: PopulateGate) -> None:
    gate.allow(1)  # the staging buffer's one populate call, then three of the tier's 1 MiB units
    async with StaticHostMem(4 * MiB) as stage:
        gate.allow(4)
        async with HostTier(small_config()) as tier, CopyEngine(None) as engine:
            await tier.wait_resident(3 * MiB)
            assert tier.statistics().resident_bytes == 3 * MiB
            base = tier.statistics().base_address
            _fill(tier, 1)
            _fill(stage, 2)
            ok = [(stage.address, base + 3 * MiB - SLOT, SLOT), (base + MiB, stage.address + MiB, MiB)]
            await engine.copy(ok)
            assert ctypes.string_at(stage.address, SLOT) == ctypes.string_at(base + 3 * MiB - SLOT, SLOT)
            for bad in (
                (stage.address, base + 3 * MiB - SLOT, SLOT + 1),
                (stage.address, base + 3 * MiB, 1),
                (base + 3 * MiB - 1, stage.address, 2),
                (base + 3 * MiB, stage.address, SLOT),
            ):
                with pytest.raises(CopyPlanError, match=r"committed|two registrations"):
                    await engine.copy([bad])
            assert engine.statistics().jobs_submitted == 1
            accepted, refused = await _attack(engine, np.random.default_rng(12), 150)
            assert accepted > 10 and refused > 10, (accepted, refused)
            gate.release_all()
            await tier.wait_resident()
            await engine.copy([(stage.address, base + 3 * MiB, SLOT)])  # resident now


async def test_a_resized_tier_is_located_afresh() -> None:
    async with (
        HostTier(small_config(quota=8 * MiB)) as tier,
        StaticHostMem(MiB) as stage,
        CopyEngine(None) as engine,
    ):
        await tier.wait_resident()
        base = tier.statistics().base_address
        inside, past = (stage.address, base + 8 * MiB - SLOT, SLOT), (stage.address, base + 8 * MiB, SLOT)
        await engine.copy([inside])
        with pytest.raises(CopyPlanError, match="committed"):
            await engine.copy([past])
        await tier.resize(16 * MiB)
        await tier.wait_resident()
        await engine.copy([past])
        assert ctypes.string_at(stage.address, SLOT) == ctypes.string_at(base + 8 * MiB, SLOT)
        await tier.resize(4 * MiB)
        for bad in (inside, past, (stage.address, base + 4 * MiB, 1), (base + 4 * MiB - 1, stage.address, 2)):
            with pytest.raises(CopyPlanError, match=r"committed|two registrations"):
                await engine.copy([bad])
        await engine.copy([(stage.address, base + 4 * MiB - SLOT, SLOT)])
        accepted, refused = await _attack(engine, np.random.default_rng(13), 100)
        assert accepted > 10 and refused > 10, (accepted, refused)


async def test_a_closing_tier_refuses_copies_over_it() -> None:
    async with StaticHostMem(MiB) as stage, CopyEngine(None) as engine:
        tier = await HostTier.open(small_config())
        await tier.wait_resident()
        base = tier.statistics().base_address
        slot = await tier.allocate()
        held, closing = await closing_with_a_copy_held(tier)
        before = engine.statistics().jobs_submitted
        for copy in ((stage.address, base, SLOT), (base, stage.address, SLOT), (base - 1, base + SLOT, 2)):
            with pytest.raises(CopyPlanError, match=r"is closing|runs into"):
                await engine.copy([copy])
        with pytest.raises(TierClosedError, match="closing"):
            await engine.to_device(tier, [slot], [stage.address])
        assert engine.statistics().jobs_submitted == before and not closing.done()
        held.set()
        await closing
        with pytest.raises(CopyPlanError, match="no open HostTier"):
            await engine.copy([(stage.address, base, SLOT)])


async def test_slot_copies_to_addresses_at_region_edges() -> None:
    async with (
        HostTier(_ramp_config()) as tier,
        StaticHostMem(4 * SLOT) as stage,
        CopyEngine(None) as engine,
    ):
        await tier.wait_resident()
        ids = await tier.allocate(4)
        _fill(tier, 3)
        _fill(stage, 4)
        a = stage.address
        # The last page of the buffer, and pages shorter than a slot ending on its last byte.
        await engine.to_device(tier, ids[:1], [a + 3 * SLOT])
        assert ctypes.string_at(a + 3 * SLOT, SLOT) == bytes(tier.view(ids[0]))
        await engine.to_device(tier, ids[1:3], [a + 4 * SLOT - 2 * 4096, a + 4 * SLOT - 4096], page=4096)
        assert ctypes.string_at(a + 4 * SLOT - 4096, 4096) == bytes(tier.view(ids[2]))[:4096]
        await engine.to_host(tier, ids[3:], [a], page=SLOT)
        assert bytes(tier.view(ids[3])) == ctypes.string_at(a, SLOT)
        stats = engine.statistics()
        for addrs, page, what in (
            ([a + 3 * SLOT + 1], None, "leaves"),
            ([a + 4 * SLOT], None, "no open"),  # one past the end
            ([a - 1], 2, r"runs into|no open"),
            ([a - SLOT], None, "no open"),
            ([a - 4096], SLOT, r"runs into|no open"),
        ):
            for method in (engine.to_device, engine.to_host):
                with pytest.raises(CopyPlanError, match=what):
                    await method(tier, ids[:1], addrs, page=page)
        assert engine.statistics().jobs_submitted == stats.jobs_submitted


@pytest.mark.parametrize("page", [SLOT + 1, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 4096, 1 << 64, 1 << 70])
async def test_a_page_larger_than_a_slot_is_refused_before_any_lookup(page: int) -> None:
    """Refused for what it is, with any form of the other side (2**64 and more raised OverflowError)."""
    async with HostTier(small_config()) as tier, StaticHostMem(4 * SLOT) as stage, CopyEngine(None) as engine:
        await tier.wait_resident()
        ids = await tier.allocate(2)
        for method in (engine.to_device, engine.to_host):
            with pytest.raises(CopyPlanError, match="does not fit"):
                await method(tier, ids[:1], [stage.address], page=page)
            with pytest.raises(CopyPlanError, match="does not fit"):
                await method(tier, ids[:1], [tier.address(ids[1])], page=page)
            with pytest.raises(CopyPlanError, match="does not fit"):  # an array's row is its page: page= is wrong
                await method(tier, ids[:1], np.zeros((1, SLOT), np.uint8), page=page)
        assert engine.statistics().jobs_submitted == 0


async def test_a_device_engine_refuses_a_host_span_over_a_whole_region() -> None:
    """Unknown addresses pass through to the driver, but not a span that covers a known region."""
    async with StaticHostMem(4 * SLOT) as stage:
        below = stage.address - SLOT
        (ids,), _ = registrations([[below]], SLOT, known_only=False)
        assert ids.tolist() == [-1]
        for n in (SLOT + 1, 5 * SLOT, 6 * SLOT, (1 << 63) - 1 - below):
            with pytest.raises(CopyPlanError, match="runs into StaticHostMem"):
                registrations([[below]], n, known_only=False)
            with pytest.raises(CopyPlanError, match="runs into StaticHostMem"):
                registrations([[0x7F00_0000_0000, below]], np.array([1, n]), known_only=False)


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # 1 MiB units, no ramp
        {"quota": 40 * MiB, "max_quota": 64 * MiB, "commit_unit": 16 * MiB, "fill_chunk": 4 * MiB},  # ramp, then units
        {"quota": 6 * MiB, "max_quota": 6 * MiB, "commit_unit": 16 * MiB},  # ends in the ramp
        {"quota": 3 * 192 * KiB, "max_quota": 5 * 192 * KiB, "slot_size": 192 * KiB, "commit_unit": 384 * KiB},
    ],
)
async def test_tier_registrations_of_agrees_span_by_span(overrides: dict[str, Any], gate: PopulateGate) -> None:
    """Thousands of spans at unit edges, the quota and the watermark, asked one at a time and all at once."""
    gate.allow(1)  # a partly resident tier first, then the whole of it
    async with HostTier(small_config(**overrides)) as tier:
        target = tier.statistics().target_bytes
        for phase in ("partial", "resident"):
            if phase == "resident":
                gate.release_all()
                await tier.wait_resident()
            else:  # the second populate call waits at the gate (if any): the watermark stands still
                await eventually(lambda: gate.calls == 2 or tier.statistics().resident_bytes == target)
            m = model_of(tier)
            assert 0 < m.committed <= m.size
            rng = np.random.default_rng(len(m.starts))
            edges = sorted({*m.starts, m.committed, m.size, tier.statistics().quota})
            offsets, sizes = [], []
            for _ in range(3000):
                offset = int(rng.choice(edges)) + int(rng.choice([-4097, -4096, -2, -1, 0, 1, 4096]))
                offset = min(max(offset, 0), m.size - 1)
                targets = [e - offset for e in edges if e > offset]
                n = (
                    int(rng.choice(targets)) + int(rng.choice([-1, 0, 1]))
                    if rng.integers(2)
                    else int(rng.integers(1, MiB))
                )
                if rng.integers(3) == 0:  # inside the committed range, up to the end of its unit or past it
                    offset = int(rng.integers(0, m.committed))
                    unit = bisect.bisect_right(m.starts, offset) - 1
                    n = min(m.starts[unit + 1], m.committed) - offset + int(rng.choice([-1, 0, 0, 1]))
                offsets.append(offset)
                sizes.append(min(max(n, 1), m.size - offset))
            good: list[tuple[int, int, int]] = []
            for offset, n in zip(offsets, sizes, strict=True):
                hit = check_span([m], m.base + offset, n)
                arrays = np.array([offset], np.uint64), np.array([n], np.uint64)
                if isinstance(hit, Problem):
                    with pytest.raises(CopyPlanError, match=hit.kind):
                        tier.registrations_of(*arrays)
                else:
                    assert hit is not None
                    assert tier.registrations_of(*arrays).tolist() == [hit[1]]
                    good.append((offset, n, hit[1]))
            assert 100 < len(good) < len(offsets)
            units = tier.registrations_of(
                np.array([g[0] for g in good], np.uint64), np.array([g[1] for g in good], np.uint64)
            )
            assert units.tolist() == [g[2] for g in good]


async def test_slot_copies_with_addresses_in_several_regions_agree_with_the_reference() -> None:
    async with (
        HostTier(small_config()) as tier,
        HostTier(_ramp_config()) as other,
        StaticHostMem(64 * 4096 + 4096) as stage,
        CopyEngine(None) as engine,
    ):
        await tier.wait_resident()
        await other.wait_resident()
        ids = await tier.allocate(48)
        for seed, region in enumerate((tier, other, stage)):
            _fill(region, 20 + seed)
        rng = np.random.default_rng(21)
        accepted = refused = 0
        for _ in range(200):
            models = known_models()
            n = int(rng.integers(1, 9))
            slots = [ids[int(i)] for i in rng.choice(len(ids), n, replace=bool(rng.integers(2)))]
            page = int(rng.choice([4096, 4095, SLOT, 3 * 4096 + 1]))
            direction = "h2d" if rng.integers(2) else "d2h"
            addrs = []
            for _ in range(n):
                m = models[int(rng.integers(len(models)))]
                pages = max(1, min(m.committed, m.size) // page)
                addr = m.base + int(rng.integers(0, pages)) * page
                if rng.integers(6) == 0:
                    addr = int(rng.choice([m.base - page, m.base + m.committed - page + 1, m.base + m.size]))
                addrs.append(addr)
            problems: list[Problem] = []
            sides = [addrs]
            expect = reference(models, sides, [page] * n, known_only=True)
            if isinstance(expect, list):
                problems += expect
            spans = sorted((a, a + page) for a in addrs)
            if direction == "h2d" and any(b < e for (_, e), (b, _) in itertools.pairwise(spans)):
                problems.append(Problem("overlapping", 0, 0))
            if direction == "d2h" and len(set(slots)) < n:
                problems.append(Problem("twice", 0, 0))
            method = engine.to_device if direction == "h2d" else engine.to_host
            before = engine.statistics().jobs_submitted
            if problems:
                with pytest.raises((CopyPlanError, SlotError)) as caught:
                    await method(tier, slots, addrs, page=page)
                message = str(caught.value)
                assert any(p.kind in message for p in problems), (message, problems)
                assert engine.statistics().jobs_submitted == before
                refused += 1
                continue
            slot_spans = [(tier.address(s), tier.address(s) + page) for s in slots]
            if any(max(a, lo) < min(a + page, hi) for a in addrs for lo, hi in slot_spans):
                continue  # the other side overlaps a slot of the request: no promised order
            _, owners = plan_slots(tier, slots, addrs, direction, page, host_only=engine.device is None)
            assert owners == [tier, *(o for o in expect[1] if o is not tier)]
            if direction == "h2d":
                want = [ctypes.string_at(tier.address(s), page) for s in slots]
                await method(tier, slots, addrs, page=page)
                assert [ctypes.string_at(a, page) for a in addrs] == want
            else:
                want = {s: ctypes.string_at(a, page) for s, a in zip(slots, addrs, strict=True)}
                await method(tier, slots, addrs, page=page)
                assert {s: ctypes.string_at(tier.address(s), page) for s in slots} == want
            accepted += 1
        assert accepted > 40 and refused > 40, (accepted, refused)


async def test_addresses_and_sizes_near_2_63() -> None:
    async with HostTier(small_config()) as tier, StaticHostMem(4 * SLOT) as stage, CopyEngine(None) as engine:
        await tier.wait_resident()
        src = tier.address(await tier.allocate())
        top = TOP - 1
        for copies, error, what in (
            ([(top, src, 1)], CopyPlanError, "no open HostTier"),
            ([(stage.address, top, 1)], CopyPlanError, "no open HostTier"),
            ([(stage.address, src, top)], CopyPlanError, "leaves"),
            ([(stage.address, src, top - stage.address)], CopyPlanError, "leaves"),
            ([(stage.address - 1, src, top)], CopyPlanError, "runs into"),
            ([(0, src, top)], CopyPlanError, "runs into"),
            (np.array([[stage.address, src, top]], np.uint64), CopyPlanError, "leaves"),
            (np.array([[stage.address, src, TOP]], np.uint64), ValueError, "63 bits"),
            (np.array([[stage.address, src, 2**64 - 1]], np.uint64), ValueError, "63 bits"),
            ([(stage.address, src, TOP)], ValueError, "63 bits"),
            ([(stage.address, src, -1)], ValueError, "non-negative"),
            (np.array([[stage.address, src, -SLOT]], np.int64), ValueError, "non-negative"),
        ):
            with pytest.raises(error, match=what):
                await engine.copy(copies)
        for addrs, error, what in (
            ([top], CopyPlanError, "no open HostTier"),
            (np.array([top], np.uint64), CopyPlanError, "no open HostTier"),
            (np.array([TOP], np.uint64), ValueError, "63 bits"),
            ([TOP], ValueError, "63 bits"),
            (np.array([-1], np.int64), ValueError, "negative"),
        ):
            with pytest.raises(error, match=what):
                await engine.to_device(tier, [0], addrs)
        assert engine.statistics().jobs_submitted == 0 and not any(stage.view())
        await engine.copy(np.array([[stage.address, src, SLOT]], np.uint64))
        await engine.to_host(tier, [0], np.array([stage.address + SLOT], np.uint64))
        assert engine.statistics().jobs_submitted == 2


async def test_a_device_engine_tracks_and_checks_host_addresses_given_per_slot() -> None:
    """Per-slot addresses in a staging buffer or tier make it an owner (its close waits for the DMA)
    and are checked as a raw copy's are, also when the engine has a device."""
    async with HostTier(small_config()) as tier, StaticHostMem(4 * SLOT) as stage:
        await tier.wait_resident()
        a = stage.address
        side = buffer_addresses([a + SLOT, 0x7F00_0000_0000, a], 3, SLOT, writable=True, host_only=False)
        assert side.regions == (stage,) and side.addresses.tolist() == [a + SLOT, 0x7F00_0000_0000, a]
        side = buffer_addresses([tier.address(await tier.allocate()), a], 2, 4096, writable=False, host_only=False)
        assert side.regions == (tier, stage)
        base = tier.statistics().base_address
        for addrs, what in (
            ([a + 3 * SLOT + 1], "leaves"),
            ([a - 1], "runs into"),
            ([base + MiB - 1], "two registrations"),
            ([base + 64 * MiB], "committed"),
        ):
            with pytest.raises(CopyPlanError, match=what):
                buffer_addresses(addrs, 1, SLOT, writable=True, host_only=False)


@pytest.mark.cuda
@pytest.mark.parametrize("backing", ["register", "vmm"])
async def test_a_device_engine_waits_for_a_staging_buffer_named_by_address(backing: str) -> None:
    """Slots to and from pinned staging by address, through the DMA engines: the buffer is an owner,
    a page leaving it is refused, the bytes land."""
    slot, unit = 256 * KiB, 32 * MiB
    config = small_config(
        quota=64 * MiB,
        max_quota=128 * MiB,
        slot_size=slot,
        commit_unit=unit,
        fill_chunk=unit,
        device=0,
        backing=backing,
    )
    async with HostTier(config) as tier, StaticHostMem(4 * slot, device=0) as stage, CopyEngine(0) as engine:
        await tier.wait_resident()
        ids = await tier.allocate(4)
        ctypes.memmove(stage.address, np.random.default_rng(7).bytes(4 * slot), 4 * slot)
        a = stage.address
        addrs = [a + 3 * slot, a + slot, a, a + 2 * slot]
        _, owners = plan_slots(tier, ids, addrs, "d2h", None, host_only=engine.device is None)
        assert owners == [tier, stage]
        await engine.to_host(tier, ids, addrs)
        assert [bytes(tier.view(s)) for s in ids] == [ctypes.string_at(x, slot) for x in addrs]
        ctypes.memset(a, 0, 4 * slot)
        tracked = len(stage.copies)
        started = engine.begin(tier, ids, addrs, "h2d")
        assert len(stage.copies) == tracked + 1  # tracked (its event is set once the bytes land)
        await started.done
        assert len(stage.copies) == 0
        assert [ctypes.string_at(x, slot) for x in addrs] == [bytes(tier.view(s)) for s in ids]
        before = engine.statistics().jobs_submitted
        for bad, what in (([a + 3 * slot + 1], "leaves"), ([a - 1], "runs into")):
            for direction in ("h2d", "d2h"):
                with pytest.raises(CopyPlanError, match=what):
                    engine.begin(tier, ids[:1], bad, direction)
        assert engine.statistics().jobs_submitted == before


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=40),
    ties=st.integers(0, 5),
    narrow=st.booleans(),
)
def test_sorted_order_is_a_stable_sort(values: list[int], ties: int, narrow: bool) -> None:
    """The planner's sort: a permutation that sorts, ties in position order, the sorted values
    read back exactly, whatever the span (up to 2**64 - 1)."""
    from aiokvtier._copy._plan import _sorted_order

    if narrow:
        values = [v % (1 << 40) for v in values]
    values += values[:ties]
    lead = np.array(values, dtype=np.uint64)
    order, ordered, _ = _sorted_order(lead)
    assert ordered.tolist() == sorted(values) == lead[order].tolist()
    assert order.tolist() == np.argsort(lead, kind="stable").tolist()


# -- the planner's fast paths against the plain algorithm ------------------------------------------


def plain_plan(
    dsts: list[int], srcs: list[int], sizes: list[int], reg: Any, order_by: str, kind: Literal["quicksort", "stable"]
) -> tuple[list[int], list[int], list[int]]:
    """The planner without its fast paths: an argsort of ``kind``, gathers, sums per run."""
    d, s, z = (np.array(v, dtype=np.uint64) for v in (dsts, srcs, sizes))
    order = np.argsort(s if order_by == "src" else d, kind=kind)
    d, s, z = d[order], s[order], z[order]
    joins = (s[1:] == s[:-1] + z[:-1]) & (d[1:] == d[:-1] + z[:-1])
    if reg is not None:
        for side in (d, s):
            ids = reg(side)
            joins &= ids[1:] == ids[:-1]
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return d[starts].tolist(), s[starts].tolist(), np.add.reduceat(z, starts).tolist()


HIGH = [0, 1, 1 << 48, TOP - 4096, TOP - 1, TOP, 2**64 - 8192, 2**64 - 4096, 2**64 - 1]


@st.composite
def hostile_copies(draw: st.DrawFn) -> tuple[list[int], list[int], int]:
    """Runs of one page size in shuffled order, near 2**63 and 2**64 - 1, with repeated addresses,
    or leading addresses spread exactly as wide as the planner's packed keys hold (or one more)."""
    n = draw(st.integers(1, 40))
    page = draw(st.sampled_from([1, 8, 4096, 1 << 20, TOP]))
    if draw(st.booleans()):
        bits = max(1, (n - 1).bit_length())
        width = (1 << (64 - bits)) - draw(st.sampled_from([0, 1, 2]))
        lo = draw(st.one_of(st.just(0), st.integers(0, 2**64 - 1 - width)))
        srcs = [lo, lo + width] + [lo + draw(st.sampled_from([0, 1, width // 2, width])) for _ in range(n - 2)]
        srcs = draw(st.permutations(srcs[:n]))
        dsts = [(i * page) % 2**64 for i in range(n)]
    else:
        base = [draw(st.one_of(st.sampled_from(HIGH), st.integers(0, 2**64 - 1))) for _ in range(2)]
        dsts, srcs = ([(b + i * page) % 2**64 for i in range(n)] for b in base)
        for _ in range(draw(st.integers(0, 3))):  # repeats: a copy to or from an address taken already
            i, j = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
            dsts[i], srcs[i] = (dsts[j], srcs[i]) if draw(st.booleans()) else (dsts[i], srcs[j])
        order = draw(st.permutations(range(n)))
        dsts, srcs = [dsts[i] for i in order], [srcs[i] for i in order]
    return dsts, srcs, page


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    copies=hostile_copies(),
    order_by=st.sampled_from(["src", "dst"]),
    form=st.sampled_from([int, np.int64, np.uint64, "array"]),
    by_registration=st.booleans(),
    distinct=st.booleans(),
)
def test_plan_agrees_with_the_plain_algorithm_on_hostile_addresses(
    copies: tuple[list[int], list[int], int], order_by: str, form: Any, by_registration: bool, distinct: bool
) -> None:
    """One page for all (an int, a numpy scalar, or an array) plans as per-copy sizes through an argsort
    do: runs merged across 2**63, never across 2**64 (or as the plain sums wrap, the same), ties in
    request order; a repeat on the ordering side refused as before."""
    dsts, srcs, page = copies
    n = len(dsts)
    if form is np.int64 and page >= TOP:
        form = np.uint64
    sizes: Any = np.full(n, page, dtype=np.uint64) if form == "array" else form(page)
    reg = (lambda a: (a >> np.uint64(20)).astype(np.int64)) if by_registration else None
    lead = np.array(srcs if order_by == "src" else dsts, dtype=np.uint64)
    expect = plain_plan(dsts, srcs, [page] * n, reg, order_by, "stable")  # the planner's sorts are all stable
    if distinct and len(set(lead.tolist())) < n:
        with pytest.raises(SlotError, match="twice"):
            plan(lead, lead, sizes, dst_reg=reg, src_reg=reg, order_by=order_by, distinct_order_side=True, n=n)
        return
    d, s = np.array(dsts, np.uint64), np.array(srcs, np.uint64)  # a list of ints past 2**63 is floats to numpy
    p = plan(d, s, sizes, dst_reg=reg, src_reg=reg, order_by=order_by, distinct_order_side=distinct, n=n)
    assert (p.dsts.tolist(), p.srcs.tolist(), p.sizes.tolist()) == expect
    assert p.requested == n and p.sizes.dtype == np.uint64


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    copies=hostile_copies(),
    order_by=st.sampled_from(["src", "dst"]),
    by_registration=st.booleans(),
    distinct=st.booleans(),
)
def test_the_small_request_planner_gives_the_arrays_plan(
    copies: tuple[list[int], list[int], int], order_by: str, by_registration: bool, distinct: bool
) -> None:
    """``plan_small`` (Python ints, for the few pages of a usual request) plans exactly as ``plan``:
    the same order, the same runs merged (across 2**63, wrapping past 2**64 as uint64 does, never
    across a registration), the same refusal of a repeat; a registration is asked only where
    copies could merge, about no more addresses than the copies that could."""
    from aiokvtier._copy._plan import plan_small

    dsts, srcs, page = copies
    n = len(dsts)
    asked: list[int] = []

    def reg(a: np.ndarray) -> np.ndarray:
        asked.append(len(a))
        return (a >> np.uint64(20)).astype(np.int64)

    chosen = reg if by_registration else None
    d, s = np.array(dsts, np.uint64), np.array(srcs, np.uint64)
    kwargs: dict[str, Any] = {"order_by": order_by, "distinct_order_side": distinct}
    try:
        expect = plan(d, s, np.uint64(page), dst_reg=chosen, src_reg=chosen, n=n, **kwargs)
    except SlotError:
        with pytest.raises(SlotError, match="twice"):
            plan_small(dsts, srcs, page, dst_reg=chosen, src_reg=chosen, **kwargs)
        return
    asked.clear()
    got = plan_small(dsts, srcs, page, dst_reg=chosen, src_reg=chosen, **kwargs)
    assert (got.dsts.tolist(), got.srcs.tolist(), got.sizes.tolist()) == (
        expect.dsts.tolist(),
        expect.srcs.tolist(),
        expect.sizes.tolist(),
    )
    assert got.requested == n and got.dsts.dtype == got.srcs.dtype == got.sizes.dtype == np.uint64
    # The ints a host copy runs are the arrays' copies, one for one.
    assert got.rows == tuple(zip(got.dsts.tolist(), got.srcs.tolist(), got.sizes.tolist(), strict=True))
    assert got.nbytes == int(expect.sizes.sum())  # known without a sum: as numpy's uint64 sum wraps
    assert all(k <= 2 * (n - 1) for k in asked)


@pytest.mark.parametrize("zero", [0, np.int64(0), np.uint64(0), [0, 0], np.zeros(2, np.uint64)])
def test_a_page_of_zero_bytes_is_refused_in_every_form(zero: Any) -> None:
    with pytest.raises(ValueError, match="a copy of zero bytes"):
        plan([2, 1], [4, 3], zero, n=2)
    with pytest.raises(ValueError, match="sizes: negative value"):
        plan([2, 1], [4, 3], [1, -1], n=2)


@st.composite
def outside_spans(draw: st.DrawFn, regions: Sequence[FakeRegion]) -> tuple[int, int]:
    """A span whose edges fall on a region's edges: up to its start, from its end, into it from
    below, over it whole, or sized up to 2**64 - 1."""
    region = draw(st.sampled_from(regions))
    start, end = region.base, region.base + region.size
    before = draw(st.integers(1, 1 << 20))
    return draw(
        st.sampled_from(
            [
                (max(0, start - before), min(before, start) or 1),  # ends exactly where the region starts
                (end, before),  # starts exactly at its end
                (max(0, start - before), min(before, start) + 1),  # one byte into it
                (max(0, start - 1), region.size + 2),  # over it whole
                (end, 2**64 - 1 - end),  # from its end to the top of the address space
                (max(0, start - before), 2**64 - 1),
            ]
        )
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), regions=fake_layouts())
def test_locate_bounding_span_at_region_edges(data: st.DataObject, regions: list[FakeRegion]) -> None:
    """``locate`` settles a request whose bounding span meets no region at once: spans that end where
    a region starts or start where one ends, alone or on both sides of it (the bounding span then covers
    the region though no span meets it), into one from below, over one, with sizes up to 2**64 - 1."""
    spans = data.draw(st.lists(outside_spans(regions), min_size=1, max_size=4))
    _check_against_reference(regions, [[a for a, _ in spans]], [n for _, n in spans], False)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), regions=fake_layouts())
def test_locate_span_agrees_with_the_scalar_reference(data: st.DataObject, regions: list[FakeRegion]) -> None:
    """One span: the region holding it inside one registration, None where it meets none, refused
    wherever the reference finds a problem (a whole buffer is checked this way at once)."""
    addr, n = data.draw(spans_near(regions))
    expect = reference([model_of(r) for r in regions], [[addr]], [n], known_only=False)
    with only_regions(*regions):
        if isinstance(expect, list):
            with pytest.raises(CopyPlanError):
                _regions.locate_span(addr, n)
            return
        found = _regions.locate_span(addr, n)
    assert found is (expect[1][0] if expect[1] else None)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), regions=fake_layouts(), known_only=st.booleans())
def test_pages_of_one_size_get_the_owners_a_page_by_page_search_gives(
    data: st.DataObject, regions: list[FakeRegion], known_only: bool
) -> None:
    """``buffer_addresses`` searches the pages' bounding span once and falls back to one search per
    page: either way, the same owners (as a set) and the same refusals as the reference."""
    first, page = data.draw(spans_near(regions))
    page = min(page, 1 << 40)
    count = data.draw(st.integers(1, 6))
    step = data.draw(st.sampled_from([page, 2 * page, page + 1]))
    addrs = [first + i * step for i in range(count) if first + i * step + page < TOP]
    assume(addrs)
    addrs = data.draw(st.permutations(addrs))
    expect = reference([model_of(r) for r in regions], [addrs], [page] * len(addrs), known_only=known_only)
    with only_regions(*regions):
        if isinstance(expect, list):
            with pytest.raises(CopyPlanError):
                buffer_addresses(addrs, len(addrs), page, writable=True, host_only=known_only)
            return
        pages = buffer_addresses(addrs, len(addrs), page, writable=True, host_only=known_only)
    if known_only or pages.regions:  # with a device, pages meeting no region pass with no owners
        assert set(map(id, pages.regions)) == set(map(id, expect[1]))
    else:
        assert expect[1] == []


GC_CHURN = """
import gc
from aiokvtier import _regions

class Region:
    region_name = "churn"
    def __init__(self, base):
        self.base, self.cycle = base, self  # a cycle: only the collector frees it
    def region_bounds(self):
        return self.base, 4096
    def registrations_of(self, offsets, nbytes):
        return offsets.astype("int64") * 0

gc.set_threshold(1, 1, 1)  # a collection at nearly every allocation, inside register() too
for i in range(3000):
    kept = Region(i << 20)
    _regions.register(kept)
    Region((i << 20) + 4096)  # registered below, then dropped without unregister()
    _regions.register(Region((i << 20) + 8192))
    _regions.locate_span(i << 20, 64)
    _regions.unregister(kept)
print("done", len(_regions.known()))
"""


def test_regions_dropped_without_unregister_are_collected_while_others_register() -> None:
    """The collector may free a dropped region while this thread holds the regions' lock (inside
    ``register``): nothing it runs then may take the lock again, or the thread waits for itself."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", GC_CHURN], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("done")


def test_a_region_collected_while_the_known_regions_are_republished_does_not_deadlock() -> None:
    """A region dropped without ``unregister`` (in a reference cycle: only the garbage collector frees it)
    whose collection runs inside another ``register`` (any allocation there may run the collector)
    republishes the regions from within it, on the same thread: it deadlocked on the registry's lock. The
    collector is made to run at each of the first allocations of ``register`` in turn (a child process,
    so that a regression fails on the timeout instead of hanging the run)."""
    script = """
import gc
from tests.test_copy_regions import FakeRegion
from aiokvtier import _regions

for k in range(1, 40):
    gc.disable()
    gc.collect()
    dropped = FakeRegion(1 << 40, 4096, (0,), 4096)
    dropped.cycle = dropped
    _regions.register(dropped)
    del dropped
    kept = FakeRegion(1 << 30, 4096, (0,), 4096)
    gc.set_threshold(gc.get_count()[0] + k)  # a collection at the k-th allocation from here
    gc.enable()
    _regions.register(kept)
    gc.disable()
    gc.collect()
    assert [r.region_bounds() for r in _regions.known()] == [(1 << 30, 4096)]
    _regions.unregister(kept)
print("done")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr


# -- the copies in flight over a region --------------------------------------------------------


def test_a_landing_is_waited_for_until_set_from_another_thread_and_set_once() -> None:
    copies = InflightCopies()
    first, second = copies.begin(), copies.begin()
    assert len(copies) == 2 and not first.is_set()
    waited = threading.Event()

    def waiter() -> None:
        InflightCopies.wait(copies.snapshot())
        waited.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    first.set()
    assert not waited.wait(0.05)  # the second copy is still in flight
    second.set()
    second.set()  # idempotent
    thread.join(5)
    assert waited.is_set() and not thread.is_alive()
    assert len(copies) == 0 and copies.snapshot() == []
    first.wait()  # a landed copy does not block


def test_many_copies_in_flight_are_all_kept_and_landed_ones_dropped() -> None:
    copies = InflightCopies()
    pending = [copies.begin() for _ in range(1000)]  # past every compaction bound, none landed
    assert len(copies) == 1000
    for landing in pending[::2]:
        landing.set()
    later = [copies.begin() for _ in range(1000)]
    assert len(copies) == 1500
    assert set(map(id, copies.snapshot())) == set(map(id, pending[1::2] + later))
    for landing in pending[1::2] + later:
        landing.set()
    assert len(copies) == 0 and copies.snapshot() == []


def test_a_plan_of_rows_makes_its_arrays_when_read_and_nothing_else() -> None:
    """``Plan.of_rows`` (a small request's plan): its arrays come from the rows on first read, from any
    thread; an attribute a plan does not have is still an AttributeError; ``replace`` keeps the copies."""
    import dataclasses
    import threading

    from aiokvtier._copy._plan import Plan

    rows = ((0x2000, 0x9000, 4096), (0x1000, 0x8000, 8192))
    plan = Plan.of_rows(rows, 3, 12288)
    assert plan.count == 2 and plan.nbytes == 12288 and plan.requested == 3 and plan.jobs == 1
    seen: list[list[int]] = []
    readers = [threading.Thread(target=lambda: seen.append(plan.srcs.tolist())) for _ in range(4)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(10)
    assert seen == [[0x9000, 0x8000]] * 4
    assert (plan.dsts.tolist(), plan.sizes.tolist()) == ([0x2000, 0x1000], [4096, 8192])
    assert plan.dsts.dtype == plan.srcs.dtype == plan.sizes.dtype == np.uint64
    with pytest.raises(AttributeError, match="nope"):
        plan.nope  # noqa: B018
    again = dataclasses.replace(Plan.of_rows(rows, 3, 12288), jobs=2)
    assert again.jobs == 2 and again.rows == rows and again.dsts.tolist() == [0x2000, 0x1000]
