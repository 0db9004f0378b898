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
    owner_lookups: int = 0
    """Lookups the owner answered itself (also in ``queries``): an attached process asks it when the index
    mirror gave no consistent read within a few tries, when it has no mirror (not x86-64, or a tier too
    large for one), or once the pool closes. Rising beside ``queries`` under load: the owner's queue is
    in the lookups' way."""
    mirror_retries: int = 0
    """Reads of the index mirror done over by attached processes because a step of the owner's write fell
    inside them (told with the lookups' counts): up to a few dozen per hundred lookups while processes store
    thousands of keys a call; a lookup gives up after 8 in a row and asks the owner."""
