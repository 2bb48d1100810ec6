"""The planner against static pool splits, in the simulator, on the Mooncake trace with a changing rate.

    python -m loadgen.planner_experiment --out bench/results/sim        # also `make sim`

The trace's arrival rate is warped piecewise (`--phases`, default 0.5x, 2x, 0.75x of the trace's own rate, a
third of its time span each: two steps), or smoothly (`--sin LOW,HIGH,PERIOD_S`: a multiplier moving from LOW to
HIGH and back every PERIOD_S), so the load the cluster must carry changes over time. On the same requests:
- every static (P, D) split of `--total` workers, mode disagg (`--mode auto`: the router may also prefill on a
  decode worker), the router's TTFT policy;
- the planner (services/planner/plan.py, the code the service runs): every `--interval-s` it takes the
  window's arrivals (rate, input lengths) and finished requests (output lengths, prefix hits), replays them
  through this simulator on every candidate (P, D) with P + D <= --total, picks the fewest workers that meet
  its SLO (or come within `--reach-margin` of the best p90 where no size meets it), and steps the pools by one
  per interval (a step down only to the largest size wanted within `--scale-down-window-s`, and not within
  `--hold-down-s` of the pool's last step; it starts from its own recommendation for the first interval,
  `--start auto`). A new worker serves
  `--start-s` after it is asked for (it costs from the moment it is asked for); a drained one takes no new
  work and stops when what it holds is done.
`--days N` runs the shaped trace N times back to back (each day's prompts under another seed, so no day hits
another's cache): with `--predictor seasonal` the planner forecasts each day from the ones before it, and a
line per day after the first compares that day alone.
Reported: goodput (requests meeting the SLO per second) and worker-seconds; the planner as a ratio to the best
static split (the one with the most goodput).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from loadgen import report as rep
from loadgen.sim.engine import ClusterConfig, Simulator, block_hashes_for
from loadgen.sim.profile import Profile, load_profile
from loadgen.trace import DEFAULT_TRACE, load_records, mooncake
from loadgen.workload import RequestSpec
from services.planner.plan import (
    PREDICTORS,
    REACH,
    SIZE_BY,
    Correction,
    Damper,
    Floor,
    Limits,
    Observation,
    RateForecast,
    SeasonalForecast,
    Slo,
    candidates,
    choose,
    damp,
    evaluate,
    floor_at,
    make_forecast,
    recent_specs,
    with_floor,
)
from services.telemetry.traffic import SHARE_TOKENS, TrafficLog

SLO = rep.Slo(ttft_s=2.0, itl_p90_s=0.05)  # the goodput SLO, per request (as loadgen/experiments.py)


def _respace(specs: Sequence[RequestSpec], multiplier: Callable[[float, float], float]) -> list[RequestSpec]:
    """Arrival times re-spaced so that each gap of the trace is run at `multiplier(offset, t)` x the trace's
    rate, where `offset` is the request's time in the trace and `t` its new arrival time so far."""
    out, t, prev = [], 0.0, specs[0].arrival_s
    for s in specs:
        t += (s.arrival_s - prev) / multiplier(s.arrival_s - specs[0].arrival_s, t)
        prev = s.arrival_s
        out.append(replace(s, arrival_s=t))
    return out


def warp(specs: Sequence[RequestSpec], phases: Sequence[float]) -> list[RequestSpec]:
    """Arrival times re-spaced so that the k-th of len(phases) equal slices of the trace's own time span
    arrives at phases[k] x the trace's rate."""
    span = (specs[-1].arrival_s - specs[0].arrival_s) or 1.0
    return _respace(specs, lambda offset, _t: phases[min(len(phases) - 1, int(offset / span * len(phases)))])


def warp_sin(specs: Sequence[RequestSpec], low: float, high: float, period_s: float) -> list[RequestSpec]:
    """Arrival times re-spaced so that the rate is the trace's own times a multiplier that moves sinusoidally
    between `low` and `high` over `period_s` of wall time, starting at `low` (the shape of Dynamo's planner
    benchmark, `sin_synth.py`: rate(t) = mid - amp * cos(2 pi t / period))."""
    mid, amp = (low + high) / 2, (high - low) / 2
    return _respace(specs, lambda _offset, t: mid - amp * math.cos(2 * math.pi * t / period_s))


def repeat_days(specs: Sequence[RequestSpec], days: int) -> tuple[list[RequestSpec], float]:
    """The run `days` times back to back, and the length of one day: its span plus one mean gap, so the rate's
    pattern repeats with that period. Day k (from 0) arrives k days later under ids ending `@dk` and with
    another trace seed, so none of its prompts shares a cached block with another day's: the same traffic
    from other users, as a working day repeats yesterday's shape, not its prompts."""
    t0 = specs[0].arrival_s
    span = specs[-1].arrival_s - t0
    day_s = span + span / max(1, len(specs) - 1)
    out = list(specs)
    for k in range(1, days):
        for s in specs:
            tags = {**s.tags}
            if "trace_seed" in tags:
                tags["trace_seed"] = str(int(tags["trace_seed"]) + 7919 * k)
            out.append(
                replace(s, request_id=f"{s.request_id}@d{k}", arrival_s=s.arrival_s + k * day_s, tags=tags)
            )
    return out, day_s


def _day(request_id: str) -> int:
    return int(request_id.rpartition("@d")[2]) if "@d" in request_id else 0


def _summary(results: list[rep.RequestResult], worker_s: float) -> dict[str, Any]:
    # one denominator for every run (the trace's span), so goodput compares requests served within the SLO
    span = max(r.start_s for r in results) - min(r.start_s for r in results)
    stats = rep.summarize(results, SLO, rep.Grouping(0, 0), duration_s=span)["overall"]
    return {
        "goodput_requests_per_s": stats["goodput_requests_per_s"],
        "slo_attainment": stats["slo_attainment"],
        "good": sum(1 for r in results if SLO.met_by(r)),
        "good_by_day": [
            sum(1 for r in results if SLO.met_by(r) and _day(r.request_id) == k)
            for k in range(1 + max(_day(r.request_id) for r in results))
        ],
        "errors": stats["errors"],
        "ttft_p90_ms": (stats["ttft_s"]["p90"] or 0) * 1000,
        "itl_p90_ms": (stats["itl_s"]["p90"] or 0) * 1000,
        "worker_s": worker_s,
    }


def _run_split(
    specs: Sequence[RequestSpec],
    hashes: Sequence[list[int]],
    profile: Profile,
    p: int,
    d: int,
    mode: str = "disagg",
) -> tuple[list[rep.RequestResult], float]:
    """The requests on a fixed P + D cluster: their results, and when the last of them was done."""
    sim = Simulator(profile, ClusterConfig(p, d, mode=mode))
    results = sim.run(list(specs), list(hashes))
    return results, max((r.t_done or 0.0) for r in sim.reqs)


def _budget(total: int) -> Limits:
    """Every split of at most `total` workers, each pool at least one."""
    return Limits(1, total - 1, 1, total - 1, max_workers=total)


def static_run(
    specs: list[RequestSpec], hashes: list[list[int]], profile: Profile, p: int, d: int, mode: str = "disagg"
) -> dict:
    results, end = _run_split(specs, hashes, profile, p, d, mode)
    return {"prefill": p, "decode": d, "end": end, **_summary(results, (p + d) * end)}


def slice_goodput(
    specs: Sequence[RequestSpec],
    hashes: Sequence[list[int]],
    profile: Profile,
    total: int,
    slice_s: float,
    mode: str = "disagg",
) -> tuple[list[float], list[dict[tuple[int, int], int]]]:
    """Cut the run into consecutive `slice_s` of arrival time and run each slice's requests on their own (from
    an empty cluster, at their own times) on every split with P, D >= 1 and P + D <= total: each slice's
    length in seconds (the last one runs to its last completion) and its good requests per (P, D)."""
    t0 = specs[0].arrival_s
    slices: list[list[int]] = []
    for i, s in enumerate(specs):
        k = int((s.arrival_s - t0) // slice_s)
        while len(slices) <= k:
            slices.append([])
        slices[k].append(i)
    pairs = candidates(_budget(total))
    lengths: list[float] = []
    goods: list[dict[tuple[int, int], int]] = []
    for k, idx in enumerate(slices):
        start = t0 + k * slice_s
        part = [replace(specs[i], arrival_s=specs[i].arrival_s - start) for i in idx]
        good = {pair: 0 for pair in pairs}
        end = 0.0  # the last slice lasts until its last request is done, the others slice_s
        for p, d in pairs if part else ():
            results, done = _run_split(part, [hashes[i] for i in idx], profile, p, d, mode)
            good[(p, d)] = sum(1 for r in results if SLO.met_by(r))
            end = max(end, done)
        lengths.append(end if k == len(slices) - 1 else slice_s)
        goods.append(good)
    return lengths, goods


def clairvoyant(
    lengths: Sequence[float], goods: Sequence[dict[tuple[int, int], int]], total: int, need: int
) -> tuple[float, list[tuple[int, int]]] | None:
    """The fewest worker-seconds of a resizing that knows every slice's traffic in advance and changes size
    between slices at no cost (no start-up, no drain): one (P, D) per slice whose good requests, summed over the
    slices, are at least `need`. None when no choice reaches it. A bound on what any planner can do with the
    same slices, not a planner."""
    # per slice and total size, the split with the most good requests; then a knapsack over the good count
    best: list[dict[int, tuple[int, tuple[int, int]]]] = []
    for good in goods:
        per: dict[int, tuple[int, tuple[int, int]]] = {}
        for (p, d), g in good.items():
            if p + d not in per or g > per[p + d][0]:
                per[p + d] = (g, (p, d))
        best.append(per)
    # frontier: good requests so far -> (worker-seconds, choices)
    frontier: dict[int, tuple[float, list[tuple[int, int]]]] = {0: (0.0, [])}
    for length, per in zip(lengths, best, strict=True):
        nxt: dict[int, tuple[float, list[tuple[int, int]]]] = {}
        for so_far, (cost, picks) in frontier.items():
            for n, (g, pair) in per.items():
                key = min(need, so_far + g)  # beyond `need` more good requests buy nothing here
                c = cost + n * length
                if key not in nxt or c < nxt[key][0]:
                    nxt[key] = (c, [*picks, pair])
        frontier = nxt
    return frontier.get(need)


def initial_sizes(
    specs: Sequence[RequestSpec],
    hashes: Sequence[list[int]],
    profile: Profile,
    limits: Limits,
    slo: Slo,
    window_s: float,
    replay_requests: int,
    reach: float = REACH,
    size_by: str = "p90",
    mode: str = "disagg",
) -> tuple[int, int]:
    """The planner's own recommendation for the first window's traffic: where an operator deploys it (a Dynamo
    planner operator starts from its profile-based recommendation, not from a guess). Only the first `window_s`
    of the trace is looked at; its prefix hit rate is that of an unbounded cache over the window."""
    first = [i for i, s in enumerate(specs) if s.arrival_s - specs[0].arrival_s <= window_s]
    seen: set[int] = set()
    cached = 0
    for i in first:
        hit = 0
        for h in hashes[i]:
            if h not in seen:
                break
            hit += 1
        cached += min(hit * profile.block_size, specs[i].input_tokens - 1)
        seen.update(hashes[i])
    obs = Observation(
        window_s=window_s,
        requests=len(first),
        prompt_tokens=float(sum(specs[i].input_tokens for i in first)),
        generation_tokens=float(sum(specs[i].output_tokens for i in first)),
        cached_tokens=float(cached),
        input_samples=[specs[i].input_tokens for i in first],
        output_samples=[specs[i].output_tokens for i in first],
    )
    pairs = candidates(limits)
    preds = evaluate(
        obs, profile, pairs, mode, 0, replay_requests, until_met=slo, reach=reach, size_by=size_by
    )
    best, _ = choose(preds, slo, reach, size_by)
    if best is None:
        return max(1, limits.max_workers // 2), max(1, limits.max_workers - limits.max_workers // 2)
    return best.prefill, best.decode


def planner_run(
    specs: list[RequestSpec],
    hashes: list[list[int]],
    profile: Profile,
    total: int,
    slo: Slo,
    interval_s: float,
    hold_down_s: float,
    start_s: float,
    replay_requests: int,
    start: tuple[int, int] | None = None,
    min_window_requests: int = 10,
    forecast: RateForecast | SeasonalForecast | None = None,
    reach: float = REACH,
    size_by: str = "p90",
    scale_down_window_s: float = 0.0,
    foresight_s: float = 0.0,
    seed: int = 0,
    schedule: Sequence[tuple[float, tuple[int, int]]] | None = None,
    floors: Sequence[Floor] = (),
    day_s: float = 0.0,
    drain_order: str = "newest",
    replay_window_s: float = 20.0,
    correct: bool = False,
    replay_from: str = "synthetic",
    mode: str = "disagg",
) -> dict[str, Any]:
    """With `foresight_s` > 0 the planner is told the future: each decision replays the requests that really
    arrive from `foresight_s` ahead on (their lengths, at their rate; the backlog and prefix hit rate are the
    measured ones), a perfect forecast, to measure what forecasting could buy. `seed` seeds every replay's
    synthetic trace: another seed is another draw of the same measured traffic. With `schedule` ((from time,
    (P, D)) in time order, the first from 0) nothing is decided: the pools follow the schedule, known in
    advance, through the same start-up, drain and billing (`_scheduled`). `floors` are the service's `--floor`
    windows in seconds of each day of `day_s` (the run's own time, not UTC). With `correct`, the planner's
    `--correction`: each window's measured p90s against the replay of it on the pools that ran (`Correction`)."""
    limits = _budget(total)
    pairs = candidates(limits)
    if schedule is not None:
        start = schedule[0][1]
    if start is None:
        start = initial_sizes(
            specs, hashes, profile, limits, slo, interval_s, replay_requests, reach, size_by, mode
        )
    sim = Simulator(profile, ClusterConfig(start[0], start[1], mode=mode))
    damper = Damper(hold_down_s, scale_down_window_s)
    stopped: dict[str, float] = {}
    billed = {
        "workers": float(sum(start)),
        "since": 0.0,
        "seconds": 0.0,
    }  # worker-seconds, integrated per tick
    starting: dict[str, int] = {"prefill": 0, "decode": 0}
    desired = start
    window_start = 0.0
    correction = Correction() if correct else None
    traffic = TrafficLog() if replay_from == "recent" else None
    step = SHARE_TOKENS // profile.block_size  # engine blocks per prefix the log hashes
    admitted = {"until": -1.0}
    last_arrival = specs[-1].arrival_s
    timeline: list[dict[str, Any]] = []
    billing: list[tuple[float, float]] = []  # (time, worker-seconds so far), per tick

    def pool(role: str) -> list[str]:
        return [w.worker_id for w in sim.workers.values() if w.role == role and not w.draining and not w.dead]

    cancelled: dict[str, int] = {"prefill": 0, "decode": 0}  # asked for, then not wanted before they served

    def victim(wid: str) -> tuple[float, ...]:
        w, newest = sim.workers[wid], -int(wid.split("-")[1])
        if drain_order == "least_work":
            work = w.queued_tokens + sum(r.remaining_prefill for r in w.running) if w.role == "prefill" else 0
            return (work, len(w.running) + len(w.admit_queue), newest)
        if drain_order == "least_cache":
            return (len(w.cache) + len(w.held), newest)
        return (newest,)

    def join(role: str) -> None:
        if cancelled[role]:
            cancelled[role] -= 1
            return
        starting[role] -= 1
        sim.add_worker(role)

    def bill(now: float) -> None:
        """Workers cost from the moment they are asked for until a drained one is seen idle."""
        billed["seconds"] += billed["workers"] * (now - billed["since"])
        running = sum(1 for wid in sim.workers if wid not in stopped)
        billed["workers"], billed["since"] = float(running + sum(starting.values())), now

    def tick() -> None:
        nonlocal desired, window_start
        now = sim.now
        for wid, w in sim.workers.items():
            if w.draining and wid not in stopped and sim.idle(w):
                stopped[wid] = now
        bill(now)
        arrived = [r for r in sim.reqs if window_start < r.arrival_s <= now]
        if traffic is not None:  # what the frontend's traffic log admits, as the requests arrive
            for r in sorted(
                (r for r in sim.reqs if admitted["until"] < r.arrival_s <= now), key=lambda r: r.arrival_s
            ):
                traffic.admit_chain(r.spec.input_tokens, r.hashes[step - 1 :: step], now=r.arrival_s)
            admitted["until"] = now
        done = [
            r for r in sim.reqs if r.t_done is not None and window_start < r.t_done <= now and not r.failed
        ]
        floored = with_floor(limits, floor_at(floors, now % day_s if day_s else now))
        if schedule is not None:
            desired = _scheduled(schedule, now, start_s + interval_s)
        elif len(arrived) >= min_window_requests and done:
            obs = Observation(
                window_s=now - window_start,
                requests=len(arrived),
                finished=len(done),
                prompt_tokens=float(sum(r.spec.input_tokens for r in arrived)),
                generation_tokens=float(sum(r.emitted for r in done)),
                cached_tokens=float(sum(r.first_cached or 0 for r in done)),
                input_samples=[r.spec.input_tokens for r in arrived],
                backlog=sum(1 for r in sim.reqs if r.arrival_s <= now and r.t_prefill_start is None),
                output_samples=[r.emitted for r in done],
            )
            if traffic is not None:
                span = max(replay_window_s, now - window_start)
                obs.recent = recent_specs([("sim", r) for r in traffic.since(0, now) if r.t > now - span])
            target_slo = slo
            if correction is not None:
                live = (len(pool("prefill")), len(pool("decode")))
                ttfts = [r.token_times[0] - r.arrival_s for r in done if r.token_times]
                gaps = [b - a for r in done for a, b in itertools.pairwise(r.token_times)]
                obs.ttft_p90_s = rep.percentile(ttfts, 90) if ttfts else None
                obs.itl_p90_s = rep.percentile(gaps, 90) if gaps else None
                if correction.comparable(live):
                    (ran,) = evaluate(obs, profile, [live], mode, seed, replay_requests, slo=slo,
                                      replay_window_s=replay_window_s)  # fmt: skip
                    correction.update(obs, ran)
                target_slo = correction.target(slo)
            if foresight_s > 0:
                obs = _foreseen(obs, specs, now + foresight_s, min_window_requests)
            if forecast is not None:
                obs.replay_rate_rps = forecast.update(now, obs.rate_rps, obs.window_s)
            preds = evaluate(
                obs,
                profile,
                candidates(floored) if floors else pairs,
                mode,
                seed,
                replay_requests,
                until_met=target_slo,
                reach=reach,
                size_by=size_by,
                replay_window_s=replay_window_s,
            )
            best, binding = choose(preds, target_slo, reach, size_by)
            if best is not None:
                desired = damp(desired, (best.prefill, best.decode), floored, damper, now)
            window_start = now
            timeline.append({"t": now, "desired": list(desired), "binding": binding, "rate": obs.rate_rps,
                             "replayed_rate": obs.replay_rps,
                             "correction": correction.to_dict() if correction is not None else None})  # fmt: skip
        elif desired[0] < floored.min_prefill or desired[1] < floored.min_decode:
            desired = damp(
                desired, desired, floored, damper, now
            )  # a floor lifts pools with nothing to size on
        for role, want in zip(("prefill", "decode"), desired, strict=True):
            have = len(pool(role)) + starting[role]
            for _ in range(want - have):
                starting[role] += 1
                sim.at(now + start_s, functools.partial(join, role))
            # scaling down takes a worker that is still starting first (as a ReplicaSet deletes a not-ready pod
            # first), then drains serving ones: draining the serving worker while its replacement is still
            # starting would leave the pool with nobody to serve
            over = max(0, have - want)
            unstart = min(over, starting[role])
            starting[role] -= unstart
            cancelled[role] += unstart
            for wid in sorted(pool(role), key=victim)[: over - unstart]:
                sim.drain_worker(wid)
        bill(now)
        billing.append((now, billed["seconds"]))
        if now <= last_arrival or any(r.t_done is None for r in sim.reqs):
            sim.at(now + interval_s, tick)

    sim.at(interval_s, tick)
    results = sim.run(specs, hashes)
    bill(max((r.t_done or 0.0) for r in sim.reqs))
    worker_s = billed["seconds"]
    return {
        "prefill": "planner",
        "decode": "planner",
        **_summary(results, worker_s),
        "start": list(start),
        "timeline": timeline,
        "billing": billing,
    }


def _scheduled(
    schedule: Sequence[tuple[float, tuple[int, int]]], now: float, lead_s: float
) -> tuple[int, int]:
    """The pools a schedule asks for at `now`: each as large as its split now or `lead_s` ahead, so a pool
    grows early enough that its new workers serve when its split begins and shrinks when its split ends."""

    def split_at(t: float) -> tuple[int, int]:
        return [schedule[0][1], *(pair for since, pair in schedule[1:] if since <= t)][-1]

    now_pair, ahead = split_at(now), split_at(now + lead_s)
    return max(now_pair[0], ahead[0]), max(now_pair[1], ahead[1])


def phase_starts(raw: Sequence[RequestSpec], warped: Sequence[RequestSpec], phases: int) -> list[float]:
    """When each of `warp`'s phases begins in the warped run: the arrival of its first request (0 for the
    first)."""
    span = (raw[-1].arrival_s - raw[0].arrival_s) or 1.0
    starts = [0.0]
    for r, w in zip(raw, warped, strict=True):
        k = min(phases - 1, int((r.arrival_s - raw[0].arrival_s) / span * phases))
        while len(starts) <= k:
            starts.append(w.arrival_s)
    return starts


def schedule_bound(
    specs: list[RequestSpec],
    hashes: list[list[int]],
    profile: Profile,
    total: int,
    starts: Sequence[float],
    phases: Sequence[float],
    best: dict[str, Any],
    interval_s: float,
    start_s: float,
    mode: str = "disagg",
) -> dict[str, Any]:
    """The fewest worker-seconds of a schedule that knows the phases in advance (one split per phase, what an
    operator's cron schedule declares), at the best static split's good requests: the busiest phase keeps the
    best static split, every other phase tries each split of at most `total` workers with at most one decode
    worker more than the best static's, and each schedule runs through `planner_run(schedule=...)` (the same
    start-up, drain and billing as the planner's). Unlike `clairvoyant`, nothing is cut: the backlog and the
    prefix caches carry from one phase into the next."""
    peak = max(range(len(phases)), key=lambda k: phases[k])
    fixed = (best["prefill"], best["decode"])
    pairs = [pair for pair in candidates(_budget(total)) if pair[1] <= fixed[1] + 1]
    options = [[fixed] if k == peak else pairs for k in range(len(phases))]
    runs = []
    for splits in itertools.product(*options):
        sched = list(zip(starts, splits, strict=True))
        r = planner_run(specs, hashes, profile, total, Slo(1.0, 1.0), interval_s, 0.0, start_s, 0,
                        schedule=sched, mode=mode)  # fmt: skip
        runs.append({"splits": [list(x) for x in splits], "good": r["good"], "worker_s": r["worker_s"]})
    kept = [r for r in runs if r["good"] >= best["good"]]
    fewest = min(kept, key=lambda r: r["worker_s"])
    close = min((r for r in runs if r["good"] >= best["good"] - 5), key=lambda r: r["worker_s"])

    def text(r: dict[str, Any]) -> str:
        plan = " -> ".join(f"{p}P + {d}D" for p, d in r["splits"])
        return f"{plan}, {r['good']} good, worker-seconds x{r['worker_s'] / best['worker_s']:.3f}"

    return {
        "runs": runs,
        "fewest": fewest,
        "text": f"schedule bound ({len(runs)} schedules of one split per phase, known in advance, each new worker "
        f"asked for {start_s:g} s + one interval ahead): at the best static split's {best['good']} good requests "
        f"{text(fewest)}; within 5 requests of it {text(close)}",
    }


def clairvoyant_bound(
    specs: Sequence[RequestSpec],
    hashes: Sequence[list[int]],
    profile: Profile,
    total: int,
    slice_s: float,
    best: dict[str, Any],
    planner_goodput: float,
    mode: str = "disagg",
) -> dict[str, Any]:
    """The clairvoyant's worker-seconds, as a ratio to the best static split's over the same slices, at that
    split's goodput and at the planner's goodput ratio: how much of what foresight could save the planner saved."""
    lengths, goods = slice_goodput(specs, hashes, profile, total, slice_s, mode)
    pair = (best["prefill"], best["decode"])
    need = sum(g[pair] for g in goods)
    full = total * sum(lengths)
    out: dict[str, Any] = {"slice_s": slice_s, "slices": len(lengths), "static_good": need}
    for key, ratio in (("same", 1.0), ("planner", planner_goodput)):
        found = clairvoyant(lengths, goods, total, math.ceil(need * min(1.0, ratio)))
        out[key] = None if found is None else {"worker_s_ratio": found[0] / full, "sizes": found[1]}
    same, at = out["same"], out["planner"]
    out["text"] = (
        f"clairvoyant bound ({len(lengths)} slices of {slice_s:g} s, each run alone, resized between slices at no "
        f"cost): the best static split's goodput ({need} good requests over the slices) at worker-seconds "
        f"x{same['worker_s_ratio']:.3f}; at the planner's goodput ratio (x{planner_goodput:.3f}) at "
        f"x{at['worker_s_ratio']:.3f}"
        if same is not None and at is not None
        else "clairvoyant bound: no resizing reaches the best static split's goodput over the slices"
    )
    return out


def _foreseen(
    measured: Observation, specs: Sequence[RequestSpec], at: float, min_requests: int
) -> Observation:
    """`measured`, its traffic replaced by the requests that arrive in the same length of window from `at` on
    (longer until it holds `min_requests`, or the trace ends); measured backlog and prefix hit rate kept."""
    t0 = specs[0].arrival_s
    after = [s for s in specs if s.arrival_s - t0 > at]
    window = measured.window_s
    ahead = [s for s in after if s.arrival_s - t0 <= at + window]
    if len(ahead) < min_requests:
        ahead = after[:min_requests]
        if ahead:
            window = max(window, ahead[-1].arrival_s - t0 - at)
    if not ahead:
        return measured
    prompt = float(sum(s.input_tokens for s in ahead))
    return Observation(
        window_s=window,
        requests=len(ahead),
        finished=len(ahead),
        prompt_tokens=prompt,
        generation_tokens=float(sum(s.output_tokens for s in ahead)),
        cached_tokens=measured.hit_rate * prompt,
        input_samples=[s.input_tokens for s in ahead],
        output_samples=[s.output_tokens for s in ahead],
        backlog=measured.backlog,
    )


def _billed_at(billing: Sequence[tuple[float, float]], t: float) -> float:
    """The planner's worker-seconds up to `t`, linear between its ticks."""
    prev = (0.0, 0.0)
    for at, seconds in billing:
        if at >= t:
            span = at - prev[0]
            return prev[1] + (seconds - prev[1]) * ((t - prev[0]) / span if span > 0 else 1.0)
        prev = (at, seconds)
    return prev[1]


def _day_text(k: int, days: int, day_s: float, best: dict[str, Any], plan: dict[str, Any], total: int) -> str:
    """Day k's line (of `days`): its requests' good ones and the worker-seconds from its start (to the next
    day's, or to each run's end for the last), planner over the best static split."""
    start = k * day_s
    end = (k + 1) * day_s if k < days - 1 else None
    static_end = end if end is not None else best["end"]
    static_ws = total * (static_end - start)
    planner_ws = _billed_at(plan["billing"], end if end is not None else math.inf) - _billed_at(
        plan["billing"], start
    )
    g, want = plan["good_by_day"][k], best["good_by_day"][k]
    return (
        f"day {k + 1} (the days before measured): planner / best static: goodput x{g / want:.3f} ({g} of {want} "
        f"good requests), worker-seconds x{planner_ws / static_ws:.3f}"
    )


def _sizes(text: str, total: int) -> tuple[int, int]:
    try:
        p, d = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--start wants auto or P,D (two integers), got {text!r}") from None
    if p < 1 or d < 1 or p + d > total:
        raise SystemExit(f"--start {text}: need P >= 1, D >= 1 and P + D <= --total {total}")
    return p, d


def _floors_s(text: str) -> list[Floor]:
    """`--floor-s`: the service's `--floor` windows, in seconds of the run's day instead of UTC clock times."""
    floors = []
    for part in (x.strip() for x in text.split(";") if x.strip()):
        try:
            span, sizes = part.split("=")
            start, end = (int(float(x)) for x in span.split("-"))
            p, d = (int(x) for x in sizes.split(","))
        except ValueError:
            raise SystemExit(f"--floor-s wants START-END=P,D in seconds, got {part!r}") from None
        floors.append(Floor(start, end, p, d))
    return floors


def _sin(text: str) -> tuple[float, float, float]:
    try:
        low, high, period = (float(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--sin wants LOW,HIGH,PERIOD_S (three numbers), got {text!r}") from None
    if not 0 < low <= high or period <= 0:
        raise SystemExit(f"--sin {text}: need 0 < LOW <= HIGH and PERIOD_S > 0")
    return low, high, period


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--limit", type=int, default=2400, help="trace records replayed")
    ap.add_argument("--profile", default="h200_node")
    ap.add_argument(
        "--total", type=int, default=8, help="workers of every static split, the planner's budget"
    )
    ap.add_argument(
        "--phases",
        default="0.5,2,0.75",
        help="rate multipliers, one per equal slice of the trace's time span",
    )
    ap.add_argument(
        "--sin",
        default="",
        metavar="LOW,HIGH,PERIOD_S",
        help="instead of --phases: a rate multiplier moving sinusoidally from LOW to HIGH and back every PERIOD_S",
    )
    ap.add_argument("--interval-s", type=float, default=3.0, help="seconds between the planner's decisions")
    ap.add_argument(
        "--hold-down-s", type=float, default=20.0, help="no step in a pool within this of its last"
    )
    ap.add_argument(
        "--scale-down-window-s",
        type=float,
        default=30.0,
        help="a pool steps down only to the largest size the decisions of this last while wanted",
    )
    ap.add_argument(
        "--reach-margin",
        type=float,
        default=0.0,
        help="where no size meets an SLO, a size within this fraction of the best p90 counts as meeting it "
        "(with --size-by attainment: this fraction of the replayed requests may miss more than the best)",
    )
    ap.add_argument(
        "--size-by",
        default="p90",
        choices=SIZE_BY,
        help="what the planner judges a candidate by: its p90s, or the replayed requests that miss the SLO",
    )
    ap.add_argument(
        "--predictor",
        default="none",
        choices=PREDICTORS,
        help="none, trend (Holt) or seasonal (the days before)",
    )
    ap.add_argument(
        "--predict-horizon-s",
        type=float,
        default=0.0,
        help="with --predictor trend or seasonal (0: --start-s + --interval-s)",
    )
    ap.add_argument(
        "--days",
        type=int,
        default=1,
        help="the shaped run this many times back to back (other users each day)",
    )
    ap.add_argument(
        "--season-s",
        type=float,
        default=0.0,
        help="with --predictor seasonal: its season (0: one day's length)",
    )
    ap.add_argument(
        "--season-span-s",
        type=float,
        default=30.0,
        help="with --predictor seasonal: the span rates are averaged over",
    )
    ap.add_argument(
        "--start",
        default="auto",
        help="the planner's starting pools, P,D; auto: its own recommendation for the first interval's traffic",
    )
    ap.add_argument("--start-s", type=float, default=20.0, help="a new worker's time to serve")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="the planner's p90 TTFT target")
    ap.add_argument("--slo-itl-ms", type=float, default=40.0, help="the planner's p90 ITL target")
    ap.add_argument("--replay-requests", type=int, default=100)
    ap.add_argument(
        "--replay-seed",
        type=int,
        default=0,
        help="seed of the planner's replays (another draw of the same load)",
    )
    ap.add_argument(
        "--foresight-s",
        type=float,
        default=0.0,
        help="tell the planner the future: replay the requests that really arrive this far ahead (0: not)",
    )
    ap.add_argument(
        "--clairvoyant-slice-s",
        type=float,
        default=60.0,
        help="also report the clairvoyant bound over slices of this length (0: not)",
    )
    ap.add_argument(
        "--floor-s",
        default="",
        metavar="START-END=P,D[;...]",
        help="the planner's --floor, in seconds of each day of the run (e.g. 390-530=7,1)",
    )
    ap.add_argument(
        "--replay-window-s",
        type=float,
        default=20.0,
        help="each replay covers at least this many seconds of the measured traffic",
    )
    ap.add_argument(
        "--replay-from",
        choices=("synthetic", "recent"),
        default="synthetic",
        help="the planner's --replay-from: requests drawn from the measured histograms with one shared prefix, "
        "or the last --replay-window-s of requests themselves as a frontend's traffic log records them",
    )
    ap.add_argument(
        "--drain-order",
        choices=("newest", "least_work", "least_cache"),
        default="newest",
        help="which worker of a pool a step down drains first",
    )
    ap.add_argument(
        "--mode",
        choices=("disagg", "auto"),
        default="disagg",
        help="the router's mode for every run: disagg (every prompt on the prefill pool) or auto (the TTFT "
        "policy may prefill on a decode worker)",
    )
    ap.add_argument(
        "--correction",
        action="store_true",
        help="the planner's --correction: judge sizes against the SLO divided by how far each window's measured "
        "p90s were from the replay of it on the pools that ran",
    )
    ap.add_argument(
        "--schedule-bound",
        action="store_true",
        help="also report the best schedule of one split per phase known in advance (with --phases, one day)",
    )
    ap.add_argument("--out", default="bench/results/sim")
    a = ap.parse_args(argv)
    profile = load_profile(a.profile)
    phases = [float(x) for x in a.phases.split(",")]
    start = None if a.start == "auto" else _sizes(a.start, a.total)
    raw = mooncake(load_records(a.trace, a.limit), scale=1, materialize=False)
    if a.sin:
        low, high, period = _sin(a.sin)
        specs = warp_sin(raw, low, high, period)
        shape = f"x{low:g}..{high:g} sinusoidally every {period:g} s"
    else:
        specs = warp(raw, phases)
        shape = f"x{a.phases}, one per equal slice of its time"
    if a.days < 1:
        raise SystemExit(f"--days must be >= 1, got {a.days}")
    if a.schedule_bound and (a.sin or a.days > 1):
        raise SystemExit("--schedule-bound needs --phases and one day")
    specs, day_s = repeat_days(specs, a.days)
    if a.days > 1:
        shape += f", {a.days} days of {day_s:.0f} s back to back"
    hashes = block_hashes_for(specs, profile.block_size)
    t0 = time.time()
    statics = []
    for p in range(1, a.total):
        statics.append(static_run(specs, hashes, profile, p, a.total - p, a.mode))
        print(json.dumps(statics[-1]), flush=True)
    best = max(statics, key=lambda r: (r["good"], -r["worker_s"]))
    slo = Slo(a.slo_ttft_ms / 1000, a.slo_itl_ms / 1000)
    horizon = a.predict_horizon_s or a.start_s + a.interval_s
    forecast = make_forecast(a.predictor, horizon, a.season_s or day_s, a.season_span_s, max(1, a.days - 1))
    plan = planner_run(specs, hashes, profile, a.total, slo, a.interval_s, a.hold_down_s, a.start_s,
                       a.replay_requests, start, forecast=forecast, reach=a.reach_margin, size_by=a.size_by,
                       scale_down_window_s=a.scale_down_window_s, foresight_s=a.foresight_s,
                       seed=a.replay_seed, floors=_floors_s(a.floor_s), day_s=day_s,
                       drain_order=a.drain_order, replay_window_s=a.replay_window_s,
                       correct=a.correction, replay_from=a.replay_from, mode=a.mode)  # fmt: skip
    print(json.dumps({k: v for k, v in plan.items() if k != "timeline"}), flush=True)
    lines = [
        f"**Planner vs static splits of {a.total} workers** — Mooncake trace, first {len(specs)} records, rate "
        f"{shape}, {profile.name} ({profile.source.split(':')[0]}), "
        f"mode {a.mode}, TTFT policy; "
        f"goodput SLO TTFT <= {SLO.ttft_s:g} s and ITL p90 <= {SLO.itl_p90_s * 1000:g} ms per request; planner "
        f"target p90 TTFT {a.slo_ttft_ms:g} ms / ITL {a.slo_itl_ms:g} ms, sized by {a.size_by}, "
        f"reach margin {a.reach_margin:g}, "
        f"interval {a.interval_s:g} s, hold-down {a.hold_down_s:g} s, scale-down window "
        f"{a.scale_down_window_s:g} s, predictor {a.predictor}"
        + (
            f" (season {a.season_s or day_s:.0f} s, span {a.season_span_s:g} s, {horizon:g} s ahead)"
            if a.predictor == "seasonal"
            else ""
        )
        + (f" (foresight {a.foresight_s:g} s: the requests that really arrive then)" if a.foresight_s else "")
        + (f", floor {a.floor_s} (seconds of the day)" if a.floor_s else "")
        + f", worker start {a.start_s:g} s, starting at "
        f"{plan['start'][0]}P + "
        f"{plan['start'][1]}D ({a.start})\n",
        "| cluster | goodput req/s | SLO met | TTFT p90 ms | ITL p90 ms | errors | worker-seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in [*statics, plan]:
        label = "planner" if r["prefill"] == "planner" else f"static {r['prefill']}P + {r['decode']}D"
        label += " (best static)" if r is best else ""
        lines.append(
            f"| {label} | {r['goodput_requests_per_s']:.3f} | {r['slo_attainment']:.1%} | {r['ttft_p90_ms']:.0f} | "
            f"{r['itl_p90_ms']:.1f} | {r['errors']} | {r['worker_s']:.0f} |"
        )
    g = plan["good"] / best["good"] if best["good"] else float("nan")
    ws = plan["worker_s"] / best["worker_s"]
    lines.append(
        f"\nplanner / best static: goodput x{g:.3f}, worker-seconds x{ws:.3f} ({1 - ws:.1%} fewer); "
        f"{len(plan['timeline'])} decisions; simulated in {time.time() - t0:.0f} s"
    )
    for k in range(1, a.days):
        lines.append(_day_text(k, a.days, day_s, best, plan, a.total))
    bound = None
    if a.clairvoyant_slice_s > 0:
        bound = clairvoyant_bound(specs, hashes, profile, a.total, a.clairvoyant_slice_s, best, g, a.mode)
        lines.append(bound["text"])
    scheduled = None
    if a.schedule_bound:
        starts = phase_starts(raw, specs, len(phases))
        scheduled = schedule_bound(
            specs, hashes, profile, a.total, starts, phases, best, a.interval_s, a.start_s, a.mode
        )
        lines.append(scheduled["text"])
    text = "\n".join(lines)
    print(text)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "planner.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(a.out, "planner.json"), "w") as f:
        json.dump(
            {
                "statics": statics,
                "planner": plan,
                "clairvoyant": bound,
                "schedule": scheduled,
                "args": vars(a),
            },
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
