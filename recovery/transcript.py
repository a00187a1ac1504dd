"""Transcript repair: give a crashed agent the tool results it is missing, by replay only.

For each call without a result: find it in the ledger by (scope, tool_call_id), check the
transcript's arguments against the ledger's hash, and insert the receipt (DESIGN §6) in call
order, with the original id. Every check is made before anything is written: a call missing
from the ledger, conflicting arguments, or a state with no receipt yet stops the repair with
an error naming the call, and the transcript is untouched. A second repair adds nothing.

Everything else is preserved byte for byte: receipts are spliced into the original text at
the spans of the elements they follow (JSON) or as new lines (JSONL); nothing is re-serialised.

What repair reads, it reads under the input layer's rules (``toolledger.ledger.inputs``), and
it refuses (``TranscriptError``, exit 6, one line, the file untouched) rather than guess:

- The file is read as bytes and must be strict UTF-8 (a leading BOM is kept as it is).
- JSON: no duplicate key in any object, no NaN, nesting at most 64 deep, integers within
  64 bits, no lone surrogate (``"\\udcff"``). Duplicate keys are refused, not resolved: a
  parser keeps the last ``"messages"`` (or ``"content"``) while a splice lands in one of them,
  so no choice of ours agrees with every reader of the file.
- JSONL is split on ``"\\n"`` only (``"\\r\\n"`` tolerated): U+2028, U+0085, form feeds and the
  like are characters inside strings, not line ends.
- The shape of every field repair decides by (``toolledger.recovery.replay``), one call per
  tool call id, and each result where the provider's API reads it, one per call.
- One format: detected even when ``--format`` names one, and refused if it finds two, or
  another than the one named.
- A symbolic link is never written to: repair replaces the file it writes (atomically), which
  would turn the link into a regular file; pass the link's target instead. Reading through a
  link (``--out`` elsewhere, or ``-``) is fine.

An Anthropic user turn with no blocks (``"content": []``) after a dangling ``tool_use``
receives the ``tool_result`` blocks, as the turn the API expects them in.

What repair writes, it reads back first: the repaired text is parsed again as the next repair
would parse it, and must hold the same calls, all answered, in the same format; otherwise
nothing is written (``RepairError``, a bug, exit 1). Inserted JSON escapes U+2028, U+2029 and
U+0085, so a reader that splits lines on them (``str.splitlines``, JavaScript) agrees with us.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolledger.ledger import inputs
from toolledger.ledger.errors import (
    ConflictError,
    CorruptRecord,
    InputError,
    LedgerError,
    NotFound,
    StateError,
)
from toolledger.ledger.identity import args_sha256, check_scope, check_text_id
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.receipts import receipt_for
from toolledger.ledger.records import Receipt
from toolledger.recovery.replay import (
    FORMATS,
    REGISTRY,
    Batch,
    Call,
    Format,
    TranscriptError,
    detect,
    kind,
    message_number,
    receipt_text,
    show,
)

__all__ = [
    "RepairError",
    "RepairReport",
    "TranscriptChanged",
    "TranscriptError",
    "repair_file",
    "repair_transcript",
]

_WS = " \t\r\n"
ITEM_KEYS = ("messages", "input", "items", "output")
_BOM = "\ufeff"
#: Characters some readers take for line ends inside a JSON string; escaped in what we insert.
_LINE_ENDS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


class RepairError(LedgerError):
    """Repair would have written a transcript it cannot read back; nothing was written."""


class TranscriptChanged(StateError):
    """The transcript changed while repair read the ledger; nothing was written."""


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


# -------------------------------------------------------------------------- reading


def _nothing(_value: Any) -> None:
    return None


#: Reads JSON syntax only: builds no object and converts no number, so that a duplicate key or
#: a huge integer cannot fail here; the input layer's rules are applied afterwards.
_SCANNER = json.JSONDecoder(
    object_pairs_hook=_nothing, parse_float=_nothing, parse_int=_nothing, parse_constant=_nothing
)


def _value_end(text: str, i: int) -> int:
    """Where the JSON value that starts at ``i`` ends (RecursionError if absurdly deep)."""
    return int(_SCANNER.raw_decode(text, i)[1])


def _too_deep(what: str) -> TranscriptError:
    return TranscriptError(f"{what}: nested more than {inputs.MAX_DEPTH} levels deep")


def _rules(text: str, what: str) -> Any:
    """``text`` (one JSON value, syntax already read) under the input layer's rules."""
    try:
        return inputs.loads(text, what)
    except InputError as exc:
        raise TranscriptError(str(exc)) from None


def _decode(data: str | bytes, name: str) -> tuple[str, str]:
    """(BOM, text after it): strict UTF-8, no lone surrogate."""
    try:
        if isinstance(data, bytes):
            inputs.decode(data, name)  # refuses, naming the offending byte
            text = data.decode("utf-8")
        else:
            text = data
        inputs.check_encodable(text, name)
    except InputError as exc:
        raise TranscriptError(str(exc)) from None
    bom = _BOM if text.startswith(_BOM) else ""
    return bom, text[len(bom) :]


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _array_spans(text: str, i: int) -> list[tuple[int, int]]:
    """Spans of the elements of the JSON array whose '[' is at ``i`` (text already valid)."""
    spans: list[tuple[int, int]] = []
    i = _skip(text, i + 1)
    if text[i] == "]":
        return spans
    while True:
        end = _value_end(text, i)
        spans.append((i, end))
        i = _skip(text, end)
        if text[i] == "]":
            return spans
        i = _skip(text, i + 1)  # past ','


def _member_span(text: str, i: int, wanted: str) -> tuple[int, int] | None:
    """Span of the value of key ``wanted`` in the JSON object whose '{' is at ``i``."""
    i = _skip(text, i + 1)
    while text[i] != "}":
        key, end = _SCANNER.raw_decode(text, i)
        i = _skip(text, _skip(text, end) + 1)  # past ':'
        vend = _value_end(text, i)
        if key == wanted:
            return i, vend
        i = _skip(text, vend)
        if text[i] == ",":
            i = _skip(text, i + 1)
    return None


def _one_item_line(value: Any, body: str) -> bool:
    """A single JSON object on one line that is a message or an item (``role``, ``type``),
    not a container holding them: a JSONL transcript of one line."""
    return (
        isinstance(value, dict)
        and "\n" not in body
        and not any(k in value for k in ITEM_KEYS)
        and ("role" in value or "type" in value)
    )


def _dumps(value: Any, **kwargs: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, **kwargs).translate(_LINE_ENDS)


@dataclass
class Document:
    text: str
    container: str  # "json" | "jsonl"
    items: list[Any]
    spans: list[tuple[int, int]]
    newline: str = "\n"
    lines: list[int] = field(default_factory=list)  # JSONL: the line number of each item

    @classmethod
    def parse(cls, text: str, name: str = "transcript") -> Document:
        """One JSON value (a list of messages, or an object holding one), else JSONL."""
        start = _skip(text, 0)
        if start == len(text):
            raise TranscriptError(f"{name}: the transcript is empty")
        try:
            end = _value_end(text, start)
        except json.JSONDecodeError as exc:
            raise TranscriptError(
                f"{name}: line {exc.lineno} is not JSON: {exc.msg} (column {exc.colno})"
            ) from None
        except RecursionError:
            raise _too_deep(name) from None
        if _skip(text, end) < len(text):  # more after the first value: one value a line
            return cls._jsonl(text, name)
        value = _rules(text, name)
        if _one_item_line(value, text[start:end]):
            # JSONL of one line, a message or an item: an agent killed right after writing
            # its first line, the model's calls, left it so; read as one JSON value it was
            # refused as a transcript (exit 6), its calls never answered
            return cls._jsonl(text, name)
        if isinstance(value, list):
            doc = cls(text, "json", value, _array_spans(text, start))
        elif isinstance(value, dict) and any(isinstance(value.get(k), list) for k in ITEM_KEYS):
            keys = [k for k in ITEM_KEYS if isinstance(value.get(k), list)]
            if len(keys) > 1 and keys != ["input", "output"]:
                # reading one would pass over the other's calls (it read the first alone)
                raise TranscriptError(
                    f"{name}: the object holds {' and '.join(repr(k) for k in keys)}: a "
                    "transcript is one list of messages (or a Responses request's 'input' "
                    "with its 'output')"
                )
            # a Responses request and its response, as logged: 'input', then 'output' (only
            # 'input' was read, and the calls of 'output' were passed over: a cold review)
            items: list[Any] = []
            spans: list[tuple[int, int]] = []
            for key in keys:
                span = _member_span(text, start, key)
                if span is None:  # cannot be: the key was just read, and keys are unique
                    raise RepairError(f"{name}: {key!r} was read but not found again")
                items += value[key]
                spans += _array_spans(text, span[0])
            doc = cls(text, "json", items, spans)
        elif isinstance(value, dict) and any(k in value for k in ITEM_KEYS):
            key = next(k for k in ITEM_KEYS if k in value)
            raise TranscriptError(
                f"{name}: {key!r} must be an array of messages, not {kind(value[key])}"
            )
        else:
            raise TranscriptError(
                f"{name}: a JSON transcript must be a list of messages, or an object with "
                f"one of {', '.join(ITEM_KEYS)}"
            )
        doc.check_items(name)
        return doc

    @classmethod
    def _jsonl(cls, text: str, name: str) -> Document:
        items, spans, numbers, pos = [], [], [], 0
        for number, line in enumerate(text.split("\n"), 1):
            body = line.removesuffix("\r")
            if body.strip(_WS):
                what = f"{name}: line {number}"
                lead = len(body) - len(body.lstrip(_WS))
                try:
                    end = _value_end(body, lead)
                except json.JSONDecodeError as exc:
                    raise TranscriptError(
                        f"{name}: line {number} is not JSON: {exc.msg} (column {exc.colno})"
                    ) from None
                except RecursionError:
                    raise _too_deep(what) from None
                if _skip(body, end) < len(body):
                    raise TranscriptError(
                        f"{name}: line {number} is not JSON: more than one value (column {end + 1})"
                    )
                items.append(_rules(body, what))
                spans.append((pos + lead, pos + end))
                numbers.append(number)
            pos += len(line) + 1
        if not items:
            raise TranscriptError(f"{name}: the transcript is empty")
        doc = cls(text, "jsonl", items, spans, "\r\n" if "\r\n" in text else "\n", numbers)
        doc.check_items(name)
        return doc

    def where(self, i: int) -> str:
        """Item ``i`` as a person finds it: its line in JSONL, its number in JSON."""
        return f"line {self.lines[i]}" if self.container == "jsonl" else message_number(i)

    def check_items(self, name: str) -> None:
        if len(self.spans) != len(self.items):  # cannot be, with duplicate keys refused
            raise RepairError(f"{name}: {len(self.items)} messages read, {len(self.spans)} found")
        for i, item in enumerate(self.items):
            if not isinstance(item, dict):
                raise TranscriptError(
                    f"{name}: {self.where(i)} must be an object, not {kind(item)}"
                )

    # ---------------------------------------------------------------------- insertions

    def _dump_like(self, value: Any, sibling: tuple[int, int], indent_ws: str) -> str:
        """``value`` as JSON, in the style of the sibling element it goes next to."""
        text = self.text[sibling[0] : sibling[1]]
        if "\n" not in text:
            compact = ", " not in text and ": " not in text
            return _dumps(value, separators=(",", ":") if compact else (", ", ": "))
        base = indent_ws.rsplit("\n", 1)[-1]
        child = text.split("\n", 1)[1]
        child_ws = child[: len(child) - len(child.lstrip(" \t"))]
        # the sibling's own indent unit, tabs as tabs (counted as characters, a tab-indented
        # transcript had its inserted members indented by one space: a cold review)
        unit = child_ws[len(base) :] if child_ws.startswith(base) else ""
        dumped = _dumps(value, indent=unit or 2)
        newline = "\r\n" if text.split("\n", 1)[0].endswith("\r") else "\n"
        return dumped.replace("\n", newline + base)

    def _leading_ws(self, start: int) -> str:
        j = start
        while j > 0 and self.text[j - 1] in _WS:
            j -= 1
        return self.text[j:start]

    def after(self, span: tuple[int, int], values: list[Any]) -> tuple[int, str]:
        """Text that inserts ``values`` right after the element at ``span``."""
        if self.container == "jsonl":
            nl = self.newline
            lines = "".join(_dumps(v) + nl for v in values)
            line_end = self.text.find("\n", span[1])
            if line_end == -1:  # the last line had no newline
                return len(self.text), nl + lines.removesuffix(nl)
            return line_end + 1, lines
        ws = self._leading_ws(span[0])
        return span[1], "".join("," + ws + self._dump_like(v, span, ws) for v in values)

    def into_content(
        self, item: int, after_block: int | None, blocks: list[Any]
    ) -> tuple[int, str]:
        """Text that inserts ``blocks`` into item ``item``'s content list."""
        content = _member_span(self.text, self.spans[item][0], "content")
        if content is None:  # cannot be: the format checked that the content is a list
            raise RepairError(f"message {item + 1} has no content to insert into")
        block_spans = _array_spans(self.text, content[0])
        if not block_spans:  # "content": [] - the blocks become its only ones, on one line
            style = self.text[self.spans[item][0] : self.spans[item][1]]
            spaced = "\n" in style or ", " in style or ": " in style
            seps = (", ", ": ") if spaced else (",", ":")
            return content[0] + 1, seps[0].join(_dumps(b, separators=seps) for b in blocks)
        if after_block is not None:
            ws = self._leading_ws(block_spans[after_block][0])
            return block_spans[after_block][1], "".join(
                "," + ws + self._dump_like(b, block_spans[after_block], ws) for b in blocks
            )
        first = block_spans[0]
        ws = self._leading_ws(first[0])
        return first[0], "".join(self._dump_like(b, first, ws) + "," + ws for b in blocks)


def _apply(text: str, edits: list[tuple[int, str]]) -> str:
    """``text`` with each piece inserted at its position (pieces at one position in their
    order), built in one pass: splicing them one by one copied the whole text per receipt, and
    a transcript of 12 MB missing 10,000 results took 73 s here (a cold review)."""
    parts: list[str] = []
    done = 0
    for pos, piece in sorted(edits, key=lambda e: e[0]):
        parts += (text[done:pos], piece)
        done = pos
    parts.append(text[done:])
    return "".join(parts)


# -------------------------------------------------------------------------- the ledger's side


def _receipt(ledger: Ledger, scope: str, call: Call, name: str) -> Receipt:
    """The receipt for a dangling call, after checking it against the ledger."""
    where = f"call {show(call.id)} ({show(call.name)})"
    try:
        check_text_id(call.id, "tool_call_id", 256)
    except InputError as exc:
        raise TranscriptError(f"{name}: {call.at}: {exc}") from None
    try:
        view = ledger.get(scope, call.id)
    except NotFound:
        raise NotFound(
            f"{where} is not in the ledger of scope {scope!r}: recovery stops "
            "here; the transcript is unchanged (a read-only tool's call is never recorded: "
            "run the read again and put its result in the transcript, then repair the rest; "
            "else, is --scope right?)"
        ) from None
    args = call.args
    try:
        if isinstance(args, str):
            args = inputs.loads_arguments(args, f"{name}: {call.at}: the arguments of {where}")
        sha = args_sha256(args)
    except InputError as exc:
        raise TranscriptError(str(exc)) from None
    op = view.operation
    if sha != op.args_sha256 or call.name != op.tool:
        raise ConflictError(
            scope=scope,
            idempotency_key=op.idempotency_key,
            stored_sha256=op.args_sha256,
            requested_sha256=sha,
            stored_tool=op.tool,
            requested_tool=call.name,
            detail=f"{where} in the transcript asks for "
            f"{'other arguments' if call.name == op.tool else 'another tool'}; "
            "the transcript is unchanged",
        )
    try:
        receipt = receipt_for(op, view.current, flags=view.flags)
    except LedgerError as exc:
        raise type(exc)(f"{where}: {exc}; the transcript is unchanged") from None
    try:
        receipt_text(receipt).encode("utf-8")
    except (UnicodeEncodeError, ValueError, TypeError):
        raise CorruptRecord(
            f"{where}: its receipt in the ledger is not UTF-8 JSON; the transcript is unchanged"
        ) from None
    return receipt


def repair_transcript(
    data: str | bytes,
    ledger: Ledger,
    scope: str,
    fmt: str | None = None,
    *,
    name: str = "transcript",
) -> RepairReport:
    """The transcript with every missing receipt inserted. Never executes anything.

    ``data`` is best given as the file's bytes (strict UTF-8 is then checked here); ``name``
    starts every error message (the CLI passes the path).
    """
    if fmt is not None and fmt not in REGISTRY:
        raise TranscriptError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    check_scope(scope)
    bom, text = _decode(data, name)
    doc = Document.parse(text, name)
    # detected even when chosen: a mixed transcript read in the chosen format had the other
    # format's calls passed over, "1 call" and exit 0 (a cold review)
    found = _detect(doc, name)
    form = REGISTRY[fmt] if fmt is not None else found
    report = RepairReport(form.name if form else None, doc.container, text=bom + text)
    if form is None:
        return report
    # the format named checked against the one detected before the text is read in it: read
    # first, an OpenAI call's "content": null failed as a malformed Anthropic message, an
    # error that named no format (a cold review of the README)
    _check_chosen(found, form, name)
    every, batches = _calls(doc, form, name)
    dangling = sum(len(b.calls) for b in batches)
    report.calls, report.answered_before = len(every), len(every) - dangling
    planned = [(b, [(c, _receipt(ledger, scope, c, name)) for c in b.calls]) for b in batches]
    if not planned:
        return report
    repaired = _apply(text, [_edit(doc, form, batch, receipts) for batch, receipts in planned])
    _read_back(repaired, doc, form, name, len(every))
    report.text = bom + repaired
    report.inserted = [
        {
            "tool_call_id": c.id,
            "tool": c.name,
            "status": r.status.value,
            "execution_id": r.execution_id,
            "review": r.review,  # a flagged call's receipt may change at its review
        }
        for _, receipts in planned
        for c, r in receipts
    ]
    return report


def _detect(doc: Document, name: str) -> Format | None:
    try:
        return detect(doc.items, doc.where)
    except TranscriptError as exc:
        raise TranscriptError(f"{name}: {exc}") from None


def _check_chosen(found: Format | None, form: Format, name: str) -> None:
    """A format chosen with ``--format`` where the transcript reads as another: refused (it
    said "0 calls" and exit 0, the calls left unanswered: a cold review)."""
    if found is not None and found is not form:
        raise TranscriptError(
            f"{name}: --format {form.name}, but it reads as {found.name}, whose calls "
            f"--format {form.name} would pass over; leave --format out, or give "
            f"--format {found.name}"
        )


def _calls(doc: Document, form: Format, name: str) -> tuple[list[Call], list[Batch]]:
    """Every call, and the batches still without a result; a call repair cannot answer
    (``Format.foreign``) left without its result is refused."""
    try:
        found = form.calls(doc.items, doc.where)
        if form.foreign is not None:
            form.foreign(doc.items, doc.where)
    except TranscriptError as exc:
        raise TranscriptError(f"{name}: {exc}") from None
    return found


def _read_back(text: str, before: Document, form: Format, name: str, calls: int) -> None:
    """Parse the repaired text as the next repair will, or write nothing: the same container,
    the same format detected, the same calls, none unanswered."""
    try:
        doc = Document.parse(text, name)
        every, batches = _calls(doc, form, name)
    except InputError as exc:
        why = str(exc)
    else:
        why = ""
        if doc.container != before.container:
            why = f"it reads as {doc.container}, not {before.container}"
        elif detect(doc.items) is not form:
            why = "its format is detected differently"
        elif len(every) != calls:
            why = f"{len(every)} calls instead of {calls}"
        elif batches:
            why = f"{sum(len(b.calls) for b in batches)} calls still without a result"
    if why:
        raise RepairError(
            f"{name}: the repaired transcript would not read back ({why}); "
            "nothing was written - please report this"
        )


def _edit(
    doc: Document, form: Format, batch: Batch, receipts: list[tuple[Call, Receipt]]
) -> tuple[int, str]:
    if batch.into_content is not None:
        if form.blocks is None:
            raise RepairError(f"{form.name} has no content blocks to insert into")
        return doc.into_content(batch.into_content, batch.after_block, form.blocks(receipts))
    if batch.after_item is None:
        raise RepairError(f"{form.name}: a batch with nowhere to go")
    return doc.after(doc.spans[batch.after_item], form.items(receipts))


# -------------------------------------------------------------------------- files


def check_writable(path: Path) -> None:
    """Refuse to replace a symbolic link (it would become a regular file) or anything that is
    not a regular file (a device, a FIFO): repair writes by atomic rename."""
    if path.is_symlink():
        raise TranscriptError(
            f"{path} is a symbolic link; pass its target ({os.path.realpath(path)})"
        )
    if path.exists() and not path.is_file():
        raise TranscriptError(f"{path} is not a regular file")
    if not path.parent.is_dir():  # a mistyped --out made the folders it named (a review)
        raise TranscriptError(f"{path.parent} is not a folder: nothing was written")


#: The most a transcript may hold: a file past it (``/dev/zero``, a stream that never ends)
#: is refused once the cap is passed, not read until memory runs out (a cold review).
MAX_TRANSCRIPT_BYTES = 256 * 1024 * 1024


def read_transcript(path: Path, limit: int | None = None) -> bytes:
    """The bytes at ``path``, at most ``limit`` of them (``MAX_TRANSCRIPT_BYTES`` by default;
    ``TranscriptError`` past it): a pipe (``/dev/stdin``) is read as a file is."""
    limit = MAX_TRANSCRIPT_BYTES if limit is None else limit
    with open(path, "rb") as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise TranscriptError(f"{path}: more than {limit:,} bytes, not a transcript repair reads")
    return data


def repair_file(
    path: Path, ledger: Ledger, scope: str, fmt: str | None = None, out: Path | None = None
) -> RepairReport:
    """Repair the transcript at ``path`` into ``out`` (default: in place, atomically).
    Nothing is written when nothing is missing and the target is the file itself."""
    target = out or path
    check_writable(target)
    in_place = target == path or (target.exists() and os.path.samefile(target, path))
    data = read_transcript(path)
    report = repair_transcript(data, ledger, scope, fmt, name=str(path))
    if in_place and report.changed and read_transcript(path) != data:
        # written to meanwhile (an agent restarted while repair read the ledger): replacing
        # it dropped what was added, an assistant turn among it, whose calls the model was
        # then asked for again, under new ids (exit 0: a cold review). A write after this
        # look is still lost: repair a transcript that its agent no longer writes
        raise TranscriptChanged(
            f"{path}: the transcript changed while repair read the ledger (is its agent "
            "running?); nothing was written: repair it again once nothing writes it"
        )
    if report.changed or not in_place:
        _write_atomic(target, report.text)
    return report


def _write_atomic(path: Path, text: str) -> None:
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
    # the rename made durable too: without the folder's fsync a power loss (not a crash) could
    # bring the old transcript back, its receipts missing again (a cold review, 2026-12-07)
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
