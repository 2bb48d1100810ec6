"""The API contract: OpenAI's chat/completions request and response bodies as pydantic models.

Requests are validated strictly (a string where a number belongs is an error, not a conversion), and fields
rackserve does not implement are refused with a message rather than silently ignored when ignoring them would
change the answer (n > 1, best_of, echo, suffix, non-text content). Unknown extra fields are ignored, as
OpenAI-compatible servers commonly do, so clients that send newer fields keep working.

Responses are built from the models here and serialized as they are, `null`s included, because the official
client expects the keys to be present.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        """The message as a chat template reads it (text parts joined; OpenAI's "developer" is "system")."""
        if isinstance(self.content, list):
            text = "".join(part.text for part in self.content)
        else:
            text = self.content or ""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": text}


class GenerationRequest(_Request):
    """Fields both endpoints share."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported (one choice per request); got n={n}")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        if any(not s for s in strings):
            raise ValueError("stop strings must be non-empty")
        return stop

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        """None: no logprobs; 0: the chosen token's only; k: and the top k alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
        if isinstance(prompt, str):
            return prompt
        if prompt and not isinstance(prompt[0], int):  # a batch: list[str] or list[list[int]]
            if len(prompt) != 1:
                raise ValueError(f"only one prompt per request is supported; got {len(prompt)}")
            only = prompt[0]
            assert isinstance(only, str | list)
            return only  # type: ignore[return-value]
        return prompt  # type: ignore[return-value]

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo=true is not supported")
        return echo

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise ValueError(f"only best_of=1 is supported; got {best_of}")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix


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
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "abort"]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


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
