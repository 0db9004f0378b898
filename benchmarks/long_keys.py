"""A long key's entry in the shared pool's index mirror: the digest path beside the word-by-word hash.

``key_rows`` hashes a key longer than ``LONG_BYTES`` over its first bytes and a BLAKE2b digest of it; the
word-by-word hash (``hash_words`` over every 8 bytes, what every key went through before) is the baseline,
timed on the same key in the same run, the arms alternating. Prints JSON::

    python benchmarks/long_keys.py [--mib 1] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from aiokvtier._pool._mirror import KIND_BYTES, hash_words, key_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=1.0, help="the key's length in MiB")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    n = int(args.mib * (1 << 20))
    key = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tobytes()
    padded = np.zeros((1, -(-n // 8) * 8), dtype=np.uint8)
    padded[0, :n] = np.frombuffer(key, dtype=np.uint8)
    lengths = np.array([n], dtype=np.int64)
    digest, words = [], []
    for _ in range(args.rounds):
        started = time.perf_counter()
        key_rows([key])
        digest.append(time.perf_counter() - started)
        started = time.perf_counter()
        hash_words(padded, KIND_BYTES, lengths)
        words.append(time.perf_counter() - started)
    d, w = statistics.median(digest), statistics.median(words)
    print(json.dumps({"key_bytes": n, "digest_ms": round(d * 1e3, 3), "word_by_word_ms": round(w * 1e3, 3),
                      "ratio": round(w / d, 1), "rounds": args.rounds}))  # fmt: skip


if __name__ == "__main__":
    main()
