from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiokvtier import HostTierConfig

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def small_config(**overrides: Any) -> HostTierConfig:
    """64 one-MiB units of 16 slots each: one populate call per unit, in order."""
    values: dict[str, Any] = dict(
        quota=64 * MiB,
        max_quota=256 * MiB,
        slot_size=64 * KiB,
        commit_unit=1 * MiB,
        fill_chunk=1 * MiB,
        fill_threads=1,
    )
    values.update(overrides)
    return HostTierConfig(**values)


async def eventually(predicate: Callable[[], bool], within: float = 5.0) -> None:
    """Wait (on the loop) until ``predicate()``: for what library threads finish after a call returns."""
    deadline = asyncio.get_running_loop().time() + within
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not true after {within} s: {predicate}")
        await asyncio.sleep(0.005)
