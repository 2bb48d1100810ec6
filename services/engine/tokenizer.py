"""The engine's tokenizer room: text to token ids and back, chat templates, and streaming detokenization.

A `Tokenizer` is built either from the metadata of a GGUF file (vocabulary, merges, token types, chat
template) or from a Hugging Face directory (`tokenizer.json` + `tokenizer_config.json`). Either way it is a
byte-level BPE run by the `tokenizers` library, and it must give the same ids as transformers gives for the
same files: the router's prefix index hashes these ids, so one differing id means a missed cache hit.

Chat templates are untrusted code from model files. They are rendered only in Jinja2's immutable sandbox,
with the same helpers and whitespace rules as transformers, so a prompt renders to the same string.

`IncrementalDetokenizer` turns generated ids into text as they arrive, never emitting half a UTF-8 character.

This room never downloads anything and never imports a model wheel; it only reads the files it is given.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _BackendTokenizer

from services.engine import tool_fallback
from services.engine.gguf_file import GgufFile

# llama.cpp's token types as GGUF stores them in `tokenizer.ggml.token_type`.
GGUF_TOKEN_TYPE_CONTROL = 3
GGUF_TOKEN_TYPE_USER_DEFINED = 4

# Control tokens that end a turn or a document. A model may emit any of these to stop, whatever its metadata
# names as eos (SmolLM2's eos is <|im_end|>, but it can also emit <|endoftext|>); llama.cpp stops on them too.
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|im_end|>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end|>",
        "<end_of_turn>",
        "<|return|>",
        "<EOT>",
        "<｜end▁of▁sentence｜>",
    }
)

# How the text is split into words before BPE, by the name in `tokenizer.ggml.pre`. The split must be the one
# the merges were learned with, or ids silently drift; so an unknown name is refused, not guessed.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# None means the GPT-2 split built into the ByteLevel pre-tokenizer. `smollm` is here on purpose: llama.cpp
# (and SmolLM2's own tokenizer.json) also isolate every digit first, but transformers' GGUF loader uses the
# plain GPT-2 split for this name, and we match transformers. The two differ only where a run of whitespace
# meets a digit ("a  1": transformers and we give "Ġ","Ġ","1"; llama.cpp gives "ĠĠ","1"; same for "\n\n1").
GGUF_PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "gpt2": None,
    "smollm": None,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


class ChatTemplateError(ValueError):
    """The chat template refused the messages (its `raise_exception`) or could not be rendered."""


class Tokenizer:
    """Byte-level BPE tokenizer with the model's chat template and stop tokens."""

    def __init__(
        self,
        backend: _BackendTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        end_token_ids: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        self.chat_template = chat_template
        self.vocab_size: int = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id: int | None = backend.token_to_id(eos_token) if eos_token else None

        added = backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, tok in added.items() if tok.special)
        stop = set(end_token_ids)
        if self.eos_token_id is not None:
            stop.add(self.eos_token_id)
        stop.update(i for i in self.special_token_ids if added[i].content in END_OF_GENERATION_TEXTS)
        self.stop_token_ids: frozenset[int] = frozenset(stop)

        # What transformers hands the template besides the messages: its special tokens map.
        named = {
            "bos_token": bos_token,
            "eos_token": eos_token,
            "unk_token": unk_token,
            "pad_token": pad_token,
        }
        self._template_vars = {name: text for name, text in named.items() if text is not None}
        self._compiled_template: jinja2.Template | None = None

    # ---- construction -------------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path_or_file: str | os.PathLike[str] | GgufFile) -> Tokenizer:
        """Build from a GGUF's `tokenizer.*` metadata (a path, or a file already read)."""
        if isinstance(path_or_file, GgufFile):
            reader = path_or_file
        else:
            where = os.fspath(path_or_file)
            if not os.path.isfile(where):
                raise FileNotFoundError(f"GGUF file not found: {where}")
            try:
                reader = GgufFile(where)
            except ValueError as exc:  # bad magic, unknown version, truncated
                raise ValueError(f"{where} is not a readable GGUF file: {exc}") from exc
        where = reader.path
        meta = reader.get

        model_type = meta("tokenizer.ggml.model")
        if model_type != "gpt2":
            kind = "no tokenizer.ggml.model" if model_type is None else f"tokenizer model {model_type!r}"
            raise ValueError(
                f"{where} has {kind}; only byte-level BPE tokenizers (tokenizer.ggml.model = 'gpt2') are "
                "supported, not SentencePiece ('llama'), WordPiece ('bert') or others"
            )
        pre = meta("tokenizer.ggml.pre") or "gpt2"  # files written before the key existed are GPT-2 style
        if pre not in GGUF_PRE_TOKENIZER_SPLITS:
            raise ValueError(
                f"{where} names pre-tokenizer {pre!r} (tokenizer.ggml.pre), which is not supported; "
                f"supported: {sorted(GGUF_PRE_TOKENIZER_SPLITS)}"
            )
        tokens: list[str] = meta("tokenizer.ggml.tokens")
        merges: list[str] | None = meta("tokenizer.ggml.merges")
        if not tokens or not merges:
            raise ValueError(f"{where} lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
        token_types: list[int] = meta("tokenizer.ggml.token_type") or []

        vocab: dict[str, int] = {}
        for token_id, token in enumerate(tokens):
            vocab.setdefault(token, token_id)
        pairs = [(left, right) for left, _, right in (merge.partition(" ") for merge in merges)]
        backend = _BackendTokenizer(
            models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
        )

        add_prefix_space = bool(meta("tokenizer.ggml.add_space_prefix"))
        split = GGUF_PRE_TOKENIZER_SPLITS[pre]
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(
                add_prefix_space=add_prefix_space, use_regex=True
            )
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
                ]
            )
        backend.decoder = decoders.ByteLevel()

        # Control tokens are matched whole in any text and are special (skippable on decode); user-defined
        # ones are matched whole but are ordinary text.
        typed = list(zip(tokens, token_types, strict=False))
        backend.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, kind in typed
                if kind == GGUF_TOKEN_TYPE_CONTROL
            ]
        )
        backend.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, kind in typed
                if kind == GGUF_TOKEN_TYPE_USER_DEFINED
            ]
        )

        def token_at(key: str) -> str | None:
            token_id = meta(key)
            return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

        bos, eos = token_at("tokenizer.ggml.bos_token_id"), token_at("tokenizer.ggml.eos_token_id")
        backend.post_processor = _bos_eos_processor(
            bos if meta("tokenizer.ggml.add_bos_token") else None,
            eos if meta("tokenizer.ggml.add_eos_token") else None,
            vocab,
        )
        end_ids = [meta(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
        return cls(
            backend,
            chat_template=meta("tokenizer.chat_template"),
            bos_token=bos,
            eos_token=eos,
            unk_token=token_at("tokenizer.ggml.unknown_token_id"),
            pad_token=token_at("tokenizer.ggml.padding_token_id"),
            end_token_ids=[i for i in end_ids if i is not None],
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build from a Hugging Face model directory: `tokenizer.json`, plus `tokenizer_config.json` for
        the chat template and special tokens (a `chat_template.jinja` file, when present, wins for the
        template)."""
        root = os.fspath(path)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"tokenizer directory not found: {root}")
        tokenizer_json = os.path.join(root, "tokenizer.json")
        if not os.path.isfile(tokenizer_json):
            raise FileNotFoundError(
                f"{tokenizer_json} not found; a Hugging Face tokenizer directory needs it"
            )
        backend = _BackendTokenizer.from_file(tokenizer_json)

        config = _read_json(os.path.join(root, "tokenizer_config.json"))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_path = os.path.join(root, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()

        generation_eos = _read_json(os.path.join(root, "generation_config.json")).get("eos_token_id")
        end_ids = generation_eos if isinstance(generation_eos, list) else [generation_eos]
        return cls(
            backend,
            chat_template=template,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            unk_token=_token_text(config.get("unk_token")),
            pad_token=_token_text(config.get("pad_token")),
            end_token_ids=[i for i in end_ids if isinstance(i, int)],
        )

    # ---- ids <-> text -------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their ids. With
        `add_special_tokens`, adds the bos/eos the model's metadata asks for."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """`encode` of each text. The batch call releases the GIL while it works (a single `encode` holds it), so
        a thread running it leaves the rest of the process running: the frontend tokenizes this way."""
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        token = self._backend.id_to_token(i)
        if token is None:
            raise ValueError(f"token id {i} is not in the vocabulary (size {self.vocab_size})")
        return token

    def to_json_str(self) -> str:
        """The `tokenizer.json` text of this tokenizer, for writing a Hugging Face directory."""
        return self._backend.to_str()

    # ---- chat ---------------------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The prompt string for `messages`, exactly as transformers' `apply_chat_template` renders it — except
        where the template has no place for tools or for an assistant's earlier `tool_calls` (SmolLM2's, like
        many small models' templates, drops both without a word): then the tools go into the system message
        and the calls into the assistant's text, in the Hermes `<tool_call>` format the frontend parses
        (`tool_fallback`), so that a tool offered is a tool the model is told of."""
        if self.chat_template is None:
            raise ChatTemplateError("this tokenizer has no chat template (none in the model files)")
        if not messages:
            raise ChatTemplateError("messages is empty; a chat needs at least one message")
        for n, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ChatTemplateError(
                    f"messages[{n}] must be a dict with 'role' and 'content', got {message!r}"
                )
        # Like transformers: a key whose value is None is absent (templates test presence, not None).
        chat = [{k: v for k, v in message.items() if v is not None} for message in messages]
        tools = tools or None
        gen = add_generation_prompt
        # Whether the template writes the earlier calls and the tools into this very prompt: rendered with and
        # without them (a probe conversation misjudged templates that show tools only beside a system message,
        # or that insist on their own call ids); where it makes no difference, they are written here. A render
        # that fails decides nothing: the template cares, and the last render reports its error.
        has_calls = any(m.get("tool_calls") for m in chat)
        prompt = self._render_or_none(chat, tools, gen) if tools or has_calls else None
        if prompt is not None and has_calls:
            bare = [{k: v for k, v in m.items() if k != "tool_calls"} for m in chat]
            if prompt == self._render_or_none(bare, tools, gen):
                chat = tool_fallback.with_calls_as_text(chat)
                prompt = self._render_or_none(chat, tools, gen)
        if prompt is not None and tools and prompt == self._render_or_none(chat, None, gen):
            chat, tools, prompt = tool_fallback.with_tools(chat, tools), None, None
        if prompt is not None:
            return prompt
        try:
            return self._render(chat, tools, gen)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template rejected the messages: {exc}") from exc

    def _render(self, chat: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return self._template().render(
            messages=chat,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self._template_vars,
        )

    def _render_or_none(
        self, chat: list[dict], tools: list[dict] | None, add_generation_prompt: bool
    ) -> str | None:
        try:
            return self._render(chat, tools, add_generation_prompt)
        except jinja2.TemplateError:
            return None

    def _template(self) -> jinja2.Template:
        if self._compiled_template is None:
            assert self.chat_template is not None
            try:
                self._compiled_template = _chat_template_env().from_string(self.chat_template)
            except jinja2.TemplateError as exc:
                raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from exc
        return self._compiled_template

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Ids of the chat-templated prompt. The template writes its own special tokens, so none are added."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        )


class IncrementalDetokenizer:
    """Text of generated tokens as they arrive, for streaming.

    Decoding one token alone is wrong twice over: a byte-level token may hold only part of a UTF-8 character,
    and some tokenizers decode a word-initial space only with a left neighbour. So each push decodes a short
    window (a few tokens already emitted, plus the new ones) and emits what the new tokens added to it, and
    holds everything back while the window's text ends in U+FFFD (an unfinished character).
    """

    # Tokens of the prompt's tail used as left context for the first window.
    PROMPT_CONTEXT_TOKENS = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids)[-self.PROMPT_CONTEXT_TOKENS :]
        # ids[:read] is emitted; ids[prefix:read] is the left context that the next window decodes with.
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)

    def push(self, token_id: int) -> str:
        """Append one generated id; return the text it completed ("" while a character is unfinished)."""
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Everything still held back, at the end of generation (an unfinished character decodes to U+FFFD,
        as it does in a full decode)."""
        text = self._decode(self._ids[self._prefix :])
        return self._advance(text) if len(text) > len(self._prefix_text) else ""

    def _advance(self, window_text: str) -> str:
        new_text = window_text[len(self._prefix_text) :]
        # The new tokens become the next left context; everything before them is no longer needed.
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new_text

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


# ---- helpers -----------------------------------------------------------------------------------------------


def _bos_eos_processor(
    bos: str | None, eos: str | None, vocab: dict[str, int]
) -> processors.TemplateProcessing:
    """What `encode(..., add_special_tokens=True)` wraps around the text."""
    head, tail = ([bos] if bos else []), ([eos] if eos else [])
    return processors.TemplateProcessing(
        single=[*head, "$A", *tail],
        pair=[*head, "$A", *tail, *head, "$B:1", *tail],
        special_tokens=[(t, vocab[t]) for t in {*head, *tail}],
    )


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json is either its text or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _chat_template_env() -> ImmutableSandboxedEnvironment:
    """The sandbox chat templates render in, with transformers' whitespace rules and helpers."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
