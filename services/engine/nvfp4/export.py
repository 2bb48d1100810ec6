"""`rackserve quantize`: a dense model into a Hugging Face NVFP4 checkpoint directory.

Layouts (checkpoint.py owns the tensor names and scale conventions):
- `compressed-tensors` (default): `quantization_config` in config.json as llm-compressor writes its
  NVFP4A16 scheme (format `nvfp4-pack-quantized`, weights: 4-bit float, strategy `tensor_group`, group 16,
  symmetric, no activation quantization; `lm_head` ignored), or with `--activations nvfp4` its NVFP4 (W4A4)
  scheme: input activations 4-bit float, `tensor_group` 16, block scales per call (`dynamic: "local"`) under a
  static `input_global_scale` per projection. vLLM reads it; so does the compressed-tensors library's own
  decompressor (tests/engine/nvfp4/test_nvfp4_methods.py checks it decodes to our weights).
- `modelopt`: `quant_method: modelopt`, `quant_algo: NVFP4`, plus hf_quant_config.json, as ModelOpt exports;
  with `--activations nvfp4`, a static `input_scale` per projection, as ModelOpt's W4A4 exports carry.
Both layouts record `"rackserve": {"activations": "16bit" | "nvfp4"}`, what the weights were quantized for:
rackserve's `--nvfp4-gemm auto` serves a 16bit one W4A16 on any GPU, an nvfp4 one W4A4 on FP4 tensor cores
(the quant_algo NVFP4 of a 16bit ModelOpt export would otherwise say W4A4). The static activation scales are
calibrated on the calibration text (calibration.calibrate_input_scales), whatever the weights' method.

Only the block projections are quantized (q/k/v/o, gate/up/down); embeddings, norms and an untied LM head
are written as float32, the loader's own dtype, so that loading the directory back gives exactly the model
`--quant nvfp4 --nvfp4-method <m>` serves from the source (same bytes, same fingerprint weights).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from services.engine.config import NVFP4_ACTIVATIONS

from .checkpoint import Layout, input_scale_to, to_compressed_tensors, to_modelopt
from .recipe import QUANT_RECIPE_ID, NVFP4Tensor

LAYOUTS: tuple[Layout, ...] = ("compressed-tensors", "modelopt")


def _hf_name(canon: str) -> str:
    """Canonical name (`layers.3.q_proj`) -> Hugging Face prefix (`model.layers.3.self_attn.q_proj`), checked
    against the loader's own mapping (the one owner of it)."""
    from services.engine.loader import _HF_LAYER_PREFIX, _hf_to_canonical

    if canon == "lm_head":
        hf = "lm_head"
    elif canon in ("embed_tokens", "norm"):
        hf = f"model.{canon}"
    else:
        _, i, kind = canon.split(".", 2)
        hf = f"model.layers.{i}.{_HF_LAYER_PREFIX[kind]}"
    if _hf_to_canonical(f"{hf}.weight") != canon:
        raise ValueError(f"no Hugging Face name for {canon!r}")
    return hf


def _hf_config(cfg: Any, quantization_config: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_context,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attention_bias,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "quantization_config": quantization_config,
    }
    if cfg.bos_token_id is not None:
        out["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_id is not None:
        out["eos_token_id"] = cfg.eos_token_id
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
    return out


def quantization_config(
    layout: Layout,
    method: str,
    gptq_options: dict[str, Any] | None = None,
    activations: str = "16bit",
    smooth: float | None = None,
) -> dict[str, Any]:
    """config.json's `quantization_config` for `layout`; `rackserve` records the method and recipe it used
    (and gptq's options: act order, scale rule, damping, calibration size) and the activations: "16bit"
    (W4A16) or "nvfp4" (W4A4, static activation scales written with the weights)."""
    if activations not in NVFP4_ACTIVATIONS:
        raise ValueError(f"activations must be one of {NVFP4_ACTIVATIONS}, got {activations!r}")
    # "activations": what the weights were quantized for; the loader reads it before quant_algo, which for
    # ModelOpt's NVFP4 names its W4A4 scheme
    provenance: dict[str, Any] = {"method": method, "recipe": QUANT_RECIPE_ID, "activations": activations}
    if method == "gptq":
        provenance["gptq"] = dict(gptq_options or {})
    if smooth is not None:  # folded into the weights and norms: a record, nothing a reader must apply
        provenance["smooth_alpha"] = smooth
    if layout == "modelopt":
        return {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
            "exclude_modules": ["lm_head"],
            "kv_cache_quant_algo": None,
            "rackserve": provenance,
        }
    weights = {
        "num_bits": 4,
        "type": "float",
        "strategy": "tensor_group",
        "group_size": 16,
        "symmetric": True,
        "dynamic": False,
        "scale_dtype": "torch.float8_e4m3fn",
        "observer": "minmax" if method != "gptq" else "mse",
    }
    if method == "gptq" and (gptq_options or {}).get("act_order", True):
        # compressed-tensors' "weight" ordering: calibrated in activation order, the format unchanged (no g_idx)
        weights["actorder"] = "weight"
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": _NVFP4_INPUTS if activations == "nvfp4" else None,
                "output_activations": None,
                "format": "nvfp4-pack-quantized",
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "rackserve": provenance,
    }


# compressed-tensors' NVFP4 activations: block scales computed per call ("local"), the tensor scale static
_NVFP4_INPUTS: dict[str, Any] = {
    "num_bits": 4,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": 16,
    "symmetric": True,
    "dynamic": "local",
    "observer": "minmax",
}


def write_checkpoint(
    loaded: Any,
    quantized: dict[str, NVFP4Tensor],
    out_dir: str | Path,
    layout: Layout,
    method: str,
    tokenizer: Any | None = None,
    gptq_options: dict[str, Any] | None = None,
    input_scales: dict[str, torch.Tensor] | None = None,
    smooth: float | None = None,
) -> Path:
    """Write `quantized` (canonical projection names) and the rest of `loaded` as a Hugging Face directory.
    `gptq_options` (what produced a gptq `quantized`) are recorded in the quantization config. `input_scales`
    (g_e per projection: calibration.calibrate_input_scales) make it a W4A4 checkpoint; every quantized
    projection needs one then. `smooth` records the alpha `loaded` was smoothed with (smoothing.py)."""
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    write = to_compressed_tensors if layout == "compressed-tensors" else to_modelopt
    for name, w in loaded.weights.items():
        if name == "rope_freqs":  # GGUF's precomputed llama3 factors: config.json's rope_scaling says it
            continue
        hf = _hf_name(name.removesuffix(".bias"))
        if name.endswith(".bias"):
            tensors[f"{hf}.bias"] = w.to(torch.float32).contiguous()
        elif name in quantized:
            tensors |= {k: v.contiguous() for k, v in write(quantized[name], hf).items()}
            if input_scales is not None:
                if name not in input_scales:
                    raise ValueError(f"{name}: a W4A4 checkpoint needs a static activation scale for it")
                tensors |= input_scale_to(layout, input_scales[name], hf)
        elif isinstance(w, torch.Tensor):
            tensors[f"{hf}.weight"] = w.to(torch.float32).contiguous()
        else:
            raise ValueError(f"{name}: the source is already quantized; quantize a dense model")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    activations = "16bit" if input_scales is None else "nvfp4"
    qcfg = quantization_config(layout, method, gptq_options, activations, smooth)
    (out / "config.json").write_text(json.dumps(_hf_config(loaded.config, qcfg), indent=2) + "\n")
    if layout == "modelopt":
        hf_quant = {"producer": {"name": "rackserve"}, "quantization": {k: qcfg[k] for k in
                    ("quant_algo", "group_size", "exclude_modules", "kv_cache_quant_algo")}}  # fmt: skip
        (out / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2) + "\n")
    if tokenizer is not None:
        (out / "tokenizer.json").write_text(tokenizer.to_json_str())
        tok_cfg: dict[str, Any] = dict(getattr(tokenizer, "_template_vars", {}))
        template = getattr(tokenizer, "chat_template", None) or loaded.chat_template
        if template:
            tok_cfg["chat_template"] = template
        (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return out


def quantize_to_dir(
    model: str,
    method: str,
    out_dir: str | Path,
    layout: Layout = "compressed-tensors",
    progress: Callable[[str], None] | None = None,
    act_order: bool | None = None,
    activations: str = "16bit",
    smooth: float | None = None,
) -> dict[str, float]:
    """`rackserve quantize`: load `model` (GGUF or dense HF dir), quantize with `method` (gptq: calibrate
    first), write `out_dir`. Returns the seconds spent per phase. `act_order` is gptq's (default on); set
    for another method it is refused, since it would change nothing. `activations` "nvfp4" calibrates and
    writes static activation scales: a W4A4 checkpoint. `smooth` (alpha in (0, 1]) smooths the model first
    (smoothing.py), calibrated on the same windows; what follows is calibrated on the smoothed model."""
    from services.engine.loader import load_model
    from services.engine.tokenizer import Tokenizer

    from .calibration import (
        calibration_windows,
        channel_amax,
        input_scales_from_amax,
        observe,
        quantize_model,
    )
    from .methods import check_method

    check_method(method)
    if activations not in NVFP4_ACTIVATIONS:
        raise ValueError(f"activations must be one of {NVFP4_ACTIVATIONS}, got {activations!r}")
    if act_order is not None and method != "gptq":
        raise ValueError(f"act order applies to gptq only, not to {method!r}")
    if smooth is not None:  # before loading and calibrating, which take minutes on a large model
        from .smoothing import check_alpha

        check_alpha(smooth)
    gptq_options: dict[str, Any] = {}
    if method == "gptq":
        gptq_options = {"act_order": True if act_order is None else act_order}
    times: dict[str, float] = {}
    t = time.perf_counter()
    loaded = load_model(model)
    if loaded.quantization != "none":
        raise ValueError(f"{model} is already quantized ({loaded.quantization}); quantize a dense model")
    tok = (
        Tokenizer.from_gguf(loaded.source) if loaded.source_format == "gguf" else Tokenizer.from_hf_dir(model)
    )
    times["load_s"] = time.perf_counter() - t
    hessians = input_scales = None
    if method == "gptq" or activations == "nvfp4" or smooth is not None:
        t = time.perf_counter()
        windows = calibration_windows(tok)
        if smooth is not None:
            from .smoothing import smooth_model

            loaded = smooth_model(loaded, channel_amax(loaded, windows), smooth)
        # one pass for both, of the smoothed model if it was smoothed
        if method == "gptq" or activations == "nvfp4":
            seen = observe(loaded, windows, hessians=method == "gptq", amax=activations == "nvfp4")
            hessians = seen.hessians
            if seen.amax is not None:
                input_scales = input_scales_from_amax(loaded, seen.amax)
        times["calibration_s"] = time.perf_counter() - t
        if progress is not None:
            progress(f"calibration: {len(windows)} windows, {sum(len(w) for w in windows)} tokens")
    t = time.perf_counter()
    quantized = quantize_model(loaded, method, hessians, progress, **gptq_options)
    times["quantize_s"] = time.perf_counter() - t
    t = time.perf_counter()
    if hessians is not None:
        gptq_options["calibration_windows"] = len(windows)
    write_checkpoint(loaded, quantized, out_dir, layout, method, tok, gptq_options, input_scales, smooth)
    times["write_s"] = time.perf_counter() - t
    return times
