"""`megacompile inspect --plot` and `megacompile plot TRACE.json` (megacompile/cli/plots.py,
plot_data.py, plot_command.py).

One inspect run of a small MLP under a budget draws its memory timeline and the last step's
runtime lanes. The PNGs are checked as files; what they draw is checked through the series
``plot_data`` hands the drawing: the peak marked is the planned peak, the measured points are
the last run's, and each lane's bars are the trace's events on that track.
"""
from __future__ import annotations

import json

import matplotlib.image
import pytest
from conftest import compile_small_training_graph

from megacompile.capture.records import recording
from megacompile.cli import commands as cli
from megacompile.cli.plot_data import last_step_window, memory_timeline, read_trace, trace_lanes
from megacompile.core import ops
from megacompile.core.node_info import info
from megacompile.report import last_report

SCRIPT = """\
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


step = torch.compile(step, backend="megatrain",
                     options={"device": "cpu", "lowering": "eager", "memory_budget": 2048})
for _ in range(3):
    step(torch.randn(4, 8), torch.randn(4, 4))
"""

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def plotted(tmp_path_factory):
    """(training graph's record, output directory, the step report) of one `inspect --plot` run.
    (Graph labels count per process: the training graph is graph0 only in a fresh one.)"""
    root = tmp_path_factory.mktemp("plots")
    script = root / "train_mlp.py"
    script.write_text(SCRIPT)
    out = root / "out"
    with recording() as records:
        assert cli.main(["inspect", "--plot", "--out", str(out), str(script)]) == 0
    index = next(i for i, r in enumerate(records) if r.backward is not None)
    return records[index], out / cli._directory_names(records)[index], last_report()


def _assert_png(path, min_bytes=8000):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and min_bytes < len(data) < 200_000
    height, width, _ = matplotlib.image.imread(str(path)).shape
    assert height > 200 and width > 600


def test_pngs_are_written(plotted):
    _, graph_dir, _ = plotted
    _assert_png(graph_dir / "memory.png")
    _assert_png(graph_dir.parent / "runtime-lanes.png")
    assert (graph_dir.parent / "runtime-trace.json").exists()


def test_memory_timeline_is_the_plan(plotted):
    record, _, report = plotted
    timeline = memory_timeline(record)
    # Every node of the forward, then every node of the backward.
    forward = [n.name for n in record.forward.graph.nodes]
    backward = [n.name for n in record.backward.graph.nodes]
    assert timeline.nodes == forward + backward and timeline.backward_start == len(forward)
    # The peak marked is the planned peak, where the plan says it is.
    assert timeline.peak_bytes == record.plan.peak_bytes == report.planned_peak_device_bytes
    assert timeline.planned[timeline.peak_index] == max(timeline.planned)
    est = record.plan.forward if timeline.peak_index < len(forward) else record.plan.backward
    assert timeline.nodes[timeline.peak_index] == est.peak_node
    assert timeline.budget == 2048
    # Shaded layers: stretches where one layer's ops compute (memory ops run inside them).
    by_name = {n.name: n for gm in (record.forward, record.backward) for n in gm.graph.nodes}
    assert [layer for layer, _, _ in timeline.layers] == ["0", "1", "2", "2", "1", "0"]
    for layer, first, last in timeline.layers:
        stretch = [by_name[name] for name in timeline.nodes[first:last + 1]]
        computed = [n for n in stretch if n.op == "call_function" and not ops.is_memory_op(n)]
        assert all(info(n).layer in (layer, None) for n in computed)  # glue runs inside a layer's stretch
        assert not ops.is_memory_op(stretch[0])


def test_memory_timeline_measures_the_last_run(plotted):
    record, _, report = plotted
    timeline = memory_timeline(record)
    measured = [m for m in timeline.measured if m is not None]
    # The eager lowering on the stand-in runs op by op: every instruction is measured.
    assert len(measured) == sum(1 for n in record.forward.graph.nodes if n.op == "call_function") + sum(
        1 for n in record.backward.graph.nodes if n.op == "call_function")
    assert 0 < max(measured) <= report.measured_peak_device_bytes


def test_memory_log_is_kept_only_under_inspect():
    record = compile_small_training_graph()
    assert record.memory_logs == {}


def test_lanes_are_the_trace(plotted):
    record, graph_dir, _ = plotted
    trace = read_trace(graph_dir.parent / "runtime-trace.json")
    track_names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    lanes = trace_lanes(trace)
    assert {"compute", "h2d", "d2h", "host optimizer"} <= {lane.name for lane in lanes}
    for lane in lanes:
        events = sorted((e["ts"], e["dur"], e["name"]) for e in trace["traceEvents"]
                        if e["ph"] == "X" and track_names[e["tid"]] == lane.name)
        assert lane.spans == events
    # The last step: from its forward program's start (three steps ran), every later event.
    start, end = last_step_window(trace)
    forward = f"{record.label} forward"
    forwards = sorted(e["ts"] for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == forward)
    assert len(forwards) == 3 and start == forwards[-1]
    last = trace_lanes(trace, (start, end))
    assert sum(len(lane.spans) for lane in last) == sum(
        1 for e in trace["traceEvents"] if e["ph"] == "X" and e["ts"] >= start)


def test_plot_command(plotted, tmp_path, capsys):
    _, graph_dir, _ = plotted
    png = tmp_path / "lanes.png"
    assert cli.main(["plot", str(graph_dir.parent / "runtime-trace.json"), "--out", str(png), "--last-step"]) == 0
    _assert_png(png)
    assert f"wrote {png}" in capsys.readouterr().out


def test_plot_command_refuses_what_is_not_a_trace(tmp_path, capsys):
    bad = tmp_path / "report.json"
    bad.write_text(json.dumps({"planned_peak_device_bytes": 1}))
    assert cli.main(["plot", str(bad)]) == 2
    assert "has no 'traceEvents' list: it is not a Chrome trace" in capsys.readouterr().err
    assert cli.main(["plot", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_plot_needs_an_output_directory(tmp_path, capsys):
    script = tmp_path / "train_mlp.py"
    script.write_text(SCRIPT)
    assert cli.main(["inspect", str(script), "--plot"]) == 2
    assert "--plot writes files: give the directory with --out DIR" in capsys.readouterr().err
