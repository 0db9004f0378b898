"""SGLang's hybrid-model existence check (``batch_exists_v2``) through ``aiokvtier.integrations.sglang``.

A prefix of ``--pages`` pages is stored in the KV pool (``batch_set_v1``) with a
Mamba state per page (``batch_set_v2``), over a pool (an ``aiokvtier pool`` owner
in a child process) and over a tier of this process; then ``batch_exists_v2`` of
the whole prefix with the Mamba pool under each hit policy (``ALL_PAGES``: the
stored prefix; ``TRAILING_PAGES``: each page's presence, past any gap), beside
``batch_exists`` of the same pages (the KV pool alone), called from the calling
thread as SGLang's prefetch thread calls it.

    python benchmarks/sglang_hybrid_exists.py [--pages 512] [--rounds 60]

Needs SGLang (``pip install 'aiokvtier[sglang]'``). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang_storage import PAGE, Owner, host_pool, storage, summary, timed

from aiokvtier.bench._common import machine


def mamba_pool(pages: int) -> Any:
    """SGLang's Mamba state host pool on the CPU, a state (two buffers) per page."""
    info = MambaStateBufferInfo(
        temporal=torch.zeros(2, pages, 4, 8, dtype=torch.float32),
        conv=(torch.zeros(2, pages, 3, 16, dtype=torch.bfloat16),),
    )
    return MambaPoolHost(info, 2.0, 0, device_capacity=pages, pin_memory=False, device="cpu", layout="page_first")


def measure(section: dict[str, Any], pages: int, rounds: int) -> dict[str, Any]:
    host, mamba = host_pool(pages), mamba_pool(pages)
    made = storage(host, section, v1=True)
    made.register_mem_host_pool_v2(host, PoolName.KV)
    made.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    try:
        keys = [f"hybrid-{i:06d}" for i in range(pages)]
        assert made.batch_set_v1(keys, torch.arange(pages * PAGE)) == [True] * pages
        states = made.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.arange(pages), keys=keys)])
        assert states[PoolName.MAMBA] == [True] * pages
        out: dict[str, Any] = {"batch_exists": summary(timed(lambda: made.batch_exists(keys), rounds))}
        for policy in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
            query = [PoolTransfer(name=PoolName.MAMBA, keys=keys[:1], hit_policy=policy)]
            assert made.batch_exists_v2(keys, query).kv_hit_pages == pages
            out[f"exists_v2_{policy.value}"] = summary(timed(lambda q=query: made.batch_exists_v2(keys, q), rounds))
        return out
    finally:
        made.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    result: dict[str, Any] = {"machine": machine(), "pages": args.pages, "rounds": args.rounds}
    with Owner("512MiB", "64KiB") as path:
        result["pool"] = measure({"pool": path}, args.pages, args.rounds)
    result["tier"] = measure({"tier": {"quota": "256MiB", "slot_size": "64KiB"}}, args.pages, args.rounds)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
