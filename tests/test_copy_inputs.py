"""What the CopyEngine refuses before it copies: bad addresses, sizes, buffers and overlaps.

Every refusal leaves memory and the engine's statistics as they were.
The host-to-host engine stands in for the GPU one: the checks are the same
code, except where a device lets unknown addresses through to the driver.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest

from aiokvtier import CopyEngine, CopyPlanError, HostTier, SlotError, StaticHostMem
from aiokvtier._copy._requests import (
    buffer_addresses,
    check_disjoint,
    copy_table,
    integers,
    plan_slots,
    registrations,
    stream_handle,
)

from .helpers import KiB, small_config

SLOT = 64 * KiB


def _pages(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, SLOT), dtype=np.uint8)


@asynccontextmanager
async def _setup(slots: int = 4) -> AsyncIterator[tuple[HostTier, StaticHostMem, CopyEngine, list[int]]]:
    """A tier whose first ``slots`` slots hold known pages, a zeroed staging buffer, a host engine."""
    async with HostTier(small_config()) as tier, StaticHostMem(8 * SLOT) as stage, CopyEngine(None) as engine:
        await tier.wait_resident()
        ids = await tier.allocate(slots)
        await engine.to_host(tier, ids, _pages(slots))
        yield tier, stage, engine, ids


def _unchanged(engine: CopyEngine, stage: StaticHostMem) -> bool:
    stats = engine.statistics()
    untouched = not np.frombuffer(stage.view(), dtype=np.uint8).any()
    return untouched and stats.jobs_submitted == 1 and stats.copies_requested == 4


class _DeviceArray:
    """A stand-in for a CUDA tensor: only ``__cuda_array_interface__``."""

    def __init__(self, n: int, page: int, *, readonly: bool = False, ptr: int = 0x7F00_0000_0000) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n, page),
            "typestr": "|u1",
            "data": (ptr, readonly),
            "strides": None,
            "version": 3,
        }


# -- 1. read-only destinations ---------------------------------------------------------


async def test_read_only_destination_buffer_is_refused() -> None:
    async with _setup() as (tier, stage, engine, ids):
        frozen = bytes(2 * SLOT)
        dst = np.frombuffer(frozen, dtype=np.uint8).reshape(2, SLOT)
        with pytest.raises(ValueError, match="read-only"):
            await engine.to_device(tier, ids[:2], dst)
        assert frozen == bytes(2 * SLOT)
        # The raw form of the same mistake: a bytes object is in no known region.
        with pytest.raises(CopyPlanError, match="no open HostTier"):
            await engine.copy([(dst.__array_interface__["data"][0], tier.address(ids[0]), SLOT)])
        assert frozen == bytes(2 * SLOT) and _unchanged(engine, stage)
        # Reading from a read-only buffer is fine.
        await engine.to_host(tier, ids[:2], np.frombuffer(bytes(2 * SLOT), dtype=np.uint8).reshape(2, SLOT))
        assert bytes(tier.view(ids[0])) == bytes(SLOT)


def test_read_only_device_array_is_refused_as_a_destination_only() -> None:
    with pytest.raises(ValueError, match="read-only"):
        buffer_addresses(_DeviceArray(2, SLOT, readonly=True), 2, SLOT, writable=True, host_only=False)
    side = buffer_addresses(_DeviceArray(2, SLOT, readonly=True), 2, SLOT, writable=False, host_only=False)
    assert side.page == SLOT and side.addresses.tolist() == [0x7F00_0000_0000, 0x7F00_0000_0000 + SLOT]


# -- 2. overlapping destinations -------------------------------------------------------


async def test_overlapping_destinations_are_refused() -> None:
    async with _setup() as (tier, stage, engine, ids):
        a = stage.address
        with pytest.raises(CopyPlanError, match="overlapping"):
            await engine.to_device(tier, ids[:2], [a, a])
        with pytest.raises(CopyPlanError, match="overlapping"):
            await engine.to_device(tier, ids[:3], [a + 4 * SLOT, a, a + SLOT // 2])
        src = tier.address(ids[0])
        with pytest.raises(CopyPlanError, match="overlapping"):
            await engine.copy([(a + SLOT, src, SLOT), (a, src, SLOT + 1)])
        with pytest.raises(CopyPlanError, match="overlapping"):
            await engine.copy([(a, src, 16), (a + 2 * SLOT, src, 16), (a, src, 16)])
        assert _unchanged(engine, stage)
        # Touching spans are not overlapping, in any order.
        await engine.copy([(a + SLOT, tier.address(ids[1]), SLOT), (a, src, SLOT)])
        assert bytes(stage.view()[: 2 * SLOT]) == bytes(tier.view(ids[0])) + bytes(tier.view(ids[1]))
        # Reading one source twice is fine; a slot written twice is still the planner's refusal.
        await engine.to_device(tier, [ids[0], ids[0]], [a + 4 * SLOT, a + 5 * SLOT])
        with pytest.raises(SlotError, match="twice"):
            await engine.to_host(tier, [ids[0], ids[0]], [a, a + SLOT])


def test_check_disjoint_agrees_with_brute_force() -> None:
    rng = np.random.default_rng(4)
    for _ in range(300):
        n = int(rng.integers(2, 12))
        starts = rng.integers(0, 200, n).astype(np.uint64)
        sizes = rng.integers(1, 30, n).astype(np.uint64)
        spans = list(zip(starts.tolist(), (starts + sizes).tolist(), strict=True))
        overlap = any(max(s1, s2) < min(e1, e2) for i, (s1, e1) in enumerate(spans) for (s2, e2) in spans[i + 1 :])
        if overlap:
            with pytest.raises(CopyPlanError):
                check_disjoint(starts, sizes)
        else:
            check_disjoint(starts, sizes)
    check_disjoint(np.arange(5, dtype=np.uint64)[::-1] * 10, 10)  # one page size for all, unsorted
    with pytest.raises(CopyPlanError):
        check_disjoint(np.arange(5, dtype=np.uint64)[::-1] * 10, 11)


# -- 3. integers only; nothing empty -----------------------------------------------------


async def test_addresses_and_sizes_must_be_integers() -> None:
    async with _setup() as (tier, stage, engine, ids):
        a, src = stage.address, tier.address(ids[0])
        with pytest.raises(TypeError, match=r"1500000000\.0"):
            await engine.copy([(a, src, 1.5e9)])
        with pytest.raises(TypeError, match=r"float"):
            await engine.copy([(float(a), src, SLOT)])
        with pytest.raises(TypeError, match="True"):
            await engine.copy([(a, src, True)])
        with pytest.raises(TypeError, match="True"):
            await engine.copy([(a, src, np.bool_(True))])
        with pytest.raises(TypeError, match="float64"):
            await engine.copy(np.array([[a, src, SLOT]], dtype=np.float64))
        with pytest.raises(TypeError, match=r"1500000000\.0"):
            await engine.to_device(tier, ids[:2], [a, 1.5e9])
        with pytest.raises(TypeError, match="True"):
            await engine.to_device(tier, ids[:2], [a, True])
        with pytest.raises(TypeError, match="float64"):
            await engine.to_device(tier, ids[:2], np.array([a, a + SLOT], dtype=np.float64))
        with pytest.raises(TypeError, match="bool"):
            await engine.to_device(tier, ids[:2], np.array([True, False]))
        with pytest.raises(TypeError):
            await engine.to_device(tier, ids[:2], a)
        with pytest.raises(TypeError, match="bytes"):
            await engine.to_device(tier, ids[:2], bytes(16))  # not a list of sixteen addresses
        assert _unchanged(engine, stage)
        # numpy integers are integers.
        await engine.copy([(np.int64(a), np.uint64(src), np.int32(SLOT))])
        await engine.to_device(tier, ids[1:3], [np.uint64(a + SLOT), a + 2 * SLOT])
        assert bytes(stage.view()[: 4 * SLOT]) == b"".join(bytes(tier.view(s)) for s in ids[:3]) + bytes(SLOT)


async def test_empty_requests_and_zero_byte_copies_are_refused() -> None:
    async with _setup() as (tier, stage, engine, ids):
        with pytest.raises(ValueError, match="no copies"):
            await engine.copy([])
        with pytest.raises(ValueError, match="no copies"):
            await engine.copy(iter(()))
        with pytest.raises(ValueError, match="zero bytes"):
            await engine.copy([(stage.address, tier.address(ids[0]), 0)])
        with pytest.raises(ValueError, match="no slots"):
            await engine.to_device(tier, [], np.zeros((0, SLOT), np.uint8))
        with pytest.raises(ValueError, match="zero bytes"):
            await engine.to_device(tier, ids[:2], np.zeros((2, 0), np.uint8))
        with pytest.raises(ValueError, match="non-negative"):
            await engine.copy([(stage.address, -1, SLOT)])
        with pytest.raises(ValueError, match="length 2"):
            await engine.copy([(stage.address, tier.address(ids[0]))])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="63 bits"):
            await engine.copy([(stage.address, 1 << 64, SLOT)])
        assert _unchanged(engine, stage)


def test_integers_takes_what_operator_index_takes() -> None:
    assert integers([1, np.int64(2), np.uint8(3)], "x").tolist() == [1, 2, 3]
    assert integers(np.array([4, 5], dtype=np.uint64), "x").dtype == np.int64
    assert integers((i for i in range(3)), "x").tolist() == [0, 1, 2]
    for bad in ([1, 2.0], [False], [np.float32(1)], ["1"], [None]):
        with pytest.raises(TypeError, match=repr(bad[-1]).replace("(", r"\(").replace(")", r"\)")):
            integers(bad, "address")
    with pytest.raises(ValueError, match="63 bits"):
        integers(np.array([1 << 63], dtype=np.uint64), "address")
    assert copy_table(np.array([[1, 2, 3]], dtype=np.uint32)).tolist() == [[1, 2, 3]]
    with pytest.raises(ValueError, match="shape"):
        copy_table(np.array([1, 2, 3]))
    with pytest.raises(TypeError, match="tuple"):
        copy_table([1, 2, 3])  # type: ignore[list-item]


# -- 4. a host-to-host engine copies only between known regions ----------------------------


async def test_host_engine_refuses_addresses_outside_known_regions() -> None:
    async with _setup() as (tier, stage, engine, ids):
        src = tier.address(ids[0])
        garbage = 0x10_0000  # below every mapping: a memmove here would kill the process
        with pytest.raises(CopyPlanError, match="no open HostTier or StaticHostMem"):
            await engine.copy([(garbage, src, SLOT)])
        with pytest.raises(CopyPlanError, match="no open HostTier or StaticHostMem"):
            await engine.copy([(stage.address, garbage, SLOT)])
        with pytest.raises(CopyPlanError, match="no open HostTier or StaticHostMem"):
            await engine.to_device(tier, ids[:1], [garbage])
        with pytest.raises(CopyPlanError, match="no open HostTier or StaticHostMem"):
            await engine.to_host(tier, ids[:1], [garbage])
        with pytest.raises(CopyPlanError, match="device memory"):
            await engine.to_device(tier, ids[:2], _DeviceArray(2, SLOT))
        # A closed tier and a closed staging buffer are not regions any more.
        async with HostTier(small_config()) as gone:
            await gone.wait_resident()
            old = gone.address(await gone.allocate())
        old_stage = StaticHostMem(SLOT)
        async with old_stage:
            old_staging_address = old_stage.address
        with pytest.raises(CopyPlanError, match="no open HostTier or StaticHostMem"):
            await engine.copy([(old, src, SLOT)])
        with pytest.raises(CopyPlanError, match="no open HostTier or StaticHostMem"):
            await engine.copy([(stage.address, old_staging_address, SLOT)])
        with pytest.raises(CopyPlanError, match="no open HostTier or StaticHostMem"):
            await engine.to_device(tier, ids[:1], [old])
        assert _unchanged(engine, stage)
        # The caller's own numpy array is fine as the buffer side: it lives while referenced.
        out = np.zeros((1, SLOT), np.uint8)
        await engine.to_device(tier, ids[:1], out)
        assert out.tobytes() == bytes(tier.view(ids[0]))


async def test_addresses_in_another_region_make_it_an_owner() -> None:
    async with _setup() as (tier, stage, engine, ids):
        _, owners = plan_slots(
            tier, ids[:2], [stage.address, stage.address + SLOT], "h2d", None, host_only=engine.device is None
        )
        assert owners == [tier, stage]
        _, owners = plan_slots(tier, ids[:1], [tier.address(ids[3])], "d2h", None, host_only=engine.device is None)
        assert owners == [tier]
        await engine.to_device(tier, ids[:2], [stage.address + SLOT, stage.address])
        assert bytes(stage.view()[:SLOT]) == bytes(tier.view(ids[1]))


async def test_unknown_addresses_pass_with_a_device() -> None:
    async with _setup() as (tier, stage, _, ids):
        (d, s), owners = registrations(
            [[0x7F00_0000_0000, stage.address], [tier.address(ids[0]), 0x7F00_0001_0000]], SLOT, known_only=False
        )
        assert d.tolist() == [-1, 0] and s.tolist() == [1, -1]
        assert owners == [stage, tier]
        side = buffer_addresses([0x7F00_0000_0000], 1, SLOT, writable=True, host_only=False)
        assert side.regions == () and side.addresses.tolist() == [0x7F00_0000_0000]


# -- 5. registrations get dense ids, never hashes ---------------------------------------------


async def test_registration_ids_are_dense_per_request() -> None:
    async with HostTier(small_config()) as a, HostTier(small_config()) as b, StaticHostMem(4 * SLOT) as stage:
        await a.wait_resident()
        await b.wait_resident()
        sa, sb = await a.allocate(40), await b.allocate(40)
        spans = [a.address(sa[0]), a.address(sa[1]), a.address(sa[17]), b.address(sb[0]), stage.address]
        spans += [b.address(sb[33]), a.address(sa[16]), stage.address + SLOT]
        (ids,), owners = registrations([spans], SLOT, known_only=True)
        # a's unit 0, a's unit 1, b's unit 0, the staging buffer, b's unit 2: in order of appearance.
        assert ids.tolist() == [0, 0, 1, 2, 3, 4, 1, 3]
        assert owners == [a, b, stage]
        (second,), _ = registrations([spans[::-1]], SLOT, known_only=True)
        assert sorted(set(second.tolist())) == [0, 1, 2, 3, 4]


async def test_registration_ids_of_many_spans_follow_region_and_unit() -> None:
    async with HostTier(small_config()) as a, HostTier(small_config()) as b, StaticHostMem(4 * SLOT) as stage:
        await a.wait_resident()
        await b.wait_resident()
        sa, sb = await a.allocate(64), await b.allocate(64)
        rng = np.random.default_rng(5)
        spans = [a.address(s) for s in sa] + [b.address(s) for s in sb] + [stage.address + i * SLOT for i in range(4)]
        spans = [spans[i] for i in rng.permutation(len(spans))] + [0x7F00_0000_0000]
        (ids,), owners = registrations([spans], SLOT, known_only=False)
        # The reference, one span at a time: (region, registration) pairs numbered as they first appear.
        pairs: list[tuple[int, int] | None] = []
        for addr in spans:
            region = next((r for r in (a, b, stage) if r.region_bounds()[0] <= addr < sum(r.region_bounds())), None)
            if region is None:
                pairs.append(None)
                continue
            unit = 0 if region is stage else int(region.registrations_at(np.array([addr], np.uint64))[0])
            pairs.append((id(region), unit))
        dense: dict[tuple[int, int], int] = {}
        expect = [-1 if p is None else dense.setdefault(p, len(dense)) for p in pairs]
        assert ids.tolist() == expect
        assert len(set(expect)) > 4  # several units of each tier
        appearance = list(dict.fromkeys(p[0] for p in pairs if p is not None))
        assert [id(o) for o in owners] == appearance


async def test_a_span_running_into_or_out_of_a_region_is_refused() -> None:
    async with StaticHostMem(4 * SLOT) as stage, CopyEngine(None) as engine:
        with pytest.raises(CopyPlanError, match="runs into"):
            registrations([[stage.address - 16]], SLOT, known_only=False)
        with pytest.raises(CopyPlanError, match="leaves"):
            registrations([[stage.address + 3 * SLOT + 16]], SLOT, known_only=False)
        with pytest.raises(CopyPlanError, match="leaves"):
            await engine.copy([(stage.address, stage.address + 2 * SLOT, 2 * SLOT + 1)])
        (ids,), _ = registrations([[stage.address - 16]], 16, known_only=False)  # ends where it starts
        assert ids.tolist() == [-1]


async def test_raw_copy_does_not_merge_across_registrations() -> None:
    async with HostTier(small_config()) as a, StaticHostMem(2 * 16 * SLOT) as stage, CopyEngine(None) as engine:
        await a.wait_resident()
        slots = await a.allocate(32)
        pages = _pages(32, 3)
        await engine.to_host(a, slots, pages)
        before = engine.statistics().descriptors_submitted
        # Contiguous on both sides, but the source crosses from unit 0 into unit 1 at slot 16.
        await engine.copy([(stage.address + i * SLOT, a.address(slots[i]), SLOT) for i in range(32)])
        assert engine.statistics().descriptors_submitted - before == 2
        assert bytes(stage.view()) == pages.tobytes()


# -- shapes and layouts keep their errors ---------------------------------------------------


async def test_shape_and_layout_errors_are_unchanged() -> None:
    async with _setup() as (tier, stage, engine, ids):
        with pytest.raises(ValueError, match="C-contiguous"):
            await engine.to_device(tier, ids[:2], np.zeros((2, 2 * SLOT), np.uint8)[:, ::2])
        with pytest.raises(ValueError, match="first dimension"):
            await engine.to_device(tier, ids[:3], np.zeros((2, SLOT), np.uint8))
        with pytest.raises(ValueError, match="expected 2 integer addresses"):
            await engine.to_device(tier, ids[:2], [stage.address])
        with pytest.raises(ValueError, match="expected 2 integer addresses"):
            await engine.to_device(tier, ids[:2], np.zeros(3, np.int64))
        with pytest.raises(CopyPlanError, match="does not fit"):
            await engine.to_device(tier, ids[:1], np.zeros((1, 2 * SLOT), np.uint8))
        with pytest.raises(ValueError, match="needs a CUDA device"):
            await engine.to_device(tier, ids[:1], np.zeros((1, SLOT), np.uint8), after=0)
        assert _unchanged(engine, stage)


def test_stream_handle_is_where_it_was() -> None:
    from aiokvtier._copy._engine import _stream_handle

    assert _stream_handle is stream_handle
    assert stream_handle(7) == ("stream", 7)
    with pytest.raises(TypeError, match="after="):
        stream_handle(True)
