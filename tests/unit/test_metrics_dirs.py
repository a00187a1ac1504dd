"""A process's temporary metrics directory does not outlive it for good: a worker killed
(SIGKILL, the OOM killer, chaos) never runs its exit hook, and its directory stayed in the
temporary folder (47 after a morning of tests); the next process of that role on the host
removes it. Those of live processes, other users' and other names are left alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

START = (
    "import os, sys; from toolledger.observability.metrics import use_multiprocess; "
    "print(use_multiprocess(role='worker'), flush=True); "
    "os._exit(0) if sys.argv[1] == 'killed' else None"
)


def start(tmp: Path, how: str) -> Path:
    """A process that takes its metrics directory, then dies without its exit hook
    (``killed``: as SIGKILL leaves it) or exits normally (``exits``); its directory."""
    env = {**os.environ, "TMPDIR": str(tmp)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    out = subprocess.run([sys.executable, "-c", START, how], env=env, capture_output=True,
                         text=True, check=True)  # fmt: skip
    return Path(out.stdout.strip())


def test_a_killed_workers_temporary_directory_is_removed_by_the_next(tmp_path: Path) -> None:
    killed = start(tmp_path, "killed")
    assert killed.is_dir() and killed.parent == tmp_path  # left behind: no exit hook ran
    exited = start(tmp_path, "exits")
    assert not killed.exists()  # the next one removed it
    assert not exited.exists()  # and its own at its exit, as before
    assert list(tmp_path.iterdir()) == []


def test_only_dead_processes_directories_of_the_prefix_are_removed(tmp_path: Path) -> None:
    from toolledger.observability.metrics import _remove_dead_temporary

    prefix = "toolledger-worker-metrics-host-"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    dead = tmp_path / f"{prefix}{gone}-abc"
    live = tmp_path / f"{prefix}{os.getpid()}-abc"
    other_role = tmp_path / f"toolledger-serve-metrics-host-{gone}-abc"
    other_shape = tmp_path / f"{prefix}notapid-abc"
    # another host whose name starts with this one's ("host-N" beside "host", N a dead pid
    # here): its process is this one, alive
    other_host = tmp_path / f"{prefix}{gone}-{os.getpid()}-abc"
    target = tmp_path / "elsewhere"
    for d in (dead, live, other_role, other_shape, other_host, target):
        d.mkdir()
    linked = tmp_path / f"{prefix}{gone}-link"
    linked.symlink_to(target, target_is_directory=True)
    _remove_dead_temporary(tmp_path, prefix)
    assert not dead.exists()
    assert live.is_dir() and other_role.is_dir() and other_shape.is_dir()
    assert other_host.is_dir()
    assert linked.is_symlink() and target.is_dir()  # a link is not followed nor removed
