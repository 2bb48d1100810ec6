"""Sampling parameters and the batched sampler.

The contract that recovery relies on: the token chosen at output index i depends only on (seed, i, the logits
after the request's own processors, the tokens emitted so far). There is no RNG state carried from step to
step — each draw takes its one uniform from a hash of (seed, i) — and every processor (penalties, logit_bias, the
grammar's bitmask) is a function of the prompt and the emitted tokens, so a request resumed on another worker
with its emitted tokens continues with the same tokens.

Everything here runs as batched tensor ops on `logits.device` (no per-row host sync): the processors, one
argmax over the batch, and a single device→host copy at the end.

Processor order (vLLM's): logit_bias, the min_tokens ban on end-of-sequence, repetition / frequency /
presence penalties, the grammar bitmask; then, for sampled rows, temperature, min_p, top_k, top_p, and the
seeded inverse-CDF draw. Logprobs are of the raw logits (vLLM's default), before any processor.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from services.engine.device import host_tensor_to_device, host_to_device

_MASK64 = (1 << 64) - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value
MAX_PENALTY = 2.0  # OpenAI's range for presence/frequency penalties: [-2, 2]


def draw_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): decorrelated per-index seeds from one request seed."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & 0x7FFF_FFFF_FFFF_FFFF


# A temperature this small samples the argmax anyway, and dividing logits by it overflows to inf (then NaN
# probabilities, and the draw picked the vocabulary's last token: 1e-38 did, until 2026-12-07). vLLM's
# threshold (_SAMPLING_EPS).
GREEDY_BELOW = 1e-5
# A repetition penalty near 0 (or huge) divides (multiplies) a logit past float32's range: inf, then NaN
# probabilities, and the draw picked the vocabulary's last token (until 2026-12-07). A penalised logit is kept
# within this bound instead, small enough that a division by any temperature that samples stays finite.
LOGIT_BOUND = 1e30


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # below GREEDY_BELOW (0 included) → greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 → off
    min_p: float = 0.0  # 0 → off; else drop tokens whose probability is below min_p × the top one's
    seed: int | None = None  # None → the engine draws one and records it on the request
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None → none; 0 → chosen token only; n → chosen + top n
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt+output tokens
    logit_bias: tuple[tuple[int, float], ...] = field(default=())  # (token id, bias added to its logit)
    # Teacher forcing: output index i < len(forced_token_ids) is forced_token_ids[i], whatever the logits say,
    # with its logprob read from the raw logits (the prompt logprobs of `echo`); no stop condition applies.
    forced_token_ids: tuple[int, ...] = ()
    # Constrained decoding (services/engine/structured.py): json_schema | json_object | regex | choice | grammar
    structured_kind: str = ""
    structured_spec: str = ""  # the schema (JSON text), regex, choices (a JSON list of strings) or EBNF

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (-MAX_PENALTY <= v <= MAX_PENALTY):
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {v}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        self.stop_token_ids = tuple(self.stop_token_ids)
        self.forced_token_ids = tuple(self.forced_token_ids)
        if self.structured_kind not in ("", "json_schema", "json_object", "regex", "choice", "grammar"):
            raise ValueError(f"structured_kind {self.structured_kind!r} is not a grammar kind")
        self.logit_bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        for t, b in self.logit_bias:
            if not (-MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias[{t}] must be in [-100, 100], got {b}")
            if t < 0:
                raise ValueError(f"logit_bias: token id {t} is negative")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def with_seed(self) -> SamplingParams:
        if self.seed is not None:
            return self
        return SamplingParams(**{**self.__dict__, "seed": random.getrandbits(63)})


@dataclass
class Sampled:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class RowContext:
    """What a row's processors read besides its logits: the prompt, the tokens emitted so far, the token ids
    it may not end on yet (min_tokens) and the grammar's packed bitmask of allowed tokens."""

    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    banned: Sequence[int] = ()
    bitmask: torch.Tensor | None = None  # int32 [ceil(vocab / 32)]: bit j of word w allows token 32w + j


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [..., vocab] from int32 [..., ceil(vocab / 32)] words (xgrammar's layout: little-endian bits)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :vocab].bool()


def apply_processors(
    logits: torch.Tensor, params: Sequence[SamplingParams], rows: Sequence[RowContext]
) -> torch.Tensor:
    """The logits after each row's own processors (a new float32 tensor; `logits` is not changed)."""
    x = logits.float().clone(memory_format=torch.contiguous_format)  # the CPU penalties view it flat
    dev, vocab = x.device, x.shape[1]
    # logit_bias and the min_tokens ban: one sparse scatter each
    bias = [(r, t, b) for r, p in enumerate(params) for t, b in p.logit_bias if t < vocab]
    if bias:
        br, bc, bv = zip(*bias, strict=True)
        idx = (host_to_device(br, torch.long, dev), host_to_device(bc, torch.long, dev))
        x.index_put_(idx, host_to_device(bv, x.dtype, dev), accumulate=True)
    nr = [r for r, c in enumerate(rows) for _ in c.banned]
    if nr:
        nc = [t for c in rows for t in c.banned]
        idx = (host_to_device(nr, torch.long, dev), host_to_device(nc, torch.long, dev))
        x.index_put_(idx, x.new_full((len(nr),), -math.inf))  # a device value: a CPU scalar would sync
    pen = [r for r, p in enumerate(params) if p.penalised]
    if pen and dev.type == "cpu":
        _penalise_seen(x, pen, params, rows)
    elif pen:
        at = host_to_device(pen, torch.long, dev)
        x[at] = _penalise(x[at], [params[r] for r in pen], [rows[r] for r in pen])
    masked = [r for r, c in enumerate(rows) if c.bitmask is not None]
    if masked:
        # queued from pinned memory: from ordinary memory the copy would wait for the GPU
        words = host_tensor_to_device(torch.stack([rows[r].bitmask for r in masked]), dev)  # type: ignore[misc]
        allowed = unpack_bitmask(words, vocab)
        at = host_to_device(masked, torch.long, dev)
        x[at] = x[at].masked_fill(~allowed, -math.inf)
    return x


def _penalise(x: torch.Tensor, params: Sequence[SamplingParams], rows: Sequence[RowContext]) -> torch.Tensor:
    """vLLM's (and HF's) definitions, batched: counts of output tokens and a prompt mask by scatter."""
    dev, (batch, vocab) = x.device, x.shape
    out_r, out_c = _flat([c.output_ids for c in rows], dev)
    counts = torch.zeros(batch, vocab, device=dev, dtype=x.dtype)
    if len(out_r):
        ones = torch.ones(len(out_r), device=dev, dtype=x.dtype)
        counts.index_put_((out_r, out_c), ones, True)
    if any(p.repetition_penalty != 1 for p in params):
        rep = host_to_device([p.repetition_penalty for p in params], x.dtype, dev)[:, None]
        seen = counts > 0
        pr, pc = _flat([c.prompt_ids for c in rows], dev)
        if len(pr):
            ones = torch.ones(len(pr), dtype=torch.bool, device=dev)  # a device value: True would sync
            seen.index_put_((pr, pc), ones)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep).clamp(-LOGIT_BOUND, LOGIT_BOUND), x)
    freq = host_to_device([p.frequency_penalty for p in params], x.dtype, dev)[:, None]
    pres = host_to_device([p.presence_penalty for p in params], x.dtype, dev)[:, None]
    return x - freq * counts - pres * (counts > 0).to(x.dtype)


def _penalise_seen(
    x: torch.Tensor, pen: Sequence[int], params: Sequence[SamplingParams], rows: Sequence[RowContext]
) -> None:
    """_penalise's arithmetic in place on a CPU, on the logits of the tokens each penalised row has seen, and on
    no other: every other logit of those rows is x - 0 - 0 = x there (the same values; the dense form turns a
    -0.0 into +0.0 under a negative penalty, which no sampler step can tell apart). The dense form (a [rows,
    vocab] float count matrix, a seen mask, whole-row passes of torch ops) took ~40-85 ms at 64 rows of 49,152
    logits on one thread, whatever the context; here numpy counts the seen (row, token) pairs (bincount over
    i * vocab + token, i the row's place among the penalised ones) and torch changes just those."""
    vocab = x.shape[1]
    rep = [params[r].repetition_penalty for r in pen]
    repeats = any(v != 1 for v in rep)
    counts = np.bincount(_keys([rows[r].output_ids for r in pen], vocab), minlength=len(pen) * vocab)
    if repeats:  # repetition_penalty also reaches the prompt's tokens
        seen = counts > 0
        seen[_keys([rows[r].prompt_ids for r in pen], vocab)] = True
        keys = np.flatnonzero(seen)
    else:
        keys = np.flatnonzero(counts)
    if not len(keys):
        return
    place = keys // vocab  # each pair's row among the penalised ones
    at = torch.from_numpy(np.asarray(pen, dtype=np.int64)[place] * vocab + keys % vocab)
    place_t = torch.from_numpy(place)

    def per_row(values: list[float]) -> torch.Tensor:  # each pair's own row's value, in x's dtype
        return torch.tensor(values, dtype=x.dtype)[place_t]

    flat = x.view(-1)
    v = flat[at]
    n = torch.from_numpy(counts[keys]).to(x.dtype)
    if repeats:
        r = per_row(rep)
        v = torch.where(v > 0, v / r, v * r).clamp(-LOGIT_BOUND, LOGIT_BOUND)
    freq = per_row([params[r].frequency_penalty for r in pen])
    pres = per_row([params[r].presence_penalty for r in pen])
    flat[at] = v - freq * n - pres * (n > 0).to(x.dtype)


def _keys(ids: Sequence[Sequence[int]], vocab: int) -> np.ndarray:
    """i * vocab + token for every token of ids[i]."""
    r, c = _flat_np(ids, vocab)
    return r * vocab + c


def _flat_np(ids: Sequence[Sequence[int]], vocab: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Rows' token ids as (row index, token id) int64 arrays, built in numpy: a Python loop over every prompt and
    output token of the batch took 37 ms a step at 64 rows of 2,048 + 1,024 tokens (numpy: 4 ms). With `vocab`,
    an id outside it raises (the admission check is the one that names it to a client)."""
    lens = [len(t) for t in ids]
    if not sum(lens):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    rows = np.repeat(np.arange(len(ids), dtype=np.int64), lens)
    cols = np.concatenate([np.asarray(t, dtype=np.int64) for t in ids if len(t)])
    if vocab is not None and (cols.min() < 0 or cols.max() >= vocab):
        raise IndexError(f"a penalised row holds a token id outside the vocabulary (size {vocab})")
    return rows, cols


def _flat(ids: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' token ids as (row index, token id) int64 tensors on `device` (_flat_np)."""
    rows, cols = _flat_np(ids)
    return host_tensor_to_device(torch.from_numpy(rows), device), host_tensor_to_device(
        torch.from_numpy(cols), device
    )


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """First index of each row's maximum. On the CPU through numpy: torch's CPU argmax over [batch, vocab]
    float32 is ~15x slower (~0.9 ms vs 0.05 ms at batch 8, vocab 49152), a visible slice of a decode step."""
    if x.device.type == "cpu":
        return torch.from_numpy(x.numpy().argmax(axis=1))
    return x.argmax(dim=1)


def _sample_rows(x: torch.Tensor, params: Sequence[SamplingParams], indices: Sequence[int]) -> torch.Tensor:
    """The seeded draw for non-greedy rows of processed logits x [rows, vocab]."""
    dev, vocab = x.device, x.shape[1]
    temp = host_to_device([p.temperature for p in params], x.dtype, dev)[:, None]
    x = x / temp
    if any(p.min_p > 0 for p in params):
        probs = torch.softmax(x, -1)
        min_p = host_to_device([p.min_p for p in params], x.dtype, dev)[:, None]
        x = x.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), -math.inf)
    if any(0 < p.top_k < vocab for p in params):
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        k = host_to_device(ks, torch.long, dev)
        # the k-th largest value per row: topk of the largest k asked (not a sort of the whole vocabulary)
        kth = torch.topk(x, max(ks), dim=-1).values.gather(1, (k - 1)[:, None])
        x = x.masked_fill(x < kth, -math.inf)
    if any(p.top_p < 1.0 for p in params):
        top_p = host_to_device([p.top_p if p.top_p < 1 else 2.0 for p in params], x.dtype, dev)
        x = _top_p(x, top_p)
    probs = torch.softmax(x, -1)
    # inverse CDF: one uniform per row, the top 53 bits of draw_seed(seed, index), made on the host (the same on
    # every device); the token is the first whose cumulative probability passes u x the row's total. A token of
    # probability 0 (masked) adds nothing to the sum, so it is never the first to pass. One cumsum instead of a
    # seeded generator and `vocab` exponentials per row (62 ms of a 175 ms batch-64 step on one CPU thread)
    u = []
    for p, i in zip(params, indices, strict=True):
        assert p.seed is not None, "the engine assigns a seed before sampling"
        u.append((draw_seed(p.seed, i) >> 10) * 2.0**-53)
    cdf = probs.cumsum_(-1)
    total = cdf[:, -1:]
    target = host_to_device(u, cdf.dtype, dev)[:, None] * total
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u within 2^-25 of 1 is 1.0 in float32 (about one draw in 30 million), and u x total can round up to the total
    # itself: nothing passes it, and the search runs off the end, onto the vocabulary's last token, masked or not.
    # The first token whose cumulative sum reaches the total is the last one with any probability: never past it.
    last = (cdf < total).sum(-1)
    return torch.minimum(drawn, last)


TOP_P_CANDIDATES = 1024  # on a CPU the nucleus is looked for among a row's most probable tokens first


def _top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x with every token outside its row's nucleus at -inf: the smallest set of most probable tokens whose mass
    reaches the row's top_p (2.0: the whole row). On a GPU, one sort of the vocabulary. On a CPU, where that sort
    was most of a sampled step (230 ms of it at 64 rows of 49,152 logits on one thread), the nucleus is found
    among each row's TOP_P_CANDIDATES most probable tokens, the same set wherever it lies within them, and rows
    whose nucleus is larger (or that keep everything) are sorted whole."""
    if x.device.type == "cpu" and x.shape[1] > TOP_P_CANDIDATES:
        vals, idx = torch.topk(x, TOP_P_CANDIDATES, dim=-1)  # sorted, most probable first
        p = torch.exp(vals - torch.logsumexp(x, -1, keepdim=True))
        found = p.sum(-1) >= top_p  # the nucleus ends within the candidates
        if bool(found.any()):
            keep = p.cumsum(-1) - p < top_p[:, None]
            out = torch.full_like(x, -math.inf).scatter_(1, idx, vals.masked_fill(~keep, -math.inf))
            if not bool(found.all()):
                rest = (~found).nonzero().squeeze(1)
                out[rest] = _sorted_top_p(x[rest], top_p[rest])
            return out
    return _sorted_top_p(x, top_p)


def _sorted_top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_x, order = torch.sort(x, -1, descending=True)
    sm = torch.softmax(sorted_x, -1)
    drop = sm.cumsum(-1) - sm >= top_p[:, None]  # keep the smallest set reaching top_p
    return x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), -math.inf)


def worst_case_batch(rows: int, vocab: int) -> tuple[list[SamplingParams], list[int], list[RowContext]]:
    """A batch that makes sample_batch use the most memory per row: every processor (penalties over prompt and
    output, a logit bias, a grammar's bitmask), temperature with top-k, top-p and min-p, 20 logprobs. A GPU
    engine samples it once when it profiles its peak, so the KV plan leaves the sampler what it really takes."""
    params = SamplingParams(
        max_tokens=2, temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=1, logprobs=20,
        presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, logit_bias=((0, 1.0),),
    )  # fmt: skip
    allowed = torch.full((-(-vocab // 32),), -1, dtype=torch.int32)  # every token allowed
    context = RowContext(prompt_ids=list(range(16)), output_ids=list(range(16)), banned=[0], bitmask=allowed)
    forced = dataclasses.replace(params, forced_token_ids=(1, 1))  # one row teacher-forced (echo)
    return [forced] + [params] * (rows - 1), [1] * rows, [context] * rows


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    indices: Sequence[int],
    rows: Sequence[RowContext] | None = None,
) -> list[Sampled]:
    """Choose each row's token at output index `indices[r]` from float logits [batch, vocab]."""
    rows = rows if rows is not None else [RowContext()] * len(params)
    plain = all(
        not p.logit_bias and not p.penalised and not c.banned and c.bitmask is None
        for p, c in zip(params, rows, strict=True)
    )
    x = logits.float() if plain else apply_processors(logits, params, rows)
    tokens = _argmax(x).to(x.device)
    drawn = [r for r, p in enumerate(params) if not p.greedy]
    if drawn:
        at = host_to_device(drawn, torch.long, x.device)
        # forced tokens are the prompt (echo's teacher forcing): the first draw after them is draw 0, as it is
        # for the same request not forced
        picked = _sample_rows(
            x[at], [params[r] for r in drawn], [indices[r] - len(params[r].forced_token_ids) for r in drawn]
        )
        tokens[at] = picked.to(tokens.device)
    forced = [
        (r, p.forced_token_ids[indices[r]])
        for r, p in enumerate(params)
        if indices[r] < len(p.forced_token_ids)
    ]
    if forced:
        fr, ft = zip(*forced, strict=True)
        tokens[host_to_device(fr, torch.long, tokens.device)] = host_to_device(
            ft, tokens.dtype, tokens.device
        )
    k = max((p.logprobs for p in params if p.logprobs is not None), default=None)
    if k is None:
        return [Sampled(int(t)) for t in tokens.tolist()]
    # one device→host copy: [token, its logprob, top-k ids, top-k logprobs] per row (ids < 2^24 are exact)
    lp = torch.log_softmax(logits.float(), -1)
    chosen = lp.gather(1, tokens[:, None])
    top_v, top_i = torch.topk(lp, k, dim=-1) if k else (lp[:, :0], tokens[:, None][:, :0])
    packed = torch.cat(
        [tokens[:, None].double(), chosen.double(), top_i.double(), top_v.double()], 1
    ).tolist()
    out = []
    for p, row in zip(params, packed, strict=True):
        token = int(row[0])
        if p.logprobs is None:
            out.append(Sampled(token))
            continue
        n = p.logprobs
        top = [(int(a), float(b)) for a, b in zip(row[2 : 2 + n], row[2 + k : 2 + k + n], strict=True)]
        out.append(Sampled(token, float(row[1]), top or None))
    return out
