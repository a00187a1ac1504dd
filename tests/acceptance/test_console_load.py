"""Load on the console (marker ``large``): 50 concurrent clients read the inbox and call pages
of a ledger of 100,000 calls for 30 s, against a real ``toolledger serve`` on loopback.

No request may fail. Latency is reported (README, "Console and HTTP API"), never asserted:
the machines are shared and noisy."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from toolledger.harness import console_load

pytestmark = pytest.mark.large


def test_console_under_load__no_errors(pg_url: str, tmp_path: Path) -> None:
    report = console_load.run(pg_url, tmp_path / "serve", calls=100_000, clients=50, duration=30)
    print(report.line())
    out = Path(__file__).resolve().parents[2] / ".toolledger" / "console-load.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(asdict(report), indent=2))
    assert report.requests > 0 and report.errors == 0, report.line()
