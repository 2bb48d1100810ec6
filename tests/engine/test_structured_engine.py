"""Constrained decoding in the engine on the real demo model (SmolLM2-135M), where it meets other parameters."""

from __future__ import annotations

import json

import pytest

from services.engine.engine import EngineConfig, LLMEngine
from services.engine.loader import LoadedModel
from services.engine.sampling import SamplingParams
from services.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def engine(smollm2: LoadedModel, gguf_path: str) -> LLMEngine:
    return LLMEngine(
        smollm2, EngineConfig(dtype="float32", num_kv_blocks=64), tokenizer=Tokenizer.from_gguf(gguf_path)
    )


def run(e: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], str | None]:
    rid = f"r{id(params)}"
    e.add_request(rid, prompt, params)
    out: list[int] = []
    reason = None
    while e.has_unfinished():
        for o in e.step():
            out += o.new_token_ids
            reason = o.finish_reason or reason
    return out, reason


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_min_tokens_past_a_complete_grammar_ends_as_without_it(engine: LLMEngine, temperature: float) -> None:
    """min_tokens holds end-of-sequence back; a choice grammar that is complete allows nothing else. Until
    2026-12-07 that left a row of -inf: greedy took token 0 whatever it was (here <|endoftext|>, not the
    <|im_end|> the model gives), a draw the vocabulary's last token, outside the grammar, again and again. The
    grammar wins: the same choice and the same end as without min_tokens."""
    tok = engine.tokenizer
    assert tok is not None
    prompt = tok.encode_chat([{"role": "user", "content": "Answer yes or no: is the sky blue?"}])
    choice = {"structured_kind": "choice", "structured_spec": json.dumps(["yes", "no"])}
    held = SamplingParams(max_tokens=10, min_tokens=4, temperature=temperature, seed=1, **choice)
    free = SamplingParams(max_tokens=10, temperature=temperature, seed=1, **choice)
    out, reason = run(engine, prompt, held)
    assert (out, reason) == run(engine, prompt, free), tok.decode(out)
    assert tok.decode(out) in ("yes<|im_end|>", "no<|im_end|>")


def test_an_echoed_prompt_taught_token_by_token_meets_the_grammar_only_after_it(engine: LLMEngine) -> None:
    """Echo with logprobs forces the prompt as the first outputs: those are the prompt's, and the grammar starts
    after them (until 2026-12-07 they were fed to it: refused, ignored, and its state was not the one the
    completion should start from). The completion equals the same request's without echo."""
    tok = engine.tokenizer
    assert tok is not None
    # the prompt holds a token the grammar takes at its start ("maybe", the user's first word): fed to it, it
    # would move the grammar on to " so"
    prompt = tok.encode_chat([{"role": "user", "content": "maybe: is the sky blue? Answer yes or no."}])
    choice = {"structured_kind": "choice", "structured_spec": json.dumps(["yes", "no", "maybe so"])}
    for temperature in (0.0, 1.0):
        plain = SamplingParams(max_tokens=8, temperature=temperature, seed=5, **choice)
        taught = SamplingParams(
            max_tokens=8 + len(prompt) - 1, temperature=temperature, seed=5, forced_token_ids=tuple(prompt[1:]),
            **choice,
        )  # fmt: skip
        out, reason = run(engine, prompt[:1], taught)
        assert out[: len(prompt) - 1] == prompt[1:]
        assert (out[len(prompt) - 1 :], reason) == run(engine, prompt, plain)
