"""The frontend, specified by what a client sees.

Three rigs, cheapest first:
- a scripted cluster in this process: the real app (uvicorn, real sockets) in front of a scripted router and
  decode worker over real gRPC, for the paths a healthy worker never takes (a crash after 3 tokens, a refusal,
  a hang past the deadline, a stream cut short) and for what the frontend sends on the wire;
- the real frontend process on a real etcd with no router or worker: every client error, exact status and
  OpenAI error fields, and 503 + Retry-After;
- the whole aggregated path with real processes (etcd, router, decode worker, frontend) and the official
  `openai` client, when the router and decode servers exist in the tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from services.discovery import WorkerDirectory
from services.engine.tokenizer import Tokenizer
from services.frontend.app import FrontendConfig, create_app
from services.frontend.coordinator import Coordinator
from services.frontend.output import TextAssembler
from services.frontend.server import DEFAULT_MODEL_NAME, connection_aborter, load_tokenizer
from services.rpc import pb, pb_grpc
from services.runtime.channels import ChannelPool
from tests.support.cluster import wait_frontend_ready
from tests.support.etcd import EtcdServer, free_port
from tests.support.markers import starts_processes
from tests.support.paths import REPO

MODEL = DEFAULT_MODEL_NAME
FRANCE: Any = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."
STARTUP_TIMEOUT_S = 90.0


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("")[0]


# ---- text assembly, without any server ------------------------------------------------------------------------


def test_text_assembler_never_splits_a_character_and_holds_back_a_possible_stop(tokenizer: Tokenizer) -> None:
    text = "Café 🙂 naïve — done. STOP here"
    ids = tokenizer.encode(text)
    plain = TextAssembler(tokenizer, prompt_token_ids=[], stop=[])
    pieces = [plain.push([i]) for i in ids] + [plain.finish()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)

    stopping = TextAssembler(tokenizer, prompt_token_ids=[], stop=["STOP", "done!"])
    pieces = [stopping.push([i]) for i in ids] + [stopping.finish()]
    assert "".join(pieces) == "Café 🙂 naïve — done. " and stopping.stop_hit == "STOP"
    # "done" could still have become "done!", so it waited for the next token.
    assert not any(p.endswith("done") for p in pieces) and "done." in pieces


# ---- rig 1: a scripted router and decode worker ---------------------------------------------------------------


class ScriptedDecode(pb_grpc.DecodeWorkerServicer):
    """Answers every prompt with ANSWER, one token per chunk; words in the prompt change the script."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls: list[tuple[pb.DecodeRequest, dict[str, str], float | None]] = []
        self.cancelled = threading.Event()
        self.answer = tokenizer.encode(ANSWER) + [tokenizer.eos_token_id or 0]

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        self.calls.append((request, metadata, context.time_remaining()))
        prompt = self.tokenizer.decode(request.prompt_token_ids)
        answer = self.answer
        if "[say]" in prompt:  # the answer is the text between [say] and [/say]
            said = prompt.split("[say]", 1)[1].split("[/say]", 1)[0]
            answer = self.tokenizer.encode(said) + [self.tokenizer.eos_token_id or 0]
        try:
            if "[refuse]" in prompt:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the script refuses this prompt")
            if "[hang]" in prompt:
                await asyncio.sleep(3600)
            if "[flood]" in prompt:  # large chunks as fast as they go, for as long as the call lasts
                alternatives = [pb.TopLogprob(token_id=t, logprob=-1.0) for t in range(20)]
                for i in itertools.count():
                    token = pb.Token(token_id=self.answer[i % 4], index=i, has_logprob=True, logprob=-0.5)
                    token.top_logprobs.extend(alternatives)
                    yield pb.DecodeChunk(tokens=[token])
                    if i % 64 == 0:
                        await asyncio.sleep(0)
            stops = set(request.params.stop_token_ids)  # as an engine, stop at a stop token id
            cut = next((k for k, t in enumerate(answer) if t in stops), None)
            answer = answer if cut is None else answer[: cut + 1]
            for i, token_id in enumerate(answer):
                if "[crash-after-3]" in prompt and i == 3:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted crash")
                if "[cut-after-3]" in prompt and i == 3:
                    return
                last = i == len(answer) - 1
                token = pb.Token(token_id=token_id, index=i)
                if request.params.logprobs >= 0:
                    token.has_logprob, token.logprob = True, -0.25
                    alternatives = [(token_id, -0.25), (self.answer[0], -3.0)][: request.params.logprobs]
                    token.top_logprobs.extend(pb.TopLogprob(token_id=t, logprob=lp) for t, lp in alternatives)
                chunk = pb.DecodeChunk(tokens=[token], finished=last)
                if last:
                    chunk.finish_reason, chunk.stop_reason = "stop", str(token_id)
                if i == 0:
                    chunk.prompt_tokens, chunk.cached_tokens = len(request.prompt_token_ids), 16
                yield chunk
                await asyncio.sleep(0.3 if "[slow]" in prompt else 0.005)
        # GeneratorExit: cancelled while the reply's send waits
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled.set()
            raise


class ScriptedRouter(pb_grpc.RouterServicer):
    def __init__(self) -> None:
        self.decode_endpoint = ""
        self.failures: list[pb.FailureReport] = []
        self.reported = threading.Event()

    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext) -> pb.RoutePlan:  # noqa: N802
        decode = pb.WorkerRef(worker_id="decode-scripted", endpoint=self.decode_endpoint, role="decode")
        return pb.RoutePlan(decode=decode, reason="scripted")

    async def ReportFailure(self, request: pb.FailureReport, context: grpc.aio.ServicerContext) -> pb.Empty:  # noqa: N802
        self.failures.append(request)
        self.reported.set()
        return pb.Empty()


class StaticWorkers:
    def __init__(self, *workers: pb.WorkerInfo) -> None:
        self._workers = list(workers)

    def workers(self, role: str) -> list[pb.WorkerInfo]:
        return [w for w in self._workers if w.role == role]

    def suppress(self, worker_id: str, seconds: float, epoch: int | None = None) -> None:
        pass


class ScriptedCluster:
    """The real app on a real port, with the scripted router and worker, on one event loop in a thread."""

    def __init__(self, tokenizer: Tokenizer, **config: Any) -> None:
        self.tokenizer = tokenizer
        self.config = config  # FrontendConfig fields over the defaults below
        self.decode = ScriptedDecode(tokenizer)
        self.router = ScriptedRouter()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="scripted-cluster", daemon=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ScriptedCluster:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _grpc_server(self, add: Any, servicer: Any) -> tuple[grpc.aio.Server, str]:
        server = grpc.aio.server()
        add(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, f"127.0.0.1:{port}"

    async def _start(self) -> None:
        self.decode_server, decode_endpoint = await self._grpc_server(
            pb_grpc.add_DecodeWorkerServicer_to_server, self.decode
        )
        self.router_server, router_endpoint = await self._grpc_server(
            pb_grpc.add_RouterServicer_to_server, self.router
        )
        self.router.decode_endpoint = decode_endpoint
        directory = self.directory = StaticWorkers(
            pb.WorkerInfo(worker_id="router-scripted", role="router", endpoint=router_endpoint),
            pb.WorkerInfo(
                worker_id="decode-scripted", role="decode", endpoint=decode_endpoint, max_model_len=512
            ),
        )
        config = FrontendConfig(
            **{
                "served_model_name": MODEL,
                "request_timeout_s": 2.0,
                "stalled_client_grace_s": 1.0,
                "body_timeout_s": 1.0,
                **self.config,
            }
        )
        app = self.app = create_app(config, self.tokenizer, directory, Coordinator(directory, ChannelPool()))
        self.http = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", proxy_headers=False)
        )  # as server.serve configures it
        app.state.abort_connection = connection_aborter(self.http)  # as server.serve sets it
        self.serving = asyncio.get_running_loop().create_task(self.http.serve())
        while not self.http.started:
            assert not self.serving.done(), "uvicorn exited while starting"
            await asyncio.sleep(0.02)

    async def _stop(self) -> None:
        self.http.should_exit = True
        await self.serving
        await self.decode_server.stop(0)
        await self.router_server.stop(0)


@pytest.fixture(scope="module")
def scripted(tokenizer: Tokenizer) -> Iterator[ScriptedCluster]:
    with ScriptedCluster(tokenizer) as cluster:
        yield cluster


ECHO_ONLY = {"model": MODEL, "prompt": "hi", "echo": True, "max_tokens": 0}


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


def sse_events(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of an event stream, `[DONE]` as the string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_chat_sends_prompt_seed_deadline_and_trace_context_to_the_worker(scripted: ScriptedCluster) -> None:
    r = httpx.post(f"{scripted.url}/v1/chat/completions", json=chat("hello"), timeout=10)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
    assert body["choices"][0]["finish_reason"] == "stop"
    request, metadata, time_remaining = scripted.decode.calls[-1]
    prompt = scripted.tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    assert list(request.prompt_token_ids) == prompt
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(scripted.decode.answer),
        "total_tokens": len(prompt) + len(scripted.decode.answer),
        "prompt_tokens_details": {"cached_tokens": 16},
    }
    assert request.params.seed != 0 and request.params.max_tokens == 512 - len(prompt)
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", metadata["traceparent"])
    assert metadata["x-request-id"] == request.request_id == r.headers["x-request-id"]
    assert time_remaining is not None and 0 < time_remaining <= 2.0


def test_client_trace_is_continued_and_request_ids_stay_unique(scripted: ScriptedCluster) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01", "x-request-id": "client-req-1"}
    r = httpx.post(
        f"{scripted.url}/v1/chat/completions", json=chat("hi", seed=7), headers=headers, timeout=10
    )
    assert r.status_code == 200
    request, metadata, _ = scripted.decode.calls[-1]
    assert (
        metadata["traceparent"].startswith(f"00-{trace_id}-")
        and "00f067aa0ba902b7" not in metadata["traceparent"]
    )
    assert request.params.seed == 7
    # the client gets its own id back; ours (what the worker saw) travels beside it
    assert r.headers["x-request-id"] == "client-req-1"
    assert r.headers["x-rackserve-request-id"] == request.request_id
    # The client's x-request-id goes to the log only: two requests reusing it stay two requests to the worker.
    httpx.post(f"{scripted.url}/v1/chat/completions", json=chat("hi"), headers=headers, timeout=10)
    assert scripted.decode.calls[-1][0].request_id != request.request_id


def test_stop_string_truncates_and_streamed_text_never_shows_it(scripted: ScriptedCluster) -> None:
    with httpx.stream(
        "POST",
        f"{scripted.url}/v1/chat/completions",
        json=chat("x", stream=True, stop=["France is"]),
        timeout=10,
    ) as r:
        events = sse_events(r)
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]]
    assert "".join(deltas) == "The capital of "
    assert all("France" not in d for d in deltas)  # held back until " is" showed it to be the stop string
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1] == "[DONE]"
    r = httpx.post(f"{scripted.url}/v1/completions", json={"model": MODEL, "prompt": "x", "stop": "France"})
    assert r.json()["choices"][0] == {
        "index": 0,
        "text": "The capital of ",
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": "France",
    }


def test_stream_usage_and_logprobs(scripted: ScriptedCluster) -> None:
    body = chat("x", stream=True, stream_options={"include_usage": True}, logprobs=True, top_logprobs=2)
    with httpx.stream("POST", f"{scripted.url}/v1/chat/completions", json=body, timeout=10) as r:
        events = sse_events(r)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage_event = events[-2]
    assert usage_event["choices"] == [] and usage_event["usage"]["completion_tokens"] == len(
        scripted.decode.answer
    )
    entries = [c for e in events[1:-2] for c in e["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in entries][:3] == ["The", " capital", " of"]
    assert entries[1]["bytes"] == list(b" capital") and entries[1]["logprob"] == -0.25
    assert [t["logprob"] for t in entries[1]["top_logprobs"]] == [-0.25, -3.0]
    r = httpx.post(
        f"{scripted.url}/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "logprobs": 1}
    )
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"][:2] == ["The", " capital"] and lp["text_offset"][:3] == [0, 3, 11]
    assert lp["top_logprobs"][1] == {" capital": -0.25}


def test_legacy_top_logprobs_always_hold_the_token_itself(scripted: ScriptedCluster) -> None:
    """OpenAI: "the API will always return the logprob of the sampled token, so there may be up to logprobs+1
    elements"; with `logprobs: 0` each position is the token alone (an empty dict until 2026-12-07, which a
    harness taking the max of it crashed on)."""
    for k in (0, 2):
        body = {"model": MODEL, "prompt": [1, 2, 3], "logprobs": k, "max_tokens": 4}
        lp = httpx.post(f"{scripted.url}/v1/completions", json=body).json()["choices"][0]["logprobs"]
        assert lp["tokens"] and len(lp["top_logprobs"]) == len(lp["tokens"])
        for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
            assert next(iter(top.items())) == (token, logprob) and len(top) <= k + 1


def test_worker_invalid_argument_is_400(scripted: ScriptedCluster) -> None:
    for stream in (False, True):
        r = httpx.post(
            f"{scripted.url}/v1/chat/completions", json=chat("[refuse]", stream=stream), timeout=10
        )
        assert r.status_code == 400
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert "the script refuses this prompt" in r.json()["error"]["message"]


def test_worker_past_the_deadline_is_504(scripted: ScriptedCluster) -> None:
    r = httpx.post(f"{scripted.url}/v1/chat/completions", json=chat("[hang]"), timeout=10)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["type"] == "timeout_error"


def test_decode_crash_after_3_tokens_reports_failure_and_ends_stream_with_error(
    scripted: ScriptedCluster,
) -> None:
    scripted.router.reported.clear()
    with httpx.stream(
        "POST", f"{scripted.url}/v1/chat/completions", json=chat("[crash-after-3]", stream=True), timeout=10
    ) as r:
        assert r.status_code == 200
        events = sse_events(r)
    text = "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in events
        if isinstance(e, dict) and "choices" in e
    )
    assert text == "The capital of"
    error = events[-2]["error"]
    assert error["type"] == "service_unavailable_error" and "after 3 tokens" in error["message"]
    assert events[-1] == "[DONE]"
    assert scripted.router.reported.wait(5)
    report = scripted.router.failures[-1]
    assert report.worker_id == "decode-scripted" and "UNAVAILABLE" in report.cause


def test_stream_cut_short_every_time_fails_past_the_migration_limit_not_silently(
    scripted: ScriptedCluster,
) -> None:
    # The scripted router always names the one scripted worker, which cuts every attempt after 3 tokens.
    r = httpx.post(f"{scripted.url}/v1/chat/completions", json=chat("[cut-after-3]"), timeout=10)
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["code"] == "migration_limit_exceeded"
    assert "after 3 tokens" in error["message"] and "--migration-limit 3" in error["message"]


def test_client_disconnect_cancels_the_worker_call(scripted: ScriptedCluster) -> None:
    for stream in (True, False):
        scripted.decode.cancelled.clear()
        with httpx.Client(timeout=10) as client:
            if stream:
                with client.stream(
                    "POST", f"{scripted.url}/v1/chat/completions", json=chat("[slow]", stream=True)
                ) as r:
                    next(r.iter_lines())
            else:
                with pytest.raises(httpx.ReadTimeout):
                    client.post(f"{scripted.url}/v1/chat/completions", json=chat("[slow]"), timeout=0.5)
        # Well before the 2 s request deadline, which would also cancel it.
        assert scripted.decode.cancelled.wait(1.0), f"worker call not cancelled (stream={stream})"


def test_a_stream_whose_client_stops_reading_is_cut_after_its_deadline(scripted: ScriptedCluster) -> None:
    """A client that stops reading a stream but keeps its connection open: the frontend's writes block once the
    socket buffers are full. They give up at the request's deadline (2 s here) plus the grace (1 s), so the
    request leaves admission, the worker's call is cancelled and the connection is closed. Until 2026-12-07
    nothing bounded them: the request held its slot and a drain waited for it as long as the client lived."""
    scripted.decode.cancelled.clear()
    body = json.dumps(chat("[flood]", stream=True, max_tokens=400, logprobs=True, top_logprobs=20)).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", scripted.port))
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"x-request-id: stalled-reader\r\nx-forwarded-for: 203.0.113.5\r\n"  # a local proxy in front
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        sent_at = time.monotonic()
        assert sock.recv(64).startswith(b"HTTP/1.1 200")  # then it reads nothing more
        record = None
        for _ in range(100):  # the request ends within the deadline and the grace, not when the client goes
            r = httpx.get(f"{scripted.url}/v1/requests/stalled-reader/timeline", timeout=10)
            if r.status_code == 200:
                record = r.json()
                break
            time.sleep(0.1)
        assert record is not None, "the stalled stream never ended"
        # recorded as the client's doing (499), once its deadline had passed: the cut, not some earlier error
        assert record["status"] == 499 and record["error_type"] == "client_closed"
        assert time.monotonic() - sent_at >= 2.0
        assert scripted.decode.cancelled.wait(5.0)  # the worker stopped generating for it
        # and the server let the connection go at once, though the client still reads nothing (a graceful
        # close would wait to flush, holding the socket, and a drain, as long as the client keeps it)
        mine = sock.getsockname()
        for _ in range(50):
            if not any(getattr(c, "client", None) == mine for c in scripted.http.server_state.connections):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the cut connection is still open")
        sock.settimeout(10)
        while sock.recv(1 << 16):  # what the kernel had buffered, then the end
            pass
    finally:
        sock.close()


def test_tokenize_renders_tools_and_the_generation_prompt_as_chat_does(tokenizer: Tokenizer) -> None:
    """/tokenize with messages counts what a chat request with the same tools sends the model (it ignored
    `tools` and `add_generation_prompt` until 2026-12-07), and refuses the template options it does not apply.
    SmolLM2's template ignores tools, so this cluster's tokenizer gets one that prints their names."""
    templated = copy.copy(tokenizer)
    templated.chat_template = (
        "{% for t in tools or [] %}tool {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    templated._compiled_template = None
    messages = [{"role": "user", "content": "weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with ScriptedCluster(templated) as cluster, httpx.Client(base_url=cluster.url, timeout=10) as http:
        used = http.post("/v1/chat/completions", json=chat("weather in Paris?", tools=tools)).json()
        counted = http.post("/tokenize", json={"messages": messages, "tools": tools}).json()
        assert counted["count"] == used["usage"]["prompt_tokens"]
        plain = http.post("/tokenize", json={"messages": messages}).json()
        assert templated.decode(counted["tokens"]) == "tool get_weather\n" + templated.decode(plain["tokens"])
        bare = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
        assert templated.decode(bare["tokens"]) == "user: weather in Paris?\n"
        for refused in (
            {"chat_template": "x"},
            {"continue_final_message": True},
            {"return_token_strs": True},
        ):
            r = http.post("/tokenize", json={"messages": messages, **refused})
            assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(refused))
        r = http.post("/tokenize", json={"prompt": "hi", "tools": tools})
        assert r.status_code == 400 and "apply to messages" in r.json()["error"]["message"]


def test_min_tokens_holds_back_stop_strings_within_its_tokens(scripted: ScriptedCluster) -> None:
    """vLLM looks for stop strings only past min_tokens: "capital" ends at the answer's second token, so
    with min_tokens 6 it does not stop the answer (it did until 2026-12-07), and with min_tokens 1 it does."""
    for url in (f"{scripted.url}/v1/chat/completions", f"{scripted.url}/v1/completions"):
        body = chat("hi") if url.endswith("chat/completions") else {"model": MODEL, "prompt": "hi"}
        # "capital" ends with the 2nd token: within min_tokens 2 it does not stop, past min_tokens 1 it does;
        # "The cap" begins in the 1st token's text and ends past it, so with min_tokens 1 it stops at once
        for stop, min_tokens, want in (("capital", 6, ANSWER), ("capital", 2, ANSWER), ("capital", 1, "The "),
                                       ("The cap", 1, "")):  # fmt: skip
            r = httpx.post(url, json={**body, "stop": [stop], "min_tokens": min_tokens}, timeout=10)
            choice = r.json()["choices"][0]
            text = (choice.get("message") or {}).get("content", choice.get("text"))
            assert (text or "") == want, (url, stop, min_tokens)
            assert choice["finish_reason"] == "stop"


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_tool_calls_are_calls_of_offered_tools_only_and_at_most_one_when_asked(
    scripted: ScriptedCluster,
) -> None:
    """With tools offered, a JSON answer that has a "name" key is an answer (until 2026-12-07 it became a call
    of a tool named "Bob" and the content was lost), and so is a call of a tool nobody offered; two calls of an
    offered tool are two calls, or one with parallel_tool_calls false; a named tool_choice ends with "stop"."""
    client = openai.OpenAI(base_url=f"{scripted.url}/v1", api_key="none", max_retries=0)

    def ask(said: str, **kw: Any) -> Any:
        msgs = [{"role": "user", "content": f"[say]{said}[/say]"}]
        return client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], **kw).choices[0]

    person = '{"name": "Bob", "age": 3}'
    for said in (person, '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'):
        choice = ask(said)
        assert choice.message.content == said and not choice.message.tool_calls, said
        assert choice.finish_reason == "stop"
    two = 'On it.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' + (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    )
    choice = ask(two)
    assert choice.message.content == "On it." and choice.finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments)["city"] for c in choice.message.tool_calls] == ["Paris", "Rome"]
    one = ask(two, parallel_tool_calls=False).message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in one] == ["Paris"]
    named = ask('{"city": "Oslo"}', tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.finish_reason == "stop" and named.message.tool_calls[0].function.name == "get_weather"


def test_with_tools_text_before_a_possible_call_streams_as_it_comes(scripted: ScriptedCluster) -> None:
    """A request with tools that the model answers in text streams that text token by token (until
    2026-12-07 it came in one chunk at the end); the text before a Hermes call streams too, the call comes
    whole at the end, and a Llama-3 style JSON call is never shown as content."""
    client = openai.OpenAI(base_url=f"{scripted.url}/v1", api_key="none", max_retries=0)

    def stream(content: str) -> list[Any]:
        msgs = [{"role": "user", "content": content}]
        return [c.choices[0].delta for c in client.chat.completions.create(
            model=MODEL, messages=msgs, tools=[WEATHER], stream=True) if c.choices]  # fmt: skip

    deltas = stream("hello")
    pieces = [d.content for d in deltas if d.content]
    assert len(pieces) > 3 and "".join(pieces) == ANSWER
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    deltas = stream(f"[say]Let me check the weather.{call}[/say]")
    pieces = [d.content for d in deltas if d.content]
    assert len(pieces) > 3 and "".join(pieces) == "Let me check the weather."
    calls = [c for d in deltas for c in d.tool_calls or []]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    deltas = stream('[say] {"name": "get_weather", "parameters": {"city": "Rome"}}[/say]')
    assert not any(d.content for d in deltas)
    assert [c.function.name for d in deltas for c in d.tool_calls or []] == ["get_weather"]


def test_every_response_names_its_request_and_streams_pass_proxies(scripted: ScriptedCluster) -> None:
    """x-request-id on every response, errors included (until 2026-12-07 a 400, 404 or a failed request's
    503 carried none, so the client's error had no id to match the server's logs with); a request that ran
    and failed also names ours, the timeline's key. Event streams say not to cache or buffer them."""
    url = f"{scripted.url}/v1/chat/completions"
    sent = {"x-request-id": "client-abc"}
    for body, status in (
        (chat("hi", model="nope"), 404),
        (chat("hi", temperature=9), 400),
        (chat("[refuse]"), 400),
    ):
        r = httpx.post(url, json=body, headers=sent, timeout=10)
        assert r.status_code == status and r.headers["x-request-id"] == "client-abc", r.text
    ran = httpx.post(url, json=chat("[refuse]"), headers=sent, timeout=10)
    timeline = httpx.get(f"{scripted.url}/v1/requests/{ran.headers['x-rackserve-request-id']}/timeline")
    assert timeline.status_code == 200 and timeline.json()["status"] == 400
    anonymous = httpx.post(url, json=chat("hi", model="nope"), timeout=10).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", anonymous)  # a fresh one where the client sent none
    client = openai.OpenAI(base_url=f"{scripted.url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert e.value.request_id
    with httpx.stream("POST", url, json=chat("hi", stream=True), timeout=10) as r:
        assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
    # one rule for every path: an id over 128 characters (or unprintable) is replaced, the first of two is kept
    for path, body in (("/v1/chat/completions", chat("hi")), ("/v1/chat/completions", chat("hi", model="nope")),
                       ("/v1/completions", ECHO_ONLY)):  # fmt: skip
        long = httpx.post(f"{scripted.url}{path}", json=body, headers={"x-request-id": "x" * 200}, timeout=10)
        assert re.fullmatch(r"[0-9a-f]{32}", long.headers["x-request-id"]), (
            path,
            long.headers["x-request-id"],
        )
        two = httpx.post(f"{scripted.url}{path}", json=body, timeout=10,
                         headers=[("x-request-id", "first"), ("x-request-id", "second")])  # fmt: skip
        assert two.headers["x-request-id"] == "first", path


def test_a_500_names_its_request_too(scripted: ScriptedCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug's 500 is answered outside every middleware (Starlette's ServerErrorMiddleware): it names the
    request all the same."""
    from services.frontend import app as app_module

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(app_module.ChatFormat, "whole", broken)
    r = httpx.post(
        f"{scripted.url}/v1/chat/completions", json=chat("hi"), headers={"x-request-id": "cid-500"}
    )
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert r.headers["x-request-id"] == "cid-500"


def test_each_choice_says_what_stopped_it_as_vllm_does(scripted: ScriptedCluster) -> None:
    """vLLM's stop_reason: the stop string, the stop token id (an int), or null for EOS; on the whole answer and
    on the stream's last chunk, for chat and completions. Not sent until 2026-12-07."""
    eos = scripted.tokenizer.eos_token_id
    capital = scripted.tokenizer.encode(" capital")[0]  # the answer's second token
    cases = [({"stop": ["France"]}, "France"), ({"stop_token_ids": [capital]}, capital), ({}, None),
             ({"stop_token_ids": [eos]}, None)]  # EOS is checked first, as vLLM does: null  # fmt: skip
    for path, body in (
        ("/v1/chat/completions", chat("hi")),
        ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
    ):
        for extra, want in cases:
            whole = httpx.post(f"{scripted.url}{path}", json={**body, **extra}, timeout=10).json()["choices"][
                0
            ]
            assert whole["finish_reason"] == "stop" and whole["stop_reason"] == want, (path, extra, whole)
            with httpx.stream("POST", f"{scripted.url}{path}", json={**body, **extra, "stream": True}) as r:
                last = [e for e in sse_events(r) if e != "[DONE]" and e["choices"]][-1]["choices"][0]
            assert last["finish_reason"] == "stop" and last["stop_reason"] == want, (path, extra, last)


def test_a_reading_client_past_its_deadline_gets_the_timeout_and_the_end_of_the_stream(
    scripted: ScriptedCluster,
) -> None:
    """The cut of a stalled stream waits the grace past the deadline: a client that reads still gets the
    request's timeout as an error event, then [DONE]."""
    with httpx.stream("POST", f"{scripted.url}/v1/chat/completions", json=chat("[slow]", stream=True),
                      timeout=10) as r:  # fmt: skip
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout", events[-2:]


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.mark.parametrize(
    "said",
    [
        "Plain words.", "  Leading and trailing  ", f"Let me check. {CALL}", f"\n\nLet me check.{CALL}",
        f"Hi.{CALL} And.{CALL} Bye.", f"A {CALL}{CALL}", f"\n\n{CALL}", f"  {CALL}",
        '{"name": "get_weather", "parameters": {"city": "Rome"}}', '<|python_tag|>{"name": "get_weather"}',
        '{"name": "Bob", "age": 3}', "a < b and {c}", f"{CALL} after",
    ],
)  # fmt: skip
def test_a_choice_with_tools_streams_what_it_answers_whole(scripted: ScriptedCluster, said: str) -> None:
    """Streamed, a choice with tools carries the same content and calls as the whole answer (the text around
    calls as it is, no whitespace-only content), each token's logprob once, for each of n choices."""
    client = openai.OpenAI(base_url=f"{scripted.url}/v1", api_key="none", max_retries=0)
    kw: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": f"[say]{said}[/say]"}],
                          "tools": [WEATHER], "n": 2, "logprobs": True, "temperature": 0}  # fmt: skip
    whole = client.chat.completions.create(**kw)
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    for i, choice in enumerate(whole.choices):
        deltas = [c.choices[0] for c in chunks if c.choices[0].index == i]
        content = "".join(d.delta.content or "" for d in deltas)
        assert content == (choice.message.content or ""), (said, content)
        calls = [(c.function.name, c.function.arguments) for d in deltas for c in d.delta.tool_calls or []]
        assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert deltas[-1].finish_reason == choice.finish_reason
        streamed = [t.token for d in deltas if d.logprobs for t in d.logprobs.content]
        assert streamed == [t.token for t in choice.logprobs.content]


def test_a_required_or_named_tool_choice_never_streams_its_call_as_content(scripted: ScriptedCluster) -> None:
    client = openai.OpenAI(base_url=f"{scripted.url}/v1", api_key="none", max_retries=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, said in (("required", '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'),
                         (named, '{"city": "Oslo"}')):  # fmt: skip
        msgs = [{"role": "user", "content": f"[say]{said}[/say]"}]
        deltas = [c.choices[0].delta for c in client.chat.completions.create(
            model=MODEL, messages=msgs, tools=[WEATHER], tool_choice=choice, stream=True) if c.choices]  # fmt: skip
        assert not any(d.content for d in deltas)
        [call] = [c for d in deltas for c in d.tool_calls or []]
        assert json.loads(call.function.arguments) == {"city": "Oslo"}


def test_a_required_or_named_tool_choice_streams_a_null_content_as_it_answers_whole(
    scripted: ScriptedCluster,
) -> None:
    """The SDK's stream helper accumulates the deltas into the message the whole answer gives: a call and no
    content (null), not content "" from the opening chunk (until 2026-12-07)."""
    client = openai.OpenAI(base_url=f"{scripted.url}/v1", api_key="none", max_retries=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, said in (("required", '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'),
                         (named, '{"city": "Oslo"}')):  # fmt: skip
        kw: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": f"[say]{said}[/say]"}],
                              "tools": [WEATHER], "tool_choice": choice}  # fmt: skip
        whole = client.chat.completions.create(**kw).choices[0].message
        with client.chat.completions.stream(**kw) as stream:
            streamed = stream.get_final_completion().choices[0].message
        assert whole.content is None and streamed.content is None, (choice, streamed.content)
        assert [c.function.arguments for c in streamed.tool_calls or []] == [
            c.function.arguments for c in whole.tool_calls or []
        ]


def test_a_grammar_too_costly_to_compile_is_refused_and_stalls_nobody(
    scripted: ScriptedCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A schema whose grammar takes seconds to compile (this one ~3 s here; its 5-deep sibling 15 s, a 30-deep
    one over 280 s) compiled on the frontend's event loop and froze every request it served (until
    2026-12-07). It now compiles on a thread of its own and is refused past the deadline (0.5 s here, 10 s by
    default), while the frontend answers others meanwhile."""
    from services.engine import structured

    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 0.5)
    costly = {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "string", "pattern": "(([a-z]{0,4}){0,4}){0,4}"}}}  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        refused = pool.submit(
            httpx.post,
            f"{scripted.url}/v1/chat/completions",
            json=chat("hi", response_format=costly),
            timeout=30,
        )
        time.sleep(0.2)  # the compile has started
        assert httpx.get(f"{scripted.url}/livez", timeout=1.5).status_code == 200  # the loop is free
        r = refused.result()
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "did not compile within 0.5 s" in r.json()["error"]["message"]
    time.sleep(3.5)  # let the compile end before the next test needs the CPU


def test_tokenizing_megabytes_leaves_the_event_loop_free(scripted: ScriptedCluster) -> None:
    """A 3.4 MB /tokenize takes seconds to tokenize; on the event loop (and on a thread holding the GIL, as the
    tokenizer's single-text call does) every other request waited for it: /livez answered after 3 s and a
    victim's median latency went from 0.07 s to 22 s (the security audit; until 2026-12-07)."""
    text = "hello world, the quick brown fox. " * 100_000
    with ThreadPoolExecutor(1) as pool:
        counting = pool.submit(httpx.post, f"{scripted.url}/tokenize", json={"prompt": text}, timeout=60)
        time.sleep(0.3)  # the tokenizing has started
        assert (
            httpx.get(f"{scripted.url}/livez", timeout=1.0).status_code == 200
        )  # the loop answers meanwhile
        r = counting.result()
    assert r.status_code == 200 and r.json()["count"] > 500_000


def test_a_text_longer_than_any_context_is_refused_before_it_is_tokenized(
    scripted: ScriptedCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More characters than the context's tokens could hold whatever they are (the context, 512 here, times the
    longest token's characters, with a margin): a 400 before any tokenizing, which on megabytes took seconds."""
    calls: list[int] = []
    encode = scripted.tokenizer.encode
    monkeypatch.setattr(
        scripted.tokenizer, "encode", lambda text, *a, **kw: calls.append(len(text)) or encode(text, *a, **kw)
    )
    r = httpx.post(f"{scripted.url}/v1/chat/completions", json=chat("x" * 200_000), timeout=30)
    assert "more than that many tokens can hold" in assert_error(
        r, 400, "invalid_request_error", "messages", "context_length_exceeded"
    )
    r = httpx.post(
        f"{scripted.url}/v1/completions", json={"model": MODEL, "prompt": "y" * 200_000}, timeout=30
    )
    assert_error(r, 400, "invalid_request_error", "prompt", "context_length_exceeded")
    assert calls == []


def test_a_body_that_does_not_arrive_in_time_is_a_408(
    scripted: ScriptedCluster,
) -> None:
    """A client that sends its headers and then trickles (or holds) its body kept the request's memory for as
    long as it liked (150 such held 600 MB; the security audit, until 2026-12-07). Here --body-timeout-s is 1."""
    host, port = scripted.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n" + b'{"model": "' + b"x" * 20
        )
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:200]
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_one_key_cannot_hold_every_slot_with_long_requests(tokenizer: Tokenizer) -> None:
    """--max-concurrent-per-key: a key within its rate held all of --max-concurrent-requests with requests that
    run long (here ones that hang to their 2 s deadline), and every other key got 429 (the security audit)."""
    from services.frontend.auth import AuthConfig
    from services.runtime.api_keys import load_api_keys

    keys = AuthConfig(load_api_keys("sk-team-a-1,sk-team-b-2"))  # named key-0 and key-1
    with ScriptedCluster(tokenizer, auth=keys, max_concurrent_requests=8, max_concurrent_per_key=2) as c:

        def post(key: str, content: str) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"}
            return httpx.post(f"{c.url}/v1/chat/completions", json=chat(content), headers=headers, timeout=30)

        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(post, "sk-team-a-1", "[hang]") for _ in range(2)]
            time.sleep(0.5)  # both admitted and hanging
            third = post("sk-team-a-1", "hi")
            assert "--max-concurrent-per-key" in assert_error(
                third, 429, "rate_limit_error", code="overloaded"
            )
            assert post("sk-team-b-2", "hi").status_code == 200  # another key still gets in
            assert [f.result().status_code for f in held] == [504, 504]
        assert post("sk-team-a-1", "hi").status_code == 200  # its slots are free again


def test_a_request_refused_under_overload_leaves_a_timeline_under_the_ids_its_429_names(
    tokenizer: Tokenizer,
) -> None:
    """A 429 at admission is a request like another for whoever looks it up: its answer names its ids, and its
    timeline (the same record as its log line and trace) says it was refused; until 2026-12-07 it had neither.
    The phase histograms stay the served requests'."""
    with ScriptedCluster(tokenizer, max_concurrent_requests=1) as c:
        url = f"{c.url}/v1/chat/completions"
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(httpx.post, url, json=chat("[hang]"), timeout=30)
            time.sleep(0.5)  # admitted and hanging
            queued_before = _samples(c.url, "rackserve_request_phase_seconds_count")
            refused = httpx.post(url, json=chat("hi"), headers={"x-request-id": "client-7"}, timeout=30)
            assert_error(refused, 429, "rate_limit_error", code="overloaded")
            assert refused.headers["x-request-id"] == "client-7"
            ours = refused.headers["x-rackserve-request-id"]
            timeline = httpx.get(f"{c.url}/v1/requests/{ours}/timeline", timeout=10)
            assert timeline.status_code == 200
            record = timeline.json()
            assert (record["status"], record["phase"], record["error_type"]) == (429, "failed", "overloaded")
            assert httpx.get(f"{c.url}/v1/requests/client-7/timeline", timeout=10).json() == record
            assert _samples(c.url, "rackserve_request_phase_seconds_count") == queued_before
            assert held.result().status_code == 504


def test_a_stream_whose_client_leaves_before_the_first_write_leaves_admission(
    scripted: ScriptedCluster,
) -> None:
    """The client goes away while the response's first write waits (its window shut): the event generator never
    ran, so its cleanup never did, and the request kept its admission slot (and, per key, one of the key's) for
    good, with the workers' calls running (the desk review; until 2026-12-07). Called here as uvicorn calls the
    app, with a `send` that never completes."""
    body = json.dumps(chat("hi", stream=True)).encode()
    fe = scripted.app.state.frontend
    before = fe.in_flight

    async def call() -> None:
        parts = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if parts:
                return parts.pop()
            await asyncio.sleep(0.5)  # after the request was taken
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                await asyncio.sleep(3600)  # the client's window is shut: the first write never completes

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
            "root_path": "", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", scripted.port),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }  # fmt: skip
        await asyncio.wait_for(scripted.app(scope, receive, send), 10)

    asyncio.run_coroutine_threadsafe(call(), scripted.loop).result(20)
    assert fe.in_flight == before and not fe._in_flight_by_key


def test_metrics_count_requests_and_tokens(scripted: ScriptedCluster) -> None:
    httpx.post(f"{scripted.url}/v1/chat/completions", json=chat("metrics"), timeout=10)
    text = httpx.get(f"{scripted.url}/metrics").text
    assert re.search(
        r'rackserve_frontend_requests_total\{endpoint="chat_completions",status="200"\} [1-9]', text
    )
    assert re.search(r"rackserve_time_to_first_token_seconds_count [1-9]", text)
    assert re.search(r"rackserve_generation_tokens_total [1-9]", text)


def _samples(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def test_requests_refused_before_they_start_are_counted_once_each(scripted: ScriptedCluster) -> None:
    """A 400 for a bad body or parameter, a 404 for an unknown model: each is one request with its status in
    rackserve_frontend_requests_total and one error by type (the error-rate alert and the errors panel read
    them); until 2026-12-07 only requests that reached a worker were counted. A request that is served counts
    once, not again by the error handlers."""
    requests_total, errors_total = (
        "rackserve_frontend_requests_total",
        "rackserve_frontend_request_errors_total",
    )
    before = _samples(scripted.url, requests_total), _samples(scripted.url, errors_total)
    url = f"{scripted.url}/v1/chat/completions"
    assert httpx.post(url, content=b"{not json", timeout=10).status_code == 400
    assert httpx.post(url, json=chat("hi", temperature=-1), timeout=10).status_code == 400
    assert httpx.post(url, json={**chat("hi"), "model": "no-such-model"}, timeout=10).status_code == 404
    assert httpx.post(url, json=chat("counted once"), timeout=10).status_code == 200
    assert httpx.post(url, json=chat("[hang]"), timeout=10).status_code == 504  # taken, then failed
    after = _samples(scripted.url, requests_total), _samples(scripted.url, errors_total)

    def delta(i: int, **labels: str) -> float:
        key = tuple(sorted(labels.items()))
        return after[i].get(key, 0.0) - before[i].get(key, 0.0)

    assert delta(0, endpoint="chat_completions", status="400") == 2
    assert delta(0, endpoint="chat_completions", status="404") == 1
    assert delta(0, endpoint="chat_completions", status="200") == 1
    assert delta(0, endpoint="chat_completions", status="504") == 1  # at its end, not again by the handler
    assert sum(v for k, v in after[0].items()) - sum(before[0].values()) == 5
    assert sum(after[1].values()) - sum(before[1].values()) == 4
    assert delta(1, status="404", error_type="model_not_found") == 1


def test_traffic_log_names_the_earlier_request_a_prompt_shares_its_prefix_with(
    scripted: ScriptedCluster, tokenizer: Tokenizer
) -> None:
    """GET /traffic: what the planner's `--replay-from recent` replays. The same long message twice and then
    another: the second shares the first's whole prompt in 256-token prefixes, the third no whole one."""
    before = httpx.get(f"{scripted.url}/traffic", timeout=10).json()["last"]
    long = " ".join(f"word{i}" for i in range(90))
    for content in (long, long, "a different question"):
        r = httpx.post(f"{scripted.url}/v1/chat/completions", json=chat(content, max_tokens=4), timeout=10)
        assert r.status_code == 200, r.text
    got = httpx.get(f"{scripted.url}/traffic", params={"since": before}, timeout=10).json()
    first, second, third = got["requests"]
    assert got["share_tokens"] == 256 and got["last"] == third["seq"] == before + 3
    assert first["prompt_tokens"] == second["prompt_tokens"] > 256
    assert (second["parent"], second["shared_tokens"]) == (first["seq"], first["prompt_tokens"] // 256 * 256)
    assert (third["parent"], third["shared_tokens"]) == (None, 0)
    assert first["t"] <= second["t"] <= third["t"] <= got["now"]
    assert "word1" not in json.dumps(got)  # lengths and numbers, no prompt text
    bad = httpx.get(f"{scripted.url}/traffic", params={"since": -1}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"


@pytest.mark.cluster  # the planner's replay runs in its spawned process
def test_the_planner_replays_the_requests_the_frontend_logged_with_the_prefixes_they_shared(
    scripted: ScriptedCluster,
) -> None:
    """`rackserve planner --replay-from recent` against this frontend: its decision replays the requests the
    frontend admitted, their prompt lengths as the frontend counted them, the three that sent the same long
    message sharing its prefix in the replay's own KV blocks, the fourth sharing none of it."""
    import argparse
    from types import SimpleNamespace

    from loadgen.sim.engine import block_hashes_for
    from services.planner.server import Planner, add_arguments

    frontend = SimpleNamespace(worker_id="frontend-scripted", epoch=1, endpoint=f"127.0.0.1:{scripted.port}")
    directory = SimpleNamespace(workers=lambda role: [frontend] if role == "frontend" else [])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--replay-from", "recent", "--min-window-requests", "4", "--max-prefill", "2",
                              "--max-decode", "1"])  # fmt: skip
    planner = Planner(args, directory)  # type: ignore[arg-type]
    long = " ".join(f"word{i}" for i in range(90))

    async def go() -> tuple[dict[str, Any], list[Any], list[int]]:
        first = await planner.tick()
        assert first["outcome"] == "no_data"  # a frontend's first scrape opens the window
        lengths = []
        async with httpx.AsyncClient(timeout=10) as client:
            for content in (long, long, long, "something else entirely"):
                r = await client.post(f"{scripted.url}/v1/chat/completions", json=chat(content, max_tokens=4))
                assert r.status_code == 200, r.text
                lengths.append(r.json()["usage"]["prompt_tokens"])
        decision = await planner.tick()
        replayed = planner._recent(0.0) or []
        await planner.close()
        return decision, replayed, lengths

    decision, replayed, lengths = asyncio.run(go())
    assert decision["replayed"] == "recent" and decision["candidates"], decision
    mine = replayed[-4:]
    assert [s.input_tokens for s in mine] == lengths
    hashes = block_hashes_for(mine, 16)
    whole = lengths[0] // 256 * 256 // 16  # the long message's whole 256-token prefixes, in 16-token blocks
    assert hashes[1][:whole] == hashes[2][:whole] == hashes[0][:whole]
    assert hashes[3][0] not in set(hashes[0])


def test_plan_comes_from_the_leader_within_one_deadline_however_many_replicas_hang(
    scripted: ScriptedCluster,
) -> None:
    """GET /v1/plan with three planner replicas that accept the connection and never answer, and one that
    answers a byte every 0.3 s (each read within httpx's timeout; until 2026-12-07 that stretched the call to
    the body's length), listed before the leader and a standby: the frontend asks all at once, each within one
    deadline, so a client with a 5 s deadline gets the leader's plan (asked one after another, the three would
    take three 2 s deadlines first)."""
    from tests.support.http import json_server

    def answering(outcome: str) -> Any:
        return json_server(lambda path: {"outcome": outcome})

    hung = [socket.create_server(("127.0.0.1", 0)) for _ in range(4)]  # listening, never accepting
    body = json.dumps({"outcome": "hold", "padding": "x" * 60}).encode()

    def trickle() -> None:  # the fourth accepts, and sends its answer a byte at a time
        with contextlib.suppress(OSError):
            while True:
                conn, _ = hung[3].accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
                    for byte in body:
                        time.sleep(0.3)
                        conn.sendall(bytes([byte]))

    threading.Thread(target=trickle, daemon=True).start()
    leader, standby = answering("hold"), answering("standby")
    endpoints = [f"127.0.0.1:{h.getsockname()[1]}" for h in hung] + [
        f"127.0.0.1:{standby.server_address[1]}",
        f"127.0.0.1:{leader.server_address[1]}",
    ]
    names = ["hung-0", "hung-1", "hung-2", "trickling", "standby", "leader"]
    planners = [
        pb.WorkerInfo(worker_id=n, role="planner", endpoint=e) for n, e in zip(names, endpoints, strict=True)
    ]
    scripted.directory._workers.extend(planners)
    try:
        r = httpx.get(f"{scripted.url}/v1/plan", timeout=5.0)
        assert r.status_code == 200 and r.json() == {"planner": "leader", "outcome": "hold"}, r.text
        leader.shutdown()  # no leader answers: the standby's answer, which names none
        r = httpx.get(f"{scripted.url}/v1/plan", timeout=5.0)
        assert r.status_code == 200 and r.json() == {"planner": "standby", "outcome": "standby"}, r.text
    finally:
        for w in planners:
            scripted.directory._workers.remove(w)
        standby.shutdown()
        for h in hung:
            h.close()


# ---- processes ------------------------------------------------------------------------------------------------


def spawn(
    module: str, *args: str, log_dir: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """`python -m module args`, its output in log_dir/<module>.log (shown when a test fails)."""
    log = open(log_dir / f"{module.rsplit('.', 2)[-2]}.log", "ab")  # noqa: SIM115 - the process owns it
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", module, *args], cwd=REPO, env=environment, stdout=log, stderr=subprocess.STDOUT
    )


def stop_all(processes: list[subprocess.Popen[bytes]]) -> None:
    for p in processes:
        if p.poll() is None:
            p.terminate()
    for p in processes:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def wait_healthy(
    url: str, processes: list[subprocess.Popen[bytes]], log_dir: Path, roles: tuple[str, ...] = ()
) -> None:
    """Until GET /health answers and shows at least one worker of each of `roles`; else stop all, with logs."""
    try:
        wait_frontend_ready(
            url, roles, STARTUP_TIMEOUT_S, lambda: [p.args for p in processes if p.poll() is not None]
        )
    except RuntimeError as exc:
        logs = "\n".join(
            f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in log_dir.glob("*.log")
        )
        stop_all(processes)
        raise RuntimeError(f"{exc}\n{logs}") from exc


# ---- rig 2: the real frontend process, etcd, and nothing else ------------------------------------------------

BODY_LIMIT_BYTES = 65536


@pytest.fixture(scope="module")
@starts_processes
def lonely(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(frontend url, etcd url): a frontend with no router or worker; its body limit set by environment."""
    log_dir = tmp_path_factory.mktemp("lonely")
    with EtcdServer(data_dir=str(log_dir / "etcd")) as etcd:
        port = free_port()
        env = {"RACKSERVE_MAX_BODY_BYTES": str(BODY_LIMIT_BYTES)}
        frontend = spawn(
            "services.frontend.server", "--etcd", etcd.url, "--port", str(port), log_dir=log_dir, env=env
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, [frontend], log_dir)
            yield url, etcd.url
        finally:
            stop_all([frontend])


def assert_error(
    r: httpx.Response, status: int, type: str, param: str | None = None, code: str | None = None
) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == (type, param), error
    if code is not None:
        assert error["code"] == code, error
    return str(error["message"])


@pytest.mark.cluster
def test_past_max_connections_the_refusal_is_an_openai_error_with_retry_after(tmp_path: Path) -> None:
    """uvicorn's own refusal was text/plain "Service Unavailable" without Retry-After (until 2026-12-07)."""
    with EtcdServer(data_dir=str(tmp_path / "etcd")) as etcd:
        port = free_port()
        frontend = spawn(
            "services.frontend.server", "--etcd", etcd.url, "--port", str(port), "--max-connections", "2",
            log_dir=tmp_path,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, [frontend], tmp_path)
            idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
            time.sleep(0.3)
            for path in ("/v1/chat/completions", "/livez"):
                r = httpx.request(
                    "POST" if path.startswith("/v1") else "GET", f"{url}{path}", json=chat("hi")
                )
                assert_error(r, 503, "service_unavailable_error", code="overloaded")
                assert int(r.headers["retry-after"]) >= 1
                assert r.headers["connection"] == "close"
            for s in idle:
                s.close()
            time.sleep(0.3)
            assert httpx.get(f"{url}/livez").status_code == 200  # the slots are free again
        finally:
            stop_all([frontend])


def test_no_router_is_503_with_retry_after(lonely: tuple[str, str]) -> None:
    url = lonely[0]
    for stream in (False, True):
        r = httpx.post(f"{url}/v1/chat/completions", json=chat("hi", stream=stream), timeout=10)
        assert_error(r, 503, "service_unavailable_error", code="no_routers")
        assert int(r.headers["retry-after"]) >= 1
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
    assert_error(r, 503, "service_unavailable_error", code="no_routers")


@pytest.mark.parametrize(
    ("body", "status", "param", "code", "says"),
    [
        (chat("hi", max_tokens="ten"), 400, "max_tokens", "invalid_value", "integer"),
        (chat("hi", temperature="hot"), 400, "temperature", "invalid_value", "number"),
        (chat("hi", temperature=3), 400, "temperature", "invalid_value", "less than or equal to 2"),
        (chat("hi", stop=7), 400, "stop", "invalid_value", "string"),
        ({"model": MODEL}, 400, "messages", "invalid_value", "field required"),
        ({"model": MODEL, "messages": []}, 400, "messages", "invalid_value", "at least 1"),
        (
            {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
            400,
            "messages[0].role",
            None,
            "user",
        ),
        (chat("hi", n=17), 400, "n", "invalid_value", "less than or equal to 16"),
        (chat("hi", max_tokens=0), 400, "max_tokens", "invalid_value", "greater than or equal to 1"),
        (chat("hi", max_completion_tokens=-1), 400, "max_completion_tokens", "invalid_value", "greater than"),
        (chat("hi", max_tokens=9000), 400, "max_tokens", "context_length_exceeded", "8192"),
        (
            chat("word " * 9000),
            400,
            "messages",
            "context_length_exceeded",
            "8192 tokens, but the prompt has 90",
        ),
        (chat("hi", model="gpt-4"), 404, "model", "model_not_found", "'gpt-4'"),
        # a long name is not echoed whole (a 3 MB name made a 3 MB error until 2026-12-07)
        (
            chat("hi", model="m" * 5000),
            404,
            "model",
            "model_not_found",
            "m'... (5000 characters) does not exist",
        ),
        # a 500 until 2026-12-07 (Python refuses int() of over 4,300 digits)
        (chat("hi", logit_bias={"1" * 5000: 1}), 400, "logit_bias", "invalid_value", "decimal strings"),
        (chat("hi", top_logprobs=3), 400, "top_logprobs", "invalid_value", "logprobs: true"),
        (
            chat("hi", stream_options={"include_usage": True}),
            400,
            "stream_options",
            "invalid_value",
            "stream is",
        ),
        (
            chat("hi", stream=True, stream_options={"continuous_usage_stats": True}),
            400,
            "stream_options.continuous_usage_stats",
            "invalid_value",
            "not supported",
        ),
        (chat("hi", seed=2**64), 400, "seed", "invalid_value", "less than or equal"),
        (
            chat("hi", logits_processors=["my.Proc"]),
            400,
            "logits_processors",
            "invalid_value",
            "not supported",
        ),
        (chat("hi", structural_tag="{}"), 400, "structural_tag", "invalid_value", "not supported"),
        (chat("hi", guided_whitespace_pattern=" "), 400, "guided_whitespace_pattern", "invalid_value", "not"),
        (chat("hi", return_token_ids=True), 400, "return_token_ids", "invalid_value", "not supported"),
        (chat("hi", best_of=3), 400, "best_of", "invalid_value", "not supported"),
        (
            chat("hi", structured_outputs={"regexp": "a+"}),
            400,
            "structured_outputs.regexp",
            "invalid_value",
            "Extra inputs",
        ),
        (chat("hi", structured_outputs={}), 400, "structured_outputs", "invalid_value", "give one of"),
        (
            chat("hi", structured_outputs={"json-schema": {}}),
            400,
            "structured_outputs.json-schema",
            "invalid_value",
            "Extra inputs",
        ),
        # a union's object member says what is wrong inside the object (until 2026-12-07 only that it was not
        # one of the strings, or that it was not a string)
        (
            chat("hi", tool_choice={"type": "function", "function": {}}),
            400,
            "tool_choice.function.name",
            "invalid_value",
            "field required",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            },
            400,
            "messages[0].content[0].type",
            "invalid_value",
            "'text' (got 'image_url')",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            400,
            "messages[0].content[0].text",
            "invalid_value",
            "valid string (got 5)",
        ),
        # what OpenAI requires of each role: until 2026-12-07 these rendered as empty turns
        (
            {"model": MODEL, "messages": [{"role": "user"}]},
            400,
            "messages[0]",
            "invalid_value",
            "needs content",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
            400,
            "messages[1]",
            "invalid_value",
            "an assistant message needs content, tool_calls or function_call",
        ),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "21"}],
            },
            400,
            "messages[1]",
            "invalid_value",
            "needs tool_call_id",
        ),
    ],
    ids=[
        "max_tokens-string",
        "temperature-string",
        "temperature-3",
        "stop-int",
        "messages-missing",
        "messages-empty",
        "role-unknown",
        "n-17",
        "max_tokens-0",
        "max_completion_tokens-negative",
        "prompt-plus-max_tokens-too-long",
        "prompt-too-long",
        "model-unknown",
        "model-unknown-of-5000-characters",
        "logit_bias-key-of-5000-digits",
        "top_logprobs-without-logprobs",
        "stream_options-without-stream",
        "continuous_usage_stats",
        "seed-past-int64",
        "logits_processors",
        "structural_tag",
        "guided_whitespace_pattern",
        "return_token_ids",
        "best_of-on-chat",
        "structured_outputs-misspelt",
        "structured_outputs-empty",
        "structured_outputs-key-not-an-identifier",
        "tool_choice-object-without-name",
        "content-part-not-text",
        "content-part-text-not-a-string",
        "user-without-content",
        "assistant-without-content-or-calls",
        "tool-without-call-id",
    ],  # fmt: skip
)
def test_chat_request_errors(
    lonely: tuple[str, str], body: dict[str, Any], status: int, param: str, code: str | None, says: str
) -> None:
    r = httpx.post(f"{lonely[0]}/v1/chat/completions", json=body, timeout=10)
    message = assert_error(r, status, "invalid_request_error", param, code)
    assert says in message


def test_echo_with_max_tokens_0_streams_when_asked(scripted: ScriptedCluster) -> None:
    """echo + max_tokens 0 is answered without the cluster; asked to stream, it streams (until 2026-12-07 it
    answered one JSON body, and the official client's stream saw no chunk at all)."""
    client = openai.OpenAI(base_url=f"{scripted.url}/v1", api_key="none", max_retries=0)
    stream = client.completions.create(
        model=MODEL, prompt=["hello world", "bye"], echo=True, max_tokens=0, n=2, stream=True,
        stream_options={"include_usage": True}, extra_headers={"x-request-id": "echo-7"},
    )  # fmt: skip
    chunks = list(stream)
    texts = {c.choices[0].index: c.choices[0].text for c in chunks if c.choices}
    assert texts == {0: "hello world", 1: "hello world", 2: "bye", 3: "bye"}
    assert all(c.choices[0].finish_reason == "length" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 0
    assert chunks[-1].usage.prompt_tokens == len(scripted.tokenizer.encode("hello world")) + len(
        scripted.tokenizer.encode("bye")
    )
    whole = httpx.post(f"{scripted.url}/v1/completions", json={**ECHO_ONLY, "prompt": "hi"}, timeout=10)
    assert whole.json()["choices"][0]["text"] == "hi" and whole.headers["x-rackserve-request-id"]
    body = {**ECHO_ONLY, "stream": True}
    with httpx.stream(
        "POST", f"{scripted.url}/v1/completions", json=body, headers={"x-request-id": "echo-8"}
    ) as r:
        assert r.headers["x-request-id"] == "echo-8" and r.headers["content-type"].startswith(
            "text/event-stream"
        )
        assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
        events = sse_events(r)
    assert events[-1] == "[DONE]" and all(e["usage"] is None for e in events[:-1])  # no usage unless asked
    # a prompt of exactly the context length: nothing is generated, so it fits (512 here)
    full = httpx.post(f"{scripted.url}/v1/completions", json={**ECHO_ONLY, "prompt": [1] * 512}, timeout=10)
    assert full.status_code == 200, full.text
    over = httpx.post(f"{scripted.url}/v1/completions", json={**ECHO_ONLY, "prompt": [1] * 513}, timeout=10)
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
    # ... while a request that generates has no room left at 512
    ran = httpx.post(f"{scripted.url}/v1/completions", json={"model": MODEL, "prompt": [1] * 512}, timeout=10)
    assert ran.status_code == 400 and ran.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"model": MODEL, "prompt": ["a"] * 65}, "prompt", "at most 64 prompts"),
        # one request fanning out to 1,024 cluster requests, each carrying a 600k-entry list (3.6 GB of the
        # frontend's memory, 200 ms of every engine step: the security audit, until 2026-12-07)
        ({"model": MODEL, "prompt": ["a"] * 16, "best_of": 16}, "best_of", "256 requests to the cluster"),
        ({"model": MODEL, "prompt": ["a"] * 16, "n": 16}, "n", "at most 128"),
        ({"model": MODEL, "prompt": "hi", "stop_token_ids": list(range(1025))}, "stop_token_ids", "1024"),
        ({"model": MODEL, "prompt": "hi", "stop": ["x" * 1025]}, "stop", "at most 1024 characters"),
        ({"model": MODEL, "prompt": [1, 999999]}, "prompt", "999999"),
        ({"model": MODEL, "prompt": ""}, "prompt", "empty"),
        ({"model": MODEL, "prompt": "hi", "logprobs": 50}, "logprobs", "20"),
        ({"model": MODEL, "prompt": "hi", "suffix": "x"}, "suffix", "not supported"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens", "echo"),
        # echo with max_tokens 0 runs nothing, but is checked as a request that runs (until 2026-12-07 it was not)
        ({**ECHO_ONLY, "prompt": "word " * 9000}, "prompt", "maximum context length"),
        ({**ECHO_ONLY, "logit_bias": {"999999": 1}}, "logit_bias", "outside the vocabulary"),
        # a list that fits no member of the union: the prompt is named, not an element valid in some member
        ({"model": MODEL, "prompt": ["a", 1]}, "prompt", "valid string"),
        (
            {
                **ECHO_ONLY,
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}},
            },
            "response_format",
            "bogus",
        ),
    ],
)
def test_completion_request_errors(
    lonely: tuple[str, str], body: dict[str, Any], param: str, says: str
) -> None:
    r = httpx.post(f"{lonely[0]}/v1/completions", json=body, timeout=10)
    assert says in assert_error(r, 400, "invalid_request_error", param)


def test_required_tool_choice_takes_tools_whose_schemas_use_defs(lonely: tuple[str, str]) -> None:
    """pydantic writes a tool's parameters with "$defs" and "#/$defs/..." references. Under tool_choice
    "required" the tools' schemas are nested in one list schema, where those references dangled: a valid
    request got a 400 naming guided_grammar, a parameter it never sent (until 2026-12-07). This frontend has no
    router: a request that passes every check gets 503."""
    loc = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

    def tool(name: str, defs: dict[str, Any]) -> dict[str, Any]:
        params = {"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
                  "$defs": defs}  # fmt: skip
        return {"type": "function", "function": {"name": name, "parameters": params}}

    url = f"{lonely[0]}/v1/chat/completions"
    ok = chat("weather?", tools=[tool("get_weather", {"Loc": loc}), tool("get_time", {"Loc": loc})],
              tool_choice="required")  # fmt: skip
    assert_error(httpx.post(url, json=ok, timeout=10), 503, "service_unavailable_error", code="no_routers")
    other = {**loc, "required": []}
    clash = chat("weather?", tools=[tool("get_weather", {"Loc": loc}), tool("get_time", {"Loc": other})],
                 tool_choice="required")  # fmt: skip
    assert "defined differently" in assert_error(httpx.post(url, json=clash, timeout=10), 400,
                                                 "invalid_request_error", "tools")  # fmt: skip
    bad = chat("x", tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
               tool_choice="required")  # fmt: skip
    assert_error(httpx.post(url, json=bad, timeout=10), 400, "invalid_request_error", "tools")


def test_malformed_body_and_limits(lonely: tuple[str, str]) -> None:
    url = f"{lonely[0]}/v1/chat/completions"
    headers = {"content-type": "application/json"}
    r = httpx.post(url, content=b'{"model": "x", "messages": [', headers=headers)
    assert "not valid JSON" in assert_error(r, 400, "invalid_request_error", code="invalid_json")
    r = httpx.post(url, content=b"[1, 2]", headers=headers)
    assert "object" in assert_error(r, 400, "invalid_request_error")
    r = httpx.post(url, content=b"", headers=headers)
    assert_error(r, 400, "invalid_request_error", code="invalid_json")
    r = httpx.post(url, json=chat("x" * BODY_LIMIT_BYTES))
    assert str(BODY_LIMIT_BYTES) in assert_error(r, 413, "invalid_request_error", code="request_too_large")
    # Without a content-length (a chunked upload), the limit holds as the bytes arrive.
    chunks = iter([b'{"model": "', b"x" * BODY_LIMIT_BYTES, b'"}'])
    r = httpx.post(url, content=chunks, headers=headers)
    assert_error(r, 413, "invalid_request_error", code="request_too_large")
    # a query parameter is named as the client wrote it (it was "query.since" until 2026-12-07)
    assert_error(httpx.get(f"{lonely[0]}/traffic?since=abc"), 400, "invalid_request_error", "since")


def test_every_v1_route_asks_for_the_api_key() -> None:
    """With keys configured, nothing under /v1 answers without one: every route there depends on `authorize` or,
    for a request's timeline (not rate-limited), `identify` (the timelines needed no key until 2026-12-07:
    workers, route reasons and client ids were readable by anyone)."""
    from fastapi.routing import APIRoute

    from services.frontend.app import api
    from services.frontend.auth import authorize, identify

    def calls(dependant: Any) -> set[Any]:
        return {dependant.call} | {c for d in dependant.dependencies for c in calls(d)}

    v1 = [r for r in api.routes if isinstance(r, APIRoute) and r.path.startswith("/v1")]
    assert {r.path for r in v1} >= {"/v1/chat/completions", "/v1/requests/{request_id}/timeline", "/v1/plan"}
    assert [r.path for r in v1 if not {authorize, identify} & calls(r.dependant)] == []


def test_the_served_api_declares_the_key_on_every_v1_path(lonely: tuple[str, str]) -> None:
    """The running frontend's OpenAPI document, whatever added each route: every /v1 operation names the Bearer
    scheme that `authorize` and `identify` declare."""
    doc = httpx.get(f"{lonely[0]}/openapi.json", timeout=10).json()
    ops = [
        (path, method, op)
        for path, item in doc["paths"].items()
        if path.startswith("/v1")
        for method, op in item.items()
    ]
    assert {p for p, _, _ in ops} >= {
        "/v1/chat/completions",
        "/v1/requests/{request_id}/timeline",
        "/v1/plan",
    }
    assert [(p, m) for p, m, op in ops if {"HTTPBearer": []} not in op.get("security", [])] == []


def test_unknown_routes_and_methods_answer_in_openai_shape(lonely: tuple[str, str]) -> None:
    assert_error(httpx.get(f"{lonely[0]}/v1/nothing"), 404, "not_found_error")
    assert_error(httpx.get(f"{lonely[0]}/v1/chat/completions"), 405, "invalid_request_error")


def test_models_health_and_registration(lonely: tuple[str, str]) -> None:
    url, etcd_url = lonely
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 8192
    reply = httpx.get(f"{url}/health")  # readiness: no decode worker is routable yet
    health = reply.json()
    assert reply.status_code == 503 and health["status"] == "unavailable"
    assert health["workers"] == {"router": 0, "prefill": 0, "decode": 0}

    async def registered() -> list[pb.WorkerInfo]:
        directory = WorkerDirectory(etcd_url, roles=("frontend",))
        await directory.start()
        try:
            return await directory.wait_for("frontend", 1, 5.0)
        finally:
            await directory.close()

    (me,) = asyncio.run(registered())
    assert me.role == "frontend" and me.endpoint == url.removeprefix("http://") and me.model_name == MODEL


# ---- rig 3: etcd, router, decode worker and frontend as real processes, through the openai client -----------


@pytest.fixture(scope="module")
@starts_processes
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(frontend url, etcd url) of a running aggregated cluster."""
    missing = [m for m in ("router", "decode") if not (REPO / "services" / m / "server.py").exists()]
    if missing:
        pytest.skip(f"services/{{{','.join(missing)}}}/server.py not in the tree yet")
    log_dir = tmp_path_factory.mktemp("cluster")
    with EtcdServer(data_dir=str(log_dir / "etcd")) as etcd:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        processes = [
            spawn(
                "services.decode.server",
                *("--etcd", etcd.url, "--port", "0", "--threads", "1", "--dtype", "float32"),
                log_dir=log_dir,
            ),
            spawn("services.router.server", "--etcd", etcd.url, "--port", "0", log_dir=log_dir),
            spawn("services.frontend.server", "--etcd", etcd.url, "--port", str(port), log_dir=log_dir),
        ]
        try:
            wait_healthy(url, processes, log_dir, roles=("router", "decode"))
            yield url, etcd.url
        finally:
            stop_all(processes)


@pytest.fixture
def client(cluster: tuple[str, str]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster[0]}/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def test_openai_client_streams_the_capital_of_france(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ANSWER
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_openai_client_non_streaming_gives_the_same_with_usage(
    client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0)
    assert reply.choices[0].message.content == ANSWER and reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(tokenizer.encode_chat(FRANCE))
    assert reply.usage.completion_tokens >= len(tokenizer.encode(ANSWER))
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_openai_client_completions_and_stream_usage(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template(FRANCE)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0)
    assert reply.choices[0].text == ANSWER
    ids = tokenizer.encode(prompt)
    stream = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=3,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "The capital of"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_stop_string_with_a_real_worker(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, stop=[" Paris"])
    assert reply.choices[0].message.content == "The capital of France is"
    assert reply.choices[0].finish_reason == "stop"


def test_16_concurrent_requests_all_complete(client: openai.OpenAI) -> None:
    def ask(i: int) -> str | None:
        reply = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, seed=i)
        return reply.choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    assert answers == [ANSWER] * 16


def test_client_disconnect_aborts_the_generation_on_the_worker(cluster: tuple[str, str]) -> None:
    url, etcd_url = cluster
    decode_endpoint = asyncio.run(_endpoint_of("decode", etcd_url))
    # Greedy counting goes on for thousands of tokens: only the disconnect can end it within the test.
    counting = {
        "model": MODEL,
        "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
        "max_tokens": 4000,
        "temperature": 0,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json={**counting, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        for _ in zip(range(5), r.iter_lines(), strict=False):
            pass
        assert asyncio.run(_load(decode_endpoint, lambda load: load.running >= 1, timeout_s=5.0))
    idle = asyncio.run(
        _load(decode_endpoint, lambda load: load.running == 0 and load.waiting == 0, timeout_s=5.0)
    )
    assert idle, "the worker kept generating after the client went away"


async def _endpoint_of(role: str, etcd_url: str) -> str:
    directory = WorkerDirectory(etcd_url, roles=(role,))
    await directory.start()
    try:
        return (await directory.wait_for(role, 1, 5.0))[0].endpoint
    finally:
        await directory.close()


async def _load(endpoint: str, condition: Callable[[pb.LoadSnapshot], bool], timeout_s: float) -> bool:
    """Whether the worker's load stream shows `condition` within `timeout_s`."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)
        call = stub.Subscribe(pb.SubscribeRequest(subscriber_id="test-frontend"), timeout=timeout_s)
        try:
            async for event in call:
                if event.HasField("load") and condition(event.load):
                    return True
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
        return False


def test_the_sdk_retrieves_the_served_model_and_a_missing_one_is_a_404(tokenizer: Tokenizer) -> None:
    """`client.models.retrieve` (GET /v1/models/{model}, a 404 for every id until 2026-12-07): the served model's
    card; another id is OpenAI's 404 model_not_found, and so is the served model for a key restricted to other
    models (the list leaves it out for that key too)."""
    import openai

    from services.frontend.auth import AuthConfig
    from services.runtime.api_keys import ApiKey

    keys = AuthConfig((ApiKey.from_secret("sk-all-models-1", "all"), ApiKey.from_secret(
        "sk-other-model-2", "other", frozenset({"another-model"}))))  # fmt: skip
    with ScriptedCluster(tokenizer, auth=keys) as c:
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="sk-all-models-1", max_retries=0)
        card = client.models.retrieve(MODEL)
        assert (card.id, card.object, card.owned_by) == (MODEL, "model", "rackserve")
        assert card.model_dump() == client.models.list().data[0].model_dump()
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve("gpt-4o")
        assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
        other = openai.OpenAI(base_url=f"{c.url}/v1", api_key="sk-other-model-2", max_retries=0)
        with pytest.raises(openai.NotFoundError) as hidden:
            other.models.retrieve(MODEL)
        assert hidden.value.body["code"] == "model_not_found" and other.models.list().data == []
        assert httpx.get(f"{c.url}/v1/models/{MODEL}").status_code == 401  # no key, no card


def test_cors_is_off_by_default_and_allowed_origins_answer_a_browsers_preflight(
    tokenizer: Tokenizer, scripted: ScriptedCluster
) -> None:
    """--allowed-origins: a browser on an allowed origin gets its preflight (OPTIONS, no key) answered and can read
    the answer and its x-request-id; another origin gets no allow header. Without the flag, no CORS headers (a
    preflight is a 405, as before)."""
    from services.frontend.auth import AuthConfig
    from services.runtime.api_keys import load_api_keys

    preflight = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    off = httpx.options(f"{scripted.url}/v1/chat/completions", headers=preflight)
    assert off.status_code == 405 and "access-control-allow-origin" not in off.headers
    with ScriptedCluster(
        tokenizer,
        auth=AuthConfig(load_api_keys("sk-browser-key-1")),
        allowed_origins=("https://app.example",),
    ) as c:
        ok = httpx.options(f"{c.url}/v1/chat/completions", headers=preflight)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in ok.headers["access-control-allow-methods"]
        assert "authorization" in ok.headers["access-control-allow-headers"].lower()
        other = httpx.options(
            f"{c.url}/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"}
        )
        assert "access-control-allow-origin" not in other.headers
        headers = {"Origin": "https://app.example", "Authorization": "Bearer sk-browser-key-1"}
        r = httpx.post(f"{c.url}/v1/chat/completions", json=chat("hi"), headers=headers, timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        assert "x-request-id" in r.headers["access-control-expose-headers"]
