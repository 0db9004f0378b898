"""A process that stores and discards generations of keys in a pool, for tests/test_pool_contains_attack.py.

``python tests/pool_contains_writer.py LOOP PATH COUNTER SECONDS``: attaches to
the pool at PATH on LOOP and, for generation g = 0, 1, 2, ... until SECONDS
have passed, publishes ``2g`` in the first 8 bytes of the file COUNTER, stores
generation g's keys (``gen_keys(g)``, one call), publishes ``2g + 1`` and
discards generation g - 2 (one call). So a key of generation g can be
visible only while the counter reads ``2g`` to ``2g + 5``, and is visible for
sure (in a pool with room for three generations) while it reads ``2g + 1`` to
``2g + 4``. Prints ``{"event": "attached"}``, then ``{"event": "done", "generations": N}``.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import sys
import time

import numpy as np

from aiokvtier import AttachedPool

PER_GENERATION = 16


def gen_keys(g: int) -> list[bytes | int]:
    """Generation g's keys: short bytes, bytes past the mirror's 32 compared bytes (sharing those 32 with
    every generation's), bytes past its 256 hashed bytes (a digest), int64s of both signs and ints past 64
    bits."""
    out: list[bytes | int] = []
    for j in range(PER_GENERATION):
        tag = b"%06d-%03d" % (g, j)
        kind = j % 8
        if kind in (0, 4):
            out.append(b"s-" + tag)
        elif kind in (1, 5):
            out.append(b"P" * 32 + tag)
        elif kind == 2:
            out.append(b"Q" * 290 + tag)
        elif kind == 3:
            out.append(g * 1000 + j if g % 2 else -(g * 1000 + j) - 1)
        elif kind == 6:
            out.append(b"m" * 20 + tag)
        else:
            out.append(2**70 + g * 1000 + j)
    return out


def decoys(g: int) -> list[bytes | int]:
    """Keys no process stores, each a near miss of one of generation g's: a byte more or less, a trailing
    NUL, another kind (an int's bytes, a bytes key's digits as an int)."""
    out: list[bytes | int] = []
    for key in gen_keys(g):
        if isinstance(key, bytes):
            out += [key + b"\0", key[:-1], key[:-1] + bytes([key[-1] ^ 1])]
        else:
            out += [key + 10**9, str(key).encode()]
            if -(2**63) <= key < 2**63:
                out.append(key.to_bytes(8, "little", signed=True))
    return out


def mapped(counter_path: str) -> mmap.mmap:
    with open(counter_path, "r+b") as f:
        return mmap.mmap(f.fileno(), 8)


async def main(path: str, counter_path: str, seconds: float) -> None:
    counter = mapped(counter_path)  # before the loop's work: a file of 8 bytes
    published = np.frombuffer(counter, dtype=np.uint64, count=1)
    async with AttachedPool(path) as pool:
        print(json.dumps({"event": "attached"}), flush=True)
        end = time.monotonic() + seconds
        g = 0
        while time.monotonic() < end:
            published[0] = 2 * g
            keys = gen_keys(g)
            result = await pool.store(keys, [b"%d" % i for i in range(len(keys))])
            assert not result.present, result  # every key is stored once
            published[0] = 2 * g + 1
            if g >= 2:
                await pool.discard(gen_keys(g - 2))
            g += 1
    del published
    counter.close()
    print(json.dumps({"event": "done", "generations": g}), flush=True)


if __name__ == "__main__":
    loop, path, counter_path, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    if loop == "uvloop":
        import uvloop

        uvloop.run(main(path, counter_path, seconds))
    else:
        asyncio.run(main(path, counter_path, seconds))
