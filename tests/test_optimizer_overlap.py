"""The host optimizer overlapped with the backward (issue 4, deliverable 3).

Where the statements after ``loss.backward()`` are ``opt.step()`` (a stock LR scheduler's
``step()`` may follow) and ``opt.zero_grad()``, each layer's parameters are updated on a host
worker thread as its gradients land, and the gradients are consumed (no host gradient
buffer). Every test trains side by side with an eager copy and compares losses (1e-5
relative) and parameters (1e-5 absolute), and checks from ``last_report().optimizer`` that
the overlapped path really ran, or that the synchronous one did and why.
"""
from __future__ import annotations

import copy
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from reference_models import GPT, MLP, make_training_step, training_state_bytes

import megacompile
from megacompile.optimizer import overlap

LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
# The CPU stand-in leaves overlap off unless asked ("auto" is on for CUDA only).
OPTIONS = {"device": "cpu", "lowering": "eager", "overlap_optimizer": True}


def pair(ctor=MLP, seed: int = 0):
    torch.manual_seed(seed)
    model = ctor()
    return model, copy.deepcopy(model)


def batches(n: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 64, generator=gen), torch.randn(16, 8, generator=gen)) for _ in range(n)]


def budget(model) -> dict:
    return {**OPTIONS, "memory_budget": training_state_bytes(model) // 4}


def assert_same(model, reference):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=PARAM_ATOL, msg=lambda m: f"{name}: {m}")


def eager_step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def optimizer_report() -> dict:
    report = megacompile.last_report()
    assert report is not None and report.optimizer is not None
    return report.optimizer


def test_compiled_step_overlaps_and_equals_eager():
    model, reference = pair(MLP)
    step, opt = make_training_step(model, F.mse_loss, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)

    def check_step(got, x, y) -> bool:
        torch.testing.assert_close(got, eager_step(reference, ref_opt, x, y), rtol=LOSS_RTOL, atol=0)
        assert_same(model, reference)
        assert all(p.grad is None for p in model.parameters())  # as eager after zero_grad()
        return optimizer_report()["overlapped"]

    compiled = torch.compile(step, backend="megatrain", options=budget(model))
    overlapped = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(5):
            got = compiled(x, y)
            overlapped.append(check_step(got, x, y))
    # A stock optimizer is never reported as having run outside megatrain.
    assert not [w for w in caught if "megatrain" in str(w.message)]
    # Every step overlaps, the first too: its optimizer state is made before the backward.
    assert overlapped == [True, True, True, True, True]
    report = optimizer_report()
    assert report["updated_params"] == len(list(model.parameters()))
    for p, q in zip(opt.state.values(), ref_opt.state.values()):
        assert float(p["step"]) == float(q["step"]) == 5.0
        torch.testing.assert_close(p["exp_avg_sq"], q["exp_avg_sq"], rtol=0, atol=PARAM_ATOL)


def test_eager_loop_with_compiled_model_and_scheduler_overlaps():
    # The user's loop is plain Python; only the model is compiled. Adam (L2 weight decay)
    # with a StepLR between step() and zero_grad().
    model, reference = pair(GPT)
    compiled = torch.compile(model, backend="megatrain", options=budget(model))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3, weight_decay=0.01)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    gen = torch.Generator().manual_seed(3)
    modes = []
    for _ in range(4):
        tokens = torch.randint(0, 96, (2, 16), generator=gen)
        loss = F.cross_entropy(compiled(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        modes.append(optimizer_report()["overlapped"])

        ref_loss = F.cross_entropy(reference(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
        ref_loss.backward()
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=LOSS_RTOL, atol=0)
        assert_same(model, reference)
    assert modes == [True, True, True, True]
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 3e-3 * 0.5 ** 4


def test_accumulated_microbatches_overlap_the_last_one():
    model, reference = pair(MLP)
    compiled = torch.compile(model, backend="megatrain", options=budget(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    data = batches(9)
    modes = []
    for start in range(0, 9, 3):
        micro = data[start:start + 3]
        for x, y in micro[:-1]:
            (F.mse_loss(compiled(x), y) / 3).backward()
            modes.append(optimizer_report()["overlapped"])
        x, y = micro[-1]
        loss = F.mse_loss(compiled(x), y) / 3
        loss.backward()
        opt.step()
        opt.zero_grad()
        modes.append(optimizer_report()["overlapped"])
        for x, y in micro:
            (F.mse_loss(reference(x), y) / 3).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_same(model, reference)
    # Micro-batches that step() does not follow keep their gradients; the last micro-batch's
    # backward updates (adding the accumulated gradient, as AccumulateGrad would), the first
    # optimizer step's too.
    assert modes == [False, False, True, False, False, True, False, False, True]


class _SharedAcrossABreak(torch.nn.Module):
    """A weight read on both sides of a graph break: two graphs, each with part of its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.shared = (torch.nn.Linear(64, 64) for _ in range(3))
        self.head = torch.nn.Linear(64, 8)

    def forward(self, x):
        x = torch.relu(self.shared(self.first(x)))
        torch._dynamo.graph_break()
        return self.head(self.shared(torch.relu(self.second(x))))


@pytest.mark.parametrize("case", ["weight_on_both_sides_of_a_graph_break", "graph_called_twice_before_backward"])
def test_a_weight_whose_gradient_comes_in_parts_is_updated_once_with_all_of_it(case):
    """Autograd sums the parts of a parameter's gradient from several backward calls before
    it accumulates them, so no single backward holds the whole gradient: those parameters are
    left to step() (``left_to_step``), the rest still overlap, and training equals eager.
    (Before, the first backward updated from its part alone: off eager from the second step.)"""
    ctor = _SharedAcrossABreak if case.startswith("weight") else MLP
    model, reference = pair(ctor)
    compiled = torch.compile(model, backend="megatrain", options=OPTIONS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    def loss_of(m, x, y):
        if case.startswith("weight"):
            return F.mse_loss(m(x), y)
        return F.mse_loss(m(x[:8]), y[:8]) + F.mse_loss(m(x[8:]), y[8:])  # two calls, one backward

    reports = []
    for x, y in batches(3):
        loss = loss_of(compiled, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        reports.append(optimizer_report())
        torch.testing.assert_close(loss.detach(), eager_step_of(loss_of, reference, ref_opt, x, y),
                                   rtol=LOSS_RTOL, atol=0)
        assert_same(model, reference)
    if case.startswith("weight"):  # the shared weight and bias wait for step(); the graph's others overlap
        assert all(r["overlapped"] and r["left_to_step"] == 2 for r in reports), reports
    else:  # every parameter is read by both calls
        assert not any(r["overlapped"] for r in reports) and "ran 2 times before its backward" in reports[-1]["reason"]


@torch._dynamo.disable
def _eager_matmul(h, weight):
    return h @ weight.t()


class _WeightAlsoReadByEagerCode(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.head = torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)

    def forward(self, x):
        h = torch.relu(self.inner(x))
        return self.head(torch.relu(h + _eager_matmul(h, self.inner.weight)))


def test_a_weight_eager_code_also_reads_raises_once_then_is_left_to_step():
    """Code outside the compiled graphs adds to a weight's gradient after the overlapped update
    used the graphs' part: that step raises ``GradientOutsideGraphsError`` naming it (it was a
    silent divergence from eager before), and from then on the weight is left to step():
    later steps equal eager."""
    model, reference = pair(_WeightAlsoReadByEagerCode)
    compiled = torch.compile(model, backend="megatrain", options=OPTIONS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    data = batches(3)
    with pytest.raises(megacompile.GradientOutsideGraphsError, match="outside the compiled graphs") as caught:
        eager_step(compiled, opt, *data[0])  # (the stock loop: the optimizer overlaps)
    assert caught.value.shapes == [(64, 64)]
    opt.zero_grad()
    # From the state the failed step left, training goes on as eager's would.
    reference.load_state_dict(model.state_dict())
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # (loading shares the tensors)
    for x, y in data[1:]:
        loss = eager_step(compiled, opt, x, y)
        report = optimizer_report()
        torch.testing.assert_close(loss, eager_step(reference, ref_opt, x, y), rtol=LOSS_RTOL, atol=0)
        assert_same(model, reference)
        assert report["overlapped"] and report["left_to_step"] == 1, report


class _ChannelsLastDownsample(torch.nn.Module):
    """A strided conv over a channels-last input (ConvNeXt's downsampling): the CPU kernel
    returns its weight's gradient channels-last, strided unlike the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.down, self.head = torch.nn.Conv2d(16, 32, 2, stride=2), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.down(x.contiguous(memory_format=torch.channels_last)).mean((2, 3)))


def test_a_gradient_that_lands_strided_unlike_its_weight_is_updated(monkeypatch):
    """The fused kernel reads contiguous gradients; a landed gradient laid out otherwise (here
    channels-last) is made contiguous first. It raised inside the update before (ConvNeXt,
    SegFormer and Funnel in benchmarks/model_sweep.py with the optimizer overlapped)."""
    strided = []
    take = overlap.GradientLander.take

    def spy(self, position, host_grad, layer, ready=None):
        strided.append(not host_grad.is_contiguous())
        return take(self, position, host_grad, layer, ready)

    monkeypatch.setattr(overlap.GradientLander, "take", spy)
    model, reference = pair(_ChannelsLastDownsample)
    compiled = torch.compile(model, backend="megatrain", options=OPTIONS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        x, y = torch.randn(2, 16, 8, 8, generator=gen), torch.randn(2, 8, generator=gen)
        torch.testing.assert_close(eager_step(compiled, opt, x, y), eager_step(reference, ref_opt, x, y),
                                   rtol=LOSS_RTOL, atol=0)
        assert_same(model, reference)
        assert optimizer_report()["overlapped"]
    assert any(strided)  # the case really arose


def eager_step_of(loss_of, model, opt, x, y):
    loss = loss_of(model, x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


class _Hooked:
    """A parameter gradient hook the synchronous path must keep honouring."""

    calls = 0

    @classmethod
    def hook(cls, grad):
        cls.calls += 1
        return grad


@pytest.mark.parametrize("pattern, reason", [
    ("clip", "not optimizer.step()"),
    ("zero_grad_first", "not followed by optimizer.zero_grad()"),
    ("zero_grad_keep", "not followed by optimizer.zero_grad()"),
    ("sgd", "not run by the fused host kernel"),
    ("grad_hook", "gradient hooks"),
    ("step_hook", "step hooks"),
    ("option_off", "overlap_optimizer=False"),
])
def test_patterns_that_must_stay_synchronous(pattern, reason):
    model, reference = pair(MLP)
    options = budget(model)
    if pattern == "option_off":
        options["overlap_optimizer"] = False
    compiled = torch.compile(model, backend="megatrain", options=options)
    make = (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)) if pattern == "sgd" else \
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    opt, ref_opt = make(model.parameters()), make(reference.parameters())
    handles = []
    if pattern == "grad_hook":
        _Hooked.calls = 0
        handles.append(model.head.weight.register_hook(_Hooked.hook))
    if pattern == "step_hook":
        handles.append(opt.register_step_pre_hook(lambda *_: None))
    try:
        for x, y in batches(3):
            if pattern == "zero_grad_first":
                opt.zero_grad()
                loss = F.mse_loss(compiled(x), y)
                loss.backward()
                opt.step()
            elif pattern == "zero_grad_keep":
                loss = F.mse_loss(compiled(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
            elif pattern == "clip":
                loss = F.mse_loss(compiled(x), y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                opt.step()
                opt.zero_grad()
            else:
                loss = F.mse_loss(compiled(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            report = optimizer_report()
            assert report["overlapped"] is False
            assert reason in report["reason"]

            ref_opt.zero_grad()
            F.mse_loss(reference(x), y).backward()
            if pattern == "clip":
                torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
            ref_opt.step()
            if pattern == "zero_grad_keep":
                ref_opt.zero_grad(set_to_none=False)
            assert_same(model, reference)
        if pattern == "zero_grad_keep":
            assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
        if pattern == "grad_hook":
            assert _Hooked.calls == 3
    finally:
        for h in handles:
            h.remove()


def test_gradients_are_consumed_not_kept():
    # The update-as-gradients-land path keeps no host gradient buffer: each gradient the
    # backward hands over is freed once its layer's update has run.
    model, reference = pair(GPT)
    compiled = torch.compile(model, backend="megatrain", options=budget(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    taken: list[weakref.ref] = []
    original_take = overlap.GradientLander.take

    def spy(self, position, host_grad, layer, ready=None):
        taken.append(weakref.ref(host_grad))
        return original_take(self, position, host_grad, layer, ready)

    overlap.GradientLander.take = spy
    try:
        gen = torch.Generator().manual_seed(5)
        for _ in range(3):
            tokens = torch.randint(0, 96, (2, 16), generator=gen)
            loss = F.cross_entropy(compiled(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        overlap.GradientLander.take = original_take
    report = optimizer_report()
    assert report["overlapped"]
    n_params = len(list(model.parameters()))
    assert len(taken) == 3 * n_params  # every step (the first too), every parameter
    assert all(ref() is None for ref in taken)
    total_grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 0 < report["peak_pending_grad_bytes"] <= total_grad_bytes


def test_first_step_overlaps_and_makes_state_only_where_eager_does():
    """The first step's Adam state is made before its backward, so the first step too updates
    each layer as its gradients land (a synchronous first step held every gradient: a 7B
    model's fp32 gradients are 28 GB of host memory). A parameter the backward gives no
    gradient keeps no state, as with torch.optim."""
    class Frozenish(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = MLP()
            self.offset = torch.nn.Parameter(torch.full((8,), 0.5))  # read, but detached: no gradient

        def forward(self, x):
            return self.body(x) + self.offset.detach()

    torch.manual_seed(0)
    model = Frozenish()
    reference = copy.deepcopy(model)
    step, opt = make_training_step(model, F.mse_loss, lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    compiled = torch.compile(step, backend="megatrain", options=budget(model))
    (x, y), = batches(1)
    got = compiled(x, y)
    torch.testing.assert_close(got, eager_step(reference, ref_opt, x, y), rtol=LOSS_RTOL, atol=0)
    assert_same(model, reference)
    report = optimizer_report()
    assert report["overlapped"], report
    trained = [p for p in model.parameters() if p is not model.offset]
    # Every gradient went to the update as it landed and none is kept in param.grad. (How many
    # are pending at once depends on the worker's pace: on a loaded 2-core machine all can be.)
    assert report["consumed_grad_bytes"] == sum(p.numel() * p.element_size() for p in trained)
    assert all(p.grad is None for p in model.parameters())
    assert model.offset not in opt.state and reference.offset not in ref_opt.state
    assert len(opt.state) == len(ref_opt.state) == len(trained)
    for p, q in zip(trained, [q for q in reference.parameters() if q is not reference.offset]):
        assert float(opt.state[p]["step"]) == float(ref_opt.state[q]["step"]) == 1.0


def test_auto_is_off_on_the_cpu_stand_in():
    model, reference = pair(MLP)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend="megatrain", options={"device": "cpu", "lowering": "eager"})
    for x, y in batches(2):
        loss = F.mse_loss(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    report = optimizer_report()
    assert report["overlapped"] is False and "CPU stand-in" in report["reason"]


def test_step_pattern_reader_on_plain_functions():
    # The bytecode reader itself, on plain Python frames.
    import sys

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])

    def read(body):
        # Read the caller's code at the moment of the call, as the backward does.
        found = {}

        def backward():
            found["opt"] = overlap.read_step_pattern(sys._getframe(1))[0]

        body(backward)
        return found["opt"]

    def good(backward):
        backward()
        opt.step()
        opt.zero_grad()

    def kw(backward):
        backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def mixed(backward):
        backward()
        opt.step()
        other.zero_grad()

    def printing(backward):
        backward()
        print("between")
        opt.step()
        opt.zero_grad()

    assert read(good) is opt
    assert read(kw) is opt
    assert read(mixed) is None
    assert read(printing) is None
