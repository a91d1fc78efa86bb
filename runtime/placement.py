"""Device placement of what the graph creates itself: factory ops and tensor constants.

megatrain traces the step on the host (the parameters live there), so every op that makes a
tensor from nothing carries the host device in its arguments: ``arange(T, device=cpu)`` for
positions, ``full(..., device=cpu)`` for masks, ``scalar_tensor(..., device=cpu)``. The
passes place those ops on the device like any other compute op, and loads move every host
value they read, but the ops' own ``device`` arguments still name the host. On the CPU
stand-in that is the same device; on CUDA the op would make a host tensor and the next
kernel would refuse it ("Expected all tensors to be on the same device"). So before a
program is lowered, every device-placed op that names the host device is retargeted to the
runtime's device. Host-placed ops (host casts) keep the host.

The host trace also picks host kernels where PyTorch chooses a kernel by device: attention
is traced as ``_scaled_dot_product_flash_attention_for_cpu`` (and its backward), which has
no CUDA kernel. On another device those two ops become ``device_attention_forward`` /
``device_attention_backward`` (``runtime/device_attention.py``).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from megacompile.core import ops
from megacompile.core.errors import MegacompileError
from megacompile.core.node_info import has_info, info
from megacompile.runtime.device_attention import device_attention_backward, device_attention_forward


def _is_host_device(value, host: torch.device) -> bool:
    return isinstance(value, torch.device) and value.type == host.type


def host_device_arguments(gm: fx.GraphModule, host: torch.device = torch.device("cpu")) -> list[fx.Node]:
    """Device-placed compute ops whose arguments name the host device."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or ops.is_memory_op(node):
            continue
        if has_info(node) and info(node).placement == "host":
            continue
        if any(_is_host_device(a, host) for a in (*node.args, *node.kwargs.values())):
            found.append(node)
    return found


def _with_dropout_zero(node: fx.Node, index: int) -> None:
    dropout = node.args[index] if len(node.args) > index else node.kwargs.get("dropout_p", 0.0)
    if dropout:
        raise MegacompileError(
            f"megatrain: attention with dropout_p={dropout} ({node.name}) cannot run on the device yet: "
            "the step was traced on the host and its attention dropout mask cannot be replayed there. "
            "Set the model's attention dropout to 0 (e.g. config.attention_dropout = 0.0).")


_aten = torch.ops.aten
# host kernel -> (its device replacement, index of its dropout_p argument)
_HOST_KERNELS = {
    _aten._scaled_dot_product_flash_attention_for_cpu.default: (device_attention_forward, 3),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (device_attention_backward, 6),
}
DEVICE_KERNELS = frozenset(fn for fn, _ in _HOST_KERNELS.values())


def substitute_host_kernels(gm: fx.GraphModule, target: torch.device,
                            host: torch.device = torch.device("cpu")) -> int:
    """Replace host-only kernels by their device versions; returns how many ops changed."""
    if target.type == host.type:
        return 0
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _HOST_KERNELS:
            continue
        if has_info(node) and info(node).placement == "host":
            continue
        replacement, dropout_index = _HOST_KERNELS[node.target]
        _with_dropout_zero(node, dropout_index)
        node.target = replacement
        changed += 1
    if changed:
        gm.recompile()
    return changed


def retarget_factories(gm: fx.GraphModule, target: torch.device, host: torch.device = torch.device("cpu")) -> int:
    """Rewrite the host device to ``target`` in device-placed ops; returns how many ops changed."""
    if target.type == host.type:
        return 0  # the CPU stand-in: host and device are the same torch device
    changed = host_device_arguments(gm, host)
    for node in changed:
        node.args = tuple(target if _is_host_device(a, host) else a for a in node.args)
        node.kwargs = {k: target if _is_host_device(v, host) else v for k, v in node.kwargs.items()}
    if changed:
        gm.recompile()
    return len(changed)


def place_constant(value, target: torch.device):
    """A tensor constant of the graph (``get_attr``), read by device ops: one copy on the device.

    Constants are what the traced code built from literals (small: a scalar, a lookup table);
    they stay on the device for the program's life.
    """
    if isinstance(value, torch.Tensor) and value.device.type != target.type:
        return value.to(target)
    return value
