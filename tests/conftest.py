import gc
import os
import sys

import pytest


def _worker_threads() -> int | None:
    """Under pytest-xdist (``./run test`` starts a worker per core) each worker gets its share
    of the cores for torch's intra-op threads, and the subprocesses it starts (through
    OMP_NUM_THREADS) too; None outside xdist. Each worker starting a thread per core
    oversubscribed them: OpenMP's spinning waits in one worker burnt the core the other
    worker was compiling on (a fifth of the suite's CPU time on 2 cores)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers <= 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // workers)))
    return int(os.environ["OMP_NUM_THREADS"])


_THREADS = _worker_threads()  # before torch is imported: its OpenMP runtime reads the variable at load

import torch  # noqa: E402
from torch._dynamo.utils import CleanupManager  # noqa: E402

if _THREADS is not None:
    torch.set_num_threads(_THREADS)  # (in case a plugin imported torch first)

sys.path.insert(0, os.path.dirname(__file__))

# Session fixtures for every test module: small training steps compiled once, their graphs kept
# (``captured_graphs.py``).
from captured_graphs import captured_gpt, captured_llama, captured_mlp, captured_mlp_bf16  # noqa: E402,F401

from megacompile.capture.records import forget_records, recording  # noqa: E402  (after the path entry above)

# Every graph megatrain compiles during the running test, oldest first (tests read it with
# ``from conftest import COMPILED``).
COMPILED: list = []


def _forget_compiled_programs() -> None:
    """Drops what earlier tests compiled. ``torch._dynamo.reset()`` clears Dynamo's caches but
    each compiled function stays a ``__compiled_fn_*`` global of the module its frame ran in
    (until its code object dies, which the reset does not make happen), and megatrain files
    records under the test functions' code objects. Both would keep every test's programs
    alive, and every later compile's optimizer lookup (a scan of live objects) would slow.
    The globals are found in Dynamo's own list of what it installed (``CleanupManager``,
    private: nothing public lists them) and set to None, not deleted: Dynamo deletes them
    itself once that code object dies."""
    torch._dynamo.reset()
    forget_records()
    for hooks in list(CleanupManager.instance.values.values()):
        for hook in hooks:
            if hook.name.startswith("__compiled_fn_") and hook.name in hook.scope:
                hook.scope[hook.name] = None


def pytest_sessionfinish(session, exitstatus):
    # What the tests froze goes back to the collector, so the interpreter's exit frees it
    # (extension modules report objects still alive at exit as leaks).
    gc.unfreeze()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from scratch: no Dynamo cache, no graphs from earlier tests. What
    earlier tests and the imports left alive is moved out of the collector's generations
    (``gc.freeze``), so collections and the optimizer lookup's scan of live objects see
    this test's objects only, as in a fresh process (no test keeps an optimizer for later)."""
    _forget_compiled_programs()
    gc.collect()
    gc.freeze()
    COMPILED.clear()
    with recording(into=COMPILED):
        yield
    _forget_compiled_programs()
    COMPILED.clear()


# The script the `inspect` tests run (cli, onnx): a 2-layer MLP trained for 2 steps on the
# CPU stand-in. megatrain compiles the forward+loss (graph with forward and backward), the SGD
# step (host graph) and the loss.detach() glue.
MLP_TRAIN_SCRIPT = """\
import os
import sys

import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


step = torch.compile(step, backend="megatrain", options={"device": "cpu", "lowering": "eager"})
for _ in range(2):
    print("loss", step(torch.randn(4, 8), torch.randn(4, 4)).item())
print("argv", sys.argv[1:], "inspect", os.environ.get("MEGACOMPILE_INSPECT"))
"""


def compile_small_training_graph(**options):
    """Compiles and runs one step of a 2-linear MLP on the CPU stand-in (eager lowering, plus
    ``options``); returns the record of its training graph."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        return loss

    compiled = torch.compile(step, backend="megatrain", options={"device": "cpu", "lowering": "eager", **options})
    compiled(torch.randn(2, 8))
    return next(r for r in COMPILED if r.backward is not None)


def record_programs(monkeypatch) -> list:
    """Every ``StreamingProgram`` built from now on in the test, in build order."""
    from megacompile.runtime.executor import StreamingProgram

    programs: list = []
    build = StreamingProgram._build

    def recording_build(self):
        build(self)
        programs.append(self)

    monkeypatch.setattr(StreamingProgram, "_build", recording_build)
    return programs
