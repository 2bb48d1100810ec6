"""What the planner reads: the Prometheus text the frontend and every worker already serve, as window deltas.

The frontend's `/metrics` gives the traffic (requests per window, prompt and output lengths per request as
histograms, cached prompt tokens, TTFT and ITL histograms); each worker's (its `metrics_endpoint` in etcd)
gives its queue, KV usage, batch size, decode step times and the prompt tokens it computed per busy second.
Counters are cumulative, so a window is the difference of two scrapes; a source seen for the first time, or
one whose counters went down (restarted), counts from zero.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from services.planner.plan import Buckets, Observation
from services.telemetry import metrics as m

# (sample name, sorted label pairs) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


# the samples that only ever grow in a living process: counters and a histogram's buckets, count and sum
_MONOTONIC = ("_total", "_count", "_sum", "_bucket")


def delta(cur: Samples, prev: Samples | None) -> Samples:
    """cur - prev for every sample; a source whose counters went backwards restarted: count from zero. Only
    counters tell: a gauge (requests in flight, KV usage) goes down in every quiet moment, and taking that for a
    restart would make the window the source's whole life (a frontend's every request in one 3 s window)."""
    if prev is None:
        return dict(cur)
    out = {k: v - prev.get(k, 0.0) for k, v in cur.items()}
    if any(v < 0 for k, v in out.items() if k[0].endswith(_MONOTONIC)):
        return dict(cur)
    return out


def _sum(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lb), v in samples.items() if n == name and want <= set(lb))


def buckets(samples: Samples, name: str, **labels: str) -> Buckets:
    """A histogram's delta as (upper bound, count in bucket), from its cumulative `_bucket{le}` samples."""
    want = set(labels.items())
    cum: dict[float, float] = defaultdict(float)
    for (n, lb), v in samples.items():
        if n == f"{name}_bucket" and want <= set(lb):
            bound = dict(lb)["le"]
            cum[math.inf if bound in ("+Inf", "inf") else float(bound)] += v
    out: Buckets = []
    below = 0.0
    for le in sorted(cum):
        out.append((le, max(0.0, cum[le] - below)))
        below = max(below, cum[le])
    return out


def quantile(hist: Buckets, q: float) -> float | None:
    """Like PromQL's histogram_quantile: linear inside the bucket the rank falls in."""
    total = sum(c for _, c in hist)
    if total <= 0:
        return None
    rank, lo, seen = q * total, 0.0, 0.0
    for hi, c in hist:
        if seen + c >= rank and c > 0:
            if math.isinf(hi):
                return lo
            return lo + (hi - lo) * (rank - seen) / c
        seen += c
        lo = hi if math.isfinite(hi) else lo
    return lo


def _hist_name(metric: Any) -> str:
    return str(metric._name)  # the name metrics.py gave it, without the _total/_bucket suffixes


def observation(
    frontend: Samples, workers: Mapping[str, tuple[str, Samples, Samples]], window_s: float
) -> Observation:
    """One window from the frontend's deltas and, per worker id, (role, deltas, current gauges)."""
    out_name = _hist_name(m.OUTPUT_TOKENS_PER_REQUEST)
    in_name = _hist_name(m.PROMPT_TOKENS_PER_REQUEST)
    arrived = int(round(_sum(frontend, f"{in_name}_count")))  # observed at admission: the demand
    finished = int(round(_sum(frontend, f"{out_name}_count")))  # observed when a request ends
    ttft = buckets(frontend, _hist_name(m.TTFT_S))
    itl = buckets(frontend, _hist_name(m.INTER_TOKEN_S))
    obs = Observation(
        window_s=window_s,
        requests=arrived,
        finished=finished,
        input_tokens=buckets(frontend, in_name),
        output_tokens=buckets(frontend, out_name),
        prompt_tokens=_sum(frontend, f"{in_name}_sum"),
        generation_tokens=_sum(frontend, f"{out_name}_sum"),
        cached_tokens=_sum(frontend, f"{_hist_name(m.CACHED_PROMPT_TOKENS)}_total"),  # counted at the finish
        ttft_p90_s=quantile(ttft, 0.9),
        itl_p90_s=quantile(itl, 0.9),
    )
    waiting: dict[str, float] = defaultdict(float)
    kv: dict[str, list[float]] = defaultdict(list)
    computed = busy = steps = step_s = 0.0
    batches: list[float] = []
    queries_name = f"{_hist_name(m.PREFIX_CACHE_QUERIES)}_total"
    hits_name = f"{_hist_name(m.PREFIX_CACHE_HITS)}_total"
    for role, d, now in workers.values():
        waiting[role] += _sum(now, m.REQUESTS_WAITING)
        kv[role].append(_sum(now, m.KV_USAGE_RATIO))
        if role == "prefill":
            computed += _sum(d, queries_name, role="prefill") - _sum(d, hits_name, role="prefill")
            # a worker's engine steps run one after another, so their seconds are its busy time
            busy += _sum(d, f"{_hist_name(m.ENGINE_STEP_S)}_sum", role="prefill")
        if role == "decode":
            steps += _sum(d, f"{_hist_name(m.ENGINE_STEP_S)}_count", role="decode")
            step_s += _sum(d, f"{_hist_name(m.ENGINE_STEP_S)}_sum", role="decode")
            batches.append(_sum(now, m.BATCH_SIZE))
    obs.waiting = dict(waiting)
    obs.backlog = int(round(sum(waiting.values())))
    obs.kv_usage = {role: sum(v) / len(v) for role, v in kv.items() if v}
    if computed > 0 and busy > 0:
        obs.prefill_tokens_per_s = computed / busy
    if steps > 0:
        obs.decode_step_s = step_s / steps
        obs.decode_batch = max(1.0, sum(batches) / len(batches)) if batches else None
    return obs
