from __future__ import annotations

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
    )
    values.update(overrides)
    return HostTierConfig(**values)
