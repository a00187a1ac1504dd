"""What every benchmark shares: interleaved rounds, statistics, throwaway databases, the job.

Every figure is the median of several rounds with its min and max; rounds interleave the
variants (A B C A B C …) and every ratio is computed pair by pair within a round, then its
median taken, because absolute numbers on shared machines drift.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from toolledger.harness.scratch import scratch_database
from toolledger.ledger.db import create_engine as ledger_engine
from toolledger.ledger.db import normalize_url


@dataclass
class Series:
    """Per-round values of one figure."""

    values: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        self.values.append(value)

    def summary(self, digits: int = 1) -> dict[str, Any]:
        if not self.values:
            return {"median": None, "min": None, "max": None, "rounds": 0}
        return {
            "median": round(statistics.median(self.values), digits),
            "min": round(min(self.values), digits),
            "max": round(max(self.values), digits),
            "rounds": len(self.values),
        }


def ratio(a: Series, b: Series) -> dict[str, Any]:
    """a/b round by round (the rounds were interleaved), then median, min, max."""
    pairs = [x / y for x, y in zip(a.values, b.values, strict=False) if y]
    return Series(pairs).summary(3)


def difference(a: Series, b: Series) -> dict[str, Any]:
    """a-b round by round (the rounds were interleaved), then median, min, max."""
    pairs = [x - y for x, y in zip(a.values, b.values, strict=False)]
    return Series(pairs).summary(3)


@dataclass
class Figures:
    """Named series, filled round by round."""

    series: dict[str, Series] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.series.setdefault(name, Series()).add(value)

    def __getitem__(self, name: str) -> Series:
        return self.series.setdefault(name, Series())

    def summaries(self, digits: int = 1) -> dict[str, Any]:
        return {k: v.summary(digits) for k, v in self.series.items()}


@contextmanager
def scratch_postgres(url: str, label: str, *, migrate: bool = True) -> Iterator[str]:
    """A database of its own on the server of ``url``, dropped afterwards; refused (``Bent``)
    if durability is off in it (a role's setting for some databases reaches it, not the
    database of ``url`` the run checked first)."""
    with scratch_database(url, f"toolledger_bench_{label}", migrate=migrate) as target:
        durability(target)
        yield target


#: "No bending" (issue 18): fsync and synchronous commit stay on, for every side.
DURABLE = {
    "fsync": ("on",),
    # without synchronous replication, "local" and "remote_*" wait for the local flush as "on"
    "synchronous_commit": ("on", "local", "remote_write", "remote_apply"),
}


class Bent(ValueError):
    """A setting that would bend the figures: the bench refuses to measure under it."""


def durability(url: str) -> dict[str, dict[str, str]]:
    """What the server says of ``DURABLE`` to a session as toolledger opens it and to one as
    the baselines and peers open theirs (plain libpq; ``PGOPTIONS`` applies to both, and the
    server's, database's and role's settings); ``Bent`` if either side is off."""
    import psycopg

    engine = ledger_engine(url)
    with engine.connect() as conn:
        ours = {n: str(conn.exec_driver_sql(f"SHOW {n}").scalar_one()) for n in DURABLE}
    engine.dispose()
    with psycopg.connect(plain_url(url), autocommit=True) as plain:
        theirs = {n: str((plain.execute(f"SHOW {n}").fetchone() or ("?",))[0]) for n in DURABLE}
    sides = {"toolledger": ours, "baselines": theirs}
    bent = [
        f"{name}={value} ({side})"
        for side, values in sides.items()
        for name, value in values.items()
        if value not in DURABLE[name]
    ]
    if bent:
        raise Bent(
            f"bench: refused to measure with {', '.join(bent)} (the server's settings, or "
            "PGOPTIONS): fsync and synchronous commit stay on"
        )
    return sides


def plain_url(url: str) -> str:
    """The libpq form of a SQLAlchemy URL (for psycopg and the peers)."""
    return sa.make_url(normalize_url(url)).set(drivername="postgresql").render_as_string(False)


def atomic_write(directory: str, name: str, data: bytes) -> None:
    """The job every variant does: temp file, write, fsync, rename, fsync the directory."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        tmp = f".{name}.{uuid.uuid4().hex[:8]}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dfd)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        os.fsync(dfd)
    finally:
        os.close(dfd)


#: What ``CpuMeter`` splits the machine's busy CPU into. ``producer`` is the bench's own
#: process (it submits and polls for completion); ``other`` is what no part accounts for
#: (the kernel's threads, page-cache writeback, anything else running).
CPU_PARTS = ("producer", "workers", "postgres", "redis", "other")


def _part_times(workers: Sequence[int]) -> dict[str, float]:
    """CPU seconds used so far by each part. A process's reaped children count in its own
    ``children_*`` times, so a Postgres backend or a pool child that exits during the
    measurement still counts, in its parent's (the postmaster's, the worker's)."""
    import psutil

    procs = list(psutil.process_iter(["pid", "ppid", "name"]))
    kids: dict[int, list[int]] = {}
    for p in procs:
        kids.setdefault(p.info["ppid"], []).append(p.info["pid"])
    tree, todo = set(), list(workers)
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo += kids.get(pid, [])
    me, out = os.getpid(), dict.fromkeys(CPU_PARTS[:-1], 0.0)
    for p in procs:
        name, pid = p.info["name"] or "", p.info["pid"]
        if pid == me:
            part = "producer"
        elif pid in tree:
            part = "workers"
        elif name.startswith("postgres"):
            part = "postgres"
        elif name.startswith("redis-server"):
            part = "redis"
        else:
            continue
        try:
            t = p.cpu_times()
        except psutil.Error:  # gone since listed: its time is in its parent's
            continue
        out[part] += t.user + t.system
        if part != "producer":  # the producer's reaped children are other runs' workers
            out[part] += t.children_user + t.children_system
    return out


class CpuMeter:
    """The whole machine's busy CPU (every process: producer, workers, Postgres, Redis)
    between ``start`` and ``stop``: what a call costs across all processes, not only the
    ones a profiler is attached to. The bench runs alone on the machine, as it asks.

    Given the worker processes' pids, it also splits that CPU into ``CPU_PARTS``: where a
    call's CPU goes, measured in every run rather than in a separate profile."""

    def __init__(self, workers: Sequence[int] = ()) -> None:
        self.workers = list(workers)
        self.began = self.busy = 0.0
        self._parts_began: dict[str, float] = {}
        self.parts: dict[str, float] = {}

    @staticmethod
    def _busy() -> float:
        import psutil

        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    def start(self) -> None:
        self._parts_began = _part_times(self.workers)
        self.began = self._busy()

    def stop(self) -> None:
        self.busy = self._busy() - self.began
        ended = _part_times(self.workers)
        self.parts = {k: max(0.0, v - self._parts_began.get(k, 0.0)) for k, v in ended.items()}
        self.parts["other"] = max(0.0, self.busy - sum(self.parts.values()))

    def ms_per(self, n: int) -> float:
        return self.busy * 1000 / max(1, n)

    def parts_ms_per(self, n: int) -> dict[str, float]:
        return {k: v * 1000 / max(1, n) for k, v in self.parts.items()}


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"benchmark: {what} did not happen within {timeout:.0f}s")
        time.sleep(0.02)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]
