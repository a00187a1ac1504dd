"""Transcript repair against hostile files: every one is refused with exit 6 and one line, the
file untouched, or repaired into a file that reads back and that a second repair leaves as is.

Each case here was reproduced against the earlier code (exit 1 "internal error", a receipt
spliced where no reader sees it, a symlink replaced, output the next run could not read).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_cli
from tests.unit.repair_support import (
    FORMATS,
    TOOL,
    answered_ids,
    args_of,
    as_json,
    as_jsonl,
    call,
    calls_items,
    items_of,
    known_ledger,
    only_insertions,
    results_items,
    text_item,
    wrap,
)
from toolledger.ledger.errors import CorruptRecord, InputError, StateError
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.records import Receipt
from toolledger.ledger.transitions import Status
from toolledger.recovery import transcript
from toolledger.recovery.transcript import (
    RepairError,
    TranscriptError,
    repair_file,
    repair_transcript,
)

SCOPE = "hostile"


@pytest.fixture(scope="module")
def ledger(sqlite_url: str) -> Iterator[Ledger]:
    yield from known_ledger(sqlite_url, SCOPE)


def refused(tmp_path: Path, ledger: Ledger, data: bytes, name: str = "t.json") -> str:
    """Repair ``data`` from a file: it must be refused as input, one line, the file as it was."""
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(InputError) as err:
        repair_file(path, ledger, SCOPE)
    assert path.read_bytes() == data
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind
    message = str(err.value)
    assert "\n" not in message and "\r" not in message
    return message


def repaired_twice(tmp_path: Path, ledger: Ledger, data: bytes, name: str = "t.json") -> bytes:
    """Repair ``data`` in place; the result is ``data`` with text inserted, and a second repair
    changes nothing (the same bytes)."""
    path = tmp_path / name
    path.write_bytes(data)
    assert repair_file(path, ledger, SCOPE).changed
    once = path.read_bytes()
    assert only_insertions(data, once)
    again = repair_file(path, ledger, SCOPE)
    assert not again.changed and again.calls == again.answered_before
    assert path.read_bytes() == once
    return once


def cli(capsys: Any, url: str, *args: str) -> tuple[int, str, str]:
    return run_cli(capsys, "--db", url, "repair", *args, "--scope", SCOPE)


def oa(*cids: str) -> list[dict[str, Any]]:
    return calls_items("openai", [call(c) for c in cids])


def an(*cids: str) -> list[dict[str, Any]]:
    return calls_items("anthropic", [call(c) for c in cids])


def dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8")


USER = {"role": "user", "content": "go"}
ARGS = json.dumps(args_of("call_ok"))


# ---------------------------------------------------------------------------- the table
# Every hostile file: (id, bytes, a regular expression its one-line refusal matches). Each is
# refused by the Python API with InputError and by the CLI with exit 6, the file untouched.


def _deep(n: int) -> str:
    return "[" * n + "]" * n


def _oa_call(**tc: Any) -> bytes:
    """An OpenAI transcript whose one tool call is ``tc`` (a dict as written)."""
    return dumps({"messages": [USER, {"role": "assistant", "tool_calls": [tc]}]})


def _an_block(block: Any, role: str = "assistant") -> bytes:
    return dumps({"messages": [USER, {"role": role, "content": [block]}]})


def _rs(*items: Any) -> bytes:
    return dumps({"input": [{"role": "user", "content": "go"}, *items]})


FN = {"name": TOOL, "arguments": ARGS}
USE = {"type": "tool_use", "id": "call_ok", "name": TOOL, "input": args_of("call_ok")}

HOSTILE: list[tuple[str, bytes, str]] = [
    # 1. what is not UTF-8 or not JSON within the limits
    ("bad-utf8", b'{"messages": [{"role": "user", "content": "\xff"}]}', r"not UTF-8 \(byte 43"),
    ("bad-utf8-jsonl", as_jsonl([USER]) + b'{"role": "user", "content": "\xc3("}\n', "not UTF-8"),
    ("encoded-surrogate", b'[{"role": "user", "content": "\xed\xb3\xbf"}]', "not UTF-8"),
    ("surrogate-escape", rb'[{"role": "user", "content": "\udcff"}]', "lone surrogate"),
    (
        "surrogate-escape-in-id",
        json.dumps({"messages": [USER, *oa("\ud800")]}).encode(),  # ASCII: the escape
        "lone surrogate",
    ),
    ("surrogate-escape-in-key", rb'[{"role": "user", "content": "x", "\udfff": 1}]', "surrogate"),
    ("deep", f'{{"messages": {_deep(1000)}}}'.encode(), "nested more than 64 levels deep"),
    ("deep-100", f'{{"messages": [{_deep(100)}]}}'.encode(), "nested more than 64 levels deep"),
    ("deep-jsonl-line", as_jsonl([USER]) + _deep(1000).encode() + b"\n", "line 2: nested"),
    ("huge-int", b'[{"role": "user", "content": "x", "n": ' + b"9" * 5000 + b"}]", "out of range"),
    ("int-past-64-bits", b'[{"role": "user", "content": "x", "n": 9223372036854775808}]', "range"),
    ("nan", b'[{"role": "user", "content": "x", "n": NaN}]', "NaN is not allowed"),
    ("infinity", b'[{"role": "user", "content": "x", "n": -Infinity}]', "not allowed"),
    ("float-overflow", b'[{"role": "user", "content": "x", "n": 1e999}]', "Infinity"),
    (
        "deep-arguments",
        _oa_call(id="call_ok", type="function", function={"name": TOOL, "arguments": _deep(2000)}),
        "the arguments of call 'call_ok'.*nested more than 64",
    ),
    (
        "huge-int-arguments",
        _oa_call(id="call_ok", type="function", function={"name": TOOL, "arguments": "9" * 5000}),
        "the arguments of call 'call_ok'.*out of range",
    ),
    # 2. duplicate keys, at any level, named
    (
        "duplicate-messages-shadowing-the-call",
        dumps(wrap("openai", [USER, *oa("call_ok")]))[:-1] + b', "messages": [{"role": "user", '
        b'"content": "x"}]}',
        "duplicate key 'messages'",
    ),
    (
        "duplicate-messages-shorter-first",
        b'{"messages": [], "messages": ' + dumps([USER, *oa("call_ok")]) + b"}",
        "duplicate key 'messages'",
    ),
    (
        "duplicate-content-in-anthropic-turn",
        dumps({"messages": [USER, *an("call_ok")]})[:-2]
        + b', {"role": "user", "content": [], "content": [{"type": "text", "text": "x"}]}]}',
        "duplicate key 'content'",
    ),
    (
        "duplicate-key-in-jsonl-line",
        as_jsonl([USER]) + b'{"role": "user", "role": "assistant", "content": "x"}\n',
        "line 2: duplicate key 'role'",
    ),
    (
        "duplicate-key-in-arguments",
        _oa_call(
            id="call_ok", type="function", function={"name": TOOL, "arguments": '{"a": 1, "a": 2}'}
        ),
        "the arguments of call 'call_ok'.*duplicate key 'a'",
    ),
    # 5. one call per tool call id
    (
        "duplicate-id-openai",
        dumps(wrap("openai", [*oa("call_ok"), USER, *oa("call_ok")])),
        r"tool_call_id 'call_ok' appears twice: message 1 tool_calls\[0\] and message 3 "
        r"tool_calls\[0\]",
    ),
    (
        "duplicate-id-in-one-turn",
        dumps(wrap("openai", [USER, *oa("call_ok", "call_ok")])),
        r"appears twice: message 2 tool_calls\[0\] and message 2 tool_calls\[1\]",
    ),
    (
        "duplicate-id-both-answered",
        dumps(
            wrap(
                "openai",
                [
                    *oa("call_ok"),
                    *results_items("openai", [("call_ok", "1")]),
                    *oa("call_ok"),
                    *results_items("openai", [("call_ok", "2")]),
                ],
            )
        ),
        "'call_ok' appears twice",
    ),
    (
        "duplicate-id-responses",
        _rs(*calls_items("responses", [call("call_ok"), call("call_ok2"), call("call_ok")])),
        "tool_call_id 'call_ok' appears twice: message 2 and message 4",
    ),
    (
        "duplicate-id-anthropic",
        dumps(wrap("anthropic", [USER, *an("call_ok"), USER, *an("call_ok")])),
        r"appears twice: message 2 content\[1\] and message 4 content\[1\]",
    ),
    (
        "duplicate-id-jsonl",
        as_jsonl([USER, *oa("call_ok"), USER, *oa("call_ok")]),
        "appears twice: line 2 .* and line 4 ",
    ),
    # 7. not a transcript at all
    ("binary", b"\x00\x01\xfe\xff\x89PNG\r\n\x1a\n", "not UTF-8"),
    ("nul-bytes", b"\x00\x00\x00", "line 1 is not JSON"),
    ("empty", b"", "the transcript is empty"),
    ("whitespace", b" \n\r\n\t\n", "the transcript is empty"),
    ("garbage", b"garbage", "line 1 is not JSON"),
    ("truncated", b'{"messages": [{"role": "user"', "line 1 is not JSON"),
    ("broken-pretty-json", b'{\n  "messages": [\n    {"role": "user",,}\n  ]\n}', "line 3 is not"),
    ("a-string", b'"hello"', "must be a list of messages"),
    ("a-number", b"42", "must be a list of messages"),
    ("no-messages", b'{"nothing": "here"}', "must be a list of messages"),
    ("double-bom", b"\xef\xbb\xbf\xef\xbb\xbf[]", "line 1 is not JSON"),
    ("form-feed-between-tokens", b'[{"role": "user",\x0c"content": "x"}]', "is not JSON"),
    ("two-values-on-a-jsonl-line", as_jsonl([USER]) + b"{} {}\n", "line 2 is not JSON"),
    ("jsonl-line-a-number", as_jsonl([USER]) + b"5\n", "line 2 must be an object, not a number"),
    # 8. shapes repair cannot trust
    ("messages-an-object", b'{"messages": {"a": 1}}', "'messages' must be an array"),
    ("messages-a-string", b'{"messages": "hi"}', "'messages' must be an array"),
    ("message-a-number", dumps([5, *oa("call_ok")]), "message 1 must be an object, not a number"),
    ("message-null", dumps([USER, None]), "message 2 must be an object, not null"),
    ("message-a-list", dumps([[USER]]), "message 1 must be an object, not an array"),
    ("openai-role-missing", dumps([{"content": "x"}, *oa("call_ok")]), "message 1 has no 'role'"),
    ("openai-role-a-number", dumps([{"role": 1}, *oa("call_ok")]), "'role' must be a string"),
    (
        "openai-tool-calls-an-object",
        dumps([USER, {"role": "assistant", "tool_calls": {"x": 1}}]),
        "message 2: 'tool_calls' must be an array, not an object",
    ),
    (
        "openai-tool-call-a-string",
        dumps([USER, {"role": "assistant", "tool_calls": ["x"]}]),
        r"tool_calls\[0\] must be an object, not a string",
    ),
    ("openai-call-without-id", _oa_call(type="function", function=FN), "has no 'id'"),
    ("openai-id-a-number", _oa_call(id=5, function=FN), "'id' must be a string, not a number"),
    ("openai-id-empty", _oa_call(id="", function=FN), "'id' is empty"),
    ("openai-id-blank", _oa_call(id="  ", function=FN), "'id' is empty"),
    ("openai-no-function", _oa_call(id="call_ok"), "has no 'function'"),
    ("openai-function-a-string", _oa_call(id="call_ok", function="f"), "'function' must be"),
    ("openai-no-name", _oa_call(id="call_ok", function={"arguments": ARGS}), "has no 'name'"),
    (
        "openai-name-a-number",
        _oa_call(id="call_ok", function={"name": 5, "arguments": ARGS}),
        "'name' must be a string",
    ),
    (
        "openai-arguments-a-number",
        _oa_call(id="call_ok", function={"name": TOOL, "arguments": 5}),
        "'arguments' must be a string, not a number",
    ),
    (
        "openai-arguments-an-object",
        _oa_call(id="call_ok", function={"name": TOOL, "arguments": args_of("call_ok")}),
        "'arguments' must be a string, not an object",
    ),
    (
        "openai-arguments-an-array",
        _oa_call(id="call_ok", function={"name": TOOL, "arguments": "[1]"}),
        "must be a JSON object, not an array",
    ),
    (
        "openai-arguments-not-json",
        _oa_call(id="call_ok", function={"name": TOOL, "arguments": "{oops"}),
        "the arguments of call 'call_ok'.*not valid JSON",
    ),
    (
        "openai-id-with-a-line-separator",
        _oa_call(id="call\u2028x", function=FN),
        "tool_call_id: control character U\\+2028",
    ),
    ("openai-id-too-long", _oa_call(id="c" * 300, function=FN), "over the cap of 256"),
    (
        "openai-tool-content-a-number",
        dumps([USER, *oa("call_ok"), {"role": "tool", "tool_call_id": "call_ok", "content": 5}]),
        "message 3: 'content' must be a string or an array, not a number",
    ),
    (
        "openai-tool-id-an-array",
        dumps([USER, *oa("call_ok"), {"role": "tool", "tool_call_id": [1], "content": "x"}]),
        "'tool_call_id' must be a string, not an array",
    ),
    (
        "openai-tool-without-id",
        dumps([USER, *oa("call_ok"), {"role": "tool", "content": "x"}]),
        "message 3 has no 'tool_call_id'",
    ),
    (
        "openai-user-content-a-number",
        dumps([{"role": "user", "content": 5}, *oa("call_ok")]),
        "'content' must be a string or an array",
    ),
    ("responses-type-a-number", _rs({"type": 5}, *calls_items("responses", [call("a")])), "type"),
    (
        "responses-no-call-id",
        _rs({"type": "function_call", "name": TOOL, "arguments": ARGS}),
        "message 2 has no 'call_id'",
    ),
    (
        "responses-call-id-an-object",
        _rs({"type": "function_call_output", "call_id": {"a": 1}, "output": "x"}),
        "'call_id' must be a string, not an object",
    ),
    (
        "responses-no-name",
        _rs({"type": "function_call", "call_id": "call_ok", "arguments": ARGS}),
        "has no 'name'",
    ),
    (
        "responses-arguments-an-object",
        _rs({"type": "function_call", "call_id": "call_ok", "name": TOOL, "arguments": {}}),
        "'arguments' must be a string",
    ),
    (
        "responses-output-missing",
        _rs(
            *calls_items("responses", [call("call_ok")]),
            {"type": "function_call_output", "call_id": "call_ok"},
        ),
        "has no 'output'",
    ),
    (
        "responses-output-a-number",
        _rs(
            *calls_items("responses", [call("call_ok")]),
            {"type": "function_call_output", "call_id": "call_ok", "output": 1},
        ),
        "'output' must be a string or an array",
    ),
    (
        "anthropic-content-a-number",
        dumps({"messages": [USER, *an("call_ok"), {"role": "user", "content": 5}]}),
        "message 3: 'content' must be a string or an array, not a number",
    ),
    (
        "anthropic-content-missing",
        dumps({"messages": [{"role": "user"}, *an("call_ok")]}),
        "message 1 has no 'content'",
    ),
    (
        "anthropic-content-null",
        dumps({"messages": [{"role": "user", "content": None}, *an("call_ok")]}),
        "'content' must be a string or an array, not null",
    ),
    (
        "anthropic-block-a-string",
        dumps({"messages": [USER, {"role": "assistant", "content": ["text", USE]}]}),
        r"message 2 content\[0\] must be an object, not a string",
    ),
    (
        "anthropic-block-without-type",
        dumps({"messages": [USER, {"role": "assistant", "content": [{"text": "x"}, USE]}]}),
        r"message 2 content\[0\] has no 'type'",
    ),
    ("anthropic-tool-use-id-a-number", _an_block({**USE, "id": 7}), "'id' must be a string"),
    (
        "anthropic-tool-use-no-name",
        _an_block({k: v for k, v in USE.items() if k != "name"}),
        "has no 'name'",
    ),
    ("anthropic-input-an-array", _an_block({**USE, "input": [1]}), "'input' must be an object"),
    ("anthropic-input-a-string", _an_block({**USE, "input": ARGS}), "'input' must be an object"),
    (
        "anthropic-tool-use-in-user-turn",
        _an_block(USE, role="user"),
        "a tool_use block in a 'user' turn",
    ),
    (
        "anthropic-tool-result-without-id",
        dumps(
            {"messages": [*an("call_ok"), {"role": "user", "content": [{"type": "tool_result"}]}]}
        ),
        "has no 'tool_use_id'",
    ),
    (
        "anthropic-tool-result-content-a-number",
        dumps(
            {
                "messages": [
                    *an("call_ok"),
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "call_ok", "content": 1}
                        ],
                    },
                ]
            }
        ),
        "'content' must be a string or an array",
    ),
]

# The table above is long on purpose; its lines are data.
assert len({case[0] for case in HOSTILE}) == len(HOSTILE)


@pytest.mark.parametrize(("data", "match"), [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile__refused_in_one_line_file_untouched(ledger, tmp_path, data, match):
    message = refused(tmp_path, ledger, data)
    assert message.startswith(f"{tmp_path / 't.json'}: ") and re.search(match, message), message


@pytest.mark.parametrize("data", [c[1] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_cli__exit_6_one_line_no_traceback(capsys, sqlite_url, ledger, tmp_path, data):
    path = tmp_path / "t.json"
    path.write_bytes(data)
    code, out, err = cli(capsys, sqlite_url, str(path))
    assert (code, out) == (6, ""), err
    assert err.count("\n") == 1 and err.startswith("toolledger: error: ")
    assert "internal error" not in err and "Traceback" not in err
    assert path.read_bytes() == data
    code, out, err = cli(capsys, sqlite_url, str(path), "--out", "-")  # 7: the same to stdout
    assert (code, out) == (6, "") and err.count("\n") == 1, err


#: Through the real entry point (a process each, so a few): name -> extra arguments.
REAL = {
    "binary": ("--out", "-"),
    "surrogate-escape": ("--out", "-"),
    "deep": (),
    "duplicate-messages-shadowing-the-call": (),
}


def test_real_entry_point__exit_6_one_line_even_in_the_c_locale(sqlite_url, ledger, tmp_path):
    """The installed ``toolledger`` in a process of its own, with an ASCII locale: refusals are
    exit 6 and one line; a repair to stdout is the exact bytes."""
    exe = Path(sys.executable).with_name("toolledger")
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C", "TOOLLEDGER_HOME": str(tmp_path / "home")}

    def run(path: Path, *extra: str) -> subprocess.CompletedProcess[bytes]:
        argv = [str(exe), "--db", sqlite_url, "repair", str(path), "--scope", SCOPE, *extra]
        return subprocess.run(argv, capture_output=True, env=env, timeout=60)

    for name, data, _ in HOSTILE:
        if name not in REAL:
            continue
        path = tmp_path / f"{name}.json"
        path.write_bytes(data)
        proc = run(path, *REAL[name])
        assert (proc.returncode, proc.stdout) == (6, b""), (name, proc.stderr)
        assert proc.stderr.startswith(b"toolledger: error: ") and proc.stderr.count(b"\n") == 1
        assert b"Traceback" not in proc.stderr and b"internal error" not in proc.stderr
        assert path.read_bytes() == data
    good = tmp_path / "good.json"
    good.write_bytes(as_jsonl([USER, *an("call_ok")]))
    proc = run(good, "--out", "-")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == repair_transcript(good.read_bytes(), ledger, SCOPE).text.encode()
    raw = "\u2028".encode()  # the receipt's are escaped: only the transcript's own are raw
    assert proc.stdout.count(raw) == good.read_bytes().count(raw) and b"\\u2028" in proc.stdout


# ---------------------------------------------------------------------------- 2. duplicates


def test_duplicate_messages__no_repair_ever_inserts_into_the_shadowed_array(ledger, tmp_path):
    """The attack: a first "messages" holds the dangling call, a second one (the one parsers
    keep) does not. Each run used to splice a receipt into the first array, unseen."""
    data = (
        b'{"messages": ' + dumps([USER, *oa("call_ok")]) + b', "messages": [' + dumps(USER) + b"]}"
    )
    path = tmp_path / "t.json"
    path.write_bytes(data)
    for _ in range(2):
        with pytest.raises(TranscriptError, match="duplicate key 'messages' in one object"):
            repair_file(path, ledger, SCOPE)
    assert path.read_bytes() == data


# ---------------------------------------------------------------------------- 3. empty user turn


@pytest.mark.parametrize("style", ["pretty", "compact", "spaced", "jsonl"])
def test_anthropic_empty_user_turn__receives_the_results(ledger, tmp_path, style):
    items = [USER, *an("call_ok", "call_fail"), {"role": "user", "content": []}]
    data = {
        "pretty": as_json("anthropic", items, indent=2),
        "compact": as_json("anthropic", items, separators=(",", ":")),
        "spaced": as_json("anthropic", items),
        "jsonl": as_jsonl(items),
    }[style]
    out = repaired_twice(tmp_path, ledger, data, "t.jsonl" if style == "jsonl" else "t.json")
    after = items_of(out)
    assert len(after) == len(items)  # no new turn: the empty one took the results
    assert [b["tool_use_id"] for b in after[-1]["content"]] == ["call_ok", "call_fail"]
    assert after[-1]["content"][1]["is_error"] is True


def test_anthropic_empty_user_turn_with_whitespace_inside(ledger, tmp_path):
    data = (
        dumps(wrap("anthropic", [USER, *an("call_ok")]))[:-2]
        + b', {"role": "user", "content": [\n  ]}]}'
    )
    out = repaired_twice(tmp_path, ledger, data)
    assert answered_ids("anthropic", items_of(out)) == ["call_ok"]


# ---------------------------------------------------------------------------- 4. JSONL lines


SEPARATORS = "\u2028\u2029\x85"


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_jsonl__line_separators_inside_strings_are_not_line_ends(ledger, tmp_path, fmt, newline):
    """U+2028, U+2029 and U+0085 inside strings (written raw) and in the receipt: each run
    reads the lines as written, and the next run reads what this one wrote."""
    items = [text_item(fmt, "user", f"a{SEPARATORS}b"), *calls_items(fmt, [call("call_ok")])]
    data = as_jsonl(items, newline)
    assert len(data.decode().splitlines()) > len(items)  # what used to break the reader
    out = repaired_twice(tmp_path, ledger, data, "t.jsonl")
    text = out.decode()
    lines = text.split("\n")
    assert all(line.endswith("\r") for line in lines[:-1]) == (newline == "\r\n")
    assert [json.loads(line) for line in lines if line.strip()][:2] == items
    for ch in SEPARATORS:  # the receipt has them too, but escaped: only the original ones are raw
        assert text.count(ch) == data.decode().count(ch)
    results = [json.loads(line) for line in lines if line.strip()]
    assert answered_ids(fmt, results) == ["call_ok"]
    content = results[-1].get("content", results[-1].get("output"))
    if fmt == "anthropic":
        content = content[0]["content"]
    assert json.loads(content)["note"] == 'a\u2028b\u2029c\x85d é 漢 \U0001f600 "q" \\'


def test_jsonl__last_line_without_newline_and_blank_lines(ledger, tmp_path):
    data = b"\n" + as_jsonl([USER]) + b"  \n\r\n" + dumps(oa("call_ok")[0])
    out = repaired_twice(tmp_path, ledger, data, "t.jsonl")
    assert out.startswith(data + b"\r\n") and not out.endswith(b"\n")  # CRLF: there is one


def test_jsonl__indented_line_with_an_anthropic_turn(ledger, tmp_path):
    """A JSONL line with leading blanks: the receipt goes into that line's user turn."""
    turn = {"role": "user", "content": [{"type": "text", "text": "and?"}]}
    data = as_jsonl([USER, *an("call_ok")]) + b"   " + dumps(turn) + b"\n"
    out = repaired_twice(tmp_path, ledger, data, "t.jsonl")
    last = items_of(out)[-1]["content"]
    assert [b["type"] for b in last] == ["tool_result", "text"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_json_with_crlf__inserted_lines_end_the_same_way(ledger, tmp_path, fmt):
    items = [text_item(fmt, "user", "go"), *calls_items(fmt, [call("call_ok")])]
    data = as_json(fmt, items, indent=2).replace(b"\n", b"\r\n")
    out = repaired_twice(tmp_path, ledger, data)
    assert out.count(b"\n") == out.count(b"\r\n") > data.count(b"\n")
    assert answered_ids(fmt, items_of(out)) == ["call_ok"]


# ---------------------------------------------------------------------------- 6. symlinks


def test_symlink__refused_in_place_link_and_target_untouched(capsys, sqlite_url, ledger, tmp_path):
    target = tmp_path / "real.json"
    data = dumps(wrap("openai", [USER, *oa("call_ok")]))
    target.write_bytes(data)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with pytest.raises(TranscriptError, match="is a symbolic link; pass its target"):
        repair_file(link, ledger, SCOPE)
    code, out, err = cli(capsys, sqlite_url, str(link))
    assert code == 6 and "is a symbolic link; pass its target" in err and str(target) in err
    assert link.is_symlink() and target.read_bytes() == data
    # writing to a link with --out is refused too; reading through one is fine
    code, _, err = cli(capsys, sqlite_url, str(target), "--out", str(link))
    assert code == 6 and "symbolic link" in err and link.is_symlink()
    code, _, _ = cli(capsys, sqlite_url, str(link), "--out", str(tmp_path / "fixed.json"))
    assert code == 0 and answered_ids("openai", items_of((tmp_path / "fixed.json").read_bytes()))
    assert link.is_symlink() and target.read_bytes() == data
    code, out, _ = cli(capsys, sqlite_url, str(link), "--out", "-")
    assert code == 0 and '"tool_call_id": "call_ok"' in out


def test_not_a_regular_file__refused(ledger, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(TranscriptError, match="is not a regular file"):
        repair_file(fifo, ledger, SCOPE)


# ---------------------------------------------------------------------------- 7. stdout


def test_stdout__exact_bytes_bom_kept(capsys, sqlite_url, ledger, tmp_path):
    path = tmp_path / "t.json"
    data = b"\xef\xbb\xbf" + as_json("openai", [USER, *oa("call_ok")], indent=2)
    path.write_bytes(data)
    code, out, _ = cli(capsys, sqlite_url, str(path), "--out", "-")
    assert code == 0 and path.read_bytes() == data
    printed = out.encode("utf-8")
    assert printed.startswith(b"\xef\xbb\xbf") and only_insertions(data, printed)
    assert answered_ids("openai", items_of(printed)) == ["call_ok"]


@pytest.mark.parametrize("container", ["json", "jsonl"])
def test_bom__kept_and_read_back(ledger, tmp_path, container):
    items = [USER, *oa("call_ok")]
    body = as_json("openai", items) if container == "json" else as_jsonl(items)
    out = repaired_twice(tmp_path, ledger, b"\xef\xbb\xbf" + body)
    assert out.startswith(b"\xef\xbb\xbf") and not out.startswith(b"\xef\xbb\xbf" * 2)


# ---------------------------------------------------------------------------- never write blind


def test_read_back__a_splice_that_breaks_the_file_writes_nothing(
    capsys, sqlite_url, ledger, tmp_path, monkeypatch
):
    """Should a splice ever be wrong, the check before writing stops it: exit 1, one line."""
    path = tmp_path / "t.json"
    data = as_json("openai", [USER, *oa("call_ok")], indent=2)
    path.write_bytes(data)
    monkeypatch.setattr(transcript.Document, "after", lambda self, span, values: (span[1], ",{"))
    with pytest.raises(RepairError, match="would not read back"):
        repair_file(path, ledger, SCOPE)
    code, _, err = cli(capsys, sqlite_url, str(path))
    assert code == 1 and "would not read back" in err and "internal error" not in err
    assert path.read_bytes() == data


def test_read_back__a_splice_that_answers_nothing_writes_nothing(ledger, tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    data = as_json("openai", [USER, *oa("call_ok")])
    path.write_bytes(data)
    monkeypatch.setattr(
        transcript.Document, "after", lambda self, span, values: (span[1], ', {"role": "user"}')
    )
    with pytest.raises(RepairError, match="1 calls still without a result"):
        repair_file(path, ledger, SCOPE)
    assert path.read_bytes() == data


def test_receipt_that_utf8_cannot_carry__corrupt_record(ledger, tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    data = as_json("openai", [USER, *oa("call_ok")])
    path.write_bytes(data)
    bad = Receipt(Status.SUCCEEDED, {"x": "\udcff"}, "e1")
    monkeypatch.setattr(transcript, "receipt_for", lambda op, ex, **_: bad)
    with pytest.raises(CorruptRecord, match="not UTF-8 JSON"):
        repair_file(path, ledger, SCOPE)
    assert path.read_bytes() == data


def test_python_api__str_and_bytes_alike(ledger):
    data = as_json(
        "responses",
        [{"role": "user", "content": "go"}, *calls_items("responses", [call("call_ok")])],
    )
    by_bytes = repair_transcript(data, ledger, SCOPE)
    by_text = repair_transcript(data.decode(), ledger, SCOPE)
    assert by_bytes.text == by_text.text and by_bytes.changed
    with pytest.raises(TranscriptError, match="lone surrogate"):
        repair_transcript('[{"role": "user", "content": "\udcff"}]', ledger, SCOPE)
    with pytest.raises(TranscriptError, match="unknown format"):
        repair_transcript(data, ledger, SCOPE, "gemini")


def test_forced_format_that_does_not_fit__refused(capsys, sqlite_url, ledger, tmp_path):
    path = tmp_path / "t.json"
    data = as_json("openai", [USER, *oa("call_ok")])
    path.write_bytes(data)
    code, _, err = cli(capsys, sqlite_url, str(path), "--format", "anthropic")
    # the format named is refused as such, before the text is read in it: it said "'content'
    # must be a string or an array, not null" of the OpenAI call, naming no format
    assert code == 6 and "--format anthropic, but it reads as openai" in err, err
    assert path.read_bytes() == data


@pytest.mark.parametrize("fmt", FORMATS)
def test_huge_transcript_of_dangling_turns__every_turn_answered(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a transcript of 4,000 model turns (11 MB), none answered (a runtime that kept the
    # model's messages and lost every result), every call with a receipt. Its repair was
    # quadratic: one splice per receipt copied the whole text (10,000 receipts in 12 MB took
    # 73 s), and an Anthropic transcript searched every item for each turn's last (20,000
    # turns: 46 s); now ~1 s. Measured, not asserted: a wall-clock limit is no test here.
    turns, padding = 4000, "x" * 2500
    items: list[Any] = []
    for n in range(turns):
        items += [*calls_items(fmt, [call(f"c{n}")]), text_item(fmt, "user", padding)]
    receipt = Receipt(Status.SUCCEEDED, {"ok": True}, "e1")
    monkeypatch.setattr(transcript, "_receipt", lambda ledger, scope, c, name: receipt)
    # When it is repaired
    report = repair_transcript(as_json(fmt, items), None, SCOPE)  # type: ignore[arg-type]
    # Then every call is answered, each in its own turn: the repaired transcript, read again,
    # misses nothing and holds each result once
    assert [i["tool_call_id"] for i in report.inserted] == [f"c{n}" for n in range(turns)]
    again = repair_transcript(report.text, None, SCOPE)  # type: ignore[arg-type]
    assert again.inserted == [] and not again.changed


def test_in_place__a_transcript_written_meanwhile_is_not_replaced(
    ledger: Ledger, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, sqlite_url: str
) -> None:
    # Given a JSONL transcript whose call has no result, and an agent that appends its next
    # turn while repair reads the ledger
    path = tmp_path / "t.jsonl"
    data = as_jsonl([USER, *oa("call_ok")])
    path.write_bytes(data)
    appended = json.dumps({"role": "assistant", "content": "a turn written meanwhile"}) + "\n"
    read = transcript._receipt

    def agent_appends(*args: Any) -> Receipt:
        with open(path, "a", encoding="utf-8") as f:
            f.write(appended)
        return read(*args)

    monkeypatch.setattr(transcript, "_receipt", agent_appends)
    # When it is repaired in place, Then nothing is written, with exit 5 and one line: the
    # agent's turn is kept (replacing the file dropped it)
    with pytest.raises(StateError, match="changed while repair read"):
        repair_file(path, ledger, SCOPE)
    assert path.read_bytes() == data + appended.encode()
    path.write_bytes(data)
    code, out, err = cli(capsys, sqlite_url, str(path))
    assert (code, out) == (5, "") and err.count("\n") == 1, err
    assert path.read_bytes() == data + appended.encode()
    # (named by --out another way, it is still the file itself)
    path.write_bytes(data)
    with pytest.raises(StateError, match="changed while repair read"):
        repair_file(path, ledger, SCOPE, out=tmp_path / "." / ".." / tmp_path.name / path.name)
    assert path.read_bytes() == data + appended.encode()
    # and a repair to another file, or of a transcript nobody writes, goes on
    path.write_bytes(data)
    assert repair_file(path, ledger, SCOPE, out=tmp_path / "o.jsonl").changed
    monkeypatch.setattr(transcript, "_receipt", read)
    assert repair_file(path, ledger, SCOPE).changed
    assert only_insertions(data, path.read_bytes())
