"""The Llama-family transformer in plain torch, over a paged KV cache.

One file, top to bottom: rotary embeddings, RMSNorm, attention (fused QKV, GQA, paged KV), SwiGLU feed-forward
(fused gate/up), the decoder, and the attention metadata a step hands it. Speed on CPU comes from a few
deliberate choices: all tokens of a step go through each projection as one matrix; decode attention is two
batched matmuls over K/V gathered once per layer from the blocks (SDPA is slow on CPU for a single query);
softmax runs in fp32 whatever the model dtype.

This room knows nothing about requests, scheduling or where the weights came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.config import ModelConfig
from services.engine.loader import Weights

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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] in rotate-half layout; cos/sin: [T, 1, head_dim // 2] float32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


# ------------------------------------------------------------------------------------------- paged KV


class PagedKvCache:
    """K and V of all layers in fixed-size blocks: one tensor [blocks, layers, 2, block_size, kv_heads, head_dim].

    Block-major, so one block — every layer's K and V for block_size tokens — is one contiguous range of bytes:
    a transfer moves a block with one descriptor, and export/import is a copy per block.
    Layer i's K is the strided view data[:, i, 0] of shape [blocks, block_size, kv_heads, head_dim].
    """

    LAYOUT = "block,layer,kv,token,kv_head,head_dim"

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.data = torch.zeros(
            num_blocks, config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim, dtype=dtype
        )
        self.k = [self.data[:, i, 0] for i in range(config.num_layers)]
        self.v = [self.data[:, i, 1] for i in range(config.num_layers)]

    @property
    def block_bytes(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty(0, dtype=dtype).element_size()
        return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * elem


@dataclass
class PrefillSegment:
    """Tokens [start, end) of the step belong to one sequence.

    ctx_blocks is None when the sequence has no earlier context: attention then runs on the fresh K/V directly.
    Otherwise it lists the sequence's blocks (new tokens included) and positions the queries' positions.
    """

    start: int
    end: int
    ctx_blocks: torch.Tensor | None = None
    positions: torch.Tensor | None = None


@dataclass
class AttnMetadata:
    slot_block: torch.Tensor  # [T] block of each new token's K/V
    slot_offset: torch.Tensor  # [T] offset inside that block
    decode_rows: torch.Tensor | None = None  # [B] rows of the step that are single-token decodes
    decode_blocks: torch.Tensor | None = None  # [B, nb] block tables, padded with block 0
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, nb * block_size] additive (0 / -inf), float32
    prefills: list[PrefillSegment] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ layers


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, quant: str, **kw) -> nn.Module:
    """A projection in the serving form: a dense nn.Linear, or NVFP4 packed weights."""
    if quant == "nvfp4":
        from services.engine.nvfp4 import NVFP4Linear

        return NVFP4Linear.from_weight(weight, bias, **kw)
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=dtype, device="meta")
    lin.weight = nn.Parameter(weight.to(dtype).contiguous(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.to(dtype).contiguous(), requires_grad=False)
    return lin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, w: Weights, prefix: str, dtype: torch.dtype, quant: str, **kw):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = torch.cat([w[f"{prefix}.q_proj"], w[f"{prefix}.k_proj"], w[f"{prefix}.v_proj"]])
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([w[f"{prefix}.{n}.bias"] for n in ("q_proj", "k_proj", "v_proj")])
        self.wqkv = make_linear(qkv, bias, dtype, quant, **kw)
        self.wo = make_linear(w[f"{prefix}.o_proj"], None, dtype, quant, **kw)
        self.scale = 1.0 / math.sqrt(self.hd)

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
        q, k, v = self.wqkv(x).split([nq, nkv, nkv], dim=-1)
        q = apply_rope(q.view(T, self.n_heads, self.hd), cos, sin)
        k = apply_rope(k.view(T, self.n_kv, self.hd), cos, sin)
        v = v.reshape(T, self.n_kv, self.hd)
        k_cache[meta.slot_block, meta.slot_offset] = k
        v_cache[meta.slot_block, meta.slot_offset] = v

        out = torch.empty(T, self.n_heads, self.hd, dtype=x.dtype)
        g = self.n_heads // self.n_kv
        if meta.decode_rows is not None:
            assert meta.decode_blocks is not None and meta.decode_mask is not None
            B, L = meta.decode_rows.shape[0], meta.decode_mask.shape[-1]
            qd = q[meta.decode_rows].view(B, self.n_kv, g, self.hd)
            kd = k_cache[meta.decode_blocks].view(B, L, self.n_kv, self.hd).permute(0, 2, 3, 1)  # [B, kv, hd, L]
            vd = v_cache[meta.decode_blocks].view(B, L, self.n_kv, self.hd).transpose(1, 2)  # [B, kv, L, hd]
            scores = torch.matmul(qd, kd).float() * self.scale + meta.decode_mask
            probs = torch.softmax(scores, dim=-1).to(x.dtype)
            out[meta.decode_rows] = torch.matmul(probs, vd).view(B, self.n_heads, self.hd)
        for seg in meta.prefills:
            qs = q[seg.start : seg.end].transpose(0, 1)  # [heads, n, hd]
            if seg.ctx_blocks is None:
                ks, vs = k[seg.start : seg.end].transpose(0, 1), v[seg.start : seg.end].transpose(0, 1)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True, scale=self.scale)
            else:
                assert seg.positions is not None
                L = seg.ctx_blocks.shape[0] * k_cache.shape[1]
                ks = k_cache[seg.ctx_blocks].view(L, self.n_kv, self.hd).transpose(0, 1)
                vs = v_cache[seg.ctx_blocks].view(L, self.n_kv, self.hd).transpose(0, 1)
                keypos = torch.arange(L)
                mask = keypos[None, :] <= seg.positions[:, None]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True, scale=self.scale)
            out[seg.start : seg.end] = o.transpose(0, 1)
        return self.wo(out.view(T, self.n_heads * self.hd))


class FeedForward(nn.Module):
    def __init__(self, w: Weights, prefix: str, dtype: torch.dtype, quant: str, **kw):
        super().__init__()
        self.ffn = w[f"{prefix}.gate_proj"].shape[0]
        gate_up = torch.cat([w[f"{prefix}.gate_proj"], w[f"{prefix}.up_proj"]])
        self.w_gate_up = make_linear(gate_up, None, dtype, quant, **kw)
        self.w_down = make_linear(w[f"{prefix}.down_proj"], None, dtype, quant, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split(self.ffn, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, w: Weights, i: int, dtype: torch.dtype, quant: str, **kw):
        super().__init__()
        p = f"layers.{i}"
        self.attn_norm = RMSNorm(w[f"{p}.input_layernorm"].to(dtype), cfg.rms_norm_eps)
        self.attn = Attention(cfg, w, p, dtype, quant, **kw)
        self.ffn_norm = RMSNorm(w[f"{p}.post_attention_layernorm"].to(dtype), cfg.rms_norm_eps)
        self.ffn = FeedForward(w, p, dtype, quant, **kw)


class Transformer(nn.Module):
    """Decoder-only Llama: embed → blocks → norm → LM head (tied to the embedding when the model says so)."""

    def __init__(self, cfg: ModelConfig, w: Weights, dtype: torch.dtype = torch.float32, quant: str = "none", **kw):
        super().__init__()
        self.config, self.dtype, self.quant = cfg, dtype, quant
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=w["embed_tokens"].to(dtype))
        self.embed.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(Block(cfg, w, i, dtype, quant, **kw) for i in range(cfg.num_layers))
        self.norm = RMSNorm(w["norm"].to(dtype), cfg.rms_norm_eps)
        # embeddings, norms and the LM head stay in high precision under nvfp4 (NVFP4.md: weights of the blocks)
        head = self.embed.weight if cfg.tie_embeddings else w["lm_head"].to(dtype)
        self.lm_head = nn.Parameter(head, requires_grad=False)
        inv = rope_inv_freq(cfg, w.get("rope_freqs"))
        angles = torch.outer(torch.arange(cfg.max_context, dtype=torch.float32), inv)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata, kv: PagedKvCache
    ) -> torch.Tensor:
        """Hidden states after the final norm for every token of the step: [T, hidden]."""
        x = self.embed(tokens)
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        for i, blk in enumerate(self.blocks):
            x = x + blk.attn(blk.attn_norm(x), cos, sin, meta, kv.k[i], kv.v[i])
            x = x + blk.ffn(blk.ffn_norm(x))
        return self.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()
