"""Layers are named from module paths whatever the compiled frame's root is: ``self``, a global,
a ``ModuleList`` argument, or the ``*args`` of a decorated ``forward(*args, **kwargs)`` (Hugging
Face wraps ``forward`` so since transformers 5.24; Dynamo's root is then ``L['args'][0]``)."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

import megacompile
from megacompile.core.node_info import layer_of_module_path, normalize_module_path, source_to_name


def test_module_paths_drop_the_root_and_its_argument_indexing():
    assert normalize_module_path("G['model'].layers.0.fc") == "layers.0.fc"
    assert normalize_module_path("L['self'].layers[0]") == "layers.0"
    assert normalize_module_path("L['args'][0].model.layers.1.mlp") == "model.layers.1.mlp"
    assert normalize_module_path("L['kwargs']['model'].head") == "head"
    # A ModuleList passed as an argument: its children are attributes, so the index stays.
    assert layer_of_module_path(normalize_module_path("L['blocks'].3.fc")) == "3"
    # Parameters are named from their sources the same way.
    assert source_to_name("L['args'][0]._modules['layers']._modules['1']._parameters['weight']") == "layers.1.weight"


def _through_args(forward):
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)
    return wrapper


class DecoratedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    @_through_args
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.square().mean()


def test_a_decorated_forward_streams_and_reports_per_layer():
    torch.manual_seed(0)
    model = DecoratedStack()
    reference = DecoratedStack()
    reference.load_state_dict(model.state_dict())
    model.compile(backend="megatrain", options={"device": "cpu", "lowering": "eager"})
    x = torch.randn(4, 16)
    loss = model(x)
    loss.backward()
    expected = reference(x)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    rows = {row.layer: row for row in megacompile.last_report().layers}
    for i in range(3):
        # Forward and backward both attributed to the layer (the backward lands its gradients).
        assert rows[f"layers.{i}"].param_bytes == 16 * 17 * 4
        assert rows[f"layers.{i}"].d2h_bytes >= 16 * 17 * 4
    assert not any(name.split(".")[0].isdigit() for name in rows)
