"""NVFP4Linear: a torch.nn.Linear replacement that keeps its weight packed in NVFP4.

forward(x) computes x @ W_hat^T (+ bias) in x's dtype, where W_hat = dequantize(weight) exactly as recipe.py
defines it, with the best kernel the machine offers:

- CUDA + Triton:  the fused W4A16 dequant-GEMM (weights stay packed, fp32 accumulation);
- otherwise:      dequantize to x's dtype + torch matmul (optionally caching the dequantized weight);
- W4A4:           on Blackwell, activations quantized to NVFP4 and multiplied on FP4 tensor cores — different
                  numerics, so only when the caller passes w4a4=True (the engine does on GPUs of compute
                  capability >= 10 whose probe GEMM passes, as --nvfp4-gemm allows: blackwell.choose_gemm);
                  off a GPU w4a4=True emulates it (activations quantized and dequantized, then the matmul).
                  The activations' tensor scale is the layer's static `input_scale` where a W4A4 checkpoint
                  calibrated one (as vLLM serves ModelOpt and compressed-tensors NVFP4), else one per call from
                  the call's amax. A static scale makes a row's product independent of the rows batched with it.

The kernel chosen is logged once per (kernel, device type, dtype), so a change of numerics is never silent.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from .blackwell import BlackwellWeight, blackwell_unavailable_reason, prepare_weight, w4a4_matmul
from .recipe import NVFP4Tensor, dequantize, quantize

logger = logging.getLogger(__name__)

_announced: set[tuple[str, str, torch.dtype]] = set()


def _announce(kernel: str, x: torch.Tensor, detail: str) -> None:
    key = (kernel, x.device.type, x.dtype)
    if key not in _announced:
        _announced.add(key)
        logger.info("NVFP4Linear: %s for %s %s activations (%s)", kernel, x.device.type, x.dtype, detail)


def _quantize_on_device(weight: torch.Tensor, method: str = "rtn") -> NVFP4Tensor:
    """Quantize where the weight lives: Triton on CUDA when available, else the torch recipe (same bytes).
    A calibrated method (methods.py) runs in torch on the weight's device; its output is the same format."""
    if method != "rtn":
        from .methods import check_method, quantize_with

        return quantize_with(weight, check_method(method, load_time=True))
    if weight.is_cuda:
        try:
            from .triton_kernels import quantize_triton
        except ImportError:
            return quantize(weight)
        return quantize_triton(weight)
    return quantize(weight)


class NVFP4Linear(torch.nn.Module):
    """Linear layer with an NVFP4 weight [out_features, in_features]; see the module docstring."""

    packed: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    input_scale: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: NVFP4Tensor,
        bias: torch.Tensor | None = None,
        *,
        cache_dequantized: bool = False,
        w4a4: bool = False,
        input_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if len(weight.shape) != 2:
            raise ValueError(
                f"NVFP4Linear: weight must be 2-D [out_features, in_features], got {weight.shape}"
            )
        self.out_features, self.in_features = weight.shape
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(
                f"NVFP4Linear: bias must have shape ({self.out_features},), got {tuple(bias.shape)}"
            )
        self.register_buffer("packed", weight.packed.contiguous())
        self.register_buffer("scales", weight.scales.contiguous())
        self.register_buffer("global_scale", weight.global_scale.reshape(()).to(torch.float32))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        # the static activation tensor scale (g_e, encode convention) W4A4 quantizes inputs with; None: per call
        self.register_buffer("input_scale", None)
        self.set_input_scale(input_scale)
        self.cache_dequantized = cache_dequantized
        self.w4a4 = w4a4
        self._dequantized: torch.Tensor | None = None  # x-dtype W_hat, CPU path with cache_dequantized only
        self._blackwell_weight: BlackwellWeight | None = None  # swizzled scales for W4A4
        if w4a4 and self.packed.is_cuda and self._fp4_shape_ok():
            # built with the weights, so the start-up log counts them as weights, not as activation peak
            self._blackwell_weight = prepare_weight(self.weight_nvfp4)

    def set_input_scale(self, g: torch.Tensor | None) -> None:
        """Set (or, with None, clear) the static activation scale: a finite positive g_e, kept as fp32 0-dim on
        the weight's device (a kernel reads it there)."""
        if g is not None:
            g = g.detach().reshape(()).to(device=self.packed.device, dtype=torch.float32)
            if not (bool(torch.isfinite(g)) and float(g) > 0):
                raise ValueError(f"NVFP4Linear: input_scale must be finite and positive, got {float(g)}")
        self.input_scale = g

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        cache_dequantized: bool = False,
        *,
        w4a4: bool = False,
        method: str = "rtn",
    ) -> NVFP4Linear:
        """Quantize a dense [out, in] weight (on its own device) with the recipe, or with one of methods.py's
        data-free methods, and wrap it."""
        with torch.no_grad():
            q = _quantize_on_device(weight.detach(), method)
        return cls(q, bias, cache_dequantized=cache_dequantized, w4a4=w4a4)

    @property
    def weight_nvfp4(self) -> NVFP4Tensor:
        return NVFP4Tensor(
            packed=self.packed,
            scales=self.scales,
            global_scale=self.global_scale,
            shape=(self.out_features, self.in_features),
        )

    def weight_bytes(self) -> int:
        """Bytes this layer holds for its weight: packed codes, scales, tensor scale, and any cached copy."""
        held = self.packed.numel() + self.scales.numel() + self.global_scale.numel() * 4
        if self.input_scale is not None:
            held += 4
        if self._dequantized is not None:
            held += self._dequantized.numel() * self._dequantized.element_size()
        if self._blackwell_weight is not None:
            held += self._blackwell_weight.scales_swizzled.numel()  # packed codes are shared, not copied
        return held

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"NVFP4Linear: expected input [..., {self.in_features}], got {tuple(x.shape)}")
        if x.is_cuda:
            if self.w4a4:
                out = self._forward_w4a4(x)
                if out is not None:
                    return out if self.bias is None else out + self.bias.to(out.dtype)
            out = self._forward_triton(x)
            if out is not None:
                return out if self.bias is None else out + self.bias.to(out.dtype)
        elif self.w4a4 and self._fp4_shape_ok():  # the shapes a GPU runs W4A4 (others fall back there too)
            x = self._emulate_w4a4_activations(x)
        elif self.w4a4:
            _announce("W4A4 not emulated, W4A16", x, self._fp4_shape_reason())
        return self._forward_dequantized(x)

    def _emulate_w4a4_activations(self, x: torch.Tensor) -> torch.Tensor:
        """W4A4 off a GPU: the call's activations quantized with the recipe (one tensor scale, as the FP4 GEMM
        takes them) and dequantized, for the 16-bit matmul after. The FP4 GEMM's product up to its roundings
        (its bf16 output; here the dequantized activations in x's dtype), so a CPU can evaluate W4A4's numerics."""
        _announce(
            "W4A4 emulated",
            x,
            f"activations NVFP4-quantized ({self._scale_kind()}), dequantized, 16-bit matmul",
        )
        x2 = x.reshape(-1, self.in_features)
        return dequantize(quantize(x2, global_scale=self.input_scale)).to(x.dtype).reshape(x.shape)

    def _forward_w4a4(self, x: torch.Tensor) -> torch.Tensor | None:
        reason = blackwell_unavailable_reason(x.device)
        if reason is None and not self._fp4_shape_ok():
            reason = self._fp4_shape_reason()
        if reason is not None:
            _announce("W4A4 unavailable, falling back to W4A16", x, reason)
            return None
        if self._blackwell_weight is None or self._blackwell_weight.packed.device != x.device:
            self._blackwell_weight = prepare_weight(self.weight_nvfp4)
        _announce(
            "blackwell-w4a4 (torch._scaled_mm)", x, f"activations quantized to NVFP4, {self._scale_kind()}"
        )
        return w4a4_matmul(x, self._blackwell_weight, self.input_scale)

    def _scale_kind(self) -> str:
        return (
            "the checkpoint's static tensor scale"
            if self.input_scale is not None
            else "a tensor scale per call"
        )

    def _fp4_shape_ok(self) -> bool:
        return self.in_features % 32 == 0 and self.out_features % 16 == 0

    def _fp4_shape_reason(self) -> str:
        return (
            "the FP4 GEMM needs in_features % 32 == 0 and out_features % 16 == 0, got "
            f"{self.in_features} and {self.out_features}"
        )

    def _forward_triton(self, x: torch.Tensor) -> torch.Tensor | None:
        try:
            from .triton_kernels import w4a16_matmul
        except ImportError as exc:
            _announce("cpu-style dequantize + matmul", x, f"Triton unavailable: {exc}")
            return None
        _announce("triton-w4a16", x, "NVFP4 weights decoded in-kernel, fp32 accumulation")
        return w4a16_matmul(x, self.weight_nvfp4)

    def _forward_dequantized(self, x: torch.Tensor) -> torch.Tensor:
        w_hat = self._dequantized
        if w_hat is None or w_hat.dtype != x.dtype or w_hat.device != x.device:
            w_hat = dequantize(self.weight_nvfp4).to(device=x.device, dtype=x.dtype)
            if self.cache_dequantized:
                self._dequantized = w_hat
        _announce(
            "dequantize + torch matmul",
            x,
            f"W_hat rounded to {x.dtype}, "
            + ("cached after first call" if self.cache_dequantized else "per call"),
        )
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, w_hat, bias)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # module.to(torch.bfloat16) casts every floating buffer; the tensor scales must stay the exact fp32 they
        # were, so they follow the device move but keep their dtype and bits.
        g, g_in = self.global_scale, self.input_scale
        super()._apply(fn, recurse)
        if self.global_scale.dtype != torch.float32:
            self.global_scale = g.to(self.global_scale.device)
        if g_in is not None and self.input_scale is not None and self.input_scale.dtype != torch.float32:
            self.input_scale = g_in.to(self.input_scale.device)
        self._dequantized = None
        self._blackwell_weight = None
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, nvfp4, cache_dequantized={self.cache_dequantized}, "
            f"w4a4={self.w4a4}" + (", static input_scale" if self.input_scale is not None else "")
        )


def weight_memory_bytes(module: torch.nn.Module) -> int:
    """Bytes of weights a model holds: NVFP4 layers count their packed form (plus caches), others their
    parameters and persistent buffers, each tensor once (a tied LM head is the embedding; the rotary tables,
    non-persistent buffers, are derived, not weights). What the engine logs at start-up."""
    total = 0
    seen: set[tuple[str, int]] = set()
    for sub in module.modules():
        if isinstance(sub, NVFP4Linear):
            total += sub.weight_bytes()
            if sub.bias is not None:
                total += sub.bias.numel() * sub.bias.element_size()
            continue
        derived: set[str] = getattr(sub, "_non_persistent_buffers_set", set())
        named = [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]
        for name, t in named:
            try:
                key = (str(t.device), t.data_ptr())
            except RuntimeError:  # an opaque tensor (oneDNN's packed bf16 weights) has no storage to share
                key = ("opaque", id(t))
            if name in derived or (t.device.type != "meta" and key in seen):
                continue
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
