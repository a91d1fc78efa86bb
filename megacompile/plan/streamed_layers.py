"""The planner's last rung, all layers at once or one layer at a time (``STREAMED``: "recompute,
layer input offloaded"): a streamed layer is replayed in the backward from its inputs, and those
inputs are offloaded in the forward and loaded back before the layer's backward, so nothing of
the layer stays on the device between its forward and its backward.

- ``streaming_minimum_spec``: every layer streamed (the ladder's bottom rung);
- ``layer_inputs``: which saved values of the recompute plan belong to one layer;
- ``mixed_spec``: a per-layer plan in which some layers are streamed (the ladder's per-layer
  mixes below the 3-option floor, ``flat_planner.plan_training``; ``megacompile plan``'s
  extrapolated mixes, ``cli/plan_command/policy_capture.py``).
"""
from __future__ import annotations

from megacompile.core.enums import Policy, Role
from megacompile.core.node_info import has_info, info
from megacompile.plan.memory_estimate import storage_root
from megacompile.plan.training_plan import PlanSpec

# The per-layer policy (a layer_policy of RECOMPUTE plus its inputs' value_policy of OFFLOAD).
STREAMED = "recompute, layer input offloaded"
STREAMING_REASON = "layer input of a replayed layer, kept on the host until its backward"


def streaming_reason(layer: str) -> str:
    """The reason of one streamed layer's input (``NodeInfo.reason``), naming the layer."""
    return f"layer input of replayed layer '{layer}' ({STREAMED}), kept on the host until its backward"


def streaming_minimum_spec(recompute_all) -> PlanSpec:
    """The ladder's bottom rung: every layer replayed, and every value the recompute-all plan
    (an ``flat_planner.Attempt``) saves (the layers' inputs) offloaded to the host."""
    saved = recompute_all.plan.saved_values
    return PlanSpec(name="recompute, layer inputs offloaded (all layers)", default_policy=Policy.RECOMPUTE,
                    value_policy={v: Policy.OFFLOAD for v in saved},
                    value_reason={v: STREAMING_REASON for v in saved})


def layer_inputs(recompute, layers: list[str]) -> dict[str, list[str]]:
    """Saved values of the recompute plan (an ``Attempt``) that one of ``layers`` alone reads.

    A value read in the forward by one layer only (its input from the layer before, or from
    the embedding), or read by none and made by that layer (what its backward reads without
    replaying: attention's output and log-sum-exp). Values several layers read (the mask, the
    rotary tables) and values of layers not listed are glue: they follow the glue's policy.
    Parameters are not activations (they stream whatever the plan).
    """
    nodes = {n.name: n for n in recompute.forward.graph.nodes}
    wanted = set(layers)
    out: dict[str, list[str]] = {}
    for name in recompute.plan.saved_values:
        node = nodes.get(name)
        if node is None or not has_info(node) or info(node).role != Role.COMPUTE:
            continue
        readers = {info(u).layer if has_info(u) else None for u in node.users if u.op != "output"} - {None}
        owners = readers or {info(node).layer}
        if len(owners) == 1 and next(iter(owners)) in wanted:
            out.setdefault(next(iter(owners)), []).append(name)
    return out


def layer_input_bytes(recompute, inputs: dict[str, list[str]]) -> dict[str, int]:
    """Device bytes of each layer's inputs (``layer_inputs``) in the recompute plan, by
    storage (a saved view counts its base once): what streaming the layer copies each way."""
    nodes = {n.name: n for n in recompute.forward.graph.nodes}
    memo: dict = {}
    out: dict[str, int] = {}
    for layer, names in inputs.items():
        roots = {storage_root(nodes[v], memo) for v in names if v in nodes}
        out[layer] = sum(info(r).nbytes_hint for r in roots if has_info(r))
    return out


def mixed_spec(name: str, layer_policy: dict, inputs: dict, default: str = "keep") -> PlanSpec:
    """A per-layer plan (layer -> keep | offload | recompute | STREAMED): a streamed layer is a
    recompute layer whose inputs (``inputs[layer]``, see ``layer_inputs``) are offloaded."""
    offloaded = {v: layer for layer, p in layer_policy.items() if p == STREAMED for v in inputs.get(layer, ())}
    return PlanSpec(
        name=name, default_policy=Policy.RECOMPUTE if default == STREAMED else default,
        layer_policy={layer: Policy.RECOMPUTE if p == STREAMED else p for layer, p in layer_policy.items()},
        value_policy={v: Policy.OFFLOAD for v in offloaded},
        value_reason={v: streaming_reason(layer) for v, layer in offloaded.items()})
