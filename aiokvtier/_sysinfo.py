"""What the host reports about itself: memory, cgroup limits, NUMA nodes.

These are small reads from procfs and sysfs; none of them can block on I/O.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "cgroup_memory_limit",
    "host_memory_bytes",
    "node_cpus",
    "online_nodes",
    "parse_cpulist",
]

_NODE_ROOT = Path("/sys/devices/system/node")


def host_memory_bytes() -> int:
    """Physical memory the OS reports (on VMs that balloon, this can start low)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cgroup_dir() -> Path | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            return Path("/sys/fs/cgroup") / path.lstrip("/")
    return None


def cgroup_memory_limit() -> int | None:
    """The tightest cgroup v2 ``memory.max`` on the way to the root, or the v1 limit."""
    limits: list[int] = []
    here = _cgroup_dir()
    root = Path("/sys/fs/cgroup")
    while here is not None:
        try:
            text = (here / "memory.max").read_text().strip()
        except OSError:
            text = "max"
        if text != "max":
            limits.append(int(text))
        if here == root or root not in here.parents:
            break
        here = here.parent
    try:
        v1 = int(Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").read_text())
        if v1 < 1 << 60:
            limits.append(v1)
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


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
