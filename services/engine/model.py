"""The Llama-family transformer in plain torch, over a paged KV cache.

One file, top to bottom: rotary embeddings, RMSNorm, attention (fused QKV, GQA, paged KV), SwiGLU feed-forward
(fused gate/up), the decoder, and the attention metadata a step hands it. Speed on CPU comes from a few
deliberate choices: all tokens of a step go through each projection as one matrix; decode attention gathers
K/V once per layer from the blocks and runs SDPA's flash CPU kernel over them (GQA, a boolean context mask),
which softmaxes in fp32 whatever the model dtype.

This room knows nothing about requests, scheduling or where the weights came from.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.engine import cpu_ops
from services.engine.config import ModelConfig
from services.engine.loader import ACTIVATION_SCALE_SUFFIX

if TYPE_CHECKING:
    from services.engine.nvfp4 import NVFP4Tensor
    from services.engine.varlen import VarlenPrefill

# the loaded weights by canonical name (loader.Weights), or the same seen through _OnDevice
Weights = Mapping[str, "torch.Tensor | NVFP4Tensor"]

log = logging.getLogger("rackserve.engine")

# ------------------------------------------------------------------------------------------------ rotary


def rope_inv_freq(config: ModelConfig, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    hd = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    if rope_freqs is not None:  # GGUF stores Llama-3 scaling as precomputed per-frequency factors
        return inv / rope_freqs.float()
    rs = config.rope_scaling
    if rs is None:
        return inv
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    mid = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def rope_tables(inv_freq: torch.Tensor, max_context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width cos and sign-folded sin per position, [max_context, head_dim] float32, so that rotating is
    `x * cos + rotate_half(x) * sin` with rotate_half a plain roll: [x1, x2] -> [x2, x1]."""
    angles = torch.outer(torch.arange(max_context, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] in rotate-half layout; cos/sin: [T, 1, head_dim] from rope_tables.

    Bit-equal to cat(x1 cos - x2 sin, x2 cos + x1 sin) (negating sin is exact) in a third of the ops."""
    xf = x.float()
    return (xf * cos + xf.roll(x.shape[-1] // 2, dims=-1) * sin).to(x.dtype)


# ------------------------------------------------------------------------------------------- paged KV


def layer_rows(block_ids: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """Rows of one layer's [kv_heads * num_blocks, block_size, head_dim] K or V view that hold these blocks."""
    heads = torch.arange(num_kv_heads, device=block_ids.device)[:, None] * num_blocks
    return (heads + block_ids.reshape(1, -1)).reshape(-1)


class PagedKvCache:
    """K and V of all layers in fixed-size blocks: one tensor [layers, 2, kv_heads, blocks, block_size, head_dim].

    Head-major inside each layer, so gathering a batch's blocks for one layer is a single index_select over
    contiguous [block_size, head_dim] chunks that lands directly in the [kv_heads x batch, tokens, head_dim]
    shape batched matmuls want — no transposing copies on the decode path. A block's bytes are therefore
    spread over layers x 2 x kv_heads chunks; export/import gather and scatter them (LAYOUT names the order).
    """

    LAYOUT = "layer,kv,kv_head,token,head_dim"  # order of one exported block

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        scratch_blocks: int = 0,
    ):
        # scratch_blocks extra blocks past the ones the BlockManager hands out: padded rows of a CUDA-graph decode
        # step write their K/V there, so padding never touches a real sequence's cache.
        self.num_blocks = num_blocks + scratch_blocks  # the block dimension of the tensor (the row stride)
        self.usable_blocks = num_blocks
        self.scratch_block = num_blocks if scratch_blocks else None
        self.block_size = block_size
        self.num_kv_heads = config.num_kv_heads
        self.dtype = dtype
        self.device = torch.device(device)
        self.data = torch.zeros(
            config.num_layers, 2, config.num_kv_heads, self.num_blocks, block_size, config.head_dim,
            dtype=dtype, device=self.device,
        )  # fmt: skip
        # per layer: [kv_heads * blocks, block_size, head_dim]; row h * num_blocks + b is head h of block b
        self.k = [self.data[i, 0].view(-1, block_size, config.head_dim) for i in range(config.num_layers)]
        self.v = [self.data[i, 1].view(-1, block_size, config.head_dim) for i in range(config.num_layers)]

    def gather_index(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Rows of a layer's K/V view holding these blocks, head-major: [kv_heads * len(block_ids)]."""
        return layer_rows(block_ids, self.num_kv_heads, self.num_blocks)

    def read_blocks(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Copy out whole blocks: [n, layers, 2, kv_heads, block_size, head_dim] (the export order), contiguous.
        One gather from the block-major view (selecting on the cache's own layout and then making the result
        contiguous copies every byte twice: 1.8x the time on one CPU thread)."""
        return self.data.permute(3, 0, 1, 2, 4, 5).index_select(0, block_ids)

    def read_block(self, block_id: int) -> torch.Tensor:
        """One block's copy, [layers, 2, kv_heads, block_size, head_dim], contiguous: read_blocks for a block id
        the host holds, with no index tensor to upload (on a GPU, that upload waited for every queued kernel)."""
        return self.data[:, :, :, block_id].clone(memory_format=torch.contiguous_format)

    def write_blocks(self, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        self.data.index_copy_(3, block_ids, blocks.permute(1, 2, 3, 0, 4, 5))

    @property
    def block_bytes(self) -> int:
        return self.data[:, :, :, 0].numel() * self.data.element_size()

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty(0, dtype=dtype).element_size()
        return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * elem


@dataclass
class PrefillSegment:
    """Tokens [start, end) of the step belong to one sequence.

    ctx_rows is None when the sequence has no earlier context: attention then runs on the fresh K/V directly.
    Otherwise it is the gather index (PagedKvCache.gather_index) of the sequence's blocks, new tokens included,
    and positions are the queries' positions. (On the Triton backend most chunks go in AttnMetadata.varlen
    instead: one launch reads every sequence's blocks in place.)
    """

    start: int
    end: int
    ctx_rows: torch.Tensor | None = None
    positions: torch.Tensor | None = None


@dataclass
class AttnMetadata:
    slot_mapping: torch.Tensor  # [T] block * block_size + offset of each new token
    decode_rows: torch.Tensor | None = None  # [B] rows of the step that are single-token decodes
    decode_tables: torch.Tensor | None = None  # int32 [B, nb] their block tables, padded with block 0
    decode_lens: torch.Tensor | None = None  # int32 [B] their context lengths, the new token included
    prefills: list[PrefillSegment] = field(default_factory=list)  # run one by one (SDPA)
    varlen: VarlenPrefill | None = None  # Triton backend: prefill chunks run in one launch per layer
    _gather: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)

    def decode_gather(self, k_cache: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For the torch path, once per step: the gather index of the decode rows' blocks in a layer's K/V view
        ([kv_heads * B * nb], see layer_rows) and the [B, 1, 1, nb * block_size] mask of keys in context."""
        if self._gather is None:
            assert self.decode_tables is not None and self.decode_lens is not None
            rows = layer_rows(self.decode_tables.long(), num_kv_heads, k_cache.shape[0] // num_kv_heads)
            keys = torch.arange(self.decode_tables.shape[1] * k_cache.shape[1], device=k_cache.device)
            self._gather = rows, (keys[None, :] < self.decode_lens[:, None])[:, None, None, :]
        return self._gather


# ------------------------------------------------------------------------------------------------ layers


def dense(w: Weights, name: str) -> torch.Tensor:
    """A tensor the model keeps in high precision (embeddings, norms, LM head, rope factors)."""
    t = w[name]
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a dense tensor, the checkpoint holds it quantized")
    return t


class _OnDevice(Mapping[str, "torch.Tensor | NVFP4Tensor"]):
    """A view of the loaded weights that hands each one out on the model's device (NVFP4 parts field by field)."""

    def __init__(self, w: Weights, device: torch.device):
        self._w, self._device = w, device

    def __getitem__(self, name: str) -> torch.Tensor | NVFP4Tensor:
        t = self._w[name]
        if isinstance(t, torch.Tensor):
            return t.to(self._device)
        if t.packed.device == self._device:
            return t
        return dataclasses.replace(
            t,
            packed=t.packed.to(self._device),
            scales=t.scales.to(self._device),
            global_scale=t.global_scale.to(self._device),
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._w)

    def __len__(self) -> int:
        return len(self._w)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 whatever the model dtype (as transformers does), with torch's fused kernel."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)


class PackedLinear(nn.Module):
    """A bf16 projection with its weight pre-packed once into oneDNN's blocked layout (AMX/AVX-512 on x86).

    Plain F.linear re-lays the weight on every call; packing at load time makes the small-batch GEMMs of decode
    roughly 1.3-2x faster on CPU. Same math (bf16 inputs, fp32 accumulation), so only rounding-level differences.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features = weight.shape[0]
        # a buffer, so the model's weight bytes (the start-up log, rackserve_engine_memory_bytes) count it
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @staticmethod
    def available() -> bool:
        """oneDNN with bf16 support on this CPU, and the packing ops in this torch build."""
        if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return False
        try:
            w = torch.ones(32, 32, dtype=torch.bfloat16)
            y = PackedLinear(w, None)(torch.ones(2, 32, dtype=torch.bfloat16))
            return bool(torch.all(y == 32))
        except (RuntimeError, AttributeError):
            return False


_PACKED_OK: bool | None = None


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, quant: str, **kw
) -> nn.Module:
    """A projection in the serving form: NVFP4 packed weights, a oneDNN-packed bf16 weight, or a dense nn.Linear."""
    global _PACKED_OK
    if quant == "nvfp4":
        from services.engine.nvfp4 import NVFP4Linear

        return NVFP4Linear.from_weight(weight, bias, **kw)
    if dtype == torch.bfloat16 and weight.device.type == "cpu":
        if _PACKED_OK is None:
            _PACKED_OK = PackedLinear.available()
            log.info(
                "bf16 projections: %s", "oneDNN pre-packed" if _PACKED_OK else "plain torch (no oneDNN bf16)"
            )
        if _PACKED_OK:
            return PackedLinear(weight.to(dtype), None if bias is None else bias.to(dtype))
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=dtype, device="meta")
    lin.weight = nn.Parameter(weight.to(dtype).contiguous(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.to(dtype).contiguous(), requires_grad=False)
    return lin


class ConcatLinear(nn.Module):
    """Projections run side by side, outputs concatenated (q|k|v, gate|up).

    Used only for pre-quantized NVFP4 parts that carry different tensor scales: fusing them into one matrix would
    mean requantizing, which changes the checkpoint's numbers.
    """

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def input_scale(w: Weights, names: list[str]) -> torch.Tensor | None:
    """The static activation scale (g_e) of projections that read one input (q/k/v, gate/up), from a W4A4
    checkpoint that calibrated them (`{name}.input_scale`), or None. Parts calibrated apart get the largest amax
    of theirs, the smallest g_e, so that no part's activations are clipped; parts of which only some carry a
    scale are refused."""
    scales = [w.get(n + ACTIVATION_SCALE_SUFFIX) for n in names]
    if all(s is None for s in scales):
        return None
    if any(s is None for s in scales):
        missing = [n for n, s in zip(names, scales, strict=True) if s is None]
        raise ValueError(f"{missing} carry no static activation scale, which the other parts of {names} do")
    return torch.stack([cast(torch.Tensor, s).reshape(()) for s in scales]).min()


def make_fused_linear(
    parts: list[torch.Tensor | NVFP4Tensor],
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    quant: str,
    input_scale: torch.Tensor | None = None,
    **kw,
) -> nn.Module:
    """One projection for several stacked weights: dense ones are concatenated (and quantized together under
    --quant nvfp4, one tensor scale); pre-quantized NVFP4 parts keep their bytes — fused when their tensor
    scales agree, side by side when they don't — and their static activation scale (`input_scale`)."""
    dense = [w for w in parts if isinstance(w, torch.Tensor)]
    if len(dense) == len(parts):
        # one part as it is: a weight already on the device in its dtype is not copied
        return make_linear(dense[0] if len(dense) == 1 else torch.cat(dense), bias, dtype, quant, **kw)
    if dense:
        raise ValueError("a fused projection mixes pre-quantized NVFP4 and dense parts")
    from services.engine.nvfp4 import NVFP4Linear, fuse_rows

    packed = cast("list[NVFP4Tensor]", parts)
    fused = fuse_rows(packed)
    cache = bool(kw.get("cache_dequantized", False))
    w4a4 = bool(kw.get("w4a4", False))
    if fused is not None:
        return NVFP4Linear(fused, bias, cache_dequantized=cache, w4a4=w4a4, input_scale=input_scale)
    biases = bias.split([w.shape[0] for w in packed]) if bias is not None else [None] * len(packed)
    return ConcatLinear(
        [
            NVFP4Linear(w, b, cache_dequantized=cache, w4a4=w4a4, input_scale=input_scale)
            for w, b in zip(packed, biases, strict=True)
        ]
    )


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, w: Weights, prefix: str, dtype: torch.dtype, quant: str, **kw):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = [w[f"{prefix}.q_proj"], w[f"{prefix}.k_proj"], w[f"{prefix}.v_proj"]]
        bias = None
        if cfg.attention_bias:
            bias = torch.cat(
                [cast(torch.Tensor, w[f"{prefix}.{n}.bias"]) for n in ("q_proj", "k_proj", "v_proj")]
            )
        in_qkv = input_scale(w, [f"{prefix}.{n}" for n in ("q_proj", "k_proj", "v_proj")])
        self.wqkv = make_fused_linear(qkv, bias, dtype, quant, in_qkv, **kw)
        in_o = input_scale(w, [f"{prefix}.o_proj"])
        self.wo = make_fused_linear([w[f"{prefix}.o_proj"]], None, dtype, quant, in_o, **kw)
        self.scale = 1.0 / math.sqrt(self.hd)
        self.triton_decode = False  # set by Transformer: decode attention through the Triton paged kernel

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttnMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        T = x.shape[0]
        nq, nkv = self.n_heads * self.hd, self.n_kv * self.hd
        qk, v = self.wqkv(x).split([nq + nkv, nkv], dim=-1)
        qk = apply_rope(qk.reshape(T, self.n_heads + self.n_kv, self.hd), cos, sin)  # q and k in one pass
        q, k = qk.split([self.n_heads, self.n_kv], dim=1)
        v = v.reshape(T, self.n_kv, self.hd)
        # write the step's K/V: the layer view as [kv_heads, slots, head_dim], indexed by flat slot
        k_cache.view(self.n_kv, -1, self.hd).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_cache.view(self.n_kv, -1, self.hd).index_copy_(1, meta.slot_mapping, v.transpose(0, 1))

        out = torch.empty(T, self.n_heads, self.hd, dtype=x.dtype, device=x.device)
        if meta.decode_rows is not None and self.triton_decode:
            import services.engine.triton_attention as triton_attention

            assert meta.decode_tables is not None and meta.decode_lens is not None
            all_decode = meta.decode_rows.shape[0] == T
            od = triton_attention.paged_decode_attention(
                (q if all_decode else q[meta.decode_rows]).contiguous(),
                k_cache, v_cache, meta.decode_tables, meta.decode_lens, self.n_kv, self.scale,
            )  # fmt: skip
            if all_decode:
                return self.wo(od.reshape(T, self.n_heads * self.hd))
            out[meta.decode_rows] = od
        elif meta.decode_rows is not None:
            ctx_rows, mask = meta.decode_gather(k_cache, self.n_kv)
            B, L = meta.decode_rows.shape[0], mask.shape[-1]
            all_decode = B == T  # the common steady state: skip the row gather and scatter
            qd = (q if all_decode else q[meta.decode_rows]).unsqueeze(2)  # [B, heads, 1, head_dim]
            kd = k_cache.index_select(0, ctx_rows).view(self.n_kv, B, L, self.hd).transpose(0, 1)
            vd = v_cache.index_select(0, ctx_rows).view(self.n_kv, B, L, self.hd).transpose(0, 1)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True, scale=self.scale)
            if all_decode:
                return self.wo(od.reshape(T, self.n_heads * self.hd))
            out[meta.decode_rows] = od.reshape(B, self.n_heads, self.hd)
        self._prefill_attention(q, k, v, meta, k_cache, v_cache, out)
        return self.wo(out.view(T, self.n_heads * self.hd))

    def forward_fused(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttnMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
    ) -> torch.Tensor:
        """forward() on the fused CPU kernels (cpu_ops): rotary + KV write in one call, decode attention read
        from the blocks where they lie; prefill segments still run SDPA over the same q/k/v."""
        T = x.shape[0]
        nq, nkv = self.n_heads * self.hd, self.n_kv * self.hd
        qkv = self.wqkv(x).contiguous()
        cpu_ops.rope_store(
            qkv, positions, cos_table, sin_table, k_cache, v_cache, meta.slot_mapping, self.n_heads, self.n_kv
        )
        q = qkv[:, :nq]
        if meta.decode_rows is not None:
            assert meta.decode_tables is not None and meta.decode_lens is not None
            all_decode = meta.decode_rows.shape[0] == T
            od = cpu_ops.paged_decode_attention(
                q if all_decode else q[meta.decode_rows],
                k_cache, v_cache, meta.decode_tables, meta.decode_lens, self.n_heads, self.n_kv, self.scale,
            )  # fmt: skip
            if all_decode:
                return self.wo(od)
        out = torch.empty(T, self.n_heads, self.hd, dtype=x.dtype)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = od.view(-1, self.n_heads, self.hd)
        k = qkv[:, nq : nq + nkv].view(T, self.n_kv, self.hd)
        v = qkv[:, nq + nkv :].view(T, self.n_kv, self.hd)
        self._prefill_attention(q.view(T, self.n_heads, self.hd), k, v, meta, k_cache, v_cache, out)
        return self.wo(out.view(T, nq))

    def _prefill_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttnMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """The step's prefill chunks, into their rows of out ([T, heads, head_dim]): on the Triton backend those in
        meta.varlen in one launch that reads every sequence's blocks in place, then SDPA for each segment of
        meta.prefills."""
        if meta.varlen is not None:
            import services.engine.triton_attention as triton_attention

            triton_attention.paged_prefill_varlen(
                q, k_cache, v_cache, meta.varlen, self.scale, self.n_kv, out
            )
        bs = k_cache.shape[1]
        for seg in meta.prefills:
            # SDPA takes its fast (and transformers-identical) CPU path only for 4-D inputs: [1, heads, n, hd]
            qs = q[seg.start : seg.end].transpose(0, 1)[None]
            if seg.ctx_rows is None:
                ks, vs = (
                    k[seg.start : seg.end].transpose(0, 1)[None],
                    v[seg.start : seg.end].transpose(0, 1)[None],
                )
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, enable_gqa=True, scale=self.scale
                )
            else:
                assert seg.positions is not None
                L = seg.ctx_rows.shape[0] // self.n_kv * bs
                ks = k_cache.index_select(0, seg.ctx_rows).view(1, self.n_kv, L, self.hd)
                vs = v_cache.index_select(0, seg.ctx_rows).view(1, self.n_kv, L, self.hd)
                mask = torch.arange(L, device=q.device)[None, :] <= seg.positions[:, None]
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=mask, enable_gqa=True, scale=self.scale
                )
            out[seg.start : seg.end] = o[0].transpose(0, 1)


class FeedForward(nn.Module):
    def __init__(self, w: Weights, prefix: str, ffn: int, dtype: torch.dtype, quant: str, **kw):
        super().__init__()
        # not read off gate_proj: through _OnDevice that would copy it to the device to learn a shape
        self.ffn = ffn
        gate_up = [w[f"{prefix}.gate_proj"], w[f"{prefix}.up_proj"]]
        in_gate_up = input_scale(w, [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.w_gate_up = make_fused_linear(gate_up, None, dtype, quant, in_gate_up, **kw)
        in_down = input_scale(w, [f"{prefix}.down_proj"])
        self.w_down = make_fused_linear([w[f"{prefix}.down_proj"]], None, dtype, quant, in_down, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split(self.ffn, dim=-1)
        return self.w_down(F.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(cpu_ops.silu_mul(self.w_gate_up(x).contiguous()))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, w: Weights, i: int, dtype: torch.dtype, quant: str, **kw):
        super().__init__()
        p = f"layers.{i}"
        self.attn_norm = RMSNorm(dense(w, f"{p}.input_layernorm").to(dtype), cfg.rms_norm_eps)
        self.attn = Attention(cfg, w, p, dtype, quant, **kw)
        self.ffn_norm = RMSNorm(dense(w, f"{p}.post_attention_layernorm").to(dtype), cfg.rms_norm_eps)
        self.ffn = FeedForward(w, p, cfg.intermediate_size, dtype, quant, **kw)


class Transformer(nn.Module):
    """Decoder-only Llama: embed → blocks → norm → LM head (tied to the embedding when the model says so)."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(
        self,
        cfg: ModelConfig,
        w: Weights,
        dtype: torch.dtype = torch.float32,
        quant: str = "none",
        cpu_kernels: bool | None = None,
        device: torch.device | str = "cpu",
        triton_decode: bool = False,
        **kw,
    ):
        super().__init__()
        self.config, self.dtype, self.quant = cfg, dtype, quant
        self.device = torch.device(device)
        # the rotary tables are computed on the CPU in fp32, then moved: GGUF's Llama-3 factors are read where the
        # loader left them, never through the device view
        factors = dense(w, "rope_freqs").cpu() if "rope_freqs" in w else None
        # each weight is moved to the device as its layer is built, so the device never holds a second copy and
        # NVFP4 weights are quantized where they will be used (Triton on CUDA)
        w = _OnDevice(w, self.device)
        # The fused CPU kernels (cpu_ops) where they build. None (auto) uses them for bf16 only: fp32 is the
        # reference dtype, pinned to transformers at 1e-4 on logits, which the kernels' different summation
        # order in RMSNorm would exceed over 30 layers (~3e-4); True uses them for fp32 too; False never.
        wanted = (
            dtype == torch.bfloat16 if cpu_kernels is None else cpu_kernels
        ) and self.device.type == "cpu"
        self.fused = wanted and cpu_ops.supports(dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=dense(w, "embed_tokens").to(dtype))
        self.embed.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(Block(cfg, w, i, dtype, quant, **kw) for i in range(cfg.num_layers))
        self.norm = RMSNorm(dense(w, "norm").to(dtype), cfg.rms_norm_eps)
        # embeddings, norms and the LM head stay in high precision under nvfp4: only the blocks' projections
        # are quantized (docs/nvfp4.md)
        head = self.embed.weight if cfg.tie_embeddings else dense(w, "lm_head")
        self.lm_head = make_linear(head, None, dtype, "none")
        cos, sin = rope_tables(rope_inv_freq(cfg, factors), cfg.max_context)
        self.register_buffer("rope_cos", cos.to(self.device), persistent=False)
        self.register_buffer("rope_sin", sin.to(self.device), persistent=False)
        for blk in cast(list[Block], self.blocks):
            blk.attn.triton_decode = triton_decode

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata, kv: PagedKvCache
    ) -> torch.Tensor:
        """Hidden states after the final norm for every token of the step: [T, hidden]."""
        x = self.embed(tokens)
        if self.fused and x.device.type == "cpu" and kv.dtype == x.dtype:
            return self._forward_fused(x, positions, meta, kv)
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        for i, blk in enumerate(cast(list[Block], self.blocks)):
            x = x + blk.attn(blk.attn_norm(x), cos, sin, meta, kv.k[i], kv.v[i])
            x = x + blk.ffn(blk.ffn_norm(x))
        return self.norm(x)

    def _forward_fused(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata, kv: PagedKvCache
    ) -> torch.Tensor:
        """The same layers on the fused kernels. x is the residual stream, updated in place; each residual add
        is fused with the norm that follows it (the next layer's input norm, or the final norm)."""
        blocks = cast(list[Block], self.blocks)
        positions = positions.contiguous()
        h = cpu_ops.rms_norm(x, blocks[0].attn_norm.weight, blocks[0].attn_norm.eps)
        for i, blk in enumerate(blocks):
            a = blk.attn.forward_fused(h, positions, meta, kv.k[i], kv.v[i], self.rope_cos, self.rope_sin)
            h = cpu_ops.add_rms_norm(x, a, blk.ffn_norm.weight, blk.ffn_norm.eps)
            after = blocks[i + 1].attn_norm if i + 1 < len(blocks) else self.norm
            h = cpu_ops.add_rms_norm(x, blk.ffn.forward_fused(h), after.weight, after.eps)
        return h

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
