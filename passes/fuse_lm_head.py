"""fuse_lm_head: the projection to the vocabulary and its cross-entropy become one chunked op.

Runs on the graph Dynamo captured, before AOTAutograd, so the fused op's own autograd formula
(``megacompile.core.fused_head``) makes the backward, and the (tokens x vocabulary) logits and
their gradient exist nowhere. A mean or sum loss that is differentiated becomes
``lm_head_loss_and_grads``: the loss and its hidden-state, weight and bias gradients, made in one
pass over each chunk's logits (the backward only scales them by the loss's gradient). Otherwise
(a per-token loss, or nothing to differentiate) the joint graph holds ``lm_head_loss`` (the loss
and a per-token log-sum-exp) and ``lm_head_loss_backward`` (which makes each chunk's logits
again and accumulates the gradients chunk by chunk).

Recognised, from the loss back to the projection, each step the only reader of the one before:

- the loss: ``F.cross_entropy`` (class indices, no class weights, no label smoothing), or
  ``F.nll_loss`` / ``aten.nll_loss_forward`` of a ``log_softmax`` over the vocabulary;
  ``ignore_index`` and reduction mean / sum / none are kept;
- between loss and projection, in any order: reshapes, ``flatten`` and ``contiguous`` that keep the
  vocabulary dimension; indexing of the token dimensions (label shifting ``logits[:, :-1]``,
  a mask); an upcast to fp32 (``.float()``); a soft cap ``c * tanh(z / c)`` (Gemma 2);
- the projection: ``F.linear`` (with or without bias) or ``x @ W.T``, with any weight, tied
  to the embedding or not.

Under ``head_chunk_tokens="auto"`` a head whose logits fit in one chunk is left alone (fused,
it would save nothing).

The token indexing and reshapes are applied to the hidden state instead (they commute with a
per-token projection), and the labels are flattened. A candidate loss that is not fused gets
the reason in the Dynamo node's ``meta["custom"]``, which AOTAutograd copies to the aten nodes
it traces from it; ``annotate`` puts it in ``NodeInfo.head_fusion``, so ``inspect`` shows it.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from megacompile.core import fused_head
from megacompile.core.torch_compat import NN_LINEAR, int_hint
from megacompile.core.units import format_bytes
from megacompile.passes.contract import PassContract

CONTRACT = PassContract(name="fuse_lm_head", stages=("dynamo",), provides=frozenset({"lm_head_fused"}),
                        uses=frozenset({"operators_canonical"}))

NOTE_KEY = "megatrain_lm_head"  # in node.meta["custom"] (AOTAutograd copies "custom" to the aten nodes)

_LINEAR = {NN_LINEAR, F.linear}
_MATMUL = {operator.matmul, torch.matmul}
_LOG_SOFTMAX = {F.log_softmax, torch.log_softmax}
_TANH = {torch.tanh}
_RESHAPE_METHODS = {"view", "reshape"}


def _val(node):
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _is(node: fx.Node, functions=(), methods=()) -> bool:
    if node.op == "call_function":
        return node.target in functions
    return node.op == "call_method" and node.target in methods


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


class NotFused(Exception):
    """Why a candidate loss is not fused (shown in NodeInfo.head_fusion)."""


class _Match:
    """A recognised head + loss: what the fused op needs, and the chain it replaces."""

    def __init__(self) -> None:
        self.loss: fx.Node | None = None       # the node whose value is the loss
        self.erase: list[fx.Node] = []         # the replaced nodes, loss first
        self.row_ops: list[fx.Node] = []       # token indexing / reshapes, projection first
        self.softcap = 0.0
        self.log_softmax_seen = False
        self.hidden = self.weight = self.bias = None
        self.labels = None
        self.projection: fx.Node | None = None
        self.rhs: fx.Node | None = None  # the matmul's right operand (x @ rhs)
        self.ignore_index = -100
        self.reduction = "mean"


def _candidates(gm: fx.GraphModule) -> list[fx.Node]:
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in (F.cross_entropy, F.nll_loss):
            found.append(node)
        elif getattr(node.target, "__name__", "") == "nll_loss_forward" or node.target in (
                torch.ops.aten.nll_loss_forward, torch.ops.aten.nll_loss_forward.default):
            found.append(node)
    return found


def _single_reader(node: fx.Node, what: str) -> None:
    if len(node.users) != 1:
        readers = ", ".join(sorted(u.name for u in node.users)) or "nothing"
        raise NotFused(f"the {what} ({node.name}) is also read by {readers}, not only by the loss")


def _match_loss(node: fx.Node, m: _Match) -> fx.Node:
    """Reads the loss's arguments into ``m``; returns the loss's input (logits or log-probs)."""
    if node.target is F.cross_entropy or node.target is F.nll_loss:
        names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
        args = {n: _arg(node, i, n) for i, n in enumerate(names)}
        if node.target is F.cross_entropy and _arg(node, 7, "label_smoothing", 0.0) not in (0, 0.0):
            raise NotFused("label smoothing is not fused")
        if args["weight"] is not None:
            raise NotFused("class weights are not fused")
        if args["size_average"] is not None or args["reduce"] is not None:
            raise NotFused("the deprecated size_average / reduce arguments are not fused")
        m.ignore_index = -100 if args["ignore_index"] is None else args["ignore_index"]
        m.reduction = args["reduction"] if args["reduction"] is not None else "mean"
        m.loss, m.labels = node, args["target"]
        m.log_softmax_seen = node.target is F.nll_loss
        source = args["input"]
    else:  # aten.nll_loss_forward(log_probs, target, weight, reduction, ignore_index) -> (loss, total_weight)
        source, target, weight, reduction, ignore_index = (list(node.args) + [None] * 5)[:5]
        if weight is not None:
            raise NotFused("class weights are not fused")
        takers = list(node.users)
        if any(u.target is not operator.getitem or u.args[1] != 0 for u in takers) or len(takers) != 1:
            raise NotFused("the loss's total weight is read too")
        m.loss, m.labels = takers[0], target
        m.erase.append(node)
        m.reduction = {0: "none", 1: "mean", 2: "sum"}.get(reduction, "?")
        m.ignore_index = ignore_index if ignore_index is not None else -100
        m.log_softmax_seen = True
    if not isinstance(m.ignore_index, int) or m.reduction not in fused_head.REDUCTIONS:
        raise NotFused(f"reduction {m.reduction!r} / ignore_index {m.ignore_index!r} not understood")
    if not isinstance(source, fx.Node) or not isinstance(m.labels, fx.Node):
        raise NotFused("the loss's input or target is not a tensor of this graph")
    logits, labels = _val(source), _val(m.labels)
    if logits is None or labels is None or logits.dim() != 2 or labels.dim() != 1:
        raise NotFused("the loss's input is not (tokens, vocabulary) with one class index per token")
    if labels.is_floating_point():
        raise NotFused("class probabilities as targets are not fused")
    return source


def _row_index_ok(index, ndim: int) -> bool:
    """An index of a logits tensor that selects tokens and leaves the vocabulary dimension whole."""
    if isinstance(index, fx.Node):  # a mask or index tensor over the token dimensions
        val = _val(index)
        return val is not None and val.dim() >= 1 and (val.dim() == 1 or val.dtype == torch.bool) and (
            val.dim() < ndim)
    items = index if isinstance(index, tuple) else (index,)
    if any(i is None or isinstance(i, fx.Node) or not isinstance(i, (int, slice, type(Ellipsis))) for i in items):
        return False
    if Ellipsis in items:
        after = items[items.index(Ellipsis) + 1:]
        return not after or after[-1] == slice(None)
    return len(items) < ndim or items[-1] == slice(None)


def _walk_to_projection(source: fx.Node, vocab: int, m: _Match) -> fx.Node:
    """From the loss's input back to the projection; fills ``m.row_ops`` and ``m.softcap``."""
    cur = source
    while True:
        _single_reader(cur, "logits")
        val = _val(cur)
        if val is None or val.dim() < 1 or val.shape[-1] != vocab:
            raise NotFused(f"{cur.name} does not keep the vocabulary as its last dimension")
        if cur.op == "placeholder":
            raise NotFused(f"the logits are an input of this graph ({cur.name}): a graph break lies between the "
                           f"projection and the loss")
        m.erase.append(cur)
        if _is(cur, _LINEAR):
            return cur
        if _is(cur, _MATMUL):
            return cur
        first = cur.args[0] if cur.args else None
        if _is(cur, _LOG_SOFTMAX, {"log_softmax"}):
            dim = _arg(cur, 1, "dim")
            dtype = _arg(cur, 3 if cur.op == "call_function" else 2, "dtype")
            if m.log_softmax_seen is not True or dim not in (-1, val.dim() - 1) or dtype not in (None, torch.float32):
                raise NotFused("a log_softmax that is not over the vocabulary, or not the loss's")
            m.log_softmax_seen = "used"
        elif _is(cur, (), _RESHAPE_METHODS) or _is(cur, {torch.reshape}):
            shape = cur.args[1:] if cur.op == "call_method" else cur.args[1:]
            if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
                shape = tuple(shape[0])
            if not shape or shape[-1] not in (vocab, -1) or _val(first).shape[-1] != vocab:
                raise NotFused(f"the reshape {cur.name} moves the vocabulary dimension")
            m.row_ops.append(cur)
        elif _is(cur, {torch.flatten}, {"flatten"}):
            if val.dim() < 2 or _val(first).shape[-1] != vocab:
                raise NotFused(f"the flatten {cur.name} takes in the vocabulary dimension")
            m.row_ops.append(cur)
        elif _is(cur, (), {"contiguous"}):
            pass
        elif _is(cur, (), {"float"}) or (_is(cur, (), {"to", "type"}) and all(
                a in (torch.float32,) or isinstance(a, torch.device) or isinstance(a, str)
                for a in list(cur.args[1:]) + list(cur.kwargs.values()))):
            if val.dtype != torch.float32:
                raise NotFused(f"{cur.name} casts the logits to {val.dtype}")
        elif _is(cur, {operator.getitem}):
            if not _row_index_ok(cur.args[1], _val(first).dim()):
                raise NotFused(f"the indexing {cur.name} is not a selection of tokens")
            m.row_ops.append(cur)
        elif _is(cur, {operator.mul, torch.mul}, {"mul"}):
            cap = cur.args[1] if isinstance(first, fx.Node) else first
            inner = first if isinstance(first, fx.Node) else cur.args[1]
            tanh = inner if isinstance(inner, fx.Node) and _is(inner, _TANH, {"tanh"}) else None
            div = tanh.args[0] if tanh is not None else None
            if not (isinstance(cap, (int, float)) and cap > 0 and isinstance(div, fx.Node)
                    and _is(div, {operator.truediv, torch.div}, {"div"}) and div.args[1] == cap) or m.softcap:
                raise NotFused(f"{cur.name} scales the logits (only a soft cap c * tanh(z / c) is fused)")
            for node in (tanh, div):
                _single_reader(node, "logits")
            m.erase += [tanh, div]
            m.softcap = float(cap)
            cur = div
            first = div.args[0]
        else:
            raise NotFused(f"{cur.name} ({getattr(cur.target, '__name__', cur.target)}) between the projection "
                           f"and the loss is not understood")
        if not isinstance(first, fx.Node):
            raise NotFused(f"{cur.name} does not read the logits")
        cur = first


def _match(node: fx.Node) -> _Match:
    m = _Match()
    source = _match_loss(node, m)
    vocab = _val(source).shape[-1]
    if not isinstance(vocab, int):
        raise NotFused("the vocabulary size is symbolic")
    projection = m.projection = _walk_to_projection(source, vocab, m)
    if m.log_softmax_seen is True:
        raise NotFused("nll_loss of something other than a log_softmax of the logits")
    hidden = projection.args[0]
    if _is(projection, _LINEAR):
        weight, bias = _arg(projection, 1, "weight"), _arg(projection, 2, "bias")
    else:
        rhs = projection.args[1]
        weight, bias = _transposed_source(rhs), None
        if weight is not rhs:
            if len(rhs.users) == 1:
                m.erase.append(rhs)
        else:
            weight = None  # made below as rhs.t()
        m.rhs = rhs
    wv, hv = (_val(weight) if weight is not None else None), _val(hidden)
    if weight is None:
        rv = _val(projection.args[1])
        if rv is None or rv.dim() != 2:
            raise NotFused("the projection's right operand is not a (hidden, vocabulary) matrix")
    elif wv is None or wv.dim() != 2 or wv.shape[0] != vocab:
        raise NotFused("the projection's weight is not a (vocabulary, hidden) matrix")
    if hv is None or hv.dim() < 1 or (isinstance(bias, fx.Node) and _val(bias).dim() != 1):
        raise NotFused("the projection's input is not a stack of hidden states")
    m.hidden, m.weight, m.bias = hidden, weight, bias
    m.row_ops.reverse()
    return m


def _transposed_source(rhs: fx.Node) -> fx.Node:
    """``W`` where ``rhs`` is ``W.T`` / ``W.t()`` / ``W.transpose(0, 1)`` of a 2-D ``W``; else ``rhs``."""
    if not isinstance(rhs, fx.Node):
        return rhs
    src = rhs.args[0] if rhs.args else None
    two_d = isinstance(src, fx.Node) and _val(src) is not None and _val(src).dim() == 2
    if not two_d:
        return rhs
    if (rhs.op == "call_function" and rhs.target is getattr and rhs.args[1] in ("T", "mT")) or \
            _is(rhs, {torch.t}, {"t"}) or (_is(rhs, {torch.transpose}, {"transpose"})
                                           and set(rhs.args[1:3]) in ({0, 1}, {-1, -2}, {0, -1}, {-2, 1})) or \
            (_is(rhs, {torch.permute}, {"permute"}) and tuple(rhs.args[1:]) in ((1, 0), ((1, 0),))):
        return src
    return rhs


def _inside_user_autocast(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and "autocast" in getattr(n.target, "__name__", "") for n in gm.graph.nodes)


def _note(node: fx.Node, text: str) -> None:
    node.meta["custom"] = {**node.meta.get("custom", {}), NOTE_KEY: text}


def _apply_row_op(graph: fx.Graph, op: fx.Node, hidden: fx.Node, width: int) -> fx.Node:
    """The same token selection / reshape on the hidden state (the vocabulary dimension -> hidden)."""
    if op.target is operator.getitem:
        return graph.call_function(operator.getitem, (hidden, op.args[1]))
    if _is(op, {torch.flatten}, {"flatten"}):
        return graph.call_function(torch.flatten, (hidden, *op.args[1:]), dict(op.kwargs))
    shape = op.args[1:]
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    return graph.call_function(torch.reshape, (hidden, (*shape[:-1], width)))


def _rewrite(gm: fx.GraphModule, m: _Match, options) -> str:
    graph = gm.graph
    projection = m.projection
    vocab = _val(projection).shape[-1]
    width = _val(m.hidden).shape[-1]
    chunk = options.fused_head_chunk_tokens(vocab)
    tokens = _tokens(_val(projection))
    if options.head_chunk_tokens == "auto" and tokens <= chunk:
        raise NotFused(f"its {tokens} tokens' logits ({format_bytes(tokens * vocab * 4)} in fp32) fit in one chunk "
                       f"of head_chunk_tokens='auto' ({chunk}): fused, it would save no memory (an int "
                       f"head_chunk_tokens fuses it anyway)")
    keep = {k: projection.meta[k] for k in ("nn_module_stack", "source_fn_stack", "stack_trace")
            if k in projection.meta}
    with graph.inserting_before(m.loss):
        hidden = m.hidden
        for op in m.row_ops:
            hidden = _apply_row_op(graph, op, hidden, width)
        if not (m.row_ops and _val(m.row_ops[-1]).dim() == 2):
            hidden = graph.call_function(torch.reshape, (hidden, (-1, width)))
        labels = graph.call_function(torch.reshape, (m.labels, (-1,)))
        weight = m.weight if m.weight is not None else graph.call_function(torch.t, (m.rhs,))
        bias = m.bias
        loss_dtype = _val(m.loss).dtype
        if options.autocast_dtype is not None:
            # What autocast does to the matmul it replaces: both operands (and a bias) cast down.
            hidden = graph.call_method("to", (hidden, options.autocast_dtype))
            weight = graph.call_method("to", (weight, options.autocast_dtype))
            if isinstance(bias, fx.Node):
                bias = graph.call_method("to", (bias, options.autocast_dtype))
        args = (hidden, weight, bias, labels, chunk, m.ignore_index, m.reduction, m.softcap, loss_dtype)
        weight_grad = bool(getattr(_val(m.weight if m.weight is not None else m.rhs), "requires_grad", False))
        with_grads = m.reduction != "none" and (weight_grad or getattr(_val(m.hidden), "requires_grad", False))
        if with_grads:  # a scalar loss that is differentiated: its gradients made with it (one matmul less)
            fused = graph.call_function(fused_head.FORWARD_WITH_GRADS, (*args, weight_grad))
        else:
            fused = graph.call_function(fused_head.FORWARD, args)
        loss = graph.call_function(operator.getitem, (fused, 0))
    for new in (fused, loss):
        new.meta.update(keep)
    loss.meta["example_value"] = m.loss.meta.get("example_value")
    itemsize = torch.tensor([], dtype=options.autocast_dtype or _val(projection).dtype).element_size()
    chunk_bytes = min(chunk, tokens) * vocab * itemsize
    note = (f"fused: {'cross-entropy' if not m.softcap else f'soft-capped ({m.softcap:g}) cross-entropy'} of the "
            f"projection to {vocab} classes, {m.reduction}, ignore_index {m.ignore_index}; {chunk} tokens per "
            f"chunk ({format_bytes(chunk_bytes)} of logits at a time)"
            + ("; its gradients made in the forward, from the same logits" if with_grads else ""))
    _note(fused, note)
    m.loss.replace_all_uses_with(loss)
    for node in [m.loss] + m.erase:
        if not node.users:
            graph.erase_node(node)
    return note


def _tokens(logits_val) -> int:
    """Tokens the projection makes logits for, at the traced example's sizes."""
    return int_hint(logits_val.numel()) // int(logits_val.shape[-1])


def run(gm: fx.GraphModule, ctx) -> None:
    user_autocast = _inside_user_autocast(gm)
    for node in _candidates(gm):
        try:
            if user_autocast:
                raise NotFused("the step runs its own torch.autocast region (use the option precision='bf16')")
            m = _match(node)
            _rewrite(gm, m, ctx.options)
        except NotFused as why:
            _note(node, f"not fused: {why}")
    gm.graph.lint()
    gm.recompile()
