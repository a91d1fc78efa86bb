"""offload_gradients: every value the graph hands back to the host leaves the device early.

Backward: each gradient is copied to the host right after the op that produces it
(``offload``), its device copy is evicted after its last use, and the host copies are waited
for just before the graph returns. AOTAutograd then accumulates the host gradient into
``param.grad`` (so gradient accumulation over micro-batches works as in eager).

Forward / inference: the values returned to the user (the loss, outputs) are offloaded the
same way. Values the forward saves for the backward stay on the device: that residency is
what the plan decided (``plan.saved_values``).

A returned value that is a host cast (``host_casts``: bf16 gradient -> fp32) is not offloaded
itself: its narrow device input is, and the cast runs on the host after the waits.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from megacompile.core import ops
from megacompile.core.enums import Placement, Role
from megacompile.core.node_info import NodeInfo, identifier, info, set_nbytes
from megacompile.passes.contract import PassContract
from megacompile.passes.host_casts import is_host_cast

CONTRACT = PassContract(
    name="offload_gradients",
    stages=("forward", "backward", "inference"),
    requires=frozenset({"annotated"}),
    uses=frozenset({"host_casts_placed", "parameters_streamed"}),
    provides=frozenset({"outputs_offloaded"}),
)


def _output_label(ctx, index: int) -> str:
    if ctx.stage == "backward":
        source = ctx.input_names[index] if index < len(ctx.input_names) else f"input_{index}"
        return f"grad.{source}"
    return f"output_{index}"


def run(gm: fx.GraphModule, ctx) -> None:
    graph = gm.graph
    output = next(iter(graph.find_nodes(op="output")))
    outs = list(output.args[0])
    if ctx.stage == "forward":
        # User outputs, and the saved activations the plan puts on the host.
        indices = list(range(ctx.num_user_outputs)) + [
            i for i in range(ctx.num_user_outputs, len(outs))
            if isinstance(outs[i], fx.Node) and info(outs[i]).decision == "offload"
        ]
    else:
        indices = list(range(len(outs)))
    offloaded: dict[fx.Node, fx.Node] = {}
    host_casts: list[fx.Node] = []
    order = _order(graph)  # positions of the nodes as captured (insertions keep their order)
    for index in indices:
        value = outs[index]
        if not isinstance(value, fx.Node) or not isinstance(value.meta.get("val"), torch.Tensor):
            continue
        cast = None
        if is_host_cast(value) and info(value.args[0]).placement == "device":
            # The narrow input crosses; the cast runs on the host after the copy lands.
            cast, value = value, value.args[0]
            if cast not in host_casts:
                host_casts.append(cast)
        if info(value).placement != "device":
            continue
        if cast is not None and value in offloaded:
            cast.replace_input_with(value, offloaded[value])
            continue
        if value in offloaded:
            outs[index] = offloaded[value]
            continue
        user_output = index < ctx.num_user_outputs or ctx.stage != "forward"
        label = _output_label(ctx, index) if user_output else f"act.{value.name}"
        if cast is not None:
            label += "." + str(value.meta["val"].dtype).replace("torch.", "")
        name = identifier(label)
        with graph.inserting_after(value):
            host = graph.create_node("call_function", ops.offload, (value, label), name=f"offload__{name}")
        host.meta["val"] = value.meta["val"]
        host.meta["megatrain"] = NodeInfo(
            layer=info(value).layer, role=Role.MEMORY, phase=info(value).phase, placement=Placement.HOST,
            source=label, decision="offload",
            reason="gradient leaves the device as soon as it is produced" if ctx.stage == "backward"
            else "returned to the user on the host" if index < ctx.num_user_outputs
            else "saved activation kept on the host until the backward",
        )
        set_nbytes(host.meta["megatrain"], value.meta["val"])
        # The device copy dies after its last use (the offload itself, unless the forward
        # also saves it for the backward).
        users = [u for u in value.users if u is not output and u is not host and u is not cast]
        keeps_on_device = ctx.stage == "forward" and any(
            o is value and info(o).decision != "offload" for o in outs[ctx.num_user_outputs:]
        )
        if not keeps_on_device:
            if any(u not in order for u in users):  # a node this loop inserted: number them again
                order = _order(graph)
            # ``host`` sits right after ``value``: no reader of ``value`` comes before it.
            last = max(users, key=order.__getitem__) if users else host
            with graph.inserting_after(last):
                evict = graph.create_node("call_function", ops.evict, (value,), name=f"evict__{name}")
            evict.meta["megatrain"] = NodeInfo(layer=info(value).layer, role=Role.MEMORY, phase=info(value).phase,
                                               placement=Placement.DEVICE, source=label)
        offloaded[value] = host
        if cast is not None:
            cast.replace_input_with(value, host)
        else:
            outs[index] = host
    with graph.inserting_before(output):
        for host in offloaded.values():
            wait = graph.create_node("call_function", ops.wait, (host,), name=f"wait__{host.name}")
            wait.meta["megatrain"] = NodeInfo(layer=info(host).layer, role=Role.MEMORY, phase=info(host).phase,
                                              placement=Placement.HOST, source=info(host).source)
    # Host casts read landed copies: they run after the waits, right before the return.
    for cast in host_casts:
        output.prepend(cast)
    output.args = (tuple(outs),) if isinstance(output.args[0], tuple) else (outs,)


def _order(graph: fx.Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}
