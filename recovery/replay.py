"""Receipts as tool-result messages, per transcript format, and where a dangling call's
receipt goes. Three formats:

openai     chat completions: assistant ``tool_calls`` -> ``{"role": "tool", "tool_call_id"}``
responses  Responses API items: ``function_call`` -> ``function_call_output`` (``call_id``)
anthropic  messages: assistant ``tool_use`` blocks -> ``tool_result`` blocks in the next user turn
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from toolledger.ledger.records import Receipt


@dataclass(frozen=True)
class Call:
    """A tool call as the transcript states it."""

    id: str
    name: str
    args: Any  # as written: a JSON string (OpenAI) or an object (Anthropic)


@dataclass(frozen=True)
class Batch:
    """Calls of one model turn still without a result, and where their results go.

    ``after_item``: insert new items after that item. ``into_content``: insert blocks into the
    content list of that item, after block ``after_block`` (None: at the start).
    """

    calls: tuple[Call, ...]
    after_item: int | None = None
    into_content: int | None = None
    after_block: int | None = None


def receipt_text(receipt: Receipt) -> str:
    return json.dumps(receipt.content, ensure_ascii=False)


def _dicts(items: list[Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    return ((i, it) for i, it in enumerate(items) if isinstance(it, dict))


def _has_block(item: dict[str, Any], *kinds: str) -> bool:
    content = item.get("content")
    return isinstance(content, list) and any(
        isinstance(b, dict) and b.get("type") in kinds for b in content
    )


# -------------------------------------------------------------------------- OpenAI chat


def openai_calls(items: list[Any]) -> tuple[list[Call], list[Batch]]:
    answered = {it.get("tool_call_id") for _, it in _dicts(items) if it.get("role") == "tool"}
    every, batches = [], []
    for i, it in _dicts(items):
        if it.get("role") != "assistant" or not isinstance(it.get("tool_calls"), list):
            continue
        calls = [
            Call(tc["id"], tc["function"]["name"], tc["function"].get("arguments", "{}"))
            for tc in it["tool_calls"]
        ]
        every.extend(calls)
        missing = tuple(c for c in calls if c.id not in answered)
        if missing:
            end = i
            while end + 1 < len(items) and _role(items[end + 1]) == "tool":
                end += 1
            batches.append(Batch(missing, after_item=end))
    return every, batches


def openai_item(call: Call, receipt: Receipt) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call.id, "content": receipt_text(receipt)}


# -------------------------------------------------------------------------- Responses API

_RESPONSE_CALL_TYPES = ("function_call", "function_call_output")


def responses_calls(items: list[Any]) -> tuple[list[Call], list[Batch]]:
    answered = {
        it.get("call_id") for _, it in _dicts(items) if it.get("type") == "function_call_output"
    }
    every, batches, i = [], [], 0
    while i < len(items):
        if _type(items[i]) != "function_call":
            i += 1
            continue
        end = i
        while end + 1 < len(items) and _type(items[end + 1]) in _RESPONSE_CALL_TYPES:
            end += 1
        calls = [
            Call(it["call_id"], it["name"], it.get("arguments", "{}"))
            for it in items[i : end + 1]
            if _type(it) == "function_call"
        ]
        every.extend(calls)
        missing = tuple(c for c in calls if c.id not in answered)
        if missing:
            batches.append(Batch(missing, after_item=end))
        i = end + 1
    return every, batches


def responses_item(call: Call, receipt: Receipt) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call.id, "output": receipt_text(receipt)}


# -------------------------------------------------------------------------- Anthropic


def _blocks(item: Any, kind: str) -> list[dict[str, Any]]:
    content = item.get("content") if isinstance(item, dict) else None
    if not isinstance(content, list):
        return []
    return [b for b in content if isinstance(b, dict) and b.get("type") == kind]


def anthropic_calls(items: list[Any]) -> tuple[list[Call], list[Batch]]:
    answered = {b.get("tool_use_id") for it in items for b in _blocks(it, "tool_result")}
    every, batches = [], []
    for i, it in _dicts(items):
        if it.get("role") != "assistant":
            continue
        calls = [Call(b["id"], b["name"], b.get("input", {})) for b in _blocks(it, "tool_use")]
        every.extend(calls)
        missing = tuple(c for c in calls if c.id not in answered)
        if not missing:
            continue
        nxt = items[i + 1] if i + 1 < len(items) else None
        if _role(nxt) == "user" and isinstance(nxt.get("content"), list):  # type: ignore[union-attr]
            leading = 0  # tool_result blocks must come first in the user turn
            for block in nxt["content"]:  # type: ignore[index]
                if not (isinstance(block, dict) and block.get("type") == "tool_result"):
                    break
                leading += 1
            batches.append(
                Batch(missing, into_content=i + 1, after_block=leading - 1 if leading else None)
            )
        else:
            batches.append(Batch(missing, after_item=i))
    return every, batches


def anthropic_block(call: Call, receipt: Receipt) -> dict[str, Any]:
    block: dict[str, Any] = {
        "type": "tool_result",
        "tool_use_id": call.id,
        "content": receipt_text(receipt),
    }
    if receipt.is_error:
        block["is_error"] = True
    return block


def anthropic_item(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    return {"role": "user", "content": blocks}


def _role(item: Any) -> Any:
    return item.get("role") if isinstance(item, dict) else None


def _type(item: Any) -> Any:
    return item.get("type") if isinstance(item, dict) else None


# -------------------------------------------------------------------------- the formats


@dataclass(frozen=True)
class Format:
    """Everything repair knows about one transcript format; adding a format is adding one."""

    name: str
    #: Does this item (a dict) show that the transcript is in this format?
    recognises: Callable[[dict[str, Any]], bool]
    #: Every call, and the batches of calls still without a result.
    calls: Callable[[list[Any]], tuple[list[Call], list[Batch]]]
    #: The items to insert after ``Batch.after_item``.
    items: Callable[[list[tuple[Call, Receipt]]], list[dict[str, Any]]]
    #: The blocks to insert into ``Batch.into_content`` (formats with content blocks).
    blocks: Callable[[list[tuple[Call, Receipt]]], list[dict[str, Any]]] | None = None


#: The formats, in the order detection tries them on each item.
REGISTRY: dict[str, Format] = {
    f.name: f
    for f in (
        Format(
            "responses",
            lambda it: it.get("type") in _RESPONSE_CALL_TYPES,
            responses_calls,
            lambda receipts: [responses_item(c, r) for c, r in receipts],
        ),
        Format(
            "openai",
            lambda it: it.get("role") == "tool" or bool(it.get("tool_calls")),
            openai_calls,
            lambda receipts: [openai_item(c, r) for c, r in receipts],
        ),
        Format(
            "anthropic",
            lambda it: _has_block(it, "tool_use", "tool_result"),
            anthropic_calls,
            lambda receipts: [anthropic_item([anthropic_block(c, r) for c, r in receipts])],
            lambda receipts: [anthropic_block(c, r) for c, r in receipts],
        ),
    )
}
FORMATS = tuple(REGISTRY)


def detect(items: list[Any]) -> Format | None:
    """The format the items are written in, or None if they hold no tool call at all."""
    for _, it in _dicts(items):
        for fmt in REGISTRY.values():
            if fmt.recognises(it):
                return fmt
    return None
