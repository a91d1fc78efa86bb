"""Compile each distinct segment once: repeated layers share their compiled kernels.

A transformer's layers are the same program over different parameters, so after the passes
the runtime's segments repeat layer after layer: the same ops in the same order over inputs of
the same shapes, under different node names. ``SegmentCache`` keys each segment by its
structure (ops, argument wiring, constants) and by what its inputs are at the first call
(shape, stride, dtype, device), compiles the first of each kind with Inductor and hands the
same compiled callable to every repeat. This needs no marking by the user: repeats are found
in the rewritten graphs themselves, whatever the model.

A compiled segment is a pure function of its inputs (no state kept between calls), so sharing
it is exact; a segment that reads a graph constant keys on that constant's identity, so it is
only shared with segments reading the very same tensor.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.fx as fx


def segment_structure(gm: fx.GraphModule) -> tuple:
    """The segment's program with node names replaced by positions: equal for two segments
    that compute the same thing from their inputs."""
    position: dict[fx.Node, int] = {}

    def ref(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ("%", position[a])
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(ref(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, ref(v)) for k, v in a.items()))
        if isinstance(a, torch.Tensor):  # a tensor literal: only the same object is the same
            return ("tensor", id(a))
        return (type(a).__name__, repr(a))

    out = []
    for k, node in enumerate(gm.graph.nodes):
        position[node] = k
        if node.op == "get_attr":
            target = ("get_attr", id(getattr(gm, node.target)))
        elif node.op == "call_function":
            target = ("call_function", getattr(node.target, "__module__", ""),
                      getattr(node.target, "__qualname__", None) or str(node.target), str(node.target))
        else:
            target = (node.op, "" if node.op == "placeholder" else str(node.target))
        out.append((target, ref(node.args), ref(node.kwargs)))
    return tuple(out)


def input_signature(inputs) -> tuple:
    """What a compiled segment assumes about its inputs (tensors by metadata, never values)."""
    sig = []
    for t in inputs:
        if isinstance(t, torch.Tensor):
            sig.append(("tensor", tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type, t.device.index,
                        t.requires_grad))
        elif isinstance(t, (tuple, list)):
            sig.append((type(t).__name__, input_signature(t)))
        else:
            sig.append((type(t).__name__, repr(t)))
    return tuple(sig)


@dataclasses.dataclass
class SegmentCacheStats:
    compiled: int = 0  # distinct segments compiled
    reused: int = 0  # segments served a compiled repeat


class SegmentCache:
    """Per compiled training step: structure + input signature -> compiled segment."""

    def __init__(self, compile_fn: Callable[[fx.GraphModule, list], Callable]) -> None:
        self.compile_fn = compile_fn
        self.stats = SegmentCacheStats()
        self._compiled: dict[tuple, Callable] = {}

    def __call__(self, gm: fx.GraphModule, inputs: list) -> Callable:
        key = (segment_structure(gm), input_signature(inputs))
        hit = self._compiled.get(key)
        if hit is not None:
            self.stats.reused += 1
            return hit
        compiled = self.compile_fn(gm, inputs)
        self._compiled[key] = compiled
        self.stats.compiled += 1
        return compiled
