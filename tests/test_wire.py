"""meshnode.wire: golden vectors, decoder behaviour, errors and the decode template."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest

from meshnode.errors import MeshnodeError
from meshnode.wire import (
    HEADER_SIZE,
    MAX_FRAME,
    PROTOCOL_VERSION,
    SEG_LOGPROBS,
    AuthResult,
    DecodeTemplate,
    DecoderState,
    Error,
    ErrorCode,
    Forward,
    FrameDecoder,
    Heartbeat,
    Hello,
    Load,
    LocalProtocolError,
    MessageKind,
    Prepare,
    RemoteProtocolError,
    Segment,
    SegmentResult,
    TokenReturn,
    Trim,
    WireError,
    check_peer_version,
    decode,
    decode_message,
    encode,
)

# --------------------------------------------------------------------------- helpers


def frame(kind: int, payload: bytes, *, magic: bytes = b"MN", version: int = 1, flags: int = 0) -> bytes:
    return struct.pack("<2sBBHI", magic, version, flags, kind, len(payload)) + payload


def tr(data: bytes, expected: list) -> None:
    """Feed ``data`` whole, one byte at a time, and followed by a partial frame (h11 style)."""
    assert FrameDecoder().feed(data) == expected
    dec = FrameDecoder()
    events = []
    for i in range(len(data)):
        events += dec.feed(data[i : i + 1])
    assert events == expected
    assert dec.pending == 0
    partial = encode(Heartbeat(1, 2, 3, False))[:-3]
    dec = FrameDecoder()
    assert dec.feed(data + partial) == expected
    assert dec.pending == len(partial)
    assert dec.state is DecoderState.OPEN


SEG = Segment(session=4, pos=5, n_rows=1, n_logits=1, drafts=(6,), temperature=0.5, top_k=-1, top_p=1.0, seed=7, flags=0)


# ---------------------------------------------------------------------- golden vectors


GOLDEN = [
    (
        Heartbeat(ref=7, seq=1, sent_ns=2, echo=True),
        # magic  ver flg kind  length    | ref      seq              sent_ns          echo
        "4d4e 01 00 0500 15000000" "07000000 0100000000000000 0200000000000000 01",
    ),
    (
        Error(ref=3, code=ErrorCode.FENCED, message="stale"),
        # kind 0x1f, length 15 | ref | code 11 | len 5 "stale"
        "4d4e 01 00 1f00 0f000000" "03000000 0b00 05000000 7374616c65",
    ),
    (
        Hello(ref=1, node_id="n1", name="", mesh_id="m", protocol=1, capabilities={"b": 1, "a": True}),
        # length 41; JSON is canonical: sorted keys, no spaces -> {"a":true,"b":1} (16 bytes)
        "4d4e 01 00 0100 29000000" "01000000 02000000 6e31 00000000 01000000 6d 0100"
        "10000000 7b2261223a747275652c2262223a317d",
    ),
    (
        Forward(ref=1, batch_id=2, step=3, segments=(SEG,), act=np.array([[1.0, -2.0]], np.float16)),
        # kind 0x100, length 116
        "4d4e 01 00 0001 74000000"
        "01000000 0200000000000000 03000000"  # ref, batch_id, step
        "0100"  # one segment
        "0400000000000000 05000000 01000000 0100"  # session, pos, n_rows, n_logits
        "01 06000000"  # one draft: 6
        "0000003f ffffffff 0000803f 0700000000000000 00"  # temp 0.5, top_k -1, top_p 1.0, seed, flags
        "0000 0000"  # no logit bias (counts of ids and values)
        "00000000 00000000 00000000 00000000"  # no penalties: presence, frequency, no counts
        "00000000"  # min_p 0
        "00000000"  # no scored prompt tokens
        "0000803f 00000000 00000000"  # no repetition penalty: repeat 1.0, repeat_last_n 0, no recent tokens
        "02 01000000 02000000"  # dtype f16, rows 1, width 2 (frame offset 110)
        "00"  # pad to frame offset 120
        "003c 00c0",  # 1.0, -2.0 as f16
    ),
]


@pytest.mark.parametrize("msg,hexstr", GOLDEN, ids=lambda x: type(x).__name__ if not isinstance(x, str) else "")
def test_golden_vectors(msg, hexstr):
    data = bytes.fromhex(hexstr.replace(" ", ""))
    assert encode(msg) == data
    assert decode(data) == msg
    tr(data, [msg])


def test_frame_header_is_little_endian_and_sized():
    data = encode(Trim(ref=0x01020304, session=1, pos=2))
    assert data[:2] == b"MN" and data[2] == 1 and data[3] == 0
    assert data[4:6] == MessageKind.TRIM.to_bytes(2, "little")
    assert int.from_bytes(data[6:10], "little") == len(data) - HEADER_SIZE
    assert data[10:14] == bytes([4, 3, 2, 1])


# ----------------------------------------------------------------------- the decoder


def test_several_frames_mixed_with_errors_in_order():
    good1 = encode(Trim(1, 2, 3))
    unknown = frame(0x7777, b"\x09\x00\x00\x00junk")
    good2 = encode(AuthResult(2, False, "no"))
    data = good1 + unknown + good2
    expected = [
        Trim(1, 2, 3),
        WireError(ErrorCode.UNKNOWN_KIND, "unknown frame kind 0x7777", ref=9, kind=0x7777),
        AuthResult(2, False, "no"),
    ]
    tr(data, expected)


def test_oversize_length_is_fatal_and_decoder_stays_in_error():
    dec = FrameDecoder()
    good = encode(Trim(1, 2, 3))
    bad = struct.pack("<2sBBHI", b"MN", 1, 0, MessageKind.FORWARD, MAX_FRAME + 1)
    events = dec.feed(good + bad + good)
    assert events[0] == Trim(1, 2, 3)
    assert len(events) == 2
    err = events[1]
    assert isinstance(err, WireError) and err.code is ErrorCode.OVERSIZE and err.fatal
    assert err.kind == MessageKind.FORWARD
    assert dec.state is DecoderState.ERROR and dec.error == err
    assert dec.feed(good) == []
    assert dec.feed_eof() == []


def test_length_exactly_at_cap_is_accepted_by_a_small_decoder():
    payload = encode(Trim(1, 2, 3))[HEADER_SIZE:]
    dec = FrameDecoder(max_frame=len(payload))
    assert dec.feed(encode(Trim(1, 2, 3))) == [Trim(1, 2, 3)]
    dec = FrameDecoder(max_frame=len(payload) - 1)
    [err] = dec.feed(encode(Trim(1, 2, 3)))
    assert err.code is ErrorCode.OVERSIZE and dec.state is DecoderState.ERROR


def test_oversize_detected_from_header_alone():
    # the decoder must not wait for (or allocate) 4 GiB before refusing
    dec = FrameDecoder()
    [err] = dec.feed(struct.pack("<2sBBHI", b"MN", 1, 0, 1, 0xFFFFFFFF))
    assert err.code is ErrorCode.OVERSIZE


@pytest.mark.parametrize(
    "data,code",
    [
        (b"XY" + bytes(8), ErrorCode.BAD_MAGIC),
        (b"GET / HTTP/1.1\r\n", ErrorCode.BAD_MAGIC),
        (frame(1, b"", version=2), ErrorCode.BAD_VERSION),
    ],
)
def test_framing_errors_are_fatal(data, code):
    dec = FrameDecoder()
    events = []
    for i in range(len(data)):
        events += dec.feed(data[i : i + 1])
    assert [e.code for e in events] == [code]
    assert events[0].fatal and dec.state is DecoderState.ERROR
    assert dec.feed(encode(Trim(1, 2, 3))) == []


def test_unknown_flags_are_ignored():
    data = encode(Trim(1, 2, 3))
    data = data[:3] + b"\x80" + data[4:]
    assert FrameDecoder().feed(data) == [Trim(1, 2, 3)]


def test_truncated_payload_is_an_error_and_decoding_continues():
    good = encode(Heartbeat(5, 1, 2, False))
    short = frame(MessageKind.HEARTBEAT, good[HEADER_SIZE:-1])  # well framed, one byte short
    events = FrameDecoder().feed(short + good)
    assert isinstance(events[0], WireError) and events[0].code is ErrorCode.TRUNCATED
    assert events[0].ref == 5 and not events[0].fatal
    assert events[1] == Heartbeat(5, 1, 2, False)


def test_trailing_bytes_in_payload_are_refused():
    good = encode(Trim(1, 2, 3))
    long = frame(MessageKind.TRIM, good[HEADER_SIZE:] + b"\x00")
    [err] = FrameDecoder().feed(long)
    assert err.code is ErrorCode.BAD_FIELD


def test_stream_ending_inside_a_frame():
    data = encode(Trim(77, 2, 3))
    for cut in (1, HEADER_SIZE, HEADER_SIZE + 5, len(data) - 1):
        dec = FrameDecoder()
        assert dec.feed(data[:cut]) == []
        assert dec.pending == cut
        [err] = dec.feed_eof()
        assert err.code is ErrorCode.TRUNCATED and err.fatal
        assert err.ref == (77 if cut >= HEADER_SIZE + 4 else 0)
        assert dec.state is DecoderState.ERROR
    dec = FrameDecoder()
    dec.feed(data)
    assert dec.feed_eof() == [] and dec.state is DecoderState.CLOSED
    assert dec.feed(data) == []


def test_empty_payload_of_known_kind_is_truncated():
    [err] = FrameDecoder().feed(frame(MessageKind.TRIM, b""))
    assert err.code is ErrorCode.TRUNCATED and err.ref == 0


def test_feed_accepts_memoryview_and_bytearray():
    data = encode(Trim(1, 2, 3))
    assert FrameDecoder().feed(memoryview(data)) == [Trim(1, 2, 3)]
    buf = bytearray(data)
    dec = FrameDecoder()
    [msg] = dec.feed(buf)
    buf[:] = bytes(len(buf))  # the caller may reuse its buffer
    assert msg == Trim(1, 2, 3)


# ------------------------------------------------------------------------ activations


def _forward(act: np.ndarray, rows: tuple[int, ...] | None = None) -> Forward:
    rows = rows if rows is not None else (act.shape[0],)
    segs = tuple(Segment(i, 0, n, min(n, 1), (), 0.0, 0, 1.0, 0, 0) for i, n in enumerate(rows))
    return Forward(1, 2, 3, segs, act)


def _forward_payload_with(dtype_code: int, rows: int, width: int, data: bytes, n_rows: int) -> bytes:
    """A Forward payload with one segment of ``n_rows`` rows and a hand-made array part."""
    body = encode(_forward(np.zeros((n_rows, 1), np.float32)))[HEADER_SIZE:]
    prefix = body[:98]  # ref 4, batch_id 8, step 4, count 2, one plain segment 80
    assert body[98] == 1 and body[99:103] == n_rows.to_bytes(4, "little")  # the f32 array head
    head = struct.pack("<BII", dtype_code, rows, width)
    return prefix + head + bytes(-(len(prefix) + len(head)) % 8) + data


def test_f16_and_f32_activations_round_trip_bit_exact():
    rng = np.random.default_rng(0)
    for dt in (np.float16, np.float32):
        act = rng.standard_normal((5, 33)).astype(dt)
        act[0, :4] = [np.inf, -np.inf, -0.0, np.nan]
        msg = _forward(act, (2, 3))
        [got] = FrameDecoder().feed(encode(msg))
        assert got.act.dtype == dt and got.act.shape == (5, 33)
        assert got.act.tobytes() == act.tobytes()


def test_decoded_activation_is_a_readonly_aligned_view():
    act = np.ones((3, 16), np.float32)
    [got] = FrameDecoder().feed(encode(_forward(act)))
    assert not got.act.flags.writeable
    assert got.act.flags.aligned
    with pytest.raises(ValueError):
        got.act[0, 0] = 2.0


def test_big_endian_and_strided_input_are_normalised():
    act = np.arange(12, dtype=">f4").reshape(3, 4)
    got = decode(encode(_forward(act)))
    assert got.act.dtype == np.dtype("<f4")
    np.testing.assert_array_equal(got.act, act)
    strided = np.arange(24, dtype=np.float32).reshape(3, 8)[:, ::2]
    np.testing.assert_array_equal(decode(encode(_forward(strided))).act, strided)


def test_bad_dtype_code_on_the_wire():
    payload = _forward_payload_with(3, 2, 1, bytes(8), 2)
    with pytest.raises(RemoteProtocolError) as ei:
        decode_message(MessageKind.FORWARD, payload)
    assert ei.value.code is ErrorCode.BAD_DTYPE
    # and the well-formed variant of the same payload decodes
    ok = decode_message(MessageKind.FORWARD, _forward_payload_with(1, 2, 1, bytes(8), 2))
    assert ok.act.shape == (2, 1)


@pytest.mark.parametrize(
    "rows,width,nbytes",
    [
        (2, 1, 4),  # fewer bytes than rows * width * 4
        (2, 1, 12),  # more
        (1, 1, 4),  # segments say 2 rows, array holds 1
        (2, 0, 0),  # width 0
        (0, 70000, 0),  # width too large
    ],
)
def test_bad_shapes_on_the_wire(rows, width, nbytes):
    payload = _forward_payload_with(1, rows, width, bytes(nbytes), 2)
    with pytest.raises(RemoteProtocolError) as ei:
        decode_message(MessageKind.FORWARD, payload)
    assert ei.value.code is ErrorCode.BAD_SHAPE
    [err] = FrameDecoder().feed(frame(MessageKind.FORWARD, payload))
    assert err.code is ErrorCode.BAD_SHAPE and err.ref == 1


def test_encode_refuses_bad_activations():
    cases = [
        (_forward(np.zeros((2, 3), np.float64)), ErrorCode.BAD_DTYPE),
        (_forward(np.zeros((2, 3), np.int32)), ErrorCode.BAD_DTYPE),
        (_forward(np.zeros((2,), np.float32), (2,)), ErrorCode.BAD_SHAPE),
        (_forward(np.zeros((2, 0), np.float32)), ErrorCode.BAD_SHAPE),
        (_forward(np.zeros((1, 65537), np.float16)), ErrorCode.BAD_SHAPE),
        (_forward(np.zeros((3, 4), np.float32), (1, 1)), ErrorCode.BAD_SHAPE),  # rows don't add up
        (dataclasses.replace(_forward(np.zeros((1, 4), np.float32)), act=[[1.0]]), ErrorCode.BAD_FIELD),
    ]
    for msg, code in cases:
        with pytest.raises(LocalProtocolError) as ei:
            encode(msg)
        assert ei.value.code is code, msg


def test_n_logits_cannot_exceed_rows():
    seg = Segment(1, 0, 1, 2, (), 0.0, 0, 1.0, 0, 0)
    with pytest.raises(LocalProtocolError) as ei:
        encode(Forward(0, 0, 0, (seg,), np.zeros((1, 2), np.float32)))
    assert ei.value.code is ErrorCode.BAD_SHAPE


def test_forward_with_several_segments_and_drafts():
    segs = (
        Segment(10, 100, 3, 3, (1, 2), 0.0, 0, 1.0, 0, 1),
        Segment(11, 7, 1, 1, (), 0.75, 40, 0.5, 2**64 - 1, 0),
        Segment(12, 0, 4, 0, (), 0.0, 0, 1.0, 0, 0),
    )
    act = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    msg = Forward(2**32 - 1, 2**64 - 1, 9, segs, act)
    tr(encode(msg), [msg])


def test_drafts_are_capped_at_32():
    act = np.zeros((33, 1), np.float32)
    ok = Forward(0, 0, 0, (Segment(1, 0, 33, 33, tuple(range(32)), 0.0, 0, 1.0, 0, 0),), act)
    assert decode(encode(ok)) == ok
    bad = dataclasses.replace(ok, segments=(dataclasses.replace(ok.segments[0], drafts=tuple(range(33))),))
    with pytest.raises(LocalProtocolError):
        encode(bad)
    # 33 drafts forged on the wire
    payload = bytearray(encode(ok)[HEADER_SIZE:])
    payload[36] = 33
    with pytest.raises(RemoteProtocolError) as ei:
        decode_message(MessageKind.FORWARD, bytes(payload))
    assert ei.value.code is ErrorCode.BAD_FIELD


# ------------------------------------------------------------------- other messages


def test_token_return_round_trip():
    msg = TokenReturn(5, 6, (SegmentResult(1, (10, 11, 12), 2, 4), SegmentResult(2, (), 0, 0)))
    tr(encode(msg), [msg])


def test_field_range_and_type_errors_are_local():
    bad = [
        Trim(-1, 0, 0),
        Trim(2**32, 0, 0),
        Trim(0, 2**64, 0),
        Trim(0, 0, 1.5),
        Trim(0, 0, True),
        Heartbeat(0, 0, 0, 1),  # echo must be a bool
        Error(0, 999, "x"),
        AuthResult(0, True, b"bytes"),
        Hello(0, "a", "b", "c", 1, {"x": object()}),
        Hello(0, "a", "b", "c", 1, {"x": float("nan")}),
        Hello(0, "a", "b", "c", 1, ["not", "a", "dict"]),
        Hello(0, "\ud800", "b", "c", 1, {}),
        Prepare(0, 1, "sha", "m", 5, 4, 10),  # reversed range
        Prepare(0, 1, "sha", "m", 0, 11, 10),  # beyond the model
        Forward(0, 0, 0, (Segment(1, 0, 1, 0, (), 1e40, 0, 1.0, 0, 0),), np.zeros((1, 1), np.float32)),
    ]
    for msg in bad:
        with pytest.raises(LocalProtocolError) as ei:
            encode(msg)
        assert ei.value.code in (ErrorCode.BAD_FIELD, ErrorCode.BAD_SHAPE), msg
        assert isinstance(ei.value, MeshnodeError)


def test_load_wire_dtype_is_checked_both_ways():
    good = Load(1, 2, "sha", 0, 10, "up", "down", "coord", "f16", 4096, 512, 4)
    assert decode(encode(good)) == good
    with pytest.raises(LocalProtocolError) as ei:
        encode(dataclasses.replace(good, wire_dtype="bf16"))
    assert ei.value.code is ErrorCode.BAD_DTYPE


def test_load_kv_type_is_carried_and_checked():
    good = Load(1, 2, "sha", 0, 10, "up", "down", "coord", "f16", 4096, 512, 4, "f16")
    assert decode(encode(good)).kv_type == "f16"
    assert Load(1, 2, "sha", 0, 10, "up", "down", "coord", "f16", 4096, 512, 4).kv_type == "q8_0"
    with pytest.raises(LocalProtocolError) as ei:
        encode(dataclasses.replace(good, kv_type="q4_0"))
    assert ei.value.code is ErrorCode.BAD_FIELD
    forged = encode(good).replace(b"\x03\x00\x00\x00f16", b"\x03\x00\x00\x00q16")
    [err] = FrameDecoder().feed(forged)
    assert err.code is ErrorCode.BAD_DTYPE


def test_bool_byte_other_than_0_1_is_refused():
    data = bytearray(encode(Heartbeat(0, 0, 0, True)))
    data[-1] = 2
    [err] = FrameDecoder().feed(bytes(data))
    assert err.code is ErrorCode.BAD_FIELD


def test_unknown_error_code_on_the_wire_is_refused():
    data = bytearray(encode(Error(0, ErrorCode.BUSY, "")))
    data[14:16] = (999).to_bytes(2, "little")
    [err] = FrameDecoder().feed(bytes(data))
    assert err.code is ErrorCode.BAD_FIELD


def test_bad_utf8_and_bad_json_are_refused():
    data = encode(Error(0, ErrorCode.BUSY, "ab")).replace(b"ab", b"\xff\xfe")
    [err] = FrameDecoder().feed(data)
    assert err.code is ErrorCode.BAD_FIELD
    hello = encode(Hello(0, "", "", "", 1, {"a": 1}))
    for text in (b"[1, 2, 3]", b"{NaN:  }", b'{"a":NaN}'):
        forged = hello[: -len(b'{"a":1}') - 4] + len(text).to_bytes(4, "little") + text
        forged = forged[:6] + (len(forged) - HEADER_SIZE).to_bytes(4, "little") + forged[10:]
        [err] = FrameDecoder().feed(forged)
        assert err.code is ErrorCode.BAD_FIELD, text


def test_encode_refuses_non_messages_and_oversize():
    with pytest.raises(LocalProtocolError) as ei:
        encode(SEG)
    assert ei.value.code is ErrorCode.UNKNOWN_KIND
    with pytest.raises(LocalProtocolError) as ei:
        encode(Error(0, ErrorCode.BUSY, "x" * 100), max_frame=50)
    assert ei.value.code is ErrorCode.OVERSIZE


def test_decode_message_unknown_kind():
    with pytest.raises(RemoteProtocolError) as ei:
        decode_message(0xBEEF, b"\x01\x00\x00\x00")
    assert ei.value.code is ErrorCode.UNKNOWN_KIND and ei.value.ref == 1
    assert isinstance(ei.value, MeshnodeError)


def test_decode_whole_frame_length_mismatch():
    data = encode(Trim(1, 2, 3))
    with pytest.raises(RemoteProtocolError) as ei:
        decode(data[:-1])
    assert ei.value.code is ErrorCode.TRUNCATED
    with pytest.raises(RemoteProtocolError) as ei:
        decode(data + b"\x00")
    assert ei.value.code is ErrorCode.BAD_FIELD


def test_version_rule_at_hello():
    ours = Hello(4, "n", "laptop", "mesh", PROTOCOL_VERSION, {})
    assert check_peer_version(ours) is None
    refusal = check_peer_version(dataclasses.replace(ours, protocol=PROTOCOL_VERSION + 1))
    assert refusal is not None and refusal.code is ErrorCode.BAD_VERSION and refusal.ref == 4


def test_messages_are_frozen_and_slotted():
    msg = Trim(1, 2, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.pos = 4  # type: ignore[misc]
    assert not hasattr(msg, "__dict__")
    assert Trim.KIND is MessageKind.TRIM


# ---------------------------------------------------------------------- hot path


@pytest.mark.parametrize("dtype,npdt", [("f32", np.float32), ("f16", np.float16)])
def test_decode_template_matches_encode(dtype, npdt):
    rng = np.random.default_rng(1)
    sampling = dict(n_logits=1, temperature=0.75, top_k=40, top_p=0.5, seed=1234, flags=3)
    tpl = DecodeTemplate(99, 48, dtype, **sampling)
    for step, (batch_id, pos, ref) in enumerate([(1, 0, 0), (2**64 - 1, 2**32 - 1, 2**32 - 1), (5, 17, 3)]):
        row = rng.standard_normal(48).astype(np.float32)
        got = bytes(tpl.encode(batch_id, step, pos, row, ref=ref))
        seg = Segment(99, pos, 1, 1, (), 0.75, 40, 0.5, 1234, 3)
        want = encode(Forward(ref, batch_id, step, (seg,), row.reshape(1, 48).astype(npdt)))
        assert got == want
        [msg] = FrameDecoder().feed(got)
        assert msg.segments == (seg,) and msg.act.tobytes() == row.astype(npdt).tobytes()


def test_decode_template_accepts_2d_row_and_refuses_bad_input():
    tpl = DecodeTemplate(1, 4)
    row = np.ones((1, 4), np.float32)
    assert bytes(tpl.encode(0, 0, 0, row)) == encode(
        Forward(0, 0, 0, (Segment(1, 0, 1, 1, (), 0.0, 0, 1.0, 0, 0),), row)
    )
    with pytest.raises(LocalProtocolError):
        tpl.encode(0, 0, 0, np.ones(5, np.float32))
    with pytest.raises(LocalProtocolError):
        tpl.encode(0, 0, 0, np.ones(4, np.int64))
    with pytest.raises(LocalProtocolError):
        tpl.encode(-1, 0, 0, np.ones(4, np.float32))
    with pytest.raises(LocalProtocolError):
        DecodeTemplate(1, 4, "bf16")
    with pytest.raises(LocalProtocolError):
        DecodeTemplate(1, 0)
    with pytest.raises(LocalProtocolError):
        DecodeTemplate(1, 4, n_logits=2)  # n_logits > n_rows (1)


@pytest.mark.slow
def test_wire_is_sans_io():
    # in a fresh interpreter: importing wire pulls in no I/O and no other meshnode package
    import subprocess
    import sys

    code = (
        "import sys, meshnode.wire\n"
        "ours = sorted(m for m in sys.modules if m.startswith('meshnode.') and not m.startswith('meshnode.wire'))\n"
        "io = [m for m in ('asyncio', 'socket', 'selectors', 'llama_cpp', 'aioquic') if m in sys.modules]\n"
        "print(ours, io)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['meshnode.errors', 'meshnode.limits'] []"  # the shared leaves only


def test_numpy_scalars_are_accepted():
    toks = np.array([5, 6], np.int32)
    msg = TokenReturn(np.uint32(1), np.int64(2), (SegmentResult(3, tuple(toks), np.int64(1), 2),))
    assert decode(encode(msg)) == TokenReturn(1, 2, (SegmentResult(3, (5, 6), 1, 2),))
    seg = Segment(1, 0, 1, 1, (), np.float32(0.5), np.int32(-1), np.float64(1.0), 0, 0)
    fwd = Forward(0, 0, 0, (seg,), np.zeros((1, 2), np.float32))
    assert decode(encode(fwd)).segments[0].temperature == 0.5
    assert decode(encode(Heartbeat(0, 1, 2, np.bool_(True)))).echo is True


def test_logit_bias_round_trips_and_is_checked_both_ways():
    act = np.zeros((1, 2), np.float32)
    seg = Segment(1, 0, 1, 1, (), 0.0, 0, 1.0, 0, 0, (3, 70000), (-100.0, 5.5))
    msg = Forward(0, 0, 0, (seg,), act)
    tr(encode(msg), [msg])
    for ids, values in [((3, 70000), (1.0,)), ((7, 3), (1.0, 1.0)), ((3, 3), (1.0, 1.0)),
                        ((3,), (100.5,)), ((3,), (float("nan"),))]:
        bad = Forward(0, 0, 0, (dataclasses.replace(seg, bias_ids=ids, bias_values=values),), act)
        with pytest.raises(LocalProtocolError):
            encode(bad)
    # a bias forged on the wire: 5.5 patched to 200
    payload = bytearray(encode(msg)[HEADER_SIZE:])
    at = bytes(payload).index(struct.pack("<f", 5.5))
    payload[at:at + 4] = struct.pack("<f", 200.0)
    with pytest.raises(RemoteProtocolError) as ei:
        decode_message(MessageKind.FORWARD, bytes(payload))
    assert ei.value.code is ErrorCode.BAD_FIELD


def test_decode_template_carries_logit_bias():
    t = DecodeTemplate(9, 4, bias_ids=(2, 5), bias_values=(-100.0, 3.0))
    row = np.arange(4, dtype=np.float32)
    frame = bytes(t.encode(7, 1, 12, row))
    want = Forward(0, 7, 1, (Segment(9, 12, 1, 1, (), 0.0, 0, 1.0, 0, 0, (2, 5), (-100.0, 3.0)),), row[None])
    assert frame == encode(want)


def test_penalties_round_trip_and_are_checked():
    act = np.zeros((1, 2), np.float32)
    seg = Segment(1, 0, 1, 1, (), 0.0, 0, 1.0, 0, 0, presence=0.5, frequency=-2.0,
                  seen_ids=(4, 9, 70000), seen_counts=(1, 3, 2))
    msg = Forward(0, 0, 0, (seg,), act)
    tr(encode(msg), [msg])
    for bad in [dict(presence=2.5), dict(frequency=float("nan")), dict(seen_counts=(1, 3)),
                dict(seen_ids=(9, 4, 70000)), dict(seen_counts=(1, 0, 2)), dict(min_p=1.5), dict(min_p=float("nan"))]:
        with pytest.raises(LocalProtocolError):
            encode(Forward(0, 0, 0, (dataclasses.replace(seg, **bad),), act))


def test_the_repetition_penalty_round_trips_and_is_checked():
    act = np.zeros((1, 2), np.float32)
    window = Segment(1, 0, 1, 1, (), 0.0, 0, 1.0, 0, 0, repeat=1.25, repeat_last_n=4, recent=(9, 4, 9))
    whole = dataclasses.replace(window, repeat_last_n=-1, recent=(4, 9, 70000))
    for seg in (window, whole):
        msg = Forward(0, 0, 0, (seg,), act)
        tr(encode(msg), [msg])
    for seg, bad in [(window, dict(repeat=0.0)), (window, dict(repeat=-1.0)), (window, dict(repeat=10.5)),
                     (window, dict(repeat=float("nan"))), (window, dict(repeat_last_n=-2)),
                     (window, dict(recent=(1, 2, 3, 4, 5))),      # more than the window
                     (whole, dict(recent=(9, 4)))]:                # the whole context's: ascending
        with pytest.raises(LocalProtocolError):
            encode(Forward(0, 0, 0, (dataclasses.replace(seg, **bad),), act))


def test_scored_prompt_tokens_round_trip_and_are_checked():
    act = np.zeros((3, 2), np.float32)
    seg = Segment(1, 0, 3, 3, (), 0.0, 0, 1.0, 0, SEG_LOGPROBS | (2 << 3), score=(7, 70000))
    msg = Forward(0, 0, 0, (seg,), act)
    tr(encode(msg), [msg])
    # more scored tokens than logit rows; scoring without logprobs asked for
    for bad in [dict(score=(1, 2, 3, 4)), dict(n_logits=1), dict(flags=0)]:
        with pytest.raises(LocalProtocolError) as ei:
            encode(Forward(0, 0, 0, (dataclasses.replace(seg, **bad),), act))
        assert ei.value.code is ErrorCode.BAD_SHAPE
    ok = SegmentResult(1, (), 0, 0, scored=(-0.5, -1.0), scored_top_ids=(3, 4), scored_top_logprobs=(-0.25, -0.75))
    tr(encode(TokenReturn(0, 1, (ok,))), [TokenReturn(0, 1, (ok,))])
    for bad in [dict(scored_top_ids=(3,)), dict(scored_top_ids=(3, 4, 5), scored_top_logprobs=(0.0, 0.0, 0.0)),
                dict(scored=(), scored_top_ids=(3, 4), scored_top_logprobs=(-0.25, -0.75)),
                dict(scored=(0.5, -1.0)), dict(scored_top_logprobs=(float("nan"), -0.75))]:
        with pytest.raises(LocalProtocolError):
            encode(TokenReturn(0, 1, (dataclasses.replace(ok, **bad),)))
