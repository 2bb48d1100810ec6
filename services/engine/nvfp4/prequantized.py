"""Whole pre-quantized NVFP4 checkpoints: a ModelOpt or compressed-tensors export of a Llama, read into the
engine's canonical weight names with the decoder projections kept packed.

checkpoint.py reads one quantized tensor; this room reads a whole state dict. It groups the tensors by module,
names each module with the loader's own Hugging Face → canonical mapping (`model.layers.3.self_attn.q_proj` →
`layers.3.q_proj`, `model.embed_tokens` → `embed_tokens`, ...), and returns:

- NVFP4Tensor for each quantized projection (q/k/v/o, gate/up/down) — the checkpoint's bytes, unchanged;
- `{projection}.input_scale` (g_e, fp32 0-dim) for each projection a W4A4 checkpoint calibrated a static
  activation scale for (ModelOpt `input_scale`, compressed-tensors `input_global_scale`: checkpoint.py);
- float32 for everything else (embeddings, norms, the LM head, biases), as `load_hf_dir` does. A checkpoint
  that quantized the embedding or LM head too gets them dequantized: the model keeps those in high precision.

Tensors the serving path reads from neither layout are skipped: KV-cache scales (`k_scale`, `v_scale`), the
activation scales of modules the engine keeps in high precision (an LM head), and an all-zero
`weight_zero_point` (symmetric NVFP4), as are modules that are no part of a Llama decoder.
Anything else on a decoder module (a non-zero zero point, FP8 or INT weights next to the NVFP4 ones, a suffix
this room does not know) is refused with the module's name: mixing in a scheme rackserve cannot run must
never load as garbage.

This room never quantizes or requantizes, and it never reads files: the caller hands it the tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .checkpoint import (
    INPUT_SCALE_SUFFIX,
    Layout,
    detect_layout,
    from_compressed_tensors,
    from_modelopt,
    input_scale_from,
)
from .recipe import NVFP4Tensor, dequantize

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Per layout: the suffix that marks a module as NVFP4-quantized, and every suffix its weight is made of.
_NVFP4_SUFFIXES: dict[str, tuple[str, tuple[str, ...]]] = {
    "modelopt": ("weight_scale_2", ("weight", "weight_scale", "weight_scale_2")),
    "compressed-tensors": ("weight_packed", ("weight_packed", "weight_scale", "weight_global_scale")),
}
# KV-cache scales: rackserve's KV cache is 16-bit (its wire formats carry their own scales).
_SKIPPED_SUFFIXES = frozenset({"k_scale", "v_scale"})
_NON_FLOAT_WEIGHTS = (torch.uint8, torch.int8, torch.int32, torch.float8_e4m3fn, torch.float8_e5m2)


def load_prequantized_weights(
    tensors: Mapping[str, torch.Tensor], layout: Layout | None = None
) -> dict[str, torch.Tensor | NVFP4Tensor]:
    """A pre-quantized Llama state dict (Hugging Face names) → canonical names; see the module docstring.

    `layout` is "modelopt" or "compressed-tensors"; None detects it from the names. Keys that map to nothing
    in a Llama decoder are skipped, like the loader skips them. Tied LM heads are the caller's business (an
    absent `lm_head.weight` stays absent).
    """
    # the one HF → canonical mapping and activation-scale name; lazy: no cycle
    from services.engine.loader import ACTIVATION_SCALE_SUFFIX, _hf_to_canonical

    if layout is None:
        layout = detect_layout(tensors)
        if layout is None:
            raise ValueError(
                "no NVFP4 weights found: expected ModelOpt (`*.weight_scale_2`) or compressed-tensors "
                "(`*.weight_packed`, `*.weight_global_scale`) tensor names"
            )
    if layout not in _NVFP4_SUFFIXES:
        raise ValueError(f"layout must be one of {tuple(_NVFP4_SUFFIXES)}, got {layout!r}")
    marker, parts = _NVFP4_SUFFIXES[layout]
    read = from_modelopt if layout == "modelopt" else from_compressed_tensors

    modules: dict[str, set[str]] = {}
    for key in tensors:
        prefix, _, suffix = key.rpartition(".")
        modules.setdefault(prefix, set()).add(suffix)

    out: dict[str, torch.Tensor | NVFP4Tensor] = {}
    for prefix, suffixes in sorted(modules.items()):
        canon = _hf_to_canonical(f"{prefix}.weight")
        if canon is None:
            continue
        known = {"weight", "bias"} | _SKIPPED_SUFFIXES
        if marker in suffixes:
            known |= set(parts) | {"weight_zero_point", INPUT_SCALE_SUFFIX[layout]}
            _check_zero_point(tensors, prefix)
            q = read(tensors, prefix)
            projection = canon.rpartition(".")[2] in PROJECTIONS
            out[canon] = q if projection else dequantize(q)
            act = f"{prefix}.{INPUT_SCALE_SUFFIX[layout]}"
            if projection and act in tensors:
                out[canon + ACTIVATION_SCALE_SUFFIX] = input_scale_from(layout, tensors[act], act)
        elif "weight" in suffixes:
            w = tensors[f"{prefix}.weight"]
            if w.dtype in _NON_FLOAT_WEIGHTS or suffixes & {"weight_scale", "weight_packed"}:
                raise ValueError(
                    f"{prefix}: weight is {w.dtype} with tensors {sorted(suffixes)}, which is not NVFP4 in the "
                    f"{layout} layout (no `{prefix}.{marker}`); rackserve serves NVFP4 or unquantized weights"
                )
            out[canon] = w.to(torch.float32).contiguous()
        unknown = suffixes - known
        if unknown:
            raise ValueError(
                f"{prefix}: unexpected tensor(s) {sorted(f'{prefix}.{s}' for s in unknown)} for a {layout} "
                "NVFP4 checkpoint"
            )
        if "bias" in suffixes:
            bias_name = _hf_to_canonical(f"{prefix}.bias")
            assert bias_name is not None
            out[bias_name] = tensors[f"{prefix}.bias"].to(torch.float32).contiguous()
    return out


def _check_zero_point(tensors: Mapping[str, torch.Tensor], prefix: str) -> None:
    zp = tensors.get(f"{prefix}.weight_zero_point")
    if zp is not None and bool((zp != 0).any()):
        raise ValueError(f"{prefix}.weight_zero_point is non-zero: asymmetric FP4 is not NVFP4")


def fuse_rows(parts: Sequence[NVFP4Tensor]) -> NVFP4Tensor | None:
    """Stack NVFP4 weights along their output rows (q/k/v into QKV, gate/up), bytes unchanged — or None when
    their tensor scales differ, since one fused tensor has one g_e and changing it would mean requantizing.

    Rows are independent in NVFP4 except through g_e, so with equal g_e the fused tensor dequantizes to exactly
    the concatenation of the parts' dequantized rows.
    """
    if not parts:
        raise ValueError("fuse_rows: nothing to fuse")
    k = parts[0].shape[-1]
    for p in parts:
        if len(p.shape) != 2 or p.shape[-1] != k:
            raise ValueError(
                f"fuse_rows: parts must be 2-D with the same in_features, got {[q.shape for q in parts]}"
            )
    g = parts[0].global_scale
    if any(not torch.equal(p.global_scale, g) for p in parts[1:]):
        return None
    return NVFP4Tensor(
        packed=torch.cat([p.packed for p in parts]),
        scales=torch.cat([p.scales for p in parts]),
        global_scale=g.clone(),
        shape=(sum(p.shape[0] for p in parts), k),
    )


def split_rows(q: NVFP4Tensor, rows: Sequence[int]) -> list[NVFP4Tensor]:
    """Inverse of fuse_rows: a fused [sum(rows), K] NVFP4 weight into its parts, bytes and g_e unchanged."""
    if len(q.shape) != 2 or sum(rows) != q.shape[0]:
        raise ValueError(f"split_rows: {list(rows)} rows do not make up a 2-D weight of shape {q.shape}")
    out, start = [], 0
    for n in rows:
        out.append(
            NVFP4Tensor(
                packed=q.packed[start : start + n].contiguous(),
                scales=q.scales[start : start + n].contiguous(),
                global_scale=q.global_scale.clone(),
                shape=(n, q.shape[1]),
            )
        )
        start += n
    return out
