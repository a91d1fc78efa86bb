"""A training step Dynamo splits into several graphs (issue 18, item 2).

Hugging Face's GPT-2 with ``labels=`` compiles to two training graphs: the model, then its
loss. The loss graph runs while the model graph's saved activations wait on the device for
their backward, so it is planned within the budget less those bytes, and the report
describes the whole step: every graph, the step's planned peak (each graph's own peak on top
of what the earlier ones hold), the parameters of every layer and their host state.
"""
import copy
import weakref

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


class _Expert(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class _PerExpertLoop(torch.nn.Module):
    """A mixture of experts written as DBRX writes it: a Python loop over the experts, each
    picking its tokens with a data-dependent op (a graph break), so one compiled graph (the
    experts' code) runs once per expert before any backward."""

    def __init__(self, width: int = 32, experts: int = 3):
        super().__init__()
        self.router = torch.nn.Linear(width, experts)
        self.experts = torch.nn.ModuleList(_Expert(width) for _ in range(experts))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = torch.nonzero(choice == i).squeeze(-1)
            out = out.index_add(0, rows, expert(x[rows]))
        return self.head(x + out).pow(2).mean()


def _sgd_step(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def _train_at_the_smallest_budget(model, x, **options):
    """One step at the smallest budget the BudgetErrors lead to: (budget, loss, how many of the
    errors refused a graph's further call before its backward)."""
    budget, repeat_errors = 1, 0
    for _ in range(12):
        compiled = torch.compile(_sgd_step(model), backend="megatrain", options={
            "device": "cpu", "lowering": "eager", "memory_budget": budget, **options})
        before = [p.detach().clone() for p in model.parameters()]
        try:
            return budget, compiled(x), repeat_errors
        except megacompile.BudgetError as e:
            if "runs again" in str(e):
                repeat_errors += 1
                assert "capture_dynamic_output_shape_ops" in str(e) and "calls_before_backward=" in str(e)
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
            budget = max(budget + 1, e.minimum_budget)
        finally:
            torch._dynamo.reset()
    pytest.fail(f"no budget found (last {budget})")


@pytest.mark.parametrize("calls_before_backward", [1, 3])
def test_a_graph_run_several_times_before_its_backward_is_counted_each_time(calls_before_backward):
    """Each call of the expert graph holds its saved activations (and, planned resident, its
    parameters) until the backward. The recorder took every repeat for a new step, so what
    the earlier calls held was neither counted nor bounded: at the smallest budget the planner
    accepted, the DBRX step measured 2.5x its budget. Now a call that would not fit beside them
    raises BudgetError before it runs (parameters untouched, the fixes named), and at the
    budget those errors lead to the measured peak is within it and the report counts the calls.
    Planned for its calls (``calls_before_backward``), the step fits a budget half as large."""
    torch.manual_seed(0)
    model = _PerExpertLoop()
    reference = copy.deepcopy(model)
    x = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))
    budget, got, repeat_errors = _train_at_the_smallest_budget(
        model, x, calls_before_backward=calls_before_backward)
    report = megacompile.last_report()
    assert report.measured_peak_device_bytes <= budget, str(report)
    assert report.measured_peak_device_bytes <= report.planned_peak_device_bytes, str(report)
    assert any("times in the step before its backward" in n for n in report.notes), report.notes
    if calls_before_backward == 1:
        assert repeat_errors > 0
        assert budget > 100_000  # (at this commit: 117,248 B)
    else:
        assert budget < 70_000  # (61,952 B: the expert graph recomputes and offloads instead)
    torch.testing.assert_close(got, _sgd_step(reference)(x), rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_call_whose_outputs_die_before_its_backward_is_still_awaited():
    """Reformer's reversible layers take a graph's output into their own autograd Function and
    drop it; the graph's saved activations are held by its autograd node, not as the tensors
    its forward returned. Watching only those tensors, the recorder took the call for abandoned
    while its backward was still to come, and the next graph ran beside bytes it did not count
    (Reformer measured 128 B over its smallest budget). Once an output shows the call's autograd
    node, the node decides."""
    from megacompile.report import _Call

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    out = Scale.apply(torch.randn(4, requires_grad=True))  # (a node like a compiled graph's)
    call = _Call(graph=None, end_bytes=0, outputs=[weakref.ref(out)])
    assert not call.abandoned()
    later = out * 3  # the next op keeps an edge to the node, not the tensor
    del out
    assert not call.abandoned()
    del later
    assert call.abandoned()



def test_a_call_is_awaited_while_the_memory_it_returned_lives():
    """Reformer's LM head in bf16: the tensors its graph returned died before the loss graph was
    planned (the user got a fresh view of an output that views an intermediate; the saved ones
    are held by the autograd node as storage, not as those objects), so the recorder dropped the
    call while its saved activations waited on the device, and the loss graph ran beside 40 KiB
    it did not count (91,520 B measured at a 59,784 B budget; benchmarks/model_sweep.py
    --at-minimum --precision bf16). A call is now awaited while the memory it returned lives."""
    from megacompile.report import _Call

    returned = torch.randn(4, 8)
    users_view = returned.detach()  # what the user holds instead: the same memory, another object
    call = _Call(graph=None, end_bytes=128)
    call.watch([returned])
    del returned
    assert not call.abandoned()
    del users_view
    assert call.abandoned()


class _HeadThenLoss(torch.nn.Module):
    """A head, then a graph break before a loss whose fp32 softmax is the largest thing."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(32, 64)
        self.head = torch.nn.Linear(64, 128)

    def forward(self, x):
        logits = self.head(torch.tanh(self.body(x))).view(4, 12, 128)
        torch._dynamo.graph_break()
        return torch.log_softmax(logits.double(), -1).square().mean()


def test_a_graph_without_layers_that_does_not_fit_says_so():
    """The loss graph after a graph break has no layers: its BudgetError named layer 'None' and a
    streaming floor of 0 B "at layer 'None'". It says what the graph needs and what to change."""
    torch.manual_seed(0)
    model = _HeadThenLoss()
    messages, budget = [], 1
    for _ in range(6):
        compiled = torch.compile(_sgd_step(model), backend="megatrain", options={
            "device": "cpu", "lowering": "eager", "memory_budget": budget})
        try:
            compiled(torch.randn(48, 32))
            break
        except megacompile.BudgetError as e:
            messages.append(str(e))
            budget = e.minimum_budget
        finally:
            torch._dynamo.reset()
    layerless = [m for m in messages if "no layers to stream" in m]
    assert layerless, messages
    assert all("'None'" not in m for m in layerless)
    assert all("For the whole step: at least" in m for m in layerless)
