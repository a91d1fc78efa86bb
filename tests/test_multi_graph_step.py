"""A training step Dynamo splits into several graphs (issue 18, item 2).

Hugging Face's GPT-2 with ``labels=`` compiles to two training graphs: the model, then its
loss. The loss graph runs while the model graph's saved activations wait on the device for
their backward, so it is planned within the budget less those bytes, and the report
describes the whole step: every graph, the step's planned peak (each graph's own peak on top
of what the earlier ones hold), the parameters of every layer and their host state.
"""
import copy

import pytest
import torch
from reference_models import labels_training_step
from test_bf16 import _megatrain_optimizer_arithmetic

import megacompile
from megacompile.core.units import parse_bytes

transformers = pytest.importorskip("transformers")


def _gpt2():
    config = transformers.GPT2Config(n_embd=128, n_layer=4, n_head=4, n_positions=128, vocab_size=512,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def test_a_step_of_two_graphs_is_planned_and_reported_as_one():
    budget = parse_bytes("5.3MiB")
    model = _gpt2()
    reference = copy.deepcopy(model)
    compiled = torch.compile(labels_training_step(model), backend="megatrain",
                             options={"device": "cpu", "lowering": "eager", "memory_budget": budget})
    # The host kernel's correctly rounded sqrt on the eager side too (tests/test_bf16.py explains).
    eager = labels_training_step(reference, wrap_optimizer=_megatrain_optimizer_arithmetic)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 512, (2, 64), generator=gen)
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)

    report = megacompile.last_report()
    training_graphs = [g for g in report.graphs if g.startswith("graph")]
    assert len(training_graphs) == 2, report.graphs
    assert " | " in report.policy  # each graph's plan
    measured, planned = report.measured_peak_device_bytes, report.planned_peak_device_bytes
    assert measured <= budget, str(report)
    assert abs(measured - planned) <= 0.05 * measured, str(report)
    # The loss graph's note says what it was planned on top of.
    assert any("hold on the device until their backward" in n for n in report.notes), report.notes
    # Every layer's parameters and the whole model's host state: fp32 weights, gradients and
    # AdamW's two moments, 16 bytes per parameter (plus a 0-d step per tensor).
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    rows = {r.layer: r for r in report.layers}
    assert rows["transformer.h.0"].param_bytes > 0
    assert sum(r.param_bytes for r in report.layers) == sum(p.numel() * 4 for p in params)
    assert report.host_bytes["weights"] == numel * 4
    assert report.host_bytes_per_param == pytest.approx(16.0, abs=0.01)


def test_a_forward_whose_loss_is_dropped_holds_nothing_for_the_next_step():
    """A forward whose outputs are all gone (the loss dropped without a backward) cannot get a
    backward: the next graph compiled is a step of its own, not planned on top of it."""
    from megacompile.report import RECORDER
    from megacompile.runtime.device import get_device

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    forward_only = torch.compile(lambda x: model(x).sum(), backend="megatrain",
                                 options={"device": "cpu", "lowering": "eager"})
    loss = forward_only(torch.randn(4, 8))
    assert RECORDER.device_bytes_held(get_device("cpu"))[0] > 0  # awaits its backward
    del loss
    assert RECORDER.device_bytes_held(get_device("cpu")) == (0, [])
