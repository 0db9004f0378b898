"""The errors aiokvtier raises, under one base.

Each with its second base, if any, and what it means:

    AiokvtierError
    ├── WouldBlock                 the slot is not resident yet (allocate_nowait)
    ├── OutOfSlots                 every slot of the quota is allocated
    ├── ConfigError (ValueError)   a config this machine cannot honour (found at open)
    ├── SlotError (ValueError)     double free, foreign or out-of-range slot id
    ├── QuotaError (ValueError)    a resize the tier cannot honour
    ├── TierClosedError            the tier (or engine) is closed
    ├── FillError                  committing part of the tier failed; ``__cause__`` says why
    ├── DecommitError              a shrink stands, but part of its tail stays committed
    ├── NumaPolicyError            a strict NUMA placement that cannot be applied
    ├── CudaUnavailableError       a device was asked for where no CUDA driver is usable
    ├── CudaError                  a driver call failed; keeps the CUresult name
    ├── CopyPlanError (ValueError) a copy the planner refuses (spans registrations, leaves the range)
    ├── BlockNotFound (KeyError)   a block store has no block for a key
    ├── DiskTierBusy               another opener holds a disk tier's directory
    ├── MooncakeError              a Mooncake Store client that cannot be had (missing wheel, no master)
    └── PoolError                  attaching to a pool failed (no socket, refused, not a pool)
        └── PoolLostError (TierClosedError)   the pool's owner went away
"""

from __future__ import annotations

import copyreg
from typing import Any

__all__ = [
    "AiokvtierError",
    "BlockNotFound",
    "ConfigError",
    "CopyPlanError",
    "CudaError",
    "CudaUnavailableError",
    "DecommitError",
    "DiskTierBusy",
    "FillError",
    "MooncakeError",
    "NumaPolicyError",
    "OutOfSlots",
    "PoolError",
    "PoolLostError",
    "QuotaError",
    "SlotError",
    "TierClosedError",
    "WouldBlock",
]


class AiokvtierError(Exception):
    """Base of every error aiokvtier raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as it is and rebuilt without __init__ (cls.__new__(cls, *args) sets args, then the
        # attributes): the default calls the class with args, which an error whose __init__ takes its
        # fields refuses (FillError, CudaError) or misreads (BlockNotFound took its message for the key).
        # copyreg's, so that a pickle names no private module of ours.
        return (copyreg.__newobj__, (type(self), *self.args), self.__dict__)  # type: ignore[attr-defined]


class WouldBlock(AiokvtierError):
    """The next slot is not resident yet; ``await allocate()`` would wait for it."""


class OutOfSlots(AiokvtierError):
    """Every slot of the current quota is allocated."""


class ConfigError(AiokvtierError, ValueError):
    """A valid config this machine cannot honour, found when opening (e.g. VMM granularity)."""


class SlotError(AiokvtierError, ValueError):
    """A slot id that is out of range, not allocated, or already free."""


class QuotaError(AiokvtierError, ValueError):
    """A resize the tier cannot honour (past ``max_quota``, or slots in use past the new end)."""


class TierClosedError(AiokvtierError):
    """The object was closed; its memory may no longer be touched through it."""


class FillError(AiokvtierError):
    """Making part of the tier resident failed.

    The original error (``OSError`` with its errno, or a [``CudaError``][aiokvtier.CudaError]) is
    the ``__cause__``. Memory below ``resident_bytes`` stays usable.
    """

    def __init__(self, message: str, *, resident_bytes: int, failed_offset: int) -> None:
        super().__init__(message)
        self.resident_bytes = resident_bytes
        self.failed_offset = failed_offset


class DecommitError(AiokvtierError):
    """A shrink stands (quota, slots and fill target are cut), but part of the tail stays committed.

    Handing a unit of the tail back failed: for instance ``madvise(MADV_DONTNEED)``
    answers EINVAL where the application locked pages of it (``mlock``,
    ``mlockall``). Those units keep their memory: they are released at close,
    a later grow over them reuses them (the fill makes whatever the failed call
    discarded resident again before the watermark passes them), and a later
    shrink tries to hand them back again. The first failure is the
    ``__cause__`` (``OSError`` with its errno, or a ``CudaError``).

    :ivar committed: ``(offset, length)`` of each run of the tail that stays
        committed, offsets from the tier's base, in ascending order.
    :ivar committed_bytes: their total length.
    """

    def __init__(self, message: str, *, committed: tuple[tuple[int, int], ...]) -> None:
        super().__init__(message)
        self.committed = committed
        self.committed_bytes = sum(length for _, length in committed)


class NumaPolicyError(AiokvtierError):
    """A NUMA placement was required (``allow_remote_numa_fallback=False``) and cannot be applied."""


class CudaUnavailableError(AiokvtierError):
    """A CUDA device was requested but the driver or ``cuda-bindings`` is not usable here."""


class CudaError(AiokvtierError):
    """A CUDA driver call failed.

    :ivar result: the ``CUresult`` name, e.g. ``"CUDA_ERROR_INVALID_VALUE"``.
    :ivar call: the driver function that returned it.
    """

    def __init__(self, call: str, result: str, code: int) -> None:
        super().__init__(f"{call} failed: {result} ({code})")
        self.call = call
        self.result = result
        self.code = code


class CopyPlanError(AiokvtierError, ValueError):
    """A copy the planner refuses: it spans two registrations or leaves the committed range."""


def key_text(key: object) -> str:
    """A block key as a message shows it: its repr, or the size of an int too long for decimal text
    (past ``sys.get_int_max_str_digits()``, whose repr is a ValueError)."""
    try:
        return repr(key)
    except ValueError:
        if not isinstance(key, int):
            raise
        return f"<an int of {key.bit_length()} bits>"


class BlockNotFound(AiokvtierError, KeyError):
    """A [``BlockStore``][aiokvtier.BlockStore] has no block for a key; nothing was copied.

    :ivar key: the first key that is missing.
    """

    def __init__(self, key: bytes | int) -> None:
        super().__init__(f"no block for key {key_text(key)} in the store")
        self.key = key

    def __str__(self) -> str:  # KeyError would quote the message again
        return str(self.args[0])


class DiskTierBusy(AiokvtierError):
    """Another process, or another ``DiskTier`` of this one, has the disk tier's directory open."""


class PoolError(AiokvtierError):
    """Attaching to a pool failed: no socket at the path, permission denied, refused, or not a pool.

    Also what an attached process gets for a request the owner refused for a
    reason of its own (the message says which).
    """


class PoolLostError(PoolError, TierClosedError):
    """The pool's owner went away (it closed or died): every pending and later call of the attached
    process raises this. The memory it mapped stays valid until it closes; attach again to a
    restarted owner."""


class MooncakeError(AiokvtierError):
    """A ``MooncakeTier`` cannot open: the ``mooncake`` wheel or the libraries it links against are
    missing, or the client's setup failed or did not finish within ``open_timeout`` (the
    master or the metadata server unreachable). The message says which; ``__cause__`` keeps
    an import error."""


# Tracebacks and reprs name each error where it is imported from (aiokvtier.PoolError), not this private
# module; pickle finds them there too (aiokvtier's module __getattr__ imports them).
for _name in __all__:
    globals()[_name].__module__ = "aiokvtier"
del _name
