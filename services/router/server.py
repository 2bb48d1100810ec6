"""The router: answers Route(tokens) with a RoutePlan naming the workers a request should use, and why.

It follows etcd for the live prefill and decode workers (services.discovery) and opens a Subscribe stream to each
of them; their load reports and stored/evicted KV-block events feed a RouterState (services.router.state): the
worker set, the global prefix index, this router's pending reservations and the measured prefill rates. Each
Route is one call of the configured policy (`--policy`, services.router.policy; default `ttft`, the
time-to-first-token estimate of services.router.cost_model). `--mode` bounds the plan's shape:
  agg     the decode worker prefills (the plan has no prefill worker);
  disagg  always a remote prefill — unless no prefill worker is eligible, then agg (the reason says so);
  auto    conditional disaggregation: the ttft policy compares prefilling on the decode worker with the best
          remote plan; the baselines use `--disagg-min-prompt-tokens`.
The plan carries the winner's and the runner-up's score terms, the reason, and the estimated TTFT; decisions
are counted by policy and reason (services.telemetry.metrics, served on `--metrics-port`).

This room must never hold request state: any number of routers can run side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from services.discovery import WorkerDirectory
from services.discovery.etcd import Backoff
from services.router.cost_model import CostSettings
from services.router.policy import (
    DEFAULT_DISAGG_MIN_PROMPT_TOKENS,
    DEFAULT_MODE,
    DEFAULT_POLICY,
    MODES,
    POLICIES,
    REGISTRY,
    Decision,
    NoWorkerError,
    PlanScore,
    Policy,
    RouteQuery,
    TtftSettings,
    WorkerState,
    make_policy,
    setting_flag,
)
from services.router.prefix_index import DEFAULT_MAX_ENTRIES, DISK, HOST
from services.router.reservations import DEFAULT_ARRIVAL_GRACE_S, DEFAULT_TTL_S
from services.router.state import DEFAULT_FAILURE_EXCLUSION_S, DEFAULT_SILENT_AFTER_S, RouterState
from services.rpc import pb, pb_grpc
from services.runtime.args import add_flag, add_service_arguments, env_name
from services.runtime.errors import WorkerUnavailableError
from services.runtime.host import ServiceHost, configure_logging, service_main
from services.runtime.rpc import request_meta
from services.runtime.tls import GrpcTls, open_channel
from services.telemetry import metrics, tracing

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

log = logging.getLogger("rackserve.router")

ROLE = "router"
SERVICE_NAME = "rackserve.v1.Router"
GATED_METHODS = (f"/{SERVICE_NAME}/Route",)
WATCHED_ROLES = ("prefill", "decode")
# A Subscribe stream is long-lived but still has a deadline; when it passes the router simply opens a new one
# (with a fresh snapshot, which also heals any drift in the block index).
SUBSCRIBE_DEADLINE_S = 300.0


def worker_state(info: pb.WorkerInfo) -> WorkerState:
    topo = info.topology
    return WorkerState(
        worker_id=info.worker_id,
        role=info.role,
        epoch=info.epoch,
        endpoint=info.endpoint,
        block_size=info.block_size or 16,
        capacity_blocks=info.kv_capacity_blocks,
        fingerprint=info.model_fingerprint,
        node=topo.get("node", ""),
        rack=topo.get("rack", ""),
        zone=topo.get("zone", ""),
        kv_bytes_per_token=info.kv_bytes_per_token,
        kv_dtype=info.kv_dtype,
        max_model_len=info.max_model_len,
    )


class WorkerViews:
    """One Subscribe stream per worker the directory shows, feeding RouterState; dropped when it vanishes."""

    def __init__(
        self, directory: WorkerDirectory, state: RouterState, subscriber_id: str, tls: GrpcTls | None = None
    ) -> None:
        self.directory = directory
        self.state = state
        self.subscriber_id = subscriber_id
        self.tls = tls
        self.connected: dict[str, bool] = {}
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
            self.state.add_worker(worker_state(info), time.monotonic())
            self.connected[info.worker_id] = False
            self._tasks[info.worker_id] = asyncio.get_running_loop().create_task(
                self._follow(info), name=f"subscribe {info.worker_id}"
            )
        else:
            self.state.remove_worker(info.worker_id)

    def _forget(self, worker_id: str) -> None:
        self.connected.pop(worker_id, None)
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()

    async def _follow(self, info: pb.WorkerInfo) -> None:
        backoff = Backoff(first_s=0.1, max_s=1.0)
        worker_id = info.worker_id
        async with open_channel(info.endpoint, self.tls) as channel:
            # Subscribe has the same shape on both worker services
            stub_class = pb_grpc.PrefillWorkerStub if info.role == "prefill" else pb_grpc.DecodeWorkerStub
            stub = stub_class(channel)
            while True:
                try:
                    stream = stub.Subscribe(
                        pb.SubscribeRequest(subscriber_id=self.subscriber_id, snapshot=True),
                        timeout=SUBSCRIBE_DEADLINE_S,
                    )
                    # the snapshot that opens the stream rebuilds the worker's blocks: the old ones are forgotten when
                    # it comes, not before. A worker takes it between two engine steps (seconds apart on a CPU, under
                    # a long prompt), and this stream reopens every SUBSCRIBE_DEADLINE_S: forgetting them at once
                    # hid a busy worker's whole cache from routing for that long each time
                    fresh = True
                    loaded = False  # block events before the first load report are the snapshot, not new work
                    # a worker reports its load every second; RouterState.silent() excludes one that stops (a
                    # frozen, dead or stuck process) from its last event's time. The stream itself is not cut
                    # on silence: after a stall of this router's own loop every stream would be, at once.
                    async for event in stream:
                        if not self.connected.get(worker_id):
                            self.connected[worker_id] = True
                            backoff.reset()
                        if event.epoch != info.epoch:
                            continue  # another process behind the same endpoint; etcd will tell us about it
                        if fresh:
                            self.state.forget_blocks(worker_id)
                            fresh = False
                        self.state.heard(worker_id, time.monotonic())
                        loaded = self._apply(worker_id, event, loaded)
                except asyncio.CancelledError:
                    raise
                except grpc.aio.AioRpcError as e:
                    # the first failure after a working stream is news; retries of a dead worker are not
                    level = logging.INFO if self.connected.get(worker_id) else logging.DEBUG
                    # DEADLINE_EXCEEDED is our own deadline: the stream is reopened at once, nothing is lost
                    if e.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                        self.state.lost(worker_id)
                        self.state.forget_blocks(worker_id)
                        log.log(level, "subscription to %s: %s %s", worker_id, e.code().name, e.details())
                if worker_id in self.connected:
                    self.connected[worker_id] = False
                await asyncio.sleep(backoff.next_s())

    def _apply(self, worker_id: str, event: pb.WorkerEvent, loaded: bool) -> bool:
        state = self.state
        if event.HasField("load"):
            load = event.load
            state.on_load(
                worker_id,
                time.monotonic(),
                waiting=load.waiting,
                running=load.running,
                queued_prefill_tokens=load.queued_prefill_tokens,
                active_decode_blocks=load.active_decode_blocks,
                free_blocks=load.free_blocks,
                step_s=load.step_s,
            )
            return True
        if event.HasField("kv"):
            apply_kv_event(state, worker_id, event.kv, computed=loaded)
            metrics.INDEX_DROPPED_BLOCKS.set(state.index.dropped)
        return loaded

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for worker_id in list(self._tasks):
            self._forget(worker_id)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _ref(w: WorkerState) -> pb.WorkerRef:
    return pb.WorkerRef(worker_id=w.worker_id, endpoint=w.endpoint, role=w.role, epoch=w.epoch)


def route_plan(decision: Decision, workers: dict[str, WorkerState], query: RouteQuery) -> pb.RoutePlan:
    """The decision as the wire carries it: workers, reason, winner's and runner-up's terms, TTFT estimate,
    and the peer pull it planned (the source's endpoint and epoch from discovery, the prompt's own chained
    block hashes of the blocks to copy)."""
    chosen = decision.chosen
    plan = pb.RoutePlan(
        decode=_ref(workers[chosen.decode]),
        reason=f"{decision.detail}; {decision.policy}: {decision.reason}",
        reason_code=decision.reason,
        policy=decision.policy,
        score_terms={**chosen.terms, "disagg": 0.0 if chosen.prefill is None else 1.0},
        estimated_ttft_s=chosen.estimated_ttft_s,
    )
    if chosen.prefill is not None:
        plan.prefill.CopyFrom(_ref(workers[chosen.prefill]))
    pull = chosen.pull
    if pull is not None:
        puller = workers[chosen.prefilling_worker]
        plan.prefix_pull.CopyFrom(
            pb.PrefixPull(
                source=_ref(workers[pull.source]),
                start_block=pull.start_block,
                block_hashes=query.hashes(puller.block_size)[
                    pull.start_block : pull.start_block + pull.blocks
                ],
                deadline_s=pull.deadline_s,
            )
        )
    runner: PlanScore | None = decision.runner_up
    if runner is not None:
        plan.runner_up_decode.CopyFrom(_ref(workers[runner.decode]))
        if runner.prefill is not None:
            plan.runner_up_prefill.CopyFrom(_ref(workers[runner.prefill]))
        plan.runner_up_terms.update({**runner.terms, "disagg": 0.0 if runner.prefill is None else 1.0})
        plan.runner_up_estimated_ttft_s = runner.estimated_ttft_s
    return plan


class Router(pb_grpc.RouterServicer):
    def __init__(self, state: RouterState) -> None:
        self.state = state
        self.policy = state.policy
        self._silent: list[str] = []  # the workers last found silent, to log each change once

    async def Route(  # noqa: N802 - gRPC method name
        self, request: pb.RouteRequest, context: grpc.aio.ServicerContext
    ) -> pb.RoutePlan:
        """The plan, with its `route` span (reason and score terms) and its latency observed."""
        started = time.monotonic()
        with tracing.server_span("route", request_meta(context).traceparent, request.request_id) as span:
            plan = self._route(request)
            metrics.ROUTE_S.observe(time.monotonic() - started)
            tracing.set_attributes(
                span,
                {
                    "rackserve.route.reason": plan.reason,
                    "rackserve.route.reason_code": plan.reason_code,
                    "rackserve.route.policy": plan.policy,
                    "rackserve.route.estimated_ttft_s": plan.estimated_ttft_s,
                    "rackserve.route.decode_worker": plan.decode.worker_id,
                    "rackserve.route.prefill_worker": plan.prefill.worker_id
                    if plan.HasField("prefill")
                    else None,
                    "rackserve.prompt_tokens": len(request.token_ids),
                    **{f"rackserve.route.score.{k}": v for k, v in plan.score_terms.items()},
                    **{f"rackserve.route.runner_up.{k}": v for k, v in plan.runner_up_terms.items()},
                },
            )
            return plan

    def _route(self, request: pb.RouteRequest) -> pb.RoutePlan:
        """One policy call over the router's state; the decision counted by policy, reason and shape."""
        tokens = list(request.token_ids)
        if request.need_prefill and not tokens:
            raise ValueError("token_ids is empty: there is no prompt to prefill")
        if tokens and min(tokens) < 0:
            raise ValueError(f"token_ids holds a negative token id ({min(tokens)})")
        # the longest context among the decode workers: every plan has one, a worker refuses a prompt of
        # max_model_len tokens or more and the policies choose no such worker, so a prompt as long fits no plan
        # (however long a prefill worker's context) and would only cost hashing time
        longest = max((w.max_model_len for w in self.state.workers.values() if w.role == "decode"), default=0)
        if longest and len(tokens) >= longest:
            raise ValueError(
                f"{len(tokens)} token ids: no shorter than any decode worker's context ({longest} tokens)"
            )
        query = RouteQuery(
            request_id=request.request_id or f"route-{uuid.uuid4().hex}",
            token_ids=tokens,
            exclude=frozenset(request.exclude_worker_ids),
            need_prefill=request.need_prefill,
        )
        now = time.monotonic()
        silent = self.state.silent(now)
        if silent != self._silent:
            for worker_id in sorted(set(silent) - set(self._silent)):
                log.warning("%s has said nothing for over %.1fs: not routed to until it does",
                            worker_id, self.state.silent_after_s)  # fmt: skip
            self._silent = silent
        try:
            decision = self.state.route(query, now)
        except NoWorkerError as e:
            metrics.NO_WORKER.inc()
            raise WorkerUnavailableError(str(e)) from e
        shape = "agg" if decision.prefill is None else "disagg"
        metrics.DECISIONS.labels(decision.policy, decision.reason, shape).inc()
        return route_plan(decision, self.state.workers, query)

    async def ReportFailure(  # noqa: N802 - gRPC method name
        self, request: pb.FailureReport, context: grpc.aio.ServicerContext
    ) -> pb.Empty:
        if not request.worker_id:
            raise ValueError("worker_id is required")
        if not self.state.report_failure(request.worker_id, time.monotonic(), request.worker_epoch):
            log.debug("failure report for %.200s (epoch %d) ignored: no such process here",
                      request.worker_id, request.worker_epoch)  # fmt: skip
            return pb.Empty()
        log.info("failure reported for %s (request %.200s): %.500s; excluded until it re-registers or %.1fs pass",
                 request.worker_id, request.request_id, request.cause, self.state.failure_exclusion_s)  # fmt: skip
        return pb.Empty()


T = TypeVar("T", bound="DataclassInstance")


def parse_bool(raw: str, name: str) -> bool:
    """An on/off setting from the environment: 1/true/yes/on or 0/false/no/off, else refused by name."""
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be one of 1/true/yes/on or 0/false/no/off, got {raw!r}")


def _add_settings_flags(group: argparse._ArgumentGroup, settings_type: type[Any]) -> None:
    """One flag per field of a settings dataclass, named, typed, defaulted and explained by the field."""
    for f in dataclasses.fields(settings_type):
        flag = setting_flag(f)
        if isinstance(f.default, bool):  # --name / --no-name, its default from RACKSERVE_<NAME> when set
            env = env_name(flag)
            raw = os.environ.get(env)
            default = f.default if raw is None else parse_bool(raw, env)
            group.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=f"{f.metadata['help']} [env {env}=1|0]",
            )
        else:
            add_flag(group, flag, f.default, f.metadata["help"], type(f.default))


def _settings_from_args(settings_type: type[T], args: argparse.Namespace) -> T:
    values = {
        f.name: getattr(args, setting_flag(f)[2:].replace("-", "_"))
        for f in dataclasses.fields(settings_type)
    }
    return settings_type(**values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_service_arguments(parser)
    g = parser.add_argument_group("router")
    add_flag(
        g, "--policy", DEFAULT_POLICY, "routing policy (ttft is rackserve's TTFT estimate)", choices=POLICIES
    )
    add_flag(g, "--mode", DEFAULT_MODE, "agg | disagg | auto (conditional disaggregation)", choices=MODES)
    add_flag(
        g, "--disagg-min-prompt-tokens", DEFAULT_DISAGG_MIN_PROMPT_TOKENS,
        "auto mode, baseline policies: the shortest prompt that is prefilled remotely", int,
    )  # fmt: skip
    add_flag(
        g, "--suppress-s", DEFAULT_FAILURE_EXCLUSION_S,
        "a worker reported as failed is not routed to until it re-registers with a new epoch or this passes",
        float,
    )  # fmt: skip
    add_flag(
        g, "--silent-after-s", DEFAULT_SILENT_AFTER_S,
        "a worker whose event stream says nothing for this long (it reports its load every second; a frozen, "
        "dead or stuck process stops) is not routed to until it speaks again", float,
    )  # fmt: skip
    add_flag(
        g,
        "--index-max-blocks",
        DEFAULT_MAX_ENTRIES,
        "bound of the prefix index: (worker, block) entries",
        int,
    )
    add_flag(
        g, "--reservation-ttl-s", DEFAULT_TTL_S, "a routed request's reservation expires after this", float
    )
    add_flag(
        g, "--reservation-grace-s", DEFAULT_ARRIVAL_GRACE_S,
        "a load report must be this much newer than a reservation to replace it", float,
    )  # fmt: skip
    t = parser.add_argument_group("ttft policy")
    _add_settings_flags(t, TtftSettings)
    _add_settings_flags(t, CostSettings)
    b = parser.add_argument_group("baseline policies")
    # every policy's settings dataclass, each once (several baselines have none)
    for settings_type in dict.fromkeys(cls.Settings for cls in REGISTRY.values()):
        if settings_type is not TtftSettings:
            _add_settings_flags(b, settings_type)


def policy_from_args(args: argparse.Namespace) -> Policy:
    return make_policy(
        args.policy,
        args.mode,
        settings=_settings_from_args(CostSettings, args),
        disagg_min_prompt_tokens=args.disagg_min_prompt_tokens,
        options=_settings_from_args(REGISTRY[args.policy].Settings, args),
    )


async def serve(args: argparse.Namespace) -> None:
    configure_logging()
    state = RouterState(
        policy_from_args(args),
        index_max_entries=args.index_max_blocks,
        reservation_ttl_s=args.reservation_ttl_s,
        reservation_grace_s=args.reservation_grace_s,
        failure_exclusion_s=args.suppress_s,
        silent_after_s=args.silent_after_s,
    )
    metrics.INDEXED_BLOCKS.set_function(lambda: len(state.index))
    host = ServiceHost(args, ROLE, [SERVICE_NAME], GATED_METHODS)
    directory = WorkerDirectory(args.etcd, roles=WATCHED_ROLES, security=host.etcd_security)
    views = WorkerViews(directory, state, subscriber_id=host.worker_id, tls=host.tls)
    try:
        await directory.start()
        views.sync()
        metrics.export_healthy_workers(directory, WATCHED_ROLES)
        pb_grpc.add_RouterServicer_to_server(Router(state), host.server)
        await host.start()
        await host.serve(host.worker_info())
        await host.wait_for_signal()
        await host.drain()
    finally:
        await host.close()
        await views.close()
        await directory.close()


def apply_kv_event(state: RouterState, worker_id: str, kv: pb.KvBlockEvent, computed: bool) -> None:
    """One KvBlockEvent from a worker into the router's state, by kind (and so by tier). `computed`: stored
    blocks are new work (not the snapshot that opens a stream)."""
    hashes = list(kv.block_hashes)
    tier = DISK if kv.tier == pb.KvBlockEvent.DISK else HOST
    if kv.kind == pb.KvBlockEvent.STORED:
        state.on_stored(worker_id, hashes, computed=computed)
    elif kv.kind == pb.KvBlockEvent.EVICTED:
        state.on_evicted(worker_id, hashes)
    elif kv.kind == pb.KvBlockEvent.OFFLOADED:
        state.on_offloaded(worker_id, hashes, tier)
    elif kv.kind == pb.KvBlockEvent.RESTORED:
        state.on_restored(worker_id, hashes, tier)
    elif kv.kind == pb.KvBlockEvent.DROPPED:
        state.on_tier2_dropped(worker_id, hashes, tier)


if __name__ == "__main__":
    sys.exit(service_main(ROLE, __doc__ or "", add_arguments, serve))
