"""Hot path: the per-token decode Forward frame, built once per session.

During decode every step sends the same shape of message for a session: one segment,
one row, the same sampling settings. :class:`DecodeTemplate` encodes that frame once
through the ordinary :func:`encode` (so its layout cannot drift from the schema), keeps
it in a preallocated ``bytearray`` and, per token, only patches ``ref``, ``batch_id``,
``step`` and ``pos`` with ``struct.pack_into`` and copies the activation row in place.

Fixed payload layout of a 1-segment, 0-draft Forward (offsets from the payload start;
the frame header adds 10)::

    0 ref u32 | 4 batch_id u64 | 12 step u32 | 16 n_segments u16 | 18 session u64
    | 26 pos u32 | 30 n_rows u32 | ... sampling fields, logit bias ... | array head | pad | data
"""

from __future__ import annotations

import struct
from dataclasses import fields, replace
from typing import Any

import numpy as np

from meshnode.wire.codec import HEADER_SIZE, encode
from meshnode.wire.errors import ErrorCode, LocalProtocolError
from meshnode.wire.messages import Forward, Segment
from meshnode.wire.schema import DTYPE_CODES, DTYPE_NAMES, MAX_WIDTH

_U8 = struct.Struct("<B")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_OFF_REF = HEADER_SIZE + 0
_OFF_BATCH = HEADER_SIZE + 4
_OFF_STEP = HEADER_SIZE + 12
_OFF_POS = HEADER_SIZE + 26
# the Segment fields a template may set: all but where the row goes and what it holds
_SAMPLING_FIELDS = {f.name for f in fields(Segment)} - {"session", "pos", "n_rows", "n_logits", "drafts", "flags"}
# what the Segment has no default for: greedy, unless given
_GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}


class DecodeTemplate:
    """A reusable one-row ``Forward`` frame for one session.

    ``dtype`` is the wire dtype, ``"f32"`` or ``"f16"``; the row given to :meth:`encode`
    is cast to it (float32 in, f16 out is the negotiated f16 mode). ``sampling``: any of
    the :class:`Segment`'s sampling fields (temperature, top_k, top_p, seed, min_p, the
    logit bias and penalties; the segment's defaults otherwise); ``n_logits`` defaults to 1
    (the final stage samples the row). Raises :class:`LocalProtocolError` for values the
    protocol cannot carry.
    """

    __slots__ = ("session", "width", "dtype", "_buf", "_row", "_view", "_off_flags")

    def __init__(
        self,
        session: int,
        width: int,
        dtype: str = "f32",
        *,
        n_logits: int = 1,
        flags: int = 0,
        **sampling: Any,
    ) -> None:
        if dtype not in DTYPE_NAMES:
            raise LocalProtocolError(ErrorCode.BAD_DTYPE, f"wire dtype {dtype!r} (only f32/f16)")
        if not isinstance(width, int) or not 1 <= width <= MAX_WIDTH:
            raise LocalProtocolError(ErrorCode.BAD_SHAPE, f"width {width!r}")
        np_dtype = DTYPE_CODES[DTYPE_NAMES[dtype]]
        if set(sampling) - _SAMPLING_FIELDS:
            raise TypeError(f"DecodeTemplate: not sampling fields: {sorted(set(sampling) - _SAMPLING_FIELDS)}")
        seg = Segment(session, 0, 1, n_logits, (), flags=flags, **{**_GREEDY, **sampling})
        proto = encode(Forward(0, 0, 0, (seg,), np.zeros((1, width), np_dtype)))
        # where the segment's flags byte sits: the one byte that differs when it does
        other = encode(Forward(0, 0, 0, (replace(seg, flags=flags ^ 1),), np.zeros((1, width), np_dtype)))
        self._off_flags = next(i for i, (a, b) in enumerate(zip(proto, other)) if a != b)
        self.session = session
        self.width = width
        self.dtype = dtype
        self._buf = bytearray(proto)
        data_off = len(proto) - width * np_dtype.itemsize
        self._row = np.frombuffer(self._buf, np_dtype, count=width, offset=data_off)
        self._view = memoryview(self._buf).toreadonly()

    def encode(self, batch_id: int, step: int, pos: int, act_row: np.ndarray, *, ref: int = 0,
               flags: int | None = None) -> memoryview:
        """Fill in one step and return the whole frame.

        ``act_row`` holds ``width`` floats (shape (width,) or (1, width)). The result is
        a read-only view of the template's buffer: send it (or ``bytes()`` it) before
        the next call, which overwrites it. Byte for byte equal to
        ``encode(Forward(ref, batch_id, step, (Segment(session, pos, 1, ...),), row))``.
        ``flags``: the segment's flags for this step (None: as last time).
        """
        try:
            _U32.pack_into(self._buf, _OFF_REF, ref)
            _U64.pack_into(self._buf, _OFF_BATCH, batch_id)
            _U32.pack_into(self._buf, _OFF_STEP, step)
            _U32.pack_into(self._buf, _OFF_POS, pos)
            if flags is not None:
                _U8.pack_into(self._buf, self._off_flags, flags)
        except struct.error as e:
            raise LocalProtocolError(ErrorCode.BAD_FIELD, f"DecodeTemplate: {e}", ref=0) from None
        row = np.asarray(act_row)
        if row.size != self.width or (row.ndim == 2 and row.shape[0] != 1) or row.ndim > 2:
            raise LocalProtocolError(ErrorCode.BAD_SHAPE, f"row shape {row.shape}, width {self.width}")
        if row.dtype.kind != "f":
            raise LocalProtocolError(ErrorCode.BAD_DTYPE, f"row dtype {row.dtype}")
        np.copyto(self._row, row.reshape(self.width), casting="same_kind")
        return self._view
