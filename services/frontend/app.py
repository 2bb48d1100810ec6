"""The FastAPI app: OpenAI's `/v1/chat/completions`, `/v1/completions` and `/v1/models`, plus `/health`
(readiness), `/livez` (liveness), `/metrics` and `/metrics/targets` (every service's /metrics, for Prometheus).

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
import importlib.metadata
import inspect
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol, TypeVar

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.engine.sampling import draw_seed
from services.engine.structured import GrammarError, Grammars
from services.engine.tokenizer import ChatTemplateError, Tokenizer
from services.frontend.auth import AuthConfig, Guard, Principal, authorize, identify
from services.frontend.coordinator import Coordinator, WorkerView
from services.frontend.dependencies import json_body, openapi_body
from services.frontend.errors import (
    CLIENT_CLOSED_REQUEST,
    NOT_FOUND,
    SERVER_ERROR,
    SERVICE_UNAVAILABLE,
    ApiError,
    bad_request,
    client_request_id,
    install_error_handlers,
    mark_counted,
    model_not_found,
    overloaded,
    response_request_id,
)
from services.frontend.output import (
    TextAssembler,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    content_before_calls,
    parse_tool_calls,
    strip_tool_calls,
)
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
    CompletionLogprobs,
    CompletionRequest,
    DetokenizeRequest,
    FinishReason,
    FunctionCall,
    GenerationRequest,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    StructuredError,
    TokenizeRequest,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from services.frontend.request_state import EmittedToken, Phase, RequestState
from services.frontend.timeline import RequestObserver
from services.rpc import pb
from services.runtime.http import DeadlineClient
from services.telemetry import metrics
from services.telemetry.traffic import SHARE_TOKENS, TrafficLog

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
    # the whole body must arrive within this (408 past it): a client that trickles one holds its memory
    body_timeout_s: float = 30.0
    # API keys and the per-key rate limit (services/frontend/auth.py); none: the API is open
    auth: AuthConfig = field(default_factory=AuthConfig)
    max_concurrent_requests: int = 0  # requests in flight before new ones get 429 (0: no limit)
    # one API key's requests in flight before its new ones get 429 (0: no limit of its own): one key within its
    # rate can otherwise hold every slot of max_concurrent_requests with long requests
    max_concurrent_per_key: int = 0
    # KV tokens admitted in flight, as a multiple of what the decode workers report they hold, before new ones
    # get 429 (0: no KV budget). 1.0 = one full pool running; above it the rest waits in the workers' queues.
    admission_kv_factor: float = 0.0
    # A stream's client that has stopped reading (its connection open) is cut this long after the request's
    # deadline: past it the response's writes give up and the request leaves admission (GET it: a 499).
    stalled_client_grace_s: float = 10.0
    # origins a browser may call the API from (CORS; "*": any); none: no CORS headers, a browser's preflight
    # is refused as before
    allowed_origins: tuple[str, ...] = ()


def _longest_token(tokenizer: Tokenizer) -> int:
    """The most characters one token's string has (byte-level tokens: one character per byte)."""
    longest = 1
    for i in range(tokenizer.vocab_size):
        with contextlib.suppress(ValueError):  # an id without a token (a padded vocabulary)
            longest = max(longest, len(tokenizer.id_to_token(i)))
    return longest


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
        self.grammars = Grammars(tokenizer, tokenizer.vocab_size, tokenizer.stop_token_ids)
        # the most characters of text one token covers (with a margin for normalizers): a text longer than the
        # context times this has more tokens than the context, whatever they are
        self.chars_per_token_bound = 4 * _longest_token(tokenizer)
        self.created = int(time.time())
        self.in_flight = 0
        self.kv_in_flight = 0  # KV tokens charged to the requests in flight (ADMISSION_OUTPUT_TOKENS)
        self._kv_charged: dict[str, int] = {}  # request id -> its charge
        self._in_flight_by_key: dict[str, int] = {}  # API key name -> its requests in flight
        self.traffic = TrafficLog()  # the recent prompts' shapes, for the planner's replay (GET /traffic)

    def kv_budget(self) -> tuple[int, int]:
        """(this frontend's budget of KV tokens in flight, the decode workers' total capacity in tokens).

        From what the routable decode workers advertise in discovery, shared evenly among the frontends."""
        capacity = sum(w.kv_capacity_blocks * (w.block_size or 16) for w in self.directory.workers("decode"))
        frontends = max(1, len(self.directory.workers("frontend")))
        return int(capacity * self.config.admission_kv_factor / frontends), capacity

    def admit(self, states: list[RequestState]) -> None:
        """Take the request (all its choices) or refuse it with 429 + Retry-After, before any work starts."""
        limit = self.config.max_concurrent_requests
        if limit and self.in_flight >= limit:
            raise overloaded(f"the frontend is serving its limit of {limit} concurrent requests "
                             "(--max-concurrent-requests); retry later")  # fmt: skip
        key, per_key = states[0].api_key_name, self.config.max_concurrent_per_key
        if per_key and self._in_flight_by_key.get(key, 0) >= per_key:
            raise overloaded(f"this API key has its limit of {per_key} requests in flight on this frontend "
                             "(--max-concurrent-per-key); retry later")  # fmt: skip
        charge = sum(
            len(st.prompt_token_ids) + min(st.params.max_tokens, ADMISSION_OUTPUT_TOKENS) for st in states
        )
        budget, capacity = self.kv_budget() if self.config.admission_kv_factor > 0 else (0, 0)
        # with nothing in flight a request is always taken (even one larger than the budget): it can only wait
        if budget and self.kv_in_flight and self.kv_in_flight + charge > budget:
            raise overloaded(
                f"the cluster is at capacity: {self.kv_in_flight} KV tokens in flight, this request needs "
                f"{charge}, the budget is {budget} ({self.config.admission_kv_factor:g} x the {capacity} tokens "
                "the decode workers hold, --admission-kv-factor); retry later"
            )
        self.in_flight += 1
        self._in_flight_by_key[key] = self._in_flight_by_key.get(key, 0) + 1
        self.kv_in_flight += charge
        self._kv_charged[states[0].request_id] = charge

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
        caller: Principal,
        max_tokens_param: str = "max_tokens",
        choices: int = 1,
        echo_logprobs: bool = False,
    ) -> list[RequestState]:
        """Check the prompt against the context length and open one request per choice: each is routed,
        run and migrated on its own, with its own seed derived from the request's. The requests are
        `caller`'s: only its key reads their timelines.

        `echo_logprobs`: the prompt's own logprobs are wanted too, so the request runs teacher-forced — its
        first token is the prompt, the rest are forced outputs whose raw logprobs the workers report."""
        n = len(prompt_token_ids)
        params = self.checked_params(
            prompt_token_ids, body, max_tokens, logprobs, prompt_param, max_tokens_param
        )
        self.traffic.admit(prompt_token_ids)  # the demand, as the prompt-length histogram counts it
        if echo_logprobs:
            params.forced_token_ids.extend(prompt_token_ids[1:])
            params.max_tokens += n - 1
            prompt_token_ids = prompt_token_ids[:1]
        metrics.PROMPT_TOKENS.inc(n)
        metrics.PROMPT_TOKENS_PER_REQUEST.observe(n)
        # Our own id, unique by construction (workers key requests by it); the client's only goes to the log.
        client_id = client_request_id(request.headers.get("x-request-id"))
        states = []
        for i in range(choices):
            choice_params = pb.SamplingParams()
            choice_params.CopyFrom(params)
            choice_params.seed = choice_seed(params.seed, i)
            states.append(
                self.coordinator.new_request(
                    uuid.uuid4().hex,
                    prompt_token_ids,
                    choice_params,
                    timeout_s=self.config.request_timeout_s,
                    traceparent=request.headers.get("traceparent"),
                    client_request_id=client_id,
                    api_key_name=caller.name,
                )
            )
        return states

    def checked_params(
        self,
        prompt_token_ids: list[int],
        body: GenerationRequest,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_param: str,
        max_tokens_param: str = "max_tokens",
    ) -> pb.SamplingParams:
        """The prompt checked against the context length, and the request's sampling parameters checked
        (a 400 naming the parameter otherwise)."""
        limit = self.max_model_len()
        n = len(prompt_token_ids)
        if n == 0:
            raise bad_request(f"{prompt_param}: the prompt is empty (0 tokens)", param=prompt_param)
        if n > limit or (n == limit and max_tokens != 0):  # max_tokens 0 (echo) generates nothing
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
        return self.sampling_params(body, max_tokens, logprobs)

    async def encode(self, text: str, add_special_tokens: bool, param: str | None = None) -> list[int]:
        """`text`'s token ids, on a thread: a few megabytes take seconds, which on the event loop stalled every
        other request (until 2026-12-07). With `param` (a generation's prompt), a text certainly longer than the
        context is refused before any of that work, naming `param`."""
        if param is not None:
            limit = self.max_model_len()
            if len(text) > limit * self.chars_per_token_bound:
                raise bad_request(
                    f"This model's maximum context length is {limit} tokens; the {param} has {len(text)} "
                    "characters, more than that many tokens can hold",
                    param=param,
                    code="context_length_exceeded",
                )
        (ids,) = await asyncio.to_thread(self.tokenizer.encode_batch, [text], add_special_tokens)
        return ids

    async def encode_chat(
        self,
        messages: list[Any],
        tools: Any,
        add_special_tokens: bool,
        param: str | None = "messages",
        **kw: Any,
    ) -> list[int]:
        """The chat template on a thread (one with 120,000 messages took 3 s of the event loop), then `encode`."""
        try:
            text = await asyncio.to_thread(self.tokenizer.apply_chat_template, messages, tools=tools, **kw)
        except ChatTemplateError as e:
            raise bad_request(f"messages: {e}", param="messages") from e
        return await self.encode(text, add_special_tokens, param)

    async def compile_grammar(self, body: GenerationRequest) -> None:
        """The request's grammar compiled off the event loop, within structured.COMPILE_TIMEOUT_S, before
        `sampling_params` checks it (then from xgrammar's cache). Compiled on the loop, one costly grammar froze
        every request this frontend serves (until 2026-12-07)."""
        try:
            structured = body.structured()
        except StructuredError as e:
            raise bad_request(str(e), param=e.param) from e
        if structured is not None:
            try:
                await self.grammars.compile_within(*structured)
            except GrammarError as e:
                raise bad_request(str(e), param=body.structured_param()) from e

    def sampling_params(
        self, body: GenerationRequest, max_tokens: int, logprobs: int | None
    ) -> pb.SamplingParams:
        """Every sampling and stopping parameter the workers honour (stop strings stay here: output.py)."""
        vocab = self.tokenizer.vocab_size
        bias = body.logit_bias_ids()
        for field_name, ids in (("logit_bias", list(bias)), ("stop_token_ids", body.stop_token_ids or [])):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(
                    f"{field_name}: token id {bad} is outside the vocabulary [0, {vocab})", param=field_name
                )
        try:
            structured = body.structured()
        except StructuredError as e:
            raise bad_request(str(e), param=e.param) from e
        # the grammar compiled (a bad one a 400 naming it, before routing) in compile_grammar, which every
        # endpoint awaits before this
        kind, spec = structured or ("", "")
        if body.min_tokens and body.min_tokens > max_tokens:
            raise bad_request(
                f"min_tokens ({body.min_tokens}) is more than max_tokens ({max_tokens})", param="min_tokens"
            )
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        return pb.SamplingParams(
            structured_kind=kind,
            structured_spec=spec,
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k if body.top_k and 0 < body.top_k < vocab else 0,  # -1, 0 and >= vocab: off
            min_p=body.min_p or 0.0,
            seed=seed % (1 << 64),  # always concrete: a replay elsewhere must draw the same tokens
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos is True,
            min_tokens=body.min_tokens or 0,
            logprobs=-1 if logprobs is None else logprobs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=bias,
        )

    async def respond(
        self,
        request: Request,
        endpoint: str,
        states: list[RequestState],
        fmt: ResponseFormat,
        body: GenerationRequest,
        per_prompt: int = 1,
        keep: int | None = None,
        echo: list[str] | None = None,
    ) -> Response:
        """Answer with every choice in `states`, `per_prompt` consecutive ones per prompt (or, for best_of,
        the `keep` with the highest cumulative logprob, renumbered 0..keep-1)."""
        try:
            self.admit(states)
        except ApiError as e:
            # refused (429): counted by the error handler, and, like a request taken, one timeline, log line
            # and trace under the ids its answer names (until 2026-12-07 a refusal left none of them)
            for state in states:
                state.fail(e.message)
                self.observer.finished(endpoint, state, e.status, e.code or e.type, refused=True)
            e.headers.update(_id_headers(states[0].client_request_id, states[0].request_id))
            raise
        mark_counted(request)  # from here its end is counted, however it ends
        echoes: list[str | None] = (
            [None] * len(states) if echo is None else [echo[i // per_prompt] for i in range(len(states))]
        )
        pieces = _merged(
            [self._pieces(state, body, echo) for state, echo in zip(states, echoes, strict=True)]
        )
        metrics.REQUESTS_IN_FLIGHT.labels(endpoint).inc()
        # the client's own x-request-id comes back as it was sent (vLLM does the same); ours is always in
        # x-rackserve-request-id, the key of the timeline, the traces and the request log
        headers = _id_headers(states[0].client_request_id, states[0].request_id)
        try:
            if not body.stream:
                answers = await _unless_disconnected(request, _collect(pieces, len(states)))
                if keep is not None and keep < per_prompt:
                    answers = _best(answers, per_prompt, keep)
                whole = fmt.whole(answers, _usage(states, per_prompt))
                self._finished(endpoint, states, 200)
                return Response(whole.model_dump_json(), media_type="application/json", headers=headers)
            first = await _unless_disconnected(request, anext(pieces))
        except ApiError as e:
            self._finished(endpoint, states, e.status, e.code or e.type)
            e.headers.update(headers)  # a request that failed is found by its ids like one that did not
            raise
        except asyncio.CancelledError:
            self._finished(endpoint, states, CLIENT_CLOSED_REQUEST, "client_closed")
            raise
        except Exception:
            self._finished(endpoint, states, 500, "internal_error")
            raise
        stream = self._sse(endpoint, states, per_prompt, fmt, first, pieces, body.include_usage)
        cut_at = max(s.deadline_s for s in states) + self.config.stalled_client_grace_s

        async def closed() -> None:
            """After the response, however it ended: a stream whose generator never ran (its client gone before
            the first write) never reached its own cleanup, and kept its admission and the workers' calls."""
            await pieces.aclose()
            self._finished(endpoint, states, CLIENT_CLOSED_REQUEST, "client_closed")

        return EventStreamResponse(
            stream, cut_at, closed, media_type="text/event-stream", headers={**headers, **SSE_HEADERS}
        )

    def _pieces(
        self, state: RequestState, body: GenerationRequest, echo: str | None
    ) -> AsyncGenerator[Piece, None]:
        forced = list(state.params.forced_token_ids)
        assembler = TextAssembler(
            self.tokenizer,
            state.prompt_token_ids + forced,  # the whole prompt is the left context of the first token
            body.stop_strings(),
            include_stop=body.include_stop_str_in_output is True,
            skip_special_tokens=body.skip_special_tokens is not False,
            min_tokens=body.min_tokens or 0,
        )
        return _pieces(self.coordinator, state, assembler, echo, len(forced), self.tokenizer.stop_token_ids)

    async def _sse(
        self,
        endpoint: str,
        states: list[RequestState],
        per_prompt: int,
        fmt: ResponseFormat,
        first: Piece,
        pieces: AsyncGenerator[Piece, None],
        include_usage: bool,
    ) -> AsyncGenerator[str, None]:
        status, error_type = 200, None
        try:
            for opening in fmt.opening(len(states)):
                yield _event(opening)
            piece: Piece | None = first
            while piece is not None:
                if piece.text or piece.finish_reason or piece.echo or (fmt.logprobs and piece.tokens):
                    # none: held back (a tool call is parsed once it is whole)
                    for event in fmt.chunk(piece):
                        yield _event(event)
                piece = await anext(pieces, None)
            if include_usage:  # best_of > n never streams, so every choice streamed is the client's
                yield _event(fmt.usage_chunk(_usage(states, per_prompt)))
        except ApiError as e:
            status, error_type = e.status, e.code or e.type
            yield f"data: {json.dumps(e.body())}\n\n"
        except (asyncio.CancelledError, GeneratorExit):  # the client went away (or the server is stopping)
            status, error_type = CLIENT_CLOSED_REQUEST, "client_closed"
            raise
        except Exception as e:  # a bug: still end the stream in OpenAI's shape rather than cut it
            log.exception("request %s: stream failed", states[0].request_id)
            status, error_type = 500, "internal_error"
            error = ApiError(
                500, f"internal error: {type(e).__name__}: {e}", SERVER_ERROR, code="internal_error"
            )
            yield f"data: {json.dumps(error.body())}\n\n"
        finally:
            self._finished(endpoint, states, status, error_type)
            await pieces.aclose()  # cancels the workers' calls if the stream stopped early
        yield "data: [DONE]\n\n"

    def _finished(
        self, endpoint: str, states: list[RequestState], status: int, error_type: str | None = None
    ) -> None:
        """The request leaves admission and is counted: once, whichever of its ends comes first."""
        if states[0].request_id not in self._kv_charged:
            return
        self.in_flight -= 1
        key = states[0].api_key_name
        self._in_flight_by_key[key] -= 1
        if not self._in_flight_by_key[key]:
            del self._in_flight_by_key[key]
        self.kv_in_flight -= self._kv_charged.pop(states[0].request_id, 0)
        metrics.REQUESTS_IN_FLIGHT.labels(endpoint).dec()
        metrics.REQUESTS.labels(endpoint, str(status)).inc()
        if status >= 400:
            metrics.REQUEST_ERRORS.labels(str(status), error_type or "error").inc()
        for state in states:  # each choice was a request of its own to the cluster: one record each
            done = state.time_of(Phase.DONE)
            if done is not None:
                metrics.E2E_S.observe(done - state.timeline[0][1])
            if state.cached_tokens:
                metrics.CACHED_PROMPT_TOKENS.inc(state.cached_tokens)
            if state.pulled_tokens:
                metrics.PULLED_PROMPT_TOKENS.inc(state.pulled_tokens)
            self.observer.finished(endpoint, state, status, error_type)


def _id_headers(client_id: str | None, ours: str) -> dict[str, str]:
    """A response's ids: the client's x-request-id echoed (ours where it sent none) and ours."""
    return {"x-request-id": client_id or ours, "x-rackserve-request-id": ours}


# An event stream is never cached, and a proxy must pass each event on as it comes: nginx buffers a proxied
# response unless told not to (X-Accel-Buffering), which turns a token stream into bursts.
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class EventStreamResponse(StreamingResponse):
    """Server-sent events whose generator is closed as soon as the response ends, however it ends, so a
    client that disconnects cancels the worker's call at once rather than when the generator is collected.

    The writes end by `cut_at` (time.monotonic()): a client that stops reading but keeps its connection open
    would otherwise block them for good, and hold its admission slot and KV budget past the request's deadline
    and a drain's end. Cut, the connection is closed and the request is recorded as the client's (499)."""

    def __init__(
        self,
        content: AsyncGenerator[str, None],
        cut_at: float,
        closed: Callable[[], Awaitable[None]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(content, **kwargs)
        self.cut_at = cut_at
        self.closed = closed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            # asyncio's clock is time.monotonic(), the clock of the requests' deadlines
            async with asyncio.timeout_at(self.cut_at):
                await super().__call__(scope, receive, send)
        except TimeoutError:
            log.warning(
                "a stream outlived its request's deadline (its client stopped reading): connection cut"
            )
            # A graceful close would wait to flush what the client is not reading, keeping the socket (and a
            # drain) for as long as the client keeps it: the server aborts the connection instead (server.py).
            abort = getattr(scope["app"].state, "abort_connection", None)
            if abort is not None and abort(scope.get("client")):
                await asyncio.sleep(0)  # the server sees the connection lost before this call returns
        finally:
            iterator = self.body_iterator
            if isinstance(iterator, AsyncGenerator):
                await iterator.aclose()
            if self.closed is not None:
                await self.closed()


# ---- from the coordinator's tokens to pieces of the answer ---------------------------------------------------


@dataclass
class Piece:
    """Text the client may see now, the tokens behind it, and the finish reason on the last piece — of the
    choice numbered `index`. With echo, the first piece of a choice carries the prompt's text (`echo`) and,
    when its logprobs were asked for, its tokens (`echoed`, after the first prompt token `echo_first`)."""

    text: str
    tokens: list[EmittedToken]
    finish_reason: str | None = None
    index: int = 0
    stop_reason: int | str | None = None  # with finish_reason "stop": the stop string or stop token id
    echo: str | None = None
    echo_first: int | None = None
    echoed: list[EmittedToken] = field(default_factory=list)


@dataclass
class Answer:
    """One choice, whole."""

    index: int
    text: str = ""
    tokens: list[EmittedToken] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    echo: str | None = None
    echo_first: int | None = None
    echoed: list[EmittedToken] = field(default_factory=list)

    @property
    def cumulative_logprob(self) -> float:
        return sum(t.logprob or 0.0 for t in self.tokens)


async def _pieces(
    coordinator: Coordinator,
    state: RequestState,
    assembler: TextAssembler,
    echo: str | None,
    forced: int,
    eos: Collection[int] = (),
) -> AsyncGenerator[Piece, None]:
    """The choice's pieces. The first `forced` tokens are the echoed prompt (teacher-forced for its
    logprobs): held until all have arrived and handed out as the prompt's text, never as generated text."""
    echoed: list[EmittedToken] = []
    pending_echo = echo is not None
    async with contextlib.aclosing(coordinator.generate(state)) as batches:
        async for batch in batches:
            tokens = state.take_unseen()
            if len(echoed) < forced:
                take = forced - len(echoed)
                echoed += tokens[:take]
                tokens = tokens[take:]
                if len(echoed) < forced and batch.finish_reason is None:
                    continue
            text = assembler.push([t.token_id for t in tokens])
            piece = Piece(text, tokens)
            if pending_echo:
                pending_echo = False
                piece.echo, piece.echoed = echo, echoed
                piece.echo_first = state.prompt_token_ids[0]
            if assembler.stop_hit is not None:
                if not state.finished:
                    state.finish(
                        "stop", assembler.stop_hit
                    )  # closing `batches` then cancels the worker's call
                piece.finish_reason, piece.stop_reason = "stop", assembler.stop_hit
                yield piece
                return
            if batch.finish_reason is not None:
                piece.text += assembler.finish()
                piece.finish_reason, piece.stop_reason = batch.finish_reason, _stop_token(state, eos)
                yield piece
                return
            yield piece


def _stop_token(state: RequestState, eos: Collection[int]) -> int | None:
    """The stop token id that ended the request, if one of `stop_token_ids` did (vLLM's stop_reason); None for
    the model's EOS (vLLM checks it first: in stop_token_ids too, unless ignore_eos) and every other end."""
    reason = state.stop_reason or ""
    if state.finish_reason != "stop" or not reason.isdigit():
        return None
    token = int(reason)
    if token in eos and not state.params.ignore_eos:
        return None
    return token if token in state.params.stop_token_ids else None


async def _merged(choices: list[AsyncGenerator[Piece, None]]) -> AsyncGenerator[Piece, None]:
    """The pieces of every choice as they arrive, each numbered with its choice. Closing this closes them
    all (cancelling their workers' calls); a choice that fails fails the whole answer."""
    pending: dict[asyncio.Future[Piece], int] = {}
    try:
        pending = {asyncio.ensure_future(anext(g)): i for i, g in enumerate(choices)}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t]):
                i = pending.pop(task)
                try:
                    piece = task.result()
                except StopAsyncIteration:
                    continue
                piece.index = i
                yield piece
                pending[asyncio.ensure_future(anext(choices[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for g in choices:
            await g.aclose()


async def _collect(pieces: AsyncIterator[Piece], choices: int) -> list[Answer]:
    answers = [Answer(i) for i in range(choices)]
    texts: list[list[str]] = [[] for _ in range(choices)]
    async for piece in pieces:
        answer = answers[piece.index]
        if piece.echo is not None:
            answer.echo, answer.echo_first, answer.echoed = piece.echo, piece.echo_first, piece.echoed
        texts[piece.index].append(piece.text)
        answer.tokens.extend(piece.tokens)
        answer.finish_reason = piece.finish_reason or answer.finish_reason
        answer.stop_reason = piece.stop_reason if piece.finish_reason else answer.stop_reason
    for answer, parts in zip(answers, texts, strict=True):
        answer.text = "".join(parts)
    return answers


def _best(answers: list[Answer], group: int, keep: int) -> list[Answer]:
    """best_of: of each prompt's `group` answers, the `keep` with the highest cumulative logprob, in that
    order, renumbered as the client's choices (prompt p's j-th is p * keep + j)."""
    kept = []
    for p in range(0, len(answers), group):
        ranked = sorted(answers[p : p + group], key=lambda a: a.cumulative_logprob, reverse=True)[:keep]
        for j, a in enumerate(ranked):
            a.index = p // group * keep + j
        kept += ranked
    return kept


def choice_seed(seed: int, index: int) -> int:
    """Choice 0 keeps the request's seed (n=1 draws what it always drew); the others get decorrelated seeds
    derived from it, so a seeded request with n > 1 gives the same n choices every time."""
    return seed if index == 0 else draw_seed(seed ^ _CHOICE_SALT, index)


_CHOICE_SALT = 0x6E5F63686F696365  # "n_choice": keeps choice seeds apart from the per-token draw seeds


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


def _usage(states: list[RequestState], per_prompt: int) -> Usage:
    """Each prompt counted once (its `per_prompt` choices share it, as OpenAI counts), completions summed."""
    # a teacher-forced (echo + logprobs) request's forced outputs are its prompt, not its completion
    prompt = sum(len(s.prompt_token_ids) + len(s.params.forced_token_ids) for s in states[::per_prompt])
    completion = sum(max(len(s.emitted) - len(s.params.forced_token_ids), 0) for s in states)
    cached = sum(s.cached_tokens for s in states[::per_prompt])
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


# ---- the two response shapes ---------------------------------------------------------------------------------


class ResponseFormat(Protocol):
    logprobs: bool

    def opening(self, choices: int) -> Sequence[BaseModel]: ...

    def chunk(self, piece: Piece) -> Sequence[BaseModel]: ...

    def usage_chunk(self, usage: Usage) -> BaseModel: ...

    def whole(self, answers: list[Answer], usage: Usage) -> BaseModel: ...


@dataclass
class _HeldChoice:
    """A choice with tools while it streams: its text so far, how much of it went out as content, and the
    tokens not yet sent (their logprobs go with the next chunk)."""

    text: str = ""
    released: int = 0
    tokens: list[EmittedToken] = field(default_factory=list)


class ChatFormat:
    def __init__(
        self,
        request_id: str,
        model: str,
        logprobs: bool,
        texts: TokenTexts,
        tool_mode: str | None = None,
        tools: Collection[str] = (),
        parallel_tool_calls: bool = True,
    ) -> None:
        self.id, self.model, self.logprobs, self.texts = f"chatcmpl-{request_id}", model, logprobs, texts
        self.created = int(time.time())
        # with tools, the text that could be a call is held until the choice is whole, then parsed for calls;
        # under `auto`, what comes before a possible call streams as content
        self.tool_mode = tool_mode
        self.tools = frozenset(tools)
        self.parallel_tool_calls = parallel_tool_calls
        self._held: dict[int, _HeldChoice] = {}

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def opening(self, choices: int) -> Sequence[BaseModel]:
        # a required or named tool_choice answers with calls only (content null, whole or streamed): its opening
        # delta carries no "" content, which a client's accumulated message kept (until 2026-12-07, the SDK's
        # stream helper gave content "" where the whole answer gives null)
        constrained = self.tool_mode is not None and self.tool_mode != "auto"
        content = None if constrained else ""
        return [
            self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=content))])
            for i in range(choices)
        ]

    def chunk(self, piece: Piece) -> Sequence[BaseModel]:
        tokens, text = piece.tokens, piece.text
        calls: list[ToolCall] = []
        delta = ChatDelta(content=text or None)
        finish = piece.finish_reason
        if self.tool_mode is not None:
            held = self._held.setdefault(piece.index, _HeldChoice())
            held.text += text
            held.tokens += tokens
            if finish is None:
                safe = content_before_calls(held.text, held.released) if self.tool_mode == "auto" else 0
                if safe <= held.released and not (self.logprobs and held.tokens):
                    return []
                delta = ChatDelta(content=held.text[held.released : safe] or None)
                held.released = max(held.released, safe)
            else:
                content, calls, finish = self._tool_calls(held.text, finish)
                rest = held.text[held.released :]
                if calls:  # what is left of the text once the calls are taken out (none of a JSON call)
                    rest = strip_tool_calls(rest) if content is not None else ""
                delta = ChatDelta(
                    content=rest or None,
                    tool_calls=[
                        ToolCallDelta(index=j, id=c.id, type="function", function=c.function)
                        for j, c in enumerate(calls)
                    ]
                    or None,
                )
            tokens, held.tokens = held.tokens, []
        logprobs = chat_logprobs(tokens, self.texts) if self.logprobs else None
        if calls:
            # the calls, then the finish in a chunk of its own with an empty delta, as OpenAI sends it: the
            # SDK's stream helper ends a call (`tool_calls.function.arguments.done`) only when a later chunk
            # comes, so calls and finish in one chunk never ended (until 2026-12-07)
            done = ChatChunkChoice(
                index=piece.index,
                delta=ChatDelta(),
                finish_reason=_finish(finish),
                stop_reason=piece.stop_reason,
            )
            return [self._chunk([ChatChunkChoice(index=piece.index, delta=delta, logprobs=logprobs)]),
                    self._chunk([done])]  # fmt: skip
        choice = ChatChunkChoice(
            index=piece.index, delta=delta, logprobs=logprobs, finish_reason=_finish(finish),
            stop_reason=piece.stop_reason,
        )  # fmt: skip
        return [self._chunk([choice])]

    def _tool_calls(self, text: str, finish: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        assert self.tool_mode is not None
        content, parsed = parse_tool_calls(text, self.tool_mode, self.tools)
        if not self.parallel_tool_calls:
            parsed = parsed[:1]  # parallel_tool_calls false: at most one call (OpenAI's and vLLM's contract)
        calls = [
            ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=args))
            for name, args in parsed
        ]
        # a named tool_choice ends with "stop", as OpenAI answers it (and vLLM); auto and required with
        # "tool_calls"
        if calls and finish == "stop" and not self.tool_mode.startswith("function:"):
            finish = "tool_calls"
        return content, calls, finish

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)

    def whole(self, answers: list[Answer], usage: Usage) -> BaseModel:
        choices = []
        for a in answers:
            content: str | None = a.text
            calls: list[ToolCall] = []
            finish = a.finish_reason
            if self.tool_mode is not None:
                content, calls, finish = self._tool_calls(a.text, finish)
            choices.append(
                ChatChoice(
                    index=a.index,
                    message=AssistantMessage(content=content, tool_calls=calls or None),
                    logprobs=chat_logprobs(a.tokens, self.texts) if self.logprobs else None,
                    finish_reason=_finish(finish),
                    stop_reason=a.stop_reason,
                )
            )
        return ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )


class CompletionFormat:
    def __init__(self, request_id: str, model: str, logprobs: bool, texts: TokenTexts) -> None:
        self.id, self.model, self.logprobs, self.texts = f"cmpl-{request_id}", model, logprobs, texts
        self.created = int(time.time())
        self._text_offset: dict[int, int] = {}  # per choice: where its next streamed token starts

    def _completion(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def opening(self, choices: int) -> Sequence[BaseModel]:
        return []

    def _logprobs(
        self, tokens: list[EmittedToken], offset: int, echo_first: int | None, echoed: list[EmittedToken]
    ) -> CompletionLogprobs:
        """The echoed prompt's logprobs (its first token has none: nothing precedes it), then the tokens'."""
        out = CompletionLogprobs()
        if echo_first is not None:
            text = self.texts(echo_first)[0]
            out.tokens.append(text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(text)
            prompt = completion_logprobs(echoed, self.texts, offset)
            offset += sum(len(t) for t in prompt.tokens)
            _extend(out, prompt)
        _extend(out, completion_logprobs(tokens, self.texts, offset))
        return out

    def chunk(self, piece: Piece) -> Sequence[BaseModel]:
        logprobs = None
        if self.logprobs:
            offset = self._text_offset.get(piece.index, 0)
            first = piece.echo_first if piece.echo is not None else None
            logprobs = self._logprobs(piece.tokens, offset, first, piece.echoed)
            self._text_offset[piece.index] = offset + sum(len(t) for t in logprobs.tokens)
        text = (piece.echo or "") + piece.text
        choice = CompletionChoice(
            index=piece.index, text=text, logprobs=logprobs, finish_reason=_finish(piece.finish_reason),
            stop_reason=piece.stop_reason,
        )  # fmt: skip
        return [self._completion([choice])]

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._completion([], usage)

    def whole(self, answers: list[Answer], usage: Usage) -> BaseModel:
        choices = [
            CompletionChoice(
                index=a.index,
                text=(a.echo or "") + a.text,
                logprobs=self._logprobs(a.tokens, 0, a.echo_first if a.echo is not None else None, a.echoed)
                if self.logprobs
                else None,
                finish_reason=_finish(a.finish_reason),
                stop_reason=a.stop_reason,
            )
            for a in answers
        ]
        return self._completion(choices, usage)


def _extend(out: CompletionLogprobs, more: CompletionLogprobs) -> None:
    out.tokens += more.tokens
    out.token_logprobs += more.token_logprobs
    out.top_logprobs += more.top_logprobs
    out.text_offset += more.text_offset


def _finish(reason: str | None) -> FinishReason | None:
    """The worker's finish reason as OpenAI names it (anything unexpected reads as "stop")."""
    if reason is None:
        return None
    if reason in ("length", "tool_calls"):
        return reason  # type: ignore[return-value]
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
        body.check_tools()
    except StructuredError as e:
        raise bad_request(str(e), param=e.param) from e
    await fe.compile_grammar(body)
    messages = [m.as_template_input() for m in body.messages]
    prompt = await fe.encode_chat(messages, body.template_tools(), body.add_special_tokens is True)
    max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    states = fe.start(
        request,
        prompt,
        body,
        body.requested_max_tokens(),
        body.requested_logprobs(),
        prompt_param="messages",
        caller=caller,
        max_tokens_param=max_tokens_param,
        choices=body.num_choices,
    )
    fmt = ChatFormat(
        states[0].request_id,
        body.model,
        body.logprobs is True,
        fe.token_texts,
        body.tool_mode(),
        [t.function.name for t in body.tools or []],
        body.parallel_tool_calls is not False,
    )
    return await fe.respond(request, "chat_completions", states, fmt, body, per_prompt=body.num_choices)


@api.post("/v1/completions", response_model=None, openapi_extra=openapi_body(CompletionRequest))
async def completions(
    request: Request,
    fe: FrontendDep,
    caller: Annotated[Principal, Depends(authorize)],
    body: Annotated[CompletionRequest, Depends(json_body(CompletionRequest))],
) -> Response:
    fe.check_model(body.model)
    caller.check_model(body.model)
    try:
        body.check_choices()
    except StructuredError as e:
        raise bad_request(str(e), param=e.param) from e
    await fe.compile_grammar(body)
    vocab = fe.tokenizer.vocab_size
    batch = body.prompts()
    prompts: list[list[int]] = []
    for i, p in enumerate(batch):
        param = "prompt" if len(batch) == 1 else f"prompt[{i}]"
        if isinstance(p, str):  # BOS/EOS as the tokenizer's metadata asks (vLLM's default for completions)
            prompts.append(await fe.encode(p, body.add_special_tokens is not False, "prompt"))
            continue
        bad = next((t for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(
                f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param="prompt"
            )
        prompts.append(list(p))
    n = body.num_choices
    best_of = body.best_of or n
    if best_of > n and body.stream:
        raise bad_request("best_of > n cannot be streamed (the best are known only at the end)", "best_of")
    # best_of ranks by cumulative logprob, so the workers return them even when the client did not ask
    logprobs = body.logprobs if body.logprobs is not None or best_of == n else 0
    max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    echo = body.echo is True
    echo_logprobs = echo and body.logprobs is not None
    if max_tokens == 0 and any(len(p) < 2 for p in prompts) and echo_logprobs:
        raise bad_request(
            "max_tokens=0 with logprobs scores the prompt, which needs at least 2 tokens", param="prompt"
        )
    if max_tokens == 0 and not echo_logprobs:
        return _echo_only(fe, request, body, batch, prompts)
    states = []
    for ids in prompts:
        states += fe.start(
            request, ids, body, max_tokens, logprobs, prompt_param="prompt", caller=caller,
            choices=best_of, echo_logprobs=echo_logprobs,
        )  # fmt: skip
    texts = [p if isinstance(p, str) else fe.tokenizer.decode(p) for p in batch] if echo else None
    fmt = CompletionFormat(states[0].request_id, body.model, body.logprobs is not None, fe.token_texts)
    return await fe.respond(request, "completions", states, fmt, body, per_prompt=best_of, keep=n, echo=texts)


def _echo_only(
    fe: Frontend,
    request: Request,
    body: CompletionRequest,
    batch: list[str | list[int]],
    prompts: list[list[int]],
) -> Response:
    """echo with max_tokens=0 and no logprobs: the answer is the prompts themselves; nothing to run. The
    prompts and parameters are checked as a request that runs is (until 2026-12-07 this path skipped the
    context length, the logit_bias ids and the grammar), and `stream` is honoured: one chunk per choice."""
    for p in prompts:
        fe.checked_params(p, body, 0, None, prompt_param="prompt")
    texts = [p if isinstance(p, str) else fe.tokenizer.decode(p) for p in batch]
    choices = [
        CompletionChoice(index=i * body.num_choices + k, text=text, finish_reason="length")
        for i, text in enumerate(texts)
        for k in range(body.num_choices)
    ]
    prompt_tokens = sum(len(p) for p in prompts)
    usage = Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=0,
        total_tokens=prompt_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=0),
    )
    ours = uuid.uuid4().hex
    headers = _id_headers(client_request_id(request.headers.get("x-request-id")), ours)
    answer = Completion(id=f"cmpl-{ours}", created=int(time.time()), model=body.model, choices=choices)
    if not body.stream:
        answer.usage = usage
        return Response(answer.model_dump_json(), media_type="application/json", headers=headers)

    def events() -> Iterator[str]:
        for choice in choices:
            yield _event(answer.model_copy(update={"choices": [choice]}))
        if body.include_usage:
            yield _event(answer.model_copy(update={"choices": [], "usage": usage}))
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={**headers, **SSE_HEADERS})


@api.post("/tokenize", response_model=None, openapi_extra=openapi_body(TokenizeRequest))
async def tokenize(
    fe: FrontendDep,
    caller: Annotated[Principal, Depends(authorize)],
    body: Annotated[TokenizeRequest, Depends(json_body(TokenizeRequest))],
) -> dict[str, Any]:
    """The token ids the model would see (vLLM's shape)."""
    if body.model is not None:
        fe.check_model(body.model)
    caller.check_model(fe.config.served_model_name)  # the served model's tokenizer, named or not
    # counted whatever their length (no context bound), but off the event loop
    if body.messages is not None:
        ids = await fe.encode_chat(
            [m.as_template_input() for m in body.messages],
            [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
            body.add_special_tokens is True,
            param=None,
            add_generation_prompt=body.add_generation_prompt is not False,
        )
    else:
        ids = await fe.encode(body.prompt or "", body.add_special_tokens is not False)
    return {"count": len(ids), "max_model_len": fe.max_model_len(), "tokens": ids}


@api.post("/detokenize", response_model=None, openapi_extra=openapi_body(DetokenizeRequest))
async def detokenize(
    fe: FrontendDep,
    caller: Annotated[Principal, Depends(authorize)],
    body: Annotated[DetokenizeRequest, Depends(json_body(DetokenizeRequest))],
) -> dict[str, Any]:
    if body.model is not None:
        fe.check_model(body.model)
    caller.check_model(fe.config.served_model_name)
    vocab = fe.tokenizer.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise bad_request(f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": fe.tokenizer.decode(body.tokens)}


@api.get("/version")
async def version() -> dict[str, str]:
    return {"version": _VERSION}


def _package_version() -> str:
    try:
        return importlib.metadata.version("rackserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


_VERSION = _package_version()


@api.get("/v1/models")
async def list_models(fe: FrontendDep, caller: Annotated[Principal, Depends(authorize)]) -> ModelList:
    """The served model, if the caller's key may use it (OpenAI lists the models a key can use)."""
    name = fe.config.served_model_name
    if caller.models is not None and name not in caller.models:
        return ModelList(data=[])
    return ModelList(data=[ModelCard(id=name, created=fe.created, max_model_len=fe.max_model_len())])


@api.get("/v1/models/{model:path}")
async def retrieve_model(
    model: str, fe: FrontendDep, caller: Annotated[Principal, Depends(authorize)]
) -> ModelCard:
    """One model (OpenAI's `GET /v1/models/{model}`, the SDK's `models.retrieve`): 404 for a model not served,
    and for one the caller's key may not use, as OpenAI answers it (the list leaves it out too)."""
    if caller.models is not None and model not in caller.models:
        raise model_not_found(model, None)
    fe.check_model(model)
    return ModelCard(id=model, created=fe.created, max_model_len=fe.max_model_len())


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
async def request_timeline(
    request_id: str, fe: FrontendDep, caller: Annotated[Principal, Depends(identify)]
) -> dict[str, Any]:
    """A finished request's timeline (one of the last `--timeline-history`): phases, workers, bytes, reason.
    Only the key that sent the request reads it; to any other it does not exist (404, as for an unknown id)."""
    record = fe.observer.timelines.get(request_id, owner=caller.name)
    if record is None:
        raise ApiError(
            404,
            f"no finished request {request_id!r} of this API key among the last "
            f"{fe.observer.timelines.capacity} (unknown, still running, or too old)",
            NOT_FOUND,
            param="request_id",
            code="request_not_found",
        )
    return record


PLAN_TIMEOUT_S = 2.0  # deadline of the planner's answer to GET /v1/plan


@api.get("/v1/plan", dependencies=[Depends(authorize)])
async def plan(fe: FrontendDep) -> dict[str, Any]:
    """The planner's latest decision (desired and actual pool sizes, the binding SLO, each candidate's
    predicted p90s), fetched from the planners found in discovery, all asked at once within one deadline: of
    several replicas, the one that leads (a standby's answer only names the leader, and is returned when no
    leader answers); 503 when none answers."""
    try:
        planners = fe.directory.workers("planner")
    except ValueError:  # a directory that does not follow planners (embedded use)
        planners = []
    async with DeadlineClient(PLAN_TIMEOUT_S) as client:

        async def ask(p: pb.WorkerInfo) -> dict[str, Any] | None:
            try:
                r = await client.get(f"http://{p.endpoint}/plan")
                r.raise_for_status()
                return {"planner": p.worker_id, **r.json()}
            except (httpx.HTTPError, ValueError) as e:
                log.info("planner %s did not answer GET /plan: %s", p.worker_id, e)
                return None

        # all at once: a replica that hangs costs one deadline, not one per replica asked before the leader
        answers = [a for a in await asyncio.gather(*(ask(p) for p in planners)) if a is not None]
    if answers:  # the leader's (the first in discovery order that does not stand by), else a standby's
        return min(answers, key=lambda a: a.get("outcome") == "standby")
    if not planners:  # the cluster runs without one: there is no plan to show (not a server fault)
        raise ApiError(
            404,
            "this cluster runs no planner (start `rackserve planner`, or `rackserve up --planner`)",
            NOT_FOUND,
            code="no_planner",
        )
    raise ApiError(503, "the planner did not answer", SERVICE_UNAVAILABLE, code="planner_unavailable")


@api.get("/traffic")
async def traffic(fe: FrontendDep, since: int = 0) -> dict[str, Any]:
    """The requests admitted in the last two minutes with a sequence number above `since`: when each arrived,
    its prompt length, and which earlier one it shares a prefix with and how many tokens of it
    (services/telemetry/traffic.py). The planner's `--replay-from recent` replays them. Like `/metrics`, no
    prompt text or hash: lengths and sequence numbers."""
    if since < 0:
        raise bad_request(f"since: must be >= 0, got {since}", param="since")
    records = fe.traffic.since(since)
    return {
        "share_tokens": SHARE_TOKENS,
        "now": time.time(),  # the clock the records' times are on: a reader on another host aligns by it
        "last": fe.traffic.last,
        "requests": [r.to_dict() for r in records],
    }


@api.get("/metrics")
async def prometheus_metrics() -> Response:
    body, content_type = metrics.exposition()
    return Response(body, media_type=content_type)


# the roles whose /metrics a scraper finds through discovery; the frontend and the planner serve it on their HTTP
# endpoint, the others on the metrics endpoint they register (none where --metrics-port is -1)
SCRAPED_ROLES = ("frontend", "router", "prefill", "decode", "planner")


@api.get("/metrics/targets")
async def prometheus_targets(fe: FrontendDep) -> list[dict[str, object]]:
    """Every registered service's /metrics in Prometheus' HTTP service discovery format (`http_sd_configs`), so
    a Prometheus outside Kubernetes follows the workers a launcher or the planner starts on ephemeral ports. As
    open as /metrics itself."""
    groups: list[dict[str, object]] = []
    for role in SCRAPED_ROLES:
        for w in fe.directory.workers(role):
            target = w.endpoint if role in ("frontend", "planner") else w.metrics_endpoint
            if target:
                groups.append({"targets": [target], "labels": {"service": role, "worker_id": w.worker_id}})
    return groups


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

    # FastAPI 0.16x traces every HTTP exchange through the global tracer provider, which --otlp-endpoint sets:
    # each request left a trace of FastAPI's beside its own, and every probe and scrape one more. A request's
    # trace is the one the frontend builds from its timeline (timeline.py); older FastAPIs take no such option.
    native: dict[str, Any] = (
        {"telemetry": {"tracing": False}} if "telemetry" in inspect.signature(FastAPI).parameters else {}
    )
    app = FastAPI(title="rackserve", summary="OpenAI-compatible frontend", lifespan=lifespan, **native)
    app.state.config = config
    app.state.guard = Guard(config.auth)
    app.state.frontend = Frontend(config, tokenizer, directory, coordinator, observer)
    metrics.export_healthy_workers(directory, ("router", "prefill", "decode"))
    install_error_handlers(app)
    app.include_router(api)
    app.add_middleware(RequestIdHeader)
    if config.allowed_origins:
        # outermost: a browser's preflight (OPTIONS, no Authorization) is answered before authentication
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["x-request-id", "x-rackserve-request-id", "retry-after"],
        )
    return app


class RequestIdHeader:
    """Every response names its request in `x-request-id`, as OpenAI's do: the client's own id echoed (vLLM
    echoes it too), else a fresh one. Responses of requests that ran set it themselves (with ours in
    x-rackserve-request-id); this covers the rest, errors first: until 2026-12-07 a 400, 404, 429 or 503 carried
    none, and the client's error object had no request id to match with the server's logs."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # the first x-request-id, as the request's own headers read it (Starlette's get), the same check
        sent = next((v for k, v in scope.get("headers") or [] if k == b"x-request-id"), b"")
        rid = response_request_id(sent.decode("latin-1")).encode("latin-1")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    message = {**message, "headers": [*headers, (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
