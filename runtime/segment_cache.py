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
import time
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
    """What a compiled segment assumes about its inputs (tensors by metadata, never values;
    a symbolic size by its expression)."""
    sig = []
    for t in inputs:
        if isinstance(t, torch.Tensor):
            sig.append(("tensor", tuple(map(_size_key, t.shape)), tuple(map(_size_key, t.stride())), t.dtype,
                        t.device.type, t.device.index, t.requires_grad))
        elif isinstance(t, torch.SymInt):
            sig.append(("SymInt", str(t)))
        elif isinstance(t, (tuple, list)):
            sig.append((type(t).__name__, input_signature(t)))
        else:
            sig.append((type(t).__name__, repr(t)))
    return tuple(sig)


def _size_key(size) -> int | str:
    return size if isinstance(size, int) else str(size)


# --- dynamic shapes ----------------------------------------------------------------------
# Under dynamic shapes a segment's inputs change size between calls. A segment compiled for
# the first call's sizes would reject the next; compiled with those sizes as symbols
# (``torch_compat.symbolic_examples``) it runs at any, so it is compiled once per size class.
def varying_sizes(inputs: list[fx.Node]) -> list | None:
    """For a segment reading ``inputs`` (nodes of a traced program): per input, which of its
    sizes are symbolic there (``symbolic_examples``' ``varying``), or None if none is."""
    def key(size):
        return str(size.node.expr) if isinstance(size, torch.SymInt) and size.node.expr.free_symbols else None

    varying, any_symbolic = [], False
    for node in inputs:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            keys = tuple(key(d) for d in val.shape)
            entry = keys if any(k is not None for k in keys) else None
        else:
            entry = key(val) if isinstance(val, torch.SymInt) else None
        varying.append(entry)
        any_symbolic = any_symbolic or entry is not None
    return varying if any_symbolic else None


def size_class(inputs: list, varying: list) -> tuple:
    """What one compiled segment serves: the inputs' sizes with each varying size >= 2 as -1,
    and each varying tensor's memory order (its strides follow from its sizes), or its exact
    sizes and strides where it is not dense (a slice: compiled for those alone)."""
    out = []
    for x, keys in zip(inputs, varying):
        if keys is None:
            continue
        if isinstance(x, torch.Tensor):
            order = memory_order(x)
            out.append((tuple(-1 if k is not None and n >= 2 else n for k, n in zip(keys, x.shape)), order)
                       if order is not None else (tuple(x.shape), x.stride()))
        else:
            out.append(x if x < 2 else -1)
    return tuple(out)


def memory_order(x: torch.Tensor) -> tuple | None:
    """``x``'s dims from the innermost out, where its strides are the products of its sizes in
    that order (a dense layout, contiguous or permuted); None otherwise."""
    order = sorted(range(x.dim()), key=lambda d: (x.stride(d), x.shape[d]))
    expected = 1
    for d in order:
        if x.shape[d] != 1 and x.stride(d) != expected:
            return None
        expected *= x.shape[d]
    return tuple(order)


@dataclasses.dataclass
class SegmentCacheStats:
    compiled: int = 0  # distinct segments compiled
    reused: int = 0  # segments served a compiled repeat
    compile_seconds: float = 0.0  # wall time in the compiler (Inductor), all segments


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
        started = time.perf_counter()
        compiled = self.compile_fn(gm, inputs)
        self.stats.compile_seconds += time.perf_counter() - started
        self._compiled[key] = compiled
        self.stats.compiled += 1
        return compiled
