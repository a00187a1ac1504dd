"""Transcript repair: give a crashed agent the tool results it is missing, by replay only.

For each call without a result: find it in the ledger by (scope, tool_call_id), check the
transcript's arguments against the ledger's hash, and insert the receipt (DESIGN §6) in call
order, with the original id. Every check is made before anything is written: a call missing
from the ledger, conflicting arguments, or a state with no receipt yet stops the repair with
an error naming the call, and the transcript is untouched. A second repair adds nothing.

Everything else is preserved byte for byte: receipts are spliced into the original text at
the spans of the elements they follow (JSON) or as new lines (JSONL); nothing is re-serialised.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolledger.ledger.errors import ConflictError, InputError, LedgerError, NotFound
from toolledger.ledger.identity import args_sha256
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.receipts import receipt_for
from toolledger.ledger.records import Receipt
from toolledger.recovery.replay import FORMATS, REGISTRY, Batch, Call, Format, detect

_WS = " \t\r\n"
_DECODER = json.JSONDecoder()
ITEM_KEYS = ("messages", "input", "items", "output")


class TranscriptError(InputError):
    """The file cannot be read as a transcript."""


@dataclass
class RepairReport:
    format: str | None
    container: str
    calls: int = 0
    answered_before: int = 0
    inserted: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""

    @property
    def changed(self) -> bool:
        return bool(self.inserted)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "container": self.container,
            "calls": self.calls,
            "answered_before": self.answered_before,
            "inserted": self.inserted,
            "changed": self.changed,
        }


# -------------------------------------------------------------------------- spans


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _array_spans(text: str, i: int) -> list[tuple[int, int]]:
    """Spans of the elements of the JSON array whose '[' is at ``i``."""
    spans: list[tuple[int, int]] = []
    i = _skip(text, i + 1)
    if text[i] == "]":
        return spans
    while True:
        _, end = _DECODER.raw_decode(text, i)
        spans.append((i, end))
        i = _skip(text, end)
        if text[i] == "]":
            return spans
        i = _skip(text, i + 1)  # past ','


def _member_span(text: str, i: int, wanted: str) -> tuple[int, int] | None:
    """Span of the value of key ``wanted`` in the JSON object whose '{' is at ``i``."""
    i = _skip(text, i + 1)
    while text[i] != "}":
        key, end = _DECODER.raw_decode(text, i)
        i = _skip(text, _skip(text, end) + 1)  # past ':'
        _, vend = _DECODER.raw_decode(text, i)
        if key == wanted:
            return i, vend
        i = _skip(text, vend)
        if text[i] == ",":
            i = _skip(text, i + 1)
    return None


@dataclass
class Document:
    text: str
    container: str  # "json" | "jsonl"
    items: list[Any]
    spans: list[tuple[int, int]]
    newline: str = "\n"

    @classmethod
    def parse(cls, text: str) -> Document:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return cls._jsonl(text)
        start = _skip(text, 0)
        if isinstance(value, list):
            return cls(text, "json", value, _array_spans(text, start))
        if isinstance(value, dict):
            for key in ITEM_KEYS:
                if isinstance(value.get(key), list):
                    span = _member_span(text, start, key)
                    assert span is not None
                    return cls(text, "json", value[key], _array_spans(text, span[0]))
        raise TranscriptError(
            "a JSON transcript must be a list of messages, or an object with "
            f"one of {', '.join(ITEM_KEYS)}"
        )

    @classmethod
    def _jsonl(cls, text: str) -> Document:
        items, spans, pos = [], [], 0
        for number, line in enumerate(text.splitlines(keepends=True), 1):
            body = line.rstrip("\r\n")
            if body.strip():
                try:
                    items.append(json.loads(body))
                except json.JSONDecodeError as exc:
                    raise TranscriptError(f"line {number} is not JSON: {exc.msg}") from None
                spans.append((pos, pos + len(body)))
            pos += len(line)
        if not items:
            raise TranscriptError("the transcript is empty")
        return cls(text, "jsonl", items, spans, "\r\n" if "\r\n" in text else "\n")

    # ---------------------------------------------------------------------- insertions

    def _dump_like(self, value: Any, sibling: tuple[int, int], indent_ws: str) -> str:
        """``value`` as JSON, in the style of the sibling element it goes next to."""
        text = self.text[sibling[0] : sibling[1]]
        if "\n" not in text:
            compact = ", " not in text and ": " not in text
            separators = (",", ":") if compact else (", ", ": ")
            return json.dumps(value, ensure_ascii=False, separators=separators)
        base = indent_ws.rsplit("\n", 1)[-1]
        child = text.split("\n", 1)[1]
        unit = len(child) - len(child.lstrip(" \t")) - len(base)
        dumped = json.dumps(value, ensure_ascii=False, indent=unit if unit > 0 else 2)
        return dumped.replace("\n", "\n" + base)

    def _leading_ws(self, start: int) -> str:
        j = start
        while j > 0 and self.text[j - 1] in _WS:
            j -= 1
        return self.text[j:start]

    def after(self, span: tuple[int, int], values: list[Any]) -> tuple[int, str]:
        """Text that inserts ``values`` right after the element at ``span``."""
        if self.container == "jsonl":
            nl = self.newline
            lines = "".join(json.dumps(v, ensure_ascii=False) + nl for v in values)
            line_end = self.text.find("\n", span[1])
            if line_end == -1:  # the last line had no newline
                return len(self.text), nl + lines.rstrip("\r\n")
            return line_end + 1, lines
        ws = self._leading_ws(span[0])
        return span[1], "".join("," + ws + self._dump_like(v, span, ws) for v in values)

    def into_content(
        self, item: int, after_block: int | None, blocks: list[Any]
    ) -> tuple[int, str]:
        """Text that inserts ``blocks`` into item ``item``'s content list."""
        content = _member_span(self.text, self.spans[item][0], "content")
        assert content is not None
        block_spans = _array_spans(self.text, content[0])
        if after_block is not None:
            ws = self._leading_ws(block_spans[after_block][0])
            return block_spans[after_block][1], "".join(
                "," + ws + self._dump_like(b, block_spans[after_block], ws) for b in blocks
            )
        first = block_spans[0]
        ws = self._leading_ws(first[0])
        return first[0], "".join(self._dump_like(b, first, ws) + "," + ws for b in blocks)


def _apply(text: str, edits: list[tuple[int, str]]) -> str:
    for pos, piece in sorted(edits, key=lambda e: e[0], reverse=True):
        text = text[:pos] + piece + text[pos:]
    return text


# -------------------------------------------------------------------------- the ledger's side


def _receipt(ledger: Ledger, scope: str, call: Call) -> Receipt:
    """The receipt for a dangling call, after checking it against the ledger."""
    where = f"call {call.id!r} ({call.name})"
    try:
        view = ledger.get(scope, call.id)
    except NotFound:
        raise NotFound(
            f"{where} is not in the ledger of scope {scope!r}: recovery stops "
            "here; the transcript is unchanged"
        ) from None
    args = call.args
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise TranscriptError(f"{where}: its arguments are not JSON ({exc.msg})") from None
    op = view.operation
    try:
        sha = args_sha256(args)
    except InputError as exc:
        raise TranscriptError(f"{where}: {exc}") from None
    if sha != op.args_sha256 or call.name != op.tool:
        raise ConflictError(
            scope=scope,
            idempotency_key=op.idempotency_key,
            stored_sha256=op.args_sha256,
            requested_sha256=sha,
            detail=f"{where} in the transcript asks for "
            f"{'other arguments' if call.name == op.tool else 'tool ' + repr(op.tool)}; "
            "the transcript is unchanged",
        )
    try:
        return receipt_for(op, view.current)
    except LedgerError as exc:
        raise type(exc)(f"{where}: {exc}; the transcript is unchanged") from None


def repair_transcript(
    text: str, ledger: Ledger, scope: str, fmt: str | None = None
) -> RepairReport:
    """The transcript with every missing receipt inserted. Never executes anything."""
    if fmt is not None and fmt not in REGISTRY:
        raise TranscriptError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    doc = Document.parse(text)
    form = REGISTRY[fmt] if fmt is not None else detect(doc.items)
    report = RepairReport(form.name if form else None, doc.container, text=text)
    if form is None:
        return report
    try:
        every, batches = form.calls(doc.items)
    except (KeyError, TypeError, AttributeError) as exc:
        raise TranscriptError(f"not a well-formed {form.name} transcript: {exc!r}") from None
    dangling = sum(len(b.calls) for b in batches)
    report.calls, report.answered_before = len(every), len(every) - dangling
    planned = [(b, [(c, _receipt(ledger, scope, c)) for c in b.calls]) for b in batches]
    edits = [_edit(doc, form, batch, receipts) for batch, receipts in planned]
    report.text = _apply(text, edits)
    report.inserted = [
        {
            "tool_call_id": c.id,
            "tool": c.name,
            "status": r.status.value,
            "execution_id": r.execution_id,
        }
        for _, receipts in planned
        for c, r in receipts
    ]
    return report


def _edit(
    doc: Document, form: Format, batch: Batch, receipts: list[tuple[Call, Receipt]]
) -> tuple[int, str]:
    if batch.into_content is not None:
        assert form.blocks is not None, f"{form.name} has no content blocks"
        return doc.into_content(batch.into_content, batch.after_block, form.blocks(receipts))
    assert batch.after_item is not None
    return doc.after(doc.spans[batch.after_item], form.items(receipts))


def repair_file(
    path: Path, ledger: Ledger, scope: str, fmt: str | None = None, out: Path | None = None
) -> RepairReport:
    """Repair the transcript at ``path`` into ``out`` (default: in place, atomically).
    Nothing is written when nothing is missing and the target is the file itself."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise TranscriptError(f"{path} is not UTF-8 text") from None
    report = repair_transcript(text, ledger, scope, fmt)
    target = out or path
    if report.changed or target != path:
        _write_atomic(target, report.text)
    return report


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
