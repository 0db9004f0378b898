"""aiokvtier: an asyncio-native host-memory tier for LLM KV caches.

The tier's range is reserved once at ``max_quota``; fill threads make it
resident unit by unit and publish a watermark, so the first allocation comes
as soon as the first small unit is resident.

The names below are imported on first use (``aiokvtier.HostTier`` imports
the tier's modules, numpy and pydantic then), so ``import aiokvtier`` and
the ``aiokvtier`` command start in milliseconds, and a Ctrl-C while the
command starts meets code that handles it.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from ._cache import Cache as Cache
    from ._config import CacheConfig as CacheConfig
    from ._config import DiskTierConfig as DiskTierConfig
    from ._config import GpuTierConfig as GpuTierConfig
    from ._config import HostTierConfig as HostTierConfig
    from ._config import MooncakeTierConfig as MooncakeTierConfig
    from ._copy._engine import CopyEngine as CopyEngine
    from ._copy._engine import CopyStatistics as CopyStatistics
    from ._copy._engine import StartedCopy as StartedCopy
    from ._copy._requests import Pages as Pages
    from ._cuda._sm import SmOptions as SmOptions
    from ._cuda._static import StaticHostMem as StaticHostMem
    from ._disk._tier import DiskStatistics as DiskStatistics
    from ._disk._tier import DiskTier as DiskTier
    from ._errors import AiokvtierError as AiokvtierError
    from ._errors import BlockNotFound as BlockNotFound
    from ._errors import ConfigError as ConfigError
    from ._errors import CopyPlanError as CopyPlanError
    from ._errors import CudaError as CudaError
    from ._errors import CudaUnavailableError as CudaUnavailableError
    from ._errors import DecommitError as DecommitError
    from ._errors import DiskTierBusy as DiskTierBusy
    from ._errors import FillError as FillError
    from ._errors import MooncakeError as MooncakeError
    from ._errors import NumaPolicyError as NumaPolicyError
    from ._errors import OutOfSlots as OutOfSlots
    from ._errors import PoolError as PoolError
    from ._errors import PoolLostError as PoolLostError
    from ._errors import QuotaError as QuotaError
    from ._errors import SlotError as SlotError
    from ._errors import TierClosedError as TierClosedError
    from ._errors import WouldBlock as WouldBlock
    from ._host._placement import Placement as Placement
    from ._host._statistics import TierStatistics as TierStatistics
    from ._host._tier import HostTier as HostTier
    from ._mooncake._tier import MooncakeStatistics as MooncakeStatistics
    from ._mooncake._tier import MooncakeTier as MooncakeTier
    from ._pool._client import AttachedPool as AttachedPool
    from ._pool._events import PoolEvents as PoolEvents
    from ._pool._owner import Pool as Pool
    from ._pool._statistics import PoolStatistics as PoolStatistics
    from ._store._events import BlockEvent as BlockEvent
    from ._store._events import EventSubscription as EventSubscription
    from ._store._policy import EvictionPolicy as EvictionPolicy
    from ._store._result import StoreResult as StoreResult
    from ._store._store import BlockStore as BlockStore
    from ._store._store import StoreStatistics as StoreStatistics

__version__ = "0.1.0"

__all__ = [
    "AiokvtierError",
    "AttachedPool",
    "BlockEvent",
    "BlockNotFound",
    "BlockStore",
    "Cache",
    "CacheConfig",
    "ConfigError",
    "CopyEngine",
    "CopyStatistics",
    "CopyPlanError",
    "CudaError",
    "CudaUnavailableError",
    "DecommitError",
    "DiskStatistics",
    "DiskTier",
    "DiskTierBusy",
    "DiskTierConfig",
    "EventSubscription",
    "EvictionPolicy",
    "FillError",
    "GpuTierConfig",
    "HostTier",
    "HostTierConfig",
    "MooncakeError",
    "MooncakeStatistics",
    "MooncakeTier",
    "MooncakeTierConfig",
    "NumaPolicyError",
    "OutOfSlots",
    "Pages",
    "Placement",
    "Pool",
    "PoolError",
    "PoolEvents",
    "PoolLostError",
    "PoolStatistics",
    "QuotaError",
    "SlotError",
    "SmOptions",
    "StartedCopy",
    "StaticHostMem",
    "StoreResult",
    "StoreStatistics",
    "TierClosedError",
    "TierStatistics",
    "WouldBlock",
]

# Each public name by the private module that defines it; a test checks this against __all__
# and against the imports above.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "._cache": ("Cache",),
    "._config": ("CacheConfig", "DiskTierConfig", "GpuTierConfig", "HostTierConfig", "MooncakeTierConfig"),
    "._copy._engine": ("CopyEngine", "CopyStatistics", "StartedCopy"),
    "._copy._requests": ("Pages",),
    "._cuda._sm": ("SmOptions",),
    "._cuda._static": ("StaticHostMem",),
    "._errors": (
        "AiokvtierError", "BlockNotFound", "ConfigError", "CopyPlanError", "CudaError", "CudaUnavailableError",
        "DecommitError", "DiskTierBusy", "FillError", "MooncakeError", "NumaPolicyError", "OutOfSlots", "PoolError",
        "PoolLostError", "QuotaError", "SlotError", "TierClosedError", "WouldBlock",
    ),
    "._disk._tier": ("DiskStatistics", "DiskTier"),
    "._host._placement": ("Placement",),
    "._host._statistics": ("TierStatistics",),
    "._host._tier": ("HostTier",),
    "._mooncake._tier": ("MooncakeStatistics", "MooncakeTier"),
    "._pool._client": ("AttachedPool",),
    "._pool._events": ("PoolEvents",),
    "._pool._owner": ("Pool",),
    "._pool._statistics": ("PoolStatistics",),
    "._store._events": ("BlockEvent", "EventSubscription"),
    "._store._policy": ("EvictionPolicy",),
    "._store._result": ("StoreResult",),
    "._store._store": ("BlockStore", "StoreStatistics"),
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


if not _typing.TYPE_CHECKING:  # type checkers see the imports above, and an unknown name stays an error

    def __getattr__(name: str) -> _typing.Any:
        module = _MODULE_OF.get(name)
        if module is None:
            raise AttributeError(f"module 'aiokvtier' has no attribute {name!r}")
        value = getattr(_importlib.import_module(module, __name__), name)
        globals()[name] = value  # found once: later lookups do not come here
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})
