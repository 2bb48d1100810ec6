"""Overload soak: the default `rackserve up` (1 prefill + 1 decode worker, `--mode auto`) held at 2x and 4x its
capacity, with the frontend's KV budget (the default, `--admission-kv-factor 2`) and without it (`0`: only the
fixed `--max-concurrent-requests`), side by side.

    python -m bench.soak_bench [--duration-s 600] [--loads 2,4] [--kv-cache-bytes 268435456]

Capacity is what the cluster reports: the decode workers' KV tokens (`/health` → kv_tokens.capacity) divided by
the tokens of a mean request (prompt uniform 16..256 + 8 output), so "4x" is four times as many closed-loop
clients as the decode pool holds requests. Each (load, config) segment starts its own cluster, runs for
`--duration-s`, and segments alternate A/B/A/B (budget, none, budget, none). Clients send streamed completions;
a refused client waits the Retry-After it was given before its next request.

Recorded per segment: every outcome (completed whole; refused before the first token, by status and code; failed
after it — the bug this guards against), TTFT p50/p99 of the completed, goodput (completed requests per second
whose TTFT met `--slo-ttft-s`), workers that left discovery during the run (an etcd watch), and every service's
peak resident memory (VmHWM of the process; VmRSS at the end). Writes bench/results/soak.md and soak.json.
Benchmarks never run in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from services.discovery import WorkerDirectory

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODEL = "SmolLM2-135M-Instruct"
OUTPUT_TOKENS = 8
INPUT_LO, INPUT_HI = 16, 256
CONFIGS = {"kv-budget": "2", "no-budget": "0"}  # --admission-kv-factor of the frontend
REQUEST_TIMEOUT_S = 120.0


@dataclass
class Outcome:
    status: int
    ttft_s: float | None = None
    e2e_s: float = 0.0
    tokens: int = 0
    code: str = ""  # the error code of a refusal or of a failed stream
    after_first_token: bool = False


@dataclass
class Segment:
    load: int
    config: str
    clients: int
    duration_s: float
    capacity_tokens: int
    outcomes: list[Outcome] = field(default_factory=list)
    left_discovery: list[str] = field(default_factory=list)
    memory_mib: dict[str, dict[str, float]] = field(default_factory=dict)

    def summary(self, slo_ttft_s: float) -> dict[str, object]:
        done = [o for o in self.outcomes if o.status == 200 and not o.code]
        failed = [o for o in self.outcomes if o.after_first_token]
        ttfts = sorted(o.ttft_s for o in done if o.ttft_s is not None)
        errors = Counter(f"{o.status} {o.code}" for o in self.outcomes if o.code)
        return {
            "load": f"{self.load}x",
            "config": self.config,
            "clients": self.clients,
            "requests": len(self.outcomes),
            "completed": len(done),
            "refused_before_first_token": sum(1 for o in self.outcomes if o.status != 200),
            "failed_after_first_token": len(failed),
            "errors": dict(errors),
            "ttft_p50_s": _pct(ttfts, 0.50),
            "ttft_p99_s": _pct(ttfts, 0.99),
            "goodput_rps": round(sum(1 for t in ttfts if t <= slo_ttft_s) / self.duration_s, 3),
            "throughput_rps": round(len(done) / self.duration_s, 3),
            "left_discovery": self.left_discovery,
            "peak_rss_mib": {k: v["peak"] for k, v in self.memory_mib.items()},
        }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


# ---- the cluster ------------------------------------------------------------------------------------------------


def start_cluster(port: int, kv_cache_bytes: int, factor: str, log_path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RACKSERVE_ADMISSION_KV_FACTOR": factor}
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--threads", "1",
           "--kv-cache-bytes", str(kv_cache_bytes), "--ready-timeout-s", "900", "--quiet"]  # fmt: skip
    with open(log_path, "wb") as log:
        up = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 960
    while time.monotonic() < deadline:
        assert up.poll() is None, f"rackserve up exited; see {log_path}"
        if b"rackserve is ready" in log_path.read_bytes():
            return up
        time.sleep(1)
    raise RuntimeError(f"rackserve up not ready in 960 s; see {log_path}")


def stop_cluster(up: subprocess.Popen[bytes]) -> None:
    up.send_signal(signal.SIGTERM)
    try:
        up.wait(120)
    except subprocess.TimeoutExpired:
        up.kill()
        up.wait()


def services_of(up: subprocess.Popen[bytes]) -> dict[str, int]:
    """The launcher's children by service name (etcd, router, prefill, decode, frontend) -> pid."""
    found = {}
    for pid in Path(f"/proc/{up.pid}/task/{up.pid}/children").read_text().split():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode() for a in argv]
        name = words[words.index("services.cli") + 1] if "services.cli" in words else Path(words[0]).name
        found[name] = int(pid)
    return found


def memory_mib(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            fields[key] = int(value.split()[0]) / 1024
    return {"peak": round(fields.get("VmHWM", 0.0), 1), "end": round(fields.get("VmRSS", 0.0), 1)}


# ---- the load ---------------------------------------------------------------------------------------------------


async def one(client: httpx.AsyncClient, base: str, rng: random.Random) -> tuple[Outcome, float]:
    """One streamed completion; returns it and the seconds to wait before the next (Retry-After if refused)."""
    n = rng.randint(INPUT_LO, INPUT_HI)
    prompt = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "sigma", "omega")) for _ in range(n))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    out = Outcome(0)
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.code = (json.loads(await r.aread()).get("error") or {}).get("code") or "error"
                out.e2e_s = time.monotonic() - t0
                return out, float(r.headers.get("retry-after") or 1)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    out.code = event["error"].get("code") or "error"
                    out.after_first_token = True
                    continue
                if out.ttft_s is None:
                    out.ttft_s = time.monotonic() - t0
                out.tokens += 1
    except httpx.HTTPError as e:
        out.code, out.after_first_token = f"client:{type(e).__name__}", out.ttft_s is not None
    out.e2e_s = time.monotonic() - t0
    return out, 0.0


async def drive(base: str, etcd_url: str, seg: Segment, seed: int) -> None:
    directory = WorkerDirectory(etcd_url, roles=("router", "prefill", "decode", "frontend"))
    await directory.start()
    directory.subscribe(
        lambda kind, info: seg.left_discovery.append(info.worker_id) if kind == "removed" else None
    )
    stop_at = time.monotonic() + seg.duration_s

    async def client_loop(i: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < stop_at:
            outcome, wait_s = await one(client, base, rng)
            seg.outcomes.append(outcome)
            if wait_s:
                await asyncio.sleep(min(wait_s, max(0.0, stop_at - time.monotonic())))

    try:
        limits = httpx.Limits(max_connections=seg.clients + 4)
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
            await asyncio.gather(*(client_loop(i, client) for i in range(seg.clients)))
    finally:
        await directory.close()


def run_segment(args: argparse.Namespace, load: int, config: str, index: int) -> Segment:
    RESULTS.mkdir(parents=True, exist_ok=True)
    up = start_cluster(args.port, args.kv_cache_bytes, CONFIGS[config], RESULTS / f"soak-{index}-up.log")
    try:
        base = f"http://127.0.0.1:{args.port}"
        health = httpx.get(f"{base}/health", timeout=10).json()
        capacity = int(health["kv_tokens"]["capacity"])
        mean_request = (INPUT_LO + INPUT_HI) / 2 * args.tokens_per_word + OUTPUT_TOKENS
        clients = max(1, round(load * capacity / mean_request))
        ready = (RESULTS / f"soak-{index}-up.log").read_text()
        match = re.search(r"rackserve is ready: \S+\s+\(etcd (\S+);", ready)
        assert match, "no etcd URL in rackserve up's ready line"
        etcd_url = match.group(1)
        seg = Segment(load, config, clients, args.duration_s, capacity)
        print(f"segment {index}: {load}x ({clients} clients), {config}, {args.duration_s:.0f} s", flush=True)
        asyncio.run(drive(base, etcd_url, seg, index))
        seg.memory_mib = {name: memory_mib(pid) for name, pid in services_of(up).items()}
        return seg
    finally:
        stop_cluster(up)


def table(rows: list[dict[str, object]]) -> str:
    head = ("| load | frontend | clients | requests | completed | refused before 1st token | failed after it "
            "| TTFT p50 / p99 s | goodput req/s | left discovery | peak RSS MiB (frontend / router / prefill / "
            "decode / etcd) |")  # fmt: skip
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        rss = r["peak_rss_mib"]
        assert isinstance(rss, dict)
        mem = " / ".join(str(rss.get(k, "—")) for k in ("frontend", "router", "prefill", "decode", "etcd"))
        lines.append(
            f"| {r['load']} | {r['config']} | {r['clients']} | {r['requests']} | {r['completed']} | "
            f"{r['refused_before_first_token']} | {r['failed_after_first_token']} | {r['ttft_p50_s']} / "
            f"{r['ttft_p99_s']} | {r['goodput_rps']} | {len(r['left_discovery'])} | {mem} |"  # type: ignore[arg-type]
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0, help="seconds per segment")
    p.add_argument("--loads", default="2,4", help="multiples of the cluster's capacity, comma-separated")
    p.add_argument(
        "--kv-cache-bytes", type=int, default=256 << 20, help="per worker (rackserve up's default)"
    )
    p.add_argument("--port", type=int, default=8790)
    p.add_argument(
        "--slo-ttft-s", type=float, default=2.5, help="goodput counts completions within this TTFT"
    )
    p.add_argument("--tokens-per-word", type=float, default=1.0, help="prompt tokens per generated word")
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"which frontends to run, comma-separated: {list(CONFIGS)}",
    )
    args = p.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; known: {list(CONFIGS)}")
    loads = [int(x) for x in args.loads.split(",")]
    segments: list[Segment] = []
    for load in loads:  # A/B/A/B over the run: budget, none at 2x, then budget, none at 4x
        for config in configs:
            segments.append(run_segment(args, load, config, len(segments)))
            write(args, segments)  # after every segment: a run cut short still leaves its numbers


def write(args: argparse.Namespace, segments: list[Segment]) -> None:
    rows = [s.summary(args.slo_ttft_s) for s in segments]
    meta = {
        "command": " ".join(sys.argv),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),  # fmt: skip
        "duration_s_per_segment": args.duration_s,
        "slo_ttft_s": args.slo_ttft_s,
    }
    text = f"# Overload soak\n\n`{meta['command']}` on {meta['machine']}, commit {meta['commit']}\n\n{table(rows)}\n"
    (RESULTS / "soak.md").write_text(text)
    (RESULTS / "soak.json").write_text(
        json.dumps({"meta": meta, "segments": rows, "outcomes": [asdict(s) for s in segments]}, indent=1)
    )
    print(text)


if __name__ == "__main__":
    main()
