"""The GIL hand-off's light holds (``GilHandoff.hold_lightly_until``), which every copy takes: a
counter rather than a timer per copy, a pause only for copies pending throughout a tick's interval,
the ticking stopped by the first tick that finds nothing held; and copies that still land, bit-exact,
next to an event loop that never idles, on asyncio and uvloop.
"""

from __future__ import annotations

import asyncio

import numpy as np

from aiokvtier import CopyEngine, HostTier, StaticHostMem
from aiokvtier._handoff import GilHandoff, handoff

from .helpers import KiB, MiB, eventually, saturated, small_config
from .invariants import check_tier

EVERY = 0.005
HANG = 30.0


def rig() -> GilHandoff:
    return GilHandoff(asyncio.get_running_loop(), every=EVERY, pause=0.0001)


async def test_a_light_hold_pending_throughout_an_interval_pauses_the_loop() -> None:
    hand = rig()
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    hand.hold_lightly_until(future)
    assert hand.ticking
    await asyncio.sleep(EVERY * 8)
    assert hand.handoffs >= 2  # the first tick may follow a gap; every later one pauses
    future.set_result(None)
    await eventually(lambda: not hand.ticking, within=1.0)  # the next tick finds nothing held
    paused = hand.handoffs
    await asyncio.sleep(EVERY * 4)
    assert hand.handoffs == paused and not hand.ticking


async def test_light_holds_that_end_within_each_interval_never_pause() -> None:
    """One short copy after another: one timer, armed by the first, and no tick pauses for them."""
    hand = GilHandoff(asyncio.get_running_loop(), every=0.25, pause=0.0001)
    loop = asyncio.get_running_loop()
    for _ in range(200):
        future: asyncio.Future[None] = loop.create_future()
        hand.hold_lightly_until(future)
        await asyncio.sleep(0)
        future.set_result(None)
        await asyncio.sleep(0)  # the done callback runs
    assert hand.ticking  # left to its tick
    await eventually(lambda: not hand.ticking, within=5.0)
    assert hand.handoffs == 0


async def test_light_and_counted_holds_keep_each_other_s_demand() -> None:
    """A counted hold released (which stops the timer at once when nothing else asks) leaves the
    ticking to a light hold still pending; releasing a light hold twice never goes below zero."""
    hand = rig()
    loop = asyncio.get_running_loop()
    light: asyncio.Future[None] = loop.create_future()
    hand.hold_lightly_until(light)
    hand.hold()
    hand.release()
    assert hand.ticking  # the light hold still asks
    await asyncio.sleep(EVERY * 6)
    assert hand.handoffs >= 1
    light.set_result(None)
    await asyncio.sleep(0)
    hand.release_light()  # one too many: ignored
    future: asyncio.Future[None] = loop.create_future()
    hand.hold_lightly_until(future)  # counted from zero again
    future.set_result(None)
    await asyncio.sleep(0)
    await eventually(lambda: not hand.ticking, within=1.0)


async def test_copies_land_next_to_a_loop_that_never_idles() -> None:
    """Eight tasks copy 1 MiB requests while another keeps the loop busy (a millisecond of Python
    between iterations); every copy lands bit-exact and the loop's own hand-off stops afterwards."""
    config = small_config(quota=64 * MiB, max_quota=64 * MiB, slot_size=64 * KiB)
    async with (
        HostTier(config) as tier,
        StaticHostMem(8 * MiB) as stage,
        CopyEngine(None) as engine,
    ):
        await tier.wait_resident()
        slots = np.asarray(await tier.allocate(128), dtype=np.int64)
        rng = np.random.default_rng(7)
        pages = np.frombuffer(stage.view(), dtype=np.uint8).reshape(128, 64 * KiB)
        pages[:] = rng.integers(0, 256, pages.shape, dtype=np.uint8)
        want = pages.copy()

        async def mover(k: int) -> None:
            mine = slots[16 * k : 16 * (k + 1)]
            for _ in range(10):
                await engine.to_host(tier, mine, pages[16 * k : 16 * (k + 1)])
                await engine.to_device(tier, mine, pages[16 * k : 16 * (k + 1)])

        async with saturated() as spins:
            async with asyncio.timeout(HANG):  # a bound on a hang, not a speed goal
                async with asyncio.TaskGroup() as group:
                    for k in range(8):
                        group.create_task(mover(k))
        assert spins[0] > 0
        assert np.array_equal(pages, want)
        assert engine.statistics().jobs_completed == 160
        check_tier(tier)
    await eventually(lambda: not handoff(asyncio.get_running_loop()).ticking, within=1.0)
