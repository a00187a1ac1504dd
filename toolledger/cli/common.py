"""What every command shares: the context, options, JSON input, output and the exit codes.

Exit codes: 0 ok, 1 failure (verify found differences, a service is unreachable, a read-only
call failed), 2 usage or configuration, 3 conflict, 4 not found, 5 state does not allow it,
6 input refused, 7 timed out (``wait``). Errors are one line on stderr (a JSON object with
``error`` under ``--json``), never a traceback.

Light on purpose: ``toolledger --help`` imports this module and nothing of the ledger, the
settings or the worker; those are imported where they are first used.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, cached_property
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

if TYPE_CHECKING:
    from toolledger.config import Settings
    from toolledger.ledger.ledger import Ledger
    from toolledger.ledger.lightreads import CallReads, LightReads
    from toolledger.worker.submit import Submitter

T = TypeVar("T")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
EXIT_CONFLICT, EXIT_NOT_FOUND, EXIT_STATE, EXIT_INPUT, EXIT_TIMEOUT = 3, 4, 5, 6, 7


class Seconds(click.FloatRange):
    """A number of seconds: a FloatRange that also refuses nan and inf (a FloatRange lets
    nan through every bound, and ``wait --timeout nan`` waited for ever)."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return number


@cache
def exit_codes() -> list[tuple[type[BaseException], int]]:
    """Domain errors and the exit code each one means; the first match wins. Built on first
    use: an error to map means the ledger is loaded already, ``--help`` never loads it."""
    from toolledger.config import ConfigError
    from toolledger.ledger.errors import ConflictError, InputError, NotFound, StateError
    from toolledger.ledger.revision import SchemaError, UnsupportedDatabase

    return [
        (ConflictError, EXIT_CONFLICT),
        (NotFound, EXIT_NOT_FOUND),
        (StateError, EXIT_STATE),
        (InputError, EXIT_INPUT),
        (ConfigError, EXIT_USAGE),
        (UnsupportedDatabase, EXIT_USAGE),
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
        from toolledger.ledger.db import ensure_schema

        ledger = self.unchecked_ledger
        ensure_schema(ledger.engine)
        return ledger

    def require_recorded(self, nothing: str = "no call has been recorded there") -> None:
        """Refuse, exit 4, a command that acts on recorded calls where the embedded ledger's
        file is missing: a mistyped ``TOOLLEDGER_HOME`` or ``TOOLLEDGER_DB`` answered "no
        call" and left an empty ``ledger.db`` behind. Nothing is created: the engine is made,
        not connected. Only commands that record (``submit``), serve or sweep make one."""
        database = self.missing_ledger()
        if database is not None:
            raise CliError(
                f"no ledger at {database}: {nothing} "
                "(is --db, TOOLLEDGER_DB or TOOLLEDGER_HOME right?)",
                EXIT_NOT_FOUND,
            )

    def missing_ledger(self) -> str | None:
        """The path of the embedded (SQLite) ledger's file where it does not exist, else
        None: nothing was ever recorded there. The engine is made, not connected."""
        import os

        database = self.unchecked_ledger.engine.url.database
        if self.unchecked_ledger.engine.dialect.name != "sqlite":
            return None
        if database in (None, "", ":memory:") or str(database).startswith("file:"):
            return None  # in memory, or SQLite's URI form (?uri=true): its own rules
        return None if os.path.exists(str(database)) else str(database)

    @cached_property
    def recorded_ledger(self) -> Ledger:
        """The ledger of a command that reads or changes calls already recorded: its schema
        checked, never made (an empty file at the ledger's path was made a ledger by ``show``
        or ``list``, as any other SQLite database was: a cold review)."""
        from toolledger.ledger.db import ensure_schema

        self.require_recorded()
        ledger = self.unchecked_ledger
        ensure_schema(ledger.engine, create_embedded=False)
        return ledger

    def require_ledger(self) -> None:
        """Fail unless a ledger is recorded there (its schema checked, never made): for a
        command that reaches the ledger through another part (the submitter), before it does."""
        self.recorded_ledger  # noqa: B018 - the property's check is the point

    @cached_property
    def unchecked_ledger(self) -> Ledger:
        # Lock waits and idle transactions bounded: a human's command frozen mid-transaction
        # (a laptop put to sleep) must not hold a call's row for longer than a worker would.
        from toolledger.ledger.ledger import Ledger

        return Ledger(
            self.settings.db,
            max_args_bytes=self.settings.max_args_bytes,
            timeout=self.settings.db_timeout,
            statement_timeout=False,
        )

    @cached_property
    def light_reads(self) -> LightReads | None:
        """The call reads on the bare driver, where they serve this ledger (no SQLAlchemy)."""
        from toolledger.ledger.lightreads import LightReads

        return LightReads.open(self.settings.db, self.settings.db_timeout)

    def reading(self, read: Callable[[CallReads], T]) -> T:
        """``read`` on the light reads where they serve, else on the ledger, which also
        answers when the driver fails under the light reads (and words the error)."""
        from toolledger.ledger.lightreads import Fallback

        light = self.light_reads
        if light is not None:
            try:
                return read(light)
            except Fallback:
                light.close()
                self.__dict__["light_reads"] = None
        return read(self.recorded_ledger)

    @cached_property
    def submitter(self) -> Submitter:
        from toolledger.worker.submit import Submitter  # Celery: only commands that enqueue

        if not self.json:  # what enqueueing logs (a broker out of reach): one line, stderr
            log_as_warning_lines()
        return Submitter(self.settings, ledger=lambda: self.ledger)

    def check_broker(self) -> None:
        """ConfigError (exit 2) for a broker URL kombu cannot read, before a command that will
        enqueue records anything (``worker.app.check_broker_url``). Loads kombu: only then."""
        from toolledger.worker.app import check_broker_url

        check_broker_url(self.settings.broker)

    def warn(self, message: str) -> None:
        """A warning of the command's own, one line on stderr: ``toolledger: warning: …``,
        ``{"warning": …}`` under ``--json``. Never on stdout, which is the command's answer."""
        message = one_line(message)
        line = json.dumps({"warning": message}) if self.json else f"toolledger: warning: {message}"
        click.echo(line, err=True)

    def close(self) -> None:
        if self.__dict__.get("light_reads") is not None:
            self.light_reads.close()  # type: ignore[union-attr]
        if "submitter" in self.__dict__:
            self.submitter.close()
        if "unchecked_ledger" in self.__dict__:
            self.unchecked_ledger.close()

    def emit(self, data: Any, human: Callable[[Any], str] | None = None) -> None:
        if self.json or human is None:
            text = json.dumps(data, ensure_ascii=False, indent=2, default=str)
        else:
            text = human(data)
        click.echo(text, file=answer_stream())


def log_as_warning_lines() -> None:
    """Without ``--json``, what a one-shot command logs is one line on stderr,
    ``toolledger: warning: …`` as the command's own warnings: it was the bare message from
    Python's last-resort handler, and the text output said it again on stdout (a cold
    review). Nothing is done where logging has handlers already (``--json``'s, a test's)."""
    import logging

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:  # one line, no traceback
                message = f"{message}: {record.exc_info[1]}"
            click.echo(f"toolledger: {record.levelname.lower()}: {one_line(message)}", err=True)

    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(Lines(logging.WARNING))
        root.setLevel(logging.WARNING)


def _set_json(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    found = ctx.find_object(Context)
    if value and found is not None:
        found.json = True


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


#: Where the group keeps a settings error until a command needs the settings: ``--help``
#: of every command works whatever the environment holds.
SETTINGS_ERROR = "toolledger.settings_error"

F = TypeVar("F", bound=Callable[..., Any])


def context_of(ctx: click.Context) -> Context:
    """The command's Context, or the settings' error (exit 2) if the environment could not
    make one."""
    found = ctx.find_object(Context)
    if found is None:
        raise ctx.find_root().meta[SETTINGS_ERROR]
    return found


def pass_ctx(f: F) -> F:
    """Click's ``make_pass_decorator(Context)``, raising the settings' error (exit 2) when the
    environment could not make a Context."""

    @functools.wraps(f)
    def with_context(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        c = context_of(ctx)
        if _command_of(ctx) in ANSWERS_ON_STDOUT_ONLY:
            return ctx.invoke(f, c, *args, **kwargs)
        if sys.stdout is None:  # started with fd 1 closed: Python gives no stream
            # the answer went to stderr, where the redirect below sends print(), exit 0: many
            # lines where a script reads one error (a cold review). Before anything is done.
            raise CliError(
                "stdout is closed: nowhere to write the answer (send it to /dev/null to drop it)",
                EXIT_USAGE,
            )
        # a tool's or a tools module's print() (run by execute, a read-only submit, a
        # reconciler) went to stdout before the answer, and --json's stdout was no JSON (a
        # cold review of the CLI): while the command runs, stdout is stderr, the answer not
        _answer.append(sys.stdout)
        try:
            with contextlib.redirect_stdout(sys.stderr):
                return ctx.invoke(f, c, *args, **kwargs)
        finally:
            _answer.pop()

    return with_context  # type: ignore[return-value]


#: The commands whose stdout is not an answer but a stream of their own (MCP's protocol, a
#: worker's banner, the showcase's story): a print() there is left where it goes.
ANSWERS_ON_STDOUT_ONLY = frozenset({"worker", "beat", "serve", "mcp", "demo", "chaos", "bench"})
#: Where a command's answer is written (the stdout it was started with), innermost last.
_answer: list[Any] = []


def answer_stream() -> Any:
    """The stream a command's answer goes to: stdout, even while the command's own run has
    ``sys.stdout`` sent to stderr (``pass_ctx``)."""
    return _answer[-1] if _answer else sys.stdout


def _command_of(ctx: click.Context) -> str | None:
    """The name of the top-level command ``ctx`` runs under (``mcp`` for ``mcp serve``)."""
    while ctx.parent is not None and ctx.parent.parent is not None:
        ctx = ctx.parent
    return ctx.info_name


def parse_json_object(raw: str, what: str, limit: int) -> dict[str, Any]:
    """JSON from the command line (or ``@file``, ``-`` for stdin) under the input layer's
    rules (``toolledger.ledger.inputs``): an object, strict UTF-8, no duplicate keys, no NaN,
    bounded depth and integers. Files and stdin are read as bytes and decoded strictly, at
    most ``limit`` bytes of them: a larger input (``@/dev/zero``, a stream that never ends)
    is refused once ``limit`` is passed, not read into memory until the kernel kills us."""
    from toolledger.ledger import inputs

    data: str | bytes = raw
    source = "stdin" if raw == "-" else raw[1:]
    try:
        if raw == "-":
            if sys.stdin is None:  # closed (``<&-``)
                raise CliError(f"cannot read {what} from stdin: it is closed", EXIT_INPUT)
            data = sys.stdin.buffer.read(limit + 1)
        elif raw.startswith("@"):
            with open(raw[1:], "rb") as file:
                data = file.read(limit + 1)
    except OSError as exc:
        raise CliError(f"cannot read {what} from {source}: {exc.strerror}", EXIT_INPUT) from None
    if len(data) > limit:
        raise CliError(f"{what} from {source}: more than {limit:,} bytes", EXIT_INPUT)
    return inputs.loads_object(data, what)


def scope_option_check(
    _ctx: click.Context, _param: click.Parameter, value: str | None
) -> str | None:
    from toolledger.ledger.identity import check_scope

    return None if value is None else check_scope(value)


def call_id_option_check(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    from toolledger.ledger.identity import check_text_id

    return check_text_id(value, "tool_call_id", 256)


def person_option_check(
    _ctx: click.Context, param: click.Parameter, value: str | None
) -> str | None:
    """A person's name (``--by``, ``--approved-by``) checked as the ledger checks it, and
    refused under the option's own name: the ledger's field (``decider: …``, ``approver: …``)
    named nothing the user typed (a cold review). The library's messages are unchanged."""
    from toolledger.ledger import inputs
    from toolledger.ledger.identity import check_text_id

    name = max(param.opts, key=len) if param.opts else (param.name or "value")
    return None if value is None else check_text_id(value, name, inputs.MAX_ACTOR)


def call_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option(
        "--tool-call-id",
        required=True,
        callback=call_id_option_check,
        help="The id the model gave the call.",
    )(f)
    return click.option(
        "--scope",
        required=True,
        callback=scope_option_check,
        help="Tenant / agent run owning the call.",
    )(f)


#: What a line told on the terminal escapes, after folding its whitespace: the C0 and C1
#: controls and DEL (a NUL was echoed raw; an ESC reached a terminal whenever click's
#: stripping of styles did not apply), and the bidirectional overrides that reorder a line.
_UNSHOWN = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def one_line(message: str) -> str:
    """``message`` as one printable line, whatever it quotes: whitespace folded, control
    characters written as escapes (``\\x00``), a lone surrogate as ``\\udc80``."""
    message = " ".join(message.split())
    message = _UNSHOWN.sub(lambda m: ascii(m.group())[1:-1], message)
    # a lone surrogate would make the error itself fail
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


def fail(message: str, code: int, as_json: bool) -> NoReturn:
    message = one_line(message)  # one line, printable, whatever the source
    if as_json:
        click.echo(json.dumps({"error": message, "exit_code": code}, ensure_ascii=False), err=True)
    else:
        click.echo(f"toolledger: error: {message}", err=True)
    sys.exit(code)


def exit_code_of(exc: BaseException) -> int:
    return next((code for cls, code in exit_codes() if isinstance(exc, cls)), EXIT_FAILURE)
