"""The store's keys (``bytes | int``) as Mooncake's ``str`` keys: deterministic across machines.

``<prefix>/<fingerprint digest>/i<decimal>`` for an int of up to 640 digits,
``.../x<hex>`` for a longer one (``x-<hex>`` below zero), ``.../b<hex>`` for
bytes, so ``1`` and ``b"\\x01"`` never meet, each key has one name, and
every process that uses the same prefix and fingerprint names a block the
same way. The fingerprint is hashed: any string (a model name with spaces, a
path) makes a safe key.

Why 640 digits: Python refuses to write an int of more digits than
``sys.get_int_max_str_digits()`` in decimal (4300 by default; the work is
quadratic in the digits), and 640 is the least a process may set it to; hex
is linear and has no limit. A bound of the process's own would name one key
two ways in two processes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["KeySpace"]

_DECIMAL = 10**640
"""Ints of fewer digits (640 at most) are named in decimal; ``sys.int_info.str_digits_check_threshold``."""


class KeySpace:
    """Names blocks for one prefix and fingerprint. Pure: any thread."""

    def __init__(self, prefix: str, fingerprint: str) -> None:
        digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:24]
        self.namespace = f"{prefix}/{digest}/"

    def name(self, key: bytes | int) -> str:
        """Any bytes and any int has a name (a long key makes a long name: Mooncake 0.3.13 took names of 2 MiB).

        :raises TypeError: ``key`` is neither bytes nor int (bool is refused: ``True`` is not a block).
        """
        if isinstance(key, bytes):
            return f"{self.namespace}b{key.hex()}"
        if isinstance(key, int) and not isinstance(key, bool):
            if -_DECIMAL < key < _DECIMAL:
                return f"{self.namespace}i{key}"
            return f"{self.namespace}x{key:x}"
        raise TypeError(f"a block key is bytes or int, not {type(key).__name__}")

    def names(self, keys: Iterable[bytes | int]) -> list[str]:
        """:raises TypeError: a key is neither bytes nor int, or ``keys`` is one key (its bytes are not keys)."""
        if isinstance(keys, bytes | bytearray | memoryview | str):
            raise TypeError(f"keys must be a sequence of keys, not one {type(keys).__name__}")
        return [self.name(key) for key in keys]
