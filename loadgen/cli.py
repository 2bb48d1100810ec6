"""`python -m loadgen` / `rackserve bench`: run a workload against an endpoint, compare runs, or simulate.

  rackserve bench run --url http://127.0.0.1:8000 --workload synthetic --input-len uniform:32:512 \\
      --output-len fixed:32 --arrival open --rate 2 --num-requests 100 --out bench/results/run1
  rackserve bench run --workload mooncake --scale 32 --time-scale 0.1 --trace-limit 200 ...
  rackserve bench compare bench/results/agg/report.json bench/results/disagg/report.json --names agg disagg
  rackserve bench sim --workload mooncake --profile h200 --prefill 4 --decode 4 --policy ttft
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from loadgen import report as rep
from loadgen.workload import Lengths, RequestSpec, poisson_arrivals, synthetic, text_sessions
from services.runtime.args import client_api_key, positive_int


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=("synthetic", "text", "mooncake"), default="synthetic")
    g.add_argument("--num-requests", type=positive_int, default=None, help="stop after this many requests")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--input-len", default="uniform:32:256", help="synthetic prompt tokens: fixed:N | uniform:LO:HI"
    )
    g.add_argument("--output-len", default="uniform:8:64", help="output tokens: fixed:N | uniform:LO:HI")
    g.add_argument(
        "--shared-prefix-tokens", type=int, default=0, help="synthetic: tokens every prompt shares"
    )
    g.add_argument("--prefix-groups", type=int, default=1, help="synthetic: distinct shared prefixes")
    g.add_argument("--sessions", type=int, default=8, help="text: conversations")
    g.add_argument("--turns", type=int, default=3, help="text: turns per conversation")
    g.add_argument("--user-len", default="uniform:20:80", help="text: tokens per user turn")
    g.add_argument("--system-prompt-tokens", type=int, default=200, help="text: shared system prompt length")
    g.add_argument("--system-prompts", type=int, default=1, help="text: distinct system prompts")
    g.add_argument("--trace", default=None, help="mooncake: the trace .jsonl (default: loadgen/traces/)")
    g.add_argument("--trace-limit", type=int, default=None, help="mooncake: first N records")
    g.add_argument("--scale", type=int, default=32, help="mooncake: 512-token blocks become 512/scale tokens")
    g.add_argument("--output-scale", type=float, default=1.0, help="mooncake: divide output lengths by this")
    g.add_argument("--max-output-tokens", type=int, default=None, help="cap every request's output")
    g.add_argument(
        "--time-scale", type=float, default=1.0, help="mooncake: multiply timestamps (0.5 = 2x rate)"
    )
    g.add_argument("--arrival", choices=("closed", "open"), default="closed")
    g.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    g.add_argument("--concurrency", type=int, default=8, help="closed loop: requests in flight")
    g.add_argument("--duration-s", type=float, default=None, help="stop starting requests after this long")

    r = p.add_argument_group("report")
    r.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    r.add_argument("--slo-itl-ms", type=float, default=200.0, help="SLO on each request's ITL p90")
    r.add_argument("--long-input-tokens", type=int, default=None, help="default: the workload's median")
    r.add_argument("--long-output-tokens", type=int, default=None, help="default: the workload's median")
    r.add_argument("--out", default=None, help="write report.json, report.md and PNG plots here")
    r.add_argument("--name", default=None, help="this run's name in reports")
    r.add_argument("--no-plots", action="store_true")


def build_workload(a: argparse.Namespace) -> list[RequestSpec]:
    if a.workload == "synthetic":
        n = a.num_requests or 100
        specs = synthetic(
            n,
            Lengths.parse(a.input_len),
            Lengths.parse(a.output_len),
            a.seed,
            a.shared_prefix_tokens,
            a.prefix_groups,
        )
    elif a.workload == "text":
        specs = text_sessions(
            a.sessions,
            a.turns,
            Lengths.parse(a.user_len),
            Lengths.parse(a.output_len),
            a.seed,
            a.system_prompt_tokens,
            a.system_prompts,
        )
    else:
        from loadgen import trace

        records = trace.load_records(a.trace or trace.DEFAULT_TRACE, a.trace_limit)
        specs = trace.mooncake(
            records,
            a.scale,
            a.output_scale,
            a.time_scale,
            a.seed,
            a.max_output_tokens,
            materialize=getattr(a, "materialize", True),
        )
    if a.max_output_tokens is not None:
        for s in specs:
            s.output_tokens = min(s.output_tokens, a.max_output_tokens)
    if a.num_requests is not None:
        specs = specs[: a.num_requests]
    if a.arrival == "open" and (a.rate is not None or a.workload != "mooncake"):
        if a.rate is None:
            raise ValueError(
                "--arrival open needs --rate for this workload (only a trace carries its own times)"
            )
        specs = poisson_arrivals(specs, a.rate, a.seed)
    return specs


def grouping_for(a: argparse.Namespace, specs: list[RequestSpec]) -> rep.Grouping:
    median = rep.Grouping.by_median([s.input_tokens for s in specs], [s.output_tokens for s in specs])
    return rep.Grouping(
        a.long_input_tokens if a.long_input_tokens is not None else median.long_input_tokens,
        a.long_output_tokens if a.long_output_tokens is not None else median.long_output_tokens,
    )


def write_outputs(report: dict[str, Any], a: argparse.Namespace, name: str) -> None:
    md = rep.to_markdown(report, title=name)
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        rep.save_json(report, os.path.join(a.out, "report.json"))
        with open(os.path.join(a.out, "report.md"), "w") as f:
            f.write(md)
        if not a.no_plots:
            from loadgen.plots import all_plots

            for path in all_plots([report], [name], a.out, "run"):
                print(f"wrote {path}", file=sys.stderr)
        print(f"wrote {os.path.join(a.out, 'report.json')}", file=sys.stderr)


def _default_model(url: str, api_key: str | None = None) -> str:
    """The first model the endpoint lists: asked with the run's key (a frontend with keys refuses /v1/* without
    one), and an endpoint not answering is this command's error, one line, not a traceback."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=10.0)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except httpx.HTTPStatusError as e:
        raise ValueError(f"{url}/v1/models: HTTP {e.response.status_code}: {e.response.text[:300]}") from e
    except httpx.HTTPError as e:
        raise ValueError(f"{url}: {type(e).__name__}: {e} (is the server running? --url)") from e
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise ValueError(f"{url}/v1/models lists no model ({type(e).__name__}); name one with --model") from e


def cmd_run(a: argparse.Namespace) -> int:
    from loadgen.client import LoadGenerator, RunConfig

    specs = build_workload(a)
    cfg = RunConfig(
        url=a.url,
        model=a.model or _default_model(a.url, a.api_key),
        mode=a.arrival,
        concurrency=a.concurrency,
        max_requests=a.num_requests,
        duration_s=a.duration_s,
        request_timeout_s=a.request_timeout_s,
        temperature=a.temperature,
        api_key=a.api_key,
        fetch_timeline=not a.no_timeline,
        progress=not a.no_progress,
    )
    results, wall_s = asyncio.run(LoadGenerator(cfg).run(specs))
    name = a.name or f"{a.workload}-{a.arrival}"
    meta = {"name": name, "kind": "measured", "url": a.url, "model": cfg.model, "argv": sys.argv[1:]}
    report = rep.summarize(
        results, rep.Slo(a.slo_ttft_ms / 1000, a.slo_itl_ms / 1000), grouping_for(a, specs), meta
    )
    write_outputs(report, a, name)
    return 0 if report["overall"]["errors"] == 0 else 1


def cmd_compare(a: argparse.Namespace) -> int:
    reports = [rep.load_json(p) for p in a.reports]
    names = a.names or [
        r["meta"].get("name") or os.path.basename(os.path.dirname(p))
        for r, p in zip(reports, a.reports, strict=True)
    ]
    if len(names) != len(reports):
        raise ValueError(f"--names gives {len(names)} names for {len(reports)} reports")
    md = rep.compare_markdown(reports, names)
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "compare.md"), "w") as f:
            f.write(md)
        from loadgen.plots import all_plots

        for path in all_plots(reports, names, a.out, "compare"):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True)
    run = sub.add_parser("run", help="send a workload to an OpenAI-compatible endpoint and report")
    run.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    run.add_argument("--model", default=None, help="default: the first model /v1/models lists")
    run.add_argument(
        "--api-key", default=client_api_key() or None,
        help="the Bearer key (default: $OPENAI_API_KEY, else the first of $RACKSERVE_API_KEY)",
    )  # fmt: skip
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument(
        "--request-timeout-s", type=float, default=300.0,
        help="each request's whole deadline, from sending it to [DONE]; a request past it is a timeout error",
    )  # fmt: skip
    run.add_argument("--no-timeline", action="store_true", help="don't fetch /v1/requests/{id}/timeline")
    run.add_argument("--no-progress", action="store_true")
    add_workload_arguments(run)
    run.set_defaults(bench_func=cmd_run)

    cmp = sub.add_parser("compare", help="put two or more report.json files side by side")
    cmp.add_argument("reports", nargs="+")
    cmp.add_argument("--names", nargs="+", default=None)
    cmp.add_argument("--out", default=None, help="write compare.md and plots here")
    cmp.set_defaults(bench_func=cmd_compare)

    from loadgen.sim.cli import add_sim_arguments, cmd_sim

    sim = sub.add_parser("sim", help="run a workload through the discrete-event simulator")
    add_sim_arguments(sim)
    add_workload_arguments(sim)
    sim.set_defaults(bench_func=cmd_sim)


def run_parsed(a: argparse.Namespace) -> int:
    try:
        return int(a.bench_func(a))
    except (FileNotFoundError, ValueError) as e:
        print(f"loadgen: error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen", description="rackserve load generator and simulator"
    )
    add_arguments(parser)
    return run_parsed(parser.parse_args(argv))
