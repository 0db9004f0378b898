"""An owner process for the pool tests: ``python tests/pool_owner.py LOOP PATH QUOTA [SLOT]`` opens a pool
at PATH, prints ``{"event": "serving", "pid": ...}`` and serves until stdin closes (or it is killed)."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from aiokvtier import Pool


async def main(path: str, quota: str, slot_size: str = "64KiB") -> None:
    config = {"quota": quota, "max_quota": quota, "slot_size": slot_size}
    async with Pool(config, path):
        sys.stdout.write(json.dumps({"event": "serving", "pid": os.getpid()}) + "\n")
        sys.stdout.flush()
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        await reader.read()


if __name__ == "__main__":
    if sys.argv[1] == "uvloop":
        import uvloop

        uvloop.run(main(*sys.argv[2:]))
    else:
        asyncio.run(main(*sys.argv[2:]))
