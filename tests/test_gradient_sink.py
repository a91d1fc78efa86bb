"""The gradient sink: where a backward program puts the gradients it returns as they land.

These run the real bf16 backward of a small MLP (every gradient crosses as a bf16 copy and a
host cast widens it to fp32) with sinks of their own: the default sink returns every gradient
widened by the graph's cast; a sink that owns a position gets that gradient exactly once, as
its bf16 copy, in the order the backward produces them, and the program returns None for it;
a sink that owns nothing still sees each widening; ``finish`` runs also after an error.
"""
import operator

import pytest
import torch
from conftest import COMPILED, record_programs
from reference_models import MLP, REFERENCE_MODELS

from megacompile.core import ops
from megacompile.core.node_info import info
from megacompile.runtime.gradient_sink import DeviceWork, GradientSink


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


class DoubleOnDevice(TakeAll):
    """Changes each offered gradient in place on the device (as an all-reduce does), and
    orders the copy after it: what lands must be the changed value."""

    def __init__(self, positions):
        super().__init__(positions)
        self.offered: list[int] = []
        self.copies_waited = 0
        self.not_copied_positions: list[int] = []

    def before_offload(self, position, value, layer):
        self.offered.append(position)
        value.mul_(2)  # exact in bf16

        def after():
            self.copies_waited += 1
        # Every other gradient "goes to another rank": no copy, the sink hears of it.
        return DeviceWork(after, copy=len(self.offered) % 2 == 1)

    def not_copied(self, position, layer, after):
        after()
        self.not_copied_positions.append(position)


def test_the_sink_changes_a_gradient_on_the_device_before_its_copy(bf16_mlp):
    step, backward, record, params, grads = bf16_mlp
    sink = DoubleOnDevice(params)
    backward.make_sink = lambda: sink
    step()
    # Every gradient is offered once, still on the device: each is made by the backward and
    # read by nothing after its copy (a weight's is a transposed view of its own matmul).
    assert sorted(sink.offered) == sorted(params) and sink.copies_waited == len(params)
    # What the sink declined is not copied (nor taken); the rest lands changed.
    assert sink.not_copied_positions == sink.offered[1::2]
    assert [p for p, _, _ in sink.taken] == sink.offered[0::2]
    for position, narrow, _ in sink.taken:
        assert torch.equal(narrow.float(), 2 * grads[params[position]])
    # The default sink is offered nothing and changes nothing.
    backward.make_sink = lambda: None
    assert all(torch.equal(g, grads[p]) for p, g in step().items())


def test_a_gradient_whose_memory_something_else_reads_is_not_offered():
    from megacompile.runtime.executor import _sole_reader

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    mm = graph.call_function(torch.ops.aten.mm.default, (x, x))
    t = graph.call_function(torch.ops.aten.t.default, (mm,))
    fresh = graph.call_function(ops.offload, (t,))
    graph.call_function(ops.evict, (t,))
    of_input = graph.call_function(ops.offload, (x,))  # an input's memory: the caller's
    mm2 = graph.call_function(torch.ops.aten.mm.default, (x, x))
    shared = graph.call_function(ops.offload, (graph.call_function(torch.ops.aten.t.default, (mm2,)),))
    later = graph.call_function(torch.ops.aten.relu.default, (mm2,))  # reads mm2 after the copy
    mm3 = graph.call_function(torch.ops.aten.mm.default, (x, x))
    pieces = graph.call_function(torch.ops.aten.split.Tensor, (mm3, 2))
    piece = graph.call_function(operator.getitem, (pieces, 0))
    sibling = graph.call_function(operator.getitem, (pieces, 1))
    of_piece = graph.call_function(ops.offload, (piece,))
    graph.output((fresh, of_input, shared, later, of_piece, sibling))
    assert _sole_reader(fresh)
    assert not _sole_reader(of_input) and not _sole_reader(shared) and not _sole_reader(of_piece)


def test_a_dense_gradient_is_reduced_as_one_block():
    from megacompile.runtime.data_parallel import _dense_flat

    base = torch.arange(12.0).reshape(3, 4)
    for t in (base, base.t(), base.t().unsqueeze(0)):
        flat = _dense_flat(t)
        assert flat is not None and flat.is_contiguous() and flat.numel() == t.numel()
        before = t.clone()
        flat.add_(1)  # elementwise on the block is elementwise on t
        assert torch.equal(t, before + 1)
    # Gaps or repeats: no single block holds exactly its elements.
    assert _dense_flat(base[:, ::2]) is None and _dense_flat(torch.zeros(4).expand(3, 4)) is None
