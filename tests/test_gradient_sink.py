"""The gradient sink: where a backward program puts the gradients it returns as they land.

These run the real bf16 backward of a small MLP (every gradient crosses as a bf16 copy and a
host cast widens it to fp32) with sinks of their own: the default sink returns every gradient
widened by the graph's cast; a sink that owns a position gets that gradient exactly once, as
its bf16 copy, in the order the backward produces them, and the program returns None for it;
a sink that owns nothing still sees each widening; ``finish`` runs also after an error.
"""
import pytest
import torch
from conftest import COMPILED, record_programs
from reference_models import MLP, REFERENCE_MODELS

from megacompile.core import ops
from megacompile.core.node_info import info
from megacompile.runtime.gradient_sink import GradientSink


class TakeAll(GradientSink):
    def __init__(self, positions, fail_at=None):
        self.positions = set(positions)
        self.fail_at = fail_at
        self.taken: list[tuple[int, torch.Tensor, str | None]] = []
        self.finished = 0

    def owns(self, position):
        return position in self.positions

    def take(self, position, host_grad, layer, ready=None):
        if position == self.fail_at:
            raise RuntimeError("sink refused a gradient")
        if ready is not None:
            ready()
        self.taken.append((position, host_grad, layer))

    def finish(self, failed=False):
        self.finished += 1
        self.failed = failed


class WatchWidening(GradientSink):
    def __init__(self):
        self.widened: list[tuple[int, torch.dtype, str | None]] = []

    def widen(self, position, narrow, cast, layer):
        self.widened.append((position, narrow.dtype, layer))
        return cast(narrow)


@pytest.fixture
def bf16_mlp(monkeypatch):
    """A compiled bf16 MLP forward+backward (no optimizer), its backward program and a step
    that leaves the gradients in ``param.grad`` (None before each call)."""
    programs = record_programs(monkeypatch)
    _, make_batch, loss_fn = REFERENCE_MODELS["mlp"]
    torch.manual_seed(0)
    model = MLP(depth=3)

    def fwd_bwd(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss.detach()

    compiled = torch.compile(fwd_bwd, backend="megatrain",
                             options={"device": "cpu", "lowering": "eager", "precision": "bf16"})
    batch = make_batch(torch.Generator().manual_seed(1))

    def step():
        for p in model.parameters():
            p.grad = None
        compiled(*batch)
        return {p: p.grad for p in model.parameters()}

    grads = step()  # compiles; the default sink
    (record,) = [r for r in COMPILED if r.backward is not None]
    (backward,) = [p for p in programs if p.label == f"{record.label} backward"]
    # Backward output i is the gradient of forward input i (a parameter).
    params = {i: ref() for i, ref in record.param_refs.items()}
    return step, backward, record, params, grads


def test_default_sink_returns_every_gradient_widened_by_the_host_cast(bf16_mlp):
    step, backward, record, params, grads = bf16_mlp
    assert backward.make_sink is not None and backward.make_sink() is None  # no overlap: the default
    assert len(grads) == 8 and all(g is not None and g.dtype == torch.float32 for g in grads.values())
    watch = WatchWidening()
    backward.make_sink = lambda: watch
    again = step()
    # One widening per gradient, from its bf16 copy, and the same fp32 gradients.
    assert sorted(p for p, _, _ in watch.widened) == sorted(params)
    assert {dtype for _, dtype, _ in watch.widened} == {torch.bfloat16}
    assert all(torch.equal(again[p], grads[p]) for p in grads)


def test_owned_gradients_reach_the_sink_once_in_order_as_bf16_copies(bf16_mlp):
    step, backward, record, params, grads = bf16_mlp
    sink = TakeAll(params)
    backward.make_sink = lambda: sink
    taken_grads = step()
    assert sink.finished == 1
    positions = [p for p, _, _ in sink.taken]
    assert sorted(positions) == sorted(params)  # each once
    # In the order the backward offloads them: the last layer's first.
    offloaded = [info(n).layer for n in record.backward.graph.nodes if n.target is ops.offload]
    assert [layer for _, _, layer in sink.taken] == offloaded
    assert offloaded[0] == "head" and offloaded[-1] == "layers.0"
    for position, narrow, _ in sink.taken:
        # The bf16 copy as it landed; the default sink's widening is exactly its float().
        assert narrow.dtype == torch.bfloat16
        assert torch.equal(narrow.float(), grads[params[position]])
    # The program returned None for every taken gradient: nothing reached param.grad.
    assert all(g is None for g in taken_grads.values())


def test_sink_finishes_after_an_error(bf16_mlp):
    step, backward, record, params, grads = bf16_mlp
    head_weight = next(i for i, p in params.items() if p.shape == (8, 64))
    sink = TakeAll(params, fail_at=head_weight)
    backward.make_sink = lambda: sink
    with pytest.raises(RuntimeError, match="sink refused a gradient"):
        step()
    assert sink.finished == 1 and sink.failed  # told the program failed
