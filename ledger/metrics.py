"""The process's Prometheus metrics: their definitions, and hooks as cheap as a global check.

Nothing here imports ``prometheus_client`` (≈150 ms) until a process turns metrics on with
``enable()``: workers, the beat and ``toolledger serve`` do (``toolledger.observability``),
the CLI's one-shot commands never do, and every hook is then a test of one global.
Transitions are counted where they commit (the ledger's facade, the executor, the sweep),
right after the commit returns: a process killed between the two loses that one count.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec

_P = ParamSpec("_P")

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Gauge

#: Buckets (seconds) of the duration histograms: a tool call, a queue wait, a sweep pass.
#: Up to a day, a lease's bound (a tool runs up to 5/6 of it): they ended at 300 s, and every
#: quantile of a longer run or wait read 300 (a cold review). An observation increments one
#: bucket: more of them cost a scrape a few samples, not the executor.
BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300,
    600, 1800, 3600, 7200, 21600, 86400,
)  # fmt: skip


class Metrics:
    """Every metric this process counts (one instance, built by ``enable``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        from prometheus_client import Counter, Histogram

        self.registry = r = registry
        self.calls_total = Counter(
            "toolledger_calls_total",
            "Status transitions of calls, counted where they commit.",
            ["tool", "status"],
            registry=r,
        )
        self.execution_duration = Histogram(
            "toolledger_execution_duration_seconds",
            "Claim to terminal write of one execution.",
            ["tool"],
            buckets=BUCKETS,
            registry=r,
        )
        self.schedule_to_start = Histogram(
            "toolledger_schedule_to_start_seconds",
            "Publish of the job to its claim (wall clocks of two hosts).",
            ["tool"],
            buckets=BUCKETS,
            registry=r,
        )
        self.claims_lost = Counter(
            "toolledger_claims_lost_total",
            "Deliveries that did not win the claim (redelivered, not authorised): nothing ran.",
            registry=r,
        )
        self.calls_left = Counter(
            "toolledger_calls_left_total",
            "Deliveries left unclaimed by a worker that does not load the call's tool.",
            registry=r,
        )
        self.lease_expired = Counter(
            "toolledger_lease_expired_total",
            "Running executions the sweep declared unknown because their lease expired.",
            registry=r,
        )
        self.reconciled = Counter(
            "toolledger_reconciled_total",
            "Unknown executions settled by evidence, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.stale_results = Counter(
            "toolledger_stale_results_total",
            "Terminal writes refused by the fence (revoked first): kept as evidence.",
            registry=r,
        )
        self.sweep_duration = Histogram(
            "toolledger_sweep_duration_seconds",
            "Duration of one sweep pass.",
            buckets=BUCKETS,
            registry=r,
        )
        self._sweep_last_success: Gauge | None = None
        self._sweep_unlanded: Gauge | None = None
        self._lock = threading.Lock()

    def sweep_succeeded(self, at: float) -> None:
        """``toolledger_sweep_last_success_timestamp_seconds``, made at this process's first
        pass without errors: a process that never swept (the beat, ``serve``, a worker off the
        sweep queue) exports no such time rather than 0 (1970), so the series is absent until
        some pass succeeded (the stalled-sweep alert's ``absent()``)."""
        with self._lock:
            if self._sweep_last_success is None:
                from prometheus_client import Gauge

                self._sweep_last_success = Gauge(
                    "toolledger_sweep_last_success_timestamp_seconds",
                    "Unix time of the end of the last sweep pass without errors.",
                    multiprocess_mode="max",
                    registry=self.registry,
                )
            self._sweep_last_success.set(at)

    def sweep_unlanded(self, paths: int) -> None:
        """``toolledger_sweep_unlanded_paths``: the paths whose committed bytes the last pass
        without errors could not land (``SweepSummary.busy``: another lander holds their lock,
        frozen or slow). Said only in the pass's log line before, at INFO: reads of the path
        failed ``not_settled`` for as long as the lander stayed frozen, and no metric or alert
        said so (a cold review). The most recent pass's value (``mostrecent``: of the
        prefork children, the last to sweep), absent until a pass succeeded."""
        with self._lock:
            if self._sweep_unlanded is None:
                from prometheus_client import Gauge

                self._sweep_unlanded = Gauge(
                    "toolledger_sweep_unlanded_paths",
                    "Paths whose committed bytes the last sweep pass without errors could not "
                    "land: another lander holds their lock (frozen or slow).",
                    multiprocess_mode="mostrecent",
                    registry=self.registry,
                )
            self._sweep_unlanded.set(paths)


_metrics: Metrics | None = None


def enable(registry: CollectorRegistry | None = None) -> Metrics:
    """Build this process's metrics (once). ``registry``: where they register (default: a
    private one, so an application's default registry is left alone)."""
    global _metrics
    if _metrics is None:
        from prometheus_client import CollectorRegistry

        _metrics = Metrics(registry or CollectorRegistry(auto_describe=True))
    return _metrics


def disable() -> None:
    """Stop counting in this process (tests; the bench's off switch)."""
    global _metrics
    _metrics = None


def _never_raises(hook: Callable[_P, None]) -> Callable[_P, None]:
    """A hook runs inside the execute protocol (between a terminal commit and its landing):
    a failure to count (a full disk under the multiprocess files) must never change what
    the protocol does. It is logged once per hook, and the count is lost."""
    failed = False

    @functools.wraps(hook)
    def guarded(*args: _P.args, **kwargs: _P.kwargs) -> None:
        nonlocal failed
        try:
            hook(*args, **kwargs)
        except Exception:  # any: see above
            if not failed:
                failed = True
                logging.getLogger("toolledger.metrics").exception("metric %s lost", hook.__name__)

    return guarded


def active() -> Metrics | None:
    """The metrics if this process counts, else None."""
    return _metrics


@_never_raises
def transition(tool: str, status: str, n: int = 1) -> None:
    """``n`` calls of ``tool`` moved to ``status`` (committed)."""
    if _metrics is not None and n:
        _metrics.calls_total.labels(tool, status).inc(n)


@_never_raises
def claim_lost() -> None:
    if _metrics is not None:
        _metrics.claims_lost.inc()


@_never_raises
def call_left() -> None:
    if _metrics is not None:
        _metrics.calls_left.inc()


@_never_raises
def stale_result() -> None:
    if _metrics is not None:
        _metrics.stale_results.inc()


@_never_raises
def lease_expired(n: int) -> None:
    if _metrics is not None and n:
        _metrics.lease_expired.inc(n)


@_never_raises
def reconciled(outcome: str) -> None:
    if _metrics is not None:
        _metrics.reconciled.labels(outcome).inc()


@_never_raises
def execution_finished(tool: str, seconds: float) -> None:
    if _metrics is not None:
        _metrics.execution_duration.labels(tool).observe(max(0.0, seconds))


@_never_raises
def scheduled_started(tool: str, published_at: Any) -> None:
    """The wait from the publish (a Unix time carried in the message) to the claim."""
    if _metrics is not None and isinstance(published_at, int | float) and published_at > 0:
        _metrics.schedule_to_start.labels(tool).observe(max(0.0, time.time() - published_at))


@_never_raises
def sweep_finished(seconds: float, ok: bool, unlanded: int = 0) -> None:
    """A pass ended; ``unlanded``: the paths whose committed bytes it could not land (kept
    from the last pass without errors: a failed pass may not have looked)."""
    if _metrics is not None:
        _metrics.sweep_duration.observe(seconds)
        if ok:
            _metrics.sweep_succeeded(time.time())
            _metrics.sweep_unlanded(unlanded)
