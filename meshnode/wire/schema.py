"""Field schema: each message's layout is declared once and compiled to a codec.

Theory of operation: a message dataclass declares its fields with :func:`wf`
(``term: int = wf(U64)``). :func:`compile_schema` walks the fields in order and merges
runs of fixed-size scalars into one :class:`struct.Struct`, so encoding a message is a
few ``pack`` calls and decoding a few ``unpack_from`` calls on a memoryview, with
variable-size fields (strings, byte strings, JSON, integer lists, nested records, the
activation tensor) in between. Wire order is field order; all integers little endian.

Field types raise :class:`Invalid` on bad values in either direction; the codec turns it
into :class:`LocalProtocolError` (encoding) or :class:`RemoteProtocolError` (decoding).
Nothing here knows about frames or message kinds.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import numbers
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from meshnode.wire.errors import ErrorCode


class Invalid(Exception):
    """A value does not fit its field (internal; converted at the codec edge)."""

    def __init__(self, code: ErrorCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


class Writer:
    """Collects encoded pieces without concatenating them (joined once per frame)."""

    __slots__ = ("parts", "size")

    def __init__(self) -> None:
        self.parts: list[Any] = []
        self.size = 0

    def add(self, piece: bytes | memoryview) -> None:
        self.parts.append(piece)
        self.size += len(piece)


def need(mv: memoryview, off: int, n: int, what: str) -> None:
    if off + n > len(mv):
        raise Invalid(ErrorCode.TRUNCATED, f"{what}: need {n} bytes at {off}, have {len(mv) - off}")


# ---------------------------------------------------------------------------- scalars


class Scalar:
    """A fixed-size field packed with one struct format character.

    ``to_wire`` / ``from_wire`` take the field's name as ``prefix`` + ``name``, joined
    only for an error message: they run once per field of every frame."""

    __slots__ = ("fmt", "lo", "hi", "is_float")

    def __init__(self, fmt: str, lo: int | None = None, hi: int | None = None) -> None:
        self.fmt = fmt
        self.lo = lo
        self.hi = hi
        self.is_float = fmt in "fd"

    def to_wire(self, v: Any, prefix: str, name: str) -> Any:
        tv = type(v)
        if tv is int and not self.is_float:   # the common case, checked without ABCs
            if self.lo <= v <= self.hi:  # type: ignore[operator]
                return v
        elif tv is float and self.is_float:
            return v
        # numpy scalars are welcome (engines hand out np.int32 token ids); bools are not
        if isinstance(v, (bool, np.bool_)):
            raise Invalid(ErrorCode.BAD_FIELD, f"{prefix}{name}: expected a number, got bool")
        if self.is_float:
            if not isinstance(v, numbers.Real):
                raise Invalid(ErrorCode.BAD_FIELD, f"{prefix}{name}: expected float, got {type(v).__name__}")
            return float(v)
        if not isinstance(v, numbers.Integral):
            raise Invalid(ErrorCode.BAD_FIELD, f"{prefix}{name}: expected int, got {type(v).__name__}")
        v = int(v)
        if not self.lo <= v <= self.hi:  # type: ignore[operator]
            raise Invalid(ErrorCode.BAD_FIELD, f"{prefix}{name}: {v} outside [{self.lo}, {self.hi}]")
        return v

    # Scalars whose class keeps this identity from_wire are decoded without a call.
    def from_wire(self, raw: Any, prefix: str, name: str) -> Any:
        return raw


class BoolField(Scalar):
    """u8 that must be 0 or 1 (so every message has exactly one encoding)."""

    def __init__(self) -> None:
        super().__init__("B", 0, 1)

    def to_wire(self, v: Any, prefix: str, name: str) -> Any:
        if not isinstance(v, (bool, np.bool_)):
            raise Invalid(ErrorCode.BAD_FIELD, f"{prefix}{name}: expected bool, got {type(v).__name__}")
        return int(v)

    def from_wire(self, raw: Any, prefix: str, name: str) -> Any:
        if raw > 1:
            raise Invalid(ErrorCode.BAD_FIELD, f"{prefix}{name}: bool byte {raw}")
        return bool(raw)


class CodeField(Scalar):
    """An :class:`ErrorCode` as u16; unknown values are refused."""

    def __init__(self) -> None:
        super().__init__("H", 0, 0xFFFF)

    def to_wire(self, v: Any, prefix: str, name: str) -> Any:
        try:
            return int(ErrorCode(v))
        except ValueError:
            raise Invalid(ErrorCode.BAD_FIELD, f"{prefix}{name}: unknown error code {v!r}") from None

    def from_wire(self, raw: Any, prefix: str, name: str) -> Any:
        try:
            return ErrorCode(raw)
        except ValueError:
            raise Invalid(ErrorCode.BAD_FIELD, f"{prefix}{name}: unknown error code {raw}") from None


U8 = Scalar("B", 0, 0xFF)
U16 = Scalar("H", 0, 0xFFFF)
U32 = Scalar("I", 0, 0xFFFF_FFFF)
U64 = Scalar("Q", 0, 0xFFFF_FFFF_FFFF_FFFF)
I32 = Scalar("i", -(2**31), 2**31 - 1)
F32 = Scalar("f")
F64 = Scalar("d")
BOOL = BoolField()
CODE = CodeField()

_LEN = struct.Struct("<I")


# ----------------------------------------------------------------------- variable size


class Var:
    """A variable-size field: ``pack(value, w, name)`` / ``unpack(mv, off, name)``."""

    def pack(self, v: Any, w: Writer, name: str) -> None:
        raise NotImplementedError

    def unpack(self, mv: memoryview, off: int, name: str) -> tuple[Any, int]:
        raise NotImplementedError


class BytesField(Var):
    """u32 length + raw bytes."""

    def pack(self, v: Any, w: Writer, name: str) -> None:
        if not isinstance(v, (bytes, bytearray)):
            raise Invalid(ErrorCode.BAD_FIELD, f"{name}: expected bytes, got {type(v).__name__}")
        w.add(_LEN.pack(len(v)))
        w.add(bytes(v))

    def unpack(self, mv: memoryview, off: int, name: str) -> tuple[Any, int]:
        need(mv, off, 4, name)
        (n,) = _LEN.unpack_from(mv, off)
        off += 4
        need(mv, off, n, name)
        return bytes(mv[off : off + n]), off + n


class StrField(Var):
    """u32 length + UTF-8; ``choices`` restricts the value (refused with ``code``)."""

    def __init__(self, choices: Sequence[str] | None = None, code: ErrorCode = ErrorCode.BAD_FIELD):
        self.choices = frozenset(choices) if choices is not None else None
        self.code = code

    def _check(self, v: str, name: str) -> None:
        if self.choices is not None and v not in self.choices:
            raise Invalid(self.code, f"{name}: {v!r} not one of {sorted(self.choices)}")

    def pack(self, v: Any, w: Writer, name: str) -> None:
        if not isinstance(v, str):
            raise Invalid(ErrorCode.BAD_FIELD, f"{name}: expected str, got {type(v).__name__}")
        self._check(v, name)
        try:
            raw = v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise Invalid(ErrorCode.BAD_FIELD, f"{name}: {e}") from None
        w.add(_LEN.pack(len(raw)))
        w.add(raw)

    def unpack(self, mv: memoryview, off: int, name: str) -> tuple[Any, int]:
        need(mv, off, 4, name)
        (n,) = _LEN.unpack_from(mv, off)
        off += 4
        need(mv, off, n, name)
        try:
            v = str(mv[off : off + n], "utf-8")
        except UnicodeDecodeError as e:
            raise Invalid(ErrorCode.BAD_FIELD, f"{name}: {e}") from None
        self._check(v, name)
        return v, off + n


class EnumStrField(StrField):
    """A string enum (:class:`enum.StrEnum`) as its value's UTF-8; decodes to the member,
    refuses any other string (so a receiver never sees a state it does not know)."""

    def __init__(self, enum_cls: type[enum.StrEnum]) -> None:
        super().__init__([m.value for m in enum_cls])
        self.enum_cls = enum_cls

    def unpack(self, mv: memoryview, off: int, name: str) -> tuple[Any, int]:
        v, off = super().unpack(mv, off, name)
        return self.enum_cls(v), off


def _no_constant(c: str) -> Any:
    raise ValueError(f"non-standard JSON constant {c}")


class JsonField(Var):
    """A JSON object (dict) as canonical UTF-8 JSON text with a u32 length."""

    def pack(self, v: Any, w: Writer, name: str) -> None:
        if not isinstance(v, dict):
            raise Invalid(ErrorCode.BAD_FIELD, f"{name}: expected dict, got {type(v).__name__}")
        try:
            text = json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
            raw = text.encode("utf-8")
        except (TypeError, ValueError) as e:
            raise Invalid(ErrorCode.BAD_FIELD, f"{name}: not JSON-encodable: {e}") from None
        w.add(_LEN.pack(len(raw)))
        w.add(raw)

    def unpack(self, mv: memoryview, off: int, name: str) -> tuple[Any, int]:
        need(mv, off, 4, name)
        (n,) = _LEN.unpack_from(mv, off)
        off += 4
        need(mv, off, n, name)
        try:
            v = json.loads(str(mv[off : off + n], "utf-8"), parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise Invalid(ErrorCode.BAD_FIELD, f"{name}: bad JSON: {e}") from None
        if not isinstance(v, dict):
            raise Invalid(ErrorCode.BAD_FIELD, f"{name}: JSON is not an object")
        return v, off + n


class IntList(Var):
    """A count (``count_fmt``) followed by that many ``item`` scalars; a tuple in Python."""

    def __init__(self, count_fmt: str, item: Scalar, max_count: int) -> None:
        self.count = struct.Struct("<" + count_fmt)
        self.item = item
        self.max_count = max_count
        self._items: dict[int, struct.Struct] = {}   # n -> Struct of n items (small n only)

    def _struct(self, n: int) -> struct.Struct:
        s = self._items.get(n)
        if s is None:
            s = struct.Struct(f"<{n}{self.item.fmt}")
            if n <= 64:
                self._items[n] = s
        return s

    def pack(self, v: Any, w: Writer, name: str) -> None:
        if not isinstance(v, (tuple, list)):
            raise Invalid(ErrorCode.BAD_FIELD, f"{name}: expected tuple, got {type(v).__name__}")
        if len(v) > self.max_count:
            raise Invalid(ErrorCode.BAD_FIELD, f"{name}: {len(v)} items, max {self.max_count}")
        it = self.item
        if len(v) > 16 and not it.is_float and set(map(type, v)) == {int} and it.lo <= min(v) and max(v) <= it.hi:
            items = v   # (a long list of plain ints in range: checked in C, as to_wire would one by one)
        else:
            items = [it.to_wire(x, name, "") for x in v]
        w.add(self.count.pack(len(items)))
        w.add(self._struct(len(items)).pack(*items))

    def unpack(self, mv: memoryview, off: int, name: str) -> tuple[Any, int]:
        need(mv, off, self.count.size, name)
        (n,) = self.count.unpack_from(mv, off)
        off += self.count.size
        if n > self.max_count:
            raise Invalid(ErrorCode.BAD_FIELD, f"{name}: {n} items, max {self.max_count}")
        s = self._struct(n)
        need(mv, off, s.size, name)
        return s.unpack_from(mv, off), off + s.size


class Records(Var):
    """A u16 count followed by that many records of a :func:`record` dataclass."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.schema: Schema = cls.__wire_schema__  # type: ignore[attr-defined]
        self.count = struct.Struct("<H")

    def pack(self, v: Any, w: Writer, name: str) -> None:
        if not isinstance(v, (tuple, list)):
            raise Invalid(ErrorCode.BAD_FIELD, f"{name}: expected tuple, got {type(v).__name__}")
        if len(v) > 0xFFFF:
            raise Invalid(ErrorCode.BAD_FIELD, f"{name}: {len(v)} records, max 65535")
        w.add(self.count.pack(len(v)))
        for i, r in enumerate(v):
            if type(r) is not self.cls:
                raise Invalid(ErrorCode.BAD_FIELD, f"{name}[{i}]: expected {self.cls.__name__}")
            self.schema.pack(r, w, f"{name}[{i}]")

    def unpack(self, mv: memoryview, off: int, name: str) -> tuple[Any, int]:
        need(mv, off, 2, name)
        (n,) = self.count.unpack_from(mv, off)
        off += 2
        out = []
        for i in range(n):
            values, off = self.schema.unpack(mv, off, f"{name}[{i}]")
            out.append(self.cls(*values))
        return tuple(out), off


# Activation dtypes on the wire: code byte -> little-endian numpy dtype.
DTYPE_CODES: dict[int, np.dtype] = {1: np.dtype("<f4"), 2: np.dtype("<f2")}
DTYPE_NAMES: dict[str, int] = {"f32": 1, "f16": 2}
MAX_WIDTH = 65536
ARRAY_HEAD = struct.Struct("<BII")  # dtype code, rows, width
ARRAY_ALIGN = 8  # data starts at a payload offset that is a multiple of this
_ZEROS = bytes(ARRAY_ALIGN)


def dtype_code(dt: np.dtype) -> int | None:
    if dt.kind == "f" and dt.itemsize == 4:
        return 1
    if dt.kind == "f" and dt.itemsize == 2:
        return 2
    return None


class ArrayField(Var):
    """2-D f32/f16 tensor: dtype u8, rows u32, width u32, zero pad to 8, raw data.

    Must be the last field: the data runs to the end of the payload, and its length must
    equal rows * width * itemsize. Decoding does not copy: the array is a read-only
    ``np.frombuffer`` view of the received payload buffer.
    """

    def pack(self, v: Any, w: Writer, name: str) -> None:
        if not isinstance(v, np.ndarray):
            raise Invalid(ErrorCode.BAD_FIELD, f"{name}: expected numpy array, got {type(v).__name__}")
        code = dtype_code(v.dtype)
        if code is None:
            raise Invalid(ErrorCode.BAD_DTYPE, f"{name}: dtype {v.dtype} (only float32/float16)")
        if v.ndim != 2 or not 1 <= v.shape[1] <= MAX_WIDTH:
            raise Invalid(ErrorCode.BAD_SHAPE, f"{name}: shape {v.shape} (need (rows, 1..{MAX_WIDTH}))")
        if v.shape[0] > 0xFFFF_FFFF:
            raise Invalid(ErrorCode.BAD_SHAPE, f"{name}: {v.shape[0]} rows")
        data = np.ascontiguousarray(v, dtype=DTYPE_CODES[code])
        w.add(ARRAY_HEAD.pack(code, v.shape[0], v.shape[1]))
        w.add(_ZEROS[: -w.size % ARRAY_ALIGN])
        w.add(memoryview(data.reshape(-1).view(np.uint8)))  # no copy; works for 0 rows too

    def unpack(self, mv: memoryview, off: int, name: str) -> tuple[Any, int]:
        need(mv, off, ARRAY_HEAD.size, name)
        code, rows, width = ARRAY_HEAD.unpack_from(mv, off)
        off += ARRAY_HEAD.size
        dt = DTYPE_CODES.get(code)
        if dt is None:
            raise Invalid(ErrorCode.BAD_DTYPE, f"{name}: dtype code {code}")
        if not 1 <= width <= MAX_WIDTH:
            raise Invalid(ErrorCode.BAD_SHAPE, f"{name}: width {width}")
        pad = -off % ARRAY_ALIGN
        need(mv, off, pad, name)
        if any(mv[off : off + pad]):
            raise Invalid(ErrorCode.BAD_FIELD, f"{name}: nonzero padding")
        off += pad
        nbytes = rows * width * dt.itemsize
        if nbytes != len(mv) - off:
            raise Invalid(ErrorCode.BAD_SHAPE, f"{name}: ({rows}, {width}) {dt} needs {nbytes} bytes, {len(mv) - off} present")
        arr = np.frombuffer(mv, dtype=dt, count=rows * width, offset=off).reshape(rows, width)
        return arr, off + nbytes


STR = StrField()
BYTES = BytesField()
JSON = JsonField()
ARRAY = ArrayField()

FieldType = Scalar | Var


# ------------------------------------------------------------------------ compilation


def wf(ftype: FieldType, **kw: Any) -> Any:
    """Declare a dataclass field's wire type (``term: int = wf(U64)``)."""
    return dataclasses.field(metadata={"wire": ftype}, **kw)


class _Run:
    """Consecutive scalars packed with one struct.

    ``fields``: (name, type) pairs in order; ``convert``: (index, name, type) of those
    whose decoded value is not the raw struct value (bools, error codes), so decoding
    the others is one ``unpack_from``."""

    __slots__ = ("names", "fields", "convert", "st")

    def __init__(self, names: list[str], types: list[Scalar]) -> None:
        self.names = names
        self.fields = tuple(zip(names, types))
        self.convert = tuple((i, n, t) for i, (n, t) in enumerate(self.fields)
                             if type(t).from_wire is not Scalar.from_wire)
        self.st = struct.Struct("<" + "".join(t.fmt for t in types))


class Schema:
    """Compiled codec for one dataclass: ``pack(obj, w)`` and ``unpack(mv, off)``."""

    def __init__(self, cls: type, fields: list[tuple[str, FieldType]]) -> None:
        self.cls = cls
        self.names = [n for n, _ in fields]
        self.steps: list[_Run | tuple[str, Var]] = []
        run_n: list[str] = []
        run_t: list[Scalar] = []
        for n, t in fields:
            if isinstance(t, Scalar):
                run_n.append(n)
                run_t.append(t)
                continue
            if run_n:
                self.steps.append(_Run(run_n, run_t))
                run_n, run_t = [], []
            self.steps.append((n, t))
        if run_n:
            self.steps.append(_Run(run_n, run_t))

    def pack(self, obj: Any, w: Writer, prefix: str = "") -> None:
        for step in self.steps:
            if isinstance(step, _Run):
                vals = [t.to_wire(getattr(obj, n), prefix, n) for n, t in step.fields]
                try:
                    w.add(step.st.pack(*vals))
                except (struct.error, OverflowError) as e:  # e.g. a float beyond f32 range
                    raise Invalid(ErrorCode.BAD_FIELD, f"{prefix}{'/'.join(step.names)}: {e}") from None
            else:
                n, t = step
                t.pack(getattr(obj, n), w, prefix + n)

    def unpack(self, mv: memoryview, off: int, prefix: str = "") -> tuple[list[Any], int]:
        out: list[Any] = []
        for step in self.steps:
            if isinstance(step, _Run):
                size = step.st.size
                if off + size > len(mv):
                    need(mv, off, size, prefix + step.names[0])
                raw = step.st.unpack_from(mv, off)
                off += size
                if step.convert:
                    vals = list(raw)
                    for i, n, t in step.convert:
                        vals[i] = t.from_wire(vals[i], prefix, n)
                    out.extend(vals)
                else:
                    out.extend(raw)
            else:
                n, t = step
                v, off = t.unpack(mv, off, prefix + n)
                out.append(v)
        return out, off


def compile_schema(cls: type) -> Schema:
    fields = []
    for f in dataclasses.fields(cls):
        t = f.metadata.get("wire")
        if t is None:
            raise TypeError(f"{cls.__name__}.{f.name} has no wire type")
        fields.append((f.name, t))
    for n, t in fields[:-1]:
        if isinstance(t, ArrayField):
            raise TypeError(f"{cls.__name__}.{n}: the array must be the last field")
    return Schema(cls, fields)


def record(cls: type) -> type:
    """Class decorator for nested records (``Segment``): compiles and attaches a schema."""
    cls.__wire_schema__ = compile_schema(cls)  # type: ignore[attr-defined]
    return cls


Check = Callable[[Any], None]
