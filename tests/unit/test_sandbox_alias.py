"""The sandbox's cheap alias comparison agrees with the whole fold, on every name."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from toolledger.sandbox import _folds_to, alias_key

#: Names that fold onto ASCII ones (a ligature, the Kelvin sign, sharp s, a dotted capital I,
#: a combining accent): the cases an ASCII-only shortcut would get wrong.
TRICKY = ["file", "ﬁle", "FILE", "key", "\u212aey", "strasse", "Straße", "i̇", "İ", "é", "e\u0301"]
names = st.one_of(
    st.sampled_from(TRICKY),
    st.text(st.sampled_from("aAbBsSkKiIeé\u212aßﬁİ\u0301\u0307"), min_size=1, max_size=6),
    st.text(min_size=1, max_size=8),
)


@given(names, names)
@example("ﬁle", "file")
@example("\u212aey", "KEY")
def test_folds_to__agrees_with_the_whole_fold(name: str, other: str) -> None:
    key = alias_key(name)
    assert _folds_to(other, key) == (alias_key(other) == key)


@pytest.mark.parametrize(("a", "b"), [("ﬁle", "file"), ("\u212aey", "key"), ("Straße", "STRASSE")])
def test_folds_to__non_ascii_names_that_fold_onto_ascii(a: str, b: str) -> None:
    assert _folds_to(a, alias_key(b)) and _folds_to(b, alias_key(a))


def test_the_property_catches_an_ascii_only_shortcut() -> None:
    """The check above can fail: a comparison by lower case alone misses the ligature."""

    def shortcut(other: str, key: str) -> bool:
        return other.lower() == key

    assert shortcut("ﬁle", alias_key("file")) != (alias_key("ﬁle") == alias_key("file"))
