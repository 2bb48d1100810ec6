"""The 128x4 swizzled block-scale layout of docs/nvfp4.md, checked against its offset formula by hand.

Expected offsets are computed by hand from
offset(m, k) = (m//128)·nKt·512 + (k//4)·512 + (m%32)·16 + ((m%128)//32)·4 + k%4.
"""

from __future__ import annotations

import pytest
import torch

from services.engine.nvfp4 import dequantize, quantize, swizzle_scales, unswizzle_scales


def labelled(rows: int, cols: int) -> torch.Tensor:
    """Entry (m, k) holds m * 1000 + k + 1, so every entry is unique and nonzero (padding is 0)."""
    m = torch.arange(rows, dtype=torch.int32)[:, None]
    k = torch.arange(cols, dtype=torch.int32)[None, :]
    return m * 1000 + k + 1


@pytest.mark.parametrize(
    ("m", "k", "offset"),
    [
        (0, 0, 0),
        (0, 1, 1),
        (1, 0, 16),  # next row of a 32-row group: 16 bytes on
        (32, 0, 4),  # next 32-row group: 4 bytes on
        (0, 4, 512),  # next column tile: one 512-byte tile on
        (33, 2, 22),  # 16 + 4 + 2
        (100, 7, 591),  # m%32 = 4, group 3, column tile 1, k%4 = 3: 512 + 64 + 12 + 3
        (127, 79, 10239),  # last entry of the first row tile: 19*512 + 31*16 + 3*4 + 3
        (128, 0, 10240),  # second row tile starts after nKt = 20 tiles of 512
        (129, 5, 10769),  # 10240 + 512 + 16 + 1
    ],
)
def test_swizzle_offset_formula_on_130_by_80(m, k, offset):
    swizzled = swizzle_scales(labelled(130, 80))
    assert int(swizzled[offset]) == m * 1000 + k + 1


def test_swizzle_pads_130_rows_to_256_with_zeros():
    swizzled = swizzle_scales(labelled(130, 80))
    assert swizzled.shape == (256 * 80,)
    assert int((swizzled == 0).sum()) == 256 * 80 - 130 * 80


def test_swizzle_pads_columns_to_a_multiple_of_4():
    swizzled = swizzle_scales(labelled(5, 3))
    assert swizzled.shape == (128 * 4,)
    assert int(swizzled[4 * 16 + 2]) == 4 * 1000 + 2 + 1  # (m=4, k=2)
    assert int(swizzled[3]) == 0  # (m=0, k=3) is a padding column
    assert int((swizzled != 0).sum()) == 15


@pytest.mark.parametrize(("rows", "cols"), [(130, 80), (5, 3), (256, 8), (1, 1)])
def test_unswizzle_inverts_swizzle(rows, cols):
    t = labelled(rows, cols)
    assert torch.equal(unswizzle_scales(swizzle_scales(t), rows, cols), t)


def test_quantized_scales_survive_the_round_trip_for_130_by_1280():
    x = torch.randn(130, 1280, generator=torch.Generator().manual_seed(3))
    q = quantize(x)
    assert q.scales.shape == (130, 80)
    swizzled = swizzle_scales(q.scales)
    assert swizzled.dtype == torch.uint8
    assert torch.equal(unswizzle_scales(swizzled, 130, 80), q.scales)
    assert dequantize(q).shape == (130, 1280)


def test_unswizzle_rejects_the_wrong_size():
    with pytest.raises(ValueError, match="swizzles to 512 elements"):
        unswizzle_scales(torch.zeros(100, dtype=torch.uint8), 5, 3)
