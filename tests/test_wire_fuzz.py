"""meshnode.wire properties: every message round-trips; no input makes the decoder raise."""

from __future__ import annotations

import dataclasses

import struct

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from meshnode.wire import (
    HEADER_SIZE,
    API_PATHS,
    ApiCancel,
    ApiHeader,
    ApiRequest,
    ApiResponseBody,
    ApiResponseStart,
    ModelsServed,
    ServedModel,
    AuthChallenge,
    AuthProof,
    AuthResult,
    CapsUpdate,
    Claim,
    DataError,
    GrammarMask,
    DecoderState,
    Error,
    ErrorCode,
    Forward,
    FrameDecoder,
    Heartbeat,
    Hello,
    Inventory,
    LaneKey,
    Profile,
    Load,
    LocalProtocolError,
    MessageKind,
    Prepare,
    Ready,
    RemoteProtocolError,
    SecretAck,
    SecretRotate,
    Segment,
    SegmentResult,
    SessionCopy,
    SessionEnd,
    ShareRequest,
    ShareTicket,
    StageStatus,
    Status,
    Stop,
    TokenReturn,
    Trim,
    WireError,
    decode_message,
    encode,
)

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

u8 = st.integers(0, 2**8 - 1)
u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)
f32 = st.floats(width=32, allow_nan=False)
f64 = st.floats(allow_nan=False)
text = st.text(max_size=24)
codes = st.sampled_from(ErrorCode)
json_scalar = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | text
json_value = st.recursive(json_scalar, lambda v: st.lists(v, max_size=3) | st.dictionaries(text, v, max_size=3), max_leaves=8)


@st.composite
def layer_range(draw: st.DrawFn) -> tuple[int, int, int]:
    a, b, total = sorted(draw(st.lists(st.integers(0, 200), min_size=3, max_size=3)))
    return a, b, total


@st.composite
def share_requests(draw: st.DrawFn) -> ShareRequest:
    a, b, _ = draw(layer_range())
    return ShareRequest(draw(u32), draw(text), draw(st.booleans()), a, b)


@st.composite
def prepares(draw: st.DrawFn) -> Prepare:
    a, b, total = draw(layer_range())
    return Prepare(draw(u32), draw(u64), draw(text), draw(text), a, b, total)


@st.composite
def inventories(draw: st.DrawFn) -> Inventory:
    a, b, _ = draw(layer_range())
    return Inventory(draw(u32), draw(u64), draw(text), a, b, draw(st.booleans()), draw(f64), draw(text))


@st.composite
def loads(draw: st.DrawFn) -> Load:
    a, b, _ = draw(layer_range())
    return Load(
        draw(u32), draw(u64), draw(text), a, b, draw(text), draw(text), draw(text),
        draw(st.sampled_from(["f32", "f16"])), draw(u32), draw(u32), draw(u32),
    )  # fmt: skip


@st.composite
def forwards(draw: st.DrawFn) -> Forward:
    rows = draw(st.lists(st.integers(0, 4), max_size=4))
    segs = []
    for n in rows:
        seg = Segment(
            draw(u64), draw(u32), n, draw(st.integers(0, n)), tuple(draw(st.lists(u32, max_size=32))),
            # any flags the check admits: the logprob count only with SEG_LOGPROBS, <= 20
            draw(f32), draw(i32), draw(f32), draw(u64), draw(u8.filter(lambda f: f >> 3 <= (20 if f & 2 else 0))),
        )  # fmt: skip
        if seg.flags & 2 and draw(st.booleans()):   # scored prompt tokens: at most n_logits
            seg = dataclasses.replace(seg, score=tuple(draw(st.lists(u32, max_size=seg.n_logits))))
        segs.append(seg)
    segs = tuple(segs)
    dtype = draw(st.sampled_from([np.float32, np.float16]))
    width = draw(st.integers(1, 9))
    # any bit pattern, NaNs and infinities included: the wire must carry them exactly
    act = draw(hnp.arrays(dtype, (sum(rows), width), elements=st.floats(width=np.dtype(dtype).itemsize * 8)))
    return Forward(draw(u32), draw(u64), draw(u32), segs, act)


@st.composite
def results(draw: st.DrawFn) -> SegmentResult:
    tokens = tuple(draw(st.lists(u32, max_size=33)))
    if not tokens or draw(st.booleans()):
        return SegmentResult(draw(u64), tokens, draw(u32), draw(u32))
    logprob = st.floats(max_value=0.0, width=32)

    def lists(count: int) -> tuple[tuple, tuple, tuple]:
        k = draw(st.integers(0, 20))
        n = k * count
        return (tuple(draw(st.lists(logprob, min_size=count, max_size=count))),
                tuple(draw(st.lists(u32, min_size=n, max_size=n))), tuple(draw(st.lists(logprob, min_size=n, max_size=n))))

    scored = lists(draw(st.integers(0, 40))) if draw(st.booleans()) else ((), (), ())
    return SegmentResult(draw(u64), tokens, draw(u32), draw(u32), *lists(len(tokens)), *scored)


messages = st.one_of(
    st.builds(Hello, u32, text, text, text, u16, st.dictionaries(text, json_value, max_size=4)),
    st.builds(AuthChallenge, u32, st.binary(max_size=64)),
    st.builds(AuthProof, u32, st.binary(max_size=64)),
    st.builds(AuthResult, u32, st.booleans(), text),
    st.builds(Heartbeat, u32, u64, u64, st.booleans()),
    st.builds(LaneKey, u32, u32, st.binary(min_size=16, max_size=16)),
    st.builds(Profile, u32, text, st.dictionaries(text, json_value, max_size=4)),
    st.builds(Claim, u32, u64, text, text, u32),
    prepares(),
    inventories(),
    loads(),
    st.builds(Ready, u32, u64, u32, u32, f64),
    st.builds(Stop, u32, u64, text),
    st.builds(Status, u32, u64, st.sampled_from(StageStatus), text, f64),
    st.builds(Error, u32, codes, text),
    forwards(),
    st.builds(TokenReturn, u32, u64, st.lists(results(), max_size=4).map(tuple)),
    st.builds(Trim, u32, u64, u32),
    st.builds(SessionEnd, u32, u64),
    st.builds(SessionCopy, u32, u64.filter(bool), u64.filter(bool), u32).filter(lambda m: m.src != m.dst),
    st.builds(DataError, u32, u64, u64, codes, text),
    st.builds(CapsUpdate, u32, st.dictionaries(text, json_value, max_size=4)),
    st.builds(SecretRotate, u32, st.binary(min_size=32, max_size=32)),
    st.builds(SecretAck, u32, text),
    st.builds(lambda b, sess, m: GrammarMask.pack(b, sess, np.asarray(m, dtype=np.uint32), 32 * len(m[0])),
              u64, u64, st.integers(1, 4).flatmap(lambda w: st.lists(
                  st.lists(st.integers(0, 2**32 - 1), min_size=w, max_size=w), min_size=1, max_size=33))),
    st.builds(ModelsServed, u32, st.lists(st.builds(ServedModel, st.text(min_size=1, max_size=24), u32, u64, st.text(max_size=40)),
                                          max_size=16).map(tuple)),
    st.builds(ApiRequest, u32, u64.filter(bool), st.sampled_from(API_PATHS), st.binary(max_size=64)),
    st.builds(ApiResponseStart, u32, u64.filter(bool), st.integers(100, 599),
              st.lists(st.builds(ApiHeader, st.sampled_from(["content-type", "retry-after", "x-a"]),
                                 st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20)),
                       max_size=4).map(tuple)),
    st.builds(ApiResponseBody, u32, u64.filter(bool), st.binary(max_size=64), st.booleans()),
    st.builds(ApiCancel, u32, u64.filter(bool)),
    share_requests(),
    st.builds(ShareTicket, u32, u16, st.binary(min_size=32, max_size=32),
              st.integers(1, 4).map(lambda n: b"t" * (32 * n)),
              st.lists(text, max_size=3).map(lambda c: {"chunks": c, "size": 1}), text),
)


def same(a: object, b: object) -> bool:
    """Equality, and bit equality for activations (NaN payloads, -0.0)."""
    if isinstance(a, Forward) and isinstance(b, Forward):
        return (
            (a.ref, a.batch_id, a.step, a.segments) == (b.ref, b.batch_id, b.step, b.segments)
            and a.act.dtype == b.act.dtype
            and a.act.shape == b.act.shape
            and a.act.tobytes() == b.act.tobytes()
        )
    return a == b


def test_every_kind_has_a_strategy():
    # one_of keeps its branches; make sure none of the kinds was forgotten
    kinds = {
        Hello, AuthChallenge, AuthProof, AuthResult, Heartbeat, LaneKey, Profile, Claim, Prepare, Inventory, Load,
        Ready, Stop, Status, Error, Forward, TokenReturn, Trim, SessionEnd, SessionCopy, DataError,
        CapsUpdate, SecretRotate, SecretAck, GrammarMask,
        ModelsServed, ApiRequest, ApiResponseStart, ApiResponseBody, ApiCancel, ShareRequest, ShareTicket,
    }  # fmt: skip
    assert {k.KIND for k in kinds} == set(MessageKind)


@FUZZ
@given(messages, st.data())
def test_round_trip_whole_bytewise_and_with_trailing_data(msg, data):
    wire = encode(msg)
    [got] = FrameDecoder().feed(wire)
    assert same(got, msg)
    assert type(got).KIND == struct.unpack_from("<H", wire, 4)[0]
    assert encode(got) == wire  # canonical: decoding then encoding gives the same bytes

    dec = FrameDecoder()
    events = []
    for i in range(len(wire)):
        events += dec.feed(wire[i : i + 1])
    assert len(events) == 1 and same(events[0], msg)

    # split at random points, followed by a second copy and a partial third
    cut = data.draw(st.integers(0, len(wire)))
    tail = data.draw(st.integers(0, len(wire) - 1))
    dec = FrameDecoder()
    events = dec.feed(wire[:cut]) + dec.feed(wire[cut:] + wire + wire[:tail])
    assert len(events) == 2 and all(same(e, msg) for e in events)
    assert dec.pending == tail and dec.state is DecoderState.OPEN


def _no_crash(events: list) -> None:
    for e in events:
        if isinstance(e, WireError):
            assert e.code is not ErrorCode.INTERNAL, e
        else:
            encode(e)  # whatever decodes is a valid message


@FUZZ
@given(st.binary(max_size=200), st.integers(1, 16))
def test_random_bytes_never_raise(data, chunk):
    dec = FrameDecoder()
    events = []
    for i in range(0, len(data), chunk):
        events += dec.feed(data[i : i + chunk])
    events += dec.feed_eof()
    _no_crash(events)
    assert dec.state is not DecoderState.OPEN


@FUZZ
@given(st.sampled_from(sorted(MessageKind) + [0, 0x0200, 0xFFFF]), st.binary(max_size=120))
def test_random_payloads_of_every_kind(kind, payload):
    try:
        msg = decode_message(kind, payload)
    except RemoteProtocolError as e:
        assert e.code is not ErrorCode.INTERNAL
    else:
        encode(msg)
    wire = struct.pack("<2sBBHI", b"MN", 1, 0, kind, len(payload)) + payload
    events = FrameDecoder().feed(wire + encode(Trim(1, 2, 3)))
    assert len(events) == 2 and events[1] == Trim(1, 2, 3)  # a bad payload never desynchronises
    _no_crash(events)


@FUZZ
@given(messages, st.data())
def test_mutated_payloads_decode_or_error(msg, data):
    payload = bytearray(encode(msg)[HEADER_SIZE:])
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        at = data.draw(st.integers(0, max(len(payload) - 1, 0)))
        if op == "flip" and payload:
            payload[at] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "insert":
            payload[at:at] = data.draw(st.binary(min_size=1, max_size=4))
        elif op == "delete" and payload:
            del payload[at]
        elif op == "truncate":
            del payload[at:]
    wire = struct.pack("<2sBBHI", b"MN", 1, 0, msg.KIND, len(payload)) + bytes(payload)
    events = FrameDecoder().feed(wire + encode(Trim(1, 2, 3)))
    assert len(events) == 2 and events[1] == Trim(1, 2, 3)
    _no_crash(events)


@FUZZ
@given(messages, st.integers(0, 2**32 - 1))
def test_lying_length_prefix(msg, length):
    wire = bytearray(encode(msg))
    wire[6:10] = struct.pack("<I", length)
    dec = FrameDecoder(max_frame=1 << 16)
    events = dec.feed(bytes(wire))
    _no_crash(events)
    if length > 1 << 16:
        assert [e.code for e in events] == [ErrorCode.OVERSIZE] and dec.state is DecoderState.ERROR


@settings(max_examples=50, deadline=None)
@given(hnp.arrays(np.float16, st.tuples(st.integers(1, 8), st.integers(1, 64)), elements=st.floats(width=16)))
def test_f16_activations_round_trip_exactly(act):
    segs = (Segment(1, 0, act.shape[0], 1, (), 0.0, 0, 1.0, 0, 0),)
    [got] = FrameDecoder().feed(encode(Forward(0, 0, 0, segs, act)))
    assert got.act.dtype == np.float16 and got.act.tobytes() == act.tobytes()


def test_f32_fields_round_to_float32():
    # documented: temperature/top_p are f32 on the wire
    seg = Segment(1, 0, 1, 1, (), 0.1, 0, 0.9, 0, 0)
    [got] = FrameDecoder().feed(encode(Forward(0, 0, 0, (seg,), np.zeros((1, 1), np.float32))))
    assert got.segments[0].temperature == float(np.float32(0.1))
    assert got.segments[0].top_p == float(np.float32(0.9))


def test_encoding_errors_are_local_never_remote():
    try:
        encode(Trim(0, -5, 0))
    except LocalProtocolError as e:
        assert e.code is ErrorCode.BAD_FIELD
    else:
        raise AssertionError("expected LocalProtocolError")
