"""Snapshots of a tier's live figures."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TierStatistics"]


@dataclass(frozen=True, slots=True)
class TierStatistics:
    """What [``HostTier.statistics()``][aiokvtier.HostTier.statistics] returns: a consistent-enough snapshot.

    Figures are read without stopping the fill, so ``resident_bytes`` may be
    one unit behind by the time you read it.
    """

    backing: str
    """``"host"``, ``"register"`` or ``"vmm"``; a pool's tier: ``"shared"``, or ``"shared-register"`` where
    the owner registers it with its GPU."""
    device: int | None
    quota: int
    max_quota: int
    base_address: int
    resident_bytes: int
    """Bytes resident (and, with a GPU backing, registered) as one contiguous prefix."""
    target_bytes: int
    """Bytes the fill works towards: the quota rounded up to whole commit units."""
    registered_bytes: int
    slot_size: int
    commit_unit: int
    fill_chunk: int
    fill_threads: int
    slots_total: int
    slots_allocated: int
    slots_free: int
    views_exported: int
    filling: bool
    fill_seconds: float
    """Seconds the latest fill (from open, or from the latest grow) has run or took."""
    fill_error: str | None
    stranded_bytes: int
    """Bytes past the resident prefix that a failed decommit left committed (see
    ``DecommitError``): held until a grow reuses them, a shrink hands them back, or close."""
    numa_node: int | None
    numa_policy: str
    """``"preferred"``, ``"bind"``, ``"first-touch"`` (mbind denied) or ``"none"``."""
    numa_warning: str | None
    transparent_huge_pages: bool | str
    """As configured: True, False or ``"auto"``."""
    closed: bool
    allocation_waits: int
    """``allocate`` calls that had to wait for the fill (counted once each, however they ended)."""
    allocation_wait_seconds: float
    """Seconds those calls spent waiting for the fill, in total."""
    huge_page_units: int = 0
    """With ``transparent_huge_pages="auto"``: committed units advised huge pages
    (``placement().huge_page_bytes`` says what the kernel gave them)."""
    huge_pages_given_up: bool = False
    """With ``"auto"``: a huge-page unit filled slower than 4 KiB pages, so no later unit gets them."""
    fill_method: str = "touch"
    """How the fill makes units resident: ``"copy"`` (``UFFDIO_COPY`` into a range registered
    once; Linux 6.9+, 4 KiB pages), ``"touch"`` (page faults, or ``MADV_POPULATE_WRITE`` when
    memory is short) or ``"driver"`` (the vmm backing: ``cuMemCreate``)."""
