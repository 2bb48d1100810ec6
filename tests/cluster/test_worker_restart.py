"""A decode worker restarted on its own address (a container restarted in its pod keeps the pod's IP and port)
serves again as soon as it is registered.

The frontend keeps one gRPC channel per endpoint. The dead worker's channel had lost its connection, and gRPC
keeps reconnecting it with a backoff that grows toward two minutes, failing every call at once in between: the
new process, registered and healthy, got "failed to connect" from the frontend, which reported it failed to the
routers and hid it, and answered 503 (31 s of them after a 40 s outage, until 2026-12-07). The channel now
follows the worker's epoch: a new process behind the address gets a fresh one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.cluster import LocalCluster, Proc, local_cluster, run, start_process, wait_frontend_ready
from tests.support.etcd import free_port

pytestmark = pytest.mark.cluster

FLAGS = ["--dtype", "float32", "--threads", "1", "--kv-cache-bytes", str(24 << 20)]
# long enough for gRPC's reconnect backoff of the dead worker's channel to reach tens of seconds
OUTAGE_S = 45.0
BODY = {"model": "SmolLM2-135M-Instruct", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, str, int]]:
    log_dir = str(tmp_path_factory.mktemp("restart"))
    port = free_port()

    def start(etcd_url: str) -> list[Proc]:
        return [
            start_process(
                "services.decode.server", "decode-0", etcd_url, log_dir, *FLAGS, "--port", str(port)
            ),
            start_process("services.router.server", "router-0", etcd_url, log_dir, "--mode", "agg"),
            start_process("services.frontend.server", "frontend-0", etcd_url, log_dir),
        ]

    with local_cluster(log_dir, start, {"decode": 1, "router": 1, "frontend": 1}) as c:
        wait_frontend_ready(f"http://{c.endpoints['frontend-0']}", ("router", "decode"))
        yield c, log_dir, port


def test_a_decode_worker_restarted_on_its_address_serves_as_soon_as_it_is_registered(
    cluster: tuple[LocalCluster, str, int],
) -> None:
    c, log_dir, port = cluster
    base = f"http://{c.endpoints['frontend-0']}"
    assert httpx.post(f"{base}/v1/completions", json=BODY, timeout=60).status_code == 200
    dead = c.procs["decode-0"].popen
    dead.kill()
    dead.wait()
    # requests while it is gone (refused): the frontend's channel to its address breaks
    end = time.monotonic() + OUTAGE_S
    while time.monotonic() < end:
        httpx.post(f"{base}/v1/completions", json=BODY, timeout=60)
        time.sleep(1)
    again = start_process(
        "services.decode.server", "decode-0", c.etcd.url, log_dir, *FLAGS, "--port", str(port)
    )
    c.procs["decode-0-again"] = again
    wait_frontend_ready(base, ("router", "decode"))

    async def served_within(seconds: float) -> list[tuple[int, str]]:
        answers: list[tuple[int, str]] = []
        async with httpx.AsyncClient(timeout=60) as client:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                r = await client.post(f"{base}/v1/completions", json=BODY)
                answers.append((r.status_code, r.text[:200]))
                if r.status_code == 200:
                    break
        return answers

    # the router hears its first load report within a second; the frontend must not refuse it meanwhile
    answers = run(lambda: served_within(5.0), 120)
    assert answers[-1][0] == 200, answers
    assert all("failed to connect" not in text for _, text in answers), answers
