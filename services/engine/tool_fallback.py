"""Tools for chat templates that have no place for them.

A model's chat template decides how offered tools and an assistant's earlier calls appear in the prompt. Many
small models' templates (SmolLM2's among them) render neither: the tools and the calls vanish, and a request
that offers tools becomes, silently, a chat without them. Where the template renders a request the same with
them as without them (`Tokenizer.apply_chat_template` renders it both ways), the prompt says what the template
would not, in the Hermes format — the one the frontend's `auto` parser reads back
(`services/frontend/output.py: parse_tool_calls`):

- the tools, as JSON lines inside `<tools></tools>` with how to call them, at the end of the first system
  message (a system message of their own first, if the chat has none);
- each earlier call, as a `<tool_call>{"name": …, "arguments": …}</tool_call>` block after the assistant's text.

Tool results (`role: "tool"`) are left to the template. Plain data in, plain data out: this module renders
nothing and knows no tokenizer.
"""

from __future__ import annotations

import json
from typing import Any

_TOOLS_INTRO = (
    "# Tools\n\n"
    "You can call the functions below to help answer. Their signatures, one JSON object per line, are within "
    "<tools></tools> tags:\n<tools>\n"
)
_TOOLS_OUTRO = (
    "\n</tools>\n\n"
    "To call functions, answer with one <tool_call></tool_call> block per call, each holding a JSON object with "
    'the function\'s name and its arguments:\n<tool_call>\n{"name": <function name>, "arguments": <arguments '
    "object>}\n</tool_call>"
)


def tools_text(tools: list[dict[str, Any]]) -> str:
    """The system message's tools section."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return _TOOLS_INTRO + lines + _TOOLS_OUTRO


def call_text(call: dict[str, Any]) -> str:
    """One earlier call as the block the model would have written. Its arguments are an object (the frontend
    parses them, as HF templates expect) or, when they were not JSON, the text as sent."""
    function = call.get("function", {})
    body = {"name": function.get("name"), "arguments": function.get("arguments", {})}
    return "<tool_call>\n" + json.dumps(body, ensure_ascii=False) + "\n</tool_call>"


def with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with the tools section at the end of the first system message, or in a new one first."""
    section = tools_text(tools)
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        text = out[0].get("content") or ""
        out[0]["content"] = f"{text}\n\n{section}" if text else section
        return out
    return [{"role": "system", "content": section}, *out]


def with_calls_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each assistant's `tool_calls` written after its text (and the key dropped)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls:
            out.append(message)
            continue
        rest = {k: v for k, v in message.items() if k != "tool_calls"}
        blocks = "\n".join(call_text(c) for c in calls)
        text = rest.get("content") or ""
        rest["content"] = f"{text}\n{blocks}" if text else blocks
        out.append(rest)
    return out
