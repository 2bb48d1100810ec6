"""The simulator: deterministic by seed, and it moves the right way when the cluster changes."""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import pytest

from loadgen import report as rep
from loadgen.sim.engine import ClusterConfig, Simulator, block_hashes_for, simulate
from loadgen.sim.profile import PROFILE_DIR, load_profile
from loadgen.workload import Lengths, poisson_arrivals, synthetic
from services.engine.block_hash import block_hashes
from services.router.cost_model import SAME_NODE

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


# ---- KV tiers and peer pulls -------------------------------------------------------------------------------------


def _tokens(rng, n):
    from loadgen.workload import TOKEN_HI, TOKEN_LO

    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


def test_a_worker_with_a_host_tier_restores_an_evicted_prefix_instead_of_recomputing_it():
    # one aggregated worker whose pool holds ~2 prompts: a 16 k-token conversation, 6 other prompts that push it
    # out of the pool, then the conversation's next turn
    import random

    from loadgen.workload import RequestSpec

    prof = dataclasses.replace(load_profile("h200_node"), kv_capacity_blocks=600)
    rng = random.Random(11)
    first = _tokens(rng, 16384)
    specs = [RequestSpec("turn-1", 16384, 8, arrival_s=0.0, token_ids=first)]
    specs += [
        RequestSpec(f"other-{i}", 16384, 8, arrival_s=1.0 + i, token_ids=_tokens(rng, 16384))
        for i in range(6)
    ]
    specs.append(RequestSpec("turn-2", 16384 + 512, 8, arrival_s=10.0, token_ids=first + _tokens(rng, 512)))
    hashes = block_hashes_for(specs, prof.block_size)
    out = {}
    for tier in (False, True):
        results, sim = simulate(specs, prof, ClusterConfig(0, 1, "agg", "ttft", host_tier=tier), hashes)
        out[tier] = ({r.request_id: r for r in results}["turn-2"], sim)
    cold, (warm, sim) = out[False][0], out[True]
    assert cold.ok and warm.ok
    assert cold.cached_tokens == 0  # without a tier the pool lost the conversation: all recomputed
    assert warm.cached_tokens == 16384  # with it, every block of the first turn came back from the host tier
    assert sim.kv_moves["restored_blocks"] == 16384 // prof.block_size
    assert warm.ttft_s < cold.ttft_s * 0.5
    # the router's index heard it: the blocks are in the worker's pool again, and its tier no longer holds them
    pool = sim.router.index.overlaps(hashes[-1])
    assert pool["decode-0"] >= 16384 // prof.block_size
    assert sim.router.index.tier_runs(hashes[-1], {}).get("decode-0", (0, 0))[0] == 0


def test_a_prompt_on_a_full_pool_keeps_its_own_cached_prefix():
    # the pool (100 blocks) is full of cached blocks, the prompt's 60-block prefix the least recent of them; the
    # prompt needs 90 blocks: the 30 new ones push other blocks out, never the prefix it is about to use
    import random

    from loadgen.workload import RequestSpec

    prof = dataclasses.replace(load_profile("h200_node"), kv_capacity_blocks=100)
    bs = prof.block_size
    rng = random.Random(7)
    prefix, other = _tokens(rng, 60 * bs), _tokens(rng, 40 * bs)
    spec = RequestSpec("long", 90 * bs, 4, arrival_s=0.0, token_ids=prefix + _tokens(rng, 30 * bs))
    hashes = block_hashes_for([spec], bs)
    sim = Simulator(prof, ClusterConfig(1, 1, "disagg", "ttft"))
    sim.warm("prefill-0", hashes[0][:60])  # first: the least recently used
    sim.warm("prefill-0", block_hashes(other, bs))
    (result,) = sim.run([spec], hashes)
    assert result.ok
    assert result.cached_tokens == 60 * bs
    w = sim.workers["prefill-0"]
    assert w.match(hashes[0]) == 90  # the whole prompt is cached there now
    assert w.used == 0 and len(w.cache) == 90 + 10  # 30 of the other blocks made room


def test_a_full_pool_evicts_a_cached_prompt_from_its_tail_so_its_head_still_hits():
    # as the engine's KvCache frees a request's blocks (last first): the eviction that makes room takes the end
    # of the least recent prompt, and a lookup of that prompt still finds the rest of its chain
    prof = dataclasses.replace(load_profile("h200_node"), kv_capacity_blocks=8)
    sim = Simulator(prof, ClusterConfig(1, 1, "disagg", "ttft"))
    w = sim.workers["prefill-0"]
    older, newer = [10, 11, 12, 13, 14, 15], [20, 21]
    sim.warm("prefill-0", older)
    sim.warm("prefill-0", newer)  # the pool is full
    assert w.allocate(1)  # another request's block
    assert w.match(older) == 5 and w.match(newer) == 2
    w.receive(older)  # its tail copied back (a peer pull): whole again, and only `newer`'s tail made room
    assert w.match(older) == 6 and w.match(newer) == 1


def test_a_planned_peer_pull_lands_the_prefix_on_the_idle_worker_and_lowers_ttft():
    # prefill-0 holds a 16 k-token prefix; 8 requests sharing it arrive at once: with pulls, prefill-1 copies the
    # prefix from prefill-0 instead of queueing behind it or recomputing
    import random

    from loadgen.workload import RequestSpec

    prof = load_profile("h200_node")
    rng = random.Random(5)
    prefix = _tokens(rng, 16384)
    specs = [
        RequestSpec(f"hot-{i}", 16384 + 1024, 16, arrival_s=0.001 * i, token_ids=prefix + _tokens(rng, 1024))
        for i in range(8)
    ]
    hashes = block_hashes_for(specs, prof.block_size)
    prefix_hashes = hashes[0][: 16384 // prof.block_size]
    ttft, sims = {}, {}
    for pull in (False, True):
        sim = Simulator(prof, ClusterConfig(2, 1, "disagg", "ttft", peer_pull=pull))
        sim.warm("prefill-0", prefix_hashes)
        results = sim.run(specs, hashes)
        assert all(r.ok for r in results)
        ttft[pull] = sum(r.ttft_s for r in results) / len(results)
        sims[pull] = sim
    off, on = sims[False], sims[True]
    assert off.kv_moves["pulls"] == 0 and on.route_reasons["peer_pull"] >= 1
    assert (
        on.kv_moves["pulled_blocks"] == len(prefix_hashes) * on.kv_moves["pulls"]
    )  # nothing lost on the way
    pulled = [q for q in on.reqs if q.pulled_blocks]
    assert pulled and all(q.prefill_worker == "prefill-1" and q.first_cached == 16384 for q in pulled)
    # the blocks are on the target now, and the router's index says so
    assert on.workers["prefill-1"].match(prefix_hashes) == len(prefix_hashes)
    assert on.router.index.overlaps(prefix_hashes)["prefill-1"] == len(prefix_hashes)
    assert off.workers["prefill-1"].match(prefix_hashes) == 0
    assert ttft[True] < ttft[False]


def test_a_pull_whose_source_dies_meanwhile_recomputes_and_still_answers():
    import random

    from loadgen.workload import RequestSpec

    prof = load_profile("h200_node")
    rng = random.Random(5)
    prefix = _tokens(rng, 16384)
    specs = [
        RequestSpec(f"hot-{i}", 16384 + 1024, 16, arrival_s=0.001 * i, token_ids=prefix + _tokens(rng, 1024))
        for i in range(8)
    ]
    hashes = block_hashes_for(specs, prof.block_size)
    sim = Simulator(prof, ClusterConfig(2, 1, "disagg", "ttft", failures=[(0.0015, "prefill-0")]))
    sim.warm("prefill-0", hashes[0][:256])
    results = sim.run(specs, hashes)
    assert all(r.ok for r in results)  # every request answered: the pulled one recomputed its prefix
    assert sim.kv_moves["pulls"] >= 1 and sim.kv_moves["pull_lost_blocks"] == 256 * sim.kv_moves["pulls"]
    assert sim.kv_moves["pulled_blocks"] == 0


def test_a_worker_started_after_a_drain_takes_the_freed_slot_on_the_same_node():
    """A planner that drains and starts workers must not push its new ones ever further away: a drained,
    idle worker frees its accelerator, and the next worker lands there (the node's fast link), as a scheduler
    bin-packing GPU pods would place it; only a full node sends a worker to the next one."""
    prof = load_profile("h200_node")  # 8 workers per node
    sim = Simulator(prof, ClusterConfig(prefill_workers=6, decode_workers=2, mode="disagg"))
    assert {w.node for w in sim.workers.values()} == {"node0"}
    assert sim.add_worker("prefill").node == "node1"  # node0's 8 slots are taken
    for wid in ("prefill-5", "prefill-4", "prefill-6"):
        sim.drain_worker(wid)  # idle: their slots are free at once
    grown = [sim.add_worker("prefill") for _ in range(3)]
    assert [w.node for w in grown] == ["node0", "node0", "node1"]
    assert len({w.worker_id for w in sim.workers.values()}) == len(sim.workers) == 12  # ids stay unique
    assert (
        sim.link_class(grown[0], sim.workers["decode-0"]) == SAME_NODE
    )  # the fast link, as before the drain


def test_a_lone_request_decodes_one_step_per_token_each_as_long_as_its_context_makes_it():
    """Token k + 1 comes one decode step after token k, the step timed by the profile for a batch of one and the
    context so far (the prompt and the k tokens emitted), the first step starting when its KV is admitted."""
    prof = load_profile("h200_node")
    (spec,) = synthetic(1, Lengths(1000, 1000), Lengths(6, 6), 1)
    sim = Simulator(prof, ClusterConfig(1, 1, "disagg", "ttft"))
    (result,) = sim.run([spec], block_hashes_for([spec], prof.block_size))
    (r,) = sim.reqs
    assert result.ok and len(r.token_times) == spec.output_tokens == 6
    n = spec.input_tokens
    want, t = [], r.t_decode_start
    for k in range(1, 6):
        t += prof.decode_step_s(1, n + k)
        want.append(t)
    assert r.token_times[1:] == pytest.approx(want, rel=1e-12, abs=0)
    assert r.token_times[0] == r.t_first < r.t_decode_start  # the prefill's token, before the KV moved
