"""A pool store's and load's copies as rows of a page array (``aiokvtier._host._rows``) and as merged runs of
neighbouring pages, against a copy per page: every byte lands where it would have, whatever the pages' form."""

from __future__ import annotations

import numpy as np
import pytest

from aiokvtier import AttachedPool, Pool
from aiokvtier._host._rows import SMALL_ROW, memmove_all, rows_from_slots, rows_into_slots, runs
from tests.test_pool import CONFIG, sock

__all__ = ["sock"]  # the fixture, used by name

SLOT = 64 << 10


def address(array: np.ndarray) -> int:
    return int(array.ctypes.data)


@pytest.mark.parametrize("seed", range(6))
def test_merged_runs_copy_what_a_copy_per_page_copies(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, slot = 200, 256
    src = rng.integers(0, 256, (n, slot), dtype=np.uint8)
    # Slots in runs of neighbours and jumps, pages whole or short: some copies merge, some do not.
    slots = np.cumsum(rng.choice([1, 1, 1, 2, 5], n)).astype(np.uint64)
    lengths = np.where(rng.random(n) < 0.8, slot, rng.integers(1, slot, n)).astype(np.uint64)
    order = rng.permutation(n) if seed % 2 else np.arange(n)
    slots, lengths = slots[order], lengths[order]
    rows = np.arange(n, dtype=np.uint64)[order] if seed % 3 else np.arange(n, dtype=np.uint64)
    one = np.zeros((int(slots.max()) + 1, slot), dtype=np.uint8)
    merged = np.zeros_like(one)
    srcs = np.uint64(address(src)) + rows * np.uint64(slot)
    dsts = (np.uint64(address(one)) + slots * np.uint64(slot)).tolist()
    memmove_all(list(zip(dsts, srcs.tolist(), lengths.tolist(), strict=True)))  # a copy per page
    memmove_all(runs(np.uint64(address(merged)) + slots * np.uint64(slot), srcs, lengths))
    assert np.array_equal(one, merged)
    whole = runs(np.uint64(address(merged)) + slots * np.uint64(slot), srcs, lengths)
    assert sum(n for _, _, n in whole) == int(lengths.sum())
    if seed % 2 == 0 and seed % 3 == 0:  # in order, neighbours whole: fewer copies than pages
        assert len(whole) < n


def test_rows_land_in_their_slots_and_come_back() -> None:
    rng = np.random.default_rng(1)
    count, slot = 64, 512
    memory = np.zeros((count, slot), dtype=np.uint8)
    pages = rng.integers(0, 256, (40, 24), dtype=np.uint8)
    slots = rng.permutation(count)[:40].astype(np.int64)
    rows_into_slots(address(memory), memory.nbytes, slot, slots[:10], pages, np.arange(30, 40, dtype=np.int64))
    rows_into_slots(address(memory), memory.nbytes, slot, slots[10:], pages[:30], None)
    expected = np.zeros_like(memory)
    expected[slots[:10], :24] = pages[30:]
    expected[slots[10:], :24] = pages[:30]
    assert np.array_equal(memory, expected)
    back = np.full((40, 32), 7, dtype=np.uint8)
    rows_from_slots(address(memory), memory.nbytes, slot, np.concatenate([slots[10:], slots[:10]]), back, 24)
    assert np.array_equal(back[:, :24], pages) and (back[:, 24:] == 7).all()  # past the blocks: untouched
    with pytest.raises(IndexError):
        rows_into_slots(address(memory), memory.nbytes, slot, np.array([count]), pages[:1], None)
    assert np.array_equal(memory, expected)


def test_whole_rows_are_gathered_straight_into_the_array() -> None:
    rng = np.random.default_rng(2)
    memory = rng.integers(0, 256, (32, 64), dtype=np.uint8)
    slots = rng.permutation(32)[:12].astype(np.int64)
    back = np.zeros((12, 64), dtype=np.uint8)
    rows_from_slots(address(memory), memory.nbytes, 64, slots, back, 64)
    assert np.array_equal(back, memory[slots])
    for outside in (32, -1):  # "clip" would copy an end slot: refused, nothing written
        back[:] = 7
        with pytest.raises(IndexError, match=f"slot {outside} is outside"):
            rows_from_slots(address(memory), memory.nbytes, 64, np.array([0, outside]), back[:2], 64)
        assert (back == 7).all()


@pytest.mark.parametrize("width", [1, 100, SMALL_ROW + 8, SLOT])
@pytest.mark.parametrize("form", ["array", "list"])
async def test_a_store_with_some_keys_present_copies_each_page_to_its_key(sock: str, width: int, form: str) -> None:
    rng = np.random.default_rng(width)
    n = 96
    keys = [b"rows-%d" % i for i in range(n)]
    pages = rng.integers(0, 256, (n, width), dtype=np.uint8)
    given = pages if form == "array" else [bytes(row) for row in pages]
    async with Pool(CONFIG, sock) as pool, AttachedPool(sock) as a:
        await pool.tier.wait_resident()
        every_third = list(range(0, n, 3))
        first = await a.store([keys[i] for i in every_third], pages[every_third])
        assert len(first.stored) == len(every_third)
        # Present keys in between: the claimed rows are a subset, not the whole array.
        result = await a.store(keys, given)
        assert set(result.present) == {keys[i] for i in every_third}
        assert len(result.stored) == n - len(every_third) and not result.skipped
        out = np.zeros((n, width), dtype=np.uint8)
        assert await a.load(keys, out) == [width] * n
        assert np.array_equal(out, pages)
        listed = [bytearray(width) for _ in range(n)]
        await a.load(keys, listed)
        assert [bytes(b) for b in listed] == [bytes(row) for row in pages]
        pool.check_invariants(sole_user=True)
