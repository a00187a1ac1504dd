"""Sandbox attacks, refused at submit and again at execution, nothing written outside; and
the staged-effect protocol seen from the sandbox alone (the ledger's side: test_fencing)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tests.helpers import NO_LEDGER, land, pending_files, row_counts
from toolledger.config import Settings
from toolledger.effects import Commit, LeaseLost, LeaseWatch, effects_of
from toolledger.ledger.errors import InputError
from toolledger.ledger.identity import new_execution_id
from toolledger.ledger.ledger import Ledger
from toolledger.ledger.transitions import Status
from toolledger.registry import load_registry
from toolledger.sandbox import ContentTooLarge, PathRefused, Sandbox, SandboxError
from toolledger.worker.pipeline import Executor
from toolledger.worker.submit import Submitter


def tree(root: Path, exclude: Path | None = None) -> dict[str, str]:
    """Every entry under ``root`` (but ``exclude``) with what it is: proof nothing changed."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(dirpath)
        if exclude and (base == exclude or exclude in base.parents):
            continue
        for name in dirnames + filenames:
            p = base / name
            if p.is_symlink():
                found[str(p)] = "link->" + os.readlink(p)
            elif p.is_file():
                found[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                found[str(p)] = "dir" if p.is_dir() else "other"
    return found


@pytest.fixture
def world(tmp_path):
    """A sandbox with scope 'me', a neighbour scope 'other', and secrets outside the root."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("do not touch")
    root = tmp_path / "sandbox"
    sb = Sandbox(root, max_content_bytes=64)
    (root / "other").mkdir(parents=True)
    (root / "other" / "theirs.txt").write_bytes(b"theirs")
    mine = root / "me"
    (mine / "ok").mkdir(parents=True)
    (mine / "ok" / "inside.txt").write_bytes(b"mine")
    os.symlink(outside / "secret.txt", mine / "file_link")
    os.symlink(outside, mine / "dir_link")
    os.symlink(root / "other", mine / "to_other")
    (mine / "a_dir").mkdir()
    os.mkfifo(mine / "fifo")
    return sb, tmp_path, mine


ATTACKS = [
    ("dotdot", "../x"),
    ("absolute", "/etc/passwd"),
    ("dotdot-inside", "a/../../x"),
    ("nul", "a\x00b"),
    ("symlinked-file", "file_link"),
    ("symlinked-dir", "dir_link/secret.txt"),
    ("symlinked-dir-deep", "ok/../dir_link/x"),
    ("into-other-scope-by-link", "to_other/theirs.txt"),
    ("into-other-scope-by-dotdot", "../other/theirs.txt"),
    ("target-is-directory", "a_dir"),
    ("target-is-fifo", "fifo"),
    ("empty-component", "ok//inside.txt"),
    ("dot", "./ok/inside.txt"),
    ("trailing-slash", "ok/"),
    ("control-char", "ok/\nx"),
    ("over-long-component", "x" * 300),
]


@pytest.mark.parametrize(("name", "path"), ATTACKS, ids=[a[0] for a in ATTACKS])
@pytest.mark.parametrize("op", ["check", "write", "append", "read"])
def test_sandbox__attack_refused_nothing_written_outside(world, name, path, op):
    sb, tmp_path, mine = world
    before = tree(tmp_path, exclude=mine)
    inside_before = tree(mine)
    staging = effects_of(sb).staging("me", new_execution_id(), None)
    action = {
        "check": lambda: sb.check("me", path),
        "write": lambda: staging.write_atomic("me", path, b"pwned"),
        "append": lambda: staging.append("me", path, b"pwned"),
        "read": lambda: sb.read("me", path),
    }[op]
    with pytest.raises(PathRefused):
        action()
    assert tree(tmp_path, exclude=mine) == before
    assert tree(mine) == inside_before  # not even a temp file left behind
    assert pending_files(sb) == []  # nothing staged either


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("ok/inside.txt/x", "path 'ok/inside.txt/x' goes through 'inside.txt', a regular file"),
        ("fifo/x", "path 'fifo/x' goes through 'fifo', a FIFO"),
        ("dir_link/x", "path 'dir_link/x' goes through 'dir_link', a symlink"),
    ],
)
@pytest.mark.parametrize("kind", ["write", "append", "read"])
def test_sandbox__a_path_through_what_is_no_folder_says_what_it_is(world, path, says, kind):
    """A file where a folder should be is named one: it was said to be 'not a regular file'."""
    sb, _, _ = world
    with pytest.raises(PathRefused) as caught:
        sb.check("me", path, kind=kind)
    assert str(caught.value) == says


@pytest.mark.parametrize("kind", ["write", "append", "read"])
def test_sandbox__a_lone_surrogate_in_a_path_is_refused_not_a_unicode_error(world, kind):
    """What a tool of one's own may pass (the submit's input rules refuse it for a model):
    a UnicodeEncodeError escaped ``check`` and ``read``, not a refusal."""
    sb, _, _ = world
    with pytest.raises(PathRefused, match="not valid Unicode"):
        sb.check("me", "ok/x\ud800", kind=kind)
    with pytest.raises(PathRefused, match="not valid Unicode"):
        sb.read("me", "\ud800")
    assert sb.read("me", "x\udcff") is None  # a name os.listdir gives: looked for, absent


@pytest.mark.parametrize("scope", ["a/b", "..", "../other", ".", "other/../me", ""])
def test_sandbox__scope_name_with_slash_or_dotdot_refused(world, scope):
    sb, tmp_path, _ = world
    before = tree(tmp_path)
    with pytest.raises(InputError):
        land(sb, scope, "x.txt", b"pwned")
    assert tree(tmp_path) == before


def test_sandbox__content_over_the_cap_refused(world):
    sb, tmp_path, _ = world
    before = tree(tmp_path)
    with pytest.raises(ContentTooLarge):
        land(sb, "me", "big.txt", b"x" * 65)
    with pytest.raises(ContentTooLarge):
        land(sb, "me", "ok/inside.txt", b"x" * 65, kind="append")
    assert tree(tmp_path) == before
    land(sb, "me", "big.txt", b"x" * 64)  # at the cap: fine


def test_sandbox__atomic_write_replaces_and_leaves_nothing_pending(world):
    sb, _, mine = world
    staging = effects_of(sb).staging("me", new_execution_id(), None)
    staged = staging.write_atomic("me", "ok/inside.txt", b"new content")
    assert staged.sha256 == hashlib.sha256(b"new content").hexdigest()
    assert (mine / "ok/inside.txt").read_bytes() == b"mine"  # staged: nothing changed yet
    commit = Commit(staging.execution_id, 1, "me", "k", 1)
    landing = effects_of(sb).publish(commit, staging.seal(), NO_LEDGER)
    assert landing.landed == 1
    assert (mine / "ok/inside.txt").read_bytes() == b"new content"
    assert pending_files(sb) == []


def test_sandbox__append_appends(world):
    sb, _, mine = world
    land(sb, "me", "log/a.txt", b"one\n", kind="append")
    land(sb, "me", "log/a.txt", b"two\n", kind="append")
    assert (mine / "log/a.txt").read_bytes() == b"one\ntwo\n"
    assert pending_files(sb) == []


def test_sandbox__discarded_stages_never_land(world):
    sb, _, mine = world
    before = tree(mine)
    staging = effects_of(sb).staging("me", new_execution_id(), None)
    staging.write_atomic("me", "ok/inside.txt", b"revoked")
    staging.append("me", "log/b.txt", b"revoked\n")
    staging.seal()
    assert len(pending_files(sb)) == 2
    assert effects_of(sb).discard(staging.execution_id) == 2
    assert pending_files(sb) == [] and tree(mine) == before


def test_sandbox__writes_only_by_a_running_execution_in_its_own_scope(world):
    sb, tmp_path, _ = world
    before = tree(tmp_path)
    with pytest.raises(SandboxError, match="only by a running execution"):
        sb.write_atomic("me", "x.txt", b"direct")  # a reconciler's or a check's sandbox
    with pytest.raises(SandboxError, match="only by a running execution"):
        sb.append("me", "x.txt", b"direct")
    with pytest.raises(PathRefused, match="cannot write in 'other'"):
        effects_of(sb).staging("me", new_execution_id(), None).write_atomic("other", "x.txt", b"x")
    lost = LeaseWatch("e", deadline=0.0)  # this process no longer holds the lease
    with pytest.raises(LeaseLost):
        effects_of(sb).staging("me", "e", lost).write_atomic("me", "x.txt", b"late")
    assert tree(tmp_path) == before


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


@pytest.mark.parametrize(("name", "path"), ATTACKS, ids=[a[0] for a in ATTACKS])
@pytest.mark.parametrize("tool", ["write_file", "append_file", "read_file"])
def test_submit__attack_refused_nothing_recorded(submitter, world, name, path, tool):
    _, tmp_path, _ = world
    before_fs, before_db = tree(tmp_path), row_counts(submitter.ledger.engine)
    args = {"path": path} if tool == "read_file" else {"path": path, "content": "pwned"}
    with pytest.raises(InputError):
        call = submitter.prepare("me", f"c-{name}", tool, args)
        submitter.submit(call, approved_by="alice")
    assert row_counts(submitter.ledger.engine) == before_db
    assert tree(tmp_path) == before_fs


def test_submit__content_over_cap_and_bad_scope_refused(submitter, world):
    _, tmp_path, _ = world
    before_fs, before_db = tree(tmp_path), row_counts(submitter.ledger.engine)
    with pytest.raises(InputError, match="over the cap"):
        submitter.prepare("me", "c1", "write_file", {"path": "a", "content": "x" * 65})
    for scope in ("a/b", "..", "x/../me"):
        with pytest.raises(InputError, match="scope"):
            submitter.prepare(scope, "c1", "write_file", {"path": "a", "content": "x"})
    assert row_counts(submitter.ledger.engine) == before_db
    assert tree(tmp_path) == before_fs


# ---------------------------------------------------------------------------- at execution


def _executor(ledger: Ledger, sb: Sandbox) -> Executor:
    return Executor(ledger, load_registry(), sb, worker_id="t", lease_seconds=30)


@pytest.mark.parametrize("swap", ["file", "parent-dir"])
def test_execution__symlink_swapped_in_after_submit_fails_before_any_byte(submitter, world, swap):
    sb, tmp_path, mine = world
    # Given a call whose path was safe at submit time
    target = "later/report.txt"
    call = submitter.prepare("me", f"c-{swap}", "write_file", {"path": target, "content": "x"})
    submitter.ledger.submit("me", call.tool_call_id, call.tool, call.args, approved_by="al")
    # When an attacker swaps in a symlink before the worker runs it
    (mine / "later").mkdir()
    if swap == "file":
        os.symlink(tmp_path / "outside" / "secret.txt", mine / "later" / "report.txt")
    else:
        os.rmdir(mine / "later")
        os.symlink(tmp_path / "outside", mine / "later")
    before = tree(tmp_path, exclude=mine)
    outcome = _executor(submitter.ledger, sb).execute("me", f"write_file:{call.tool_call_id}", 1)
    # Then the execution fails, refused, and nothing outside the scope changed
    assert outcome.status is Status.FAILED
    assert outcome.result["error"] == "refused" and "symlink" in outcome.result["message"]
    assert tree(tmp_path, exclude=mine) == before
    assert (tmp_path / "outside" / "secret.txt").read_text() == "do not touch"
    assert pending_files(sb) == []
