"""``toolledger bench --only cli_start``: the CLI's cold start, alone, in seconds. No speed is
asserted (the report says whether the goal was met); only that every figure is there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_cli


def cli_start(capsys: Any, out: Path, pg: str) -> dict[str, Any]:
    argv = ["bench", "--only", "cli_start", "--quick", "--rounds", "1", "--pg", pg]
    code, stdout, stderr = run_cli(capsys, *argv, "--out", str(out), "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["only"] == "cli_start" and "raw" not in report
    assert (out / "bench.json").stat().st_size > 0 and (out / "bench.md").stat().st_size > 0
    assert not (out / "bench.png").exists()
    section = report["cli_start"]
    assert section["goal_seconds"] == 0.25 and section["python_pass"]["median"] > 0
    for name, figure in section["commands"].items():
        assert figure["median"] > 0 and figure["met"] in (True, False), name
    return dict(section)


def test_bench_cli_start__embedded_alone(tmp_path: Path, capsys: Any) -> None:
    section = cli_start(capsys, tmp_path / "bench", "")
    assert list(section["commands"]) == ["help", "show_embedded"]


@pytest.mark.postgres
def test_bench_cli_start__postgres_too(pg_server: str, tmp_path: Path, capsys: Any) -> None:
    section = cli_start(capsys, tmp_path / "bench", pg_server)
    assert list(section["commands"]) == ["help", "show_embedded", "show_postgres"]
