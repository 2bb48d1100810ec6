"""Block-scale layouts: the linear storage layout and the 128x4 swizzle of Blackwell block-scaled GEMMs.

Linear `[rows, K/16]` is what rackserve stores and what checkpoints hold. cuBLASLt / CUTLASS block-scaled
FP4 GEMMs read scales in 128-row x 4-column tiles, each tile laid out as 32 x 16 bytes:

    offset(m, k) = (m // 128) * nKt * 512 + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4

with rows padded to a multiple of 128 and columns to a multiple of 4 (nKt = padded columns / 4), padding
filled with zeros. Swizzle once when a weight is loaded, never per call.
"""

from __future__ import annotations

import torch

SWIZZLE_ROWS = 128
SWIZZLE_COLS = 4


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """(padded rows, padded cols) of the swizzled buffer."""
    return -(-rows // SWIZZLE_ROWS) * SWIZZLE_ROWS, -(-cols // SWIZZLE_COLS) * SWIZZLE_COLS


def swizzle_scales(scales_2d: torch.Tensor) -> torch.Tensor:
    """Linear [rows, cols] scales -> flat swizzled buffer of padded_rows * padded_cols elements."""
    if scales_2d.dim() != 2:
        raise ValueError(
            f"swizzle_scales: expected a 2-D [rows, K/16] tensor, got shape {tuple(scales_2d.shape)}"
        )
    rows, cols = scales_2d.shape
    prow, pcol = swizzled_shape(rows, cols)
    padded = torch.zeros((prow, pcol), dtype=scales_2d.dtype, device=scales_2d.device)
    padded[:rows, :cols] = scales_2d
    # [row tile, 32-row group within the tile, row within the group, column tile, column within the tile]
    tiles = padded.view(prow // 128, 4, 32, pcol // 4, 4)
    # -> [row tile, column tile, row within group, 32-row group, column within tile], i.e. the offset formula.
    return tiles.permute(0, 3, 2, 1, 4).contiguous().flatten()


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of swizzle_scales: flat swizzled buffer -> linear [rows, cols]."""
    prow, pcol = swizzled_shape(rows, cols)
    if swizzled.numel() != prow * pcol:
        raise ValueError(
            f"unswizzle_scales: a {rows}x{cols} matrix swizzles to {prow * pcol} elements, "
            f"got {swizzled.numel()}"
        )
    tiles = swizzled.reshape(prow // 128, pcol // 4, 32, 4, 4)
    linear = tiles.permute(0, 3, 2, 1, 4).reshape(prow, pcol)
    return linear[:rows, :cols].contiguous()
