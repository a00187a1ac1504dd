"""Looking after the ledger: its schema and ``verify``; the sandbox's own state; the tools
registered."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from toolledger.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_STATE,
    EXIT_USAGE,
    CliError,
    Context,
    json_option,
    pass_ctx,
)


@click.group()
def db() -> None:
    """The ledger's schema."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
@click.option(
    "--grant",
    "grant_to",
    metavar="ROLE",
    help="then let ROLE (Postgres) read and write the ledger's rows, and nothing more: the role "
    "every other part runs under (run again after each upgrade)",
)
@json_option
@pass_ctx
def db_upgrade(c: Context, revision: str, grant_to: str | None) -> None:
    """Create or migrate the schema (Alembic)."""
    from toolledger.ledger import db as ledger_db

    _revision_given(revision)
    ledger_db.refuse_newer(c.unchecked_ledger.engine)  # exit 1: no revision here is ahead
    if grant_to is not None:
        try:
            ledger_db.refuse_grant(c.unchecked_ledger.engine, grant_to)
        except ValueError as exc:
            raise CliError(f"--grant: {exc}", EXIT_USAGE) from None
    with _known_revision(revision):
        at = ledger_db.behind(c.unchecked_ledger.engine, revision)
    if at is not None:  # Alembic did nothing and said nothing (a deployment review)
        raise CliError(
            f"--revision {revision!r} is older than the schema (at {at}): upgrade never goes "
            f"back; `toolledger db downgrade --revision {revision}` does",
            EXIT_USAGE,
        )
    with _known_revision(revision):
        ledger_db.upgrade(c.unchecked_ledger.engine, revision)
    current = ledger_db.current_revision(c.unchecked_ledger.engine)
    if grant_to is None:
        c.emit({"revision": current}, lambda d: f"schema at revision {d['revision']}")
        return
    tables = _grant(c, grant_to)
    c.emit(
        {"revision": current, "granted": {"role": grant_to, "tables": tables}},
        lambda d: (
            f"schema at revision {d['revision']}; {grant_to} may read and write the rows "
            f"of {', '.join(tables)}"
        ),
    )


def _grant(c: Context, role: str) -> list[str]:
    import sqlalchemy as sa

    from toolledger.ledger import db as ledger_db

    try:
        return ledger_db.grant(c.unchecked_ledger.engine, role)
    except ValueError as exc:
        raise CliError(f"--grant: {exc}", EXIT_USAGE) from None
    except sa.exc.ProgrammingError as exc:  # no such role; not allowed to grant
        said = str(exc.orig).splitlines()[0] if exc.orig is not None else str(exc)
        raise CliError(f"--grant {role!r}: {said}", EXIT_USAGE) from None


@db.command("downgrade")
@click.option("--revision", default="base", show_default=True)
@json_option
@pass_ctx
def db_downgrade(c: Context, revision: str) -> None:
    """Migrate the schema down ('base' drops every table of a ledger that holds nothing)."""
    from toolledger.ledger import db as ledger_db

    _revision_given(revision)
    c.require_recorded("there is nothing to downgrade")  # a mistyped home made an empty one
    ledger_db.refuse_newer(c.unchecked_ledger.engine)
    with _known_revision(revision):
        ledger_db.downgrade(c.unchecked_ledger.engine, revision)
    current = ledger_db.current_revision(c.unchecked_ledger.engine)
    c.emit({"revision": current}, _said_revision)


def _said_revision(d: dict[str, object]) -> str:
    """Where the schema stands, in words: at base (null under --json) there is none (it said
    "schema at revision None", Python's word for the JSON's null: a cold review)."""
    if d["revision"] is None:
        return "schema at base: no table of the ledger's is left"
    return f"schema at revision {d['revision']}"


def _revision_given(revision: str) -> None:
    """An empty --revision is a usage error, said before anything is opened (Alembic asserted
    it: an internal error, exit 1, after the ledger's file was made: a cold review)."""
    if not revision.strip():
        raise CliError("--revision must not be empty", EXIT_USAGE)


@contextmanager
def _known_revision(revision: str) -> Iterator[None]:
    """A --revision that is not one of the schema's is a usage error, not an internal one."""
    from alembic.util import CommandError

    try:
        yield
    except CommandError as exc:
        # Alembic's word for a revision it cannot go to: unknown, a range, a relative step
        # past either end (``+1`` at head); a newer database is refused before (exit 1)
        unknown = "Can't locate revision" in str(exc) or "No such revision" in str(exc)
        why = "no such revision of the schema" if unknown else " ".join(str(exc).split())
        raise CliError(f"--revision {revision!r}: {why}", EXIT_USAGE) from None


# ---------------------------------------------------------------------------- sandbox


@click.group()
def sandbox() -> None:
    """The sandbox's own state (under .toolledger/)."""


@sandbox.command("upgrade")
@click.option(
    "--new",
    is_flag=True,
    help="Mark the folder only if no process has used it yet (a deployment's first step); "
    "one already used is left as it is.",
)
@json_option
@pass_ctx
def sandbox_upgrade(c: Context, new: bool) -> None:
    """Bring the sandbox's own state to this version's format, once every process that lands
    effects in it (workers, the HTTP API, MCP servers and proxies, agents' embedded clients,
    `toolledger execute`) runs this version.

    Format 2 lets the sweep remove the lock files no lander holds: a sandbox kept one for
    every path ever written. An earlier version's lander would lock a removed file without
    seeing it, so two of them could land on one path at once: run this after the last of
    them stopped, and run no earlier version on the sandbox afterwards. Only on a local
    filesystem (ext2/3/4, XFS, Btrfs, tmpfs, F2FS). This command removes what no lander
    holds now (progress on stderr); every sweep pass goes on with the rest.

    With --new it marks only a folder no process has used yet, on a local filesystem, and
    leaves any other as it is (exit 0, `"left_as_is": true`): a deployment can run it before
    its workers start, on every start, without upgrading under an earlier version's feet."""
    from toolledger.effects import FORMAT, effects_of
    from toolledger.folders import local_filesystem
    from toolledger.sandbox import Sandbox

    box = Sandbox.configured(c.settings)
    if not box.root.is_dir():
        if not new:
            raise CliError(f"no sandbox at {box.root} (a new one: --new makes it)", EXIT_USAGE)
        # before the first start, as a worker would at its start: a folder nobody has used
        try:
            box.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            why = f"cannot make the sandbox {box.root}: {exc.strerror}"
            raise CliError(why, EXIT_USAGE) from None
    if not box.attached and not new:
        raise CliError(
            f"{box.root} has no .toolledger/ (no worker has used it): --new to mark it anyway",
            EXIT_USAGE,
        )
    effects = effects_of(box)
    before = effects.state_format()
    if before > FORMAT:
        raise CliError(f"sandbox {box.root} is at format {before}, of a later version", EXIT_STATE)
    fd = os.open(box.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        local = local_filesystem(fd)
    finally:
        os.close(fd)
    if new and (box.attached or not local):
        # a deployment's first step, on every start: never an upgrade under running workers,
        # and never a stop for a sandbox that keeps its lock files (a network filesystem)
        why = "in use" if box.attached else "not on a local filesystem (its lock files stay)"
        c.emit(
            {
                "sandbox": str(box.root),
                "format": before,
                "was": before,
                "lock_files_removed": 0,
                "lock_files_left": effects.lock_file_count(),
                "left_as_is": True,
            },
            lambda d: (
                f"sandbox {d['sandbox']} is {why}, at format {d['format']}: left as it is"
                + (
                    " (once every process that lands in it runs this version, run `toolledger "
                    "sandbox upgrade` without --new)"
                    if box.attached and local and d["format"] < FORMAT
                    else ""
                )
            ),
        )
        return
    if not local:
        raise CliError(
            f"sandbox {box.root} is not on a local filesystem (ext2/3/4, XFS, Btrfs, tmpfs, "
            "F2FS): its lock files stay",
            EXIT_USAGE,
        )
    box.prepare()
    effects.upgrade()
    removed = 0
    for shard in range(256):
        removed += effects.sweep_locks(limit=0)  # one shard a call
        if shard % 32 == 31 and not c.json:
            click.echo(
                f"  {shard + 1}/256 shards of {effects.paths_dir}: {removed} lock files removed",
                err=True,
            )
    out = {
        "sandbox": str(box.root),
        "format": effects.state_format(),
        "was": before,
        "lock_files_removed": removed,
        "lock_files_left": effects.lock_file_count(),  # held by a lander, or made since
        "left_as_is": False,
    }
    c.emit(
        out,
        lambda d: (
            f"sandbox {d['sandbox']} at format {d['format']} (was {d['was']}): "
            f"{d['lock_files_removed']} lock files removed, {d['lock_files_left']} left (held by a "
            "lander, or made since: the sweep removes them once free)"
        ),
    )


# ------------------------------------------------------------------------------ calls


@click.command()
@json_option
@pass_ctx
def verify(c: Context) -> int:
    """Rebuild current state from the events alone; exit 1 on any difference."""
    try:
        c.require_recorded(nothing="nothing to verify")
    except CliError as exc:  # verify's own word for it since 12-01: exit 1, a difference
        raise CliError(exc.message, EXIT_FAILURE) from None
    report = c.recorded_ledger.verify()
    c.emit(
        report.to_json(),
        lambda d: (
            f"verify: {'ok' if d['ok'] else 'DIFFERENCES'} — {d['operations']} operations, "
            f"{d['executions']} executions, {d['events']} events, "
            f"{d['flagged']} flagged for review"
            + "".join(
                f"\n  {x['table']} {x['scope']}/{x['idempotency_key']} {x['field']}: "
                f"stored {x['stored']!r}, rebuilt {x['rebuilt']!r}"
                for x in d["differences"]
            )
        ),
    )
    return EXIT_OK if report.ok else EXIT_FAILURE


@click.command()
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["all", "openai", "anthropic"]),
    default="all",
    show_default=True,
    help="openai / anthropic: a list ready to pass as the API's tools.",
)
@json_option
@pass_ctx
def tools(c: Context, fmt: str) -> None:
    """The registered tools: their JSON schemas and their contracts."""
    definitions = [t.definitions() for t in c.submitter.registry]
    data: Any = {"tools": definitions} if fmt == "all" else [d[fmt] for d in definitions]

    def human(_: Any) -> str:
        return "\n".join(
            f"{d['name']:<14} {'idempotent' if d['idempotent'] else 'not idempotent':<15} "
            f"{'read-only' if d['read_only'] else 'side effect':<12} "
            f"{'reconcilable' if d['reconcilable'] else 'human recovery':<15} "
            f"{(d['description'].splitlines() or [''])[0][:70]}"  # a tool with no docstring
            for d in definitions
        )

    c.emit(data, human if fmt == "all" else None)
