"""Output dtypes where the kernels and the host trace's fake tensors disagree.

The memory estimate sizes every value from its fake tensor. For the normalisations below,
with a bf16/fp16 input and fp32 parameters (a LayerNorm under CPU autocast, a BatchNorm after
a bf16 conv: megatrain loads norm weights in fp32), the kernels return the saved statistics
(mean, rstd) in fp32, the CPU kernels as the CUDA ones (their accumulate type), while the
fake tensor of the host trace (PyTorch's reference implementation, whose CPU branch casts
them to the input's dtype) says bf16: the stand-in measured up to 1.5% more than planned at
the smallest budget (ConvNeXt, Swin, ALBERT in bf16). The other way, GroupNorm's backward
returns the input gradient in the input's dtype (bf16) where its fake says fp32 (the
statistics' dtype): planned above what ran. The plan sizes what the kernels return,
except where Inductor compiles that CPU branch itself (the stand-in's Inductor lowering).
``tests/test_kernel_dtypes.py`` checks the rule against the installed kernels (CPU; CUDA's
where there is a GPU).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from megacompile.core import torch_compat as compat
from megacompile.core.node_info import is_view_node

_REDUCED = (torch.bfloat16, torch.float16)
# op -> the output indices of its saved statistics (mean / rstd, save_mean / save_invstd).
_NORMS = {
    torch.ops.aten.native_layer_norm.default: (1, 2),
    torch.ops.aten.native_group_norm.default: (1, 2),
    torch.ops.aten.native_batch_norm.default: (1, 2),
    torch.ops.aten._native_batch_norm_legit.default: (1, 2),
    torch.ops.aten._native_batch_norm_legit.no_stats: (1, 2),
    torch.ops.aten._native_batch_norm_legit_functional.default: (1, 2),
    torch.ops.aten._native_batch_norm_legit_no_training.default: (1, 2),
}

# op -> (output index, argument index): that output has that argument's dtype (the input
# gradient, the input's), whatever its fake tensor says.
_INPUT_GRADIENTS = {
    torch.ops.aten.native_group_norm_backward.default: (0, 1),
}

_KEEP_DTYPE = (torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.clone.default)


def kernel_statistics_dtype(target, args) -> torch.dtype | None:
    """The dtype the kernels of ``target`` give its saved statistics for these (fake)
    arguments where it differs from the input's (mixed precision: a reduced-precision input
    with an fp32 parameter or running statistic), else None."""
    if target not in _NORMS or not args or not isinstance(args[0], torch.Tensor):
        return None
    if args[0].dtype not in _REDUCED:
        return None
    mixed = any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args[1:])
    return torch.float32 if mixed else None


def kernel_input_gradient_dtype(target, args) -> torch.dtype | None:
    """The dtype the kernels of ``target`` give its input gradient for these (fake)
    arguments where the input is in reduced precision (then the input's), else None."""
    if target not in _INPUT_GRADIENTS:
        return None
    arg = _INPUT_GRADIENTS[target][1]
    if len(args) <= arg or not isinstance(args[arg], torch.Tensor) or args[arg].dtype not in _REDUCED:
        return None
    return args[arg].dtype


def _resized_outputs(node: fx.Node) -> dict[int, torch.dtype]:
    """Output index -> the kernel's dtype, where it differs from ``node``'s fake tensors."""
    vals = node.meta.get("val")
    if not isinstance(vals, (tuple, list)):
        return {}
    args = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args]
    wanted: dict[int, torch.dtype] = {}
    if node.target in _NORMS and (dtype := kernel_statistics_dtype(node.target, args)) is not None:
        wanted.update(dict.fromkeys(_NORMS[node.target], dtype))
    if node.target in _INPUT_GRADIENTS and (dtype := kernel_input_gradient_dtype(node.target, args)) is not None:
        wanted[_INPUT_GRADIENTS[node.target][0]] = dtype
    return {i: d for i, d in wanted.items() if isinstance(vals[i], torch.Tensor) and vals[i].dtype != d}


def size_as_kernels(gm: fx.GraphModule) -> int:
    """Gives every output that the kernel returns in another dtype than its fake tensor
    says a fake tensor of the kernel's dtype, in ``gm`` and every graph module under it (the
    node's tuple and the ``getitem`` nodes that take the pieces); returns how many."""
    changed = 0
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function" or (node.target not in _NORMS and node.target not in _INPUT_GRADIENTS):
                continue
            resized = _resized_outputs(node)
            if not resized:
                continue
            vals = list(node.meta["val"])
            for i, dtype in resized.items():
                vals[i] = compat.fake_like(vals[i], dtype)
            changed += len(resized)
            node.meta["val"] = tuple(vals)
            for user in node.users:
                if user.target is operator.getitem and user.args[1] in resized:
                    user.meta["val"] = vals[user.args[1]]
                    _follow_aliases(user, resized[user.args[1]])
    return changed


def _follow_aliases(node: fx.Node, dtype: torch.dtype) -> None:
    """Views and detaches of a resized value (what AOTAutograd saves is a ``detach`` of it)
    return its dtype too."""
    for user in node.users:
        val = user.meta.get("val")
        if (isinstance(val, torch.Tensor) and val.dtype != dtype and user.args and user.args[0] is node
                and (user.target in _KEEP_DTYPE or is_view_node(user))):
            user.meta["val"] = compat.fake_like(val, dtype)
            _follow_aliases(user, dtype)
