"""Real worker processes against a real etcd, for tests that need a cluster (workers, disagg, chaos, …).

`start_process` runs one service (`python -m services.<role>.server`) with its log in a file; `LocalCluster`
starts a set of them against an `EtcdServer`, waits until each has registered, and on the way out kills what is
still running and prints the log tails of a failed setup. Everything runs SmolLM2-135M in float32 with one torch
thread per process (`WORKER_FLAGS`).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import httpx

from services.discovery import WorkerDirectory
from services.rpc import pb, pb_grpc
from tests.support.etcd import EtcdServer

T = TypeVar("T")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LEASE_TTL_S = 3.0
STARTUP_TIMEOUT_S = 150.0
RPC_TIMEOUT_S = 30.0
WORKER_FLAGS = ["--dtype", "float32", "--kv-cache-bytes", str(24 << 20), "--threads", "1"]


@dataclass
class Proc:
    worker_id: str
    popen: subprocess.Popen[bytes]
    log_path: str

    def log_tail(self, lines: int = 40) -> str:
        with open(self.log_path, errors="replace") as f:
            return f"--- {self.worker_id} log tail ---\n" + "".join(f.readlines()[-lines:])


@dataclass
class LocalCluster:
    etcd: EtcdServer
    procs: dict[str, Proc]
    endpoints: dict[str, str] = field(default_factory=dict)
    infos: dict[str, pb.WorkerInfo] = field(default_factory=dict)


def wait_frontend_ready(
    url: str,
    roles: tuple[str, ...] = (),
    timeout_s: float = STARTUP_TIMEOUT_S,
    exited: Callable[[], list[Any]] = lambda: [],
) -> None:
    """Until the frontend's GET /health answers 200 and counts at least one worker of each of `roles`; raises
    RuntimeError with the last answer, or as soon as `exited()` names a process that died."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        dead = exited()
        if dead:
            raise RuntimeError(f"{url} not ready: exited {dead} (last: {last})")
        try:
            r = httpx.get(f"{url}/health", timeout=2)
            # 503 is /health's "up, but no decode worker is routable": ready enough when none is asked for
            up = r.status_code == 200 or (r.status_code == 503 and not roles)
            if up and all(r.json()["workers"].get(role, 0) >= 1 for role in roles):
                return
            last = r.text
        except (httpx.HTTPError, ValueError, KeyError) as e:
            last = repr(e)
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready within {timeout_s}s (last: {last})")


def run(body: Callable[[], Awaitable[T]], timeout_s: float = 60.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(body(), timeout_s)

    return asyncio.run(bounded())


def start_process(
    module: str, worker_id: str, etcd_url: str, log_dir: str, *extra: str, tree: str = ROOT
) -> Proc:
    """`python -m module` of the checkout at `tree` (this one unless a benchmark runs another's code)."""
    log_path = os.path.join(log_dir, f"{worker_id}.log")
    cmd = [sys.executable, "-m", module, "--etcd", etcd_url, "--port", "0", "--worker-id", worker_id]
    cmd += ["--lease-ttl-s", str(LEASE_TTL_S), *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if tree != ROOT:
        env.pop("PYTHONPATH", None)  # that tree's code, not this checkout's
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    return Proc(worker_id, popen, log_path)


@contextmanager
def local_cluster(
    log_dir: str,
    start: Callable[[str], list[Proc]],
    expect: dict[str, int],
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
) -> Iterator[LocalCluster]:
    """A real etcd, the processes `start(etcd_url)` launches, and a wait until `expect[role]` of each registered."""
    with EtcdServer(data_dir=os.path.join(log_dir, "etcd")) as etcd:
        procs = {p.worker_id: p for p in start(etcd.url)}
        c = LocalCluster(etcd, procs)
        try:

            async def wait_registered() -> None:
                d = WorkerDirectory(etcd.url, roles=tuple(expect))
                await d.start()
                try:
                    for role, n in expect.items():
                        for info in await d.wait_for(role, n, startup_timeout_s):
                            c.infos[info.worker_id] = info
                            c.endpoints[info.worker_id] = info.endpoint
                finally:
                    await d.close()

            run(wait_registered, startup_timeout_s + 10)
            yield c
        except BaseException:
            for p in procs.values():
                print(p.log_tail(), file=sys.stderr)
            raise
        finally:
            for p in procs.values():
                if p.popen.poll() is None:
                    p.popen.kill()
                p.popen.wait()


def greedy(max_tokens: int = 48, **kw: Any) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=7, logprobs=-1, **kw)


def token_ids(chunks: list[pb.DecodeChunk]) -> list[int]:
    return [t.token_id for c in chunks for t in c.tokens]


def token_indices(chunks: list[pb.DecodeChunk]) -> list[int]:
    return [t.index for c in chunks for t in c.tokens]


async def wait_for_load(
    endpoint: str, stub_class: Any, predicate: Callable[[pb.LoadSnapshot], bool], timeout_s: float = 10.0
) -> pb.LoadSnapshot:
    """The first LoadSnapshot from the worker's Subscribe stream that satisfies predicate."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stream = stub_class(channel).Subscribe(pb.SubscribeRequest(subscriber_id="test"), timeout=timeout_s)
        async for event in stream:
            if event.HasField("load") and predicate(event.load):
                stream.cancel()
                return event.load
    raise AssertionError("the Subscribe stream ended without a matching LoadSnapshot")


async def decode(endpoint: str, request: pb.DecodeRequest) -> list[pb.DecodeChunk]:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)
        return [chunk async for chunk in stub.Decode(request, timeout=RPC_TIMEOUT_S)]


def _drain(proc: subprocess.Popen[str], tail: deque[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        tail.append(line)


@contextmanager
def rackserve_up(*flags: str, ready_s: float = 240.0) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A real `rackserve up` (etcd, router, workers, frontend) on a free port: (the launcher, the base URL).

    Stopped with SIGTERM, so the launcher stops its children in order (a SIGKILLed launcher would leave them
    running); killed only if it has not exited within its grace."""
    from tests.support.etcd import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "rackserve is ready" in line:
                break
        if proc.poll() is not None or not lines or "rackserve is ready" not in lines[-1]:
            raise RuntimeError("rackserve up did not become ready:\n" + "".join(lines[-30:]))
        # keep draining the launcher's output (a full pipe would block it mid-print); the tail is kept for failures
        tail: deque[str] = deque(lines, maxlen=200)
        threading.Thread(target=_drain, args=(proc, tail), daemon=True).start()
        proc.log_tail = tail  # type: ignore[attr-defined]
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=45)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
