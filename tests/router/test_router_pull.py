"""The router plans prefix pulls between workers and prices the KV tiers: pure Python, no network.

Each test builds a RouterState as the live router does (workers from discovery, block events, load reports),
routes a prompt, and checks the plan — who prefills, whether it pulls and from whom, the RoutePlan the wire
carries — against the cost model's own arithmetic.
"""

from __future__ import annotations

import argparse

import pytest

from services.engine.block_hash import block_hashes
from services.router.cost_model import CostSettings
from services.router.policy import RouteQuery, WorkerState, make_policy
from services.router.prefix_index import DISK, HOST
from services.router.server import add_arguments, apply_kv_event, policy_from_args, route_plan, worker_state
from services.router.state import RouterState
from services.rpc import pb

BS = 16
RATE = CostSettings().prefill_tokens_per_s


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 49000 + 1 for i in range(n)]


def P(worker_id: str, **kw: object) -> WorkerState:  # noqa: N802 - reads like a diagram
    return WorkerState(worker_id, "prefill", epoch=3, endpoint=f"{worker_id}:50051", **kw)  # type: ignore[arg-type]


def D(worker_id: str, **kw: object) -> WorkerState:  # noqa: N802
    return WorkerState(worker_id, "decode", epoch=3, endpoint=f"{worker_id}:50052", **kw)  # type: ignore[arg-type]


def router(
    *workers: WorkerState, mode: str = "disagg", settings: CostSettings | None = None, **kw: object
) -> RouterState:
    state = RouterState(make_policy("ttft", mode, settings=settings, **kw))  # type: ignore[arg-type]
    for w in workers:
        state.add_worker(w)
    return state


def cache(state: RouterState, worker_id: str, tokens: list[int]) -> None:
    state.on_stored(worker_id, block_hashes(tokens, BS), computed=False)


def busy_holder_and_idle_peer(**kw: object) -> tuple[RouterState, list[int]]:
    """B holds 1,600 of the prompt's 2,048 tokens in its pool behind a 0.25 s queue (shorter than recomputing
    them elsewhere); A is idle and cold."""
    tokens = prompt(2048)
    state = router(P("A", rack="r1"), P("B", rack="r1"), D("d", rack="r1"), **kw)
    cache(state, "B", tokens[:1600])
    state.on_load("B", 0.0, queued_prefill_tokens=1000, running=1)
    return state, tokens


def test_an_idle_worker_pulls_the_prefix_a_busy_peer_holds_and_the_plan_says_so() -> None:
    state, tokens = busy_holder_and_idle_peer()
    query = RouteQuery("pull", token_ids=tokens)
    decision = state.route(query, 1.0)
    assert decision.prefill == "A" and decision.reason == "peer_pull"
    pull = decision.chosen.pull
    assert pull is not None and (pull.source, pull.start_block, pull.blocks, pull.tokens) == (
        "B",
        0,
        100,
        1600,
    )
    terms = decision.chosen.terms
    s = CostSettings()
    bytes_per_s, latency_s = s.link("same_rack")
    expected_pull_s = s.peer_pull_overhead_s + latency_s + 100 * BS * s.kv_bytes_per_token / bytes_per_s
    assert terms["pull_s"] == pytest.approx(expected_pull_s)
    assert (terms["pulled_tokens"], terms["cached_tokens"], terms["uncached_tokens"]) == (1600, 0, 448)
    assert terms["queue_s"] == 0  # B's queue is not A's: the pull does not wait for B's step
    assert decision.estimated_ttft_s == pytest.approx(
        sum(terms[t] for t in ("queue_s", "pull_s", "prefill_s", "restore_s", "transfer_s", "admission_s"))
    )
    # the wire: the source's endpoint and epoch from discovery, the prompt's own chained hashes of the blocks
    plan = route_plan(decision, state.workers, query)
    assert plan.prefill.worker_id == "A" and plan.HasField("prefix_pull")
    pp = plan.prefix_pull
    assert (pp.source.worker_id, pp.source.endpoint, pp.source.epoch, pp.source.role) == (
        "B",
        "B:50051",
        3,
        "prefill",
    )
    assert pp.start_block == 0 and list(pp.block_hashes) == block_hashes(tokens, BS)[:100]
    assert pp.deadline_s >= 1600 / RATE  # never given up before computing them would have finished
    assert plan.score_terms["pulled_tokens"] == 1600 and plan.reason_code == "peer_pull"
    assert "pull 100 blocks from B" in plan.reason


def test_the_pull_beats_both_waiting_for_the_holder_and_recomputing() -> None:
    with_pull, tokens = busy_holder_and_idle_peer()
    without, _ = busy_holder_and_idle_peer(peer_pull=False)
    pulled = with_pull.route(RouteQuery("x", token_ids=tokens), 1.0)
    waited = without.route(RouteQuery("x", token_ids=tokens), 1.0)
    # without pulls, queueing behind the holder beats recomputing on the idle worker
    assert waited.prefill == "B" and waited.reason == "cache_hit" and waited.chosen.pull is None
    recomputed = waited.runner_up
    assert (
        recomputed is not None and recomputed.prefill == "A" and recomputed.terms["uncached_tokens"] == 2048
    )
    assert pulled.estimated_ttft_s < waited.estimated_ttft_s < recomputed.estimated_ttft_s
    # the pull's saving over recomputing on the same worker is the compute of the pulled tokens less the pull
    assert pulled.chosen.pull is not None
    assert recomputed.estimated_ttft_s - pulled.estimated_ttft_s == pytest.approx(pulled.chosen.pull.saved_s)


@pytest.mark.parametrize(
    ("cross_zone_bytes_per_s", "pulls"), [(1e9, True), (3e7, False)], ids=["fast", "slow"]
)
def test_a_pull_across_a_slow_link_loses_to_recompute_when_the_arithmetic_says_so(
    cross_zone_bytes_per_s: float, pulls: bool
) -> None:
    tokens = prompt(2048)
    settings = CostSettings(cross_zone_bytes_per_s=cross_zone_bytes_per_s)
    state = router(P("A", zone="z1"), P("B", zone="z2"), D("d", zone="z1"), settings=settings)
    cache(state, "B", tokens[:1600])
    state.on_load("B", 0.0, queued_prefill_tokens=16000, running=1)
    decision = state.route(RouteQuery("far", token_ids=tokens), 1.0)
    assert decision.prefill == "A"
    pull_s = settings.peer_pull_overhead_s + settings.cross_zone_latency_s
    pull_s += 1600 * settings.kv_bytes_per_token / cross_zone_bytes_per_s
    assert (pull_s < 1600 / RATE) is pulls  # the arithmetic the test relies on
    if pulls:
        assert decision.chosen.pull is not None and decision.chosen.pull.link == "cross_zone"
        assert decision.chosen.terms["pull_s"] == pytest.approx(pull_s)
    else:
        assert decision.chosen.pull is None and decision.chosen.terms["uncached_tokens"] == 2048


def test_no_peer_pull_never_plans_one_from_the_flag_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokens = prompt(2048)
    for argv, env in ((["--no-peer-pull"], None), ([], "0"), (["--peer-pull"], None)):
        if env is not None:
            monkeypatch.setenv("RACKSERVE_PEER_PULL", env)
        else:
            monkeypatch.delenv("RACKSERVE_PEER_PULL", raising=False)
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        policy = policy_from_args(parser.parse_args(["--mode", "disagg", *argv]))
        state = RouterState(policy)
        for w in (P("A", rack="r1"), P("B", rack="r1"), D("d", rack="r1")):
            state.add_worker(w)
        cache(state, "B", tokens[:1600])
        state.on_load("B", 0.0, queued_prefill_tokens=16000, running=1)
        query = RouteQuery("flag", token_ids=tokens)
        decision = state.route(query, 1.0)
        plan = route_plan(decision, state.workers, query)
        on = argv == ["--peer-pull"]
        assert policy.options.peer_pull is on
        assert (decision.chosen.pull is not None) is on and plan.HasField("prefix_pull") is on
    monkeypatch.setenv("RACKSERVE_PEER_PULL", "maybe")
    with pytest.raises(ValueError, match="RACKSERVE_PEER_PULL"):
        add_arguments(argparse.ArgumentParser())


def test_a_decode_worker_another_model_or_a_draining_worker_is_never_a_pull_source() -> None:
    tokens = prompt(2048)
    state = router(
        P("A", fingerprint="m1"),
        P("C", fingerprint="m2"),
        P("E", fingerprint="m1"),
        D("d", fingerprint="m1"),
        D("d2", fingerprint="m1"),
        mode="auto",
    )
    for holder in ("C", "E", "d2"):
        cache(state, holder, tokens)
        state.on_load(holder, 0.0, queued_prefill_tokens=40000, running=4, waiting=8)
    state.workers["E"].healthy = False  # draining
    decision = state.route(RouteQuery("src", token_ids=tokens, fingerprint="m1"), 1.0)
    assert decision.chosen.prefilling_worker in ("A", "d")
    for plan in (decision.chosen, decision.runner_up):
        assert plan is not None and plan.pull is None and plan.terms["pulled_tokens"] == 0
    # the same prefix on a healthy prefill worker of the same model is pulled
    state.workers["E"].healthy = True
    decision = state.route(RouteQuery("src2", token_ids=tokens, fingerprint="m1"), 1.0)
    assert decision.chosen.pull is not None and decision.chosen.pull.source == "E"


def _info(worker_id: str, role: str, dtype: str) -> pb.WorkerInfo:
    """A registration of model m1 with KV of `dtype` (fp32 or bf16)."""
    return pb.WorkerInfo(
        worker_id=worker_id, role=role, endpoint=f"{worker_id}:1", epoch=3, model_fingerprint="m1",
        block_size=BS, kv_dtype=dtype, kv_bytes_per_token=46080 if dtype == "fp32" else 23040,
    )  # fmt: skip


def test_a_prefill_worker_whose_kv_has_another_dtype_is_never_a_pull_source() -> None:
    """The model fingerprint hashes the weights as float32, so a bfloat16 worker of the model has a float32
    one's: the puller refuses its blocks (fallback_layout, after the source copied and published them), and the
    blocks the plan priced as copied were recomputed. The dtype comes from the worker's registration."""
    tokens = prompt(2048)

    for source_dtype, pulls in (("bf16", False), ("fp32", True)):
        state = RouterState(make_policy("ttft", "disagg"))
        for w in (
            _info("A", "prefill", "fp32"),
            _info("B", "prefill", source_dtype),
            _info("d", "decode", "fp32"),
        ):
            state.add_worker(worker_state(w))
        cache(state, "B", tokens[:1600])
        state.on_load("B", 0.0, queued_prefill_tokens=4000, running=1)
        query = RouteQuery("x", token_ids=tokens)
        decision = state.route(query, 1.0)
        plan = route_plan(decision, state.workers, query)
        assert plan.HasField("prefix_pull") is pulls, source_dtype
        assert (decision.chosen.terms["pulled_tokens"] > 0) is pulls


def test_a_prefill_worker_whose_kv_has_another_dtype_never_prefills_for_the_decode_worker() -> None:
    """The same rule for the prefill -> decode pair: a decode worker refuses another dtype's KV (KvMismatchError)
    after the prefill ran and its copy was made, and the request rebuilds. Such a pair is not planned: the
    prefill worker of the decode worker's dtype is, and with none the decode worker prefills itself."""
    tokens = prompt(256)

    for prefills, chosen in ((("bf16", "fp32"), "P1"), (("bf16",), "d")):
        state = RouterState(make_policy("ttft", "disagg"))
        for i, dtype in enumerate(prefills):
            state.add_worker(worker_state(_info(f"P{i}", "prefill", dtype)))
        state.add_worker(worker_state(_info("d", "decode", "fp32")))
        state.on_load("P1" if len(prefills) > 1 else "P0", 0.0, queued_prefill_tokens=0, running=0)
        state.on_load("P0", 0.0, queued_prefill_tokens=0, running=0)
        decision = state.route(RouteQuery("x", token_ids=tokens), 1.0)
        assert decision.chosen.prefilling_worker == chosen, (prefills, decision.chosen)


def test_a_pull_starts_after_what_the_worker_holds_in_its_pool_and_tier_and_too_short_a_run_is_not_pulled() -> (
    None
):
    tokens = prompt(2048)
    hashes = block_hashes(tokens, BS)
    state = router(P("A"), P("B"), D("d"), peer_pull_min_blocks=8)
    state.on_stored("A", hashes[:20], computed=False)
    state.on_stored("A", hashes[20:40], computed=False)  # then pushed to A's host tier
    state.on_evicted("A", hashes[20:40])
    state.on_offloaded("A", hashes[20:40], HOST)
    cache(state, "B", tokens[:1600])
    state.on_load("B", 0.0, queued_prefill_tokens=16000, running=1)
    query = RouteQuery("start", token_ids=tokens)
    decision = state.route(query, 1.0)
    assert decision.prefill == "A"
    terms = decision.chosen.terms
    assert (terms["cached_tokens"], terms["tier2_tokens"], terms["pulled_tokens"]) == (320, 320, 960)
    pp = route_plan(decision, state.workers, query).prefix_pull
    assert pp.start_block == 40 and list(pp.block_hashes) == hashes[40:100]
    # B holding only 7 blocks more than A does is below --peer-pull-min-blocks: nothing is pulled
    short = router(P("A"), P("B"), D("d"), peer_pull_min_blocks=8)
    short.on_stored("A", hashes[:40], computed=False)
    short.on_stored("B", hashes[:47], computed=False)
    short.on_load("B", 0.0, queued_prefill_tokens=16000, running=1)
    assert short.route(RouteQuery("short", token_ids=tokens), 1.0).chosen.pull is None


def test_a_planned_pull_counts_its_blocks_as_soon_cached_on_the_puller() -> None:
    state, tokens = busy_holder_and_idle_peer()
    first = state.route(RouteQuery("first", token_ids=tokens), 1.0)
    assert first.prefill == "A" and first.chosen.pull is not None
    assert state.workers["A"].pending_prefill_tokens == 448  # only what it computes queues there
    second = state.route(RouteQuery("second", token_ids=tokens), 1.001)
    a_plan = second.chosen if second.prefill == "A" else second.runner_up
    assert a_plan is not None and a_plan.prefill == "A"
    assert a_plan.terms["cached_tokens"] == 2047 and a_plan.pull is None  # nothing left to pull for A


def test_a_disk_tier_hit_is_restored_at_the_slower_disk_price_and_events_name_their_tier() -> None:
    tokens = prompt(2048)
    hashes = block_hashes(tokens, BS)
    state = router(P("A"), P("B"), D("d"), peer_pull=False)
    for worker_id, tier in (("A", pb.KvBlockEvent.HOST), ("B", pb.KvBlockEvent.DISK)):
        for kind in (pb.KvBlockEvent.STORED, pb.KvBlockEvent.EVICTED, pb.KvBlockEvent.OFFLOADED):
            apply_kv_event(state, worker_id, pb.KvBlockEvent(kind=kind, block_hashes=hashes, tier=tier), True)
    assert state.index.tier2_blocks_of("A", HOST) == 128 and state.index.tier2_blocks_of("B", DISK) == 128
    assert state.index.tier2_blocks_of("B", HOST) == 0
    decision = state.route(RouteQuery("disk", token_ids=tokens), 0.0)
    assert decision.prefill == "A" and decision.runner_up is not None and decision.runner_up.prefill == "B"
    host, disk = decision.chosen.terms, decision.runner_up.terms
    s = CostSettings()
    assert (
        host["restore_s"] == pytest.approx(2047 * s.tier2_restore_fraction / RATE)
        and host["disk_tokens"] == 0
    )
    assert (
        disk["restore_s"] == pytest.approx(2047 * s.disk_restore_fraction / RATE)
        and disk["disk_tokens"] == 2047
    )
    # B restores from disk (RESTORED, tier DISK): a pool hit now, its disk tier emptied
    apply_kv_event(
        state,
        "B",
        pb.KvBlockEvent(kind=pb.KvBlockEvent.RESTORED, block_hashes=hashes, tier=pb.KvBlockEvent.DISK),
        True,
    )
    assert state.index.tier2_blocks_of("B", DISK) == 0 and state.index.overlaps(hashes)["B"] == 128
