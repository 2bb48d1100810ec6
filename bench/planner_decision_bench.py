"""What one planner decision costs: the replay of a measured window through every candidate (P, D).

    python -m bench.planner_decision_bench [--repeats 3]

The window is the first 200 requests of the Mooncake trace (loadgen/traces), described as the planner's
observation describes it (their rate and their prompt and output lengths), replayed by `plan.evaluate` through
every candidate within `--max-prefill` x `--max-decode` of 2, 4 (the defaults) and 8, at `--replay-requests`
50 and 200 (the default), on the h200_node profile, against the planner's default SLO. The observation carries
no prefix hits, so the replay shares no prefixes: what the planner's replay process spends per
`--interval-s`, on one core. The decision's own seconds are the replay's; scraping and publishing are
milliseconds. Writes bench/results/planner_decision.md. Benchmarks never assert; this one reports.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.report import publish
from loadgen.sim.profile import load_profile
from loadgen.trace import load_records, mooncake
from services.planner.plan import Limits, Observation, Slo, candidates, evaluate

WINDOW = 200


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="decisions timed per row (the median is reported)")
    args = ap.parse_args()
    profile = load_profile("h200_node")
    specs = mooncake(load_records(limit=WINDOW), scale=1, materialize=False)
    ins, outs = [s.input_tokens for s in specs], [s.output_tokens for s in specs]
    obs = Observation(
        window_s=specs[-1].arrival_s - specs[0].arrival_s, requests=len(specs), input_tokens=[],
        output_tokens=[], prompt_tokens=sum(ins), generation_tokens=sum(outs), input_samples=ins,
        output_samples=outs,
    )  # fmt: skip
    rows = []
    for most in (2, 4, 8):
        pairs = candidates(Limits(1, most, 1, most))
        for replayed in (50, 200):
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                evaluate(obs, profile, pairs, "disagg", 0, replayed, slo=Slo(2.0, 0.1))
                times.append(time.perf_counter() - t)
            rows.append((most, len(pairs), replayed, statistics.median(times)))
            print(rows[-1], flush=True)
    lines = [
        "# One planner decision",
        "",
        f"`python -m bench.planner_decision_bench --repeats {args.repeats}` — a {WINDOW}-request window of the "
        f"Mooncake trace ({obs.rate_rps:.2f} req/s) replayed through every candidate on the h200_node profile, "
        "one core; the median of the repeats.",
        "",
        "| `--max-prefill` = `--max-decode` | candidates | `--replay-requests` | seconds a decision |",
        "|---|---|---|---|",
        *(f"| {m} | {n} | {r} | {s:.2f} |" for m, n, r, s in rows),
    ]
    publish(lines, "planner_decision.md")


if __name__ == "__main__":
    main()
