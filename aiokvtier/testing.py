"""Test doubles for code built on aiokvtier.

``RecordingBackend`` stands in for what moves a CopyEngine's bytes:
``CopyEngine(None, backend=RecordingBackend(hold=True))`` checks, plans and
orders requests as any engine does, records every planned job as an
``IssuedCopy``, and completes each one on the engine's completion thread
only when the test releases (or fails) it, so planning, batching, ordering,
cancellation and closing are tested without a GPU.
"""

from __future__ import annotations

from ._copy._recording import IssuedCopy as IssuedCopy
from ._copy._recording import RecordingBackend as RecordingBackend

__all__ = ["IssuedCopy", "RecordingBackend"]
