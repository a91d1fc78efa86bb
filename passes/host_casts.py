"""host_casts: dtype casts that shrink what crosses the link run on the host.

Under ``precision="bf16"`` the graph is traced under ``torch.autocast``, so it holds the casts
autocast makes: ``_to_copy(weight, dtype=bfloat16)`` in front of every matmul, and in the
backward ``_to_copy(grad, dtype=float32)`` turning each bf16 weight gradient into the fp32
gradient of the fp32 parameter. Where such a cast runs decides the bytes on the link:

- a down-cast of a host tensor (a parameter, a user input) runs on the host, before its
  ``load``: the load then carries 2 bytes per element instead of 4 (stream_parameters loads
  the cast's result, not the fp32 tensor);
- an up-cast whose result the graph hands back to the host (a gradient, a user output) runs
  on the host too, after its ``offload``: the bf16 value crosses and the fp32 value is made
  on the host (offload_gradients offloads the cast's input and waits before the cast).

Such a cast is an explicit host op: ``NodeInfo.placement == "host"``, ``decision ==
"host_cast"``. It reads host values only, owns no device bytes, and the executor runs it on
the host. The recompute pass never saves a parameter's host cast: like a view of a host
tensor, the backward derives it again from the host tensor (and loads it again).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from megacompile.core.enums import Placement
from megacompile.core.node_info import identifier, info, set_nbytes
from megacompile.passes.contract import PassContract

CONTRACT = PassContract(
    name="host_casts",
    stages=("joint", "forward", "backward", "inference"),
    requires=frozenset({"annotated"}),
    provides=frozenset({"host_casts_placed"}),
)

HOST_CAST = "host_cast"
_CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def _cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype of a pure dtype cast (same device, same layout), else None."""
    if node.op != "call_function" or node.target not in _CASTS:
        return None
    src, out = node.args[0], node.meta.get("val")
    if not isinstance(src, fx.Node) or not isinstance(src.meta.get("val"), torch.Tensor):
        return None
    if not isinstance(out, torch.Tensor) or out.device != src.meta["val"].device:
        return None
    extra = set(node.kwargs) - {"dtype", "layout", "device"}
    if extra or node.kwargs.get("layout", torch.strided) != torch.strided:
        return None
    return out.dtype


def _shrinks(node: fx.Node) -> bool:
    return node.meta["val"].element_size() < node.args[0].meta["val"].element_size()


def _grows(node: fx.Node) -> bool:
    return node.meta["val"].element_size() > node.args[0].meta["val"].element_size()


def is_host_cast(node: fx.Node) -> bool:
    return node.op == "call_function" and info(node).decision == HOST_CAST


def _returned_to_host(gm: fx.GraphModule, ctx) -> list[fx.Node]:
    """Values the graph hands back to the host side: gradients, user outputs."""
    output = next(iter(gm.graph.find_nodes(op="output")))
    outs = list(output.args[0])
    if ctx.stage == "forward":
        outs = outs[: ctx.num_user_outputs]
    return [o for o in outs if isinstance(o, fx.Node)]


def _mark_host(node: fx.Node, reason: str) -> None:
    ni = info(node)
    ni.placement = Placement.HOST
    ni.decision, ni.reason = HOST_CAST, reason
    src = info(node.args[0]).source
    if src and ni.source is None:
        dtype = str(node.meta["val"].dtype).replace("torch.", "")
        ni.source = f"{src}.{dtype}"
    set_nbytes(ni, node.meta["val"])


def run(gm: fx.GraphModule, ctx) -> None:
    for node in gm.graph.nodes:
        # A copy of a joint node keeps the joint's decision; this graph decides again.
        if info(node).decision == HOST_CAST:
            info(node).decision = info(node).reason = None
        if _cast_dtype(node) is None:
            continue
        src = node.args[0]
        if src.op == "placeholder" and info(src).placement == "host" and _shrinks(node):
            _mark_host(node, f"cast on the host: the load carries {node.meta['val'].element_size()} bytes per "
                             f"element, not {src.meta['val'].element_size()}")
            if info(node).layer is None:
                # Its load belongs to the input's layer (a parameter's): a cast traced outside
                # any module (the weights of a token-chunked run) would leave it untagged.
                info(node).layer = info(src).layer
    if ctx.stage != "joint" and "outputs_offloaded" in ctx.coming_facts:
        output = next(iter(gm.graph.find_nodes(op="output")))
        saved = set(list(output.args[0])[ctx.num_user_outputs:]) if ctx.stage == "forward" else set()
        for value in _returned_to_host(gm, ctx):
            if value in saved:
                continue  # the backward reads it on the device
            if _cast_dtype(value) is None or not _grows(value) or is_host_cast(value):
                continue
            if len(value.users) != 1:
                continue  # the device also reads the wide value
            if info(value.args[0]).placement != "device":
                continue
            _mark_host(value, f"cast on the host after the offload: {value.args[0].meta['val'].element_size()} "
                              f"bytes per element cross the link, not {value.meta['val'].element_size()}")


def host_cast_label(node: fx.Node) -> str:
    return identifier(info(node).source or node.name)
