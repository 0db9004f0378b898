"""Cache: a whole ``CacheConfig`` opened at once (host tier, disk and Mooncake tiers, copy engine, block store)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from contextlib import AsyncExitStack, contextmanager
from types import TracebackType
from typing import Any, Self

from ._config import CacheConfig, DiskTierConfig, GpuTierConfig, HostTierConfig, MooncakeTierConfig
from ._copy._engine import CopyEngine
from ._disk._tier import DiskTier
from ._errors import ConfigError
from ._host._tier import HostTier
from ._lifecycle import finish
from ._mooncake._tier import MooncakeTier
from ._store._policy import EvictionPolicy
from ._store._store import BlockStore

__all__ = ["Cache"]


class Cache:
    """The tiers a ``CacheConfig`` names, opened together, with a ``BlockStore`` over them.

    ``async with await Cache.open(config, fingerprint=...) as cache:`` or
    ``cache = await Cache.open(...)`` then ``await cache.aclose()``. What it
    opens, from the config's tiers:

    - the host tier (required): a ``HostTier``, the store's slots;
    - a GPU tier: a ``CopyEngine`` on its device (the store then copies device
      pages; the GPU tier's own memory stays the engine's to manage);
    - a disk tier: a ``DiskTier`` below the host tier, blocks of the host
      tier's slot size, under ``fingerprint`` (name the model and its KV
      layout: blocks of another fingerprint are never found);
    - a Mooncake tier: a ``MooncakeTier`` below those, blocks of the host
      tier's slot size, under the same ``fingerprint`` (the store registers
      the host tier's slots with it).

    Closing closes them all, store first. An open that fails or is
    cancelled closes whatever it had opened before the error reaches the
    caller.
    """

    def __init__(
        self,
        store: BlockStore,
        tier: HostTier,
        engine: CopyEngine | None,
        disk: DiskTier | None,
        remote: MooncakeTier | None = None,
    ) -> None:
        self.store = store
        self.tier = tier
        self.engine = engine
        """The engine for the GPU tier's device; None without a GPU tier."""
        self.disk = disk
        """The disk tier; None without one."""
        self.remote = remote
        """The Mooncake tier; None without one."""
        self._stack: AsyncExitStack | None = None

    @classmethod
    async def open(
        cls,
        config: CacheConfig | Mapping[str, Any],
        *,
        fingerprint: str | None = None,
        policy: str | EvictionPolicy = "lru",
        admit_after: int = 2,
    ) -> Cache:
        """Open every tier of ``config``, then the store.

        :raises pydantic.ValidationError: ``config`` is a mapping that does not validate.
        :raises ConfigError: no host tier, a disk or Mooncake tier without a ``fingerprint``, or a host
            tier registered for another device than the GPU tier's (a host tier that names no
            device is registered for the GPU tier's).
        :raises DiskTierBusy: another process has the disk tier's directory open.
        :raises MooncakeError: the Mooncake tier's master does not answer, its setup failed, or it
            refused the host tier's slots.

        And whatever opening each part raises (see ``HostTier.open()``, ``CopyEngine.open()``,
        ``DiskTier.open()``, ``MooncakeTier.open()``), with a note naming the part (an ``OSError`` of
        an ``mmap`` or of a directory says nothing of which).
        """
        if not isinstance(config, CacheConfig):
            config = await asyncio.to_thread(CacheConfig.model_validate, config)  # a disk path is stat'ed
        tiers = {tier.kind: tier for tier in config.tiers}
        host = tiers.get("host")
        if not isinstance(host, HostTierConfig):
            raise ConfigError("a cache needs a host tier: its slots hold the blocks")
        gpu, disk, remote = tiers.get("gpu"), tiers.get("disk"), tiers.get("mooncake")
        for name, below in (("disk", disk), ("Mooncake", remote)):
            if below is not None and not fingerprint:
                raise ConfigError(f"a cache with a {name} tier needs a fingerprint (the model and its KV layout)")
        device = gpu.device if isinstance(gpu, GpuTierConfig) else None
        if device is not None and host.device not in (None, device):
            raise ConfigError(f"the host tier is registered for device {host.device}, the GPU tier is device {device}")
        if device is not None and host.device is None:  # the host tier is made GPU-usable for that device
            host = HostTierConfig.model_validate({**host.model_dump(exclude_unset=True), "device": device})
        task = asyncio.ensure_future(
            cls._open(
                host,
                device,
                disk if isinstance(disk, DiskTierConfig) else None,
                remote if isinstance(remote, MooncakeTierConfig) else None,
                fingerprint,
                policy,
                admit_after,
            )
        )
        try:
            return await finish(task)
        except asyncio.CancelledError:
            if task.done() and not task.cancelled() and task.exception() is None:
                await finish(task.result().aclose())  # opened just before the cancellation landed
            raise

    @classmethod
    async def _open(
        cls,
        host: HostTierConfig,
        device: int | None,
        disk_config: DiskTierConfig | None,
        remote_config: MooncakeTierConfig | None,
        fingerprint: str | None,
        policy: str | EvictionPolicy,
        admit_after: int,
    ) -> Cache:
        # Run to its end even when the caller is cancelled (finish() above): a cancelled open
        # closes what it opened, in order, before the cancellation reaches the caller.
        async with AsyncExitStack() as stack:
            with _stage("host tier"):
                tier = await stack.enter_async_context(HostTier(host))
            engine = None
            if device is not None:
                with _stage("copy engine"):
                    engine = await stack.enter_async_context(CopyEngine(device))
            disk = None
            if disk_config is not None:
                assert fingerprint is not None
                with _stage("disk tier"):
                    disk = await stack.enter_async_context(
                        DiskTier(disk_config, block_size=tier.slot_size, fingerprint=fingerprint)
                    )
            remote = None
            if remote_config is not None:
                assert fingerprint is not None
                with _stage("Mooncake tier"):
                    remote = await stack.enter_async_context(
                        MooncakeTier(remote_config, block_size=tier.slot_size, fingerprint=fingerprint)
                    )
            with _stage("block store"):
                store = await stack.enter_async_context(
                    BlockStore(tier, engine, policy, disk=disk, remote=remote, admit_after=admit_after)
                )
            cache = cls(store, tier, engine, disk, remote)
            cache._stack = stack.pop_all()
        return cache

    async def aclose(self) -> None:
        """Close the store, then the Mooncake tier, the disk tier, the engine and the host tier. Idempotent."""
        stack, self._stack = self._stack, None
        if stack is not None:
            await finish(stack.aclose())

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        parts = ["host", *(["gpu"] if self.engine is not None else []), *(["disk"] if self.disk is not None else [])]
        parts += ["mooncake"] if self.remote is not None else []
        return f"<Cache [{' + '.join(parts)} | {len(self.store)} blocks]>"


@contextmanager
def _stage(part: str) -> Iterator[None]:
    """Name the part whose open failed in the error's notes (the traceback shows them)."""
    try:
        yield
    except Exception as exc:
        exc.add_note(f"aiokvtier: the cache's {part} failed to open")
        raise
