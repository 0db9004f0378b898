"""The store's keys (``bytes | int``) as Mooncake's ``str`` keys: deterministic across machines.

``<prefix>/<fingerprint digest>/i<decimal>`` for an int, ``.../b<hex>`` for
bytes, so ``1`` and ``b"\\x01"`` never meet, and every process that uses the
same prefix and fingerprint names a block the same way. The fingerprint is
hashed: any string (a model name with spaces, a path) makes a safe key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["KeySpace"]


class KeySpace:
    """Names blocks for one prefix and fingerprint. Pure: any thread."""

    def __init__(self, prefix: str, fingerprint: str) -> None:
        digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:24]
        self.namespace = f"{prefix}/{digest}/"

    def name(self, key: bytes | int) -> str:
        """:raises TypeError: ``key`` is neither bytes nor int (bool is refused: ``True`` is not a block)."""
        if isinstance(key, bytes):
            return f"{self.namespace}b{key.hex()}"
        if isinstance(key, int) and not isinstance(key, bool):
            return f"{self.namespace}i{key}"
        raise TypeError(f"a block key is bytes or int, not {type(key).__name__}")

    def names(self, keys: Iterable[bytes | int]) -> list[str]:
        """:raises TypeError: a key is neither bytes nor int, or ``keys`` is one key (its bytes are not keys)."""
        if isinstance(keys, bytes | bytearray | memoryview | str):
            raise TypeError(f"keys must be a sequence of keys, not one {type(keys).__name__}")
        return [self.name(key) for key in keys]
