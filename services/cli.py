"""The `rackserve` command. Each subcommand imports only what it runs.

rackserve generate --prompt "What is the capital of France?"     # one chat turn on the local engine
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model", default="", help="a .gguf file or a Hugging Face directory (default: SmolLM2-135M)"
    )
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--quant", default="none", choices=["none", "nvfp4"])
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--max-model-len", type=int, default=0)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


def _build_engine(a: argparse.Namespace):  # noqa: ANN202 - imported lazily
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.engine.model_files import smollm2_gguf_path

    cfg = EngineConfig(
        dtype=a.dtype,
        quant=a.quant,
        block_size=a.block_size,
        kv_cache_bytes=a.kv_cache_bytes,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len,
        enable_prefix_caching=not a.no_prefix_caching,
        num_threads=a.threads,
    )
    return LLMEngine(a.model or smollm2_gguf_path(), cfg)


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


_SERVICES = {
    "frontend": "the OpenAI-compatible HTTP frontend and request coordinator",
    "router": "the router (placement by estimated time to first token)",
    "prefill": "a prefill worker",
    "decode": "a decode worker",
}


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
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="rackserve", description="Disaggregated LLM inference cluster")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="run one prompt on a local engine and stream the answer")
    _engine_args(gen)
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

    for name, help_text in _SERVICES.items():
        sp = sub.add_parser(name, help=help_text)
        sp.set_defaults(service=name)

    args_list = sys.argv[1:] if argv is None else argv
    if args_list and args_list[0] in _SERVICES:
        return _run_service(args_list[0], args_list[1:])
    a = parser.parse_args(argv)
    try:
        return int(a.func(a))
    except (FileNotFoundError, ValueError) as e:
        print(f"rackserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
