"""The OpenAI API as real clients send it, through the official `openai` client against a real `rackserve up`
(etcd, router, a prefill and a decode worker, disaggregated so the first token comes from the prefill worker
and the rest from the decode worker): every sampling/stopping parameter is honoured end to end, `n` choices
are reproducible, and what is not implemented is refused with a 400 naming it."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from services.engine.model_files import smollm2_gguf_path
from services.engine.tokenizer import Tokenizer
from tests.support.etcd import free_port

MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a short story about a cat."}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--dtype", "float32"]
    cmd += ["--prefill", "1", "--decode", "1", "--mode", "disagg", "--threads", "1", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "rackserve is ready" in line:
            break
    if proc.poll() is not None or not lines or "rackserve is ready" not in lines[-1]:
        proc.kill()
        pytest.fail("rackserve up did not become ready:\n" + "".join(lines[-30:]))
    yield f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def client(url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf_path())


def test_ignore_eos_gives_exactly_max_tokens(client: Any) -> None:
    natural = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=48)
    assert natural.choices[0].finish_reason == "stop" and natural.usage.completion_tokens < 48
    forced = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=48, extra_body={"ignore_eos": True}
    )
    assert forced.usage.completion_tokens == 48
    assert forced.choices[0].finish_reason == "length"
    assert forced.choices[0].message.content.startswith(natural.choices[0].message.content)


def test_min_tokens_holds_back_the_end(client: Any) -> None:
    natural = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=48)
    n = natural.usage.completion_tokens
    longer = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=48, extra_body={"min_tokens": n + 5}
    )
    assert longer.usage.completion_tokens >= n + 5


def test_logit_bias_forces_a_token_on_the_prefill_and_the_decode_worker(client: Any, tok: Tokenizer) -> None:
    [hello] = tok.encode("Hello")
    r = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0.8, seed=1, max_tokens=4, logit_bias={str(hello): 100}
    )
    assert r.choices[0].message.content == "Hello" * 4
    banned = client.chat.completions.create(
        model=MODEL,
        messages=FRANCE,
        temperature=0,
        max_tokens=16,
        logit_bias={str(tok.encode(" Paris")[0]): -100},
    )
    assert "Paris" not in banned.choices[0].message.content


def test_stop_token_ids_and_stop_strings(client: Any, tok: Tokenizer) -> None:
    [paris] = tok.encode(" Paris")
    r = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=32, extra_body={"stop_token_ids": [paris]}
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == "The capital of France is Paris"
    cut = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, stop=[" is"])
    assert cut.choices[0].message.content == "The capital of France"
    kept = client.chat.completions.create(
        model=MODEL,
        messages=FRANCE,
        temperature=0,
        stop=[" is"],
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].message.content == "The capital of France is"


def test_penalties_change_a_repetitive_answer(client: Any) -> None:
    def story(**kw: Any) -> str:
        r = client.chat.completions.create(
            **{"model": MODEL, "messages": STORY, "temperature": 0, "max_tokens": 40, **kw}
        )
        return r.choices[0].message.content

    plain = story()
    assert story(frequency_penalty=1.5) != plain
    assert story(presence_penalty=1.5) != plain
    assert story(extra_body={"repetition_penalty": 1.5}) != plain
    assert story(extra_body={"repetition_penalty": 1.0}, presence_penalty=0) == plain  # neutral values pass
    sampled = dict(temperature=1.0, seed=3, max_tokens=20)
    r1 = client.chat.completions.create(model=MODEL, messages=STORY, extra_body={"top_k": 1}, **sampled)
    assert r1.choices[0].message.content == story(max_tokens=20)[: len(r1.choices[0].message.content)]


def test_n_seeded_choices_are_reproducible_and_streamed_with_their_index(client: Any) -> None:
    kw = dict(model=MODEL, messages=STORY, temperature=1.0, seed=42, max_tokens=16, n=3, logprobs=True)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1
    assert a.usage.completion_tokens == sum(len(c.logprobs.content) for c in a.choices)  # summed
    one = client.chat.completions.create(**{**kw, "n": 1})
    assert one.choices[0].message.content == texts[0]  # choice 0 keeps the request's own seed
    streamed = ["", "", ""]
    usage = None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert streamed == texts
    assert usage is not None and usage.completion_tokens == a.usage.completion_tokens
    assert usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once


def test_best_of_returns_the_most_likely_of_its_candidates(client: Any) -> None:
    kw = dict(model=MODEL, prompt="Once upon a time", temperature=1.0, seed=5, max_tokens=8, logprobs=0)
    candidates = client.completions.create(**kw, n=4)
    best = client.completions.create(**kw, extra_body={"best_of": 4})
    assert len(best.choices) == 1
    scores = {c.text: sum(c.logprobs.token_logprobs) for c in candidates.choices}
    assert best.choices[0].text == max(scores, key=scores.__getitem__)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": {"cat": 1}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ],
)
def test_what_is_not_honoured_is_refused_naming_it(url: str, extra: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 4, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_neutral_values_pass(url: str) -> None:
    body = {
        "model": MODEL, "messages": FRANCE, "max_tokens": 4, "temperature": 0, "n": 1, "repetition_penalty": 1.0,
        "response_format": {"type": "text"}, "tools": None, "tool_choice": None, "top_k": -1, "min_p": 0,
        "logit_bias": None, "presence_penalty": None, "seed": None, "stop": None,
    }  # fmt: skip
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "The capital of France"
