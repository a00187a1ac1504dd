"""Hostile input gets a clear one-line refusal with its documented exit code and changes
nothing: each case an attacker reproduced (issue: the whole input surface), on both backends,
through the CLI and the Python API; then Hypothesis throws arbitrary text at both."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import row_counts, run_cli
from toolledger.config import ConfigError, Settings
from toolledger.ledger import inputs
from toolledger.ledger.errors import InputError, InvalidArguments, InvalidIdentifier
from toolledger.ledger.ledger import Ledger

WRITE = '{"path": "a.txt", "content": "x"}'
#: Examples per property: the default run stays well under a minute; HYPOTHESIS_PROFILE=large
#: runs 100 times as many (``make fuzz``).
EXAMPLES = 100 * (100 if os.environ.get("HYPOTHESIS_PROFILE") == "large" else 1)
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
DOCUMENTED_EXITS = {0, 1, 2, 3, 4, 5, 6}


@pytest.fixture
def cli(db_url, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TOOLLEDGER_SANDBOX", str(tmp_path / "sandbox"))
    monkeypatch.setenv("TOOLLEDGER_BROKER", f"embedded+sqlite:///{tmp_path / 'broker.db'}")
    monkeypatch.delenv("TOOLLEDGER_TOOLS", raising=False)
    return lambda *argv: run_cli(capsys, "--db", db_url, *argv)


def submit(cli, *extra: str, args: str = WRITE, tcid: str = "c1") -> tuple[int, str, str]:
    return cli(
        "submit",
        "--scope",
        "hostile",
        "--tool-call-id",
        tcid,
        "--tool",
        "write_file",
        "--args",
        args,
        *extra,
    )


DEEP = '{"path": "a.txt", "content": ' + "[" * 1000 + "]" * 1000 + "}"
HUGE = '{"path": "a.txt", "content": ' + "9" * 5000 + "}"
SURROGATE = "\udcff"  # what Python makes of an undecodable argv byte (surrogateescape)

CLI_CASES: dict[str, tuple[tuple[str, ...], dict[str, str], str]] = {
    # name: (extra argv, submit kwargs, what the one-line error names)
    "args: invalid UTF-8": (
        (),
        {"args": '{"path": "a.txt", "content": "' + SURROGATE + '"}'},
        "--args",
    ),
    "args: lone surrogate escape": (
        (),
        {"args": '{"path": "a.txt", "content": "\\udcff"}'},
        "--args",
    ),
    "args: 1,000 levels deep": ((), {"args": DEEP}, "nested more than 64"),
    "args: 5,000-digit integer": ((), {"args": HUGE}, "out of range"),
    "args: duplicate key": (
        (),
        {"args": '{"path": "a.txt", "path": "b", "content": "x"}'},
        "duplicate key",
    ),
    "args: NaN": ((), {"args": '{"path": "a.txt", "content": NaN}'}, "NaN"),
    # an extra key the schema refuses, named in the error: its NUL was echoed raw
    "args: NUL in a key": ((), {"args": WRITE[:-1] + ', "k\\u0000": 1}'}, "k\\x00"),
    "args: ESC in a key": ((), {"args": WRITE[:-1] + ', "k\\u001b[31m": 1}'}, "k\\x1b[31m"),
    "tool_call_id: invalid UTF-8": ((), {"tcid": "c" + SURROGATE}, "tool_call_id"),
    "tool_call_id: U+2028": ((), {"tcid": "c\u2028d"}, "U+2028"),
    "tool_call_id: U+0085": ((), {"tcid": "c\x85"}, "U+0085"),
    "tool_call_id: bidi override": ((), {"tcid": "c\u202ed"}, "U+202E"),
    "tool_call_id: a dot segment": ((), {"tcid": ".."}, "dot segment"),
    "tool_call_id: the other dot segment": ((), {"tcid": "."}, "dot segment"),
    "key: C1 control": (("--key", "k\x9b"), {}, "key"),
    "key: invalid UTF-8": (("--key", "k" + SURROGATE), {}, "key"),
    # named as the option typed, not the ledger's field ("approver: …": a cold review)
    "approved-by: invalid UTF-8": (("--approved-by", "al" + SURROGATE), {}, "--approved-by: "),
    "approved-by: newline": (("--approved-by", "al\nroot"), {}, "--approved-by: "),
    "reason: NUL": (("--approved-by", "al", "--reason", "a\x00b"), {}, "reason"),
    "reason: invalid UTF-8": (("--approved-by", "al", "--reason", SURROGATE), {}, "reason"),
    "reason: over the cap": (("--approved-by", "al", "--reason", "r" * 5000), {}, "reason"),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli__hostile_submit_is_refused_with_exit_6_and_records_nothing(cli, ledger, case):
    extra, kwargs, names = CLI_CASES[case]
    before = row_counts(ledger.engine)
    code, out, err = submit(cli, *extra, **kwargs)
    assert (code, out) == (6, ""), err
    assert err.startswith("toolledger: error: ") and err.count("\n") == 1, err
    assert names in err and "internal error" not in err
    # a control character the input held is written as an escape, never echoed raw
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", err), err
    assert row_counts(ledger.engine) == before


@pytest.mark.parametrize(
    "argv",
    [
        ["approve", "--scope", "s", "--tool-call-id", "c"],
        ["reject", "--scope", "s", "--tool-call-id", "c"],
        ["retry", "--scope", "s", "--tool-call-id", "c"],
        ["resolve", "--execution-id", "e", "--as", "failed", "--evidence", "x"],
    ],
    ids=lambda argv: argv[0],
)
@pytest.mark.parametrize("person", ["al\x01", "", "p" * 300])
def test_cli__a_refused_person_is_named_as_the_option(cli, argv, person):
    """`--by` refused as "decider: …", "resolver: …", "authoriser: …": fields of the ledger
    the user never typed. The option's name now; the library's own messages are unchanged."""
    code, out, err = cli(*argv, "--by", person)
    assert (code, out) == (6, ""), err
    assert err.startswith("toolledger: error: --by: ") and err.count("\n") == 1, err


def test_cli__args_from_stdin_and_file_are_decoded_strictly(cli, ledger, monkeypatch, tmp_path):
    before = row_counts(ledger.engine)
    bad = b'{"path": "a.txt", "content": "\xff\xfe"}'
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(bad)))
    code, _, err = submit(cli, args="-")
    assert code == 6 and "not UTF-8 (byte 30" in err
    (tmp_path / "args.json").write_bytes(bad)
    code, _, err = submit(cli, args=f"@{tmp_path / 'args.json'}")
    assert code == 6 and "not UTF-8" in err
    assert row_counts(ledger.engine) == before


def test_cli__args_that_never_end_or_a_closed_stdin_are_refused(cli, ledger, monkeypatch):
    """``--args @/dev/zero`` was read whole before the size cap: the process grew until the
    kernel killed it (23 GB, exit 137, no word). A closed stdin was an internal error."""
    before = row_counts(ledger.engine)
    code, out, err = submit(cli, args="@/dev/zero")
    assert (code, out) == (6, "") and err.count("\n") == 1, err
    assert "--args from /dev/zero: more than" in err
    monkeypatch.setattr(sys, "stdin", None)
    code, out, err = submit(cli, args="-")
    assert (code, out) == (6, "") and "from stdin: it is closed" in err, err
    assert row_counts(ledger.engine) == before


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (("list", "--limit", str(2**63 - 1)), {}, "--limit"),
        (("db", "downgrade", "--revision", "+1"), {}, "--revision '+1': Relative revision"),
        (("db", "downgrade", "--revision", "0001:0003"), {}, "Range revision not allowed"),
        (("db", "upgrade", "--revision", "-1"), {}, "--revision '-1'"),
        (("list",), {"TOOLLEDGER_FAILPOINTS": "garbage"}, "TOOLLEDGER_FAILPOINTS='garbage'"),
    ],
)
def test_cli__bad_options_and_settings_exit_2_not_internal(cli, monkeypatch, argv, env, says):
    """Each was an internal error, exit 1: an OverflowError from SQLite, Alembic's
    CommandError, a failpoint spec refused only when the first call ran."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, out, err = cli(*argv)
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert says in err and "internal error" not in err, err


def test_cli__real_undecodable_argv_bytes_exit_6(db_url, tmp_path):
    """The bytes themselves, through a real process (argv decoded by Python, not by us)."""
    env = {**os.environ, "TOOLLEDGER_DB": db_url, "TOOLLEDGER_SANDBOX": str(tmp_path)}
    argv: list[str | bytes] = [
        sys.executable,
        "-m",
        "toolledger",
        "submit",
        "--scope",
        "hostile",
        "--tool-call-id",
        b"c\xff",
        "--tool",
        "write_file",
        "--args",
        WRITE,
    ]
    proc = subprocess.run(argv, env=env, capture_output=True, timeout=60)
    assert proc.returncode == 6, proc.stderr
    assert b"Traceback" not in proc.stderr and b"tool_call_id" in proc.stderr


def test_cli__a_failed_read_only_call_exits_1_and_prints_its_result(cli):
    code, out, _ = cli(
        "submit",
        "--scope",
        "hostile",
        "--tool-call-id",
        "r1",
        "--tool",
        "read_file",
        "--args",
        '{"path": "missing.txt"}',
        "--json",
    )
    assert code == 1
    assert json.loads(out)["status"] == "failed"


# ------------------------------------------------------------------ the Python API


def test_api__deep_or_huge_or_unencodable_args_raise_input_errors(ledger):
    deep: Any = []
    for _ in range(5000):
        deep = [deep]
    before = row_counts(ledger.engine)
    for args, expected in [
        ({"path": "a.txt", "content": deep}, "nested more than 64"),
        ({"path": "a.txt", "content": 10**5000}, "out of range"),
        ({"path": "a.txt", "content": "\udcff"}, "lone surrogate"),
        ({"path": "a.txt", "content": float("nan")}, "NaN"),
        ({"path": "a.txt", 1: "x"}, "keys must be strings"),
        ({"path": "a.txt", "content": {1, 2}}, "set is not a JSON value"),
    ]:
        with pytest.raises(InvalidArguments, match=expected):
            ledger.submit("hostile", "api1", "write_file", args)
    assert row_counts(ledger.engine) == before


def test_api__identifiers_and_free_text_are_checked_before_the_database(ledger):
    before = row_counts(ledger.engine)
    with pytest.raises(InvalidArguments, match="reason"):
        ledger.submit(
            "hostile",
            "api2",
            "write_file",
            {"path": "a", "content": "x"},
            approved_by="al",
            reason="a\x00b",
        )
    with pytest.raises(InvalidIdentifier, match="approver"):
        ledger.submit(
            "hostile", "api2", "write_file", {"path": "a", "content": "x"}, approved_by="al\x85"
        )
    with pytest.raises(InvalidIdentifier, match="tool_call_id"):
        ledger.approve("hostile", "c\x00", by="al")  # a NUL never reaches the driver
    with pytest.raises(InvalidIdentifier, match="execution_id"):
        ledger.resolve("e\x00", _succeeded(), by="al", evidence="seen it")
    assert row_counts(ledger.engine) == before


def _succeeded() -> Any:
    from toolledger.ledger.transitions import Status

    return Status.SUCCEEDED


# ------------------------------------------------------------------ messages


def test_message__a_forged_job_is_rejected_at_once_logged_once_without_secrets(
    db_url, tmp_path, caplog
):
    from toolledger.worker.app import create_app
    from toolledger.worker.tasks import EXECUTE

    settings = Settings.from_env(
        {"TOOLLEDGER_DB": db_url, "TOOLLEDGER_SANDBOX": str(tmp_path)},
        broker=f"embedded+sqlite:///{tmp_path / 'b.db'}",
    )
    task = create_app(settings).tasks[EXECUTE]
    ledger = Ledger(db_url)
    before = row_counts(ledger.engine)
    caplog.set_level(logging.INFO, logger="toolledger")
    for args, kwargs in [
        (("hostile", "write_file:c1", True), {}),
        (("hostile", "write_file:c1", {}), {}),
        (("hostile", "write_file:c1", 2**70), {}),
        (("hostile", "write_file:c1", 1), {"lease_token": "s3cr3t"}),
        (("hostile/..", "write_file:c1", 1), {}),
        (("hostile", "k\x00", 1), {}),
        ((), {}),
    ]:
        caplog.clear()
        assert task.run(*args, **kwargs) == "rejected"
        (record,) = caplog.records
        assert "rejected" in record.getMessage() and "s3cr3t" not in record.getMessage()
    assert row_counts(ledger.engine) == before
    ledger.close()


# ------------------------------------------------------------------ configuration


@pytest.fixture
def tool_modules(tmp_path, monkeypatch):
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "tl_raises.py").write_text("raise RuntimeError('boom')\n")
    (mods / "tl_exits.py").write_text("import sys\nsys.exit(0)\n")
    (mods / "tl_shadows.py").write_text(
        "from pydantic import BaseModel\nfrom toolledger.tools import tool\n"
        "class A(BaseModel):\n    x: int = 0\n"
        "@tool(read_only=True)\ndef write_file(args: A, ctx) -> dict:\n    return {}\n"
    )
    (mods / "tl_proxied.py").write_text(  # the MCP proxy's names are no registered tool's
        "from pydantic import BaseModel\nfrom toolledger.tools import tool\n"
        "class A(BaseModel):\n    x: int = 0\n"
        "@tool(name='mcp.write_file')\ndef w(args: A, ctx) -> dict:\n    return {}\n"
    )
    monkeypatch.syspath_prepend(str(mods))
    return mods


#: A tool of a user's whose own validator and check raise what pydantic does not make a
#: ValidationError, for arguments a model may well send (a number for a date, a name unknown).
STAMP_TOOL = """
from datetime import datetime
from typing import Any
from pydantic import BaseModel, field_validator
from toolledger.tools import tool


class When(BaseModel):
    path: str
    when: datetime

    @field_validator("when", mode="before")
    @classmethod
    def iso(cls, v: Any) -> datetime:
        return datetime.fromisoformat(v)


def known(args: When, ctx: Any) -> None:
    {"ok.txt": 1}[args.path]


@tool(check=known, sandboxed=True)
def stamp(args: When, ctx: Any) -> dict[str, Any]:
    \"\"\"Write a date.\"\"\"
    ctx.sandbox.write_atomic(ctx.scope, args.path, args.when.isoformat().encode())
    return {"path": args.path}
"""


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ('{"path": "ok.txt", "when": 5}', "invalid arguments for stamp: TypeError: fromisoformat"),
        ('{"path": "no.txt", "when": "2020-01-02"}', "stamp refused its arguments: KeyError"),
    ],
)
def test_cli__a_user_tools_validator_or_check_raising_is_exit_6_not_internal(
    cli, ledger, tool_modules, monkeypatch, args, says
):
    (tool_modules / "tl_stamp.py").write_text(STAMP_TOOL)
    monkeypatch.setenv("TOOLLEDGER_TOOLS", "tl_stamp")
    before = row_counts(ledger.engine)
    argv = ("submit", "--scope", "hostile", "--tool-call-id", "st1", "--tool", "stamp")
    code, out, err = cli(*argv, "--args", args, "--approved-by", "al")
    assert (code, out) == (6, ""), err
    assert err.startswith(f"toolledger: error: {says}") and err.count("\n") == 1, err
    assert row_counts(ledger.engine) == before


@pytest.mark.parametrize(
    ("module", "says"),
    [
        ("tl_raises", "failed to load: RuntimeError: boom"),
        ("tl_exits", "failed to load: SystemExit: 0"),
        ("tl_shadows", "a different tool named 'write_file' is already registered"),
        ("tl_proxied", "module 'tl_proxied': tool name 'mcp.write_file' is not"),
        ("tl_missing", "No module named 'tl_missing'"),
    ],
)
def test_config__a_tool_module_that_does_not_load_is_exit_2_for_submit_and_worker(
    cli, tool_modules, monkeypatch, module, says
):
    monkeypatch.setenv("TOOLLEDGER_TOOLS", module)
    for argv in (
        (
            "submit",
            "--scope",
            "hostile",
            "--tool-call-id",
            "c1",
            "--tool",
            "write_file",
            "--args",
            WRITE,
        ),
        ("worker",),
    ):
        code, _out, err = cli(*argv)
        assert code == 2 and says in err and err.count("\n") == 1, (argv, err)


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("TOOLLEDGER_DB", "postgresql://u:secret@127.0.0.1:notaport/x", "port is not a number"),
        ("TOOLLEDGER_DB", "postgresql://u:secret/x", "port is not a number"),  # no @host
        ("TOOLLEDGER_DB", "mysql://u@h/x", "scheme 'mysql'"),
        # an '@' in the password: SQLAlchemy took "secret@127.0.0.1" for the host, and every
        # error quoted it ("failed to resolve host 'secret@127.0.0.1'")
        ("TOOLLEDGER_DB", "postgresql://u:p@secret@127.0.0.1:5432/x", "percent-encoded, as %40"),
        ("TOOLLEDGER_BROKER", "sqla+postgresql://u:p@secret@127.0.0.1/x", "as %40"),
        ("TOOLLEDGER_BROKER", "redis://:secret@127.0.0.1:99999/0", "from 0 to 65535"),
        ("TOOLLEDGER_BROKER", "redis://[::1/0", "does not parse"),
        ("TOOLLEDGER_BROKER", "http://example", "scheme 'http'"),
        ("TOOLLEDGER_DB", "sqlite:////tmp/secret/ledger.db?timeout=abc", "its timeout 'abc'"),
        ("TOOLLEDGER_DB", "sqlite:////tmp/secret/ledger.db?timeout=nan", "its timeout 'nan'"),
    ],
)
def test_config__a_malformed_url_is_exit_2_and_never_echoes_its_password(
    capsys, monkeypatch, tmp_path, name, value, says
):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError):
        Settings.from_env()
    code, _out, err = run_cli(capsys, "list")
    assert code == 2 and says in err and "secret" not in err


def test_config__every_commands_help_works_whatever_the_environment_holds(capsys, monkeypatch):
    """``--help`` reads no setting: with a malformed URL in the environment every command's
    help was the settings' error (exit 2), while the command itself still is."""
    from toolledger.cli import COMMANDS

    monkeypatch.setenv("TOOLLEDGER_DB", "mysql://u:secret@h/x")
    for name in sorted(COMMANDS):
        argv = name.split() if name != "mcp" else ["mcp", "serve"]
        code, out, err = run_cli(capsys, *argv, "--help")
        assert code == 0 and "Usage:" in out and err == "", (name, err)
    # the worker's help is ours, then Celery's worker options (from an app of no settings)
    code, out, err = run_cli(capsys, "worker", "-h")
    assert code == 0 and "--log-format" in out and "--concurrency" in out, err
    code, _out, err = run_cli(capsys, "worker")
    assert code == 2 and err.count("\n") == 1 and "TOOLLEDGER_DB" in err
    code, _out, err = run_cli(capsys, "list", "--json")
    assert code == 2 and json.loads(err)["exit_code"] == 2 and "secret" not in err


def test_config__every_command_takes_json_after_its_name(capsys, monkeypatch):
    """README: "Every command takes ``--json``". ``worker`` and ``beat`` did only before their
    name (``toolledger --json beat``): after it, Celery's "No such option"."""
    import click

    from toolledger.cli import COMMANDS, load_command

    def leaves(command: click.Command, name: str) -> list[tuple[str, click.Command]]:
        if isinstance(command, click.Group):
            return [
                leaf
                for sub, child in command.commands.items()
                for leaf in leaves(child, f"{name} {sub}")
            ]
        return [(name, command)]

    for name in sorted(COMMANDS):
        for full, command in leaves(load_command(name), name):
            assert any("--json" in p.opts for p in command.params), full
    monkeypatch.setenv("TOOLLEDGER_DB", "mysql://u:secret@h/x")
    for name in ("worker", "beat"):
        code, _out, err = run_cli(capsys, name, "--json")
        assert code == 2 and json.loads(err)["exit_code"] == 2 and "secret" not in err, err


# ------------------------------------------------------------------ Hypothesis

text_or_garbage = st.one_of(
    st.text(),  # any Unicode, surrogates included
    st.binary().map(lambda b: b.decode("utf-8", "surrogateescape")),  # argv bytes
    st.sampled_from(["", " ", "-", "@", "@/nonexistent", "{}", "[]", "null", WRITE, DEEP[:80]]),
)


@FUZZ
@given(
    tcid=text_or_garbage,
    tool=st.one_of(st.just("write_file"), text_or_garbage),
    args=st.one_of(
        text_or_garbage,
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(), c, max_size=3),
            max_leaves=8,
        ).map(lambda v: json.dumps(v, allow_nan=True)),
    ),
    key=st.none() | text_or_garbage,
    reason=st.none() | text_or_garbage,
)
def test_fuzz__submit_exits_with_a_documented_code_never_a_traceback(
    cli, ledger, tcid, tool, args, key, reason
):
    before = row_counts(ledger.engine)
    extra = [
        *(("--key", key) if key is not None else ()),
        *(("--approved-by", "fuzz", "--reason", reason) if reason is not None else ()),
    ]
    code, _out, err = cli(
        "submit", "--scope", "fuzz", "--tool-call-id", tcid, "--tool", tool, "--args", args, *extra
    )
    assert code in DOCUMENTED_EXITS
    assert "internal error" not in err and "Traceback" not in err
    if code != 0:
        assert err.count("\n") == 1, err
        assert row_counts(ledger.engine) == before


json_ish = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda c: (
        st.lists(c, max_size=4)
        | st.dictionaries(st.text(), c, max_size=4)
        | st.tuples(c)
        | st.sets(st.integers(), max_size=2)
    ),
    max_leaves=12,
)


@FUZZ
@given(text=st.one_of(st.text(), st.binary()))
def test_fuzz__loads_refuses_with_an_input_error_or_returns_checked_json(text):
    try:
        value = inputs.loads(text, "fuzz")
    except InputError:
        return
    assert inputs.check_value(value, "fuzz") is value
    again = inputs.loads(json.dumps(value, ensure_ascii=False), "fuzz")
    assert again == value or value != value  # NaN cannot come back: refused


@FUZZ
@given(value=json_ish)
def test_fuzz__check_value_accepts_what_canonical_json_can_write(value):
    from toolledger.ledger.identity import canonical_json

    try:
        inputs.check_value(value, "fuzz")
    except InputError:
        return
    canonical_json(value).encode("utf-8")  # never raises on an accepted value


@FUZZ
@given(value=st.text())
def test_fuzz__identifiers_accepted_are_printable_on_one_line(value):
    try:
        inputs.check_identifier(value, "fuzz")
    except InputError:
        return
    assert value.encode("utf-8") and len(str(value).splitlines()) == 1


def test_fuzz__a_real_process_with_random_bytes_never_tracebacks(db_url, tmp_path):
    """A few raw byte strings through a real process (the in-process fuzz covers the rest)."""
    rng = __import__("random").Random(17)
    env = {**os.environ, "TOOLLEDGER_DB": db_url, "TOOLLEDGER_SANDBOX": str(tmp_path)}
    for _ in range(5):
        junk = bytes(rng.randrange(1, 256) for _ in range(rng.randrange(1, 40)))
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "toolledger",
                "submit",
                "--scope",
                "fuzz",
                b"--tool-call-id",
                junk,
                "--tool",
                "write_file",
                "--args",
                junk,
            ],
            env=env,
            capture_output=True,
            timeout=60,
        )
        assert proc.returncode in DOCUMENTED_EXITS and b"Traceback" not in proc.stderr


@pytest.mark.parametrize("attempt", [True, -1, 2**40, 1.0, "1", None])
def test_api__a_claim_with_a_forged_attempt_is_refused_before_sql(ledger, attempt):
    with pytest.raises(InvalidArguments, match="attempt must be an integer"):
        ledger.claim("hostile", "write_file:c1", attempt, worker_id="w")
