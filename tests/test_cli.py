"""Tests for the ``megacompile`` command line (megacompile/cli/commands.py).

``inspect`` runs in-process through ``main([...])``: a subprocess would pay torch's import
(seconds) every time. One test runs the installed console script to check the wiring.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from conftest import COMPILED, MLP_TRAIN_SCRIPT

from megacompile.cli import commands as cli

PASSES = {
    "joint": ["annotate", "host_casts", "resident_parameters", "recompute"],
    "forward": ["annotate", "host_casts", "stream_parameters", "offload_gradients"],
    "backward": ["annotate", "host_casts", "recompute", "stream_parameters", "offload_gradients"],
}


@pytest.fixture
def train_script(tmp_path):
    path = tmp_path / "train_mlp.py"
    path.write_text(MLP_TRAIN_SCRIPT)
    return path


def _sections(out: str) -> dict[tuple[str, str], tuple[str, str]]:
    """Printed snapshots by (graph, stage) -> (header, text), for the training graph."""
    found = {}
    parts = re.split(r"^======== (.*) ========$", out, flags=re.M)
    for header, text in zip(parts[1::2], parts[2::2]):
        m = re.match(r"graph\d+ \[\d\d\] (\w+) / (\w+) -- ", header)
        if m:
            found[(m.group(1), m.group(2))] = (header, text.lstrip("\n"))
    return found


def test_inspect_prints_every_pass_with_provenance(train_script, capsys):
    assert cli.main(["inspect", str(train_script), "--steps", "2"]) == 0
    captured = capsys.readouterr()
    sections = _sections(captured.out)

    for graph, passes in PASSES.items():
        header, _ = sections[(graph, "captured")]
        assert "captured (as traced by AOTAutograd" in header
        for name in passes:
            header, text = sections[(graph, name)]
            assert re.search(rf"-- pass {name}: created \d+ node\(s\), erased \d+, took [\d.]+ ms$", header), header
            assert text.startswith(f"# {graph} graph: after {name}")

    forward = sections[("forward", "offload_gradients")][1]
    backward = sections[("backward", "offload_gradients")][1]
    assert "megatrain.load(" in forward and "megatrain.evict(" in forward
    assert "megatrain.offload(" in backward

    # Plan summary and the step report come before the snapshots.
    assert "plan         policy keep (parameters resident), planned peak" in captured.out
    assert "reason       " in captured.out
    assert "megatrain step report (cpu, lowering=eager, policy=keep (parameters resident))" in captured.out
    assert "optimizer (host) [00] optimizer / captured" in captured.out
    # The script saw its own argv and the inspect marker; its prints went to stderr.
    assert "argv ['--steps', '2'] inspect 1" in captured.err
    assert re.search(r"^loss ", captured.err, flags=re.M) and not re.search(r"^loss ", captured.out, flags=re.M)
    assert "MEGACOMPILE_INSPECT" not in os.environ


def test_inspect_out_writes_one_file_per_snapshot(train_script, tmp_path, capsys):
    out_dir = tmp_path / "dump"
    # --out after the script's path: inspect's own options are recognised there too.
    assert cli.main(["inspect", str(train_script), "--out", str(out_dir),
                     "--stage", "forward", "--stage", "backward/offload_gradients"]) == 0
    printed = capsys.readouterr().out

    # Labels come from a process-wide counter (graph0 in a fresh process).
    graph_dirs = [p.name for p in out_dir.iterdir() if p.is_dir()]
    assert len(graph_dirs) == 1 and re.fullmatch(r"graph\d+", graph_dirs[0]), \
        f"only the training graph has forward/backward snapshots: {graph_dirs}"
    label = graph_dirs[0]
    names = sorted(os.listdir(out_dir / label))
    # NN counts each snapshot's position in the graph's pipeline (dynamo 00-03 and joint 04-08
    # are unselected).
    assert names == [
        "09-forward-captured.py", "10-forward-annotate.py", "11-forward-host_casts.py",
        "12-forward-stream_parameters.py", "13-forward-offload_gradients.py", "19-backward-offload_gradients.py",
    ]
    streamed = (out_dir / label / "12-forward-stream_parameters.py").read_text()
    assert streamed.splitlines()[0].startswith(
        f"# megacompile inspect: {label} [12] forward / stream_parameters -- pass stream_parameters: created")
    assert "megatrain.load(" in streamed
    assert "megatrain.offload(" in (out_dir / label / "19-backward-offload_gradients.py").read_text()

    summary = (out_dir / "summary.txt").read_text()
    assert "policy keep" in summary and "megatrain step report" in summary
    assert str(out_dir / label / "09-forward-captured.py") in summary
    # With --out, stdout has the summary only, not the graphs.
    assert "def program(" not in printed and "files:" in printed


def test_inspect_json_of_a_module(train_script, tmp_path, capsys, monkeypatch):
    # -m looks the module up from the current directory, as `python -m` does.
    monkeypatch.chdir(tmp_path)
    assert cli.main(["inspect", "--format", "json", "-m", "train_mlp"]) == 0
    data = json.loads(capsys.readouterr().out)  # the script's prints must not be in stdout

    training = next(g for g in data["graphs"] if g["plan"] and g["plan"]["policy"].startswith("keep"))
    stages = training["stages"]
    for graph, passes in PASSES.items():
        assert [s["stage"] for s in stages[graph]] == ["captured", *passes]
    last_forward = stages["forward"][-1]
    assert last_forward["provenance"]["pass"] == "offload_gradients"
    assert last_forward["file"] == f"{training['directory']}/13-forward-offload_gradients.py"
    assert "megatrain.load(" in last_forward["text"]
    assert "megatrain.offload(" in stages["backward"][-1]["text"]
    assert training["plan"]["peak_bytes"] > 0 and training["plan"]["reason"]
    assert data["report"]["policy"].startswith("keep") and data["report"]["layers"]
    assert any(g["label"] == "optimizer (host)" for g in data["graphs"])
    assert data["script"] == "-m train_mlp"


def test_inspect_bad_script_path(tmp_path, capsys):
    code = cli.main(["inspect", str(tmp_path / "missing.py")])
    assert code != 0
    assert "missing.py' does not exist" in capsys.readouterr().err


def test_inspect_script_error_exits_1(tmp_path, capsys):
    script = tmp_path / "broken.py"
    script.write_text("def setup():\n    raise ValueError('no data here')\n\nsetup()\n")
    assert cli.main(["inspect", str(script)]) == 1
    err = capsys.readouterr().err
    assert "ValueError: no data here" in err  # the user's traceback
    assert "the script raised ValueError: no data here" in err


def test_inspect_nothing_compiled_exits_1(tmp_path, capsys):
    script = tmp_path / "idle.py"
    script.write_text(textwrap.dedent("""\
        import torch
        f = torch.compile(lambda x: x + 1, backend="megatrain")  # never called
    """))
    assert cli.main(["inspect", str(script)]) == 1
    assert "compiled nothing with the megatrain backend" in capsys.readouterr().err


def test_inspect_unknown_stage_is_a_usage_error(train_script, capsys):
    assert cli.main(["inspect", "--stage", "forwardd", str(train_script)]) == 2
    assert "--stage 'forwardd' is neither a graph" in capsys.readouterr().err


def test_console_script_help():
    # The installed entry point when there is one, else the same main via `python -m`.
    exe = os.path.join(os.path.dirname(sys.executable), "megacompile")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "megacompile"]
    result = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for name in ("inspect", "calibrate"):
        assert name in result.stdout


def test_calibrate_is_wired(capsys):
    assert cli.main(["calibrate", "--help"]) == 0
    assert "--quick" in capsys.readouterr().out


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert re.fullmatch(r"megacompile \S+\n", capsys.readouterr().out)


@pytest.mark.parametrize("setting", ["default", "inspect", "on", "off_under_inspect"])
def test_snapshots_are_kept_for_inspect_only(setting, monkeypatch):
    """Formatting the program after every pass is for `inspect`: by default (snapshots="auto")
    a compile keeps none unless inspect runs the script (its environment variable), or the
    option asks. The program itself is the same either way."""
    import torch
    import torch.nn.functional as F
    from reference_models import MLP, make_training_step

    import megacompile
    from megacompile.options import INSPECT_ENV

    options = {"device": "cpu", "lowering": "eager"}
    if setting in ("inspect", "off_under_inspect"):
        monkeypatch.setenv(INSPECT_ENV, "1")
    if setting == "on":
        options["snapshots"] = True
    if setting == "off_under_inspect":
        options["snapshots"] = False
    torch.manual_seed(0)
    step, _ = make_training_step(MLP(16, 2, 4), F.mse_loss)
    torch.compile(step, backend="megatrain", options=options)(torch.randn(4, 16), torch.randn(4, 4))
    record = next(r for r in COMPILED if r.backward is not None)
    stages = [(s.graph, s.stage) for s in record.snapshots]
    if setting in ("inspect", "on"):
        assert stages[:5] == [("dynamo", "captured"), ("dynamo", "canonical_operators"),
                              ("dynamo", "elide_causal_mask"), ("dynamo", "fuse_lm_head"), ("joint", "captured")]
        assert ("backward", "offload_gradients") in stages
    else:
        assert stages == []
    assert any(n.target is megacompile.core.ops.load for n in record.forward.graph.nodes)


def test_snapshots_option_is_checked():
    from megacompile import OptionsError, parse_options

    with pytest.raises(OptionsError, match="snapshots='yes' must be True, False or 'auto'"):
        parse_options({"snapshots": "yes"})
