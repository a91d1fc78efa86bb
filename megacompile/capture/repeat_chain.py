"""A short copy of a joint graph whose repeated layers form a chain: the planner's template.

With layers marked by ``nested_compile_region`` (by the user or ``mark_repeated_layers``),
AOTAutograd's joint graph of the step calls one partitioned forward body per layer and one
backward body per layer (``invoke_subgraph``), before ``inline_regions`` copies the bodies
in. Where those calls form a chain (each forward call reads the previous one's output, each
backward call the next one's input gradient), a program of k layers is the same graph with
the middle calls left out: the forward hands layer k-2's output straight to the last layer,
the backward hands the last layer's input gradient straight to layer k-2, and the left-out
layers' parameter gradients become None. Where layers of different bodies alternate (Gemma's
sliding-window and full attention), the chain is counted in units of one period (two layers
there) and copies keep whole units. ``template_planner`` plans on such copies (k small
and fixed) instead of building every candidate over all N layers.

Nothing here changes the joint graph it is given: ``truncated_joint`` works on a copy, and
returns None wherever the structure is not a plain chain (an op between two layers, a
gradient of a shared input accumulated across layers, ...); the caller then plans the flat
graph as before.
"""
from __future__ import annotations

import dataclasses
import operator

import torch.fx as fx

from megacompile.core import torch_compat as compat


@dataclasses.dataclass
class RepeatChain:
    """The forward and backward calls of the repeated layers, in forward order (``backward[i]``
    is the backward of ``forward[i]``), in units of ``period`` consecutive calls whose bodies
    repeat unit after unit (1 where every layer is alike; 2 where two kinds alternate, e.g.
    sliding-window and full attention)."""

    forward: list[fx.Node]
    backward: list[fx.Node]
    period: int = 1

    def __len__(self) -> int:
        """The number of units."""
        return len(self.forward) // self.period

    def units(self) -> list[list[fx.Node]]:
        """The forward calls grouped by unit."""
        p = self.period
        return [self.forward[i:i + p] for i in range(0, len(self.forward), p)]


def _is_call(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and compat.is_invoke_subgraph(node.target)


def _reads_from(call: fx.Node, producer: fx.Node) -> list[fx.Node]:
    """The operands of ``call`` that are outputs (getitems) of ``producer``."""
    return [a for a in call.args[2:] if isinstance(a, fx.Node) and a.target is operator.getitem
            and a.args[0] is producer]


def _linked_runs(calls: list[fx.Node]) -> list[list[fx.Node]]:
    """Maximal runs of forward calls in which each reads exactly one output of the one before
    it (the hidden state)."""
    runs: list[list[fx.Node]] = []
    for call in calls:
        if runs and len(_reads_from(call, runs[-1][-1])) == 1:
            runs[-1].append(call)
        else:
            runs.append([call])
    return runs


def _longest_periodic_stretch(bodies: list) -> tuple[int, int, int]:
    """(start, period, units) of the stretch of ``bodies`` covering the most calls with whole
    units of one repeating pattern (at least two units); the shortest period on a tie. (0, 1, 0)
    where none repeats."""
    best = (0, 1, 0)
    for p in range(1, len(bodies) // 2 + 1):
        i = 0
        while i + p < len(bodies):
            if bodies[i] != bodies[i + p]:
                i += 1
                continue
            j = i  # bodies[j] == bodies[j + p] for j in [i, end): units = (end - i) // p + 1
            while j + p < len(bodies) and bodies[j] == bodies[j + p]:
                j += 1
            units = (j - i) // p + 1
            if units >= 2 and units * p > best[1] * best[2]:
                best = (i, p, units)
            i = j + 1
    return best


def find_repeat_chain(joint: fx.GraphModule) -> RepeatChain | None:
    """The longest periodic chain of forward calls with their backward calls, or None."""
    forward_calls: list[fx.Node] = []
    backward_calls: list[fx.Node] = []
    for node in joint.graph.nodes:
        if _is_call(node):
            (backward_calls if compat.is_backward_tagged(node) else forward_calls).append(node)
    best: tuple[int, list[fx.Node]] = (0, [])
    period = 1
    for run in _linked_runs(forward_calls):
        start, p, units = _longest_periodic_stretch([c.args[0].target for c in run])
        if units * p > best[0]:
            best, period = (units * p, run[start:start + units * p]), p
    forward = best[1]
    if not forward:
        return None
    # A backward call reads what its forward call saved: pair each with the forward call it
    # reads most from (among all of them: a layer after the chain may read the chain's last
    # output too). Calls outside the chain are other bodies' (torch 2.11 traces the first
    # layer, whose input is a graph input, as a body of its own) or the glue's.
    in_chain = set(forward)
    paired: dict[fx.Node, fx.Node] = {}
    for call in backward_calls:
        counts = {f: len(_reads_from(call, f)) for f in forward_calls}
        best_forward = max(forward_calls, key=lambda f: counts[f])
        if counts[best_forward] == 0 or best_forward not in in_chain:
            continue
        if best_forward in paired:
            return None
        paired[best_forward] = call
    if len(paired) != len(forward):
        return None
    backward = [paired[f] for f in forward]
    # ... and each backward call reads exactly one output of the next layer's backward (the
    # gradient of its output).
    for cur, nxt in zip(backward, backward[1:]):
        if len(_reads_from(cur, nxt)) != 1:
            return None
    return RepeatChain(forward, backward, period)


def _copy(joint: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """A copy of ``joint`` with the same node names and (shallow-copied) meta; the bodies are
    shared, as attributes of the copy."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in joint.graph.nodes:
        env[node] = graph.node_copy(node, lambda a: env[a])
    gm = fx.GraphModule(joint, graph)
    for key, value in vars(joint).items():
        if key.startswith("_megatrain"):
            setattr(gm, key, value)
    return gm, env


def truncated_joint(joint: fx.GraphModule, chain: RepeatChain, k: int) -> fx.GraphModule | None:
    """A copy of ``joint`` keeping the chain's first k-1 units and its last one (k units in
    all), or None if the left-out units cannot be cut out cleanly."""
    n, p = len(chain), chain.period
    if not 2 <= k < n:
        return None
    gm, env = _copy(joint)
    fw = [env[c] for c in chain.forward]
    bw = [env[c] for c in chain.backward]
    first_dropped, last_kept = (k - 1) * p, (n - 1) * p  # calls [first_dropped, last_kept) are left out
    dropped_fw, dropped_bw = fw[first_dropped:last_kept], bw[first_dropped:last_kept]
    # Forward: the last unit reads what the first left-out unit read.
    (block_in,) = _reads_from(fw[first_dropped], fw[first_dropped - 1])
    (block_out,) = _reads_from(fw[last_kept], fw[last_kept - 1])
    # Backward: the last kept unit before the cut reads the gradient the last unit hands down.
    (grad_out,) = _reads_from(bw[last_kept - 1], bw[last_kept])
    (grad_in,) = _reads_from(bw[first_dropped - 1], bw[first_dropped])
    block_out.replace_all_uses_with(block_in)
    grad_in.replace_all_uses_with(grad_out)
    dropped = set(dropped_fw) | set(dropped_bw)
    doomed: list[fx.Node] = []
    output = next(iter(gm.graph.find_nodes(op="output")))
    for call in dropped:
        for item in list(call.users):
            for user in list(item.users):
                if user is output:
                    # A left-out layer's parameter gradient: this short program has none.
                    output.args = fx.node.map_arg(output.args, lambda a: None if a is item else a)
                elif not (_is_call(user) and user in dropped):
                    return None  # read outside the left-out layers: not a plain chain
            doomed.append(item)
        doomed.append(call)
    for node in reversed(list(gm.graph.nodes)):
        if node in doomed or (node.op == "call_function" and node.target is operator.getitem
                              and node.args[0] in dropped):
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm
