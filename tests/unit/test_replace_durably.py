"""The small files the sandbox writes whole (a spool, its format marker): all or nothing, and
no temporary file left behind when the disk refuses."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from toolledger import effects


def test_replace_durably__a_full_disk_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spool written while the disk was full left an empty ``*.spool.tmpPID`` in the
    pending folder for good (a cold review)."""
    target = tmp_path / "e1.spool"
    target.write_bytes(b"old")
    real_write = os.write

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(effects.os, "write", full)
    with pytest.raises(OSError, match="No space"):
        effects._replace_durably(target, b"new bytes")
    monkeypatch.setattr(effects.os, "write", real_write)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e1.spool"]
    assert target.read_bytes() == b"old"


def test_replace_durably__short_writes_still_write_the_whole_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = os.write
    monkeypatch.setattr(effects.os, "write", lambda fd, data: real_write(fd, bytes(data[:3])))
    effects._replace_durably(tmp_path / "f", b"0123456789")
    assert (tmp_path / "f").read_bytes() == b"0123456789"
