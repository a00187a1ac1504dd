"""An upstream's ``inputSchema`` applied within a deadline: its ``pattern``s off the GIL, and
the validation's own steps.

The proxy checks a call's arguments against the upstream tool's ``inputSchema`` in a thread,
within ``SCHEMA_CHECK_SECONDS``. jsonschema matches ``pattern``, ``patternProperties`` and
the additional-properties rules with Python's ``re``, which holds the GIL while it
backtracks: a schema's ``^(a|aa)+$`` and a model's 60 ``a``s froze the proxy's event loop,
every other call, the leases' renewal and SIGTERM with it, for good (a cold review). Here
those searches go through the ``regex`` module (``re``'s syntax; it lets other threads run
while it matches) under the deadline of the check in progress: past it, ``TimeoutError``,
and the call is refused as one whose arguments could not be checked.

A thread cannot be stopped from outside, and the refusal alone left a recursive schema's
check (``anyOf`` over a ``$ref`` cycle: exponential in the argument's depth) burning a core
for hours after it, the proxy unable to exit until it ended (a cold review). So the check
stops itself: every keyword the proxy's validators apply (``stepping_keyword``, in
``proxy``'s ``_validator``) and every step of jsonschema's walk for ``unevaluated*``
(``install``) first looks at the deadline, which the proxy also cuts short
(``Deadline.cut``) the moment it stops waiting, at its bound or at SIGTERM.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any, TypeVar, cast

_check = threading.local()
F = TypeVar("F", bound=Callable[..., Any])


class Deadline:
    """When the check in progress must end (``time.monotonic()``), shared by the thread that
    runs it and the loop that waits for it: the loop cuts it short when it stops waiting, so
    that an abandoned check ends at its next step instead of at the bound."""

    __slots__ = ("at",)

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def cut(self) -> None:
        self.at = float("-inf")


_monotonic = time.monotonic  # a global, not an attribute looked up at every step


def overdue() -> None:
    """``TimeoutError`` if this thread's check is past its deadline. Outside a check,
    nothing."""
    limit: Deadline | None = getattr(_check, "deadline", None)
    if limit is not None and _monotonic() > limit.at:
        raise TimeoutError("the check's deadline has passed")


def stepping(fn: F) -> F:
    """``fn``, first looking at the check's deadline (``overdue``)."""

    @wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        overdue()
        return fn(*args, **kwargs)

    return cast("F", step)


Keyword = Callable[[Any, Any, Any, Any], Any]


def stepping_keyword(fn: Keyword) -> Keyword:
    """A jsonschema keyword's function, first looking at the check's deadline: ``overdue``
    inlined and jsonschema's four arguments passed as they are, since it runs at every
    keyword applied: about 0.2 µs each here (a thread-local read, a clock read, a call),
    some 10 % of what jsonschema spends on a keyword."""

    def step(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        limit: Deadline | None = getattr(_check, "deadline", None)
        if limit is not None and _monotonic() > limit.at:
            raise TimeoutError("the check's deadline has passed")
        return fn(validator, value, instance, schema)

    return step


class _TimedRe:
    """What jsonschema's modules see as ``re``: ``re`` itself, but ``search``, bounded by
    this thread's check deadline when it has one."""

    def __getattr__(self, name: str) -> Any:
        return getattr(re, name)

    @staticmethod
    def search(pattern: Any, string: str, flags: int = 0) -> Any:
        limit: Deadline | None = getattr(_check, "deadline", None)
        if limit is None or not isinstance(pattern, str):
            return re.search(pattern, string, flags)
        import regex

        pattern = as_re_reads(pattern)
        left = max(0.001, limit.at - time.monotonic())
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
    """Make jsonschema's keyword modules search through ``_TimedRe``, and its walk of what
    ``unevaluatedItems``/``unevaluatedProperties`` have seen look at the deadline at each step
    (once a process). That walk follows ``$ref`` and ``$dynamicRef`` by calling itself, no
    keyword applied in between: both on a chain of definitions doubles its work at each link.
    Its recursive calls go through ``_utils``'s globals, so the wrapper there sees each."""
    global _installed
    with _lock:
        if _installed:
            return
        import regex  # noqa: F401 - missing: fail here, at the proxy's start, not mid-check
        from jsonschema import _keywords, _legacy_keywords, _utils

        for module in (_keywords, _legacy_keywords, _utils):
            module.re = _TimedRe()  # type: ignore[attr-defined]
        for walk in ("item_indexes", "property_keys"):
            name = f"find_evaluated_{walk}_by_schema"
            setattr(_utils, name, stepping(getattr(_utils, name)))
        _installed = True


@contextmanager
def deadline(limit: Deadline) -> Iterator[None]:
    """The searches and steps of this thread's check, meanwhile, end by ``limit``
    (``TimeoutError``)."""
    _check.deadline = limit
    try:
        yield
    finally:
        _check.deadline = None
