"""Telemetry shared by every rackserve service: Prometheus metric definitions (metrics.py), OpenTelemetry
tracing and W3C traceparent propagation (tracing.py), and the workers' `/metrics` HTTP server (http.py).

This room must never import a service; services import it.
"""
