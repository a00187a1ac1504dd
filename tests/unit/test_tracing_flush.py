"""``tracing.flush`` (a prefork child's spans at its exit) is bounded by its timeout whatever
the exporter does: the SDK's batch processor ignores the timeout it is given and exports every
batch, each up to the exporter's own timeout, so behind a collector that accepted and never
answered each recycled child took 10 s to exit, a pool slot held (a cold review)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from toolledger.observability import tracing


class Hanging(SpanExporter):
    """A collector that accepts and never answers (each export waits until released)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.release.wait(30)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.release.set()


def test_flush__gives_up_at_its_timeout_behind_an_exporter_that_never_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter = Hanging()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=60_000))
    tracer = provider.get_tracer("t")
    for i in range(1500):  # several batches
        with tracer.start_as_current_span(f"s{i}"):
            pass
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    started = time.monotonic()
    try:
        tracing.flush(300)
        took = time.monotonic() - started
    finally:
        exporter.release.set()
        provider.shutdown()
    assert took < 5.0, f"flush(300) took {took:.1f} s: the exporter held the exit"


def test_flush__exports_what_it_holds_when_the_exporter_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=60_000))
    with provider.get_tracer("t").start_as_current_span("held"):
        pass
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: provider)
    tracing.flush(5000)
    assert [s.name for s in exporter.get_finished_spans()] == ["held"]
    provider.shutdown()
