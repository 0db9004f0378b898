"""BlockStore.events(): who keeps a subscription alive, and what one that nobody reads costs.

On asyncio and uvloop. A subscription belongs to whoever holds it: one that
nobody references any more (never iterated, left part way, its reader
cancelled) stops receiving and is released; one held and not read keeps at
most ``event_limit`` events.
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc

import pytest

from aiokvtier import BlockEvent, EventSubscription, TierClosedError

from .helpers import eventually
from .test_store import bounded, open_store, pages


def subscribers(store: object) -> int:
    gc.collect()  # a subscription caught in a reference cycle goes at the next collection
    return store.statistics().subscribers  # type: ignore[attr-defined,no-any-return]


async def test_subscriptions_never_iterated_are_released_once_dropped() -> None:
    async with open_store(64) as (_tier, store):
        subs = [store.events() for _ in range(1000)]
        assert store.statistics().subscribers == 1000
        store.events()  # made and dropped in the same breath
        del subs
        assert subscribers(store) == 0


async def test_a_dropped_subscription_receives_nothing_and_costs_no_memory() -> None:
    # Before, each of these held a queue that every store appended to: 1,000 of them grew the
    # process by megabytes and made every store walk them all.
    async with open_store(64) as (_tier, store):
        for _ in range(1000):
            store.events()
        await bounded(store.store([-1], pages([-1])))  # what a first store allocates once
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for k in range(64):
                await bounded(store.store([k], pages([k])))
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        # 64 events queued in each of 1,000 subscriptions would be 1,000 x 64 pointers (512 KB) at least.
        assert grown < 200_000, grown


async def test_a_held_unread_subscription_keeps_at_most_event_limit_events() -> None:
    async with open_store(128, event_limit=8) as (_tier, store):
        events = store.events()
        for k in range(100):
            await bounded(store.store([k], pages([k])))
        assert "8/8 queued | 92 dropped" in repr(events)
        assert await bounded(anext(events)) == BlockEvent("stored", (92,), dropped=92)
        for k in range(93, 100):
            assert await bounded(anext(events)) == BlockEvent("stored", (k,))
        waiting = asyncio.create_task(anext(events))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # nothing more was queued
        waiting.cancel()
        assert store.statistics().subscribers == 1


async def test_a_subscription_made_before_a_store_sees_it_when_read_later() -> None:
    async with open_store(8) as (_tier, store):
        sub = store.events()
        await bounded(store.store([1], pages([1])))
        gc.collect()  # the store holds it weakly: its holder, here, keeps it
        async for event in sub:
            assert event == BlockEvent("stored", (1,))
            break
        assert store.statistics().subscribers == 1  # break leaves it held by `sub`
        del sub
        assert subscribers(store) == 0


async def test_a_reader_in_a_task_nobody_holds_keeps_reading() -> None:
    # Its task is referenced only by the future it waits on: the store holds the subscription of
    # a waiting reader strongly, or the collector would take the task with it.
    async with open_store(8) as (_tier, store):
        got: list[BlockEvent] = []

        async def reader() -> None:
            async for event in store.events():
                got.append(event)

        asyncio.create_task(reader())  # noqa: RUF006 - kept by nothing on purpose
        await asyncio.sleep(0)
        assert subscribers(store) == 1
        await bounded(store.store([1], pages([1])))
        await eventually(lambda: got == [BlockEvent("stored", (1,))])
        gc.collect()
        await bounded(store.store([2], pages([2])))
        await eventually(lambda: len(got) == 2)
        await bounded(store.aclose())
        await eventually(lambda: store.statistics().subscribers == 0)


async def test_a_cancelled_reader_releases_its_subscription() -> None:
    async with open_store(8) as (_tier, store):

        async def reader() -> None:
            async for _event in store.events():
                pass

        task = asyncio.create_task(reader())
        await asyncio.sleep(0)
        assert store.statistics().subscribers == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await bounded(task)
        del task
        # Released once the loop has run the callback that woke this test, which still holds the task (from
        # Python 3.12 on, wait_for awaits the task itself, as a plain await does)
        await eventually(lambda: subscribers(store) == 0)


async def test_a_cancelled_wait_leaves_a_held_subscription_as_it_was() -> None:
    async with open_store(8) as (_tier, store):
        events = store.events()
        waiting = asyncio.create_task(anext(events))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await bounded(waiting)
        await bounded(store.store([1], pages([1])))
        assert await bounded(anext(events)) == BlockEvent("stored", (1,))  # nothing lost
        assert store.statistics().subscribers == 1


async def test_a_subscription_left_part_way_is_released() -> None:
    async with open_store(8) as (_tier, store):
        events = store.events()
        await bounded(store.store([1, 2], pages([1, 2])))
        await bounded(store.store([3], pages([3])))
        assert await bounded(anext(events)) == BlockEvent("stored", (1, 2))
        del events  # one event still queued, no reader
        assert subscribers(store) == 0


async def test_aclose_ends_a_waiting_reader_and_releases_at_once() -> None:
    async with open_store(8) as (_tier, store):
        events = store.events()
        assert isinstance(events, EventSubscription)
        waiting = asyncio.create_task(anext(events))
        await asyncio.sleep(0)
        await bounded(events.aclose())
        with pytest.raises(StopAsyncIteration):
            await bounded(waiting)
        assert store.statistics().subscribers == 0
        await bounded(store.store([1], pages([1])))
        with pytest.raises(StopAsyncIteration):
            await bounded(anext(events))  # ended: received nothing since
        await bounded(events.aclose())  # idempotent
        assert "ended" in repr(events)

        async with store.events() as scoped:
            await bounded(store.store([2], pages([2])))
            assert await bounded(anext(scoped)) == BlockEvent("stored", (2,))
            assert store.statistics().subscribers == 1
        assert store.statistics().subscribers == 0


async def test_at_store_close_a_subscription_ends_after_its_queue_and_is_released() -> None:
    async with open_store(8) as (_tier, store):
        events = store.events()
        await bounded(store.store([1], pages([1])))
        await bounded(store.aclose())
        assert store.statistics().subscribers == 1  # one event still to read
        assert [e async for e in events] == [BlockEvent("stored", (1,))]
        assert store.statistics().subscribers == 0
        with pytest.raises(StopAsyncIteration):
            await bounded(anext(events))
        with pytest.raises(TierClosedError):
            store.events()


async def test_two_readers_of_one_subscription_share_its_events() -> None:
    async with open_store(8) as (_tier, store):
        events = store.events()
        first = asyncio.create_task(anext(events))
        second = asyncio.create_task(anext(events))
        await asyncio.sleep(0)
        await bounded(store.store([1], pages([1])))
        await bounded(store.store([2], pages([2])))
        got = {await bounded(first), await bounded(second)}
        assert got == {BlockEvent("stored", (1,)), BlockEvent("stored", (2,))}
