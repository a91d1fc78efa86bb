"""The planner's predictions hold (issue 3, deliverable 4).

Across the golden models and four budgets from generous down to the minimum:
- the measured peak device bytes stay within the budget, and within 5% of the planned peak;
- as the budget grows, the predicted extra time of the plan and the number of recomputed
  ops never increase;
- with a budget that fits everything, the plan recomputes nothing and offloads nothing.
"""
import copy

import pytest
import torch

import megacompile
from megacompile.capture import COMPILED
from megacompile.cost_model import predict_record
from megacompile.hardware import get_profile
from reference_models import GPT, MLP, LlamaLogits, REFERENCE_MODELS, make_training_step

MODELS = {
    "mlp": lambda: MLP(depth=4),
    "gpt": lambda: GPT(layers=2),
    "llama": lambda: LlamaLogits(layers=2),
}


def _run(name: str, budget: int | None):
    torch._dynamo.reset()
    COMPILED.clear()
    _, make_batch, loss_fn = REFERENCE_MODELS[name]
    torch.manual_seed(0)
    model = MODELS[name]()
    reference = copy.deepcopy(model)
    step, _ = make_training_step(model, loss_fn)
    eager_step, _ = make_training_step(reference, loss_fn)
    step = torch.compile(step, backend="megatrain",
                         options={"device": "cpu", "lowering": "eager", "memory_budget": budget})
    x, y = make_batch(torch.Generator().manual_seed(1))
    torch.testing.assert_close(step(x, y), eager_step(x, y), rtol=1e-5, atol=0)
    record = next(r for r in COMPILED if r.backward is not None)
    predicted = predict_record(record, get_profile("cpu-standin")).total_s
    return megacompile.last_report(), record.plan, predicted


@pytest.mark.parametrize("name", sorted(MODELS))
def test_predictions_hold_from_generous_to_minimum_budget(name):
    generous_report, generous_plan, _ = _run(name, None)
    # Everything fits: nothing recomputed (beyond re-deriving views of parameters) or offloaded.
    assert generous_plan.policy.startswith("keep")
    assert not any(p in ("recompute", "offload") for p in generous_plan.layer_policy.values())
    assert all(info_phase_is_view(op) for op in generous_report.recomputed_ops)
    assert generous_report.d2h_bytes == sum(r.param_bytes for r in generous_report.layers) + 4  # grads + loss

    with pytest.raises(megacompile.BudgetError) as excinfo:
        _run(name, 1024)
    minimum = excinfo.value.minimum_budget
    keep_peak = generous_report.planned_peak_device_bytes
    assert minimum < keep_peak

    budgets = [minimum + (keep_peak - minimum) * k // 3 for k in range(4)]  # minimum .. keep_peak
    results = [_run(name, b) for b in budgets]
    for budget, (report, plan, _) in zip(budgets, results):
        measured, planned = report.measured_peak_device_bytes, report.planned_peak_device_bytes
        assert measured <= budget, f"budget {budget}: measured {measured}\n{report}"
        assert abs(planned - measured) / measured <= 0.05, f"budget {budget}: planned {planned} measured {measured}"
    # Predicted step time (the cost model's three lanes + host optimizer) of each plan.
    times = [predicted for _, _, predicted in results]
    recomputed = [len(report.recomputed_ops) for report, _, _ in results]
    assert all(a >= b - 1e-12 for a, b in zip(times, times[1:])), times
    assert recomputed == sorted(recomputed, reverse=True), recomputed
    assert times[-1] <= times[0]
    # The tightest budget really needed the planner.
    assert results[0][1].policy != "keep"


def info_phase_is_view(op_name: str) -> bool:
    # Recomputed ops under the keep plan are views of parameters (t, view, permute, ...),
    # named after the aten op by AOTAutograd.
    base = op_name.rstrip("0123456789_")
    return base in {"t", "view", "permute", "expand", "transpose", "unsqueeze", "squeeze", "alias",
                    "_unsafe_view", "slice", "select", "detach", "as_strided", "reshape"}
