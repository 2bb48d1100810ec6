"""The GGUF reader gives what the `gguf` package's reference reader gives, field by field and byte by byte, and
names the file and the problem for a file it cannot read."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from services.engine.gguf_file import GgufFile
from services.engine.model_files import smollm2_gguf_path
from tests.engine.test_loader_errors import write_gguf


def _same_as_the_reference(path: str) -> GgufFile:
    ours, ref = GgufFile(path), gguf.GGUFReader(path)
    # the reference adds its own GGUF.* pseudo-fields (version, counts) beside the file's metadata
    keys = {k for k in ref.fields if not k.startswith("GGUF.")}
    assert set(ours.fields) == keys
    for key in keys:
        assert ours.fields[key] == ref.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(d) for d in b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert a.data.tobytes() == b.data.tobytes(), a.name
    return ours


def test_smollm2_reads_as_the_reference_reader_reads_it() -> None:
    f = _same_as_the_reference(smollm2_gguf_path())
    assert f.get("general.architecture") == "llama" and len(f.get("tokenizer.ggml.tokens")) == 49152
    kinds = {t.tensor_type for t in f.tensors}
    assert gguf.GGMLQuantizationType.Q8_0 in kinds and gguf.GGMLQuantizationType.F32 in kinds


def test_quantized_and_float_tensors_of_a_written_file_match_the_reference(tmp_path) -> None:
    path = write_gguf(tmp_path / "q.gguf", qtype=gguf.GGMLQuantizationType.Q8_0, layers=2)
    f = _same_as_the_reference(str(path))
    q = next(t for t in f.tensors if t.name == "blk.0.attn_q.weight")
    assert q.tensor_type == gguf.GGMLQuantizationType.Q8_0 and q.data.dtype == np.uint8
    assert gguf.quants.dequantize(q.data, q.tensor_type).shape == (64, 64)
    norm = next(t for t in f.tensors if t.name == "output_norm.weight")
    assert norm.data.dtype == np.float32 and norm.shape == (64,)


def test_a_bad_magic_a_newer_version_and_a_truncated_file_name_the_file(tmp_path) -> None:
    good = write_gguf(tmp_path / "ok.gguf").read_bytes()
    cases = {
        "magic.gguf": (b"GGML" + good[4:], "not a GGUF file"),
        "version.gguf": (good[:4] + (9).to_bytes(4, "little") + good[8:], "version 9 is not supported"),
        "cut-header.gguf": (good[:200], "truncated"),
        "cut-data.gguf": (good[: len(good) - 100], "truncated GGUF \\(tensor .* runs past the end"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=message) as e:
            GgufFile(tmp_path / name)
        assert name in str(e.value)
