"""The runtime planner's last rung one layer at a time (``STREAMED``: "recompute, layer input
offloaded"): which values of the recompute plan are one decoder layer's inputs, and the plan
of a per-layer mix in which some layers are replayed from inputs kept on the host.

The runtime builds the rung for all layers at once (``flat_planner.streaming_minimum_spec``:
recompute everywhere, every saved value offloaded); a per-layer mix needs to know which saved
values belong to which layer, so that only the streamed layers' inputs leave the device.
"""
from __future__ import annotations

from megacompile.cli.plan_command import STREAMED
from megacompile.core.enums import Policy, Role
from megacompile.core.node_info import has_info, info
from megacompile.plan.flat_planner import STREAMING_REASON
from megacompile.plan.training_plan import PlanSpec


def layer_inputs(recompute, decoder: list[str]) -> dict[str, list[str]]:
    """Saved values of the recompute plan (an ``Attempt``) that one decoder layer alone reads.

    A value read in the forward by one decoder layer only (its input from the layer before,
    or from the embedding), or read by none and made by that layer (what its backward reads
    without replaying: attention's output and log-sum-exp). Values several layers read (the
    mask, the rotary tables) and the head's input are glue: they follow the glue's policy.
    Parameters are not activations (they stream whatever the plan).
    """
    nodes = {n.name: n for n in recompute.forward.graph.nodes}
    out: dict[str, list[str]] = {}
    for name in recompute.plan.saved_values:
        node = nodes.get(name)
        if node is None or not has_info(node) or info(node).role != Role.COMPUTE:
            continue
        readers = {info(u).layer if has_info(u) else None for u in node.users if u.op != "output"} - {None}
        owners = readers or {info(node).layer}
        if len(owners) == 1 and next(iter(owners)) in decoder:
            out.setdefault(next(iter(owners)), []).append(name)
    return out


def mixed_spec(name: str, layer_policy: dict, inputs: dict, default: str = "keep") -> PlanSpec:
    """A per-layer plan (layer -> keep | offload | recompute | STREAMED): a streamed layer is a
    recompute layer whose inputs (``inputs[layer]``, see ``layer_inputs``) are offloaded."""
    offloaded = [v for layer, p in layer_policy.items() if p == STREAMED for v in inputs.get(layer, ())]
    return PlanSpec(
        name=name, default_policy=Policy.RECOMPUTE if default == STREAMED else default,
        layer_policy={layer: Policy.RECOMPUTE if p == STREAMED else p for layer, p in layer_policy.items()},
        value_policy={v: Policy.OFFLOAD for v in offloaded}, value_reason={v: STREAMING_REASON for v in offloaded})
