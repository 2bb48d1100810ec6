"""The NVFP4 pieces the engine plugs in: NVFP4Linear, checkpoint layouts, the KV wire format, and the
Blackwell W4A4 call checked for shapes and dtypes on torch's meta device (no GPU needed)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from services.engine.nvfp4 import (
    NVFP4Linear,
    NVFP4Tensor,
    dequantize,
    dequantize_kv_from_wire,
    detect_layout,
    from_compressed_tensors,
    from_modelopt,
    load_nvfp4_weight,
    quantize,
    quantize_kv_for_wire,
    weight_memory_bytes,
)
from services.engine.nvfp4 import linear as nvfp4_linear
from services.engine.nvfp4.blackwell import (
    BlackwellUnavailable,
    prepare_weight,
    scaled_mm_nvfp4,
    w4a4_matmul,
)
from services.engine.nvfp4.checkpoint import to_compressed_tensors, to_modelopt


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- NVFP4Linear -----------------------------------------------------------------------------------------


def test_linear_forward_is_x_times_dequantized_weight_plus_bias():
    w = torch.randn(48, 64, generator=gen(0))
    b = torch.randn(48, generator=gen(1))
    x = torch.randn(2, 5, 64, generator=gen(2))
    layer = NVFP4Linear.from_weight(w, b)
    expected = x @ dequantize(quantize(w)).T + b
    out = layer(x)
    assert out.shape == (2, 5, 48) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-5)


def test_linear_keeps_only_packed_weights_and_counts_their_bytes():
    layer = NVFP4Linear.from_weight(torch.randn(32, 72, generator=gen(0)))
    # 72 columns pad to 80: 40 packed bytes and 5 scale bytes per row, plus the 4-byte tensor scale.
    assert layer.packed.shape == (32, 40) and layer.packed.dtype == torch.uint8
    assert layer.scales.shape == (32, 5) and layer.global_scale.dtype == torch.float32
    assert layer.weight_bytes() == 32 * 40 + 32 * 5 + 4
    assert set(dict(layer.named_buffers())) == {"packed", "scales", "global_scale"}


def test_linear_cache_dequantized_keeps_the_weight_in_x_dtype_after_first_call():
    w = torch.randn(16, 32, generator=gen(0))
    layer = NVFP4Linear.from_weight(w, cache_dequantized=True)
    before = layer.weight_bytes()
    x = torch.randn(3, 32, generator=gen(1)).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    assert layer.weight_bytes() == before + 16 * 32 * 2  # the bf16 copy is now held
    expected = x @ dequantize(quantize(w)).to(torch.bfloat16).T
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(layer(x), out, rtol=0, atol=0)


def test_linear_to_bfloat16_keeps_the_global_scale_exact_fp32():
    w = torch.randn(16, 32, generator=gen(0)) * 3
    layer = NVFP4Linear.from_weight(w, torch.randn(16, generator=gen(1)))
    g = layer.global_scale.clone()
    layer = layer.to(torch.bfloat16)
    assert layer.global_scale.dtype == torch.float32 and torch.equal(layer.global_scale, g)
    assert layer.bias is not None and layer.bias.dtype == torch.bfloat16
    assert layer.packed.dtype == torch.uint8


def test_linear_logs_its_kernel_once(caplog, monkeypatch):
    monkeypatch.setattr(nvfp4_linear, "_announced", set())  # forget what earlier tests announced
    layer = NVFP4Linear.from_weight(torch.randn(8, 16, generator=gen(0)))
    x = torch.randn(2, 16, generator=gen(1)).to(torch.float16)
    with caplog.at_level(logging.INFO, logger="services.engine.nvfp4.linear"):
        layer(x)
        layer(x)
        NVFP4Linear.from_weight(torch.randn(8, 16, generator=gen(2)))(x)
    messages = [r.getMessage() for r in caplog.records if "NVFP4Linear" in r.getMessage()]
    assert len(messages) == 1  # once per (kernel, device, dtype) per process, not per call or layer
    assert "dequantize + torch matmul" in messages[0] and "torch.float16" in messages[0]


def test_weight_memory_bytes_counts_nvfp4_layers_packed():
    model = torch.nn.Sequential(
        NVFP4Linear.from_weight(torch.randn(32, 64, generator=gen(0))),
        torch.nn.LayerNorm(32),
    )
    assert weight_memory_bytes(model) == (32 * 32 + 32 * 4 + 4) + 2 * 32 * 4


def test_linear_rejects_the_wrong_input_width():
    layer = NVFP4Linear.from_weight(torch.randn(8, 16, generator=gen(0)))
    with pytest.raises(ValueError, match=r"\[\.\.\., 16\]"):
        layer(torch.randn(2, 17))


# --- checkpoints ----------------------------------------------------------------------------------------


def test_detect_layout_from_tensor_names():
    assert detect_layout(["l.weight", "l.weight_scale", "l.weight_scale_2", "l.input_scale"]) == "modelopt"
    assert (
        detect_layout(["l.weight_packed", "l.weight_scale", "l.weight_global_scale"]) == "compressed-tensors"
    )
    assert detect_layout(["l.weight", "l.bias"]) is None


def test_compressed_tensors_round_trip_is_identical():
    q = quantize(torch.randn(64, 128, generator=gen(4)))
    tensors = to_compressed_tensors(q, "model.layers.0.mlp.down_proj")
    assert tensors["model.layers.0.mlp.down_proj.weight_scale"].dtype == torch.float8_e4m3fn
    back = from_compressed_tensors(tensors, "model.layers.0.mlp.down_proj")
    assert torch.equal(back.packed, q.packed) and torch.equal(back.scales, q.scales)
    assert torch.equal(back.global_scale, q.global_scale)
    assert torch.equal(dequantize(back), dequantize(q))


def test_modelopt_round_trip_keeps_codes_and_scales_and_g_e_within_one_rounding():
    q = quantize(torch.randn(64, 128, generator=gen(5)))
    tensors = to_modelopt(q, "l")
    # ModelOpt stores the decode scale g_d = 1 / g_e.
    torch.testing.assert_close(tensors["l.weight_scale_2"] * q.global_scale, torch.tensor(1.0))
    back = from_modelopt(tensors, "l")
    assert torch.equal(back.packed, q.packed) and torch.equal(back.scales, q.scales)
    # fp32 reciprocals do not always round-trip: allow one ulp on g_e and so on the dequantized values.
    ulp = torch.finfo(torch.float32).eps * float(q.global_scale)
    assert abs(float(back.global_scale) - float(q.global_scale)) <= ulp
    torch.testing.assert_close(dequantize(back), dequantize(q), rtol=2.5e-7, atol=0)


def test_modelopt_round_trip_is_identical_when_the_reciprocal_is_exact():
    x = torch.randn(16, 64, generator=gen(6))
    x = x / x.abs().max() * 2688 / 1024  # amax = 2.625 -> g_e = 1024, g_d = 2^-10, both exact
    q = quantize(x)
    assert float(q.global_scale) == 1024.0
    back = from_modelopt(to_modelopt(q, "l"), "l")
    assert torch.equal(dequantize(back), dequantize(q))


def test_modelopt_by_hand_decode_convention():
    # A ModelOpt tensor written by hand: codes 7 (6.0) and 1 (0.5), block scale 2.0, g_d = 0.25 -> g_e = 4.
    tensors = {
        "p.weight": torch.tensor([[0x17] + [0] * 7], dtype=torch.uint8),
        "p.weight_scale": torch.tensor([[2.0]]).to(torch.float8_e4m3fn),
        "p.weight_scale_2": torch.tensor(0.25),
        "p.input_scale": torch.tensor(0.5),
    }
    q = load_nvfp4_weight(tensors, "p")
    assert float(q.global_scale) == 4.0 and q.shape == (1, 16)
    assert dequantize(q)[0, :3].tolist() == [3.0, 0.25, 0.0]  # 6 * 2 * 0.25, 0.5 * 2 * 0.25


def test_compressed_tensors_by_hand_encode_convention():
    tensors = {
        "p.weight_packed": torch.tensor([[0x17] + [0] * 7], dtype=torch.uint8),
        "p.weight_scale": torch.tensor([[2.0]]).to(torch.float8_e4m3fn),
        "p.weight_global_scale": torch.tensor([4.0]),
    }
    q = load_nvfp4_weight(tensors, "p")
    assert float(q.global_scale) == 4.0
    assert dequantize(q)[0, :3].tolist() == [3.0, 0.25, 0.0]


def test_checkpoint_errors_name_the_missing_tensor():
    with pytest.raises(KeyError, match="p.weight_scale_2"):
        from_modelopt({"p.weight": torch.zeros(1, 8, dtype=torch.uint8)}, "p")
    with pytest.raises(ValueError, match="swizzled"):
        from_compressed_tensors(
            {
                "p.weight_packed": torch.zeros(1, 8, dtype=torch.uint8),
                "p.weight_scale": torch.zeros(128 * 4, dtype=torch.uint8),
                "p.weight_global_scale": torch.tensor([1.0]),
            },
            "p",
        )


# --- KV wire format -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kv_wire_round_trip(dtype):
    kv = torch.randn(2, 4, 16, 64, generator=gen(7)).to(dtype)  # [layers?, heads, tokens, head_dim]
    payload = quantize_kv_for_wire(kv)
    # 2*4*16 rows of 64: 32 packed + 4 scale bytes each, plus header, shape and tensor scale.
    assert len(payload) == 8 + 4 * 8 + 4 + 128 * (32 + 4)
    back = dequantize_kv_from_wire(payload)
    assert back.shape == kv.shape and back.dtype == dtype
    assert torch.equal(back, dequantize(quantize(kv)).to(dtype))
    rel = float(torch.linalg.norm(back.float() - kv.float()) / torch.linalg.norm(kv.float()))
    assert 0.08 < rel < 0.11, rel


def test_kv_wire_odd_head_dim_and_bad_payloads():
    kv = torch.randn(3, 40, generator=gen(8))
    payload = quantize_kv_for_wire(kv)
    assert dequantize_kv_from_wire(bytearray(payload)).shape == (3, 40)
    with pytest.raises(ValueError, match="bad magic"):
        dequantize_kv_from_wire(b"XXXX" + payload[4:])
    with pytest.raises(ValueError, match="needs"):
        dequantize_kv_from_wire(payload[:-1])


# --- Blackwell W4A4 -------------------------------------------------------------------------------------


def on_meta(q: NVFP4Tensor) -> NVFP4Tensor:
    return NVFP4Tensor(
        packed=q.packed.to("meta"),
        scales=q.scales.to("meta"),
        global_scale=q.global_scale.to("meta"),
        shape=q.shape,
    )


def test_scaled_mm_call_is_well_formed_on_the_meta_device():
    # torch's meta kernel for _scaled_mm checks operand dtypes, layouts and the swizzled scale sizes.
    w = prepare_weight(on_meta(quantize(torch.randn(256, 128, generator=gen(9)))))
    assert w.scales_swizzled.dtype == torch.float8_e4m3fn and w.scales_swizzled.numel() == 256 * 8
    a = on_meta(quantize(torch.randn(8, 128, generator=gen(10))))
    out = scaled_mm_nvfp4(a, w, torch.bfloat16)
    assert out.shape == (8, 256) and out.dtype == torch.bfloat16


def test_prepare_weight_needs_k_multiple_of_32():
    with pytest.raises(ValueError, match="K % 32"):
        prepare_weight(quantize(torch.randn(16, 48, generator=gen(11))))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_w4a4_without_blackwell_is_a_clear_error():
    w = prepare_weight(quantize(torch.randn(16, 64, generator=gen(12))))
    with pytest.raises(BlackwellUnavailable, match="W4A4 GEMM unavailable"):
        w4a4_matmul(torch.randn(2, 64), w)


@pytest.mark.parametrize("tie", [True, False])
def test_the_weight_bytes_an_engine_logs_are_the_checkpoints_each_tensor_once(tie):
    """The start-up log's weight bytes (weight_memory_bytes): a tied LM head is the embedding, not a second copy,
    and the rotary tables are derived from the config, not weights. In fp32 they equal the checkpoint's bytes."""
    from services.engine.model import Transformer
    from services.engine.nvfp4 import weight_memory_bytes
    from tests.conftest import tiny_llama

    loaded = tiny_llama(tie=tie)
    model = Transformer(loaded.config, loaded.weights)
    assert weight_memory_bytes(model) == sum(t.numel() * 4 for t in loaded.weights.values())


def test_prepare_weight_needs_n_multiple_of_16():
    """cuBLAS's FP4 GEMM needs both of the weight's dimensions aligned; a layer that is not falls back."""
    with pytest.raises(ValueError, match="N % 16"):
        prepare_weight(quantize(torch.randn(200, 64, generator=gen(13))))


def _emulated_fp4_gemm(a, w, out_dtype):  # type: ignore[no-untyped-def]
    """What cuBLAS computes from _scaled_mm's operands: the weight's scales read back out of the swizzled layout,
    the product rounded to bf16, then the tensor scales."""
    from services.engine.nvfp4 import dequantize
    from services.engine.nvfp4.layouts import unswizzle_scales

    scales = unswizzle_scales(w.scales_swizzled.view(torch.uint8), w.n, w.k // 16)
    w_hat = dequantize(NVFP4Tensor(w.packed, scales, w.global_scale, (w.n, w.k)))
    return (dequantize(a) @ w_hat.T).to(torch.bfloat16).to(out_dtype)


def test_the_w4a4_probe_takes_a_right_product_and_refuses_a_failing_or_wrong_one(monkeypatch):
    """At start-up one FP4 GEMM decides whether W4A4 runs: a build whose _scaled_mm cannot (here: the CPU) or
    whose product is wrong (scales read in another layout) gives the reason the engine logs before W4A16."""
    from services.engine.nvfp4 import blackwell

    cpu = torch.device("cpu")
    assert blackwell._probe(cpu).startswith("a probe FP4 GEMM failed")
    monkeypatch.setattr(blackwell, "scaled_mm_nvfp4", _emulated_fp4_gemm)
    assert blackwell._probe(cpu) is None

    def transposed_scales(a, w, out_dtype):  # type: ignore[no-untyped-def]
        flipped = w.scales_swizzled.view(torch.uint8).flip(0).view(torch.float8_e4m3fn)
        return _emulated_fp4_gemm(a, dataclasses.replace(w, scales_swizzled=flipped), out_dtype)

    monkeypatch.setattr(blackwell, "scaled_mm_nvfp4", transposed_scales)
    assert "wrong product" in blackwell._probe(cpu)


def test_a_step_whose_activations_held_nan_is_refused_once_and_the_flag_cleared():
    from services.engine.nvfp4.blackwell import nonfinite_flag, raise_if_nonfinite

    dev = torch.device("cpu")
    flag = nonfinite_flag(dev)
    assert nonfinite_flag(dev) is flag  # one per device, made once
    raise_if_nonfinite(dev)  # nothing set: nothing raised
    flag |= torch.tensor(True)
    with pytest.raises(ValueError, match="NaN or Inf"):
        raise_if_nonfinite(dev)
    raise_if_nonfinite(dev)  # cleared: the next step runs


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_fp4_gemm_output_is_rescaled_in_place_in_bf16_with_the_bits_of_the_fp32_route(
    monkeypatch, out_dtype
):
    """cuBLAS writes bf16; the tensor scales are applied after. In bf16 that is one in-place multiply (no [M, N]
    fp32 temporary), which must give the bits the fp32 route gives; other dtypes take the fp32 route."""
    from services.engine.nvfp4 import blackwell

    raw = (torch.randn(33, 48, generator=gen(14)) * 50).to(torch.bfloat16)
    monkeypatch.setattr(blackwell.torch, "_scaled_mm", lambda *a, **k: raw.clone())
    x = quantize(torch.randn(33, 64, generator=gen(15)))
    w = prepare_weight(quantize(torch.randn(48, 64, generator=gen(16))))
    got = blackwell.scaled_mm_nvfp4(x, w, out_dtype)
    want = (raw.float() * torch.reciprocal(x.global_scale * w.global_scale)).to(out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, want)
