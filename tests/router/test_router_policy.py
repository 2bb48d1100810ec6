"""Scenario tests that pin the router's decisions: pure Python, no network (the policies are plain objects).

Each test builds a RouterState the way the live router does — workers from discovery, block events into the
prefix index, load reports — and asserts who is chosen and why.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter

import pytest

from services.engine.block_hash import block_hashes
from services.router.cost_model import CostSettings, RateMeter, link_class
from services.router.policy import (
    POLICIES,
    REGISTRY,
    NoWorkerError,
    RouteQuery,
    WorkerState,
    make_policy,
    setting_flag,
)
from services.router.prefix_index import PrefixIndex
from services.router.server import Router, add_arguments, policy_from_args, route_plan
from services.router.state import RouterState
from services.rpc import pb
from services.runtime.args import env_name

BS = 16


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 49000 + 1 for i in range(n)]


def router(*workers: WorkerState, policy: str = "ttft", mode: str = "auto", **kw: object) -> RouterState:
    state = RouterState(make_policy(policy, mode, **kw))
    for w in workers:
        state.add_worker(w)
    return state


def cache(state: RouterState, worker_id: str, tokens: list[int]) -> None:
    """The worker reports it holds the full blocks of `tokens` (a snapshot of its prefix cache)."""
    state.on_stored(worker_id, block_hashes(tokens, BS), computed=False)


def P(worker_id: str, **kw: object) -> WorkerState:  # noqa: N802 - reads like a diagram
    return WorkerState(worker_id, "prefill", epoch=1, **kw)  # type: ignore[arg-type]


def D(worker_id: str, **kw: object) -> WorkerState:  # noqa: N802
    return WorkerState(worker_id, "decode", epoch=1, **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ cache vs queue (A cached, B idle)


@pytest.mark.parametrize(
    ("a_queued_tokens", "expected", "reason"),
    [(400, "A", "cache_hit"), (16000, "B", "least_queue")],
    ids=["A_short_queue", "A_long_queue"],
)
def test_seed_case_80pct_cached_busy_a_vs_idle_cold_b(
    a_queued_tokens: int, expected: str, reason: str
) -> None:
    tokens = prompt(2048)
    # the choice between A's cache and B's empty queue (with peer pulls B would copy A's prefix instead:
    # tests/test_router_pull.py)
    state = router(P("A"), P("B"), D("d"), mode="disagg", peer_pull=False)
    cache(state, "A", tokens[: int(2048 * 0.8)])
    state.on_load("A", 0.0, queued_prefill_tokens=a_queued_tokens, running=1)
    decision = state.route(RouteQuery("seed", token_ids=tokens), 1.0)
    assert decision.prefill == expected
    assert decision.reason == reason
    assert decision.runner_up is not None and decision.runner_up.prefill == ({"A", "B"} - {expected}).pop()
    assert decision.estimated_ttft_s < decision.runner_up.estimated_ttft_s
    # A's terms show why: cached tokens lower its prefill term, its queue raises its queue term
    a_terms = decision.chosen.terms if expected == "A" else decision.runner_up.terms
    assert a_terms["cached_tokens"] == 2048 * 0.8 // BS * BS


def test_same_prefix_on_two_workers_goes_to_the_one_in_the_decode_workers_rack() -> None:
    tokens = prompt(2048)
    state = router(
        P("p-far", node="n3", rack="r2", zone="z1"),
        P("p-near", node="n2", rack="r1", zone="z1"),
        D("d", node="n1", rack="r1", zone="z1"),
        mode="disagg",
    )
    cache(state, "p-far", tokens)
    cache(state, "p-near", tokens)
    for i in range(20):
        decision = state.route(RouteQuery(f"topo-{i}", token_ids=tokens), 0.0)
        assert decision.prefill == "p-near", decision
        state.reservations.expire(state.workers, 1e9)  # each request alone: the rule, not the spreading
    assert decision.reason == "topology"
    assert decision.runner_up is not None and decision.runner_up.prefill == "p-far"
    assert decision.chosen.terms["transfer_s"] < decision.runner_up.terms["transfer_s"]


def test_an_unlabeled_prefill_worker_is_priced_beside_labeled_ones_across_a_zone() -> None:
    """Three prefill workers in another zone than the decode worker, and one without labels (priced at
    --unlabeled-link, same_rack by default). Until 2026-12-07 the candidate pruning kept only the best three of
    "any" for a decode worker whose own groups were empty, so the unlabeled worker was never priced and every
    plan crossed the zone."""
    far = [P(f"far{i}", zone="z2", rack="r9", node=f"n{i}") for i in range(3)]
    state = router(*far, P("unlabeled", queued_prefill_tokens=40), D("d", zone="z1", rack="r1", node="n0x"),
                   mode="disagg")  # fmt: skip
    decision = state.route(RouteQuery("q", token_ids=prompt(4000)), 0.0)
    assert decision.prefill == "unlabeled", decision
    assert decision.chosen.terms["transfer_s"] < decision.runner_up.terms["transfer_s"]
    assert decision.estimated_ttft_s < decision.runner_up.estimated_ttft_s


def test_short_prompt_with_an_idle_decode_worker_is_prefilled_locally() -> None:
    state = router(P("p", rack="r1"), D("d", rack="r1"))
    decision = state.route(RouteQuery("short", token_ids=prompt(40)), 0.0)
    assert decision.prefill is None and decision.decode == "d"
    assert decision.reason == "local_prefill"
    assert decision.runner_up is not None and decision.runner_up.prefill == "p"
    assert decision.detail.startswith("agg")


def test_long_prompt_is_prefilled_remotely() -> None:
    state = router(P("p", rack="r1"), D("d", rack="r1"))
    decision = state.route(RouteQuery("long", token_ids=prompt(3000)), 0.0)
    assert decision.prefill == "p" and decision.decode == "d"
    assert decision.reason == "remote_prefill"
    assert decision.chosen.terms["transfer_s"] > 0
    assert decision.detail.startswith("disagg")


def test_a_short_prompt_cached_on_the_decode_worker_but_a_busy_decode_worker_goes_remote() -> None:
    tokens = prompt(200)
    state = router(P("p"), D("d"))
    cache(state, "d", tokens)
    assert state.route(RouteQuery("warm", token_ids=tokens), 0.0).prefill is None
    state.on_load("d", 1.0, queued_prefill_tokens=20000, running=40)
    assert state.route(RouteQuery("busy", token_ids=tokens), 2.0).prefill == "p"


@pytest.mark.parametrize("mode", ["agg", "disagg"])
def test_mode_agg_and_disagg_force_the_plan_shape(mode: str) -> None:
    state = router(P("p"), D("d"), mode=mode)
    short = state.route(RouteQuery("s", token_ids=prompt(20)), 0.0)
    long = state.route(RouteQuery("l", token_ids=prompt(3000)), 0.0)
    expected = None if mode == "agg" else "p"
    assert short.prefill == expected and long.prefill == expected


def test_resume_without_prefill_is_never_disaggregated() -> None:
    state = router(P("p"), D("d"), mode="disagg")
    decision = state.route(RouteQuery("resume", token_ids=prompt(3000), need_prefill=False), 0.0)
    assert decision.prefill is None and decision.detail == "agg: no prefill needed"


# ------------------------------------------------------------------------------------ herding


def test_burst_of_100_identical_prefix_requests_spreads_instead_of_herding() -> None:
    def burst(state: RouterState) -> tuple[Counter[str], Counter[str]]:
        prefills: Counter[str] = Counter()
        decodes: Counter[str] = Counter()
        for i in range(100):
            tokens = prompt(512, seed=0)[:448] + prompt(64, seed=i + 1)  # shared 448-token system prompt
            decision = state.route(RouteQuery(f"burst-{i}", token_ids=tokens), 0.001 * i)
            prefills[decision.prefill or "local"] += 1
            decodes[decision.decode] += 1
        return prefills, decodes

    def fresh(**kw: object) -> RouterState:
        state = RouterState(make_policy("ttft", "disagg"), **kw)  # type: ignore[arg-type]
        for w in [P("p0"), P("p1"), P("p2"), P("p3"), D("d0"), D("d1")]:
            state.add_worker(w)
        cache(state, "p0", prompt(512, seed=0)[:448])
        return state

    prefills, decodes = burst(fresh())
    assert len(prefills) == 4 and max(prefills.values()) <= 40, prefills
    assert prefills["p0"] == max(prefills.values()), prefills  # the cache still attracts the most
    assert min(decodes.values()) >= 35, decodes
    # the control: without reservations (they expire at once) the same burst herds onto the cached worker
    herded, _ = burst(fresh(reservation_ttl_s=0.0))
    assert herded["p0"] == 100


def test_two_router_replicas_with_the_same_view_do_not_pick_the_same_worker_for_everything() -> None:
    tokens = prompt(1024)

    def replica() -> RouterState:
        state = router(P("p0"), P("p1"), P("p2"), D("d0"), D("d1"), mode="disagg")
        for p in ("p0", "p1", "p2"):
            cache(state, p, tokens)  # equally good prefill workers
        return state

    a, b = replica(), replica()
    picks_a = [(a.route(RouteQuery(f"a-{i}", token_ids=tokens), 0.0)) for i in range(12)]
    picks_b = [(b.route(RouteQuery(f"b-{i}", token_ids=tokens), 0.0)) for i in range(12)]
    plans_a = [(d.prefill, d.decode) for d in picks_a]
    plans_b = [(d.prefill, d.decode) for d in picks_b]
    assert plans_a != plans_b
    # the burst's first requests — where two replicas with the same stale view herd — land apart
    firsts = [replica().route(RouteQuery(f"first-{i}", token_ids=tokens), 0.0).prefill for i in range(8)]
    assert len(set(firsts)) >= 2, firsts
    # and two replicas with the same view agree on one request (the choice is keyed by its id, not by chance)
    same = [replica().route(RouteQuery("same", token_ids=tokens), 0.0) for _ in range(2)]
    assert (same[0].prefill, same[0].decode) == (same[1].prefill, same[1].decode)


def test_a_load_report_replaces_the_reservations_it_already_counts() -> None:
    state = router(P("p"), D("d"), mode="disagg")
    state.route(RouteQuery("r1", token_ids=prompt(1000)), 0.0)
    assert state.workers["p"].pending_prefill_tokens == 1000 and state.workers["d"].pending_requests == 1
    state.on_load("p", 0.01, queued_prefill_tokens=0)  # too soon: the request may not have arrived
    assert state.workers["p"].pending_prefill_tokens == 1000
    state.on_load("p", 1.0, queued_prefill_tokens=1000)
    assert state.workers["p"].pending_prefill_tokens == 0 and state.workers["p"].queued_prefill_tokens == 1000
    state.route(RouteQuery("r2", token_ids=prompt(10)), 100.0)  # a reservation never outlives its TTL
    assert state.workers["d"].pending_requests == 1


def test_a_heartbeat_repeating_the_last_load_report_keeps_the_reservations_it_does_not_count() -> None:
    """A worker inside a long step (a 2000-token prompt on a CPU: seconds) repeats its last snapshot every second;
    the request routed to it is in no snapshot until the step ends. Until 2026-12-07 that heartbeat cleared the
    reservation, and the router sent the next requests to the busy worker as if it were idle."""
    state = router(P("a"), P("b"), D("d"), mode="disagg")
    idle = {"waiting": 0, "running": 0, "queued_prefill_tokens": 0, "free_blocks": 500, "step_s": 0.0}
    for worker_id in ("a", "b", "d"):
        state.on_load(worker_id, 0.0, **idle)
    busy = state.route(RouteQuery("big", token_ids=prompt(2000)), 1.0).prefill
    other = "b" if busy == "a" else "a"
    state.on_load(busy, 1.5, **idle)  # the heartbeat: the same snapshot again
    assert state.workers[busy].pending_prefill_tokens == 2000
    for i in range(3):  # 1500 tokens in all: the idle worker's queue stays shorter than the busy one's
        decision = state.route(RouteQuery(f"next-{i}", token_ids=prompt(500, seed=i + 1)), 1.6 + i / 100)
        assert decision.prefill == other, decision
        assert decision.reason == "least_queue" and decision.runner_up.terms["queue_s"] == 2000 / 4000
    # the step ended: a new snapshot counts the request
    state.on_load(busy, 4.0, **{**idle, "free_blocks": 375})
    assert state.workers[busy].pending_prefill_tokens == 0


# ------------------------------------------------------------------------------------ who may be chosen


def test_failed_worker_is_excluded_until_it_registers_with_a_new_epoch() -> None:
    state = router(D("d0"), D("d1"), policy="least_loaded")
    state.report_failure("d0", now=0.0)
    assert {state.route(RouteQuery(f"f{i}"), 1.0).decode for i in range(5)} == {"d1"}
    state.add_worker(D("d0"))  # the same process seen again (etcd re-list): still excluded
    assert state.route(RouteQuery("f-same"), 1.0).decode == "d1"
    state.add_worker(WorkerState("d0", "decode", epoch=2))  # restarted
    assert "d0" in {state.route(RouteQuery(f"g{i}"), 1.0).decode for i in range(6)}


def test_a_worker_silent_past_the_bound_is_not_routed_to_until_it_speaks_again() -> None:
    state = RouterState(make_policy("least_loaded", "auto"), silent_after_s=3.0)
    state.add_worker(D("d0"), now=0.0)
    state.add_worker(D("d1"), now=0.0)
    state.heard("d0", 2.0)
    state.heard("d1", 2.5)
    assert {state.route(RouteQuery(f"a{i}"), 5.0).decode for i in range(6)} == {"d0", "d1"}
    # d0 said nothing since t=2: past 3 s it is silent, d1 (heard at 2.5) not yet
    assert state.silent(5.1) == ["d0"]
    assert {state.route(RouteQuery(f"b{i}"), 5.1).decode for i in range(6)} == {"d1"}
    state.heard("d0", 5.2)  # its stream speaks again
    assert "d0" in {state.route(RouteQuery(f"c{i}"), 5.3).decode for i in range(6)}
    state.lost("d1")  # its stream failed: excluded at once, not after the bound
    assert {state.route(RouteQuery(f"d{i}"), 5.3).decode for i in range(6)} == {"d0"}
    state.lost("d0")
    with pytest.raises(NoWorkerError):
        state.route(RouteQuery("none"), 5.3)
    # a new process under the id (a new epoch) gets its own bound from its registration
    state.add_worker(WorkerState("d1", "decode", epoch=2), now=6.0)
    assert state.route(RouteQuery("new"), 6.5).decode == "d1"
    # a worker added without a time (the simulator's) is never taken for silent
    state.add_worker(D("sim"))
    assert "sim" not in state.silent(1e9)


def test_a_late_failure_report_about_a_replaced_process_does_not_exclude_its_successor() -> None:
    state = router(D("d0"), D("d1"), policy="least_loaded")
    state.add_worker(
        WorkerState("d0", "decode", epoch=2)
    )  # d0 restarted before the report about epoch 1 came
    assert not state.report_failure("d0", now=0.0, epoch=1)
    assert "d0" in {state.route(RouteQuery(f"a{i}"), 1.0).decode for i in range(6)}
    # reports about unknown workers are not kept (a client cannot grow the router's state with made-up ids)
    assert not state.report_failure("no-such-worker", now=0.0)
    assert state.report_failure("d0", now=0.0, epoch=2)
    assert {state.route(RouteQuery(f"b{i}"), 1.0).decode for i in range(6)} == {"d1"}


@pytest.mark.parametrize("policy", POLICIES)
def test_a_worker_whose_context_cannot_hold_the_prompt_is_never_chosen(policy: str) -> None:
    """A prefill worker with less KV memory than the decode workers has a shorter context (544 tokens for 34
    blocks). The frontend limits prompts by the decode workers' context only, and until 2026-12-07 the router sent
    a longer prompt to that prefill worker anyway: the client got a 400 for a prompt the cluster could serve."""
    state = router(
        P("p-small", max_model_len=544), D("d-big", max_model_len=5824), policy=policy, mode="disagg"
    )
    for n in (544, 1000):
        decision = state.route(RouteQuery(f"long-{n}", token_ids=prompt(n)), 0.0)
        assert decision.prefill is None and decision.decode == "d-big", decision
        assert "no eligible prefill worker" in decision.detail
    assert state.route(RouteQuery("short", token_ids=prompt(300)), 0.0).prefill == "p-small"
    state.add_worker(D("d-small", max_model_len=544))
    assert {state.route(RouteQuery(f"d{i}", token_ids=prompt(1000)), 0.0).decode for i in range(8)} == {
        "d-big"
    }


def test_a_prompt_no_decode_worker_can_hold_is_refused_as_too_long() -> None:
    """Every plan needs a decode worker, and none is chosen whose context cannot hold the prompt: a prompt that fits
    only a prefill worker's longer context fits no plan, and is the caller's error (INVALID_ARGUMENT naming the
    limit), not UNAVAILABLE "no decode workers", a status that says to retry."""
    servicer = Router(router(P("p-big", max_model_len=5824), D("d-small", max_model_len=544), mode="disagg"))
    with pytest.raises(ValueError, match=r"1000 token ids: .*\(544 tokens\)"):
        servicer._route(pb.RouteRequest(request_id="long", token_ids=prompt(1000), need_prefill=True))
    assert servicer._route(pb.RouteRequest(request_id="short", token_ids=prompt(300), need_prefill=True))


def test_unhealthy_mismatched_and_excluded_workers_are_never_chosen() -> None:
    tokens = prompt(2048)
    state = router(
        P("p-sick", healthy=False, fingerprint="m1"),
        P("p-other-model", fingerprint="m2"),
        P("p-ok", fingerprint="m1"),
        D("d", fingerprint="m1"),
        D("d-excluded", fingerprint="m1"),
        mode="disagg",
    )
    for p in ("p-sick", "p-other-model"):
        cache(state, p, tokens)  # the tempting ones hold the whole prompt
    for i in range(10):
        decision = state.route(RouteQuery(f"x{i}", token_ids=tokens, exclude=frozenset({"d-excluded"})), 0.0)
        assert (decision.prefill, decision.decode) == ("p-ok", "d")
    with pytest.raises(NoWorkerError, match="no decode workers"):
        state.route(RouteQuery("none", exclude=frozenset({"d", "d-excluded"})), 0.0)


# ------------------------------------------------------------------------------------ calibration


def test_measured_prefill_rates_steer_long_prompts_to_the_faster_worker() -> None:
    state = router(P("slow"), P("fast"), D("d"), mode="disagg")
    for worker_id, blocks in (("slow", 32), ("fast", 512)):
        state.on_load(worker_id, 0.0, queued_prefill_tokens=5000)
        state.on_stored(worker_id, list(range(hash(worker_id) % 1000, hash(worker_id) % 1000 + blocks)))
        state.on_load(worker_id, 1.0, queued_prefill_tokens=0)
    assert state.workers["slow"].prefill_tokens_per_s == pytest.approx(32 * BS)
    assert state.workers["fast"].prefill_tokens_per_s == pytest.approx(512 * BS)
    picks = {state.route(RouteQuery(f"c{i}", token_ids=prompt(3000, i)), 1.0).prefill for i in range(10)}
    assert picks == {"fast"}


def test_rate_meter_counts_only_busy_time_and_blends_measurements() -> None:
    meter = RateMeter(alpha=0.5, min_busy_s=0.5)
    meter.load(busy=False, now=0.0)
    meter.computed(10_000)  # idle: not part of any measurement
    meter.load(busy=True, now=10.0)
    meter.computed(1000)
    meter.load(busy=False, now=11.0)
    assert meter.tokens_per_s == pytest.approx(1000)
    meter.load(busy=True, now=20.0)
    meter.computed(3000)
    meter.load(busy=True, now=21.0)
    assert meter.tokens_per_s == pytest.approx(0.5 * 3000 + 0.5 * 1000)


def test_link_class_is_the_nearest_shared_topology_level() -> None:
    a = D("a", node="n1", rack="r1", zone="z1")
    assert link_class(a, P("p", node="n1", rack="r1", zone="z1")) == "same_node"
    assert link_class(a, P("p", node="n2", rack="r1", zone="z1")) == "same_rack"
    assert link_class(a, P("p", node="n3", rack="r2", zone="z1")) == "same_zone"
    assert link_class(a, P("p", node="n4", rack="r3", zone="z2")) == "cross_zone"
    assert link_class(a, P("p"), "same_zone") == "same_zone"
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        CostSettings(prefill_tokens_per_s=0)


# ------------------------------------------------------------------------------------ the prefix index


def test_prefix_index_counts_the_leading_run_and_forgets_a_worker_that_leaves() -> None:
    tokens = prompt(160)
    hashes = block_hashes(tokens, BS)  # 10 blocks
    index = PrefixIndex()
    index.stored("w1", hashes)
    index.stored("w2", hashes[:4] + hashes[5:])  # a hole at block 4: only 4 usable
    index.stored("w3", hashes[1:])  # no first block: nothing usable
    assert index.overlaps(hashes) == {"w1": 10, "w2": 4}
    index.evicted("w1", hashes[6:])
    assert index.overlaps(hashes) == {"w1": 6, "w2": 4}
    index.remove_worker("w1")
    index.stored("w4", hashes[:2])  # reuses w1's slot: must not inherit its blocks
    assert index.overlaps(hashes) == {"w2": 4, "w4": 2}
    assert len(index) == 9 + 9 + 2


def test_prefix_index_is_bounded_and_under_reports_when_full() -> None:
    index = PrefixIndex(max_entries=5)
    hashes = block_hashes(prompt(160), BS)
    index.stored("w", hashes)
    assert len(index) == 5 and index.dropped == 5
    assert index.overlaps(hashes) == {"w": 5}
    # across calls and workers: the room left is what the others' entries left, a tier's entries count too
    index = PrefixIndex(max_entries=6)
    index.stored("a", hashes[:3])
    index.stored("b", hashes[:4])
    assert len(index) == 6 and index.dropped == 1 and index.overlaps(hashes) == {"a": 3, "b": 3}
    index.offloaded("a", hashes[5:7])
    assert len(index) == 6 and index.dropped == 3
    index.evicted("b", hashes[:3])
    index.offloaded("a", hashes[5:7])
    assert len(index) == 5 and index.dropped == 3 and index.overlaps(hashes) == {"a": 3}
    index.offloaded("a", hashes[5:9])  # two there already, room for one, one dropped
    assert len(index) == 6 and index.dropped == 4
    # a hash repeated within one event or sent again is one entry, never dropped
    index = PrefixIndex(max_entries=2)
    index.stored("w", [hashes[0], hashes[0], hashes[1]])
    index.stored("w", [hashes[0]])
    assert len(index) == 2 and index.dropped == 0
    # an event whose hashes fail midway changes nothing: the same hashes later are indexed, owner and count

    def failing():
        yield from hashes[:2]
        raise RuntimeError("the event broke off")

    # a block leaving a tier frees its entry: the room is there for the next ones
    index = PrefixIndex(max_entries=4)
    index.offloaded("w", hashes[:2])
    index.tier2_dropped("w", hashes[:1])
    assert len(index) == 1
    index.offloaded("w", hashes[2:5])
    assert len(index) == 4 and index.dropped == 0
    index = PrefixIndex(max_entries=8)
    with pytest.raises(RuntimeError):
        index.stored("w", failing())
    assert len(index) == 0 and index.overlaps(hashes) == {}
    index.stored("w", hashes[:3])
    assert len(index) == 3 and index.overlaps(hashes) == {"w": 3}


# ------------------------------------------------------------------------------------ baselines


def test_round_robin_cycles_in_id_order() -> None:
    state = router(D("d2"), D("d0"), D("d1"), policy="round_robin")
    assert [state.route(RouteQuery(f"r{i}"), 0.0).decode for i in range(6)] == ["d0", "d1", "d2"] * 2


def test_least_loaded_picks_the_fewest_requests_counting_pending_ones() -> None:
    state = router(D("d0"), D("d1"), D("d2"), policy="least_loaded")
    state.on_load("d0", 0.0, waiting=3, running=4)
    state.on_load("d1", 0.0, running=2)
    state.on_load("d2", 0.0, running=5)
    picks = [state.route(RouteQuery(f"l{i}"), 0.01).decode for i in range(4)]
    assert picks[:2] == ["d1", "d1"] and sorted(picks[2:]) == ["d1", "d2"]


def test_cache_overlap_follows_the_cache_even_onto_a_loaded_worker() -> None:
    tokens = prompt(1024)
    state = router(P("cold"), P("warm"), D("d"), policy="cache_overlap", mode="disagg")
    cache(state, "warm", tokens[:512])
    state.on_load("warm", 0.0, queued_prefill_tokens=50000, waiting=30)
    decision = state.route(RouteQuery("c", token_ids=tokens), 0.0)
    assert decision.prefill == "warm" and decision.reason == "cache_hit"


@pytest.mark.parametrize(("overlap_weight", "expected"), [(1.0, "idle"), (4.0, "cached")])
def test_dynamo_kv_cost_weighs_prefill_blocks_against_decode_blocks(
    overlap_weight: float, expected: str
) -> None:
    # request 8 blocks. cached: 6 cached, 10 active decode blocks -> 1·2 + 18 = 20 | 4·2 + 18 = 26
    #                   idle:   nothing cached, nothing active   -> 1·8 + 8 = 16  | 4·8 + 8 = 40
    tokens = prompt(8 * BS)
    state = router(D("cached"), D("idle"), policy="dynamo_kv", mode="agg", overlap_weight=overlap_weight)
    cache(state, "cached", tokens[: 6 * BS])
    state.on_load("cached", 0.0, active_decode_blocks=10)
    decision = state.route(RouteQuery("dyn", token_ids=tokens), 0.0)
    assert decision.decode == expected and decision.reason == "dynamo_cost"


def test_dynamo_kv_temperature_samples_instead_of_always_the_cheapest() -> None:
    tokens = prompt(8 * BS)
    for temperature, expect_both in ((0.0, False), (1.0, True)):
        picks = set()
        for i in range(40):
            state = router(D("a"), D("b"), policy="dynamo_kv", mode="agg", temperature=temperature)
            state.on_load("b", 0.0, active_decode_blocks=4)  # a is cheaper
            picks.add(state.route(RouteQuery(f"t{i}", token_ids=tokens), 0.0).decode)
        assert picks == ({"a", "b"} if expect_both else {"a"})


def test_sgl_cache_aware_rules_balance_then_match_rate_then_smallest_tree() -> None:
    tokens = prompt(1024)
    # balanced load, match rate 0.5 > 0.3: the worker with the match
    state = router(D("m"), D("n"), D("big-tree"), policy="sgl_cache_aware", mode="agg")
    cache(state, "m", tokens[:512])
    cache(state, "big-tree", prompt(4096, seed=9))
    assert (
        d := state.route(RouteQuery("s1", token_ids=tokens), 0.0)
    ).decode == "m" and d.reason == "cache_hit"
    # imbalanced (100 − 0 > 64 and 100 > 1.5·0): shortest queue, whatever the cache
    state.on_load("m", 0.0, waiting=100)
    assert (d := state.route(RouteQuery("s2", token_ids=tokens), 0.0)).decode in ("n", "big-tree")
    assert d.reason == "balance"
    # balanced again, a prompt nobody holds (match 0 < 0.3): the worker with the smallest tree
    state.on_load("m", 1.0, waiting=0)
    other = prompt(1024, seed=5)
    assert (d := state.route(RouteQuery("s3", token_ids=other), 1.0)).decode == "n"
    assert d.reason == "most_cache_room"


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_answers_the_same_interface_and_the_plan_explains_itself(policy: str) -> None:
    tokens = prompt(600)
    state = router(
        P("p0", endpoint="h:1", rack="r1"), P("p1", endpoint="h:2"), D("d0", endpoint="h:3"), policy=policy
    )
    state.add_worker(D("d1", endpoint="h:4"))
    decision = state.route(RouteQuery("any", token_ids=tokens), 0.0)
    assert decision.policy == policy and decision.reason
    plan = route_plan(decision, state.workers, RouteQuery("any", token_ids=tokens))
    assert plan.decode.endpoint in ("h:3", "h:4") and plan.reason_code == decision.reason
    assert plan.reason.startswith("disagg" if plan.HasField("prefill") else "agg")
    assert plan.estimated_ttft_s == pytest.approx(
        sum(plan.score_terms[t] for t in ("queue_s", "prefill_s", "transfer_s", "admission_s"))
    )
    assert plan.HasField("runner_up_decode") and "queue_s" in plan.runner_up_terms


def test_every_weight_is_a_flag_that_reaches_the_policy() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--policy", "dynamo_kv", "--overlap-weight", "4", "--prefill-tokens-per-s", "1000", "--mode", "agg"]
    )
    policy = policy_from_args(args)
    assert policy.name == "dynamo_kv" and policy.mode == "agg"
    assert policy.options.overlap_weight == 4.0
    assert policy.settings.prefill_tokens_per_s == 1000.0
    flags = parser.format_help()
    for name in CostSettings.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in flags


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_setting_is_a_flag_that_the_environment_reaches(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings_type = REGISTRY[policy].Settings
    expected: dict[str, float] = {}
    for f in dataclasses.fields(settings_type):
        if isinstance(f.default, bool):  # an on/off switch: the environment turns it the other way
            value: float = not f.default
            monkeypatch.setenv(env_name(setting_flag(f)), "1" if value else "0")
        else:
            value = f.default * 2 + 1  # not the default, and of the field's type
            monkeypatch.setenv(env_name(setting_flag(f)), str(value))
        expected[f.name] = value
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    chosen = policy_from_args(parser.parse_args(["--policy", policy]))
    assert type(chosen.options) is settings_type
    assert {name: getattr(chosen.options, name) for name in expected} == expected


def test_a_setting_the_policy_does_not_have_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="overlap_weight"):
        make_policy("ttft", overlap_weight=2.0)
    with pytest.raises(ValueError, match="near_best_s"):
        make_policy("ttft", near_best_s=-1.0)


# ------------------------------------------------------------------------------------ tier 2: restore vs recompute


def offload(state: RouterState, worker_id: str, tokens: list[int]) -> None:
    """The worker computed `tokens`' blocks, then its pool pushed them out into its tier 2 (its events, in order)."""
    hashes = block_hashes(tokens, BS)
    state.on_stored(worker_id, hashes, computed=False)
    state.on_evicted(worker_id, hashes)
    state.on_offloaded(worker_id, hashes)


def test_with_equal_load_a_worker_holding_the_prefix_in_tier_2_beats_a_cold_one() -> None:
    tokens = prompt(2048)
    state = router(P("A"), P("B"), D("d"), mode="disagg")
    offload(state, "A", tokens)
    assert state.index.overlaps(block_hashes(tokens, BS)) == {}  # nothing left in any pool
    decision = state.route(RouteQuery("t2", token_ids=tokens), 0.0)
    assert decision.prefill == "A" and decision.reason == "tier2_hit"
    chosen, runner = decision.chosen.terms, decision.runner_up.terms if decision.runner_up else {}
    # 128 full blocks: all but the last token restored (the last one is always computed)
    assert (chosen["cached_tokens"], chosen["tier2_tokens"], chosen["uncached_tokens"]) == (0, 2047, 1)
    assert chosen["restore_s"] == pytest.approx(2047 * CostSettings().tier2_restore_fraction / 4000.0)
    assert (runner["tier2_tokens"], runner["uncached_tokens"], runner["restore_s"]) == (0, 2048, 0)
    assert decision.estimated_ttft_s < decision.runner_up.estimated_ttft_s  # type: ignore[union-attr]
    # once the worker restores it, the same prefix is a pool hit there and no longer a tier-2 one
    state.on_restored("A", block_hashes(tokens, BS))
    state.reservations.expire(state.workers, 1e9)
    again = state.route(RouteQuery("t2-again", token_ids=tokens), 1.0)
    assert again.prefill == "A" and again.reason == "cache_hit"
    assert (again.chosen.terms["cached_tokens"], again.chosen.terms["tier2_tokens"]) == (2047, 0)


def test_a_pool_hit_beats_a_tier_2_hit_of_the_same_prefix() -> None:
    tokens = prompt(2048)
    state = router(P("A"), P("B"), D("d"), mode="disagg")
    cache(state, "A", tokens)
    offload(state, "B", tokens)
    decision = state.route(RouteQuery("pool", token_ids=tokens), 0.0)
    assert decision.prefill == "A" and decision.reason == "cache_hit"
    assert decision.runner_up is not None and decision.runner_up.prefill == "B"
    assert decision.runner_up.terms["tier2_tokens"] == 2047 and decision.runner_up.terms["restore_s"] > 0
    assert decision.chosen.terms["restore_s"] == 0 and decision.chosen.terms["cached_tokens"] == 2047


def test_tier_2_continues_the_pools_run_and_a_decode_worker_restores_locally() -> None:
    tokens = prompt(640)
    state = router(D("d0"), D("d1"), mode="agg")
    offload(state, "d0", tokens)  # all 40 blocks went to d0's tier 2, then a prompt restored the first 20
    state.on_restored("d0", block_hashes(tokens[:320], BS))
    decision = state.route(RouteQuery("agg-t2", token_ids=tokens), 0.0)
    assert decision.decode == "d0" and decision.prefill is None
    assert (decision.chosen.terms["cached_tokens"], decision.chosen.terms["tier2_tokens"]) == (320, 319)
    assert decision.reason == "cache_hit" and decision.runner_up is not None  # its pool holds more, too
    assert decision.runner_up.terms["uncached_tokens"] == 640


@pytest.mark.parametrize(
    ("a_queued_tokens", "fraction", "expected", "reason"),
    [(1000, 0.1, "A", "tier2_hit"), (4000, 0.1, "B", "least_queue"), (1000, 1.0, "B", "least_queue")],
    ids=["A_short_queue", "A_long_queue", "restore_as_slow_as_recompute"],
)
def test_a_loaded_worker_with_a_tier_2_hit_loses_to_an_idle_cold_one_when_the_arithmetic_says_so(
    a_queued_tokens: int, fraction: float, expected: str, reason: str
) -> None:
    """2048 tokens at 4000 tok/s: B computes all of them (0.512 s); A restores 2047 (0.0512 s at 0.1) and
    computes 1, but first waits for its queue: A wins below ~1840 queued tokens, loses above; with restores
    priced as recompute (fraction 1.0) its 1000-token queue is enough to lose."""
    tokens = prompt(2048)
    settings = CostSettings(tier2_restore_fraction=fraction)
    state = RouterState(make_policy("ttft", "disagg", settings=settings))
    for w in (P("A"), P("B"), D("d")):
        state.add_worker(w)
    offload(state, "A", tokens)
    state.on_load("A", 0.0, queued_prefill_tokens=a_queued_tokens, running=1)
    decision = state.route(RouteQuery("loaded", token_ids=tokens), 1.0)
    assert decision.prefill == expected and decision.reason == reason
    assert decision.runner_up is not None
    a = decision.chosen if expected == "A" else decision.runner_up
    b = decision.runner_up if expected == "A" else decision.chosen
    assert a.terms["queue_s"] == pytest.approx(a_queued_tokens / 4000.0)
    assert a.terms["restore_s"] == pytest.approx(2047 * fraction / 4000.0)
    assert a.estimated_ttft_s - b.estimated_ttft_s == pytest.approx(
        (a_queued_tokens + 2047 * fraction + 1 - 2048) / 4000.0
    )


def test_the_restore_fraction_is_a_flag_and_an_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--tier2-restore-fraction", "0.25"])
    assert policy_from_args(args).settings.tier2_restore_fraction == 0.25
    monkeypatch.setenv("RACKSERVE_TIER2_RESTORE_FRACTION", "0.5")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert policy_from_args(parser.parse_args([])).settings.tier2_restore_fraction == 0.5
    with pytest.raises(ValueError, match="tier2_restore_fraction"):
        CostSettings(tier2_restore_fraction=-0.1)
