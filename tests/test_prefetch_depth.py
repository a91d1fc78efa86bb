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
from conftest import COMPILED
from reference_models import make_training_step

import megacompile
from megacompile.core import ops
from megacompile.core.node_info import info


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
    record = next(r for r in reversed(COMPILED) if r.plan is not None and r.plan.policy != "inference")
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
    # The first layer's weight is loaded before any compute: deeper it lands in the same place,
    # so no variant is built for it (nor is it given a depth).
    from megacompile.plan.flat_planner import _loads_after_compute

    movable = {info(n).source for n in _loads_after_compute(roomy.forward)}
    assert wide in movable and "layers.0.0.weight" not in movable, movable
    assert "layers.0.0.weight" not in roomy.plan.prefetch

    # The same model planned without deeper prefetch: the compute lane waits longer for
    # its loads, by the same cost model, and the deeper plan is predicted faster.
    from megacompile.core.torch_compat import reset_dynamo

    reset_dynamo()
    default, _ = train_with_prefetch_disabled()
    assert default.plan.prefetch == {}
    deep_time, default_time = predicted(roomy), predicted(default)
    assert deep_time.exposed_wait_s < default_time.exposed_wait_s
    assert deep_time.total_s < default_time.total_s
    assert roomy.plan.predicted_seconds == deep_time.total_s


def predicted(record):
    from megacompile.plan.cost_model import step_time
    from megacompile.plan.hardware import get_profile

    param_bytes = sum(record.param_bytes_by_layer.values())
    # Lowered eagerly (train()'s options): no op fuses, as the planner priced it.
    return step_time(record.forward, record.backward, get_profile("h100-pcie"), optimizer_param_bytes=param_bytes,
                     fused_pointwise=False)


def train_with_prefetch_disabled():
    import megacompile.plan.flat_planner as planner

    original = planner._load_stalls
    planner._load_stalls = lambda *a, **k: {}
    try:
        return train(budget=None)
    finally:
        planner._load_stalls = original



def _plans_and_builds(budget: int | None, monkeypatch) -> tuple:
    """(the chosen plan, every plan built for it) for the reference MLP on an H100 PCIe
    profile under ``budget``; training equals eager."""
    from reference_models import REFERENCE_MODELS

    import megacompile.plan.flat_planner as planner
    from megacompile.core.torch_compat import reset_dynamo

    built = []
    plan_training = planner.plan_training

    def recording(build, *args, **kwargs):
        def recorded_build(plan, **kw):
            attempt = build(plan, **kw)
            built.append(attempt.plan)
            return attempt
        return plan_training(recorded_build, *args, **kwargs)

    ctor, batch, loss_fn = REFERENCE_MODELS["mlp"]
    torch.manual_seed(0)
    model = ctor()
    step, _ = make_training_step(model, loss_fn)
    eager_step, _ = make_training_step(copy.deepcopy(model), loss_fn)
    options = {"device": "cpu", "lowering": "eager", "hardware": "h100-pcie"}
    if budget is not None:
        options["memory_budget"] = budget
    with monkeypatch.context() as m:
        m.setattr(planner, "plan_training", recording)
        reset_dynamo()
        compiled = torch.compile(step, backend="megatrain", options=options)
        x, y = batch(torch.Generator().manual_seed(1))
        torch.testing.assert_close(compiled(x, y), eager_step(x, y), rtol=1e-5, atol=1e-6)
    report = megacompile.last_report()
    assert budget is None or report.measured_peak_device_bytes <= budget
    return report, built


def test_deeper_prefetch_is_built_only_for_rungs_within_the_budget(monkeypatch):
    """A deeper-prefetch variant's peak is never below its rung's, so the planner builds one
    only for rungs that fit: the chosen plan is the one building every variant gives, with
    fewer builds."""
    import megacompile.plan.flat_planner as planner

    # The ladder's own choice: the planner would take a plan as fast that holds less on the host
    # (flat_planner._least_on_host_as_fast_as) and prefetches nothing deeper; the property here
    # is the ladder's.
    monkeypatch.setattr(planner, "_least_on_host_as_fast_as", lambda chosen, fitting: chosen)
    keep_peak = _plans_and_builds(None, monkeypatch)[0].planned_peak_device_bytes
    budget = int(keep_peak * 0.6)  # a per-activation plan with deeper prefetch
    with monkeypatch.context() as m:  # the planner as it was: a variant for every rung
        m.setattr(planner, "_rungs_to_prefetch_deeper", lambda ladder, fits: ladder)
        every, every_built = _plans_and_builds(budget, monkeypatch)
    chosen, built = _plans_and_builds(budget, monkeypatch)
    assert "deeper prefetch" in chosen.policy, chosen.policy
    assert (chosen.policy, chosen.planned_peak_device_bytes, chosen.recomputed_ops, chosen.h2d_bytes) == (
        every.policy, every.planned_peak_device_bytes, every.recomputed_ops, every.h2d_bytes)
    assert len(built) < len(every_built), (len(built), len(every_built))
    # The property the pruning stands on, checked on every variant built for a rung.
    def decisions(p):  # what a variant copies from its rung (it changes only the prefetch)
        return (p.default_policy, sorted(p.layer_policy.items()), sorted(p.value_policy.items()), p.resident)

    variants = [p for p in every_built if ", deeper prefetch for" in p.policy]
    assert len(variants) > 1, [p.policy for p in every_built]
    for plan in variants:
        (rung,) = [r for r in every_built if r not in variants and decisions(r) == decisions(plan)]
        assert plan.peak_bytes >= rung.peak_bytes, (plan.policy, plan.peak_bytes, rung.peak_bytes)
