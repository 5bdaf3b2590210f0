"""Protocol messages: one frozen, slotted dataclass per :class:`MessageKind`.

Each field's wire type is declared next to it (``wf(U64)``); the layout of a payload is
the fields in declaration order (see :mod:`meshnode.wire.schema` and docs/protocol.md).
Every message starts with ``ref`` (u32 request id; a reply carries the ref of the
request it answers; 0 = none), so a receiver can read the ref of a frame it cannot
otherwise decode and answer it with an ``Error``.

Kinds below 0x100 are the control plane, 0x100 and up the data plane. Cross-field rules
(segment rows must add up to the activation rows ...) live in the ``check`` functions
registered with :func:`message`; they run on both encode and decode.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from meshnode.limits import DEFAULT_KV_TYPE, KV_CACHE_TYPES, MAX_VERIFY_WINDOW
from meshnode.wire.errors import ErrorCode
from meshnode.wire.schema import (
    ARRAY,
    BOOL,
    BYTES,
    CODE,
    EnumStrField,
    F32,
    F64,
    I32,
    JSON,
    STR,
    U8,
    U16,
    U32,
    U64,
    IntList,
    Invalid,
    Records,
    Schema,
    StrField,
    compile_schema,
    record,
    wf,
)

# Hello.protocol; peers with another value are refused at Hello. 2: Hello carries only
# what the proof needs (name and capabilities empty); both follow in Profile, after the proof.
PROTOCOL_VERSION = 2
# Segment.flags bits. SEG_LANE: stage 0 sent this step while no other frame of its session
# was in flight, so every stage may carry it (and its TokenReturn) on the lossy fast lane
# (meshnode.net.lane); stage 0 resends it over the stream, without the bit, if it is lost.
SEG_LANE = 0x01
WIRE_DTYPES = ("f32", "f16")


class MessageKind(enum.IntEnum):
    """Frame kind (u16). Never renumber; new kinds get new numbers."""

    HELLO = 0x0001
    AUTH_CHALLENGE = 0x0002
    AUTH_PROOF = 0x0003
    AUTH_RESULT = 0x0004
    HEARTBEAT = 0x0005
    LANE_KEY = 0x0006
    PROFILE = 0x0007
    CLAIM = 0x0010
    PREPARE = 0x0011
    INVENTORY = 0x0012
    LOAD = 0x0013
    READY = 0x0014
    STOP = 0x0015
    STATUS = 0x0016
    ERROR = 0x001F
    FORWARD = 0x0100
    TOKEN_RETURN = 0x0101
    TRIM = 0x0102
    SESSION_END = 0x0103
    DATA_ERROR = 0x0104
    # membership and trust: capability updates, secret rotation
    CAPS_UPDATE = 0x0040
    SECRET_ROTATE = 0x0041
    SECRET_ACK = 0x0042


class MessageType:
    """What the codec knows about one message class: its kind, schema and cross-field check."""

    __slots__ = ("kind", "cls", "schema", "check")

    def __init__(self, kind: MessageKind, cls: type, schema: Schema, check: Callable[[Any], None] | None):
        self.kind = kind
        self.cls = cls
        self.schema = schema
        self.check = check


MESSAGE_TYPES: dict[int, MessageType] = {}


def message(kind: MessageKind, check: Callable[[Any], None] | None = None) -> Callable[[type], type]:
    """Register a message dataclass under ``kind`` and compile its codec."""

    def deco(cls: type) -> type:
        schema = compile_schema(cls)
        if schema.names[:1] != ["ref"]:
            raise TypeError(f"{cls.__name__}: the first field must be ref")
        cls.KIND = kind  # type: ignore[attr-defined]
        MESSAGE_TYPES[kind] = MessageType(kind, cls, schema, check)
        return cls

    return deco


# ----------------------------------------------------------------------------- control


# Bounds of the peer-describing fields (docs/security.md): a Hello travels before the mesh proof,
# so it must fit the handshake's frame cap; a name is a label, not a document.
MAX_NODE_ID_LEN = 64
MAX_MESH_ID_LEN = 64
MAX_NAME_LEN = 64


def _check_hello(m: "Hello") -> None:
    for field, value, cap in (("node_id", m.node_id, MAX_NODE_ID_LEN), ("mesh_id", m.mesh_id, MAX_MESH_ID_LEN),
                              ("name", m.name, MAX_NAME_LEN)):
        if len(value) > cap:
            raise Invalid(ErrorCode.BAD_FIELD, f"{field} of {len(value)} characters (at most {cap})")


@message(MessageKind.HELLO, _check_hello)
@dataclass(frozen=True, slots=True)
class Hello:
    """First message on a connection, both directions. ``capabilities`` is JSON.

    Since protocol 2 a node sends ``name=""`` and ``capabilities={}`` here (this goes to
    anyone who connects, before the proof); they follow in :class:`Profile`."""

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    node_id: str = wf(STR)
    name: str = wf(STR)
    mesh_id: str = wf(STR)
    protocol: int = wf(U16)
    capabilities: dict[str, Any] = wf(JSON)


def _check_profile(m: "Profile") -> None:
    if len(m.name) > MAX_NAME_LEN:
        raise Invalid(ErrorCode.BAD_FIELD, f"name of {len(m.name)} characters (at most {MAX_NAME_LEN})")


@message(MessageKind.PROFILE, _check_profile)
@dataclass(frozen=True, slots=True)
class Profile:
    """The rest of a node's self-description, sent right after its ``AuthResult(ok)``:
    only to a peer whose proof verified. ``capabilities`` is JSON (meshnode.net.caps,
    plus ``quic_port``); meshnode.net.auth checks its schema and size."""

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    name: str = wf(STR)
    capabilities: dict[str, Any] = wf(JSON)


@message(MessageKind.AUTH_CHALLENGE)
@dataclass(frozen=True, slots=True)
class AuthChallenge:
    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    nonce: bytes = wf(BYTES)


@message(MessageKind.AUTH_PROOF)
@dataclass(frozen=True, slots=True)
class AuthProof:
    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    mac: bytes = wf(BYTES)


@message(MessageKind.AUTH_RESULT)
@dataclass(frozen=True, slots=True)
class AuthResult:
    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    ok: bool = wf(BOOL)
    reason: str = wf(STR)


@message(MessageKind.HEARTBEAT)
@dataclass(frozen=True, slots=True)
class Heartbeat:
    """``echo`` = this is the answer to a heartbeat (``sent_ns`` copied back)."""

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    seq: int = wf(U64)
    sent_ns: int = wf(U64)
    echo: bool = wf(BOOL)


LANE_KEY_LEN = 16   # AES-128-GCM


def _check_lane_key(m: "LaneKey") -> None:
    if len(m.key) != LANE_KEY_LEN:
        raise Invalid(ErrorCode.BAD_FIELD, f"lane key of {len(m.key)} bytes, expected {LANE_KEY_LEN}")


@message(MessageKind.LANE_KEY, _check_lane_key)
@dataclass(frozen=True, slots=True)
class LaneKey:
    """Seal the lane packets you send me with ``key`` (AES-128-GCM) under ``key_id``
    (meshnode.net.lane). Sent once per link, on the control stream, after authentication."""

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    key_id: int = wf(U32)
    key: bytes = wf(BYTES)


@message(MessageKind.CLAIM)
@dataclass(frozen=True, slots=True)
class Claim:
    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    term: int = wf(U64)
    coordinator_id: str = wf(STR)
    model_sha256: str = wf(STR)
    stage_index: int = wf(U32)


def _check_layers(m: Any) -> None:
    if m.layer_start > m.layer_end:
        raise Invalid(ErrorCode.BAD_FIELD, f"layer range [{m.layer_start}, {m.layer_end}) is reversed")


def _check_prepare(m: Prepare) -> None:
    _check_layers(m)
    if m.layer_end > m.n_layers_total:
        raise Invalid(ErrorCode.BAD_FIELD, f"layer_end {m.layer_end} > n_layers_total {m.n_layers_total}")


@message(MessageKind.PREPARE, _check_prepare)
@dataclass(frozen=True, slots=True)
class Prepare:
    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    term: int = wf(U64)
    model_sha256: str = wf(STR)
    model_name: str = wf(STR)
    layer_start: int = wf(U32)
    layer_end: int = wf(U32)
    n_layers_total: int = wf(U32)


@message(MessageKind.INVENTORY, _check_layers)
@dataclass(frozen=True, slots=True)
class Inventory:
    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    term: int = wf(U64)
    model_sha256: str = wf(STR)
    layer_start: int = wf(U32)
    layer_end: int = wf(U32)
    present: bool = wf(BOOL)
    progress: float = wf(F64)
    detail: str = wf(STR)


@message(MessageKind.LOAD, _check_layers)
@dataclass(frozen=True, slots=True)
class Load:
    """``upstream`` / ``downstream`` / ``coordinator`` are node ids ('' = none)."""

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    term: int = wf(U64)
    model_sha256: str = wf(STR)
    layer_start: int = wf(U32)
    layer_end: int = wf(U32)
    upstream: str = wf(STR)
    downstream: str = wf(STR)
    coordinator: str = wf(STR)
    wire_dtype: str = wf(StrField(WIRE_DTYPES, ErrorCode.BAD_DTYPE))
    n_ctx: int = wf(U32)
    n_batch: int = wf(U32)
    n_seq_max: int = wf(U32)
    # The KV cache type every stage uses: results depend on it (docs/engine.md).
    kv_type: str = wf(StrField(KV_CACHE_TYPES), default=DEFAULT_KV_TYPE)


@message(MessageKind.READY)
@dataclass(frozen=True, slots=True)
class Ready:
    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    term: int = wf(U64)
    stage_index: int = wf(U32)
    n_embd: int = wf(U32)
    load_ms: float = wf(F64)


@message(MessageKind.STOP)
@dataclass(frozen=True, slots=True)
class Stop:
    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    term: int = wf(U64)
    reason: str = wf(STR)


class StageStatus(enum.StrEnum):
    """``Status.state``: what a stage server reports of the stage it was asked about."""

    CLAIMED = "claimed"
    STOPPED = "stopped"
    FAILED = "failed"


@message(MessageKind.STATUS)
@dataclass(frozen=True, slots=True)
class Status:
    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    term: int = wf(U64)
    state: StageStatus = wf(EnumStrField(StageStatus))
    detail: str = wf(STR)
    progress: float = wf(F64)


@message(MessageKind.ERROR)
@dataclass(frozen=True, slots=True)
class Error:
    """Answer to a control request (or to an undecodable frame: ref = its ref)."""

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    code: ErrorCode = wf(CODE)
    message: str = wf(STR)


# -------------------------------------------------------------------------------- data


@record
@dataclass(frozen=True, slots=True)
class Segment:
    """One session's rows inside a Forward batch.

    ``n_logits``: how many rows at the end of the segment are sampled by the final
    stage (0 = none). ``drafts``: draft token ids being verified (<= 32).
    """

    session: int = wf(U64)
    pos: int = wf(U32)
    n_rows: int = wf(U32)
    n_logits: int = wf(U16)
    drafts: tuple[int, ...] = wf(IntList("B", U32, MAX_VERIFY_WINDOW))
    temperature: float = wf(F32)
    top_k: int = wf(I32)
    top_p: float = wf(F32)
    seed: int = wf(U64)
    flags: int = wf(U8)


def _check_forward(m: Forward) -> None:
    rows = 0
    for i, s in enumerate(m.segments):
        if s.n_logits > s.n_rows:
            raise Invalid(ErrorCode.BAD_SHAPE, f"segments[{i}]: n_logits {s.n_logits} > n_rows {s.n_rows}")
        rows += s.n_rows
    if rows != m.act.shape[0]:
        raise Invalid(ErrorCode.BAD_SHAPE, f"segments hold {rows} rows, activation has {m.act.shape[0]}")


@message(MessageKind.FORWARD, _check_forward)
@dataclass(frozen=True, slots=True, eq=False)
class Forward:
    """One pipeline step: activation rows for several sessions, sent stage to stage.

    ``act`` is (rows, width) float32 or float16; rows = sum of segment ``n_rows``, in
    segment order. A decoded ``act`` is a read-only view of the receive buffer (no
    copy): copy it if you need to write to it or keep it beyond the buffer's life.
    """

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    batch_id: int = wf(U64)
    step: int = wf(U32)
    segments: tuple[Segment, ...] = wf(Records(Segment))
    act: np.ndarray = wf(ARRAY)

    def __eq__(self, other: object) -> bool:
        # ndarray == is elementwise, so the generated dataclass __eq__ cannot be used.
        if not isinstance(other, Forward):
            return NotImplemented
        return (
            (self.ref, self.batch_id, self.step, self.segments)
            == (other.ref, other.batch_id, other.step, other.segments)
            and self.act.dtype == other.act.dtype
            and np.array_equal(self.act, other.act)
        )

    __hash__ = None  # type: ignore[assignment]


@record
@dataclass(frozen=True, slots=True)
class SegmentResult:
    """Tokens sampled for one session: the accepted drafts plus the bonus token."""

    session: int = wf(U64)
    tokens: tuple[int, ...] = wf(IntList("H", U32, 0xFFFF))
    n_accepted: int = wf(U32)
    n_drafted: int = wf(U32)


@message(MessageKind.TOKEN_RETURN)
@dataclass(frozen=True, slots=True)
class TokenReturn:
    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    batch_id: int = wf(U64)
    results: tuple[SegmentResult, ...] = wf(Records(SegmentResult))


@message(MessageKind.TRIM)
@dataclass(frozen=True, slots=True)
class Trim:
    """Drop the session's KV cache at positions >= pos."""

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    session: int = wf(U64)
    pos: int = wf(U32)


@message(MessageKind.SESSION_END)
@dataclass(frozen=True, slots=True)
class SessionEnd:
    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    session: int = wf(U64)


# DataError.session of a failure of the whole batch (session ids are never 0). A DataError
# naming one session of the batch fails that session only (its sampling failed at the
# final stage); the batch's TokenReturn still brings the others (docs/protocol.md).
WHOLE_BATCH = 0


@message(MessageKind.DATA_ERROR)
@dataclass(frozen=True, slots=True)
class DataError:
    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    batch_id: int = wf(U64)
    session: int = wf(U64)
    code: ErrorCode = wf(CODE)
    message: str = wf(STR)


# ------------------------------------------------------------------ membership and trust
# Capabilities travel only over authenticated links (never from mDNS), and a leaked mesh
# secret is replaced on the members that are online (`meshnode mesh rotate`).

SECRET_LEN = 32


def _check_secret(m: Any) -> None:
    if len(m.secret) != SECRET_LEN:
        raise Invalid(ErrorCode.BAD_FIELD, f"mesh secret of {len(m.secret)} bytes, expected {SECRET_LEN}")


@message(MessageKind.CAPS_UPDATE)
@dataclass(frozen=True, slots=True)
class CapsUpdate:
    """My capability summary changed (same JSON as ``Hello.capabilities``); no reply."""

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    capabilities: dict[str, Any] = wf(JSON)


@message(MessageKind.SECRET_ROTATE, _check_secret)
@dataclass(frozen=True, slots=True)
class SecretRotate:
    """Replace the mesh secret with ``secret`` (32 bytes): store it, use it for every new
    link, answer ``SecretAck`` (or ``Error`` when it could not be stored). Links already
    up stay up."""

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    secret: bytes = wf(BYTES)


@message(MessageKind.SECRET_ACK)
@dataclass(frozen=True, slots=True)
class SecretAck:
    """The new secret is stored; ``mesh_id`` is the id of the mesh it makes."""

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    mesh_id: str = wf(STR)


Message = (
    Hello
    | AuthChallenge
    | AuthProof
    | AuthResult
    | Heartbeat
    | LaneKey
    | Profile
    | Claim
    | Prepare
    | Inventory
    | Load
    | Ready
    | Stop
    | Status
    | Error
    | Forward
    | TokenReturn
    | Trim
    | SessionEnd
    | DataError
    | CapsUpdate
    | SecretRotate
    | SecretAck
)

if set(MESSAGE_TYPES) != set(MessageKind):  # import-time sanity: every kind has exactly one class
    raise RuntimeError(f"MessageKind without a message class: {set(MessageKind) - set(MESSAGE_TYPES)}")


def check_peer_version(hello: Hello) -> Error | None:
    """The versioning rule: return the ``Error`` to send (then close) when the peer's
    ``Hello.protocol`` differs from ours, or ``None`` when the peer is compatible."""
    if hello.protocol == PROTOCOL_VERSION:
        return None
    return Error(
        ref=hello.ref,
        code=ErrorCode.BAD_VERSION,
        message=f"protocol {hello.protocol} not supported (this node speaks {PROTOCOL_VERSION})",
    )
