"""The package's shape (DESIGN §3): one import name, every arrow pointing down, no cycles.

Read from the source (every import statement, at module level or inside a function; those
under ``if TYPE_CHECKING:`` excluded, since they never run), so that a new import that breaks
the layering fails here, before it tangles anything. Each rule is also shown failing on a
graph made to break it.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import toolledger

ROOT = Path(toolledger.__file__).parent

#: The rooms from the bottom up; an import may point to a lower rank or within its own room.
ROOMS: list[tuple[str, int, tuple[str, ...]]] = [
    ("ledger", 0, ("toolledger.ledger",)),
    (
        "contract",
        1,
        (
            "toolledger.config",
            "toolledger.failpoints",
            "toolledger.folders",
            "toolledger.sandbox",
            "toolledger.effects",
            "toolledger.tools",
            "toolledger.builtin_tools",
            "toolledger.registry",
            "toolledger.jsonlines",
            "toolledger.observability",
        ),
    ),
    ("worker", 2, ("toolledger.worker",)),
    ("recovery", 2, ("toolledger.recovery",)),
    (
        "top",
        3,
        (
            "toolledger.cli",
            "toolledger.client",
            "toolledger.mcp",
            "toolledger.openai_agents",
            "toolledger.langchain",
            "toolledger.turns",
            "toolledger.demo",
            "toolledger.harness",
            "toolledger.server",
            "toolledger.__main__",
            "toolledger.entry",
        ),
    ),
    ("api", 4, ("toolledger",)),
]


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    files = [
        Path(d) / f
        for d, _, names in os.walk(ROOT, followlinks=True)  # ledger/, worker/, recovery/
        for f in names
        if f.endswith(".py")
    ]
    for path in sorted(files):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if "plugin" in parts:  # the chaos plugins are loaded by path into any version
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(["toolledger", *parts])] = path
    return found


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node except what sits under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def room_of(module: str) -> tuple[str, int]:
    best: tuple[int, str, int] = (-1, "", 0)
    for room, rank, prefixes in ROOMS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best[0]:
                best = (len(prefix), room, rank)
    assert best[0] >= 0, f"{module} is in no room: add it to ROOMS"
    return best[1], best[2]


def upward(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for a, targets in g.items():
        room_a, rank_a = room_of(a)
        for b in targets:
            room_b, rank_b = room_of(b)
            if room_b != room_a and rank_b >= rank_a:
                bad.append(f"{a} ({room_a}) -> {b} ({room_b})")
    return sorted(bad)


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def reachable(g: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in g.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


# ------------------------------------------------------------------------------ the package


def test_layout__every_module_sits_in_a_room():
    found = modules()
    for room in ("ledger", "worker", "recovery"):  # reached through the symlinks
        assert any(room_of(name)[0] == room for name in found), room
    for name in found:
        room_of(name)


def test_layout__every_arrow_points_down():
    assert upward(graph()) == []


def test_layout__no_import_cycles():
    assert cycles(graph()) == []


def test_layout__worker_and_recovery_do_not_import_each_other():
    g = graph()
    for a, targets in g.items():
        for b in targets:
            pair = {room_of(a)[0], room_of(b)[0]}
            assert pair != {"worker", "recovery"}, f"{a} -> {b}"


def test_repair__cannot_reach_anything_that_executes():
    """Transcript repair replays receipts: no path from it leads to a tool, the sandbox or the
    worker, so no bug in it can run a call again."""
    reached = reachable(graph(), "toolledger.recovery.transcript")
    assert reached, "the walk found nothing: the test would pass vacuously"
    for name in reached:
        assert room_of(name)[0] == "ledger" or name.startswith("toolledger.recovery."), name
    assert "toolledger.ledger.ledger" in reached


def test_layout__the_graph_sees_function_level_imports_and_skips_type_checking_ones():
    g = graph()
    # humans.py imports the ledger at module level; app.py settles the sandbox inside a
    # function (effects_of); sandbox.py names effects only for the type checker.
    assert "toolledger.effects" in g["toolledger.worker.app"]
    assert "toolledger.effects" not in g["toolledger.sandbox"]


# ------------------------------------------------------------------------------ the checks can fail


def test_checks__an_upward_arrow_is_found():
    g = {"toolledger.ledger.models": {"toolledger.worker.pipeline"}}
    assert upward(g) == ["toolledger.ledger.models (ledger) -> toolledger.worker.pipeline (worker)"]
    g = {"toolledger.recovery.sweep": {"toolledger.worker.submit"}}
    assert len(upward(g)) == 1  # siblings at the same rank


def test_checks__a_cycle_is_found():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]


def test_checks__a_path_from_repair_to_the_worker_is_found():
    g = {"toolledger.recovery.transcript": {"toolledger.ledger.x"}, "toolledger.ledger.x": set()}
    g["toolledger.ledger.x"].add("toolledger.worker.pipeline")
    assert "toolledger.worker.pipeline" in reachable(g, "toolledger.recovery.transcript")


def test_checks__imports_parsed_as_python_resolves_them(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "import toolledger.a\n"
        "from toolledger import b\n"
        "from . import c\n"
        "if TYPE_CHECKING:\n    import toolledger.d\n"
        "def f():\n    from toolledger.e import thing\n"
    )
    known = {f"toolledger.{x}" for x in "abcde"} | {"toolledger"}
    got = imports_of("toolledger.m", src, known)
    assert got == {"toolledger.a", "toolledger.b", "toolledger.c", "toolledger.e"}


@pytest.mark.parametrize("module", ["toolledger.nowhere.x"])
def test_checks__a_module_outside_every_room_is_refused(module):
    ROOMS_BACKUP = list(ROOMS)
    try:
        ROOMS[:] = [r for r in ROOMS if r[0] != "api"]
        with pytest.raises(AssertionError, match="in no room"):
            room_of(module)
    finally:
        ROOMS[:] = ROOMS_BACKUP
