"""The fault kinds of a chaos run, each one entry: how the timeline draws it, whether the plain
Celery baseline can suffer it, and how the checker may blame an ``unknown`` on it.

Injecting a kind is the ``_fault_<name>`` method of ``ChaosRun`` (and of ``BaselineRun`` where
``in_baseline``); ``tests/unit/test_chaos_checker.py`` checks that each entry has its method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class FaultKind:
    name: str
    colour: str  # matplotlib colour on the timeline
    in_baseline: bool = False
    #: How an unknown execution is blamed on a fault of this kind: a fault that hit the
    #: execution's process ("pid"), or also its worker's host name ("pid_or_host").
    blames: Literal["pid", "pid_or_host"] | None = None
    #: The field of its record that says how long it lasted (seconds; None: an instant).
    lasts: str | None = None
    #: Whether it cuts executions off from the database (all of them, or its target's).
    database: bool = False
    #: Whether it takes its worker out of the fleet while it lasts (a freeze, a cut, a main
    #: process killed until its restart is ready): one such at a time while one is left up.
    disables: bool = False


KINDS: dict[str, FaultKind] = {
    k.name: k
    for k in (
        FaultKind("kill_main", "tab:red", in_baseline=True, blames="pid", disables=True),
        FaultKind("kill_child", "tab:orange", in_baseline=True, blames="pid"),
        FaultKind(
            "zombie", "tab:purple", in_baseline=True, blames="pid", lasts="frozen_s", disables=True
        ),
        FaultKind("redis_flush", "tab:brown", in_baseline=True),
        FaultKind("pg_terminate", "tab:blue", database=True),
        FaultKind("duplicate", "tab:gray", in_baseline=True),
        FaultKind(
            "partition",
            "tab:pink",
            blames="pid_or_host",
            lasts="cut_s",
            database=True,
            disables=True,
        ),
        FaultKind("pg_crash", "black", lasts="down_s", database=True),
    )
}

#: Every kind, in schedule order; the baseline's.
EXTERNAL = tuple(KINDS)
BASELINE = tuple(k.name for k in KINDS.values() if k.in_baseline)
#: The kinds that cut executions off from the database.
DATABASE = tuple(k.name for k in KINDS.values() if k.database)
#: The kinds that cut every worker's executions off the database at once (a partition cuts only
#: its target's): a woken process on its way to the fence would meet them too.
WHOLE_DATABASE = tuple(k.name for k in KINDS.values() if k.database and k.blames is None)
#: The kinds that can cut an execution off: each waits (bounded) for one in flight to strike.
MEETS_WORK = tuple(k.name for k in KINDS.values() if k.blames or k.database)
#: The kinds that take a worker out of the fleet while they last.
DISABLES = tuple(k.name for k in KINDS.values() if k.disables)
#: The timeline's colour for failpoint firings (inside the workers, not on the schedule).
FAILPOINT_COLOUR = "tab:olive"
