"""``toolledger bench --quick`` runs in CI so the harness never rots. No speed is asserted."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_cli

pytestmark = [pytest.mark.postgres, pytest.mark.redis]
HEADLINES = (
    "ledger_vs_handwritten",
    "celery_vs_noop",
    "vs_procrastinate",
    "vs_dbos",
    "sweep_1m_vs_10k",
)


def test_bench__quick_run_reports_every_figure(pg_server, redis_server, tmp_path, capsys):
    out = tmp_path / "bench"
    code, stdout, stderr = run_cli(
        capsys,
        "bench",
        "--quick",
        "--pg",
        pg_server,
        "--redis",
        redis_server,
        "--out",
        str(out),
        "--json",
    )
    assert code == 0, stderr
    report = json.loads(stdout)
    assert list(report)[:5] == list(HEADLINES)  # the headline ratios come first
    for name in HEADLINES:
        figure = report[name]
        assert figure["goal"] and "met" in figure
        # a number, or an explicit reason why there is none
        assert figure["median"] is not None or figure.get("why"), (name, figure)
    raw = report["raw"]
    assert set(raw["protocol_jobs_per_s"]) == {
        f"{d}/{i}" for d in ("postgres", "sqlite") for i in ("toolledger", "handwritten", "insert")
    }
    assert {"toolledger", "celery_noop", "celery_write"} <= set(raw["e2e"])
    assert raw["claim_contention"]["attempts_per_s"]["rounds"] >= 1
    for name in ("bench.json", "bench.md", "bench.png"):
        assert (out / name).stat().st_size > 0
