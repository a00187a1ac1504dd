"""The beat's scrape (``read_on_collect``) does not wait past ``SCRAPE_WAIT_SECONDS`` for a
read of the ledger's state that hangs (a frozen database: 20 s and more were seen behind a
stopped proxy, past Prometheus's 10 s scrape timeout, the target down for that scrape): it is
served the values last read, whose timestamp says how old they are."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from toolledger.observability import metrics


def test_a_scrape_does_not_wait_for_a_hung_read(monkeypatch: pytest.MonkeyPatch) -> None:
    frozen = threading.Event()
    reads: list[str] = []

    def state_counts(ledger: Any) -> dict[str, dict[str, float]]:
        reads.append("read")
        if len(reads) > 1:
            frozen.wait(120)  # the database froze after the first read
        return {"calls": {"running": 1.0}, "inbox": {}, "oldest": {}, "approved": {}, "since": {}}

    def scrape() -> dict[str, float]:
        return {f.name: f.samples[0].value for f in collector.collect() if f.samples}

    monkeypatch.setattr(metrics, "state_counts", state_counts)
    monkeypatch.setattr(metrics, "SCRAPE_WAIT_SECONDS", 0.5)
    collector = metrics.LedgerStateCollector(object(), ttl=0)  # type: ignore[arg-type]
    try:
        first = scrape()
        assert first["toolledger_ledger_state_up"] == 1.0
        served: list[dict[str, float]] = []
        scraping = threading.Thread(
            target=lambda: served.append(scrape()),
            daemon=True,
        )
        scraping.start()
        scraping.join(timeout=30)  # the wait is 0.5 s; 30 for a loaded machine
        assert not scraping.is_alive(), "the scrape waits for the hung read"
        assert len(reads) == 2
        # the values last read, their time unchanged: the alert on its age sees it stop
        stamp = "toolledger_ledger_state_timestamp_seconds"
        assert served[0][stamp] == first[stamp]
    finally:
        frozen.set()
