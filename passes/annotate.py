"""annotate: tag every node with its layer, role, phase, placement and bytes.

Layers come from ``nn_module_stack`` (forward ops) and ``fwd_nn_module_stack`` (backward ops,
which AOTAutograd copies from the forward op they differentiate); parameters get the layer
of the module that owns them. All later passes and the planner read these tags.

Runs on every stage, because partitioning copies nodes into new graphs: the copies get their
own NodeInfo (the joint graph's must not change when a forward pass rewrites its copy).
"""
from __future__ import annotations

import functools

import torch
import torch.fx as fx

from megacompile.core import fused_head, token_chunks
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
from megacompile.passes.elide_causal_mask import NOTE_KEY as MASK_NOTE
from megacompile.passes.fuse_lm_head import NOTE_KEY as HEAD_NOTE

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


_LOSS_OPS = {torch.ops.aten.nll_loss_forward.default}


def _backward_note(node: fx.Node) -> str:
    return (f"fused (backward): each chunk of {node.args[6]} tokens makes its logits again and adds to the "
            f"gradients")


def _workspace(node: fx.Node, options) -> int:
    """The fused head's working set at the traced sizes, for the chunk kernels it will run
    with (Triton on CUDA where it is installed, torch ops elsewhere)."""
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args]
    if node.target is fused_head.FORWARD:
        hidden, weight, chunk, softcap, weight_grad = vals[0], vals[1], vals[4], vals[7], False
    elif node.target is fused_head.FORWARD_WITH_GRADS:
        hidden, weight, chunk, softcap, weight_grad = vals[0], vals[1], vals[4], vals[7], vals[9]
    else:
        hidden, weight, chunk, softcap, weight_grad = vals[1], vals[2], vals[6], vals[9], vals[10]
    triton = options.device == "cuda" and fused_head.triton_importable()
    vocab, width = (compat.int_hint(d) for d in weight.shape)
    return fused_head.workspace_bytes(node.target, compat.int_hint(hidden.shape[0]), vocab, width,
                                      weight.element_size(), chunk, softcap, triton, weight_grad)


def _chunked(node: fx.Node) -> tuple[int, str]:
    """A token-chunked run's working set at the traced sizes, and what inspect says of it."""
    vals = [fx.node.map_arg(a, lambda n: n.meta.get("val")) for a in node.args]
    body, chunks, tokens, shared = vals[:4]
    extra = vals[4:6] if node.target is token_chunks.BACKWARD else ()
    n = compat.int_hint(tokens[0].numel()) // max(1, compat.int_hint(tokens[0].shape[-1]))
    rows = min(n, token_chunks.chunk_rows(n, chunks))
    what = "backward: replays and backpropagates" if extra else "forward: computes"
    count = -(-n // rows)  # (a count above the tokens runs one token a chunk)
    note = (f"token-chunked run ({what} {token_chunks.body_of(body).describe()} over {count} chunk"
            f"{'s' if count != 1 else ''} of {rows} of {n} tokens)")
    return token_chunks.workspace_bytes(node.target, body, chunks, tokens, shared, *extra), note


@functools.lru_cache(maxsize=None)
def _is_attention(target) -> bool:
    return "scaled_dot_product" in str(target)  # (an op's str is built on every call: asked once per op)


def run(gm: fx.GraphModule, ctx) -> None:
    tangent_index = 0
    input_index = 0
    for node in gm.graph.nodes:
        # Partitioning may share one meta dict between a joint node and its copies.
        node.meta = dict(node.meta)
        old = node.meta.get(META_KEY)
        ni = old.copy() if old is not None else NodeInfo()  # a shallow copy, like dataclasses.replace
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
            # (AOTAutograd copies the Dynamo node's note to every aten node traced from it:
            # shown on the fused ops, and on the loss where it was not fused.)
            note = (node.meta.get("custom") or {}).get(HEAD_NOTE)
            ni.head_fusion = note if node.target in _LOSS_OPS else None
            if node.target in (fused_head.FORWARD, fused_head.FORWARD_WITH_GRADS):
                ni.head_fusion = note
            if node.target is fused_head.BACKWARD:
                ni.head_fusion = _backward_note(node)
            if node.target in fused_head.OPS:
                ni.workspace_bytes = _workspace(node, ctx.options)
            ni.token_chunks = None
            # Attention ops (forward and backward) say whether their mask was proven causal.
            ni.attention_mask = (node.meta.get("custom") or {}).get(MASK_NOTE) if _is_attention(node.target) else None
            if node.target in token_chunks.OPS:
                ni.workspace_bytes, ni.token_chunks = _chunked(node)
            # Views and tuple-producing ops own no bytes: the base / the getitems do.
            if is_view_node(node) or isinstance(val, (tuple, list)):
                ni.nbytes, ni.nbytes_hint = 0, 0
            else:
                set_nbytes(ni, val)
        elif node.op == "output":
            ni.role = Role.OUTPUT
