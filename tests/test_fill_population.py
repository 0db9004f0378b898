"""How the fill makes pages resident where it does not copy them in (a kernel before 6.9, a
refused userfaultfd, huge pages): touched where memory allows, populated in short calls where not.
Every test here fills that way (the ``touch_fill`` fixture); tests/test_fill_copy.py has the copy.

The calls that reach the kernel are recorded by spies on ``_linux``: every
touch step and every MADV_POPULATE_WRITE call is bounded in size, mprotect
runs once per resize and never per unit, a fill short of memory still
reports ENOMEM as a partial failure, and the guard that replaced per-unit
PROT_NONE (nothing hands out or copies into memory above the watermark)
holds.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from aiokvtier import CopyEngine, CopyPlanError, FillError, HostTier, HostTierConfig, SlotError, WouldBlock
from aiokvtier._config import default_fill_threads
from aiokvtier._handoff import GilHandoff, handoff
from aiokvtier._host import _headroom, _hugepages, _linux

from .conftest import PopulateGate, smaps_flags
from .helpers import MiB, saturated, small_config
from .invariants import RW, assert_perms, check_tier


class Calls:
    """Lengths of the kernel-facing calls the fill makes, by kind, from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.touch: list[int] = []
        self.populate: list[int] = []
        self.mprotect: list[tuple[int, bool]] = []

    def add(self, kind: str, value: object) -> None:
        with self._lock:
            getattr(self, kind).append(value)


@pytest.fixture(autouse=True)
def _touching(touch_fill: None) -> None:
    """Every tier here fills by touching or populating."""


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    seen = Calls()
    touch_step, madvise, mprotect = _linux._touch_step, _linux._madvise, _linux.mprotect

    def spy_touch(addr: int, n: int) -> None:
        seen.add("touch", n)
        touch_step(addr, n)

    def spy_madvise(addr: int, length: int, advice: int) -> int:
        if advice == _linux.MADV_POPULATE_WRITE:
            seen.add("populate", length)
        return int(madvise(addr, length, advice))

    def spy_mprotect(addr: int, length: int, writable: bool) -> None:
        seen.add("mprotect", (length, writable))
        mprotect(addr, length, writable)

    monkeypatch.setattr(_linux, "_touch_step", spy_touch)
    monkeypatch.setattr(_linux, "_madvise", spy_madvise)
    monkeypatch.setattr(_linux, "mprotect", spy_mprotect)
    yield seen


@pytest.fixture
def memory_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel reports no memory to spare: every unit must be populated, not touched."""
    monkeypatch.setattr(_headroom, "available_bytes", lambda: 0)


def big_units(**overrides: object) -> HostTierConfig:
    return small_config(quota=96 * MiB, max_quota=256 * MiB, commit_unit=32 * MiB, fill_chunk=32 * MiB, **overrides)


async def test_touching_is_bounded_and_mprotect_runs_once_per_resize(calls: Calls) -> None:
    async with HostTier(big_units(fill_threads=3)) as tier:
        await tier.wait_resident()
        check_tier(tier, settled=True)
        assert calls.touch and max(calls.touch) <= _linux.TOUCH_STEP
        assert sum(calls.touch) == 96 * MiB and not calls.populate
        assert calls.mprotect == [(96 * MiB, True)]  # the whole target at once, no unit alone
        await tier.resize(160 * MiB)
        await tier.wait_resident()
        assert calls.mprotect[1:] == [(64 * MiB, True)]
        await tier.resize(32 * MiB)
        assert calls.mprotect[2:] == [(128 * MiB, False)]  # the tail closes in one call too
        check_tier(tier, settled=True)
        slot = await tier.allocate()
        assert bytes(tier.view(slot)[:16]) == bytes(16)


async def test_short_of_memory_the_fill_populates_in_bounded_calls(calls: Calls, memory_short: None) -> None:
    async with HostTier(big_units(fill_threads=2)) as tier:
        await tier.wait_resident()
        check_tier(tier, settled=True)
    assert not calls.touch
    assert calls.populate and max(calls.populate) <= _linux.POPULATE_STEP
    assert sum(calls.populate) == 96 * MiB


async def test_enomem_from_populate_is_a_partial_failure(monkeypatch: pytest.MonkeyPatch, memory_short: None) -> None:
    real = _linux._madvise
    limit = [0]

    def run_out(addr: int, length: int, advice: int) -> int:
        if advice == _linux.MADV_POPULATE_WRITE:
            with lock:
                limit[0] += length
                if limit[0] > 40 * MiB:  # memory runs out inside the second 32 MiB unit
                    ctypes.set_errno(errno.ENOMEM)
                    return -1
        return int(real(addr, length, advice))

    lock = threading.Lock()
    monkeypatch.setattr(_linux, "_madvise", run_out)
    async with HostTier(big_units(fill_threads=1)) as tier:
        with pytest.raises(FillError) as info:
            await tier.wait_resident()
        assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOMEM
        assert info.value.resident_bytes == 32 * MiB == tier.statistics().resident_bytes
        assert len(await tier.allocate(16 * 32)) == 16 * 32  # the resident prefix still serves
        await tier.resize(32 * MiB)  # a shrink to the prefix clears the failure
        assert tier.statistics().fill_error is None
        check_tier(tier, settled=True)


async def test_strict_overcommit_opens_the_range_unit_by_unit(monkeypatch: pytest.MonkeyPatch, calls: Calls) -> None:
    # Under vm.overcommit_memory=2 a writable private mapping is charged in full: the one large
    # mprotect fails with ENOMEM, and each unit is opened (and charged) as it commits.
    spy = _linux.mprotect

    def strict(addr: int, length: int, writable: bool) -> None:
        if writable and length > 32 * MiB:
            raise OSError(errno.ENOMEM, "mprotect: Cannot allocate memory")
        spy(addr, length, writable)

    monkeypatch.setattr(_linux, "mprotect", strict)
    async with HostTier(big_units(fill_threads=2)) as tier:
        await tier.wait_resident()
        check_tier(tier, settled=True)
        assert (
            sorted(calls.mprotect)
            == [(4 * MiB, True), (4 * MiB, True), (8 * MiB, True), (16 * MiB, True)] + [(32 * MiB, True)] * 2
        )
        await tier.resize(32 * MiB)
        check_tier(tier, settled=True)


async def test_memory_below_the_target_but_above_the_watermark_is_never_handed_out(gate: PopulateGate) -> None:
    # Past the watermark the range is read-write (one mprotect covers the target) but holds no
    # committed unit: no slot there is handed out, and no raw copy may touch it.
    async with HostTier(small_config(quota=8 * MiB)) as tier, CopyEngine(None) as engine:
        gate.allow(2)
        await tier.wait_resident(2 * MiB)
        stats = tier.statistics()
        assert stats.resident_bytes == 2 * MiB and stats.target_bytes == 8 * MiB
        assert_perms(stats.base_address, stats.base_address + stats.target_bytes, RW, "the target")
        held = await tier.allocate(32)
        with pytest.raises(WouldBlock):
            tier.allocate_nowait()
        with pytest.raises(SlotError):
            tier.address(32)
        with pytest.raises(SlotError):
            tier.view(40)
        above = stats.base_address + 3 * MiB  # inside the target, above the watermark
        for dst, src in ((above, tier.address(held[0])), (tier.address(held[0]), above)):
            with pytest.raises(CopyPlanError, match="committed"):
                await engine.copy([(dst, src, 64 << 10)])
        waiting = asyncio.create_task(tier.allocate())
        await asyncio.sleep(0.02)
        assert not waiting.done()
        gate.release_all()
        assert await waiting == 32
        check_tier(tier)


def test_a_claim_touches_only_what_memory_covers(monkeypatch: pytest.MonkeyPatch) -> None:
    reserve = _headroom.reserve_bytes()
    monkeypatch.setattr(_headroom, "available_bytes", lambda: reserve + 100 * MiB)
    with _headroom.Claim(60 * MiB) as first:
        assert first.granted
        with _headroom.Claim(60 * MiB) as second:  # the first 60 MiB are in flight: not enough left
            assert not second.granted
        with _headroom.Claim(40 * MiB) as third:
            assert third.granted
    with _headroom.Claim(100 * MiB) as again:  # released: the whole room is back
        assert again.granted
    monkeypatch.setattr(_headroom, "available_bytes", lambda: None)
    with _headroom.Claim(MiB) as unknown:  # nothing reported: populate, which can report ENOMEM
        assert not unknown.granted


async def test_fill_threads_default_from_the_machine() -> None:
    async with HostTier(small_config(fill_threads=None)) as tier:
        await tier.wait_resident()
        threads = tier.statistics().fill_threads
        assert threads == default_fill_threads() and 1 <= threads <= 8


# -- transparent_huge_pages="auto" ----------------------------------------------------------------

BUDDYINFO = """\
Node 0, zone      DMA      1      1      1      0      2      1      1      0      1      1      3
Node 0, zone   Normal    412    230    118     61     30     17      9      5      4      2      6
Node 1, zone   Normal      0      0      0      0      0      0      0      0      0      0      1
"""


def test_free_huge_blocks_reads_buddyinfo(tmp_path: Path) -> None:
    path = tmp_path / "buddyinfo"
    path.write_text(BUDDYINFO)
    # Node 0: order 9 counts 1 + 2 blocks, order 10 counts 3 + 6, each two 2 MiB blocks.
    assert _hugepages.free_huge_blocks(0, path) == 1 + 2 + 2 * (3 + 6)
    assert _hugepages.free_huge_blocks(1, path) == 2
    assert _hugepages.free_huge_blocks(None, path) == 21 + 2
    assert _hugepages.free_huge_blocks(0, tmp_path / "missing") == 0


def auto_units(monkeypatch: pytest.MonkeyPatch, defrag: str, free_blocks: int, huge_gib_s: float = 2.0) -> None:
    """The kernel's THP settings and free blocks, and unit fill times as if 4 KiB pages ran at 1 GiB/s.

    Times are fixed because the real ones are the machine's: on the development VM a huge-page
    unit does fall to a tenth of the 4 KiB rate once the VM's free huge pages run out
    (docs/benchmarks.md), whatever the test says about ``defrag``.
    """
    monkeypatch.setattr(_hugepages, "kernel_settings", lambda: ("madvise", defrag))
    monkeypatch.setattr(_hugepages, "free_huge_blocks", lambda node: free_blocks)
    record = _hugepages.HugePagePolicy.record

    def timed(self: _hugepages.HugePagePolicy, huge: bool, length: int, seconds: float) -> None:
        record(self, huge, length, length / ((huge_gib_s if huge else 1.0) * (1 << 30)))

    monkeypatch.setattr(_hugepages.HugePagePolicy, "record", timed)


def huge_advised(tier: HostTier, offset: int) -> bool:
    return "hg" in smaps_flags(tier.statistics().base_address + offset)


async def test_thp_auto_where_the_fault_cannot_stall(monkeypatch: pytest.MonkeyPatch) -> None:
    auto_units(monkeypatch, "defer", 0)
    async with HostTier(big_units(fill_threads=1, transparent_huge_pages="auto")) as tier:
        await tier.wait_resident()
        s = check_tier(tier, settled=True)
        assert s.transparent_huge_pages == "auto" and not s.huge_pages_given_up
        assert s.huge_page_units == 5  # every unit but the first, which gave the 4 KiB rate
        assert not huge_advised(tier, 0) and huge_advised(tier, 64 * MiB)
        await tier.resize(32 * MiB)
        assert tier.statistics().huge_page_units == 3


async def test_thp_auto_stays_off_where_a_fault_could_compact(monkeypatch: pytest.MonkeyPatch) -> None:
    auto_units(monkeypatch, "madvise", 16)  # 32 MiB free in 2 MiB blocks: not twice a 32 MiB unit
    async with HostTier(big_units(fill_threads=2, transparent_huge_pages="auto")) as tier:
        await tier.wait_resident()
        s = tier.statistics()
        assert s.huge_page_units == 3  # the 4, 8 and 16 MiB ramp units fit, the 32 MiB ones do not
        assert not huge_advised(tier, 64 * MiB)


async def test_thp_auto_gives_up_after_a_unit_slower_than_small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    auto_units(monkeypatch, "defer", 0, huge_gib_s=0.1)  # compaction: a tenth of the 4 KiB rate
    async with HostTier(big_units(fill_threads=1, transparent_huge_pages="auto")) as tier:
        await tier.wait_resident()
        s = check_tier(tier, settled=True)
        assert s.huge_pages_given_up and s.huge_page_units == 1
        assert not huge_advised(tier, 64 * MiB)


async def test_the_fill_goes_on_while_the_event_loop_is_busy() -> None:
    """A loop that never idles (it gives up the GIL and takes it back on every iteration) starves
    any thread that needs the GIL often: the fill needs it about once per unit, and reads the
    memory available with the GIL held. Before that, 4 MiB of this tier took 6 s; now seconds."""
    config = small_config(quota=256 * MiB, max_quota=256 * MiB, commit_unit=64 * MiB, fill_chunk=64 * MiB)
    config = config.model_copy(update={"fill_threads": 2})
    async with HostTier(config) as tier:
        async with saturated() as spins:
            async with asyncio.timeout(120):  # a bound on a hang, not a speed goal
                await tier.wait_resident()
        assert spins[0] > 0
        check_tier(tier)


async def test_the_gil_handoff_runs_only_while_there_is_demand() -> None:
    config = small_config(quota=64 * MiB, max_quota=128 * MiB, commit_unit=16 * MiB, fill_chunk=16 * MiB)
    async with HostTier(config) as tier:
        hand = handoff(asyncio.get_running_loop())  # the tier's: one per loop
        await tier.wait_resident()
        await asyncio.sleep(0.05)  # the next tick sees the fill done and nothing pending: it stops
        assert not hand.ticking
        await tier.resize(128 * MiB)  # a grow starts it again
        await tier.wait_resident()
        await asyncio.sleep(0.05)
        assert not hand.ticking
        check_tier(tier)
    await asyncio.sleep(0.05)
    assert not hand.ticking


def test_gil_handoff_sleeps_on_its_loop_while_there_is_demand() -> None:
    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        assert handoff(loop) is handoff(loop)  # one per loop
        left = 3

        def source() -> bool:
            nonlocal left
            left -= 1
            return left >= 0

        hand = GilHandoff(loop, every=0.001, pause=0.0001)
        hand.add_source(source)
        hand.start()
        hand.start()  # idempotent: one timer
        await asyncio.sleep(0.1)
        assert not hand.ticking  # stopped by itself once the source is false
        by_source = hand.handoffs
        hand.hold()  # pending work keeps it going until released
        await asyncio.sleep(0.02)
        assert hand.ticking
        hand.release()
        await asyncio.sleep(0.02)
        assert not hand.ticking
        return by_source, hand.handoffs

    by_source, total = asyncio.run(main())
    assert by_source == 3 and total > 3
