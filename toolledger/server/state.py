"""What the API and the console share: the ledger, the submitter, the authenticator, and the
operations a person may perform, each checked against the token's role and scopes."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from toolledger.config import Settings
from toolledger.ledger import inputs
from toolledger.ledger.errors import InputError, InvalidArguments, NotFound, StateError
from toolledger.ledger.identity import check_scope, check_text_id
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.lightreads import events_page
from toolledger.ledger.receipts import receipt_for
from toolledger.ledger.records import CallView, EventRecord, ListedCall
from toolledger.ledger.transitions import TERMINAL, EventKind, Status, fold_flags, parse_status
from toolledger.recovery.humans import resolve as resolve_call
from toolledger.recovery.humans import retry as retry_call
from toolledger.sandbox import ContentTooLarge
from toolledger.server.auth import Action, Authenticator, Session, Token
from toolledger.worker.reads import READS_AT_ONCE, ReadSlots
from toolledger.worker.submit import PreparedCall, Submitter

_T = TypeVar("_T")

#: Rows a page of the list holds at most.
PAGE_LIMIT = 500


#: Events a console's call page shows, the latest: 23,000 ``linked`` events an agent made by
#: linking ids to one key made a 5.8 MB page (a cold review). The rest: ``events --after``.
PAGE_EVENTS = 500
#: The kinds of event a person's decision writes (the console's ``?done=`` notice reads them).
ACT_KINDS = frozenset(
    {EventKind.APPROVED, EventKind.REJECTED, EventKind.SUCCEEDED, EventKind.FAILED}
    | {EventKind.REVIEWED}
)


def encode_cursor(position: tuple[datetime, str, str]) -> str:
    at, scope, key = position
    raw = json.dumps([at.isoformat(), scope, key], ensure_ascii=False).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str, str]:
    """A position this server gave out: an aware time, a scope and a key the ledger could
    hold (anything else is refused here, never handed to the database)."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        at, scope, key = inputs.loads(raw, "cursor")
        when = datetime.fromisoformat(at)
        if when.tzinfo is None:
            raise ValueError("a naive time")
        # in UTC here, as the ledger binds it: 0001-01-01T00:00+01:00 is before year 1, and
        # overflowed in SQLite's binding, a 500 (a cold review)
        when = when.astimezone(UTC)
        return when, check_scope(scope), check_text_id(key, "key")
    except (ValueError, TypeError, OverflowError, InputError):
        raise InvalidArguments("cursor is not one this server gave out") from None


@dataclass
class Page:
    calls: list[ListedCall]
    next_cursor: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "count": len(self.calls),
            "calls": [c.to_json() for c in self.calls],
            "next_cursor": self.next_cursor,
        }


@dataclass(frozen=True)
class Submission:
    """A submit that passed every check that writes nothing (``Desk.prepare``)."""

    call: PreparedCall
    approved_by: str | None
    reason: str | None


#: The largest file a call's page reads to compare with the request.
FILE_CHECK_BYTES = 64 << 20


@dataclass(frozen=True)
class FileFacts:
    """What a call's page says of a sandbox file's bytes against the requested content."""

    sha256: str
    size: int
    matches: bool
    contains: bool


def _examine(fd: int, wanted: bytes | None) -> FileFacts:
    with os.fdopen(fd, "rb", closefd=False) as f:
        current = f.read(FILE_CHECK_BYTES)
    return FileFacts(
        sha256=hashlib.sha256(current).hexdigest(),
        size=len(current),
        matches=wanted is not None and current == wanted,
        contains=wanted is not None and wanted in current,
    )


class FileChecks:
    """The console's file checks, kept by the file's (device, inode, size, mtime, ctime) and
    the requested content's sha256: the last ``size`` of them (facts only, never bytes). Views
    asking at once for a check not yet known wait for the one under way (``get``)."""

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._known: OrderedDict[tuple[Any, ...], FileFacts] = OrderedDict()
        self._under_way: dict[tuple[Any, ...], threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, ...], examine: Callable[[], FileFacts]) -> FileFacts:
        with self._lock:
            if (known := self._known.get(key)) is not None:
                self._known.move_to_end(key)
                return known
            turn = self._under_way.setdefault(key, threading.Lock())
        with turn:  # one examines; the others wait for it and read what it found
            with self._lock:
                if (known := self._known.get(key)) is not None:
                    return known
            try:
                facts = examine()
            except BaseException:
                with self._lock:
                    self._under_way.pop(key, None)
                raise
            with self._lock:  # known before the turn is dropped: a late view finds it
                self._known[key] = facts
                while len(self._known) > self.size:
                    self._known.popitem(last=False)
                self._under_way.pop(key, None)
            return facts


class Desk:
    """The operations of the API and the console, as one token may perform them."""

    def __init__(self, settings: Settings, auth: Authenticator, *, submitter: Submitter) -> None:
        self.settings = settings
        self.auth = auth
        self.submitter = submitter
        self._reader: Ledger | None = None
        self._making_reader = threading.Lock()
        # read-only calls run apart from the pool every sync endpoint shares, so many at once
        # and so long (``api.submit``): the tool's hard limit, as a worker gives any other tool
        self.reads = ReadSlots(READS_AT_ONCE)
        self.read_timeout = settings.time_limit
        self.file_checks = FileChecks()

    @property
    def ledger(self) -> Ledger:
        """The ledger every write goes through (the submitter's)."""
        return self.submitter.ledger

    @property
    def reader(self) -> Ledger:
        """The ledger pages read from. On Postgres its own pool: autocommit (a read-committed
        read sees the same in or out of a transaction, and skips the rollback round trip) and
        no ping at checkout (a connection the server dropped fails its first statement and
        the read is tried again once, ``_read``): a page is four statements, not eight."""
        if self._reader is None:
            with self._making_reader:  # made once: 40 first requests at once made 39 pools
                if self._reader is None:
                    self._reader = self._new_reader()
        return self._reader

    def _new_reader(self) -> Ledger:
        if self.ledger.dialect != "postgresql":
            return self.ledger
        from toolledger.ledger.db import create_engine

        engine = create_engine(
            self.settings.db,
            timeout=self.settings.db_timeout,
            statement_timeout=False,
            pool_pre_ping=False,
            isolation_level="AUTOCOMMIT",
            pool_size=8,
            max_overflow=16,
        )
        return Ledger(engine, max_args_bytes=self.settings.max_args_bytes)

    def _read(self, work: Callable[[Ledger], _T]) -> _T:
        """``work`` on the reader, once more if its connection turned out to be dead."""
        import sqlalchemy as sa

        try:
            return work(self.reader)
        except sa.exc.DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
            return work(self.reader)

    # ------------------------------------------------------------------ sessions

    def session_live(self, session: Session) -> bool:
        """Not ended by a logout (in this process or any other)."""
        return not self._read(lambda ledger: ledger.session_ended(session.id))

    def end_session(self, session: Session) -> None:
        """Logout: the session is refused from now on, by every server process."""
        expires = datetime.fromtimestamp(session.expires, UTC)
        self.ledger.end_session(session.id, session.token.name, expires)

    def close(self) -> None:
        if self._reader is not None and self._reader is not self.ledger:
            self._reader.close()

    # ------------------------------------------------------------------ reads

    @staticmethod
    def check_visible(who: Token, scope: str, tool_call_id: str) -> None:
        if not who.sees(scope):  # as if it did not exist: the same words as the ledger's
            raise NotFound(f"no call {tool_call_id!r} in scope {scope!r}")

    def list_calls(
        self,
        who: Token,
        *,
        status: str | None = None,
        scope: str | None = None,
        review: bool = False,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page:
        who.require(Action.READ)
        if not 1 <= limit <= PAGE_LIMIT:
            raise InvalidArguments(f"limit must be 1..{PAGE_LIMIT}")
        wanted = parse_status(status) if status else None
        after = decode_cursor(cursor) if cursor else None
        scope = scope or None  # empty: no filter, as status and cursor (a form's empty field)
        if scope is not None:
            check_scope(scope)
        if scope is not None and not who.sees(scope):
            return Page([], None)
        rows = self._read(
            lambda r: r.list_calls(
                status=wanted,
                scope=scope,
                review=review,
                limit=limit + 1,
                scopes=who.scopes,
                after=after,
            )
        )
        more = len(rows) > limit
        rows = rows[:limit]
        return Page(rows, encode_cursor(rows[-1].position) if more else None)

    def inbox(self, who: Token) -> dict[str, int]:
        who.require(Action.READ)
        return self._read(lambda r: r.inbox_counts(who.scopes))

    def show(self, who: Token, scope: str, tool_call_id: str) -> dict[str, Any]:
        """The CLI's ``show --json``: the call, its attempts, the receipt."""
        who.require(Action.READ)
        self.check_visible(who, scope, tool_call_id)
        return self._show(*self._read(lambda r: r.history(scope, tool_call_id)))

    @staticmethod
    def _show(view: CallView, history: list[EventRecord]) -> dict[str, Any]:
        try:
            receipt = receipt_for(view.operation, view.current, flags=view.flags)
        except StateError:
            receipt = None
        data = view.to_json(receipt)
        # the newest event the page shows: what its review form says it saw (``seen``)
        data["last_seq"] = history[-1].seq if history else None
        if view.operation.review:
            flags = [e for e in history if e.kind == "flagged"]
            data["review_detail"] = flags[-1].detail if flags else None
        return data

    def page(self, who: Token, scope: str, tool_call_id: str) -> dict[str, Any]:
        """Everything the console's call page shows: the call, the history, the evidence and,
        for a sandbox tool, the file as it is now against what was asked."""
        who.require(Action.READ)
        self.check_visible(who, scope, tool_call_id)
        view, history = self._read(lambda r: r.history(scope, tool_call_id))
        call = self._show(view, history)
        flags = self._waiting_flags(history)
        shown = history[-PAGE_EVENTS:]  # the latest: where the call stands
        return {
            "call": call,
            "events": [e.to_json() for e in shown],
            "events_hidden": len(history) - len(shown),
            # a person's own acts, wherever they are in the history (``?done=``'s notice)
            "acts": [e.to_json() for e in history if e.kind in ACT_KINDS],
            "file": self._file_check(view),
            "view": view,
            "flags": flags,
            "to_settle": self._to_settle(call, flags),
        }

    @staticmethod
    def _waiting_flags(history: list[EventRecord]) -> dict[str, str]:
        """The executions a flag still waits on, and its reason (a review settles the flags
        raised on the execution it names, and only those: ``fold_flags``)."""
        kinds = (EventKind.FLAGGED, EventKind.REVIEWED)
        waiting, _ = fold_flags(
            (e.kind, e.execution_id or "", e.detail) for e in history if e.kind in kinds
        )
        return {f.execution_id: f.reason for f in reversed(waiting)}  # the first one's reason

    @staticmethod
    def _to_settle(call: dict[str, Any], flags: dict[str, str]) -> list[dict[str, Any]]:
        """The executions the page's resolve forms name: each unknown one and each a flag
        waits on. Only the last one was named (or the unknown ones), where a ``both_ran`` or
        ``contradicted`` flag sits on the earlier, proven attempt: the ledger refused the
        form, and nothing on the page settled the flag (a cold review)."""
        executions: list[dict[str, Any]] = call["executions"]
        named = [e for e in executions if e["status"] == "unknown" or e["execution_id"] in flags]
        if not named and call["review"]:  # flagged, on no execution it names: as before
            return executions[-1:]
        return named

    def _file_check(self, view: CallView) -> dict[str, Any] | None:
        """The file as it is now against the request. What was learnt of the file's bytes is
        kept by the file's identity, size and times (``FileChecks``): each view of a call
        on a 60 MB file read and hashed it again, 250 ms a view, and 40 views at once took
        6.6 s (a cold review)."""
        op = view.operation
        try:
            tool = self.submitter.registry.get(op.tool)
        except Exception:  # noqa: BLE001 - a tool no longer registered: no file to compare
            return None
        path, content = op.args.get("path"), op.args.get("content")
        if not (tool.sandboxed and isinstance(path, str)):
            return None
        wanted = content.encode() if isinstance(content, str) else None
        wanted_sha = hashlib.sha256(wanted).hexdigest() if wanted is not None else None
        try:
            facts = self._file_facts(op.scope, path, wanted, wanted_sha)
        except Exception as exc:  # noqa: BLE001 - shown as it is: the file cannot be read
            return {"path": path, "error": f"{type(exc).__name__}: {exc}"}
        out: dict[str, Any] = {
            "path": path,
            # Bytes for the path waiting to land (committed, a receipt given, or staged by a
            # running call): the file as it stands is not what the ledger says it will hold.
            # Without it, a call seen succeeded a moment before its bytes landed read "the
            # requested content is not in the file" (CI, under load).
            "pending": self._pending_on(op.scope, path),
            "exists": facts is not None,
            "sha256": facts.sha256 if facts is not None else None,
            "size": facts.size if facts is not None else None,
        }
        if wanted_sha is not None:
            out["requested_sha256"] = wanted_sha
            out["matches"] = facts is not None and facts.matches
            out["contains"] = facts is not None and facts.contains
        return out

    def _file_facts(
        self, scope: str, path: str, wanted: bytes | None, wanted_sha: str | None
    ) -> FileFacts | None:
        """The file's facts, None if it is absent: from ``file_checks`` while the file's
        device, inode, size and modification and change times are those it was read at (a
        write changes the times, a rename the inode), else read and hashed once however
        many views ask at once."""
        sandbox = self.submitter.sandbox
        with sandbox.open_regular(scope, path) as fd:
            if fd is None:
                return None
            st = os.fstat(fd)
            if st.st_size > FILE_CHECK_BYTES:
                raise ContentTooLarge(
                    f"{path!r} is {st.st_size} bytes, over the cap of {FILE_CHECK_BYTES}"
                )
            key = (
                scope, path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                wanted_sha,
            )  # fmt: skip
            return self.file_checks.get(key, lambda: _examine(fd, wanted))

    def _pending_on(self, scope: str, path: str) -> bool:
        from toolledger.effects import effects_of

        try:
            return effects_of(self.submitter.sandbox).pending_on(scope, path)
        except Exception:  # noqa: BLE001 - cannot tell: said as not waiting, the file as it is
            return False

    def events(
        self, who: Token, scope: str, tool_call_id: str, *, after: int = 0, limit: int = 0
    ) -> dict[str, Any]:
        """The CLI's ``events --json`` (``--after``, ``--limit``)."""
        who.require(Action.READ)
        self.check_visible(who, scope, tool_call_id)
        return self._read(lambda r: events_page(r, scope, tool_call_id, after=after, limit=limit))

    # ------------------------------------------------------------------ writes

    def submit(self, who: Token, body: dict[str, Any]) -> dict[str, Any]:
        """The CLI's ``submit --json``; ``approve: true`` approves at once in the token's name
        (a role that may decide only: an agent never approves its own calls)."""
        return self.record(who, self.prepare(who, body))

    def prepare(self, who: Token, body: dict[str, Any]) -> Submission:
        """Every check of a submit that writes nothing: whether the call is read-only (run at
        once, where it is asked) is known then."""
        who.require(Action.SUBMIT)
        known = {"scope", "tool_call_id", "tool", "args", "key", "approve", "reason"}
        extra = sorted(set(body) - known)
        if extra:
            raise InvalidArguments(f"unknown field(s): {', '.join(extra)}")
        scope, call_id, tool, args = (
            body.get(f) for f in ("scope", "tool_call_id", "tool", "args")
        )
        for name, value in (("scope", scope), ("tool_call_id", call_id), ("tool", tool)):
            if not isinstance(value, str):
                raise InvalidArguments(f"{name} must be a string")
        if not isinstance(args, dict):
            raise InvalidArguments("args must be a JSON object")
        key, approve, reason = body.get("key"), body.get("approve", False), body.get("reason")
        if key is not None and not isinstance(key, str):
            raise InvalidArguments("key must be a string")
        if not isinstance(approve, bool):
            raise InvalidArguments("approve must be true or false")
        if reason is not None and not isinstance(reason, str):
            raise InvalidArguments("reason must be a string")
        assert isinstance(scope, str) and isinstance(call_id, str) and isinstance(tool, str)
        if not who.sees(scope):
            raise NotFound(f"no scope {scope!r} for token {who.name!r}")
        if approve:
            who.require(Action.DECIDE)
        call = self.submitter.prepare(scope, call_id, tool, args, key)
        return Submission(call, who.name if approve else None, reason)

    def record(self, who: Token, sub: Submission) -> dict[str, Any]:
        """A prepared submit recorded (or, read-only, run) in the token's name."""
        return self.submitter.submit(
            sub.call, approved_by=sub.approved_by, reason=sub.reason, actor=who.name
        )

    def decide(
        self, who: Token, scope: str, tool_call_id: str, reason: str | None, *, approve: bool
    ) -> dict[str, Any]:
        who.require(Action.DECIDE)
        self.check_visible(who, scope, tool_call_id)
        out = self.submitter.decide(scope, tool_call_id, who.name, reason, approve=approve)
        return out

    def retry(
        self,
        who: Token,
        scope: str,
        tool_call_id: str,
        *,
        accept_duplicate: bool,
        reason: str | None,
        attempt: int | None = None,
    ) -> dict[str, Any]:
        who.require(Action.RETRY)
        self.check_visible(who, scope, tool_call_id)
        sub = self.submitter
        return retry_call(
            sub.ledger,
            sub.registry,
            sub.enqueue,
            scope,
            tool_call_id,
            by=who.name,
            accept_duplicate=accept_duplicate,
            reason=reason,
            attempt=attempt,
        )

    def resolve(
        self,
        who: Token,
        execution_id: str,
        as_: str,
        evidence: str,
        *,
        review: bool = False,
        seen: int | None = None,
    ) -> dict[str, Any]:
        who.require(Action.RESOLVE)
        check_text_id(execution_id, "execution_id", 64)
        execution = self.ledger.execution(execution_id)  # NotFound if there is none
        if not who.sees(execution.scope):
            raise NotFound(f"no execution {execution_id!r}")
        if as_ not in {s.value for s in TERMINAL}:
            raise InvalidArguments("as must be succeeded or failed")
        if not isinstance(evidence, str) or not evidence.strip():
            raise InvalidArguments("evidence is required: what did you see that proves it?")
        return resolve_call(
            self.ledger,
            execution_id,
            Status(as_),
            by=who.name,
            evidence=evidence,
            review=review,
            seen=seen,
        )
