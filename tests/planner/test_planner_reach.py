"""Sizing when an SLO is out of reach, and sizing ahead of the load: `attainable` turns a TTFT target that no
number of workers can meet (prompts too long to prefill within it) into the best achievable p90 plus a margin, so
the planner asks for the fewest workers that come near the best rather than whichever size the replay's noise
puts nearest an impossible target; `RateForecast` sizes for the arrival rate a worker's start-up ahead, and
`SeasonalForecast` for the rate the same time of the days before saw that far ahead."""

from __future__ import annotations

import json
import zlib

import pytest

from loadgen.sim.profile import load_profile
from services.planner.plan import (
    Limits,
    Observation,
    Prediction,
    RateForecast,
    SeasonalForecast,
    Slo,
    attainable,
    candidates,
    choose,
    evaluate,
    make_forecast,
    replay_workload,
)

CPU = load_profile("cpu_smollm2")


def test_an_unreachable_ttft_target_asks_for_the_fewest_workers_near_the_best() -> None:
    slo = Slo(ttft_s=1.0, itl_s=0.1)
    # every size misses 1 s (a 3 s prompt alone); 3 and 4 prefill workers are as good as each other, 2 queue
    preds = [
        Prediction(1, 1, 9.0, 0.05),
        Prediction(2, 1, 4.4, 0.05),
        Prediction(3, 1, 3.05, 0.05),
        Prediction(4, 1, 3.0, 0.05),
    ]
    target = attainable(preds, slo, reach=0.1)
    assert target.ttft_s == pytest.approx(3.3) and target.itl_s == slo.itl_s  # the ITL target is reachable
    best, binding = choose(preds, slo, reach=0.1)
    assert (best.prefill, best.decode, binding) == (3, 1, "ttft")
    # with no margin it is the least miss, as before: the largest
    assert choose(preds, slo, reach=0.0)[0] == preds[-1]
    # a reachable SLO is the SLO: the margin changes nothing
    met = [Prediction(1, 1, 2.0, 0.05), Prediction(2, 1, 0.8, 0.05), Prediction(3, 1, 0.5, 0.05)]
    assert attainable(met, slo) == slo
    assert choose(met, slo)[0] == met[1]
    # a candidate that fails requests does not set what is attainable
    assert attainable([Prediction(9, 9, 0.1, 0.01, failed=1), *preds], slo, 0.1) == target


def test_sized_by_attainment_the_fewest_workers_that_miss_no_more_requests_than_the_best_win() -> None:
    slo = Slo(ttft_s=1.0, itl_s=0.1)
    # 100 replayed requests; 10 are too long for 1 s on any size; 4 prefill workers queue nobody past it, 3 one
    # request a few ms (its p90 a hair above the best), 2 a dozen requests, 1 half of them
    preds = [
        Prediction(1, 1, 9.0, 0.05, misses=55, requests=100),
        Prediction(2, 1, 2.4, 0.05, misses=22, requests=100),
        Prediction(3, 1, 2.02, 0.05, misses=10, requests=100),
        Prediction(4, 1, 2.0, 0.05, misses=10, requests=100),
        Prediction(5, 1, 1.9, 0.05, misses=9, requests=100, failed=1),  # fails a request: never chosen
    ]
    # by p90 with no margin the best p90 is the target, so the largest size that meets it wins
    assert choose(preds, slo)[0] == preds[3]
    # by attainment, 3 serves as many requests within the SLO as 4
    best, binding = choose(preds, slo, size_by="attainment")
    assert (best.prefill, best.decode, binding) == (3, 1, "ttft")
    # a margin is a share of the replayed requests: 12 % lets 2 workers miss 12 more than the best
    assert choose(preds, slo, reach=0.12, size_by="attainment")[0] == preds[1]
    assert choose(preds, slo, reach=0.11, size_by="attainment")[0] == preds[2]
    # where every request misses on every size, fewer misses cannot tell: the p90 stays within 2x of the best
    hopeless = [
        Prediction(1, 1, 30.0, 0.05, misses=100, requests=100),
        Prediction(2, 1, 5.9, 0.05, misses=100, requests=100),
        Prediction(3, 1, 3.0, 0.05, misses=100, requests=100),
    ]
    assert choose(hopeless, slo, size_by="attainment")[0] == hopeless[1]


def test_a_replay_counts_the_requests_that_miss_the_slo() -> None:
    # ~2,000-token prompts on a ~1,600 tokens/s profile: each takes over 1 s alone; one worker also queues them
    long = Observation(
        window_s=10, requests=12, input_tokens=[(1024, 0.0), (2048, 12.0)], output_tokens=[(1, 12.0)],
        prompt_tokens=12 * 1800, generation_tokens=12,
    )  # fmt: skip
    preds = evaluate(long, CPU, [(1, 1), (4, 1)], slo=Slo(ttft_s=1.2, itl_s=0.1))
    assert all(p.requests == 24 for p in preds)  # the replay's requests (at least 20 s of arrivals)
    one, four = preds
    assert 0 < four.misses < one.misses <= one.requests
    loose = evaluate(long, CPU, [(4, 1)], slo=Slo(ttft_s=60.0, itl_s=1.0))
    assert loose[0].misses == 0
    assert evaluate(long, CPU, [(4, 1)])[0].misses == 0  # no SLO given: nothing is counted
    # a longer replay window plays more of the measured traffic: 40 s at the window's 1.2 requests/s
    wide = evaluate(long, CPU, [(4, 1)], slo=Slo(ttft_s=1.2, itl_s=0.1), replay_window_s=40.0)
    assert wide[0].requests == 48 and wide[0].misses > 0


def test_the_pruned_replay_reaches_for_the_best_first_and_chooses_as_the_full_one() -> None:
    # prompts of ~2,000 tokens on a ~1,600 tokens/s CPU profile: no size prefills one within 1 s
    long = Observation(
        window_s=10, requests=12, input_tokens=[(1024, 0.0), (2048, 12.0)], output_tokens=[(1, 12.0)],
        prompt_tokens=12 * 1800, generation_tokens=12,
    )  # fmt: skip
    slo, limits = Slo(ttft_s=1.0, itl_s=0.1), Limits(1, 4, 1, 2, max_workers=5)
    pairs = candidates(limits)
    full = evaluate(long, CPU, pairs, slo=slo)
    assert not any(p.meets(slo) for p in full)
    pruned = evaluate(long, CPU, pairs, until_met=slo)
    assert choose(pruned, slo) == choose(full, slo)
    best, binding = choose(full, slo)
    assert binding == "ttft" and best.meets(attainable(full, slo))
    # the largest total is replayed first: the pruned replay always knows the best the limits can do
    assert max(p.workers for p in pruned) == 5


def test_the_forecast_sizes_ahead_of_a_rising_rate_and_follows_a_falling_one() -> None:
    rising = RateForecast(horizon_s=20.0)
    for t in range(0, 60, 3):
        ahead = rising.update(float(t), 1.0 + 0.05 * t)  # +0.05 req/s every second
    assert ahead > 1.0 + 0.05 * 57  # above what the last window measured: the rate 20 s on
    assert ahead == pytest.approx(1.0 + 0.05 * 77, rel=0.15)
    falling = RateForecast(horizon_s=20.0)
    for t in range(0, 60, 3):
        ahead = falling.update(float(t), 8.0 - 0.1 * t)
    assert ahead < 8.0 - 0.1 * 57
    steady = RateForecast(horizon_s=20.0)
    for t in range(0, 60, 3):
        ahead = steady.update(float(t), 4.0)
    assert ahead == pytest.approx(4.0)
    # one wild window cannot ask for more than max_ratio x what it measured
    jumpy = RateForecast(horizon_s=600.0, max_ratio=2.0)
    jumpy.update(0.0, 1.0)
    assert jumpy.update(3.0, 5.0) <= 10.0 and jumpy.update(6.0, 0.5) >= 0.25


def test_the_replay_plays_the_forecast_rate() -> None:
    obs = Observation(window_s=10, requests=20, prompt_tokens=20 * 100, generation_tokens=20 * 10)
    measured = replay_workload(obs, 16, max_requests=1000, min_window_s=60)
    obs.replay_rate_rps = 2 * obs.rate_rps
    ahead = replay_workload(obs, 16, max_requests=1000, min_window_s=60)
    assert len(ahead) == 2 * len(measured)  # over the same simulated span, twice the arrivals
    assert ahead[-1].arrival_s == pytest.approx(measured[-1].arrival_s, rel=0.3)
    assert obs.to_dict()["replay_rate_per_s"] == 4.0


DAY = 3600.0  # a short season, so the test's days are quick to build


def _day(forecast: SeasonalForecast, day: int, rate_at, until: float, step: float = 3.0) -> float:
    """Feed one day's windows of `step` s up to `until` s into the day; the last forecast."""
    ahead = 0.0
    t = step
    while t <= until:
        ahead = forecast.update(day * DAY + t, rate_at(t), step)
        t += step
    return ahead


def test_the_seasonal_forecast_sees_yesterdays_step_coming_and_nothing_on_the_first_day() -> None:
    def step_at_1800(t: float) -> float:
        return 1.0 if t < 1800 else 4.0

    f = SeasonalForecast(horizon_s=30.0, season_s=DAY, span_s=30.0)
    # the first day: no season measured yet, so the forecast is the window's own rate, even just before the step
    assert _day(f, 0, step_at_1800, 1779) == 1.0
    _day(f, 0, step_at_1800, DAY)  # the rest of day 1, its step included
    # day 2, 30 s before the step: yesterday's next half minute ran at 4x, and today's level is yesterday's
    assert _day(f, 1, step_at_1800, 1770) == pytest.approx(4.0)
    # well before it, the forecast is the steady rate; after it, the new one
    g = SeasonalForecast(horizon_s=30.0, season_s=DAY, span_s=30.0)
    _day(g, 0, step_at_1800, DAY)
    assert _day(g, 1, step_at_1800, 1200) == pytest.approx(1.0)
    assert _day(g, 1, step_at_1800, 2400) == pytest.approx(4.0)


def test_the_seasonal_forecast_scales_yesterdays_shape_to_todays_level_within_its_ratio() -> None:
    f = SeasonalForecast(horizon_s=30.0, season_s=DAY, span_s=30.0)
    _day(f, 0, lambda t: 1.0 if t < 1800 else 3.0, DAY)
    # today runs at twice yesterday's level: the step is forecast to twice yesterday's height
    assert _day(f, 1, lambda t: 2.0, 1770) == pytest.approx(6.0)
    # but never beyond max_ratio x the window just measured, however large yesterday's step was
    h = SeasonalForecast(horizon_s=30.0, season_s=DAY, span_s=30.0, max_ratio=2.0)
    _day(h, 0, lambda t: 1.0 if t < 1800 else 50.0, DAY)
    assert _day(h, 1, lambda t: 1.0, 1770) == pytest.approx(2.0)
    # a rise from a silent stretch (nothing arrived) is the largest rise there is
    z = SeasonalForecast(horizon_s=30.0, season_s=DAY, span_s=30.0)
    _day(z, 0, lambda t: 0.0 if t < 1800 else 3.0, DAY)
    assert _day(z, 1, lambda t: 1.0, 1770) == pytest.approx(4.0)
    # a fall seen yesterday never sizes below the load measured now: it is met as it comes
    d = SeasonalForecast(horizon_s=30.0, season_s=DAY, span_s=30.0)
    _day(d, 0, lambda t: 4.0 if t < 1800 else 1.0, DAY)
    assert _day(d, 1, lambda t: 4.0, 1770) == pytest.approx(4.0)


def test_the_seasonal_forecast_averages_the_seasons_it_keeps_and_forgets_older_ones() -> None:
    f = SeasonalForecast(horizon_s=30.0, season_s=DAY, span_s=30.0, seasons=2)
    _day(f, 0, lambda t: 1.0 if t < 1800 else 2.0, DAY)
    _day(f, 1, lambda t: 1.0 if t < 1800 else 4.0, DAY)
    # day 3 before the step: the mean of the two steps seen, 2x and 4x
    assert _day(f, 2, lambda t: 1.0, 1770) == pytest.approx(3.0)
    _day(f, 2, lambda t: 1.0, DAY)
    # day 4 keeps days 2 and 3 only: day 1's buckets are gone, and the step is now (4 + 1) / 2
    assert min(f.buckets) * f.bucket_s >= DAY - f.span_s
    assert _day(f, 3, lambda t: 1.0, 1770) == pytest.approx(2.5)


def test_make_forecast_names_each_predictor() -> None:
    assert make_forecast("none", 20.0) is None
    assert isinstance(make_forecast("trend", 20.0), RateForecast)
    seasonal = make_forecast("seasonal", 20.0, season_s=600.0, span_s=20.0, seasons=3)
    assert isinstance(seasonal, SeasonalForecast) and (seasonal.season_s, seasonal.seasons) == (600.0, 3)
    with pytest.raises(ValueError, match="arima"):
        make_forecast("arima", 20.0)
    with pytest.raises(ValueError, match="season_s"):
        SeasonalForecast(20.0, season_s=0.0)
    # a state is checked as a whole before any of it is taken
    half_broken = zlib.compress(
        json.dumps({"season_s": 600.0, "span_s": 20.0, "buckets": [[1, 2.0, 3.0], [2]]}).encode()
    )
    with pytest.raises(ValueError, match="not a seasonal"):
        seasonal.load_state(half_broken, 0.0)
    assert not seasonal.buckets
