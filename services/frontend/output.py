"""From generated token ids to what the client sees: text (never half a UTF-8 character, never past a stop
string) and OpenAI's two logprob shapes.

Stop strings are checked here and only here: the frontend detokenizes every token anyway (incrementally, a
short window per token), so it looks for them in the text not yet released — never the whole output again —
and ends the request (cancelling the worker's call) at the first one. While streaming, it holds back any tail
of the text that could still grow into a stop string, so no chunk ever carries text that a later token reveals
to be part of one. `include_stop_str_in_output` releases the stop string itself too, as vLLM does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from functools import lru_cache

from services.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from services.frontend.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from services.frontend.request_state import EmittedToken


class TextAssembler:
    """Releases generated text incrementally, truncated at the first stop string."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str],
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_ids=prompt_token_ids, skip_special_tokens=skip_special_tokens
        )
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self._held = ""  # decoded, not yet released: it may be the start of a stop string
        self.stop_hit: str | None = None  # the stop string that ended the text, once found
        # min_tokens: a stop string that is complete within the first min_tokens tokens' text does not stop
        # (vLLM looks for stop strings only past them); one completed by a later token does, even if it began
        # inside that text
        self._min_tokens = min_tokens
        self._tokens = 0
        self._released = 0  # characters released so far
        self._protected = 0  # characters of the text of the first min_tokens tokens

    def push(self, token_ids: Sequence[int]) -> str:
        """The text these tokens release now. Once a stop string appears, the text before it, then nothing."""
        if self.stop_hit is not None:
            return ""
        for token_id in token_ids:
            self._held += self._detokenizer.push(token_id)
            self._tokens += 1
            if self._tokens <= self._min_tokens:
                self._protected = self._released + len(self._held)
        return self._release(final=False)

    def finish(self) -> str:
        """Everything still held back, when generation has ended."""
        if self.stop_hit is not None:
            return ""
        self._held += self._detokenizer.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        protected = self._protected - self._released  # of the held text (may be negative: none of it)
        hits = []
        for s in self._stop:
            # only a stop string that ends past the protected text counts
            index = self._held.find(s, max(0, protected - len(s) + 1))
            if index >= 0:
                hits.append((index, -len(s), s))
        if hits:
            index, _, self.stop_hit = min(hits)  # the earliest; at a tie, the longest
            end = index + len(self.stop_hit) if self._include_stop else index
            released, self._held = self._held[:end], ""
            self._released += len(released)
            return released
        keep = 0 if final else _stop_prefix_len(self._held, self._stop)
        cut = len(self._held) - keep
        released, self._held = self._held[:cut], self._held[cut:]
        self._released += len(released)
        return released


def _stop_prefix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


# ---- logprobs -----------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE writes each byte as a printable character: printable Latin-1 bytes stand for
    themselves, the rest (controls, space, …) are shifted to U+0100 onward in byte order. Inverted here."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in alphabet.values())
    for n, b in enumerate(shifted):
        alphabet[chr(0x100 + n)] = b
    return alphabet


class TokenTexts:
    """Each token's text and exact bytes, as OpenAI's logprobs show them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(token_id)
        return hit

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        try:
            piece = self._tokenizer.id_to_token(token_id)
        except ValueError:
            return f"<token {token_id}>", []
        if token_id in self._tokenizer.special_token_ids:
            raw = piece.encode()
        else:
            alphabet = _byte_level_alphabet()
            raw = b"".join(bytes([alphabet[c]]) if c in alphabet else c.encode() for c in piece)
        # A token holding part of a character shows U+FFFD, as OpenAI's do; `bytes` stays exact.
        return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokens: Sequence[EmittedToken], texts: TokenTexts) -> ChatLogprobs:
    content = []
    for t in tokens:
        if t.logprob is None:
            continue
        text, raw = texts(t.token_id)
        top = [TopLogprob(token=texts(i)[0], logprob=lp, bytes=texts(i)[1]) for i, lp in t.top_logprobs]
        content.append(TokenLogprob(token=text, logprob=t.logprob, bytes=raw, top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(
    tokens: Sequence[EmittedToken], texts: TokenTexts, text_offset: int
) -> CompletionLogprobs:
    """The legacy shape; `text_offset` is where the first of `tokens` starts in the completion text. Each
    position's `top_logprobs` holds the token that is there (sampled or echoed) first, then the top
    alternatives — up to `logprobs` + 1 entries, as OpenAI documents and vLLM answers (until 2026-12-07 the
    token itself was missing wherever it was not among the top, and `logprobs: 0` gave empty dicts)."""
    out = CompletionLogprobs()
    for t in tokens:
        if t.logprob is None:
            continue
        text = texts(t.token_id)[0]
        out.tokens.append(text)
        out.token_logprobs.append(t.logprob)
        top = {text: t.logprob}
        for i, lp in t.top_logprobs:
            top.setdefault(texts(i)[0], lp)
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out


# ---- tool calls ---------------------------------------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_tool_calls(
    text: str, mode: str, tools: Collection[str] | None = None
) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments JSON)]) from a model's output, for a request whose tool mode is `mode`.

    `function:<name>`: the output is that function's arguments (constrained decoding made it so).
    `required`: a JSON list of {"name", "parameters"} (also constrained).
    `auto`: Hermes-style `<tool_call>{"name": …, "arguments": …}</tool_call>` blocks (the text around them is
    the content), or Llama-3 style — the whole output one JSON object {"name": …, "parameters": …} (or several
    joined by ";", optionally after `<|python_tag|>`). Anything else is plain content, and so is an output
    whose calls name a function not among `tools` (when given): a JSON answer with a "name" key is an answer,
    not a call of a tool nobody offered (until 2026-12-07 it became one, and the content was lost)."""
    if mode.startswith("function:"):
        return None, [(mode.removeprefix("function:"), text.strip())]
    if mode == "required":
        try:
            calls = json.loads(text)
        except ValueError:
            return text, []
        return None, [(c["name"], json.dumps(c.get("parameters", {}))) for c in calls if isinstance(c, dict)]

    def offered(calls: list[tuple[str, str]]) -> bool:
        return tools is None or all(name in tools for name, _ in calls)

    if _TOOL_CALL_TAG in text:
        found = [_call(block) for block in _HERMES.findall(text)]
        calls = [c for c in found if c is not None]
        if calls and offered(calls):
            # the text around the blocks, as it is (what a stream of it sends: content_before_calls), unless
            # it is only whitespace
            content = strip_tool_calls(text)
            return (content if content.strip() else None), calls
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if body.startswith("{"):
        whole = _json_calls(body)
        if whole and offered(whole):
            return None, whole
    return text, []


def _json_calls(body: str) -> list[tuple[str, str]]:
    """Llama-3 style calls: JSON objects separated by ";" (a ";" inside a string argument separates nothing;
    until 2026-12-07 splitting on every ";" made such a call content). [] unless the whole body is calls."""
    decoder = json.JSONDecoder()
    calls, at = [], 0
    while True:
        try:
            obj, at = decoder.raw_decode(body, at)
        except ValueError:
            return []
        call = _call_of(obj)
        if call is None:
            return []
        calls.append(call)
        rest = body[at:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return []
        at = len(body) - len(rest[1:].lstrip())


_TOOL_CALL_TAG = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def content_before_calls(text: str, released: int = 0) -> int:
    """How much of a streaming `auto` output is content whatever follows: everything before the first
    `<tool_call>` (less a tail that could still become one), and nothing when the output may be a Llama-3
    style call (it starts, past whitespace, with "{" or `<|python_tag|>`, or could still) or while it is only
    whitespace (the whole content may turn out to be none). `released`: what an earlier call returned, so the
    search goes on from there (a stream asks after every token)."""
    if not released:
        body = text.lstrip()
        if not body or body.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(body):
            return 0
    at = text.find(_TOOL_CALL_TAG, max(0, released - len(_TOOL_CALL_TAG)))
    if at < 0:
        at = len(text)
        for k in range(min(len(_TOOL_CALL_TAG) - 1, len(text)), 0, -1):
            if text.endswith(_TOOL_CALL_TAG[:k]):
                at = len(text) - k
                break
    return at if text[:at].strip() else 0


def strip_tool_calls(text: str) -> str:
    """The text with its Hermes `<tool_call>` blocks taken out."""
    return _HERMES.sub("", text)


def _call(block: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    return _call_of(obj)


def _call_of(obj: object) -> tuple[str, str] | None:
    """(name, arguments JSON) of a parsed call object; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args)
