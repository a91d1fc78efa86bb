"""recompute: choose what the forward saves for the backward, and replay the rest.

Joint stage: under the plan's policy, decide for every forward value the backward needs
whether it is saved (a device activation that lives from forward to backward) or recomputed
in the backward, and record the decision and its reason in NodeInfo. The partitioner then
splits the joint graph with exactly these saved values.

The plan gives a policy per layer (``plan.layer_policy``):
- ``keep``: save every activation of the layer the backward reads, on the device.
- ``offload``: save them too, but on the host: offload_gradients copies them out in the
  forward and stream_parameters loads them back before the backward needs them.
- ``recompute``: save only the values that cross a layer boundary (each layer's inputs), so a
  layer's internals are replayed in backward from its input.
In both, views of host inputs (``t(weight)``) and host casts (``host_casts``: a parameter cast
to bf16 on the host) are never saved: the backward re-derives them from the host tensor, so
no parameter copy stays on the device (or on the host) from forward to backward.
Random ops are always saved (replaying them would draw new numbers), so is the fused LM
head's log-sum-exp (a replay would run the head's whole matmul to save 4 bytes a token), and so
is every op that reads an input the step updates in place (BatchNorm's ``_native_batch_norm_legit_functional``
reads the running statistics, which AOTAutograd overwrites with their new values once the
forward has run): replayed in the backward, it would read the updated buffer, whose version
autograd also refuses for a saved tensor. The running statistics are updated once, by the
forward, as in eager.

Backward stage: the partitioner copies recomputed forward ops to the front of the backward
graph, which would replay every layer at once. This pass sinks each recomputed op to just
before its first use, so a layer is replayed right before its backward runs.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from megacompile.core import fused_head, ops
from megacompile.core import torch_compat as compat
from megacompile.core.node_info import info, is_view_node
from megacompile.passes.contract import PassContract
from megacompile.passes.host_casts import is_host_cast

CONTRACT = PassContract(
    name="recompute",
    stages=("joint", "backward"),
    requires=frozenset({"annotated"}),
    uses=frozenset({"host_casts_placed", "resident_loads"}),
    # joint: the saved values are marked under the plan; backward: replays sit before first use
    provides=frozenset({"recompute_applied"}),
)


def forward_nodes(joint: fx.GraphModule) -> list[fx.Node]:
    """Nodes of the joint graph that belong to the forward, in order."""
    last = None
    for node in joint.graph.nodes:
        if compat.is_forward_tagged(node) or compat.is_primal(node):
            last = node
    result = []
    for node in joint.graph.nodes:
        if node.op == "output":
            break
        if not compat.is_tangent(node):
            result.append(node)
        if node is last:
            break
    return result


def num_forward_outputs(joint: fx.GraphModule) -> int:
    """How many of a joint graph's outputs belong to the forward: AOTAutograd's joint graph
    returns the forward's outputs, then one gradient per primal input."""
    output = next(iter(joint.graph.find_nodes(op="output")))
    primals = sum(1 for n in joint.graph.find_nodes(op="placeholder") if compat.is_primal(n))
    return len(output.args[0]) - primals


def _is_random(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, compat.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _host_view_roots(node: fx.Node, memo: dict) -> list[fx.Node] | None:
    """The primals a node is a pure view of (None if it computes anything)."""
    if node in memo:
        return memo[node]
    if compat.is_primal(node):
        result = [node]
    elif is_host_cast(node) and compat.is_primal(node.args[0]):
        result = [node.args[0]]  # a host-side cast re-derives as cheaply as a view
    elif is_view_node(node) and node.all_input_nodes:
        roots: list[fx.Node] = []
        for inp in node.all_input_nodes:
            r = _host_view_roots(inp, memo)
            if r is None:
                roots = None
                break
            roots.extend(r)
        result = roots
    else:
        result = None
    memo[node] = result
    return result


def _mark(node: fx.Node, decision: str, reason: str) -> None:
    ni = info(node)
    ni.decision, ni.reason = decision, reason


@dataclasses.dataclass
class SavedValueWalk:
    """What the forward must hand to the backward, before any policy is applied.

    ``needed``: forward values the backward reads directly (the candidates for saving);
    ``saved_sym``: sizes it needs (dynamic shapes). Built once per joint graph and reused for
    every candidate plan and every per-activation price.
    """

    fwd: list[fx.Node]
    fwd_set: set
    needed: list[fx.Node]
    saved_sym: list[fx.Node]
    # Inputs the step updates in place (compat.mutated_inputs): no replay may read them.
    mutated: set = dataclasses.field(default_factory=set)

    @classmethod
    def of(cls, joint: fx.GraphModule) -> "SavedValueWalk":
        fwd = forward_nodes(joint)
        fwd_set = set(fwd)
        in_backward = lambda n: n not in fwd_set and n.op != "output"  # noqa: E731
        output = next(iter(joint.graph.find_nodes(op="output")))
        needed: list[fx.Node] = [n for n in fwd if any(in_backward(u) for u in n.users)]
        # A gradient can be a forward value itself (rare, e.g. an identity); the backward needs it.
        for out in list(output.args[0])[num_forward_outputs(joint):]:
            if isinstance(out, fx.Node) and out in fwd_set and out not in needed:
                needed.append(out)
        saved_sym = [n for n in needed if compat.is_sym_node(n)]
        return cls(fwd, fwd_set, [n for n in needed if not compat.is_sym_node(n)], saved_sym,
                   set(compat.mutated_inputs(joint)))

    def walk(self, layer_policy: dict[str, str], default_policy: str = "keep",
             value_policy: dict[str, str] | None = None, value_reason: dict[str, str] | None = None,
             start: list[fx.Node] | None = None) -> tuple[dict, list[fx.Node], dict]:
        """Decide, without touching the graph, which values are saved and which are replayed.

        ``value_policy`` (node name -> keep | offload | recompute) overrides the layer policy
        for the candidates it names (all members of one storage group get the same entry).
        A recomputed value is replayed from its inputs: inputs that are saved anyway cost
        nothing; inputs the backward does not read are replayed too, within their layer (a
        value that crosses into another layer is saved instead: the chain stops there).
        ``start``: walk only from these values (pricing one candidate); default: all needed.
        Returns (saved: node -> (decision, reason), saved_sym, marks: node -> (decision, reason)).
        """
        value_policy = value_policy or {}
        value_reason = value_reason or {}
        fwd_set = self.fwd_set
        candidates = set(self.needed)
        saved_sym = list(self.saved_sym)
        view_memo: dict = {}
        saved: dict[fx.Node, tuple[str, str]] = {}
        marks: dict[fx.Node, tuple[str, str]] = {}

        def layer_policy_of(n: fx.Node) -> str:
            return layer_policy.get(info(n).layer, default_policy)

        def decision_of(n: fx.Node) -> str:
            return value_policy.get(n.name) or layer_policy_of(n)

        def save(n: fx.Node, reason: str) -> None:
            if n in saved:
                return
            if n.target is ops.load:
                entry = ("resident", reason)
            elif n.op != "placeholder" and decision_of(n) == "offload":
                entry = ("offload", value_reason.get(n.name)
                         or f"layer '{info(n).layer}' offloads its saved activations to the host")
            else:
                entry = ("save", reason)
            saved[n] = marks[n] = entry

        def replay(n: fx.Node, reason: str) -> None:
            marks[n] = ("recompute", reason)
            worklist.extend(i for i in n.all_input_nodes if i in fwd_set)

        def replay_reason(n: fx.Node) -> str:
            if layer_policy_of(n) == "recompute":
                return "inside a layer: replayed from the layer's input"
            return "not read by the backward: replayed for a recomputed value"

        def pinned(n: fx.Node) -> str | None:
            """Why the backward cannot replay ``n`` (None: it can)."""
            if _is_random(n):
                return "random op: replay would differ"
            if n.target is fused_head.FORWARD:
                return "fused LM head: its log-sum-exp is 4 bytes a token, a replay the head's whole matmul"
            if n.target is fused_head.FORWARD_WITH_GRADS:
                return "fused LM head with its gradients: a replay would run the head's three matmuls again"
            for i in n.all_input_nodes if self.mutated else ():
                for root in _host_view_roots(i, view_memo) or ():
                    if root in self.mutated:
                        return (f"reads '{info(root).source or root.name}', which the step updates in place: "
                                f"a replay in the backward would read the updated value")
            return None

        def crosses_layer(n: fx.Node) -> bool:
            return any(u in fwd_set and u.op != "output" and info(u).layer != info(n).layer for u in n.users)

        worklist = list(self.needed if start is None else start)
        visited: set[fx.Node] = set()
        while worklist:
            n = worklist.pop()
            if n in visited:
                continue
            visited.add(n)
            if compat.is_sym_node(n):
                # A size (dynamic shapes) a replayed op needs: saved as a SymInt, not a tensor.
                if n not in saved_sym:
                    saved_sym.append(n)
                continue
            if n.target is ops.load:
                save(n, "resident parameter: its device copy serves the backward too")
                continue
            roots = _host_view_roots(n, view_memo)
            if roots is not None:
                for r in roots:
                    save(r, "host tensor: the backward loads it again")
                if n not in roots and not is_host_cast(n):
                    marks[n] = ("recompute", "view of a host tensor, free to re-derive")
                continue
            producer = n.args[0] if n.target is operator.getitem else n
            why_pinned = pinned(producer) if isinstance(producer, fx.Node) and producer.op == "call_function" else None
            if isinstance(n.meta.get("val"), (tuple, list)):
                if why_pinned:
                    # Save a tuple op's outputs, never the tuple itself.
                    worklist.extend(u for u in n.users if u.target is operator.getitem and u in fwd_set)
                else:
                    # Reached only from a replayed output: replay the op.
                    replay(n, replay_reason(n))
                continue
            if n.op == "placeholder" or why_pinned:
                save(n, why_pinned or "graph input")
                continue
            chosen = value_policy.get(n.name) if n in candidates else None
            if chosen is not None:
                if chosen != "recompute" or not n.all_input_nodes:
                    save(n, value_reason.get(n.name) or f"planner: {chosen}")
                else:
                    replay(n, value_reason.get(n.name) or "planner: recompute")
                continue
            policy = layer_policy_of(n)
            if policy != "recompute" and (n in candidates or crosses_layer(n)):
                save(n, f"layer policy {policy}")
                continue
            if crosses_layer(n) or not n.all_input_nodes:
                save(n, "layer boundary: the backward replays the layer from it")
                continue
            replay(n, replay_reason(n))
        return saved, saved_sym, marks


def choose_saved(joint: fx.GraphModule, layer_policy: dict[str, str], default_policy: str = "keep",
                 value_policy: dict[str, str] | None = None,
                 value_reason: dict[str, str] | None = None) -> tuple[list[fx.Node], list[fx.Node]]:
    """The values the forward saves, under a keep / recompute / offload policy per layer and,
    where the planner decided per activation, per value; decisions recorded in NodeInfo."""
    saved, saved_sym, marks = SavedValueWalk.of(joint).walk(layer_policy, default_policy, value_policy,
                                                            value_reason)
    for node, (decision, reason) in marks.items():
        _mark(node, decision, reason)
    return list(saved), saved_sym


def _sink_recomputed(gm: fx.GraphModule) -> None:
    graph = gm.graph
    nodes = list(graph.nodes)
    recomputed = {n for n in nodes if n.op == "call_function" and info(n).phase == "recompute"}
    order: list[fx.Node] = []
    emitted: set[fx.Node] = set()

    def emit(n: fx.Node) -> None:
        stack = [(n, False)]
        while stack:
            cur, expanded = stack.pop()
            if cur in emitted:
                continue
            if expanded:
                emitted.add(cur)
                order.append(cur)
                # Take a tuple op's outputs apart right away, so the tuple (which keeps
                # every output alive) dies at once and each output lives only as long as
                # its own uses.
                for user in cur.users:
                    if user.target is operator.getitem and user not in emitted:
                        emitted.add(user)
                        order.append(user)
                continue
            stack.append((cur, True))
            for inp in reversed(cur.all_input_nodes):
                if inp not in emitted:
                    stack.append((inp, False))

    for n in nodes:
        if n.op == "placeholder":
            emit(n)
    for n in nodes:
        if n not in recomputed:
            emit(n)
    # Placeholders stay first, in their order; everything else follows in demand order.
    # (Recomputed ops nobody needs are dead; DCE removes them below.)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    for n in order:
        if n.op == "placeholder":
            continue
        if anchor is None:
            first = next(iter(graph.nodes))
            if first is not n:
                first.prepend(n)
        else:
            anchor.append(n)
        anchor = n
    graph.eliminate_dead_code()


def run(gm: fx.GraphModule, ctx) -> None:
    if ctx.stage == "joint":
        saved, saved_sym = choose_saved(gm, ctx.plan.layer_policy, ctx.plan.default_policy,
                                        ctx.plan.value_policy, ctx.plan.value_reason)
        ctx.plan.saved_values = [n.name for n in saved]
        ctx.plan.saved_sym_nodes = [n.name for n in saved_sym]
    else:
        _sink_recomputed(gm)
        ctx.plan.recomputed_ops = [
            n.name for n in gm.graph.nodes if n.op == "call_function" and info(n).phase == "recompute"
        ]
