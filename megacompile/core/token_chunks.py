"""Token-chunked runs: ``megatrain::token_chunked`` and its backward.

A *run* is a piece of a layer made only of ops that treat every token alone (projections,
pointwise ops, norms over the last dimension, residual adds; ``passes/chunk_tokens.py`` finds
them). ``token_chunked(body, chunks, tokens, shared)`` computes the run over ``chunks`` slices
of the tokens, one after the other, so the run's intermediates (an MLP's 3.5x wider
activations, a norm's fp32 upcast) exist for one slice at a time. Its autograd formula keeps
only the run's inputs; the backward (``token_chunked_backward``) replays each slice's forward
and backpropagates it, writing that slice's rows of the token gradients and adding to the
shared tensors' (weights') gradients, in fp32 where the weights are narrower.

``body`` names a registered ``ChunkBody``: the run as a small graph of the ops Dynamo
captured, over (rows, width) tensors. What one slice runs is that graph traced to aten ops
(``torch_compat.trace_aten``: the autograd and autocast of the slice made explicit), cached
per slice shape; the same traced graphs give the memory a slice needs (``workspace_bytes``,
by a liveness walk) and the FLOPs, and on the CPU stand-in they run node by node with every
value reported to the tracker (``workspace.observe``), so planned and measured peaks count
the same tensors.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Optional

import torch
import torch.fx as fx
from torch.utils import flop_counter

from megacompile.core import torch_compat as compat
from megacompile.core import workspace
from megacompile.core.autocast_lists import autocast_lists_for


@dataclasses.dataclass
class ChunkBody:
    """One run: ``graph(*token_inputs, *shared_inputs)`` -> tuple of (rows, width) outputs."""

    graph: fx.GraphModule
    num_token_inputs: int
    out_lead: list  # each output's leading (token) shape in the step's graph
    autocast: Optional[torch.dtype]  # the run's ops ran under torch.autocast(cpu, this dtype)
    ops: list  # the replaced ops' names, for NodeInfo / inspect
    # Whose autocast op lists the run follows ("cuda": core/autocast_lists.py; "cpu": CPU's own).
    autocast_lists: str = "cpu"

    def describe(self) -> str:
        return f"{len(self.ops)} ops ({', '.join(self.ops[:6])}{', ...' if len(self.ops) > 6 else ''})"


_BODIES: dict[str, ChunkBody] = {}
_COUNTER = itertools.count()


def register_body(body: ChunkBody) -> str:
    key = f"run{next(_COUNTER)}"
    _BODIES[key] = body
    return key


def body_of(key: str) -> ChunkBody:
    found = _BODIES.get(key)
    if found is None:
        raise RuntimeError(f"megatrain token_chunked: no run registered as {key!r} in this process (a graph "
                           f"holding the op was saved and loaded elsewhere?); recompile the step")
    return found


def chunk_rows(tokens: int, chunks: int) -> int:
    return max(1, -(-tokens // max(1, chunks)))


def _slices(tokens: int, chunks: int):
    rows = chunk_rows(tokens, chunks)
    for start in range(0, tokens, rows):
        yield start, min(tokens, start + rows)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


@contextlib.contextmanager
def _autocast(body: ChunkBody):
    with autocast_lists_for(body.autocast_lists if body.autocast is not None else "cpu"), \
            torch.autocast("cpu", dtype=body.autocast, enabled=body.autocast is not None):
        yield


# --- the traced slice programs ---------------------------------------------------------
_TRACED: dict[tuple, fx.GraphModule] = {}
_STRUCTURES: dict[str, object] = {}


def _structure(key: str):
    """What the traced slices of run ``key`` depend on: its ops and how they connect, its
    constants, autocast and token-input count. The same layer's runs in every layer of a
    model compare equal here (only Dynamo's value names differ), so their slices are traced
    once. A run holding a tensor constant or a module attribute keeps its own key (a tensor's
    repr may elide its values)."""
    found = _STRUCTURES.get(key)
    if found is None:
        body = body_of(key)
        index: dict[fx.Node, int] = {}
        constants: list = []

        def position(a):
            if isinstance(a, fx.Node):
                return ("node", index[a])
            constants.append(a)
            return a

        rows = []
        for i, node in enumerate(body.graph.graph.nodes):
            index[node] = i
            rows.append((node.op, node.target, repr(fx.node.map_aggregate((node.args, node.kwargs), position))))
        shareable = all(n.op != "get_attr" for n in index) and not any(isinstance(a, torch.Tensor) for a in constants)
        found = (tuple(rows), body.num_token_inputs, body.autocast, body.autocast_lists) if shareable else key
        _STRUCTURES[key] = found
    return found


def _signature(ts) -> tuple:
    return tuple((tuple(int(compat.int_hint(d)) for d in t.shape), t.dtype) for t in ts)


def _forward_fn(body: ChunkBody):
    def forward(tokens, shared):
        with _autocast(body):
            return list(body.graph(*tokens, *shared))
    return forward


def _backward_fn(body: ChunkBody, needs: tuple):
    def backward(tokens, shared, grads):
        inputs = [t.detach().requires_grad_(need) for t, need in zip(list(tokens) + list(shared), needs)]
        # (traced inside the op's kernel, which runs below autograd where an input requires grad)
        with compat.autograd_dispatch(), torch.enable_grad(), _autocast(body):
            outs = body.graph(*inputs)
            # A shared operand shaped (1, 1, C) (Falcon-H1's muP vector) broadcasts a run's output
            # on rows to (1, n, C): its gradient, given in rows, takes the output's shape.
            pairs = [(o, g.reshape(o.shape)) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            wanted = [t for t in inputs if t.requires_grad]
            if wanted and any(g is not None for g in grads) and not pairs:
                raise RuntimeError("megatrain token_chunked_backward: the run's replay recorded no autograd "
                                   "graph; its gradients would be zeros")
            got = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True) \
                if pairs and wanted else [None] * len(wanted)
        return [torch.zeros_like(t) if g is None else g for t, g in zip(wanted, got)]
    return backward


def traced_slice(key: str, kind: str, tokens, shared, grads=(), needs: tuple = ()) -> fx.GraphModule:
    """The aten graph one slice runs (``kind``: "forward" or "backward"), for these shapes."""
    grads = list(grads)
    sig = (_structure(key), kind, _signature(tokens), _signature(shared),
           _signature([g for g in grads if g is not None]), tuple(g is None for g in grads), needs)
    gm = _TRACED.get(sig)
    if gm is None:
        body = body_of(key)
        if kind == "forward":
            gm = compat.trace_aten(_forward_fn(body), [list(tokens), list(shared)])
        else:
            gm = compat.trace_aten(_backward_fn(body, needs), [list(tokens), list(shared), grads])
        gm.graph.eliminate_dead_code()  # (the replayed forward's own outputs are not needed)
        _device_neutral(gm)
        _TRACED[sig] = gm
    return gm


class _Runner(fx.Interpreter):
    """Runs a traced slice on real tensors, reporting every value to the tracker."""

    def __init__(self, gm: fx.GraphModule, device: torch.device) -> None:
        super().__init__(gm)
        self.device = device

    def call_function(self, target, args, kwargs):
        if "device" in kwargs and self.device.type != "cpu":  # traced on host fakes
            kwargs = {**kwargs, "device": self.device}
        return workspace.tracked(super().call_function(target, args, kwargs))


def _device_neutral(gm: fx.GraphModule) -> None:
    """Traced on host fakes, casts and ``*_like`` ops carry ``device=cpu``: dropped, they keep
    their input's device, so the program runs on any device. Factories without a tensor input
    keep theirs (``_Runner`` replaces it)."""
    for node in gm.graph.nodes:
        first = node.args[0] if node.args else None
        if "device" in node.kwargs and isinstance(first, fx.Node):
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "device"}
    gm.recompile()


def _needs_runner(gm: fx.GraphModule) -> bool:
    found = getattr(gm, "_megatrain_factories", None)
    if found is None:
        found = any("device" in n.kwargs for n in gm.graph.nodes)
        gm._megatrain_factories = found
    return found


def _run(gm: fx.GraphModule, device: torch.device, *args):
    if not workspace.observing() and (device.type == "cpu" or not _needs_runner(gm)):
        return gm(*args)  # (its code frees each value after its last use, as _Runner does)
    return _Runner(gm, device).run(*args)


def _slice_rows(ts, start: int, end: int):
    return [t[start:end] for t in ts]


def _grad_slices(grads, start, end):
    return [None if g is None else _rows(g)[start:end] for g in grads]


def _check(key, tokens, chunks) -> int:
    if not tokens:
        raise ValueError("megatrain token_chunked: a run needs at least one token input")
    n = tokens[0].numel() // max(1, tokens[0].shape[-1])
    for t in tokens:
        if t.numel() // max(1, t.shape[-1]) != n:
            raise ValueError(f"megatrain token_chunked({key}): token inputs disagree on the token count: "
                             f"{[tuple(x.shape) for x in tokens]}")
    if chunks < 1:
        raise ValueError(f"megatrain token_chunked({key}): chunks must be >= 1, got {chunks}")
    return n


@torch.library.custom_op("megatrain::token_chunked", mutates_args=())
def token_chunked(body: str, chunks: int, tokens: list[torch.Tensor], shared: list[torch.Tensor]) -> list[torch.Tensor]:
    """The run ``body`` over ``chunks`` slices of the tokens; outputs shaped as in the step."""
    n = _check(body, tokens, chunks)
    run = body_of(body)
    flat = [_rows(t) for t in tokens]
    outs = None
    for start, end in _slices(n, chunks):
        part = _slice_rows(flat, start, end)
        gm = traced_slice(body, "forward", part, shared)
        got = _run(gm, tokens[0].device, part, list(shared))
        if outs is None:
            outs = [workspace.tracked(torch.empty((n, o.shape[-1]), dtype=o.dtype, device=o.device)) for o in got]
        for out, o in zip(outs, got):
            out[start:end] = _rows(o)
        del got
    return [o.view(*lead, o.shape[-1]) for o, lead in zip(outs, run.out_lead)]


def _fake_outputs(body: str, tokens, shared):
    run = body_of(body)
    one = [_rows(t)[:1] for t in tokens]
    with _autocast(run):
        got = run.graph(*one, *shared)
    n = tokens[0].numel() // max(1, tokens[0].shape[-1])
    return [tokens[0].new_empty((n, o.shape[-1]), dtype=o.dtype).view(*lead, o.shape[-1])
            for o, lead in zip(got, run.out_lead)]


@token_chunked.register_fake
def _(body, chunks, tokens, shared):
    return _fake_outputs(body, tokens, shared)


@torch.library.custom_op("megatrain::token_chunked_backward", mutates_args=())
def token_chunked_backward(body: str, chunks: int, tokens: list[torch.Tensor], shared: list[torch.Tensor],
                           grads: list[Optional[torch.Tensor]], needs: list[bool]) -> list[torch.Tensor]:
    """The gradients of the inputs ``needs`` marks (token inputs first), others empty."""
    n = _check(body, tokens, chunks)
    needs = tuple(bool(x) for x in needs)
    flat = [_rows(t) for t in tokens]
    k = len(tokens)
    token_grads = [workspace.tracked(torch.empty(f.shape, dtype=f.dtype, device=f.device)) if need else None
                   for f, need in zip(flat, needs[:k])]
    sums: list = [None] * len(shared)  # weight gradients, summed over slices (fp32 where narrower)
    for start, end in _slices(n, chunks):
        part = _slice_rows(flat, start, end)
        gslice = _grad_slices(grads, start, end)
        gm = traced_slice(body, "backward", part, shared, gslice, needs)
        got = iter(_run(gm, tokens[0].device, part, list(shared), gslice))
        for i, need in enumerate(needs):
            if not need:
                continue
            g = next(got)
            if i < k:
                token_grads[i][start:end] = g
            elif sums[i - k] is None:
                wide = g.dtype in (torch.float32, torch.float64)
                sums[i - k] = g if wide else workspace.tracked(g.float())
            else:
                sums[i - k].add_(g)
            del g
        del got
    def empty():  # one per unneeded gradient: a custom op's returns may not alias one another
        return tokens[0].new_empty((0,))

    result = [empty() if g is None else g.view(tokens[i].shape) for i, g in enumerate(token_grads)]
    for s, t, need in zip(sums, shared, needs[k:]):
        result.append(s.to(t.dtype) if need and s is not None else (torch.zeros_like(t) if need else empty()))
    return result


@token_chunked_backward.register_fake
def _(body, chunks, tokens, shared, grads, needs):
    ins = list(tokens) + list(shared)
    return [torch.empty_like(t, memory_format=torch.contiguous_format) if need else tokens[0].new_empty((0,))
            for t, need in zip(ins, needs)]


def _setup_context(ctx, inputs, output) -> None:
    body, chunks, tokens, shared = inputs
    ctx.save_for_backward(*tokens, *shared)
    ctx.meta = (body, chunks, len(tokens))


def _backward(ctx, grads):
    body, chunks, k = ctx.meta
    saved = ctx.saved_tensors
    tokens, shared = list(saved[:k]), list(saved[k:])
    needs_tokens, needs_shared = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
    # (autograd reports one flag per list argument)
    needs = [bool(needs_tokens)] * k + [bool(needs_shared) and s.requires_grad for s in shared] \
        if isinstance(needs_shared, bool) else list(needs_tokens) + list(needs_shared)
    needs = [need and torch.is_floating_point(t) for need, t in zip(needs, tokens + shared)]
    got = token_chunked_backward(body, chunks, tokens, shared, list(grads), needs)
    token_grads = [g if need else None for g, need in zip(got[:k], needs[:k])]
    shared_grads = [g if need else None for g, need in zip(got[k:], needs[k:])]
    return None, None, token_grads, shared_grads


token_chunked.register_autograd(_backward, setup_context=_setup_context)

FORWARD = torch.ops.megatrain.token_chunked.default
BACKWARD = torch.ops.megatrain.token_chunked_backward.default
OPS = (FORWARD, BACKWARD)
CHUNKS_ARG = 1  # both ops: the chunk count, which the planner sets


def call_tokens(node: fx.Node) -> int:
    """Tokens a call of either op in a graph runs over, at the traced sizes."""
    first = node.args[2][0].meta["val"]
    return int(compat.int_hint(first.numel())) // max(1, int(compat.int_hint(first.shape[-1])))


def set_chunks(node: fx.Node, chunks: int) -> None:
    """The planner's decision: this call runs in ``chunks`` chunks."""
    node.args = (*node.args[:CHUNKS_ARG], int(chunks), *node.args[CHUNKS_ARG + 1:])


# --- memory and FLOPs of one call, from the traced slice programs --------------------------
def _is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _nbytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return int(compat.int_hint(val.numel())) * val.element_size()
    return 0

_PEAK_KEY = "megatrain_slice_peak"


def graph_peak(gm: fx.GraphModule) -> int:
    """Most bytes a traced slice holds at once beyond its inputs: each value from its op to
    the last reader of it or of a view of it (its outputs to the end), as ``_Runner`` frees them.
    Kept on the (cached, never rewritten) slice: the planner asks once per candidate plan."""
    if _PEAK_KEY in gm.meta:
        return gm.meta[_PEAK_KEY]
    nodes = list(gm.graph.nodes)
    base: dict[fx.Node, fx.Node | None] = {}
    for node in nodes:
        if node.op == "placeholder":
            base[node] = None  # the op's inputs: not this slice's bytes
        elif node.op == "call_function":
            first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
            base[node] = base.get(first) if _is_view(node) and first is not None else node
    last: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            b = base.get(arg)
            if b is not None:
                last[b] = max(last.get(b, 0), i)
    live = peak = 0
    frees: dict[int, int] = {}
    for i, node in enumerate(nodes):
        if node.op == "call_function" and base.get(node) is node:
            size = _nbytes(node.meta.get("val"))
            live += size
            peak = max(peak, live)
            frees[last.get(node, i)] = frees.get(last.get(node, i), 0) + size
        live -= frees.pop(i, 0) if node.op != "output" else 0
    gm.meta[_PEAK_KEY] = peak
    return peak


def _graph_flops(gm: fx.GraphModule) -> int:
    total = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        formula = flop_counter.flop_registry.get(getattr(node.target, "overloadpacket", None))
        if formula is None:
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        total += int(formula(*args, **kwargs, out_val=node.meta.get("val")))
    return total


def _slice_inputs(tokens, chunks: int):
    n = compat.int_hint(tokens[0].numel()) // max(1, compat.int_hint(tokens[0].shape[-1]))
    rows = min(n, chunk_rows(n, chunks))
    return n, rows, [torch.empty((rows, compat.int_hint(t.shape[-1])), dtype=t.dtype, device="meta") for t in tokens]


def _as_meta(ts):
    return [None if t is None else torch.empty(tuple(compat.int_hint(d) for d in t.shape), dtype=t.dtype,
                                                device="meta") for t in ts]


_WORKSPACE: dict[tuple, int] = {}


def workspace_bytes(target, body: str, chunks: int, tokens, shared, grads=(), needs=()) -> int:
    """Bytes one call holds beyond its inputs and outputs at its fullest: one slice's
    program, and (backward) the fp32 sums of narrower weights' gradients. Remembered per
    run structure and sizes: the planner asks for every copy of the op in every candidate's
    graphs."""
    key = (target, _structure(body), chunks, _signature(tokens), _signature(shared),
           tuple(None if g is None else _signature([g]) for g in grads), tuple(needs))
    found = _WORKSPACE.get(key)
    if found is None:
        found = _WORKSPACE[key] = _workspace_bytes(target, body, chunks, tokens, shared, grads, needs)
    return found


def _workspace_bytes(target, body: str, chunks: int, tokens, shared, grads, needs) -> int:
    _n, rows, part = _slice_inputs(tokens, chunks)
    shared = _as_meta(shared)
    if target is FORWARD:
        return graph_peak(traced_slice(body, "forward", part, shared))
    gslice = [None if g is None else torch.empty((rows, compat.int_hint(g.shape[-1])), dtype=g.dtype, device="meta")
              for g in grads]
    peak = graph_peak(traced_slice(body, "backward", part, shared, gslice, tuple(needs)))
    k = len(tokens)
    sums = sum(compat.int_hint(s.numel()) * 4 for s, need in zip(shared, needs[k:])
               if need and s.dtype not in (torch.float32, torch.float64))
    return peak + sums


def flops(target, body: str, chunks: int, tokens, shared, grads=(), needs=()) -> int:
    n, rows, part = _slice_inputs(tokens, chunks)
    shared = _as_meta(shared)
    if target is FORWARD:
        gm = traced_slice(body, "forward", part, shared)
    else:
        gslice = [None if g is None else torch.empty((rows, compat.int_hint(g.shape[-1])), dtype=g.dtype,
                                                     device="meta") for g in grads]
        gm = traced_slice(body, "backward", part, shared, gslice, tuple(needs))
    return _graph_flops(gm) * n // max(1, rows)


@flop_counter.register_flop_formula(torch.ops.megatrain.token_chunked, get_raw=True)
def _forward_flops(body, chunks, tokens, shared, *args, out_val=None, **kwargs) -> int:
    return flops(FORWARD, body, chunks, tokens, shared)


@flop_counter.register_flop_formula(torch.ops.megatrain.token_chunked_backward, get_raw=True)
def _backward_flops(body, chunks, tokens, shared, grads, needs, *args, out_val=None, **kwargs) -> int:
    return flops(BACKWARD, body, chunks, tokens, shared, grads, needs)
