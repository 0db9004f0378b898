"""The pool's wire protocol: frames, keys and errors, encoded and decoded without an event loop.

A frame is ``<u32 length><u8 op><u32 request id><u32 json length><json><parts>``:
the json object holds the small fields (and ``"p"``, the byte length of each
binary part), the parts hold arrays (slot ids, lengths, keys) as raw bytes,
so a request of thousands of keys costs a few joins, not a Python step per
field. Request ids pair replies with requests (a connection carries many
requests at once); pushes from the owner carry id 0.

Nothing here unpickles or evaluates what a peer sent: a frame is json and
byte arrays, checked as they are read.

::

    client                                  owner
    HELLO {v, pid}            ───────────>
                              <───────────  WELCOME {pool, layout, index, config} + the tier's memfd
                                            and the index mirror's (SCM_RIGHTS)
                              <───────────  STATE {resident, quota, ...}    (pushed at every change)
    ALLOC {n, wait}           ───────────>  REPLY [slot ids]    (waits only for the fill)
    FREE [slot ids]           ───────────>  REPLY
    LOOKUP keys               ───────────>  REPLY {hits}     (when the index mirror cannot answer)
    CONTAINS keys             ───────────>  REPLY [a byte a key, 1: stored]   (the same; touches and counts
                                            nothing)
    LOOKED {q, h, m, r}       ───────────>  (no reply: lookups answered from the mirror, for the counts;
                                            any request may carry them instead, as "looked": {q, h, m, r})
    BEGIN keys [lengths]      ───────────>  REPLY {claim} [outcomes] [slots]
    COMMIT {claim}            ───────────>  REPLY            (the blocks are visible to all)
    ABORT {claim}             ───────────>  (no reply)
    AWAIT keys                ───────────>  REPLY once no other process is storing them
    LOAD keys                 ───────────>  REPLY {pin} [slots] [lengths]   (pinned until UNPIN)
    UNPIN {pin}               ───────────>  (no reply)
    DISCARD keys              ───────────>  REPLY {dropped}
    STATS                     ───────────>  REPLY {tier, pool}
    SUBSCRIBE                 ───────────>  REPLY, then EVENT {kind} keys at every stored, evicted, discarded
                                            (with {dropped}: events not sent before it, the process not reading)
                              <───────────  ERROR {type, message}  (in place of a REPLY)
                              <───────────  BYE {reason}          (the owner is closing)
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import numpy.typing as npt
from numpy import char as np_char

from .. import (
    _errors,
    _numpy,  # noqa: F401  (numpy's lazy submodules imported now, not on a loop)
)

__all__ = [
    "Key",
    "Message",
    "as_key",
    "decode",
    "decode_keys",
    "encode",
    "encode_keys",
    "error_from",
    "error_to",
]

VERSION = 7
"""3: the index mirror holds a spare copy of its table (a reader never waits for a write). 4: byte keys of
several lengths may come zero-padded (the ``"p"`` form); any request may carry the mirror's lookup counts. 5: a
key longer than 256 bytes is hashed in the mirror by a digest of it; an event carries how many were dropped. 6:
the mirror's hash is seeded from its header and mixes each word twice. 7: ``CONTAINS`` (per key presence, for
``contains`` where the mirror cannot answer)."""

HELLO, WELCOME, STATE, ALLOC, FREE, LOOKUP, BEGIN, COMMIT, ABORT, AWAIT, LOAD, UNPIN, DISCARD, STATS = range(1, 15)
SUBSCRIBE, LOOKED, CONTAINS = 15, 16, 17
REPLY, ERROR, BYE, EVENT = 100, 101, 102, 103

# A block's outcome in a BEGIN reply.
PRESENT, CLAIMED, BUSY, SKIPPED = 0, 1, 2, 3

LENGTH = struct.Struct("<I")
HEAD = struct.Struct("<BII")
MAX_FRAME = 1 << 30
"""Frames past this are refused (a peer speaking another protocol, or a corrupt stream)."""

Key = bytes | int
KeyMatrix = tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]
"""Byte keys as the rows of a uint8 matrix, zero-padded to the longest, and each key's length: the form a
frame's keys arrive in, which the owner hands on to the index mirror rather than have it rebuilt."""


@dataclass(slots=True)
class Message:
    op: int
    rid: int
    fields: dict[str, Any] = field(default_factory=dict)
    parts: list[bytes] = field(default_factory=list)

    def ints(self, index: int) -> npt.NDArray[np.int64]:
        return np.frombuffer(self.parts[index], dtype=np.int64)

    def uints(self, index: int) -> npt.NDArray[np.uint64]:
        return np.frombuffer(self.parts[index], dtype=np.uint64)


def encode(
    op: int, rid: int, fields: dict[str, Any] | None = None, parts: Sequence[bytes] = (), *, request: bool = False
) -> bytes:
    """One frame, length prefix included.

    :param request: a request to the owner, which drops a process that sends a frame past ``MAX_FRAME``.
    :raises ValueError: ``request`` and the frame would be larger than that (checked before it is built).
    """
    head = dict(fields or {})
    head["p"] = [len(p) for p in parts]
    text = json.dumps(head, separators=(",", ":")).encode()
    body = [HEAD.pack(op, rid, len(text)), text, *parts]
    size = sum(map(len, body))
    if request and size > MAX_FRAME:
        raise ValueError(
            f"a request of {size} bytes does not fit the pool protocol's frames of at most {MAX_FRAME} bytes "
            "(its keys take the room: split the call, or shorten the keys)"
        )
    return b"".join([LENGTH.pack(size), *body])


def decode(payload: bytes) -> Message:
    """A frame without its length prefix.

    :raises ValueError: the frame is malformed.
    """
    if len(payload) < HEAD.size:
        raise ValueError("a frame shorter than its header")
    op, rid, n = HEAD.unpack_from(payload)
    end = HEAD.size + n
    try:
        head = json.loads(payload[HEAD.size : end])
    except RecursionError:  # nested past the interpreter's depth: not a frame of ours either
        raise ValueError("a frame's fields are nested too deeply") from None
    if not isinstance(head, dict):
        raise ValueError("a frame's fields are not an object")
    lengths = head.pop("p", [])
    if not isinstance(lengths, list) or not all(type(x) is int and x >= 0 for x in lengths):
        raise ValueError("a frame's part lengths are malformed")
    if end + sum(lengths) != len(payload):
        raise ValueError("a frame's parts do not add up to its length")
    parts = []
    for length in lengths:
        parts.append(payload[end : end + length])
        end += length
    return Message(op, rid, head, parts)


def as_key(key: object) -> Key:
    """``bytes`` or ``int``, as ``BlockStore`` takes keys: bytes-like objects become bytes, numpy integers
    ints; bools, strs and floats are refused.

    :raises TypeError: not a key.
    """
    kind = type(key)
    if kind is bytes or kind is int:
        return key  # type: ignore[return-value]
    if isinstance(key, bool | np.bool_):
        raise TypeError(f"a key is bytes or an int, not a bool ({key!r})")
    if isinstance(key, bytes | bytearray | memoryview):
        return bytes(key)
    if isinstance(key, np.integer):
        return int(key)
    raise TypeError(f"a key is bytes or an int, not {kind.__name__} ({key!r})")


_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


def decimal(key: int) -> bytes:
    """An int key past 64 bits as the decimal text a pool carries it as.

    :raises ValueError: the int has more digits than Python converts to text
        (``sys.get_int_max_str_digits()``): no pool can hold that key.
    """
    try:
        return b"%d" % key
    except ValueError:
        raise ValueError(
            f"an int key of {key.bit_length()} bits has more digits than Python converts to text "
            f"(sys.get_int_max_str_digits()): a pool carries such keys as decimal text and cannot hold it"
        ) from None


def encode_keys(keys: Sequence[Key], types: set[type] | None = None) -> tuple[str, list[bytes]]:
    """``(kind, parts)``: ``"f"`` bytes of one length (that length, then the bytes joined: block hashes,
    the usual keys), ``"p"`` bytes of several lengths, none ending in a zero byte (the longest's length,
    then each zero-padded to it), ``"b"`` other bytes (their lengths, then the bytes joined), ``"i"`` all
    int64 ints, ``"m"`` anything else (each key tagged, as bytes)."""
    if types is None:
        types = set(map(type, keys))
    if types == {bytes} and len(keys) >= PADDED_FROM and len(keys[0]) <= PADDED_WIDTH:  # type: ignore[arg-type]
        padded = _padded(keys)  # type: ignore[arg-type]
        if padded is not None:
            return padded
    if types == {bytes}:
        # One pass for the lengths (an array: its min and max say whether they are all one length).
        lengths = np.fromiter(map(len, keys), dtype=np.uint32, count=len(keys))  # type: ignore[arg-type]
        size = int(lengths[0]) if len(keys) else 0
        if size and int(lengths.min()) == int(lengths.max()):
            return "f", [LENGTH.pack(size), b"".join(keys)]  # type: ignore[arg-type]
        return "b", [lengths.tobytes(), b"".join(keys)]  # type: ignore[arg-type]
    if all(type(k) is int and _I64_MIN <= k <= _I64_MAX for k in keys):
        return "i", [np.array(keys, dtype=np.int64).tobytes()]
    tagged = [b"b" + k if isinstance(k, bytes) else b"i" + decimal(k) for k in keys]
    lengths = np.fromiter(map(len, tagged), dtype=np.uint32, count=len(tagged))
    return "m", [lengths.tobytes(), b"".join(tagged)]


PADDED_FROM = 64
"""Byte keys are tried in the ``"p"`` (or ``"f"``) form from this many on (below, numpy's fixed costs exceed
the lengths' pass)."""
PADDED_WIDTH = 32
"""The longest key the ``"p"`` form is tried for (a batch's first key longer: not tried in vain)."""


def _padded(keys: Sequence[bytes]) -> tuple[str, list[bytes]] | None:
    """Keys of up to ``PADDED_WIDTH`` bytes none of which ends in a zero byte as ``"p"`` (``"f"`` if of one
    length), packed by numpy in C; None otherwise. Their lengths are read off the packed rows, which add up
    to the keys' only when no key was cut short and none ended in a zero byte (numpy's count stops at
    those). The owner cuts them out of the frame as records rather than by each one's length: 4,096 keys
    cost it ~0.25 ms less, a store's begin and a discard each."""
    data = np.array(keys, dtype=f"S{PADDED_WIDTH}")
    lengths = np_char.str_len(data)
    joined = b"".join(keys)
    if int(lengths.sum()) != len(joined):
        return None
    width, least = int(lengths.max()), int(lengths.min())
    if not least:
        return None
    if least == width:
        return "f", [LENGTH.pack(width), joined]
    rows = data.view(np.uint8).reshape(len(keys), PADDED_WIDTH)[:, :width]
    return "p", [LENGTH.pack(width), rows.tobytes()]


def decode_keys(kind: object, parts: list[bytes]) -> list[Key]:
    """The keys ``encode_keys`` encoded.

    :raises ValueError: malformed.
    """
    return decode_key_matrix(kind, parts)[0]


def decode_key_matrix(kind: object, parts: list[bytes]) -> tuple[list[Key], KeyMatrix | None]:
    """The keys ``encode_keys`` encoded, and byte keys also as a ``KeyMatrix`` where the decoding made one
    (keys of one length, and most batches of several; None otherwise).

    :raises ValueError: malformed.
    """
    if kind == "i":
        if len(parts) != 1 or len(parts[0]) % 8:
            raise ValueError("malformed int keys")
        # numpy >= 2.5 (Python >= 3.12) types this list[int], older numpy Any; list[Key] is invariant
        return cast("list[Key]", np.frombuffer(parts[0], dtype=np.int64).tolist()), None
    if kind == "f":
        if len(parts) != 2 or len(parts[0]) != LENGTH.size:
            raise ValueError("malformed fixed-length keys")
        (size,) = LENGTH.unpack(parts[0])
        blob = parts[1]
        if size > MAX_FRAME:  # no frame holds such a key (and numpy has no record that wide)
            raise ValueError(f"malformed fixed-length keys: keys of {size} bytes")
        if size == 0 or len(blob) % size:
            raise ValueError("malformed fixed-length keys: the bytes are not a whole number of keys")
        # numpy's raw fixed-size records come out as bytes, whole (zero bytes kept): 4x faster than slicing.
        fixed: list[Key] = np.frombuffer(blob, dtype=f"V{size}").tolist()
        n = len(fixed)
        return fixed, (np.frombuffer(blob, dtype=np.uint8).reshape(n, size), np.full(n, size, dtype=np.int64))
    if kind == "p":
        if len(parts) != 2 or len(parts[0]) != LENGTH.size:
            raise ValueError("malformed padded keys")
        (width,) = LENGTH.unpack(parts[0])
        blob = parts[1]
        if width > MAX_FRAME:
            raise ValueError(f"malformed padded keys: rows of {width} bytes")
        if width == 0 or len(blob) % width:
            raise ValueError("malformed padded keys: the bytes are not a whole number of keys")
        # Each record comes out as bytes without its zero padding: the key (none ends in a zero byte).
        strings = np.frombuffer(blob, dtype=f"S{width}")
        padded: list[Key] = strings.tolist()
        matrix = np.frombuffer(blob, dtype=np.uint8).reshape(len(padded), width)
        return padded, (matrix, np_char.str_len(strings).astype(np.int64))
    if kind not in ("b", "m") or len(parts) != 2 or len(parts[0]) % 4:
        raise ValueError("malformed keys")
    lengths = np.frombuffer(parts[0], dtype=np.uint32).astype(np.int64)
    ends = np.cumsum(lengths)
    blob = parts[1]
    if (int(ends[-1]) if ends.size else 0) != len(blob):
        raise ValueError("malformed keys: the lengths do not add up")
    if kind == "b":
        records = _as_records(blob, lengths, ends)
        if records is not None:
            return records[0], (records[1], lengths)
    starts = (ends - lengths).tolist()
    pieces = [blob[a:b] for a, b in zip(starts, ends.tolist(), strict=True)]
    if kind == "b":
        return pieces, None  # type: ignore[return-value]
    keys: list[Key] = []
    for piece in pieces:
        if piece[:1] == b"b":
            keys.append(piece[1:])
        elif piece[:1] == b"i":
            keys.append(int(piece[1:]))
        else:
            raise ValueError("malformed keys: an unknown tag")
    return keys, None


RECORDS_FROM = 64
"""Byte keys of several lengths are cut out of a frame as numpy records from this many keys on (below, numpy's
fixed costs exceed the slicing)."""
RECORDS_SPREAD = 16
"""The most lengths apart the shortest and the longest key may be for the records (a column copy per byte
between them)."""


def _as_records(
    blob: bytes, lengths: npt.NDArray[np.int64], ends: npt.NDArray[np.int64]
) -> tuple[list[Key], npt.NDArray[np.uint8]] | None:
    """Keys of several lengths as numpy's zero-padded records, which come out as bytes without their trailing
    zero bytes: exact where no key ends in a zero byte (4,096 keys: a third cheaper than slicing each). None
    where that does not hold, or the batch is small or its lengths far apart; else the keys, and the
    records as a matrix."""
    n = len(lengths)
    if n < RECORDS_FROM:
        return None
    least, most = int(lengths.min()), int(lengths.max())
    if not least or most - least > RECORDS_SPREAD:
        return None
    flat = np.frombuffer(blob, dtype=np.uint8)
    if not flat[ends - 1].all():  # a key ending in a zero byte would lose it
        return None
    starts = ends - lengths
    padded = np.zeros((n, most), dtype=np.uint8)
    padded[:, :least] = flat[starts[:, None] + np.arange(least)]
    for column in range(least, most):
        longer = np.flatnonzero(lengths > column)
        padded[longer, column] = flat[starts[longer] + column]
    keys: list[Key] = padded.view(f"S{most}").ravel().tolist()
    return keys, padded


# Errors an owner may send, by name; anything else arrives as a PoolError with its text.
_ERRORS: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    **{name: getattr(_errors, name) for name in _errors.__all__},
}


def error_to(exc: BaseException) -> tuple[dict[str, Any], list[bytes]]:
    """An ERROR frame's fields and parts for ``exc``."""
    name = type(exc).__name__
    if isinstance(exc, _errors.BlockNotFound):
        # The key as a part, once: its message (the key's repr) is made again from it at the other end.
        kind, parts = encode_keys([exc.key])
        return {"type": "BlockNotFound", "k": kind}, parts
    if isinstance(exc, _errors.FillError):
        fields = {"type": "FillError", "message": str(exc), "resident": exc.resident_bytes}
        return fields | {"failed": exc.failed_offset}, []
    if name not in _ERRORS or name in ("DecommitError", "CudaError"):  # their extra fields do not travel
        name = "PoolError"
    return {"type": name, "message": str(exc)}, []


def error_from(message: Message) -> Exception:
    """The exception an ERROR frame stands for."""
    name = message.fields.get("type")
    text = str(message.fields.get("message", ""))
    if name == "BlockNotFound":
        return _errors.BlockNotFound(decode_keys(message.fields.get("k"), message.parts)[0])
    if name == "FillError":
        resident, failed = message.fields.get("resident"), message.fields.get("failed")
        return _errors.FillError(text, resident_bytes=int(resident or 0), failed_offset=int(failed or 0))
    cls = _ERRORS.get(str(name), _errors.PoolError)
    if cls in (_errors.DecommitError, _errors.CudaError, _errors.FillError):
        cls = _errors.PoolError
    return cls(text)
