"""Metrics agree with the ledger after a small chaos run: a real prefork worker whose children
are SIGKILLed at random mid-call (failpoints), a real beat sweeping every second, the
worker's and the beat's endpoints and the /metrics ASGI app (uvicorn, in a thread) scraped
at the end and compared with the ledger's own account.

Each agreement check is also shown failing on a scrape made to disagree.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from toolledger.config import Settings
from toolledger.harness.processes import beat_process, service_env, stop_all, worker_process
from toolledger.ledger import metrics as counters
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.models import execution_events, executions
from toolledger.ledger.transitions import EventKind, Status
from toolledger.observability.metrics import OPEN_STATUSES, asgi_app
from toolledger.worker.submit import Submitter

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(url: str) -> Scrape:
    """Every sample at ``url`` by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - a local test URL
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: Scrape, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def probe_settings(
    db: str, broker: str, prefix: str, tmp_path: Path, **more: str
) -> dict[str, str]:
    """Settings (lower-case names) of a stack running the probe tools under ``tmp_path``."""
    return {
        "db": db,
        "broker": broker,
        "broker_prefix": prefix,
        "sandbox": str(tmp_path / "sandbox"),
        "tools": "toolledger.harness.probe",
        "home": str(tmp_path / "home"),
        **more,
    }


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise TimeoutError(what)


# ------------------------------------------------------------------------ the agreement


def ledger_facts(ledger: Ledger, sweep_marked: int) -> dict[str, Any]:
    """The ledger's own account: calls by status (``list``), executions by status, the
    unknown events the sweep wrote for expired leases, the review flags."""
    calls = Counter(c.status.value for c in ledger.list_calls(limit=0))
    flagged = Counter(c.review for c in ledger.list_calls(review=True, limit=0))
    with ledger.engine.connect() as conn:
        rows = conn.execute(sa.select(executions.c.status, sa.func.count()).group_by("status"))
        runs = {str(s): int(n) for s, n in rows}
        expired = conn.execute(
            sa.select(sa.func.count()).where(
                execution_events.c.kind == EventKind.UNKNOWN,
                execution_events.c.actor == "sweep",
            )
        ).scalar_one()
    return {
        "calls": dict(calls),
        "executions": runs,
        "claims": sum(runs.values()),
        "lease_expired_events": int(expired),
        "sweep_marked": sweep_marked,
        "contradicted": flagged.get("contradicted", 0),
    }


def disagreements(gauges: Scrape, worker: Scrape, facts: dict[str, Any]) -> list[str]:
    """Every way the scraped values differ from the ledger's account (empty: they agree)."""
    bad = []

    def check(what: str, scraped: float, truth: float) -> None:
        if scraped != truth:
            bad.append(f"{what}: scraped {scraped}, ledger {truth}")

    for status in OPEN_STATUSES:
        check(
            f"toolledger_calls{{status={status}}}",
            total(gauges, "toolledger_calls", status=status),
            facts["calls"].get(status, 0),
        )
    check(
        "toolledger_inbox{kind=unknown}",
        total(gauges, "toolledger_inbox", kind="unknown"),
        facts["calls"].get("unknown", 0),
    )
    check(
        "toolledger_inbox{kind=pending_approval}",
        total(gauges, "toolledger_inbox", kind="pending_approval"),
        facts["calls"].get("pending_approval", 0),
    )
    check(
        "toolledger_inbox{kind=contradicted}",
        total(gauges, "toolledger_inbox", kind="contradicted"),
        facts["contradicted"],
    )
    expired = total(worker, "toolledger_lease_expired_total")
    check("toolledger_lease_expired_total vs the sweeps' marked", expired, facts["sweep_marked"])
    check("toolledger_lease_expired_total vs events", expired, facts["lease_expired_events"])
    # transitions counted in the worker processes, against the executions they left
    check("claims (calls_total running)", total(worker, "toolledger_calls_total", status="running"), facts["claims"])  # fmt: skip
    for status in ("succeeded", "failed"):
        check(
            f"toolledger_calls_total{{status={status}}}",
            total(worker, "toolledger_calls_total", status=status),
            facts["executions"].get(status, 0),
        )
    check(
        "toolledger_calls_total{status=unknown}",
        total(worker, "toolledger_calls_total", status="unknown"),
        facts["lease_expired_events"],
    )
    return bad


def sweep_marked(log_text: str) -> int:
    """The sum of marked_unknown over every sweep summary a worker logged."""
    found = re.findall(r"toolledger\.sweep: (\{.*\})", log_text)
    return sum(json.loads(s)["marked_unknown"] for s in found)


# ------------------------------------------------------------------------ the run


@pytest.fixture
def metrics_app_url(pg_url: str) -> Iterator[str]:
    """The /metrics ASGI app served by uvicorn in a thread of this process."""
    import uvicorn

    counters.disable()
    ledger = Ledger(pg_url)
    port = free_port()
    config = uvicorn.Config(asgi_app(ledger, ttl=0.5), port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 20, "uvicorn started")
    yield f"http://127.0.0.1:{port}/metrics"
    server.should_exit = True
    thread.join(10)
    ledger.close()
    counters.disable()


def test_metrics__agree_with_the_ledger_after_a_small_chaos_run(
    pg_url, redis_server, redis_prefix, tmp_path, metrics_app_url
):
    # Given a worker whose children are SIGKILLed before or after about 1 in 4 effects, and a beat
    # sweeping every second with 2-second leases
    settings_env = probe_settings(
        pg_url,
        redis_server,
        redis_prefix,
        tmp_path,
        lease_seconds="2",
        sweep_interval="1",
        sweep_grace="0",
        requeue_after="3",
    )
    worker_port, beat_port = free_port(), free_port()
    env = service_env(**settings_env, failpoints="before_effect=15%kill;after_effect=15%kill")
    worker = worker_process(
        "w1", {**env, "TOOLLEDGER_METRICS_PORT": str(worker_port)}, tmp_path / "logs"
    )
    beat = beat_process(
        "beat",
        service_env(**settings_env, metrics_port=str(beat_port)),
        tmp_path / "logs",
        "--interval",
        "1",
    )
    procs = [worker.start(), beat.start()]
    try:
        worker.wait_ready(60)
        beat.wait_ready(60)
        settings = Settings.from_env(
            {f"TOOLLEDGER_{k.upper()}": v for k, v in settings_env.items()}
        )
        sub = Submitter(settings)
        # When 40 calls are submitted approved and 3 wait for approval
        for i in range(43):
            args = {"path": f"out/{i}.txt", "content": f"c{i}", "hold_ms": 40}
            call = sub.prepare("chaos", f"call_{i}", "probe_write", args)
            sub.submit(call, approved_by="alice" if i < 40 else None)
        ledger = Ledger(pg_url)

        def settled() -> bool:
            now = Counter(c.status for c in ledger.list_calls(limit=0))
            return now[Status.APPROVED] == now[Status.RUNNING] == 0

        wait_for(settled, 120, "every approved call settled")
        time.sleep(2.5)  # one more sweep pass finds nothing left; the gauges' cache expires
        wait_for(lambda: settled() and "toolledger.sweep" in worker.log_text(), 10, "a sweep")
        # Then the scraped values agree with the ledger's account, read before and after the
        # scrapes, unchanged between: the sweep still reconciles an unknown call now and then
        # (to failed, say), and a scrape between the gauges' read and the ledger's compared two
        # moments (CI under load: unknown scraped 1, ledger 0; failed 13 against 14)
        for _ in range(10):
            facts = ledger_facts(ledger, sweep_marked(worker.log_text()))
            time.sleep(2.5)  # past the gauges' cache, the ledger standing still
            worker_samples = scrape(f"http://127.0.0.1:{worker_port}/metrics")
            beat_samples = scrape(f"http://127.0.0.1:{beat_port}/metrics")
            app_samples = scrape(metrics_app_url)
            if ledger_facts(ledger, sweep_marked(worker.log_text())) == facts:
                break
        print(json.dumps(facts))
        assert facts["claims"] > 40, "the run must have redelivered or retried something"
        assert disagreements(beat_samples, worker_samples, facts) == []
        assert disagreements(app_samples, worker_samples, facts) == []
        # and the transitions counted in this process (submit) are served by the app
        assert total(app_samples, "toolledger_calls_total", status="pending_approval") == 3
        assert total(app_samples, "toolledger_calls_total", status="approved") == 40
        # the histograms saw every claim and the sweep ran and succeeded
        # every execution whose executor wrote its own terminal status was timed (a killed
        # one's row ends reconciled or unknown, and some calls end there: not "all 40")
        with ledger.engine.connect() as conn:
            own = conn.execute(
                sa.select(sa.func.count()).where(
                    executions.c.status.in_(["succeeded", "failed"]),
                    executions.c.reconciled.is_(False),
                )
            ).scalar_one()
        assert own > 0
        assert total(worker_samples, "toolledger_execution_duration_seconds_count") >= own
        assert (
            total(worker_samples, "toolledger_schedule_to_start_seconds_count") >= facts["claims"]
        )
        assert total(worker_samples, "toolledger_sweep_duration_seconds_count") >= 1
        assert total(worker_samples, "toolledger_sweep_last_success_timestamp_seconds") > 0
        assert total(beat_samples, "toolledger_sweep_interval_seconds") == 1.0
        # the grace the running-past-its-lease alert waits for; every pass landed what it
        # swept (the prefork children's last value); nothing approved or running is left
        assert beat_samples[("toolledger_sweep_grace_seconds", ())] == 0.0
        assert worker_samples[("toolledger_sweep_unlanded_paths", ())] == 0.0
        for samples in (beat_samples, app_samples):
            assert samples[("toolledger_approved_calls", (("kind", "claimable"),))] == 0.0
            assert all(
                name != "toolledger_running_oldest_lease_expiry_timestamp_seconds"
                for name, _ in samples
            )
        sub.close()
        ledger.close()
    finally:
        stop_all(procs)


def test_metrics__one_prometheus_multiproc_dir_for_two_workers_and_a_beat(
    fresh_db_url, redis_server, redis_prefix, tmp_path
):
    """PROMETHEUS_MULTIPROC_DIR set once for every process of a host (prometheus_client's own
    habit): each worker counts in a directory of its own inside it, the beat in memory. Before,
    the second worker wiped the first's files, both endpoints served the same sum, and the beat
    served the workers' counts too: summed by Prometheus, every call counted several times."""
    # Given one directory for everyone, holding a killed worker's leftovers from this host and
    # a live directory of another host's
    shared = tmp_path / "prom"
    host = socket.gethostname()
    probe = subprocess.Popen(["true"])  # a pid that has exited
    probe.wait()
    dead = probe.pid
    (shared / f"worker-{host}-{dead}").mkdir(parents=True)
    (shared / f"worker-{host}-{dead}" / "counter_1.db").write_bytes(b"old")
    (shared / "worker-elsewhere-1").mkdir()
    settings_env = probe_settings(
        fresh_db_url, redis_server, redis_prefix, tmp_path, sweep_interval="1"
    )
    ports = [free_port() for _ in range(3)]
    env = {**service_env(**settings_env), "PROMETHEUS_MULTIPROC_DIR": str(shared)}
    workers = [
        worker_process(f"w{i}", {**env, "TOOLLEDGER_METRICS_PORT": str(ports[i])}, tmp_path)
        for i in range(2)
    ]
    beat = beat_process(
        "beat", {**env, "TOOLLEDGER_METRICS_PORT": str(ports[2])}, tmp_path, "--interval", "1"
    )
    procs: list[Any] = []
    try:
        for worker in workers:  # one after the other: the second starts while the first counts
            procs.append(worker.start())
            worker.wait_ready(60)
        procs.append(beat.start())
        beat.wait_ready(60)
        settings = Settings.from_env(
            {f"TOOLLEDGER_{k.upper()}": v for k, v in settings_env.items()}
        )
        sub = Submitter(settings)
        # When 12 calls run, on either worker
        for i in range(12):
            call = sub.prepare(
                "dir", f"call_{i}", "probe_write", {"path": f"{i}.txt", "content": "x"}
            )
            sub.submit(call, approved_by="alice")
        ledger = Ledger(fresh_db_url)
        wait_for(
            lambda: Counter(c.status for c in ledger.list_calls(limit=0))[Status.SUCCEEDED] == 12,
            120,
            "every call succeeded",
        )
        # Then each is counted once across the endpoints a Prometheus would scrape
        samples = [scrape(f"http://127.0.0.1:{port}/metrics") for port in ports]
        for status in ("running", "succeeded"):
            counted = [total(s, "toolledger_calls_total", status=status) for s in samples]
            assert counted[0] + counted[1] == 12 and counted[2] == 0, (status, counted)
        # the beat never sweeps: it exports no last-success time (it exported 0, 1970)
        assert LAST_SUCCESS not in {name for name, _ in samples[2]}, samples[2]
        # each worker has its directory, the dead worker's is gone, another host's is not
        mine = sorted(p.name for p in shared.iterdir())
        assert mine == sorted(
            ["worker-elsewhere-1", *(f"worker-{host}-{w.pid}" for w in workers)]
        ), mine
        sub.close()
        ledger.close()
    finally:
        stop_all(procs)
    # and a worker that stopped took its directory with it
    assert [p.name for p in shared.iterdir()] == ["worker-elsewhere-1"]


def listening_on(port: int) -> set[str]:
    """The local addresses of the IPv4 sockets listening on ``port`` (/proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        ip, at = local.split(":")
        if state == "0A" and int(at, 16) == port:  # TCP_LISTEN
            found.add(socket.inet_ntoa(bytes.fromhex(ip)[::-1]))
    return found


@pytest.mark.parametrize("addr", [None, "127.0.0.1"])
def test_worker__a_metrics_port_of_0_is_logged_once_ready(tmp_path, addr):
    """Any free port is only useful if the worker says which: its endpoint opens before
    Celery sets up logging, which dropped the line (the beat said it; the worker did not).
    It listens on every interface unless TOOLLEDGER_METRICS_ADDR says where (it could not be
    kept to loopback, a cold review)."""
    env = service_env(home=str(tmp_path / "home"), metrics_port="0")
    if addr is not None:
        env["TOOLLEDGER_METRICS_ADDR"] = addr
    worker = worker_process("w", env, tmp_path, concurrency=1)
    procs = [worker.start()]
    expected = addr or "0.0.0.0"  # noqa: S104 - the default said
    try:
        worker.wait_ready(60)
        said = wait_for(
            lambda: re.search(
                rf"metrics at http://{re.escape(expected)}:(\d+)/metrics", worker.log_text()
            ),
            10,
            "the metrics line",
        )
        samples = scrape(f"http://127.0.0.1:{said.group(1)}/metrics")
        assert any(name.startswith("toolledger_") for name, _ in samples), samples
        assert listening_on(int(said.group(1))) == {expected}
    finally:
        stop_all(procs)


def test_serve__counts_in_memory_whatever_prometheus_multiproc_dir_says(
    sqlite_url, tmp_path, monkeypatch
):
    """prometheus_client picks its value class when imported: in a process started with
    PROMETHEUS_MULTIPROC_DIR, ``serve``'s counts would go into that directory's files (a
    worker's, served twice) unless it counts in memory."""
    from prometheus_client import values

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    # as if imported with the variable set (this process imported it without)
    monkeypatch.setattr(values, "ValueClass", values.get_value_class())
    monkeypatch.setattr(counters, "_metrics", None)
    ledger = Ledger(sqlite_url)
    ledger.upgrade()
    asgi_app(ledger)
    counters.transition("write_file", "approved")
    assert list(tmp_path.iterdir()) == []
    active = counters.active()
    assert active is not None
    ledger.close()


# ------------------------------------------------------------------------ the checks can fail


AGREEING: dict[str, Any] = {
    "calls": {"succeeded": 5, "unknown": 2, "pending_approval": 1},
    "executions": {"succeeded": 5, "failed": 1, "unknown": 2},
    "claims": 8,
    "lease_expired_events": 3,
    "sweep_marked": 3,
    "contradicted": 0,
}


def crafted() -> tuple[Scrape, Scrape]:
    def k(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return name, tuple(sorted(labels.items()))

    gauges = {
        k("toolledger_calls", status="unknown"): 2.0,
        k("toolledger_calls", status="pending_approval"): 1.0,
        k("toolledger_calls", status="approved"): 0.0,
        k("toolledger_calls", status="running"): 0.0,
        k("toolledger_inbox", kind="unknown"): 2.0,
        k("toolledger_inbox", kind="pending_approval"): 1.0,
        k("toolledger_inbox", kind="contradicted"): 0.0,
    }
    worker = {
        k("toolledger_lease_expired_total"): 3.0,
        k("toolledger_calls_total", tool="w", status="running"): 8.0,
        k("toolledger_calls_total", tool="w", status="succeeded"): 5.0,
        k("toolledger_calls_total", tool="w", status="failed"): 1.0,
        k("toolledger_calls_total", tool="w", status="unknown"): 3.0,
    }
    return gauges, worker


WRONG = [
    ("calls gauge", "gauges", ("toolledger_calls", (("status", "unknown"),)), 3.0),
    ("inbox unknown", "gauges", ("toolledger_inbox", (("kind", "unknown"),)), 1.0),
    ("inbox pending", "gauges", ("toolledger_inbox", (("kind", "pending_approval"),)), 0.0),
    ("inbox contradicted", "gauges", ("toolledger_inbox", (("kind", "contradicted"),)), 1.0),
    ("lease expirations", "worker", ("toolledger_lease_expired_total", ()), 2.0),
    ("claims", "worker", ("toolledger_calls_total", (("status", "running"), ("tool", "w"))), 9.0),
    (
        "succeeded",
        "worker",
        ("toolledger_calls_total", (("status", "succeeded"), ("tool", "w"))),
        4.0,
    ),
]


def test_disagreements__none_on_agreeing_values():
    gauges, worker = crafted()
    assert disagreements(gauges, worker, AGREEING) == []


@pytest.mark.parametrize(("what", "which", "key", "value"), WRONG, ids=[w[0] for w in WRONG])
def test_disagreements__each_check_fails_on_a_wrong_value(what, which, key, value):
    gauges, worker = crafted()
    (gauges if which == "gauges" else worker)[key] = value
    found = disagreements(gauges, worker, AGREEING)
    assert len(found) >= 1, what
    assert key[0] in " ".join(found) or what == "claims"


def test_disagreements__sweep_marked_differs_from_the_counter():
    gauges, worker = crafted()
    facts = {**AGREEING, "sweep_marked": 4}
    assert disagreements(gauges, worker, facts) == [
        "toolledger_lease_expired_total vs the sweeps' marked: scraped 3.0, ledger 4"
    ]


def test_sweep_marked__sums_the_summaries_a_worker_logged(tmp_path: Path):
    log = (
        'x toolledger.sweep: {"marked_unknown": 2, "errors": []}\n'
        "unrelated line\n"
        'y toolledger.sweep: {"marked_unknown": 1, "errors": []}\n'
    )
    assert sweep_marked(log) == 3
    assert sweep_marked("") == 0


# ------------------------------------------------------------------------ cost


def test_state_counts__each_part_can_use_a_partial_index(pg_url):
    """With sequential scans priced out, every part of the gauges' statement is answered
    from a partial index: their predicates match, so the cost follows the open calls."""
    from toolledger.observability import metrics

    ledger = Ledger(pg_url)
    captured: list[str] = []

    @sa.event.listens_for(ledger.engine, "before_cursor_execute", retval=True)
    def explain(conn, cursor, statement, parameters, context, executemany):
        read = statement.lstrip().upper().startswith("SELECT")
        if read and ("operations" in statement or "executions" in statement):
            cursor.execute("SET enable_seqscan = off")
            cursor.execute("EXPLAIN " + statement, parameters)
            captured.extend(row[0] for row in cursor.fetchall())
        return statement, parameters

    try:
        counts = metrics.state_counts(ledger)
    finally:
        ledger.close()
    plan = "\n".join(captured)
    assert set(counts["calls"]) == {s.value for s in OPEN_STATUSES}
    for index in ("ix_operations_waiting", "ix_operations_approved_unclaimed"):
        assert index in plan, plan
    assert "ix_operations_review" in plan, plan
    assert "ix_executions_unknown" in plan, plan  # the oldest unknown (the oldest pending
    # approval: ix_operations_attention or ix_operations_waiting, as the planner prices them)
    assert "ix_executions_running_lease" in plan, plan  # the earliest running lease
    assert "Seq Scan" not in plan, plan


def test_inbox_oldest__since_the_submit_and_since_the_lease_expired(fresh_db_url):
    """A pending approval waits since its submit; an unknown call since its execution's lease
    expired, or since its last heartbeat if it was marked unknown before that (an executor
    known to be gone: the gauge read a time in the future, by the whole lease, a cold review),
    and only while the call is still unknown (a retried attempt's old execution stays
    unknown, and must not be taken for a call waiting on a person)."""
    from toolledger.observability.metrics import LedgerStateCollector, state_counts

    ledger = Ledger(fresh_db_url)
    try:
        assert state_counts(ledger)["oldest"] == {}

        def went_unknown(call: str, lease: float) -> float:
            ledger.submit("s", call, "write_file", {"path": call, "content": "x"}, approved_by="b")
            claim = ledger.claim("s", f"write_file:{call}", 1, worker_id="w", lease_seconds=lease)
            assert claim is not None
            if lease < 1:
                time.sleep(lease + 0.05)  # expired: the sweep's case
            ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")
            (ex,) = ledger.get("s", call).executions
            assert ex.lease_expires_at is not None
            if lease < 1:
                return ex.lease_expires_at.timestamp()
            (marked,) = [e for e in ledger.events("s", call) if e.kind == "unknown"]
            return marked.at.timestamp()  # marked before its lease would have expired

        went_unknown("retried", 1)  # the earliest lease of all, then retried: approved now
        ledger.authorize_retry("s", "retried", by="otto", accept_duplicate=True)
        ledger.submit("s", "p1", "write_file", {"path": "p1", "content": "x"})
        ledger.submit("s", "p2", "write_file", {"path": "p2", "content": "x"})
        unknown = went_unknown("u1", 1.5)  # marked at once; its lease passes below
        went_unknown("u2", 3600)
        went_unknown("u3", 0.2)  # its lease expired after u1 was marked
        time.sleep(1.6)  # u1's lease has passed: it still waits since it was marked
        oldest = state_counts(ledger)["oldest"]
        assert oldest["unknown"] <= time.time()
        first = ledger.get("s", "p1").operation.created_at.timestamp()
        assert oldest == {
            "pending_approval": pytest.approx(first, abs=1e-3),
            "unknown": pytest.approx(unknown, abs=1e-3),
        }
        samples = {
            tuple(s.labels.items()): s.value
            for family in LedgerStateCollector(ledger, ttl=0).collect()
            if family.name == "toolledger_inbox_oldest_timestamp_seconds"
            for s in family.samples
        }
        assert samples == {
            (("kind", "pending_approval"),): pytest.approx(first, abs=1e-3),
            (("kind", "unknown"),): pytest.approx(unknown, abs=1e-3),
        }
    finally:
        ledger.close()


def test_inbox_oldest__a_flagged_call_since_the_flag_it_carries_now(fresh_db_url):
    """A flagged call (contradicted, both_ran, not_landed) waits on a person since it was
    flagged: since its last ``flagged`` event (a review that raises another flag starts the
    wait anew), and only while the flag stands."""
    from toolledger.observability.metrics import state_counts

    ledger = Ledger(fresh_db_url)

    def unknown(call: str) -> str:
        ledger.submit("s", call, "notify", {"to": call}, approved_by="al")
        claim = ledger.claim("s", f"notify:{call}", 1, worker_id="zombie")
        assert claim is not None
        ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")
        return claim.execution_id

    def contradicted(eid: str) -> None:
        ledger.resolve(eid, Status.FAILED, by="bob", evidence="nothing sent")
        late = {"late_result": {"sent": 1}}
        ledger.record_late_result(eid, late, actor="zombie", outcome=Status.SUCCEEDED)

    def flagged_at(call: str) -> float:
        return max(e.at for e in ledger.events("s", call) if e.kind == "flagged").timestamp()

    try:
        # Given c1 contradicted while its retry runs, then c2 contradicted
        a = unknown("c1")
        ledger.resolve(a, Status.FAILED, by="bob", evidence="nothing sent")
        ledger.authorize_retry("s", "c1", by="carol", accept_duplicate=True)
        retried = ledger.claim("s", "notify:c1", 2, worker_id="w2")
        assert retried is not None
        late = {"late_result": {"sent": 1}}
        ledger.record_late_result(a, late, actor="zombie", outcome=Status.SUCCEEDED)
        first = flagged_at("c1")
        b = unknown("c2")
        contradicted(b)
        assert flagged_at("c2") > first
        assert state_counts(ledger)["oldest"] == {"contradicted": pytest.approx(first, abs=1e-3)}
        # When c1's review, once its retry has ended, finds both attempts ran: both_ran
        ledger.finish(retried.execution_id, retried.lease_token, Status.SUCCEEDED, {"sent": 2})
        ledger.review(a, Status.SUCCEEDED, by="bob", evidence="the late result is right")
        assert ledger.get("s", "c1").operation.review == "both_ran"
        assert flagged_at("c1") > flagged_at("c2")
        # Then contradicted waits since c2's flag, both_ran since c1's second one
        assert state_counts(ledger)["oldest"] == {
            "contradicted": pytest.approx(flagged_at("c2"), abs=1e-3),
            "both_ran": pytest.approx(flagged_at("c1"), abs=1e-3),
        }
        # and a settled flag waits no more
        ledger.review(b, Status.FAILED, by="erin", evidence="really not sent")
        assert set(state_counts(ledger)["oldest"]) == {"both_ran"}
    finally:
        ledger.close()


def test_approved_calls__by_whether_a_worker_may_claim_them(fresh_db_url):
    """``toolledger_approved_calls{kind}`` splits the approved calls as the outbox does: an
    MCP proxy's (mcp.*) and a flagged one no worker may claim, and the no-claims alert, on
    every approved call, fired on an idle healthy stack holding one (a cold review). The
    oldest claimable call waits since its approval, a retried one since its retry's
    authorisation (its first approval is older, and says nothing of this attempt)."""
    from toolledger.observability.metrics import LedgerStateCollector, state_counts

    ledger = Ledger(fresh_db_url)
    try:
        assert state_counts(ledger)["approved"] == {"claimable": 0, "flagged": 0, "proxied": 0}
        assert state_counts(ledger)["since"] == {}

        def unknown(call: str, tool: str, args: dict[str, Any]) -> str:
            ledger.submit("s", call, tool, args, approved_by="al")
            claim = ledger.claim("s", f"{tool}:{call}", 1, worker_id="zombie")
            assert claim is not None
            ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")
            return claim.execution_id

        # a call approved first, retried last; one approved between: the oldest wait
        unknown("retried", "write_file", {"path": "r", "content": "x"})
        ledger.submit("s", "c1", "write_file", {"path": "c1", "content": "x"}, approved_by="al")
        approved_at = ledger.get("s", "c1").operation.decided_at
        assert approved_at is not None
        time.sleep(0.01)
        ledger.authorize_retry("s", "retried", by="otto", accept_duplicate=True)
        # an MCP proxy's call, left approved (its proxy killed before its claim)
        ledger.submit("desk", "p1", "mcp.echo", {"text": "hi"}, key="mcp.echo:p1",
                      approved_by="mcp-proxy")  # fmt: skip
        # a flagged call whose retry is approved: contradicted, no claim until reviewed
        a = unknown("flag", "notify", {"to": "x"})
        ledger.resolve(a, Status.FAILED, by="bob", evidence="nothing sent")
        # the retry authorised before the flag (one is refused while a flag waits)
        ledger.authorize_retry("s", "flag", by="carol", accept_duplicate=True)
        late = {"late_result": {"sent": 1}}
        ledger.record_late_result(a, late, actor="zombie", outcome=Status.SUCCEEDED)
        assert ledger.get("s", "flag").operation.review == "contradicted"

        counts = state_counts(ledger)
        assert counts["approved"] == {"claimable": 2, "flagged": 1, "proxied": 1}
        assert counts["calls"]["approved"] == 4  # toolledger_calls{status="approved"}: all
        assert counts["since"] == {
            "approved_claimable": pytest.approx(approved_at.timestamp(), abs=1e-3)
        }
        served = {
            (family.name, tuple(s.labels.items())): s.value
            for family in LedgerStateCollector(ledger, ttl=0).collect()
            for s in family.samples
            if family.name.startswith("toolledger_approved")
        }
        assert served == {
            ("toolledger_approved_calls", (("kind", "claimable"),)): 2,
            ("toolledger_approved_calls", (("kind", "flagged"),)): 1,
            ("toolledger_approved_calls", (("kind", "proxied"),)): 1,
            ("toolledger_approved_claimable_oldest_timestamp_seconds", ()): pytest.approx(
                approved_at.timestamp(), abs=1e-3
            ),
        }
    finally:
        ledger.close()


def test_running_oldest_lease_expiry__the_earliest_lease_of_the_running_executions(
    fresh_db_url,
):
    """A call running long past its lease that no sweep marks unknown (the sweeper pointed at
    another ledger) showed in no gauge: ``toolledger_running_oldest_lease_expiry_timestamp_
    seconds`` is the earliest lease expiry of the executions running now, absent when none
    runs."""
    from toolledger.observability.metrics import LedgerStateCollector, state_counts

    def gauge() -> list[float]:
        return [
            s.value
            for family in LedgerStateCollector(ledger, ttl=0).collect()
            if family.name == "toolledger_running_oldest_lease_expiry_timestamp_seconds"
            for s in family.samples
        ]

    ledger = Ledger(fresh_db_url)
    try:
        assert gauge() == []
        for call, lease in (("long", 3600), ("short", 60), ("gone", 1)):
            ledger.submit("s", call, "write_file", {"path": call, "content": "x"},
                          approved_by="al")  # fmt: skip
            claim = ledger.claim("s", f"write_file:{call}", 1, worker_id="w", lease_seconds=lease)
            assert claim is not None
        (gone,) = ledger.get("s", "gone").executions
        ledger.mark_unknown(gone.execution_id, reason="lease expired", actor="sweep")
        (short,) = ledger.get("s", "short").executions
        assert short.lease_expires_at is not None
        expected = short.lease_expires_at.timestamp()
        assert state_counts(ledger)["since"] == {"running_lease": pytest.approx(expected, abs=1e-3)}
        assert gauge() == [pytest.approx(expected, abs=1e-3)]
    finally:
        ledger.close()


def test_collector__cached_for_its_ttl(sqlite_url):
    from toolledger.observability.metrics import LedgerStateCollector

    ledger = Ledger(sqlite_url)
    collector = LedgerStateCollector(ledger, ttl=3600)
    before = collector.counts()
    ledger.submit("cache", "c1", "write_file", {"path": "a", "content": "x"})
    assert collector.counts() == before  # served from cache
    collector.ttl = 0
    after = collector.counts()
    ledger.close()
    assert after is not None and before is not None
    assert after["calls"]["pending_approval"] == before["calls"]["pending_approval"] + 1


def test_collector__an_unreadable_ledger_is_said_beside_the_values_it_last_read(
    sqlite_url, monkeypatch
):
    """The ledger's gauges go on being served when it cannot be read (a vanished gauge would
    resolve its alerts), but ``toolledger_ledger_state_up`` says 0 and the timestamp says when
    they were read: frozen values were served as current (a cold review)."""
    from toolledger.observability import metrics as m

    def served(collector: m.LedgerStateCollector) -> dict[str, float]:
        return {
            (s.name + str(sorted(s.labels.items())) if s.labels else s.name): s.value
            for family in collector.collect()
            for s in family.samples
        }

    ledger = Ledger(sqlite_url)
    try:
        collector = m.LedgerStateCollector(ledger, ttl=0)
        ok = served(collector)
        assert ok["toolledger_ledger_state_up"] == 1.0
        assert ok["toolledger_ledger_state_timestamp_seconds"] == pytest.approx(time.time(), abs=5)

        def unreadable(_ledger: Ledger) -> None:
            raise sa.exc.OperationalError("SELECT", {}, Exception("the server went away"))

        monkeypatch.setattr(m, "state_counts", unreadable)
        time.sleep(0.01)
        down = served(collector)
        assert down["toolledger_ledger_state_up"] == 0.0
        # the values last read, and when: unchanged
        assert {k: v for k, v in down.items() if k != "toolledger_ledger_state_up"} == {
            k: v for k, v in ok.items() if k != "toolledger_ledger_state_up"
        }
        # never read at all: the up gauge alone
        never = served(m.LedgerStateCollector(ledger, ttl=0))
        assert never == {"toolledger_ledger_state_up": 0.0}
    finally:
        ledger.close()


@pytest.mark.parametrize(
    "error",
    [
        sa.exc.OperationalError("SELECT", {}, Exception("the server went away")),
        # not the database's: a bug, a driver's own error, a thread's MemoryError
        RuntimeError("something else"),
    ],
    ids=["sqlalchemy", "other"],
)
def test_collector__a_failed_read_is_not_tried_again_for_its_ttl(
    sqlite_url, monkeypatch, caplog, error
):
    """Every scrape read the ledger again while it failed (nothing was cached): scrapes
    queued, each holding a server thread (a cold review). Tried once per ttl, as a success.
    An error that was not SQLAlchemy's went through: every scrape failed whole (no counters
    either) and read again."""
    from toolledger.observability import metrics as m

    tries = []

    def unreadable(_ledger: Ledger) -> None:
        tries.append(1)
        raise error

    monkeypatch.setattr(m, "state_counts", unreadable)
    ledger = Ledger(sqlite_url)
    try:
        collector = m.LedgerStateCollector(ledger, ttl=3600)
        for _ in range(5):
            assert collector.counts() is None
        assert len(tries) == 1
        up = [s.value for f in collector.collect() for s in f.samples]
        assert up == [0.0] and len(tries) == 1
        assert any(type(error).__name__ in r.getMessage() for r in caplog.records)
    finally:
        ledger.close()


def test_serve_metrics__a_slow_ledger_read_does_not_hold_the_event_loop(sqlite_url, monkeypatch):
    """``/metrics`` reads the ledger in a worker thread: run on the event loop, one scrape
    while the ledger was slow held every API and console request (10.6 s for a 404, a cold
    review)."""
    import httpx
    import uvicorn

    from toolledger.observability import metrics as m

    entered, release = threading.Event(), threading.Event()
    real = m.state_counts

    def slow(ledger: Ledger) -> dict[str, dict[str, float]]:
        entered.set()
        release.wait(30)
        return real(ledger)

    counters.disable()
    ledger = Ledger(sqlite_url)
    metrics_app = asgi_app(ledger, ttl=0)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/ping":  # a route without the ledger
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await metrics_app(scope, receive, send)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 20, "uvicorn started")
        monkeypatch.setattr(m, "state_counts", slow)
        scraped: list[int] = []
        scraper = threading.Thread(
            target=lambda: scraped.append(
                httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=40).status_code
            )
        )
        scraper.start()
        assert entered.wait(10), "the scrape never read the ledger"
        # While the scrape waits on the ledger, another request is answered, and so is a
        # second scrape, with what was last read (it waited on the first's lock, on the loop)
        assert httpx.get(f"http://127.0.0.1:{port}/ping", timeout=5).status_code == 204
        second = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert second.status_code == 200 and "toolledger_ledger_state_up 0.0" in second.text
        release.set()
        scraper.join(40)
        assert scraped == [200]
    finally:
        release.set()
        server.should_exit = True
        thread.join(10)
        ledger.close()
        counters.disable()


def test_cold_paths__import_neither_prometheus_client_nor_opentelemetry():
    """The CLI's read paths, the worker's pipeline and the submitter import neither library
    (prometheus_client alone costs ~150 ms): they load when a process turns metrics on."""
    import subprocess
    import sys

    code = (
        "import sys, toolledger.cli, toolledger.worker.pipeline, toolledger.worker.submit, "
        "toolledger.recovery.sweep, toolledger.observability\n"
        "bad = [m for m in sys.modules if m.startswith(('prometheus_client', 'opentelemetry'))]\n"
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


LAST_SUCCESS = "toolledger_sweep_last_success_timestamp_seconds"


def test_sweep_last_success__absent_until_a_pass_succeeds():
    """A process that never swept exported 0 (1970) beside the sweepers' times: a dashboard
    read it as a sweep failing since 1970, and ``absent()`` could never fire while one such
    process was scraped."""
    from toolledger.ledger import metrics as counters

    counters.disable()
    try:
        own = counters.enable()
        assert own.registry.get_sample_value(LAST_SUCCESS) is None
        counters.sweep_finished(0.1, ok=False)
        assert own.registry.get_sample_value(LAST_SUCCESS) is None
        before = time.time()
        counters.sweep_finished(0.1, ok=True)
        counters.sweep_finished(0.1, ok=True)  # made once, set again
        assert (own.registry.get_sample_value(LAST_SUCCESS) or 0) >= before
    finally:
        counters.disable()


def test_sweep_unlanded__the_last_successful_pass_says_how_many_paths_did_not_land():
    """``toolledger_sweep_unlanded_paths``: a pass's busy paths (committed bytes another
    lander's lock kept from landing) were said only in its log line (a cold review). Absent
    until a pass succeeds; a failed pass, which may not have looked, leaves it as it was."""
    from toolledger.ledger import metrics as counters

    name = "toolledger_sweep_unlanded_paths"
    counters.disable()
    try:
        own = counters.enable()
        assert own.registry.get_sample_value(name) is None
        counters.sweep_finished(0.1, ok=True, unlanded=2)
        assert own.registry.get_sample_value(name) == 2
        counters.sweep_finished(0.1, ok=False, unlanded=0)
        assert own.registry.get_sample_value(name) == 2
        counters.sweep_finished(0.1, ok=True, unlanded=0)
        assert own.registry.get_sample_value(name) == 0
    finally:
        counters.disable()


def test_sweep_duration__a_pass_that_raised_is_a_pass_too(
    sqlite_template: Path, tmp_path: Path
) -> None:
    """A pass the ledger stops (out of reach, a table gone) raised before it was counted:
    with Postgres stopped for 45 s under a real sweeper, 8 passes ran and failed and
    ``toolledger_sweep_duration_seconds_count`` stood still, as if no sweep were scheduled
    (a cold review). It is counted now, and the last success left as it was."""
    import shutil

    from prometheus_client import CollectorRegistry

    from toolledger.recovery.sweep import sweep
    from toolledger.registry import load_registry
    from toolledger.sandbox import Sandbox

    path = tmp_path / "ledger.db"
    shutil.copyfile(sqlite_template, path)  # a ledger of its own, migrated
    with sa.create_engine(f"sqlite:///{path}").begin() as conn:
        conn.execute(sa.text("DROP TABLE executions"))  # the pass cannot read the ledger
    registry = CollectorRegistry()
    counters.disable()
    counters.enable(registry)
    settings = Settings.from_env({"TOOLLEDGER_SANDBOX": str(tmp_path / "sb")})
    ledger = Ledger(f"sqlite:///{path}")
    try:
        with pytest.raises(sa.exc.OperationalError):
            sweep(ledger, load_registry(""), Sandbox.configured(settings),
                  grace_seconds=0, requeue_after=3600, publish=None)  # fmt: skip
    finally:
        ledger.close()
        counters.disable()
    assert registry.get_sample_value("toolledger_sweep_duration_seconds_count") == 1
    assert registry.get_sample_value(LAST_SUCCESS) is None


@pytest.mark.parametrize("seconds", [500, 1500, 3000])
def test_duration_buckets__tell_apart_what_a_lease_of_an_hour_allows(seconds: float) -> None:
    """The buckets ended at 300 s: a tool run under a long lease (up to a day; its time
    limits 2/3 and 5/6 of it) or a job behind a queue of minutes fell in +Inf, and every
    quantile over 300 s read 300 (histogram_quantile's highest finite bucket): a run of
    10 minutes and one of 50 looked alike (a cold review)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    counters.disable()
    counters.enable(registry)
    try:
        counters.execution_finished("write_file", seconds)
        counters.scheduled_started("write_file", time.time() - seconds)
    finally:
        counters.disable()
    for name in ("toolledger_execution_duration_seconds", "toolledger_schedule_to_start_seconds"):
        finite = [
            float(s.labels["le"])
            for metric in registry.collect()
            if metric.name == name
            for s in metric.samples
            if s.name.endswith("_bucket") and s.labels["le"] != "+Inf" and s.value == 1
        ]
        # in a finite bucket at most twice its value: a quantile within a factor of 2
        assert finite and min(finite) <= 2 * seconds, (name, finite)


def test_metrics_off__no_endpoint_and_no_counting(monkeypatch):
    from toolledger.observability import metrics

    monkeypatch.setenv("TOOLLEDGER_METRICS", "off")
    counters.disable()
    assert metrics.start_worker_metrics() is None
    assert counters.active() is None
    counters.transition("write_file", "running")  # a no-op


def test_ledger__counts_its_own_transitions_where_they_commit(sqlite_url):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    counters.disable()
    counters.enable(registry)
    try:
        ledger = Ledger(sqlite_url)
        ledger.submit("count", "c1", "write_file", {"path": "a", "content": "x"})
        ledger.submit("count", "c1", "write_file", {"path": "a", "content": "x"})  # existing
        ledger.approve("count", "c1", by="alice")
        claim = ledger.claim("count", "write_file:c1", 1, worker_id="w")
        assert claim is not None
        assert ledger.claim("count", "write_file:c1", 1, worker_id="w2") is None  # lost
        ledger.finish(claim.execution_id, claim.lease_token, Status.SUCCEEDED, {"ok": True})
        ledger.submit("count", "c2", "write_file", {"path": "b", "content": "x"}, approved_by="a")
        ledger.close()
    finally:
        counters.disable()

    def calls(status: str) -> float | None:
        labels = {"tool": "write_file", "status": status}
        return registry.get_sample_value("toolledger_calls_total", labels)

    assert calls("pending_approval") == 1  # the repeated submit changed nothing
    assert calls("approved") == 2
    assert calls("running") == 1  # the lost claim is no transition
    assert calls("succeeded") is None  # the executor counts its terminal write (pipeline)


def test_late_result__settling_an_unknown_counts_as_a_reconciliation(fresh_db_url):
    """A late result that proves what an unknown execution did settles it at once, in the
    ledger: counted in ``toolledger_reconciled_total`` and as the call's transition, as the
    sweep counts the same proof (it was counted nowhere, and the dashboard's reconciliations
    missed every one a fenced-out worker settled itself). Evidence that proves nothing, or
    arrives for a settled execution, counts nothing."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    counters.disable()
    counters.enable(registry)
    ledger = Ledger(fresh_db_url)
    try:
        eids = []
        for call in ("c1", "c2"):
            ledger.submit("late", call, "notify", {"to": call}, approved_by="al")
            claim = ledger.claim("late", f"notify:{call}", 1, worker_id="zombie")
            assert claim is not None
            ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")
            eids.append(claim.execution_id)
        late = {"late_result": {"sent": 1}}
        ledger.record_late_result(eids[0], late, actor="zombie", outcome=Status.SUCCEEDED)
        ledger.record_late_result(eids[0], late, actor="zombie", outcome=Status.SUCCEEDED)
        ledger.record_late_result(eids[1], {"late_result": {}}, actor="zombie", outcome=None)
        assert ledger.get("late", "c1").operation.status is Status.SUCCEEDED
        assert ledger.get("late", "c2").operation.status is Status.UNKNOWN
    finally:
        ledger.close()
        counters.disable()
    outcome = {"outcome": "succeeded"}
    assert registry.get_sample_value("toolledger_reconciled_total", outcome) == 1
    labels = {"tool": "notify", "status": "succeeded"}
    assert registry.get_sample_value("toolledger_calls_total", labels) == 1


@pytest.mark.parametrize("port", ["given", "any"])
def test_worker_with_embedded_beat__one_endpoint_serves_counters_once_and_gauges(tmp_path, port):
    """``worker -B``: Celery forks the beat from the worker's main process, where it
    inherited the group's multiprocess directory. Its endpoint served the worker's counters a
    second time (on :9809: every count twice, the lease-expiration alert at half the
    expirations), or, given TOOLLEDGER_METRICS_PORT, tried the worker's port ("address
    already in use") and the ledger's gauges were served nowhere (a cold review). The
    worker's endpoint now serves them; the beat opens none. ``any``: port 0, so that a second
    endpoint would show as a second port (other processes here hold 9808 and 9809)."""
    chosen = str(free_port()) if port == "given" else "0"
    settings_env = {
        "home": str(tmp_path / "home"),
        "sandbox": str(tmp_path / "sandbox"),
        "sweep_interval": "1",
        "metrics_port": chosen,
    }
    worker = worker_process(
        "w", service_env(**settings_env), tmp_path, concurrency=1, extra=("-B",)
    )
    procs = [worker.start()]
    try:
        worker.wait_ready(60)
        settings = Settings.from_env(
            {f"TOOLLEDGER_{k.upper()}": v for k, v in settings_env.items()}
        )
        sub = Submitter(settings)
        sub.submit(
            sub.prepare("b", "c1", "write_file", {"path": "a.txt", "content": "x"}),
            approved_by="alice",
        )
        ledger = Ledger(settings.db)
        wait_for(
            lambda: [c.status for c in ledger.list_calls(limit=0)] == [Status.SUCCEEDED],
            60,
            "the call succeeded",
        )
        at = re.search(r"MainProcess\] metrics at http://[^:]+:(\d+)/metrics", worker.log_text())
        assert at is not None, worker.log_text()
        url = f"http://127.0.0.1:{at.group(1)}/metrics"
        # the beat is up, past the start where it would open an endpoint: a sweep it sent ran
        wait_for(
            lambda: total(scrape(url), "toolledger_sweep_duration_seconds_count") >= 1,
            30,
            "a sweep",
        )
        said = set(re.findall(r"metrics at http://[^:]+:(\d+)/metrics", worker.log_text()))
        assert said == {at.group(1)}, worker.log_text()
        assert "metrics endpoint not started" not in worker.log_text()
        samples = scrape(url)
        assert total(samples, "toolledger_calls_total", status="succeeded") == 1
        assert total(samples, "toolledger_ledger_state_up") == 1, samples
        assert ("toolledger_calls", (("status", "approved"),)) in samples, samples
        assert total(samples, "toolledger_sweep_interval_seconds") == 1
        sub.close()
        ledger.close()
    finally:
        stop_all(procs)
