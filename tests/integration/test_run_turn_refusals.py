"""A turn refused for one of its calls records none of them; a turn of two formats is
refused. Nothing runs in these tests, so no worker: the ledger on each backend is enough."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.test_client import openai_turn, responses_turn
from toolledger import Client
from toolledger.config import Settings
from toolledger.ledger.errors import InputError, LedgerError, NotFound


@pytest.fixture
def client(db_url: str, tmp_path: Path) -> Iterator[Client]:
    settings = Settings.from_env(
        {"TOOLLEDGER_DB": db_url, "TOOLLEDGER_HOME": str(tmp_path / "home"),
         "TOOLLEDGER_SANDBOX": str(tmp_path / "sandbox"),
         "TOOLLEDGER_BROKER": "redis://127.0.0.1:1/0"}  # no worker: nothing may be enqueued
    )  # fmt: skip
    with Client(settings) as c:
        yield c


@pytest.mark.parametrize(
    "bad",
    [
        {"function": {"name": "write_file", "arguments": "[1, 2]"}},  # not a JSON object
        {"function": {"name": "no_such_tool", "arguments": "{}"}},
        {"function": {"name": "write_file", "arguments": '{"path": "../x", "content": "x"}'}},
        # the id of a call already recorded, with other arguments (a ConflictError)
        {"function": {"name": "write_file", "arguments": '{"path": "other", "content": "y"}'}},
    ],
)
def test_run_turn__a_turn_refused_for_one_call_records_none(
    client: Client, scope: str, bad: dict[str, Any]
) -> None:
    turn = openai_turn(2, "refused")
    turn["tool_calls"][1] = {"id": "refused_1", "type": "function", **bad}
    first = openai_turn(2, "refused")["tool_calls"][1]["function"]  # recorded before, as the
    client.submit(scope, "refused_1", "write_file", json.loads(first["arguments"]))  # turn had it
    asked: list[str] = []

    def policy(_tool: str, call_id: str, _args: Any) -> str:
        asked.append(call_id)
        return "policy"

    with pytest.raises(LedgerError):
        client.run_turn(scope, turn, approve=policy, timeout=5)
    assert asked == []  # refused before anyone was asked
    with pytest.raises(NotFound):
        client.ledger.get(scope, "refused_0")  # the first call, valid, recorded neither


def test_run_turn__a_turn_of_two_formats_is_refused(client: Client, scope: str) -> None:
    """A Responses item and a chat message in one list: reading one format would pass over
    the other's calls without a word."""
    mixed = [*responses_turn(1, "mix_r"), openai_turn(1, "mix_c")]
    with pytest.raises(LedgerError, match="one format"):
        client.run_turn(scope, mixed, approve=lambda *_: "policy", timeout=5)
    for call in ("mix_r_0", "mix_c_0"):
        with pytest.raises(NotFound):
            client.ledger.get(scope, call)


def test_run_turn__each_call_is_checked_once(
    client: Client, scope: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn's check of every call is the check its submit uses: prepared once per call."""
    submitter = client._submitter
    prepared: list[str] = []
    real = submitter.prepare

    def counted(scope: str, tool_call_id: str, *rest: Any) -> Any:
        prepared.append(tool_call_id)
        return real(scope, tool_call_id, *rest)

    monkeypatch.setattr(submitter, "prepare", counted)
    with pytest.raises(TimeoutError):  # CallsWaiting: nobody approved them
        client.run_turn(scope, openai_turn(3, "once"), timeout=0)
    assert prepared == ["once_0", "once_1", "once_2"]
    assert [client.status(scope, f"once_{i}") for i in range(3)] == ["pending_approval"] * 3


def test_run_turn__arguments_changed_after_their_check_are_never_recorded(
    client: Client, scope: str
) -> None:
    """The approval policy was handed the very arguments the check had passed, and the turn
    recorded them as they were after it: a policy that changed them recorded a path escape
    and a field the schema refuses (a cold review's repro)."""

    def meddling(_tool: str, _call_id: str, args: dict[str, Any]) -> None:
        args["path"], args["extra"] = "../escape.txt", 1

    with pytest.raises(TimeoutError):  # nobody approved it: it waits, as it was checked
        client.run_turn(scope, openai_turn(1, "meddled"), approve=meddling, timeout=0)
    args = client.ledger.get(scope, "meddled_0").operation.args
    assert args["path"] != "../escape.txt" and "extra" not in args
    checked = client.check(scope, "changed", "write_file", {"path": "a.txt", "content": "x"})
    checked.args["path"] = "../escape.txt"  # changed after its check: refused, not recorded
    with pytest.raises(InputError, match="changed after"):
        client.submit_checked(checked)
    with pytest.raises(NotFound):
        client.ledger.get(scope, "changed")
