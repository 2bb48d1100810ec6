"""The small `/metrics` HTTP server of router, prefill and decode workers (the frontend serves its own).

`--metrics-port` picks the port; 0 takes an ephemeral one, and the bound `host:port` goes into the worker's
WorkerInfo.metrics_endpoint in etcd, so a launcher or a test can find it; -1 turns the server off. It runs
prometheus-client's own server in a daemon thread, off the event loop, serving the default registry.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prometheus_client import start_http_server

log = logging.getLogger("rackserve.telemetry")


@dataclass
class MetricsServer:
    endpoint: str  # host:port it listens on
    _server: Any
    _thread: Any

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=2)


def start_metrics_server(host: str, port: int) -> MetricsServer | None:
    """Serve /metrics on host:port (0: ephemeral); None when port is negative (off)."""
    if port < 0:
        return None
    server, thread = start_http_server(port, addr=host)
    bound = server.server_port
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return MetricsServer(f"{host}:{bound}", server, thread)
