"""ViewReader (runtime/gguf_view.py) against gguf-py's stock GGUFReader, its oracle: every field's parts
(contents, dtypes, shapes), data indices and types, and every tensor, the same on the default model's file,
on a small GGUF written with gguf-py's GGUFWriter, and on a hand-written one with what the writer refuses
(empty arrays, strings that are not UTF-8)."""
from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType as VT

from chatserve.model_source.gguf_check import CheckedReader
from chatserve.runtime import gguf_view
from chatserve.runtime.gguf_view import ViewReader


def assert_same_reader(ours: GGUFReader, stock: GGUFReader) -> int:
    """Every field and tensor of `ours` equals `stock`'s; returns how many field parts were compared."""
    assert list(ours.fields) == list(stock.fields)
    compared = 0
    for name, want in stock.fields.items():
        got = ours.fields[name]
        assert (got.offset, got.name, got.data, got.types) == (want.offset, want.name, want.data, want.types), name
        assert len(got.parts) == len(want.parts), name
        for a, b in zip(got.parts, want.parts):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
            compared += 1
        if want.types and want.types[-1] != VT.ARRAY:
            assert _contents(got) == _contents(want), name
    assert ours.data_offset == stock.data_offset and ours.alignment == stock.alignment
    assert len(ours.tensors) == len(stock.tensors)
    for t, s in zip(ours.tensors, stock.tensors):
        assert (t.name, t.tensor_type, t.n_elements, t.n_bytes, t.data_offset) == \
            (s.name, s.tensor_type, s.n_elements, s.n_bytes, s.data_offset)
        assert t.shape.tolist() == s.shape.tolist() and t.data.dtype == s.data.dtype
        assert t.data.shape == s.data.shape and t.data.tobytes() == s.data.tobytes()
    return compared


def _contents(field) -> object:
    """A field's values, or the type of the error reading them raises (bytes that are not UTF-8)."""
    try:
        return field.contents()
    except Exception as e:
        return type(e)


@pytest.fixture
def fast_path(monkeypatch):
    """Count the arrays ViewReader builds itself (so a comparison cannot pass by falling back)."""
    monkeypatch.setattr(gguf_view, "FAST_ARRAYS", True)
    calls: list[int] = []
    real = ViewReader._array_parts

    def counted(self, offs):
        out = real(self, offs)
        calls.append(offs if out is not None else -1)
        return out

    monkeypatch.setattr(ViewReader, "_array_parts", counted)
    return calls


def test_default_model_fields_match_stock_reader(default_path, fast_path):
    compared = assert_same_reader(ViewReader(default_path), GGUFReader(default_path))
    assert compared > 100_000                       # the vocabulary and merges went through both
    assert len([c for c in fast_path if c >= 0]) >= 3


def test_checked_reader_matches_stock_reader_below_its_big_array_cut(default_path, fast_path):
    ours, stock = CheckedReader(default_path), GGUFReader(default_path)
    small = [k for k, f in stock.fields.items() if len(f.parts) < CheckedReader.BIG_ARRAY]
    assert small and all(ours.fields[k].data == stock.fields[k].data for k in small)
    assert all(ours.fields[k].contents() == stock.fields[k].contents() for k in small
               if stock.fields[k].types[-1] != VT.ARRAY)


def write_with_gguf_writer(path: Path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("t.strings", ["a", "", "héllo wörld", "日本語", "<|im_end|>", " ", "x" * 300])
    w.add_array("t.one_empty_string", [""])
    w.add_array("t.floats", [0.5, -1.25, 3e30])
    w.add_array("t.bools", [True, False, True])
    for vt in (VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64, VT.FLOAT64):
        w.add_key_value(f"t.{vt.name.lower()}s", [0, 1, 2, 127], VT.ARRAY, sub_type=vt)
    w.add_array("t.nested_ints", [[1, 2, 3], [4, 5], [6]])
    w.add_array("t.nested_strings", [["a", "bc"], ["", "dé"]])
    w.add_array("t.long_ints", list(range(5000)))
    w.add_array("t.long_strings", [f"tok{i}" * (i % 5) for i in range(5000)])
    w.add_string("t.scalar_string", "plain")
    w.add_uint32("t.scalar_u32", 7)
    w.add_bool("t.scalar_bool", True)
    w.add_tensor("a.weight", np.arange(24, dtype=np.float32).reshape(4, 6))
    w.add_tensor("b.weight", np.arange(8, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_writer_file_fields_match_stock_reader(tmp_path, fast_path):
    path = tmp_path / "w.gguf"
    write_with_gguf_writer(path)
    ours, stock = ViewReader(str(path)), GGUFReader(str(path))
    assert assert_same_reader(ours, stock) > 15_000
    assert ours.fields["t.strings"].contents() == ["a", "", "héllo wörld", "日本語", "<|im_end|>", " ", "x" * 300]
    assert ours.fields["t.nested_ints"].types == [VT.ARRAY, VT.ARRAY, VT.INT32]
    assert -1 in fast_path                          # nested arrays went to gguf-py's own method
    assert len([c for c in fast_path if c >= 0]) >= 14


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + payload


def _string(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def test_hand_written_edge_cases_match_stock_reader(tmp_path, fast_path):
    kvs = [
        _kv("e.empty_strings", VT.ARRAY, struct.pack("<IQ", VT.STRING, 0)),
        _kv("e.empty_ints", VT.ARRAY, struct.pack("<IQ", VT.INT32, 0)),
        _kv("e.empty_of_unknown_type", VT.ARRAY, struct.pack("<IQ", 99, 0)),
        _kv("e.not_utf8", VT.ARRAY, struct.pack("<IQ", VT.STRING, 3) + _string(b"\xff\xfe") + _string(b"")
            + _string(b"\x00z")),
        _kv("e.odd_offsets", VT.ARRAY, struct.pack("<IQ", VT.UINT16, 3) + struct.pack("<3H", 1, 65535, 7)),
        _kv("e.after", VT.STRING, _string(b"end")),
    ]
    body = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs)
    path = tmp_path / "e.gguf"
    path.write_bytes(body + b"\0" * (-len(body) % 32))
    ours, stock = ViewReader(str(path)), GGUFReader(str(path))
    assert assert_same_reader(ours, stock) > 10
    assert ours.fields["e.empty_strings"].types == [VT.ARRAY] and ours.fields["e.after"].contents() == "end"
    assert len(fast_path) == 5


def test_truncated_string_array_is_an_error(tmp_path):
    body = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _kv("t", VT.ARRAY, struct.pack("<IQ", VT.STRING, 2)
                                                        + _string(b"ab") + struct.pack("<Q", 1000) + b"cd")
    path = tmp_path / "t.gguf"
    path.write_bytes(body)
    with pytest.raises(ValueError, match="past the end"):
        ViewReader(str(path))


def test_unchecked_gguf_version_takes_the_stock_path(tmp_path, monkeypatch):
    path = tmp_path / "w.gguf"
    write_with_gguf_writer(path)
    monkeypatch.setattr(gguf_view, "FAST_ARRAYS", False)
    monkeypatch.setattr(ViewReader, "_array_parts", lambda self, offs: pytest.fail("fast path taken"))
    assert_same_reader(ViewReader(str(path)), GGUFReader(str(path)))
