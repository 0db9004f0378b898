"""Where the tier's pages are: NUMA node resolution and /proc/self/numa_maps.

Placement is read from ``numa_maps``, an ordinary file, so it can be checked
where seccomp forbids ``get_mempolicy``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import _sysinfo

__all__ = ["Placement", "node_cpus_or_none", "read_placement"]

_NODE_PAGES = re.compile(r"\bN(\d+)=(\d+)")


@dataclass(frozen=True, slots=True)
class Placement:
    """Pages of a range per NUMA node, and the memory policy attached to it."""

    pages_per_node: dict[int, int] = field(default_factory=dict)
    """Resident pages per node, in ``kernel_page_size`` units."""
    policy: str = "default"
    """The kernel's policy text, e.g. ``"prefer:0"``, ``"bind:1"``, ``"default"``."""
    kernel_page_size: int = 4096
    huge_pages: bool = False
    """Whether any of the range is backed by huge pages (hugetlbfs, or THP per ``AnonHugePages``)."""
    huge_page_bytes: int = 0
    """Bytes of the range backed by transparent huge pages (``AnonHugePages`` in smaps)."""

    @property
    def bytes_per_node(self) -> dict[int, int]:
        return {node: pages * self.kernel_page_size for node, pages in self.pages_per_node.items()}


def read_placement(
    base: int,
    size: int,
    numa_maps: Path = Path("/proc/self/numa_maps"),
    smaps: Path = Path("/proc/self/smaps"),
) -> Placement:
    """Sum ``numa_maps`` (and smaps' ``AnonHugePages``) over the mappings that start inside ``[base, base+size)``.

    mprotect splits the range into several mappings (committed and not); each
    has its own line. ``numa_maps`` marks only hugetlbfs mappings ``huge``:
    transparent huge pages show in smaps alone.
    """
    thp = 0
    try:
        inside = False
        for line in smaps.read_text().splitlines():
            head = line.split(" ", 1)[0]
            if "-" in head and not head.endswith(":"):
                inside = base <= int(head.split("-", 1)[0], 16) < base + size
            elif inside and head == "AnonHugePages:":
                thp += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    pages: dict[int, int] = {}
    policies: list[str] = []
    page_size = 4096
    huge = False
    try:
        lines = numa_maps.read_text().splitlines()
    except OSError:
        return Placement(huge_pages=thp > 0, huge_page_bytes=thp)
    for line in lines:
        start_text, _, rest = line.partition(" ")
        try:
            start = int(start_text, 16)
        except ValueError:
            continue
        if not base <= start < base + size:
            continue
        policy = rest.split(" ", 1)[0]
        if policy not in policies:
            policies.append(policy)
        for node, count in _NODE_PAGES.findall(rest):
            pages[int(node)] = pages.get(int(node), 0) + int(count)
        if "kernelpagesize_kB=" in rest:
            page_size = int(rest.split("kernelpagesize_kB=")[1].split()[0]) * 1024
        huge = huge or " huge " in f" {rest} "
    return Placement(pages, ",".join(policies) or "default", page_size, huge or thp > 0, thp)


def node_cpus_or_none(node: int | None) -> set[int] | None:
    if node is None:
        return None
    try:
        return _sysinfo.node_cpus(node) or None
    except OSError:
        return None
