"""What megatrain compiled is kept with the function it was compiled for, not in a process list."""
import pytest
import torch

import megacompile
from megacompile.capture.records import compiled_graphs, recording

OPTIONS = {"device": "cpu", "lowering": "eager"}


def _model_and_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return model, step


def test_graphs_belong_to_the_compiled_function():
    _, step = _model_and_step()
    compiled = torch.compile(step, backend="megatrain", options=OPTIONS)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    compiled(x, y)
    mine = compiled_graphs(compiled)
    # The training graph, and the optimizer's graph after the graph break at backward()
    # (a resume function of `step`): both are step's.
    assert any(r.backward is not None for r in mine), [r.label for r in mine]
    assert any(r.label.startswith("optimizer") for r in mine), [r.label for r in mine]
    assert compiled_graphs(step) == mine  # the function itself, or what torch.compile returned
    assert compiled_graphs(_model_and_step) == []  # never compiled
    assert megacompile.compiled_graphs is compiled_graphs


def test_a_module_stands_for_its_forward():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    compiled = torch.compile(model, backend="megatrain", options=OPTIONS)
    compiled(torch.randn(2, 8)).sum().backward()
    assert [r.backward is not None for r in compiled_graphs(compiled)] == [True]
    with pytest.raises(TypeError, match="compiled_graphs"):
        compiled_graphs(3)


def test_recording_collects_every_graph_made_inside_it():
    _, step = _model_and_step()
    compiled = torch.compile(step, backend="megatrain", options=OPTIONS)
    with recording() as inside:
        compiled(torch.randn(4, 8), torch.randn(4, 1))
    compiled(torch.randn(4, 8), torch.randn(4, 1))  # cached: nothing new either way
    # Records are per function code: this closure's def compiled in earlier tests too.
    assert len(inside) >= 2 and compiled_graphs(compiled)[-len(inside):] == inside
