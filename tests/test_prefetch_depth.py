"""Per-value prefetch depth (issue 3, deliverable 3).

The planner simulates each candidate on the hardware profile's lanes; where a streamed
value's load would keep the compute lane waiting at the default depth, it also builds the
plan with that value prefetched one layer further ahead and lets the ladder (or, when
everything fits, the budget) decide. A model whose one wide layer follows narrow ones, priced
on an H100 PCIe profile: the wide layer's weights are loaded earlier, with the reason, the
predicted waits shrink, and the stand-in measures the planned peak exactly. (Where a deeper
prefetch raises the peak past the budget, the plan keeps the default depth: the candidate
does not fit.)
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import megacompile
import megacompile.capture as capture
from megacompile import ops
from megacompile.node_info import info
from reference_models import make_training_step


class NarrowThenWide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)]
            + [nn.Sequential(nn.Linear(64, 2048), nn.GELU(), nn.Linear(2048, 64))]
            + [nn.Sequential(nn.Linear(64, 64), nn.GELU())]
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def train(budget: int | None):
    torch.manual_seed(0)
    model = NarrowThenWide()
    reference = copy.deepcopy(model)
    step, _ = make_training_step(model, F.mse_loss)
    eager_step, _ = make_training_step(reference, F.mse_loss)

    options = {"device": "cpu", "lowering": "eager", "hardware": "h100-pcie",
               # Parameters stream (no residency): the prefetch depth is what is decided.
               "disable_passes": ["resident_parameters"]}
    if budget is not None:
        options["memory_budget"] = budget
    compiled = torch.compile(step, backend="megatrain", options=options)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        x, y = torch.randn(8, 64, generator=gen), torch.randn(8, 64, generator=gen)
        torch.testing.assert_close(compiled(x, y), eager_step(x, y), rtol=1e-5, atol=0)
    record = next(r for r in reversed(capture.COMPILED) if r.plan is not None and r.plan.policy != "inference")
    return record, megacompile.last_report()


def first_compute_index(gm, layer: str) -> int:
    nodes = list(gm.graph.nodes)
    return next(i for i, n in enumerate(nodes)
                if n.op == "call_function" and not ops.is_memory_op(n) and info(n).layer == layer)


def test_a_stalling_load_is_prefetched_deeper_when_the_budget_allows():
    roomy, roomy_report = train(budget=None)
    wide = "layers.3.0.weight"
    assert roomy.plan.prefetch.get(wide, 1) >= 2, roomy.plan.prefetch
    assert "would wait" in roomy.plan.prefetch_reason[wide]
    nodes = list(roomy.forward.graph.nodes)
    load = next(n for n in nodes if n.target is ops.load and info(n).source == wide)
    assert info(load).reason == roomy.plan.prefetch_reason[wide]  # shown by inspect
    # Issued before layers.2 starts (depth 1 would issue it there, one layer ahead).
    assert nodes.index(load) < first_compute_index(roomy.forward, "layers.2")
    assert roomy_report.measured_peak_device_bytes == roomy_report.planned_peak_device_bytes

    # The same model planned without deeper prefetch: the compute lane waits longer for
    # its loads, by the same cost model, and the deeper plan is predicted faster.
    from megacompile._torch_compat import reset_dynamo

    reset_dynamo()
    default, _ = train_with_prefetch_disabled()
    assert default.plan.prefetch == {}
    deep_time, default_time = predicted(roomy), predicted(default)
    assert deep_time.exposed_wait_s < default_time.exposed_wait_s
    assert deep_time.total_s < default_time.total_s
    assert roomy.plan.predicted_seconds == deep_time.total_s


def predicted(record):
    from megacompile.cost_model import step_time
    from megacompile.hardware import get_profile

    param_bytes = sum(record.param_bytes_by_layer.values())
    return step_time(record.forward, record.backward, get_profile("h100-pcie"), optimizer_param_bytes=param_bytes)


def train_with_prefetch_disabled():
    import megacompile.planner as planner

    original = planner._load_stalls
    planner._load_stalls = lambda *a, **k: {}
    try:
        return train(budget=None)
    finally:
        planner._load_stalls = original
