"""The pool's wire format and block index on their own (no socket, no loop)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiokvtier import BlockNotFound, FillError, OutOfSlots, PoolError, SlotError
from aiokvtier._pool import _wire
from aiokvtier._pool._index import BlockIndex

keys_st = st.lists(st.one_of(st.binary(max_size=40), st.integers(-(2**80), 2**80)), max_size=50)


@given(keys_st)
def test_keys_round_trip_in_every_form(keys: list[bytes | int]) -> None:
    kind, parts = _wire.encode_keys(keys)
    assert _wire.decode_keys(kind, parts) == keys
    frame = _wire.encode(_wire.LOOKUP, 7, {"k": kind}, parts)
    message = _wire.decode(frame[4:])
    assert (message.op, message.rid, message.fields["k"]) == (_wire.LOOKUP, 7, kind)
    assert _wire.decode_keys(kind, message.parts) == keys


def test_the_forms_chosen() -> None:
    assert _wire.encode_keys([b"ab", b"cd"])[0] == "f"
    assert _wire.encode_keys([b"ab", b"c"])[0] == "b"
    assert _wire.encode_keys([b"", b""])[0] == "b"
    assert _wire.encode_keys([1, -5])[0] == "i"
    assert _wire.encode_keys([1, b"\x01"])[0] == "m"
    assert _wire.encode_keys([2**64])[0] == "m"
    several = [b"%d-" % i for i in range(100)]  # 2 to 3 bytes, none ending in a zero byte: padded
    assert _wire.encode_keys(several)[0] == "p"
    assert _wire.encode_keys([b"%02d" % i for i in range(100)])[0] == "f"  # one length
    assert _wire.encode_keys([*several, b"x\x00"])[0] == "b"  # one ends in a zero byte
    assert _wire.encode_keys([*several, b"x" * 33])[0] == "b"  # one longer than the padding
    assert _wire.encode_keys([*several, b""])[0] == "b"  # an empty key
    assert _wire.encode_keys(several[5:15])[0] == "b"  # a small batch: not tried


@given(st.lists(st.binary(min_size=1, max_size=40), min_size=64, max_size=200, unique=True))
def test_padded_keys_decode_to_the_keys_and_their_matrix(keys: list[bytes]) -> None:
    """Whatever form a batch takes, its matrix (where the decoding made one) holds each key zero-padded
    and its length: what the owner hands the index mirror."""
    kind, parts = _wire.encode_keys(keys)
    decoded, matrix = _wire.decode_key_matrix(kind, parts)
    assert decoded == keys and all(type(k) is bytes for k in decoded)
    if kind == "p":
        assert not any(k.endswith(b"\x00") for k in keys) and max(map(len, keys)) <= _wire.PADDED_WIDTH
    if matrix is not None:
        rows, lengths = matrix
        assert lengths.tolist() == [len(k) for k in keys]
        assert [bytes(row[:n]) for row, n in zip(rows, lengths.tolist(), strict=True)] == keys
        assert not any(row[n:].any() for row, n in zip(rows, lengths.tolist(), strict=True))


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00",  # an empty json text
        _wire.HEAD.pack(1, 0, 2) + b"[]",
        _wire.HEAD.pack(1, 0, 10) + b'{"p": [5]}',
        _wire.HEAD.pack(1, 0, 11) + b'{"p": [-1]}',
        _wire.HEAD.pack(1, 0, 200000) + b"[" * 100000 + b"]" * 100000,
    ],
)
def test_malformed_frames_are_value_errors(payload: bytes) -> None:
    with pytest.raises(ValueError):
        _wire.decode(payload)


def test_malformed_keys_are_value_errors() -> None:
    for kind, parts in (
        ("f", [b"\x03\x00\x00\x00", b"abcd"]),
        ("f", [b"\x00\x00\x00\x00", b""]),
        ("p", [b"\x03\x00\x00\x00", b"abcd"]),
        ("p", [b"\x00\x00\x00\x00", b""]),
        ("p", [b"\x03\x00\x00\x00"]),
        ("b", [b"\x05\x00\x00\x00", b"abc"]),
        ("i", [b"1234567"]),
        ("m", [b"\x02\x00\x00\x00", b"zz"]),
        ("?", []),
    ):
        with pytest.raises(ValueError):
            _wire.decode_keys(kind, parts)


def test_errors_travel_by_name_with_their_fields() -> None:
    for error in (SlotError("x"), OutOfSlots("y"), ValueError("z"), TypeError("t"), BlockNotFound(b"\x00k")):
        fields, parts = _wire.error_to(error)
        back = _wire.error_from(_wire.Message(_wire.ERROR, 1, fields, parts))
        assert type(back) is type(error) and str(back) == str(error)
    fields, parts = _wire.error_to(FillError("f", resident_bytes=5, failed_offset=6))
    back = _wire.error_from(_wire.Message(_wire.ERROR, 1, fields, parts))
    assert isinstance(back, FillError) and (back.resident_bytes, back.failed_offset) == (5, 6)
    fields, parts = _wire.error_to(RuntimeError("a bug"))
    assert type(_wire.error_from(_wire.Message(_wire.ERROR, 1, fields, parts))) is PoolError


@given(
    st.lists(st.binary(min_size=1, max_size=24), min_size=64, max_size=300, unique=True),
    st.sampled_from([b"", b"\x00", b"\x00\x00", b"x\x00y"]),
)
def test_many_keys_of_several_lengths_round_trip_whole(keys: list[bytes], tail: bytes) -> None:
    """Cut out as numpy records where that is exact: zero bytes inside or at the end of a key kept."""
    keys = [k + tail for k in keys]
    if len(set(map(len, keys))) == 1:
        keys.append(keys[0] + b"z")  # several lengths: the "b" form
    kind, parts = _wire.encode_keys(keys)
    padded = not any(k.endswith(b"\x00") for k in keys) and max(map(len, keys)) <= _wire.PADDED_WIDTH
    assert kind == ("p" if padded else "b")
    decoded = _wire.decode_keys(kind, parts)
    assert decoded == keys and all(type(k) is bytes for k in decoded)


@pytest.mark.parametrize("form", [b"%d-%d-", b"\x00%d\x00%d-", b"%d-%d\x00"])
def test_a_batch_of_keys_a_few_lengths_apart_round_trips_whole(form: bytes) -> None:
    keys = [form % (4242, i) for i in range(3000)]  # 7 to 11 bytes: padded, or cut out as records, unless one ends in 0
    kind, parts = _wire.encode_keys(keys)
    assert kind == ("b" if form.endswith(b"\x00") else "p") and _wire.decode_keys(kind, parts) == keys
    if kind == "b":  # a key ending in a zero byte: cut out one by one, no matrix
        assert _wire.decode_key_matrix(kind, parts)[1] is None


def test_as_key() -> None:
    import numpy as np

    assert _wire.as_key(bytearray(b"a")) == b"a" and _wire.as_key(np.int64(3)) == 3
    for bad in (True, np.bool_(False), "s", 1.5, None):
        with pytest.raises(TypeError):
            _wire.as_key(bad)


def test_the_index_claims_commits_pins_evicts_and_discards() -> None:
    index = BlockIndex()
    assert index.classify([b"a", b"b"]).tolist() == [_wire.CLAIMED, _wire.CLAIMED]
    claim = index.claim([b"a", b"b"], np.array([10, 20]))
    assert index.classify([b"a", b"c"]).tolist() == [_wire.BUSY, _wire.CLAIMED]
    index.place(claim, np.array([0, 1]))
    assert index.commit(claim) == [b"a", b"b"]
    assert index.lookup([b"a", b"b", b"x"]) == 2
    pin, slots, lengths = index.pin([b"a"])
    assert (slots.tolist(), lengths.tolist()) == ([0], [10])
    assert index.evict(2, keep=set()) == ([b"b"], [1])  # a is pinned
    dropped, freed = index.discard([b"a", b"zz"])
    assert (dropped, freed.tolist()) == ([b"a"], [])  # freed at its unpin
    assert index.unpin(pin, loaded=True) == [0]
    assert index.counts["loads"] == 1 and index.bytes_loaded == 10
    with pytest.raises(BlockNotFound):
        index.pin([b"a"])
    with pytest.raises(ValueError, match="twice"):
        index.classify([b"q", b"q"])
    claim = index.claim([b"c"], np.array([5]))
    index.place(claim, np.array([7]))
    assert index.abort(claim) == [7] and index.abort(claim) == []
    outcomes = np.array([_wire.CLAIMED, _wire.PRESENT, _wire.CLAIMED, _wire.BUSY, _wire.PRESENT], dtype=np.uint8)
    assert BlockIndex.cut(outcomes, 1).tolist() == [
        _wire.CLAIMED,
        _wire.PRESENT,
        _wire.SKIPPED,
        _wire.SKIPPED,
        _wire.PRESENT,
    ]
