"""``toolledger serve``: the HTTP API, the console and /metrics in one ASGI process."""

from __future__ import annotations

import click

from toolledger.cli.common import Context, json_option, pass_ctx


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=click.IntRange(0, 65535), default=8420, show_default=True)
@click.option(
    "--insecure-local",
    is_flag=True,
    help="Run without tokens (127.0.0.1 only): every request acts as a local operator.",
)
@click.option(
    "--workers",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Server processes (uvicorn's --workers): sessions are good in every one.",
)
@click.option(
    "--secure-cookies",
    is_flag=True,
    help="Mark the console's cookies Secure (behind a TLS-terminating proxy, where this server "
    "sees only http).",
)
@click.option(
    "--forwarded-allow-ips",
    default=None,
    metavar="IPS",
    help="Trust X-Forwarded-For and -Proto from these proxy addresses (comma-separated, as "
    "uvicorn's option): each client's own address is then the one its wrong tokens are "
    "throttled by.",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default=None,
    help="Log lines as text or JSON objects [env TOOLLEDGER_LOG_FORMAT, text].",
)
@json_option
@pass_ctx
def serve(
    c: Context,
    host: str,
    port: int,
    insecure_local: bool,
    workers: int,
    secure_cookies: bool,
    forwarded_allow_ips: str | None,
    log_format: str | None,
) -> None:
    """Serve the JSON API, the console and /metrics (tokens: TOOLLEDGER_API_TOKENS)."""
    from toolledger.server.run import run

    run(
        c.settings,
        host=host,
        port=port,
        insecure_local=insecure_local,
        workers=workers,
        secure_cookies=secure_cookies,
        forwarded_allow_ips=forwarded_allow_ips,
        log_format=log_format,
    )
