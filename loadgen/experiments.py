"""`make sim`: the simulator's experiments at GPU scale, deterministic, written to bench/results/sim/.

1. Routing policies on the Mooncake FAST'25 synthetic trace (first 1,000 records at full size, H200-node profile,
   4 prefill + 4 decode workers, each with the profile's host KV tier) at the trace's rate and at 2x, in router
   modes auto and disagg (where only the prefill placement differs): goodput under SLO, TTFT p50/p99, prefix hit
   rate, peer pulls and host-tier restores. The TTFT policy (which alone plans peer pulls) also runs with pulls
   off, tiers off, both off, and with a prefill-rate estimate 30% off either way; a last table sets its goodput
   against the best baseline's.
2. Routing's counter-examples (docs/routing.md) as named scenarios:
   hot_prefix_long_queue  A holds the prompt's prefix but has a queue, B is idle and cold (cache-only loses)
   near_vs_far_cache      the prefix is cached on two prefill workers, one across racks (topology matters)
   burst_same_prefix      100 requests with one new prefix at once (min-TTFT scatters it unless queued
                          requests' blocks count as cached)
3. Prefill:decode ratio sweep on 8 workers (disagg, TTFT policy), plus all-aggregated, on the trace at 2x rate.
Profiles are labelled: the GPU ones are written from published figures, not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from typing import Any

from loadgen import report as rep
from loadgen.sim.engine import ClusterConfig, Simulator, block_hashes_for
from loadgen.sim.profile import Profile, load_profile
from loadgen.trace import DEFAULT_TRACE, load_records, mooncake
from loadgen.workload import TOKEN_HI, TOKEN_LO, RequestSpec

OUT = "bench/results/sim"
GPU_SLO = rep.Slo(ttft_s=2.0, itl_p90_s=0.05)
POLICIES = (
    "round_robin",
    "least_loaded",
    "cache_overlap",
    "dynamo_kv",
    "sgl_cache_aware",
    "ttft",
    "ttft_no_pending",
)


def _run(
    specs: list[RequestSpec],
    hashes: list[list[int]],
    profile: Profile,
    cfg: ClusterConfig,
    warm: dict | None = None,
) -> tuple[dict[str, Any], Simulator]:
    sim = Simulator(profile, cfg)
    for wid, hs in (warm or {}).items():
        sim.warm(wid, hs)
    results = sim.run(specs, hashes)
    grouping = rep.Grouping.by_median([s.input_tokens for s in specs], [s.output_tokens for s in specs])
    meta: dict[str, Any] = {"kind": "simulated", "profile": profile.name, "profile_source": profile.source}
    meta["cluster"] = {"prefill": cfg.prefill_workers, "decode": cfg.decode_workers, "mode": cfg.mode}
    meta["policy"], meta["route_reasons"] = cfg.policy, dict(sim.route_reasons)
    return rep.summarize(results, GPU_SLO, grouping, meta), sim


def _row(label: str, r: dict[str, Any]) -> str:
    o = r["overall"]
    hit = o["prefix_hit_rate"] or 0.0
    return (
        f"| {label} | {o['goodput_requests_per_s']:.2f} ({o['slo_attainment']:.0%}) | "
        f"{o['ttft_s']['p50'] * 1000:.0f} | {o['ttft_s']['p99'] * 1000:.0f} | {o['itl_s']['p90'] * 1000:.1f} | "
        f"{hit:.1%} | {(o['phase_mean_s']['transfer'] or 0) * 1000:.1f} | {o['errors']} |"
    )


HEAD = "| {} | goodput req/s (SLO met) | TTFT p50 ms | TTFT p99 ms | ITL p90 ms | prefix hit | KV transfer ms (mean) "
HEAD += "| errors |\n|---|---|---|---|---|---|---|---|"


TRACE_HEAD = (
    HEAD.replace("| errors |\n", "| errors | peer pulls (blocks) | host-tier restored blocks |\n")
    + "---|---|"
)
BASELINES = POLICIES[:5]
# (label, policy, rate error, host tier, peer pulls): every run has the profile's host tier on each simulated
# worker (tiers are the workers'; the baselines keep their placement rule over the same workers), except the
# ablations that say so; only the TTFT policy plans peer pulls.
TRACE_RUNS: tuple[tuple[str, str, float, bool, bool], ...] = (
    *((p, p, 1.0, True, False) for p in BASELINES),
    ("ttft", "ttft", 1.0, True, True),
    ("ttft_no_pending", "ttft_no_pending", 1.0, True, True),
    ("ttft, pulls off", "ttft", 1.0, True, False),
    ("ttft, tiers off", "ttft", 1.0, False, True),
    ("ttft, pulls and tiers off", "ttft", 1.0, False, False),
    ("ttft (rate est. +30%)", "ttft", 1.3, True, True),
    ("ttft (rate est. -30%)", "ttft", 0.7, True, True),
)
TRACE_LOADS = ((1.0, "auto"), (2.0, "auto"), (1.0, "disagg"), (2.0, "disagg"))
SWEEP_LOADS = (1.6, 1.8, 1.9, 2.0, 2.1, 2.2)


def trace_policies(out: list[str], reports: dict, trace_path: str, limit: int | None) -> None:
    prof = load_profile("h200_node")
    base = mooncake(load_records(trace_path, limit), scale=1, materialize=False)
    t0 = time.time()
    hashes = block_hashes_for(base, prof.block_size)
    print(f"hashed {len(base)} trace requests in {time.time() - t0:.1f}s")
    span = max(s.arrival_s for s in base) - min(s.arrival_s for s in base)
    # auto: every policy may also prefill on a decode worker (the baselines by the router's prompt-length
    # threshold, ttft by its estimate); disagg: every prompt goes to the prefill pool, so only placement differs
    verdicts = []
    for rate, mode in TRACE_LOADS:
        specs = [replace(s, arrival_s=s.arrival_s / rate) for s in base]
        offered = len(specs) / (span / rate)
        out.append(
            f"\n**Mooncake trace ({len(specs)} requests) at {rate:g}x its rate, {prof.name}, 4 prefill + 4 decode, "
            f"mode {mode}, host KV tier on every worker** — SLO TTFT ≤ {GPU_SLO.ttft_s:g} s, "
            f"ITL p90 ≤ {GPU_SLO.itl_p90_s * 1000:g} ms; offered {offered:.2f} req/s (the ceiling of goodput)\n"
        )
        out.append(TRACE_HEAD.format("policy"))
        goodput: dict[str, float] = {}
        for label, policy, err, tier, pull in TRACE_RUNS:
            cfg = ClusterConfig(4, 4, mode, policy, rate_error=err, host_tier=tier, peer_pull=pull)
            r, sim = _run(specs, hashes, prof, cfg)
            moves = dict(sim.kv_moves)
            r["meta"]["kv_moves"] = moves
            r["meta"]["host_tier"], r["meta"]["peer_pull"] = tier, pull
            reports[f"trace_x{rate:g}_{mode}_{label}"] = r
            goodput[label] = r["overall"]["goodput_requests_per_s"]
            out.append(
                _row(label, r)
                + f" {moves.get('pulls', 0)} ({moves.get('pulled_blocks', 0)}) | {moves.get('restored_blocks', 0)} |"
            )
            print(out[-1], flush=True)
        best = max(BASELINES, key=lambda p: goodput[p])
        ratio = goodput["ttft"] / goodput[best] if goodput[best] else float("inf")
        verdicts.append(
            f"| {rate:g}x {mode} | {goodput['ttft']:.2f} | {best} {goodput[best]:.2f} | **{ratio:.2f}x** | "
            f"{goodput['ttft, pulls off']:.2f} | {goodput['ttft, tiers off']:.2f} | "
            f"{goodput['ttft, pulls and tiers off']:.2f} | {offered:.2f} |"
        )
    out.append(
        "\n**TTFT policy (host tier + peer pulls) vs the best baseline (host tier too)**\n\n"
        "| load, mode | ttft goodput req/s | best baseline | ratio | ttft, pulls off | ttft, tiers off | "
        "ttft, both off | offered req/s |\n|---|---|---|---|---|---|---|---|"
    )
    out.extend(verdicts)
    # mode disagg at 2x sits on the saturation cliff: goodput around it, so one point is not read alone
    out.append(
        "\n**Mode disagg around 2x (the saturation cliff)** — goodput req/s, host tier on every worker\n\n"
        "| load | ttft | ttft, pulls off | dynamo_kv | ttft / dynamo_kv |\n|---|---|---|---|---|"
    )
    for rate in SWEEP_LOADS:
        specs = [replace(s, arrival_s=s.arrival_s / rate) for s in base]
        g = []
        for policy, pull in (("ttft", True), ("ttft", False), ("dynamo_kv", False)):
            cfg = ClusterConfig(4, 4, "disagg", policy, host_tier=True, peer_pull=pull)
            r, _ = _run(specs, hashes, prof, cfg)
            reports[f"sweep_x{rate:g}_disagg_{policy}{'' if pull else '_pulls_off'}"] = r
            g.append(r["overall"]["goodput_requests_per_s"])
        out.append(
            f"| {rate:g}x | {g[0]:.2f} | {g[1]:.2f} | {g[2]:.2f} | {g[0] / g[2] if g[2] else 0:.2f}x |"
        )
        print(out[-1], flush=True)


def _prompt(prefix: list[int], n_unique: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return prefix + [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n_unique)]


def scenarios(out: list[str], reports: dict) -> None:
    import random

    rng = random.Random(7)
    hot = [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(8192)]
    h200, nvl = load_profile("h200_node"), load_profile("gb200_nvl72")
    cases: list[tuple[str, str, Profile, dict[str, tuple[str, str]] | None, list[RequestSpec], dict]] = []

    # A vs B: 40 requests share an 8k prefix cached on prefill-0 only, each with 2k tokens of its own, at once
    specs = [
        RequestSpec(f"hot-{i}", 10240, 32, arrival_s=0.01 * i, token_ids=_prompt(hot, 2048, i))
        for i in range(40)
    ]
    warm_a = {"prefill-0": block_hashes_for([specs[0]], h200.block_size)[0][: 8192 // h200.block_size]}
    cases.append(
        ("hot_prefix_long_queue", "A has the prefix and a queue, B is idle", h200, None, specs, warm_a)
    )

    # near vs far: the prefix is on prefill-0 (decode's rack) and prefill-1 (another rack); NVL72 links
    far = {"prefill-0": ("node0", "rack0"), "prefill-1": ("node9", "rack1"), "decode-0": ("node1", "rack0")}
    specs_nf = [
        RequestSpec(f"nf-{i}", 16384 + 64, 32, arrival_s=0.5 * i, token_ids=_prompt(hot + hot, 64, 100 + i))
        for i in range(20)
    ]
    prefix_hashes = block_hashes_for([specs_nf[0]], nvl.block_size)[0][: 16384 // nvl.block_size]
    cases.append(
        ("near_vs_far_cache", "prefix on two prefill workers, one across racks", nvl, far, specs_nf,
         {"prefill-0": prefix_hashes, "prefill-1": prefix_hashes})
    )  # fmt: skip

    # burst: 100 requests with one new 4k prefix within 100 ms, 8 prefill workers, nothing cached
    new = [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(4096)]
    specs_b = [
        RequestSpec(f"burst-{i}", 4096 + 256, 16, arrival_s=0.001 * i, token_ids=_prompt(new, 256, 500 + i))
        for i in range(100)
    ]
    cases.append(("burst_same_prefix", "100 requests, one new prefix, at once", h200, None, specs_b, {}))

    for name, what, prof, placement, specs, warm in cases:
        hashes = block_hashes_for(specs, prof.block_size)
        n_prefill = 8 if name == "burst_same_prefix" else 2
        out.append(f"\n**{name}** — {what} ({prof.name}, {n_prefill} prefill + 1 decode, mode disagg)\n")
        out.append(HEAD.format("policy"))
        for policy in POLICIES:
            cfg = ClusterConfig(n_prefill, 1, "disagg", policy, placement=placement or {})
            r, sim = _run(specs, hashes, prof, cfg, warm)
            reports[f"scenario_{name}_{policy}"] = r
            extra = ""
            if name == "near_vs_far_cache":
                near = sum(1 for q in sim.reqs if q.prefill_worker == "prefill-0")
                extra = f" (near worker chosen {near}/{len(sim.reqs)})"
            out.append(_row(policy + extra, r))
            print(out[-1], flush=True)


def ratio_sweep(out: list[str], reports: dict, trace_path: str, limit: int | None) -> None:
    prof = load_profile("h200_node")
    base = mooncake(load_records(trace_path, limit), scale=1, materialize=False)
    specs = [replace(s, arrival_s=s.arrival_s / 2.0) for s in base]
    hashes = block_hashes_for(specs, prof.block_size)
    out.append("\n**Prefill:decode ratio on 8 H200 workers** — Mooncake trace at 2x rate, TTFT policy\n")
    out.append(HEAD.format("P:D"))
    best = None
    for p in range(1, 8):
        r, _ = _run(specs, hashes, prof, ClusterConfig(p, 8 - p, "disagg", "ttft"))
        reports[f"ratio_{p}:{8 - p}"] = r
        out.append(_row(f"{p}:{8 - p} disagg", r))
        print(out[-1], flush=True)
        g = r["overall"]["goodput_requests_per_s"]
        best = (g, p) if best is None or g > best[0] else best
    for label, cfg in (
        ("8 agg", ClusterConfig(0, 8, "agg", "ttft")),
        ("4:4 auto", ClusterConfig(4, 4, "auto", "ttft")),
    ):
        r, _ = _run(specs, hashes, prof, cfg)
        reports[f"ratio_{label}"] = r
        out.append(_row(label, r))
        print(out[-1], flush=True)
    assert best is not None
    out.append(
        f"\nbest disaggregated ratio for this trace: {best[1]}:{8 - best[1]} ({best[0]:.2f} req/s goodput)"
    )


def plots(reports: dict, out_dir: str) -> None:
    from loadgen.plots import _plt

    plt = _plt()
    for rate in ("1_auto", "2_auto", "1_disagg", "2_disagg"):
        keys = [k for k in reports if k.startswith(f"trace_x{rate}_")]
        if not keys:
            continue
        fig, axes = plt.subplots(1, 3, figsize=(16, 4))
        labels = [k.split("_", 3)[3] for k in keys]
        for ax, (title, get) in zip(
            axes,
            (
                ("goodput req/s", lambda o: o["goodput_requests_per_s"]),
                ("TTFT p99 s", lambda o: o["ttft_s"]["p99"]),
                ("prefix hit rate", lambda o: o["prefix_hit_rate"] or 0),
            ),
            strict=True,
        ):
            ax.bar(labels, [get(reports[k]["overall"]) for k in keys])
            ax.set_title(f"{title} (trace x{rate})")
            ax.tick_params(axis="x", rotation=60, labelsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"policies_x{rate}.png"), dpi=100)
        plt.close(fig)
    keys = [k for k in reports if k.startswith("ratio_") and "disagg" not in k and ":" in k]
    if keys:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(
            [k[6:] for k in keys], [reports[k]["overall"]["goodput_requests_per_s"] for k in keys], marker="o"
        )
        ax.set_xlabel("prefill:decode workers")
        ax.set_ylabel("goodput req/s")
        ax.set_title("P:D ratio sweep (Mooncake x2, H200 profile)")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "ratio_sweep.png"), dpi=100)
        plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description="the simulator's experiments (make sim)")
    p.add_argument("--out", default=OUT)
    p.add_argument("--trace", default=DEFAULT_TRACE)
    p.add_argument("--trace-limit", type=int, default=1000, help="first N records (0: all 3,993)")
    p.add_argument("--only", choices=("policies", "scenarios", "ratio"), default=None)
    a = p.parse_args()
    a.trace_limit = a.trace_limit or None
    os.makedirs(a.out, exist_ok=True)
    out: list[str] = []
    reports: dict[str, Any] = {}
    t0 = time.time()
    if a.only in (None, "scenarios"):
        scenarios(out, reports)
    if a.only in (None, "policies"):
        trace_policies(out, reports, a.trace, a.trace_limit)
    if a.only in (None, "ratio"):
        ratio_sweep(out, reports, a.trace, a.trace_limit)
    plots(reports, a.out)
    summary = "\n".join(out) + f"\n\n(simulated in {time.time() - t0:.0f} s of CPU; deterministic)\n"
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write(summary)
    with open(os.path.join(a.out, "reports.json"), "w") as f:
        json.dump(
            {k: {kk: vv for kk, vv in v.items() if kk != "requests"} for k, v in reports.items()}, f, indent=1
        )
    print(summary)
    print(f"wrote {a.out}/summary.md, reports.json and plots")


if __name__ == "__main__":
    main()
