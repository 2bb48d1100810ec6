"""A decode worker's KV import and its other streams: how long their step takes when a prompt's KV arrives.

    python -m bench.kv_import_bench [--reps 5] [--tokens 2048,4096,8000] [--streams 16]

A decode worker that is streaming tokens to `--streams` sequences is handed another request's KV, pulled from a
prefill worker. Until 2026-12-06 the engine wrote that KV into its pool's blocks before the step that admitted the
request, so every stream's next token waited for the write; now (`--kv-async-restore`, on by default, which
already did the same for blocks restored from a KV tier) the restore thread writes it beside that step, and the
request runs from the next one.

Measured on the real SmolLM2-135M engine (bf16, one torch thread for the engine; the write on its own thread),
with a KV payload of the model's layout (random values: only the bytes' size matters here). Each round, A/B/A/B
on the same engine: a step of the streams alone; the step that admits the import with the write before it
(`async_restore` off); the same with the write beside it (on). The imported request is then aborted, so every
round starts from the same pool. Reported: each step's wall time, median of `reps`.

The same for a pulled prefix (a prompt about to be prefilled on this worker, whose prefix a peer had: until
2026-12-06 `import_prefix` wrote it between two steps; now `begin_import_prefix` writes it beside the step and
`finish_import_prefix` commits it): the time from the import's start to the end of the streams' next step.
Writes two markdown tables to stdout and bench/results/kv_import.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from bench.report import publish, wait_rows
from services.engine.config import EngineConfig
from services.engine.engine import KvExport, LLMEngine
from services.engine.host_bytes import bytes_of
from services.engine.model_files import smollm2_gguf_path
from services.engine.sampling import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "kv_import.md"


def timed_step(e: LLMEngine) -> float:
    t0 = time.perf_counter()
    e.step()
    return time.perf_counter() - t0


def import_step(e: LLMEngine, kv: KvExport, beside: bool, n: int) -> float:
    """The step that admits a request bringing `kv`, written before it or beside it."""
    e.scheduler.async_restore = beside
    rid = f"imp-{n}"
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    e.add_request(rid, kv.token_ids, params, output_ids=[1], kv=kv)
    took = timed_step(e)
    assert all(r.request_id != rid for r in e.scheduler.waiting)  # admitted in that step
    e.abort(rid)  # waits for a write still running beside the step
    return took


def prefix_step(e: LLMEngine, payload: memoryview, beside: bool, gen: torch.Generator) -> float:
    """A pulled prefix of fresh hashes written before the streams' next step (import_prefix between steps, as
    until 2026-12-06) or beside it (begin_import_prefix, the step, then finish_import_prefix)."""
    n = len(payload) // e.kv.block_bytes
    hashes = torch.randint(1, 2**62, (n,), generator=gen).tolist()
    t0 = time.perf_counter()
    if beside:
        job = e.begin_import_prefix("pull", hashes, 0, payload)
        e.step()
        took = time.perf_counter() - t0
        job.written.result()
        e.finish_import_prefix(job)
    else:
        e.import_prefix("pull", hashes, 0, payload)
        e.step()
        took = time.perf_counter() - t0
    e.release_kv("pull")
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", default="2048,4096,8000")
    ap.add_argument("--streams", type=int, default=16)
    a = ap.parse_args(argv)
    cfg = EngineConfig(dtype="bfloat16", num_threads=1, max_num_seqs=64, kv_cache_bytes=1 << 30)
    e = LLMEngine(smollm2_gguf_path(), cfg)
    gen = torch.Generator().manual_seed(0)
    streams = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    for i in range(a.streams):  # short prompts that decode for the whole run
        e.add_request(f"s{i}", torch.randint(10, 40_000, (16,), generator=gen).tolist(), streams)
    for _ in range(3):
        e.step()  # the streams' prefill, then decode steps
    rows: list[tuple[int, float, dict[str, float]]] = []
    prefix_rows: list[tuple[int, float, dict[str, float]]] = []
    n = 0
    for tokens in (int(t) for t in a.tokens.split(",")):
        nblocks = -(-tokens // e.kv.block_size)
        data = torch.randn(nblocks * e.kv.block_bytes // 2, generator=gen).to(torch.bfloat16)
        payload = bytes_of(data)
        kv = KvExport(e.kv_layout, torch.randint(10, 40_000, (tokens,), generator=gen).tolist(), payload)
        times: dict[str, list[float]] = {"alone": [], "before": [], "beside": []}
        for _ in range(a.reps):  # A/B/A/B
            times["alone"].append(timed_step(e))
            n += 1
            times["before"].append(import_step(e, kv, False, n))
            timed_step(e)
            n += 1
            times["beside"].append(import_step(e, kv, True, n))
            timed_step(e)
        med = {k: statistics.median(v) * 1000 for k, v in times.items()}
        rows.append((tokens, len(payload) / 2**20, med))
        pulled: dict[str, list[float]] = {"alone": [], "before": [], "beside": []}
        for _ in range(a.reps):  # A/B/A/B
            pulled["alone"].append(timed_step(e))
            pulled["before"].append(prefix_step(e, payload, False, gen))
            pulled["alone"].append(timed_step(e))
            pulled["beside"].append(prefix_step(e, payload, True, gen))
        med = {k: statistics.median(v) * 1000 for k, v in pulled.items()}
        prefix_rows.append((tokens, len(payload) / 2**20, med))
    lines = [
        f"The step of {a.streams} decoding streams that admits a prompt's imported KV, SmolLM2-135M bf16 engine, "
        f"median of {a.reps} A/B/A/B rounds ({platform.machine()}, {torch.__version__}):",
        "",
        "| prompt tokens | KV MiB | step alone ms | with the import, written before the step | written beside it "
        "| ratio | the streams' extra wait, before / now ms |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += wait_rows(rows, "beside")
    lines += [
        "",
        f"The step of the same {a.streams} streams after a pulled prefix of that many tokens is written into the pool "
        "(a prefill's peer pull on this worker: `import_prefix` between steps until 2026-12-06, now beside the "
        "step), same rounds:",
        "",
        "| prefix tokens | KV MiB | step alone ms | written before the step | written beside it | ratio "
        "| the streams' extra wait, before / now ms |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += wait_rows(prefix_rows, "beside")
    publish(lines, RESULTS.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
