"""The fast lane: sealed UDP datagrams for per-token frames, beside the QUIC connection.

Why: a decode step crosses every hop of a split once per token, as one small frame (a
2.3 KB activation, a 30-byte token). Through aioquic each crossing costs ~0.4 ms of
Python on a 2-core VM (stream bookkeeping, packet building, header
protection, parsing, an ACK timer), against ~0.05 ms for sealing the frame ourselves:
the two hops of a 2-stage SmolLM2 step spent ~0.7 ms of a ~22 ms token there
(docs/mesh.md, "The fast lane").

What: after a QUIC link authenticates, each end picks a random AES-128-GCM key and a
key id for the traffic it *receives*, and sends both to the peer over the (encrypted,
authenticated) control stream as ``LaneKey``. A lane packet is::

    mark u8 = 0x01 | key_id u32 | counter u64 | AES-GCM(frame) + 16-byte tag

little endian; the 13-byte header is the associated data, the nonce is 4 zero bytes and
the counter. The first byte has QUIC's fixed bit (0x40) and long-header bit (0x80)
clear, which no QUIC v1 packet has, so lane packets share the QUIC socket and its
5-tuple (same firewall path, no second port) and the receive path tells them apart by
one byte. One packet carries exactly one wire frame.

The lane is *ordered and lossy*: a receiver accepts only counters above the highest it
has accepted (a late or replayed packet is dropped, never processed out of order), and
nothing is retransmitted. Whoever puts a frame on the lane must cope with its loss:
stage 0 resends a lost decode step over the QUIC stream (``meshnode.mesh.pipeline``).

This module is sans-IO: :class:`LaneSender` seals, :class:`LaneReceiver` opens;
:mod:`meshnode.net.link` moves the bytes.
"""

from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = ["LANE_MARK", "KEY_LEN", "LaneDrop", "LaneReceiver", "LaneSender", "is_lane_packet", "lane_key_id"]

LANE_MARK = 0x01
KEY_LEN = 16
_HEADER = struct.Struct("<BIQ")
HEADER_SIZE = _HEADER.size          # 13
TAG_SIZE = 16
_MAX_COUNTER = (1 << 64) - 1


class LaneDrop(Exception):
    """A lane packet that is not taken (bad tag, replayed, too short, ...); ``str()`` says why."""


def is_lane_packet(data: bytes | bytearray | memoryview) -> bool:
    """True when ``data`` is a lane packet rather than QUIC (by its first byte)."""
    return len(data) > 0 and data[0] == LANE_MARK


def lane_key_id(data: bytes | bytearray | memoryview) -> int | None:
    """The key id of a lane packet, or None when it is too short to have one."""
    if len(data) < HEADER_SIZE + TAG_SIZE:
        return None
    return _HEADER.unpack_from(data)[1]


def _nonce(counter: int) -> bytes:
    return b"\0\0\0\0" + counter.to_bytes(8, "little")


class LaneSender:
    """Seals frames for one peer with the key that peer gave us."""

    __slots__ = ("key_id", "_aead", "_counter")

    def __init__(self, key_id: int, key: bytes) -> None:
        if len(key) != KEY_LEN:
            raise ValueError(f"lane key must be {KEY_LEN} bytes, got {len(key)}")
        self.key_id = key_id
        self._aead = AESGCM(bytes(key))
        self._counter = 0

    def seal(self, frame: bytes | bytearray | memoryview, *, pad_to: int = 0) -> bytes:
        """One lane packet carrying ``frame``, zero-padded to ``pad_to`` bytes of
        plaintext (probes: a lane is only trusted with datagrams as big as it has carried;
        the frame's own length prefix tells the receiver where it ends)."""
        if self._counter >= _MAX_COUNTER:   # 2**64 packets: never, but a nonce must not repeat
            raise LaneDrop("lane counter exhausted")
        self._counter += 1
        header = _HEADER.pack(LANE_MARK, self.key_id, self._counter)
        plain = bytes(frame)
        if len(plain) < pad_to:
            plain += bytes(pad_to - len(plain))
        return header + self._aead.encrypt(_nonce(self._counter), plain, header)


class LaneReceiver:
    """Opens the packets sealed with our key; ``key_id``/``key`` are what we tell the peer."""

    __slots__ = ("key_id", "key", "_aead", "highest", "dropped")

    def __init__(self, key_id: int | None = None, key: bytes | None = None) -> None:
        self.key_id = int.from_bytes(os.urandom(4), "little") if key_id is None else key_id
        self.key = os.urandom(KEY_LEN) if key is None else bytes(key)
        if len(self.key) != KEY_LEN:
            raise ValueError(f"lane key must be {KEY_LEN} bytes, got {len(self.key)}")
        self._aead = AESGCM(self.key)
        self.highest = 0      # the highest counter accepted so far
        self.dropped = 0      # packets refused (telemetry)

    def open(self, packet: bytes | bytearray | memoryview) -> bytes:
        """The plaintext inside ``packet`` (a frame, plus any padding); raises
        :class:`LaneDrop` (and counts it) when the packet is short, not for this key,
        forged, or not newer than the last one taken."""
        try:
            if len(packet) < HEADER_SIZE + TAG_SIZE:
                raise LaneDrop(f"{len(packet)} bytes: shorter than a lane packet")
            mark, key_id, counter = _HEADER.unpack_from(packet)
            if mark != LANE_MARK or key_id != self.key_id:
                raise LaneDrop("not a lane packet for this key")
            if counter <= self.highest:
                raise LaneDrop(f"counter {counter} not above {self.highest} (late or replayed)")
            mv = memoryview(packet)
            try:
                frame = self._aead.decrypt(_nonce(counter), bytes(mv[HEADER_SIZE:]), bytes(mv[:HEADER_SIZE]))
            except InvalidTag:
                raise LaneDrop("authentication failed") from None
        except LaneDrop:
            self.dropped += 1
            raise
        self.highest = counter
        return frame
