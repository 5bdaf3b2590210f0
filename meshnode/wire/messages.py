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
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from meshnode import PROTOCOL_VERSION
from meshnode.limits import (
    DEFAULT_KV_TYPE,
    KV_CACHE_TYPES,
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_REPEAT_PENALTY,
    MAX_SCORED,
    MAX_SEEN,
    MAX_TOP_LOGPROBS,
    MAX_VERIFY_WINDOW,
)
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
# 3: SessionEnd goes to stage 1 only and every stage relays it (a stage of version 2 would
# not, and its successors would never free the session); a stage may fail one session of
# a Forward with DataError(NO_SUCH_SESSION).
# 4: Segment carries the request's logit bias (bias_ids, bias_values) and penalties
# (presence, frequency, and the counts of the tokens generated before it), and min_p.
# 5: Segment.score asks the final stage for the logprobs of prompt tokens (OpenAI's echo),
# which SegmentResult returns (scored, scored_top_ids, scored_top_logprobs).
# 6: ApiRequest.path may name /v1/responses (OpenAI's Responses API), llama.cpp server's
# /completion and /infill, and /tokenize and /detokenize; Segment carries the repetition
# penalty (repeat, repeat_last_n, recent).
# 7: ApiRequest.path may name /tokenizer_info, a GET whose query string is the body.
# The number itself is meshnode.PROTOCOL_VERSION (one place: the fabric, mDNS and Hello use it).
# Segment.flags bits. SEG_LANE: stage 0 sent this step while no other frame of its session
# was in flight, so every stage may carry it (and its TokenReturn) on the lossy fast lane
# (meshnode.net.lane); stage 0 resends it over the stream, without the bit, if it is lost.
SEG_LANE = 0x01
# SEG_LOGPROBS: the final stage returns the sampled tokens' logprobs (SegmentResult) and
# (flags >> SEG_TOP_SHIFT) alternatives per token, at most MAX_TOP_LOGPROBS.
SEG_LOGPROBS = 0x02
SEG_TOP_SHIFT = 3


def logprob_flags(top_logprobs: int | None) -> int:
    """Segment.flags bits asking for logprobs with ``top_logprobs`` alternatives (None: none)."""
    if top_logprobs is None:
        return 0
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs {top_logprobs} outside 0..{MAX_TOP_LOGPROBS}")
    return SEG_LOGPROBS | (top_logprobs << SEG_TOP_SHIFT)


def flags_top_logprobs(flags: int) -> int | None:
    """The inverse of :func:`logprob_flags` (checked on decode by Forward's check)."""
    return flags >> SEG_TOP_SHIFT if flags & SEG_LOGPROBS else None


# SEG_MASKED: the final stage samples this segment under the GrammarMask that stage 0 sent
# just before the Forward; without it the session fails (never samples unconstrained).
SEG_MASKED = 0x04
# GrammarMask bounds: a vocabulary of up to 2**20 tokens (a 128 KiB bitset a row) and
# one row per logit of a verify window.
MAX_MASK_VOCAB = 1 << 20
MASK_BITSET = 0
MASK_IDS = 1
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
    SESSION_COPY = 0x0090
    CAPS_UPDATE = 0x0040
    SECRET_ROTATE = 0x0041
    SECRET_ACK = 0x0042
    # grammar-constrained sampling: the allowed tokens of a step's logit rows
    GRAMMAR_MASK = 0x0080
    # the mesh-wide endpoint: models coordinators serve, /v1 requests carried to them
    MODELS_SERVED = 0x0060
    API_REQUEST = 0x0061
    API_RESPONSE_START = 0x0062
    API_RESPONSE_BODY = 0x0063
    API_CANCEL = 0x0064
    # model sharing: a puller asks a holder for a ticket to the bulk channel (meshnode.net.bulk)
    SHARE_REQUEST = 0x0050
    SHARE_TICKET = 0x0051


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
    ``bias_ids`` / ``bias_values``: the request's logit bias (OpenAI's ``logit_bias``), added
    to those tokens' logits before sampling; ids unique and ascending, values in -100..100.
    ``presence`` / ``frequency``: OpenAI's penalties (-2..2), applied by ``seen_ids`` /
    ``seen_counts``, the tokens generated before the segment's first logit row and how
    often each came (ids unique and ascending, counts >= 1). ``min_p``: llama.cpp's, 0..1.
    ``score``: the prompt tokens that follow the segment's first ``len(score)`` logit rows
    (OpenAI's ``echo`` with logprobs): the final stage returns each one's logprob in its row,
    and samples only the logit rows after them (none when ``n_logits == len(score)``).
    Needs SEG_LOGPROBS (the alternatives per row, as for sampled tokens).
    ``repeat`` / ``repeat_last_n``: the repetition penalty (1: off; 0 < repeat <= 10) over
    the context's last ``repeat_last_n`` tokens (-1: all of it; 0: off), ``recent`` those
    tokens before the first logit row (in order; with -1 the distinct ids, ascending).
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
    bias_ids: tuple[int, ...] = wf(IntList("H", U32, MAX_LOGIT_BIAS), default=())
    bias_values: tuple[float, ...] = wf(IntList("H", F32, MAX_LOGIT_BIAS), default=())
    presence: float = wf(F32, default=0.0)
    frequency: float = wf(F32, default=0.0)
    seen_ids: tuple[int, ...] = wf(IntList("I", U32, MAX_SEEN), default=())
    seen_counts: tuple[int, ...] = wf(IntList("I", U32, MAX_SEEN), default=())
    min_p: float = wf(F32, default=0.0)
    score: tuple[int, ...] = wf(IntList("I", U32, MAX_SCORED), default=())
    repeat: float = wf(F32, default=1.0)
    repeat_last_n: int = wf(I32, default=0)
    recent: tuple[int, ...] = wf(IntList("I", U32, MAX_SEEN), default=())


def _ascending(ids: tuple[int, ...]) -> bool:
    return all(map(operator.lt, ids, ids[1:]))   # (a step's lists hold up to thousands of ids)


def _check_penalties(i: int, s: Segment) -> None:
    if not (-MAX_PENALTY <= s.presence <= MAX_PENALTY and -MAX_PENALTY <= s.frequency <= MAX_PENALTY):
        raise Invalid(ErrorCode.BAD_FIELD, f"segments[{i}]: a penalty outside -{MAX_PENALTY:g}..{MAX_PENALTY:g}")
    if len(s.seen_ids) != len(s.seen_counts):
        raise Invalid(ErrorCode.BAD_SHAPE, f"segments[{i}]: {len(s.seen_ids)} seen ids, "
                                           f"{len(s.seen_counts)} counts")
    if not _ascending(s.seen_ids) or not all(s.seen_counts):
        raise Invalid(ErrorCode.BAD_FIELD, f"segments[{i}]: seen ids not unique and ascending, or a count of 0")
    if not (0 < s.repeat <= MAX_REPEAT_PENALTY) or s.repeat_last_n < -1:   # (NaN fails too)
        raise Invalid(ErrorCode.BAD_FIELD, f"segments[{i}]: a repetition penalty outside 0..{MAX_REPEAT_PENALTY:g} "
                                           f"or a window below -1")
    if s.repeat_last_n >= 0 and len(s.recent) > s.repeat_last_n or s.repeat_last_n < 0 and not _ascending(s.recent):
        raise Invalid(ErrorCode.BAD_FIELD, f"segments[{i}]: recent tokens past the window, or not unique "
                                           "and ascending for the whole context")


def _check_bias(i: int, s: Segment) -> None:
    if len(s.bias_ids) != len(s.bias_values):
        raise Invalid(ErrorCode.BAD_SHAPE, f"segments[{i}]: {len(s.bias_ids)} bias ids, "
                                           f"{len(s.bias_values)} bias values")
    if not _ascending(s.bias_ids):
        raise Invalid(ErrorCode.BAD_FIELD, f"segments[{i}]: bias ids not unique and ascending")
    if not all(-MAX_BIAS <= v <= MAX_BIAS for v in s.bias_values):   # (NaN fails too)
        raise Invalid(ErrorCode.BAD_FIELD, f"segments[{i}]: a bias value outside -{MAX_BIAS:g}..{MAX_BIAS:g}")


def _check_forward(m: Forward) -> None:
    rows = 0
    for i, s in enumerate(m.segments):
        if s.n_logits > s.n_rows:
            raise Invalid(ErrorCode.BAD_SHAPE, f"segments[{i}]: n_logits {s.n_logits} > n_rows {s.n_rows}")
        if s.bias_ids or s.bias_values:
            _check_bias(i, s)
        if s.presence or s.frequency or s.seen_ids or s.seen_counts or s.repeat != 1.0 or s.repeat_last_n or s.recent:
            _check_penalties(i, s)
        if not 0.0 <= s.min_p <= 1.0:   # (NaN fails too)
            raise Invalid(ErrorCode.BAD_FIELD, f"segments[{i}]: min_p {s.min_p} outside 0..1")
        if s.score and (len(s.score) > s.n_logits or not s.flags & SEG_LOGPROBS):
            raise Invalid(ErrorCode.BAD_SHAPE, f"segments[{i}]: {len(s.score)} scored rows of "
                                               f"{s.n_logits} logit rows, or without SEG_LOGPROBS")
        rows += s.n_rows
        if s.flags >> SEG_TOP_SHIFT > (MAX_TOP_LOGPROBS if s.flags & SEG_LOGPROBS else 0):
            raise Invalid(ErrorCode.BAD_FIELD, f"segments[{i}]: flags {s.flags:#x} ask for too many logprobs")
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
    """Tokens sampled for one session: the accepted drafts plus the bonus token.

    With SEG_LOGPROBS: ``logprobs`` has one value per token, and ``top_ids`` /
    ``top_logprobs`` the same number of alternatives per token, flattened (else all empty).
    ``scored`` (``scored_top_ids``, ``scored_top_logprobs``): the same for the segment's
    ``score`` tokens, one value per scored row; ``tokens`` is empty when no row was sampled.
    """

    session: int = wf(U64)
    tokens: tuple[int, ...] = wf(IntList("H", U32, 0xFFFF))
    n_accepted: int = wf(U32)
    n_drafted: int = wf(U32)
    logprobs: tuple[float, ...] = wf(IntList("B", F32, MAX_VERIFY_WINDOW + 1), default=())
    top_ids: tuple[int, ...] = wf(IntList("H", U32, (MAX_VERIFY_WINDOW + 1) * MAX_TOP_LOGPROBS), default=())
    top_logprobs: tuple[float, ...] = wf(IntList("H", F32, (MAX_VERIFY_WINDOW + 1) * MAX_TOP_LOGPROBS),
                                         default=())
    scored: tuple[float, ...] = wf(IntList("I", F32, MAX_SCORED), default=())
    scored_top_ids: tuple[int, ...] = wf(IntList("I", U32, MAX_SCORED * MAX_TOP_LOGPROBS), default=())
    scored_top_logprobs: tuple[float, ...] = wf(IntList("I", F32, MAX_SCORED * MAX_TOP_LOGPROBS), default=())


def _check_logprobs(i: int, what: str, n: int, lps: tuple[float, ...], top_ids: tuple[int, ...],
                    top_lps: tuple[float, ...]) -> None:
    """``lps``: none, or one logprob per one of ``n`` tokens with as many alternatives each."""
    if not lps:
        if top_ids or top_lps:
            raise Invalid(ErrorCode.BAD_SHAPE, f"results[{i}]: alternatives without {what}")
        return
    k = len(lps)
    if k != n or len(top_ids) != len(top_lps) or len(top_ids) % k or len(top_ids) // k > MAX_TOP_LOGPROBS:
        raise Invalid(ErrorCode.BAD_SHAPE, f"results[{i}]: {what} do not match its {n} tokens")
    # a log-probability is <= 0 (-inf allowed: a token the model rules out)
    if not all(v <= 0.0 for v in lps) or not all(v <= 0.0 for v in top_lps):
        raise Invalid(ErrorCode.BAD_FIELD, f"results[{i}]: a logprob is NaN or positive")


def _check_token_return(m: TokenReturn) -> None:
    for i, r in enumerate(m.results):
        _check_logprobs(i, "logprobs", len(r.tokens), r.logprobs, r.top_ids, r.top_logprobs)
        # (the number of scored rows is the step's: stage 0 checks it against what it sent)
        _check_logprobs(i, "scored", len(r.scored), r.scored, r.scored_top_ids, r.scored_top_logprobs)


@message(MessageKind.TOKEN_RETURN, _check_token_return)
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


def _check_session_copy(m: SessionCopy) -> None:
    if m.src == m.dst or not m.src or not m.dst:
        raise Invalid(ErrorCode.BAD_FIELD, f"session copy {m.src:x} -> {m.dst:x}")


@message(MessageKind.SESSION_COPY, _check_session_copy)
@dataclass(frozen=True, slots=True)
class SessionCopy:
    """Share the KV of ``src`` at positions [0, n_pos) with the new session ``dst`` (a
    request with several choices prefills its prompt once). Travels stage to stage on
    the data stream behind the prefill it copies, so every stage holds that prefill
    first; a stage applies it, then passes it downstream."""

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    src: int = wf(U64)
    dst: int = wf(U64)
    n_pos: int = wf(U32)


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


@record
@dataclass(frozen=True, slots=True)
class MaskRow:
    """One logit row's allowed tokens: ``MASK_BITSET`` (u32 words, bit ``t % 32`` of word
    ``t // 32``) or ``MASK_IDS`` (the allowed ids, u32 each, when fewer are allowed)."""

    form: int = wf(U8)
    data: bytes = wf(BYTES)


def _check_grammar_mask(m: GrammarMask) -> None:
    if not 1 <= m.n_vocab <= MAX_MASK_VOCAB:
        raise Invalid(ErrorCode.BAD_FIELD, f"n_vocab {m.n_vocab} out of 1..{MAX_MASK_VOCAB}")
    if not 1 <= len(m.rows) <= MAX_VERIFY_WINDOW + 1:
        raise Invalid(ErrorCode.BAD_FIELD, f"{len(m.rows)} mask rows, expected 1..{MAX_VERIFY_WINDOW + 1}")
    words = (m.n_vocab + 31) // 32
    for i, r in enumerate(m.rows):
        if r.form == MASK_BITSET:
            if len(r.data) != 4 * words:
                raise Invalid(ErrorCode.BAD_SHAPE, f"rows[{i}]: {len(r.data)} bytes, a bitset of {m.n_vocab} is {4 * words}")
        elif r.form == MASK_IDS:
            if len(r.data) % 4 or len(r.data) > 4 * m.n_vocab:
                raise Invalid(ErrorCode.BAD_SHAPE, f"rows[{i}]: {len(r.data)} bytes is no list of token ids")
            ids = np.frombuffer(r.data, dtype="<u4")
            if ids.size and int(ids.max()) >= m.n_vocab:
                raise Invalid(ErrorCode.BAD_FIELD, f"rows[{i}]: token id {int(ids.max())} >= n_vocab {m.n_vocab}")
        else:
            raise Invalid(ErrorCode.BAD_FIELD, f"rows[{i}]: unknown form {r.form}")


@message(MessageKind.GRAMMAR_MASK, _check_grammar_mask)
@dataclass(frozen=True, slots=True)
class GrammarMask:
    """The allowed tokens of each logit row of one session's segment in batch
    ``batch_id``. Stage 0 sends it on the data stream right before that Forward; every
    stage relays it downstream in order; the final stage applies it before sampling the
    segment (flagged ``SEG_MASKED``)."""

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    batch_id: int = wf(U64)
    session: int = wf(U64)
    n_vocab: int = wf(U32)
    rows: tuple[MaskRow, ...] = wf(Records(MaskRow))

    @staticmethod
    def pack(batch_id: int, session: int, mask: np.ndarray, n_vocab: int) -> GrammarMask:
        """From ``(rows, words)`` uint32 bitsets: each row as a bitset or, when shorter,
        its allowed ids."""
        rows = []
        for row in np.ascontiguousarray(mask, dtype="<u4"):
            bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:n_vocab]
            n = int(bits.sum())
            if n < row.shape[0]:
                rows.append(MaskRow(MASK_IDS, np.flatnonzero(bits).astype("<u4").tobytes()))
            else:
                rows.append(MaskRow(MASK_BITSET, row.tobytes()))
        return GrammarMask(ref=0, batch_id=batch_id, session=session, n_vocab=n_vocab, rows=tuple(rows))

    def unpack(self) -> np.ndarray:
        """``(rows, words)`` uint32 bitsets."""
        words = (self.n_vocab + 31) // 32
        out = np.zeros((len(self.rows), words), dtype=np.uint32)
        for i, r in enumerate(self.rows):
            if r.form == MASK_BITSET:
                out[i] = np.frombuffer(r.data, dtype="<u4")
            else:
                ids = np.frombuffer(r.data, dtype="<u4").astype(np.int64)
                np.bitwise_or.at(out[i], ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
        return out
# ------------------------------------------------------------- the mesh-wide endpoint
# A coordinator tells its members which models it serves (ModelsServed, replacing its last
# list); any member may then carry an OpenAI request for one of them to it (ApiRequest on
# a data stream of its own), which the coordinator answers on the same stream key with
# ApiResponseStart and ApiResponseBody frames; ApiCancel ends it early (docs/protocol.md).

MAX_SERVED_MODELS = 16          # models one coordinator may list
MAX_MODEL_NAME_LEN = 128
MAX_CAPABILITIES_LEN = 256     # a ServedModel's feature names, comma-separated
MAX_API_BODY = 16 << 20         # a forwarded request's body (the HTTP cap is --max-body)
MAX_API_QUERY = 8 << 10         # a forwarded GET's query string (its body on the wire)
MAX_API_CHUNK = 64 << 10        # one ApiResponseBody's data
MAX_API_HEADERS = 16
MAX_HEADER_NAME_LEN = 64
MAX_HEADER_VALUE_LEN = 256
# The only routes a member can reach on a coordinator through the mesh: the ones that
# take a model. Anything else (/status, /v1/models ...) is not even encodable.
API_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/completion", "/infill", "/tokenize",
             "/detokenize", "/tokenizer_info")
# those whose body may leave ``model`` out (llama.cpp serves one model): the node's own
API_MODEL_OPTIONAL = ("/completion", "/infill", "/tokenize", "/detokenize", "/tokenizer_info")
# GET routes: an ApiRequest's ``body`` is then the URL's query string (``model=...``)
API_GET_PATHS = ("/tokenizer_info",)


@record
@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model a coordinator serves now: its id, context length, creation time and
    what it supports (feature names of /v1/models' ``capabilities``, comma-separated)."""

    name: str = wf(STR)
    n_ctx: int = wf(U32)
    created: int = wf(U64)
    capabilities: str = wf(STR, default="")


def _check_models_served(m: "ModelsServed") -> None:
    if len(m.models) > MAX_SERVED_MODELS:
        raise Invalid(ErrorCode.BAD_FIELD, f"{len(m.models)} models (at most {MAX_SERVED_MODELS})")
    for i, sm in enumerate(m.models):
        if not 0 < len(sm.name) <= MAX_MODEL_NAME_LEN:
            raise Invalid(ErrorCode.BAD_FIELD, f"models[{i}].name of {len(sm.name)} characters "
                                               f"(1 to {MAX_MODEL_NAME_LEN})")
        if len(sm.capabilities) > MAX_CAPABILITIES_LEN:
            raise Invalid(ErrorCode.BAD_FIELD, f"models[{i}].capabilities of {len(sm.capabilities)} "
                                               f"characters (at most {MAX_CAPABILITIES_LEN})")


@message(MessageKind.MODELS_SERVED, _check_models_served)
@dataclass(frozen=True, slots=True)
class ModelsServed:
    """The models I coordinate and serve now (all of them: replaces my last list); no reply."""

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    models: tuple[ServedModel, ...] = wf(Records(ServedModel))


def _check_request_id(m: Any) -> None:
    if m.request_id == 0:
        raise Invalid(ErrorCode.BAD_FIELD, "request_id 0")


def _check_api_request(m: "ApiRequest") -> None:
    _check_request_id(m)
    limit = MAX_API_QUERY if m.path in API_GET_PATHS else MAX_API_BODY
    if len(m.body) > limit:
        raise Invalid(ErrorCode.BAD_FIELD, f"body of {len(m.body)} bytes (at most {limit} for {m.path})")


@message(MessageKind.API_REQUEST, _check_api_request)
@dataclass(frozen=True, slots=True)
class ApiRequest:
    """POST ``body`` (JSON) to ``path`` of your OpenAI endpoint for me (for a path of
    ``API_GET_PATHS``: GET it with ``body`` as the query string); answer on the data
    stream this came on with ApiResponseStart, then ApiResponseBody frames."""

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    request_id: int = wf(U64)
    path: str = wf(StrField(API_PATHS))
    body: bytes = wf(BYTES)


@record
@dataclass(frozen=True, slots=True)
class ApiHeader:
    name: str = wf(STR)
    value: str = wf(STR)


def _check_api_start(m: "ApiResponseStart") -> None:
    _check_request_id(m)
    if not 100 <= m.status <= 599:
        raise Invalid(ErrorCode.BAD_FIELD, f"HTTP status {m.status}")
    if len(m.headers) > MAX_API_HEADERS:
        raise Invalid(ErrorCode.BAD_FIELD, f"{len(m.headers)} headers (at most {MAX_API_HEADERS})")
    for i, h in enumerate(m.headers):
        if not (0 < len(h.name) <= MAX_HEADER_NAME_LEN and h.name.isascii()
                and all(c.isalnum() or c == "-" for c in h.name)):
            raise Invalid(ErrorCode.BAD_FIELD, f"headers[{i}]: bad name")
        if len(h.value) > MAX_HEADER_VALUE_LEN or not h.value.isprintable():
            raise Invalid(ErrorCode.BAD_FIELD, f"headers[{i}]: bad value")


@message(MessageKind.API_RESPONSE_START, _check_api_start)
@dataclass(frozen=True, slots=True)
class ApiResponseStart:
    """The HTTP status and headers of the answer to ApiRequest ``request_id``."""

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    request_id: int = wf(U64)
    status: int = wf(U16)
    headers: tuple[ApiHeader, ...] = wf(Records(ApiHeader))


def _check_api_body(m: "ApiResponseBody") -> None:
    _check_request_id(m)
    if len(m.data) > MAX_API_CHUNK:
        raise Invalid(ErrorCode.BAD_FIELD, f"data of {len(m.data)} bytes (at most {MAX_API_CHUNK})")


@message(MessageKind.API_RESPONSE_BODY, _check_api_body)
@dataclass(frozen=True, slots=True)
class ApiResponseBody:
    """Body bytes of the answer, in order; ``more=False`` ends the answer."""

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    request_id: int = wf(U64)
    data: bytes = wf(BYTES)
    more: bool = wf(BOOL)


@message(MessageKind.API_CANCEL, _check_request_id)
@dataclass(frozen=True, slots=True)
class ApiCancel:
    """My client went away: stop serving ApiRequest ``request_id`` and free what it holds."""

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    request_id: int = wf(U64)
MAX_SHA256_LEN = 64
SHARE_TICKET_LEN = 32
MAX_SHARE_TICKETS = 4        # parallel connections one ticket answer allows
MAX_MANIFEST_CHUNKS = 1 << 17   # 1 TiB in 8 MiB chunks (meshnode.models.transfer bounds it again)


def _check_share_request(m: "ShareRequest") -> None:
    if len(m.model_sha256) > MAX_SHA256_LEN:
        raise Invalid(ErrorCode.BAD_FIELD, f"model_sha256 of {len(m.model_sha256)} characters")
    if not m.whole:
        _check_layers(m)


@message(MessageKind.SHARE_REQUEST, _check_share_request)
@dataclass(frozen=True, slots=True)
class ShareRequest:
    """Ask a holder for the whole model ``model_sha256`` (``whole``) or for the layer package
    of blocks [layer_start, layer_end). Answered by :class:`ShareTicket` or ``Error``."""

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    model_sha256: str = wf(STR)
    whole: bool = wf(BOOL)
    layer_start: int = wf(U32)
    layer_end: int = wf(U32)


def _check_share_ticket(m: "ShareTicket") -> None:
    if len(m.cert_sha256) != 32:
        raise Invalid(ErrorCode.BAD_FIELD, f"cert_sha256 of {len(m.cert_sha256)} bytes, expected 32")
    n, rest = divmod(len(m.tickets), SHARE_TICKET_LEN)
    if rest or not 1 <= n <= MAX_SHARE_TICKETS:
        raise Invalid(ErrorCode.BAD_FIELD, f"tickets of {len(m.tickets)} bytes")
    chunks = m.manifest.get("chunks") if isinstance(m.manifest, dict) else None
    if not isinstance(chunks, list) or len(chunks) > MAX_MANIFEST_CHUNKS:
        raise Invalid(ErrorCode.BAD_FIELD, "manifest without a bounded chunk list")
    if len(m.name) > MAX_NAME_LEN * 4:
        raise Invalid(ErrorCode.BAD_FIELD, f"name of {len(m.name)} characters")


@message(MessageKind.SHARE_TICKET, _check_share_ticket)
@dataclass(frozen=True, slots=True)
class ShareTicket:
    """Fetch it over the bulk channel: TLS to TCP ``port`` whose certificate has SHA-256
    ``cert_sha256``, presenting one of ``tickets`` (32 bytes each, single-use) per
    connection. ``manifest``: size, sha256, chunk_size, chunks (meshnode.models.transfer)."""

    KIND: ClassVar[MessageKind]
    ref: int = wf(U32)
    port: int = wf(U16)
    cert_sha256: bytes = wf(BYTES)
    tickets: bytes = wf(BYTES)
    manifest: dict[str, Any] = wf(JSON)
    name: str = wf(STR)


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
    | SessionCopy
    | DataError
    | CapsUpdate
    | SecretRotate
    | SecretAck
    | GrammarMask
    | ModelsServed
    | ApiRequest
    | ApiResponseStart
    | ApiResponseBody
    | ApiCancel
    | ShareRequest
    | ShareTicket
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
