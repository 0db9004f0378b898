"""``bench store --sections tiers``, its ``mooncake`` row: the tier beside Mooncake's own batch calls.

A ``mooncake_master`` is started on free loopback ports for the run and
stopped after. Both arms move the same blocks between the same registered
host tier slots and the store, through the same client: the baseline is one
``batch_put_from`` / ``batch_get_into`` of every block on one thread, what an
engine calling Mooncake directly does; the tier splits the batch over its
threads, checks sizes and counts. Rounds alternate between the arms, each
round under fresh keys (removed after it); medians are reported.

A third arm loads the tier's blocks through a ``BlockStore`` over another
host tier (``remote=`` the same tier), into a numpy array: each block comes
from the cluster into a store slot, then is copied out, the previous round's
blocks evicted for room (``store_get``); the same load again, now host hits,
is the copy out alone (``store_hit``). Its baseline is the tier's own get
followed by that copy: ``store_get_ratio`` is their time over ``store_get``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from .._config import HostTierConfig, MooncakeTierConfig
from .._host._tier import HostTier
from .._mooncake import _client
from .._mooncake._tier import MooncakeTier
from .._store._store import BlockStore
from ._common import median

KiB, MiB = 1 << 10, 1 << 20
BLOCK = 64 * KiB


@contextlib.contextmanager
def _master(binary: str) -> Iterator[tuple[int, int]]:
    rpc, http, metrics = _client.loopback_ports(3)
    argv = _client.master_argv(binary, rpc, http, metrics)
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    for port in (rpc, http):
                        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        raise RuntimeError(f"mooncake_master did not start: {log.read()[-2000:].decode()}") from None
                    time.sleep(0.05)
            yield rpc, http
        finally:
            process.kill()
            process.wait(10)


async def _run(rpc: int, http: int, n: int, rounds: int) -> dict[str, Any]:
    total = n * BLOCK
    config = MooncakeTierConfig.model_validate(
        {
            "master": f"127.0.0.1:{rpc}",
            "metadata_server": f"http://127.0.0.1:{http}/metadata",
            "local_hostname": "127.0.0.1",
            "segment_size": 2 * total + 64 * MiB,  # both arms' blocks of a round, and room to spare
            "local_buffer_size": 16 * MiB,
            "timeout": 60.0,
        }
    )
    host_config = HostTierConfig.model_validate(
        {"quota": 2 * total, "max_quota": 2 * total, "slot_size": BLOCK, "fill_threads": 2}
    )
    near_config = HostTierConfig.model_validate({"quota": total, "max_quota": total, "slot_size": BLOCK})
    arms = ("raw_put", "raw_get", "tier_put", "tier_get", "store_get", "store_hit")
    samples: dict[str, list[float]] = {k: [] for k in arms}
    out = np.empty((n, BLOCK), dtype=np.uint8)
    async with (
        HostTier(host_config) as host,
        MooncakeTier(config, block_size=BLOCK, fingerprint="bench") as tier,
        HostTier(near_config) as near,
        BlockStore(near, remote=tier) as store,
    ):
        await host.wait_resident()
        await near.wait_resident()
        await tier.register(host.base_address, 2 * total)
        src, dst = await host.allocate(n), await host.allocate(n)
        rng = np.random.default_rng(7)
        for slot in src:
            host.view(slot)[:] = rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
        src_addresses = host.slot_addresses(src).tolist()
        dst_addresses = host.slot_addresses(dst).tolist()
        sizes = [BLOCK] * n
        client = tier._client  # the baseline calls the very client the tier uses
        for r in range(rounds + 1):
            raw_names = [f"bench-raw/{r}/{i}" for i in range(n)]
            keys: list[bytes | int] = [r * n + i for i in range(n)]
            started = time.perf_counter()
            codes = await asyncio.to_thread(client.batch_put_from, raw_names, src_addresses, sizes)
            raw_put = time.perf_counter() - started
            assert all(code == 0 for code in codes), f"Mooncake refused puts: {sorted(set(codes))}"
            started = time.perf_counter()
            got = await asyncio.to_thread(client.batch_get_into, raw_names, dst_addresses, sizes)
            raw_get = time.perf_counter() - started
            assert all(size == BLOCK for size in got)
            started = time.perf_counter()
            written = await tier.write(keys, src_addresses, sizes)
            tier_put = time.perf_counter() - started
            assert len(written) == n, tier.statistics()
            started = time.perf_counter()
            ok = await tier.read(keys, dst_addresses)
            tier_get = time.perf_counter() - started
            assert all(ok), tier.statistics()
            started = time.perf_counter()
            await store.load(keys, out)  # only in the cluster: into the store's slots, then out
            store_get = time.perf_counter() - started
            assert store.statistics().remote_fetched == (r + 1) * n, store.statistics()
            started = time.perf_counter()
            await store.load(keys, out)  # now host hits: the copy out alone
            store_hit = time.perf_counter() - started
            # force: past the lease a put or get gives every block
            await asyncio.to_thread(client.batch_remove, raw_names + tier.keys.names(keys), True)
            if r:  # the first round warms the threads and the segment
                measured = (raw_put, raw_get, tier_put, tier_get, store_get, store_hit)
                for name, value in zip(samples, measured, strict=True):
                    samples[name].append(value)
        for i, (slot_a, slot_b) in enumerate(zip(src[:8], dst[:8], strict=True)):
            assert bytes(host.view(slot_a)) == bytes(host.view(slot_b)) == out[i].tobytes(), "a block came back wrong"
    gbps = {k: round(total / median(v) / 1e9, 3) for k, v in samples.items()}
    return {
        "block_bytes": BLOCK,
        "blocks": n,
        "protocol": "tcp (loopback)",
        "gb_per_s": gbps,
        "put_ratio": round(gbps["tier_put"] / gbps["raw_put"], 3),
        "get_ratio": round(gbps["tier_get"] / gbps["raw_get"], 3),
        "store_get_ratio": round(
            (median(samples["tier_get"]) + median(samples["store_hit"])) / median(samples["store_get"]), 3
        ),
    }


def row(quick: bool) -> dict[str, Any]:
    """The tier's put and get against Mooncake's batch calls, or why it was skipped."""
    # Mooncake's info lines, in this program's own process: the wheel reads MC_LOG_LEVEL when it is first
    # imported (below), and ignores GLOG_minloglevel (0.3.13).
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    why = _client.why_unloadable()
    binary = _client.find_master()
    if why is not None or binary is None:
        return {"skipped": why or "mooncake_master is not installed"}
    n, rounds = (1024, 2) if quick else (4096, 5)
    with _master(binary) as (rpc, http):
        return asyncio.run(_run(rpc, http, n, rounds))
