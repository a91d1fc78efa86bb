"""The ``megatrain`` op library, and the invariants of the graphs the real pipeline builds.

- ``torch.ops.megatrain.load/offload/wait/evict``: registered, fake kernels propagate
  shapes and strides, reference kernels run, and dead-code elimination keeps the
  side-effecting ``wait``/``evict`` nodes that nobody reads.
- The forward and backward graphs of a compiled MLP training step (the session's capture,
  ``captured_graphs.captured_mlp``, copied per test) keep the invariants ``passes.invariants``
  documents, and ``invariants.check`` catches hand-made corruptions of them.
- ``disable_passes=["stream_parameters"]`` still trains correctly on the CPU stand-in.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from conftest import COMPILED
from reference_models import MLP, make_training_step
from torch._subclasses.fake_tensor import FakeTensorMode

import megacompile
from megacompile.core import ops
from megacompile.core.node_info import NodeInfo, identifier, info
from megacompile.passes import PassContext, facts_after, invariants
from megacompile.passes.invariants import InvariantViolation

OPS = ("load", "offload", "wait", "evict")




# --- the op library ---------------------------------------------------------------------------
def test_ops_are_registered():
    schemas = {name: str(getattr(torch.ops.megatrain, name).default._schema) for name in OPS}
    assert schemas == {
        "load": "megatrain::load(Tensor host, str name) -> Tensor",
        "offload": "megatrain::offload(Tensor device, str name) -> Tensor",
        "wait": "megatrain::wait(Tensor t) -> ()",
        "evict": "megatrain::evict(Tensor t) -> ()",
    }
    assert ops.MEMORY_OPS == (ops.load, ops.offload, ops.wait, ops.evict)
    assert ops.load is torch.ops.megatrain.load.default


@pytest.mark.parametrize("make", [
    lambda: torch.empty(6, 4),
    lambda: torch.empty(6, 4).t(),  # non-contiguous: strides must be kept
    lambda: torch.empty(2, 3, 5).permute(2, 0, 1),
    lambda: torch.empty(3, dtype=torch.float64),
    lambda: torch.empty((), dtype=torch.int64),
], ids=["contiguous", "transposed", "permuted", "float64", "scalar"])
def test_fake_kernels_keep_shape_stride_dtype(make):
    with FakeTensorMode():
        t = make()
        for op in (torch.ops.megatrain.load, torch.ops.megatrain.offload):
            out = op(t, "w")
            assert type(out).__name__ == "FakeTensor"
            assert (out.shape, out.stride(), out.dtype, out.device) == (t.shape, t.stride(), t.dtype, t.device)
        assert torch.ops.megatrain.wait(t) is None
        assert torch.ops.megatrain.evict(t) is None


def test_reference_kernels_copy():
    host = torch.randn(5, 3).t()
    for op in (torch.ops.megatrain.load, torch.ops.megatrain.offload):
        out = op(host, "w")
        assert torch.equal(out, host) and out.stride() == host.stride()
        assert out.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()
    assert torch.ops.megatrain.wait(host) is None
    assert torch.ops.megatrain.evict(host) is None


def test_dead_code_elimination_keeps_wait_and_evict():
    g = fx.Graph()
    x = g.placeholder("x")
    loaded = g.call_function(ops.load, (x, "w"))
    wait = g.call_function(ops.wait, (loaded,))
    relu = g.call_function(torch.ops.aten.relu.default, (loaded,))
    dead = g.call_function(torch.ops.aten.neg.default, (loaded,))  # pure and unused
    evict = g.call_function(ops.evict, (loaded,))
    g.output(relu)
    assert not wait.users and not evict.users
    assert g.eliminate_dead_code()  # something was removed ...
    remaining = list(g.nodes)
    assert dead not in remaining  # ... the pure op ...
    assert wait in remaining and evict in remaining  # ... but never the memory ops
    assert [n.target for n in remaining if n.op == "call_function"] == [
        ops.load, ops.wait, torch.ops.aten.relu.default, ops.evict]
    gm = fx.GraphModule(torch.nn.Module(), g)
    t = torch.randn(4)
    assert torch.equal(gm(t), t.relu())
    # An unused load is a side effect too (a prefetch nobody reads must be caught by the
    # invariants, not silently dropped).
    g2 = fx.Graph()
    y = g2.placeholder("y")
    g2.call_function(ops.load, (y, "w"))
    g2.output(y)
    g2.eliminate_dead_code()
    assert any(n.target is ops.load for n in g2.nodes)


# --- invariants of the real pipeline -----------------------------------------------------------
def _train_record(**options):
    torch.manual_seed(0)
    model = MLP(width=16, depth=2, out=4)
    step, _ = make_training_step(model, torch.nn.functional.mse_loss)
    compiled = torch.compile(step, backend="megatrain", options={"device": "cpu", "lowering": "eager", **options})
    compiled(torch.randn(4, 16), torch.randn(4, 4))
    records = [r for r in COMPILED if r.backward is not None]
    assert len(records) == 1, [r.label for r in COMPILED]
    return model, records[0]


@pytest.fixture
def trained(captured_mlp):
    """The 2-layer MLP captured once per session (every parameter streams: no resident
    parameters), with its own copies of the record's programs, which a test may corrupt."""
    return captured_mlp.model, captured_mlp.fresh_record()


def test_resident_parameters_load_once_and_cross_as_planned():
    """With room for everything, parameters read by both passes load once per step."""
    _, record = _train_record()
    assert record.plan.resident, record.plan
    fwd_loads = [n for n in record.forward.graph.nodes if n.target is ops.load]
    resident = [n for n in fwd_loads if n.meta["megatrain"].decision == "resident"]
    assert {n.meta["megatrain"].source for n in resident} == set(record.plan.resident)
    for load in resident:
        assert sum(u.target is ops.wait for u in load.users) == 1
        assert not any(u.target is ops.evict for u in load.users)
    bwd_loaded = {n.args[1] for n in record.backward.graph.nodes if n.target is ops.load}
    assert not bwd_loaded & set(record.plan.resident)


def _is_compute(node: fx.Node) -> bool:
    return node.op == "call_function" and not ops.is_memory_op(node)


def test_every_load_has_one_wait_and_one_evict(trained):
    _, rec = trained
    for gm in (rec.forward, rec.backward):
        loads = [n for n in gm.graph.nodes if n.target is ops.load]
        assert loads
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for load in loads:
            waits = [u for u in load.users if u.target is ops.wait]
            evicts = [u for u in load.users if u.target is ops.evict]
            uses = [u for u in load.users if _is_compute(u)]
            assert len(waits) == 1 and len(evicts) == 1, load.name
            assert uses, f"{load.name} is never used"
            assert all(order[waits[0]] < order[u] < order[evicts[0]] for u in uses), load.name


def test_no_compute_reads_a_host_value(trained):
    _, rec = trained
    for gm in (rec.forward, rec.backward):
        for node in gm.graph.nodes:
            if _is_compute(node):
                for inp in node.all_input_nodes:
                    assert info(inp).placement != "host", f"{node.name} reads host value {inp.name}"


def test_backward_returns_only_host_gradients(trained):
    model, rec = trained
    output = next(iter(rec.backward.graph.find_nodes(op="output")))
    outs = list(output.args[0])
    grads = [o for o in outs if o is not None]
    assert len(grads) == len(list(model.parameters()))  # x and y get None
    for out in grads:
        assert out.target is ops.offload, out.name
        assert info(out).placement == "host"
        assert out.args[1].startswith("grad.")
    assert {o.args[1] for o in grads} == {f"grad.{n}" for n, _ in model.named_parameters()}
    # The forward hands the user a host loss, and no loaded parameter copy to the backward.
    fw_out = list(next(iter(rec.forward.graph.find_nodes(op="output"))).args[0])
    assert fw_out[0].target is ops.offload
    assert not any(isinstance(o, fx.Node) and o.target is ops.load for o in fw_out)


def test_load_names_derive_from_parameter_names(trained):
    model, rec = trained
    params = [n for n, _ in model.named_parameters()]
    assert "layers.0.0.weight" in params
    fw_loads = {n.name: n.args[1] for n in rec.forward.graph.nodes if n.target is ops.load}
    assert "load__layers_0_0_weight" in fw_loads
    # The forward loads every parameter and the two inputs, once each.
    assert fw_loads == {f"load__{identifier(s)}": s for s in params + ["x", "y"]}
    bw_loads = {n.name: n.args[1] for n in rec.backward.graph.nodes if n.target is ops.load}
    for name, source in bw_loads.items():
        assert name == f"load__{identifier(source)}"
        assert source in params or source in ("x", "y") or source.startswith("grad_output_"), source
    for gm in (rec.forward, rec.backward):
        for node in gm.graph.nodes:
            if node.target in (ops.wait, ops.evict) and node.args[0].target is ops.load:
                kind = "wait" if node.target is ops.wait else "evict"
                assert node.name == node.args[0].name.replace("load__", f"{kind}__", 1)


# --- invariants.check catches corruptions ------------------------------------------------------
def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def _ctx(rec, stage: str) -> PassContext:
    ctx = PassContext(rec.options, stage, rec.plan, [], [], num_user_outputs=1 if stage == "forward" else 0)
    # The facts that hold once the passes ran on this stage (invariants depend on them).
    ctx.ran = ["annotate", "recompute", "stream_parameters", "offload_gradients"] if stage == "backward" else [
        "annotate", "stream_parameters", "offload_gradients"]
    ctx.facts = set(facts_after(stage))
    return ctx


def _node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def test_check_accepts_the_real_graphs(trained):
    _, rec = trained
    invariants.check(rec.forward, _ctx(rec, "forward"))
    invariants.check(rec.backward, _ctx(rec, "backward"))
    invariants.check(_copy(rec.forward), _ctx(rec, "forward"))


def _delete_evict(gm):
    gm.graph.erase_node(_node(gm, "evict__layers_0_0_weight"))
    return ["load__layers_0_0_weight", "exactly one wait and one evict", "has 1 and 0"]


def _use_after_evict(gm):
    load = _node(gm, "load__layers_0_0_weight")
    use = next(u for u in load.users if _is_compute(u))
    use.prepend(_node(gm, "evict__layers_0_0_weight"))
    return ["load__layers_0_0_weight", "used after its evict"]


def _use_before_wait(gm):
    load = _node(gm, "load__layers_0_0_weight")
    use = next(u for u in load.users if _is_compute(u))
    use.append(_node(gm, "wait__layers_0_0_weight"))
    return ["load__layers_0_0_weight", "used before its wait"]


def _compute_reads_host(gm):
    host = next(n for n in gm.graph.nodes if n.op == "placeholder" and info(n).placement == "host")
    output = next(iter(gm.graph.find_nodes(op="output")))
    with gm.graph.inserting_before(output):
        neg = gm.graph.call_function(torch.ops.aten.neg.default, (host,))
    neg.meta["megatrain"] = NodeInfo(role="compute", placement="device")
    output.args = ((*output.args[0], neg),)
    return [f"compute op {neg.name} reads host value {host.name} without a load"]


def _output_left_on_device(gm):
    output = next(iter(gm.graph.find_nodes(op="output")))
    outs = list(output.args[0])
    loss = outs[0].args[0]  # offload__output_0 -> mse_loss
    outs[0] = loss
    output.args = (tuple(outs),)
    return [f"output 0 ({loss.name}) is returned while still on the device"]


def _loaded_copy_crosses(gm):
    output = next(iter(gm.graph.find_nodes(op="output")))
    load = _node(gm, "load__head_weight")
    output.args = ((*output.args[0], load),)
    return ["loaded parameter copy load__head_weight crosses from forward to backward"]


def _missing_node_info(gm):
    del _node(gm, "addmm").meta["megatrain"]
    return ["node addmm has no NodeInfo"]


CORRUPTIONS = [_delete_evict, _use_after_evict, _use_before_wait, _compute_reads_host, _output_left_on_device,
               _loaded_copy_crosses, _missing_node_info]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=[c.__name__.strip("_") for c in CORRUPTIONS])
def test_check_names_the_violation(trained, corrupt):
    _, rec = trained
    broken = _copy(rec.forward)
    words = corrupt(broken)
    broken.graph.lint()  # still a well-formed FX graph: only our invariants are broken
    with pytest.raises(InvariantViolation) as excinfo:
        invariants.check(broken, _ctx(rec, "forward"))
    message = str(excinfo.value)
    assert message.startswith("forward graph after pass 'offload_gradients': "), message
    for word in words:
        assert word in message, message
    # The original graph is untouched by corrupting the copy.
    invariants.check(rec.forward, _ctx(rec, "forward"))


def test_check_catches_backward_gradient_left_on_device(trained):
    _, rec = trained
    broken = _copy(rec.backward)
    output = next(iter(broken.graph.find_nodes(op="output")))
    outs = list(output.args[0])
    index = next(i for i, o in enumerate(outs) if o is not None)
    outs[index] = outs[index].args[0]
    output.args = (tuple(outs),)
    with pytest.raises(InvariantViolation, match=rf"backward graph after pass 'offload_gradients': output {index} "):
        invariants.check(broken, _ctx(rec, "backward"))


# --- bisecting with disable_passes ---------------------------------------------------------------
def test_disable_stream_parameters_still_trains():
    torch.manual_seed(0)
    model = MLP(width=16, depth=2, out=4)
    reference = copy.deepcopy(model)
    step, _ = make_training_step(model, torch.nn.functional.mse_loss)
    ref_step, _ = make_training_step(reference, torch.nn.functional.mse_loss)
    compiled = torch.compile(step, backend="megatrain",
                             options={"device": "cpu", "lowering": "eager", "disable_passes": ["stream_parameters"],
                                      "snapshots": True})
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
        ours, theirs = compiled(x, y).item(), ref_step(x, y).item()
        assert abs(ours - theirs) <= 1e-5 * abs(theirs)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.detach() - q.detach()).abs().max().item() <= 1e-5, name

    assert COMPILED
    stages = {(s.graph, s.stage) for rec in COMPILED for s in rec.snapshots}
    assert ("forward", "offload_gradients") in stages and ("backward", "recompute") in stages
    assert not any(stage == "stream_parameters" for _, stage in stages), sorted(stages)
    rec = next(r for r in COMPILED if r.backward is not None)
    for gm in (rec.forward, rec.backward):
        assert not any(n.target is ops.load for n in gm.graph.nodes)
    assert megacompile.last_report() is not None


# --- bf16: host casts are explicit host ops, and the invariants cover them ---------------------
@pytest.fixture
def trained_bf16(captured_mlp_bf16):
    """The same MLP under precision="bf16", captured once per session; copies as above."""
    return captured_mlp_bf16.model, captured_mlp_bf16.fresh_record()


def _host_casts(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and info(n).decision == "host_cast"]


def test_bf16_host_casts_are_placed_on_the_host(trained_bf16):
    _, rec = trained_bf16
    invariants.check(rec.forward, _ctx(rec, "forward"))
    invariants.check(rec.backward, _ctx(rec, "backward"))
    # Forward: every fp32 host tensor a matmul reads is cast to bf16 on the host and that
    # cast is what is loaded.
    casts = _host_casts(rec.forward)
    assert casts and all(info(c).placement == "host" and info(c).created_by == "capture" for c in casts)
    for cast in casts:
        assert cast.args[0].op == "placeholder" and cast.meta["val"].dtype == torch.bfloat16
        assert [u.target for u in cast.users] == [ops.load]
        assert info(next(iter(cast.users))).nbytes_hint == cast.meta["val"].numel() * 2
    # Backward: every gradient is a host cast to fp32 of a bf16 offload.
    output = next(iter(rec.backward.graph.find_nodes(op="output")))
    grads = [o for o in output.args[0] if isinstance(o, fx.Node)]
    assert grads and all(g in _host_casts(rec.backward) for g in grads)
    for g in grads:
        assert g.meta["val"].dtype == torch.float32
        assert g.args[0].target is ops.offload and g.args[0].meta["val"].dtype == torch.bfloat16


def _gradient_cast_reads_device(gm):
    cast = next(n for n in _host_casts(gm) if n.args[0].target is ops.offload)
    device_value = cast.args[0].args[0]
    cast.replace_input_with(cast.args[0], device_value)
    return [f"host op {cast.name} reads device value {device_value.name}"]


def _gradient_cast_before_wait(gm):
    cast = next(n for n in _host_casts(gm) if n.args[0].target is ops.offload)
    wait = next(u for u in cast.args[0].users if u.target is ops.wait)
    wait.prepend(cast)
    return [f"host op {cast.name} reads {cast.args[0].name} before waiting for its offload"]


def _device_reads_host_cast(gm):
    load = next(n for n in gm.graph.nodes if n.target is ops.load and n.args[0].op == "call_function")
    cast = load.args[0]
    with gm.graph.inserting_after(load):
        neg = gm.graph.call_function(torch.ops.aten.neg.default, (cast,))
    neg.meta["megatrain"] = NodeInfo(role="compute", placement="device")
    return [f"compute op {neg.name} reads host value {cast.name} without a load"]


@pytest.mark.parametrize("corrupt", [_gradient_cast_reads_device, _gradient_cast_before_wait, _device_reads_host_cast],
                         ids=["gradient_cast_reads_device", "gradient_cast_before_wait", "device_reads_host_cast"])
def test_check_names_host_cast_violations(trained_bf16, corrupt):
    _, rec = trained_bf16
    broken = _copy(rec.backward)
    words = corrupt(broken)
    broken.graph.lint()
    with pytest.raises(InvariantViolation) as excinfo:
        invariants.check(broken, _ctx(rec, "backward"))
    for word in words:
        assert word in str(excinfo.value), str(excinfo.value)


def test_check_catches_host_cast_crossing_to_backward(trained_bf16):
    _, rec = trained_bf16
    broken = _copy(rec.forward)
    cast = _host_casts(broken)[0]
    output = next(iter(broken.graph.find_nodes(op="output")))
    output.args = ((*output.args[0], cast),)
    with pytest.raises(InvariantViolation, match=f"host cast {cast.name} crosses from forward to backward"):
        invariants.check(broken, _ctx(rec, "forward"))
