"""A GGUF metadata reader fast enough for a tokenizer: :class:`BulkReader`.

Below both ``engine`` (which peeks at a slice's shape before loading it) and ``models``
(which reads, slices and indexes model files); ``models.gguf_info.open_gguf`` wraps it
with the checks that turn a bad file into a ``ModelFileError``.
"""

from __future__ import annotations

import struct
import sys
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

__all__ = ["BulkReader", "MAX_ARRAY_ELEMENTS", "PARSE_ERRORS"]

# What a reader raises on a file cut short or corrupt (a short read surfaces as a reshape
# ValueError or an IndexError somewhere in the header or the tensor table): callers turn
# these into their own one-line errors.
PARSE_ERRORS = (ValueError, IndexError, OverflowError, UnicodeDecodeError, KeyError)

# A metadata array longer than this is refused (a ValueError, which open_gguf reports as a
# corrupt file): the reader keeps a small array object per element, so a crafted file of
# empty strings could otherwise ask for gigabytes. The largest real tokenizers hold ~300k
# tokens and merges.
MAX_ARRAY_ELEMENTS = 1 << 23


class BulkReader(GGUFReader):
    """GGUFReader that parses metadata arrays in bulk, over a plain ndarray view of its memmap.

    A tokenizer is a few arrays of ~50k-260k elements, and the stock reader parses each
    element with its own recursive call (enum lookup, a dtype, a slice and a byte-order
    view): ~1 s for SmolLM2's header, most of the time of slicing a small model (so of a
    failover's resume, docs/mesh.md). :meth:`_get_field_parts` reads a non-empty array of
    scalars as one array and walks a string array's length prefixes with ``struct``, and
    hands back the same fields (one part per element, the same data indices and types):
    ~10x faster. Slicing ``np.memmap`` pays ``memmap.__array_finalize__`` per slice; a
    plain view of the same mapping behaves identically. Tensor data arrays are then plain
    views of the mapping too (still paged lazily).
    """

    def _plain(self) -> np.ndarray:
        plain = self.__dict__.get("_plain_data")
        if plain is None:
            plain = self.data.view(np.ndarray)
            self.__dict__["_plain_data"] = plain
        return plain

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
        count = int(count)
        dt = np.dtype(dtype)
        arr = self._plain()[offset:offset + dt.itemsize * count].view(dtype=dt)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
        # The stock parser handles scalars, strings, empty and nested arrays, and files of
        # the other byte order; this one only the big arrays of a native-order file.
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        if raw_itype.shape != (1,) or alen.shape != (1,):
            raise ValueError(f"array header at {orig_offs} runs past the end of the file")
        itype = GGUFValueType(int(raw_itype[0]))
        n = int(alen[0])
        if n > MAX_ARRAY_ELEMENTS:
            raise ValueError(f"metadata array of {n} elements at {orig_offs} (at most {MAX_ARRAY_ELEMENTS})")
        nptype = self.gguf_scalar_to_np.get(itype)
        if n == 0 or (nptype is None and itype != GGUFValueType.STRING):
            return super()._get_field_parts(orig_offs, raw_type)
        offs = orig_offs + 12
        parts: list[Any] = [raw_itype, alen]
        if nptype is not None:
            values = self._get(offs, nptype, n)
            if values.shape[0] != n:
                raise ValueError(f"array of {n} elements at {orig_offs} runs past the end of the file")
            parts += list(values.reshape(n, 1))
            return 12 + int(values.nbytes), parts, list(range(2, 2 + n)), [GGUFValueType.ARRAY, itype]
        plain = self._plain()
        size = plain.shape[0]
        length = struct.Struct("<Q").unpack_from
        for _ in range(n):
            if offs + 8 > size:
                raise ValueError(f"string array at {orig_offs} runs past the end of the file")
            end = offs + 8 + length(plain, offs)[0]
            if end > size:
                raise ValueError(f"string array at {orig_offs} runs past the end of the file")
            parts.append(plain[offs:offs + 8].view(np.uint64))
            parts.append(plain[offs + 8:end])
            offs = end
        return offs - orig_offs, parts, list(range(3, 2 + 2 * n, 2)), [GGUFValueType.ARRAY, itype]
