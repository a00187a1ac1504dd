"""What the package promises a user's environment: one import name, no import side effects,
and the Celery app where ``celery -A`` looks for it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.unit.test_layout import modules

REPO = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLLEDGER_")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # From a copy of the tree (links kept as links): setuptools builds in place, and a build/
    # left by an earlier build would carry modules that no longer exist into this wheel.
    source = tmp_path_factory.mktemp("source") / "toolledger"
    junk = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__", "docs")
    shutil.copytree(REPO, source, symlinks=True, ignore=junk)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
         "--wheel-dir", str(out), str(source)],
        check=True, capture_output=True, cwd=source, timeout=300,
    )  # fmt: skip
    (found,) = out.glob("toolledger-*.whl")
    return found


def test_wheel__installs_exactly_one_top_level_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"toolledger"}
    # the rooms, from their folders at the repository's top level, and the migrations
    for must in (
        "toolledger/ledger/ledger.py",
        "toolledger/worker/pipeline.py",
        "toolledger/recovery/sweep.py",
        "toolledger/ledger/migrations/versions/0001_initial.py",
        "toolledger/ledger/migrations/script.py.mako",
        "toolledger/server/templates/call.html",  # the console's pages, in any install
        "toolledger/server/templates/inbox.html",
    ):
        assert must in names, must
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    requires = [line for line in text.splitlines() if line.startswith("Requires-Dist:")]
    core = [r for r in requires if "extra ==" not in r]
    assert not any(lib in r for r in core for lib in ("matplotlib", "procrastinate", "dbos"))
    assert any("matplotlib" in r and 'extra == "harness"' in r for r in requires)
    assert not any(lib in r for r in core for lib in ("fastapi", "uvicorn", "opentelemetry"))
    assert any("fastapi" in r and 'extra == "serve"' in r for r in requires)


def test_import__of_every_module_creates_nothing(tmp_path):
    """Importing any module makes no file or directory (the Celery app for ``-A`` is made on
    first use), wherever it is run."""
    names = [m for m in modules() if m not in ("toolledger.__main__",) and "migrations" not in m]
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    subprocess.run(
        [sys.executable, "-c", code, *names],
        check=True, cwd=tmp_path, env=clean_env(HOME=str(tmp_path)), timeout=120,
    )  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_celery__finds_the_app_and_the_sweep_it_includes(tmp_path):
    env = clean_env(HOME=str(tmp_path), TOOLLEDGER_HOME=str(tmp_path / "home"))
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "toolledger.worker.app", "report"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "include: ['toolledger.recovery.tasks']" in out.stdout
    assert str(tmp_path / "home") in out.stdout  # the environment, read when the app is made
    code = (
        "from toolledger.worker.app import app\n"
        "app.loader.import_default_modules()\n"
        "print(sorted(t for t in app.tasks if t.startswith('toolledger.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['toolledger.execute', 'toolledger.sweep']"
