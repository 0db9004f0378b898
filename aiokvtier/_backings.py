"""The ``Backings`` a tier is handed: the host backing, or the CUDA ones a config names; and a pool's.

The one module that hands the tier (``aiokvtier._host``) what ``aiokvtier._cuda``
builds, so that the host package never imports the CUDA one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._errors import ConfigError
from ._host._backing import Backing, host_backing
from ._host._shared import SharedBacking

if TYPE_CHECKING:
    from ._config import ResolvedHostConfig

__all__ = ["DefaultBackings", "SharedBackings"]


class DefaultBackings:
    """``backing="host"`` without CUDA; ``"register"`` and ``"vmm"`` through the driver."""

    def numa_node(self, config: ResolvedHostConfig) -> int | None:
        if config.numa_node != "auto":
            return config.numa_node
        if config.device is None:
            return None
        from ._cuda._driver import device_numa_node

        return device_numa_node(config.device)

    def make(self, config: ResolvedHostConfig, node: int | None) -> Backing:
        if config.backing == "host":
            return host_backing(config, node)
        from ._cuda._backings import make_backing

        return make_backing(config, node)


class SharedBackings:
    """``Backings`` for a pool's tier: the shared backing, with the NUMA node the config names.

    Keeps the backing it made (``made``) so that the pool can hand its
    ``fd`` to attached processes.
    """

    def __init__(self) -> None:
        self.made: SharedBacking | None = None

    def numa_node(self, config: ResolvedHostConfig) -> int | None:
        return DefaultBackings().numa_node(config)

    def make(self, config: ResolvedHostConfig, node: int | None) -> Backing:
        strict, huge = not config.allow_remote_numa_fallback, config.transparent_huge_pages is True
        if config.backing == "register":
            from ._cuda._backings import SharedRegisterBacking

            assert config.device is not None  # a register backing names its device (the config's check)
            self.made = SharedRegisterBacking(
                config.max_quota, device=config.device, node=node, strict_numa=strict, huge_pages=huge
            )
        elif config.backing == "host":
            self.made = SharedBacking(config.max_quota, node=node, strict_numa=strict, huge_pages=huge)
        else:
            raise ConfigError(
                f"a pool shares host memory, registered with the owner's GPU or not (backing='host' or "
                f"'register'); backing={config.backing!r} is not shared yet"
            )
        return self.made
