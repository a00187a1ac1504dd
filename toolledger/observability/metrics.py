"""Where the metrics are exposed, and the gauges read from the ledger's current state.

Prefork: a Celery worker's children count into prometheus_client's multiprocess files, and
the worker's main process serves them all, summed, on one endpoint — so a child killed
mid-task keeps what it counted. The files are the worker's own: a fresh temporary directory,
or one of its own inside ``PROMETHEUS_MULTIPROC_DIR`` when that is set (``worker-HOST-PID``):
two workers, or a worker and the beat, given one directory would each serve the other's
counts (and the last to start would wipe the others' files). ``toolledger serve --workers
N`` does the same for its N processes (``serve-HOST-PID``): they share one socket, so one
scrape target, which must serve their sum. Every other process (the beat, a single
``toolledger serve``) counts in its own memory whatever the environment says.

The beat and ``toolledger serve`` also serve the ledger's gauges
(``toolledger_calls{status}``, ``toolledger_inbox{kind}``,
``toolledger_inbox_oldest_timestamp_seconds{kind}``, ``toolledger_approved_calls{kind}``,
``toolledger_approved_claimable_oldest_timestamp_seconds``,
``toolledger_running_oldest_lease_expiry_timestamp_seconds``), read through the partial indexes and
cached for ``CACHE_SECONDS``; workers do not (N workers would each query the ledger per
scrape), except one that runs the beat in its group (``worker -B``): its endpoint serves them
for the beat, which opens none (``EmbeddedBeat``).

Environment (read by the process entry points): ``TOOLLEDGER_METRICS=off`` turns every
counter and endpoint off; ``TOOLLEDGER_METRICS_PORT`` is the port of a worker's or the
beat's endpoint (defaults ``WORKER_PORT``/``BEAT_PORT``; 0 = any free port, logged),
``TOOLLEDGER_METRICS_ADDR`` the address it listens on (default every interface).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import math
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from toolledger.ledger import metrics as counters
from toolledger.ledger.identity import PROXIED_PREFIX
from toolledger.ledger.models import execution_events, executions, operations
from toolledger.ledger.transitions import EventKind, Status

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

    from toolledger.ledger.ledger import Ledger

log = logging.getLogger("toolledger.metrics")

#: Default ports of the endpoints a worker process group and the beat open.
WORKER_PORT = 9808
BEAT_PORT = 9809
#: How long the ledger's gauges are served from cache: a scrape storm costs one query.
CACHE_SECONDS = 5.0
#: Statuses the calls gauge reports: those the partial indexes serve. Terminal statuses grow
#: without bound (counting them is a scan): their rates are toolledger_calls_total's.
OPEN_STATUSES = (Status.PENDING_APPROVAL, Status.APPROVED, Status.RUNNING, Status.UNKNOWN)
_WAITING = (Status.PENDING_APPROVAL, Status.RUNNING, Status.UNKNOWN)  # ix_operations_waiting
#: Approved calls by whether a worker may claim them (``_approved_by_kind``).
APPROVED_KINDS = ("claimable", "flagged", "proxied")


def metrics_on(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process counts and serves metrics (TOOLLEDGER_METRICS, default on)."""
    from toolledger.config import switch

    return switch(os.environ if env is None else env, "TOOLLEDGER_METRICS")


def metrics_port(default: int, env: Mapping[str, str] | None = None) -> int:
    return int((env if env is not None else os.environ).get("TOOLLEDGER_METRICS_PORT", default))


def metrics_addr(env: Mapping[str, str] | None = None) -> str:
    """The address a worker's or the beat's endpoint listens on: ``TOOLLEDGER_METRICS_ADDR``,
    every interface by default (prometheus_client's, for a Prometheus in another container);
    127.0.0.1 keeps it to this host (it could not be, a cold review)."""
    given = (env if env is not None else os.environ).get("TOOLLEDGER_METRICS_ADDR", "").strip()
    return given or "0.0.0.0"  # noqa: S104 - the documented default


# ------------------------------------------------------------------------ the ledger's gauges


def state_counts(ledger: Ledger) -> dict[str, dict[str, float]]:
    """{"calls": {status: n}, "inbox": {kind: n}, "oldest": {kind: epoch seconds}} from
    current state, two statements whose parts each match a partial index's predicate (so none
    scans the table). "oldest" says since when the longest-waiting call of a kind has waited
    on a person: a pending approval since it was submitted, an unknown call since its
    execution's lease expired (or since it was marked unknown, if that came first), a
    flagged one (contradicted, both_ran, not_landed) since it
    was flagged; a kind with nothing waiting is left out.

    "approved" splits the approved calls by whether a worker may claim them
    (``_approved_by_kind``): the no-claims alert counted every approved call, and an MCP
    proxy's or a flagged one, which no worker may claim, fired it on an idle healthy stack (a
    cold review). "since" holds when the oldest claimable call was approved
    (``approved_claimable``) and the earliest lease expiry of the running executions
    (``running_lease``, ix_executions_running_lease: a call running long past its lease that
    no sweep marks, the sweeper pointed at another ledger, showed nowhere); each left out when
    there is none. Four statements, each through a partial index."""
    o = operations.c
    waiting = (
        sa.select(sa.literal("calls"), o.status, sa.func.count())
        .where(o.status.in_([s.value for s in _WAITING]))
        .group_by(o.status)
    )
    review = (
        sa.select(sa.literal("review"), o.review, sa.func.count())
        .where(o.review.is_not(None))
        .group_by(o.review)
    )
    calls: dict[str, float] = {s.value: 0 for s in OPEN_STATUSES}
    flagged: dict[str, float] = {}
    with ledger.engine.connect() as conn:
        for part, name, n in conn.execute(sa.union_all(waiting, review)):
            (calls if part == "calls" else flagged)[str(name)] = int(n)
        approved: dict[str, float] = dict.fromkeys(APPROVED_KINDS, 0)
        since: dict[str, float] = {}
        for kind, n, first in conn.execute(_approved_by_kind()):
            approved[str(kind)] = int(n)
            if kind == "claimable" and first is not None:
                since["approved_claimable"] = first.timestamp()
        oldest = {
            str(kind): when.timestamp()
            for kind, when in conn.execute(_oldest_waiting())
            if when is not None
        }
        lease = conn.execute(
            sa.select(sa.func.min(executions.c.lease_expires_at)).where(
                executions.c.status == Status.RUNNING.value
            )
        ).scalar_one()
        if lease is not None:
            since["running_lease"] = lease.timestamp()
    calls[Status.APPROVED] = sum(approved.values())
    inbox: dict[str, float] = {
        "pending_approval": calls[Status.PENDING_APPROVAL],
        "unknown": calls[Status.UNKNOWN],
        "contradicted": flagged.pop("contradicted", 0),
    }
    inbox.update(flagged)  # both_ran, not_landed: also waiting on a human
    return {"calls": calls, "inbox": inbox, "oldest": oldest, "approved": approved, "since": since}


def _approved_by_kind() -> sa.Select[str, int, datetime | None]:
    """Approved calls by whether a worker may claim them (the outbox's filter,
    ``ledger.outbox``): ``claimable``; ``flagged`` (a review stands: the claim refuses it
    until a human settles it, and the inbox shows it); ``proxied`` (an ``mcp.*`` tool the MCP
    proxy recorded: a proxy sends it when one is asked for the call again, no worker ever
    does, and none is re-published). With, for the claimable ones, since when the oldest has
    waited: since its approval, or since its attempt was authorised for a retried call (its
    last ``approved`` event: few rows, read only for retried calls). The rows are the
    approved ones (ix_operations_approved_unclaimed), each read once."""
    o, ev = operations.c, execution_events.c
    kind = sa.case(
        (o.review.is_not(None), sa.literal("flagged")),
        (o.tool.like(f"{PROXIED_PREFIX}%"), sa.literal("proxied")),
        else_=sa.literal("claimable"),
    )
    authorised = (
        sa.select(sa.func.max(ev.at))
        .where(
            ev.scope == o.scope,
            ev.idempotency_key == o.idempotency_key,
            ev.kind == EventKind.APPROVED.value,
        )
        .scalar_subquery()
    )
    since = sa.case(
        (o.authorized_attempts > 1, authorised), else_=sa.func.coalesce(o.decided_at, o.created_at)
    )
    waiting = sa.case((kind == "claimable", since), else_=sa.null())
    rows = (
        sa.select(kind.label("kind"), waiting.label("since"))
        .where(o.status == Status.APPROVED.value)
        .subquery()
    )
    return sa.select(rows.c.kind, sa.func.count(), sa.func.min(rows.c.since)).group_by(rows.c.kind)


def _oldest_waiting() -> sa.CompoundSelect[str, datetime | None]:
    """The oldest pending approval (ix_operations_attention: its first entry), the unknown
    execution of a still-unknown call whose lease expired first (ix_executions_unknown: few
    rows by nature; an attempt retried since is no longer the operation's), and for each
    review kind the call flagged first (ix_operations_review, then each flagged call's
    events: few rows by nature), each since the flag it carries now (its last ``flagged``
    event: a call reviewed and flagged again waits since the second)."""
    o, e, ev = operations.c, executions.c, execution_events.c
    pending = sa.select(
        sa.literal("pending_approval").label("kind"), sa.func.min(o.created_at).label("since")
    ).where(o.status == Status.PENDING_APPROVAL.value)
    # since the lease expired; one marked unknown before it would have (an executor known to
    # be gone: the proxy's time limit, a SIGTERM) since it was marked: its lease may end a day
    # later, and the alert on a call waiting an hour fired a day late (a cold review). The
    # time it was marked is its ``unknown`` event's (few rows: unknown executions only).
    marked = (
        sa.select(sa.func.max(ev.at))
        .where(
            ev.scope == e.scope,
            ev.idempotency_key == e.idempotency_key,
            ev.execution_id == e.execution_id,
            ev.kind == EventKind.UNKNOWN.value,
        )
        .scalar_subquery()
    )
    since = sa.case(
        (sa.and_(marked.is_not(None), marked < e.lease_expires_at), marked),
        else_=e.lease_expires_at,
    )
    unknown = sa.select(sa.literal("unknown"), sa.func.min(since)).where(
        e.status == Status.UNKNOWN.value,
        o.scope == e.scope,
        o.idempotency_key == e.idempotency_key,
        o.status == Status.UNKNOWN.value,
        o.authorized_attempts == e.attempt,
    )
    flags = (
        sa.select(o.review.label("kind"), sa.func.max(ev.at).label("since"))
        .where(
            o.review.is_not(None),
            ev.scope == o.scope,
            ev.idempotency_key == o.idempotency_key,
            ev.kind == EventKind.FLAGGED.value,
        )
        .group_by(o.scope, o.idempotency_key, o.review)
        .subquery()
    )
    flagged = sa.select(flags.c.kind, sa.func.min(flags.c.since)).group_by(flags.c.kind)
    return sa.union_all(pending, unknown, flagged)


@dataclasses.dataclass(frozen=True)
class _Snapshot:
    values: dict[str, dict[str, float]] | None  # the last values read
    up: bool  # whether the last try to read succeeded
    read_at: float  # Unix time the values were read
    tried: float  # monotonic time the last try ended


class LedgerStateCollector:
    """The gauges read from the ledger, cached ``ttl`` seconds (one query per ttl at most).

    When the ledger cannot be read, the last values read are served on (a gauge that
    vanished would resolve the alerts on it) beside ``toolledger_ledger_state_up`` 0 and
    the time they were read: values frozen since a rename or an outage were served as
    current, and the inbox alerts fired on them (a cold review).

    ``read_on_collect`` False: ``collect`` serves what ``counts`` last read and never queries
    itself — for an endpoint on an event loop, which calls ``counts`` in a thread first (a
    scrape of ``toolledger serve`` ran the query on the loop: every API and console request
    waited behind it while the ledger was slow, a cold review).

    One read at a time, and nobody waits for it: a scrape arriving while another reads serves
    the values last read (``collect`` takes no lock: the snapshot is one attribute). A failed
    read is not tried again for ``ttl`` either: scrapes queued behind a lock, each to read
    again, held the loop and the server's threads (a second cold review)."""

    def __init__(
        self, ledger: Ledger, ttl: float = CACHE_SECONDS, *, read_on_collect: bool = True
    ) -> None:
        self.ledger, self.ttl, self.read_on_collect = ledger, ttl, read_on_collect
        self._reading = threading.Lock()
        self._snapshot = _Snapshot(None, False, 0.0, -math.inf)

    def counts(self) -> dict[str, dict[str, float]] | None:
        """The values to serve: read now if the last try is ``ttl`` old and nobody reads."""
        snap = self._snapshot
        if time.monotonic() - snap.tried < self.ttl or not self._reading.acquire(blocking=False):
            return snap.values
        try:
            snap = self._snapshot
            if time.monotonic() - snap.tried < self.ttl:  # read by another since the first look
                return snap.values
            try:
                values = state_counts(self.ledger)
            except Exception as exc:  # any: a scrape serves the counters whatever this read does
                # the database's own errors by class (their text may quote SQL and parameters);
                # anything else is a bug, worth its traceback
                database = isinstance(exc, sa.exc.SQLAlchemyError)
                log.warning(
                    "metrics: cannot read the ledger: %s",
                    type(exc).__name__,
                    exc_info=not database,
                )
                self._snapshot = dataclasses.replace(snap, up=False, tried=time.monotonic())
                return snap.values
            self._snapshot = _Snapshot(values, True, time.time(), time.monotonic())
            return values
        finally:
            self._reading.release()

    def _served(self) -> tuple[dict[str, dict[str, float]] | None, bool, float]:
        if self.read_on_collect:
            # in a thread of its own, waited for SCRAPE_WAIT_SECONDS: the beat's scrape that
            # started a read of a frozen database waited for it (20 s and more, past
            # Prometheus's 10 s timeout: the target down, a cold review); it goes on, unwaited
            reader = threading.Thread(target=self.counts, name="ledger-state", daemon=True)
            reader.start()
            reader.join(SCRAPE_WAIT_SECONDS)
        snap = self._snapshot
        return snap.values, snap.up, snap.read_at

    def describe(self) -> Iterable[Metric]:
        return []  # not known before the first scrape; nothing to check for clashes

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        counts, up, read_at = self._served()
        yield GaugeMetricFamily(
            "toolledger_ledger_state_up",
            "1 if the last read of the ledger's state succeeded; 0 if it failed or none has "
            "ended yet (the gauges read from it are then those of "
            "toolledger_ledger_state_timestamp_seconds).",
            value=1.0 if up else 0.0,
        )
        if counts is None:
            return
        yield GaugeMetricFamily(
            "toolledger_ledger_state_timestamp_seconds",
            "When the ledger's gauges served were read (Unix time).",
            value=read_at,
        )
        calls = GaugeMetricFamily(
            "toolledger_calls", "Calls by status now (open statuses).", labels=["status"]
        )
        for status, n in counts["calls"].items():
            calls.add_metric([status], n)
        inbox = GaugeMetricFamily(
            "toolledger_inbox", "Calls waiting on a human, by why.", labels=["kind"]
        )
        for kind, n in counts["inbox"].items():
            inbox.add_metric([kind], n)
        oldest = GaugeMetricFamily(
            "toolledger_inbox_oldest_timestamp_seconds",
            "Since when the longest-waiting call has waited on a human (Unix time): a pending "
            "approval since its submit, an unknown call since its lease expired, a flagged "
            "call since it was flagged.",
            labels=["kind"],
        )
        for kind, since in counts["oldest"].items():
            oldest.add_metric([kind], since)
        yield calls
        yield inbox
        yield oldest
        approved = GaugeMetricFamily(
            "toolledger_approved_calls",
            "Approved calls now, by whether a worker may claim them: claimable; flagged (a "
            "review stands, in the inbox); proxied (an mcp.* tool the MCP proxy recorded: only "
            "a proxy asked for the call again sends it, no worker claims it).",
            labels=["kind"],
        )
        for kind, n in counts["approved"].items():
            approved.add_metric([kind], n)
        yield approved
        marks = counts["since"]
        if "approved_claimable" in marks:
            yield GaugeMetricFamily(
                "toolledger_approved_claimable_oldest_timestamp_seconds",
                "Since when the longest-waiting claimable approved call has waited for a "
                "worker (Unix time): since its approval, or its retry's authorisation.",
                value=marks["approved_claimable"],
            )
        if "running_lease" in marks:
            yield GaugeMetricFamily(
                "toolledger_running_oldest_lease_expiry_timestamp_seconds",
                "The earliest lease expiry of the executions running now (Unix time): past it "
                "by the sweep's grace, the sweep should have made the execution unknown.",
                value=marks["running_lease"],
            )


# ------------------------------------------------------------------------ registries


class _Chained:
    """Another registry's metrics, served from this one (its names are its own business)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self.inner.collect()


#: The files every process group keeps whatever comes and goes: a dead process's counts are
#: folded into them (``fold_dead``). Not a pid: prometheus_client reads the part after the
#: type (and a gauge's mode) as the process's id, used only by the ``all`` modes, never kept.
GROUP_FILE = "group"
#: Gauge modes whose dead processes' values prometheus_client serves on: folded as it serves
#: them. The ``live*`` ones leave the sum with their process (its files are removed: what
#: ``mark_process_dead`` does, which a SIGKILLed child never gets to ask for); ``all`` serves
#: each process under its own pid label: left as it is.
_FOLDED_GAUGES = ("min", "max", "sum", "mostrecent")
#: Taken (flock) by whoever reads or folds a group's files: a fold removes a file after
#: adding its counts to the group's, and a read between the two would count them twice; a
#: read that globbed the removed file would fail on it (prometheus_client raises for any
#: file but a live gauge's). ``serve --workers N``: N processes may scrape the one directory.
_LOCK_FILE = ".fold.lock"
#: How long a scrape waits for the group's lock (a fold and a read take milliseconds): past it
#: the group's counters are left out of that scrape, one warning line, rather than waited for.
GROUP_LOCK_WAIT_SECONDS = 1.0


class GroupFiles:
    """A process group's multiprocess files, served summed (prometheus_client's
    ``MultiProcessCollector``), the files of its processes that are gone first folded into
    the group's own (``fold_dead``).

    prometheus_client never removes a dead process's files: each pool child writes its own
    (``counter_PID.db``, ``histogram_PID.db``, a gauge file per mode) and a worker under
    ``--max-tasks-per-child 1`` left two per task, every scrape reading them all: 1.2 s at
    6,200 files on the test machine, linear, Prometheus's 10 s scrape timeout passed near
    50,000 (25,000 tasks) and the worker's target went down. A ``live*`` gauge of a child
    SIGKILLed stayed in its sum for good (a cold review)."""

    def __init__(self, directory: str) -> None:
        from prometheus_client import multiprocess

        self.directory = directory
        self.inner = multiprocess.MultiProcessCollector(None, path=directory)  # type: ignore[no-untyped-call]

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        with _group_lock(self.directory) as held:
            if not held:  # served unfolded, a fold half done would count twice: none served
                log.warning(
                    "metrics: the group's counters not served: another process holds %s "
                    "past %.0f s (frozen?)",
                    os.path.join(self.directory, _LOCK_FILE),
                    GROUP_LOCK_WAIT_SECONDS,
                )
                return
            try:
                fold_dead(self.directory)
            except Exception:  # any: the scrape serves the files as they are, unfolded
                log.warning("metrics: cannot fold dead processes' files", exc_info=True)
            served = list(self.inner.collect())  # type: ignore[no-untyped-call]
        yield from served


@contextlib.contextmanager
def _group_lock(directory: str, wait: float | None = None) -> Iterator[bool]:
    """The group's lock, waited for ``wait`` seconds at most (``GROUP_LOCK_WAIT_SECONDS``);
    yields whether it is held. A holder frozen (SIGSTOP, a stalled disk) held every other
    process's scrape for as long: ``serve --workers N`` renders on its event loop, and a
    process whose /metrics was scraped answered no request meanwhile (a cold review: 5 s for
    a SIGSTOPped holder, until uvicorn's health check killed it; a holder in a stalled disk's
    I/O outlives a kill)."""
    from toolledger.effects import flock_by

    deadline = time.monotonic() + (GROUP_LOCK_WAIT_SECONDS if wait is None else wait)
    fd = os.open(os.path.join(directory, _LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        yield flock_by(fd, deadline)
    finally:
        os.close(fd)  # releases the lock


def fold_dead(directory: str) -> int:
    """Fold the multiprocess files in ``directory`` of processes that are gone into the
    group's files (``GROUP_FILE``), as prometheus_client serves them: counters and
    histograms summed, a ``min``/``max``/``sum``/``mostrecent`` gauge by its mode; a
    ``live*`` gauge's file removed (its process left the sum). The number of files folded
    or removed. Under ``_group_lock``: served between the two steps, a count would be
    twice. A fold that fails changes nothing (each group file is renamed into place whole);
    a crash between the renames and the removals (this process killed) counts the dead
    files twice: the worker's group then goes with its directory (a new one at its next
    start), a ``serve`` group's process restarts into the same directory (an overcount,
    never a counter going back)."""
    from prometheus_client.mmap_dict import MmapedDict

    folded: dict[str, dict[str, tuple[float, float]]] = {}  # group file -> key -> value, time
    done: list[Path] = []
    for path in sorted(Path(directory).glob("*.db")):
        parts = path.name.removesuffix(".db").split("_")
        kind, owner = parts[0], parts[-1]
        mode = parts[1] if kind == "gauge" and len(parts) == 3 else ""
        if not owner.isdigit() or _alive(int(owner)) or (kind == "gauge" and not mode):
            continue  # the group's files, a live process's, or a name not prometheus_client's
        if mode.startswith("live"):
            done.append(path)
            continue
        if kind == "gauge" and mode not in _FOLDED_GAUGES:
            continue
        target = "_".join(p for p in (kind, mode, GROUP_FILE) if p) + ".db"
        if target not in folded:
            group = Path(directory) / target
            folded[target] = (
                {k: (v, t) for k, v, t, _ in _read_values(group)} if group.exists() else {}
            )
        into = folded[target]
        for key, value, at, _ in _read_values(path):
            into[key] = _fold(mode, into.get(key), (value, at))
        done.append(path)
    # each group file written whole under another name, then renamed over the old: a fold
    # that fails (a full disk) leaves the group's files and the dead ones as they were, and
    # the next scrape folds them again from the start (written in place, the keys written
    # before the failure were added a second time at each try)
    fresh: list[tuple[str, str]] = []
    try:
        for target, values in folded.items():
            staged = os.path.join(directory, f".{target}.{os.getpid()}.tmp")  # not *.db
            fresh.append((staged, os.path.join(directory, target)))
            group_file = MmapedDict(staged)  # type: ignore[no-untyped-call]
            try:
                for key, (value, at) in values.items():
                    group_file.write_value(key, value, at)  # type: ignore[no-untyped-call]
            finally:
                group_file.close()  # type: ignore[no-untyped-call]
    except BaseException:
        for staged, _ in fresh:
            with contextlib.suppress(OSError):
                os.unlink(staged)
        raise
    for staged, target in fresh:
        os.replace(staged, target)
    for path in done:
        path.unlink(missing_ok=True)
    return len(done)


def _read_values(path: Path) -> Iterator[tuple[str, float, float, int]]:
    """(key, value, timestamp, position) of each sample in a multiprocess file."""
    from prometheus_client.mmap_dict import MmapedDict

    return iter(MmapedDict.read_all_values_from_file(str(path)))  # type: ignore[no-untyped-call]


def _fold(
    mode: str, kept: tuple[float, float] | None, new: tuple[float, float]
) -> tuple[float, float]:
    """One sample's (value, timestamp) folded into what the group's file holds for it, as
    prometheus_client's collector merges processes' samples of that kind."""
    if kept is None:
        return new
    if mode == "min":
        return min(kept, new, key=lambda pair: pair[0])
    if mode == "max":
        return max(kept, new, key=lambda pair: pair[0])
    if mode == "mostrecent":
        return new if new[1] > kept[1] else kept
    return kept[0] + new[0], 0.0  # counters, histograms, summaries, a sum gauge


#: The directory this process group counts into (``use_multiprocess``): None for a process
#: that counts in memory, whatever PROMETHEUS_MULTIPROC_DIR says.
_group_dir: str | None = None


def multiprocess_dir() -> str | None:
    """Where this process's group counts (a worker's, set by ``use_multiprocess``)."""
    return _group_dir


def _in_memory() -> None:
    """Count in this process's memory: prometheus_client chose its value class from
    PROMETHEUS_MULTIPROC_DIR at import, and a process given a worker's directory would write
    its counts among the worker's (served twice) without this. Before any metric is built."""
    if _group_dir is None and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import values

        values.ValueClass = values.MutexValue


def process_registry(*extra: Any) -> CollectorRegistry:
    """A registry serving this process's counters (all processes' of its group, in
    multiprocess mode) plus ``extra`` collectors."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    directory = multiprocess_dir()
    if directory:
        registry.register(GroupFiles(directory))
    else:
        _in_memory()
        own = counters.enable()
        registry.register(_Chained(own.registry))
    for collector in extra:
        registry.register(collector)
    return registry


def asgi_app(ledger: Ledger, *, ttl: float = CACHE_SECONDS) -> Any:
    """The /metrics ASGI app for ``toolledger serve``: this process's counters (under
    ``--workers N``, every process's, summed: ``join_serve_group``) and the ledger's gauges
    (this process's own read: a custom collector, in no multiprocess file, so served once
    whatever N is). Counting starts here (unless TOOLLEDGER_METRICS=off: then only the
    gauges are served)."""
    from prometheus_client import CollectorRegistry, make_asgi_app

    state = LedgerStateCollector(ledger, ttl, read_on_collect=False)
    if not metrics_on():
        registry = CollectorRegistry(auto_describe=False)
        registry.register(state)
    else:
        _in_memory()
        counters.enable()
        registry = process_registry(state)
    return _ReadFirst(make_asgi_app(registry=registry), state)


#: Threads of its own for /metrics' read of the ledger's state: a scrape while a read runs
#: is served the last values at once (``LedgerStateCollector.counts``), so a few will do.
SCRAPE_THREADS = 4
#: How long a scrape waits for the read it started (a read takes milliseconds); past it the
#: scrape is served the values last read, and their timestamp, while the read goes on.
SCRAPE_WAIT_SECONDS = 3.0


class _ReadFirst:
    """An ASGI app that reads the ledger's state in a worker thread, then lets ``inner``
    (prometheus_client's, which renders synchronously on the event loop) serve it. The
    thread is one of its own, never of the pool every request shares: with the database
    frozen, 45 requests held its 40 threads, and a scrape waited 15.6 s for one, past
    Prometheus' 10 s timeout (a cold review of serve). Nor does a scrape wait past
    ``SCRAPE_WAIT_SECONDS`` for the read it started: frozen, the database held it as long
    (25 s, for ever if it stays so), where the served timestamp is there to say so."""

    def __init__(self, inner: Any, state: LedgerStateCollector) -> None:
        self.inner, self.state = inner, state
        self._threads: Any = None  # an anyio.CapacityLimiter, made on the server's loop

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") == "http":
            import anyio
            import anyio.to_thread

            if self._threads is None:
                self._threads = anyio.CapacityLimiter(SCRAPE_THREADS)
            with anyio.move_on_after(SCRAPE_WAIT_SECONDS):  # the read goes on, unwaited
                await anyio.to_thread.run_sync(
                    self.state.counts, limiter=self._threads, abandon_on_cancel=True
                )
        await self.inner(scope, receive, send)


# ------------------------------------------------------------------------ serve --workers N

#: Set by ``serve --workers N`` for its processes: the directory they all count into.
SERVE_DIR_VARIABLE = "TOOLLEDGER_SERVE_METRICS_DIR"


def start_serve_group() -> str | None:
    """In ``serve --workers N``'s main process, before uvicorn starts its processes: a
    multiprocess directory for them all (``serve-HOST-PID`` inside PROMETHEUS_MULTIPROC_DIR,
    else a fresh temporary one; removed when this process exits), named to them in
    ``SERVE_DIR_VARIABLE``. The N processes share one socket, so one scrape target: a scrape
    was answered by whichever process accepted it, with that process's counters alone, and
    the counters went up and down between scrapes (increase() invented traffic, a cold
    review). Each process now serves the sum of all. None when metrics are off."""
    if not metrics_on():
        return None
    path = use_multiprocess(role="serve")
    os.environ[SERVE_DIR_VARIABLE] = path
    return path


def join_serve_group() -> str | None:
    """In one of ``serve --workers N``'s processes (spawned: a fresh interpreter), before any
    metric is built: count into the group's directory that ``start_serve_group`` named, and
    leave the sum's live gauges when this process exits (as a worker's pool child does).
    None when there is no group (one process, or metrics off)."""
    global _group_dir
    path = os.environ.get(SERVE_DIR_VARIABLE) or None
    if path is None or not metrics_on():
        return None
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    _group_dir = path
    from prometheus_client import values

    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]
    atexit.register(_leave, path, os.getpid())
    return path


def _leave(directory: str, pid: int) -> None:
    if os.getpid() == pid and os.path.isdir(directory):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]


# ------------------------------------------------------------------------ worker and beat


def use_multiprocess(directory: str | None = None, *, role: str = "worker") -> str:
    """Switch this process (and the children it will fork) to multiprocess counting in a
    directory of its own (removed when this process exits, not when a child does): a new
    temporary one (``toolledger-ROLE-metrics-HOST-PID-…``), or ``ROLE-HOST-PID`` inside
    ``directory`` (PROMETHEUS_MULTIPROC_DIR); either way the directories of this host's
    processes of that role that died without removing theirs (SIGKILL) are removed first.
    Must run before any metric is built: prometheus_client picks its value class from the
    environment."""
    global _group_dir
    parent = directory or os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
    host = socket.gethostname()
    if parent is None:
        # every worker killed (chaos, the OOM killer) left its temporary directory behind
        # (47 in /tmp after a morning of tests)
        prefix = f"toolledger-{role}-metrics-{host}-"
        _remove_dead_temporary(Path(tempfile.gettempdir()), prefix)
        path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))
    else:
        _remove_dead(Path(parent), host, role)
        path = Path(parent) / f"{role}-{host}-{os.getpid()}"
        # A container's worker has the same pid each start: what is there is a run's that
        # ended (its counts would be summed in, prometheus_client's rule).
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    atexit.register(_cleanup, str(path), os.getpid())
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    _group_dir = str(path)
    from prometheus_client import values

    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]
    return str(path)


def _remove_dead(parent: Path, host: str, role: str = "worker") -> None:
    """Remove the directories in ``parent`` of this host's processes of ``role`` whose
    process is gone (a worker killed, which never ran its exit hook). Another host's are left
    alone: its pids mean nothing here."""
    prefix = f"{role}-{host}-"
    with contextlib.suppress(OSError):
        for child in parent.iterdir():
            pid = child.name.removeprefix(prefix)
            if child.name.startswith(prefix) and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(child, ignore_errors=True)


def _remove_dead_temporary(parent: Path, prefix: str) -> None:
    """Remove this user's ``PREFIX+PID-…`` temporary directories in ``parent`` whose process
    is gone (another user's are left alone, as are names of any other shape)."""
    with contextlib.suppress(OSError):
        for child in parent.iterdir():
            # PREFIX + PID + "-" + mkdtemp's suffix, which has no "-": another host's name
            # that starts with this one's ("app-5" beside "app") never parses as one of ours
            pid, dash, suffix = child.name.removeprefix(prefix).partition("-")
            ours = child.name.startswith(prefix) and pid.isdigit() and dash and "-" not in suffix
            if not ours or _alive(int(pid)):
                continue
            with contextlib.suppress(OSError):
                if child.is_dir() and not child.is_symlink() and child.stat().st_uid == os.getuid():
                    shutil.rmtree(child, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's process, alive
        return True
    return True


def serve_http(registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> int:  # noqa: S104
    """Serve ``registry`` at http://addr:port/metrics in a daemon thread; the bound port."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=addr, registry=registry)
    bound = int(server.server_address[1])
    log.info("metrics at %s", endpoint(bound, addr))
    return bound


def endpoint(port: int, addr: str = "0.0.0.0") -> str:  # noqa: S104
    """The URL ``serve_http`` serves at."""
    host = f"[{addr}]" if ":" in addr else addr
    return f"http://{host}:{port}/metrics"


@dataclasses.dataclass(frozen=True)
class EmbeddedBeat:
    """What a worker's endpoint serves for the beat it runs inside its group (``worker -B``):
    the ledger's gauges, read from ``db``, and the beat's sweep interval and grace."""

    db: str
    timeout: float | None
    sweep_interval: float
    sweep_grace: float | None = None

    def collectors(self) -> list[Any]:
        from toolledger.ledger.ledger import Ledger

        ledger = Ledger(self.db, timeout=self.timeout, fast_path=False)
        # read in the worker's main process, which forks pool children (again at each
        # --max-tasks-per-child) and the beat: a child must not use, nor close, the
        # connections it inherits (SQLAlchemy's recipe for a pool across a fork)
        os.register_at_fork(after_in_child=lambda: ledger.engine.dispose(close=False))
        return [
            LedgerStateCollector(ledger),
            *beat_constants(self.sweep_interval, self.sweep_grace),
        ]


#: Whether this process group's endpoint serves the gauges of a beat embedded in it (set in
#: the worker's main process, inherited by the beat it forks).
_beat_in_group = False


def beat_served_by_group() -> bool:
    """In a beat: whether the worker it runs inside (``worker -B``) serves its gauges."""
    return _beat_in_group


def start_worker_metrics(
    default_port: int = WORKER_PORT, *, beat: EmbeddedBeat | None = None
) -> int | None:
    """In a worker's main process, before its pool forks: multiprocess counting, the
    endpoint for the whole group. None when metrics are off or the port is taken (the
    worker runs on; a warning says why).

    ``beat``: the worker runs a beat in its group (``worker -B``, a process forked from this
    one, which inherits the group's directory): this endpoint serves the beat's gauges too,
    and the beat opens none. Its own endpoint served the group's counters a second time
    (on :9809, every count twice in Prometheus), or, given TOOLLEDGER_METRICS_PORT, the
    worker's port: "address already in use", and the ledger's gauges served nowhere (a cold
    review)."""
    global _beat_in_group
    if not metrics_on():
        return None
    use_multiprocess()
    counters.enable()
    extra: list[Any] = []
    if beat is not None:
        _beat_in_group = True
        extra = beat.collectors()
    try:
        return serve_http(process_registry(*extra), metrics_port(default_port), metrics_addr())
    except OSError as exc:
        log.warning("metrics endpoint not started: %s", exc)
        return None


def worker_child_exited(pid: int) -> None:
    """A pool child exits: its live gauges leave the sum (its counters stay)."""
    directory = multiprocess_dir()
    if directory and counters.active() is not None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]


class Constant:
    """A gauge whose value is known at start (the sweep interval the beat schedules)."""

    def __init__(self, name: str, documentation: str, value: float) -> None:
        self.name, self.documentation, self.value = name, documentation, value

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily(self.name, self.documentation, value=self.value)


def beat_constants(sweep_interval: float, sweep_grace: float | None) -> list[Constant]:
    """The beat's settings the alerts count with: the sweep interval it schedules (the
    stalled-sweep alert counts in intervals) and the sweep's grace (the running-past-its-lease
    alert waits for it, plus three intervals)."""
    constants = [
        Constant(
            "toolledger_sweep_interval_seconds",
            "Seconds between sweeps the beat schedules.",
            sweep_interval,
        )
    ]
    if sweep_grace is not None:
        constants.append(
            Constant(
                "toolledger_sweep_grace_seconds",
                "Seconds past a lease's expiry before the sweep makes its execution unknown "
                "(the beat's TOOLLEDGER_SWEEP_GRACE).",
                sweep_grace,
            )
        )
    return constants


def start_beat_metrics(
    ledger: Ledger,
    sweep_interval: float,
    default_port: int = BEAT_PORT,
    *,
    sweep_grace: float | None = None,
) -> int | None:
    """The beat's endpoint: the ledger's gauges (one beat runs: one source of them), the
    sweep interval it schedules (the stalled-sweep alert counts in intervals) and the sweep's
    grace as the beat's settings say (``TOOLLEDGER_SWEEP_GRACE``: the running-past-its-lease
    alert waits for it, plus three intervals)."""
    if not metrics_on():
        return None
    _in_memory()
    counters.enable()
    try:
        registry = process_registry(
            LedgerStateCollector(ledger), *beat_constants(sweep_interval, sweep_grace)
        )
        return serve_http(registry, metrics_port(default_port), metrics_addr())
    except OSError as exc:
        log.warning("metrics endpoint not started: %s", exc)
        return None


def _cleanup(directory: str, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(directory, ignore_errors=True)
