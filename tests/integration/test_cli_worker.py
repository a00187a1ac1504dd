"""CLI: tools, submit validation against the registry and sandbox, execute, read-only calls."""

from __future__ import annotations

import contextlib
import json
import textwrap
from typing import Any

import pytest

from tests.helpers import row_counts, run_cli
from toolledger.ledger.transitions import Status


@pytest.fixture
def run(db_url, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TOOLLEDGER_SANDBOX", str(tmp_path / "sandbox"))
    monkeypatch.setenv("TOOLLEDGER_BROKER", "redis://127.0.0.1:1/0")  # nobody listens

    def _run(*argv: str) -> tuple[int, str, str]:
        return run_cli(capsys, "--db", db_url, *argv)

    return _run


def submit(run, scope, cid, tool, args, *extra):
    return run(
        "submit",
        "--scope",
        scope,
        "--tool-call-id",
        cid,
        "--tool",
        tool,
        "--args",
        json.dumps(args),
        *extra,
    )


def test_tools__json_schemas_in_openai_and_anthropic_form(run):
    _, out, _ = run("tools", "--json")
    tools = {t["name"]: t for t in json.loads(out)["tools"]}
    assert {"write_file", "append_file", "read_file"} <= set(tools)
    w = tools["write_file"]
    assert (w["idempotent"], w["reconcilable"], w["read_only"]) == (True, True, False)
    assert (tools["append_file"]["idempotent"], tools["append_file"]["reconcilable"]) == (
        False,
        False,
    )
    assert tools["read_file"]["read_only"] is True
    schema = w["openai"]["function"]["parameters"]
    assert w["openai"]["type"] == "function" and w["openai"]["function"]["name"] == "write_file"
    assert w["anthropic"]["input_schema"] == schema
    assert schema["type"] == "object" and set(schema["required"]) == {"path", "content"}
    assert schema["additionalProperties"] is False


def test_tools__format_openai_is_a_list_to_pass_as_tools(run):
    code, out, _ = run("tools", "--format", "openai")
    listed = json.loads(out)
    assert code == 0 and all(t["type"] == "function" for t in listed)


BAD = [
    ("unknown-tool", "format_disk", {"path": "a"}, 4, "unknown tool"),
    ("missing-field", "write_file", {"path": "a"}, 6, "content: Field required"),
    ("extra-field", "write_file", {"path": "a", "content": "x", "mode": 7}, 6, "mode: Extra"),
    ("wrong-type", "write_file", {"path": "a", "content": 7}, 6, "content: Input should be"),
    ("path-escape", "write_file", {"path": "../../etc/x", "content": "x"}, 6, "'..'"),
    ("absolute", "append_file", {"path": "/etc/passwd", "content": "x"}, 6, "absolute"),
]


@pytest.mark.parametrize(("name", "tool", "args", "code", "message"), BAD, ids=[b[0] for b in BAD])
def test_submit__validated_against_tool_and_sandbox(
    run, ledger, scope, name, tool, args, code, message
):
    before = row_counts(ledger.engine)
    got, out, err = submit(run, scope, "c1", tool, args, "--approved-by", "alice")
    assert got == code, err
    assert message in err and out == ""
    assert row_counts(ledger.engine) == before


def test_submit__read_only_needs_no_approval_and_leaves_no_claim(run, ledger, scope, tmp_path):
    (tmp_path / "sandbox" / scope).mkdir(parents=True)
    (tmp_path / "sandbox" / scope / "notes.txt").write_text("hello")
    before = row_counts(ledger.engine)
    code, out, _ = submit(run, scope, "r1", "read_file", {"path": "notes.txt"}, "--json")
    result = json.loads(out)
    assert code == 0 and result["recorded"] is False
    assert result["result"]["content"] == "hello"
    assert row_counts(ledger.engine) == before


def test_submit__approved_with_broker_down_is_recorded_and_says_so(run, ledger, scope):
    code, out, _ = submit(
        run,
        scope,
        "c1",
        "write_file",
        {"path": "a", "content": "x"},
        "--approved-by",
        "alice",
        "--json",
    )
    data = json.loads(out)
    assert code == 0 and data["status"] == "approved"
    assert data["enqueued"] is False and data["enqueue_error"]
    assert ledger.get(scope, "c1").operation.enqueued_at is None


def test_submit__recorded_when_its_outbox_stamp_cannot_be_cleared_exits_0(
    run, ledger, scope, monkeypatch, caplog
):
    """The broker down and the ledger failing the clearing of the stamp (a full disk under
    both, the embedded default): the call was recorded, approved, yet ``submit`` exited 1,
    "database error", no answer on stdout. The stamp left only delays the sweep's
    re-publication."""
    import sqlalchemy as sa

    from toolledger.ledger.ledger import Ledger

    def full(*_args: Any) -> None:
        raise sa.exc.OperationalError("UPDATE", {}, Exception("database or disk is full"))

    monkeypatch.setattr(Ledger, "clear_enqueued", full)
    code, out, err = submit(
        run, scope, "c1", "write_file", {"path": "a", "content": "x"}, "--approved-by", "al",
        "--json",
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(out)
    assert data["status"] == "approved" and data["enqueued"] is False
    said = [r.getMessage() for r in caplog.records if r.name == "toolledger.submit"]
    assert any("outbox stamp" in m and "disk is full" in m for m in said), said
    assert ledger.get(scope, "c1").operation.status is Status.APPROVED


def test_submit__under_json_its_warnings_are_json_lines_too(db_url, tmp_path, scope):
    """Under ``--json`` every line a command writes to stderr is a JSON object, its warnings
    included (a failed enqueue the outbox retries): it was a plain line among them, which a
    script reading stderr as JSON lines failed on."""
    import os
    import subprocess

    from toolledger.harness.processes import toolledger_argv

    env = {**os.environ, "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0",
           "TOOLLEDGER_SANDBOX": str(tmp_path / "sandbox")}  # fmt: skip
    args = json.dumps({"path": "a", "content": "x"})
    argv = ["--json", "--db", db_url, "submit", "--scope", scope, "--tool-call-id", "j1"]
    proc = subprocess.run(
        [*toolledger_argv(), *argv, "--tool", "write_file", "--args", args, "--approved-by", "al"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["enqueued"] is False
    lines = [json.loads(line) for line in proc.stderr.splitlines()]
    assert any("enqueue of" in w.get("warning", "") for w in lines), proc.stderr


def test_execute__runs_an_approved_call_in_process(run, scope, tmp_path):
    submit(
        run,
        scope,
        "c1",
        "write_file",
        {"path": "d/report.txt", "content": "done"},
        "--approved-by",
        "alice",
    )
    code, out, _ = run("execute", "--scope", scope, "--tool-call-id", "c1", "--json")
    shown = json.loads(out)
    assert code == 0 and shown["status"] == "succeeded" and shown["outcome"] == "finished"
    assert (tmp_path / "sandbox" / scope / "d/report.txt").read_text() == "done"
    assert shown["receipt"]["bytes_written"] == 4
    code, _, err = run("execute", "--scope", scope, "--tool-call-id", "c1")
    assert code == 5 and "succeeded" in err


def test_execute__a_sandbox_of_a_later_format_is_refused_before_anything(
    run, ledger, scope, tmp_path
):
    """Only workers and the beat looked at the sandbox's format: ``execute`` (and a client's
    read-only call, which lands what is pending on its path) landed in a sandbox a later
    version had marked (a deployment review). Refused now, exit 2, nothing claimed or read."""
    state = tmp_path / "sandbox" / ".toolledger"
    state.mkdir(parents=True)
    (state / "format").write_text("3\n")
    (tmp_path / "sandbox" / scope).mkdir()
    (tmp_path / "sandbox" / scope / "notes.txt").write_text("hello")
    args = {"path": "report.txt", "content": "done"}
    assert submit(run, scope, "c1", "write_file", args, "--approved-by", "al")[0] == 0
    before = row_counts(ledger.engine)
    code, out, err = run("execute", "--scope", scope, "--tool-call-id", "c1")
    assert code == 2 and out == "" and "is at format 3, of a later toolledger" in err, err
    assert len(err.strip().splitlines()) == 1
    code, out, err = submit(run, scope, "r1", "read_file", {"path": "notes.txt"})
    assert code == 2 and out == "" and "is at format 3, of a later toolledger" in err, err
    assert row_counts(ledger.engine) == before
    assert (
        json.loads(run("show", "--scope", scope, "--tool-call-id", "c1", "--json")[1])["status"]
        == "approved"
    )
    assert not (tmp_path / "sandbox" / scope / "report.txt").exists()


@pytest.mark.parametrize("state", ["unrecorded", "unsure"])
def test_execute__a_call_whose_end_is_not_on_record_exits_1(run, scope, monkeypatch, state):
    """``execute`` of a call whose outcome the ledger could not take (spooled for the sweep)
    or whose claim could not be learned printed "unrecorded: …" and exited 0, which a script
    read as the call having ended (a cold review): exit 1, one line on stderr."""
    from toolledger.worker.pipeline import Outcome
    from toolledger.worker.runtime import Runtime

    class Unrecorded:
        def execute(self, *_: Any) -> Outcome:
            return Outcome(state, "e-1")

    monkeypatch.setattr(Runtime, "executor", lambda self, worker_id: Unrecorded())
    submit(run, scope, "c1", "write_file", {"path": "x", "content": "x"}, "--approved-by", "al")
    code, out, err = run("execute", "--scope", scope, "--tool-call-id", "c1", "--json")
    assert code == 1 and json.loads(out)["outcome"] == state
    (line,) = err.strip().splitlines()
    assert json.loads(line)["exit_code"] == 1 and "sweep" in json.loads(line)["error"]


def test_execute__an_outcome_kept_nowhere_is_not_said_kept_on_disk(run, scope, monkeypatch):
    """helper-90: ``execute`` said "kept on disk" of an outcome a full disk did not take."""
    from toolledger.worker.pipeline import Outcome
    from toolledger.worker.runtime import Runtime

    class Unkept:
        def execute(self, *_: Any) -> Outcome:
            return Outcome("unrecorded", "e-1", kept=False)

    monkeypatch.setattr(Runtime, "executor", lambda self, worker_id: Unkept())
    submit(run, scope, "c1", "write_file", {"path": "x", "content": "x"}, "--approved-by", "al")
    code, _, err = run("execute", "--scope", scope, "--tool-call-id", "c1")
    assert code == 1 and "kept on disk" not in err and "it is lost" in err, err


def test_execute__pending_call_is_refused(run, scope):
    submit(run, scope, "c1", "write_file", {"path": "a", "content": "x"})
    code, _, err = run("execute", "--scope", scope, "--tool-call-id", "c1")
    assert code == 5 and "pending_approval" in err


def test_tools__user_module_from_env(run, tmp_path, monkeypatch):
    module = tmp_path / "mytools_for_test.py"
    module.write_text(
        textwrap.dedent('''
        from pydantic import BaseModel
        from toolledger.tools import tool

        class Args(BaseModel):
            to: str

        @tool(idempotent=False)
        def send_greeting(args: Args, ctx) -> dict:
            """Send a greeting."""
            return {"sent_to": args.to}

        @tool(idempotent=False)
        def say_nothing(args: Args, ctx) -> dict:
            return {}
    ''')
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TOOLLEDGER_TOOLS", "mytools_for_test")
    _, out, _ = run("tools", "--json")
    names = [t["name"] for t in json.loads(out)["tools"]]
    assert "send_greeting" in names
    # a tool without a docstring is listed too (it was "internal error: IndexError", exit 1)
    code, out, err = run("tools")
    assert code == 0 and "say_nothing" in out and "Send a greeting." in out, err


def test_submit__a_broker_that_never_answers_fails_the_publish_in_bounded_time(
    run, ledger, scope, monkeypatch
):
    """A Redis that accepts connections and never answers (frozen, partitioned) held every
    publish for ever: kombu's sockets wait without a timeout, and ``serve`` hung with all its
    threads in publishes (a cold review). The publish fails now, the call recorded for the
    sweep to publish."""
    import socket
    import threading

    held: list[socket.socket] = []
    hole = socket.create_server(("127.0.0.1", 0))
    port = hole.getsockname()[1]

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(hole.accept()[0])  # never read, never answered

    threading.Thread(target=accept, daemon=True).start()
    monkeypatch.setenv("TOOLLEDGER_BROKER", f"redis://127.0.0.1:{port}/0")
    monkeypatch.setattr("toolledger.worker.app.BROKER_SOCKET_TIMEOUT", 0.5)
    out: list[tuple[int, str, str]] = []
    args = {"path": "a", "content": "x"}
    submitting = threading.Thread(
        target=lambda: out.append(
            submit(run, scope, "c1", "write_file", args, "--approved-by", "al", "--json")
        ),
        daemon=True,
    )
    try:
        submitting.start()
        submitting.join(120)
        assert not submitting.is_alive(), "the publish waited for a broker that never answers"
        code, stdout, _ = out[0]
        data = json.loads(stdout)
        assert code == 0 and data["status"] == "approved" and data["enqueued"] is False
        assert ledger.get(scope, "c1").operation.enqueued_at is None  # the sweep publishes it
    finally:
        hole.close()
        for conn in held:
            conn.close()


def test_submit__an_approval_for_a_call_already_waiting_is_said_not_applied(run, ledger, scope):
    """The same call again with an approver answered "existing", pending, and nothing else:
    the approval silently dropped (a cold review, through the API). It says so now."""
    args = {"path": "a", "content": "x"}
    code, _, _ = submit(run, scope, "c1", "write_file", args)
    assert code == 0
    code, out, _ = submit(run, scope, "c1", "write_file", args, "--approved-by", "al", "--json")
    data = json.loads(out)
    assert code == 0 and (data["outcome"], data["status"]) == ("existing", "pending_approval")
    assert "was not applied" in data["warning"]
    code, out, err = submit(run, scope, "c1", "write_file", args, "--approved-by", "al")
    assert "toolledger: warning: the call already exists, waiting for approval" in err
    assert "warning" not in out  # on stderr only (it was on stdout: a cold review)
    assert ledger.get(scope, "c1").operation.status is Status.PENDING_APPROVAL
    # rejected: the approval is not applied either, and is said so (it was silent)
    assert run("reject", "--scope", scope, "--tool-call-id", "c1", "--by", "bob")[0] == 0
    code, out, _ = submit(run, scope, "c1", "write_file", args, "--approved-by", "al", "--json")
    data = json.loads(out)
    assert code == 0 and (data["outcome"], data["status"]) == ("existing", "rejected")
    assert data["warning"].startswith("the call already exists, and it was rejected: ")
    assert "this submit's approval by 'al' was not applied" in data["warning"]
    # a new id linked to the rejected key: no call existed; the key's action was rejected
    code, out, _ = submit(run, scope, "c9", "write_file", args, "--key", "write_file:c1",
                          "--approved-by", "al", "--json")  # fmt: skip
    data = json.loads(out)
    assert code == 0 and (data["outcome"], data["status"]) == ("linked", "rejected")
    assert data["warning"].startswith("its key 'write_file:c1' names an action recorded before")
    code, out, _ = submit(run, scope, "c1", "write_file", args)  # no approver: nothing to say
    assert code == 0 and "warning" not in out
