"""The request decoder every servicer is registered with (``registry``); it
never raises: undecodable bytes (bad UTF-8, truncated fields) reach the handler
as ``Malformed`` and are answered RUN_VALIDATION_ERROR, instead of gRPC's
generic UNKNOWN with a parser traceback.

The protobuf decoder refuses a message whose string field holds invalid UTF-8
without saying which field. To name it, the bytes are decoded a second time
with a twin of the message type in which every string field is a bytes field
(which takes any bytes), and the first value that is not UTF-8 gives the
field's path (``owner``, ``commands[2].acquire.run_id``). Bytes that do not
decode even so (a truncated message, a wrong wire type) name ``request``.

The decoder in use (upb) accepts a 10-byte varint carrying bits past 64 and
drops them (``from_revision`` of ``0x80 * 9 + 0x02`` reads as 0); such bytes
are no valid encoding, so they are ``Malformed`` too, naming ``request``.

A message over the server's size limit is ``Malformed`` too (not decoded at
all, naming ``request``), so it is refused the same way and never tears down a
KeepAlive or Execute stream; gRPC's own receive limit is set well above it
(rpc/server.py)."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import (
    Descriptor,
    FieldDescriptor,
    FileDescriptor,
)
from google.protobuf.message import DecodeError, Message

_STRING = descriptor_pb2.FieldDescriptorProto.TYPE_STRING
_BYTES = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES


@dataclass(frozen=True, slots=True)
class Malformed:
    type_name: str
    error: str
    field: str = "request"  # the field holding invalid UTF-8, when it could be found


def decoder(cls: Any, max_bytes: int | None) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        if max_bytes is not None and len(data) > max_bytes:
            return Malformed(
                cls.DESCRIPTOR.full_name,
                f"the message is {len(data)} bytes, over the server's limit of {max_bytes} "
                "(--max-message-bytes)",
            )
        try:
            msg = cls.FromString(data)
        except (DecodeError, ValueError) as exc:
            error = str(exc).split(":")[-1].strip()
            field = _bad_utf8_field(cls.DESCRIPTOR, data)
            if field is None:
                return Malformed(cls.DESCRIPTOR.full_name, error)
            return Malformed(cls.DESCRIPTOR.full_name, f"{field} is not valid UTF-8", field)
        suspects = _to_walk(msg, data)
        if suspects and _overlong(cls.DESCRIPTOR, data, suspects):
            return Malformed(cls.DESCRIPTOR.full_name, "a varint carries more than 64 bits")
        return msg

    return decode


# Where a 10-byte varint with bits past 64 may start: nine bytes with the
# continuation bit, then one above 1 (a C-speed search). Text in many
# scripts looks so too; only when C-speed checks cannot rule one out are the
# parts of the message holding such a place walked in Python.
_HIGH = bytes(int(b >= 0x80) for b in range(256))
_NINE_HIGH = b"\x01" * 9 + b"\x00"
_VARINT_TYPES = frozenset({
    FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT32,
    FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_BOOL, FieldDescriptor.TYPE_ENUM,
})


def _suspects(data: bytes) -> tuple[list[int], list[int]]:
    """Where a varint past 64 bits may start; and those of them whose tenth
    byte is odd (it would read as a number with bit 63 set)."""
    flags = data.translate(_HIGH)
    out: list[int] = []
    odd: list[int] = []
    at = flags.find(_NINE_HIGH)
    while at >= 0:
        last = data[at + 9]
        if last > 1:
            out.append(at)
            if last & 1:
                odd.append(at)
        at = flags.find(_NINE_HIGH, at + 10)
    return out, odd


def _to_walk(msg: Any, data: bytes) -> list[int]:
    """The suspects (above) a C-speed check cannot rule out. One in a known
    field with an even tenth byte reads as a number below 2^63, whose proper
    encoding is shorter, so the message re-encodes shorter than it came; one
    in an unknown field goes with it (the server reads none). A negative
    int32 or enum that one reads as is refused by validation anyway."""
    suspects, odd = _suspects(data)
    if not suspects:
        return suspects
    msg.DiscardUnknownFields()
    return odd if msg.ByteSize() == len(data) else suspects


def _varint(data: bytes, i: int) -> tuple[int, int]:
    """The varint at ``i`` and where it ends; -1 as the value when it is 10
    bytes long and carries bits past 64."""
    start, value, shift = i, 0, 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return (-1 if i - start == 10 and b > 1 else value), i
        shift += 7


_MESSAGE, _PACKED = 1, 2


@functools.cache
def _layout(desc: Descriptor) -> dict[int, tuple[int, Descriptor | None]]:
    """Field number -> what a length-delimited value of it holds (a message,
    packed numbers) and the message's type; other fields are left out."""
    out: dict[int, tuple[int, Descriptor | None]] = {}
    for f in desc.fields:
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            out[f.number] = (_MESSAGE, f.message_type)
        elif f.type in _VARINT_TYPES:
            out[f.number] = (_PACKED, None)
    return out


def _overlong(desc: Descriptor | None, data: bytes, suspects: list[int],
              i: int = 0, end: int | None = None) -> bool:
    """Whether ``data[i:end]`` (a message of type ``desc``, decoded once
    already) holds a varint past 64 bits — a number, key, length or packed
    number, here or in a nested message holding one of ``suspects``."""
    end = len(data) if end is None else end
    layout = _layout(desc) if desc is not None else {}
    try:
        while i < end:
            key, i = _varint(data, i)
            if key < 0:
                return True
            wire = key & 7
            if wire == 0:
                value, i = _varint(data, i)
                if value < 0:
                    return True
            elif wire == 2:
                n, i = _varint(data, i)
                if n < 0:
                    return True
                j = i + n
                kind = layout.get(key >> 3)
                if kind is not None:
                    k = bisect.bisect_left(suspects, i)
                    if k < len(suspects) and suspects[k] < j:
                        if kind[0] == _MESSAGE:
                            if _overlong(kind[1], data, suspects, i, j):
                                return True
                        else:  # packed numbers
                            while i < j:
                                value, i = _varint(data, i)
                                if value < 0:
                                    return True
                i = j
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            # wire types 3 and 4 (groups): their fields follow as any others
    except IndexError:
        return True
    return False


def _bad_utf8_field(desc: Descriptor, data: bytes) -> str | None:
    """The path of the first string field in ``data`` that is not UTF-8."""
    try:
        twin = _bytes_twin(desc.file).FindMessageTypeByName(desc.full_name)
        parsed = message_factory.GetMessageClass(twin).FromString(data)
    except (DecodeError, ValueError, KeyError, TypeError):
        return None
    return _first_bad(parsed, desc, "")


def _first_bad(msg: Message, desc: Descriptor, prefix: str) -> str | None:
    for twin_field, value in msg.ListFields():
        field = desc.fields_by_name[twin_field.name]
        path = prefix + field.name
        items = list(enumerate(value)) if field.is_repeated else [(None, value)]
        for index, item in items:
            at = path if index is None else f"{path}[{index}]"
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    item.decode("utf-8")
                except UnicodeDecodeError:
                    return at
            elif field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type is not None:
                found = _first_bad(item, field.message_type, at + ".")
                if found is not None:
                    return found
    return None


@functools.cache
def _bytes_twin(file: FileDescriptor) -> descriptor_pool.DescriptorPool:
    """A pool holding ``file`` and its imports with every string field made bytes."""
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(fd: FileDescriptor) -> None:
        if fd.name in added:
            return
        for dep in fd.dependencies:
            add(dep)
        proto = descriptor_pb2.FileDescriptorProto()
        fd.CopyToProto(proto)
        _strings_to_bytes(proto.message_type)
        pool.Add(proto)
        added.add(fd.name)

    add(file)
    return pool


def _strings_to_bytes(messages: Any) -> None:
    for message in messages:
        if not message.options.map_entry:  # a map's key may not be bytes
            for field in message.field:
                if field.type == _STRING:
                    field.type = _BYTES
        _strings_to_bytes(message.nested_type)
