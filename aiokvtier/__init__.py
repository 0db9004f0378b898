"""aiokvtier: an asyncio-native host-memory tier for LLM KV caches.

The tier's range is reserved once at ``max_quota``; fill threads make it
resident unit by unit and publish a watermark, so the first allocation comes
as soon as the first small unit is resident.
"""

from __future__ import annotations

from ._config import CacheConfig as CacheConfig
from ._config import DiskTierConfig as DiskTierConfig
from ._config import GpuTierConfig as GpuTierConfig
from ._config import HostTierConfig as HostTierConfig
from ._cuda._engine import CopyEngine as CopyEngine
from ._cuda._engine import CopyStatistics as CopyStatistics
from ._cuda._engine import StartedCopy as StartedCopy
from ._cuda._static import StaticHostMem as StaticHostMem
from ._errors import AiokvtierError as AiokvtierError
from ._errors import BlockNotFound as BlockNotFound
from ._errors import ConfigError as ConfigError
from ._errors import CopyPlanError as CopyPlanError
from ._errors import CudaError as CudaError
from ._errors import CudaUnavailableError as CudaUnavailableError
from ._errors import DecommitError as DecommitError
from ._errors import FillError as FillError
from ._errors import NumaPolicyError as NumaPolicyError
from ._errors import OutOfSlots as OutOfSlots
from ._errors import QuotaError as QuotaError
from ._errors import SlotError as SlotError
from ._errors import TierClosedError as TierClosedError
from ._errors import WouldBlock as WouldBlock
from ._host._placement import Placement as Placement
from ._host._statistics import TierStatistics as TierStatistics
from ._host._tier import HostTier as HostTier
from ._store._events import BlockEvent as BlockEvent
from ._store._events import EventSubscription as EventSubscription
from ._store._policy import EvictionPolicy as EvictionPolicy
from ._store._store import BlockStore as BlockStore
from ._store._store import StoreResult as StoreResult
from ._store._store import StoreStatistics as StoreStatistics

__version__ = "0.1.0"

__all__ = [
    "AiokvtierError",
    "BlockEvent",
    "BlockNotFound",
    "BlockStore",
    "CacheConfig",
    "ConfigError",
    "CopyEngine",
    "CopyStatistics",
    "CopyPlanError",
    "CudaError",
    "CudaUnavailableError",
    "DecommitError",
    "DiskTierConfig",
    "EventSubscription",
    "EvictionPolicy",
    "FillError",
    "GpuTierConfig",
    "HostTier",
    "HostTierConfig",
    "NumaPolicyError",
    "OutOfSlots",
    "Placement",
    "QuotaError",
    "SlotError",
    "StartedCopy",
    "StaticHostMem",
    "StoreResult",
    "StoreStatistics",
    "TierClosedError",
    "TierStatistics",
    "WouldBlock",
]
