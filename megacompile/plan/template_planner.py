"""Planning repeated layers once: the candidate plans priced on short copies of the step.

The flat planner (``planner.plan_training``) builds each of its ~25 candidate plans over the
whole joint graph, so under a tight budget planning grows with depth (each build partitions
and passes all N layers). When the layers are marked repeats that chain
(``truncate_repeats``), the candidates here are plans that make the same decision for a value
in every repeated layer, and each is built on two short copies of the step (3 and 4 layers:
the first layers and the last one, with the glue). What one more layer adds (peak bytes,
predicted seconds, recomputed ops) is the difference between the two, so a candidate's
numbers at N layers are extrapolated linearly (each copy priced with the host optimizer
updating its own parameters, so that every lane grows with the layers as at full depth). The
fastest candidate whose extrapolated peak fits the budget is built over the full graph, once,
and checked against the budget with the same estimate the flat planner uses. If it does not
fit, the next fastest is built, and so on; after ``MAX_FULL_BUILDS`` misses the flat planner
takes over. Beside the candidates built on the copies, every split of the repeated layers among
keep, recompute and streamed (the flat planner's per-layer rungs) is priced from the uniform
ones without a build of its own (``_per_layer_mixes``). So the budget is
never trusted to an extrapolation: the plan that runs is one whose full-depth build fits.

Where keeping every activation fits (by the extrapolation), the flat planner is used: it
builds only the one or few plans of its first rungs, not its ladder.

Decisions for repeated layers are keyed by ``inline_regions.BODY_NODE`` (the body node a
value was copied from), the same in every layer and in every copy of the step; the glue's
by node name, which copies keep.
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from megacompile.core.node_info import BODY_NODE
from megacompile.core.units import format_bytes
from megacompile.plan.depth_extrapolation import extend_to_depth, per_layer_from_two_depths
from megacompile.plan.flat_planner import EQUALLY_FAST, Attempt, PlanMaker, saved_groups, solver_mixes
from megacompile.plan.solvers import SOLVERS, Option
from megacompile.plan.streamed_layers import STREAMED, STREAMING_REASON, layer_inputs, mixed_spec
from megacompile.plan.training_plan import PlanSpec

# The two short copies of the step: k layers each (the chain's first k-1 and its last).
DEPTHS = (3, 4)
# Chains at least this long are planned on the template (option plan_repeats).
MIN_LAYERS = {"auto": 8, "template": DEPTHS[-1] + 1}
# Candidates whose extrapolated peak fits that are built over the full graph (fastest first)
# before the flat planner takes over.
MAX_FULL_BUILDS = 3


@dataclasses.dataclass
class Template:
    """One short copy of the step, ready to build plans on."""

    k: int  # units of the chain (layers, where the chain's period is one layer)
    maker: PlanMaker
    joint: fx.GraphModule
    units: list[list[str]]  # the copy's repeated layers (module paths), grouped by unit


@dataclasses.dataclass
class Spec:
    """A plan stated without naming layers: per body node for the repeated layers, per node
    name for the glue, so it can be built on a template and on the full graph alike."""

    name: str
    default: str = "keep"
    by_origin: dict = dataclasses.field(default_factory=dict)  # BODY_NODE -> (policy, reason)
    by_name: dict = dataclasses.field(default_factory=dict)  # glue node name -> (policy, reason)

    def build(self, maker: PlanMaker, joint: fx.GraphModule, snapshots: bool = False) -> Attempt:
        per_value, reasons = {}, {}
        for node in joint.graph.nodes:
            origin = node.meta.get(BODY_NODE)
            chosen = self.by_origin.get(origin) if origin is not None else self.by_name.get(node.name)
            if chosen is not None:
                per_value[node.name], reasons[node.name] = chosen
        return maker.make(PlanSpec(name=self.name, default_policy=self.default, value_policy=per_value,
                                   value_reason=reasons), snapshots=snapshots)


@dataclasses.dataclass
class Priced:
    """A spec built on both templates and extrapolated to the full depth."""

    spec: Spec
    attempts: tuple  # one Attempt per template (none for a per-layer mix, priced from the uniform ones)
    peak: float
    seconds: float
    recomputed: float
    host_activation_bytes: float = 0.0
    counts: dict | None = None  # a per-layer mix: repeated layers per policy (MIX_POLICIES)


def _extrapolate(values: list[float], depths: tuple, n: int) -> float:
    """A quantity at n layers, from the longer copy on by what one more layer added between them."""
    return extend_to_depth(values[-1], [(n - depths[-1], per_layer_from_two_depths(values, depths))])


def _price(spec: Spec, templates: list[Template], n: int) -> Priced:
    attempts = tuple(spec.build(t.maker, t.joint) for t in templates)
    for t, a in zip(templates, attempts):
        a.plan.predicted_seconds = t.maker.predict_seconds(a)
    depths = tuple(t.k for t in templates)
    return Priced(
        spec, attempts,
        peak=_extrapolate([a.peak for a in attempts], depths, n),
        seconds=_extrapolate([a.plan.predicted_seconds for a in attempts], depths, n),
        recomputed=_extrapolate([len(a.plan.recomputed_ops) for a in attempts], depths, n),
        host_activation_bytes=_extrapolate([a.host_activation_bytes for a in attempts], depths, n),
    )


def _uniform_mixes(keep: Priced, floor: float, template_floor: int, template: Template, profile, options,
                   n: int) -> list[Spec]:
    """Per-activation plans with one decision per body node: the solver's picks over one
    repeated layer's saved values (counted n times) and the glue's, for memory targets from
    keep's extrapolated peak down to the smallest uniform plan's."""
    attempt = keep.attempts[-1]
    groups = saved_groups(attempt, template.joint, profile, options.recompute != "never",
                          options.prefetch_depth, template_floor)
    fw = {node.name: node for node in attempt.forward.graph.nodes}
    # The template's second unit stands for every unit: its neighbours on both sides are units
    # too, as for all but the first and last of the full depth. A body that appears several
    # times in a unit gets one decision, counted as often as it appears.
    middle = set(template.units[1])
    times: dict[tuple, int] = {}  # a body's saved group (by its members' body nodes) -> how often in the unit
    first_of: dict[tuple, object] = {}
    for g in groups:
        if g.layer in middle and fw[g.root].meta.get(BODY_NODE) is not None:
            key = tuple(fw[m].meta.get(BODY_NODE) for m in g.members)
            times[key] = times.get(key, 0) + 1
            first_of.setdefault(key, g)
    representative = list(first_of.values())
    glue = [g for g in groups if fw[g.root].meta.get(BODY_NODE) is None]
    if not representative and len(glue) < len(groups):
        # The units' names (call sites) and the groups' layers (annotate's) disagree: deciding
        # for the glue alone would leave every repeated layer kept. The flat planner plans.
        raise ValueError(f"the copy's middle unit {sorted(middle)} names no layer of its saved values")
    counted = [n * times[key] for key in first_of]
    items = [[Option(o.name, o.memory_saved * c, o.time_cost * c) for o in g.options]
             for g, c in zip(representative, counted)]
    items += [list(g.options) for g in glue]
    chosen_for = representative + glue
    if not items:
        return []
    specs = []
    for picks in solver_mixes(SOLVERS[options.solver], items, max(0.0, keep.peak - floor)):
        by_origin, by_name = {}, {}
        for g, j in zip(chosen_for, picks):
            target = by_origin if g in representative else by_name
            for member in g.members:
                key = fw[member].meta.get(BODY_NODE) if g in representative else member
                target[key] = (g.options[j].name, g.reason(j) + (" (the same in every repeated layer)"
                                                                    if g in representative else ""))
        counts = {p: sum(1 for g, j in zip(chosen_for, picks) if g.options[j].name == p)
                  for p in ("keep", "offload", "recompute")}
        specs.append(Spec("per-activation, every repeated layer alike ("
                          + ", ".join(f"{c} {p}" for p, c in counts.items() if c) + ")",
                          by_origin=by_origin, by_name=by_name))
    return specs


def _streamed_all(recompute: Priced, template: Template) -> Spec:
    """Every layer streamed (the flat planner's streaming minimum, stated per body node and glue
    name): recompute-all with every value it saves offloaded, so a layer is replayed in the
    backward from its input, which waits on the host."""
    nodes = {n.name: n for n in template.joint.graph.nodes}
    by_origin, by_name = {}, {}
    for name in recompute.attempts[-1].plan.saved_values:
        node = nodes.get(name)
        if node is None:
            continue
        origin = node.meta.get(BODY_NODE)
        if origin is not None:
            by_origin[origin] = ("offload", STREAMING_REASON)
        else:
            by_name[name] = ("offload", STREAMING_REASON)
    return Spec("recompute, layer inputs offloaded (all layers)", default="recompute", by_origin=by_origin,
                by_name=by_name)


# Per-layer mixes: how many repeated layers are kept, recomputed and streamed (the flat
# planner's per-layer rungs, whose best plans at Llama-2-7B in bf16 keep some layers and stream
# the rest).
MIX_POLICIES = ("keep", "recompute", STREAMED)


def _quantities(a) -> tuple:
    return a.peak, a.plan.predicted_seconds, len(a.plan.recomputed_ops), a.host_activation_bytes


def _per_layer_mixes(uniform: dict[str, Priced], depths: tuple, n: int, period: int = 1) -> list[Priced]:
    """Every split of the n repeated layers among keep, recompute and streamed that is not
    uniform, priced from the uniform candidates' copies: what one layer of each policy adds
    (the two copies' difference), counted per policy, on top of recompute-all's fixed part (a
    mix recomputes the glue, the layers outside the chain, as recompute-all does). An
    estimate: the chosen mix is built over the full graph and checked as every candidate is,
    and a miss corrects the estimate of the next (``plan_with_templates``). n counts the chain's
    units; the names count layers (``period`` per unit)."""
    on_copies = {policy: [_quantities(a) for a in priced.attempts] for policy, priced in uniform.items()}
    slope = {policy: [per_layer_from_two_depths([q[i] for q in rows], depths) for i in range(4)]
             for policy, rows in on_copies.items()}
    fixed = [on_copies["recompute"][-1][i] - depths[-1] * slope["recompute"][i] for i in range(4)]
    out = []
    for kept in range(n + 1):
        for recomputed in range(n - kept + 1):
            counts = {"keep": kept, "recompute": recomputed, STREAMED: n - kept - recomputed}
            if max(counts.values()) == n:
                continue  # uniform: priced from its own copies
            value = [fixed[i] + sum(c * slope[p][i] for p, c in counts.items()) for i in range(4)]
            label = ", ".join(f"{'streamed' if p == STREAMED else p} {c * period}" for p, c in counts.items() if c)
            out.append(Priced(Spec(f"per-layer ({label})"), (), *value, counts=counts))
    return out


def _mix_layers(mix: Priced, units: list[list[str]]) -> dict[str, str]:
    """Each repeated layer's policy in a mix (counted in units; every layer of a unit alike):
    the first units streamed, the next recomputed, the last kept (their backward runs first,
    with nothing to replay or load, while the earlier layers' inputs come back). The glue is
    recomputed (``mixed_spec``'s default there)."""
    order = [STREAMED] * mix.counts[STREAMED] + ["recompute"] * mix.counts["recompute"] + ["keep"] * mix.counts["keep"]
    return {layer: policy for unit, policy in zip(units, order) for layer in unit}


def fastest_fitting(priced: list[Priced], budget: int, host_budget: int | None) -> list[Priced]:
    """The candidates whose extrapolated peak fits the budget (and their host bytes the host's),
    fastest first; among the equally fast (``EQUALLY_FAST``) the one holding fewer activation
    bytes on the host first; ties go to the one that recomputes less, then to the smaller peak.

    Not the highest fitting rung of the flat planner's ladder, along which the recompute count
    may only fall as the peak grows: where the smallest plan offloads every activation (few
    recomputes, bound by the host link), recompute-all never made that ladder, and a far slower
    offloading mix was built instead (Llama-2-7B in bf16; docs/results.md)."""
    fitting = [p for p in priced
               if p.peak <= budget and (host_budget is None or p.host_activation_bytes <= host_budget)]
    if not fitting:
        return []
    fastest = min(p.seconds for p in fitting)

    def order(p: Priced) -> tuple:
        equally_fast = p.seconds <= fastest * (1 + EQUALLY_FAST)
        return (not equally_fast, p.host_activation_bytes if equally_fast else 0, p.seconds, p.recomputed, p.peak)
    return sorted(fitting, key=order)


def _deeper_prefetch_may_pay(rung: Priced, template: Template) -> bool:
    """Whether the rung's deeper-prefetch variant is worth a build over the full graph: on the
    longer short copy, some load stalls the compute lane and prefetching it one layer further
    ahead is predicted faster. (A full build of the variant costs what the rung's own did; on
    the benchmark Llama it was built at every depth from 16 layers and never taken.)"""
    short = rung.attempts[-1]
    deeper = template.maker.deeper_prefetch(short)
    return deeper is not None and template.maker.predict_seconds(deeper) < short.plan.predicted_seconds


def plan_with_templates(full: PlanMaker, full_joint: fx.GraphModule, templates: list[Template], n: int,
                        options, profile, repeated_layers: list[list[str]] | None = None) -> Attempt | None:
    """The plan for the full graph, or None where the flat planner should plan it (keeping
    every activation fits; recompute='always'; no rung's full-depth build fits).
    ``repeated_layers``: the full graph's names of the repeated layers in forward order, grouped
    by the chain's n units (per-layer mixes are priced only where they are known)."""
    budget = options.memory_budget
    if budget is None or options.recompute == "always":
        return None
    period = len(templates[-1].units[0])
    described = f"{n} repeated layers" if period == 1 else f"{n * period} repeated layers ({n} units of {period})"
    keep = _price(Spec("keep"), templates, n)
    if keep.peak <= budget:
        return None  # the flat planner's first rungs: a few builds, no ladder
    priced = [keep, _price(Spec("offload (all layers)", default="offload"), templates, n)]
    recompute = None
    if options.recompute != "never":
        recompute = _price(Spec("recompute (all layers)", default="recompute"), templates, n)
        priced.append(recompute)
    floor = min(p.peak for p in priced)
    template_floor = min(p.attempts[-1].peak for p in priced)
    mixes = _uniform_mixes(keep, floor, template_floor, templates[-1], profile, options, n)
    priced += [_price(spec, templates, n) for spec in mixes]
    uniform = {"keep": keep}
    if (recompute is not None and recompute.attempts[-1].plan.saved_values and repeated_layers
            and len(repeated_layers) == n):
        uniform.update(recompute=recompute)
        uniform[STREAMED] = _price(_streamed_all(recompute, templates[-1]), templates, n)
        priced.append(uniform[STREAMED])
    on_copies = len(priced)
    if len(uniform) == len(MIX_POLICIES):
        priced += _per_layer_mixes(uniform, tuple(t.k for t in templates), n, period)
    tried: list[Priced] = []
    inputs = None  # the repeated layers' inputs (streamed_layers.layer_inputs), from recompute-all's full build
    while len(tried) < MAX_FULL_BUILDS:
        rung = next((p for p in fastest_fitting(priced, budget, options.host_activation_budget)
                     if not any(p is t for t in tried)), None)
        if rung is None:
            break
        tried.append(rung)
        if rung.counts is None:
            # Built with inspect's snapshots: it is most likely the plan that runs, and capture
            # would otherwise build it a second time to take them.
            attempt = rung.spec.build(full, full_joint, snapshots=True)
        else:
            if inputs is None:
                inputs = layer_inputs(Spec("recompute (all layers)", default="recompute").build(full, full_joint),
                                      [layer for unit in repeated_layers for layer in unit])
            per_layer = _mix_layers(rung, repeated_layers)
            attempt = full.make(mixed_spec(rung.spec.name, per_layer, inputs, default="recompute"), snapshots=True)
            attempt.plan.layer_costs = {layer: {"name": p} for layer, p in per_layer.items()}
        if not full.fits(attempt):
            if rung.counts is not None:
                # The mixes share one estimate: what it missed by here it likely misses by for the others.
                for p in priced:
                    if p.counts is not None:
                        p.peak += max(0, attempt.peak - rung.peak)
                        p.host_activation_bytes += max(0, attempt.host_activation_bytes - rung.host_activation_bytes)
            continue
        attempt.plan.predicted_seconds = full.predict_seconds(attempt)
        shown_by = [rung] if rung.counts is None else [uniform[p] for p, c in rung.counts.items() if c]
        may_pay = any(_deeper_prefetch_may_pay(r, templates[-1]) for r in shown_by)
        chosen = full.with_tuned_prefetch(attempt) if may_pay else attempt
        builds = full.builds  # the rungs tried, recompute-all for the mixes' inputs, a deeper-prefetch variant
        unit = "unit" if period > 1 else "repeated layer"
        per = "unit" if period > 1 else "layer"
        chosen.plan.reason = (
            f"keeping every activation needs about {format_bytes(keep.peak)} (extrapolated) > budget "
            f"{format_bytes(budget)}; {described} planned on {len(templates)} short copies of the step "
            f"({' and '.join(str(t.k * period) for t in templates)} layers): {on_copies} candidates deciding alike "
            f"for every {unit}, priced there and extrapolated, and {len(priced) - on_copies} per-{per} splits "
            f"among keep, recompute and streamed priced from them; the fastest whose extrapolated peak fits was "
            f"built over the full graph ({builds} full build(s)) and fits at {format_bytes(chosen.peak)} "
            f"(predicted {chosen.plan.predicted_seconds * 1e3:.3f} ms/step, {options.solver} solver)")
        chosen.plan.template = {
            "repeated_layers": n * period, "period": period, "template_layers": [t.k * period for t in templates],
            "candidates": on_copies,
            "per_layer_mixes": len(priced) - on_copies, "full_builds": builds, "extrapolated_peak": int(rung.peak),
            "extrapolated_seconds": rung.seconds,
        }
        return chosen
    return None
