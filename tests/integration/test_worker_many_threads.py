"""A threads worker wider than the ledger's default pool (helper-90).

Each thread of a threads pool keeps one ledger connection for its life (the fast path); the
pool allowed 44. At 60 threads, 15 claims found no connection, failed after the timeout (their
calls waiting for the sweep to re-publish them) and logged a false "cannot learn whether it
committed"; renewals and landings starved too. The worker now sizes the pool to its threads."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from toolledger.config import Settings
from toolledger.harness.processes import service_env, stop_all, toolledger_argv, worker_process
from toolledger.worker.submit import Submitter

THREADS = 50


def test_worker__every_thread_of_a_wide_threads_pool_claims(
    redis_server: str, redis_prefix: str, tmp_path: Path
) -> None:
    settings = {
        "db": f"sqlite:///{tmp_path / 'ledger.db'}",
        "broker": redis_server,
        "broker_prefix": redis_prefix,
        "sandbox": str(tmp_path / "sandbox"),
        "home": str(tmp_path / "home"),
        "metrics": "off",
        "requeue_after": "600",  # a call left to the sweep would not run within the test
    }
    env = service_env(**settings, failpoints="before_effect=sleep(3)")  # all at once
    worker = worker_process("wide", env, tmp_path / "logs", pool="threads", concurrency=THREADS)
    worker.start()
    submitter = Submitter(
        Settings.from_env({f"TOOLLEDGER_{k.upper()}": v for k, v in settings.items()})
    )
    try:
        worker.wait_ready(60)
        for i in range(THREADS):
            call = submitter.prepare("s", f"c{i}", "write_file", {"path": f"f{i}", "content": "x"})
            assert submitter.submit(call, approved_by="al")["enqueued"] is True
        for i in range(THREADS):
            done = subprocess.run(
                [*toolledger_argv(), "--json", "wait", "--scope", "s", "--tool-call-id", f"c{i}",
                 "--timeout", "90"],
                env=service_env(**settings), capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert done.returncode == 0, (done.stderr, worker.log_text()[-2000:])
            assert json.loads(done.stdout)["status"] == "succeeded", done.stdout
        said = worker.log_text()
        assert "QueuePool limit" not in said and "cannot learn whether it committed" not in said
    finally:
        submitter.ledger.close()
        stop_all([worker])
