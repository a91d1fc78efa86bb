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
from megacompile.passes.host_casts import is_host_cast

CONTRACT = PassContract(
    name="resident_parameters",
    stages=("joint",),
    requires=frozenset({"annotated"}),
    uses=frozenset({"host_casts_placed"}),
    provides=frozenset({"resident_loads"}),
)


def _host_copies(param: fx.Node) -> list[fx.Node]:
    """The parameter's narrowing host casts (under bf16, its bf16 copy): what its loads carry,
    and what both passes read where autocast's forward cast is reused by the backward."""
    width = param.meta["val"].element_size()
    return [u for u in param.users if is_host_cast(u) and u.meta["val"].element_size() < width]


def _read_in_both_phases(value: fx.Node, skip: tuple = ()) -> bool:
    """Whether the forward and the backward both read ``value`` (readers in ``skip`` aside),
    directly or through views (the forward's t(weight) is what the backward reuses)."""
    readers, stack = [], [value]
    while stack:
        cur = stack.pop()
        for u in cur.users:
            if u.op != "call_function" or u in skip:
                continue
            readers.append(u)
            if is_view_node(u) and not compat.is_backward_tagged(u):
                stack.append(u)
    return any(compat.is_backward_tagged(u) for u in readers) and any(
        not compat.is_backward_tagged(u) for u in readers)


def used_in_both_phases(joint: fx.GraphModule) -> list[fx.Node]:
    """Parameter placeholders read by the forward and by the backward, as they are or through
    one of their host copies."""
    return [node for node in joint.graph.nodes
            if compat.is_primal(node) and info(node).role == "param" and _crossing_values(node, _host_copies(node))]


def _crossing_values(param: fx.Node, copies: list[fx.Node]) -> list[fx.Node]:
    """What of the parameter both passes read: the parameter as it is (its host ``copies``
    aside, which read it on the host) and each of those copies."""
    own = [param] if _read_in_both_phases(param, skip=tuple(copies)) else []
    return own + [c for c in copies if _read_in_both_phases(c)]


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
        reason = ctx.plan.resident_reason.get(
            source, "kept on the device for the whole step: one load per step instead of two")
        # What crosses: the parameter as it is, or a host copy of it (the bf16 copy, loaded right
        # after its cast; the cast stays on the host, served by the persistent copy), whichever
        # both passes read (a tied embedding: its lookup reads the weight in the forward only).
        copies = _host_copies(param)
        for value in _crossing_values(param, copies):
            users = [u for u in value.users if u not in copies]  # a host copy keeps reading the host tensor
            name = source if value is param else info(value).source or f"{source}.{value.name}"
            with graph.inserting_after(anchor if value is param else value):
                load = graph.create_node("call_function", ops.load, (value, name), name=f"load__{identifier(name)}")
            if value is param:
                anchor = load
            load.meta["val"] = value.meta.get("val")
            load.meta["partitioner_tag"] = "is_forward"
            load.meta["megatrain"] = NodeInfo(
                layer=info(param).layer, role=Role.MEMORY, phase=Phase.FORWARD, placement=Placement.DEVICE,
                source=name, decision="resident", reason=reason)
            set_nbytes(load.meta["megatrain"], value.meta.get("val"))
            for user in users:
                user.replace_input_with(value, load)
