"""The planner: one device budget, a keep / offload / recompute decision per layer.

``plan_training`` searches for the fastest plan that fits, using the real pipeline to check
each candidate (``build`` partitions the joint graph under a plan, runs the passes and
estimates the peak), so a chosen plan's predicted peak is the one the runtime will see:

1. Keep everything. If it fits, that is the plan: no recompute, no activation offload.
2. Otherwise price each layer's options from the keep plan and an all-recompute plan:
   offloading a layer's saved activations frees their bytes and costs the copies both ways;
   recomputing frees all but its boundary inputs and costs its forward again. A solver
   (``options.solver``: exact or greedy, see ``solvers.py``) picks the cheapest set that frees
   enough; if the built plan still overshoots (the peak is not a plain sum), the target grows
   by the overshoot and the solver runs again.
3. Fall back to the most aggressive plans (offload all, recompute all). If none fits,
   ``BudgetError`` names the smallest peak any plan reached and the layer that sets it.

Decisions and their reasons land in ``NodeInfo.decision`` / ``reason`` (shown by inspect);
the per-layer choice and its price are in ``TrainingPlan.layer_policy`` / ``layer_costs``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch.fx as fx

from .errors import BudgetError
from .node_info import has_info, info
from .options import format_bytes
from .plan import TrainingPlan
from .solvers import SOLVERS, Option


@dataclasses.dataclass
class Attempt:
    plan: TrainingPlan
    forward: fx.GraphModule
    backward: fx.GraphModule
    snapshots: list

    @property
    def peak(self) -> int:
        return self.plan.peak_bytes


def _saved_device_bytes_by_layer(attempt: Attempt) -> dict[str, int]:
    out: dict[str, int] = {}
    saved = set(attempt.plan.saved_values)
    for node in attempt.forward.graph.nodes:
        if node.name in saved and has_info(node) and info(node).layer and info(node).role == "compute":
            out[info(node).layer] = out.get(info(node).layer, 0) + info(node).nbytes_hint
    return out


def _forward_seconds_by_layer(gm: fx.GraphModule, profile) -> dict[str, float]:
    """What replaying each layer's forward costs, by the cost model (roofline + launch)."""
    from .cost_model import annotate_costs, cost

    annotate_costs(gm, profile)
    out: dict[str, float] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and has_info(node) and info(node).layer and info(node).role == "compute":
            out[info(node).layer] = out.get(info(node).layer, 0.0) + cost(node).time_s
    return out


def plan_training(
    build: Callable[[TrainingPlan], Attempt],
    layers: list[str],
    options,
    profile,
    predict_seconds: Callable[[Attempt], float],
    resident_candidates: list[str] | None = None,
) -> Attempt:
    budget = options.memory_budget
    allow_recompute = options.recompute != "never"

    def make(default: str, per_layer: dict[str, str] | None = None, name: str = "",
             resident: list[str] | None = None) -> Attempt:
        plan = TrainingPlan(policy=name or default, budget=budget, default_policy=default,
                            layer_policy=dict(per_layer or {}), resident=list(resident or []))
        return build(plan)

    def fits(a: Attempt) -> bool:
        return budget is None or a.peak <= budget

    if options.recompute == "always":
        a = make("recompute")
        if fits(a):
            return a
        _raise([a], budget)

    if resident_candidates and not {"resident_parameters", "stream_parameters"} & set(options.disable_passes):
        # Room for everything: parameters used by both passes stay on the device for the
        # step (one load per step instead of two).
        roomy = make("keep", name="keep (parameters resident)", resident=resident_candidates)
        if fits(roomy):
            roomy.plan.reason = (f"everything fits with {len(resident_candidates)} parameter(s) resident for the "
                                 f"step: one load each per step instead of two")
            return roomy
    keep = make("keep")
    if fits(keep):
        return keep

    # The candidate ladder: built plans from least to most aggressive. Each is built for
    # real, so its peak is the one the runtime will see, and priced by the cost model.
    candidates: list[Attempt] = [keep]
    offload_all = make("offload", name="offload (all layers)")
    candidates.append(offload_all)
    recompute_all = None
    if allow_recompute:
        recompute_all = make("recompute", name="recompute (all layers)")
        candidates.append(recompute_all)
    floor = min(c.peak for c in candidates)

    keep_bytes = _saved_device_bytes_by_layer(keep)
    link = 1.0 / profile.d2h_bandwidth + 1.0 / profile.h2d_bandwidth
    if recompute_all is not None:
        boundary_bytes = _saved_device_bytes_by_layer(recompute_all)
        fwd_seconds = _forward_seconds_by_layer(keep.forward, profile)
    items: list[list[Option]] = []
    for layer in layers:
        k = keep_bytes.get(layer, 0)
        opts = [Option("keep", 0, 0.0), Option("offload", k, k * link)]
        if recompute_all is not None:
            opts.append(Option("recompute", max(0, k - boundary_bytes.get(layer, 0)), fwd_seconds.get(layer, 0.0)))
        items.append(opts)
    solver = SOLVERS[options.solver]
    seen: set[tuple[str, ...]] = set()
    for fraction in (0.2, 0.4, 0.6, 0.8, 1.0):
        picks = solver(items, int((keep.peak - floor) * fraction) + 1)
        if picks is None or tuple(picks) in seen:
            continue
        seen.add(tuple(picks))
        per_layer = {layer: items[i][j].name for i, (layer, j) in enumerate(zip(layers, picks))}
        counts = {p: sum(1 for v in per_layer.values() if v == p) for p in ("keep", "offload", "recompute")}
        a = make("keep", per_layer, name="per-layer (" + ", ".join(f"{n} {p}" for p, n in counts.items() if n) + ")")
        a.plan.layer_costs = {layer: dataclasses.asdict(items[i][j]) for i, (layer, j) in enumerate(zip(layers, picks))}
        candidates.append(a)

    # Keep a ladder along which, as the peak grows, predicted time strictly falls and the
    # recompute count never rises; a budget then takes the last rung that fits. A larger
    # budget can only move up the ladder: step time and recomputed ops never increase.
    for c in candidates:
        c.plan.predicted_seconds = predict_seconds(c)
    ladder: list[Attempt] = []
    for c in sorted(candidates, key=lambda c: (c.peak, c.plan.predicted_seconds)):
        # Ties in time go to the later (less aggressive) rung: no offload or recompute that
        # buys nothing.
        if not ladder or (c.plan.predicted_seconds <= ladder[-1].plan.predicted_seconds
                          and len(c.plan.recomputed_ops) <= len(ladder[-1].plan.recomputed_ops)):
            ladder.append(c)
    fitting = [c for c in ladder if fits(c)]
    if not fitting:
        _raise(candidates, budget)
    chosen = fitting[-1]
    chosen.plan.reason = (
        f"keeping every activation needs {format_bytes(keep.peak)} > budget {format_bytes(budget)}; "
        f"chose the fastest of {len(candidates)} built plans that fits (predicted "
        f"{chosen.plan.predicted_seconds * 1e3:.3f} ms/step, {options.solver} solver for per-layer choices)"
    )
    return chosen


def _raise(attempts: list[Attempt], budget: int | None) -> None:
    best = min(attempts, key=lambda a: a.peak).plan
    raise BudgetError(
        f"megatrain: memory_budget={format_bytes(budget)} is too small for this training step. "
        f"The smallest plan needs {format_bytes(best.peak_bytes)} ({best.peak_bytes} bytes) of device "
        f"memory, set by layer '{best.limiting_layer}' (plan '{best.policy}'). Raise memory_budget to at "
        f"least {best.peak_bytes}, or shrink that layer's working set (smaller batch or sequence length, "
        f"or prefetch_depth=0).",
        minimum_budget=best.peak_bytes,
        limiting_layer=str(best.limiting_layer),
    )
