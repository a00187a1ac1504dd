"""Request plumbing shared by the API and the console: who is asking, the body, the errors."""

from __future__ import annotations

import re
import urllib.parse
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from toolledger.config import ConfigError, Settings
from toolledger.ledger import inputs
from toolledger.ledger.errors import (
    ConflictError,
    InputError,
    InvalidArguments,
    LedgerError,
    NotFound,
    StateError,
)
from toolledger.server.auth import (
    SESSION_COOKIE,
    Forbidden,
    Session,
    Throttled,
    Token,
    loopback_name,
)
from toolledger.server.state import Desk

#: The ledger's errors as HTTP statuses, with the CLI's kind and exit code; first match wins.
ERRORS: list[tuple[type[BaseException], int, str, int]] = [
    (Forbidden, 403, "forbidden", 5),
    (ConflictError, 409, "conflict", 3),
    (NotFound, 404, "not_found", 4),
    (StateError, 409, "state", 5),
    (InputError, 422, "input", 6),
    (ConfigError, 422, "input", 6),
]


class Unauthorized(LedgerError):
    """No valid token: send Authorization: Bearer SECRET."""


class BodyTooLarge(InputError):
    """The request body is larger than any call may be."""


class ReadsBusy(LedgerError):
    """As many read-only calls as the server runs at once are running: ask again shortly
    (503, ``busy``, Retry-After; it was not run, and a read is not recorded)."""

    retry_after = 1


class ReadTimedOut(LedgerError):
    """A read-only call did not finish within its time limit (504, ``timeout``); its run goes
    on unseen until it ends (a thread cannot be stopped) and is not recorded."""


def desk_of(request: Request) -> Desk:
    desk: Desk = request.app.state.desk
    return desk


def _bearer(request: Request) -> str | None:
    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    return secret.strip() if scheme.lower() == "bearer" and secret.strip() else None


def token_of(request: Request) -> Token | None:
    """The token behind the request: the local operator's, or a bearer secret's."""
    state = request.app.state
    if state.local is not None:
        return state.local  # type: ignore[no-any-return]
    secret = _bearer(request)
    if secret is None:
        return None
    return desk_of(request).auth.by_secret_from(secret, client_address(request))


def client_address(request: Request) -> str:
    """Who sent the request, as far as this server can tell: the peer's address, or the
    client's as a trusted proxy says (``serve --forwarded-allow-ips``)."""
    return request.client.host if request.client is not None else ""


def session_of(request: Request) -> Session | None:
    """The console's session cookie, unless the request is the local operator's or carries a
    bearer secret (which then decides alone). Whether a logout ended it is not judged here:
    ``Desk.session_live`` reads the database."""
    if request.app.state.local is not None or _bearer(request) is not None:
        return None
    return desk_of(request).auth.session_of(request.cookies.get(SESSION_COOKIE))


async def api_token(request: Request) -> Token:
    """The API's token, judged on the event loop (a hash and a comparison, as the console
    judges a bearer): as a plain function FastAPI ran it on the threads every request shares,
    and with them held by a frozen database a wrong token's 401 waited 7.7 s for one."""
    token = token_of(request)
    if token is None:
        raise Unauthorized()
    return token


def max_body_for(settings: Settings) -> int:
    """The largest body worth reading: the arguments' limit as JSON may spell it (a byte
    escaped as ``\\u0001`` takes six) plus room for the envelope."""
    return int(settings.max_args_bytes) * 6 + 64 * 1024


def max_body(request: Request) -> int:
    return max_body_for(desk_of(request).settings)


async def read_body(request: Request, *, empty_ok: bool = False) -> dict[str, Any]:
    """The body as a JSON object under the input layer's rules, read up to a bound."""
    limit = max_body(request)
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body of {declared} bytes is over the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body is over the {limit}-byte limit")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        if empty_ok:
            return {}
        raise InvalidArguments("request body: a JSON object is required")
    return inputs.loads_object(raw, "request body")


#: The largest form the console accepts (a reason, some evidence, a token).
FORM_LIMIT = 256 * 1024


class BodyLimit:
    """Bounds every request body before anything parses it: the API's to what a call may
    carry, the console's forms (and the login) to ``FORM_LIMIT``; a declared length over the
    bound is refused at once, a chunked body as soon as it passes it."""

    def __init__(self, app: Any, api_limit: int, form_limit: int = FORM_LIMIT) -> None:
        self.app, self.api_limit, self.form_limit = app, api_limit, form_limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.api_limit if scope["path"].startswith("/api/") else self.form_limit
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            message = f"request body of {int(declared)} bytes is over the {limit}-byte limit"
            await refusal(scope, BodyTooLarge(message))(scope, receive, send)
            return
        seen = 0

        async def bounded() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(f"request body is over the {limit}-byte limit")
            return message

        await self.app(scope, bounded, send)


#: Methods that change nothing, whoever sends them.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def host_name(authority: str) -> str:
    """The name in a ``Host`` header, without its port (``[::1]:8420`` -> ``::1``); the whole
    authority when what follows the name is not a port (``127.0.0.1:80.evil`` named
    127.0.0.1: a cold review)."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        name, _, rest = authority[1:].partition("]")
    elif authority.count(":") == 1:
        name, rest = authority.split(":")[0], ":" + authority.split(":")[1]
    else:
        return authority
    port = rest.removeprefix(":")
    if rest and not (rest.startswith(":") and port.isascii() and (port.isdigit() or not port)):
        return authority
    return name


class LoopbackOnly:
    """``serve --insecure-local``: no token, so every request is the operator, and only the
    operator's own requests may reach it. Refused (403, nothing read or changed): a Host that
    is not a loopback name (DNS rebinding: another site's name pointed at 127.0.0.1, whose
    pages could then read every answer and the console's CSRF token), and a request that
    changes something and that a browser says came from another site (``Origin`` not this
    server, ``Sec-Fetch-Site`` cross-site or same-site): a page the operator opens could
    otherwise approve, retry and submit calls, a duplicate effect accepted included. A
    request no browser sent (curl, the client) carries neither header and passes."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            why = self.refusal(scope)
            if why is not None:
                await error_response(Forbidden(why))(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def refusal(scope: Any) -> str | None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        names = [k.decode("latin-1").lower() for k, _ in scope["headers"]]
        for judged in ("host", "origin", "sec-fetch-site"):
            if names.count(judged) > 1:  # the last one was judged, whatever the first said
                return f"--insecure-local refuses a request with more than one {judged} header"
        host = headers.get("host", "")
        if not loopback_name(host_name(host)):
            return f"--insecure-local answers only requests to a loopback name, not {host!r}"
        if scope["method"] in SAFE_METHODS:
            return None
        site = headers.get("sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            return "--insecure-local refuses a request from another site (Sec-Fetch-Site)"
        origin = headers.get("origin")
        ours = (f"http://{host}".lower(), f"https://{host}".lower())
        # "null": a page whose referrer policy hides it; only the browser's own word that it is
        # same-origin (Sec-Fetch-Site, which no page can set) lets it through
        if (
            origin is not None
            and origin.lower() not in ours
            and not (origin == "null" and site == "same-origin")
        ):
            return f"--insecure-local refuses a request from another site ({origin!r})"
        return None


#: A path whose scope segment (``/api/calls/SCOPE/…``, ``/calls/SCOPE/…``) holds an escaped "/".
_ESCAPED_SLASH_IN_SCOPE = re.compile(rb"^(?:/api)?/calls/[^/]*%2[fF]")


class StrictPath:
    """Refuses (422, nothing read or changed) a request whose path's escapes are not UTF-8:
    the router read them leniently, as U+FFFD, so many malformed paths named one call, and
    ``POST /api/calls/acme/bad%FE/approve`` approved the call ``bad\ufffd`` (a cold review).
    Bodies were strict UTF-8 already. And one whose scope segment holds an escaped "/": a
    scope holds none, and the router, splitting the unescaped path, answered
    ``GET /api/calls/acme%2Fx`` with the call x of scope acme."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            raw: bytes = scope.get("raw_path") or b""
            why = None
            try:
                urllib.parse.unquote_to_bytes(raw).decode("utf-8")
            except UnicodeDecodeError as exc:
                why = f"the request's path is not UTF-8 once unescaped (byte {exc.start})"
            if why is None and _ESCAPED_SLASH_IN_SCOPE.match(raw):
                # the router splits on the unescaped path: ".../calls/acme%2Fx/approve" was
                # the call x of scope acme, where the client named the scope "acme/x"
                why = "a scope holds no '/': the path's scope segment has an escaped one"
            if why is not None:
                await refusal(scope, InvalidArguments(why))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class HeadAsGet:
    """HEAD answered as GET without its body (RFC 9110: a server that takes GET takes HEAD):
    FastAPI's routes name GET only, so ``curl -I`` and a monitor's HEAD of a page or a call
    were 405 (a cold review). The GET's headers, its Content-Length included, are sent as
    they are; nothing else changes (HEAD, as GET, changes nothing)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Any) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


class NoStoreApi:
    """``Cache-Control: no-store`` on every answer under ``/api/``, as the console's pages
    have it: a call's arguments and results (an agent's data, a token a tool returned) were
    sent without it, and a browser (``--insecure-local``, ``/docs``' "Try it out") or a
    caching proxy in front could keep them on disk (a cold review). A header a route set
    itself stands."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/api/"):
            await self.app(scope, receive, send)
            return

        async def no_store(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"cache-control" for k, _ in headers):
                    headers.append((b"cache-control", b"no-store"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, no_store)


def require_suffix(request: Request, suffix: str) -> None:
    """A POST to an escaped id ending in ``/suffix`` names no action: never this one."""
    if not suffixed(request, suffix):
        raise NotFound(f"no action at {request.url.path!r}: POST to the call's path + /{suffix}")


def suffixed(request: Request, suffix: str) -> bool:
    """Whether the request's path really ends in ``/suffix``: a tool_call_id may hold "/",
    sent escaped (``x%2Fevents``), which the router has already unescaped."""
    raw: bytes = request.scope.get("raw_path") or request.url.path.encode()
    return raw.endswith(b"/" + suffix.encode())


def refusal(scope: Any, exc: LedgerError) -> Response:
    """A middleware's refusal, before any route: the API's JSON under ``/api/``, and
    elsewhere the console's error page (``app.state.refusal_page``, which the app sets: this
    module is below the console's), as the routes' errors are (a person reads it): a form
    over the bound, a path not UTF-8, were shown as raw JSON in the browser (a cold review)."""
    app = scope.get("app")
    page = getattr(app.state, "refusal_page", None) if app is not None else None
    if scope["path"].startswith("/api/") or page is None:
        return error_response(exc)
    response: Response = page(Request(scope), exc)
    return response


def error_response(exc: BaseException) -> JSONResponse:
    if isinstance(exc, Unauthorized):
        return JSONResponse(
            {"error": str(exc), "kind": "unauthorized", "exit_code": 2},
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
    if isinstance(exc, BodyTooLarge):
        return JSONResponse({"error": str(exc), "kind": "input", "exit_code": 6}, 413)
    if isinstance(exc, ReadsBusy):
        return JSONResponse(
            {"error": str(exc), "kind": "busy", "exit_code": 1},
            status_code=503,
            headers={"Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, ReadTimedOut):
        return JSONResponse({"error": str(exc), "kind": "timeout", "exit_code": 1}, 504)
    if isinstance(exc, Throttled):
        return JSONResponse(
            {"error": str(exc), "kind": "throttled", "exit_code": 2},
            status_code=429,
            headers={"Retry-After": str(exc.retry_after)},
        )
    for cls, status, kind, code in ERRORS:
        if isinstance(exc, cls):
            message = " ".join(str(exc).split())
            return JSONResponse({"error": message, "kind": kind, "exit_code": code}, status)
    raise exc
