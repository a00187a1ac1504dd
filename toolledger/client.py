"""The API an agent calls: submit a turn's tool calls, wait for their receipts.

    from toolledger import Client

    with Client() as client:                      # Settings from the environment, like the CLI
        handle = client.submit("run-42", "call_1", "write_file",
                               {"path": "a.txt", "content": "hi"}, approved_by="policy")
        receipt = handle.result(timeout=30)       # succeeded / failed / rejected / unknown
        messages.append(receipt.to_openai())

``AsyncClient`` has the same methods as coroutines. A waiter is **woken by the database**:
on Postgres by ``LISTEN toolledger_receipts`` (a trigger NOTIFYs in the very transaction that
writes a receipt, so a wake-up is never earlier than the commit and never lost once the
listener is connected); on the embedded default by the ledger file's doorbells (a datagram
the committing process sends after its commit, ``ledger.doorbell``). Either way a waiter
also re-reads every ``poll_interval`` seconds (default :data:`FALLBACK_POLL`) in case a wake-up
never comes (a listener reconnecting, another network namespace); ``stats`` counts receipts
found that way, which should stay 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from toolledger.config import Settings
from toolledger.ledger import doorbell
from toolledger.ledger.db import ensure_schema
from toolledger.ledger.errors import InputError, NoReceipt
from toolledger.ledger.inputs import wait_seconds
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.receipts import receipt_for
from toolledger.ledger.records import CallView, Receipt
from toolledger.ledger.transitions import RECEIPT_STATUSES, Status

if TYPE_CHECKING:
    from toolledger.tools import Registry
    from toolledger.turns import CallsWaiting
    from toolledger.worker.submit import PreparedCall

log = logging.getLogger("toolledger.client")
P = ParamSpec("P")
T = TypeVar("T")

#: Seconds between a waiter's re-reads when nothing woke it (insurance, not the mechanism).
FALLBACK_POLL = 10.0
#: Seconds between re-reads when no wake-up can come at all (``Notifier.unavailable``), or
#: while the database does not answer.
UNAVAILABLE_POLL = 0.05
#: The channel the receipt trigger notifies (migration 0003).
CHANNEL = "toolledger_receipts"
#: The listener's application_name in pg_stat_activity.
LISTENER_NAME = "toolledger-receipts"
#: ``ReceiptTimeout.status`` when no read answered within the timeout: where the call
#: stands is not known.
UNANSWERED = "unanswered"


def _start_wait(timeout: float | None) -> float:
    """How long a wait may wait for the listener to start: 5 s, or less if its timeout is."""
    return 5.0 if timeout is None else max(0.0, min(5.0, timeout))


class ReceiptTimeout(TimeoutError):
    """No receipt within the timeout; ``status`` is where the call stands (for example
    ``pending_approval``: it waits for a human). ``unanswered``: the database did not answer
    the wait's last read within the timeout, and ``status`` is what the last answer said
    (:data:`UNANSWERED` if none did)."""

    def __init__(
        self,
        scope: str,
        tool_call_id: str,
        status: str,
        waited: float,
        *,
        unanswered: bool = False,
    ) -> None:
        head = f"no receipt for {tool_call_id!r} in scope {scope!r} after {waited:.3g} s: "
        if not unanswered:
            said = f"it is {status}"
        elif status == UNANSWERED:
            said = "the database did not answer"
        else:
            said = f"the database did not answer (it was {status} at its last answer)"
        super().__init__(head + said)
        self.scope, self.tool_call_id, self.status = scope, tool_call_id, status
        self.unanswered = unanswered


class _Unanswered(Exception):
    """A wait's read given up at its deadline (its thread goes on until the server answers)."""


def _read_apart(read: Callable[[], Any], deliver: Callable[[bool, Any], None]) -> None:
    """``read()`` in a daemon thread of its own, its value or exception given to ``deliver``.

    The database's own timeouts cannot bound a wait: a statement timeout is the server's to
    enforce, and a frozen server's kernel still acknowledges every packet, so no TCP timeout
    fires (``wait --timeout 5`` exited 7 after 42 s behind a 40 s freeze). A wait's reads run
    apart, and one that overruns the wait's deadline is left behind: it ends, and gives its
    connection back to the pool, when the server answers or the connection breaks. Not in a
    pool of threads, where left-behind reads would hold the threads other work waits for (an
    event loop's default executor: 6 threads on 2 cores, and ``asyncio.run`` waits for them
    at its end). On Postgres only: an embedded ledger's reads do not wait on a writer (WAL),
    and an in-memory one is a connection per thread (another thread's is empty)."""

    def run() -> None:
        try:
            outcome: tuple[bool, Any] = (True, read())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            outcome = (False, exc)
        deliver(*outcome)

    threading.Thread(target=run, name="toolledger-wait-read", daemon=True).start()


def _within(
    deadline: float | None, grace: float, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs
) -> T:
    """``fn(...)``, given up with ``_Unanswered`` ``grace`` seconds past ``deadline`` (see
    ``_read_apart``). The grace is the settings' ``db_timeout``, what any statement of the
    ledger may take: a read sent near the deadline, or after it (``wait(timeout=0)``, the MCP
    server's look at a call after a cut), is not a frozen server's for taking longer than a
    fixed quarter second did (a healthy database 50 ms away answered "did not answer" for a
    call that had its receipt: a cold review)."""
    if deadline is None:
        return fn(*args, **kwargs)
    while True:
        answer = _one_read(lambda: fn(*args, **kwargs), deadline - time.monotonic() + grace)
        if answer is None:
            raise _Unanswered
        ok, value = answer
        if ok:
            return value  # type: ignore[no-any-return]
        if not _connect_timed_out(value):
            raise value
        if time.monotonic() >= deadline:
            raise _Unanswered  # bounded by its connect timeout now: the same silence
        # time is left: connect again, as a read still waiting would have (helper-94: the
        # wait ended at the first connect's timeout, 2 s into a 30 s wait)


def _one_read(read: Callable[[], Any], wait: float) -> tuple[bool, Any] | None:
    """``read()`` apart (``_read_apart``): (True, its value) or (False, its exception), or
    None if it has not answered within ``wait`` seconds."""
    box: list[tuple[bool, Any]] = []
    done = threading.Event()

    def deliver(ok: bool, value: Any) -> None:
        box.append((ok, value))
        done.set()

    _read_apart(read, deliver)
    return box[0] if done.wait(max(0.0, wait)) else None


def _connect_timed_out(exc: BaseException) -> bool:
    """A read whose connection was not answered within its connect timeout (libpq's): a
    frozen server's, as a read given up on is (since the clients' ledger is bounded by
    ``db_timeout``, its connect times out near the grace's end: the wait said "database
    unavailable" instead of "did not answer" about as often as not)."""
    try:
        from psycopg.errors import ConnectionTimeout
    except ImportError:  # pragma: no cover - the SQLite-only install
        return False
    return isinstance(getattr(exc, "orig", None), ConnectionTimeout)


def receipt_of(view: CallView) -> Receipt | None:
    """The call's receipt if it has one (None: pending approval, approved or running)."""
    op = view.operation
    if op.status not in RECEIPT_STATUSES:
        return None
    try:
        r = receipt_for(op, view.current, flags=view.flags)
    except NoReceipt:
        return None
    current = view.current
    reconciled = bool(current and current.reconciled and r.execution_id == current.execution_id)
    return Receipt(
        r.status, r.content, r.execution_id, view.scope, view.tool_call_id, reconciled,
        op.review, r.disputed,
    )  # fmt: skip


# ------------------------------------------------------------------------ wake-ups


#: Every Notifier and Stats of this process, made anew in a forked child (``_after_fork``).
_FORKED: weakref.WeakSet[Any] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for held in list(_FORKED):
        with contextlib.suppress(Exception):
            held._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


Key = tuple[str, str]


class Notifier:
    """One listener per client (a thread), dispatching wake-ups to the waiters of a call.

    ``watch`` registers a callback *before* the waiter's first read: a receipt committed
    between that read and the wait still wakes it."""

    def __init__(self, db_url: str) -> None:
        from toolledger.ledger.db import normalize_url

        self.url = normalize_url(db_url)
        self._watchers: dict[Key, list[Callable[[], None]]] = defaultdict(list)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.woken = 0
        #: Seconds before the first reconnect of a lost listener (then doubling, up to 5).
        self.reconnect_pause = 0.2
        #: No wake-ups can come (an in-memory database, no bell directory): waiters poll.
        self.unavailable = False
        _FORKED.add(self)

    def _after_fork(self) -> None:
        """In a forked child: the listener is the parent's (its thread did not come along,
        its socket is the parent's session), and so are the waiters; the child starts its own
        at its first wait. Inherited as started, it never rang a child's waiter: each found
        its receipt at a fallback read, 10 s late, in every child of a prefork server made
        after the parent's first wait (a cold review). The parent's connection is left open
        and unused: closing it in the child would end the parent's session."""
        stopped = self._stop.is_set()  # a client closed before the fork stays closed
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self._watchers = defaultdict(list)
        self._ready, self._stop = threading.Event(), threading.Event()
        if stopped:
            self._stop.set()
        self._thread = None
        self.unavailable = False

    @property
    def postgres(self) -> bool:
        return self.url.startswith("postgresql")

    def start(self, wait: float = 5.0) -> bool:
        """Start listening (once); True when wake-ups are live."""
        with self._lock:
            if self._thread is None:
                target = self._run_postgres if self.postgres else self._run_doorbell
                self._thread = threading.Thread(
                    target=target, name="toolledger-notify", daemon=True
                )
                self._thread.start()
        return self._ready.wait(wait) and not self.unavailable

    @contextlib.contextmanager
    def watch(self, key: Key, wake: Callable[[], None]) -> Iterator[None]:
        with self._lock:
            self._watchers[key].append(wake)
        try:
            yield
        finally:
            with self._lock:
                callbacks = self._watchers[key]
                callbacks.remove(wake)
                if not callbacks:
                    del self._watchers[key]

    def dispatch(self, payload: bytes | str) -> None:
        try:
            keys = json.loads(payload)
            if keys and isinstance(keys[0], str):  # Postgres: one [scope, key]
                keys = [keys]
            found = [tuple(k) for k in keys]
        except (ValueError, TypeError, IndexError):
            found = None  # not ours to read: wake everyone, they will look
        with self._lock:
            if found is None:
                callbacks = [cb for cbs in self._watchers.values() for cb in cbs]
            else:
                callbacks = [cb for k in found for cb in self._watchers.get(k, ())]
        for cb in callbacks:
            self.woken += 1
            try:
                cb()
            except Exception as exc:  # noqa: BLE001 - one waiter's wake-up, not the listener's
                # (one that raised ended the embedded listener's thread, and sent the Postgres
                # one reconnecting at every ring, the waiters after it never woken: a review)
                log.warning("a waiter's wake-up failed: %s: %s", type(exc).__name__, exc)

    def wake_all(self) -> None:
        self.dispatch(b"")

    def _run_postgres(self) -> None:
        import psycopg

        conninfo = self.url.replace("postgresql+psycopg://", "postgresql://", 1)
        failures = 0
        while not self._stop.is_set():
            try:
                with psycopg.connect(
                    conninfo,
                    autocommit=True,
                    connect_timeout=5,
                    application_name=LISTENER_NAME,
                    client_encoding="UTF8",  # a call's id in a payload, on SQL_ASCII too
                ) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self._ready.set()
                    self.wake_all()  # (re)connected: anything may have been missed meanwhile
                    failures = 0
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=1.0):
                            self.dispatch(note.payload)
            except Exception as exc:  # noqa: BLE001 - a listener reconnects, whatever broke
                self._ready.clear()
                if self._stop.is_set():
                    return
                log.warning("receipt listener: %s; reconnecting", " ".join(str(exc).split()))
                self._stop.wait(min(self.reconnect_pause * 2**failures, 5.0))
                failures += 1

    def _run_doorbell(self) -> None:
        import sqlalchemy as sa

        database = sa.make_url(self.url).database
        try:
            if not database or database == ":memory:":
                raise OSError("an in-memory database has no bell directory")
            bell = doorbell.Doorbell(doorbell.bell_dir(database))
        except OSError as exc:
            log.warning("no wake-ups (%s): waiters poll every %s s", exc, UNAVAILABLE_POLL)
            self.unavailable = True
            self._ready.set()
            return
        with bell:
            self._ready.set()
            while not self._stop.is_set():
                for payload in bell.wait(1.0):
                    self.dispatch(payload)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=3)


# ------------------------------------------------------------------------ the client


@dataclass(eq=False)  # one per client, told apart by identity (a fork renews its lock)
class Stats:
    """How waits ended. ``woken``: the receipt was there at the first read or at a read a
    wake-up caused; ``found_by_poll``: at a fallback read (should stay 0: a wake-up missed);
    ``fallback_reads``: fallback reads done; ``timeouts``: waits that ran out."""

    woken: int = 0
    found_by_poll: int = 0
    timeouts: int = 0
    fallback_reads: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        _FORKED.add(self)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork

    def add(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)


class CallHandle:
    """One submitted call; ``result()`` waits for its receipt."""

    def __init__(
        self, client: Client, scope: str, tool_call_id: str, submitted: dict[str, Any]
    ) -> None:
        self.client, self.scope, self.tool_call_id = client, scope, tool_call_id
        self.submitted = submitted
        self.idempotency_key: str = submitted["idempotency_key"]
        self._immediate = _read_only_receipt(scope, tool_call_id, submitted)

    @property
    def status(self) -> str:
        return str(self.submitted["status"])

    @property
    def receipt_in_hand(self) -> Receipt | None:
        """A read-only call's receipt, which its submit ran and answered (no wait needed)."""
        return self._immediate

    def result(self, timeout: float | None = None) -> Receipt:
        if self._immediate is not None:
            return self._immediate
        return self.client.wait(self.scope, self.tool_call_id, timeout=timeout)


def _read_only_receipt(scope: str, tool_call_id: str, out: dict[str, Any]) -> Receipt | None:
    """A read-only call ran at once and was not recorded: its receipt is its result."""
    if out.get("outcome") != "read_only":
        return None
    return Receipt(Status(out["status"]), out["result"], None, scope, tool_call_id)


class Client:
    """Submit tool calls, decide on them, and wait for their receipts (thread-safe)."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        poll_interval: float = FALLBACK_POLL,
        registry: Registry | None = None,
    ) -> None:
        """``registry``: the tools calls are checked against (default: the settings' tools,
        loaded here; a client that only waits and decides may give ``Registry()``)."""
        from toolledger.worker.submit import Submitter

        self.settings = settings if settings is not None else Settings.from_env()
        self._submitter = Submitter(self.settings, registry=registry)
        try:  # as the CLI and the workers do: nothing read or written on another schema
            ensure_schema(self._submitter.ledger.engine)
        except BaseException:
            self._submitter.close()
            raise
        self.poll_interval = poll_interval
        self.notifier = Notifier(self.settings.db)
        self.stats = Stats()

    # ------------------------------------------------------------------ parts

    @property
    def ledger(self) -> Ledger:
        return self._submitter.ledger

    def warm(self) -> None:
        """Import now what the first submit's publish would import between its call's commit
        and its publish (``Submitter.warm``): for a process that submits at once when asked,
        and may be killed then (``mcp serve``)."""
        self._submitter.warm()

    def close(self) -> None:
        self.notifier.close()
        self._submitter.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ------------------------------------------------------------------ calls

    def check(
        self,
        scope: str,
        tool_call_id: str,
        tool: str,
        args: dict[str, Any],
        *,
        key: str | None = None,
    ) -> PreparedCall:
        """Every check ``submit`` makes before it records anything (identifiers, size, the
        tool, its schema, sandbox paths) and the conflict it would find with what the ledger
        holds now (the id or key recorded for other arguments), recording nothing:
        InputError, UnknownTool or ConflictError. Returns the checked call, which
        ``submit_checked`` records without checking it twice."""
        call = self._submitter.prepare(scope, tool_call_id, tool, args, key)
        conflict = self.ledger.conflict_of(scope, tool_call_id, call.key, tool, call.args_sha256)
        if conflict is not None:
            raise conflict
        return call

    def submit(
        self,
        scope: str,
        tool_call_id: str,
        tool: str,
        args: dict[str, Any],
        *,
        key: str | None = None,
        approved_by: str | None = None,
        reason: str | None = None,
    ) -> CallHandle:
        """Validate, record and enqueue one call (a read-only tool runs at once). Submitting
        the same call again finds it: never a second action."""
        call = self._submitter.prepare(scope, tool_call_id, tool, args, key)
        return self._record(call, approved_by, reason)

    def submit_checked(
        self, call: PreparedCall, *, approved_by: str | None = None, reason: str | None = None
    ) -> CallHandle:
        """``submit`` of a call ``check`` returned: recorded and enqueued as ``submit`` would
        (a conflict that arose since the check is still refused by the ledger; arguments
        changed since the check are refused, nothing recorded: check them again)."""
        from toolledger.ledger.identity import args_sha256

        if args_sha256(call.args) != call.args_sha256:
            raise InputError(f"{call.tool_call_id}: its arguments changed after they were checked")
        return self._record(call, approved_by, reason)

    def _record(
        self, call: PreparedCall, approved_by: str | None, reason: str | None
    ) -> CallHandle:
        out = self._submitter.submit(call, approved_by=approved_by, reason=reason)
        return CallHandle(self, call.scope, call.tool_call_id, out)

    def approve(
        self, scope: str, tool_call_id: str, *, by: str, reason: str | None = None
    ) -> dict[str, Any]:
        return self._submitter.decide(scope, tool_call_id, by, reason, approve=True)

    def reject(
        self, scope: str, tool_call_id: str, *, by: str, reason: str | None = None
    ) -> dict[str, Any]:
        return self._submitter.decide(scope, tool_call_id, by, reason, approve=False)

    def retry(
        self,
        scope: str,
        tool_call_id: str,
        *,
        by: str,
        accept_duplicate: bool = False,
        reason: str | None = None,
        attempt: int | None = None,
    ) -> dict[str, Any]:
        """``attempt``: the call's ``last_attempt`` as the decision saw it (refused,
        InvalidTransition, if there is a later attempt now)."""
        from toolledger.recovery import humans

        return humans.retry(
            self.ledger,
            self._submitter.registry,
            self._submitter.enqueue,
            scope,
            tool_call_id,
            by=by,
            accept_duplicate=accept_duplicate,
            reason=reason,
            attempt=attempt,
        )

    def resolve(
        self,
        execution_id: str,
        status: Status | str,
        *,
        by: str,
        evidence: str,
        review: bool = False,
        seen: int | None = None,
    ) -> dict[str, Any]:
        """A human's resolution of an unknown execution; ``review=True`` to settle the flag
        on its call that the person has looked at (``humans.resolve``). ``seen``, with
        ``review`` (as the CLI's ``--seen``): the ``seq`` of the call's newest event the
        person looked at; the review is refused (``StaleFence``, "look again") if a flag it
        would settle was raised since or the call changed."""
        from toolledger.recovery import humans

        if seen is not None and not review:  # as the CLI's and the API's refusal
            raise InputError("seen goes with review=True: it says what the review saw")
        return humans.resolve(
            self.ledger,
            execution_id,
            Status(status),
            by=by,
            evidence=evidence,
            review=review,
            seen=seen,
        )

    def receipt(self, scope: str, tool_call_id: str) -> Receipt | None:
        """The call's receipt now, or None if it has none yet (NotFound if no such call)."""
        return receipt_of(self.ledger.get(scope, tool_call_id))

    def status(self, scope: str, tool_call_id: str) -> str:
        return self.ledger.get(scope, tool_call_id).operation.status.value

    # ------------------------------------------------------------------ waiting

    def wait(self, scope: str, tool_call_id: str, *, timeout: float | None = None) -> Receipt:
        """Block until the call has a receipt; ReceiptTimeout (a TimeoutError) after
        ``timeout`` seconds, carrying the call's status."""
        timeout = wait_seconds(timeout)
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        status = UNANSWERED  # what the last read said (every read given up at the deadline)
        apart = deadline if self.notifier.postgres else None  # _read_apart
        grace = self.settings.db_timeout
        try:
            view = _within(apart, grace, self.ledger.get, scope, tool_call_id)  # NotFound first
            status = view.operation.status.value
            if (found := receipt_of(view)) is not None:  # in hand: no second read to lose it
                self.stats.add("woken")
                return found
            key = (scope, view.operation.idempotency_key)
            self.notifier.start(_start_wait(timeout))  # never past the timeout: it re-reads
            rung = threading.Event()
            by_poll = False
            with self.notifier.watch(key, rung.set):
                # read again now that a ring would reach us: one between the first read and
                # the watch is not lost
                view = _within(apart, grace, self.ledger.get, scope, tool_call_id)
                answered = True  # did the last read answer (else view is an older answer)
                while True:
                    status = view.operation.status.value
                    left = None if deadline is None else deadline - time.monotonic()
                    waited = time.monotonic() - started
                    if (found := self._ended(view, by_poll, left, waited, answered)) is not None:
                        return found
                    wait = self._interval(left)
                    by_poll = not rung.wait(wait)
                    rung.clear()
                    if by_poll:
                        self.stats.add("fallback_reads")
                    again = _within(apart, grace, self._reread, scope, tool_call_id, deadline)
                    answered = again is not None
                    view = view if again is None else again
        except _Unanswered:
            self.stats.add("timeouts")
            waited = time.monotonic() - started
            raise ReceiptTimeout(scope, tool_call_id, status, waited, unanswered=True) from None

    def _ended(
        self,
        view: CallView,
        by_poll: bool,
        left: float | None,
        waited: float,
        answered: bool = True,
    ) -> Receipt | None:
        """A wait's look at what it read: the call's receipt if it has one (counted as found
        by a poll or a wake-up), ``ReceiptTimeout`` if no time is ``left``, else None. When
        the last read did not ``answer`` (``view`` is an older answer), the timeout says the
        database did not answer and what it said last, not that the call still stands so."""
        found = receipt_of(view)
        if found is not None:
            self.stats.add("found_by_poll" if by_poll else "woken")
            return found
        if left is not None and left <= 0:
            self.stats.add("timeouts")
            status = view.operation.status.value
            raise ReceiptTimeout(
                view.scope, view.tool_call_id, status, waited, unanswered=not answered
            )
        return None

    def _interval(self, left: float | None) -> float:
        poll = UNAVAILABLE_POLL if self.notifier.unavailable else self.poll_interval
        return poll if left is None else max(0.0, min(left, poll))

    def _reread(
        self, scope: str, tool_call_id: str, deadline: float | None = None
    ) -> CallView | None:
        """The call again; None while the database does not answer (a restart, a failover):
        the wait goes on with what it knew, until its timeout (a pause never runs past it)."""
        import sqlalchemy as sa

        try:
            return self.ledger.get(scope, tool_call_id)
        except sa.exc.OperationalError as exc:
            said = " ".join(str(exc.orig).split())  # libpq's messages span lines
            log.warning("waiting for %s/%s: %s", scope, tool_call_id, said)
            pause = min(1.0, self.poll_interval)
            if deadline is not None:
                pause = max(0.0, min(pause, deadline - time.monotonic()))
            time.sleep(pause)
            return None

    def run_turn(
        self,
        scope: str,
        message: dict[str, Any] | list[Any],
        *,
        approve: Callable[[str, str, dict[str, Any]], str | None] | None = None,
        timeout: float | None = None,
    ) -> list[dict[str, Any]]:
        """Submit one assistant message's tool calls in order, wait for all, and return the
        tool results in the message's own format (see ``toolledger.turns``)."""
        from toolledger.turns import run_turn

        return run_turn(self, scope, message, approve=approve, timeout=timeout)


class AsyncClient:
    """``Client``'s methods as coroutines: database work in threads, waits on the event loop
    (an idle waiter costs nothing but its fallback read)."""

    def __init__(
        self, settings: Settings | None = None, *, poll_interval: float = FALLBACK_POLL
    ) -> None:
        self.sync = Client(settings, poll_interval=poll_interval)

    @classmethod
    def of(cls, client: Client) -> AsyncClient:
        """The coroutines of an existing ``Client``: its ledger, listener and settings shared
        (closing either closes both)."""
        wrapped = cls.__new__(cls)
        wrapped.sync = client
        return wrapped

    @property
    def stats(self) -> Stats:
        return self.sync.stats

    @property
    def ledger(self) -> Ledger:
        return self.sync.ledger

    async def _run(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def check(
        self,
        scope: str,
        tool_call_id: str,
        tool: str,
        args: dict[str, Any],
        *,
        key: str | None = None,
    ) -> PreparedCall:
        return await self._run(self.sync.check, scope, tool_call_id, tool, args, key=key)

    async def submit(
        self,
        scope: str,
        tool_call_id: str,
        tool: str,
        args: dict[str, Any],
        *,
        key: str | None = None,
        approved_by: str | None = None,
        reason: str | None = None,
    ) -> AsyncCallHandle:
        handle = await self._run(
            self.sync.submit,
            scope,
            tool_call_id,
            tool,
            args,
            key=key,
            approved_by=approved_by,
            reason=reason,
        )
        return AsyncCallHandle(self, handle)

    async def submit_checked(
        self, call: PreparedCall, *, approved_by: str | None = None, reason: str | None = None
    ) -> AsyncCallHandle:
        handle = await self._run(
            self.sync.submit_checked, call, approved_by=approved_by, reason=reason
        )
        return AsyncCallHandle(self, handle)

    async def approve(
        self, scope: str, tool_call_id: str, *, by: str, reason: str | None = None
    ) -> dict[str, Any]:
        return await self._run(self.sync.approve, scope, tool_call_id, by=by, reason=reason)

    async def reject(
        self, scope: str, tool_call_id: str, *, by: str, reason: str | None = None
    ) -> dict[str, Any]:
        return await self._run(self.sync.reject, scope, tool_call_id, by=by, reason=reason)

    async def retry(
        self,
        scope: str,
        tool_call_id: str,
        *,
        by: str,
        accept_duplicate: bool = False,
        reason: str | None = None,
        attempt: int | None = None,
    ) -> dict[str, Any]:
        return await self._run(
            self.sync.retry,
            scope,
            tool_call_id,
            by=by,
            accept_duplicate=accept_duplicate,
            reason=reason,
            attempt=attempt,
        )

    async def resolve(
        self,
        execution_id: str,
        status: Status | str,
        *,
        by: str,
        evidence: str,
        review: bool = False,
        seen: int | None = None,
    ) -> dict[str, Any]:
        return await self._run(
            self.sync.resolve,
            execution_id,
            status,
            by=by,
            evidence=evidence,
            review=review,
            seen=seen,
        )

    async def receipt(self, scope: str, tool_call_id: str) -> Receipt | None:
        return await self._run(self.sync.receipt, scope, tool_call_id)

    async def status(self, scope: str, tool_call_id: str) -> str:
        return await self._run(self.sync.status, scope, tool_call_id)

    async def wait(self, scope: str, tool_call_id: str, *, timeout: float | None = None) -> Receipt:
        timeout = wait_seconds(timeout)
        sync = self.sync
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = None if timeout is None else started + timeout
        # (Client.wait's deadline is read on time.monotonic(), the clock loop.time() reads)
        status = UNANSWERED

        async def read(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
            """A read given up at the deadline (see ``_read_apart``; its thread goes on)."""
            if deadline is None or not sync.notifier.postgres:
                return await self._run(fn, *args, **kwargs)
            answer: asyncio.Future[T] = loop.create_future()

            def settle(ok: bool, value: Any) -> None:
                if not answer.done():  # given up meanwhile: nobody reads it
                    (answer.set_result if ok else answer.set_exception)(value)

            def deliver(ok: bool, value: Any) -> None:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(settle, ok, value)

            _read_apart(lambda: fn(*args, **kwargs), deliver)
            left = max(0.0, deadline - loop.time()) + sync.settings.db_timeout  # see _within
            try:
                return await asyncio.wait_for(answer, left)
            except TimeoutError:
                raise _Unanswered from None
            except Exception as exc:
                if not _connect_timed_out(exc):
                    raise
                if loop.time() >= deadline:  # as Client.wait's (see _within; helper-94)
                    raise _Unanswered from None
                return await read(fn, *args, **kwargs)

        try:
            view = await read(sync.ledger.get, scope, tool_call_id)
            status = view.operation.status.value
            if (found := receipt_of(view)) is not None:  # see Client.wait
                sync.stats.add("woken")
                return found
            key = (scope, view.operation.idempotency_key)
            await self._run(sync.notifier.start, _start_wait(timeout))
            rung = asyncio.Event()
            # Held weakly: the notifier holds ``wake`` and the event holds this task (its
            # waiter's callback), so a strong hold kept a wait abandoned in a closed loop, its
            # watcher, task and loop, for the process's life. A running wait is held by its
            # caller and its timer; an abandoned one is collected, its ``watch`` then closed.
            weak_rung = weakref.ref(rung)

            def wake() -> None:
                # the loop closed with this wait pending (never cancelled): nobody waits there
                if (event := weak_rung()) is not None:
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(event.set)

            by_poll = False
            with sync.notifier.watch(key, wake):
                view = await read(sync.ledger.get, scope, tool_call_id)  # see Client.wait
                answered = True
                while True:
                    status = view.operation.status.value
                    left = None if deadline is None else deadline - loop.time()
                    waited = loop.time() - started
                    if (found := sync._ended(view, by_poll, left, waited, answered)) is not None:
                        return found
                    try:
                        await asyncio.wait_for(rung.wait(), sync._interval(left))
                        by_poll = False
                    except TimeoutError:
                        by_poll = True
                        sync.stats.add("fallback_reads")
                    rung.clear()
                    again = await read(sync._reread, scope, tool_call_id, deadline)
                    answered = again is not None
                    view = view if again is None else again
        except _Unanswered:
            sync.stats.add("timeouts")
            waited = loop.time() - started
            raise ReceiptTimeout(scope, tool_call_id, status, waited, unanswered=True) from None

    async def run_turn(
        self,
        scope: str,
        message: dict[str, Any] | list[Any],
        *,
        approve: Callable[[str, str, dict[str, Any]], str | Awaitable[str | None] | None]
        | None = None,
        timeout: float | None = None,
    ) -> list[dict[str, Any]]:
        from toolledger.turns import run_turn_async

        return await run_turn_async(self, scope, message, approve=approve, timeout=timeout)

    async def warm(self) -> None:
        """``Client.warm``, on a thread (it imports)."""
        await self._run(self.sync.warm)

    async def close(self) -> None:
        await self._run(self.sync.close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()


class AsyncCallHandle:
    def __init__(self, client: AsyncClient, handle: CallHandle) -> None:
        self.client, self.handle = client, handle
        self.scope, self.tool_call_id = handle.scope, handle.tool_call_id
        self.idempotency_key = handle.idempotency_key

    @property
    def status(self) -> str:
        return self.handle.status

    async def result(self, timeout: float | None = None) -> Receipt:
        if self.handle._immediate is not None:
            return self.handle._immediate
        return await self.client.wait(self.scope, self.tool_call_id, timeout=timeout)


# ---------------------------------------------------------------- for the adapters


def unanswered(scope: str, call_id: str, raises: type[CallsWaiting] | None = None) -> CallsWaiting:
    """What an adapter's tool raises when the database failed (``database_failed``) once the
    submit may have committed: the call may be in flight, so the run stops as for a timeout,
    the model told nothing. As an ordinary error, the model called again under a new id, and
    the effect happened twice (a cold review). ``raises``: the adapter's own CallsWaiting."""
    from toolledger.turns import CallsWaiting

    return (raises or CallsWaiting)(scope, {call_id: UNANSWERED}, frozenset({call_id}))


@contextlib.contextmanager
def waiting_on(
    scope: str, call_id: str, raises: type[CallsWaiting] | None = None
) -> Iterator[None]:
    """Around an adapter's wait for one call's receipt (sync or async): no receipt within the
    timeout stops the run, naming where the call stands (``raises``); the database failing,
    as ``unanswered``; anything else (a record the ledger calls corrupt, a bug) as it is."""
    from toolledger.turns import CallsWaiting, database_failed

    try:
        yield
    except ReceiptTimeout as exc:
        waiting = frozenset({call_id}) if exc.unanswered else frozenset()
        raise (raises or CallsWaiting)(scope, {call_id: exc.status}, waiting) from None
    except Exception as exc:
        if not database_failed(exc):
            raise
        raise unanswered(scope, call_id, raises) from exc
