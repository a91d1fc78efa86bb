"""Inline ``torch.compiler.nested_compile_region`` calls and the step's own activation
checkpoints before the streaming passes.

A layer marked with ``nested_compile_region`` is traced by Dynamo once; every later call of
it is an ``invoke_subgraph`` node over the one traced body, so Dynamo's time no longer grows
with depth. The streaming passes need each layer's ops in the flat graph (a parameter is
loaded before its layer and evicted after it; activations are saved per layer), so this
module copies the body in at every call site before AOTAutograd sees the graph.

A region under ``torch.utils.checkpoint`` (``model.gradient_checkpointing_enable()``, a
Trainer's ``gradient_checkpointing=True``) reaches the backend as a ``tag_activation_checkpoint``
call over its body. What to keep and what to recompute is the planner's decision, made per
layer under the memory budget, so ``inline_checkpoint_regions`` drops the wrapper and keeps
the ops: the values are the same (recomputing replays the forward, RNG included), and a step
written for a GPU with checkpointing on runs streamed rather than falling back to eager.

What matters for attribution: the body's ops carry the module paths of the instance Dynamo
traced (say ``layers.1``); a copy at the call site of ``layers.5`` gets its paths rewritten
to ``layers.5`` so that the passes, the planner and ``inspect`` see the right layer.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from megacompile.core import torch_compat as compat
from megacompile.core.node_info import BODY_NODE


def call_site_path(node: fx.Node) -> str | None:
    """The module path of the layer a region call runs (its call site's innermost module)."""
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else None


def _region_path(body: fx.GraphModule) -> str | None:
    """The module path of the instance the body was traced from: the shortest path its ops
    name (the region's own module; the submodules extend it)."""
    paths = []
    for n in body.graph.nodes:
        for path, _ in (n.meta.get("nn_module_stack") or {}).values():
            paths.append(path)
    return min(paths, key=len) if paths else None


def _renamed_stack(stack: dict, old: str | None, new: str | None, outer: dict) -> dict:
    if not old or not new or old == new:
        return dict(stack)
    renamed = dict(outer)  # the call site's enclosing modules first
    for key, (path, cls) in stack.items():
        if path == old or path.startswith(old + ".") or path.startswith(old + "["):
            path = new + path[len(old):]
        renamed[f"{key}@{new}"] = (path, cls)
    return renamed


def _body_path(body: fx.GraphModule) -> str | None:
    """Like ``_region_path``, also reading the forward module paths backward ops carry."""
    paths = []
    for n in body.graph.nodes:
        for key in ("nn_module_stack", "fwd_nn_module_stack"):
            for path, _ in (n.meta.get(key) or {}).values():
                paths.append(path)
    return min(paths, key=len) if paths else None


def _operands(call: fx.Node) -> list:
    """The body's inputs among a call's arguments: ``invoke_subgraph(body, identifier, *operands)``,
    ``tag_activation_checkpoint(body, *operands)``."""
    return compat.invoke_subgraph_operands(call) if compat.is_invoke_subgraph(call.target) else list(call.args[1:])


def _copy_attribute(gm: fx.GraphModule, body: fx.GraphModule, name: str) -> str:
    """A body's attribute (a nested body, a constant) put on ``gm`` under a name it lacks."""
    value = getattr(body, name)
    fresh, k = name, 0
    while hasattr(gm, fresh):
        k += 1
        fresh = f"{name}_{k}"
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        # A tensor constant: registered as a buffer (not persisted), as fx expects of what a
        # get_attr reads; a plain attribute drew fx's "no underlying reference" warning.
        gm.register_buffer(fresh, value, persistent=False)
    else:
        setattr(gm, fresh, value)
    return fresh


def _inline_calls(gm: fx.GraphModule, call_site, body_path, tag_of, is_call=None) -> int:
    """Replaces every ``invoke_subgraph`` call in ``gm`` (or every call ``is_call(target)``
    selects) by a copy of its body (in place).

    ``call_site(call)``: (the call site's module path, its enclosing modules' stack entries);
    ``body_path(body)``: the module path the body was traced at, renamed to the call site's
    in every copied node's module stacks; ``tag_of(call)``: a partitioner tag for the copies,
    or None to keep theirs. Returns how many calls were inlined.
    """
    graph = gm.graph
    is_call = is_call or compat.is_invoke_subgraph
    calls = [n for n in graph.nodes if n.op == "call_function" and is_call(n.target)]
    if not calls:
        return 0
    bodies = {call.args[0].target for call in calls}
    # Every call site is read before anything is inlined: a backward call may be paired with
    # its forward call through the forward call's results, which inlining replaces.
    sites = {call: call_site(call) for call in calls}
    for call in calls:
        body_node = call.args[0]
        body = getattr(gm, body_node.target)
        operands = _operands(call)
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(operands):
            raise ValueError(f"{call.target.__name__} '{call.name}': {len(operands)} operands for "
                             f"{len(placeholders)} body inputs")
        env: dict[fx.Node, fx.Node] = dict(zip(placeholders, operands))
        (new, outer), old, tag = sites[call], body_path(body), tag_of(call)
        outputs = None
        with graph.inserting_before(call):
            for n in body.graph.nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    outputs = fx.node.map_arg(n.args[0], lambda a: env[a])
                    continue
                if n.op == "get_attr":  # a nested body or a constant of the body's: moved onto gm
                    copy = graph.get_attr(_copy_attribute(gm, body, n.target))
                else:
                    copy = graph.node_copy(n, lambda a: env[a])
                copy.meta = dict(n.meta)
                copy.meta[BODY_NODE] = (body_node.target, n.name)
                for key in ("nn_module_stack", "fwd_nn_module_stack"):
                    if key in n.meta:
                        copy.meta[key] = _renamed_stack(n.meta[key], old, new, outer)
                if tag is not None:
                    copy.meta["partitioner_tag"] = tag
                env[n] = copy
        if not isinstance(outputs, (tuple, list)):
            call.replace_all_uses_with(outputs)
        for user in list(call.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(outputs[user.args[1]])
                graph.erase_node(user)
            else:
                raise ValueError(f"{call.target.__name__} '{call.name}' is used by '{user.name}' other than by "
                                 f"indexing")
        graph.erase_node(call)
        if not body_node.users:
            graph.erase_node(body_node)
    still_used = {n.target for n in graph.nodes if n.op == "get_attr"}
    for name in bodies - still_used:
        delattr(gm, name)
    graph.lint()
    gm.recompile()
    return len(calls)


def _own_site(call: fx.Node) -> tuple[str | None, dict]:
    new = call_site_path(call)
    return new, {k: v for k, v in (call.meta.get("nn_module_stack") or {}).items() if v[0] != new}


def inline_partitioned_regions(joint: fx.GraphModule) -> int:
    """Replaces the forward and backward ``invoke_subgraph`` calls of an AOTAutograd joint
    graph by copies of their (already partitioned) bodies, in place; returns how many.

    AOTAutograd traces a marked layer's forward and backward once and partitions that joint
    once (``capture.TrainingCompiler.partition`` saves everything the backward reads); the
    joint graph of the step then calls the forward body per layer and the backward body per
    layer, paired by ``meta["custom"]["call_id"]``. Each copy gets the call's partitioner
    tag (forward or backward) and module paths renamed to the call site's layer (a backward
    call takes its forward call's), so the passes see an ordinary flat joint graph.
    """
    def call_id(call: fx.Node):
        return (call.meta.get("custom") or {}).get("call_id")

    forward_sites, forward_calls = {}, {}
    for n in joint.graph.nodes:
        if n.op == "call_function" and compat.is_invoke_subgraph(n.target) and call_site_path(n):
            forward_calls[n] = _own_site(n)
            if call_id(n) is not None:
                forward_sites[call_id(n)] = forward_calls[n]

    order = {n: k for k, n in enumerate(forward_calls)}

    def site(call: fx.Node):
        if call in forward_calls:
            return forward_calls[call]
        if call_id(call) is not None and call_id(call) in forward_sites:
            return forward_sites[call_id(call)]
        # torch 2.11 records no call_id: a backward call reads what its forward call saved
        # (the forward body's extra outputs), which names the forward call. It may also read
        # the layer's input, the previous forward call's output: the forward call it reads
        # most from is its own (ties: the later one).
        reads: dict[fx.Node, int] = {}
        for operand in call.args[2:]:
            if (isinstance(operand, fx.Node) and operand.target is operator.getitem
                    and operand.args[0] in forward_calls):
                reads[operand.args[0]] = reads.get(operand.args[0], 0) + 1
        if not reads:
            return None, {}
        return forward_calls[max(reads, key=lambda f: (reads[f], order[f]))]

    return _inline_calls(joint, site, _body_path, lambda call: call.meta.get("partitioner_tag"))


def inline_nested_regions(gm: fx.GraphModule) -> int:
    """Replaces every ``invoke_subgraph`` call of a Dynamo graph by a copy of its body, as
    traced (in place). Returns how many calls were inlined."""
    return _inline_calls(gm, _own_site, _region_path, lambda call: None)


def inline_checkpoint_regions(gm: fx.GraphModule) -> int:
    """Replaces every ``tag_activation_checkpoint`` call of a Dynamo graph by its body's ops
    (in place; nested checkpoints too). Returns how many calls were inlined."""
    total = 0
    while count := _inline_calls(gm, lambda call: (None, {}), lambda body: None, lambda call: None,
                                 compat.is_activation_checkpoint):
        total += count
    return total
