"""End to end: `rackserve up` runs the whole cluster as real processes, and the official openai client talks to it."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess

import httpx
import pytest

from tests.support.cluster import rackserve_up

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cluster():
    with rackserve_up("--dtype", "float32", "--prefill", "1", "--decode", "1") as up:
        yield up


def test_openai_client_streams_the_capital_of_france(cluster):
    import openai

    _, url = cluster
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=FRANCE, temperature=0, stream=True, max_tokens=32
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == "The capital of France is Paris."


def test_sixteen_concurrent_requests_all_complete(cluster):
    import openai

    _, url = cluster
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=180)

    def ask(i: int) -> tuple[str, str | None]:
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": f"Count from {i} to {i + 3}."}],
            max_tokens=12,
            temperature=0.7,
            seed=i,
        )
        return r.choices[0].message.content or "", r.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(ask, range(16)))
    assert len(results) == 16
    assert all(text and reason in ("stop", "length") for text, reason in results)


@pytest.mark.parametrize(
    "body,status,etype",
    [
        ({"model": "gpt-9", "messages": FRANCE}, 404, "invalid_request_error"),
        ({"model": "SmolLM2-135M-Instruct", "messages": "hi"}, 400, "invalid_request_error"),
        (
            {"model": "SmolLM2-135M-Instruct", "messages": FRANCE, "max_tokens": 0},
            400,
            "invalid_request_error",
        ),
        (
            {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "word " * 9000}]},
            400,
            "invalid_request_error",
        ),
    ],
)
def test_bad_requests_get_openai_errors(cluster, body, status, etype):
    _, url = cluster
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["type"] == etype and err["message"]


def test_malformed_json_is_a_400(cluster):
    _, url = cluster
    r = httpx.post(
        f"{url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_ctrl_c_stops_every_process(cluster):
    proc, url = cluster
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    assert len(children.stdout.split()) == 5  # etcd, router, prefill, decode, frontend
    proc.send_signal(signal.SIGINT)
    # the launcher kills whatever has not stopped 30 s after the signal
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        ps = subprocess.run(
            ["ps", "-eo", "pid,ppid,stat,wchan:24,etime,args"], capture_output=True, text=True
        )
        ours = {str(proc.pid), *children.stdout.split()}
        mine = [ln for ln in ps.stdout.splitlines() if set(ln.split()[:2]) & ours]
        pytest.fail(
            "rackserve up still running 60 s after Ctrl-C\n"
            + "\n".join(mine)
            + "\n--- its output ---\n"
            + "".join(proc.log_tail)
        )
    assert code == 0, "".join(proc.log_tail)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)
    for pid in children.stdout.split():
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid), f"process {pid} still running"


def _is_zombie(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True
