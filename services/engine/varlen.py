"""A step's prefill chunks as one varlen attention launch reads them (triton_attention.paged_prefill_varlen).

A step that prefills many short prompts would otherwise run attention once per chunk per layer: 64 prompts on a
30-layer model are ~2,000 launches a step, on a GPU more host time than the step's arithmetic. The host knows
every chunk's row, length, position and blocks, so it lays them out once per step — a tile map (which chunk, which
of its row tiles each program takes), the chunks' rows, lengths and positions, their block tables — uploads them
in one copy, and every layer launches once over all of them. Nothing depends on triton here: the engine builds
plans without importing it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from services.engine.device import host_to_device

# A fresh prompt's chunk (no cached prefix) this long keeps its own SDPA call: the flash kernel behind it beats the
# paged kernel on long causal attention, and a step holds few such chunks (its token budget / this), so their
# launches stay few. Shorter fresh chunks, and every chunk after a cached prefix, go in the varlen launch.
SDPA_FRESH_MIN_TOKENS = 256


class PrefillChunk(NamedTuple):
    """One sequence's chunk of a step: rows [row, row + num_tokens) of the step's q and out, the queries at
    positions start_pos .. start_pos + num_tokens - 1, the sequence's block ids in order (covering them)."""

    row: int
    num_tokens: int
    start_pos: int
    block_table: Sequence[int]


@dataclass(frozen=True)
class VarlenPrefill:
    """A step's prefill chunks as the varlen kernel reads them, on the device: built once per step
    (`plan_prefill`), read by every layer's one launch.

    tiles int32 [2, num_tiles] (each program's chunk, and which of its BLOCK_M-row tiles); seqs int32 [3, S] (each
    chunk's first row, length, first position); tables int32 [S, max_blocks] (padded with a valid block id: keys
    past a chunk's end are never read). rows_needed and block_size let the launch check q and the cache."""

    tiles: torch.Tensor
    seqs: torch.Tensor
    tables: torch.Tensor
    block_m: int
    rows_needed: int
    block_size: int

    @property
    def num_tiles(self) -> int:
        return self.tiles.shape[1]


def prefill_block_m(max_tokens: int, dtype: torch.dtype) -> int:
    """Query rows per program: 64, fewer for short chunks and for fp32 (at 64 fp32 rows a program spills its
    registers: 7 KB of stack per thread at head_dim 128 on sm_90, none at 32; scripts/triton_compile_check.py)."""
    return 16 if max_tokens <= 16 else 32 if dtype == torch.float32 else 64


def plan_prefill(
    chunks: Sequence[PrefillChunk], dtype: torch.dtype, block_size: int, device: torch.device
) -> VarlenPrefill:
    """The varlen launch's metadata for a step's chunks, in one host-to-device copy (the host knows every length:
    no program is launched for nothing and nothing is read back)."""
    if not chunks:
        raise ValueError("plan_prefill needs at least one chunk")
    for c in chunks:
        if (
            c.num_tokens < 1
            or c.start_pos < 0
            or len(c.block_table) * block_size < c.start_pos + c.num_tokens
        ):
            raise ValueError(
                f"a chunk of {c.num_tokens} tokens at position {c.start_pos} with {len(c.block_table)} blocks of "
                f"{block_size}: the table must cover it"
            )
    block_m = prefill_block_m(max(c.num_tokens for c in chunks), dtype)
    seg_of: list[int] = []
    tile_of: list[int] = []
    for i, c in enumerate(chunks):
        n = -(-c.num_tokens // block_m)
        seg_of += [i] * n
        tile_of += range(n)
    width = max(len(c.block_table) for c in chunks)
    nt, S = len(seg_of), len(chunks)
    # each part starts 16-byte aligned: Triton specialises a pointer argument on its alignment, and parts at
    # offsets that vary with the step's tile and chunk counts would compile up to four variants while serving
    at_seqs = _align4(2 * nt)
    at_tables = _align4(at_seqs + 3 * S)
    flat = seg_of + tile_of + [0] * (at_seqs - 2 * nt)
    flat += [c.row for c in chunks] + [c.num_tokens for c in chunks] + [c.start_pos for c in chunks]
    flat += [0] * (at_tables - at_seqs - 3 * S)
    for c in chunks:
        flat += [*c.block_table, *[c.block_table[0]] * (width - len(c.block_table))]
    buf = host_to_device(flat, torch.int32, device)
    return VarlenPrefill(
        tiles=buf[: 2 * nt].view(2, nt),
        seqs=buf[at_seqs : at_seqs + 3 * S].view(3, S),
        tables=buf[at_tables:].view(S, width),
        block_m=block_m,
        rows_needed=max(c.row + c.num_tokens for c in chunks),
        block_size=block_size,
    )


def _align4(n: int) -> int:
    """n int32s rounded up to a multiple of 4 (16 bytes)."""
    return -(-n // 4) * 4
