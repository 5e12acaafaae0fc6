"""Checks on a request's wire bytes that parsing alone hides: which string field is not UTF-8
(the parser only says that one is), and two members of one oneof set at once (the parser
keeps the last one silently, so `regex` and `json_schema` sent together would compile just
the one that came last). Plain protobuf; no grpc.

The bytes are re-read as unknown fields of an empty message, which keeps every field as it
came, then walked with the message's descriptor.
"""

from __future__ import annotations

from functools import cache

from google.protobuf import empty_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

_LENGTH_DELIMITED = 2


def _fields(data: bytes):
    holder = empty_pb2.Empty()
    holder.ParseFromString(data)
    return UnknownFieldSet(holder)


def _walk(descriptor: Descriptor, data: bytes, prefix: str):
    """(field path, field descriptor, raw field) for every field present, in wire order."""
    seen: dict[str, int] = {}
    for raw in _fields(data):
        fd = descriptor.fields_by_number.get(raw.field_number)
        if fd is None:
            continue
        name = prefix + fd.name
        if fd.is_repeated:
            seen[name] = seen.get(name, -1) + 1
            name += f"[{seen[name]}]"
        yield name, fd, raw


def bad_utf8_field(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """The path (`messages[1].content`) of the first string field of `data` that is not
    valid UTF-8, or None."""
    try:
        for name, fd, raw in _walk(descriptor, data, prefix):
            if raw.wire_type != _LENGTH_DELIMITED:
                continue
            if fd.type == FieldDescriptor.TYPE_STRING:
                try:
                    raw.data.decode("utf-8")
                except UnicodeDecodeError:
                    return name
            elif fd.type == FieldDescriptor.TYPE_MESSAGE:
                found = bad_utf8_field(fd.message_type, raw.data, name + ".")
                if found:
                    return found
    except DecodeError:
        return None
    return None


@cache
def _has_oneof(descriptor: Descriptor, _depth: int = 0) -> bool:
    if descriptor.oneofs:
        return True
    return _depth < 16 and any(
        _has_oneof(fd.message_type, _depth + 1) for fd in descriptor.fields
        if fd.type == FieldDescriptor.TYPE_MESSAGE)


def oneof_conflict(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """A message saying which oneof of `data` has two different members set
    (`constraint: sets both json_schema and regex; set exactly one`), or None. A member
    sent twice is not a conflict (protobuf merges it)."""
    if not _has_oneof(descriptor):
        return None
    chosen: dict[str, str] = {}
    # A singular message field sent several times is merged by the parser: its pieces
    # are checked together, as the one message they become.
    parts: dict[str, tuple[Descriptor, list[bytes]]] = {}
    try:
        for name, fd, raw in _walk(descriptor, data, prefix):
            oneof = fd.containing_oneof
            if oneof is not None and not oneof.name.startswith("_"):  # `_x`: proto3 optional
                key = prefix + oneof.name
                first = chosen.setdefault(key, fd.name)
                if first != fd.name:
                    where = prefix.rstrip(".") or oneof.name
                    return (f"{where}: sets both {first} and {fd.name}; set exactly one "
                            f"({oneof.name})")
            if fd.type == FieldDescriptor.TYPE_MESSAGE and raw.wire_type == _LENGTH_DELIMITED:
                parts.setdefault(name, (fd.message_type, []))[1].append(raw.data)
    except DecodeError:
        return None
    for name, (message_type, pieces) in parts.items():
        found = oneof_conflict(message_type, b"".join(pieces), name + ".")
        if found:
            return found
    return None
