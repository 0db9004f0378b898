"""A hypothesis state machine: allocate / free / resize / close against a plain model."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aiokvtier import HostTier, HostTierConfig, OutOfSlots, QuotaError, SlotError, TierClosedError

from .conftest import fill_threads_alive

SLOT = 4096
MAX_SLOTS = 96


class TierMachine(RuleBasedStateMachine):
    loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop

    def __init__(self) -> None:
        super().__init__()
        self.runner = asyncio.Runner(loop_factory=type(self).loop_factory)
        self.tier: HostTier | None = None
        self.closed = False

    def run(self, coro: Any) -> Any:
        return self.runner.run(coro)

    @initialize(slots=st.integers(1, MAX_SLOTS))
    def open(self, slots: int) -> None:
        cfg = HostTierConfig(
            quota=slots * SLOT, max_quota=MAX_SLOTS * SLOT, slot_size=SLOT, commit_unit=4 * SLOT, fill_chunk=8 * SLOT
        )
        self.tier = self.run(HostTier.open(cfg))
        self.run(self.tier.wait_resident())
        self.total = slots
        self.allocated: set[int] = set()
        self.free_stack: list[int] = []
        self.next_fresh = 0

    def expected_take(self, n: int) -> list[int]:
        k = min(n, len(self.free_stack))
        taken = self.free_stack[len(self.free_stack) - k :][::-1]
        del self.free_stack[len(self.free_stack) - k :]
        taken += list(range(self.next_fresh, self.next_fresh + n - k))
        self.next_fresh += n - k
        return taken

    @precondition(lambda self: not self.closed)
    @rule(n=st.integers(1, 10), nowait=st.booleans())
    def allocate(self, n: int, nowait: bool) -> None:
        assert self.tier is not None
        available = len(self.free_stack) + self.total - self.next_fresh
        if n > available:
            with pytest.raises(OutOfSlots):
                self.run(self.tier.allocate(n))
            return
        if nowait and n == 1:
            got = [self.tier.allocate_nowait()]
        else:
            got = self.run(self.tier.allocate(n)) if n > 1 else [self.run(self.tier.allocate())]
        assert got == self.expected_take(n)
        for slot in got:
            self.tier.view(slot)[:4] = slot.to_bytes(4, "little")
        self.allocated.update(got)

    @precondition(lambda self: not self.closed and self.allocated)
    @rule(data=st.data(), many=st.booleans())
    def free(self, data: st.DataObject, many: bool) -> None:
        assert self.tier is not None
        if many:
            chosen = data.draw(st.lists(st.sampled_from(sorted(self.allocated)), min_size=1, max_size=5, unique=True))
            self.tier.free_many(chosen)
        else:
            chosen = [data.draw(st.sampled_from(sorted(self.allocated)))]
            self.tier.free(chosen[0])
        self.allocated.difference_update(chosen)
        self.free_stack.extend(chosen)

    @precondition(lambda self: not self.closed)
    @rule(slot=st.integers(-2, MAX_SLOTS + 2))
    def free_invalid(self, slot: int) -> None:
        assert self.tier is not None
        if slot in self.allocated:
            return
        with pytest.raises(SlotError):
            self.tier.free(slot)

    @precondition(lambda self: not self.closed)
    @rule(slots=st.integers(0, MAX_SLOTS + 8))
    def resize(self, slots: int) -> None:
        assert self.tier is not None
        if slots == 0 or slots > MAX_SLOTS or any(s >= slots for s in self.allocated):
            with pytest.raises(QuotaError):
                self.run(self.tier.resize(slots * SLOT))
            return
        self.run(self.tier.resize(slots * SLOT))
        self.run(self.tier.wait_resident())
        if slots < self.total:
            self.free_stack = [s for s in self.free_stack if s < slots]
            self.next_fresh = min(self.next_fresh, slots)
        self.total = slots

    @precondition(lambda self: not self.closed)
    @rule()
    def close(self) -> None:
        assert self.tier is not None
        self.run(self.tier.aclose())
        self.closed = True

    @precondition(lambda self: self.closed)
    @rule(n=st.integers(1, 3))
    def use_after_close(self, n: int) -> None:
        assert self.tier is not None
        with pytest.raises(TierClosedError):
            self.run(self.tier.allocate(n))
        with pytest.raises(TierClosedError):
            self.tier.free(0)
        with pytest.raises(TierClosedError):
            self.run(self.tier.resize(SLOT))
        self.run(self.tier.aclose())

    @invariant()
    def figures_match(self) -> None:
        if self.tier is None or self.closed:
            return
        stats = self.tier.statistics()
        assert stats.slots_total == self.total
        assert stats.slots_allocated == len(self.allocated)
        assert stats.slots_free == len(self.free_stack) + self.total - self.next_fresh
        for slot in self.allocated:
            assert int.from_bytes(self.tier.view(slot)[:4], "little") == slot

    def teardown(self) -> None:
        if self.tier is not None:
            self.run(self.tier.aclose())
        self.runner.close()
        assert not fill_threads_alive()


class UvloopTierMachine(TierMachine):
    pass


try:
    import uvloop

    UvloopTierMachine.loop_factory = uvloop.new_event_loop
except ImportError:  # pragma: no cover
    pass

_settings = settings(max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck))
TestTierAsyncio = TierMachine.TestCase
TestTierAsyncio.settings = _settings
TestTierUvloop = UvloopTierMachine.TestCase
TestTierUvloop.settings = _settings
