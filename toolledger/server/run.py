"""Start the server under uvicorn, refusing to expose a ledger without tokens."""

from __future__ import annotations

import errno
import logging
import os
import secrets
import socket
from typing import Any

from toolledger.config import FROM_FILE, ConfigError, Settings
from toolledger.server.auth import load_tokens, loopback_name

log = logging.getLogger("toolledger.serve")

#: The fewest characters of ``TOOLLEDGER_API_SESSION_KEY``: 128 random bits written in base64
#: (``openssl rand -base64 16``); ``openssl rand -hex 32`` gives 64.
MIN_SESSION_KEY = 24


def run(
    settings: Settings,
    *,
    host: str,
    port: int,
    insecure_local: bool,
    workers: int = 1,
    secure_cookies: bool = False,
    forwarded_allow_ips: str | None = None,
    log_format: str | None = None,
) -> None:
    from toolledger.observability.logs import configure_logging
    from toolledger.server.app import create_app

    # One format for ours and uvicorn's lines (log_config=None: uvicorn's loggers propagate
    # to the root, which this configures); the processes of --workers read it from the env.
    if log_format is not None:
        os.environ["TOOLLEDGER_LOG_FORMAT"] = log_format
    configure_logging(log_format)

    tokens = load_tokens()
    if not tokens:
        if not insecure_local:
            raise ConfigError(
                "no API tokens: set TOOLLEDGER_API_TOKENS (name:role:secret,...) or "
                "TOOLLEDGER_API_TOKENS_FILE, or pass --insecure-local (127.0.0.1 only)"
            )
        if not loopback_name(host):
            raise ConfigError(f"--insecure-local binds a loopback address only, not {host!r}")
        log.warning("serving without tokens (--insecure-local): every request is an operator")
    key = os.environ.get("TOOLLEDGER_API_SESSION_KEY") or ""
    if key and len(key) < MIN_SESSION_KEY:
        # it keys the token fingerprint a cookie carries: a guessable key made a copied cookie
        # an offline oracle for a weak secret again (a cold review; "x" was taken)
        raise ConfigError(
            f"TOOLLEDGER_API_SESSION_KEY is {len(key)} characters, fewer than "
            f"{MIN_SESSION_KEY}: use a random one (openssl rand -hex 32)"
        )
    # Behind a proxy every client has the proxy's address, one bucket of wrong tokens for all
    # (auth.FailureThrottle): trusted proxies name the client (and its scheme) for it.
    proxy: dict[str, Any] = {"proxy_headers": False}
    if forwarded_allow_ips is not None and (
        "*" in forwarded_allow_ips or not forwarded_allow_ips.strip()
    ):
        # uvicorn's "trust everyone": each client would name the address it is counted by,
        # guess without end and make any other address wait (helper-99)
        raise ConfigError(
            "--forwarded-allow-ips: name the proxy's own addresses (comma-separated), not "
            f"{forwarded_allow_ips!r}: a client it trusts names the address its wrong tokens "
            "are counted by"
        )
    if forwarded_allow_ips:
        proxy = {"proxy_headers": True, "forwarded_allow_ips": forwarded_allow_ips}
    _can_listen(host, port, workers)
    if workers > 1:
        _ledger_opens(settings)
        # Each worker process builds its app from the environment: the settings as resolved
        # here (the command line's --db/--broker/--sandbox included) and one session key, so
        # that a session cookie from one process is good in every other.
        os.environ.update(
            {
                **_urls_for_workers(settings),
                "TOOLLEDGER_SANDBOX": str(settings.sandbox),
                "TOOLLEDGER_API_SESSION_KEY": key or secrets.token_hex(32),
                "TOOLLEDGER_SERVE_INSECURE_LOCAL": "1" if insecure_local else "",
                "TOOLLEDGER_SERVE_SECURE_COOKIES": "1" if secure_cookies else "",
            }
        )
        # One socket, one scrape target: every process counts into one directory and serves
        # the sum (observability.metrics.start_serve_group)
        from toolledger.observability.metrics import start_serve_group

        start_serve_group()
        _uvicorn(
            "toolledger.server.run:app_from_env",
            factory=True,
            workers=workers,
            host=host,
            port=port,
            log_level="info",
            log_config=None,
            **proxy,
        )
        return
    app = create_app(
        settings,
        tokens,
        insecure_local=insecure_local,
        secure_cookies=secure_cookies,
        session_key=key.encode() or None,
    )
    _uvicorn(app, host=host, port=port, log_level="info", log_config=None, **proxy)


def _can_listen(host: str, port: int, workers: int) -> None:
    """An ``OSError`` (exit 1, one line) if ``host:port`` cannot be listened on: uvicorn said
    it in its log and exited 3, the CLI's "conflict", with no error line (a cold review).
    Probed as uvicorn binds: one process through asyncio (every address the name resolves
    to, IPv6 only on IPv6: an IPv4 listener elsewhere on the port refused ``--host ::`` that
    uvicorn serves, helper-103), ``--workers`` on one dual-stack socket."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"serve: cannot listen on {host}:{port}: {exc.strerror}") from None
    for family, kind, proto, _, address in infos if workers == 1 else infos[:1]:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            if family == socket.AF_INET6 and workers == 1:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL and workers == 1:
                    continue  # asyncio passes over such an address too
                raise OSError(f"serve: cannot listen on {host}:{port}: {exc.strerror}") from None


def _ledger_opens(settings: Settings) -> None:
    """What each of ``--workers``' processes does first (``create_app``: the database answers,
    the schema is at head), done once here: refused, it is one line and exit 1, as with one
    process. Each process died at its start with the whole traceback, uvicorn started it
    again, and again: 78 tracebacks in 40 s, for ever, nothing answering (a cold review)."""
    from toolledger.ledger.db import create_engine, ensure_schema

    engine = create_engine(settings.db, timeout=settings.db_timeout)
    try:
        ensure_schema(engine)
    finally:
        engine.dispose()


def _uvicorn(app: Any, **options: Any) -> None:
    """``uvicorn.run``, its failure to start (exit 3, said in its log) an error of ours."""
    import uvicorn

    try:
        uvicorn.run(app, **options)
    except SystemExit as exc:
        if exc.code == 3:  # uvicorn's "startup failed"
            raise OSError("serve: the server could not start (its log above says why)") from None
        raise


def _urls_for_workers(settings: Settings) -> dict[str, str]:
    """TOOLLEDGER_DB and _BROKER for ``--workers``' processes, unless a secret file gives the
    same URL: its variable is left to them, and the URL (a password in it) kept out of their
    environment. With both set, each process refused to start (helper-92: no answer at all)."""
    out: dict[str, str] = {}
    # the variables as set, in any case (the settings read them so: helper-94)
    named = {k.upper(): k for k in os.environ if os.environ[k]}
    files = {
        n: named[f"TOOLLEDGER_{rest}"]
        for n, rest in FROM_FILE.items()
        if f"TOOLLEDGER_{rest}" in named
    }
    from_files: Settings | None = None
    if files:
        try:
            from_files = Settings.from_env()
        except ConfigError:  # --db over a file that holds no good URL: the command line's
            from_files = None
    for name in FROM_FILE:
        value = getattr(settings, name)
        if name in files:
            if from_files is not None and getattr(from_files, name) == value:
                continue  # the processes read the same file
            os.environ.pop(files[name])  # --db/--broker given: theirs wins, as here
        out[f"TOOLLEDGER_{name.upper()}"] = value
    return out


def app_from_env() -> Any:
    """The app of one of ``serve --workers N``'s processes (uvicorn's factory)."""
    import sqlalchemy as sa

    from toolledger.ledger.errors import LedgerError
    from toolledger.ledger.revision import SchemaError
    from toolledger.observability.logs import configure_logging
    from toolledger.observability.metrics import join_serve_group
    from toolledger.server.app import create_app

    configure_logging()
    join_serve_group()  # before create_app builds the counters
    try:
        return create_app(
            Settings.from_env(),
            load_tokens(),
            insecure_local=os.environ.get("TOOLLEDGER_SERVE_INSECURE_LOCAL") == "1",
            secure_cookies=os.environ.get("TOOLLEDGER_SERVE_SECURE_COOKIES") == "1",
            session_key=os.environ["TOOLLEDGER_API_SESSION_KEY"].encode(),
        )
    except (sa.exc.OperationalError, LedgerError, ConfigError, SchemaError) as exc:
        # the ledger out of reach when uvicorn starts a process again (the parent checked it
        # at start: ``_ledger_opens``): one line a try, not its traceback, until it answers
        said = str(getattr(exc, "orig", None) or exc).strip().splitlines() or [""]
        log.error("serve: process %d cannot start: %s", os.getpid(), said[0][:300])
        raise SystemExit(1) from None
