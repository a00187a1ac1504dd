"""The bench's split of the machine's CPU into parts (``CpuMeter``): a worker's CPU counts
with it, its pool children's too, even those that exit (and are reaped) before the end."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from toolledger.harness.bench.common import CPU_PARTS, CpuMeter

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"
# A worker that burns 0.4 s itself and runs a child that burns 0.4 s, exits and is reaped.
WORKER = (
    "import subprocess, sys, time\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    f"subprocess.run([sys.executable, '-c', {BURN.format(s=0.4)!r}], check=True)\n"
    + BURN.format(s=0.4)
    + "print('done', flush=True)\n"
    "sys.stdin.readline()\n"
)


def test_cpu_meter__a_workers_tree_counts_with_it_reaped_children_too() -> None:
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert worker.stdin is not None and worker.stdout is not None
    try:
        assert worker.stdout.readline().strip() == "ready"
        meter = CpuMeter([worker.pid])
        meter.start()
        worker.stdin.write("go\n")
        worker.stdin.flush()
        assert worker.stdout.readline().strip() == "done"  # the child was reaped before this
        time.sleep(0.05)
        meter.stop()
    finally:
        worker.communicate("bye\n", timeout=30)
    assert set(meter.parts) == set(CPU_PARTS)
    assert meter.parts["workers"] >= 0.7, meter.parts  # 0.4 s of its own + 0.4 s its child's
    assert meter.parts["producer"] < 0.2, meter.parts  # this process only waited
    assert all(v >= 0 for v in meter.parts.values()), meter.parts
    assert abs(sum(meter.parts.values()) - meter.busy) < 0.05 or meter.parts["other"] == 0
    per_call = meter.parts_ms_per(10)
    assert per_call["workers"] == pytest.approx(meter.parts["workers"] * 100)  # ms per call
