"""The shared backing on its own: a memfd mapped twice is one memory; a decommit gives pages back."""

from __future__ import annotations

import ctypes
import os

import pytest

from aiokvtier import ConfigError, HostTier
from aiokvtier._backings import SharedBackings
from aiokvtier._host._shared import SharedBacking, map_shared, unmap_shared

MiB = 1 << 20


def _bytes(address: int, n: int) -> bytes:
    return ctypes.string_at(address, n)


def test_a_second_mapping_sees_the_same_pages_and_a_decommit_empties_them_for_both() -> None:
    backing = SharedBacking(8 * MiB, node=None, strict_numa=False, huge_pages=False)
    try:
        assert backing.base % (2 * MiB) == 0
        backing.commit(0, 4 * MiB)
        ctypes.memmove(backing.base + 4096, b"shared", 6)
        other = map_shared(backing.fd, backing.size)
        try:
            assert other != backing.base
            assert _bytes(other + 4096, 6) == b"shared"
            ctypes.memmove(other + 8192, b"back", 4)
            assert _bytes(backing.base + 8192, 4) == b"back"
            backing.decommit(0, 4 * MiB)
            assert os.fstat(backing.fd).st_blocks == 0  # the pages went back to the system
            assert _bytes(other + 4096, 6) == bytes(6)  # punched out of the file: gone for every mapping
        finally:
            unmap_shared(other, backing.size)
    finally:
        backing.release([])


def test_the_mapping_outlives_the_owners_descriptor() -> None:
    backing = SharedBacking(4 * MiB, node=None, strict_numa=False, huge_pages=False)
    backing.commit(0, 4 * MiB)
    other = map_shared(backing.fd, backing.size)
    ctypes.memmove(backing.base, b"still here", 10)
    backing.release([(0, 4 * MiB)])  # the owner unmaps and closes the memfd
    try:
        assert _bytes(other, 10) == b"still here"
    finally:
        unmap_shared(other, 4 * MiB)


async def test_a_tier_over_shared_backings_fills_and_serves() -> None:
    backings = SharedBackings()
    async with HostTier({"quota": "32MiB", "slot_size": "64KiB"}, backings=backings) as tier:
        await tier.wait_resident()
        s = tier.statistics()
        assert s.backing == "shared" and s.resident_bytes == 32 * MiB
        assert backings.made is not None and backings.made.base == s.base_address
        await tier.resize("16MiB")
        assert tier.statistics().resident_bytes <= 16 * MiB


def test_the_vmm_backing_is_not_shared() -> None:
    from aiokvtier import HostTierConfig

    config = HostTierConfig(quota="32MiB", device=0, backing="vmm").resolved
    with pytest.raises(ConfigError, match="not shared yet"):
        SharedBackings().make(config, None)
