"""Receipts as tool-result messages, per transcript format, and where a dangling call's
receipt goes. Three formats:

openai     chat completions: assistant ``tool_calls`` -> ``{"role": "tool", "tool_call_id"}``
responses  Responses API items: ``function_call`` -> ``function_call_output`` (``call_id``)
anthropic  messages: assistant ``tool_use`` blocks -> ``tool_result`` blocks in the next user turn

Reading a format is also checking it: every field repair decides by (a role, a type, an id, a
tool name, the arguments, a content list it may insert into) must have the shape the format
gives it, or the transcript is refused with one line naming the message and the field. A field
of the wrong type is never skipped: a result hidden that way would make repair answer a call
twice, and one skipped call would go unanswered. A tool call id may appear in one call only:
the ledger knows one call per id, so two calls with the same id cannot both be answered from
it, and answering both with one receipt would tell the model a lie about one of them.

A result answers its call only where the provider's API looks for it (chat: among the ``tool``
messages right after the call's assistant message; Anthropic: among the leading ``tool_result``
blocks of the user turn right after the call's turn; Responses: anywhere after the call). A
result elsewhere, a second result for one call, or a result for no call is refused: each was
counted as an answer, and repair exited 0 leaving a transcript the API refuses (a cold review).

A call of a kind toolledger never records (a Responses ``custom_tool_call``, ``computer_call``,
``local_shell_call``, ``shell_call`` or ``apply_patch_call``; a legacy chat ``function_call``)
left without its result is refused by repair (``Format.foreign``): passed over, it left a
transcript the API refuses, and exit 0 (a cold review). ``run_turn`` answers a turn's function
calls and leaves those to its caller, whose own code runs them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from toolledger.ledger.errors import InputError
from toolledger.ledger.records import Receipt

#: Names an item by its position, for error messages ("message 3", "line 7").
Where = Callable[[int], str]


class TranscriptError(InputError):
    """The file cannot be read as a transcript."""


def message_number(i: int) -> str:
    return f"message {i + 1}"


@dataclass(frozen=True)
class Call:
    """A tool call as the transcript states it."""

    id: str
    name: str
    args: Any  # as written: a JSON string (OpenAI) or an object (Anthropic)
    at: str = ""  # where it is, for messages ("message 3 tool_calls[0]")
    item: int = -1  # the index of the item holding it


@dataclass(frozen=True)
class Result:
    """A tool result as the transcript states it."""

    id: str
    at: str
    #: The item whose calls it answers, standing where it stands (None: no item's).
    turn: int | None


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


# -------------------------------------------------------------------------- shapes

_MISSING: Any = object()


def kind(value: Any) -> str:
    """The JSON name of a value's type, for messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return {dict: "an object", list: "an array", str: "a string", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def show(value: str, limit: int = 60) -> str:
    """An id quoted for a one-line message, however long or strange it is."""
    return repr(value if len(value) <= limit else value[:limit] + "…")


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TranscriptError(f"{where} must be an object, not {kind(value)}")
    return value


def _field(obj: dict[str, Any], key: str, where: str, types: tuple[type, ...], what: str) -> Any:
    """``obj[key]``, required, of one of ``types``."""
    value = obj.get(key, _MISSING)
    if value is _MISSING:
        raise TranscriptError(f"{where} has no {key!r}")
    if not isinstance(value, types):
        raise TranscriptError(f"{where}: {key!r} must be {what}, not {kind(value)}")
    return value


def _optional(
    obj: dict[str, Any], key: str, where: str, types: tuple[type, ...], what: str, default: Any
) -> Any:
    return _field(obj, key, where, types, what) if key in obj else default


def _text(obj: dict[str, Any], key: str, where: str) -> str:
    return str(_field(obj, key, where, (str,), "a string"))


def _id(obj: dict[str, Any], key: str, where: str) -> str:
    value = _text(obj, key, where)
    if not value.strip():
        raise TranscriptError(f"{where}: {key!r} is empty")
    return value


def _role(item: dict[str, Any], where: str) -> str:
    return _text(item, "role", where)


def _type(item: dict[str, Any], where: str) -> str | None:
    value: str | None = _optional(item, "type", where, (str,), "a string", None)
    return value


def _content(item: dict[str, Any], where: str, required: bool) -> Any:
    """A message's content: text or a list of parts (null allowed where it is optional)."""
    if not required and item.get("content") is None:
        return None
    return _field(item, "content", where, (str, list), "a string or an array")


def unique(calls: list[Call]) -> None:
    """Refuse a tool call id that names two calls (see the module docstring)."""
    seen: dict[str, Call] = {}
    for c in calls:
        if c.id in seen:
            raise TranscriptError(
                f"tool_call_id {show(c.id)} appears twice: {seen[c.id].at} and {c.at}"
            )
        seen[c.id] = c


def answered(calls: list[Call], results: list[Result], rule: str) -> set[str]:
    """The ids of the calls with a result; a result out of place (``rule`` says where it goes),
    a second one for a call, or one for no call is refused (see the module docstring)."""
    by_id = {c.id: c for c in calls}
    first: dict[str, Result] = {}
    for r in results:
        c = by_id.get(r.id)
        if c is None:
            raise TranscriptError(
                f"{r.at}: a result for tool_call_id {show(r.id)}, which no call has"
            )
        if r.id in first:
            raise TranscriptError(
                f"{r.at}: a second result for tool_call_id {show(r.id)} "
                f"(the first: {first[r.id].at})"
            )
        if r.turn != c.item:
            raise TranscriptError(
                f"{r.at}: the result for tool_call_id {show(r.id)} is out of place: {rule} "
                f"(its call: {c.at})"
            )
        first[r.id] = r
    return set(first)


# -------------------------------------------------------------------------- OpenAI chat


def openai_calls(items: list[Any], where: Where = message_number) -> tuple[list[Call], list[Batch]]:
    results: list[Result] = []
    turns: list[tuple[int, list[Call]]] = []
    run: int | None = None  # the assistant message the tool messages read so far follow
    for i, raw in enumerate(items):
        w = where(i)
        it = _object(raw, w)
        role = _role(it, w)
        _content(it, w, required=role == "tool")
        if role == "tool":
            results.append(Result(_id(it, "tool_call_id", w), w, run))
            continue
        run = None
        tool_calls = it.get("tool_calls")
        if role != "assistant" or tool_calls is None:
            continue
        if not isinstance(tool_calls, list):
            raise TranscriptError(f"{w}: 'tool_calls' must be an array, not {kind(tool_calls)}")
        calls = []
        for k, tc in enumerate(tool_calls):
            wk = f"{w} tool_calls[{k}]"
            tc = _object(tc, wk)
            fn = _object(_field(tc, "function", wk, (dict,), "an object"), f"{wk}.function")
            calls.append(
                Call(
                    _id(tc, "id", wk),
                    _text(fn, "name", f"{wk}.function"),
                    _optional(fn, "arguments", f"{wk}.function", (str,), "a string", "{}"),
                    wk,
                    i,
                )
            )
        run = i
        turns.append((i, calls))
    every = [c for _, calls in turns for c in calls]
    unique(every)
    done = answered(every, results, _CHAT_RULE)
    batches = []
    for i, calls in turns:
        missing = tuple(c for c in calls if c.id not in done)
        if missing:
            end = i
            while end + 1 < len(items) and items[end + 1].get("role") == "tool":
                end += 1
            batches.append(Batch(missing, after_item=end))
    return every, batches


_CHAT_RULE = "a tool message goes among the tool messages right after its call's message"


def openai_foreign(items: list[Any], where: Where = message_number) -> None:
    """Refuses a legacy ``function_call`` (the assistant message's, before ``tool_calls``)
    whose ``function`` message does not follow it: repair answers ``tool_calls`` only."""
    for i, it in enumerate(items):
        if not (isinstance(it, dict) and it.get("role") == "assistant"):
            continue
        if it.get("function_call") is None:
            continue
        after = items[i + 1] if i + 1 < len(items) else None
        if not (isinstance(after, dict) and after.get("role") == "function"):
            raise TranscriptError(
                f"{where(i)}: a legacy function_call without the 'function' message after "
                "it: repair answers tool_calls only (toolledger records no other kind); add "
                "its result, then repair"
            )


def openai_item(call: Call, receipt: Receipt) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call.id, "content": receipt_text(receipt)}


# -------------------------------------------------------------------------- Responses API

_RESPONSE_CALL_TYPES = ("function_call", "function_call_output")
#: Responses items of calls the client answers, other than function calls, and the output item
#: that answers each (``call_id``): toolledger records none of them (``Format.foreign``).
_OTHER_RESPONSE_CALLS = {
    "custom_tool_call": "custom_tool_call_output",
    "computer_call": "computer_call_output",
    "local_shell_call": "local_shell_call_output",
    "shell_call": "shell_call_output",
    "apply_patch_call": "apply_patch_call_output",
}
_OTHER_RESPONSE_OUTPUTS = {out: call for call, out in _OTHER_RESPONSE_CALLS.items()}


def responses_calls(
    items: list[Any], where: Where = message_number
) -> tuple[list[Call], list[Batch]]:
    outputs: list[tuple[int, str, str]] = []
    types: list[str | None] = []
    calls: dict[int, Call] = {}
    for i, raw in enumerate(items):
        w = where(i)
        it = _object(raw, w)
        t = _type(it, w)
        types.append(t)
        if t == "function_call":
            args = _optional(it, "arguments", w, (str,), "a string", "{}")
            calls[i] = Call(_id(it, "call_id", w), _text(it, "name", w), args, w, i)
        elif t == "function_call_output":
            outputs.append((i, _id(it, "call_id", w), w))
            _field(it, "output", w, (str, list), "a string or an array")
    every = list(calls.values())
    unique(every)
    item = {c.id: c.item for c in every}
    results = []
    for i, cid, w in outputs:
        at = item.get(cid)
        if at is None:
            # the output of a call the server holds (``previous_response_id``, an
            # ``item_reference``): the usual continuation, not a result for no call (a cold
            # review: refused as one); nothing here to answer or to pair it with
            continue
        # the API reads an output anywhere after its call: there, it answers the call's item
        results.append(Result(cid, w, at if at < i else None))
    done = answered(every, results, "a function_call_output goes after its function_call")
    batches, i = [], 0
    while i < len(items):
        if types[i] != "function_call":
            i += 1
            continue
        end = i
        while end + 1 < len(items) and types[end + 1] in _RESPONSE_CALL_TYPES:
            end += 1
        group = [calls[j] for j in range(i, end + 1) if j in calls]
        missing = tuple(c for c in group if c.id not in done)
        if missing:
            batches.append(Batch(missing, after_item=end))
        i = end + 1
    return every, batches


def responses_foreign(items: list[Any], where: Where = message_number) -> None:
    """Refuses a call of another kind than a function call (``_OTHER_RESPONSE_CALLS``) that
    no output of its kind follows: repair cannot answer it from the ledger."""
    waiting: dict[tuple[str, str], int] = {}  # (type, call_id) -> its item
    for i, it in enumerate(items):
        t = it.get("type") if isinstance(it, dict) else None
        if not isinstance(t, str):  # responses_calls refused every type that is not a string
            continue
        if t in _OTHER_RESPONSE_CALLS:
            waiting.setdefault((t, _id(it, "call_id", where(i))), i)
        elif t in _OTHER_RESPONSE_OUTPUTS:
            waiting.pop((_OTHER_RESPONSE_OUTPUTS[t], _id(it, "call_id", where(i))), None)
    for (t, cid), i in sorted(waiting.items(), key=lambda kv: kv[1]):
        raise TranscriptError(
            f"{where(i)}: a {t} ({show(cid)}) without its {_OTHER_RESPONSE_CALLS[t]}: repair "
            "answers function calls only (toolledger records no other kind); add its output, "
            "then repair"
        )


def responses_item(call: Call, receipt: Receipt) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call.id, "output": receipt_text(receipt)}


# -------------------------------------------------------------------------- Anthropic


def _anthropic_blocks(it: dict[str, Any], role: str, w: str) -> list[dict[str, Any]]:
    """The content blocks of one message, each checked as far as repair reads it."""
    content = _content(it, w, required=True)
    if isinstance(content, str):
        return []
    blocks = []
    for k, raw in enumerate(content):
        wk = f"{w} content[{k}]"
        block = _object(raw, wk)
        t = _text(block, "type", wk)
        if t == "tool_use":
            if role != "assistant":
                raise TranscriptError(f"{wk}: a tool_use block in a {role!r} turn")
            _id(block, "id", wk)
            _text(block, "name", wk)
            _optional(block, "input", wk, (dict,), "an object", {})
        elif t == "tool_result":
            if role != "user":
                raise TranscriptError(f"{wk}: a tool_result block in a {role!r} turn")
            _id(block, "tool_use_id", wk)
            _optional(block, "content", wk, (str, list), "a string or an array", None)
        blocks.append(block)
    return blocks


def anthropic_calls(
    items: list[Any], where: Where = message_number
) -> tuple[list[Call], list[Batch]]:
    # The API combines consecutive turns of one role into one turn: a turn here is a run of
    # items of one role, numbered by its first item (an assistant's calls in two items, or its
    # results in two user items, were refused as out of place: a cold review)
    results: list[Result] = []
    roles: list[str] = []
    runs: list[int] = []  # each item's turn: the first item of its run
    turns: dict[int, list[Call]] = {}  # an assistant turn's calls, by turn
    last: dict[int, int] = {}  # each turn's last item, by turn (one pass: see below)
    leading = False  # the current turn's blocks so far are all tool_result blocks
    for i, raw in enumerate(items):
        w = where(i)
        it = _object(raw, w)
        role = _role(it, w)
        if i and role == roles[-1]:
            runs.append(runs[-1])
        else:
            runs.append(i)
            leading = True
        roles.append(role)
        last[runs[-1]] = i
        blocks = _anthropic_blocks(it, role, w)
        if isinstance(it["content"], str) and it["content"]:
            # text: a text block of the combined turn, which no result then opens (a result
            # after it counted, exit 0, a transcript the API refuses: a cold review)
            leading = False
        # the API reads the tool_result blocks that open the turn after the calls' turn (an
        # assistant's: a tool_use block elsewhere is refused)
        before = runs[runs[-1] - 1] if runs[-1] else None
        for k, b in enumerate(blocks):
            if b["type"] != "tool_result":
                leading = False
                continue
            results.append(
                Result(b["tool_use_id"], f"{w} content[{k}]", before if leading else None)
            )
        calls = [
            Call(b["id"], b["name"], b.get("input", {}), f"{w} content[{k}]", runs[-1])
            for k, b in enumerate(blocks)
            if b["type"] == "tool_use"
        ]
        if calls:
            turns.setdefault(runs[-1], []).extend(calls)
    every = [c for calls in turns.values() for c in calls]
    unique(every)
    done = answered(every, results, _ANTHROPIC_RULE)
    batches = []
    for first, calls in turns.items():
        missing = tuple(c for c in calls if c.id not in done)
        if not missing:
            continue
        # the turn's last item (searched for in every item, turn by turn: 20,000 turns took
        # 46 s to read, a cold review)
        i = last[first]
        nxt = items[i + 1] if i + 1 < len(items) else None
        if nxt is not None and roles[i + 1] == "user" and isinstance(nxt["content"], list):
            # tool_result blocks must come first in the user turn: after those already there
            # (an empty turn, ``"content": []``, takes them as its first blocks)
            leading_blocks = 0
            for block in nxt["content"]:
                if block["type"] != "tool_result":
                    break
                leading_blocks += 1
            batches.append(
                Batch(
                    missing,
                    into_content=i + 1,
                    after_block=leading_blocks - 1 if leading_blocks else None,
                )
            )
        else:
            batches.append(Batch(missing, after_item=i))
    return every, batches


_ANTHROPIC_RULE = "tool_result blocks open the user turn right after their tool_use's turn"


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


def _has_block(item: dict[str, Any], *kinds: str) -> bool:
    content = item.get("content")
    return isinstance(content, list) and any(
        isinstance(b, dict) and b.get("type") in kinds for b in content
    )


# -------------------------------------------------------------------------- the formats


@dataclass(frozen=True)
class Format:
    """Everything repair knows about one transcript format; adding a format is adding one."""

    name: str
    #: Does this item (a dict) show that the transcript is in this format?
    recognises: Callable[[dict[str, Any]], bool]
    #: Every call, and the batches of calls still without a result; refuses (TranscriptError)
    #: a transcript whose shape repair cannot trust, naming the place with ``Where``.
    calls: Callable[[list[Any], Where], tuple[list[Call], list[Batch]]]
    #: The items to insert after ``Batch.after_item``.
    items: Callable[[list[tuple[Call, Receipt]]], list[dict[str, Any]]]
    #: The blocks to insert into ``Batch.into_content`` (formats with content blocks).
    blocks: Callable[[list[tuple[Call, Receipt]]], list[dict[str, Any]]] | None = None
    #: Refuses (TranscriptError) a call of a kind toolledger never records left without its
    #: result: repair's, since a whole transcript must answer every call; ``run_turn`` leaves
    #: such calls to its caller.
    foreign: Callable[[list[Any], Where], None] | None = None


#: (a tuple: a ``type`` that is a list or an object is compared, never hashed)
_RESPONSE_ITEM_TYPES = (*_RESPONSE_CALL_TYPES, *_OTHER_RESPONSE_CALLS, *_OTHER_RESPONSE_OUTPUTS)

#: The formats, in the order detection tries them on each item.
REGISTRY: dict[str, Format] = {
    f.name: f
    for f in (
        Format(
            "responses",
            lambda it: it.get("type") in _RESPONSE_ITEM_TYPES,
            responses_calls,
            lambda receipts: [responses_item(c, r) for c, r in receipts],
            foreign=responses_foreign,
        ),
        Format(
            "openai",
            lambda it: (
                it.get("role") in ("tool", "function")
                or bool(it.get("tool_calls"))
                or it.get("function_call") is not None
            ),
            openai_calls,
            lambda receipts: [openai_item(c, r) for c, r in receipts],
            foreign=openai_foreign,
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


def item_number(i: int) -> str:
    return f"item {i + 1}"


def detect(items: list[Any], where: Where = item_number) -> Format | None:
    """The format the items are written in, or None if they hold no tool call at all.
    Items of two formats are refused (TranscriptError): reading one would silently pass over
    the calls written in the other."""
    found: Format | None = None
    first = 0  # the item it was found in
    for i, it in enumerate(items):
        if not isinstance(it, dict):
            continue
        for fmt in REGISTRY.values():
            if not fmt.recognises(it):
                continue
            if found is None:
                found, first = fmt, i
            elif fmt is not found:
                either = (
                    f"{where(i)} is written in both {found.name} and {fmt.name} form"
                    if first == i
                    else f"{where(i)} is written in {fmt.name} form, {where(first)} in "
                    f"{found.name} form"
                )
                raise TranscriptError(f"{either}: one transcript, one format")
    return found
