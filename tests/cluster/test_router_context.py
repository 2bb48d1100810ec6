"""A prompt that fits the decode workers' context is served, even where a prefill worker's context is shorter.

A real etcd, frontend, router (`--mode disagg`), a prefill worker with little KV memory (34 blocks: a 544-token
context) and a decode worker with more (a 5824-token context). The frontend admits prompts up to the decode
workers' context; until 2026-12-07 the router sent a 1000-token prompt to the small prefill worker anyway, which
refused it, and the client got a 400 for a prompt the cluster could serve (on the decode worker, aggregated).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support.cluster import (
    WORKER_FLAGS,
    LocalCluster,
    Proc,
    local_cluster,
    start_process,
    wait_frontend_ready,
)
from tests.support.markers import starts_processes

BIG_KV = ["--dtype", "float32", "--threads", "1", "--kv-cache-bytes", str(256 << 20)]


@pytest.fixture(scope="module")
@starts_processes
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    log_dir = str(tmp_path_factory.mktemp("router-context"))

    def start(etcd_url: str) -> list[Proc]:
        return [
            start_process("services.prefill.server", "prefill-small", etcd_url, log_dir, *WORKER_FLAGS),
            start_process("services.decode.server", "decode-big", etcd_url, log_dir, *BIG_KV),
            start_process("services.router.server", "router", etcd_url, log_dir, "--mode", "disagg"),
            start_process("services.frontend.server", "frontend", etcd_url, log_dir),
        ]

    with local_cluster(log_dir, start, {"prefill": 1, "decode": 1, "router": 1, "frontend": 1}) as c:
        wait_frontend_ready(f"http://{c.endpoints['frontend']}", ("decode", "prefill"))
        yield c


def test_a_prompt_longer_than_a_prefill_workers_context_is_served_by_the_decode_worker(
    cluster: LocalCluster,
) -> None:
    small, big = cluster.infos["prefill-small"].max_model_len, cluster.infos["decode-big"].max_model_len
    n = 1000
    assert small < n < big, (small, big)
    url = f"http://{cluster.endpoints['frontend']}"
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    prompt = [(i * 37) % 4000 + 10 for i in range(n)]
    r = httpx.post(
        f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4}, timeout=120
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == n
