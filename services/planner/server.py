"""The planner process: every `--interval-s` it reads what the cluster measures, replays that traffic through
the simulator on candidate (prefill, decode) pool sizes with the live cost profile, picks the fewest workers
that meet `--slo-ttft-ms` / `--slo-itl-ms`, damps the step, and publishes the decision.

    rackserve planner --etcd http://127.0.0.1:2379 --slo-ttft-ms 2000 --slo-itl-ms 100

Publishing: `GET /plan` on its HTTP port (the frontend's `GET /v1/plan` forwards to it; the planner registers
in etcd with role `planner` and that port as its endpoint), `/metrics` (rackserve_planner_*), one log line
per decision. Acting (`--scale-mode`): `recommend` publishes only; `local` publishes for `rackserve up
--planner`, which starts and drains its worker processes to match; `kubernetes` patches the two Deployments'
`scale` subresource (services/planner/kube.py).

This room never holds request state and never talks to the workers' gRPC: it reads only their /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any, TypeVar

import aetcd
import httpx
import uvicorn
from fastapi import FastAPI, Response

from loadgen.workload import RequestSpec
from services.discovery import Registration, WorkerDirectory
from services.discovery.election import Election
from services.discovery.etcd import (
    EtcdSecurity,
    close_quietly,
    connect_first_reachable,
    describe,
    parse_etcd_urls,
    with_deadline,
)
from services.discovery.keys import PLANNER_LEADER_KEY, PLANNER_SEASON_KEY
from services.planner import observe
from services.planner.plan import (
    PREDICTORS,
    REACH,
    REPLAY_MIN_WINDOW_S,
    SIZE_BY,
    WEEKDAYS,
    Correction,
    Damper,
    Floor,
    Limits,
    Observation,
    SeasonalForecast,
    Slo,
    attainable,
    candidates,
    choose,
    damp,
    evaluate,
    floor_at,
    floor_zone,
    live_profile,
    make_forecast,
    parse_floor_exceptions,
    parse_floors,
    recent_specs,
    with_floor,
)
from services.rpc import pb
from services.runtime.args import (
    add_advertise_host,
    add_flag,
    add_security_arguments,
    advertised_host,
    port_number,
    switch,
)
from services.runtime.http import DeadlineClient
from services.telemetry import metrics
from services.telemetry.traffic import TrafficRecord

log = logging.getLogger("rackserve.planner")

ROLE = "planner"
T = TypeVar("T")
SCALE_MODES = ("recommend", "local", "kubernetes")
SCRAPE_TIMEOUT_S = 2.0
DRAIN_HTTP_S = 5  # on SIGTERM, how long uvicorn waits for answers still being written (/v1/plan is small)
ETCD_TIMEOUT_S = 5.0  # one read or write of the seasons' state
PARENT_CHECK_S = 0.5  # how often the replay process looks for the planner that spawned it
REPLAY_FROM = ("synthetic", "recent")
TRAFFIC_KEEP_S = 600.0  # the most of a frontend's traffic log the planner holds (a window kept open grows)
SEASON_STATE_MAX_BYTES = 1 << 20  # etcd refuses requests above 1.5 MiB by default (--max-request-bytes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("planner")
    add_flag(g, "--etcd", "http://127.0.0.1:2379", "etcd endpoint for discovery")
    add_flag(g, "--host", "127.0.0.1", "address to listen on and to register")
    add_advertise_host(g)
    add_flag(
        g,
        "--port",
        0,
        "HTTP port of /plan and /metrics (0: an ephemeral port, registered in etcd)",
        port_number,
    )
    add_flag(g, "--worker-id", "", "id in discovery (default: planner-HOSTNAME-PID)")
    add_flag(g, "--lease-ttl-s", 10.0, "etcd lease TTL of the planner's registration", float)
    add_flag(g, "--interval-s", 30.0, "seconds between decisions (also the measurement window)", float)
    add_flag(g, "--slo-ttft-ms", 2000.0, "p90 time-to-first-token target", float)
    add_flag(g, "--slo-itl-ms", 100.0, "p90 inter-token-latency target", float)
    add_flag(g, "--min-prefill", 1, "fewest prefill workers", int)
    add_flag(g, "--max-prefill", 4, "most prefill workers", int)
    add_flag(g, "--min-decode", 1, "fewest decode workers", int)
    add_flag(g, "--max-decode", 4, "most decode workers", int)
    add_flag(g, "--max-workers", 0, "budget on prefill + decode workers together (0: none)", int)
    add_flag(g, "--floor", "", "daily windows of wall-clock time in which the pools are kept at least this "
             "large, `[DAYS ]HH:MM-HH:MM=P,D` separated by `;`, DAYS such as Mon-Fri or Sat,Sun (none: every day; a "
             "cron floor, as KEDA's cron scaler; a window may run past midnight; start it a start-up plus a few "
             "intervals early)")  # fmt: skip
    add_flag(g, "--floor-except", "", "dates on which no --floor window starts (holidays), `,`-separated: "
             "YYYY-MM-DD, or MM-DD for every year; in --floor-tz")  # fmt: skip
    add_flag(g, "--floor-tz", "UTC", "the time zone of --floor's times and days (an IANA name such as "
             "America/New_York; daylight saving time is followed)")  # fmt: skip
    add_flag(g, "--hold-down-s", 60.0, "no step in a pool within this long of its last step", float)
    add_flag(g, "--scale-down-window-s", 0.0, "a pool steps down only to the largest size any decision of this "
             "last while wanted (the HPA's scale-down stabilization window; 0: the latest decision's)",
             float)  # fmt: skip
    add_flag(g, "--scale-mode", "recommend", "recommend: publish only; local: `rackserve up --planner` acts; "
             "kubernetes: patch the Deployments' replicas", choices=SCALE_MODES)  # fmt: skip
    add_flag(g, "--profile", "cpu_smollm2", "the simulator's cost profile (loadgen/profiles) that the live "
             "measurements calibrate")  # fmt: skip
    add_flag(g, "--router-mode", "disagg", "the router's --mode, replayed in the simulator",
             choices=("agg", "disagg", "auto"))  # fmt: skip
    add_flag(g, "--min-window-requests", 10, "arrivals a window needs before it is replayed (fewer: "
             "hold, and the window extends into the next interval)", int)  # fmt: skip
    add_flag(g, "--replay-requests", 200, "most requests of one window replayed per candidate", int)
    add_flag(g, "--replay-from", "synthetic", "what a replay plays: synthetic: requests drawn from the measured "
             "length histograms sharing one prefix of the measured hit rate; recent: the requests of the last "
             "interval themselves, as the frontends' GET /traffic logged them (their arrivals and the prefixes "
             "they shared); synthetic where no frontend serves it", choices=REPLAY_FROM)  # fmt: skip
    add_flag(g, "--reach-margin", REACH, "where no size meets an SLO (prompts too long for the TTFT target on any "
             "number of workers), a size within this fraction of the best candidate's p90 counts as meeting it; "
             "with --size-by attainment, a size may miss this fraction of the replayed requests more than the best",
             float)  # fmt: skip
    add_flag(g, "--size-by", "p90", "what a candidate is judged by: p90: its p90 TTFT and ITL against the targets "
             "(or the best reachable p90s); attainment: the replayed requests that miss the SLO (TTFT, or their own "
             "p90 ITL), against the fewest any candidate misses (docs/planner.md)", str, SIZE_BY)  # fmt: skip
    add_flag(g, "--predictor", "none", "the arrival rate replayed: none: the window's measured rate; trend: "
             "Holt's linear trend over the windows, --predict-horizon-s ahead; seasonal: the window's rate times "
             "the rise the same time of the last --seasons seasons (--season-s) saw --predict-horizon-s ahead",
             choices=PREDICTORS)  # fmt: skip
    add_flag(g, "--season-s", 86400.0, "with --predictor seasonal: the length of a season (a day; a week is "
             "604800)", float)  # fmt: skip
    add_flag(g, "--season-span-s", 60.0, "with --predictor seasonal: the span a rate is averaged over, "
             "ahead in the seasons past and behind today", float)  # fmt: skip
    add_flag(g, "--seasons", 7, "with --predictor seasonal: how many past seasons are kept and averaged", int)
    add_flag(g, "--season-save-s", 300.0, "with --predictor seasonal: how often what was measured is saved to "
             "etcd (and at shutdown), so a restarted planner keeps its seasons; 0: never", float)  # fmt: skip
    add_flag(g, "--predict-horizon-s", 60.0, "with --predictor trend or seasonal: how far ahead to size for "
             "(a worker's start-up time plus one interval)", float)  # fmt: skip
    switch(g, "--correction", "size against the SLO divided by how far the measured p90s have run from the replay "
           "of the same windows on the pools that served them (smoothed; Dynamo's planner's correction factors): "
           "what the simulator does not model is then measured")  # fmt: skip
    add_flag(g, "--history", 100, "decisions `GET /plan` keeps", int)
    k = parser.add_argument_group("kubernetes (--scale-mode kubernetes)")
    add_flag(k, "--kube-namespace", "", "namespace of the Deployments (default: the pod's own)")
    add_flag(k, "--kube-prefill-deployment", "rackserve-prefill", "the prefill Deployment")
    add_flag(k, "--kube-decode-deployment", "rackserve-decode", "the decode Deployment")
    add_flag(k, "--kube-api", "https://kubernetes.default.svc", "the Kubernetes API server")
    add_flag(k, "--kube-timeout-s", 5.0, "deadline of one Kubernetes API call, its answer included", float)
    add_security_arguments(parser)


def _config(args: argparse.Namespace) -> tuple[Slo, Limits]:
    if args.interval_s <= 0:
        raise ValueError(f"--interval-s must be > 0, got {args.interval_s}")
    if args.slo_ttft_ms <= 0 or args.slo_itl_ms <= 0:
        raise ValueError("--slo-ttft-ms and --slo-itl-ms must be > 0")
    if args.reach_margin < 0:
        raise ValueError(f"--reach-margin must be >= 0, got {args.reach_margin}")
    if args.scale_down_window_s < 0:
        raise ValueError(f"--scale-down-window-s must be >= 0, got {args.scale_down_window_s}")
    if args.predict_horizon_s < 0:
        raise ValueError(f"--predict-horizon-s must be >= 0, got {args.predict_horizon_s}")
    if args.season_s <= 0 or args.season_span_s <= 0 or args.seasons < 1 or args.season_save_s < 0:
        raise ValueError(
            "--season-s and --season-span-s must be > 0, --seasons >= 1 and --season-save-s >= 0"
        )
    if args.min_prefill < 1 and args.router_mode != "agg":
        raise ValueError(f"--router-mode {args.router_mode} needs --min-prefill >= 1")
    limits = Limits(args.min_prefill, args.max_prefill, args.min_decode, args.max_decode, args.max_workers)
    return Slo(args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000), limits


def _floors(text: str, limits: Limits, tz: tzinfo | None = None) -> list[Floor]:
    """`--floor`'s windows, each within the limits, and so every overlap of them (the largest floor of an
    overlap is in force from some window's start on: each start is checked on each of its days of a week)."""
    floors = parse_floors(text)
    monday = datetime(2024, 1, 1, tzinfo=tz or UTC)  # a Monday without a daylight-saving change that week
    for f in floors:
        for day in sorted(f.days) if f.days is not None else [0]:
            wall = (monday + timedelta(days=day, seconds=f.start_s)).timestamp()
            p, d = floor_at(floors, wall, tz) or (0, 0)
            if (
                p > limits.max_prefill
                or d > limits.max_decode
                or (limits.max_workers and p + d > limits.max_workers)
            ):
                when = f"{WEEKDAYS[day].capitalize()} " if f.days is not None else ""
                raise ValueError(
                    f"--floor asks for {p} prefill + {d} decode workers from {when}{f.start_s // 3600:02d}:"
                    f"{f.start_s % 3600 // 60:02d}, beyond --max-prefill {limits.max_prefill}, --max-decode "
                    f"{limits.max_decode} or --max-workers {limits.max_workers}"
                )
    return floors


def _exit_with_parent(parent: int) -> None:
    """The replay process's initializer: it leaves as soon as the planner that spawned it is gone. A planner
    SIGKILLed (the OOM killer, a pod's grace period run out) never shuts its pool down, and the replay process
    would otherwise idle on as an orphan, holding multiprocessing's resource tracker open with it."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="planner-watch", daemon=True).start()


def _replay_pool() -> concurrent.futures.ProcessPoolExecutor:
    return concurrent.futures.ProcessPoolExecutor(
        1,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_exit_with_parent,
        initargs=(os.getpid(),),
    )


class Planner:
    """The decision loop's state: last scrapes, the damper, the history; `tick()` is one interval."""

    def __init__(self, args: argparse.Namespace, directory: WorkerDirectory, scaler: Any = None) -> None:
        from loadgen.sim.profile import load_profile

        self.args = args
        self.slo, self.limits = _config(args)
        self.floor_tz = floor_zone(args.floor_tz)
        self.floors = _floors(args.floor, self.limits, self.floor_tz)
        self.floor_skip = parse_floor_exceptions(args.floor_except)
        self.base_profile = load_profile(args.profile)
        self.directory = directory
        self.scaler = scaler
        self.damper = Damper(args.hold_down_s, args.scale_down_window_s)
        self.correction = Correction() if args.correction else None
        self.forecast = make_forecast(
            args.predictor, args.predict_horizon_s, args.season_s, args.season_span_s, args.seasons
        )
        self.security = EtcdSecurity.from_args(args)
        self.prev: dict[
            str, tuple[float, observe.Samples]
        ] = {}  # source -> (time, samples) of its last scrape
        self.history: deque[dict[str, Any]] = deque(maxlen=args.history)
        self.current: dict[str, Any] | None = None
        self.client = DeadlineClient(SCRAPE_TIMEOUT_S)
        # the replays are pure-Python CPU work: in a process of their own they never starve this event loop
        # (its etcd lease keep-alive, its HTTP answers); spawned, since this process runs gRPC threads
        self.pool = _replay_pool()
        self.desired: tuple[int, int] | None = None
        # a planner alone leads; `serve` campaigns (services/discovery/election.py) so that of several replicas
        # one decides and acts while the others stand by, measuring, to take over where it stops
        self.leader = True
        self.holder: str | None = None  # the leader's worker id, as the last campaign round read it
        # the registration lease this replica last led under (its leader key lives and dies with it), and whether
        # a round since then saw another replica hold the key: either way another replica may have decided
        # between this one's decisions, and a return to the lead then starts over
        self.term: int | None = None
        self.rival = False
        # --replay-from recent: per frontend (id and epoch), the last seq read, the records since, and how far
        # this host's clock is ahead of the frontend's
        self.traffic: dict[str, tuple[int, deque[TrafficRecord], float]] = {}

    def actual(self) -> tuple[int, int]:
        return len(self.directory.workers("prefill")), len(self.directory.workers("decode"))

    def discovered(self) -> dict[str, Any]:
        """What discovery shows now, from one reading of it: the workers per pool (`actual`) and the ids counted
        (`registered`: a launcher following the plan, `up --planner`, tells its own workers from others
        registered in the same etcd by them)."""
        registered = {
            role: sorted(w.worker_id for w in self.directory.workers(role)) for role in ("prefill", "decode")
        }
        return {"actual": {role: len(ids) for role, ids in registered.items()}, "registered": registered}

    async def _scrape(self, endpoint: str) -> tuple[float, observe.Samples] | None:
        """(when it answered, its samples): the window ends when the numbers were read, not when asked."""
        try:
            r = await self.client.get(f"http://{endpoint}/metrics")
            r.raise_for_status()
            return time.monotonic(), observe.parse(r.text)
        except (httpx.HTTPError, ValueError) as e:
            log.info("planner: scrape of %s failed: %s", endpoint, e)
            return None

    async def measure(self) -> Observation | None:
        """Scrape every frontend and worker; each source's window is since its own last good scrape (a
        failed scrape keeps the older one, so nothing is counted twice). None on the first scrape. A window
        with fewer than --min-window-requests finished requests is not closed: the next one extends it."""
        sources: dict[str, tuple[str, str]] = {}
        for f in self.directory.workers("frontend"):
            sources[f"frontend/{f.worker_id}/{f.epoch}"] = ("frontend", f.endpoint)
        for role in ("prefill", "decode"):
            for w in self.directory.workers(role):
                if w.metrics_endpoint:
                    sources[f"{role}/{w.worker_id}/{w.epoch}"] = (role, w.metrics_endpoint)
        got = await asyncio.gather(*(self._scrape(ep) for _, ep in sources.values()))
        if self.args.replay_from == "recent":
            await self._read_traffic({k: ep for k, (role, ep) in sources.items() if role == "frontend"})
        front: observe.Samples = {}
        workers: dict[str, tuple[str, observe.Samples, observe.Samples]] = {}
        fronts: list[tuple[float, observe.Samples]] = []  # per frontend: its window and its deltas over it
        fresh: dict[str, tuple[float, observe.Samples]] = {}
        for (key, (role, _)), answer in zip(sources.items(), got, strict=True):
            prev = self.prev.get(key)
            if answer is None:
                if prev is not None:
                    fresh[key] = prev
                continue
            now, samples = answer
            fresh[key] = answer
            d = observe.delta(samples, prev[1] if prev is not None else None)
            if role == "frontend":
                if prev is None:
                    continue  # a frontend first seen now: its counters span its whole life, not a window
                fronts.append((now - prev[0], d))
            else:
                workers[key] = (role, d, samples)
        window = max((span for span, _ in fronts), default=0.0)
        if window <= 0:
            self.prev = fresh
            return None
        for span, d in fronts:
            # Frontends' windows differ where a scrape failed (its window is since its last good one): each
            # frontend's counts are scaled to the common window, so their rates add up. Summed as they were,
            # over the longest window, a frontend that answered every time counted for less (until 2026-12-07).
            scale = window / span if span > 0 else 0.0
            for k, v in d.items():
                front[k] = front.get(k, 0.0) + v * scale
        obs = observe.observation(front, workers, window)
        if self._sizable(obs):
            self.prev = fresh
        else:  # keep the window open; only sources first seen now start from here
            self.prev = {**fresh, **self.prev}
        return obs

    async def _read_traffic(self, frontends: dict[str, str]) -> None:
        """The records each frontend's traffic log added since the last read (a frontend first seen, or
        restarted under a new epoch, from its first); a frontend gone is forgotten."""

        async def read(key: str, endpoint: str) -> None:
            last, held, ahead = self.traffic.get(key, (0, deque(), 0.0))
            try:
                r = await self.client.get(f"http://{endpoint}/traffic", params={"since": last})
                r.raise_for_status()
                body = r.json()
                got = [TrafficRecord(**x) for x in body["requests"]]
                ahead = time.time() - float(body["now"])
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                log.info("planner: GET /traffic of %s failed: %s", endpoint, e)
                got = []
            held.extend(got)
            oldest = time.time() - TRAFFIC_KEEP_S - ahead  # on the frontend's clock
            while held and held[0].t < oldest:  # a window kept open is bounded
                held.popleft()
            self.traffic[key] = (got[-1].seq if got else last, held, ahead)

        self.traffic = {k: v for k, v in self.traffic.items() if k in frontends}
        await asyncio.gather(*(read(k, ep) for k, ep in frontends.items()))

    def _recent(self, window_s: float) -> list[RequestSpec] | None:
        """The requests of the last `window_s` (at least REPLAY_MIN_WINDOW_S, as a synthetic replay) as the
        traffic logs hold them, merged in arrival order, as replay specs. None: no log holds any."""
        since = time.time() - max(window_s, REPLAY_MIN_WINDOW_S)
        timed: list[tuple[float, str, TrafficRecord]] = []
        for key, (_, held, ahead) in self.traffic.items():  # each frontend's times on this host's clock
            timed.extend((r.t + ahead, key, r) for r in held if r.t + ahead >= since)
        timed.sort(key=lambda x: x[0])
        return recent_specs([(key, replace(r, t=t)) for t, key, r in timed]) or None

    def _sizable(self, obs: Observation) -> bool:
        """A window with enough arrivals (--min-window-requests) and a finished request to replay."""
        return obs.requests >= self.args.min_window_requests and obs.done > 0

    def lead(self, holder: str | None, leads: bool, term: int | None = None) -> None:
        """What a campaign round found: this replica leads, or `holder` does (None: no one it could see, as
        when etcd did not answer). `term`: the registration lease the round campaigned under."""
        was, self.leader, self.holder = self.leader, leads, holder
        metrics.PLANNER_LEADER.set(1.0 if leads else 0.0)
        if not leads and holder is not None:
            self.rival = True
        if leads and not was:
            if self.rival or term != self.term:
                log.info("planner: leading now")
                # another replica may have led since this one last did: its seasons are the ones it restored at
                # its start plus what it measured since, standing by (no less than the old leader saved); the
                # damping starts over from what runs
                self.desired = None
                self.damper = Damper(self.args.hold_down_s, self.args.scale_down_window_s)
            else:
                # its key never left it (the same lease, and no round saw another holder): no other replica
                # decided while it stood by (an etcd hiccup), so its last decision and damping still stand.
                # Starting over from what runs would leave out the workers its last steps started that are
                # still loading, and drain one of them despite the hold-down
                log.info("planner: leading again; no other replica led meanwhile, its last decision stands")
        if leads:
            self.term, self.rival = term, False
        elif was and not leads:
            log.info("planner: standing by (%s leads)", holder or "no one yet")
            # a standby exports no decision: dashboards take the pools' desired sizes from the leader alone
            self.current = None
            for gauge in (metrics.PLANNER_DESIRED, metrics.PLANNER_TARGET, metrics.PLANNER_FLOOR,
                          metrics.PLANNER_BINDING_SLO, metrics.PLANNER_PREDICTED_P90_S,
                          metrics.PLANNER_CORRECTION):  # fmt: skip
                gauge.clear()

    async def tick(self, now: float | None = None) -> dict[str, Any]:
        wall = time.time() if now is None else now
        now = time.monotonic() if now is None else now
        t0 = time.perf_counter()
        obs = await self.measure()
        if not self.leader:
            return self._stand_by(obs, wall)
        actual = self.actual()
        # what the last step asked for is the base of the next (workers take a while to appear); until the
        # first sized decision, and in recommend mode, it is what runs
        base = self.desired if self.desired is not None and self.args.scale_mode != "recommend" else actual
        deployments = await self._deployments()
        if deployments is not None:
            # kubernetes mode: what the Deployments are set to is what was last asked for — by this planner, by a
            # `helm upgrade` or a `kubectl scale` since, or not at all where its PATCH failed. Stepping from its
            # own memory instead, it held at a size the Deployments did not have: a PATCH refused once (a 500)
            # or replicas reset by hand were never set again (until 2026-12-07)
            base = deployments
        preds: list[Any] = []
        floor = floor_at(self.floors, wall, self.floor_tz, self.floor_skip)
        limits = with_floor(self.limits, floor)
        profile = self.base_profile
        targets = self.slo  # what the decision sized for: the SLO, or the best reachable p90 plus the margin
        if obs is None:
            outcome, binding, target = "no_data", "none", base
        elif not self._sizable(obs):
            # too few finished requests to replay: no evidence to size on — hold, and let the window grow (a
            # pool is never emptied by a quiet minute; --min-* is the floor an operator sets for idle)
            outcome, binding, target = "idle", "none", base
        else:
            profile = live_profile(self.base_profile, obs)
            if self.args.replay_from == "recent":
                obs.recent = self._recent(obs.window_s)
            goal = await self._corrected(obs, profile, actual)
            if self.forecast is not None:
                # wall-clock time: a season is a time of day (the damper's `now` is monotonic)
                obs.replay_rate_rps = self.forecast.update(wall, obs.rate_rps, obs.window_s)
            pairs = candidates(limits, self.args.router_mode)
            replay = functools.partial(
                evaluate,
                obs,
                profile,
                pairs,
                self.args.router_mode,
                0,
                self.args.replay_requests,
                slo=goal,
            )
            preds = await self.replay(replay)
            best, binding = choose(preds, goal, self.args.reach_margin, self.args.size_by)
            targets = attainable(preds, goal, self.args.reach_margin)
            target = (best.prefill, best.decode) if best is not None else base
            outcome = ""
        # no sized decision, no step: an idle window is not evidence, and at start, before the workers have
        # registered, its base is 0 + 0, which the damper would lift to --min-* (a scale-down of Deployments
        # whose pods are still loading) and record as a change that then holds the next real step down
        sized = outcome not in ("no_data", "idle")
        if not sized and floor is not None:
            # a floor in force lifts the pools without traffic to size on (pre-warming before the hours it
            # covers), from what was last asked for: never from the 0 + 0 of workers not yet registered
            asked = await self._asked(actual, deployments)
            if asked is not None and (asked[0] < limits.min_prefill or asked[1] < limits.min_decode):
                sized, outcome, base, target = True, "", asked, asked
        desired = damp(base, target, limits, self.damper, now, self.args.router_mode) if sized else base
        if not outcome:
            dp, dd = desired[0] - base[0], desired[1] - base[1]
            if dp == dd == 0:
                outcome = outcome or "hold"
            elif dp * dd < 0:
                outcome = "rebalance"
            else:
                outcome = "scale_up" if dp + dd > 0 else "scale_down"
        if sized:
            self.desired = desired
        chosen = next((p for p in preds if (p.prefill, p.decode) == target), None)
        decision = {
            "time": time.time(),
            "scale_mode": self.args.scale_mode,
            "outcome": outcome,
            "desired": {"prefill": desired[0], "decode": desired[1]},
            "target": {"prefill": target[0], "decode": target[1]},
            "actual": {"prefill": actual[0], "decode": actual[1]},
            "binding_slo": binding,
            "slo": {"ttft_ms": self.args.slo_ttft_ms, "itl_ms": self.args.slo_itl_ms},
            "attainable": {
                "ttft_ms": round(targets.ttft_s * 1000, 2),
                "itl_ms": round(targets.itl_s * 1000, 2),
            },
            "predictor": self.args.predictor,
            "size_by": self.args.size_by,
            "replayed": "recent" if obs is not None and obs.recent else "synthetic",
            "correction": self.correction.to_dict() if self.correction is not None else None,
            "floor": {"prefill": floor[0], "decode": floor[1]} if floor is not None else None,
            "limits": {
                "min_prefill": self.limits.min_prefill,
                "max_prefill": self.limits.max_prefill,
                "min_decode": self.limits.min_decode,
                "max_decode": self.limits.max_decode,
                "max_workers": self.limits.max_workers,
                "hold_down_s": self.args.hold_down_s,
                "scale_down_window_s": self.args.scale_down_window_s,
            },
            "predicted": chosen.to_dict() if chosen is not None else None,
            "candidates": [p.to_dict() for p in preds],
            "observed": obs.to_dict() if obs is not None else None,
            "profile": {
                "name": profile.name,
                "prefill_tokens_per_s": profile.prefill_tokens_per_s,
                "decode_base_s": profile.decode_base_s,
            },
        }
        if self.scaler is not None and sized and outcome != "hold":
            await self.scaler.apply(desired)
        self._publish(decision, chosen)
        metrics.PLANNER_DECISION_S.observe(time.perf_counter() - t0)
        return decision

    async def _corrected(self, obs: Observation, profile: Any, actual: tuple[int, int]) -> Slo:
        """The SLO the candidates are judged against: as set, or with --correction divided by how far the
        measured p90s have run from the replay of the window on `actual`, at the measured rate (when
        `Correction.comparable`)."""
        if self.correction is None:
            return self.slo
        if self.correction.comparable(actual) and min(actual) > 0 and (obs.ttft_p90_s or obs.itl_p90_s):
            replay = functools.partial(
                evaluate,
                obs,
                profile,
                [actual],
                self.args.router_mode,
                0,
                self.args.replay_requests,
                slo=self.slo,
            )
            (ran,) = await self.replay(replay)
            self.correction.update(obs, ran)
        return self.correction.target(self.slo)

    async def _deployments(self) -> tuple[int, int] | None:
        """kubernetes mode: the Deployments' replicas now. None in the other modes, or when they cannot be read."""
        from services.planner.kube import KubeScaler

        if not isinstance(self.scaler, KubeScaler):
            return None
        # a failed read is counted like a refused PATCH, so an API server the planner cannot read shows on the
        # scale-errors alert even in intervals with nothing to scale
        prefill = await self.scaler.read("prefill")
        if prefill is None:
            return None
        decode = await self.scaler.read("decode")
        return None if decode is None else (prefill, decode)

    async def _asked(
        self, actual: tuple[int, int], deployments: tuple[int, int] | None
    ) -> tuple[int, int] | None:
        """What the pools were last asked to be: the Deployments' replicas (kubernetes mode), else the last
        decision's desired; before any, the registered workers where there are any (not in kubernetes mode,
        whose pods may still be loading). None: not known."""
        from services.planner.kube import KubeScaler

        if deployments is not None:
            return deployments
        if self.desired is not None:
            return self.desired
        if isinstance(self.scaler, KubeScaler):
            return None
        return actual if sum(actual) > 0 else None

    def _publish(self, decision: dict[str, Any], chosen: Any) -> None:
        self.current = decision
        self.history.append(
            {k: decision[k] for k in ("time", "outcome", "desired", "target", "actual", "binding_slo")}
        )
        for pool in metrics.POOLS:
            metrics.PLANNER_DESIRED.labels(pool).set(decision["desired"][pool])
            metrics.PLANNER_TARGET.labels(pool).set(decision["target"][pool])
            metrics.PLANNER_ACTUAL.labels(pool).set(decision["actual"][pool])
            metrics.PLANNER_FLOOR.labels(pool).set((decision["floor"] or {}).get(pool, 0))
        for slo in ("ttft", "itl", "none"):
            metrics.PLANNER_BINDING_SLO.labels(slo).set(1.0 if decision["binding_slo"] == slo else 0.0)
        if decision.get("correction"):
            for slo in ("ttft", "itl"):
                metrics.PLANNER_CORRECTION.labels(slo).set(decision["correction"][slo])
        if chosen is not None:
            metrics.PLANNER_PREDICTED_P90_S.labels("ttft").set(chosen.ttft_p90_s)
            metrics.PLANNER_PREDICTED_P90_S.labels("itl").set(chosen.itl_p90_s)
        metrics.PLANNER_DECISIONS.labels(decision["outcome"]).inc()
        obs = decision["observed"] or {}
        log.info(
            "plan %s: desired prefill=%d decode=%d (target %d/%d, actual %d/%d); binding %s; predicted %s; "
            "observed %.2f req/s, in %.0f / out %.0f tokens, hit %.2f; candidates %s",
            decision["outcome"], decision["desired"]["prefill"], decision["desired"]["decode"],
            decision["target"]["prefill"], decision["target"]["decode"],
            decision["actual"]["prefill"], decision["actual"]["decode"], decision["binding_slo"],
            json.dumps(decision["predicted"]), obs.get("request_rate_per_s", 0.0),
            obs.get("mean_input_tokens", 0.0), obs.get("mean_output_tokens", 0.0),
            obs.get("prefix_hit_rate", 0.0),
            " ".join(f"P{c['prefill']}D{c['decode']}={c['ttft_p90_ms']:.0f}/{c['itl_p90_ms']:.0f}ms"
                     for c in decision["candidates"]),
        )  # fmt: skip

    def _stand_by(self, obs: Observation | None, wall: float) -> dict[str, Any]:
        """A replica that does not lead keeps measuring (its windows and its seasons stay current) and decides
        nothing: no replay, no step, no scaling."""
        if obs is not None and self.forecast is not None and self._sizable(obs):
            self.forecast.update(wall, obs.rate_rps, obs.window_s)
        metrics.PLANNER_DECISIONS.labels("standby").inc()
        return self.plan()

    def plan(self) -> dict[str, Any]:
        live = self.discovered()
        if not self.leader:
            return {"outcome": "standby", "leader": self.holder, "scale_mode": self.args.scale_mode, **live}
        if self.current is None:
            return {
                "outcome": "starting",
                "scale_mode": self.args.scale_mode,
                "desired": dict(live["actual"]),
                **live,
                "binding_slo": "none",
                "candidates": [],
                "history": [],
            }
        # actual is live; the rest is the last decision's
        return {**self.current, **live, "history": list(self.history)}

    async def connect(self) -> aetcd.Client:
        """A client on the first etcd endpoint that answers."""
        return await connect_first_reachable(parse_etcd_urls(self.args.etcd), ETCD_TIMEOUT_S, self.security)

    @contextlib.asynccontextmanager
    async def _etcd(self) -> AsyncIterator[aetcd.Client]:
        """A client on the first etcd endpoint that answers, closed after use (the seasons' state is read once
        and written every few minutes: no connection is held between)."""
        client = await self.connect()
        try:
            yield client
        finally:
            await close_quietly(client)

    async def restore_season(self) -> int:
        """Load what a planner before this one measured of the seasons (etcd, PLANNER_SEASON_KEY); the buckets
        taken. Nothing there, another season or span, or etcd not answering: start from nothing, and say so."""
        if not isinstance(self.forecast, SeasonalForecast):
            return 0
        try:
            async with self._etcd() as client:
                got = await with_deadline(client.get(PLANNER_SEASON_KEY.encode()), ETCD_TIMEOUT_S)
            if got is None:
                log.info("planner: no seasons saved yet; the seasonal forecast starts from nothing")
                return 0
            taken = self.forecast.load_state(got.value, time.time())
        except Exception as e:  # a forecast is worth having, never worth not planning for
            log.warning(
                "planner: could not restore the seasons from etcd (%s); starting from nothing", describe(e)
            )
            return 0
        log.info(
            "planner: seasonal forecast restored %d buckets of %.0f s from etcd",
            taken,
            self.forecast.bucket_s,
        )
        return taken

    async def save_season(self) -> int:
        """Write what the seasonal forecast measured to etcd; its size in bytes (0: nothing written). Only the
        leader writes; a standby's own copy is for when it takes over."""
        if not self.leader or not isinstance(self.forecast, SeasonalForecast) or not self.forecast.buckets:
            return 0
        data = self.forecast.to_state()
        if len(data) > SEASON_STATE_MAX_BYTES:
            log.warning("planner: the seasons' state is %d bytes, more than etcd takes in one value; not saved "
                        "(lower --seasons or raise --season-span-s)", len(data))  # fmt: skip
            return 0
        try:
            async with self._etcd() as client:
                await with_deadline(client.put(PLANNER_SEASON_KEY.encode(), data), ETCD_TIMEOUT_S)
        except Exception as e:
            log.warning("planner: could not save the seasons to etcd (%s)", describe(e))
            return 0
        return len(data)

    async def replay(self, fn: Callable[[], T]) -> T:
        """`fn()` in the replay process. One that died (the OOM killer, a stray kill) breaks its pool for good:
        every later call would fail at once and the planner would never decide again. A new process then runs
        it, once; if that one dies too, the error is this interval's and the next starts another."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.pool, fn)
        except BrokenProcessPool:
            self._new_pool()
        try:
            return await loop.run_in_executor(self.pool, fn)
        except BrokenProcessPool:
            self._new_pool()
            raise

    def _new_pool(self) -> None:
        log.warning("planner: the replay process died; starting another")
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.pool = _replay_pool()

    def start_replays(self) -> None:
        """Spawn the replay process now: its start (a Python process importing the simulator) then does not
        make the first decision late."""
        self.pool.submit(int)

    async def close(self) -> None:
        await self.client.aclose()
        self.pool.shutdown(wait=False, cancel_futures=True)


def create_app(planner: Planner) -> FastAPI:
    app = FastAPI(title="rackserve planner")

    @app.get("/plan")
    async def get_plan() -> dict[str, Any]:
        return planner.plan()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    return app


async def _loop(planner: Planner, interval_s: float, stop: asyncio.Event) -> None:
    save_every = planner.args.season_save_s
    saved = time.monotonic()
    while not stop.is_set():
        try:
            await planner.tick()
        except Exception:  # one bad interval (a scrape, a simulation) must not stop planning
            log.exception("planner: decision failed")
        if save_every > 0 and time.monotonic() - saved >= save_every:
            await planner.save_season()
            saved = time.monotonic()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(interval_s):
                await stop.wait()


async def _campaign(planner: Planner, election: Election, client: aetcd.Client | None) -> aetcd.Client | None:
    """One round of the election, on `client` (connected first when None); returns the client for the next
    round, None after a failure. etcd not answering means not leading (never two replicas acting)."""
    try:
        if client is None:
            client = await planner.connect()
        holder = await election.campaign(client, ETCD_TIMEOUT_S)
    except Exception as e:
        if planner.leader:
            log.warning("planner: etcd did not answer the leader's campaign (%s); standing by", describe(e))
        planner.lead(None, False)
        await close_quietly(client)
        return None
    planner.lead(holder, election.leads(holder), election.registration.lease_id)
    return client


async def _campaigns(
    planner: Planner, election: Election, period_s: float, stop: asyncio.Event, client: aetcd.Client | None
) -> None:
    """A round every `period_s` until `stop`, on one etcd connection while it works."""
    try:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(period_s):
                    await stop.wait()
            if not stop.is_set():
                client = await _campaign(planner, election, client)
    finally:
        await close_quietly(client)


async def serve(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape would drown the decisions
    security = EtcdSecurity.from_args(args)
    directory = WorkerDirectory(args.etcd, roles=("frontend", "prefill", "decode"), security=security)
    await directory.start()
    scaler = None
    if args.scale_mode == "kubernetes":
        from services.planner.kube import KubeScaler

        scaler = KubeScaler.in_cluster(args)
    planner = Planner(args, directory, scaler)
    planner.leader = False  # not before a round of the election says so (its HTTP answers start first)
    metrics.PLANNER_LEADER.set(0.0)
    planner.start_replays()
    server = _QuietServer(uvicorn.Config(create_app(planner), host=args.host, port=args.port,
                                         log_level="warning", access_log=False,
                                         timeout_graceful_shutdown=DRAIN_HTTP_S))  # fmt: skip
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    serving = loop.create_task(server.serve(), name="uvicorn")
    registration: Registration | None = None
    planning: asyncio.Task[None] | None = None
    campaigning: asyncio.Task[None] | None = None
    try:
        while not server.started:
            if serving.done():
                await serving
                raise RuntimeError("planner: HTTP server stopped while starting")
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        host = advertised_host(args)
        worker_id = args.worker_id or f"{ROLE}-{socket.gethostname()}-{os.getpid()}"
        info = pb.WorkerInfo(
            worker_id=worker_id, role=ROLE, endpoint=f"{host}:{port}", epoch=int(time.time() * 1000)
        )
        registration = await Registration.start(args.etcd, info, ttl_s=args.lease_ttl_s, security=security)
        log.info("planner %s on http://%s:%d (scale mode %s)", worker_id, host, port, args.scale_mode)
        await planner.restore_season()
        election = Election(PLANNER_LEADER_KEY, registration)
        client = await _campaign(planner, election, None)
        if not planner.leader:
            log.info("planner: standing by (%s leads)", planner.holder or "no one yet")
        # a round every third of the lease: a replica takes over within about a TTL of the leader's end
        period_s = max(0.5, args.lease_ttl_s / 3)
        campaigning = loop.create_task(_campaigns(planner, election, period_s, stop, client), name="campaign")
        planning = loop.create_task(_loop(planner, args.interval_s, stop), name="plan")
        await stop.wait()
    finally:
        stop.set()
        if campaigning is not None:
            await campaigning
        if planning is not None:
            await planning
            if args.season_save_s > 0:
                await planner.save_season()
        if registration is not None:
            await registration.close()
        server.should_exit = True
        await serving
        await planner.close()
        if scaler is not None:
            await scaler.close()
        await directory.close()


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handlers: serve() leaves discovery on SIGTERM itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
