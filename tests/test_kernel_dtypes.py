"""Values sized as the CPU kernels return them where the trace's fake tensors say otherwise
(megacompile/core/kernel_dtypes.py).

A normalisation with a bf16 input and fp32 parameters returns fp32 statistics from its CPU
kernel while its fake tensor says bf16: the stand-in measured more than the plan (ConvNeXt,
Swin, ALBERT in bf16, up to 1.5% over the smallest budget). The rule is checked against the
installed kernels (CPU, and CUDA where there is a GPU), as is GroupNorm's backward, whose input
gradient the fake says is fp32 where the kernel returns bf16; a step whose norms save their
statistics is measured node by node against its plan.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from reference_models import make_training_step
from torch.fx.experimental.proxy_tensor import make_fx

from megacompile.capture.records import recording
from megacompile.cli.plot_data import memory_timeline
from megacompile.core.kernel_dtypes import kernel_input_gradient_dtype, kernel_statistics_dtype, size_as_kernels
from megacompile.report import last_report

aten = torch.ops.aten
X = torch.randn(2, 8, 4)
C = 8


def _calls(device):
    """(op, arguments after the input) with the parameters of dtype ``p``."""
    def of(p):
        w, b = torch.randn(C, dtype=p, device=device), torch.randn(C, dtype=p, device=device)
        # running statistics: fp32 in any module
        stats = (torch.zeros(C, device=device), torch.ones(C, device=device))
        return [
            (aten.native_layer_norm.default, ([4], w[:4], b[:4], 1e-5), (2, 8, 4)),
            (aten.native_group_norm.default, (w, b, 2, C, 4, 2, 1e-5), (2, C, 4)),
            (aten.native_batch_norm.default, (w, b, *stats, True, 0.1, 1e-5), (2, C, 4)),
            (aten._native_batch_norm_legit_functional.default, (w, b, *stats, True, 0.1, 1e-5), (2, C, 4)),
            (aten._native_batch_norm_legit.no_stats, (w, b, True, 0.1, 1e-5), (2, C, 4)),
        ]
    return of


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.parametrize("params", [torch.float32, torch.bfloat16], ids=["fp32-params", "bf16-params"])
def test_the_rule_is_what_the_kernels_return(params, device):
    for op, rest, shape in _calls(device)(params):
        x = X.reshape(shape).to(device, torch.bfloat16)
        if params == torch.bfloat16 and "batch_norm" in str(op) and "no_stats" not in str(op):
            continue  # the kernel refuses bf16 parameters beside fp32 running statistics
        out = op(x, *rest)
        want = kernel_statistics_dtype(op, (x, *rest)) or x.dtype
        assert (out[1].dtype, out[2].dtype) == (want, want), op


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_the_group_norm_backward_rule_is_what_the_kernels_return(device):
    """GroupNorm's backward returns the input gradient in the input's dtype; its fake says the
    statistics' (fp32), and so did the plan."""
    x = X.reshape(2, C, 4).to(device, torch.bfloat16)
    w, b = torch.randn(C, device=device), torch.randn(C, device=device)
    _, mean, rstd = aten.native_group_norm(x, w, b, 2, C, 4, 2, 1e-5)
    args = (torch.randn_like(x), x, mean, rstd, w, 2, C, 4, 2, [True, True, True])
    grad_input = aten.native_group_norm_backward(*args)[0]
    assert kernel_input_gradient_dtype(aten.native_group_norm_backward.default, args) == grad_input.dtype
    assert kernel_input_gradient_dtype(aten.native_group_norm_backward.default,
                                       (args[0].float(), x.float(), *args[2:])) is None  # fp32: nothing to say


class Norms(nn.Module):
    """Layers whose norms save their statistics for the backward: LayerNorm (bf16 input under
    CPU autocast, fp32 weight), BatchNorm1d, GroupNorm."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict({"fc": nn.Linear(32, 32), "ln": nn.LayerNorm(32), "bn": nn.BatchNorm1d(32),
                           "gn": nn.GroupNorm(4, 32)})
            for _ in range(3))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer["gn"](layer["bn"](layer["ln"](layer["fc"](x))))
        return self.head(x)


def test_bf16_norms_are_planned_as_the_stand_in_measures_them():
    torch.manual_seed(0)
    step, _ = make_training_step(Norms(), lambda out, y: (out.float() - y).square().mean())
    compiled = torch.compile(step, backend="megatrain", options={
        "device": "cpu", "lowering": "eager", "memory_budget": 60_000, "precision": "bf16", "snapshots": True})
    with recording() as records:
        for _ in range(2):
            compiled(torch.randn(64, 32), torch.randn(64, 1))
    record = next(r for r in records if r.backward is not None)
    timeline = memory_timeline(record)
    # Node by node, what was measured is what was planned (before: the statistics measured more,
    # GroupNorm's input gradient less).
    off = [(n, p, m) for n, p, m in zip(timeline.nodes, timeline.planned, timeline.measured)
           if m is not None and m != p]
    assert not off, f"measured != planned at {off[:5]}"
    report = last_report()
    assert report.measured_peak_device_bytes <= report.planned_peak_device_bytes <= 60_000


def test_views_and_detaches_of_the_statistics_are_resized_too():
    """AOTAutograd saves ``detach(mean)``: an offloaded statistic is loaded at that node's size."""
    def norm(x, w, b):
        out, mean, rstd = aten.native_layer_norm(x, [4], w, b, 1e-5)
        return out, aten.detach(mean), mean.view(-1), rstd

    gm = make_fx(norm, tracing_mode="fake")(torch.randn(2, 4, dtype=torch.bfloat16), torch.randn(4), torch.randn(4))
    assert size_as_kernels(gm) == 2
    out, detached, viewed, rstd = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert out.meta["val"].dtype == torch.bfloat16
    assert [v.meta["val"].dtype for v in (detached, viewed, rstd)] == [torch.float32] * 3
