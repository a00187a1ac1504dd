"""``inputs.INVISIBLE`` is exactly the characters a person cannot see as themselves."""

from __future__ import annotations

import sys
import unicodedata

from toolledger.ledger.inputs import INVISIBLE, shown


def test_invisible__is_every_control_format_and_separator_character_and_no_other():
    categories = {"Cc", "Cf", "Zl", "Zp"}
    wrong = [
        f"U+{n:04X} {unicodedata.category(chr(n))}"
        for n in range(sys.maxunicode + 1)
        if (unicodedata.category(chr(n)) in categories) != bool(INVISIBLE.fullmatch(chr(n)))
    ]
    assert not wrong, (unicodedata.unidata_version, wrong[:10])


def test_shown__escapes_what_cannot_be_seen_and_keeps_the_rest():
    assert shown("invoice\u202efdp.sh") == "invoice\\u202efdp.sh"
    assert shown("zw\u200b1 \U000e0041") == "zw\\u200b1 \\U000e0041"
    assert shown("a\nb\tc", keep="\n\t") == "a\nb\tc"
    assert shown("a\nb") == "a\\u000ab"
    assert shown("café 日本 👍") == "café 日本 👍"
