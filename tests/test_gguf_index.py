"""gguf_index.GGUFIndex reads what gguf.GGUFReader reads (tensor types, shapes, bytes; scalar and
string fields), on tiny GGUFs with token arrays and on the packaged SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest

from outrider.errors import ModelError
from outrider.weights.gguf_index import GGUFIndex
from outrider.weights.quant_load import own_quantization


def same_as_reader(path) -> None:
    import gguf

    index, reader = GGUFIndex.open(path), gguf.GGUFReader(str(path))
    assert set(index.tensors) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        mine = index.tensors[t.name]
        assert mine.type == t.tensor_type.name and mine.shape == tuple(int(n) for n in reversed(t.shape))
        assert mine.data.shape == np.asarray(t.data).shape
        assert np.array_equal(mine.data.reshape(-1).view(np.uint8), np.asarray(t.data).reshape(-1).view(np.uint8))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's names for the header's own counts
            continue
        value = field.contents()
        if isinstance(value, (int, float, str)):
            assert index.meta[key] == pytest.approx(value) if isinstance(value, float) else index.meta[key] == value, key
        else:
            assert key not in index.meta  # arrays are skipped


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "F32"])
def test_tiny_gguf_matches_the_reader(tmp_path, qtype):
    import test_gguf_import as writer

    path = tmp_path / "tiny.gguf"
    writer.write_tiny_gguf(path, "llama", qtype=qtype, tied=True)
    same_as_reader(path)


def test_own_quantization_names_the_gguf_family(tmp_path):
    from test_quant_model import gguf_folder

    assert own_quantization(gguf_folder(tmp_path / "a", "Q4_1")) == "q4"
    assert own_quantization(gguf_folder(tmp_path / "b", "Q8_0")) == "q8_0"
    assert own_quantization(gguf_folder(tmp_path / "c", "F32")) is None
    mixed = gguf_folder(tmp_path / "d", "Q4_1", odd_tensor=("model.layers.0.mlp.down_proj.weight", "Q5_0"))
    assert own_quantization(mixed) == "gguf"  # kinds kept exactly (weights/quant_convert.py), mixed
    odd = gguf_folder(tmp_path / "e", "Q4_1", odd_tensor=("model.layers.0.mlp.down_proj.weight", "Q5_1"))
    assert own_quantization(odd) is None  # a kind we cannot keep: the float model by default
    assert own_quantization(tmp_path) is None  # no GGUF


def test_damaged_file_says_so(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 20)
    with pytest.raises(ModelError, match="not a readable GGUF file"):
        GGUFIndex.open(path)
    path.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelError, match="re-pull it"):
        GGUFIndex.open(path)


@pytest.mark.model
def test_packaged_smollm2_matches_the_reader(smollm2_path):
    same_as_reader(smollm2_path / "original.gguf")
    assert own_quantization(smollm2_path) == "q4"
