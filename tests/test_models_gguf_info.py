"""read_model_info on real and synthetic GGUFs, and every way a file can be bad."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshnode.errors import MeshnodeError
from meshnode.models.errors import ModelFileError
from meshnode.models.gguf_info import block_index, read_model_info


@pytest.mark.slow
def test_smollm2_info(smollm2):
    info = read_model_info(smollm2.path)
    assert info.architecture == "llama"
    assert info.n_layers == 30
    assert info.n_embd == 576
    assert info.n_vocab == 49152
    assert info.file_type_name == "MOSTLY_Q4_1"
    assert info.tied_embeddings  # no output.weight
    assert info.chat_template and "im_start" in info.chat_template
    assert info.tokenizer_model == "gpt2"
    assert len(info.blocks) == 30
    assert all(len(b) == 9 for b in info.blocks)
    assert {t.name for t in info.blocks[7]} >= {"blk.7.attn_q.weight", "blk.7.ffn_down.weight"}
    assert {t.name for t in info.other_tensors} == {"token_embd.weight", "output_norm.weight"}
    assert info.size == smollm2.path.stat().st_size
    assert info.n_tensor_bytes < info.size


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_synthetic_info(synthetic_gguf, arch):
    p = synthetic_gguf(architecture=arch, n_layer=3, vocab=300)
    info = read_model_info(p)
    assert (info.architecture, info.n_layers, info.n_embd, info.n_vocab) == (arch, 3, 64, 300)
    assert not info.tied_embeddings
    assert info.file_type_name == "ALL_F32"


def test_block_index():
    assert block_index("blk.12.attn_q.weight") == 12
    assert block_index("token_embd.weight") is None
    assert block_index("blkx.1.a") is None


def test_missing_file(tmp_path: Path):
    with pytest.raises(ModelFileError, match="not found"):
        read_model_info(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path: Path):
    p = tmp_path / "notes.gguf"
    p.write_text("hello, this is certainly not a model file\n" * 10)
    with pytest.raises(ModelFileError, match="not a GGUF file") as ei:
        read_model_info(p)
    assert str(p) in str(ei.value)
    assert isinstance(ei.value, MeshnodeError)


def test_empty_file(tmp_path: Path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        read_model_info(p)


@pytest.mark.parametrize("keep", [30, 200, 5000, 0.6, 0.999])
def test_truncated(synthetic_gguf, tmp_path: Path, keep):
    src = synthetic_gguf()
    data = src.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:n])
    with pytest.raises(ModelFileError, match="truncated") as ei:
        read_model_info(p)
    assert str(p) in str(ei.value)


def test_missing_block_count(synthetic_gguf, tmp_path: Path):
    import gguf

    # a GGUF with an architecture but no {arch}.block_count
    p = tmp_path / "nokeys.gguf"
    w = gguf.GGUFWriter(p, "llama")
    w.add_uint32("llama.embedding_length", 8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="llama.block_count"):
        read_model_info(p)


# -- metadata arrays parsed in bulk (gguf_info._Reader) and packed in bulk (gguf_write) ----

def _arrays_gguf(synthetic_gguf):
    """A small model plus arrays of every element type the bulk paths take (bools: the
    writer hands them to the stock code), one of a single element, and a scalar after."""
    from gguf import GGUFValueType as T

    extra = (
        ("test.u8", [0, 1, 255], T.ARRAY, T.UINT8),
        ("test.i16", [-32768, 7, 32767], T.ARRAY, T.INT16),
        ("test.u64", [0, 2**64 - 1], T.ARRAY, T.UINT64),
        ("test.f64", [1.5, -2.25e300], T.ARRAY, T.FLOAT64),
        ("test.f32", [0.1, 3.0e38, -1.0], T.ARRAY, T.FLOAT32),
        ("test.bools", [True, False, True], T.ARRAY, T.BOOL),
        ("test.one", ["solo"], T.ARRAY, T.STRING),
        ("test.strings", ["", "é", "a b", "x" * 300], T.ARRAY, T.STRING),
        ("test.scalar", "after the arrays", T.STRING, None),
    )
    return synthetic_gguf("arrays.gguf", vocab=300, extra_metadata=extra)


def test_the_bulk_array_parser_gives_the_stock_readers_fields(synthetic_gguf):
    from gguf import GGUFReader

    from meshnode.models.gguf_info import open_gguf

    p = _arrays_gguf(synthetic_gguf)
    stock, fast = GGUFReader(p), open_gguf(p)
    assert list(stock.fields) == list(fast.fields)
    for key, a in stock.fields.items():
        b = fast.fields[key]
        assert (a.offset, a.name, a.types, a.data) == (b.offset, b.name, b.types, b.data), key
        assert [(x.dtype, x.shape, x.tobytes()) for x in a.parts] == \
            [(y.dtype, y.shape, y.tobytes()) for y in b.parts], key
        assert a.contents() == b.contents(), key
    assert fast.fields["test.strings"].contents() == ["", "é", "a b", "x" * 300]
    assert len(fast.fields["tokenizer.ggml.tokens"].data) == 300
    assert [(t.name, t.data_offset, t.n_bytes) for t in stock.tensors] == \
        [(t.name, t.data_offset, t.n_bytes) for t in fast.tensors]


def test_the_bulk_array_writer_writes_the_stock_writers_bytes(synthetic_gguf, tmp_path: Path, monkeypatch):
    import gguf

    from meshnode.models import gguf_write, slicer

    src = _arrays_gguf(synthetic_gguf)
    for name, ends in (("first", (True, False)), ("last", (False, True)), ("middle", (False, False))):
        slicer.write_slice(src, 1, 3, tmp_path / f"{name}-bulk.gguf", keep_embedding=ends[0], keep_head=ends[1])
        with monkeypatch.context() as m:
            m.setattr(gguf_write, "_Writer", gguf.GGUFWriter)
            slicer.write_slice(src, 1, 3, tmp_path / f"{name}-stock.gguf", keep_embedding=ends[0], keep_head=ends[1])
        assert (tmp_path / f"{name}-bulk.gguf").read_bytes() == (tmp_path / f"{name}-stock.gguf").read_bytes()


def test_a_cut_anywhere_in_the_metadata_arrays_is_a_truncated_file(synthetic_gguf, tmp_path: Path):
    from gguf import GGUFReader

    src = _arrays_gguf(synthetic_gguf)
    data = src.read_bytes()
    fields = GGUFReader(src).fields
    start = fields["tokenizer.ggml.tokens"].offset
    end = fields["test.scalar"].offset
    p = tmp_path / "cut.gguf"
    for n in range(start, end, max(1, (end - start) // 97)):
        p.write_bytes(data[:n])
        with pytest.raises(ModelFileError, match="truncated"):
            read_model_info(p)


def test_a_string_array_whose_lengths_point_past_the_file_is_refused(synthetic_gguf, tmp_path: Path):
    import struct

    from gguf import GGUFReader

    src = _arrays_gguf(synthetic_gguf)
    data = bytearray(src.read_bytes())
    field = GGUFReader(src).fields["test.strings"]
    first_len = field.offset + 8 + len("test.strings") + 4 + 4 + 8   # key, type, item type, count
    for bad in (2**63, len(data)):
        data[first_len:first_len + 8] = struct.pack("<Q", bad)
        p = tmp_path / "lying.gguf"
        p.write_bytes(bytes(data))
        with pytest.raises(ModelFileError, match="truncated or corrupt"):
            read_model_info(p)


def test_an_array_longer_than_any_tokenizer_is_refused_before_it_is_read(synthetic_gguf, tmp_path: Path):
    # a count of 2**40 empty strings would be a few TB of small objects: refused up front
    import struct

    from gguf import GGUFReader

    from meshnode.gguf_reader import MAX_ARRAY_ELEMENTS

    src = _arrays_gguf(synthetic_gguf)
    data = bytearray(src.read_bytes())
    for key in ("test.strings", "test.u64"):
        field = GGUFReader(src).fields[key]
        count = field.offset + 8 + len(key) + 4 + 4   # key, type, item type
        bad = bytearray(data)
        bad[count:count + 8] = struct.pack("<Q", 2**40)
        p = tmp_path / "huge.gguf"
        p.write_bytes(bytes(bad))
        with pytest.raises(ModelFileError, match=f"at most {MAX_ARRAY_ELEMENTS}"):
            read_model_info(p)


def test_corrupted_metadata_is_refused_or_read_as_gguf_reads_it(synthetic_gguf):
    """Differential fuzzing: bytes of the metadata changed at random. open_gguf either
    refuses the file with ModelFileError or returns the fields gguf's own reader returns
    for it (when that reader accepts it too)."""
    import tempfile

    from gguf import GGUFReader
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from meshnode.models.gguf_info import open_gguf

    src = _arrays_gguf(synthetic_gguf)
    data = src.read_bytes()
    header = GGUFReader(src).fields["test.scalar"].offset + 64   # the metadata, and a bit more
    folder = Path(tempfile.mkdtemp(dir=src.parent))

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(st.tuples(st.integers(24, header - 1), st.integers(0, 255)), min_size=1, max_size=4))
    def check(edits):
        bad = bytearray(data)
        for at, value in edits:
            bad[at] = value
        p = folder / "fuzz.gguf"
        p.write_bytes(bytes(bad))
        try:
            ours = open_gguf(p)
        except ModelFileError:
            return
        try:
            theirs = GGUFReader(p)
        except Exception:  # noqa: BLE001 - gguf's reader may fail where ours stops earlier or differently
            return
        assert list(ours.fields) == list(theirs.fields)
        for key, a in theirs.fields.items():
            b = ours.fields[key]
            assert (a.types, a.data) == (b.types, b.data), key
            assert [x.tobytes() for x in a.parts] == [y.tobytes() for y in b.parts], key

    check()
