"""The ASGI application: the API, the console and /metrics behind one authenticator."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio.to_thread
import sqlalchemy as sa
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from toolledger.config import ConfigError, Settings
from toolledger.ledger.db import busy, ensure_schema, unreachable
from toolledger.ledger.errors import LedgerError
from toolledger.server import api, console
from toolledger.server.auth import LOCAL, Authenticator, Throttled, Token
from toolledger.server.deps import (
    BodyLimit,
    HeadAsGet,
    LoopbackOnly,
    NoStoreApi,
    StrictPath,
    error_response,
    max_body_for,
)
from toolledger.server.docs import swagger_page
from toolledger.server.state import Desk
from toolledger.worker.submit import Submitter

log = logging.getLogger("toolledger.server")


#: The router's HTTP errors as the CLI's kinds and exit codes (others: "http", 1).
_ROUTING_ERRORS: dict[int, tuple[str, int]] = {404: ("not_found", 4), 405: ("usage", 2)}


def create_app(
    settings: Settings,
    tokens: list[Token],
    *,
    insecure_local: bool = False,
    secure_cookies: bool = False,
    session_key: bytes | None = None,
    submitter: Submitter | None = None,
    metrics: bool = True,
) -> FastAPI:
    """The server for these settings. Without tokens only ``insecure_local`` runs it, and
    then every request is the local operator (``run`` binds it to 127.0.0.1 only)."""
    if not tokens and not insecure_local:
        raise ConfigError(
            "no API tokens: set TOOLLEDGER_API_TOKENS (name:role:secret,...) or "
            "TOOLLEDGER_API_TOKENS_FILE, or run with --insecure-local on 127.0.0.1"
        )
    sub = submitter or Submitter(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await anyio.to_thread.run_sync(_warm, sub)
        yield
        app.state.desk.close()
        if submitter is None:
            sub.close()

    app = FastAPI(
        lifespan=lifespan,
        title="toolledger",
        summary="Side-effecting tool calls of AI agents, at most once: the humans' side.",
        version="1",
        docs_url=None,  # /docs below: FastAPI's loads any 5.x Swagger UI, unchecked
        redoc_url=None,
        # no route is "not found" (the API's 404 with the CLI's exit code 4), never a bare 307
        # to the path with a slash added: "/api/calls/s1" went on to ".../s1/" (a cold review)
        redirect_slashes=False,
    )
    ensure_schema(sub.ledger.engine)
    app.state.desk = Desk(settings, Authenticator(tokens, session_key), submitter=sub)
    app.state.local = LOCAL if insecure_local and not tokens else None
    app.state.secure_cookies = secure_cookies
    app.state.refusal_page = console.refusal_page  # deps' refusals before any route
    app.include_router(api.router)
    app.include_router(console.router)

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return swagger_page("/openapi.json", f"{app.title} - Swagger UI")

    app.add_middleware(HeadAsGet)
    app.add_middleware(BodyLimit, api_limit=max_body_for(settings))
    app.add_middleware(StrictPath)
    app.add_middleware(NoStoreApi)  # outside the others: their refusals carry it too
    if app.state.local is not None:
        app.add_middleware(LoopbackOnly)

    @app.exception_handler(LedgerError)
    async def ledger_error(request: Request, exc: LedgerError) -> Response:
        if not request.url.path.startswith("/api/"):
            page = console.render(
                request, "error.html", console._status_of(exc), who=None, error=str(exc)
            )
            if isinstance(exc, Throttled):  # a bearer secret on a console page
                page.headers["Retry-After"] = str(exc.retry_after)
            return page
        return error_response(exc)

    @app.exception_handler(sa.exc.OperationalError)
    async def unavailable(request: Request, exc: sa.exc.OperationalError) -> Response:
        # the database did not answer, or waited past its timeout (locked, gone, out of
        # connections): said in the API's shape with the CLI's exit code (1), not as a bare
        # text 500 (a cold review). Anything else of the kind (a missing table, a read-only
        # file) is no matter of trying again: the 500 below, its traceback logged.
        if not (busy(exc.orig) or unreachable(exc.orig)):
            return await internal(request, exc)
        said = (str(exc.orig).strip().splitlines() or [""])[0][:300]  # the driver's, no SQL
        return _unavailable(request, said)

    @app.exception_handler(sa.exc.TimeoutError)
    async def no_connection(request: Request, exc: sa.exc.TimeoutError) -> Response:
        # every connection of the pool held past its timeout: the database answers slowly (a
        # lock, a stall), as a lock timeout says. The pages' pool (8 + 16) runs out before the
        # 40 threads do, and 15 of 40 inboxes asked behind a lock were a bug's 500 with a
        # traceback each (a cold review)
        said = str(exc).split(" (Background")[0][:300]  # SQLAlchemy's, without its link
        return _unavailable(request, f"no connection of the pool free in time: {said}")

    def _unavailable(request: Request, said: str) -> Response:
        log.warning("%s %s: database unavailable: %s", request.method, request.url.path, said)
        message = "database unavailable: try again (what was recorded stands; show tells)"
        if not request.url.path.startswith("/api/"):
            return console.render(request, "error.html", 503, who=None, error=message)
        return JSONResponse({"error": message, "kind": "unavailable", "exit_code": 1}, 503)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> Response:
        # anything else is a bug: the client gets the API's shape, the log its traceback
        if isinstance(exc, sa.exc.SQLAlchemyError):  # (Starlette logs the rest's itself)
            log.error("%s %s: internal error", request.method, request.url.path, exc_info=exc)
        if not request.url.path.startswith("/api/"):
            return console.render(
                request,
                "error.html",
                500,
                who=None,
                error="internal error (its traceback is in the server's log)",
            )
        return JSONResponse(
            {"error": f"internal error: {type(exc).__name__}", "kind": "internal", "exit_code": 1},
            500,
        )

    @app.exception_handler(ConfigError)
    async def config_error(_request: Request, exc: ConfigError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        first: dict[str, Any] = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = f"{where}: {first.get('msg', 'invalid request')}".strip(": ")
        if not request.url.path.startswith("/api/"):  # a person reads the console's
            return console.render(request, "error.html", 422, who=None, error=message)
        return JSONResponse({"error": message, "kind": "input", "exit_code": 6}, 422)

    @app.exception_handler(ClientDisconnect)
    async def gone(request: Request, _exc: ClientDisconnect) -> Response:
        # the client left mid-body: nothing was done, nobody reads an answer, and it is no
        # error of the server's (it logged a traceback; a cold review)
        log.info(
            "%s %s: the client left before its body was read", request.method, request.url.path
        )
        return Response(status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> Response:
        # the router's own: no such route (the CLI's not found, 4), or not that method
        # (usage, 2); an unknown route answered kind "http", exit 1 (a cold review)
        kind, code = _ROUTING_ERRORS.get(exc.status_code, ("http", 1))
        return JSONResponse(
            {"error": str(exc.detail), "kind": kind, "exit_code": code},
            exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    if metrics:
        _mount_metrics(app, sub)

    return app


def _warm(sub: Submitter) -> None:
    """What the first publish would import on a request's thread, imported before the first
    request (``Submitter.warm``)."""
    sub.warm()


def _mount_metrics(app: FastAPI, sub: Submitter) -> None:
    """``/metrics`` for Prometheus: this process's counters and the ledger's gauges, cached a
    few seconds. Unauthenticated, like every exporter: counts by tool and status, no
    contents, no ids."""
    from starlette.routing import Route

    from toolledger.observability.metrics import asgi_app

    app.router.routes.append(
        Route("/metrics", _AsgiEndpoint(asgi_app(sub.ledger)), include_in_schema=False)
    )


class _AsgiEndpoint:
    """An ASGI app as a route's endpoint (a plain function would be taken for a request
    handler), so that /metrics answers without a redirect to /metrics/."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)
