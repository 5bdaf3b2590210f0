"""Wire error codes, the error event and the two protocol exceptions.

Whose fault it was decides the type (the h11 convention):

* :class:`LocalProtocolError` -- *we* tried to encode something the protocol cannot
  carry (a field out of range, an oversize frame, a bad activation dtype). Raised by
  :func:`meshnode.wire.encode`; a bug or bad input on our side, never sent anywhere.
* :class:`RemoteProtocolError` -- the *peer* sent bytes that do not decode. Raised by
  :func:`meshnode.wire.decode_message`. :class:`~meshnode.wire.FrameDecoder` never lets
  it escape: it turns it into a :class:`WireError` event at its edge.

Both carry an :class:`ErrorCode`, the same code that travels in ``Error`` / ``DataError``
frames, so the receiver of a bad frame can answer with exactly what went wrong.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from meshnode.errors import MeshnodeError


class ErrorCode(enum.IntEnum):
    """Error codes, carried on the wire as u16. Values are part of protocol version 1:
    never renumber; adding a code needs a protocol version bump (docs/protocol.md)."""

    UNKNOWN_KIND = 1  # frame kind this peer does not know
    BAD_VERSION = 2  # frame header version or Hello.protocol not supported
    BAD_MAGIC = 3  # frame does not start with b"MN"
    OVERSIZE = 4  # length prefix above the frame cap
    TRUNCATED = 5  # payload (or stream) ends inside a field
    BAD_SHAPE = 6  # activation shape / segment rows inconsistent
    BAD_DTYPE = 7  # activation dtype code other than f32 / f16
    BAD_FIELD = 8  # a field value out of range / bad utf-8 / trailing bytes
    AUTH_FAILED = 9  # mesh secret proof did not verify
    NOT_AUTHENTICATED = 10  # request before authentication completed
    FENCED = 11  # stale term: a newer coordinator owns this stage
    BUSY = 12  # peer cannot take the request now
    NO_SUCH_SESSION = 13  # data message for a session the stage does not hold
    ENGINE_ERROR = 14  # the stage engine failed on this request
    INTERNAL = 15  # bug on the sending side


@dataclass(frozen=True, slots=True)
class WireError:
    """Event: a frame could not be decoded (returned by ``FrameDecoder.feed``).

    ``ref`` is the request id of the bad frame when its payload was long enough to hold
    one (0 otherwise), ``kind`` its frame kind when the header was readable (else
    ``None``), so the receiver can answer with ``Error(ref, code, detail)``.
    ``fatal`` means the decoder is now in its ERROR state: the caller must close the
    connection; every later ``feed`` returns ``[]``.
    """

    code: ErrorCode
    detail: str
    ref: int = 0
    kind: int | None = None
    fatal: bool = False


class ProtocolError(MeshnodeError):
    """Base of the two protocol errors; ``code`` is an :class:`ErrorCode`."""

    def __init__(self, code: ErrorCode, detail: str, *, ref: int = 0) -> None:
        super().__init__(f"{code.name}: {detail}")
        self.code = code
        self.detail = detail
        self.ref = ref


class LocalProtocolError(ProtocolError):
    """We tried to encode a message the protocol cannot carry."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that do not decode to a valid message."""
