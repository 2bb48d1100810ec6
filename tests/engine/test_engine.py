"""Engine mechanics on a tiny random Llama: batching, chunked prefill, preemption, prefix caching, sampling,
stop conditions, KV export/import — each compared with an independent run that must give the same tokens."""

from __future__ import annotations

import pytest
import torch

from services.engine.block_hash import ROOT_HASH, block_hash, block_hashes
from services.engine.engine import (
    EngineConfig,
    KvMismatchError,
    LLMEngine,
    PromptTooLongError,
)
from services.engine.sampling import SamplingParams
from tests.conftest import tiny_llama

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def engine(**kw) -> LLMEngine:
    cfg = dict(dtype="float32", num_kv_blocks=128, block_size=4, max_num_batched_tokens=256)
    cfg.update(kw)
    return LLMEngine(tiny_llama(), EngineConfig(**cfg))


def prompts(n: int, lengths=(3, 9, 14, 21, 30, 7, 12, 5)) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Each prompt run alone, unchunked, with a roomy cache."""
    e = engine()
    return [e.generate([p], GREEDY)[0] for p in prompts(8)]


def test_continuous_batching_gives_each_sequence_its_solo_tokens(reference):
    assert engine().generate(prompts(8), GREEDY) == reference


@pytest.mark.slow
def test_chunked_prefill_under_a_small_token_budget_gives_the_same_tokens(reference):
    e = engine(max_num_batched_tokens=8)
    assert e.generate(prompts(8), GREEDY) == reference


@pytest.mark.slow
def test_preemption_when_blocks_run_out_recomputes_and_gives_the_same_tokens(reference):
    e = engine(num_kv_blocks=24, enable_prefix_caching=False)
    assert e.generate(prompts(8), GREEDY) == reference
    assert e.stats().preemptions > 0
    assert e.stats().free_blocks == 24  # nothing leaked


@pytest.mark.slow
def test_admission_limit_caps_the_running_batch(reference):
    e = engine(max_num_seqs=2)
    for i, p in enumerate(prompts(8)):
        e.add_request(f"r{i}", p, GREEDY)
    peak = 0
    while e.has_unfinished():
        e.step()
        peak = max(peak, e.stats().running)
    assert peak == 2


def test_prefix_cache_reuses_blocks_and_emits_store_and_evict_events():
    e = engine(num_kv_blocks=16)
    shared = list(range(40, 60))  # 20 tokens = 5 full blocks of 4
    e.generate([shared + [1, 2]], GREEDY)
    stored = [ev for ev in e.drain_kv_events() if ev.kind == "stored"]
    assert [ev.block_hash for ev in stored][:5] == block_hashes(shared, 4)
    assert stored[0].parent_hash == ROOT_HASH and stored[1].parent_hash == stored[0].block_hash

    req = e.add_request("second", shared + [7, 8, 9], GREEDY)
    out = []
    while e.has_unfinished():
        for o in e.step():
            out += o.new_token_ids
    assert req.num_cached_tokens == 20
    fresh = engine(enable_prefix_caching=False).generate([shared + [7, 8, 9]], GREEDY)[0]
    assert out == fresh
    # a cache of 16 blocks cannot keep everything: later prompts evict the oldest free blocks
    e.generate(prompts(4, lengths=(30,)), GREEDY)
    assert any(ev.kind == "evicted" for ev in e.drain_kv_events())


def test_fully_cached_prompt_still_computes_its_last_token():
    e = engine()
    p = list(range(10, 26))  # exactly 4 blocks
    first = e.generate([p], GREEDY)[0]
    req = e.add_request("again", p, GREEDY)
    out = []
    while e.has_unfinished():
        for o in e.step():
            out += o.new_token_ids
    assert out == first and req.num_cached_tokens == 12  # the last block is recomputed for logits


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    p = prompts(1)[0]
    a = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True)
    b = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=124, ignore_eos=True)
    assert engine().generate([p], a) == engine().generate([p], a)
    assert engine().generate([p], a) != engine().generate([p], b)


def test_resuming_with_emitted_tokens_continues_with_the_same_tokens():
    """Sampling at step i depends only on (seed, i, logits): a request resumed elsewhere continues identically."""
    p = prompts(1)[0]
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=50, seed=7, ignore_eos=True)
    full = engine().generate([p], params)[0]
    other = engine()
    req = other.add_request("resumed", p, params, output_ids=full[:7])
    out = []
    while other.has_unfinished():
        for o in other.step():
            out += o.new_token_ids
    assert full[:7] + out == full
    assert req.params.seed == 7


def test_top_k_1_and_tiny_top_p_equal_greedy(reference):
    p = prompts(1)[0]
    k1 = SamplingParams(max_tokens=24, temperature=1.5, top_k=1, seed=1, ignore_eos=True)
    tp = SamplingParams(max_tokens=24, temperature=1.5, top_p=1e-6, seed=1, ignore_eos=True)
    assert engine().generate([p], k1)[0] == reference[0]
    assert engine().generate([p], tp)[0] == reference[0]


def test_stop_token_ids_max_tokens_and_min_tokens(reference):
    e = engine()
    target = reference[1][5]
    first = reference[1].index(target)
    out = e.generate([prompts(2)[1]], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(target,)))[
        0
    ]
    assert out == reference[1][: first + 1]
    assert e.generate([prompts(2)[1]], SamplingParams(max_tokens=3, temperature=0))[0] == reference[1][:3]
    # with min_tokens the stop token cannot end the sequence early
    long = e.generate(
        [prompts(2)[1]],
        SamplingParams(max_tokens=24, min_tokens=first + 2, temperature=0, stop_token_ids=(target,)),
    )[0]
    assert len(long) >= first + 2 and long[first] != target


def test_logprobs_are_log_softmax_of_the_chosen_token():
    e = engine()
    e.add_request("lp", prompts(1)[0], SamplingParams(max_tokens=3, temperature=0, logprobs=2))
    outs = [o for _ in range(10) for o in e.step()]
    for o in outs:
        s = o.logprobs[0]
        assert s.logprob is not None and s.logprob <= 0
        assert s.top_logprobs is not None and s.top_logprobs[0][0] == s.token_id  # greedy picks the top one
        assert s.top_logprobs[0][1] == pytest.approx(s.logprob)


def test_kv_export_import_continues_exactly_like_never_moving():
    p = prompts(3)[2]  # 14 tokens: 3 full blocks and a partial one
    params = SamplingParams(max_tokens=16, temperature=0.7, seed=99, ignore_eos=True)
    never_moved = engine().generate([p], params)[0]

    prefill = engine()
    prefill.add_request("r", p, SamplingParams(**{**params.__dict__, "max_tokens": 1}), hold_kv=True)
    [first] = prefill.step()
    kv = prefill.export_kv("r")
    assert len(kv.token_ids) == len(p) and len(kv.data) == kv.num_blocks * prefill.kv.block_bytes == 4 * 2048

    decode = engine(num_kv_blocks=40)
    decode.add_request("r", p, params, output_ids=first.new_token_ids, kv=kv)
    out = list(first.new_token_ids)
    steps = 0
    while decode.has_unfinished():
        for o in decode.step():
            out += o.new_token_ids
        steps += 1
    assert out == never_moved
    assert steps == len(never_moved) - 1  # no prefill step on the decode side: every step emitted a token
    prefill.release_kv("r")
    assert prefill.stats().free_blocks == prefill.stats().total_blocks


def test_an_export_copied_off_the_engine_thread_is_the_requests_kv_even_when_its_blocks_are_released_meanwhile():
    """A prefill worker copies a request's KV out on another thread while the engine steps on. The pin taken by
    begin_export keeps the blocks from being freed and refilled by other prompts — a release of the request, its
    hold's expiry — until the copy has read them: the bytes are the request's own."""
    import threading

    p = prompts(3)[2]
    e = engine(num_kv_blocks=12, enable_prefix_caching=False)
    e.add_request("r", p, SamplingParams(max_tokens=1, temperature=0), hold_kv=True)
    e.step()
    want = bytes(e.export_kv("r").data)
    job = e.begin_export("r\x00copy", "r")
    e.release_kv("r")  # the hold expires before the copy runs
    assert e.stats().free_blocks == 12 - 4  # the pin keeps the request's 4 blocks
    others = prompts(2, lengths=(16,))  # 4 blocks each: every free block, with their own KV
    for i, q in enumerate(others):
        e.add_request(f"o{i}", q, SamplingParams(max_tokens=1, temperature=0), hold_kv=True)
    while e.has_unfinished():
        e.step()
    assert e.stats().free_blocks == 0
    out: list[bytes] = []
    copier = threading.Thread(target=lambda: out.append(bytes(job.copy_out(keep_device=False)[0])))
    copier.start()
    copier.join(30)
    assert out == [want]
    e.release_kv("r\x00copy")
    for i in range(2):
        e.release_kv(f"o{i}")
    assert e.stats().free_blocks == 12


def test_kv_import_refuses_another_layout_or_model():
    p = prompts(3)[2]  # 4 blocks of 4
    src = engine()
    src.add_request("r", p, SamplingParams(max_tokens=1, temperature=0), hold_kv=True)
    src.step()
    kv = src.export_kv("r")
    with pytest.raises(KvMismatchError, match="block_size"):
        engine(block_size=8).add_request("r", p, GREEDY, output_ids=[1], kv=kv)
    with pytest.raises(KvMismatchError, match="dtype"):
        engine(dtype="bfloat16").add_request("r", p, GREEDY, output_ids=[1], kv=kv)
    other_model = LLMEngine(tiny_llama(seed=5), EngineConfig(dtype="float32", num_kv_blocks=16, block_size=4))
    with pytest.raises(KvMismatchError, match="model_fingerprint"):
        other_model.add_request("r", p, GREEDY, output_ids=[1], kv=kv)
    with pytest.raises(KvMismatchError, match="different tokens"):
        engine().add_request("r", [t + 1 for t in p], GREEDY, output_ids=[1], kv=kv)
    # a cache of 3 blocks of 4 holds no 15-token context: its context length is 12
    with pytest.raises(PromptTooLongError, match="context length of 12 tokens"):
        engine(num_kv_blocks=3).add_request("r", p, GREEDY, output_ids=[1], kv=kv)


def test_a_cache_smaller_than_the_context_caps_the_context_instead_of_hanging():
    """A sequence longer than the whole KV cache preempted itself and waited for blocks forever (the engine audit:
    a 64-slot pool, a 63-token prompt, 198 empty steps). The context is capped at what the cache holds."""
    e = engine(num_kv_blocks=4)  # 4 blocks of 4 tokens
    assert e.max_model_len == 16
    e.add_request("fits", list(range(10, 20)), SamplingParams(max_tokens=50, temperature=0))
    out, reason, steps = [], None, 0
    while e.has_unfinished():
        steps += 1
        assert steps < 100, "the request never finished"
        for o in e.step():
            out += o.new_token_ids
            reason = o.finish_reason or reason
    assert reason == "length" and len(out) == 6
    with pytest.raises(PromptTooLongError, match="context length of 16 tokens"):
        e.add_request("long", list(range(10, 26)), GREEDY)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=12, temperature=1.0, seed=42),
        SamplingParams(max_tokens=12, temperature=0.8, seed=7, presence_penalty=1.5, frequency_penalty=0.7),
        SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3, min_tokens=10),
    ],
    ids=["seeded", "penalised", "min_tokens"],
)
def test_an_echoed_prompt_taught_token_by_token_generates_what_the_plain_request_does(params):
    """Completions' echo with logprobs runs the prompt teacher-forced (its tokens become forced outputs, so the
    workers report their logprobs). Those tokens are the prompt's: until 2026-12-07 they moved the seeded draw's
    index, counted as output for presence/frequency penalties and toward min_tokens, and the completion changed."""
    import dataclasses

    prompt = prompts(3)[2]
    plain = engine().generate([prompt], params)[0]
    taught = dataclasses.replace(
        params, max_tokens=params.max_tokens + len(prompt) - 1, forced_token_ids=tuple(prompt[1:])
    )
    out = engine().generate([prompt[:1]], taught)[0]
    assert out[: len(prompt) - 1] == prompt[1:]
    assert out[len(prompt) - 1 :] == plain


def test_bad_requests_are_refused_with_a_clear_error():
    e = engine()
    with pytest.raises(PromptTooLongError, match="context length of 512"):
        e.add_request("long", [1] * 600, GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        e.add_request("vocab", [1, 999], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        e.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    e.add_request("dup", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="duplicate"):
        e.add_request("dup", [1, 2], GREEDY)
    assert e.stats().waiting == 1  # the refused ones left nothing behind


def test_abort_frees_blocks():
    e = engine(num_kv_blocks=32)
    e.add_request("a", prompts(1)[0], GREEDY)
    e.step()
    assert e.stats().free_blocks < 32
    e.abort("a")
    assert not e.has_unfinished() and e.stats().free_blocks == 32


@pytest.mark.parametrize("steps", [0, 1, 5])  # queued, mid-prefill (4 chunks of 8), decoding
def test_abort_frees_the_blocks_of_a_request_that_would_hold_its_kv(steps: int):
    """A prefill worker's requests hold their KV after finishing (hold_kv); one aborted before that (its Prefill
    call cancelled) must still give its blocks back: nothing can release it once it is gone."""
    e = engine(num_kv_blocks=32, max_num_batched_tokens=8)
    prompt = prompts(5)[4]  # 30 tokens
    e.add_request("held", prompt, SamplingParams(max_tokens=4, temperature=0), hold_kv=True)
    for _ in range(steps):
        e.step()
    e.abort("held")
    assert not e.has_unfinished() and not e.id_in_use("held")
    assert e.stats().free_blocks == 32


def test_block_hash_is_chained_deterministic_and_ignores_partial_blocks():
    a = block_hashes(list(range(10)), 4)
    assert len(a) == 2 and a[1] == block_hash(a[0], [4, 5, 6, 7])
    assert (
        block_hashes([9] + list(range(1, 10)), 4)[1] != a[1]
    )  # a different first block changes every later hash
    # a fixed value: the router, the workers and the simulator must agree across processes and releases
    # pinned: changing the definition silently would split the cluster's view of what is cached
    assert block_hash(ROOT_HASH, [1, 2, 3, 4]) == block_hash(0, (1, 2, 3, 4)) == 0x18B2_C1FB_9F5E_FAEE


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused-cpu-kernels"])
def test_batched_decode_over_scattered_blocks_equals_full_prefill_of_each_sequence(fused: bool):
    """The decode attention path (torch: paged gather, padded context, boolean mask, SDPA; fused: the C++ kernel
    reading the blocks in place) gives each sequence the hidden state a causal prefill of its whole token list
    gives, for sequences of different lengths whose blocks are scattered through the cache."""
    from services.engine.model import AttnMetadata, PagedKvCache, PrefillSegment, Transformer

    loaded = tiny_llama(seed=2)
    model = Transformer(loaded.config, loaded.weights, torch.float32, cpu_kernels=fused)
    assert model.fused == fused
    bs = 4
    kv = PagedKvCache(loaded.config, num_blocks=32, block_size=bs, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (13, 6, 22)]
    tables = [[30, 2, 17, 5], [9, 21], [1, 28, 11, 3, 24, 7]]  # deliberately out of order

    def slots(table: list[int], positions: range) -> list[int]:
        return [table[p // bs] * bs + p % bs for p in positions]

    for seq, table in zip(seqs, tables, strict=True):  # prefill all but the last token of each sequence
        n = len(seq) - 1
        meta = AttnMetadata(
            slot_mapping=torch.tensor(slots(table, range(n))), prefills=[PrefillSegment(0, n)]
        )
        model(torch.tensor(seq[:n]), torch.arange(n), meta, kv)
    nb = max(-(-len(s) // bs) for s in seqs)
    lens = torch.tensor([len(s) for s in seqs])
    last_slots = [slots(t, range(len(s) - 1, len(s)))[0] for s, t in zip(seqs, tables, strict=True)]
    meta = AttnMetadata(
        slot_mapping=torch.tensor(last_slots),
        decode_rows=torch.arange(len(seqs)),
        decode_tables=torch.tensor([t + [0] * (nb - len(t)) for t in tables], dtype=torch.int32),
        decode_lens=lens.to(torch.int32),
    )
    decoded = model(torch.tensor([s[-1] for s in seqs]), lens - 1, meta, kv)

    fresh = PagedKvCache(loaded.config, num_blocks=32, block_size=bs, dtype=torch.float32)
    for i, seq in enumerate(seqs):
        n = len(seq)
        full = AttnMetadata(slot_mapping=torch.arange(n), prefills=[PrefillSegment(0, n)])
        ref = model(torch.tensor(seq), torch.arange(n), full, fresh)[-1]
        torch.testing.assert_close(decoded[i], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "params, named",
    [
        (SamplingParams(max_tokens=2, stop_token_ids=(3, 256)), "stop_token_ids holds 256"),
        (SamplingParams(max_tokens=2, forced_token_ids=(-1,)), "forced_token_ids holds -1"),
    ],
)
def test_ids_the_sampler_indexes_with_are_refused_at_admission_when_outside_the_vocabulary(params, named):
    """A stop id past the vocabulary (banned until min_tokens) or a forced id indexes the logits: on a GPU a
    device-side assert that ends the worker and every request on it. The engine refuses the request instead,
    naming the field, and keeps serving."""
    e = engine()
    with pytest.raises(ValueError, match=named):
        e.add_request("bad", [1, 2, 3], params)
    assert e.generate([[1, 2, 3]], GREEDY)[0]  # the engine still serves
