"""Installation-level promises: the entry point and the private-API boundary."""
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


def test_private_torch_apis_only_in_the_compat_module():
    """Nothing outside megacompile/core/torch_compat.py imports from torch._* (one place to fix)."""
    pattern = re.compile(r"^\s*(from|import)\s+torch\._", re.M)
    offenders = []
    for folder in ("megacompile", "passes", "runtime"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.relative_to(ROOT).as_posix() == "megacompile/core/torch_compat.py":
                continue
            if pattern.search(path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
