"""What a service registers in etcd is an address its peers can dial, whatever address it listens on.

In a pod the frontend listens on 0.0.0.0 (probes and port-forwards reach it on any address) and the planner scrapes
its /metrics at the endpoint it registered: a wildcard is no address to dial, so a service registers
--advertise-host (the chart: the pod's IP), else its --host, else, for a wildcard, the machine's name.
"""

from __future__ import annotations

import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.cluster import local_cluster, run, start_process
from tests.support.etcd import free_port

pytestmark = pytest.mark.cluster  # starts etcd and routers


def test_a_service_listening_on_every_address_registers_one_its_peers_can_dial(
    tmp_path: pytest.TempPathFactory,
) -> None:
    log_dir = str(tmp_path)

    def start(etcd_url: str) -> list:
        return [
            start_process("services.router.server", "advertised", etcd_url, log_dir,
                          "--host", "0.0.0.0", "--advertise-host", "127.0.0.1"),
            start_process("services.router.server", "wildcard", etcd_url, log_dir, "--host", "0.0.0.0"),
        ]  # fmt: skip

    with local_cluster(log_dir, start, {"router": 2}) as c:
        advertised, wildcard = c.endpoints["advertised"], c.endpoints["wildcard"]
        assert advertised.rsplit(":", 1)[0] == "127.0.0.1"
        assert wildcard.rsplit(":", 1)[0] == socket.gethostname()
        # and the metrics endpoint the planner and /metrics/targets dial, the same way (the desk review)
        assert c.infos["advertised"].metrics_endpoint.rsplit(":", 1)[0] == "127.0.0.1"
        assert c.infos["wildcard"].metrics_endpoint.rsplit(":", 1)[0] == socket.gethostname()

        async def serving(endpoint: str) -> int:
            async with grpc.aio.insecure_channel(endpoint) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5.0
                )
                return int(reply.status)

        # both registered endpoints are dialled as a peer would dial them, and answer
        for endpoint in (advertised, wildcard):
            assert run(lambda e=endpoint: serving(e), 10.0) == health_pb2.HealthCheckResponse.SERVING


def test_a_second_service_given_a_taken_port_fails_instead_of_sharing_it(
    tmp_path: pytest.TempPathFactory,
) -> None:
    """grpc sets SO_REUSEPORT by default: a second router on the same port bound it too, both said `serving`,
    and the kernel split connections between them (so did three services of `rackserve up` given one
    RACKSERVE_PORT). Now the second one does not start."""
    log_dir = str(tmp_path)
    port = free_port()

    def start(etcd_url: str) -> list:
        return [start_process("services.router.server", "first", etcd_url, log_dir, "--port", str(port))]

    with local_cluster(log_dir, start, {"router": 1}) as c:
        second = start_process("services.router.server", "second", c.etcd.url, log_dir, "--port", str(port))
        try:
            assert second.popen.wait(60) != 0
        finally:
            if second.popen.poll() is None:
                second.popen.kill()
        assert "Failed to bind" in second.log_tail() or "address already in use" in second.log_tail().lower()
        assert c.endpoints["first"].endswith(f":{port}")
