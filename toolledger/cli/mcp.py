"""``toolledger mcp``: the ledger as an MCP server (``serve``) or in front of one (``proxy``).

The ``mcp`` package (the extra ``toolledger[mcp]``) is imported only when one of these runs:
``toolledger --help`` and every other command never load it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from toolledger.cli.common import (
    EXIT_FAILURE,
    EXIT_USAGE,
    CliError,
    Context,
    Seconds,
    json_option,
    pass_ctx,
)
from toolledger.ledger.identity import check_scope
from toolledger.mcp import DEFAULT_TIMEOUT


def _scope(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    return None if value is None else check_scope(value)


def _shared(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option(
        "--timeout",
        type=Seconds(min=0),
        default=DEFAULT_TIMEOUT,
        show_default=True,
        help="Seconds a call waits for its result; then it is answered with its status "
        "(not an error) and goes on: the same tool_call_id later gets the result.",
    )(f)
    f = click.option(
        "--approved-by",
        default="mcp",
        show_default=True,
        help="Who calls are approved by: the MCP host decides which calls to send.",
    )(f)
    return click.option(
        "--scope",
        callback=_scope,
        help="Scope of calls without _meta toolledger/scope [default: mcp-<session>, one "
        "per server process].",
    )(f)


def _seconds(name: str, default: float, help: str) -> Callable[..., Any]:
    """A positive number of seconds, at most a day, with its default shown."""
    return click.option(
        name,
        type=Seconds(min=0, min_open=True, max=86_400),
        default=default,
        show_default=True,
        help=help,
    )


def _require_mcp() -> None:
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise CliError(
            "the mcp package is not installed: pip install 'toolledger[mcp]'", EXIT_USAGE
        ) from None


@click.group()
def mcp() -> None:
    """Serve the tools over MCP, or put the ledger in front of another MCP server."""


@mcp.command()
@_shared
@json_option
@pass_ctx
def serve(c: Context, scope: str | None, approved_by: str, timeout: float) -> None:
    """A stdio MCP server of the registered tools: every call through the ledger.

    The tool_call_id is _meta["toolledger/tool_call_id"], else the JSON-RPC request id
    (prefixed with this session's id); the same id again replays the result.
    """
    _require_mcp()
    import anyio

    from toolledger.mcp.serve import serve as run

    c.ledger  # noqa: B018 - the schema checked (created, embedded) before a host connects
    anyio.run(partial_run(run, c, scope=scope, approved_by=approved_by, timeout=timeout))


@mcp.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@_shared
@click.option(
    "--idempotent",
    "idempotent",
    multiple=True,
    metavar="TOOL",
    help="An upstream tool that is idempotent (repeatable; the upstream's hints are hints).",
)
@click.option(
    "--lease",
    type=Seconds(min=0, min_open=True, max=86_400),  # a day: config.MAX_LEASE_SECONDS
    default=None,
    help="Seconds a forward's claim holds, renewed every lease/3 while it runs "
    "[default: TOOLLEDGER_LEASE_SECONDS].",
)
@_seconds(
    "--time-limit",
    3600.0,
    "Seconds an upstream call may run; then it is cancelled upstream and recorded unknown.",
)
@_seconds(
    "--start-timeout",
    120.0,
    "Seconds the upstream may take to start and list its tools; then the proxy exits 1.",
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@json_option
@pass_ctx
def proxy(
    c: Context,
    scope: str | None,
    approved_by: str,
    timeout: float,
    idempotent: tuple[str, ...],
    lease: float | None,
    time_limit: float | None,
    start_timeout: float,
    command: tuple[str, ...],
) -> None:
    """Put the ledger in front of another MCP server: toolledger mcp proxy -- COMMAND [ARGS].

    Each call is recorded, forwarded upstream once (with _meta toolledger/idempotency_key)
    and answered from the ledger ever after; a call cut off mid-forward (the proxy killed or
    stopped, the upstream gone, past --time-limit) becomes unknown and is never forwarded
    again. SIGTERM stops the proxy and its upstream at once.
    """
    if command[0].startswith("-"):  # a mistyped option, taken for the upstream command
        raise CliError(
            f"no such option {command[0]!r} (the upstream command comes after --)", EXIT_USAGE
        )
    _require_mcp()
    import anyio

    from toolledger.mcp.proxy import UpstreamError
    from toolledger.mcp.proxy import proxy as run

    c.ledger  # noqa: B018 - the schema checked (created, embedded) before a host connects
    try:
        anyio.run(
            partial_run(
                run,
                c,
                list(command),
                scope=scope,
                approved_by=approved_by,
                idempotent=idempotent,
                lease=lease,
                timeout=timeout,
                time_limit=time_limit,
                start_timeout=start_timeout,
            )
        )
    except UpstreamError as exc:
        raise CliError(str(exc), EXIT_FAILURE) from None


def partial_run(fn: Callable[..., Any], c: Context, *args: Any, **kwargs: Any) -> Any:
    """``fn(settings, *args, **kwargs)`` as anyio.run takes it."""

    async def main() -> None:
        await fn(c.settings, *args, **kwargs)

    return main
