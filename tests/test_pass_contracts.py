"""Passes declare what they require, use and provide; the manager checks the order.

Also: provenance comes from node-creation hooks, and facts (not pass names) tell later code
what holds.
"""
import pytest
from conftest import compile_small_training_graph

import megacompile
from megacompile.core import ops
from megacompile.core.node_info import info
from megacompile.passes import (
    PASS_ORDER,
    PassContract,
    PassOrderError,
    check_order,
    facts_after,
    optional_pass_names,
    recompute,
)


def _contracts(*names):
    by_name = {p.CONTRACT.name: p.CONTRACT for p in PASS_ORDER}
    return [by_name[n] for n in names]


def test_the_pass_order_keeps_every_contract():
    check_order([p.CONTRACT for p in PASS_ORDER])
    for p in PASS_ORDER:
        assert callable(p.run) and p.CONTRACT.provides, p.CONTRACT.name


def test_a_pass_before_what_it_requires_is_refused():
    order = _contracts("host_casts", "annotate", "resident_parameters", "recompute", "stream_parameters",
                       "offload_gradients")
    with pytest.raises(PassOrderError, match=r"pass 'host_casts' requires \['annotated'\].*annotate, which runs later"):
        check_order(order)


def test_a_pass_before_a_fact_it_uses_is_refused():
    order = _contracts("annotate", "host_casts", "resident_parameters", "recompute", "offload_gradients",
                       "stream_parameters")
    with pytest.raises(PassOrderError, match=r"'offload_gradients' uses \['parameters_streamed'\]"):
        check_order(order)


def test_a_stage_must_end_with_what_the_compiler_needs():
    with pytest.raises(PassOrderError, match=r"joint graph: .*\['recompute_applied'\] unprovided"):
        check_order(_contracts("annotate", "host_casts", "resident_parameters", "stream_parameters"))


def test_unknown_stage_is_refused():
    with pytest.raises(ValueError, match="unknown stage"):
        PassContract(name="x", stages=("jointt",), provides=frozenset({"y"}))


def test_optional_passes_are_derived_from_the_contracts():
    assert optional_pass_names() == ["canonical_operators", "elide_causal_mask", "fuse_lm_head", "chunk_tokens",
                                     "narrow_dtype_extremes", "host_casts", "resident_parameters",
                                     "stream_parameters", "offload_gradients", "merge_compute_runs"]
    assert "parameters_streamed" not in facts_after("forward", ["stream_parameters"])
    assert "outputs_offloaded" in facts_after("forward", ["stream_parameters"])
    assert facts_after("joint") >= {"annotated", "recompute_applied", "resident_loads"}
    with pytest.raises(megacompile.OptionsError, match="cannot switch off"):
        megacompile.parse_options({"device": "cpu", "disable_passes": ["annotate"]})


def _compiled_record(**options):
    return compile_small_training_graph(snapshots=True, **options)


def test_provenance_comes_from_node_creation():
    record = _compiled_record()
    for gm in (record.forward, record.backward):
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is ops.load and info(node).decision == "resident":
                assert info(node).created_by == "resident_parameters", node.format_node()  # made in the joint
            elif node.target is ops.load or (node.target in (ops.wait, ops.evict) and node.args[0].target is ops.load):
                assert info(node).created_by == "stream_parameters", node.format_node()
            elif node.target is ops.offload or (node.target is ops.wait and node.args[0].target is ops.offload):
                assert info(node).created_by == "offload_gradients", node.format_node()
            elif not ops.is_memory_op(node):
                assert info(node).created_by in ("capture", "recompute", "host_casts"), node.format_node()
    # The snapshot's count is what the hooks saw: every node stamped by stream_parameters
    # (a load, a wait and an evict per streamed input, and more), none of them erased later.
    snap = next(s for s in record.snapshots if s.graph == "forward" and s.stage == "stream_parameters")
    stamped = [n for n in record.forward.graph.nodes if info(n).created_by == "stream_parameters"]
    streamed = [n for n in stamped if n.target is ops.load]
    assert len(streamed) >= 3 and snap.nodes_created == len(stamped) >= 3 * len(streamed)


def test_a_switched_off_pass_leaves_its_fact_unset():
    record = _compiled_record(disable_passes=["stream_parameters", "offload_gradients"])
    assert not any(n.target in (ops.load, ops.offload) for n in record.forward.graph.nodes)
    assert [s.stage for s in record.snapshots if s.graph == "forward"] == ["captured", "annotate", "host_casts"]


def test_forward_outputs_are_counted_from_the_joint_graph(monkeypatch):
    """The recompute pass finds the forward's outputs from the graph (outputs less one
    gradient per primal) rather than from an attribute set on the graph; the partition
    checks it against AOTAutograd's count, which it would refuse to plan otherwise."""
    from megacompile.capture import training_compiler

    seen = []
    original = training_compiler.TrainingCompiler.partition

    def spy(self, joint, joint_inputs, *, num_fwd_outputs, **kw):
        seen.append((recompute.num_forward_outputs(joint), num_fwd_outputs))
        return original(self, joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)

    monkeypatch.setattr(training_compiler.TrainingCompiler, "partition", spy)
    _compiled_record()
    assert seen == [(1, 1)]
