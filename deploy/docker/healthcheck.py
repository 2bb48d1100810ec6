"""Container HEALTHCHECK for every rackserve image: healthy when the service in this container says it serves.

The frontend answers HTTP `GET /health`; the router and the workers answer the gRPC health protocol
(`grpc.health.v1`, SERVING only once the model is loaded and until a drain begins), on `RACKSERVE_HEALTH_PORT`
(plaintext even when the service port requires mutual TLS) or else `RACKSERVE_PORT`. Which service runs is read
from PID 1's command line. Exit 0 healthy, 1 not. (Kubernetes ignores HEALTHCHECK; the chart's probes ask the same
questions.)
"""

from __future__ import annotations

import os
import sys
import urllib.request

TIMEOUT_S = 3.0
ROLES = ("frontend", "router", "prefill", "decode")


def service_role() -> str:
    try:
        with open("/proc/1/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return ""
    return next((a for a in argv if a in ROLES), "")


def main() -> int:
    role = service_role()
    host = os.environ.get("RACKSERVE_HOST", "127.0.0.1")
    host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    if role == "frontend" or not role:
        port = os.environ.get("RACKSERVE_PORT", "8000")
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=TIMEOUT_S) as r:
                return 0 if r.status == 200 else 1
        except OSError as e:
            print(f"frontend /health: {e}", file=sys.stderr)
            return 1
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = os.environ.get("RACKSERVE_HEALTH_PORT") or os.environ.get("RACKSERVE_PORT", "")
    if not port or port == "0":
        print(
            "set RACKSERVE_HEALTH_PORT (or a fixed RACKSERVE_PORT) to health-check this service",
            file=sys.stderr,
        )
        return 1
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S
            )
        except grpc.RpcError as e:
            print(f"{role} health: {e.code().name}", file=sys.stderr)
            return 1
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
