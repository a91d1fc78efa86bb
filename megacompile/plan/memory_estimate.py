"""The training plan and the static memory estimate of a rewritten program.

The estimate walks a rewritten graph in execution order: a device value is live from the op
that produces it (or, for the backward, from the start: the saved activations) to its last
use, where views keep their base alive and values the forward hands to the backward live to
the end of the forward. Under the Inductor lowering a value read by a compiled segment lives
to that segment's end (the runtime frees a segment's inputs when it returns). The peak is the
most bytes live at once.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import sympy
import torch
import torch.fx as fx

from megacompile.core import ops
from megacompile.core.node_info import has_info, info, is_view_node, tensor_nbytes, tensor_nbytes_hint
from megacompile.runtime.executor import copying_device_segments


@dataclasses.dataclass
class MemoryEstimate:
    peak_bytes: int = 0
    peak_node: str | None = None
    peak_layer: str | None = None
    # Bytes live when the graph starts (saved activations for the backward).
    start_bytes: int = 0
    # Bytes still live when it ends (saved activations the forward hands on).
    end_bytes: int = 0
    # Peak bytes live while each layer's ops run.
    per_layer_peak: dict[str, int] = dataclasses.field(default_factory=dict)


def storage_root(node: fx.Node, memo: dict) -> fx.Node:
    """The node whose storage ``node`` views (itself if it owns one)."""
    if node in memo:
        return memo[node]
    root = node
    if node.op == "call_function" and is_view_node(node):
        tensors = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if tensors:
            root = storage_root(tensors[0], memo)
    elif (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node)
          and is_view_node(node.args[0])):
        # A piece of a multi-output view (split, unbind, chunk): it views the op's input, and
        # holding one piece keeps the whole input alive.
        root = storage_root(node.args[0], memo)
    memo[node] = root
    return root


def bytes_at(nbytes: Any, hint: int, sizes: dict | None) -> int:
    """``nbytes`` (an int or a sympy expression) at the given symbol values; the traced
    example's ``hint`` where no sizes are given or a symbol is not among them."""
    if sizes is None:
        return hint
    if not isinstance(nbytes, sympy.Expr):
        return int(nbytes)
    value = nbytes.xreplace(sizes)
    return int(value) if value.is_number else hint


# The CUDA caching allocator hands out blocks in multiples of 512 bytes (a 64-element bf16
# bias takes 512 bytes, not 128), and its statistics, which the measured peak reads, count
# the blocks. The CPU stand-in's tracker counts exact tensor bytes.
_ALLOCATION_GRANULARITY = {"cuda": 512}


def allocation_granularity(device: str) -> int:
    """Bytes a device allocates in: every tensor's storage is rounded up to a multiple."""
    return _ALLOCATION_GRANULARITY.get(device, 1)


def allocated_bytes(nbytes: int, granularity: int) -> int:
    return -(-nbytes // granularity) * granularity


def _owned_bytes(node: fx.Node, sizes: dict | None = None, granularity: int = 1) -> int:
    if not has_info(node) or info(node).placement != "device":
        return 0
    if node.op == "call_function" and node.target in (ops.wait, ops.evict):
        return 0
    return allocated_bytes(bytes_at(info(node).nbytes, info(node).nbytes_hint, sizes), granularity)


def storage_roots(gm: fx.GraphModule) -> dict[str, str]:
    """Node name -> name of the node whose storage it views (itself if it owns one)."""
    memo: dict = {}
    return {n.name: storage_root(n, memo).name for n in gm.graph.nodes if n.op in ("placeholder", "call_function")}


def storage_root_bytes(gm: fx.GraphModule, granularity: int = 1) -> dict[str, int]:
    """Name of each device storage's root -> its bytes (the traced example's sizes)."""
    memo: dict = {}
    roots = {storage_root(n, memo) for n in gm.graph.nodes if n.op in ("placeholder", "call_function")}
    return {r.name: _owned_bytes(r, None, granularity) for r in roots if _owned_bytes(r, None, granularity)}


def runtime_segments(gm: fx.GraphModule, lowering: str) -> list[list[fx.Node]] | None:
    """The runs the runtime compiles into one segment each (Inductor lowering), else None."""
    if lowering != "inductor":
        return None

    return copying_device_segments(gm)


def estimate_memory(gm: fx.GraphModule, keep_outputs_alive: bool, curve: list | None = None,
                    input_storage: dict[str, str] | None = None, sizes: dict | None = None,
                    lowering: str = "eager", granularity: int = 1,
                    input_storage_bytes: dict[str, int] | None = None,
                    inputs_held: bool = False) -> MemoryEstimate:
    """``input_storage``: for the backward, which saved inputs share one forward storage
    (``storage_roots`` of the forward graph): they are one allocation, not several, and as
    large as that storage (``input_storage_bytes``, ``storage_root_bytes`` of the forward):
    a saved piece of a split keeps the whole split input alive.
    ``sizes``: values of the graph's size symbols (sympy symbol -> int) to estimate at, for a
    call whose shapes differ from the traced example's; None: the example's sizes.
    ``lowering``: under "inductor", a value a compiled segment reads lives to the end of that
    segment (runtime_segments), where the runtime frees it.
    ``granularity``: the device's allocation unit (allocation_granularity).
    ``inputs_held``: the graph's inputs live to its end whatever reads them (a backward run with
    ``retain_graph=True``: autograd holds the saved activations until the graph is freed)."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    end = len(nodes)
    memo: dict = {}
    storage_bytes: dict[fx.Node, int] = {}  # a saved input standing for a larger forward storage
    if input_storage:
        first_of: dict[str, fx.Node] = {}
        for n in nodes:
            if n.op == "placeholder" and n.name in input_storage:
                key = input_storage[n.name]
                if key in first_of:
                    memo[n] = first_of[key]
                else:
                    first_of[key] = n
                    if input_storage_bytes and key in input_storage_bytes:
                        storage_bytes[n] = input_storage_bytes[key]
    birth: dict[fx.Node, int] = {}
    death: dict[fx.Node, int] = {}
    output = nodes[-1]
    orphans: list[tuple[int, int, int]] = []
    for node in nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        root = storage_root(node, memo)
        if _owned_bytes(root, sizes, granularity) == 0:
            continue
        born_at = 0 if root.op == "placeholder" else position[root]
        if root.op == "call_function" and root.target is operator.getitem:
            # A tuple op's outputs exist from the op itself, not from the getitem.
            born_at = position[root.args[0]]
        birth.setdefault(root, born_at)
        last = position[node]
        for user in node.users:
            if user is output:
                last = end if keep_outputs_alive else position[user]
            else:
                last = max(last, position[user])
        if inputs_held and root.op == "placeholder":
            last = end
        death[root] = max(death.get(root, 0), last)

    # A compiled segment holds its inputs until it returns. (Values made inside a segment are
    # Inductor's own buffers: freed at their last use, or never materialized when fused, so
    # counting them op by op is an upper bound.)
    for segment in runtime_segments(gm, lowering) or ():
        inside = set(segment)
        segment_end = position[segment[-1]]
        for node in segment:
            for read in node.all_input_nodes:
                root = storage_root(read, memo)
                if read not in inside and root in death:
                    death[root] = max(death[root], segment_end)

    # A tuple op's outputs are held by the tuple until its last getitem has run; outputs
    # nobody takes apart (no getitem) still exist for that long.
    for node in nodes:
        if node.op != "call_function" or not isinstance(node.meta.get("val"), (tuple, list)):
            continue
        if not has_info(node) or info(node).placement != "device" or is_view_node(node):
            continue  # (a multi-output view's pieces own nothing: they view its input)
        getitems = [u for u in node.users if u.target is operator.getitem]
        tuple_end = max((position[g] for g in getitems), default=position[node])
        for g in getitems:
            if g in death:
                death[g] = max(death[g], tuple_end)
        taken = {g.args[1] for g in getitems}
        orphan = sum(allocated_bytes(bytes_at(tensor_nbytes(v), tensor_nbytes_hint(v), sizes), granularity)
                     for i, v in enumerate(node.meta["val"]) if i not in taken)
        if orphan:
            orphans.append((position[node], tuple_end, orphan))

    delta = [0] * (end + 2)
    # An op's own working set (the fused head's chunk buffers) lives while it runs.
    for node in nodes:
        if has_info(node) and info(node).workspace_bytes and info(node).placement == "device":
            size = allocated_bytes(info(node).workspace_bytes, granularity)
            delta[position[node]] += size
            delta[position[node] + 1] -= size
    for born_at, dies_at, size in orphans:
        delta[born_at] += size
        delta[dies_at + 1] -= size
    start_bytes = end_bytes = 0
    for root, b in birth.items():
        size = max(_owned_bytes(root, sizes, granularity), storage_bytes.get(root, 0))
        delta[b] += size
        delta[death[root] + 1] -= size
        if b == 0 and root.op == "placeholder":
            start_bytes += size
        if death[root] >= end:
            end_bytes += size
    est = MemoryEstimate(start_bytes=start_bytes, end_bytes=end_bytes)
    live = 0
    current_layer = None
    for i in range(end + 1):
        live += delta[i]
        node = nodes[i] if i < end else None
        if curve is not None and node is not None:
            curve.append((node.name, live))
        if node is not None and has_info(node) and info(node).layer:
            current_layer = info(node).layer
        if current_layer is not None:
            est.per_layer_peak[current_layer] = max(est.per_layer_peak.get(current_layer, 0), live)
        if live > est.peak_bytes:
            est.peak_bytes = live
            est.peak_node = node.name if node is not None else "<end>"
            est.peak_layer = current_layer
    return est


def estimate_program_pair(forward: fx.GraphModule, backward: fx.GraphModule | None, lowering: str,
                          granularity: int, curves: tuple[list, list] | None = None, inputs_held: bool = False,
                          ) -> tuple[MemoryEstimate, MemoryEstimate | None]:
    """The estimates of a graph's forward and backward, as the planner makes them: the forward
    hands its outputs (saved values) on where there is a backward, and the backward's saved
    inputs are the forward's storages. ``curves``: two lists to fill with each program's
    (node name, live bytes). ``inputs_held``: the backward retains the graph (option retain_graph)."""
    fw_curve, bw_curve = curves if curves is not None else (None, None)
    how = dict(lowering=lowering, granularity=granularity)
    fw = estimate_memory(forward, keep_outputs_alive=backward is not None, curve=fw_curve, **how)
    if backward is None:
        return fw, None
    bw = estimate_memory(backward, keep_outputs_alive=False, curve=bw_curve, input_storage=storage_roots(forward),
                         input_storage_bytes=storage_root_bytes(forward, granularity), inputs_held=inputs_held, **how)
    return fw, bw
