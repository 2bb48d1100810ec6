"""Fuzz the HTTP API of a secured cluster: schemathesis generates requests from the frontend's own OpenAPI document
and sends them to a real frontend (API keys on) in front of a real router and decode worker (SmolLM2), every gRPC
link between them mutual TLS. Bounded in examples and time. Nothing may answer 5xx or hang; afterwards the service
still serves a real completion — over mTLS — and turns away gRPC clients without a certificate."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.runtime.tls import GrpcTls
from tests.support.certs import SERVER_NAME, make_ca_and_leaf, tls_flags
from tests.support.cluster import WORKER_FLAGS, local_cluster, start_process
from tests.support.etcd import free_port

KEY = "sk-fuzz-0c41d7"
MODEL = "SmolLM2-135M-Instruct"
MAX_TIME_S = 25  # schemathesis' own budget for the whole run
MAX_EXAMPLES = 30  # per operation and phase


@dataclass
class SecureCluster:
    url: str
    decode_endpoint: str
    decode_health_port: int
    certs: dict[str, str]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureCluster]:
    log_dir = tmp_path_factory.mktemp("fuzz")
    certs = make_ca_and_leaf(tmp_path_factory.mktemp("certs"))
    tls = tls_flags(certs)
    health_port = free_port()

    def start(etcd_url: str) -> list:
        return [
            start_process(
                "services.router.server", "router-fz", etcd_url, str(log_dir), "--mode", "agg", *tls
            ),
            start_process(
                "services.decode.server",
                "decode-fz",
                etcd_url,
                str(log_dir),
                *WORKER_FLAGS,
                *tls,
                "--kv-backends",
                "tcp",
                "--health-port",
                str(health_port),
            ),  # fmt: skip
            # a short context keeps any generation the fuzzer reaches short; a small body limit gets exercised
            start_process(
                "services.frontend.server",
                "frontend-fz",
                etcd_url,
                str(log_dir),
                *tls,
                "--api-key",
                KEY,
                "--max-model-len",
                "40",
                "--max-body-bytes",
                "65536",
                "--request-timeout-s",
                "60",
            ),  # fmt: skip
        ]

    with local_cluster(str(log_dir), start, {"router": 1, "decode": 1, "frontend": 1}) as c:
        yield SecureCluster(
            f"http://{c.endpoints['frontend-fz']}", c.endpoints["decode-fz"], health_port, certs
        )


def _complete(url: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        return http.post("/v1/completions", json=body)


def test_fuzzed_requests_never_get_a_5xx_or_hang_and_the_service_keeps_serving(
    cluster: SecureCluster, tmp_path: Path
) -> None:
    schema = httpx.get(f"{cluster.url}/openapi.json", timeout=30).json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(schema["paths"])
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    # The one runtime fact the document cannot know: the served model's name. Pinned, the fuzzer's requests pass
    # the model check and reach tokenization, the context checks, the router, the worker and the streams.
    for path in ("/v1/chat/completions", "/v1/completions"):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        body["properties"]["model"] = {"type": "string", "const": MODEL}
    (tmp_path / "openapi.json").write_text(json.dumps(schema))
    cmd = [
        str(Path(sys.executable).parent / "st"), "run", str(tmp_path / "openapi.json"), "--url", cluster.url,
        "--checks", "not_a_server_error",
        "--header", f"Authorization: Bearer {KEY}",
        "--max-examples", str(MAX_EXAMPLES),
        "--max-time", str(MAX_TIME_S),
        "--request-timeout", "90",  # a request still running then counts as a hang, and fails the run
        "--generation-database", "none",
        "--workers", "1",  # hypothesis' generation is not thread-safe on CPython 3.11 (ast recursion errors)
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=MAX_TIME_S + 150)
    report = out.stdout[-6000:] + out.stderr[-2000:]
    assert out.returncode == 0, report
    assert "generated" in out.stdout and "failure" not in out.stdout.lower(), report
    # still up, still right: a real completion after the storm (frontend -> router -> worker, all over mTLS)
    assert httpx.get(f"{cluster.url}/health", timeout=30).status_code == 200
    r = _complete(cluster.url)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


async def _health(target: str, credentials: grpc.ChannelCredentials | None) -> str:
    options = [("grpc.ssl_target_name_override", SERVER_NAME)]
    channel = (
        grpc.aio.secure_channel(target, credentials, options=options)
        if credentials is not None
        else grpc.aio.insecure_channel(target)
    )
    async with channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        except grpc.aio.AioRpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_services_speak_mutual_tls_and_refuse_clients_without_a_certificate(cluster: SecureCluster) -> None:
    r = _complete(cluster.url)  # the completion path crosses every gRPC link: Route, Subscribe, Decode
    assert r.status_code == 200, r.text
    certs = cluster.certs
    good = GrpcTls.from_files(certs["cert"], certs["key"], certs["ca"]).channel_credentials()
    no_client_cert = grpc.ssl_channel_credentials(root_certificates=Path(certs["ca"]).read_bytes())

    async def checks() -> tuple[str, str, str, str]:
        return (
            await _health(cluster.decode_endpoint, good),
            await _health(cluster.decode_endpoint, None),  # plaintext against the TLS port
            await _health(cluster.decode_endpoint, no_client_cert),  # TLS, but no client certificate
            await _health(f"127.0.0.1:{cluster.decode_health_port}", None),  # the probe port: health only
        )

    assert asyncio.run(checks()) == ("SERVING", "UNAVAILABLE", "UNAVAILABLE", "SERVING")
