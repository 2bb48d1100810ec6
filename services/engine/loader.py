"""Model loading: GGUF files and Hugging Face safetensors directories into one in-memory form.

Both loaders produce a `ModelConfig` and a dict of float32 tensors under canonical (Hugging Face Llama) names,
so the model code never knows where its weights came from. GGUF tensors are dequantized with the `gguf` package
and llama.cpp's q/k row permutation is undone, which makes a GGUF and the safetensors it was converted from
load to the same numbers (and the same fingerprint).

This room never runs the model and never downloads anything.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash

from services.engine.config import NVFP4_ACTIVATIONS, ModelConfig, ModelLoadError, RopeScaling

if TYPE_CHECKING:
    from services.engine.nvfp4 import NVFP4Tensor

Weights = dict[
    str, "torch.Tensor | NVFP4Tensor"
]  # NVFP4Tensor only for projections of pre-quantized checkpoints
_PREQUANTIZED = {"modelopt": "modelopt", "compressed-tensors": "compressed-tensors"}

# canonical name templates of one decoder layer, and where GGUF keeps each of them
_LAYER_TENSORS = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_BIAS_TENSORS = ("q_proj", "k_proj", "v_proj")


# The canonical name of a projection's static activation scale (g_e, fp32 0-dim) in LoadedModel.weights:
# `layers.3.q_proj` + this, from a W4A4 checkpoint (nvfp4/prequantized.py)
ACTIVATION_SCALE_SUFFIX = ".input_scale"


@dataclass
class LoadedModel:
    config: ModelConfig
    # canonical names: embed_tokens, layers.{i}.{name}[.bias], norm, lm_head?, rope_freqs?; float32 from a GGUF
    # (dequantized), as stored (bf16, fp16 or fp32) from safetensors; NVFP4 parts for a pre-quantized checkpoint,
    # with their static activation scales (ACTIVATION_SCALE_SUFFIX) where a W4A4 checkpoint carries them
    weights: Weights
    source: str  # path it was loaded from
    chat_template: str | None = None
    source_format: str = ""  # "gguf" | "hf" | "memory"
    quantization: str = "none"  # "none", or "nvfp4:<layout>" for a pre-quantized checkpoint (kept packed)
    # what a pre-quantized checkpoint declares of its activations: "16bit" (W4A16), "nvfp4" (W4A4), "" (nothing)
    nvfp4_activations: str = ""


def required_tensor_names(config: ModelConfig) -> list[str]:
    names = ["embed_tokens", "norm"]
    for i in range(config.num_layers):
        names += [f"layers.{i}.{n}" for n in _LAYER_TENSORS]
        if config.attention_bias:
            names += [f"layers.{i}.{n}.bias" for n in _BIAS_TENSORS]
    if not config.tie_embeddings:
        names.append("lm_head")
    return names


def _check_complete(config: ModelConfig, weights: Weights, source: str) -> None:
    missing = [n for n in required_tensor_names(config) if n not in weights]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{source}: missing tensors: {shown}")
    expect = {
        "embed_tokens": (config.vocab_size, config.hidden_size),
        "layers.0.q_proj": (config.num_heads * config.head_dim, config.hidden_size),
        "layers.0.k_proj": (config.num_kv_heads * config.head_dim, config.hidden_size),
        "layers.0.gate_proj": (config.intermediate_size, config.hidden_size),
    }
    for name, shape in expect.items():
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(
                f"{source}: tensor {name} has shape {tuple(weights[name].shape)}, config implies {shape}"
            )


def load_model(path: str | os.PathLike[str]) -> LoadedModel:
    """Load a `.gguf` file or a Hugging Face directory (config.json + *.safetensors)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path does not exist: {p}")
    if p.is_dir():
        return load_hf_dir(p)
    if p.suffix == ".gguf":
        return load_gguf(p)
    raise ModelLoadError(f"{p}: not a .gguf file or a Hugging Face model directory")


# --------------------------------------------------------------------------------------------------- GGUF


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time q/k permutation (interleaved rotary pairs → rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | os.PathLike[str]) -> LoadedModel:
    import gguf

    from services.engine.gguf_file import GgufFile

    p = Path(path)
    try:
        reader = GgufFile(p)
    except ValueError as e:  # bad magic, version or a truncated file
        raise ModelLoadError(f"{p}: not a readable GGUF file ({e})") from e
    arch = reader.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{p}: unsupported architecture {arch!r} (supported: llama)")

    def meta(key: str, default: Any = None) -> Any:
        return reader.get(f"{arch}.{key}", default)

    hidden = int(meta("embedding_length"))
    n_heads = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_heads))
    tensors = {t.name: t for t in reader.tensors}
    vocab = meta("vocab_size")
    if vocab is None:
        vocab = len(reader.get("tokenizer.ggml.tokens", []))
    scaling = None
    if meta("rope.scaling.type") not in (None, "none"):
        raise ModelLoadError(f"{p}: unsupported rope scaling {meta('rope.scaling.type')!r}")
    config = ModelConfig(
        architecture="llama",
        num_layers=int(meta("block_count")),
        hidden_size=hidden,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=int(meta("attention.key_length", hidden // n_heads)),
        intermediate_size=int(meta("feed_forward_length")),
        vocab_size=int(vocab),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        max_context=int(meta("context_length", 4096)),
        tie_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        rope_scaling=scaling,
        bos_token_id=reader.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=reader.get("tokenizer.ggml.eos_token_id"),
        name=str(reader.get("general.name", p.stem)),
    )

    def dequant(t: Any) -> np.ndarray:
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(
                f"{p}: tensor {t.name} uses quantization type {t.tensor_type.name}, which cannot be dequantized"
            ) from e
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        return np.asarray(arr, dtype=np.float32).reshape(shape)

    weights: Weights = {}
    for name, t in tensors.items():
        canon = _gguf_to_canonical(name)
        if canon is None:
            continue
        arr = dequant(t)
        if canon.endswith("q_proj") or canon.endswith("q_proj.bias"):
            arr = _unpermute_rows(arr, n_heads)
        elif canon.endswith("k_proj") or canon.endswith("k_proj.bias"):
            arr = _unpermute_rows(arr, n_kv)
        weights[canon] = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
    _check_complete(config, weights, str(p))
    return LoadedModel(
        config=config,
        weights=weights,
        source=str(p),
        chat_template=reader.get("tokenizer.chat_template"),
        source_format="gguf",
    )


def _gguf_to_canonical(name: str) -> str | None:
    base, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    suffix = ".bias" if kind == "bias" else ""
    fixed = {
        "token_embd": "embed_tokens",
        "output_norm": "norm",
        "output": "lm_head",
        "rope_freqs": "rope_freqs",
    }
    if base in fixed:
        return fixed[base] + suffix
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk":
        for canon, g in _LAYER_TENSORS.items():
            if parts[2] == g:
                return f"layers.{parts[1]}.{canon}{suffix}"
    return None


# ------------------------------------------------------------------------------------ Hugging Face directory

_HF_LAYER_PREFIX = {
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


def _hf_to_canonical(name: str) -> str | None:
    if name == "lm_head.weight":
        return "lm_head"
    if not name.startswith("model."):
        return None
    rest = name[len("model.") :]
    base, _, kind = rest.rpartition(".")
    suffix = ".bias" if kind == "bias" else ""
    if base in ("embed_tokens", "norm"):
        return base + suffix
    parts = base.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers":
        for canon, hf in _HF_LAYER_PREFIX.items():
            if parts[2] == hf:
                return f"layers.{parts[1]}.{canon}{suffix}"
    return None


def _hf_rope_scaling(cfg: dict[str, Any]) -> RopeScaling | None:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ModelLoadError(f"unsupported rope scaling type {kind!r} (supported: default, llama3)")
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs["low_freq_factor"]),
        high_freq_factor=float(rs["high_freq_factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
    )


def load_hf_dir(path: str | os.PathLike[str]) -> LoadedModel:
    from safetensors.torch import load_file

    p = Path(path)
    cfg_path = p / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(f"{p}: no config.json (expected a Hugging Face model directory)")
    cfg = json.loads(cfg_path.read_text())
    model_type = cfg.get("model_type")
    if model_type != "llama":
        raise ModelLoadError(f"{p}: unsupported architecture {model_type!r} (supported: llama)")
    quant_method = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant_method not in (None, "gguf", *_PREQUANTIZED):
        raise ModelLoadError(f"{p}: unsupported quantization {quant_method!r} in config.json")
    rope_theta = cfg.get("rope_theta")
    if rope_theta is None:
        rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    hidden = int(cfg["hidden_size"])
    n_heads = int(cfg["num_attention_heads"])
    config = ModelConfig(
        architecture="llama",
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=n_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", n_heads)),
        head_dim=int(cfg.get("head_dim") or hidden // n_heads),
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        rope_theta=float(rope_theta),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_context=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        rope_scaling=_hf_rope_scaling(cfg),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id") if isinstance(cfg.get("eos_token_id"), int) else None,
        name=p.name,
    )
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{p}: no *.safetensors files")
    weights: Weights = {}
    quantization, activations = "none", ""
    if quant_method in _PREQUANTIZED:
        from services.engine.nvfp4 import load_prequantized_weights

        raw: dict[str, torch.Tensor] = {}
        for f in files:
            raw |= load_file(str(f))
        try:
            weights = dict(load_prequantized_weights(raw, _PREQUANTIZED[quant_method]))  # type: ignore[arg-type]
        except ValueError as e:
            raise ModelLoadError(f"{p}: {e}") from e
        quantization = f"nvfp4:{quant_method}"
        activations = _declared_activations(cfg.get("quantization_config") or {}, p)
    else:
        for f in files:
            for name, t in load_file(str(f)).items():
                canon = _hf_to_canonical(name)
                if canon is not None:
                    # 16-bit floats as stored: an 8B bf16 checkpoint is 16 GB of host memory, not 32 in float32,
                    # and half the bytes to the GPU; every consumer converts where it computes
                    keep = t.dtype in (torch.bfloat16, torch.float16, torch.float32)
                    weights[canon] = (t if keep else t.to(torch.float32)).contiguous()
    if config.tie_embeddings:
        weights.pop("lm_head", None)
    _check_complete(config, weights, str(p))
    template = None
    tc = p / "tokenizer_config.json"
    if tc.exists():
        template = json.loads(tc.read_text()).get("chat_template")
    if template is None and (p / "chat_template.jinja").exists():
        template = (p / "chat_template.jinja").read_text()
    return LoadedModel(
        config=config,
        weights=weights,
        source=str(p),
        chat_template=template,
        source_format="hf",
        quantization=quantization,
        nvfp4_activations=activations,
    )


def _declared_activations(qcfg: dict[str, Any], p: Path) -> str:
    """What an NVFP4 checkpoint's quantization config says of its activations: compressed-tensors names them
    per config group (`input_activations`: null is NVFP4A16, 4-bit floats is NVFP4 W4A4); ModelOpt's
    `quant_algo` NVFP4 is its W4A4 scheme (config.json, or hf_quant_config.json in older exports). What
    `rackserve quantize` wrote says so itself (`rackserve.activations`), in either layout."""
    if "rackserve" in qcfg:  # ours: quantized for 16-bit activations (exports before the key was written too)
        ours = (qcfg.get("rackserve") or {}).get("activations", "16bit")
        return str(ours) if ours in NVFP4_ACTIVATIONS else ""
    if qcfg.get("quant_method") == "compressed-tensors":
        inputs = [g.get("input_activations") for g in (qcfg.get("config_groups") or {}).values()]
        if inputs and all(a is None for a in inputs):
            return "16bit"
        if any(isinstance(a, dict) and a.get("num_bits") == 4 and a.get("type") == "float" for a in inputs):
            return "nvfp4"
        return ""
    algo = qcfg.get("quant_algo")
    hf_quant = p / "hf_quant_config.json"
    if algo is None and hf_quant.exists():
        try:
            algo = (json.loads(hf_quant.read_text()).get("quantization") or {}).get("quant_algo")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ModelLoadError(f"{hf_quant}: not a ModelOpt quantization config: {e}") from e
    return "nvfp4" if algo == "NVFP4" else ""


# ------------------------------------------------------------------------------------------- fingerprint


def model_fingerprint(config: ModelConfig, weights: Weights, quant_id: str = "none") -> str:
    """Hash of config + weights + quantization; KV from a model with another fingerprint is refused.

    The same on every device: floating weights are hashed as float32 values (converted where they live, so a
    GPU-resident model is converted on the GPU), integers as their bytes. xxh3-128 rather than a cryptographic
    hash: this is a compatibility check, and an 8B model's 32 GB of float32 hash in seconds, not half a minute."""
    h = xxhash.xxh3_128()
    h.update(b"rackserve-fingerprint/2\0")
    h.update(config.canonical_json().encode())
    h.update(b"\0quant=" + quant_id.encode())
    for name in sorted(weights):
        w = weights[name]
        parts = [w] if isinstance(w, torch.Tensor) else [w.packed, w.scales, w.global_scale.reshape(1)]
        h.update(f"\0{name}:{tuple(w.shape)}\0".encode())
        for t in parts:
            t = t.detach()
            if t.is_floating_point():
                t = t.to(torch.float32)
            h.update(t.contiguous().cpu().numpy().data.cast("B"))
    return h.hexdigest()[:32]
