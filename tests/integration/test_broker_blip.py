"""A broker blip under a running tool (helper-89): the worker reconnects, the tool runs on.

Celery's ``worker_cancel_long_running_tasks_on_connection_loss`` (DESIGN §7) terminated every
task running on a prefork worker when its Redis connection dropped, however briefly: a call
that would have succeeded read ``not_applied`` (sandboxed) or ``unknown`` ("ask a human").
Its one purpose, keeping a redelivered message from running twice, is the claim's: off now.
Real worker, real Redis; only this worker's own connections are cut (``CLIENT KILL ADDR``)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import redis

from toolledger.harness.processes import service_env, stop_all, toolledger_argv, worker_process


def _cut_connections(pid: int, client: redis.Redis, port: int) -> int:
    """CLIENT KILL every connection the worker's processes hold to Redis."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    cut = 0
    for proc in procs:
        for conn in proc.net_connections(kind="tcp"):
            if conn.raddr and conn.raddr.port == port:
                try:
                    client.execute_command("CLIENT", "KILL", "ADDR",
                                           f"{conn.laddr.ip}:{conn.laddr.port}")  # fmt: skip
                    cut += 1
                except redis.ResponseError:  # gone meanwhile
                    pass
    return cut


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_worker__a_broker_blip_does_not_stop_a_running_tool(
    redis_server: str, redis_prefix: str, tmp_path: Path, pool: str
) -> None:
    port = redis.connection.parse_url(redis_server).get("port", 6379)
    env = service_env(
        db=f"sqlite:///{tmp_path / 'ledger.db'}",
        broker=redis_server,
        broker_prefix=redis_prefix,
        sandbox=str(tmp_path / "sandbox"),
        home=str(tmp_path / "home"),
        metrics="off",
        failpoints="before_effect=sleep(4)",
    )

    def cli(*argv: str) -> dict:
        done = subprocess.run([*toolledger_argv(), "--json", *argv], env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    worker = worker_process("blip", env, tmp_path / "logs", pool=pool, concurrency=2)
    client = redis.Redis.from_url(redis_server)
    worker.start()
    try:
        worker.wait_ready(60)
        args = json.dumps({"path": "a.txt", "content": "whole"})
        cli("submit", "--scope", "s", "--tool-call-id", "c1", "--tool", "write_file",
            "--args", args, "--approved-by", "al")  # fmt: skip
        deadline = time.monotonic() + 60
        while cli("show", "--scope", "s", "--tool-call-id", "c1")["status"] != "running":
            assert time.monotonic() < deadline, worker.log_text()[-3000:]
            time.sleep(0.1)
        time.sleep(0.5)  # the tool is in its 4 s
        assert _cut_connections(worker.pid, client, int(port)) >= 1
        got = cli("wait", "--scope", "s", "--tool-call-id", "c1", "--timeout", "60")
        assert got["status"] == "succeeded", (got, worker.log_text()[-3000:])
        (execution,) = cli("show", "--scope", "s", "--tool-call-id", "c1")["executions"]
        assert execution["status"] == "succeeded"
        assert (tmp_path / "sandbox" / "s" / "a.txt").read_text() == "whole"
        assert "Terminating it instead" not in worker.log_text()
    finally:
        client.close()
        stop_all([worker])
