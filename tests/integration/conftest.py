"""Fixtures two or more integration modules share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def exporter() -> Iterator[Any]:
    """This process's spans, in memory (one SDK provider per process: added to it if one is
    set); shut down afterwards, so that the rest of the session's spans are not kept.
    Imported here, not at the top: a module that does not trace never loads the SDK."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    yield memory
    memory.shutdown()


@pytest.fixture
def spans(exporter: Any) -> Iterator[Any]:
    """The in-memory exporter, emptied before and after the test."""
    exporter.clear()
    yield exporter
    exporter.clear()


@pytest.fixture
def pending_client(db_url: str, tmp_path: Any) -> Iterator[Any]:
    """A Client on ``db_url`` whose broker is out of reach (nothing is enqueued: every call
    stays pending) and whose fallback read never comes: a wait ends only by a wake-up."""
    from toolledger import Client
    from toolledger.config import Settings

    settings = Settings.from_env(
        {"TOOLLEDGER_DB": db_url, "TOOLLEDGER_HOME": str(tmp_path / "home"),
         "TOOLLEDGER_SANDBOX": str(tmp_path / "sandbox"),
         "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0"}
    )  # fmt: skip
    with Client(settings, poll_interval=3600) as c:
        yield c
