"""An SGLang HiCache storage in its own process, for the SGLang integration tests and benchmark.

``python tests/sglang_instance.py POOL_PATH``: builds SGLang's host KV pool
(``make_host_pool``) and the aiokvtier storage the way SGLang's dynamic
loader does (``make_storage``) over the pool at POOL_PATH, prints
``{"event": "ready"}``, then answers one JSON command a line:

- ``{"op": "set", "keys": [...], "seed": N}``: fills pages with bytes from
  seed N, ``batch_set_v1``; answers the results and each page's digest;
- ``{"op": "get", "keys": [...]}``: ``exists`` of each key, ``batch_exists``,
  ``batch_get_v1`` into fresh host pages; answers those and the digests;
- ``{"op": "close"}``: ``close()``, answers and exits.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

PAGE = 16
"""Tokens per page."""


def make_host_pool(
    layout: str = "page_first", *, page: int = PAGE, layers: int = 4, heads: int = 4, dim: int = 64, tokens: int = 2048
) -> Any:
    """SGLang's MHA host KV pool on the CPU (fp16), as SGLang builds it beside a device pool."""
    device = MHATokenToKVPool(
        tokens, page, torch.float16, heads, dim, layers, "cpu", False, start_layer=0, end_layer=layers - 1
    )
    return MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        page,
        layout,
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
        write_back_staging=device.hicache_write_back_staging,
    )


def storage_config(
    section: dict[str, Any], *, v1: bool = True, tp_rank: int = 0, tp_size: int = 1, mla: bool = False, dp_rank: int = 0
) -> Any:
    extra = {
        "backend_name": "aiokvtier",
        "module_path": "aiokvtier.integrations.sglang",
        "class_name": "HiCacheAiokvtier",
        "interface_v1": 1 if v1 else 0,
        "aiokvtier": section,
    }
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=True,
        model_name="test/model",
        dp_rank=dp_rank,
        extra_config=extra,
    )


def make_storage(host: Any, section: dict[str, Any], **kwargs: Any) -> Any:
    """The storage as SGLang's cache controller makes it: the factory's dynamic backend, then the host pool."""
    storage = StorageBackendFactory.create_backend("dynamic", storage_config(section, **kwargs), host)
    storage.register_mem_pool_host(host)
    return storage


def page_bytes(host: Any, index: int) -> bytes:
    """The bytes of the page at host index ``index``, span after span (as the zero-copy calls see it)."""
    ptrs, sizes = host.get_page_buffer_meta(torch.arange(index, index + host.page_size))
    return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes, strict=True))


def fill_pages(host: Any, indices: torch.Tensor, seed: int) -> None:
    """Random bytes in every span of the pages at ``indices``."""
    rng = np.random.default_rng(seed)
    ptrs, sizes = host.get_page_buffer_meta(indices)
    for p, s in zip(ptrs, sizes, strict=True):
        ctypes.memmove(p, rng.integers(0, 256, s, dtype=np.uint8).tobytes(), s)


def digests(host: Any, indices: torch.Tensor) -> list[str]:
    starts = indices[:: host.page_size].tolist()
    return [hashlib.sha256(page_bytes(host, i)).hexdigest() for i in starts]


def main(path: str) -> None:
    host = make_host_pool()
    storage = make_storage(host, {"pool": path})
    print(json.dumps({"event": "ready"}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        keys = command.get("keys", [])
        if command["op"] == "set":
            indices = host.alloc(len(keys) * host.page_size)
            fill_pages(host, indices, command["seed"])
            results = storage.batch_set_v1(keys, indices)
            answer = {"results": results, "digests": digests(host, indices)}
        elif command["op"] == "get":
            indices = host.alloc(len(keys) * host.page_size)
            exists = [storage.exists(k) for k in keys]
            prefix = storage.batch_exists(keys)
            results = storage.batch_get_v1(keys, indices)
            answer = {"exists": exists, "prefix": prefix, "results": results, "digests": digests(host, indices)}
        else:
            storage.close()
            print(json.dumps({"closed": True}), flush=True)
            return
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
