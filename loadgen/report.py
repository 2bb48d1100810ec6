"""Reports: one set of metrics for a real run and a simulated one, so the two compare side by side.

A run is a list of `RequestResult`s. `summarize` turns it into p50/p90/p99 of TTFT, inter-token gaps and
end-to-end latency, throughput, goodput under an SLO and error counts — overall and for each group of
short/long prompt × short/long output ("don't judge by one average"). The prefix hit rate is cached prompt
tokens over the prompt tokens of the successful requests that report `cached_tokens`. Output: a markdown table, a
JSON file, PNG plots, and `compare_markdown` for two or more runs. This module never talks to a server or a
simulator.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PHASES = ("queue", "prefill", "transfer", "decode")
GROUPS = ("short_in/short_out", "short_in/long_out", "long_in/short_out", "long_in/long_out")


@dataclass
class RequestResult:
    """What one request did. Times are seconds; `start_s` is relative to the run's start."""

    request_id: str
    input_tokens: int
    output_tokens: int  # tokens actually received
    requested_output_tokens: int
    start_s: float
    ok: bool
    status: int = 200
    error: str | None = None
    ttft_s: float | None = None
    # one gap per token after the first: a chunk of k tokens after a gap g gives k gaps of g/k (client.token_gaps)
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    server_request_id: str | None = None
    phases_s: dict[str, float] | None = None  # queue/prefill/transfer/decode, when the server reports them
    cached_tokens: int | None = None

    def itl_p90_s(self) -> float | None:
        return percentile(self.itl_s, 90) if self.itl_s else None


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0
    itl_p90_s: float = 0.2

    def met_by(self, r: RequestResult) -> bool:
        if not r.ok or r.ttft_s is None or r.ttft_s > self.ttft_s:
            return False
        p90 = r.itl_p90_s()
        return p90 is None or p90 <= self.itl_p90_s  # a one-token answer has no gap to miss the SLO with


@dataclass(frozen=True)
class Grouping:
    """A prompt is long when it has more than `long_input_tokens`; an output when more than `long_output_tokens`."""

    long_input_tokens: int
    long_output_tokens: int

    def of(self, r: RequestResult) -> str:
        i = "long_in" if r.input_tokens > self.long_input_tokens else "short_in"
        o = "long_out" if r.requested_output_tokens > self.long_output_tokens else "short_out"
        return f"{i}/{o}"

    @staticmethod
    def by_median(input_tokens: Sequence[int], output_tokens: Sequence[int]) -> Grouping:
        """Split at the workload's medians (planned lengths), so the same workload groups the same in every run."""
        return Grouping(int(percentile(input_tokens, 50)), int(percentile(output_tokens, 50)))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _dist(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values),
    }


def _stats(results: Sequence[RequestResult], duration_s: float, slo: Slo) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    good = [r for r in results if slo.met_by(r)]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_tokens for r in ok)
    phases: dict[str, float | None] = {}
    with_phases = [r.phases_s for r in ok if r.phases_s]
    for p in PHASES:
        vals = [ph[p] for ph in with_phases if p in ph]
        phases[p] = sum(vals) / len(vals) if vals else None
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = str(r.status) if r.status else "client"
            errors[key] = errors.get(key, 0) + 1
    # The hit rate is over the requests that report cached_tokens: a server that leaves it out of some answers
    # says nothing about their prompts, which would otherwise count as misses.
    reporting = [r for r in ok if r.cached_tokens is not None]
    cached_tokens = sum(r.cached_tokens or 0 for r in reporting)
    reporting_in_tokens = sum(r.input_tokens for r in reporting)
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "errors_by_status": errors,
        "ttft_s": _dist([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": _dist([g for r in ok for g in r.itl_s]),
        "e2e_s": _dist([r.e2e_s for r in ok if r.e2e_s is not None]),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "requests_per_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_tokens_per_s": out_tokens / duration_s if duration_s > 0 else 0.0,
        "goodput_requests_per_s": len(good) / duration_s if duration_s > 0 else 0.0,
        "slo_attainment": len(good) / len(results) if results else 0.0,
        "prefix_hit_rate": cached_tokens / reporting_in_tokens if reporting_in_tokens else None,
        "phase_mean_s": phases,
    }


def run_duration_s(results: Sequence[RequestResult]) -> float:
    """From the first request's start to the last one's end."""
    if not results:
        return 0.0
    start = min(r.start_s for r in results)
    end = max(r.start_s + (r.e2e_s or 0.0) for r in results)
    return end - start


def summarize(
    results: Sequence[RequestResult],
    slo: Slo,
    grouping: Grouping,
    meta: dict[str, Any] | None = None,
    duration_s: float | None = None,
) -> dict[str, Any]:
    """The report of one run: overall and per-group stats, the settings that shaped them, and every request."""
    duration = run_duration_s(results) if duration_s is None else duration_s
    groups = {g: _stats([r for r in results if grouping.of(r) == g], duration, slo) for g in GROUPS}
    return {
        "meta": meta or {},
        "slo": asdict(slo),
        "grouping": asdict(grouping),
        "duration_s": duration,
        "overall": _stats(results, duration, slo),
        "groups": groups,
        "requests": [asdict(r) for r in results],
    }


def save_json(report: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def load_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


# ---- markdown --------------------------------------------------------------------------------------------------


def _ms(x: float | None) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1000:.0f}"


def _row(name: str, s: dict[str, Any]) -> str:
    t, i, e = s["ttft_s"], s["itl_s"], s["e2e_s"]
    hit = "–" if s["prefix_hit_rate"] is None else f"{s['prefix_hit_rate']:.0%}"
    return (
        f"| {name} | {s['requests']} | {s['errors']} | {_ms(t['p50'])} / {_ms(t['p90'])} / {_ms(t['p99'])} | "
        f"{_ms(i['p50'])} / {_ms(i['p90'])} / {_ms(i['p99'])} | {_ms(e['p50'])} / {_ms(e['p99'])} | "
        f"{s['requests_per_s']:.2f} | {s['output_tokens_per_s']:.1f} | {s['goodput_requests_per_s']:.2f} "
        f"({s['slo_attainment']:.0%}) | {hit} |"
    )


_HEADER = (
    "| group | n | err | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | e2e p50/p99 ms | req/s | out tok/s "
    "| goodput req/s (SLO met) | prefix hit |\n|---|---|---|---|---|---|---|---|---|---|"
)


def to_markdown(report: dict[str, Any], title: str | None = None) -> str:
    slo, g = report["slo"], report["grouping"]
    lines = []
    if title:
        lines.append(f"### {title}\n")
    lines.append(
        f"SLO: TTFT ≤ {slo['ttft_s'] * 1000:.0f} ms and ITL p90 ≤ {slo['itl_p90_s'] * 1000:.0f} ms; "
        f"long prompt > {g['long_input_tokens']} tokens, long output > {g['long_output_tokens']} tokens; "
        f"duration {report['duration_s']:.1f} s\n"
    )
    lines.append(_HEADER)
    lines.append(_row("**all**", report["overall"]))
    for name, s in report["groups"].items():
        if s["requests"]:
            lines.append(_row(name, s))
    ph = report["overall"]["phase_mean_s"]
    if any(v is not None for v in ph.values()):
        lines.append("\nmean phase time (ms): " + ", ".join(f"{p} {_ms(ph[p])}" for p in PHASES))
    return "\n".join(lines) + "\n"


def compare_markdown(reports: Sequence[dict[str, Any]], names: Sequence[str]) -> str:
    """Runs side by side: one row per (group, run), plus each run's ratio to the first on the headline numbers."""
    lines = [_HEADER]
    for group in ("overall", *GROUPS):
        for name, rep in zip(names, reports, strict=True):
            s = rep["overall"] if group == "overall" else rep["groups"][group]
            if s["requests"]:
                label = "all" if group == "overall" else group
                lines.append(_row(f"{label} · {name}", s))
    base = reports[0]["overall"]
    lines.append(f"\nratios to `{names[0]}` (all requests):\n")
    lines.append("| run | TTFT p50 | TTFT p99 | ITL p50 | out tok/s | goodput |\n|---|---|---|---|---|---|")
    for name, rep in zip(names, reports, strict=True):
        s = rep["overall"]

        def ratio(a: float | None, b: float | None) -> str:
            # A zero (a run with no goodput) is a ratio of 0.00×; only a missing value or a zero base has none.
            return "–" if a is None or b is None or b == 0 else f"{a / b:.2f}×"

        lines.append(
            f"| {name} | {ratio(s['ttft_s']['p50'], base['ttft_s']['p50'])} | "
            f"{ratio(s['ttft_s']['p99'], base['ttft_s']['p99'])} | "
            f"{ratio(s['itl_s']['p50'], base['itl_s']['p50'])} | "
            f"{ratio(s['output_tokens_per_s'], base['output_tokens_per_s'])} | "
            f"{ratio(s['goodput_requests_per_s'], base['goodput_requests_per_s'])} |"
        )
    return "\n".join(lines) + "\n"
