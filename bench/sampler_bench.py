"""The sampler over a batch with every processor on, and a sampled decode step: before and now, side by side.

    python -m bench.sampler_bench [--before 17e5769] [--rounds 5] [--engine-rounds 2] [--batch 64]

Per arm, child processes import rackserve from that arm's tree — `before`: the commit given by --before, checked
out into a temporary git worktree (removed after); `now`: this checkout — with one torch thread:
1. `sample_batch` over one fixed batch: SmolLM2's vocabulary (49,152), `--batch` rows each with a `--prompt`-token
   prompt and `--output` generated tokens, temperature 0.7 with top-k 50, top-p 0.9, min-p 0.05, repetition,
   frequency and presence penalties, a min_tokens ban and a grammar bitmask on every row; each arm's best of 3
   calls per round, `--rounds` A/B rounds after a warm-up round;
2. the engine's decode step on SmolLM2-135M (bf16) at batch `--batch`, greedy and at temperature 0.7 (32-token
   prompts, 40 tokens each, timed after the batch is prefilled), `--engine-rounds` A/B rounds.
Reported: medians per arm and now/before. Before 2026-12-06 the penalties flattened every prompt and output token in
Python lists each step, and a sampled row drew `vocab` seeded exponentials (the exponential race); now numpy, and
an inverse-CDF draw at one uniform hashed from (seed, index) — the same contract, other tokens for a given seed.
Writes bench/results/sampler.md. Benchmarks never run in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

from bench.report import publish

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from services.engine.sampling import RowContext, SamplingParams, sample_batch
torch.set_num_threads(1)
B, P, O, V = (int(a) for a in sys.argv[2:6])
g = torch.Generator().manual_seed(0)
bitmask = torch.full((-(-V // 32),), -1, dtype=torch.int32)
bitmask[7] = 0
rows = [RowContext(prompt_ids=torch.randint(0, V, (P,), generator=g).tolist(),
                   output_ids=torch.randint(0, V, (O,), generator=g).tolist(), banned=[2], bitmask=bitmask)
        for _ in range(B)]
params = [SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, seed=i, repetition_penalty=1.1,
                         frequency_penalty=0.3, presence_penalty=0.2) for i in range(B)]
logits = torch.randn(B, V, generator=g) * 4
best, tokens = 1e9, None
for _ in range(3):
    t0 = time.perf_counter()
    out = sample_batch(logits, params, [O] * B, rows)
    best = min(best, time.perf_counter() - t0)
    tokens = [s.token_id for s in out]
nucleus = [SamplingParams(temperature=0.7, top_p=0.9, seed=i) for i in range(B)]  # top-p alone, no processor
best_p = 1e9
for _ in range(3):
    t0 = time.perf_counter()
    sample_batch(logits, nucleus, [O] * B)
    best_p = min(best_p, time.perf_counter() - t0)
print(json.dumps({"s": best, "top_p_s": best_p, "tokens": tokens}))
"""


ENGINE_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.model_files import smollm2_gguf_path
from services.engine.sampling import SamplingParams
torch.set_num_threads(1)
B = int(sys.argv[2])
cfg = EngineConfig(dtype="bfloat16", num_kv_blocks=2048, max_num_seqs=B, max_num_batched_tokens=4096, num_threads=1)
e = LLMEngine(smollm2_gguf_path(), cfg)
out = {}
for name, temp in (("greedy", 0.0), ("sampled", 0.7)):
    p = SamplingParams(max_tokens=40, temperature=temp, seed=3, ignore_eos=True)
    for i in range(B):
        e.add_request(f"{name}{i}", list(range(10 + i, 42 + i)), p)
    steps, t0 = 0, 0.0
    while e.has_unfinished():
        if steps == 5:  # prefilled and warm: decode steps of the whole batch from here
            t0 = time.perf_counter()
        e.step()
        steps += 1
    out[name] = (time.perf_counter() - t0) / (steps - 5)
print(json.dumps(out))
"""


def run_engine_arm(tree: str, batch: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", ENGINE_CHILD, tree, str(batch)], capture_output=True, text=True, timeout=900,
        check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_arm(tree: str, a: argparse.Namespace) -> dict:
    args = [str(a.batch), str(a.prompt), str(a.output), "49152"]
    out = subprocess.run(
        [sys.executable, "-c", CHILD, tree, *args], capture_output=True, text=True, timeout=600, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--before", default="17e5769", help="the commit to compare with (default: before the change)"
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--output", type=int, default=1024)
    ap.add_argument(
        "--engine-rounds", type=int, default=2, help="A/B rounds of the engine's decode step (0: none)"
    )
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = os.path.join(tmp, "before")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "-q", "--detach", before, a.before], check=True)
        try:
            trees = {"before": before, "now": ROOT}
            times: dict[str, list[float]] = {arm: [] for arm in trees}
            top_p_times: dict[str, list[float]] = {arm: [] for arm in trees}
            tokens: dict[str, list[int]] = {}
            steps: dict[str, dict[str, list[float]]] = {arm: {"greedy": [], "sampled": []} for arm in trees}
            for r in range(a.rounds + 1):
                for arm, tree in trees.items():  # A/B/A/B
                    res = run_arm(tree, a)
                    tokens[arm] = res["tokens"]
                    if r:  # round 0 warms up
                        times[arm].append(res["s"])
                        top_p_times[arm].append(res["top_p_s"])
            for _ in range(a.engine_rounds):
                for arm, tree in trees.items():  # A/B/A/B
                    for mode, sec in run_engine_arm(tree, a.batch).items():
                        steps[arm][mode].append(sec)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", before], check=False)
    med = {arm: statistics.median(v) for arm, v in times.items()}
    lines = [
        f"**The sampler, every processor on** — {a.batch} rows x 49,152 logits, {a.prompt}-token prompts, "
        f"{a.output} generated tokens; one torch thread, {platform.processor() or platform.machine()}; median of "
        f"{a.rounds} A/B rounds (best of 3 calls each); before = {a.before}",
        "",
        "| arm | sample_batch ms, every processor | temperature + top-p 0.9 alone |",
        "|---|---|---|",
        *(
            f"| {arm} | {med[arm] * 1e3:.1f} | {statistics.median(top_p_times[arm]) * 1e3:.1f} |"
            for arm in med
        ),
        "",
        f"now / before: x{med['now'] / med['before']:.2f}; same tokens: {tokens['now'] == tokens['before']} "
        "(not before 2026-12-06's inverse-CDF draw)",
    ]
    if not a.engine_rounds:
        publish(lines, "sampler.md")
        return
    lines += [
        "",
        f"**A decode step of SmolLM2-135M at batch {a.batch}** (bf16, one torch thread, 32-token prompts, 40 tokens "
        f"each; steps after the batch prefilled), median of {a.engine_rounds} A/B rounds, ms per step:",
        "",
        "| arm | greedy | temperature 0.7 | sampled / greedy |",
        "|---|---|---|---|",
    ]
    for arm in trees:
        g, smp = (statistics.median(steps[arm][m]) * 1e3 for m in ("greedy", "sampled"))
        lines.append(f"| {arm} | {g:.1f} | {smp:.1f} | x{smp / g:.2f} |")
    sampled = {arm: statistics.median(steps[arm]["sampled"]) for arm in trees}
    lines += ["", f"sampled step, now / before: x{sampled['now'] / sampled['before']:.2f}"]
    publish(lines, "sampler.md")


if __name__ == "__main__":
    main()
