"""`rackserve up --planner` following the planner's decision: the real `Cluster` and `run()` against a planner
stand-in (an HTTP server in this process answering /plan) and stand-in worker processes, which print the line a
real worker logs when it registers in etcd and whose start, load and drain the test controls with files."""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import services.launcher as launcher
from services.launcher import Cluster, add_arguments

pytestmark = pytest.mark.cluster  # starts processes

# argv: the role, the launcher's flags, `--worker-id ID`. A file CTL/ID.fail: it fails at its start; CTL/ID.loading:
# it loads (no registration) until the file goes; CTL/hold-drain: SIGTERM drains until the file goes.
WORKER = """
import os, signal, sys, time
ctl, role, wid = os.environ["FAKE_CTL"], sys.argv[1], sys.argv[sys.argv.index("--worker-id") + 1]
if os.path.exists(os.path.join(ctl, wid + ".fail")):
    print("OSError: [Errno 98] address already in use", flush=True)
    sys.exit(1)
def term(*_):
    while os.path.exists(os.path.join(ctl, "hold-drain")):
        time.sleep(0.05)
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
while os.path.exists(os.path.join(ctl, wid + ".loading")):
    time.sleep(0.05)
print(f"INFO rackserve.discovery: etcd http://127.0.0.1:1: registered /rackserve/v1/workers/{role}/{wid} "
      "(lease 1, ttl 3s)", flush=True)
while True:
    time.sleep(1)
"""


class Planner:
    """/plan answering whatever `plan` holds."""

    def __init__(self) -> None:
        self.plan: dict[str, Any] = {"outcome": "starting"}
        planner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps(planner.plan).encode()
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def decide(
        self,
        n: int,
        outcome: str,
        desired: tuple[int, int],
        registered: tuple[list[str], list[str]] | None = None,
    ) -> None:
        """A decision; `registered`: the (prefill, decode) worker ids in etcd, with `actual` their counts, as the
        planner's decisions name them."""
        plan: dict[str, Any] = {
            "time": n,
            "outcome": outcome,
            "desired": dict(zip(("prefill", "decode"), desired, strict=True)),
        }
        if registered is not None:
            plan["registered"] = dict(zip(("prefill", "decode"), registered, strict=True))
            plan["actual"] = {role: len(ids) for role, ids in plan["registered"].items()}
        self.plan = plan


@pytest.fixture
def ctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("FAKE_CTL", str(tmp_path))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    yield tmp_path
    (tmp_path / "hold-drain").unlink(missing_ok=True)


@pytest.fixture
def signals() -> Iterator[None]:
    """run() and Cluster.stop() install their own handlers: pytest's come back afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--planner", "--device", "cpu", "--quiet", *argv])


def cluster(ctl: Path, planner: Planner, prefill: int, decode: int, *argv: str) -> Cluster:
    """A cluster of `up`'s own workers (the command line's), following `planner`."""
    c = Cluster(args("--prefill", str(prefill), "--decode", str(decode), *argv))
    c.planner_port = planner.port
    c._worker_cmd = ([sys.executable, str(ctl / "worker.py")], [], [])
    for _ in range(prefill):
        c.add_worker("prefill")
    for _ in range(decode):
        c.add_worker("decode")
    return c


def kill(c: Cluster) -> None:
    c._stopping = True
    for p in c.live():
        if p.popen.poll() is None:
            p.popen.kill()
            p.popen.wait(5)


def serve_until(
    c: Cluster, done: Callable[[], bool], within_s: float = 15.0, each: Callable[[], None] = lambda: None
) -> None:
    """Be the launcher's main thread (it makes the plan thread's spawns) until `done`."""
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        c.serve_spawns(0.05)
        each()


def serve_for(c: Cluster, polls: int, each: Callable[[], None] = lambda: None) -> None:
    """Long enough for the plan thread to read the decision `polls` times."""
    end = time.monotonic() + polls * launcher.PLAN_POLL_S + 0.5
    serve_until(c, lambda: time.monotonic() >= end, each=each)


def names(c: Cluster, role: str) -> list[str]:
    return [p.name for p in c.pools[role]]


def registered(c: Cluster) -> None:
    """Until every worker has logged its registration, and a poll more (what the planner's `actual` shows)."""
    pools = lambda: [p for pool in c.pools.values() for p in pool]  # noqa: E731
    serve_until(c, lambda: all(any(": registered " in line for line in p.tail) for p in pools()))
    serve_for(c, 1)


def follow(c: Cluster) -> threading.Thread:
    t = threading.Thread(target=c.follow_plan, name="plan", daemon=True)
    t.start()
    return t


@pytest.mark.parametrize(("start", "want"), [((1, 2), (2, 1)), ((2, 1), (1, 2))])
def test_a_rebalance_drains_first_and_starts_nothing_past_the_budget_until_the_drained_worker_exits(
    ctl: Path, start: tuple[int, int], want: tuple[int, int]
) -> None:
    """Moving a worker between pools under --max-workers 3 started the new one before (or right after) the other
    pool's drain, and a draining worker runs on for its --drain-grace-s: 4 workers on a budget of 3, each sized
    for a third of a shared GPU's memory."""
    planner = Planner()
    c = cluster(ctl, planner, *start, "--max-workers", "3", "--max-prefill", "2", "--max-decode", "2")
    try:
        (ctl / "hold-drain").touch()
        registered(c)
        planner.decide(1, "rebalance", want)
        follow(c)
        running = lambda: sum(p.popen.poll() is None for p in c.live())  # noqa: E731
        peak = [running()]
        watch = lambda: peak.append(running())  # noqa: E731
        shrink = "decode" if want[0] > start[0] else "prefill"
        grow = "prefill" if shrink == "decode" else "decode"
        serve_until(c, lambda: len(c.pools[shrink]) == want[shrink == "decode"], each=watch)
        serve_for(c, 2, each=watch)
        assert len(c.pools[grow]) == start[grow == "decode"], "started while the drained worker still runs"
        (ctl / "hold-drain").unlink()  # its streams have finished: it exits
        serve_until(c, lambda: len(c.pools[grow]) == want[grow == "decode"], each=watch)
        assert max(peak) == 3
    finally:
        kill(c)


def test_a_failed_fork_does_not_end_the_plan_thread(
    ctl: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """One fork refused (EAGAIN under memory or pid pressure) ended the plan-following thread for good: later
    decisions were never acted on, and nothing told `up`."""
    planner = Planner()
    c = cluster(ctl, planner, 1, 1, "--max-decode", "3")
    real = subprocess.Popen
    refused = []

    def flaky(cmd: list[str], *a: Any, **kw: Any) -> Any:
        if "decode-1" in cmd and not refused:
            refused.append(cmd)
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return real(cmd, *a, **kw)

    monkeypatch.setattr(subprocess, "Popen", flaky)
    try:
        planner.decide(1, "scale_up", (1, 2))
        thread = follow(c)
        serve_until(c, lambda: bool(refused))
        planner.decide(2, "scale_up", (1, 3))
        serve_until(c, lambda: len(c.pools["decode"]) == 3)
        assert thread.is_alive()
        assert "could not follow its decision (BlockingIOError" in capsys.readouterr().out
    finally:
        kill(c)


def test_workers_the_launcher_did_not_start_count_toward_the_planners_decision(ctl: Path) -> None:
    """Two decode workers started by hand on the same etcd: the planner's decision counts them (desired and actual
    are cluster-wide), and the launcher compared it with its own pool, starting two more on a `hold` (5 decode
    workers on --max-decode 3). It follows desired less the registered workers that are not its own; a worker of
    its own still loading (not registered yet) is not started a second time, and a draining one (registered
    until it exits) is not taken for another's."""
    planner = Planner()
    c = cluster(ctl, planner, 1, 1, "--max-decode", "3", "--max-prefill", "1")
    try:
        registered(c)
        planner.decide(1, "hold", (1, 3), (["prefill-0"], ["decode-0", "hand-a", "hand-b"]))
        follow(c)
        serve_for(c, 2)
        assert (names(c, "prefill"), names(c, "decode")) == (["prefill-0"], ["decode-0"])
        # one of the others left: the planner asks for one more, which loads for a while
        (ctl / "decode-1.loading").touch()
        planner.decide(2, "scale_up", (1, 3), (["prefill-0"], ["decode-0", "hand-a"]))
        serve_until(c, lambda: len(c.pools["decode"]) == 2)
        serve_for(c, 2)
        assert names(c, "decode") == ["decode-0", "decode-1"]
        # it registers: the planner sees 3, as asked; nothing moves
        (ctl / "decode-1.loading").unlink()
        planner.decide(2, "scale_up", (1, 3), (["prefill-0"], ["decode-0", "decode-1", "hand-a"]))
        registered(c)
        serve_for(c, 2)
        assert names(c, "decode") == ["decode-0", "decode-1"]
        # a scale-down to 2 drains one of the launcher's own, and only one while it drains (still registered)
        (ctl / "hold-drain").touch()
        planner.decide(3, "scale_down", (1, 2), (["prefill-0"], ["decode-0", "decode-1", "hand-a"]))
        serve_until(c, lambda: len(c.pools["decode"]) == 1)
        serve_for(c, 2)
        assert names(c, "decode") == ["decode-0"] and c.next_index["decode"] == 2
    finally:
        kill(c)


# ---------------------------------------------------------------------------------------------- run()
@pytest.fixture
def up(
    ctl: Path, monkeypatch: pytest.MonkeyPatch, signals: None
) -> Iterator[Callable[..., tuple[int, Cluster]]]:
    """run() itself, with etcd, router, frontend and the readiness wait left out: `up`'s own workers and a
    planner process (a sleeper; /plan is answered by a Planner) from start_services."""
    made: list[Cluster] = []

    def start(planner: Planner, prefill: int, decode: int, then: Callable[[Cluster], None], *argv: str):
        def start_services(self: Cluster) -> None:
            self.planner_port = planner.port
            self._worker_cmd = ([sys.executable, str(ctl / "worker.py")], [], [])
            for _ in range(prefill):
                self.add_worker("prefill")
            for _ in range(decode):
                self.add_worker("decode")
            self._planner_cmd = [sys.executable, "-c", "import time; time.sleep(600)"]
            self.spawn("planner", self._planner_cmd)
            made.append(self)
            threading.Thread(target=then, args=(self,), daemon=True).start()

        monkeypatch.setattr(Cluster, "start_etcd", lambda self: None)
        monkeypatch.setattr(Cluster, "start_services", start_services)
        monkeypatch.setattr(Cluster, "wait_ready", lambda self: None)
        monkeypatch.setattr(launcher, "check_args", lambda a: None)
        rc = launcher.run(args("--prefill", str(prefill), "--decode", str(decode), *argv))
        return rc, made[0]

    yield start
    for c in made:
        kill(c)


def wait(done: Callable[[], bool], within_s: float = 15.0) -> None:
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def ctrl_c(c: Cluster) -> None:
    """Ctrl-C to `up` (this process): only while run() runs."""
    if not c._stopping:
        os.kill(os.getpid(), signal.SIGINT)


def live(c: Cluster, name: str) -> list[launcher.Proc]:
    return [p for p in c.live() if p.name == name and p.popen.poll() is None]


def test_a_planner_that_dies_is_started_again_and_the_cluster_serves_on(up, capsys) -> None:
    """The planner is optional: SIGKILLed (or crashed), it stopped `up` and every worker with it, cutting the
    streams in flight. It is started again after a backoff (1 s, then 2 s, ...), each restart logged."""
    seen: dict[str, Any] = {}

    def then(c: Cluster) -> None:
        for _ in (1, 2):
            wait(lambda: len(live(c, "planner")) == 1)
            killed = live(c, "planner")[0]
            killed.popen.kill()
            wait(lambda killed=killed: [p for p in live(c, "planner") if p is not killed] != [])
        seen["workers"] = [p.name for p in c.live() if p.popen.poll() is None and p.name != "planner"]
        ctrl_c(c)

    rc, c = up(Planner(), 1, 1, then)
    out = capsys.readouterr().out
    assert rc == 0 and c.planner_restarts == 2
    assert seen["workers"] == ["prefill-0", "decode-0"]
    assert "starting the planner again in 1s" in out and "starting the planner again in 2s" in out
    assert "planner: restart 1" in out and "planner: restart 2" in out
    assert "rackserve up: planner exited with status -9" in out


def test_a_worker_the_planner_added_that_fails_leaves_its_pool_and_the_next_decision_retries(
    up, ctl: Path, capsys
) -> None:
    """A worker the planner asked for that exited at its start (a port taken, memory short) stopped the whole
    serving cluster. It leaves its pool, logged with its last lines; the same decision does not start it again,
    the next one does."""
    planner = Planner()
    (ctl / "decode-1.fail").touch()
    seen: dict[str, Any] = {}

    def then(c: Cluster) -> None:
        planner.decide(1, "scale_up", (1, 2))
        wait(lambda: c.next_index["decode"] == 2 and all(p.name != "decode-1" for p in c.live()))
        time.sleep(2 * launcher.PLAN_POLL_S)
        seen["held"] = (names(c, "decode"), c.next_index["decode"])
        planner.decide(2, "scale_up", (1, 2))
        wait(lambda: names(c, "decode") == ["decode-0", "decode-2"])
        ctrl_c(c)

    rc, c = up(planner, 1, 1, then)
    out = capsys.readouterr().out
    assert rc == 0
    assert seen["held"] == (["decode-0"], 2)
    assert "decode-1 exited with status 1; its last lines:" in out and "address already in use" in out
    assert "decode-1 left the decode pool" in out and "started decode-2" in out


def test_a_worker_of_the_command_line_that_fails_still_stops_up(up, capsys) -> None:
    """`up`'s own workers are what the user asked for: one that exits stops `up`, naming it (as before)."""

    def then(c: Cluster) -> None:
        c.pools["decode"][0].popen.kill()

    rc, _ = up(Planner(), 1, 1, then)
    out = capsys.readouterr().out
    assert rc == 1 and "decode-0 exited with status -9" in out and "rackserve up: stopping" in out


def test_ctrl_c_during_a_spawn_the_planner_asked_for_stops_up(up, monkeypatch: pytest.MonkeyPatch) -> None:
    """The KeyboardInterrupt of a Ctrl-C that came while the main thread forked a worker for the planner was
    caught with the spawn's errors and handed to the plan thread: `up` ran on until a second Ctrl-C."""
    planner = Planner()
    real = subprocess.Popen
    second: list[bool] = []

    def slow(cmd: list[str], *a: Any, **kw: Any) -> Any:
        if "decode-1" in cmd:
            # handled in this (main) thread at its next bytecode: in the middle of the spawn
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
        return real(cmd, *a, **kw)

    def then(c: Cluster) -> None:
        planner.decide(1, "scale_up", (1, 2))
        wait(lambda: c.next_index["decode"] == 2)
        time.sleep(5.0)
        if not c._stopping:
            second.append(True)
            ctrl_c(c)

    monkeypatch.setattr(subprocess, "Popen", slow)
    rc, c = up(planner, 1, 1, then)
    assert rc == 0 and not second, "the first Ctrl-C was swallowed"
