"""What the repair tests share: a SQLite ledger holding calls in each state, and transcripts.

Not a test module: the hostile cases (test_repair_hostile.py) and the properties
(test_repair_properties.py) import it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from toolledger.ledger.ledger import Ledger
from toolledger.ledger.transitions import Status

FORMATS = ("openai", "responses", "anthropic")
TOOL = "write_file"
#: Results with what a naive writer gets wrong: line separators, NEL, non-BMP, quotes.
RESULT = {"path": "a.txt", "note": 'a\u2028b\u2029c\x85d é 漢 \U0001f600 "q" \\'}

#: Calls in the ledger, by id: the state each is in.
KNOWN: dict[str, Status] = {
    "call_ok": Status.SUCCEEDED,
    "call_ok2": Status.SUCCEEDED,
    "call_fail": Status.FAILED,
    "call_unknown": Status.UNKNOWN,
    "call_rejected": Status.REJECTED,
    "call_é漢": Status.SUCCEEDED,
}


def args_of(cid: str) -> dict[str, Any]:
    """The arguments each known call was recorded with."""
    return {"path": f"{cid}.txt", "content": f"for {cid} \u2028 ok"}


def record(ledger: Ledger, scope: str, cid: str, status: Status) -> None:
    approve = status is not Status.REJECTED
    ledger.submit(scope, cid, TOOL, args_of(cid), approved_by="al" if approve else None)
    if status is Status.REJECTED:
        ledger.reject(scope, cid, by="bob", reason="not now")
        return
    claim = ledger.claim(scope, f"{TOOL}:{cid}", 1, worker_id="w")
    assert claim is not None
    if status is Status.UNKNOWN:
        ledger.mark_unknown(claim.execution_id, reason="lease expired", actor="sweep")
    else:
        result = RESULT if status is Status.SUCCEEDED else {"error": "disk full\x85"}
        ledger.finish(claim.execution_id, claim.lease_token, status, result)


def known_ledger(url: str, scope: str) -> Iterator[Ledger]:
    """A ledger on ``url`` holding every call of ``KNOWN`` in ``scope``."""
    ledger = Ledger(url)
    for cid, status in KNOWN.items():
        record(ledger, scope, cid, status)
    yield ledger
    ledger.close()


# ---------------------------------------------------------------------------- transcripts


def calls_items(fmt: str, calls: list[tuple[str, str, Any]]) -> list[dict[str, Any]]:
    """One model turn making ``calls`` (id, tool, arguments as an object)."""
    if fmt == "openai":
        return [
            {
                "role": "assistant",
                "content": None,
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
            {"type": "function_call", "call_id": i, "name": t, "arguments": json.dumps(a)}
            for i, t, a in calls
        ]
    return [
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "On it."}]
            + [{"type": "tool_use", "id": i, "name": t, "input": a} for i, t, a in calls],
        }
    ]


def results_items(fmt: str, results: list[tuple[str, str]]) -> list[dict[str, Any]]:
    if fmt == "openai":
        return [{"role": "tool", "tool_call_id": i, "content": c} for i, c in results]
    if fmt == "responses":
        return [{"type": "function_call_output", "call_id": i, "output": c} for i, c in results]
    blocks = [{"type": "tool_result", "tool_use_id": i, "content": c} for i, c in results]
    return [{"role": "user", "content": blocks}]


def text_item(fmt: str, role: str, text: str) -> dict[str, Any]:
    if fmt == "responses":
        return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}
    return {"role": role, "content": text}


def call(cid: str) -> tuple[str, str, Any]:
    return (cid, TOOL, args_of(cid))


def wrap(fmt: str, items: list[Any]) -> dict[str, Any]:
    return {"model": "m", "input" if fmt == "responses" else "messages": items}


def as_json(fmt: str, items: list[Any], **dump: Any) -> bytes:
    return json.dumps(wrap(fmt, items), ensure_ascii=False, **dump).encode("utf-8")


def as_jsonl(items: list[Any], newline: str = "\n") -> bytes:
    return "".join(json.dumps(i, ensure_ascii=False) + newline for i in items).encode("utf-8")


def items_of(data: bytes) -> list[Any]:
    """The messages of a transcript, read the way a plain JSON reader would (splitting JSONL
    on "\\n" only)."""
    text = data.decode("utf-8").removeprefix("\ufeff")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.split("\n") if line.strip(" \t\r")]
    if isinstance(value, list):
        return value
    keys = ("messages", "input", "items", "output")
    return next(value[k] for k in keys if isinstance(value.get(k), list))


def answered_ids(fmt: str, items: list[Any]) -> list[str]:
    if fmt == "openai":
        return [m["tool_call_id"] for m in items if m.get("role") == "tool"]
    if fmt == "responses":
        return [m["call_id"] for m in items if m.get("type") == "function_call_output"]
    return [
        b["tool_use_id"]
        for m in items
        if isinstance(m.get("content"), list)
        for b in m["content"]
        if b.get("type") == "tool_result"
    ]


def only_insertions(old: bytes, new: bytes) -> bool:
    """``new`` is ``old`` with text inserted: ``old`` is a subsequence of it."""
    rest = iter(new)
    return all(byte in rest for byte in old)
