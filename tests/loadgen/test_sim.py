"""The simulator: deterministic by seed, and it moves the right way when the cluster changes."""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import pytest

from loadgen import report as rep
from loadgen.sim.engine import ClusterConfig, block_hashes_for, simulate
from loadgen.sim.profile import PROFILE_DIR, load_profile
from loadgen.workload import Lengths, poisson_arrivals, synthetic
from services.engine.block_hash import block_hashes

SLO = rep.Slo(ttft_s=1.0, itl_p90_s=0.05)


def _summary(results):
    return rep.summarize(results, SLO, rep.Grouping(1000, 100))


def _shared_prefix_load(n=120, rate=40.0, seed=3):
    specs = synthetic(
        n, Lengths(2048, 4096), Lengths(32, 128), seed, shared_prefix_tokens=1536, prefix_groups=8
    )
    return poisson_arrivals(specs, rate, seed)


def test_same_seed_gives_identical_results_and_another_seed_does_not():
    prof = load_profile("h200_node")
    cfg = ClusterConfig(prefill_workers=2, decode_workers=2, policy="ttft", failures=[(2.0, "decode-1")])
    a, _ = simulate(_shared_prefix_load(seed=5), prof, cfg)
    b, _ = simulate(_shared_prefix_load(seed=5), prof, cfg)
    c, _ = simulate(_shared_prefix_load(seed=6), prof, cfg)
    assert json.dumps(_summary(a)) == json.dumps(_summary(b))
    assert json.dumps(_summary(a)) != json.dumps(_summary(c))


def test_more_decode_workers_lower_inter_token_latency():
    prof = load_profile("h200_node")
    specs = poisson_arrivals(synthetic(300, Lengths(512, 1024), Lengths(100, 200), 1), 60.0, 1)
    hashes = block_hashes_for(specs, prof.block_size)
    itl = {}
    for n in (1, 4):
        results, _ = simulate(specs, prof, ClusterConfig(2, n, "disagg", "least_loaded"), hashes)
        itl[n] = _summary(results)["overall"]["itl_s"]["p50"]
    assert itl[4] < itl[1] * 0.8, itl


def test_cache_aware_policies_raise_prefix_hit_rate_on_a_shared_prefix_workload():
    # 7 system prompts over 4 prefill workers whose caches hold about two of them: round-robin makes every worker
    # see every prompt and thrash; a cache-aware policy keeps each prompt on one worker
    prof = dataclasses.replace(load_profile("h200_node"), kv_capacity_blocks=100)
    specs = synthetic(
        140, Lengths(1700, 2000), Lengths(16, 32), 3, shared_prefix_tokens=1536, prefix_groups=7
    )
    specs = poisson_arrivals(specs, 10.0, 3)
    hashes = block_hashes_for(specs, prof.block_size)
    hit = {}
    for policy in ("round_robin", "cache_overlap", "ttft"):
        results, _ = simulate(specs, prof, ClusterConfig(4, 2, "disagg", policy), hashes)
        hit[policy] = _summary(results)["overall"]["prefix_hit_rate"]
    assert hit["cache_overlap"] > hit["round_robin"] + 0.1, hit
    assert hit["ttft"] > hit["round_robin"] + 0.1, hit


def test_disaggregation_removes_prefill_stalls_from_inter_token_gaps():
    prof = load_profile("h200_node")
    specs = poisson_arrivals(synthetic(150, Lengths(4000, 8000), Lengths(64, 128), 2), 6.0, 2)
    hashes = block_hashes_for(specs, prof.block_size)
    agg, _ = simulate(specs, prof, ClusterConfig(0, 4, "agg", "least_loaded"), hashes)
    dis, _ = simulate(specs, prof, ClusterConfig(2, 2, "disagg", "least_loaded"), hashes)
    assert _summary(dis)["overall"]["itl_s"]["p99"] < _summary(agg)["overall"]["itl_s"]["p99"]


def test_decode_worker_failure_migrates_its_requests_and_every_request_completes_once():
    prof = load_profile("h200_node")
    specs = poisson_arrivals(synthetic(100, Lengths(256, 1024), Lengths(100, 200), 4), 40.0, 4)
    results, sim = simulate(
        specs, prof, ClusterConfig(1, 2, "disagg", "round_robin", failures=[(2.0, "decode-0")])
    )
    assert all(r.ok for r in results)
    assert all(r.output_tokens == r.requested_output_tokens for r in results)  # no token lost or repeated
    migrated = [r for r in sim.reqs if r.migrations]
    assert migrated and all(r.decode_worker == "decode-1" for r in migrated)


def test_losing_every_decode_worker_fails_requests_with_a_reason():
    prof = load_profile("h200_node")
    specs = poisson_arrivals(synthetic(50, Lengths(256, 512), Lengths(200, 300), 4), 40.0, 4)
    results, _ = simulate(
        specs, prof, ClusterConfig(1, 1, "disagg", "round_robin", failures=[(0.5, "decode-0")])
    )
    failed = [r for r in results if not r.ok]
    assert failed and all("no live decode worker" in (r.error or "") for r in failed)


def test_simulator_hashes_prompts_with_the_engines_block_hash():
    specs = synthetic(5, Lengths(40, 90), Lengths(4, 4), 0)
    assert block_hashes_for(specs, 16) == [block_hashes(s.token_ids, 16) for s in specs]


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(PROFILE_DIR, "*.json"))))
def test_every_profile_loads_and_says_where_its_numbers_come_from(path):
    prof = load_profile(path)
    assert prof.source.startswith(("measured", "published figures")), prof.source
    assert prof.prefill_s(512, 0) > 0 and prof.decode_step_s(8, 4096) > 0
    assert prof.transfer_s(1 << 30, "same_zone") >= prof.transfer_s(1 << 30, "same_node")
