"""worker.prefork.ProcessLock: a lock between forked processes that the kernel releases when
its holder dies, which billiard's semaphores never were (a killed pool child kept its worker's
job queue locked for ever)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from toolledger.worker.prefork import ProcessLock, RobustPool


def _fork_holding(lock: ProcessLock) -> tuple[int, int]:
    """A forked child that takes ``lock`` and keeps it; returns its pid once it holds it."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            lock.acquire()
            os.write(w, b"1")
            time.sleep(600)
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    return pid, r


def test_another_process_holding_it__it_is_not_taken_until_that_process_dies() -> None:
    lock = ProcessLock()
    pid, r = _fork_holding(lock)
    try:
        assert lock.acquire(block=False) is False
        assert lock.acquire(timeout=0.2) is False
        # When its holder is SIGKILLed where it holds it
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        # Then it is free
        assert lock.acquire(timeout=30)
        lock.release()
    finally:
        os.close(r)
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGKILL)


def test_a_killed_holder_before_a_blocked_waiter__the_waiter_gets_it() -> None:
    lock = ProcessLock()
    pid, r = _fork_holding(lock)
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(lock.acquire()))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not got  # blocked behind the other process
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    waiter.join(30)
    assert got == [True]
    lock.release()
    os.close(r)


def test_two_threads_of_one_process__are_kept_apart() -> None:
    lock = ProcessLock()
    with lock:
        other: list[bool] = []
        t = threading.Thread(target=lambda: other.append(lock.acquire(timeout=0.2)))
        t.start()
        t.join()
        assert other == [False]
    assert lock.acquire(block=False)
    lock.release()


def test_held_in_the_parent_at_fork__the_child_waits_for_the_parent_then_takes_it() -> None:
    # The child's copy of the thread lock is held (copied so at the fork): it is made anew,
    # and the record lock, the parent's, keeps the child waiting until the parent lets go.
    lock = ProcessLock()
    lock.acquire()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        refused = lock.acquire(block=False) is False
        os.write(w, b"r" if refused else b"x")
        os._exit(0 if refused and lock.acquire(timeout=60) else 1)
    os.close(w)
    said = os.read(r, 1)  # the parent lets go only once the child has been refused
    os.close(r)
    lock.release()
    _, status = os.waitpid(pid, 0)
    assert said == b"r"
    assert os.waitstatus_to_exitcode(status) == 0


def test_it_is_not_pickled() -> None:
    import pickle

    with pytest.raises(TypeError, match="by fork only"):
        pickle.dumps(ProcessLock())


def test_robust_pool__its_queues_locks_are_process_locks() -> None:
    pool = RobustPool(processes=1)
    try:
        for queue in (pool._inqueue, pool._outqueue):
            assert isinstance(queue._rlock, ProcessLock)
            assert isinstance(queue._wlock, ProcessLock)
        assert pool.apply(pow, (2, 10)) == 1024  # it still runs jobs
    finally:
        pool.terminate()
        pool.join()
