"""The load generator's client against a scripted streaming server in this process (asyncio, a real socket): a
malformed event fails its own request and not the run, a stream must end with [DONE], an aborted answer is a
failure, inter-token gaps are per token, and the request timeout is a deadline for the whole request."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

import loadgen.client as client
from loadgen import report as rep
from loadgen.client import LoadGenerator, RunConfig
from loadgen.workload import RequestSpec

DONE = "[DONE]"
# A script: (seconds to wait, the `data:` payload to send then), in order; the server closes the stream after it.
Script = list[tuple[float, str]]


def chunk(text: str = "a", *, finish: str | None = None, usage: dict[str, Any] | None = None) -> str:
    event: dict[str, Any] = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        event["usage"] = usage
    return json.dumps(event)


def usage(completion_tokens: int) -> str:
    return json.dumps({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": completion_tokens}})


def answer(tokens: int = 3) -> Script:
    """A well-formed answer: `tokens` one-token chunks, the usage, [DONE]."""
    return [*((0.0, chunk()) for _ in range(tokens)), (0.0, usage(tokens)), (0.0, DONE)]


class ScriptedServer:
    """Answers each POST with the script named by its x-request-id, as a server-sent event stream."""

    def __init__(self, scripts: dict[str, Script]) -> None:
        self.scripts = scripts

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._answer, "127.0.0.1", 0)
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            headers = dict(
                (k.strip().lower(), v.strip())
                for k, v in (line.split(":", 1) for line in head.split("\r\n")[1:] if ":" in line)
            )
            await reader.readexactly(int(headers.get("content-length", "0")))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
            for wait, data in self.scripts[headers["x-request-id"]]:
                await asyncio.sleep(wait)
                writer.write(f"data: {data}\n\n".encode())
                await writer.drain()
        except ConnectionError:
            # the client gave up on the request (its deadline)
            pass
        finally:
            writer.close()


def run(scripts: dict[str, Script], specs: list[RequestSpec] | None = None, **cfg: Any):
    """Every request of the run, by id, and the run's report (one is always produced)."""
    specs = specs or [RequestSpec(rid, 8, 16, token_ids=[1] * 8) for rid in scripts]

    async def main() -> tuple[list[rep.RequestResult], float]:
        async with ScriptedServer(scripts) as url:
            config = RunConfig(
                url=url, model="m", concurrency=len(specs), progress=False, fetch_timeline=False, **cfg
            )
            return await LoadGenerator(config).run(specs)

    results, wall_s = asyncio.run(main())
    report = rep.summarize(
        results, rep.Slo(ttft_s=10.0, itl_p90_s=10.0), rep.Grouping(1000, 1000), duration_s=wall_s
    )
    return {r.request_id: r for r in results}, report["overall"]


def test_a_malformed_event_or_a_failing_request_is_that_requests_error_not_the_runs():
    """TGI's `{"error": "..."}`, a `null` event and a request that cannot even be built each fail alone; the
    good requests around them are reported."""
    scripts = {
        "ok-1": answer(),
        "tgi-error": [(0.0, chunk()), (0.0, json.dumps({"error": "Input validation error"}))],
        "openai-error": [(0.0, chunk()), (0.0, json.dumps({"error": {"message": "no KV", "code": "503"}}))],
        "null-event": [(0.0, chunk()), (0.0, "null"), (0.0, usage(1)), (0.0, DONE)],
        "ok-2": answer(),
    }
    specs = [RequestSpec(rid, 8, 16, token_ids=[1] * 8) for rid in scripts]
    # neither token ids nor messages: building its body raises
    specs.append(RequestSpec("no-prompt", 8, 16))
    results, overall = run(scripts, specs)
    assert results["ok-1"].ok and results["ok-2"].ok
    tgi, openai, null, no_prompt = (
        results[k] for k in ("tgi-error", "openai-error", "null-event", "no-prompt")
    )
    assert (tgi.ok, tgi.status, tgi.error) == (False, 500, "Input validation error")
    assert (openai.ok, openai.status, openai.error) == (False, 503, "no KV")
    assert not null.ok and null.error == "malformed stream event: null"
    assert not no_prompt.ok and no_prompt.error is not None and no_prompt.error.startswith("ValueError:")
    assert overall["requests"] == 6 and overall["ok"] == 2 and overall["errors"] == 4


def test_a_stream_must_end_with_done_and_an_aborted_answer_is_a_failure():
    scripts = {
        # three tokens, then the server closes the stream: no usage, no [DONE]
        "cut": [(0.0, chunk()), (0.0, chunk()), (0.0, chunk())],
        "abort": [(0.0, chunk()), (0.0, chunk("b", finish="abort")), (0.0, usage(2)), (0.0, DONE)],
        "error": [(0.0, chunk()), (0.0, chunk("", finish="error")), (0.0, usage(1)), (0.0, DONE)],
        "length": [(0.0, chunk()), (0.0, chunk("b", finish="length")), (0.0, usage(2)), (0.0, DONE)],
    }
    results, overall = run(scripts)
    assert (results["cut"].ok, results["cut"].error) == (False, "stream ended without [DONE]")
    assert not results["abort"].ok and results["abort"].error == "the answer ended with finish_reason 'abort'"
    assert not results["error"].ok and results["error"].error == "the answer ended with finish_reason 'error'"
    assert results["length"].ok and results["length"].error is None
    # only the finished answer counts toward goodput
    assert overall["ok"] == 1 and overall["slo_attainment"] == pytest.approx(1 / 4)


def test_a_chunk_of_k_tokens_after_a_gap_g_gives_k_gaps_of_g_over_k():
    # counts known per chunk: 1, 4, 2 tokens arriving at 1.0, 1.4, 1.6 s
    assert client.token_gaps([(1.0, 1), (1.4, 4), (1.6, 2)]) == pytest.approx([0.1] * 4 + [0.1] * 2)
    # the first chunk's extra tokens arrived with the first one: gaps of 0 (its wait is the TTFT)
    assert client.token_gaps([(1.0, 3), (1.2, 2)]) == pytest.approx([0.0, 0.0, 0.1, 0.1])
    # counts unknown, 12 tokens in all (the usage at the end): the first chunk is one token, the other 11 split
    # evenly over the later chunks, the spare one to the chunk after the longer gap
    gaps = client.token_gaps([(1.0, None), (1.1, None), (1.4, None)], total=12)
    assert gaps == pytest.approx([0.1 / 5] * 5 + [0.3 / 6] * 6)
    # no total, or fewer tokens than chunks: a chunk is one token
    assert client.token_gaps([(1.0, None), (1.1, None), (1.3, None)]) == pytest.approx([0.1, 0.2])
    assert client.token_gaps([(1.0, None), (1.1, None), (1.3, None)], total=2) == pytest.approx([0.1, 0.2])
    assert client.token_gaps([], total=3) == []


def test_itl_over_a_real_stream_has_one_gap_per_token_after_the_first():
    """12 tokens in 3 chunks of 4, 100 ms apart: 11 gaps of about 25 ms, not 2 of 100 ms."""
    running = [
        (0.1, chunk("abcd", usage={"prompt_tokens": 8, "completion_tokens": 4 * i})) for i in (1, 2, 3)
    ]
    at_end = [(0.1, chunk("abcd")) for _ in range(3)]
    scripts = {"running": [*running, (0.0, DONE)], "at-end": [*at_end, (0.0, usage(12)), (0.0, DONE)]}
    results, _ = run(scripts)
    running_gaps = results["running"].itl_s
    assert results["running"].ok and results["running"].output_tokens == 12
    assert len(running_gaps) == 11 and running_gaps[:3] == [0.0, 0.0, 0.0]
    # each chunk's wait is split evenly over its 4 tokens
    assert len(set(running_gaps[3:7])) == 1 and len(set(running_gaps[7:])) == 1
    assert 0 < max(running_gaps) < 0.1
    at_end_gaps = results["at-end"].itl_s
    assert results["at-end"].ok and results["at-end"].output_tokens == 12
    assert len(at_end_gaps) == 11 and 0 < max(at_end_gaps) < 0.1


def test_a_final_usage_on_the_last_text_chunk_is_the_answers_count_not_that_chunks():
    """4 one-token chunks 100 ms apart, the last also carrying the answer's usage (4 tokens): 3 gaps of about
    100 ms (the last chunk was taken to hold all 4 tokens, 6 gaps, until the desk review of 2026-12-07)."""
    script = [(0.1, chunk("ab")) for _ in range(3)]
    script += [(0.1, chunk("ab", usage={"prompt_tokens": 8, "completion_tokens": 4})), (0.0, DONE)]
    results, _ = run({"last": script})
    gaps = results["last"].itl_s
    assert results["last"].ok and results["last"].output_tokens == 4
    assert len(gaps) == 3 and min(gaps) > 0.05


def test_the_request_timeout_is_a_deadline_for_the_whole_request():
    """A stream that trickles a token every 0.2 s never waits long on one read, but runs past a 0.5 s deadline."""
    scripts = {
        "slow": [*((0.2, chunk()) for _ in range(10)), (0.0, usage(10)), (0.0, DONE)],
        "fast": answer(),
    }
    results, _ = run(scripts, request_timeout_s=0.5)
    slow = results["slow"]
    assert (slow.ok, slow.status, slow.error) == (False, 0, "timeout: no complete answer within 0.5 s")
    assert results["fast"].ok
