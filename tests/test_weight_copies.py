"""precision="bf16": each weight's bf16 copy is made once and rewritten by the host optimizer's
update, not cast before every load (runtime/weight_copies.py).

Counted on the CPU stand-in, where the same program runs: from the second step on, no weight
is cast on the host (every load takes its copy as it is) and the overlapped optimizer rewrites
every copy in its update. A weight changed outside the optimizer is recast at its next load,
and the training stays bitwise equal to eager autocast with the same optimizer arithmetic.
"""
import copy
import dataclasses

import pytest
import torch
from reference_models import REFERENCE_MODELS, make_training_step
from test_bf16 import EAGER_OPS, _exact_reference_step

import megacompile
from megacompile.runtime import host_adam
from megacompile.runtime.device import get_device

KERNEL = host_adam.host_adam_available()
needs_kernel = pytest.mark.skipif(not KERNEL, reason="host Adam kernel unavailable")


@needs_kernel
@pytest.mark.parametrize("target", KERNEL.cpu_targets if KERNEL else [])
def test_kernel_writes_the_bf16_copy_of_the_updated_param(target):
    """Bitwise ``param.to(torch.bfloat16)`` after the update, on every target this CPU runs:
    round to nearest even, infinities, subnormals, signed zeros; a NaN stays a NaN."""
    gen = torch.Generator().manual_seed(0)
    sizes = [100_003, 7, 3 * 65536 + 5]  # remainders, and more than one chunk per tensor
    params = [torch.randn(n, generator=gen) * 10.0 ** torch.randint(-30, 30, (n,), generator=gen) for n in sizes]
    params[0][:10] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, 3.4e38,
                                   -1e-40, 1.0, 1.0 + 2.0**-8])  # the last: a tie, rounds to even
    grads = [torch.randn(n, generator=gen) for n in sizes]
    copies = [torch.full((n,), 7.0, dtype=torch.bfloat16) for n in sizes]
    host_adam.fused_adam_step(params, grads, [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes], 1,
                              lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True,
                              target=target, bf16_copies=copies)
    for p, c in zip(params, copies):
        want = p.to(torch.bfloat16)
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(c), nan)
        assert torch.equal(c[~nan].view(torch.int16), want[~nan].view(torch.int16))


@needs_kernel
def test_kernel_rejects_a_copy_of_the_wrong_size():
    p = torch.zeros(8)
    with pytest.raises(RuntimeError, match="bf16_copies\\[0\\] must be a contiguous bfloat16 CPU tensor of 8"):
        host_adam.fused_adam_step([p], [p.clone()], [p.clone()], [p.clone()], 1, lr=1e-3, beta1=0.9, beta2=0.999,
                                  eps=1e-8, weight_decay=0.0, decoupled=True,
                                  bf16_copies=[torch.zeros(4, dtype=torch.bfloat16)])


def _train(steps: int, overlap: bool, between=None, name: str = "mlp"):
    """A reference model trained in bf16 on the CPU stand-in beside its exact eager reference;
    the weight-copy counters of each step (``between(model, reference)`` runs before steps 2+)."""
    ctor, make_batch, loss_fn = REFERENCE_MODELS[name]
    torch.manual_seed(0)
    model = ctor()
    reference = copy.deepcopy(model)
    step, _ = make_training_step(model, loss_fn)
    compiled = torch.compile(step, backend="megatrain", options={
        "device": "cpu", "lowering": "eager", "precision": "bf16", "overlap_optimizer": overlap, **EAGER_OPS})
    eager = _exact_reference_step(reference, loss_fn)
    copies = get_device("cpu").weight_copies
    gen = torch.Generator().manual_seed(1)
    counts = []
    for i in range(steps):
        if i and between is not None:
            between(model, reference)
        before = dataclasses.replace(copies.stats)
        x, y = make_batch(gen)
        torch.testing.assert_close(compiled(x, y), eager(x, y), rtol=0, atol=0, msg=lambda m: f"step {i}: {m}")
        counts.append({k: getattr(copies.stats, k) - getattr(before, k) for k in dataclasses.asdict(before)})
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    torch._dynamo.reset()
    return model, counts


@needs_kernel
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_no_weight_is_cast_in_a_steady_step_when_the_optimizer_writes_the_copies(name):
    """Step 1's loads make the copies and its overlapped update (the first step overlaps
    too) writes them; from step 2 on no weight is cast on the host. The GPT's layers also
    hold weights no load casts (LayerNorm's, fp32 under autocast): updated beside, without a
    copy."""
    model, counts = _train(4, overlap=True, name=name)
    n = counts[0]["made"]
    if name == "mlp":
        assert n == len(list(model.parameters()))  # every MLP parameter is a Linear weight or bias
    else:
        assert 0 < n < len(list(model.parameters()))
    assert counts[0]["written_by_optimizer"] == n
    for later in counts[1:]:
        assert later["made"] == later["recast"] == 0, later  # no host cast of a weight at all
        assert later["written_by_optimizer"] == n
        assert later["reused"] >= n  # every load (forward and backward) took its copy
    # Every copied weight's bf16 gradient landed in its copy (no host buffer of its own), and
    # training stayed bitwise equal to eager (``_train``).
    assert all(c["lent"] == n for c in counts), counts
    # Host gradient bytes held for the updates: only the GPT's LayerNorm gradients (fp32, no copy).
    assert (megacompile.last_report().optimizer["peak_pending_grad_bytes"] == 0) == (name == "mlp")


def test_a_copy_a_gradient_landed_in_is_recast_if_its_update_never_comes():
    """Lent to a landing gradient, a copy is the update's to rewrite; where the update does
    not come (the step failed between), the next load casts the weight again instead of
    carrying the gradient's bits to the device."""
    from megacompile.runtime.weight_copies import WeightCopies

    copies = WeightCopies(page_lock=False)
    weight = torch.randn(4, 8)
    copy_ = copies.get(weight, torch.bfloat16)
    lent = copies.lend(weight)
    assert lent is copy_ and copies.for_update([weight]) == [copy_]  # the update rewrites it
    lent.fill_(7.0)  # a gradient landed
    again = copies.get(weight, torch.bfloat16)
    assert again is copy_ and torch.equal(again, weight.to(torch.bfloat16)) and copies.stats.recast == 1
    assert copies.lend(torch.randn(3)) is None  # a weight without a copy: the program's own buffer


def test_without_the_overlapped_optimizer_each_load_recasts_in_place():
    """The step's own optimizer (not the overlapped one) does not write the copies: each is
    recast into its buffer at the next load, and results are unchanged."""
    model, counts = _train(3, overlap=False)
    n = len(list(model.parameters()))
    assert counts[0]["made"] == n
    for later in counts[1:]:
        assert later["made"] == 0 and later["recast"] == n and later["written_by_optimizer"] == 0


@needs_kernel
@pytest.mark.parametrize("how", ["in_place", "data_swap", "through_data"])
def test_a_weight_changed_outside_the_optimizer_is_recast(how):
    """A user's in-place edit (bumps the version counter), a ``.data`` swap (another storage),
    or an edit through ``.data`` (invisible to the counter) followed by
    ``megacompile.forget_weight_copies()`` between steps: the next load sees the new value,
    bitwise as eager does."""
    def edit(model, reference):
        for m in (model, reference):
            w = next(m.parameters())
            with torch.no_grad():
                if how == "in_place":
                    w.mul_(0.5)
                elif how == "data_swap":
                    w.data = w.data * 0.5
                else:
                    w.data.mul_(0.5)
        if how == "through_data":
            megacompile.forget_weight_copies()
    model, counts = _train(4, overlap=True, between=edit)
    for later in counts[2:]:
        if how == "through_data":  # every copy made again
            assert later["made"] == counts[0]["made"] and later["recast"] == 0, later
        else:
            assert later["recast"] == 1, later

