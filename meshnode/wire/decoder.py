"""Incremental frame decoder: bytes in, messages and error events out. No I/O.

Theory of operation: the decoder alternates between two phases. While reading a header
it collects up to 10 bytes (taking them straight from the fed buffer when a whole
header is there). Once the header checks out, it appends incoming bytes to a payload
buffer until the announced length arrived, and a ``Forward`` activation is then decoded
as a view of that buffer (each frame gets its own buffer, so views stay valid after
later feeds). The buffer grows with the bytes that actually arrived, never with what
the header declares: a 10-byte header announcing 64 MiB costs nothing until 64 MiB
came (a stranger's headers could make a node allocate gigabytes: docs/security.md). Growing a
large ``bytearray`` is a ``realloc`` that glibc serves with ``mremap`` for big buffers,
so each byte is still copied about once. Frames that arrive whole at the start of a feed (QUIC
delivers a decode step's frame in one piece) skip the byte-wise phases: each is copied
into its own buffer in one go and decoded.

Errors never escape :meth:`FrameDecoder.feed`; they come out as :class:`WireError`
events. Two families (docs/protocol.md, "Errors"):

* framing errors (BAD_MAGIC, BAD_VERSION, OVERSIZE): the stream cannot be resynchronised.
  The event has ``fatal=True``, the decoder enters :attr:`DecoderState.ERROR` and every
  later ``feed`` returns ``[]``; the caller must close the connection.
* payload errors (UNKNOWN_KIND, TRUNCATED, BAD_FIELD, BAD_SHAPE, BAD_DTYPE): the frame
  was well framed, so decoding goes on with the next frame. The caller should answer
  with ``Error`` / ``DataError`` carrying the event's ``code`` and ``ref``.
"""

from __future__ import annotations

import enum

from meshnode.wire.codec import HEADER, HEADER_SIZE, MAX_FRAME, decode_message, parse_header
from meshnode.wire.errors import ErrorCode, RemoteProtocolError, WireError
from meshnode.wire.messages import Message


class DecoderState(enum.Enum):
    OPEN = "open"  # accepting bytes
    ERROR = "error"  # hit a fatal framing error (see FrameDecoder.error); close the connection
    CLOSED = "closed"  # feed_eof() was called at a frame boundary


class FrameDecoder:
    """Turns a byte stream into messages. Feed it whatever the transport delivers."""

    def __init__(self, *, max_frame: int = MAX_FRAME) -> None:
        self._max_frame = max_frame
        self._state = DecoderState.OPEN
        self._error: WireError | None = None
        self._hdr = bytearray()  # partial header
        self._kind = -1
        self._payload: bytearray | None = None  # the bytes of the frame's payload so far
        self._length = 0                         # what the header declared (checked against max_frame)

    @property
    def max_frame(self) -> int:
        """The largest payload accepted; a larger declared length is a fatal OVERSIZE."""
        return self._max_frame

    @max_frame.setter
    def max_frame(self, value: int) -> None:
        # a link raises it once the peer authenticated (handshake frames are small)
        self._max_frame = min(int(value), MAX_FRAME)

    @property
    def state(self) -> DecoderState:
        return self._state

    @property
    def error(self) -> WireError | None:
        """The fatal error that put the decoder in ERROR state, if any."""
        return self._error

    @property
    def pending(self) -> int:
        """Bytes held of a frame not yet complete (0 at a frame boundary)."""
        return len(self._hdr) + (HEADER_SIZE + len(self._payload) if self._payload is not None else 0)

    @property
    def buffered(self) -> int:
        """Bytes of memory this decoder holds for a frame in progress (what a memory
        budget counts; a declared length is not held until it arrived)."""
        return len(self._hdr) + (len(self._payload) if self._payload is not None else 0)

    @property
    def wanted(self) -> int:
        """Bytes that complete the header or the frame in progress (at least 1). Feeding
        exactly that many yields at most one event: a caller that must act on each frame
        before the next one is read (the link during its handshake) feeds this much."""
        if self._payload is None:
            return HEADER_SIZE - len(self._hdr)
        return max(1, self._length - len(self._payload))

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message | WireError]:
        """Consume ``data``; return the messages and error events of every frame it completes,
        in stream order. Never raises on bad input. Returns ``[]`` once not OPEN.
        The decoder copies what it keeps: ``data`` may be reused by the caller afterwards."""
        if self._state is not DecoderState.OPEN:
            return []
        mv = memoryview(data)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        events: list[Message | WireError] = []
        i, n = 0, len(mv)
        if self._payload is None and not self._hdr:
            i = self._whole_frames(mv, events)   # the common case, a partial rest goes on below
        while i < n:
            if self._payload is None:
                if not self._hdr and n - i >= HEADER_SIZE:
                    hdr: bytearray | memoryview = mv[i : i + HEADER_SIZE]
                    i += HEADER_SIZE
                else:
                    take = min(HEADER_SIZE - len(self._hdr), n - i)
                    self._hdr += mv[i : i + take]
                    i += take
                    if len(self._hdr) < HEADER_SIZE:
                        break
                    hdr = self._hdr
                try:
                    self._kind, length = parse_header(hdr, self._max_frame)
                except RemoteProtocolError as e:
                    kind = HEADER.unpack_from(hdr, 0)[3] if e.code is ErrorCode.OVERSIZE else None
                    events.append(self._fail(WireError(e.code, e.detail, kind=kind, fatal=True)))
                    return events
                self._hdr = bytearray()
                self._length = length
                # only what is here now: the rest is appended as it arrives
                take = min(length, n - i)
                payload = self._payload = bytearray(mv[i : i + take])
                i += take
            else:
                payload = self._payload
                take = min(self._length - len(payload), n - i)
                if take:
                    payload += mv[i : i + take]
                    i += take
            if len(payload) == self._length:
                events.append(self._finish(payload))
        return events

    def _whole_frames(self, mv: memoryview, events: list[Message | WireError]) -> int:
        """Decode the complete frames at the start of ``mv`` (no frame is in progress);
        returns the offset of the first byte not consumed. Each payload gets its own
        buffer, as on the byte-wise path: an activation view is aligned and outlives
        the caller's buffer."""
        i, n = 0, len(mv)
        while n - i >= HEADER_SIZE:
            try:
                kind, length = parse_header(mv[i : i + HEADER_SIZE], self._max_frame)
            except RemoteProtocolError:
                break   # the copying path reports it, with the same event
            if n - i - HEADER_SIZE < length:
                break
            self._kind = kind
            i += HEADER_SIZE
            events.append(self._finish(bytearray(mv[i : i + length])))
            i += length
        return i

    def feed_eof(self) -> list[WireError]:
        """The transport closed. Returns ``[WireError(TRUNCATED, fatal=True)]`` if it closed
        inside a frame (state ERROR), else ``[]`` (state CLOSED)."""
        if self._state is not DecoderState.OPEN:
            return []
        if not self.pending:
            self._state = DecoderState.CLOSED
            return []
        ref = 0
        if self._payload is not None and len(self._payload) >= 4:
            ref = int.from_bytes(self._payload[:4], "little")
        kind = self._kind if self._payload is not None else None
        ev = WireError(
            ErrorCode.TRUNCATED, f"stream ended inside a frame ({self.pending} bytes held)", ref=ref, kind=kind, fatal=True
        )
        return [self._fail(ev)]

    def _fail(self, ev: WireError) -> WireError:
        self._state = DecoderState.ERROR
        self._error = ev
        self._hdr = bytearray()
        self._payload = None
        return ev

    def _finish(self, payload: bytearray) -> Message | WireError:
        self._payload = None
        kind = self._kind
        try:
            return decode_message(kind, payload)
        except RemoteProtocolError as e:
            return WireError(e.code, e.detail, ref=e.ref, kind=kind)
        except Exception as e:  # a codec bug must not take the connection down; tests assert none occur
            return WireError(ErrorCode.INTERNAL, f"decoder bug on kind 0x{kind:04x}: {e!r}", kind=kind)
