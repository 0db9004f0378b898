"""What a store call did with each key: the answer of ``BlockStore.store`` and ``AttachedPool.store``.

A module of its own so that an attached process answers its first store without importing the block
store (its import took 17-90 ms, paid by that first call).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._keys import Key

__all__ = ["StoreResult"]


@dataclass(frozen=True, slots=True)
class StoreResult:
    """What [``BlockStore.store()``][aiokvtier.BlockStore.store] did with each key, in the caller's order."""

    stored: tuple[Key, ...]
    """Newly stored (copied)."""
    present: tuple[Key, ...]
    """Already stored, or stored meanwhile by a concurrent call that this one waited for: not copied again."""
    skipped: tuple[Key, ...]
    """Not stored: no room even after eviction, or, with ``wait=False``, no resident slot (or a key that another
    store, waiting for the fill, is storing). No key after the first skipped one is in ``stored``: every key
    before it was stored or present, and from it on the call stored nothing (keys found present may follow)."""
