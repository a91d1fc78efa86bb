"""resident_parameters: parameters the plan keeps on the device for the whole step.

A streamed parameter is loaded twice per step (forward and backward). A resident one is
loaded once, at the start of the forward, and its device copy is handed to the backward as
a planned saved value: one host-to-device copy per step instead of two, for device memory
held across the step. The planner makes parameters resident when the budget allows.

Joint stage, before ``recompute``: insert the load in the joint graph and point every use
(forward and backward) at it, so the partitioner saves the device copy instead of the host
parameter. The joint graph is rebuilt for each candidate plan, so the pass first removes
the loads an earlier candidate inserted.
"""
from __future__ import annotations

import torch.fx as fx

from megacompile.core import ops
from megacompile.core import torch_compat as compat
from megacompile.core.enums import Phase, Placement, Role
from megacompile.core.node_info import NodeInfo, identifier, info, is_view_node, set_nbytes
from megacompile.passes.contract import PassContract

CONTRACT = PassContract(
    name="resident_parameters",
    stages=("joint",),
    requires=frozenset({"annotated"}),
    uses=frozenset({"host_casts_placed"}),
    provides=frozenset({"resident_loads"}),
)


def used_in_both_phases(joint: fx.GraphModule) -> list[fx.Node]:
    """Parameter placeholders read by the forward and by the backward."""
    out = []
    for node in joint.graph.nodes:
        if not compat.is_primal(node) or info(node).role != "param":
            continue
        # Readers through views too: the forward's t(weight) is what the backward reuses.
        readers, stack = [], [node]
        while stack:
            cur = stack.pop()
            for u in cur.users:
                if u.op != "call_function":
                    continue
                readers.append(u)
                if is_view_node(u) and not compat.is_backward_tagged(u):
                    stack.append(u)
        if any(compat.is_backward_tagged(u) for u in readers) and any(
                not compat.is_backward_tagged(u) for u in readers):
            out.append(node)
    return out


def run(gm: fx.GraphModule, ctx) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is ops.load:  # the joint graph holds no other loads
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    resident = set(ctx.plan.resident)
    if not resident:
        return
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1]
    for param in used_in_both_phases(gm):
        source = info(param).source
        if source not in resident:
            continue
        users = [u for u in param.users]
        with graph.inserting_after(anchor):
            load = graph.create_node("call_function", ops.load, (param, source), name=f"load__{identifier(source)}")
        anchor = load
        load.meta["val"] = param.meta.get("val")
        load.meta["partitioner_tag"] = "is_forward"
        load.meta["megatrain"] = NodeInfo(
            layer=info(param).layer, role=Role.MEMORY, phase=Phase.FORWARD, placement=Placement.DEVICE, source=source,
            decision="resident",
            reason=ctx.plan.resident_reason.get(
                source, "kept on the device for the whole step: one load per step instead of two"),
        )
        set_nbytes(load.meta["megatrain"], param.meta.get("val"))
        for user in users:
            user.replace_input_with(param, load)
