"""``Staged.to_json`` is written out field by field (``asdict`` cost 10x as much on every
terminal write): it must stay exactly ``asdict``, whatever fields the class grows."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from toolledger.effects import Staged


@given(
    n=st.integers(min_value=0, max_value=10_000),
    kind=st.sampled_from(["write", "append"]),
    path=st.text(min_size=1, max_size=40),
    size=st.integers(min_value=0, max_value=2**40),
    sha256=st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
)
def test_to_json_is_asdict(n: int, kind: str, path: str, size: int, sha256: str) -> None:
    staged = Staged(n, kind, path, size, sha256)
    assert staged.to_json() == dataclasses.asdict(staged)
    assert list(staged.to_json()) == [f.name for f in dataclasses.fields(Staged)]
