"""Failpoints: open each crash window of the execute protocol on purpose (DESIGN §5).

``TOOLLEDGER_FAILPOINTS="after_effect=exit(23)"`` — points are separated by ``;``, each
``point=[P%][N*]action``, as in fail-rs: ``5%exit(23)`` fires with probability 5 %,
``2*raise`` fires the first two times only. A leading ``first+`` (``first+5%kill``) also fires
the first hit of the point across every process that shares the failpoint log (one marker
file, created with O_EXCL, claims it), so a short chaos run covers each window at least once
instead of hoping the percentage does; without a log it is the first hit of this process.
Several actions for one point are chained with ``->``, as in fail-rs
(``after_stage=first+0%stop->first+2%kill``): each hit fires the first of them that fires, so
the fleet's first hit stops and its second is killed; each ``first+`` of a chain is its own.
Actions: ``exit(N)`` (os._exit: no cleanup, no
finally blocks), ``kill`` (SIGKILL to self), ``raise``, ``sleep(S)``, ``stop`` (SIGSTOP to
self: a zombie until someone sends SIGCONT), ``off``.

Zero cost when unset: ``hit`` is then a function that returns at once. With a log path,
each firing is appended there (JSON: point, action, pid, ref, t) before it acts, so a chaos
run can line every ``unknown`` up with the fault that caused it.
"""

from __future__ import annotations

import itertools
import os
import random
import re
import signal
import threading
import time
from dataclasses import dataclass

from toolledger import jsonlines

#: In the order an execution meets them (DESIGN §5, worker.pipeline): after_stage fires inside
#: the effect (its bytes staged, the commit not yet made); before_publish / after_publish
#: around each landing, under the path's lock.
POINTS = (
    "after_claim",
    "before_effect",
    "after_stage",
    "after_effect",
    "after_terminal",
    "before_publish",
    "after_publish",
)
ENV = "TOOLLEDGER_FAILPOINTS"
#: The most actions one point chains with ``->``.
MAX_CHAIN = 4
#: The longest ``sleep(S)``: a day (a freeze longer than any lease; nan and inf refused).
MAX_SLEEP = 86_400.0

_SPEC = re.compile(
    r"^(?P<first>first\+)?(?:(?P<pct>\d+(?:\.\d+)?)%)?(?:(?P<count>\d+)\*)?(?P<action>exit|kill|raise|sleep|stop|off)"
    r"(?:\((?P<arg>[^)]*)\))?$"
)


class FailpointError(RuntimeError):
    """Raised by a failpoint whose action is ``raise``."""


class FailpointSpecError(ValueError):
    """TOOLLEDGER_FAILPOINTS does not parse."""


@dataclass
class Action:
    kind: str
    arg: float = 0.0
    probability: float = 1.0
    remaining: int | None = None  # None: every time
    first: bool = False  # the first hit fires, fleet-wide when there is a log to share
    then: Action | None = None  # the next of a chain (``->``), asked when this one does not fire
    index: int = 0  # its place in the chain (the ``first+`` marker of each is its own)

    def should_fire(self, point: str) -> bool:
        if self.first:
            self.first = False
            if _claim_first(point if not self.index else f"{point}-{self.index}"):
                return True
        if self.remaining is not None:
            if self.remaining <= 0:
                return False
            self.remaining -= 1
        return self.probability >= 1.0 or random.random() < self.probability

    def record(self, point: str, ref: str | None) -> None:
        if not _log_path:
            return
        entry = {"point": point, "action": self.kind, "pid": os.getpid(), "ref": ref}
        jsonlines.append(_log_path, {**entry, "t": time.time()})

    def perform(self, point: str) -> None:
        if self.kind == "exit":
            os._exit(int(self.arg))
        elif self.kind == "raise":
            raise FailpointError(f"failpoint {point} fired")
        elif self.kind == "sleep":
            time.sleep(self.arg)
        elif self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)


def parse(spec: str) -> dict[str, Action]:
    """``"after_effect=exit(23);after_claim=10%raise"`` -> {point: Action} (the first of its
    chain, for ``a->b``)."""
    actions: dict[str, Action] = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        point, _, text = item.partition("=")
        point, text = point.strip(), text.strip()
        if point not in POINTS:
            raise FailpointSpecError(f"unknown failpoint {point!r}; known: {', '.join(POINTS)}")
        parts = text.split("->")
        if len(parts) > MAX_CHAIN:
            raise FailpointSpecError(f"{point}: at most {MAX_CHAIN} chained actions")
        chain = [_action(point, part.strip(), i) for i, part in enumerate(parts)]
        for a, b in itertools.pairwise(chain):
            a.then = b
        actions[point] = chain[0]
    return actions


def _action(point: str, text: str, index: int) -> Action:
    match = _SPEC.match(text)
    if not match:
        raise FailpointSpecError(f"cannot parse failpoint action {text!r} for {point}")
    kind, arg = match["action"], match["arg"]
    if kind in ("exit", "sleep") and not arg:
        raise FailpointSpecError(f"{kind} needs an argument, e.g. {kind}(1)")
    # Values are checked here, when the variable is read, not where the point fires: a
    # ``sleep(nan)`` raised ValueError after the claim, an ``exit(999)`` exited 231, a
    # ``kill(9)`` ignored its argument (a cold review)
    if kind not in ("exit", "sleep") and arg is not None:
        raise FailpointSpecError(f"{kind} takes no argument: {text!r} for {point}")
    if kind == "exit" and not (re.fullmatch(r"[0-9]{1,3}", arg.strip()) and int(arg) <= 255):
        raise FailpointSpecError(f"exit needs a status from 0 to 255: {text!r} for {point}")
    if kind == "sleep" and not (_is_number(arg) and 0 <= float(arg) <= MAX_SLEEP):
        raise FailpointSpecError(
            f"sleep needs seconds from 0 to {MAX_SLEEP:g}: {text!r} for {point}"
        )
    if match["pct"] and float(match["pct"]) > 100:
        raise FailpointSpecError(f"a probability is at most 100%: {text!r} for {point}")
    return Action(
        kind=kind,
        arg=float(arg) if arg else 0.0,
        probability=float(match["pct"]) / 100 if match["pct"] else 1.0,
        remaining=int(match["count"]) if match["count"] else None,
        first=bool(match["first"]),
        index=index,
    )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


_lock = threading.Lock()
_active: dict[str, Action] = {}
_log_path = ""


def first_markers(log_path: str) -> list[str]:
    """The marker files ``first+`` leaves beside ``log_path`` (a new run removes them): one
    per point, in ``POINTS`` order, then those of the later actions of chains."""
    folder, name = os.path.split(os.path.abspath(log_path))
    later = [f"{point}-{i}" for i in range(1, MAX_CHAIN) for point in POINTS]
    return [os.path.join(folder, f"{name}.first-{point}") for point in [*POINTS, *later]]


def _claim_first(point: str) -> bool:
    if not _log_path:
        return True
    try:
        fd = os.open(f"{os.path.abspath(_log_path)}.first-{point}", os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def _off(point: str, ref: str | None = None) -> None:
    """What ``hit`` is when no failpoint is configured."""


def _on(point: str, ref: str | None = None) -> None:
    action = _active.get(point)
    with _lock:  # counters are shared by the threads of one process
        while action is not None and (action.kind == "off" or not action.should_fire(point)):
            action = action.then
    if action is not None:
        action.record(point, ref)
        action.perform(point)


#: Call at each crash window: ``failpoints.hit("after_effect")``.
hit = _off


def armed() -> bool:
    """Whether any failpoint is active (when none is, ``hit`` is a function that does nothing)."""
    return hit is not _off


def configure(spec: str | None, log_path: str = "") -> None:
    """Activate the failpoints of ``spec`` (empty or None: all off, at zero cost)."""
    global hit, _log_path
    actions = parse(spec) if spec else {}
    _log_path = log_path
    _active.clear()
    _active.update(actions)
    hit = _on if actions else _off
