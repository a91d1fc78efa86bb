"""The planner: one device budget; keep / offload / recompute per layer or per saved
activation, and which parameters stay resident.

``plan_training`` searches for the fastest plan that fits, using the real pipeline to check
each candidate (``build`` partitions the joint graph under a plan, runs the passes and
estimates the peak), so a chosen plan's predicted peak is the one the runtime will see:

1. Keep everything with every parameter both passes read resident. If it fits, that is the
   plan: no recompute, no activation offload.
2. Keep every activation with parameters streamed. If it fits, the smallest parameters both
   passes read stay resident (``_partial_residency``: the longest smallest-first prefix that
   fits), the rest stream.
3. Otherwise build offload-all and recompute-all, then solver-chosen mixes (``options.solver``:
   exact or greedy, see ``solvers.py``) for several memory targets, at two granularities:
   per layer (the coarse fallback) and per saved activation (``saved_groups``: one item per
   storage group, each option priced by the cost model and by the bytes it frees at the keep
   plan's peaks). All are built and priced with the cost model's step time; a ladder along
   which time falls and recompute never rises as the peak grows keeps the useful ones, and
   the last rung within the budget wins. Rungs within the budget whose loads keep the
   compute lane waiting are also built with those loads prefetched a layer deeper. The
   candidates do not depend on the budget, so a larger budget only moves up the ladder.
4. Under those: the streaming minimum (every layer replayed from its input, the inputs on
   the host: ``streamed_layers.streaming_minimum_spec``) and per-layer mixes in which some
   layers are kept or recomputed and the others streamed (``_streamed_mixes``), drawn into
   the same ladder; such mixes above recompute-all's peak too (layers kept where recomputed
   layers' boundaries leave no room). If none fits, ``BudgetError`` names the smallest peak.

Decisions and their reasons land in ``NodeInfo.decision`` / ``reason`` (shown by inspect);
the choices are in ``TrainingPlan.layer_policy`` / ``value_policy`` / ``resident`` and their
prices in ``layer_costs`` / ``value_reason`` / ``resident_reason``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch.fx as fx

from megacompile.core import ops
from megacompile.core.enums import Policy
from megacompile.core.errors import BudgetError
from megacompile.core.host_ops import is_device_compute
from megacompile.core.node_info import has_info, info, is_view_node, tensor_nbytes_hint
from megacompile.core.units import format_bytes
from megacompile.passes import facts_after
from megacompile.passes.recompute import SavedValueWalk
from megacompile.passes.stream_parameters import layer_runs
from megacompile.plan.cost_model import HostCastsServed, annotate_costs, cost, is_cpu_standin, simulate, step_time
from megacompile.plan.memory_estimate import storage_root
from megacompile.plan.solvers import SOLVERS, Option
from megacompile.plan.streamed_layers import (
    STREAMED,
    layer_input_bytes,
    layer_inputs,
    mixed_spec,
    streaming_minimum_spec,
)
from megacompile.plan.streaming_floor import StreamingFloor, streaming_floor
from megacompile.plan.training_plan import PlanSpec, TrainingPlan


@dataclasses.dataclass
class Attempt:
    plan: TrainingPlan
    forward: fx.GraphModule
    backward: fx.GraphModule
    snapshots: list

    @property
    def peak(self) -> int:
        return self.plan.peak_bytes

    @property
    def host_activation_bytes(self) -> int:
        """Bytes of activations the forward puts on the host for the backward: its copies of the
        values the plan offloads (not the step's outputs)."""
        return sum(info(n).nbytes_hint for n in self.forward.graph.nodes
                   if n.op == "call_function" and n.target is ops.offload and has_info(n)
                   and isinstance(n.args[0], fx.Node) and has_info(n.args[0])
                   and info(n.args[0]).decision == "offload")


def _saved_device_bytes_by_layer(attempt: Attempt) -> dict[str, int]:
    """Device bytes the forward hands to the backward, per layer, by storage: a saved view
    counts its base's bytes (once, however many views of it are saved)."""
    out: dict[str, int] = {}
    saved = set(attempt.plan.saved_values)
    memo: dict = {}
    roots: set = set()
    for node in attempt.forward.graph.nodes:
        if node.name in saved and has_info(node) and info(node).role == "compute":
            root = storage_root(node, memo)
            if root in roots or not has_info(root) or info(root).placement != "device" or root.target is ops.load:
                continue
            roots.add(root)
            if info(root).layer:
                out[info(root).layer] = out.get(info(root).layer, 0) + info(root).nbytes_hint
    return out


def _forward_seconds_by_layer(gm: fx.GraphModule, profile) -> dict[str, float]:
    """What replaying each layer's forward costs, by the cost model (roofline + launch)."""
    annotate_costs(gm, profile)
    out: dict[str, float] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and has_info(node) and info(node).layer and info(node).role == "compute":
            out[info(node).layer] = out.get(info(node).layer, 0.0) + cost(node).time_s
    return out


@dataclasses.dataclass
class SavedGroup:
    """Saved activations that share one device storage (a value and its saved views): one
    decision for all of them, priced by the storage's bytes (views are not free to keep)."""

    root: str
    layer: str | None
    members: list[str]
    nbytes: int
    options: list[Option]
    notes: list[str]

    def reason(self, j: int) -> str:
        return self.notes[j]


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} us"


def _freed_at_peak(keep: Attempt, groups: dict, prefetch_depth: int, floor: int) -> dict[str, tuple[int, int]]:
    """Bytes each group frees at the keep plan's peaks, if offloaded and if recomputed.

    Freeing a saved activation lowers the peak only where it would otherwise be live: an
    offloaded one comes back ``prefetch_depth`` layers before the backward reads it, a
    recomputed one is replayed just before, so neither helps a peak in the layers next to
    its own. Checked at the peak of each graph (forward, backward) that exceeds ``floor``;
    the smaller of the two counts.
    """
    out = {root: [g.nbytes, g.nbytes] for root, g in groups.items()}
    est = keep.plan.forward
    if est is not None and est.peak_bytes > floor:
        nodes = list(keep.forward.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        peak_at = next((i for i, n in enumerate(nodes) if n.name == est.peak_node), len(nodes))
        by_name = {n.name: n for n in nodes}
        for root, g in groups.items():
            # Not saved, it dies after its last forward reader (views included).
            last = 0
            stack = [by_name[m] for m in g.members if m in by_name] + ([by_name[root]] if root in by_name else [])
            while stack:
                cur = stack.pop()
                for u in cur.users:
                    if u.op == "output" or u.target in (ops.offload, ops.evict, ops.wait):
                        continue
                    last = max(last, pos[u])
                    if is_view_node(u):
                        stack.append(u)
            born = pos[by_name[root]] if root in by_name else 0
            if last >= peak_at or born > peak_at:
                out[root] = [0, 0]  # live at the forward's peak either way, or not yet born
    est = keep.plan.backward
    if est is not None and est.peak_bytes > floor:
        nodes = list(keep.backward.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        peak_at = next((i for i, n in enumerate(nodes) if n.name == est.peak_node), len(nodes))
        compute = [n for n in nodes if n.op == "call_function" and not ops.is_memory_op(n)]
        cpos = {n: i for i, n in enumerate(compute)}
        runs = [start for _, start in layer_runs(compute)]
        by_name = {n.name: n for n in nodes if n.op == "placeholder"}
        for root, g in groups.items():
            readers, stack = [], [by_name[m] for m in g.members if m in by_name]
            while stack:
                cur = stack.pop()
                for u in cur.users:
                    if u in cpos:
                        readers.append(u)
                        if is_view_node(u):
                            stack.append(u)
            if not readers:
                continue
            first = min(readers, key=pos.__getitem__)
            last = max(pos[u] for u in readers)
            if last < peak_at:
                out[root] = [0, 0]  # dead before the peak already
                continue
            run = max((k for k, start in enumerate(runs) if start <= cpos[first]), default=0)
            reload_at = pos[compute[runs[max(0, run - prefetch_depth)]]] if runs else pos[first]
            freed = out[root]
            out[root] = [freed[0] if reload_at > peak_at else 0, freed[1] if pos[first] > peak_at else 0]
    return {root: (v[0], v[1]) for root, v in out.items()}


def saved_groups(keep: Attempt, joint: fx.GraphModule, profile, allow_recompute: bool,
                 prefetch_depth: int = 1, floor: int = 0) -> list[SavedGroup]:
    """The keep plan's saved device activations, grouped by storage, each with its options.

    - keep: frees nothing, costs nothing;
    - offload: frees the storage, costs its copies out and back (bytes of every saved view
      each way) where the compute of its layer does not hide them (all of it when copies
      are synchronous, as on the CPU stand-in);
    - recompute: frees the storage less whatever the replay makes the forward save instead,
      costs the cost-model time of the ops replayed from values that stay saved.
    """
    fw = keep.forward
    annotate_costs(fw, profile)
    seconds = {n.name: (cost(n).time_s if cost(n) else 0.0) for n in fw.graph.nodes if n.op == "call_function"}
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    memo: dict = {}
    saved = set(keep.plan.saved_values)
    groups: dict[str, SavedGroup] = {}
    for node in fw.graph.nodes:
        if node.name not in saved or node.op == "placeholder" or node.target is ops.load:
            continue
        if not has_info(node) or info(node).placement != "device":
            continue
        root = storage_root(node, memo)
        if root.op == "placeholder" or root.target is ops.load or info(root).nbytes_hint <= 0:
            continue
        g = groups.setdefault(root.name, SavedGroup(root.name, info(root).layer, [], info(root).nbytes_hint, [], []))
        g.members.append(node.name)

    # How much of each layer's copies its compute hides (the keep plan's lanes).
    exposure: dict[str | None, float] = {}
    if not is_cpu_standin(profile):
        timeline = step_time(keep.forward, keep.backward, profile, optimizer_param_bytes=0)
        link = 1.0 / profile.d2h_bandwidth + 1.0 / profile.h2d_bandwidth
        for g in groups.values():
            exposure[g.layer] = exposure.get(g.layer, 0.0) + g.nbytes * link
        for layer, need in list(exposure.items()):
            row = timeline.per_layer.get(layer or "(glue)")
            slack = max(0.0, row.compute_s - row.h2d_s - row.d2h_s) if row else 0.0
            exposure[layer] = max(0.0, need - slack) / need if need > 0 else 1.0

    at_peak = _freed_at_peak(keep, groups, prefetch_depth, floor)
    walk = SavedValueWalk.of(joint)
    joint_nodes = {n.name: n for n in joint.graph.nodes}
    group_of_root = set(groups)
    needed = set(walk.needed)
    out = []
    for g in groups.values():
        link_bytes = sum(tensor_nbytes_hint(fw_nodes[m].meta.get("val")) for m in g.members)
        copy_s = link_bytes / profile.d2h_bandwidth + link_bytes / profile.h2d_bandwidth
        exposed = exposure.get(g.layer, 1.0)
        offload_frees, recompute_frees = at_peak[g.root]
        g.options = [Option("keep", 0, 0.0), Option("offload", offload_frees, copy_s * exposed)]
        g.notes = ["", ""]
        hidden = f", {1 - exposed:.0%} hidden behind compute" if exposed < 1.0 else ""
        g.notes[1] = (f"planner: offload frees {format_bytes(g.nbytes)} ({format_bytes(offload_frees)} at the peak) "
                      f"for {_us(copy_s)} of copies each way ({link_bytes} B){hidden}")
        members = [joint_nodes[m] for m in g.members if m in joint_nodes]
        if allow_recompute and len(members) == len(g.members):
            stays, _, marks = walk.walk({}, "keep", {m: "recompute" for m in g.members}, start=members)
            if not any(m in stays for m in members):
                replayed = [n for n, (d, _) in marks.items() if d == "recompute"]
                replay_s = sum(seconds.get(n.name, 0.0) for n in replayed)
                extra_roots = set()
                for n in stays:
                    fn = fw_nodes.get(n.name)
                    if fn is None or n.op == "placeholder" or n.target is ops.load or n in needed:
                        continue
                    r = storage_root(fn, memo)
                    if r.name not in group_of_root:
                        extra_roots.add(r)
                extra = sum(info(r).nbytes_hint for r in extra_roots)
                if g.nbytes - extra > 0:
                    kernels = sum(1 for n in replayed if seconds.get(n.name, 0.0) > 0)
                    frees = max(0, min(recompute_frees, g.nbytes - extra))
                    g.options.append(Option("recompute", frees, replay_s))
                    g.notes.append(f"planner: recompute frees {format_bytes(g.nbytes - extra)} "
                                   f"({format_bytes(frees)} at the peak) for {_us(replay_s)} replaying {kernels} "
                                   f"op(s) from saved values")
        cheapest = min(g.options[1:], key=lambda o: (o.memory_saved == 0, o.time_cost))
        g.notes[0] = (f"planner: kept on the device ({format_bytes(g.nbytes)}; cheapest alternative "
                      f"{cheapest.name} at {_us(cheapest.time_cost)})")
        out.append(g)
    return out


def _partial_residency(keep: Attempt, hot: list[str], budget: int | None, make, predict_seconds) -> Attempt:
    """Keeping every activation fits, but not with every parameter both passes read resident:
    keep the smallest of those resident (norms, biases, the head of a small vocabulary), as
    many as fit. Smallest first, a prefix of one fixed order: a larger budget keeps a superset
    resident, so step time and recompute never grow with the budget."""
    sizes: dict[str, int] = {}
    for node in keep.forward.graph.nodes:
        if node.op == "placeholder" and has_info(node) and info(node).source in hot:
            sizes[info(node).source] = info(node).nbytes_hint
    order = sorted((p for p in hot if p in sizes), key=lambda p: (sizes[p], p))
    if not order:
        return keep
    slack = budget - keep.peak
    # Each resident parameter adds at most its bytes at any point of the step: this prefix fits.
    lo = 0
    while lo < len(order) and sum(sizes[p] for p in order[: lo + 1]) <= slack:
        lo += 1
    hi = len(order) - 1  # all of them (the first rung) did not fit

    def attempt(k: int) -> Attempt:
        chosen = order[:k]
        reasons = {p: (f"small and read by both passes ({format_bytes(sizes[p])}): one load per step instead "
                       f"of two; {k} of {len(order)} such parameters fit the budget, smallest first")
                   for p in chosen}
        return make(PlanSpec(name=f"keep (parameters resident: {k} of {len(order)})", resident=chosen,
                             resident_reason=reasons))

    best = attempt(lo) if lo else None
    if best is not None and best.peak > budget:
        best, lo = None, 0
    # The estimate is an upper bound; larger prefixes may fit too (their peak grows with k).
    while lo < hi:
        mid = (lo + hi + 1) // 2
        a = attempt(mid)
        if a.peak <= budget:
            best, lo = a, mid
        else:
            hi = mid - 1
    if best is None:
        return keep
    best.plan.predicted_seconds = predict_seconds(best)
    best.plan.reason = (f"everything fits with activations kept but not with all {len(order)} parameters read by "
                        f"both passes resident; the {lo} smallest stay resident (one load each per step instead "
                        f"of two), the rest stream")
    return best


class PlanMaker:
    """Builds plans with one ``build`` (a joint graph's) and prices them: what every planner
    (this module's, ``template_planner``) needs around the pipeline."""

    def __init__(self, build: Callable, options, profile, predict_seconds: Callable[[Attempt], float]) -> None:
        self.build, self.options, self.profile, self.predict_seconds = build, options, profile, predict_seconds
        self.budget = options.memory_budget
        self.calls_before_backward = options.calls_before_backward
        self.host_budget = options.host_activation_budget
        self.builds = 0  # plans built so far (what planning costs grows with it)

    def make(self, spec: PlanSpec, snapshots: bool = False) -> Attempt:
        """Builds ``spec`` under this maker's budget."""
        plan = TrainingPlan(spec.replace(budget=self.budget, calls_before_backward=self.calls_before_backward))
        # Only a plan likely to be chosen as built is built with inspect's snapshots; the
        # caller builds the chosen plan again with them if it has none.
        self.builds += 1
        return self.build(plan, snapshots=True) if snapshots else self.build(plan)

    def fits(self, a: Attempt) -> bool:
        return (self.budget is None or a.peak <= self.budget) and self.fits_host(a)

    def fits_host(self, a: Attempt) -> bool:
        """Its activations on the host within ``host_activation_budget``."""
        return self.host_budget is None or a.host_activation_bytes <= self.host_budget

    def deeper_prefetch(self, a: Attempt) -> Attempt | None:
        """``a`` with every streamed value whose load stalls the compute lane (by the cost
        model's lane simulation) prefetched one layer further ahead, or None if none stalls."""
        stalls = _load_stalls(a, self.profile, self.options.precision, self.options.overlaps_optimizer)
        if not stalls:
            return None
        p = a.plan
        prefetch, reasons = dict(p.prefetch), dict(p.prefetch_reason)
        for source, stall in stalls.items():
            depth = p.prefetch.get(source, self.options.prefetch_depth)
            if depth >= _MAX_PREFETCH:
                continue
            prefetch[source] = depth + 1
            reasons[source] = (f"prefetched {depth + 1} layers ahead: at depth {depth} the compute lane would wait "
                               f"{_us(stall)} for this load (cost model)")
        if prefetch == p.prefetch:
            return None
        deeper = self.make(p.spec.replace(name=f"{p.policy}, deeper prefetch for {len(stalls)} value(s)",
                                          prefetch=prefetch, prefetch_reason=reasons))
        deeper.plan.layer_costs = dict(p.layer_costs)
        return deeper

    def with_tuned_prefetch(self, a: Attempt) -> Attempt:
        """The faster of ``a`` and ``a`` with deeper prefetch, if that fits the budget."""
        deeper = self.deeper_prefetch(a)
        if deeper is None or not self.fits(deeper):
            return a
        if a.plan.predicted_seconds is None:
            a.plan.predicted_seconds = self.predict_seconds(a)
        deeper.plan.predicted_seconds = self.predict_seconds(deeper)
        if deeper.plan.predicted_seconds >= a.plan.predicted_seconds:
            return a
        deeper.plan.reason = a.plan.reason
        return deeper


# The uniform plans that both the ladder and ``some_plan_fits`` build.
_RECOMPUTE = PlanSpec(name="recompute", default_policy=Policy.RECOMPUTE)  # option recompute="always"
_OFFLOAD_ALL = PlanSpec(name="offload (all layers)", default_policy=Policy.OFFLOAD)
_RECOMPUTE_ALL = PlanSpec(name="recompute (all layers)", default_policy=Policy.RECOMPUTE)


def some_plan_fits(build: Callable[[TrainingPlan], Attempt], options, profile,
                   predict_seconds: Callable[[Attempt], float]) -> bool:
    """True where ``plan_training`` is sure to find a plan within both budgets, known from the
    few candidates with the smallest peaks (offload-all, recompute-all, the streaming minimum)
    rather than the whole ladder: the ladder's lowest rung is its smallest candidate that fits
    the host, so where one of these fits, a rung does. False means not known: a mix streaming
    fewer layers may still fit a small host_activation_budget (plan_training decides)."""
    maker = PlanMaker(build, options, profile, predict_seconds)
    if options.recompute == "always":
        return maker.fits(maker.make(_RECOMPUTE))
    if maker.fits(maker.make(_OFFLOAD_ALL)):
        return True
    if options.recompute == "never":
        return False
    recompute_all = maker.make(_RECOMPUTE_ALL)
    if maker.fits(recompute_all):
        return True
    return bool(recompute_all.plan.saved_values) and maker.fits(maker.make(streaming_minimum_spec(recompute_all)))


def plan_training(
    build: Callable[[TrainingPlan], Attempt],
    layers: list[str],
    options,
    profile,
    predict_seconds: Callable[[Attempt], float],
    resident_candidates: list[str] | None = None,
    joint: fx.GraphModule | None = None,
) -> Attempt:
    budget = options.memory_budget
    allow_recompute = options.recompute != "never"
    maker = PlanMaker(build, options, profile, predict_seconds)
    make, fits, deeper_prefetch, with_tuned_prefetch = (maker.make, maker.fits, maker.deeper_prefetch,
                                                        maker.with_tuned_prefetch)

    if options.recompute == "always":
        a = make(_RECOMPUTE)
        if fits(a):
            return a
        keep = make(PlanSpec(name="keep"))
        _raise([a], budget, _floor(keep, layers))

    # Partial residency needs the passes that make a parameter resident and stream the rest.
    streams_and_keeps_resident = ("resident_loads" in facts_after("joint", options.disable_passes)
                                  and "parameters_streamed" in facts_after("forward", options.disable_passes))
    if resident_candidates and streams_and_keeps_resident:
        # Room for everything: parameters used by both passes stay on the device for the
        # step (one load per step instead of two).
        roomy = make(PlanSpec(name="keep (parameters resident)", resident=resident_candidates), snapshots=True)
        if fits(roomy):
            roomy.plan.reason = (f"everything fits with {len(resident_candidates)} parameter(s) resident for the "
                                 f"step: one load each per step instead of two")
            return roomy
    keep = make(PlanSpec(name="keep"))
    if fits(keep):
        if resident_candidates and streams_and_keeps_resident:
            return with_tuned_prefetch(_partial_residency(keep, resident_candidates, budget, make, predict_seconds))
        return with_tuned_prefetch(keep)

    # The candidate ladder: built plans from least to most aggressive. Each is built for
    # real, so its peak is the one the runtime will see, and priced by the cost model.
    candidates: list[Attempt] = [keep]
    offload_all = make(_OFFLOAD_ALL)
    candidates.append(offload_all)
    recompute_all = None
    if allow_recompute:
        recompute_all = make(_RECOMPUTE_ALL)
        candidates.append(recompute_all)
    floor = min(c.peak for c in candidates)

    keep_bytes = _saved_device_bytes_by_layer(keep)
    link = 1.0 / profile.d2h_bandwidth + 1.0 / profile.h2d_bandwidth
    if recompute_all is not None:
        boundary_bytes = _saved_device_bytes_by_layer(recompute_all)
        fwd_seconds = _forward_seconds_by_layer(keep.forward, profile)
    # Per saved activation (storage group), priced one by one; also tells what a whole layer
    # frees at the peak.
    groups = saved_groups(keep, joint, profile, allow_recompute, options.prefetch_depth, floor) if joint else []
    at_peak: dict[str, list[int]] = {}
    for g in groups:
        row = at_peak.setdefault(g.layer, [0, 0])
        row[0] += g.options[1].memory_saved
        row[1] += g.options[2].memory_saved if len(g.options) > 2 else 0
    items: list[list[Option]] = []
    for layer in layers:
        k = keep_bytes.get(layer, 0)
        off, rec = max(0, k), max(0, k - boundary_bytes.get(layer, 0)) if recompute_all is not None else 0
        if joint is not None:
            off, rec = min(off, at_peak.get(layer, [0, 0])[0]), min(rec, at_peak.get(layer, [0, 0])[1])
        opts = [Option("keep", 0, 0.0), Option("offload", off, k * link)]
        if recompute_all is not None:
            opts.append(Option("recompute", rec, fwd_seconds.get(layer, 0.0)))
        items.append(opts)
    solver = SOLVERS[options.solver]
    seen: set[tuple[str, ...]] = set()
    # Coarse: one decision per layer (the fallback the finer plans must beat on the ladder).
    for fraction in (0.2, 0.4, 0.6, 0.8, 1.0):
        picks = solver(items, int((keep.peak - floor) * fraction) + 1)
        if picks is None or tuple(picks) in seen:
            continue
        seen.add(tuple(picks))
        per_layer = {layer: items[i][j].name for i, (layer, j) in enumerate(zip(layers, picks))}
        counts = {p: sum(1 for v in per_layer.values() if v == p) for p in ("keep", "offload", "recompute")}
        a = make(PlanSpec(name="per-layer (" + ", ".join(f"{n} {p}" for p, n in counts.items() if n) + ")",
                          layer_policy=per_layer))
        a.plan.layer_costs = {layer: dataclasses.asdict(items[i][j]) for i, (layer, j) in enumerate(zip(layers, picks))}
        candidates.append(a)
    # Fine: one decision per saved activation (per storage group), priced one by one.
    if groups:
        for picks in solver_mixes(solver, [g.options for g in groups], keep.peak - floor):
            per_value, reasons = {}, {}
            for g, j in zip(groups, picks):
                for member in g.members:
                    per_value[member] = g.options[j].name
                    reasons[member] = g.reason(j)
            counts = {p: sum(1 for g, j in zip(groups, picks) if g.options[j].name == p)
                      for p in ("keep", "offload", "recompute")}
            a = make(PlanSpec(name="per-activation (" + ", ".join(f"{n} {p}" for p, n in counts.items() if n) + ")",
                              value_policy=per_value, value_reason=reasons))
            a.plan.layer_costs = {g.root: dataclasses.asdict(g.options[j]) for g, j in zip(groups, picks)}
            candidates.append(a)
    # The plans above: what the ladder holds at budgets it met before the streamed rungs.
    upper = list(candidates)
    # The streaming minimum: every layer replayed from its input, and the inputs themselves
    # on the host (offloaded in the forward, loaded back one layer ahead of its backward),
    # so the backward holds one layer's boundary instead of all of them. Added after the
    # mixes so their spans (keep .. floor) and hence the plans at larger budgets stay as they were.
    streaming = None
    if recompute_all is not None and recompute_all.plan.saved_values:
        streaming = make(streaming_minimum_spec(recompute_all))
        if streaming.peak < recompute_all.peak:
            candidates.append(streaming)
            # Above the floor too: layers kept where the budget has room, the others streamed,
            # which leaves no boundary on the device, so more layers are kept than with the others
            # recomputed (recompute-all and the next mix up can be far apart at 7B: 42 and 148 GiB).
            candidates += _streamed_mixes(make, layers, recompute_all, fwd_seconds, keep_bytes, boundary_bytes,
                                          link, solver, above_floor=True)
            if maker.host_budget is not None:  # where the streamed ones may not fit the host: none streamed
                candidates += _streamed_mixes(make, layers, recompute_all, fwd_seconds, keep_bytes, boundary_bytes,
                                              link, solver, above_floor=True, streamed=False)
        else:
            streaming = None

    # Keep a ladder along which, as the peak grows, predicted time strictly falls and the
    # recompute count never rises; a budget then takes the last rung that fits. A larger
    # budget can only move up the ladder: step time and recomputed ops never increase.
    # Each rung whose loads stall the compute lane also comes with deeper prefetch for those
    # loads (more memory, less waiting), and the ladder is drawn again over all of them.
    # Only rungs get the variant: building one per candidate doubled the planning time. And
    # only rungs that fit: a variant holds each load it moves earlier for longer and nothing
    # for less, so its peak is at least its rung's; over the budget, it sorts after every
    # plan that fits and cannot change the choice (the plan is the one every variant would
    # give, so the ladder's monotonicity in the budget is kept).
    def priced_with_deeper_variants(attempts: list[Attempt]) -> list[Attempt]:
        for a in attempts:
            a.plan.predicted_seconds = predict_seconds(a)
        on_host = [a for a in attempts if maker.fits_host(a)]
        deeper = [d for d in map(deeper_prefetch, _rungs_to_prefetch_deeper(_ladder(on_host), fits)) if d is not None]
        for d in deeper:
            d.plan.predicted_seconds = predict_seconds(d)
        return attempts + deeper

    candidates = priced_with_deeper_variants(candidates)
    # Plans over host_activation_budget are off the ladder, not just its rungs: a plan they
    # dominate (faster and smaller) may be the one that fits.
    ladder = _ladder([c for c in candidates if maker.fits_host(c)])
    # Below the floor: per-layer mixes with some layers streamed, between the streaming
    # minimum's peak and the smallest plan above (built after the ladder above is drawn, so
    # its deeper-prefetch variants are the ones it had).
    if streaming is not None:
        below = _streamed_mixes(make, layers, recompute_all, fwd_seconds, keep_bytes, boundary_bytes, link, solver)
        if maker.host_budget is not None:
            # The mixes above stream as many layers as their targets want; these stream only as
            # many as the host has room for, the longest-context steps' way to fit both budgets.
            below += _streamed_mixes(make, layers, recompute_all, fwd_seconds, keep_bytes, boundary_bytes, link,
                                     solver, host_budget=maker.host_budget)
        below = priced_with_deeper_variants(below)
        candidates += below
        # Under the smallest plan without streamed layers that the ladder could take: one over
        # host_activation_budget (offload-all, say) is no floor for the plans that fit the host.
        upper_floor = min((c.peak for c in upper if maker.fits_host(c)), default=float("inf"))
        ladder = _extend_below(ladder, [b for b in below if maker.fits_host(b)], upper_floor)
    fitting = [c for c in ladder if fits(c)]
    if not fitting:
        _raise(candidates, budget, _floor(keep, layers), maker.host_budget)
    chosen = _least_on_host_as_fast_as(fitting[-1], [c for c in candidates if fits(c) and maker.fits_host(c)])
    chosen.plan.reason = (
        f"keeping every activation needs {format_bytes(keep.peak)} > budget {format_bytes(budget)}; "
        f"chose the fastest of {len(candidates)} built plans that fits (predicted "
        f"{chosen.plan.predicted_seconds * 1e3:.3f} ms/step, {options.solver} solver for per-layer choices)"
    )
    if chosen is not fitting[-1]:
        chosen.plan.reason += (f"; of the plans that fit within {EQUALLY_FAST:.1%} of the ladder's choice "
                               f"({fitting[-1].plan.predicted_seconds * 1e3:.3f} ms/step, "
                               f"{format_bytes(fitting[-1].host_activation_bytes)} of activations on the host), "
                               f"the one holding the fewest there ({format_bytes(chosen.host_activation_bytes)})")
    over_host = [c for c in candidates if not maker.fits_host(c)]
    if over_host:
        chosen.plan.reason += (f"; {len(over_host)} plan(s) left out for putting more than host_activation_budget="
                               f"{format_bytes(maker.host_budget)} of activations on the host")
    streamed = [layer for layer, row in chosen.plan.layer_costs.items() if row.get("name") == STREAMED]
    if streamed:
        chosen.plan.reason += (f"; streamed ({STREAMED}: replayed from inputs kept on the host until their "
                               f"backward): {', '.join(streamed)}")
    return chosen


# Targets of the streamed mixes: these fractions of the way from what recompute-all frees to
# what streaming every layer frees (against keep).
_STREAMED_TARGETS = (0.25, 0.5, 0.75, 1.0)
# Above the floor: these fractions of what recompute-all frees, denser toward the floor, where
# models far larger than the budget plan (each halves the distance to recompute-all's peak).
_ABOVE_FLOOR_TARGETS = (0.5, 0.75, 0.875, 0.9375, 0.96875)


def _streamed_mixes(make: Callable, layers: list[str], recompute_all: Attempt, fwd_seconds: dict,
                    keep_bytes: dict, boundary_bytes: dict, link: float, solver: Callable,
                    above_floor: bool = False, streamed: bool = True,
                    host_budget: int | None = None) -> list[Attempt]:
    """Per-layer plans with a third option per layer beside keep and recompute, ``STREAMED``
    (recompute, layer input offloaded), for memory targets below the floor.

    Under the floor the peak is one layer's replay in the backward plus what every other
    layer leaves on the device: a kept layer its saved bytes, a recomputed one its boundary,
    a streamed one nothing. So, against keep, recompute frees the saved bytes less the
    boundary and streaming frees all of them; recompute costs the layer's forward replayed,
    streaming that plus its inputs' copies out and back. (Offload is left out: an offloaded
    layer's values come back a layer ahead of its backward, during the replay of the layer
    after it, which is where these peaks are.) Targets: from what recompute-all frees toward
    what streaming every layer frees; only picks with some layer streamed are built.
    ``above_floor``: targets short of what recompute-all frees (``_ABOVE_FLOOR_TARGETS``), for
    budgets between its peak and the next plan up. ``streamed=False`` (above the floor only):
    keep or recompute, no layer streamed, for a host that may not hold their inputs
    (``host_activation_budget``); only picks that keep some layer are built. ``host_budget``
    (below the floor): a layer may be streamed only if its inputs fit it together with those of
    the layers before it that may (in layer order)."""
    inputs = layer_inputs(recompute_all, layers)
    input_bytes = layer_input_bytes(recompute_all, inputs)
    may_stream, on_host = set(), 0
    for layer in layers:
        if streamed and (host_budget is None or on_host + input_bytes.get(layer, 0) <= host_budget):
            may_stream.add(layer)
            on_host += input_bytes.get(layer, 0)
    items = []
    for layer in layers:
        k = max(0, keep_bytes.get(layer, 0))
        fwd = fwd_seconds.get(layer, 0.0)
        # Above the floor the inputs' copies are priced as overlapped with compute (the lane
        # simulation of each built mix says whether they are), so the solver streams a layer
        # rather than recompute it where it needs the bytes: more layers are kept in the budget.
        copies = 0.0 if above_floor else input_bytes.get(layer, 0) * link
        items.append([Option("keep", 0, 0.0), Option("recompute", max(0, k - boundary_bytes.get(layer, 0)), fwd),
                      Option(STREAMED, k, fwd + copies)][:3 if layer in may_stream else 2])
    at_recompute = sum(opts[1].memory_saved for opts in items)
    most = sum(opts[-1].memory_saved for opts in items)
    wanted = STREAMED if streamed else "keep"  # what a pick must have to be a new plan
    out, seen = [], set()
    targets = ([int(fraction * at_recompute) + 1 for fraction in _ABOVE_FLOOR_TARGETS] if above_floor else
               [int(at_recompute + fraction * (most - at_recompute)) + 1 for fraction in _STREAMED_TARGETS])
    for target in targets:
        picks = solver(items, min(most, target))
        if picks is None or not any(items[i][j].name == wanted for i, j in enumerate(picks)):
            continue
        per_layer = {layer: items[i][j].name for i, (layer, j) in enumerate(zip(layers, picks))}
        if tuple(sorted(per_layer.items())) in seen:
            continue
        seen.add(tuple(sorted(per_layer.items())))
        counts = {p: sum(1 for v in per_layer.values() if v == p) for p in ("keep", "recompute", STREAMED)}
        label = ", ".join(f"{'streamed' if p == STREAMED else p} {n}" for p, n in counts.items() if n)
        a = make(mixed_spec(f"per-layer ({label})", per_layer, inputs))
        a.plan.layer_costs = {layer: dataclasses.asdict(items[i][j]) for i, (layer, j) in enumerate(zip(layers, picks))}
        out.append(a)
    return out


# Plans predicted within this fraction of the fastest are equally fast: the cost model's step
# times were within 8-15% of measured ones on GPUs, so a 0.5% edge is no reason to hold
# gigabytes of activations on the host (Gemma-3-12B, bf16: streaming 42 of 48 layers kept
# 14.4 GiB there for a step recompute-all ties to the millisecond).
EQUALLY_FAST = 0.005


def _least_on_host_as_fast_as(chosen: Attempt, fitting: list[Attempt]) -> Attempt:
    """Of the plans that fit and are no slower than ``chosen`` (the ladder's choice) by more than
    ``EQUALLY_FAST``, the one holding the fewest activation bytes on the host; ties to the
    faster, then to fewer recomputes (a plan off the ladder for recomputing more can win)."""
    limit = chosen.plan.predicted_seconds * (1 + EQUALLY_FAST)
    as_fast = [c for c in fitting if c.plan.predicted_seconds <= limit] + [chosen]
    return min(as_fast, key=lambda c: (c.host_activation_bytes, c.plan.predicted_seconds,
                                       len(c.plan.recomputed_ops), c.peak))


def _extend_below(ladder: list[Attempt], below: list[Attempt], upper_floor: int) -> list[Attempt]:
    """The ladder with the ``below`` candidates that peak under ``upper_floor`` (the smallest
    peak of the plans without streamed layers) drawn in under it by the ladder's rule. A rung
    above stays unless one of them beats it on every count: a smaller peak, no more time and
    no more recomputed ops (then a budget that met the rung gets that plan instead)."""
    return _ladder(ladder + [c for c in below if c.peak < upper_floor])


def solver_mixes(solver: Callable, items: list[list[Option]], span: float) -> list[list[int]]:
    """The solver's distinct picks (each upgrading something) for memory targets of 10%, 20%,
    ..., 100% of ``span`` bytes, and for everything the items can save."""
    most = sum(max(o.memory_saved for o in opts) for opts in items)
    out, seen = [], set()
    for required in [int(span * f) + 1 for f in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)] + [most]:
        picks = solver(items, min(required, most))
        if picks is None or tuple(picks) in seen or not any(picks):
            continue
        seen.add(tuple(picks))
        out.append(picks)
    return out


def _rungs_to_prefetch_deeper(ladder: list[Attempt], fits: Callable[[Attempt], bool]) -> list[Attempt]:
    """The rungs whose deeper-prefetch variants are worth building: those within the budget."""
    return [rung for rung in ladder if fits(rung)]


def _ladder(candidates: list[Attempt]) -> list[Attempt]:
    """The candidates along which, as the peak grows, predicted time falls and the recompute
    count never rises (each candidate priced: ``plan.predicted_seconds``)."""
    def numbers(c: Attempt) -> tuple:
        return c.peak, c.plan.predicted_seconds, len(c.plan.recomputed_ops)

    ladder: list[Attempt] = []
    for c in sorted(candidates, key=lambda c: numbers(c)[:2]):
        # Ties in time go to the later (less aggressive) rung: no offload or recompute that
        # buys nothing.
        _, seconds, recomputed = numbers(c)
        if not ladder or (seconds <= numbers(ladder[-1])[1] and recomputed <= numbers(ladder[-1])[2]):
            ladder.append(c)
    return ladder


# A parameter is prefetched at most this many layers ahead (each layer deeper holds one more
# layer's parameters on the device).
_MAX_PREFETCH = 4


def _load_stalls(attempt: Attempt, profile, precision: str, overlapped_optimizer: bool) -> dict[str, float]:
    """Streamed value (by source name) -> seconds the compute lane waits for those of its loads
    a deeper prefetch can issue earlier, over the forward and the backward, by the cost model's
    lane simulation. (A load issued before its program's first compute op lands in the same
    place at any depth: at 7B the embedding's and the head's waits had a variant of the same
    programs built for every rung, an eighth of the planning time.)"""
    stalls: dict[str, float] = {}
    served = HostCastsServed(copies_written_by_optimizer=overlapped_optimizer)
    for gm in (attempt.forward, attempt.backward):
        if gm is None:
            continue
        served.gradients_taken = overlapped_optimizer and gm is attempt.backward
        waits = {n.name: n for n in gm.graph.nodes if n.op == "call_function" and n.target is ops.wait}
        movable = _loads_after_compute(gm)
        for event in simulate(gm, profile, precision, served=served).events:
            wait = waits.get(event.name) if event.lane == "stall" else None
            load = wait.args[0] if wait is not None else None
            if load is None or load not in movable or load.args[0].op != "placeholder":
                continue
            source = info(load).source
            if source:
                stalls[source] = stalls.get(source, 0.0) + (event.end_s - event.start_s)
    return stalls


def _loads_after_compute(gm: fx.GraphModule) -> set[fx.Node]:
    """The loads of ``gm`` that some device compute op runs before: those a deeper prefetch can
    issue earlier (``stream_parameters`` issues a load at the start of a layer's run, never
    before the program's first)."""
    movable, computed = set(), False
    for node in gm.graph.nodes:
        if node.target is ops.load and computed:
            movable.add(node)
        computed = computed or is_device_compute(node)
    return movable


def _floor(keep: Attempt, layers: list[str]) -> StreamingFloor:
    return streaming_floor(keep.forward, keep.backward, layers, _saved_device_bytes_by_layer(keep))


def _raise(attempts: list[Attempt], budget: int | None, floor: StreamingFloor, host_budget: int | None = None) -> None:
    within_budget = [a for a in attempts if budget is None or a.peak <= budget]
    if within_budget and host_budget is not None:
        least = min(within_budget, key=lambda a: a.host_activation_bytes)
        raise BudgetError(
            f"megatrain: no plan within memory_budget={format_bytes(budget)} keeps its activations on the host within "
            f"host_activation_budget={format_bytes(host_budget)}: of the plans built, the least any puts there is "
            f"{format_bytes(least.host_activation_bytes)} ({least.host_activation_bytes} bytes, plan "
            f"'{least.plan.policy}'). Raise host_activation_budget to {least.host_activation_bytes} (that plan fits "
            f"it), raise memory_budget, or shrink the step (smaller batch or sequence length).",
            minimum_budget=None, limiting_layer=str(least.plan.limiting_layer), streaming_floor=floor.bytes,
            least_host_activation_bytes=least.host_activation_bytes)
    best = min(attempts, key=lambda a: a.peak).plan
    if floor.layer is None or best.limiting_layer is None:  # a graph without layers (a loss after a graph break)
        raise BudgetError(
            f"megatrain: memory_budget={format_bytes(budget)} is too small for this training step. This graph has no "
            f"layers to stream; its smallest plan needs {format_bytes(best.peak_bytes)} ({best.peak_bytes} bytes) of "
            f"device memory (plan '{best.policy}'). Raise memory_budget to at least {best.peak_bytes}, or shrink its "
            f"tensors (smaller batch or sequence length).",
            minimum_budget=best.peak_bytes, limiting_layer=str(best.limiting_layer), streaming_floor=floor.bytes)
    if best.peak_bytes >= floor.bytes:
        ratio = best.peak_bytes / max(floor.bytes, 1)
        against_floor = f"the streaming floor is {floor.describe()} ({ratio:.2f}x of it)"
    else:  # the floor keeps every activation its layer's backward reads; this plan recomputes or offloads some
        against_floor = (f"below the streaming floor with every activation kept, {floor.describe()}, as the plan "
                         f"recomputes or offloads some of them")
    raise BudgetError(
        f"megatrain: memory_budget={format_bytes(budget)} is too small for this training step. "
        f"The smallest plan needs {format_bytes(best.peak_bytes)} ({best.peak_bytes} bytes) of device "
        f"memory, set by layer '{best.limiting_layer}' (plan '{best.policy}'); {against_floor}. "
        f"Raise memory_budget to at "
        f"least {best.peak_bytes}, or shrink that layer's working set (smaller batch or sequence length, "
        f"or prefetch_depth=0).",
        minimum_budget=best.peak_bytes,
        limiting_layer=str(best.limiting_layer),
        streaming_floor=floor.bytes,
    )
