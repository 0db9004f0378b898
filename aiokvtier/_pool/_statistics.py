"""A snapshot of a pool: its tier's figures and its shared blocks'."""

from __future__ import annotations

from dataclasses import dataclass

from .._host._statistics import TierStatistics

__all__ = ["PoolStatistics"]


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """What [``Pool.statistics()``][aiokvtier.Pool.statistics] and
    [``AttachedPool.statistics()``][aiokvtier.AttachedPool.statistics] return."""

    tier: TierStatistics
    """The shared tier's figures, as the owner's ``HostTier.statistics()`` gives them
    (``backing`` is ``"shared"``)."""
    path: str
    """The socket the pool is served on."""
    owner_pid: int
    clients: int
    """Processes attached now."""
    slots_attached: int
    """Slots that attached processes hold through ``allocate`` (not blocks)."""
    blocks: int
    """Visible blocks of the shared store."""
    blocks_pinned: int
    """Blocks a load (in any process) is reading now: never evicted."""
    claims: int
    """Stores in flight (claims not yet committed or aborted)."""
    queries: int
    hits: int
    misses: int
    stores: int
    present: int
    skipped: int
    loads: int
    evictions: int
    discards: int
    bytes_stored: int
    bytes_loaded: int
