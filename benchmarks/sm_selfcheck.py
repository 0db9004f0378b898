"""A one-minute check of the SM copy path on a GPU machine; prints JSON, exits 1 on a failure.

python benchmarks/sm_selfcheck.py
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import traceback
from typing import Any

from aiokvtier import CopyEngine, HostTier, HostTierConfig
from aiokvtier._cuda import _kernel
from aiokvtier._cuda._driver import PrimaryContext, check, driver


async def round_trip(backing: str, page: int = 16 << 10, n: int = 1024) -> dict[str, Any]:
    cfg = HostTierConfig.model_validate(
        {"quota": 64 << 20, "max_quota": 64 << 20, "slot_size": page, "commit_unit": 32 << 20,
         "fill_chunk": 32 << 20, "device": 0, "backing": backing}
    )  # fmt: skip
    async with HostTier(cfg) as tier, CopyEngine(0, method="sm") as engine:
        await tier.wait_resident()
        slots = (await tier.allocate(n))[::-1]
        drv = driver()
        mapped = check("cuMemHostGetDevicePointer", drv.cuMemHostGetDevicePointer(tier.address(slots[0]), 0))
        for i, s in enumerate(slots):
            tier.view(s)[:] = bytes([i % 251]) * page
        dev = int(check("cuMemAlloc", drv.cuMemAlloc(n * page)))
        try:
            await engine.to_device(tier, slots, [dev + i * page for i in range(n)])
            for s in slots:
                tier.view(s)[:] = b"\0" * page
            await engine.to_host(tier, slots, [dev + i * page for i in range(n)])
        finally:
            drv.cuMemFree(dev)
        bad = [i for i, s in enumerate(slots) if bytes(tier.view(s)) != bytes([i % 251]) * page]
        stats = dataclasses.asdict(engine.statistics())
        return {
            "bit_exact": not bad,
            "first_bad": bad[:4],
            "host_pointer_is_device_pointer": int(mapped) == tier.address(slots[0]),
            "stats": {k: v for k, v in stats.items() if "method" in k or k.startswith("sm")},
        }


def main() -> int:
    report: dict[str, Any] = {}
    ok = True
    try:
        ctx = PrimaryContext(0)
        ctx.make_current()
        arch = _kernel.device_arch(0)
        report["arch"] = arch
        report["host_pointers_usable"] = _kernel.host_pointers_usable(0)
        report["cubin_bytes"] = len(_kernel.compile_cubin(_kernel.KernelSpec(arch)))
        for backing in ("register", "vmm"):
            report[backing] = asyncio.run(round_trip(backing))
            ok &= report[backing]["bit_exact"]
        ctx.release()
    except Exception:
        report["error"] = traceback.format_exc()
        ok = False
    print(json.dumps(report, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
