""" "No bending" (issue 18): the bench refuses to measure with fsync or synchronous commit off,
on the server, for a database, or through ``PGOPTIONS`` (which reaches the baselines' and the
peers' plain connections); and the report records what both sides saw. Since 12-06 every
ledger session turns ``synchronous_commit`` off into on (``lightreads.pg_session_settings``):
toolledger's side is never bent by it, the baselines' still are, and the bench still refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.conftest import fresh_pg_database
from tests.helpers import run_cli
from toolledger.harness.bench import common
from toolledger.harness.bench.common import Bent, durability
from toolledger.ledger.db import create_engine

pytestmark = pytest.mark.postgres

ON = {"fsync": "on", "synchronous_commit": "on"}


def test_durability__both_sides_on_are_recorded(pg_server: str) -> None:
    assert durability(pg_server) == {"toolledger": ON, "baselines": ON}


def test_durability__pgoptions_bends_the_baselines_and_is_refused(
    pg_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGOPTIONS", "-c synchronous_commit=off")
    with pytest.raises(Bent, match=r"synchronous_commit=off \(baselines\)") as refused:
        durability(pg_server)
    assert "(toolledger)" not in str(refused.value)  # its sessions turn it on


def test_durability__a_database_set_asynchronous_is_refused(
    pg_server: str, pg_template: str
) -> None:
    with fresh_pg_database(pg_server, pg_template) as url:
        engine = create_engine(url)
        name = engine.url.database
        with engine.begin() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" SET synchronous_commit = off'))
        engine.dispose()
        with pytest.raises(Bent) as refused:
            durability(url)
        said = str(refused.value)
        assert "synchronous_commit=off (baselines)" in said
        assert "(toolledger)" not in said  # its sessions turn it on


def test_bench__refuses_before_measuring_exit_2(
    pg_server: str, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGOPTIONS", "-c synchronous_commit=off")
    out = tmp_path / "out"
    argv = ["bench", "--only", "cli_start", "--quick", "--rounds", "1", "--pg", pg_server]
    code, _, err = run_cli(capsys, *argv, "--out", str(out))
    assert code == 2 and "refused to measure with synchronous_commit=off" in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()  # nothing measured, nothing written


def test_durability__every_scratch_database_is_checked_where_it_is_measured(
    pg_server: str, pg_template: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The measurements run in scratch databases, not in the one ``--pg`` names: a setting
    that reaches only them (a role's, for some databases) must be caught there too."""
    import contextlib

    with fresh_pg_database(pg_server, pg_template) as url:
        engine = create_engine(url)
        with engine.begin() as conn:
            name = engine.url.database
            conn.execute(sa.text(f'ALTER DATABASE "{name}" SET synchronous_commit = off'))
        engine.dispose()
        monkeypatch.setattr(common, "scratch_database", lambda *a, **k: contextlib.nullcontext(url))
        checked = common.scratch_postgres(pg_server, "checked")
        with pytest.raises(Bent, match="synchronous_commit=off"), checked:
            pass
