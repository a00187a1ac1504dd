"""The alert rules and the Prometheus config in deploy/prometheus/: ``promtool check rules``
and ``promtool check config`` pass, and ``promtool test rules`` shows each alert firing on
series made to fire it and silent on series that must not (deploy/prometheus/alerts.test.yml).
Without promtool (Debian's ``prometheus`` package): a schema check of the same files, itself
shown failing on broken rules. Under CI=true a missing promtool is a failure."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
ALERTS = DEPLOY / "alerts.yml"
CI = os.environ.get("CI", "").lower() == "true"
EXPECTED = {
    "ToolledgerInboxNotEmpty",
    "ToolledgerCallWaitingLong",
    "ToolledgerLeaseExpirationsRising",
    "ToolledgerSweepStalled",
    "ToolledgerLedgerUnreadable",
    "ToolledgerNoWorkerClaims",
    "ToolledgerApprovedCallWaitingLong",
    "ToolledgerRunningPastLease",
    "ToolledgerEffectsNotLanding",
}


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        message = "promtool is not installed (apt-get install prometheus)"
        if CI:
            pytest.fail(f"{message}; under CI=true that is a failure", pytrace=False)
        pytest.skip(f"{message}; the schema check still runs")
    return found


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=DEPLOY)


def schema_errors(doc: Any) -> list[str]:
    """What makes ``doc`` not a Prometheus rules file (the fields promtool requires)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("groups"), list):
        return ["top level: a mapping with a list 'groups'"]
    errors = []
    for g in doc["groups"]:
        if not isinstance(g, dict) or not g.get("name") or not isinstance(g.get("rules"), list):
            errors.append(f"group {g!r}: needs name and rules")
            continue
        for r in g["rules"]:
            name = r.get("alert") or r.get("record")
            if not name or not isinstance(r.get("expr"), str) or not r["expr"].strip():
                errors.append(f"rule {name!r}: needs alert (or record) and a non-empty expr")
            if "for" in r and not str(r["for"]).rstrip("smhdwy").isdigit():
                errors.append(f"rule {name!r}: 'for' is not a duration")
            extra = set(r) - {"alert", "record", "expr", "for", "labels", "annotations"}
            if extra:
                errors.append(f"rule {name!r}: unknown fields {sorted(extra)}")
    return errors


def alerts() -> set[str]:
    doc = yaml.safe_load(ALERTS.read_text())
    return {r["alert"] for g in doc["groups"] for r in g["rules"] if "alert" in r}


def test_alert_rules__schema_and_the_nine_alerts():
    assert schema_errors(yaml.safe_load(ALERTS.read_text())) == []
    assert alerts() == EXPECTED


@pytest.mark.parametrize(
    "broken",
    [
        {"rules": []},
        {"groups": [{"name": "x", "rules": [{"alert": "A"}]}]},
        {"groups": [{"name": "x", "rules": [{"alert": "A", "expr": "up", "for": "ten"}]}]},
        {"groups": [{"name": "x", "rules": [{"alert": "A", "expr": "up", "fro": "1m"}]}]},
    ],
)
def test_schema_check__fails_on_broken_rules(broken):
    assert schema_errors(broken)


def test_promtool__check_rules_and_config():
    tool = promtool()
    checked = run(tool, "check", "rules", "alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 9 rules found" in checked.stdout
    config = run(tool, "check", "config", "prometheus.yml")
    assert config.returncode == 0, config.stdout + config.stderr


def test_promtool__each_alert_fires_when_it_must_and_only_then():
    tested = run(promtool(), "test", "rules", "alerts.test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    text = (DEPLOY / "alerts.test.yml").read_text()
    for name in EXPECTED:
        assert f"alertname: {name}" in text, name  # every alert is unit-tested


def test_promtool__fails_on_a_rule_that_does_not_parse(tmp_path):
    tool = promtool()
    bad = tmp_path / "bad.yml"
    bad.write_text("groups:\n  - name: x\n    rules:\n      - alert: A\n        expr: 'sum(('\n")
    assert run(tool, "check", "rules", str(bad)).returncode != 0


def test_prometheus__scrapes_every_compose_service_that_serves_metrics():
    """Each service of docker-compose.yml that runs a worker or the beat (the processes that
    serve /metrics on their own port) is a scrape target. The sweeper was not, and it is the
    only one that exports the last successful sweep: ToolledgerSweepStalled fired on a
    healthy stack (a cold review)."""
    compose = yaml.safe_load((DEPLOY.parents[1] / "docker-compose.yml").read_text())
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    scraped: set[str] = set()
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            scraped.update(sd["names"])
        for static in job.get("static_configs", []):
            scraped.update(t.split(":")[0] for t in static["targets"])
    serving = {
        name
        for name, service in compose["services"].items()
        if (service.get("command") or [None])[0] in ("worker", "beat", "serve")
    }
    assert {"worker", "sweeper", "beat"} <= serving  # the stack's shape this test reads
    assert serving <= scraped, f"not scraped: {sorted(serving - scraped)}"
