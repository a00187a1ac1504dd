"""The one input layer: what toolledger accepts from outside, written once.

Every entry point — the CLI, the Python API (``Ledger``, ``Submitter``), transcript repair, the
worker's messages — passes what it was given through these functions before anything is
recorded. A refusal is an :class:`~toolledger.ledger.errors.InputError` (exit 6 on the CLI)
whose one-line message names the field; nothing is written.

The rules:

- **Text is Unicode that UTF-8 can encode**: bytes must decode as strict UTF-8, and a string
  holding a lone surrogate (what Python makes of undecodable ``argv`` bytes) is refused.
- **JSON** is one value with no duplicate keys in any object (parsers disagree on which one
  wins), no ``NaN``/``Infinity``, nesting at most :data:`MAX_DEPTH` deep and integers within
  :data:`MAX_INT` (a signed 64-bit integer: what Postgres and SQLite store and JavaScript clients
  can nearly round-trip), object keys strings.
- **Identifiers** (tool_call_id, idempotency key, actor names) are non-empty, at most a cap of
  characters, with no control characters: C0, DEL, C1 (U+0080 to U+009F, U+0085 among them), the
  line and paragraph separators U+2028/U+2029, and the bidirectional overrides and isolates
  (U+202A to U+202E, U+2066 to U+2069) that make a printed id lie about its order.
- **Free text** (a reason) is at most :data:`MAX_TEXT` characters; newlines and tabs are
  allowed, every other control character is not (NUL included).
"""

from __future__ import annotations

import json
import re
from typing import Any, NoReturn

from toolledger.ledger.errors import InvalidArguments, InvalidIdentifier

#: Deepest nesting of objects and arrays accepted in any JSON input.
MAX_DEPTH = 64
#: Largest magnitude of an integer in any JSON input (signed 64-bit).
MAX_INT = 2**63 - 1
#: Longest free-text field (a reason), in characters.
MAX_TEXT = 4000
#: Longest actor name (approver, resolver), in characters.
MAX_ACTOR = 256

_ID_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_TEXT_FORBIDDEN = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_INT_DIGITS = len(str(MAX_INT))

#: Every character a person cannot see as itself (Unicode's control, format, line and
#: paragraph separator characters: Cc, Cf, Zl, Zp; bidirectional overrides and zero-width
#: characters among them), for Python's Unicode 14 (``tests/unit/test_input_text.py`` compares
#: it with ``unicodedata``), and the marks Unicode says to draw as nothing (``MARKS_UNSEEN``).
#: A path holding one is refused at submit, and the console shows each escaped
#: (``\u202e``): ``invoice\u202efdp.sh`` read as ``invoicehs.pdf`` on the page where a person
#: approves it (a cold review).
INVISIBLE = re.compile(
    r"[\x00-\x1f\x7f-\x9f\xad\u0600-\u0605\u061c\u06dd\u070f\u0890-\u0891\u08e2"
    r"\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb"
    r"\U000110bd\U000110cd\U00013430-\U00013438\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
    r"\U000e0001\U000e0020-\U000e007f"
    r"\u034f\u17b4\u17b5\u180b-\u180d\u180f\ufe00-\ufe0f\U000e0100-\U000e01ef]"
)
#: The nonspacing marks among Unicode's default-ignorable code points: the combining grapheme
#: joiner, two Khmer vowels, the Mongolian and the other variation selectors. Each is drawn as
#: nothing: ``c1``, ``c1\ufe0f`` and ``c1\U000e0100`` were four calls shown as one ``c1``, and
#: ``report.txt\ufe0f`` a path shown as ``report.txt`` (a cold review). (An emoji's selector
#: is escaped too, as its zero-width joiner always was.) The blank-looking letters among them
#: (U+115F, U+1160, U+3164, U+FFA0) are letters of a script and stay (README, "Known
#: limitations").
MARKS_UNSEEN = (0x034F, 0x17B4, 0x17B5, *range(0x180B, 0x180E), 0x180F,
                *range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0))  # fmt: skip


def shown(text: str, keep: str = "") -> str:
    """``text`` with each invisible character (``INVISIBLE``) but those in ``keep`` written as
    its escape, ``\\u202e``: what a person reads is what is there."""
    return INVISIBLE.sub(lambda m: m.group() if m.group() in keep else _escape(m.group()), text)


def shown_id(text: str) -> str:
    """An identifier (a scope, a tool call's id, a key, a name) as a person must read it to
    tell it from every other: each invisible character escaped (``shown``), a backslash typed
    before ``u`` or ``U`` written twice (so the typed ``zw\\u200b1`` is not the id holding a
    zero-width space), and each blank a reader cannot see or count escaped too: a space at
    either end or next to another space, and every other space character (U+00A0 and the
    like). ``"n16 "`` and ``"n16"`` are both accepted ids, and looked the same on the page
    where a person approves one of them and in the lists (a cold review)."""
    text = shown(TYPED_ESCAPE.sub(r"\\\\", text))
    return _UNSEEN_BLANKS.sub(lambda m: "".join(map(_escape, m.group())), text)


#: A backslash before ``u`` or ``U``: what ``shown``'s escapes start with.
TYPED_ESCAPE = re.compile(r"\\(?=[uU])")
#: Blanks nobody can count: leading, trailing or doubled spaces, and every other space.
_UNSEEN_BLANKS = re.compile(r"^\x20+|\x20+\Z|\x20(?=\x20)|(?<=\x20)\x20|[^\S\x20]")


def _escape(ch: str) -> str:
    n = ord(ch)
    return f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def _refuse(what: str, why: str, error: type[Exception] = InvalidArguments) -> NoReturn:
    raise error(f"{what}: {why}")


def decode(data: bytes, what: str) -> str:
    """Strict UTF-8 (a leading BOM dropped); anything else is refused, naming the offset."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        _refuse(what, f"not UTF-8 (byte {exc.start}: {data[exc.start : exc.start + 1]!r})")
    return text.removeprefix("\ufeff")


def check_encodable(text: str, what: str) -> str:
    """Refuse a string that UTF-8 cannot encode (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        _refuse(what, f"not valid Unicode (a lone surrogate at character {exc.start})")
    return text


def loads(text: str | bytes, what: str) -> Any:
    """Parse one JSON value under the rules above."""
    if isinstance(text, bytes):
        text = decode(text, what)
    check_encodable(text, what)

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            if k in out:
                _refuse(what, f"duplicate key {k!r} in one object")
            out[k] = v
        return out

    def constant(name: str) -> NoReturn:
        _refuse(what, f"not valid JSON: {name} is not allowed")

    def integer(digits: str) -> int:
        n = len(digits.lstrip("-"))
        if n > _INT_DIGITS or abs(int(digits)) > MAX_INT:
            _refuse(what, f"integer of {n} digits is out of range (±{MAX_INT})")
        return int(digits)

    try:
        value = json.loads(
            text, object_pairs_hook=pairs, parse_constant=constant, parse_int=integer
        )
    except json.JSONDecodeError as exc:
        _refuse(what, f"not valid JSON: {exc}")
    except RecursionError:
        _refuse(what, f"nested more than {MAX_DEPTH} levels deep")
    check_value(value, what)
    return value


def valid_text(value: Any) -> Any:
    """What toolledger stores of what it cannot refuse (a tool's result and error, what a
    reconciler found): ``value`` (JSON-shaped, or a string) with every string valid Unicode.
    A lone surrogate (an undecodable byte of a file name, as ``os.fsdecode`` gives it) cannot
    be stored: no database takes it, and a terminal write holding one would fail on every
    try, its call left running. It is written out as its escape, ``\\udcff``: readable,
    nothing dropped. ValueError if two keys of one object become one that way."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
        return value
    if isinstance(value, dict):
        out = {valid_text(k): valid_text(v) for k, v in value.items()}
        if len(out) != len(value):
            raise ValueError("two keys are one once their lone surrogates are escaped")
        return out
    if isinstance(value, list | tuple):
        return [valid_text(v) for v in value]
    return value


#: Values a JSON round trip gives back unchanged, type and all (a float can be NaN, a
#: subclass — an IntEnum, a str enum — comes back as its base type; a str only if ASCII:
#: storable as it is). An int only within 64 bits: past 4,300 digits ``json.dumps`` refuses.
_PLAIN = frozenset({bool, type(None)})
_INT_BOUND = 1 << 63


def _plain(value: Any) -> bool:
    kind = type(value)
    if kind is str:
        storable: bool = value.isascii()  # (a flag CPython keeps)
        return storable
    return kind in _PLAIN or (kind is int and -_INT_BOUND <= value < _INT_BOUND)


def storable_object(result: Any) -> dict[str, Any]:
    """What toolledger stores of a value a tool returned or a reconciler found: a JSON object
    (a tool must return one; be lenient), the JSON round trip of it, so that what is stored,
    replayed and compared is one object, its strings made storable (``valid_text``). What is
    not JSON, or cannot be made storable, is kept as its ``ascii()`` text with a warning."""
    value = result if isinstance(result, dict) else {"result": result}
    if type(value) is dict:
        # What most tools return, checked and copied from one snapshot (a thread the tool
        # started may still be changing its dict): the round trip would give an equal copy.
        items = list(value.items())
        if all(type(k) is str and k.isascii() and _plain(v) for k, v in items):
            return dict(items)
    try:
        text = json.dumps(value, allow_nan=False)
        out: dict[str, Any] = json.loads(text)
        # ASCII text escapes every string's surrogates, paired or lone: look closer only then
        return valid_text(out) if "\\ud" in text else out
    except (TypeError, ValueError, RecursionError):
        try:
            shown = ascii(result)[:2000]  # ASCII: no lone surrogate
        except (TypeError, ValueError, RecursionError):  # a 4,301-digit int, say
            shown = f"({type(result).__name__} could not be shown)"
        return {"result_repr": shown, "warning": "tool result was not JSON"}


def valid_line(text: str | None) -> str | None:
    """A tool's error message for a text column: ``valid_text``, and a NUL written as ``\\x00``
    (Postgres text refuses NUL; JSON columns keep it as ``\\u0000``, so results need not)."""
    if text is None:
        return None
    out: str = valid_text(text)
    return out.replace("\x00", "\\x00") if "\x00" in out else out


def check_value(value: Any, what: str) -> Any:
    """A JSON-able value within the rules: walked without recursion, so that any depth is
    refused cleanly rather than by the interpreter."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            check_encodable(item, what)
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            if abs(item) > MAX_INT:
                _refuse(what, f"integer out of range (±{MAX_INT})")
        elif isinstance(item, float):
            if item != item or item in (float("inf"), float("-inf")):
                _refuse(what, "not valid JSON: NaN and Infinity are not allowed")
        elif isinstance(item, dict | list | tuple):
            if depth > MAX_DEPTH:
                _refuse(what, f"nested more than {MAX_DEPTH} levels deep")
            if isinstance(item, dict):
                for k, v in item.items():
                    if not isinstance(k, str):
                        _refuse(what, f"object keys must be strings, not {type(k).__name__}")
                    check_encodable(k, what)
                    stack.append((v, depth + 1))
            else:
                stack.extend((v, depth + 1) for v in item)
        else:
            _refuse(what, f"{type(item).__name__} is not a JSON value")
    return value


def loads_object(text: str | bytes, what: str) -> dict[str, Any]:
    value = loads(text, what)
    if not isinstance(value, dict):
        _refuse(what, f"must be a JSON object, not {_json_type(value)}")
    return value


def loads_arguments(text: str, what: str) -> dict[str, Any]:
    """A model's tool-call ``arguments`` string: a JSON object, or blank (empty or white
    space: what models send for a tool without parameters, and what the OpenAI Agents SDK
    reads as ``{}``) for none. ``run_turn`` and ``repair`` both read a call's arguments
    through this, so a call one of them took the other finds (``repair`` refused ``""``)."""
    return {} if not text.strip() else loads_object(text, what)


def check_identifier(value: Any, what: str, max_len: int = 512) -> str:
    """Non-empty, at most ``max_len`` characters, encodable, no control characters."""
    if not isinstance(value, str) and value is not None:  # 7 was "must not be empty"
        _refuse(what, f"must be a string, not {type(value).__name__}", InvalidIdentifier)
    if not isinstance(value, str) or not value.strip():
        _refuse(what, "must not be empty", InvalidIdentifier)
    check_encodable_id(value, what)
    if len(value) > max_len:
        _refuse(what, f"{len(value)} characters, over the cap of {max_len}", InvalidIdentifier)
    bad = _ID_FORBIDDEN.search(value)
    if bad:
        why = f"control character U+{ord(bad.group()):04X} is not allowed"
        _refuse(what, why, InvalidIdentifier)
    return value


def check_encodable_id(value: str, what: str) -> str:
    try:
        return check_encodable(value, what)
    except InvalidArguments as exc:
        raise InvalidIdentifier(str(exc)) from None


def check_text(value: Any, what: str, max_len: int = MAX_TEXT) -> str | None:
    """Free text (None passes): a cap, encodable, newlines and tabs but no other control."""
    if value is None:
        return None
    if not isinstance(value, str):
        _refuse(what, f"must be text, not {type(value).__name__}")
    check_encodable(value, what)
    if len(value) > max_len:
        _refuse(what, f"{len(value)} characters, over the cap of {max_len}")
    bad = _TEXT_FORBIDDEN.search(value)
    if bad:
        _refuse(what, f"control character U+{ord(bad.group()):04X} is not allowed")
    return value


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


#: A timeout longer than this is no bound: waited as ``None`` (threading's own limit is some
#: 9.2e9 s, and ``inf`` or ``1e10`` raised OverflowError from every wait on Postgres and left
#: ``run_turn`` unable to answer a turn at all: a cold review).
FOREVER = 1e9


def wait_seconds(timeout: float | None) -> float | None:
    """A wait's ``timeout`` as the waits read it: ``None`` (or longer than ``FOREVER``, ``inf``
    too) waits without one; ``nan`` is refused (``ValueError``: it made the async waits read
    the database as fast as it answered, for ever, and sync ``run_turn`` time out at once)."""
    if timeout is None:
        return None
    seconds = float(timeout)
    if seconds != seconds:
        raise ValueError("timeout is nan: give seconds, or None to wait without one")
    return None if seconds > FOREVER else seconds
