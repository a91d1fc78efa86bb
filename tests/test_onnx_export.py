"""`megacompile inspect --format onnx`: the rewritten programs as ONNX models
(megacompile/cli/onnx_program.py, onnx_ops.py).

One inspect run of a small MLP (its forward streams and offloads, its backward loads, waits,
evicts and offloads gradients) is read back: every file passes ``onnx.checker`` with shape
inference, its nodes follow the FX program in order, and each memory op carries the tensor,
layer and bytes the FX program says. The aten -> ONNX table is checked numerically on a
function of many mapped ops with ONNX's reference evaluator.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from conftest import MLP_TRAIN_SCRIPT, compile_small_training_graph
from onnx.reference import ReferenceEvaluator
from torch.fx.experimental.proxy_tensor import make_fx

from megacompile.capture.records import recording
from megacompile.cli import commands as cli
from megacompile.cli.onnx_program import ATEN_DOMAIN, MEMORY_DOMAIN, program_to_onnx
from megacompile.core import ops
from megacompile.core.node_info import info


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(records, output directory) of one `inspect --format onnx` run."""
    root = tmp_path_factory.mktemp("onnx")
    script = root / "train_mlp.py"
    script.write_text(MLP_TRAIN_SCRIPT)
    out = root / "out"
    with recording() as records:
        assert cli.main(["inspect", "--format", "onnx", "--out", str(out), str(script)]) == 0
    return records, out


def _programs(exported):
    """(FX graph, its ONNX model) of every rewritten program."""
    records, out = exported
    found = []
    for record, directory in zip(records, cli._directory_names(records)):
        for part in ("forward", "backward"):
            gm = getattr(record, part)
            if record.plan is not None and gm is not None:
                found.append((gm, onnx.load(str(out / directory / f"{part}.onnx"))))
    return found


def test_every_program_is_written_and_checked(exported):
    programs = _programs(exported)
    # The training graph's forward and backward, and the loss.detach() glue's forward.
    assert len(programs) == 3
    for _, model in programs:
        onnx.checker.check_model(model, full_check=True)  # strict shape inference over the mapped ops
        domains = {o.domain: o.version for o in model.opset_import}
        assert domains[""] == 20 and MEMORY_DOMAIN in domains
    records, out = exported
    summary = (out / "summary.txt").read_text()
    training = cli._directory_names(records)[0]  # graph0 in a fresh process: labels count per process
    assert f"{out}/{training}/forward.onnx" in summary and f"{out}/{training}/backward.onnx" in summary


def test_nodes_follow_the_fx_program(exported):
    for gm, model in _programs(exported):
        order = []
        for node in model.graph.node:
            fx_name = dict((p.key, p.value) for p in node.metadata_props)["fx_node"]
            if not order or order[-1] != fx_name:
                order.append(fx_name)
        assert order == [n.name for n in gm.graph.nodes if n.op == "call_function"]
        assert [i.name for i in model.graph.input] == [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        returned = [a.name for a in next(iter(gm.graph.find_nodes(op="output"))).args[0] if a is not None]
        assert [o.name for o in model.graph.output] == returned


def test_memory_ops_carry_tensor_layer_and_bytes(exported):
    kinds = set()
    for gm, model in _programs(exported):
        by_name = {n.name: n for n in model.graph.node}
        memory_nodes = [n for n in gm.graph.nodes if ops.is_memory_op(n)]
        assert len(memory_nodes) == sum(n.domain == MEMORY_DOMAIN for n in model.graph.node)
        for fx_node in memory_nodes:
            onnx_node = by_name[fx_node.name]
            kind = fx_node.target.__name__.split(".")[0]  # "load.default" -> "load"
            kinds.add(kind)
            assert (onnx_node.domain, onnx_node.op_type) == (MEMORY_DOMAIN, kind)
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in onnx_node.attribute}
            moved = fx_node if kind in ("load", "offload") else fx_node.args[0]
            copy = moved.op == "call_function" and moved.target in (ops.load, ops.offload)
            val = moved.meta["val"]
            assert attrs["tensor"].decode() == (moved.args[1] if copy else moved.name)
            assert attrs["layer"].decode() == (info(fx_node).layer or "")
            assert attrs["bytes"] == val.numel() * val.element_size()
            assert list(onnx_node.input) == [fx_node.args[0].name]
            assert list(onnx_node.output) == ([fx_node.name] if kind in ("load", "offload") else [])
    assert kinds == {"load", "offload", "wait", "evict"}


def test_unmapped_aten_ops_keep_their_name_and_arguments(exported):
    (forward, fw_model), (backward, bw_model) = _programs(exported)[:2]
    loss = next(n for n in fw_model.graph.node if n.domain == ATEN_DOMAIN and n.op_type == "mse_loss")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in loss.attribute}
    assert attrs["input_names"] == [b"self", b"target"] and attrs["reduction"] == 1
    grad = next(n for n in bw_model.graph.node if n.op_type == "mse_loss_backward")
    assert grad.domain == ATEN_DOMAIN and len(grad.input) == 3
    # Mapped ops are standard ONNX: the Linear layers' matmuls.
    assert {"Gemm", "Transpose", "Relu"} <= {n.op_type for n in fw_model.graph.node if n.domain == ""}


def _many_mapped_ops(x, w, b, idx, ln_w, ln_b):
    h = torch.addmm(b, x, w.t())
    h = torch.nn.functional.gelu(h) + torch.nn.functional.silu(h) * 0.5 - h.pow(2) / 3.0
    h = h.view(2, 3, 8).transpose(1, 2).permute(0, 2, 1).reshape(6, 8)
    s = torch.softmax(h, dim=-1) + torch.log_softmax(h, dim=0)
    r = torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-6)
    e = torch.nn.functional.embedding(idx, w)
    n = torch.nn.functional.layer_norm(h, (8,), ln_w, ln_b, 1e-5)
    a, c = torch.split(h, [2, 6], dim=1)
    m = torch.where(h > 0, h, -h).sum(0) + (h <= 0.1).float().sum()
    z = torch.cat([a, c.neg()], dim=1).unsqueeze(0).expand(2, 6, 8)[..., 1:5]
    return s * r, e.sin().cos(), n, m, z, torch.bmm(h.unsqueeze(0), h.t().unsqueeze(0))


def test_mapped_ops_compute_what_torch_computes():
    torch.manual_seed(0)
    args = (torch.randn(6, 4), torch.randn(8, 4), torch.randn(8), torch.tensor([0, 3, 5]), torch.randn(8),
            torch.randn(8))
    gm = make_fx(_many_mapped_ops)(*args)
    model = program_to_onnx(gm, "mapped ops")
    onnx.checker.check_model(model, full_check=True)
    assert all(n.domain == "" for n in model.graph.node), [n.op_type for n in model.graph.node if n.domain]
    results = ReferenceEvaluator(model).run(None, {i.name: a.numpy() for i, a in zip(model.graph.input, args)})
    for got, expected in zip(results, _many_mapped_ops(*args)):
        np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-5)


def test_bf16_programs_pass_the_checker():
    """Autocast's casts become Casts, the bf16 matmuls stay standard ONNX ops."""
    record = compile_small_training_graph(precision="bf16")
    for gm in (record.forward, record.backward):
        model = program_to_onnx(gm, "bf16")
        onnx.checker.check_model(model, full_check=True)
        assert {"Cast", "Gemm" if gm is record.forward else "MatMul"} <= {n.op_type for n in model.graph.node}


def test_onnx_needs_an_output_directory(tmp_path, capsys):
    script = tmp_path / "train_mlp.py"
    script.write_text(MLP_TRAIN_SCRIPT)
    assert cli.main(["inspect", "--format", "onnx", str(script)]) == 2
    assert "--format onnx writes files: give the directory with --out DIR" in capsys.readouterr().err
