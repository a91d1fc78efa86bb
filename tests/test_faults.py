"""A fault in the middle of a step loses nothing silently (issue 18, item 6).

With the optimizer overlapped, some layers are updated before the backward ends. A simulated
device out-of-memory on a load: in the forward, nothing has changed and the error is the
original one; in the backward after some layers were updated, ``PartialUpdateError`` names
exactly those layers, and every other parameter and its optimizer state is as before the
step. Training then goes on.
"""
import copy

import pytest
import torch
from reference_models import REFERENCE_MODELS, make_training_step, training_state_bytes

import megacompile
from megacompile.runtime.device import get_device


def _trained_two_steps():
    ctor, make_batch, loss_fn = REFERENCE_MODELS["mlp"]
    torch.manual_seed(0)
    model = ctor(depth=3)
    step, opt = make_training_step(model, loss_fn)
    step = torch.compile(step, backend="megatrain", options={
        "device": "cpu", "lowering": "eager", "memory_budget": training_state_bytes(model) // 3,
        "overlap_optimizer": True})
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):  # the stock loop's step overlaps from the second step on
        step(*make_batch(gen))
    return model, opt, step, make_batch(gen)


def _snapshot(model, opt):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: copy.deepcopy(opt.state[p]) for n, p in model.named_parameters()}
    return params, state


def _fail_on(monkeypatch, tag: str, occurrence: int):
    """The device's ``occurrence``-th load of ``tag`` in the step runs out of memory."""
    device = get_device("cpu")
    load = device.load
    seen = [0]

    def failing_load(host, name, layer, track=True):
        if name == tag:
            seen[0] += 1
            if seen[0] == occurrence:
                raise torch.OutOfMemoryError(f"simulated: out of memory loading {name}")
        return load(host, name, layer, track)
    monkeypatch.setattr(device, "load", failing_load)


def _same(a, b):
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_load_that_runs_out_of_memory_loses_nothing_silently(monkeypatch, where):
    model, opt, step, (x, y) = _trained_two_steps()
    params, state = _snapshot(model, opt)
    # The input x loads once in the forward, then again near the backward's end, for layers.0's
    # weight gradient, after the later layers' gradients landed and their updates ran.
    _fail_on(monkeypatch, "x", 1 if where == "forward" else 2)
    if where == "forward":
        with pytest.raises(torch.OutOfMemoryError, match="simulated"):
            step(x, y)
        updated_layers = set()
    else:
        with pytest.raises(megacompile.PartialUpdateError, match="already updated") as info:
            step(x, y)
        assert isinstance(info.value.error, torch.OutOfMemoryError)
        updated_layers = {layer for layer, _ in info.value.updated}
        assert updated_layers and "layers.0" not in updated_layers, info.value.updated
        assert sum(n for _, n in info.value.updated) == sum(
            1 for n, _ in model.named_parameters() if n.rsplit(".", 2)[0] in updated_layers)
        assert all(layer in str(info.value) for layer in updated_layers)
    for name, p in model.named_parameters():
        changed = not torch.equal(p, params[name])
        layer = name.rsplit(".", 2)[0]
        assert changed == (layer in updated_layers), name
        if layer not in updated_layers:
            assert all(_same(opt.state[p][k], v) for k, v in state[name].items()), name
    monkeypatch.undo()
    assert torch.isfinite(step(x, y))  # and training goes on


def test_a_host_that_cannot_hold_the_optimizer_state_gets_an_error_before_allocation(monkeypatch):
    """AdamW's state is allocated at the first step: with less host memory available than it
    needs, ``HostMemoryError`` names both numbers, nothing is allocated and the parameters are
    unchanged; with enough, the same step trains."""
    from megacompile.core import host_memory

    ctor, make_batch, loss_fn = REFERENCE_MODELS["mlp"]
    torch.manual_seed(0)
    model = ctor(depth=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step, opt = make_training_step(model, loss_fn)
    step = torch.compile(step, backend="megatrain", options={"device": "cpu", "lowering": "eager"})
    needed = sum(2 * p.numel() * 4 for p in model.parameters())
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: needed - 1)
    x, y = make_batch(torch.Generator().manual_seed(1))
    with pytest.raises(megacompile.HostMemoryError, match="more host memory") as info:
        step(x, y)
    assert info.value.needed_bytes == needed and info.value.available_bytes == needed - 1
    assert str(needed) in str(info.value)
    assert not any(opt.state[p] for p in model.parameters())  # nothing allocated
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: needed)
    torch._dynamo.reset()
    assert torch.isfinite(step(x, y))
    assert all(opt.state[p] for p in model.parameters())


def test_a_host_that_cannot_hold_the_bf16_weight_copies_gets_an_error_before_allocation(monkeypatch):
    """Under ``precision="bf16"`` each weight gets a persistent bf16 copy on the host at its
    first load: each is checked against the host's available memory before it is allocated."""
    from megacompile.core import host_memory

    ctor, make_batch, loss_fn = REFERENCE_MODELS["mlp"]
    torch.manual_seed(0)
    model = ctor(depth=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step, opt = make_training_step(model, loss_fn)
    step = torch.compile(step, backend="megatrain", options={"device": "cpu", "lowering": "eager",
                                                             "precision": "bf16"})
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 16)
    with pytest.raises(megacompile.HostMemoryError, match="bfloat16 copy of a weight") as info:
        step(*make_batch(torch.Generator().manual_seed(1)))
    assert info.value.available_bytes == 16 and info.value.needed_bytes > 16
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not any(opt.state[p] for p in model.parameters())
