"""Plan data is typed: a frozen decision spec apart from what building it gave; enums for
policy, role, phase and placement."""
import copy
import dataclasses
import pickle

import pytest
from conftest import compile_small_training_graph

from megacompile.core.enums import Phase, Placement, Policy, Role
from megacompile.core.node_info import has_info, info
from megacompile.plan.training_plan import PlanSpec, TrainingPlan


def test_a_spec_is_frozen_and_typed():
    spec = PlanSpec(name="mix", default_policy="offload", layer_policy={"layers.0": "recompute"},
                    resident=["w"], prefetch={"w": 2})
    assert spec.default_policy is Policy.OFFLOAD and spec.layer_policy["layers.0"] is Policy.RECOMPUTE
    assert spec.policy_of_layer("layers.0") is Policy.RECOMPUTE and spec.policy_of_layer("layers.9") is Policy.OFFLOAD
    assert spec.resident == ("w",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"
    with pytest.raises(TypeError, match="frozen"):
        spec.layer_policy["layers.1"] = Policy.KEEP
    with pytest.raises(ValueError):
        PlanSpec(default_policy="recomptue")  # a typo is an error, not a silent 'keep'
    deeper = spec.replace(prefetch={"w": 3})
    assert deeper.prefetch == {"w": 3} and spec.prefetch == {"w": 2} and deeper.layer_policy == spec.layer_policy
    assert copy.deepcopy(spec) == spec and pickle.loads(pickle.dumps(spec)) == spec


def test_a_built_plan_reads_its_spec_and_keeps_results_apart():
    plan = TrainingPlan(PlanSpec(name="keep", budget=123))
    assert (plan.policy, plan.budget, plan.default_policy) == ("keep", 123, Policy.KEEP)
    plan.saved_values.append("relu")
    with pytest.raises(AttributeError):
        plan.layer_policy = {}  # decisions are the spec's: build another spec
    flat = plan.as_dict()
    assert flat["policy"] == "keep" and flat["saved_values"] == ["relu"] and "spec" not in flat


def test_compiled_nodes_and_plans_carry_the_enums():
    record = compile_small_training_graph(recompute="always")
    assert isinstance(record.plan.spec, PlanSpec) and record.plan.default_policy is Policy.RECOMPUTE
    phases = set()
    for gm in (record.forward, record.backward):
        for node in gm.graph.nodes:
            if has_info(node):
                ni = info(node)
                assert isinstance(ni.role, Role) and isinstance(ni.phase, Phase), node.format_node()
                assert isinstance(ni.placement, Placement), node.format_node()
                phases.add(ni.phase)
    assert Phase.RECOMPUTE in phases
