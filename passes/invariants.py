"""The graph invariants the passes keep, checked after every pass.

1. Every node a pass sees carries NodeInfo (``annotate`` ran first).
2. After ``stream_parameters``: no compute op reads a host value; every ``load`` has one
   ``wait`` before all its compute uses and one ``evict`` after all of them, and nothing
   reads a loaded value after its evict.
3. After ``offload_gradients``: every tensor the graph returns to the host side (user
   outputs, gradients) is host-resident.
4. Forward: nothing device-resident crosses from forward to backward unless the plan saved
   it (``plan.saved_values``); a loaded parameter copy never crosses.
5. Host ops (``host_casts``): only host casts run on the host; after ``offload_gradients``
   they read host values only, an offloaded input only after its wait (the device reads a host cast's result only
   through a load: invariant 2); a host cast never crosses from forward to backward.
A violation raises ``InvariantViolation`` naming the pass that broke it.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from megacompile.core import ops
from megacompile.core.host_ops import is_host_op
from megacompile.core.node_info import has_info, info, is_view_node
from megacompile.passes.host_casts import is_host_cast
from megacompile.passes.stream_parameters import alias_uses


class InvariantViolation(AssertionError):
    pass


def _fail(ctx, message: str) -> None:
    last = ctx.ran[-1] if ctx.ran else "capture"  # the pass that broke it
    raise InvariantViolation(f"{ctx.stage} graph after pass '{last}': {message}")


def _reaches_output(node: fx.Node) -> bool:
    """The value (or a view of it) is handed on by the graph: a planned resident copy."""
    stack = [node]
    while stack:
        cur = stack.pop()
        for u in cur.users:
            if u.op == "output":
                return True
            if is_view_node(u):
                stack.append(u)
    return False


def check(gm: fx.GraphModule, ctx) -> None:
    if ctx.stage == "dynamo":
        return  # Dynamo's own graph: NodeInfo begins with annotate, on the graphs AOTAutograd makes
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    for node in nodes:
        if node.op in ("placeholder", "call_function") and not has_info(node):
            _fail(ctx, f"node {node.name} has no NodeInfo")
    if ctx.stage == "joint":
        return

    if "parameters_streamed" in ctx.facts:
        for node in nodes:
            if node.op != "call_function":
                continue
            if is_host_op(node):
                continue  # checked below: host ops read host values only
            if not ops.is_memory_op(node):
                for inp in node.all_input_nodes:
                    if info(inp).placement == "host" and isinstance(inp.meta.get("val"), torch.Tensor):
                        _fail(ctx, f"compute op {node.name} reads host value {inp.name} without a load")
            if node.target is ops.load:
                waits = [u for u in node.users if u.target is ops.wait]
                evicts = [u for u in node.users if u.target is ops.evict]

                uses = alias_uses(node)
                crosses = ctx.stage == "forward" and _reaches_output(node)
                if crosses and info(node).decision != "resident":
                    _fail(ctx, f"loaded parameter copy {node.name} crosses from forward to backward")
                if len(waits) != 1 or len(evicts) != (0 if crosses else 1):
                    _fail(ctx, f"{node.name} needs exactly one wait and {'no' if crosses else 'one'} evict, "
                               f"has {len(waits)} and {len(evicts)}")
                if any(position[u] < position[waits[0]] for u in uses):
                    _fail(ctx, f"{node.name} is used before its wait")
                if evicts and any(position[u] > position[evicts[0]] for u in uses):
                    _fail(ctx, f"{node.name} is used after its evict")
                if not uses:
                    _fail(ctx, f"{node.name} is loaded but never used")

    for node in nodes:
        if not is_host_op(node):
            continue
        if not is_host_cast(node):
            _fail(ctx, f"{node.name} runs on the host but is not a host cast")
        for inp in node.all_input_nodes:
            # Before offload_gradients, a gradient's host cast still reads the device value
            # that pass will offload.
            if info(inp).placement != "host" and "outputs_offloaded" in ctx.facts:
                _fail(ctx, f"host op {node.name} reads device value {inp.name}")
            if inp.target is ops.offload:
                waits = [u for u in inp.users if u.target is ops.wait]
                if len(waits) != 1 or position[waits[0]] > position[node]:
                    _fail(ctx, f"host op {node.name} reads {inp.name} before waiting for its offload")

    output = next(iter(gm.graph.find_nodes(op="output")))
    outs = list(output.args[0])
    user_outs = outs if ctx.stage != "forward" else outs[: ctx.num_user_outputs]
    if "outputs_offloaded" in ctx.facts:
        for i, value in enumerate(user_outs):
            if isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor):
                if info(value).placement != "host":
                    _fail(ctx, f"output {i} ({value.name}) is returned while still on the device")

    if ctx.stage == "forward":
        planned = set(ctx.plan.saved_values)
        for value in outs[ctx.num_user_outputs:]:
            if isinstance(value, fx.Node) and is_host_cast(value):
                _fail(ctx, f"host cast {value.name} crosses from forward to backward (the backward re-derives it)")
            if not isinstance(value, fx.Node) or info(value).placement != "device":
                continue
            if not isinstance(value.meta.get("val"), torch.Tensor):
                continue  # a saved size (SymInt), not memory
            if value.target is ops.load and info(value).decision != "resident":
                _fail(ctx, f"loaded parameter copy {value.name} crosses from forward to backward")
            if value.name not in planned:
                _fail(ctx, f"device value {value.name} crosses from forward to backward but the plan did not save it")
