"""Configuration models, validated once at the edge.

Every model is frozen and forbids unknown keys; sizes accept integers or
strings such as ``"64GiB"``. Defaults that depend on the host (``max_quota``,
``commit_unit``) are resolved during validation, so a validated config holds
concrete numbers and the hot paths never touch pydantic.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    DirectoryPath,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from . import _sysinfo
from ._host._linux import PAGE_SIZE

__all__ = ["CacheConfig", "DiskTierConfig", "GpuTierConfig", "HostTierConfig"]

PositiveSize = Annotated[ByteSize, Field(gt=0)]
MiB = 1 << 20


def default_max_quota() -> int:
    """Host memory as the OS reports it, capped by the cgroup memory limit."""
    limit = _sysinfo.cgroup_memory_limit()
    total = _sysinfo.host_memory_bytes()
    return min(total, limit) if limit is not None else total


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class HostTierConfig(_Frozen):
    """The host tier: a progressively filled, slot-addressed range of CPU memory.

    :param quota: bytes to make resident (rounded up to whole commit units).
    :param max_quota: the address range reserved once; resizes stay below it.
        None: host memory as the OS reports it, capped by the cgroup limit. On
        VMs whose MemTotal grows as memory is used, pass it explicitly.
    :param slot_size: bytes per slot, a multiple of the page size.
    :param fill_chunk: what a fill thread claims at a time; stopping and
        progress are checked between commit units inside it.
    :param commit_unit: unit of commit, decommit and GPU registration, a
        multiple of ``slot_size``. None: the multiple of ``slot_size`` nearest
        ``fill_chunk``.
    :param fill_threads: threads making the range resident.
    :param numa_node: node to place pages on; ``"auto"`` is the GPU's node when
        ``device`` is set and no binding otherwise; None never binds.
    :param allow_remote_numa_fallback: True: MPOL_PREFERRED, and first touch by
        the bound fill thread where mbind is denied. False: MPOL_BIND, and a
        denied mbind fails the open.
    :param transparent_huge_pages: opt the range into THP (MADV_HUGEPAGE);
        default off, since direct compaction can slow population tenfold.
    :param device: CUDA ordinal that will copy to and from the tier.
    :param backing: ``"host"`` (no GPU registration), ``"register"``,
        ``"vmm"`` or ``"auto"``.
    """

    kind: Literal["host"] = "host"
    quota: PositiveSize
    max_quota: PositiveSize | None = Field(default=None, validate_default=True)
    slot_size: PositiveSize = Field(default=ByteSize(2 * MiB), validate_default=True)
    fill_chunk: PositiveSize = ByteSize(512 * MiB)
    commit_unit: PositiveSize | None = Field(default=None, validate_default=True)
    fill_threads: Annotated[int, Field(ge=1, le=256)] = 1
    numa_node: Annotated[int, Field(ge=0)] | Literal["auto"] | None = "auto"
    allow_remote_numa_fallback: bool = True
    transparent_huge_pages: bool = False
    device: Annotated[int, Field(ge=0)] | None = None
    backing: Literal["auto", "host", "register", "vmm"] = "auto"

    @field_validator("max_quota")
    @classmethod
    def _max_quota(cls, value: ByteSize | None, info: ValidationInfo) -> ByteSize:
        quota = info.data.get("quota")
        if value is None:
            value = ByteSize(default_max_quota())
            if quota is not None and quota > value:
                raise ValueError(
                    f"quota ({quota.human_readable()}) exceeds the host memory available "
                    f"({value.human_readable()}); set max_quota explicitly to reserve more"
                )
        elif quota is not None and value < quota:
            raise ValueError(f"max_quota ({value.human_readable()}) is below quota ({quota.human_readable()})")
        return value

    @field_validator("slot_size")
    @classmethod
    def _slot_size(cls, value: ByteSize, info: ValidationInfo) -> ByteSize:
        if value % PAGE_SIZE:
            raise ValueError(f"slot_size ({value}) must be a multiple of the {PAGE_SIZE}-byte page")
        quota = info.data.get("quota")
        if quota is not None and value > quota:
            raise ValueError(f"slot_size ({value}) is larger than quota ({quota})")
        return value

    @field_validator("commit_unit")
    @classmethod
    def _commit_unit(cls, value: ByteSize | None, info: ValidationInfo) -> ByteSize | None:
        slot = info.data.get("slot_size")
        if slot is None:
            return value
        if value is None:
            chunk = info.data.get("fill_chunk") or 512 * MiB
            return ByteSize(max(1, round(chunk / slot)) * slot)
        if value < slot:
            raise ValueError(f"commit_unit ({value}) is smaller than slot_size ({slot})")
        if value % slot:
            raise ValueError(f"commit_unit ({value}) must be a multiple of slot_size ({slot})")
        return value

    @field_validator("numa_node")
    @classmethod
    def _numa_node(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int):
            nodes = _sysinfo.online_nodes()
            if nodes is not None and value not in nodes:
                raise ValueError(f"numa_node {value} is not an online node (online: {sorted(nodes)})")
        return value

    @model_validator(mode="after")
    def _backing_needs_device(self) -> HostTierConfig:
        if self.backing in ("register", "vmm") and self.device is None:
            raise ValueError(f"backing={self.backing!r} needs a CUDA device: set device")
        return self

    @property
    def resolved_backing(self) -> Literal["host", "register", "vmm"]:
        """The backing ``"auto"`` stands for (see docs/backings.md for the rule)."""
        if self.backing != "auto":
            return self.backing
        return "host" if self.device is None else "vmm"


class GpuTierConfig(_Frozen):
    """The GPU tier: KV pages in device memory, the fastest level."""

    kind: Literal["gpu"] = "gpu"
    quota: PositiveSize
    device: Annotated[int, Field(ge=0)] = 0


class DiskTierConfig(_Frozen):
    """The disk tier: spilled pages in files under an existing directory."""

    kind: Literal["disk"] = "disk"
    quota: PositiveSize
    path: DirectoryPath


TierConfig = Annotated[GpuTierConfig | HostTierConfig | DiskTierConfig, Field(discriminator="kind")]
_ORDER = {"gpu": 0, "host": 1, "disk": 2}


class CacheConfig(_Frozen):
    """A whole cache: its tiers, fastest first (GPU, host, disk), validated together.

    Every tier is validated and every error reported in one ValidationError;
    nothing is allocated by building a config.
    """

    tiers: Annotated[list[TierConfig], Field(min_length=1)]

    @model_validator(mode="after")
    def _ordered(self) -> CacheConfig:
        kinds = [tier.kind for tier in self.tiers]
        ranks = [_ORDER[kind] for kind in kinds]
        if any(a >= b for a, b in itertools.pairwise(ranks)):
            raise ValueError(f"tiers must be ordered gpu, host, disk with at most one of each; got {kinds}")
        return self
