"""``make demo`` from a fresh clone: what a newcomer runs first. Sets up its own venv."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {
    "call_plan": "succeeded",
    "call_log": "succeeded",
    "call_escape": "refused",
    "call_deploy": "rejected",
    "call_notify": "succeeded",
    "call_overwrite": "refused",
    "call_report": "succeeded (attempt 2)",
    "call_summary": "succeeded",
}


def test_demo__make_demo_from_a_fresh_clone(tmp_path: Path, record_property):
    if not (ROOT / ".git").exists() or not shutil.which("git"):
        pytest.skip("not a git checkout")
    clone = tmp_path / "toolledger"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TOOLLEDGER_", "VIRTUAL_ENV", "PYTEST"))
    }
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p
    )
    began = time.monotonic()
    proc = subprocess.run(
        ["make", "demo"], cwd=clone, env=env, capture_output=True, text=True, timeout=900
    )
    elapsed = time.monotonic() - began
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    for call, status in EXPECTED.items():
        assert re.search(rf"ok\s+{call}\s+{re.escape(status)}\s", out), (call, out[-3000:])
    assert "BAD" not in out and "all as expected" in out and "verify: ok" in out
    assert (clone / ".toolledger" / "ledger.db").exists()  # left to explore
    record_property("make_demo_fresh_clone_s", round(elapsed, 1))
    print(f"\nmake demo from a fresh clone: {elapsed:.0f}s")
