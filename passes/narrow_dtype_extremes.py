"""narrow_dtype_extremes: a fill with fp32's largest value, into a bf16 or fp16 value, fills
that dtype's largest instead.

Under ``precision="bf16"`` Dynamo traces the step before the backend adds autocast, so model
Python that reads a dtype at trace time sees fp32 (so it does in a step's own
``torch.autocast("cuda")`` region, which casts nothing on the host tensors Dynamo traces; the
backend retargets it). The common case is a mask: DeBERTa fills attention scores with
``torch.finfo(query.dtype).min``. Eager autocast reads bf16 there and fills bf16's least
value; the trace holds fp32's (-3.4028e38), which autocast's bf16 scores cannot hold, and the
fill raises "value cannot be converted to type c10::BFloat16 without
overflow" at run time. Such a value can only have come from a dtype read, so it is replaced by
the filled dtype's own extreme: exactly what eager autocast fills. Other values, and fills of
fp32 values, are left alone (an overflowing fill the user wrote still raises as in eager).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from megacompile.passes.contract import PassContract

CONTRACT = PassContract(name="narrow_dtype_extremes", stages=("joint", "inference"),
                        requires=frozenset({"annotated"}),  # the invariants ask every node for its NodeInfo
                        provides=frozenset({"dtype_extremes_narrowed"}))

aten = torch.ops.aten
# op -> position of its fill value among the args
FILLS = {
    aten.masked_fill.Scalar: 2, aten.fill.Scalar: 1, aten.full.default: 1, aten.full_like.default: 1,
    aten.new_full.default: 2, aten.index_fill.int_Scalar: 3,
}
_TRACED_EXTREME = torch.finfo(torch.float32).max
_NARROW = (torch.bfloat16, torch.float16)


def narrowed_value(node: fx.Node) -> float | None:
    """The value ``node`` should fill instead of the one it holds, or None to leave it."""
    if node.op != "call_function" or node.target not in FILLS:
        return None
    position, val = FILLS[node.target], node.meta.get("val")
    if len(node.args) <= position or not isinstance(val, torch.Tensor) or val.dtype not in _NARROW:
        return None
    value = node.args[position]
    if not isinstance(value, float) or abs(value) != _TRACED_EXTREME:
        return None
    return torch.finfo(val.dtype).max * (1.0 if value > 0 else -1.0)


def applies(ctx) -> bool:
    return ctx.autocast_added  # only autocast Dynamo's trace did not see makes such a fill


def run(gm: fx.GraphModule, ctx) -> None:
    changed = 0
    for node in gm.graph.nodes:
        value = narrowed_value(node)
        if value is not None:
            position = FILLS[node.target]
            node.args = (*node.args[:position], value, *node.args[position + 1:])
            changed += 1
    if changed:
        gm.recompile()
