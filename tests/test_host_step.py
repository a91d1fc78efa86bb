"""The optimizer's step() taken out of Dynamo's trace (megacompile/optimizer/host_step.py).

Once a training graph has compiled, a stock Adam / AdamW over its parameters gets an instance
``step`` that Dynamo does not trace: Dynamo calls it as one opaque function and it runs the
fused host kernel. Before, Dynamo traced the update tensor by tensor only for the backend to
replace that graph with the same kernel: 0.19 s of capture per decoder layer
(benchmarks/compile_time.py). What must hold: results equal eager's, nothing of the update
is traced, LR schedulers made before or after keep working without warnings, a closure or a
step hook still gets the stock step, and optimizers the kernel does not run are traced as
before.
"""
from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import COMPILED
from reference_models import MLP

import megacompile
from megacompile.optimizer.host_step import has_host_step

OPTIONS = {"device": "cpu", "lowering": "eager"}


def pair(seed: int = 0):
    torch.manual_seed(seed)
    model = MLP()
    return model, copy.deepcopy(model)


def batches(n: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 64, generator=gen), torch.randn(16, 8, generator=gen)) for _ in range(n)]


def make_step(model, opt, sched=None, closure: bool = False):
    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if closure:
            # A closure step: the stock step calls it once (under enable_grad) and returns its value.
            opt.step(lambda: loss.detach())
        else:
            opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        return loss.detach()

    return step


def assert_same(model, reference, opt, ref_opt):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
    for p, q in zip(model.parameters(), reference.parameters()):
        state, ref_state = opt.state[p], ref_opt.state[q]
        assert set(state) == set(ref_state)
        assert float(state["step"]) == float(ref_state["step"])
        assert state["step"].dtype == ref_state["step"].dtype
        torch.testing.assert_close(state["exp_avg"], ref_state["exp_avg"], rtol=0, atol=1e-7)
        torch.testing.assert_close(state["exp_avg_sq"], ref_state["exp_avg_sq"], rtol=0, atol=1e-9)


def captured_optimizer_graphs() -> list:
    """Optimizer graphs Dynamo traced and handed to the backend."""
    return [r for r in COMPILED if r.snapshots and r.snapshots[0].graph == "optimizer"
            and r.snapshots[0].stage == "captured"]


def untraced_records() -> list:
    return [r for r in COMPILED if r.snapshots and r.snapshots[0].stage == "untraced"]


@pytest.mark.parametrize("ctor", [
    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01),
], ids=["adamw", "adam"])
def test_step_is_not_traced_and_equals_eager(ctor):
    model, reference = pair()
    opt, ref_opt = ctor(model.parameters()), ctor(reference.parameters())
    compiled = torch.compile(make_step(model, opt), backend="megatrain", options=OPTIONS)
    eager = make_step(reference, ref_opt)
    assert not has_host_step(opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(4):
            torch.testing.assert_close(compiled(x, y), eager(x, y), rtol=1e-6, atol=0)
            assert all(p.grad is None for p in model.parameters())
    assert not [w for w in caught if "megatrain" in str(w.message)]
    assert_same(model, reference, opt, ref_opt)
    # Installed by the compile; the update was never traced: no optimizer graph reached the
    # backend, and inspect has one record saying so.
    assert has_host_step(opt)
    assert captured_optimizer_graphs() == []
    (record,) = untraced_records()
    assert record.label == f"optimizer (host, fused {type(opt).__name__})"
    assert "step() is not traced" in record.snapshots[0].text
    assert f"{sum(p.numel() for p in model.parameters()):,} elements" in record.snapshots[0].text
    from megacompile.cli.commands import _snapshot_header

    assert _snapshot_header(record.label, 0, record.snapshots[0]).endswith(
        "optimizer / untraced -- not traced (runs on the host as one call)")
    # The step report names the host kernel that ran.
    assert record.label in megacompile.last_report().host_graphs
    # Copies and pickles carry the stock step (Optimizer.__getstate__ keeps no instance
    # attributes), so a copy never updates the original.
    assert not has_host_step(copy.deepcopy(opt))
    assert not has_host_step(pickle.loads(pickle.dumps(opt)))
    # Removing the instance attribute gives the class's step back.
    del opt.step
    assert not has_host_step(opt) and opt.step.__func__ is type(opt).step


def test_an_optimizer_the_kernel_does_not_run_is_traced_as_before():
    model, reference = pair()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-2, momentum=0.9)
    compiled = torch.compile(make_step(model, opt), backend="megatrain", options=OPTIONS)
    eager = make_step(reference, ref_opt)
    for x, y in batches(3):
        torch.testing.assert_close(compiled(x, y), eager(x, y), rtol=1e-6, atol=0)
    assert not has_host_step(opt) and "step" not in vars(opt)
    assert len(captured_optimizer_graphs()) >= 1 and untraced_records() == []


@pytest.mark.parametrize("made", ["before", "after"])
def test_lr_scheduler_made_before_or_after_the_compile(made):
    model, reference = pair()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if made == "before" else None
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    compiled = torch.compile(make_step(model, opt), backend="megatrain", options=OPTIONS)
    eager = make_step(reference, ref_opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(4):
            torch.testing.assert_close(compiled(x, y), eager(x, y), rtol=1e-6, atol=0)
            if sched is None:  # made after the first compiled step installed the host step
                assert has_host_step(opt)
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            sched.step()
            ref_sched.step()
            assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    # Neither "optimizer.step() has been overridden" nor "lr_scheduler.step() before
    # optimizer.step()": the host step does the scheduler's bookkeeping.
    assert not [w for w in caught if "step()" in str(w.message)], [str(w.message) for w in caught]
    assert has_host_step(opt)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** 4)
    assert_same(model, reference, opt, ref_opt)


def test_a_closure_or_a_step_hook_gets_the_stock_step():
    model, reference = pair()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    data = batches(4)
    compiled = torch.compile(make_step(model, opt), backend="megatrain", options=OPTIONS)
    eager = make_step(reference, ref_opt)
    compiled(*data[0]), eager(*data[0])
    assert has_host_step(opt)

    # A hook registered after the compile: the host step sees it and runs the stock step,
    # which calls the hook (the fused kernel would not).
    seen = []
    handle = opt.register_step_post_hook(lambda o, args, kwargs: seen.append(o))
    compiled(*data[1]), eager(*data[1])
    assert seen == [opt]
    handle.remove()
    compiled(*data[2]), eager(*data[2])
    assert seen == [opt]

    # A closure: the stock step calls it and returns its value.
    x, y = data[3]
    loss = F.mse_loss(model(x), y)
    loss.backward()
    assert opt.step(lambda: torch.tensor(7.0)) == torch.tensor(7.0)
    opt.zero_grad()
    make_step(reference, ref_opt)(x, y)
    assert_same(model, reference, opt, ref_opt)


def test_a_compiled_model_in_an_eager_loop_steps_on_the_host_kernel():
    """Only the model is compiled; the loop calls opt.step() itself. The compile installed the
    host step, so the eager call runs the fused kernel (no warning that an optimizer ran
    outside megatrain) and matches eager."""
    model, reference = pair()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    compiled = torch.compile(model, backend="megatrain", options=OPTIONS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(3):
            loss = F.mse_loss(compiled(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_loss = make_step(reference, ref_opt)(x, y)
            torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-6, atol=0)
    assert not [w for w in caught if "megatrain" in str(w.message)]
    assert has_host_step(opt)
    assert "optimizer (host, fused AdamW)" in megacompile.last_report().host_graphs
    assert_same(model, reference, opt, ref_opt)


def test_the_owner_of_a_wrapped_optimizer_is_the_wrapped_one():
    """An ``Optimizer`` subclass that delegates to the optimizer it holds as ``.optimizer``
    (accelerate's ``AcceleratedOptimizer``, which ``transformers.Trainer`` steps) is not a
    second owner of the parameters; two independent optimizers over them are."""
    from megacompile.optimizer.ownership import optimizer_of

    class Wrapper(torch.optim.Optimizer):
        def __init__(self, optimizer):
            self.optimizer = optimizer

        @property
        def param_groups(self):
            return self.optimizer.param_groups

    model = MLP(depth=1)
    params = {id(p): p for p in model.parameters()}
    inner = torch.optim.AdamW(model.parameters())
    wrapper = Wrapper(inner)
    assert optimizer_of(params) is inner
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    assert optimizer_of(params) is None
    del wrapper, other
