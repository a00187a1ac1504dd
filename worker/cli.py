"""``toolledger``: the command line users and their scripts drive (DESIGN §9).

Exit codes: 0 ok, 1 failure (verify found differences, a service is unreachable), 2 usage,
3 conflict, 4 not found, 5 state does not allow it, 6 input refused. Errors are one line on
stderr (a JSON object with ``error`` under ``--json``), never a traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

import click
import sqlalchemy as sa

from ledger.db import SchemaError, ensure_schema
from ledger.errors import ConflictError, InputError, LedgerError, NotFound, StateError
from ledger.identity import check_scope, check_text_id
from ledger.ledger import Ledger
from ledger.transitions import parse_status
from worker.config import ConfigError, Settings
from worker.submit import Submitter

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
EXIT_CONFLICT, EXIT_NOT_FOUND, EXIT_STATE, EXIT_INPUT = 3, 4, 5, 6

#: Domain errors and the exit code each one means; the first match wins.
EXIT_CODES: list[tuple[type[BaseException], int]] = [
    (ConflictError, EXIT_CONFLICT),
    (NotFound, EXIT_NOT_FOUND),
    (StateError, EXIT_STATE),
    (InputError, EXIT_INPUT),
    (ConfigError, EXIT_USAGE),
    (SchemaError, EXIT_FAILURE),
]


class CliError(click.ClickException):
    """An error with an exit code, raised by commands for conditions outside the ledger."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Context:
    """What every command gets: settings and, lazily, the ledger."""

    settings: Settings
    json: bool = False

    @cached_property
    def ledger(self) -> Ledger:
        """The ledger, its schema checked (and created, on the embedded default)."""
        ledger = self.unchecked_ledger
        ensure_schema(ledger.engine)
        return ledger

    @cached_property
    def unchecked_ledger(self) -> Ledger:
        # Lock waits and idle transactions bounded: a human's command frozen mid-transaction
        # (a laptop put to sleep) must not hold a call's row for longer than a worker would.
        return Ledger(
            self.settings.db,
            max_args_bytes=self.settings.max_args_bytes,
            timeout=self.settings.db_timeout,
            statement_timeout=False,
        )

    @cached_property
    def submitter(self) -> Submitter:
        return Submitter(self.settings, ledger=lambda: self.ledger)

    def close(self) -> None:
        if "submitter" in self.__dict__:
            self.submitter.close()
        if "unchecked_ledger" in self.__dict__:
            self.unchecked_ledger.close()

    def emit(self, data: Any, human: Callable[[Any], str] | None = None) -> None:
        if self.json or human is None:
            click.echo(json.dumps(data, ensure_ascii=False, indent=2, default=str))
        else:
            click.echo(human(data))


def _set_json(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.find_object(Context).json = True  # type: ignore[union-attr]


def json_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--json`` on every command as well as before it."""
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        expose_value=False,
        callback=_set_json,
        help="Machine-readable output (and errors) as JSON.",
    )(f)


pass_ctx = click.make_pass_decorator(Context)


def parse_json_object(raw: str, what: str) -> dict[str, Any]:
    """JSON from the command line (or ``@file``, ``-`` for stdin): an object, no NaN."""
    if raw == "-":
        raw = sys.stdin.read()
    elif raw.startswith("@"):
        try:
            raw = Path(raw[1:]).read_text(encoding="utf-8")
        except OSError as exc:
            raise CliError(
                f"cannot read {what} from {raw[1:]}: {exc.strerror}", EXIT_INPUT
            ) from None

    def _refuse(name: str) -> NoReturn:
        raise CliError(f"{what} is not valid JSON: {name} is not allowed", EXIT_INPUT)

    try:
        value = json.loads(raw, parse_constant=_refuse)
    except json.JSONDecodeError as exc:
        raise CliError(f"{what} is not valid JSON: {exc}", EXIT_INPUT) from None
    if not isinstance(value, dict):
        raise CliError(f"{what} must be a JSON object, not {type(value).__name__}", EXIT_INPUT)
    return value


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


@cli.group()
def db() -> None:
    """The ledger's schema."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
@json_option
@pass_ctx
def db_upgrade(c: Context, revision: str) -> None:
    """Create or migrate the schema (Alembic)."""
    from ledger import db as ledger_db

    ledger_db.upgrade(c.unchecked_ledger.engine, revision)
    current = ledger_db.current_revision(c.unchecked_ledger.engine)
    c.emit({"revision": current}, lambda d: f"schema at revision {d['revision']}")


@db.command("downgrade")
@click.option("--revision", default="base", show_default=True)
@json_option
@pass_ctx
def db_downgrade(c: Context, revision: str) -> None:
    """Migrate the schema down (``base`` drops every table)."""
    from ledger import db as ledger_db

    ledger_db.downgrade(c.unchecked_ledger.engine, revision)
    current = ledger_db.current_revision(c.unchecked_ledger.engine)
    c.emit({"revision": current}, lambda d: f"schema at revision {d['revision']}")


# ------------------------------------------------------------------------------ calls


def _check_scope(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    return None if value is None else check_scope(value)


def _check_call_id(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    return check_text_id(value, "tool_call_id", 256)


def call_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option(
        "--tool-call-id",
        required=True,
        callback=_check_call_id,
        help="The id the model gave the call.",
    )(f)
    return click.option(
        "--scope", required=True, callback=_check_scope, help="Tenant / agent run owning the call."
    )(f)


@cli.command()
@call_options
@click.option("--tool", required=True, help="Tool name.")
@click.option("--args", "raw_args", required=True, help="Arguments: JSON object, @file or -.")
@click.option("--key", help="Idempotency key [default: TOOL:TOOL_CALL_ID].")
@click.option("--approved-by", help="Approve at once, in this person's name.")
@click.option("--reason", help="Why it was approved.")
@json_option
@pass_ctx
def submit(
    c: Context,
    scope: str,
    tool_call_id: str,
    tool: str,
    raw_args: str,
    key: str | None,
    approved_by: str | None,
    reason: str | None,
) -> None:
    """Record a call; approved at once with --approved-by, else pending_approval."""
    args = parse_json_object(raw_args, "--args")
    call = c.submitter.prepare(scope, tool_call_id, tool, args, key)  # before any write
    out = c.submitter.submit(call, approved_by=approved_by, reason=reason)
    c.emit(out, _human_submit)


def _human_submit(d: dict[str, Any]) -> str:
    call = f"{d['scope']}/{d['tool_call_id']}"
    line = f"{d['outcome']}: {call} -> {d['idempotency_key']} [{d['status']}]"
    if d.get("enqueue_error"):  # recorded and approved; the sweep will publish it
        line += f"\nwarning: not enqueued ({d['enqueue_error']}); the sweep will re-enqueue it"
    if "result" in d:
        line += "\n" + json.dumps(d["result"], ensure_ascii=False, indent=2)
    return line


def _decision(name: str, approve: bool) -> click.Command:
    @call_options
    @click.option("--by", required=True, help="Who decided.")
    @click.option("--reason", help="Why.")
    @json_option
    @pass_ctx
    def command(c: Context, scope: str, tool_call_id: str, by: str, reason: str | None) -> None:
        out = c.submitter.decide(scope, tool_call_id, by, reason, approve=approve)
        out["outcome"] = "decided"
        c.emit(out, _human_submit)

    command.__doc__ = f"The human decision: {name} a pending call."
    return cli.command(name)(command)


approve = _decision("approve", approve=True)
reject = _decision("reject", approve=False)


@cli.command()
@call_options
@json_option
@pass_ctx
def show(c: Context, scope: str, tool_call_id: str) -> None:
    """One call: its action, every attempt and the receipt the model would get."""
    view = c.ledger.get(scope, tool_call_id)
    try:
        receipt = c.ledger.receipt(scope, tool_call_id)
    except StateError:
        receipt = None
    data = view.to_json(receipt)
    if view.operation.review:  # both versions, side by side, from the flag's event
        flags = [e for e in c.ledger.events(scope, tool_call_id) if e.kind == "flagged"]
        data["review_detail"] = flags[-1].detail if flags else None
    c.emit(data, _human_show)


def _human_show(d: dict[str, Any]) -> str:
    flag = f"  REVIEW: {d['review']}" if d.get("review") else ""
    lines = [
        f"{d['scope']}/{d['tool_call_id']}  {d['tool']}  [{d['status']}]{flag}",
        f"  key     {d['idempotency_key']}",
        f"  sha256  {d['args_sha256']}",
        f"  args    {json.dumps(d['args'], ensure_ascii=False)[:200]}",
    ]
    for e in d["executions"]:
        mark = " (reconciled)" if e["reconciled"] else ""
        lines.append(f"  attempt {e['attempt']}  {e['execution_id']}  {e['status']}{mark}")
        if e["result"] is not None:
            lines.append(f"    result {json.dumps(e['result'], ensure_ascii=False)[:200]}")
    if d["receipt"] is not None:
        lines.append(f"  receipt {json.dumps(d['receipt'], ensure_ascii=False)[:300]}")
    if d.get("review_detail"):
        lines.append(f"  review  {json.dumps(d['review_detail'], ensure_ascii=False)[:600]}")
    return "\n".join(lines)


@cli.command()
@call_options
@json_option
@pass_ctx
def events(c: Context, scope: str, tool_call_id: str) -> None:
    """The call's event history, in order."""
    history = c.ledger.events(scope, tool_call_id)
    key = history[0].idempotency_key if history else None
    c.emit(
        {
            "scope": scope,
            "tool_call_id": tool_call_id,
            "idempotency_key": key,
            "events": [e.to_json() for e in history],
        },
        lambda d: "\n".join(
            f"{e['seq']:>6}  {e['at']}  {e['kind']:<16} {e['actor']:<20} "
            f"{(e['execution_id'] or '-'):<36}  {json.dumps(e['detail'], ensure_ascii=False)[:120]}"
            for e in d["events"]
        ),
    )


@cli.command("list")
@click.option("--status", help="Only calls in this status (e.g. unknown: the humans' inbox).")
@click.option(
    "--review",
    is_flag=True,
    help="Only calls flagged for a human's review (a contradiction, or two attempts ran).",
)
@click.option("--scope", callback=_check_scope, help="Only this scope.")
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=1000,
    show_default=True,
    help="At most this many rows, oldest first; 0 for all.",
)
@json_option
@pass_ctx
def list_(c: Context, status: str | None, review: bool, scope: str | None, limit: int) -> None:
    """Calls from current state (never from the history)."""
    wanted = parse_status(status) if status else None
    rows = c.ledger.list_calls(status=wanted, scope=scope, limit=limit, review=review)
    c.emit({"count": len(rows), "calls": [r.to_json() for r in rows]}, _human_list)


def _human_list(d: dict[str, Any]) -> str:
    calls = d["calls"]
    w_scope = max([5, *(len(r["scope"]) for r in calls)])
    w_call = max([12, *(len(str(r["tool_call_id"])) for r in calls)])
    lines = [
        f"{'scope':<{w_scope}} {'tool_call_id':<{w_call}} {'tool':<14} {'status':<17} "
        "attempt execution_id"
    ]
    for r in calls:
        mark = " (reconciled)" if r["reconciled"] else ""
        if r.get("review"):
            mark += f" [review: {r['review']}]"
        lines.append(
            f"{r['scope']:<{w_scope}} {r['tool_call_id']!s:<{w_call}} {r['tool']:<14} "
            f"{r['status']:<17} {r['attempt']:>7} {r['execution_id'] or '-'}{mark}"
        )
    return "\n".join(lines)


@cli.command()
@json_option
@pass_ctx
def verify(c: Context) -> int:
    """Rebuild current state from the events alone; exit 1 on any difference."""
    report = c.ledger.verify()
    c.emit(
        report.to_json(),
        lambda d: (
            f"verify: {'ok' if d['ok'] else 'DIFFERENCES'} — {d['operations']} operations, "
            f"{d['executions']} executions, {d['events']} events, "
            f"{d['flagged']} flagged for review"
            + "".join(
                f"\n  {x['table']} {x['scope']}/{x['idempotency_key']} {x['field']}: "
                f"stored {x['stored']!r}, rebuilt {x['rebuilt']!r}"
                for x in d["differences"]
            )
        ),
    )
    return EXIT_OK if report.ok else EXIT_FAILURE


# ------------------------------------------------------------------------------ main


def _fail(message: str, code: int, as_json: bool) -> NoReturn:
    message = " ".join(message.split())  # one line, whatever the source
    if as_json:
        click.echo(json.dumps({"error": message, "exit_code": code}, ensure_ascii=False), err=True)
    else:
        click.echo(f"toolledger: error: {message}", err=True)
    sys.exit(code)


def _exit_code(exc: BaseException) -> int:
    return next((code for cls, code in EXIT_CODES if isinstance(exc, cls)), EXIT_FAILURE)


def _load_commands() -> None:
    """The commands that live with their parts register themselves on ``cli``."""
    import worker.cli_run  # noqa: F401

    for module in ("recovery.cli", "bench.cli"):
        with contextlib.suppress(ModuleNotFoundError):
            importlib.import_module(module)


def main(argv: list[str] | None = None) -> NoReturn:
    """Console entry point: run a command, map every error to one line and an exit code."""
    _load_commands()
    args = sys.argv[1:] if argv is None else argv
    as_json = "--json" in args
    try:
        rv = cli.main(args=args, prog_name="toolledger", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        _fail("aborted", 130, as_json)
    except CliError as exc:
        _fail(exc.message, exc.code, as_json)
    except click.UsageError as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx else ""
        _fail(exc.format_message() + hint, EXIT_USAGE, as_json)
    except click.ClickException as exc:
        _fail(exc.format_message(), exc.exit_code, as_json)
    except (LedgerError, ConfigError, SchemaError) as exc:
        _fail(str(exc), _exit_code(exc), as_json)
    except sa.exc.OperationalError as exc:
        _fail(f"database unavailable: {str(exc.orig).strip()}", EXIT_FAILURE, as_json)
    except sa.exc.SQLAlchemyError as exc:
        if os.environ.get("TOOLLEDGER_DEBUG"):
            raise
        _fail(f"database error: {str(getattr(exc, 'orig', exc)).strip()}", EXIT_FAILURE, as_json)
    except OSError as exc:
        _fail(f"{exc.strerror or exc}: {exc.filename or ''}".strip(": "), EXIT_FAILURE, as_json)
    except Exception as exc:  # the promise is: never a traceback
        if os.environ.get("TOOLLEDGER_DEBUG"):
            raise
        _fail(f"internal error: {type(exc).__name__}: {exc}", EXIT_FAILURE, as_json)
    sys.exit(rv if isinstance(rv, int) else EXIT_OK)
