"""`rackserve up` refusing what cannot work before it starts anything, saying why a child died, and a launcher
killed outright taking its children with it."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest

from services.launcher import Cluster, check_args
from services.launcher import add_arguments as launcher_arguments
from tests.support.cluster import rackserve_up
from tests.support.etcd import free_port
from tests.support.paths import REPO

pytestmark = pytest.mark.cluster  # starts processes


def up(
    *flags: str, env: dict[str, str] | None = None, timeout_s: float = 120.0
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--port", str(free_port()), *flags],
        capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--decode", "0"], "argument --decode: "),
        (["--prefill", "-2"], "argument --prefill: "),
        (["--port", "99999"], "argument --port: "),
        (["--model", "/no/such/model.gguf"], "--model /no/such/model.gguf: no such file"),
        (["--prefill", "0", "--mode", "disagg"], "--mode disagg needs prefill workers"),
        (["--kv-disk-path", "/tmp/x"], "kv_disk_path needs kv_disk_bytes"),
        # the frontend's own rule, which refused it only once etcd and every worker had started (until 2026-12-07)
        (["--api-key", "sk-1"], "--api-key: API key 'key-0': shorter than 8 characters"),
    ],
)
def test_settings_that_cannot_work_are_refused_before_anything_starts(flags: list[str], said: str) -> None:
    """Until 2026-12-07 `--decode 0` waited out the 180 s readiness timeout, a bad port or model was a
    traceback in a child, and `--prefill -2` was taken."""
    t0 = time.monotonic()
    done = up(*flags, timeout_s=60)
    assert done.returncode != 0 and said in done.stderr, done.stderr + done.stdout
    assert "[etcd]" not in done.stdout and time.monotonic() - t0 < 30  # nothing was started


def test_a_port_already_served_is_refused_not_taken_for_a_ready_cluster() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "services.cli", "up", "--port", str(port)],
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
    assert done.returncode != 0 and f"--port {port} on 127.0.0.1: Address already in use" in done.stderr


def test_a_child_that_dies_is_named_with_its_last_lines_even_quiet() -> None:
    """One setting every worker refuses (RACKSERVE_MAX_NUM_SEQS=0, which `up` leaves to the environment): the
    launcher stops and shows the worker's own message. A per-process setting in the launcher's environment
    (RACKSERVE_PORT, here a port already taken) no longer reaches the children: the router starts."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        env = {"RACKSERVE_MAX_NUM_SEQS": "0", "RACKSERVE_PORT": str(held.getsockname()[1])}
        done = up("--quiet", "--dtype", "float32", env=env)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "-0 exited with status 1; its last lines:" in out, out
    assert "max_num_seqs must be at least 1" in out, out
    assert "router exited" not in out, out


LAUNCHER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-m", "services.launcher.lifeline", str(os.getpid()),
                              "sleep", "600"], start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(600)
    """
)


def test_a_child_started_through_the_lifeline_stops_when_the_launcher_is_killed() -> None:
    """`up` SIGKILLed (or the OOM killer) left every child running: a whole cluster nobody owned. The kernel now
    sends each child SIGTERM when the launcher dies (what `up` itself sends on Ctrl-C)."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert launcher.stdout is not None
        child = int(launcher.stdout.readline())
        deadline = time.monotonic() + 10
        while _comm(child) != "sleep":  # the lifeline has set its signal and become the command
            assert time.monotonic() < deadline, "the child never became `sleep`"
            time.sleep(0.05)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while _comm(child) not in ("", "<zombie>"):
            assert time.monotonic() < deadline, f"pid {child} outlived its killed launcher"
            time.sleep(0.05)
    finally:
        if launcher.poll() is None:
            launcher.kill()


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            return "<zombie>"
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def test_a_second_ctrl_c_ends_a_stop_that_waits_on_a_stuck_worker() -> None:
    """A frozen worker used to hold the launcher for its whole 30 s stop budget (the router and etcd then got
    0.1 s; each tier now gets at least 5 s), and further Ctrl-Cs were ignored."""
    with rackserve_up("--dtype", "float32", "--prefill", "0", "--decode", "1") as (proc, _url):
        children = subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
        decode = next(pid for pid in children if "--worker-id decode-0" in _cmdline(int(pid)))
        os.kill(int(decode), signal.SIGSTOP)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        time.sleep(2.0)  # it is stopping the frontend, then waits for the frozen worker
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)  # the impatient second Ctrl-C
        proc.wait(20)
        assert time.monotonic() - t0 < 15
        for pid in children:
            assert _comm(int(pid)) in ("", "<zombie>"), f"{pid} outlived the launcher"


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def _launcher_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launcher_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_port_left_in_time_wait_by_an_earlier_run_is_not_refused() -> None:
    """The port check bound without SO_REUSEADDR, so for a minute after an earlier cluster served clients (its
    connections in TIME_WAIT) `up` refused a port uvicorn would bind (the desk review)."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server's side closes first: its end of the connection stays in TIME_WAIT
        client.close()
    check_args(_launcher_args("--port", str(port)))  # no SystemExit


def test_a_child_asked_for_by_another_thread_outlives_that_thread() -> None:
    """PR_SET_PDEATHSIG follows the thread that forked: the planner's thread starting workers itself meant its
    end (an exception) stopped every worker it had started (the desk review). Spawns are made on the main
    thread."""
    cluster = Cluster(_launcher_args("--quiet"))
    made: dict[str, Any] = {}

    def ask() -> None:
        made["p"] = cluster.spawn("sleeper", ["sleep", "600"])
        deadline = time.monotonic() + 10
        while _comm(made["p"].popen.pid) != "sleep":  # the lifeline has asked for its signal: then this ends
            assert time.monotonic() < deadline
            time.sleep(0.02)

    asker = threading.Thread(target=ask)
    asker.start()
    while asker.is_alive():
        cluster.serve_spawns(0.1)
    asker.join()
    try:
        time.sleep(0.5)
        assert made["p"].popen.poll() is None, "the child died with the thread that asked for it"
    finally:
        made["p"].popen.kill()
        made["p"].popen.wait(5)


@pytest.mark.parametrize(
    ("service", "flag"),
    [("router", "--port"), ("decode", "--health-port"), ("frontend", "--port")],
)
def test_a_service_on_a_port_in_use_says_so_in_one_line(etcd_server: Any, service: str, flag: str) -> None:
    """A port another process holds (a second `up` started at the same moment, a pod's hostPort) was a traceback:
    grpc's RuntimeError for the gRPC services, uvicorn's SystemExit(3) inside the event loop for the frontend,
    whose 20 last lines under `up` then held no word of the port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "services.cli", service, "--etcd", etcd_server.url, flag, str(port)],
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )  # fmt: skip
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1, done.stderr[-2000:]
    assert last.startswith(f"rackserve {service}: error: OSError: ") and str(port) in last, done.stderr[
        -2000:
    ]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


def test_ctrl_c_in_generate_stops_it_without_a_traceback() -> None:
    """`rackserve generate` interrupted while it streams its answer printed a KeyboardInterrupt traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "generate", "--prompt", "Write a long story", "--max-tokens", "400"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
        # as a terminal runs it: SIGINT at its default (a background child of a shell inherits it ignored)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        proc.stdout.read(20)  # the answer has begun
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err.decode()[-2000:]
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err.decode()[-2000:]
