"""The fused CPU kernels (services/engine/cpu_ops.py, csrc/cpu_ops.cpp) against the torch ops they replace.

Elementwise results (residual add, rotary, the KV write) must be bit-identical to torch; reductions (RMSNorm,
attention) and silu (its own exp) may differ at rounding level. Then the whole model: bf16 on the kernels
against bf16 on torch ops, and the fallback when no compiler is around.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from services.engine import cpu_ops
from services.engine.model import (
    AttnMetadata,
    PagedKvCache,
    PrefillSegment,
    Transformer,
    apply_rope,
    layer_rows,
)

pytestmark = pytest.mark.skipif(
    cpu_ops.load() is None, reason="no C++ compiler: the torch path is tested alone"
)

DTYPES = [torch.float32, torch.bfloat16]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ulps_close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, ulps: int = 2) -> None:
    """Equal up to a few units in the last place of dtype."""
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(a.float(), b.float(), rtol=ulps * eps, atol=ulps * eps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_exactly_and_normalizes_it(dtype):
    res = (torch.randn(37, 576, generator=gen(1)) * 4).to(dtype)
    delta = torch.randn(37, 576, generator=gen(2)).to(dtype)
    w = torch.randn(576, generator=gen(3))
    want_res = res + delta  # torch rounds the sum to dtype
    want = F.rms_norm(want_res.float(), w.shape, w, 1e-5).to(dtype)
    got = cpu_ops.add_rms_norm(res, delta, w, 1e-5)
    assert torch.equal(res, want_res)
    # the mean of 576 squares is summed in lanes as wide as the CPU's vectors (-march=native: 8 on AVX2, 16 on
    # AVX-512), torch in its own order; in float32 that moves a few outputs by up to ~4 ulps (CI's CPU saw 4),
    # and rounding to bf16 hides it
    ulps = 6 if dtype == torch.float32 else 2
    ulps_close(got, want, dtype, ulps)
    ulps_close(cpu_ops.rms_norm(want_res, w, 1e-5), want, dtype, ulps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_rotates_q_and_k_like_torch_and_writes_k_v_to_their_slots_only(dtype):
    nh, nkv, hd, bs, blocks = 9, 3, 64, 16, 8
    T = 40
    qkv = torch.randn(T, (nh + 2 * nkv) * hd, generator=gen(4)).to(dtype)
    positions = torch.randint(0, 500, (T,), generator=gen(5))
    slots = torch.randperm(blocks * bs, generator=gen(6))[:T]
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    angles = torch.outer(torch.arange(512).float(), inv)
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((-angles.sin(), angles.sin()), -1)
    k_cache = torch.full((nkv * blocks, bs, hd), 7.0, dtype=dtype)
    v_cache = torch.full((nkv * blocks, bs, hd), 7.0, dtype=dtype)

    heads = qkv.view(T, nh + 2 * nkv, hd)
    want_qk = apply_rope(heads[:, : nh + nkv], cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    want_v = heads[:, nh + nkv :].clone()
    cpu_ops.rope_store(qkv, positions, cos, sin, k_cache, v_cache, slots, nh, nkv)

    assert torch.equal(heads[:, : nh + nkv], want_qk)
    assert torch.equal(heads[:, nh + nkv :], want_v)
    k_view, v_view = k_cache.view(nkv, -1, hd), v_cache.view(nkv, -1, hd)
    assert torch.equal(k_view[:, slots], want_qk[:, nh:].transpose(0, 1))
    assert torch.equal(v_view[:, slots], want_v.transpose(0, 1))
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert bool((k_view[:, untouched] == 7).all()) and bool((v_view[:, untouched] == 7).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch_silu_times_up(dtype):
    gate_up = (torch.randn(11, 2 * 1536, generator=gen(7)) * 6).to(dtype)
    gate, up = gate_up.split(1536, dim=-1)
    want = F.silu(gate) * up
    got = cpu_ops.silu_mul(gate_up)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 48])  # 48: not a multiple of 16, the generic (non-AVX-512) loops
def test_paged_decode_attention_equals_sdpa_over_gathered_blocks(dtype, head_dim):
    nh, nkv, bs, blocks = 9, 3, 16, 96
    lens = torch.tensor([1, 16, 17, 100, 250], dtype=torch.int32)  # block-boundary and ragged lengths
    B, nb = len(lens), -(-int(lens.max()) // bs)
    k_cache = torch.randn(nkv * blocks, bs, head_dim, generator=gen(8)).to(dtype)
    v_cache = torch.randn(nkv * blocks, bs, head_dim, generator=gen(9)).to(dtype)
    perm = torch.randperm(blocks, generator=gen(10))[: B * nb].view(B, nb).to(torch.int32)  # scattered blocks
    qkv = torch.randn(B, (nh + 2 * nkv) * head_dim, generator=gen(11)).to(dtype)
    q = qkv[:, : nh * head_dim]  # a strided view, as the model passes it
    scale = 1 / math.sqrt(head_dim)

    got = cpu_ops.paged_decode_attention(q, k_cache, v_cache, perm, lens, nh, nkv, scale)

    rows = layer_rows(perm.long(), nkv, blocks)
    kd = k_cache.index_select(0, rows).view(nkv, B, nb * bs, head_dim).transpose(0, 1).float()
    vd = v_cache.index_select(0, rows).view(nkv, B, nb * bs, head_dim).transpose(0, 1).float()
    mask = (torch.arange(nb * bs)[None, :] < lens[:, None])[:, None, None, :]
    want = F.scaled_dot_product_attention(
        q.float().reshape(B, nh, 1, head_dim), kd, vd, attn_mask=mask, enable_gqa=True, scale=scale
    ).reshape(B, nh * head_dim)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def _logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    kv = PagedKvCache(model.config, -(-len(ids) // 16), 16, model.dtype)
    meta = AttnMetadata(slot_mapping=torch.arange(len(ids)), prefills=[PrefillSegment(0, len(ids))])
    return model.logits(model(ids, torch.arange(len(ids)), meta, kv))


@pytest.mark.slow
def test_smollm2_on_the_kernels_is_as_accurate_as_on_torch_ops(smollm2):
    """fp32 on the kernels stays within 2e-3 of fp32 on torch ops (the reference transformers is pinned to); bf16
    on the kernels is as close to that reference as bf16 on torch ops is (KL and top-1 agreement)."""
    ids = torch.randint(0, smollm2.config.vocab_size, (200,), generator=gen(12))
    model = {
        (dtype, kernels): Transformer(smollm2.config, smollm2.weights, dtype, cpu_kernels=kernels)
        for dtype in DTYPES
        for kernels in (True, False)
    }
    assert all(m.fused == kernels for (_, kernels), m in model.items())
    logits = {key: _logits(m, ids) for key, m in model.items()}
    ref = logits[(torch.float32, False)]
    assert (logits[(torch.float32, True)] - ref).abs().max().item() < 2e-3

    def kl(x: torch.Tensor) -> float:
        return F.kl_div(x.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean").item()

    def agree(x: torch.Tensor) -> float:
        return (x.argmax(-1) == ref.argmax(-1)).float().mean().item()

    fused, plain = logits[(torch.bfloat16, True)], logits[(torch.bfloat16, False)]
    assert kl(fused) < 1.25 * kl(plain)
    assert agree(fused) > agree(plain) - 0.05


@pytest.mark.slow
def test_bf16_engine_on_the_kernels_decodes_what_the_fp32_reference_would_choose(smollm2):
    """Greedy bf16 decoding on the kernels, four sequences batched (paged decode attention over their blocks):
    replayed through the fp32 torch model, every generated token is the reference's top choice or within bf16
    noise of it (0.5 logits; measured gaps are <= 0.18, and the same for bf16 on torch ops)."""
    from services.engine.engine import EngineConfig, LLMEngine
    from services.engine.sampling import SamplingParams

    prompts = [torch.randint(100, 40000, (n,), generator=gen(20 + n)).tolist() for n in (5, 40, 130)] + [
        [1, 9690, 198, 2683, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    ]
    engine = LLMEngine(smollm2, EngineConfig(dtype="bfloat16", num_kv_blocks=256))
    assert engine.model.fused
    outputs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    ref = Transformer(smollm2.config, smollm2.weights, torch.float32, cpu_kernels=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert len(out) == 24
        logits = _logits(ref, torch.tensor(prompt + out))[len(prompt) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(out)[:, None])[:, 0]
        assert (logits.max(-1).values - chosen).max().item() < 0.5


@pytest.mark.cluster
def test_without_a_compiler_the_model_falls_back_to_torch_ops(tmp_path):
    code = (
        "import torch\n"
        "from services.engine import cpu_ops\n"
        "from services.engine.model import Transformer\n"
        "from tests.conftest import tiny_llama\n"
        "assert cpu_ops.load() is None\n"
        "m = tiny_llama(seed=1)\n"
        "t = Transformer(m.config, m.weights, torch.bfloat16)\n"
        "assert not t.fused\n"
        "print('fallback ok')\n"
    )
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "RACKSERVE_KERNEL_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "fallback ok" in done.stdout
    assert "fused CPU kernels unavailable" in done.stderr
