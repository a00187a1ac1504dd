"""Seeing it run: Prometheus metrics, OpenTelemetry traces (optional) and structured logs.

``metrics``: the endpoints (``asgi_app`` for ``toolledger serve``, an HTTP endpoint per worker
process group and for the beat) and the collector that reads the ledger's current state;
``tracing``: spans and the trace context carried in Celery messages, no-ops unless
OpenTelemetry is installed and configured by the standard ``OTEL_*`` variables;
``logs``: ``configure_logging`` (text or JSON lines) and the ids every line carries.
The metric definitions themselves live in ``toolledger.ledger.metrics`` (the ledger counts
its own transitions, and may import nothing above itself).
"""

from __future__ import annotations

__all__ = ["asgi_app", "configure_logging"]


def __getattr__(name: str) -> object:
    # lazy: importing the package must not import prometheus_client or OpenTelemetry
    if name == "asgi_app":
        from toolledger.observability.metrics import asgi_app

        return asgi_app
    if name == "configure_logging":
        from toolledger.observability.logs import configure_logging

        return configure_logging
    raise AttributeError(name)
