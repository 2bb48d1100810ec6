"""The sampler over a batch with every processor on: before and now, side by side.

    python -m bench.sampler_bench [--before 17e5769] [--rounds 5] [--batch 64] [--prompt 2048] [--output 1024]

Per arm, a child process imports services/engine/sampling.py from that arm's tree — `before`: the commit given by
--before, checked out into a temporary git worktree (removed after); `now`: this checkout — and times
`sample_batch` over one fixed batch: SmolLM2's vocabulary (49,152), `--batch` rows each with a `--prompt`-token
prompt and `--output` generated tokens, temperature 0.7 with top-k 50, top-p 0.9, min-p 0.05, repetition,
frequency and presence penalties, a min_tokens ban and a grammar bitmask on every row, one torch thread. A/B/A/B:
`--rounds` rounds, each arm's best of 3 calls per round (the first round unmeasured, a warm-up); reported: the
median per arm, now/before, and whether both gave the same tokens. Before 2026-12-06 the penalties flattened
every prompt and output token in Python (37 ms of the call at the defaults). Writes bench/results/sampler.md.
Benchmarks never run in tests.
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
print(json.dumps({"s": best, "tokens": tokens}))
"""


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
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = os.path.join(tmp, "before")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "-q", "--detach", before, a.before], check=True)
        try:
            trees = {"before": before, "now": ROOT}
            times: dict[str, list[float]] = {arm: [] for arm in trees}
            tokens: dict[str, list[int]] = {}
            for r in range(a.rounds + 1):
                for arm, tree in trees.items():  # A/B/A/B
                    res = run_arm(tree, a)
                    tokens[arm] = res["tokens"]
                    if r:  # round 0 warms up
                        times[arm].append(res["s"])
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", before], check=False)
    med = {arm: statistics.median(v) for arm, v in times.items()}
    lines = [
        f"**The sampler, every processor on** — {a.batch} rows x 49,152 logits, {a.prompt}-token prompts, "
        f"{a.output} generated tokens; one torch thread, {platform.processor() or platform.machine()}; median of "
        f"{a.rounds} A/B rounds (best of 3 calls each); before = {a.before}",
        "",
        "| arm | sample_batch ms |",
        "|---|---|",
        *(f"| {arm} | {med[arm] * 1e3:.1f} |" for arm in med),
        "",
        f"now / before: x{med['now'] / med['before']:.2f}; same tokens: {tokens['now'] == tokens['before']}",
    ]
    publish(lines, "sampler.md")


if __name__ == "__main__":
    main()
