"""A hostile sandbox: hard links planted in a scope, and names that another filesystem would
alias (Windows syntax and device names, names differing only by case). Each is refused where
it can still be refused as input (nothing recorded, exit 6), again when the effect is staged,
and once more where the bytes land (kept aside, the call flagged ``not_landed``); and each
refusal leaves every file as it was."""

from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import NO_LEDGER, land, pending_files, row_counts, run_cli
from tests.integration.test_sandbox import tree
from toolledger.builtin_tools import ContentArgs, reconcile_write_file
from toolledger.config import Settings
from toolledger.effects import Commit, Effects, effects_of
from toolledger.ledger.errors import InputError
from toolledger.ledger.identity import new_execution_id
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.transitions import Status
from toolledger.registry import load_registry
from toolledger.sandbox import AliasRefused, HardLinkRefused, PathRefused, Sandbox
from toolledger.tools import ToolContext
from toolledger.worker.pipeline import Executor
from toolledger.worker.submit import Submitter

SECRET = b"root:x:0:0:do not touch\n"


class Book:
    """A ledger that knows of no other execution and keeps what it is told (not_landed)."""

    def __init__(self) -> None:
        self.not_landed: list[tuple[str, dict[str, Any]]] = []

    def effect_states(self, execution_ids: list[str]) -> dict[str, Any]:
        return {}

    def record_not_landed(self, execution_id: str, detail: dict[str, Any]) -> None:
        self.not_landed.append((execution_id, detail))


@pytest.fixture
def world(tmp_path: Path) -> tuple[Sandbox, Path, Path]:
    """Scope 'me' holding a hard link to a file outside the root ('linked.txt') and one to a
    neighbour scope's file ('theirs.txt'); an ordinary file; 'Notes.txt' and 'Docs/'."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "passwd").write_bytes(SECRET)
    root = tmp_path / "sandbox"
    (root / "other").mkdir(parents=True)
    (root / "other" / "theirs.txt").write_bytes(b"theirs\n")
    mine = root / "me"
    mine.mkdir()
    os.link(outside / "passwd", mine / "linked.txt")
    os.link(root / "other" / "theirs.txt", mine / "theirs.txt")
    (mine / "plain.txt").write_bytes(b"plain\n")
    (mine / "Notes.txt").write_bytes(b"notes\n")
    (mine / "Docs").mkdir()
    return Sandbox(root, max_content_bytes=64).prepare(), tmp_path, mine


def stage(sb: Sandbox, scope: str, path: str, data: bytes, kind: str) -> tuple[Commit, list[Any]]:
    """Stage one effect as a running execution would; its commit, ready to publish."""
    eid = new_execution_id()
    staging = effects_of(sb).staging(scope, eid, None)
    (staging.write_atomic if kind == "write" else staging.append)(scope, path, data)
    return Commit(eid, 1, scope, "k", 1), staging.seal()


def snapshot(tmp_path: Path, sb: Sandbox) -> dict[str, str]:
    """Every file and directory but the sandbox's own state (locks, stages)."""
    return tree(tmp_path, exclude=sb.root / ".toolledger")


# ---------------------------------------------------------------------------- hard links


@pytest.mark.parametrize("path", ["linked.txt", "theirs.txt"])
def test_hard_link__read_and_hash_refused_naming_the_link_count(world, path):
    sb, tmp_path, _ = world
    before = snapshot(tmp_path, sb)
    with pytest.raises(
        HardLinkRefused, match=r"has 2 hard links; refusing to read through a hard link"
    ):
        sb.read("me", path)
    with pytest.raises(HardLinkRefused):
        sb.sha256("me", path)
    with pytest.raises(HardLinkRefused, match="refusing to read"):
        sb.check("me", path, kind="read")
    with pytest.raises(HardLinkRefused, match="refusing to append"):
        sb.check("me", path, kind="append")
    sb.check("me", path, kind="write")  # a write renames over the link: safe
    assert snapshot(tmp_path, sb) == before


def test_hard_link__refused_by_a_running_append_nothing_staged(world):
    sb, tmp_path, _ = world
    before = snapshot(tmp_path, sb)
    staging = effects_of(sb).staging("me", new_execution_id(), None)
    with pytest.raises(HardLinkRefused, match="refusing to append"):
        staging.append("me", "linked.txt", b"pwned\n")
    assert staging.staged == [] and pending_files(sb) == []
    assert snapshot(tmp_path, sb) == before


def test_hard_link__a_write_replaces_the_link_and_leaves_the_other_file_alone(world):
    sb, tmp_path, mine = world
    assert land(sb, "me", "linked.txt", b"mine now\n").landed == 1
    assert (mine / "linked.txt").read_bytes() == b"mine now\n"
    assert os.stat(mine / "linked.txt").st_nlink == 1
    assert (tmp_path / "outside" / "passwd").read_bytes() == SECRET
    assert sb.read("me", "linked.txt") == b"mine now\n"  # one link now: readable


@pytest.mark.parametrize("how", ["target-replaced-by-a-link", "target-linked-from-outside"])
def test_hard_link__planted_after_staging_the_append_is_set_aside_not_landed(world, how):
    sb, tmp_path, mine = world
    # Given an append staged and committed while plain.txt was an ordinary file
    commit, staged = stage(sb, "me", "plain.txt", b"appended\n", "append")
    # When an attacker makes plain.txt another name of a file outside before it lands
    victim = tmp_path / "outside" / "passwd"
    if how == "target-replaced-by-a-link":
        (mine / "plain.txt").unlink()
        os.link(victim, mine / "plain.txt")
    else:
        victim = tmp_path / "outside" / "plain-alias"
        os.link(mine / "plain.txt", victim)
    victim_bytes = victim.read_bytes()
    before = snapshot(tmp_path, sb)
    book = Book()
    landing = effects_of(sb).publish(commit, staged, book)
    # Then nothing lands, the bytes are kept aside (not left to be redone) and it is said
    assert (landing.landed, landing.refused) == (0, 1)
    assert victim.read_bytes() == victim_bytes
    assert snapshot(tmp_path, sb) == before
    assert [name.rsplit(".", 1)[1] for name in pending_files(sb)] == ["refused"]
    [(eid, detail)] = book.not_landed
    assert eid == commit.execution_id and "hard links; refusing to append" in detail["reason"]
    # And a later settle does not land it either, even once the link is gone
    os.unlink(victim)
    effects_of(sb).settle(book)  # type: ignore[arg-type]
    assert snapshot(tmp_path, sb) == {k: v for k, v in before.items() if k != str(victim)}
    assert len(book.not_landed) == 1


def test_hard_link__an_interrupted_append_redone_through_a_link_is_set_aside(world):
    """The intent (``applying-<offset>``) of an append a crash interrupted is redone by the
    next lander: if the target is a hard link by then, the intent is set aside, not kept."""
    sb, tmp_path, mine = world
    commit, staged = stage(sb, "me", "plain.txt", b"appended\n", "append")
    pending = effects_of(sb).pending_dir
    [name] = pending_files(sb)
    os.rename(pending / name, pending / name.replace(".append", ".applying-6"))
    (mine / "plain.txt").unlink()
    os.link(tmp_path / "outside" / "passwd", mine / "plain.txt")
    before = snapshot(tmp_path, sb)
    landing = effects_of(sb).publish(commit, staged, Book())
    assert (landing.landed, landing.refused) == (0, 1)
    assert snapshot(tmp_path, sb) == before
    assert [n.rsplit(".", 1)[1] for n in pending_files(sb)] == ["refused"]


def test_hard_link__reconciler_of_write_file_cannot_tell(world):
    sb, _, _ = world
    ctx = ToolContext("me", sb)
    assert (
        reconcile_write_file(ContentArgs(path="linked.txt", content=SECRET.decode()), ctx) is None
    )


# ---------------------------------------------------------------------------- names


WINDOWS_NAMES = [
    ("backslash", "a\\b.txt"),
    ("backslash-dotdot", "..\\other\\theirs.txt"),
    ("backslash-absolute", "\\etc\\passwd"),
    ("colon-stream", "plain.txt:hidden"),
    ("drive", "C:x"),
    ("star", "a*.txt"),
    ("question", "a?.txt"),
    ("quote", 'a".txt'),
    ("lt", "a<b"),
    ("gt", "a>b"),
    ("pipe", "a|b"),
    ("trailing-dot", "plain.txt."),
    ("trailing-dots", "dir.../x"),
    ("trailing-space", "plain.txt "),
    ("trailing-space-dir", "dir /x"),
    ("device", "CON"),
    ("device-lower", "nul"),
    ("device-mixed-with-extension", "Aux.tar.gz"),
    ("device-as-directory", "logs/PRN/x.txt"),
    ("device-com", "com1.log"),
    ("device-lpt", "LPT9"),
    ("device-superscript", "COM\u00b9.txt"),
    ("device-space-before-extension", "NUL .txt"),
    ("device-console", "conin$"),
]


@pytest.mark.parametrize(("name", "path"), WINDOWS_NAMES, ids=[n[0] for n in WINDOWS_NAMES])
@pytest.mark.parametrize("op", ["check", "write", "append", "read"])
def test_names__windows_syntax_and_devices_refused_nothing_changed(world, name, path, op):
    sb, tmp_path, _ = world
    before = snapshot(tmp_path, sb)
    staging = effects_of(sb).staging("me", new_execution_id(), None)
    action = {
        "check": lambda: sb.check("me", path),
        "write": lambda: staging.write_atomic("me", path, b"pwned"),
        "append": lambda: staging.append("me", path, b"pwned"),
        "read": lambda: sb.read("me", path),
    }[op]
    with pytest.raises(PathRefused):
        action()
    assert snapshot(tmp_path, sb) == before and pending_files(sb) == []


@pytest.mark.parametrize(
    "path", ["CONSOLE", "com10", "nullable.txt", "lpt", "a.b.c", ".hidden", "con-fig/aux_1"]
)
def test_names__near_misses_are_fine(world, path):
    sb, _, mine = world
    assert land(sb, "me", path, b"ok").landed == 1
    assert (mine / path).read_bytes() == b"ok"


@pytest.mark.parametrize("scope", ["con", "Nul.d", "x.", "lpt1"])
def test_names__a_scope_windows_would_alias_refused(world, scope):
    sb, tmp_path, _ = world
    before = snapshot(tmp_path, sb)
    with pytest.raises(PathRefused, match=r"dot or a space|Windows device"):
        sb.check(scope, "a.txt")
    with pytest.raises(PathRefused):
        land(sb, scope, "a.txt", b"x")
    assert snapshot(tmp_path, sb) == before and pending_files(sb) == []


NFD_E = unicodedata.normalize("NFD", "\u00e9")
CASE_ALIASES = [
    ("file", "notes.txt", "Notes.txt"),
    ("file-upper", "NOTES.TXT", "Notes.txt"),
    ("directory", "docs/new.txt", "Docs"),
    ("kelvin-sign", "\u212aey/x", "Key"),  # K (U+212A) folds to k
]


@pytest.mark.parametrize(
    ("name", "path", "existing"), CASE_ALIASES, ids=[c[0] for c in CASE_ALIASES]
)
@pytest.mark.parametrize("kind", ["write", "append"])
def test_case__a_new_name_aliasing_a_sibling_refused_at_check(world, name, path, existing, kind):
    sb, tmp_path, mine = world
    if existing == "Key":
        (mine / "Key").mkdir()
    before = snapshot(tmp_path, sb)
    with pytest.raises(AliasRefused) as refused:
        sb.check("me", path, kind=kind)
    message = str(refused.value)
    assert existing in message and path.split("/")[0] in message and "\n" not in message
    assert snapshot(tmp_path, sb) == before


def test_case__unicode_normalisation_counts_as_the_same_name(world):
    sb, tmp_path, mine = world
    (mine / "caf\u00e9.txt").write_bytes(b"nfc")  # NFC, as most keyboards type it
    before = snapshot(tmp_path, sb)
    with pytest.raises(AliasRefused):
        sb.check("me", f"caf{NFD_E}.txt")  # NFD, what macOS's HFS+ stores: one file there
    assert snapshot(tmp_path, sb) == before


def test_case__existing_names_and_reads_are_not_compared(world):
    sb, _, mine = world
    sb.check("me", "Notes.txt")  # exactly the existing name: fine
    sb.check("me", "notes.txt", kind="read")  # a read creates nothing
    assert sb.read("me", "notes.txt") is None
    assert land(sb, "me", "Notes.txt", b"replaced\n").landed == 1
    assert land(sb, "me", "Docs/inside.txt", b"in\n").landed == 1
    assert (mine / "Docs" / "inside.txt").read_bytes() == b"in\n"


@pytest.mark.parametrize(
    ("path", "made", "kind"),
    [
        ("notes.txt", "Notes.txt", "write"),
        ("notes.txt", "Notes.txt", "append"),
        ("later/x.txt", "Later", "write"),
        ("later/x.txt", "Later", "append"),
    ],
)
def test_case__an_alias_made_after_staging_is_refused_where_it_lands(tmp_path, path, made, kind):
    """Staged while nothing aliased it; a sibling differing by case appears before landing:
    the effect is kept aside and flagged, and no second name (file or directory) is left."""
    sb = Sandbox(tmp_path / "sandbox").prepare()
    (sb.root / "me").mkdir()
    commit, staged = stage(sb, "me", path, b"late\n", kind)
    if "." in made:
        (sb.root / "me" / made).write_bytes(b"theirs\n")
    else:
        (sb.root / "me" / made).mkdir()
    before = snapshot(tmp_path, sb)
    book = Book()
    landing = effects_of(sb).publish(commit, staged, book)
    assert (landing.landed, landing.refused) == (0, 1)
    assert snapshot(tmp_path, sb) == before
    assert [n.rsplit(".", 1)[1] for n in pending_files(sb)] == ["refused"]
    [(_, detail)] = book.not_landed
    assert "differ only by letter case" in detail["reason"] and made in detail["reason"]


def test_case__scope_differing_only_by_case_refused_naming_both(tmp_path):
    sb = Sandbox(tmp_path / "sandbox").prepare()
    # staged while no alias existed; then 'Conv' is made (another process, by hand)
    commit, staged = stage(sb, "conv", "a.txt", b"conv's\n", "write")
    (sb.root / "Conv").mkdir()
    (sb.root / "Conv" / "a.txt").write_bytes(b"Conv's\n")
    before = snapshot(tmp_path, sb)
    # at check time (submit) and where an execution stages: the scope's directory would be made
    with pytest.raises(AliasRefused, match="'conv' and the existing 'Conv'"):
        sb.check("conv", "a.txt")
    with pytest.raises(AliasRefused, match="'conv' and the existing 'Conv'"):
        stage(sb, "conv", "b.txt", b"conv's\n", "write")
    # the one staged before is refused where it lands: no 'conv' directory
    book = Book()
    assert effects_of(sb).publish(commit, staged, book).refused == 1
    assert len(book.not_landed) == 1
    assert snapshot(tmp_path, sb) == before
    assert (sb.root / "Conv" / "a.txt").read_bytes() == b"Conv's\n"


def test_case__scopes_already_aliasing_are_refused_when_used(tmp_path):
    """Two directories made by hand (or before this rule): neither scope is used."""
    sb = Sandbox(tmp_path / "sandbox").prepare()
    for scope in ("Team", "team"):
        (sb.root / scope).mkdir()
        (sb.root / scope / "f.txt").write_bytes(scope.encode())
    before = snapshot(tmp_path, sb)
    for scope, other in (("Team", "team"), ("team", "Team")):
        with pytest.raises(AliasRefused, match=f"'{scope}' and the existing '{other}'"):
            sb.read(scope, "f.txt")
        with pytest.raises(AliasRefused):
            land(sb, scope, "f.txt", b"x", kind="append")
    assert snapshot(tmp_path, sb) == before


# ---------------------------------------------------------------------------- through submit


@pytest.fixture
def submitter(sqlite_url, tmp_path, world):
    sb, _, _ = world
    settings = Settings(
        db=sqlite_url,
        sandbox=sb.root,
        max_content_bytes=64,
        broker="redis://127.0.0.1:1/0",
        home=tmp_path / "home",
    )
    sub = Submitter(settings)
    yield sub
    sub.close()


SUBMIT_REFUSED = [
    ("append-through-hard-link", "append_file", "linked.txt", "refusing to append"),
    ("read-through-hard-link", "read_file", "linked.txt", "refusing to read"),
    ("read-other-scope-by-link", "read_file", "theirs.txt", "refusing to read"),
    ("write-case-alias", "write_file", "notes.txt", "differ only by letter case"),
    ("append-case-alias-dir", "append_file", "docs/x.log", "differ only by letter case"),
    ("write-backslash", "write_file", "a\\b", "backslash"),
    ("write-device", "write_file", "nul.txt", "Windows device"),
]


@pytest.mark.parametrize(
    ("name", "tool", "path", "message"), SUBMIT_REFUSED, ids=[s[0] for s in SUBMIT_REFUSED]
)
def test_submit__refused_as_input_nothing_recorded(submitter, world, name, tool, path, message):
    _, tmp_path, _ = world
    before_fs, before_db = tree(tmp_path), row_counts(submitter.ledger.engine)
    args = {"path": path} if tool == "read_file" else {"path": path, "content": "pwned"}
    with pytest.raises(InputError, match=message):
        submitter.submit(submitter.prepare("me", f"c-{name}", tool, args), approved_by="al")
    assert row_counts(submitter.ledger.engine) == before_db
    assert tree(tmp_path) == before_fs


def test_submit__a_write_over_a_hard_link_is_accepted(submitter):
    call = submitter.prepare("me", "c-w", "write_file", {"path": "linked.txt", "content": "x"})
    assert call.tool == "write_file"


@pytest.mark.parametrize(
    ("tool", "path", "message"),
    [
        ("read_file", "linked.txt", "has 2 hard links; refusing to read through a hard link"),
        ("append_file", "theirs.txt", "has 2 hard links; refusing to append through a hard link"),
        ("write_file", "NOTES.txt", "'NOTES.txt' and the existing 'Notes.txt'"),
        ("write_file", "x\\y", "backslash"),
    ],
)
def test_cli__refused_exit_6_one_line_nothing_written(
    world, sqlite_url, capsys, monkeypatch, tool, path, message
):
    sb, tmp_path, _ = world
    monkeypatch.setenv("TOOLLEDGER_HOME", str(tmp_path / "home"))
    args = (
        f'{{"path": "{path}"}}' if tool == "read_file" else f'{{"path": "{path}", "content": "x"}}'
    )
    args = args.replace("\\", "\\\\")
    before = tree(tmp_path, exclude=tmp_path / "home")
    counts = row_counts(Ledger(sqlite_url).engine)
    code, out, err = run_cli(
        capsys, "--db", sqlite_url, "--sandbox", str(sb.root), "submit", "--scope", "me",
        "--tool-call-id", f"cli-{tool}-{hashlib.sha256(path.encode()).hexdigest()[:8]}",
        "--tool", tool, "--args", args,
    )  # fmt: skip
    assert code == 6, err
    assert message in err and err.count("\n") == 1 and out == ""
    assert tree(tmp_path, exclude=tmp_path / "home") == before
    assert row_counts(Ledger(sqlite_url).engine) == counts


# ---------------------------------------------------------------------------- at execution


def append_planted_after_commit(
    submitter: Submitter, sb: Sandbox, monkeypatch: Any, cid: str, content: str, plant: Any
) -> tuple[Any, Any]:
    """Submit and execute an append to plain.txt, ``plant`` run between its commit and its
    landing: (the call, the outcome)."""
    call = submitter.prepare("me", cid, "append_file", {"path": "plain.txt", "content": content})
    submitter.ledger.submit("me", call.tool_call_id, call.tool, call.args, approved_by="al")
    publish = Effects.publish

    def plant_then_publish(self: Effects, *args: Any) -> Any:
        plant()
        return publish(self, *args)

    monkeypatch.setattr(Effects, "publish", plant_then_publish)
    executor = Executor(submitter.ledger, load_registry(), sb, worker_id="t", lease_seconds=30)
    try:
        return call, executor.execute("me", f"append_file:{call.tool_call_id}", 1)
    finally:
        monkeypatch.setattr(Effects, "publish", publish)


def test_execution__a_hard_link_planted_before_landing_is_flagged_not_landed(
    submitter, world, monkeypatch
):
    """Submitted and run while plain.txt was an ordinary file; the link appears between the
    commit and the landing: the call succeeded (its commit stands), its append never landed,
    and a human is asked (``not_landed``)."""
    sb, tmp_path, mine = world

    def plant() -> None:
        (mine / "plain.txt").unlink()
        os.link(tmp_path / "outside" / "passwd", mine / "plain.txt")

    call, outcome = append_planted_after_commit(
        submitter, sb, monkeypatch, "c-late-link", "x\n", plant
    )
    assert outcome.status is Status.SUCCEEDED
    assert outcome.landing is not None and outcome.landing.refused == 1
    assert (tmp_path / "outside" / "passwd").read_bytes() == SECRET
    view = submitter.ledger.get("me", call.tool_call_id)
    assert (view.operation.status, view.operation.review) == (Status.SUCCEEDED, "not_landed")
    assert [n.rsplit(".", 1)[1] for n in pending_files(sb)] == ["refused"]


def test_execution__a_not_landed_effects_bytes_are_kept_until_a_human_reviews_the_call(
    submitter, world, monkeypatch, capsys, sqlite_url
):
    """The flag says where the bytes are kept; the sweep leaves them while the call waits
    for a human and removes them once the human has reviewed it (`toolledger resolve`)."""
    from toolledger.recovery.sweep import sweep

    sb, _, mine = world

    def plant() -> None:  # the target became a directory after the commit
        (mine / "plain.txt").unlink()
        (mine / "plain.txt").mkdir()

    call, outcome = append_planted_after_commit(
        submitter, sb, monkeypatch, "c-kept", "kept\n", plant
    )
    assert outcome.landing is not None and outcome.landing.refused == 1
    flag = submitter.ledger.events("me", call.tool_call_id)[-1]
    assert flag.kind == "flagged" and flag.detail["reason"] == "not_landed"
    kept = sb.root / flag.detail["effect"]["kept"]
    assert kept.read_bytes() == b"kept\n"

    def a_pass() -> None:
        summary = sweep(
            submitter.ledger, load_registry(), sb, grace_seconds=60, requeue_after=60,
            publish=None,
        )  # fmt: skip
        assert not summary.errors, summary.errors

    a_pass()
    assert kept.exists()  # the call waits on a human: its bytes stay
    code, _, err = run_cli(
        capsys, "--db", sqlite_url, "--sandbox", str(sb.root), "resolve",
        "--execution-id", outcome.execution_id, "--as", "succeeded", "--by", "dana",
        "--evidence", "moved plain.txt/ away and appended the kept line by hand", "--review",
    )  # fmt: skip
    assert code == 0, err
    assert kept.exists()  # the command touches no file: the sweep does
    # bytes of the same execution set aside with no flag recorded (the ledger was out when
    # they were): no review named them, so they stay
    unflagged = kept.with_name(kept.name.replace(".0.", ".1.", 1))
    unflagged.write_bytes(b"unreviewed\n")
    a_pass()
    assert not kept.exists() and pending_files(sb) == [unflagged.name]
    assert (mine / "plain.txt").is_dir()  # nothing landed: the human's to do


def a_directory_in_place_of(path: Path) -> None:
    path.unlink()
    path.mkdir()


def killed_after_the_flag(self: Ledger, execution_id: str, detail: dict[str, Any]) -> None:
    """``record_not_landed`` that records, then dies before the bytes are set aside."""
    RECORD_NOT_LANDED(self, execution_id, detail)
    raise KeyboardInterrupt


RECORD_NOT_LANDED = Ledger.record_not_landed


def test_execution__a_refusal_the_ledger_was_not_told_of_is_refused_again_never_kept_unflagged(
    submitter, world, monkeypatch
):
    """The flag is recorded before the bytes are set aside: a ledger that cannot be told, or a
    crash between the flag and the rename, leaves the effect where it was, for the next settle
    to refuse and flag again; bytes kept are always named by a flag."""
    sb, _, mine = world
    plant = partial(a_directory_in_place_of, mine / "plain.txt")
    record = Ledger.record_not_landed

    def unreachable(self: Ledger, execution_id: str, detail: dict[str, Any]) -> None:
        raise RuntimeError("the database is down")

    monkeypatch.setattr(Ledger, "record_not_landed", unreachable)
    call, outcome = append_planted_after_commit(
        submitter, sb, monkeypatch, "c-untold", "untold\n", plant
    )
    assert outcome.status is Status.SUCCEEDED and outcome.landing is not None
    assert (outcome.landing.refused, outcome.landing.left) == (0, 0)
    assert "refused, not yet flagged" in outcome.landing.problems[0]
    assert submitter.ledger.get("me", call.tool_call_id).operation.review is None
    assert [n.rsplit(".", 1)[1] for n in pending_files(sb)] == ["append"]  # where it was

    monkeypatch.setattr(Ledger, "record_not_landed", killed_after_the_flag)
    with pytest.raises(KeyboardInterrupt):
        effects_of(sb).settle(submitter.ledger)
    assert [n.rsplit(".", 1)[1] for n in pending_files(sb)] == ["append"]  # where it was

    monkeypatch.setattr(Ledger, "record_not_landed", record)
    assert effects_of(sb).settle(submitter.ledger).refused == 1
    history = submitter.ledger.events("me", call.tool_call_id)
    flags = [e for e in history if e.kind == "flagged"]
    assert len(flags) == 1  # told once: the second refusal names the bytes the flag names
    assert sum("not_landed" in e.detail for e in history if e.kind == "evidence") == 1
    kept = sb.root / flags[0].detail["effect"]["kept"]
    assert kept.read_bytes() == b"untold\n" and pending_files(sb) == [kept.name]


def test_execution__a_refusal_reviewed_before_its_bytes_went_aside_is_not_told_again(
    submitter, world, monkeypatch
):
    """A crash after the flag, a human who settles the call before the next settle: that
    settle sets the bytes aside under the name the reviewed flag gives, tells no one again
    (the call stays out of the inbox), and the next sweep pass removes them."""
    sb, _, mine = world
    plant = partial(a_directory_in_place_of, mine / "plain.txt")
    record = Ledger.record_not_landed

    monkeypatch.setattr(Ledger, "record_not_landed", killed_after_the_flag)
    with pytest.raises(KeyboardInterrupt):
        append_planted_after_commit(submitter, sb, monkeypatch, "c-seen", "seen\n", plant)
    monkeypatch.setattr(Ledger, "record_not_landed", record)
    (flag,) = [e for e in submitter.ledger.events("me", "c-seen") if e.kind == "flagged"]
    submitter.ledger.review(
        flag.execution_id, Status.SUCCEEDED, by="dana", evidence="left it: plain.txt/ stays"
    )
    assert submitter.ledger.get("me", "c-seen").operation.review is None

    assert effects_of(sb).settle(submitter.ledger).refused == 1
    assert [e.kind for e in submitter.ledger.events("me", "c-seen")].count("flagged") == 1
    assert submitter.ledger.get("me", "c-seen").operation.review is None  # not back in the inbox
    kept = sb.root / flag.detail["effect"]["kept"]
    assert pending_files(sb) == [kept.name]
    assert effects_of(sb).sweep_refused(submitter.ledger) == 1
    assert pending_files(sb) == []


def test_execution__a_hard_link_planted_before_the_run_fails_refused(submitter, world):
    sb, tmp_path, mine = world
    call = submitter.prepare(
        "me", "c-run-link", "append_file", {"path": "plain.txt", "content": "x\n"}
    )
    submitter.ledger.submit("me", call.tool_call_id, call.tool, call.args, approved_by="al")
    (mine / "plain.txt").unlink()
    os.link(tmp_path / "outside" / "passwd", mine / "plain.txt")
    before = tree(tmp_path, exclude=sb.root / ".toolledger")
    executor = Executor(submitter.ledger, load_registry(), sb, worker_id="t", lease_seconds=30)
    outcome = executor.execute("me", f"append_file:{call.tool_call_id}", 1)
    assert outcome.status is Status.FAILED
    assert outcome.result["error"] == "refused" and "hard links" in outcome.result["message"]
    assert tree(tmp_path, exclude=sb.root / ".toolledger") == before
    assert pending_files(sb) == []


@pytest.mark.parametrize("tool", ["write_file", "append_file"])
def test_execution__a_case_twin_made_since_the_submit_fails_refused(submitter, world, tool):
    """Both names were new at their submits; the first landed; the second ran, staged, and
    was committed succeeded while its bytes were refused at landing (flagged not_landed, the
    model told it succeeded). Refused where it stages now: the call fails, nothing flagged."""
    sb, _tmp_path, _mine = world
    calls = [
        submitter.prepare("me", f"{tool}-{name}", tool, {"path": f"{name}.txt", "content": "x"})
        for name in (f"{tool}-twin", f"{tool}-TWIN")
    ]
    for call in calls:
        submitter.ledger.submit("me", call.tool_call_id, call.tool, call.args, approved_by="al")
    executor = Executor(submitter.ledger, load_registry(), sb, worker_id="t", lease_seconds=30)
    first, second = (executor.execute("me", c.key, 1) for c in calls)
    assert first.status is Status.SUCCEEDED
    assert second.status is Status.FAILED, second.result
    assert second.result["error"] == "refused" and "letter case" in second.result["message"]
    assert submitter.ledger.get("me", calls[1].tool_call_id).operation.review is None
    made = sorted(p.name for p in (sb.root / "me").iterdir() if tool in p.name)
    assert made == [f"{tool}-twin.txt"]
    assert pending_files(sb) == []


def test_helpers_still_land_with_no_ledger(world):
    """NO_LEDGER (tests of the sandbox alone) keeps working with the new checks."""
    sb, _, mine = world
    assert (
        effects_of(sb).publish(*stage(sb, "me", "fresh.txt", b"f", "write"), NO_LEDGER).landed == 1
    )
    assert (mine / "fresh.txt").read_bytes() == b"f"


def _within(seconds: float, fn: Any) -> Any:
    """``fn()`` in a daemon thread, its result, or a failure if it has not returned by then
    (a call blocked on a FIFO would otherwise hang the suite)."""
    import threading

    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out["value"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    return out["value"]


@pytest.mark.parametrize("planted", ["fifo", "symlink"])
def test_settle__a_spool_that_is_no_regular_file_is_set_aside_never_waited_on(
    ledger, tmp_path, planted
):
    """helper-101: a FIFO at a spool's name blocked every settle for ever (the sweep, every
    read-only call, a worker's start); a link was followed."""
    sandbox = Sandbox(tmp_path / "sb")
    effects = effects_of(sandbox)
    effects.pending_dir.mkdir(parents=True, exist_ok=True)
    spool = effects.pending_dir / f"{new_execution_id()}.spool"
    secret = tmp_path / "outside.txt"
    secret.write_text('{"lease_token": "t", "status": "failed", "result": {}}')
    if planted == "fifo":
        os.mkfifo(spool)
    else:
        spool.symlink_to(secret)
    landing = _within(20, lambda: effects.settle(ledger))
    assert not isinstance(landing, Exception), landing
    assert not spool.exists() and not spool.is_symlink()
    assert (spool.parent / f"{spool.name}.refused").exists() or (
        spool.parent / f"{spool.name}.refused"
    ).is_symlink()
    assert any("set aside" in problem for problem in landing.problems), landing.problems
    assert secret.read_text().startswith('{"lease_token"')  # followed by nothing


def test_format__a_fifo_at_the_format_file_is_an_error_not_a_hang(tmp_path):
    """helper-101: a FIFO at ``.toolledger/format`` hung every process that lands at start."""
    effects = effects_of(Sandbox(tmp_path / "sb"))
    effects.state.mkdir(parents=True, exist_ok=True)
    os.mkfifo(effects.state / "format")
    raised = _within(20, effects.check_format)
    assert isinstance(raised, OSError), raised


def test_replace_durably__a_link_planted_at_its_temporary_name_is_not_followed(
    tmp_path, monkeypatch
):
    """helper-101 (suspected): the temporary file was opened O_CREAT|O_TRUNC, following a
    link planted at its name: the write, and a truncation, went where it pointed."""
    from toolledger.effects import _replace_durably

    target = tmp_path / "state" / "a.spool"
    target.parent.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    # the name it will take, planted (its random part made known: helper-103 saw a link at
    # a name never used, which tested nothing)
    monkeypatch.setattr("toolledger.effects.secrets.token_hex", lambda n: "0a1b2c3d")
    (target.parent / f"a.spool.tmp{os.getpid()}.0a1b2c3d").symlink_to(victim)
    with pytest.raises(FileExistsError):
        _replace_durably(target, b"new")
    assert victim.read_text() == "keep me" and not target.exists()


def test_replace_durably__two_threads_replacing_one_file_each_write_it_whole(tmp_path):
    """helper-102: two writers of one process shared one temporary name: the second removed
    the first's and one renamed the other's half-written file into place."""
    import threading

    from toolledger.effects import _replace_durably

    target = tmp_path / "a.spool"
    bodies = [bytes([65 + n]) * 200_000 for n in range(4)]
    errors: list[BaseException] = []

    def write(body: bytes) -> None:
        try:
            for _ in range(30):
                _replace_durably(target, body)
        except BaseException as exc:  # noqa: BLE001 - said by the test
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and target.read_bytes() in bodies
    assert [p.name for p in tmp_path.iterdir()] == ["a.spool"]  # no temporary file left


def test_execute__a_call_whose_effect_did_not_land_exits_1(world, monkeypatch, capsys, sqlite_url):
    """``execute`` of a call whose write was kept aside (its target became a directory
    between the commit and the landing) exited 0, its receipt saying ``succeeded`` and
    ``bytes_written``: a script took the file for written (a cold review of the CLI). The
    call ended, flagged ``not_landed``: its JSON on stdout as ever, exit 1, one error line."""
    sb, _, mine = world
    cli = partial(run_cli, capsys, "--db", sqlite_url, "--sandbox", str(sb.root), "--json")
    call = ["--scope", "me", "--tool-call-id", "c-aside"]
    args = '{"path": "plain.txt", "content": "aside"}'
    code, _, err = cli(
        "submit", *call, "--tool", "write_file", "--args", args, "--approved-by", "al"
    )
    assert code == 0, err
    publish = Effects.publish

    def plant_then_publish(self: Effects, *a: Any) -> Any:
        (mine / "plain.txt").unlink()
        (mine / "plain.txt").mkdir()
        return publish(self, *a)

    monkeypatch.setattr(Effects, "publish", plant_then_publish)
    code, out, err = cli("execute", *call)
    assert code == 1, err
    data = json.loads(out)
    assert (data["status"], data["review"], data["landing"]["refused"]) == (
        "succeeded",
        "not_landed",
        1,
    )
    lines = [json.loads(line) for line in err.splitlines()]
    assert lines[-1]["exit_code"] == 1 and "did not land" in lines[-1]["error"], err
    assert (mine / "plain.txt").is_dir()


def test_sweep__counts_the_effects_it_kept_aside(submitter, world, monkeypatch):
    """A sweep whose settle kept an effect aside (its target became a directory after the
    commit) said so only in a log line: its JSON summary counted nothing of it, ``landed``
    0, ``errors`` [] (a cold review of the CLI). ``kept_aside`` counts them; each call is
    flagged ``not_landed`` as before."""
    from toolledger.effects import Landing
    from toolledger.recovery.sweep import sweep

    sb, _, mine = world
    monkeypatch.setattr(Effects, "publish", lambda self, *a: Landing())  # a crash: not landed
    call, outcome = append_planted_after_commit(
        submitter, sb, monkeypatch, "c-swept", "later\n", lambda: None
    )
    assert outcome.status is Status.SUCCEEDED
    monkeypatch.undo()  # the next settle is the sweep's, landing as ever
    (mine / "plain.txt").unlink()
    (mine / "plain.txt").mkdir()
    summary = sweep(
        submitter.ledger, load_registry(), sb, grace_seconds=60, requeue_after=60, publish=None
    )
    assert (summary.landed, summary.to_json()["kept_aside"]) == (0, 1)
    assert submitter.ledger.get("me", call.tool_call_id).operation.review == "not_landed"
