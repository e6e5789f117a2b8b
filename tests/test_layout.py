"""Layout rules read from the source: tests share helpers through tests/_support.py, never through each
other; pipeline/ has no import cycles among its modules; the shipped package never imports tests."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PIPELINE = REPO / "pipeline"

# import cycles known and accepted, each with its reason; a new cycle fails, and so does one listed here
# that no longer exists (remove it from the list then)
KNOWN_CYCLES: set[frozenset[str]] = set()  # none (core.io -> core.hashes only: the memo writes its store itself)


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module named by an import anywhere in the file (top level, functions, classes): `import a.b`,
    `from a.b import c` (a.b, and a.b.c as well in case c is a module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in sorted(PIPELINE.rglob("*.py"))}
    return {name: {m for m in _imports(p) if m in modules and m != name} for name, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_test_module_imports_another_test_module():
    tests = REPO / "tests"
    bad = [(p.name, m) for p in sorted(tests.rglob("*.py")) for m in sorted(_imports(p))
           if (m.split(".")[0] == "tests" and m.split(".")[-1].startswith("test_"))
           or m.split(".")[0].startswith("test_")]
    assert not bad, f"shared test helpers belong in tests/_support.py: {bad}"


def test_pipeline_has_no_import_cycles():
    found = set(_cycles(_graph()))
    new = found - KNOWN_CYCLES
    assert not new, "import cycles in pipeline/: " + "; ".join(" <-> ".join(sorted(c)) for c in sorted(new, key=sorted))
    gone = KNOWN_CYCLES - found
    assert not gone, f"fixed, remove from KNOWN_CYCLES: {[sorted(c) for c in gone]}"


def test_pipeline_never_imports_tests():
    bad = [(str(p.relative_to(REPO)), m) for p in sorted(PIPELINE.rglob("*.py")) for m in sorted(_imports(p))
           if m.split(".")[0] == "tests"]
    assert not bad, f"the shipped package must not import the tests: {bad}"
