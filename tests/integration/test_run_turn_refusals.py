"""A turn refused for one of its calls records none of them; a turn of two formats is
refused. Nothing runs in these tests, so no worker: the ledger on each backend is enough."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.test_client import openai_turn, responses_turn
from toolledger import AsyncClient, Client
from toolledger.config import Settings
from toolledger.ledger.errors import InputError, LedgerError, NotFound
from toolledger.ledger.transitions import Status
from toolledger.recovery.transcript import repair_transcript
from toolledger.sandbox import HardLinkRefused
from toolledger.tools import UnknownTool


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


def test_run_turn__an_sdk_object_is_told_to_be_a_dict(client: Client, scope: str) -> None:
    """An OpenAI SDK ``ChatCompletionMessage`` passed as it is was refused as "the message
    holds no tool call", which it did (a cold review)."""
    from openai.types.chat import ChatCompletionMessage

    reply = ChatCompletionMessage.model_validate(openai_turn(1, "sdk"))
    with pytest.raises(LedgerError, match=r"item 1 is a ChatCompletionMessage, not a dict: .*"
                       r"\.model_dump\(\)"):  # fmt: skip
        client.run_turn(scope, reply, approve=lambda *_: "policy", timeout=5)  # type: ignore[arg-type]
    with pytest.raises(NotFound):
        client.ledger.get(scope, "sdk_0")


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


# ------------------------------------------------ replays where a check would refuse now


def _succeeded(client: Client, scope: str, cid: str, tool: str, args: dict[str, Any]) -> Any:
    """A call recorded and run to success (by hand: no worker here), as a worker would."""
    ledger = client.ledger
    ledger.submit(scope, cid, tool, args, approved_by="al")
    claim = ledger.claim(scope, f"{tool}:{cid}", 1, worker_id="w")
    assert claim is not None
    ledger.finish(claim.execution_id, claim.lease_token, Status.SUCCEEDED, {"done": cid})
    return client.receipt(scope, cid)


def _turn(cid: str, tool: str, arguments: str) -> dict[str, Any]:
    call = {"id": cid, "type": "function", "function": {"name": tool, "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _answer(turn_items: list[dict[str, Any]]) -> Any:
    (item,) = turn_items
    return json.loads(item["content"])


def test_run_turn__a_recorded_call_a_check_would_refuse_now_is_replayed(
    client: Client, scope: str
) -> None:
    """The same call asked again after it ran is a replay, whatever the tool's checks say of
    the sandbox or the registry now: the submit checked the tool's schema and paths before it
    looked in the ledger, so a file hard-linked since (an operator's backup), a tool gone from
    this process's registry or a schema since narrowed turned the receipt into an error: the
    model was told a call that took effect had failed. A new call is still refused."""
    args = {"path": "log.txt", "content": "line\n"}
    _succeeded(client, scope, "ap1", "append_file", args)
    folder = Path(client.settings.sandbox) / scope
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "log.txt").write_text("line\n")
    os.link(folder / "log.txt", folder / "backup-log.txt")
    _succeeded(client, scope, "gone1", "gone_tool", {})  # a tool no longer registered here
    _succeeded(client, scope, "old1", "write_file", {"path": "a.txt"})  # no content: old schema

    turn = _turn("ap1", "append_file", json.dumps(args))
    assert _answer(client.run_turn(scope, turn, approve=lambda *_: "policy")) == {"done": "ap1"}
    for cid, tool, given in [("gone1", "gone_tool", {}), ("old1", "write_file", {"path": "a.txt"})]:
        assert _answer(client.run_turn(scope, _turn(cid, tool, json.dumps(given)))) == {"done": cid}
        again = client.submit(scope, cid, tool, given, approved_by="al")
        assert (again.status, again.submitted["outcome"]) == ("succeeded", "existing")
    assert client.check(scope, "ap1", "append_file", args).tool_call_id == "ap1"

    for cid, tool, given, refused in [  # new calls: the checks stand, nothing recorded
        ("ap2", "append_file", args, HardLinkRefused),
        ("gone2", "gone_tool", {}, UnknownTool),
        ("old2", "write_file", {"path": "a.txt"}, InputError),
        ("ap1", "append_file", {**args, "content": "other\n"}, HardLinkRefused),  # other args
    ]:
        with pytest.raises(refused):
            client.run_turn(scope, _turn(cid, tool, json.dumps(given)), approve=lambda *_: "p")
        if cid != "ap1":
            with pytest.raises(NotFound):
                client.ledger.get(scope, cid)
    assert client.ledger.get(scope, "ap1").operation.args == args


@pytest.mark.parametrize("bad", ["bad\x07name", "", "   ", 7, "x" * 257])
def test_run_turn__an_approver_the_ledger_refuses_records_no_call_of_the_turn(
    client: Client, scope: str, bad: Any
) -> None:
    """The policy's answer for the second call was checked only at its own submit: the
    first call was recorded, approved and run, then the turn raised."""
    turn = openai_turn(2, "appr")

    def policy(_tool: str, call_id: str, _args: Any) -> Any:
        return "policy" if call_id == "appr_0" else bad

    async def policy_async(tool: str, call_id: str, args: Any) -> Any:
        return policy(tool, call_id, args)

    with pytest.raises(InputError, match="approver of call 'appr_1'"):
        client.run_turn(scope, turn, approve=policy, timeout=5)
    async_client = AsyncClient(client.settings)
    try:
        with pytest.raises(InputError, match="approver of call 'appr_1'"):
            asyncio.run(async_client.run_turn(scope, turn, approve=policy_async, timeout=5))
    finally:
        asyncio.run(async_client.close())
    for cid in ("appr_0", "appr_1"):
        with pytest.raises(NotFound):
            client.ledger.get(scope, cid)


@pytest.mark.parametrize("blank", ["", "  ", "\n"])
def test_run_turn_and_repair__read_blank_arguments_alike(
    client: Client, scope: str, blank: str
) -> None:
    """Models send "" for a tool without parameters; run_turn read it as {} and repair
    refused the same transcript (exit 6: not valid JSON), so a crashed agent's turn could not
    be repaired from the ledger that answered it."""
    _succeeded(client, scope, "nop1", "gone_tool", {})
    turn = _turn("nop1", "gone_tool", blank)
    assert _answer(client.run_turn(scope, turn)) == {"done": "nop1"}
    transcript = json.dumps([{"role": "user", "content": "go"}, turn])
    report = repair_transcript(transcript.encode(), client.ledger, scope)
    repaired = json.loads(report.text)
    assert len(report.inserted) == 1 and repaired[-1]["tool_call_id"] == "nop1"
    assert json.loads(repaired[-1]["content"]) == {"done": "nop1"}


def test_run_turn__a_read_only_calls_approver_is_not_checked(client: Client, scope: str) -> None:
    """A read-only call is not recorded and takes no approver: the turn's check of the
    policy's answers refused a turn over a name no call would use (submit takes it)."""
    folder = Path(client.settings.sandbox) / scope
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "r.txt").write_text("read me")
    turn = _turn("r1", "read_file", json.dumps({"path": "r.txt"}))
    (item,) = client.run_turn(scope, turn, approve=lambda *_: "")
    assert item["tool_call_id"] == "r1" and "read me" in item["content"]


def test_submit__a_read_under_an_id_recorded_for_another_call_is_a_conflict(
    client: Client, scope: str
) -> None:
    """A read-only call records nothing, but its tool_call_id may be taken: a read under the
    id of a recorded write ran and answered for it (exit 0), where a write under it was
    refused (a cold review). Refused as a conflict, and the read never runs."""
    from toolledger.ledger.errors import ConflictError

    folder = Path(client.settings.sandbox) / scope
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "r.txt").write_text("read me")
    client.submit(scope, "taken", "write_file", {"path": "w.txt", "content": "x"})
    with pytest.raises(ConflictError):
        client.submit(scope, "taken", "read_file", {"path": "r.txt"})
    # its key, named on purpose, recorded for another action: the same conflict
    with pytest.raises(ConflictError):
        client.submit(scope, "free", "read_file", {"path": "r.txt"}, key="write_file:taken")
    answered = client.submit(scope, "free", "read_file", {"path": "r.txt"})  # a new id: runs
    assert answered.status == "succeeded"


def test_run_turn__a_call_answered_among_the_items_given_is_not_answered_again(
    client: Client, scope: str
) -> None:
    """A Responses turn passed with the output of one of its calls: that call is answered
    already, and is neither submitted nor answered again (it was answered a second time, and
    the transcript then held two results for it: a cold review); the others are."""
    from toolledger.turns import CallsWaiting

    first, second = responses_turn(2, "given")
    done = {"type": "function_call_output", "call_id": "given_0", "output": "already here"}
    assert client.run_turn(scope, [first, done], approve=lambda *_: "policy", timeout=1) == []
    with pytest.raises(CallsWaiting) as waiting:  # no worker: the other call has no receipt
        client.run_turn(scope, [first, done, second], approve=lambda *_: "policy", timeout=1)
    assert list(waiting.value.waiting) == ["given_1"]
    with pytest.raises(NotFound):
        client.ledger.get(scope, "given_0")
    chat = openai_turn(1, "chat")
    answer = {"role": "tool", "tool_call_id": "chat_0", "content": "already"}
    assert client.run_turn(scope, [chat, answer], timeout=1) == []

    async def in_async() -> list[dict[str, Any]]:
        async with AsyncClient(client.settings) as aclient:
            return await aclient.run_turn(scope, [first, done], timeout=1)

    assert asyncio.run(in_async()) == []


def test_run_turn__an_approval_not_applied_to_a_waiting_call_is_said(
    client: Client, scope: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Run again with a policy that now approves a call already waiting for a person, the
    approval is not applied (the person decides) and run_turn waited its timeout out in
    silence (a cold review): it says so, sync and async."""
    from toolledger.turns import CallsWaiting

    turn = openai_turn(1, "waits")
    with pytest.raises(CallsWaiting):
        client.run_turn(scope, turn, approve=lambda *_: None, timeout=0)
    with caplog.at_level("WARNING", logger="toolledger.client"):
        with pytest.raises(CallsWaiting):
            client.run_turn(scope, turn, approve=lambda *_: "policy", timeout=0)

        async def again() -> None:
            async with AsyncClient(client.settings) as aclient:
                await aclient.run_turn(scope, turn, approve=lambda *_: "policy", timeout=0)

        with pytest.raises(CallsWaiting):
            asyncio.run(again())
    said = [r.getMessage() for r in caplog.records if "was not applied" in r.getMessage()]
    assert len(said) == 2 and said[0].startswith(f"{scope}/waits_0: the call already exists")
    assert client.ledger.get(scope, "waits_0").operation.status is Status.PENDING_APPROVAL


def test_run_turn__a_record_the_ledger_calls_corrupt_is_raised_not_said_unanswered(
    client: Client, scope: str
) -> None:
    """A wait that met a record the ledger calls corrupt: said "unanswered" (the database did
    not answer), it was reported so for ever, and the turn's other calls with it (a cold
    review of the day's diff). The ledger's error is raised as it is."""
    from toolledger.ledger.errors import CorruptRecord

    wait = client.wait

    def corrupt(scope_: str, tool_call_id: str, **kwargs: Any) -> Any:
        if tool_call_id == "k_0":
            raise CorruptRecord("a terminal status without a result")
        return wait(scope_, tool_call_id, **kwargs)

    client.wait = corrupt  # type: ignore[method-assign]
    with pytest.raises(CorruptRecord):
        client.run_turn(scope, openai_turn(2, "k"), timeout=0.2)
