"""The input layer on text: the characters nobody sees as themselves, identifiers of the wrong type."""

from __future__ import annotations

import sys
import unicodedata

from toolledger.ledger.inputs import INVISIBLE, MARKS_UNSEEN, shown, shown_id


def test_invisible__is_every_control_format_and_separator_character_and_no_other():
    categories = {"Cc", "Cf", "Zl", "Zp"}
    wrong = [
        f"U+{n:04X} {unicodedata.category(chr(n))}"
        for n in range(sys.maxunicode + 1)
        if (unicodedata.category(chr(n)) in categories or n in MARKS_UNSEEN)
        != bool(INVISIBLE.fullmatch(chr(n)))
    ]
    assert not wrong, (unicodedata.unidata_version, wrong[:10])


def test_invisible__marks_drawn_as_nothing_are_marks_and_escaped():
    """Variation selectors and their kin: four ids shown as one ``c1`` (a cold review)."""
    assert all(unicodedata.category(chr(n)) == "Mn" for n in MARKS_UNSEEN)
    assert len(MARKS_UNSEEN) == 1 + 2 + 3 + 1 + 16 + 240
    for mark in ("\ufe0f", "\u034f", "\u180b", "\U000e0100"):
        assert shown(f"c1{mark}") != "c1"
    assert shown("c1\ufe0f") == "c1\\ufe0f"


def test_shown__escapes_what_cannot_be_seen_and_keeps_the_rest():
    assert shown("invoice\u202efdp.sh") == "invoice\\u202efdp.sh"
    assert shown("zw\u200b1 \U000e0041") == "zw\\u200b1 \\U000e0041"
    assert shown("a\nb\tc", keep="\n\t") == "a\nb\tc"
    assert shown("a\nb") == "a\\u000ab"
    assert shown("café 日本 👍") == "café 日本 👍"


def test_identifier__a_value_that_is_no_string_is_said_so() -> None:
    """``_meta``'s ``toolledger/tool_call_id`` of 7 was refused as "must not be empty"."""
    import pytest

    from toolledger.ledger.errors import InvalidIdentifier
    from toolledger.ledger.inputs import check_identifier

    for value, said in ((7, "int"), (["x"], "list"), (True, "bool"), ({"a": 1}, "dict")):
        with pytest.raises(InvalidIdentifier, match=f"tool_call_id: must be a string, not {said}"):
            check_identifier(value, "tool_call_id")
    for empty in ("", "  ", None):
        with pytest.raises(InvalidIdentifier, match="must not be empty"):
            check_identifier(empty, "tool_call_id")


def test_shown_id__ids_differing_only_by_blanks_read_differently() -> None:
    """``"n16 "`` and ``"n16"`` are both accepted ids and read the same where a person
    approves one (a cold review): every blank a reader cannot see or count is escaped, a
    single inner space is kept, and a typed escape stays distinguishable from a real one."""
    ids = ["n16", "n16 ", " n16", "n\xa016", "n 16", "n  16", "n\u3000", "zw\u200b1", r"zw\u200b1"]
    seen = [shown_id(i) for i in ids]
    assert seen == [
        "n16",
        "n16\\u0020",
        "\\u0020n16",
        "n\\u00a016",
        "n 16",
        "n\\u0020\\u002016",
        "n\\u3000",
        "zw\\u200b1",
        "zw\\\\u200b1",
    ]
    assert len(set(seen)) == len(ids)
    for n in range(0x3001):  # every blank character but the space is escaped wherever it is
        if chr(n).isspace() and n != 0x20:
            assert shown_id(f"a{chr(n)}b") == f"a\\u{n:04x}b", hex(n)
