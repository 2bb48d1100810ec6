"""The API contract: OpenAI's chat/completions request and response bodies as pydantic models.

Requests are validated strictly (a string where a number belongs is an error, not a conversion). Every
parameter OpenAI or vLLM define that changes the answer is either honoured or refused with a 400 naming it
(`_NEUTRAL` lists the refused ones and the values that pass because they change nothing). Other unknown fields
are ignored, as OpenAI-compatible servers do, so clients that send newer metadata keep working.

Responses are built from the models here and serialized as they are, `null`s included, because the official
client expects the keys to be present.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = (
    1024  # each; a stop string is looked for after every token (one megabyte made that O(T^2))
)
MAX_STOP_TOKEN_IDS = 1024  # each one is checked per token on the worker, every choice carries the list
MAX_CHOICES = 128  # prompts x best_of (or n) of one /v1/completions request: each is a request to the cluster
MAX_TOP_LOGPROBS = 20
MAX_N = 16  # choices per request (each one is a request of its own to the cluster)
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
INT32_MAX = 2**31 - 1  # what the wire's int32 fields hold
MAX_PROMPTS = 64  # prompts in one /v1/completions batch


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCallParam(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallParam(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    tool_calls: list[ToolCallParam] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # an assistant's earlier call in OpenAI's older functions API: rendered as the one tool call it is
    function_call: FunctionCallParam | None = None

    @model_validator(mode="after")
    def _complete(self) -> ChatMessage:
        """What OpenAI requires of each role (a 400 there, and until 2026-12-07 an empty turn here): content,
        except an assistant's that makes calls (`tool_calls`, or the older `function_call`); and a tool message
        names the call it answers."""
        calls = self.tool_calls or self.function_call is not None
        if self.content is None and not (self.role == "assistant" and calls):
            if self.role == "assistant":
                raise ValueError("an assistant message needs content, tool_calls or function_call")
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id, the id of the call it answers")
        return self

    def as_template_input(self) -> dict[str, Any]:
        """The message as a chat template reads it (text parts joined with newlines, as vLLM joins them;
        OpenAI's "developer" is "system"; a call's JSON arguments as an object, as HF templates expect)."""
        if isinstance(self.content, list):
            text = "\n".join(part.text for part in self.content)
        else:
            text = self.content or ""
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        calls = self.tool_calls or []
        if not calls and self.function_call is not None:
            calls = [ToolCallParam(id=f"call_{self.function_call.name}", function=self.function_call)]
        if calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                for c in calls
            ]  # fmt: skip
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class FunctionDef(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


def _refused_unless(neutral: str) -> Any:
    """A parameter rackserve does not implement: accepted only at a value that changes nothing."""
    return Field(default=None, description=f"Not supported: refused with 400 unless {neutral}.")


# name → (is the value neutral?, what neutral means), for parameters refused rather than ignored
_NEUTRAL: dict[str, tuple[Any, str]] = {
    "suffix": (lambda v: not v, "null or empty"),
    "functions": (lambda v: not v, "null or empty"),
    "function_call": (lambda v: v in (None, "none"), 'null or "none"'),
    "prompt_logprobs": (lambda v: v is None, "null"),
    "bad_words": (lambda v: not v, "null or empty"),
    "allowed_token_ids": (lambda v: v is None, "null"),
    "use_beam_search": (lambda v: v in (None, False), "null or false"),
    "length_penalty": (lambda v: v in (None, 1, 1.0), "null or 1.0"),
    "truncate_prompt_tokens": (lambda v: v is None, "null"),
    "spaces_between_special_tokens": (lambda v: v in (None, True), "null or true"),
    "return_tokens_as_token_ids": (lambda v: v in (None, False), "null or false"),
    "prediction": (lambda v: v is None, "null"),
    "audio": (lambda v: v is None, "null"),
    "modalities": (lambda v: v in (None, ["text"]), 'null or ["text"]'),
    "web_search_options": (lambda v: v is None, "null"),
    "add_generation_prompt": (lambda v: v in (None, True), "null or true"),
    "continue_final_message": (lambda v: v in (None, False), "null or false"),
    "chat_template": (lambda v: v is None, "null"),
    "chat_template_kwargs": (lambda v: not v, "null or empty"),
    "documents": (lambda v: not v, "null or empty"),
    "echo": (lambda v: v in (None, False), "null or false"),
    "logits_processors": (lambda v: not v, "null or empty"),
    "structural_tag": (lambda v: v is None, "null"),
    "guided_whitespace_pattern": (lambda v: v is None, "null"),
    "return_token_ids": (lambda v: v in (None, False), "null or false"),
    "best_of": (lambda v: v in (None, 1), "null or 1"),
    "return_token_strs": (lambda v: v in (None, False), "null or false"),
    "continuous_usage_stats": (lambda v: v in (None, False), "null or false"),
}


class StructuredError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class ResponseFormatParam(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = Field(
        default=None,
        description='{"name": ..., "schema": {...}, "strict": ...}: the output validates against schema',
    )

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormatParam:
        if self.type == "json_schema" and not isinstance((self.json_schema or {}).get("schema"), dict):
            raise ValueError('type "json_schema" needs json_schema.schema, a JSON schema object')
        return self


class StructuredOutputs(_Request):
    """vLLM's structured_outputs: exactly one of these. Its other keys (structural_tag, whitespace_pattern,
    disable_any_whitespace, ...) change the output, and a misspelt key would leave it unconstrained: any key not
    here is refused with a 400 naming it."""

    model_config = ConfigDict(strict=True, extra="forbid")

    json_: str | dict[str, Any] | None = Field(default=None, alias="json", description="a JSON schema")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(default=None, description="EBNF (GBNF) grammar")
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one_given(self) -> StructuredOutputs:
        if (
            all(v is None for v in (self.json_, self.regex, self.choice, self.grammar))
            and not self.json_object
        ):
            raise ValueError("give one of json, regex, choice, grammar or json_object: true")
        return self


def _neutral_only(value: Any, info: ValidationInfo) -> Any:
    is_neutral, neutral = _NEUTRAL[info.field_name or ""]
    if not is_neutral(value):
        raise ValueError(f"{info.field_name} is not supported by rackserve (only {neutral} is accepted)")
    return value


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: Any = _refused_unless("null or false")

    @field_validator("continuous_usage_stats", mode="before")
    @classmethod
    def _refuse(cls, value: Any, info: ValidationInfo) -> Any:
        return _neutral_only(value, info)


class GenerationRequest(_Request):
    """Fields both endpoints share. A parameter that changes the answer is honoured or refused with a 400
    naming it; neutral values (explicit nulls, `n: 1`, `repetition_penalty: 1.0`) always pass."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX, description="-1 or 0: off (vLLM)")] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=2)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        default=None, description="token id (as a string) → bias added to its logit, in [-100, 100]"
    )
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: (
        Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None
    ) = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    skip_special_tokens: bool | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None  # int64, as vLLM
    response_format: ResponseFormatParam | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    prompt_logprobs: Any = _refused_unless("null")
    logits_processors: Any = _refused_unless("null or empty")
    structural_tag: Any = _refused_unless("null")
    guided_whitespace_pattern: Any = _refused_unless("null")
    return_token_ids: Any = _refused_unless("null or false")
    bad_words: Any = _refused_unless("null or empty")
    allowed_token_ids: Any = _refused_unless("null")
    use_beam_search: Any = _refused_unless("null or false")
    length_penalty: Any = _refused_unless("null or 1.0")
    truncate_prompt_tokens: Any = _refused_unless("null")
    spaces_between_special_tokens: Any = _refused_unless("null or true")
    return_tokens_as_token_ids: Any = _refused_unless("null or false")

    @field_validator(
        "prompt_logprobs", "logits_processors", "structural_tag", "guided_whitespace_pattern",
        "return_token_ids", "bad_words", "allowed_token_ids",
        "use_beam_search", "length_penalty", "truncate_prompt_tokens", "spaces_between_special_tokens",
        "return_tokens_as_token_ids", mode="before",
    )  # fmt: skip
    @classmethod
    def _refuse(cls, value: Any, info: ValidationInfo) -> Any:
        return _neutral_only(value, info)

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(
        cls, options: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        # as vLLM: an empty object asks for nothing and passes
        if options is not None and options.model_fields_set and info.data.get("stream") is not True:
            raise ValueError("stream_options can only be given when stream is true")
        return options

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        if any(not s for s in strings):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in strings):
            raise ValueError(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias and len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}")
        for key in bias or {}:
            # the length first: int() of thousands of digits is refused by Python itself (a 500, until 2026-12-07)
            if not (key.isascii() and key.isdigit()) or len(key) > 10 or int(key) > INT32_MAX:
                raise ValueError(f"keys must be token ids written as decimal strings, got {key[:24]!r}")
        return bias

    def structured(self) -> tuple[str, str] | None:
        """The one grammar the output must follow, as (kind, spec) for the workers; a ValueError (400) names
        the parameter when two are given or one is malformed."""
        found: list[tuple[str, str, str]] = []  # (param, kind, spec)
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", "json_object", ""))
        elif rf is not None and rf.type == "json_schema":
            schema = (rf.json_schema or {}).get("schema")
            if not isinstance(schema, dict):
                raise StructuredError("response_format", "json_schema.schema must be a JSON schema object")
            found.append(("response_format", "json_schema", json.dumps(schema)))
        so = self.structured_outputs
        if so is not None:
            for kind, value in (
                ("json_schema", so.json_), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar),
                ("json_object", so.json_object or None),
            ):  # fmt: skip
                if value is not None:
                    spec = value if isinstance(value, str) else json.dumps(value)
                    found.append(("structured_outputs", kind, "" if kind == "json_object" else spec))
        legacy = (
            ("guided_json", "json_schema", self.guided_json), ("guided_regex", "regex", self.guided_regex),
            ("guided_choice", "choice", self.guided_choice), ("guided_grammar", "grammar", self.guided_grammar),
        )  # fmt: skip
        for param, kind, value in legacy:
            if value is not None:
                found.append((param, kind, value if isinstance(value, str) else json.dumps(value)))
        tool_schema = self.tool_schema() if isinstance(self, ChatCompletionRequest) else None
        if tool_schema is not None:
            found.insert(0, ("tool_choice", "json_schema", json.dumps(tool_schema)))
        if len(found) > 1:
            raise StructuredError(
                found[1][0], f"only one constraint per request; {found[0][0]} is already one"
            )
        if found and found[0][1] == "choice" and not json.loads(found[0][2]):
            raise StructuredError(found[0][0], "choice needs at least one string")
        return (found[0][1], found[0][2]) if found else None

    def structured_param(self) -> str:
        """The parameter that carries the grammar (for errors)."""
        if isinstance(self, ChatCompletionRequest) and self.tool_schema() is not None:
            return "tools"  # the grammar is the tools' parameters (tool_choice asked for it)
        for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice"):
            if getattr(self, name) is not None and not (name == "response_format" and self.response_format
                                                         and self.response_format.type == "text"):  # fmt: skip
                return name
        return "guided_grammar"

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage is True


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: the first parsed call only (ChatFormat)
    best_of: Any = _refused_unless("null or 1")
    functions: Any = _refused_unless("null or empty")
    function_call: Any = _refused_unless('null or "none"')
    prediction: Any = _refused_unless("null")
    audio: Any = _refused_unless("null")
    modalities: Any = _refused_unless('null or ["text"]')
    web_search_options: Any = _refused_unless("null")
    add_generation_prompt: Any = _refused_unless("null or true")
    continue_final_message: Any = _refused_unless("null or false")
    chat_template: Any = _refused_unless("null")
    chat_template_kwargs: Any = _refused_unless("null or empty")
    documents: Any = _refused_unless("null or empty")
    echo: Any = _refused_unless("null or false")
    add_special_tokens: bool | None = Field(
        default=None,
        description="add BOS/EOS around the templated prompt (default false: the template has them)",
    )

    @field_validator(
        "functions", "function_call", "prediction", "audio", "modalities", "web_search_options",
        "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
        "documents", "echo", "best_of", mode="before",
    )  # fmt: skip
    @classmethod
    def _refuse_chat(cls, value: Any, info: ValidationInfo) -> Any:
        return _neutral_only(value, info)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and info.data.get("logprobs") is not True:  # 0 asks for nothing: vLLM lets it pass too
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    def check_tools(self) -> None:
        """A StructuredError naming tool_choice when it asks for a call the tools cannot make."""
        choice = self.tool_choice
        if (isinstance(choice, NamedToolChoice) or choice == "required") and not self.tools:
            raise StructuredError("tool_choice", "it asks for a tool call, but tools is empty")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if choice.function.name not in names:
                raise StructuredError(
                    "tool_choice", f"no tool named {choice.function.name!r} (tools: {names})"
                )

    def tool_mode(self) -> str | None:
        """None (no tools, or "none"), "auto", "required", or "function:<name>" for a forced call."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return f"function:{self.tool_choice.function.name}"
        return self.tool_choice or "auto"

    def tool_schema(self) -> dict[str, Any] | None:
        """What constrained decoding enforces: the named function's parameters, or for `required` a
        non-empty list of {"name", "parameters"} calls of the given tools (vLLM's shape)."""
        mode = self.tool_mode()
        tools = {t.function.name: t.function.parameters or {"type": "object"} for t in self.tools or []}
        if mode is not None and mode.startswith("function:"):
            return tools[mode.removeprefix("function:")]
        if mode == "required":
            # Each tool's parameters are nested under the list's items here, so their root-relative references
            # ("#/$defs/Loc", as pydantic writes schemas) would dangle: their definitions move to the root (as
            # vLLM does), and two tools defining one name differently are refused.
            lifted: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
            calls = []
            for name, params in tools.items():
                params = dict(params)
                for key, defs in lifted.items():
                    own = params.pop(key, None) or {}
                    if not isinstance(own, dict):
                        raise StructuredError("tools", f"{name}: parameters.{key} must be an object")
                    for def_name, def_schema in own.items():
                        if defs.setdefault(def_name, def_schema) != def_schema:
                            raise StructuredError(
                                "tools", f"{key}/{def_name} is defined differently by two tools"
                            )
                calls.append(
                    {"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                     "required": ["name", "parameters"], "additionalProperties": False}
                )  # fmt: skip
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            schema.update({key: defs for key, defs in lifted.items() if defs})
            return schema
        return None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (none when tool_choice is "none")."""
        if self.tool_mode() is None:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        """None: no logprobs; 0: the chosen token's only; k: and the top k alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0, description="0 only with echo: score the prompt")] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool | None = Field(
        default=None, description="prepend the prompt (and its logprobs) to each choice"
    )
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    add_special_tokens: bool | None = Field(
        default=None, description="add the BOS/EOS the model's tokenizer metadata asks for (default true)"
    )
    suffix: Any = _refused_unless("null or empty")

    @field_validator("suffix", mode="before")
    @classmethod
    def _refuse_completion(cls, value: Any, info: ValidationInfo) -> Any:
        return _neutral_only(value, info)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: str | list[int] | list[str] | list[list[int]]) -> Any:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):  # a batch
            if len(prompt) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        elif isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt is empty (0 tokens)")
        return prompt

    def check_choices(self) -> None:
        """A StructuredError naming the parameter when best_of, n and max_tokens disagree, or when the prompts
        times best_of (or n) pass MAX_CHOICES."""
        if self.best_of is not None and self.best_of < self.num_choices:
            raise StructuredError(
                "best_of", f"best_of ({self.best_of}) must be at least n ({self.num_choices})"
            )
        per_prompt = self.best_of or self.num_choices
        if len(self.prompts()) * per_prompt > MAX_CHOICES:
            raise StructuredError(
                "best_of" if self.best_of else "n",
                f"{len(self.prompts())} prompts x {per_prompt} choices each is "
                f"{len(self.prompts()) * per_prompt} requests to the cluster; at most {MAX_CHOICES}",
            )
        if self.max_tokens == 0 and not self.echo:
            raise StructuredError("max_tokens", "max_tokens=0 needs echo=true (it scores the prompt only)")

    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt (text or token ids) or several."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template (with `tools` and
    `add_generation_prompt` as vLLM's TokenizeChatRequest has them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    tools: list[Tool] | None = None
    continue_final_message: Any = _refused_unless("null or false")
    chat_template: Any = _refused_unless("null")
    chat_template_kwargs: Any = _refused_unless("null or empty")
    return_token_strs: Any = _refused_unless("null or false")

    @field_validator(
        "continue_final_message", "chat_template", "chat_template_kwargs", "return_token_strs", mode="before"
    )
    @classmethod
    def _refuse_tokenize(cls, value: Any, info: ValidationInfo) -> Any:
        return _neutral_only(value, info)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.prompt is not None and (self.tools is not None or self.add_generation_prompt is not None):
            raise ValueError("tools and add_generation_prompt apply to messages, not to a prompt")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


# ---- responses ------------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall | None = None


class _WithoutEmptyToolCalls(BaseModel):
    """`tool_calls` appears only when there are calls (as OpenAI answers); every other null stays."""

    @model_serializer(mode="wrap")
    def _drop_empty_tool_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


class AssistantMessage(_WithoutEmptyToolCalls):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


# vLLM's extension on every choice: what stopped it — the stop string, the stop token id (an int), or null (EOS,
# length, or nothing yet)
StopReason = int | str | None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_WithoutEmptyToolCalls):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None


class Completion(BaseModel):
    """Both the whole answer and each streamed chunk of `/v1/completions` (OpenAI uses one shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rackserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
