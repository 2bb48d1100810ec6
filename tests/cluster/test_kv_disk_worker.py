"""The local-disk KV tier in real decode worker processes (agg: they prefill locally), across a restart: a worker
with a tiny pool and a disk tier (tier 2 off) serves a prompt and a second one that pushes the first's blocks out
to disk, is stopped with SIGTERM and started again on the same --kv-disk-path. The restarted worker announces the
kept blocks in its Subscribe snapshot (OFFLOADED, tier DISK), serves the first prompt as a prefix hit
(cached_tokens > 0) with the cold run's tokens, and counts the disk hit on /metrics. Started again with another
dtype, it wipes the directory (its log says why) and the prompt is computed cold. Bad disk flags stop the worker
at start, naming the flag."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.discovery.directory import WorkerDirectory
from services.engine.block_hash import block_hashes
from services.engine.model_files import smollm2_gguf_path
from services.engine.tokenizer import Tokenizer
from services.rpc import pb, pb_grpc
from tests.engine.test_kv_disk import BS, POOL, TEXT_A, TEXT_B
from tests.support.cluster import Proc, decode, greedy, run, start_process, token_ids
from tests.support.etcd import EtcdServer, free_port

pytestmark = pytest.mark.cluster  # starts etcd and workers

BLOCK_BYTES = 30 * 2 * 3 * BS * 64 * 2  # SmolLM2-135M, bf16: layers x (K, V) x kv heads x tokens x head_dim
DISK_BYTES = 64 << 20


def flags(disk: Path, dtype: str = "bfloat16") -> list[str]:
    pool = POOL * BLOCK_BYTES * (2 if dtype == "float32" else 1)  # the same 7 blocks either way
    return [
        "--dtype", dtype, "--threads", "1", "--kv-cache-bytes", str(pool),
        "--kv-disk-path", str(disk), "--kv-disk-bytes", str(DISK_BYTES), "--drain-grace-s", "5",
    ]  # fmt: skip


def metric(endpoint: str, name: str, **labels: str) -> float:
    text = httpx.get(f"http://{endpoint}/metrics", timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def start(etcd: EtcdServer, worker_id: str, log_dir: Path, extra: list[str]) -> tuple[Proc, pb.WorkerInfo]:
    """A decode worker, once it is registered (its info), or its log if it died first."""
    proc = start_process("services.decode.server", worker_id, etcd.url, str(log_dir), *extra)

    async def registered() -> pb.WorkerInfo:
        d = WorkerDirectory(etcd.url, roles=("decode",))
        await d.start()
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                assert proc.popen.poll() is None, proc.log_tail()
                for info in d.workers("decode"):
                    if info.worker_id == worker_id:
                        return info
                await asyncio.sleep(0.2)
            raise AssertionError(f"{worker_id} did not register\n{proc.log_tail()}")
        finally:
            await d.close()

    try:
        return proc, run(registered, 200)
    except BaseException:
        stop(proc)
        raise


def stop(proc: Proc) -> int:
    """SIGTERM and wait: the worker drains and exits (killed only if it hangs)."""
    if proc.popen.poll() is None:
        proc.popen.send_signal(signal.SIGTERM)
        try:
            return proc.popen.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
    return proc.popen.wait()


def ask(endpoint: str, rid: str, prompt: list[int]) -> list[pb.DecodeChunk]:
    req = pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, params=greedy(16, ignore_eos=True))
    return run(lambda: decode(endpoint, req), 180)


def snapshot(endpoint: str) -> list[pb.KvBlockEvent]:
    """The KV events of a Subscribe stream's snapshot (everything before its first LoadSnapshot)."""

    async def read() -> list[pb.KvBlockEvent]:
        out: list[pb.KvBlockEvent] = []
        async with grpc.aio.insecure_channel(endpoint) as channel:
            stream = pb_grpc.DecodeWorkerStub(channel).Subscribe(
                pb.SubscribeRequest(subscriber_id="t", snapshot=True), timeout=20
            )
            async for ev in stream:
                if ev.HasField("load"):
                    stream.cancel()
                    break
                out.append(ev.kv)
        return out

    return run(read, 30)


def test_a_restarted_worker_serves_its_disk_blocks_as_a_prefix_hit_with_the_cold_runs_tokens(
    tmp_path: Path,
) -> None:
    tok = Tokenizer.from_gguf(smollm2_gguf_path())
    a, b = tok.encode(TEXT_A), tok.encode(TEXT_B)
    hashes = block_hashes(a[: len(a) - 1], BS)
    disk = tmp_path / "kv-disk"
    with EtcdServer(data_dir=str(tmp_path / "etcd")) as etcd:
        proc, info = start(etcd, "decode-d1", tmp_path, flags(disk))
        try:
            cold = ask(info.endpoint, "a-cold", a)
            assert cold[0].cached_tokens == 0
            ask(info.endpoint, "b", b)  # needs the whole pool: A's blocks go to disk
            assert metric(info.metrics_endpoint, "rackserve_kv_tier_blocks", tier="disk") >= len(hashes)
            assert (
                metric(info.metrics_endpoint, "rackserve_kv_tier_capacity_bytes", tier="disk") == DISK_BYTES
            )
        finally:
            assert stop(proc) == 0, proc.log_tail()
        assert {f"{h:016x}.kv" for h in hashes} <= {p.name for p in (disk / "blocks").iterdir()}

        proc, info = start(etcd, "decode-d2", tmp_path, flags(disk))
        try:
            events = snapshot(info.endpoint)
            on_disk = [
                h
                for k in events
                if k.kind == pb.KvBlockEvent.OFFLOADED and k.tier == pb.KvBlockEvent.DISK
                for h in k.block_hashes
            ]
            assert set(hashes) <= set(on_disk)  # the router learns what the directory kept
            warm = ask(info.endpoint, "a-again", a)
            assert warm[0].cached_tokens == len(hashes) * BS  # a prefix hit, from disk
            assert token_ids(warm) == token_ids(cold)
            assert metric(info.metrics_endpoint, "rackserve_kv_tier_hits_total", tier="disk") == len(hashes)
            assert metric(info.metrics_endpoint, "rackserve_kv_tier_restore_seconds_count", tier="disk") == 1
            ask(info.endpoint, "b-again", b)  # A's blocks out to disk once more
        finally:
            assert stop(proc) == 0, proc.log_tail()

        proc, info = start(etcd, "decode-d3", tmp_path, flags(disk, dtype="float32"))
        try:
            assert snapshot(info.endpoint) == []  # nothing kept: blocks of a bf16 cache are no use to fp32
            assert ask(info.endpoint, "a-f32", a)[0].cached_tokens == 0
            log = Path(proc.log_path).read_text()
            assert "wiping" in log and "dtype 'bfloat16' != 'float32'" in log, proc.log_tail()
        finally:
            assert stop(proc) == 0, proc.log_tail()


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        (["--kv-disk-bytes", "-5"], "--kv-disk-bytes: must be at least 0"),
        (["--kv-disk-bytes", str(1 << 20)], "kv_disk_bytes needs kv_disk_path"),
        (
            ["--kv-disk-path", "{tmp}/d", "--kv-disk-bytes", "1000"],
            "kv_disk_bytes=1000 cannot hold one KV block",
        ),
        (["--kv-disk-path", "{tmp}/a-file", "--kv-disk-bytes", str(1 << 20)], "kv_disk_path='{tmp}/a-file'"),
    ],
)
def test_a_bad_disk_flag_stops_the_worker_naming_it(tmp_path: Path, flags: list[str], complaint: str) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    cmd = [sys.executable, "-m", "services.decode.server", "--etcd", "http://127.0.0.1:1", "--port", "0"]
    cmd += [f.format(tmp=tmp_path) for f in flags]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode != 0
    assert complaint.format(tmp=tmp_path) in p.stdout + p.stderr


def test_rackserve_up_gives_every_worker_a_disk_directory_of_its_own(tmp_path: Path) -> None:
    """`rackserve up --kv-disk-path DIR --kv-disk-bytes N`: each worker its own DIR/<worker id> (two workers on one
    directory would refuse to start: its lock), and a request through the frontend still answers."""
    port = free_port()
    disk = tmp_path / "kv"
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--prefill", "1", "--decode", "1"]
    cmd += ["--kv-cache-bytes", str(POOL * BLOCK_BYTES), "--kv-disk-path", str(disk)]
    cmd += ["--kv-disk-bytes", str(DISK_BYTES)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "rackserve is ready" in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.wait(450), "rackserve up did not become ready:\n" + "".join(lines[-40:])
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "SmolLM2-135M-Instruct", "prompt": TEXT_A, "max_tokens": 4, "temperature": 0},
            timeout=300,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        for wid in ("prefill-0", "decode-0"):
            manifest = json.loads((disk / wid / "manifest.json").read_text())
            assert manifest["block_size"] == BS and manifest["codec"] == "bf16", manifest
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
