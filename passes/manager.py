"""The pass manager: passes declare contracts, the manager checks their order and runs them.

A pass is a module with a ``CONTRACT`` and ``run(gm, ctx)``. A contract names the stages the
pass rewrites and three sets of *facts*, properties of the graph that hold once a pass ran:

- ``requires``: facts that must hold before it runs (a pass that provides them runs first);
- ``uses``: facts it takes into account where they hold (the pass providing them, if it
  runs, runs first; it may be switched off);
- ``provides``: facts that hold after it runs.

A pass module may also define ``applies(ctx)``: False skips it for that graph (no snapshot,
as if it did not apply to the stage).

``PASS_ORDER`` is checked against the contracts once, at import. ``run_pipeline`` checks the
passes left after ``options.disable_passes`` the same way, so switching off a pass another
one stands on is an error naming both; ``disable_passes`` may name exactly the passes whose
facts nothing requires. Results a pass computes for the compiler travel in ``PassContext``
(the recompute pass's saved values in ``ctx.plan``); the facts that held after each pass are
in ``ctx.facts``. Provenance (``NodeInfo.created_by``) is stamped by node-creation hooks on the
graph module while a pass runs.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch.fx as fx

from megacompile.core import torch_compat as compat
from megacompile.core.node_info import info
from megacompile.core.printer import format_graph
from megacompile.passes import invariants
from megacompile.passes.contract import PassContract, PassOrderError, check_order  # noqa: F401  (re-exported)

# TORCH_LOGS="+megatrain": one line per pass run (docs/guide.md, "Logs").
log = logging.getLogger(__name__)


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
    plan: Any  # megacompile.plan.training_plan.TrainingPlan: the decisions in, saved values out
    input_names: list[str]
    input_roles: list[str]
    # Forward: how many outputs are the user's (the rest are saved for the backward).
    num_user_outputs: int = 0
    # The graph runs under autocast that Dynamo's trace did not see (precision="bf16", or the
    # step's or caller's CUDA regions retargeted to the host tensors): the model's Python read
    # fp32 dtypes where autocast's values are bf16 (narrow_dtype_extremes).
    autocast_added: bool = False
    snapshots: list[GraphSnapshot] = dataclasses.field(default_factory=list)
    ran: list[str] = dataclasses.field(default_factory=list)
    # Facts that hold now (PassContract.provides of the passes that ran on this graph), and
    # those that will hold once every selected pass of this stage ran.
    facts: set[str] = dataclasses.field(default_factory=set)
    coming_facts: set[str] = dataclasses.field(default_factory=set)


class _Provenance:
    """Node-creation and erase hooks on the graph module while one pass runs."""

    def __init__(self, gm: fx.GraphModule, pass_name: str) -> None:
        self.gm, self.pass_name = gm, pass_name
        self.created: list[fx.Node] = []
        self.erased: set[fx.Node] = set()

    def _on_create(self, node: fx.Node) -> None:
        self.created.append(node)

    def _on_erase(self, node: fx.Node) -> None:
        self.erased.add(node)

    def __enter__(self) -> "_Provenance":
        compat.add_node_hooks(self.gm, self._on_create, self._on_erase)
        return self

    def __exit__(self, *exc) -> None:
        compat.remove_node_hooks(self.gm, self._on_create, self._on_erase)

    def stamp(self) -> tuple[int, int]:
        """Marks the surviving created nodes with the pass; (created, erased) counts, each
        node that was created and erased within the pass counted in neither."""
        kept = [n for n in self.created if n not in self.erased]
        for node in kept:
            info(node).created_by = self.pass_name
        return len(kept), len(self.erased - set(self.created))


def run_pipeline(gm: fx.GraphModule, ctx: PassContext, passes: tuple, keep_snapshots: bool = True) -> fx.GraphModule:
    """Runs ``passes`` (modules with ``CONTRACT`` and ``run``) that apply to ``ctx.stage``,
    less ``ctx.options.disable_passes``, checking invariants after each (``check(gm, ctx)``
    of ``passes.invariants``)."""
    selected = [p for p in passes if p.CONTRACT.name not in ctx.options.disable_passes]
    check_order([p.CONTRACT for p in selected])
    if keep_snapshots:
        ctx.snapshots.append(
            GraphSnapshot(ctx.stage, "captured", format_graph(gm, f"{ctx.stage} graph: captured"), 0, 0, 0.0)
        )
    ctx.ran = []
    ctx.facts = set()
    ctx.coming_facts = {f for p in selected if ctx.stage in p.CONTRACT.stages for f in p.CONTRACT.provides}
    for p in selected:
        contract = p.CONTRACT
        if ctx.stage not in contract.stages or not getattr(p, "applies", lambda _ctx: True)(ctx):
            continue
        start = time.perf_counter()
        with _Provenance(gm, contract.name) as provenance:
            p.run(gm, ctx)
        elapsed = (time.perf_counter() - start) * 1e3
        created, erased = provenance.stamp()
        ctx.ran.append(contract.name)
        ctx.facts |= contract.provides
        log.debug("%s graph, plan %r: pass %s: +%d nodes, -%d, %.1f ms", ctx.stage, ctx.plan.policy, contract.name,
                  created, erased, elapsed)
        if keep_snapshots:
            # The graph a plan will run is built with snapshots: it is linted after every
            # pass, so a broken graph names its pass. Candidates are linted once, at the end.
            gm.graph.lint()
        invariants.check(gm, ctx)
        if keep_snapshots:
            title = f"{ctx.stage} graph: after {contract.name} (+{created} nodes, -{erased})"
            ctx.snapshots.append(GraphSnapshot(ctx.stage, contract.name, format_graph(gm, title), created, erased,
                                               elapsed))
    if not keep_snapshots:
        gm.graph.lint()
    gm.recompile()
    return gm
