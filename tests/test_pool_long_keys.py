"""Long keys in the shared pool's mirror: hashed by a digest past ``LONG_BYTES``, never word by word.

A key's mirror entry was a hash over each of its 8-byte words, a round of numpy calls per word of the
batch's longest key: a key of 1 MiB held the owner's loop (at commit) and a reader (at each lookup) for
half a second. Keys past ``LONG_BYTES`` are now hashed as their first ``KEY_BYTES`` and a digest of the
whole key, and their entries keep their real length.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest

from aiokvtier import AttachedPool, Pool
from aiokvtier._pool._mirror import DIGEST_BYTES, KEY_BYTES, LONG_BYTES, USABLE, hash_words, key_rows

CONFIG = {"quota": "16MiB", "max_quota": "16MiB", "slot_size": "4KiB"}


@pytest.fixture
def sock() -> Iterator[str]:
    """A socket path short enough for sun_path, in a directory of its own."""
    directory = tempfile.mkdtemp(prefix="akl", dir="/tmp")
    yield os.path.join(directory, "pool.sock")
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))
    os.rmdir(directory)


def long_keys() -> list[bytes]:
    rng = np.random.default_rng(7)
    body = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    return [
        body[:LONG_BYTES],  # the longest hashed word by word
        body[: LONG_BYTES + 1],  # the shortest digested
        body,  # 1 MiB
        body[:-1] + bytes([body[-1] ^ 1]),  # the same but its last byte
        body + b"\x00",  # the same and a zero byte more
        b"\x00" * 5000,
        b"\x00" * 5001,
    ]


def test_a_long_keys_entry_is_its_own_whatever_its_batch_and_near_keys_differ() -> None:
    keys = long_keys()
    batch: list[bytes | int] = [b"short", *keys, 7, b"s" * 40]
    rows = key_rows(batch)
    for i, k in enumerate(batch):
        assert (key_rows([k])[0] == rows[i]).all(), len(k) if isinstance(k, bytes) else k
    entries = {tuple(r[:7].tolist()) for r in rows}
    assert len(entries) == len(batch)  # every key its own entry
    hashes = {tuple(r[:2].tolist()) for r in rows}
    assert len(hashes) == len(batch)  # and its own hashes: keys that differ in their last byte included
    assert int(rows[3, 2]) & 0xFFFFFFFF == 1 << 20  # the entry keeps the key's real length


def test_the_hash_never_goes_word_by_word_over_a_long_key() -> None:
    widths: list[int] = []

    def recording(data: np.ndarray, kind: int, lengths: np.ndarray) -> np.ndarray:
        widths.append(int(data.shape[1]))
        return hash_words(data, kind, lengths)

    keys = long_keys()
    assert (key_rows(keys, recording) == key_rows(keys)).all()
    assert widths and max(widths) <= max(LONG_BYTES, KEY_BYTES + DIGEST_BYTES)


def test_a_key_matrix_of_long_rows_answers_as_its_keys_one_by_one() -> None:
    keys = [bytes([i + 1]) * 3000 for i in range(5)]
    matrix = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(5, 3000)
    assert (key_rows(matrix) == key_rows(keys)).all()


@pytest.mark.skipif(not USABLE, reason="the mirror is read only on x86-64")
async def test_long_keys_are_found_and_loaded_across_processes_by_the_mirror_and_the_owner(sock: str) -> None:
    keys = long_keys()
    pages = np.random.default_rng(8).integers(0, 256, (len(keys), 4096), dtype=np.uint8)
    async with Pool(CONFIG, sock), AttachedPool(sock) as a, AttachedPool(sock) as b:
        assert not (await a.store(keys, pages)).skipped
        assert b.lookup_nowait(keys) == len(keys)  # the mirror, on this thread
        assert await b.lookup(keys) == len(keys)
        assert b.lookup_nowait([*keys[:2], keys[2][:-1]]) == 2  # a prefix of a stored key is another key
        back = np.zeros_like(pages)
        await b.load(keys, back)
        assert (back == pages).all()
        assert await b.discard(keys[2:3]) == 1
        assert b.lookup_nowait(keys) == 2
