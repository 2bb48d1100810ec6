"""Workloads: the requests a run sends, with their arrival times — the same list feeds the load generator and the
simulator.

A `RequestSpec` carries its prompt either as token ids (sent to /v1/completions; exact lengths, real prefix
sharing) or as chat messages made of real text (sent to /v1/chat/completions). Generators:
  synthetic   fixed or uniform prompt/output lengths, token-id prompts, an optional shared prefix
  text        real-text chat prompts with a shared system prompt and multi-turn sessions (a later turn repeats the
              earlier turns, so its prefix is reusable)
  mooncake    replay of the Mooncake FAST'25 trace (see trace.py)
Arrivals: `poisson_arrivals` for an open loop at a rate; trace workloads carry their own timestamps; a closed loop
ignores arrival times.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

# Token ids drawn for synthetic prompts: inside every Llama-family vocabulary and clear of the special tokens
# that sit at the start (SmolLM2's are 0-16).
TOKEN_LO, TOKEN_HI = 1000, 30000


@dataclass
class RequestSpec:
    request_id: str
    input_tokens: int
    output_tokens: int
    arrival_s: float = 0.0
    token_ids: list[int] | None = None  # a /v1/completions prompt
    messages: list[dict[str, str]] | None = None  # a /v1/chat/completions prompt
    tags: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Lengths:
    """`fixed:N` or `uniform:LO:HI` (inclusive)."""

    lo: int
    hi: int

    @staticmethod
    def parse(text: str) -> Lengths:
        kind, _, rest = text.partition(":")
        try:
            if kind == "fixed":
                n = int(rest)
                out = Lengths(n, n)
            elif kind == "uniform":
                lo, hi = (int(x) for x in rest.split(":"))
                out = Lengths(lo, hi)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"a length is 'fixed:N' or 'uniform:LO:HI', got {text!r}") from None
        if out.lo < 1 or out.hi < out.lo:
            raise ValueError(f"lengths must satisfy 1 <= LO <= HI, got {text!r}")
        return out

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)


def poisson_arrivals(specs: list[RequestSpec], rate_per_s: float, seed: int) -> list[RequestSpec]:
    """Exponential gaps at `rate_per_s` (an open loop), in list order."""
    if rate_per_s <= 0:
        raise ValueError(f"--rate must be positive, got {rate_per_s}")
    rng = random.Random(seed ^ 0x5EED)
    t = 0.0
    for s in specs:
        s.arrival_s = t
        t += rng.expovariate(rate_per_s)
    return specs


def synthetic(
    n: int,
    input_len: Lengths,
    output_len: Lengths,
    seed: int,
    shared_prefix_tokens: int = 0,
    prefix_groups: int = 1,
) -> list[RequestSpec]:
    """Token-id prompts of the given lengths. With `shared_prefix_tokens`, request i opens with prefix
    i % prefix_groups (e.g. 8 system prompts shared by many users); the rest of each prompt is its own."""
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(shared_prefix_tokens)]
        for _ in range(max(1, prefix_groups))
    ]
    specs = []
    for i in range(n):
        prefix = prefixes[i % len(prefixes)]
        n_in = max(input_len.draw(rng), shared_prefix_tokens + 1)
        ids = prefix + [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n_in - len(prefix))]
        specs.append(
            RequestSpec(
                f"syn-{i}", n_in, output_len.draw(rng), token_ids=ids, tags={"prefix": str(i % len(prefixes))}
            )
        )
    return specs


def _corpus_words() -> list[str]:
    with open(os.path.join(os.path.dirname(__file__), "corpus.txt")) as f:
        return f.read().split()


WORDS_PER_TOKEN = 0.75  # English prose runs about 1.3 tokens a word for Llama-family tokenizers


def _text(rng: random.Random, words: list[str], tokens: int) -> str:
    n = max(1, int(tokens * WORDS_PER_TOKEN))
    start = rng.randrange(len(words))
    return " ".join(words[(start + k) % len(words)] for k in range(n))


def text_sessions(
    sessions: int,
    turns: int,
    user_len: Lengths,
    output_len: Lengths,
    seed: int,
    system_prompt_tokens: int = 200,
    system_prompts: int = 1,
) -> list[RequestSpec]:
    """Real-text chat: `sessions` conversations of `turns` turns; every conversation opens with one of
    `system_prompts` shared system prompts, and turn k repeats turns 1..k-1 (with a stand-in assistant answer of
    the requested output length), so both the system prompt and the conversation so far are reusable prefixes.
    Token counts are estimates (about 1.3 tokens a word); the report uses the server's counts when it sends them."""
    rng = random.Random(seed)
    words = _corpus_words()
    systems = [_text(rng, words, system_prompt_tokens) for _ in range(system_prompts)]
    specs = []
    for s in range(sessions):
        history: list[dict[str, str]] = [{"role": "system", "content": systems[s % system_prompts]}]
        n_tokens = system_prompt_tokens
        for t in range(turns):
            n_user, n_out = user_len.draw(rng), output_len.draw(rng)
            history = history + [{"role": "user", "content": _text(rng, words, n_user)}]
            n_tokens += n_user
            specs.append(
                RequestSpec(
                    f"chat-{s}-{t}", n_tokens, n_out, messages=list(history), tags={"session": str(s)}
                )
            )
            history = history + [{"role": "assistant", "content": _text(rng, words, n_out)}]
            n_tokens += n_out
    # interleave sessions turn by turn, as concurrent users would
    specs.sort(key=lambda r: (int(r.request_id.split("-")[2]), int(r.request_id.split("-")[1])))
    return specs
