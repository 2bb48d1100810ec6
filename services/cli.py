"""The `rackserve` command. Each subcommand imports only what it runs.

rackserve generate --prompt "What is the capital of France?"     # one chat turn on the local engine
rackserve timeline --log requests.jsonl --last 20 --out t.html   # request waterfalls from the request log
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from services.runtime.args import client_api_key, positive_int


def _build_engine(a: argparse.Namespace):  # noqa: ANN202 - imported lazily
    from services.engine.engine import LLMEngine
    from services.runtime.args import engine_config, model_path

    return LLMEngine(model_path(a), engine_config(a))


def cmd_generate(a: argparse.Namespace) -> int:
    from services.engine.sampling import SamplingParams
    from services.engine.tokenizer import IncrementalDetokenizer

    engine = _build_engine(a)
    tok = engine.tokenizer
    if a.raw:
        ids = tok.encode(a.prompt)
    else:
        ids = tok.encode_chat([{"role": "user", "content": a.prompt}])
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed)
    engine.add_request("cli", ids, params)
    detok = IncrementalDetokenizer(tok, prompt_ids=ids)
    t0 = time.perf_counter()
    first = None
    n = 0
    while engine.has_unfinished():
        for out in engine.step():
            first = first or time.perf_counter()
            for t in out.new_token_ids:
                n += 1
                sys.stdout.write(detok.push(t))
                sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    end = time.perf_counter()
    if first is not None:
        decode_tps = (n - 1) / (end - first) if n > 1 and end > first else 0.0
        print(
            f"[{len(ids)} prompt tokens, {n} generated; TTFT {first - t0:.3f}s, decode {decode_tps:.1f} tok/s]",
            file=sys.stderr,
        )
    return 0


def cmd_timeline(a: argparse.Namespace) -> int:
    """Draw request timelines — one by id from a frontend, or the last N of a request log — as HTML."""
    import json

    from services.telemetry.waterfall import read_request_log, render_html

    if a.url:
        import httpx

        if not a.id:
            raise ValueError("--url needs --id (the request id, e.g. the x-request-id response header)")
        headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
        try:
            r = httpx.get(f"{a.url.rstrip('/')}/v1/requests/{a.id}/timeline", headers=headers, timeout=10)
        except httpx.HTTPError as e:
            raise ValueError(f"{a.url}: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise ValueError(f"{a.url}: HTTP {r.status_code}: {r.text[:300]}")
        records = [r.json()]
    else:
        with open(a.log, encoding="utf-8") as f:
            records = read_request_log(f)
        if a.id:
            records = [r for r in records if a.id in (r["request_id"], r.get("client_request_id"))]
        records = records[-a.last :]
        if not records:
            raise ValueError(f"{a.log}: no matching request timelines")
    with open(a.out, "w", encoding="utf-8") as f:
        f.write(render_html(records))
    print(json.dumps({"out": a.out, "requests": len(records)}))
    return 0


_SERVICES = {
    "frontend": "the OpenAI-compatible HTTP frontend and request coordinator",
    "router": "the router (placement by estimated time to first token)",
    "prefill": "a prefill worker",
    "decode": "a decode worker",
    "planner": "the planner (sizes the prefill and decode pools from measured load and the SLO)",
}


def cmd_quantize(a: argparse.Namespace) -> int:
    from services.engine.model_files import smollm2_gguf_path
    from services.engine.nvfp4.export import quantize_to_dir

    times = quantize_to_dir(
        a.model or smollm2_gguf_path(),
        a.method,
        a.out,
        a.layout,
        progress=lambda m: print(m, file=sys.stderr),
        act_order=a.act_order,
        activations=a.activations,
        smooth=a.smooth,
    )
    print(
        f"wrote {a.out} ({a.layout}, {a.method}, {a.activations} activations): "
        + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
    )
    return 0


def _run_service(name: str, argv: list[str]) -> int:
    """Each service owns its flags: `rackserve decode --help` shows the decode worker's."""
    import asyncio
    import importlib

    module = importlib.import_module(f"services.{name}.server")
    parser = argparse.ArgumentParser(prog=f"rackserve {name}", description=_SERVICES[name])
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        asyncio.run(module.serve(args))
    except KeyboardInterrupt:
        pass
    # a setting, a file, a port, etcd: its message (a bug keeps its traceback)
    except (OSError, ValueError) as e:
        print(f"rackserve {name}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="rackserve", description="Disaggregated LLM inference cluster")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="run one prompt on a local engine and stream the answer")
    from services.runtime.args import add_engine_arguments

    add_engine_arguments(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=cmd_generate)

    up = sub.add_parser("up", help="run a whole cluster on this machine")
    from services import launcher

    launcher.add_arguments(up)
    up.set_defaults(func=launcher.run)

    bench = sub.add_parser(
        "bench", help="load generator and simulator: run a workload at an endpoint, compare runs, simulate"
    )
    from loadgen.cli import add_arguments as add_bench_arguments
    from loadgen.cli import run_parsed as run_bench

    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench)
    from services.engine.config import NVFP4_ACTIVATIONS, NVFP4_METHODS

    qz = sub.add_parser(
        "quantize", help="write an NVFP4 checkpoint (compressed-tensors or ModelOpt) of a model"
    )
    qz.add_argument(
        "--model", default="", help="a .gguf file or a dense Hugging Face directory (default: SmolLM2)"
    )
    qz.add_argument("--method", default="rtn", choices=NVFP4_METHODS,
                    help="how scales and codes are chosen (docs/nvfp4-quality.md); gptq calibrates first")  # fmt: skip
    qz.add_argument("--out", required=True, help="the directory to write")
    qz.add_argument("--layout", default="compressed-tensors", choices=("compressed-tensors", "modelopt"))
    qz.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=None,
                    help="gptq: quantize columns by decreasing Hessian diagonal (default: on); "
                    "--no-act-order keeps index order")  # fmt: skip
    qz.add_argument("--activations", default="16bit", choices=NVFP4_ACTIVATIONS,
                    help="what the weights are quantized for: 16bit (W4A16), or nvfp4 (W4A4: static activation "
                    "scales calibrated and written with them)")  # fmt: skip
    qz.add_argument("--smooth", type=float, default=None, metavar="ALPHA",
                    help="smooth before quantizing (SmoothQuant's migration, alpha in (0, 1], e.g. 0.9): input "
                    "ranges moved into q/k/v and gate/up, folded into the RMSNorm weights before them")  # fmt: skip
    qz.set_defaults(func=cmd_quantize)

    tl = sub.add_parser("timeline", help="draw request timelines as a waterfall (HTML)")
    source = tl.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="a frontend, e.g. http://127.0.0.1:8000 (with --id)")
    source.add_argument("--log", help="a request log written with the frontend's --request-log")
    tl.add_argument(
        "--id", default="", help="one request: its id (x-request-id) or the client's x-request-id"
    )
    tl.add_argument(
        "--api-key",
        default=client_api_key(),
        help="with --url: the frontend's Bearer key, where it has keys (default: $OPENAI_API_KEY, else the first "
        "of $RACKSERVE_API_KEY)",
    )
    tl.add_argument("--last", type=positive_int, default=20, help="with --log: the last N requests")
    tl.add_argument("--out", default="timeline.html", help="the HTML file to write")
    tl.set_defaults(func=cmd_timeline)

    for name, help_text in _SERVICES.items():
        sp = sub.add_parser(name, help=help_text)
        sp.set_defaults(service=name)

    args_list = sys.argv[1:] if argv is None else argv
    if args_list and args_list[0] in _SERVICES:
        return _run_service(args_list[0], args_list[1:])
    a = parser.parse_args(argv)
    try:
        return int(a.func(a))
    except (OSError, ValueError, RuntimeError) as e:
        print(f"rackserve: error: {e}", file=sys.stderr)
        return 2
    # Ctrl-C (generate, bench, quantize): the user stopped it, no traceback; the shell's status for SIGINT
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
