"""JSON lines: one object per line, appended so that concurrent writers never interleave.

Logs the tests, the chaos run and the benchmarks read after the fact (effects landed,
failpoints fired, charges made) are written here, each line by one ``write`` under
``O_APPEND`` and fsynced, so a line either is whole on disk or is not there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def append(path: str | os.PathLike[str], entry: dict[str, Any], *, fsync: bool = True) -> None:
    """Append one object as one line (one write under O_APPEND), fsynced unless told not to."""
    data = (json.dumps(entry, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every object in the file, in order; nothing if it does not exist."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n") if line.strip()]
