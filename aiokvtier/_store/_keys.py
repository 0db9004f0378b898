"""Keys: what a caller may name a block with, made ``bytes`` or ``int`` once at the edge.

A key is ``bytes`` or an ``int``; bytes-like objects become ``bytes`` and
numpy integers ``int``; ``bool``, ``str`` and ``float`` are refused. ``1``
and ``b"\\x01"`` are different keys. The common call (a list of ``bytes`` or
of ``int``) is checked in one pass in C and not copied where the call does
not keep it across an await.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["Key", "NotCanonical", "canonical", "key_array", "key_list", "key_of", "key_seq", "keys_of"]

Key = bytes | int


def key_of(key: object) -> Key:
    """``bytes`` or ``int``: bytes-like objects become bytes, numpy integers ints; bools are refused."""
    kind = type(key)
    if kind is bytes or kind is int:
        return key  # type: ignore[return-value]
    if kind is bool or isinstance(key, bool | np.bool_):
        raise TypeError(f"a key is bytes or an int, not a bool ({key!r})")
    if isinstance(key, bytes | bytearray | memoryview):
        return bytes(key)
    if isinstance(key, str | float):
        raise TypeError(f"a key is bytes or an int, not {kind.__name__} ({key!r})")
    try:
        return operator.index(key)  # type: ignore[arg-type]
    except TypeError:
        pass
    try:
        return bytes(memoryview(key))  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"a key is bytes or an int, not {kind.__name__}") from None


def keys_of(keys: Iterable[object]) -> list[Key]:
    """The caller's keys as a new list of bytes and ints (converted where they are bytes-like or integers)."""
    given = key_list(keys)
    if canonical(given):
        return given  # type: ignore[return-value]
    return [key_of(k) for k in given]


def key_seq(keys: Iterable[object]) -> Sequence[Key]:
    """The caller's list or tuple itself when every key is a bytes or an int: for a call that does not keep
    its keys across an await (lookup, load, discard); else as ``keys_of()``."""
    if type(keys) is list or type(keys) is tuple:
        if canonical(keys):
            return keys
        return [key_of(k) for k in keys]
    return keys_of(keys)


_ONE_KEY = (bytes, bytearray, memoryview, str, int)  # a tuple: isinstance of a union type is slower


def key_list(keys: Iterable[object]) -> list[object]:
    if isinstance(keys, _ONE_KEY):
        raise TypeError(f"keys must be a sequence of keys, not one {type(keys).__name__}")
    return list(keys)  # a copy: the call keeps it across awaits, whatever the caller does to theirs


def canonical(keys: Sequence[object]) -> bool:
    """Every key is a bytes or an int already (one pass in C)."""
    if keys and type(keys[0]) in (bytes, int) and operator.countOf(map(type, keys), type(keys[0])) == len(keys):
        return True  # one kind of key, the usual case: a fifth cheaper than the set of types
    return set(map(type, keys)) <= {bytes, int}


def key_array(keys: Sequence[Key]) -> npt.NDArray[np.object_]:
    """Keys as a 1-D object array (numpy would make fixed-width bytes of a list of bytes)."""
    out = np.empty(len(keys), dtype=object)
    out[:] = keys
    return out


class NotCanonical(Exception):
    """A store found a key that is not a bytes or an int only after it had started: convert and start again."""
