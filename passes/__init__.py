"""The graph passes and the pass manager that runs them.

Every pass is a module with the same shape:

    NAME: str                      # how options and provenance refer to it
    STAGES: tuple[str, ...]        # which graphs it rewrites: joint | forward | backward | inference
    def run(gm: fx.GraphModule, ctx: PassContext) -> None   # rewrites gm in place

The manager runs them in ``PASS_ORDER``, skips the ones ``options.disable_passes`` names,
stamps every node a pass creates with that pass's name (``NodeInfo.created_by``), checks the
graph invariants after each pass (``passes.invariants``), and keeps a printed snapshot of
the graph after each pass for ``megacompile inspect``.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch.fx as fx

from megacompile.core.node_info import info
from megacompile.core.printer import format_graph
from megacompile.passes import (
    annotate,
    host_casts,
    invariants,
    offload_gradients,
    recompute,
    resident_parameters,
    stream_parameters,
)

PASS_ORDER = (annotate, host_casts, resident_parameters, recompute, stream_parameters, offload_gradients)


def known_pass_names() -> list[str]:
    return [p.NAME for p in PASS_ORDER]


def optional_pass_names() -> list[str]:
    """Passes ``disable_passes`` may switch off."""
    return [p.NAME for p in PASS_ORDER if p.OPTIONAL]


@dataclasses.dataclass
class GraphSnapshot:
    """The graph of one stage after one pass, as ``megacompile inspect`` prints it."""

    graph: str  # forward | backward | inference | joint | optimizer | host
    stage: str  # the pass name, or "captured"
    text: str
    nodes_created: int
    nodes_erased: int
    elapsed_ms: float


@dataclasses.dataclass
class PassContext:
    options: Any  # megacompile.options.Options
    stage: str
    plan: Any  # megacompile.plan.memory_estimate.TrainingPlan
    input_names: list[str]
    input_roles: list[str]
    num_user_outputs: int = 0
    snapshots: list[GraphSnapshot] = dataclasses.field(default_factory=list)
    ran: list[str] = dataclasses.field(default_factory=list)


def run_passes(gm: fx.GraphModule, ctx: PassContext, keep_snapshots: bool = True) -> fx.GraphModule:
    if keep_snapshots:
        ctx.snapshots.append(
            GraphSnapshot(ctx.stage, "captured", format_graph(gm, f"{ctx.stage} graph: captured"), 0, 0, 0.0)
        )
    ctx.ran = []
    for p in PASS_ORDER:
        if ctx.stage not in p.STAGES or p.NAME in ctx.options.disable_passes:
            continue
        before = set(gm.graph.nodes)
        start = time.perf_counter()
        p.run(gm, ctx)
        elapsed = (time.perf_counter() - start) * 1e3
        after = set(gm.graph.nodes)
        created = after - before
        for node in created:
            info(node).created_by = p.NAME
        ctx.ran.append(p.NAME)
        if keep_snapshots:
            # The graph a plan will run is built with snapshots: it is linted after every
            # pass, so a broken graph names its pass. Candidates are linted once, at the end.
            gm.graph.lint()
        invariants.check(gm, ctx)
        if keep_snapshots:
            title = f"{ctx.stage} graph: after {p.NAME} (+{len(created)} nodes, -{len(before - after)})"
            ctx.snapshots.append(
                GraphSnapshot(ctx.stage, p.NAME, format_graph(gm, title), len(created), len(before - after), elapsed)
            )
    if not keep_snapshots:
        gm.graph.lint()
    gm.recompile()
    return gm
