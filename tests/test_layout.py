"""Layout rules read from the source: tests share helpers through tests/_support.py, never through each
other; pipeline/ has no import cycles among its modules; every import in pipeline/ points down its floors
(`FLOORS`: a package imports its own modules and those of lower floors, never a higher floor's nor another
package's of its floor); a stage module imports no other stage; the two workers that run in vLLM's interpreter
import nothing of pipeline; the shipped package never imports tests. Imports are read from the whole file (ast
walk: module level, functions and classes alike)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PIPELINE = REPO / "pipeline"

# import cycles known and accepted, each with its reason; a new cycle fails, and so does one listed here
# that no longer exists (remove it from the list then)
KNOWN_CYCLES: set[frozenset[str]] = set()  # none (core.io -> core.hashes only: the memo writes its store itself)


# the floors of pipeline/, lowest first (docs/ARCHITECTURE.md, "Floors"): a package may import its own modules
# and any package of a lower floor; `pipeline` (the empty package module) sits with core
FLOORS: tuple[tuple[str, ...], ...] = (
    ("core",),                                         # house rules: errors, io, hashes, config, loading
    ("artifacts",),                                    # the files between stages: layout, writer, reader
    ("models",),                                       # drafter and target families, formats, the reference loop
    ("serving",),                                      # what vLLM reads and runs (its workers import no pipeline)
    ("quant", "evaluation", "provenance", "tiny"),     # the stages' library code, each on its own
    ("stages",),                                       # one module per stage, their list and runner
    ("commands", "help"),                              # commands that are not stages; `<stage> --help`
    ("__main__",),                                     # `python -m pipeline`: dispatches to both
)
# modules run inside vLLM's interpreter (standard library + vLLM only): no import of pipeline but each other
VLLM_SIDE = ("pipeline.serving.worker", "pipeline.serving.worker_common", "pipeline.serving.worker_engine",
             "pipeline.serving.worker_speed", "pipeline.serving.worker_load_probe", "pipeline.serving.extract")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_lines(source: str, filename: str, importer: str = "") -> list[tuple[int, str]]:
    """(line, module) for every module named by an import anywhere in the source (top level, functions,
    classes): `import a.b`, `from a.b import c` (a.b, and a.b.c as well in case c is a module); a relative
    import is resolved against `importer`, the importing module's dotted name."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = importer.split(".")[: len(importer.split(".")) - node.level]
                base = ".".join(pkg + ([base] if base else []))
            if base:
                out.append((node.lineno, base))
                out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def _imports(path: Path) -> set[str]:
    name = _module_name(path) if PIPELINE in path.parents else ""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return {m for _, m in _import_lines(path.read_text(encoding="utf-8"), str(path), package + ".x" if package else "")}


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


def _floor_of(module: str) -> tuple[int, str] | None:
    """(floor, package) of a module of pipeline/ (`pipeline.stages.cache` -> stages), None outside pipeline."""
    parts = module.split(".")
    if parts[0] != "pipeline":
        return None
    package = parts[1] if len(parts) > 1 else "core"
    for i, floor in enumerate(FLOORS):
        if package in floor:
            return i, package
    return len(FLOORS), package  # a package no floor names: reported by the test below


def _upward(importer: str, where: str, imports: list[tuple[int, str]], modules: set[str]) -> list[str]:
    """One sentence per import of `importer` (a module of pipeline/) that does not point down its floors."""
    mine = _floor_of(importer)
    out = []
    named = {(line, m) for line, m in imports if m in modules and m != importer}
    for line, m in sorted(named):
        if any(o == line and n.startswith(m + ".") for o, n in named):
            continue  # `from pipeline.serving import contract`: named once, as pipeline.serving.contract
        theirs = _floor_of(m)
        if theirs is None or theirs[1] == mine[1]:
            continue
        if theirs[0] > mine[0]:
            out.append(f"{where}:{line} imports {m}: `{theirs[1]}` is floor {theirs[0]}, above `{mine[1]}` "
                       f"(floor {mine[0]}); move the shared code down a floor or pass it in as an argument")
        elif theirs[0] == mine[0]:
            out.append(f"{where}:{line} imports {m}: `{theirs[1]}` and `{mine[1]}` share floor {mine[0]} and "
                       "never import each other; move the shared code down a floor")
    return out


def _pipeline_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PIPELINE.rglob("*.py"))}


def _imports_with_lines(name: str, path: Path) -> list[tuple[int, str]]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return _import_lines(path.read_text(encoding="utf-8"), str(path), package + ".x")


def test_the_floor_check_finds_an_upward_import():
    """The checker itself, on sources written here: an import up a floor (in a function too), one across a
    floor, and a relative one are named with file and line; imports down a floor and within a package are not."""
    modules = {"pipeline.core.io", "pipeline.models.targets", "pipeline.quant.recipes", "pipeline.evaluation.report",
               "pipeline.artifacts.checkpoint", "pipeline.artifacts.cache"}
    source = ("from pipeline.core.io import read_json\n"
              "from . import cache\n"
              "def load():\n"
              "    from pipeline.models.targets import carried\n")
    found = _upward("pipeline.artifacts.checkpoint", "pipeline/artifacts/checkpoint.py",
                    _import_lines(source, "x.py", "pipeline.artifacts.x"), modules)
    assert found == ["pipeline/artifacts/checkpoint.py:4 imports pipeline.models.targets: `models` is floor 2, "
                     "above `artifacts` (floor 1); move the shared code down a floor or pass it in as an argument"]
    across = _upward("pipeline.quant.recipes", "q.py", _import_lines("import pipeline.evaluation.report\n", "q.py"),
                     modules)
    assert len(across) == 1 and across[0].startswith("q.py:1 imports pipeline.evaluation.report: `evaluation` and "
                                                     "`quant` share floor 4")
    up_relative = _upward("pipeline.core.io", "io.py", _import_lines("from ..models import targets\n", "io.py",
                                                                     "pipeline.core.x"), modules)
    assert [s.split(":")[0:2] for s in up_relative] == [["io.py", "1 imports pipeline.models.targets"]]


def test_every_package_of_pipeline_has_a_floor():
    packages = {p.name for p in PIPELINE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    packages |= {p.stem for p in PIPELINE.glob("*.py") if p.stem != "__init__"}
    named = {pkg for floor in FLOORS for pkg in floor}
    assert packages - named == set(), f"place each new package of pipeline/ on a floor in FLOORS: {sorted(packages - named)}"
    assert named - packages == set(), f"FLOORS names packages that no longer exist: {sorted(named - packages)}"


def test_pipeline_imports_point_down_the_floors():
    modules = _pipeline_modules()
    bad = [s for name, p in modules.items()
           for s in _upward(name, str(p.relative_to(REPO)), _imports_with_lines(name, p), set(modules))]
    assert not bad, "imports up or across the floors of pipeline/ (tests/test_layout.py FLOORS):\n" + "\n".join(bad)


def test_no_stage_imports_another_stage():
    """A stage module (pipeline/stages/__init__.py STAGES) imports only the stage list (`pipeline.stages`),
    never another stage nor the runner; what two stages share lives a floor down."""
    from pipeline.stages import MODULES

    modules = _pipeline_modules()
    stage_dir = {m for m in modules if m.startswith("pipeline.stages.")}
    bad = [f"{modules[s].relative_to(REPO)}:{line} imports {m}" for s in sorted(MODULES.values())
           for line, m in _imports_with_lines(s, modules[s]) if m in stage_dir and m != s]
    assert not bad, "stages importing other stages (move the shared code down a floor): " + "; ".join(bad)


def test_the_vllm_side_imports_nothing_of_pipeline():
    """The workers run in vLLM's interpreter, where the project's dependencies are not installed: what they need
    from the project comes in their job file."""
    modules = _pipeline_modules()
    bad = [f"{modules[w].relative_to(REPO)}:{line} imports {m}" for w in VLLM_SIDE
           for line, m in _imports_with_lines(w, modules[w]) if m.split(".")[0] == "pipeline"
           and m not in VLLM_SIDE and m.rpartition(".")[0] not in VLLM_SIDE]
    assert not bad, "the vLLM-side workers import the project: " + "; ".join(bad)
