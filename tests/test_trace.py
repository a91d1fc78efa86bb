"""The runtime's Chrome trace (issue 4): ``megacompile.trace_runtime(path)``.

A short training run under the trace writes valid Chrome trace JSON whose events cover
every lane the run used, are named after the program's nodes, never overlap on one track,
and match the programs instruction for instruction; with no trace active nothing is
recorded.
"""
import collections
import json
import threading

import pytest
import torch
from conftest import COMPILED
from reference_models import REFERENCE_MODELS, make_training_step, training_state_bytes

import megacompile
from megacompile.core import ops
from megacompile.runtime import trace

INSTRUCTION_LANES = {"compute", "h2d", "d2h", "wait", "evict"}


def _train(lowering: str, steps: int, path=None):
    ctor, make_batch, loss_fn = REFERENCE_MODELS["mlp"]
    torch.manual_seed(0)
    model = ctor(depth=3)
    budget = training_state_bytes(model) // 3  # parameters stream, gradients leave early
    step, _ = make_training_step(model, loss_fn)
    step = torch.compile(step, backend="megatrain",
                         options={"device": "cpu", "lowering": lowering, "memory_budget": budget,
                                  "overlap_optimizer": True})
    gen = torch.Generator().manual_seed(1)
    batches = [make_batch(gen) for _ in range(steps + 1)]
    step(*batches[0])  # compiles outside the trace
    if path is None:
        for x, y in batches[1:]:
            step(x, y)
        return step, None
    with megacompile.trace_runtime(path) as recorder:
        for x, y in batches[1:]:
            step(x, y)
    return step, recorder


def _load(path):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    events = data["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans:
        assert set(e) >= {"name", "ph", "ts", "dur", "pid", "tid", "args"}, e
        assert e["dur"] >= 0 and e["ts"] >= 0, e
        assert e["tid"] in tracks, e
    return spans, tracks


def _instruction_nodes():
    """Every node that is one instruction of a streaming program (eager lowering)."""
    nodes = []
    for record in COMPILED:
        for gm in (record.forward, record.backward):
            if gm is not None:
                nodes += [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    return nodes


def _assert_no_overlap(spans):
    by_track = collections.defaultdict(list)
    for e in spans:
        by_track[e["tid"]].append(e)
    for tid, events in by_track.items():
        events.sort(key=lambda e: e["ts"])
        for a, b in zip(events, events[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (tid, a, b)


def test_training_run_trace_covers_lanes_and_program(tmp_path):
    steps = 2
    path = tmp_path / "runtime.json"
    _train("eager", steps, path)
    spans, tracks = _load(path)

    lanes = {tracks[e["tid"]].split(" [")[0] for e in spans}
    assert lanes == {"graphs", "compute", "h2d", "d2h", "wait", "evict", "host optimizer"}, lanes
    # These steps overlap the optimizer with the backward: its per-layer updates are on the
    # worker thread's own track, inside the backward program's event.
    updates = [e for e in spans if tracks[e["tid"]].startswith("host optimizer [")]
    assert updates and all(e["args"]["overlapped"] for e in updates)
    backwards = [e for e in spans if tracks[e["tid"]] == "graphs" and "backward" in e["name"]]
    assert all(any(b["ts"] <= u["ts"] and u["ts"] + u["dur"] <= b["ts"] + b["dur"] + 1e-3 for b in backwards)
               for u in updates)

    nodes = _instruction_nodes()
    by_kind = collections.Counter()
    for n in nodes:
        kind = n.target._schema.name.split("::")[-1] if ops.is_memory_op(n) else "op"
        lane = {"load": "h2d", "offload": "d2h", "wait": "wait", "evict": "evict"}.get(kind, "compute")
        by_kind[(lane, n.name)] += 1
    recorded = collections.Counter((tracks[e["tid"]], e["name"]) for e in spans
                                   if tracks[e["tid"]] in INSTRUCTION_LANES)
    # Every instruction of every program, once per step, on its lane, under its node's name.
    assert recorded == collections.Counter({k: v * steps for k, v in by_kind.items()})

    loads = [e for e in spans if tracks[e["tid"]] == "h2d"]
    assert any(e["args"]["layer"] == "layers.1" for e in loads)
    assert all(e["args"]["bytes"] > 0 for e in loads)
    weight = next(e for e in loads if e["name"] == "load__layers_1_0_weight")
    assert weight["args"]["bytes"] == 64 * 64 * 4

    programs = [e["name"] for e in spans if tracks[e["tid"]] == "graphs"]
    assert sum(name.endswith("forward") for name in programs) == 2 * steps  # the step, loss.detach()
    assert sum(name.endswith("backward") for name in programs) == steps
    # Each step's AdamW update of every parameter, layer by layer, on the worker's track.
    n_params = len(list(REFERENCE_MODELS["mlp"][0](depth=3).parameters()))
    assert sum(e["args"]["tensors"] for e in updates) == steps * n_params

    _assert_no_overlap(spans)
    # Instructions lie inside their program's event.
    graphs = sorted((e for e in spans if tracks[e["tid"]] == "graphs"), key=lambda e: e["ts"])
    for e in spans:
        if tracks[e["tid"]] in INSTRUCTION_LANES:
            assert any(g["ts"] - 1e-3 <= e["ts"] and e["ts"] + e["dur"] <= g["ts"] + g["dur"] + 1e-3
                       for g in graphs), e


def test_host_thread_summary_counts_what_the_programs_ran(tmp_path):
    """``recorder.host_thread_summary()``: the instructions the programs ran, by kind, once per
    step (ops run one by one through dispatch apart from compiled segments), and the thread's
    time inside them, which lies within its time inside the programs."""
    steps = 2
    _, recorder = _train("eager", steps, tmp_path / "runtime.json")
    summary = recorder.host_thread_summary()
    nodes = _instruction_nodes()
    memory = collections.Counter(n.target._schema.name.split("::")[-1] for n in nodes if ops.is_memory_op(n))
    computed = sum(1 for n in nodes if not ops.is_memory_op(n))
    counts = summary["instructions"]
    assert counts["op"] == computed * steps  # the eager lowering: every compute node is one op
    assert "segment" not in counts
    for kind in ("load", "offload", "wait", "evict"):
        assert counts.get(kind, 0) == memory[kind] * steps, kind
    assert 0 < summary["busy_s"] <= summary["program_s"]
    assert summary["busy_fraction"] == pytest.approx(summary["busy_s"] / summary["program_s"])
    by_kind = summary["busy_s_by_kind"]
    assert set(by_kind) == set(counts) and all(t > 0 for t in by_kind.values())
    assert sum(by_kind.values()) == pytest.approx(summary["busy_s"])


def test_tracing_off_records_nothing(tmp_path):
    path = tmp_path / "one.json"
    step, recorder = _train("eager", 1, path)
    assert trace.active() is None
    before = len(recorder.to_json()["traceEvents"])
    ctor, make_batch, _ = REFERENCE_MODELS["mlp"]
    step(*make_batch(torch.Generator().manual_seed(2)))  # after the trace ended
    with trace.span("host optimizer", "outside"):
        pass
    assert len(recorder.to_json()["traceEvents"]) == before
    assert trace.span("compute", "x") is trace.span("h2d", "y")  # the shared no-op


def test_span_from_worker_threads_gets_its_own_track(tmp_path):
    path = tmp_path / "threads.json"
    started = threading.Barrier(2)

    def worker():
        started.wait()
        with trace.span("host optimizer", "adam group 1", layer="layers.1", bytes=123):
            pass

    with megacompile.trace_runtime(path):
        with trace.span("host optimizer", "adam group 0", layer="layers.0", bytes=456):
            t = threading.Thread(target=worker, name="worker-1")
            t.start()
            started.wait()
            t.join()
    spans, tracks = _load(path)
    names = {tracks[e["tid"]]: e for e in spans}
    assert set(names) == {"host optimizer", "host optimizer [worker-1]"}
    assert names["host optimizer"]["args"] == {"layer": "layers.0", "bytes": 456}
    assert names["host optimizer [worker-1]"]["name"] == "adam group 1"
    # The worker's span ran inside the main thread's: they overlap in time, on two tracks.
    outer, inner = names["host optimizer"], names["host optimizer [worker-1]"]
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def test_traces_nest(tmp_path):
    """A trace opened inside another (a script's own, under `megacompile inspect --plot`):
    both record what runs inside the inner one; the outer one also what runs outside it."""
    with megacompile.trace_runtime(tmp_path / "outer.json"):
        with trace.span("host", "before"):
            pass
        with megacompile.trace_runtime(tmp_path / "inner.json"):
            with trace.span("host", "inside"):
                pass
        with trace.span("host", "after"):
            pass
    names = {}
    for which in ("outer", "inner"):
        events = json.loads((tmp_path / f"{which}.json").read_text())["traceEvents"]
        names[which] = [e["name"] for e in events if e["ph"] == "X"]
    assert names == {"outer": ["before", "inside", "after"], "inner": ["inside"]}
    assert trace.active() is None


@pytest.mark.inductor
def test_inductor_segments_are_named_after_their_nodes(tmp_path):
    path = tmp_path / "inductor.json"
    _train("inductor", 1, path)
    spans, tracks = _load(path)
    names = {n.name for n in _instruction_nodes()}
    segments = [e for e in spans if e["name"].startswith("segment[")]
    assert segments
    for e in segments:
        assert tracks[e["tid"]] == "compute"
        first, last = e["name"][len("segment["):-1].split("..")
        assert first in names and last in names, e["name"]
    for e in spans:
        if tracks[e["tid"]] in INSTRUCTION_LANES and not e["name"].startswith("segment["):
            assert e["name"] in names, e["name"]
    _assert_no_overlap(spans)
