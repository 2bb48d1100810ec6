"""The batched sampler against reference formulas written element by element, and the recovery contract:
a row's token depends only on (seed, index, its logits after its own processors, its tokens) — never on the
other rows of the batch — so a penalised or biased request resumed elsewhere continues token for token."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from services.engine.engine import EngineConfig, LLMEngine
from services.engine.sampling import (
    RowContext,
    SamplingParams,
    _penalise,
    apply_processors,
    draw_seed,
    sample_batch,
    unpack_bitmask,
)
from tests.conftest import tiny_llama

VOCAB = 64


def _logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _reference_penalties(
    row: list[float], p: SamplingParams, prompt: list[int], out: list[int]
) -> list[float]:
    """vLLM's / HF's definitions, one element at a time."""
    result = []
    for t, v in enumerate(row):
        if t in prompt or t in out:
            v = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        count = out.count(t)
        v -= p.frequency_penalty * count
        v -= p.presence_penalty * (1 if count else 0)
        result.append(v)
    return result


def test_penalties_match_the_reference_formula_row_by_row() -> None:
    rng = random.Random(3)
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(presence_penalty=-1.5),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=2.0),
        SamplingParams(),  # unpenalised, in the same batch
    ]
    rows = [
        RowContext([rng.randrange(VOCAB) for _ in range(9)], [rng.randrange(VOCAB) for _ in range(12)])
        for _ in params
    ]
    logits = _logits(len(params))
    got = apply_processors(logits, params, rows)
    for r, (p, c) in enumerate(zip(params, rows, strict=True)):
        want = _reference_penalties(logits[r].tolist(), p, list(c.prompt_ids), list(c.output_ids))
        assert got[r].tolist() == pytest.approx(want, abs=1e-5)
    assert torch.equal(logits, _logits(len(params)))  # the caller's logits are not touched


def test_each_penalty_moves_the_greedy_choice_as_its_definition_says() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 2.0, 1.5  # 5 wins unpenalised
    ctx = [RowContext(prompt_ids=[], output_ids=[5])]
    greedy = dict(temperature=0.0)
    assert sample_batch(logits, [SamplingParams(**greedy)], [1], ctx)[0].token_id == 5
    # 2.0 - 0.6 < 1.5: having said 5 once, the penalised row says 6
    assert sample_batch(logits, [SamplingParams(presence_penalty=0.6, **greedy)], [1], ctx)[0].token_id == 6
    assert sample_batch(logits, [SamplingParams(frequency_penalty=0.6, **greedy)], [1], ctx)[0].token_id == 6
    # 2.0 / 1.5 < 1.5
    assert sample_batch(logits, [SamplingParams(repetition_penalty=1.5, **greedy)], [1], ctx)[0].token_id == 6
    # a negative presence penalty rewards repetition: 5 again, even against a closer rival
    logits[0, 6] = 2.1
    assert sample_batch(logits, [SamplingParams(presence_penalty=-0.5, **greedy)], [1], ctx)[0].token_id == 5
    # repetition_penalty reaches the prompt's tokens too (frequency/presence only the output's)
    in_prompt = [RowContext(prompt_ids=[6], output_ids=[])]
    assert (
        sample_batch(logits, [SamplingParams(repetition_penalty=1.2, **greedy)], [0], in_prompt)[0].token_id
        == 5
    )
    assert (
        sample_batch(logits, [SamplingParams(presence_penalty=2, **greedy)], [0], in_prompt)[0].token_id == 6
    )


def test_logit_bias_adds_to_the_logit_and_can_force_or_ban_a_token() -> None:
    logits = _logits(2, seed=1)
    params = [SamplingParams(logit_bias=((3, 2.5), (40, -7.0))), SamplingParams()]
    got = apply_processors(logits, params, [RowContext(), RowContext()])
    want = logits.clone()
    want[0, 3] += 2.5
    want[0, 40] -= 7.0
    assert torch.allclose(got, want)
    forced = SamplingParams(temperature=1.0, seed=9, logit_bias=((17, 100.0),))
    banned_top = int(logits[1].argmax())
    banned = SamplingParams(temperature=0.0, logit_bias=((banned_top, -100.0),))
    for i in range(20):
        picks = sample_batch(logits, [forced, banned], [i, i])
        assert picks[0].token_id == 17
        assert picks[1].token_id != banned_top


def test_min_p_never_draws_a_token_below_its_threshold() -> None:
    logits = _logits(1, seed=2) / 3
    probs = torch.softmax(logits[0], -1)
    allowed = set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())
    assert 1 < len(allowed) < VOCAB
    p = SamplingParams(temperature=1.0, min_p=0.2, seed=4)
    drawn = {sample_batch(logits, [p], [i])[0].token_id for i in range(300)}
    assert drawn <= allowed and len(drawn) > 1


def test_top_k_and_top_p_keep_the_reference_sets() -> None:
    logits = _logits(1, seed=5)
    order = logits[0].argsort(descending=True).tolist()
    p = SamplingParams(temperature=1.0, top_k=3, seed=1)
    assert {sample_batch(logits, [p], [i])[0].token_id for i in range(200)} <= set(order[:3])
    probs = torch.softmax(logits[0], -1)[order].tolist()
    keep = next(k for k in range(1, VOCAB + 1) if sum(probs[:k]) >= 0.5)  # the smallest set reaching top_p
    p = SamplingParams(temperature=1.0, top_p=0.5, seed=1)
    assert {sample_batch(logits, [p], [i])[0].token_id for i in range(200)} <= set(order[:keep])


def test_bitmask_unpacks_little_endian_and_masks_the_choice() -> None:
    allowed = [0, 31, 32, 45, 63]
    words = torch.zeros(2, dtype=torch.int64)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # int32 as xgrammar packs
    assert unpack_bitmask(words, VOCAB).nonzero().flatten().tolist() == allowed
    logits = _logits(1, seed=6)
    ctx = [RowContext(bitmask=words)]
    greedy = sample_batch(logits, [SamplingParams(temperature=0.0)], [0], ctx)[0].token_id
    assert greedy == max(allowed, key=lambda t: float(logits[0, t]))
    p = SamplingParams(temperature=2.0, seed=3)
    assert {sample_batch(logits, [p], [i], ctx)[0].token_id for i in range(100)} <= set(allowed)


def test_a_row_samples_the_same_alone_as_in_any_batch() -> None:
    params = [
        SamplingParams(temperature=0.9, top_p=0.8, seed=1),
        SamplingParams(temperature=0.0, frequency_penalty=1.0),
        SamplingParams(temperature=1.2, top_k=5, min_p=0.05, seed=2, logit_bias=((7, 3.0),)),
        SamplingParams(temperature=0.7, repetition_penalty=1.4, seed=3, logprobs=3),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    rows = [RowContext([1, 2, 3], [4, 5, 4, 9]) for _ in params]
    logits = _logits(len(params), seed=7)
    for index in range(5):
        together = sample_batch(logits, params, [index] * len(params), rows)
        for r in range(len(params)):
            [alone] = sample_batch(logits[r : r + 1], [params[r]], [index], [rows[r]])
            assert alone == together[r]


def test_a_temperature_too_small_to_divide_by_samples_the_argmax() -> None:
    """Logits of magnitude ~17 divided by 1e-38 overflow to inf; the draw then picked the vocabulary's last
    token (until 2026-12-07). Below 1e-5 (vLLM's threshold) a row is greedy; at 1e-3 the draw itself still
    lands on the argmax of such peaked logits."""
    logits = _logits(1, seed=9) * 6
    argmax = int(logits[0].argmax())
    assert argmax != VOCAB - 1
    for temperature in (1e-3, 9.9e-6, 1e-30, 1e-38, 1e-45, 5e-324):
        p = SamplingParams(temperature=temperature, seed=3, logprobs=1)
        for index in range(4):
            [out] = sample_batch(logits, [p], [index])
            assert out.token_id == argmax, temperature
            assert math.isfinite(out.logprob)


def test_an_extreme_repetition_penalty_still_draws_a_seen_token_not_the_last_one() -> None:
    """repetition_penalty 1e-45 divides a seen positive logit past float range; it drew the vocabulary's last
    token (NaN probabilities) until 2026-12-07. Now the seen token, boosted to the bound, is drawn, on the CPU's
    sparse path and the dense one, at any temperature that samples."""
    logits = _logits(1, seed=10).abs() + 1.0  # every logit positive: the seen one is divided up
    seen = 7
    for temperature in (1.0, 1e-4):
        p = SamplingParams(temperature=temperature, repetition_penalty=1e-45, seed=1)
        row = RowContext([seen], [])
        assert sample_batch(logits, [p], [0], [row])[0].token_id == seen
        processed = _penalise(logits.clone(), [p], [row])  # the dense form a GPU runs
        assert torch.isfinite(processed).all() and int(processed.argmax()) == seen


def test_the_draw_is_the_inverse_cdf_at_a_uniform_hashed_from_seed_and_index() -> None:
    """The per-index draw every worker reproduces, whatever its device: u = the top 53 bits of
    draw_seed(seed, index) / 2^53; the token is the first whose cumulative probability passes u x the total
    (here computed apart, in float64)."""
    logits = _logits(1, seed=8)
    p = SamplingParams(temperature=0.8, seed=12345)
    cdf = np.cumsum(torch.softmax(logits[0].double() / 0.8, -1).numpy())
    for index in range(50):
        u = (draw_seed(12345, index) >> 10) * 2.0**-53
        want = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        assert sample_batch(logits, [p], [index])[0].token_id == want


def test_draws_over_many_indices_follow_the_distribution_and_never_pick_a_masked_token() -> None:
    """20,000 seeded draws from one row (a fixed outcome: the seeds are fixed): each token's share is its
    probability within sampling error (chi-square), and the tokens top-k masks out never come."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 3.0, -0.5]])
    p = SamplingParams(temperature=1.0, top_k=6, seed=7)
    n = 20_000
    picks = [s.token_id for s in sample_batch(logits.expand(n, -1), [p] * n, list(range(n)))]
    counts = np.bincount(picks, minlength=8)
    kept = torch.topk(logits[0], 6).indices.tolist()
    assert all(counts[t] == 0 for t in range(8) if t not in kept)
    probs = torch.softmax(logits[0][kept], -1).numpy()
    observed = counts[kept]
    chi2 = float((((observed - n * probs) ** 2) / (n * probs)).sum())
    assert chi2 < 20.5  # 5 degrees of freedom: p = 0.001


def test_a_uniform_that_rounds_to_one_never_draws_a_masked_token() -> None:
    """Seed 64667561's first uniform is 0.99999999..., 1.0 in float32: nothing in the cumulative sum passed u x
    the total, and the vocabulary's last token came out whatever masked it (top_k, top_p, min_p, a grammar).
    Until 2026-12-07; now the last token with any probability."""
    seed = 64667561
    u = (draw_seed(seed, 0) >> 10) * 2.0**-53
    assert u < 1.0 and np.float32(u) == 1.0
    logits = _logits(1, seed=3)
    logits[0, VOCAB - 1] = logits[0].min() - 1  # the last token is the least likely: masked by each below
    top = int(logits[0].argmax())
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        picked = sample_batch(logits, [SamplingParams(temperature=1.0, seed=seed, **kw)], [0])[0].token_id
        assert picked == top, kw
    # unmasked, it is the last token of the row, as the inverse CDF at u -> 1 says
    assert sample_batch(logits, [SamplingParams(temperature=1.0, seed=seed)], [0])[0].token_id == VOCAB - 1


def test_logprobs_are_the_raw_log_softmax_in_one_copy() -> None:
    logits = _logits(2, seed=9)
    params = [
        SamplingParams(temperature=0.0, logprobs=2, presence_penalty=2.0),
        SamplingParams(temperature=0),
    ]
    picks = sample_batch(logits, params, [0, 0], [RowContext([], [int(logits[0].argmax())]), RowContext()])
    lp = torch.log_softmax(logits[0], -1)
    assert picks[0].logprob == pytest.approx(float(lp[picks[0].token_id]), abs=1e-6)
    top = lp.topk(2)
    assert picks[0].top_logprobs == [
        (int(i), pytest.approx(float(v), abs=1e-6)) for i, v in zip(top.indices, top.values, strict=True)
    ]
    assert picks[1].logprob is None


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(repetition_penalty=math.inf), "repetition_penalty"),
        (dict(min_p=1.5), "min_p"),
        (dict(logit_bias=((1, 101.0),)), "logit_bias"),
    ],
)
def test_out_of_range_parameters_are_refused_naming_them(kw: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        SamplingParams(**kw)


def _engine() -> LLMEngine:
    cfg = EngineConfig(dtype="float32", num_kv_blocks=128, block_size=4, max_num_batched_tokens=256)
    return LLMEngine(tiny_llama(), cfg)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=20, temperature=0.9, seed=5, ignore_eos=True, frequency_penalty=1.1,
                       presence_penalty=0.4, repetition_penalty=1.3),
        SamplingParams(max_tokens=20, temperature=1.0, seed=6, ignore_eos=True, min_p=0.02,
                       logit_bias=((11, 4.0), (12, -50.0))),
    ],
    ids=["penalised", "logit_bias"],
)  # fmt: skip
def test_a_resumed_processed_request_continues_token_for_token(params: SamplingParams) -> None:
    prompt = list(range(30, 45))
    full = _engine().generate([prompt], params)[0]
    other = _engine()
    other.add_request("resumed", prompt, params, output_ids=full[:8])
    out: list[int] = []
    while other.has_unfinished():
        for o in other.step():
            out += o.new_token_ids
    assert full[:8] + out == full
    plain = _engine().generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0.9, seed=5, ignore_eos=True)
    )
    if params.penalised:
        assert full != plain[0]  # the penalties did change the answer


def test_logit_bias_reaches_the_engine() -> None:
    forced = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias=((77, 100.0),))
    assert _engine().generate([[1, 2, 3]], forced)[0] == [77] * 6


def test_the_batch_a_gpu_engine_profiles_its_sampler_with_runs_every_processor():
    """A GPU engine sizes its KV cache after a profile of its largest step, the sampler over a full batch
    included, with every processor on (the sampler keeps several copies of the logits alive, tens of bytes per
    logit). That batch must be one the sampler takes: each row draws a token the grammar allows and returns 20
    logprobs."""
    from services.engine.sampling import worst_case_batch

    vocab, rows = 1000, 8
    params, indices, contexts = worst_case_batch(rows, vocab)
    out = sample_batch(torch.randn(rows, vocab), params, indices, contexts)
    assert len(out) == rows and all(0 <= s.token_id < vocab for s in out)
    assert all(s.top_logprobs is not None and len(s.top_logprobs) == 20 for s in out)
    assert all(not p.greedy and p.penalised and p.logit_bias for p in params)


def test_top_p_on_a_cpu_finds_the_nucleus_the_full_sort_finds() -> None:
    """On a CPU the nucleus is looked for among a row's 1,024 most probable tokens before any sort of the whole
    vocabulary: peaked rows (nucleus inside them), flat rows (nucleus past them: sorted whole), rows that keep
    everything (2.0), rows with tokens already masked — every row keeps exactly the full sort's set."""
    from services.engine.sampling import _sorted_top_p, _top_p

    g = torch.Generator().manual_seed(21)
    vocab = 8192
    scale = torch.tensor([12.0, 6.0, 0.3, 8.0, 0.01, 5.0])[:, None]  # peaked ... almost flat
    x = torch.randn(6, vocab, generator=g) * scale
    x[3, ::3] = -math.inf  # already masked by top-k / min-p / a grammar
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.7, 0.9, 2.0])
    got, want = _top_p(x, top_p), _sorted_top_p(x, top_p)
    assert torch.equal(got.isfinite(), want.isfinite())
    assert torch.equal(got[got.isfinite()], want[want.isfinite()])
    kept = got.isfinite().sum(-1).tolist()
    assert (
        kept[0] < 1024 < kept[2] and kept[5] == vocab
    )  # both paths ran: inside the candidates, and past them


def test_a_cpu_penalises_only_the_seen_tokens_and_gets_the_dense_forms_bits() -> None:
    """On a CPU the penalties touch only each row's seen tokens (sampling._penalise_seen); the dense form the GPU
    runs (sampling._penalise) must give the same bits for every logit, over random batches mixing every penalty
    with unpenalised rows, repeated tokens, prompt-only tokens, -inf logits and rows with nothing seen."""
    from services.engine import sampling

    rng = random.Random(11)
    for trial in range(30):
        batch = rng.randrange(1, 9)
        params, rows = [], []
        for _ in range(batch):
            kind = rng.randrange(5)
            params.append(
                SamplingParams(
                    repetition_penalty=rng.choice([1.0, 1.0, 1.25, 0.7]) if kind else 1.0,
                    frequency_penalty=rng.choice([0.0, 0.5, -0.3]) if kind else 0.0,
                    presence_penalty=rng.choice([0.0, 1.5, -0.8]) if kind else 0.0,
                )
            )
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 20))]
            out = [rng.randrange(8) for _ in range(rng.randrange(0, 30))]  # few distinct: repeats
            rows.append(RowContext(prompt, out))
        logits = _logits(batch, seed=trial)
        logits[0, 3] = -math.inf
        got = apply_processors(logits, params, rows)
        pen = [r for r, p in enumerate(params) if p.penalised]
        want = logits.clone()
        if pen:
            want[pen] = sampling._penalise(want[pen], [params[r] for r in pen], [rows[r] for r in pen])
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), trial  # bits: no -0.0 in randn


def test_penalties_take_logits_of_any_layout() -> None:
    logits = _logits(3).t().contiguous().t()  # the same values, column-major
    assert not logits.is_contiguous()
    params = [SamplingParams(frequency_penalty=0.5)] * 3
    rows = [RowContext([], [1, 1, 2])] * 3
    assert torch.equal(
        apply_processors(logits, params, rows), apply_processors(logits.contiguous(), params, rows)
    )


def test_a_penalised_token_id_outside_the_vocabulary_raises_rather_than_reaching_another_row() -> None:
    with pytest.raises(IndexError, match="outside the vocabulary"):
        apply_processors(
            _logits(2), [SamplingParams(presence_penalty=1.0)] * 2, [RowContext([], [VOCAB + 1])] * 2
        )
