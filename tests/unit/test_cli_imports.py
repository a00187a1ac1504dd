"""The CLI starts light: each command imports what it uses and nothing else.

Every case runs the real ``main`` in a fresh interpreter and reads ``sys.modules`` as the
process exits, so an import that sneaks back (a module-level ``import celery`` in a command
module, Alembic in the schema check) fails here. The check is shown failing on a process made
to load Celery. Never a wall-clock assertion: ``toolledger bench`` measures the time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from toolledger.cli import COMMANDS, cli, load_command
from toolledger.ledger import db

#: What no reading command and no --help may load: the broker, migrations, the worker's side.
HEAVY = (
    "celery",
    "kombu",
    "billiard",
    "alembic",
    "mako",
    "toolledger.worker",
    "toolledger.recovery",
    "toolledger.harness",
    "toolledger.server",
    "mcp",
)
#: What no reading command may load either: the ORM (the schema is Core tables), and on the
#: embedded ledger the Postgres driver.
READ_HEAVY = (*HEAVY, "sqlalchemy.orm", "psycopg")
#: What ``show`` and ``events`` must not load either on a ledger at head: they read on the
#: bare driver (``ledger.lightreads``), and the settings are read without pydantic.
SHOW_HEAVY = (*READ_HEAVY, "sqlalchemy", "pydantic", "pydantic_settings")
#: What ``toolledger --help`` must not load either: it needs click and the table, nothing more.
HELP_HEAVY = (*HEAVY, "sqlalchemy", "pydantic", "pydantic_settings", "toolledger.ledger")
#: What a submit that enqueues nothing (the call waits for approval) must not load: the
#: submitter, but not the broker's client nor the worker's app.
SUBMIT_HEAVY = (
    *(m for m in READ_HEAVY if m != "toolledger.worker"),
    "toolledger.worker.app",
    "toolledger.worker.tasks",
    "toolledger.worker.pipeline",
)

PROBE = """
import atexit, json, sys
atexit.register(lambda: print("MODULES=" + json.dumps(sorted(sys.modules))))
{prelude}
from toolledger.cli import main
main({argv!r})
"""


def loaded(argv: list[str], home: Path, prelude: str = "") -> tuple[int, set[str]]:
    """Run ``toolledger ARGV`` in a fresh interpreter: its exit code and every module loaded."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLLEDGER_")}
    env["TOOLLEDGER_HOME"] = str(home)
    code = PROBE.format(prelude=prelude, argv=argv)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("MODULES=")]
    assert lines, done.stderr
    return done.returncode, set(json.loads(lines[-1].removeprefix("MODULES=")))


def among(modules: set[str], names: tuple[str, ...]) -> set[str]:
    """Which of ``names`` (packages or modules) were loaded, themselves or a submodule."""
    return {n for n in names if any(m == n or m.startswith(n + ".") for m in modules)}


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An embedded ledger already at head (creating one runs Alembic, on purpose)."""
    path = tmp_path_factory.mktemp("home")
    engine = db.create_engine(f"sqlite:///{path / 'ledger.db'}")
    db.upgrade(engine)
    engine.dispose()
    return path


CALL = ["--scope", "s", "--tool-call-id", "c"]
#: A call recorded and left pending approval: nothing to enqueue (each run replays the first).
SUBMIT_PENDING = [
    "submit",
    *("--scope", "s", "--tool-call-id", "pending", "--tool", "write_file"),
    *("--args", '{"path": "pending.txt", "content": "x"}'),
]


@pytest.mark.parametrize(
    ("argv", "exit_code", "forbidden", "prelude", "caught"),
    [
        pytest.param(["--help"], 0, HELP_HEAVY, "", set(), id="help"),
        pytest.param(["show", *CALL], 4, SHOW_HEAVY, "", set(), id="show"),
        pytest.param(["list"], 0, READ_HEAVY, "", set(), id="list"),
        pytest.param(["events", *CALL], 4, SHOW_HEAVY, "", set(), id="events"),
        pytest.param(["submit", "--help"], 0, HEAVY, "", set(), id="submit-help"),
        pytest.param(["--json", "show", *CALL], 4, SHOW_HEAVY, "", set(), id="show-json"),
        pytest.param(SUBMIT_PENDING, 0, SUBMIT_HEAVY, "", set(), id="submit-pending"),
        # the check itself, made to fail: a process that loaded Celery must be caught
        pytest.param(["show", *CALL], 4, HEAVY, "import celery", {"celery"}, id="crafted-celery"),
        pytest.param(
            ["--help"], 0, HELP_HEAVY, "import sqlalchemy", {"sqlalchemy"}, id="crafted-sa"
        ),
        pytest.param(
            ["show", *CALL],
            4,
            READ_HEAVY,
            "import sqlalchemy.orm",
            {"sqlalchemy.orm"},
            id="crafted-orm",
        ),
        pytest.param(["list"], 0, READ_HEAVY, "import psycopg", {"psycopg"}, id="crafted-psycopg"),
        pytest.param(
            ["events", *CALL], 4, SHOW_HEAVY, "import pydantic", {"pydantic"}, id="crafted-pydantic"
        ),
        pytest.param(
            SUBMIT_PENDING, 0, SUBMIT_HEAVY, "import kombu", {"kombu"}, id="crafted-submit-kombu"
        ),
    ],
)
def test_cli__loads_only_what_the_command_uses(
    home: Path,
    argv: list[str],
    exit_code: int,
    forbidden: tuple[str, ...],
    prelude: str,
    caught: set[str],
) -> None:
    code, modules = loaded(argv, home, prelude)
    assert code == exit_code
    assert among(modules, forbidden) == caught


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("prelude", "caught"), [("", set()), ("import psycopg", {"psycopg"})], ids=["light", "crafted"]
)
def test_cli__show_on_postgres_loads_no_driver_module(
    home: Path, pg_url: str, prelude: str, caught: set[str]
) -> None:
    """On Postgres too ``show`` and ``events`` read on libpq itself (``ledger.pq``): importing
    psycopg was most of their time."""
    for command in ("show", "events"):
        code, modules = loaded(["--db", pg_url, command, *CALL], home, prelude)
        assert code == 4
        assert "toolledger.ledger.pq" in modules
        assert among(modules, SHOW_HEAVY) == caught


def test_cli__help_imports_no_command_module(home: Path) -> None:
    _, modules = loaded(["--help"], home)
    assert {m for m in modules if m.startswith("toolledger.cli.")} == {"toolledger.cli.common"}


# ------------------------------------------------------------------------------ the table


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_commands__table_help_is_the_commands_own(name: str) -> None:
    command = load_command(name)
    first_paragraph = " ".join((command.help or "").split("\n\n")[0].split())
    assert command.name == name
    assert COMMANDS[name][1] == first_paragraph


def test_commands__help_shows_no_rst_markup() -> None:
    """`db downgrade --help` showed ``base`` with its RST backticks (a cold review): the help
    of every command and subcommand is plain text."""
    commands = [load_command(name) for name in sorted(COMMANDS)]
    for command in commands:
        if isinstance(command, click.Group):
            commands.extend(command.commands.values())
    for command in commands:
        ctx = click.Context(command, info_name=command.name)
        assert "``" not in command.get_help(ctx), command.name


def test_commands__help_lists_what_click_would(capsys: pytest.CaptureFixture[str]) -> None:
    """The listing written from the table is click's own, at any width."""
    for width in (50, 80, 200):
        ctx = click.Context(
            cli, info_name="toolledger", terminal_width=width, max_content_width=width
        )
        listing = cli.get_help(ctx).splitlines()
        widest = max(map(len, COMMANDS))
        limit = ctx.make_formatter().width - 6 - widest
        for name in COMMANDS:
            help_ = load_command(name).get_short_help_str(limit)
            assert f"  {name:<{widest}}  {help_}" in listing


# ------------------------------------------------------------------------------ the schema


def test_files_head__is_alembics_head() -> None:
    assert db.files_head() is not None
    assert db.files_head() == db.head_revision()


def test_files_head__leaves_a_branch_to_alembic(tmp_path: Path) -> None:
    # Given a straight line, then a second revision revising the same parent
    (tmp_path / "a.py").write_text('revision = "a"\ndown_revision = None\n')
    (tmp_path / "b.py").write_text("revision: str = 'b'\ndown_revision: str | None = 'a'\n")
    assert db.files_head(tmp_path) == "b"
    (tmp_path / "c.py").write_text('revision = "c"\ndown_revision = "a"\n')
    # Then the text reading gives up (None), and ensure_schema asks Alembic
    assert db.files_head(tmp_path) is None
    (tmp_path / "c.py").write_text('revision = "c"\ndown_revision = ("a", "b")\n')
    assert db.files_head(tmp_path) is None


# ------------------------------------------------------------------------------ bare groups


@pytest.mark.parametrize("argv", [[], ["db"], ["sandbox"]])
def test_bare_group__prints_its_help_as_click_lays_it_out(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``toolledger`` alone printed its whole help squeezed into one ``error:`` line."""
    from toolledger.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.startswith(f"Usage: toolledger {' '.join(argv)}".rstrip() + " [OPTIONS] COMMAND")
    assert "\nCommands:\n" in err
    assert "error:" not in err


def test_bare_group__under_json_is_one_error_object(capsys: pytest.CaptureFixture[str]) -> None:
    from toolledger.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--json", "db"])
    lines = capsys.readouterr().err.splitlines()
    assert exited.value.code == 2
    assert [json.loads(line) for line in lines] == [
        {"error": "missing command (see 'toolledger db --help')", "exit_code": 2}
    ]
