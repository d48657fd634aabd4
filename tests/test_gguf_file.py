"""kvserve's GGUF header reader (kvserve/loading/gguf_file.py) against gguf-py's GGUFReader, the
library it stands in for: every metadata value and every tensor's type, shape, offset, size and
data, on the bundled model and on files of random metadata written by gguf-py; truncated and
malformed files fail with an error and never hang."""
from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.loading.errors import ModelLoadError
from kvserve.loading.gguf import _field, open_gguf
from kvserve.loading.gguf_file import GGUFFile, Unreadable

VT = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType


def assert_same(ours: GGUFFile, reader: gguf.GGUFReader) -> None:
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]  # (its header pseudo-fields)
    assert list(ours.fields) == list(ours.types) == keys
    for k in keys:
        want = reader.fields[k].contents()
        kinds = reader.fields[k].types
        assert ours.types[k] == (kinds[0], kinds[1] if kinds[0] == VT.ARRAY else None), k
        assert ours.fields[k] == want and type(ours.fields[k]) is type(want), k
        if isinstance(want, list) and want:
            assert [type(v) for v in ours.fields[k]] == [type(v) for v in want], k
    assert len(ours.tensors) == len(reader.tensors)
    for t, r in zip(ours.tensors, reader.tensors):
        assert (t.name, t.tensor_type, t.shape, t.data_offset, t.n_bytes) == (
            r.name, r.tensor_type, tuple(int(d) for d in r.shape), int(r.data_offset), int(r.n_bytes))
        assert t.data.dtype == r.data.dtype and t.data.shape == r.data.shape, t.name
        assert np.array_equal(t.data, r.data, equal_nan=True), t.name
        assert not t.data.flags.writeable


def test_bundled_model_equals_gguf_py(gemma_path, gemma_gguf_reader):
    ours = GGUFFile(gemma_path)
    assert_same(ours, gemma_gguf_reader)
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 262144
    assert ours.data_start == gemma_gguf_reader.data_offset


SCALARS = {  # value type -> values of it
    VT.UINT8: st.integers(0, 255), VT.INT8: st.integers(-128, 127),
    VT.UINT16: st.integers(0, 2**16 - 1), VT.INT16: st.integers(-2**15, 2**15 - 1),
    VT.UINT32: st.integers(0, 2**32 - 1), VT.INT32: st.integers(-2**31, 2**31 - 1),
    VT.UINT64: st.integers(0, 2**64 - 1), VT.INT64: st.integers(-2**63, 2**63 - 1),
    VT.FLOAT32: st.floats(width=32, allow_nan=False), VT.FLOAT64: st.floats(allow_nan=False),
    VT.BOOL: st.booleans(), VT.STRING: st.text(max_size=12),
}
VALUES = st.one_of(
    *(st.tuples(st.just(vt), values, st.none()) for vt, values in SCALARS.items()),
    *(st.tuples(st.just(VT.ARRAY), st.lists(values, min_size=1, max_size=6), st.just(vt)) for vt, values in SCALARS.items()),
)
TENSORS = st.lists(st.tuples(st.sampled_from([Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.BF16]),
                             st.integers(1, 3), st.integers(1, 2)), max_size=4)


def write(path, metadata: dict, tensors: list, alignment: int | None = None,
          endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> None:
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (vtype, value, sub) in metadata.items():
        w.add_key_value(key, value, vtype, sub_type=sub)
    rng = np.random.default_rng(len(tensors))
    for i, (qtype, rows, blocks) in enumerate(tensors):
        x = rng.standard_normal((rows, 32 * blocks)).astype(np.float32)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(f"t{i}", x.astype(np.float16) if qtype == Q.F16 else x)
        else:
            w.add_tensor(f"t{i}", gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(metadata=st.dictionaries(st.text("abcxyz.", min_size=1, max_size=6).filter(lambda k: k != "general.alignment"),
                                VALUES, max_size=8),
       tensors=TENSORS, alignment=st.sampled_from([None, 8, 64]), big=st.booleans())
def test_random_files_equal_gguf_py(tmp_path, metadata, tensors, alignment, big):
    path = tmp_path / "x.gguf"
    write(path, metadata, tensors, alignment, gguf.GGUFEndian.BIG if big else gguf.GGUFEndian.LITTLE)
    assert_same(GGUFFile(path), gguf.GGUFReader(str(path)))


def test_arrays_can_be_left_out(tmp_path):
    path = tmp_path / "x.gguf"
    write(path, {"v": (VT.ARRAY, ["a", "b"], VT.STRING), "n": (VT.UINT32, 7, None)}, [(Q.Q8_0, 2, 1)])
    ours = GGUFFile(path, values=False)
    assert ours.fields == {"general.architecture": "llama", "n": 7}
    assert ours.types["v"] == (VT.ARRAY, VT.STRING)
    assert [(t.name, t.shape, t.n_bytes) for t in ours.tensors] == [("t0", (32, 2), 68)]


def test_every_truncation_fails_with_an_error(tmp_path):
    path = tmp_path / "x.gguf"
    write(path, {"s": (VT.STRING, "hello", None), "v": (VT.ARRAY, ["a", "bc"], VT.STRING),
                 "f": (VT.ARRAY, [1.5, 2.5], VT.FLOAT32)}, [(Q.F32, 2, 1), (Q.Q4_0, 1, 2)])
    whole = path.read_bytes()
    end = max(t.data_offset + t.n_bytes for t in GGUFFile(path).tensors)  # (then only padding)
    cut = tmp_path / "cut.gguf"
    for n in range(end):
        cut.write_bytes(whole[:n])
        with pytest.raises((ValueError, struct.error)):
            GGUFFile(cut)
        with pytest.raises(ModelLoadError, match="cut.gguf.*truncated or corrupt"):
            open_gguf(cut)


@pytest.mark.parametrize("header,message", [
    (b"GGML" + bytes(20), "no GGUF magic"),
    (struct.pack("<4sIQQ", b"GGUF", 1, 0, 0), "GGUF version 1"),
    (struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 13),
     "unknown metadata value type 13"),
    (struct.pack("<4sIQQ", b"GGUF", 3, 0, 2) + (struct.pack("<Q", 1) + b"k" + struct.pack("<IB", 0, 1)) * 2,
     "'k' appears twice"),
    (struct.pack("<4sIQQ", b"GGUF", 3, 1, 0) + struct.pack("<Q", 1) + b"w" + struct.pack("<IQIQ", 1, 32, 99, 0),
     "unknown ggml type 99"),
    (struct.pack("<4sIQQ", b"GGUF", 3, 1, 0) + struct.pack("<Q", 1) + b"w" + struct.pack("<IQIQ", 1, 33, 8, 0),
     "not whole Q8_0 blocks"),
    (struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", 17) + b"general.alignment" + struct.pack("<II", 4, 3),
     "power of two"),
    (struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 0, 2**62),
     "past the end"),
])
def test_malformed_headers_say_what_is_wrong(tmp_path, header, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(header)
    with pytest.raises(ValueError, match=message):
        GGUFFile(path)


def test_a_string_that_is_not_utf8_fails_only_where_it_is_read(tmp_path):
    path = tmp_path / "x.gguf"
    write(path, {"llama.bad": (VT.STRING, "zzzz", None), "llama.block_count": (VT.UINT32, 2, None)}, [])
    path.write_bytes(path.read_bytes().replace(b"zzzz", b"\xff\xfezz"))
    ours = open_gguf(path)
    assert isinstance(ours.fields["llama.bad"], Unreadable)
    assert _field(ours, "llama.block_count", path=path) == 2
    with pytest.raises(ModelLoadError, match="x.gguf.*'llama.bad' cannot be read.*UTF-8"):
        _field(ours, "llama.bad", path=path)
