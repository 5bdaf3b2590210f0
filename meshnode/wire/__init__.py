"""meshnode.wire: the sans-IO binary protocol between nodes.

Theory of operation: this package turns messages into bytes and bytes into messages,
and nothing else: no sockets, no asyncio, no clocks, no other meshnode package (only
``meshnode.errors``). A transport feeds whatever bytes arrive into a
:class:`FrameDecoder` and gets back a list of messages and :class:`WireError` events; it
sends ``encode(msg)``. Errors say whose fault they are: :class:`LocalProtocolError` from
encoding, :class:`RemoteProtocolError` from :func:`decode_message`, and ``WireError``
events (never exceptions) out of the decoder. The format is in docs/protocol.md.

The per-token decode frame has a fast path, :class:`DecodeTemplate`.
"""

from meshnode.wire.codec import (
    HEADER_SIZE,
    MAGIC,
    MAX_FRAME,
    WIRE_VERSION,
    decode,
    decode_message,
    encode,
    parse_header,
)
from meshnode.wire.decoder import DecoderState, FrameDecoder
from meshnode.wire.errors import (
    ErrorCode,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    WireError,
)
from meshnode.wire.messages import (
    SEG_LANE,
    PROTOCOL_VERSION,
    WIRE_DTYPES,
    AuthChallenge,
    AuthProof,
    AuthResult,
    CapsUpdate,
    Claim,
    DataError,
    Error,
    Forward,
    Heartbeat,
    Hello,
    Inventory,
    LaneKey,
    Profile,
    Load,
    Message,
    MessageKind,
    Prepare,
    Ready,
    SecretAck,
    SecretRotate,
    Segment,
    SegmentResult,
    SessionEnd,
    StageStatus,
    Status,
    Stop,
    TokenReturn,
    Trim,
    check_peer_version,
)
from meshnode.wire.template import DecodeTemplate

__all__ = [
    "HEADER_SIZE",
    "MAGIC",
    "SEG_LANE",
    "MAX_FRAME",
    "PROTOCOL_VERSION",
    "WIRE_DTYPES",
    "WIRE_VERSION",
    "AuthChallenge",
    "AuthProof",
    "AuthResult",
    "CapsUpdate",
    "Claim",
    "DataError",
    "DecodeTemplate",
    "DecoderState",
    "Error",
    "ErrorCode",
    "FrameDecoder",
    "Forward",
    "Heartbeat",
    "Hello",
    "Inventory",
    "LaneKey",
    "Profile",
    "Load",
    "LocalProtocolError",
    "Message",
    "MessageKind",
    "Prepare",
    "ProtocolError",
    "Ready",
    "RemoteProtocolError",
    "SecretAck",
    "SecretRotate",
    "Segment",
    "SegmentResult",
    "SessionEnd",
    "StageStatus",
    "Status",
    "Stop",
    "TokenReturn",
    "Trim",
    "WireError",
    "check_peer_version",
    "decode",
    "decode_message",
    "encode",
    "parse_header",
]
