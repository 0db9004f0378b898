"""``AttachedPool(prefault=True)``: the resident pool mapped into the process ahead of its first touch."""

from __future__ import annotations

import asyncio
import ctypes

import pytest

from aiokvtier import AttachedPool, Pool
from tests.test_pool import sock, until

from .conftest import fill_threads_alive, mappings_in, proc_text

__all__ = ["sock"]  # the fixture, used by name

MiB = 1 << 20
SLOT = 64 << 10
CONFIG = {"quota": "64MiB", "max_quota": "64MiB", "slot_size": SLOT, "commit_unit": "16MiB"}


def _rss(base: int) -> int:
    """Bytes of the mapping that starts at ``base`` mapped into this process."""
    inside = False
    for line in proc_text("/proc/self/smaps").splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            inside = int(head.split("-")[0], 16) == base
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping starts at {base:#x}")


async def test_prefault_maps_the_resident_pool_in_and_leaves_its_bytes_alone(sock: str) -> None:
    async with Pool(CONFIG, sock) as pool:
        await pool.tier.wait_resident()
        slot = await pool.tier.allocate()
        pool.tier.view(slot)[:5] = b"hello"
        async with AttachedPool(sock) as plain, AttachedPool(sock, prefault=True) as eager:
            await eager.wait_resident()
            await until(lambda: eager.prefaulted_bytes == 64 * MiB, "the whole pool mapped in")
            assert plain.prefaulted_bytes == 0
            assert await asyncio.to_thread(_rss, eager.base_address) == 64 * MiB
            assert await asyncio.to_thread(_rss, plain.base_address) < 64 * MiB // 4  # maps on first touch
            assert ctypes.string_at(eager.base_address + slot * SLOT, 5) == b"hello"  # nothing written


async def test_a_shrink_lowers_what_is_prefaulted_and_a_regrow_maps_the_new_pages(sock: str) -> None:
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock, prefault=True) as eager:
        await until(lambda: eager.prefaulted_bytes == 64 * MiB, "the whole pool mapped in")
        await pool.resize("16MiB")
        await until(lambda: eager.quota == 16 * MiB, "the shrink reached the attached process")
        assert eager.prefaulted_bytes <= 16 * MiB
        await pool.resize("64MiB")
        await until(lambda: eager.prefaulted_bytes == 64 * MiB, "the whole pool mapped in")
        slot = await pool.tier.allocate()
        while slot * SLOT < 16 * MiB:  # one in a unit the shrink handed back and the regrow made again
            slot = await pool.tier.allocate()
        pool.tier.view(slot)[:3] = b"new"
        assert ctypes.string_at(eager.base_address + slot * SLOT, 3) == b"new"  # the file's page, not a stale one


def test_prefault_is_a_bool() -> None:
    with pytest.raises(TypeError, match="prefault must be a bool"):
        AttachedPool("/tmp/x.sock", prefault="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("delay", [0.0, 0.001, 0.005, 0.02])
async def test_a_close_while_prefaulting_leaves_no_mapping_or_thread(sock: str, delay: float) -> None:
    config = {"quota": "512MiB", "max_quota": "512MiB", "slot_size": SLOT, "commit_unit": "32MiB"}
    async with Pool(config, sock):  # still filling while the process attaches and maps in
        eager = await AttachedPool.attach(sock, prefault=True)
        base, size = eager.base_address, eager.max_quota
        await asyncio.sleep(delay)
        await eager.aclose()
        assert eager.prefaulted_bytes <= eager.resident_bytes
        assert await asyncio.to_thread(mappings_in, base, size) == []
        assert not [t for t in fill_threads_alive() if t.name == "aiokvtier-attached"]
