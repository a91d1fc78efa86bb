"""Installation-level promises: the entry point and the private-API boundary."""
import ast
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_backend_string_works_without_importing_megacompile():
    """`backend="megatrain"` resolves through the torch_dynamo_backends entry point."""
    code = (
        "import sys, torch\n"
        "f = torch.compile(lambda x: (x * 2).sum(), backend='megatrain',"
        " options={'device': 'cpu', 'lowering': 'eager'})\n"
        "x = torch.ones(3, requires_grad=True)\n"
        "y = f(x); y.backward()\n"
        "assert float(y) == 6.0 and x.grad.tolist() == [2.0, 2.0, 2.0]\n"
        "assert 'megacompile' in sys.modules  # loaded by Dynamo through the entry point\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


# The installed source: the packages' folders and the one top-level module.
SOURCES = [p for folder in ("megacompile", "passes", "runtime") for p in sorted((ROOT / folder).rglob("*.py"))]
SOURCES.append(ROOT / "megacompile_autoload.py")


def test_private_torch_apis_only_in_the_compat_module():
    """Nothing outside megacompile/core/torch_compat.py imports from torch._* (one place to fix),
    but the entry point torch runs while it imports (megacompile_autoload.py: its docstring says why)."""
    pattern = re.compile(r"^\s*(from|import)\s+torch\._", re.M)
    allowed = {"megacompile/core/torch_compat.py", "megacompile_autoload.py"}

    def uses_private_attribute(text: str) -> bool:  # torch._x in code, not in strings or comments
        return any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "torch"
                   and n.attr.startswith("_") and not n.attr.startswith("__") for n in ast.walk(ast.parse(text)))

    offenders = [p.relative_to(ROOT).as_posix() for p in SOURCES
                 if p.relative_to(ROOT).as_posix() not in allowed
                 and (pattern.search(p.read_text()) or uses_private_attribute(p.read_text()))]
    assert offenders == []


def _project() -> dict:
    import tomllib  # lazy: Python 3.11+; the package supports 3.10, this module's other tests too

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("-", "_")


def test_every_third_party_import_is_declared():
    """Each top-level module the installed source imports, other than the standard library and
    megacompile's own, is a dependency or in an extra of pyproject.toml (import name = the
    distribution's name for all of them today)."""
    project = _project()
    required = {_requirement_name(r) for r in project["dependencies"]}
    extras = {_requirement_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    assert "torch" in required and "transformers" in extras
    imported: dict[str, str] = {}
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("megacompile", "megacompile_autoload"):
                    imported.setdefault(top, f"{path.relative_to(ROOT)}:{node.lineno}")
    assert {"torch", "sympy", "transformers"} <= set(imported)
    undeclared = {name: where for name, where in imported.items() if name not in required | extras}
    assert undeclared == {}


def test_torch_requirement_admits_this_torch():
    """The declared torch range holds the torch the tests run on."""
    import torch

    (spec,) = [r for r in _project()["dependencies"] if _requirement_name(r) == "torch"]
    bounds = dict(re.findall(r"(>=|<)\s*([\d.]+)", spec))
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    low = tuple(int(x) for x in bounds[">="].split(".")[:2])
    high = tuple(int(x) for x in bounds["<"].split(".")[:2])
    assert low <= version < high, (spec, torch.__version__)


def test_readme_is_a_front_door_and_its_links_exist():
    """Issue 20, item 7: the README stays short (~15 KB) and the documents it sends readers
    to exist."""
    root = pathlib.Path(__file__).resolve().parent.parent
    text = (root / "README.md").read_text(encoding="utf-8")
    assert len(text.encode()) <= 16_000, len(text.encode())
    for cmd in ("./run demo", "./run test"):
        assert cmd in text
    linked = set(re.findall(r"`(docs/[\w./-]+\.md)`", text))
    assert {"docs/results.md", "docs/guide.md", "docs/architecture.md"} <= linked, linked
    for path in linked:
        assert (root / path).exists(), path
