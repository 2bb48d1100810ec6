"""The NVFP4 recipe (services/engine/nvfp4/recipe.py) pinned byte for byte on docs/nvfp4.md's edge cases.

Every expected byte below was worked out by hand from docs/nvfp4.md, not produced by the implementation. Most cases
put an "anchor" block [2688, 0, ...] first so that amax = 2688 and g_e = 2688 / 2688 = 1 exactly; then a block
whose amax is 6·m gets v = fl(6m · fl(1/6)) = m (the product is m·(1 + 1.8e-8), inside half an ulp), its
E4M3 scale is e4m3(m), and when that scale is a power of two y = x / s is exact, so E2M1 ties land exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from services.engine.nvfp4 import QUANT_RECIPE_ID, NVFP4Tensor, dequantize, quantize
from services.engine.nvfp4.methods import quantize_with

ANCHOR = [2688.0] + [0.0] * 15  # amax 2688 -> g_e = 1; scale byte 0x7E (448), codes [7, 0, ...]
ANCHOR_PACKED = [0x07, 0, 0, 0, 0, 0, 0, 0]


def up(v: float) -> float:
    """The next fp32 above v."""
    return float(torch.nextafter(torch.tensor(v), torch.tensor(math.inf)))


def down(v: float) -> float:
    """The next fp32 below v."""
    return float(torch.nextafter(torch.tensor(v), torch.tensor(-math.inf)))


def quantize_blocks(*blocks: list[float], dtype: torch.dtype = torch.float32) -> NVFP4Tensor:
    row = [v for block in blocks for v in block]
    return quantize(torch.tensor(row, dtype=torch.float32).to(dtype))


def test_recipe_id_is_stable():
    assert QUANT_RECIPE_ID == "nvfp4-e2m1-e4m3x16-fp32ge-v1"


def test_every_e2m1_tie_rounds_to_the_even_code():
    # |y| = 6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 -> codes 7, 0, 2, 2, 4, 4, 6, 6; negatives add 8.
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    q = quantize_blocks(ANCHOR, ties + [-t for t in ties])
    assert float(q.global_scale) == 1.0
    assert q.scales.tolist() == [0x7E, 0x38]  # 448 for the anchor, 1.0 for the ties block
    assert q.packed.tolist() == ANCHOR_PACKED + [0x07, 0x22, 0x44, 0x66, 0x8F, 0xAA, 0xCC, 0xEE]


def test_one_ulp_off_each_tie_rounds_to_the_nearer_code():
    block = [6.0, up(0.25), down(0.75), up(1.25), down(1.75), up(2.5), down(3.5), up(5.0)]
    block += [down(0.25), up(0.75), down(1.25), up(1.75), down(2.5), up(3.5), down(5.0), 0.0]
    # codes 7, 1, 1, 3, 3, 5, 5, 7 | 0, 2, 2, 4, 4, 6, 6, 0
    q = quantize_blocks(ANCHOR, block)
    assert q.packed.tolist()[8:] == [0x17, 0x31, 0x53, 0x75, 0x20, 0x42, 0x64, 0x06]


def test_representable_values_get_their_own_codes_and_pack_even_element_low():
    # 0, 0.5, 1, 1.5, 2, 3, 4, 6 are codes 0..7; the negatives 8..15, with -0.0 -> 8.
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    q = quantize_blocks(ANCHOR, mags + [-m for m in mags])
    assert q.packed.tolist()[8:] == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]


def test_packing_order_puts_element_2j_in_the_low_nibble():
    q = quantize_blocks(ANCHOR, [6.0, 0.5, 1.0, 0.0] + [0.0] * 12)  # codes 7, 1, 2, 0
    assert q.packed.tolist()[8:10] == [0x17, 0x02]


@pytest.mark.parametrize(
    ("m", "scale_byte"),
    [
        (1.0625, 0x38),  # midway 1.0 (0x38) / 1.125 (0x39) -> even mantissa, 1.0
        (1.1875, 0x3A),  # midway 1.125 (0x39) / 1.25 (0x3A) -> even mantissa, 1.25
        (2.0**-10, 0x00),  # midway 0 / 2^-9 -> 0: the block scale is zero
        (3 * 2.0**-10, 0x02),  # midway 2^-9 (0x01) / 2^-8 (0x02), subnormal -> 0x02
        (5 * 2.0**-10, 0x02),  # midway 2^-8 (0x02) / 3*2^-9 (0x03) -> 0x02
        (15 * 2.0**-10, 0x08),  # midway 7*2^-9 (0x07) / 2^-6 (0x08): rounds up into the normals
    ],
)
def test_e4m3_block_scale_midpoints_round_to_even(m, scale_byte):
    q = quantize_blocks(ANCHOR, [6 * m] + [0.0] * 15)
    assert q.scales.tolist() == [0x7E, scale_byte]


def test_e4m3_block_scale_just_above_a_midpoint_rounds_up():
    q = quantize_blocks(ANCHOR, [up(up(6 * 1.0625))] + [0.0] * 15)
    assert q.scales.tolist() == [0x7E, 0x39]


def test_subnormal_block_scale_is_kept_and_used_exactly():
    # amax 6*2^-9 -> scale 2^-9 (0x01), inv = 512: y = 6, -6, 1, 0.25, 0.75 -> codes 7, 15, 2, 0, 2.
    block = [6 * 2.0**-9, -6 * 2.0**-9, 2.0**-9, 2.0**-11, 3 * 2.0**-11] + [0.0] * 11
    q = quantize_blocks(ANCHOR, block)
    assert q.scales.tolist() == [0x7E, 0x01]
    assert q.packed.tolist()[8:] == [0xF7, 0x02, 0x02, 0, 0, 0, 0, 0]
    x_hat = dequantize(q)[16:21].tolist()
    assert x_hat == [6 * 2.0**-9, -6 * 2.0**-9, 2.0**-9, 0.0, 2.0**-9]


def test_zero_block_scale_gives_zero_codes_and_keeps_signs():
    # amax 6*2^-10 -> scale 0 (tie to even), inv = 0: every y is +-0 -> codes 0 or 8.
    block = [6 * 2.0**-10, -(2.0**-12), 0.0, -0.0] + [0.0] * 12
    q = quantize_blocks(ANCHOR, block)
    assert q.scales.tolist() == [0x7E, 0x00]
    assert q.packed.tolist()[8:] == [0x80, 0x80, 0, 0, 0, 0, 0, 0]


def test_scale_midpoint_blocks_quantize_their_elements():
    # m = 3*2^-10 -> s = 2^-8, inv = 256: y(18*2^-10) = 4.5 -> code 6.
    # m = 15*2^-10 -> s = 2^-6, inv = 64: y(90*2^-10) = 5.625 -> code 7.
    q = quantize_blocks(ANCHOR, [18 * 2.0**-10] + [0.0] * 15, [90 * 2.0**-10] + [0.0] * 15)
    assert q.packed.tolist()[8] == 0x06
    assert q.packed.tolist()[16] == 0x07


def test_elements_above_six_times_the_scale_saturate_to_code_7():
    # Scale 1.0 (m = 1.0625 rounds down), so y = 6.375 > 6 saturates: code 7, dequantized to 6.
    q = quantize_blocks(ANCHOR, [6.375, -6.375] + [0.0] * 14)
    assert q.packed.tolist()[8] == 0xF7
    assert dequantize(q)[16:18].tolist() == [6.0, -6.0]


def test_block_scale_saturates_at_448_without_a_tensor_scale():
    # With g_e forced to 1, a block max of 6000 wants scale 1000: clamped to 448 (0x7E), never NaN.
    # y = 6000/448 = 13.4 -> 7, -6000 -> 15, 2688/448 = 6 -> 7, 100/448 = 0.22 -> 0.
    x = torch.tensor([6000.0, -6000.0, 2688.0, 100.0] + [0.0] * 12)
    q = quantize(x, global_scale=1.0)
    assert q.scales.tolist() == [0x7E]
    assert q.packed.tolist() == [0xF7, 0x07, 0, 0, 0, 0, 0, 0]
    assert dequantize(q)[:4].tolist() == [2688.0, -2688.0, 2688.0, 0.0]


@pytest.mark.parametrize(
    ("amax", "expected"),
    [(2688.0, 1.0), (1.0, 2688.0), (7.0, 384.0), (3.0, 896.0), (5.0, 537.6)],
)
def test_global_scale_is_2688_over_amax_in_fp32(amax, expected):
    q = quantize(torch.tensor([amax, -amax / 2] + [0.0] * 14))
    assert q.global_scale.dtype == torch.float32 and q.global_scale.dim() == 0
    assert q.global_scale.item() == torch.tensor(expected, dtype=torch.float32).item()


def test_the_global_scale_reads_nothing_from_the_host_so_a_cuda_graph_can_capture_it():
    """W4A4 quantizes each step's activations inside the decode step's CUDA graph, where a tensor made from a host
    value (a synchronising copy) or a host read of a device value is an error. The ops the scale runs, recorded
    at torch's dispatcher: none of either; and the value is the IEEE fp32 quotient 2688 / amax."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from services.engine.nvfp4.recipe import global_scale_for_amax

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    amaxes = torch.tensor([2688.0, 1.0, 7.0, 3.0, 5.0, 1e-30, 1e-37, 0.0, float("inf"), 3.3e38])
    for amax in amaxes:
        with Ops() as ops:
            g = global_scale_for_amax(amax)
        host = [
            op for op in ops.seen if "lift_fresh" in op or "_local_scalar_dense" in op or "_to_copy" in op
        ]
        assert host == [], ops.seen
        want = torch.tensor(2688.0, dtype=torch.float32) / amax
        if not (amax > 0 and torch.isfinite(amax) and torch.isfinite(want)):
            want = torch.tensor(1.0)
        assert g.item() == want.item() and g.dtype == torch.float32


def test_unit_amax_reconstructs_exactly():
    # g_e = 2688, the block scale is 448 and 1.0 -> code 7 -> 6 * 448 / 2688 = 1 exactly.
    q = quantize(torch.ones(16))
    assert q.scales.tolist() == [0x7E]
    assert q.packed.tolist() == [0x77] * 8
    assert dequantize(q).tolist() == [1.0] * 16


def test_all_zero_tensor():
    q = quantize(torch.zeros(4, 32))
    assert float(q.global_scale) == 1.0
    assert q.scales.tolist() == [[0, 0]] * 4
    assert q.packed.tolist() == [[0] * 16] * 4
    assert torch.equal(dequantize(q), torch.zeros(4, 32))


def test_negative_zero_is_code_8():
    q = quantize(torch.full((16,), -0.0))
    assert float(q.global_scale) == 1.0
    assert q.scales.tolist() == [0]
    assert q.packed.tolist() == [0x88] * 8
    x_hat = dequantize(q)
    assert torch.equal(x_hat, torch.zeros(16)) and bool(torch.signbit(x_hat).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_input_is_upcast_and_gives_the_same_bytes(dtype):
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    q = quantize_blocks(ANCHOR, ties + [-t for t in ties], dtype=dtype)  # all exact in bf16 and fp16
    assert float(q.global_scale) == 1.0
    assert q.scales.tolist() == [0x7E, 0x38]
    assert q.packed.tolist() == ANCHOR_PACKED + [0x07, 0x22, 0x44, 0x66, 0x8F, 0xAA, 0xCC, 0xEE]
    assert dequantize(q).dtype == torch.float32


def test_k_not_a_multiple_of_16_is_zero_padded_and_recorded():
    q = quantize(torch.ones(3, 20))  # Kp = 32: block 0 all ones, block 1 four ones and 12 pads
    assert q.k == 20 and q.padded_k == 32 and q.shape == (3, 20)
    assert q.packed.shape == (3, 16) and q.scales.shape == (3, 2)
    assert q.scales.tolist() == [[0x7E, 0x7E]] * 3
    assert q.packed.tolist() == [[0x77] * 8 + [0x77, 0x77] + [0] * 6] * 3
    x_hat = dequantize(q)
    assert x_hat.shape == (3, 20) and torch.equal(x_hat, torch.ones(3, 20))


def test_leading_dims_are_kept():
    x = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(1))
    q = quantize(x)
    assert q.packed.shape == (2, 3, 24) and q.scales.shape == (2, 3, 3)
    assert dequantize(q).shape == (2, 3, 40)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_input_is_rejected(bad, dtype):
    x = torch.ones(32, dtype=dtype)
    x[5] = bad
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x)


@pytest.mark.parametrize("method", ["rtn", "four_over_six", "mse"])
def test_non_finite_refusal_counts_the_callers_elements_not_the_padding(method):
    # 2 x 20 elements pad to 2 x 32: the message names the 40 passed in
    x = torch.ones(2, 20)
    x[1, 3] = math.nan
    with pytest.raises(ValueError, match=r"has 1 non-finite value\(s\) \(NaN or Inf\) out of 40;"):
        quantize_with(x, method)


def test_dequantize_is_code_times_scale_over_global_scale():
    # codes 1, 2, 7, 15 under scale 1.0 (0x38) and g_e = 2: 0.5/2, 1/2, 6/2, -6/2.
    q = NVFP4Tensor(
        packed=torch.tensor([0x21, 0xF7, 0, 0, 0, 0, 0, 0], dtype=torch.uint8),
        scales=torch.tensor([0x38], dtype=torch.uint8),
        global_scale=torch.tensor(2.0),
        shape=(16,),
    )
    assert dequantize(q).tolist() == [0.25, 0.5, 3.0, -3.0] + [0.0] * 12


def test_nvfp4_tensor_rejects_inconsistent_shapes():
    with pytest.raises(ValueError, match="needs packed"):
        NVFP4Tensor(
            packed=torch.zeros(4, dtype=torch.uint8),
            scales=torch.zeros(1, dtype=torch.uint8),
            global_scale=torch.tensor(1.0),
            shape=(16,),
        )


def test_gaussian_round_trip_error_matches_nvfp4_md():
    x = torch.randn(1024, 4096, generator=torch.Generator().manual_seed(0))
    x_hat = dequantize(quantize(x))
    rel = float(torch.linalg.norm(x_hat - x) / torch.linalg.norm(x))
    assert 0.090 <= rel <= 0.100, rel


def test_empty_tensors_quantize_to_empty_buffers():
    q = quantize(torch.empty(0, 32))
    assert q.packed.shape == (0, 16) and q.scales.shape == (0, 2) and float(q.global_scale) == 1.0
    assert dequantize(q).shape == (0, 32)
