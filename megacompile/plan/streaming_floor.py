"""The streaming floor: what streaming a step layer by layer needs on the device at least.

While layer L's backward runs, streaming holds L's weights, the weights of the layer whose
backward comes next (loaded ahead so the compute never waits), L's gradients until they
leave for the host, and L's working set: the activations L's backward reads. Everything else
(other layers' weights, gradients and saved activations) can wait on the host. So

    floor = max over layers L of  W(L) + W(L's predecessor) + G(L) + A(L)

with W the device bytes of a layer's weights as loaded (bf16 under ``precision="bf16"``), G
the bytes of its gradients as the backward produces them, and A the device bytes its backward
reads when every activation is kept (the ``keep`` plan's saved values of that layer).
``BudgetError`` reports it beside the smallest plan, so a user sees how far the planner is
from what streaming could do.
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from megacompile.core import ops
from megacompile.core.enums import Placement, Role
from megacompile.core.node_info import has_info, info, tensor_nbytes_hint
from megacompile.core.units import format_bytes


@dataclasses.dataclass(frozen=True)
class StreamingFloor:
    bytes: int
    layer: str | None
    weights: int
    next_weights: int
    gradients: int
    working_set: int

    def describe(self) -> str:
        return (f"{format_bytes(self.bytes)} at layer '{self.layer}': its weights {format_bytes(self.weights)}, the "
                f"next layer's {format_bytes(self.next_weights)}, its gradients {format_bytes(self.gradients)}, "
                f"the activations its backward reads {format_bytes(self.working_set)}")


def _is_parameter_load(load: fx.Node) -> bool:
    """A load of a parameter (through host casts, which keep the parameter's identity)."""
    src = load.args[0]
    while isinstance(src, fx.Node) and src.op == "call_function" and has_info(src) \
            and info(src).placement == Placement.HOST:
        src = src.args[0] if src.args and isinstance(src.args[0], fx.Node) else None
    return isinstance(src, fx.Node) and src.op == "placeholder" and has_info(src) and info(src).role == Role.PARAM


def weight_bytes_by_layer(forward: fx.GraphModule) -> dict[str, int]:
    """Device bytes of each layer's parameters as the forward loads them (each source once)."""
    out: dict[str, int] = {}
    seen: set[tuple[str, str | None]] = set()
    for node in forward.graph.find_nodes(op="call_function", target=ops.load):
        layer = info(node).layer
        if layer is None or not _is_parameter_load(node) or (layer, info(node).source) in seen:
            continue
        seen.add((layer, info(node).source))
        out[layer] = out.get(layer, 0) + info(node).nbytes_hint
    return out


def gradient_bytes_by_layer(backward: fx.GraphModule) -> dict[str, int]:
    """Device bytes of the gradients each layer's backward sends to the host."""
    out: dict[str, int] = {}
    for node in backward.graph.find_nodes(op="call_function", target=ops.offload):
        value = node.args[0]
        layer = info(value).layer if has_info(value) else None
        if layer is not None and info(value).placement == Placement.DEVICE:
            # (a gradient is often a view, a transposed mm: its own bytes, not the view's 0)
            out[layer] = out.get(layer, 0) + tensor_nbytes_hint(value.meta["val"])
    return out


def streaming_floor(forward: fx.GraphModule, backward: fx.GraphModule, layers: list[str],
                    saved_by_layer: dict[str, int]) -> StreamingFloor:
    """The floor of a step whose ``keep`` plan built ``forward`` and ``backward``;
    ``layers`` in forward order, ``saved_by_layer`` the keep plan's saved device bytes."""
    weights = weight_bytes_by_layer(forward)
    grads = gradient_bytes_by_layer(backward)
    best = StreamingFloor(0, None, 0, 0, 0, 0)
    for i, layer in enumerate(layers):
        # The backward runs the layers in reverse: the one before L in the forward comes next.
        nxt = weights.get(layers[i - 1], 0) if i > 0 else 0
        candidate = StreamingFloor(0, layer, weights.get(layer, 0), nxt, grads.get(layer, 0),
                                   saved_by_layer.get(layer, 0))
        total = candidate.weights + candidate.next_weights + candidate.gradients + candidate.working_set
        if total > best.bytes:
            best = dataclasses.replace(candidate, bytes=total)
    return best
