"""Transcript repair: a result counts only where the provider's API looks for it, and a
transcript is read in one format, whatever ``--format`` says (both found by a cold review).

A result out of place, a second result for one call, or a result for no call used to count
as an answer: repair exited 0 and left a transcript the API refuses (a chat ``tool`` message
after a later user message, an Anthropic ``tool_result`` before its ``tool_use``). And
``--format`` skipped detection, so a mixed transcript had one format's calls passed over.
Each is refused now: exit 6, one line naming the place, the file untouched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_cli
from tests.unit.repair_support import (
    answered_ids,
    as_json,
    as_jsonl,
    call,
    calls_items,
    items_of,
    known_ledger,
    only_insertions,
    results_items,
)
from toolledger.ledger.errors import InputError
from toolledger.ledger.ledger import Ledger
from toolledger.recovery.transcript import repair_file

SCOPE = "placement"
USER = {"role": "user", "content": "go"}


@pytest.fixture(scope="module")
def ledger(sqlite_url: str) -> Iterator[Ledger]:
    yield from known_ledger(sqlite_url, SCOPE)


def calls(fmt: str, *cids: str) -> list[dict[str, Any]]:
    return calls_items(fmt, [call(c) for c in cids])


def results(fmt: str, *cids: str) -> list[dict[str, Any]]:
    return results_items(fmt, [(c, "done") for c in cids])


def an_turn(*blocks: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


def an_result(cid: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": cid, "content": "done"}


TEXT = {"type": "text", "text": "and then"}

# (id, bytes, a regular expression its one-line refusal matches)
MISPLACED: list[tuple[str, bytes, str]] = [
    # OpenAI chat: the run of tool messages right after the assistant message of the call
    (
        "chat-result-after-a-later-user-message",
        as_json(
            "openai",
            [USER, *calls("openai", "call_ok", "call_ok2"), USER, *results("openai", "call_ok")],
        ),
        r"message 4: the result for tool_call_id 'call_ok' is out of place: .*"
        r"\(its call: message 2 tool_calls\[0\]\)",
    ),
    (
        "chat-result-in-a-later-turns-run",
        as_json(
            "openai",
            [
                *calls("openai", "call_ok"),
                USER,
                *calls("openai", "call_ok2"),
                *results("openai", "call_ok2", "call_ok"),
            ],
        ),
        "message 5: the result for tool_call_id 'call_ok' is out of place",
    ),
    (
        "chat-result-before-its-call",
        as_json("openai", [USER, *results("openai", "call_ok"), *calls("openai", "call_ok")]),
        "message 2: the result for tool_call_id 'call_ok' is out of place",
    ),
    (
        "chat-second-result",
        as_json("openai", [*calls("openai", "call_ok"), *results("openai", "call_ok", "call_ok")]),
        "message 3: a second result for tool_call_id 'call_ok' \\(the first: message 2\\)",
    ),
    (
        "chat-result-for-no-call",
        as_json("openai", [*calls("openai", "call_ok"), *results("openai", "call_ok", "nobody")]),
        "message 3: a result for tool_call_id 'nobody', which no call has",
    ),
    (
        "chat-result-for-no-call-jsonl",
        as_jsonl([USER, *results("openai", "nobody"), *calls("openai", "call_ok")]),
        "line 2: a result for tool_call_id 'nobody', which no call has",
    ),
    # Anthropic: the leading tool_result blocks of the user turn right after the call's turn
    (
        "anthropic-result-before-its-tool-use",
        as_json(
            "anthropic",
            [
                *calls("anthropic", "call_ok"),
                an_turn(an_result("call_ok2")),
                *calls("anthropic", "call_ok2"),
            ],
        ),
        r"message 2 content\[0\]: the result for tool_call_id 'call_ok2' is out of place",
    ),
    (
        "anthropic-result-a-turn-late",
        as_json(
            "anthropic",
            [
                *calls("anthropic", "call_ok"),
                an_turn(TEXT),
                {"role": "assistant", "content": "ok"},
                an_turn(an_result("call_ok")),
            ],
        ),
        r"message 4 content\[0\]: the result for tool_call_id 'call_ok' is out of place",
    ),
    (
        "anthropic-result-after-text",
        as_json("anthropic", [*calls("anthropic", "call_ok"), an_turn(TEXT, an_result("call_ok"))]),
        r"message 2 content\[1\]: the result for tool_call_id 'call_ok' is out of place",
    ),
    (
        # a user item whose content is text is a text block of the combined turn: the
        # results after it do not open the turn (they counted, and a result inserted for
        # call_ok2 landed before the text, leaving call_ok's after it: exit 0, a transcript
        # the API refuses, a cold review)
        "anthropic-result-after-a-text-item-of-the-same-turn",
        as_json(
            "anthropic",
            [
                *calls("anthropic", "call_ok", "call_ok2"),
                {"role": "user", "content": "and then"},
                an_turn(an_result("call_ok")),
            ],
        ),
        r"message 3 content\[0\]: the result for tool_call_id 'call_ok' is out of place",
    ),
    (
        "anthropic-second-result",
        as_json(
            "anthropic",
            [*calls("anthropic", "call_ok"), an_turn(an_result("call_ok"), an_result("call_ok"))],
        ),
        r"message 2 content\[1\]: a second result for tool_call_id 'call_ok'",
    ),
    (
        "anthropic-result-for-no-call",
        as_json(
            "anthropic",
            [*calls("anthropic", "call_ok"), an_turn(an_result("call_ok"), an_result("x"))],
        ),
        r"message 2 content\[1\]: a result for tool_call_id 'x', which no call has",
    ),
    # Responses: a function_call_output after its function_call
    (
        "responses-output-before-its-call",
        as_json("responses", [*results("responses", "call_ok"), *calls("responses", "call_ok")]),
        "message 1: the result for tool_call_id 'call_ok' is out of place",
    ),
    (
        "responses-second-output",
        as_json(
            "responses",
            [
                *calls("responses", "call_ok"),
                *results("responses", "call_ok"),
                USER,
                *results("responses", "call_ok"),
            ],
        ),
        "message 4: a second result for tool_call_id 'call_ok'",
    ),
]


def refused(tmp_path: Path, ledger: Ledger, data: bytes, fmt: str | None = None) -> str:
    path = tmp_path / "t.json"
    path.write_bytes(data)
    with pytest.raises(InputError) as err:
        repair_file(path, ledger, SCOPE, fmt)
    assert path.read_bytes() == data
    assert list(tmp_path.iterdir()) == [path]
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    return message


def cli(capsys: Any, url: str, path: Path, *args: str) -> tuple[int, str, str]:
    return run_cli(capsys, "--db", url, "repair", str(path), "--scope", SCOPE, *args)


@pytest.mark.parametrize(
    ("data", "match"), [c[1:] for c in MISPLACED], ids=[c[0] for c in MISPLACED]
)
def test_misplaced_result__refused_in_one_line(ledger, tmp_path, data, match):
    message = refused(tmp_path, ledger, data)
    assert re.search(match, message), message


@pytest.mark.parametrize("data", [c[1] for c in MISPLACED], ids=[c[0] for c in MISPLACED])
def test_misplaced_result_cli__exit_6(capsys, sqlite_url, ledger, tmp_path, data):
    path = tmp_path / "t.json"
    path.write_bytes(data)
    code, out, err = cli(capsys, sqlite_url, path)
    assert (code, out) == (6, "") and err.count("\n") == 1, err
    assert path.read_bytes() == data


# Where results belong, as the API reads them: accepted, repaired once and for good.
PLACED: list[tuple[str, str, list[Any], list[str]]] = [
    (
        "chat-run-after-the-call",
        "openai",
        [USER, *calls("openai", "call_ok", "call_ok2"), *results("openai", "call_ok"), USER],
        ["call_ok", "call_ok2"],
    ),
    (
        "anthropic-results-then-text",
        "anthropic",
        [*calls("anthropic", "call_ok", "call_ok2"), an_turn(an_result("call_ok"), TEXT)],
        ["call_ok", "call_ok2"],
    ),
    (
        "responses-output-later-than-the-next-call",
        "responses",
        [*calls("responses", "call_ok", "call_ok2"), USER, *results("responses", "call_ok2")],
        ["call_ok", "call_ok2"],
    ),
    # The API combines consecutive turns of one role: an assistant's calls in two items, and
    # their results in two user items, are one turn each (a cold review: refused as misplaced)
    (
        "anthropic-calls-in-two-assistant-items",
        "anthropic",
        [*calls("anthropic", "call_ok"), *calls("anthropic", "call_ok2"),
         an_turn(an_result("call_ok"), TEXT)],
        ["call_ok", "call_ok2"],
    ),
    (
        "anthropic-results-in-two-user-items",
        "anthropic",
        [*calls("anthropic", "call_ok", "call_ok2"), an_turn(an_result("call_ok")),
         an_turn(TEXT)],
        ["call_ok", "call_ok2"],
    ),
    # An output for a call the server holds (previous_response_id, item_reference): the
    # usual continuation, neither refused as a result for no call nor answered again
    (
        "responses-output-of-a-call-held-by-the-server",
        "responses",
        [*results("responses", "call_prev"), *calls("responses", "call_ok", "call_ok2"),
         *results("responses", "call_ok")],
        ["call_prev", "call_ok", "call_ok2"],
    ),
]  # fmt: skip


def test_anthropic_results_in_consecutive_user_items__answer_their_calls(ledger, tmp_path):
    """Both results in user items of their own, one after the other: one turn to the API."""
    items = [*calls("anthropic", "call_ok", "call_ok2"), an_turn(an_result("call_ok")),
             an_turn(an_result("call_ok2"))]  # fmt: skip
    path = tmp_path / "t.json"
    path.write_bytes(data := as_json("anthropic", items))
    report = repair_file(path, ledger, SCOPE)
    assert (report.calls, report.answered_before, report.changed) == (2, 2, False)
    assert path.read_bytes() == data
    # text before the second user item's result: that one is not leading any more
    items[-2] = an_turn(an_result("call_ok"), TEXT)
    path.write_bytes(as_json("anthropic", items))
    with pytest.raises(InputError, match="'call_ok2' is out of place"):
        repair_file(path, ledger, SCOPE)


@pytest.mark.parametrize(
    ("fmt", "items", "after"), [c[1:] for c in PLACED], ids=[c[0] for c in PLACED]
)
def test_placed_result__answers_its_call_and_repair_is_idempotent(
    ledger, tmp_path, fmt, items, after
):
    path = tmp_path / "t.json"
    data = as_json(fmt, items, indent=2)
    path.write_bytes(data)
    report = repair_file(path, ledger, SCOPE)
    assert (report.calls, report.answered_before, len(report.inserted)) == (2, 1, 1)
    once = path.read_bytes()
    assert only_insertions(data, once)
    assert answered_ids(fmt, items_of(once)) == after
    assert not repair_file(path, ledger, SCOPE).changed and path.read_bytes() == once


# ---------------------------------------------------------------------------- --format

MIXED_CHAT_RESPONSES = as_json(
    "openai", [USER, *calls("openai", "call_ok"), *calls("responses", "call_ok2")]
)
#: One assistant message holding tool_use blocks and tool_calls.
MIXED_ONE_MESSAGE = json.dumps(
    [
        {
            **calls("anthropic", "call_ok")[0],
            "tool_calls": calls("openai", "call_ok2")[0]["tool_calls"],
        }
    ]
).encode()


MIXED = "one transcript, one format"


@pytest.mark.parametrize(
    ("data", "fmt", "match"),
    [
        (MIXED_CHAT_RESPONSES, "responses", "message 3 is written in responses form, message 2 in"),
        (MIXED_CHAT_RESPONSES, "openai", "message 3 is written in responses form"),
        (MIXED_ONE_MESSAGE, "anthropic", "message 1 is written in both openai and anthropic form"),
        (MIXED_ONE_MESSAGE, "openai", "message 1 is written in both"),
        (
            as_jsonl([USER, *calls("anthropic", "call_ok"), *calls("openai", "call_ok2")]),
            "anthropic",
            "line 3 is written in openai form, line 2 in anthropic form",
        ),
    ],
    ids=[
        "chat+responses-as-responses",
        "chat+responses-as-openai",
        "one-message-as-anthropic",
        "one-message-as-openai",
        "jsonl-anthropic+chat-as-anthropic",
    ],
)
def test_format_chosen__a_mixed_transcript_is_still_refused(
    capsys, sqlite_url, ledger, tmp_path, data, fmt, match
):
    """--format used to skip detection: the other format's calls were passed over, exit 0."""
    message = refused(tmp_path, ledger, data, fmt)
    assert match in message and message.endswith(MIXED), message
    code, out, err = cli(capsys, sqlite_url, tmp_path / "t.json", "--format", fmt)
    assert (code, out) == (6, "") and err.count("\n") == 1 and MIXED in err, err


@pytest.mark.parametrize("fmt", ["openai", "responses"])
def test_format_chosen__another_format_than_the_one_detected_is_refused(ledger, tmp_path, fmt):
    """A transcript that reads as Anthropic and holds no call, with ``--format`` naming a
    format that finds nothing in it: refused, not "0 calls" (its result is for no call)."""
    data = json.dumps([{"role": "assistant", "content": "hi"}, an_turn(an_result("call_ok"))])
    message = refused(tmp_path, ledger, data.encode(), fmt)
    assert "it reads as anthropic" in message, message


def test_format_chosen__the_detected_one_or_nothing_to_detect_still_works(ledger, tmp_path):
    path = tmp_path / "t.json"
    data = as_json("responses", [USER, *calls("responses", "call_ok")])
    path.write_bytes(data)
    assert len(repair_file(path, ledger, SCOPE, "responses").inserted) == 1
    plain = tmp_path / "plain.json"
    plain.write_bytes(as_json("openai", [USER]))
    for fmt in ("openai", "responses", "anthropic"):
        report = repair_file(plain, ledger, SCOPE, fmt)
        assert (report.format, report.calls, report.changed) == (fmt, 0, False)


# ------------------------------------------------ calls of a kind toolledger never records

CUSTOM = {"type": "custom_tool_call", "call_id": "ct1", "name": "grammar", "input": "x = 1"}
CUSTOM_OUT = {"type": "custom_tool_call_output", "call_id": "ct1", "output": "ok"}
SHELL = {"type": "local_shell_call", "call_id": "sh1", "action": {"type": "exec"}}
LEGACY = {"role": "assistant", "content": None,
          "function_call": {"name": "write_file", "arguments": "{}"}}  # fmt: skip
LEGACY_OUT = {"role": "function", "name": "write_file", "content": "done"}

#: (id, format, items, a regular expression the one-line refusal matches): each was passed
#: over, and repair exited 0 leaving a call the API refuses the next request for (a cold
#: review)
FOREIGN: list[tuple[str, str, list[dict[str, Any]], str]] = [
    ("responses-custom-tool-call-unanswered", "responses",
     [*calls("responses", "call_ok"), CUSTOM],
     r"message 2: a custom_tool_call \('ct1'\) without its custom_tool_call_output: repair "
     r"answers function calls only"),
    ("responses-only-a-custom-tool-call", "responses", [USER, CUSTOM],
     r"message 2: a custom_tool_call \('ct1'\) without"),
    ("responses-its-output-before-it", "responses", [CUSTOM_OUT, CUSTOM],
     r"message 2: a custom_tool_call \('ct1'\) without"),
    ("responses-local-shell-call", "responses",
     [*calls("responses", "call_ok"), *results("responses", "call_ok"), SHELL],
     r"message 3: a local_shell_call \('sh1'\) without its local_shell_call_output"),
    ("chat-legacy-function-call", "openai", [USER, LEGACY, USER],
     r"message 2: a legacy function_call without the 'function' message after it"),
    ("chat-legacy-function-call-among-tool-calls", "openai",
     [USER, *calls("openai", "call_ok"), *results("openai", "call_ok"), LEGACY],
     r"message 4: a legacy function_call without"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("fmt", "items", "match"), [c[1:] for c in FOREIGN], ids=[c[0] for c in FOREIGN]
)
def test_foreign_call_unanswered__refused_in_one_line_and_exit_6(
    capsys, sqlite_url, ledger, tmp_path, fmt, items, match
):
    data = as_json(fmt, items)
    assert re.search(match, refused(tmp_path, ledger, data)), refused(tmp_path, ledger, data)
    path = tmp_path / "t.json"
    code, out, err = cli(capsys, sqlite_url, path)
    assert (code, out) == (6, "") and err.count("\n") == 1, err
    assert path.read_bytes() == data


def test_foreign_call_answered__the_function_calls_are_repaired_beside_it(ledger, tmp_path):
    """A custom tool call (or a legacy function_call) with its result is the caller's,
    answered: repair answers the function calls and passes over it."""
    for fmt, items in (
        ("responses", [CUSTOM, CUSTOM_OUT, *calls("responses", "call_ok", "call_ok2")]),
        ("openai", [USER, LEGACY, LEGACY_OUT, *calls("openai", "call_ok", "call_ok2")]),
    ):
        path = tmp_path / f"{fmt}.json"
        path.write_bytes(data := as_json(fmt, items))
        report = repair_file(path, ledger, SCOPE)
        assert (report.calls, report.answered_before, len(report.inserted)) == (2, 0, 2)
        assert only_insertions(data, path.read_bytes())
        assert answered_ids(fmt, items_of(path.read_bytes())) == ["call_ok", "call_ok2"]


def test_run_turn_parse__leaves_a_custom_tool_call_to_its_caller() -> None:
    """run_turn answers the turn's function calls; a custom tool call is its caller's to run
    (refusing the turn would refuse an application that runs those itself)."""
    from toolledger.turns import parse_turn

    fmt, turn = parse_turn([*calls("responses", "call_ok"), CUSTOM])
    assert fmt.name == "responses" and [c.id for c in turn] == ["call_ok"]


@pytest.mark.parametrize("fmt", ["openai", "anthropic"])
def test_run_turn_parse__two_turns_without_results__refused(fmt: str) -> None:
    """run_turn hands back one list of results, appended after the turn: given two turns
    without results, those of the first were handed back to go after the second, out of
    place (the API refuses the transcript). Refused, nothing submitted; a Responses list is
    answered, as its outputs go anywhere after their calls."""
    from toolledger.turns import parse_turn

    items = [*calls(fmt, "call_ok"), USER, *calls(fmt, "call_ok2")]
    with pytest.raises(InputError, match=r"^the items hold 2 turns whose calls have no result"):
        parse_turn(items)
    answered_first = [
        *calls(fmt, "call_ok"),
        *results(fmt, "call_ok"),
        USER,
        *calls(fmt, "call_ok2"),
    ]
    assert [c.id for c in parse_turn(answered_first)[1]] == ["call_ok2"]
    responses = [*calls("responses", "call_ok"), USER, *calls("responses", "call_ok2")]
    assert [c.id for c in parse_turn(responses)[1]] == ["call_ok", "call_ok2"]
