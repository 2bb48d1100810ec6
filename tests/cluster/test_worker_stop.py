"""A worker told to stop before it serves: SIGTERM while its model loads ends it, even as PID 1 of a container.

Linux ignores a signal that PID 1 of a PID namespace has no handler for when it comes from outside (the container
runtime's SIGTERM on a pod's deletion), so a worker whose handlers came only once its model had loaded held its GPU
until the kubelet's SIGKILL. Here the worker runs as PID 1 of a namespace of its own (`unshare`), and its model is a
FIFO no one writes: a model volume that never answers, so the load lasts as long as the test wants.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.paths import REPO

pytestmark = [
    pytest.mark.cluster,  # starts processes
    pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare as root"),
]


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _child(pid: int, deadline_s: float = 30.0) -> int:
    """The one child of `pid` (unshare's: the worker, PID 1 of its namespace)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        children = _children(pid)
        if children:
            return children[0]
        time.sleep(0.05)
    raise AssertionError("unshare started no worker")


def _wait_for(log: Path, text: str, proc: subprocess.Popen[bytes], deadline_s: float = 120.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if text in log.read_text(errors="replace"):
            return
        assert proc.poll() is None, log.read_text(errors="replace")
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} within {deadline_s}s\n{log.read_text(errors='replace')}")


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_worker_stopped_while_its_model_loads_exits_even_as_pid_1(tmp_path: Path, role: str) -> None:
    model = tmp_path / "stalled.gguf"
    os.mkfifo(model)
    log = tmp_path / f"{role}.log"
    cmd = ["unshare", "--fork", "--pid", "--mount-proc", sys.executable, "-m", f"services.{role}.server"]
    cmd += ["--etcd", "http://127.0.0.1:1", "--port", "0", "--worker-id", f"{role}-loading"]
    cmd += ["--model", str(model)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        worker = _child(proc.pid)
        # the service's host is up (its metrics endpoint logged) and the engine thread waits on the model
        _wait_for(log, "metrics on", proc)
        time.sleep(0.5)
        os.kill(worker, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text(errors="replace")
        said = log.read_text(errors="replace")
        assert "stopped while loading its model" in said, said
        assert "listening on" not in said  # it never served
    finally:
        if proc.poll() is None:
            for pid in _children(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()
