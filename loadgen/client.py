"""The load generator's engine: streams requests at an OpenAI-compatible endpoint and times every token.

One asyncio loop and one httpx client carry thousands of concurrent streams. Closed loop: `concurrency`
requests in flight, the next one starts when one ends. Open loop: each request starts at its arrival time
(Poisson or a trace's timestamps), whatever is in flight. Both stop at `max_requests` or `duration_s`, whichever
comes first; a request still running at the end of the duration is allowed to finish (within its deadline).

Token-id prompts go to /v1/completions, chat prompts to /v1/chat/completions, both with `stream: true` and
`stream_options.include_usage` (the server's token counts win over our estimates). `ignore_eos` is sent too: vLLM
and rackserve honour it, so each answer has the workload's output length. A request succeeds when its stream
ends with `data: [DONE]`, no choice finished with "abort" or "error", and it took less than `request_timeout_s`
in all; anything else, an exception included, is that request's error and never stops the run.

When the server serves `GET /v1/requests/{id}/timeline` (rackserve's frontend does), each finished request's
phase timestamps are fetched and split into queue/prefill/transfer/decode; a 404 or 405 on the first try means
"not available" and no more are asked for.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadgen.report import RequestResult
from loadgen.workload import RequestSpec


@dataclass
class RunConfig:
    url: str  # the server's base URL, e.g. http://127.0.0.1:8000
    model: str
    mode: str = "closed"  # closed | open
    concurrency: int = 8
    max_requests: int | None = None
    duration_s: float | None = None
    # a whole-request deadline: a stream still running past it is cut and recorded as a timeout
    request_timeout_s: float = 300.0
    temperature: float = 0.0
    api_key: str | None = None
    fetch_timeline: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("closed", "open"):
            raise ValueError(f"--arrival must be 'closed' or 'open', got {self.mode!r}")
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be at least 1, got {self.concurrency}")


# Finish reasons that mean the answer was cut short, not finished: rackserve's frontend ends an aborted request
# with "abort" (services/frontend/app.py `_finish`); vLLM's are "stop", "length", "abort", "error", "repetition".
FAILED_FINISH_REASONS = frozenset({"abort", "error"})


@dataclass
class _Stream:
    """What one request's stream has delivered so far, kept when the request fails midway (a timeout, a broken
    stream) so that its status, server id and error are still reported."""

    status: int = 200
    error: str | None = None
    server_id: str | None = None
    # [DONE] arrived: a stream that stops without it was cut, whatever it carried
    done: bool = False
    usage: dict[str, Any] = field(default_factory=dict)
    # (arrival time, tokens in it when the server says) of each event that carried text
    chunks: list[tuple[float, int | None]] = field(default_factory=list)

    def event(self, obj: Any, now: float) -> bool:
        """Take one parsed `data:` event; False when it ends the request (an error, an aborted answer)."""
        if not isinstance(obj, dict):
            return self._fail(0, f"malformed stream event: {json.dumps(obj)[:200]}")
        if "error" in obj:
            message, status = _stream_error(obj["error"])
            return self._fail(status, message)
        choices = obj.get("choices") or []
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            return self._fail(0, f"malformed stream event: {json.dumps(obj)[:200]}")
        before = _count(self.usage.get("completion_tokens"))
        usage = obj.get("usage")
        if isinstance(usage, dict) and usage:
            self.usage = usage
        texts = [c.get("text") if "text" in c else _content(c.get("delta")) for c in choices]
        if any(isinstance(t, str) and t for t in texts):
            # A running count on this very chunk (vLLM's `continuous_usage_stats`) tells how many tokens it
            # carries; a count that arrives only at the end does not.
            after = _count(usage.get("completion_tokens")) if isinstance(usage, dict) else None
            tokens = after - (before or 0) if after is not None else None
            self.chunks.append((now, tokens if tokens is not None and tokens > 0 else None))
        for c in choices:
            reason = c.get("finish_reason")
            if reason in FAILED_FINISH_REASONS:
                return self._fail(500, f"the answer ended with finish_reason {reason!r}")
        return True

    def _fail(self, status: int, error: str) -> bool:
        self.status, self.error = status, error
        return False


def token_gaps(chunks: Sequence[tuple[float, int | None]], total: int | None = None) -> list[float]:
    """Every inter-token gap of one answer, from its chunks' arrival times and token counts.

    A chunk carrying k tokens after a gap g gives k gaps of g/k; the first chunk's extra tokens came with the
    first token (gaps of 0: the wait before them is the TTFT). A chunk's count is known when the server puts a
    running `usage` on every chunk (vLLM's `continuous_usage_stats`). rackserve and most servers count tokens
    only at the end, so the tokens no chunk accounts for (`total` less the known counts) are spread over the
    chunks of unknown count: one to the first chunk (a first token comes out of prefill alone), an equal share
    to each later one, the remainder one each to those after the longest gaps. Without `total` (or with fewer
    tokens than chunks), a chunk of unknown count is one token.
    """
    unknown = [i for i, (_, k) in enumerate(chunks) if k is None]
    counts = [1 if k is None else k for _, k in chunks]
    spare = (total or 0) - sum(k for _, k in chunks if k is not None)
    later = [i for i in unknown if i > 0]
    if total is not None and unknown and spare > len(unknown):
        if later:
            spare -= len(unknown)
            share, rest = divmod(spare, len(later))
            longest = sorted(later, key=lambda i: chunks[i - 1][0] - chunks[i][0])[:rest]
            for i in later:
                counts[i] = 1 + share + (1 if i in longest else 0)
        else:
            counts[0] = spare
    gaps: list[float] = []
    for i, k in enumerate(counts):
        if i == 0:
            gaps += [0.0] * (k - 1)
        else:
            gaps += [(chunks[i][0] - chunks[i - 1][0]) / k] * k
    return gaps


class _Progress:
    """A status line on stderr (done/total, errors, in flight, elapsed): redrawn in place on a terminal, a
    plain line every 5 s otherwise (logs, CI)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.tty = total, enabled, sys.stderr.isatty()
        self.done = self.errors = self.in_flight = 0
        self.t0 = time.perf_counter()
        self._last = 0.0

    def update(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self._last < (0.2 if self.tty else 5.0)):
            return
        self._last = now
        width = 30
        filled = int(width * self.done / max(1, self.total))
        bar = "#" * filled + "." * (width - filled)
        line = (
            f"[{bar}] {self.done}/{self.total} done, {self.errors} errors, {self.in_flight} in flight, "
            f"{now - self.t0:.1f}s"
        )
        sys.stderr.write(f"\r{line} " if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self.update(force=True)
            if self.tty:
                sys.stderr.write("\n")


def phases_from_timeline(body: dict[str, Any]) -> dict[str, float] | None:
    """queue/prefill/transfer/decode seconds from a rackserve timeline ([phase, seconds since start] pairs)."""
    if isinstance(body.get("phases_s"), dict):
        return {k: float(v) for k, v in body["phases_s"].items()}
    steps = body.get("timeline_s") or body.get("timeline")
    if not isinstance(steps, list) or len(steps) < 2:
        return None
    bucket = {"queued": "queue", "routed": "queue", "prefilling": "prefill", "transferring": "transfer"}
    bucket["decoding"] = "decode"
    out = {"queue": 0.0, "prefill": 0.0, "transfer": 0.0, "decode": 0.0}
    pairs: list[tuple[str, float]] = []
    for step in steps:
        if isinstance(step, list | tuple) and len(step) == 2:
            pairs.append((str(step[0]), float(step[1])))
        elif isinstance(step, dict) and "phase" in step:
            t = step.get("t_s", step.get("t"))
            pairs.append((str(step["phase"]), float(t) if t is not None else 0.0))
    for (phase, t), (_, t_next) in zip(pairs, pairs[1:], strict=False):
        if phase in bucket:
            out[bucket[phase]] += max(0.0, t_next - t)
    return out


class LoadGenerator:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self._timeline_available: bool | None = None if cfg.fetch_timeline else False

    def _headers(self, spec: RequestSpec) -> dict[str, str]:
        return {"x-request-id": spec.request_id, **self._auth()}

    def _auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}

    def _body(self, spec: RequestSpec) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.cfg.model,
            "max_tokens": spec.output_tokens,
            "temperature": self.cfg.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        if spec.token_ids is not None:
            return "/v1/completions", {**body, "prompt": spec.token_ids}
        if spec.messages is not None:
            return "/v1/chat/completions", {**body, "messages": spec.messages}
        raise ValueError(f"request {spec.request_id} has neither token ids nor messages")

    async def one(self, client: httpx.AsyncClient, spec: RequestSpec, t0: float) -> RequestResult:
        """One request, start to end. Whatever goes wrong in it (HTTP, a malformed stream, a deadline, a bug) is
        this request's error, never the run's."""
        stream = _Stream()
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.cfg.request_timeout_s):
                await self._stream(client, spec, stream)
        except TimeoutError:
            stream.status = 0
            stream.error = f"timeout: no complete answer within {self.cfg.request_timeout_s:g} s"
        except Exception as e:
            stream.status, stream.error = 0, f"{type(e).__name__}: {e}"
        end = time.perf_counter()
        if stream.error is None and not stream.done:
            stream.status, stream.error = 0, "stream ended without [DONE]"
        if stream.error is None and not stream.chunks:
            stream.error = "no tokens in the stream"
        ok = stream.error is None
        usage = stream.usage
        details = usage.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
        output_tokens = _count(usage.get("completion_tokens"))
        arrivals = [t for t, _ in stream.chunks]
        result = RequestResult(
            request_id=spec.request_id,
            input_tokens=_count(usage.get("prompt_tokens")) or spec.input_tokens,
            output_tokens=output_tokens or sum(k or 1 for _, k in stream.chunks),
            requested_output_tokens=spec.output_tokens,
            start_s=start - t0,
            ok=ok,
            status=stream.status,
            error=stream.error,
            ttft_s=arrivals[0] - start if arrivals else None,
            itl_s=token_gaps(_running_counts(stream.chunks), output_tokens),
            e2e_s=end - start,
            server_request_id=stream.server_id,
            cached_tokens=cached,
        )
        if ok and stream.server_id and self._timeline_available is not False:
            try:
                result.phases_s = await self._timeline(client, stream.server_id)
            except Exception:
                # A timeline we cannot read leaves the request without phases; the request itself succeeded.
                result.phases_s = None
        return result

    async def _stream(self, client: httpx.AsyncClient, spec: RequestSpec, stream: _Stream) -> None:
        """Send the request and read its stream into `stream`, stopping at [DONE] or the first failure."""
        path, body = self._body(spec)
        async with client.stream(
            "POST", self.cfg.url.rstrip("/") + path, json=body, headers=self._headers(spec)
        ) as resp:
            stream.status = resp.status_code
            stream.server_id = resp.headers.get("x-request-id")
            if resp.status_code != 200:
                raw = (await resp.aread()).decode(errors="replace")
                stream.error = _error_message(raw) or f"HTTP {resp.status_code}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    stream.done = True
                    return
                if not stream.event(json.loads(data), time.perf_counter()):
                    return

    async def _timeline(self, client: httpx.AsyncClient, server_id: str) -> dict[str, float] | None:
        try:
            url = f"{self.cfg.url.rstrip('/')}/v1/requests/{server_id}/timeline"
            r = await client.get(url, headers=self._auth(), timeout=10.0)
        except httpx.HTTPError:
            return None
        if r.status_code in (404, 405) and self._timeline_available is None:
            self._timeline_available = False  # the server has no timeline endpoint
            return None
        if r.status_code != 200:
            return None
        self._timeline_available = True
        try:
            return phases_from_timeline(r.json())
        except (ValueError, TypeError):
            return None

    async def run(self, specs: Sequence[RequestSpec]) -> tuple[list[RequestResult], float]:
        """Every result and the run's wall time."""
        cfg = self.cfg
        todo = list(specs[: cfg.max_requests] if cfg.max_requests is not None else specs)
        progress = _Progress(len(todo), cfg.progress)
        results: list[RequestResult] = []
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
        t0 = time.perf_counter()
        stop_at = t0 + cfg.duration_s if cfg.duration_s else float("inf")

        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

            async def tracked(spec: RequestSpec) -> None:
                progress.in_flight += 1
                r = await self.one(client, spec, t0)
                progress.in_flight -= 1
                progress.done += 1
                progress.errors += 0 if r.ok else 1
                results.append(r)
                progress.update()

            if cfg.mode == "closed":
                queue = iter(todo)

                async def worker() -> None:
                    for spec in queue:
                        if time.perf_counter() >= stop_at:
                            return
                        await tracked(spec)

                await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
            else:
                tasks = []
                for spec in todo:
                    due = t0 + spec.arrival_s
                    if due >= stop_at:
                        break
                    if (wait := due - time.perf_counter()) > 0:
                        await asyncio.sleep(wait)
                    tasks.append(asyncio.create_task(tracked(spec)))
                    progress.update()
                await asyncio.gather(*tasks)
        progress.close()
        results.sort(key=lambda r: r.start_s)
        return results, time.perf_counter() - t0


def _error_message(raw: str) -> str | None:
    try:
        body = json.loads(raw)
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200] or None


def _stream_error(error: Any) -> tuple[str, int]:
    """The message and status of an error event: OpenAI's (and rackserve's) `{"error": {"message", "code"}}`, or
    TGI's `{"error": "message"}`; a status that is not a number reads as 500."""
    message, code = (error.get("message"), error.get("code")) if isinstance(error, dict) else (error, None)
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    status = code if isinstance(code, int) and not isinstance(code, bool) else 500
    return str(message or "error in stream")[:200], status


def _running_counts(chunks: list[tuple[float, int | None]]) -> list[tuple[float, int | None]]:
    """The chunks, with their token counts only where the server sent a running count (two text chunks or more
    carried one): a server that puts its final usage on the last text chunk would otherwise have that chunk
    carry every token of the answer."""
    if sum(1 for _, k in chunks if k is not None) >= 2:
        return chunks
    return [(t, None) for t, _ in chunks]


def _content(delta: Any) -> Any:
    return delta.get("content") if isinstance(delta, dict) else None


def _count(value: Any) -> int | None:
    """A token count from the server, or None where it sent none (or something else)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
