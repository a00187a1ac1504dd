"""The schema revision, read without Alembic or SQLAlchemy: from the migration files as text.

A ledger at head (the usual case) is recognised by comparing its version row with
``files_head()``; Alembic is loaded only when they differ (``db.ensure_schema``). The CLI's
light reads (``lightreads``) use the same comparison on a bare driver connection.
"""

from __future__ import annotations

import re
from pathlib import Path

from toolledger.ledger.errors import StateError

MIGRATIONS = Path(__file__).parent / "migrations"
#: Alembic's table of the revision a database is at (its default name, which env.py keeps).
VERSION_TABLE = "alembic_version"

_REVISION = re.compile(r"""^revision(?:\s*:[^=\n]*)?\s*=\s*["']([^"'\n]+)["']\s*$""", re.M)
_DOWN = re.compile(
    r"""^down_revision(?:\s*:[^=\n]*)?\s*=\s*(?:None|["']([^"'\n]+)["'])\s*$""", re.M
)


class SchemaError(RuntimeError):
    """The ledger's schema is missing or not at the revision this code needs."""


class UnsupportedDatabase(SchemaError):
    """A database the ledger cannot keep every call in (its encoding): a configuration to
    change, exit 2; nothing is written to it."""


class DowngradeRefused(SchemaError, StateError):
    """A downgrade that would drop what the ledger holds: the ledger's state does not allow
    it (exit 5), and nothing was changed."""


def files_head(versions: Path = MIGRATIONS / "versions") -> str | None:
    """The head revision, read from the migration files as text (no Alembic); None unless
    they form one straight line, each with one plain ``revision`` and ``down_revision``
    (a merge, a branch or any other spelling is left to Alembic's ``head_revision``)."""
    revisions: set[str] = set()
    parents: set[str | None] = set()
    for path in versions.glob("*.py"):
        text = path.read_text(encoding="utf-8")
        found, down = _REVISION.findall(text), _DOWN.findall(text)
        if not found and not down:
            continue  # not a revision (__init__.py)
        if len(found) != 1 or len(down) != 1 or found[0] in revisions:
            return None
        revisions.add(found[0])
        parents.add(down[0] or None)
    heads = revisions - parents
    if len(heads) != 1 or len(parents) != len(revisions) or not parents <= revisions | {None}:
        return None
    return heads.pop()


def files_revisions(versions: Path = MIGRATIONS / "versions") -> set[str]:
    """Every revision the migration files name (read as text, no Alembic)."""
    found: set[str] = set()
    for path in versions.glob("*.py"):
        found.update(_REVISION.findall(path.read_text(encoding="utf-8")))
    return found
