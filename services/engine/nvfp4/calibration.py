"""Calibration for gptq, and the whole-model quantizer shared by `rackserve quantize` and the quality bench.

gptq needs, per projection, the Hessian of its inputs H = 2 X^T X / n over a calibration set; a W4A4
checkpoint needs, per projection, a static tensor scale for its input activations (their largest magnitude).
Both are collected in one pass (`observe`) of the unquantized float32 model (every layer sees the float
inputs, not those of already-quantized layers before it: for gptq simpler, and within noise of the sequential
variant on small models).

The calibration text ships with Debian (base-files' licence texts other than GPL-3) plus the repository's
loadgen/corpus.txt; the quality bench evaluates on /usr/share/common-licenses/GPL-3, which none of it contains.

Fusing follows the engine: q/k/v and gate/up are quantized as one matrix each (one tensor scale, one
Hessian: they read the same input), exactly as `--quant nvfp4` does at load, then split into the checkpoint's
per-projection tensors — which share g_e, so the loader fuses them back byte for byte.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .methods import check_method, quantize_with
from .prequantized import split_rows
from .recipe import NVFP4Tensor, global_scale_for_amax

_REPO = Path(__file__).resolve().parents[3]
CALIBRATION_TEXTS = (
    Path("/usr/share/common-licenses/Apache-2.0"),
    Path("/usr/share/common-licenses/MPL-2.0"),
    Path("/usr/share/common-licenses/Artistic"),
    _REPO / "loadgen" / "corpus.txt",
)
EVALUATION_TEXT = Path("/usr/share/common-licenses/GPL-3")  # never calibrated on
CALIBRATION_WINDOW = 512
CALIBRATION_WINDOWS = 8

# The engine's fused projections: (module attribute path, the canonical parts in row order)
FUSED = (
    ("attn.wqkv", ("q_proj", "k_proj", "v_proj")),
    ("attn.wo", ("o_proj",)),
    ("ffn.w_gate_up", ("gate_proj", "up_proj")),
    ("ffn.w_down", ("down_proj",)),
)


def calibration_windows(
    tokenizer: object,
    texts: Sequence[Path] = CALIBRATION_TEXTS,
    window: int = CALIBRATION_WINDOW,
    max_windows: int = CALIBRATION_WINDOWS,
) -> list[torch.Tensor]:
    """Non-overlapping `window`-token windows of the texts (each text tokenized on its own), at most
    `max_windows`, spread over the texts in turn so that each contributes."""
    if EVALUATION_TEXT in texts:
        raise ValueError(f"{EVALUATION_TEXT} is the evaluation text; calibrating on it would flatter gptq")
    per_text = []
    for t in texts:
        if not t.is_file():
            continue
        ids = tokenizer.encode(t.read_text(encoding="utf-8", errors="replace"))  # type: ignore[attr-defined]
        chunks = [ids[i : i + window] for i in range(0, len(ids) - window // 4, window)]
        per_text.append([torch.tensor(c) for c in chunks if len(c) >= 16])
    out: list[torch.Tensor] = []
    while len(out) < max_windows and any(per_text):
        for chunks in per_text:
            if chunks and len(out) < max_windows:
                out.append(chunks.pop(0))
    if not out:
        raise ValueError(f"no calibration text found among {[str(t) for t in texts]}")
    return out


def _observe_inputs(
    loaded: object, windows: Sequence[torch.Tensor], observe: Callable[[str, torch.Tensor], None]
) -> None:
    """Run the windows through the unquantized float32 model, handing every fused projection's [tokens, in]
    float32 input to `observe` with its key `layers.{i}.{attr}` (FUSED)."""
    from services.engine.model import AttnMetadata, PagedKvCache, PrefillSegment, Transformer

    cfg = loaded.config  # type: ignore[attr-defined]
    model = Transformer(cfg, loaded.weights, torch.float32, "none", cpu_kernels=False)  # type: ignore[attr-defined]
    handles = []
    for i, blk in enumerate(model.blocks):
        for attr, _ in FUSED:
            key = f"layers.{i}.{attr}"

            def hook(_m: torch.nn.Module, args: tuple[torch.Tensor, ...], key: str = key) -> None:
                observe(key, args[0].reshape(-1, args[0].shape[-1]).to(torch.float32))

            handles.append(blk.get_submodule(attr).register_forward_pre_hook(hook))
    try:
        for ids in windows:
            kv = PagedKvCache(cfg, -(-len(ids) // 16), 16, torch.float32)
            meta = AttnMetadata(slot_mapping=torch.arange(len(ids)), prefills=[PrefillSegment(0, len(ids))])
            model(ids, torch.arange(len(ids)), meta, kv)
    finally:
        for h in handles:
            h.remove()


@dataclass
class Observed:
    """What one calibration pass collected, keyed `layers.{i}.{attr}` (FUSED); None where it was not asked."""

    hessians: dict[str, torch.Tensor] | None  # H = 2 X^T X / n of the projection's input
    amax: dict[str, torch.Tensor] | None  # max |x_j| per input channel


def observe(
    loaded: object, windows: Sequence[torch.Tensor], *, hessians: bool = False, amax: bool = False
) -> Observed:
    """One pass of the windows collecting what is asked: gptq's Hessians, the channel maxima, or both (a W4A4
    gptq checkpoint needs both, and one forward is ~7 s of SmolLM2's calibration on two cores)."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    peaks: dict[str, torch.Tensor] = {}

    def see(key: str, x: torch.Tensor) -> None:
        if hessians:
            sums[key] = sums.get(key, 0) + x.T @ x  # type: ignore[assignment]  # fp32: 4k tokens sum fine
            counts[key] = counts.get(key, 0) + x.shape[0]
        if amax:
            a = x.abs().amax(dim=0)
            peaks[key] = torch.maximum(peaks[key], a) if key in peaks else a

    if not (hessians or amax):
        raise ValueError("observe: ask for hessians, amax or both")
    _observe_inputs(loaded, windows, see)
    return Observed(
        {k: 2 * s / counts[k] for k, s in sums.items()} if hessians else None, peaks if amax else None
    )


def collect_hessians(loaded: object, windows: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """H = 2 X^T X / n of every fused projection's input, keyed `layers.{i}.{attr}` (FUSED)."""
    h = observe(loaded, windows, hessians=True).hessians
    assert h is not None
    return h


def channel_amax(loaded: object, windows: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """max |x_j| per input channel of every fused projection over the windows, keyed `layers.{i}.{attr}`
    (FUSED): what smoothing's factors and, at its largest, a static activation scale are made of."""
    a = observe(loaded, windows, amax=True).amax
    assert a is not None
    return a


def calibrate_input_scales(loaded: object, windows: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """W4A4's static activation scales calibrated on the windows (input_scales_from_amax)."""
    return input_scales_from_amax(loaded, channel_amax(loaded, windows))


def input_scales_from_amax(loaded: object, amax: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """W4A4's static activation scales: for every block projection (canonical names, `layers.3.q_proj`), g_e of
    the largest |x| its input took (`amax`: channel_amax's; max calibration, as ModelOpt's and llm-compressor's
    default observers). The parts of a fused projection read one input, so they share its scale."""
    out: dict[str, torch.Tensor] = {}
    for i in range(loaded.config.num_layers):  # type: ignore[attr-defined]
        for attr, parts in FUSED:
            a = amax[f"layers.{i}.{attr}"].max()
            # global_scale_for_amax maps these to 1.0, a scale that would mean amax 2688: refuse them instead
            if not (bool(torch.isfinite(a)) and float(a) > 0):
                raise ValueError(f"layers.{i}.{attr}: calibration saw an input amax of {float(a)}")
            g = global_scale_for_amax(a)
            out |= {f"layers.{i}.{p}": g for p in parts}
    return out


def quantize_model(
    loaded: object,
    method: str,
    hessians: dict[str, torch.Tensor] | None = None,
    progress: Callable[[str], None] | None = None,
    **gptq_kw: Any,
) -> dict[str, NVFP4Tensor]:
    """Every block projection of a dense model as NVFP4 with `method`, canonical names (`layers.3.q_proj`).
    `gptq_kw` are methods.gptq's options (act_order, scales, damp), refused for the other methods."""
    check_method(method)
    if method == "gptq" and hessians is None:
        raise ValueError("quantize_model: method 'gptq' needs the calibration Hessians (collect_hessians)")
    if method != "gptq" and gptq_kw:
        raise ValueError(f"quantize_model: {sorted(gptq_kw)} apply to gptq only, not {method!r}")
    weights = loaded.weights  # type: ignore[attr-defined]
    out: dict[str, NVFP4Tensor] = {}
    for i in range(loaded.config.num_layers):  # type: ignore[attr-defined]
        start = time.perf_counter()
        for attr, parts in FUSED:
            names = [f"layers.{i}.{p}" for p in parts]
            dense = [weights[n] for n in names]
            if not all(isinstance(w, torch.Tensor) for w in dense):
                raise ValueError(f"layer {i}: already quantized; quantize a dense (GGUF or bf16) model")
            h = hessians[f"layers.{i}.{attr}"] if method == "gptq" and hessians is not None else None
            with torch.no_grad():
                q = quantize_with(torch.cat(dense), method, hessian=h, **gptq_kw)
            for name, part in zip(names, split_rows(q, [w.shape[0] for w in dense]), strict=True):
                out[name] = part
        if progress is not None:
            progress(f"layer {i}: {method} in {time.perf_counter() - start:.2f} s")
    return out
