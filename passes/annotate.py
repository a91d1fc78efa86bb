"""annotate: tag every node with its layer, role, phase, placement and bytes.

Layers come from ``nn_module_stack`` (forward ops) and ``fwd_nn_module_stack`` (backward ops,
which AOTAutograd copies from the forward op they differentiate); parameters get the layer
of the module that owns them. All later passes and the planner read these tags.

Runs on every stage, because partitioning copies nodes into new graphs: the copies get their
own NodeInfo (the joint graph's must not change when a forward pass rewrites its copy).
"""
from __future__ import annotations

import copy

import torch.fx as fx

from megacompile.core import torch_compat as compat
from megacompile.core.enums import Phase, Placement, Role
from megacompile.core.node_info import (
    META_KEY,
    NodeInfo,
    is_view_node,
    layer_of_module_path,
    normalize_module_path,
    set_nbytes,
)
from megacompile.core.ops import is_memory_op
from megacompile.passes.contract import PassContract

CONTRACT = PassContract(
    name="annotate",
    stages=("joint", "forward", "backward", "inference"),
    provides=frozenset({"annotated"}),
)


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    path, _type = list(stack.values())[-1]
    return normalize_module_path(path)


def _param_layer(name: str) -> str | None:
    module_path = name.rsplit(".", 1)[0] if "." in name else ""
    return layer_of_module_path(module_path) if module_path else None


def run(gm: fx.GraphModule, ctx) -> None:
    tangent_index = 0
    input_index = 0
    for node in gm.graph.nodes:
        # Partitioning may share one meta dict between a joint node and its copies.
        node.meta = dict(node.meta)
        old = node.meta.get(META_KEY)
        ni = copy.copy(old) if old is not None else NodeInfo()  # a shallow copy, like dataclasses.replace
        node.meta[META_KEY] = ni
        if ctx.stage == "joint":
            ni.decision = ni.reason = None  # a fresh plan decides again
        if node.op == "placeholder":
            if compat.is_primal(node) or ctx.stage == "inference":
                # An inference graph's inputs (``arg0_1``...) are the Dynamo graph's inputs.
                index = int(node.target.split("_")[-1]) - 1 if compat.is_primal(node) else input_index
                input_index += 1
                ni.source = ctx.input_names[index]
                ni.role = Role(ctx.input_roles[index])
                ni.layer = _param_layer(ni.source) if ni.role == "param" else None
                ni.placement = Placement.HOST
                ni.phase = Phase.FORWARD
            elif compat.is_tangent(node):
                ni.source = f"grad_output_{tangent_index}"
                tangent_index += 1
                ni.role = Role.TANGENT
                ni.placement = Placement.HOST
                ni.phase = Phase.BACKWARD
            else:
                # A value the forward saved for the backward (its NodeInfo was copied from
                # the forward node): a device activation, unless the plan offloaded it.
                ni.role = Role.SAVED
                ni.placement = Placement.HOST if ni.decision == "offload" else Placement.DEVICE
            set_nbytes(ni, node.meta.get("val"))
        elif node.op == "call_function" and not is_memory_op(node):
            ni.layer = layer_of_module_path(_module_path(node))
            ni.role = Role.COMPUTE
            ni.placement = Placement.DEVICE
            if ctx.stage == "backward" and compat.is_forward_tagged(node):
                ni.phase = Phase.RECOMPUTE
            elif compat.is_backward_tagged(node):
                ni.phase = Phase.BACKWARD
            elif ctx.stage != "backward":
                ni.phase = Phase.FORWARD
            else:
                ni.phase = Phase.BACKWARD
            val = node.meta.get("val")
            # Views and tuple-producing ops own no bytes: the base / the getitems do.
            if is_view_node(node) or isinstance(val, (tuple, list)):
                ni.nbytes, ni.nbytes_hint = 0, 0
            else:
                set_nbytes(ni, val)
        elif node.op == "output":
            ni.role = Role.OUTPUT
