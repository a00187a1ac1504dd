"""``toolledger``: the command line users and their scripts drive (DESIGN §9).

One module per group of commands; every command is registered here, in ``COMMANDS``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

import click
import sqlalchemy as sa

from toolledger.cli import admin, calls, harness, mcp, recovery, run
from toolledger.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    Context,
    exit_code_of,
    fail,
)
from toolledger.config import ConfigError, Settings
from toolledger.ledger.db import SchemaError
from toolledger.ledger.errors import LedgerError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--db", envvar="TOOLLEDGER_DB", help="Ledger URL [env TOOLLEDGER_DB].")
@click.option("--broker", envvar="TOOLLEDGER_BROKER", help="Broker URL [env TOOLLEDGER_BROKER].")
@click.option(
    "--sandbox", envvar="TOOLLEDGER_SANDBOX", help="Sandbox root [env TOOLLEDGER_SANDBOX]."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.version_option(package_name="toolledger")
@click.pass_context
def cli(
    ctx: click.Context,
    db: str | None,
    broker: str | None,
    sandbox: str | None,
    as_json: bool,
) -> None:
    """Run AI agents' side-effecting tool calls at most once, through any crash."""
    settings = Settings.from_env(db=db, broker=broker, sandbox=Path(sandbox) if sandbox else None)
    ctx.obj = Context(settings, json=as_json)
    ctx.call_on_close(ctx.obj.close)


# ------------------------------------------------------------------------------ db


#: Every command, in the order ``--help`` lists them.
COMMANDS: list[click.Command] = [
    calls.submit,
    calls.approve,
    calls.reject,
    calls.show,
    calls.events,
    calls.list_,
    calls.wait,
    run.execute,
    run.worker,
    run.beat,
    recovery.sweep,
    recovery.resolve,
    recovery.retry,
    recovery.repair,
    admin.db,
    admin.verify,
    admin.tools,
    mcp.mcp,
    harness.demo,
    harness.chaos,
    harness.bench,
]
for _command in COMMANDS:
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> NoReturn:
    """Console entry point: run a command, map every error to one line and an exit code."""
    args = sys.argv[1:] if argv is None else argv
    as_json = "--json" in args
    try:
        rv = cli.main(args=args, prog_name="toolledger", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        fail("aborted", 130, as_json)
    except CliError as exc:
        fail(exc.message, exc.code, as_json)
    except click.UsageError as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx else ""
        fail(exc.format_message() + hint, EXIT_USAGE, as_json)
    except click.ClickException as exc:
        fail(exc.format_message(), exc.exit_code, as_json)
    except (LedgerError, ConfigError, SchemaError) as exc:
        fail(str(exc), exit_code_of(exc), as_json)
    except sa.exc.OperationalError as exc:
        fail(f"database unavailable: {str(exc.orig).strip()}", EXIT_FAILURE, as_json)
    except sa.exc.SQLAlchemyError as exc:
        if os.environ.get("TOOLLEDGER_DEBUG"):
            raise
        fail(f"database error: {str(getattr(exc, 'orig', exc)).strip()}", EXIT_FAILURE, as_json)
    except OSError as exc:
        fail(f"{exc.strerror or exc}: {exc.filename or ''}".strip(": "), EXIT_FAILURE, as_json)
    except Exception as exc:  # the promise is: never a traceback
        if os.environ.get("TOOLLEDGER_DEBUG"):
            raise
        fail(f"internal error: {type(exc).__name__}: {exc}", EXIT_FAILURE, as_json)
    sys.exit(rv if isinstance(rv, int) else EXIT_OK)
