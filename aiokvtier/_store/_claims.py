"""Claims: the keys store calls are writing now, so that a store of the same key waits instead of copying twice.

A store call claims its missing keys before its first await and settles the
claim when it ends, stored or not: the claim's future gives the keys it
stored, and a waiter stores the others itself (or skips them). Everything
runs on the store's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from ._index import I64
from ._keys import Key

__all__ = ["Claim", "Claims"]


class Claim:
    """The keys one store call is storing, and the future its waiters learn the stored keys from."""

    __slots__ = ("_future", "_keys", "_set", "_stored", "filling")

    def __init__(self, keys: list[Key], filling: bool) -> None:
        self._keys = keys
        self._set: set[Key] | None = None
        self._future: asyncio.Future[Sequence[Key]] | None = None
        self._stored: Sequence[Key] | None = None
        self.filling = filling
        """The call may be waiting for the fill (``wait=True``, taking slots): ``wait=False`` calls skip its keys."""

    @property
    def keys(self) -> set[Key]:
        """As a set, made when a concurrent call first asks (most calls have none)."""
        if self._set is None:
            self._set = set(self._keys)
        return self._set

    @property
    def future(self) -> asyncio.Future[Sequence[Key]]:
        """Gives the keys the call stored once it ended. Made when first asked for (by a call that waits
        for this one: most calls have none), done at once where the call ended already."""
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
            if self._stored is not None:
                self._future.set_result(self._stored)
        return self._future

    def settle(self, stored: Sequence[Key]) -> None:
        self._stored = stored
        if self._future is not None:
            self._future.set_result(stored)


class Claims:
    """The claims of the store calls running now."""

    __slots__ = ("_claims",)

    def __init__(self) -> None:
        self._claims: set[Claim] = set()

    def __len__(self) -> int:
        return len(self._claims)

    def open(self, keys: list[Key], filling: bool) -> Claim:
        """Claim ``keys`` for a call (``filling``: it may wait for the fill). Every claim is made here (tests
        record them here, to act when one settles)."""
        claim = Claim(keys, filling)
        self._claims.add(claim)
        return claim

    def settle(self, claim: Claim, stored: Sequence[Key]) -> None:
        """The call ended: its waiters learn which of its keys it stored."""
        self._claims.discard(claim)
        claim.settle(stored)

    def elsewhere(
        self, keys: list[Key], missing: I64, wait: bool
    ) -> tuple[I64, dict[asyncio.Future[Sequence[Key]], list[int]], list[int]]:
        """Split ``missing`` into the keys no other call is storing, per call those it is, and (``wait=False``)
        those a call that may be waiting for the fill is storing: waiting for that call would wait for the fill."""
        indices = missing.tolist()
        missing_keys = [keys[i] for i in indices]
        elsewhere: dict[Key, Claim] = {}
        for other in self._claims:
            for key in other.keys.intersection(missing_keys):
                elsewhere[key] = other
        if not elsewhere:
            return missing, {}, []
        free: list[int] = []
        filling: list[int] = []
        waiting: dict[asyncio.Future[Sequence[Key]], list[int]] = {}
        for i, key in zip(indices, missing_keys, strict=True):
            claim = elsewhere.get(key)
            if claim is None:
                free.append(i)
            elif claim.filling and not wait:
                filling.append(i)
            else:
                waiting.setdefault(claim.future, []).append(i)
        return np.asarray(free, dtype=np.int64), waiting, filling
