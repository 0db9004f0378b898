"""A mock serving engine on a GPU: a paged KV cache offloaded to a filling host tier and onboarded back.

    python examples/engine_offload.py --quota 8GiB

The engine keeps its KV cache as pages of one CUDA tensor (``[gpu_pages,
page_bytes]`` uint8), the way paged-attention engines do. A request's prompt
is full blocks named by prefix-chained hashes; a kernel on the engine's
compute stream "computes" each block's KV page (bytes that follow from the
block's hash alone). When the request finishes, its new blocks are offloaded
to the host tier with ``store(keys, page_addresses, after=event)``: the copy
waits on the GPU for the kernel's event, not on the host, and the GPU pages
go back to the free list once it has landed. Later the same conversations
come back with a new turn: ``lookup`` finds their stored prefix, ``load``
brings it into fresh GPU pages (``after=`` the compute stream, which last
used those pages), and every onboarded page is compared on the GPU, bit for
bit, with what its hash computes.

All of it runs while the tier is still filling: the first offload comes
as soon as the tier's first unit is resident (after the CUDA context's
creation, about a second on a cold process). The program prints a JSON summary and exits 1 if a page differs.

Needs ``pip install 'aiokvtier[torch]'`` (the ``cuda`` extra and torch).
Without a CUDA device (or without torch, or the ``cuda`` extra) it prints
one line saying it skipped and exits 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import Any

from aiokvtier import _program

with _program.starting():  # a Ctrl-C during the slow imports ends the example at once, without a traceback
    import asyncio

    from pydantic import ByteSize, TypeAdapter, ValidationError

    from aiokvtier import BlockNotFound, BlockStore, CopyEngine, HostTier, HostTierConfig

BLOCK_TOKENS = 16
SHARED_PROMPTS = 4  # system prompts that many conversations start with


def size(text: str) -> int:
    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, or like 64KiB, 8GiB)") from None


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    # The aiokvtier command's parser: one-line errors, exit 2, every default in the help.
    parser = _program.Parser(prog="engine_offload.py", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quota", type=size, default="8GiB", help="the host tier")
    parser.add_argument("--page-size", type=size, default="64KiB", help="KV bytes per block")
    parser.add_argument("--gpu-pages", type=int, default=4096, help="pages of the GPU KV cache")
    parser.add_argument("--conversations", type=int, default=64, help="conversations")
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation")
    parser.add_argument("--blocks-per-turn", type=int, default=16, help="new blocks a turn adds")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--backing", choices=["auto", "register", "vmm"], default="auto", help="the tier's backing")
    parser.add_argument("--device", type=int, default=0, help="CUDA ordinal")
    args = parser.parse_args(argv)
    for name in ("gpu_pages", "conversations", "turns", "blocks_per_turn", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name.replace('_', '-')}: must be at least 1")
    try:
        args.config = HostTierConfig(
            quota=args.quota, max_quota=args.quota, slot_size=args.page_size, device=args.device, backing=args.backing
        )
    except ValidationError as error:
        parser.error(error.errors()[0]["msg"].removeprefix("Value error, "))
    return args


def cuda_or_reason(device: int) -> tuple[Any, str | None]:
    """torch when it can compute on ``device`` and the CopyEngine can copy there, else why not."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "torch sees no GPU"
    if device >= torch.cuda.device_count():
        return None, f"device {device} is not among torch's {torch.cuda.device_count()}"
    try:
        import cuda.bindings  # noqa: F401  (the CopyEngine's driver bindings)
    except ImportError:
        return None, "cuda-bindings (the 'cuda' extra) is not installed"
    return torch, None


class KVCache:
    """The GPU side: one uint8 tensor of pages, a free list, and the compute stream with its kernel."""

    def __init__(self, torch: Any, device: int, pages: int, page_bytes: int) -> None:
        self.torch = torch
        self.device = torch.device("cuda", device)
        self.page_bytes = page_bytes
        self.pages = torch.zeros((pages, page_bytes), dtype=torch.uint8, device=self.device)
        self.free = list(range(pages))
        self.freed = asyncio.Condition()
        self.stream = torch.cuda.Stream(self.device)
        self.offsets = torch.arange(page_bytes, dtype=torch.int64, device=self.device)
        torch.cuda.synchronize(self.device)  # made on the default stream; used on the compute stream

    def address(self, page: int) -> int:
        return int(self.pages.data_ptr()) + page * self.page_bytes

    async def take(self, n: int) -> list[int]:
        """``n`` free pages, waiting for other requests to give theirs back."""
        if n > len(self.pages):
            raise ValueError(f"a request needs {n} pages; the GPU cache has {len(self.pages)}")
        async with self.freed:
            await self.freed.wait_for(lambda: len(self.free) >= n)
            taken, self.free = self.free[:n], self.free[n:]
        return taken

    async def give_back(self, pages: list[int]) -> None:
        async with self.freed:
            self.free.extend(pages)
            self.freed.notify_all()

    def kv_of(self, keys: list[bytes]) -> Any:
        """The mock attention kernel: a ``[len(keys), page_bytes]`` uint8 tensor that follows from the hashes.

        Integer mixing (a multiply-xorshift hash of byte offset and block
        seed), kept below 2**63 so that nothing overflows int64.
        """
        torch = self.torch
        seeds = [int.from_bytes(k[:4], "little") ^ (int.from_bytes(k[4:8], "little") >> 1) for k in keys]
        h = self.offsets[None, :] * 40503 + torch.tensor(seeds, dtype=torch.int64, device=self.device)[:, None]
        h = (h & 0xFFFFFFFF) ^ (h >> 29)
        h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
        h = h ^ (h >> 16)
        return (h & 0xFF).to(torch.uint8)

    def compute(self, keys: list[bytes], pages: list[int]) -> Any:
        """Write the blocks' KV into ``pages`` on the compute stream; returns an event recorded after it."""
        torch = self.torch
        with torch.cuda.stream(self.stream):
            index = torch.tensor(pages, dtype=torch.int64, device=self.device)
            self.pages.index_copy_(0, index, self.kv_of(keys))
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def differing(self, keys: list[bytes], pages: list[int]) -> int:
        """How many of ``pages`` differ from what their keys compute (checked on the GPU)."""
        torch = self.torch
        with torch.cuda.stream(self.stream):
            index = torch.tensor(pages, dtype=torch.int64, device=self.device)
            same = (self.pages.index_select(0, index) == self.kv_of(keys)).all(dim=1)
            return int((~same).sum().item())


def conversation_keys(conversation: int, turns: int, blocks_per_turn: int) -> list[bytes]:
    """Block hashes of a conversation after ``turns`` turns: a shared system prompt, then its own blocks.

    Each hash covers its parent's hash and the block's tokens, so equal
    hashes mean equal prefixes; the tokens are a function of position here.
    """
    keys, parent = [], b""
    system = conversation % SHARED_PROMPTS
    for i in range(blocks_per_turn + turns * blocks_per_turn):
        owner = f"system {system}" if i < blocks_per_turn else f"conversation {conversation}"
        tokens = f"{owner} block {i} of {BLOCK_TOKENS} tokens".encode()
        parent = hashlib.sha256(parent + tokens).digest()
        keys.append(parent)
    return keys


COUNTS = (
    "requests", "blocks_asked", "hits", "blocks_computed", "blocks_offloaded", "blocks_present",
    "blocks_skipped", "blocks_onboarded", "blocks_verified", "mismatches", "lost_to_eviction",
)  # fmt: skip


class Engine:
    def __init__(self, store: BlockStore, tier: HostTier, cache: KVCache, opened: float) -> None:
        self.store, self.tier, self.cache = store, tier, cache
        self.opened = opened
        self.counts = dict.fromkeys(COUNTS, 0)
        self.first_offload: dict[str, Any] | None = None

    async def serve(self, keys: list[bytes]) -> None:
        """One request: onboard the stored prefix, compute the rest, offload the new blocks, free the pages."""
        c, cache, store = self.counts, self.cache, self.store
        c["requests"] += 1
        c["blocks_asked"] += len(keys)
        pages = await cache.take(len(keys))
        try:
            hits = store.lookup(keys)  # the connector's get_num_new_matched_tokens: hits * BLOCK_TOKENS
            if hits:
                try:
                    # The fresh pages were last written or read by kernels on the compute stream.
                    await store.load(keys[:hits], [cache.address(p) for p in pages[:hits]], after=cache.stream)
                except BlockNotFound:
                    hits = 0  # evicted since the lookup: recompute it all
                    c["lost_to_eviction"] += 1
                else:
                    c["blocks_onboarded"] += hits
                    bad = cache.differing(keys[:hits], pages[:hits])
                    c["mismatches"] += bad
                    c["blocks_verified"] += hits - bad
            c["hits"] += hits
            new_keys, new_pages = keys[hits:], pages[hits:]
            if new_keys:
                done = cache.compute(new_keys, new_pages)
                c["blocks_computed"] += len(new_keys)
                addresses = [cache.address(p) for p in new_pages]
                result = await store.store(new_keys, addresses, after=done, wait=False)
                if self.first_offload is None and result.stored:
                    t = self.tier.statistics()
                    self.first_offload = {
                        "ms_after_open": round((time.perf_counter() - self.opened) * 1e3, 2),
                        "resident_bytes": t.resident_bytes,
                        "resident_fraction": round(t.resident_bytes / t.quota, 6),
                        "tier_filling": t.filling,
                    }
                c["blocks_offloaded"] += len(result.stored)
                c["blocks_present"] += len(result.present)
                c["blocks_skipped"] += len(result.skipped)
        finally:
            # store() returned: the copy out has landed, so the pages are free to reuse.
            await cache.give_back(pages)


async def run(args: argparse.Namespace, torch: Any) -> dict[str, Any]:
    cache = KVCache(torch, args.device, args.gpu_pages, args.page_size)
    cache.differing([b"warm-up!"], [0])  # the kernels load before the clock starts, as in a running engine
    started = time.perf_counter()
    async with AsyncExitStack() as stack:
        tier = await stack.enter_async_context(HostTier(args.config))
        engine = await stack.enter_async_context(CopyEngine(args.device))
        store = await stack.enter_async_context(BlockStore(tier, engine))
        mock = Engine(store, tier, cache, started)
        limit = asyncio.Semaphore(args.concurrency)

        async def request(conversation: int, turn: int) -> None:
            async with limit:
                await mock.serve(conversation_keys(conversation, turn, args.blocks_per_turn))

        turns = []
        for turn in range(1, args.turns + 1):  # every conversation comes back with one more turn
            before = dict(mock.counts)
            await asyncio.gather(*(request(c, turn) for c in range(args.conversations)))
            asked = mock.counts["blocks_asked"] - before["blocks_asked"]
            hits = mock.counts["hits"] - before["hits"]
            fraction = round(tier.statistics().resident_bytes / tier.statistics().quota, 6)
            turns.append({"turn": turn, "blocks_asked": asked, "hits": hits, "resident_fraction": fraction})
        elapsed = time.perf_counter() - started
        t, s, e = tier.statistics(), store.statistics(), engine.statistics()
        return {
            "device": torch.cuda.get_device_name(args.device),
            "backing": t.backing,
            "quota_bytes": t.quota,
            "page_bytes": t.slot_size,
            "gpu_pages": args.gpu_pages,
            **mock.counts,
            "bytes_offloaded": s.bytes_stored,
            "bytes_onboarded": s.bytes_loaded,
            "copy_bytes_by_direction": e.bytes_by_direction,
            "copy_batches_by_direction": e.jobs_by_direction,
            "store": {"blocks": s.blocks, "capacity": s.capacity, "evictions": s.evictions, "skipped": s.skipped},
            "turns": turns,
            "first_offload": mock.first_offload,
            "at_end": {
                "resident_bytes": t.resident_bytes,
                "resident_fraction": round(t.resident_bytes / t.quota, 6),
                "tier_filling": t.filling,
            },
            "elapsed_s": round(elapsed, 3),
        }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    torch, reason = cuda_or_reason(args.device)
    if torch is None:
        print(f"engine_offload: skipped: no CUDA device ({reason})")
        return 0
    summary = _program.run_async(run(args, torch))
    print(json.dumps(summary, indent=2))
    return 1 if summary["mismatches"] else 0


if __name__ == "__main__":
    # By the aiokvtier command's conventions: a usage error exits 2 in one line, Ctrl-C closes what is
    # open and ends by SIGINT, a closed stdout ends quietly.
    _program.run(main, name="engine_offload.py")
