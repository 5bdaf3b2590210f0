"""Frames: encode a message to bytes, decode a payload to a message.

Frame layout (little endian, 10-byte header)::

    magic b"MN" | version u8 (=1) | flags u8 | kind u16 | length u32 | payload[length]

``length`` counts the payload only and is capped at :data:`MAX_FRAME` (64 MiB). Senders
write ``flags = 0``; receivers ignore flag bits (reserved for later, compatible use).
A payload is the message's fields in declaration order (:mod:`meshnode.wire.messages`).
"""

from __future__ import annotations

import struct

from meshnode.wire.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from meshnode.wire.messages import MESSAGE_TYPES, Message, MessageKind
from meshnode.wire.schema import Invalid, Writer

MAGIC = b"MN"
WIRE_VERSION = 1
MAX_FRAME = 64 * 1024 * 1024
HEADER = struct.Struct("<2sBBHI")
HEADER_SIZE = HEADER.size  # 10
_REF = struct.Struct("<I")


def _kind_name(kind: int) -> str:
    try:
        return MessageKind(kind).name
    except ValueError:
        return f"kind 0x{kind:04x}"


def encode(msg: Message, *, max_frame: int = MAX_FRAME) -> bytes:
    """Encode ``msg`` as one whole frame.

    Raises :class:`LocalProtocolError` when the message cannot be carried: a field of the
    wrong type or out of range (BAD_FIELD), an activation of another dtype (BAD_DTYPE) or
    shape, segment rows that do not add up (BAD_SHAPE), a payload above ``max_frame``
    (OVERSIZE), or an object that is not a message (UNKNOWN_KIND).
    """
    mtype = MESSAGE_TYPES.get(getattr(type(msg), "KIND", -1))
    if mtype is None or type(msg) is not mtype.cls:
        raise LocalProtocolError(ErrorCode.UNKNOWN_KIND, f"not a wire message: {type(msg).__name__}")
    ref = msg.ref if isinstance(msg.ref, int) else 0
    w = Writer()
    try:
        mtype.schema.pack(msg, w)  # types and ranges first, then cross-field rules
        if mtype.check is not None:
            mtype.check(msg)
    except Invalid as e:
        raise LocalProtocolError(e.code, f"{mtype.cls.__name__}: {e.detail}", ref=ref) from None
    except (AttributeError, TypeError) as e:  # not a dataclass field set we can read
        raise LocalProtocolError(ErrorCode.BAD_FIELD, f"{mtype.cls.__name__}: {e}", ref=ref) from None
    if w.size > max_frame:
        raise LocalProtocolError(
            ErrorCode.OVERSIZE, f"{mtype.cls.__name__}: payload {w.size} bytes > cap {max_frame}", ref=ref
        )
    return b"".join([HEADER.pack(MAGIC, WIRE_VERSION, 0, mtype.kind, w.size), *w.parts])


def decode_message(kind: int, payload: bytes | bytearray | memoryview) -> Message:
    """Decode one frame's payload (the frame header already parsed).

    Zero copy for the activation of a ``Forward``: it is a read-only view of
    ``payload``, which must therefore not be modified while the message is alive.
    Raises :class:`RemoteProtocolError` (UNKNOWN_KIND, TRUNCATED, BAD_FIELD, BAD_SHAPE,
    BAD_DTYPE); its ``ref`` is the payload's ref when at least 4 bytes are present.
    """
    mv = memoryview(payload)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    mv = mv.toreadonly()
    ref = _REF.unpack_from(mv, 0)[0] if len(mv) >= 4 else 0
    mtype = MESSAGE_TYPES.get(kind)
    if mtype is None:
        raise RemoteProtocolError(ErrorCode.UNKNOWN_KIND, f"unknown frame kind 0x{kind:04x}", ref=ref)
    name = mtype.cls.__name__
    try:
        values, end = mtype.schema.unpack(mv, 0)
        if end != len(mv):
            raise Invalid(ErrorCode.BAD_FIELD, f"{len(mv) - end} trailing bytes")
        msg = mtype.cls(*values)
        if mtype.check is not None:
            mtype.check(msg)
    except Invalid as e:
        raise RemoteProtocolError(e.code, f"{name}: {e.detail}", ref=ref) from None
    return msg  # type: ignore[no-any-return]


def parse_header(header: bytes | bytearray | memoryview, max_frame: int = MAX_FRAME) -> tuple[int, int]:
    """Check a 10-byte frame header; return ``(kind, length)``.

    Raises :class:`RemoteProtocolError` with BAD_MAGIC, BAD_VERSION or OVERSIZE: all three
    mean the stream cannot be trusted any further (the connection must be closed).
    """
    magic, version, _flags, kind, length = HEADER.unpack_from(header, 0)
    if magic != MAGIC:
        raise RemoteProtocolError(ErrorCode.BAD_MAGIC, f"bad magic {bytes(magic)!r}")
    if version != WIRE_VERSION:
        raise RemoteProtocolError(ErrorCode.BAD_VERSION, f"frame version {version}, expected {WIRE_VERSION}")
    if length > max_frame:
        raise RemoteProtocolError(
            ErrorCode.OVERSIZE, f"{_kind_name(kind)}: length {length} > cap {max_frame}"
        )
    return kind, length


def decode(frame: bytes | bytearray | memoryview, *, max_frame: int = MAX_FRAME) -> Message:
    """Decode exactly one whole frame (for transports that deliver whole messages).

    Raises :class:`RemoteProtocolError`: any error of :func:`parse_header` or
    :func:`decode_message`, or TRUNCATED / BAD_FIELD when ``frame`` is shorter or longer
    than its length prefix says.
    """
    mv = memoryview(frame)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if len(mv) < HEADER_SIZE:
        raise RemoteProtocolError(ErrorCode.TRUNCATED, f"{len(mv)} bytes, header needs {HEADER_SIZE}")
    kind, length = parse_header(mv, max_frame)
    if len(mv) - HEADER_SIZE != length:
        code = ErrorCode.TRUNCATED if len(mv) - HEADER_SIZE < length else ErrorCode.BAD_FIELD
        raise RemoteProtocolError(code, f"{_kind_name(kind)}: length {length}, {len(mv) - HEADER_SIZE} bytes present")
    return decode_message(kind, mv[HEADER_SIZE:])
