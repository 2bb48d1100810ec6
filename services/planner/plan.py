"""What the planner decides, as arithmetic over a window of measurements: no I/O, no clock of its own.

    obs = Observation(...)                       # one interval of what the cluster measured (observe.py)
    profile = live_profile(base, obs)            # the simulator's cost profile with the live rates
    preds = evaluate(obs, profile, candidates(limits, mode), mode, seed)   # replay through loadgen.sim per (P, D)
    target, binding = choose(preds, slo)         # the fewest workers that meet both SLOs
    desired = damp(actual, target, limits, damper, now, mode)   # one step per pool, a hold-down, the bounds

The replay: the window's request rate, input/output length distributions and prefix hit rate become a
synthetic trace (Poisson arrivals, lengths drawn from the measured histograms, the hit rate as a shared prefix),
and the simulator — which runs the router's own policy code — plays it on each candidate (P, D) with the cost
profile calibrated from the workers' measured prefill rate and decode step time.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime, timedelta, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from loadgen.report import percentile
from loadgen.sim.engine import ClusterConfig, Simulator, block_hashes_for
from loadgen.sim.profile import Profile
from loadgen.workload import RequestSpec
from services.telemetry.traffic import SHARE_TOKENS, TrafficRecord

# Histograms as (upper bound, count in that bucket — not cumulative); the last bound may be inf.
Buckets = list[tuple[float, float]]


@dataclass
class Observation:
    """One planning window of cluster measurements (deltas over the window, or gauges at its end)."""

    window_s: float
    requests: int  # arrivals (admitted): the demand, even when the cluster cannot keep up with it
    input_tokens: Buckets = field(default_factory=list)  # prompt tokens per arrival
    output_tokens: Buckets = field(default_factory=list)  # generated tokens per finished request
    prompt_tokens: float = 0.0  # of the arrivals
    generation_tokens: float = 0.0  # of the finished requests
    cached_tokens: float = 0.0  # of the finished requests
    finished: int = -1  # requests that finished in the window (-1: as many as arrived)
    input_samples: list[int] | None = None  # exact lengths, when known (the simulator's own planner)
    output_samples: list[int] | None = None
    # the requests themselves (`--replay-from recent`: the frontends' traffic logs, `recent_specs`): their
    # arrival times and prompts' block ids, so the replay shares prefixes as the traffic did
    recent: list[RequestSpec] | None = None
    ttft_p90_s: float | None = None  # measured at the frontend over the window
    itl_p90_s: float | None = None
    waiting: dict[str, float] = field(default_factory=dict)  # requests queued per pool, now
    backlog: int = 0  # requests queued now, not yet started: the replay starts with them
    kv_usage: dict[str, float] = field(default_factory=dict)  # mean KV usage ratio per pool, now
    prefill_tokens_per_s: float | None = None  # calibrated: computed prompt tokens / prefill busy seconds
    decode_step_s: float | None = None  # mean decode step over the window
    decode_batch: float | None = None  # mean sequences per decode step over the window
    decode_ctx_tokens: float | None = None  # mean context tokens per decode step (estimated)
    # the arrival rate the replay plays (RateForecast's); None: the measured one
    replay_rate_rps: float | None = None

    @property
    def rate_rps(self) -> float:
        return self.requests / self.window_s if self.window_s > 0 else 0.0

    @property
    def replay_rps(self) -> float:
        return self.rate_rps if self.replay_rate_rps is None else self.replay_rate_rps

    @property
    def done(self) -> int:
        return self.requests if self.finished < 0 else self.finished

    @property
    def hit_rate(self) -> float:
        looked_up = self.mean_input() * self.done
        return min(1.0, self.cached_tokens / looked_up) if looked_up > 0 else 0.0

    def mean_input(self) -> float:
        return self.prompt_tokens / self.requests if self.requests else 0.0

    def mean_output(self) -> float:
        return self.generation_tokens / self.done if self.done else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "window_s": round(self.window_s, 3),
            "requests": self.requests,
            "finished": self.done,
            "request_rate_per_s": round(self.rate_rps, 4),
            "replay_rate_per_s": None if self.replay_rate_rps is None else round(self.replay_rate_rps, 4),
            "mean_input_tokens": round(self.mean_input(), 1),
            "mean_output_tokens": round(self.mean_output(), 1),
            "prefix_hit_rate": round(self.hit_rate, 4),
            "backlog": self.backlog,
            "ttft_p90_s": self.ttft_p90_s,
            "itl_p90_s": self.itl_p90_s,
            "waiting": self.waiting,
            "kv_usage": self.kv_usage,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_step_s": self.decode_step_s,
            "decode_batch": self.decode_batch,
        }


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float


@dataclass(frozen=True)
class Limits:
    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    max_workers: int = 0  # 0: no budget on P + D

    def __post_init__(self) -> None:
        if not 0 <= self.min_prefill <= self.max_prefill:
            raise ValueError(
                f"need 0 <= --min-prefill <= --max-prefill, got {self.min_prefill}, {self.max_prefill}"
            )
        if not 1 <= self.min_decode <= self.max_decode:
            raise ValueError(
                f"need 1 <= --min-decode <= --max-decode, got {self.min_decode}, {self.max_decode}"
            )
        if self.max_workers and self.max_workers < self.min_prefill + self.min_decode:
            raise ValueError(
                f"--max-workers {self.max_workers} is below --min-prefill + --min-decode "
                f"({self.min_prefill + self.min_decode})"
            )


DAY_S = 86_400


WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")  # datetime.weekday() order


@dataclass(frozen=True)
class Floor:
    """A daily window of wall-clock time in which the pools are kept at least this large: what an operator
    declares for load that comes at known hours (KEDA's cron scaler, for llm-d). `start_s`, `end_s`: seconds
    after midnight; a window whose end is not after its start runs past midnight. `days`: the weekdays
    (0 = Monday) it starts on, None for every day; a window past midnight runs on into the next day. The times
    and days are those of the time zone `active` is given (UTC by default)."""

    start_s: int
    end_s: int
    prefill: int
    decode: int
    days: frozenset[int] | None = None

    def active(self, wall: float, tz: tzinfo | None = None, skip: FloorExceptions | None = None) -> bool:
        """Whether the window holds at `wall` (epoch seconds) in `tz`; never on a window that starts on a date of
        `skip` (a holiday: the window from the day before that runs past midnight still runs out)."""
        if tz is None and self.days is None and not skip:
            t, weekday = wall % DAY_S, 0  # UTC every day: no calendar needed (the experiment's run seconds)
            today = None
        else:
            local = datetime.fromtimestamp(wall, tz or UTC)
            t = local.hour * 3600 + local.minute * 60 + local.second + local.microsecond / 1e6
            weekday, today = local.weekday(), local.date()

        def on(back: int) -> bool:
            """Whether the window starts on the day `back` days before today."""
            if self.days is not None and (weekday - back) % 7 not in self.days:
                return False
            return not skip or today is None or not skip.holds(today - timedelta(days=back))

        if self.start_s < self.end_s:
            return self.start_s <= t < self.end_s and on(0)
        return (t >= self.start_s and on(0)) or (t < self.end_s and on(1))


@dataclass(frozen=True)
class FloorExceptions:
    """`--floor-except`: dates on which no `--floor` window starts (holidays), each `YYYY-MM-DD` or, every year,
    `MM-DD`; in `--floor-tz`."""

    dates: frozenset[date] = frozenset()
    yearly: frozenset[tuple[int, int]] = frozenset()  # (month, day)

    def __bool__(self) -> bool:
        return bool(self.dates or self.yearly)

    def holds(self, day: date) -> bool:
        return day in self.dates or (day.month, day.day) in self.yearly


def parse_floor_exceptions(text: str) -> FloorExceptions:
    dates, yearly = set(), set()
    for part in (x.strip() for x in text.replace(";", ",").split(",")):
        if not part:
            continue
        try:
            if part.count("-") == 2:
                dates.add(date.fromisoformat(part))
            else:
                month, _, day = part.partition("-")
                date(2000, int(month), int(day))  # a leap year: 02-29 is a date
                yearly.add((int(month), int(day)))
        except ValueError as exc:
            raise ValueError(
                f"--floor-except wants dates YYYY-MM-DD or, every year, MM-DD; got {part!r}"
            ) from exc
    return FloorExceptions(frozenset(dates), frozenset(yearly))


def _clock(text: str) -> int:
    hh, sep, mm = text.strip().partition(":")
    if not sep or not hh.isdigit() or not mm.isdigit() or len(mm) != 2 or int(hh) > 23 or int(mm) > 59:
        raise ValueError(f"not a time of day HH:MM: {text!r}")
    return int(hh) * 3600 + int(mm) * 60


def _weekdays(text: str) -> frozenset[int]:
    """`Mon-Fri`, `Sat,Sun`, `Mon-Wed,Fri`, `Fri-Mon` (a range may wrap past Sunday): the weekdays, 0 = Monday."""
    days: set[int] = set()
    for part in text.lower().split(","):
        first, dash, last = part.strip().partition("-")
        if first not in WEEKDAYS or (dash and last not in WEEKDAYS):
            raise ValueError(f"not weekdays like Mon-Fri or Sat,Sun: {text!r}")
        a = WEEKDAYS.index(first)
        b = WEEKDAYS.index(last) if dash else a
        days.update((a + k) % 7 for k in range((b - a) % 7 + 1))
    return frozenset(days)


def parse_floors(text: str) -> list[Floor]:
    """`--floor`: windows `[DAYS ]HH:MM-HH:MM=P,D`, separated by `;` (DAYS such as `Mon-Fri`; none: every day).
    Empty: none."""
    floors = []
    for part in (x.strip() for x in text.split(";")):
        if not part:
            continue
        head, eq, sizes = part.partition("=")
        head = head.strip()
        days_text, _, span = head.partition(" ") if head[:1].isalpha() else ("", "", head)
        start, dash, end = span.partition("-")
        p, comma, d = sizes.partition(",")
        if not eq or not dash or not comma or not p.strip().isdigit() or not d.strip().isdigit():
            raise ValueError(f"--floor wants [DAYS ]HH:MM-HH:MM=P,D, got {part!r}")
        days = _weekdays(days_text) if days_text.strip() else None
        floor = Floor(_clock(start), _clock(end), int(p), int(d), days)
        if floor.start_s == floor.end_s:
            raise ValueError(f"--floor window {part!r} is empty")
        floors.append(floor)
    return floors


def floor_zone(name: str) -> tzinfo | None:
    """`--floor-tz`: an IANA time zone name (Europe/Berlin); UTC (or empty) is None, the fast path."""
    if name in ("", "UTC", "utc"):
        return None
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(
            f"--floor-tz {name!r} is not a time zone this host knows (an IANA name such as Europe/Berlin; "
            "a system without a zone database needs the tzdata package)"
        ) from exc


def floor_at(
    floors: Sequence[Floor], wall: float, tz: tzinfo | None = None, skip: FloorExceptions | None = None
) -> tuple[int, int] | None:
    """The pools' floor at wall-clock time `wall` (epoch seconds) in time zone `tz` (None: UTC): the largest of
    the active windows per pool (none starting on a date of `skip`), None when none is active."""
    on = [f for f in floors if f.active(wall, tz, skip)]
    if not on:
        return None
    return max(f.prefill for f in on), max(f.decode for f in on)


def with_floor(limits: Limits, floor: tuple[int, int] | None) -> Limits:
    """The limits with their minimums raised to `floor` (never above the maximums, which `--floor` is checked
    against at start)."""
    if floor is None:
        return limits
    return replace(
        limits,
        min_prefill=min(limits.max_prefill, max(limits.min_prefill, floor[0])),
        min_decode=min(limits.max_decode, max(limits.min_decode, floor[1])),
    )


@dataclass
class Prediction:
    prefill: int
    decode: int
    ttft_p90_s: float
    itl_p90_s: float
    failed: int = 0
    misses: int = 0  # replayed requests that missed the SLO (TTFT, or their own p90 ITL) or failed
    requests: int = 0

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    def excess(self, slo: Slo) -> float:
        """How far past the SLOs, as relative overshoot summed over both (0 when both are met)."""
        over = max(0.0, self.ttft_p90_s / slo.ttft_s - 1.0) + max(0.0, self.itl_p90_s / slo.itl_s - 1.0)
        return over + (1e6 * self.failed)  # a candidate that cannot serve some request is last

    def meets(self, slo: Slo) -> bool:
        return self.failed == 0 and self.ttft_p90_s <= slo.ttft_s and self.itl_p90_s <= slo.itl_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefill": self.prefill,
            "decode": self.decode,
            "ttft_p90_ms": round(self.ttft_p90_s * 1000, 2),
            "itl_p90_ms": round(self.itl_p90_s * 1000, 2),
            "failed": self.failed,
            "misses": self.misses,
        }


def least_prefill(limits: Limits, mode: str = "disagg") -> int:
    """The fewest prefill workers a plan may have: `--min-prefill`, and at least one unless the router runs in
    agg mode (its decode workers prefill their own prompts: an agg cluster needs no prefill pool at all)."""
    return limits.min_prefill if mode == "agg" else max(1, limits.min_prefill)


def candidates(limits: Limits, mode: str = "disagg") -> list[tuple[int, int]]:
    out = []
    for p in range(least_prefill(limits, mode), limits.max_prefill + 1):
        for d in range(limits.min_decode, limits.max_decode + 1):
            if not limits.max_workers or p + d <= limits.max_workers:
                out.append((p, d))
    return out


def live_profile(base: Profile, obs: Observation) -> Profile:
    """The base profile with what the workers measured: their prefill rate, and the decode step curve scaled
    so that it passes through the measured (batch, step time) point."""
    changes: dict[str, Any] = {}
    if obs.prefill_tokens_per_s and obs.prefill_tokens_per_s > 0:
        changes["prefill_tokens_per_s"] = obs.prefill_tokens_per_s
    if obs.decode_step_s and obs.decode_step_s > 0:
        batch = max(1.0, obs.decode_batch or 1.0)
        ctx = obs.decode_ctx_tokens or batch * (obs.mean_input() + obs.mean_output() / 2)
        modelled = base.decode_base_s + batch * base.decode_per_seq_s + ctx * base.decode_per_ctx_token_s
        k = obs.decode_step_s / modelled if modelled > 0 else 1.0
        changes.update(
            decode_base_s=base.decode_base_s * k,
            decode_per_seq_s=base.decode_per_seq_s * k,
            decode_per_ctx_token_s=base.decode_per_ctx_token_s * k,
        )
    if not changes:
        return base
    return replace(base, name=f"{base.name}+live", source=f"{base.source}; rates measured live", **changes)


PREDICTORS = ("none", "trend", "seasonal")
REACH = 0.0  # how far above the best achievable p90 a size may be where no size meets an SLO (0: the best)
# what a candidate is judged by: its p90s against the (attainable) targets, or how many replayed requests miss the
# SLO against the fewest any candidate misses (the share a size serves within the SLO: what goodput counts)
SIZE_BY = ("p90", "attainment")
# sized by attainment, a size's p90s stay within this factor of the best (or the SLO)
ATTAINMENT_P90_BOUND = 2.0


CORRECTION_BOUNDS = (0.5, 2.0)  # one window's observed / predicted p90, before smoothing


@dataclass
class Correction:
    """How far the live cluster's p90s are from what the replay predicts for the pools that ran, over that same
    window's traffic: observed / predicted, per SLO, smoothed over the windows (weight `alpha` on the newest)
    and each window's ratio kept within CORRECTION_BOUNDS. Candidates are then judged against the SLO divided
    by it (`target`): a cluster whose p90 TTFT runs 30 % above its replay is sized for a target 30 % tighter,
    one that runs below it for a looser one. What the simulator does not model (a frontend's own overhead, a
    network, another tenant of the host) is then measured instead — the correction factors of Dynamo's SLA
    planner, applied to a replay instead of a profile's interpolation."""

    alpha: float = 0.3
    ttft: float = 1.0
    itl: float = 1.0
    windows: int = 0  # windows that updated it
    pools: tuple[int, int] | None = None  # (P, D) that served the last window offered to `comparable`

    def comparable(self, pools: tuple[int, int]) -> bool:
        """Whether the window served by `pools` can be held against its replay on them: the same pools served
        the window before (one across a resize mixes two clusters). Records `pools` for the next."""
        same, self.pools = pools == self.pools, pools
        return same

    def update(self, obs: Observation, ran: Prediction) -> bool:
        """Take one window: `ran` is the replay of its traffic on the pools that served it. False (and
        nothing changes) when the window measured no p90 to compare."""
        lo, hi = CORRECTION_BOUNDS
        took = False
        if obs.ttft_p90_s and ran.ttft_p90_s > 0:
            ratio = min(hi, max(lo, obs.ttft_p90_s / ran.ttft_p90_s))
            self.ttft = (1 - self.alpha) * self.ttft + self.alpha * ratio
            took = True
        if obs.itl_p90_s and ran.itl_p90_s > 0:
            ratio = min(hi, max(lo, obs.itl_p90_s / ran.itl_p90_s))
            self.itl = (1 - self.alpha) * self.itl + self.alpha * ratio
            took = True
        self.windows += took
        return took

    def target(self, slo: Slo) -> Slo:
        return Slo(slo.ttft_s / self.ttft, slo.itl_s / self.itl)

    def to_dict(self) -> dict[str, Any]:
        return {"ttft": round(self.ttft, 4), "itl": round(self.itl, 4), "windows": self.windows}


@dataclass
class RateForecast:
    """The arrival rate `horizon_s` from now, by Holt's linear trend (double exponential smoothing) over the
    windows' measured rates: a level and a trend (req/s per second), both updated at the end of each window.

    A worker asked for now serves only once it has started, so pools sized for the rate measured now are sized
    for the past; sized for the rate one start-up plus one interval ahead, they grow before a rising load
    arrives and shrink as a falling one leaves (Dynamo's planner forecasts the next interval's load for the
    same reason). The forecast never leaves [rate / max_ratio, rate x max_ratio] of the window just measured,
    so one noisy window cannot ask for an absurd cluster."""

    horizon_s: float
    alpha: float = 0.5  # weight of the newest window in the level
    beta: float = 0.2  # weight of the newest slope in the trend
    max_ratio: float = 2.0
    level: float | None = None
    trend: float = 0.0
    t: float = 0.0

    def update(self, t: float, rate: float, window_s: float = 0.0) -> float:
        """Take the window that ended at `t` with `rate` (its length does not matter here); return the
        forecast rate at t + horizon_s."""
        if self.level is None:
            self.level, self.t = rate, t
            return rate
        dt = t - self.t
        if dt <= 0:
            return self.forecast(rate)
        level = self.alpha * rate + (1 - self.alpha) * (self.level + self.trend * dt)
        self.trend = self.beta * (level - self.level) / dt + (1 - self.beta) * self.trend
        self.level, self.t = level, t
        return self.forecast(rate)

    def forecast(self, rate: float) -> float:
        assert self.level is not None
        ahead = self.level + self.trend * self.horizon_s
        return min(rate * self.max_ratio, max(rate / self.max_ratio, ahead))


@dataclass
class SeasonalForecast:
    """The arrival rate `horizon_s` from now, from how it moved at this moment of the seasons already measured (a
    season is a day, or a week): the window's rate times the rise the last `seasons` seasons saw from the
    `span_s` before this moment to the `span_s` that began `horizon_s` after it.

    A step that comes at the same time each day — a working day's start, a nightly batch — cannot be seen in the
    windows before it, which is what Holt's trend reads; it can be in yesterday's. Where no earlier season was
    measured at both moments (the first day, a gap) the forecast is the window's own rate: no prediction.

    Only a rise of at least `min_rise` counts, and the forecast stays within [rate, rate x max_ratio]: a fall
    seen yesterday never sizes below the load now, because a worker drained now stops serving now while one asked
    for serves only a start-up later (the pools grow ahead of a rise and shrink as a fall is measured), and the
    noise of two spans' means in a steady stretch (a tenth or more either way) would otherwise only ever add
    workers."""

    horizon_s: float
    season_s: float
    span_s: float = 60.0
    seasons: int = 7
    max_ratio: float = 4.0
    min_rise: float = 1.25
    t: float | None = None
    # measured arrivals and seconds per bucket of span_s / 3 (bucket index -> [requests, seconds])
    buckets: dict[int, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.season_s <= 0 or self.span_s <= 0 or self.seasons < 1:
            raise ValueError("a seasonal forecast needs season_s > 0, span_s > 0 and seasons >= 1")

    @property
    def bucket_s(self) -> float:
        return self.span_s / 3

    def update(self, t: float, rate: float, window_s: float = 0.0) -> float:
        """Take the window of `window_s` (0: since the last update) that ended at `t` with `rate`; return the
        forecast rate at t + horizon_s."""
        start = t - window_s if window_s > 0 else self.t
        if start is not None and t > start:
            self._record(start, t, rate)
        self.t = t
        oldest = math.floor((t - self.seasons * self.season_s - self.span_s) / self.bucket_s)
        for k in [k for k in self.buckets if k < oldest]:
            del self.buckets[k]
        return self.forecast(t, rate)

    def _record(self, a: float, b: float, rate: float) -> None:
        k = math.floor(a / self.bucket_s)
        while k * self.bucket_s < b:
            lo, hi = max(a, k * self.bucket_s), min(b, (k + 1) * self.bucket_s)
            if hi > lo:
                cell = self.buckets.setdefault(k, [0.0, 0.0])
                cell[0] += rate * (hi - lo)
                cell[1] += hi - lo
            k += 1

    def mean(self, a: float, b: float) -> float | None:
        """The measured rate over [a, b), None where less than half of it was measured."""
        requests = seconds = 0.0
        k = math.floor(a / self.bucket_s)
        while k * self.bucket_s < b:
            cell = self.buckets.get(k)
            if cell is not None and cell[1] > 0:
                part = (min(b, (k + 1) * self.bucket_s) - max(a, k * self.bucket_s)) / self.bucket_s
                requests, seconds = requests + cell[0] * part, seconds + cell[1] * part
            k += 1
        return requests / seconds if seconds >= (b - a) / 2 else None

    def to_state(self) -> bytes:
        """What was measured, compressed: a restarted planner forecasts from its first window with it."""
        cells = [[k, round(r, 4), round(sec, 3)] for k, (r, sec) in sorted(self.buckets.items())]
        doc = {"season_s": self.season_s, "span_s": self.span_s, "buckets": cells}
        return zlib.compress(json.dumps(doc, separators=(",", ":")).encode())

    def load_state(self, data: bytes, now: float) -> int:
        """Take the buckets of a state saved with this season and span that are still within the seasons kept
        at `now`; how many were taken (0 for another season or span). ValueError for what is not a state."""
        try:
            doc = json.loads(zlib.decompress(data))
            season_s, span_s = float(doc["season_s"]), float(doc["span_s"])
            cells = {int(k): [float(r), float(sec)] for k, r, sec in doc["buckets"]}
        except (zlib.error, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"not a seasonal forecast's state: {e}") from e
        if (season_s, span_s) != (self.season_s, self.span_s):
            return 0
        oldest = math.floor((now - self.seasons * self.season_s - self.span_s) / self.bucket_s)
        taken = {k: cell for k, cell in cells.items() if k >= oldest and k not in self.buckets}
        self.buckets.update(taken)
        return len(taken)

    def forecast(self, t: float, rate: float) -> float:
        then, before = [], []
        for n in range(1, self.seasons + 1):
            at = t - n * self.season_s
            ahead = self.mean(at + self.horizon_s, at + self.horizon_s + self.span_s)
            past = self.mean(at - self.span_s, at)
            if ahead is not None and past is not None:
                then.append(ahead)
                before.append(past)
        if not then or sum(then) <= 0:
            return rate
        rise = (
            sum(then) / sum(before) if sum(before) > 0 else self.max_ratio
        )  # from nothing: as far as it goes
        return rate * min(self.max_ratio, rise) if rise >= self.min_rise else rate


def make_forecast(
    predictor: str, horizon_s: float, season_s: float = 86400.0, span_s: float = 60.0, seasons: int = 7
) -> RateForecast | SeasonalForecast | None:
    """The forecaster a `--predictor` names (none: None, the measured rate is replayed)."""
    if predictor == "trend":
        return RateForecast(horizon_s)
    if predictor == "seasonal":
        return SeasonalForecast(horizon_s, season_s, span_s, seasons)
    if predictor != "none":
        raise ValueError(f"unknown predictor {predictor!r}: one of {', '.join(PREDICTORS)}")
    return None


def _draw(buckets: Buckets, mean: float, rng: random.Random, samples: list[int] | None = None) -> int:
    """A length drawn from the exact samples, else from a histogram (uniform inside its bucket), else the
    mean."""
    if samples:
        return samples[rng.randrange(len(samples))]
    total = sum(c for _, c in buckets)
    if total <= 0:
        return max(1, round(mean))
    x = rng.random() * total
    lo = 0.0
    for hi, c in buckets:
        if x < c:
            top = hi if math.isfinite(hi) else max(2 * lo, lo + 1, mean)
            return max(1, round(lo + (top - lo) * rng.random()))
        x -= c
        lo = hi
    return max(1, round(lo))


REPLAY_MIN_WINDOW_S = 20.0  # the least traffic a replay covers, in simulated seconds


def replay_workload(
    obs: Observation,
    block_size: int,
    seed: int = 0,
    max_requests: int = 200,
    min_window_s: float = REPLAY_MIN_WINDOW_S,
) -> list[RequestSpec]:
    """The window's traffic as a trace: the backlog queued now arrives at once, then Poisson arrivals at the
    measured rate; lengths drawn from the measured histograms, a prefix of hit_rate x the prompt shared by every
    request (the simplest sharing that gives the measured hit rate). At most `max_requests` arrivals (plus the
    backlog), over at least `min_window_s` simulated seconds. With `obs.recent`, those requests themselves
    instead (`_replay_recent`; the newest `max_requests`: the caller chose their window)."""
    rate = obs.replay_rps
    if rate <= 0:
        return []
    rng = random.Random(seed)
    if obs.recent:
        outputs = obs.output_samples or [max(1, round(obs.mean_output()))]
        return _replay_recent(obs.recent[-max_requests:], obs.backlog, rate, outputs, rng)
    n = max(1, min(max_requests, math.ceil(rate * max(obs.window_s, min_window_s))))
    mean_in, mean_out = obs.mean_input(), obs.mean_output()
    shared_blocks = int(obs.hit_rate * mean_in) // block_size
    specs, t = [], 0.0
    for i in range(obs.backlog + n):
        if i >= obs.backlog:
            t += rng.expovariate(rate)
        n_in = _draw(obs.input_tokens, mean_in, rng, obs.input_samples)
        n_out = _draw(obs.output_tokens, mean_out, rng, obs.output_samples)
        blocks = math.ceil(n_in / block_size)
        shared = min(shared_blocks, max(0, (n_in - 1) // block_size))
        ids = list(range(1, shared + 1)) + [-(i + 1) * 1_000_000 - k for k in range(blocks - shared)]
        specs.append(
            RequestSpec(
                f"plan-{i}",
                n_in,
                n_out,
                arrival_s=t,
                tags={
                    "hash_ids": ",".join(map(str, ids)),
                    "trace_block_tokens": str(block_size),
                    "trace_seed": str(seed),
                },
            )
        )
    return specs


def recent_specs(records: Sequence[tuple[str, TrafficRecord]]) -> list[RequestSpec]:
    """The traffic logs' records ((source, record): a frontend's records number their parents in its own log)
    in arrival order, as requests whose prompts share what the records say they shared: block ids of
    `SHARE_TOKENS` tokens, a parent's ids for the shared prefix and new ones after it. A parent older than the
    records stands in as ids of its own, so the requests that shared it share them again. Output lengths are
    the replay's to draw (`_replay_recent`)."""
    ids = itertools.count(1)
    chains: dict[tuple[str, int], list[int]] = {}
    out = []
    for source, r in records:
        shared = r.shared_tokens // SHARE_TOKENS
        prefix: list[int] = []
        if shared and r.parent is not None:
            prefix = chains.setdefault((source, r.parent), [])
            prefix.extend(next(ids) for _ in range(shared - len(prefix)))  # a parent older than the records
        own = max(1, math.ceil(r.prompt_tokens / SHARE_TOKENS)) - shared
        chain = chains[(source, r.seq)] = prefix[:shared] + [next(ids) for _ in range(own)]
        out.append(
            RequestSpec(
                f"recent-{source}-{r.seq}",
                r.prompt_tokens,
                1,
                arrival_s=r.t,
                tags={
                    "hash_ids": ",".join(map(str, chain)),
                    "trace_block_tokens": str(SHARE_TOKENS),
                    "trace_seed": "0",
                },
            )
        )
    return out


def _replay_recent(
    recent: Sequence[RequestSpec], backlog: int, rate: float, outputs: Sequence[int], rng: random.Random
) -> list[RequestSpec]:
    """The recent requests again, in the order and with the relative gaps they arrived with, scaled to arrive
    at `rate` (the window's, or the forecast's); a backlog of `backlog` of them drawn at random arrives at once
    first. Their own prompts and block ids, so the prefixes they shared are shared again (the replay's caches
    start empty); output lengths drawn from `outputs` (those measured: an arrival's own is not known yet)."""
    first = min(s.arrival_s for s in recent)
    span = max(s.arrival_s for s in recent) - first
    own = (len(recent) - 1) / span if span > 0 else rate
    speedup = rate / own if own > 0 else 1.0
    queued = [recent[rng.randrange(len(recent))] for _ in range(backlog)]
    again = [(0.0, s) for s in queued] + [((s.arrival_s - first) / speedup, s) for s in recent]
    return [
        RequestSpec(
            f"plan-{i}", s.input_tokens, outputs[rng.randrange(len(outputs))], arrival_s=t, tags=dict(s.tags)
        )
        for i, (t, s) in enumerate(again)
    ]


def simulate_candidate(
    specs: Sequence[RequestSpec],
    hashes: Sequence[list[int]],
    profile: Profile,
    p: int,
    d: int,
    mode: str,
    slo: Slo | None = None,
) -> Prediction:
    """One candidate's replay: its p90 TTFT and ITL and, against `slo`, the requests that miss it."""
    sim = Simulator(profile, ClusterConfig(prefill_workers=p, decode_workers=d, mode=mode))
    results = sim.run(specs, hashes)
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.itl_s]
    misses = 0
    if slo is not None:
        met = [r for r in ok if r.ttft_s is not None and r.ttft_s <= slo.ttft_s]
        misses = len(results) - sum(1 for r in met if not r.itl_s or percentile(r.itl_s, 90) <= slo.itl_s)
    return Prediction(
        p,
        d,
        ttft_p90_s=percentile(ttfts, 90) if ttfts else 0.0,
        itl_p90_s=percentile(gaps, 90) if gaps else 0.0,
        failed=len(results) - len(ok),
        misses=misses,
        requests=len(results),
    )


def evaluate(
    obs: Observation,
    profile: Profile,
    pairs: Sequence[tuple[int, int]],
    mode: str = "disagg",
    seed: int = 0,
    max_requests: int = 200,
    until_met: Slo | None = None,
    reach: float = REACH,
    size_by: str = "p90",
    slo: Slo | None = None,
    replay_window_s: float = REPLAY_MIN_WINDOW_S,
) -> list[Prediction]:
    """Replay the window through each candidate (P, D), counting the requests that miss `slo` (or `until_met`).
    With `until_met`, the largest total goes first (what the limits can reach at best: `attainable`, or the
    fewest misses), then the others by increasing P + D, and the replay stops after the first total at which
    some candidate is good enough for `choose`: it never takes a candidate with more workers than that, so its
    answer is the same as over every candidate, for less simulation (when none is, every candidate is
    simulated)."""
    specs = replay_workload(obs, profile.block_size, seed, max_requests, replay_window_s)
    if not specs:
        return []
    hashes = block_hashes_for(specs, profile.block_size)
    judge = until_met or slo

    def run(p: int, d: int) -> Prediction:
        return simulate_candidate(specs, hashes, profile, p, d, mode, judge)

    if until_met is None:
        return [run(p, d) for p, d in pairs]
    totals = sorted({p + d for p, d in pairs})
    out = [run(p, d) for p, d in pairs if p + d == totals[-1]]
    good_enough = _good_enough(out, until_met, reach, size_by)
    for n in totals[:-1]:
        level = [run(p, d) for p, d in pairs if p + d == n]
        out.extend(level)
        if any(good_enough(x) for x in level):
            break
    return out


def _good_enough(
    best_of: Sequence[Prediction], slo: Slo, reach: float, size_by: str
) -> Callable[[Prediction], bool]:
    """What `choose` takes from a candidate, given the candidates `best_of` that set the bar. p90: it meets the
    attainable targets. attainment: it misses no more requests than the fewest any candidate that fails none
    misses, plus `reach` of the replayed requests, and its p90s are within ATTAINMENT_P90_BOUND of the best."""
    if size_by == "attainment":
        fewest = min((p.misses for p in best_of if p.failed == 0), default=0)  # as `attainable`
        # requests that miss the SLO on any size are the same miss however long they wait: without a bound on
        # the p90s, a size that queues them for minutes would count as good as one that serves them in seconds
        bound = attainable(best_of, slo, ATTAINMENT_P90_BOUND - 1.0)
        return lambda p: (
            p.failed == 0 and p.misses <= fewest + math.floor(reach * p.requests) and p.meets(bound)
        )
    target = attainable(best_of, slo, reach)
    return lambda p: p.meets(target)


def attainable(preds: Sequence[Prediction], slo: Slo, reach: float = REACH) -> Slo:
    """The targets the limits allow: each SLO as set, or — where no candidate meets it — `reach` (a fraction)
    above the best p90 any candidate achieves. Prompts too long to prefill within the TTFT target on any number
    of workers make that target unreachable; sizing then asks for the fewest workers that come within `reach` of
    the best the largest cluster can do, not for whichever size the replay's noise puts nearest the SLO."""
    ok = [p for p in preds if p.failed == 0]
    if not ok:
        return slo
    ttft = min(p.ttft_p90_s for p in ok)
    itl = min(p.itl_p90_s for p in ok)
    return Slo(max(slo.ttft_s, ttft * (1 + reach)), max(slo.itl_s, itl * (1 + reach)))


def binding_slo(pred: Prediction, slo: Slo) -> str:
    """The SLO nearest to (or furthest past) its limit for this candidate: the one that sizes the cluster."""
    return "ttft" if pred.ttft_p90_s / slo.ttft_s >= pred.itl_p90_s / slo.itl_s else "itl"


def choose(
    preds: Sequence[Prediction], slo: Slo, reach: float = REACH, size_by: str = "p90"
) -> tuple[Prediction | None, str]:
    """The fewest workers that are good enough (`_good_enough`: by p90, they meet both attainable targets; by
    attainment, they miss no more replayed requests than the best candidate, within `reach`); ties: the most
    headroom. When none is, the one that misses the targets least. Returns it and the binding SLO (against the
    SLO as set)."""
    if not preds:
        return None, "none"
    target = attainable(preds, slo, reach)
    good = _good_enough(preds, slo, reach, size_by)
    meeting = [p for p in preds if good(p)]
    if meeting:
        best = min(
            meeting,
            key=lambda p: (
                p.workers,
                p.misses if size_by == "attainment" else 0,
                max(p.ttft_p90_s / target.ttft_s, p.itl_p90_s / target.itl_s),
            ),
        )
    else:
        best = min(preds, key=lambda p: (round(p.excess(target), 6), p.workers))
    return best, binding_slo(best, slo)


@dataclass
class Damper:
    """Scaling is damped: per pool at most one step per interval, and no step down within `hold_down_s` of
    that pool's last change (a step up is never held: missing the SLO costs more than a worker-minute, the
    asymmetry of Kubernetes' HPA stabilization windows). With `window_s`, a pool steps down only to the largest
    size any decision of the last `window_s` seconds wanted (the HPA's scale-down stabilization window): one
    replay that puts a smaller size within reach by chance does not drain a worker that the next replay wants
    back and that then takes a start-up to return."""

    hold_down_s: float = 30.0
    window_s: float = 0.0
    last_change: dict[str, float] = field(default_factory=dict)
    wanted: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)

    def step(self, pool: str, actual: int, target: int, lo: int, hi: int, now: float) -> int:
        target = min(hi, max(lo, target))
        wanted = self.wanted.setdefault(pool, deque())
        wanted.append((now, target))
        while wanted[0][0] < now - self.window_s:
            wanted.popleft()
        if target < actual:
            target = min(actual, max(t for _, t in wanted))
        if target == actual:
            return actual
        last = self.last_change.get(pool)
        if target < actual and last is not None and now - last < self.hold_down_s:
            return min(hi, max(lo, actual))
        self.last_change[pool] = now
        return actual + (1 if target > actual else -1)


def damp(
    actual: tuple[int, int],
    target: tuple[int, int],
    limits: Limits,
    damper: Damper,
    now: float,
    mode: str = "disagg",
) -> tuple[int, int]:
    before = dict(damper.last_change)
    p = damper.step("prefill", actual[0], target[0], least_prefill(limits, mode), limits.max_prefill, now)
    d = damper.step("decode", actual[1], target[1], limits.min_decode, limits.max_decode, now)

    def undo(pool: str) -> None:
        # the step was not taken: the pool's last change is the one before it (forgetting that one, as until
        # 2026-12-07, let a step down follow a real change without its hold-down)
        if pool in before:
            damper.last_change[pool] = before[pool]
        else:
            damper.last_change.pop(pool, None)

    if limits.max_workers and p + d > limits.max_workers:
        # a step up that the budget cannot hold yet waits for the other pool's step down to land
        if p > actual[0]:
            p = actual[0]
            undo("prefill")
        if d > actual[1] and p + d > limits.max_workers:
            d = actual[1]
            undo("decode")
    return p, d
