"""Configuration models, validated once at the edge.

Every model is frozen and forbids unknown keys; sizes accept integers or
strings such as ``"64GiB"``. Defaults that depend on the host (``max_quota``,
``commit_unit``) are resolved during validation, so a validated config holds
concrete numbers, and ``HostTierConfig.resolved`` hands them to the hot paths
as plain ints, so those never touch pydantic.
"""

from __future__ import annotations

import difflib
import itertools
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Any, Literal, Self, SupportsIndex

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    DirectoryPath,
    Field,
    ModelWrapValidatorHandler,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from . import _sysinfo
from ._errors import QuotaError
from ._host._linux import PAGE_SIZE

__all__ = [
    "CacheConfig",
    "DiskTierConfig",
    "GpuTierConfig",
    "HostTierConfig",
    "MooncakeTierConfig",
    "ResolvedHostConfig",
    "default_fill_threads",
    "parse_quota",
]

PositiveSize = Annotated[ByteSize, Field(gt=0)]
MiB = 1 << 20
SIZE_LIMIT = 1 << 63  # sizes reach mmap, madvise and the CUDA driver as signed 64-bit lengths
_BYTE_SIZE: TypeAdapter[ByteSize] = TypeAdapter(ByteSize)


def _as_index(value: object) -> int | None:
    """``operator.index(value)``, or None where that refuses it; bool is refused too."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        return None
    try:
        return operator.index(value)
    except TypeError:  # numpy.bool_ has __index__ only to refuse it
        return None


def _size_bytes(value: object, name: str) -> int:
    """``value`` as a number of bytes: an integer, or a string such as ``"64GiB"`` or ``"1GB"``.

    bool and float are refused: ``True`` is not a size, and a float has
    already lost the low bits of a large one.

    :raises ValueError: not an integer or a size string, not above zero, or
        ``2**63`` bytes or more; the message names ``name`` and the rule.
    """
    if isinstance(value, str):
        try:
            size = int(_BYTE_SIZE.validate_python(value))
        except ValidationError as exc:
            raise ValueError(f"{name} {value!r} is not a size: {exc.errors()[0]['msg']}") from None
    else:
        index = _as_index(value)
        if index is None:
            raise ValueError(f"{name} must be an integer or a string such as '64GiB', not {type(value).__name__}")
        size = index
    if size <= 0:
        raise ValueError(f"{name} must be more than 0 bytes, got {value!r}")
    if size >= SIZE_LIMIT:
        raise ValueError(f"{name} must be below 2**63 bytes, got {value!r}")
    return size


def _show(size: int) -> str:
    return f"{size} bytes ({ByteSize(size).human_readable()})"


def parse_quota(value: object, *, slot_size: int, max_quota: int) -> int:
    """A new quota for a resize, by the rules of ``HostTierConfig.quota``.

    ``value`` is an integer or a size string (``"64GiB"``, ``"1GB"``); the
    result is rounded down to whole slots of ``slot_size`` and is at least one
    slot and at most ``max_quota``. Pure arithmetic: any thread may call it.

    :raises QuotaError: bool, float or another type; a string that is not a
        size; zero, negative or ``2**63`` bytes or more; below one slot once
        rounded; or past ``max_quota``. The message names the rule and the value.
    """
    try:
        size = _size_bytes(value, "quota")
    except ValueError as exc:
        raise QuotaError(str(exc)) from None
    quota = size // slot_size * slot_size
    if quota == 0:
        raise QuotaError(f"quota {value!r} rounds down to zero slots: it is smaller than one slot ({_show(slot_size)})")
    if quota > max_quota:
        raise QuotaError(
            f"quota {value!r} ({_show(quota)} in whole slots) exceeds max_quota ({_show(max_quota)}), "
            "the address range reserved at open, which never grows: open the tier with a larger max_quota"
        )
    return quota


def default_max_quota() -> int:
    """Host memory as the OS reports it, capped by the cgroup memory limit."""
    limit = _sysinfo.cgroup_memory_limit()
    total = _sysinfo.host_memory_bytes()
    return min(total, limit) if limit is not None else total


MAX_DEFAULT_FILL_THREADS = 8
"""Touching pages from 8 threads filled at 10.5 GiB/s on a 16-core H200
host, 5.8x one thread; past 8 the memory bandwidth, not the threads, limits."""


def default_fill_threads(cpus: set[int] | None = None) -> int:
    """Fill threads when none are configured: the CPUs usable (of ``cpus`` if given), at most 8."""
    import os

    usable = os.sched_getaffinity(0)
    if cpus:
        usable = usable & cpus or cpus
    return max(1, min(MAX_DEFAULT_FILL_THREADS, len(usable)))


@dataclass(frozen=True, slots=True)
class ResolvedHostConfig:
    """A validated ``HostTierConfig`` as plain values, for code that must not touch pydantic.

    Every size is a plain ``int`` in bytes, already rounded (``quota`` and
    ``max_quota`` to whole slots) and with its default resolved. ``numa_node``
    is as configured: ``"auto"`` needs the device's node, found when opening.
    """

    quota: int
    max_quota: int
    slot_size: int
    fill_chunk: int
    commit_unit: int
    fill_threads: int
    numa_node: int | Literal["auto"] | None
    allow_remote_numa_fallback: bool
    transparent_huge_pages: bool | Literal["auto"]
    device: int | None
    backing: Literal["host", "register", "vmm"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="wrap")
    @classmethod
    def _unknown_fields(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        """Pydantic's "Extra inputs are not permitted" names a misspelt field but not the one meant: say it."""
        try:
            return handler(data)
        except ValidationError as exc:
            errors = exc.errors()
            if not any(e["type"] == "extra_forbidden" and len(e["loc"]) == 1 for e in errors):
                raise  # a nested model's unknown fields were named by its own validator
            fields = [name for name in cls.model_fields if name != "kind"]
            details: list[InitErrorDetails] = []
            for e in errors:
                message = e["msg"]
                if e["type"] == "extra_forbidden" and len(e["loc"]) == 1:
                    name = str(e["loc"][0])
                    close = difflib.get_close_matches(name, fields, 1)
                    hint = f"did you mean {close[0]!r}?" if close else "the fields are " + ", ".join(fields)
                    message = f"{cls.__name__} has no field {name!r}: {hint}"
                # Every error again, in order, with its own message and context (a bound, a validator's error).
                error = PydanticCustomError(e["type"], message, e.get("ctx"))
                details.append(InitErrorDetails(type=error, loc=e["loc"], input=e["input"]))
            raise ValidationError.from_exception_data(exc.title, details) from None


GPU_UNIT = 64 * MiB
"""The default commit unit of the GPU-usable backings (see ``HostTierConfig.commit_unit``)."""


def gpu_unit(slot: int) -> int:
    """``GPU_UNIT`` rounded to a whole number of ``slot``-byte slots (at least one)."""
    return max(1, round(GPU_UNIT / slot)) * slot


class HostTierConfig(_Frozen):
    """The host tier: a progressively filled, slot-addressed range of CPU memory.

    Sizes are integers (numpy integers too) or strings such as ``"64GiB"`` or
    ``"1GB"``; bool and float are refused. Every size must be above zero and
    below ``2**63`` bytes. A size that breaks a rule is a ValidationError whose
    message names the field and the rule. ``fill_threads``, ``numa_node`` and
    ``device`` take integers (anything ``operator.index`` accepts, numpy
    integers included) and hold a plain ``int``; bool, float and numeric
    strings are refused.

    After validation, [``resolved``][aiokvtier.HostTierConfig.resolved]
    holds every value as a plain ``int`` (or bool, literal, None) for code
    that must not touch pydantic.

    :ivar quota: bytes to make resident, rounded down to whole slots (the last
        commit unit may stay partial). The config holds and reports the rounded
        value, so ``quota="1GB"`` with 2 MiB slots is 952 MiB. It must hold at
        least one slot.
    :ivar max_quota: the address range reserved once; resizes stay below it.
        Rounded down to whole slots like ``quota`` (which keeps it page-aligned),
        and at least ``quota`` once both are rounded.
        None: host memory as the OS reports it, capped by the cgroup limit. On
        VMs whose MemTotal grows as memory is used, pass it explicitly.
    :ivar slot_size: bytes per slot, a multiple of the page size and at most
        ``quota``.
    :ivar fill_chunk: what a fill thread claims at a time; stopping and
        progress are checked between commit units inside it.
    :ivar commit_unit: unit of commit, decommit and GPU registration, a
        multiple of ``slot_size``. None: the multiple of ``slot_size`` nearest
        ``fill_chunk``; with a GPU-usable backing (``"register"``, ``"vmm"``, or
        ``"auto"`` with a device) and neither given, nearest 64 MiB (the
        driver stalls the process's ``mmap`` calls while it pins or maps a
        unit).
    :ivar fill_threads: threads making the range resident, 1 to 256. None
        (the default): one per CPU this process may run on, at most 8, and at
        most the CPUs of the tier's NUMA node (the fill threads are bound to
        it). Touching pages scales with threads up to the memory bandwidth;
        8 is where the measured gain flattens (docs/guide.md).
    :ivar numa_node: node to place pages on; ``"auto"`` is the GPU's node when
        ``device`` is set and no binding otherwise; None never binds. A node
        must be online.
    :ivar allow_remote_numa_fallback: True: MPOL_PREFERRED, and first touch by
        the bound fill thread where mbind is denied. False: MPOL_BIND, and a
        denied mbind fails the open.
    :ivar transparent_huge_pages: True opts the range into THP
        (MADV_HUGEPAGE); default off, since direct compaction can slow
        population tenfold. ``"auto"``: huge pages unit by unit, only where
        the kernel's defrag setting cannot stall the fault or the node has
        free 2 MiB blocks for the unit, and none after a huge-page unit
        filled slower than 4 KiB pages (docs/guide.md).
    :ivar device: CUDA ordinal that will copy to and from the tier.
    :ivar backing: ``"host"`` (no GPU registration), ``"register"``,
        ``"vmm"`` or ``"auto"``.
    """

    kind: Literal["host"] = "host"
    quota: PositiveSize
    max_quota: PositiveSize | None = Field(default=None, validate_default=True)
    slot_size: PositiveSize = Field(default=ByteSize(2 * MiB), validate_default=True)
    fill_chunk: PositiveSize = ByteSize(512 * MiB)
    commit_unit: PositiveSize | None = Field(default=None, validate_default=True)
    fill_threads: Annotated[int, Field(ge=1, le=256)] | None = None
    numa_node: Annotated[int, Field(ge=0)] | Literal["auto"] | None = "auto"
    allow_remote_numa_fallback: bool = True
    transparent_huge_pages: bool | Literal["auto"] = False
    device: Annotated[int, Field(ge=0)] | None = None
    backing: Literal["auto", "host", "register", "vmm"] = "auto"

    @field_validator("quota", "max_quota", "slot_size", "fill_chunk", "commit_unit", mode="before")
    @classmethod
    def _size(cls, value: object, info: ValidationInfo) -> int | None:
        if value is None and info.field_name in ("max_quota", "commit_unit"):
            return None  # resolved below, once the sizes it depends on are known
        return _size_bytes(value, str(info.field_name))

    @field_validator("fill_threads", "device", "numa_node", mode="before")
    @classmethod
    def _strict_int(cls, value: object, info: ValidationInfo) -> object:
        if value is None or (info.field_name == "numa_node" and value == "auto"):
            return value  # the field's type says whether None is allowed
        index = _as_index(value)
        if index is None:
            # Without this, pydantic's lax mode turns True into 1 and "1" or 1.0 into 1.
            also = ", 'auto' or None" if info.field_name == "numa_node" else ""
            raise ValueError(f"{info.field_name} must be an integer{also}, not {type(value).__name__} {value!r}")
        return index

    @field_validator("slot_size")
    @classmethod
    def _slot_size(cls, value: ByteSize) -> ByteSize:
        if value % PAGE_SIZE:
            raise ValueError(f"slot_size ({value}) must be a multiple of the {PAGE_SIZE}-byte page")
        return value

    @field_validator("commit_unit")
    @classmethod
    def _commit_unit(cls, value: ByteSize | None, info: ValidationInfo) -> ByteSize | None:
        slot = info.data.get("slot_size")
        if slot is None:
            return value
        if value is None:
            chunk = info.data.get("fill_chunk") or 512 * MiB
            value = ByteSize(max(1, round(chunk / slot)) * slot)
            if value >= SIZE_LIMIT:
                raise ValueError(f"commit_unit (derived from fill_chunk, {value}) must be below 2**63 bytes")
            return value
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
    def _whole_slots(self) -> HostTierConfig:
        slot = int(self.slot_size)
        quota = int(self.quota) // slot * slot
        if quota == 0:
            raise ValueError(
                f"quota ({_show(self.quota)}) rounds down to zero slots: slot_size ({_show(slot)}) is larger than quota"
            )
        if self.max_quota is None:
            maximum = default_max_quota() // slot * slot
            if maximum < quota:
                raise ValueError(
                    f"quota ({_show(quota)}) exceeds this host's memory "
                    f"({_show(maximum)}: MemTotal, capped by the memory cgroup's limit): lower quota, or, where "
                    "that memory grows as it is used (a VM), set max_quota explicitly"
                )
        else:
            maximum = int(self.max_quota) // slot * slot
            if maximum == 0:
                raise ValueError(
                    f"max_quota ({_show(self.max_quota)}) rounds down to zero slots of slot_size ({_show(slot)})"
                )
            if maximum < quota:
                raise ValueError(
                    f"max_quota ({_show(maximum)}) is below quota ({_show(quota)}): raise max_quota or lower quota"
                )
        # slot_size is validated after quota and max_quota, so only here can they be
        # rounded; the model is frozen, and nobody has seen (or hashed) it yet.
        self.__dict__.update(quota=ByteSize(quota), max_quota=ByteSize(maximum))
        return self

    @model_validator(mode="after")
    def _backing_needs_device(self) -> HostTierConfig:
        if self.backing in ("register", "vmm") and self.device is None:
            raise ValueError(f"backing={self.backing!r} needs a CUDA device: set device")
        if self.resolved_backing != "host" and not {"commit_unit", "fill_chunk"} & self.model_fields_set:
            # cuMemHostRegister and cuMemCreate hold the address space's lock while the driver
            # pins or maps a unit: with 512 MiB units another thread's mmap waited 12 ms (p99,
            # register) and 11 ms (vmm) on the H200, with 64 MiB ones 1.5-1.7 ms, at the same
            # fill rate (docs/benchmarks.md, neighbours).
            self.__dict__["commit_unit"] = ByteSize(gpu_unit(int(self.slot_size)))
        return self

    @property
    def resolved_backing(self) -> Literal["host", "register", "vmm"]:
        """The backing ``"auto"`` stands for: ``"register"`` with a device, ``"host"`` without.

        With units copied in by several threads and registered one at a time, register fills
        a 96 GiB tier in 5.5 s on the H200 machine (vmm: 26-34 s) while another CUDA call of the
        process waits 11 ms at worst (docs/gpu.md, "Which backing").
        """
        if self.backing != "auto":
            return self.backing
        return "host" if self.device is None else "register"

    @cached_property
    def resolved(self) -> ResolvedHostConfig:
        """This config as plain values, built on first use and kept (the config is frozen).

        Not a field: ``model_dump()``, equality and hashing ignore it.

        :raises ValueError: the config was built with ``model_construct()``,
            which skips the validation that resolves ``max_quota`` and
            ``commit_unit``.
        """
        max_quota, commit_unit = self.max_quota, self.commit_unit
        if max_quota is None or commit_unit is None:
            raise ValueError("HostTierConfig.resolved needs a validated config, not one from model_construct()")
        return ResolvedHostConfig(
            quota=int(self.quota),
            max_quota=int(max_quota),
            slot_size=int(self.slot_size),
            fill_chunk=int(self.fill_chunk),
            commit_unit=int(commit_unit),
            fill_threads=default_fill_threads() if self.fill_threads is None else int(self.fill_threads),
            numa_node=self.numa_node,
            allow_remote_numa_fallback=self.allow_remote_numa_fallback,
            transparent_huge_pages=self.transparent_huge_pages,
            device=self.device,
            backing=self.resolved_backing,
        )

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy, as pydantic makes it (``update`` is not validated), that resolves its own values.

        The cached ``resolved`` lives in the instance ``__dict__``, which
        pydantic copies: left there, it would describe the original.
        """
        copied = super().model_copy(update=update, deep=deep)
        copied.__dict__.pop("resolved", None)
        return copied


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


_ADDRESS = r"^[A-Za-z0-9_.:\[\]-]+:[0-9]{1,5}$"


class MooncakeTierConfig(_Frozen):
    """The remote tier: blocks in a Mooncake Store cluster, shared by every engine that uses it.

    Blocks are found by key: a tier with the same ``key_prefix`` and the same
    fingerprint (given at open) finds what any other machine's tier stored.

    :ivar master: the ``mooncake_master`` RPC address, ``host:port``.
    :ivar metadata_server: where the transfer engines meet: the master's HTTP
        metadata server (``http://host:port/metadata``), or an etcd address.
    :ivar local_hostname: the address other clients reach this one at (for
        its segment); on a single machine ``127.0.0.1``.
    :ivar protocol: ``"tcp"``, or ``"rdma"`` with ``rdma_devices`` naming the
        devices (e.g. ``"mlx5_0,mlx5_1"``).
    :ivar segment_size: host memory this client gives the cluster's pool.
    :ivar local_buffer_size: Mooncake's own staging buffer in this process.
    :ivar timeout: seconds a call to the store may take before the tier stops
        waiting for it (the memory it uses stays held until it returns).
    :ivar open_timeout: seconds the open may take: reaching the master and
        the metadata server, then the client's setup (about 1 s on loopback).
    :ivar key_prefix: the namespace of the keys in the store.
    """

    kind: Literal["mooncake"] = "mooncake"
    master: Annotated[str, Field(pattern=_ADDRESS)]
    metadata_server: Annotated[str, Field(min_length=1)]
    local_hostname: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.:\[\]-]+$")]
    protocol: Literal["tcp", "rdma"] = "tcp"
    rdma_devices: str = ""
    segment_size: PositiveSize = Field(default=ByteSize(1 << 30), validate_default=True)
    local_buffer_size: PositiveSize = Field(default=ByteSize(64 * MiB), validate_default=True)
    timeout: Annotated[float, Field(gt=0, le=3600)] = 10.0
    open_timeout: Annotated[float, Field(gt=0, le=3600)] = 30.0
    key_prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:/-]{1,64}$")] = "aiokvtier"

    @field_validator("segment_size", "local_buffer_size", mode="before")
    @classmethod
    def _size(cls, value: object, info: ValidationInfo) -> int:
        return _size_bytes(value, str(info.field_name))

    @model_validator(mode="after")
    def _rdma_needs_devices(self) -> MooncakeTierConfig:
        if self.protocol == "rdma" and not self.rdma_devices:
            raise ValueError("protocol='rdma' needs rdma_devices (e.g. 'mlx5_0')")
        return self


TierConfig = Annotated[
    GpuTierConfig | HostTierConfig | DiskTierConfig | MooncakeTierConfig, Field(discriminator="kind")
]
_ORDER = {"gpu": 0, "host": 1, "disk": 2, "mooncake": 3}


class CacheConfig(_Frozen):
    """A whole cache: its tiers, fastest first (GPU, host, disk, Mooncake), validated together.

    Every tier is validated and every error reported in one ValidationError;
    nothing is allocated by building a config.
    """

    tiers: Annotated[list[TierConfig], Field(min_length=1)]

    @model_validator(mode="after")
    def _ordered(self) -> CacheConfig:
        kinds = [tier.kind for tier in self.tiers]
        ranks = [_ORDER[kind] for kind in kinds]
        if any(a >= b for a, b in itertools.pairwise(ranks)):
            raise ValueError(f"tiers must be ordered gpu, host, disk, mooncake with at most one of each; got {kinds}")
        return self
