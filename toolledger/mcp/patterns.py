"""An upstream's ``pattern`` checked within a deadline, off the GIL.

The proxy checks a call's arguments against the upstream tool's ``inputSchema`` in a thread,
within ``SCHEMA_CHECK_SECONDS``. jsonschema matches ``pattern``, ``patternProperties`` and
the additional-properties rules with Python's ``re``, which holds the GIL while it
backtracks: a schema's ``^(a|aa)+$`` and a model's 60 ``a``s froze the proxy's event loop,
every other call, the leases' renewal and SIGTERM with it, for good (a cold review). Here
those searches go through the ``regex`` module (``re``'s syntax; it lets other threads run
while it matches) under the deadline of the check in progress: past it, ``TimeoutError``,
and the call is refused as one whose arguments could not be checked.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_check = threading.local()


class _TimedRe:
    """What jsonschema's modules see as ``re``: ``re`` itself, but ``search``, bounded by
    this thread's check deadline when it has one."""

    def __getattr__(self, name: str) -> Any:
        return getattr(re, name)

    @staticmethod
    def search(pattern: Any, string: str, flags: int = 0) -> Any:
        deadline: float | None = getattr(_check, "deadline", None)
        if deadline is None or not isinstance(pattern, str):
            return re.search(pattern, string, flags)
        import regex

        pattern = as_re_reads(pattern)
        left = max(0.001, deadline - time.monotonic())
        return regex.search(pattern, string, flags | regex.VERSION0, timeout=left)


#: A quantifier ``re`` reads: ``{m}``, ``{m,}``, ``{m,n}``, ``{,n}``.
_QUANTIFIER = re.compile(r"\{(?:\d+(?:,\d*)?|,\d+)\}")


def as_re_reads(pattern: str) -> str:
    r"""``pattern`` written so that ``regex`` reads it as ``re`` (and JSON Schema's ECMA 262)
    do, where the two differ on text ``re`` takes literally (reviews: answers changed):

    - ``[:`` opens a POSIX class to ``regex`` (``[[:alpha:]]`` took "abc"), a set of "[:alph"
      then "]" to ``re``: written ``[\:``, a colon to all three. (Sent to ``re`` instead, such
      a pattern matched without the deadline, and ``^(a|aa)+[:]?$`` froze the proxy again.)
    - a ``{`` that opens no quantifier is literal to ``re``, where ``regex`` reads
      ``{e<=1}`` as fuzzy matching: written ``\{``.

    An escaped character is copied as it is."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        if pattern[i] == "\\":
            out.append(pattern[i : i + 2])
            i += 2
        elif pattern.startswith("[:", i):
            out.append("[\\:")
            i += 2
        elif pattern[i] == "{" and not _QUANTIFIER.match(pattern, i):
            out.append("\\{")
            i += 1
        else:
            out.append(pattern[i])
            i += 1
    return "".join(out)


_installed = False
_lock = threading.Lock()


def install() -> None:
    """Make jsonschema's keyword modules search through ``_TimedRe`` (once a process)."""
    global _installed
    with _lock:
        if _installed:
            return
        import regex  # noqa: F401 - missing: fail here, at the proxy's start, not mid-check
        from jsonschema import _keywords, _legacy_keywords, _utils

        for module in (_keywords, _legacy_keywords, _utils):
            module.re = _TimedRe()  # type: ignore[attr-defined]
        _installed = True


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """The searches of this thread, meanwhile, end within ``seconds`` (``TimeoutError``)."""
    _check.deadline = time.monotonic() + seconds
    try:
        yield
    finally:
        _check.deadline = None
