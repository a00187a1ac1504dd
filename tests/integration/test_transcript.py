"""Transcript repair: OpenAI chat, Responses API and Anthropic; JSON and JSONL."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_cli
from toolledger.ledger.errors import ConflictError, NoReceipt, NotFound
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.transitions import Status
from toolledger.recovery.transcript import TranscriptError, repair_file, repair_transcript

FORMATS = ["openai", "responses", "anthropic"]
SAVED = {"path": "report.txt", "bytes_written": 4, "note": "診断 ✓"}

Turn = tuple[str, Any]


# ---------------------------------------------------------------------------- builders


def calls_msg(fmt: str, calls: list[tuple[str, str, dict[str, Any]]]) -> list[dict[str, Any]]:
    if fmt == "openai":
        return [
            {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "tool_calls": [
                    {
                        "id": i,
                        "type": "function",
                        "function": {"name": t, "arguments": json.dumps(a)},
                    }
                    for i, t, a in calls
                ],
            }
        ]
    if fmt == "responses":
        return [
            {
                "type": "function_call",
                "id": f"fc_{i}",
                "call_id": i,
                "name": t,
                "arguments": json.dumps(a),
                "status": "completed",
            }
            for i, t, a in calls
        ]
    return [
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "On it."}]
            + [{"type": "tool_use", "id": i, "name": t, "input": a} for i, t, a in calls],
        }
    ]


def results_msg(fmt: str, results: list[tuple[str, str]]) -> list[dict[str, Any]]:
    if fmt == "openai":
        return [{"role": "tool", "tool_call_id": i, "content": c} for i, c in results]
    if fmt == "responses":
        return [{"type": "function_call_output", "call_id": i, "output": c} for i, c in results]
    return [
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": i, "content": c} for i, c in results
            ],
        }
    ]


def text_msg(fmt: str, role: str, text: str) -> dict[str, Any]:
    if fmt == "responses":
        return {
            "type": "message",
            "role": role,
            "content": [{"type": "input_text", "text": text}],
            "x-trace": {"span": 7},
        }
    return {"role": role, "content": text, "x-meta": {"turn": text[:8]}}


def build(fmt: str, turns: list[Turn]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for kind, value in turns:
        if kind == "calls":
            items += calls_msg(fmt, value)
        elif kind == "results":
            items += results_msg(fmt, value)
        else:
            items.append(text_msg(fmt, kind, value))
    return items


def serialise(items: list[dict[str, Any]], container: str, fmt: str) -> str:
    if container == "jsonl":
        return "".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items)
    key = "input" if fmt == "responses" else "messages"
    return json.dumps(
        {"model": "m-1", key: items, "metadata": {"keep": [1, 2.50, "é"]}},
        ensure_ascii=False,
        indent=2,
    )


def only_insertions(old: str, new: str) -> list[str]:
    """The inserted pieces, asserting nothing of the old text changed or vanished."""
    pieces = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        assert op in ("equal", "insert"), (op, old[i1:i2], new[j1:j2])
        if op == "insert":
            pieces.append(new[j1:j2])
    return pieces


def tool_results(fmt: str, text: str, container: str) -> list[tuple[str, str]]:
    """(call id, content) of every tool result in a transcript, in order."""
    items = (
        [json.loads(line) for line in text.splitlines() if line.strip()]
        if container == "jsonl"
        else next(v for k, v in json.loads(text).items() if k in ("messages", "input"))
    )
    if fmt == "openai":
        return [(m["tool_call_id"], m["content"]) for m in items if m.get("role") == "tool"]
    if fmt == "responses":
        return [
            (m["call_id"], m["output"]) for m in items if m.get("type") == "function_call_output"
        ]
    return [
        (b["tool_use_id"], b["content"])
        for m in items
        if isinstance(m.get("content"), list)
        for b in m["content"]
        if b.get("type") == "tool_result"
    ]


# ---------------------------------------------------------------------------- ledger states


ARGS = {"path": "report.txt", "content": "done"}


def in_state(ledger: Ledger, scope: str, cid: str, status: Status, args=None) -> str | None:
    args = args or {"path": f"{cid}.txt", "content": cid}
    approve = status not in (Status.PENDING_APPROVAL, Status.REJECTED)
    ledger.submit(scope, cid, "write_file", args, approved_by="al" if approve else None)
    if status is Status.REJECTED:
        ledger.reject(scope, cid, by="bob", reason="not now")
        return None
    if status in (Status.PENDING_APPROVAL, Status.APPROVED):
        return None
    claim = ledger.claim(scope, f"write_file:{cid}", 1, worker_id="w")
    if status in (Status.SUCCEEDED, Status.FAILED):
        ledger.finish(
            claim.execution_id,
            claim.lease_token,
            status,
            SAVED if status is Status.SUCCEEDED else {"error": "disk full"},
        )
    elif status is Status.UNKNOWN:
        ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")
    return claim.execution_id


def call(cid: str) -> tuple[str, str, dict[str, Any]]:
    return (cid, "write_file", {"path": f"{cid}.txt", "content": cid})


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("container", ["json", "jsonl"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_repair__mixed_batch_receipts_in_call_order(ledger, scope, fmt, container):
    eid_unknown = in_state(ledger, scope, "call_u", Status.UNKNOWN)
    in_state(ledger, scope, "call_s", Status.SUCCEEDED)
    turns = [("user", "write the report"), ("calls", [call("call_u"), call("call_s")])]
    text = serialise(build(fmt, turns), container, fmt)
    report = repair_transcript(text, ledger, scope)  # format detected
    assert (report.format, report.container, report.calls) == (fmt, container, 2)
    only_insertions(text, report.text)
    results = tool_results(fmt, report.text, container)
    assert [r[0] for r in results] == ["call_u", "call_s"]
    unknown, saved = (json.loads(r[1]) for r in results)
    assert unknown["status"] == "unknown" and unknown["execution_id"] == eid_unknown
    assert saved == SAVED and results[1][1] == json.dumps(SAVED, ensure_ascii=False)
    assert [i["status"] for i in report.inserted] == ["unknown", "succeeded"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_repair__a_jsonl_transcript_of_one_line_is_repaired(ledger, scope, fmt):
    """An agent killed right after writing its first line, the model's calls, left a JSONL
    transcript of one line: read as one JSON value, an object that holds no list of messages,
    it was refused (exit 6, "a JSON transcript must be a list of messages ..."), where the
    same line after a user message was repaired (seen in a crash loop: 2 restarts of 8)."""
    in_state(ledger, scope, "c1", Status.SUCCEEDED)
    text = serialise(calls_msg(fmt, [call("c1")]), "jsonl", fmt)
    assert text.count("\n") == 1
    report = repair_transcript(text, ledger, scope)
    assert (report.format, report.container, report.calls) == (fmt, "jsonl", 1)
    only_insertions(text, report.text)
    assert tool_results(fmt, report.text, "jsonl") == [
        ("c1", json.dumps(SAVED, ensure_ascii=False))
    ]
    assert not repair_transcript(report.text, ledger, scope).changed


@pytest.mark.parametrize("fmt", FORMATS)
def test_repair__rejected_gets_a_rejection_receipt(ledger, scope, fmt):
    in_state(ledger, scope, "call_r", Status.REJECTED)
    text = serialise(build(fmt, [("user", "go"), ("calls", [call("call_r")])]), "json", fmt)
    report = repair_transcript(text, ledger, scope, fmt)
    ((cid, content),) = tool_results(fmt, report.text, "json")
    assert cid == "call_r" and json.loads(content) == {"status": "rejected", "reason": "not now"}
    if fmt == "anthropic":
        assert '"is_error": true' in report.text


@pytest.mark.parametrize("container", ["json", "jsonl"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_repair__long_transcript_only_last_batch_dangling_rest_preserved(
    ledger, scope, fmt, container
):
    turns: list[Turn] = []
    for t in range(15):
        cid = f"old_{t}"
        turns += [
            ("user", f"turn {t} — é"),
            ("calls", [call(cid)]),
            ("results", [(cid, json.dumps({"earlier": t}))]),
            ("assistant", f"done {t}"),
        ]
    in_state(ledger, scope, "last_a", Status.SUCCEEDED)
    in_state(ledger, scope, "last_b", Status.FAILED)
    turns += [("user", "and now two more"), ("calls", [call("last_a"), call("last_b")])]
    text = serialise(build(fmt, turns), container, fmt)
    report = repair_transcript(text, ledger, scope)
    assert (report.calls, report.answered_before) == (17, 15)
    pieces = only_insertions(text, report.text)
    assert "old_" not in "".join(pieces)  # nothing about the earlier turns was touched
    results = tool_results(fmt, report.text, container)
    assert [r[0] for r in results[-2:]] == ["last_a", "last_b"]
    assert json.loads(results[-1][1]) == {"error": "disk full"}
    assert report.text.startswith(text[: text.index("and now two more")])


@pytest.mark.parametrize("fmt", FORMATS)
def test_repair__second_repair_adds_nothing(ledger, scope, fmt, tmp_path):
    in_state(ledger, scope, "c1", Status.SUCCEEDED)
    path = tmp_path / "t.json"
    path.write_text(serialise(build(fmt, [("user", "x"), ("calls", [call("c1")])]), "json", fmt))
    assert repair_file(path, ledger, scope).changed
    once = path.read_bytes()
    again = repair_file(path, ledger, scope)
    assert not again.changed and again.answered_before == 1
    assert path.read_bytes() == once


def test_repair__the_replaced_transcript_and_its_folder_are_fsynced(
    ledger, scope, tmp_path, monkeypatch
):
    """A rename is durable once its folder is fsynced: without it a power loss (not a crash)
    could bring the old transcript back, its receipts missing again (a cold review)."""
    import os
    import stat

    in_state(ledger, scope, "c1", Status.SUCCEEDED)
    path = tmp_path / "t.json"
    path.write_text(
        serialise(build("openai", [("user", "x"), ("calls", [call("c1")])]), "json", "openai")
    )
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert repair_file(path, ledger, scope).changed
    assert synced == ["file", "folder"]


def test_repair__anthropic_partial_user_turn_gets_the_missing_block_after_the_others(ledger, scope):
    in_state(ledger, scope, "a", Status.SUCCEEDED)
    in_state(ledger, scope, "b", Status.UNKNOWN)
    items = build("anthropic", [("user", "x"), ("calls", [call("a"), call("b")])])
    items.append(
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "a", "content": json.dumps(SAVED)},
                {"type": "text", "text": "also, hurry"},
            ],
        }
    )
    text = serialise(items, "json", "anthropic")
    report = repair_transcript(text, ledger, scope)
    only_insertions(text, report.text)
    last = json.loads(report.text)["messages"][-1]["content"]
    assert [b.get("tool_use_id", b["type"]) for b in last] == ["a", "b", "text"]


ERRORS = [
    # a read-only call is never recorded: said, with what to do (it read as a wrong scope)
    ("missing", NotFound, "is not in the ledger.*read-only tool's call is never recorded"),
    ("conflict", ConflictError, "other arguments"),
    ("pending", NoReceipt, "no receipt yet"),
]


@pytest.mark.parametrize(("case", "error", "message"), ERRORS, ids=[e[0] for e in ERRORS])
@pytest.mark.parametrize("fmt", FORMATS)
def test_repair__cannot_give_a_receipt_stops_transcript_untouched(
    ledger, scope, tmp_path, fmt, case, error, message
):
    in_state(ledger, scope, "fine", Status.SUCCEEDED)
    if case == "conflict":
        in_state(ledger, scope, "bad", Status.SUCCEEDED, args={"path": "x", "content": "other"})
    elif case == "pending":
        in_state(ledger, scope, "bad", Status.PENDING_APPROVAL)
    path = tmp_path / "t.json"
    path.write_text(
        serialise(build(fmt, [("user", "x"), ("calls", [call("fine"), call("bad")])]), "json", fmt)
    )
    before = path.read_bytes()
    with pytest.raises(error, match=message) as err:
        repair_file(path, ledger, scope)
    assert "'bad'" in str(err.value)
    assert path.read_bytes() == before


# That repair never executes is proved from the import graph (tests/unit/test_layout.py:
# nothing reachable from toolledger.recovery.transcript can run a tool).


def test_repair__a_responses_request_with_its_output_repairs_the_outputs_calls(ledger, scope):
    """A Responses request logged with its response, ``{"input": [...], "output": [...]}``:
    the calls of ``output`` are read too (only ``input`` was, and a call that ran was left
    unanswered with "0 calls", exit 0: a cold review). Any other two lists are refused."""
    in_state(ledger, scope, "c1", Status.SUCCEEDED)
    (item,) = calls_msg("responses", [call("c1")])
    doc = {"model": "m", "input": [text_msg("responses", "user", "go")], "output": [item]}
    text = json.dumps(doc, indent=2)
    report = repair_transcript(text, ledger, scope)
    assert (report.format, report.calls, len(report.inserted)) == ("responses", 1, 1)
    only_insertions(text, report.text)
    repaired = json.loads(report.text)
    assert [i.get("type") for i in repaired["output"]] == ["function_call", "function_call_output"]
    assert repaired["input"] == doc["input"]
    assert repair_transcript(report.text, ledger, scope).inserted == []
    both = json.dumps({"messages": doc["input"], "output": [item]})
    with pytest.raises(TranscriptError, match="holds 'messages' and 'output'"):
        repair_transcript(both, ledger, scope)


@pytest.mark.parametrize("content", [None, ""])
@pytest.mark.parametrize("chosen", ["responses", "anthropic"])
def test_repair__a_format_chosen_that_finds_no_call_where_another_does_is_refused(
    ledger, scope, chosen, content
):
    """``--format`` naming a format the transcript is not in: "0 calls", exit 0, the calls
    left unanswered (a cold review). Refused now, saying which format it reads as, before
    the transcript is read in the format named: an OpenAI call message's ``"content": null``
    (what models send) read as Anthropic's was refused as a malformed line ("'content' must
    be a string or an array, not null"), which named no format (a cold review of the README)."""
    in_state(ledger, scope, "c1", Status.SUCCEEDED)
    items = build("openai", [("user", "go"), ("calls", [call("c1")])])
    items[-1]["content"] = content
    text = serialise(items, "json", "openai")
    with pytest.raises(TranscriptError, match="it reads as openai"):
        repair_transcript(text, ledger, scope, chosen)
    assert len(repair_transcript(text, ledger, scope, "openai").inserted) == 1
    plain = serialise([text_msg("openai", "user", "hi")], "json", "openai")
    assert repair_transcript(plain, ledger, scope, chosen).inserted == []  # nothing to pass over


@pytest.mark.parametrize("bad", ["", "not json at all\n", "[1, 2", '{"nothing": "here"}'])
def test_repair__not_a_transcript(ledger, scope, bad):
    with pytest.raises(TranscriptError):
        repair_transcript(bad, ledger, scope)


def test_repair__no_tool_calls_nothing_to_do(ledger, scope):
    text = serialise([text_msg("openai", "user", "hi")], "json", "openai")
    report = repair_transcript(text, ledger, scope)
    assert report.format is None and not report.changed and report.text == text


# ---------------------------------------------------------------------------- CLI


def test_repair_cli__in_place_out_and_exit_codes(db_url, ledger, scope, tmp_path, capsys):
    in_state(ledger, scope, "c1", Status.SUCCEEDED)
    path = tmp_path / "t.jsonl"
    path.write_text(
        serialise(build("openai", [("user", "x"), ("calls", [call("c1")])]), "jsonl", "openai")
    )
    original = path.read_text()
    code, out, _ = run_cli(
        capsys,
        "--db",
        db_url,
        "repair",
        str(path),
        "--scope",
        scope,
        "--out",
        str(tmp_path / "fixed.jsonl"),
        "--json",
    )
    summary = json.loads(out)
    assert code == 0 and summary["format"] == "openai" and len(summary["inserted"]) == 1
    assert path.read_text() == original  # --out leaves the input alone
    assert tool_results("openai", (tmp_path / "fixed.jsonl").read_text(), "jsonl")[0][0] == "c1"
    # a mistyped --out made every folder it named (a review): refused, exit 6, nothing made
    typo = tmp_path / "no" / "such" / "fixed.jsonl"
    code, out, err = run_cli(
        capsys, "--db", db_url, "repair", str(path), "--scope", scope, "--out", str(typo)
    )
    assert code == 6 and "is not a folder: nothing was written" in err, (code, err)
    assert not (tmp_path / "no").exists()
    code, out, err = run_cli(
        capsys, "--db", db_url, "repair", str(path), "--scope", scope, "--out", "-", "--json"
    )  # stdout is the transcript, whole; the summary asked for is on stderr, one JSON line
    assert code == 0 and out == (tmp_path / "fixed.jsonl").read_text()
    assert json.loads(err)["out"] == "-" and len(json.loads(err)["inserted"]) == 1
    code, out, _ = run_cli(capsys, "--db", db_url, "repair", str(path), "--scope", scope)
    assert code == 0 and "1 inserted" in out and path.read_text() != original
    path.write_text(
        serialise(build("openai", [("user", "x"), ("calls", [call("zz")])]), "jsonl", "openai")
    )
    code, _, err = run_cli(capsys, "--db", db_url, "repair", str(path), "--scope", scope)
    assert code == 4 and "'zz'" in err
    Path(path).write_text("garbage")
    code, _, err = run_cli(capsys, "--db", db_url, "repair", str(path), "--scope", scope)
    assert code == 6 and "line 1 is not JSON" in err


def test_repair__a_tab_indented_transcript_gets_tab_indented_results(ledger, scope):
    """Inserted messages are indented as their siblings are, tabs included (a tab-indented
    transcript had its inserted members indented by a tab and one space: a cold review)."""
    in_state(ledger, scope, "c1", Status.SUCCEEDED)
    text = json.dumps(build("openai", [("user", "go"), ("calls", [call("c1")])]), indent="\t")
    report = repair_transcript(text, ledger, scope)
    (inserted,) = only_insertions(text, report.text)
    members = [line for line in inserted.splitlines() if line.strip().startswith('"')]
    assert members and all(line.startswith('\t\t"') for line in members), inserted
    assert report.text == json.dumps(json.loads(report.text), indent="\t", ensure_ascii=False)


def test_repair_cli__input_past_the_cap_is_refused_a_pipe_still_read(
    db_url, ledger, scope, tmp_path, capsys, monkeypatch
):
    """`repair /dev/zero --out -` read until memory ran out (MemoryError, exit 1 "internal
    error"): now refused past the cap, exit 6, one line; /dev/stdin is still read."""
    import subprocess
    import sys

    import toolledger
    from toolledger.recovery import transcript

    in_state(ledger, scope, "c1", Status.SUCCEEDED)
    monkeypatch.setattr(transcript, "MAX_TRANSCRIPT_BYTES", 1024 * 1024)
    code, out, err = run_cli(
        capsys, "--db", db_url, "repair", "/dev/zero", "--scope", scope, "--out", "-"
    )
    assert (code, out) == (6, ""), err
    assert err.count("\n") == 1 and "/dev/zero: more than 1,048,576 bytes" in err, err
    path = tmp_path / "t.jsonl"
    path.write_text(
        serialise(build("openai", [("user", "x"), ("calls", [call("c1")])]), "jsonl", "openai")
    )
    with pytest.raises(TranscriptError, match="more than 10 bytes"):
        transcript.read_transcript(path, limit=10)
    code = str(Path(toolledger.__file__).resolve().parents[1])  # this tree's, not an install's
    piped = subprocess.run(
        [sys.executable, "-m", "toolledger", "--db", db_url, "repair", "/dev/stdin",
         "--scope", scope, "--out", "-"],
        input=path.read_text(), capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": code},
    )  # fmt: skip
    assert piped.returncode == 0, piped.stderr
    assert tool_results("openai", piped.stdout, "jsonl")[0][0] == "c1"
