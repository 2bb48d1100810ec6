"""`rackserve bench sim`: a workload (same flags as `bench run`) through the simulator, reported like a real run."""

from __future__ import annotations

import argparse
import json

from loadgen.sim.routing import POLICY_NAMES
from services.router.policy import DEFAULT_MODE, MODES


def add_sim_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulated cluster")
    g.add_argument(
        "--profile", default="h200_node", help="a profile name in loadgen/profiles/ or a .json path"
    )
    g.add_argument("--prefill", type=int, default=2, help="prefill workers")
    g.add_argument("--decode", type=int, default=2, help="decode workers")
    g.add_argument("--mode", choices=MODES, default=DEFAULT_MODE, help="the router's mode")
    g.add_argument("--policy", choices=POLICY_NAMES, default="ttft")
    g.add_argument("--max-inflight", type=int, default=1_000_000, help="frontend admission limit")
    g.add_argument(
        "--host-tier",
        action="store_true",
        help="give every worker the profile's host-memory KV tier (as --kv-tier2-bytes does a real worker)",
    )
    g.add_argument(
        "--peer-pull",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the TTFT policy may plan prefix pulls between workers (the router's --peer-pull)",
    )
    g.add_argument(
        "--fail", action="append", default=[], metavar="T_S:WORKER_ID", help="kill a worker at T_S"
    )


def cmd_sim(a: argparse.Namespace) -> int:
    from loadgen import report as rep
    from loadgen.cli import build_workload, grouping_for, write_outputs
    from loadgen.sim.engine import ClusterConfig, simulate
    from loadgen.sim.profile import load_profile

    if a.workload == "text":
        raise ValueError("the simulator needs token-id prompts: use --workload synthetic or mooncake")
    failures = []
    for f in a.fail:
        t, _, wid = f.partition(":")
        failures.append((float(t), wid))
    profile = load_profile(a.profile)
    a.materialize = False
    specs = build_workload(a)
    if a.host_tier and not profile.host_tier_blocks:
        raise ValueError(f"profile {profile.name} has no host tier (host_tier_blocks, host_link)")
    cfg = ClusterConfig(
        a.prefill,
        a.decode,
        a.mode,
        a.policy,
        a.max_inflight,
        failures=failures,
        seed=a.seed,
        host_tier=a.host_tier,
        peer_pull=a.peer_pull,
    )
    results, sim = simulate(specs, profile, cfg)
    name = a.name or f"sim-{profile.name}-{a.mode}-{a.policy}"
    meta = {
        "name": name,
        "kind": "simulated",
        "profile": profile.name,
        "profile_source": profile.source,
        "cluster": {"prefill": a.prefill, "decode": a.decode, "mode": a.mode, "policy": a.policy},
        "route_reasons": dict(sim.route_reasons),
        "kv_moves": dict(sim.kv_moves),
    }
    report = rep.summarize(
        results, rep.Slo(a.slo_ttft_ms / 1000, a.slo_itl_ms / 1000), grouping_for(a, specs), meta
    )
    write_outputs(report, a, name)
    print(f"profile: {profile.name} — {profile.source}; route reasons: {json.dumps(dict(sim.route_reasons))}")
    return 0
