"""The embedded default (SQLite ledger + the embedded SQLite broker): real worker processes,
the same code path as production. No service needed."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from toolledger import jsonlines
from toolledger.config import Settings
from toolledger.harness.processes import service_env, stop_all, worker_process
from toolledger.ledger.transitions import Status
from toolledger.worker.submit import Submitter


def test_embedded__two_workers_200_jobs_each_effect_once_nothing_lost(tmp_path: Path):
    home = tmp_path / ".toolledger"
    env = {
        "home": str(home),
        "tools": "toolledger.harness.probe",
        "effects_log": str(tmp_path / "fx.log"),
    }
    settings = Settings.from_env({f"TOOLLEDGER_{k.upper()}": v for k, v in env.items()})
    assert settings.broker.startswith("embedded+sqlite:///") and settings.db.startswith("sqlite")
    # Given two prefork workers starting together on a fresh home (both create the schemas)
    workers = [worker_process(f"e{i}", service_env(**env), tmp_path / "logs") for i in (1, 2)]
    for w in workers:
        w.start()
    try:
        for w in workers:
            w.wait_ready(90)
        sub = Submitter(settings)
        for i in range(200):
            call = sub.prepare("emb", f"c{i}", "probe_write", {"path": f"{i}", "content": f"#{i}"})
            assert sub.submit(call, approved_by="al")["enqueued"]
        ledger = sub.ledger
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            statuses = Counter(c.status for c in ledger.list_calls(limit=0))
            if statuses[Status.SUCCEEDED] == 200:
                break
            time.sleep(0.2)
    finally:
        stop_all(workers)
    assert statuses == {Status.SUCCEEDED: 200}
    effects = jsonlines.read(tmp_path / "fx.log")
    assert len(effects) == 200 and len({e["key"] for e in effects}) == 200
    assert {w.name for w in workers} and len({e["pid"] for e in effects}) >= 2
    for i in range(200):
        assert (home / "sandbox" / "emb" / str(i)).read_text() == f"#{i}"
    assert ledger.verify().ok
    sub.close()
