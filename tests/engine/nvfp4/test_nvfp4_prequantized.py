"""Pre-quantized NVFP4 checkpoints: a tiny random Llama exported the way ModelOpt and compressed-tensors
(llm-compressor) write NVFP4 — projections packed, everything else bf16, plus the activation and KV-cache
scales rackserve does not read — through real safetensors bytes, then loaded into canonical names with every
projection's bytes unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch

from services.engine.loader import LoadedModel, required_tensor_names
from services.engine.model import Block, Transformer
from services.engine.nvfp4 import (
    NVFP4Linear,
    NVFP4Tensor,
    dequantize,
    fuse_rows,
    load_prequantized_weights,
    quantize,
)
from services.engine.nvfp4.checkpoint import to_compressed_tensors, to_modelopt
from services.engine.nvfp4.prequantized import PROJECTIONS
from services.engine.nvfp4.recipe import abs_max, global_scale_for_amax
from tests.conftest import tiny_llama

# Hugging Face Llama module names, written out independently of the loader's mapping.
HF_LAYER = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
}
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def hf_module(canon: str) -> str:
    if canon in ("embed_tokens", "norm"):
        return f"model.{canon}"
    if canon == "lm_head":
        return "lm_head"
    _, i, rest = canon.split(".", 2)
    return f"model.layers.{i}.{HF_LAYER[rest]}"


def is_projection(canon: str) -> bool:
    return canon.startswith("layers.") and canon.rpartition(".")[2] in PROJECTIONS


def packed(t: torch.Tensor | NVFP4Tensor) -> NVFP4Tensor:
    assert isinstance(t, NVFP4Tensor)
    return t


def shared_fused_scales(model: LoadedModel) -> dict[str, torch.Tensor]:
    """One g_e per fused group (q/k/v, gate/up), as llm-compressor and ModelOpt's HF export write them."""
    scales: dict[str, torch.Tensor] = {}
    for i in range(model.config.num_layers):
        for group in FUSED:
            names = [f"layers.{i}.{n}" for n in group]
            amax = torch.stack([abs_max(model.weights[n]) for n in names]).max()
            g = global_scale_for_amax(amax)
            scales |= {n: g.clone() for n in names}  # own tensors: a safetensors file shares no memory
    return scales


def export(
    model: LoadedModel,
    layout: str,
    *,
    fused_scales: bool = False,
    quantize_lm_head: bool = False,
) -> dict[str, torch.Tensor]:
    shared = shared_fused_scales(model) if fused_scales else {}
    out: dict[str, torch.Tensor] = {}
    for canon, w in model.weights.items():
        prefix = hf_module(canon)
        if is_projection(canon) or (canon == "lm_head" and quantize_lm_head):
            q = quantize(w, global_scale=shared.get(canon))
            if layout == "modelopt":
                out |= to_modelopt(q, prefix)
                out[f"{prefix}.input_scale"] = torch.tensor(0.02)
            else:
                out |= to_compressed_tensors(q, prefix)
                out[f"{prefix}.input_global_scale"] = torch.tensor([1500.0])
                out[f"{prefix}.weight_zero_point"] = torch.zeros(
                    w.shape[0], w.shape[1] // 16, dtype=torch.int8
                )
        else:
            out[f"{prefix}.weight"] = w.to(torch.bfloat16)
    # KV-cache scales, and a module no Llama decoder has: both skipped
    out["model.layers.0.self_attn.k_proj.k_scale"] = torch.tensor(1.0)
    out["model.layers.0.self_attn.v_proj.v_scale"] = torch.tensor(1.0)
    out["model.rotary_emb.inv_freq"] = torch.ones(8)
    return out


def through_safetensors(tensors: dict[str, torch.Tensor], tmp_path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file, save_file

    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return load_file(str(path))


def assert_loaded(model: LoadedModel, loaded: dict, *, exact_global_scale: bool) -> None:
    # every projection's static activation scale as g_e: compressed-tensors' 1500 as it is, ModelOpt's 0.02 inverted
    act = {n: t for n, t in loaded.items() if n.endswith(".input_scale")}
    assert set(loaded) - set(act) == set(required_tensor_names(model.config))
    assert set(act) == {f"{c}.input_scale" for c in model.weights if is_projection(c)}
    g_in = torch.tensor(1500.0) if exact_global_scale else torch.tensor(1.0) / torch.tensor(0.02)
    assert all(torch.equal(t, g_in) for t in act.values())
    for canon, w in model.weights.items():
        got = loaded[canon]
        if not is_projection(canon):
            assert got.dtype == torch.float32 and torch.equal(got, w.to(torch.bfloat16).float()), canon
            continue
        want = quantize(w)
        assert isinstance(got, NVFP4Tensor) and got.shape == tuple(w.shape), canon
        assert torch.equal(got.packed, want.packed) and torch.equal(got.scales, want.scales), canon
        if exact_global_scale:
            assert torch.equal(got.global_scale, want.global_scale), canon
        else:  # ModelOpt stores g_d = 1 / g_e; reading it back is one more fp32 rounding
            one = torch.tensor(1.0)
            assert torch.equal(got.global_scale, one / (one / want.global_scale)), canon
            ulp = torch.finfo(torch.float32).eps * float(want.global_scale)
            assert abs(float(got.global_scale) - float(want.global_scale)) <= ulp, canon


def test_modelopt_export_loads_to_canonical_names_with_projection_bytes_unchanged(tmp_path):
    model = tiny_llama(tie=False)
    tensors = through_safetensors(export(model, "modelopt"), tmp_path)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.uint8  # packed, ModelOpt-style
    assert_loaded(model, load_prequantized_weights(tensors, "modelopt"), exact_global_scale=False)


def test_compressed_tensors_export_loads_bit_exact_and_serves_like_the_original_weight(tmp_path):
    model = tiny_llama(tie=True)
    tensors = through_safetensors(export(model, "compressed-tensors"), tmp_path)
    loaded = load_prequantized_weights(tensors, "compressed-tensors")
    assert_loaded(model, loaded, exact_global_scale=True)
    assert "lm_head" not in loaded  # tied: the caller reuses the embedding
    # An NVFP4Linear built from the loaded tensor is the layer quant="nvfp4" builds from the float weight.
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    from_checkpoint = NVFP4Linear(packed(loaded["layers.1.down_proj"]))
    from_float = NVFP4Linear.from_weight(model.weights["layers.1.down_proj"])
    assert torch.equal(from_checkpoint(x), from_float(x))


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_layout_is_detected_from_tensor_names(layout):
    tensors = export(tiny_llama(layers=1), layout)
    detected, named = load_prequantized_weights(tensors), load_prequantized_weights(tensors, layout)
    assert detected.keys() == named.keys()
    for k, v in named.items():
        w = detected[k]
        if isinstance(v, NVFP4Tensor):
            assert isinstance(w, NVFP4Tensor) and torch.equal(w.packed, v.packed)
        else:
            assert isinstance(w, torch.Tensor) and torch.equal(w, v)


def test_shared_fused_scales_fuse_to_exactly_the_bytes_the_engine_quantizes(tmp_path):
    model = tiny_llama()
    loaded = load_prequantized_weights(
        through_safetensors(export(model, "compressed-tensors", fused_scales=True), tmp_path)
    )
    engine_model = Transformer(model.config, model.weights, torch.float32, "nvfp4")
    for i, blk in enumerate(cast(list[Block], engine_model.blocks)):
        for group, layer in zip(FUSED, (blk.attn.wqkv, blk.ffn.w_gate_up), strict=True):
            assert isinstance(layer, NVFP4Linear)
            parts = [packed(loaded[f"layers.{i}.{n}"]) for n in group]
            fused = fuse_rows(parts)
            assert fused is not None
            assert torch.equal(fused.packed, layer.packed) and torch.equal(fused.scales, layer.scales)
            assert torch.equal(fused.global_scale, layer.global_scale)
            assert torch.equal(dequantize(fused), torch.cat([dequantize(p) for p in parts]))


def test_fuse_rows_refuses_parts_with_different_tensor_scales():
    model = tiny_llama(layers=1)
    parts = [quantize(model.weights[f"layers.0.{n}"]) for n in ("q_proj", "k_proj", "v_proj")]
    assert len({float(p.global_scale) for p in parts}) == 3  # each quantized on its own amax
    assert fuse_rows(parts) is None  # fusing would mean requantizing two of them
    with pytest.raises(ValueError, match="same in_features"):
        fuse_rows([parts[0], quantize(model.weights["layers.0.down_proj"])])


def test_a_quantized_lm_head_is_dequantized_since_the_model_keeps_it_high_precision():
    model = tiny_llama(layers=1, tie=False)
    loaded = load_prequantized_weights(export(model, "modelopt", quantize_lm_head=True))
    head = loaded["lm_head"]
    assert isinstance(head, torch.Tensor) and head.dtype == torch.float32
    assert torch.allclose(head, dequantize(quantize(model.weights["lm_head"])), rtol=1e-6, atol=0)


def _nonzero_zero_point(t: dict[str, torch.Tensor]) -> None:
    t["model.layers.0.mlp.up_proj.weight_zero_point"][0, 0] = 1


def _fp8_module(t: dict[str, torch.Tensor]) -> None:  # a ModelOpt FP8 layer among the NVFP4 ones
    w = t.pop("model.layers.0.input_layernorm.weight")
    t["model.layers.0.input_layernorm.weight"] = w.to(torch.float8_e4m3fn)
    t["model.layers.0.input_layernorm.weight_scale"] = torch.tensor(1.0)


def _unknown_suffix(t: dict[str, torch.Tensor]) -> None:
    t["model.layers.0.self_attn.o_proj.weight_g_idx"] = torch.zeros(64, dtype=torch.int32)


def _missing_block_scales(t: dict[str, torch.Tensor]) -> None:
    del t["model.layers.0.self_attn.q_proj.weight_scale"]


@pytest.mark.parametrize(
    ("layout", "corrupt", "error", "message"),
    [
        ("compressed-tensors", _nonzero_zero_point, ValueError, "up_proj.weight_zero_point is non-zero"),
        ("modelopt", _fp8_module, ValueError, "input_layernorm: weight is torch.float8_e4m3fn"),
        ("modelopt", _unknown_suffix, ValueError, r"unexpected tensor\(s\).*o_proj.weight_g_idx"),
        ("modelopt", _missing_block_scales, KeyError, "q_proj.weight_scale"),
    ],
)
def test_refuses_what_it_cannot_serve_and_names_the_tensor(layout, corrupt, error, message):
    tensors = export(tiny_llama(layers=1), layout)
    corrupt(tensors)
    with pytest.raises(error, match=message):
        load_prequantized_weights(tensors, layout)


def test_a_checkpoint_without_nvfp4_weights_is_refused():
    dense = {f"{hf_module(k)}.weight": v for k, v in tiny_llama(layers=1).weights.items()}
    with pytest.raises(ValueError, match="no NVFP4 weights found"):
        load_prequantized_weights(dense)
