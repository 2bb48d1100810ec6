"""Offline NVFP4 recipes on SmolLM2-135M: which `rackserve quantize` settings lose the least, W4A16 and W4A4.

    python -m bench.nvfp4_recipe_bench [--windows N] [--held-out M] [--alphas 0.5,0.75,0.9] [--threads T]

Every row is a checkpoint `rackserve quantize` writes (`quantize_to_dir`, as the CLI calls it) for one method
(rtn or gptq) and one smoothing alpha (none or `--smooth ALPHA`), always with `--activations nvfp4`, so that
the one checkpoint carries static activation scales and serves both ways. Each is loaded the way a worker
loads it and scored by teacher-forced perplexity against the unquantized float32 model, three ways:
W4A16 (`--nvfp4-gemm w4a16`), W4A4 under the checkpoint's static scales (`--nvfp4-gemm w4a4`), and W4A4 with
one tensor scale per call (the scales dropped, as a checkpoint without them is served).

The windows are the first N 512-token windows of /usr/share/common-licenses/GPL-3 (the other benches' text)
and, held out, the next M: choosing an alpha by the first set and reading it on the second says whether the
choice flatters. Calibration (gptq's Hessians, the smoothing maxima, the static scales) reads other texts
(calibration.calibration_windows). Writes bench/results/nvfp4_recipes.md. Benchmarks never assert; this one
reports.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench.nvfp4_quality_bench import WINDOW_TOKENS, score
from bench.nvfp4_w4a4_bench import static_scales
from bench.report import publish
from services.engine.engine import EngineConfig, LLMEngine
from services.engine.loader import load_gguf, load_model
from services.engine.model_files import smollm2_gguf_path
from services.engine.nvfp4.calibration import EVALUATION_TEXT
from services.engine.nvfp4.export import quantize_to_dir
from services.engine.tokenizer import Tokenizer

METHODS = ("rtn", "gptq")
# (label, nvfp4_gemm, keep the checkpoint's static activation scales)
SERVINGS = (("W4A16", "w4a16", True), ("W4A4 static", "w4a4", True), ("W4A4 per call", "w4a4", False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=8, help="512-token windows of GPL-3 to choose by")
    ap.add_argument("--held-out", type=int, default=6, help="the windows after those, to read the choice on")
    ap.add_argument("--alphas", default="0.5,0.75,0.9", help="smoothing alphas besides none")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    gguf = smollm2_gguf_path()
    tok = Tokenizer.from_gguf(gguf)
    corpus = tok.encode(EVALUATION_TEXT.read_text())
    n = args.windows + args.held_out
    if len(corpus) < n * WINDOW_TOKENS:
        raise SystemExit(f"{EVALUATION_TEXT} has {len(corpus) // WINDOW_TOKENS} windows, not {n}")
    windows = [torch.tensor(corpus[i * WINDOW_TOKENS : (i + 1) * WINDOW_TOKENS]) for i in range(n)]
    sets = {"chosen on": windows[: args.windows], "held out": windows[args.windows :]}
    dense = LLMEngine(load_gguf(gguf), EngineConfig(dtype="float32")).model
    refs = {name: score(dense, ws) for name, ws in sets.items()}
    alphas: list[float | None] = [None, *(float(a) for a in args.alphas.split(",") if a)]
    rows: list[tuple[str, dict[str, tuple[float, float]], float]] = []
    for method in METHODS:
        for alpha in alphas:
            label = f"`--method {method}`" + (f" `--smooth {alpha}`" if alpha is not None else "")
            with tempfile.TemporaryDirectory(prefix="rackserve-recipe-") as out:
                times = quantize_to_dir(gguf, method, out, activations="nvfp4", smooth=alpha)
                cells: dict[str, tuple[float, float]] = {}
                for serving, gemm, static in SERVINGS:
                    cfg = EngineConfig(dtype="float32", nvfp4_gemm=gemm, nvfp4_cache_dequantized=True)
                    model = LLMEngine(load_model(Path(out)), cfg).model
                    if not static:
                        static_scales(model, None)
                    for name, ws in sets.items():
                        ppl, top = score(model, ws)
                        ref_ppl, ref_top = refs[name]
                        cells[f"{serving} {name}"] = (ppl / ref_ppl, float((top == ref_top).float().mean()))
                    print(label, *(f"{k}: {v[0]:.4f}x" for k, v in cells.items() if k.startswith(serving)))
            rows.append((label, cells, sum(times.values())))
    heads = [f"{s} {name}" for s, _, _ in SERVINGS for name in sets]
    lines = [
        "# Offline NVFP4 recipes on SmolLM2-135M-Instruct",
        "",
        f"`python -m bench.nvfp4_recipe_bench --windows {args.windows} --held-out {args.held_out} --alphas "
        f"{args.alphas} --threads {args.threads}` — torch {torch.__version__}; perplexity ratio to the "
        f"unquantized float32 model (top-1 agreement) on windows 0-{args.windows - 1} ('chosen on') and "
        f"{args.windows}-{n - 1} ('held out') of {EVALUATION_TEXT}, {WINDOW_TOKENS} tokens each; every "
        f"checkpoint written with `--activations nvfp4`; {time.perf_counter() - t_start:.0f} s.",
        "",
        "| `rackserve quantize` | " + " | ".join(heads) + " | quantize s |",
        "|---|" + "---|" * (len(heads) + 1),
        *(
            f"| {label} | "
            + " | ".join(f"{cells[h][0]:.4f}x ({cells[h][1]:.3f})" for h in heads)
            + f" | {seconds:.0f} |"
            for label, cells, seconds in rows
        ),
    ]
    publish(lines, "nvfp4_recipes.md")


if __name__ == "__main__":
    main()
