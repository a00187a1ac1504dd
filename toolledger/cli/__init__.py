"""``toolledger``: the command line users and their scripts drive (DESIGN §9).

One module per group of commands; every command is registered here, in ``COMMANDS``, and
its module is imported only when that command runs: ``toolledger --help`` loads no command,
``show`` / ``list`` / ``events`` load the ledger's reads but neither Celery nor Alembic.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

from toolledger.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    Context,
    exit_code_of,
    fail,
)

#: Every command: its name -> where it is defined ("module:attribute") and the first paragraph
#: of its help, which ``toolledger --help`` shows without importing the module (a test holds
#: each to the command's own docstring).
COMMANDS: dict[str, tuple[str, str]] = {
    "submit": (
        "toolledger.cli.calls:submit",
        "Record a call; approved at once with --approved-by, else pending_approval.",
    ),
    "approve": ("toolledger.cli.calls:approve", "The human decision: approve a pending call."),
    "reject": ("toolledger.cli.calls:reject", "The human decision: reject a pending call."),
    "show": (
        "toolledger.cli.calls:show",
        "One call: its action, every attempt and the receipt the model would get.",
    ),
    "events": ("toolledger.cli.calls:events", "The call's event history, in order."),
    "list": ("toolledger.cli.calls:list_", "Calls from current state (never from the history)."),
    "wait": (
        "toolledger.cli.calls:wait",
        "Wait for the call's receipt (woken by the database) and print it.",
    ),
    "execute": (
        "toolledger.cli.run:execute",
        "Run an approved call now, in this process, through the same pipeline as a worker.",
    ),
    "worker": (
        "toolledger.cli.run:worker",
        "Run a Celery worker with toolledger's app and defaults.",
    ),
    "beat": (
        "toolledger.cli.run:beat",
        "Run the one beat that schedules the sweep on its own queue (Celery beat options pass "
        "through). Run exactly one; two are safe, only wasteful.",
    ),
    "sweep": (
        "toolledger.cli.recovery:sweep",
        "One recovery pass: expired running -> unknown, reconcile, re-enqueue lost work.",
    ),
    "resolve": (
        "toolledger.cli.recovery:resolve",
        "A human's resolution of an unknown execution, or review of a flagged call.",
    ),
    "retry": (
        "toolledger.cli.recovery:retry",
        "A new attempt under the same key (unknown or failed calls), authorised by a person.",
    ),
    "repair": (
        "toolledger.cli.recovery:repair",
        "Insert the missing tool results into a transcript, by replay (never re-execution).",
    ),
    "db": ("toolledger.cli.admin:db", "The ledger's schema."),
    "sandbox": ("toolledger.cli.admin:sandbox", "The sandbox's own state (under .toolledger/)."),
    "verify": (
        "toolledger.cli.admin:verify",
        "Rebuild current state from the events alone; exit 1 on any difference.",
    ),
    "tools": (
        "toolledger.cli.admin:tools",
        "The registered tools: their JSON schemas and their contracts.",
    ),
    "serve": (
        "toolledger.cli.serve:serve",
        "Serve the JSON API, the console and /metrics (tokens: TOOLLEDGER_API_TOKENS).",
    ),
    "mcp": (
        "toolledger.cli.mcp:mcp",
        "Serve the tools over MCP, or put the ledger in front of another MCP server.",
    ),
    "demo": (
        "toolledger.cli.harness:demo",
        "The showcase: an agent session, a worker crash, recovery — on the embedded default.",
    ),
    "chaos": (
        "toolledger.cli.harness:chaos",
        "Kill, freeze, partition and crash the world mid-task; check nothing was duplicated, "
        "lost, stuck, landed after its revocation or hidden from the model.",
    ),
    "bench": (
        "toolledger.cli.harness:bench",
        "Benchmarks, every figure a median of interleaved rounds; JSON, Markdown and a PNG.",
    ),
}


#: Commands that run until stopped: their spans are exported as the SDK does (every other
#: command is one-shot: ``tracing.for_one_shot``).
LONG_RUNNING = frozenset({"worker", "beat", "serve", "mcp", "demo", "chaos", "bench"})


def load_command(name: str) -> click.Command:
    """The command ``name`` of ``COMMANDS``, its module imported now."""
    module, _, attribute = COMMANDS[name][0].partition(":")
    command: click.Command = getattr(importlib.import_module(module), attribute)
    return once_each(command)


def once_each(command: click.Command) -> click.Command:
    """``command`` (and its subcommands) refusing an option that takes one value given twice,
    exit 2: click took the last in silence, and ``submit --scope a … --scope b`` recorded the
    call in ``b`` (a cold review of the CLI). Flags, counts and ``multiple`` options repeat."""
    if not getattr(command, "_once_each", False):
        make_parser = command.make_parser

        def strict(ctx: click.Context) -> Any:
            parser = make_parser(ctx)
            parse = parser.parse_args

            def parse_once(args: list[str]) -> Any:
                opts, rest, order = parse(args=args)
                _refuse_repeated(ctx, order)
                return opts, rest, order

            parser.parse_args = parse_once  # type: ignore[method-assign]
            return parser

        command.make_parser = strict  # type: ignore[method-assign]
        command._once_each = True  # type: ignore[attr-defined]
    for sub in getattr(command, "commands", {}).values():
        once_each(sub)
    return command


def _refuse_repeated(ctx: click.Context, order: list[click.Parameter]) -> None:
    seen: set[str | None] = set()
    for param in order:  # one entry per time it was given, in the order given
        if isinstance(param, click.Option) and not (param.is_flag or param.multiple or param.count):
            if param.name in seen:
                name = max(param.opts, key=len)
                raise click.UsageError(f"{name} given more than once: give it once", ctx)
            seen.add(param.name)


class Interrupted(Exception):
    """A Ctrl-C while a command ran (click's own Abort printed an empty line first, before
    the one line of the error: a cold review)."""


class LazyGroup(click.Group):
    """A group whose commands come from ``COMMANDS``, each imported when it is resolved."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted from None

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        """Click's, but a Ctrl-C while the global options are parsed is ``Interrupted``: out
        of click's own handler it was an empty line before ``aborted`` (a cold review, with a
        real SIGINT 0.09 s into ``show``)."""
        try:
            return super().make_context(info_name, args, parent, **extra)
        except KeyboardInterrupt:
            raise Interrupted from None

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name, command, rest = super().resolve_command(ctx, args)
        if name is not None and name not in LONG_RUNNING:
            from toolledger.observability import tracing

            tracing.for_one_shot()  # its spans exported at its exit in bounded time
        return name, command, rest

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return load_command(cmd_name) if cmd_name in COMMANDS else None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Click's own listing, written from the table: no command's module is imported."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names))
        stubs = [click.Command(name, help=COMMANDS[name][1]) for name in names]
        rows = [(stub.name or "", stub.get_short_help_str(limit)) for stub in stubs]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _not_empty(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An empty ``--db``/``--broker``/``--sandbox`` on the command line is refused (exit 2): it
    was taken for "not given", so ``--db "$URL"`` with URL unset wrote to the default ledger
    (a cold review). An empty variable is unset, as ever."""
    from click.core import ParameterSource

    if value is not None and not value.strip():
        if ctx.get_parameter_source(param.name or "") is ParameterSource.COMMANDLINE:
            raise click.BadParameter("must not be empty (leave the option out for the default)")
        return None
    return value


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--db", envvar="TOOLLEDGER_DB", callback=_not_empty, help="Ledger URL [env TOOLLEDGER_DB]."
)
@click.option(
    "--broker",
    envvar="TOOLLEDGER_BROKER",
    callback=_not_empty,
    help="Broker URL [env TOOLLEDGER_BROKER].",
)
@click.option(
    "--sandbox",
    envvar="TOOLLEDGER_SANDBOX",
    callback=_not_empty,
    help="Sandbox root [env TOOLLEDGER_SANDBOX].",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=lambda ctx, _param, value: _print_version(ctx, value),
    help="Show the version and exit (JSON with --json).",
)
@click.pass_context
def cli(
    ctx: click.Context,
    db: str | None,
    broker: str | None,
    sandbox: str | None,
    as_json: bool,
) -> None:
    """Run AI agents' side-effecting tool calls at most once, through any crash."""
    from toolledger.cli.common import SETTINGS_ERROR
    from toolledger.config import ConfigError, Settings

    try:
        settings = Settings.from_env(
            db=db, broker=broker, sandbox=Path(sandbox) if sandbox else None
        )
    except ConfigError as exc:  # raised when a command needs settings, not for its --help
        ctx.meta[SETTINGS_ERROR] = _as_given(ctx, exc)
        return
    _remember_given(ctx)
    ctx.obj = Context(settings, json=as_json)
    ctx.call_on_close(_closing(ctx.obj))


def _closing(obj: Context) -> Callable[[], None]:
    """``obj.close``, a Ctrl-C in it ``Interrupted``: it runs when click's context closes,
    outside ``LazyGroup.invoke``, and click's handler put an empty line before ``aborted``."""

    def close() -> None:
        try:
            obj.close()
        except KeyboardInterrupt:
            raise Interrupted from None

    return close


once_each(cli)  # --db given twice, as a command's option


def _print_version(ctx: click.Context, wanted: bool) -> None:
    """``--version``: click's line, or ``{"version": …}`` under ``--json``, which is machine
    output on every command (it printed the line: a cold review). ``--json`` may come after
    ``--version``, which is eager: ``main`` has seen the whole command line."""
    if not wanted:  # every run passes here: nothing imported for it
        return
    import json
    from importlib.metadata import version

    number = version("toolledger")
    click.echo(json.dumps({"version": number}) if _JSON[0] else f"toolledger, version {number}")
    ctx.exit()


#: Whether this run's command line holds ``--json`` (set by ``main``).
_JSON = [False]


#: The settings this run was given as options (``--db``…), not by the environment: an error
#: the database gives later (a bad ``sslmode``) is named after what the user typed.
_ON_LINE: set[str] = set()


def _as_given(ctx: click.Context, exc: Exception) -> Exception:
    """A setting's error named as the user gave it: ``--db: …`` for a URL typed on the command
    line, which was said as ``TOOLLEDGER_DB: …`` (a cold review), the variable's name kept for
    one read from the environment."""
    _remember_given(ctx)
    text = _named_as_given(str(exc))
    return exc if text == str(exc) else type(exc)(text)


def _remember_given(ctx: click.Context) -> None:
    from click.core import ParameterSource

    for option in ("db", "broker", "sandbox"):
        if ctx.get_parameter_source(option) is ParameterSource.COMMANDLINE:
            _ON_LINE.add(option)


def _named_as_given(text: str) -> str:
    for option in _ON_LINE:
        variable = f"TOOLLEDGER_{option.upper()}: "
        if text.startswith(variable):
            return f"--{option}: {text.removeprefix(variable)}"
    return text


def main(argv: list[str] | None = None) -> NoReturn:
    """Console entry point: run a command, map every error to one line and an exit code."""
    args = sys.argv[1:] if argv is None else argv
    _ON_LINE.clear()  # a run in-process after another (tests, an application's own calls)
    as_json = _JSON[0] = "--json" in args
    if as_json:
        log_as_json_lines()
    else:
        warnings_on_one_line()
    try:
        rv = cli.main(args=args, prog_name="toolledger", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, Interrupted):
        fail("aborted", 130, as_json)
    except CliError as exc:
        fail(exc.message, exc.code, as_json)
    except click.UsageError as exc:
        if _is_bare_help(exc) and exc.ctx:
            # bare ``toolledger`` (or ``toolledger db``): the help as click prints it, not
            # squeezed into one error line (a cold review); still exit 2, nothing was run
            if not as_json:
                click.echo(exc.format_message(), err=True)
                sys.exit(EXIT_USAGE)
            fail(f"missing command (see '{exc.ctx.command_path} --help')", EXIT_USAGE, True)
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx else ""
        fail(exc.format_message() + hint, EXIT_USAGE, as_json)
    except click.ClickException as exc:
        fail(exc.format_message(), exc.exit_code, as_json)
    except Exception as exc:  # the promise is: never a traceback
        message, code, debug = _describe(exc)
        if debug and os.environ.get("TOOLLEDGER_DEBUG"):
            raise
        fail(_named_as_given(message), code, as_json)
    sys.exit(rv if isinstance(rv, int) else EXIT_OK)


def _is_bare_help(exc: click.UsageError) -> bool:
    """Click 8.2's answer to a group run without a command (8.1 printed the help itself)."""
    bare = getattr(click.exceptions, "NoArgsIsHelpError", None)
    return bare is not None and isinstance(exc, bare)


def warnings_on_one_line() -> None:
    """Python's own warnings (SQLAlchemy's about a URL's ignored options) as one line on
    stderr, ``toolledger: warning: …`` as the settings' own are, not Python's two lines quoting
    a line of toolledger's source (a cold review). A command that sets up logging of its own
    keeps this: a warning is still one line."""
    import logging
    import warnings

    def one_line(message: Warning | str, *_args: Any, **_kwargs: Any) -> str:
        text = " ".join(str(message).split())
        if getattr(logging, "_warnings_showwarning", None) is not None:
            # captured into logging (Celery's worker and beat do): the record's text, which
            # its own format prefixes, and no newline of ours inside it (a cold review)
            return text
        if os.environ.get("TOOLLEDGER_LOG_FORMAT", "").strip().lower() == "json":
            # a worker's or the beat's --log-format json, before Celery captures warnings
            # (its warning that it runs as root): a JSON log line as every other, not the
            # first line of stderr a JSON reader failed on (a cold review)
            return _json_log_line(text)
        return f"toolledger: warning: {text}\n"

    warnings.formatwarning = one_line


def _json_log_line(text: str) -> str:
    """``text`` as the WARNING line ``--log-format json`` writes (observability.logs), from
    the logger Python's captured warnings go to."""
    import logging

    from toolledger.observability.logs import JsonFormatter

    record = logging.LogRecord("py.warnings", logging.WARNING, "", 0, text, None, None)
    return JsonFormatter().format(record) + "\n"


def log_as_json_lines() -> None:
    """Under ``--json``, what a command logs (a warning: a failed enqueue the outbox will
    retry, a refused landing) is a JSON object a line on stderr, as its error would be, not
    a plain line among them: ``{"warning": message, "logger": name}`` (``list``'s own warning
    is ``{"warning": …}``; an ERROR record ``{"error": …, "logger": …}``, without the
    ``exit_code`` of the command's own failure). A command that sets up logging of its own
    (a worker, the beat, ``serve``) replaces it."""
    import json
    import logging

    class JsonLines(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            message = " ".join(record.getMessage().split())
            if record.exc_info and record.exc_info[1] is not None:  # one line, no traceback
                message = f"{message}: {' '.join(str(record.exc_info[1]).split())}"
            line = {record.levelname.lower(): message, "logger": record.name}
            return json.dumps(line, ensure_ascii=False)

    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonLines())
        root.addHandler(handler)
        root.setLevel(logging.WARNING)
        # Python's own warnings (SQLAlchemy's about a URL's ignored options) were two plain
        # lines quoting source code (a cold review): records of py.warnings, one JSON line
        logging.captureWarnings(True)
        from toolledger import config  # a misspelt variable too: it was a plain line

        config.tell_warnings_with(
            lambda message: logging.getLogger("toolledger.config").warning("%s", message)
        )


#: Errors told as their own message and exit code, even under TOOLLEDGER_DEBUG.
_DOMAIN_ERRORS = [
    ("toolledger.ledger.errors", "LedgerError"),
    ("toolledger.config", "ConfigError"),
    ("toolledger.ledger.db", "SchemaError"),
]


def _describe(exc: Exception) -> tuple[str, int, bool]:
    """An error's one line, its exit code, and whether TOOLLEDGER_DEBUG shows its traceback."""
    if any(_is(exc, module, name) for module, name in _DOMAIN_ERRORS):
        return str(exc), exit_code_of(exc), False
    orig = str(getattr(exc, "orig", exc)).strip()
    if _is(exc, "sqlalchemy.exc", "SQLAlchemyError"):
        from toolledger.ledger.db import misconfigured

        wrong = misconfigured(exc)
        if wrong is not None:
            return f"TOOLLEDGER_DB: {wrong}", EXIT_USAGE, False
    if _is(exc, "sqlalchemy.exc", "OperationalError"):
        # a lock or statement timeout is a database that answered, busy: "unavailable" sent
        # people looking for a server that was up (a cold review)
        from toolledger.ledger.db import busy, unreachable

        cause = getattr(exc, "orig", None)
        if busy(cause):
            return f"database busy: {orig}", EXIT_FAILURE, False
        if unreachable(cause):
            return f"database unavailable: {orig}", EXIT_FAILURE, False
        # a table gone, a read-only file: no matter of trying again (it read "unavailable")
        return f"database error: {orig}", EXIT_FAILURE, True
    if _is(exc, "sqlalchemy.exc", "SQLAlchemyError"):
        return f"database error: {orig}", EXIT_FAILURE, True
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}: {exc.filename or ''}".strip(": "), EXIT_FAILURE, False
    return f"internal error: {type(exc).__name__}: {exc}", EXIT_FAILURE, True


def _is(exc: Exception, module: str, name: str) -> bool:
    """``isinstance(exc, module.name)``, importing nothing: no class of a module that was
    never imported can have raised ``exc`` (and ``--help`` imports neither the ledger nor
    SQLAlchemy)."""
    loaded = sys.modules.get(module)
    return loaded is not None and isinstance(exc, getattr(loaded, name))
