"""A real local cluster for the measuring scripts: `rackserve up` as a subprocess, ready when it says so."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from services.runtime.ports import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextmanager
def rackserve_up(*flags: str, ready_timeout_s: float = 300.0, log_path: str | None = None) -> Iterator[str]:
    """Run `rackserve up --quiet <flags>` on a free port; yield its base URL; kill it on the way out."""
    port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--quiet", *flags]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + ready_timeout_s
    try:
        while True:
            line = proc.stdout.readline()
            if line:
                lines.append(line)
            if "rackserve is ready" in line:
                break
            if not line or time.monotonic() > deadline:
                raise RuntimeError("rackserve up did not become ready:\n" + "".join(lines[-30:]))
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if log_path:
            with open(log_path, "w") as f:
                f.writelines(lines)
