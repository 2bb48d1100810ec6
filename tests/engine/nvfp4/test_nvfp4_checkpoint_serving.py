"""A pre-quantized NVFP4 checkpoint directory (ModelOpt or compressed-tensors) serves with its bytes unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.loader import load_model, model_fingerprint
from services.engine.model_files import smollm2_gguf_path
from services.engine.nvfp4 import NVFP4Linear, dequantize, quantize
from services.engine.nvfp4.checkpoint import to_compressed_tensors, to_modelopt
from services.engine.nvfp4.prequantized import PROJECTIONS
from services.engine.sampling import SamplingParams
from services.engine.tokenizer import Tokenizer
from tests.conftest import tiny_llama
from tests.engine.nvfp4.test_nvfp4_prequantized import HF_LAYER  # the tests' one independent HF name map

pytestmark = pytest.mark.slow  # writes and serves whole checkpoints of the real model


def write_checkpoint(tmp_path, layout: str):
    """A tiny Llama exported the way the two common NVFP4 toolchains write it (each projection its own g_e)."""
    model = tiny_llama(vocab=256)
    c = model.config
    tensors: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}  # what each projection must dequantize to
    for name, w in model.weights.items():
        parts = name.split(".")
        if len(parts) == 3 and parts[2] in PROJECTIONS:
            q = quantize(w)
            expected[name] = dequantize(q)
            prefix = f"model.layers.{parts[1]}.{HF_LAYER[parts[2]]}"
            tensors |= to_modelopt(q, prefix) if layout == "modelopt" else to_compressed_tensors(q, prefix)
        elif name == "embed_tokens" or name == "norm":
            tensors[f"model.{name}.weight"] = w
        else:
            kind = "input_layernorm" if name.endswith("input_layernorm") else "post_attention_layernorm"
            tensors[f"model.layers.{parts[1]}.{kind}.weight"] = w
            expected[name] = w
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    cfg = {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "intermediate_size": c.intermediate_size,
        "vocab_size": c.vocab_size,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_context,
        "tie_word_embeddings": True,
        "quantization_config": {"quant_method": layout},
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "tokenizer.json").write_text(Tokenizer.from_gguf(smollm2_gguf_path()).to_json_str())
    return model, expected


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_prequantized_checkpoint_serves_exactly_its_dequantized_weights(tmp_path, layout):
    dense, expected = write_checkpoint(tmp_path, layout)
    loaded = load_model(tmp_path)
    assert loaded.quantization == f"nvfp4:{layout}"
    engine = LLMEngine(loaded, EngineConfig(dtype="float32", num_kv_blocks=64, block_size=4))
    qkv = engine.model.blocks[0].attn.wqkv
    # per-projection tensor scales differ, so q/k/v stay separate NVFP4 projections rather than being requantized
    packed = [m for m in qkv.modules() if isinstance(m, NVFP4Linear)]
    assert len(packed) == 3 and all(m.packed.dtype == torch.uint8 for m in packed)

    # reference: the same model with every projection replaced by its dequantized checkpoint weight, served dense
    ref_weights = dict(dense.weights) | expected
    ref_model = type(dense)(config=dense.config, weights=ref_weights, source="ref", source_format="memory")
    reference = LLMEngine(ref_model, EngineConfig(dtype="float32", num_kv_blocks=64, block_size=4))
    prompts = [[5, 17, 42, 99, 3, 8], [200, 1, 2]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert engine.generate(prompts, params) == reference.generate(prompts, params)
    # the fingerprint tells the pre-quantized model from the dense one and from its dequantized twin
    assert engine.fingerprint != reference.fingerprint
    assert engine.fingerprint != model_fingerprint(dense.config, dense.weights)
