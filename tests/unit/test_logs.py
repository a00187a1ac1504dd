"""Structured logs: JSON lines carrying the bound ids (and the current span's), text lines
with the ids appended, the format chosen by option or TOOLLEDGER_LOG_FORMAT."""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import pytest

from toolledger.observability import logs


def emit(fmt: str, message: str, *args: object) -> str:
    out = io.StringIO()
    logger = logging.getLogger(f"toolledger.test.{fmt}")
    logger.propagate = False
    logger.handlers[:] = [logs.handler(fmt, out)]
    logger.setLevel(logging.INFO)
    logger.info(message, *args)
    return out.getvalue()


def test_json__one_object_per_line_with_the_bound_ids():
    with logs.bind(scope="s", idempotency_key="k", attempt=1, tool_call_id=None):
        logs.bind_more(execution_id="e1", tool="write_file")
        text = emit("json", "did %s", "it")
    line = json.loads(text)
    assert line["message"] == "did it" and line["level"] == "INFO"
    assert (line["scope"], line["idempotency_key"], line["attempt"]) == ("s", "k", 1)
    assert (line["execution_id"], line["tool"]) == ("e1", "write_file")
    assert "tool_call_id" not in line  # None is not an id
    assert text.count("\n") == 1


def test_json__every_unicode_line_break_is_escaped_one_record_one_line():
    text = emit("json", "a%sb", "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")
    assert len(text.splitlines()) == 1, text.splitlines()
    assert json.loads(text)["message"] == "a\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029b"


def test_json__no_ids_outside_a_bind_and_binds_nest():
    assert "scope" not in json.loads(emit("json", "x"))
    with logs.bind(scope="outer"), logs.bind(execution_id="inner"):
        line = json.loads(emit("json", "x"))
    assert (line["scope"], line["execution_id"]) == ("outer", "inner")
    assert logs.bound() == {}


def test_json__carries_the_current_span_ids():
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("t")
    with tracer.start_as_current_span("s") as span:
        line = json.loads(emit("json", "x"))
    ctx = span.get_span_context()
    assert line["trace_id"] == f"{ctx.trace_id:032x}"
    assert line["span_id"] == f"{ctx.span_id:016x}"


def test_text__ids_appended():
    with logs.bind(execution_id="e9"):
        assert emit("text", "hello").rstrip().endswith("hello [execution_id=e9]")


def test_format__option_then_environment_then_text(monkeypatch):
    monkeypatch.delenv("TOOLLEDGER_LOG_FORMAT", raising=False)
    assert logs.log_format() == "text"
    monkeypatch.setenv("TOOLLEDGER_LOG_FORMAT", "JSON")
    assert logs.log_format() == "json"
    assert logs.log_format("text") == "text"
    with pytest.raises(ValueError, match="xml"):
        logs.log_format("xml")


def test_configure_logging__replaces_the_root_handlers(monkeypatch):
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    try:
        logs.configure_logging("json", logging.WARNING)
        assert len(root.handlers) == 1
        assert isinstance(root.handlers[0].formatter, logs.JsonFormatter)
        assert root.level == logging.WARNING
    finally:
        root.handlers[:] = saved
        root.setLevel(level)


def test_metric_hooks__a_failure_to_count_never_reaches_the_protocol(caplog: Any) -> None:
    """A hook that cannot count (its registry broken) logs once and returns."""
    from toolledger.ledger import metrics

    class Broken:
        def __getattr__(self, name: str) -> Any:
            raise OSError(28, "No space left on device")

    saved = metrics._metrics
    metrics._metrics = Broken()  # type: ignore[assignment]
    try:
        metrics.transition("t", "succeeded")
        metrics.transition("t", "failed")
        metrics.execution_finished("t", 0.1)
    finally:
        metrics._metrics = saved
    lost = [r for r in caplog.records if "lost" in r.getMessage()]
    assert [r.getMessage() for r in lost] == [
        "metric transition lost",
        "metric execution_finished lost",
    ]


def test_json__a_python_warning_before_logging_is_set_up_is_a_json_line(monkeypatch):
    """Under ``--log-format json`` (TOOLLEDGER_LOG_FORMAT=json), a warning printed before
    Celery captures warnings into logging (its warning that the worker runs as root) was
    ``toolledger: warning: …``, the first line of stderr and not JSON (a cold review)."""
    import warnings

    from toolledger.cli import warnings_on_one_line

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    warnings_on_one_line()
    monkeypatch.setenv("TOOLLEDGER_LOG_FORMAT", "json")
    said = warnings.formatwarning("running as\n  root", UserWarning, "x.py", 1)
    assert said.endswith("\n") and said.count("\n") == 1
    line = json.loads(said)
    assert (line["level"], line["logger"], line["message"]) == (
        "WARNING",
        "py.warnings",
        "running as root",
    )
    monkeypatch.setenv("TOOLLEDGER_LOG_FORMAT", "text")
    assert warnings.formatwarning("x", UserWarning, "x.py", 1) == "toolledger: warning: x\n"
