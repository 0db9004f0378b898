"""What the host reports about itself: memory, cgroup limits, NUMA nodes.

These are small reads from procfs and sysfs; none of them can block on I/O.
They are read with the GIL held (``read_text()``): a fill thread checks the
memory available as it goes, and every system call that gives up the GIL must
take it back, which next to a busy event loop can take seconds.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "CgroupMemory",
    "available_memory",
    "cgroup_memory",
    "cgroup_memory_limit",
    "host_memory_bytes",
    "meminfo",
    "node_cpus",
    "online_nodes",
    "parse_cpulist",
    "read_text",
]

_NODE_ROOT = Path("/sys/devices/system/node")

# ctypes.PyDLL: calls keep the GIL (a plain CDLL gives it up around each call).
_libc = ctypes.PyDLL(None, use_errno=True)
_open = _libc.open
_open.argtypes = [ctypes.c_char_p, ctypes.c_int]
_open.restype = ctypes.c_int
_read = _libc.read
_read.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
_read.restype = ctypes.c_ssize_t
_close = _libc.close
_close.argtypes = [ctypes.c_int]
_close.restype = ctypes.c_int
_CHUNK = 1 << 16


def read_text(path: Path) -> str:
    """A small procfs, sysfs or cgroupfs file, read without giving up the GIL.

    :raises OSError: the file cannot be opened or read (``FileNotFoundError`` where it does not exist).
    :raises ValueError: the path holds a NUL byte (as ``open`` does).
    """
    name = os.fsencode(path)
    if b"\0" in name:
        raise ValueError(f"embedded null byte in the path {path!s:.80}")
    fd = _open(name, os.O_RDONLY | os.O_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    try:
        buf = ctypes.create_string_buffer(_CHUNK)
        chunks: list[bytes] = []
        while True:
            n = _read(fd, buf, _CHUNK)
            if n < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                raise OSError(err, os.strerror(err), str(path))
            if n == 0:
                return b"".join(chunks).decode()
            chunks.append(buf.raw[:n])
    finally:
        _close(fd)


def _readable(path: Path) -> bool:
    try:
        read_text(path)
    except OSError:
        return False
    return True


def host_memory_bytes() -> int:
    """Physical memory the OS reports (on VMs that balloon, this can start low)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


_CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a page-rounded 2**63 - 1


@dataclass(frozen=True, slots=True)
class CgroupMemory:
    """The memory cgroup this process is in, as far as it limits memory."""

    version: Literal["v1", "v2"] | None
    """None where no memory controller is mounted."""
    limit: int | None
    """The tightest limit on the way to the root, bytes; None: no limit."""
    usage: int | None
    """Bytes charged to the cgroup that holds that limit, less its inactive page cache."""


def _cgroup_dirs(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = _CGROUP_ROOT
) -> tuple[Path | None, Path | None]:
    """The process's cgroup v2 directory and its cgroup v1 memory directory (either may be None)."""
    try:
        lines = read_text(proc_cgroup).splitlines()
    except OSError:
        return None, None
    v2 = v1 = None
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            v2 = root / path.lstrip("/")
        elif "memory" in controllers.split(","):
            v1 = root / "memory" / path.lstrip("/")
    return v2, v1


def _read_int(path: Path) -> int | None:
    try:
        text = read_text(path).strip()
    except OSError:
        return None
    try:
        return int(text)
    except ValueError:
        return None  # "max"


def _inactive_file(path: Path, key: str) -> int:
    try:
        for line in read_text(path).splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _walk(start: Path, top: Path, limit_file: str, usage_file: str, stat_key: str) -> tuple[int | None, int | None]:
    """The tightest limit from ``start`` up to ``top``, and the usage where it was set.

    Directories that do not exist are passed over: inside a container without
    a cgroup namespace, /proc/self/cgroup names a path from the host's root
    while the container's own cgroup is mounted at ``top``.
    """
    best: tuple[int | None, int | None] = (None, None)
    here = start
    while True:
        limit = _read_int(here / limit_file)
        if limit is not None and limit < _UNLIMITED and (best[0] is None or limit < best[0]):
            usage = _read_int(here / usage_file)
            if usage is not None:
                usage = max(0, usage - _inactive_file(here / "memory.stat", stat_key))
            best = (limit, usage)
        if here == top or top not in here.parents:
            return best
        here = here.parent


def cgroup_memory(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = _CGROUP_ROOT) -> CgroupMemory:
    """The memory limit cgroups put on this process: v2 ``memory.max``, else v1 ``memory.limit_in_bytes``.

    Each is the tightest on the way from the process's cgroup to the root.
    Both are read on hybrid hosts; the tighter wins.
    """
    v2_dir, v1_dir = _cgroup_dirs(proc_cgroup, root)
    found: list[tuple[int, int | None, Literal["v1", "v2"]]] = []
    version: Literal["v1", "v2"] | None = None
    if v2_dir is not None and _readable(root / "cgroup.controllers"):
        version = "v2"
        limit, usage = _walk(v2_dir, root, "memory.max", "memory.current", "inactive_file")
        if limit is not None:
            found.append((limit, usage, "v2"))
    v1_top = root / "memory"
    if _readable(v1_top / "memory.limit_in_bytes"):
        version = version or "v1"
        limit, usage = _walk(
            v1_dir or v1_top, v1_top, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
        )
        if limit is not None:
            found.append((limit, usage, "v1"))
    if not found:
        return CgroupMemory(version, None, None)
    limit, usage, version = min(found, key=lambda item: item[0])
    return CgroupMemory(version, limit, usage)


def cgroup_memory_limit() -> int | None:
    """The tightest cgroup v2 ``memory.max`` on the way to the root, or the v1 limit."""
    return cgroup_memory().limit


def meminfo(path: Path = Path("/proc/meminfo")) -> dict[str, int]:
    """``/proc/meminfo`` (or a node's ``meminfo``) in bytes, keyed by field name."""
    values: dict[str, int] = {}
    for line in read_text(path).splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if not fields:
            continue
        key = name.split()[-1]  # a node's file says "Node 0 MemTotal"
        try:
            number = int(fields[0])
        except ValueError:
            continue
        values[key] = number * 1024 if fields[1:] == ["kB"] else number
    return values


def available_memory() -> tuple[int, str]:
    """Bytes this process can still make resident, and what bounds it.

    ``MemAvailable``, or less where the memory cgroup's limit minus its usage
    (page cache that can be dropped not counted) is tighter.
    """
    available = meminfo().get("MemAvailable", host_memory_bytes())
    reason = "MemAvailable"
    cgroup = cgroup_memory()
    if cgroup.limit is not None:
        room = max(0, cgroup.limit - (cgroup.usage or 0))
        if room < available:
            available, reason = room, f"cgroup {cgroup.version} limit less usage"
    return available, reason


def parse_cpulist(text: str) -> set[int]:
    """Parse the kernel's ``0-3,8,10-11`` CPU list format."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def online_nodes() -> set[int] | None:
    """NUMA nodes with memory online, or None where the kernel exposes no NUMA sysfs."""
    try:
        return parse_cpulist((_NODE_ROOT / "online").read_text())
    except OSError:
        return None


def node_cpus(node: int) -> set[int]:
    """CPUs of a NUMA node (empty for a memory-only node)."""
    return parse_cpulist((_NODE_ROOT / f"node{node}" / "cpulist").read_text())
