"""Host ops of a rewritten program: what the program runs on the host rather than the device,
and which of them the runtime serves without running (the executor builds its instructions
from these; the cost model prices them by the same rules)."""
from __future__ import annotations

import torch
import torch.fx as fx

from megacompile.core import ops
from megacompile.core.enums import Role
from megacompile.core.node_info import has_info, info

_CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def is_host_op(node: fx.Node) -> bool:
    """A compute op the program runs on the host (today: host casts)."""
    return (node.op == "call_function" and not ops.is_memory_op(node) and has_info(node)
            and info(node).placement == "host")


def is_device_compute(node: fx.Node) -> bool:
    """A compute op the program runs on the device: neither a memory op nor a host op."""
    return node.op == "call_function" and not ops.is_memory_op(node) and not is_host_op(node)


def is_weight_copy_cast(node: fx.Node) -> bool:
    """A host cast narrowing a parameter (its bf16 copy on the way to a load). The runtime serves
    it from the parameter's persistent copy (``runtime/weight_copies.py``), which the host
    optimizer rewrites in its update's pass, so it casts nothing while the copy is current."""
    if not is_host_op(node) or node.target not in _CASTS:
        return False
    src = node.args[0]
    return (isinstance(src, fx.Node) and src.op == "placeholder" and has_info(src) and info(src).role == Role.PARAM
            and node.meta["val"].element_size() < src.meta["val"].element_size())


def widened_copy(node: fx.Node) -> fx.Node | None:
    """The offloaded narrow copy a host op reads as its only value (under bf16, the cast that
    widens a gradient's bf16 copy to fp32 on the host), else None. The overlapped optimizer
    takes that copy as it lands and its kernel widens it, so the cast does not run."""
    if not is_host_op(node):
        return None
    read: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), read.append)
    return read[0] if len(read) == 1 and read[0].target is ops.offload else None
