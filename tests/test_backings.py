"""The tier is handed what builds its backing: a ``Backings`` of one's own is used, and its faults undo the open."""

from __future__ import annotations

import threading

import pytest

from aiokvtier import HostTier
from aiokvtier._config import ResolvedHostConfig
from aiokvtier._host._backing import Backing, HostBacking, host_backing

from .helpers import MiB, small_config
from .invariants import check_tier


class Recording:
    """Builds the host backing and remembers what the tier asked for, and on which thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.built: list[HostBacking] = []
        self.released: list[list[tuple[int, int]]] = []

    def numa_node(self, config: ResolvedHostConfig) -> int | None:
        self.calls.append(("numa_node", threading.current_thread().name))
        return None

    def make(self, config: ResolvedHostConfig, node: int | None) -> Backing:
        self.calls.append(("make", threading.current_thread().name))
        backing = host_backing(config, node)
        release = backing.release

        def spy(committed: list[tuple[int, int]]) -> None:
            self.released.append(list(committed))
            release(committed)

        backing.release = spy  # type: ignore[method-assign]
        self.built.append(backing)
        return backing


async def test_a_tier_uses_the_backings_it_is_handed_off_the_loop() -> None:
    backings = Recording()
    tier = await HostTier.open(small_config(), backings=backings)
    try:
        assert [name for name, _ in backings.calls] == ["numa_node", "make"]
        assert all(thread.startswith("aiokvtier-tier") for _, thread in backings.calls)
        assert tier.statistics().base_address == backings.built[0].base
        slot = await tier.allocate()
        tier.view(slot)[:4] = b"abcd"
        assert bytes(tier.view(slot)[:4]) == b"abcd"
        check_tier(tier)
    finally:
        await tier.aclose()
    assert len(backings.released) == 1


class Refusing(Recording):
    def make(self, config: ResolvedHostConfig, node: int | None) -> Backing:
        raise OSError(12, "no room for this range")


async def test_a_backing_that_cannot_be_built_fails_the_open_with_its_error() -> None:
    backings = Refusing()
    with pytest.raises(OSError, match="no room for this range"):
        await HostTier.open(small_config(quota=8 * MiB), backings=backings)
    assert [name for name, _ in backings.calls] == ["numa_node"]
