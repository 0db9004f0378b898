"""BlockStore on a GPU (marker ``cuda``): device pages through a CopyEngine."""

from __future__ import annotations

import asyncio

import pytest

from aiokvtier import BlockNotFound, BlockStore, CopyEngine, HostTier

from .test_cuda import BACKINGS, SLOT, gpu_config, pages, torch_cuda

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("backing", BACKINGS)
async def test_device_pages_round_trip_bit_exact(backing: str) -> None:
    torch = torch_cuda()
    async with HostTier(gpu_config(backing)) as tier, CopyEngine(0) as engine, BlockStore(tier, engine) as store:
        keys = [i.to_bytes(32, "little") for i in range(300)]
        src = pages(torch, len(keys), 7)
        result = await store.store(keys, src)
        assert result.stored == tuple(keys) and not result.skipped
        assert tier.statistics().slots_allocated == len(store) == len(keys)
        shuffled = keys[::-1]
        dst = torch.zeros_like(src)
        await store.load(shuffled, dst)
        torch.cuda.synchronize()
        assert torch.equal(dst, src.flip(0))
        again = await store.store(keys[:10], src[:10])
        assert again.present == tuple(keys[:10]) and not again.stored
        with pytest.raises(BlockNotFound):
            await store.load([b"missing", *keys[:2]], dst[:3])


async def test_stores_follow_a_kernel_through_after() -> None:
    torch = torch_cuda()
    async with HostTier(gpu_config("vmm")) as tier, CopyEngine(0) as engine, BlockStore(tier, engine) as store:
        keys = list(range(64))
        src = torch.zeros((len(keys), SLOT), dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # after the zeros
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)  # the fill below lands well after the store is submitted
            src.fill_(0x5A)
        await store.store(keys, src, after=stream)  # no host sync: ordered on the GPU
        dst = torch.zeros_like(src)
        await store.load(keys, dst)
        torch.cuda.synchronize()
        assert bool((dst == 0x5A).all())


async def test_short_blocks_load_their_own_length_on_the_gpu() -> None:
    torch = torch_cuda()
    async with HostTier(gpu_config("register")) as tier, CopyEngine(0) as engine, BlockStore(tier, engine) as store:
        half = pages(torch, 4, 3)[:, : SLOT // 2].contiguous()
        await store.store([1, 2, 3, 4], half)
        dst = torch.full((4, SLOT), 0xEE, dtype=torch.uint8, device="cuda")
        await store.load([1, 2, 3, 4], dst)
        torch.cuda.synchronize()
        assert torch.equal(dst[:, : SLOT // 2], half)
        assert bool((dst[:, SLOT // 2 :] == 0xEE).all())  # only the stored length was copied


async def test_a_cancelled_device_load_has_landed_when_cancellation_arrives() -> None:
    torch = torch_cuda()
    async with HostTier(gpu_config("vmm")) as tier, CopyEngine(0) as engine, BlockStore(tier, engine) as store:
        keys = list(range(512))
        await store.store(keys, pages(torch, len(keys), 5))
        for delay in (0, 0.0005, 0.001, 0.002, 0.004):
            dst = torch.zeros((len(keys), SLOT), dtype=torch.uint8, device="cuda")
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                torch.cuda._sleep(5_000_000)
            task = asyncio.create_task(store.load(keys, dst, after=stream))
            await asyncio.sleep(delay)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            assert store.statistics().blocks_pinned == 0 and store.statistics().in_flight == 0
            dst.zero_()  # the caller reuses its buffer at once: nothing may still write into it
            torch.cuda.synchronize()
            assert int(dst.sum()) == 0
        assert tier.statistics().slots_allocated == len(store) == len(keys)


async def test_device_pages_by_address_and_present_keys_among_new_ones() -> None:
    """Pages named by device address, and a store whose present keys sit among new ones: the engine is
    handed the checked addresses of the new keys' pages only, in the caller's order."""
    torch = torch_cuda()
    async with HostTier(gpu_config("vmm")) as tier, CopyEngine(0) as engine, BlockStore(tier, engine) as store:
        src = pages(torch, 8, 11)
        base, row = src.data_ptr(), src.stride(0) * src.element_size()
        assert (await store.store([0, 2], [base, base + 2 * row])).stored == (0, 2)
        result = await store.store(list(range(8)), src)
        assert result.stored == (1, 3, 4, 5, 6, 7) and result.present == (0, 2)
        dst = torch.zeros_like(src)
        await store.load(list(range(8))[::-1], [dst.data_ptr() + i * row for i in range(8)])
        torch.cuda.synchronize()
        assert torch.equal(dst, src.flip(0))
        assert tier.statistics().slots_allocated == len(store) == 8
