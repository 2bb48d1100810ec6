"""The planner's sizing and damping against surges: a queued backlog is load to drain within the SLO, a pool
grows within one interval and shrinks only to the largest size its scale-down window wanted (the HPA's
stabilization windows), the pruned replay decides as the full one does, and the simulated benchmark's planner
starts from its own recommendation and keeps to the damping and the budget."""

from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing
from typing import Any

import pytest

from loadgen import planner_experiment as pe
from loadgen.sim.engine import block_hashes_for
from loadgen.sim.profile import Profile, load_profile
from loadgen.trace import load_records, mooncake
from services.planner.plan import (
    Damper,
    Floor,
    Limits,
    Observation,
    Slo,
    candidates,
    choose,
    damp,
    evaluate,
    make_forecast,
)

CPU = load_profile("cpu_smollm2")
# 300-token prompts, one output token, 1 request/s: one prefill worker (1,600 tokens/s) keeps up with it
STEADY = Observation(
    window_s=20, requests=20, input_tokens=[(256, 0.0), (512, 20.0)], output_tokens=[(1, 20.0)],
    prompt_tokens=20 * 300, generation_tokens=20, input_samples=[300] * 20, output_samples=[1] * 20,
)  # fmt: skip
LIMITS, SLO = Limits(1, 4, 1, 2, max_workers=6), Slo(ttft_s=1.0, itl_s=0.1)


def test_a_backlog_is_load_to_drain_so_prefill_grows_within_one_interval() -> None:
    calm, _ = choose(evaluate(STEADY, CPU, candidates(LIMITS)), SLO)
    assert calm is not None and (calm.prefill, calm.decode) == (1, 1)
    # the same arrival rate with 40 requests queued now: one prefill worker would take 7 s to drain them
    queued = Observation(**{**STEADY.__dict__, "backlog": 40})
    surge, binding = choose(evaluate(queued, CPU, candidates(LIMITS)), SLO)
    assert surge is not None and surge.prefill > 1 and binding == "ttft"
    damper = Damper(hold_down_s=60.0)
    assert damp((2, 1), (1, 1), LIMITS, damper, now=0.0) == (1, 1)  # calm: a step down
    # the next interval the backlog is there: a step up at once, though the pool changed 5 s ago
    assert damp((1, 1), (surge.prefill, surge.decode), LIMITS, damper, now=5.0) == (2, 1)


def test_the_pruned_replay_chooses_what_the_full_replay_chooses() -> None:
    limits = Limits(1, 4, 1, 4, max_workers=6)
    pairs = candidates(limits)
    for obs in (STEADY, Observation(**{**STEADY.__dict__, "backlog": 40})):
        full = evaluate(obs, CPU, pairs, slo=SLO)
        for size_by in ("p90", "attainment"):
            pruned = evaluate(obs, CPU, pairs, until_met=SLO, size_by=size_by)
            assert choose(pruned, SLO, size_by=size_by) == choose(full, SLO, size_by=size_by)
            assert {(p.prefill, p.decode) for p in pruned} <= set(pairs)
    # the steady load is met at 2 workers: besides the largest total (what the limits reach at best, replayed
    # first), nothing larger is simulated
    assert {p.workers for p in evaluate(STEADY, CPU, pairs, until_met=SLO)} == {2, 6}


def test_benchmark_planner_starts_from_its_recommendation_and_keeps_to_damping_and_budget() -> None:
    profile = load_profile("h200_node")
    specs = pe.warp(mooncake(load_records(limit=150), scale=1, materialize=False), [0.5, 2, 0.75])
    hashes = block_hashes_for(specs, profile.block_size)
    total, slo = 6, Slo(ttft_s=1.0, itl_s=0.04)
    limits = Limits(1, total - 1, 1, total - 1, max_workers=total)
    start = pe.initial_sizes(specs, hashes, profile, limits, slo, 10.0, 50)
    assert start in candidates(limits)
    run = pe.planner_run(specs, hashes, profile, total, slo, 10.0, 30.0, 5.0, 50)
    assert run["start"] == list(pe.initial_sizes(specs, hashes, profile, limits, slo, 10.0, 50))
    assert run["errors"] == 0 and run["good"] > 0
    sizes = [tuple(run["start"])] + [tuple(e["desired"]) for e in run["timeline"]]
    for (p0, d0), (p1, d1) in zip(sizes, sizes[1:], strict=False):
        assert abs(p1 - p0) <= 1 and abs(d1 - d0) <= 1 and p1 + d1 <= total and p1 >= 1 and d1 >= 1


def test_a_pool_shrinks_only_to_the_largest_size_its_window_wanted() -> None:
    limits, damper = Limits(1, 6, 1, 2), Damper(hold_down_s=0.0, window_s=30.0)
    assert damp((4, 1), (4, 1), limits, damper, now=0.0) == (4, 1)
    assert damp((4, 1), (2, 1), limits, damper, now=10.0) == (4, 1)  # 4 was wanted 10 s ago: no drain
    assert damp((4, 1), (2, 1), limits, damper, now=31.0) == (
        3,
        1,
    )  # now the window wants 2 at most: one step
    assert damp((3, 1), (5, 1), limits, damper, now=32.0) == (4, 1)  # a step up is never held
    assert damp((4, 1), (3, 1), limits, damper, now=40.0) == (4, 1)  # 5 was wanted at 32 s
    assert damp((4, 1), (3, 1), limits, damper, now=63.0) == (3, 1)
    # without a window, the same noise drains at once (the hold-down aside)
    assert damp((4, 1), (2, 1), limits, Damper(hold_down_s=0.0), now=10.0) == (3, 1)


def test_the_smooth_load_shape_runs_the_trace_at_its_multiplier() -> None:
    specs = mooncake(load_records(limit=400), scale=1, materialize=False)
    span = specs[-1].arrival_s - specs[0].arrival_s
    # a constant multiplier of 2 halves every gap
    doubled = pe.warp_sin(specs, 2.0, 2.0, 100.0)
    assert doubled[-1].arrival_s == pytest.approx(span / 2)
    # from 0.5x at the start to 2x half a period later: the first gaps are twice as long as the trace's, and the
    # trace's first quarter, below 1x all along, arrives later than in the trace itself
    smooth = pe.warp_sin(specs, 0.5, 2.0, 4 * span)
    assert smooth[1].arrival_s == pytest.approx(2 * (specs[1].arrival_s - specs[0].arrival_s), rel=0.01)
    quarter = next(i for i, s in enumerate(specs) if s.arrival_s - specs[0].arrival_s >= span / 4)
    assert smooth[quarter].arrival_s > 1.2 * (specs[quarter].arrival_s - specs[0].arrival_s)
    assert [s.request_id for s in smooth] == [s.request_id for s in specs]  # the same requests, in order


def test_the_clairvoyant_bound_trades_good_requests_across_slices_at_the_fewest_worker_seconds() -> None:
    lengths = [100.0, 50.0]
    goods = [
        {(1, 1): 80, (2, 1): 100, (1, 2): 99, (2, 2): 100},  # quiet: 3 workers serve all of it
        {(1, 1): 5, (2, 1): 59, (1, 2): 20, (2, 2): 60},  # busy: it takes all 4
    ]
    # the best static split (2, 2) makes 160: the same at 3 then 4 workers, 100 worker-seconds fewer than 4 + 4
    assert pe.clairvoyant(lengths, goods, 4, 160) == (3 * 100 + 4 * 50, [(2, 1), (2, 2)])
    # one good request fewer: the busy slice's last one is worth 50 worker-seconds
    assert pe.clairvoyant(lengths, goods, 4, 159) == (3 * 100 + 3 * 50, [(2, 1), (2, 1)])
    assert pe.clairvoyant(lengths, goods, 4, 161) is None  # more than any choice makes


def _second_half_starts(raw: list, warped: list, fraction: float = 0.5) -> float:
    """When the warped run reaches the first request of the second half (or past `fraction`) of the trace's
    own time span."""
    span = raw[-1].arrival_s - raw[0].arrival_s
    half = next(i for i, r in enumerate(raw) if r.arrival_s - raw[0].arrival_s >= span * fraction)
    return float(warped[half].arrival_s - warped[0].arrival_s)


def test_the_clairvoyant_sizes_a_quiet_slice_smaller_than_a_busy_one() -> None:
    profile = load_profile("h200_node")
    raw = mooncake(load_records(limit=300), scale=1, materialize=False)
    specs = pe.warp(raw, [0.25, 4])  # the first half of the trace at a quarter of its rate, the second at 4x
    hashes = block_hashes_for(specs, profile.block_size)
    cut = _second_half_starts(raw, specs)  # where the rate steps up: one slice each side
    lengths, goods = pe.slice_goodput(specs, hashes, profile, 6, cut)
    assert len(lengths) == len(goods) == 2 and lengths[0] == cut
    assert set(goods[0]) == set(goods[1]) == {(p, d) for p in range(1, 6) for d in range(1, 7 - p)}
    need = max(sum(g[(p, 6 - p)] for g in goods) for p in range(1, 6))  # the best static split of 6
    found = pe.clairvoyant(lengths, goods, 6, need)
    assert found is not None
    cost, (quiet, busy) = found
    assert sum(quiet) < sum(busy) == 6 and cost < 6 * sum(lengths)
    assert goods[0][quiet] + goods[1][busy] >= need


def test_a_schedule_grows_a_pool_ahead_of_its_split_and_shrinks_it_when_the_split_ends() -> None:
    sched = [(0.0, (2, 1)), (100.0, (5, 1)), (200.0, (3, 2))]
    assert pe._scheduled(sched, 50.0, 23.0) == (2, 1)
    assert pe._scheduled(sched, 80.0, 23.0) == (5, 1)  # asked for 23 s ahead: serving by 100 s
    assert pe._scheduled(sched, 180.0, 23.0) == (5, 2)  # decode grows ahead; prefill shrinks only at 200 s
    assert pe._scheduled(sched, 200.0, 23.0) == (3, 2)


def test_the_schedule_bound_serves_the_static_goodput_with_a_smaller_quiet_phase() -> None:
    profile = load_profile("h200_node")
    raw = mooncake(load_records(limit=300), scale=1, materialize=False)
    phases = [0.25, 4.0]
    specs = pe.warp(raw, phases)
    hashes = block_hashes_for(specs, profile.block_size)
    starts = pe.phase_starts(raw, specs, len(phases))
    assert starts == [0.0, pytest.approx(_second_half_starts(raw, specs))]
    statics = [pe.static_run(specs, hashes, profile, p, 6 - p) for p in range(1, 6)]
    best = max(statics, key=lambda r: (r["good"], -r["worker_s"]))
    split = (best["prefill"], best["decode"])
    # a schedule that never changes is the static split: the same requests served, the same worker-seconds
    same = pe.planner_run(
        specs, hashes, profile, 6, SLO, 3.0, 0.0, 10.0, 0, schedule=[(0.0, split), (starts[1], split)]
    )
    assert same["good"] == best["good"] and same["worker_s"] == pytest.approx(best["worker_s"])
    bound = pe.schedule_bound(specs, hashes, profile, 6, starts, phases, best, 3.0, 10.0)
    # the busy phase keeps the best split; the quiet one tries every split with at most one decode worker more
    assert len(bound["runs"]) == len([p for p in candidates(pe._budget(6)) if p[1] <= split[1] + 1])
    assert all(r["splits"][1] == list(split) for r in bound["runs"])
    quiet, busy = bound["fewest"]["splits"]
    assert sum(quiet) < sum(busy) == 6
    assert bound["fewest"]["good"] >= best["good"] and bound["fewest"]["worker_s"] < best["worker_s"]
    assert "schedule bound" in bound["text"]


def test_foresight_replays_the_requests_that_really_arrive_ahead() -> None:
    specs = mooncake(load_records(limit=200), scale=1, materialize=False)
    t0 = specs[0].arrival_s
    measured = Observation(
        window_s=5.0, requests=12, finished=12, prompt_tokens=1200.0, generation_tokens=120.0,
        cached_tokens=600.0, input_samples=[100] * 12, output_samples=[10] * 12, backlog=3,
    )  # fmt: skip
    at = 30.0
    ahead = [s for s in specs if at < s.arrival_s - t0 <= at + 5.0]
    seen = pe._foreseen(measured, specs, at, 1)
    assert seen.input_samples == [s.input_tokens for s in ahead] and len(ahead) >= 1
    assert seen.output_samples == [s.output_tokens for s in ahead]
    assert seen.rate_rps == pytest.approx(len(ahead) / 5.0)
    assert seen.backlog == 3 and seen.hit_rate == pytest.approx(measured.hit_rate)  # what is measured now
    # too few in the window: it reaches further ahead for enough requests to replay
    more = pe._foreseen(measured, specs, at, len(ahead) + 5)
    assert more.requests == len(ahead) + 5 and more.window_s > 5.0
    assert pe._foreseen(measured, specs, 1e9, 1) is measured  # past the trace's end: nothing to foresee


def _small_planner(specs: list, hashes: list, profile: Profile, **kw: Any) -> dict:
    """The benchmark's planner on a budget of 6, 10 s start-ups, from 2P + 1D, with `kw` (a forecast, foresight)."""
    return pe.planner_run(specs, hashes, profile, 6, Slo(1.0, 0.04), 3.0, 20.0, 10.0, 50, (2, 1),
                          scale_down_window_s=30.0, **kw)  # fmt: skip


def _small_planners(
    specs: list, hashes: list, profile: Profile, variants: dict[Any, dict]
) -> dict[Any, dict]:
    """`_small_planner` of each variant's `kw`, two at a time in processes of their own: each run is a
    single-threaded simulation of tens of seconds, and the suite otherwise leaves the second core idle."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold gRPC or torch threads
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as pool:
        jobs = {k: pool.submit(_small_planner, specs, hashes, profile, **kw) for k, kw in variants.items()}
        return {k: job.result() for k, job in jobs.items()}


def _size_before(run: dict, t: float) -> int:
    """The workers the planner's last decision before `t` wanted."""
    return sum([e for e in run["timeline"] if e["t"] < t][-1]["desired"])


@functools.cache
def _step_case() -> tuple[float, Floor, dict[str, dict]]:
    """The trace's second half at ten times the rate of its first: (when the step comes, a floor over it, the
    planner's runs of it: plain, with foresight, with the floor). The plain run is the baseline of the foresight
    and the floor tests alike."""
    profile = load_profile("h200_node")
    raw = mooncake(load_records(limit=400), scale=1, materialize=False)
    specs = pe.warp(raw, [0.2, 2])
    hashes = block_hashes_for(specs, profile.block_size)
    step = _second_half_starts(raw, specs)
    # asked for a start-up (10 s) and more ahead of the step
    floor = Floor(int(step) - 20, int(step) + 30, 4, 1)
    runs = _small_planners(specs, hashes, profile, {"plain": {}, "foresight": {"foresight_s": 20.0},
                                                     "floor": {"floors": [floor]}})  # fmt: skip
    return step, floor, runs


@pytest.mark.cluster  # its planner runs go to child processes
def test_a_planner_told_the_future_grows_before_a_step_and_serves_more_of_it() -> None:
    step, _, both = _step_case()
    runs = {0.0: both["plain"], 20.0: both["foresight"]}
    # workers asked for ahead of the step
    assert _size_before(runs[20.0], step) > _size_before(runs[0.0], step)
    assert runs[20.0]["good"] > runs[0.0]["good"] and runs[20.0]["errors"] == runs[0.0]["errors"] == 0


@pytest.mark.cluster  # its planner runs go to child processes
def test_a_floor_over_the_step_holds_the_pools_at_it_and_serves_more_of_the_step() -> None:
    step, floor, both = _step_case()
    runs = {0: both["plain"], 1: both["floor"]}
    inside = [e for e in runs[1]["timeline"] if step <= e["t"] < floor.end_s]
    assert inside and all(e["desired"][0] >= 4 and e["desired"][1] >= 1 for e in inside)
    assert _size_before(runs[1], step) >= 5 > _size_before(runs[0], step)
    assert runs[1]["good"] > runs[0]["good"] and runs[1]["errors"] == 0
    # before the window the floor changes nothing: the same decisions
    early = [e["desired"] for e in runs[1]["timeline"] if e["t"] < floor.start_s]
    assert early == [e["desired"] for e in runs[0]["timeline"] if e["t"] < floor.start_s]
    assert pe._floors_s("10-20=2,1; 30-40=1,1") == [Floor(10, 20, 2, 1), Floor(30, 40, 1, 1)]
    with pytest.raises(SystemExit, match="--floor-s"):
        pe._floors_s("10=2,1")


def test_repeat_days_runs_the_shape_again_with_other_users() -> None:
    profile = load_profile("h200_node")
    specs = mooncake(load_records(limit=50), scale=1, materialize=False)
    two, day_s = pe.repeat_days(specs, 2)
    span = specs[-1].arrival_s - specs[0].arrival_s
    assert len(two) == 100 and day_s == pytest.approx(span + span / 49)
    assert [s.arrival_s - day_s for s in two[50:]] == pytest.approx([s.arrival_s for s in specs])
    assert [s.input_tokens for s in two[50:]] == [s.input_tokens for s in specs]
    assert two[50].request_id == f"{specs[0].request_id}@d1" and pe._day(two[50].request_id) == 1
    hashes = block_hashes_for(two, profile.block_size)
    day1 = {h for hs in hashes[:50] for h in hs}
    assert day1 and not day1 & {h for hs in hashes[50:] for h in hs}  # no block cached for another day
    assert pe.repeat_days(specs, 1) == (specs, pytest.approx(day_s))


@pytest.mark.cluster  # its planner runs go to child processes
def test_a_planner_that_learned_yesterday_grows_before_todays_step_and_serves_more_of_it() -> None:
    profile = load_profile("h200_node")
    raw = mooncake(load_records(limit=300), scale=1, materialize=False)
    one = pe.warp(raw, [0.1, 1, 0.1])  # a day: quiet, a third of the trace at ten times the rate, quiet
    specs, day_s = pe.repeat_days(one, 2)
    hashes = block_hashes_for(specs, profile.block_size)
    step = day_s + _second_half_starts(raw, one, 1 / 3)  # the second day's step
    forecasts = {
        name: make_forecast(name, 13.0, season_s=day_s, span_s=15.0, seasons=1)
        for name in ("none", "seasonal")
    }
    runs = _small_planners(specs, hashes, profile, {name: {"forecast": f} for name, f in forecasts.items()})
    # day 1: nothing measured a day ago, so the two decide alike up to its step
    assert _size_before(runs["seasonal"], step - day_s) == _size_before(runs["none"], step - day_s)
    # day 2: the seasonal one asks for workers ahead of the step, and more of the day's requests are served well
    assert _size_before(runs["seasonal"], step) > _size_before(runs["none"], step)
    assert runs["seasonal"]["good_by_day"][1] > runs["none"]["good_by_day"][1]
    assert runs["seasonal"]["errors"] == runs["none"]["errors"] == 0


def test_a_middle_days_line_counts_its_own_worker_seconds_up_to_the_next_day() -> None:
    # 3 days of 100 s; the planner runs 4 workers throughout (billed every 10 s), the static split 8 until 310 s
    billing = [(t, 4.0 * t) for t in range(0, 320, 10)]
    plan = {"billing": billing, "good_by_day": [10, 9, 8]}
    best = {"end": 310.0, "good_by_day": [10, 10, 10]}
    middle = pe._day_text(1, 3, 100.0, best, plan, 8)
    assert (
        "goodput x0.900 (9 of 10" in middle and "worker-seconds x0.500" in middle
    )  # 400 of 800, 100 to 200 s
    last = pe._day_text(2, 3, 100.0, best, plan, 8)  # to each run's end: 4 x 110 of 8 x 110
    assert "goodput x0.800" in last and "worker-seconds x0.500" in last


def test_a_cluster_slower_than_its_replay_is_sized_for_a_tighter_target_with_correction() -> None:
    """`--correction`: windows whose measured p90 TTFT runs twice what the replay of the same traffic predicts
    on the pools that served it raise the correction, and the choice grows the prefill pool that the
    uncorrected choice keeps at one worker; a window that measures what the replay predicts changes nothing."""
    from services.planner.plan import Correction

    queued = Observation(**{**STEADY.__dict__, "backlog": 5})  # one prefill worker: p90 TTFT ~0.8 s of 1 s
    pairs = candidates(LIMITS)
    plain, _ = choose(evaluate(queued, CPU, pairs, slo=SLO), SLO)
    assert plain is not None and (plain.prefill, plain.decode) == (1, 1)
    (ran,) = evaluate(queued, CPU, [(1, 1)], slo=SLO)

    agrees = Correction()
    assert agrees.update(Observation(**{**queued.__dict__, "ttft_p90_s": ran.ttft_p90_s}), ran)
    assert (agrees.ttft, agrees.itl) == (1.0, 1.0) and agrees.target(SLO) == SLO

    slow = Correction()
    measured = Observation(**{**queued.__dict__, "ttft_p90_s": 3 * ran.ttft_p90_s})  # past the bound of 2x
    for _ in range(2):
        assert slow.update(measured, ran)
    assert slow.ttft == pytest.approx(0.7 * (0.7 + 0.3 * 2) + 0.3 * 2) and slow.itl == 1.0  # no ITL measured
    goal = slow.target(SLO)
    assert goal.ttft_s == pytest.approx(SLO.ttft_s / slow.ttft) and goal.itl_s == SLO.itl_s
    corrected, binding = choose(evaluate(queued, CPU, pairs, slo=goal), goal)
    assert corrected is not None and (corrected.prefill, corrected.decode) == (2, 1) and binding == "ttft"
    # a window with nothing measured is not evidence
    assert not slow.update(queued, ran) and slow.windows == 2


def test_the_benchmark_runs_every_cluster_in_the_mode_it_is_given() -> None:
    """`--mode auto` lets the router prefill on a decode worker: on one prefill worker and five decode workers
    under a 2x load, the decode workers take prompts the lone prefill worker would have queued."""
    profile = load_profile("h200_node")
    specs = pe.warp(mooncake(load_records(limit=150), scale=1, materialize=False), [2.0])
    hashes = block_hashes_for(specs, profile.block_size)
    disagg = pe.static_run(specs, hashes, profile, 1, 5)
    auto = pe.static_run(specs, hashes, profile, 1, 5, "auto")
    assert auto["good"] > disagg["good"]
    assert auto["ttft_p90_ms"] < disagg["ttft_p90_ms"]
    # the planner's own cluster runs in that mode too: from the same start it serves what the mode allows
    runs = {
        mode: pe.planner_run(specs, hashes, profile, 6, SLO, 10.0, 30.0, 5.0, 50, (1, 5), mode=mode)
        for mode in ("disagg", "auto")
    }
    assert runs["auto"]["good"] > runs["disagg"]["good"]
