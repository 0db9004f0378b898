"""The default ``Backings``: the host backing, or the CUDA ones a config names.

The one module that hands the tier (``aiokvtier._host``) what ``aiokvtier._cuda``
builds, so that the host package never imports the CUDA one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._host._backing import Backing, host_backing

if TYPE_CHECKING:
    from ._config import ResolvedHostConfig

__all__ = ["DefaultBackings"]


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
