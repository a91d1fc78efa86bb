"""Repeated layers planned on short copies of the step (megacompile/plan/template_planner.py,
megacompile/capture/repeat_chain.py): the plan fits, trains like eager, is as fast as the flat
planner's, and the full graph is built a few times instead of once per candidate."""
from __future__ import annotations

import copy
import dataclasses
import functools
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import COMPILED
from reference_models import make_training_step, training_state_bytes

import megacompile
from megacompile.capture import (
    inline_regions,
)
from megacompile.capture import (
    repeat_chain as truncate_repeats,
)
from megacompile.capture import (
    training_compiler as capture,
)
from megacompile.core import torch_compat as compat
from megacompile.core.errors import OptionsError
from megacompile.options import parse_options
from megacompile.plan import template_planner


class Block(nn.Module):
    """``squared``: ReLU squared instead of GELU, a branch on an attribute, so marked blocks of
    both kinds are two bodies (as Gemma's sliding-window and full-attention layers are)."""

    def __init__(self, dim: int = 32, squared: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.squared = squared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x))
        return x + self.down(F.relu(h).square() if self.squared else F.gelu(h))


class Net(nn.Module):
    """``depth`` blocks (marked with mark_repeated_layers); ``between``: an op between blocks,
    which breaks the chain the short copies are cut from; ``alternate``: every other block
    squared (two bodies, alternating)."""

    def __init__(self, depth: int = 6, dim: int = 32, between: bool = False, alternate: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, squared=alternate and i % 2 == 1) for i in range(depth))
        self.head = nn.Linear(dim, 4)
        self.between = between

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            if self.between:
                x = x * 0.5
        return self.head(x)


def _compile(model, budget: int, mode: str):
    step, _ = make_training_step(model, F.mse_loss, lr=1e-2)
    return torch.compile(step, backend="megatrain", options={
        "device": "cpu", "lowering": "eager", "memory_budget": budget, "plan_repeats": mode})


def _batch(gen):
    return torch.randn(64, 32, generator=gen), torch.randn(64, 4, generator=gen)


def _plan_of_last_compile():
    return next(r for r in reversed(COMPILED) if r.plan is not None and r.plan.policy != "inference").plan


@functools.lru_cache(maxsize=None)
def _planned(depth: int, budget_fraction: float, mode: str):
    """The plan megatrain makes for a fresh Net under ``budget_fraction`` of its training state
    (one step run), and the budget. Cached: tests share compiles."""
    torch.manual_seed(0)
    model = Net(depth)
    megacompile.mark_repeated_layers(model)
    budget = int(training_state_bytes(model) * budget_fraction)
    compat.reset_dynamo()
    _compile(model, budget, mode)(*_batch(torch.Generator().manual_seed(1)))
    return _plan_of_last_compile(), budget


def _template_plan_trains_like_eager(depth: int, budget_fraction: float, alternate: bool = False):
    """Two steps of a fresh marked Net under ``budget_fraction`` of its training state, planned on
    the template, and of its eager twin, asserted equal, with measured = planned peak <= budget:
    the plan."""
    torch.manual_seed(0)
    model = Net(depth, alternate=alternate)
    reference = copy.deepcopy(model)
    assert len(megacompile.mark_repeated_layers(model)) == depth
    budget = int(training_state_bytes(model) * budget_fraction)
    compat.reset_dynamo()
    compiled = _compile(model, budget, "template")
    eager_step, _ = make_training_step(reference, F.mse_loss, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        batch = _batch(gen)
        torch.testing.assert_close(compiled(*batch), eager_step(*batch), rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-5)
    report = megacompile.last_report()
    assert report.measured_peak_device_bytes == report.planned_peak_device_bytes <= budget
    return _plan_of_last_compile()


def test_template_plan_fits_trains_like_eager_and_builds_the_full_graph_a_few_times(monkeypatch):
    builds = []
    original = capture.TrainingCompiler._builder

    def counting(self, joint, num_fwd_outputs):
        build = original(self, joint, num_fwd_outputs)
        n_calls = sum(1 for n in joint.graph.nodes if n.op == "call_function" and "layers" not in n.name)

        def counted(plan, snapshots=False):
            builds.append(len(joint.graph.nodes))
            return build(plan, snapshots=snapshots)
        return counted if n_calls else build

    monkeypatch.setattr(capture.TrainingCompiler, "_builder", counting)
    plan = _template_plan_trains_like_eager(6, 0.3)
    assert plan.template is not None, plan.reason
    assert plan.value_policy and "offload" in plan.value_policy.values() or plan.recomputed_ops
    # Every candidate was built on the short copies; the full graph (the largest) only for the
    # chosen rung, its deeper-prefetch variant and inspect's snapshots.
    full = max(builds)
    assert builds.count(full) <= template_planner.MAX_FULL_BUILDS + 2
    assert len(builds) - builds.count(full) >= 2 * plan.template["candidates"]
    # The extrapolated peak of the chosen plan is the one its full build has.
    assert abs(plan.template["extrapolated_peak"] - plan.peak_bytes) <= 0.05 * plan.peak_bytes


def test_template_plan_is_as_fast_as_the_flat_planners():
    template, budget = _planned(6, 0.3, "template")
    flat, _ = _planned(6, 0.3, "flat")
    assert template.template is not None and flat.template is None
    assert template.peak_bytes <= budget and flat.peak_bytes <= budget
    # Deciding alike for every layer loses little: within 5% of the flat ladder's choice.
    assert template.predicted_seconds <= flat.predicted_seconds * 1.05


def _planned_on_h200(fraction: float, depth: int = 6, hardware: str = "h200", **options):
    """As ``_planned(depth, fraction, "template")`` with the H200 profile (or ``hardware``), whose
    lane simulation shows loads stalling the compute lane (the CPU stand-in's copies are synchronous)."""
    torch.manual_seed(0)
    model = Net(depth)
    megacompile.mark_repeated_layers(model)
    step, _ = make_training_step(model, F.mse_loss, lr=1e-2)
    compat.reset_dynamo()
    compiled = torch.compile(step, backend="megatrain", options={
        "device": "cpu", "lowering": "eager", "memory_budget": int(training_state_bytes(model) * fraction),
        "plan_repeats": "template", "hardware": hardware, **options})
    compiled(*_batch(torch.Generator().manual_seed(1)))
    return _plan_of_last_compile()


@pytest.mark.parametrize("fraction", [0.3, 0.6])
def test_the_short_copy_decides_whether_a_deeper_prefetch_variant_is_built(fraction, monkeypatch):
    """The chosen rung's deeper-prefetch variant is built over the full graph only where the
    longer short copy predicts it faster. Against always building it: the same plan, the same
    predicted time and peak, one full build fewer."""
    checked = _planned_on_h200(fraction)
    monkeypatch.setattr(template_planner, "_deeper_prefetch_may_pay", lambda rung, template: True)
    always = _planned_on_h200(fraction)
    assert checked.template is not None and always.template is not None
    assert checked.policy == always.policy and checked.prefetch == always.prefetch
    assert checked.predicted_seconds == pytest.approx(always.predicted_seconds, rel=1e-12)
    assert checked.peak_bytes == always.peak_bytes
    assert checked.template["full_builds"] == always.template["full_builds"] - 1


def test_template_plans_grow_no_slower_with_the_budget():
    plans = [_planned(6, fraction, "template")[0] for fraction in (0.3, 0.37, 0.45)]
    assert all(p.template is not None for p in plans)
    for smaller, larger in zip(plans, plans[1:]):
        # No slower, but for what fewer activation bytes on the host may take (EQUALLY_FAST:
        # at 0.37 a split that recomputes holds less there than offloading everything, 0.4%
        # slower; so the recompute count may rise with the budget too).
        assert larger.predicted_seconds <= smaller.predicted_seconds * (1 + template_planner.EQUALLY_FAST)


def _joint_of(model, budget, monkeypatch) -> "torch.fx.GraphModule":
    """The step's joint graph before its marked calls are inlined (a copy)."""
    seen = []
    original = inline_regions.inline_partitioned_regions

    def spy(joint):
        if not seen:
            seen.append(truncate_repeats._copy(joint)[0])
        return original(joint)

    monkeypatch.setattr(inline_regions, "inline_partitioned_regions", spy)
    compat.reset_dynamo()
    _compile(model, budget, "flat")(*_batch(torch.Generator().manual_seed(1)))
    return seen[0]


def _calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and compat.is_invoke_subgraph(n.target)]


def test_a_short_copy_keeps_the_first_layers_and_the_last(monkeypatch):
    torch.manual_seed(0)
    model = Net(8)
    megacompile.mark_repeated_layers(model)
    joint = _joint_of(model, training_state_bytes(model), monkeypatch)
    chain = truncate_repeats.find_repeat_chain(joint)
    n = len(chain)
    assert n >= 7  # a call per block (torch may inline the first block's, or make it a body of its own)
    before = [n_.name for n_ in joint.graph.nodes]
    short = truncate_repeats.truncated_joint(joint, chain, 3)
    assert [n_.name for n_ in joint.graph.nodes] == before  # the full graph is untouched
    calls = _calls(short)
    # The chain's 3 layers each way, and any call outside the chain as it was (torch 2.11 traces
    # the first block, whose input is a graph input, as a body of its own).
    assert len(calls) == 2 * 3 + len(_calls(joint)) - 2 * n
    kept = {c.name for c in calls}
    assert {chain.forward[0].name, chain.forward[1].name, chain.forward[-1].name} <= kept
    assert {chain.backward[0].name, chain.backward[1].name, chain.backward[-1].name} <= kept
    # The last layer reads layer 1's output; layer 1's backward reads the last one's gradient.
    fw_last = next(c for c in calls if c.name == chain.forward[-1].name)
    assert any(a.target is operator.getitem and a.args[0].name == chain.forward[1].name
               for a in fw_last.args[2:] if isinstance(a, torch.fx.Node))
    bw_1 = next(c for c in calls if c.name == chain.backward[1].name)
    assert any(a.target is operator.getitem and a.args[0].name == chain.backward[-1].name
               for a in bw_1.args[2:] if isinstance(a, torch.fx.Node))
    # The left-out layers' parameter gradients are gone from the outputs (6 per block).
    out_full = next(iter(joint.graph.find_nodes(op="output"))).args[0]
    out_short = next(iter(short.graph.find_nodes(op="output"))).args[0]
    assert len(out_full) == len(out_short)
    assert sum(a is None for a in out_short) - sum(a is None for a in out_full) == 6 * (n - 3)


def test_an_op_between_layers_breaks_the_chain(monkeypatch):
    """Then there is no template: ``capture`` plans the flat graph (``_templates`` returns none)."""
    torch.manual_seed(0)
    model = Net(4, between=True)
    megacompile.mark_repeated_layers(model)
    joint = _joint_of(model, training_state_bytes(model), monkeypatch)
    assert len(_calls(joint)) >= 6 and truncate_repeats.find_repeat_chain(joint) is None


def test_plan_repeats_option_is_checked():
    assert parse_options({"device": "cpu", "plan_repeats": "flat"}).plan_repeats == "flat"
    with pytest.raises(OptionsError, match="plan_repeats='layered'.*'auto', 'template', 'flat'"):
        parse_options({"device": "cpu", "plan_repeats": "layered"})


def test_a_failing_template_plan_warns_and_the_flat_planner_plans(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a structure the template planner did not expect")

    monkeypatch.setattr(template_planner, "plan_with_templates", broken)
    torch.manual_seed(0)
    model = Net(6)
    reference = copy.deepcopy(model)
    megacompile.mark_repeated_layers(model)
    budget = int(training_state_bytes(model) * 0.3)
    compat.reset_dynamo()
    batch = _batch(torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match="short copies of the step failed .*RuntimeError: a structure"):
        loss = _compile(model, budget, "template")(*batch)
    eager_step, _ = make_training_step(reference, F.mse_loss, lr=1e-2)
    torch.testing.assert_close(loss, eager_step(*batch), rtol=1e-5, atol=0)
    plan = _plan_of_last_compile()
    assert plan.template is None and plan.peak_bytes <= budget


def test_host_activation_budget_takes_offloading_rungs_off_the_template_ladder():
    """The rungs' host bytes are extrapolated from the short copies like their peaks: with the
    cap at 0 the template planner takes a rung that offloads nothing, and still plans."""
    from megacompile.plan.flat_planner import Attempt

    def planned(**options):
        torch.manual_seed(0)
        model = Net(6)
        megacompile.mark_repeated_layers(model)
        step, _ = make_training_step(model, F.mse_loss, lr=1e-2)
        compat.reset_dynamo()
        torch.compile(step, backend="megatrain", options={
            "device": "cpu", "lowering": "eager", "memory_budget": int(training_state_bytes(model) * 0.4),
            "plan_repeats": "template", **options})(*_batch(torch.Generator().manual_seed(1)))
        record = next(r for r in reversed(COMPILED) if r.backward is not None)
        return record.plan, Attempt(record.plan, record.forward, record.backward, []).host_activation_bytes

    default, default_host = planned()
    capped, capped_host = planned(host_activation_budget=0)
    assert default.template is not None and default_host > 0, default.policy
    assert capped.template is not None and capped_host == 0, capped.policy


def test_the_extrapolated_step_time_is_the_full_builds(tmp_path):
    """Each short copy is priced with the host optimizer updating its own parameters, so what a
    layer adds is what it adds at full depth: the chosen plan's extrapolated step time is the
    one its full build is predicted at. Priced with the whole model's update, which overlaps the
    backward and here outlasts a short copy's device work, the layers' share was hidden (the
    extrapolation was 0.81x the full build's time; Llama-2-7B in bf16: 3.6x too cheap a layer)."""
    from megacompile.plan.hardware import get_profile, profile_to_json

    slow_host = dataclasses.replace(get_profile("h200"), name="h200, slow host AdamW", host_adamw_params_per_s=5e8)
    (tmp_path / "profile.json").write_text(profile_to_json(slow_host))
    plan = _planned_on_h200(0.3, depth=12, hardware=str(tmp_path / "profile.json"), overlap_optimizer=True)
    assert plan.template is not None, plan.reason
    assert plan.template["extrapolated_seconds"] == pytest.approx(plan.predicted_seconds, rel=0.02)


def test_the_fastest_fitting_candidate_is_built_first_whatever_it_recomputes():
    """The candidates of Llama-2-7B in bf16 at 60 GiB (8 x 4096 tokens, the H100 profile), as the
    template planner priced them (GiB, seconds, recomputed ops): offloading every activation is
    the smallest and bound by the host link, recompute-all recomputes most and is the fastest
    that fits. It is built first; the offloading mixes that fit follow by time."""
    GiB = 1 << 30

    def candidate(name, peak, seconds, recomputed, host=0.0):
        return template_planner.Priced(template_planner.Spec(name), (), peak * GiB, seconds, recomputed, host * GiB)

    priced = [candidate("keep", 233.5, 2.616, 448), candidate("offload (all layers)", 16.7, 9.734, 448, 239.8),
              candidate("recompute (all layers)", 31.3, 3.101, 2696),
              candidate("9 keep, 19 offload", 51.9, 8.200, 448, 200.6),
              candidate("19 keep, 9 offload", 165.2, 3.229, 448, 72.0)]
    order = [p.spec.name for p in template_planner.fastest_fitting(priced, 60 * GiB, None)]
    assert order == ["recompute (all layers)", "9 keep, 19 offload", "offload (all layers)"]
    # Within a host budget, the offloading ones are out.
    assert [p.spec.name for p in template_planner.fastest_fitting(priced, 60 * GiB, 100 * GiB)] == [
        "recompute (all layers)"]


def test_a_budget_under_recompute_alls_peak_is_met_by_a_per_layer_mix_as_fast_as_the_flat_planners():
    """Under recompute-all's peak the fastest plan that fits splits the repeated layers: the first
    streamed (replayed from an input kept on the host), the next recomputed, the last kept. The
    template planner prices every split from the uniform candidates' copies (what one layer of
    each policy adds) and builds the fastest that fits over the full graph: its extrapolated
    peak is the full build's, it fits, trains like eager and is within 5% of the flat planner's
    per-layer choice (Llama-2-7B in bf16 at 60 GiB: the same predicted step, compiled in about a
    third of the time; docs/results.md)."""
    plan = _template_plan_trains_like_eager(12, 0.15)
    assert plan.template is not None and plan.policy.startswith("per-layer ("), plan.reason
    assert plan.template["per_layer_mixes"] == (11 + 1) * (11 + 2) // 2 - 3  # 11 chained layers, uniform splits out
    assert abs(plan.template["extrapolated_peak"] - plan.peak_bytes) <= 0.05 * plan.peak_bytes
    policies = [plan.layer_costs[f"blocks.{i}"]["name"] for i in range(1, 12)]
    assert "recompute, layer input offloaded" in policies and policies == sorted(
        policies, key=["recompute, layer input offloaded", "recompute", "keep"].index)
    flat, _ = _planned(12, 0.15, "flat")
    assert flat.template is None and plan.predicted_seconds <= flat.predicted_seconds * 1.05


def test_alternating_bodies_make_a_chain_of_two_layer_units(monkeypatch):
    """Blocks of two kinds, alternating, are two bodies: the chain is counted in units of both,
    and a short copy keeps whole units (the first two and the last)."""
    torch.manual_seed(0)
    model = Net(10, alternate=True)
    megacompile.mark_repeated_layers(model)
    joint = _joint_of(model, training_state_bytes(model), monkeypatch)
    chain = truncate_repeats.find_repeat_chain(joint)
    assert chain.period == 2 and len(chain) >= 4 and len(chain.forward) == 2 * len(chain)
    bodies = [c.args[0].target for c in chain.forward]
    assert bodies[0] != bodies[1] and bodies == bodies[:2] * len(chain)
    short = truncate_repeats.truncated_joint(joint, chain, 3)
    assert len(_calls(short)) == 2 * 3 * 2 + len(_calls(joint)) - 2 * len(chain.forward)
    kept = {c.name for c in _calls(short)}
    assert {c.name for c in chain.forward[:4] + chain.forward[-2:]} <= kept
    assert not {c.name for c in chain.forward[4:-2]} & kept
    # The last unit reads the second unit's output.
    fw_last_unit = next(c for c in _calls(short) if c.name == chain.forward[-2].name)
    assert any(a.target is operator.getitem and a.args[0].name == chain.forward[3].name
               for a in fw_last_unit.args[2:] if isinstance(a, torch.fx.Node))


def test_alternating_layers_are_planned_in_units_as_fast_as_the_flat_planner():
    """Under a budget that needs some activations off the device, alternating blocks (Gemma 2 and 3
    alternate sliding-window and full-attention layers) are planned on copies of 3 and 4 units:
    the plan trains like eager, its extrapolated peak is the full build's, and it is within 5% of
    the flat planner's (Gemma 2 at 16 layers: the same predicted step; docs/results.md)."""
    plan = _template_plan_trains_like_eager(12, 0.2, alternate=True)
    assert plan.template is not None and plan.template["period"] == 2, plan.reason
    assert plan.template["template_layers"] == [6, 8] and "units of 2" in plan.reason
    assert abs(plan.template["extrapolated_peak"] - plan.peak_bytes) <= 0.05 * plan.peak_bytes
    torch.manual_seed(0)
    model = Net(12, alternate=True)
    megacompile.mark_repeated_layers(model)
    budget = int(training_state_bytes(model) * 0.2)
    compat.reset_dynamo()
    _compile(model, budget, "flat")(*_batch(torch.Generator().manual_seed(1)))
    flat = _plan_of_last_compile()
    assert flat.template is None and plan.predicted_seconds <= flat.predicted_seconds * 1.05


def test_among_equally_fast_candidates_the_one_holding_less_on_the_host_is_built_first():
    """Gemma-3-12B in bf16 (48 layers, 4 x 4096 tokens, 60 GiB, the H100 profile): streaming 42
    layers and recompute-all were predicted within a millisecond of each other, and the split that
    recomputes two ops fewer held 14.4 GiB of activations on the host. Within ``EQUALLY_FAST`` of
    the fastest, fewer host bytes go first; a candidate past that margin stays behind the faster."""
    GiB = 1 << 30

    def candidate(name, peak, seconds, recomputed, host=0.0):
        return template_planner.Priced(template_planner.Spec(name), (), peak * GiB, seconds, recomputed, host * GiB)

    priced = [candidate("streamed 42", 11.4, 3.5670, 6439, 14.4),
              candidate("recompute (all layers)", 25.8, 3.5672, 6441),
              candidate("streamed 47", 8.9, 3.5650, 6441, 16.9), candidate("keep 40", 55.0, 3.40, 400, 30.0)]
    # A candidate 4.6% faster than the rest: first, the rest by time.
    order = [p.spec.name for p in template_planner.fastest_fitting(priced, 60 * GiB, None)]
    assert order == ["keep 40", "streamed 47", "streamed 42", "recompute (all layers)"]
    # Without it the three are equally fast: the fewest host bytes first.
    order = [p.spec.name for p in template_planner.fastest_fitting(priced[:3], 60 * GiB, None)]
    assert order == ["recompute (all layers)", "streamed 42", "streamed 47"]
    # The flat planner's rule: the ladder took the split; recompute-all is off the ladder (more
    # recomputes at the same time) and holds nothing on the host.
    from types import SimpleNamespace

    from megacompile.plan import flat_planner

    def attempt(seconds, recomputed, peak, host):
        return SimpleNamespace(plan=SimpleNamespace(predicted_seconds=seconds, recomputed_ops=[0] * recomputed),
                               peak=peak * GiB, host_activation_bytes=host * GiB)
    ladder_choice, recompute_all, slower = attempt(3.567, 6439, 11.4, 14.4), attempt(3.567, 6441, 25.8, 0), \
        attempt(3.6, 448, 30.0, 0)
    assert flat_planner._least_on_host_as_fast_as(ladder_choice, [recompute_all, slower]) is recompute_all
    assert flat_planner._least_on_host_as_fast_as(ladder_choice, [slower]) is ladder_choice
