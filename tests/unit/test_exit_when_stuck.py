"""worker.app.exit_when_stuck: a prefork worker whose pool child was killed by a signal
leaves once its exit is stuck; one whose children live (a warm shutdown waiting for their
tasks) or ended as they should is left alone. Real forked children, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

from toolledger.worker.app import _killed

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")


def _child(code: int | None) -> int:
    """A forked child that exits with ``code``, or waits to be signalled (None)."""
    pid = os.fork()
    if pid == 0:
        if code is None:
            time.sleep(60)
        os._exit(code or 0)
    return pid


def _zombie(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                return
        time.sleep(0.01)
    raise AssertionError(f"{pid} never became a zombie")


def _process(pid: int, returncode: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, _popen=SimpleNamespace(returncode=returncode))


def test_killed__read_from_a_zombie_without_reaping_it() -> None:
    killed, ended, alive = _child(None), _child(0), _child(None)
    failed = _child(3)
    try:
        os.kill(killed, signal.SIGTERM)
        for pid in (killed, ended, failed):
            _zombie(pid)
        assert _killed(_process(killed)) is True
        assert _killed(_process(ended)) is False
        assert _killed(_process(failed)) is False  # an exit status, not a signal
        assert _killed(_process(alive)) is False
        # never reaped: each is still there for billiard's own wait
        assert os.waitpid(killed, 0)[1] & 0x7F == signal.SIGTERM
        assert os.waitpid(ended, 0)[1] == 0
    finally:
        os.kill(alive, signal.SIGKILL)
        for pid in (alive, failed):
            os.waitpid(pid, 0)


def test_killed__from_the_status_billiard_reaped() -> None:
    assert _killed(_process(999_999_999, returncode=-signal.SIGTERM)) is True
    assert _killed(_process(999_999_999, returncode=0)) is False
    assert _killed(_process(999_999_999, returncode=None)) is False  # gone, not known yet


SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from types import SimpleNamespace
    from toolledger.worker.app import ShutdownBegun, exit_when_stuck

    how = sys.argv[1]
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    proc = SimpleNamespace(pid=pid, _popen=SimpleNamespace(returncode=None))
    worker = SimpleNamespace(pool=SimpleNamespace(_pool=SimpleNamespace(_pool=[proc])))
    begun = ShutdownBegun()
    exit_when_stuck(worker, begun, grace=0.5, tick=0.05)
    if how == "reaped":  # killed by the group's signal, reaped and out of the pool's list
        time.sleep(0.3)  # (billiard's) before the watcher's first look after the shutdown
        os.kill(pid, signal.SIGTERM)
        proc._popen.returncode = -(os.waitpid(pid, 0)[1] & 0x7F)
        worker.pool._pool._pool = []
        begun.set(3)
        time.sleep(6)
        print("still here")
        sys.exit(0)
    if how != "running":
        begun.set(3)  # the shutdown began
    time.sleep(0.3)
    if how != "live":
        os.kill(pid, signal.SIGTERM)
        worker.pool._pool = None  # and the pool is gone: the child it had is still judged
    time.sleep(6)  # stuck
    os.kill(pid, signal.SIGKILL)
    print("still here")
    """
)


@pytest.mark.parametrize(
    ("how", "code", "said"),
    [
        ("killed", 3, ""),  # a child killed in the shutdown: leaves, with its exit code
        ("reaped", 3, ""),  # killed with it and gone from the pool's list before a look
        ("live", 0, "still here"),  # children alive (running their tasks): stays
        ("running", 0, "still here"),  # a child killed with no shutdown begun: none of its own
    ],
)
def test_exit_when_stuck__leaves_only_once_a_child_was_killed(
    how: str, code: int, said: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stdout.strip()) == (code, said), proc.stderr[-2000:]
    if code == 3:  # left in its grace, not after the 6 s it stayed: exit 3, not 0
        assert "killed by a signal" in proc.stderr
