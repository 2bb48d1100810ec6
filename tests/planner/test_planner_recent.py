"""`--replay-from recent`: the planner replays the frontend's traffic log, the requests as they arrived with
the prefixes they shared, instead of requests drawn from the length histograms with one shared prefix."""

from __future__ import annotations

from typing import Any

from loadgen.sim.engine import block_hashes_for
from loadgen.sim.profile import load_profile
from services.planner.plan import (
    Limits,
    Observation,
    Slo,
    candidates,
    choose,
    evaluate,
    recent_specs,
    replay_workload,
)
from services.telemetry.traffic import SHARE_TOKENS, TrafficRecord

CPU = load_profile("cpu_smollm2")


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_replayed_requests_share_exactly_the_prefixes_the_records_say() -> None:
    records = [
        ("fe-1", TrafficRecord(1, 10.0, 3 * SHARE_TOKENS + 40, None, 0)),
        ("fe-1", TrafficRecord(2, 10.5, 5 * SHARE_TOKENS, 1, 2 * SHARE_TOKENS)),
        ("fe-1", TrafficRecord(3, 11.0, 900, None, 0)),
        # two children of a request older than the records: they still share its prefix with each other
        ("fe-1", TrafficRecord(9, 11.5, 4 * SHARE_TOKENS, 7, 3 * SHARE_TOKENS)),
        ("fe-1", TrafficRecord(10, 12.0, 2 * SHARE_TOKENS + 1, 7, 2 * SHARE_TOKENS)),
        # another frontend numbers its own log: its seq 1 is not fe-1's
        ("fe-2", TrafficRecord(2, 12.5, 3 * SHARE_TOKENS, 1, 3 * SHARE_TOKENS)),
    ]
    specs = recent_specs(records)
    assert [s.input_tokens for s in specs] == [r.prompt_tokens for _, r in records]
    hashes = block_hashes_for(specs, CPU.block_size)  # the engine's own block hashes, at 16 tokens
    per = SHARE_TOKENS // CPU.block_size
    assert _common(hashes[0], hashes[1]) == 2 * per
    assert _common(hashes[2], hashes[0]) == _common(hashes[2], hashes[1]) == 0
    assert _common(hashes[3], hashes[4]) == 2 * per
    assert max(_common(hashes[5], h) for h in hashes[:5]) == 0

    # replayed: a backlog of 2 at once, then the records at their gaps scaled to the rate replayed (the
    # window's measured 2/s: their own; a forecast's 4/s: twice as fast)
    obs = Observation(window_s=3, requests=6, output_tokens=[(8, 6.0)], generation_tokens=48, backlog=2)
    obs.recent = specs
    own = replay_workload(obs, CPU.block_size)
    obs.replay_rate_rps = 4.0
    fast = replay_workload(obs, CPU.block_size)
    assert len(own) == len(fast) == 6 + 2
    assert [s.arrival_s for s in own] == [0.0, 0.0, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert [s.arrival_s for s in fast] == [0.0, 0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.25]
    assert {s.output_tokens for s in own} == {8}


def test_prompts_that_share_their_prefixes_need_fewer_prefill_workers_than_their_lengths_say() -> None:
    """Twenty 2,048-token prompts in 10 s on the CPU profile: sharing nothing they need 3 prefill workers for
    a 1 s p90 TTFT; each sharing 1,792 tokens with the one before, 1."""

    def window(shared: bool) -> Observation:
        records = [
            (
                "fe",
                TrafficRecord(
                    i + 1, 100 + 0.5 * i, 2048, i if shared and i else None, 1792 if shared and i else 0
                ),
            )
            for i in range(20)
        ]
        obs = Observation(
            window_s=10, requests=20, input_tokens=[(2048, 20.0)], output_tokens=[(8, 20.0)],
            prompt_tokens=20 * 2048, generation_tokens=160,
        )  # fmt: skip
        obs.recent = recent_specs(records)
        return obs

    limits, slo = Limits(1, 3, 1, 3, max_workers=4), Slo(ttft_s=1.0, itl_s=0.08)
    apart, _ = choose(evaluate(window(False), CPU, candidates(limits)), slo)
    sharing, _ = choose(evaluate(window(True), CPU, candidates(limits)), slo)
    assert apart is not None and sharing is not None
    assert (apart.prefill, sharing.prefill) == (3, 1)


def test_the_planner_replays_only_what_each_frontend_logged_lately_on_its_own_clock() -> None:
    """Two frontends' GET /traffic, served by real HTTP servers: one whose clock runs 100 s behind the
    planner's, with three requests in the last seconds (the second sharing the first's prefix); one whose
    last request was 5 minutes ago. The replay holds the three, in order, on the planner's clock, and none of
    the idle frontend's."""
    import argparse
    import asyncio
    import time

    from services.planner.server import Planner, add_arguments
    from tests.support.http import json_server

    def serve(now: float, records: list[dict]) -> Any:
        def answer(path: str) -> dict:
            assert path.startswith("/traffic?since=")
            return {"share_tokens": SHARE_TOKENS, "now": now + (time.time() - start), "last": len(records),
                    "requests": records}  # fmt: skip

        return json_server(answer)

    start = time.time()
    behind = start - 100.0  # the first frontend's clock
    busy = serve(behind, [
        {"seq": 1, "t": behind - 3.0, "prompt_tokens": 600, "parent": None, "shared_tokens": 0},
        {"seq": 2, "t": behind - 2.0, "prompt_tokens": 700, "parent": 1, "shared_tokens": 512},
        {"seq": 3, "t": behind - 1.0, "prompt_tokens": 300, "parent": None, "shared_tokens": 0},
    ])  # fmt: skip
    idle = serve(
        start, [{"seq": 1, "t": start - 300.0, "prompt_tokens": 5000, "parent": None, "shared_tokens": 0}]
    )
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    planner = Planner(parser.parse_args(["--replay-from", "recent"]), directory=None)  # type: ignore[arg-type]

    async def go() -> None:
        await planner._read_traffic({
            "frontend/a/1": f"127.0.0.1:{busy.server_address[1]}",
            "frontend/b/1": f"127.0.0.1:{idle.server_address[1]}",
        })  # fmt: skip
        await planner.close()

    try:
        asyncio.run(go())
    finally:
        busy.shutdown()
        idle.shutdown()
    specs = planner._recent(30.0) or []
    assert [s.input_tokens for s in specs] == [600, 700, 300]
    assert all(start - 5.0 < s.arrival_s <= time.time() for s in specs)  # on the planner's clock
    hashes = block_hashes_for(specs, CPU.block_size)
    assert _common(hashes[0], hashes[1]) == 512 // CPU.block_size
