"""Memoryviews of slots that cannot outlive the memory under them.

A view is a ``memoryview`` over a ctypes array at the slot's address. The
ledger keeps a count of live views per slot (a weakref finalizer drops it
when the view and everything derived from it is released). The tier uses
the count to refuse a shrink that would unmap a slot someone still views, and
to defer unmapping at close until the last view is gone: no view ever points
at unmapped memory. A view made on another thread than the close's may have
passed its owner's open check as the close begins: the ledger refuses views
from the moment the close asks it about them (``defer_until_empty``), under
the lock that counts them, so a view is either counted (and holds the memory)
or refused.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Callable

from .._errors import TierClosedError

__all__ = ["ViewLedger"]


class ViewLedger:
    """:param owner: what to call the owner in the error for a view refused at close ("HostTier")."""

    def __init__(self, slot_size: int, owner: str = "owner of the memory") -> None:
        self._buffer_type: type[ctypes.Array[ctypes.c_ubyte]] = type("SlotBuffer", (ctypes.c_ubyte * slot_size,), {})
        self._live: dict[int, int] = {}
        self._lock = threading.Lock()  # finalizers run on whichever thread drops the view
        self._on_empty: Callable[[], None] | None = None
        self._owner = owner
        self._closed = False

    def view(self, slot: int, address: int) -> memoryview:
        """:raises TierClosedError: the owner's close has begun releasing the memory."""
        buffer = self._buffer_type.from_address(address)
        with self._lock:
            if self._closed:
                raise TierClosedError(f"the {self._owner} is closed: its memory is released, no view of it is made")
            self._live[slot] = self._live.get(slot, 0) + 1
        weakref.finalize(buffer, self._dropped, slot)
        return memoryview(buffer).cast("B")

    def _dropped(self, slot: int) -> None:
        with self._lock:
            left = self._live[slot] - 1
            if left:
                self._live[slot] = left
            else:
                del self._live[slot]
            on_empty = self._on_empty if not self._live else None
            if on_empty is not None:
                self._on_empty = None
        if on_empty is not None:
            on_empty()

    def count(self) -> int:
        return sum(self._live.values())

    def live(self) -> list[int]:
        """Slots with a live view."""
        return list(self._live)

    def highest(self) -> int:
        """Highest slot with a live view, or -1."""
        return max(self._live, default=-1)

    def defer_until_empty(self, callback: Callable[[], None]) -> bool:
        """Arrange for ``callback`` to run when the last view is released.

        :returns: False if views are live (``callback`` will run on the thread
            that drops the last one); True if none are, and the caller runs it.
        """
        with self._lock:
            self._closed = True  # no view from now on: the memory goes now, or with the last one
            if self._live:
                self._on_empty = callback
                return False
        return True
