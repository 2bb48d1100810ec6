"""The planner: its decision over the simulator, its damping, what it reads from real /metrics text, its
Kubernetes patches (against a real HTTP server), and a real `rackserve up --planner` moving capacity from
prefill to decode when the traffic changes shape, without losing a request."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import date
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from loadgen.sim.profile import load_profile
from services.planner import observe
from services.planner.kube import FileToken, KubeScaler
from services.planner.plan import (
    Damper,
    Limits,
    Observation,
    Prediction,
    Slo,
    candidates,
    choose,
    damp,
    evaluate,
    live_profile,
)
from services.telemetry import metrics as m
from tests.support.etcd import EtcdServer, free_port
from tests.support.etcd import etcd_server as etcd_server  # the fixture; `as` marks it used for ruff
from tests.support.markers import starts_processes

CPU = load_profile("cpu_smollm2")
# long prompts, one output token each / short prompts, long outputs — the two shapes of the issue
LONG_PROMPTS = Observation(
    window_s=10, requests=20, input_tokens=[(1024, 0.0), (2048, 20.0)], output_tokens=[(1, 20.0)],
    prompt_tokens=20 * 1500, generation_tokens=20,
)  # fmt: skip
LONG_OUTPUTS = Observation(
    window_s=10, requests=40, input_tokens=[(16, 0.0), (32, 40.0)], output_tokens=[(64, 0.0), (128, 40.0)],
    prompt_tokens=40 * 24, generation_tokens=40 * 100,
)  # fmt: skip


def test_long_prompts_size_prefill_and_long_outputs_size_decode() -> None:
    limits, slo = Limits(1, 3, 1, 3, max_workers=4), Slo(ttft_s=1.0, itl_s=0.08)
    a, binding_a = choose(evaluate(LONG_PROMPTS, CPU, candidates(limits)), slo)
    b, binding_b = choose(evaluate(LONG_OUTPUTS, CPU, candidates(limits)), slo)
    assert a is not None and b is not None
    assert (binding_a, binding_b) == ("ttft", "itl")
    assert a.prefill > a.decode and b.decode > b.prefill
    assert b.meets(slo) and b.workers == 3  # (1, 2) is the fewest workers under the ITL target


def test_the_fewest_workers_that_meet_both_slos_win_else_the_smallest_miss() -> None:
    slo = Slo(ttft_s=1.0, itl_s=0.1)
    preds = [Prediction(1, 1, 2.0, 0.05), Prediction(2, 1, 0.9, 0.05), Prediction(2, 2, 0.5, 0.04)]
    best, binding = choose(preds, slo)
    assert (best.prefill, best.decode, binding) == (2, 1, "ttft")
    # nothing meets: the one that misses by least, not the biggest
    missing = [Prediction(1, 1, 3.0, 0.3), Prediction(2, 1, 1.5, 0.3), Prediction(1, 2, 3.0, 0.12)]
    best, binding = choose(missing, slo)
    assert (best.prefill, best.decode, binding) == (1, 2, "ttft")
    assert choose([], slo) == (None, "none")


def test_scaling_is_damped_one_step_per_pool_held_down_and_bounded() -> None:
    limits, damper = Limits(1, 4, 1, 4), Damper(hold_down_s=30.0)
    assert damp((1, 1), (4, 3), limits, damper, now=0.0) == (2, 2)  # one step each, not the jump
    assert damp((2, 2), (4, 3), limits, damper, now=10.0) == (3, 3)  # up: the next interval
    assert damp((3, 3), (1, 1), limits, damper, now=20.0) == (3, 3)  # down: held down after a change
    assert damp((3, 3), (1, 1), limits, damper, now=41.0) == (2, 2)
    assert damp((3, 3), (9, 0), limits, Damper(0.0), now=0.0) == (4, 2)  # never past --max-*/--min-*
    assert damp((1, 1), (1, 1), limits, Damper(0.0), now=0.0) == (1, 1)
    # a budget of 3: moving capacity is a swap in one interval, a step up alone waits for room
    budget = Limits(1, 2, 1, 2, max_workers=3)
    assert damp((2, 1), (1, 2), budget, Damper(0.0), now=0.0) == (1, 2)
    assert damp((2, 1), (2, 2), budget, Damper(0.0), now=0.0) == (2, 1)
    # a step up the budget cancels keeps the pool's last real change: its hold-down still holds a step down
    roomy, held = Limits(1, 4, 1, 2, max_workers=3), Damper(hold_down_s=30.0)
    assert damp((1, 1), (2, 1), roomy, held, now=0.0) == (2, 1)  # a change at 0
    assert damp((2, 1), (3, 1), roomy, held, now=10.0) == (2, 1)  # no room: not taken
    assert damp((2, 1), (1, 1), roomy, held, now=20.0) == (2, 1)  # 20 s after the change at 0: held
    assert damp((2, 1), (1, 1), roomy, held, now=31.0) == (1, 1)
    # the same for decode: its step up cancelled for want of room, its step down still waits out the hold-down
    roomy, held = Limits(1, 2, 1, 4, max_workers=3), Damper(hold_down_s=30.0)
    assert damp((1, 1), (1, 2), roomy, held, now=0.0) == (1, 2)
    assert damp((1, 2), (1, 3), roomy, held, now=10.0) == (1, 2)
    assert damp((1, 2), (1, 1), roomy, held, now=20.0) == (1, 2)
    assert damp((1, 2), (1, 1), roomy, held, now=31.0) == (1, 1)
    with pytest.raises(ValueError, match="max-workers"):
        Limits(2, 4, 2, 4, max_workers=3)
    assert all(p + d <= 3 for p, d in candidates(budget)) and (2, 1) in candidates(budget)


def test_live_profile_takes_the_measured_prefill_rate_and_step_time() -> None:
    obs = Observation(window_s=10, requests=10, prompt_tokens=1000, generation_tokens=1000,
                      prefill_tokens_per_s=800.0, decode_step_s=0.2, decode_batch=4.0)  # fmt: skip
    live = live_profile(CPU, obs)
    assert live.prefill_tokens_per_s == 800.0
    ctx = 4 * (100 + 100 / 2)
    assert live.decode_step_s(4, int(ctx)) == pytest.approx(0.2, rel=1e-3)
    assert live_profile(CPU, Observation(window_s=1, requests=0)) is CPU


def test_observation_from_real_metrics_text() -> None:
    """The planner reads the names metrics.py exports: two scrapes of a registry with those metrics."""
    reg = CollectorRegistry()
    names = (m.PROMPT_TOKENS_PER_REQUEST, m.OUTPUT_TOKENS_PER_REQUEST, m.TTFT_S, m.INTER_TOKEN_S)
    h = {
        x._name: Histogram(x._name, "d", buckets=x._upper_bounds[:-1], registry=reg)  # type: ignore[attr-defined]
        for x in names
    }
    cached = Counter(m.CACHED_PROMPT_TOKENS._name, "d", registry=reg)  # type: ignore[attr-defined]
    in_flight = Gauge(m.REQUESTS_IN_FLIGHT._name, "d", registry=reg)  # type: ignore[attr-defined]
    for _ in range(30):  # the frontend's life before the window
        h[m.PROMPT_TOKENS_PER_REQUEST._name].observe(9000)  # type: ignore[attr-defined]
    in_flight.set(6)
    before = observe.parse(generate_latest(reg).decode())
    in_flight.set(2)  # a gauge that goes down is not a restart: the window is still the difference
    for _ in range(10):
        h[m.PROMPT_TOKENS_PER_REQUEST._name].observe(400)  # type: ignore[attr-defined]
        h[m.OUTPUT_TOKENS_PER_REQUEST._name].observe(50)  # type: ignore[attr-defined]
        h[m.TTFT_S._name].observe(0.3)  # type: ignore[attr-defined]
        h[m.INTER_TOKEN_S._name].observe(0.02)  # type: ignore[attr-defined]
    cached.inc(1000)
    after = observe.parse(generate_latest(reg).decode())
    obs = observe.observation(observe.delta(after, before), {}, window_s=5.0)
    assert obs.requests == 10 and obs.rate_rps == 2.0
    assert obs.mean_input() == 400 and obs.mean_output() == 50
    assert obs.hit_rate == pytest.approx(0.25)
    assert 0.25 <= obs.ttft_p90_s <= 0.5 and 0.01 <= obs.itl_p90_s <= 0.025
    assert sum(c for _, c in obs.input_tokens) == 10
    # a source that restarted (its counters went down) counts from zero, never negative
    restarted = observe.delta(before, after)
    assert restarted == before and observe.observation(restarted, {}, window_s=5.0).requests == 30


class _FakeApiServer(ThreadingHTTPServer):
    """A real HTTP server in the Kubernetes API's shape for the scale subresource: it records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str, dict | None]] = []
        self.replicas = {"rackserve-prefill": 2, "rackserve-decode": 1}
        # statuses the next PATCHes are answered with, unapplied (an API server's 500)
        self.refuse: list[int] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _name(self) -> str:
                return self.path.split("/deployments/")[1].split("/")[0]

            def do_GET(self) -> None:  # noqa: N802
                outer.calls.append(("GET", self.path, self.headers.get("Authorization", ""), None))
                self._send({"spec": {"replicas": outer.replicas[self._name()]}})

            def do_PATCH(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.calls.append(("PATCH", self.path, self.headers["Content-Type"], body))
                if outer.refuse:
                    self.send_error(outer.refuse.pop(0))
                    return
                outer.replicas[self._name()] = body["spec"]["replicas"]
                self._send({"spec": body["spec"]})

            def _send(self, obj: dict) -> None:
                _answer(self, json.dumps(obj).encode())

            def log_message(self, *a: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def _answer(handler: BaseHTTPRequestHandler, raw: bytes) -> None:
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(raw)))
    handler.end_headers()
    handler.wfile.write(raw)


def test_kubernetes_mode_reads_the_rotated_service_account_token(tmp_path: Path) -> None:
    """The kubelet rotates a projected token (about hourly); a token read once at start is refused after it
    expires, and every scale failed from then on."""
    token = tmp_path / "token"
    token.write_text("first\n")
    api = _FakeApiServer()
    threading.Thread(target=api.serve_forever, daemon=True).start()
    try:
        scaler = KubeScaler(
            f"http://127.0.0.1:{api.server_address[1]}", "prod", {"prefill": "rackserve-prefill",
            "decode": "rackserve-decode"}, FileToken(str(token), reread_s=0.0), True, 2.0,
        )  # fmt: skip

        async def go() -> None:
            await scaler.replicas("prefill")
            token.write_text("second\n")  # rotated
            await scaler.replicas("prefill")
            token.unlink()  # mid-rotation: the last token is kept
            await scaler.replicas("prefill")
            await scaler.close()

        asyncio.run(go())
    finally:
        api.shutdown()
    assert [c[2] for c in api.calls if c[0] == "GET"] == ["Bearer first", "Bearer second", "Bearer second"]


def test_kubernetes_mode_patches_only_the_scale_subresource_of_the_two_deployments() -> None:
    api = _FakeApiServer()
    threading.Thread(target=api.serve_forever, daemon=True).start()
    try:
        scaler = KubeScaler(
            f"http://127.0.0.1:{api.server_address[1]}", "prod",
            {"prefill": "rackserve-prefill", "decode": "rackserve-decode"}, "tok", True, 2.0,
        )  # fmt: skip

        async def go() -> None:
            await scaler.apply((1, 2))
            await scaler.apply((1, 2))  # unchanged: nothing sent
            await scaler.close()

        asyncio.run(go())
    finally:
        api.shutdown()
    patches = [c for c in api.calls if c[0] == "PATCH"]
    base = "/apis/apps/v1/namespaces/prod/deployments"
    assert [(p[1], p[2], p[3]) for p in patches] == [
        (f"{base}/rackserve-prefill/scale", "application/merge-patch+json", {"spec": {"replicas": 1}}),
        (f"{base}/rackserve-decode/scale", "application/merge-patch+json", {"spec": {"replicas": 2}}),
    ]
    assert all(c[2] == "Bearer tok" for c in api.calls if c[0] == "GET")
    assert api.replicas == {"rackserve-prefill": 1, "rackserve-decode": 2}


class _Trickler:
    """A real HTTP/1.1 server that answers every request with `body`, sent a byte every 0.35 s (each read well
    within httpx's timeout) for the methods in `slow`, at once for the others."""

    def __init__(self, body: bytes, slow: tuple[str, ...]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.endpoint = self.url.removeprefix("http://")
        self.body, self.slow = body, slow
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.listener.accept()
                threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            method = conn.recv(65536).split(b" ", 1)[0].decode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(self.body))
            if method not in self.slow:
                conn.sendall(self.body)
                return
            for byte in self.body:
                time.sleep(0.35)
                conn.sendall(bytes([byte]))

    def close(self) -> None:
        self.listener.close()


def _scale_errors(pool: str) -> float:
    return REGISTRY.get_sample_value("rackserve_planner_scale_errors_total", {"pool": pool}) or 0.0


def test_a_kubernetes_api_that_trickles_its_answer_is_cut_at_the_call_deadline() -> None:
    """--kube-timeout-s bounds a whole call: an API server that sends its answer a byte at a time, each within
    httpx's read timeout, must not stretch one call to the body's length (until 2026-12-07 it did: ~8 s here).
    The reads and, with a quick read, the patches."""
    body = b'{"spec":{"replicas":3}}'
    slow_reads, slow_patches = _Trickler(body, ("GET",)), _Trickler(body, ("PATCH",))
    before = _scale_errors("prefill"), _scale_errors("decode")

    async def go() -> None:
        scaler = KubeScaler(slow_reads.url, "prod", {"prefill": "p", "decode": "d"}, "", True, 1.0)
        with pytest.raises(TimeoutError):
            await scaler.replicas("prefill")
        await scaler.apply((1, 2))  # each pool's read fails at its deadline: counted, logged, not raised
        await scaler.close()
        scaler = KubeScaler(slow_patches.url, "prod", {"prefill": "p", "decode": "d"}, "", True, 1.0)
        await scaler.apply((3, 2))  # prefill reads 3: nothing to patch; decode's patch fails at its deadline
        await scaler.close()

    try:
        asyncio.run(go())
    finally:
        slow_reads.close()
        slow_patches.close()
    assert (_scale_errors("prefill"), _scale_errors("decode")) == (before[0] + 1, before[1] + 2)


def test_a_scrape_that_trickles_is_cut_at_its_deadline() -> None:
    """A frontend or worker whose /metrics or /traffic answer trickles fails that scrape at SCRAPE_TIMEOUT_S
    (the whole answer), not at the body's length; the planner goes on without it."""
    from types import SimpleNamespace

    from services.planner.server import SCRAPE_TIMEOUT_S, Planner, add_arguments

    slow = _Trickler(
        b"rackserve_a 1\nrackserve_b 2\nrackserve_c 3\n", ("GET",)
    )  # 15 s at a byte every 0.35 s
    p = argparse.ArgumentParser()
    add_arguments(p)
    planner = Planner(p.parse_args([]), SimpleNamespace(workers=lambda role: []), None)  # type: ignore[arg-type]

    async def go() -> tuple[Any, float, float]:
        t = time.monotonic()
        scraped = await planner._scrape(slow.endpoint)
        scraped_s = time.monotonic() - t
        t = time.monotonic()
        await planner._read_traffic({"frontend/f/1": slow.endpoint})
        read_s = time.monotonic() - t
        await planner.close()
        return scraped, scraped_s, read_s

    try:
        scraped, scraped_s, read_s = asyncio.run(go())
    finally:
        slow.close()
    assert scraped is None  # failed (whole, it parses: a slow source was read to its end until 2026-12-07)
    # bounded by the deadline, not by the 15 s body (a generous margin for a loaded machine)
    assert scraped_s < SCRAPE_TIMEOUT_S + 5 and read_s < SCRAPE_TIMEOUT_S + 5


def test_frontends_whose_windows_differ_add_up_to_the_clusters_rate() -> None:
    """Two frontends at 1 request/s each; one scrape of frontend A fails, so A's next window is twice B's. Their
    counts were summed over the longest window (90 requests in 60 s: 1.5/s, until 2026-12-07); each is now scaled
    to the common window, and the rate is the cluster's 2/s."""
    from types import SimpleNamespace

    from services.planner.server import Planner, add_arguments

    arrived = (f"{observe._hist_name(m.PROMPT_TOKENS_PER_REQUEST)}_count", ())
    finished = (f"{observe._hist_name(m.OUTPUT_TOKENS_PER_REQUEST)}_count", ())
    # per round, per frontend: (scrape time, requests so far), or None for a failed scrape
    rounds = [
        {"a": (0.0, 0), "b": (0.0, 0)},
        {"a": None, "b": (30.0, 30)},
        {"a": (60.0, 60), "b": (60.0, 60)},
    ]
    frontends = [SimpleNamespace(worker_id=f, epoch=1, endpoint=f) for f in ("a", "b")]
    p = argparse.ArgumentParser()
    add_arguments(p)
    planner = Planner(
        p.parse_args([]), SimpleNamespace(workers=lambda role: frontends if role == "frontend" else [])
    )  # type: ignore[arg-type]
    at = iter(range(len(rounds) * 2))

    async def scrape(endpoint: str) -> tuple[float, observe.Samples] | None:
        answer = rounds[next(at) // 2][endpoint]
        return (
            None if answer is None else (answer[0], {arrived: float(answer[1]), finished: float(answer[1])})
        )

    planner._scrape = scrape  # type: ignore[method-assign]

    async def go() -> list[Observation | None]:
        try:
            return [await planner.measure() for _ in rounds]
        finally:
            await planner.close()

    first, second, third = asyncio.run(go())
    assert first is None and second is not None and second.rate_rps == pytest.approx(1.0)  # B alone, 30 s
    assert third is not None and third.window_s == 60.0 and third.rate_rps == pytest.approx(2.0)


class _MetricsServer(ThreadingHTTPServer):
    """A real HTTP server answering /metrics with a registry's Prometheus text, as a frontend does."""

    def __init__(self, registry: CollectorRegistry) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                _answer(self, generate_latest(registry))

            def log_message(self, *a: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)


@starts_processes
def test_a_replay_process_that_dies_is_replaced() -> None:
    """The replays run in a process of their own. Killed (the OOM killer), it broke its pool for good: every
    later decision failed at once and the planner never decided again. Now the next replay starts another."""
    from types import SimpleNamespace

    from services.planner.server import Planner, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    directory = SimpleNamespace(workers=lambda role: [])
    planner = Planner(p.parse_args([]), directory, None)  # type: ignore[arg-type]

    async def go() -> tuple[int, int, int]:
        first = await planner.replay(os.getpid)
        os.kill(first, signal.SIGKILL)
        await asyncio.sleep(0.5)
        second = await planner.replay(os.getpid)  # the pool broke under this call: a new process ran it
        third = await planner.replay(os.getpid)
        await planner.close()
        return first, second, third

    first, second, third = asyncio.run(go())
    assert first != os.getpid() and second not in (first, os.getpid()) and third == second


def _idle_kubernetes_planner(
    replicas: tuple[int, int], flags: list[str], times: list[float], leads: list[bool] | None = None
) -> tuple[list[dict], _FakeApiServer, Any]:
    """A planner in kubernetes mode before any worker has registered, against real HTTP servers: the API (the
    Deployments at `replicas`) and a frontend's /metrics that sees one request a window (below
    --min-window-requests: nothing to size on). Its decisions at `times`, the API server, the planner. With
    `leads`, whether it leads the election at each of them (else another replica does); each decision then
    also carries `exported`, the desired sizes its metrics show."""
    from types import SimpleNamespace

    from services.planner.server import Planner, add_arguments

    reg = CollectorRegistry()
    name = m.PROMPT_TOKENS_PER_REQUEST._name  # type: ignore[attr-defined]
    prompts = Histogram(name, "d", buckets=m.PROMPT_TOKENS_PER_REQUEST._upper_bounds[:-1], registry=reg)  # type: ignore[attr-defined]
    front, api = _MetricsServer(reg), _FakeApiServer()
    api.replicas = {"rackserve-prefill": replicas[0], "rackserve-decode": replicas[1]}
    for server in (front, api):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    frontend = SimpleNamespace(
        worker_id="frontend-0", epoch=1, endpoint=f"127.0.0.1:{front.server_address[1]}"
    )
    directory = SimpleNamespace(workers=lambda role: [frontend] if role == "frontend" else [])
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--scale-mode", "kubernetes", *flags])
    scaler = KubeScaler(f"http://127.0.0.1:{api.server_address[1]}", "prod",
                        {"prefill": "rackserve-prefill", "decode": "rackserve-decode"}, "tok", True, 2.0)  # fmt: skip
    planner = Planner(args, directory, scaler)  # type: ignore[arg-type]

    async def go() -> list[dict]:
        decisions = []
        for i, t in enumerate(times):
            prompts.observe(500)
            if leads is not None:
                planner.lead(None if leads[i] else "planner-other", leads[i])
            decisions.append(await planner.tick(now=t))
            if leads is not None:
                decisions[-1]["exported"] = {
                    p: REGISTRY.get_sample_value("rackserve_planner_desired_replicas", {"pool": p})
                    for p in m.POOLS
                }
        await scaler.close()
        await planner.close()
        return decisions

    try:
        return asyncio.run(go()), api, planner
    finally:
        front.shutdown()
        api.shutdown()


def test_an_idle_planner_scales_nothing_while_the_workers_are_still_starting() -> None:
    """Kubernetes mode, the planner up before any worker has registered (pods loading the model) and a few
    requests a window: no sized decision, so no PATCH (the Deployments keep their 3 + 2 replicas) and nothing
    the damper would count as a change."""
    decisions, api, planner = _idle_kubernetes_planner(
        (3, 2), ["--min-prefill", "1", "--min-decode", "1"], [100.0, 130.0, 160.0]
    )
    assert [d["outcome"] for d in decisions] == ["no_data", "idle", "idle"]
    assert all(d["actual"] == {"prefill": 0, "decode": 0} for d in decisions)
    assert [c for c in api.calls if c[0] == "PATCH"] == []
    assert api.replicas == {"rackserve-prefill": 3, "rackserve-decode": 2}
    assert planner.damper.last_change == {}


def test_a_floor_lifts_idle_pools_in_its_hours_through_the_kubernetes_api() -> None:
    """`--floor 08:00-18:00=3,2` in kubernetes mode, no traffic to size on and the Deployments at 1 + 1: from
    08:00 (UTC) the planner steps them up to the floor, one worker per pool a decision, from the replicas the
    API reports (no worker has registered); before 08:00 and once the floor is reached it scales nothing."""
    day = 20 * 86_400  # a whole number of days after the epoch: midnight UTC
    times = [
        day + 7.5 * 3600,
        day + 7.5 * 3600 + 30,
        day + 8 * 3600,
        day + 8 * 3600 + 30,
        day + 8 * 3600 + 60,
    ]
    decisions, api, _ = _idle_kubernetes_planner(
        (1, 1), ["--floor", "08:00-18:00=3,2; 23:30-00:30=2,1"], times
    )
    assert [d["outcome"] for d in decisions] == ["no_data", "idle", "scale_up", "scale_up", "idle"]
    assert [d["floor"] for d in decisions] == [None, None] + [{"prefill": 3, "decode": 2}] * 3
    assert [d["desired"] for d in decisions[2:4]] == [
        {"prefill": 2, "decode": 2},
        {"prefill": 3, "decode": 2},
    ]
    assert [(c[1].split("/")[-2], c[3]) for c in api.calls if c[0] == "PATCH"] == [
        ("rackserve-prefill", {"spec": {"replicas": 2}}),
        ("rackserve-decode", {"spec": {"replicas": 2}}),
        ("rackserve-prefill", {"spec": {"replicas": 3}}),
    ]
    assert api.replicas == {"rackserve-prefill": 3, "rackserve-decode": 2}
    # the dashboard's floor series: the window in force at the last decision
    floor = {p: REGISTRY.get_sample_value("rackserve_planner_floor_replicas", {"pool": p}) for p in m.POOLS}
    assert floor == {"prefill": 3.0, "decode": 2.0}


def test_a_planner_that_stops_leading_scales_nothing_and_exports_no_decision() -> None:
    """The floor test's planner, leading, then standing by for a decision (another replica leads), then leading
    again: no PATCH while it stands by, its metrics show no desired sizes then (a dashboard's max over the
    replicas is the leader's), and back in the lead it steps on from what the Deployments run."""
    day = 20 * 86_400
    times = [day + 8 * 3600, day + 8 * 3600 + 30, day + 8 * 3600 + 60]
    decisions, api, planner = _idle_kubernetes_planner(
        (1, 1), ["--floor", "08:00-18:00=3,2"], times, leads=[True, False, True]
    )
    assert [d["outcome"] for d in decisions] == ["scale_up", "standby", "scale_up"]
    assert decisions[1]["leader"] == "planner-other" and "desired" not in decisions[1]
    assert [d["exported"] for d in decisions] == [
        {"prefill": 2.0, "decode": 2.0}, {"prefill": None, "decode": None}, {"prefill": 3.0, "decode": 2.0},
    ]  # fmt: skip
    assert [(c[1].split("/")[-2], c[3]) for c in api.calls if c[0] == "PATCH"] == [
        ("rackserve-prefill", {"spec": {"replicas": 2}}),
        ("rackserve-decode", {"spec": {"replicas": 2}}),
        ("rackserve-prefill", {"spec": {"replicas": 3}}),
    ]
    assert REGISTRY.get_sample_value("rackserve_planner_leader") == 1.0


# 300-token prompts, one output token each, at 1 request/s: a window the stubbed or in-process replays size on
SIZABLE = Observation(
    window_s=20, requests=20, input_tokens=[(256, 0.0), (512, 20.0)], output_tokens=[(1, 20.0)],
    prompt_tokens=20 * 300, generation_tokens=20, input_samples=[300] * 20, output_samples=[1] * 20,
    ttft_p90_s=0.5,
)  # fmt: skip


def _local_planner(flags: list[str], registered: tuple[int, int]) -> Any:
    """A planner in local mode whose measurement is SIZABLE and whose directory lists `registered` workers."""
    from types import SimpleNamespace

    from services.planner.server import Planner, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    pools = dict(zip(("prefill", "decode"), registered, strict=True))
    directory = SimpleNamespace(
        workers=lambda role: [SimpleNamespace(worker_id=f"{role}-{i}") for i in range(pools.get(role, 0))]
    )
    planner = Planner(p.parse_args(["--scale-mode", "local", *flags]), directory)  # type: ignore[arg-type]

    async def measure() -> Observation:
        return SIZABLE

    planner.measure = measure  # type: ignore[method-assign]
    return planner


def test_kubernetes_mode_steps_from_the_deployments_replicas_so_a_refused_or_undone_patch_is_set_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Kubernetes mode, every replay wanting 2 prefill + 1 decode where the Deployments run 1 + 1: the API server
    answers the first PATCH with a 500, and after the planner has set prefill to 2 a `helm upgrade` sets it back
    to 1. Each time the next decision PATCHes 2 again (until 2026-12-07 the planner took its own last desired for
    what was set: it held at 2, and the Deployment stayed at 1 for good)."""
    from types import SimpleNamespace

    import services.planner.server as server

    monkeypatch.setattr(server, "choose", lambda *a: (SimpleNamespace(prefill=2, decode=1), "ttft"))
    monkeypatch.setattr(server, "attainable", lambda preds, goal, *a: goal)
    api = _FakeApiServer()
    api.replicas = {"rackserve-prefill": 1, "rackserve-decode": 1}
    api.refuse = [500]
    threading.Thread(target=api.serve_forever, daemon=True).start()
    planner = _local_planner(["--max-prefill", "2", "--max-decode", "1"], (1, 1))
    planner.args.scale_mode = "kubernetes"
    deployments = {"prefill": "rackserve-prefill", "decode": "rackserve-decode"}
    planner.scaler = KubeScaler(
        f"http://127.0.0.1:{api.server_address[1]}", "prod", deployments, "tok", True, 2.0
    )

    async def replay(fn: Any) -> list[Prediction]:
        return []

    planner.replay = replay
    before = _scale_errors("prefill")

    async def go() -> list[tuple[str, dict, dict]]:
        seen = []
        for t in (0.0, 30.0, 60.0, 90.0, 120.0):
            if t == 90.0:
                api.replicas["rackserve-prefill"] = 1  # a `helm upgrade` resets the chart's starting size
            d = await planner.tick(now=t)
            seen.append((d["outcome"], d["desired"], dict(api.replicas)))
        await planner.scaler.close()
        await planner.close()
        return seen

    try:
        seen = asyncio.run(go())
    finally:
        api.shutdown()
    two, at_1 = {"prefill": 2, "decode": 1}, {"rackserve-prefill": 1, "rackserve-decode": 1}
    at_2 = {"rackserve-prefill": 2, "rackserve-decode": 1}
    assert seen == [
        ("scale_up", two, at_1),  # refused
        ("scale_up", two, at_2),
        ("hold", two, at_2),
        ("scale_up", two, at_2),  # undone by hand, set again
        ("hold", two, at_2),
    ]
    assert [c[3] for c in api.calls if c[0] == "PATCH"] == [{"spec": {"replicas": 2}}] * 3
    assert _scale_errors("prefill") == before + 1


def test_kubernetes_mode_counts_a_failed_read_of_the_deployments_as_a_scale_error() -> None:
    """Each decision reads both Deployments' replicas first; an API server that does not answer that read is a
    failed call like a refused PATCH, counted in rackserve_planner_scale_errors_total (until 2026-12-07 it was
    only logged, and in an interval with nothing to size the scale-errors alert never saw it)."""
    planner = _local_planner([], (1, 1))
    planner.args.scale_mode = "kubernetes"
    deployments = {"prefill": "rackserve-prefill", "decode": "rackserve-decode"}
    planner.scaler = KubeScaler(f"http://127.0.0.1:{free_port()}", "prod", deployments, "tok", True, 2.0)

    async def measure() -> None:
        return None

    planner.measure = measure
    before = _scale_errors("prefill")

    async def go() -> dict:
        try:
            return await planner.tick(now=0.0)
        finally:
            await planner.scaler.close()
            await planner.close()

    assert asyncio.run(go())["outcome"] == "no_data"
    assert _scale_errors("prefill") == before + 1


def test_kubernetes_rebalance_steps_down_first_and_never_exceeds_the_budget_when_a_patch_is_refused() -> None:
    """A budget of 3 at 2 prefill + 1 decode, the decision 1 + 2. The step down is sent first; when the API server
    refuses it, the step up is not sent, so the pods never number 4 (until 2026-12-07 prefill went first
    whichever way it stepped, and a refused step down beside a step up that went through left 2 + 2 for a
    hold-down). The next apply sets both, down first; the other way round, decode steps down first."""
    api = _FakeApiServer()
    api.replicas = {"rackserve-prefill": 2, "rackserve-decode": 1}
    api.refuse = [500]
    threading.Thread(target=api.serve_forever, daemon=True).start()
    deployments = {"prefill": "rackserve-prefill", "decode": "rackserve-decode"}
    scaler = KubeScaler(f"http://127.0.0.1:{api.server_address[1]}", "prod", deployments, "tok", True, 2.0)

    async def go() -> list[dict[str, int]]:
        seen = []
        for desired in ((1, 2), (1, 2), (2, 1)):
            await scaler.apply(desired)
            seen.append(dict(api.replicas))
        await scaler.close()
        return seen

    try:
        seen = asyncio.run(go())
    finally:
        api.shutdown()
    assert seen == [
        {"rackserve-prefill": 2, "rackserve-decode": 1},  # the step down refused: no step up either
        {"rackserve-prefill": 1, "rackserve-decode": 2},
        {"rackserve-prefill": 2, "rackserve-decode": 1},
    ]
    patches = [
        (c[1].split("/deployments/")[1].split("/")[0], c[3]["spec"]["replicas"])
        for c in api.calls
        if c[0] == "PATCH"
    ]
    assert patches == [
        ("rackserve-prefill", 1),  # refused
        ("rackserve-prefill", 1),
        ("rackserve-decode", 2),
        ("rackserve-decode", 1),
        ("rackserve-prefill", 2),
    ]


def test_the_plan_names_the_registered_workers_it_counts() -> None:
    """`registered`: the ids `actual` counts, in every shape of the plan, so `up --planner` can tell its own
    workers from others registered in the same etcd."""
    planner = _local_planner([], (1, 2))
    want = {"prefill": ["prefill-0"], "decode": ["decode-0", "decode-1"]}
    assert planner.plan()["outcome"] == "starting" and planner.plan()["registered"] == want
    planner.current = {"outcome": "hold"}
    assert planner.plan()["registered"] == want and planner.plan()["actual"] == {"prefill": 1, "decode": 2}
    planner.lead("planner-other", False)
    assert planner.plan()["outcome"] == "standby" and planner.plan()["registered"] == want


@pytest.mark.parametrize(
    ("standby", "lease_after", "kept"),
    [
        # one round etcd did not answer, the same lease after it: no other replica can have held the key
        (RuntimeError("etcd did not answer"), 7, True),
        # a round saw another replica hold the key: it may have decided meanwhile
        ("planner-other", 7, False),
        # the lease (and the key with it) expired while etcd did not answer: another may have led unseen
        (RuntimeError("etcd did not answer"), 8, False),
    ],
)
def test_a_planner_back_in_the_lead_keeps_its_last_decision_only_if_no_other_replica_led_between(
    monkeypatch: pytest.MonkeyPatch, standby: Any, lease_after: int, kept: bool
) -> None:
    """Local mode, a 60 s hold-down: the planner scales decode 1 -> 2 (the new worker still loading: etcd lists
    1 + 1), then stands by for a campaign round, leads again and sizes for 1 decode worker. After a mere etcd
    hiccup its last decision stands: decode stays at 2 (held down), not drained from what etcd lists. Where
    another replica held the key, or its own lease ran out, it starts over from what runs."""
    from types import SimpleNamespace

    import services.planner.server as server

    targets = iter([(1, 2), (1, 1)])
    monkeypatch.setattr(
        server,
        "choose",
        lambda preds, goal, *a: (SimpleNamespace(prefill=(t := next(targets))[0], decode=t[1]), "itl"),
    )
    monkeypatch.setattr(server, "attainable", lambda preds, goal, *a: goal)
    planner = _local_planner(["--hold-down-s", "60", "--max-prefill", "1", "--max-decode", "2"], (1, 1))
    rounds: list[Any] = ["planner-me", standby, "planner-me"]

    # services/discovery/election.py's rounds, as etcd would answer them, under a registration lease of 7
    class Election:
        registration = SimpleNamespace(lease_id=7)

        async def campaign(self, client: Any, timeout_s: float) -> str | None:
            got = rounds.pop(0)
            if isinstance(got, Exception):
                raise got
            return got

        def leads(self, holder: str | None) -> bool:
            return holder == "planner-me"

    election = Election()

    async def replay(fn: Any) -> list[Prediction]:
        return []

    async def connect() -> object:
        return object()

    planner.replay, planner.connect = replay, connect

    async def go() -> list[dict]:
        client = await server._campaign(planner, election, object())  # type: ignore[arg-type]
        first = await planner.tick(now=0.0)
        client = await server._campaign(planner, election, client)  # type: ignore[arg-type]
        election.registration.lease_id = lease_after
        await server._campaign(planner, election, client)  # type: ignore[arg-type]
        second = await planner.tick(now=6.0)
        await planner.close()
        return [first, second]

    first, second = asyncio.run(go())
    assert planner.leader and (first["outcome"], first["desired"]) == (
        "scale_up",
        {"prefill": 1, "decode": 2},
    )
    assert second["actual"] == {"prefill": 1, "decode": 1} and second["outcome"] == "hold"
    if kept:
        assert second["desired"] == {"prefill": 1, "decode": 2}
        assert planner.damper.last_change == {"decode": 0.0}
    else:
        assert second["desired"] == {"prefill": 1, "decode": 1}
        assert planner.damper.last_change == {}


def test_an_agg_planner_with_min_prefill_0_plans_no_prefill_pool() -> None:
    """`--router-mode agg --min-prefill 0`: the decode workers prefill their own prompts, so (0, D) is a
    candidate, replayed as the agg cluster it is (the same p90s as (1, D): agg routes no prompt to a prefill
    pool), and the damper steps prefill down to 0. In disagg mode the floor stays one prefill worker."""
    import services.planner.server as server

    limits = Limits(0, 2, 1, 2)
    assert candidates(limits, "agg")[:2] == [(0, 1), (0, 2)]
    assert min(p for p, _ in candidates(limits)) == 1 and min(p for p, _ in candidates(limits, "auto")) == 1
    assert damp((1, 1), (0, 1), limits, Damper(0.0), 0.0, "agg") == (0, 1)
    assert damp((1, 1), (0, 1), limits, Damper(0.0), 0.0) == (1, 1)
    none, one = evaluate(SIZABLE, CPU, [(0, 1), (1, 1)], "agg")
    assert none.failed == 0 and none.requests > 0
    assert (none.ttft_p90_s, none.itl_p90_s) == (one.ttft_p90_s, one.itl_p90_s)

    planner = _local_planner(["--router-mode", "agg", "--min-prefill", "0", "--max-prefill", "2",
                              "--max-decode", "2", "--hold-down-s", "0"], (1, 1))  # fmt: skip

    # the replay in this process (no spawned one): what the planner asks of it is the same
    async def replay(fn: Any) -> Any:
        return fn()

    planner.replay = replay

    async def go() -> dict:
        decision = await planner.tick(now=0.0)
        await planner.close()
        return decision

    decision = asyncio.run(go())
    assert decision["target"]["prefill"] == 0 and decision["desired"]["prefill"] == 0
    assert {(c["prefill"], c["decode"]) for c in decision["candidates"]} >= {(0, 1), (0, 2)}
    with pytest.raises(ValueError, match="min-prefill"):
        server._config(argparse.Namespace(**{**vars(planner.args), "router_mode": "disagg"}))


@pytest.mark.cluster  # the replay runs in the planner's spawned process
def test_the_planner_service_corrects_its_target_only_from_windows_on_unchanged_pools() -> None:
    """`rackserve planner --correction`: a window is compared with its replay only when the pools that serve
    now also served at the last sized window; then the SLO it sizes for tightens by the correction. Without
    the flag the SLO is as set."""
    from services.planner.server import Planner, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    # 300-token prompts at 1 request/s with 5 queued, measured 3x slower at p90 than any replay of them
    obs = Observation(window_s=20, requests=20, input_tokens=[(256, 0.0), (512, 20.0)], output_tokens=[(1, 20.0)],
                      prompt_tokens=20 * 300, generation_tokens=20, input_samples=[300] * 20, output_samples=[1] * 20,
                      backlog=5, ttft_p90_s=30.0)  # fmt: skip
    profile = load_profile("cpu_smollm2")
    plain = Planner(p.parse_args(["--slo-ttft-ms", "1000"]), directory=None)  # type: ignore[arg-type]
    corrected = Planner(p.parse_args(["--slo-ttft-ms", "1000", "--correction"]), directory=None)  # type: ignore[arg-type]

    async def go() -> list[Slo]:
        goals = [await plain._corrected(obs, profile, (1, 1))]
        for pools in ((1, 1), (1, 1), (2, 1), (2, 1)):
            goals.append(await corrected._corrected(obs, profile, pools))
        await plain.close()
        await corrected.close()
        return goals

    goals = asyncio.run(go())
    assert plain.correction is None and goals[0] == Slo(1.0, 0.1)
    # first window: nothing to compare with; second, same pools: 3x, bounded to 2x, weighted 0.3 -> 1.3;
    # third, resized: not compared; fourth, the new pools again: 1.3 x 0.7 + 2 x 0.3
    assert [round(g.ttft_s, 4) for g in goals[1:]] == [
        1.0,
        round(1 / 1.3, 4),
        round(1 / 1.3, 4),
        round(1 / 1.51, 4),
    ]
    assert all(g.itl_s == 0.1 for g in goals) and corrected.correction is not None
    assert corrected.correction.to_dict() == {"ttft": 1.51, "itl": 1.0, "windows": 2}


def test_floor_windows_parse_and_wrap_past_midnight() -> None:
    from services.planner.plan import floor_at, parse_floors
    from services.planner.server import _floors

    floors = parse_floors("08:00-18:00=3,2; 23:30-00:30=2,1;17:00-19:00=1,3")
    assert floor_at(floors, 7 * 3600 + 3599) is None
    assert floor_at(floors, 8 * 3600) == (3, 2)
    assert floor_at(floors, 17 * 3600 + 60) == (3, 3)  # two windows: the larger of each pool
    assert floor_at(floors, 18 * 3600) == (1, 3)  # a window's end is not in it
    assert floor_at(floors, 86_400 * 3 + 10) == (2, 1)  # 00:00:10 on another day: the window past midnight
    assert floor_at(floors, 23 * 3600 + 1799) is None and parse_floors("") == []
    for bad in (
        "8-18=3,2",
        "08:00-18:00=3",
        "08:00=3,2",
        "08:00-24:00=1,1",
        "08:00-08:00=1,1",
        "08:00-09:00=a,1",
    ):
        with pytest.raises(ValueError):
            parse_floors(bad)
    # within the limits, also where two windows overlap: 17:00-18:00 asks for 3 + 3 of a budget of 5
    with pytest.raises(ValueError, match="--max-workers 5"):
        _floors("08:00-18:00=3,2; 17:00-19:00=1,3", Limits(1, 4, 1, 4, max_workers=5))
    with pytest.raises(ValueError, match="--max-prefill 4"):
        _floors("08:00-18:00=5,1", Limits(1, 4, 1, 4))
    assert len(_floors("08:00-18:00=3,2; 17:00-19:00=1,3", Limits(1, 4, 1, 4, max_workers=6))) == 2


def test_floor_windows_keep_to_their_weekdays_and_time_zone() -> None:
    """`--floor "Mon-Fri 08:00-18:00=3,2; ..." --floor-tz Europe/Berlin`: the times and days are Berlin's,
    daylight saving time included; a window past midnight runs on into the day after one of its days."""
    from services.planner.plan import floor_at, floor_zone, parse_floors
    from services.planner.server import _floors

    floors = parse_floors("Mon-Fri 08:00-18:00=3,2; sat,Sun 10:00-14:00=1,1; Fri 22:00-02:00=2,2")
    assert [f.days for f in floors] == [frozenset(range(5)), frozenset({5, 6}), frozenset({4})]
    berlin = floor_zone("Europe/Berlin")
    assert floor_zone("UTC") is None
    utc = 1_704_067_200  # 2024-01-01 00:00 UTC, a Monday
    hour, day = 3600, 86_400
    assert floor_at(floors, utc + 7 * hour, berlin) == (3, 2)  # Monday 08:00 in Berlin (CET, UTC+1)
    assert floor_at(floors, utc + 7 * hour) is None  # the same instant read in UTC: 07:00
    summer = 1_717_372_800  # 2024-06-03 00:00 UTC, a Monday
    assert floor_at(floors, summer + 6 * hour, berlin) == (3, 2)  # 08:00 in Berlin (CEST, UTC+2)
    assert floor_at(floors, summer + 6 * hour - 1, berlin) is None
    assert floor_at(floors, utc + 5 * day + 9 * hour, berlin) == (1, 1)  # Saturday 10:00
    assert floor_at(floors, utc + 4 * day + 23 * hour + 1800, berlin) == (
        2,
        2,
    )  # Saturday 00:30: Friday's window
    assert floor_at(floors, utc + 5 * day + 23 * hour + 1800, berlin) is None  # Sunday 00:30: no Saturday one
    assert floor_at(floors, utc + 5 * day + 7 * hour, berlin) is None  # Saturday 08:00: not a weekday
    assert parse_floors("Fri-Mon 01:00-02:00=1,1")[0].days == frozenset({4, 5, 6, 0})
    assert parse_floors(" 08:00 - 18:00 = 3,2")[0].days is None  # spaces inside a window without days
    for bad in ("Mox 08:00-09:00=1,1", "Mon- 08:00-09:00=1,1", "Mon-Fri08:00-09:00=1,1"):
        with pytest.raises(ValueError):
            parse_floors(bad)
    with pytest.raises(ValueError, match="--floor-tz 'Mars/Olympus'"):
        floor_zone("Mars/Olympus")
    # overlaps are checked on the days they share: Friday 17:00-18:00 asks for 3 + 3 of a budget of 5
    with pytest.raises(ValueError, match="from Fri 17:00"):
        _floors("Mon-Fri 08:00-18:00=3,2; Fri 17:00-19:00=1,3", Limits(1, 4, 1, 4, max_workers=5), berlin)
    assert (
        len(_floors("Mon-Thu 08:00-18:00=3,2; Fri 17:00-19:00=1,3", Limits(1, 4, 1, 4, max_workers=5))) == 2
    )


def test_floor_windows_do_not_start_on_the_dates_excepted() -> None:
    """`--floor-except "2024-12-24, 12-25"`: no window starts on Christmas Eve 2024 or on any Christmas Day (in
    --floor-tz); the window that started the evening before runs out past midnight as usual, and one that would
    start on the excepted date does not run into the next."""
    from services.planner.plan import floor_at, floor_zone, parse_floor_exceptions, parse_floors

    floors = parse_floors("Mon-Fri 08:00-18:00=3,2; 22:00-02:00=2,1")
    skip = parse_floor_exceptions("2024-12-24, 12-25")
    berlin = floor_zone("Europe/Berlin")
    hour, day = 3600, 86_400
    mon = 1_734_908_400  # 2024-12-23 00:00 in Berlin (CET), a Monday
    assert floor_at(floors, mon + 9 * hour, berlin, skip) == (3, 2)  # Monday: an ordinary day
    assert floor_at(floors, mon + day + 9 * hour, berlin) == (3, 2)  # Tuesday the 24th without exceptions
    assert floor_at(floors, mon + day + 9 * hour, berlin, skip) is None  # ... and with them
    assert floor_at(floors, mon + day + 30 * 60, berlin, skip) == (2, 1)  # 00:30 on the 24th: Monday's night
    assert (
        floor_at(floors, mon + day + 23 * hour, berlin, skip) is None
    )  # the 24th's own night does not start
    assert floor_at(floors, mon + 2 * day + 30 * 60, berlin, skip) is None  # ... nor run into the 25th
    assert floor_at(floors, mon + 2 * day + 9 * hour, berlin, skip) is None  # the 25th, every year
    next_year = 1_766_617_200  # 2025-12-25 00:00 in Berlin, a Thursday
    assert floor_at(floors, next_year + 9 * hour, berlin, skip) is None
    assert floor_at(floors, next_year + day + 9 * hour, berlin, skip) == (3, 2)  # Friday the 26th
    assert floor_at(floors, mon + 9 * hour, None, skip) == (
        3,
        2,
    )  # without a zone, UTC: 08:00 on Monday the 23rd
    assert not parse_floor_exceptions("") and parse_floor_exceptions("02-29").holds(date(2028, 2, 29))
    for bad in ("2024-13-01", "12/25", "02-30", "Christmas"):
        with pytest.raises(ValueError, match="--floor-except"):
            parse_floor_exceptions(bad)


def test_planner_flags_are_checked() -> None:
    from services.planner.server import _config, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ValueError, match="slo"):
        _config(p.parse_args(["--slo-itl-ms", "0"]))
    with pytest.raises(ValueError, match="min-prefill"):
        _config(p.parse_args(["--min-prefill", "3", "--max-prefill", "2"]))
    with pytest.raises(ValueError, match="reach-margin"):
        _config(p.parse_args(["--reach-margin", "-0.1"]))
    with pytest.raises(ValueError, match="scale-down-window-s"):
        _config(p.parse_args(["--scale-down-window-s", "-1"]))
    with pytest.raises(ValueError, match="predict-horizon-s"):
        _config(p.parse_args(["--predictor", "trend", "--predict-horizon-s", "-1"]))
    with pytest.raises(ValueError, match="season-s"):
        _config(p.parse_args(["--predictor", "seasonal", "--season-s", "0"]))
    with pytest.raises(SystemExit):
        p.parse_args(["--predictor", "arima"])
    with pytest.raises(SystemExit):
        p.parse_args(["--size-by", "p99"])
    assert (p.parse_args([]).predictor, p.parse_args([]).scale_down_window_s) == ("none", 0.0)
    assert (
        p.parse_args([]).size_by == "p90"
        and p.parse_args(["--size-by", "attainment"]).size_by == "attainment"
    )


def test_the_planner_service_builds_the_forecast_its_flags_name() -> None:
    from services.planner.plan import SeasonalForecast
    from services.planner.server import Planner, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--predictor", "seasonal", "--predict-horizon-s", "90", "--season-s", "604800",
                         "--season-span-s", "120", "--seasons", "4"])  # fmt: skip
    planner = Planner(args, directory=None)  # type: ignore[arg-type]
    try:
        f = planner.forecast
        assert isinstance(f, SeasonalForecast)
        assert (f.horizon_s, f.season_s, f.span_s, f.seasons) == (90.0, 604800.0, 120.0, 4)
        assert (p.parse_args([]).season_s, p.parse_args([]).seasons) == (86400.0, 7)  # a day, a week of them
    finally:
        asyncio.run(planner.close())


def _a_step_an_hour_ago(forecast: Any, now: float) -> None:
    """3 s windows around this moment an hour ago (the tests' season): the rate stepped from 1 to 4 req/s 15 s
    past it."""
    for t in range(-4200, -3000, 3):
        forecast.update(now + t, 1.0 if t < -3585 else 4.0, 3.0)


def test_a_restarted_planner_keeps_the_seasons_it_measured_in_etcd(etcd_server: EtcdServer) -> None:
    from services.discovery.etcd import close_quietly, connect_first_reachable, parse_etcd_urls
    from services.discovery.keys import PLANNER_SEASON_KEY
    from services.planner.server import Planner, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    flags = ["--etcd", etcd_server.url, "--predictor", "seasonal", "--predict-horizon-s", "30",
             "--season-s", "3600", "--season-span-s", "30"]  # fmt: skip

    def planner(*more: str) -> Planner:
        return Planner(p.parse_args([*flags, *more]), directory=None)  # type: ignore[arg-type]

    async def body() -> None:
        now = time.time()
        first = planner()
        assert await first.restore_season() == 0  # nothing saved yet
        f = first.forecast
        assert f is not None
        _a_step_an_hour_ago(f, now)  # today is at 1 req/s
        for t in range(-600, 1, 3):
            ahead = f.update(now + t, 1.0, 3.0)
        assert ahead == pytest.approx(4.0)
        assert await first.save_season() > 0
        await first.close()
        # a new planner process: its first window already forecasts the step (the state keeps ms, not every bit)
        second = planner()
        assert await second.restore_season() > 0
        assert second.forecast is not None and second.forecast.update(now, 1.0, 3.0) == pytest.approx(
            4.0, rel=1e-3
        )
        await second.close()
        # another season is another pattern: nothing taken, no forecast
        other = planner("--season-s", "7200")
        assert await other.restore_season() == 0 and other.forecast.update(now, 1.0, 3.0) == 1.0  # type: ignore[union-attr]
        await other.close()
        # what is not a state is reported and skipped: the planner plans without a forecast
        client = await connect_first_reachable(parse_etcd_urls(etcd_server.url), 5.0)
        await client.put(PLANNER_SEASON_KEY.encode(), b"not a state")
        await close_quietly(client)
        broken = planner()
        assert await broken.restore_season() == 0 and broken.forecast.update(now, 1.0, 3.0) == 1.0  # type: ignore[union-attr]
        await broken.close()

    asyncio.run(body())


def test_a_planner_process_restores_the_seasons_at_start_and_saves_them_when_stopped(
    etcd_server: EtcdServer, tmp_path
) -> None:
    import os
    import signal

    from services.discovery.etcd import close_quietly, connect_first_reachable, parse_etcd_urls
    from services.discovery.keys import PLANNER_SEASON_KEY
    from services.planner.plan import SeasonalForecast

    def forecast() -> SeasonalForecast:
        return SeasonalForecast(horizon_s=30.0, season_s=3600.0, span_s=30.0)

    seeded = forecast()
    now = time.time()
    _a_step_an_hour_ago(seeded, now)

    async def etcd(op: str) -> bytes | None:
        client = await connect_first_reachable(parse_etcd_urls(etcd_server.url), 5.0)
        try:
            if op == "put":
                await client.put(PLANNER_SEASON_KEY.encode(), seeded.to_state())
            elif op == "delete":
                await client.delete(PLANNER_SEASON_KEY.encode())
            else:
                got = await client.get(PLANNER_SEASON_KEY.encode())
                return None if got is None else got.value
            return None
        finally:
            await close_quietly(client)

    asyncio.run(etcd("put"))
    log_path = tmp_path / "planner.log"
    cmd = [sys.executable, "-m", "services.cli", "planner", "--etcd", etcd_server.url, "--port", "0",
           "--predictor", "seasonal", "--season-s", "3600", "--season-span-s", "30", "--predict-horizon-s", "30",
           "--interval-s", "1", "--season-save-s", "3600"]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    try:
        deadline = time.monotonic() + 60
        while f"restored {len(seeded.buckets)} buckets" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        # what it holds now is only in its memory: it writes it back when stopped
        asyncio.run(etcd("delete"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    saved = asyncio.run(etcd("get"))
    assert saved is not None, log_path.read_text()
    again = forecast()
    assert again.load_state(saved, time.time()) == len(seeded.buckets)
    assert again.buckets.keys() == seeded.buckets.keys()
    for k, (requests, seconds) in seeded.buckets.items():  # as measured, to the state's ms
        assert again.buckets[k] == pytest.approx([requests, seconds], abs=1e-3)


def _children(pid: int) -> set[int]:
    """Every process under `pid` (Linux /proc), its own children first."""
    import pathlib

    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in pathlib.Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = {int(k) for k in (task / "children").read_text().split()}
            except OSError:
                continue
            todo.extend(kids - out)
            out |= kids
    return out


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    import pathlib

    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_sigkilled_planner_leaves_no_replay_process_behind(etcd_server: EtcdServer, tmp_path) -> None:
    import os
    import signal

    log_path = tmp_path / "planner.log"
    cmd = [sys.executable, "-m", "services.cli", "planner", "--etcd", etcd_server.url, "--port", "0",
           "--interval-s", "1"]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    kids: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        # started at once: the replay process (spawned, so with multiprocessing's resource tracker beside it)
        while len(kids) < 2 or "planner planner-" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
            kids = _children(proc.pid)
        assert all(_running(k) for k in kids)
        proc.send_signal(signal.SIGKILL)  # no shutdown of its pool: the replay process must notice by itself
        proc.wait(timeout=10)
        deadline = time.monotonic() + 20
        while any(_running(k) for k in kids):
            assert time.monotonic() < deadline, f"still running after the planner's SIGKILL: {kids}"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for k in kids:
            if _running(k):
                os.kill(k, signal.SIGKILL)


def _spawn_logged(tmp_path, name: str, *argv: str) -> tuple[subprocess.Popen[bytes], Any]:
    import os

    log_path = tmp_path / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    return proc, log_path


def _until(what: str, check: Any, procs: list[tuple[subprocess.Popen[bytes], Any]], timeout_s: float) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` (with the logs) if a process exits
    or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        for proc, log_path in procs:
            assert proc.poll() is None, (
                f"{log_path.name} exited while waiting for {what}:\n{log_path.read_text()}"
            )
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for _, p in procs)
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s\n{logs}"
        time.sleep(0.2)


def test_of_two_planner_replicas_one_leads_and_the_other_takes_over_when_it_is_killed(
    etcd_server: EtcdServer, tmp_path
) -> None:
    import re
    import signal

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    front = _spawn_logged(tmp_path, "frontend", "services.frontend.server", "--etcd", etcd_server.url,
                          "--port", str(port))  # fmt: skip
    planner = ("services.cli", "planner", "--etcd", etcd_server.url, "--port", "0", "--interval-s", "1",
               "--lease-ttl-s", "2")  # fmt: skip
    procs = [front]  # those that must stay up
    spawned = [front]

    def endpoint(log_path: Any) -> str | None:
        found = re.search(r"planner \S+ on (http://\S+:\d+)", log_path.read_text())
        return found.group(1) if found else None

    def get(base: str, path: str) -> httpx.Response | None:
        try:
            return httpx.get(f"{base}{path}", timeout=10)
        except httpx.HTTPError:
            return None

    try:
        # b first, so that it leads and a, the standby, is the planner discovery lists first
        b = _spawn_logged(tmp_path, "planner-b", *planner, "--worker-id", "planner-b")
        procs.append(b)
        spawned.append(b)
        _until("a leading planner-b", lambda: "leading now" in b[1].read_text(), procs, 60)
        a = _spawn_logged(tmp_path, "planner-a", *planner, "--worker-id", "planner-a")
        procs.append(a)
        spawned.append(a)
        a_url = _until("planner-a's endpoint", lambda: endpoint(a[1]), procs, 60)
        b_url = endpoint(b[1])
        assert b_url is not None
        standby = _until("planner-a's plan", lambda: get(a_url, "/plan"), procs, 30).json()
        # from its first answer on (its HTTP port opens before its first round of the election)
        assert standby["outcome"] == "standby" and standby["leader"] in (None, "planner-b"), standby
        standby = _until("planner-a standing by for planner-b",
                         lambda: (p := get(a_url, "/plan")) is not None and p.json().get("leader") == "planner-b"
                         and p.json(), procs, 30)  # fmt: skip
        assert standby["outcome"] == "standby", standby
        assert "rackserve_planner_leader 0.0" in httpx.get(f"{a_url}/metrics", timeout=10).text
        assert "rackserve_planner_leader 1.0" in httpx.get(f"{b_url}/metrics", timeout=10).text
        leading = httpx.get(f"{b_url}/plan", timeout=10).json()
        assert leading["outcome"] != "standby", leading

        def front_plan() -> dict[str, Any] | None:
            r = get(url, "/v1/plan")
            return r.json() if r is not None and r.status_code == 200 else None

        # the frontend asks every replica it discovers and answers with the leader's plan, not the standby's
        _until("the frontend's plan", front_plan, procs, 60)
        for _ in range(5):
            answer = front_plan()
            assert answer is not None and answer["planner"] == "planner-b", answer
            assert answer["outcome"] != "standby", answer
            time.sleep(0.3)

        # the leader dies without a word: its lease (2 s) runs out and the standby takes over
        b[0].send_signal(signal.SIGKILL)
        b[0].wait(timeout=10)
        procs.remove(b)
        _until("planner-a leading", lambda: (p := get(a_url, "/plan")) is not None
               and p.json()["outcome"] != "standby", procs, 30)  # fmt: skip
        assert "rackserve_planner_leader 1.0" in httpx.get(f"{a_url}/metrics", timeout=10).text
        answer = _until("the frontend's plan from planner-a",
                        lambda: (p := front_plan()) is not None and p["planner"] == "planner-a" and p,
                        procs, 30)  # fmt: skip
        assert answer["outcome"] != "standby", answer
    finally:
        for proc, _ in spawned:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in spawned:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ---- a real cluster -----------------------------------------------------------------------------------------


def _numbers(rng: random.Random, n: int) -> str:
    return " ".join(str(rng.randrange(10_000)) for _ in range(n))  # no shared prefix between prompts


@pytest.mark.cluster
def test_up_passes_other_planner_flags_on_and_refuses_ones_it_sets_itself() -> None:
    """`up --planner-flag NAME=VALUE` reaches the planner as --NAME VALUE; a flag `up` sets itself, or one that is
    not NAME=VALUE, stops `up` before it starts anything, naming the flag to use."""
    from services.launcher import add_arguments as launcher_arguments

    parser = argparse.ArgumentParser(prog="rackserve up", exit_on_error=False)
    launcher_arguments(parser)
    a = parser.parse_args(["--planner", "--planner-flag", "predictor=seasonal", "--planner-flag=--seasons=3"])
    assert a.planner_flag == [("predictor", "seasonal"), ("seasons", "3")]
    with pytest.raises(argparse.ArgumentError, match="use `up --hold-down-s`"):
        parser.parse_args(["--planner-flag", "hold-down-s=5"])
    with pytest.raises(argparse.ArgumentError, match="expected NAME=VALUE"):
        parser.parse_args(["--planner-flag", "predictor"])


@pytest.mark.cluster  # starts processes (rackserve up)
def test_up_planner_moves_capacity_from_prefill_to_decode_without_losing_a_request() -> None:
    """`rackserve up --planner` (local mode), budget 3 workers, starting at 2 prefill + 1 decode. Long prompts
    with one output token keep it there (TTFT binds); short prompts with long outputs make it drain a prefill
    worker and start a decode worker (ITL binds). Every request of both phases answers 200 with its tokens,
    and the launcher's log shows the drain: the worker leaves with requests in flight and exits cleanly."""
    port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--mode", "disagg"]
    cmd += [
        "--prefill",
        "2",
        "--decode",
        "1",
        "--planner",
        "--planner-interval-s",
        "3",
        "--hold-down-s",
        "60",
    ]
    cmd += ["--max-workers", "3", "--max-prefill", "2", "--max-decode", "2"]
    cmd += ["--slo-ttft-ms", "1000", "--slo-itl-ms", "20", "--ready-timeout-s", "420"]
    # any other planner flag passes through `up`; half the default window keeps the test's length down
    cmd += ["--planner-flag", "scale-down-window-s=3", "--planner-flag", "min-window-requests=5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "rackserve is ready" in line:
                ready.set()
        ready.set()  # its output ended: it stopped (the wait below then fails at once, not at its deadline)

    threading.Thread(target=pump, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    stop = threading.Event()
    results: list[tuple[str, int, int]] = []  # (phase, status, completion tokens)

    def client(phase: str, seed: int, prompt_words: int, max_tokens: int, once: bool = False) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=url, timeout=300) as c:
            while not stop.is_set():
                r = c.post("/v1/completions", json={
                    "model": "SmolLM2-135M-Instruct", "prompt": _numbers(rng, prompt_words),
                    "max_tokens": max_tokens, "temperature": 0,
                })  # fmt: skip
                tokens = r.json().get("usage", {}).get("completion_tokens", 0) if r.status_code == 200 else 0
                results.append((phase, r.status_code, tokens))
                if once:
                    return

    def plan() -> dict:
        r = httpx.get(f"{url}/v1/plan", timeout=30)  # a loaded 2-core CI box
        assert r.status_code == 200, r.text + "\n" + "".join(lines[-60:])
        return r.json()

    def wait_plan(pred, timeout_s: float) -> dict:  # noqa: ANN001
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            p = plan()
            if pred(p):
                return p
            time.sleep(1)
        pytest.fail(
            f"plan never reached the expected state; last: {json.dumps(p)[:2000]}\n" + "".join(lines[-40:])
        )

    def run_phase(name: str, seeds: range, words: int, max_tokens: int, until) -> dict:  # noqa: ANN001
        """Clients send this shape until `until()` returns a plan; they stop before the phase ends."""
        stop.clear()
        threads = [threading.Thread(target=client, args=(name, s, words, max_tokens)) for s in seeds]
        for t in threads:
            t.start()
        try:
            return until()
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=180)

    try:
        assert ready.wait(450) and any("rackserve is ready" in x for x in lines), (
            "rackserve up did not become ready:\n" + "".join(lines[-40:])
        )

        def two_sized_decisions() -> dict:
            # a sized decision needs 5 finished arrivals (min-window-requests)
            first = wait_plan(lambda p: p.get("candidates"), 240)
            return wait_plan(lambda p: p["time"] > first["time"] and p.get("candidates"), 240)

        # long prompts, one token each: still 2 prefill + 1 decode, TTFT the binding SLO. "Long" is sized to this
        # machine: a prefill of ~3 s, well past the 1 s TTFT SLO, yet quick enough for 5 arrivals per window
        # (a CPU without native bf16 prefills ~35 tokens/s per worker, one with AVX-512 bf16 many times that)
        t0 = time.monotonic()
        client("calibrate", 99, 60, 1, once=True)
        words = max(15, min(200, round(60 * 3.0 / (time.monotonic() - t0))))
        a = run_phase("long_prompts", range(3), words, 1, two_sized_decisions)
        assert a["desired"] == {"prefill": 2, "decode": 1} and a["binding_slo"] == "ttft", a
        assert a["limits"]["scale_down_window_s"] == 3.0, a["limits"]
        both = {"prefill": 1, "decode": 2}

        def rebalanced() -> dict:
            # the prefill pool shrinks after its hold-down; then a sized decision (not an `idle` window of too
            # few arrivals on a loaded box, whose binding SLO is `none`) shows the new shape with ITL binding
            b = wait_plan(
                lambda p: p["actual"] == both and p["desired"] == both and p["binding_slo"] == "itl", 240
            )
            time.sleep(3)  # traffic keeps flowing on the new shape
            return b

        # ~10-token prompts, 48 tokens out: prefill is never the bottleneck, even on a CPU without native bf16
        b = run_phase("long_outputs", range(100, 108), 2, 48, rebalanced)
        assert b["binding_slo"] == "itl", b
    finally:
        stop.set()
        proc.send_signal(2)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    log = "".join(lines)
    by_phase = {ph: [r for r in results if r[0] == ph] for ph in ("long_prompts", "long_outputs")}
    assert all(len(v) >= 3 for v in by_phase.values()), {k: len(v) for k, v in by_phase.items()}
    assert all(status == 200 for _, status, _ in results), [r for r in results if r[1] != 200]
    assert all(n >= 1 for _, _, n in results)
    # the drain, in order: the planner's decision, the SIGTERM, the worker leaving, its clean exit
    drain = log.index("planner: draining prefill-1")
    assert log.index("started decode-1") > 0
    assert log.index("[prefill-1]", drain) and "prefill prefill-1 draining" in log[drain:]
    assert "prefill prefill-1 stopped" in log[drain:]
    assert "exited with status" not in log


# ---- the chart ------------------------------------------------------------------------------------------------


@pytest.mark.cluster
def test_chart_planner_profile_validates_strictly_and_its_rbac_is_the_minimum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ci profile with the planner in kubernetes mode: kubernetes-validate --strict accepts every object (the
    planner's Deployment, Role, RoleBinding, ServiceAccount, NetworkPolicy), the Role allows get/patch on the two
    worker Deployments' scale subresource and nothing else, and the env parses with the planner's own flags."""
    from services.planner.plan import floor_zone, parse_floor_exceptions
    from services.planner.server import _config, _floors
    from services.planner.server import add_arguments as planner_arguments
    from tests.deploy import test_chart as chart

    profile = chart.CHART / "ci" / "planner-kubernetes-values.yaml"
    manifest = chart.render_text("-f", str(profile))
    out = subprocess.run([str(chart.BIN / "kubernetes-validate"), "--strict", "-"], input=manifest,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    for kind in ("deployment", "role", "rolebinding", "serviceaccount", "networkpolicy"):
        assert f"passed for resource {kind}/rs-rackserve-planner" in out.stdout + out.stderr, kind
    objs = chart.render("-f", str(profile))
    role = chart.find(objs, "Role", "rs-rackserve-planner")
    assert role["rules"] == [{
        "apiGroups": ["apps"], "resources": ["deployments/scale"],
        "resourceNames": ["rs-rackserve-prefill", "rs-rackserve-decode"], "verbs": ["get", "patch"],
    }]  # fmt: skip
    binding = chart.find(objs, "RoleBinding", "rs-rackserve-planner")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "rs-rackserve-planner", "namespace": "llm"}
    ]
    assert not [o for o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding") and "planner" in str(o)]
    dep = chart.find(objs, "Deployment", "rs-rackserve-planner")
    spec = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 1 and spec["serviceAccountName"] == "rs-rackserve-planner"
    assert spec["automountServiceAccountToken"] is True
    env = chart.env_of(chart.container(dep, "planner"))
    for name, value in env.items():
        if isinstance(value, str):
            monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    planner_arguments(parser)
    known = {a.dest for a in parser._actions}
    assert all(n.removeprefix("RACKSERVE_").lower() in known for n in env if n.startswith("RACKSERVE_")), env
    args = parser.parse_args([])
    assert (args.scale_mode, args.kube_namespace, args.kube_prefill_deployment) == (
        "kubernetes", "llm", "rs-rackserve-prefill",
    )  # fmt: skip
    assert (args.slo_ttft_ms, args.max_workers, args.port) == (1500.0, 6, 8090)
    floors = _floors(args.floor, _config(args)[1], floor_zone(args.floor_tz))
    assert [(f.start_s, f.prefill, f.decode, f.days) for f in floors] == [
        (7 * 3600 + 1800, 3, 2, frozenset(range(5))), (22 * 3600, 2, 1, None),
    ]  # fmt: skip
    assert args.floor_tz == "Europe/Berlin"
    skip = parse_floor_exceptions(args.floor_except)
    assert (skip.yearly, skip.dates) == ({(12, 24), (12, 25)}, {date(2027, 4, 5)})
    # the frontend forwards GET /v1/plan to it; it reads the workers' /metrics: both admitted, nothing else
    policy = chart.find(objs, "NetworkPolicy", "rs-rackserve-planner")
    assert [p["port"] for p in policy["spec"]["ingress"][0]["ports"]] == [8090]
    workers = chart.find(objs, "NetworkPolicy", "rs-rackserve-workers")
    assert any("planner" in json.dumps(rule.get("from", [])) for rule in workers["spec"]["ingress"])


@pytest.mark.cluster
def test_chart_planner_replicas_roll_one_at_a_time_with_one_leading() -> None:
    from tests.deploy import test_chart as chart

    objs = chart.render("--set", "planner.enabled=true", "--set", "planner.replicas=2")
    dep = chart.find(objs, "Deployment", "rs-rackserve-planner")
    # two stand by for each other (the election); an upgrade surges one new pod, which waits for the lease
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }


@pytest.mark.cluster
def test_chart_recommend_mode_gets_no_token_and_no_role() -> None:
    from tests.deploy import test_chart as chart

    objs = chart.render("--set", "planner.enabled=true")
    dep = chart.find(objs, "Deployment", "rs-rackserve-planner")
    assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert not [
        o for o in objs if o["kind"] in ("Role", "RoleBinding") and "planner" in o["metadata"]["name"]
    ]
    assert not [o for o in chart.render() if "planner" in o["metadata"]["name"]]  # off by default
