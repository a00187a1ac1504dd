"""Structured logs: text or one JSON object per line, each carrying the ids of the call it is
about (the same ids the spans carry: scope, idempotency_key, execution_id, attempt, tool,
tool_call_id, trace_id, span_id).

The ids are bound to the running context (``bind``) by the executor and the sweep; a JSON
line holds them and the message, never a call's arguments or result (no log line at INFO or
above formats them).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

from toolledger.observability import tracing

FORMATS = ("text", "json")
#: The text format's layout (the ids are appended when bound).
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_ids: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "toolledger_log_ids", default=None
)


@contextlib.contextmanager
def bind(**ids: Any) -> Iterator[dict[str, Any]]:
    """Bind ``ids`` to every log line of this block (nested binds add to the outer ones);
    the returned dict may be updated as more is learnt (the claim's execution_id)."""
    merged = {**(_ids.get() or {}), **{k: v for k, v in ids.items() if v is not None}}
    token = _ids.set(merged)
    try:
        yield merged
    finally:
        _ids.reset(token)


def bind_more(**ids: Any) -> None:
    """Add ids (None skipped) to the innermost ``bind`` block; a no-op outside one."""
    current = _ids.get()
    if current is not None:
        current.update({k: v for k, v in ids.items() if v is not None})


def bound() -> dict[str, Any]:
    """The ids bound now (a copy)."""
    return dict(_ids.get() or {})


class IdsFilter(logging.Filter):
    """Puts the bound ids and the current trace/span ids on each record (``record.ids``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ids = dict(_ids.get() or {})
        if (pair := tracing.current_ids()) is not None:
            ids["trace_id"], ids["span_id"] = pair
        record.ids = ids
        return True


#: The line breaks JSON leaves as they are (it escapes C0 only): escaped, so that a reader
#: splitting on every Unicode line break (Python's ``str.splitlines``) reads one line a
#: record (a tool's error text holding U+2028 was read as 11 lines: a cold review).
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the ids, the exception."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        line.update(getattr(record, "ids", None) or {})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str).translate(_LINE_BREAKS)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        ids = getattr(record, "ids", None)
        if ids:
            text += " [" + " ".join(f"{k}={v}" for k, v in ids.items()) + "]"
        return text


def log_format(value: str | None = None) -> str:
    """The format asked for: ``value`` (an option), else TOOLLEDGER_LOG_FORMAT, else text."""
    fmt = (value or os.environ.get("TOOLLEDGER_LOG_FORMAT") or "text").strip().lower()
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(FORMATS)}")
    return fmt


def handler(fmt: str, stream: Any = None) -> logging.Handler:
    """A stream handler writing ``fmt`` lines with the ids."""
    out = logging.StreamHandler(stream)
    out.setFormatter(JsonFormatter() if log_format(fmt) == "json" else TextFormatter(TEXT_FORMAT))
    out.addFilter(IdsFilter())
    return out


def configure_logging(fmt: str | None = None, level: int | str = logging.INFO) -> None:
    """Route the root logger to stderr in ``fmt`` (text|json; None: TOOLLEDGER_LOG_FORMAT,
    else text) at ``level``, replacing its handlers."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler(log_format(fmt)))
    root.setLevel(level)
    # the schema check's migration context says at INFO which dialect it found, nine lines a
    # start, and before a schema error's one line (a cold review): its warnings are enough
    logging.getLogger("alembic").setLevel(max(logging.WARNING, root.level))


def restyle(fmt: str, logger: logging.Logger | None = None) -> None:
    """Give every handler ``logger`` (default: the root) has now the ``fmt`` formatter and
    the ids: for the worker and the beat, whose logging Celery sets up."""
    for h in (logger or logging.getLogger()).handlers:
        h.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(TEXT_FORMAT))
        if not any(isinstance(f, IdsFilter) for f in h.filters):
            h.addFilter(IdsFilter())


def error_line(exc: BaseException) -> str:
    """An error in the driver's words, its first line: a SQLAlchemy error (the embedded
    broker's) quoted its statement, the message's base64 body and a link, 1.3 kB in a failed
    publish's warning (a cold review)."""
    orig = getattr(exc, "orig", None)
    text = str(orig if isinstance(orig, BaseException) else exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
