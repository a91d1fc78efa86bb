"""A backward called with ``retain_graph=True`` (``megacompile/capture/retained_graph.py``).

Autograd then holds every saved activation until the graph is freed, where the plan frees each
at its last read, so the device holds more than planned. The first such backward of a graph
records its peak with the saved values held (the report notes it) and, where that is over the
budget, warns with the budget that fits. The estimate is checked against what the CPU stand-in
measures; training still matches eager.
"""
import copy
import re
import warnings

import torch
from reference_models import REFERENCE_MODELS, training_state_bytes

import megacompile

RETAINED = "retain_graph=True"


def _steps(retain: bool, **options):
    """Two steps of the MLP at 30% of its training state, compiled and eager, whose backward
    retains the graph or not; returns (compiled losses, eager losses, warnings' texts, last
    report, budget)."""
    ctor, make_batch, loss_fn = REFERENCE_MODELS["mlp"]
    torch.manual_seed(0)
    model = ctor(depth=3)
    reference = copy.deepcopy(model)
    budget = int(training_state_bytes(model) * 0.3)

    def make(m):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

        def step(x, y):
            loss = loss_fn(m(x), y)
            loss.backward(retain_graph=retain)
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return step

    compiled = torch.compile(make(model), backend="megatrain",
                             options={"device": "cpu", "lowering": "eager", "memory_budget": budget, **options})
    eager = make(reference)
    g = torch.Generator().manual_seed(1)
    batches = [make_batch(g) for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [compiled(*b) for b in batches]
    want = [eager(*b) for b in batches]
    texts = [str(w.message) for w in caught if "megatrain" in str(w.message)]
    return got, want, texts, megacompile.last_report(), budget


def test_a_retained_backward_over_the_budget_warns_and_the_option_plans_for_it():
    got, want, texts, report, budget = _steps(retain=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert len(texts) == 1 and RETAINED in texts[0] and "option retain_graph=True" in texts[0], texts  # once
    need = int(re.search(r"\((\d+) bytes\)", texts[0]).group(1))
    # What the device held is what the warning says (an upper bound), above both the plan and the budget.
    assert report.measured_peak_device_bytes <= need
    assert report.measured_peak_device_bytes > max(report.planned_peak_device_bytes, budget)
    assert any(RETAINED in n for n in report.notes), report.notes

    # With the option, the planner prices the backward with the saved values held: within the budget.
    got, want, texts, report, budget = _steps(retain=True, retain_graph=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert texts == []
    assert report.measured_peak_device_bytes <= report.planned_peak_device_bytes <= budget
    assert any(RETAINED in n for n in report.notes), report.notes


def test_a_backward_that_frees_the_graph_is_not_noted():
    got, want, texts, report, budget = _steps(retain=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert texts == []
    assert not any(RETAINED in n for n in report.notes)
    assert report.measured_peak_device_bytes <= budget
