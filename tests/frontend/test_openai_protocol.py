"""The OpenAI edge's pure parts, without a cluster: tool-call parsing in both styles, the request models'
refusals and neutral values, and multi-part content."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from services.frontend.output import content_before_calls, parse_tool_calls
from services.frontend.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, StructuredError

MSGS = [{"role": "user", "content": "hi"}]


def test_hermes_tool_calls_are_parsed_with_the_text_around_them() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text += '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text, "auto")
    assert content == "Let me check.\n"  # the text around the blocks as it is: what a stream of it sends
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert (
        parse_tool_calls("\n " + text.removeprefix("Let me check.\n"), "auto")[0] is None
    )  # only whitespace


def test_llama3_json_tool_calls_are_parsed() -> None:
    content, calls = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {"x": 1}}', "auto")
    assert content is None and [(n, json.loads(a)) for n, a in calls] == [("f", {"x": 1})]
    _, two = parse_tool_calls(
        '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"y": 2}}', "auto"
    )
    assert [n for n, _ in two] == ["f", "g"]
    # a ";" inside an argument separates nothing (it split the call into two broken halves until 2026-12-07)
    _, semi = parse_tool_calls(
        '{"name": "f", "parameters": {"q": "a;b"}}; {"name": "g", "parameters": {}}', "auto"
    )
    assert [(n, json.loads(a)) for n, a in semi] == [("f", {"q": "a;b"}), ("g", {})]
    assert parse_tool_calls('{"name": "f", "parameters": {}} and more', "auto")[1] == []


def test_plain_text_and_broken_json_stay_content() -> None:
    assert parse_tool_calls("Paris is sunny.", "auto") == ("Paris is sunny.", [])
    assert parse_tool_calls('{"name": 3}', "auto") == ('{"name": 3}', [])
    assert parse_tool_calls("<tool_call>{not json</tool_call>", "auto")[1] == []


def test_only_calls_of_offered_tools_are_calls() -> None:
    offered = {"get_weather"}
    assert parse_tool_calls('{"name": "Bob", "age": 3}', "auto", offered) == ('{"name": "Bob", "age": 3}', [])
    hermes = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse_tool_calls(hermes, "auto", offered) == (hermes, [])
    mixed = '{"name": "get_weather", "parameters": {}}; {"name": "rm_rf", "parameters": {}}'
    assert parse_tool_calls(mixed, "auto", offered) == (mixed, [])
    assert parse_tool_calls('{"name": "get_weather", "parameters": {"c": 1}}', "auto", offered) == (
        None,
        [("get_weather", '{"c": 1}')],
    )


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("", 0), ("   ", 0), (" {", 0), ("<|py", 0), ("<|python_tag|>{", 0),  # may still be a JSON call
        ("  <tool_call>{", 0), ("\n\n<tool", 0),  # only whitespace before a call: maybe no content at all
        ("Sure", 4), ("Sure <tool", 5), ("Sure <tool_call>{", 5), ("Sure <tool_call>{}</tool_call> ok", 5),
        ("<", 0), ("a < b", 5),
    ],
)  # fmt: skip
def test_content_before_calls_holds_only_what_could_be_a_call(text: str, content: int) -> None:
    assert content_before_calls(text) == content


def test_forced_and_required_outputs_become_calls() -> None:
    assert parse_tool_calls(' {"city": "Rome"} ', "function:get_weather") == (
        None,
        [("get_weather", '{"city": "Rome"}')],
    )
    _, calls = parse_tool_calls('[{"name": "a", "parameters": {"k": 1}}]', "required")
    assert calls == [("a", '{"k": 1}')]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"use_beam_search": True}, "use_beam_search"),
        ({"bad_words": ["x"]}, "bad_words"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"chat_template": "{{ x }}"}, "chat_template"),
    ],
)  # fmt: skip
def test_unimplemented_or_inconsistent_parameters_are_refused(extra: dict, param: str) -> None:
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"model": "m", "messages": MSGS, **extra})
    assert any(param in str(err["loc"]) or param in err["msg"] for err in e.value.errors())


def test_neutral_values_validate() -> None:
    ChatCompletionRequest.model_validate(
        {"model": "m", "messages": MSGS, "use_beam_search": False, "length_penalty": 1.0, "bad_words": [],
         "spaces_between_special_tokens": True, "tools": [], "tool_choice": "none", "n": 1, "modalities": ["text"]}
    )  # fmt: skip
    CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "suffix": None, "echo": False, "best_of": 1}
    )


def test_neutral_values_vllm_lets_pass_pass() -> None:
    """top_logprobs 0 asks for nothing and an empty stream_options sets nothing: vLLM lets both pass without
    logprobs / stream, and so does rackserve (1 and include_usage are refused: test_frontend)."""
    ChatCompletionRequest.model_validate({"model": "m", "messages": MSGS, "top_logprobs": 0})
    ChatCompletionRequest.model_validate({"model": "m", "messages": MSGS, "stream_options": {}})
    for extra in ({"top_logprobs": 1}, {"stream_options": {"include_usage": False}}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({"model": "m", "messages": MSGS, **extra})


def test_required_tool_choice_lifts_both_kinds_of_definitions_and_refuses_malformed_ones() -> None:
    def body(**params: Any) -> ChatCompletionRequest:
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", **params}}}
        return ChatCompletionRequest.model_validate(
            {"model": "m", "messages": MSGS, "tools": [tool], "tool_choice": "required"}
        )

    schema = body(
        **{"$defs": {"A": {"type": "string"}}, "definitions": {"B": {"type": "integer"}}}
    ).tool_schema()
    assert schema is not None and schema["$defs"] == {"A": {"type": "string"}}
    assert schema["definitions"] == {"B": {"type": "integer"}}
    params = schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" not in params and "definitions" not in params
    for bad in ([1], "x", 5):  # a 500 (AttributeError) before 2026-12-07's fix of e5db465
        with pytest.raises(StructuredError) as e:
            body(**{"$defs": bad}).tool_schema()
        assert e.value.param == "tools"


def test_multi_part_text_is_joined_with_newlines_as_vllm_does() -> None:
    m = ChatMessage.model_validate(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    )
    assert m.as_template_input() == {"role": "user", "content": "a\nb"}


def test_two_constraints_are_refused_naming_the_second() -> None:
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": MSGS, "response_format": {"type": "json_object"}, "guided_regex": "a+"}
    )
    with pytest.raises(ValueError, match="guided_regex"):
        body.structured()


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": "required"},  # with no tools
        {"tools": [{"type": "function", "function": {"name": "f"}}],
         "tool_choice": {"type": "function", "function": {"name": "g"}}},
    ],
)  # fmt: skip
def test_a_tool_choice_the_tools_cannot_meet_is_refused_naming_it(extra: dict) -> None:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": MSGS, **extra})
    with pytest.raises(StructuredError) as e:
        body.check_tools()
    assert e.value.param == "tool_choice"


def test_an_assistant_turn_of_the_older_functions_api_is_its_call() -> None:
    """OpenAI asks an assistant message for content "unless tool_calls or function_call is specified": a history
    from the older functions API (content null, a function_call) is its one call in the prompt, not a 400."""
    legacy = ChatMessage.model_validate(
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    )
    assert legacy.as_template_input()["tool_calls"] == [
        {"id": "call_get_weather", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]  # fmt: skip
    with pytest.raises(ValueError, match="needs content, tool_calls or function_call"):
        ChatMessage.model_validate({"role": "assistant", "content": None})
