"""A second process that writes a pool's index mirror, for tests/test_pool_index_shm.py.

``python tests/pool_mirror_writer.py FD SLOTS SECONDS SEED``: maps the
mirror at FD (inherited) as its writer and churns the keys ``c00000``...
(inserted with slot = their number and length = a generation * 1000 + their
number, removed at random, the table rebuilt whenever its tombstones pile
up) for SECONDS, with ``weak_hash``, whose few values put every key in a
handful of collision chains. Prints ``{"writes": N}`` at the end.
"""

from __future__ import annotations

import json
import random
import sys
import time

import numpy as np
import numpy.typing as npt

STABLE, CHURN = 8, 40
"""Keys ``s00000``.. (inserted once by the test, never removed) and ``c00000``.. (churned here)."""


def weak_hash(data: npt.NDArray[np.uint8], kind: int, lengths: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    """Seven values, from the key's last byte: collisions everywhere (the key bytes must tell keys apart)."""
    h = np.zeros((2, data.shape[0]), dtype=np.uint64)
    h[0] = data[np.arange(data.shape[0]), np.maximum(lengths - 1, 0)].astype(np.uint64) % np.uint64(7)
    return h


def key(group: str, i: int) -> bytes:
    return b"%s%05d" % (group.encode(), i)


def main(fd: int, slots: int, seconds: float, seed: int) -> None:
    from aiokvtier._pool._mirror import IndexMirror

    mirror = IndexMirror(fd, slots, owner=True, hasher=weak_hash)
    rng = random.Random(seed)
    present: set[int] = set()
    writes = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        absent = [i for i in range(STABLE, STABLE + CHURN) if i not in present]
        add = rng.sample(absent, rng.randint(0, len(absent)))
        if add:
            generation = rng.randint(1, 60)
            mirror.insert([key("c", i) for i in add], add, [generation * 1000 + i for i in add])
            present.update(add)
        drop = rng.sample(sorted(present), rng.randint(0, len(present)))
        if drop:
            mirror.remove_slots(drop)  # key c<i> lives in slot i
            present.difference_update(drop)
        writes += 2
    mirror.close()
    print(json.dumps({"writes": writes}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
