"""A GPU-attached process's registrations of the pool, over a model of the driver (runs without a GPU).

What ``cuMemHostRegister`` and ``cuMemHostUnregister`` were asked, unit by
unit: the owner's units once the watermark passed them whole, none past the
owner's fill target, and the units a shrink handed back unregistered before
a regrow registers the new pages. tests/test_pool_cuda.py runs the same on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest

from aiokvtier import AttachedPool, CopyPlanError, CudaError, Pool
from aiokvtier._host._layout import UnitLayout
from aiokvtier._pool import _gpu
from tests.test_pool import sock, until

__all__ = ["sock"]  # the fixture, used by name

MiB = 1 << 20
SLOT = 64 << 10
UNIT = 32 * MiB
CONFIG = {"quota": "256MiB", "max_quota": "256MiB", "slot_size": SLOT, "commit_unit": UNIT}


class ModelDriver:
    """Registered ranges, by address; a range may be made to refuse its unregistration."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []
        self.refuse_unregister: set[int] = set()

    def cuMemHostRegister(self, address: int, length: int, flags: int) -> tuple[int]:
        assert address not in self.registered, f"{address:#x} registered twice"
        self.registered[address] = length
        self.calls.append(("register", address))
        return (0,)

    def cuMemHostUnregister(self, address: int) -> tuple[int]:
        if address in self.refuse_unregister:
            return (1,)
        del self.registered[address]
        self.calls.append(("unregister", address))
        return (0,)


class ModelContext:
    def __init__(self, device: int) -> None:
        self.released = False

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        yield

    def release(self) -> None:
        self.released = True


@pytest.fixture
def model(monkeypatch: pytest.MonkeyPatch) -> ModelDriver:
    drv = ModelDriver()
    monkeypatch.setattr(_gpu, "driver", lambda: drv)
    monkeypatch.setattr(_gpu, "PrimaryContext", ModelContext)
    return drv


def _units(base: int, size: int) -> list[tuple[int, int]]:
    layout = UnitLayout.build(size, SLOT, UNIT)
    return [(base + layout.start(i), layout.end(i) - layout.start(i)) for i in range(layout.count)]


def test_units_are_registered_whole_below_the_watermark_and_the_bound(model: ModelDriver) -> None:
    base, size = 1 << 40, 256 * MiB
    reg = _gpu.Registrations(0, base, size, SLOT, UNIT)
    units = _units(base, size)
    assert units[:5] == [(base, 4 * MiB), (base + 4 * MiB, 4 * MiB), (base + 8 * MiB, 8 * MiB),
                         (base + 16 * MiB, 16 * MiB), (base + 32 * MiB, 32 * MiB)]  # fmt: skip
    assert reg.extend(6 * MiB) == 4 * MiB  # the second unit is not whole below the watermark
    assert reg.reachable(6 * MiB) == 4 * MiB and reg.reachable(64 * MiB) == 64 * MiB
    reg.bound = 64 * MiB
    assert reg.extend(size) == 64 * MiB  # nothing past the owner's fill target
    assert dict(units[:5]) == model.registered
    offsets = np.array([60 * MiB, 64 * MiB], dtype=np.uint64)
    _, bad = reg.units_of(offsets, np.full(2, SLOT, dtype=np.uint64))
    assert bad == 1
    _, bad = reg.units_of(np.array([32 * MiB - SLOT], dtype=np.uint64), np.array([2 * SLOT], dtype=np.uint64))
    assert bad == 0  # across two of the owner's units
    reg.release()
    assert model.registered == {}


def test_a_lowered_bound_is_unregistered_from_the_top_and_a_raised_one_registered_again(model: ModelDriver) -> None:
    base, size = 1 << 40, 256 * MiB
    reg = _gpu.Registrations(0, base, size, SLOT, UNIT)
    reg.extend(size)
    assert sum(model.registered.values()) == size
    reg.bound = 40 * MiB  # inside a unit: that unit goes too (its tail was handed back)
    _, bad = reg.units_of(np.array([32 * MiB], dtype=np.uint64), np.array([SLOT], dtype=np.uint64))
    assert bad == 0  # refused from the moment the bound is lowered, before the worker unregisters
    assert reg.shrink() == 32 * MiB
    unregistered = [a for op, a in model.calls if op == "unregister"]
    assert unregistered == sorted(unregistered, reverse=True) and len(unregistered) == 7
    model.calls.clear()
    reg.bound = size
    assert reg.extend(size) == size
    assert [op for op, _ in model.calls] == ["register"] * 7  # the new pages, registered afresh
    reg.release()


def test_a_unit_that_cannot_be_unregistered_is_never_copied_or_registered_again(model: ModelDriver) -> None:
    base, size = 1 << 40, 256 * MiB
    reg = _gpu.Registrations(0, base, size, SLOT, UNIT)
    reg.extend(size)
    model.refuse_unregister.add(base + 128 * MiB)
    reg.bound = 64 * MiB
    with pytest.raises(CudaError, match="cuMemHostUnregister"):
        reg.shrink()
    assert reg.ceiling == 128 * MiB
    reg.bound = size
    _, bad = reg.units_of(np.array([128 * MiB], dtype=np.uint64), np.array([SLOT], dtype=np.uint64))
    assert bad == 0
    assert reg.reachable(size) <= 128 * MiB
    model.refuse_unregister.clear()
    reg.release()
    assert model.registered == {}


async def test_an_attached_process_unregisters_what_a_shrink_handed_back_before_a_regrow(
    model: ModelDriver, sock: str
) -> None:
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock, device=0) as attached:
        await attached.wait_resident()
        assert attached.registered_bytes == 256 * MiB
        base = attached.base_address
        await pool.resize("64MiB")
        await until(lambda: attached.registered_bytes == 64 * MiB, "the shrink unregistered in the attached process")
        assert set(model.registered) == {a for a, _ in _units(base, 64 * MiB)}
        with pytest.raises(CopyPlanError, match="registered"):
            attached.registrations_of(np.array([64 * MiB], dtype=np.uint64), np.array([SLOT], dtype=np.uint64))
        model.calls.clear()
        await pool.resize("256MiB")
        await until(lambda: attached.quota == 256 * MiB, "the regrow reached the attached process")
        await attached.wait_resident()
        assert attached.registered_bytes == 256 * MiB
        assert [op for op, _ in model.calls] == ["register"] * 6  # 64-256 MiB, in units of 32 MiB
        ids = await attached.allocate_ids(1)
        assert (
            attached.registrations_of(
                np.array([int(ids[0]) * SLOT], dtype=np.uint64), np.array([SLOT], dtype=np.uint64)
            ).size
            == 1
        )
        await attached.free_many(ids.tolist())
    assert model.registered == {}
