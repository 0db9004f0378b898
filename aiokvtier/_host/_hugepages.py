"""Transparent huge pages where they cannot lose: ``transparent_huge_pages="auto"``.

A huge-page fault in a region opted in with MADV_HUGEPAGE may enter direct
compaction when no free 2 MiB block is at hand; on a fragmented node that
dropped population from 4.6 to 0.32 GiB/s. Where a free block is at hand, a
huge page fills twice as fast or more. So, per commit unit:

- huge pages only where the kernel's ``defrag`` setting never compacts on
  the fault (``defer``, ``never``: the fault takes a free block or falls back
  to 4 KiB pages at once), or where the node has free order-9 blocks for
  twice the unit (``/proc/buddyinfo``) so that compaction is not needed;
- the first unit is filled with 4 KiB pages, which gives the 4 KiB rate;
- a huge-page unit that fills slower than that rate (compaction after all)
  ends huge pages for the rest of the tier's life.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

from .._sysinfo import read_text

__all__ = ["HUGE_PAGE", "HugePagePolicy", "free_huge_blocks", "kernel_settings"]

HUGE_PAGE = 2 << 20
_HUGE_ORDER = 9  # 2 MiB in 4 KiB pages
_THP = Path("/sys/kernel/mm/transparent_hugepage")
_SELECTED = re.compile(r"\[([^\]]+)\]")


def _selected(path: Path) -> str | None:
    try:
        found = _SELECTED.search(read_text(path))  # with the GIL held: fill threads ask per unit
    except OSError:
        return None
    return found.group(1) if found else None


def kernel_settings(root: Path = _THP) -> tuple[str | None, str | None]:
    """The selected ``enabled`` and ``defrag`` values (None where the kernel has no THP)."""
    return _selected(root / "enabled"), _selected(root / "defrag")


def free_huge_blocks(node: int | None, buddyinfo: Path = Path("/proc/buddyinfo")) -> int:
    """Free blocks of 2 MiB or more on ``node`` (every node for None), counted in 2 MiB blocks."""
    try:
        lines = read_text(buddyinfo).splitlines()
    except OSError:
        return 0
    blocks = 0
    for line in lines:
        # "Node 0, zone   Normal   <count of order 0> <order 1> ... <order 10>"
        head, _, counts = line.partition("zone")
        fields = counts.split()
        try:
            line_node = int(head.replace("Node", "").strip(" ,"))
        except ValueError:
            continue
        if node is not None and line_node != node:
            continue
        for order, count in enumerate(fields[1:]):
            if order >= _HUGE_ORDER and count.isdigit():
                blocks += int(count) << (order - _HUGE_ORDER)
    return blocks


class HugePagePolicy:
    """Decides, unit by unit, whether a unit gets huge pages; any thread."""

    def __init__(self, node: int | None) -> None:
        self._node = node
        self._lock = threading.Lock()
        self._rate_4k: float | None = None
        self.given_up = False
        """A huge-page unit filled slower than 4 KiB pages do: none since."""

    def choose(self, length: int) -> bool:
        """Whether the next unit of ``length`` bytes should get huge pages."""
        if self.given_up or self._rate_4k is None or length < HUGE_PAGE:
            return False
        enabled, defrag = kernel_settings()
        if enabled not in ("always", "madvise"):
            return False
        if defrag in ("defer", "never"):
            return True
        return free_huge_blocks(self._node) * HUGE_PAGE >= 2 * length

    def record(self, huge: bool, length: int, seconds: float) -> None:
        """What a unit's fill took: sets the 4 KiB rate, or gives huge pages up."""
        rate = length / seconds if seconds > 0 else float("inf")
        with self._lock:
            if not huge:
                self._rate_4k = rate if self._rate_4k is None else max(self._rate_4k, rate)
            elif self._rate_4k is not None and rate < self._rate_4k:
                self.given_up = True
