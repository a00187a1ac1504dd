"""Traces: the submit span in this process and the ``execute_tool`` span of a real prefork
Celery worker process are one trace (the context travels in the message's headers), with
every attribute; the worker's JSON log lines carry the same ids; the sweep's passes and its
reconciliations are spans too.

The worker runs under a launcher that installs an SDK tracer provider whose in-memory span
exporter also ships each finished span as a JSON line to a file (a pool child's memory is
not ours to read); this process's spans go to an ``InMemorySpanExporter``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from toolledger.config import Settings
from toolledger.harness.processes import ManagedProcess, service_env, stop_all
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.transitions import Status
from toolledger.worker.submit import Submitter

LAUNCHER = """
import json, os, runpy, sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

class Shipping(InMemorySpanExporter):
    def export(self, spans):
        done = super().export(spans)
        with open(os.environ["SPANS_OUT"], "a") as out:
            for span in spans:
                out.write(json.dumps(json.loads(span.to_json())) + "\\n")
        return done

provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(Shipping()))
trace.set_tracer_provider(provider)
sys.argv = ["toolledger", *sys.argv[1:]]
runpy.run_module("toolledger", run_name="__main__")
"""

EXECUTE_ATTRIBUTES = {
    "gen_ai.operation.name",
    "gen_ai.tool.name",
    "gen_ai.tool.call.id",
    "toolledger.scope",
    "toolledger.idempotency_key",
    "toolledger.execution_id",
    "toolledger.attempt",
    "toolledger.status",
}


def read_spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise TimeoutError(what)


@pytest.mark.postgres
@pytest.mark.redis
def test_trace__submit_span_is_the_parent_of_the_worker_span(
    pg_url, redis_server, redis_prefix, tmp_path, spans
):
    settings_env = {
        "db": pg_url,
        "broker": redis_server,
        "broker_prefix": redis_prefix,
        "sandbox": str(tmp_path / "sandbox"),
        "home": str(tmp_path / "home"),
        "metrics": "off",
    }
    out = tmp_path / "worker-spans.jsonl"
    env = {**service_env(**settings_env), "SPANS_OUT": str(out)}
    argv = [sys.executable, "-c", LAUNCHER, "worker", "--pool", "prefork", "--concurrency", "1"]
    argv += ["--without-gossip", "--without-mingle", "--log-format", "json"]
    worker = ManagedProcess("w1", "worker", argv, env, tmp_path / "w1.log")
    worker.start()
    try:
        worker.wait_ready(60)
        settings = Settings.from_env(
            {f"TOOLLEDGER_{k.upper()}": v for k, v in settings_env.items()}
        )
        sub = Submitter(settings)
        # When a call is submitted, approved, in this process
        call = sub.prepare("traced", "call_1", "write_file", {"path": "a.txt", "content": "x"})
        sub.submit(call, approved_by="alice")
        ledger = Ledger(pg_url)
        wait_for(
            lambda: ledger.get("traced", "call_1").operation.status is Status.SUCCEEDED,
            60,
            "the call to succeed",
        )
        done = wait_for(
            lambda: [s for s in read_spans(out) if s["name"].startswith("execute_tool")],
            20,
            "the worker's span",
        )
        eid = ledger.get("traced", "call_1").executions[-1].execution_id
        sub.close()
        ledger.close()
    finally:
        stop_all([worker])
    # Then this process exported the submit span, the worker its child
    (submit,) = [s for s in spans.get_finished_spans() if s.name == "submit_tool write_file"]
    (child,) = done
    ctx = submit.get_span_context()
    assert child["context"]["trace_id"] == f"0x{ctx.trace_id:032x}"
    assert child["parent_id"] == f"0x{ctx.span_id:016x}"
    assert child["name"] == "execute_tool write_file"
    attrs = child["attributes"]
    assert set(attrs) >= EXECUTE_ATTRIBUTES, EXECUTE_ATTRIBUTES - set(attrs)
    assert attrs["gen_ai.operation.name"] == "execute_tool"
    assert attrs["gen_ai.tool.name"] == "write_file"
    assert attrs["gen_ai.tool.call.id"] == "call_1"
    assert attrs["toolledger.scope"] == "traced"
    assert attrs["toolledger.idempotency_key"] == "write_file:call_1"
    assert attrs["toolledger.execution_id"] == eid
    assert attrs["toolledger.attempt"] == 1
    assert attrs["toolledger.status"] == "succeeded"
    assert submit.attributes["gen_ai.tool.call.id"] == "call_1"
    # and the worker's JSON log line about it carries the same ids
    lines = [json.loads(x) for x in worker.log_text().splitlines() if x.startswith("{")]
    about = [x for x in lines if x.get("execution_id") == eid]
    assert about, worker.log_text()[-3000:]
    line = about[-1]
    assert line["trace_id"] == f"{ctx.trace_id:032x}"
    assert (line["scope"], line["idempotency_key"], line["attempt"]) == (
        "traced",
        "write_file:call_1",
        1,
    )
    assert (line["tool"], line["tool_call_id"]) == ("write_file", "call_1")
    assert '"x"' not in line["message"]  # no argument contents


def test_trace__an_execution_that_failed_ends_its_span_in_error(sqlite_url, tmp_path, spans):
    """A tool's failure is the span's (status ERROR): a trace UI showed it as fine (a cold
    review); a success stays unset."""
    from opentelemetry.trace import StatusCode

    from toolledger.builtin_tools import BUILTINS
    from toolledger.sandbox import Sandbox
    from toolledger.tools import Registry
    from toolledger.worker.pipeline import Executor, LeaseKeeper

    ledger = Ledger(sqlite_url)
    try:
        executor = Executor(
            ledger, Registry(list(BUILTINS)), Sandbox(tmp_path / "sb").prepare(), worker_id="w",
            lease_seconds=30, leases=LeaseKeeper(ledger, 30, 0.0),
        )  # fmt: skip
        ledger.submit("tr", "ok", "write_file", {"path": "a.txt", "content": "x"}, approved_by="a")
        ledger.submit("tr", "bad", "write_file", {"path": "d", "content": "x"}, approved_by="a")
        (tmp_path / "sb" / "tr" / "d").mkdir(parents=True)  # a folder there: the write fails
        assert executor.execute("tr", "write_file:ok", 1).status is Status.SUCCEEDED
        assert executor.execute("tr", "write_file:bad", 1).status is Status.FAILED
    finally:
        ledger.close()
    by_call = {
        s.attributes["toolledger.idempotency_key"]: s
        for s in spans.get_finished_spans()
        if s.name.startswith("execute_tool")
    }
    assert by_call["write_file:ok"].status.status_code is StatusCode.UNSET
    assert by_call["write_file:bad"].status.status_code is StatusCode.ERROR
    assert by_call["write_file:bad"].status.description == "finished: failed"


def test_trace__a_sweep_and_its_reconciliation_are_spans(sqlite_url, tmp_path, spans):
    from toolledger.recovery.sweep import sweep
    from toolledger.registry import load_registry
    from toolledger.sandbox import Sandbox

    ledger = Ledger(sqlite_url)
    ledger.submit("sw", "c1", "write_file", {"path": "a.txt", "content": "x"}, approved_by="a")
    claim = ledger.claim("sw", "write_file:c1", 1, worker_id="gone", lease_seconds=0.01)
    assert claim is not None
    time.sleep(0.05)
    settings = Settings.from_env({"TOOLLEDGER_SANDBOX": str(tmp_path / "sb")})
    summary = sweep(
        ledger,
        load_registry(""),
        Sandbox.configured(settings),
        grace_seconds=0,
        requeue_after=3600,
        publish=None,
    )
    ledger.close()
    assert summary.marked_unknown == 1
    finished = {s.name: s for s in spans.get_finished_spans()}
    assert finished["sweep"].attributes["toolledger.sweep.marked_unknown"] == 1
    rec = finished["reconcile write_file"]
    assert rec.parent is not None and rec.parent.span_id == finished["sweep"].context.span_id
    assert rec.attributes["toolledger.execution_id"] == claim.execution_id
    assert rec.attributes["toolledger.reconcile.outcome"] == "not_applied"


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_trace__configured_by_the_standard_variables_alone(
    pg_url, redis_server, redis_prefix, tmp_path, pool
):
    """No launcher: OTEL_TRACES_EXPORTER=console and OTEL_SERVICE_NAME set up each pool
    child's own provider after the fork (the console exporter writes to the worker's log);
    on the threads pool, the worker process's own, at its start (no child is forked)."""
    from toolledger.harness.processes import worker_process

    settings_env = {
        "db": pg_url,
        "broker": redis_server,
        "broker_prefix": redis_prefix,
        "sandbox": str(tmp_path / "sandbox"),
        "home": str(tmp_path / "home"),
        "metrics": "off",
    }
    otel = {
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_SERVICE_NAME": "tl-test-worker",
    }
    worker = worker_process(
        "w1", {**service_env(**settings_env), **otel}, tmp_path / "logs", concurrency=1, pool=pool
    )
    worker.start()
    try:
        worker.wait_ready(60)
        settings = Settings.from_env(
            {f"TOOLLEDGER_{k.upper()}": v for k, v in settings_env.items()}
        )
        sub = Submitter(settings)
        sub.submit(
            sub.prepare(f"env-{pool}", "c1", "write_file", {"path": "a", "content": "x"}),
            approved_by="alice",
        )
        wait_for(lambda: '"execute_tool write_file"' in worker.log_text(), 30, "a console span")
        sub.close()
    finally:
        stop_all([worker])
    log = worker.log_text()
    assert '"service.name": "tl-test-worker"' in log
    assert '"gen_ai.tool.call.id": "c1"' in log


def test_trace__a_recycled_pool_child_exports_its_spans_before_it_exits(tmp_path):
    """``--max-tasks-per-child 1``: each child runs one call and exits through ``os._exit``,
    which skips the SDK's exit hook; the spans its batch processor held (5 s by default) were
    lost, none of the three calls' ``execute_tool`` spans exported (a cold review). Flushed
    at ``worker_process_shutdown``, each is. The embedded ledger and broker: no services."""
    from toolledger.harness.processes import worker_process

    settings_env = {
        "sandbox": str(tmp_path / "sandbox"),
        "home": str(tmp_path / "home"),
        "metrics": "off",
    }
    otel = {"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "tl-test-recycled"}
    worker = worker_process(
        "w1",
        {**service_env(**settings_env), **otel},
        tmp_path / "logs",
        concurrency=1,
        extra=("--max-tasks-per-child", "1"),
    )
    worker.start()
    try:
        worker.wait_ready(60)
        settings = Settings.from_env(
            {f"TOOLLEDGER_{k.upper()}": v for k, v in settings_env.items()}
        )
        sub = Submitter(settings)
        for i in range(3):
            sub.submit(
                sub.prepare("recycled", f"c{i}", "write_file", {"path": f"{i}", "content": "x"}),
                approved_by="alice",
            )
        ledger = Ledger(settings.db)
        wait_for(
            lambda: (
                all(c.status == Status.SUCCEEDED for c in ledger.list_calls(limit=0))
                and len(ledger.list_calls(limit=0)) == 3
            ),
            60,
            "three calls succeeded",
        )
        # well within the batch processor's 5 s delay: only a flush at the child's exit
        # exports them (after the delay, the child is long gone)
        wait_for(
            lambda: worker.log_text().count('"name": "execute_tool write_file"') == 3,
            8,
            "three execute_tool spans",
        )
        sub.close()
        ledger.close()
    finally:
        stop_all([worker])


def test_logs__every_line_a_json_worker_writes_to_stderr_is_json(tmp_path):
    """``worker --log-format json`` run as root: Celery's warning about it came first on
    stderr as ``toolledger: warning: …``, not JSON (a cold review). The embedded ledger and
    broker: no services."""
    import os
    import signal
    import subprocess

    from toolledger.harness.processes import toolledger_argv

    env = service_env(home=str(tmp_path / "home"), sandbox=str(tmp_path / "sandbox"))
    env["TOOLLEDGER_METRICS"] = "off"
    err_path = tmp_path / "stderr"
    with err_path.open("wb") as err, (tmp_path / "stdout").open("wb") as out:
        proc = subprocess.Popen(
            [*toolledger_argv(), "worker", "--log-format", "json", "--pool", "threads",
             "--concurrency", "1", "--without-gossip", "--without-mingle"],
            env=env, stdout=out, stderr=err, start_new_session=True,
        )  # fmt: skip
        try:
            wait_for(lambda: " ready." in err_path.read_text(errors="replace"), 60, "ready")
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    lines = err_path.read_text(errors="replace").splitlines()
    assert lines
    parsed = [json.loads(line) for line in lines]  # each a JSON object
    if os.geteuid() == 0:  # Celery warns only then
        assert any("superuser privileges" in p["message"] for p in parsed), lines


def test_trace__console_spans_never_reach_stdout_a_commands_output(tmp_path):
    """``OTEL_TRACES_EXPORTER=console`` (documented): the SDK's console exporter wrote each
    span, pretty-printed over 40 lines, to stdout, after ``toolledger --json submit``'s own
    JSON (a reader of the output got two documents) and into ``mcp serve``'s JSON-RPC stream
    (its host read lines that are no message: a cold review of the README). Spans are
    diagnostics: one JSON line each on stderr, beside the warnings. The embedded default."""
    import subprocess

    from toolledger.harness.processes import toolledger_argv

    env = service_env(home=str(tmp_path / "home"), sandbox=str(tmp_path / "sandbox"))
    env.update({"TOOLLEDGER_METRICS": "off", "OTEL_TRACES_EXPORTER": "console"})
    args = '{"path": "a.txt", "content": "x"}'
    done = subprocess.run(
        [*toolledger_argv(), "--json", "submit", "--scope", "s", "--tool-call-id", "c1",
         "--tool", "write_file", "--args", args, "--approved-by", "alice"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tool_call_id"] == "c1"  # the output alone
    spans = [json.loads(line) for line in done.stderr.splitlines()]  # each line one object
    assert [s["name"] for s in spans] == ["submit_tool write_file"], done.stderr


@pytest.mark.parametrize("as_json", [False, True])
def test_trace__a_collector_down_costs_a_command_one_warning_line(
    tmp_path: Path, as_json: bool
) -> None:
    """A collector down (OTEL_EXPORTER_OTLP_ENDPOINT at a closed port): a one-shot command
    waited out the exporter's 10 s of retries after its work was done, then wrote four lines,
    the last "toolledger: error: Failed to export spans batch" under exit 0 (a cold review of
    the README). Its export is bounded (2 s), and what it says is one warning line."""
    import socket
    import subprocess

    from toolledger.harness.processes import toolledger_argv

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = service_env(home=str(tmp_path / "home"), sandbox=str(tmp_path / "sandbox"))
    env.update(
        {"TOOLLEDGER_METRICS": "off", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
    )
    args = '{"path": "a.txt", "content": "x"}'
    done = subprocess.run(
        [*toolledger_argv(), *(["--json"] if as_json else []), "submit", "--scope", "s",
         "--tool-call-id", "c1", "--tool", "write_file", "--args", args, "--approved-by", "al"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "spans not exported" in lines[0], done.stderr
    if as_json:
        assert set(json.loads(lines[0])) == {"warning", "logger"}
    else:
        assert lines[0].startswith("toolledger: warning: "), done.stderr


def test_trace__one_shot_commands_bound_their_export_long_running_ones_do_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from toolledger.cli import cli
    from toolledger.observability import tracing

    for name, one_shot in [("worker", False), ("serve", False), ("show", True), ("sweep", True)]:
        monkeypatch.setattr(tracing, "_one_shot", False)
        with cli.make_context("toolledger", ["--help"], resilient_parsing=True) as ctx:
            cli.resolve_command(ctx, [name])
        assert tracing._one_shot is one_shot, name
    monkeypatch.setattr(tracing, "_one_shot", True)
    assert tracing._export_timeout({}) == tracing.ONE_SHOT_EXPORT_SECONDS
    # the user's own bound wins (the exporter reads it)
    assert tracing._export_timeout({"OTEL_EXPORTER_OTLP_TIMEOUT": "30"}) is None
    assert tracing._export_timeout({"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "30"}) is None
    monkeypatch.setattr(tracing, "_one_shot", False)
    assert tracing._export_timeout({}) is None
