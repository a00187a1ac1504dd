"""A call's trace followed through recovery: every span about a call made after its first
worker (the sweep's re-publish and the execution it starts, its reconciliation, a person's
retry and resolution) links to the call's submit span, whose context the ledger keeps with
the call; the span it runs under stays its parent. Before 2026-12-07 each was in the sweep's
or the CLI's trace only, and an operator following a call in a trace UI lost it exactly
when something went wrong (a cold review). In-memory exporter; each backend."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from toolledger.config import Settings
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.transitions import Status
from toolledger.observability import tracing
from toolledger.worker.submit import Submitter

ARGS = {"path": "a.txt", "content": "x"}


class Broker:
    """A Celery app as ``Submitter.enqueue`` and ``tasks.publish`` use it: each message's
    arguments and headers kept; ``down`` makes a publish fail."""

    def __init__(self) -> None:
        self.sent: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.down = False

    @contextlib.contextmanager
    def producer_or_acquire(self) -> Iterator[None]:
        yield None

    def send_task(
        self, name: str, *, args: tuple[Any, ...], headers: dict[str, Any], **_: Any
    ) -> None:
        if self.down:
            raise ConnectionError("the broker is down")
        self.sent.append((args, dict(headers)))

    def close(self) -> None:
        pass


def settings_for(url: str, tmp_path: Path) -> Settings:
    return Settings.from_env(
        {
            "TOOLLEDGER_DB": url,
            "TOOLLEDGER_SANDBOX": str(tmp_path / "sb"),
            "TOOLLEDGER_HOME": str(tmp_path / "home"),
            "TOOLLEDGER_METRICS": "off",
        }
    )


def linked(span: ReadableSpan, to: ReadableSpan) -> bool:
    """Whether ``span`` links to ``to``."""
    want = to.get_span_context()
    return any(
        (link.context.trace_id, link.context.span_id) == (want.trace_id, want.span_id)
        for link in span.links
    )


def one(spans: InMemorySpanExporter, name: str) -> ReadableSpan:
    (found,) = [s for s in spans.get_finished_spans() if s.name == name]
    return found


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise TimeoutError(what)


def make_unknown(ledger: Ledger, scope: str, key: str, attempt: int = 1) -> str:
    """Attempt ``attempt`` claimed by a worker that died: its lease expired."""
    claim = ledger.claim(scope, key, attempt, worker_id="gone", lease_seconds=0.01)
    assert claim is not None
    time.sleep(0.05)
    return claim.execution_id


def run_sweep(ledger: Ledger, settings: Settings, publish: Any, requeue_after: float) -> Any:
    from toolledger.recovery.sweep import sweep
    from toolledger.sandbox import Sandbox

    return sweep(
        ledger,
        Submitter(settings, ledger=ledger).registry,
        Sandbox.configured(settings),
        grace_seconds=0,
        requeue_after=requeue_after,
        publish=publish,
        max_auto_retries=0,
    )


def test_call_trace__the_reconciliation_links_to_the_calls_submit_span(
    db_url: str, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    settings = settings_for(db_url, tmp_path)
    ledger = Ledger(db_url)
    broker = Broker()
    sub = Submitter(settings, ledger=ledger, app=broker)  # type: ignore[arg-type]
    try:
        sub.submit(sub.prepare("tr", "c1", "write_file", ARGS), approved_by="alice")
        eid = make_unknown(ledger, "tr", "write_file:c1")
        summary = run_sweep(ledger, settings, None, 3600)
    finally:
        ledger.close()
    assert summary.marked_unknown == 1
    submit, sweep = one(spans, "submit_tool write_file"), one(spans, "sweep")
    rec = one(spans, "reconcile write_file")
    assert rec.attributes is not None and rec.attributes["toolledger.execution_id"] == eid
    # its parent is still the sweep's span; the link leads to the call's trace
    assert rec.parent is not None and rec.parent.span_id == sweep.context.span_id
    assert linked(rec, submit), rec.links
    assert not linked(sweep, submit)  # the pass is about many calls: no link of its own


def test_call_trace__a_job_the_sweep_republished_links_its_execution_to_the_submit_span(
    db_url: str, tmp_path: Path, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    from toolledger.worker import runtime
    from toolledger.worker.app import create_app
    from toolledger.worker.tasks import EXECUTE, publish

    monkeypatch.setattr(runtime, "_runtime", None)  # this process's: built for this ledger

    settings = settings_for(db_url, tmp_path)
    ledger = Ledger(db_url)
    broker = Broker()
    broker.down = True  # the first publish is lost: the sweep re-publishes the call
    sub = Submitter(settings, ledger=ledger, app=broker)  # type: ignore[arg-type]
    try:
        out = sub.submit(sub.prepare("tr", "c2", "write_file", ARGS), approved_by="alice")
        assert out["enqueued"] is False
        broker.down = False
        summary = run_sweep(ledger, settings, functools.partial(publish, broker, settings), 0)
        assert summary.requeued == 1
        ((args, headers),) = broker.sent
        # the worker runs the message it was handed, as its task does
        app = create_app(settings)
        try:
            app.tasks[EXECUTE].apply(args=args, headers=headers)
        finally:
            app.close()
        assert ledger.get("tr", "c2").operation.status is Status.SUCCEEDED
    finally:
        ledger.close()
    submit, sweep = one(spans, "submit_tool write_file"), one(spans, "sweep")
    execute = one(spans, "execute_tool write_file")
    # the sweep published it: its span is the execution's parent, the submit span its link
    assert execute.context.trace_id == sweep.context.trace_id
    assert execute.parent is not None and execute.parent.span_id == sweep.context.span_id
    assert linked(execute, submit), execute.links


def test_call_trace__a_persons_retry_and_resolution_link_to_the_submit_span(
    db_url: str, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    from toolledger.recovery import humans

    settings = settings_for(db_url, tmp_path)
    ledger = Ledger(db_url)
    broker = Broker()
    sub = Submitter(settings, ledger=ledger, app=broker)  # type: ignore[arg-type]
    try:
        sub.submit(sub.prepare("tr", "c3", "write_file", ARGS), approved_by="alice")
        ledger.mark_expired(grace_seconds=0, limit=10, actor="t")  # nothing expired yet
        first = make_unknown(ledger, "tr", "write_file:c3")
        assert ledger.mark_expired(grace_seconds=0, limit=10, actor="t")
        humans.retry(ledger, sub.registry, sub.enqueue, "tr", "c3", by="bob", accept_duplicate=True)
        second = make_unknown(ledger, "tr", "write_file:c3", 2)
        assert ledger.mark_expired(grace_seconds=0, limit=10, actor="t")
        humans.resolve(ledger, second, Status.FAILED, by="bob", evidence="looked: not there")
    finally:
        ledger.close()
    assert first != second
    submit = one(spans, "submit_tool write_file")
    retried = one(spans, "retry_tool write_file")
    resolved = one(spans, "resolve_tool write_file")
    assert linked(retried, submit), retried.links
    assert linked(resolved, submit), resolved.links
    assert retried.attributes is not None and retried.attributes["toolledger.attempt"] == 2
    assert resolved.attributes is not None
    assert resolved.attributes["toolledger.execution_id"] == second
    # the retry's message: published under the retry's span, and about the call
    _, headers = broker.sent[-1]
    parent = tracing.links_to({"traceparent": headers["traceparent"]})[0].context
    assert parent.span_id == retried.context.span_id
    kept = tracing.links_to({"traceparent": headers[tracing.CALL_TRACEPARENT]})[0].context
    assert kept.span_id == submit.context.span_id


def test_call_trace__the_call_keeps_its_submit_spans_context_in_its_first_event(
    db_url: str, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    """Where the context is kept: the ``submitted`` event's detail, written by the insert
    that records the call (no statement more); a call submitted without tracing keeps none."""
    settings = settings_for(db_url, tmp_path)
    ledger = Ledger(db_url)
    sub = Submitter(settings, ledger=ledger, app=Broker())  # type: ignore[arg-type]
    try:
        sub.submit(sub.prepare("tr", "c4", "write_file", ARGS))
        ledger.submit("tr", "c5", "write_file", ARGS)  # the ledger alone: no span
        traces = ledger.call_traces([("tr", "write_file:c4"), ("tr", "write_file:c5")])
    finally:
        ledger.close()
    submit = one(spans, "submit_tool write_file").get_span_context()
    assert set(traces) == {("tr", "write_file:c4")}
    assert traces["tr", "write_file:c4"]["traceparent"].startswith(
        f"00-{submit.trace_id:032x}-{submit.span_id:016x}-"
    )


def test_call_trace__an_approval_links_to_the_submit_span_and_so_does_its_execution(
    db_url: str, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    """A call waiting for a person, approved later (another process, another trace): the
    approval's span and the execution it publishes are found from the call's trace."""
    settings = settings_for(db_url, tmp_path)
    ledger = Ledger(db_url)
    broker = Broker()
    sub = Submitter(settings, ledger=ledger, app=broker)  # type: ignore[arg-type]
    try:
        sub.submit(sub.prepare("tr", "c6", "write_file", ARGS))  # pending: nothing published
        assert broker.sent == []
        sub.decide("tr", "c6", "alice", None, approve=True)
    finally:
        ledger.close()
    submit, approve = one(spans, "submit_tool write_file"), one(spans, "approve_tool write_file")
    assert linked(approve, submit), approve.links
    ((_, headers),) = broker.sent
    kept = tracing.links_to({"traceparent": headers[tracing.CALL_TRACEPARENT]})[0].context
    assert kept.span_id == submit.context.span_id


def test_call_trace__a_real_worker_links_a_republished_execution_to_the_submit_span(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    """The header travels through a real broker and a prefork pool child (the console
    exporter writes the child's spans, one JSON line each, to the worker's log): the job the
    sweep re-published runs in a span linked to the call's submit span. The embedded ledger
    and broker: no services."""
    import json

    from toolledger.harness.processes import service_env, stop_all, worker_process
    from toolledger.worker.app import create_app

    env_settings = {"sandbox": str(tmp_path / "sb"), "home": str(tmp_path / "home")}
    settings = Settings.from_env(
        {f"TOOLLEDGER_{k.upper()}": v for k, v in env_settings.items()}
        | {"TOOLLEDGER_METRICS": "off"}
    )
    otel = {"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "tl-test-links"}
    env = {**service_env(**env_settings), "TOOLLEDGER_METRICS": "off", **otel}
    worker = worker_process("w1", env, tmp_path / "logs", concurrency=1)
    worker.start()
    try:
        worker.wait_ready(60)
        app = create_app(settings)
        sub = Submitter(settings, app=app)
        sub.submit(sub.prepare("real", "c1", "write_file", ARGS))  # pending: not published
        sub.ledger.approve("real", "c1", by="alice")  # approved, never published (lost)
        summary = run_sweep(sub.ledger, settings, app.toolledger_publish, 0)
        assert summary.requeued == 1
        wait_for(
            lambda: sub.ledger.get("real", "c1").operation.status is Status.SUCCEEDED,
            60,
            "the call to succeed",
        )
        wait_for(lambda: '"execute_tool write_file"' in worker.log_text(), 30, "its span")
        sub.close()
        app.close()
    finally:
        stop_all([worker])
    (line,) = [
        x for x in worker.log_text().splitlines() if '"name": "execute_tool write_file"' in x
    ]
    execute = json.loads(line[line.index("{") :])  # after the log's prefix, if any
    submit = one(spans, "submit_tool write_file").get_span_context()
    links = [link["context"] for link in execute["links"]]
    assert {"trace_id": f"0x{submit.trace_id:032x}", "span_id": f"0x{submit.span_id:016x}"} in [
        {"trace_id": c["trace_id"], "span_id": c["span_id"]} for c in links
    ], execute
    assert execute["context"]["trace_id"] == f"0x{one(spans, 'sweep').context.trace_id:032x}"


def test_call_trace__a_replayed_or_linked_submit_links_to_the_calls_first_submit_span(
    db_url: str, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    """An agent restarted after a crash submits its calls again (another trace): each replay's
    span, and a new id's linked to the call's key, is found from the call's own trace; it stood
    alone before (a cold review), its outcome unsaid."""
    settings = settings_for(db_url, tmp_path)
    ledger = Ledger(db_url)
    sub = Submitter(settings, ledger=ledger, app=Broker())  # type: ignore[arg-type]
    try:
        first = sub.submit(sub.prepare("tr", "c7", "write_file", ARGS))
        sub.submit(sub.prepare("tr", "c7", "write_file", ARGS))  # the replay
        sub.submit(sub.prepare("tr", "c8", "write_file", ARGS, key=first["idempotency_key"]))
    finally:
        ledger.close()
    created, replayed, link = [
        s for s in spans.get_finished_spans() if s.name == "submit_tool write_file"
    ]
    assert [s.attributes.get("toolledger.outcome") for s in (created, replayed, link)] == [
        "created",
        "existing",
        "linked",
    ]
    assert not created.links
    assert linked(replayed, created), replayed.links
    assert linked(link, created), link.links
