"""The router: answers Route(tokens) with a RoutePlan naming the workers a request should use.

It follows etcd for the live prefill and decode workers (services.discovery), and opens a Subscribe stream to
each of them to keep that worker's latest LoadSnapshot and the set of KV block hashes it has cached — the
inputs of the TTFT-estimate policy to come (DESIGN.md §5). Today's policy is round-robin over the live decode
workers (and, for a disaggregated plan, over the live prefill workers); a worker reported as failed is hidden
for `--suppress-s`. Whether a request is disaggregated is `--mode`:
  agg     the decode worker prefills (the plan has no prefill worker);
  disagg  always a remote prefill — unless no prefill worker is live, then agg (the reason says so);
  auto    conditional disaggregation: disagg when the prompt has at least `--disagg-min-prompt-tokens` tokens
          and a prefill worker is live, else agg (a short prompt costs less to prefill than to ship).
The plan's reason names the mode and the rule that decided it; score_terms carries `disagg` (0 or 1).

This room must never hold request state: any number of routers can run side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import sys
import time
from dataclasses import dataclass, field

import grpc

from services.discovery import WorkerDirectory
from services.discovery.etcd import Backoff
from services.rpc import pb, pb_grpc
from services.runtime.args import add_flag, add_service_arguments
from services.runtime.errors import WorkerUnavailableError
from services.runtime.host import ServiceHost, configure_logging, service_main
from services.runtime.rpc import request_meta
from services.telemetry import metrics, tracing

log = logging.getLogger("rackserve.router")

ROLE = "router"
SERVICE_NAME = "rackserve.v1.Router"
GATED_METHODS = (f"/{SERVICE_NAME}/Route",)
WATCHED_ROLES = ("prefill", "decode")
DEFAULT_SUPPRESS_S = 10.0
MODES = ("agg", "disagg", "auto")
DEFAULT_MODE = "auto"
DEFAULT_DISAGG_MIN_PROMPT_TOKENS = 256  # below this, shipping the KV costs about what computing it does
# A Subscribe stream is long-lived but still has a deadline; when it passes the router simply opens a new one
# (with a fresh snapshot, which also heals any drift in the block index).
SUBSCRIBE_DEADLINE_S = 300.0


@dataclass
class WorkerView:
    """What this router knows about one worker beyond etcd: its load and the KV blocks it has cached."""

    info: pb.WorkerInfo
    load: pb.LoadSnapshot | None = None
    block_hashes: set[int] = field(default_factory=set)
    connected: bool = False


class WorkerViews:
    """One WorkerView and one Subscribe stream per worker the directory shows; dropped when it vanishes."""

    def __init__(self, directory: WorkerDirectory, subscriber_id: str) -> None:
        self.directory = directory
        self.subscriber_id = subscriber_id
        self.views: dict[str, WorkerView] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        directory.subscribe(self._on_change)

    def sync(self) -> None:
        """Start following every worker the directory shows now (those found before subscribing)."""
        for role in WATCHED_ROLES:
            for info in self.directory.workers(role):
                if info.worker_id not in self._tasks:
                    self._on_change("added", info)

    def _on_change(self, kind: str, info: pb.WorkerInfo) -> None:
        self._forget(info.worker_id)
        if kind == "added":
            view = self.views[info.worker_id] = WorkerView(info)
            self._tasks[info.worker_id] = asyncio.get_running_loop().create_task(
                self._follow(view), name=f"subscribe {info.worker_id}"
            )

    def _forget(self, worker_id: str) -> None:
        self.views.pop(worker_id, None)
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()

    async def _follow(self, view: WorkerView) -> None:
        backoff = Backoff(first_s=0.1, max_s=1.0)
        async with grpc.aio.insecure_channel(view.info.endpoint) as channel:
            # Subscribe has the same shape on both worker services
            stub_class = (
                pb_grpc.PrefillWorkerStub if view.info.role == "prefill" else pb_grpc.DecodeWorkerStub
            )
            stub = stub_class(channel)
            while True:
                try:
                    stream = stub.Subscribe(
                        pb.SubscribeRequest(subscriber_id=self.subscriber_id, snapshot=True),
                        timeout=SUBSCRIBE_DEADLINE_S,
                    )
                    view.block_hashes.clear()  # the snapshot that opens the stream rebuilds it
                    async for event in stream:
                        if not view.connected:
                            view.connected = True
                            backoff.reset()
                        _apply(view, event)
                except asyncio.CancelledError:
                    raise
                except grpc.aio.AioRpcError as e:
                    # the first failure after a working stream is news; retries of a dead worker are not
                    level = logging.INFO if view.connected else logging.DEBUG
                    if e.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                        log.log(
                            level,
                            "subscription to %s: %s %s",
                            view.info.worker_id,
                            e.code().name,
                            e.details(),
                        )
                view.connected = False
                await asyncio.sleep(backoff.next_s())

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for worker_id in list(self._tasks):
            self._forget(worker_id)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _apply(view: WorkerView, event: pb.WorkerEvent) -> None:
    if event.epoch != view.info.epoch:
        return  # another process behind the same endpoint; etcd will tell us about it
    if event.HasField("load"):
        view.load = event.load
    elif event.HasField("kv"):
        if event.kv.kind == pb.KvBlockEvent.STORED:
            view.block_hashes.update(event.kv.block_hashes)
        else:
            view.block_hashes.difference_update(event.kv.block_hashes)


class RoundRobin:
    """Each choice is the next worker id after the previous choice, in id order, so a changing set stays fair."""

    reason = "round_robin"

    def __init__(self) -> None:
        self._last_id = ""

    def choose(self, candidates: list[pb.WorkerInfo]) -> pb.WorkerInfo:
        ordered = sorted(candidates, key=lambda w: w.worker_id)
        chosen = next((w for w in ordered if w.worker_id > self._last_id), ordered[0])
        self._last_id = chosen.worker_id
        return chosen


def _ref(info: pb.WorkerInfo) -> pb.WorkerRef:
    return pb.WorkerRef(worker_id=info.worker_id, endpoint=info.endpoint, role=info.role, epoch=info.epoch)


def disagg_decision(
    mode: str, prompt_tokens: int, need_prefill: bool, prefill_live: bool, min_tokens: int
) -> str:
    """ "agg: …" or "disagg: …" — the decision and the rule behind it, as the plan's reason starts."""
    if mode == "agg":
        return "agg: mode agg"
    if not need_prefill:
        return "agg: no prefill needed"
    if not prefill_live:
        return f"agg: mode {mode} but no live prefill worker"
    if mode == "disagg":
        return "disagg: mode disagg"
    if prompt_tokens >= min_tokens:
        return f"disagg: auto, prompt {prompt_tokens} >= {min_tokens} tokens"
    return f"agg: auto, prompt {prompt_tokens} < {min_tokens} tokens"


class Router(pb_grpc.RouterServicer):
    def __init__(
        self,
        directory: WorkerDirectory,
        views: WorkerViews,
        suppress_s: float = DEFAULT_SUPPRESS_S,
        mode: str = DEFAULT_MODE,
        disagg_min_prompt_tokens: int = DEFAULT_DISAGG_MIN_PROMPT_TOKENS,
    ):
        if mode not in MODES:
            raise ValueError(f"--mode must be one of {MODES}, got {mode!r}")
        self.directory = directory
        self.views = views
        self.suppress_s = suppress_s
        self.mode = mode
        self.disagg_min_prompt_tokens = disagg_min_prompt_tokens
        self.policy = RoundRobin()
        self.prefill_policy = RoundRobin()

    async def Route(  # noqa: N802 - gRPC method name
        self, request: pb.RouteRequest, context: grpc.aio.ServicerContext
    ) -> pb.RoutePlan:
        """The plan, with its `route` span (reason and score terms) and routing metrics around the policy."""
        started = time.monotonic()
        with tracing.server_span("route", request_meta(context).traceparent, request.request_id) as span:
            plan = await self._route(request)
            policy = self.policy.reason
            shape = "disagg" if plan.HasField("prefill") else "agg"
            metrics.DECISIONS.labels(policy, metrics.reason_label(plan.reason), shape).inc()
            metrics.ROUTE_S.observe(time.monotonic() - started)
            tracing.set_attributes(
                span,
                {
                    "rackserve.route.reason": plan.reason,
                    "rackserve.route.policy": policy,
                    "rackserve.route.decode_worker": plan.decode.worker_id,
                    "rackserve.route.prefill_worker": plan.prefill.worker_id
                    if plan.HasField("prefill")
                    else None,
                    "rackserve.prompt_tokens": len(request.token_ids),
                    **{f"rackserve.route.score.{k}": v for k, v in plan.score_terms.items()},
                },
            )
            return plan

    async def _route(self, request: pb.RouteRequest) -> pb.RoutePlan:
        excluded = set(request.exclude_worker_ids)
        candidates = [w for w in self.directory.workers("decode") if w.worker_id not in excluded]
        if not candidates:
            metrics.NO_WORKER.inc()
            raise WorkerUnavailableError("no decode workers")
        decode = self.policy.choose(candidates)
        prefills = [w for w in self.directory.workers("prefill") if w.worker_id not in excluded]
        decision = disagg_decision(
            self.mode,
            len(request.token_ids),
            request.need_prefill,
            bool(prefills),
            self.disagg_min_prompt_tokens,
        )
        disagg = decision.startswith("disagg")
        plan = pb.RoutePlan(
            decode=_ref(decode),
            reason=f"{decision}; {self.policy.reason}",
            score_terms={"disagg": 1.0 if disagg else 0.0},
        )
        if disagg:
            plan.prefill.CopyFrom(_ref(self.prefill_policy.choose(prefills)))
        return plan

    async def ReportFailure(  # noqa: N802 - gRPC method name
        self, request: pb.FailureReport, context: grpc.aio.ServicerContext
    ) -> pb.Empty:
        if not request.worker_id:
            raise ValueError("worker_id is required")
        log.info("failure reported for %s (request %s): %s; hiding it for %.1fs",
                 request.worker_id, request.request_id, request.cause, self.suppress_s)  # fmt: skip
        self.directory.suppress(request.worker_id, self.suppress_s)
        return pb.Empty()


def export_healthy_workers(directory: WorkerDirectory, roles: tuple[str, ...]) -> None:
    """rackserve_healthy_workers{role}: read from this router's view of etcd at scrape time."""
    for role in roles:
        metrics.HEALTHY_WORKERS.labels(role).set_function(functools.partial(_count, directory, role))


def _count(directory: WorkerDirectory, role: str) -> float:
    return float(len(directory.workers(role)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_service_arguments(parser)
    g = parser.add_argument_group("router")
    add_flag(
        g, "--suppress-s", DEFAULT_SUPPRESS_S, "how long a worker reported as failed is not routed to", float
    )
    add_flag(g, "--mode", DEFAULT_MODE, "agg | disagg | auto (conditional disaggregation)", choices=MODES)
    add_flag(
        g, "--disagg-min-prompt-tokens", DEFAULT_DISAGG_MIN_PROMPT_TOKENS,
        "auto mode: the shortest prompt that is prefilled remotely", int,
    )  # fmt: skip


async def serve(args: argparse.Namespace) -> None:
    configure_logging()
    host = ServiceHost(args, ROLE, [SERVICE_NAME], GATED_METHODS)
    directory = WorkerDirectory(args.etcd, roles=WATCHED_ROLES)
    views = WorkerViews(directory, subscriber_id=host.worker_id)
    try:
        await directory.start()
        views.sync()
        export_healthy_workers(directory, WATCHED_ROLES)
        pb_grpc.add_RouterServicer_to_server(
            Router(directory, views, args.suppress_s, args.mode, args.disagg_min_prompt_tokens), host.server
        )
        await host.start()
        await host.serve(host.worker_info())
        await host.wait_for_signal()
        await host.drain()
    finally:
        await host.close()
        await views.close()
        await directory.close()


if __name__ == "__main__":
    sys.exit(service_main(ROLE, __doc__ or "", add_arguments, serve))
