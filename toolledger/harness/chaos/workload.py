"""The chaos run's workload: a seeded mix of jobs that can show a second effect.

- ``write``: chaos_write to a path of its own (a stale write of it overwrites nothing);
- ``shared``: chaos_write to a path shared by a chain of writers submitted one after another
  (each waits for the one before it to end), so a stale write of an earlier one would
  overwrite the newer truth;
- ``append``: chaos_append of a line unique to the call into one of a few shared logs (a
  second effect is a second line);
- ``charge``: chaos_charge through the downstream service, under the call's key.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

#: Share of each kind in the mix.
MIX = {"write": 0.25, "shared": 0.35, "append": 0.25, "charge": 0.15}
#: Writers per shared path, appends' log files.
CHAIN = 4
APPEND_FILES = 8
TOOLS = {"write": "chaos_write", "shared": "chaos_write", "append": "chaos_append",
         "charge": "chaos_charge"}  # fmt: skip


@dataclass(frozen=True)
class Job:
    cid: str
    kind: str
    tool: str
    args: dict[str, Any]
    group: str = ""  # the shared path or the append log
    after: str = ""  # shared writers: the call this one waits for
    line: str = ""  # appends: the exact line it adds

    @property
    def key(self) -> str:
        return f"{self.tool}:{self.cid}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Job:
        return cls(**data)


@dataclass
class Workload:
    jobs: list[Job] = field(default_factory=list)

    def by_kind(self, kind: str) -> list[Job]:
        return [j for j in self.jobs if j.kind == kind]

    def chains(self) -> dict[str, list[Job]]:
        """Shared path -> its writers, in the order they are submitted."""
        out: dict[str, list[Job]] = {}
        for j in self.by_kind("shared"):
            out.setdefault(j.group, []).append(j)
        return out


def make_workload(jobs: int, seed: int, run_id: str, hold_ms: int) -> Workload:
    """``hold_ms``: the mean time a job holds (half before its effect, half after); each job
    draws its own between a quarter and three times that, so faults meet jobs at every stage."""
    rng = random.Random(seed)
    kinds = rng.choices(list(MIX), weights=list(MIX.values()), k=jobs)
    out, chains = Workload(), 0
    last_in_chain: dict[str, tuple[str, int]] = {}  # group -> (cid, writers so far)
    mean = hold_ms
    for i, kind in enumerate(kinds):
        cid = f"job-{i:06d}"
        stamp = f"{cid} {run_id}"
        hold_ms = int(mean * rng.uniform(0.25, 3.0))
        if kind == "write":
            args = {"path": f"own/{i % 97:02d}/{cid}.txt", "content": stamp, "hold_ms": hold_ms}
            out.jobs.append(Job(cid, kind, TOOLS[kind], args))
        elif kind == "shared":
            open_chains = [g for g, (_, n) in last_in_chain.items() if n < CHAIN]
            if open_chains and rng.random() < 0.75:
                group = rng.choice(open_chains)
            else:
                group, chains = f"shared/s{chains:05d}.txt", chains + 1
            after, n = last_in_chain.get(group, ("", 0))
            args = {"path": group, "content": stamp, "hold_ms": hold_ms}
            out.jobs.append(Job(cid, kind, TOOLS[kind], args, group=group, after=after))
            last_in_chain[group] = (cid, n + 1)
        elif kind == "append":
            group = f"logs/a{rng.randrange(APPEND_FILES)}.log"
            line = stamp + "\n"
            args = {"path": group, "content": line, "hold_ms": hold_ms}
            out.jobs.append(Job(cid, kind, TOOLS[kind], args, group=group, line=line))
        else:
            args = {"account": f"acct-{rng.randrange(20)}", "cents": 100 + i, "hold_ms": hold_ms}
            out.jobs.append(Job(cid, kind, TOOLS[kind], args))
    return out
