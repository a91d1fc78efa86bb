"""The package's layout: imports flow one way, and a lazy import says why it is lazy.

The stages, lowest first (docs/architecture.md, "Where things live"):

    core                      the IR and shared utilities; imports nothing of megacompile
    passes, runtime, report   each imports only the core
    plan                      + passes, runtime
    options, optimizer,       + plan (options), + runtime and report (optimizer),
    distributed, checkpoint   + runtime (data parallel setup; its optimizer state for DCP)
    capture                   everything above
    backend                   everything above
    the package's __init__    the public API, from everything above
    cli                       anything; nothing but ``python -m megacompile`` imports it

A module may import its own stage or a lower one, never a sibling stage on its own level
(passes and runtime stay independent) and never a higher one. There are no import cycles
between modules, and every import inside a function carries a comment saying why it is
there and not at the top.
"""
from __future__ import annotations

import ast
import collections
import functools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# stage -> level; a module belongs to the longest stage prefix of its name.
STAGES = {
    "megacompile.core": 0,
    "megacompile.passes": 1,
    "megacompile.runtime": 1,
    "megacompile.report": 1,
    "megacompile.plan": 2,
    "megacompile.options": 3,
    "megacompile.optimizer": 3,
    "megacompile.distributed": 3,
    "megacompile.checkpoint": 3,
    "megacompile.capture": 4,
    "megacompile.backend": 5,
    "megacompile": 6,  # the package's own __init__: the public API
    "megacompile.cli": 7,
    "megacompile.__main__": 8,
}

# Source folders and the package each one installs as (pyproject's package-dir).
FOLDERS = {"megacompile": "megacompile", "passes": "megacompile.passes", "runtime": "megacompile.runtime"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = FOLDERS[rel.parts[0]].split(".") + list(rel.parts[1:])
    parts[-1] = parts[-1][: -len(".py")]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))}


def _stage(module: str) -> str:
    return max((s for s in STAGES if module == s or module.startswith(s + ".")), key=len)


def _imports(path: Path, module: str, known: set[str]):
    """(imported megacompile module, line, inside a function, the statement's last line)."""
    tree = ast.parse(path.read_text())
    lines = path.read_text().splitlines()
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def in_function(node) -> bool:
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return True
        return False

    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from pkg import name` imports the module pkg.name where there is one, else pkg.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        yield targets, node.lineno, in_function(node), lines[node.end_lineno - 1]


@functools.lru_cache(maxsize=None)  # (read only by the tests: parsing every module is a second each time)
def _graph():
    modules = _modules()
    known = set(modules)
    edges = collections.defaultdict(set)
    lazy = []
    for module, path in modules.items():
        for targets, line, in_function, last_line in _imports(path, module, known):
            if in_function:
                lazy.append((f"{path.relative_to(ROOT)}:{line}", last_line))
            for target in targets:
                if target.startswith("megacompile") and target != module:
                    edges[module].add((target, line, in_function))
    return modules, edges, lazy


def test_every_module_has_a_stage():
    modules, _, _ = _graph()
    assert "megacompile.plan.flat_planner" in modules and "megacompile.runtime.executor" in modules
    for module in modules:
        assert _stage(module) in STAGES, module


def test_imports_flow_one_way():
    modules, edges, _ = _graph()
    offenders = []
    for module, targets in edges.items():
        stage = _stage(module)
        for target, line, _ in targets:
            other = _stage(target)
            # Importing a subpackage runs its parent package's __init__, not its API: the
            # package root counts only when a module imports it by name.
            if other == "megacompile" and target != "megacompile":
                continue
            if other == stage:
                continue
            if STAGES[other] >= STAGES[stage]:
                offenders.append(f"{modules[module].relative_to(ROOT)}:{line} ({stage}) imports {target} ({other})")
    assert offenders == [], "\n".join(offenders)


def test_nothing_imports_the_cli():
    modules, edges, _ = _graph()
    allowed = ("megacompile.cli", "megacompile.__main__")
    importers = sorted({m for m, targets in edges.items() for t, _, _ in targets
                        if _stage(t) == "megacompile.cli" and _stage(m) not in allowed})
    assert importers == []


def test_no_import_cycles():
    """Between modules, counting every import (a function-level one closes a cycle too)."""
    modules, edges, _ = _graph()
    graph = {m: {t for t, _, _ in edges.get(m, ()) if t in modules} for m in modules}
    # A package's __init__ that merely re-exports is still an edge; none may close a loop.
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_a_lazy_import_says_why():
    """An import inside a function is lazy on purpose (an optional dependency, a slow
    import); the reason is written beside it as a comment."""
    _, _, lazy = _graph()
    unexplained = [where for where, last_line in lazy if "#" not in last_line]
    assert unexplained == [], unexplained


def test_ruff_is_clean():
    """The lint configured in pyproject.toml ([tool.ruff]) passes on the whole repository."""
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_package_is_installed():
    """A non-editable install ships exactly the packages pyproject.toml lists: each folder
    with an __init__.py under megacompile/ (and passes/, runtime/) must be listed."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {_module_name(init) for folder in FOLDERS for init in (ROOT / folder).rglob("__init__.py")}
    assert found - listed == set() and "megacompile.cli.plan_command" in found


def test_docstrings_are_short_and_hold_no_history():
    """Docstrings say what and why in a few lines (issue 16): none over 30 lines, no dates and
    no timings (a number of seconds); history, timings and measurements live in
    benchmarks/results/ and docs/."""
    import ast
    import re

    long, dated, timed = [], [], []
    for path in _modules().values():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                          ast.ClassDef)))]:
            doc = ast.get_docstring(node)
            if not doc:
                continue
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'name', '<module>')}"
            if doc.count("\n") >= 30:
                long.append(f"{where} ({doc.count(chr(10)) + 1} lines)")
            if re.search(r"\b20\d\d-\d\d-\d\d\b", doc):
                dated.append(where)
            if re.search(r"\b\d+(\.\d+)?\s?(ms|us|s)\b", doc):
                timed.append(where)
    assert not long, f"docstrings over 30 lines (move the detail to docs/architecture.md): {long}"
    assert not dated, f"dates in docstrings (history belongs in benchmarks/results/ or docs/): {dated}"
    assert not timed, f"timings in docstrings (measurements belong in benchmarks/results/ or docs/): {timed}"
