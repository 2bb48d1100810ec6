"""The load generator: report math on known inputs, workloads that keep prefix sharing real, and one run of
`rackserve bench run` against a real `rackserve up` cluster."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import subprocess
import sys

import httpx
import pytest

from loadgen import report as rep
from loadgen.client import phases_from_timeline
from loadgen.local import REPO, rackserve_up
from loadgen.sim.engine import block_hashes_for
from loadgen.trace import TraceBlockHasher, mooncake
from loadgen.workload import Lengths, poisson_arrivals, text_sessions
from services.engine.block_hash import block_hashes


def _r(i, ttft, itl, *, n_in=100, n_out=10, ok=True, status=200, start=0.0, e2e=None, cached=None):
    return rep.RequestResult(
        request_id=f"r{i}",
        input_tokens=n_in,
        output_tokens=len(itl) + 1 if ok else 0,
        requested_output_tokens=n_out,
        start_s=start,
        ok=ok,
        status=status,
        error=None if ok else "boom",
        ttft_s=ttft if ok else None,
        itl_s=itl,
        e2e_s=e2e if e2e is not None else (ttft or 0) + sum(itl),
        cached_tokens=cached,
    )


# ---- report math ------------------------------------------------------------------------------------------------


def test_percentiles_interpolate_linearly_between_ranks():
    xs = [float(x) for x in range(1, 11)]
    assert rep.percentile(xs, 50) == pytest.approx(5.5)
    assert rep.percentile(xs, 90) == pytest.approx(9.1)
    assert rep.percentile(xs, 99) == pytest.approx(9.91)
    assert rep.percentile([3.0], 99) == 3.0
    assert math.isnan(rep.percentile([], 50))


def test_goodput_counts_only_requests_meeting_both_the_ttft_and_the_itl_p90_slo():
    slo = rep.Slo(ttft_s=0.5, itl_p90_s=0.1)
    results = [
        _r(0, 0.2, [0.05] * 9),  # meets both
        _r(1, 0.9, [0.05] * 9),  # TTFT too slow
        _r(2, 0.2, [0.05] * 8 + [0.5, 0.5]),  # ITL p90 too slow (two of ten gaps are long)
        _r(3, 0.2, []),  # one token: nothing to miss the ITL term with
        _r(4, None, [], ok=False, status=503),
    ]
    s = rep.summarize(results, slo, rep.Grouping(1000, 1000), duration_s=10.0)["overall"]
    assert s["goodput_requests_per_s"] == pytest.approx(0.2)  # requests 0 and 3 in 10 s
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    assert s["requests_per_s"] == pytest.approx(0.4)
    assert s["errors"] == 1 and s["errors_by_status"] == {"503": 1}


def test_groups_split_short_and_long_prompts_and_outputs_at_the_thresholds():
    g = rep.Grouping(long_input_tokens=100, long_output_tokens=10)
    results = [
        _r(0, 0.1, [0.01], n_in=100, n_out=10),  # at the threshold: short/short
        _r(1, 0.2, [0.01], n_in=101, n_out=10),
        _r(2, 0.3, [0.01], n_in=50, n_out=11),
        _r(3, 0.4, [0.01], n_in=500, n_out=500),
        _r(4, 0.6, [0.01], n_in=500, n_out=500),
    ]
    s = rep.summarize(results, rep.Slo(), g, duration_s=1.0)
    counts = {name: grp["requests"] for name, grp in s["groups"].items()}
    assert counts == {
        "short_in/short_out": 1,
        "long_in/short_out": 1,
        "short_in/long_out": 1,
        "long_in/long_out": 2,
    }
    assert s["groups"]["long_in/long_out"]["ttft_s"]["p50"] == pytest.approx(0.5)
    assert s["overall"]["ttft_s"]["p50"] == pytest.approx(0.3)
    assert rep.Grouping.by_median([1, 2, 3], [10, 20, 30]) == rep.Grouping(2, 20)


def test_itl_percentiles_pool_every_gap_and_errors_are_left_out_of_latency():
    results = [_r(0, 0.1, [0.01, 0.02, 0.03]), _r(1, 0.1, [0.04]), _r(2, None, [], ok=False, status=0)]
    s = rep.summarize(results, rep.Slo(), rep.Grouping(1000, 1000), duration_s=2.0)["overall"]
    assert s["itl_s"]["p50"] == pytest.approx(0.025)
    assert s["ttft_s"]["p99"] == pytest.approx(0.1)
    assert s["output_tokens_per_s"] == pytest.approx((4 + 2) / 2.0)
    assert s["errors_by_status"] == {"client": 1}


def test_prefix_hit_rate_is_cached_over_prompt_tokens():
    results = [_r(0, 0.1, [0.01], n_in=100, cached=80), _r(1, 0.1, [0.01], n_in=100, cached=0)]
    s = rep.summarize(results, rep.Slo(), rep.Grouping(1000, 1000), duration_s=1.0)["overall"]
    assert s["prefix_hit_rate"] == pytest.approx(0.4)


def test_prefix_hit_rate_counts_only_the_prompts_of_requests_that_report_cached_tokens():
    """A request without cached_tokens says nothing about its prompt: it is not a miss."""
    results = [_r(0, 0.1, [0.01], n_in=100, cached=80), _r(1, 0.1, [0.01], n_in=100, cached=None)]
    s = rep.summarize(results, rep.Slo(), rep.Grouping(1000, 1000), duration_s=1.0)["overall"]
    assert s["prefix_hit_rate"] == pytest.approx(0.8)
    none = rep.summarize([_r(0, 0.1, [0.01])], rep.Slo(), rep.Grouping(1000, 1000), duration_s=1.0)
    assert none["overall"]["prefix_hit_rate"] is None


def test_compare_shows_a_run_without_goodput_as_a_zero_ratio():
    """0.00× when a run met no SLO; "–" only where the base is 0 (nothing to divide by)."""
    good = rep.summarize([_r(0, 0.2, [0.02])], rep.Slo(), rep.Grouping(1000, 1000), duration_s=1)
    # every request too slow for the 2 s TTFT SLO: no goodput
    slow = rep.summarize([_r(0, 5.0, [0.02])], rep.Slo(), rep.Grouping(1000, 1000), duration_s=1)
    assert slow["overall"]["goodput_requests_per_s"] == 0
    md = rep.compare_markdown([good, slow], ["good", "slow"])
    assert "| slow | 25.00× | 25.00× | 1.00× | 1.00× | 0.00× |" in md
    md = rep.compare_markdown([slow, good], ["slow", "good"])
    assert "| good | 0.04× | 0.04× | 1.00× | 1.00× | – |" in md


def test_compare_puts_runs_side_by_side_with_ratios_to_the_first():
    a = rep.summarize(
        [_r(0, 0.2, [0.02]), _r(1, 0.2, [0.02])], rep.Slo(), rep.Grouping(1000, 1000), duration_s=1
    )
    b = rep.summarize(
        [_r(0, 0.1, [0.04]), _r(1, 0.1, [0.04])], rep.Slo(), rep.Grouping(1000, 1000), duration_s=1
    )
    md = rep.compare_markdown([a, b], ["agg", "disagg"])
    assert "| all · agg |" in md and "| all · disagg |" in md
    assert "| disagg | 0.50× | 0.50× | 2.00× |" in md


def test_the_timeline_is_fetched_with_the_runs_api_key() -> None:
    """A frontend with API keys answers a timeline only to a key (401 otherwise): the load generator sends the
    one its requests use, and without one it has no phases to report."""
    from loadgen.client import LoadGenerator, RunConfig

    body = {"timeline_s": [["queued", 0.0], ["prefilling", 0.1], ["decoding", 0.4], ["done", 1.0]]}
    seen: list[str | None] = []

    def frontend(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        if request.headers.get("authorization") != "Bearer sk-run":
            return httpx.Response(401, json={"error": {"code": "invalid_api_key"}})
        return httpx.Response(200, json=body)

    async def fetch(key: str | None) -> dict[str, float] | None:
        gen = LoadGenerator(RunConfig(url="http://frontend", model="m", api_key=key, progress=False))
        async with httpx.AsyncClient(transport=httpx.MockTransport(frontend)) as client:
            return await gen._timeline(client, "chatcmpl-1")

    assert asyncio.run(fetch("sk-run")) == phases_from_timeline(body) is not None
    assert asyncio.run(fetch(None)) is None
    assert seen == ["Bearer sk-run", None]


def test_timeline_phases_split_into_queue_prefill_transfer_decode():
    body = {
        "timeline_s": [
            ["queued", 0.0],
            ["routed", 0.01],
            ["prefilling", 0.03],
            ["transferring", 0.23],
            ["decoding", 0.28],
            ["done", 1.28],
        ]
    }
    assert phases_from_timeline(body) == pytest.approx(
        {"queue": 0.03, "prefill": 0.2, "transfer": 0.05, "decode": 1.0}
    )
    assert phases_from_timeline({"error": {}}) is None


# ---- workloads --------------------------------------------------------------------------------------------------


def test_mooncake_equal_hash_ids_give_equal_token_blocks_and_equal_block_hashes():
    records = [
        {"timestamp": 0, "input_length": 1536, "output_length": 10, "hash_ids": [7, 8, 9]},
        {"timestamp": 500, "input_length": 1536, "output_length": 20, "hash_ids": [7, 8, 4]},
        {"timestamp": 1000, "input_length": 1024, "output_length": 30, "hash_ids": [5, 8]},
    ]
    a, b, c = mooncake(records, scale=16, seed=1)  # 32-token blocks
    assert a.token_ids[:64] == b.token_ids[:64] and a.token_ids[64:] != b.token_ids[64:]
    ha, hb, hc = (block_hashes(s.token_ids, 16) for s in (a, b, c))
    assert ha[:4] == hb[:4] and ha[4] != hb[4]  # two shared 32-token blocks = four 16-token KV blocks
    # the same hash id after a different parent is a different prefix: the chain sees that
    assert a.token_ids[32:64] == c.token_ids[32:64] and ha[2] != hc[2]
    # the simulator's shortcut computes the engine's hashes
    hasher = TraceBlockHasher(16)
    assert [hasher.hashes(s) for s in (a, b, c)] == [ha, hb, hc]
    # another seed is other tokens under the same hash ids: other hashes, from the same hasher too
    (other,) = mooncake(records[:1], scale=16, seed=2)
    theirs = hasher.hashes(other)
    assert theirs == block_hashes(other.token_ids, 16) and not set(theirs) & set(ha)


def test_the_shared_trace_hasher_keeps_its_memo_bounded_and_its_hashes_the_engines():
    records = [
        {"timestamp": i * 100, "input_length": 1536, "output_length": 4, "hash_ids": [1, 2 + i % 3, 10 + i]}
        for i in range(12)
    ]
    # the first request's chain again, its last block partial: the same (parent, hash id), other tokens
    records.append({"timestamp": 1200, "input_length": 1280, "output_length": 4, "hash_ids": [1, 2, 10]})
    specs = mooncake(records, scale=16)  # 32-token trace blocks: 3 memo entries a request, some shared
    truth = [block_hashes(s.token_ids, 16) for s in specs]
    assert truth[-1] == truth[0][:5]  # its 16 tokens are the full block's first 16: one KV block of its two
    bounded = TraceBlockHasher(16, max_hashes=8)  # 2 KV blocks an entry: 4 entries
    for _ in range(2):  # a second pass finds some blocks evicted and computes them again, the same
        assert [bounded.hashes(s) for s in specs] == truth
        assert len(bounded._memo) == 4
    # the most recently used stay: the last request's three blocks and the one before them
    assert list(bounded._memo)[-3:] == [(0, *k) for k in _keys(specs[-1], truth[-1])]
    # a hit makes an entry the most recent: of a, b, a, c (one trace block each) under room for two, a and c stay
    one = mooncake(
        [{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [h]} for h in (1, 2, 3)], 16
    )
    lru = TraceBlockHasher(16, max_hashes=4)
    for s in (one[0], one[1], one[0], one[2]):
        lru.hashes(s)
    assert [key[2] for key in lru._memo] == [1, 3]
    # one hasher per block size for the process (a planner's replays reuse its memo), bounded likewise
    shared = TraceBlockHasher.shared(16)
    assert shared is TraceBlockHasher.shared(16) and shared is not TraceBlockHasher.shared(32)
    assert shared.max_hashes == TraceBlockHasher.MEMO_HASHES
    bare = [dataclasses.replace(s, token_ids=None) for s in specs]
    for size in (16, 32):  # twice through the shared memo, for each block size
        want = [block_hashes(s.token_ids, size) for s in specs]
        assert block_hashes_for(bare, size) == want and block_hashes_for(bare, size) == want


def _keys(spec, hashes: list[int]) -> list[tuple[int, int, int]]:
    """(parent, hash id, tokens) of each of a 3-block trace request's 32-token blocks (16-token KV blocks)."""
    from services.engine.block_hash import ROOT_HASH

    ids = [int(h) for h in spec.tags["hash_ids"].split(",")]
    parents = [ROOT_HASH] + hashes[1::2][:2]
    tokens = [min(32, spec.input_tokens - 32 * i) for i in range(len(ids))]
    return list(zip(parents, ids, tokens, strict=True))


def test_mooncake_scale_shrinks_lengths_and_time_scale_stretches_arrivals():
    records = [
        {"timestamp": 0, "input_length": 1000, "output_length": 100, "hash_ids": [1, 2]},
        {"timestamp": 2000, "input_length": 513, "output_length": 9, "hash_ids": [1, 3]},
    ]
    a, b = mooncake(records, scale=32, output_scale=10, time_scale=0.5)
    assert (a.input_tokens, a.output_tokens, len(a.token_ids)) == (32, 10, 32)
    assert (b.input_tokens, b.output_tokens, b.arrival_s) == (17, 1, 1.0)
    with pytest.raises(ValueError, match="must divide 512"):
        mooncake(records, scale=3)


def test_text_sessions_repeat_the_system_prompt_and_the_conversation_so_far():
    specs = text_sessions(
        2, 3, Lengths(10, 20), Lengths(5, 5), seed=0, system_prompt_tokens=50, system_prompts=1
    )
    by_session = {}
    for s in specs:
        by_session.setdefault(s.tags["session"], []).append(s)
    turns = by_session["0"]
    assert [len(t.messages) for t in turns] == [2, 4, 6]
    assert turns[1].messages[:2] == turns[0].messages
    assert turns[2].messages[:4] == turns[1].messages
    assert [m["role"] for m in turns[2].messages] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert by_session["1"][0].messages[0] == turns[0].messages[0]  # one shared system prompt
    assert 50 + 10 <= turns[0].input_tokens <= 50 + 20


def test_lengths_and_arrivals_reject_bad_settings():
    assert Lengths.parse("uniform:3:9") == Lengths(3, 9)
    for bad in ("fixed:0", "uniform:9:3", "normal:5", "fixed:x"):
        with pytest.raises(ValueError):
            Lengths.parse(bad)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals([], 0.0, 0)


# ---- a real cluster ---------------------------------------------------------------------------------------------


@pytest.mark.cluster
def test_bench_run_against_rackserve_up_times_every_request(tmp_path):
    """`rackserve bench run` streams a handful of requests at a real cluster; every one completes with a
    measured TTFT and one inter-token gap per token after the first, and the report files are written."""
    with rackserve_up(
        "--prefill", "0", "--decode", "1", "--mode", "agg", log_path=str(tmp_path / "up.log")
    ) as url:
        out = tmp_path / "run"
        cmd = [sys.executable, "-m", "services.cli", "bench", "run", "--url", url, "--workload", "synthetic"]
        cmd += [
            "--num-requests",
            "6",
            "--input-len",
            "uniform:16:96",
            "--output-len",
            "fixed:6",
            "--concurrency",
        ]
        cmd += ["3", "--shared-prefix-tokens", "32", "--out", str(out), "--no-progress"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    reqs = report["requests"]
    assert len(reqs) == 6 and all(r["ok"] and r["status"] == 200 for r in reqs)
    for r in reqs:
        assert r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"]
        assert 2 <= r["output_tokens"] <= 6 and len(r["itl_s"]) >= 1 and all(g >= 0 for g in r["itl_s"])
    assert report["overall"]["output_tokens_per_s"] > 0
    assert "| **all** | 6 | 0 |" in proc.stdout
    for name in ("report.md", "run_cdf.png", "run_groups.png"):
        assert os.path.getsize(out / name) > 0
