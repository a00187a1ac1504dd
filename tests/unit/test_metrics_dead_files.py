"""A process group's multiprocess files of processes that are gone are folded into the
group's own files when it is scraped: counts kept, files bounded.

Each pool child writes files of its own (``counter_PID.db``, ``histogram_PID.db``, a gauge
file per mode), and prometheus_client never removes a dead process's: a worker under
``--max-tasks-per-child 1`` left two files per task (62 after 30 calls here), and every
scrape read them all, linear in the files (1.2 s at 6,200 files on the test machine: about
50,000, 25,000 tasks, pass Prometheus's 10 s scrape timeout, and the worker's target is
down). A ``live*`` gauge of a child that was SIGKILLed (no exit hook ran) stayed in its sum
for good. The children here count through the same hooks the executor and the sweep use,
forked from a process that enabled them (as billiard forks the pool from the worker's main
process), and leave by ``os._exit`` (no exit hook, as SIGKILL)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.parser import text_string_to_metric_families

from toolledger.observability import metrics

CHILDREN = """
import os, sys
directory, n, first = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
from prometheus_client import Gauge, values
values.ValueClass = values.get_value_class()
from toolledger.ledger import metrics as counters
counters.enable()
busy = Gauge("hobs_busy", "A live gauge.", multiprocess_mode="livesum", registry=None)
for i in range(n):
    pid = os.fork()
    if pid == 0:
        counters.transition("write_file", "running")
        counters.transition("write_file", "succeeded")
        counters.execution_finished("write_file", 0.02)
        counters.sweep_finished(0.1, True, unlanded=first + i)
        busy.set(1)
        os._exit(0)
    os.waitpid(pid, 0)
os._exit(0)
"""


def children(directory: Path, n: int, first: int) -> None:
    """``n`` pool children that each count one call and one sweep pass, then die."""
    subprocess.run([sys.executable, "-c", CHILDREN, str(directory), str(n), str(first)],
                   check=True, timeout=120)  # fmt: skip


def scrape(monkeypatch: pytest.MonkeyPatch, directory: Path) -> dict[str, float]:
    """What the group's endpoint serves: {sample name{labels}: value}."""
    monkeypatch.setattr(metrics, "_group_dir", str(directory))
    text = generate_latest(metrics.process_registry()).decode()
    served: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            served[f"{s.name}{{{labels}}}"] = s.value
    return served


def read(path: Path) -> list[tuple[str, float, float, int]]:
    return list(MmapedDict.read_all_values_from_file(str(path)))


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.db"))


def test_dead_childrens_files_are_folded_and_their_counts_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = tmp_path / "group"
    group.mkdir()
    children(group, 20, 0)
    first = scrape(monkeypatch, group)
    assert first["toolledger_calls_total{status=running,tool=write_file}"] == 20
    assert first["toolledger_calls_total{status=succeeded,tool=write_file}"] == 20
    assert first["toolledger_execution_duration_seconds_count{tool=write_file}"] == 20
    assert first["toolledger_execution_duration_seconds_bucket{le=0.025,tool=write_file}"] == 20
    assert first["toolledger_sweep_duration_seconds_count{}"] == 20
    assert first["toolledger_sweep_unlanded_paths{}"] == 19  # the last pass's (mostrecent)
    assert first["toolledger_sweep_last_success_timestamp_seconds{}"] > 0
    # a live gauge of processes all gone (SIGKILLed: nobody marked them dead) is not summed
    assert first.get("hobs_busy{}", 0) == 0
    # the dead processes' files are gone, folded into one file per kind of the group's
    folded = files(group)
    assert len(folded) <= 4, folded
    assert scrape(monkeypatch, group) == first  # folding again changes nothing

    children(group, 20, 100)  # more children come and go: counters never go backwards
    second = scrape(monkeypatch, group)
    assert second["toolledger_calls_total{status=running,tool=write_file}"] == 40
    assert second["toolledger_execution_duration_seconds_count{tool=write_file}"] == 40
    assert second["toolledger_execution_duration_seconds_sum{tool=write_file}"] == pytest.approx(
        0.8
    )
    assert second["toolledger_sweep_unlanded_paths{}"] == 119
    last = second["toolledger_sweep_last_success_timestamp_seconds{}"]
    assert last >= first["toolledger_sweep_last_success_timestamp_seconds{}"]
    assert files(group) == folded  # bounded: the same files, whatever the number of children


def test_a_live_processs_files_are_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file of a process still alive (this one, standing in for a pool child at work) is
    served as it is and never folded: it may still be written."""
    donor, group = tmp_path / "donor", tmp_path / "group"
    donor.mkdir()
    group.mkdir()
    children(donor, 3, 0)
    me = os.getpid()
    for name in ("counter", "gauge_livesum"):
        # a child's (the one that forked them counted nothing: its values are 0)
        counted = [p for p in donor.glob(f"{name}_*.db") if any(v for _, v, _, _ in read(p))]
        shutil.copy(counted[0], group / f"{name}_{me}.db")
    served = scrape(monkeypatch, group)
    assert served["toolledger_calls_total{status=running,tool=write_file}"] == 1
    assert served["hobs_busy{}"] == 1  # alive: its live gauge counts
    assert files(group) == [f"counter_{me}.db", f"gauge_livesum_{me}.db"]


def test_a_fold_that_fails_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fold that fails part way (a full disk under the group's file) leaves the files as
    they were: the scrape serves them unfolded, and the next fold counts each once. Written
    in place, the keys written before the failure were added again at the next try."""
    group = tmp_path / "group"
    group.mkdir()
    children(group, 5, 0)
    expected = scrape(monkeypatch, group)  # folded once: the group's files hold the counts
    children(group, 5, 10)
    written: list[str] = []
    real = MmapedDict.write_value

    def full_disk(self: MmapedDict, key: str, value: float, timestamp: float) -> None:
        if len(written) >= 6:  # past the zeros, into the calls counted
            raise OSError(28, "No space left on device")
        written.append(key)
        real(self, key, value, timestamp)

    with monkeypatch.context() as patched:
        patched.setattr(MmapedDict, "write_value", full_disk)
        unfolded = scrape(monkeypatch, group)
    running = "toolledger_calls_total{status=running,tool=write_file}"
    assert expected[running] == 5
    assert unfolded[running] == 10
    folded = scrape(monkeypatch, group)
    # the dead children's live gauge leaves with the fold (unfolded, its files still served)
    assert unfolded.pop("hobs_busy{}") == 5 and "hobs_busy{}" not in folded
    assert folded == pytest.approx(unfolded)  # each count once (summed in another order)
    assert len(files(group)) <= 4


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(120)
"""


def test_a_scrape_does_not_wait_for_a_frozen_lock_holder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another process of the group holds the fold lock and does not let go (frozen: a
    SIGSTOP, a stalled disk). A scrape waited for it for as long: under ``serve --workers
    N`` on the event loop, so no API request of that process was answered either. It now
    leaves the group's counters out, one warning line, and serves them once the lock is
    free."""
    group = tmp_path / "group"
    group.mkdir()
    children(group, 3, 0)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(group / metrics._LOCK_FILE)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        served: list[dict[str, float]] = []
        scraping = threading.Thread(target=lambda: served.append(scrape(monkeypatch, group)))
        scraping.daemon = True
        scraping.start()
        scraping.join(timeout=30)  # the wait is 1 s; 30 for a loaded machine
        assert not scraping.is_alive(), "the scrape waits for the lock's frozen holder"
        assert "toolledger_calls_total{status=running,tool=write_file}" not in served[0]
        assert "the group's counters not served" in caplog.text
    finally:
        holder.kill()
        holder.wait(timeout=30)
    scraping.join(timeout=30)
    again = scrape(monkeypatch, group)
    assert again["toolledger_calls_total{status=running,tool=write_file}"] == 3
