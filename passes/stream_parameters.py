"""stream_parameters: host-resident tensors reach compute only through explicit loads.

For every host value a compute op reads (parameters, user inputs, incoming gradients, and in
the backward the parameters again) this pass inserts

    load  (host -> device copy, issued ``prefetch_depth`` layers before the first use, so the
           copy of layer k+1 overlaps the compute of layer k: double buffering at depth 1;
           the plan may set a deeper depth per value, ``plan.prefetch``, where the cost
           model says its load would keep the compute lane waiting)
    wait  (right before the first use: the compute lane blocks until the copy has landed)
    evict (right after the last use: the device copy is dead and its slot is reused)

and rewrites the uses to read the device copy. A layer's weight read again by the layer after
other layers ran (a layer called twice: a siamese pair, a model run on two batches in one
step) is loaded for each such occurrence and evicted after it, rather than held on the device
in between. The backward loads parameters again; nothing
loaded in the forward is still alive when the forward ends, except what the plan made
resident: those loads (placed by ``resident_parameters``) move to where a streamed load of the
same value would be issued, get their wait, and cross to the backward. A host cast
(``host_casts``) is a host value like a parameter: its result is what is loaded, and it moves
to just before its load.
"""
from __future__ import annotations

import torch.fx as fx

from megacompile.core import ops
from megacompile.core.enums import Placement, Role
from megacompile.core.host_ops import is_device_compute, is_host_op
from megacompile.core.node_info import NodeInfo, identifier, info, is_tensor_node, is_view_node, set_nbytes
from megacompile.passes.contract import PassContract

CONTRACT = PassContract(
    name="stream_parameters",
    stages=("forward", "backward", "inference"),
    requires=frozenset({"annotated"}),
    uses=frozenset({"host_casts_placed", "recompute_applied"}),
    provides=frozenset({"parameters_streamed"}),
)


def layer_runs(compute: list[fx.Node]) -> list[tuple[str | None, int]]:
    """Contiguous runs of compute ops of one layer: (layer, index of its first op).

    Glue ops (no layer) do not start a run; they belong to the run around them.
    """
    runs: list[tuple[str | None, int]] = []
    current = object()
    for i, node in enumerate(compute):
        layer = info(node).layer
        if layer is None:
            continue
        if layer != current:
            runs.append((layer, i))
            current = layer
    return runs


def alias_uses(value: fx.Node) -> list[fx.Node]:
    """Compute ops that read ``value`` directly or through a chain of views of it."""
    found, stack = [], [value]
    while stack:
        cur = stack.pop()
        for user in cur.users:
            if user.op != "call_function" or ops.is_memory_op(user):
                continue
            found.append(user)
            if is_view_node(user):
                stack.append(user)
    return found


def occurrences(host: fx.Node, users: list[fx.Node], position: dict, runs: list[tuple[str | None, int]]) -> list:
    """The uses of a host value (in program order) grouped by occurrence: a new group starts at
    a use by the value's own layer after a run of another layer (the layer runs again). Uses by
    other layers (a tied embedding's head, rotary tables every layer reads) stay in the group
    before them, as does a use reached through a view made in it."""
    layer = info(host).layer
    groups: list[list[fx.Node]] = []
    end = -1
    for user in users:
        start = position[user]
        reach = max((position[u] for u in alias_uses(user) if u in position), default=start) \
            if is_view_node(user) else start
        apart = layer is not None and info(user).layer == layer and any(
            end < run_start <= start and run_layer not in (None, layer) for run_layer, run_start in runs)
        if groups and not apart:
            groups[-1].append(user)
            end = max(end, reach)
        else:
            groups.append([user])
            end = reach
    return groups


def _place_resident_loads(gm: fx.GraphModule, position: dict, issue_position) -> None:
    """Loads the plan placed for resident parameters (at the forward's front, by
    resident_parameters) are issued where a streamed load of the same value would be, and
    waited for before their first use. The copy engine takes loads in program order: left at
    the front, every resident weight would land before the first layer's streamed inputs."""
    graph = gm.graph
    for load in [n for n in graph.nodes if n.target is ops.load]:
        if any(u.target is ops.wait for u in load.users):
            continue
        uses = sorted((u for u in load.users if u in position), key=position.__getitem__)
        if not uses:
            continue
        issue_position(load, uses[0]).prepend(load)
        if is_host_op(load.args[0]):
            load.prepend(load.args[0])  # its host cast runs right before it, as for a streamed load
        with graph.inserting_before(uses[0]):
            wait = graph.create_node("call_function", ops.wait, (load,), name=f"wait__{identifier(info(load).source)}")
        wait.meta["megatrain"] = NodeInfo(layer=info(load).layer, role=Role.MEMORY, phase=info(uses[0]).phase,
                                          placement=Placement.DEVICE, source=info(load).source)


def run(gm: fx.GraphModule, ctx) -> None:
    graph = gm.graph
    nodes = list(graph.nodes)
    # Device compute only: a host op (a host cast) is not a use that needs a load.
    compute = [n for n in nodes if is_device_compute(n)]
    position = {n: i for i, n in enumerate(compute)}
    runs = layer_runs(compute)
    run_starts = [start for _, start in runs]

    def run_index(pos: int) -> int:
        # The run containing compute op ``pos`` (the last run starting at or before it).
        idx = 0
        for k, start in enumerate(run_starts):
            if start <= pos:
                idx = k
            else:
                break
        return idx

    def issue_position(value: fx.Node, first: fx.Node) -> fx.Node:
        """Where the load of ``value`` (a host value, or a resident load's) is issued: at the
        start of the run ``depth`` layers before its first use."""
        depth = ctx.plan.prefetch.get(info(value).source, ctx.options.prefetch_depth)
        if not run_starts:
            return first
        issue_at = compute[run_starts[max(0, run_index(position[first]) - depth)]]
        return first if position[issue_at] > position[first] else issue_at

    _place_resident_loads(gm, position, issue_position)

    host_values = [
        n for n in nodes
        if (n.op == "placeholder" or is_host_op(n)) and info(n).placement == "host" and is_tensor_node(n)
        and any(u in position for u in n.users)
    ]
    for host in host_values:
        users = sorted((u for u in host.users if u in position), key=position.__getitem__)
        for k, group in enumerate(occurrences(host, users, position, runs)):
            _stream(graph, host, group, position, issue_position, ctx, first_occurrence=k == 0)


def _stream(graph: fx.Graph, host: fx.Node, users: list[fx.Node], position: dict, issue_position, ctx,
            first_occurrence: bool) -> None:
    """One load of ``host`` for ``users`` (one occurrence), its wait and its evict."""
    first, last = users[0], users[-1]
    name = identifier(info(host).source or host.name)
    depth = ctx.plan.prefetch.get(info(host).source, ctx.options.prefetch_depth)
    reason = ctx.plan.prefetch_reason.get(info(host).source) or (
        f"prefetched {depth} layer(s) ahead" if depth else "loaded at first use")
    with graph.inserting_before(issue_position(host, first)):
        load = graph.create_node("call_function", ops.load, (host, info(host).source or host.name),
                                 name=f"load__{name}")
    if host.op != "placeholder" and first_occurrence:
        # A host cast of a parameter runs right before its (first) load (its input is a
        # placeholder, so it can move up to a prefetched load).
        load.prepend(host)
    load.meta["val"] = host.meta.get("val")
    load.meta["megatrain"] = NodeInfo(
        layer=info(host).layer, role=Role.MEMORY, phase=info(first).phase, placement=Placement.DEVICE,
        source=info(host).source,
        decision="stream", reason=reason,
    )
    set_nbytes(load.meta["megatrain"], host.meta.get("val"))
    with graph.inserting_before(first):
        wait = graph.create_node("call_function", ops.wait, (load,), name=f"wait__{name}")
    wait.meta["megatrain"] = NodeInfo(layer=info(host).layer, role=Role.MEMORY, phase=info(first).phase,
                                      placement=Placement.DEVICE, source=info(host).source)
    for user in users:
        user.replace_input_with(host, load)
    # The device copy is dead only when its views are too (``t(weight)`` feeding a
    # matmul later): evict after the last use of the copy or of any view of it.
    last = max(alias_uses(load), key=position.__getitem__, default=last)
    with graph.inserting_after(last):
        evict = graph.create_node("call_function", ops.evict, (load,), name=f"evict__{name}")
    evict.meta["megatrain"] = NodeInfo(layer=info(host).layer, role=Role.MEMORY, phase=info(last).phase,
                                       placement=Placement.DEVICE, source=info(host).source)
