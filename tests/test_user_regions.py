"""A step's own regions that Dynamo records as higher-order ops: custom autograd Functions and
``torch.utils.checkpoint``.

Both are common in models people bring (Bloom's GeLU is a Function; a Trainer with
``gradient_checkpointing=True`` wraps every decoder layer in a checkpoint). Both used to send
the whole graph to plain eager, unstreamed. Now a Function's forward and its own backward are
traced into the two programs, and a checkpoint's body is inlined: what to recompute is the
planner's decision. The references are eager PyTorch with the same regions.
"""
import warnings

import pytest
import torch
import torch.nn as nn
from reference_models import (
    labels_training_step,
    make_training_step,
    tiny_llama,
    train_side_by_side,
    training_state_bytes,
)

import megacompile
from megacompile.capture.inline_regions import inline_checkpoint_regions
from megacompile.core import torch_compat as compat

STOCK_LOSS_RTOL = 2.0**-12  # bf16 losses against eager autocast with torch's AdamW (tests/test_bf16.py)


class StraightThroughTanh(torch.autograd.Function):
    """Forward ``tanh(x) * w``; backward passes ``g * w`` to ``x`` as if tanh were the identity.
    Not the forward's derivative, so a program that differentiated the forward would differ."""

    @staticmethod
    def forward(ctx, x, w):
        y = torch.tanh(x)
        ctx.save_for_backward(y, w)
        return y * w

    @staticmethod
    def backward(ctx, grad):
        y, w = ctx.saved_tensors
        return grad * w, (grad * y).sum(0)


class Layer(nn.Module):
    def __init__(self, width: int, region: str):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.rand(width) + 0.5)
        self.region = region

    def _mix(self, h):
        return torch.tanh(h) * self.scale

    def forward(self, x):
        h = self.linear(x)
        if self.region == "function":
            h = StraightThroughTanh.apply(h, self.scale)
        else:
            h = torch.utils.checkpoint.checkpoint(self._mix, h, use_reentrant=False)
        return x + h


def _model(region: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Layer(32, region) for _ in range(4)], nn.Linear(32, 1))


def _train(model, step_of, batches, options, autocast=False):
    """``train_side_by_side``, failing on any megatrain warning (a fallback to plain eager warns)
    and unless the step streamed within the budget."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pairs, reference = train_side_by_side(model, step_of, batches, options, autocast=autocast)
    assert [str(w.message) for w in caught if "megatrain" in str(w.message)] == []
    report = megacompile.last_report()
    assert report.h2d_bytes > 0 and report.measured_peak_device_bytes <= options["memory_budget"]
    return pairs, reference


def _assert_same_training(pairs, model, reference, param_rtol=1e-5):
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=param_rtol, atol=1e-6)


def _regression_batches(steps=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 32, generator=g), torch.randn(8, 1, generator=g)) for _ in range(steps)]


def _mse_step(model):
    return make_training_step(model, lambda out, y: ((out - y) ** 2).mean(), lr=1e-2)[0]


@pytest.mark.parametrize("region", ["function", "checkpoint"])
def test_a_region_streams_and_trains_like_eager_in_fp32(region):
    model = _model(region)
    pairs, reference = _train(model, _mse_step, _regression_batches(),
                              {"memory_budget": training_state_bytes(model) // 4})
    _assert_same_training(pairs, model, reference)


def test_a_custom_function_trains_like_eager_autocast_in_bf16():
    model = _model("function")
    pairs, _ = _train(model, _mse_step, _regression_batches(),
                      {"memory_budget": training_state_bytes(model) // 4, "precision": "bf16"}, autocast=True)
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=STOCK_LOSS_RTOL, atol=0)


def test_a_transformers_model_with_gradient_checkpointing_streams():
    """``model.gradient_checkpointing_enable()``, as a user coming from FSDP or DeepSpeed leaves it."""
    model = tiny_llama(layers=4)
    model.gradient_checkpointing_enable()
    model.train()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 96, (2, 16), generator=g),) for _ in range(3)]
    pairs, reference = _train(model, labels_training_step, batches,
                              {"memory_budget": training_state_bytes(model) // 4})
    _assert_same_training(pairs, model, reference, param_rtol=1e-4)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_checkpointed_layers_marked_repeated(precision):
    """``mark_repeated_layers`` and gradient checkpointing together: each checkpoint body holds a
    marked layer's call (``invoke_subgraph`` over a body of its own), moved onto the graph when
    the checkpoint is inlined; under bf16 the marked calls are inlined in turn."""
    model = tiny_llama(layers=4)
    model.gradient_checkpointing_enable()
    model.train()
    megacompile.mark_repeated_layers(model)  # the eager copy runs the marked layers as plain calls
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 96, (2, 16), generator=g),) for _ in range(2)]
    budget = training_state_bytes(model) // 4
    pairs, _ = _train(model, labels_training_step, batches, {"memory_budget": budget, "precision": precision},
                      autocast=precision == "bf16")
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-5 if precision == "fp32" else STOCK_LOSS_RTOL, atol=0)


def test_nested_checkpoints_are_inlined_into_the_same_computation():
    """The outer body holds the inner body as an attribute: it is moved onto the graph."""
    torch.manual_seed(0)
    inner, outer = nn.Linear(8, 8), nn.Linear(8, 8)

    def block(x):
        return torch.utils.checkpoint.checkpoint(lambda t: inner(t).relu(), outer(x), use_reentrant=False) * 2

    def fn(x):
        return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum()

    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    x = torch.randn(4, 8)
    torch.compile(fn, backend=capture)(x)
    gm, example_inputs = graphs[0]

    def checkpoints(graph_module):
        return sum(1 for n in graph_module.graph.nodes if n.op == "call_function"
                   and compat.is_activation_checkpoint(n.target))

    assert checkpoints(gm) == 1
    want = gm(*example_inputs)
    assert inline_checkpoint_regions(gm) == 2  # the outer region, then the inner one it held
    assert checkpoints(gm) == 0
    assert not any(isinstance(getattr(gm, n.target), torch.fx.GraphModule)
                   for n in gm.graph.nodes if n.op == "get_attr")
    torch.testing.assert_close(gm(*example_inputs), want, rtol=0, atol=0)
