"""`make bench-cluster`: aggregated vs disaggregated on the real CPU cluster, and the simulator's prediction of
the same runs with the measured CPU profile — predicted vs measured TTFT and throughput.

  python -m loadgen.validate [--out bench/results/cluster] [--requests 30] [--profile cpu_smollm2]

The workload is a slice of the Mooncake trace scaled for SmolLM2 (512-token blocks → 16 tokens, outputs capped),
prompts sent as token ids to /v1/completions, arrivals at the trace's timestamps slowed by --time-scale. Both
clusters have two workers: agg = 2 decode workers that prefill; disagg = 1 prefill + 1 decode worker. The real
router's policy (ttft) and the simulator's are the same object. The machine's 2 cores are shared, so measured
numbers are noisy and preliminary; re-measure the profile (python -m loadgen.measure_profile) before trusting
a comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

from loadgen import report as rep
from loadgen.client import LoadGenerator, RunConfig
from loadgen.local import rackserve_up
from loadgen.sim.engine import ClusterConfig, simulate
from loadgen.sim.profile import load_profile
from loadgen.trace import DEFAULT_TRACE, load_records, mooncake
from loadgen.workload import RequestSpec

MODEL = "SmolLM2-135M-Instruct"
CPU_SLO = rep.Slo(ttft_s=5.0, itl_p90_s=0.5)
CLUSTERS = {
    "agg": (("--prefill", "0", "--decode", "2", "--mode", "agg"), ClusterConfig(0, 2, "agg", "ttft")),
    "disagg": (
        ("--prefill", "1", "--decode", "1", "--mode", "disagg"),
        ClusterConfig(1, 1, "disagg", "ttft"),
    ),
}


def workload(n: int, time_scale: float, max_input_tokens: int, max_output_tokens: int) -> list[RequestSpec]:
    records = [r for r in load_records(DEFAULT_TRACE) if 2048 <= r["input_length"] <= max_input_tokens * 32][
        :n
    ]
    t0 = records[0]["timestamp"]
    for r in records:
        r["timestamp"] -= t0
    return mooncake(
        records, scale=32, output_scale=8, time_scale=time_scale, max_output_tokens=max_output_tokens
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/cluster")
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--time-scale", type=float, default=0.5, help="stretch the trace's arrival times")
    p.add_argument("--max-input-tokens", type=int, default=384)
    p.add_argument("--max-output-tokens", type=int, default=16)
    p.add_argument("--profile", default="cpu_smollm2")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    specs = workload(a.requests, a.time_scale, a.max_input_tokens, a.max_output_tokens)
    grouping = rep.Grouping.by_median([s.input_tokens for s in specs], [s.output_tokens for s in specs])
    profile = load_profile(a.profile)
    reports: dict[str, dict] = {}
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for name, (flags, cfg) in CLUSTERS.items():
        with rackserve_up(*flags, log_path=os.path.join(a.out, f"{name}_up.log")) as url:
            run = RunConfig(url=url, model=MODEL, mode="open", request_timeout_s=600.0)
            results, wall_s = asyncio.run(LoadGenerator(run).run(specs))
        meta: dict[str, Any] = {
            "name": f"measured {name}",
            "kind": "measured",
            "when": when,
            "cluster": list(flags),
        }
        reports[f"measured {name}"] = rep.summarize(results, CPU_SLO, grouping, meta)
        sim_results, sim = simulate(specs, profile, cfg)
        meta = {
            "name": f"simulated {name}",
            "kind": "simulated",
            "profile": profile.name,
            "source": profile.source,
        }
        meta["route_reasons"] = dict(sim.route_reasons)
        reports[f"simulated {name}"] = rep.summarize(sim_results, CPU_SLO, grouping, meta)
    names = list(reports)
    for n, r in reports.items():
        d = os.path.join(a.out, n.replace(" ", "_"))
        os.makedirs(d, exist_ok=True)
        rep.save_json(r, os.path.join(d, "report.json"))
    lines = [
        f"Real CPU cluster vs simulator ({len(specs)} Mooncake requests scaled 1/32, {when}; "
        f"load average {os.getloadavg()[0]:.1f})\n"
    ]
    lines.append(rep.compare_markdown([reports[n] for n in names], names))
    lines.append("\nPredicted (simulated) vs measured:\n")
    lines.append(
        "| cluster | TTFT p50 sim/real | TTFT p90 sim/real | e2e p50 sim/real | out tok/s sim/real |"
    )
    lines.append("|---|---|---|---|---|")
    for c in CLUSTERS:
        s, m = reports[f"simulated {c}"]["overall"], reports[f"measured {c}"]["overall"]

        def pair(a: float | None, b: float | None, scale: float = 1000.0, fmt: str = ".0f") -> str:
            if not a or not b:
                return "–"
            return f"{a * scale:{fmt}} / {b * scale:{fmt}} ({a / b:.2f}×)"

        lines.append(
            f"| {c} | {pair(s['ttft_s']['p50'], m['ttft_s']['p50'])} | {pair(s['ttft_s']['p90'], m['ttft_s']['p90'])} "
            f"| {pair(s['e2e_s']['p50'], m['e2e_s']['p50'])} "
            f"| {pair(s['output_tokens_per_s'], m['output_tokens_per_s'], 1.0, '.1f')} |"
        )
    summary = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write(summary)
    from loadgen.plots import all_plots

    all_plots([reports[n] for n in names], names, a.out, "agg_vs_disagg")
    print(summary)
    print(f"wrote {a.out}/summary.md and plots")


if __name__ == "__main__":
    main()
