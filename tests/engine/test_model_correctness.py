"""The engine's forward pass and loaders, pinned against Hugging Face transformers on the real SmolLM2 model."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from services.engine.engine import EngineConfig, LLMEngine
from services.engine.loader import load_hf_dir, model_fingerprint
from services.engine.model import AttnMetadata, PagedKvCache, PrefillSegment, Transformer
from services.engine.sampling import SamplingParams
from services.engine.tokenizer import Tokenizer
from tests.conftest import FRANCE

pytestmark = pytest.mark.slow  # the real model against transformers, prompts of hundreds of tokens


def prompt_logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    kv = PagedKvCache(model.config, -(-len(ids) // 16), 16, model.dtype)
    meta = AttnMetadata(slot_mapping=torch.arange(len(ids)), prefills=[PrefillSegment(0, len(ids))])
    return model.logits(model(ids, torch.arange(len(ids)), meta, kv))


def test_fp32_logits_match_transformers_on_512_token_prompt(smollm2, hf_model):
    ids = torch.randint(0, smollm2.config.vocab_size, (512,), generator=torch.Generator().manual_seed(7))
    ours = prompt_logits(Transformer(smollm2.config, smollm2.weights, torch.float32), ids)
    with torch.no_grad():
        ref = hf_model(ids[None]).logits[0].float()
    assert ours.shape == ref.shape == (512, 49152)
    assert (ours - ref).abs().max().item() < 1e-4


def test_smollm2_config_read_from_gguf(smollm2):
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.rope_theta, c.vocab_size, c.bos_token_id, c.eos_token_id) == (100000.0, 49152, 1, 2)
    assert c.tie_embeddings and "lm_head" not in smollm2.weights
    assert abs(c.rms_norm_eps - 1e-5) < 1e-9


def test_greedy_chat_answers_capital_of_france_then_eos(smollm2, gguf_path):
    tok = Tokenizer.from_gguf(gguf_path)
    engine = LLMEngine(smollm2, EngineConfig(dtype="float32", num_kv_blocks=64), tokenizer=tok)
    prompt = tok.encode_chat(FRANCE)
    req = engine.add_request("france", prompt, SamplingParams(max_tokens=32, temperature=0))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
    assert tok.decode(out[:-1]) == "The capital of France is Paris."
    assert out[-1] == tok.eos_token_id == 2
    assert req.finish_reason == "stop"


def write_hf_dir(hf_model, gguf_path, path, dtype: torch.dtype = torch.float32) -> None:
    """The HF layout of the demo model, weights in `dtype` (transformers refuses save_pretrained on a GGUF-loaded
    model, so it is written directly)."""
    from safetensors.torch import save_file

    cfg = hf_model.config.to_dict()
    cfg.pop("quantization_config", None)
    (path / "config.json").write_text(json.dumps(cfg))
    state = {k: v.to(dtype).contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(path / "model.safetensors"))
    tok = Tokenizer.from_gguf(gguf_path)
    (path / "tokenizer.json").write_text(tok.to_json_str())
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": tok.chat_template, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
        )
    )


def test_hf_safetensors_dir_loads_to_the_same_model_and_fingerprint(smollm2, hf_model, gguf_path, tmp_path):
    write_hf_dir(hf_model, gguf_path, tmp_path)
    hf = load_hf_dir(tmp_path)
    assert hf.config.canonical_json() == smollm2.config.canonical_json()
    assert sorted(hf.weights) == sorted(smollm2.weights)
    for name, t in smollm2.weights.items():
        assert torch.equal(hf.weights[name], t), name
    fp = model_fingerprint(smollm2.config, smollm2.weights)
    assert model_fingerprint(hf.config, hf.weights) == fp
    # the fingerprint moves with the quantization and with any weight
    assert model_fingerprint(hf.config, hf.weights, "nvfp4") != fp
    hf.weights["norm"] = hf.weights["norm"].clone()
    hf.weights["norm"][0] += 1e-3
    assert model_fingerprint(hf.config, hf.weights) != fp
    # and the directory serves the same answer through its own tokenizer.json
    engine = LLMEngine(tmp_path, EngineConfig(dtype="float32", num_kv_blocks=64))
    ids = engine.tokenizer.encode_chat(FRANCE)  # type: ignore[attr-defined]
    [out] = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0))
    assert engine.tokenizer.decode(out, skip_special_tokens=True) == "The capital of France is Paris."  # type: ignore[attr-defined]


def test_a_bf16_checkpoint_stays_bf16_on_the_host_and_serves_as_its_float32_values(
    hf_model, gguf_path, tmp_path
):
    """A bf16 safetensors checkpoint is held as stored (an 8B model: 16 GB of host memory, not 32 in float32);
    every consumer converts where it computes, so the fingerprint and the tokens are those of its float32 values."""
    write_hf_dir(hf_model, gguf_path, tmp_path, torch.bfloat16)
    hf = load_hf_dir(tmp_path)
    assert {t.dtype for t in hf.weights.values()} == {torch.bfloat16}
    wide = dataclasses.replace(hf, weights={k: v.float() for k, v in hf.weights.items()})
    assert model_fingerprint(hf.config, hf.weights) == model_fingerprint(wide.config, wide.weights)
    prompt = Tokenizer.from_gguf(gguf_path).encode_chat(FRANCE)
    params = SamplingParams(max_tokens=8, temperature=0)
    for dtype in ("float32", "bfloat16"):
        cfg = EngineConfig(dtype=dtype, num_kv_blocks=64)
        assert LLMEngine(hf, cfg).generate([prompt], params) == LLMEngine(wide, cfg).generate(
            [prompt], params
        )


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_batched_decode_matches_single_sequence_reference(smollm2, dtype):
    """Continuous batching with mixed lengths gives each sequence the same greedy tokens as running it alone."""
    engine = LLMEngine(smollm2, EngineConfig(dtype=dtype, num_kv_blocks=256))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (5, 40, 17, 64)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], params)[0] for p in prompts]
    if dtype == "float32":
        assert together == alone
    else:  # bf16 rounding depends on the batch shape, so near-ties may flip; the first token may not
        assert [t[0] for t in together] == [a[0] for a in alone]
        agree = sum(x == y for t, a in zip(together, alone, strict=True) for x, y in zip(t, a, strict=True))
        assert agree >= 0.6 * sum(len(t) for t in together)


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    from services.engine.config import ModelConfig, RopeScaling
    from services.engine.model import rope_inv_freq

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling |= {"original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    hf_cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=scaling)
    ref, _ = _compute_llama3_parameters(hf_cfg)
    ours = rope_inv_freq(
        ModelConfig(
            architecture="llama",
            num_layers=1,
            hidden_size=4096,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=128256,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            max_context=131072,
            tie_embeddings=False,
            rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
        )
    )
    assert torch.allclose(ours, ref.float(), rtol=1e-6, atol=0)
    plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    assert ours[0] == plain[0] and torch.isclose(ours[-1], plain[-1] / 8)  # high kept, low scaled by factor
