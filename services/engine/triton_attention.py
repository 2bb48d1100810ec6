"""Triton paged attention over the engine's KV cache (PagedKvCache): decode, split-K decode, and chunked prefill.

The cache layout is the one model.py keeps: one layer's K (and V) view is [num_kv_heads * num_blocks, block_size,
head_dim], head-major, so row h * num_blocks + b holds head h of block b. The kernels read each key where it lies
(block table -> row -> token) with one masked gather per tile; nothing is copied out of the cache first.

Decode runs one program per (sequence, KV head) and handles the head's whole query group in it (GQA): the group is
padded to 16 rows so both products are tensor-core dots, and each K/V tile is read once for all its query heads.
Softmax is online (running max and sum) in fp32 whatever the cache dtype; p is rounded to the cache dtype only as
the input of the P @ V dot, as flash attention does. Keys past a sequence's length are masked in the loads
themselves, so a block id that a table holds only past seq_len is never read: garbage (or NaN) there cannot leak.

Long contexts with few (sequence, KV head) pairs leave most of a GPU idle, so decode then splits each context into
NUM_SPLITS ranges (flash-decoding): every split writes an unnormalised partial output with its running max and sum,
and a second kernel rescales and adds them. `choose_num_splits` picks the count from shapes alone.

All of this runs on CPU under TRITON_INTERPRET=1 (how the tests check it); the variable must be set before triton
is imported.
"""

from __future__ import annotations

import importlib.util
import math
import os

import torch

from services.engine.varlen import PrefillChunk, VarlenPrefill, plan_prefill

try:
    import triton
    import triton.language as tl
except ImportError:  # a torch-only install: available() says False and nothing here is called
    triton = None  # type: ignore[assignment]

LOG2E = 1.4426950408889634
# multiply-adds contracted into FMAs (the online softmax's rescales): what every Triton before 3.10 did by
# default, pinned so that 3.10's new default (off) does not change these kernels' code or numbers
FP_FUSION = True
# Decode splits a context only when it is at least this long, into ranges of at least MIN_SPLIT_TOKENS, and only
# while B * kv_heads programs would not already fill the GPU (TARGET_PROGRAMS is a few waves of an H100's SMs).
SPLIT_MIN_CONTEXT = 1024
MIN_SPLIT_TOKENS = 256
TARGET_PROGRAMS = 256
MAX_SPLITS = 64
GROUP_ROWS = 16  # tl.dot needs at least 16 rows; a GQA group is padded up to this


def available() -> bool:
    """Triton importable, and something to run it on: a CUDA device, or Triton's CPU interpreter."""
    if triton is None or importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _jit(fn=None, **options):  # type: ignore[no-untyped-def]
    # Without triton the kernels stay plain (uncallable) functions, so importing this module never fails.
    if fn is None:
        return lambda f: _jit(f, **options)
    return triton.jit(fn, **options) if triton is not None else fn


# ------------------------------------------------------------------------------------------------ kernels


@_jit
def _dot(a, b, FP32: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation: true fp32 products for fp32 inputs (never TF32), tensor cores for 16-bit.

    Triton's interpreter multiplies bf16 tiles as their raw uint16 bits, so under TRITON_INTERPRET=1 bf16 operands
    are widened first: bf16 x bf16 products are exact in fp32, so this is the tensor-core dot's math."""
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif FP32:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@_jit
def _decode_kernel(
    Q, K, V, TABLES, LENS, OUT, M_PART, L_PART, ACC_PART,
    stride_qb, stride_qh, stride_kr, stride_kt, stride_vr, stride_vt, stride_tb, stride_ob, stride_oh,
    num_blocks, qk_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT: tl.constexpr, FP32: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """One (sequence, KV head[, split]): online softmax over its keys for the whole query group. With split-K, a
    sequence's own context (its length, read here) is cut into NUM_SPLITS runs of whole tiles: the same work per
    split whatever the longest context the grid was sized for (a CUDA graph's tables are as wide as the model's
    context), and a short context's trailing splits are empty."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(LENS + b)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, TILE)
    heads = kvh * GROUP + offs_g
    in_group = offs_g < GROUP
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=in_group[:, None],
        other=0.0,
    )
    if SPLIT:
        split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE) * TILE
        start = s * split_len
        end = tl.minimum(start + split_len, seq_len)
    else:
        start = 0
        end = seq_len
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    table = TABLES + b.to(tl.int64) * stride_tb
    head_row = kvh.to(tl.int64) * num_blocks
    for t0 in range(start, end, TILE):
        pos = t0 + offs_t
        valid = pos < end
        # masked: table entries (and so blocks) past this range are never read
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0)
        row = head_row + block.to(tl.int64)
        tok = pos % BLOCK_SIZE
        k = tl.load(
            K + (row * stride_kr + tok * stride_kt)[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0
        )
        scores = _dot(q, tl.trans(k), FP32, UPCAST) * qk_scale  # log2 units
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + (row * stride_vr + tok * stride_vt)[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0
        )
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32, UPCAST)
        m_i = m_new
    if SPLIT:
        # partials [B, heads, NUM_SPLITS(, head_dim)], unnormalised; an empty split leaves m=-inf, l=0, acc=0
        part = (b.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + s
        tl.store(M_PART + part, m_i, mask=in_group)
        tl.store(L_PART + part, l_i, mask=in_group)
        tl.store(ACC_PART + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=in_group[:, None])
    else:
        out = acc / l_i[:, None]
        tl.store(
            OUT + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(OUT.dtype.element_ty),
            mask=in_group[:, None],
        )


@_jit
def _reduce_splits_kernel(
    M_PART, L_PART, ACC_PART, OUT, stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """One (sequence, query head): rescale the splits' partials to their common max and normalise once."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    base = (b.to(tl.int64) * tl.num_programs(1) + h) * NUM_SPLITS
    in_range = offs_s < NUM_SPLITS
    m = tl.load(M_PART + base + offs_s, mask=in_range, other=float("-inf"))
    l_s = tl.load(L_PART + base + offs_s, mask=in_range, other=0.0)
    acc_ptrs = ACC_PART + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :]
    acc = tl.load(acc_ptrs, mask=in_range[:, None], other=0.0)
    m_max = tl.max(m, 0)  # finite: split 0 always holds key 0 (seq_len >= 1)
    w = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(OUT + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty))


# Triton compiles a kernel apart for an int argument equal to 1 or a multiple of 16: a step's tile and sequence
# counts and its tables' width vary per call, and each new combination would compile (seconds) while serving.
@_jit(do_not_specialize=["stride_table", "num_tiles", "num_seqs"])
def _prefill_kernel(
    Q, K, V, TABLES, TILES, SEQS, OUT,
    stride_qt, stride_qh, stride_kr, stride_kt, stride_vr, stride_vt, stride_ot, stride_oh, stride_table,
    num_tiles, num_seqs, num_blocks, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE: tl.constexpr, FP32: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """BLOCK_M queries of one head of one of the step's chunks (the tile map says which chunk and which of its
    row tiles), causal over that sequence's cached prefix and the chunk itself (already in the cache)."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    seg = tl.load(TILES + tile)
    mblk = tl.load(TILES + num_tiles + tile)
    q_row = tl.load(SEQS + seg).to(tl.int64)  # the chunk's first row in the step's q and out
    num_tokens = tl.load(SEQS + num_seqs + seg)
    start_pos = tl.load(SEQS + 2 * num_seqs + seg)
    table = TABLES + seg.to(tl.int64) * stride_table
    kvh = h // GROUP
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, TILE)
    q_valid = offs_m < num_tokens
    q_pos = start_pos + offs_m
    Q += q_row * stride_qt
    OUT += q_row * stride_ot
    q = tl.load(
        Q + offs_m[:, None].to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :],
        mask=q_valid[:, None],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # keys up to this tile's last query (causal), never past the chunk
    end = tl.minimum(start_pos + (mblk + 1) * BLOCK_M, start_pos + num_tokens)
    head_row = kvh.to(tl.int64) * num_blocks
    for t0 in range(0, end, TILE):
        pos = t0 + offs_t
        valid = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0)
        row = head_row + block.to(tl.int64)
        tok = pos % BLOCK_SIZE
        k = tl.load(
            K + (row * stride_kr + tok * stride_kt)[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0
        )
        scores = _dot(q, tl.trans(k), FP32, UPCAST) * qk_scale
        # key 0 is visible to every row (padding rows too), so no row's max stays -inf
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + (row * stride_vr + tok * stride_vt)[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0
        )
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32, UPCAST)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        OUT + offs_m[:, None].to(tl.int64) * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(OUT.dtype.element_ty),
        mask=q_valid[:, None],
    )


# ------------------------------------------------------------------------------------------------ launchers


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _tile(head_dim: int, dtype: torch.dtype) -> int:
    """Keys per loop trip. Tokens are addressed one by one (table -> row -> offset), so a tile need not line up
    with blocks: it is sized to keep one K or V tile near 16 KiB (pipelined loads keep a few in shared memory),
    and at least 16 wide for tl.dot."""
    return max(16, min(64, 16384 // (head_dim * dtype.itemsize)))


def _upcast(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int) -> int:
    """Split-K factor for decode, from shapes only (so a captured CUDA graph keeps its grid): 1 unless the
    context is long and batch * kv_heads programs alone would leave the GPU mostly idle."""
    programs = batch * num_kv_heads
    if max_context < SPLIT_MIN_CONTEXT or programs >= TARGET_PROGRAMS:
        return 1
    splits = min(math.ceil(TARGET_PROGRAMS / programs), max_context // MIN_SPLIT_TOKENS, MAX_SPLITS)
    return 1 << (max(splits, 1).bit_length() - 1)  # a power of two, rounded down


def unsupported_shape(head_dim: int, block_size: int) -> str:
    """Why the kernels cannot take a model's head_dim or a cache's block_size ("" when they can): tiles are
    powers of two, head_dim 16..256, block_size 8..128."""
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        return f"head_dim {head_dim} must be a power of two in 16..256"
    if block_size & (block_size - 1) or not 8 <= block_size <= 128:
        return f"block_size {block_size} must be a power of two in 8..128"
    return ""


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int) -> None:
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q dtype {q.dtype} not supported (fp32, bf16, fp16)")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype} but the cache is {k_cache.dtype}/{v_cache.dtype}")
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, num_heads, head_dim], got {tuple(q.shape)}")
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError(f"q is on {q.device} but the cache is on {k_cache.device}/{v_cache.device}")
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError("k/v caches must be one layer's [kv_heads * blocks, block_size, head_dim] views")
    rows, block_size, head_dim = k_cache.shape
    if rows % num_kv_heads:
        raise ValueError(f"cache rows {rows} are not a multiple of num_kv_heads {num_kv_heads}")
    if q.shape[-1] != head_dim:
        raise ValueError(f"q's head_dim {q.shape[-1]} does not match the cache's {head_dim}")
    why = unsupported_shape(head_dim, block_size)
    if why:
        raise ValueError(why)
    if q.shape[-2] % num_kv_heads:
        raise ValueError(f"num_heads {q.shape[-2]} is not a multiple of num_kv_heads {num_kv_heads}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One decode token per sequence attending over its paged context.

    q: [B, num_heads, head_dim] (fp32, bf16 or fp16); k_cache, v_cache: one layer's
    [num_kv_heads * num_blocks, block_size, head_dim] views in q's dtype; block_tables: int32 [B, max_blocks], a
    sequence's block ids in order (entries past its length may hold any valid block id: they are never read);
    seq_lens: int32 [B], each >= 1, the new token included. Returns [B, num_heads, head_dim] in q's dtype, written
    into `out` when given. num_splits overrides choose_num_splits (1 forces the single-pass kernel).

    CUDA-graph capturable: no host synchronisation, no .item(), no branch on tensor values. The launch grid and
    the split-K count depend only on shapes (max_blocks is block_tables.shape[1]); each program reads its own
    length on the device, splits that context evenly over the splits, and loops only over its share of keys.
    Replaying a graph with new tables and lengths in the same tensors is therefore correct as long as max_blocks
    (the tables' width) is unchanged, and a short context in a graph's wide tables is spread over the splits as
    in an eager call. The split-K partials are allocated per call (a graph keeps them in its private pool).
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    _check_cache(q, k_cache, v_cache, num_kv_heads)
    B, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    num_blocks = k_cache.shape[0] // num_kv_heads
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError(f"block_tables must be [B={B}, max_blocks] and seq_lens [B]")
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, contiguous in head_dim")
    group = num_heads // num_kv_heads
    tile = _tile(head_dim, q.dtype)
    max_context = block_tables.shape[1] * block_size
    splits = choose_num_splits(B, num_kv_heads, max_context) if num_splits is None else num_splits
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {splits}")
    common = dict(
        GROUP=group, GROUP_PAD=max(GROUP_ROWS, _next_pow2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        TILE=tile, NUM_SPLITS=splits, FP32=q.dtype == torch.float32, UPCAST=_upcast(q.dtype),
        enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    args = (
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1), num_blocks, scale * LOG2E,
    )  # fmt: skip
    if splits == 1:
        _decode_kernel[(B, num_kv_heads, 1)](
            q, k_cache, v_cache, block_tables, seq_lens, out, out, out, out, *args, SPLIT=False, **common
        )
        return out
    m_part = torch.empty(B, num_heads, splits, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(B, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    tensors = (q, k_cache, v_cache, block_tables, seq_lens, out, m_part, l_part, acc_part)
    _decode_kernel[(B, num_kv_heads, splits)](*tensors, *args, SPLIT=True, **common)
    _reduce_splits_kernel[(B, num_heads)](
        m_part, l_part, acc_part, out, out.stride(0), out.stride(1),
        NUM_SPLITS=splits, SPLITS_PAD=_next_pow2(splits), HEAD_DIM=head_dim, enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return out


def paged_prefill_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: VarlenPrefill,
    scale: float,
    num_kv_heads: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Every prefill chunk of a step in one launch: each chunk's queries (its rows of q, [T, num_heads,
    head_dim]), whose K/V are already in the cache, attend causally over their sequence's blocks — the cached
    prefix and the chunk itself. Writes the chunks' rows of `out` ([T, num_heads, head_dim]) and no other row;
    q and out may be strided views (head_dim contiguous)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    _check_cache(q, k_cache, v_cache, num_kv_heads)
    T, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    if plan.block_size != block_size:
        raise ValueError(
            f"the plan was made for blocks of {plan.block_size} tokens, the cache has {block_size}"
        )
    if T < plan.rows_needed or out.shape[0] < plan.rows_needed:
        raise ValueError(f"the plan reads rows up to {plan.rows_needed}, q has {T} and out {out.shape[0]}")
    if out.shape[1:] != q.shape[1:] or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [T, {num_heads}, {head_dim}] {q.dtype}, contiguous in head_dim")
    _prefill_kernel[(plan.num_tiles, num_heads)](
        q, k_cache, v_cache, plan.tables, plan.tiles, plan.seqs, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), plan.tables.stride(0), plan.num_tiles, plan.seqs.shape[1],
        k_cache.shape[0] // num_kv_heads, scale * LOG2E,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=plan.block_m,
        TILE=_tile(head_dim, q.dtype), FP32=q.dtype == torch.float32, UPCAST=_upcast(q.dtype),
        enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start_pos: int,
    scale: float,
    num_kv_heads: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's chunk of n new tokens, whose K/V are already in the cache, attending causally: the varlen
    launch for a single chunk (tests and the compile check; the table is read back to the host to plan it).

    q: [n, num_heads, head_dim]; the queries sit at positions start_pos .. start_pos + n - 1 and see keys
    0 .. their own position, read from the blocks of block_table (int32 [>= ceil((start_pos + n) / block_size)]):
    the cached prefix and the chunk itself. Returns [n, num_heads, head_dim] in q's dtype (into `out` if given).
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    _check_cache(q, k_cache, v_cache, num_kv_heads)
    n = q.shape[0]
    block_size = k_cache.shape[1]
    if block_table.dtype != torch.int32 or block_table.dim() != 1:
        raise ValueError("block_table must be a 1-D int32 tensor")
    if start_pos < 0 or block_table.shape[0] * block_size < start_pos + n:
        raise ValueError(
            f"block_table covers {block_table.shape[0] * block_size} tokens, the chunk ends at {start_pos + n}"
        )
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, contiguous in head_dim")
    if n == 0:
        return out
    plan = plan_prefill([PrefillChunk(0, n, start_pos, block_table.tolist())], q.dtype, block_size, q.device)
    return paged_prefill_varlen(q, k_cache, v_cache, plan, scale, num_kv_heads, out)


def warm_up_prefill(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[int]:
    """Compile the prefill kernel's variants a worker launches (one per query-tile height: prefill_block_m's
    answers for a chunk of up to 16 tokens and for a longer one) on a scratch cache of four blocks, before the
    first request: else each compiles (seconds) inside a step while serving, stalling every sequence in it.
    Returns the tile heights compiled."""
    k = torch.zeros(num_kv_heads * 4, block_size, head_dim, dtype=dtype, device=device)
    heights = []
    for n in (16, 4 * block_size):
        plan = plan_prefill([PrefillChunk(0, n, 0, [0, 1, 2, 3])], dtype, block_size, device)
        q = torch.zeros(n, num_heads, head_dim, dtype=dtype, device=device)
        paged_prefill_varlen(q, k, k, plan, 1.0, num_kv_heads, torch.empty_like(q))
        heights.append(plan.block_m)
    return heights
