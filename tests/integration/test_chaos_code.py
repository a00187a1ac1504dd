"""``toolledger chaos --code DIR`` puts another version under test: the chaos plugins load into
that version's own modules, today's (the toolledger namespace) and one from before it."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from toolledger.harness.chaos.harness import PLUGIN, Code

REPO = Path(__file__).resolve().parents[2]
#: main just before the fence (#8) and the namespace: flat `ledger`, `worker`, `recovery`.
BEFORE_NAMESPACE = "e537a12"

PROBE = """
import importlib, json, os
from importlib import import_module
legacy = bool(os.environ.get("TOOLLEDGER_CHAOS_LEGACY"))
loader = import_module("worker.tools" if legacy else "toolledger.registry")
registry = loader.load_registry("toolledger_chaos_tools", use_entry_points=False)
roles = import_module("toolledger_chaos_roles")
print(json.dumps({
    "tools": sorted(t.name for t in registry if t.name.startswith("chaos_")),
    "tools_from": import_module("toolledger_chaos_tools").make_tool.__module__,
    "submitter_from": roles.Submitter.__module__,
    "parts": roles.PARTS,
}))
"""


def _probe(code: Code, cwd: Path) -> dict[str, object]:
    import json

    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLLEDGER_")}
    env.update(code.env())
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=cwd,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    known = subprocess.run(
        ["git", "-C", str(REPO), "cat-file", "-e", f"{BEFORE_NAMESPACE}^{{commit}}"],
        capture_output=True,
    )
    if known.returncode != 0:
        pytest.skip(f"needs the repository's history (commit {BEFORE_NAMESPACE}): a full clone")
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", BEFORE_NAMESPACE], capture_output=True, check=True
    ).stdout
    tree = tmp_path_factory.mktemp("before-namespace")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def test_code__this_checkout_runs_the_plugins_in_the_namespace(tmp_path):
    code = Code(None)
    assert not code.legacy and code.cli()[-1] == "toolledger"
    got = _probe(code, tmp_path)
    assert got["tools"] == ["chaos_append", "chaos_charge", "chaos_write"]
    assert got["tools_from"] == "toolledger.tools"
    assert got["submitter_from"] == "toolledger.worker.submit" and got["parts"] is True


def test_code__a_checkout_from_before_the_namespace_runs_its_own_modules(old_tree):
    code = Code(old_tree)
    assert code.legacy and code.cli()[-1] == "worker"
    assert "TOOLLEDGER_CHAOS_LEGACY" in code.env() and str(PLUGIN) in code.env()["PYTHONPATH"]
    got = _probe(code, old_tree)
    assert got["tools"] == ["chaos_append", "chaos_charge", "chaos_write"]
    assert got["tools_from"] == "worker.tools"  # the old tree's, not this one's
    assert got["submitter_from"] == "worker.submit" and got["parts"] is False
    assert "after_claim" in code.failpoints()
