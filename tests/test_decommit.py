"""A shrink whose decommit fails, with real faults: pages of the tail locked with ``mlock``.

``madvise(MADV_DONTNEED)`` refuses a locked mapping with EINVAL, after it has
discarded the pages of the unit before the locked ones. The tier must say so
(``DecommitError``), hand back the rest of the tail, keep the units it could
not decommit (stranded), and reuse them on a later grow: make resident again
what the failed call discarded (with copies, touching such a page would raise
SIGBUS) and move the watermark past them. Every step is checked against the
kernel (``mincore``, ``/proc/self/maps``), and every wait is bounded so that a
regression fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from aiokvtier import DecommitError, FillError, HostTier, TierClosedError
from aiokvtier._host import _linux, _userfault

from .conftest import PopulateGate, mappings_in
from .helpers import MiB, eventually, small_config
from .invariants import check_tier, wait_no_library_threads

pytestmark = pytest.mark.timeout(120)

WAIT = 10.0
"""Seconds after which an await counts as a hang."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

LOCKED = 4 * _linux.PAGE_SIZE
"""Bytes locked in a unit: a few pages, far below the usual RLIMIT_MEMLOCK (8 MiB)."""
INTO = 64 << 10
"""Where in a unit they are locked: past its start, so that the failed madvise discards the pages before them."""


def lock(addr: int, length: int = LOCKED) -> None:
    """``mlock`` what the application would; skips the test where the kernel refuses it."""
    if _libc.mlock(addr, length):
        err = ctypes.get_errno()
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        pytest.skip(f"mlock refused ({os.strerror(err)}; RLIMIT_MEMLOCK {soft})")


def unlock(addr: int, length: int = LOCKED) -> None:
    _libc.munlock(addr, length)  # ENOMEM once the tier has unmapped the range: nothing left to unlock


@contextmanager
def locked(*addresses: int) -> Iterator[None]:
    try:
        for addr in addresses:
            lock(addr)
        yield
    finally:
        for addr in addresses:
            unlock(addr)


def resident_pages(addr: int, length: int) -> int:
    pages = length // _linux.PAGE_SIZE
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(addr, length, vec):
        raise OSError(ctypes.get_errno(), "mincore")
    return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())


PAGES = MiB // _linux.PAGE_SIZE


def fill_methods() -> list[Any]:
    copy = pytest.param(
        "copy",
        marks=pytest.mark.skipif(not _userfault.supported(), reason="the fill copies only on Linux 6.9+"),
    )
    return [copy, "touch"]


@pytest.fixture(params=fill_methods())
def method(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "touch":
        monkeypatch.setattr(_userfault, "supported", lambda: False)
    return str(request.param)


async def open_resident(quota: int = 8 * MiB, **overrides: Any) -> HostTier:
    tier = await HostTier.open(small_config(quota=quota, **overrides))
    await asyncio.wait_for(tier.wait_resident(), WAIT)
    return tier


async def closed_cleanly(tier: HostTier) -> None:
    base = tier.statistics().base_address
    await asyncio.wait_for(tier.aclose(), WAIT)
    assert tier.released
    assert not mappings_in(base, tier.config.resolved.max_quota)
    await wait_no_library_threads()


async def shrink_fails(tier: HostTier, quota: int) -> DecommitError:
    with pytest.raises(DecommitError) as info:
        await asyncio.wait_for(tier.resize(quota), WAIT)
    error = info.value
    assert isinstance(error.__cause__, OSError) and error.__cause__.errno == errno.EINVAL, repr(error.__cause__)
    return error


# -- the defect -----------------------------------------------------------------------------------


async def test_a_grow_reuses_the_unit_a_locked_tail_kept(method: str) -> None:
    tier = await open_resident()
    s = tier.statistics()
    base = s.base_address
    assert s.fill_method == method
    try:
        with locked(base + 4 * MiB + INTO):
            error = await shrink_fails(tier, 4 * MiB)
            message = str(error)
            assert "could not be decommitted" in message and "stay committed" in message, message
            assert f"+{4 * MiB}..+{5 * MiB}" in message and "1 MiB" in message, message
            assert "later grow" in message and "madvise" in message and "munlock" in message, message
            assert error.committed == ((4 * MiB, MiB),) and error.committed_bytes == MiB
            # The shrink stands; the rest of the tail was handed back.
            s = check_tier(tier, settled=True)
            assert (s.quota, s.slots_total, s.stranded_bytes) == (4 * MiB, 64, MiB)
            assert not s.filling and s.fill_error is None
            assert resident_pages(base + 5 * MiB, 3 * MiB) == 0
            # madvise discarded the pages before the locked ones, then gave up.
            assert resident_pages(base + 4 * MiB, MiB) < PAGES

            # The grow over the kept unit completes (it waited forever), still locked.
            await asyncio.wait_for(tier.resize(8 * MiB), WAIT)
            await asyncio.wait_for(tier.wait_resident(), WAIT)
            s = check_tier(tier, settled=True)
            assert (s.resident_bytes, s.stranded_bytes, s.filling) == (8 * MiB, 0, False)
            # Resident again in full: with copies, a discarded page would raise SIGBUS when touched.
            assert resident_pages(base + 4 * MiB, 4 * MiB) == 4 * PAGES
            slots = await asyncio.wait_for(tier.allocate(128), WAIT)
            for slot in slots:
                view = tier.view(slot)
                view[0], view[-1] = 1, 2
                view.release()
            tier.free_many(slots)
    finally:
        await closed_cleanly(tier)


async def test_a_grow_that_allocates_and_waits_from_every_side_completes() -> None:
    tier = await open_resident()
    base = tier.statistics().base_address
    try:
        with locked(base + 4 * MiB + INTO):
            await shrink_fails(tier, 4 * MiB)
            await asyncio.wait_for(tier.resize(8 * MiB), WAIT)
            taken = await asyncio.wait_for(
                asyncio.gather(
                    tier.allocate(64),  # the slots below the kept unit
                    tier.allocate(16),  # the kept unit's
                    asyncio.to_thread(tier.wait_resident_blocking, 8 * MiB, WAIT),
                    tier.wait_resident(),
                ),
                WAIT,
            )
            assert sorted(taken[0] + taken[1]) == list(range(80))
            assert tier.allocate_nowait() == 80
            check_tier(tier, settled=True)
    finally:
        await closed_cleanly(tier)


# -- the neighbourhood ------------------------------------------------------------------------------


async def test_a_failure_in_the_middle_of_the_tail_hands_back_the_rest(method: str) -> None:
    tier = await open_resident()
    base = tier.statistics().base_address
    try:
        with locked(base + 4 * MiB + INTO, base + 5 * MiB + INTO, base + 7 * MiB + INTO):
            error = await shrink_fails(tier, 2 * MiB)
            assert error.committed == ((4 * MiB, 2 * MiB), (7 * MiB, MiB)), error.committed
            assert "3 of its 6 unit(s)" in str(error), str(error)
            s = check_tier(tier, settled=True)
            assert (s.quota, s.stranded_bytes) == (2 * MiB, 3 * MiB)
            for unit in (2, 3, 6):  # the units around the locked ones were handed back
                assert resident_pages(base + unit * MiB, MiB) == 0, unit
            # A grow into the middle: 2 and 3 are committed, 4 and 5 reused; 7 stays stranded past it.
            await asyncio.wait_for(tier.resize(6 * MiB), WAIT)
            await asyncio.wait_for(tier.wait_resident(), WAIT)
            s = check_tier(tier, settled=True)
            assert (s.resident_bytes, s.stranded_bytes) == (6 * MiB, MiB)
            assert resident_pages(base + 2 * MiB, 4 * MiB) == 4 * PAGES
            await asyncio.wait_for(tier.resize(8 * MiB), WAIT)
            await asyncio.wait_for(tier.wait_resident(), WAIT)
            s = check_tier(tier, settled=True)
            assert (s.resident_bytes, s.stranded_bytes) == (8 * MiB, 0)
            assert resident_pages(base, 8 * MiB) == 8 * PAGES
    finally:
        await closed_cleanly(tier)


async def test_a_second_shrink_retries_what_the_first_could_not_decommit() -> None:
    tier = await open_resident()
    base = tier.statistics().base_address
    try:
        lock(base + 7 * MiB + INTO)
        error = await shrink_fails(tier, 6 * MiB)
        assert error.committed == ((7 * MiB, MiB),)
        # Still locked: the second shrink hands back its own tail and lists the stranded unit again.
        error = await shrink_fails(tier, 3 * MiB)
        assert error.committed == ((7 * MiB, MiB),) and "1 of its 4 unit(s)" in str(error), str(error)
        s = check_tier(tier, settled=True)
        assert (s.quota, s.stranded_bytes) == (3 * MiB, MiB)
        assert resident_pages(base + 3 * MiB, 3 * MiB) == 0
        # Unlocked: a resize to the same quota hands the unit back.
        unlock(base + 7 * MiB + INTO)
        await asyncio.wait_for(tier.resize(3 * MiB), WAIT)
        s = check_tier(tier, settled=True)
        assert (s.quota, s.stranded_bytes) == (3 * MiB, 0)
        assert resident_pages(base + 7 * MiB, MiB) == 0
        # Nothing stranded: the same quota again changes nothing.
        await asyncio.wait_for(tier.resize(3 * MiB), WAIT)
        assert check_tier(tier, settled=True) == tier.statistics()
    finally:
        unlock(base + 7 * MiB + INTO)
        await closed_cleanly(tier)


async def test_a_grow_whose_recommit_fails_fails_there_like_any_fill(gate: PopulateGate) -> None:
    gate.allow(8)  # the first fill: one populate call per unit
    tier = await open_resident()
    base = tier.statistics().base_address
    try:
        with locked(base + 4 * MiB + INTO):
            await shrink_fails(tier, 4 * MiB)
            gate.fail(8)  # making the kept unit resident again runs out of memory
            await asyncio.wait_for(tier.resize(8 * MiB), WAIT)
            with pytest.raises(FillError) as info:
                await asyncio.wait_for(tier.wait_resident(), WAIT)
            assert info.value.failed_offset == 4 * MiB and "injected" in str(info.value.__cause__)
            s = check_tier(tier)
            assert (s.resident_bytes, s.stranded_bytes, s.filling) == (4 * MiB, MiB, False)
            assert s.fill_error is not None
            await asyncio.wait_for(tier.wait_resident(4 * MiB), WAIT)  # below the failure: served
            assert len(await asyncio.wait_for(tier.allocate(64), WAIT)) == 64
            with pytest.raises(FillError):
                await asyncio.wait_for(tier.allocate(), WAIT)
            # A shrink to the failure clears it; the unit, still locked, stays stranded.
            await shrink_fails(tier, 4 * MiB)
            s = check_tier(tier, settled=True)
            assert (s.fill_error, s.stranded_bytes) == (None, MiB)
        gate.release_all()
        await asyncio.wait_for(tier.resize(8 * MiB), WAIT)
        await asyncio.wait_for(tier.wait_resident(), WAIT)
        s = check_tier(tier, settled=True)
        assert (s.resident_bytes, s.stranded_bytes, s.fill_error) == (8 * MiB, 0, None)
        assert resident_pages(base + 4 * MiB, MiB) == PAGES
    finally:
        gate.release_all()
        await closed_cleanly(tier)


async def test_a_grow_whose_mprotect_fails_after_a_failed_shrink(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tier = await open_resident()
    base = tier.statistics().base_address
    real = _linux.mprotect
    answer: list[int] = []

    def refuse_opening(addr: int, length: int, writable: bool) -> None:
        if writable and answer:
            raise OSError(answer.pop(), "mprotect: injected")
        real(addr, length, writable)

    monkeypatch.setattr(_linux, "mprotect", refuse_opening)
    try:
        with locked(base + 4 * MiB + INTO):
            await shrink_fails(tier, 4 * MiB)
            before = tier.statistics()
            # Refused outright: the grow raises and nothing changes.
            answer.append(errno.EACCES)
            with pytest.raises(OSError, match="injected"):
                await asyncio.wait_for(tier.resize(8 * MiB), WAIT)
            s = check_tier(tier, settled=True)
            assert (s.quota, s.target_bytes, s.stranded_bytes) == (before.quota, before.target_bytes, MiB)
            # ENOMEM (strict overcommit): the backing opens unit by unit, the kept unit included.
            answer.append(errno.ENOMEM)
            await asyncio.wait_for(tier.resize(8 * MiB), WAIT)
            await asyncio.wait_for(tier.wait_resident(), WAIT)
            s = check_tier(tier, settled=True)
            assert (s.resident_bytes, s.stranded_bytes) == (8 * MiB, 0)
            assert resident_pages(base + 4 * MiB, MiB) == PAGES
            warned = [r for r in caplog.records if "unit by unit" in r.getMessage()]
            assert [r.levelno for r in warned] == [logging.WARNING]  # a fallback
            # Opening unit by unit, a unit whose decommit fails is closed (PROT_NONE) all the same.
            error = await shrink_fails(tier, 4 * MiB)
            assert error.committed == ((4 * MiB, MiB),)
            check_tier(tier, settled=True)
            await asyncio.wait_for(tier.resize(6 * MiB), WAIT)
            await asyncio.wait_for(tier.wait_resident(), WAIT)
            assert check_tier(tier, settled=True).stranded_bytes == 0
    finally:
        await closed_cleanly(tier)


async def test_close_after_a_failed_decommit_releases_everything() -> None:
    tier = await open_resident()
    base = tier.statistics().base_address
    with locked(base + 4 * MiB + INTO, base + 6 * MiB + INTO):
        await shrink_fails(tier, 2 * MiB)
        assert tier.statistics().stranded_bytes == 2 * MiB
        await closed_cleanly(tier)  # munmap takes locked pages too
        s = tier.statistics()
        assert s.closed and not s.filling
    with pytest.raises(TierClosedError):
        await tier.resize(8 * MiB)


async def test_a_failing_shrink_racing_close() -> None:
    tier = await open_resident()
    base = tier.statistics().base_address
    with locked(base + 4 * MiB + INTO):
        shrink = asyncio.create_task(tier.resize(4 * MiB))
        await asyncio.sleep(0)
        close = asyncio.create_task(tier.aclose())
        outcomes = await asyncio.wait_for(asyncio.gather(shrink, close, return_exceptions=True), WAIT)
    assert isinstance(outcomes[0], (DecommitError, TierClosedError)), outcomes
    assert outcomes[1] is None
    assert tier.released and not mappings_in(base, tier.config.resolved.max_quota)
    await wait_no_library_threads()


async def test_a_grow_over_a_kept_unit_racing_close(gate: PopulateGate) -> None:
    gate.allow(8)
    tier = await open_resident()
    base = tier.statistics().base_address
    with locked(base + 4 * MiB + INTO):
        await shrink_fails(tier, 4 * MiB)
        await asyncio.wait_for(tier.resize(8 * MiB), WAIT)
        await eventually(lambda: gate.calls == 9)  # the fill thread is held making unit 4 resident again
        assert gate.seen[8][:2] == (base + 4 * MiB, INTO)  # only the pages the failed madvise discarded
        waiter = asyncio.create_task(tier.wait_resident())
        taker = asyncio.create_task(tier.allocate(128))
        close = asyncio.create_task(tier.aclose())
        await asyncio.sleep(0.05)
        assert not close.done()  # the teardown waits for the fill thread
        gate.release_all()
        outcomes = await asyncio.wait_for(asyncio.gather(waiter, taker, close, return_exceptions=True), WAIT)
    for outcome in outcomes[:2]:
        assert outcome is None or isinstance(outcome, (list, TierClosedError)), outcomes
    assert outcomes[2] is None
    assert tier.released and not mappings_in(base, tier.config.resolved.max_quota)
    await wait_no_library_threads()
