"""The console: server-rendered pages for the people who approve calls and settle unknowns.

No script at all (the Content-Security-Policy forbids any), forms only. Everything an agent
produced — arguments, results, evidence, ids — is untrusted text: Jinja's autoescape is on
for every template and nothing is marked safe."""

from __future__ import annotations

import json
import re
import secrets
import shlex
import urllib.parse
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup
from starlette.concurrency import run_in_threadpool

from toolledger.ledger.errors import InvalidArguments, LedgerError
from toolledger.ledger.inputs import TYPED_ESCAPE, shown, shown_id
from toolledger.server.auth import (
    LOGIN_COOKIE,
    SESSION_COOKIE,
    SESSION_SECONDS,
    Action,
    Throttled,
    Token,
    same_text,
)
from toolledger.server.deps import (
    ERRORS,
    BodyTooLarge,
    client_address,
    desk_of,
    require_suffix,
    session_of,
    token_of,
)

router = APIRouter(include_in_schema=False)

#: Nothing but this origin's styles and forms; no script, no frame, no plugin.
CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)

#: The messages a redirect may ask for (the query names one; it never carries text).
DONE = {
    "approved": "Approved and enqueued.",
    "rejected": "Rejected.",
    "retried": "A new attempt was authorised and enqueued.",
    "resolved": "Resolved, with your evidence recorded.",
}
#: Rows per inbox section; the counts above say how many there are, the list pages show all.
INBOX_LIMIT = 25


class _Shown(str):
    """Text written for the page already (``pretty``'s JSON: its own escapes tell a backslash
    typed from one written); still HTML-escaped, as any text."""


def _visible(value: Any) -> Any:
    """Every value a page shows, with each control, format and separator character written as
    its escape (``inputs.shown``; line breaks and tabs kept): an agent's path
    ``invoice\\u202efdp.sh`` showed as ``invoicehs.pdf`` on the page where a person approves
    it, and ids differing by a zero-width character as one id (a cold review). A backslash
    typed before ``u`` or ``U`` is written twice, so that ``zw\\u200b1`` typed is not shown as
    the id holding a zero-width space."""
    if isinstance(value, _Shown | Markup):  # pretty's, or a macro's: shown already
        return value
    if isinstance(value, str):
        return shown(TYPED_ESCAPE.sub(r"\\\\", value), keep="\n\t")
    return value


#: The characters of one JSON block a page shows (an event's detail, a result, the receipt):
#: 400 KB of arguments made a 3.8 MB page, 0.4 s of rendering (a cold review). The page
#: says what it cut and links to the whole (``?whole=``).
SHOWN_CHARS = 16_384
#: The arguments, what a person approves, are shown further.
ARGS_SHOWN_CHARS = 32_768


def _pretty(value: Any, limit: int = SHOWN_CHARS) -> _Shown:
    """A value as indented JSON, the characters nobody sees escaped (JSON's own escaping
    tells a typed backslash: it is written twice), cut after ``limit`` characters with a
    line saying how many were not shown (``cut``)."""
    text = json.dumps(value, ensure_ascii=False, indent=2, default=str)
    return _Shown(shown(_cut(text, limit)[0], keep="\n"))


def _cut(text: str, limit: int) -> tuple[str, int]:
    """``text`` cut after ``limit`` characters, with a last line that says so, and how many
    characters were not shown (0: the whole)."""
    if len(text) <= limit:
        return text, 0
    left = len(text) - limit
    note = "not shown here: the page's links “whole, as JSON” give everything"
    return f"{text[:limit]}\n[… {left:,} more characters {note}]", left


env = Environment(
    loader=FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
    lstrip_blocks=True,
    finalize=_visible,
)
env.filters["pretty"] = _pretty
# an id, a scope, a key, a name: its blanks that nobody can count escaped too ("n16 ")
env.filters["ident"] = lambda v: v if v is None else _Shown(shown_id(str(v)))
env.filters["pretty_text"] = lambda text: _Shown(shown(text, keep="\n"))  # JSON written
env.filters["q"] = lambda v: quote(str(v), safe="")
env.filters["sh"] = lambda v: shlex.quote(str(v))  # a command to copy: one word a value


def call_url(scope: str, tool_call_id: str, suffix: str = "") -> str:
    return f"/calls/{quote(scope, safe='')}/{quote(tool_call_id, safe='')}{suffix}"


env.globals["call_url"] = call_url


def _session(request: Request) -> str:
    if request.app.state.local is not None:
        return "local"
    return request.cookies.get(SESSION_COOKIE, "")


def render(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
    who: Token | None = context.get("who")
    session = _session(request)
    context.setdefault("csrf", desk_of(request).auth.csrf_for(session) if session else "")
    context.setdefault("local", request.app.state.local is not None)
    context.setdefault("may", {a.value: bool(who and who.may(a)) for a in Action})
    if isinstance(error := context.get("error"), str):
        # an error quotes ids with repr, which writes a typed backslash twice already and a
        # zero-width space as \u200b: written again, the real id read as the typed one (a
        # cold review)
        context["error"] = _Shown(shown(error, keep="\n\t"))
    html = env.get_template(name).render(request=request, **context)
    return HTMLResponse(html, status_code=status, headers=secure_headers())


def refusal_page(request: Request, exc: LedgerError) -> HTMLResponse:
    """The error page of a request refused before any route (``deps.refusal``)."""
    return render(request, "error.html", _status_of(exc), who=None, error=str(exc))


async def render_off_loop(
    request: Request, name: str, status: int = 200, **context: Any
) -> HTMLResponse:
    """``render`` in a thread: a call page with 400 KB of arguments took 0.4 s to render on
    the event loop, and ``/login`` and every other request waited 1.3 s behind 10 of them (a
    cold review). The pages that read the ledger are rendered so."""
    return await run_in_threadpool(lambda: render(request, name, status, **context))


def secure_headers() -> dict[str, str]:
    return {
        "Content-Security-Policy": CSP,
        "X-Content-Type-Options": "nosniff",
        # same-origin, not no-referrer: under no-referrer a browser sends a form post's Origin
        # as "null", and --insecure-local could not tell the console's own posts from a page's
        "Referrer-Policy": "same-origin",
        "Cache-Control": "no-store",
    }


def _login_redirect(request: Request, back: str | None = None) -> RedirectResponse:
    """To the login form, then back to this page, or to ``back`` (a form posted with an
    ended session: its action's path is no page, and a GET of it was a 404, helper-91)."""
    # the path as it was sent (escaped): decoded, an id's "%2F" became a "/", another path
    raw: bytes = request.scope.get("raw_path") or request.url.path.encode()
    path = raw.decode("latin-1")
    target = back or path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse("/login?" + urlencode({"next": target}), status_code=303)


async def _who(request: Request) -> Token | None:
    """The token behind a console request: the local operator's, a bearer secret's, or a
    session cookie's that no logout has ended (one read of the database, off the loop)."""
    session = session_of(request)
    if session is None:
        return token_of(request)
    if not await run_in_threadpool(desk_of(request).session_live, session):
        return None
    return session.token


async def _form(request: Request, who: Token) -> dict[str, str]:
    """The posted form, once its CSRF token proved it came from one of our pages."""
    if _media_type(request) != "application/x-www-form-urlencoded":
        # the console's forms post nothing else; a multipart body's fields went through
        # Starlette's parser, which read bytes that are not UTF-8 as Latin-1, and a reason was
        # recorded so (a cold review)
        raise InvalidArguments(
            "a form is posted as application/x-www-form-urlencoded: nothing was done"
        )
    # read strictly: Starlette's parser turns bytes that are not UTF-8 into U+FFFD, and a
    # reason was recorded so, where the API refuses it (a cold review)
    raw = await request.body()
    try:
        pairs = urllib.parse.parse_qsl(
            raw.decode("latin-1"), keep_blank_values=True, encoding="utf-8", errors="strict"
        )
    except UnicodeDecodeError:
        raise InvalidArguments("the form is not UTF-8 text: nothing was done") from None
    form: dict[str, Any] = dict(pairs)  # the last of a repeated field, as Starlette's
    # a browser sends a textarea's line breaks as CRLF (the HTML form encoding): the text's
    # lines are LF, as the API takes them (a two-line reason was refused for its U+000D; a
    # cold review). A lone CR is still the input rules' to refuse.
    fields = {k: v.replace("\r\n", "\n") for k, v in form.items() if isinstance(v, str)}
    if not desk_of(request).auth.check_csrf(_session(request), fields.get("csrf")):
        raise CsrfRefused()
    return fields


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def _form_number(text: str, low: int, high: int) -> int | None:
    """A number a page wrote in a hidden field (ASCII digits, ``low``..``high``), else None.
    ``str.isdecimal`` let 5,000 digits through to ``int``, which raised past Python's 4,300
    and answered 500; and it took other scripts' digits (``\u0661``), which no page writes."""
    if not _DIGITS.fullmatch(text):
        return None
    number = int(text)
    return number if low <= number <= high else None


_DIGITS = re.compile(r"[0-9]{1,20}")


class CsrfRefused(LedgerError):
    """The form did not carry this session's CSRF token: nothing was done."""


def _status_of(exc: BaseException) -> int:
    if isinstance(exc, CsrfRefused):
        return 403
    if isinstance(exc, BodyTooLarge):  # a chunked body found over the bound mid-stream
        return 413
    if isinstance(exc, Throttled):  # a bearer secret on a console page
        return 429
    return next((status for cls, status, _, _ in ERRORS if isinstance(exc, cls)), 500)


# ---------------------------------------------------------------------------- login


@router.get("/login")
def login_page(request: Request, next: str = "/") -> Response:
    nonce = secrets.token_urlsafe(24)
    response: Response = render(
        request, "login.html", who=None, nonce=nonce, next=_local_path(next)
    )
    response.set_cookie(
        LOGIN_COOKIE, nonce, max_age=600, httponly=True, samesite="strict", path="/login",
        secure=_secure(request),
    )  # fmt: skip
    return response


def _secure(request: Request) -> bool:
    """Whether the console's cookies are marked Secure: ``serve --secure-cookies`` (behind a
    TLS-terminating proxy, where this server sees only http: its cookies were never Secure,
    helper-91), or a request that came over https."""
    return bool(getattr(request.app.state, "secure_cookies", False)) or (
        request.url.scheme == "https"
    )


def _local_path(target: str) -> str:
    """Only a path on this server: never an open redirect (browsers read ``/\\host`` as
    ``//host``, so no backslash either, nor a control character)."""
    local = target.startswith("/") and not target.startswith("//")
    if not local or "\\" in target or any(ord(c) < 0x20 or ord(c) == 0x7F for c in target):
        return "/"
    # escaped where it is not ASCII (an id's zero-width space): the page writes it as it is,
    # and the escape the page would show for it is no path (a cold review: login led to "/")
    return quote(target, safe="/?&=%#:@!$'()*+,;~")


@router.post("/login")
async def login(request: Request) -> Response:
    form = await request.form()
    nonce, secret = form.get("nonce"), form.get("token")
    target = _local_path(str(form.get("next") or "/"))
    expected = request.cookies.get(LOGIN_COOKIE)
    if not (isinstance(nonce, str) and expected and same_text(expected, nonce)):
        return render(
            request,
            "login.html",
            403,
            who=None,
            nonce="",
            next=target,
            error="The login form expired or was not ours; reload and try again.",
        )
    auth = desk_of(request).auth
    try:
        token = (
            auth.by_secret_from(secret, client_address(request))
            if isinstance(secret, str) and secret
            else None
        )
    except Throttled as exc:  # the form stays good: its nonce is the one the cookie holds
        slowed = render(
            request,
            "login.html",
            429,
            who=None,
            nonce=nonce,
            next=target,
            error=f"Too many wrong tokens from your address: try again in {exc.retry_after} s.",
        )
        slowed.headers["Retry-After"] = str(exc.retry_after)
        return slowed
    if token is None:
        fresh = secrets.token_urlsafe(24)
        refused = render(
            request,
            "login.html",
            401,
            who=None,
            nonce=fresh,
            next=target,
            error="That token is not valid.",
        )
        refused.set_cookie(
            LOGIN_COOKIE, fresh, max_age=600, httponly=True, samesite="strict", path="/login",
            secure=_secure(request),
        )  # fmt: skip
        return refused
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(
        SESSION_COOKIE,
        auth.session_for(token),
        max_age=SESSION_SECONDS,
        httponly=True,
        samesite="strict",
        secure=_secure(request),
        path="/",
    )
    response.delete_cookie(LOGIN_COOKIE, path="/login")
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    who = await _who(request)
    if who is None:
        return _login_redirect(request)
    try:
        await _form(request, who)
    except CsrfRefused as exc:
        return render(request, "error.html", 403, who=who, error=str(exc))
    session = session_of(request)
    if session is not None:  # a bearer secret or the local operator has no session to end
        await run_in_threadpool(desk_of(request).end_session, session)
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


# ---------------------------------------------------------------------------- pages


@router.get("/")
async def inbox(request: Request) -> Response:
    who = await _who(request)
    if who is None:
        return _login_redirect(request)
    desk = desk_of(request)

    def read() -> dict[str, Any]:
        return {
            "counts": desk.inbox(who),
            "pending": desk.list_calls(who, status="pending_approval", limit=INBOX_LIMIT).calls,
            "unknown": desk.list_calls(who, status="unknown", limit=INBOX_LIMIT).calls,
            "review": desk.list_calls(who, review=True, limit=INBOX_LIMIT).calls,
        }

    return await render_off_loop(request, "inbox.html", who=who, **await run_in_threadpool(read))


@router.get("/calls")
async def calls(
    request: Request,
    status: str | None = None,
    scope: str | None = None,
    review: bool = False,
    cursor: str | None = None,
) -> Response:
    who = await _who(request)
    if who is None:
        return _login_redirect(request)
    status, scope = status or None, scope or None
    try:
        page = await run_in_threadpool(
            lambda: desk_of(request).list_calls(
                who, status=status, scope=scope, review=review, limit=100, cursor=cursor
            )
        )
    except LedgerError as exc:
        return render(request, "error.html", _status_of(exc), who=who, error=str(exc))
    query = {"status": status, "scope": scope, "review": "1" if review else None}
    more = None
    if page.next_cursor:
        more = "/calls?" + urlencode(
            {k: v for k, v in {**query, "cursor": page.next_cursor}.items() if v}
        )
    return await render_off_loop(
        request,
        "list.html",
        who=who,
        page=page,
        status_filter=status or "",
        scope=scope or "",
        review=review,
        more=more,
    )


async def _call_page(
    request: Request,
    who: Token,
    scope: str,
    tool_call_id: str,
    *,
    status: int = 200,
    error: str | None = None,
) -> Response:
    try:
        data = await run_in_threadpool(lambda: desk_of(request).page(who, scope, tool_call_id))
    except LedgerError as exc:
        return render(request, "error.html", _status_of(exc), who=who, error=str(exc))
    said = request.query_params.get("done", "")
    done = DONE.get(said) if _did(data.get("acts") or [], who.name, said) else None
    call = data["call"]
    data["args_text"], data["args_left"] = _cut(
        json.dumps(call["args"], ensure_ascii=False, indent=2, default=str), ARGS_SHOWN_CHARS
    )
    data["args_shown"] = ARGS_SHOWN_CHARS
    return await render_off_loop(
        request, "call.html", status, who=who, error=error, done=done, **data
    )


#: What a call page's ``?whole=`` link gives as JSON, whole: the page cuts long values.
WHOLE = ("args", "call", "events")


async def _whole(
    request: Request, who: Token, scope: str, tool_call_id: str, what: str
) -> Response:
    """The arguments (``args``), the call as ``show --json`` has it (``call``) or its whole
    history (``events``), as a JSON download: what the page cut, whole, for a person whose
    session holds no bearer token for the API."""
    desk = desk_of(request)

    def read() -> bytes:
        if what == "events":
            value: Any = desk.events(who, scope, tool_call_id)
        else:
            value = desk.show(who, scope, tool_call_id)
            value = value["args"] if what == "args" else value
        return json.dumps(value, ensure_ascii=False, indent=2).encode()

    try:
        body = await run_in_threadpool(read)
    except LedgerError as exc:
        return render(request, "error.html", _status_of(exc), who=who, error=str(exc))
    name = f"{what}.json"
    headers = {**secure_headers(), "Content-Disposition": f'attachment; filename="{name}"'}
    return Response(body, media_type="application/json", headers=headers)


def _act_of(event: dict[str, Any]) -> str | None:
    """The notice a person's event stands for: an approval, a retry (an approval of a new
    attempt), a rejection, a resolution (the status they gave, or a review)."""
    kind = event.get("kind")
    if kind == "approved":
        return "retried" if (event.get("detail") or {}).get("retry") else "approved"
    if kind == "rejected":
        return "rejected"
    return "resolved" if kind in ("succeeded", "failed", "reviewed") else None


def _did(events: list[dict[str, Any]], name: str, said: str) -> bool:
    """Whether this person's own act of the kind the notice ``?done=`` names is on the call's
    record: a link anyone can write showed "Approved and enqueued." on a call still pending
    (helper-91), and "retried" or "resolved" after any act of theirs (helper-92)."""
    return any(e.get("actor") == name and _act_of(e) == said for e in events)


@router.get("/calls/{scope}/{tool_call_id:path}")
async def call(request: Request, scope: str, tool_call_id: str) -> Response:
    who = await _who(request)
    if who is None:
        return _login_redirect(request)
    whole = request.query_params.get("whole")
    if whole is not None:
        if whole not in WHOLE:
            error = f"whole is one of {', '.join(WHOLE)}"
            return render(request, "error.html", 422, who=who, error=error)
        return await _whole(request, who, scope, tool_call_id, whole)
    return await _call_page(request, who, scope, tool_call_id)


# ---------------------------------------------------------------------------- actions


async def _act(request: Request, scope: str, tool_call_id: str, action: str) -> Response:
    require_suffix(request, action)  # an escaped "x%2Fapprove" is the call x/approve's path
    who = await _who(request)
    if who is None:  # back to the call's page, not to the action's path (a GET of it: 404)
        return _login_redirect(request, back=call_url(scope, tool_call_id))
    desk = desk_of(request)
    try:
        form = await _form(request, who)
        # a role that may not: 403 whatever else the form says, as the API answers (a
        # viewer's approval without a reason was 422 "a reason is required")
        who.require(Action.RETRY if action == "retry" else Action.DECIDE)
        reason = form.get("reason", "").strip()
        if not reason:
            raise InvalidArguments("a reason is required")
        if action in ("approve", "reject"):
            approve = action == "approve"

            def work() -> Any:
                return desk.decide(who, scope, tool_call_id, reason, approve=approve)

            done = "approved" if approve else "rejected"
        elif action == "retry":
            accept = form.get("accept_duplicate") == "yes"
            # the attempt the page showed
            attempt = _form_number(form.get("attempt", ""), 1, 2**31)
            if attempt is None:
                raise InvalidArguments("the page's attempt is missing: reload it")

            def work() -> Any:
                return desk.retry(
                    who, scope, tool_call_id, accept_duplicate=accept, reason=reason,
                    attempt=attempt,
                )  # fmt: skip

            done = "retried"
        else:  # pragma: no cover - the routes name the actions
            raise InvalidArguments(f"no action {action!r}")
        await run_in_threadpool(work)
    except LedgerError as exc:
        return await _call_page(
            request, who, scope, tool_call_id, status=_status_of(exc), error=str(exc)
        )
    return RedirectResponse(call_url(scope, tool_call_id, f"?done={done}"), status_code=303)


@router.post("/calls/{scope}/{tool_call_id:path}/approve")
async def approve(request: Request, scope: str, tool_call_id: str) -> Response:
    return await _act(request, scope, tool_call_id, "approve")


@router.post("/calls/{scope}/{tool_call_id:path}/reject")
async def reject(request: Request, scope: str, tool_call_id: str) -> Response:
    return await _act(request, scope, tool_call_id, "reject")


@router.post("/calls/{scope}/{tool_call_id:path}/retry")
async def retry(request: Request, scope: str, tool_call_id: str) -> Response:
    return await _act(request, scope, tool_call_id, "retry")


@router.post("/calls/{scope}/{tool_call_id:path}/resolve")
async def resolve(request: Request, scope: str, tool_call_id: str) -> Response:
    """Resolve one execution of this call (the form names it) with evidence."""
    require_suffix(request, "resolve")
    who = await _who(request)
    if who is None:
        return _login_redirect(request, back=call_url(scope, tool_call_id))
    desk = desk_of(request)
    try:
        form = await _form(request, who)
        who.require(Action.RESOLVE)  # before the form's fields, as the API (and _act)
        execution_id, as_ = form.get("execution_id", ""), form.get("as", "")
        evidence = form.get("evidence", "")
        # the page's form for a flagged execution says "yes": it showed the flag. A post
        # without it (a form for the unknown execution, loaded before the flag was raised)
        # is a resolution, never a review of a flag its sender did not see
        seen_flag = form.get("review")
        if seen_flag not in (None, "yes"):
            raise InvalidArguments("the form's review field is yes or absent: reload the page")
        review = seen_flag == "yes"
        seen: int | None = None
        if review:  # the page's newest event: the review is refused if the call moved since
            seen = _form_number(form.get("seen", ""), 0, 2**62)
            if seen is None:
                raise InvalidArguments("the page's newest event is missing: reload it")

        def work() -> Any:
            desk.check_visible(who, scope, tool_call_id)
            view = desk.ledger.get(scope, tool_call_id)
            if execution_id not in {e.execution_id for e in view.executions}:
                raise InvalidArguments("that execution is not one of this call's")
            return desk.resolve(who, execution_id, as_, evidence, review=review, seen=seen)

        await run_in_threadpool(work)
    except LedgerError as exc:
        return await _call_page(
            request, who, scope, tool_call_id, status=_status_of(exc), error=str(exc)
        )
    return RedirectResponse(call_url(scope, tool_call_id, "?done=resolved"), status_code=303)
