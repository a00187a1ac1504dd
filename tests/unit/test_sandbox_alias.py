"""The sandbox's cheap alias comparison agrees with the whole fold, on every name."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from toolledger.sandbox import _folds_to, alias_among, alias_key

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


def _slow_alias_among(names: list[str], name: str) -> str | None:
    key = alias_key(name)
    return next((o for o in names if o != name and alias_key(o) == key), None)


listings = st.lists(names, max_size=12, unique=True)


@given(listings, names)
@example(["file", "other"], "FILE")
@example(["FILE"], "FILE")  # the name itself is not its own alias
@example(["FILE", "file"], "FILE")
@example(["key"], "\u212aey")  # a non-ASCII name that folds onto an ASCII sibling
@example(["a", "ab", "b"], "AB")
@example(["xab", "abx"], "ab")  # a key inside a longer name is not a match
def test_alias_among__the_one_pass_fold_agrees_with_comparing_each_name(
    listing: list[str], name: str
) -> None:
    found = alias_among(listing, name)
    expected = _slow_alias_among(listing, name)
    assert (found is None) == (expected is None), (listing, name, found, expected)
    if found is not None:
        assert found != name and alias_key(found) == alias_key(name)


def test_alias_among__a_substring_search_would_be_caught() -> None:
    """The property above can fail: searching for the key without its separators matches
    'ab' inside 'xab', which no filesystem folds together."""
    listing, name = ["xab"], "AB"
    assert alias_among(listing, name) is None
    assert ("ab" in "\0".join(listing).lower()) != (_slow_alias_among(listing, name) is not None)
