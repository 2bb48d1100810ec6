"""A real OTLP/gRPC trace receiver on loopback, for tests that assert on the spans services export.

`with trace_receiver() as (receiver, endpoint):` serves opentelemetry-proto's TraceService on 127.0.0.1 and
keeps every span it receives, flattened (service name, ids as hex, attributes as plain values), in
`receiver.spans`; pass `endpoint` to a service's `--otlp-endpoint`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace endpoint that keeps every span it receives, flattened with its service name."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        for resource_spans in request.resource_spans:
            service = next(
                (a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"),
                "",
            )
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    attributes = {a.key: _value(a.value) for a in s.attributes}
                    with self._lock:
                        self.spans.append(
                            {
                                "service": service,
                                "name": s.name,
                                "trace_id": s.trace_id.hex(),
                                "span_id": s.span_id.hex(),
                                "parent_span_id": s.parent_span_id.hex(),
                                "start_ns": s.start_time_unix_nano,
                                "end_ns": s.end_time_unix_nano,
                                "attributes": attributes,
                            }
                        )
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_request(self, request_id: str) -> list[dict[str, Any]]:
        return [s for s in list(self.spans) if s["attributes"].get("rackserve.request_id") == request_id]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@contextmanager
def trace_receiver() -> Iterator[tuple[TraceReceiver, str]]:
    receiver = TraceReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, f"http://127.0.0.1:{port}"
    finally:
        server.stop(0)
