"""The CLI contract (DESIGN §9): JSON fields, exit codes, one-line errors, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.helpers import row_counts, run_cli
from toolledger.ledger.errors import InputError
from toolledger.ledger.ledger import Ledger

ARGS = '{"path": "a.txt", "content": "done"}'


@pytest.fixture
def run(db_url, capsys):
    def _run(*argv: str) -> tuple[int, str, str]:
        return run_cli(capsys, "--db", db_url, *argv)

    return _run


def submit(run, scope, cid="c1", args=ARGS, *extra):
    return run(
        "submit",
        "--scope",
        scope,
        "--tool-call-id",
        cid,
        "--tool",
        "write_file",
        "--args",
        args,
        *extra,
    )


BAD_INPUT = [
    ("malformed-json", ["--args", '{"path": '], "not valid JSON"),
    ("nan", ["--args", '{"x": NaN}'], "NaN is not allowed"),
    ("non-object", ["--args", "[1, 2]"], "must be a JSON object"),
    ("string", ["--args", '"hello"'], "must be a JSON object"),
    ("oversized", ["--args", json.dumps({"content": "x" * 200})], "over the cap"),
    ("bad-tool-name", ["--args", ARGS, "--tool", "rm -rf"], "tool name"),
    ("empty-key", ["--args", ARGS, "--key", ""], "must not be empty"),
]


@pytest.mark.parametrize(("name", "argv", "message"), BAD_INPUT, ids=[b[0] for b in BAD_INPUT])
def test_cli__bad_input_refused_exit_6_nothing_written(
    run, ledger, scope, monkeypatch, name, argv, message
):
    monkeypatch.setenv("TOOLLEDGER_MAX_ARGS_BYTES", "100")
    before = row_counts(ledger.engine)
    base = ["submit", "--scope", scope, "--tool-call-id", "c1"]
    tool = [] if "--tool" in argv else ["--tool", "write_file"]  # an option is given once
    code, out, err = run(*base, *tool, *argv)
    assert code == 6, err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert out == ""
    assert row_counts(ledger.engine) == before


def test_cli__a_reason_without_an_approver_is_refused_not_dropped(run, ledger, scope):
    """--reason says why a call was approved: without --approved-by it was dropped in
    silence, the call recorded pending as if no reason had been given."""
    before = row_counts(ledger.engine)
    code, out, err = submit(run, scope, "c1", ARGS, "--reason", "looked fine")
    assert code == 2 and "--approved-by" in err and out == ""
    assert row_counts(ledger.engine) == before
    with pytest.raises(InputError, match="approved_by"):  # the Python API and the HTTP API
        ledger.submit(scope, "c1", "write_file", json.loads(ARGS), reason="looked fine")
    assert row_counts(ledger.engine) == before
    code, out, _ = submit(
        run, scope, "c1", ARGS, "--reason", "ok", "--approved-by", "ann", "--json"
    )
    assert code == 0 and json.loads(out)["status"] == "approved"


@pytest.mark.parametrize("bad_scope", ["../x", "a/b", "..", "", "x" * 200, "a b"])
def test_cli__unsafe_scope_refused_everywhere(run, ledger, bad_scope):
    before = row_counts(ledger.engine)
    for argv in (
        [
            "submit",
            "--scope",
            bad_scope,
            "--tool-call-id",
            "c",
            "--tool",
            "write_file",
            "--args",
            ARGS,
        ],
        ["show", "--scope", bad_scope, "--tool-call-id", "c"],
        ["approve", "--scope", bad_scope, "--tool-call-id", "c", "--by", "x"],
        ["list", "--scope", bad_scope],
    ):
        code, _, err = run(*argv)
        assert code == 6, (argv, err)
        assert "scope" in err
    assert row_counts(ledger.engine) == before


def test_cli__unknown_status_refused(run):
    """A status no call can have is a bad option's value, exit 2 (DESIGN §9: usage), as
    ``resolve --as bogus`` and ``repair --format bogus`` are: it was exit 6, "input refused",
    which says a call's input was (a cold review)."""
    code, _, err = run("list", "--status", "done")
    assert code == 2 and "unknown status 'done'" in err
    code, out, err = run("list", "--status", "")
    assert (code, out) == (2, "") and "unknown status ''" in err
    code, out, err = run("list", "--status", "done", "--json")
    assert (code, out) == (2, "") and json.loads(err)["exit_code"] == 2


def test_cli__version_under_json_is_json(capsys):
    """``toolledger --version --json`` printed ``toolledger, version 0.1.0``: ``--json`` is
    machine output on every command (DESIGN §9), and a script's ``json.loads`` failed on it
    (a cold review). Without ``--json`` it is the line it was."""
    from importlib.metadata import version

    for argv in (("--version", "--json"), ("--json", "--version")):
        code, out, err = run_cli(capsys, *argv)
        assert (code, err) == (0, ""), argv
        assert json.loads(out) == {"version": version("toolledger")}, argv
    assert run_cli(capsys, "--version") == (0, f"toolledger, version {version('toolledger')}\n", "")


def test_cli__repair_of_a_missing_transcript_is_not_found(run, tmp_path):
    """``repair`` of a file that is not there is exit 4 (DESIGN §9: not found), as a call or a
    ledger that is not there is: it was click's usage error, exit 2 (a cold review)."""
    missing = tmp_path / "nope.jsonl"
    code, out, err = run("repair", str(missing))
    assert (code, out) == (4, "") and err.count("\n") == 1, err
    assert str(missing) in err and "Traceback" not in err
    code, _, err = run("repair", str(missing), "--json")
    assert json.loads(err)["exit_code"] == 4
    assert not missing.exists()


def test_cli__json_errors_are_one_json_object(run, scope):
    code, out, err = run("show", "--scope", scope, "--tool-call-id", "nope", "--json")
    assert code == 4 and out == ""
    assert json.loads(err) == {"error": f"no call 'nope' in scope '{scope}'", "exit_code": 4}


def test_cli__usage_error_exit_2(run, scope):
    code, _, err = run("submit", "--scope", scope)
    assert code == 2 and "Missing option" in err and err.count("\n") == 1


def test_cli__conflict_exit_3_names_both_hashes(run, ledger, scope):
    assert submit(run, scope)[0] == 0
    before = row_counts(ledger.engine)
    code, _, err = submit(run, scope, "c1", '{"path": "a.txt", "content": "other"}', "--json")
    assert code == 3
    error = json.loads(err)["error"]
    view = ledger.get(scope, "c1")
    assert view.operation.args_sha256 in error
    assert row_counts(ledger.engine) == before


def test_cli__state_does_not_allow_exit_5(run, scope):
    submit(run, scope, "c1", ARGS, "--approved-by", "alice")
    code, _, err = run("approve", "--scope", scope, "--tool-call-id", "c1", "--by", "bob")
    assert code == 5 and "approved to approved" in err


def test_cli__submit_show_events_list_json_contract(run, scope):
    code, out, _ = submit(run, scope, "c1", ARGS, "--json")
    assert code == 0
    submitted = json.loads(out)
    assert submitted["status"] == "pending_approval" and submitted["outcome"] == "created"
    assert run("approve", "--scope", scope, "--tool-call-id", "c1", "--by", "bob", "--json")[0] == 0

    code, out, _ = run("show", "--scope", scope, "--tool-call-id", "c1", "--json")
    shown = json.loads(out)
    for field in (
        "scope",
        "tool_call_id",
        "tool",
        "idempotency_key",
        "args_sha256",
        "status",
        "executions",
        "receipt",
    ):
        assert field in shown
    assert (shown["status"], shown["idempotency_key"], shown["receipt"]) == (
        "approved",
        "write_file:c1",
        None,
    )
    assert shown["args_sha256"] == submitted["args_sha256"]

    code, out, _ = run("events", "--scope", scope, "--tool-call-id", "c1", "--json")
    kinds = [e["kind"] for e in json.loads(out)["events"]]
    assert kinds == ["submitted", "pending_approval", "approved"]

    code, out, _ = run("--json", "list", "--scope", scope, "--status", "approved")
    listed = json.loads(out)
    assert listed["count"] == 1 and listed["calls"][0]["tool_call_id"] == "c1"


def test_cli__show_json_executions_carry_the_contract_fields(run, ledger, scope):
    submit(run, scope, "c1", ARGS, "--approved-by", "alice")
    claim = ledger.claim(scope, "write_file:c1", 1, worker_id="w")
    from toolledger.ledger.transitions import Status

    ledger.finish(claim.execution_id, claim.lease_token, Status.SUCCEEDED, {"bytes_written": 4})
    shown = json.loads(run("show", "--scope", scope, "--tool-call-id", "c1", "--json")[1])
    (ex,) = shown["executions"]
    assert {k: ex[k] for k in ("execution_id", "attempt", "status", "result", "reconciled")} == {
        "execution_id": claim.execution_id,
        "attempt": 1,
        "status": "succeeded",
        "result": {"bytes_written": 4},
        "reconciled": False,
    }
    assert "lease_token" not in ex
    assert shown["receipt"] == {"bytes_written": 4}


def test_cli__real_entry_point_never_prints_a_traceback(tmp_path: Path):
    exe = Path(sys.executable).with_name("toolledger")
    env = {"PATH": "/usr/bin:/bin", "TOOLLEDGER_HOME": str(tmp_path / "home")}
    bad = subprocess.run(
        [
            str(exe),
            "submit",
            "--scope",
            "s",
            "--tool-call-id",
            "c",
            "--tool",
            "write_file",
            "--args",
            "{oops",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert bad.returncode == 6
    assert bad.stderr.startswith("toolledger: error:") and "Traceback" not in bad.stderr
    assert not (tmp_path / "home").exists()  # refused input created nothing at all
    ok = subprocess.run([str(exe), "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert ok.returncode == 0 and "submit" in ok.stdout


def test_cli__under_json_every_warning_is_a_json_line(tmp_path: Path):
    """A misspelt setting was a plain line under --json, and a Python warning (SQLAlchemy's,
    about a URL option it ignores) two plain lines quoting source code (a cold review)."""
    exe = Path(sys.executable).with_name("toolledger")
    env = {"PATH": "/usr/bin:/bin", "TOOLLEDGER_LEASE_SECOND": "3"}
    db = f"sqlite:///{tmp_path / 'ledger.db'}?mode=ro"
    proc = subprocess.run(
        [str(exe), "--json", "--db", db, "submit", "--scope", "s", "--tool-call-id", "c",
         "--tool", "write_file", "--args", ARGS],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stderr.splitlines()]  # each line JSON
    loggers = {d["logger"] for d in lines if "warning" in d}
    assert {"toolledger.config", "py.warnings"} <= loggers, lines
    told = next(d["warning"] for d in lines if d.get("logger") == "toolledger.config")
    assert "TOOLLEDGER_LEASE_SECONDS" in told
    plain = subprocess.run(
        [str(exe), "--db", db, "show", "--scope", "s", "--tool-call-id", "c"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert "toolledger: warning: TOOLLEDGER_LEASE_SECOND is not a setting" in plain.stderr
    # without --json, Python's warning too is one line of its own, not two quoting source
    said = plain.stderr.splitlines()
    assert any("'mode' are not accepted" in line for line in said), said
    assert all(line.startswith("toolledger: warning: ") for line in said), said


def test_cli__text_warnings_are_one_line_on_stderr_once_never_on_stdout(tmp_path: Path):
    """An enqueue that failed was said on stdout and again on stderr (a bare log line), a
    sweep's failed requeue too, and an approval not applied on stdout alone (a cold review)."""
    import toolledger

    code = str(Path(toolledger.__file__).resolve().parents[1])  # this tree's, not an install's
    env = {"PATH": "/usr/bin:/bin", "TOOLLEDGER_HOME": str(tmp_path / "home"),
           "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/11", "PYTHONPATH": code}  # fmt: skip

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "toolledger", *argv],
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60,
        )  # fmt: skip

    call = ("--scope", "s", "--tool", "write_file", "--args", ARGS)
    sent = cli("submit", "--tool-call-id", "c1", *call, "--approved-by", "al")
    assert sent.returncode == 0 and "warning" not in sent.stdout, sent
    said = sent.stderr.splitlines()
    assert len(said) == 1 and said[0].startswith("toolledger: warning: enqueue of "), said
    assert cli("submit", "--tool-call-id", "c2", *call).returncode == 0
    again = cli("submit", "--tool-call-id", "c2", *call, "--approved-by", "zed")
    assert again.returncode == 0 and "warning" not in again.stdout, again
    assert again.stderr.startswith("toolledger: warning: the call already exists")
    assert again.stderr.count("\n") == 1, again.stderr
    swept = cli("sweep", "--requeue-after", "0")
    assert swept.returncode == 1 and "warning" not in swept.stdout, swept
    said = swept.stderr.splitlines()
    assert len(said) == 1 and said[0].startswith("toolledger: warning: requeue of "), said


def test_cli__a_closed_stdout_is_refused_before_anything_is_done(tmp_path: Path):
    """Started with stdout closed (``>&-``), a command ran and wrote its answer to stderr,
    exit 0: ``submit`` recorded the call and ``--json list`` put 18 lines of JSON where a
    script reads the one line of an error (a cold review). Refused, exit 2, one line,
    nothing recorded; stdout sent to /dev/null drops the answer as ever."""
    import os

    import toolledger

    code = str(Path(toolledger.__file__).resolve().parents[1])  # this tree's, not an install's
    env = {"PATH": "/usr/bin:/bin", "TOOLLEDGER_HOME": str(tmp_path / "home"), "PYTHONPATH": code}

    def cli(*argv: str, closed: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "toolledger", *argv], stdin=subprocess.DEVNULL,
            stdout=None if closed else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=env, cwd=tmp_path, timeout=60, preexec_fn=(lambda: os.close(1)) if closed else None,
        )  # fmt: skip

    call = ("--scope", "s", "--tool-call-id", "c1", "--tool", "write_file", "--args", ARGS)
    for argv in (("submit", *call), ("--json", "submit", *call), ("list",)):
        done = cli(*argv)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, (argv, done.stderr)
        assert "stdout" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "home").exists()  # nothing recorded, no ledger made
    assert cli("submit", *call, closed=False).returncode == 0
    assert cli("show", "--scope", "s", "--tool-call-id", "c1", closed=False).returncode == 0


def test_cli__an_embedded_broker_held_locked_bounds_the_enqueue(tmp_path: Path):
    """A process holding the embedded broker's write lock (a worker or a ``submit`` stopped
    with Ctrl-Z mid-publish) held ``submit --approved-by`` 61 s with the ledger's wait at
    7.5 s: the broker's SQLite busy timeout was 30 s, fixed, for each of the publish's tries
    (a cold review). The publish now waits as the ledger does, ``TOOLLEDGER_DB_TIMEOUT``:
    the call is recorded, the failed enqueue said, and the sweep re-publishes it."""
    import sqlite3
    import time

    import toolledger

    code = str(Path(toolledger.__file__).resolve().parents[1])  # this tree's, not an install's
    env = {"PATH": "/usr/bin:/bin", "TOOLLEDGER_HOME": str(tmp_path / "home"),
           "TOOLLEDGER_DB_TIMEOUT": "1", "PYTHONPATH": code}  # fmt: skip

    def submit(call_id: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "toolledger", "--json", "submit", "--scope", "s",
             "--tool-call-id", call_id, "--tool", "write_file", "--args", ARGS,
             "--approved-by", "al"],
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=20,
        )  # fmt: skip

    assert submit("c1").returncode == 0  # the broker's file made
    holder = sqlite3.connect(tmp_path / "home" / "broker.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # its write lock, held as a frozen process would
    try:
        started = time.monotonic()
        held = submit("c2")
        took = time.monotonic() - started
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert held.returncode == 0, held.stderr
    out = json.loads(held.stdout)
    assert (out["status"], out["enqueued"]) == ("approved", False), out
    error = out["enqueue_error"]
    assert error.endswith("database is locked") and "\n" not in error, error
    # said once, the driver's words: not SQLAlchemy's statement, its base64 message body
    # and its link (1.3 kB on one line, and four lines in the JSON field: a cold review)
    said = [json.loads(line)["warning"] for line in held.stderr.splitlines()]
    assert len(said) == 1 and said[0].endswith("database is locked"), said
    assert took < 12, took  # 1 s a try, and the process's start
    holder = sqlite3.connect(tmp_path / "home" / "broker.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # and the sweep's re-publish of c2: one short line too
    try:
        swept = subprocess.run(
            [sys.executable, "-m", "toolledger", "--json", "sweep", "--requeue-after", "0"],
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=20,
        )  # fmt: skip
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    errors = json.loads(swept.stdout)["errors"]
    assert swept.returncode == 1 and len(errors) == 1, swept
    assert errors[0].endswith("database is locked") and "\n" not in errors[0], errors
    after = submit("c3")  # the lock let go: published as ever
    assert after.returncode == 0 and json.loads(after.stdout)["enqueued"] is True, after.stderr


def test_cli__ctrl_c_is_one_line_aborted_while_it_loads_and_while_it_runs(tmp_path: Path):
    """A Ctrl-C while a command ran printed an empty line before its JSON error (click's
    Abort), and one while the script imported the command line a traceback (a cold review)."""
    import signal
    import time

    exe = Path(sys.executable).with_name("toolledger")
    env = {"PATH": "/usr/bin:/bin"}
    submit = [str(exe), "submit", "--scope", "s", "--tool-call-id", "c", "--tool", "write_file",
              "--args", ARGS]  # fmt: skip
    assert subprocess.run(submit, env=env, cwd=tmp_path, timeout=60).returncode == 0
    wait = subprocess.Popen(
        [str(exe), "--json", "wait", "--scope", "s", "--tool-call-id", "c", "--timeout", "60"],
        env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(2.0)  # waiting (pending approval: no receipt comes)
    wait.send_signal(signal.SIGINT)
    _, err = wait.communicate(timeout=30)
    assert wait.returncode == 130 and err == '{"error": "aborted", "exit_code": 130}\n', err
    interrupted_import = (
        "import sys\n"
        "class Stop:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'toolledger.cli':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Stop())\n"
        "from toolledger.entry import main\n"
        "main()\n"
    )
    loading = subprocess.run(
        [sys.executable, "-c", interrupted_import, "list"],
        capture_output=True, text=True, cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert (loading.returncode, loading.stderr) == (130, "toolledger: error: aborted\n")


@pytest.mark.parametrize("where", ["parsing", "closing"])
def test_cli__ctrl_c_while_the_line_is_parsed_or_the_ledger_closed_is_one_line(
    capsys, monkeypatch, tmp_path, where
):
    """A Ctrl-C while click parsed the global options, or while the command closed its
    ledger, came out of click's own handler: an empty line, then ``aborted`` (seen with a
    real SIGINT 0.09-0.12 s into ``show``: ``\\ntoolledger: error: aborted``; a cold
    review). One line, as anywhere else."""
    import click.core

    from toolledger.cli.common import Context

    def interrupted(*_args: object, **_kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setenv("TOOLLEDGER_HOME", str(tmp_path / "home"))
    if where == "parsing":
        monkeypatch.setattr(click.core, "iter_params_for_processing", interrupted)
    else:
        monkeypatch.setattr(Context, "close", interrupted)
    for json_flag, said in (((), "toolledger: error: aborted\n"),
                            (("--json",), '{"error": "aborted", "exit_code": 130}\n')):  # fmt: skip
        code, _, err = run_cli(capsys, *json_flag, "tools")  # (closing: its answer printed)
        assert (code, err) == (130, said), where


def test_cli__embedded_default_creates_its_ledger_on_first_use(tmp_path: Path):
    exe = Path(sys.executable).with_name("toolledger")
    env = {"PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [
            str(exe),
            "submit",
            "--scope",
            "s",
            "--tool-call-id",
            "c",
            "--tool",
            "write_file",
            "--args",
            ARGS,
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / ".toolledger" / "ledger.db").exists()
    led = Ledger(f"sqlite:///{tmp_path / '.toolledger' / 'ledger.db'}")
    assert led.get("s", "c").operation.status.value == "pending_approval"
    led.close()


def test_cli__list_gives_every_row_unless_limited_and_says_when_rows_were_left(run, scope):
    """DESIGN §9's list has no limit: it silently stopped at 1,000 rows (a script draining
    the unknown inbox never saw the newest). --limit is an extension, and says what it left."""
    for i in range(3):
        assert (
            submit(run, scope, f"l{i}", json.dumps({"path": f"l{i}.txt", "content": "x"}))[0] == 0
        )
    code, out, _ = run("--json", "list", "--scope", scope)
    listed = json.loads(out)
    assert code == 0 and (listed["count"], listed["more"]) == (3, False)
    code, out, err = run("--json", "list", "--scope", scope, "--limit", "2")
    listed = json.loads(out)
    assert (listed["count"], listed["more"]) == (2, True)
    assert json.loads(err) == {"warning": "more than 2 calls; these are the oldest 2"}
    code, out, err = run("list", "--scope", scope, "--limit", "2")  # text: a text warning
    assert code == 0 and err == "toolledger: warning: more than 2 calls; these are the oldest 2\n"
    assert [c["tool_call_id"] for c in listed["calls"]] == ["l0", "l1"]  # oldest first
    code, out, _ = run("--json", "list", "--scope", scope, "--limit", "3")
    assert json.loads(out)["more"] is False


def test_cli__sweep_exits_1_when_its_pass_reported_errors(db_url, capsys, scope, tmp_path):
    """A broker out of reach: the approved call cannot be re-published. The summary lists
    it, and the exit code says the pass failed (a cron job reads only that)."""
    base = ("--db", db_url, "--sandbox", str(tmp_path / "sandbox"))
    args = {"path": "s.txt", "content": "x"}
    code, _, err = run_cli(
        capsys, *base, "--broker", "redis://127.0.0.1:1/11", "submit", "--scope", scope,
        "--tool-call-id", "s1", "--tool", "write_file", "--args", json.dumps(args),
        "--approved-by", "al",
    )  # fmt: skip
    assert code == 0, err  # recorded; its enqueue failed, and the sweep is the outbox
    code, out, _ = run_cli(
        capsys, *base, "--broker", "redis://127.0.0.1:1/11", "--json", "sweep",
        "--requeue-after", "0",
    )  # fmt: skip
    summary = json.loads(out)
    assert code == 1 and summary["requeued"] == 0
    assert any(e.startswith("requeue of ") for e in summary["errors"])  # the first it tried
    code, out, _ = run_cli(capsys, *base, "--json", "sweep", "--no-requeue")
    assert code == 0 and json.loads(out)["errors"] == []


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_cli__seconds_must_be_finite(run, scope, value):
    """A FloatRange lets nan through every bound: wait --timeout nan waited for ever."""
    code, _, err = run("wait", "--scope", scope, "--tool-call-id", "x", "--timeout", value)
    assert code == 2 and "--timeout" in err and len(err.strip().splitlines()) == 1
    code, _, _ = run("sweep", "--grace", value)
    assert code == 2


def test_cli__beat_interval_says_its_range_and_its_own_name(capsys, tmp_path, monkeypatch):
    """`beat --interval 1e300` was refused as "sweep_interval=1e+300: …", a setting's internal
    name, and its help showed no upper bound."""
    monkeypatch.setenv("TOOLLEDGER_HOME", str(tmp_path / "home"))
    code, out, _ = run_cli(capsys, "beat", "--help")
    assert code == 0 and "[0.1<=x<=86400]" in out, out
    code, _, err = run_cli(capsys, "beat", "--interval", "1e300")
    assert code == 2 and "'--interval'" in err and "sweep_interval" not in err, err
    assert err.count("\n") == 1 and not (tmp_path / "home").exists()


def test_cli__mcp_proxy_a_mistyped_option_is_a_usage_error(run):
    """Before the ``--``, an option the proxy does not know was taken for the upstream
    command (exit 1, "No such file or directory: --idempotnet")."""
    code, _, err = run("mcp", "proxy", "--scope", "x", "--idempotnet", "t", "--", "true")
    assert code == 2 and "no such option '--idempotnet'" in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = run("mcp", "proxy", "--json", "--bogus", "--", "true")
    assert code == 2 and json.loads(err)["exit_code"] == 2  # --json taken as the option it is


def test_cli__db_a_revision_that_is_not_ours_is_a_usage_error(run):
    code, out, _ = run("--json", "db", "upgrade")
    head = json.loads(out)["revision"]
    for command in ("upgrade", "downgrade"):
        code, _, err = run("db", command, "--revision", "9999")
        assert code == 2 and "no such revision" in err and "internal error" not in err
        assert len(err.strip().splitlines()) == 1
    assert json.loads(run("--json", "db", "upgrade")[1])["revision"] == head  # unchanged


def test_cli__db_upgrade_to_an_older_revision_is_refused_not_ignored(run):
    """Alembic's upgrade only goes up: ``db upgrade --revision 0003`` on a ledger at head did
    nothing and printed the head's revision, exit 0 (a deployment review)."""
    head = json.loads(run("--json", "db", "upgrade")[1])["revision"]
    code, _, err = run("db", "upgrade", "--revision", "0003")
    assert code == 2 and f"older than the schema (at {head})" in err
    assert "db downgrade --revision 0003" in err and len(err.strip().splitlines()) == 1
    # before them all, and the relative forms Alembic takes: the same (each did nothing and
    # printed the head's revision, exit 0: a cold review)
    for older in ("base", "head-1", "heads-1", "base+1", "0001+1", "-1"):
        code, _, err = run("db", "upgrade", "--revision", older)
        assert code == 2 and f"older than the schema (at {head})" in err, (older, err)
    assert run("db", "upgrade", "--revision", "head-0")[0] == 0  # where it is: nothing to do
    assert json.loads(run("--json", "db", "upgrade", "--revision", head)[1])["revision"] == head
    assert run("db", "downgrade", "--revision", "0004")[0] == 0
    assert json.loads(run("--json", "db", "upgrade", "--revision", "0005")[1])["revision"] == "0005"


def test_cli__db_downgrade_to_base_says_so_in_words_and_null_in_json(tmp_path, capsys):
    # a ledger of its own that holds nothing (base drops the tables of an empty ledger only;
    # the module's shared ledger holds other tests' calls)
    def run(*argv: str) -> tuple[int, str, str]:
        return run_cli(capsys, "--db", f"sqlite:///{tmp_path / 'empty.db'}", *argv)

    assert run("db", "upgrade")[0] == 0
    code, out, err = run("db", "downgrade", "--revision", "base")
    assert (code, out.strip()) == (0, "schema at base: no table of the ledger's is left"), err
    assert "None" not in out
    run("db", "upgrade")
    code, out, err = run("--json", "db", "downgrade", "--revision", "base")
    assert code == 0 and json.loads(out) == {"revision": None}, err


def test_cli__db_upgrade_grant_lets_a_role_read_and_write_rows_and_nothing_more(
    pg_server, pg_template, tmp_path, capsys, monkeypatch
):
    """README: every part but ``db upgrade`` runs under a role that may only read and write
    rows, granted by hand after each upgrade; ``--grant ROLE`` does it (the deployment review:
    the compose stack ran everything as the owner). The role submits, executes, sweeps, lists
    and verifies; it creates and drops nothing."""
    import uuid

    import psycopg

    from tests.conftest import fresh_pg_database

    role = f"tl_app_{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("TOOLLEDGER_SANDBOX", str(tmp_path / "sandbox"))
    admin = psycopg.connect(sa.make_url(pg_server).set(drivername="postgresql").render_as_string(
        hide_password=False), autocommit=True)  # fmt: skip
    admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw'")
    try:
        with fresh_pg_database(pg_server, pg_template) as url:
            owner = ("--db", url)
            code, out, err = run_cli(capsys, *owner, "--json", "db", "upgrade", "--grant", role)
            assert code == 0, err
            granted = json.loads(out)["granted"]
            assert granted["role"] == role and "operations" in granted["tables"]
            app = sa.make_url(url).set(username=role, password="pw")
            as_app = ("--db", app.render_as_string(hide_password=False))
            args = json.dumps({"path": "a.txt", "content": "x"})
            for argv in (
                ("submit", "--scope", "s", "--tool-call-id", "c1", "--tool", "write_file",
                 "--args", args, "--approved-by", "al"),
                ("execute", "--scope", "s", "--tool-call-id", "c1"),
                ("sweep",),
                ("list",),
                ("verify",),
            ):  # fmt: skip
                code, _, err = run_cli(capsys, *as_app, *argv)
                assert code == 0, (argv, err)
            assert (tmp_path / "sandbox" / "s" / "a.txt").read_text() == "x"
            dsn = app.set(drivername="postgresql").render_as_string(hide_password=False)
            with psycopg.connect(dsn, autocommit=True) as conn:
                for ddl in ("CREATE TABLE stray (i int)", "DROP TABLE operations",
                            "TRUNCATE execution_events", "DELETE FROM alembic_version"):  # fmt: skip
                    with pytest.raises(psycopg.errors.InsufficientPrivilege):
                        conn.execute(ddl)
            code, _, err = run_cli(capsys, *owner, "db", "upgrade", "--grant", "no_such_role_x")
            assert code == 2 and "role 'no_such_role_x' does not exist" in err
    finally:
        admin.execute(f"DROP ROLE IF EXISTS {role}")
        admin.close()


def test_cli__a_ledger_file_with_a_second_hard_link_is_refused_by_every_command(tmp_path, capsys):
    """helper-90: two names of one SQLite file are two write-ahead logs and two writers'
    queues: a shell's ``execute`` under one and a worker's under the other both claimed one
    attempt, a charge ran twice, and ``verify`` was ok. A second hard link is refused, by
    the reads on SQLite's own module too (``show``); a symlink is one name, and works."""
    import os

    first = tmp_path / "a" / "ledger.db"
    assert run_cli(capsys, "--db", f"sqlite:///{first}", "db", "upgrade")[0] == 0
    (tmp_path / "b").mkdir()
    os.link(first, tmp_path / "b" / "ledger.db")
    args = json.dumps({"path": "x.txt", "content": "x"})
    for db in (first, tmp_path / "b" / "ledger.db"):
        for argv in (
            ("show", "--scope", "s", "--tool-call-id", "c1"),
            ("list",),
            ("submit", "--scope", "s", "--tool-call-id", "c1", "--tool", "write_file",
             "--args", args),
            ("verify",),
        ):  # fmt: skip
            code, out, err = run_cli(capsys, "--db", f"sqlite:///{db}", *argv)
            assert code == 2 and out == "" and "has 2 hard links" in err, (argv, err)
            assert len(err.strip().splitlines()) == 1
    os.unlink(tmp_path / "b" / "ledger.db")
    os.symlink(first, tmp_path / "b" / "ledger.db")
    code, _, err = run_cli(capsys, "--db", f"sqlite:///{tmp_path / 'b' / 'ledger.db'}", "list")
    assert code == 0, err


def test_cli__db_upgrade_grant_is_refused_on_the_embedded_ledger(tmp_path, capsys):
    code, out, err = run_cli(
        capsys, "--db", f"sqlite:///{tmp_path / 'l.db'}", "db", "upgrade", "--grant", "app"
    )
    assert code == 2 and out == "" and "--grant: roles are Postgres's" in err
    assert (
        not (tmp_path / "l.db").exists()
        or sa.inspect(sa.create_engine(f"sqlite:///{tmp_path / 'l.db'}")).get_table_names() == []
    )  # refused before the upgrade: nothing made


def test_cli__a_postgres_database_with_other_session_defaults(pg_server, pg_template, tmp_path):
    """A database a DBA set to another DateStyle, time zone and IntervalStyle: psycopg parses
    ``timestamptz`` only in ISO, so every read of a row failed — a submit after its commit,
    ``list``, the executor's claim. Every ledger connection now asks for ISO itself."""
    from datetime import UTC, datetime

    import psycopg

    from tests.conftest import fresh_pg_database
    from toolledger.ledger.ledger import Ledger
    from toolledger.registry import load_registry
    from toolledger.sandbox import Sandbox
    from toolledger.worker.pipeline import Executor

    with fresh_pg_database(pg_server, pg_template) as url:
        name = url.rsplit("/", 1)[1]
        with psycopg.connect(pg_server.replace("+psycopg", ""), autocommit=True) as admin:
            for setting in ("DateStyle = 'SQL, DMY'", "TimeZone = 'Asia/Kolkata'"):
                admin.execute(f"ALTER DATABASE {name} SET {setting}")
            admin.execute(f"ALTER DATABASE {name} SET IntervalStyle = 'sql_standard'")
        sandbox, broker = str(tmp_path / "sandbox"), "redis://127.0.0.1:1/11"  # no broker
        base = ("--db", url, "--sandbox", sandbox, "--broker", broker, "--json")
        before = datetime.now(UTC)

        def cli(*argv: str) -> dict:
            import io
            from contextlib import redirect_stderr, redirect_stdout

            from toolledger.cli import main

            out, err = io.StringIO(), io.StringIO()
            with redirect_stdout(out), redirect_stderr(err), pytest.raises(SystemExit) as exit_:
                main([*base, *argv])
            assert not exit_.value.code, err.getvalue()
            return json.loads(out.getvalue())

        made = cli(
            "submit", "--scope", "ds", "--tool-call-id", "c1", "--tool", "write_file",
            "--args", ARGS, "--approved-by", "al",
        )  # fmt: skip
        assert made["outcome"] == "created"
        ledger = Ledger(url)
        try:
            executor = Executor(
                ledger, load_registry(), Sandbox(tmp_path / "sandbox"), worker_id="w",
                lease_seconds=30,
            )  # fmt: skip
            assert executor.execute("ds", made["idempotency_key"], 1).state == "finished"
        finally:
            ledger.close()
        shown = cli("show", "--scope", "ds", "--tool-call-id", "c1")
        assert shown["status"] == "succeeded" and shown["receipt"]["bytes_written"] == 4
        finished = datetime.fromisoformat(shown["executions"][0]["finished_at"])
        assert before <= finished <= datetime.now(UTC)  # read right, not only read
        assert cli("list", "--scope", "ds")["count"] == 1
        kinds = [
            e["kind"] for e in cli("events", "--scope", "ds", "--tool-call-id", "c1")["events"]
        ]
        assert kinds[-1] == "succeeded"
        assert cli("sweep", "--no-requeue")["errors"] == []
        assert (tmp_path / "sandbox" / "ds" / "a.txt").read_text() == "done"


def test_cli__the_options_a_postgres_url_carries_are_kept(pg_server, tmp_path):
    """``?options=-c search_path=…`` puts the ledger in a schema of its own. The ledger's own
    connect options (timeouts, DateStyle) replaced the URL's without a word: the tables went
    to ``public`` and the schema stayed empty."""
    import psycopg

    from toolledger.harness import scratch

    with (
        scratch.scratch_database(pg_server, "tl_t") as plain,
        psycopg.connect(plain.replace("+psycopg", ""), autocommit=True) as admin,
    ):
        admin.execute("CREATE SCHEMA agents")
        url = plain + "?options=-c%20search_path%3Dagents"
        base = ("--db", url, "--sandbox", str(tmp_path / "sandbox"), "--json")
        for argv in (
            ("db", "upgrade"),
            ("submit", "--scope", "s", "--tool-call-id", "c1", "--tool", "write_file",
             "--args", ARGS),
        ):  # fmt: skip
            proc = subprocess.run(
                [str(Path(sys.executable).with_name("toolledger")), *base, *argv],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr
        where = "SELECT to_regclass(%s) IS NOT NULL"
        assert admin.execute(where, ("agents.operations",)).fetchone() == (True,)
        assert admin.execute(where, ("public.operations",)).fetchone() == (False,)
        count = admin.execute("SELECT count(*) FROM agents.operations").fetchone()
        assert count == (1,)


@pytest.mark.parametrize("encoding", ["SQL_ASCII", "LATIN1"])
def test_cli__a_postgres_database_of_another_encoding_is_refused(pg_server, tmp_path, encoding):
    """LATIN1 cannot hold every character a call may carry (a submit of one failed with an
    internal UnicodeEncodeError); SQL_ASCII holds them as bytes its varchar limits count (a
    call id of 65 emoji, within the ledger's 256 characters, failed as a database error), and
    ``db upgrade`` failed there with an internal TypeError. Both are refused at connect, exit
    2, one line, nothing made; and so is a ledger an earlier version made there, by the
    commands that read it on libpq itself (``show``) as by the rest."""
    import sqlalchemy as sa

    from toolledger.harness import scratch
    from toolledger.ledger.db import upgrade

    with scratch.scratch_database(pg_server, "tl_t", encoding=encoding) as url:
        base = ("--db", url, "--sandbox", str(tmp_path / "sandbox"), "--json")

        def refused(*argv: str) -> None:
            exe = str(Path(sys.executable).with_name("toolledger"))
            done = subprocess.run([exe, *base, *argv], capture_output=True, text=True, timeout=120)
            assert done.returncode == 2 and done.stdout == "", done.stderr
            said = json.loads(done.stderr)["error"]
            assert said.startswith(f"the ledger's database has the encoding {encoding};")

        refused("db", "upgrade")
        # no ledger checks: a ledger an earlier version made (which sent UTF-8 since 0a63a4d)
        plain = sa.create_engine(url, connect_args={"client_encoding": "UTF8"})
        with plain.connect() as conn:
            made = conn.exec_driver_sql(
                "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
            )
            assert made.scalar_one() == 0
        upgrade(plain)
        plain.dispose()
        refused("show", "--scope", "s", "--tool-call-id", "c1")
        refused("list")
        refused("submit", "--scope", "s", "--tool-call-id", "c1", "--tool", "write_file",
                "--args", ARGS)  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [
        ["show", "--scope", "s", "--tool-call-id", "c"],
        ["events", "--scope", "s", "--tool-call-id", "c"],
        ["list"],
        ["list", "--review"],
        ["wait", "--scope", "s", "--tool-call-id", "c", "--timeout", "5"],
        ["approve", "--scope", "s", "--tool-call-id", "c", "--by", "ann"],
        ["reject", "--scope", "s", "--tool-call-id", "c", "--by", "ann"],
        ["execute", "--scope", "s", "--tool-call-id", "c"],
        ["retry", "--scope", "s", "--tool-call-id", "c", "--by", "ann"],
        ["resolve", "--execution-id", "e", "--as", "failed", "--by", "ann", "--evidence", "x"],
        ["repair", "TRANSCRIPT", "--scope", "s"],
        ["db", "downgrade", "--revision", "0004"],
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_cli__a_command_on_recorded_calls_refuses_a_missing_embedded_ledger(
    argv, tmp_path, capsys, monkeypatch
):
    """`TOOLLEDGER_HOME=typo toolledger show …` answered "no call" and left an empty
    typo/ledger.db behind (list answered nothing at all, exit 0; wait waited its whole
    timeout on a ledger no one writes to). Now: exit 4, one line naming the file, nothing made."""
    transcript = tmp_path / "t.json"
    transcript.write_text("[]")
    home = tmp_path / "typo"
    monkeypatch.setenv("TOOLLEDGER_HOME", str(home))
    monkeypatch.delenv("TOOLLEDGER_DB", raising=False)
    argv = [str(transcript) if a == "TRANSCRIPT" else a for a in argv]
    code, out, err = run_cli(capsys, *argv)
    assert code == 4, (code, out, err)
    assert err.count("\n") == 1 and f"no ledger at {home / 'ledger.db'}" in err, err
    assert not (home / "ledger.db").exists()
    # `db upgrade` (and submit, worker, beat, serve, sweep) still make it; then it is read
    assert run_cli(capsys, "db", "upgrade")[0] == 0
    code, out, err = run_cli(capsys, *argv)
    assert "no ledger at" not in err and code in (0, 1, 4, 5, 7), (code, out, err)


@pytest.mark.parametrize(
    ("tool", "args", "code"),
    [
        ("write_file", '{"path": "../x", "content": "x"}', 6),
        ("write_file", '{"path": "x"}', 6),
        ("nosuch", "{}", 4),
    ],
    ids=["sandbox", "schema", "unknown-tool"],
)
def test_cli__a_refused_submit_makes_no_embedded_ledger(
    tool, args, code, tmp_path, capsys, monkeypatch
):
    """A refused submit on a home with no ledger left a full ledger.db behind (exit 6 says
    nothing was recorded), and `list` then answered count 0 instead of "no ledger at …"."""
    home = tmp_path / "home"
    monkeypatch.setenv("TOOLLEDGER_HOME", str(home))
    monkeypatch.delenv("TOOLLEDGER_DB", raising=False)
    argv = ["submit", "--scope", "p", "--tool-call-id", "c", "--tool", tool, "--args", args]
    got, out, err = run_cli(capsys, *argv)
    assert got == code and err.count("\n") == 1, (got, out, err)
    assert not (home / "ledger.db").exists()
    assert run_cli(capsys, "--json", "list")[0] == 4
    # an accepted call makes it, as ever
    ok = ["submit", "--scope", "p", "--tool-call-id", "c", "--tool", "write_file"]
    assert run_cli(capsys, *ok, "--args", '{"path": "a", "content": "x"}')[0] == 0
    assert (home / "ledger.db").exists()


def test_cli__a_path_that_does_not_show_as_itself_is_refused_for_new_calls_only(tmp_path, capsys):
    """A new call's path holding a zero-width space or a bidirectional override is refused
    at submit (it read as another name on the page a person approves from); a call recorded
    before that rule, approved as it was, still runs (a cold review: it failed at execute)."""
    from toolledger.ledger.ledger import Ledger

    url, sandbox = f"sqlite:///{tmp_path / 'ledger.db'}", tmp_path / "sandbox"
    cli = [
        "--db",
        url,
        "--sandbox",
        str(sandbox),
        "--broker",
        f"embedded+sqlite:///{tmp_path / 'b.db'}",
    ]
    assert run_cli(capsys, *cli, "db", "upgrade")[0] == 0
    ledger = Ledger(url)
    old = {"path": "zw\u200b.txt", "content": "x"}
    ledger.submit("s", "old1", "write_file", old, approved_by="ann")  # as before the rule
    ledger.close()
    code, out, err = run_cli(
        capsys, *cli, "--json", "execute", "--scope", "s", "--tool-call-id", "old1"
    )
    assert code == 0 and '"succeeded"' in out, err
    assert (sandbox / "s" / "zw\u200b.txt").read_text() == "x"
    # a variation selector too: ``report.txt\ufe0f`` was shown as ``report.txt`` (a cold review)
    for i, path in enumerate(("zw\u200b2.txt", "invoice\u202efdp.sh", "report.txt\ufe0f")):
        args = json.dumps({"path": path, "content": "x"})
        code, _, err = run_cli(capsys, *cli, "submit", "--scope", "s", "--tool-call-id",
                               f"new-{i}", "--tool", "write_file", "--args", args)  # fmt: skip
        assert code == 6 and "does not show as itself" in err, err
        said = "a mark drawn as nothing" if path.endswith("\ufe0f") else "a control, format"
        assert said in err, err


def test_cli__a_database_locked_past_the_timeout_is_busy_not_unavailable(
    tmp_path, capsys, monkeypatch
):
    """SQLite's lock held by another process past the command's timeout read "database
    unavailable": a person went looking for a server that was there (a cold review)."""
    import contextlib
    import sqlite3

    db = tmp_path / "ledger.db"
    url = f"sqlite:///{db}"
    assert run_cli(capsys, "--db", url, "db", "upgrade")[0] == 0
    monkeypatch.setenv("TOOLLEDGER_DB_TIMEOUT", "0.5")
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as holder:
        holder.execute("BEGIN EXCLUSIVE")
        submit = ["submit", "--scope", "s", "--tool-call-id", "c", "--tool", "write_file",
                  "--args", '{"path": "a.txt", "content": "x"}']  # fmt: skip
        code, _, err = run_cli(capsys, "--db", url, *submit)
        holder.execute("ROLLBACK")
    assert code == 1 and err.startswith("toolledger: error: database busy: "), err
    assert "locked" in err


@pytest.mark.postgres
def test_unreachable__a_server_out_of_reach_not_one_that_refused_for_good(pg_server):
    """Every connect failure was "unreachable", a 503 "try again" from serve: a database or a
    role that does not exist too, which no retry mends (a cold review)."""
    import psycopg

    from toolledger.ledger.db import unreachable

    def failure(url: str) -> BaseException:
        with pytest.raises(psycopg.OperationalError) as caught:
            psycopg.connect(url, connect_timeout=5)
        return caught.value

    server = sa.make_url(pg_server)
    base = f"postgresql://{server.username}@{server.host}:{server.port}"
    assert unreachable(failure("postgresql://127.0.0.1:1/x"))  # nothing listens
    assert not unreachable(failure(f"{base}/no_such_database_zz"))
    assert not unreachable(failure(f"postgresql://no_such_role_zz@{server.host}:{server.port}/x"))
    for for_now in (  # refusals at connect that pass, in the server's words (no SQLSTATE)
        'FATAL:  too many connections for role "app"',
        "FATAL:  the database system is not yet accepting connections",
        "FATAL:  the database system is shutting down",
    ):
        assert unreachable(psycopg.OperationalError(f"connection failed: {for_now}")), for_now


def test_cli__a_database_error_trying_again_will_not_mend_is_no_unavailable(tmp_path, capsys):
    """A table gone read "database unavailable" (a cold review): it is a database error."""
    import contextlib
    import sqlite3

    db = tmp_path / "ledger.db"
    url = f"sqlite:///{db}"
    assert run_cli(capsys, "--db", url, "db", "upgrade")[0] == 0
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("DROP TABLE tool_calls")
        conn.commit()
    code, _, err = run_cli(capsys, "--db", url, "show", "--scope", "s", "--tool-call-id", "c")
    assert code == 1 and err.startswith("toolledger: error: database error: no such table"), err


def test_cli__busy_is_a_lock_or_statement_timeout_only():
    from toolledger.ledger.db import busy as _busy

    class PgError(Exception):
        def __init__(self, sqlstate: str) -> None:
            self.sqlstate = sqlstate

    assert _busy(PgError("55P03")) and _busy(PgError("57014"))  # lock, statement timeout
    assert not _busy(PgError("08006")) and not _busy(None)  # a connection failure
    assert not _busy(ConnectionRefusedError("is locked"))


def test_cli__another_applications_database_or_an_empty_file_is_never_made_a_ledger(
    tmp_path, capsys
):
    """`--db` naming another application's SQLite database (a typo): `show` and `list` made
    it a ledger in silence, and so did `submit`; an empty file at the ledger's path was made
    one by `list` (a cold review). Read commands make nothing; no command makes a ledger
    among another application's tables."""
    import contextlib
    import sqlite3

    app, empty = tmp_path / "app.db", tmp_path / "empty.db"
    alembic_app = tmp_path / "alembic-app.db"  # Alembic's version table is any such app's too
    with contextlib.closing(sqlite3.connect(app)) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER)")
        conn.commit()
    with contextlib.closing(sqlite3.connect(alembic_app)) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER)")
        conn.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        conn.execute("INSERT INTO alembic_version VALUES ('3f2a1b9c0d7e')")
        conn.commit()
    empty.touch()
    show = ["show", "--scope", "s", "--tool-call-id", "c", "--json"]
    submit = ["submit", "--scope", "s", "--tool-call-id", "c", "--tool", "write_file",
              "--args", '{"path": "a.txt", "content": "x"}', "--json"]  # fmt: skip
    for argv in (show, ["list", "--json"], submit):
        code, _, err = run_cli(capsys, "--db", f"sqlite:///{app}", *argv)
        assert code == 1 and "not a toolledger ledger" in err and err.count("\n") == 1, err
    with contextlib.closing(sqlite3.connect(app)) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        # nor left in WAL mode, which the file keeps (its application may not read WAL)
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
    assert tables == ["invoices"] and mode == "delete"
    code, _, err = run_cli(capsys, "--db", f"sqlite:///{alembic_app}", "list")
    assert code == 1 and "not a toolledger ledger's (invoices; Alembic revision" in err, err
    with contextlib.closing(sqlite3.connect(alembic_app)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    transcript = tmp_path / "t.json"
    transcript.write_text("[]")
    call = ["--scope", "s", "--tool-call-id", "c"]
    readers = [
        show, ["list"], ["events", *call], ["wait", *call, "--timeout", "0.5"],
        ["approve", *call, "--by", "a"], ["reject", *call, "--by", "a"],
        ["retry", *call, "--by", "a"], ["execute", *call], ["verify"],
        ["resolve", "--execution-id", "e", "--as", "failed", "--by", "a", "--evidence", "x"],
        ["repair", str(transcript), "--scope", "s"],
    ]  # fmt: skip
    broker = f"embedded+sqlite:///{tmp_path / 'broker.db'}"
    for argv in readers:
        code, _, err = run_cli(capsys, "--db", f"sqlite:///{empty}", "--broker", broker, *argv)
        assert code == 1 and "db upgrade" in err, (argv, err)
        with contextlib.closing(sqlite3.connect(empty)) as conn:
            assert not conn.execute("SELECT name FROM sqlite_master").fetchall(), argv
    code, _, err = run_cli(capsys, "--db", f"sqlite:///{empty}", *submit)  # submit makes it
    assert code == 0, err
    # `db upgrade` makes the other application's database a ledger, on purpose: WAL from then
    assert run_cli(capsys, "--db", f"sqlite:///{app}", "db", "upgrade")[0] == 0
    assert run_cli(capsys, "--db", f"sqlite:///{app}", *submit)[0] == 0
    with contextlib.closing(sqlite3.connect(app)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@pytest.mark.postgres
@pytest.mark.parametrize(
    "option",
    [
        "sslmode=bogus",
        "foo=bar",
        "options=-c%20foo%3Dbar",  # refused by the server: was "database unavailable", waited on
        "options=-c%20statement_timeout%3Dabc",
    ],
)
def test_cli__a_postgres_url_whose_options_libpq_refuses_is_a_setting_to_mend(
    pg_server, tmp_path, capsys, option
):
    """``?sslmode=bogus`` was "database unavailable", exit 1, and a worker waited on it for
    ever (a review): exit 2, one line naming the setting as it was given (``--db``: it was
    said as TOOLLEDGER_DB, a variable the user never set), and a worker refuses to start."""
    import time

    from toolledger.config import ConfigError, Settings
    from toolledger.worker.app import check_worker_start

    url = f"{pg_server}{'&' if '?' in pg_server else '?'}{option}"
    code, out, err = run_cli(capsys, "--db", url, "list", "--json")
    assert code == 2, (code, out, err)
    assert json.loads(err)["error"].startswith("--db: ") and err.count("\n") == 1
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TOOLLEDGER_DB", url)
        code, out, err = run_cli(capsys, "list", "--json")
    assert code == 2 and json.loads(err)["error"].startswith("TOOLLEDGER_DB: "), err
    settings = Settings.from_env(
        {"TOOLLEDGER_DB": url, "TOOLLEDGER_HOME": str(tmp_path / "home"),
         "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0"}
    )  # fmt: skip
    began = time.monotonic()
    with pytest.raises(ConfigError, match="TOOLLEDGER_DB: "):
        check_worker_start(settings)
    assert time.monotonic() - began < 5  # refused, not waited on


def test_cli__an_empty_global_option_is_refused_not_taken_for_the_default(
    capsys, tmp_path, monkeypatch
):
    """``--db ''`` was taken for "not given": with TOOLLEDGER_DB set, ``--db "$URL"`` and URL
    unset wrote the call to the default home's ledger instead (a cold review)."""
    monkeypatch.setenv("TOOLLEDGER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TOOLLEDGER_DB", f"sqlite:///{tmp_path / 'other.db'}")
    for option in ("--db", "--broker", "--sandbox"):
        code, _out, err = run_cli(capsys, option, "", "submit", "--scope", "s", "--tool-call-id",
                                 "c", "--tool", "write_file", "--args", ARGS)  # fmt: skip
        assert code == 2 and f"'{option}': must not be empty" in err, (option, err)
    assert not (tmp_path / "home").exists() and not (tmp_path / "other.db").exists()
    monkeypatch.setenv("TOOLLEDGER_DB", "")  # an empty variable is unset, as ever
    assert run_cli(capsys, "list")[0] == 4  # (no ledger in the home: nothing recorded)


@pytest.mark.parametrize("home", ["pc%41", "q?x=1"])
def test_cli__a_home_a_url_cannot_carry_is_refused(capsys, tmp_path, monkeypatch, home):
    """``TOOLLEDGER_HOME=…/pc%41`` put the ledger in ``…/pcA`` and the sandbox in the home;
    ``…/q?x=1`` made the ledger the file ``…/q`` beside it (a cold review)."""
    monkeypatch.setenv("TOOLLEDGER_HOME", str(tmp_path / home))
    monkeypatch.delenv("TOOLLEDGER_DB", raising=False)
    code, _, err = run_cli(capsys, "submit", "--scope", "s", "--tool-call-id", "c", "--tool",
                           "write_file", "--args", ARGS)  # fmt: skip
    assert code == 2 and "which a ledger URL cannot carry" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_cli__a_home_the_broker_url_cannot_carry_is_refused(capsys, tmp_path, monkeypatch):
    """``TOOLLEDGER_HOME=…/a;1``: kombu reads ``;`` in a broker URL as a list of failover URLs,
    so the embedded broker was the file ``…/a`` beside the home (``submit --approved-by``,
    exit 0), and homes ``a;1`` and ``a;2`` shared one broker: one home's workers took the
    other's jobs (a cold review). Refused before anything is made, as ``?`` and ``%41`` are."""
    monkeypatch.setenv("TOOLLEDGER_HOME", str(tmp_path / "a;1"))
    monkeypatch.delenv("TOOLLEDGER_DB", raising=False)
    monkeypatch.delenv("TOOLLEDGER_BROKER", raising=False)
    code, _, err = run_cli(capsys, "submit", "--scope", "s", "--tool-call-id", "c", "--tool",
                           "write_file", "--args", ARGS, "--approved-by", "bob")  # fmt: skip
    assert code == 2 and "holds ';', which a ledger URL cannot carry" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # a broker of one's own: the home's ';' is no URL's
    monkeypatch.setenv("TOOLLEDGER_BROKER", f"embedded+sqlite:///{tmp_path / 'broker.db'}")
    assert run_cli(capsys, "submit", "--scope", "s", "--tool-call-id", "c", "--tool",
                   "write_file", "--args", ARGS)[0] == 0  # fmt: skip


def test_cli__an_empty_revision_is_a_usage_error_before_anything_is_made(
    capsys, tmp_path, monkeypatch
):
    monkeypatch.setenv("TOOLLEDGER_HOME", str(tmp_path / "home"))
    for command in ("upgrade", "downgrade"):
        code, _, err = run_cli(capsys, "db", command, "--revision", "")
        assert code == 2 and "--revision must not be empty" in err, err
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["sweep", "--grace", "1e12"], {}),
        (["sweep", "--requeue-after", "1e20"], {}),
        (["sweep"], {"TOOLLEDGER_SWEEP_GRACE": "1e300"}),
        (["sweep"], {"TOOLLEDGER_REQUEUE_AFTER": "1e20"}),
    ],
)
def test_cli__a_sweep_time_past_a_year_is_refused(run, monkeypatch, argv, env):
    """1e12 s of grace overflowed Postgres's timestamps: every pass failed "timestamp out of
    range", the beat's too, recovery off (a cold review)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, _, err = run(*argv)
    assert code == 2 and ("a year" in err or "31536000" in err), err
    monkeypatch.undo()
    assert run("db", "upgrade")[0] == 0  # (a test before this one leaves the schema older)
    assert run("sweep", "--grace", "31536000", "--no-requeue")[0] == 0  # a year is taken


def test_serve__a_port_it_cannot_listen_on_is_one_error_line_exit_1(capsys, tmp_path, monkeypatch):
    """uvicorn exited 3, the CLI's "conflict", its reason in its log only (a cold review)."""
    import socket

    monkeypatch.setenv("TOOLLEDGER_HOME", str(tmp_path))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        code, _out, err = run_cli(capsys, "--json", "serve", "--insecure-local", "--port", port)
    said = json.loads(err.strip().splitlines()[-1])
    assert code == 1 and said["exit_code"] == 1 and "cannot listen on 127.0.0.1" in said["error"]


def test_cli__wait_is_a_read_it_loads_no_tools(run, scope, monkeypatch):
    """The README lists the commands that load the user's tools, and reads do not: ``wait``
    loaded them through the client, and a module that failed to import failed it (exit 2:
    a cold review)."""
    assert run("db", "upgrade")[0] == 0  # (a test before this one leaves the schema older)
    code, _, err = submit(run, scope, "w")
    assert code == 0, err
    assert (
        run("reject", "--scope", scope, "--tool-call-id", "w", "--by", "a", "--reason", "no")[0]
        == 0
    )
    monkeypatch.setenv("TOOLLEDGER_TOOLS", "no_such_tools_module_anywhere")
    code, out, err = run(
        "--json", "wait", "--scope", scope, "--tool-call-id", "w", "--timeout", "0"
    )
    assert code == 0 and json.loads(out)["status"] == "rejected", err


@pytest.mark.parametrize("which", ["--sandbox", "TOOLLEDGER_HOME"])
def test_cli__a_home_or_sandbox_that_is_a_file_is_a_configuration_error(
    capsys, tmp_path, monkeypatch, which
):
    """It said "Not a directory", exit 1, a failure, not the configuration error it is (a
    cold review)."""
    plain = tmp_path / "afile"
    plain.write_text("x")
    monkeypatch.setenv("TOOLLEDGER_HOME", str(tmp_path / "home"))
    argv = ["--sandbox", str(plain)] if which == "--sandbox" else []
    if which == "TOOLLEDGER_HOME":
        monkeypatch.setenv("TOOLLEDGER_HOME", str(plain))
    code, _, err = run_cli(capsys, *argv, "submit", "--scope", "s", "--tool-call-id", "c",
                           "--tool", "write_file", "--args", ARGS)  # fmt: skip
    assert code == 2 and "is not a directory" in err, err
    assert plain.read_text() == "x" and not (tmp_path / "home").exists()


@pytest.mark.parametrize("home", ["h#1", "50%off", "100%"])
def test_cli__a_home_a_url_reads_as_written_is_taken(capsys, tmp_path, monkeypatch, home):
    """helper-103: "#" and a "%" not followed by two hex digits reach the file as written;
    refusing them stopped installs that worked."""
    monkeypatch.setenv("TOOLLEDGER_HOME", str(tmp_path / home))
    monkeypatch.delenv("TOOLLEDGER_DB", raising=False)
    code, _, err = run_cli(capsys, "submit", "--scope", "s", "--tool-call-id", "c", "--tool",
                           "write_file", "--args", ARGS)  # fmt: skip
    assert code == 0, err
    assert (tmp_path / home / "ledger.db").is_file()


def test_serve__the_listen_probe_binds_as_uvicorn_does():
    """helper-103: the probe bound a dual-stack IPv6 socket, and an IPv4 listener elsewhere
    on the port refused ``--host ::``/``::1``, which uvicorn (IPv6 only on IPv6) serves."""
    import socket

    from toolledger.server.run import _can_listen

    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("0.0.0.0", 0))  # noqa: S104 - the wildcard is the case
        taken.listen()
        port = taken.getsockname()[1]
        _can_listen("::1", port, 1)  # uvicorn's one process would serve it
        with pytest.raises(OSError, match=r"cannot listen on 127\.0\.0\.1"):
            _can_listen("127.0.0.1", port, 1)


def test_cli__events_pages_through_a_long_history(run, scope):
    """A key an agent linked thousands of ids to answered its whole history at once (a cold
    review: 23,000 links, 5.8 MB). ``--limit`` and ``--after`` page it; ``more`` says when
    to ask again; the pages together are the history."""
    run("db", "upgrade")
    assert submit(run, scope, "c1", ARGS, "--key", "k")[0] == 0
    for i in range(2, 6):  # each a linked event on the same key
        assert submit(run, scope, f"c{i}", ARGS, "--key", "k")[0] == 0
    whole = json.loads(run("events", "--scope", scope, "--tool-call-id", "c3", "--json")[1])
    assert len(whole["events"]) == 6 and whole["more"] is False
    pages, after = [], 0
    while True:
        code, out, err = run("events", "--scope", scope, "--tool-call-id", "c3", "--json",
                             "--limit", "4", "--after", str(after))  # fmt: skip
        page = json.loads(out)
        assert code == 0 and page["idempotency_key"] == "k" and len(page["events"]) <= 4
        pages.append(page)
        if not page["more"]:
            assert err == ""
            break
        assert json.loads(err)["warning"].endswith(f"--after {page['events'][-1]['seq']}")
        after = page["events"][-1]["seq"]
    assert [len(p["events"]) for p in pages] == [4, 2]
    assert [e for p in pages for e in p["events"]] == whole["events"]
    # past the end: no events, the key still named; text mode warns on stderr too
    last = whole["events"][-1]["seq"]
    page = json.loads(run("events", "--scope", scope, "--tool-call-id", "c3", "--json",
                          "--after", str(last))[1])  # fmt: skip
    assert (page["events"], page["more"], page["idempotency_key"]) == ([], False, "k")
    code, out, err = run("events", "--scope", scope, "--tool-call-id", "c3", "--limit", "1")
    assert (
        code == 0
        and len(out.splitlines()) == 1
        and err.startswith("toolledger: warning: more than 1")
    )
    code, _, err = run("events", "--scope", scope, "--tool-call-id", "c3", "--limit", "-1")
    assert code == 2 and "--limit" in err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("worker", "--workdir", "/tmp"), "No such option '--workdir'"),
        (("worker", "--concurrency"), "requires an argument"),
        (("worker", "stray"), "unexpected extra argument (stray)"),
        (("beat", "--bogus"), "No such option '--bogus'"),
    ],
)
def test_cli__a_celery_option_that_does_not_exist_makes_no_ledger(
    capsys, tmp_path, monkeypatch, argv, says
):
    """Celery parsed its options after the start's checks, which had made the embedded
    ledger: a mistyped option, exit 2, left a new ``ledger.db`` behind, and ``list`` there
    then answered "no calls" instead of "no ledger at"."""
    home = tmp_path / "home"
    monkeypatch.setenv("TOOLLEDGER_HOME", str(home))
    code, _out, err = run_cli(capsys, *argv)
    assert code == 2 and says in err and err.count("\n") == 1, err
    assert not home.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["--tool-call-id", "c1", "--scope", "other"],
        ["--tool-call-id", "c1", "--approved-by", "ann", "--approved-by", "bob"],
        ["--tool-call-id", "c1", "--tool-call-id", "c2"],
        ["--tool-call-id", "c1", "--args", ARGS],
    ],
    ids=["scope", "approved-by", "tool-call-id", "args"],
)
def test_cli__an_option_given_twice_is_refused_not_the_last_taken(run, ledger, scope, argv):
    """Click took the last in silence: ``submit --scope a … --scope b`` recorded the call in
    ``b`` (a cold review of the CLI). Exit 2, one line naming the option, nothing recorded."""
    before = row_counts(ledger.engine)
    base = ["submit", "--scope", scope, "--tool", "write_file", "--args", ARGS, "--json"]
    code, out, err = run(*base, *argv)
    assert code == 2 and out == "", err
    assert "given more than once" in json.loads(err)["error"]
    assert row_counts(ledger.engine) == before


def test_cli__a_global_option_given_twice_is_refused(capsys, tmp_path):
    a, b = f"sqlite:///{tmp_path / 'a.db'}", f"sqlite:///{tmp_path / 'b.db'}"
    code, out, err = run_cli(capsys, "--db", a, "--db", b, "db", "upgrade")
    assert code == 2 and out == "" and "--db given more than once" in err, err
    assert not (tmp_path / "a.db").exists() and not (tmp_path / "b.db").exists()


@pytest.mark.parametrize("query", ["socket_timeout=5", "foo=bar"])
def test_cli__a_broker_url_whose_options_kombu_refuses_is_a_setting_to_mend(
    run, ledger, scope, monkeypatch, query
):
    """kombu takes a broker URL's query as keywords of its Connection: one it does not take
    failed every enqueue ("the sweep will re-enqueue it", exit 0, the call recorded and never
    published, every sweep failing alike) and a worker's start as an "internal error" (a cold
    review of the CLI). Refused as a setting, exit 2, nothing recorded."""
    monkeypatch.setenv("TOOLLEDGER_BROKER", f"redis://:s3cret@127.0.0.1:6379/13?{query}")
    before = row_counts(ledger.engine)
    code, out, err = submit(run, scope, "c1", ARGS, "--approved-by", "ann", "--json")
    assert code == 2 and out == "", err
    error = json.loads(err)["error"]
    assert error.startswith("TOOLLEDGER_BROKER: ") and "s3cret" not in error, error
    assert row_counts(ledger.engine) == before


CHATTY_TOOLS = '''
from pydantic import BaseModel
from toolledger.tools import tool

class To(BaseModel):
    to: str

@tool(idempotent=False)
def chatty(args: To, ctx) -> dict:
    """Prints while it runs."""
    print("hello from the tool")
    return {"ok": args.to}

@tool(read_only=True)
def chatty_read(args: To, ctx) -> dict:
    """Prints while it reads."""
    print("reading")
    return {"read": args.to}
'''


def test_cli__a_tools_print_never_reaches_the_answer_on_stdout(run, scope, tmp_path, monkeypatch):
    """A tool's print() went to stdout before the answer: ``execute --json`` and a read-only
    ``submit --json`` printed "hello from the tool" and then the JSON, which no script could
    parse (a cold review of the CLI). It goes to stderr; stdout is the answer alone."""
    (tmp_path / "chatty_cli_tools.py").write_text(CHATTY_TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TOOLLEDGER_TOOLS", "chatty_cli_tools")
    monkeypatch.setenv("TOOLLEDGER_SANDBOX", str(tmp_path / "sandbox"))
    call = ["--scope", scope, "--tool-call-id", "c1"]
    code, out, err = run("submit", *call, "--tool", "chatty", "--args", '{"to": "x"}',
                         "--approved-by", "ann", "--json")  # fmt: skip
    assert code == 0, err
    code, out, err = run("execute", *call, "--json")
    assert code == 0 and json.loads(out)["status"] == "succeeded", out
    assert "hello from the tool" in err
    code, out, err = run("submit", "--scope", scope, "--tool-call-id", "r1", "--tool",
                         "chatty_read", "--args", '{"to": "y"}', "--json")  # fmt: skip
    assert code == 0 and json.loads(out)["result"] == {"read": "y"}, out
    assert "reading" in err
