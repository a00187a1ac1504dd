"""OpenTelemetry spans, optional: no-ops unless OpenTelemetry is installed and in use.

"In use" means a process imported ``opentelemetry.trace`` — an application that set its own
tracer provider, or ``configure()`` here, which sets up the SDK from the standard ``OTEL_*``
variables when one of ``OTEL_TRACES_EXPORTER`` / ``OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT`` is
set (nothing of toolledger's own). Until then nothing is imported and every helper returns
at once, so the CLI's cold start and a worker without tracing pay nothing.

The trace context of the submitting process travels in the Celery message's headers (W3C
``traceparent``), so a worker's ``execute_tool`` span is a child of the submit span.

A call's own trace context (its submit span's, ``carrier``) is kept in the ledger with the
call (the detail of its ``submitted`` event). Every later span about the call made elsewhere
(the sweep's re-publish and reconciliation, a person's retry, resolution or review, and the
execution they publish) links to it (``links_to``), its parent staying the span it runs
under: an operator following a call in a trace UI finds what recovery did to it. A message
published about a call (``for_call``) carries that context in ``CALL_TRACEPARENT``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

log = logging.getLogger("toolledger.tracing")

_ENDPOINTS = (
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
)
_configured_pid: int | None = None
#: Seconds a one-shot command's spans may take to reach the collector, all retries included,
#: unless OTEL_EXPORTER_OTLP[_TRACES]_TIMEOUT says otherwise (``for_one_shot``).
ONE_SHOT_EXPORT_SECONDS = 2.0
_TIMEOUTS = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
_OTLP_LOGGER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
_one_shot = False


def for_one_shot() -> None:
    """This process runs one command and exits (``toolledger submit``, ``show``…): its spans
    are exported at its exit within ``ONE_SHOT_EXPORT_SECONDS``, and a collector that cannot
    take them is one warning line. With the exporter's own bound (10 s) and retries, a
    collector down held every command 10 s after its work was done, then wrote four lines
    to stderr, the last "toolledger: error: Failed to export spans batch" under a command
    that had succeeded (exit 0: a cold review)."""
    global _one_shot
    _one_shot = True


def _trace() -> Any:
    """The ``opentelemetry.trace`` module if this process uses OpenTelemetry, else None."""
    return sys.modules.get("opentelemetry.trace")


def active() -> bool:
    return _trace() is not None


def configure(env: Mapping[str, str] | None = None) -> bool:
    """Set up the SDK's tracer provider from the OTEL_* variables, once per process (again
    in a forked child: the exporter's thread does not survive a fork). False if not asked
    for, not installed, or an application already set a provider."""
    global _configured_pid
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    wanted = any(env.get(name) for name in _ENDPOINTS)
    if not wanted or env.get("OTEL_TRACES_EXPORTER", "").lower() == "none":
        return False
    if _configured_pid == os.getpid():
        return True
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("OTEL_* is set but opentelemetry-sdk is not installed: no traces")
        return False
    current = trace.get_tracer_provider()
    if _configured_pid is None and not isinstance(current, trace.ProxyTracerProvider):
        return False  # the application's own provider wins
    exporter = _exporter(
        env.get("OTEL_TRACES_EXPORTER", "otlp").split(",")[0].strip(), _export_timeout(env)
    )
    if exporter is None:
        return False
    provider = TracerProvider(resource=Resource.create({}))  # OTEL_SERVICE_NAME, _RESOURCE_…
    provider.add_span_processor(BatchSpanProcessor(exporter))
    if _configured_pid is None:
        trace.set_tracer_provider(provider)
    else:  # a forked child: replace the parent's (its exporter thread is gone)
        trace._TRACER_PROVIDER = provider
    _configured_pid = os.getpid()
    return True


#: How long a pool child that exits waits for its spans to be exported (milliseconds).
FLUSH_MILLIS = 5000


def flush(timeout_millis: int = FLUSH_MILLIS) -> None:
    """Export the spans this process's provider still holds, waiting ``timeout_millis`` at
    most (whatever the exporter does): for a prefork pool child that exits
    (``--max-tasks-per-child``, a warm shutdown). It leaves through ``os._exit``, so the
    SDK's own exit hook never ran, and the spans its batch processor held (up to 5 s of them)
    were lost: none of a recycled child's ``execute_tool`` spans reached the collector (a
    cold review)."""
    trace = _trace()
    if trace is None:
        return
    provider = trace.get_tracer_provider()
    force_flush = getattr(provider, "force_flush", None)
    if force_flush is None:  # the API's no-op or proxy provider: nothing held
        return
    # in a thread of its own, given up at the timeout: the SDK's batch processor ignores the
    # timeout it is given (opentelemetry-sdk 1.45) and exports every batch it holds, each up
    # to the exporter's own timeout: behind a collector that accepts and never answers, each
    # recycled child took 10 s to exit, a pool slot held (a cold review). Given up, the
    # daemon thread dies with the child.
    failed: list[BaseException] = []

    def run() -> None:
        try:
            force_flush(timeout_millis)
        except Exception as exc:  # noqa: BLE001 - a child's exit must not fail on its spans
            failed.append(exc)

    flushing = threading.Thread(target=run, name="toolledger-span-flush", daemon=True)
    flushing.start()
    flushing.join(timeout_millis / 1000)
    if flushing.is_alive():
        log.warning("spans not exported at exit: the exporter took over %d ms", timeout_millis)
    elif failed:
        log.warning("spans not exported at exit: %s", failed[0])


def _export_timeout(env: Mapping[str, str]) -> float | None:
    """The OTLP exporter's bound for this process: a one-shot command's, unless the
    variables set one (None: the exporter's own, from the variables or its 10 s)."""
    return ONE_SHOT_EXPORT_SECONDS if _one_shot and not any(map(env.get, _TIMEOUTS)) else None


def _exporter(name: str, timeout: float | None = None) -> Any:
    """The span exporter ``name`` (``console`` or OTLP over HTTP). ``timeout``: the OTLP
    exporter's bound on an export, retries included, and its retries said as one warning."""
    try:
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            # stderr, one JSON line a span: the SDK's default, stdout pretty-printed, mixed
            # spans into a command's --json output and into `mcp serve`'s JSON-RPC stream
            return ConsoleSpanExporter(out=sys.stderr, formatter=_span_line)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        if timeout is None:
            return OTLPSpanExporter()
        logging.getLogger(_OTLP_LOGGER).addFilter(_one_warning)
        return OTLPSpanExporter(timeout=timeout)
    except ImportError:
        log.warning("the %s span exporter is not installed (extra 'otel'): no traces", name)
        return None


def _one_warning(record: logging.LogRecord) -> bool:
    """The OTLP exporter's records for a one-shot command: its retries unsaid, its failure
    one warning (the command's own outcome is its exit code: an "error" line under exit 0
    read as the command's failure)."""
    if record.levelno < logging.ERROR:
        return False
    record.msg, record.args = f"spans not exported: {record.getMessage()}", None
    record.levelno, record.levelname = logging.WARNING, "WARNING"
    return True


def _span_line(finished: Any) -> str:
    """A finished span as one line of JSON (the SDK's ``to_json`` indents it over ~40)."""
    return str(finished.to_json(indent=None)) + "\n"


@contextlib.contextmanager
def span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    *,
    parent: Any = None,
    links: Sequence[Any] = (),
) -> Iterator[Any]:
    """A span, current while the block runs; None when tracing is not in use. An
    exception leaving the block is recorded on it. ``links``: ``links_to``'s."""
    trace = _trace()
    if trace is None:
        yield None
        return
    attrs = {k: v for k, v in (attributes or {}).items() if v is not None}
    tracer = trace.get_tracer("toolledger")
    with tracer.start_as_current_span(
        name, context=parent, attributes=attrs, links=list(links) or None
    ) as current:
        yield current


#: The W3C headers of a call's trace context as the ledger keeps it (``carrier``).
_W3C = ("traceparent", "tracestate")
#: The message header that carries the call's own ``traceparent`` (``for_call``), where
#: ``traceparent`` is the publisher's (the sweep's span, a person's retry).
CALL_TRACEPARENT = "toolledger_call_traceparent"
_call: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "toolledger_call_trace", default=None
)


def carrier() -> dict[str, str] | None:
    """The current span's W3C trace context (``traceparent``, and ``tracestate`` if any), to
    be kept with the call; None without tracing or a span. Nothing else of the context (no
    baggage: it is the application's, and may be personal) is kept."""
    trace = _trace()
    if trace is None or not trace.get_current_span().get_span_context().is_valid:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    headers: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(headers)
    kept = {k: v for k in _W3C if isinstance(v := headers.get(k), str)}
    return kept or None


def links_to(kept: Mapping[str, Any] | None) -> list[Any]:
    """A link to the span whose context ``kept`` is (``carrier``'s, as the ledger kept it),
    or none: not in use, nothing kept, or not a valid W3C context (a detail the ledger holds
    is read, never trusted)."""
    if _trace() is None or not isinstance(kept, Mapping):
        return []
    parent = kept.get("traceparent")
    if not isinstance(parent, str) or len(parent) > 64:
        return []
    from opentelemetry.trace import Link, get_current_span
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    headers = {"traceparent": parent}
    if isinstance(state := kept.get("tracestate"), str) and len(state) <= 512:
        headers["tracestate"] = state
    context = get_current_span(TraceContextTextMapPropagator().extract(headers))
    linked = context.get_span_context()
    return [Link(linked)] if linked.is_valid else []


@contextlib.contextmanager
def for_call(kept: Mapping[str, Any] | None) -> Iterator[None]:
    """While the block runs, a message published (``inject``) is about the call whose trace
    context ``kept`` is: it carries it in ``CALL_TRACEPARENT``, and its execution's span links
    to it (``call_links``)."""
    token = _call.set(kept if isinstance(kept, Mapping) else None)
    try:
        yield
    finally:
        _call.reset(token)


def call_links(headers: Mapping[str, Any]) -> list[Any]:
    """The link to the call's own span a message carries (``for_call``), or none."""
    if _trace() is None:
        return []
    return links_to({"traceparent": headers.get(CALL_TRACEPARENT)})


def annotate(current: Any, attributes: Mapping[str, Any], name: str | None = None) -> None:
    """Set attributes (None values skipped) and optionally rename; a no-op without a span."""
    if current is None:
        return
    current.set_attributes({k: v for k, v in attributes.items() if v is not None})
    if name is not None:
        current.update_name(name)


def failed(current: Any, description: str) -> None:
    """Mark the span's operation as failed (status ERROR): a trace UI showed a tool that
    failed, an unknown outcome or a result refused by the fence as fine (a cold review)."""
    if current is None:
        return
    from opentelemetry.trace import Status as SpanStatus
    from opentelemetry.trace import StatusCode

    current.set_status(SpanStatus(StatusCode.ERROR, description))


def inject(headers: MutableMapping[str, Any]) -> None:
    """Write the current trace context into a message's headers (nothing if not in use), and
    the call's own (``for_call``) if one is set."""
    if _trace() is None:
        return
    from opentelemetry.propagate import inject as _inject

    _inject(headers)
    kept = _call.get()
    if kept is not None and isinstance(parent := kept.get("traceparent"), str):
        headers[CALL_TRACEPARENT] = parent


def extract(headers: Mapping[str, Any]) -> Any:
    """The trace context a message carries, or None."""
    if _trace() is None or not headers.get("traceparent"):
        return None
    from opentelemetry.propagate import extract as _extract

    return _extract(dict(headers))


def current_ids() -> tuple[str, str] | None:
    """(trace_id, span_id) of the current span as hex, for log lines; None if none."""
    trace = _trace()
    if trace is None:
        return None
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
