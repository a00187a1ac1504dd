"""The bench report's "what is left" figures are arithmetic on the rounds: held to it here."""

from __future__ import annotations

from toolledger.harness.bench.common import CPU_PARTS, Figures
from toolledger.harness.bench.report import markdown
from toolledger.harness.bench.runner import _e2e_gaps


def _figures() -> Figures:
    f = Figures()
    for r, (ours, peer) in enumerate([(3.0, 1.0), (4.0, 1.5), (2.5, 2.0)]):
        for i, part in enumerate(CPU_PARTS):
            f.add(f"e2e/toolledger_threads/cpu_{part}", ours + i)
            f.add(f"e2e/procrastinate/cpu_{part}", peer)
            f.add(f"e2e/toolledger/cpu_{part}", ours)
            f.add(f"e2e/celery_write/cpu_{part}", peer + r)
        f.add("e2e/toolledger_threads/cpu_ms_per_call", 10.0 + r)
        f.add("e2e/procrastinate/cpu_ms_per_call", 8.0)
        f.add("e2e/toolledger/cpu_ms_per_call", 9.0)
        f.add("e2e/celery_write/cpu_ms_per_call", 3.0 * (r + 1))
    return f


def test_gaps_are_differences_taken_round_by_round_then_their_median():
    gaps = _e2e_gaps(_figures(), {})
    threads = gaps["toolledger_threads - procrastinate"]
    assert list(threads) == [*CPU_PARTS, "total"]
    # rounds: 3-1, 4-1.5, 2.5-2 → 2, 2.5, 0.5: median 2 (not 3.17 - 1.5 of the medians)
    assert threads["producer"] == {"median": 2.0, "min": 0.5, "max": 2.5, "rounds": 3}
    assert threads["workers"]["median"] == 3.0  # + 1 for the second part, every round
    assert threads["total"] == {"median": 3.0, "min": 2.0, "max": 4.0, "rounds": 3}
    # the peer's own rounds matter: 3-1, 4-2.5, 2.5-4 → 2, 1.5, -1.5
    plain = gaps["toolledger - celery_write"]
    assert plain["producer"] == {"median": 1.5, "min": -1.5, "max": 2.0, "rounds": 3}
    assert plain["total"] == {"median": 3.0, "min": 0.0, "max": 6.0, "rounds": 3}


def test_a_peer_that_did_not_run_has_no_gap_row_and_the_report_says_the_rest():
    gaps = _e2e_gaps(_figures(), {"procrastinate": "not installed"})
    assert list(gaps) == ["toolledger - celery_write"]
    text = markdown({"raw": {"e2e_cpu_over_peers": gaps}})
    assert "| toolledger - celery_write | 1.5 (-1.5-2.0) |" in text
    assert "procrastinate" not in text


def test_published_report__is_what_the_report_code_renders_from_its_json():
    """docs/bench/bench.md is bench.json rendered: none of its figures typed by hand, and none
    of its rows lost reading the JSON back (two were: the process counts became strings)."""
    import json
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs" / "bench"
    rendered = markdown(json.loads((docs / "bench.json").read_text()))
    assert rendered == (docs / "bench.md").read_text()
    assert "against the loop in turn too" in rendered  # a row read at "4", not 4
    production = markdown(json.loads((docs / "e2e-production.json").read_text()))
    assert production == (docs / "e2e-production.md").read_text()
    assert "| production_vs_procrastinate (production configuration" in production
