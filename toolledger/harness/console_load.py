"""Load on the console: N concurrent clients reading the inbox and call pages of a ledger of
100,000 calls, against a real ``toolledger serve`` process on loopback.

    python -m toolledger.harness.console_load --db postgresql+psycopg://…/db [--calls 100000]
        [--clients 50] [--duration 30] [--think 0]

The ledger is filled in bulk (rows as the protocol leaves them: operations, tool calls,
executions and four events per call; 1 % pending approval, 0.5 % unknown, 0.2 % flagged);
each client logs in once and then loops: the inbox one time in four, else a random call's
page. Reported: requests, errors (any status but 200, any transport error), throughput and
latency percentiles, measured by the clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import sqlalchemy as sa

from toolledger.harness.processes import service_env, toolledger_argv
from toolledger.ledger.db import create_engine as make_engine
from toolledger.ledger.db import upgrade
from toolledger.ledger.identity import args_sha256
from toolledger.ledger.models import execution_events, executions, operations, tool_calls

BATCH = 2000


@dataclass
class LoadReport:
    calls: int
    clients: int
    duration_s: float
    think_s: float
    requests: int
    errors: int
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    inbox_p99_ms: float
    call_p99_ms: float
    backend: str
    workers: int = 1

    def line(self) -> str:
        return (
            f"{self.clients} clients x {self.duration_s:.0f} s on {self.calls:,} calls "
            f"({self.backend}, {self.workers} server process(es), think {self.think_s} s): "
            f"{self.requests:,} requests, {self.errors} errors, "
            f"{self.rps:.0f}/s; p50 {self.p50_ms:.1f} ms, p90 {self.p90_ms:.1f}, "
            f"p99 {self.p99_ms:.1f} (inbox {self.inbox_p99_ms:.1f}, call {self.call_p99_ms:.1f}),"
            f" max {self.max_ms:.1f}"
        )


def populate(db_url: str, calls: int, scopes: int = 50, seed: int = 7) -> list[tuple[str, str]]:
    """Bulk-fill the ledger; returns a sample of (scope, tool_call_id) to read."""
    rnd = random.Random(seed)
    engine = make_engine(db_url)
    upgrade(engine)
    start = datetime.now(UTC) - timedelta(days=30)
    sample: list[tuple[str, str]] = []
    done = 0
    while done < calls:
        ops, tcs, exs, evs = [], [], [], []
        for i in range(done, min(calls, done + BATCH)):
            scope = f"tenant-{i % scopes:03d}"
            call_id = f"call_{i:07d}"
            tool = "write_file" if i % 3 else "append_file"
            args = {"path": f"docs/{i % 997}.txt", "content": f"line {i}\n"}
            key = f"{tool}:{call_id}"
            at = start + timedelta(seconds=i * 25)
            r = rnd.random()
            status, review = "succeeded", None
            if r < 0.01:
                status = "pending_approval"
            elif r < 0.015:
                status = "unknown"
            elif r < 0.017:
                review = "contradicted"
            attempts = 0 if status == "pending_approval" else 1
            ops.append(
                {
                    "scope": scope,
                    "idempotency_key": key,
                    "tool": tool,
                    "args": args,
                    "args_sha256": args_sha256(args),
                    "status": status,
                    "authorized_attempts": attempts,
                    "decided_by": None if attempts == 0 else "loadgen",
                    "decided_at": None,
                    "reason": None,
                    "created_at": at,
                    "enqueued_at": at,
                    "review": review,
                }
            )
            tcs.append(
                {
                    "scope": scope,
                    "tool_call_id": call_id,
                    "idempotency_key": key,
                    "args_sha256": args_sha256(args),
                    "created_at": at,
                }
            )
            ev = {"scope": scope, "idempotency_key": key, "actor": "agent", "at": at}
            evs.append(
                {
                    **ev,
                    "execution_id": None,
                    "kind": "submitted",
                    "detail": {"tool_call_id": call_id, "tool": tool, "args": args},
                }
            )
            if attempts:
                eid = str(uuid.UUID(int=rnd.getrandbits(128)))
                result = {"path": args["path"], "bytes_written": len(args["content"])}
                terminal = status == "succeeded"
                exs.append(
                    {
                        "execution_id": eid,
                        "scope": scope,
                        "idempotency_key": key,
                        "attempt": 1,
                        "status": "succeeded" if terminal else "unknown",
                        "worker_id": "w1",
                        "lease_token": None,
                        "lease_expires_at": None,
                        "heartbeat_at": None,
                        "started_at": at,
                        "finished_at": at,
                        "result": result if terminal else None,
                        "reconciled": False,
                        "error": None,
                        "fenced": True,
                        "effects": None,
                    }
                )
                evs.append(
                    {
                        **ev,
                        "execution_id": None,
                        "kind": "approved",
                        "actor": "loadgen",
                        "detail": {"attempt": 1},
                    }
                )
                evs.append(
                    {
                        **ev,
                        "execution_id": eid,
                        "kind": "running",
                        "actor": "w1",
                        "detail": {"attempt": 1},
                    }
                )
                evs.append(
                    {
                        **ev,
                        "execution_id": eid,
                        "actor": "w1",
                        "kind": "succeeded" if terminal else "unknown",
                        "detail": {"result": result} if terminal else {"reason": "lease"},
                    }
                )
            if rnd.random() < 0.01 or status != "succeeded":
                sample.append((scope, call_id))
        with engine.begin() as conn:
            conn.execute(operations.insert(), ops)
            conn.execute(tool_calls.insert(), tcs)
            if exs:
                conn.execute(executions.insert(), exs)
            conn.execute(execution_events.insert(), evs)
        done += len(ops)
        print(f"\r  filled {done:,}/{calls:,} calls", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("ANALYZE"))
    engine.dispose()
    return sample


def existing(db_url: str, n: int = 2000) -> list[tuple[str, str]]:
    """A sample of the calls already in the ledger (``--no-fill``), its inbox included."""
    engine = make_engine(db_url)
    upgrade(engine)
    with engine.connect() as conn:
        waiting = conn.execute(
            sa.select(tool_calls.c.scope, tool_calls.c.tool_call_id)
            .join(
                operations,
                sa.and_(
                    operations.c.scope == tool_calls.c.scope,
                    operations.c.idempotency_key == tool_calls.c.idempotency_key,
                ),
            )
            .where(operations.c.status != "succeeded")
            .limit(n // 2)
        ).all()
        some = conn.execute(
            sa.select(tool_calls.c.scope, tool_calls.c.tool_call_id)
            .order_by(sa.func.random())
            .limit(n // 2)
        ).all()
    engine.dispose()
    return [(r[0], r[1]) for r in [*waiting, *some]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    db_url: str,
    home: Path,
    token: str,
    workers: int = 1,
    role: str = "viewer",
    options: tuple[str, ...] = (),
) -> tuple[subprocess.Popen[bytes], str]:
    """A real ``toolledger serve`` on a free port with one token of ``role`` (and ``serve``'s
    ``options``), once it answers; its log is ``home/serve.log``."""
    import httpx

    port = free_port()
    home.mkdir(parents=True, exist_ok=True)
    env = service_env(
        db=db_url,
        home=str(home),
        sandbox=str(home / "sandbox"),
        broker=f"embedded+sqlite:///{home / 'broker.db'}",
        api_tokens=f"load:{role}:{token}",
    )
    log = (home / "serve.log").open("wb")
    proc = subprocess.Popen(
        [*toolledger_argv(), "serve", "--port", str(port), "--workers", str(workers), *options],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited: {(home / 'serve.log').read_text()[-2000:]}")
        try:
            if httpx.get(base + "/login", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("serve did not answer within 60 s")


async def _session(base: str, token: str) -> dict[str, str]:
    import httpx

    async with httpx.AsyncClient(base_url=base) as client:
        page = await client.get("/login")
        nonce = re.search(r'name="nonce" value="([^"]+)"', page.text)
        assert nonce is not None
        r = await client.post("/login", data={"nonce": nonce.group(1), "token": token})
        if "toolledger_session" not in client.cookies:
            raise RuntimeError(f"login failed: {r.status_code}")
        return {"toolledger_session": client.cookies["toolledger_session"]}


class Connection:
    """One client's keep-alive HTTP/1.1 connection, as lean as a load generator must be
    (httpx cost the generator as much CPU as the server it measured). A GET on a reused
    connection the server closed meanwhile is sent again once, as browsers do."""

    def __init__(self, host: str, port: int, cookie: str) -> None:
        self.host, self.port, self.cookie = host, port, cookie
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, path: str) -> int:
        for attempt in (1, 2):
            fresh = self.writer is None
            if fresh:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            assert self.reader is not None and self.writer is not None
            request = f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\nCookie: {self.cookie}\r\n\r\n"
            self.writer.write(request.encode())
            try:
                await self.writer.drain()
                head = await self.reader.readuntil(b"\r\n\r\n")
            except (ConnectionError, asyncio.IncompleteReadError):
                self.close()
                if fresh or attempt == 2:
                    raise
                continue  # the server closed an idle keep-alive connection: once more
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            fields = dict(
                (k.strip().lower(), v.strip()) for k, _, v in (x.partition(":") for x in lines[1:])
            )
            await self.reader.readexactly(int(fields.get("content-length", "0")))
            if fields.get("connection", "").lower() == "close":
                self.close()
            return status
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def _load(
    base: str,
    token: str,
    sample: list[tuple[str, str]],
    clients: int,
    duration: float,
    think: float,
) -> tuple[list[tuple[str, float]], int]:
    from urllib.parse import urlsplit

    cookies = await _session(base, token)
    cookie = "; ".join(f"{k}={v}" for k, v in cookies.items())
    where = urlsplit(base)
    latencies: list[tuple[str, float]] = []
    errors = 0
    failures: list[str] = []
    stop = time.monotonic() + duration

    async def client(n: int) -> None:
        nonlocal errors
        rnd = random.Random(n)
        conn = Connection(where.hostname or "127.0.0.1", where.port or 80, cookie)
        if think:  # people do not all click at the same instant
            await asyncio.sleep(rnd.uniform(0, think))
        while time.monotonic() < stop:
            if rnd.random() < 0.25:
                kind, url = "inbox", "/"
            else:
                scope, call_id = rnd.choice(sample)
                kind, url = "call", f"/calls/{scope}/{call_id}"
            t0 = time.perf_counter()
            try:
                status = await asyncio.wait_for(conn.get(url), 30)
                ok, why = status == 200, f"{status} on {url}"
            except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as exc:
                conn.close()
                ok, why = False, f"{type(exc).__name__} on {url}"
            if not ok and len(failures) < 5:
                failures.append(why)
            latencies.append((kind, time.perf_counter() - t0))
            errors += not ok
            if think:
                await asyncio.sleep(rnd.uniform(0.5, 1.5) * think)
        conn.close()

    await asyncio.gather(*(client(n) for n in range(clients)))
    for why in failures:
        print(f"  failed: {why}", file=sys.stderr)
    return latencies, errors


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 10) - 1] * 1000


def run(
    db_url: str,
    home: Path,
    *,
    calls: int = 100_000,
    clients: int = 50,
    duration: float = 30,
    think: float = 0.0,
    fill: bool = True,
    workers: int = 1,
) -> LoadReport:
    sample = populate(db_url, calls) if fill else existing(db_url)
    if not sample:
        raise RuntimeError("nothing to read: fill the ledger first")
    token = secrets.token_urlsafe(24)
    proc, base = start_server(db_url, home, token, workers)
    try:
        print(f"  {clients} clients reading {base} for {duration:.0f} s", file=sys.stderr)
        t0 = time.monotonic()
        latencies, errors = asyncio.run(_load(base, token, sample, clients, duration, think))
        elapsed = time.monotonic() - t0
    finally:
        proc.terminate()
        proc.wait(10)
    every = [s for _, s in latencies]
    return LoadReport(
        calls=calls,
        clients=clients,
        duration_s=duration,
        think_s=think,
        requests=len(every),
        errors=errors,
        rps=len(every) / elapsed,
        p50_ms=_pct(every, 50),
        p90_ms=_pct(every, 90),
        p99_ms=_pct(every, 99),
        max_ms=max(every) * 1000,
        inbox_p99_ms=_pct([s for k, s in latencies if k == "inbox"], 99),
        call_p99_ms=_pct([s for k, s in latencies if k == "call"], 99),
        backend=make_engine(db_url).dialect.name,
        workers=workers,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--db", required=True, help="An empty ledger database (it is filled).")
    p.add_argument("--calls", type=int, default=100_000)
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--duration", type=float, default=30)
    p.add_argument("--think", type=float, default=0.0, help="Mean seconds between requests.")
    p.add_argument("--home", default=str(Path(tempfile.gettempdir()) / "toolledger-load"))
    p.add_argument("--workers", type=int, default=1, help="serve --workers")
    p.add_argument("--no-fill", action="store_true", help="Read the calls already there.")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    report = run(
        a.db,
        Path(a.home),
        calls=a.calls,
        clients=a.clients,
        duration=a.duration,
        think=a.think,
        fill=not a.no_fill,
        workers=a.workers,
    )
    print(json.dumps(asdict(report), indent=2) if a.json else report.line())
    return 0 if report.errors == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
