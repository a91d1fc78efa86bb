"""Per-layer mixes with streamed layers ("recompute, layer input offloaded") below the floor.

Between the streaming minimum (every layer replayed, every input on the host) and the smallest
plan without streamed layers, the planner builds per-layer mixes in which some layers are kept
or recomputed and the others streamed (``flat_planner._streamed_mixes``). At a budget in that
span, one of them runs: its peak is the planned one and it trains like eager.
"""
import torch
from reference_models import GPT, _token_batch, _xent, make_training_step, train_side_by_side

import megacompile
from megacompile.capture import records
from megacompile.core.errors import BudgetError
from megacompile.core.node_info import has_info, info
from megacompile.plan import flat_planner
from megacompile.plan.streamed_layers import STREAMED

OPTIONS = {"plan_repeats": "flat"}


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(layers=4, context=128)


def _batches(n: int = 2):
    gen = torch.Generator().manual_seed(1)
    return [_token_batch(gen, batch=4, seq=128) for _ in range(n)]


def _built_plans(monkeypatch) -> list:
    """Every plan the planner builds for the step's graph (its first planning: the graph as
    captured), with a budget nothing meets. The retry with token-chunked layers is switched off:
    its plans are not read."""
    calls: list[list] = []
    plan_training, make = flat_planner.plan_training, flat_planner.PlanMaker.make

    def spy_plan(*args, **kwargs):
        calls.append([])
        return plan_training(*args, **kwargs)

    def spy_make(self, spec, snapshots=False):
        attempt = make(self, spec, snapshots)
        calls[-1].append(attempt)
        return attempt

    monkeypatch.setattr(flat_planner, "plan_training", spy_plan)
    monkeypatch.setattr(flat_planner.PlanMaker, "make", spy_make)
    step, _ = make_training_step(_model(), _xent)
    compiled = torch.compile(step, backend="megatrain",
                             options={"device": "cpu", "lowering": "eager", "memory_budget": 1024,
                                      "disable_passes": ["chunk_tokens"], **OPTIONS})
    try:
        compiled(*_batches(1)[0])
    except BudgetError:
        pass
    torch._dynamo.reset()
    monkeypatch.undo()
    return calls[0]


def _is_streamed(name: str) -> bool:
    return name.startswith("per-layer (") and "streamed" in name or "layer inputs offloaded" in name


def test_budget_under_the_floor_streams_some_layers_and_trains_like_eager(monkeypatch):
    built = _built_plans(monkeypatch)
    floor = min(a.peak for a in built if not _is_streamed(a.plan.policy))
    minimum = next(a for a in built if "layer inputs offloaded (all layers)" in a.plan.policy)
    mixes = [a for a in built if a.plan.policy.startswith("per-layer (") and "streamed" in a.plan.policy]
    assert any(minimum.peak < a.peak < floor for a in mixes), [(a.plan.policy, a.peak) for a in built]

    budget = floor - 1  # under every plan without streamed layers
    model = _model()
    with records.recording() as compiled:
        pairs, reference = train_side_by_side(model, lambda m: make_training_step(m, _xent)[0], _batches(),
                                              {"memory_budget": budget, **OPTIONS})
    # Trains like eager (fp32, two AdamW steps).
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    report = megacompile.last_report()
    (record,) = [r for r in compiled if r.backward is not None]
    plan = record.plan
    streamed = [layer for layer, row in plan.layer_costs.items() if row["name"] == STREAMED]
    kept_or_recomputed = [layer for layer, row in plan.layer_costs.items()
                          if row["name"] != STREAMED and layer.startswith("blocks.")]
    assert plan.policy.startswith("per-layer (") and streamed and kept_or_recomputed, plan.policy
    assert minimum.peak < plan.peak_bytes <= budget
    # The reason names the streamed layers; each offloaded input names its layer.
    assert f"streamed ({STREAMED}" in plan.reason and all(layer in plan.reason for layer in streamed), plan.reason
    reasons = {info(n).reason for n in record.forward.graph.nodes if has_info(n) and info(n).reason}
    for layer in streamed:
        if any(layer in v for v in plan.value_reason.values()):
            assert any(f"replayed layer '{layer}'" in r for r in reasons), (layer, reasons)
    assert {plan.value_policy[v] for v in plan.value_policy} == {"offload"}
    # The peak as planned and as measured on the CPU stand-in.
    measured, planned = report.measured_peak_device_bytes, report.planned_peak_device_bytes
    assert measured <= budget, str(report)
    assert abs(planned - measured) / measured <= 0.05, (planned, measured)


def test_streamed_mixes_above_the_floor_keep_layers_where_recompute_all_would_not(monkeypatch):
    """Above recompute-all's peak the planner also builds mixes that keep some layers and stream
    the others (``_streamed_mixes(above_floor=True)``): a streamed layer leaves no boundary on the
    device, so such a mix keeps layers at budgets where keeping them beside recomputed layers'
    boundaries does not fit. Each peaks between recompute-all and keeping everything, and each
    keeps at least one layer."""
    built = _built_plans(monkeypatch)
    recompute_all = next(a for a in built if a.plan.policy == "recompute (all layers)")
    keep = next(a for a in built if a.plan.policy == "keep")
    above = [a for a in built if a.plan.policy.startswith("per-layer (keep")
             and "streamed" in a.plan.policy and a.peak > recompute_all.peak]
    assert above, [(a.plan.policy, a.peak) for a in built]
    for a in above:
        assert recompute_all.peak < a.peak < keep.peak, (a.plan.policy, a.peak)
        kept = [layer for layer, row in a.plan.layer_costs.items()
                if row["name"] == "keep" and layer.startswith("blocks.")]
        streamed = [layer for layer, row in a.plan.layer_costs.items() if row["name"] == STREAMED]
        assert kept and streamed, a.plan.layer_costs
