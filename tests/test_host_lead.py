"""How far the program's thread may run ahead of the device (option ``host_lead_layers``,
runtime/host_lead.py): the bound itself, where the executor marks a new layer, and how a
trace splits the thread's time into its own work and time blocked on the device.

The waiting itself happens on CUDA only (tests/test_cuda.py runs it there); here the marks are
objects with CUDA events' ``query`` / ``synchronize``, and the stand-in's programs report their
layer changes to a device that records them."""
from __future__ import annotations

import pytest
import torch
from reference_models import REFERENCE_MODELS, make_training_step, training_state_bytes

from megacompile.core.errors import OptionsError
from megacompile.options import parse_options
from megacompile.runtime import device as device_mod
from megacompile.runtime.host_lead import HostLead
from megacompile.runtime.trace import TraceRecorder


class _Mark:
    """A device mark the test completes by hand (as the GPU would when it gets there)."""

    def __init__(self, name: str) -> None:
        self.name, self.done, self.waited = name, False, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def test_the_host_waits_for_the_oldest_layer_once_more_than_the_limit_are_outstanding():
    lead = HostLead()
    marks = [_Mark(f"layer {i}") for i in range(6)]
    blocked = []
    for i, mark in enumerate(marks):
        lead.layer_started(mark, 2, on_blocked=lambda s, e: blocked.append((s, e)))
        # Never more than two layers' marks outstanding after the host starts one.
        assert lead.outstanding == min(i + 1, 2)
    # Starting layer i (i >= 2) waited for layer i - 2, the oldest outstanding, and only that.
    assert [m.waited for m in marks] == [True, True, True, True, False, False]
    assert lead.throttles == 4 and len(blocked) == 4
    assert all(s <= e for s, e in blocked) and lead.throttled_ns == sum(e - s for s, e in blocked)


def test_a_layer_the_device_has_reached_costs_no_wait():
    lead = HostLead()
    first, second, third = _Mark("0"), _Mark("1"), _Mark("2")
    lead.layer_started(first, 1)
    first.done = True  # the device got there before the host started the next layer
    lead.layer_started(second, 1)
    lead.layer_started(third, 1)  # the device has not reached layer 1: the host waits for it
    assert not first.waited and second.waited and not third.waited
    assert lead.throttles == 1


def test_no_limit_keeps_no_marks():
    lead = HostLead()
    for i in range(4):
        lead.layer_started(_Mark(str(i)), None)
    assert lead.outstanding == 0 and lead.throttles == 0


@pytest.mark.parametrize("bad", [0, -1, True, "3", 2.0])
def test_host_lead_layers_must_be_a_positive_int_or_none(bad):
    with pytest.raises(OptionsError, match="host_lead_layers"):
        parse_options({"device": "cpu", "host_lead_layers": bad})
    assert parse_options({"device": "cpu", "host_lead_layers": None}).host_lead_layers is None
    assert parse_options({"device": "cpu", "host_lead_layers": 5}).host_lead_layers == 5
    assert parse_options({"device": "cpu"}).host_lead_layers == 3


def _layer_changes(monkeypatch, options: dict) -> list:
    """The limits the programs passed to the device at each change of layer over one
    compiled step (after the compiling one), with the layers they changed to."""
    device = device_mod.get_device("cpu")
    seen: list = []
    from megacompile.runtime import executor

    original = executor.StreamingProgram._run_instructions

    def run_instructions(self, call, env, recorder, profiled):
        seen.append(("program", self.label))
        return original(self, call, env, recorder, profiled)

    monkeypatch.setattr(executor.StreamingProgram, "_run_instructions", run_instructions)
    ctor, make_batch, loss_fn = REFERENCE_MODELS["mlp"]
    torch.manual_seed(0)
    model = ctor(depth=4)
    step, _ = make_training_step(model, loss_fn)
    step = torch.compile(step, backend="megatrain", options={
        "device": "cpu", "lowering": "eager", "memory_budget": training_state_bytes(model) // 3, **options})
    gen = torch.Generator().manual_seed(1)
    step(*make_batch(gen))
    seen.clear()
    monkeypatch.setattr(device, "layer_started", lambda limit: seen.append(("layer", limit)), raising=False)
    # The executor passes no layer name: which layer each mark stands for is read off the
    # instruction that follows it, so record the instructions too.
    from megacompile.runtime import instructions

    for cls in (instructions.ComputeOp, instructions.Segment):
        original_run = cls.run

        def run(self, call, _original=original_run):
            if seen and seen[-1][0] == "layer" and len(seen[-1]) == 2:
                seen[-1] = ("layer", seen[-1][1], self.layer)
            return _original(self, call)

        monkeypatch.setattr(cls, "run", run)
    step(*make_batch(gen))
    return seen


def test_programs_mark_each_new_layer_of_their_compute_in_order(monkeypatch):
    seen = _layer_changes(monkeypatch, {"host_lead_layers": 2})
    programs = [i for i, e in enumerate(seen) if e[0] == "program"] + [len(seen)]
    by_program = {seen[a][1]: [e for e in seen[a:b] if e[0] == "layer"] for a, b in zip(programs, programs[1:])}
    # The step's graph (its number depends on what else the process compiled before).
    backward_label = next(label for label in by_program if label.endswith(" backward"))
    forward, backward = by_program[backward_label.replace(" backward", " forward")], by_program[backward_label]
    assert all(limit == 2 for _, limit, _ in forward + backward)
    # The MLP's blocks, in the order each program computes them, each once.
    forward_layers = [layer for _, _, layer in forward]
    backward_layers = [layer for _, _, layer in backward]
    blocks = [f"layers.{i}" for i in range(4)]
    assert [layer for layer in forward_layers if layer in blocks] == blocks, forward_layers
    assert [layer for layer in backward_layers if layer in blocks] == blocks[::-1], backward_layers
    # A mark is made only where the layer changes.
    for layers in (forward_layers, backward_layers):
        assert all(a != b for a, b in zip(layers, layers[1:])), layers


def test_no_bound_makes_no_marks(monkeypatch):
    seen = _layer_changes(monkeypatch, {"host_lead_layers": None})
    assert not [e for e in seen if e[0] == "layer"]
    assert [e for e in seen if e[0] == "program"]


def test_trace_splits_the_threads_time_into_work_blocked_and_throttled(tmp_path):
    recorder = TraceRecorder(tmp_path / "t.json")
    ms = 1_000_000
    recorder.add_program("graph0 forward", 0, 100 * ms)
    recorder.add_instruction("compute", "segment[a]", 1 * ms, 11 * ms, {"kind": "segment"})
    recorder.add_instruction("wait", "wait__loss", 20 * ms, 80 * ms, {"kind": "wait"})
    recorder.add_blocked(21 * ms, 79 * ms)  # inside the wait: blocked until the copy landed
    recorder.add_throttle(12 * ms, 19 * ms)  # between instructions: the host lead's wait
    summary = recorder.host_thread_summary()
    assert summary["program_s"] == pytest.approx(0.100)
    assert summary["busy_s"] == pytest.approx(0.070)
    assert summary["blocked_s"] == pytest.approx(0.058)
    assert summary["working_s"] == pytest.approx(0.012)
    assert summary["working_fraction"] == pytest.approx(0.12)
    assert summary["throttled_s"] == pytest.approx(0.007)
    recorder.write()
    import json

    data = json.loads((tmp_path / "t.json").read_text())
    names = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "host blocked" in names
