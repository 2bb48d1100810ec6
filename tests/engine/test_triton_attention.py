"""The Triton paged-attention kernels, run on CPU by Triton's interpreter and compared with a plain torch reference.

The reference gathers each sequence's blocks out of the cache, keeps its first seq_len keys, repeats K/V over the
query group and softmaxes in fp32. Cases cover scattered block tables, ragged lengths around the block size,
GQA ratios 1, 3 (SmolLM2: 9 heads, 3 KV heads, head_dim 64) and 4, fp32 / bf16 / fp16, block sizes 8..128, the
split-K path (chosen by the heuristic and forced, with empty splits), and a NaN-filled block that tables name only
past seq_len, which must leave the output bit-identical.

TRITON_INTERPRET must be set before triton is imported, and other test modules may import triton for real,
so the kernels run in one child process (this file run as a script) on inputs this process writes to disk.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from services.engine import triton_attention as ta  # noqa: E402
from services.engine.config import ModelConfig  # noqa: E402
from services.engine.model import AttnMetadata, PagedKvCache, layer_rows  # noqa: E402
from services.engine.varlen import PrefillChunk, plan_prefill, prefill_block_m  # noqa: E402
from tests.support.markers import starts_processes  # noqa: E402
from tests.support.paths import REPO  # noqa: E402


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_cache(
    seed: int, num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V views, exactly as PagedKvCache lays them out."""
    shape = (2, num_kv_heads, num_blocks, block_size, head_dim)
    data = torch.randn(shape, generator=gen(seed)).to(dtype)
    return data[0].view(-1, block_size, head_dim), data[1].view(-1, block_size, head_dim)


def scattered_tables(
    seed: int, lens: list[int], block_size: int, num_blocks: int, max_blocks: int, pad: int | None = None
) -> torch.Tensor:
    """Each sequence gets distinct blocks drawn at random from the whole cache; padding entries name block
    `pad` (or more random blocks, which the kernel must not read past seq_len either)."""
    g = gen(seed)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (len(lens), max_blocks), generator=g, dtype=torch.int32)
    if pad is not None:
        tables.fill_(pad)
        perm = perm[perm != pad]
    used = 0
    for i, n in enumerate(lens):
        nb = math.ceil(n / block_size)
        tables[i, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    assert used <= perm.numel()
    return tables


def decode_case(
    seed: int,
    lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_blocks: int | None = None,
    extra_blocks: int = 0,
    num_splits: int | None = None,
    strided_q: bool = False,
) -> dict:
    need = sum(math.ceil(n / block_size) for n in lens)
    num_blocks = num_blocks or need + 5
    max_blocks = max(math.ceil(n / block_size) for n in lens) + extra_blocks
    k, v = make_cache(seed, kv_heads, num_blocks, block_size, head_dim, dtype)
    if strided_q:  # q as the engine has it: a view into the fused qkv projection's output
        qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=gen(seed + 1)).to(dtype)
        q = qkv[:, : heads * head_dim].view(len(lens), heads, head_dim)
    else:
        q = torch.randn(len(lens), heads, head_dim, generator=gen(seed + 1)).to(dtype)
    return dict(
        q=q,
        k_cache=k,
        v_cache=v,
        block_tables=scattered_tables(seed + 2, lens, block_size, num_blocks, max_blocks),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        num_kv_heads=kv_heads,
        scale=1.0 / math.sqrt(head_dim),
        num_splits=num_splits,
    )


def poisoned_case(nan: bool, num_splits: int | None) -> dict:
    """Padding entries all name block 0, which no sequence uses and which holds NaN (or zeros); the unused
    tail of each sequence's last block holds NaN (or zeros) too."""
    bs, lens = 16, [3, 16, 17, 40]
    case = decode_case(40, lens, heads=9, kv_heads=3, head_dim=64, block_size=bs, dtype=torch.bfloat16,
                       extra_blocks=2, num_splits=num_splits)  # fmt: skip
    num_blocks = case["k_cache"].shape[0] // 3
    case["block_tables"] = scattered_tables(42, lens, bs, num_blocks, case["block_tables"].shape[1], pad=0)
    fill = float("nan") if nan else 0.0
    for cache in (case["k_cache"], case["v_cache"]):
        cache[layer_rows(torch.tensor([0]), 3, num_blocks)] = fill
        for i, n in enumerate(lens):
            last = case["block_tables"][i, (n - 1) // bs].long()
            cache[layer_rows(last[None], 3, num_blocks), n % bs or bs :] = fill
    return case


def decode_cases() -> dict[str, dict]:
    bf16, fp32, fp16 = torch.bfloat16, torch.float32, torch.float16
    ragged = [1, 15, 16, 17, 150]  # 1, block_size - 1, block_size, block_size + 1, long
    return {
        "smollm2_bf16": decode_case(0, ragged, 9, 3, 64, 16, bf16, extra_blocks=3, strided_q=True),
        "smollm2_fp32": decode_case(1, ragged, 9, 3, 64, 16, fp32, extra_blocks=3),
        "mha_fp32_hd128": decode_case(2, [1, 16, 33, 90], 4, 4, 128, 16, fp32),
        "gqa4_bf16_hd128": decode_case(3, [7, 64, 65], 8, 2, 128, 16, bf16, extra_blocks=1),
        "gqa4_fp16_bs8_hd16": decode_case(4, [1, 7, 8, 9, 70], 8, 2, 16, 8, fp16),
        "gqa3_fp32_bs128_hd256": decode_case(5, [1, 127, 129], 6, 2, 256, 128, fp32),
        # long contexts, few (sequence, kv head) pairs: the heuristic picks split-K
        "split_auto_fp32": decode_case(6, [1, 700, 2000], 3, 1, 64, 16, fp32, num_blocks=190),
        "split_auto_bf16": decode_case(7, [1, 1100, 1500], 9, 3, 64, 16, bf16, num_blocks=180),
        # forced: 3 splits (not a power of two) with the short sequence's later splits empty
        "split_forced_3": decode_case(8, [1, 15, 17, 300], 9, 3, 64, 16, fp32, num_splits=3),
        "single_pass_long": decode_case(6, [1, 700, 2000], 3, 1, 64, 16, fp32, num_blocks=190, num_splits=1),
        # a CUDA graph's tables: as wide as a long context allows (the splits sized for it), short contexts in
        # them, each cut into its own splits (a context shorter than the splits' tiles leaves most empty)
        "split_graph_width": decode_case(11, [1, 33, 200, 600], 6, 2, 64, 16, bf16, extra_blocks=90),
        "split_graph_width_fp32": decode_case(
            12, [5, 130, 700], 4, 1, 64, 16, fp32, extra_blocks=80, num_splits=16
        ),
        "poison_nan": poisoned_case(nan=True, num_splits=1),
        "poison_zero": poisoned_case(nan=False, num_splits=1),
        "poison_nan_split": poisoned_case(nan=True, num_splits=2),
        "poison_zero_split": poisoned_case(nan=False, num_splits=2),
    }


def prefill_case(
    seed: int, start_pos: int, n: int, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype
) -> dict:
    total = start_pos + n
    nb = math.ceil(total / block_size)
    num_blocks = nb + 4
    k, v = make_cache(seed, kv_heads, num_blocks, block_size, head_dim, dtype)
    table = scattered_tables(seed + 2, [total], block_size, num_blocks, nb + 1)[0]  # one spare entry
    return dict(
        q=torch.randn(n, heads, head_dim, generator=gen(seed + 1)).to(dtype),
        k_cache=k,
        v_cache=v,
        block_table=table,
        start_pos=start_pos,
        scale=1.0 / math.sqrt(head_dim),
        num_kv_heads=kv_heads,
    )


def prefill_cases() -> dict[str, dict]:
    return {
        "fresh_smollm2_bf16": prefill_case(20, 0, 37, 9, 3, 64, 16, torch.bfloat16),
        "chunk_after_prefix_fp32": prefill_case(21, 50, 20, 8, 2, 64, 16, torch.float32),
        "chunk_two_row_tiles_fp32": prefill_case(22, 17, 70, 3, 1, 64, 16, torch.float32),
        "single_token_fp32": prefill_case(23, 33, 1, 4, 4, 32, 8, torch.float32),
    }


VARLEN_CHUNKS = [
    (0, 37),
    (50, 20),
    (0, 1),
    (17, 70),
]  # (start_pos, tokens): fresh, after a prefix, 1, 2 tiles


def varlen_case(seed: int, dtype: torch.dtype) -> dict:
    """One layer of a step holding four prefill chunks of four sequences (SmolLM2's heads) between decode rows:
    rows 0-2 and the last 3 belong to no chunk. q is a strided view (q beside k in one projection, as the model
    has it), each sequence has its own scattered blocks, the chunks' own K/V already in them."""
    heads, kv_heads, hd, bs = 9, 3, 64, 16
    totals = [a + n for a, n in VARLEN_CHUNKS]
    nbs = [math.ceil(t / bs) for t in totals]
    num_blocks = sum(nbs) + 5
    k, v = make_cache(seed, kv_heads, num_blocks, bs, hd, dtype)
    tables = scattered_tables(seed + 1, totals, bs, num_blocks, max(nbs))
    T = 3 + sum(n for _, n in VARLEN_CHUNKS) + 3
    qk = torch.randn(T, heads + kv_heads, hd, generator=gen(seed + 2)).to(dtype)
    chunks, row = [], 3
    for i, (a, n) in enumerate(VARLEN_CHUNKS):
        chunks.append((row, n, a, tables[i, : nbs[i]].tolist()))
        row += n
    return dict(q=qk[:, :heads], k_cache=k, v_cache=v, chunks=chunks, scale=1 / 8, num_kv_heads=kv_heads)


def engine_step() -> dict:
    """Layer 1 of the engine's own PagedKvCache (SmolLM2's attention shape, bf16) with the inputs a step hands the
    kernels: decode tables padded with block 0 as engine.py pads them (block 0 is another sequence's here), and a
    prefill chunk after a cached prefix. `expected` is what model.py's torch path (SDPA) computes from them."""
    cfg = ModelConfig(architecture="llama", num_layers=2, hidden_size=576, num_heads=9, num_kv_heads=3,
                      head_dim=64, intermediate_size=1536, vocab_size=64, rope_theta=1e4, rms_norm_eps=1e-5,
                      max_context=256, tie_embeddings=True)  # fmt: skip
    kv = PagedKvCache(cfg, num_blocks=24, block_size=16, dtype=torch.bfloat16)
    kv.data.copy_(torch.randn(kv.data.shape, generator=gen(60)))
    tables, lens = [[5, 17, 2], [0], [11, 3, 20, 7, 13]], [40, 16, 70]
    meta = AttnMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        decode_tables=torch.tensor([t + [0] * (5 - len(t)) for t in tables], dtype=torch.int32),
        decode_lens=torch.tensor(lens, dtype=torch.int32),
    )
    k, v, scale = kv.k[1], kv.v[1], 1 / 8
    q = torch.randn(3, 9, 64, generator=gen(61)).to(torch.bfloat16)
    rows, mask = meta.decode_gather(k, 3)
    kd, vd = (c.index_select(0, rows).view(3, 3, 80, 64).transpose(0, 1) for c in (k, v))
    decode = F.scaled_dot_product_attention(
        q[:, :, None], kd, vd, attn_mask=mask, enable_gqa=True, scale=scale
    )
    # prefill: tokens 40..69 of the third sequence, after a 40-token cached prefix
    ctx_rows, positions = kv.gather_index(torch.tensor(tables[2])), torch.arange(40, 70)
    qp = torch.randn(30, 9, 64, generator=gen(62)).to(torch.bfloat16)
    kp, vp = (c.index_select(0, ctx_rows).view(1, 3, 80, 64) for c in (k, v))
    causal = torch.arange(80)[None, :] <= positions[:, None]
    prefill = F.scaled_dot_product_attention(
        qp.transpose(0, 1)[None], kp, vp, attn_mask=causal, enable_gqa=True, scale=scale
    )
    return dict(
        decode=dict(q=q, k_cache=k, v_cache=v, block_tables=meta.decode_tables, seq_lens=meta.decode_lens,
                    num_kv_heads=3, scale=scale),
        prefill=dict(q=qp, k_cache=k, v_cache=v, block_table=torch.tensor(tables[2], dtype=torch.int32),
                     start_pos=40, scale=scale, num_kv_heads=3),
        expected_decode=decode[:, :, 0],
        expected_prefill=prefill[0].transpose(0, 1),
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------ reference


def gather_keys(
    cache: torch.Tensor, table: torch.Tensor, num_kv_heads: int, n: int, group: int
) -> torch.Tensor:
    """A sequence's first n keys (or values) out of its blocks, fp32, repeated per query head: [heads, n, hd]."""
    rows = layer_rows(table.long(), num_kv_heads, cache.shape[0] // num_kv_heads)
    return cache[rows].float().view(num_kv_heads, -1, cache.shape[-1])[:, :n].repeat_interleave(group, 0)


def reference_decode(q, k_cache, v_cache, block_tables, seq_lens, num_kv_heads, scale, **_) -> torch.Tensor:
    B, heads, hd = q.shape
    group = heads // num_kv_heads
    out = torch.empty(B, heads, hd)
    for b in range(B):
        n = int(seq_lens[b])
        k = gather_keys(k_cache, block_tables[b], num_kv_heads, n, group)
        v = gather_keys(v_cache, block_tables[b], num_kv_heads, n, group)
        p = torch.softmax((k @ q[b].float()[:, :, None]).squeeze(-1) * scale, dim=-1)  # [heads, n]
        out[b] = (p[:, None, :] @ v).squeeze(1)
    return out


def reference_prefill(q, k_cache, v_cache, block_table, start_pos, scale, num_kv_heads) -> torch.Tensor:
    n, heads, hd = q.shape
    total = start_pos + n
    group = heads // num_kv_heads
    k = gather_keys(k_cache, block_table, num_kv_heads, total, group)
    v = gather_keys(v_cache, block_table, num_kv_heads, total, group)
    scores = q.float().transpose(0, 1) @ k.transpose(1, 2) * scale  # [heads, n, total]
    causal = torch.arange(total)[None, :] <= (start_pos + torch.arange(n))[:, None]
    p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return (p @ v).transpose(0, 1)


# ------------------------------------------------------------------------------------------------ child


def run_interpreted(inputs_path: Path, outputs_path: Path) -> None:
    """Child process (TRITON_INTERPRET=1): every case through the kernels."""
    from services.engine import triton_attention

    inputs = torch.load(inputs_path)
    out: dict[str, object] = {"available": triton_attention.available(), "decode": {}, "prefill": {}}
    for name, case in inputs["decode"].items():
        out["decode"][name] = triton_attention.paged_decode_attention(**case)  # type: ignore[index]
    # into a caller's buffer: a strided view of a wider tensor, which must be the tensor returned
    case = dict(inputs["decode"]["smollm2_bf16"])
    wide = torch.full((5, 9, 128), 7.0, dtype=torch.bfloat16)
    returned = triton_attention.paged_decode_attention(**case, out=wide[:, :, :64])
    out["into_out"] = (wide, returned.data_ptr() == wide.data_ptr())
    for name, case in inputs["prefill"].items():
        out["prefill"][name] = triton_attention.paged_prefill_attention(**case)  # type: ignore[index]
    out["warm"] = {
        str(dt): triton_attention.warm_up_prefill(9, 3, 64, 16, dt, torch.device("cpu"))
        for dt in (torch.bfloat16, torch.float32)
    }
    out["varlen"] = {}
    for name, case in inputs["varlen"].items():
        case = dict(case)
        plan = plan_prefill(
            [PrefillChunk(*c) for c in case.pop("chunks")], case["q"].dtype, 16, torch.device("cpu")
        )
        sentinel = torch.full(case["q"].shape, 7.0, dtype=case["q"].dtype)
        out["varlen"][name] = triton_attention.paged_prefill_varlen(**case, plan=plan, out=sentinel)
    step = inputs["engine"]
    out["engine"] = (
        triton_attention.paged_decode_attention(**step["decode"]),
        triton_attention.paged_prefill_attention(**step["prefill"]),
    )
    torch.save(out, outputs_path)


@pytest.fixture(scope="module")
@starts_processes
def interpreted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("triton_attention")
    inputs = {
        "decode": decode_cases(),
        "prefill": prefill_cases(),
        "varlen": {"bf16": varlen_case(70, torch.bfloat16), "fp32": varlen_case(71, torch.float32)},
        "engine": engine_step(),
    }
    torch.save(inputs, tmp / "inputs.pt")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, __file__, str(tmp / "inputs.pt"), str(tmp / "outputs.pt")],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"interpreted kernels failed:\n{proc.stdout}\n{proc.stderr}"
    return inputs, torch.load(tmp / "outputs.pt")


def tolerance(dtype: torch.dtype) -> dict:
    # fp32: summation order only. bf16/fp16: the output's own rounding plus p rounded for the P @ V dot.
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}.get(
        dtype, dict(rtol=1.6e-2, atol=1e-2)
    )


NONPOISON = [n for n in decode_cases() if not n.startswith("poison")]


def test_available_under_the_interpreter(interpreted):
    assert interpreted[1]["available"] is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-device answer")
def test_not_available_without_a_device_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert ta.available() is False


@pytest.mark.parametrize("name", NONPOISON)
def test_decode_matches_the_torch_reference(interpreted, name):
    inputs, outputs = interpreted
    case = inputs["decode"][name]
    got = outputs["decode"][name]
    assert got.shape == case["q"].shape and got.dtype == case["q"].dtype
    torch.testing.assert_close(got.float(), reference_decode(**case), **tolerance(got.dtype))


def test_split_k_is_what_the_heuristic_picks_for_long_contexts_and_agrees_with_one_pass(interpreted):
    inputs, outputs = interpreted
    for name in ("split_auto_fp32", "split_auto_bf16", "split_graph_width"):
        case = inputs["decode"][name]
        B, kv, width = case["q"].shape[0], case["num_kv_heads"], case["block_tables"].shape[1]
        assert ta.choose_num_splits(B, kv, width * case["k_cache"].shape[1]) > 1, name
    # same inputs through both paths: only fp32 summation order differs
    torch.testing.assert_close(
        outputs["decode"]["split_auto_fp32"], outputs["decode"]["single_pass_long"], rtol=1e-5, atol=1e-6
    )


def test_blocks_named_only_past_seq_len_never_affect_the_output(interpreted):
    _, outputs = interpreted
    for suffix in ("", "_split"):
        poisoned, clean = outputs["decode"][f"poison_nan{suffix}"], outputs["decode"][f"poison_zero{suffix}"]
        assert torch.isfinite(poisoned).all()
        assert torch.equal(poisoned, clean)
    inputs = interpreted[0]
    clean_case = inputs["decode"]["poison_zero"]
    torch.testing.assert_close(
        outputs["decode"]["poison_zero"].float(), reference_decode(**clean_case), **tolerance(torch.bfloat16)
    )


def test_decode_writes_into_a_strided_out_buffer(interpreted):
    inputs, outputs = interpreted
    wide, same_storage = outputs["into_out"]
    assert same_storage
    assert torch.equal(wide[:, :, :64], outputs["decode"]["smollm2_bf16"])
    assert (wide[:, :, 64:] == 7.0).all()  # nothing written outside the view


@pytest.mark.parametrize("name", list(prefill_cases()))
def test_prefill_matches_the_causal_torch_reference(interpreted, name):
    inputs, outputs = interpreted
    case = inputs["prefill"][name]
    got = outputs["prefill"][name]
    assert got.shape == case["q"].shape and got.dtype == case["q"].dtype
    torch.testing.assert_close(got.float(), reference_prefill(**case), **tolerance(got.dtype))


@pytest.mark.parametrize("name", ["bf16", "fp32"])
def test_one_varlen_launch_gives_each_chunk_its_own_causal_attention_and_touches_no_other_row(
    interpreted, name
):
    """Four sequences' chunks in one launch (a fresh prompt, a chunk after a cached prefix, a one-token prompt, a
    chunk of two row tiles): each chunk's rows are what that sequence alone computes over its own blocks; the
    rows of no chunk (a step's decode rows) keep what the caller had there."""
    inputs, outputs = interpreted
    case, got = inputs["varlen"][name], outputs["varlen"][name]
    assert got.dtype == case["q"].dtype
    for row, n, start, table in case["chunks"]:
        want = reference_prefill(
            case["q"][row : row + n], case["k_cache"], case["v_cache"], torch.tensor(table, dtype=torch.int32),
            start, case["scale"], case["num_kv_heads"],
        )  # fmt: skip
        torch.testing.assert_close(got[row : row + n].float(), want, **tolerance(got.dtype))
    assert (got[:3] == 7.0).all() and (got[-3:] == 7.0).all()


@pytest.mark.parametrize("chunks", [1, 2, 3, 5, 7])
def test_every_part_of_a_plan_starts_16_byte_aligned_whatever_the_steps_counts(chunks):
    """Triton specialises pointers on 16-byte alignment: a part whose offset moved with the step's tile and chunk
    counts would compile another kernel variant (seconds) in the middle of serving."""
    plan = plan_prefill(
        [PrefillChunk(9 * i, 9, 0, [i]) for i in range(chunks)], torch.float32, 16, torch.device("cpu")
    )
    for part in (plan.tiles, plan.seqs, plan.tables):
        assert part.data_ptr() % 16 == 0
    assert plan.seqs.tolist() == [[9 * i for i in range(chunks)], [9] * chunks, [0] * chunks]
    assert plan.tables.tolist() == [[i] for i in range(chunks)]


def test_the_warm_up_compiles_every_tile_height_a_step_can_pick(interpreted):
    """A worker compiles the prefill kernel before its first request: both heights prefill_block_m gives (a step
    whose chunks are all short, and any other), per dtype."""
    _, outputs = interpreted
    for dt in (torch.bfloat16, torch.float32):
        want = sorted({prefill_block_m(n, dt) for n in range(1, 4096)})
        assert sorted(outputs["warm"][str(dt)]) == want


def test_a_plan_whose_table_does_not_cover_its_chunk_is_refused():
    with pytest.raises(ValueError, match="the table must cover it"):
        plan_prefill([PrefillChunk(0, 20, 0, [3])], torch.float32, 16, torch.device("cpu"))


def test_kernels_agree_with_the_engines_torch_path_on_its_own_cache_and_metadata(interpreted):
    inputs, outputs = interpreted
    step = inputs["engine"]
    decode, prefill = outputs["engine"]
    tol = tolerance(torch.bfloat16)
    torch.testing.assert_close(decode.float(), step["expected_decode"].float(), **tol)
    torch.testing.assert_close(prefill.float(), step["expected_prefill"].float(), **tol)


def test_choose_num_splits_depends_on_shape_only_and_stays_a_power_of_two():
    assert ta.choose_num_splits(1, 8, 512) == 1  # short context: one pass
    assert ta.choose_num_splits(64, 8, 32768) == 1  # 512 programs already fill the GPU
    for batch, kv, ctx in [(1, 1, 1024), (1, 3, 8192), (4, 8, 4096), (2, 2, 131072)]:
        s = ta.choose_num_splits(batch, kv, ctx)
        assert 1 < s <= ta.MAX_SPLITS and s & (s - 1) == 0
        assert ctx // s >= ta.MIN_SPLIT_TOKENS


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(block_size=12), "block_size 12"),
        (dict(head_dim=48), "head_dim 48"),
        (dict(cache_dtype=torch.float16), "cache is torch.float16"),
        (dict(heads=8), "num_heads 8"),
        (dict(table_dtype=torch.int64), "int32"),
        (dict(flat_q=True), r"q must be \[tokens, num_heads, head_dim\]"),
    ],
)
def test_unsupported_inputs_are_refused_by_name(change, message):
    bs, hd, heads = change.get("block_size", 16), change.get("head_dim", 64), change.get("heads", 9)
    q = torch.zeros(2, heads * hd) if change.get("flat_q") else torch.zeros(2, heads, hd)
    k = torch.zeros(3 * 4, bs, hd, dtype=change.get("cache_dtype", torch.float32))
    tables = torch.zeros(2, 2, dtype=change.get("table_dtype", torch.int32))
    with pytest.raises(ValueError, match=message):
        ta.paged_decode_attention(q, k, k, tables, torch.ones(2, dtype=torch.int32), 3, 0.125)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_replays_in_a_cuda_graph_with_new_tables_and_lengths():
    """Captured once, replayed on other tables and lengths in the same tensors: the answer follows the data."""
    cases = [decode_case(s, lens, 9, 3, 64, 16, torch.bfloat16, num_blocks=200)
             for s, lens in ((50, [1, 17, 1000, 33]), (51, [40, 2, 16, 999]))]  # fmt: skip
    for splits in (1, 4):
        static = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in cases[0].items()}
        static["num_splits"] = splits
        ta.paged_decode_attention(**static)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ta.paged_decode_attention(**static)
        for case in cases:
            for key in ("q", "k_cache", "v_cache", "block_tables", "seq_lens"):
                static[key].copy_(case[key])
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out.float().cpu(), reference_decode(**case), rtol=1.6e-2, atol=1e-2)


if __name__ == "__main__":
    run_interpreted(Path(sys.argv[1]), Path(sys.argv[2]))
