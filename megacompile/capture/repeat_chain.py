"""A short copy of a joint graph whose repeated layers form a chain: the planner's template.

With layers marked by ``nested_compile_region`` (by the user or ``mark_repeated_layers``),
AOTAutograd's joint graph of the step calls one partitioned forward body per layer and one
backward body per layer (``invoke_subgraph``), before ``inline_regions`` copies the bodies
in. Where those calls form a chain (each forward call reads the previous one's output, each
backward call the next one's input gradient), a program of k layers is the same graph with
the middle calls left out: the forward hands layer k-2's output straight to the last layer,
the backward hands the last layer's input gradient straight to layer k-2, and the left-out
layers' parameter gradients become None. ``template_planner`` plans on such copies (k small
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
    """The forward and backward calls of one body, in forward order (``backward[i]`` is the
    backward of ``forward[i]``)."""

    forward: list[fx.Node]
    backward: list[fx.Node]

    def __len__(self) -> int:
        return len(self.forward)


def _is_call(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and compat.is_invoke_subgraph(node.target)


def _reads_from(call: fx.Node, producer: fx.Node) -> list[fx.Node]:
    """The operands of ``call`` that are outputs (getitems) of ``producer``."""
    return [a for a in call.args[2:] if isinstance(a, fx.Node) and a.target is operator.getitem
            and a.args[0] is producer]


def find_repeat_chain(joint: fx.GraphModule) -> RepeatChain | None:
    """The longest chain of forward calls of one body with their backward calls, or None."""
    forward_by_body: dict[str, list[fx.Node]] = {}
    backward_calls: list[fx.Node] = []
    for node in joint.graph.nodes:
        if not _is_call(node):
            continue
        if compat.is_backward_tagged(node):
            backward_calls.append(node)
        else:
            forward_by_body.setdefault(node.args[0].target, []).append(node)
    if not forward_by_body:
        return None
    forward = max(forward_by_body.values(), key=len)
    if len(forward) < 2:
        return None
    # Each forward call reads exactly one output of the one before it (the hidden state).
    for prev, cur in zip(forward, forward[1:]):
        if len(_reads_from(cur, prev)) != 1:
            return None
    # A backward call reads what its forward call saved: pair by the forward call it reads
    # most from. One that reads from none of them is another body's (torch 2.11 traces the
    # first layer, whose input is a graph input, as a body of its own).
    paired: dict[fx.Node, fx.Node] = {}
    for call in backward_calls:
        counts = {f: len(_reads_from(call, f)) for f in forward}
        best = max(forward, key=lambda f: counts[f])
        if counts[best] == 0:
            continue
        if best in paired:
            return None
        paired[best] = call
    if len(paired) != len(forward):
        return None
    backward = [paired[f] for f in forward]
    # ... and each backward call reads exactly one output of the next layer's backward (the
    # gradient of its output).
    for cur, nxt in zip(backward, backward[1:]):
        if len(_reads_from(cur, nxt)) != 1:
            return None
    return RepeatChain(forward, backward)


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
    """A copy of ``joint`` keeping the chain's first k-1 layers and its last one (k layers in
    all), or None if the left-out layers cannot be cut out cleanly."""
    n = len(chain)
    if not 2 <= k < n:
        return None
    gm, env = _copy(joint)
    fw = [env[c] for c in chain.forward]
    bw = [env[c] for c in chain.backward]
    dropped_fw, dropped_bw = fw[k - 1:n - 1], bw[k - 1:n - 1]
    # Forward: the last layer reads what the first left-out layer read.
    (block_in,) = _reads_from(fw[k - 1], fw[k - 2])
    (block_out,) = _reads_from(fw[n - 1], fw[n - 2])
    # Backward: layer k-2 reads the gradient the last layer's backward hands down.
    (grad_out,) = _reads_from(bw[n - 2], bw[n - 1])
    (grad_in,) = _reads_from(bw[k - 2], bw[k - 1])
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
