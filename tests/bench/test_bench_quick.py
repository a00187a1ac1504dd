"""``toolledger bench --quick`` runs in CI so the harness never rots. No speed is asserted."""

from __future__ import annotations

import json
from importlib import metadata

import pytest

from tests.helpers import run_cli

pytestmark = [pytest.mark.postgres, pytest.mark.redis]
HEADLINES = (
    "ledger_vs_handwritten",
    "sqlite_vs_handwritten",
    "celery_vs_noop",
    "vs_celery_write",
    "added_cpu_ms_per_call",
    "vs_procrastinate",
    "threads_vs_procrastinate",
    "production_vs_procrastinate",
    "vs_dbos",
    "sweep_1m_vs_10k",
)
PARTS = ["producer", "workers", "postgres", "redis", "other"]
IMPLS_TIMED = ("toolledger", "handwritten")


def test_bench__quick_run_reports_every_figure(pg_server, redis_server, tmp_path, capsys):
    out = tmp_path / "bench"
    code, stdout, stderr = run_cli(
        capsys,
        "bench",
        "--quick",
        "--rounds",  # one round reaches every section (CI time); the rounds' arithmetic is
        "1",  # held in tests/unit/test_bench_gaps.py
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
    assert report["rounds"] == 1
    assert list(report)[: len(HEADLINES)] == list(HEADLINES)  # the headline ratios come first
    for name in HEADLINES:
        figure = report[name]
        assert figure["goal"] and "met" in figure
        # a number, or an explicit reason why there is none
        assert figure["median"] is not None or figure.get("why"), (name, figure)
    raw = report["raw"]
    assert set(raw["protocol_jobs_per_s"]) == {
        f"{d}/{i}" for d in ("postgres", "sqlite") for i in ("toolledger", "handwritten", "insert")
    } | {"sqlite/handwritten_queued", "postgres/handwritten_minimal"}
    queued = report["sqlite_vs_handwritten"]["vs_handwritten_queued_by_processes"]
    assert all(q["median"] > 0 for q in queued.values()), queued
    minimal = report["ledger_vs_handwritten"]["vs_minimal_by_processes"]
    assert all(m["median"] > 0 for m in minimal.values()), minimal
    assert "against the minimal SQL written from scratch" in (out / "bench.md").read_text()
    assert {"toolledger", "toolledger_threads", "toolledger_production", "celery_noop",
            "celery_write"} <= set(raw["e2e"])  # fmt: skip
    for name, e2e in raw["e2e"].items():  # the machine's CPU per call, every variant
        assert e2e["cpu_ms_per_call"]["median"] > 0, name
        parts = e2e["cpu_parts_ms_per_call"]  # and where it went, every part named
        assert list(parts) == PARTS, name
        assert all(p["median"] >= 0 for p in parts.values()), (name, parts)
    cpu = raw["protocol_cpu_ms_per_job"]  # where the protocol's time goes, both sides
    assert set(cpu) == {f"{d}/{i}" for d in ("postgres", "sqlite") for i in IMPLS_TIMED}
    # Linux splits a process's CPU time into user and system by sampling ticks, so a quick
    # run's few milliseconds can all fall on one side: only their sum must be above nothing
    times = [c for side in cpu.values() for c in side.values()]
    assert all(c["user"]["median"] >= 0 and c["sys"]["median"] >= 0 for c in times), cpu
    assert all(c["user"]["max"] + c["sys"]["max"] > 0 for c in times), cpu
    gaps = raw["e2e_cpu_over_peers"]  # and what is left against each peer, by part
    peers = {"celery_write", *({"procrastinate"} - set(raw["e2e_not_run"]))}
    assert {g.split(" - ")[1] for g in gaps} == peers, gaps
    assert all(list(g) == [*PARTS, "total"] for g in gaps.values()), gaps
    assert raw["claim_contention"]["attempts_per_s"]["rounds"] >= 1
    for name in ("bench.json", "bench.md", "bench.png"):
        assert (out / name).stat().st_size > 0
    # two runs compare only with the versions they ran on
    packages = report["machine"]["packages"]
    assert packages["celery"] == metadata.version("celery"), packages
    assert f"celery {packages['celery']}" in (out / "bench.md").read_text()
    assert (
        "(threads, 2 workers of 2; not the production configuration)"
        in (out / "bench.md").read_text()
    )
    # and under what durability: fsync and synchronous commit on, for every side
    for side in ("toolledger", "baselines"):
        assert report["machine"]["durability"][side] == {"fsync": "on", "synchronous_commit": "on"}
    assert "durability, as each side's sessions saw it" in (out / "bench.md").read_text()
    assert "| backend | processes | toolledger user / sys |" in (out / "bench.md").read_text()
    assert "| toolledger - celery_write |" in (out / "bench.md").read_text()
    assert (
        "| system | producer | workers | postgres | redis | other |"
        in (out / "bench.md").read_text()
    )


@pytest.mark.parametrize(
    ("section", "headlines", "raw"),
    [
        ("protocol", HEADLINES[:2], {"protocol_jobs_per_s", "protocol_cpu_ms_per_job", "jobs"}),
        ("e2e", HEADLINES[2:9], {"e2e", "e2e_cpu_over_peers", "e2e_not_run", "jobs"}),
    ],
)
def test_bench__one_section_alone(
    pg_server, redis_server, tmp_path, capsys, section, headlines, raw
):
    out = tmp_path / "bench"
    argv = ["bench", "--only", section, "--quick", "--rounds", "1", "--pg", pg_server]
    code, stdout, stderr = run_cli(
        capsys, *argv, "--redis", redis_server, "--out", str(out), "--json"
    )
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["only"] == section and set(report["raw"]) == raw
    assert [k for k in report if k in HEADLINES] == list(headlines)
    for name in headlines:
        assert report[name]["median"] is not None or report[name].get("why"), name
    markdown = (out / "bench.md").read_text()
    assert all(f"| {name}" in markdown for name in headlines)
    assert not (out / "bench.png").exists()
