"""The load generator's engine: streams requests at an OpenAI-compatible endpoint and times every token.

One asyncio loop and one httpx client carry thousands of concurrent streams. Closed loop: `concurrency`
requests in flight, the next one starts when one ends. Open loop: each request starts at its arrival time
(Poisson or a trace's timestamps), whatever is in flight. Both stop at `max_requests` or `duration_s`, whichever
comes first; a request still running at the end of the duration is allowed to finish (within its deadline).

Token-id prompts go to /v1/completions, chat prompts to /v1/chat/completions, both with `stream: true` and
`stream_options.include_usage` (the server's token counts win over our estimates). `ignore_eos` is sent too: vLLM
honours it, rackserve ignores it, so `output_tokens` is what actually arrived.

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
from dataclasses import dataclass
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
        path, body = self._body(spec)
        start = time.perf_counter()
        arrivals: list[float] = []
        usage: dict[str, Any] = {}
        status, error, server_id = 200, None, None
        try:
            async with client.stream(
                "POST", self.cfg.url.rstrip("/") + path, json=body, headers=self._headers(spec)
            ) as resp:
                status = resp.status_code
                server_id = resp.headers.get("x-request-id")
                if status != 200:
                    raw = (await resp.aread()).decode(errors="replace")
                    error = _error_message(raw) or f"HTTP {status}"
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        obj = json.loads(data)
                        if "error" in obj:
                            error = _error_message(data) or "error in stream"
                            status = (
                                int(obj["error"].get("code") or 0)
                                if str(obj["error"].get("code", "")).isdigit()
                                else 500
                            )
                            break
                        if obj.get("usage"):
                            usage = obj["usage"]
                        for c in obj.get("choices") or []:
                            text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                            if text:
                                arrivals.append(time.perf_counter())
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            status, error = 0, f"{type(e).__name__}: {e}"
        end = time.perf_counter()
        ok = error is None and bool(arrivals)
        if error is None and not arrivals:
            error = "no tokens in the stream"
        details = usage.get("prompt_tokens_details") or {}
        result = RequestResult(
            request_id=spec.request_id,
            input_tokens=int(usage.get("prompt_tokens") or spec.input_tokens),
            output_tokens=int(usage.get("completion_tokens") or len(arrivals)),
            requested_output_tokens=spec.output_tokens,
            start_s=start - t0,
            ok=ok,
            status=status,
            error=error,
            ttft_s=arrivals[0] - start if arrivals else None,
            itl_s=[b - a for a, b in zip(arrivals, arrivals[1:], strict=False)],
            e2e_s=end - start,
            server_request_id=server_id,
            cached_tokens=details.get("cached_tokens"),
        )
        if ok and server_id and self._timeline_available is not False:
            result.phases_s = await self._timeline(client, server_id)
        return result

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
