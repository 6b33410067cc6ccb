"""Hypothesis strategies that build *wire bytes* for any protobuf message from
its descriptor, so requests can be anything a client could put on the wire:
plausible values (so calls reach the server's rules, not just its decoder),
boundary and huge numbers, negative numbers, unknown enum numbers, strings
with any bytes (invalid UTF-8, control characters, long), nested garbage,
unknown and repeated fields, and truncated encodings.
"""

from __future__ import annotations

import struct
import uuid
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

INT64_EDGES = [0, 1, -1, 2, 99, 100, 101, 1000, 60_000, 86_400_000, 86_400_001,
               2**31 - 1, -(2**31), 2**31, 2**53 + 1, 2**63 - 1, -(2**63)]
UINT_EDGES = [0, 1, 2**32 - 1, 2**64 - 1]
VALID_TEXT = ["f0", "f1", "f2", "A", "B", "ok", "k/1", "é\U0001f600"]
EDGE_TEXT = ["", "x" * 129, "x" * 257, "x" * 513, "\u0000", "a\nb", " ", "\u202e"]

# -- wire encoding -------------------------------------------------------------------


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative numbers: 64-bit two's complement, as protobuf does
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def key(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def length_delimited(number: int, payload: bytes) -> bytes:
    return key(number, 2) + varint(len(payload)) + payload


# -- strategies ----------------------------------------------------------------------

_T = FieldDescriptor


def _int_values(signed: bool) -> st.SearchStrategy[int]:
    edges = INT64_EDGES if signed else [*UINT_EDGES, 1, 2, 100]
    lo, hi = (-(2**63), 2**63 - 1) if signed else (0, 2**64 - 1)
    small = st.integers(0, 5)
    return st.one_of(small, small, small, st.sampled_from(edges), st.integers(lo, hi))


def _text_bytes() -> st.SearchStrategy[bytes]:
    valid = st.sampled_from(VALID_TEXT).map(lambda s: s.encode())
    return st.one_of(
        valid, valid, valid, valid,
        st.sampled_from(EDGE_TEXT).map(lambda s: s.encode()),
        st.text(max_size=40).map(lambda s: s.encode("utf-8", "surrogatepass")),
        st.binary(max_size=40),  # any bytes: mostly invalid UTF-8
        st.integers(200, 5000).map(lambda n: b"y" * n),  # over the size limits
    )


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[bytes]:
    t, n = field.type, field.number
    if t in (_T.TYPE_INT64, _T.TYPE_INT32, _T.TYPE_SINT64, _T.TYPE_SINT32):
        if t in (_T.TYPE_SINT64, _T.TYPE_SINT32):
            return _int_values(True).map(lambda v: key(n, 0) + varint((v << 1) ^ (v >> 63)))
        return _int_values(True).map(lambda v: key(n, 0) + varint(v))
    if t in (_T.TYPE_UINT64, _T.TYPE_UINT32):
        return _int_values(False).map(lambda v: key(n, 0) + varint(v))
    if t == _T.TYPE_BOOL:
        return st.sampled_from([0, 1, 2, 2**63]).map(lambda v: key(n, 0) + varint(v))
    if t == _T.TYPE_ENUM:
        assert field.enum_type is not None
        known = [v.number for v in field.enum_type.values]
        valid = st.sampled_from(known)
        return st.one_of(valid, valid, valid, st.integers(-(2**31), 2**31 - 1)).map(
            lambda v: key(n, 0) + varint(v)
        )
    if t in (_T.TYPE_STRING, _T.TYPE_BYTES):
        return _text_bytes().map(lambda b: length_delimited(n, b))
    if t in (_T.TYPE_DOUBLE, _T.TYPE_FIXED64, _T.TYPE_SFIXED64):
        return st.binary(min_size=8, max_size=8).map(lambda b: key(n, 1) + b)
    if t in (_T.TYPE_FLOAT, _T.TYPE_FIXED32, _T.TYPE_SFIXED32):
        return st.binary(min_size=4, max_size=4).map(lambda b: key(n, 5) + b)
    return st.just(b"")


def _field(field: FieldDescriptor, depth: int) -> st.SearchStrategy[bytes]:
    if field.type == _T.TYPE_MESSAGE:
        assert field.message_type is not None
        sub = message(field.message_type, depth + 1)
        inner = st.one_of(sub, sub, sub, st.binary(max_size=30))  # or garbage in its place
        one = inner.map(lambda b: length_delimited(field.number, b))
    else:
        one = _scalar(field)
    repeated = bool(field.is_repeated)
    count = st.integers(0, 6) if repeated else st.sampled_from([0, 1, 1, 1, 1, 1, 2])
    if repeated and field.type != _T.TYPE_MESSAGE and field.type not in (
        _T.TYPE_STRING, _T.TYPE_BYTES
    ):
        # packed encoding as well
        packed = st.lists(_int_values(True), max_size=6).map(
            lambda vs: length_delimited(field.number, b"".join(varint(v) for v in vs))
        )
        return st.one_of(count.flatmap(lambda k: st.lists(one, min_size=k, max_size=k)).map(
            b"".join), packed)
    return count.flatmap(lambda k: st.lists(one, min_size=k, max_size=k)).map(b"".join)


_unknown_field = st.one_of(
    st.tuples(st.integers(20, 2**29 - 1), _int_values(True)).map(
        lambda t: key(t[0], 0) + varint(t[1])),
    st.tuples(st.integers(20, 2000), st.binary(max_size=20)).map(
        lambda t: length_delimited(t[0], t[1])),
    st.tuples(st.integers(20, 2000), st.binary(min_size=8, max_size=8)).map(
        lambda t: key(t[0], 1) + t[1]),
)


def message(desc: Descriptor, depth: int = 0) -> st.SearchStrategy[bytes]:
    """Well-formed-ish wire bytes for ``desc`` (recursion bounded by depth)."""
    if depth > 3:
        return st.just(b"")
    parts = [_field(f, depth) for f in desc.fields]
    body = st.tuples(*parts).map(b"".join) if parts else st.just(b"")
    extra = st.lists(_unknown_field, max_size=2).map(b"".join)
    return st.tuples(body, extra, st.booleans()).map(
        lambda t: t[0] + t[1] if t[2] else t[1] + t[0]
    )


def _clean_field(field: FieldDescriptor, depth: int) -> st.SearchStrategy[bytes]:
    t, n = field.type, field.number
    one: st.SearchStrategy[bytes]
    if t == _T.TYPE_MESSAGE:
        assert field.message_type is not None
        one = clean(field.message_type, depth + 1).map(lambda b: length_delimited(n, b))
    elif field.name == "request_id":  # fresh ids: a reused one is refused
        one = st.just(n).map(lambda n: length_delimited(n, uuid.uuid4().hex.encode()))
    elif t in (_T.TYPE_STRING, _T.TYPE_BYTES):
        one = st.sampled_from(VALID_TEXT).map(lambda v: length_delimited(n, v.encode()))
    elif t == _T.TYPE_ENUM:
        assert field.enum_type is not None
        known = [v.number for v in field.enum_type.values if v.number] or [0]
        one = st.sampled_from(known).map(lambda v: key(n, 0) + varint(v))
    elif t == _T.TYPE_BOOL:
        one = st.sampled_from([0, 1]).map(lambda v: key(n, 0) + varint(v))
    elif t in (_T.TYPE_DOUBLE, _T.TYPE_FIXED64, _T.TYPE_SFIXED64, _T.TYPE_FLOAT,
               _T.TYPE_FIXED32, _T.TYPE_SFIXED32):
        one = _scalar(field)
    else:
        ints = [1000, 60_000] if field.name.endswith("_ms") else [1, 1, 1, 2, 3]
        if field.name == "schema":
            ints = [1]
        one = st.sampled_from(ints).map(lambda v: key(n, 0) + varint(v))
    count = st.integers(0, 3) if field.is_repeated else st.just(1)
    return count.flatmap(lambda k: st.lists(one, min_size=k, max_size=k)).map(b"".join)


def clean(desc: Descriptor, depth: int = 0) -> st.SearchStrategy[bytes]:
    """Plausible, mostly valid wire bytes for ``desc``: calls that reach the rules."""
    if depth > 3 or not desc.fields:
        return st.just(b"")
    return st.tuples(*[_clean_field(f, depth) for f in desc.fields]).map(b"".join)


def _wild_one(desc: Descriptor) -> st.SearchStrategy[bytes]:
    """One wild occurrence of one field (appended, it overrides a singular one)."""
    return st.sampled_from(list(desc.fields)).flatmap(
        lambda f: _field(f, 2).filter(lambda b: b != b"") if not f.is_repeated else _field(f, 2)
    )


def request(desc: Descriptor) -> st.SearchStrategy[bytes]:
    """A request: plausible, plausible with one wild field, wild, truncated or
    raw garbage."""
    good = message(desc)
    plausible = clean(desc)
    mutated = (
        st.tuples(plausible, _wild_one(desc)).map(lambda t: t[0] + t[1])
        if desc.fields else plausible
    )
    truncated = good.flatmap(
        lambda b: st.integers(1, max(1, len(b))).map(lambda k: b[:-k]) if b else st.just(b"\x0a")
    )
    garbage = st.one_of(
        st.binary(max_size=64),
        st.just(b"\x0a\xff\xff\xff\xff\x0f"),  # a length far past the end
        st.just(b"\x80" * 11),  # a varint that never ends
        st.just(struct.pack("<B", 0x0F)),  # wire type 7 does not exist
    )
    return st.one_of(plausible, plausible, mutated, mutated, mutated, good, good, truncated,
                     garbage)


def field_names(desc: Descriptor) -> list[str]:
    return [f.name for f in desc.fields]


def describe(method: Any) -> str:
    return f"{method.containing_service.full_name}/{method.name}"
