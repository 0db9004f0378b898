"""Large requests (thousands of pages) plan as a plain reference planner does.

The planner sorts large requests by radix passes over address ranks and skips
the merge search where no two neighbours can be a page apart; these tests draw
requests past those thresholds (random slots, repeats, registration boundaries,
pages shorter than slots, spans too wide for the passes) and compare every
plan, copy for copy, and every refusal, with a straightforward planner on
Python ints.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiokvtier import CopyPlanError, HostTier, SlotError
from aiokvtier._copy import _plan
from aiokvtier._copy._plan import plan, sorted_values
from aiokvtier._copy._requests import check_disjoint, plan_slots

from .helpers import KiB, MiB, small_config

Copies = tuple[list[int], list[int], list[int]]
WRAP = 1 << 64


def reference(
    dsts: list[int], srcs: list[int], page: int, reg: Callable[[int], int] | None, order_by: str, distinct: bool
) -> Copies:
    """Sort by the leading side (stable), refuse a repeat there if asked, and merge each copy into the run
    before it where both sides continue it and each side stays in one registration."""
    lead = srcs if order_by == "src" else dsts
    if distinct and len(set(lead)) < len(lead):
        raise SlotError("a slot appears twice as a copy destination")
    runs: list[list[int]] = []  # [dst, src, size, last index]
    for i in sorted(range(len(lead)), key=lead.__getitem__):
        if runs:
            last = runs[-1][3]
            if (
                srcs[i] == (srcs[last] + page) % WRAP
                and dsts[i] == (dsts[last] + page) % WRAP
                and (reg is None or (reg(dsts[i]) == reg(dsts[last]) and reg(srcs[i]) == reg(srcs[last])))
            ):
                runs[-1][2] += page
                runs[-1][3] = i
                continue
        runs.append([dsts[i], srcs[i], page, i])
    return [r[0] for r in runs], [r[1] for r in runs], [r[2] % WRAP for r in runs]


def large_request(seed: int, n: int, slot: int, page: int, total: int, kind: str) -> tuple[list[int], list[int]]:
    """Per-slot-like copies: the leading side on ``total`` slots of a tier (shuffled, some repeated,
    or in ascending runs, the runs shuffled), the other side continuing the slots' runs or
    shuffled pages; or leading addresses spread too wide for the radix passes, or all alike."""
    rng = np.random.default_rng(seed)
    base = int(rng.integers(0, 1 << 47)) & ~0xFFF
    if kind == "runs":  # merges within each run
        start = int(rng.integers(0, total - n + 1))
        cut = np.sort(rng.choice(np.arange(1, n), size=64, replace=False)).tolist()
        bounds = list(zip([0, *cut], [*cut, n], strict=True))[::-1]
        ids = np.concatenate([np.arange(start + a, start + b) for a, b in bounds])
    elif kind == "repeats":
        ids = rng.integers(0, total, n)
    else:
        ids = rng.permutation(total)[:n]
    lead = [base + int(i) * slot for i in ids.tolist()]
    if kind == "wide":
        lead = rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True).tolist()
        k = n // 8
        lead[:k] = lead[k : 2 * k]  # repeats
    elif kind == "alike":
        lead = [base] * n
    elif kind == "odd":  # one address off the slots' alignment: the grain is 1
        lead[int(rng.integers(0, n))] += 1
    other_base = int(rng.integers(0, 1 << 47)) & ~0xFFF
    if seed % 2:  # the other side continues the leading side's runs
        other = [(other_base + a - base) % WRAP for a in lead]
    else:
        other = (other_base + rng.permutation(n).astype(np.int64) * page).tolist()
    return lead, other


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.sampled_from([_plan.RADIX_FROM - 1, _plan.RADIX_FROM, 3000, 4096, 9000, 20000]),
    slot=st.sampled_from([4 * KiB, 48 * KiB, 64 * KiB, 2 * MiB]),
    page_of_slot=st.sampled_from([1, 4, 16]),
    spread=st.sampled_from([1, 2, 64, 2048]),
    kind=st.sampled_from(["shuffled", "repeats", "runs", "wide", "alike", "odd"]),
    order_by=st.sampled_from(["src", "dst"]),
    reg_bits=st.sampled_from([None, 20, 26]),
    distinct=st.booleans(),
    sizes_form=st.sampled_from(["int", "array"]),
)
def test_large_plans_match_the_reference(
    seed: int,
    n: int,
    slot: int,
    page_of_slot: int,
    spread: int,
    kind: str,
    order_by: str,
    reg_bits: int | None,
    distinct: bool,
    sizes_form: str,
) -> None:
    """Copy for copy, in the same order, and the same refusal of a repeat on the leading side."""
    page = slot // page_of_slot
    lead, other = large_request(seed, n, slot, page, n * spread, kind)
    dsts, srcs = (other, lead) if order_by == "src" else (lead, other)
    n = len(lead)
    reg_py = None if reg_bits is None else (lambda a: a >> reg_bits)
    asked = [0]

    def reg(a: np.ndarray) -> np.ndarray:
        asked[0] += len(a)
        return (a >> np.uint64(reg_bits)).astype(np.int64)

    sizes: Any = page if sizes_form == "int" else np.full(n, page, dtype=np.uint64)
    kwargs: dict[str, Any] = {"order_by": order_by, "distinct_order_side": distinct, "n": n}
    if reg_bits is not None:
        kwargs |= {"dst_reg": reg, "src_reg": reg}
    d, s = np.array(dsts, dtype=np.uint64), np.array(srcs, dtype=np.uint64)
    try:
        expect = reference(dsts, srcs, page, reg_py, order_by, distinct)
    except SlotError:
        with pytest.raises(SlotError, match="twice"):
            plan(d, s, sizes, **kwargs)
        return
    got = plan(d, s, sizes, **kwargs)
    assert (got.dsts.tolist(), got.srcs.tolist(), got.sizes.tolist()) == expect
    assert got.requested == n and got.dsts.dtype == got.srcs.dtype == got.sizes.dtype == np.uint64
    assert d.tolist() == dsts and s.tolist() == srcs  # the caller's arrays are left alone


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.sampled_from([_plan.RADIX_FROM, 5000, 20000]),
    bits=st.sampled_from([12, 16, 40, 64]),
    overlap=st.sampled_from([None, 0, 1, 4095]),
)
def test_large_overlap_checks_find_what_sorted_spans_show(seed: int, n: int, bits: int, overlap: int | None) -> None:
    """Shuffled destinations of one page: refused exactly where the sorted spans overlap
    (a repeat, or a start inside the page before it), and the sorted values are numpy's."""
    rng = np.random.default_rng(seed)
    page = 4096
    starts = rng.choice(max(n, 1 << min(bits, 40)), size=n, replace=False).astype(np.uint64) * np.uint64(page)
    if bits == 64:
        starts = rng.integers(0, 2**63, n, dtype=np.uint64)
    if overlap is not None:
        i, j = rng.choice(n, size=2, replace=False)
        starts[i] = starts[j] + np.uint64(overlap)
    assert sorted_values(starts).tolist() == np.sort(starts).tolist()
    spans = sorted(starts.tolist())
    clash = any(b < a + page for a, b in itertools.pairwise(spans))
    if clash:
        with pytest.raises(CopyPlanError, match="overlapping"):
            check_disjoint(starts, page)
    else:
        check_disjoint(starts, page)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("page", [4 * KiB, 16 * KiB])
async def test_large_slot_plans_match_the_reference(direction: str, page: int) -> None:
    """A tier's shuffled slots (repeats where the direction allows them), pages shorter than a slot
    or as long, the other side continuing the slots' runs or not: the plan the engine would
    submit is the reference's, never merged across a registration; a repeated slot is refused
    as a d2h destination."""
    async with HostTier(small_config(slot_size=16 * KiB, commit_unit=1 * MiB, quota=64 * MiB)) as tier:
        await tier.wait_resident()
        ids = await tier.allocate(tier.slots_total)
        rng = np.random.default_rng(7)
        try:
            for trial in range(6):
                n = [_plan.RADIX_FROM, 4000][trial % 2]
                slots = [ids[i] for i in rng.permutation(len(ids))[:n].tolist()]
                if trial >= 4:
                    k = n // 10
                    slots[:k] = slots[k : 2 * k]  # repeats
                if trial in (2, 3):  # ascending runs: the other side continues them below
                    slots = sorted(slots)
                    cut = n // 3
                    slots = slots[cut:] + slots[:cut]
                host = [tier.address(s) for s in slots]
                base = 1 << 44
                if trial in (1, 2, 3):  # the other side continues the slots' runs
                    other = [base + (a - min(host)) * page // (16 * KiB) for a in host]
                else:
                    other = (base + rng.permutation(n).astype(np.int64) * page).tolist()

                lo, hi = tier.base_address, tier.base_address + tier.slots_total * tier.slot_size

                def unit(a: int, lo: int = lo, hi: int = hi) -> int:
                    return int(tier.registrations_at(np.array([a], dtype=np.uint64))[0]) if lo <= a < hi else -1

                dsts, srcs = (other, host) if direction == "h2d" else (host, other)
                order_by = "src" if direction == "h2d" else "dst"
                try:
                    expect = reference(dsts, srcs, page, unit, order_by, direction == "d2h")
                except SlotError:
                    with pytest.raises(SlotError, match="twice"):
                        plan_slots(tier, slots, other, direction, page, host_only=False)
                    continue
                got, owners = plan_slots(tier, slots, other, direction, page, host_only=False)
                assert (got.dsts.tolist(), got.srcs.tolist(), got.sizes.tolist()) == expect
                assert owners == [tier]
                if page == tier.slot_size and trial in (2, 3):
                    assert got.count < n  # runs merged (within registrations)
        finally:
            tier.free_many(ids)
