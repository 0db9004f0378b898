"""The fill with GPU backings (marker ``cuda``): skipped with "no CUDA device" where there is none."""

from __future__ import annotations

import threading

import pytest

from aiokvtier import HostTier, HostTierConfig
from aiokvtier._host import _linux

from .helpers import MiB
from .invariants import check_tier

pytestmark = pytest.mark.cuda


def config(backing: str, **overrides: object) -> HostTierConfig:
    values: dict[str, object] = dict(
        quota=256 * MiB, max_quota=1024 * MiB, slot_size=256 << 10, commit_unit=32 * MiB, fill_chunk=32 * MiB,
        device=0, backing=backing,
    )  # fmt: skip
    values.update(overrides)
    return HostTierConfig.model_validate(values)


async def test_register_touches_registers_per_unit_and_opens_the_range_once(monkeypatch: pytest.MonkeyPatch) -> None:
    lock = threading.Lock()
    protects: list[tuple[int, bool]] = []
    real = _linux.mprotect

    def spy(addr: int, length: int, writable: bool) -> None:
        with lock:
            protects.append((length, writable))
        real(addr, length, writable)

    monkeypatch.setattr(_linux, "mprotect", spy)
    async with HostTier(config("register", fill_threads=4)) as tier:
        await tier.wait_resident()
        s = check_tier(tier, settled=True)
        assert s.registered_bytes == s.resident_bytes == 256 * MiB
        assert protects == [(256 * MiB, True)]
        await tier.resize(64 * MiB)
        s = check_tier(tier, settled=True)
        assert s.registered_bytes == 64 * MiB and protects[1:] == [(192 * MiB, False)]
        await tier.resize(512 * MiB)
        await tier.wait_resident()
        s = check_tier(tier, settled=True)
        assert s.registered_bytes == 512 * MiB


@pytest.mark.parametrize("threads", [1, 4])
async def test_vmm_fills_with_any_thread_count(threads: int) -> None:
    async with HostTier(config("vmm", fill_threads=threads)) as tier:
        await tier.wait_resident()
        s = tier.statistics()
        assert s.registered_bytes == s.resident_bytes == 256 * MiB and s.fill_threads == threads
