"""Each pass of ``passes.PASS_ORDER`` on a fresh copy of a graph captured once per session.

The captures (``captured_graphs.py``) are real compiles of small reference models; these tests
run a pass (and the passes its contract stands on, through the pass manager) on copies of
their Dynamo or joint graphs and check what that pass alone is for, so no test here compiles
a model. Rewritten Dynamo graphs are also run against the graph as captured.
"""
from __future__ import annotations

import dataclasses
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from captured_graphs import CapturedStep

from megacompile.core import fused_head, ops, token_chunks
from megacompile.core import torch_compat as compat
from megacompile.core.node_info import has_info, info, is_view_node, layer_of_module_path, normalize_module_path
from megacompile.passes import (
    PASS_ORDER,
    annotate,
    canonical_operators,
    chunk_tokens,
    elide_causal_mask,
    fuse_lm_head,
    host_casts,
    invariants,
    recompute,
    resident_parameters,
    stream_parameters,
)
from megacompile.passes.manager import PassContext, run_pipeline
from megacompile.plan.memory_estimate import estimate_program_pair
from megacompile.plan.training_plan import PlanSpec, TrainingPlan
from megacompile.runtime.executor import copying_device_segments


@dataclasses.dataclass
class Built:
    """A joint graph run through the joint passes under a plan, split, and both halves rewritten."""

    joint: fx.GraphModule
    forward: fx.GraphModule
    backward: fx.GraphModule
    plan: TrainingPlan
    forward_ctx: PassContext
    backward_ctx: PassContext


def _build(step: CapturedStep, spec: PlanSpec = PlanSpec(), disable: tuple[str, ...] = (), **options) -> Built:
    """What the planner's build does for one plan (``TrainingCompiler._builder``), on a fresh
    copy of the captured joint graph, with ``disable`` as the options' ``disable_passes``."""
    opts = step.options_with(disable_passes=tuple(disable), **options)
    plan = TrainingPlan(spec)
    joint = step.fresh_joint_graph()
    run_pipeline(joint, step.context("joint", plan, opts), PASS_ORDER, keep_snapshots=False)
    by_name = {n.name: n for n in joint.graph.nodes}
    forward, backward = compat.extract_forward_backward(
        joint, [by_name[n] for n in plan.saved_values], [by_name[n] for n in plan.saved_sym_nodes],
        step.num_fwd_outputs)
    fctx, bctx = step.context("forward", plan, opts), step.context("backward", plan, opts)
    run_pipeline(forward, fctx, PASS_ORDER, keep_snapshots=False)
    run_pipeline(backward, bctx, PASS_ORDER, keep_snapshots=False)
    return Built(joint, forward, backward, plan, fctx, bctx)


def _check_invariants(built: Built) -> None:
    invariants.check(built.forward, built.forward_ctx)
    invariants.check(built.backward, built.backward_ctx)


def _calls(gm: fx.GraphModule, *targets) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def _compute(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and not ops.is_memory_op(n)]


def _outputs(gm: fx.GraphModule) -> list:
    return list(next(iter(gm.graph.find_nodes(op="output"))).args[0])


def _loads(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.args[1]: n for n in _calls(gm, ops.load)}


def _params(step: CapturedStep) -> list[str]:
    return [name for name, role in zip(step.input_names, step.input_roles) if role == "param"]


def _dynamo_layer(node: fx.Node) -> str | None:
    """The layer of a Dynamo graph node, from its module stack (as the passes read it)."""
    path, _type = list(node.meta["nn_module_stack"].values())[-1]
    return layer_of_module_path(normalize_module_path(path))


def _view_root(node: fx.Node) -> fx.Node:
    while is_view_node(node):
        node = node.args[0]
    return node


def _run_dynamo_graph(step: CapturedStep, gm: fx.GraphModule) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(gm(*step.example_inputs))


# --- the captures themselves -------------------------------------------------------------------
def _fingerprint(gm: fx.GraphModule) -> tuple:
    """What a pass could change in place: the code, and each node's meta keys, dict-valued
    meta and NodeInfo."""
    return str(gm.graph), [(n.name, sorted(n.meta), repr({k: v for k, v in n.meta.items() if isinstance(v, dict)}),
                            repr(n.meta.get("megatrain"))) for n in gm.graph.nodes]


def test_fresh_copies_share_no_node_meta_or_node_info(captured_mlp_bf16):
    """A copy's nodes, meta dicts and NodeInfo are its own, so a pass run on it (or a test
    that corrupts it) leaves the captured graphs as they were."""
    step = captured_mlp_bf16
    kept = [step.dynamo_graph, step.joint_graph, step.record.forward, step.record.backward]
    before = [_fingerprint(gm) for gm in kept]
    record = step.fresh_record()
    copies = [step.fresh_dynamo_graph(), step.fresh_joint_graph(), record.forward, record.backward]
    for original, copied in zip(kept, copies):
        assert copied is not original and copied.graph is not original.graph
        assert [n.name for n in copied.graph.nodes] == [n.name for n in original.graph.nodes]
        for old, new in zip(original.graph.nodes, copied.graph.nodes):
            assert new is not old and new.meta is not old.meta
            assert new.meta.get("megatrain") is None or new.meta["megatrain"] is not old.meta["megatrain"]
            assert all(new.meta[k] is not v for k, v in old.meta.items() if isinstance(v, dict)), new.name
    assert any(has_info(n) for n in step.record.forward.graph.nodes)  # the record's copies had NodeInfo to copy
    assert record.plan is not step.record.plan and record.plan.saved_values == step.record.plan.saved_values

    # Rewrite every copy: the joint passes on the joint graph; on all of them, each node's
    # NodeInfo and dict-valued meta changed in place, and a node erased.
    run_pipeline(copies[1], step.context("joint"), PASS_ORDER, keep_snapshots=False)
    for gm in copies:
        for node in gm.graph.nodes:
            info(node).placement, info(node).layer = "device", "changed"
            for value in node.meta.values():
                if isinstance(value, dict):
                    value.clear()
    for gm in copies[2:]:
        gm.graph.erase_node(_calls(gm, ops.evict)[0])
    assert [_fingerprint(gm) for gm in kept] == before
    assert not any(has_info(n) for n in step.joint_graph.graph.nodes)  # captured before any joint pass


def test_captures_hold_what_the_compiler_saw(captured_mlp, captured_gpt):
    """Names, roles and counts as the backend and AOTAutograd gave them, and the record of the
    plan chosen in that compile."""
    assert captured_mlp.input_names == ["layers.0.0.weight", "layers.0.0.bias", "x", "layers.1.0.weight",
                                        "layers.1.0.bias", "head.weight", "head.bias", "y"]
    assert captured_mlp.input_roles == ["param", "param", "input", "param", "param", "param", "param", "input"]
    assert captured_mlp.num_fwd_outputs == recompute.num_forward_outputs(captured_mlp.joint_graph) == 1
    assert captured_mlp.options.disable_passes == ("resident_parameters",)
    assert captured_gpt.options.head_chunk_tokens == 8
    for step in (captured_mlp, captured_gpt):
        dynamo_inputs = [n for n in step.dynamo_graph.graph.nodes if n.op == "placeholder"]
        primals = [n for n in step.joint_graph.graph.nodes if compat.is_primal(n)]
        assert len(dynamo_inputs) == len(primals) == len(step.input_names) == len(step.example_inputs)
        # Before the dynamo-stage passes, before the joint-stage ones, and the plan that was built.
        assert not _calls(step.joint_graph, ops.load) and step.record.plan.saved_values
        assert _calls(step.record.forward, ops.load) and _calls(step.record.backward, ops.offload)
    assert any(n.target is F.cross_entropy for n in captured_gpt.dynamo_graph.graph.nodes)
    assert _calls(captured_gpt.joint_graph, fused_head.FORWARD_WITH_GRADS)  # the compile fused it, as its options say


# --- elide_causal_mask -------------------------------------------------------------------------
def _bool_values(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes
            if isinstance(n.meta.get("example_value"), torch.Tensor) and n.meta["example_value"].dtype == torch.bool]


def test_elide_causal_mask_makes_llama_attention_causal(captured_llama):
    """Hugging Face's (tokens x tokens) bool mask is proven causal: every attention call runs
    with is_causal=True and no mask, the mask's construction is gone, and the graph computes
    the same logits."""
    step = captured_llama
    gm = step.fresh_dynamo_graph()
    calls = _calls(gm, F.scaled_dot_product_attention)
    assert len(calls) == 2 and all(c.kwargs["attn_mask"] is not None and not c.kwargs["is_causal"] for c in calls)
    assert _bool_values(gm)
    nodes = len(gm.graph.nodes)
    canonical_operators.run(gm, step.context("dynamo"))  # what the pipeline runs first (one operator spelling)
    elide_causal_mask.run(gm, step.context("dynamo"))
    for call in calls:
        assert call.kwargs["attn_mask"] is None and call.kwargs["is_causal"] is True
        assert call.meta["custom"][elide_causal_mask.NOTE_KEY].startswith("causal: the bool mask")
    assert _bool_values(gm) == [] and len(gm.graph.nodes) < nodes
    want, got = _run_dynamo_graph(step, step.fresh_dynamo_graph()), _run_dynamo_graph(step, gm)
    # The masked and the causal attention run different CPU kernels (their rounding differs
    # by instruction set): the project's fp32 tolerance.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --- fuse_lm_head ------------------------------------------------------------------------------
def test_fuse_lm_head_replaces_the_gpt_head_and_loss(captured_gpt):
    """With head_chunk_tokens=8 the head's projection and its cross entropy become one
    lm_head_loss over chunks of 8 tokens, reading the final norm's output and the head weight,
    and the loss is the unfused one."""
    step = captured_gpt
    gm = step.fresh_dynamo_graph()
    head_weight = next(n for n in gm.graph.nodes if n.op == "placeholder" and "head" in n.name)
    fuse_lm_head.run(gm, step.context("dynamo"))
    (fused,) = _calls(gm, fused_head.FORWARD_WITH_GRADS)
    assert not [n for n in gm.graph.nodes if n.target in (F.cross_entropy, compat.NN_LINEAR)
                and head_weight in n.all_input_nodes]
    assert not _calls(gm, F.cross_entropy)
    hidden, weight, bias, _labels, chunk = fused.args[:5]
    assert weight is head_weight and bias is None and chunk == 8
    assert any(n.target is F.layer_norm for n in hidden.all_input_nodes + [hidden])  # ln_f's output, reshaped
    assert fused.meta["custom"][fuse_lm_head.NOTE_KEY].startswith("fused: cross-entropy of the projection to 96")
    (want,), (got,) = _run_dynamo_graph(step, step.fresh_dynamo_graph()), _run_dynamo_graph(step, gm)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fuse_lm_head_leaves_a_one_chunk_head_with_the_reason(captured_gpt):
    """Under head_chunk_tokens="auto" the GPT's 32 tokens fit one chunk: nothing to save."""
    step = captured_gpt
    gm = step.fresh_dynamo_graph()
    fuse_lm_head.run(gm, step.context("dynamo", options=step.options_with(head_chunk_tokens="auto")))
    assert not _calls(gm, fused_head.FORWARD) and not _calls(gm, fused_head.FORWARD_WITH_GRADS)
    (loss,) = _calls(gm, F.cross_entropy)
    assert loss.meta["custom"][fuse_lm_head.NOTE_KEY].startswith("not fused: its 32 tokens' logits")


# --- chunk_tokens ------------------------------------------------------------------------------
def test_chunk_tokens_turns_each_gpt_block_runs_into_chunked_ops(captured_gpt):
    """With token_chunks=4 each block's per-token runs (its MLP among them) become
    token_chunked ops over 4 chunks; attention stays; the loss is the unchunked one."""
    step = captured_gpt
    ctx = step.context("dynamo", options=step.options_with(token_chunks=4))
    assert chunk_tokens.applies(ctx) and not chunk_tokens.applies(step.context("dynamo"))
    gm = step.fresh_dynamo_graph()
    chunk_tokens.run(gm, ctx)
    chunked = _calls(gm, token_chunks.FORWARD)
    assert chunked and all(node.args[1] == 4 for node in chunked)
    layers = [_dynamo_layer(node) for node in chunked]
    assert {"blocks.0", "blocks.1"} <= set(layers), layers
    # The MLPs' GELUs run only inside the chunked bodies now; attention is left as it was.
    assert not [n for n in gm.graph.nodes if getattr(n.target, "__name__", None) == "gelu"]
    assert len([n for n in gm.graph.nodes if n.target is operator.matmul]) == 4
    bodies = [token_chunks.body_of(node.args[0]).describe() for node in chunked]
    assert any("gelu" in body for body in bodies), bodies
    (want,), (got,) = _run_dynamo_graph(step, step.fresh_dynamo_graph()), _run_dynamo_graph(step, gm)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# --- annotate ----------------------------------------------------------------------------------
def test_annotate_tags_every_gpt_joint_node(captured_gpt):
    """Every node gets NodeInfo; parameters their owning layer, name and host placement;
    forward and backward compute ops their phase, and a forward op that reads a parameter
    the parameter's layer; the fused head its working set."""
    step = captured_gpt
    gm = step.fresh_joint_graph()
    ctx = step.context("joint")
    annotate.run(gm, ctx)
    ctx.ran, ctx.facts = ["annotate"], set(annotate.CONTRACT.provides)
    invariants.check(gm, ctx)
    owners = {"tok.weight": "tok", "blocks.0.attn.qkv.weight": "blocks.0", "blocks.1.ln2.bias": "blocks.1",
              "ln_f.weight": "ln_f", "head.weight": "head"}
    sources = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        ni = info(node)
        if compat.is_primal(node):
            sources[ni.source] = ni
            assert ni.placement == "host" and ni.phase == "forward"
            assert ni.role == ("param" if ni.source.endswith(("weight", "bias")) else "input"), ni
        elif compat.is_tangent(node):
            assert (ni.role, ni.phase, ni.placement) == ("tangent", "backward", "host")
        else:
            assert ni.role == "compute" and ni.placement == "device", node.name
            assert ni.phase == ("backward" if compat.is_backward_tagged(node) else "forward"), node.name
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and not is_view_node(node):
                assert ni.nbytes == val.numel() * val.element_size(), node.name
    assert {s: sources[s].layer for s in owners} == owners
    assert sources["x"].layer is None and sources["y"].layer is None
    for node in gm.graph.nodes:
        if node.op == "call_function" and compat.is_forward_tagged(node):
            for param in (a for a in node.all_input_nodes if compat.is_primal(a) and info(a).role == "param"):
                assert info(node).layer == info(param).layer, (node.name, info(param).source)
    layers = {info(n).layer for n in _compute(gm)}
    assert {"tok", "pos", "blocks.0", "blocks.1", "ln_f", "head"} <= layers
    backward_layers = {info(n).layer for n in _compute(gm) if info(n).phase == "backward"}
    assert {"blocks.0", "blocks.1", "head"} <= backward_layers
    (head,) = _calls(gm, fused_head.FORWARD_WITH_GRADS)
    assert info(head).layer == "head" and info(head).workspace_bytes > 0 and info(head).head_fusion.startswith("fused")


def test_annotate_carries_the_mask_proof_to_llama_attention_ops(captured_llama):
    """The capture's compile proved the Llama's mask causal on Dynamo's graph; annotate puts
    that proof on the aten attention ops (forward and backward) of the joint graph, each in
    its decoder layer."""
    step = captured_llama
    gm = step.fresh_joint_graph()
    annotate.run(gm, step.context("joint"))
    attention = [n for n in _compute(gm) if "scaled_dot_product" in str(n.target)]
    assert len(attention) == 4  # a forward and a backward per layer
    assert all(info(n).attention_mask.startswith("causal:") for n in attention), [info(n).attention_mask
                                                                                   for n in attention]
    assert sorted((info(n).layer, info(n).phase) for n in attention) == [
        (f"lm.model.layers.{i}", phase) for i in (0, 1) for phase in ("backward", "forward")]
    assert all(info(n).attention_mask is None for n in _compute(gm) if n not in attention)


# --- host_casts --------------------------------------------------------------------------------
def test_host_casts_move_bf16_casts_of_parameters_and_gradients_to_the_host(captured_mlp_bf16):
    """Under bf16 every parameter's cast to bf16 runs on the host before its load (2 bytes an
    element cross, not 4), and every fp32 gradient is made on the host from its offloaded bf16
    value; switched off, the same casts run on the device and the loads carry fp32."""
    step = captured_mlp_bf16
    built = _build(step)
    _check_invariants(built)
    forward, backward = built.forward, built.backward
    params = set(_params(step))
    cast_on_host = params | {"x"}  # the matmuls' bf16 operands; the loss reads y in fp32
    casts = [n for n in _compute(forward) if info(n).decision == host_casts.HOST_CAST]
    assert {info(c.args[0]).source for c in casts} == cast_on_host
    for cast in casts:
        assert info(cast).placement == "host" and cast.meta["val"].dtype == torch.bfloat16
        (load,) = cast.users
        assert load.target is ops.load and info(load).nbytes == cast.meta["val"].numel() * 2
    # The loss's cast up to fp32 is an activation: it stays on the device.
    assert all(info(n).placement == "device" for n in _compute(forward) if n not in casts)
    grads = [o for o in _outputs(backward) if isinstance(o, fx.Node)]
    assert len(grads) == len(params)
    for grad in grads:
        assert host_casts.is_host_cast(grad) and grad.meta["val"].dtype == torch.float32
        assert grad.args[0].target is ops.offload and grad.args[0].meta["val"].dtype == torch.bfloat16

    device_casts = _build(step, disable=("host_casts",))
    _check_invariants(device_casts)
    assert not [n for n in device_casts.forward.graph.nodes if info(n).decision == host_casts.HOST_CAST]
    wide = {name: info(load).nbytes for name, load in _loads(device_casts.forward).items()}
    narrow = {info(load.args[0].args[0]).source: info(load).nbytes for load in _calls(forward, ops.load)
              if host_casts.is_host_cast(load.args[0])}
    assert narrow.keys() == cast_on_host and params <= wide.keys()
    assert all(narrow[p] * 2 == wide[p] for p in cast_on_host)
    grads_on_device = [o for o in _outputs(device_casts.backward) if isinstance(o, fx.Node)]
    assert all(o.target is ops.offload and o.meta["val"].dtype == torch.float32 for o in grads_on_device)


# --- resident_parameters -----------------------------------------------------------------------
def test_resident_parameters_load_once_for_both_passes(captured_mlp):
    """Resident parameters are loaded once, in the forward, waited for and never evicted there:
    the copy crosses to the backward, which loads them no more. The others stream (load, wait,
    evict) and never cross."""
    step = captured_mlp
    joint = step.fresh_joint_graph()
    annotate.run(joint, step.context("joint"))
    both = [info(n).source for n in resident_parameters.used_in_both_phases(joint)]
    assert both and set(both) < set(_params(step))
    built = _build(step, PlanSpec(name="resident", resident=tuple(both)))
    _check_invariants(built)
    joint_loads = _loads(built.joint)
    assert set(joint_loads) == set(both) and all(info(n).decision == "resident" for n in joint_loads.values())
    forward_loads = _loads(built.forward)
    crossing = {_view_root(v) for v in _outputs(built.forward)[step.num_fwd_outputs:]}
    for name in both:
        load = forward_loads[name]
        assert info(load).decision == "resident" and load in crossing  # itself or a view of it is saved
        assert [u.target for u in load.users if ops.is_memory_op(u)] == [ops.wait]
    # Issued where a streamed load would be (the copy engine takes loads in program order), not
    # all at the forward's front: the head's weight after the first layer's compute has begun.
    order = list(built.forward.graph.nodes)
    assert order.index(forward_loads["head.weight"]) > order.index(_compute(built.forward)[0])
    streamed = set(_params(step)) - set(both)
    for name in streamed:
        load = forward_loads[name]
        assert info(load).decision == "stream" and load not in crossing
        assert [u.target for u in load.users if ops.is_memory_op(u)] == [ops.wait, ops.evict]
    backward_loads = _loads(built.backward)
    assert backward_loads and not set(backward_loads) & set(both)

    # A later candidate without residency starts from the same joint graph: the loads go.
    plan = TrainingPlan(PlanSpec())
    ctx = step.context("joint", plan)
    resident_parameters.run(built.joint, ctx)
    assert not _calls(built.joint, ops.load)


def test_resident_parameters_under_bf16_keep_each_weights_bf16_copy_for_both_passes(captured_mlp_bf16):
    """Under bf16 both passes read a weight's bf16 copy (autocast's forward cast, which the
    backward reuses). A resident weight's copy is loaded once, right after its host cast, at 2
    bytes an element, issued where a streamed load would be (not all at the forward's front),
    and crosses to the backward, which loads it no more."""
    step = captured_mlp_bf16
    joint = step.fresh_joint_graph()
    annotate.run(joint, step.context("joint"))
    host_casts.run(joint, step.context("joint"))
    both = [info(n).source for n in resident_parameters.used_in_both_phases(joint)]
    # The weights the backward multiplies by (not the first layer's: no gradient flows to x),
    # read by both passes only through their bf16 copies.
    weights = [p for p in _params(step) if p.endswith("weight") and p != "layers.0.0.weight"]
    assert both == weights, both
    built = _build(step, PlanSpec(name="resident", resident=tuple(both)))
    _check_invariants(built)
    resident = [n for n in _calls(built.forward, ops.load) if info(n).decision == "resident"]
    copies = {info(n.args[0].args[0]).source: n for n in resident if host_casts.is_host_cast(n.args[0])}
    assert set(copies) == set(weights)
    crossing = {_view_root(v) for v in _outputs(built.forward)[step.num_fwd_outputs:]}
    for load in copies.values():
        assert load.meta["val"].dtype == torch.bfloat16 and info(load).nbytes == load.meta["val"].numel() * 2
        assert load.prev is load.args[0] and load in crossing  # right after its cast; saved for the backward
    # Issued in use order with the streamed loads: the last layer's copy comes after the first
    # layer's compute has started.
    order = list(built.forward.graph.nodes)
    first_compute = next(n for n in _compute(built.forward) if not host_casts.is_host_cast(n))
    assert order.index(copies[weights[-1]]) > order.index(first_compute)
    backward_sources = {info(n.args[0].args[0] if host_casts.is_host_cast(n.args[0]) else n.args[0]).source
                        for n in _calls(built.backward, ops.load)}
    assert not backward_sources & set(weights), backward_sources


# --- recompute ---------------------------------------------------------------------------------
def _saved_activations(built: Built) -> set[str]:
    """The joint graph's values the forward saves for the backward, parameters and inputs aside."""
    return {n.name for n in built.joint.graph.nodes if n.name in built.plan.saved_values and n.op != "placeholder"}


def test_recompute_replays_a_layer_in_the_backward_and_saves_less(captured_mlp):
    """Under recompute for layers.1 the forward saves fewer activations (its linear's output
    is not saved), and the backward replays that layer's forward ops (phase recompute), each
    sunk to just before its first use: after the head's backward, not at the backward's front."""
    step = captured_mlp
    keep = _build(step)
    replayed = _build(step, PlanSpec(name="recompute layers.1", layer_policy={"layers.1": "recompute"}))
    _check_invariants(replayed)
    kept, saved = _saved_activations(keep), _saved_activations(replayed)
    assert saved < kept and kept - saved == {"addmm_1"}  # layers.1's linear, which its GELU's backward reads
    assert not [n for n in _compute(keep.backward) if info(n).phase == "recompute" and not is_view_node(n)]
    marked = [n for n in replayed.joint.graph.nodes if info(n).decision == "recompute" and not is_view_node(n)]
    assert marked and {info(n).layer for n in marked} == {"layers.1"}
    nodes = list(replayed.backward.graph.nodes)
    again = [n for n in _compute(replayed.backward) if info(n).phase == "recompute"]
    assert replayed.plan.recomputed_ops == [n.name for n in again]
    ops_again = [n for n in again if not is_view_node(n)]  # (views of host tensors are re-derived in any plan)
    assert [n.target for n in ops_again] == [torch.ops.aten.addmm.default]
    assert {info(n).layer for n in ops_again} == {"layers.1"}
    first_backward = min(nodes.index(n) for n in _compute(replayed.backward) if info(n).phase == "backward")
    for node in ops_again:
        first_use = min(nodes.index(u) for u in node.users)
        assert first_backward < nodes.index(node) < first_use, node.name
        between = nodes[nodes.index(node) + 1:first_use]
        assert not [n.name for n in between if n in _compute(replayed.backward)], node.name


def test_recompute_never_replays_the_fused_head(captured_gpt):
    """Recomputing everything still saves the gradients the fused head made in the forward: a
    replay would run the head's three matmuls again."""
    built = _build(captured_gpt, PlanSpec(name="recompute", default_policy="recompute"))
    _check_invariants(built)
    (head,) = _calls(built.joint, fused_head.FORWARD_WITH_GRADS)
    grads = [u for u in head.users if u.target is operator.getitem and u.args[1] in (1, 2)]
    assert len(grads) == 2 and all(info(g).decision == "save" and "fused LM head" in info(g).reason for g in grads)
    assert not [n for n in built.backward.graph.nodes if n.target in fused_head.OPS]


# --- stream_parameters -------------------------------------------------------------------------
def test_stream_parameters_load_wait_evict_every_parameter(captured_mlp):
    """Every parameter and input a compute op reads arrives through load -> wait -> uses ->
    evict, in the forward and again in the backward, and no compute op reads a host value;
    without the pass the compute reads the host placeholders directly."""
    step = captured_mlp
    built = _build(step, disable=("offload_gradients",))
    _check_invariants(built)
    for gm, ctx in ((built.forward, built.forward_ctx), (built.backward, built.backward_ctx)):
        assert "parameters_streamed" in ctx.facts
        nodes = list(gm.graph.nodes)
        for node in _compute(gm):
            assert all(info(a).placement != "host" for a in node.all_input_nodes), node.name
        for name, load in _loads(gm).items():
            assert info(load.args[0]).source == name and info(load.args[0]).placement == "host"
            (wait,) = [u for u in load.users if u.target is ops.wait]
            (evict,) = [u for u in load.users if u.target is ops.evict]
            uses = stream_parameters.alias_uses(load)
            assert uses and all(nodes.index(wait) < nodes.index(u) < nodes.index(evict) for u in uses), name
    assert set(_loads(built.forward)) == set(step.input_names)

    unstreamed = _build(step, disable=("stream_parameters", "offload_gradients"))
    assert not _calls(unstreamed.forward, ops.load)
    assert any(info(a).placement == "host" for n in _compute(unstreamed.forward) for a in n.all_input_nodes)


@pytest.mark.parametrize("depth", [0, 1])
def test_stream_parameters_prefetch_a_layer_ahead(captured_mlp, depth):
    """At prefetch_depth=1 the load of layers.1's weight is issued before layers.0 computes
    (the copy overlaps it); at depth 0 only once layers.1 starts."""
    built = _build(captured_mlp, disable=("offload_gradients",), prefetch_depth=depth)
    nodes = list(built.forward.graph.nodes)
    load = _loads(built.forward)["layers.1.0.weight"]
    by_layer = {}
    for node in _compute(built.forward):
        by_layer.setdefault(info(node).layer, []).append(nodes.index(node))
    if depth:
        assert nodes.index(load) < min(by_layer["layers.0"])
    else:
        assert max(by_layer["layers.0"]) < nodes.index(load) < min(by_layer["layers.1"])


# --- offload_gradients -------------------------------------------------------------------------
def test_offload_gradients_return_only_host_values(captured_mlp):
    """The backward returns every gradient as a host copy offloaded right after the op that
    made it and waited for before the return; the forward hands the loss back on the host.
    Without the pass they are returned from the device."""
    step = captured_mlp
    built = _build(step)
    _check_invariants(built)
    grads = [o for o in _outputs(built.backward) if o is not None]
    assert {o.args[1] for o in grads} == {f"grad.{p}" for p in _params(step)}
    nodes = list(built.backward.graph.nodes)
    last_compute = max(nodes.index(n) for n in _compute(built.backward))
    for grad in grads:
        assert grad.target is ops.offload and info(grad).placement == "host"
        assert grad.prev is grad.args[0], (grad.name, grad.prev.name)
        (wait,) = [u for u in grad.users if u.target is ops.wait]
        assert nodes.index(wait) > last_compute
        (evict,) = [u for u in grad.args[0].users if u.target is ops.evict]  # the device copy dies
        assert nodes.index(evict) > nodes.index(grad)
    (loss,) = _outputs(built.forward)[: step.num_fwd_outputs]
    assert loss.target is ops.offload and info(loss).placement == "host"

    kept_on_device = _build(step, disable=("offload_gradients",))
    assert not _calls(kept_on_device.backward, ops.offload)
    assert all(info(o).placement == "device" for o in _outputs(kept_on_device.backward) if o is not None)


# --- merge_compute_runs ------------------------------------------------------------------------
def _memory_ops_inside_layer_runs(gm: fx.GraphModule) -> list[str]:
    """Memory ops that sit between two compute ops of one layer's run."""
    nodes = list(gm.graph.nodes)
    compute = [n for n in _compute(gm) if info(n).placement != "host"]
    starts = [start for _, start in stream_parameters.layer_runs(compute)] or [0]
    starts[0] = 0
    inside = []
    for a, b in zip(starts, [*starts[1:], len(compute)]):
        first, last = nodes.index(compute[a]), nodes.index(compute[b - 1])
        inside += [n.name for n in nodes[first:last] if n.op == "call_function" and ops.is_memory_op(n)]
    return inside


@pytest.mark.parametrize("depth", [0, 1])
def test_merge_compute_runs_gathers_memory_ops_at_layer_run_ends(captured_gpt, depth):
    """With the plan's ``merged_compute_runs``, no memory op is left inside a layer's run of
    compute (loads and waits before it, offloads and evicts after it), so the copying
    program compiles each run whole: fewer segments, and no op left to run alone between a
    wait and an evict. The compute ops keep their order, the invariants hold, and here the
    peak grows (frees come later)."""
    step = captured_gpt
    cut = _build(step, prefetch_depth=depth)
    merged = _build(step, PlanSpec(merged_compute_runs=True), prefetch_depth=depth)
    _check_invariants(merged)
    assert "compute_runs_merged" in merged.forward_ctx.facts and "compute_runs_merged" not in cut.forward_ctx.facts
    for before, after in ((cut.forward, merged.forward), (cut.backward, merged.backward)):
        assert _memory_ops_inside_layer_runs(before)  # a weight's wait and evict inside its layer
        assert _memory_ops_inside_layer_runs(after) == []
        assert [n.name for n in _compute(after)] == [n.name for n in _compute(before)]
        assert sorted(n.name for n in after.graph.nodes) == sorted(n.name for n in before.graph.nodes)
        segments_before, segments_after = copying_device_segments(before), copying_device_segments(after)
        assert len(segments_after) < len(segments_before)
        alone = [len(_compute(gm)) - sum(map(len, copying_device_segments(gm))) for gm in (before, after)]
        assert alone[1] < alone[0], alone
    peaks = [max(e.peak_bytes for e in estimate_program_pair(b.forward, b.backward, "inductor", 1))
             for b in (cut, merged)]
    assert peaks[1] >= peaks[0]
