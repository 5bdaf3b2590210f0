"""Split a GGUF into parts as ``llama-gguf-split --split`` does (with gguf-py's writer):
``<stem>-00001-of-0000N.gguf`` ..., the first part holding the metadata, every part its
``split.*`` keys and a run of the tensors. For tests of split models."""

from __future__ import annotations

import math
from pathlib import Path

from gguf import GGUFReader, GGUFWriter

from meshnode.models.slicer import _add_raw_tensor, _read_kvs


def split_gguf(src: Path, dest_dir: Path, parts: int) -> Path:
    """Write ``src`` as ``parts`` files (about: a run of tensors each) in ``dest_dir``;
    return the first part's path."""
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    dest_dir.mkdir(parents=True, exist_ok=True)
    per_part = math.ceil(len(reader.tensors) / parts)
    writer = GGUFWriter(dest_dir / src.name, arch, split_max_tensors=per_part)
    for kv in _read_kvs(reader, src):
        if kv.key != "general.architecture":
            writer.add_key_value(kv.key, kv.value, kv.vtype, sub_type=kv.sub_type)
    for t in reader.tensors:
        _add_raw_tensor(writer, t.name, t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data)
    writer.close()
    (first,) = dest_dir.glob(f"{src.stem}-00001-of-*.gguf")
    return first
