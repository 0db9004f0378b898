"""A mock serving engine over a BlockStore: prefix-cache lookups, loads for hits, stores after prefill.

Prompts are token blocks named by prefix-chained hashes (a block's hash
covers its parent's hash and its own tokens, so equal hashes mean equal
prefixes). Each request looks its prefix up, loads the hits, "computes" the
rest (deterministic bytes per block hash) and stores it without waiting for
the tier's fill. The quota is small, so later rounds evict earlier blocks
while the first round runs as the tier still fills. A router task follows the
event stream. Every loaded block is checked against what its hash computes.

With CUDA (``pip install 'aiokvtier[torch]'``: torch and the ``cuda`` extra)
pages are CUDA tensors copied by a CopyEngine; without, numpy pages copied on
the store's thread.

    python examples/engine_mock.py
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

from aiokvtier import _program

with _program.starting():  # a Ctrl-C during the slow imports ends the example at once, without a traceback
    import asyncio

    import numpy as np

    from aiokvtier import BlockEvent, BlockNotFound, BlockStore, HostTier, HostTierConfig

BLOCK_TOKENS = 16
PAGE = 64 << 10  # KV bytes per block (all layers of one block, for the mock)
QUOTA = 8 << 20  # 128 blocks: far fewer than the run touches; the tier fills in two steps


def block_hashes(tokens: list[int]) -> list[bytes]:
    """One key per full block: sha256(parent hash, the block's tokens)."""
    keys, parent = [], b""
    for i in range(0, len(tokens) - len(tokens) % BLOCK_TOKENS, BLOCK_TOKENS):
        chunk = np.asarray(tokens[i : i + BLOCK_TOKENS], dtype=np.int32).tobytes()
        parent = hashlib.sha256(parent + chunk).digest()
        keys.append(parent)
    return keys


def compute_kv(keys: list[bytes]) -> np.ndarray:
    """The mock prefill: each block's KV bytes follow from its hash alone."""
    return np.stack([np.frombuffer(hashlib.shake_128(k).digest(PAGE), dtype=np.uint8) for k in keys])


class Pages:
    """Host numpy pages, or CUDA tensor pages when a GPU is here."""

    def __init__(self) -> None:
        self.torch: Any = None
        try:
            import cuda.bindings  # noqa: F401  (the CopyEngine's dependency)
            import torch

            if torch.cuda.is_available():
                self.torch = torch
        except ImportError:
            pass

    @property
    def device(self) -> int | None:
        return 0 if self.torch is not None else None

    def upload(self, host: np.ndarray) -> Any:
        return host if self.torch is None else self.torch.from_numpy(host).to("cuda")

    def empty(self, n: int) -> Any:
        if self.torch is None:
            return np.empty((n, PAGE), dtype=np.uint8)
        return self.torch.empty((n, PAGE), dtype=self.torch.uint8, device="cuda")

    def download(self, pages: Any) -> np.ndarray:
        return pages if self.torch is None else pages.cpu().numpy()

    def stream(self) -> Any:
        """What the copies wait for on the GPU: the stream the compute ran on."""
        return None if self.torch is None else self.torch.cuda.current_stream()


class Engine:
    def __init__(self, store: BlockStore, pages: Pages) -> None:
        self.store, self.pages = store, pages
        self.asked = self.hits = self.loaded = self.stored = self.skipped = self.raced = 0

    async def serve(self, tokens: list[int]) -> None:
        keys = block_hashes(tokens)
        self.asked += len(keys)
        hits = self.store.lookup(keys)  # the connector's get_num_new_matched_tokens: hits * BLOCK_TOKENS
        if hits:
            dst = self.pages.empty(hits)
            try:
                await self.store.load(keys[:hits], dst, after=self.pages.stream())
            except BlockNotFound:
                hits = 0  # evicted by a concurrent store since the lookup: recompute it all
                self.raced += 1
            else:
                if not np.array_equal(self.pages.download(dst), compute_kv(keys[:hits])):
                    raise AssertionError("a loaded block differs from what was stored")
                self.loaded += hits
        self.hits += hits
        new = keys[hits:]
        if new:
            await asyncio.sleep(0.001)  # prefill
            kv = self.pages.upload(compute_kv(new))
            result = await self.store.store(new, kv, after=self.pages.stream(), wait=False)
            self.stored += len(result.stored)
            self.skipped += len(result.skipped)


class Router:
    """What a KV-aware router knows from the event stream alone: which blocks this store holds."""

    def __init__(self, events: AsyncIterator[BlockEvent]) -> None:
        self.events, self.held, self.dropped = events, set[bytes](), 0
        self.counts = {"stored": 0, "evicted": 0, "discarded": 0}

    async def follow(self) -> None:
        async for event in self.events:
            self.dropped += event.dropped
            self.counts[event.kind] += len(event.keys)
            keys = {k for k in event.keys if isinstance(k, bytes)}
            if event.kind == "stored":
                self.held |= keys
            else:
                self.held -= keys


def prompts(rng: random.Random, round_: int) -> list[list[int]]:
    """Three shared system prompts; users come back with their conversation plus a new turn."""
    systems = [[1000 * s + t for t in range(8 * BLOCK_TOKENS)] for s in range(3)]
    out = []
    for user in range(8):
        rng_user = random.Random(user)  # a user's history is the same every round, and grows
        history = [rng_user.randrange(50_000) for _ in range(BLOCK_TOKENS * (4 + round_ * 3))]
        fresh = [rng.randrange(50_000) for _ in range(BLOCK_TOKENS * rng.randrange(2, 6))]
        out.append(systems[user % 3] + history + fresh)
    return out


async def main() -> None:
    pages = Pages()
    config = HostTierConfig(quota=QUOTA, max_quota=QUOTA, slot_size=PAGE, numa_node=None, device=pages.device)
    rng = random.Random(7)
    async with AsyncExitStack() as stack:
        tier = await stack.enter_async_context(HostTier(config))
        engine: Any = None
        if pages.device is not None:
            from aiokvtier import CopyEngine

            engine = await stack.enter_async_context(CopyEngine(pages.device))
        print("pages:", "CUDA tensors through a CopyEngine" if engine else "numpy, copied on the store's thread")
        store = await stack.enter_async_context(BlockStore(tier, engine))
        router = Router(store.events())
        following = asyncio.create_task(router.follow())
        mock = Engine(store, pages)
        for round_ in range(5):
            before = (mock.asked, mock.hits)
            filling = tier.statistics().resident_bytes < QUOTA
            await asyncio.gather(*(mock.serve(p) for p in prompts(rng, round_)))
            asked, hits = mock.asked - before[0], mock.hits - before[1]
            s = store.statistics()
            print(
                f"round {round_ + 1}: {asked} blocks asked, {hits} hits ({hits / asked:.0%}), "
                f"{s.blocks}/{s.capacity} blocks held, {s.evictions} evicted so far"
                + (", tier still filling at the start" if filling else "")
            )
        for _ in range(10):  # let the router read the last events
            await asyncio.sleep(0)
        agrees = len(router.held) == len(store) and all(k in store for k in router.held)
        await store.aclose()  # ends the event stream: the router has seen everything
        await following
        s = store.statistics()
        print(
            f"hit rate {mock.hits / mock.asked:.1%} over {mock.asked} blocks; {mock.stored} stored, "
            f"{mock.skipped} skipped (not resident yet), {s.evictions} evicted, {mock.raced} lookups raced an eviction"
        )
        print(f"router: {router.counts} from the events, {router.dropped} dropped; agrees with the store: {agrees}")
        assert s.evictions > 0 and mock.hits > 0
        print(f"verified: {mock.loaded} loaded blocks equal what was stored")


def cli() -> None:
    _program.Parser(prog="engine_mock.py", description=(__doc__ or "").split("\n\n")[0]).parse_args()
    _program.run_async(main())


if __name__ == "__main__":
    # By the aiokvtier command's conventions: --help, one-line errors (exit 2), Ctrl-C closes the tier
    # and ends by SIGINT, a closed stdout ends quietly.
    _program.run(cli, name="engine_mock.py")
