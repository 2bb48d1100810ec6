"""Bad model files give an error that names the file and the problem, before anything is half-built."""

from __future__ import annotations

import json

import numpy as np
import pytest

from services.engine.config import EngineConfig, ModelLoadError
from services.engine.engine import LLMEngine, PromptTooLongError
from services.engine.loader import load_model
from services.engine.sampling import SamplingParams
from tests.conftest import tiny_llama


def write_gguf(path, arch="llama", drop=(), qtype=None, layers=1):
    """A minimal GGUF with tiny-llama-shaped tensors (sizes a multiple of 32 so quantized types fit)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_feed_forward_length(128)
    w.add_context_length(256)
    w.add_vocab_size(64)
    shapes = {"token_embd.weight": (64, 64), "output_norm.weight": (64,)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_q.weight": (64, 64),
            f"blk.{i}.attn_k.weight": (32, 64),
            f"blk.{i}.attn_v.weight": (32, 64),
            f"blk.{i}.attn_output.weight": (64, 64),
            f"blk.{i}.ffn_gate.weight": (128, 64),
            f"blk.{i}.ffn_up.weight": (128, 64),
            f"blk.{i}.ffn_down.weight": (64, 128),
            f"blk.{i}.attn_norm.weight": (64,),
            f"blk.{i}.ffn_norm.weight": (64,),
        }
    for name, shape in shapes.items():
        if name in drop:
            continue
        if qtype is not None and name == "blk.0.attn_q.weight":
            block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((shape[0], shape[1] // block * nbytes), dtype=np.uint8)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            w.add_tensor(name, np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_valid_minimal_gguf_loads(tmp_path):
    m = load_model(write_gguf(tmp_path / "ok.gguf"))
    assert m.config.num_layers == 1 and m.config.tie_embeddings


def test_unknown_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")


def test_unsupported_architecture_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_model(write_gguf(tmp_path / "gpt2.gguf", arch="gpt2"))


def test_gguf_with_missing_tensors_names_them(tmp_path):
    path = write_gguf(tmp_path / "holes.gguf", drop=("blk.0.ffn_down.weight", "output_norm.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensors: .*layers\.0\.down_proj"):
        load_model(path)


def test_unsupported_gguf_quantization_type_is_named(tmp_path):
    import gguf

    path = write_gguf(tmp_path / "q81.gguf", qtype=gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(ModelLoadError, match="blk.0.attn_q.weight uses quantization type Q8_1"):
        load_model(path)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"this is not a model" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(bad)


def test_hf_dir_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'"):
        load_model(tmp_path)
    cfg = {"model_type": "llama", "quantization_config": {"quant_method": "awq"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported quantization 'awq'"):
        load_model(tmp_path)


def test_engine_settings_are_validated():
    with pytest.raises(ValueError, match="quant must be one of"):
        EngineConfig(quant="int3")
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="float8")
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig(block_size=12)


def test_prompt_longer_than_the_configured_context_is_refused():
    e = LLMEngine(tiny_llama(), EngineConfig(dtype="float32", num_kv_blocks=64, max_model_len=32))
    with pytest.raises(PromptTooLongError, match="32 tokens"):
        e.add_request("x", list(range(40)), SamplingParams(max_tokens=4))
