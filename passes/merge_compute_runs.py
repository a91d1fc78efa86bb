"""merge_compute_runs: a layer's compute runs uninterrupted, its memory ops gathered at its ends.

Where the program copies (CUDA), every memory op ends the compiled segment before it
(``runtime/executor``): a weight's ``wait`` right before its matmul and its ``evict`` right
after leave ``t``, ``mm`` and ``view`` between them, which run one by one through Python
dispatch, about a hundred ops a layer. This pass moves, inside each run of one layer's compute
(``stream_parameters.layer_runs``):

    load, wait       up, to before the run's first compute op (a load only where its source
                     is ready there: a parameter, a host cast of one, a value from before);
    offload, evict   down, to after the run's last compute op (an offload only where nothing
                     in the run reads it).

Waiting earlier on a copy that was issued layers ahead costs nothing when it has landed;
freeing later holds values to the run's end, which the memory estimate sees, since it reads
this order. The planner builds this as a variant of the plan it chose
(``PlanSpec.merged_compute_runs``) and takes it only if it fits the budget.
"""
from __future__ import annotations

import torch.fx as fx

from megacompile.core import ops
from megacompile.core.host_ops import is_host_op
from megacompile.passes.contract import PassContract
from megacompile.passes.stream_parameters import layer_runs

CONTRACT = PassContract(
    name="merge_compute_runs",
    stages=("forward", "backward"),
    requires=frozenset({"annotated"}),
    uses=frozenset({"parameters_streamed", "outputs_offloaded"}),
    provides=frozenset({"compute_runs_merged"}),
)

_UP = (ops.load, ops.wait)
_DOWN = (ops.offload, ops.evict)


def applies(ctx) -> bool:
    return bool(ctx.plan.spec.merged_compute_runs)


def _is_compute(node: fx.Node) -> bool:
    return node.op == "call_function" and not ops.is_memory_op(node) and not is_host_op(node)


def run(gm: fx.GraphModule, ctx) -> None:
    for first, last, inside in _runs_with_memory_ops(gm):
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        _hoist(first, [n for n in inside if n.target in _UP], order)
        _sink(last, [n for n in inside if n.target in _DOWN], order)


def _runs_with_memory_ops(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node, list[fx.Node]]]:
    """Each run of one layer's compute as (first compute op, last compute op, the memory and
    host ops between them in graph order), for runs that have any."""
    nodes = list(gm.graph.nodes)
    compute = [n for n in nodes if _is_compute(n)]
    if not compute:
        return []
    # Glue ahead of the first layer joins its run, as glue joins the run around it.
    starts = [start for _, start in layer_runs(compute)] or [0]
    starts[0] = 0
    bounds = [(compute[a], compute[b - 1]) for a, b in zip(starts, [*starts[1:], len(compute)])]
    position = {n: i for i, n in enumerate(nodes)}
    out = []
    for first, last in bounds:
        inside = [n for n in nodes[position[first] + 1:position[last]] if not _is_compute(n)]
        if any(n.op == "call_function" and ops.is_memory_op(n) for n in inside):
            out.append((first, last, inside))
    return out


def _hoist(first: fx.Node, movers: list[fx.Node], order: dict[fx.Node, int]) -> None:
    """Moves loads and waits to just before ``first``, in their order, with the host ops a
    load reads (a host cast runs right before its load). A node stays where it reads a value
    computed inside the run, or a load that had to stay."""
    moved: set[fx.Node] = set()
    for node in movers:
        needed = _inputs_to_move(node, order[first], order, moved)
        if needed is None:
            continue
        for n in [*needed, node]:
            first.prepend(n)
            moved.add(n)


def _inputs_to_move(node: fx.Node, start: int, order: dict[fx.Node, int], moved: set[fx.Node]) -> list[fx.Node] | None:
    """The host ops after position ``start`` that ``node`` reads, which move up with it, in
    order; None if it reads anything else from after ``start``."""
    needed: list[fx.Node] = []
    for inp in node.all_input_nodes:
        if inp in moved or order[inp] < start:
            continue  # already above the run, or defined before it
        if not is_host_op(inp):
            return None  # computed in the run, or a load that stays below
        deeper = _inputs_to_move(inp, start, order, moved)
        if deeper is None:
            return None
        needed += [d for d in [*deeper, inp] if d not in needed]
    return needed


def _sink(last: fx.Node, movers: list[fx.Node], order: dict[fx.Node, int]) -> None:
    """Moves offloads and evicts to just after ``last``, in their order. An offload whose
    result is read before ``last`` stays (its evict, after it either way, still moves)."""
    anchor = last
    for node in movers:
        if any(order[u] <= order[last] for u in node.users):
            continue
        anchor.append(node)
        anchor = node
