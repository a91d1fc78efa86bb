"""megatrain's logs through torch's logging system: TORCH_LOGS="megatrain" shows each graph's
plan decision and the compile phases with their times, "+megatrain" every pass run, and without
TORCH_LOGS nothing is printed. Each case is a fresh process: torch reads TORCH_LOGS at import.
Before torch 2.13, which loads the entry point that registers "megatrain" before it reads
TORCH_LOGS, the name is the package's: "megacompile" (megacompile_autoload.py)."""
import os
import subprocess
import sys

import pytest
import torch

# The name TORCH_LOGS takes on this torch.
LOG_NAME = "megatrain" if tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 13) else "megacompile"

STEP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
def step(x):
    loss = model(x).sum()
    loss.backward()
    return loss.detach()
step = torch.compile(step, backend="megatrain",
                     options={"device": "cpu", "lowering": "eager", "memory_budget": "1MiB"})
print("loss", float(step(torch.ones(4, 8))))
"""


def _run(torch_logs: str | None, tmp_path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    if torch_logs is not None:
        env["TORCH_LOGS"] = torch_logs
    # Not from the checkout's root: the installed package's entry points register the name.
    out = subprocess.run([sys.executable, "-c", STEP], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("loss")
    return out.stderr


@pytest.mark.parametrize("setting", ["megatrain", "+megatrain", None])
def test_torch_logs(setting, tmp_path):
    err = _run(setting.replace("megatrain", LOG_NAME) if setting else None, tmp_path)
    plan_lines = [line for line in err.splitlines() if "graph0: plan 'keep" in line]
    pass_lines = [line for line in err.splitlines() if "pass stream_parameters: +" in line]
    if setting is None:
        assert "graph0" not in err and "megacompile" not in err, err
        return
    assert len(plan_lines) == 1, err
    assert "planned peak" in plan_lines[0] and "under budget 1.00 MiB" in plan_lines[0]
    assert "graph0: why: " in err
    for phase in ("capturing it with AOTAutograd", "captured the joint forward+backward graph",
                  "graph0 forward: lowered (eager) in", "graph0 backward: lowered (eager) in"):
        assert phase in err, phase
    if setting == "megatrain":
        assert pass_lines == [], err
    else:  # debug: one line per pass run, on every graph of every candidate plan
        assert any("forward graph, plan 'keep (parameters resident)'" in line for line in pass_lines), err
        assert "backward graph" in err and "pass offload_gradients: +" in err
