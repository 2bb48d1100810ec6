"""OpenTelemetry tracing for every rackserve process: setup, W3C traceparent in and out, and span helpers.

Off by default. `configure(service, instance, endpoint)` with an OTLP/gRPC endpoint (`--otlp-endpoint`,
e.g. `http://otel-collector:4317`) installs a TracerProvider whose BatchSpanProcessor exports every
`--otlp-batch-delay-ms`; without one, the API's no-op tracer makes every span call free.

One trace per request (docs/design.md). The frontend's coordinator makes the request's traceparent when the
request arrives — `00-<trace id>-<request span id>-01` — and sends it in the metadata of every RPC; the
frontend emits the `request` span with exactly that span id once the request ends (`pinned_ids`), so the
spans the workers emitted meanwhile (`route`, `prefill`, `kv_transfer`) are its children. Workers open their
spans under the caller's traceparent with `server_span`. Every span carries `rackserve.request_id`.

This room must never import a service, and never make tracing a reason for a request to fail.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import logging
import secrets
import time
from collections.abc import Iterator, Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("rackserve.telemetry")

TRACER_NAME = "rackserve"
REQUEST_ID = "rackserve.request_id"  # the attribute every span carries
DEFAULT_BATCH_DELAY_MS = 1000

_propagator = TraceContextTextMapPropagator()
_pinned: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("pinned_ids", default=None)
_provider = None  # the SDK TracerProvider once configured


def configure(
    service: str, instance: str, endpoint: str, batch_delay_ms: int = DEFAULT_BATCH_DELAY_MS
) -> bool:
    """Export spans over OTLP/gRPC to `endpoint`; "" leaves tracing off. True when tracing is on."""
    global _provider
    if not endpoint:
        return False
    # imported here: a process without an endpoint never loads the SDK or the exporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class PinnableIds(RandomIdGenerator):
        """Random ids, except inside `pinned_ids`, where the next span gets the ids already on the wire."""

        def generate_span_id(self) -> int:
            pinned = _pinned.get()
            return pinned[1] if pinned else super().generate_span_id()

        def generate_trace_id(self) -> int:
            pinned = _pinned.get()
            return pinned[0] if pinned else super().generate_trace_id()

    resource = Resource.create({"service.name": f"rackserve-{service}", "service.instance.id": instance})
    provider = TracerProvider(resource=resource, id_generator=PinnableIds())
    insecure = not endpoint.startswith("https://")
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure, timeout=5)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=batch_delay_ms))
    trace.set_tracer_provider(provider)
    _provider = provider
    atexit.register(shutdown)
    log.info("tracing on: OTLP/gRPC to %s, batched every %d ms", endpoint, batch_delay_ms)
    return True


def enabled() -> bool:
    return _provider is not None


def shutdown() -> None:
    """Flush what is batched (bounded by the exporter's timeout) and stop exporting."""
    global _provider
    provider, _provider = _provider, None
    if provider is not None:
        provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


# ---- W3C traceparent -------------------------------------------------------------------------------------------


def parse_traceparent(traceparent: str | None) -> SpanContext | None:
    """The span context a valid traceparent names (remote), else None."""
    if not traceparent:
        return None
    ctx = _propagator.extract({"traceparent": traceparent})
    span_context = trace.get_current_span(ctx).get_span_context()
    return span_context if span_context.is_valid else None


def new_traceparent(parent: str | None = None) -> str:
    """A traceparent for a new request span: continues the client's trace (and its flags) when `parent` is a
    valid traceparent, else starts a trace of its own. The span id is always new."""
    span_context = parse_traceparent(parent)
    if span_context is not None:
        trace_id, flags = f"{span_context.trace_id:032x}", f"{int(span_context.trace_flags):02x}"
    else:
        trace_id, flags = secrets.token_hex(16), "01"
    return f"00-{trace_id}-{secrets.token_hex(8)}-{flags}"


def context_of(traceparent: str | None) -> Context:
    """An OpenTelemetry context whose parent is the span `traceparent` names; an empty one (the span starts a
    trace) when it names none. Never the current context: the frontend's spans are made inside FastAPI's own
    HTTP span, and a `request` span that fell back to it joined FastAPI's trace, not the one whose traceparent
    the workers got, so a request sent without a traceparent left two traces (until 2026-12-07)."""
    span_context = parse_traceparent(traceparent)
    return trace.set_span_in_context(NonRecordingSpan(span_context)) if span_context else Context()


def traceparent_of(span: Span) -> str:
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


@contextlib.contextmanager
def pinned_ids(traceparent: str) -> Iterator[None]:
    """The next span started inside gets the trace id and span id of `traceparent` (a no-op if invalid)."""
    span_context = parse_traceparent(traceparent)
    token = _pinned.set((span_context.trace_id, span_context.span_id) if span_context else None)
    try:
        yield
    finally:
        _pinned.reset(token)


# ---- spans -----------------------------------------------------------------------------------------------------


def unix_ns(unix_s: float) -> int:
    return int(unix_s * 1e9)


def monotonic_to_unix_s(monotonic_s: float) -> float:
    """A time.monotonic() reading as unix seconds (spans are in wall-clock time)."""
    return time.time() - (time.monotonic() - monotonic_s)


@contextlib.contextmanager
def server_span(name: str, traceparent: str, request_id: str) -> Iterator[Span]:
    """A span for work done on behalf of the caller whose traceparent came in the RPC metadata."""
    with tracer().start_as_current_span(
        name,
        context=context_of(traceparent),
        kind=SpanKind.SERVER,
        attributes={REQUEST_ID: request_id},
    ) as span:
        yield span


def child_span(
    parent: Span, name: str, start_unix_s: float, end_unix_s: float, attributes: Mapping[str, object]
) -> None:
    """A finished span under `parent` covering [start, end] (for phases timed before the span existed)."""
    ctx = trace.set_span_in_context(parent)
    span = tracer().start_span(
        name, context=ctx, start_time=unix_ns(start_unix_s), attributes=_attrs(attributes)
    )
    span.end(end_time=unix_ns(max(end_unix_s, start_unix_s)))


def _attrs(attributes: Mapping[str, object]) -> dict[str, str | int | float | bool]:
    """Span attributes must be primitives; None is dropped, anything else becomes its text."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in attributes.items():
        if value is None:
            continue
        out[key] = value if isinstance(value, (str, int, float, bool)) else str(value)
    return out


def set_attributes(span: Span, attributes: Mapping[str, object]) -> None:
    span.set_attributes(_attrs(attributes))


__all__ = [
    "REQUEST_ID",
    "SpanKind",
    "StatusCode",
    "TraceFlags",
    "child_span",
    "configure",
    "context_of",
    "enabled",
    "monotonic_to_unix_s",
    "new_traceparent",
    "parse_traceparent",
    "pinned_ids",
    "server_span",
    "set_attributes",
    "shutdown",
    "traceparent_of",
    "tracer",
    "unix_ns",
]
