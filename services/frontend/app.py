"""The FastAPI app: OpenAI's `/v1/chat/completions`, `/v1/completions` and `/v1/models`, plus `/health`
(readiness), `/livez` (liveness) and `/metrics`.

A request is validated (dependencies.py), tokenized here, checked against the model's context length, handed
to the coordinator as a `RequestState`, and answered from the tokens it yields — as one JSON body, or as
server-sent events. A streamed response waits for the first token before sending its headers, so anything
that fails before then (no worker, a worker refusing the request, the deadline) is an ordinary HTTP error with
its status; after that, a failure ends the stream with an OpenAI-style error event. A client that goes away
cancels the worker's call, streaming or not.

Admission is bounded, and decided before any work starts: past `max_concurrent_requests` requests in flight, or
when the KV tokens in flight would pass `admission_kv_factor` times what the decode workers report they hold
(`Frontend.admit`), a new one is answered at once with 429 and `Retry-After` (errors.overloaded) instead of
queueing without bound; every request admitted ends with its completion or an explicit error. `/health` is
readiness: 503 while no decode worker is routable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from services.engine.tokenizer import ChatTemplateError, Tokenizer
from services.frontend.auth import AuthConfig, Guard, Principal, authorize
from services.frontend.coordinator import Coordinator, EmittedToken, Phase, RequestState, WorkerView
from services.frontend.dependencies import json_body, openapi_body
from services.frontend.errors import (
    CLIENT_CLOSED_REQUEST,
    NOT_FOUND,
    SERVER_ERROR,
    ApiError,
    bad_request,
    install_error_handlers,
    model_not_found,
    overloaded,
)
from services.frontend.output import TextAssembler, TokenTexts, chat_logprobs, completion_logprobs
from services.frontend.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    Completion,
    CompletionChoice,
    CompletionRequest,
    FinishReason,
    GenerationRequest,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Usage,
)
from services.frontend.timeline import RequestObserver
from services.rpc import pb
from services.telemetry import metrics

log = logging.getLogger("rackserve.frontend")

T = TypeVar("T")

DEFAULT_MAX_MODEL_LEN = 8192
COMPLETIONS_DEFAULT_MAX_TOKENS = (
    16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
)
# The output a request is charged for at admission, at most: a chat request without max_tokens may run to the end
# of the context, but charging it that would admit a handful; past this, preemption shares the pool instead.
ADMISSION_OUTPUT_TOKENS = 256


@dataclass
class FrontendConfig:
    served_model_name: str
    max_model_len: int = 0  # 0: the smallest the decode workers advertise, else DEFAULT_MAX_MODEL_LEN
    request_timeout_s: float = 600.0
    max_body_bytes: int = 4 << 20
    # API keys and the per-key rate limit (services/frontend/auth.py); none: the API is open
    auth: AuthConfig = field(default_factory=AuthConfig)
    max_concurrent_requests: int = 0  # requests in flight before new ones get 429 (0: no limit)
    # KV tokens admitted in flight, as a multiple of what the decode workers report they hold, before new ones
    # get 429 (0: no KV budget). 1.0 = one full pool running; above it the rest waits in the workers' queues.
    admission_kv_factor: float = 0.0


class Frontend:
    """What every endpoint shares: the config, the tokenizer, the worker view and the coordinator."""

    def __init__(
        self,
        config: FrontendConfig,
        tokenizer: Tokenizer,
        directory: WorkerView,
        coordinator: Coordinator,
        observer: RequestObserver | None = None,
    ) -> None:
        self.config = config
        self.observer = observer or RequestObserver()
        self.tokenizer = tokenizer
        self.directory = directory
        self.coordinator = coordinator
        self.token_texts = TokenTexts(tokenizer)
        self.created = int(time.time())
        self.in_flight = 0
        self.kv_in_flight = 0  # KV tokens charged to the requests in flight (ADMISSION_OUTPUT_TOKENS)
        self._kv_charged: dict[str, int] = {}  # request id -> its charge

    def kv_budget(self) -> tuple[int, int]:
        """(this frontend's budget of KV tokens in flight, the decode workers' total capacity in tokens).

        From what the routable decode workers advertise in discovery, shared evenly among the frontends."""
        capacity = sum(w.kv_capacity_blocks * (w.block_size or 16) for w in self.directory.workers("decode"))
        frontends = max(1, len(self.directory.workers("frontend")))
        return int(capacity * self.config.admission_kv_factor / frontends), capacity

    def admit(self, endpoint: str, state: RequestState) -> None:
        """Take the request or refuse it with 429 + Retry-After, before any work starts."""
        limit = self.config.max_concurrent_requests
        if limit and self.in_flight >= limit:
            metrics.REQUESTS.labels(endpoint, "429").inc()
            raise overloaded(f"the frontend is serving its limit of {limit} concurrent requests "
                             "(--max-concurrent-requests); retry later")  # fmt: skip
        charge = len(state.prompt_token_ids) + min(state.params.max_tokens, ADMISSION_OUTPUT_TOKENS)
        budget, capacity = self.kv_budget() if self.config.admission_kv_factor > 0 else (0, 0)
        # with nothing in flight a request is always taken (even one larger than the budget): it can only wait
        if budget and self.kv_in_flight and self.kv_in_flight + charge > budget:
            metrics.REQUESTS.labels(endpoint, "429").inc()
            raise overloaded(
                f"the cluster is at capacity: {self.kv_in_flight} KV tokens in flight, this request needs "
                f"{charge}, the budget is {budget} ({self.config.admission_kv_factor:g} x the {capacity} tokens "
                "the decode workers hold, --admission-kv-factor); retry later"
            )
        self.in_flight += 1
        self.kv_in_flight += charge
        self._kv_charged[state.request_id] = charge

    def max_model_len(self) -> int:
        """The context a request may use: configured, else the decode workers' smallest; never more than the
        smallest decode worker's whole KV cache holds (such a request could only fail after its first token)."""
        decodes = self.directory.workers("decode")
        if self.config.max_model_len > 0:
            limit = self.config.max_model_len
        else:
            advertised = [w.max_model_len for w in decodes if w.max_model_len > 0]
            limit = min(advertised) if advertised else DEFAULT_MAX_MODEL_LEN
        held = [w.kv_capacity_blocks * (w.block_size or 16) for w in decodes if w.kv_capacity_blocks > 0]
        return min([limit, *held])

    def check_model(self, model: str) -> None:
        if model != self.config.served_model_name:
            raise model_not_found(model, self.config.served_model_name)

    def start(
        self,
        request: Request,
        prompt_token_ids: list[int],
        body: GenerationRequest,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_param: str,
        max_tokens_param: str = "max_tokens",
    ) -> RequestState:
        """Check the prompt against the context length and open the request's state."""
        limit = self.max_model_len()
        n = len(prompt_token_ids)
        if n == 0:
            raise bad_request(f"{prompt_param}: the prompt is empty (0 tokens)", param=prompt_param)
        if n >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but the prompt has {n} tokens "
                "(leaving no room for a completion)",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = limit - n
        elif n + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but {n + max_tokens} were requested "
                f"({n} in the prompt + {max_tokens_param}={max_tokens}); lower {max_tokens_param} to at most "
                f"{limit - n}",
                param=max_tokens_param,
                code="context_length_exceeded",
            )
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        params = pb.SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=seed % (1 << 64),  # always concrete: a replay elsewhere must draw the same tokens
            stop=body.stop_strings(),
            logprobs=-1 if logprobs is None else logprobs,
        )
        metrics.PROMPT_TOKENS.inc(n)
        # Our own id, unique by construction (workers key requests by it); the client's only goes to the log.
        client_request_id = request.headers.get("x-request-id", "")
        return self.coordinator.new_request(
            uuid.uuid4().hex,
            prompt_token_ids,
            params,
            timeout_s=self.config.request_timeout_s,
            traceparent=request.headers.get("traceparent"),
            client_request_id=client_request_id[:128] if client_request_id.isprintable() else None,
        )

    async def respond(
        self,
        request: Request,
        endpoint: str,
        state: RequestState,
        fmt: ResponseFormat,
        body: GenerationRequest,
    ) -> Response:
        self.admit(endpoint, state)
        assembler = TextAssembler(self.tokenizer, state.prompt_token_ids, body.stop_strings())
        pieces = _pieces(self.coordinator, state, assembler)
        metrics.REQUESTS_IN_FLIGHT.labels(endpoint).inc()
        headers = {"x-request-id": state.request_id}
        try:
            if not body.stream:
                text, tokens, finish_reason = await _unless_disconnected(request, _collect(pieces))
                whole = fmt.whole(text, tokens, finish_reason, _usage(state))
                self._finished(endpoint, state, 200)
                return Response(whole.model_dump_json(), media_type="application/json", headers=headers)
            first = await _unless_disconnected(request, anext(pieces))
        except ApiError as e:
            self._finished(endpoint, state, e.status, e.code or e.type)
            raise
        except asyncio.CancelledError:
            self._finished(endpoint, state, CLIENT_CLOSED_REQUEST, "client_closed")
            raise
        except Exception:
            self._finished(endpoint, state, 500, "internal_error")
            raise
        stream = self._sse(endpoint, state, fmt, first, pieces, body.include_usage)
        return EventStreamResponse(stream, media_type="text/event-stream", headers=headers)

    async def _sse(
        self,
        endpoint: str,
        state: RequestState,
        fmt: ResponseFormat,
        first: Piece,
        pieces: AsyncGenerator[Piece, None],
        include_usage: bool,
    ) -> AsyncGenerator[str, None]:
        status, error_type = 200, None
        try:
            for opening in fmt.opening():
                yield _event(opening)
            piece: Piece | None = first
            while piece is not None:
                if piece.text or piece.finish_reason or (fmt.logprobs and piece.tokens):
                    yield _event(fmt.chunk(piece))
                piece = await anext(pieces, None)
            if include_usage:
                yield _event(fmt.usage_chunk(_usage(state)))
        except ApiError as e:
            status, error_type = e.status, e.code or e.type
            yield f"data: {json.dumps(e.body())}\n\n"
        except (asyncio.CancelledError, GeneratorExit):  # the client went away (or the server is stopping)
            status, error_type = CLIENT_CLOSED_REQUEST, "client_closed"
            raise
        except Exception as e:  # a bug: still end the stream in OpenAI's shape rather than cut it
            log.exception("request %s: stream failed", state.request_id)
            status, error_type = 500, "internal_error"
            error = ApiError(
                500, f"internal error: {type(e).__name__}: {e}", SERVER_ERROR, code="internal_error"
            )
            yield f"data: {json.dumps(error.body())}\n\n"
        finally:
            self._finished(endpoint, state, status, error_type)
            await pieces.aclose()  # cancels the worker's call if the stream stopped early
        yield "data: [DONE]\n\n"

    def _finished(
        self, endpoint: str, state: RequestState, status: int, error_type: str | None = None
    ) -> None:
        self.in_flight -= 1
        self.kv_in_flight -= self._kv_charged.pop(state.request_id, 0)
        metrics.REQUESTS_IN_FLIGHT.labels(endpoint).dec()
        metrics.REQUESTS.labels(endpoint, str(status)).inc()
        if status >= 400:
            metrics.REQUEST_ERRORS.labels(str(status), error_type or "error").inc()
        done = state.time_of(Phase.DONE)
        if done is not None:
            metrics.E2E_S.observe(done - state.timeline[0][1])
        if state.cached_tokens:
            metrics.CACHED_PROMPT_TOKENS.inc(state.cached_tokens)
        self.observer.finished(endpoint, state, status, error_type)


class EventStreamResponse(StreamingResponse):
    """Server-sent events whose generator is closed as soon as the response ends, however it ends, so a
    client that disconnects cancels the worker's call at once rather than when the generator is collected."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            iterator = self.body_iterator
            if isinstance(iterator, AsyncGenerator):
                await iterator.aclose()


# ---- from the coordinator's tokens to pieces of the answer ---------------------------------------------------


@dataclass
class Piece:
    """Text the client may see now, the tokens behind it, and the finish reason on the last piece."""

    text: str
    tokens: list[EmittedToken]
    finish_reason: str | None = None


async def _pieces(
    coordinator: Coordinator, state: RequestState, assembler: TextAssembler
) -> AsyncGenerator[Piece, None]:
    async with contextlib.aclosing(coordinator.generate(state)) as batches:
        async for batch in batches:
            tokens = state.take_unseen()
            text = assembler.push([t.token_id for t in tokens])
            if assembler.stop_hit is not None:
                if not state.finished:
                    state.finish(
                        "stop", assembler.stop_hit
                    )  # closing `batches` then cancels the worker's call
                yield Piece(text, tokens, "stop")
                return
            if batch.finish_reason is not None:
                yield Piece(text + assembler.finish(), tokens, batch.finish_reason)
                return
            yield Piece(text, tokens)


async def _collect(pieces: AsyncIterator[Piece]) -> tuple[str, list[EmittedToken], str | None]:
    texts: list[str] = []
    tokens: list[EmittedToken] = []
    finish_reason = None
    async for piece in pieces:
        texts.append(piece.text)
        tokens.extend(piece.tokens)
        finish_reason = piece.finish_reason or finish_reason
    return "".join(texts), tokens, finish_reason


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so the worker's call) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ApiError):
                await task
    if task.cancelled():
        raise ApiError(CLIENT_CLOSED_REQUEST, "the client closed the connection", code="client_closed")
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(state: RequestState) -> Usage:
    prompt, completion = len(state.prompt_token_ids), len(state.emitted)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=state.cached_tokens),
    )


def _event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


# ---- the two response shapes ---------------------------------------------------------------------------------


class ResponseFormat(Protocol):
    logprobs: bool

    def opening(self) -> Sequence[BaseModel]: ...

    def chunk(self, piece: Piece) -> BaseModel: ...

    def usage_chunk(self, usage: Usage) -> BaseModel: ...

    def whole(
        self, text: str, tokens: list[EmittedToken], finish_reason: str | None, usage: Usage
    ) -> BaseModel: ...


class ChatFormat:
    def __init__(self, request_id: str, model: str, logprobs: bool, texts: TokenTexts) -> None:
        self.id, self.model, self.logprobs, self.texts = f"chatcmpl-{request_id}", model, logprobs, texts
        self.created = int(time.time())

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def opening(self) -> Sequence[BaseModel]:
        return [self._chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])]

    def chunk(self, piece: Piece) -> BaseModel:
        delta = ChatDelta(content=piece.text or None)
        logprobs = chat_logprobs(piece.tokens, self.texts) if self.logprobs else None
        finish = _finish(piece.finish_reason)
        return self._chunk([ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish)])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)

    def whole(
        self, text: str, tokens: list[EmittedToken], finish_reason: str | None, usage: Usage
    ) -> BaseModel:
        choice = ChatChoice(
            message=AssistantMessage(content=text),
            logprobs=chat_logprobs(tokens, self.texts) if self.logprobs else None,
            finish_reason=_finish(finish_reason),
        )
        return ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage
        )


class CompletionFormat:
    def __init__(self, request_id: str, model: str, logprobs: bool, texts: TokenTexts) -> None:
        self.id, self.model, self.logprobs, self.texts = f"cmpl-{request_id}", model, logprobs, texts
        self.created = int(time.time())
        self._text_offset = 0  # where the next streamed token starts in the completion text

    def _completion(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def opening(self) -> Sequence[BaseModel]:
        return []

    def chunk(self, piece: Piece) -> BaseModel:
        logprobs = None
        if self.logprobs:
            logprobs = completion_logprobs(piece.tokens, self.texts, self._text_offset)
            self._text_offset += sum(len(t) for t in logprobs.tokens)
        choice = CompletionChoice(
            text=piece.text, logprobs=logprobs, finish_reason=_finish(piece.finish_reason)
        )
        return self._completion([choice])

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._completion([], usage)

    def whole(
        self, text: str, tokens: list[EmittedToken], finish_reason: str | None, usage: Usage
    ) -> BaseModel:
        logprobs = completion_logprobs(tokens, self.texts, 0) if self.logprobs else None
        choice = CompletionChoice(text=text, logprobs=logprobs, finish_reason=_finish(finish_reason))
        return self._completion([choice], usage)


def _finish(reason: str | None) -> FinishReason | None:
    """The worker's finish reason as OpenAI names it (anything unexpected reads as "stop")."""
    if reason is None:
        return None
    if reason == "length":
        return "length"
    return "abort" if reason == "abort" else "stop"


# ---- endpoints -----------------------------------------------------------------------------------------------

api = APIRouter()


def frontend(request: Request) -> Frontend:
    return request.app.state.frontend  # type: ignore[no-any-return]


FrontendDep = Annotated[Frontend, Depends(frontend)]


@api.post("/v1/chat/completions", response_model=None, openapi_extra=openapi_body(ChatCompletionRequest))
async def chat_completions(
    request: Request,
    fe: FrontendDep,
    caller: Annotated[Principal, Depends(authorize)],
    body: Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))],
) -> Response:
    fe.check_model(body.model)
    caller.check_model(body.model)
    try:
        prompt = fe.tokenizer.encode_chat([m.as_template_input() for m in body.messages])
    except ChatTemplateError as e:
        raise bad_request(f"messages: {e}", param="messages") from e
    max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    state = fe.start(
        request,
        prompt,
        body,
        body.requested_max_tokens(),
        body.requested_logprobs(),
        prompt_param="messages",
        max_tokens_param=max_tokens_param,
    )
    fmt = ChatFormat(state.request_id, body.model, body.logprobs is True, fe.token_texts)
    return await fe.respond(request, "chat_completions", state, fmt, body)


@api.post("/v1/completions", response_model=None, openapi_extra=openapi_body(CompletionRequest))
async def completions(
    request: Request,
    fe: FrontendDep,
    caller: Annotated[Principal, Depends(authorize)],
    body: Annotated[CompletionRequest, Depends(json_body(CompletionRequest))],
) -> Response:
    fe.check_model(body.model)
    caller.check_model(body.model)
    if isinstance(body.prompt, str):
        prompt = fe.tokenizer.encode(body.prompt)
    else:
        prompt = list(body.prompt)  # type: ignore[arg-type]  # one prompt of token ids, by validation
        vocab = fe.tokenizer.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(
                f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", param="prompt"
            )
    max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    state = fe.start(request, prompt, body, max_tokens, body.logprobs, prompt_param="prompt")
    fmt = CompletionFormat(state.request_id, body.model, body.logprobs is not None, fe.token_texts)
    return await fe.respond(request, "completions", state, fmt, body)


@api.get("/v1/models", dependencies=[Depends(authorize)])
async def list_models(fe: FrontendDep) -> ModelList:
    card = ModelCard(id=fe.config.served_model_name, created=fe.created, max_model_len=fe.max_model_len())
    return ModelList(data=[card])


@api.get("/livez")
async def livez() -> dict[str, str]:
    """Liveness: the process serves HTTP (what a restart would fix); readiness is /health."""
    return {"status": "ok"}


@api.get("/health")
async def health(fe: FrontendDep) -> JSONResponse:
    """Readiness: 200 with the worker counts while a decode worker is routable (registered, not suppressed
    after a failure), else 503 with the same body, so a load balancer stops sending until one is back."""
    workers = {role: len(fe.directory.workers(role)) for role in ("router", "prefill", "decode")}
    budget, capacity = fe.kv_budget()
    ready = workers["decode"] > 0
    body: dict[str, object] = {
        "status": "ok" if ready else "unavailable",
        "model": fe.config.served_model_name,
        "workers": workers,
        "in_flight": fe.in_flight,
        "kv_tokens": {"in_flight": fe.kv_in_flight, "budget": budget, "capacity": capacity},
    }
    if not ready:
        body["reason"] = "no decode worker is routable"
    return JSONResponse(body, status_code=200 if ready else 503)


@api.get("/v1/requests/{request_id}/timeline")
async def request_timeline(request_id: str, fe: FrontendDep) -> dict[str, Any]:
    """A finished request's timeline (one of the last `--timeline-history`): phases, workers, bytes, reason."""
    record = fe.observer.timelines.get(request_id)
    if record is None:
        raise ApiError(
            404,
            f"no finished request {request_id!r} among the last {fe.observer.timelines.capacity} "
            "(unknown, still running, or too old)",
            NOT_FOUND,
            param="request_id",
            code="request_not_found",
        )
    return record


@api.get("/metrics")
async def prometheus_metrics() -> Response:
    body, content_type = metrics.exposition()
    return Response(body, media_type=content_type)


def create_app(
    config: FrontendConfig,
    tokenizer: Tokenizer,
    directory: WorkerView,
    coordinator: Coordinator,
    observer: RequestObserver | None = None,
) -> FastAPI:
    """The app. Discovery's lifetime is the caller's; the coordinator's channels close with the app."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await coordinator.close()
        await coordinator.channels.close()
        app.state.frontend.observer.close()

    app = FastAPI(title="rackserve", summary="OpenAI-compatible frontend", lifespan=lifespan)
    app.state.config = config
    app.state.guard = Guard(config.auth)
    app.state.frontend = Frontend(config, tokenizer, directory, coordinator, observer)
    metrics.export_healthy_workers(directory, ("router", "prefill", "decode"))
    install_error_handlers(app)
    app.include_router(api)
    return app
