"""The OpenAI API as real clients send it, through the official `openai` client against a real `rackserve up`
(etcd, router, a prefill and a decode worker, disaggregated so the first token comes from the prefill worker
and the rest from the decode worker): every sampling/stopping parameter is honoured end to end, `n` choices
are reproducible, and what is not implemented is refused with a 400 naming it."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from services.engine.model_files import smollm2_gguf_path
from services.engine.tokenizer import Tokenizer
from tests.support.cluster import rackserve_up

MODEL = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a short story about a cat."}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    flags = ("--dtype", "float32", "--prefill", "1", "--decode", "1", "--mode", "disagg", "--threads", "1")
    with rackserve_up(*flags) as (_, base):
        yield base


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

    variants: list[dict[str, Any]] = [
        {},
        {"frequency_penalty": 1.5},
        {"presence_penalty": 1.5},
        {"extra_body": {"repetition_penalty": 1.5}},
        {"extra_body": {"repetition_penalty": 1.0}, "presence_penalty": 0},  # neutral values
        {"extra_body": {"top_k": 1}, "temperature": 1.0, "seed": 3, "max_tokens": 20},  # top_k 1 is greedy
        {"max_tokens": 20},
    ]
    # at once, so the engine batches them (the workers run float32: a batch gives each the tokens it gives alone)
    with ThreadPoolExecutor(len(variants)) as pool:
        plain, frequency, presence, repetition, neutral, top_k_1, greedy_20 = pool.map(
            lambda kw: story(**kw), variants
        )
    assert frequency != plain and presence != plain and repetition != plain
    assert neutral == plain  # neutral values pass
    assert top_k_1 == greedy_20[: len(top_k_1)]


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
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "no spaces", "parameters": {}}}]},
            "tools[0].function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
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


def test_echo_logprobs_equal_a_teacher_forced_forward(client: Any, tok: Tokenizer, hf_model: Any) -> None:
    """What lm-eval's local-completions sends for loglikelihood: echo, logprobs, max_tokens 0 — one logprob
    per prompt token (none for the first), equal to the model's own teacher-forced log-softmax."""
    import torch

    text = "The capital of France is Paris"
    ids = tok.encode(text)
    r = client.completions.create(
        model=MODEL, prompt=text, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    [choice] = r.choices
    assert choice.text == text
    lp = choice.logprobs
    assert lp.tokens == [tok.decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=2e-3)
    assert lp.text_offset == [len(tok.decode(ids[:k])) for k in range(len(ids))]
    # max_tokens=1 generates one more token after the echoed prompt; a batch of token-id prompts works too
    more = client.completions.create(
        model=MODEL, prompt=[ids, ids[:4]], echo=True, logprobs=0, max_tokens=1, temperature=0
    )
    assert [c.index for c in more.choices] == [0, 1]
    assert more.choices[0].text.startswith(text) and len(more.choices[0].logprobs.tokens) == len(ids) + 1
    assert more.choices[0].logprobs.token_logprobs[1 : len(ids)] == pytest.approx(
        lp.token_logprobs[1:], abs=1e-5
    )
    assert more.usage.completion_tokens == 2 and more.usage.prompt_tokens == len(ids) + 4
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=text, echo=True, max_tokens=3, temperature=0, stream=True
        )
    )
    plain = client.completions.create(model=MODEL, prompt=text, max_tokens=3, temperature=0)
    assert streamed == text + plain.choices[0].text


def test_a_batch_of_prompts_with_n(client: Any) -> None:
    r = client.completions.create(
        model=MODEL, prompt=["One, two,", "Red, green,"], n=2, max_tokens=4, temperature=0
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text != r.choices[2].text == r.choices[3].text
    alone = client.completions.create(model=MODEL, prompt="Red, green,", max_tokens=4, temperature=0)
    assert r.choices[2].text == alone.choices[0].text


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def test_json_schema_output_parses_and_validates(client: Any) -> None:
    import json

    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    for seed in (1, 2):
        r = client.chat.completions.create(
            model=MODEL, messages=ask, temperature=1.0, seed=seed, max_tokens=80, response_format=fmt
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    obj = client.chat.completions.create(
        model=MODEL, messages=ask, temperature=0, max_tokens=60, response_format={"type": "json_object"}
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # cut at max_tokens: still a prefix of JSON, opening an object
        assert obj.choices[0].message.content.lstrip().startswith("{")
    pick = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0.8, seed=4, max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["Lyon", "Marseille"]}},
    )  # fmt: skip
    assert pick.choices[0].message.content in ("Lyon", "Marseille")
    digits = client.completions.create(
        model=MODEL,
        prompt="My PIN is",
        max_tokens=10,
        temperature=1.0,
        seed=2,
        extra_body={"guided_regex": "[0-9]{4}"},
    )
    assert len(digits.choices[0].text) == 4 and digits.choices[0].text.isdigit()


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_forced_tool_call_returns_arguments_that_validate(client: Any, url: str, tok: Tokenizer) -> None:
    import json

    import jsonschema

    params = WEATHER["function"]["parameters"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice=named, temperature=0, max_tokens=60
    )
    [call] = r.choices[0].message.tool_calls
    # a named tool_choice ends with "stop", as OpenAI and vLLM answer it; auto and required with "tool_calls"
    assert r.choices[0].finish_reason == "stop" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), params)
    required = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=80,
    )
    calls = required.choices[0].message.tool_calls
    assert calls and required.choices[0].finish_reason == "tool_calls"
    for c in calls:
        assert c.function.name == "get_weather"
        jsonschema.validate(json.loads(c.function.arguments), params)
    # streamed: the call arrives as a tool_calls delta, with the finish reason
    deltas = [
        c.choices[0]
        for c in client.chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice=named, temperature=0, max_tokens=60,
            stream=True,
        )
        if c.choices
    ]  # fmt: skip
    streamed = [tc for d in deltas for tc in d.delta.tool_calls or []]
    assert [tc.function.arguments for tc in streamed] == [call.function.arguments]
    assert deltas[-1].finish_reason == "stop"  # named, as above
    # the call and its result round-trip into the next turn's template
    follow = client.chat.completions.create(
        model=MODEL,
        messages=[
            *ASK_WEATHER,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
        ],
        tools=[WEATHER],
        temperature=0,
        max_tokens=24,
    )
    assert follow.choices[0].finish_reason in ("stop", "length") and follow.choices[0].message.content
    # the tools, the earlier call and its result all reach the prompt (SmolLM2's template renders only the
    # result: the frontend writes the tools and the call, and until 2026-12-07 both were dropped)
    history = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    body = {"model": MODEL, "messages": history, "tools": [WEATHER]}
    seen = httpx.post(f"{url}/tokenize", json=body, timeout=30).json()
    prompt = tok.decode(seen["tokens"])
    assert follow.usage.prompt_tokens == seen["count"]
    assert '"name": "get_weather"' in prompt.split("<|im_start|>user")[0]  # offered, in the system message
    assert "<tool_call>" in prompt.split("<|im_start|>assistant")[1] and '{"temperature": 21}' in prompt


def test_the_sdks_stream_helper_ends_each_streamed_tool_call(client: Any) -> None:
    """`client.chat.completions.stream` (the SDK's helper) emits `tool_calls.function.arguments.done`, with the
    arguments parsed into the tool's model, for a required and a named call: the finish comes in a chunk after
    the calls, as OpenAI sends it (one chunk held both until 2026-12-07, and the helper never ended the call)."""
    import openai
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        city: str = Field(max_length=20)

    for choice in ("required", {"type": "function", "function": {"name": "GetWeather"}}):
        with client.chat.completions.stream(
            model=MODEL, messages=ASK_WEATHER, tools=[openai.pydantic_function_tool(GetWeather)],
            tool_choice=choice, max_completion_tokens=80, temperature=0,
        ) as stream:  # fmt: skip
            events = list(stream)
            final = stream.get_final_completion()
        done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
        [call] = final.choices[0].message.tool_calls
        assert [(e.name, e.parsed_arguments) for e in done] == [
            ("GetWeather", call.function.parsed_arguments)
        ]
        assert isinstance(call.function.parsed_arguments, GetWeather), choice
        assert final.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop")


def test_tokenize_detokenize_and_version(url: str, tok: Tokenizer) -> None:
    r = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}, timeout=30)
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode("Hello world")
    assert r.json()["count"] == len(r.json()["tokens"]) and r.json()["max_model_len"] > 0
    chat = httpx.post(f"{url}/tokenize", json={"messages": FRANCE}, timeout=30).json()
    assert chat["tokens"] == tok.encode_chat(FRANCE)
    back = httpx.post(f"{url}/detokenize", json={"tokens": chat["tokens"]}, timeout=30).json()
    assert back["prompt"] == tok.decode(chat["tokens"])
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10**8]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.get(f"{url}/version", timeout=30).json()["version"]
